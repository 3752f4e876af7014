package engine

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/internal/engine/index"
)

// tables are the engine-wide tables: the namespaces by id and
// fingerprint, the ids given back, the caches, and whether the engine is
// closed. Its lock is its own: no other file takes it. Readers (a
// request's namespace and cache) share it; writers (Declare, Release,
// RegisterCache, Close) hold it alone, briefly. In the lock order it
// comes after pinTab.mu and before the index's and the space's locks
// (Engine). Nothing holding it calls the policy: a caller's step that
// must run under it (a vllm-fs binding, the spares' guess) is passed in
// as a function.
type tables struct {
	mu       sync.RWMutex
	closed   bool
	nss      []*namespace // by NamespaceID
	byFP     map[uint64]NamespaceID
	free     []NamespaceID // ids Release gave back (namespaces without files), taken first
	sweepAt  int           // ids at which a new one with none given back sweeps (sweepLocked)
	caches   map[CacheID]*cache
	lastCach uint64
	declares int // namespaces counted against max
	max      int // Config.MaxNamespaces
	// holds reports whether the index holds a file of fingerprint fp
	// (index.Counts.Holds): such a namespace's id is not given back.
	holds func(fp uint64) bool
	// budgets are Config.Budgets (budget.go), set at Open; nil for none.
	budgets *budgetSet
	// books are the model books (modelbook.go), set at Open (setBooks)
	// once read: the model id of namespaces found on the mounts before
	// their clients declare them.
	books *modelBook
}

// newTables returns empty tables bounding declarations at max.
func newTables(max int, holds func(fp uint64) bool) *tables {
	return &tables{byFP: map[uint64]NamespaceID{}, caches: map[CacheID]*cache{}, max: max, holds: holds}
}

// close marks the tables closed, calling first (once, under the lock)
// where this call closed them, and reports whether it did.
func (t *tables) close(first func()) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return false
	}
	t.closed = true
	first()
	return true
}

// isClosed reports whether close ran.
func (t *tables) isClosed() bool {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return t.closed
}

