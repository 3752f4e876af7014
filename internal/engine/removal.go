package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/engine/index"
	"github.com/kvhost/kvhost/internal/engine/removals"
)

// The removal part (docs/engine.md, "Removal"): dropping entries from the
// index and removing their files (drop.go), deleting and purging at a
// client's request (delete.go), and the unlink itself (here).
//
// removeFile is the only way the engine unlinks a file under a mount: a
// data file (delete, eviction, a corrupt file, a failed publication, the
// source of a move), a temporary file (a store or move that failed, was
// cancelled, or hit ENOSPC before its retry) and a spare. Every mover
// is told to forget the file first: what a mover keeps of a file (the
// GPU path's CUDA registration, which pins the file's pages; a cuFile
// handle with its descriptor, which keeps its blocks allocated) must not
// outlive the name, or the engine would count free what a mover still
// holds. The registrar's periodic sweep of unlinked files is only a
// backstop for files removed behind the engine's back.

// remover is the removal part. It holds no lock of its own: the index's
// path claims (index.Drop, index.Release...) order its removals, and it
// counts what vanished and what it failed to remove.
type remover struct {
	ix     *index.Index
	fs     fsys.FS
	log    *slog.Logger
	now    func() time.Time
	hd     *headerReader // a file's header (drop.go)
	host   removalHost
	mounts []*mount // the engine's, set once Open has opened them all

	vanished atomic.Uint64 // Stats.Vanished
	failures atomic.Uint64 // Stats.RemoveFailures

	// feed records every key that leaves the index or changes mount
	// (published, movedKeys), for the daemon's removal streams
	// (Engine.Removals); sweep finds the files other nodes removed
	// while it has subscribers (removalfeed.go).
	feed  removals.Feed
	sweep vanishSweep
	// objs is the object mount: an evicted file's key it holds is
	// recorded moved there (published). Set once at Open.
	objs *objectTier
	// pending holds the entries dropped whose files are still to be
	// removed, each with the reason its keys' removal is recorded for
	// once its file is gone (pend, settle): by the dropper (removeAt,
	// evictClaimed), by the job that held the path meanwhile (an
	// orphan: endRelease), or by a later try where the removal failed
	// (index.Leaving's left: retryLeft, a purge). An orphan of an eviction
	// (index.Evict) has none: it is recorded evicted (publishOrphans).
	pending sync.Map // *entry -> removals.Reason
}

// published records the removal of the keys of en, which has just left
// the index, for reason: those the index no longer finds (a key another
// file holds is still stored: no record). It costs one atomic load while
// the feed has never had a subscriber.
func (r *remover) published(en *entry, reason removals.Reason) {
	if !r.feed.Recording() || en.Spare {
		return
	}
	// An evicted file's key the object mount holds is still stored,
	// there: a move to its medium.
	evicted := reason == removals.Evicted || reason == removals.ClusterEvicted
	recs := make([]removals.Record, 0, len(en.Keys))
	for _, k := range en.Keys {
		if r.ix.Files().Get(en.FP, []byte(k)) != nil {
			continue
		}
		rec := removals.Record{FP: en.FP, Key: k, Reason: reason, Mount: en.Mount, To: removals.NoMount}
		if evicted && r.objs != nil && r.objs.holds(en.FP, []byte(k)) {
			rec.Reason, rec.To = removals.Moved, r.objs.index()
		}
		recs = append(recs, rec)
	}
	r.feed.Publish(recs...)
}

// pend holds the record of the removal of en's keys, for reason, until
// its file is gone (settle). It costs one atomic load while the feed has
// never had a subscriber.
func (r *remover) pend(en *entry, reason removals.Reason) {
	if r.feed.Recording() && !en.Spare {
		r.pending.Store(en, reason)
	}
}

