package engine

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/internal/fsys"
)

// Removal (docs/engine.md, "Data movers").
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

// removeFile tells every mover to forget the file with identity id, then
// unlinks path. A zero id (the caller could not read it) is read from the
// name first. A file already gone is no error. Callers count the file's
// bytes free only after it returns.
func (e *Engine) removeFile(path string, id fsys.Identity) error {
	if id.Ino == 0 {
		fi, err := e.fs.Stat(path)
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
	e.forget(id)
	if err := e.fs.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("engine: remove %s: %w", path, err)
	}
	return nil
}

// removeTemp removes a temporary file that was not published (or a spare
// made ahead that was not kept), f being the file while it is still open
// (nil once closed): removeFile with its identity, read from f where it
// is open (never another file's, should the name have been replaced).
func (e *Engine) removeTemp(tmp string, f fsys.File) {
	var id fsys.Identity
	if f != nil {
		id, _ = fileIdentity(f) // zero if fstat failed: read from the name
	}
	if err := e.removeFile(tmp, id); err != nil {
		e.log.Warn("engine: remove temporary file", "path", tmp, "err", err)
	}
}

// drop removes en from the index, tells the policy, and, if remove is set,
// removes its file (holding its path meanwhile, so that a store publishing
// a new file there waits and its file is never the one removed). It
// reports whether en was still indexed, that is, whether this call
// dropped it.
func (e *Engine) drop(ctx context.Context, en *entry, remove bool, why string) bool {
	e.ix.mu.Lock()
	was, claimed := e.ix.dropLocked(en, remove)
	rec := en.access(abi.AccessRemove, e.now().UnixNano())
	e.ix.mu.Unlock()
	if !was {
		return false
	}
	if claimed {
		e.removeClaimed(en)
	}
	e.log.Debug("engine: entry dropped", "path", en.path, "why", why)
	e.access(ctx, []abi.AccessRecord{rec})
	return true
}

// release ends this engine's claim on path, first removing the orphans
// left to it, and wakes the stores waiting for the path.
func (e *Engine) release(path string) {
	e.releaseFreed(path, nil)
}

// releaseFreed is release for a holder that has just removed the files of
// freed (or found them gone), which their mounts counted as used until
// then: they stop counting in the same hold of the index's lock.
func (e *Engine) releaseFreed(path string, freed []*entry) {
	e.ix.mu.Lock()
	fl, orphans := e.ix.releaseLocked(path, freed)
	e.ix.mu.Unlock()
	e.endRelease(path, fl, orphans)
}

// endRelease finishes what index.releaseLocked began, without the lock:
// it wakes the stores waiting for the path, or removes the orphans left
// to the claim (never a file its holder just published: they are entries
// of files unindexed while it held the path) and releases the path again.
func (e *Engine) endRelease(path string, fl *flight, orphans []*entry) {
	if fl != nil {
		close(fl.done)
		return
	}
	e.removeIfSame(path, orphans)
	e.releaseFreed(path, orphans)
}

// removeClaimed removes en's file (if it is still the file at its path) and
// releases the path claimed by index.dropLocked.
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
