package engine

import (
	"errors"
	"fmt"
	"syscall"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/format"
)

// Reading a file's header and entry, whatever the mount's layout: the
// header in the file on a kvhost mount, or made from the layout and the
// file's name and size on a vllm-fs mount (vllmfs.go).

// openSame opens the file at en's path and checks that it is en's file
// (identity and header id). It returns the open file and its header, or an
// error wrapping os.ErrNotExist (vanished), errReplaced, ErrCorrupt (the
// file at the path does not decode) or the I/O error. The open follows no
// symbolic link below the mount's root (openNoLinks), as every other open
// of a data file: a link at the path, even to en's own file moved aside,
// is not en's file (errReplaced), as a load takes it for a vanished one;
// nor does it wait on a named pipe at the path (checkOpen).
func (e *Engine) openSame(en *entry, flag int) (fsys.File, *format.Header, error) {
	f, err := e.openNoLinks(e.mounts[en.Mount], en.Path, flag|checkOpen, 0)
	if errors.Is(err, syscall.ELOOP) {
		return nil, nil, fmt.Errorf("%w: %s, or a directory of it in the mount, is a symbolic link: %w", errReplaced, en.Path, err)
	}
	if err != nil {
		return nil, nil, err
	}
	id, err := fileIdentity(f)
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	if !id.Mode.IsRegular() {
		f.Close()
		return nil, nil, fmt.Errorf("%w: %s is not a regular file", errReplaced, en.Path)
	}
	h, err := e.fileHeader(en.Mount, en.Path, f, id)
	if err != nil {
		f.Close()
		if !en.Ident.Same(id) {
			return nil, nil, fmt.Errorf("%w: %s", errReplaced, en.Path)
		}
		return nil, nil, err
	}
	if !sameFile(en, id, h) {
		f.Close()
		return nil, nil, fmt.Errorf("%w: %s: inode %d id %#x, indexed inode %d id %#x", errReplaced, en.Path, id.Ino, h.ID, en.Ident.Ino, en.FID)
	}
	return f, h, nil
}

// readEntry reads the header of the file at path into an unindexed entry.
// A kvhost file shorter than its header says is corrupt: a *shortFileError
// (wrapping ErrCorrupt) with the entry of what is there.
func (e *Engine) readEntry(mnt int, path string) (*entry, error) {
	if e.mounts[mnt].raw != nil {
		return e.rawEntry(mnt, path)
	}
	// The identity is that of the file whose header is read.
	f, id, err := e.openRegular(e.mounts[mnt], path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	h, err := e.readHeader(f)
	if err != nil {
		return nil, err
	}
	if id.Size < h.FileLen() {
		return nil, &shortFileError{en: e.entryOf(mnt, path, h, id), want: h.FileLen()}
	}
	return e.entryOf(mnt, path, h, id), nil
}

// shortFileError is readEntry's error for a file whose header decodes but
// that is shorter than the header says (cut short: a crash of the file
// system, a truncation behind kvhost's back). It wraps ErrCorrupt. en is
// the unindexed entry of the file as it is (its size the file's), whose
// id tells its owner (the adoption walk removes a dead node's).
type shortFileError struct {
	en   *entry
	want int64 // the file's length as its header says
}

// Error names the file and its sizes.
func (e *shortFileError) Error() string {
	return fmt.Sprintf("%v: %s: %d bytes, header says %d", ErrCorrupt, e.en.Path, e.en.Size, e.want)
}

// Unwrap returns ErrCorrupt.
func (e *shortFileError) Unwrap() error { return ErrCorrupt }

// entryOf returns an unindexed entry for the file at path with header h
// and identity id.
func (e *Engine) entryOf(mnt int, path string, h *format.Header, id fsys.Identity) *entry {
	en := &entry{FP: h.Fingerprint, Mount: mnt, Path: path, Size: id.Size, Ident: id, FID: h.ID, Last: id.Mtime}
	en.Verified.Store(e.cfg.Now().UnixNano())
	for _, k := range h.Keys {
		en.Keys = append(en.Keys, string(k.Key))
	}
	return en
}

// fileHeader returns the header of the open file f at path on mount mnt,
// whose identity id the caller took (fileIdentity, one fstat per open):
// read from the file on a kvhost mount, made from the layout and id.Size
// on a vllm-fs mount.
func (e *Engine) fileHeader(mnt int, path string, f fsys.File, id fsys.Identity) (*format.Header, error) {
	m := e.mounts[mnt]
	if m.raw == nil {
		return e.readHeader(f)
	}
	return e.rawHeader(m, path, id.Size)
}
