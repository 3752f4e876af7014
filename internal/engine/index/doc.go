// Package index is the engine's index part: what the engine knows is
// stored (the published files, by id, path and key: Files), their counts
// by namespace (Counts), the paths its jobs hold (Flight) and the reads
// of files that discoveries make (ReadMark: Flights), the entries' pins
// and the restart hold's (Pins), and the files that left the index but
// are still on disk (Leaving). Index composes those parts under one lock;
// its lock and state are its own: every operation the engine calls is
// whole, one hold of the lock, and only the index changes an entry's
// counts (pins, client pins, hits, last access, the restart hold's
// marks). It tells the space part of the bytes its files hold on each
// mount through Space, and calls nothing else of the engine: no I/O, no
// policy. Its invariants are checked with -tags invariants (Index.Check).
package index

import (
	"sync/atomic"

	"github.com/kvhost/kvhost/fsys"
)

// Space is what the index tells of the files it counts on each mount
// (by the mount's position): the engine's space part implements it. The
// index calls it with its own lock held (lock order: index > space), so
// it never calls back into the index.
type Space interface {
	// Free: a file of size bytes is removed (or found gone); orphan: it
	// was counted as an orphan.
	Free(mount int, size int64, orphan bool)
	// Left: a file of size bytes stays on disk unindexed (Index.LeaveSpare).
	Left(mount int, size int64)
	// Unorphan: an orphan's file of size bytes is left instead.
	Unorphan(mount int, size int64)
	// Indexed: a file of size bytes is indexed; reserved: its bytes were
	// reserved by the store that wrote it.
	Indexed(mount int, size int64, reserved bool)
	// Unindexed: a file of size bytes leaves the index; removing: its
	// file is being removed; orphan: by a path another job holds.
	Unindexed(mount int, size int64, removing, orphan bool)
	// Moved: a file moved from one mount to another.
	Moved(from, to int)
}

// KeySet is told each key the index gains or loses (Index.Mirror).
type KeySet interface {
	Add(fp uint64, key string)
	Remove(fp uint64, key string)
}

// PinnedFile is a file held open for the client pins of its entry
// (Entry.File). Its count of references is the entry's hold (one, until
// the last client pin ends) and each load reading through it; the last
// Release closes the file, and a reference is never taken again once the
// count is 0 (Acquire).
type PinnedFile struct {
	f    fsys.File
	refs atomic.Int32
}

// NewPinnedFile returns f held open with one reference: the entry's hold.
func NewPinnedFile(f fsys.File) *PinnedFile {
	pf := &PinnedFile{f: f}
	pf.refs.Store(1)
	return pf
}

// File is the file held open.
func (pf *PinnedFile) File() fsys.File { return pf.f }

// Acquire takes a reference to pf for a load, unless its last one went
// (the file closed, or closing: the load opens the file by name).
func (pf *PinnedFile) Acquire() bool {
	for {
		n := pf.refs.Load()
		if n <= 0 {
			return false
		}
		if pf.refs.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// Release drops one reference to pf, closing its file at the last, and
// reports whether it did.
func (pf *PinnedFile) Release() bool {
	if pf.refs.Add(-1) == 0 {
		pf.f.Close()
		return true
	}
	return false
}

// ClientPinned reports whether en is held by a client pin. Call it in a
// function the index calls (its lock is held).
func (en *Entry) ClientPinned() bool { return en.leases > 0 }

// RetryAt is when a file left on disk may be removed again (Unix
// nanoseconds). Call it in a function the index calls.
func (en *Entry) RetryAt() int64 { return en.retryAt }

// SetGone marks en, an entry the index never held (a file read and left
// to the job that holds its path), as gone.
func (en *Entry) SetGone() { en.gone = true }
