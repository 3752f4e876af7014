package fsys

import (
	"errors"

	"golang.org/x/sys/unix"
)

// TryLock takes an exclusive flock on the open file f without waiting
// (retrying a call an interrupt cut short); it reports false if another
// open file description holds a lock on the file.
func TryLock(f interface{ Fd() uintptr }) (bool, error) {
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
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX)
		if !errors.Is(err, unix.EINTR) {
			return err
		}
	}
}
