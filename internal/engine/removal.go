package engine

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/kvhost/kvhost/fsys"
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
func (e *Engine) removeFile(m *mount, path string, id fsys.Identity) error {
	return e.removeFileIn(m, nil, path, id)
}

// removeFileIn is removeFile where the caller holds path's directory open
// as dir (openDir), or with dir nil.
func (e *Engine) removeFileIn(m *mount, dir fsys.File, path string, id fsys.Identity) error {
	if rel, ok := m.belowLinkFree(path); !ok || rel == "" {
		return e.removeByName(path, id)
	}
	if dir == nil {
		d, err := e.openDir(m, filepath.Dir(path))
		if errors.Is(err, os.ErrNotExist) {
			return nil // the directory gone, and the file with it
		}
		if err != nil {
			return fmt.Errorf("engine: remove %s: %w", path, err)
		}
		defer d.Close()
		dir = d
	}
	fi, err := fsys.StatAt(e.fs, dir, path)
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
		e.log.Debug("engine: not removed: the file at the path is another one", "path", path)
		return nil
	}
	e.forget(id)
	if err := fsys.RemoveAt(e.fs, dir, path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("engine: remove %s: %w", path, err)
	}
	return nil
}

// removeByName is removeFile of a file above a vllm-fs mount's data
// directory (removeFileIn), or of one no mount holds yet (writeConfig's
// temporary file): by name.
func (e *Engine) removeByName(path string, id fsys.Identity) error {
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

// removeTemp removes a temporary file on m that was not published (a
// store's or a move's that failed or was cancelled, a store's first try
// before its retry after an ENOSPC, or a spare made ahead whose
// allocation failed), f being the file while it is still open (nil once
// closed): removeFile with its identity, read from f where it is open
// (never another file's, should the name have been replaced). The caller
// does not count the file (it gives its reservation back, or keeps it for
// the retry): a file whose removal fails stays counted as a spare's does
// (removeOwn), of f's size, or where f cannot say it, of size bytes.
func (e *Engine) removeTemp(m *mount, tmp string, f fsys.File, size int64) {
	id := fsys.Identity{Size: size} // no inode: read from the name
	if f != nil {
		if fid, err := fileIdentity(f); err == nil {
			id = fid
		}
	}
	e.removeOwn(m, tmp, id, "temporary file")
}

// removeOwn removes the file at path on m, of identity id (of which the
// size is what m is to count; a zero id is read from the name): a file of
// this engine's own name (a spare, a temporary file) that m no longer
// counts. Where the removal fails the file is still there: m counts it as
// used (index.leaveSpare), as it does a data file whose removal failed,
// until an eviction there removes it (retryLeft); the failure counts in
// Stats.RemoveFailures. what names the file in the warning.
func (e *Engine) removeOwn(m *mount, path string, id fsys.Identity, what string) {
	e.removeOwnIn(m, nil, path, id, what)
}

// removeOwnIn is removeOwn where the caller holds path's directory open
// as dir (removeFileIn), or with dir nil.
func (e *Engine) removeOwnIn(m *mount, dir fsys.File, path string, id fsys.Identity, what string) {
	if err := e.removeFileIn(m, dir, path, id); err != nil {
		e.st.removeFailures.Add(1)
		e.log.Warn("engine: remove a "+what, "path", path, "err", err)
		e.ix.LeaveSpare(m.idx, path, id.Size)
	}
}
