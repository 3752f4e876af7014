// Package region describes memory regions that KV-cache blocks live in and
// segments of them.
//
// A Region is host memory (Host: a memfd or a shared-memory file that
// another process maps too) or device memory that the CPU cannot address
// (Device). Host-addressable regions implement Addressable.
//
// A shared-memory file that is not sealed against shrinking (OpenShared)
// can be truncated by its owner under the mapping; every CPU copy that
// touches such memory runs under Guard, which turns the resulting SIGBUS
// into an error.
package region

import (
	"errors"
	"fmt"
)

// Errors of the package.
var (
	// ErrBounds: a segment does not lie inside its region.
	ErrBounds = errors.New("region: segment out of bounds")
	// ErrNotAddressable: the region's bytes cannot be read by the CPU.
	ErrNotAddressable = errors.New("region: not host-addressable")
	// ErrClosed: the region was closed.
	ErrClosed = errors.New("region: closed")
	// ErrFault: a copy touched memory that faulted, such as a page of a
	// shared file truncated under its mapping (see Guard).
	ErrFault = errors.New("region: memory fault")
	// ErrTruncated: a shared file is now shorter than its mapping.
	ErrTruncated = errors.New("region: shared file truncated")
	// ErrNotShared: a descriptor is not a shared-memory file.
	ErrNotShared = errors.New("region: not a shared-memory file")
)

// Kind says where a region's memory lives.
type Kind uint8

// Kinds of region.
const (
	KindHost   Kind = 1 // host memory the CPU can address
	KindDevice Kind = 2 // GPU memory
)

// String names the kind.
func (k Kind) String() string {
	switch k {
	case KindHost:
		return "host"
	case KindDevice:
		return "device"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// Region is a contiguous range of memory.
type Region interface {
	// ID identifies the region; for a memfd region it is the memfd's inode
	// number, the same in every process that maps it.
	ID() uint64
	// Len is the region's size in bytes.
	Len() int64
	// Kind says where the memory lives.
	Kind() Kind
}

// Addressable is a Region whose bytes the CPU can read and write.
type Addressable interface {
	Region
	// Bytes returns the whole region. It is valid until the region is closed.
	Bytes() []byte
}

// Segment is Length bytes at Offset in Region.
type Segment struct {
	Region Region // the memory the segment lies in
	Offset int64  // where the segment starts in Region, in bytes
	Length int64  // the segment's size in bytes
}

// Check reports whether the segment lies inside its region.
func (s Segment) Check() error {
	if s.Region == nil {
		return fmt.Errorf("%w: nil region", ErrBounds)
	}
	if s.Offset < 0 || s.Length < 0 || s.Offset > s.Region.Len() || s.Length > s.Region.Len()-s.Offset {
		return fmt.Errorf("%w: [%d, +%d) in region %d of %d bytes", ErrBounds, s.Offset, s.Length, s.Region.ID(), s.Region.Len())
	}
	return nil
}

// Bytes returns the segment's bytes, if its region is addressable and the
// segment lies inside it.
func (s Segment) Bytes() ([]byte, error) {
	if err := s.Check(); err != nil {
		return nil, err
	}
	a, ok := s.Region.(Addressable)
	if !ok {
		return nil, fmt.Errorf("%w: %s region %d", ErrNotAddressable, s.Region.Kind(), s.Region.ID())
	}
	b := a.Bytes()
	if b == nil {
		return nil, ErrClosed
	}
	return b[s.Offset : s.Offset+s.Length : s.Offset+s.Length], nil
}

// Device is a Region in GPU memory. Its bytes are not addressable by the CPU;
// GPU data paths move them with the CUDA runtime or cuFile.
type Device interface {
	Region
	// Ordinal is the CUDA device the memory lives on, as the daemon numbers
	// its devices.
	Ordinal() int
	// Ptr is the device address of the region's first byte in the daemon's
	// CUDA context (for CUDA IPC memory: the address the import returned).
	Ptr() uintptr
}
