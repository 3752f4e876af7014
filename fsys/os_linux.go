//go:build linux

package fsys

import (
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// OS is the operating system's file system.
type OS struct{}

var _ FS = OS{}

// OpenFile implements FS with open(2); the descriptor is close-on-exec.
// With ONoLinks it opens with openat2 RESOLVE_NO_SYMLINKS (openNoLinks).
func (OS) OpenFile(name string, flag int, perm os.FileMode) (File, error) {
	var fd int
	var err error
	if flag&ONoLinks != 0 {
		fd, err = openNoLinks(name, flag&^ONoLinks|unix.O_CLOEXEC, uint32(perm.Perm()))
	} else {
		fd, err = unix.Open(name, flag|unix.O_CLOEXEC, uint32(perm.Perm()))
	}
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: name, Err: err}
	}
	return &osFile{fd: fd, name: name}, nil
}

// openNoLinks opens name as open(2) does, but fails with ELOOP where any
// of its components is a symbolic link: openat2 RESOLVE_NO_SYMLINKS, one
// system call. Where the kernel has no openat2 (before Linux 5.6: ENOSYS;
// EPERM where a seccomp filter refuses what it does not know) it opens
// each directory of name relative to the one before, O_NOFOLLOW, and name
// last relative to its directory: no link is followed there either, and
// a link planted between two steps is met by the later one.
func openNoLinks(name string, flag int, perm uint32) (int, error) {
	how := unix.OpenHow{Flags: uint64(flag), Resolve: unix.RESOLVE_NO_SYMLINKS}
	if flag&unix.O_CREAT != 0 || flag&unix.O_TMPFILE == unix.O_TMPFILE {
		how.Mode = uint64(perm) // openat2 refuses a mode it would not use
	}
	fd, err := unix.Openat2(unix.AT_FDCWD, name, &how)
	if err != unix.ENOSYS && err != unix.EPERM {
		return fd, err
	}
	return openWalkNoLinks(name, flag, perm)
}

// openWalkNoLinks is openNoLinks without openat2: a walk of name's
// directories, each opened relative to the one before with O_NOFOLLOW.
func openWalkNoLinks(name string, flag int, perm uint32) (int, error) {
	var err error
	name = filepath.Clean(name)
	dir := unix.AT_FDCWD
	closeDir := func() {
		if dir != unix.AT_FDCWD {
			unix.Close(dir)
		}
	}
	defer closeDir()
	rest := name
	if filepath.IsAbs(name) {
		if dir, err = unix.Open("/", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err != nil {
			return -1, err
		}
		rest = strings.TrimLeft(name, "/")
		if rest == "" {
			rest = "."
		}
	}
	comps := strings.Split(rest, "/")
	for _, c := range comps[:len(comps)-1] {
		// O_PATH|O_NOFOLLOW opens a link itself, which fstat tells.
		next, err := unix.Openat(dir, c, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return -1, err
		}
		closeDir()
		dir = next
		var st unix.Stat_t
		if err := unix.Fstat(dir, &st); err != nil {
			return -1, err
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
		case unix.S_IFLNK:
			return -1, unix.ELOOP
		default:
			return -1, unix.ENOTDIR
		}
	}
	return unix.Openat(dir, comps[len(comps)-1], flag|unix.O_NOFOLLOW, perm)
}

// Rename implements FS.
func (OS) Rename(oldpath, newpath string) error { return os.Rename(oldpath, newpath) }

// RenameNoReplace implements NoReplacer (renameat2 RENAME_NOREPLACE;
// errors.ErrUnsupported where the file system refuses the flag).
func (OS) RenameNoReplace(oldpath, newpath string) error {
	err := unix.Renameat2(unix.AT_FDCWD, oldpath, unix.AT_FDCWD, newpath, unix.RENAME_NOREPLACE)
	if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EOPNOTSUPP) {
		err = errors.ErrUnsupported
	}
	if err != nil {
		return &os.LinkError{Op: "rename", Old: oldpath, New: newpath, Err: err}
	}
	return nil
}

var _ AtFS = OS{}

