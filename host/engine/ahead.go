package engine

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/transfer"
)

// Spare files made ahead of stores (Mount.Preallocate; docs/engine.md,
// "Spare files made ahead").
//
// Spares (spares.go) come from evictions, so only a full cache has them:
// a cache with room writes every store into a fresh file, whose pages the
// kernel allocates and zeroes during the store, and whose pages the GPU
// path has not registered (it registers a file after its first job). On a
// mount with Preallocate set, a background goroutine makes spares ahead
// of demand instead: after a namespace's declaration or a store, while no
// file is in flight on the engine, it creates files of the size the
// stores write (wantSpares: the last file of a whole group of keys; until
// a store, such a file of the namespace declared first:
// predictSparesLocked), allocates their pages (fallocate) and tells the movers (transfer.Preparer: the GPU path
// registers them), until Preallocate bytes of spares of that size exist
// or the spares would take the mount past its low watermark. The next
// stores of that size then write into pages that exist and are registered,
// as stores into a full cache do. A made spare is a spare like any other:
// free space that holds pages, removed when a reservation needs the room
// (reserve) and at Close.
//
// The maker runs only once no file has been in flight for aheadQuiet, so
// that it takes no memory bandwidth from a burst of jobs (a client's next
// job follows its last within microseconds to milliseconds); it makes one
// file at a time, and checks again before the next. Spares made ahead of
// one size count against Preallocate until stores take them; when stores
// change size and the made spares of the old size fill the budget, the
// maker removes those first.

// aheadQuiet is how long no file must have been in flight before the
// maker makes a spare: longer than the gaps between a burst's jobs,
// shorter than the idle moments between an inference server's bursts.
const aheadQuiet = 20 * time.Millisecond

// spareMaker is the goroutine that makes spares ahead of stores.
type spareMaker struct {
	wake chan struct{} // a token: there may be work (a declaration, a store, room freed)
	idle chan struct{} // a token: the last file in flight ended
	stop chan struct{}
	done chan struct{}
	// lastEnd is when the last file in flight ended (UnixNano); quietFor
	// is aheadQuiet (a field for tests).
	lastEnd  atomic.Int64
	quietFor atomic.Int64
	// quiet is closed while the maker has nothing to do (WaitSpares);
	// guarded by Engine.mu, replaced by an open channel when work
	// appears.
	quiet chan struct{}
	// waitedIdle counts the times it began to wait for the files in
	// flight (tests wait for it).
	waitedIdle atomic.Int64
}

// startSpareMaker starts the maker if a mount makes spares ahead.
func (e *Engine) startSpareMaker() {
	for _, m := range e.mounts {
		if m.ahead > 0 && e.spareEligible(m) {
			quiet := make(chan struct{})
			close(quiet)
			mk := &spareMaker{
				wake: make(chan struct{}, 1), idle: make(chan struct{}, 1),
				stop: make(chan struct{}), done: make(chan struct{}), quiet: quiet,
			}
			mk.quietFor.Store(int64(aheadQuiet))
			e.maker = mk
			go e.makeSpares()
			return
		}
	}
}

// stopSpareMaker stops the maker and waits for the file it is making.
func (e *Engine) stopSpareMaker() {
	if e.maker == nil {
		return
	}
	close(e.maker.stop)
	<-e.maker.done
}

// sizeSource is what set the size a mount makes spares ahead in.
type sizeSource uint8

const (
	sizeUnknown sizeSource = iota
	sizeGuessed            // a declaration (predictSparesLocked)
	sizePartial            // a stored file of fewer keys than a group
	sizeWhole              // a stored file of a whole group of keys
)

// wantSpares records that a store on m writes a file of size bytes, and
// wakes the maker if m should have more spares. Spares are made in the
// size of the last file that held a whole group of the namespace's keys
// (full): a job's last file may hold fewer, and following it would make
// spares of a size few stores write (and remove those of the size most
// do). Until such a file is stored, files of fewer keys set it, over a
// declaration's guess too (a client whose jobs all hold fewer keys than
// a group writes only such files), but only ever upwards: jobs of
// varying length would otherwise have the maker remove and remake the
// whole budget in every idle moment.
func (e *Engine) wantSpares(m *mount, size int64, full bool) {
	if e.maker == nil || m.ahead <= 0 || !e.spareEligible(m) {
		return
	}
	e.mu.Lock() // once per store: the size and the check together
	switch {
	case full:
		m.aheadSize, m.aheadFrom = size, sizeWhole
	case m.aheadFrom < sizePartial || m.aheadFrom == sizePartial && size > m.aheadSize:
		m.aheadSize, m.aheadFrom = size, sizePartial
	}
	work := e.spareWorkLocked()
	e.mu.Unlock()
	e.wakeMaker(work)
}

