package gpu

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"runtime/trace"
	"time"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/staging"
)

// lane is a CUDA stream and one blocking event per pipeline slot, driven by
// one job at a time from the job's own (locked) thread.
type lane struct {
	stream cuda.Stream
	events []cuda.Event
	// sums is the lane's checksum table (Config.SumsOnDevice), kept with
	// the lane for its next jobs.
	sums devSums
}

// maxIdleLanes bounds the lanes a device keeps for reuse.
const maxIdleLanes = 256

// getLane takes an idle lane of dev or makes one; the calling thread has
// dev's device current.
func (m *Mover) getLane(dev *device) (*lane, error) {
	select {
	case ln := <-dev.idle:
		return ln, nil
	default:
	}
	s, err := m.r.NewStream()
	if err != nil {
		return nil, fmt.Errorf("gpu: %w", err)
	}
	ln := &lane{stream: s}
	for range m.cfg.Depth {
		e, err := m.r.NewBlockingEvent()
		if err != nil {
			m.destroyLane(ln)
			return nil, fmt.Errorf("gpu: %w", err)
		}
		ln.events = append(ln.events, e)
	}
	return ln, nil
}

// putLane keeps a lane whose work is all waited for, or destroys it.
func (m *Mover) putLane(dev *device, ln *lane) {
	select {
	case dev.idle <- ln:
	default:
		m.destroyLane(ln)
	}
}

// destroyIdle destroys dev's idle lanes, on a thread with dev current.
func (m *Mover) destroyIdle(dev *device) error {
	if len(dev.idle) == 0 {
		return nil
	}
	unlock, err := m.r.LockDevice(dev.ordinal)
	if err != nil {
		return fmt.Errorf("gpu: %w", err)
	}
	defer unlock()
	for {
		select {
		case ln := <-dev.idle:
			m.destroyLane(ln)
		default:
			return nil
		}
	}
}

func (m *Mover) destroyLane(ln *lane) {
	for _, e := range ln.events {
		m.r.DestroyEvent(e)
	}
	m.r.DestroyStream(ln.stream)
	ln.sums.free()
}

// await waits for event e: it polls e for up to Config.Poll, then sleeps
// on it (a blocking event). The polls do not yield: a goroutine locked to
// its thread that yields hands its processor over and sleeps until it is
// scheduled again, which cost as much as the wake-up it avoids (the last
// wait of 2 MiB loads: 212–347 µs yielding, 94–113 µs not; RATIONALE).
//
// Most waits find their copies done at the first poll (a buffer is waited
// for only when it is needed again): the clock is read only after a poll
// that finds them running.
func (m *Mover) await(e cuda.Event) error {
	var deadline time.Time
	for m.cfg.Poll > 0 {
		done, err := m.r.Done(e)
		if err != nil || done {
			return err
		}
		now := time.Now()
		if deadline.IsZero() {
			deadline = now.Add(m.cfg.Poll)
		} else if now.After(deadline) {
			break
		}
	}
	return m.r.Wait(e)
}

// copies fills cp with the chunk's copies between the buffer at bufPtr and
// the device.
func copies(cp *cuda.Copies, c *chunk, bufPtr uintptr, h2d bool) {
	cp.Reset()
	lead := uintptr(c.off - c.aoff)
	for _, p := range c.pieces {
		host := bufPtr + lead + uintptr(p.bufOff)
		if h2d {
			cp.Add(p.dev, host, uintptr(p.n))
		} else {
			cp.Add(host, p.dev, uintptr(p.n))
		}
	}
}

// laneRun is one job's copies on its lane: the slots (events) whose
// copies are enqueued and not yet waited for, and whether a CUDA call on
// the lane failed.
type laneRun struct {
	ctx     context.Context // the job's: its waits are execution-trace regions
	m       *Mover
	dev     *device
	ln      *lane
	pending []bool
	// broken: a CUDA call on the lane failed. Its events may not cover
	// the copies enqueued (a failed record) and its stream may carry an
	// error: finish synchronizes the whole stream and destroys the lane,
	// never reused.
	broken bool
	// failed is the first error of a CUDA call on the lane that the job
	// saw before finish (an enqueue, a record, a wait), for the device's
	// fault count.
	failed error
}

// startRun starts a job's run on ln with slots events (at most
// len(ln.events)).
func (m *Mover) startRun(ctx context.Context, dev *device, ln *lane, slots int) *laneRun {
	return &laneRun{ctx: ctx, m: m, dev: dev, ln: ln, pending: make([]bool, slots)}
}

// recorded records slot s's event after copies whose enqueue returned
// eerr, marking the slot pending either way (copies enqueued before a
// failure still run).
func (r *laneRun) recorded(s int, eerr error) error {
	r.pending[s] = true
	rerr := r.m.r.Record(r.ln.events[s], r.ln.stream)
	return r.called(errors.Join(eerr, rerr))
}

// called notes a CUDA call on the lane (an enqueue, a launch, a record, a
// wait) that returned err: a failed one breaks the lane, and the first
// failure is kept for the device's fault count.
func (r *laneRun) called(err error) error {
	if err != nil {
		r.broken = true
		r.failed = cmp.Or(r.failed, err)
	}
	return err
}

// wait retires slot s's copies.
func (r *laneRun) wait(s int) error {
	if !r.pending[s] {
		return nil
	}
	r.pending[s] = false
	defer trace.StartRegion(r.ctx, "gpu: copy wait").End()
	return r.called(r.m.await(r.ln.events[s]))
}

