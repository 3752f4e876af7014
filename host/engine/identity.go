package engine

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"slices"

	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/internal/fsys"
	"github.com/kvhost/kvhost/staging"
)

// File identity (docs/engine.md, "File identity").
//
// An entry remembers two things about its file: what the file system says
// (device, inode, size, ctime: fsys.Identity, one stat to check) and the
// random id the writer put in the header (format.Header.ID, which never
// repeats). The stat is the cheap check of Lookup; the id is read (one
// open and one 4 KiB pread) wherever a wrong answer would lose data:
// before a store answers present, before a file is removed, and at every
// load (which reads the header anyway).

// newFileID draws the id of a file about to be written: random, non-zero.
func newFileID() uint64 {
	for {
		if id := rand.Uint64(); id != 0 {
			return id
		}
	}
}

// sameFile reports whether the header h read from a file with identity id
// is the file of en. With a file id the id decides (with the device and
// inode): a file written in place keeps its id, and its ctime changes, but
// it is the same file (a load's checksums judge its bytes). Without one
// (files written before ids) the whole stat identity and the key list
// must match.
func (en *entry) sameFile(id fsys.Identity, h *format.Header) bool {
	if en.fid != 0 || h.ID != 0 {
		return en.fid == h.ID && en.ident.Dev == id.Dev && en.ident.Ino == id.Ino
	}
	if !en.ident.Same(id) || h.Fingerprint != en.fp || len(h.Keys) != len(en.keys) {
		return false
	}
	for i, k := range h.Keys {
		if string(k.Key) != en.keys[i] {
			return false
		}
	}
	return true
}

// errReplaced: the file at an entry's path is not the entry's file.
var errReplaced = errors.New("engine: file replaced")

// openSame opens the file at en's path and checks that it is en's file
// (identity and header id). It returns the open file and its header, or an
// error wrapping os.ErrNotExist (vanished), errReplaced, ErrCorrupt (the
// file at the path does not decode) or the I/O error.
func (e *Engine) openSame(en *entry, flag int) (fsys.File, *format.Header, error) {
	f, err := e.fs.OpenFile(en.path, flag, 0)
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
		return nil, nil, fmt.Errorf("%w: %s is not a regular file", errReplaced, en.path)
	}
	h, err := e.fileHeader(en.mount, en.path, f, id)
	if err != nil {
		f.Close()
		if !en.ident.Same(id) {
			return nil, nil, fmt.Errorf("%w: %s", errReplaced, en.path)
		}
		return nil, nil, err
	}
	if !en.sameFile(id, h) {
		f.Close()
		return nil, nil, fmt.Errorf("%w: %s: inode %d id %#x, indexed inode %d id %#x", errReplaced, en.path, id.Ino, h.ID, en.ident.Ino, en.fid)
	}
	return f, h, nil
}

// confirm checks, reading the header, that en's file is still the one
// indexed; a file removed or replaced drops the entry (false). It is the
// check before a store answers present. An I/O error other than "not
// found" is false but keeps the entry.
func (e *Engine) confirm(ctx context.Context, en *entry) bool {
	f, _, err := e.openSame(en, os.O_RDONLY)
	if err == nil {
		f.Close()
		en.verified.Store(e.now().UnixNano())
		return true
	}
	switch {
	case errors.Is(err, os.ErrNotExist), errors.Is(err, errReplaced):
		e.st.vanished.Add(1)
		e.drop(ctx, en, false, err.Error())
	default:
		e.log.Warn("engine: check of an indexed file", "path", en.path, "err", err)
	}
	return false
}

