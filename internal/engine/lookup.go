package engine

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
)

// namer names keys' files: the policy's names on the kvhost mounts, or a
// vllm-fs mount's layout.
type namer struct {
	mounts   []*mount      // set as Open adds them
	kvMounts int           // mounts of kvhost's layout: the first ones; the rest are vllm-fs
	pol      policy.Policy // the engine's (a switchPolicy), set once Open has it
}

// resolve joins a policy-chosen relative path under its mount, re-checking
// that it cannot escape the root.
func (nm *namer) resolve(rec *abi.NameRecord) (int, string, error) {
	if int(rec.Mount) >= nm.kvMounts {
		// Mounts from kvMounts on are vllm-fs mounts: each serves its
		// own namespace only, named by the layout.
		return 0, "", fmt.Errorf("%w: mount %d of the %d kvhost mounts", ErrPolicy, rec.Mount, nm.kvMounts)
	}
	p := rec.Path()
	if err := abi.CheckPath(p); err != nil {
		return 0, "", fmt.Errorf("%w: %w", ErrPolicy, err)
	}
	root := nm.mounts[rec.Mount].root
	full := filepath.Join(root, string(p))
	if !strings.HasPrefix(full, root+string(filepath.Separator)) {
		return 0, "", fmt.Errorf("%w: path %q escapes %s", ErrPolicy, p, root)
	}
	return int(rec.Mount), full, nil
}

// names asks the policy for the mount and path of every key.
func (nm *namer) names(ctx context.Context, ns *namespace, keys [][]byte) ([]int, []string, []error, error) {
	mounts := make([]int, len(keys))
	paths := make([]string, len(keys))
	errs := make([]error, len(keys))
	if m := ns.layout; m != nil {
		// A vllm-fs mount's namespace: the layout names every file.
		for i, k := range keys {
			mounts[i] = m.idx
			rel, err := m.raw.layout.Path(k)
			if err != nil {
				errs[i] = fmt.Errorf("%w: %w", ErrInvalid, err)
				continue
			}
			paths[i] = filepath.Join(m.root, filepath.FromSlash(rel))
		}
		return mounts, paths, errs, nil
	}
	recs := make([]abi.NameRecord, min(len(keys), abi.MaxBatch))
	for start := 0; start < len(keys); start += abi.MaxBatch {
		batch := keys[start:min(len(keys), start+abi.MaxBatch)]
		rs := recs[:len(batch)]
		for i, k := range batch {
			rs[i] = abi.NameRecord{NS: uint32(ns.id), Fingerprint: ns.fp, TPRank: uint32(ns.geo.TPRank), MountCount: uint32(nm.kvMounts)}
			rs[i].SetKey(k)
		}
		if err := nm.pol.Name(ctx, rs); err != nil {
			return nil, nil, nil, fmt.Errorf("%w: name: %w", ErrPolicy, err)
		}
		for i := range rs {
			mounts[start+i], paths[start+i], errs[start+i] = nm.resolve(&rs[i])
		}
	}
	return mounts, paths, errs, nil
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
	n, err := e.enterNamespace(ns)
	if err != nil {
		return 0, err
	}
	defer e.busy.calls.exit()
	// The index's lock is taken twice, whatever the number of keys: once
	// to find every key's entry, once to count the hits. Loads and stores
	// take the same lock; a lookup that took it per key queued behind them
	// once per key (docs/engine.md, "Lookup and delete").
	found := e.ix.Files().GetAll(n.fp, keys, nil)
	// The entries hit, each once: a file of several keys is counted once
	// (a short slice, keys of one file are neighbours; a map for long
	// requests).
	hit := make([]*entry, 0, min(len(keys), 64))
	var seenMap map[*entry]bool
	if len(keys) > 64 {
		seenMap = map[*entry]bool{}
	}
	counted := func(en *entry) bool {
		if seenMap != nil {
			return seenMap[en]
		}
		return slices.Contains(hit, en)
	}
	now := e.cfg.Now().UnixNano()
	// countHits counts a hit at now on each entry hit, under one hold of
	// the index's lock, and reports them to the policy off the lookup's
	// path.
	countHits := func() {
		if len(hit) > 0 {
			e.pol.hitRec.add(ctx, e.ix.Pins().Hit(hit, now))
		}
	}
	stored := len(keys)
	for i, k := range keys {
		if err := ctx.Err(); err != nil {
			countHits()
			return i, err
		}
		en := found[i]
		if en == nil && i > 0 {
			// A file discovered for an earlier key may hold this one too.
			en = e.find(n, k)
		}
		if en != nil && !counted(en) && !e.chk.recentlyVerified(en, now) && !e.chk.verify(ctx, en) {
			// Dropped, or moved to another mount meanwhile (demote.go):
			// then the key's entry is the new file.
			if en = e.find(n, k); en != nil && !e.chk.verify(ctx, en) {
				en = nil
			}
		}
		if en == nil {
			en = e.shared.discover(ctx, n, k)
		}
		if en == nil && e.objs.has(n, k) {
			e.st.hits.Add(1) // in the object mount (objects.go)
			continue
		}
		if en == nil {
			e.st.misses.Add(1)
			stored = i
			break
		}
		e.st.hits.Add(1)
		if !counted(en) {
			if seenMap != nil {
				seenMap[en] = true
			}
			hit = append(hit, en)
		}
	}
	countHits()
	return stored, nil
}

// MirrorKeys tells ks every key the index holds now and, from then on,
// every key it gains or loses (the daemon's shared lookup table). A later
// call replaces ks; nil stops the mirroring.
func (e *Engine) MirrorKeys(ks KeySet) { e.ix.Files().Mirror(ks) }

// find returns the entry the index holds for key in ns, or nil.
func (e *Engine) find(ns *namespace, key []byte) *entry { return e.ix.Files().Get(ns.fp, key) }
