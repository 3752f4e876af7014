package engine

import (
	"errors"
	"fmt"
	"sync"
	"syscall"
	"time"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/format"
)

// headerReader opens the engine's files on its mounts and reads their
// headers and entries, whatever the mount's layout: the header in the
// file on a kvhost mount, or made from the layout and the file's name and
// size on a vllm-fs mount (raw: vllmfs.go). Every open below a mount's
// root goes through it (openNoLinks), and it owns the buffers of the
// headers' first reads (readHeader).
type headerReader struct {
	fs     fsys.FS
	mounts []*mount // set as Open adds them
	now    func() time.Time
	raw    rawFiles
	heads  sync.Pool // *[]byte: readHeader's first read, format.Align bytes, aligned
}

// rawFiles makes the entries and headers of a vllm-fs mount's row files,
// which hold no header (vllmfs.go).
type rawFiles interface {
	rawEntry(mnt int, path string) (*entry, error)
	rawHeader(m *mount, path string, size int64) (*format.Header, error)
}

// header returns an aligned buffer of format.Align bytes for a header's
// first read, reused where one is free, and put to give it back.
func (hr *headerReader) header() (buf []byte, put func()) {
	p, _ := hr.heads.Get().(*[]byte)
	if p == nil {
		buf := fsys.AlignedBuffer(format.Align)
		p = &buf
	}
	return *p, func() { hr.heads.Put(p) }
}

// openSame opens the file at en's path and checks that it is en's file
// (identity and header id). It returns the open file and its header, or an
// error wrapping os.ErrNotExist (vanished), errReplaced, ErrCorrupt (the
// file at the path does not decode) or the I/O error. The open follows no
// symbolic link below the mount's root (openNoLinks), as every other open
// of a data file: a link at the path, even to en's own file moved aside,
// is not en's file (errReplaced), as a load takes it for a vanished one;
// nor does it wait on a named pipe at the path (checkOpen).
func (hr *headerReader) openSame(en *entry, flag int) (fsys.File, *format.Header, error) {
	f, err := hr.openNoLinks(hr.mounts[en.Mount], en.Path, flag|checkOpen, 0)
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
	h, err := hr.fileHeader(en.Mount, en.Path, f, id)
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
func (hr *headerReader) readEntry(mnt int, path string) (*entry, error) {
	if hr.mounts[mnt].raw != nil {
		return hr.raw.rawEntry(mnt, path)
	}
	// The identity is that of the file whose header is read.
	f, id, err := hr.openRegular(hr.mounts[mnt], path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	h, err := hr.readHeader(f)
	if err != nil {
		return nil, err
	}
	if id.Size < h.FileLen() {
		return nil, &shortFileError{en: hr.entryOf(mnt, path, h, id), want: h.FileLen()}
	}
	return hr.entryOf(mnt, path, h, id), nil
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
func (hr *headerReader) entryOf(mnt int, path string, h *format.Header, id fsys.Identity) *entry {
	en := &entry{FP: h.Fingerprint, Mount: mnt, Path: path, Size: id.Size, Ident: id, FID: h.ID, Last: id.Mtime}
	en.Verified.Store(hr.now().UnixNano())
	for _, k := range h.Keys {
		en.Keys = append(en.Keys, string(k.Key))
	}
	return en
}

// fileHeader returns the header of the open file f at path on mount mnt,
// whose identity id the caller took (fileIdentity, one fstat per open):
// read from the file on a kvhost mount, made from the layout and id.Size
// on a vllm-fs mount.
func (hr *headerReader) fileHeader(mnt int, path string, f fsys.File, id fsys.Identity) (*format.Header, error) {
	m := hr.mounts[mnt]
	if m.raw == nil {
		return hr.readHeader(f)
	}
	return hr.raw.rawHeader(m, path, id.Size)
}

// rewrittenUnder reports whether the file f, whose header h a load (or a
// move's copy) read before its payload, was rewritten meanwhile (a spare reused by another
// engine on the directory): its header no longer decodes, or names
// another file id. Only memory mounts in kvhost's layout keep spares.
func (hr *headerReader) rewrittenUnder(m *mount, f fsys.File, h *format.Header) bool {
	if !m.memory || m.raw != nil {
		return false
	}
	now, err := hr.peekHeader(f)
	return err != nil || now.ID != h.ID
}
