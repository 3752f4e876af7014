package index

import (
	"slices"
	"sync"
)

// Flight marks a path that this engine is writing (a store) or removing (an
// eviction, a delete, a corrupt file dropped). At most one of them holds a
// path at a time, so that a removal never deletes a file a store has just
// published there, and a store that finds its path held waits for the
// holder and then looks again at what is stored. Flights are the index's
// (Flights, guarded by its lock).
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

// Flights is the index's part that holds the paths this engine's jobs
// hold (a store writing there, a move, a removal) and the reads of files
// that discoveries are making at paths no job holds. It shares the
// index's lock.
type Flights struct {
	mu       *sync.RWMutex      // the Index's
	inflight map[string]*Flight // paths being written or removed
	// reads holds the reads of files at paths that discoveries are
	// making (BeginRead), by path.
	reads map[string][]*ReadMark
}

// claimLocked marks path in flight and returns true, or returns false and
// the holder's flight if it already is. The reads of the path begun
// before go stale (ReadMark).
func (fs *Flights) claimLocked(path string) (bool, *Flight) {
	if fl := fs.inflight[path]; fl != nil {
		return false, fl
	}
	fs.inflight[path] = &Flight{Done: make(chan struct{})}
	for _, r := range fs.reads[path] {
		r.stale = true
	}
	return true, nil
}

// releaseLocked ends the claim on path and returns its flight, whose done
// the caller closes once it has let the index's lock go; or, where
// orphans were left to the claim, keeps the claim and returns them
// (taken from the flight) for the caller to remove before it releases
// the path again.
func (fs *Flights) releaseLocked(path string) (*Flight, []*Entry) {
	fl := fs.inflight[path]
	if orphans := fl.orphans; len(orphans) > 0 {
		fl.orphans = nil
		return nil, orphans
	}
	delete(fs.inflight, path)
	return fl, nil
}

// heldLocked reports whether a job of this engine holds path.
func (fs *Flights) heldLocked(path string) bool { return fs.inflight[path] != nil }

// replacedLocked reports whether the store holding en's path is about
// to replace en (Replacing).
func (fs *Flights) replacedLocked(en *Entry) bool {
	fl := fs.inflight[en.Path]
	return fl != nil && fl.replaces == en
}

// Replacing marks the store holding path as one that replaces old, the
// file indexed there, so that no pin takes hold of old from then on
// (Pins.PinClient), unless a client pin holds old already: then it
// reports false. Both in one step: a pin either comes first and refuses
// the store, or finds the path being replaced and pins nothing.
func (fs *Flights) Replacing(path string, old *Entry) bool {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if old.leases > 0 && !old.gone {
		return false
	}
	if fl := fs.inflight[path]; fl != nil {
		fl.replaces = old
	}
	return true
}

// ReadMark is a discovery's read of the file at a path it does not hold
// (Engine.discover, Engine.adoptFound), between BeginRead and EndRead. It
// goes stale when a job of this engine claims the path meanwhile: the
// file read may be one that job removed (a delete, an eviction) or
// replaced (a store), and is then not indexed (Index.Adopt). Guarded by
// the index's lock.
type ReadMark struct{ stale bool }

// BeginRead marks a read of the file at path, or returns nil where a job
// holds the path.
func (fs *Flights) BeginRead(path string) *ReadMark {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if fs.heldLocked(path) {
		return nil
	}
	r := &ReadMark{}
	fs.reads[path] = append(fs.reads[path], r)
	return r
}

// EndRead ends the read r of path.
func (fs *Flights) EndRead(path string, r *ReadMark) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if list := slices.DeleteFunc(fs.reads[path], func(x *ReadMark) bool { return x == r }); len(list) > 0 {
		fs.reads[path] = list
	} else {
		delete(fs.reads, path)
	}
}
