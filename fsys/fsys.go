// Package fsys is the file-system seam of the storage engine: every file
// operation the engine and the staging pipeline perform goes through FS, so
// that tests can inject ENOSPC, EIO and short writes (Faulty) and step a
// failure through a workload.
package fsys

import (
	"errors"
	"io/fs"
	"os"
)

// FS is the file system. Paths are OS paths.
type FS interface {
	// OpenFile opens name with os.OpenFile-style flags (which may include
	// syscall.O_DIRECT).
	OpenFile(name string, flag int, perm os.FileMode) (File, error)
	// Rename renames oldpath to newpath, replacing newpath (os.Rename).
	Rename(oldpath, newpath string) error
	// Remove removes the file or empty directory name (os.Remove).
	Remove(name string) error
	// MkdirAll creates path and any missing parents (os.MkdirAll).
	MkdirAll(path string, perm os.FileMode) error
	// ReadDir lists the directory name, sorted by file name (os.ReadDir).
	ReadDir(name string) ([]fs.DirEntry, error)
	// Stat returns name's FileInfo, following symbolic links (os.Stat);
	// its Sys() is a *syscall.Stat_t.
	Stat(name string) (os.FileInfo, error)
	// Statfs describes the file system that holds path (statfs(2)).
	Statfs(path string) (StatFS, error)
	// SyncDir fsyncs a directory, making renames in it durable.
	SyncDir(path string) error
}

// ONoLinks is an OpenFile flag of fsys's own (no open(2) flag has its
// bit): the open fails with an error matching syscall.ELOOP where any
// component of name, the last included, is a symbolic link (openat2's
// RESOLVE_NO_SYMLINKS; where the kernel has no openat2, a walk of name's
// directories opened one by one, each relative to the last, without
// following links). An FS that wraps another passes it on with the other
// flags; OS takes it off before it opens.
const ONoLinks = 1 << 30

// NoReplacer is an FS that renames without replacing (renameat2's
// RENAME_NOREPLACE): RenameNoReplace renames oldpath to newpath unless
// newpath exists, failing then with an error that matches fs.ErrExist, and
// with one that matches errors.ErrUnsupported where the file system (or an
// FS it wraps) cannot rename so. A type that embeds OS and changes Rename
// must change RenameNoReplace alike, or the engine's renames of new files
// bypass its Rename.
type NoReplacer interface {
	RenameNoReplace(oldpath, newpath string) error
}

// renameNoReplace is fsys's RenameNoReplace through inner: its own where
// it has one, else errors.ErrUnsupported.
func renameNoReplace(inner FS, oldpath, newpath string) error {
	nr, ok := inner.(NoReplacer)
	if !ok {
		return &os.LinkError{Op: "rename", Old: oldpath, New: newpath, Err: errors.ErrUnsupported}
	}
	return nr.RenameNoReplace(oldpath, newpath)
}

// AtFS is an FS that acts on a name in a directory it opened, as the
// *at system calls do (openat, fstatat, unlinkat, renameat2, mkdirat): only the
// last component of path is looked up, in the directory open as dir,
// whatever path's directories name meanwhile (one replaced by a symbolic
// link, one renamed away). dir is a File of this FS's OpenFile of path's
// directory with O_DIRECTORY (O_PATH suffices; with ONoLinks where it
// must be reached through no link). path is the name's whole path: a
// wrapper sees what it sees in Stat, Remove, Rename or MkdirAll, and OS
// uses its last component only. Callers go through OpenAt, StatAt,
// RemoveAt, RenameAt and MkdirAt, which fall back on those path methods
// where an FS is no AtFS (an FS that embeds the FS interface, as most
// wrappers do, is none unless it says so). A type that embeds OS and
// changes OpenFile, Stat, Remove, Rename or MkdirAll must change these
// alike, or the engine's calls bypass its own, as with NoReplacer.
type AtFS interface {
	// OpenAt opens path's last component in dir (openat) with OpenFile's
	// flags and perm; with ONoLinks it fails, matching syscall.ELOOP,
	// where that name is a symbolic link (the one name looked up).
	OpenAt(dir File, path string, flag int, perm os.FileMode) (File, error)
	// StatAt returns the FileInfo of path's last component in dir,
	// not following it where it is a symbolic link (fstatat
	// AT_SYMLINK_NOFOLLOW); its Sys() is a *syscall.Stat_t.
	StatAt(dir File, path string) (os.FileInfo, error)
	// RemoveAt removes the file (not a directory) named by path's last
	// component in dir (unlinkat).
	RemoveAt(dir File, path string) error
	// RenameAt renames oldpath's last component in olddir to newpath's
	// in newdir (renameat2), replacing it unless noReplace: then it
	// fails as NoReplacer's RenameNoReplace does.
	RenameAt(olddir File, oldpath string, newdir File, newpath string, noReplace bool) error
	// MkdirAt makes the directory named by path's last component in dir
	// (mkdirat), failing with an error that matches fs.ErrExist where
	// the name exists.
	MkdirAt(dir File, path string, perm os.FileMode) error
}