// The two Stat_t types StatAt takes for one are the same size.
var (
	_ [unsafe.Sizeof(unix.Stat_t{}) - unsafe.Sizeof(syscall.Stat_t{})]byte
	_ [unsafe.Sizeof(syscall.Stat_t{}) - unsafe.Sizeof(unix.Stat_t{})]byte
)

// OpenAt implements AtFS with openat(2), the descriptor close-on-exec;
// ONoLinks is O_NOFOLLOW there, path's last component being the one name
// looked up.
func (OS) OpenAt(dir File, path string, flag int, perm os.FileMode) (File, error) {
	if flag&ONoLinks != 0 {
		flag = flag&^ONoLinks | unix.O_NOFOLLOW
	}
	fd, err := unix.Openat(int(dir.Fd()), filepath.Base(path), flag|unix.O_CLOEXEC, uint32(perm.Perm()))
	if err != nil {
		return nil, &os.PathError{Op: "openat", Path: path, Err: err}
	}
	return &osFile{fd: fd, name: path}, nil
}

// StatAt implements AtFS with fstatat(2) AT_SYMLINK_NOFOLLOW.
func (OS) StatAt(dir File, path string) (os.FileInfo, error) {
	// syscall's Stat_t (the FileInfo's Sys, as os.Stat's) is the
	// kernel's struct stat, as x/sys/unix's is: the same bytes.
	var st syscall.Stat_t
	if err := unix.Fstatat(int(dir.Fd()), filepath.Base(path), (*unix.Stat_t)(unsafe.Pointer(&st)), unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return nil, &os.PathError{Op: "fstatat", Path: path, Err: err}
	}
	return &statInfo{name: filepath.Base(path), st: st}, nil
}

// RemoveAt implements AtFS with unlinkat(2).
func (OS) RemoveAt(dir File, path string) error {
	if err := unix.Unlinkat(int(dir.Fd()), filepath.Base(path), 0); err != nil {
		return &os.PathError{Op: "unlinkat", Path: path, Err: err}
	}
	return nil
}

// RenameAt implements AtFS with renameat2(2) (renameat where noReplace
// is not set); with noReplace, errors.ErrUnsupported where the file
// system refuses the flag, as RenameNoReplace.
func (OS) RenameAt(olddir File, oldpath string, newdir File, newpath string, noReplace bool) error {
	var err error
	if noReplace {
		err = unix.Renameat2(int(olddir.Fd()), filepath.Base(oldpath), int(newdir.Fd()), filepath.Base(newpath), unix.RENAME_NOREPLACE)
		if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EOPNOTSUPP) {
			err = errors.ErrUnsupported
		}
	} else {
		err = unix.Renameat(int(olddir.Fd()), filepath.Base(oldpath), int(newdir.Fd()), filepath.Base(newpath))
	}
	if err != nil {
		return &os.LinkError{Op: "renameat", Old: oldpath, New: newpath, Err: err}
	}
	return nil
}

// MkdirAt implements AtFS with mkdirat(2).
func (OS) MkdirAt(dir File, path string, perm os.FileMode) error {
	if err := unix.Mkdirat(int(dir.Fd()), filepath.Base(path), uint32(perm.Perm())); err != nil {
		return &os.PathError{Op: "mkdirat", Path: path, Err: err}
	}
	return nil
}

// Remove implements FS.
func (OS) Remove(name string) error { return os.Remove(name) }

// MkdirAll implements FS.
func (OS) MkdirAll(path string, perm os.FileMode) error { return os.MkdirAll(path, perm) }

// ReadDir implements FS.
func (OS) ReadDir(name string) ([]fs.DirEntry, error) { return os.ReadDir(name) }

// Stat implements FS.
func (OS) Stat(name string) (os.FileInfo, error) { return os.Stat(name) }

// Statfs implements FS.
func (OS) Statfs(path string) (StatFS, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return StatFS{}, &os.PathError{Op: "statfs", Path: path, Err: err}
	}
	bs := int64(st.Bsize)
	return StatFS{
		Type:      int64(st.Type),
		BlockSize: bs,
		Total:     int64(st.Blocks) * bs,
		Free:      int64(st.Bfree) * bs,
		Avail:     int64(st.Bavail) * bs,
		ReadOnly:  st.Flags&unix.ST_RDONLY != 0,
	}, nil
}

