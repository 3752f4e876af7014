package engine

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/internal/engine/space"
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
// file is in flight on the engine, it creates files of the sizes the
// stores write, allocates their pages (fallocate) and tells the movers
// (transfer.Preparer: the GPU path registers them). Each namespace that
// stores on the mount has a size (spareMaker.want: its last file of a whole
// group of keys; until a store, such a file as its declaration says:
// spareMaker.predict) and an even share of Preallocate, which goes to
// spares of its size (space), as far as the spares stay
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

// spareMaker is the goroutine that makes spares ahead of stores, and
// what it knows. Its methods do nothing on a nil maker (no mount makes
// spares ahead).
type spareMaker struct {
	wakeup chan struct{} // a token: there may be work (a declaration, a store, room freed)
	idle   chan struct{} // a token: the last file in flight ended
	stop   chan struct{}
	done   chan struct{}
	// lastEnd is when the last file in flight ended, or a store last
	// reserved a file where the budget follows bursts (UnixNano); quietFor
	// is aheadQuiet (a field for tests).
	lastEnd  atomic.Int64
	quietFor atomic.Int64
	// waitedIdle counts the times it began to wait for the files in
	// flight (tests wait for it).
	waitedIdle atomic.Int64

	// What it works with: the room on the mounts, the mounts, whether a
	// file is in flight (fileSlots.busy), how it makes and removes its
	// files, and the count of spares made (Stats.SparesMade).
	sp     *space.Space
	mounts []*mount
	busy   func() bool
	own    *ownFiles // creates and removes the spares (createFile, removeSpare)
	made   *atomic.Uint64
	log    *slog.Logger
}

// activeAt moves lastEnd to now (UnixNano) unless it is later already.
func (mk *spareMaker) activeAt(now int64) {
	for {
		old := mk.lastEnd.Load()
		if now <= old || mk.lastEnd.CompareAndSwap(old, now) {
			return
		}
	}
}

// newSpareMaker returns a maker, not yet started, where a mount of
// mounts makes spares ahead, else nil.
func newSpareMaker(sp *space.Space, mounts []*mount, busy func() bool, own *ownFiles, made *atomic.Uint64, log *slog.Logger) *spareMaker {
	for _, m := range mounts {
		if m.sp.MakesAhead() {
			mk := &spareMaker{
				wakeup: make(chan struct{}, 1), idle: make(chan struct{}, 1),
				stop: make(chan struct{}), done: make(chan struct{}),
				sp: sp, mounts: mounts, busy: busy, own: own, made: made, log: log,
			}
			mk.quietFor.Store(int64(aheadQuiet))
			return mk
		}
	}
	return nil
}

// start starts the maker's goroutine.
func (mk *spareMaker) start() {
	if mk == nil {
		return
	}
	mk.sp.TrackMaker() // before the maker and any job
	go mk.run()
}

// close stops the maker and waits for the file it is making.
func (mk *spareMaker) close() {
	if mk == nil {
		return
	}
	close(mk.stop)
	<-mk.done
}

// want returns what a store of namespace ns on m tells the spares
// made ahead (space.StoreReserve records it with the reservation),
// or nil where m makes none or ns is not declared. The namespace's
// spares are made in the size of its last file that held a whole group
// of its keys (full): a job's last file may hold fewer, and following it
// would make spares of a size few stores write (and remove those of the
// size most do). Until such a file is stored, files of fewer keys set
// it, over a declaration's guess too (a client whose jobs all hold fewer
// keys than a group writes only such files), but only ever upwards: jobs
// of varying length would otherwise have the maker remove and remake the
// namespace's share in every idle moment. The caller holds the tables'
// lock for reading where m makes spares ahead (tables.whileDeclared).
func (mk *spareMaker) want(m *mount, ns NamespaceID, declared, full bool) *space.StoreAhead {
	if mk == nil || !m.sp.MakesAhead() || !declared {
		return nil
	}
	return &space.StoreAhead{NS: uint32(ns), Full: full}
}

// predict guesses the size of the files a newly declared
// namespace's stores will write, a file holding a whole group of its keys
// (wholeFileLen), for the mount that makes spares ahead, where that mount
// knows no size of the namespace yet, and reports whether the maker then
// has work. Declare calls it for a namespace in kvhost's layout, so that
// the spares are made in the idle moment between a client's start and its
// first stores rather than after them. It guesses only where one kvhost
// mount makes spares ahead: with several, which of them the policy will
// place files on is not known before it does, and spares on a mount no
// store reaches would hold its memory for nothing. Any store's size
// replaces the guess (want). The caller holds the tables' lock.
func (mk *spareMaker) predict(ns *namespace) bool {
	if mk == nil || ns.layout != nil {
		return false
	}
	var only *mountSpace
	for _, m := range mk.mounts {
		if m.sp.MakesAhead() {
			if only != nil {
				return false
			}
			only = m.sp
		}
	}
	if only == nil {
		return false
	}
	return mk.sp.GuessAhead(only, uint32(ns.id), ns.wholeFileLen())
}

