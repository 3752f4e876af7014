package engine

// flight marks a path that this engine is writing (a store) or removing (an
// eviction, a delete, a corrupt file dropped). At most one of them holds a
// path at a time, so that a removal never deletes a file a store has just
// published there, and a store that finds its path held waits for the
// holder and then looks again at what is stored.
type flight struct {
	done chan struct{} // closed when the path is released
	// orphans are the entries of files at the path that were unindexed
	// while the path was held: the holder removes the file at release if
	// it is still one of them (a store that published has replaced it).
	orphans []*entry
}

// claimLocked marks path in flight and returns true, or returns false and
// the holder's flight if it already is.
func (e *Engine) claimLocked(path string) (bool, *flight) {
	if fl := e.inflight[path]; fl != nil {
		return false, fl
	}
	e.inflight[path] = &flight{done: make(chan struct{})}
	return true, nil
}

// release ends this engine's claim on path, first removing the orphans
// left to it, and wakes the stores waiting for the path.
func (e *Engine) release(path string) {
	e.releaseFreed(path, nil)
}

// releaseFreed is release for a holder that has just removed the files of
// freed (or found them gone), which their mounts counted as used until
// then: they stop counting in the same hold of the lock.
func (e *Engine) releaseFreed(path string, freed []*entry) {
	e.mu.Lock()
	for _, en := range freed {
		m := e.mounts[en.mount]
		m.used -= en.size
		if en.orphan {
			m.orphaned -= en.size
		}
	}
	fl, orphans := e.releaseLocked(path)
	e.mu.Unlock()
	e.endRelease(path, fl, orphans)
}

// endRelease finishes what releaseLocked began, without the lock: it
// wakes the stores waiting for the path, or removes the orphans left to
// the claim (never a file its holder just published: they are entries of
// files unindexed while it held the path) and releases the path again.
func (e *Engine) endRelease(path string, fl *flight, orphans []*entry) {
	if fl != nil {
		close(fl.done)
		return
	}
	e.removeIfSame(path, orphans)
	e.releaseFreed(path, orphans)
}

// releaseLocked ends the claim on path and returns its flight, whose done
// the caller closes once it has unlocked e.mu; or, where orphans were left
// to the claim, keeps the claim and returns them (taken from the flight)
// for the caller to remove before it releases the path again.
func (e *Engine) releaseLocked(path string) (*flight, []*entry) {
	fl := e.inflight[path]
	if orphans := fl.orphans; len(orphans) > 0 {
		fl.orphans = nil
		return nil, orphans
	}
	delete(e.inflight, path)
	return fl, nil
}

// removeLocked arranges the removal of the file of en, already unindexed:
// if the path is free it claims it and returns true, and the caller calls
// removeClaimed (or evictClaimed) without the lock; if the path is held,
// the holder removes the file when it releases the path, unless the file
// was replaced. Either way the file counts as used on its mount again
// until it is removed: the room is not free before (but an orphan is on
// its way out: evictions leave it out of what they must free).
func (e *Engine) removeLocked(en *entry) bool {
	m := e.mounts[en.mount]
	m.used += en.size
	ok, fl := e.claimLocked(en.path)
	if !ok {
		fl.orphans = append(fl.orphans, en)
		en.orphan = true
		m.orphaned += en.size
	}
	return ok
}

// removeClaimed removes en's file (if it is still the file at its path) and
// releases the path claimed by removeLocked.
func (e *Engine) removeClaimed(en *entry) {
	e.removeIfSame(en.path, []*entry{en})
	e.releaseFreed(en.path, []*entry{en})
}

// evictClaimed is removeClaimed for an evicted entry: the file may be
// kept as a spare (spares.go), its bytes then moving to the spares.
func (e *Engine) evictClaimed(en *entry) {
	if e.disposeIfSame(en.path, []*entry{en}, true) {
		e.release(en.path)
		return
	}
	e.releaseFreed(en.path, []*entry{en})
}
