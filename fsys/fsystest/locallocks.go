package fsystest

import (
	"os"
	"sync"

	"github.com/kvhost/kvhost/fsys"
)

// LocalLocks is a file system whose flocks are its client's alone, as on
// an NFS mount with local_lock=flock (or all, or nolock), or any shared
// file system whose locks do not leave the node: a flock taken through
// one LocalLocks excludes the others taken through it (one kernel's lock
// table), but none taken through another LocalLocks, and no lock is taken
// on the file itself. Each simulated node gets its own. Everything else
// goes to FS.
type LocalLocks struct {
	fsys.FS
	mu   sync.Mutex
	cond *sync.Cond
	held map[uint64]*localLockFile // by inode: the open file holding its flock
}

// NewLocalLocks returns a LocalLocks over fs, its lock table empty.
func NewLocalLocks(fs fsys.FS) *LocalLocks {
	l := &LocalLocks{FS: fs, held: map[uint64]*localLockFile{}}
	l.cond = sync.NewCond(&l.mu)
	return l
}

// OpenFile opens name; the file's flocks are in l's table.
func (l *LocalLocks) OpenFile(name string, flag int, perm os.FileMode) (fsys.File, error) {
	f, err := l.FS.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return &localLockFile{File: f, l: l}, nil
}

// localLockFile is a file of LocalLocks.
type localLockFile struct {
	fsys.File
	l      *LocalLocks
	ino    uint64
	locked bool // guarded by l.mu
}

// inode is the file's inode number.
func (f *localLockFile) inode() (uint64, error) {
	fi, err := fsys.Fstat(f.File)
	if err != nil {
		return 0, err
	}
	id, err := fsys.IdentityOf(fi)
	return id.Ino, err
}

// tryLocked takes the flock if no other open file of l holds it. Called
// with l.mu held.
func (f *localLockFile) tryLocked(ino uint64) bool {
	if h := f.l.held[ino]; h != nil && h != f {
		return false
	}
	f.l.held[ino], f.ino, f.locked = f, ino, true
	return true
}

// TryLock implements fsys.Locker in l's table.
func (f *localLockFile) TryLock() (bool, error) {
	ino, err := f.inode()
	if err != nil {
		return false, err
	}
	f.l.mu.Lock()
	defer f.l.mu.Unlock()
	return f.tryLocked(ino), nil
}

// Lock implements fsys.Locker in l's table: it waits for the holder's
// Close.
func (f *localLockFile) Lock() error {
	ino, err := f.inode()
	if err != nil {
		return err
	}
	f.l.mu.Lock()
	defer f.l.mu.Unlock()
	for !f.tryLocked(ino) {
		f.l.cond.Wait()
	}
	return nil
}

// Stat implements fsys.Stater.
func (f *localLockFile) Stat() (os.FileInfo, error) { return fsys.Fstat(f.File) }

// Close releases the file's flock and closes it.
func (f *localLockFile) Close() error {
	f.l.mu.Lock()
	if f.locked && f.l.held[f.ino] == f {
		delete(f.l.held, f.ino)
		f.l.cond.Broadcast()
	}
	f.locked = false
	f.l.mu.Unlock()
	return f.File.Close()
}
