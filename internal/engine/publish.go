package engine

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/format"
)

// Publishing a file: a store's new file and a move's copy are written
// under an owned temporary name (createTemp, or a spare taken for a
// store), then published by publish — fsync (Config.Fsync, and on NFS
// with buffered I/O: mount.syncFirst), rename into place, and the
// identity of the file renamed, read from the open file.

// publish makes tmp, open as f and fully written, the file of en (whose
// path is where it goes, on mount m): it fsyncs f (Config.Fsync; on a
// mount whose file system's clients send the rename before the data,
// always: mount.syncFirst), renames tmp to en.path and sets en.ident from
// the open file (seal), unless ctx ended first. replaces is the entry of the file the rename replaces
// (nil: none), which the movers forget first; where a file that is not
// kvhost's lies there instead (the indexed one replaced behind the
// engine's back), nothing is renamed and the error wraps ErrPolicy
// (othersAt); so it does where a link or a file took the place of its
// directory (openDir: ErrInvalid on a vllm-fs mount). published reports whether
// the rename happened: the temporary name is gone and f is closed. A
// failure after it removes the file again if it is still en's (the
// caller holds the path; another node may have replaced it; where the
// fstat failed, the header's file id decides) and returns the error with
// published true; left is en where that removal failed (disposeIfSame):
// the file is still at en.path, and the caller keeps its reservation
// counted as the file's (index.leave) instead of giving it back. op
// prefixes the failed step's name in the error (ioError).
func (e *Engine) publish(ctx context.Context, m *mount, f fsys.File, tmp string, en, replaces *entry, op string) (published bool, left *entry, err error) {
	if e.cfg.Fsync || m.syncFirst {
		if err := f.Sync(); err != nil {
			return false, nil, ioError(m, op+"fsync", err)
		}
	}
	if err := ctx.Err(); err != nil {
		return false, nil, err // cancelled: never published
	}
	err = e.rename(m, tmp, en.Path, replaces)
	if errors.Is(err, ErrPolicy) || isLinkRefusal(err) {
		return false, nil, err
	}
	if err != nil {
		return false, nil, ioError(m, op+"rename", err)
	}
	en.Ident, err = e.seal(f, filepath.Dir(en.Path))
	if err != nil {
		// Visible but not vouched for (not durable, or its identity
		// unknown): removed rather than indexed, if it is still ours.
		if en.Ident.Ino == 0 && en.FID != 0 {
			// The fstat failed: the name's identity, which the header's
			// file id, read before the removal, proves ours or not. Where
			// the name's stat fails too, the id alone decides then, and
			// at every retry (disposeIfSame).
			if fi, serr := e.fs.Stat(en.Path); serr == nil {
				en.Ident, _ = fsys.IdentityOf(fi)
			}
		}
		if en.Ident.Ino != 0 || en.FID != 0 {
			left = e.rm.removeIfSame(en.Path, []*entry{en})
		}
		return true, left, ioError(m, op+"publish", err)
	}
	en.Verified.Store(e.cfg.Now().UnixNano())
	return true, nil, nil
}

// rename renames tmp to path, in one directory on m, for publish:
// replaces is the entry of the file the rename replaces (nil: none). The
// directory is opened once without following any link below m's
// linkFree directory (openDir: its root; a vllm-fs mount's data
// directory; ErrPolicy, ErrInvalid on a vllm-fs mount, where a link or a
// file took its place since the temporary file was made), and the rename
// is of the names in it (renameat2): a directory replaced by a symbolic
// link in the meantime never takes the file out of the mount. In kvhost's
// layout the indexed file may have been replaced behind the engine's back
// by one that is not kvhost's: looked at as a file the index does not
// hold is (othersAt), and never destroyed; where the index holds none the
// rename does not replace (renameNew). A vllm-fs row, which has no
// header, replaces what is at its name (vLLM's row of the same key, or a
// file cut short), as vLLM's own rename does.
func (e *Engine) rename(m *mount, tmp, path string, replaces *entry) error {
	dir, err := e.hd.openDir(m, filepath.Dir(path))
	if err != nil {
		return err
	}
	defer dir.Close()
	if m.raw != nil {
		if replaces != nil {
			e.forget(replaces.Ident)
		}
		return fsys.RenameAt(e.fs, dir, tmp, dir, path, false)
	}
	if replaces == nil {
		return e.renameNew(m, dir, tmp, path)
	}
	if err := e.othersAt(m, path); err != nil {
		return err
	}
	e.forget(replaces.Ident) // the rename replaces it
	return fsys.RenameAt(e.fs, dir, tmp, dir, path, false)
}

// renameNew renames tmp to path in dir, their directory, open, where the
// index holds no file. Only a file that is not there, or a kvhost file
// (othersAt: another engine's, or a crash's), is replaced: the rename
// does not replace (RENAME_NOREPLACE), and only where path exists does
// othersAt look at it before the rename that replaces it. A file system
// without RENAME_NOREPLACE (NFS, most FUSE file systems; m.plainRenames
// from its first refusal) gets the look before every rename, and a file
// put at path between the two is replaced.
func (e *Engine) renameNew(m *mount, dir fsys.File, tmp, path string) error {
	if !m.plainRenames.Load() {
		err := fsys.RenameAt(e.fs, dir, tmp, dir, path, true)
		switch {
		case errors.Is(err, errors.ErrUnsupported):
			m.plainRenames.Store(true)
		case !errors.Is(err, fs.ErrExist):
			return err
		}
	}
	if err := e.othersAt(m, path); err != nil {
		return err
	}
	return fsys.RenameAt(e.fs, dir, tmp, dir, path, false)
}

// othersAt fails with ErrPolicy where path holds a file that is not a
// kvhost file (no format.Magic at its start: a file someone put in the
// mount, a symbolic link, a socket), which a rename would destroy: only a
// policy that names a key's file where such a file lies gets there. A
// kvhost file the index does not hold (another node's or engine's, or
// one left by a crash) may be replaced.
func (e *Engine) othersAt(m *mount, path string) error {
	f, err := e.hd.openNoLinks(m, path, os.O_RDONLY|syscall.O_NOFOLLOW|checkOpen, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err == nil {
		var b [len(format.Magic)]byte
		n, rerr := f.ReadAt(b[:], 0)
		f.Close()
		if rerr == nil && n == len(b) && string(b[:]) == format.Magic {
			return nil
		}
		if rerr != nil && !errors.Is(rerr, io.EOF) {
			err = rerr
		}
	}
	if errors.Is(err, syscall.EISDIR) {
		return nil // the rename fails, and the store says so (a directory at its path)
	}
	if err != nil && !errors.Is(err, syscall.ELOOP) && !errors.Is(err, syscall.ENXIO) {
		// Cannot tell (EACCES, I/O): not destroyed on a guess either.
		return fmt.Errorf("%w: %s, where the policy names a key's file, cannot be read to tell whether it is a kvhost file: %w", ErrPolicy, path, err)
	}
	return fmt.Errorf("%w: %s, where the policy names a key's file, holds a file that is not kvhost's: kvhost does not replace it", ErrPolicy, path)
}

// seal finishes publishing f, just renamed into directory dir: it takes
// f's identity (after the rename, which sets its ctime: never a stat of
// the name, which may already be another's), closes f and, with
// Config.Fsync, syncs dir. The identity is zero where the fstat failed.
func (e *Engine) seal(f fsys.File, dir string) (fsys.Identity, error) {
	id, err := fileIdentity(f)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil && e.cfg.Fsync {
		err = e.fs.SyncDir(dir)
	}
	return id, err
}
