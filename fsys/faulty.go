package fsys

import (
	"io"
	"io/fs"
	"os"
	"sync"
)

// Op names a file operation, for fault injection.
type Op uint8

// Operations Faulty can fail.
const (
	OpOpen Op = iota
	OpRead
	OpWrite
	OpSync
	OpClose
	OpRename
	OpRemove
	OpMkdir
	OpReadDir
	OpStat
	OpStatfs
	OpSyncDir
	OpAllocate
	OpLock // a flock, taken or tried
	numOps
)

var opNames = [numOps]string{"open", "read", "write", "sync", "close", "rename", "remove", "mkdir", "readdir", "stat", "statfs", "syncdir", "allocate", "lock"}

// String names the operation.
func (o Op) String() string {
	if o < numOps {
		return opNames[o]
	}
	return "op(?)"
}

// Fault is what an Injector decides for one operation.
type Fault struct {
	// Err, if set, fails the operation with this error (e.g. syscall.ENOSPC)
	// before it touches the file system.
	Err error
	// Short, for a write, writes only half the bytes and reports that count
	// with no error, as a real short write does.
	Short bool
}

// Injector decides the fault of each operation; the zero Fault lets it run.
// It must be safe for concurrent use.
type Injector interface {
	// Inject returns the fault for op on path (Rename's new path; for a
	// file's operations, the name it was opened by).
	Inject(op Op, path string) Fault
}

// InjectorFunc adapts a function to Injector.
type InjectorFunc func(op Op, path string) Fault

// Inject calls f.
func (f InjectorFunc) Inject(op Op, path string) Fault { return f(op, path) }

// Counter counts the operations in Ops and returns Fault for the At-th one
// (0-based) and, if Sticky, every later one. It is safe for concurrent use.
type Counter struct {
	Ops    []Op  // the operations counted; empty counts every operation
	At     int   // 0-based index, among counted operations, of the one that fails
	Fault  Fault // what the At-th operation (and, if Sticky, every later one) gets
	Sticky bool  // fail every counted operation after the At-th too

	mu    sync.Mutex
	n     int
	fired int
}

// Inject implements Injector.
func (c *Counter) Inject(op Op, _ string) Fault {
	match := len(c.Ops) == 0
	for _, o := range c.Ops {
		match = match || o == op
	}
	if !match {
		return Fault{}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	i := c.n
	c.n++
	if i == c.At || (c.Sticky && i > c.At) {
		c.fired++
		return c.Fault
	}
	return Fault{}
}

// Count returns how many matching operations were seen.
func (c *Counter) Count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n
}

// Fired returns how many faults were injected.
func (c *Counter) Fired() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.fired
}

// Faulty wraps an FS and injects the faults its Injector decides.
type Faulty struct {
	FS  FS       // the file system operations reach unless Inj fails them
	Inj Injector // decides each operation's fault
}

var _ FS = (*Faulty)(nil)

func (f *Faulty) check(op Op, path string) error {
	if fl := f.Inj.Inject(op, path); fl.Err != nil {
		return &os.PathError{Op: op.String(), Path: path, Err: fl.Err}
	}
	return nil
}

// OpenFile implements FS.
func (f *Faulty) OpenFile(name string, flag int, perm os.FileMode) (File, error) {
	if err := f.check(OpOpen, name); err != nil {
		return nil, err
	}
	file, err := f.FS.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return &faultyFile{File: file, fs: f, name: name}, nil
}

// Rename implements FS.
func (f *Faulty) Rename(oldpath, newpath string) error {
	if err := f.check(OpRename, newpath); err != nil {
		return err
	}
	return f.FS.Rename(oldpath, newpath)
}

// RenameNoReplace implements NoReplacer, failing as Rename does (OpRename).
func (f *Faulty) RenameNoReplace(oldpath, newpath string) error {
	if err := f.check(OpRename, newpath); err != nil {
		return err
	}
	return renameNoReplace(f.FS, oldpath, newpath)
}

// Remove implements FS.
func (f *Faulty) Remove(name string) error {
	if err := f.check(OpRemove, name); err != nil {
		return err
	}
	return f.FS.Remove(name)
}

var _ AtFS = (*Faulty)(nil)

// OpenAt implements AtFS, failing as OpenFile does (OpOpen).
func (f *Faulty) OpenAt(dir File, path string, flag int, perm os.FileMode) (File, error) {
	if err := f.check(OpOpen, path); err != nil {
		return nil, err
	}
	file, err := OpenAt(f.FS, dir, path, flag, perm)
	if err != nil {
		return nil, err
	}
	return &faultyFile{File: file, fs: f, name: path}, nil
}

// StatAt implements AtFS, failing as Stat does (OpStat).
func (f *Faulty) StatAt(dir File, path string) (os.FileInfo, error) {
	if err := f.check(OpStat, path); err != nil {
		return nil, err
	}
	return StatAt(f.FS, dir, path)
}

// RemoveAt implements AtFS, failing as Remove does (OpRemove).
func (f *Faulty) RemoveAt(dir File, path string) error {
	if err := f.check(OpRemove, path); err != nil {
		return err
	}
	return RemoveAt(f.FS, dir, path)
}

