package engine

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/format"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/fsys"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/staging"
)

// Names the engine owns under a mount root: every name starting with '.'.
const (
	tmpPrefix   = ".tmp-"
	probePrefix = ".probe-direct-"
)

// Engine stores and loads KV-cache blocks. It is safe for concurrent use.
type Engine struct {
	cfg       Config
	log       *slog.Logger
	fs        fsys.FS
	pol       policy.Policy
	ownPolicy bool
	hitRec    *hitRecorder // lookup hits, reported off the lookup's path
	host      *staging.Mover  // the CPU path; its pool is the engine's I/O workers
	files     chan struct{}   // one token per file in flight (Config.IOWorkers)
	mounts    []*mount
	now       func() time.Time
	node      string    // this node's name in temporary file names
	lock      fsys.File // Config.LockFile, flocked for the engine's life
	dirs      sync.Map  // directories known to exist
	unsynced  sync.Map  // directories created, not yet fsynced (Config.Fsync)

	mu       sync.Mutex
	closed   bool
	nss      []*namespace // by NamespaceID
	nsByFP   map[uint64]NamespaceID
	caches   map[CacheID]*cache
	entries  map[uint64]*entry
	byKey    map[keyID]keyRef
	byPath   map[string]*entry
	inflight map[string]*flight // paths being written or removed
	jobs     map[JobID]*Job
	lastID   uint64 // entries
	lastJob  uint64
	lastCach uint64
	declares int // namespaces counted against Config.MaxNamespaces
	jobsWG   sync.WaitGroup

	st    counters
	fails *failureLog
}

type counters struct {
	stores, loads, hits, misses, evictions, failures, corrupt, vanished, written, read atomic.Uint64
}

type namespace struct {
	id          NamespaceID
	fp          uint64
	declared    bool
	geo         Geometry
	rec         abi.NamespaceRecord
	keysPerFile int
	order       uint32
	// counted: created or claimed by Declare, so it counts against
	// Config.MaxNamespaces (namespaces of files found on disk do not).
	counted bool
}

type cache struct {
	id     CacheID
	ns     *namespace
	layers []LayerTensor
	kind   region.Kind // of every layer's region: picks the mover
}

// keyID names a key across namespaces: its geometry fingerprint and bytes.
type keyID struct {
	fp  uint64
	key string
}

type keyRef struct {
	e   *entry
	idx int // index of the key in the file
}

// entry is one published file. Fields other than pins, hits, last and gone
// are immutable after it is indexed.
type entry struct {
	id    uint64
	ns    NamespaceID
	fp    uint64
	mount int
	path  string
	size  int64
	keys  []string
	ident fsys.Identity // of the file when it was indexed
	fid   uint64        // the header's file id (0: written before ids)
	// verified is when the file was last checked (Unix nanoseconds).
	verified atomic.Int64
	// guarded by Engine.mu
	pins int32
	hits uint32
	last int64
	gone bool // removed from the index
}

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
		cfg.IOWorkers = max(2, runtime.GOMAXPROCS(0))
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
	e := &Engine{
		cfg:      cfg,
		log:      cfg.Logger,
		fs:       cfg.FS,
		now:      cfg.Now,
		node:     nodeName(cfg.NodeID),
		fails:    &failureLog{log: cfg.Logger, interval: 10 * time.Second},
		nsByFP:   map[uint64]NamespaceID{},
		caches:   map[CacheID]*cache{},
		entries:  map[uint64]*entry{},
		byKey:    map[keyID]keyRef{},
		byPath:   map[string]*entry{},
		inflight: map[string]*flight{},
		jobs:     map[JobID]*Job{},
	}
	// The node-local lock first: a second daemon on this node stops here,
	// before it touches a mount.
	if cfg.LockFile != "" {
		lock, err := lockNode(e.fs, cfg.LockFile)
		if err != nil {
			return nil, err
		}
		e.lock = lock
	}
	ok := false
	defer func() {
		if !ok && e.lock != nil {
			e.lock.Close()
		}
	}()
	for i, m := range cfg.Mounts {
		mt, err := e.openMount(i, m)
		if err != nil {
			return nil, err
		}
		mt.backend = "staging"
		e.mounts = append(e.mounts, mt)
	}
	const bufSize = 4 << 20
	host, err := staging.NewMover(staging.Config{
		Workers:    cfg.IOWorkers,
		CPUs:       cfg.CPUs,
		BufferSize: bufSize,
		Buffers:    int(max(2, cfg.StagingBytes/bufSize)),
	})
	if err != nil {
		return nil, fmt.Errorf("engine: %w", err)
	}
	e.host = host
	e.files = make(chan struct{}, cfg.IOWorkers)
	pool := host
	if err := e.buildMovers(); err != nil {
		pool.Close()
		return nil, err
	}
	start := time.Now()
	if err := e.rebuild(ctx); err != nil {
		pool.Close()
		return nil, err
	}
	e.pol = cfg.Policy
	if e.pol == nil {
		if e.pol, err = cfg.NewPolicy(e.Index()); err != nil {
			pool.Close()
			return nil, fmt.Errorf("%w: new policy: %w", ErrPolicy, err)
		}
		e.ownPolicy = true
	}
	e.reportMounts()
	e.restore(ctx)
	e.hitRec = newHitRecorder(e)
	ok = true
	st := e.Stats()
	e.log.Info("engine: open", "mounts", len(e.mounts), "entries", st.Entries, "keys", st.Keys, "rebuild", time.Since(start))
	return e, nil
}

