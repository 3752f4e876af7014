package region

import (
	"fmt"
	"math"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/internal/fstype"
)

// OpenShared maps size bytes of a shared-memory file received from another
// process: a memfd, sealed or not, or a regular file on a memory file
// system (tmpfs, such as /dev/shm, or hugetlbfs). The Host takes ownership
// of fd and closes it on Close.
//
// Unlike OpenMemfd it does not require the file to be sealed against
// shrinking: the owner may truncate the file while it is mapped, and a
// page past the new end then raises SIGBUS when touched. Such a Host
// reports Shrinkable; copies that touch its bytes must run under Guard (or
// SafeCopy), and CheckSize tells whether the file is still whole.
func OpenShared(fd int, size int64) (*Host, error) {
	if size <= 0 {
		return nil, fmt.Errorf("region: size %d: want > 0", size)
	}
	if size > math.MaxInt {
		return nil, fmt.Errorf("%w: %d bytes do not fit the address space", ErrBounds, size)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("region: fstat fd %d: %w", fd, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, fmt.Errorf("%w: descriptor is not a regular file (mode %o)", ErrNotShared, st.Mode)
	}
	var fs unix.Statfs_t
	if err := unix.Fstatfs(fd, &fs); err != nil {
		return nil, fmt.Errorf("region: fstatfs fd %d: %w", fd, err)
	}
	// tmpfs is also shmem (/dev/shm, memfd).
	if fs.Type != fstype.Tmpfs && fs.Type != fstype.Hugetlbfs {
		return nil, fmt.Errorf("%w: the file is on a file system of type %#x, not tmpfs or hugetlbfs (use a memfd or a file under /dev/shm)", ErrNotShared, fs.Type)
	}
	if st.Size < size {
		return nil, fmt.Errorf("%w: file of %d bytes mapped as %d", ErrBounds, st.Size, size)
	}
	h, err := mapFd(fd, size, st.Ino)
	if err != nil {
		return nil, err
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	h.shrinkable = err != nil || seals&unix.F_SEAL_SHRINK == 0
	return h, nil
}

// CheckSize reports, with ErrTruncated, a file that is now shorter than
// the mapping: its owner truncated it, and touching the missing pages
// would fault. It is a check at one instant, not a guarantee for later;
// Guard is.
func (h *Host) CheckSize() error {
	h.mu.RLock()
	defer h.mu.RUnlock()
	if h.mem == nil {
		return ErrClosed
	}
	if !h.shrinkable {
		return nil
	}
	var st unix.Stat_t
	if err := unix.Fstat(h.fd, &st); err != nil {
		return fmt.Errorf("region: fstat: %w", err)
	}
	if st.Size < h.size {
		return fmt.Errorf("%w: region %d: the file has %d bytes, %d are mapped", ErrTruncated, h.id, st.Size, h.size)
	}
	return nil
}
