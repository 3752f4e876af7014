package client

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/region"
)

// Memfd is a mapped, sealable memfd: host memory a client fills with KV
// blocks and registers with the daemon (RegisterMemfd), which maps the same
// pages. Close unmaps it and closes the descriptor.
type Memfd struct {
	host *region.Host
}

// Bytes returns the mapping; it is valid until Close.
func (m *Memfd) Bytes() []byte { return m.host.Bytes() }

// Len returns the size in bytes.
func (m *Memfd) Len() int64 { return m.host.Len() }

// Fd returns the memfd's descriptor, owned by m.
func (m *Memfd) Fd() int { return m.host.Fd() }

// Close unmaps the memory and closes the descriptor. A region the daemon
// registered stays valid there: the daemon holds its own mapping.
func (m *Memfd) Close() error { return m.host.Close() }

// NewMemfd creates a sealable memfd of size bytes, seals it against
// shrinking, and maps it: host memory ready for RegisterMemfd.
func NewMemfd(name string, size int64) (*Memfd, error) {
	if size <= 0 {
		return nil, fmt.Errorf("%w: size %d", ErrInvalid, size)
	}
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("client: memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("client: ftruncate memfd: %w", err)
	}
	if err := SealShrink(fd); err != nil {
		unix.Close(fd)
		return nil, err
	}
	h, err := region.OpenMemfd(fd, size)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	return &Memfd{host: h}, nil
}

// SealShrink makes sure the memfd fd carries F_SEAL_SHRINK, which the
// daemon requires: a region that could shrink under the daemon's copies
// would fault it.
func SealShrink(fd int) error {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return fmt.Errorf("%w: fd %d is not a memfd (F_GET_SEALS: %w)", ErrInvalid, fd, err)
	}
	if seals&unix.F_SEAL_SHRINK != 0 {
		return nil
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK); err != nil {
		if errors.Is(err, unix.EPERM) {
			return fmt.Errorf("%w: memfd %d cannot be sealed against shrinking: create it with MFD_ALLOW_SEALING (client.NewMemfd does)", ErrInvalid, fd)
		}
		return fmt.Errorf("%w: F_ADD_SEALS on fd %d: %w", ErrInvalid, fd, err)
	}
	return nil
}

// Rights encodes descriptors as SCM_RIGHTS ancillary data, for callers
// that write protocol frames themselves.
func Rights(fds ...int) []byte { return unix.UnixRights(fds...) }