// Declare registers a geometry and returns its namespace. Declaring the same
// geometry again returns the same id.
func (e *Engine) Declare(ctx context.Context, g Geometry) (NamespaceID, error) {
	if err := g.Validate(); err != nil {
		return 0, err
	}
	fp := g.Fingerprint()
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return 0, ErrClosed
	}
	id, ok := e.nsByFP[fp]
	if ok && e.nss[id].declared {
		e.mu.Unlock()
		return id, nil
	}
	if !ok || !e.nss[id].counted {
		// Every namespace costs state here and in every policy shard,
		// for the life of the engine: bound them.
		if e.declares >= e.cfg.MaxNamespaces {
			e.mu.Unlock()
			return 0, fmt.Errorf("%w: namespace %q: %d namespaces declared, the limit (Config.MaxNamespaces) is %d", ErrInvalid, g.Model, e.declares, e.cfg.MaxNamespaces)
		}
		if !ok {
			id = e.newNamespaceLocked(fp)
		}
		e.nss[id].counted = true
		e.declares++
	}
	e.mu.Unlock()

	rec, err := e.pol.Namespace(ctx, g.record(id, len(e.mounts)))
	if err != nil {
		return 0, fmt.Errorf("%w: namespace %q: %w", ErrPolicy, g.Model, err)
	}
	if rec.KeysPerFile < 1 || rec.KeysPerFile > abi.MaxKeysPerFile || (rec.Order != abi.OrderLayerMajor && rec.Order != abi.OrderBlockMajor) {
		return 0, fmt.Errorf("%w: namespace %q: layout keys per file %d, order %d", ErrPolicy, g.Model, rec.KeysPerFile, rec.Order)
	}
	if segs := int64(rec.KeysPerFile) * int64(g.SegmentsPerKey()); segs > MaxSegmentsPerFile {
		return 0, fmt.Errorf("%w: %w: namespace %q: KeysPerFile %d × SegmentsPerKey %d = %d segments per file: want at most %d (fewer keys per file, or larger blocks)",
			ErrInvalid, ErrPolicy, g.Model, rec.KeysPerFile, g.SegmentsPerKey(), segs, MaxSegmentsPerFile)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	ns := e.nss[id]
	if !ns.declared {
		ns.declared, ns.geo, ns.rec = true, g, rec
		ns.keysPerFile, ns.order = int(rec.KeysPerFile), rec.Order
	}
	return id, nil
}

// Release ends the declaration of namespace ns: the server calls it when
// no client uses the namespace any more. The namespace stops counting
// against Config.MaxNamespaces and is unknown to requests until declared
// again (which returns the same id); its files stay indexed, on disk and
// servable then. It fails with ErrUnknownNamespace for an id Declare never
// returned, and with ErrInvalid while caches of the namespace are still
// registered. Releasing a released namespace does nothing.
func (e *Engine) Release(ns NamespaceID) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return ErrClosed
	}
	if int(ns) >= len(e.nss) || e.nss[ns].geo.Model == "" { // never declared
		return fmt.Errorf("%w: %d", ErrUnknownNamespace, ns)
	}
	n := e.nss[ns]
	if !n.declared {
		return nil
	}
	caches := 0
	for _, c := range e.caches {
		if c.ns == n {
			caches++
		}
	}
	if caches > 0 {
		return fmt.Errorf("%w: release of namespace %d (%q): %d caches are still registered", ErrInvalid, ns, n.geo.Model, caches)
	}
	n.declared = false
	if n.counted {
		n.counted = false
		e.declares--
	}
	return nil
}