// OpenAt is fs's OpenAt where fs is an AtFS, else its OpenFile of path
// (which follows path's directories, links included, as they are now).
func OpenAt(fs FS, dir File, path string, flag int, perm os.FileMode) (File, error) {
	if a, ok := fs.(AtFS); ok {
		return a.OpenAt(dir, path, flag, perm)
	}
	return fs.OpenFile(path, flag, perm)
}

// StatAt is fs's StatAt where fs is an AtFS, else its Stat of path (which
// follows links).
func StatAt(fs FS, dir File, path string) (os.FileInfo, error) {
	if a, ok := fs.(AtFS); ok {
		return a.StatAt(dir, path)
	}
	return fs.Stat(path)
}

// RemoveAt is fs's RemoveAt where fs is an AtFS, else its Remove of path.
func RemoveAt(fs FS, dir File, path string) error {
	if a, ok := fs.(AtFS); ok {
		return a.RemoveAt(dir, path)
	}
	return fs.Remove(path)
}

// RenameAt is fs's RenameAt where fs is an AtFS, else its Rename of the
// paths, or with noReplace its RenameNoReplace (errors.ErrUnsupported
// where it has none).
func RenameAt(fs FS, olddir File, oldpath string, newdir File, newpath string, noReplace bool) error {
	if a, ok := fs.(AtFS); ok {
		return a.RenameAt(olddir, oldpath, newdir, newpath, noReplace)
	}
	if noReplace {
		return renameNoReplace(fs, oldpath, newpath)
	}
	return fs.Rename(oldpath, newpath)
}

// MkdirAt is fs's MkdirAt where fs is an AtFS, else a Stat of path (an
// error matching fs.ErrExist where it exists) and its MkdirAll.
func MkdirAt(fsys FS, dir File, path string, perm os.FileMode) error {
	if a, ok := fsys.(AtFS); ok {
		return a.MkdirAt(dir, path, perm)
	}
	if _, err := fsys.Stat(path); err == nil {
		return &os.PathError{Op: "mkdir", Path: path, Err: fs.ErrExist}
	}
	return fsys.MkdirAll(path, perm)
}

// File is an open file. Positional methods are safe for concurrent use.
type File interface {
	// ReadAt reads len(p) bytes at off (pread, repeated until done); as
	// io.ReaderAt, it returns an error (io.EOF at end of file) when it
	// reads fewer.
	ReadAt(p []byte, off int64) (int, error)
	// WriteAt writes p at off (pwrite, repeated until done); as
	// io.WriterAt, it returns an error when it writes fewer bytes.
	WriteAt(p []byte, off int64) (int, error)
	// WritevAt writes the buffers in order at off (pwritev). Like pwritev
	// it may write less than asked without an error; callers loop.
	WritevAt(bufs [][]byte, off int64) (int, error)
	// ReadvAt reads into the buffers in order from off (preadv); it may
	// read less than asked, returning 0 at end of file.
	ReadvAt(bufs [][]byte, off int64) (int, error)
	// Allocate reserves disk space for the first size bytes (fallocate),
	// so that a file written with O_DIRECT gets contiguous extents and a
	// full file system fails before any data is written. File systems
	// without fallocate return nil.
	Allocate(size int64) error
	// Sync flushes the file's data and metadata to the device (fsync).
	Sync() error
	// Close closes the descriptor (close(2)); it is gone even when Close
	// fails.
	Close() error
	// Fd is the OS file descriptor, for backends that register files
	// (cuFile). Data must not be moved through it behind the FS's back.
	Fd() uintptr
}

// StatFS is what statfs says of a file system.
type StatFS struct {
	Type      int64 // f_type magic (e.g. TMPFS_MAGIC)
	BlockSize int64 // f_bsize: the unit statfs counts blocks in, in bytes
	Total     int64 // bytes
	Free      int64 // bytes free
	Avail     int64 // bytes available to unprivileged users
	// ReadOnly: the file system is mounted read-only (ST_RDONLY): no
	// file can be created, written, renamed or removed on it.
	ReadOnly bool
}
