package engine

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/internal/engine/removals"
	"github.com/kvhost/kvhost/internal/format"
)

// Dropping entries and removing their files (docs/engine.md, "Lookup and
// delete", "File identity"): an entry leaves the index and its file is
// removed while this engine holds its path (index.dropLocked), and only
// if the file at the path is still the entry's (removeIfSame). A file is
// never removed by name alone; the unlink itself is removeFile's
// (removal.go).

// drop removes en from the index, tells the policy, and, if remove is set,
// removes its file (holding its path meanwhile, so that a store publishing
// a new file there waits and its file is never the one removed). It
// reports whether en was still indexed, that is, whether this call
// dropped it.
func (r *remover) drop(ctx context.Context, en *entry, remove bool, why string) bool {
	return r.dropAs(ctx, en, remove, why, reasonOf(why))
}

// dropAs is drop, its keys' removal recorded for reason (published);
// reason 0 records nothing: the caller does (dropReplaced).
func (r *remover) dropAs(ctx context.Context, en *entry, remove bool, why string, reason removals.Reason) bool {
	was, claimed, rec := r.ix.Drop(en, remove, r.now().UnixNano())
	if !was {
		return false
	}
	r.recordDrop(en, remove, reason)
	r.dropped(ctx, en, claimed, rec, why)
	return true
}

// recordDrop records the removal of the keys of en, just dropped, for
// reason (0: none, the caller records it): at once where its file is
// not to be removed (gone already, replaced, or another node's), else
// once its file is gone (pend: removeAt, evictClaimed, endRelease), so
// that a crash never leaves a file whose keys subscribers were told
// are gone, to be found again at the restart.
func (r *remover) recordDrop(en *entry, remove bool, reason removals.Reason) {
	switch {
	case reason == 0:
	case remove:
		r.pend(en, reason)
	default:
		r.published(en, reason)
	}
}

// dropped ends the drop of en from the index (index.drop,
// index.dropUnpinned): it removes the file where the drop claimed its
// path and tells the policy (rec). It reports whether en's file, to be
// removed, is still on disk: its removal failed (index.Leaving's left).
func (r *remover) dropped(ctx context.Context, en *entry, claimed bool, rec abi.AccessRecord, why string) (left bool) {
	if claimed {
		left = r.removeClaimed(en)
	}
	r.log.Debug("engine: entry dropped", "path", en.Path, "why", why)
	r.host.access(ctx, []abi.AccessRecord{rec})
	return left
}

// release ends this engine's claim on path, first removing the orphans
// left to it, and wakes the stores waiting for the path.
func (r *remover) release(path string) {
	r.releaseFreed(path, nil)
}

// releaseFreed is release for a holder that has just removed the files of
// freed (or found them gone), which their mounts counted as used until
// then: they stop counting in the same hold of the index's lock.
func (r *remover) releaseFreed(path string, freed []*entry) {
	fl, orphans := r.ix.Release(path, freed)
	r.endRelease(path, fl, orphans)
}

// releaseRemoved is releaseFreed for a holder that has just tried to
// remove the file of one of ens: left, where not nil, is the one whose
// file is still there, at at (disposeIfSame), which its mount goes on
// counting (index.Leaving.leaveLocked); the others stop counting.
func (r *remover) releaseRemoved(path string, ens []*entry, left *entry, at string) {
	fl, orphans := r.ix.ReleaseLeaving(path, ens, left, at)
	r.endRelease(path, fl, orphans)
}

// endRelease finishes what index.releaseLocked began, without the lock:
// it wakes the stores waiting for the path, or removes the orphans left
// to the claim (never a file its holder just published: they are entries
// of files unindexed while it held the path) and releases the path again.
func (r *remover) endRelease(path string, fl *flight, orphans []*entry) {
	if fl != nil {
		close(fl.Done)
		return
	}
	_, left, at := r.disposeIfSame(path, orphans, false)
	r.publishOrphans(orphans, left)
	r.releaseRemoved(path, orphans, left, at)
}

