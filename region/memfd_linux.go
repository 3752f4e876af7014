//go:build linux

package region

import (
	"fmt"
	"sync"

	"golang.org/x/sys/unix"
)

// Host is host memory backed by a memfd and mapped shared, so that another
// process given the fd (SCM_RIGHTS) maps the same pages.
type Host struct {
	mu   sync.RWMutex
	fd   int
	id   uint64
	size int64
	mem  []byte
	// shrinkable: the file is not sealed against shrinking (OpenShared),
	// so its owner may truncate it under the mapping.
	shrinkable bool
}

// NewHost creates a memfd of size bytes named name (for /proc) and maps it.
func NewHost(name string, size int64) (*Host, error) {
	if size <= 0 {
		return nil, fmt.Errorf("region: size %d: want > 0", size)
	}
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("region: memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("region: ftruncate memfd to %d: %w", size, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("region: fstat fd %d: %w", fd, err)
	}
	h, err := mapFd(fd, size, st.Ino)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	return h, nil
}

// OpenMemfd maps size bytes of a memfd received from another process. The
// Host takes ownership of fd and closes it on Close. The file must be at
// least size bytes long.
func OpenMemfd(fd int, size int64) (*Host, error) {
	if size <= 0 {
		return nil, fmt.Errorf("region: size %d: want > 0", size)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("region: fstat fd %d: %w", fd, err)
	}
	if st.Size < size {
		return nil, fmt.Errorf("%w: memfd of %d bytes mapped as %d", ErrBounds, st.Size, size)
	}
	return mapFd(fd, size, st.Ino)
}

// mapFd maps size bytes of fd, whose inode number (the region's ID) the
// caller's fstat found.
func mapFd(fd int, size int64, ino uint64) (*Host, error) {
	mem, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("region: mmap %d bytes: %w", size, err)
	}
	return &Host{fd: fd, id: ino, size: size, mem: mem}, nil
}

// Shrinkable reports whether the file behind the mapping may be truncated
// by another process while it is mapped (a region from OpenShared without
// F_SEAL_SHRINK). CPU accesses to such a region's bytes must run under
// Guard: a page past the file's new end raises SIGBUS.
func (h *Host) Shrinkable() bool { return h.shrinkable }

// ID is the memfd's inode number.
func (h *Host) ID() uint64 { return h.id }

// Len is the mapped size.
func (h *Host) Len() int64 { return h.size }

// Kind is KindHost.
func (h *Host) Kind() Kind { return KindHost }

// Bytes returns the mapping, or nil after Close.
func (h *Host) Bytes() []byte {
	h.mu.RLock()
	defer h.mu.RUnlock()
	return h.mem
}

// Fd returns the memfd, to pass to another process; -1 after Close.
func (h *Host) Fd() int {
	h.mu.RLock()
	defer h.mu.RUnlock()
	return h.fd
}

// Close unmaps the memory and closes the memfd. Using the bytes after Close
// faults; the caller must make sure no I/O is in flight on the region.
func (h *Host) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.mem == nil {
		return nil
	}
	err := unix.Munmap(h.mem)
	h.mem = nil
	if cerr := unix.Close(h.fd); err == nil {
		err = cerr
	}
	h.fd = -1
	if err != nil {
		return fmt.Errorf("region: close: %w", err)
	}
	return nil
}