func (e *Engine) newNamespaceLocked(fp uint64) NamespaceID {
	id := NamespaceID(len(e.nss))
	e.nss = append(e.nss, &namespace{id: id, fp: fp})
	e.nsByFP[fp] = id
	return id
}

func (e *Engine) namespace(id NamespaceID) (*namespace, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil, ErrClosed
	}
	if int(id) >= len(e.nss) || !e.nss[id].declared {
		return nil, fmt.Errorf("%w: %d", ErrUnknownNamespace, id)
	}
	return e.nss[id], nil
}

// RegisterCache registers the paged KV cache of one worker for namespace ns:
// one tensor per layer. Every block of every layer must lie inside its
// region; every region must be of one kind, for which every mount has a
// data mover (host memory: the staging pipeline, which needs
// host-addressable regions; device memory: Config.Movers).
func (e *Engine) RegisterCache(ns NamespaceID, layers []LayerTensor) (CacheID, error) {
	n, err := e.namespace(ns)
	if err != nil {
		return 0, err
	}
	g := n.geo
	if len(layers) != g.Layers {
		return 0, fmt.Errorf("%w: %d layer tensors for %d layers", ErrInvalid, len(layers), g.Layers)
	}
	c := &cache{ns: n, layers: slices.Clone(layers)}
	bb := g.BlockBytes()
	for l, t := range layers {
		bad := func(format string, args ...any) error {
			return fmt.Errorf("%w: layer %d: "+format, append([]any{ErrInvalid, l}, args...)...)
		}
		if t.Region == nil {
			return 0, bad("no region")
		}
		kind := t.Region.Kind()
		if l == 0 {
			c.kind = kind
		} else if kind != c.kind {
			return 0, bad("%s region %d, but layer 0 is in %s memory: a cache's regions are of one kind", kind, t.Region.ID(), c.kind)
		}
		for _, m := range e.mounts {
			if _, err := m.mover(kind); err != nil {
				return 0, bad("%s region %d: %w", kind, t.Region.ID(), err)
			}
		}
		if kind == region.KindHost {
			a, ok := t.Region.(region.Addressable)
			if !ok {
				return 0, bad("host region %d is not host-addressable", t.Region.ID())
			}
			if a.Bytes() == nil {
				return 0, bad("region %d is closed", t.Region.ID())
			}
		}
		if t.NumBlocks <= 0 || t.Offset < 0 || t.BlockStride < 0 || t.PlaneStride < 0 {
			return 0, bad("num blocks %d, offset %d, block stride %d, plane stride %d", t.NumBlocks, t.Offset, t.BlockStride, t.PlaneStride)
		}
		if t.NumBlocks > 1 && t.BlockStride < bb {
			return 0, bad("block stride %d is less than a block (%d bytes)", t.BlockStride, bb)
		}
		if g.Planes() > 1 && t.PlaneStride < bb {
			return 0, bad("plane stride %d is less than a block (%d bytes)", t.PlaneStride, bb)
		}
		// The last block's offset, without overflow: every term is bounded
		// by what is left of the region before it is multiplied.
		rl := t.Region.Len()
		room := rl - t.Offset
		if room < 0 {
			return 0, bad("offset %d is outside region %d of %d bytes", t.Offset, t.Region.ID(), rl)
		}
		if t.NumBlocks > 1 && int64(t.NumBlocks-1) > room/max(t.BlockStride, 1) {
			return 0, bad("%d blocks of stride %d from offset %d do not fit in region %d of %d bytes", t.NumBlocks, t.BlockStride, t.Offset, t.Region.ID(), rl)
		}
		room -= int64(t.NumBlocks-1) * t.BlockStride
		if g.Planes() > 1 && t.PlaneStride > room {
			return 0, bad("plane stride %d from offset %d does not fit in region %d of %d bytes", t.PlaneStride, t.Offset, t.Region.ID(), rl)
		}
		last := region.Segment{Region: t.Region, Offset: t.Offset + int64(g.Planes()-1)*t.PlaneStride + int64(t.NumBlocks-1)*t.BlockStride, Length: bb}
		if last.Offset < 0 || last.Check() != nil {
			return 0, bad("last block [%d, +%d) is outside region %d of %d bytes", last.Offset, bb, t.Region.ID(), t.Region.Len())
		}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return 0, ErrClosed
	}
	e.lastCach++
	c.id = CacheID(e.lastCach)
	e.caches[c.id] = c
	return c.id, nil
}

