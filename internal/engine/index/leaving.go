package index

import (
	"sync"
	"sync/atomic"
)

// Leaving is the index's part that holds the files still on disk though
// they left the index: those whose removal failed, left there (left),
// and those being removed now (removing). Their mounts count their
// bytes as used until they are gone. It shares the index's lock.
type Leaving struct {
	mu      *sync.RWMutex // the Index's
	sp      Space
	flights *Flights
	// left holds the entries dropped from the index whose file could not
	// be removed (drop.go, disposeIfSame), and the spares whose removal
	// failed (LeaveSpare), by the file's path: their mounts count their
	// bytes as used until an eviction there removes them (retryLeft) or
	// a file indexed at the path replaces them.
	left map[string]*Entry
	// nleft is len(left), read without the lock: an eviction, which
	// tries the files left again first (Take), takes no lock where there
	// are none.
	nleft atomic.Int64
	// removing holds the entries dropped from the index whose file is
	// being removed now (Index.unindexLocked with remove: a drop, a
	// move's source; Take) until their holder frees them
	// (Index.releaseLocked), leaves them (leaveLocked) or keeps a spare
	// (Index.ReleaseKept): meanwhile they are neither indexed nor in
	// left, yet the file is on disk, and may stay there. A cluster
	// adopter retires no dead node while one of its files is here
	// (AnyOut).
	removing map[*Entry]struct{}
}

// leaveLocked records that the file of en, dropped from the index, could
// not be removed and is at path at: its mount goes on counting its bytes
// as used, no longer as an orphan's (no job removes it now).
func (l *Leaving) leaveLocked(en *Entry, at string) {
	if en.orphan {
		en.orphan = false
		l.sp.Unorphan(en.Mount, en.Size)
	}
	delete(l.removing, en) // its removal is over: en is left
	switch old := l.left[at]; {
	case old == nil:
		l.nleft.Add(1)
	case old != en: // one file at a path
		l.sp.Free(old.Mount, old.Size, false)
	}
	l.left[at] = en
}

// replacedLocked forgets the file left at path, if any, which a file
// indexed there has taken the place of: its mount stops counting it.
func (l *Leaving) replacedLocked(path string) {
	if old := l.left[path]; old != nil {
		delete(l.left, path)
		l.nleft.Add(-1)
		l.sp.Free(old.Mount, old.Size, false)
	}
}

// removingLocked records that en's file, dropped from the index, is
// being removed.
func (l *Leaving) removingLocked(en *Entry) { l.removing[en] = struct{}{} }

// removedLocked records that en's removal is over (its file gone, left
// or kept).
func (l *Leaving) removedLocked(en *Entry) { delete(l.removing, en) }

// LeaveSpare records that the spare file at path, of size bytes on mount,
// which the mount no longer counts (taken from its spares, or made and
// not kept), or a temporary file not published (removeTemp), could not
// be removed: like a dropped file's (leaveLocked), its bytes count as
// used until an eviction there removes it (retryLeft).
func (l *Leaving) LeaveSpare(mount int, path string, size int64) {
	en := &Entry{Mount: mount, Path: path, Size: size, Spare: true}
	en.RemoveFailed.Store(true)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.sp.Left(mount, size)
	l.leaveLocked(en, path)
}

// Leave is leaveLocked taking the lock.
func (l *Leaving) Leave(en *Entry, at string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.leaveLocked(en, at)
}

// Take takes from left the entries that want accepts (those of a mount
// due a try: retryLeft; those of a namespace: Purge) whose path it
// claims (none that a job holds now), by path, for the caller to remove
// and release (removeAt); each is next due next. Where left is empty it
// returns without taking the lock.
func (l *Leaving) Take(want func(*Entry) bool, next int64) map[string]*Entry {
	if l.nleft.Load() == 0 {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	var took map[string]*Entry
	for at, en := range l.left {
		if !want(en) {
			continue
		}
		if ok, _ := l.flights.claimLocked(at); !ok {
			continue
		}
		delete(l.left, at)
		l.nleft.Add(-1)
		l.removing[en] = struct{}{}
		en.retryAt = next
		if took == nil {
			took = map[string]*Entry{}
		}
		took[at] = en
	}
	return took
}

// AnyOut reports whether of accepts an entry whose file is still on disk
// though it left the index: left there (left) or being removed
// (removing).
func (l *Leaving) AnyOut(of func(*Entry) bool) bool {
	l.mu.RLock()
	defer l.mu.RUnlock()
	for _, en := range l.left {
		if of(en) {
			return true
		}
	}
	for en := range l.removing {
		if of(en) {
			return true
		}
	}
	return false
}
