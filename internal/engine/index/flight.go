package engine

import "slices"

// flight marks a path that this engine is writing (a store) or removing (an
// eviction, a delete, a corrupt file dropped). At most one of them holds a
// path at a time, so that a removal never deletes a file a store has just
// published there, and a store that finds its path held waits for the
// holder and then looks again at what is stored. Flights are the index's
// (index.inflight, guarded by index.mu).
type flight struct {
	done chan struct{} // closed when the path is released
	// orphans are the entries of files at the path that were unindexed
	// while the path was held: the holder removes the file at release if
	// it is still one of them (a store that published has replaced it).
	orphans []*entry
	// replaces is the indexed file a store holding the path is about to
	// replace (Engine.replacing): Pin pins none of it.
	replaces *entry
}

// claimLocked marks path in flight and returns true, or returns false and
// the holder's flight if it already is. The reads of the path begun
// before go stale (readMark).
func (ix *index) claimLocked(path string) (bool, *flight) {
	if fl := ix.inflight[path]; fl != nil {
		return false, fl
	}
	ix.inflight[path] = &flight{done: make(chan struct{})}
	for _, r := range ix.reads[path] {
		r.stale = true
	}
	return true, nil
}

// readMark is a discovery's read of the file at a path it does not hold
// (Engine.discover, Engine.adoptFound), between beginRead and endRead. It goes stale when a
// job of this engine claims the path meanwhile: the file read may be one
// that job removed (a delete, an eviction) or replaced (a store), and is
// then not indexed (adopt). Guarded by index.mu.
type readMark struct{ stale bool }

// beginRead marks a read of the file at path, or returns nil where a job
// holds the path.
func (ix *index) beginRead(path string) *readMark {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if ix.heldLocked(path) {
		return nil
	}
	r := &readMark{}
	ix.reads[path] = append(ix.reads[path], r)
	return r
}

// endRead ends the read r of path.
func (ix *index) endRead(path string, r *readMark) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if list := slices.DeleteFunc(ix.reads[path], func(x *readMark) bool { return x == r }); len(list) > 0 {
		ix.reads[path] = list
	} else {
		delete(ix.reads, path)
	}
}

// heldLocked reports whether a job of this engine holds path.
func (ix *index) heldLocked(path string) bool { return ix.inflight[path] != nil }

// releaseLocked ends the claim on path and returns its flight, whose done
// the caller closes once it has unlocked index.mu; or, where orphans were
// left to the claim, keeps the claim and returns them (taken from the
// flight) for the caller to remove before it releases the path again.
// freed are entries whose files the holder has just removed (or found
// gone), which their mounts counted as used until then: they stop
// counting in the same step, and leave index.removing.
func (ix *index) releaseLocked(path string, freed []*entry) (*flight, []*entry) {
	for _, en := range freed {
		ix.sp.free(ix.sp.mounts[en.mount], en.size, en.orphan)
		delete(ix.removing, en)
	}
	fl := ix.inflight[path]
	if orphans := fl.orphans; len(orphans) > 0 {
		fl.orphans = nil
		return nil, orphans
	}
	delete(ix.inflight, path)
	return fl, nil
}