// UnregisterCache forgets a cache. Jobs already submitted keep using it:
// the caller must wait for them before unmapping the regions.
func (e *Engine) UnregisterCache(id CacheID) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, ok := e.caches[id]; !ok {
		return fmt.Errorf("%w: %d", ErrUnknownCache, id)
	}
	delete(e.caches, id)
	return nil
}

// request validates the common part of store and load requests.
func (e *Engine) request(id CacheID, keys [][]byte, blocks [][]int) (*cache, error) {
	e.mu.Lock()
	c, ok := e.caches[id]
	closed := e.closed
	e.mu.Unlock()
	if closed {
		return nil, ErrClosed
	}
	if !ok {
		return nil, fmt.Errorf("%w: %d", ErrUnknownCache, id)
	}
	if len(keys) != len(blocks) {
		return nil, fmt.Errorf("%w: %d keys and %d block lists", ErrInvalid, len(keys), len(blocks))
	}
	bpk := c.ns.geo.BlocksPerKey()
	nb := c.layers[0].NumBlocks
	for _, t := range c.layers {
		nb = min(nb, t.NumBlocks)
	}
	for i, k := range keys {
		if len(k) == 0 || len(k) > abi.MaxKeyLen {
			return nil, fmt.Errorf("%w: key %d: length %d: want 1..%d", ErrInvalid, i, len(k), abi.MaxKeyLen)
		}
		if len(blocks[i]) != bpk {
			return nil, fmt.Errorf("%w: key %d: %d blocks: want %d", ErrInvalid, i, len(blocks[i]), bpk)
		}
		for _, b := range blocks[i] {
			if b < 0 || b >= nb {
				return nil, fmt.Errorf("%w: key %d: block %d outside 0..%d", ErrInvalid, i, b, nb-1)
			}
		}
	}
	return c, nil
}

// Job is a store or load in progress.
type Job struct {
	id     JobID
	kind   string
	done   chan struct{}
	cancel context.CancelFunc
	start  time.Time
	res    Result
	bytes  atomic.Int64
}

// ID returns the job's id.
func (j *Job) ID() JobID { return j.id }

// Done is closed when the job has finished.
func (j *Job) Done() <-chan struct{} { return j.done }

// Cancel asks the job to stop; keys not finished end OutcomeFailed with
// context.Canceled. Published files stay published.
func (j *Job) Cancel() { j.cancel() }

// Wait waits for the job and returns its result and Result.Err(), or ctx's
// error if ctx ends first (the job goes on).
func (j *Job) Wait(ctx context.Context) (Result, error) {
	select {
	case <-j.done:
		return j.res, j.res.Err()
	case <-ctx.Done():
		return Result{}, ctx.Err()
	}
}

func (e *Engine) newJob(ctx context.Context, kind string, n int) (*Job, context.Context, error) {
	ctx, cancel := context.WithCancel(ctx)
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		cancel()
		return nil, nil, ErrClosed
	}
	e.lastJob++
	j := &Job{id: JobID(e.lastJob), kind: kind, done: make(chan struct{}), cancel: cancel, start: time.Now()}
	j.res.Keys = make([]KeyResult, n)
	e.jobs[j.id] = j
	e.jobsWG.Add(1)
	return j, ctx, nil
}

func (e *Engine) finish(j *Job) {
	j.res.Bytes = j.bytes.Load()
	j.res.Duration = time.Since(j.start)
	for i, k := range j.res.Keys {
		if k.Outcome == OutcomePending {
			j.res.Keys[i] = KeyResult{Outcome: OutcomeFailed, Err: fmt.Errorf("engine: %s job %d: key not processed", j.kind, j.id)}
		}
		if j.res.Keys[i].Outcome == OutcomeFailed {
			e.st.failures.Add(1)
			e.fails.add(j.kind, j.res.Keys[i].Err, time.Now())
		}
	}
	e.mu.Lock()
	delete(e.jobs, j.id)
	e.mu.Unlock()
	j.cancel()
	close(j.done)
	e.jobsWG.Done()
}

