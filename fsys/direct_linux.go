//go:build linux

package fsys

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"unsafe"

	"golang.org/x/sys/unix"
)

// DirectAlign is the alignment O_DIRECT I/O needs of buffers, file
// offsets and lengths (4 KiB: every file system kvhost runs on).
const DirectAlign = 4096

// AlignedBuffer returns n zeroed bytes whose address is
// DirectAlign-aligned, as O_DIRECT I/O needs.
func AlignedBuffer(n int) []byte {
	raw := make([]byte, n+DirectAlign)
	off := 0
	if r := int(uintptr(unsafe.Pointer(unsafe.SliceData(raw))) % DirectAlign); r != 0 {
		off = DirectAlign - r
	}
	return raw[off : off+n : off+n]
}

// ProbeDirect reports whether the file system holding dir accepts O_DIRECT
// files: it creates, writes and removes a hidden probe file. tmpfs before
// Linux 6.6 refuses O_DIRECT at open, which yields false with a nil error.
func ProbeDirect(fs FS, dir string) (bool, error) {
	var rnd [8]byte
	if _, err := unix.Getrandom(rnd[:], 0); err != nil {
		return false, fmt.Errorf("fsys: probe: %w", err)
	}
	name := filepath.Join(dir, fmt.Sprintf(".probe-direct-%x", rnd))
	direct, made, err := ProbeDirectFile(fs, name, 0)
	if made {
		fs.Remove(name)
	}
	return direct, err
}

// ProbeDirectFile is ProbeDirect with the probe file's name, and the
// removal left to the caller: it creates name (which must not exist)
// with O_DIRECT and flag's bits besides (ONoLinks), and writes 4
// KiB. It returns false and a nil error where the file system refuses
// O_DIRECT (EINVAL), and an error where the probe could not tell (a full
// or read-only file system, a symbolic link on name's way: callers fall
// back to buffered I/O). made reports whether name may hold a file the
// probe made, which the caller removes (the engine, relative to the
// mount's root opened without links): also where the open failed, as
// Linux checks O_DIRECT only once O_CREAT has made the file, so a file
// system without direct I/O fails the open with EINVAL and keeps an
// empty file; not where the name existed (EEXIST) or a link was met on
// its way (ELOOP).
func ProbeDirectFile(fs FS, name string, flag int) (direct, made bool, err error) {
	f, err := fs.OpenFile(name, os.O_RDWR|os.O_CREATE|os.O_EXCL|unix.O_DIRECT|flag, 0o600)
	if err != nil {
		// With O_EXCL, a name that exists after any failure but EEXIST
		// (or a link met, which makes nothing) is the one this open made.
		made = !errors.Is(err, os.ErrExist) && !errors.Is(err, unix.ELOOP)
		if errors.Is(err, unix.EINVAL) {
			return false, made, nil
		}
		return false, made, fmt.Errorf("fsys: probe O_DIRECT: %w", err)
	}
	buf := AlignedBuffer(DirectAlign)
	_, werr := f.WriteAt(buf, 0)
	cerr := f.Close()
	if werr != nil {
		if errors.Is(werr, unix.EINVAL) {
			return false, true, nil
		}
		return false, true, fmt.Errorf("fsys: probe O_DIRECT: %w", werr)
	}
	if cerr != nil {
		return false, true, fmt.Errorf("fsys: probe O_DIRECT: %w", cerr)
	}
	return true, true, nil
}
