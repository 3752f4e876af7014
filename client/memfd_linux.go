package client

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/region"
)

// NewMemfd creates a sealable memfd of size bytes, seals it against
// shrinking, and maps it: a host region ready for RegisterMemfd.
func NewMemfd(name string, size int64) (*region.Host, error) {
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
	return h, nil
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