// Stats returns the engine's counters and per-mount usage.
func (e *Engine) Stats() Stats {
	s := Stats{
		Stores: e.st.stores.Load(), Loads: e.st.loads.Load(), Hits: e.st.hits.Load(), Misses: e.st.misses.Load(),
		Evictions: e.st.evictions.Load(), Failures: e.st.failures.Load(), Corrupt: e.st.corrupt.Load(),
		Vanished: e.st.vanished.Load(), BytesWritten: e.st.written.Load(), BytesRead: e.st.read.Load(),
		StoreFailures: e.fails.stats(0), LoadFailures: e.fails.stats(1),
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	s.Entries, s.Keys = len(e.entries), len(e.byKey)
	for _, m := range e.mounts {
		s.Mounts = append(s.Mounts, MountStats{
			Path: m.root, Capacity: m.capacity, Configured: m.configured, Reserve: m.reserve, Used: m.used, Entries: m.entries,
			Direct: m.direct, IO: m.ioName(), Backend: m.backend, Checksums: m.checksums,
		})
	}
	return s
}

// Close stops accepting requests and waits for the jobs in flight; if ctx
// ends first it cancels them and waits for them to unwind. Temporary files
// of cancelled stores are removed. Close returns ctx's error in that case.
func (e *Engine) Close(ctx context.Context) error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.closed = true
	e.mu.Unlock()
	done := make(chan struct{})
	go func() { e.jobsWG.Wait(); close(done) }()
	var err error
	select {
	case <-done:
	case <-ctx.Done():
		err = ctx.Err()
		e.mu.Lock()
		for _, j := range e.jobs {
			j.cancel()
		}
		e.mu.Unlock()
		<-done
	}
	e.hitRec.close()
	e.host.Close()
	if e.ownPolicy {
		err = errors.Join(err, e.pol.Close(context.WithoutCancel(ctx)))
	}
	if e.lock != nil {
		e.lock.Close() // releases the flock
	}
	return err
}

// Index returns the engine's index as a policy host sees it.
func (e *Engine) Index() policy.Index { return indexView{e} }

// indexView implements policy.Index over the engine.
type indexView struct{ e *Engine }

var _ policy.Index = indexView{}

// Lookup returns the entry with the given id.
func (v indexView) Lookup(id uint64) (policy.Entry, bool) {
	e := v.e
	e.mu.Lock()
	defer e.mu.Unlock()
	en, ok := e.entries[id]
	if !ok {
		return policy.Entry{}, false
	}
	return en.policyEntry(), true
}

// Range calls fn for every entry until fn returns false. fn runs without the
// engine's lock held, on a snapshot.
func (v indexView) Range(fn func(policy.Entry) bool) {
	e := v.e
	e.mu.Lock()
	snap := make([]policy.Entry, 0, len(e.entries))
	for _, en := range e.entries {
		snap = append(snap, en.policyEntry())
	}
	e.mu.Unlock()
	for _, en := range snap {
		if !fn(en) {
			return
		}
	}
}

// Namespaces returns every declared namespace.
func (v indexView) Namespaces() []abi.NamespaceRecord {
	e := v.e
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []abi.NamespaceRecord
	for _, ns := range e.nss {
		if ns.declared {
			out = append(out, ns.rec)
		}
	}
	return out
}

func (en *entry) policyEntry() policy.Entry {
	return policy.Entry{
		ID: en.id, KeyHash: abi.KeyHash([]byte(en.keys[0])), Size: uint64(en.size), Mount: uint32(en.mount),
		NS: uint32(en.ns), LastAccess: uint64(en.last), Hits: en.hits, Pins: uint32(en.pins),
	}
}

func (en *entry) access(kind uint32, t int64) abi.AccessRecord {
	return abi.AccessRecord{
		Entry: en.id, Time: uint64(t), Size: uint64(en.size), KeyHash: abi.KeyHash([]byte(en.keys[0])),
		Kind: kind, Mount: uint32(en.mount), NS: uint32(en.ns), Hits: en.hits,
	}
}

// access reports events to the policy, in batches. A policy failure here is
// logged, never fatal to the operation that caused it.
func (e *Engine) access(ctx context.Context, recs []abi.AccessRecord) {
	for len(recs) > 0 {
		n := min(len(recs), abi.MaxBatch)
		if err := e.pol.Access(context.WithoutCancel(ctx), recs[:n]); err != nil {
			e.log.Warn("engine: policy access", "err", err)
		}
		recs = recs[n:]
	}
}

