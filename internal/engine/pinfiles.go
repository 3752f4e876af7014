package engine

import (
	"os"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/engine/index"
)

// Files held open for client pins (docs/engine.md, "Pins and other
// nodes").
//
// A client pin is a promise: a key pinned loads until its pin ends. This
// engine keeps it for the files only it removes, by removing none that a
// client pins. Another engine sharing the directory (a node of a cluster
// mount, or any node of a shared network file system) sees none of this
// engine's pins, and may remove a file one of them holds: its own file
// evicted, deleted or purged on a cluster mount, any file it indexed on
// a shared mount without a cluster capacity. So where another engine may
// remove a pinned file, Pin opens it (the open is its check, in place of
// a stat) and keeps it open until the last client pin of it ends. A
// POSIX file system keeps a file removed through one client readable
// through a descriptor another holds open (CephFS and GlusterFS were
// seen to; NFS does not, and is left out: othersRemove); a load of the
// pinned key then reads the file through that descriptor,
// whether or not it is still at its name, and finds the entry, which a
// removal took out of the index, in index.Pins' pinnedGone.

// pinnedRef is a load's reference to a pinnedFile: the file, whose Close
// releases the reference instead of closing it.
type pinnedRef struct {
	fsys.File
	t    *pinTable
	pf   *pinnedFile
	done atomic.Bool
}

// Close releases the load's reference.
func (r *pinnedRef) Close() error {
	if r.done.CompareAndSwap(false, true) {
		r.t.releaseFile(r.pf)
	}
	return nil
}

// releaseFile drops one reference to pf, closing its file at the last.
func (t *pinTable) releaseFile(pf *pinnedFile) {
	if pf.Release() {
		t.open.Add(-1)
	}
}

// openSlot counts a file about to be held open for a pin, or reports
// false, counting the pin unopened, where maxOpen files are already
// held; the caller gives a slot it took and did not use back (closeSlot).
func (t *pinTable) openSlot() bool {
	if t.open.Add(1) > t.maxOpen {
		t.open.Add(-1)
		t.unopened.Add(1)
		return false
	}
	return true
}

// closeSlot gives back a slot openSlot took for a file not held.
func (t *pinTable) closeSlot() { t.open.Add(-1) }

// holdOpen keeps f, opened for a pin of en (openSlot), open until the
// last client pin of en ends, unless another pin of en holds a file
// already (f is then closed).
func (t *pinTable) holdOpen(en *entry, f fsys.File) {
	pf := index.NewPinnedFile(f)
	if !t.ix.Pins().HoldOpen(en, pf) { // another pin of en opened it meanwhile
		t.releaseFile(pf)
	}
}

// DefaultMaxPinnedOpen is the most files an engine keeps open for client
// pins (pinTable.maxOpen): an eighth of the descriptors the process may
// open (RLIMIT_NOFILE), at least 64. Beyond it a pin checks its file with
// a stat, as where no other engine removes files, and is counted
// (Stats.PinnedFilesUnopened).
func DefaultMaxPinnedOpen() int64 {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return 64
	}
	return max(int64(min(lim.Cur/8, 1<<30)), 64)
}

// othersRemove reports whether another engine may remove en's file on m
// (the file held open for its client pins, above): on a cluster mount,
// where this node may not (mayEvict: another live node's, a twin's of
// this node's tag, or one without an owner tag); on a mount of a network
// file system without a cluster capacity, every file; on a local or
// memory file system, none. On NFS none either: another client's removal
// ends the file under this node's descriptors (ESTALE), so an open held
// there would keep nothing.
func (m *mount) othersRemove(en *entry) bool {
	if m.removalStales {
		return false
	}
	if m.cluster != nil {
		return !m.mayEvict(en)
	}
	return m.network
}

// loadFlag is the flag a load opens a file of m with.
func loadFlag(m *mount) int {
	if m.direct {
		return os.O_RDONLY | unix.O_DIRECT
	}
	return os.O_RDONLY
}

// PinnedFilesOpen returns how many files the engine holds open for client
// pins now.
func (e *Engine) PinnedFilesOpen() int64 { return e.pinTab.open.Load() }