// Declare registers a geometry and returns its namespace. Declaring the same
// geometry again returns the same id while it is declared or has files. A new geometry beyond
// Config.MaxNamespaces declared and not released is refused with ErrLimit.
func (e *Engine) Declare(ctx context.Context, g Geometry) (NamespaceID, error) {
	if err := e.busy.calls.enter(); err != nil {
		return 0, err
	}
	defer e.busy.calls.exit()
	if err := g.Validate(); err != nil {
		return 0, err
	}
	fp := g.Fingerprint()
	mounts := e.nm.kvMounts
	lm := e.vllm.layoutMount(g.Model)
	if lm != nil {
		// Its files carry no fingerprint: they are the mount's.
		fp, mounts = lm.raw.fp, len(e.mounts)
	} else if strings.HasPrefix(g.Model, ModelPrefix) {
		// A client asking for a vllm-fs directory by its base name:
		// another base means other fields (a geometry mistake), never
		// a new namespace elsewhere.
		var bases []string
		for _, m := range e.mounts {
			if m.raw != nil {
				bases = append(bases, m.raw.model)
			}
		}
		return 0, fmt.Errorf("%w: namespace %q: no vllm-fs mount serves it (the fs tier's fields differ from every mount's; served: %v)", ErrInvalid, g.Model, bases)
	} else if e.nm.kvMounts == 0 {
		return 0, fmt.Errorf("%w: namespace %q: every mount is a vllm-fs mount serving its own namespace, and none serves this one", ErrInvalid, g.Model)
	}
	if sp, ok := e.pol.Policy.(*switchPolicy); ok {
		// A policy swap waits for this declaration to be marked, so
		// that the new policy is told of it (ReplacePolicy).
		sp.declMu.RLock()
		defer sp.declMu.RUnlock()
	}
	var bind func() ([]*entry, error)
	if lm != nil {
		bind = func() ([]*entry, error) { return e.vllm.bindLayoutLocked(lm, g) }
	}
	d, err := e.tables.beginDeclare(g, fp, lm, bind)
	if err != nil || d.done {
		return d.id, err
	}
	if len(d.short) > 0 {
		// Before the namespace is declared: no request finds them.
		e.vllm.dropShort(ctx, lm, d.short)
	}

	rec, err := e.pol.Namespace(ctx, g.record(d.id, mounts))
	if err != nil {
		// The client sees the error; the operator must too (a plugin
		// whose shards choose different layouts refuses every model).
		e.cfg.Logger.Warn("engine: the policy refused a namespace", "ns", d.id, "model", g.Model, "err", err)
		err = fmt.Errorf("%w: namespace %q: %w", ErrPolicy, g.Model, err)
	} else if lm != nil {
		// The layout decides: one row per file, in the row's order.
		rec.KeysPerFile, rec.Order = 1, abi.OrderLayerMajor
	}
	segs := int64(rec.KeysPerFile) * int64(g.SegmentsPerKey())
	switch {
	case err != nil:
	case rec.KeysPerFile < 1 || rec.KeysPerFile > abi.MaxKeysPerFile || (rec.Order != abi.OrderLayerMajor && rec.Order != abi.OrderBlockMajor):
		err = fmt.Errorf("%w: namespace %q: layout keys per file %d, order %d", ErrPolicy, g.Model, rec.KeysPerFile, rec.Order)
	case segs > MaxSegmentsPerFile:
		err = fmt.Errorf("%w: %w: namespace %q: KeysPerFile %d × SegmentsPerKey %d = %d segments per file: want at most %d (fewer keys per file, or larger blocks)",
			ErrInvalid, ErrPolicy, g.Model, rec.KeysPerFile, g.SegmentsPerKey(), segs, MaxSegmentsPerFile)
	}
	work, err := e.tables.endDeclare(d, g, fp, lm, rec, err, func(ns *namespace) bool {
		where := LayoutKVHost
		if lm != nil {
			where = LayoutVLLMFS + " " + lm.root
		}
		e.cfg.Logger.Info("engine: namespace declared", "ns", d.id, "model", g.Model, "fingerprint", fmt.Sprintf("%016x", ns.fp),
			"tp_rank", g.TPRank, "tp_size", g.TPSize, "key_bytes", g.KeyBytes(), "layout", where)
		return e.maker.predict(ns)
	})
	if err != nil {
		return 0, err
	}
	if lm == nil {
		e.tables.noteModel(g) // its model id kept for the next start
	}
	e.maker.wake(work)
	return d.id, nil
}

// declaring is what the first step of a declaration (beginDeclare)
// hands its second (endDeclare).
type declaring struct {
	id NamespaceID
	// done: the namespace was declared already, id is the answer.
	done bool
	// counted: this call counted the namespace against the bound.
	counted bool
	// short: rows cut short on the vllm-fs mount (bind), for the caller
	// to drop before the namespace is declared.
	short []*entry
}

// beginDeclare is Declare's first step under the lock: it finds or makes
// the namespace of fingerprint fp for g (of vllm-fs mount lm, or nil),
// counts it against the bound and marks a declaration under way. bind,
// where lm is set, checks g against the mount's files under the lock.
func (t *tables) beginDeclare(g Geometry, fp uint64, lm *mount, bind func() ([]*entry, error)) (declaring, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return declaring{}, ErrClosed
	}
	id, ok := t.byFP[fp]
	if ok && lm == nil && t.nss[id].geo.Model != "" && t.nss[id].geo != g {
		return declaring{}, fingerprintCollision(g, fp, id, t.nss[id].geo)
	}
	if ok && t.nss[id].declared {
		if lm != nil && t.nss[id].geo != g {
			return declaring{}, fmt.Errorf("%w: namespace %q: vllm-fs mount %s already serves it with another geometry (%+v)", ErrInvalid, g.Model, lm.root, t.nss[id].geo)
		}
		return declaring{id: id, done: true}, nil
	}
	var d declaring
	if bind != nil {
		var err error
		if d.short, err = bind(); err != nil {
			return declaring{}, err
		}
	}
	if !ok || !t.nss[id].counted {
		// Every namespace costs state here and in every policy shard: bound
		// them.
		if t.declares >= t.max {
			return declaring{}, fmt.Errorf("%w: namespace %q: %d namespaces declared, the limit (Config.MaxNamespaces) is %d", ErrLimit, g.Model, t.declares, t.max)
		}
		if !ok {
			id = t.newLocked(fp)
		}
		t.nss[id].counted = true
		t.declares++
		d.counted = true
	}
	t.nss[id].declaring++
	d.id = id
	return d, nil
}

