package engine

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"slices"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/engine/index"
	"github.com/kvhost/kvhost/internal/engine/space"
)

// Names the engine owns under a mount root: every name starting with '.'
// (on a vllm-fs mount, vLLM's base directory may start with '.' too:
// baseDirs).
const (
	tmpPrefix   = ".tmp-"
	probePrefix = ".probe-direct-"
	sparePrefix = ".spare-" // an evicted file kept for reuse (spares.go)
)

// Engine stores and loads KV-cache blocks. It is safe for concurrent use.
//
// Its files are layered so that calls go one way, downwards (only the
// eviction and a move between mounts call each other, in capacity.go and
// demote.go: an eviction may demote its victim, and a move reserves room
// on its target, which may evict there). From the bottom:
//
//   - declarations: api.go, geometry.go, failures.go;
//   - state: the parts, packages of their own: space (room on the
//     mounts), then index (entries, paths held), parts.go naming their
//     types;
//   - plumbing: hits.go (policy events), observe.go, movers.go, jobs.go,
//     calls.go (the calls in flight that are not jobs),
//     recheck.go;
//   - files: identity.go, removal.go, tempfiles.go, vllmfs.go,
//     headers.go, checks.go, mount.go;
//   - room: spares.go, owner.go (whose spares are live), ahead.go,
//     warm.go, drop.go, publish.go, cluster.go (cluster-wide capacity),
//     capacity.go (the capacity part: reservations, eviction) and
//     demote.go;
//   - requests: namespaces.go, caches.go, lookup.go, pins.go, store.go,
//     load.go, delete.go;
//   - life: recover.go, hold.go, reload.go, engine.go.
type Engine struct {
	cfg    Config  // with its defaults set: Logger, Now, Memory and the rest
	fs     fsys.FS // Config.FS, watched: its calls in flight are in busy.io
	pol    policyPart
	mv     movers // the CPU path, the movers' names, the file slots (movers.go)
	mounts []*mount
	nm     *namer      // the keys' names: the policy's or a vllm-fs layout's (lookup.go)
	watch  *mountWatch // the mounts' capacity, refusals and probes (mount.go, mountfail.go)
	// own: the files of the engine's own names, temporary files, owner
	// files, the node lock and the directories mkdir knows (tempfiles.go,
	// owner.go); hd opens the data files and reads their headers
	// (headers.go).
	own  *ownFiles
	hd   *headerReader
	vllm *vllmReader // vllm-fs mounts: their base directories and row files (vllmfs.go)
	chk  *checker    // is an entry's file still the one indexed (checks.go)

	// The engine's state in parts, each with its own lock; the lock
	// order is evictMu (per mount, in mount order) > pinTab.mu > tables.mu >
	// ix.mu > space.mu (docs/engine.md, "The engine's parts"). Nothing
	// holding one of them calls the policy. hold.mu (hold.go) is taken
	// before ix.mu and held across the policy call of a release.
	//
	// tables are the engine-wide tables: namespaces, caches, and
	// whether the engine is closed (namespaces.go), under their own lock.
	tables *tables
	// ix is what is stored: entries by id, key and path, and the paths
	// jobs hold (index.go).
	ix *index.Index
	// space is the room on every mount: capacity, used, reservations,
	// orphans, spares (package space).
	space *space.Space

	busy inFlight   // the jobs, calls and file operations in flight; Close's wait for them
	st   counters   // what the engine counts, for Stats and tests
	objs objectTier // the object mount's keys (Config.Objects)

	pinTab     pinTable     // client pins and the files they hold open (pins.go, pinfiles.go)
	hold       *restartHold // the files found at start, pinned for Config.RestartHold (hold.go)
	tier       *tiering     // moves between mounts, ticks and mount updates (demote.go)
	maker      *spareMaker  // spares made ahead of stores (ahead.go); nil without Mount.Preallocate
	warm       *warmer      // files offered to the movers ahead of jobs (warm.go); nil where none takes them
	verify     *verifier    // files found at start verified ahead of their loads (verifyahead.go); nil where none
	clusterRun clusterLoops // loops of the cluster mounts (cluster.go)

	rm       *remover   // dropping entries, removing files (removal.go)
	capacity *capacity  // reservations, eviction, the eviction lock (capacity.go)
	shared   *sharedDir // the cases of a directory other engines share (shared.go)
}