// RenameAt implements AtFS, failing as Rename does (OpRename).
func (f *Faulty) RenameAt(olddir File, oldpath string, newdir File, newpath string, noReplace bool) error {
	if err := f.check(OpRename, newpath); err != nil {
		return err
	}
	return RenameAt(f.FS, olddir, oldpath, newdir, newpath, noReplace)
}

// MkdirAt implements AtFS, failing as MkdirAll does (OpMkdir).
func (f *Faulty) MkdirAt(dir File, path string, perm os.FileMode) error {
	if err := f.check(OpMkdir, path); err != nil {
		return err
	}
	return MkdirAt(f.FS, dir, path, perm)
}

// MkdirAll implements FS.
func (f *Faulty) MkdirAll(path string, perm os.FileMode) error {
	if err := f.check(OpMkdir, path); err != nil {
		return err
	}
	return f.FS.MkdirAll(path, perm)
}

// ReadDir implements FS.
func (f *Faulty) ReadDir(name string) ([]fs.DirEntry, error) {
	if err := f.check(OpReadDir, name); err != nil {
		return nil, err
	}
	return f.FS.ReadDir(name)
}

// Stat implements FS.
func (f *Faulty) Stat(name string) (os.FileInfo, error) {
	if err := f.check(OpStat, name); err != nil {
		return nil, err
	}
	return f.FS.Stat(name)
}

// Statfs implements FS.
func (f *Faulty) Statfs(path string) (StatFS, error) {
	if err := f.check(OpStatfs, path); err != nil {
		return StatFS{}, err
	}
	return f.FS.Statfs(path)
}

// SyncDir implements FS.
func (f *Faulty) SyncDir(path string) error {
	if err := f.check(OpSyncDir, path); err != nil {
		return err
	}
	return f.FS.SyncDir(path)
}

type faultyFile struct {
	File
	fs   *Faulty
	name string
}

func (f *faultyFile) ReadAt(p []byte, off int64) (int, error) {
	if err := f.fs.check(OpRead, f.name); err != nil {
		return 0, err
	}
	return f.File.ReadAt(p, off)
}

func (f *faultyFile) ReadvAt(bufs [][]byte, off int64) (int, error) {
	if err := f.fs.check(OpRead, f.name); err != nil {
		return 0, err
	}
	return f.File.ReadvAt(bufs, off)
}

func (f *faultyFile) WriteAt(p []byte, off int64) (int, error) {
	fl := f.fs.Inj.Inject(OpWrite, f.name)
	if fl.Err != nil {
		return 0, &os.PathError{Op: "write", Path: f.name, Err: fl.Err}
	}
	if fl.Short && len(p) >= 8192 {
		// Half, in whole 4 KiB units, keeping O_DIRECT alignment; WriteAt
		// must say why it wrote less (io.WriterAt).
		n, err := f.File.WriteAt(p[:len(p)/2&^4095], off)
		if err == nil {
			err = &os.PathError{Op: "write", Path: f.name, Err: io.ErrShortWrite}
		}
		return n, err
	}
	return f.File.WriteAt(p, off)
}

func (f *faultyFile) WritevAt(bufs [][]byte, off int64) (int, error) {
	fl := f.fs.Inj.Inject(OpWrite, f.name)
	if fl.Err != nil {
		return 0, &os.PathError{Op: "write", Path: f.name, Err: fl.Err}
	}
	if fl.Short {
		// Write only the first half of the iovecs, or the first half of a
		// single one in whole 4 KiB units, keeping O_DIRECT alignment.
		switch {
		case len(bufs) > 1:
			return f.File.WritevAt(bufs[:len(bufs)/2], off)
		case len(bufs) == 1 && len(bufs[0]) >= 8192:
			return f.File.WritevAt([][]byte{bufs[0][:len(bufs[0])/2&^4095]}, off)
		}
	}
	return f.File.WritevAt(bufs, off)
}

func (f *faultyFile) Allocate(size int64) error {
	if err := f.fs.check(OpAllocate, f.name); err != nil {
		return err
	}
	return f.File.Allocate(size)
}

func (f *faultyFile) Sync() error {
	if err := f.fs.check(OpSync, f.name); err != nil {
		return err
	}
	return f.File.Sync()
}

// TryLock implements Locker (OpLock).
func (f *faultyFile) TryLock() (bool, error) {
	if err := f.fs.check(OpLock, f.name); err != nil {
		return false, err
	}
	return TryLock(f.File)
}

// Lock implements Locker (OpLock).
func (f *faultyFile) Lock() error {
	if err := f.fs.check(OpLock, f.name); err != nil {
		return err
	}
	return Lock(f.File)
}

// Stat implements Stater; it fails like FS.Stat (OpStat).
func (f *faultyFile) Stat() (os.FileInfo, error) {
	if err := f.fs.check(OpStat, f.name); err != nil {
		return nil, err
	}
	return Fstat(f.File)
}

func (f *faultyFile) Close() error {
	if err := f.fs.check(OpClose, f.name); err != nil {
		f.File.Close() // the descriptor is gone either way, as with close(2)
		return err
	}
	return f.File.Close()
}