// endDeclare is Declare's second step under the lock, after the policy
// answered rec or err: it declares the namespace, calling declared once
// where this call did (its result: the maker has work, reported), or
// gives back what beginDeclare took where the declaration failed.
func (t *tables) endDeclare(d declaring, g Geometry, fp uint64, lm *mount, rec abi.NamespaceRecord, err error, declared func(*namespace) bool) (work bool, _ error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	ns := t.nss[d.id]
	ns.declaring--
	if err == nil && lm == nil && ns.geo.Model != "" && ns.geo != g {
		// Another geometry of the same fingerprint was declared meanwhile.
		err = fingerprintCollision(g, fp, d.id, ns.geo)
	}
	if err != nil {
		// Refused: the count this call took goes back, unless another
		// declaration of the namespace succeeded meanwhile.
		if d.counted && ns.counted && !ns.declared {
			ns.counted = false
			t.declares--
		}
		t.freeUnusedLocked(ns)
		return false, err
	}
	if !ns.counted {
		// A refused declaration gave back the count this one relied on.
		ns.counted = true
		t.declares++
	}
	if !ns.declared {
		ns.declared, ns.geo, ns.rec = true, g, rec
		ns.keysPerFile, ns.order = int(rec.KeysPerFile), rec.Order
		ns.layout = lm
		work = declared(ns)
	}
	return work, nil
}

// fingerprintCollision is Declare's refusal of a geometry whose fingerprint
// is that of namespace id, known as another geometry: their files would
// carry the same fingerprint, so neither could tell the other's from its own.
func fingerprintCollision(g Geometry, fp uint64, id NamespaceID, other Geometry) error {
	return fmt.Errorf("%w: namespace %q: its geometry's fingerprint %016x is namespace %d's, declared as %+v; "+
		"the two could not tell each other's files apart (declare it under another model id)", ErrInvalid, g.Model, fp, id, other)
}

// Release ends the declaration of namespace ns: the server calls it when
// no client uses the namespace any more. The namespace stops counting
// against Config.MaxNamespaces and is unknown to requests until declared
// again; where it has files, they stay indexed, on disk and servable, and
// declaring it again returns the same id until they have all gone
// (tables.sweepLocked); where it has none, its id goes back
// (freeUnusedLocked) and a later new geometry may take it. It fails with ErrUnknownNamespace for an id Declare never
// returned, and with ErrInvalid while caches of the namespace are still
// registered. Releasing a released namespace does nothing.
func (e *Engine) Release(ns NamespaceID) error {
	if err := e.busy.calls.enter(); err != nil {
		return err
	}
	defer e.busy.calls.exit()
	work, err := e.tables.release(ns, e.maker.forget) // its share of the spares goes to the others
	e.maker.wake(work)
	return err
}

// release is Release under the lock; forget drops what the spares made
// ahead know of the namespace, and reports whether the maker then has
// work (reported).
func (t *tables) release(ns NamespaceID, forget func(NamespaceID) bool) (work bool, _ error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return false, ErrClosed
	}
	if int(ns) >= len(t.nss) || t.nss[ns].geo.Model == "" { // never declared
		return false, fmt.Errorf("%w: %d", ErrUnknownNamespace, ns)
	}
	n := t.nss[ns]
	if !n.declared {
		return false, nil
	}
	caches := 0
	for _, c := range t.caches {
		if c.ns == n {
			caches++
		}
	}
	if caches > 0 {
		return false, fmt.Errorf("%w: release of namespace %d (%q): %d caches are still registered", ErrInvalid, ns, n.geo.Model, caches)
	}
	n.declared = false
	if n.counted {
		n.counted = false
		t.declares--
	}
	work = forget(ns)
	t.freeUnusedLocked(n)
	return work, nil
}

