package fsystest

import (
	"os"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/fsys"
)

// NFSLocks is a file system whose flocks behave as an NFSv4 client's:
// Linux emulates flock there with a POSIX lock of the whole file, and an
// exclusive one on a file not open for writing fails with EBADF
// (nfs4_proc_lock: "Don't rely on the VFS having checked the file open
// mode, since it won't do this for flock() locks"; flock(2), "NFS
// details"). Everything else goes to FS.
type NFSLocks struct{ fsys.FS }

// OpenFile opens name; the file's flocks need write access.
func (n NFSLocks) OpenFile(name string, flag int, perm os.FileMode) (fsys.File, error) {
	f, err := n.FS.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return &nfsLockFile{File: f, writable: flag&(os.O_WRONLY|os.O_RDWR) != 0}, nil
}

// nfsLockFile is a file of NFSLocks.
type nfsLockFile struct {
	fsys.File
	writable bool
}

// TryLock implements fsys.Locker: EBADF without write access.
func (f *nfsLockFile) TryLock() (bool, error) {
	if !f.writable {
		return false, unix.EBADF
	}
	return fsys.TryLock(f.File)
}

// Lock implements fsys.Locker: EBADF without write access.
func (f *nfsLockFile) Lock() error {
	if !f.writable {
		return unix.EBADF
	}
	return fsys.Lock(f.File)
}

// Stat implements fsys.Stater.
func (f *nfsLockFile) Stat() (os.FileInfo, error) { return fsys.Fstat(f.File) }
