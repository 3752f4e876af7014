package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
)

// Deleting keys at a client's request: their entries are dropped and their
// files removed (drop.go), except where a client pin holds them (pins.go).

// Delete removes the files holding any of keys (a file holding several keys
// goes with all of them) and returns how many of the requested keys were
// stored and are now removed: a key repeated in keys counts once, and the
// other keys of a removed file are not counted. A key whose file a client
// pin holds (Pin) is refused: it stays stored and is not counted. A load that has not yet
// opened a deleted file reports it missing.
func (e *Engine) Delete(ctx context.Context, ns NamespaceID, keys [][]byte) (int, error) {
	n, err := e.enterNamespace(ns)
	if err != nil {
		return 0, err
	}
	defer e.busy.calls.exit()
	// The entries first: removing a file unindexes its other keys.
	byEntry := map[*entry]int{} // requested keys held by each entry
	var order []*entry
	keyOf := map[*entry][]byte{} // a requested key of each entry
	seen := map[string]bool{}
	for _, k := range keys {
		if seen[string(k)] {
			continue
		}
		seen[string(k)] = true
		if en := e.find(n, k); en != nil {
			if byEntry[en] == 0 {
				order = append(order, en)
				keyOf[en] = k
			}
			byEntry[en]++
		}
	}
	removed := len(e.objs.only(n, seen)) // counted, and removed below
	for _, en := range order {
		if err := ctx.Err(); err != nil {
			return removed, err
		}
		// A key whose file's removal failed counts: deleted from the
		// cache, never served again (index.Leaving's left), though its file stays.
		if d := e.rm.dropUnpinned(ctx, en, keyOf[en], nil, "deleted"); d.en != nil {
			removed += byEntry[en]
		}
	}
	// The objects of the keys no file holds now: a key a client pin kept
	// keeps its object too.
	e.objs.remove(n, e.objs.only(n, seen))
	if removed > 0 {
		e.maker.room() // room for spares made ahead
	}
	return removed, nil
}

// droppedKey is what dropUnpinned did.
type droppedKey struct {
	// en is the entry dropped (nil if none): en as found, or the file it
	// moved to since (demote.go).
	en *entry
	// keys is the keys the index found in its file (a key a newer file
	// took counts there, as Stats.Namespaces counts it).
	keys int
	// pinned: a client pin kept the file (en is nil).
	pinned bool
	// left: the file's removal failed; it stays on disk (index.Leaving's left),
	// counted as used, until a later eviction or purge removes it.
	left bool
	// kept: en was dropped from the index only, its file left on disk to
	// its node (mayRemove said no: another node's on a cluster mount).
	kept bool
}

// dropUnpinned drops en, found for key, and removes its file, as Delete
// does, unless a client pin holds it; the check and the unindexing are one
// step under index.mu, so a pin that took hold is never deleted under it.
// Where en's file moved to another mount since it was found (demote.go),
// the moved file is the one dropped. Where mayRemove is not nil and says
// no (asked with index.mu held), en is only dropped from the index and its
// file stays (kept).
func (r *remover) dropUnpinned(ctx context.Context, en *entry, key []byte, mayRemove func(*entry) bool, why string) droppedKey {
	d := r.ix.DropUnpinned(en, key, mayRemove, r.now().UnixNano())
	switch {
	case d.Pinned:
		r.log.Debug("engine: removal refused: pinned", "path", d.En.Path, "why", why)
		return droppedKey{pinned: true}
	case d.En == nil:
		return droppedKey{}
	}
	r.recordDrop(d.En, d.Remove, reasonOf(why))
	left := r.dropped(ctx, d.En, d.Claimed, d.Rec, why)
	return droppedKey{en: d.En, keys: d.Keys, left: left, kept: !d.Remove}
}

// PurgeResult is what Purge removed, and what it left for client pins.
type PurgeResult struct {
	Namespaces int   // namespaces purged
	Files      int   // files removed
	Keys       int   // the keys the index found in them
	Bytes      int64 // their bytes, headers included
	// Pinned is the files left because a client pin holds them (Pin).
	Pinned int
	// Left is the files whose removal failed (the engine's log says why):
	// no longer indexed, so no key of them is served, but still on disk,
	// counted as used, until a later purge or an eviction on their mount
	// removes them; a restart would find them again.
	Left int
	// Others is the files of other nodes on a cluster mount that this
	// engine indexed and dropped from its index, leaving them to their
	// nodes, which remove them at their next interval (the purge record);
	// not counted in Files, Keys or Bytes.
	Others int
	// Objects is the objects removed from the object mount
	// (Config.Objects): every one of the namespaces, this node's or
	// another's; not counted in Files, Keys or Bytes.
	Objects int
}