// policyPart is the policy the engine calls (a switchPolicy, so that
// ReplacePolicy can swap what it wraps: reload.go), whether the engine
// closes it, and the recorder that reports lookup hits off the lookup's
// path (hits.go).
type policyPart struct {
	policy.Policy
	own    bool
	hitRec *hitRecorder
}

// inFlight is what is in flight: the jobs (jobs.go), the calls that are
// not jobs (calls.go) and the file operations and movers' calls
// (Activity); and Close's wait for them to end: down is closed when
// Close's teardown has ended (shutdown), closeErr set before; unwind is
// how long Close waits, once its context has ended, for the jobs it
// cancelled and the calls in flight (defaultCloseUnwind; tests shorten
// it).
type inFlight struct {
	jobs  jobTable
	calls callGate
	io    fsys.InFlight

	down     chan struct{}
	closeErr error
	unwind   time.Duration
}

type counters struct {
	stores, loads, hits, misses, evictions, reused, made, failures, corrupt, written, read atomic.Uint64
	fails                                                                                  *failureLog // the store and load failures, logged at most once an interval
	// layersByKey counts the keys of layer-range loads verified by the
	// whole key's checksum (files without layer sums): Stats.LayerLoadsByKey.
	layersByKey atomic.Uint64
	// checkedBefore counts the keys loads took as verified, unchanged
	// since checked (checked.go): Stats.LoadKeysCheckedBefore.
	checkedBefore atomic.Uint64

	// pathWaits counts the times a store waited for another job holding
	// its file's path; evictWaits, the reservations that found no room
	// below a mount's high watermark and went to its eviction lock
	// (reserveUsed). Tests wait for them instead of sleeping.
	pathWaits, evictWaits atomic.Int64
	// tailTurns counts the loads of a step's last layers that waited for
	// the previous load's end (loadOrder): tests wait for it.
	tailTurns atomic.Int64

	// ended counts the jobs finished (Activity); scanned, the files a
	// cluster adoption walk read.
	ended, scanned atomic.Uint64
}

// DefaultIOWorkers is the number of I/O workers of a Config whose
// IOWorkers is 0 (the staging pool's default too): runtime.GOMAXPROCS as
// it is now, at least 2 (the daemon reads it before it raises GOMAXPROCS
// beyond the workers).
func DefaultIOWorkers() int { return max(2, runtime.GOMAXPROCS(0)) }

