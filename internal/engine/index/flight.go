package index

import "slices"

// Flight marks a path that this engine is writing (a store) or removing (an
// eviction, a delete, a corrupt file dropped). At most one of them holds a
// path at a time, so that a removal never deletes a file a store has just
// published there, and a store that finds its path held waits for the
// holder and then looks again at what is stored. Flights are the index's
// (index.inflight, guarded by index.mu).
type Flight struct {
	Done chan struct{} // closed when the path is released
	// orphans are the entries of files at the path that were unindexed
	// while the path was held: the holder removes the file at release if
	// it is still one of them (a store that published has replaced it).
	orphans []*Entry
	// replaces is the indexed file a store holding the path is about to
	// replace (Engine.replacing): Pin pins none of it.
	replaces *Entry
}

// claimLocked marks path in flight and returns true, or returns false and
// the holder's flight if it already is. The reads of the path begun
// before go stale (readMark).
func (ix *Index) claimLocked(path string) (bool, *Flight) {
	if fl := ix.inflight[path]; fl != nil {
		return false, fl
	}
	ix.inflight[path] = &Flight{Done: make(chan struct{})}
	for _, r := range ix.reads[path] {
		r.stale = true
	}
	return true, nil
}

// ReadMark is a discovery's read of the file at a path it does not hold
// (Engine.discover, Engine.adoptFound), between beginRead and endRead. It goes stale when a
// job of this engine claims the path meanwhile: the file read may be one
// that job removed (a delete, an eviction) or replaced (a store), and is
// then not indexed (adopt). Guarded by index.mu.
type ReadMark struct{ stale bool }

// BeginRead marks a read of the file at path, or returns nil where a job
// holds the path.
func (ix *Index) BeginRead(path string) *ReadMark {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if ix.heldLocked(path) {
		return nil
	}
	r := &ReadMark{}
	ix.reads[path] = append(ix.reads[path], r)
	return r
}

// EndRead ends the read r of path.
func (ix *Index) EndRead(path string, r *ReadMark) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if list := slices.DeleteFunc(ix.reads[path], func(x *ReadMark) bool { return x == r }); len(list) > 0 {
		ix.reads[path] = list
	} else {
		delete(ix.reads, path)
	}
}

// heldLocked reports whether a job of this engine holds path.
func (ix *Index) heldLocked(path string) bool { return ix.inflight[path] != nil }

// releaseLocked ends the claim on path and returns its flight, whose done
// the caller closes once it has unlocked index.mu; or, where orphans were
// left to the claim, keeps the claim and returns them (taken from the
// flight) for the caller to remove before it releases the path again.
// freed are entries whose files the holder has just removed (or found
// gone), which their mounts counted as used until then: they stop
// counting in the same step, and leave index.removing.
func (ix *Index) releaseLocked(path string, freed []*Entry) (*Flight, []*Entry) {
	for _, en := range freed {
		ix.sp.Free(en.Mount, en.Size, en.orphan)
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