// freeUnusedLocked gives n's id back (newLocked takes it again)
// where nothing names it: n is not declared, no declaration of it is
// under way, no file found on the mounts is being indexed in it
// (namespaceOf to adoptDone), and it has no file (no store runs without a
// cache). So geometries declared and released, or refused, without
// files, and namespaces whose files have all gone since (evicted,
// deleted, purged, vanished: sweepLocked), do not use up ids,
// which policies bound (65,536 for the built-in ones) and which each
// hold state. t.mu is held.
func (t *tables) freeUnusedLocked(n *namespace) {
	if n.declared || n.declaring > 0 || n.adopting > 0 || n.layout != nil || t.holds(n.fp) {
		return
	}
	delete(t.byFP, n.fp)
	t.nss[n.id] = &namespace{id: n.id}
	t.free = append(t.free, n.id)
}

// namespaceOf returns the namespace of files of fingerprint fp, created
// (undeclared, not counted against Config.MaxNamespaces) if there is none:
// files found on disk are indexed in the namespace of their geometry.
// The caller indexes the file, or gives up, then calls adoptDone: until
// then the id is not given back.
func (t *tables) namespaceOf(fp uint64) NamespaceID {
	t.mu.Lock()
	defer t.mu.Unlock()
	id, ok := t.byFP[fp]
	if !ok {
		id = t.newLocked(fp)
	}
	t.nss[id].adopting++
	return id
}

// adoptDone ends what namespaceOf began for each of ids, the file given
// the id indexed or not.
func (t *tables) adoptDone(ids ...NamespaceID) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, id := range ids {
		t.nss[id].adopting--
	}
}

// newLocked makes a namespace of fingerprint fp under an id
// Release gave back, else a new one. t.mu is held.
func (t *tables) newLocked(fp uint64) NamespaceID {
	var id NamespaceID
	if len(t.free) == 0 && len(t.nss) >= t.sweepAt {
		t.sweepLocked()
	}
	if n := len(t.free); n > 0 {
		id, t.free = t.free[n-1], t.free[:n-1]
		t.nss[id] = &namespace{id: id, fp: fp}
	} else {
		id = NamespaceID(len(t.nss))
		t.nss = append(t.nss, &namespace{id: id, fp: fp})
	}
	t.byFP[fp] = id
	return id
}

// sweepLocked gives back the ids of the namespaces that nothing
// names any more (freeUnusedLocked): released while they had files, or
// found on the mounts, and whose files have all gone since. Release gives
// back only the ids of namespaces without files, and no file's removal
// looks at its namespace, so without it every model that ever stored a
// file kept its id until a restart: models coming and going used ids up.
// It runs when a new id is wanted and none was given back, once there
// are twice as many ids as were in use at the last sweep, and 64 more:
// ids stay within that of the most in use, and a sweep's cost, a look at
// every namespace, is spread over the ids it gives back, at least half.
// t.mu is held.
func (t *tables) sweepLocked() {
	for _, n := range t.nss {
		if id, ok := t.byFP[n.fp]; ok && id == n.id {
			t.freeUnusedLocked(n)
		}
	}
	t.sweepAt = 2*(len(t.nss)-len(t.free)) + 64
}

// KeysPerFile is how many consecutive keys of one store namespace ns packs
// into a file at most: the layout its policy chose when it was declared (1
// unless the policy packs; a store of fewer keys writes fewer). It fails
// with ErrUnknownNamespace for a namespace not declared now, and with
// ErrClosed once the engine is closed.
func (e *Engine) KeysPerFile(ns NamespaceID) (k int, err error) {
	// A Release and a new Declare rewrite the layout under the lock.
	err = e.tables.read(ns, func(n *namespace) { k = n.keysPerFile })
	return k, err
}