// predictSparesLocked guesses the size of the files a newly declared
// namespace's stores will write, a file holding a whole group of its keys
// (wholeFileLen), for the mount that makes spares ahead, where that mount
// knows no size yet, and reports whether the maker then has work. Declare
// calls it for a namespace in kvhost's layout, so that the spares are
// made in the idle moment between a client's start and its first stores
// rather than after them. It guesses only where one kvhost mount makes
// spares ahead: with several, which of them the policy will place files
// on is not known before it does, and spares on a mount no store reaches
// would hold its memory for nothing. Any store's size replaces the guess
// (wantSpares). The caller holds e.mu.
func (e *Engine) predictSparesLocked(ns *namespace) bool {
	if e.maker == nil || ns.layout != nil {
		return false
	}
	var only *mount
	for _, m := range e.mounts {
		if m.ahead > 0 && e.spareEligible(m) {
			if only != nil {
				return false
			}
			only = m
		}
	}
	if only == nil || only.aheadFrom != sizeUnknown {
		return false
	}
	only.aheadSize, only.aheadFrom = ns.wholeFileLen(), sizeGuessed
	return e.spareWorkLocked()
}

// spareRoom wakes the maker if it has work (a delete or a move freed
// room), and marks it busy for WaitSpares.
func (e *Engine) spareRoom() {
	if e.maker == nil {
		return
	}
	e.mu.Lock()
	work := e.spareWorkLocked()
	e.mu.Unlock()
	e.wakeMaker(work)
}

// spareWorkLocked reports whether the maker has work, and if so marks it
// busy for WaitSpares.
func (e *Engine) spareWorkLocked() bool {
	if m, _ := e.nextSpareLocked(); m == nil {
		return false
	}
	select {
	case <-e.maker.quiet:
		e.maker.quiet = make(chan struct{})
	default:
	}
	return true
}

// wakeMaker wakes the maker if work says it has some.
func (e *Engine) wakeMaker(work bool) {
	if !work {
		return
	}
	select {
	case e.maker.wake <- struct{}{}:
	default:
	}
}

// filesInFlight reports whether a file is in flight: a store's or a
// load's (a slot of e.files), or a copy between mounts.
func (e *Engine) filesInFlight() bool { return len(e.files) > 0 || e.moving.Load() > 0 }

// fileEnded is called after a file in flight released its slot, and
// after a copy between mounts ended.
func (e *Engine) fileEnded() {
	mk := e.maker
	if mk == nil {
		return
	}
	mk.lastEnd.Store(time.Now().UnixNano())
	if !e.filesInFlight() {
		select {
		case mk.idle <- struct{}{}:
		default:
		}
	}
}

// nextSpareLocked returns the mount whose spares the maker should work
// on, or nil, and a made spare of another size to remove first (no path:
// make one of m.aheadSize). A mount wants a spare of size aheadSize while
// its spares of that size are fewer than Preallocate bytes (and than
// aheadFiles, where that bounds them), the spares it
// made ahead (of any size) leave room for one more within Preallocate,
// and one more stays below the low watermark.
func (e *Engine) nextSpareLocked() (*mount, spareFile) {
	if e.closed {
		return nil, spareFile{}
	}
	for _, m := range e.mounts {
		size := m.aheadSize
		if m.ahead <= 0 || size <= 0 || !e.spareEligible(m) {
			continue
		}
		if n := len(m.spares[size]); int64(n+1)*size > m.ahead || m.aheadFiles > 0 && n >= m.aheadFiles {
			continue // enough of that size
		}
		if m.madeBytes+size > m.ahead {
			// Made spares of other sizes fill the budget: remove them,
			// but only where one of this size then fits below the low
			// watermark (else they would go for nothing).
			stale := m.madeBytes - m.madeOfSizeLocked(size)
			if m.used+m.spareBytes-stale+size > m.low {
				continue
			}
			if sf, ok := m.staleMadeLocked(size); ok {
				return m, sf
			}
			continue
		}
		if !m.madeFitsLocked(size) {
			continue
		}
		return m, spareFile{}
	}
	return nil, spareFile{}
}

// madeFitsLocked reports whether one more spare of size made ahead stays
// within Preallocate and, beside m's files, reservations and spares,
// below the low watermark.
func (m *mount) madeFitsLocked(size int64) bool {
	return m.madeBytes+size <= m.ahead && m.used+m.spareBytes+size <= m.low
}

