package gds

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Errors of the batch path.
var (
	// errBatchEntry: an entry of a batch completed as failed, invalid,
	// canceled or timed out. Errors wrap it with the entry's cuFile status
	// or errno where the library gave one.
	errBatchEntry = errors.New("gds: batch entry failed")
	// errBatchTimeout: a batch's entries did not all complete within
	// MoverConfig.BatchTimeout; the batch was canceled, and the job
	// failed once every entry had come back.
	errBatchTimeout = errors.New("gds: batch timed out")
)

// batchStats counts a driver's batch I/O.
type batchStats struct {
	SetUps    uint64 // batch contexts set up (cuFileBatchIOSetUp)
	Batches   uint64 // batches submitted
	Entries   uint64 // entries submitted
	Short     uint64 // entries that moved less than asked (finished per call)
	Abandoned uint64 // batches canceled: context done, timeout, status error
	// Stuck counts abandoned batches whose entries did not all come back
	// within the drain after cuFileBatchIOCancel (5 s, or BatchTimeout):
	// the library may still move bytes into the job's memory, so each
	// held its job, and with it the job's memory, file handle and batch
	// context, until they did, and counted as a fault of its device
	// (Mover.DeviceFaults).
	Stuck uint64
	// Refusals counts mounts whose batches the library refused (e.g.
	// CU_FILE_BATCH_NOCOMPAT_ERROR in compat mode); Fallbacks counts what
	// went per call instead: every later job that would have batched
	// there, and each batch that met the refusal.
	Refusals, Fallbacks uint64
}

// batchCounters are a driver's batchStats, updated atomically.
type batchCounters struct {
	setUps, batches, entries, short, abandoned, stuck, refusals, fallbacks atomic.Uint64
}

// batchPoll is the longest one cuFileBatchIOGetStatus call waits, so that
// a canceled context or the batch timeout is noticed soon.
const batchPoll = 5 * time.Millisecond

// useBatch says whether a job on a mount of capability c goes in batches;
// a job that would, on a mount that refused batches, is counted as a
// fallback.
func (m *Mover) useBatch(c Capability) bool {
	if !m.wantBatch(c) {
		return false
	}
	if c.batch == batchStateRefused {
		m.d.batch.fallbacks.Add(1)
		return false
	}
	return true
}

// wantBatch says whether the mover's IO mode batches on a mount of
// capability c, as the job's file meets it (Capability.forFile), refusals
// aside.
func (m *Mover) wantBatch(c Capability) bool {
	if !m.d.props.BatchAPI {
		return false
	}
	switch m.cfg.IO {
	case IOBatch:
		return true
	case IOAuto:
		switch c.Mode {
		case ModeDirect:
			return m.d.props.FeatureFlags&featureBatchIO != 0
		case ModeCompat:
			return autoBatchCompat
		}
	}
	return false
}

// chunks splits pieces into runs of at most size entries on one device,
// of nearly equal length (130 pieces at 128 are two batches of 65).
func chunks(pcs []piece, size int) [][]piece {
	var out [][]piece
	for len(pcs) > 0 {
		same := 1
		for same < len(pcs) && pcs[same].ordinal == pcs[0].ordinal {
			same++
		}
		run := pcs[:same]
		n := (len(run) + size - 1) / size
		for i := range n {
			out = append(out, run[i*len(run)/n:(i+1)*len(run)/n])
		}
		pcs = pcs[same:]
	}
	return out
}

// batchRefused says whether err is the library declining batch I/O as
// such (nothing was submitted), not an I/O failure: per-call I/O may
// then serve the same entries.
func batchRefused(err error) bool {
	for _, st := range []Status{statusBatchNoCompatError, statusAsyncNotSupported, statusPlatformNotSupported,
		statusIONotSupported, statusDriverNotInitialized} {
		if errors.Is(err, st) {
			return true
		}
	}
	return errors.Is(err, ErrUnavailable)
}

// batchContext returns the worker's batch context for its current
// device, setting one up on the worker's thread the first time (and after
// one was dropped).
func (w *worker) batchContext() (batchCtx, error) {
	if b := w.batches[w.bound]; b != nil {
		return b, nil
	}
	b, err := w.m.d.api.batchSetUp(w.m.batchSize)
	if err != nil {
		return nil, err
	}
	w.m.d.batch.setUps.Add(1)
	w.batches[w.bound] = b
	if n := w.m.batchSize; len(w.events) < n {
		w.ios, w.events, w.done = make([]batchIO, 0, n), make([]batchEvent, n), make([]bool, n)
	}
	return b, nil
}