// SyncDir implements FS.
func (OS) SyncDir(path string) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return &os.PathError{Op: "open", Path: path, Err: err}
	}
	err = unix.Fsync(fd)
	unix.Close(fd)
	if err != nil {
		return &os.PathError{Op: "fsync", Path: path, Err: err}
	}
	return nil
}

type osFile struct {
	fd   int
	name string
}

func (f *osFile) wrap(op string, err error) error {
	if err == nil {
		return nil
	}
	return &os.PathError{Op: op, Path: f.name, Err: err}
}

func (f *osFile) ReadAt(p []byte, off int64) (int, error) {
	total := 0
	for total < len(p) {
		n, err := unix.Pread(f.fd, p[total:], off+int64(total))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return total, f.wrap("pread", err)
		}
		if n == 0 {
			return total, io.EOF
		}
		total += n
	}
	return total, nil
}

func (f *osFile) WriteAt(p []byte, off int64) (int, error) {
	total := 0
	for total < len(p) {
		n, err := unix.Pwrite(f.fd, p[total:], off+int64(total))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return total, f.wrap("pwrite", err)
		}
		if n == 0 {
			return total, f.wrap("pwrite", io.ErrShortWrite)
		}
		total += n
	}
	return total, nil
}

func (f *osFile) WritevAt(bufs [][]byte, off int64) (int, error) {
	for {
		n, err := unix.Pwritev(f.fd, bufs, off)
		if err == unix.EINTR {
			continue
		}
		return n, f.wrap("pwritev", err)
	}
}

func (f *osFile) ReadvAt(bufs [][]byte, off int64) (int, error) {
	for {
		n, err := unix.Preadv(f.fd, bufs, off)
		if err == unix.EINTR {
			continue
		}
		return n, f.wrap("preadv", err)
	}
}

func (f *osFile) Allocate(size int64) error {
	for {
		err := unix.Fallocate(f.fd, 0, 0, size)
		switch err {
		case unix.EINTR:
			continue
		case unix.EOPNOTSUPP, unix.ENOSYS:
			return nil
		}
		return f.wrap("fallocate", err)
	}
}

func (f *osFile) Sync() error { return f.wrap("fsync", unix.Fsync(f.fd)) }

func (f *osFile) Close() error {
	if f.fd < 0 {
		return f.wrap("close", os.ErrClosed)
	}
	err := unix.Close(f.fd)
	f.fd = -1
	return f.wrap("close", err)
}

func (f *osFile) Fd() uintptr { return uintptr(f.fd) }

// Stat implements Stater with fstat(2).
func (f *osFile) Stat() (os.FileInfo, error) { return fstatFd(f.fd, f.name) }

// MapRead implements Mapper with mmap(2) and madvise(MADV_SEQUENTIAL).
func (f *osFile) MapRead(n int64) (*Mapping, error) {
	var st unix.Stat_t
	if err := unix.Fstat(f.fd, &st); err != nil {
		return nil, f.wrap("fstat", err)
	}
	// Whole pages (a direct read of the aligned range around the data
	// reads into the file's padding), never past the end of the file.
	page := int64(unix.Getpagesize())
	n = min((n+page-1)/page*page, st.Size)
	if n <= 0 {
		return &Mapping{name: f.name}, nil
	}
	b, err := unix.Mmap(f.fd, 0, int(n), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, f.wrap("mmap", err)
	}
	// MADV_SEQUENTIAL (VM_SEQ_READ) is what keeps unmapping from marking
	// the pages accessed: without it the munmap activates them, which is
	// the cost the mapping avoids.
	if err := unix.Madvise(b, unix.MADV_SEQUENTIAL); err != nil {
		unix.Munmap(b)
		return nil, f.wrap("madvise", err)
	}
	return &Mapping{b: b, name: f.name}, nil
}