// removeClaimed removes en's file (if it is still the file at its path) and
// releases the path claimed by index.dropLocked.
func (r *remover) removeClaimed(en *entry) (left bool) {
	return r.removeAt(en.Path, en)
}

// evictClaimed is removeClaimed for an evicted entry: the file may be
// kept as a spare (spares.go), its bytes then moving to the spares.
func (r *remover) evictClaimed(en *entry) {
	kept, left, at := r.disposeIfSame(en.Path, []*entry{en}, true)
	if left == nil { // gone from its path: removed, or a spare now
		r.published(en, r.evictedReason(en))
	} else {
		r.pend(en, r.evictedReason(en))
	}
	if kept {
		fl, orphans := r.ix.ReleaseKept(en.Path, en)
		r.endRelease(en.Path, fl, orphans)
		return
	}
	r.releaseRemoved(en.Path, []*entry{en}, left, at)
}

// retryLeft tries again to remove m's files whose removal failed
// (index.Leaving's left), but those whose path a job holds now and those it tried
// within leftRetryInterval. An eviction calls it before it asks for
// victims; where no file is left (the common case) it takes no lock.
func (r *remover) retryLeft(m *mount) {
	now := r.now().UnixNano()
	due := func(en *entry) bool { return en.Mount == m.idx && en.RetryAt() <= now }
	for at, en := range r.ix.Leaving().Take(due, now+int64(leftRetryInterval)) {
		r.removeAt(at, en)
	}
}

// removeAt removes the file of en at at (its path, or where a failed
// removal left it: takeLeft) if it is still en's, records the removal
// of its keys pending once it is gone (settle), and releases the path
// claimed for it; it reports whether the file is still there.
func (r *remover) removeAt(at string, en *entry) (left bool) {
	_, l, now := r.disposeIfSame(at, []*entry{en}, false)
	if l == nil {
		r.settle(en)
	}
	r.releaseRemoved(at, []*entry{en}, l, now)
	return l != nil
}

// dropVanished drops en, whose file went or changed behind the engine's
// back, and counts it vanished (Stats.Vanished) only where this call
// dropped it: a file this engine removed or moved meanwhile (a delete, a
// purge, a move, an eviction; a load's pin stops none but the last) is its
// own doing, not a vanishing. It reports whether this call dropped en.
func (r *remover) dropVanished(ctx context.Context, en *entry, why string) bool {
	if !r.dropAs(ctx, en, false, why, removals.Vanished) {
		return false
	}
	r.vanished.Add(1)
	return true
}

// dropReplaced is dropVanished of en, whose file another file replaced
// at its path, but for the record of its keys' removal, which the caller
// makes (published, Vanished) once it has indexed the new file: a key the
// new file holds is still stored, and gets none.
func (r *remover) dropReplaced(ctx context.Context, en *entry, why string) bool {
	if !r.dropAs(ctx, en, false, why, 0) {
		return false
	}
	r.vanished.Add(1)
	return true
}

// removeIfSame removes the file at path if it is the file of one of ens
// (same identity and header id): a file at the path is never removed by
// name alone. The caller holds the path, so no store of this engine
// publishes there meanwhile; another node may still rename a file onto the
// path between the check and the unlink (a window of one system call,
// docs/engine.md). It returns the entry whose file it could not remove,
// or nil (disposeIfSame).
func (r *remover) removeIfSame(path string, ens []*entry) *entry {
	_, left, _ := r.disposeIfSame(path, ens, false)
	return left
}