// Purge removes every file of the namespace of fingerprint fp (Geometry's
// fingerprint; Stats.Namespaces lists them) that the engine indexes, from
// every mount, as Delete
// removes a key's file: a file a client pin holds stays (counted in
// Pinned), a file the restart hold holds goes. It works whether or not a
// client declares the namespace now, so that the files of a model no
// longer served, found at start, can be removed too. It fails with
// ErrUnknownNamespace where the engine knows no namespace of fp and
// indexes no file of it, unless it has a cluster mount, where it writes
// the purge record all the same: another node may hold the only files.
// It removes the files indexed when it looks: a store of the namespace
// still running meanwhile may leave files behind; stop the model's
// clients first. On a mount with a cluster capacity
// (Mount.ClusterCapacity) it also writes a purge record there
// (clusterpurge.go): every node of the mount drops the namespace's files
// written at or before the record from its index at its next interval and
// removes those of its own, there and on its mounts without a cluster
// capacity (covers), as it removes this engine's here (its client
// pins keep theirs until they end); this engine removes its own files and
// those of the dead nodes it adopted, and drops the other nodes' files it
// indexed, leaving them to their nodes (PurgeResult.Others), and files
// without an owner tag, which no node removes (mayPurge). A record that cannot be written fails the purge
// after the files are removed here. On another shared directory it removes
// the files this engine indexes: its own, and other nodes' that it found
// (a lookup, a load, its start's walk); another node's files it never
// found stay. Purge on each node to remove them all. With an object mount
// (Config.Objects) it removes every object of the namespace there too,
// every node's (PurgeResult.Objects); one it could not remove fails it.
func (e *Engine) Purge(ctx context.Context, fp uint64) (PurgeResult, error) {
	if err := e.busy.calls.enter(); err != nil {
		return PurgeResult{}, err
	}
	defer e.busy.calls.exit()
	closed, known := e.tables.known(fp)
	if closed {
		return PurgeResult{}, ErrClosed
	}
	var r PurgeResult
	found := e.purge(ctx, []uint64{fp}, &r)
	oerr := e.objs.purge(ctx, []uint64{fp}, &r)
	// On a cluster mount the files may be another node's alone, which
	// this node never found: the record goes out all the same.
	if !found && r.Objects == 0 && oerr == nil && !known && !clustered(e.mounts) {
		return r, fmt.Errorf("%w: no namespace of fingerprint %016x, and no file or object of one (kvhost stats lists them)", ErrUnknownNamespace, fp)
	}
	return r, errors.Join(recordPurges(ctx, e.mounts, []uint64{fp}), oerr)
}

// PurgeModel is Purge for every namespace declared with model id model
// since the engine opened (each tensor-parallel rank, each geometry of
// the model is one), declared now or not: what Stats.Namespaces lists
// under the id, beyond its bound too. It fails with ErrUnknownNamespace
// where no namespace was declared with the id; files found at start whose
// namespace no client declared since go by their fingerprint (Purge).
// Like Purge, it tells the other nodes of a cluster mount, and elsewhere
// removes only the files this engine indexes.
func (e *Engine) PurgeModel(ctx context.Context, model string) (PurgeResult, error) {
	if model == "" {
		return PurgeResult{}, fmt.Errorf("%w: purge of an empty model id", ErrInvalid)
	}
	if err := e.busy.calls.enter(); err != nil {
		return PurgeResult{}, err
	}
	defer e.busy.calls.exit()
	closed, fps := e.tables.fingerprints(model)
	if closed {
		return PurgeResult{}, ErrClosed
	}
	if len(fps) == 0 {
		return PurgeResult{}, fmt.Errorf("%w: no namespace of model %q was declared since the daemon started (files found on the mounts that no client declared since go by their fingerprint: kvhost stats lists them)", ErrUnknownNamespace, model)
	}
	var r PurgeResult
	e.purge(ctx, fps, &r)
	oerr := e.objs.purge(ctx, fps, &r)
	return r, errors.Join(recordPurges(ctx, e.mounts, fps), oerr)
}

// purge removes the files of the namespaces of fps indexed now
// (dropUnpinned), and tries again those whose removal failed before
// (index.Leaving's left), adds the namespaces and what it removed and kept to res,
// and reports whether there were any such files (found) and whether it
// removed one. One walk of the index serves every fingerprint. A file
// for which mayRemove says no (another node's on a cluster mount:
// mayPurge) is only dropped from the index: its node removes it,
// told by the purge record the caller writes next (recordPurges).
func (r *remover) purge(ctx context.Context, fps []uint64, mayRemove func(*entry) bool, res *PurgeResult) (found, removed bool) {
	res.Namespaces += len(fps)
	// The files left before first, so that a file this purge fails to
	// remove is tried once.
	ofFPs := func(en *entry) bool { return !en.Spare && slices.Contains(fps, en.FP) }
	left := r.ix.Leaving().Take(ofFPs, r.now().UnixNano()+int64(leftRetryInterval))
	for at, en := range left {
		if r.removeAt(at, en) {
			res.Left++
			continue
		}
		res.Files, res.Bytes = res.Files+1, res.Bytes+en.Size
		removed = true
	}
	ens := r.ix.Files().Matching(nil, func(en *entry) bool { return slices.Contains(fps, en.FP) })
	if r.purgeEntries(ctx, ens, mayRemove, res, "purged") {
		removed = true
	}
	return len(ens)+len(left) > 0, removed
}

// purgeEntries drops ens as a purge does (dropUnpinned: a client pin
// keeps a file; mayRemove: another node's file on a cluster mount only
// leaves the index), until ctx ends, adds what it removed and kept to
// res and reports whether it removed a file.
func (r *remover) purgeEntries(ctx context.Context, ens []*entry, mayRemove func(*entry) bool, res *PurgeResult, why string) bool {
	removed := false
	for _, en := range ens {
		if ctx.Err() != nil {
			break
		}
		switch d := r.dropUnpinned(ctx, en, []byte(en.Keys[0]), mayRemove, why); {
		case d.left:
			res.Left++
		case d.kept:
			res.Others++
		case d.en != nil:
			res.Files, res.Keys, res.Bytes = res.Files+1, res.Keys+d.keys, res.Bytes+d.en.Size
			removed = true
		case d.pinned:
			res.Pinned++
		}
	}
	return removed
}

// purge is remover.purge with the cluster's say on other nodes' files
// (mayPurge), making room for spares ahead where it removed a file.
func (e *Engine) purge(ctx context.Context, fps []uint64, res *PurgeResult) bool {
	found, removed := e.rm.purge(ctx, fps, mayPurge(e.mounts), res)
	if removed {
		e.maker.room() // room for spares made ahead
	}
	return found
}
