package engine

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"slices"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/internal/transfer"
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
// file is in flight on the engine, it creates files of the sizes the
// stores write, allocates their pages (fallocate) and tells the movers
// (transfer.Preparer: the GPU path registers them). Each namespace that
// stores on the mount has a size (wantSparesLocked: its last file of a whole
// group of keys; until a store, such a file as its declaration says:
// predictSparesLocked) and an even share of Preallocate, which goes to
// spares of its size (aheadTargetsLocked), as far as the spares stay
// below the mount's low watermark. The next
// stores of that size then write into pages that exist and are registered,
// as stores into a full cache do. A made spare is a spare like any other:
// free space that holds pages, removed when a reservation needs the room
// (reserve) and at Close.
//
// The maker runs only once no file has been in flight for aheadQuiet, so
// that it takes no memory bandwidth from a burst of jobs (a client's next
// job follows its last within microseconds to milliseconds); it makes one
// file at a time, and checks again before the next. Spares made ahead of
// a size count against Preallocate until stores take them; when the
// shares change (a namespace stores another size, another namespace
// comes, one is released) and made spares beyond their size's share fill
// the budget, the maker removes those first.

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
		if m.ahead > 0 {
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

// sizeSource is what set the size of a namespace's files on a mount.
type sizeSource uint8

const (
	sizeUnknown sizeSource = iota
	sizeGuessed            // a declaration (predictSparesLocked)
	sizePartial            // a stored file of fewer keys than a group
	sizeWhole              // a stored file of a whole group of keys
)

// nsAhead is what a namespace's declaration and stores say about the
// files it stores on a mount that makes spares ahead: their size (0:
// unknown), and what set it.
type nsAhead struct {
	size   int64
	from   sizeSource
	failed bool
}

// wantSparesLocked records that a store of namespace ns on m writes a
// file of size bytes, and reports whether the maker should be woken (m
// should have more spares). The namespace's spares are made in the size
// of its last file that held a whole group of its keys (full): a job's
// last file may hold fewer, and following it would make spares of a size
// few stores write (and remove those of the size most do). Until such a
// file is stored, files of fewer keys set it, over a declaration's guess
// too (a client whose jobs all hold fewer keys than a group writes only
// such files), but only ever upwards: jobs of varying length would
// otherwise have the maker remove and remake the namespace's share in
// every idle moment. The caller holds e.mu (reserveFile: once per store,
// with the reservation and the spare it takes).
func (e *Engine) wantSparesLocked(m *mount, ns NamespaceID, size int64, full bool) bool {
	if e.maker == nil || m.ahead <= 0 {
		return false
	}
	if n := e.nss[ns]; !n.declared {
		return false
	}
	was := m.aheadNS[ns]
	a := was
	a.failed = false
	switch {
	case full:
		a = nsAhead{size: size, from: sizeWhole}
	case a.from < sizePartial || a.from == sizePartial && size > a.size:
		a = nsAhead{size: size, from: sizePartial}
	}
	if a == was && !e.makerQuietLocked() {
		// Nothing changed, and the maker already knows it has work (it
		// looks again once the files in flight end): a store of a burst
		// skips the shares' computation under the lock.
		return false
	}
	m.setAheadLocked(ns, a)
	return e.spareWorkLocked()
}

// makerQuietLocked reports whether the maker found nothing to do when it
// last looked (and nothing marked it busy since).
func (e *Engine) makerQuietLocked() bool {
	select {
	case <-e.maker.quiet:
		return true
	default:
		return false
	}
}

// predictSparesLocked guesses the size of the files a newly declared
// namespace's stores will write, a file holding a whole group of its keys
// (wholeFileLen), for the mount that makes spares ahead, where that mount
// knows no size of the namespace yet, and reports whether the maker then
// has work. Declare calls it for a namespace in kvhost's layout, so that
// the spares are made in the idle moment between a client's start and its
// first stores rather than after them. It guesses only where one kvhost
// mount makes spares ahead: with several, which of them the policy will
// place files on is not known before it does, and spares on a mount no
// store reaches would hold its memory for nothing. Any store's size
// replaces the guess (wantSparesLocked). The caller holds e.mu.
func (e *Engine) predictSparesLocked(ns *namespace) bool {
	if e.maker == nil || ns.layout != nil {
		return false
	}
	var only *mount
	for _, m := range e.mounts {
		if m.ahead > 0 {
			if only != nil {
				return false
			}
			only = m
		}
	}
	if only == nil || only.aheadNS[ns.id].from != sizeUnknown {
		return false
	}
	only.setAheadLocked(ns.id, nsAhead{size: ns.wholeFileLen(), from: sizeGuessed})
	return e.spareWorkLocked()
}

// forgetAheadLocked drops what every mount knows of released namespace
// ns's files (its share of the spares goes to the others), and reports
// whether the maker then has work.
func (e *Engine) forgetAheadLocked(ns NamespaceID) bool {
	if e.maker == nil {
		return false
	}
	for _, m := range e.mounts {
		delete(m.aheadNS, ns)
	}
	return e.spareWorkLocked()
}

// setAheadLocked records what namespace ns says about its files on m.
func (m *mount) setAheadLocked(ns NamespaceID, a nsAhead) {
	if m.aheadNS == nil {
		m.aheadNS = map[NamespaceID]nsAhead{}
	}
	m.aheadNS[ns] = a
}

// aheadTargetsLocked returns the bytes of spares of each size m makes
// ahead: Preallocate split evenly between the namespaces whose file size
// on m is known, each share going to its namespace's size.
func (m *mount) aheadTargetsLocked() map[int64]int64 {
	k := int64(0)
	for _, a := range m.aheadNS {
		if a.size > 0 {
			k++
		}
	}
	if k == 0 {
		return nil
	}
	t := make(map[int64]int64, k)
	for _, a := range m.aheadNS {
		if a.size > 0 {
			t[a.size] += m.ahead / k
		}
	}
	return t
}

// failedLocked reports whether every namespace of size on m failed to get one.
func (m *mount) failedLocked(size int64) bool {
	for _, a := range m.aheadNS {
		if a.size == size && !a.failed {
			return false
		}
	}
	return true
}

// aheadWantLocked is how many spares of size m keeps for target bytes:
// as many as fit in them, at most aheadFiles where that bounds them.
func (m *mount) aheadWantLocked(size, target int64) int {
	n := int(target / size)
	if m.aheadFiles > 0 {
		n = min(n, m.aheadFiles)
	}
	return n
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
	if m, _, _ := e.nextSpareLocked(); m == nil {
		return false
	}
	if e.makerQuietLocked() {
		e.maker.quiet = make(chan struct{})
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
// on, or nil, the size of the spare to make there, and a made spare
// beyond its size's share to remove first (no path: make one of size). A
// mount wants a spare of a size while its spares of that size (made or
// evicted) are fewer than that size's share of Preallocate holds (and
// than aheadFiles, where that bounds them), the spares it made ahead (of
// any size) leave room for one more within Preallocate, and one more
// stays below the low watermark. Of the sizes that want one, the one with
// the least of its share comes first.
func (e *Engine) nextSpareLocked() (*mount, int64, spareFile) {
	if e.closed {
		return nil, 0, spareFile{}
	}
	for _, m := range e.mounts {
		if m.ahead <= 0 {
			continue
		}
		targets := m.aheadTargetsLocked()
		type cand struct {
			size int64
			f    float64
		}
		var cands []cand
		for sz, target := range targets {
			if m.failedLocked(sz) {
				continue
			}
			want := m.aheadWantLocked(sz, target)
			have := len(m.spares[sz])
			if have >= want {
				continue // enough of that size
			}
			cands = append(cands, cand{sz, float64(have) / float64(want)})
		}
		slices.SortFunc(cands, func(a, b cand) int {
			if a.f != b.f {
				return cmp.Compare(a.f, b.f)
			}
			return cmp.Compare(a.size, b.size)
		})
		for _, c := range cands {
			size := c.size
			if m.madeFitsLocked(size) {
				return m, size, spareFile{}
			}
			// Made spares beyond their sizes' shares take the room:
			// remove them, but only where one of this size then fits
			// (else they would go for nothing).
			sf, excess := m.excessMadeLocked(targets, size)
			if excess > 0 && m.madeBytes-excess+size <= m.ahead && m.used+m.spareBytes-excess+size <= m.low {
				return m, size, sf
			}
		}
	}
	return nil, 0, spareFile{}
}

// madeFitsLocked reports whether one more spare of size made ahead stays
// within Preallocate and, beside m's files, reservations and spares,
// below the low watermark.
func (m *mount) madeFitsLocked(size int64) bool {
	return m.madeBytes+size <= m.ahead && m.used+m.spareBytes+size <= m.low
}

// excessMadeLocked returns the bytes of m's spares made ahead beyond
// their sizes' shares (targets), of sizes other than size, and one of
// them (the made spares of a size beyond its share: at most as many as
// its spares beyond what the share holds).
func (m *mount) excessMadeLocked(targets map[int64]int64, size int64) (spareFile, int64) {
	var one spareFile
	var excess int64
	sizes := slices.Sorted(maps.Keys(m.spares))
	for _, sz := range sizes {
		list := m.spares[sz]
		if sz == size {
			continue
		}
		over := len(list) - m.aheadWantLocked(sz, targets[sz])
		for _, sf := range list {
			if over <= 0 {
				break
			}
			if sf.zeroed {
				if one.path == "" {
					one = sf
				}
				excess += sz
				over--
			}
		}
	}
	return one, excess
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
		m, _, _ := e.nextSpareLocked()
		if m == nil && !e.makerQuietLocked() {
			close(mk.quiet)
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
		m, size, stale := e.nextSpareLocked() // again: the quiet took time
		if m != nil && stale.path != "" {
			m.removeSpareLocked(stale)
		}
		e.mu.Unlock()
		switch {
		case m == nil:
			continue
		case stale.path != "":
			if err := e.removeFile(stale.path, stale.id); err != nil {
				e.log.Warn("engine: remove a spare file", "path", stale.path, "err", err)
			}
			continue
		}
		if err := e.makeSpare(m, size); err != nil {
			// Not again until the next store of a namespace of that
			// size on m, or the next namespace declared: a full file
			// system, or one that refuses fallocate, would otherwise
			// have the maker retry without end.
			e.mu.Lock()
			for ns, a := range m.aheadNS {
				if a.size == size {
					a.failed = true
					m.aheadNS[ns] = a
				}
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
	// closing, or the file failed (a zero id is read from the name).
	if rerr := e.removeFile(path, id); rerr != nil {
		e.log.Warn("engine: remove a spare file", "path", path, "err", rerr)
	}
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
