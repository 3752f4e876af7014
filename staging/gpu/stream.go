package gpu

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvhost/kvhost/internal/cuda"
	"github.com/kvhost/kvhost/internal/fsys"
)

// lane is a CUDA stream and one blocking event per pipeline slot, driven by
// one job at a time from the job's own (locked) thread.
type lane struct {
	stream cuda.Stream
	events []cuda.Event
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

// runStreamed moves the chunks on the calling goroutine's own thread and a
// lane of its own: each chunk's copies are enqueued right after its read
// (before its write) and waited for (await: polled, then asleep on a
// blocking event) only when its buffer is needed again, so no job waits
// for another's copies.
func (m *Mover) runStreamed(ctx context.Context, f fsys.File, chunks []chunk, dev *device, sums []uint32, write, fused bool) (total int64, err error) {
	m.mu.RLock() // Close waits for the jobs in flight
	defer m.mu.RUnlock()
	if m.closed {
		return 0, ErrClosed
	}
	unlock, err := m.r.LockDevice(dev.ordinal)
	if err != nil {
		return 0, fmt.Errorf("gpu: %w", err)
	}
	defer unlock()
	ln, err := m.getLane(dev)
	if err != nil {
		return 0, err
	}
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
	pending := make([]bool, d)
	// broken: a CUDA call on the lane failed. Its events may not cover
	// the copies enqueued (a failed record) and its stream may carry an
	// error: before the buffers go back the whole stream is synchronized,
	// and the lane is destroyed, never reused.
	broken := false
	// wait retires slot s's copies.
	wait := func(s int) error {
		if !pending[s] {
			return nil
		}
		pending[s] = false
		if err := m.await(ln.events[s]); err != nil {
			broken = true
			return err
		}
		return nil
	}
	defer func() {
		var errs []error
		for s := range d {
			errs = append(errs, wait(s))
		}
		if broken {
			errs = append(errs, m.r.Sync(ln.stream))
		}
		for _, b := range bufs {
			m.bufs.put(b)
		}
		if werr := errors.Join(errs...); werr != nil || broken {
			m.destroyLane(ln)
			if err == nil {
				total, err = 0, werr
			}
			return
		}
		m.putLane(dev, ln)
	}()
	var cp cuda.Copies
	enqueue := func(k int, h2d bool) error {
		s := k % d
		_, ptr := m.buf(bufs[s])
		copies(&cp, &chunks[k], ptr, h2d)
		// Copies enqueued before a failure still run: the slot is pending
		// either way, and a broken lane is synchronized whole.
		pending[s] = true
		var eerr error
		if dev.kernel != nil && cuda.KernelCopyable(&cp, m.tableEntries) {
			// The buffer's table, like the buffer, is rewritten only
			// after the slot's event says the last launch completed.
			eerr = dev.kernel.Launch(&cp, m.table(bufs[s]), ln.stream)
		} else {
			eerr = m.r.Enqueue(&cp, h2d, m.fallback, ln.stream)
		}
		rerr := m.r.Record(ln.events[s], ln.stream)
		if eerr != nil || rerr != nil {
			broken = true
		}
		return errors.Join(eerr, rerr)
	}
	if write { // prime: the first d gathers in flight before any write
		for k := range min(d, len(chunks)) {
			if err := enqueue(k, false); err != nil {
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
			if err := m.writeChunk(f, st, sums, fused); err != nil {
				return 0, err
			}
			if k+d < len(chunks) {
				if err := enqueue(k+d, false); err != nil {
					return 0, err
				}
			}
		} else {
			if err := m.readChunk(f, st, sums, fused); err != nil {
				return 0, err
			}
			if err := enqueue(k, true); err != nil {
				return 0, err
			}
		}
		total += chunks[k].end - chunks[k].off
	}
	return total, nil // the deferred waits report the last copies' errors
}
