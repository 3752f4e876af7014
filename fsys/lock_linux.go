package fsys

import (
	"errors"
	"os"

	"golang.org/x/sys/unix"
)

// Locker is implemented by Files that take their flocks themselves (a
// watched file, whose flocks are in its table while they run; Faulty's,
// which inject faults): TryLock and Lock call these where f has them. A
// File that wraps another and is no Locker takes its flocks on the
// descriptor, past any Locker it wraps.
type Locker interface {
	// TryLock is TryLock of the file.
	TryLock() (bool, error)
	// Lock is Lock of the file.
	Lock() error
}

// TryLock takes an exclusive flock on the open file f without waiting
// (retrying a call an interrupt cut short); it reports false if another
// open file description holds a lock on the file.
func TryLock(f interface{ Fd() uintptr }) (bool, error) {
	if l, ok := f.(Locker); ok {
		return l.TryLock()
	}
	return tryLockFd(f)
}

func tryLockFd(f interface{ Fd() uintptr }) (bool, error) {
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		switch {
		case err == nil:
			return true, nil
		case errors.Is(err, unix.EINTR):
			continue
		case errors.Is(err, unix.EWOULDBLOCK):
			return false, nil
		}
		return false, err
	}
}

// Lock takes an exclusive flock on the open file f, waiting while another
// open file description holds one (retrying a call an interrupt cut
// short). For a file the caller just created, whose other holders can
// only be checkers that hold it a moment.
func Lock(f interface{ Fd() uintptr }) error {
	if l, ok := f.(Locker); ok {
		return l.Lock()
	}
	return lockFd(f)
}

func lockFd(f interface{ Fd() uintptr }) error {
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX)
		if !errors.Is(err, unix.EINTR) {
			return err
		}
	}
}

// OpenToLock opens name on fs to take its flock: read-write, with flag's
// other bits (O_NOFOLLOW, O_CREATE, ...; not its access mode). An NFS
// client emulates flock with a POSIX lock of the whole file, and an
// exclusive one on a file not open for writing fails there with EBADF
// (flock(2), "NFS details"), so a lock probe of a file opened read-only
// would fail on every NFS mount. Where write access is refused (EACCES:
// another user's file; EROFS) it opens read-only, which takes the flock
// on local and other shared file systems.
//
// It opens with O_NONBLOCK: the file is opened only to be flocked (the
// flag changes nothing for a flock, nor for a regular file's reads), and
// a named pipe someone put at name, which a read-only open would wait on
// for a writer, is opened at once (a read-write open never waits).
func OpenToLock(fs FS, name string, flag int, perm os.FileMode) (File, error) {
	flag &^= os.O_RDONLY | os.O_WRONLY | os.O_RDWR
	flag |= unix.O_NONBLOCK
	f, err := fs.OpenFile(name, flag|os.O_RDWR, perm)
	if errors.Is(err, unix.EACCES) || errors.Is(err, unix.EROFS) {
		f, err = fs.OpenFile(name, flag|os.O_RDONLY, perm)
	}
	return f, err
}