// insertLocked indexes en, replacing any entry at its path or holding its
// keys (returned, already unindexed).
func (e *Engine) insertLocked(en *entry) []*entry {
	var replaced []*entry
	if old := e.byPath[en.path]; old != nil {
		e.unindexLocked(old)
		replaced = append(replaced, old)
	}
	e.lastID++
	en.id = e.lastID
	e.entries[en.id] = en
	e.byPath[en.path] = en
	for i, k := range en.keys {
		e.byKey[keyID{en.fp, k}] = keyRef{e: en, idx: i}
	}
	m := e.mounts[en.mount]
	m.used += en.size
	m.entries++
	return replaced
}

// unindexLocked removes en from the index.
func (e *Engine) unindexLocked(en *entry) {
	if en.gone {
		return
	}
	en.gone = true
	delete(e.entries, en.id)
	if e.byPath[en.path] == en {
		delete(e.byPath, en.path)
	}
	for _, k := range en.keys {
		if ref, ok := e.byKey[keyID{en.fp, k}]; ok && ref.e == en {
			delete(e.byKey, keyID{en.fp, k})
		}
	}
	m := e.mounts[en.mount]
	m.used -= en.size
	m.entries--
}

// drop removes en from the index, tells the policy, and, if remove is set,
// removes its file (holding its path meanwhile, so that a store publishing
// a new file there waits and its file is never the one removed). It
// reports whether en was still indexed, that is, whether this call
// dropped it.
func (e *Engine) drop(ctx context.Context, en *entry, remove bool, why string) bool {
	e.mu.Lock()
	was := !en.gone
	e.unindexLocked(en)
	rec := en.access(abi.AccessRemove, e.now().UnixNano())
	claimed := was && remove && e.removeLocked(en)
	e.mu.Unlock()
	if !was {
		return false
	}
	if claimed {
		e.removeClaimed(en)
	}
	e.log.Debug("engine: entry dropped", "path", en.path, "why", why)
	e.access(ctx, []abi.AccessRecord{rec})
	return true
}

// resolve joins a policy-chosen relative path under its mount, re-checking
// that it cannot escape the root.
func (e *Engine) resolve(rec *abi.NameRecord) (int, string, error) {
	if int(rec.Mount) >= len(e.mounts) {
		return 0, "", fmt.Errorf("%w: mount %d of %d", ErrPolicy, rec.Mount, len(e.mounts))
	}
	p := rec.Path()
	if err := abi.CheckPath(p); err != nil {
		return 0, "", fmt.Errorf("%w: %w", ErrPolicy, err)
	}
	root := e.mounts[rec.Mount].root
	full := filepath.Join(root, string(p))
	if !strings.HasPrefix(full, root+string(filepath.Separator)) {
		return 0, "", fmt.Errorf("%w: path %q escapes %s", ErrPolicy, p, root)
	}
	return int(rec.Mount), full, nil
}

// names asks the policy for the mount and path of every key.
func (e *Engine) names(ctx context.Context, ns *namespace, keys [][]byte) ([]int, []string, []error, error) {
	mounts := make([]int, len(keys))
	paths := make([]string, len(keys))
	errs := make([]error, len(keys))
	recs := make([]abi.NameRecord, min(len(keys), abi.MaxBatch))
	for start := 0; start < len(keys); start += abi.MaxBatch {
		batch := keys[start:min(len(keys), start+abi.MaxBatch)]
		rs := recs[:len(batch)]
		for i, k := range batch {
			rs[i] = abi.NameRecord{NS: uint32(ns.id), Fingerprint: ns.fp, TPRank: uint32(ns.geo.TPRank), MountCount: uint32(len(e.mounts))}
			rs[i].SetKey(k)
		}
		if err := e.pol.Name(ctx, rs); err != nil {
			return nil, nil, nil, fmt.Errorf("%w: name: %w", ErrPolicy, err)
		}
		for i := range rs {
			mounts[start+i], paths[start+i], errs[start+i] = e.resolve(&rs[i])
		}
	}
	return mounts, paths, errs, nil
}