// settle records the removal of en's keys that pend held, now that its
// file is gone from its path (removed, kept as a spare, or found gone or
// replaced), and reports whether one was pending.
func (r *remover) settle(en *entry) bool {
	reason, ok := r.pending.LoadAndDelete(en)
	if ok {
		r.published(en, reason.(removals.Reason))
	}
	return ok
}

// evictedReason is the feed's reason of the eviction of en.
func (r *remover) evictedReason(en *entry) removals.Reason {
	if r.mounts[en.Mount].cluster != nil {
		return removals.ClusterEvicted
	}
	return removals.Evicted
}

// publishOrphans records the removal of the keys of orphans, entries
// dropped while a job of this engine held their paths, whose files that
// job has just tried to remove (endRelease): with the reason their drop
// left (pend), or evicted (index.Evict and EvictID leave the file of a
// held path to its holder, and record nothing). left, where not nil, is
// the orphan whose file is still there: its record waits for the retry
// that removes it. A key the holder's own file holds now (a store that
// published at the path) is still stored: no record.
func (r *remover) publishOrphans(orphans []*entry, left *entry) {
	if !r.feed.Recording() {
		return
	}
	for _, en := range orphans {
		if en == left {
			if _, ok := r.pending.Load(en); !ok {
				r.pend(en, r.evictedReason(en))
			}
			continue
		}
		if !r.settle(en) {
			r.published(en, r.evictedReason(en))
		}
	}
}

// movedKeys records that the keys of en, a move's source, are now in to,
// the copy (or the file at the target) that took its place in the index:
// those the index finds in to.
func (r *remover) movedKeys(en, to *entry) {
	if !r.feed.Recording() {
		return
	}
	recs := make([]removals.Record, 0, len(en.Keys))
	for _, k := range en.Keys {
		if r.ix.Files().Get(en.FP, []byte(k)) != to {
			continue
		}
		recs = append(recs, removals.Record{FP: en.FP, Key: k, Reason: removals.Moved, Mount: en.Mount, To: to.Mount})
	}
	r.feed.Publish(recs...)
}

// reasonOf is the feed's reason of a drop (drop, dropUnpinned) that its
// caller explains as why: "deleted", "purged" (and "purged on the
// cluster"), "corrupt" and a vllm-fs row cut short; anything else is a
// file that went behind the engine's back (dropVanished's, and the old
// file of a store that failed after its rename).
func reasonOf(why string) removals.Reason {
	switch {
	case why == "deleted":
		return removals.Deleted
	case strings.HasPrefix(why, "purged"):
		return removals.Purged
	case why == "corrupt", strings.HasSuffix(why, "cut short"):
		return removals.Corrupt
	}
	return removals.Vanished
}

// removalHost is what removal asks of the rest of the engine: a spare kept of an evicted file (spares.go), the
// movers told to forget a file (movers.go) and the policy told of the
// entries dropped (hits.go).
type removalHost interface {
	keepSpare(m *mount, dir fsys.File, path string, id fsys.Identity, evicted int64) (bool, string)
	forget(id fsys.Identity)
	access(ctx context.Context, recs []abi.AccessRecord)
}

// removeFile tells every mover to forget the file with identity id, then
// unlinks path, a file on m. A zero id (the caller could not read it) is
// read from the name first. A file already gone is no error. Callers
// count the file's bytes free only after it returns.
//
// The unlink is relative to path's directory, opened once without
// following any link below m's linkFree directory (openDir: its root; a
// vllm-fs mount's data directory): the name is looked at there
// (fstatat), and unlinked there only if it still names id's inode (a
// file another node renamed onto the path since the caller's check is
// not removed: nil, as for a file gone). A directory of path replaced by
// a symbolic link after the caller's check then never makes the unlink
// remove a file of that name where the link points; the opened
// directory, where it is moved away, still holds the file. A file above
// a vllm-fs mount's data directory (a temporary file of config.json, in
// the base directory, the operator's) is removed by name.
func (r *remover) removeFile(m *mount, path string, id fsys.Identity) error {
	return r.removeFileIn(m, nil, path, id)
}

