// Package fsys is the file-system seam of the storage engine: every file
// operation the engine and the staging pipeline perform goes through FS, so
// that tests can inject ENOSPC, EIO and short writes (Faulty) and step a
// failure through a workload.
package fsys

import (
	"io/fs"
	"os"
)

// FS is the file system. Paths are OS paths.
type FS interface {
	// OpenFile opens name with os.OpenFile-style flags (which may include
	// syscall.O_DIRECT).
	OpenFile(name string, flag int, perm os.FileMode) (File, error)
	Rename(oldpath, newpath string) error
	Remove(name string) error
	MkdirAll(path string, perm os.FileMode) error
	ReadDir(name string) ([]fs.DirEntry, error)
	Stat(name string) (os.FileInfo, error)
	Statfs(path string) (StatFS, error)
	// SyncDir fsyncs a directory, making renames in it durable.
	SyncDir(path string) error
}

// File is an open file. Positional methods are safe for concurrent use.
type File interface {
	ReadAt(p []byte, off int64) (int, error)
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
	Sync() error
	Close() error
	// Fd is the OS file descriptor, for backends that register files
	// (cuFile). Data must not be moved through it behind the FS's back.
	Fd() uintptr
}

// StatFS is what statfs says of a file system.
type StatFS struct {
	Type      int64 // f_type magic (e.g. TMPFS_MAGIC)
	BlockSize int64
	Total     int64 // bytes
	Free      int64 // bytes free
	Avail     int64 // bytes available to unprivileged users
}