// verify checks, cheaply (one stat), that en's file is still the one
// indexed. A file removed or replaced behind the engine's back drops the
// entry; verify then reports false.
func (e *Engine) verify(ctx context.Context, en *entry) bool {
	fi, err := e.fs.Stat(en.path)
	if err == nil {
		var id fsys.Identity
		if id, err = fsys.IdentityOf(fi); err == nil && id.Same(en.ident) {
			en.verified.Store(e.now().UnixNano())
			return true
		}
	}
	why := "vanished"
	switch {
	case err == nil:
		why = "replaced"
	case !errors.Is(err, os.ErrNotExist):
		// Cannot tell (EIO, EACCES...): a miss for now, but keep the entry.
		e.log.Warn("engine: stat", "path", en.path, "err", err)
		return false
	}
	e.st.vanished.Add(1)
	e.drop(ctx, en, false, why)
	return false
}

// recentlyVerified reports whether en's file was checked within
// Config.VerifyInterval of now (Unix nanoseconds).
func (e *Engine) recentlyVerified(en *entry, now int64) bool {
	iv := e.cfg.VerifyInterval
	return iv > 0 && now-en.verified.Load() < int64(iv)
}

// Lookup returns how many leading keys of ns are stored. A hit is checked
// against the file system (a stat per file: same inode, same size) unless
// it was checked within Config.VerifyInterval: a file removed or replaced
// behind the engine's back is a miss once checked, so it stays a hit for at
// most VerifyInterval (with 0, every hit is checked and none is stale).
// Loads always open and check the file. The first key missing from the
// index is looked for under its policy name, so files published by another
// node sharing the mount are found.
func (e *Engine) Lookup(ctx context.Context, ns NamespaceID, keys [][]byte) (int, error) {
	n, err := e.namespace(ns)
	if err != nil {
		return 0, err
	}
	hits := make([]abi.AccessRecord, 0, min(len(keys), 64))
	defer func() { e.hitRec.add(ctx, hits) }()
	// The entries already counted, to count a file of several keys once:
	// a short slice (keys of one file are neighbours), a map for long
	// requests.
	var seen []*entry
	var seenMap map[*entry]bool
	if len(keys) > 64 {
		seenMap = map[*entry]bool{}
	}
	counted := func(en *entry) bool {
		if seenMap != nil {
			return seenMap[en]
		}
		return slices.Contains(seen, en)
	}
	now := e.now().UnixNano()
	for i, k := range keys {
		if err := ctx.Err(); err != nil {
			return i, err
		}
		en := e.find(n, k)
		if en != nil && !counted(en) && !e.recentlyVerified(en, now) && !e.verify(ctx, en) {
			en = nil
		}
		if en == nil {
			en = e.discover(ctx, n, k)
		}
		if en == nil {
			e.st.misses.Add(1)
			return i, nil
		}
		e.st.hits.Add(1)
		if !counted(en) {
			if seenMap != nil {
				seenMap[en] = true
			} else {
				seen = append(seen, en)
			}
			e.mu.Lock()
			en.hits++
			en.last = now
			hits = append(hits, en.access(abi.AccessHit, now))
			e.mu.Unlock()
		}
	}
	return len(keys), nil
}

func (e *Engine) find(ns *namespace, key []byte) *entry {
	e.mu.Lock()
	defer e.mu.Unlock()
	if ref, ok := e.byKey[keyID{ns.fp, string(key)}]; ok {
		return ref.e
	}
	return nil
}

// discover looks for key under its policy name and indexes the file if its
// header says it holds the key in this geometry.
func (e *Engine) discover(ctx context.Context, ns *namespace, key []byte) *entry {
	mounts, paths, errs, err := e.names(ctx, ns, [][]byte{key})
	if err != nil || errs[0] != nil {
		return nil
	}
	e.mu.Lock()
	busy := e.inflight[paths[0]] != nil
	e.mu.Unlock()
	if busy {
		return nil
	}
	en, err := e.readEntry(mounts[0], paths[0])
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			e.log.Debug("engine: not a match", "path", paths[0], "err", err)
		}
		return nil
	}
	if _, err := en.match(ns.fp, key); err != nil {
		e.log.Info("engine: file under the key's name belongs to another key or geometry", "path", paths[0], "err", err)
		return nil
	}
	return e.adopt(ctx, en)
}

// adopt indexes an entry found on disk and tells the policy.
func (e *Engine) adopt(ctx context.Context, en *entry) *entry {
	e.mu.Lock()
	if old := e.byPath[en.path]; old != nil && old.ident.Same(en.ident) && old.fid == en.fid {
		e.mu.Unlock()
		return old
	}
	id, ok := e.nsByFP[en.fp]
	if !ok {
		id = e.newNamespaceLocked(en.fp)
	}
	en.ns = id
	replaced := e.insertLocked(en)
	var recs []abi.AccessRecord
	for _, r := range replaced {
		recs = append(recs, r.access(abi.AccessRemove, en.last))
	}
	recs = append(recs, en.access(abi.AccessInsert, en.last))
	e.mu.Unlock()
	e.access(ctx, recs)
	return en
}

