package engine

import (
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/format"
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
func sameFile(en *entry, id fsys.Identity, h *format.Header) bool {
	if en.FID != 0 || h.ID != 0 {
		return en.FID == h.ID && en.Ident.Inode() == id.Inode()
	}
	if !en.Ident.Same(id) || h.Fingerprint != en.FP || len(h.Keys) != len(en.Keys) {
		return false
	}
	for i, k := range h.Keys {
		if string(k.Key) != en.Keys[i] {
			return false
		}
	}
	return true
}

// errReplaced: the file at an entry's path is not the entry's file.
var errReplaced = errors.New("engine: file replaced")

// fileIdentity is the identity of an open file (fstat).
func fileIdentity(f fsys.File) (fsys.Identity, error) {
	fi, err := fsys.Fstat(f)
	if err != nil {
		return fsys.Identity{}, err
	}
	return fsys.IdentityOf(fi)
}

// openRegular opens path, a file under m's root, read-only, never through
// a link planted below the root (openNoLinks), and returns it with its
// identity: that of the open file, not of the name (the name may be
// replaced meanwhile), from one fstat that also refuses anything but a
// regular file. The open does not block (O_NONBLOCK, checkOpen): a named
// pipe at path is refused, not waited on.
func (hr *headerReader) openRegular(m *mount, path string) (fsys.File, fsys.Identity, error) {
	f, err := hr.openNoLinks(m, path, os.O_RDONLY|checkOpen, 0)
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

// openData opens path, the file of an indexed entry on m, with flag (read
// only, O_DIRECT where m uses it) for a load to read: never through a
// link planted below the root (openNoLinks), and without waiting on a
// named pipe someone put at the name. It opens with checkOpen, fstats
// the file, refuses anything but a regular file (errNotRegular), and
// clears O_NONBLOCK (fcntl F_SETFL) before handing the descriptor on,
// with the identity of that one fstat (idErr: the fstat's failure, which
// refuses nothing: the load goes on as before the check):
// the flag does nothing to a regular file's reads, but the paths it goes
// to (O_DIRECT reads, mmap, the GPU's registration) see the flags of a
// plain open. On an O_DIRECT mount a named pipe's open fails with
// EINVAL (no O_DIRECT on a pipe): the name is opened again without
// O_DIRECT, only to tell that from a file system's own EINVAL.
func (hr *headerReader) openData(m *mount, path string, flag int) (f fsys.File, id fsys.Identity, idErr, err error) {
	f, err = hr.openNoLinks(m, path, flag|checkOpen, 0)
	if errors.Is(err, syscall.EINVAL) && flag&unix.O_DIRECT != 0 {
		if g, _, gerr := hr.openRegular(m, path); errors.Is(gerr, errNotRegular) {
			return nil, fsys.Identity{}, nil, gerr
		} else if gerr == nil {
			g.Close()
		}
		return nil, fsys.Identity{}, nil, err
	}
	if err != nil {
		return nil, fsys.Identity{}, nil, err
	}
	id, idErr = fileIdentity(f)
	if idErr == nil && !id.Mode.IsRegular() {
		err = fmt.Errorf("%w: %s (%v)", errNotRegular, path, id.Mode.Type())
	}
	if err == nil {
		err = clearNonblock(f, flag)
	}
	if err != nil {
		f.Close()
		return nil, fsys.Identity{}, nil, err
	}
	return f, id, idErr, nil
}

// clearNonblock clears O_NONBLOCK (checkOpen) on f's descriptor, opened
// with flag: one F_SETFL with flag itself, which sets the status flags it
// can change (O_DIRECT kept where flag has it) and ignores the rest.
func clearNonblock(f fsys.File, flag int) error {
	if _, err := unix.FcntlInt(f.Fd(), unix.F_SETFL, flag&^unix.O_NONBLOCK); err != nil {
		return fmt.Errorf("fcntl F_SETFL: %w", err)
	}
	return nil
}

// checkOpen is an open flag of the opens that only look at a file (its
// identity, its header) before it is read, indexed or removed:
// O_NONBLOCK, so that a named pipe someone put at a file's name (a row's
// name in vLLM's shared directory, a policy's name) is opened at once,
// then refused as not a regular file, where a plain open waits for a
// writer, holding the request and every later one of that name forever.
// It changes nothing for a regular file's reads.
const checkOpen = syscall.O_NONBLOCK

// errNotRegular: a name where a kvhost file should be is not a regular
// file (a directory, a socket...).
var errNotRegular = errors.New("engine: not a regular file")

// readHeader reads and decodes the header at the start of f, with aligned
// buffers so that it works on files opened with O_DIRECT. It returns an
// error wrapping ErrCorrupt where the file's bytes fail the header's checks
// (a file too short included), and a read's own error as it is: an I/O
// error (EIO, ESTALE, a timeout of a network mount) says nothing of the
// bytes, and a corrupt file is removed.
//
// The first read, all of a header of up to 55 keys, goes into a buffer
// reused from the engine's buffers (buffers.header), whose pages stay mapped while loads keep using
// it (a sync.Pool drops what two garbage collections find unused). A
// fresh heap buffer's pages fault in the kernel's copy, and such a fault
// waits for the address space's lock, queued behind the unmaps of loads
// that copy from mappings: 0.14-0.35 ms per header read beside them on
// the H100 machine, against 0.01-0.03 ms with the reused buffer or beside
// loads that take no such lock (RATIONALE.md, "Why does readHeader reuse
// its buffer?"). The header returned holds copies of the keys, never the
// buffer.
func (hr *headerReader) readHeader(f fsys.File) (*format.Header, error) {
	return hr.decodeHeader(f, true)
}

// peekHeader is readHeader without the keys' copy: the header's keys are
// left in a buffer that goes back to them, so its caller reads only
// the header's other fields (rewrittenUnder, after every load of a memory
// mount's file, compares the file id).
func (hr *headerReader) peekHeader(f fsys.File) (*format.Header, error) {
	return hr.decodeHeader(f, false)
}

// decodeHeader is readHeader, copying the keys out of the reused buffer
// (before it goes back) only with own.
func (hr *headerReader) decodeHeader(f fsys.File, own bool) (*format.Header, error) {
	buf, put := hr.header()
	defer put()
	n, err := f.ReadAt(buf, 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	if n < format.FixedLen {
		return nil, fmt.Errorf("%w: %w", ErrCorrupt, format.ErrTruncated)
	}
	h, err := format.Decode(buf[:n])
	var te *format.TruncatedError
	if errors.As(err, &te) && te.Need <= format.MaxHeaderLen && n == len(buf) {
		buf = fsys.AlignedBuffer((te.Need + format.Align - 1) / format.Align * format.Align)
		n, err = f.ReadAt(buf, 0)
		if err != nil && !errors.Is(err, io.EOF) {
			return nil, err
		}
		if n < te.Need {
			return nil, fmt.Errorf("%w: %w", ErrCorrupt, format.ErrTruncated)
		}
		h, err = format.Decode(buf[:n])
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	if own {
		ownKeys(h)
	}
	return h, nil
}

// ownKeys gives h's keys, which Decode leaves in the bytes it read, bytes
// of their own: one allocation for them all.
func ownKeys(h *format.Header) {
	n := 0
	for _, k := range h.Keys {
		n += len(k.Key)
	}
	b := make([]byte, 0, n)
	for i := range h.Keys {
		lo := len(b)
		b = append(b, h.Keys[i].Key...)
		h.Keys[i].Key = b[lo:len(b):len(b)]
	}
}

// matchKey returns the position of key in en's file, or an error where
// the file holds other keys or another fingerprint.
func matchKey(en *entry, fp uint64, key []byte) (int, error) {
	if en.FP != fp {
		return -1, fmt.Errorf("%w: %w: file 0x%016x, want 0x%016x", ErrMismatch, format.ErrFingerprint, en.FP, fp)
	}
	for i, k := range en.Keys {
		if k == string(key) {
			return i, nil
		}
	}
	return -1, fmt.Errorf("%w: %w", ErrMismatch, format.ErrKey)
}
