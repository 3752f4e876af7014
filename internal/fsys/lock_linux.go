package fsys

import (
	"errors"

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