// disposeIfSame is removeIfSame; with spare set (an evicted entry, whose
// file its mount still counts as used: evict), the file is kept as a
// spare for later stores where its mount keeps spares and it fits
// (spares.go), its bytes then moving to the spares. It reports whether it
// kept one. left is the entry of ens whose file may still be there, at
// at (path, or the spare's name it was renamed to), because a step failed
// with an I/O error (an open or read other than "not found", the unlink
// itself): the caller goes on counting its bytes (index.Leaving.leaveLocked),
// for an eviction to try again (retryLeft). The first such failure of a
// file counts in Stats.RemoveFailures and logs a warning; a retry's
// failure is logged at debug level only.
func (r *remover) disposeIfSame(path string, ens []*entry, spare bool) (kept bool, left *entry, at string) {
	if len(ens) == 0 {
		return false, nil, ""
	}
	fail := func(op string, en *entry, at string, err error) (bool, *entry, string) {
		if en.RemoveFailed.CompareAndSwap(false, true) {
			r.failures.Add(1)
			r.log.Warn("engine: "+op, "path", at, "err", err)
		} else {
			r.log.Debug("engine: "+op+" (tried again)", "path", at, "err", err)
		}
		return false, en, at
	}
	m := r.mounts[ens[0].Mount]
	// The directory first, held to the end: the check below and the
	// rename or unlink after it are of the name in the directory
	// opened, never of one where a link planted meanwhile points
	// (removeFileIn).
	dir, err := m.openDir(r.fs, filepath.Dir(path))
	switch {
	case errors.Is(err, os.ErrNotExist):
		return false, nil, ""
	case isLinkRefusal(err):
		// A link (or a file) in place of a directory of path: the
		// file is no longer at the path; nothing is removed there.
		r.log.Debug("engine: not removed: a directory of the path is a symbolic link now", "path", path, "err", err)
		return false, nil, ""
	case err != nil:
		return fail("open the directory before remove", ens[0], path, err)
	}
	defer dir.Close()
	f, err := m.openNoLinks(r.fs, path, os.O_RDONLY|checkOpen, 0)
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) && !errors.Is(err, syscall.ELOOP) {
			return fail("open before remove", ens[0], path, err)
		}
		return false, nil, ""
	}
	id, err := fileIdentity(f)
	var h *format.Header
	if err == nil && !ens[0].Spare {
		h, err = r.hd.fileHeader(ens[0].Mount, path, f, id)
	}
	f.Close()
	match := -1 // the index in ens of the file's entry
	switch {
	case err == nil && ens[0].Spare:
		// A spare left on disk (index.leaveSpare), alone in ens: its
		// name is this engine's own, and the file there is the spare
		// whatever its header says (an evicted file's, zeros, or part
		// of each).
		match = 0
	case err == nil:
		match = slices.IndexFunc(ens, func(en *entry) bool { return sameFile(en, id, h) || en.UnknownWithID(h.ID) })
	case errors.Is(err, ErrCorrupt):
		// A corrupt file at the inode indexed (a corrupt file being
		// dropped; writing into it changed its ctime): its header cannot
		// say more, and a corrupt file is no one's data.
		match = slices.IndexFunc(ens, func(en *entry) bool { return en.Ident.Inode() == id.Inode() })
	default:
		return fail("check before remove", ens[0], path, err)
	}
	if match < 0 {
		r.log.Debug("engine: not removed: the file at the path is another one", "path", path)
		return false, nil, ""
	}
	// A spare keeps its inode and pages: movers keep what they cache of
	// it (a registration of its pages) for the store that reuses it.
	if spare {
		kept, at := r.host.keepSpare(m, dir, path, id, ens[0].Size)
		if kept {
			return true, nil, ""
		}
		path = at
	}
	if err := r.removeFileIn(m, dir, path, id); err != nil {
		return fail("remove", ens[match], path, err)
	}
	return false, nil, ""
}

// leftRetryInterval is the least time between two tries of retryLeft at
// one file whose removal failed. Evictions come as often as stores cross
// the high watermark, many a second on a busy mount, and each try is a
// few system calls per file left; on a read-only remount every evicted
// file is left. The first retry comes at the next eviction (a passing
// failure frees the room at once), later ones at most once an interval:
// a lasting cause (EROFS, EACCES) then costs a few calls per file every
// 10 s, and the room comes back within 10 s of its fix.
const leftRetryInterval = 10 * time.Second