// dropBatch destroys the worker's batch context for its current device.
func (w *worker) dropBatch() {
	if b := w.batches[w.bound]; b != nil {
		b.destroy()
		delete(w.batches, w.bound)
	}
}

// closeBatches destroys every batch context of the worker, each on a
// thread bound to its device.
func (w *worker) closeBatches() {
	bind := w.m.d.cfg.BindDevice
	for ordinal, b := range w.batches {
		if ordinal != w.bound && bind != nil {
			if err := bind(ordinal); err != nil {
				w.m.d.log.Warn("cufile: cannot bind device to destroy a batch context", "device", ordinal, "err", err)
			}
			w.bound = ordinal
		}
		b.destroy()
	}
	clear(w.batches)
}

// abandonDrain bounds how long the outstanding entries of an abandoned
// batch are collected after cuFileBatchIOCancel (or BatchTimeout, if
// shorter) before the batch is declared stuck.
const abandonDrain = 5 * time.Second

// stuckPoll is the longest one cuFileBatchIOGetStatus call of a stuck
// batch waits, and the pause after one that failed.
const stuckPoll = 100 * time.Millisecond

// abandon cancels the worker's batch after err, with remaining of its
// entries outstanding (those not done), and returns err once every entry
// has come back (complete, failed or canceled): until then the library
// may still read the entries or move bytes into the job's memory through
// the job's handle, so the job must not end — its caller would release
// that memory and the handle. An event that brings no outstanding entry
// back (backEvent) is not counted. Then the context is destroyed (its
// state is unknown; the next batch sets up a new one).
//
// Entries still out after abandonDrain (or BatchTimeout) make the batch
// stuck: counted (batchStats.Stuck), counted as a fault of the device
// (Mover.DeviceFaults, which makes the daemon unready) and logged at error
// level, and the worker goes on collecting them, without a bound, holding
// the job. If they come back, the job's error says after how long.
func (w *worker) abandon(b batchCtx, done []bool, remaining int, err error) error {
	m := w.m
	m.d.batch.abandoned.Add(1)
	if cerr := b.cancel(); cerr != nil {
		err = fmt.Errorf("%w (cuFileBatchIOCancel: %w)", err, cerr)
	}
	start := time.Now()
	deadline := start.Add(min(abandonDrain, m.cfg.BatchTimeout))
	stuck := false
	var serr error // the last cuFileBatchIOGetStatus error
	for remaining > 0 {
		wait := min(batchPoll, time.Until(deadline))
		if !stuck && wait <= 0 {
			stuck = true
			m.d.batch.stuck.Add(1)
			m.batchStuck(w.bound, remaining, err, serr)
		}
		if stuck {
			wait = stuckPoll
		}
		n, e := b.status(1, w.events[:remaining], wait)
		if e != nil {
			// Nothing is known of the entries: they may still be
			// out. Ask again after a pause.
			serr = e
			time.Sleep(wait)
			continue
		}
		for _, ev := range w.events[:n] {
			if i, e := backEvent(ev, done); e == nil {
				done[i] = true
				remaining--
			}
		}
	}
	w.dropBatch()
	if stuck {
		return fmt.Errorf("%w; its entries came back %v after cuFileBatchIOCancel, and the job was held until then",
			err, time.Since(start).Round(time.Millisecond))
	}
	return err
}

