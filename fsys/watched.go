package fsys

import (
	"errors"
	"io/fs"
	"os"
)

// Watched wraps an FS so that every call it and its files make — opens,
// renames, reads, writes, fsyncs, fstats, flocks, closes — is in w while it
// runs: a call on a hung mount shows as w.Oldest, whatever else still
// moves. Its files are Staters and Lockers (TryLock and Lock go through
// them), and Mappers where the wrapped files are (reads through a mapping
// are not watched). Fd is not watched; what else is done through the
// descriptor is the caller's to watch.
func Watched(fsys FS, w *InFlight) FS {
	return &watchedFS{fs: fsys, w: w}
}

type watchedFS struct {
	fs FS
	w  *InFlight
}

var (
	_ FS     = (*watchedFS)(nil)
	_ AtFS   = (*watchedFS)(nil)
	_ Stater = (*watchedFile)(nil)
	_ Mapper = (*watchedFile)(nil)
	_ Locker = (*watchedFile)(nil)
)

// errNotMapper is MapRead's error where the wrapped file cannot be
// mapped: MapForRead then reads with pread, as for a file that is no
// Mapper.
var errNotMapper = errors.New("fsys: the file cannot be mapped")

// OpenFile implements FS.
func (f *watchedFS) OpenFile(name string, flag int, perm os.FileMode) (File, error) {
	defer f.w.End(f.w.Begin())
	file, err := f.fs.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return &watchedFile{File: file, w: f.w}, nil
}

// Rename implements FS.
func (f *watchedFS) Rename(oldpath, newpath string) error {
	defer f.w.End(f.w.Begin())
	return f.fs.Rename(oldpath, newpath)
}

// RenameNoReplace implements NoReplacer.
func (f *watchedFS) RenameNoReplace(oldpath, newpath string) error {
	defer f.w.End(f.w.Begin())
	return renameNoReplace(f.fs, oldpath, newpath)
}

// Remove implements FS.
func (f *watchedFS) Remove(name string) error {
	defer f.w.End(f.w.Begin())
	return f.fs.Remove(name)
}

// OpenAt implements AtFS.
func (f *watchedFS) OpenAt(dir File, path string, flag int, perm os.FileMode) (File, error) {
	defer f.w.End(f.w.Begin())
	file, err := OpenAt(f.fs, dir, path, flag, perm)
	if err != nil {
		return nil, err
	}
	return &watchedFile{File: file, w: f.w}, nil
}

// StatAt implements AtFS.
func (f *watchedFS) StatAt(dir File, path string) (os.FileInfo, error) {
	defer f.w.End(f.w.Begin())
	return StatAt(f.fs, dir, path)
}

// RemoveAt implements AtFS.
func (f *watchedFS) RemoveAt(dir File, path string) error {
	defer f.w.End(f.w.Begin())
	return RemoveAt(f.fs, dir, path)
}

// RenameAt implements AtFS.
func (f *watchedFS) RenameAt(olddir File, oldpath string, newdir File, newpath string, noReplace bool) error {
	defer f.w.End(f.w.Begin())
	return RenameAt(f.fs, olddir, oldpath, newdir, newpath, noReplace)
}

// MkdirAt implements AtFS.
func (f *watchedFS) MkdirAt(dir File, path string, perm os.FileMode) error {
	defer f.w.End(f.w.Begin())
	return MkdirAt(f.fs, dir, path, perm)
}

// MkdirAll implements FS.
func (f *watchedFS) MkdirAll(path string, perm os.FileMode) error {
	defer f.w.End(f.w.Begin())
	return f.fs.MkdirAll(path, perm)
}

// ReadDir implements FS.
func (f *watchedFS) ReadDir(name string) ([]fs.DirEntry, error) {
	defer f.w.End(f.w.Begin())
	return f.fs.ReadDir(name)
}

// Stat implements FS.
func (f *watchedFS) Stat(name string) (os.FileInfo, error) {
	defer f.w.End(f.w.Begin())
	return f.fs.Stat(name)
}

// Statfs implements FS.
func (f *watchedFS) Statfs(path string) (StatFS, error) {
	defer f.w.End(f.w.Begin())
	return f.fs.Statfs(path)
}

// SyncDir implements FS.
func (f *watchedFS) SyncDir(path string) error {
	defer f.w.End(f.w.Begin())
	return f.fs.SyncDir(path)
}

type watchedFile struct {
	File
	w *InFlight
}

func (f *watchedFile) ReadAt(p []byte, off int64) (int, error) {
	defer f.w.End(f.w.Begin())
	return f.File.ReadAt(p, off)
}

func (f *watchedFile) WriteAt(p []byte, off int64) (int, error) {
	defer f.w.End(f.w.Begin())
	return f.File.WriteAt(p, off)
}

func (f *watchedFile) WritevAt(bufs [][]byte, off int64) (int, error) {
	defer f.w.End(f.w.Begin())
	return f.File.WritevAt(bufs, off)
}

func (f *watchedFile) ReadvAt(bufs [][]byte, off int64) (int, error) {
	defer f.w.End(f.w.Begin())
	return f.File.ReadvAt(bufs, off)
}

func (f *watchedFile) Allocate(size int64) error {
	defer f.w.End(f.w.Begin())
	return f.File.Allocate(size)
}

func (f *watchedFile) Sync() error {
	defer f.w.End(f.w.Begin())
	return f.File.Sync()
}

func (f *watchedFile) Close() error {
	defer f.w.End(f.w.Begin())
	return f.File.Close()
}

// TryLock implements Locker: the wrapped file's flock, watched.
func (f *watchedFile) TryLock() (bool, error) {
	defer f.w.End(f.w.Begin())
	return TryLock(f.File)
}

// Lock implements Locker: the wrapped file's flock, watched (a wait for
// another holder counts as in flight).
func (f *watchedFile) Lock() error {
	defer f.w.End(f.w.Begin())
	return Lock(f.File)
}

// Stat implements Stater: the wrapped file's fstat.
func (f *watchedFile) Stat() (os.FileInfo, error) {
	defer f.w.End(f.w.Begin())
	return Fstat(f.File)
}

// MapRead implements Mapper where the wrapped file does.
func (f *watchedFile) MapRead(n int64) (*Mapping, error) {
	m, ok := f.File.(Mapper)
	if !ok {
		return nil, errNotMapper
	}
	defer f.w.End(f.w.Begin())
	return m.MapRead(n)
}
