package cuda

import (
	"fmt"
	"sync"
	"unsafe"

	"github.com/kvhost/kvhost/region"
)

// Pinned is page-locked host memory from cudaHostAlloc (portable: usable
// with every device), page-aligned, so it also serves O_DIRECT I/O.
type Pinned struct {
	r   *Runtime
	ptr unsafe.Pointer
	n   int
}

// HostAlloc allocates n bytes of pinned host memory.
func (r *Runtime) HostAlloc(n int) (*Pinned, error) {
	if n <= 0 {
		return nil, fmt.Errorf("cuda: pinned allocation of %d bytes", n)
	}
	var p unsafe.Pointer
	if err := r.err("cudaHostAlloc", callPSU(r.fn.hostAlloc, unsafe.Pointer(&p), uintptr(n), hostAllocPortable)); err != nil {
		return nil, err
	}
	return &Pinned{r: r, ptr: p, n: n}, nil
}

// Ptr is the address of the first byte.
func (p *Pinned) Ptr() uintptr { return uintptr(p.ptr) }

// Bytes is the memory as a slice; valid until Free.
func (p *Pinned) Bytes() []byte {
	if p.ptr == nil {
		return nil
	}
	return unsafe.Slice((*byte)(p.ptr), p.n)
}

// Free releases the memory (cudaFreeHost).
func (p *Pinned) Free() error {
	if p.ptr == nil {
		return ErrClosed
	}
	err := p.r.err("cudaFreeHost", callU(p.r.fn.freeHost, uintptr(p.ptr)))
	p.ptr = nil
	return err
}

// HostRegister page-locks existing host memory b (cudaHostRegister,
// portable). b must stay alive and unmoved until HostUnregister: memory
// from mmap or C, never the Go heap.
func (r *Runtime) HostRegister(b []byte) error {
	if len(b) == 0 {
		return fmt.Errorf("cuda: register of 0 bytes")
	}
	return r.err("cudaHostRegister", callUSU(r.fn.hostRegister, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), hostRegisterPortable))
}

// HostUnregister undoes HostRegister.
func (r *Runtime) HostUnregister(b []byte) error {
	return r.err("cudaHostUnregister", callU(r.fn.hostUnregister, uintptr(unsafe.Pointer(&b[0]))))
}

// DeviceMemory is an allocation from cudaMalloc on one device. It is a
// region.Device.
type DeviceMemory struct {
	r       *Runtime
	id      uint64
	ordinal int
	ptr     uintptr
	n       int64
}

// Malloc allocates n bytes on the current device, which the caller names
// as ordinal (the thread's current device).
func (r *Runtime) Malloc(ordinal int, n int64) (*DeviceMemory, error) {
	if n <= 0 {
		return nil, fmt.Errorf("cuda: device allocation of %d bytes", n)
	}
	var p unsafe.Pointer
	if err := r.err("cudaMalloc", callPS(r.fn.malloc, unsafe.Pointer(&p), uintptr(n))); err != nil {
		return nil, err
	}
	return &DeviceMemory{r: r, id: r.nextID.Add(1), ordinal: ordinal, ptr: uintptr(p), n: n}, nil
}

// ID identifies the allocation within this Runtime.
func (m *DeviceMemory) ID() uint64 { return m.id }

// Len is the allocation's size.
func (m *DeviceMemory) Len() int64 { return m.n }

// Kind is region.KindDevice.
func (m *DeviceMemory) Kind() region.Kind { return region.KindDevice }

// Ordinal is the device the memory lives on.
func (m *DeviceMemory) Ordinal() int { return m.ordinal }

// Ptr is the device address.
func (m *DeviceMemory) Ptr() uintptr { return m.ptr }

// IPCHandle exports the allocation (cudaIpcGetMemHandle) for another
// process to import.
func (m *DeviceMemory) IPCHandle() ([IPCHandleSize]byte, error) {
	var h [IPCHandleSize]byte
	err := m.r.err("cudaIpcGetMemHandle", callPA(m.r.fn.ipcGetMemHandle, unsafe.Pointer(&h[0]), m.ptr))
	return h, err
}

// Close frees the memory (cudaFree).
func (m *DeviceMemory) Close() error {
	if m.ptr == 0 {
		return ErrClosed
	}
	err := m.r.err("cudaFree", callU(m.r.fn.free, m.ptr))
	m.ptr = 0
	return err
}