// removeFileIn is removeFile where the caller holds path's directory open
// as dir (openDir), or with dir nil.
func (r *remover) removeFileIn(m *mount, dir fsys.File, path string, id fsys.Identity) error {
	if rel, ok := m.belowLinkFree(path); !ok || rel == "" {
		return r.removeByName(path, id)
	}
	if dir == nil {
		d, err := m.openDir(r.fs, filepath.Dir(path))
		if errors.Is(err, os.ErrNotExist) {
			return nil // the directory gone, and the file with it
		}
		if err != nil {
			return fmt.Errorf("engine: remove %s: %w", path, err)
		}
		defer d.Close()
		dir = d
	}
	fi, err := fsys.StatAt(r.fs, dir, path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("engine: remove %s: %w", path, err)
	}
	now, err := fsys.IdentityOf(fi)
	if err != nil {
		return fmt.Errorf("engine: remove %s: %w", path, err)
	}
	switch {
	case id.Ino == 0:
		id = now
	case now.Inode() != id.Inode():
		r.log.Debug("engine: not removed: the file at the path is another one", "path", path)
		return nil
	}
	r.host.forget(id)
	if err := fsys.RemoveAt(r.fs, dir, path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("engine: remove %s: %w", path, err)
	}
	return nil
}

// removeByName is removeFile of a file above a vllm-fs mount's data
// directory (removeFileIn), or of one no mount holds yet (writeConfig's
// temporary file): by name.
func (r *remover) removeByName(path string, id fsys.Identity) error {
	if id.Ino == 0 {
		fi, err := r.fs.Stat(path)
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return nil
			}
			return fmt.Errorf("engine: remove %s: %w", path, err)
		}
		if id, err = fsys.IdentityOf(fi); err != nil {
			return fmt.Errorf("engine: remove %s: %w", path, err)
		}
	}
	r.host.forget(id)
	if err := r.fs.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("engine: remove %s: %w", path, err)
	}
	return nil
}

// removeTemp removes a temporary file on m that was not published (a
// store's or a move's that failed or was cancelled, a store's first try
// before its retry after an ENOSPC, or a spare made ahead whose
// allocation failed), f being the file while it is still open (nil once
// closed): removeFile with its identity, read from f where it is open
// (never another file's, should the name have been replaced). The caller
// does not count the file (it gives its reservation back, or keeps it for
// the retry): a file whose removal fails stays counted as a spare's does
// (removeOwn), of f's size, or where f cannot say it, of size bytes.
func (r *remover) removeTemp(m *mount, tmp string, f fsys.File, size int64) {
	id := fsys.Identity{Size: size} // no inode: read from the name
	if f != nil {
		if fid, err := fileIdentity(f); err == nil {
			id = fid
		}
	}
	r.removeOwn(m, tmp, id, "temporary file")
}

// removeOwn removes the file at path on m, of identity id (of which the
// size is what m is to count; a zero id is read from the name): a file of
// this engine's own name (a spare, a temporary file) that m no longer
// counts. Where the removal fails the file is still there: m counts it as
// used (index.leaveSpare), as it does a data file whose removal failed,
// until an eviction there removes it (retryLeft); the failure counts in
// Stats.RemoveFailures. what names the file in the warning.
func (r *remover) removeOwn(m *mount, path string, id fsys.Identity, what string) {
	r.removeOwnIn(m, nil, path, id, what)
}

// removeOwnIn is removeOwn where the caller holds path's directory open
// as dir (removeFileIn), or with dir nil.
func (r *remover) removeOwnIn(m *mount, dir fsys.File, path string, id fsys.Identity, what string) {
	if err := r.removeFileIn(m, dir, path, id); err != nil {
		r.failures.Add(1)
		r.log.Warn("engine: remove a "+what, "path", path, "err", err)
		r.ix.Leaving().LeaveSpare(m.idx, path, id.Size)
	}
}
