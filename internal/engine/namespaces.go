package engine

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/kvhost/kvhost/abi"
)

// Declare registers a geometry and returns its namespace. Declaring the same
// geometry again returns the same id while it is declared or has files. A new geometry beyond
// Config.MaxNamespaces declared and not released is refused with ErrLimit.
func (e *Engine) Declare(ctx context.Context, g Geometry) (NamespaceID, error) {
	if err := e.calls.enter(); err != nil {
		return 0, err
	}
	defer e.calls.exit()
	if err := g.Validate(); err != nil {
		return 0, err
	}
	fp := g.Fingerprint()
	mounts := e.kvMounts
	lm := e.layoutMount(g.Model)
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
	} else if e.kvMounts == 0 {
		return 0, fmt.Errorf("%w: namespace %q: every mount is a vllm-fs mount serving its own namespace, and none serves this one", ErrInvalid, g.Model)
	}
	if sp, ok := e.pol.(*switchPolicy); ok {
		// A policy swap waits for this declaration to be marked, so
		// that the new policy is told of it (ReplacePolicy).
		sp.declMu.RLock()
		defer sp.declMu.RUnlock()
	}
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return 0, ErrClosed
	}
	id, ok := e.nsByFP[fp]
	if ok && lm == nil && e.nss[id].geo.Model != "" && e.nss[id].geo != g {
		other := e.nss[id].geo
		e.mu.Unlock()
		return 0, fingerprintCollision(g, fp, id, other)
	}
	if ok && e.nss[id].declared {
		if lm != nil && e.nss[id].geo != g {
			e.mu.Unlock()
			return 0, fmt.Errorf("%w: namespace %q: vllm-fs mount %s already serves it with another geometry (%+v)", ErrInvalid, g.Model, lm.root, e.nss[id].geo)
		}
		e.mu.Unlock()
		return id, nil
	}
	var short []*entry // rows cut short on the vllm-fs mount, dropped below
	if lm != nil {
		var err error
		if short, err = e.bindLayoutLocked(lm, g); err != nil {
			e.mu.Unlock()
			return 0, err
		}
	}
	counted := false // by this call
	if !ok || !e.nss[id].counted {
		// Every namespace costs state here and in every policy shard: bound
		// them.
		if e.declares >= e.cfg.MaxNamespaces {
			e.mu.Unlock()
			return 0, fmt.Errorf("%w: namespace %q: %d namespaces declared, the limit (Config.MaxNamespaces) is %d", ErrLimit, g.Model, e.declares, e.cfg.MaxNamespaces)
		}
		if !ok {
			id = e.newNamespaceLocked(fp)
		}
		e.nss[id].counted = true
		e.declares++
		counted = true
	}
	e.nss[id].declaring++
	e.mu.Unlock()
	if len(short) > 0 {
		// Before the namespace is declared: no request finds them.
		e.dropShort(ctx, lm, short)
	}

	rec, err := e.pol.Namespace(ctx, g.record(id, mounts))
	if err != nil {
		// The client sees the error; the operator must too (a plugin
		// whose shards choose different layouts refuses every model).
		e.log.Warn("engine: the policy refused a namespace", "ns", id, "model", g.Model, "err", err)
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
	e.mu.Lock()
	ns := e.nss[id]
	ns.declaring--
	if err == nil && lm == nil && ns.geo.Model != "" && ns.geo != g {
		// Another geometry of the same fingerprint was declared meanwhile.
		err = fingerprintCollision(g, fp, id, ns.geo)
	}
	if err != nil {
		// Refused: the count this call took goes back, unless another
		// declaration of the namespace succeeded meanwhile.
		if counted && ns.counted && !ns.declared {
			ns.counted = false
			e.declares--
		}
		e.freeUnusedLocked(ns)
		e.mu.Unlock()
		return 0, err
	}
	work := false
	if !ns.counted {
		// A refused declaration gave back the count this one relied on.
		ns.counted = true
		e.declares++
	}
	if !ns.declared {
		ns.declared, ns.geo, ns.rec = true, g, rec
		ns.keysPerFile, ns.order = int(rec.KeysPerFile), rec.Order
		ns.layout = lm
		where := LayoutKVHost
		if lm != nil {
			where = LayoutVLLMFS + " " + lm.root
		}
		e.log.Info("engine: namespace declared", "ns", id, "model", g.Model, "fingerprint", fmt.Sprintf("%016x", ns.fp),
			"tp_rank", g.TPRank, "tp_size", g.TPSize, "key_bytes", g.KeyBytes(), "layout", where)
		work = e.predictSparesLocked(ns)
	}
	e.mu.Unlock()
	e.wakeMaker(work)
	return id, nil
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
// (sweepNamespacesLocked); where it has none, its id goes back
// (freeUnusedLocked) and a later new geometry may take it. It fails with ErrUnknownNamespace for an id Declare never
// returned, and with ErrInvalid while caches of the namespace are still
// registered. Releasing a released namespace does nothing.
func (e *Engine) Release(ns NamespaceID) error {
	if err := e.calls.enter(); err != nil {
		return err
	}
	defer e.calls.exit()
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
	e.wakeMaker(e.forgetAheadLocked(ns)) // its share of the spares goes to the others
	e.freeUnusedLocked(n)
	return nil
}

// freeUnusedLocked gives n's id back (newNamespaceLocked takes it again)
// where nothing names it: n is not declared, no declaration of it is
// under way, no file found on the mounts is being indexed in it
// (namespaceOf to adoptDone), and it has no file (no store runs without a
// cache). So geometries declared and released, or refused, without
// files, and namespaces whose files have all gone since (evicted,
// deleted, purged, vanished: sweepNamespacesLocked), do not use up ids,
// which policies bound (65,536 for the built-in ones) and which each
// hold state. e.mu is held.
func (e *Engine) freeUnusedLocked(n *namespace) {
	if n.declared || n.declaring > 0 || n.adopting > 0 || n.layout != nil || e.ix.Holds(n.fp) {
		return
	}
	delete(e.nsByFP, n.fp)
	e.nss[n.id] = &namespace{id: n.id}
	e.freeNS = append(e.freeNS, n.id)
}

// namespaceOf returns the namespace of files of fingerprint fp, created
// (undeclared, not counted against Config.MaxNamespaces) if there is none:
// files found on disk are indexed in the namespace of their geometry.
// The caller indexes the file, or gives up, then calls adoptDone: until
// then the id is not given back.
func (e *Engine) namespaceOf(fp uint64) NamespaceID {
	e.mu.Lock()
	defer e.mu.Unlock()
	id, ok := e.nsByFP[fp]
	if !ok {
		id = e.newNamespaceLocked(fp)
	}
	e.nss[id].adopting++
	return id
}

// adoptDone ends what namespaceOf began for each of ids, the file given
// the id indexed or not.
func (e *Engine) adoptDone(ids ...NamespaceID) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, id := range ids {
		e.nss[id].adopting--
	}
}