// IPCMemory is a range of another process's device allocation, imported
// with cudaIpcOpenMemHandle. It is a region.Device: Ptr is the address of
// the range's first byte in this process.
type IPCMemory struct {
	r       *Runtime
	id      uint64
	ordinal int
	base    uintptr // what cudaIpcOpenMemHandle returned
	off     int64
	n       int64
	// AllocSize is the exported allocation's size, as the driver
	// (cuMemGetAddressRange) reports it.
	AllocSize int64

	once sync.Once
	cerr error
}

// OpenIPC imports a client's IPC handle on the calling thread's current
// device (ordinal) and returns the range [off, off+n) of the exported
// allocation. declared is the allocation size the client reports; the
// driver's size of the allocation (cuMemGetAddressRange) checks the
// range, and a declared size larger than it is refused too. Where the
// driver API is not loaded, or cannot say, the import is refused with an
// error wrapping ErrUnchecked.
//
// The runtime requires cudaIpcMemLazyEnablePeerAccess, so where the
// devices have peer access (NVLink) an allocation of another device is
// imported over it, and the driver reports it as ordinal's in every
// pointer attribute (measured on two H200s): such an import cannot be told
// from a good one and is accepted. Its copies then cross the peer link.
func (r *Runtime) OpenIPC(ordinal int, handle [IPCHandleSize]byte, off, n, declared int64) (*IPCMemory, error) {
	if off < 0 || n <= 0 || declared <= 0 || off > declared || n > declared-off {
		return nil, fmt.Errorf("%w: [%d, +%d) of a %d-byte allocation", ErrBounds, off, n, declared)
	}
	if r.drv == nil {
		// Refused before anything is mapped: see below.
		return nil, fmt.Errorf("%w: the CUDA driver API (libcuda) is not loaded, so [%d, +%d) cannot be checked against the exported allocation", ErrUnchecked, off, n)
	}
	p, code := ipcOpen(r.fn.ipcOpenMemHandle, &handle, ipcLazyEnablePeerAccess)
	if err := r.err("cudaIpcOpenMemHandle", code); err != nil {
		return nil, fmt.Errorf("cuda: import IPC handle on device %d: %w", ordinal, err)
	}
	m := &IPCMemory{r: r, id: r.nextID.Add(1), ordinal: ordinal, base: p, off: off, n: n}
	// The range is checked against the allocation the driver mapped, or
	// the import is refused: a range past its end would have the daemon's
	// copies fault on the device, which breaks its context for every
	// client (fail closed).
	var base uintptr
	var size uintptr
	if code := callPPU(r.fn.cuMemGetAddressRange, unsafe.Pointer(&base), unsafe.Pointer(&size), p); code != 0 {
		m.Close()
		return nil, fmt.Errorf("%w: cuMemGetAddressRange of the imported allocation: %w", ErrUnchecked, r.err("cuMemGetAddressRange", code))
	}
	if base != p || int64(size) < declared {
		m.Close()
		return nil, fmt.Errorf("%w: client declared %d bytes at %#x, the driver says %d bytes at %#x", ErrBounds, declared, p, size, base)
	}
	m.AllocSize = int64(size)
	return m, nil
}

// ID identifies the import within this Runtime.
func (m *IPCMemory) ID() uint64 { return m.id }

// Len is the range's length.
func (m *IPCMemory) Len() int64 { return m.n }

// Kind is region.KindDevice.
func (m *IPCMemory) Kind() region.Kind { return region.KindDevice }

// Ordinal is the device the memory lives on.
func (m *IPCMemory) Ordinal() int { return m.ordinal }

// Ptr is the address of the range's first byte in this process.
func (m *IPCMemory) Ptr() uintptr { return m.base + uintptr(m.off) }

// Close unmaps the import (cudaIpcCloseMemHandle), once. Call it on a
// thread whose current device is Ordinal.
func (m *IPCMemory) Close() error {
	m.once.Do(func() { m.cerr = m.r.err("cudaIpcCloseMemHandle", callU(m.r.fn.ipcCloseMemHandle, m.base)) })
	return m.cerr
}

var (
	_ region.Device = (*DeviceMemory)(nil)
	_ region.Device = (*IPCMemory)(nil)
)