func (en *entry) match(fp uint64, key []byte) (int, error) {
	if en.fp != fp {
		return -1, fmt.Errorf("%w: %w: file 0x%016x, want 0x%016x", ErrMismatch, format.ErrFingerprint, en.fp, fp)
	}
	for i, k := range en.keys {
		if k == string(key) {
			return i, nil
		}
	}
	return -1, fmt.Errorf("%w: %w", ErrMismatch, format.ErrKey)
}

// errNotRegular: a name where a kvhost file should be is not a regular
// file (a directory, a socket...).
var errNotRegular = errors.New("engine: not a regular file")

// readEntry reads the header of the file at path into an unindexed entry.
func (e *Engine) readEntry(mnt int, path string) (*entry, error) {
	f, err := e.fs.OpenFile(path, os.O_RDONLY, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if fi, err := fsys.Fstat(f); err == nil && !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%w: %s (%v)", errNotRegular, path, fi.Mode().Type())
	}
	h, err := readHeader(f)
	if err != nil {
		return nil, err
	}
	// The open file, not the name: the identity must be that of the file
	// whose header was read, even if the name was replaced meanwhile.
	id, err := fileIdentity(f)
	if err != nil {
		return nil, err
	}
	if id.Size < h.FileLen() {
		return nil, fmt.Errorf("%w: %s: %d bytes, header says %d", ErrCorrupt, path, id.Size, h.FileLen())
	}
	return e.entryOf(mnt, path, h, id), nil
}

// entryOf returns an unindexed entry for the file at path with header h
// and identity id.
func (e *Engine) entryOf(mnt int, path string, h *format.Header, id fsys.Identity) *entry {
	en := &entry{fp: h.Fingerprint, mount: mnt, path: path, size: id.Size, ident: id, fid: h.ID, last: id.Mtime}
	en.verified.Store(e.now().UnixNano())
	for _, k := range h.Keys {
		en.keys = append(en.keys, string(k.Key))
	}
	return en
}

// readHeader reads and decodes the header at the start of f, with aligned
// buffers so that it works on files opened with O_DIRECT.
func readHeader(f fsys.File) (*format.Header, error) {
	buf := staging.AlignedBuffer(format.Align)
	n, err := f.ReadAt(buf, 0)
	if n < format.FixedLen {
		if err == nil || errors.Is(err, io.EOF) {
			err = format.ErrTruncated
		}
		return nil, fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	h, err := format.Decode(buf[:n])
	var te *format.TruncatedError
	if errors.As(err, &te) && te.Need <= format.MaxHeaderLen && n == len(buf) {
		buf = staging.AlignedBuffer((te.Need + format.Align - 1) / format.Align * format.Align)
		if n, _ = f.ReadAt(buf, 0); n < te.Need {
			return nil, fmt.Errorf("%w: %w", ErrCorrupt, format.ErrTruncated)
		}
		h, err = format.Decode(buf[:n])
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	return h, nil
}

// Delete removes the files holding any of keys (a file holding several keys
// goes with all of them) and returns how many of the requested keys were
// stored and are now removed: a key repeated in keys counts once, and the
// other keys of a removed file are not counted. A load that has not yet
// opened a deleted file reports it missing.
func (e *Engine) Delete(ctx context.Context, ns NamespaceID, keys [][]byte) (int, error) {
	n, err := e.namespace(ns)
	if err != nil {
		return 0, err
	}
	// The entries first: removing a file unindexes its other keys.
	byEntry := map[*entry]int{} // requested keys held by each entry
	var order []*entry
	seen := map[string]bool{}
	for _, k := range keys {
		if seen[string(k)] {
			continue
		}
		seen[string(k)] = true
		if en := e.find(n, k); en != nil {
			if byEntry[en] == 0 {
				order = append(order, en)
			}
			byEntry[en]++
		}
	}
	removed := 0
	for _, en := range order {
		if err := ctx.Err(); err != nil {
			return removed, err
		}
		if e.drop(ctx, en, true, "deleted") {
			removed += byEntry[en]
		}
	}
	return removed, nil
}