// newNamespaceLocked makes a namespace of fingerprint fp under an id
// Release gave back, else a new one. e.mu is held.
func (e *Engine) newNamespaceLocked(fp uint64) NamespaceID {
	var id NamespaceID
	if len(e.freeNS) == 0 && len(e.nss) >= e.sweepNS {
		e.sweepNamespacesLocked()
	}
	if n := len(e.freeNS); n > 0 {
		id, e.freeNS = e.freeNS[n-1], e.freeNS[:n-1]
		e.nss[id] = &namespace{id: id, fp: fp}
	} else {
		id = NamespaceID(len(e.nss))
		e.nss = append(e.nss, &namespace{id: id, fp: fp})
	}
	e.nsByFP[fp] = id
	return id
}

// sweepNamespacesLocked gives back the ids of the namespaces that nothing
// names any more (freeUnusedLocked): released while they had files, or
// found on the mounts, and whose files have all gone since. Release gives
// back only the ids of namespaces without files, and no file's removal
// looks at its namespace, so without it every model that ever stored a
// file kept its id until a restart: models coming and going used ids up.
// It runs when a new id is wanted and none was given back, once there
// are twice as many ids as were in use at the last sweep, and 64 more:
// ids stay within that of the most in use, and a sweep's cost, a look at
// every namespace, is spread over the ids it gives back, at least half.
// e.mu is held.
func (e *Engine) sweepNamespacesLocked() {
	for _, n := range e.nss {
		if id, ok := e.nsByFP[n.fp]; ok && id == n.id {
			e.freeUnusedLocked(n)
		}
	}
	e.sweepNS = 2*(len(e.nss)-len(e.freeNS)) + 64
}

// KeysPerFile is how many consecutive keys of one store namespace ns packs
// into a file at most: the layout its policy chose when it was declared (1
// unless the policy packs; a store of fewer keys writes fewer). It fails
// with ErrUnknownNamespace for a namespace not declared now, and with
// ErrClosed once the engine is closed.
func (e *Engine) KeysPerFile(ns NamespaceID) (int, error) {
	e.mu.RLock() // a Release and a new Declare rewrite the layout under the lock
	defer e.mu.RUnlock()
	n, err := e.namespaceLocked(ns)
	if err != nil {
		return 0, err
	}
	return n.keysPerFile, nil
}

// Fingerprint is the fingerprint ns's keys are indexed and mirrored into
// a lookup table under (MirrorKeys): its geometry's (Geometry.Fingerprint),
// or for a namespace a vllm-fs mount serves, the mount's files'. It fails
// as KeysPerFile does.
func (e *Engine) Fingerprint(ns NamespaceID) (uint64, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	n, err := e.namespaceLocked(ns)
	if err != nil {
		return 0, err
	}
	return n.fp, nil
}

func (e *Engine) namespace(id NamespaceID) (*namespace, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	return e.namespaceLocked(id)
}

// namespaceLocked is namespace with e.mu held.
func (e *Engine) namespaceLocked(id NamespaceID) (*namespace, error) {
	if e.closed {
		return nil, ErrClosed
	}
	if int(id) >= len(e.nss) || !e.nss[id].declared {
		return nil, fmt.Errorf("%w: %d", ErrUnknownNamespace, id)
	}
	return e.nss[id], nil
}

// namespaceStats lists what the index holds of each namespace with files
// indexed or declared now (Stats.Namespaces): the most bytes first, then
// by model id and fingerprint.
func (e *Engine) namespaceStats() []NamespaceStats {
	counts := e.ix.FingerprintCounts()
	e.mu.RLock()
	out := make([]NamespaceStats, 0, len(counts))
	for fp, c := range counts {
		ns := NamespaceStats{Fingerprint: fp, Files: c.Files, Keys: c.Keys, Bytes: c.Bytes}
		if id, ok := e.nsByFP[fp]; ok {
			ns.Model, ns.Declared = e.nss[id].geo.Model, e.nss[id].declared
		}
		out = append(out, ns)
	}
	for _, n := range e.nss {
		if _, ok := counts[n.fp]; !ok && n.declared {
			out = append(out, NamespaceStats{Fingerprint: n.fp, Model: n.geo.Model, Declared: true})
		}
	}
	e.mu.RUnlock()
	slices.SortFunc(out, func(a, b NamespaceStats) int {
		return cmp.Or(cmp.Compare(b.Bytes, a.Bytes), strings.Compare(a.Model, b.Model), cmp.Compare(a.Fingerprint, b.Fingerprint))
	})
	return out
}