// fileIdentity is the identity of an open file (fstat).
func fileIdentity(f fsys.File) (fsys.Identity, error) {
	fi, err := fsys.Fstat(f)
	if err != nil {
		return fsys.Identity{}, err
	}
	return fsys.IdentityOf(fi)
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

// removeIfSame removes the file at path if it is the file of one of ens
// (same identity and header id): a file at the path is never removed by
// name alone. The caller holds the path, so no store of this engine
// publishes there meanwhile; another node may still rename a file onto the
// path between the check and the unlink (a window of one system call,
// docs/engine.md).
func (e *Engine) removeIfSame(path string, ens []*entry) {
	e.disposeIfSame(path, ens, false)
}

// disposeIfSame is removeIfSame; with spare set (an evicted entry, whose
// file its mount still counts as used: evict), the file is kept as a
// spare for later stores where its mount keeps spares and it fits
// (spares.go), its bytes then moving to the spares. It reports whether it
// kept one.
func (e *Engine) disposeIfSame(path string, ens []*entry, spare bool) bool {
	if len(ens) == 0 {
		return false
	}
	f, err := e.fs.OpenFile(path, os.O_RDONLY, 0)
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			e.log.Warn("engine: open before remove", "path", path, "err", err)
		}
		return false
	}
	id, err := fileIdentity(f)
	var h *format.Header
	if err == nil {
		h, err = e.fileHeader(ens[0].mount, path, f, id)
	}
	f.Close()
	match := false
	switch {
	case err == nil:
		match = slices.ContainsFunc(ens, func(en *entry) bool { return en.sameFile(id, h) })
	case errors.Is(err, ErrCorrupt):
		// A corrupt file at the inode indexed (a corrupt file being
		// dropped; writing into it changed its ctime): its header cannot
		// say more, and a corrupt file is no one's data.
		match = slices.ContainsFunc(ens, func(en *entry) bool { return en.ident.Dev == id.Dev && en.ident.Ino == id.Ino })
	default:
		e.log.Warn("engine: check before remove", "path", path, "err", err)
		return false
	}
	if !match {
		e.log.Debug("engine: not removed: the file at the path is another one", "path", path)
		return false
	}
	// A spare keeps its inode and pages: movers keep what they cache of
	// it (a registration of its pages) for the store that reuses it.
	if spare {
		kept, at := e.keepSpare(e.mounts[ens[0].mount], path, id, ens[0].size)
		if kept {
			return true
		}
		path = at
	}
	if err := e.removeFile(path, id); err != nil {
		e.log.Warn("engine: remove", "path", path, "err", err)
	}
	return false
}

// openRegular opens path read-only and returns it with its identity: that
// of the open file, not of the name (the name may be replaced meanwhile),
// from one fstat that also refuses anything but a regular file.
func (e *Engine) openRegular(path string) (fsys.File, fsys.Identity, error) {
	f, err := e.fs.OpenFile(path, os.O_RDONLY, 0)
	if err != nil {
		return nil, fsys.Identity{}, err
	}
	id, err := fileIdentity(f)
	if err == nil && !id.Mode.IsRegular() {
		err = fmt.Errorf("%w: %s (%v)", errNotRegular, path, id.Mode.Type())
	}
	if err != nil {
		f.Close()
		return nil, fsys.Identity{}, err
	}
	return f, id, nil
}

// errNotRegular: a name where a kvhost file should be is not a regular
// file (a directory, a socket...).
var errNotRegular = errors.New("engine: not a regular file")

// readEntry reads the header of the file at path into an unindexed entry.
func (e *Engine) readEntry(mnt int, path string) (*entry, error) {
	if e.mounts[mnt].raw != nil {
		return e.rawEntry(mnt, path)
	}
	// The identity is that of the file whose header is read.
	f, id, err := e.openRegular(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	h, err := readHeader(f)
	if err != nil {
		return nil, err
	}
	if id.Size < h.FileLen() {
		return nil, fmt.Errorf("%w: %s: %d bytes, header says %d", ErrCorrupt, path, id.Size, h.FileLen())
	}
	return e.entryOf(mnt, path, h, id), nil
}

// entryOf returns an unindexed entry for the file at path with header h
// and identity id.
func (e *Engine) entryOf(mnt int, path string, h *format.Header, id fsys.Identity) *entry {
	en := &entry{fp: h.Fingerprint, mount: mnt, path: path, size: id.Size, ident: id, fid: h.ID, last: id.Mtime}
	en.verified.Store(e.now().UnixNano())
	for _, k := range h.Keys {
		en.keys = append(en.keys, string(k.Key))
	}
	return en
}

// readHeader reads and decodes the header at the start of f, with aligned
// buffers so that it works on files opened with O_DIRECT.
func readHeader(f fsys.File) (*format.Header, error) {
	buf := staging.AlignedBuffer(format.Align)
	n, err := f.ReadAt(buf, 0)
	if n < format.FixedLen {
		if err == nil || errors.Is(err, io.EOF) {
			err = format.ErrTruncated
		}
		return nil, fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	h, err := format.Decode(buf[:n])
	var te *format.TruncatedError
	if errors.As(err, &te) && te.Need <= format.MaxHeaderLen && n == len(buf) {
		buf = staging.AlignedBuffer((te.Need + format.Align - 1) / format.Align * format.Align)
		if n, _ = f.ReadAt(buf, 0); n < te.Need {
			return nil, fmt.Errorf("%w: %w", ErrCorrupt, format.ErrTruncated)
		}
		h, err = format.Decode(buf[:n])
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	return h, nil
}