// madeOfSizeLocked is the bytes of m's spares of size made ahead.
func (m *mount) madeOfSizeLocked(size int64) int64 {
	var n int64
	for _, sf := range m.spares[size] {
		if sf.zeroed {
			n += size
		}
	}
	return n
}

// staleMadeLocked returns a spare made ahead of another size than size.
func (m *mount) staleMadeLocked(size int64) (spareFile, bool) {
	for sz, list := range m.spares {
		if sz == size {
			continue
		}
		for _, sf := range list {
			if sf.zeroed {
				return sf, true
			}
		}
	}
	return spareFile{}, false
}

// awaitQuiet waits until no file has been in flight for the quiet
// period, and reports false if the maker was stopped first.
func (e *Engine) awaitQuiet() bool {
	mk := e.maker
	for {
		if e.filesInFlight() {
			mk.waitedIdle.Add(1)
			select {
			case <-mk.idle:
				continue
			case <-mk.stop:
				return false
			}
		}
		left := time.Duration(mk.quietFor.Load()) - time.Since(time.Unix(0, mk.lastEnd.Load()))
		if left <= 0 {
			return true
		}
		t := time.NewTimer(left)
		select {
		case <-t.C:
		case <-mk.wake: // checks again (tests shorten the period)
			t.Stop()
		case <-mk.stop:
			t.Stop()
			return false
		}
	}
}

// makeSpares is the maker's goroutine.
func (e *Engine) makeSpares() {
	mk := e.maker
	defer close(mk.done)
	for {
		e.mu.Lock()
		m, _ := e.nextSpareLocked()
		if m == nil {
			select {
			case <-mk.quiet:
			default:
				close(mk.quiet)
			}
		}
		e.mu.Unlock()
		if m == nil {
			select {
			case <-mk.wake:
				continue
			case <-mk.stop:
				return
			}
		}
		if !e.awaitQuiet() {
			return
		}
		e.mu.Lock()
		m, stale := e.nextSpareLocked() // again: the quiet took time
		var size int64
		if m != nil {
			size = m.aheadSize
			if stale.path != "" {
				m.removeSpareLocked(stale)
			}
		}
		e.mu.Unlock()
		switch {
		case m == nil:
			continue
		case stale.path != "":
			e.forget(stale.id)
			e.removeTemp(stale.path)
			continue
		}
		if err := e.makeSpare(m, size); err != nil {
			// Not again until the next store of m, or the next
			// namespace declared: a full file system, or one that
			// refuses fallocate, would otherwise have the maker
			// retry without end.
			e.mu.Lock()
			if m.aheadSize == size {
				m.aheadSize, m.aheadFrom = 0, sizeUnknown
			}
			e.mu.Unlock()
			e.log.Debug("engine: make a spare file ahead of stores", "mount", m.root, "size", size, "err", err)
		}
	}
}

// makeSpare makes one spare of size bytes on m: a file in m's root with
// its pages allocated, shown to the movers (transfer.Preparer), then
// added to m's spares if it still fits below the low watermark.
func (e *Engine) makeSpare(m *mount, size int64) error {
	f, path, op, err := e.createFile(m.root, sparePrefix, 0, size)
	if err != nil {
		return fmt.Errorf("%s: %w", op, err)
	}
	id, err := fileIdentity(f)
	if err == nil {
		for _, mv := range m.movers {
			if p, ok := mv.(transfer.Preparer); ok {
				p.Prepare(f)
			}
		}
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		e.mu.Lock()
		keep := !e.closed && m.madeFitsLocked(size) // stores may have taken the room meanwhile
		if keep {
			m.addSpareLocked(spareFile{path: path, id: id, zeroed: true})
		}
		e.mu.Unlock()
		if keep {
			e.st.made.Add(1)
			return nil
		}
	}
	// Not kept: the room went to stores meanwhile, the engine is
	// closing, or the file failed.
	e.forget(id)
	e.removeTemp(path)
	return err
}

// WaitSpares waits until the engine has made the spare files it makes
// ahead of stores (Mount.Preallocate) for the declarations and stores so
// far: the maker has nothing left to do, or has stopped (Close). It
// returns at once where no mount makes them, and ctx's error if ctx ends
// first. Movers may still be preparing the files (the GPU path's
// registrations).
func (e *Engine) WaitSpares(ctx context.Context) error {
	mk := e.maker
	if mk == nil {
		return nil
	}
	e.spareRoom() // room an eviction or a capacity refresh freed, which wakes no one
	for {
		e.mu.Lock()
		quiet := mk.quiet
		e.mu.Unlock()
		select {
		case <-quiet:
			e.mu.Lock()
			same := mk.quiet == quiet
			e.mu.Unlock()
			if same {
				return nil
			}
		case <-mk.done:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}