// runBatch moves pcs (at most the batch size) as one batch on the
// worker's context and waits for every entry. An entry that moved less
// than asked is finished with per-call I/O (which fails a read past the
// end of the file with transfer.ErrShortFile, as the per-call path
// does); a failed entry fails the job. If the library refuses batches,
// the mount is marked so (logged once, counted) and the pieces go per
// call. It returns the bytes moved.
func (w *worker) runBatch(ctx context.Context, h *handle, dev uint64, pcs []piece, write bool) (int64, error) {
	m := w.m
	if m.d.caps.get(dev).batch == batchStateRefused {
		m.d.batch.fallbacks.Add(1)
		return w.perCall(h, pcs, write)
	}
	b, err := w.batchContext()
	if err != nil {
		if batchRefused(err) {
			m.d.caps.refuseBatch(dev, fmt.Errorf("cuFileBatchIOSetUp: %w", err))
			return w.perCall(h, pcs, write)
		}
		return 0, fmt.Errorf("gds: cuFileBatchIOSetUp(%d): %w", m.batchSize, err)
	}
	ios := w.ios[:0]
	for i, pc := range pcs {
		ios = append(ios, batchIO{h: h.h, base: pc.base, bufOff: pc.bufOff, fileOff: pc.fileOff, n: pc.n, write: write, cookie: uintptr(i)})
	}
	w.ios = ios
	if err := m.d.inflight.acquire(ctx, len(ios)); err != nil {
		return 0, err
	}
	defer m.d.inflight.release(len(ios))
	if err := b.submit(ios); err != nil {
		if batchRefused(err) {
			m.d.caps.refuseBatch(dev, fmt.Errorf("cuFileBatchIOSubmit: %w", err))
			return w.perCall(h, pcs, write)
		}
		// The context's state is unknown: the next batch sets up a
		// fresh one.
		w.dropBatch()
		return 0, fmt.Errorf("gds: cuFileBatchIOSubmit of %d entries: %w", len(ios), err)
	}
	m.d.batch.batches.Add(1)
	m.d.batch.entries.Add(uint64(len(ios)))

	done := w.done[:len(pcs)]
	clear(done)
	var (
		moved     int64
		first     error
		remaining = len(pcs)
		rest      []piece // what short entries left, and entries refused one by one
		refused   error
		deadline  = time.Now().Add(m.cfg.BatchTimeout)
	)
	for remaining > 0 {
		if err := ctx.Err(); err != nil {
			return moved, w.abandon(b, done, remaining, fmt.Errorf("gds: batch with %d of %d entries outstanding: %w", remaining, len(pcs), err))
		}
		wait := min(batchPoll, time.Until(deadline))
		if wait <= 0 {
			return moved, w.abandon(b, done, remaining, fmt.Errorf("%w: %d of %d entries outstanding after %v", errBatchTimeout, remaining, len(pcs), m.cfg.BatchTimeout))
		}
		ev := w.events[:remaining]
		n, err := b.status(remaining, ev, wait)
		if err != nil {
			return moved, w.abandon(b, done, remaining, fmt.Errorf("gds: cuFileBatchIOGetStatus: %w", err))
		}
		// An event that brings no entry back (backEvent) abandons the
		// batch, but only once the call's other events are counted:
		// abandon waits for the entries still out.
		var odd error
		for _, e := range ev[:n] {
			i, err := backEvent(e, done)
			if err != nil {
				if odd == nil {
					odd = fmt.Errorf("gds: cuFileBatchIOGetStatus: %w", err)
				}
				continue
			}
			done[i] = true
			remaining--
			pc := pcs[i]
			switch {
			case e.status == batchComplete && e.ret == pc.n:
				moved += pc.n
			case e.status == batchComplete && e.ret >= 0 && e.ret < pc.n:
				m.d.batch.short.Add(1)
				moved += e.ret
				r := pc
				r.bufOff, r.fileOff, r.n = pc.bufOff+e.ret, pc.fileOff+e.ret, pc.n-e.ret
				rest = append(rest, r)
			default:
				eerr := entryError(e, pc)
				if e.status != batchComplete && batchRefused(eerr) {
					// The library took the batch but declined this
					// entry as such: nothing of it moved.
					refused = eerr
					rest = append(rest, pc)
				} else if first == nil {
					first = fmt.Errorf("gds: %s: %w", pieceName(pc, write), eerr)
				}
			}
		}
		if odd != nil {
			return moved, w.abandon(b, done, remaining, odd)
		}
	}
	if first != nil {
		return moved, first
	}
	if refused != nil {
		m.d.caps.refuseBatch(dev, fmt.Errorf("batch entry: %w", refused))
	}
	n, err := w.perCall(h, rest, write)
	return moved + n, err
}