// Fingerprint is the fingerprint ns's keys are indexed and mirrored into
// a lookup table under (MirrorKeys): its geometry's (Geometry.Fingerprint),
// or for a namespace a vllm-fs mount serves, the mount's files'. It fails
// as KeysPerFile does.
func (e *Engine) Fingerprint(ns NamespaceID) (fp uint64, err error) {
	err = e.tables.read(ns, func(n *namespace) { fp = n.fp })
	return fp, err
}

// read calls fn with declared namespace id under the lock, or returns
// namespace's error.
func (t *tables) read(id NamespaceID, fn func(*namespace)) error {
	t.mu.RLock()
	defer t.mu.RUnlock()
	n, err := t.namespaceLocked(id)
	if err != nil {
		return err
	}
	fn(n)
	return nil
}

// namespace returns declared namespace id: ErrClosed once the engine is
// closed, ErrUnknownNamespace for one not declared now.
func (t *tables) namespace(id NamespaceID) (*namespace, error) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return t.namespaceLocked(id)
}

// namespaceLocked is namespace with t.mu held.
func (t *tables) namespaceLocked(id NamespaceID) (*namespace, error) {
	if t.closed {
		return nil, ErrClosed
	}
	if int(id) >= len(t.nss) || !t.nss[id].declared {
		return nil, fmt.Errorf("%w: %d", ErrUnknownNamespace, id)
	}
	return t.nss[id], nil
}

// whileDeclared calls fn under the lock, shared, with whether namespace
// id is declared: Release, which waits for fn, then follows it.
func (t *tables) whileDeclared(id NamespaceID, fn func(declared bool)) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	fn(int(id) < len(t.nss) && t.nss[id].declared)
}

// declaredGeometry returns the geometry of the namespace of fingerprint
// fp where it is declared.
func (t *tables) declaredGeometry(fp uint64) (Geometry, bool) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	if id, ok := t.byFP[fp]; ok && t.nss[id].declared {
		return t.nss[id].geo, true
	}
	return Geometry{}, false
}

// known reports whether the tables are closed, and whether a namespace
// of fingerprint fp exists (declared or not).
func (t *tables) known(fp uint64) (closed, known bool) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	_, known = t.byFP[fp]
	return t.closed, known
}

// fingerprints reports whether the tables are closed, and the
// fingerprints of the namespaces declared with model id model since the
// engine opened (declared now or not).
func (t *tables) fingerprints(model string) (closed bool, fps []uint64) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	for _, n := range t.nss {
		if n.geo.Model == model {
			fps = append(fps, n.fp)
		}
	}
	return t.closed, fps
}

// records returns the policy's record of every declared namespace.
func (t *tables) records() []abi.NamespaceRecord {
	t.mu.RLock()
	defer t.mu.RUnlock()
	var out []abi.NamespaceRecord
	for _, ns := range t.nss {
		if ns.declared {
			out = append(out, ns.rec)
		}
	}
	return out
}

// stats lists what the index holds of each namespace with files
// indexed (counts, by fingerprint) or declared now (Stats.Namespaces):
// the most bytes first, then by model id and fingerprint.
func (t *tables) stats(counts map[uint64]index.FPCount) []NamespaceStats {
	t.mu.RLock()
	out := make([]NamespaceStats, 0, len(counts))
	for fp, c := range counts {
		ns := NamespaceStats{Fingerprint: fp, Files: c.Files, Keys: c.Keys, Bytes: c.Bytes}
		if id, ok := t.byFP[fp]; ok {
			ns.Model, ns.Declared = t.nss[id].geo.Model, t.nss[id].declared
		}
		out = append(out, ns)
	}
	for _, n := range t.nss {
		if _, ok := counts[n.fp]; !ok && n.declared {
			out = append(out, NamespaceStats{Fingerprint: n.fp, Model: n.geo.Model, Declared: true})
		}
	}
	t.mu.RUnlock()
	slices.SortFunc(out, func(a, b NamespaceStats) int {
		return cmp.Or(cmp.Compare(b.Bytes, a.Bytes), strings.Compare(a.Model, b.Model), cmp.Compare(a.Fingerprint, b.Fingerprint))
	})
	return out
}
