package cuda

import "time"

// PinnedCopyTimes measures the ceiling of host ↔ GPU copies on w's device:
// the best of passes copies of n bytes from pinned host memory to device
// memory (h2d) and back (d2h), each synchronized on w's stream. It
// allocates both buffers and frees them before returning. Call it from a
// function w runs (Worker.Do), so that the device is w's.
func (w *Worker) PinnedCopyTimes(n, passes int) (h2d, d2h time.Duration, err error) {
	r := w.Runtime()
	h, err := r.HostAlloc(n)
	if err != nil {
		return 0, 0, err
	}
	defer h.Free()
	d, err := r.Malloc(w.Ordinal(), int64(n))
	if err != nil {
		return 0, 0, err
	}
	defer d.Close()
	best := func(copy func() error) (time.Duration, error) {
		b := time.Duration(1 << 62)
		for range max(1, passes) {
			start := time.Now()
			err := copy()
			if err == nil {
				err = r.Sync(w.Stream())
			}
			if err != nil {
				return 0, err
			}
			b = min(b, time.Since(start))
		}
		return b, nil
	}
	if h2d, err = best(func() error { return r.CopyH2D(d.Ptr(), h.Ptr(), uintptr(n), w.Stream()) }); err != nil {
		return 0, 0, err
	}
	d2h, err = best(func() error { return r.CopyD2H(h.Ptr(), d.Ptr(), uintptr(n), w.Stream()) })
	return h2d, d2h, err
}