// backEvent returns the index of the entry that event e reports back,
// or an error if it reports none back: a cookie the batch does not have,
// an entry already back (done), or a state that is not final
// (cuFileBatchIOGetStatus reports completions; an entry waiting or
// pending is still the library's).
func backEvent(e batchEvent, done []bool) (int, error) {
	switch {
	case e.cookie >= uintptr(len(done)):
		return 0, fmt.Errorf("event for unknown entry %d", e.cookie)
	case done[e.cookie]:
		return 0, fmt.Errorf("second event for entry %d", e.cookie)
	case !e.status.final():
		return 0, fmt.Errorf("event for entry %d in state %s", e.cookie, e.status)
	}
	return int(e.cookie), nil
}

// perCall moves pcs one call each on this worker.
func (w *worker) perCall(h *handle, pcs []piece, write bool) (int64, error) {
	if len(pcs) == 0 {
		return 0, nil
	}
	var moved int64
	for _, pc := range pcs {
		n, err := w.m.ioPiece(h, pc, write)
		moved += n
		if err != nil {
			return moved, err
		}
	}
	return moved, nil
}

// pieceName names a piece in errors: "batch cuFileRead of 65536 bytes at
// file offset 4096".
func pieceName(pc piece, write bool) string {
	op := "cuFileRead"
	if write {
		op = "cuFileWrite"
	}
	return fmt.Sprintf("batch %s of %d bytes at file offset %d", op, pc.n, pc.fileOff)
}

// entryError is the error of an entry that did not complete: its state,
// and the cuFile status (-ret above 5000) or errno (other negative ret)
// the library gave.
func entryError(e batchEvent, pc piece) error {
	var cause error
	switch {
	case e.ret < -5000:
		cause = Status(-e.ret)
	case e.ret < 0:
		cause = syscall.Errno(-e.ret)
	}
	switch {
	case cause != nil:
		return fmt.Errorf("%w: %s: %w", errBatchEntry, e.status, cause)
	case e.status == batchComplete:
		return fmt.Errorf("%w: %s with %d bytes of %d", errBatchEntry, e.status, e.ret, pc.n)
	}
	return fmt.Errorf("%w: %s", errBatchEntry, e.status)
}

// batchEntries is the driver's bound on batch entries in flight: the
// configured one, else cuFile's bounce buffer count, else 128.
func batchEntries(configured int, p Properties) int {
	switch {
	case configured > 0:
		return configured
	case p.MaxDeviceCache > 0 && p.PerBufferCache > 0 && p.MaxDeviceCache/p.PerBufferCache > 0:
		return int(p.MaxDeviceCache / p.PerBufferCache)
	}
	return 128
}

// entryBudget is a weighted semaphore over batch entries in flight, first
// come first served, so that a large batch is not starved by small ones.
type entryBudget struct {
	size int

	mu      sync.Mutex
	free    int
	waiters list.List // of *budgetWaiter
}

type budgetWaiter struct {
	n     int
	ready chan struct{}
}

func newEntryBudget(size int) *entryBudget {
	return &entryBudget{size: size, free: size}
}

// acquire takes n entries (at most the budget's size), waiting for room
// until ctx is done.
func (b *entryBudget) acquire(ctx context.Context, n int) error {
	if n > b.size {
		return fmt.Errorf("gds: batch of %d entries exceeds the %d in flight allowed", n, b.size)
	}
	b.mu.Lock()
	if b.waiters.Len() == 0 && b.free >= n {
		b.free -= n
		b.mu.Unlock()
		return nil
	}
	w := &budgetWaiter{n: n, ready: make(chan struct{})}
	e := b.waiters.PushBack(w)
	b.mu.Unlock()
	select {
	case <-w.ready:
		return nil
	case <-ctx.Done():
		b.mu.Lock()
		select {
		case <-w.ready:
			// Granted meanwhile: give it back.
			b.free += n
		default:
			b.waiters.Remove(e)
		}
		b.grantLocked()
		b.mu.Unlock()
		return fmt.Errorf("gds: waiting for room for a batch of %d entries: %w", n, ctx.Err())
	}
}

// release returns n entries.
func (b *entryBudget) release(n int) {
	b.mu.Lock()
	b.free += n
	b.grantLocked()
	b.mu.Unlock()
}

// grantLocked wakes waiters in order while the first one fits.
func (b *entryBudget) grantLocked() {
	for e := b.waiters.Front(); e != nil; e = b.waiters.Front() {
		w := e.Value.(*budgetWaiter)
		if w.n > b.free {
			return
		}
		b.free -= w.n
		b.waiters.Remove(e)
		close(w.ready)
	}
}