// forget drops what every mount knows of released namespace ns's files
// (its share of the spares goes to the others), and reports whether the
// maker then has work. The caller holds the tables' lock.
func (mk *spareMaker) forget(ns NamespaceID) bool {
	if mk == nil {
		return false
	}
	return mk.sp.ForgetAhead(uint32(ns))
}

// room wakes the maker if it has work (a delete or a move freed room),
// and marks it busy for WaitSpares.
func (mk *spareMaker) room() {
	if mk == nil {
		return
	}
	mk.wake(mk.sp.SpareWork())
}

// wake wakes the maker if work says it has some.
func (mk *spareMaker) wake(work bool) {
	if !work {
		return
	}
	select {
	case mk.wakeup <- struct{}{}:
	default:
	}
}

// fileEnded is called after a file in flight released its slot, and
// after a copy between mounts ended.
func (mk *spareMaker) fileEnded() {
	if mk == nil {
		return
	}
	mk.lastEnd.Store(time.Now().UnixNano())
	if !mk.busy() {
		select {
		case mk.idle <- struct{}{}:
		default:
		}
	}
}

// awaitQuiet waits until no file has been in flight for the quiet
// period, and reports false if the maker was stopped first.
func (mk *spareMaker) awaitQuiet() bool {
	for {
		if mk.busy() {
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
		case <-mk.wakeup: // checks again (tests shorten the period)
			t.Stop()
		case <-mk.stop:
			t.Stop()
			return false
		}
	}
}

// run is the maker's goroutine.
func (mk *spareMaker) run() {
	defer close(mk.done)
	sp := mk.sp
	for {
		if !sp.SpareWorkOrQuiet() {
			select {
			case <-mk.wakeup:
				continue
			case <-mk.stop:
				return
			}
		}
		if !mk.awaitQuiet() {
			return
		}
		sp.EndBursts(time.Now().UnixNano(), time.Duration(mk.quietFor.Load())) // the budget follows the burst that just ended
		ms, size, stale := sp.NextSpare()                                      // again: the quiet took time
		switch {
		case ms == nil:
			continue
		case stale.Path != "":
			mk.own.removeSpare(mk.mounts[ms.Index()], stale.Path, stale.ID)
			continue
		}
		m := mk.mounts[ms.Index()]
		if err := mk.makeSpare(m, size); err != nil {
			// Not again until the next store of a namespace of that
			// size on m, or the next namespace declared: a full file
			// system, or one that refuses fallocate, would otherwise
			// have the maker retry without end.
			sp.FailedAhead(ms, size)
			mk.log.Debug("engine: make a spare file ahead of stores", "mount", m.root, "size", size, "err", err)
		}
	}
}

// makeSpare makes one spare of size bytes on m: a file in m's root with
// its pages allocated, shown to the movers (transfer.Preparer), then
// added to m's spares if it still fits below the low watermark.
func (mk *spareMaker) makeSpare(m *mount, size int64) error {
	f, path, op, err := mk.own.createFile(m, m.root, sparePrefix, 0, size)
	if err != nil {
		return fmt.Errorf("%s: %w", op, err)
	}
	id, err := fileIdentity(f)
	if err == nil && id.Size < size {
		// The file system has no fallocate (ramfs: Allocate returns
		// nil on EOPNOTSUPP): the file holds nothing, and kept it
		// would count as a spare of its own size, 0, so that the
		// maker would make another at once, without end.
		err = fmt.Errorf("%s: %d bytes after allocating %d: the file system does not preallocate", path, id.Size, size)
	}
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
		// Stores may have taken the room meanwhile.
		if mk.sp.KeepMade(m.sp, spareFile{Path: path, ID: id, Zeroed: true}) {
			mk.made.Add(1)
			return nil
		}
	}
	// Not kept: the room went to stores meanwhile, the engine is
	// closing, or the file failed (a zero id is read from the name; the
	// file has size bytes either way).
	id.Size = size
	mk.own.removeSpare(m, path, id)
	return err
}

// WaitSpares waits until the engine has made the spare files it makes
// ahead of stores (Mount.Preallocate) for the declarations and stores so
// far: the maker has nothing left to do, or has stopped (Close). It
// returns at once where no mount makes them, and ctx's error if ctx ends
// first. Movers may still be preparing the files (the GPU path's
// registrations).
func (e *Engine) WaitSpares(ctx context.Context) error { return e.maker.waitSpares(ctx) }

// waitSpares is WaitSpares.
func (mk *spareMaker) waitSpares(ctx context.Context) error {
	if mk == nil {
		return nil
	}
	mk.room() // room an eviction or a capacity refresh freed, which wakes no one
	sp := mk.sp
	for {
		quiet := sp.QuietChan()
		select {
		case <-quiet:
			if sp.QuietChan() == quiet {
				return nil
			}
		case <-mk.done:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}