// Open opens an engine over cfg.Mounts: it creates missing roots, probes
// O_DIRECT once per mount, removes temporary leftovers of earlier runs and
// rebuilds the index from the files' headers (a parallel scan).
func Open(ctx context.Context, cfg Config) (*Engine, error) {
	if len(cfg.Mounts) == 0 {
		return nil, fmt.Errorf("%w: config: no mounts", ErrInvalid)
	}
	if cfg.Policy == nil && cfg.NewPolicy == nil {
		return nil, fmt.Errorf("%w: config: no policy", ErrInvalid)
	}
	if cfg.Host == nil {
		return nil, fmt.Errorf("%w: config: no CPU path (Config.Host)", ErrInvalid)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.FS == nil {
		cfg.FS = fsys.OS{}
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.IOWorkers <= 0 {
		cfg.IOWorkers = DefaultIOWorkers()
	}
	if cfg.StagingBytes <= 0 {
		cfg.StagingBytes = 64 << 20
	}
	if cfg.MaxNamespaces <= 0 {
		cfg.MaxNamespaces = DefaultMaxNamespaces
	}
	if cfg.TempGrace <= 0 {
		cfg.TempGrace = DefaultTempGrace
	}
	cfg.Memory = machineMemory(cfg.Memory)
	e := &Engine{
		cfg:   cfg,
		space: space.New(),
		busy:  inFlight{calls: newCallGate(), down: make(chan struct{}), unwind: defaultCloseUnwind},
	}
	e.st.fails = &failureLog{log: cfg.Logger, interval: 10 * time.Second}
	e.fs = fsys.Watched(cfg.FS, &e.busy.io)
	e.hd = &headerReader{fs: e.fs, now: cfg.Now}
	e.nm = &namer{}
	e.watch = &mountWatch{cfg: cfg.Mounts, noReuse: cfg.NoReuse, fsync: cfg.Fsync, memory: cfg.Memory, fs: e.fs, log: cfg.Logger, now: cfg.Now, space: e.space}
	e.ix = index.NewIndex(e.space.Counts())
	e.rm = &remover{ix: e.ix, fs: e.fs, hd: e.hd, log: e.cfg.Logger, now: e.cfg.Now, host: e}
	e.pinTab.ix, e.pinTab.now, e.pinTab.tell, e.pinTab.maxOpen = e.ix, e.cfg.Now, e.access, DefaultMaxPinnedOpen()
	e.chk = &checker{fs: e.fs, now: cfg.Now, log: cfg.Logger, ix: e.ix, hd: e.hd, pins: &e.pinTab, rm: e.rm}
	e.tables = newTables(cfg.MaxNamespaces, e.ix.Counts().Holds)
	budgets, err := newBudgetSet(cfg.Budgets)
	if err != nil {
		return nil, fmt.Errorf("engine: %w", err)
	}
	e.tables.budgets = budgets
	// The node-local lock first: a second daemon on this node stops here,
	// before it touches a mount.
	e.own = &ownFiles{fs: e.fs, log: e.cfg.Logger, now: e.cfg.Now, grace: cfg.TempGrace, node: nodeName(cfg.NodeID), token: newToken(), dirs: newDirCache(e.fs, cfg.Fsync), rm: e.rm,
		sp: e.space, eligible: e.watch.spareEligible, reused: &e.st.reused}
	e.watch.own, e.watch.rm = e.own, e.rm
	if cfg.LockFile != "" {
		if err := e.own.lockNode(cfg.LockFile); err != nil {
			return nil, err
		}
	}
	e.vllm = &vllmReader{fs: e.fs, own: e.own, hd: e.hd, ix: e.ix, rm: e.rm, tables: e.tables, fsync: cfg.Fsync, corrupt: &e.st.corrupt, log: cfg.Logger, now: cfg.Now}
	e.hd.raw = e.vllm
	ok := false
	defer func() {
		if !ok {
			e.own.closeOwners()
		}
		if !ok {
			e.clusterRun.Close(clusters(e.mounts))
		}
		if !ok {
			e.own.unlockNode()
		}
		if !ok && e.pol.hitRec != nil {
			e.pol.hitRec.close()
		}
	}()
	for i, m := range cfg.Mounts {
		mt, err := e.openMount(i, m)
		if err != nil {
			return nil, err
		}
		mt.backend = "staging"
		if m.VLLMFS != nil {
			if err := e.vllm.openLayout(mt, m.VLLMFS); err != nil {
				return nil, err
			}
			if other := e.vllm.layoutMount(mt.raw.model); other != nil {
				return nil, fmt.Errorf("%w: mounts %s and %s: both vllm-fs mounts serve namespace %q", ErrInvalid, other.root, mt.root, mt.raw.model)
			}
		} else {
			if e.nm.kvMounts < i {
				return nil, fmt.Errorf("%w: mount %s: a kvhost mount after the vllm-fs mount %s: list vllm-fs mounts last (the policy places other namespaces on mounts 0..n-1)", ErrInvalid, mt.root, e.mounts[e.nm.kvMounts].root)
			}
			for _, other := range e.mounts[:e.nm.kvMounts] {
				if err := checkDisjoint(e.fs, other.root, mt.root); err != nil {
					return nil, err
				}
			}
			e.nm.kvMounts++
		}
		e.mounts = append(e.mounts, mt)
		e.hd.mounts, e.nm.mounts, e.watch.mounts, e.vllm.mounts = e.mounts, e.mounts, e.mounts, e.mounts
		e.space.Add(mt.sp)
	}
	e.rm.mounts = e.mounts
	e.shared = &sharedDir{nm: e.nm, ix: e.ix, hd: e.hd, rm: e.rm, tables: e.tables, fs: e.fs, mounts: e.mounts, tell: e.access, log: cfg.Logger, now: cfg.Now}
	if err := e.tables.budgets.checkFloors(ownCapacity(e.mounts, e.space)); err != nil {
		return nil, fmt.Errorf("engine: %w", err)
	}
	e.capacity = &capacity{ix: e.ix, space: e.space, watch: e.watch, own: e.own, rm: e.rm, tables: e.tables, fs: e.fs,
		waits: &e.st.evictWaits, evictions: &e.st.evictions, tell: e.access, log: cfg.Logger, now: cfg.Now}
	e.tier = newTiering(e)
	e.hold = newRestartHold(e)
	e.capacity.tier, e.capacity.hold = e.tier, e.hold
	const bufSize = 4 << 20
	host, err := cfg.Host(HostSpec{
		Workers:    cfg.IOWorkers,
		CPUs:       cfg.CPUs,
		BufferSize: bufSize,
		Buffers:    int(max(2, cfg.StagingBytes/bufSize)),
		YieldBytes: cfg.YieldBytes,
	})
	if err != nil {
		return nil, fmt.Errorf("engine: %w", err)
	}
	e.mv.host = host
	e.mv.slots.tokens = make(chan struct{}, cfg.IOWorkers)
	e.capacity.files = &e.mv.slots
	pool := host
	if err := e.buildMovers(); err != nil {
		pool.Close()
		return nil, err
	}
	e.objs = objectTier{objs: cfg.Objects, find: e.find, rm: e.rm, st: &e.st, io: &e.busy.io, log: cfg.Logger, mounts: e.mounts,
		slots: make(chan struct{}, cmp.Or(cfg.ObjectKeys, max(DefaultObjectKeys, cfg.IOWorkers)))}
	e.objs.watch()
	e.rm.objs = &e.objs
	e.tier.objs, e.objs.lazy = &e.objs, e.tier.demotes
	if cfg.Objects != nil {
		e.objs.promoter = newObjectPromoter(e, e.objs.holds, e.busy.down)
	}
	e.own.openOwners(e.mounts, e.watch.spareEligible) // before the walk, which keeps live owners' spares
	// The cluster locks before the walk too: an adopter of this node's
	// files then lets go of them (openCluster).
	if err := openCluster(e); err != nil {
		pool.Close()
		return nil, err
	}
	start := time.Now()
	rc := &recovery{mounts: e.mounts, workers: cfg.IOWorkers, log: cfg.Logger, fs: e.fs, hd: e.hd, own: e.own, rm: e.rm, ix: e.ix, tables: e.tables, tier: e.tier, corrupt: &e.st.corrupt,
		journals: accessPaths(e.mounts, e.own.node), now: cfg.Now}
	if err := rc.rebuild(ctx); err != nil {
		pool.Close()
		return nil, err
	}
	// Before any eviction: the budgets count the files found.
	books := newModelBook(e.fs, cfg.Logger, e.mounts, e.own.node)
	books.prune(books.read(e.mounts), e.ix.Counts().Holds)
	e.tables.setBooks(books)
	e.tables.budgetsFound(cfg.Logger, e.ix.Counts().ByFingerprint())
	e.pol.Policy = cfg.Policy
	if e.pol.Policy == nil {
		if e.pol.Policy, err = cfg.NewPolicy(e.Index()); err != nil {
			pool.Close()
			return nil, fmt.Errorf("%w: new policy: %w", ErrPolicy, err)
		}
		e.pol.own = true
	}
	e.pol.Policy, e.pol.own = newSwitchPolicy(e.pol.Policy, e.pol.own), true // ReplacePolicy
	e.tier.pol, e.nm.pol = e.pol.Policy, e.pol.Policy
	e.chk.interval.Store(int64(cfg.VerifyInterval))
	e.watch.reportMounts()
	// Before any access event: the restart hold's release may come from
	// a timer while Open still runs.
	e.pol.hitRec = newHitRecorder(e, newAccessLog(e.ix, e.fs, cfg.Logger, writableAccessPaths(e.mounts, e.own.node)))
	e.capacity.hits = e.pol.hitRec
	e.access(ctx, e.ix.Files().Records(abi.AccessRestore)) // the policy told of every indexed entry
	// Before the cluster's first count, which may evict this node's files.
	e.hold.start(ctx, cfg.RestartHold)
	if err := countCluster(ctx, e.mounts); err != nil {
		e.hold.release(false)
		pool.Close()
		return nil, err
	}
	e.maker = newSpareMaker(e.space, e.mounts, e.mv.slots.busy, e.own, &e.st.made, e.cfg.Logger)
	e.capacity.maker = e.maker
	e.maker.start()
	e.tier.start(ctx, e.pol.hitRec, e.maker)
	e.warm = startWarmer(e.mounts, e.ix, e.hd.openRegular)
	e.shared.warm = e.warm
	e.verify = startVerifier(e.mounts, e.ix, e.hd, e.mv.slots.busy, e.cfg.Logger)
	e.clusterRun.Start(ctx, clusters(e.mounts))
	ok = true
	st := e.Stats()
	e.cfg.Logger.Info("engine: open", "mounts", len(e.mounts), "entries", st.Entries, "keys", st.Keys, "rebuild", time.Since(start))
	return e, nil
}

// Stats returns the engine's counters and per-mount usage.
func (e *Engine) Stats() Stats {
	s := Stats{
		Stores: e.st.stores.Load(), Loads: e.st.loads.Load(), Hits: e.st.hits.Load(), Misses: e.st.misses.Load(),
		Evictions: e.st.evictions.Load(), Reused: e.st.reused.Load(), SparesMade: e.st.made.Load(), Failures: e.st.failures.Load(), Corrupt: e.st.corrupt.Load(),
		Vanished: e.rm.vanished.Load(), RemoveFailures: e.rm.failures.Load(), BytesWritten: e.st.written.Load(), BytesRead: e.st.read.Load(),
		LayerLoadsByKey: e.st.layersByKey.Load(), LoadKeysCheckedBefore: e.st.checkedBefore.Load(), FilesVerifiedAhead: e.verify.count(),
		PinnedFilesOpen: e.pinTab.open.Load(), PinnedFilesUnopened: e.pinTab.unopened.Load(),
		StoreFailures: e.st.fails.stats(0), LoadFailures: e.st.fails.stats(1), Tiering: e.TierStats(), HeldFound: e.HeldFound(),
	}
	s.Entries, s.Keys = e.ix.Files().Size()
	counts := e.ix.Counts().ByFingerprint()
	s.Namespaces = e.tables.stats(counts)
	s.Budgets = e.tables.budgetStats(counts, s.Namespaces)
	rooms := e.space.Usages()
	for i, m := range e.mounts {
		sp := rooms[i]
		s.Mounts = append(s.Mounts, MountStats{
			Path: m.root, Capacity: sp.Capacity, Configured: sp.Configured, Reserve: sp.Reserve, Used: sp.Used, Entries: sp.Entries,
			SpareFiles: sp.SpareFiles, SpareBytes: sp.SpareBytes, Preallocate: sp.Ahead,
			Direct: m.direct, Memory: m.memory, Class: className(m.desc.class), IO: m.ioName(), Backend: m.backend, Checksums: m.checksums, Layout: LayoutKVHost,
			MovedIn: sp.MovedIn, MovedOut: sp.MovedOut, StoresFailing: m.storeFailure(),
		})
		if m.readers != nil {
			g := m.readers.Stats()
			ms := &s.Mounts[len(s.Mounts)-1]
			ms.LoadReaders, ms.LoadBuffered, ms.LoadReadersChanged, ms.LoadRate = g.Arm.Readers, g.Arm.Buffered, g.Changes, g.Rates[g.Arm]
			for a, rate := range g.Rates {
				ms.LoadArms = append(ms.LoadArms, LoadArm{Readers: a.Readers, Buffered: a.Buffered, Rate: rate, Home: a == g.Home})
			}
			slices.SortFunc(ms.LoadArms, func(x, y LoadArm) int { // O_DIRECT first, then by count
				if x.Buffered != y.Buffered {
					if y.Buffered {
						return -1
					}
					return 1
				}
				return cmp.Compare(x.Readers, y.Readers)
			})
		}
		if m.raw != nil {
			ms := &s.Mounts[len(s.Mounts)-1]
			ms.Layout, ms.Namespace, ms.Base = LayoutVLLMFS, m.raw.model, m.raw.layout.Base()
		}
	}
	return s
}

// defaultCloseUnwind is how long Close waits, once its context has ended,
// for the jobs it cancelled and the calls still in flight to return.
const defaultCloseUnwind = 5 * time.Second

// Close stops accepting requests and waits for everything in flight: the
// jobs, and the calls that are not jobs (Lookup, Pin, Unpin, Delete,
// Purge, Declare, Release, ReplacePolicy and the like); calls that begin
// after it fail with ErrClosed. Once they have all returned it closes the
// engine's parts (the policy, the movers, the node lock): no call uses
// them after they are closed, and nothing touches the mounts after Close
// returns nil.
//
// If ctx ends first, Close cancels the jobs and waits a few seconds more
// (defaultCloseUnwind) for them to unwind: the temporary files of
// cancelled stores are removed. Whatever still has not returned then (a
// file operation hung on a FUSE or NFS mount, which no cancellation
// reaches) is logged, and Close returns an error wrapping ErrInFlight and
// ctx's error without waiting for it: the engine's parts, the node lock
// (Config.LockFile) included, are closed once it returns, so no other
// engine opens the directories meanwhile. A later Close waits (up to its
// own ctx) for that and returns the close's outcome.
func (e *Engine) Close(ctx context.Context) error {
	if e.tables.close(e.space.Close) { // no spare kept or made from now on
		e.busy.jobs.close()
		e.busy.calls.close()
		go e.shutdown()
	}
	select {
	case <-e.busy.down:
		return e.busy.closeErr
	case <-ctx.Done():
	}
	e.busy.jobs.cancelAll()
	unwind := time.NewTimer(e.busy.unwind)
	defer unwind.Stop()
	select {
	case <-e.busy.down:
		return errors.Join(ctx.Err(), e.busy.closeErr)
	case <-unwind.C:
	}
	a := e.Activity()
	calls := e.busy.calls.inFlight()
	args := []any{"jobs", a.Jobs, "calls", calls}
	if !a.OldestIO.IsZero() {
		args = append(args, "oldest_io", time.Since(a.OldestIO).Round(time.Millisecond).String())
	}
	e.cfg.Logger.Error("engine: close gave up waiting for what is still in flight (a hung file system?); the engine closes, and lets go of its node lock, once they return", args...)
	return fmt.Errorf("engine: close: %w (jobs: %d, calls: %d; or the engine's background work): %w", ErrInFlight, a.Jobs, calls, ctx.Err())
}

// shutdown is Close's teardown: it waits for the jobs and the calls in
// flight, then closes the engine's parts, sets busy.closeErr and closes busy.down.
func (e *Engine) shutdown() {
	start := time.Now()
	e.busy.jobs.wg.Wait()
	<-e.busy.calls.idle
	e.pinTab.close()
	e.hold.release(false)
	e.tier.stop()
	e.maker.close()
	e.warm.close()
	e.verify.close()
	e.clusterRun.Close(clusters(e.mounts))
	e.own.dropSpares(e.mounts)
	e.own.closeOwners() // after the spares: none is left for another engine to find live
	e.pol.hitRec.close()
	e.mv.host.Close()
	e.objs.bounce.close()
	var err error
	if e.pol.own {
		err = e.pol.Close(context.Background())
	}
	e.own.unlockNode()
	e.busy.closeErr = err
	close(e.busy.down)
	e.cfg.Logger.Debug("engine: closed", "took", time.Since(start))
}
