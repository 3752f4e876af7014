package engine

import (
	"errors"
	"syscall"
	"time"
)

// mountFault reports whether err, the failure of a store's file on its
// mount, is the mount's own: ErrNoSpace (no room after evicting what could
// be), or a file system's error about itself from a file operation. A cancelled job, a
// fault in the client's memory, the policy's or a GPU's failure are not.
func mountFault(err error) bool {
	if errors.Is(err, ErrNoSpace) {
		return true
	}
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return false
	}
	// The errors a file system returns for itself: the mount, not the
	// request, is what fails (RATIONALE.md, "Why does a mount's refusal
	// of stores count only the mount's own errors?").
	switch errno {
	case syscall.EROFS, // mounted (or remounted, after an error) read-only
		syscall.EIO,       // the device or the server failed the I/O
		syscall.EACCES,    // the daemon's user may not create files there
		syscall.EPERM,     // likewise (an immutable directory, an LSM's refusal)
		syscall.ENOSPC,    // full, from outside (kvhost's own files were evicted first)
		syscall.EDQUOT,    // the daemon's user's quota
		syscall.ESTALE,    // an NFS handle the server no longer knows
		syscall.ENOTCONN,  // a FUSE or network file system whose server left
		syscall.ENODEV,    // the device went away
		syscall.ENXIO,     // likewise
		syscall.EREMOTEIO, // a remote I/O error
		syscall.EUCLEAN,   // a corrupt file system (ext4, XFS)
		syscall.ETIMEDOUT: // a network file system that does not answer
		return true
	}
	return false
}

// storeEnded records how the store of one file on m ended (storeFile, and
// the copy of a move to m: copyFile):
// a success ends the mount's StoreFailure, a failure of the mount's own
// (mountFault) starts or extends it, and any other failure leaves it as
// it is. A success costs one atomic load while the mount stores (and a
// swap where it ends a failure); now is called only for a failure.
func (m *mount) storeEnded(err error, now func() time.Time) {
	if err == nil {
		if f := m.failing.Load(); f != nil {
			m.failing.CompareAndSwap(f, nil) // a newer failure stays
		}
		return
	}
	if !mountFault(err) {
		return
	}
	m.refuse(err.Error(), 1, now())
}

// refuse starts m's StoreFailure, or extends the one it has, with a
// failure of text why, adding stores to its count.
func (m *mount) refuse(why string, stores uint64, now time.Time) {
	for {
		old := m.failing.Load()
		f := &StoreFailure{Since: now, Last: now, Stores: stores, Err: why}
		if old != nil {
			f.Since, f.Stores = old.Since, old.Stores+stores
		}
		if m.failing.CompareAndSwap(old, f) {
			return
		}
	}
}

// storeFailure is a copy of m's StoreFailure, or nil.
func (m *mount) storeFailure() *StoreFailure {
	f := m.failing.Load()
	if f == nil {
		return nil
	}
	c := *f
	return &c
}