// finish waits for every copy the job enqueued (the whole stream after a
// failure), then gives the lane back, or destroys it if anything failed;
// it returns the waits' errors.
func (r *laneRun) finish() error {
	var errs []error
	for s := range r.pending {
		errs = append(errs, r.wait(s))
	}
	if r.broken {
		errs = append(errs, r.m.r.Sync(r.ln.stream))
	}
	err := errors.Join(errs...)
	if err != nil || r.broken {
		r.m.destroyLane(r.ln)
		if err == nil {
			err = errors.New("gpu: a CUDA call on the job's stream failed")
		}
		r.m.deviceFault(r.dev, errors.Join(r.failed, err))
		return err
	}
	r.m.putLane(r.dev, r.ln)
	return nil
}

// onLane runs job on the calling goroutine's thread, locked with dev
// current, with a lane of dev, while holding the mover open (Close waits
// for the jobs in flight). The job gives the lane back or destroys it
// (laneRun.finish).
func (m *Mover) onLane(dev *device, job func(ln *lane) (int64, error)) (int64, error) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if m.closed {
		return 0, errClosed
	}
	// A device that cannot be made current, or whose stream or events
	// cannot be made, may have a broken context: the job's fault too.
	unlock, err := m.r.LockDevice(dev.ordinal)
	if err != nil {
		err = fmt.Errorf("gpu: %w", err)
		m.deviceFault(dev, err)
		return 0, err
	}
	defer unlock()
	ln, err := m.getLane(dev)
	if err != nil {
		m.deviceFault(dev, err)
		return 0, err
	}
	return job(ln)
}

// runStreamed moves the chunks on the calling goroutine's own thread and a
// lane of its own: each chunk's copies are enqueued right after its read
// (before its write) and waited for (await: polled, then asleep on a
// blocking event) only when its buffer is needed again, so no job waits
// for another's copies.
func (m *Mover) runStreamed(ctx context.Context, f fsys.File, chunks []chunk, dev *device, sums []uint32, write, fused bool, folio int64) (int64, error) {
	return m.onLane(dev, func(ln *lane) (total int64, err error) {
		// Buffers: one, waiting if need be, then as many more up to Depth as
		// are free now (a job holding none always gets one: no deadlock).
		var bufs []int
		i, _, err := m.bufs.take(ctx, true)
		if err != nil {
			m.putLane(dev, ln)
			return 0, err
		}
		bufs = append(bufs, i)
		for len(bufs) < m.cfg.Depth && len(bufs) < len(chunks) {
			i, ok, _ := m.bufs.take(ctx, false)
			if !ok {
				break
			}
			bufs = append(bufs, i)
		}
		d := len(bufs)
		run := m.startRun(ctx, dev, ln, d)
		cpuSums, onDevice := m.sumsWhere(dev, ln, chunks, sums)
		defer func() {
			werr := run.finish()
			for _, b := range bufs { // every copy that could touch them is done
				m.bufs.put(b)
			}
			if err == nil && werr != nil {
				total, err = 0, werr
			}
			if err == nil {
				m.countSums(chunks, sums, onDevice)
			}
		}()
		wait := run.wait
		y := staging.Yielder{Every: m.cfg.YieldBytes, Yield: m.yieldHook}
		if onDevice {
			// The CPU reads no byte for checksums: a store's writes go
			// unfused.
			fused = fused && !write
		}
		var cp cuda.Copies
		// enqueue enqueues chunk k's copies, then (sum) the checksum
		// kernel, and records the slot's event after them.
		enqueue := func(k int, h2d, sum bool) error {
			s := k % d
			_, ptr := m.buf(bufs[s])
			copies(&cp, &chunks[k], ptr, h2d)
			var eerr error
			if dev.kernel != nil && cuda.KernelCopyable(&cp, m.tableEntries) {
				// The buffer's table, like the buffer, is rewritten only
				// after the slot's event says the last launch completed.
				eerr = dev.kernel.Launch(&cp, m.table(bufs[s]), ln.stream)
			} else {
				eerr = m.r.Enqueue(&cp, h2d, m.fallback, ln.stream)
			}
			if eerr == nil && sum {
				eerr = ln.sums.launch(dev, ln)
			}
			return run.recorded(s, eerr)
		}
		if write && onDevice {
			// Before the gathers, on the same stream: the kernel reads
			// the bytes the store takes, and is done by chunk 0's event.
			if err := run.called(ln.sums.launch(dev, ln)); err != nil {
				return 0, err
			}
		}
		if write { // prime: the first d gathers in flight before any write
			for k := range min(d, len(chunks)) {
				if err := enqueue(k, false, false); err != nil {
					return 0, err
				}
			}
		}
		for k := range chunks {
			if err := ctx.Err(); err != nil {
				return 0, err
			}
			s := k % d
			if err := wait(s); err != nil { // chunk k gathered (store), buffer free (load)
				return 0, err
			}
			st := &stage{c: &chunks[k], buf: bufs[s]}
			if write {
				if err := m.writeChunk(f, st, cpuSums, fused, folio, &y); err != nil {
					return 0, err
				}
				if k+d < len(chunks) {
					if err := enqueue(k+d, false, false); err != nil {
						return 0, err
					}
				}
			} else {
				if err := m.readChunk(f, st, cpuSums, fused, &y); err != nil {
					return 0, err
				}
				// After the last chunk's copies, the kernel reads every
				// byte the load delivered.
				if err := enqueue(k, true, onDevice && k == len(chunks)-1); err != nil {
					return 0, err
				}
			}
			total += chunks[k].end - chunks[k].off
		}
		if onDevice {
			if err := wait((len(chunks) - 1) % d); err != nil {
				return 0, err
			}
			ln.sums.fold(sums)
		}
		return total, nil // the deferred waits report the last copies' errors
	})
}
