package engine

import (
	"errors"
	"fmt"
	"os"

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
