// Package cuda binds the parts of the CUDA runtime (libcudart) and driver
// API (libcuda) that kvhost's GPU data paths need: devices, streams,
// events, pinned host memory, device memory, asynchronous copies (one per
// segment, or batched with cudaMemcpyBatchAsync), and CUDA IPC import of
// client memory as a region.Device.
//
// The libraries are opened at run time with package internal/dl, so kvhost
// builds without the CUDA toolkit and runs on machines without a GPU; a
// build without cgo compiles and reports the runtime unavailable. Every
// symbol is resolved by Open: a missing one is an error then, not a crash
// later (cudaMemcpyBatchAsync, CUDA 12.8+, and the driver API are
// optional and reported by Runtime.HasBatch and Runtime.HasDriver).
//
// CUDA's current device is per OS thread: call the Runtime only from a
// goroutine locked to its thread that has called SetDevice, such as a
// Worker's, or one that called LockDevice.
package cuda

import (
	"errors"
	"fmt"
	"sync/atomic"
	"unsafe"

	"github.com/kvhost/kvhost/internal/dl"
)

// Errors of the package.
var (
	// ErrUnavailable: the CUDA runtime could not be loaded (not installed,
	// no driver, or a build without cgo). It wraps dl's error text.
	ErrUnavailable = errors.New("cuda: runtime unavailable")
	// ErrNoBatch: the runtime lacks cudaMemcpyBatchAsync (before CUDA 12.8).
	ErrNoBatch = errors.New("cuda: cudaMemcpyBatchAsync unavailable")
	// ErrBounds: a range lies outside the device allocation it names.
	ErrBounds = errors.New("cuda: range outside the allocation")
	// ErrUnchecked: an imported range could not be checked against its
	// allocation (no driver API, or the driver could not say), so it was
	// refused.
	ErrUnchecked = errors.New("cuda: range not checkable against the allocation")
	// ErrSticky matches (errors.Is) any sticky Error: a fault that broke
	// the process's context on its device.
	ErrSticky = errors.New("cuda: sticky error: the device's context is broken")
	// ErrClosed: the memory or runtime was closed.
	ErrClosed = errors.New("cuda: closed")
)

// Error is a cudaError_t status code. It prints its name (from a built-in
// table, so without the library), and compares with errors.Is.
type Error int

// Status codes the data paths check for.
const (
	ErrorInvalidValue          Error = 1
	ErrorMemoryAllocation      Error = 2
	ErrorInitializationError   Error = 3
	ErrorInsufficientDriver    Error = 35
	ErrorNoDevice              Error = 100
	ErrorInvalidDevice         Error = 101
	ErrorMapBufferObjectFailed Error = 205
	ErrorInvalidResourceHandle Error = 400
	ErrorNotReady              Error = 600
	ErrorIllegalAddress        Error = 700
	ErrorLaunchFailure         Error = 719
	ErrorPeerAccessUnsupported Error = 217
	ErrorNotSupported          Error = 801
	ErrorUnknown               Error = 999
)

var errorNames = map[Error]string{
	0:                          "cudaSuccess",
	ErrorInvalidValue:          "cudaErrorInvalidValue",
	ErrorMemoryAllocation:      "cudaErrorMemoryAllocation",
	ErrorInitializationError:   "cudaErrorInitializationError",
	4:                          "cudaErrorCudartUnloading",
	ErrorInsufficientDriver:    "cudaErrorInsufficientDriver",
	46:                         "cudaErrorDevicesUnavailable",
	ErrorNoDevice:              "cudaErrorNoDevice",
	ErrorInvalidDevice:         "cudaErrorInvalidDevice",
	201:                        "cudaErrorDeviceUninitialized",
	ErrorMapBufferObjectFailed: "cudaErrorMapBufferObjectFailed",
	ErrorPeerAccessUnsupported: "cudaErrorPeerAccessUnsupported",
	ErrorInvalidResourceHandle: "cudaErrorInvalidResourceHandle",
	ErrorNotReady:              "cudaErrorNotReady",
	ErrorIllegalAddress:        "cudaErrorIllegalAddress",
	ErrorLaunchFailure:         "cudaErrorLaunchFailure",
	712:                        "cudaErrorHostMemoryAlreadyRegistered",
	713:                        "cudaErrorHostMemoryNotRegistered",
	ErrorNotSupported:          "cudaErrorNotSupported",
	ErrorUnknown:               "cudaErrorUnknown",
}

// Sticky reports whether the code is one of CUDA's sticky errors: a fault
// on the device (an illegal address, a failed or timed-out launch, a
// hardware or ECC error, a fault the GPU contained, such as a bad access
// to a peer's memory over NVLink) after which the process's context on
// that device is unusable, and every later call there fails, until the
// process exits. They are the codes CUDA documents as "the process must
// be terminated and relaunched", and cudaErrorECCUncorrectable.
func (e Error) Sticky() bool {
	switch e {
	case 214, // cudaErrorECCUncorrectable
		226, // cudaErrorContained
		ErrorIllegalAddress,
		702, // cudaErrorLaunchTimeout
		710, // cudaErrorAssert
		714, // cudaErrorHardwareStackError
		715, // cudaErrorIllegalInstruction
		716, // cudaErrorMisalignedAddress
		717, // cudaErrorInvalidAddressSpace
		718, // cudaErrorInvalidPc
		ErrorLaunchFailure,
		721, // cudaErrorTensorMemoryLeak
		810, // cudaErrorMpsClientTerminated
		911: // cudaErrorExternalDevice
		return true
	}
	return false
}

// Is makes errors.Is(err, ErrSticky) true for a sticky code anywhere in
// err's tree (wrapped or joined).
func (e Error) Is(target error) bool { return target == ErrSticky && e.Sticky() }

// Error names the code.
func (e Error) Error() string {
	if n, ok := errorNames[e]; ok {
		return n
	}
	return fmt.Sprintf("cudaError(%d)", int(e))
}

// Result is a CUresult, a status code of the CUDA driver API, as a
// library built on the driver reports one (cuFile's CUfileError_t.cu_err).
// The driver numbers its sticky errors as the runtime numbers its own
// (CUDA_ERROR_ILLEGAL_ADDRESS is 700, CUDA_ERROR_LAUNCH_FAILED 719, as
// cudaErrorIllegalAddress and cudaErrorLaunchFailure), so errors.Is(err,
// ErrSticky) holds for the same faults.
type Result int

// Sticky reports whether the code is one of the driver's sticky errors
// (Error.Sticky's).
func (r Result) Sticky() bool { return Error(r).Sticky() }

// Is makes errors.Is(err, ErrSticky) true for a sticky code.
func (r Result) Is(target error) bool { return target == ErrSticky && r.Sticky() }

// Error prints the code: "CUresult 700".
func (r Result) Error() string { return fmt.Sprintf("CUresult %d", int(r)) }

// CallError is a failed CUDA call: the function, the status code, and the
// runtime's description when the library gives one. It unwraps to Code.
type CallError struct {
	// Func is the CUDA function that failed ("cudaMemcpyAsync").
	Func string
	// Code is the status it returned.
	Code Error
	// Desc is the library's description of Code ("" where it gives none).
	Desc string
}

// Error names the function, the status and its description.
func (e *CallError) Error() string {
	if e.Desc != "" {
		return fmt.Sprintf("cuda: %s: %v (%s)", e.Func, e.Code, e.Desc)
	}
	return fmt.Sprintf("cuda: %s: %v", e.Func, e.Code)
}

// Unwrap returns the status code.
func (e *CallError) Unwrap() error { return e.Code }

// Config says where the libraries are. Empty lists use the defaults.
type Config struct {
	// Runtime lists paths of libcudart to try in order (default
	// DefaultRuntimePaths()).
	Runtime []string
	// Driver lists paths of libcuda (default DefaultDriverPaths()). The
	// driver API is optional: it bounds IPC imports by their allocation.
	Driver []string
}

// DefaultRuntimePaths returns the usual places of the CUDA runtime. The
// slice is the caller's.
func DefaultRuntimePaths() []string {
	return []string{
		"libcudart.so.13", "libcudart.so.12", "libcudart.so",
		"/usr/local/cuda/targets/x86_64-linux/lib/libcudart.so.13",
		"/usr/local/cuda/targets/x86_64-linux/lib/libcudart.so.12",
		"/usr/local/cuda/lib64/libcudart.so.13", "/usr/local/cuda/lib64/libcudart.so.12",
		"/usr/local/cuda/lib64/libcudart.so",
	}
}

// DefaultDriverPaths returns the usual places of the driver API library.
// The slice is the caller's.
func DefaultDriverPaths() []string {
	return []string{"libcuda.so.1", "libcuda.so", "/usr/lib/x86_64-linux-gnu/libcuda.so.1"}
}

// Copy directions (cudaMemcpyKind).
const (
	hostToDevice = 1
	deviceToHost = 2
)

// Flags.
const (
	hostAllocPortable       = 1 // cudaHostAllocPortable
	hostRegisterPortable    = 1 // cudaHostRegisterPortable
	streamNonBlocking       = 1 // cudaStreamNonBlocking
	eventDisableTiming      = 2 // cudaEventDisableTiming
	eventBlockingSync       = 1 // cudaEventBlockingSync
	ipcLazyEnablePeerAccess = 1 // cudaIpcMemLazyEnablePeerAccess
)

// IPCHandleSize is the size of a cudaIpcMemHandle_t.
const IPCHandleSize = 64

// Runtime is an open CUDA runtime. Its methods may be called from many
// goroutines; each call acts on the calling thread's current device.
type Runtime struct {
	rt, drv *dl.Library
	version int
	nextID  atomic.Uint64
	fn      struct {
		getErrorName, getErrorString                            unsafe.Pointer
		runtimeGetVersion, getDeviceCount, setDevice, getDevice unsafe.Pointer
		deviceGetPCIBusID, deviceGetAttribute                   unsafe.Pointer
		streamCreate, streamDestroy, streamSync, streamQuery    unsafe.Pointer
		eventCreate, eventRecord, eventSync, eventDestroy       unsafe.Pointer
		eventQuery                                              unsafe.Pointer
		hostAlloc, freeHost, hostRegister, hostUnregister       unsafe.Pointer
		malloc, free, memcpyAsync, memcpy, memcpyBatch          unsafe.Pointer
		ipcGetMemHandle, ipcOpenMemHandle, ipcCloseMemHandle    unsafe.Pointer
		cuInit, cuMemGetAddressRange                            unsafe.Pointer
		cuDeviceGet, cuDeviceGetUuid                            unsafe.Pointer
		cuModuleLoadDataEx, cuModuleGetFunction, cuModuleUnload unsafe.Pointer
		cuLaunchKernel                                          unsafe.Pointer
		cuCtxGetCurrent, cuCtxSetCurrent                        unsafe.Pointer
	}
}

// Open loads the runtime (and the driver API if present) and resolves
// every symbol.
func Open(cfg Config) (*Runtime, error) {
	paths := cfg.Runtime
	if len(paths) == 0 {
		paths = DefaultRuntimePaths()
	}
	rt, err := dl.Open(paths...)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	r := &Runtime{rt: rt}
	f := &r.fn
	syms := []struct {
		p    *unsafe.Pointer
		name string
	}{
		{&f.getErrorName, "cudaGetErrorName"}, {&f.getErrorString, "cudaGetErrorString"},
		{&f.runtimeGetVersion, "cudaRuntimeGetVersion"}, {&f.getDeviceCount, "cudaGetDeviceCount"},
		{&f.setDevice, "cudaSetDevice"}, {&f.getDevice, "cudaGetDevice"},
		{&f.deviceGetPCIBusID, "cudaDeviceGetPCIBusId"}, {&f.deviceGetAttribute, "cudaDeviceGetAttribute"},
		{&f.streamCreate, "cudaStreamCreateWithFlags"}, {&f.streamDestroy, "cudaStreamDestroy"},
		{&f.streamSync, "cudaStreamSynchronize"}, {&f.streamQuery, "cudaStreamQuery"},
		{&f.eventCreate, "cudaEventCreateWithFlags"}, {&f.eventRecord, "cudaEventRecord"},
		{&f.eventSync, "cudaEventSynchronize"}, {&f.eventDestroy, "cudaEventDestroy"},
		{&f.eventQuery, "cudaEventQuery"},
		{&f.hostAlloc, "cudaHostAlloc"}, {&f.freeHost, "cudaFreeHost"},
		{&f.hostRegister, "cudaHostRegister"}, {&f.hostUnregister, "cudaHostUnregister"},
		{&f.malloc, "cudaMalloc"}, {&f.free, "cudaFree"},
		{&f.memcpyAsync, "cudaMemcpyAsync"}, {&f.memcpy, "cudaMemcpy"},
		{&f.ipcGetMemHandle, "cudaIpcGetMemHandle"}, {&f.ipcOpenMemHandle, "cudaIpcOpenMemHandle"},
		{&f.ipcCloseMemHandle, "cudaIpcCloseMemHandle"},
	}
	for _, s := range syms {
		if *s.p, err = rt.Sym(s.name); err != nil {
			rt.Close()
			return nil, fmt.Errorf("%w: %w", ErrUnavailable, err)
		}
	}
	var v int32
	if code := callP(f.runtimeGetVersion, unsafe.Pointer(&v)); code != 0 {
		rt.Close()
		return nil, fmt.Errorf("%w: %w", ErrUnavailable, r.err("cudaRuntimeGetVersion", code))
	}
	r.version = int(v)
	if r.version >= 12080 {
		// Optional: absent before 12.8; its signature lost failIdx in 13.0.
		f.memcpyBatch, _ = rt.Sym("cudaMemcpyBatchAsync")
	}
	dpaths := cfg.Driver
	if len(dpaths) == 0 {
		dpaths = DefaultDriverPaths()
	}
	if drv, err := dl.Open(dpaths...); err == nil {
		a, err1 := drv.Sym("cuInit")
		b, err2 := drv.Sym("cuMemGetAddressRange_v2")
		if err1 == nil && err2 == nil && callU(a, 0) == 0 {
			r.drv, f.cuInit, f.cuMemGetAddressRange = drv, a, b
			// Optional, both or neither: device UUIDs (DeviceUUID).
			if g, err := drv.Sym("cuDeviceGet"); err == nil {
				for _, name := range []string{"cuDeviceGetUuid_v2", "cuDeviceGetUuid"} {
					if u, err := drv.Sym(name); err == nil {
						f.cuDeviceGet, f.cuDeviceGetUuid = g, u
						break
					}
				}
			}
			// Optional, both or neither: the thread's context (LockDevice).
			if g, err := drv.Sym("cuCtxGetCurrent"); err == nil {
				if c, err := drv.Sym("cuCtxSetCurrent"); err == nil {
					f.cuCtxGetCurrent, f.cuCtxSetCurrent = g, c
				}
			}
			// Optional, all four or none: the copy kernel (copykernel.go).
			r.loadKernelSymbols(drv)
		} else {
			drv.Close()
		}
	}
	return r, nil
}

// Close closes the libraries. Nothing obtained from the runtime may be
// used afterwards.
func (r *Runtime) Close() error {
	var err error
	if r.drv != nil {
		err = r.drv.Close()
	}
	return errors.Join(err, r.rt.Close())
}

// Path is the path the runtime was loaded from.
func (r *Runtime) Path() string { return r.rt.Path() }

// Version is the runtime's version (1000·major + 10·minor: 13000 is 13.0).
func (r *Runtime) Version() int { return r.version }

// HasBatch reports whether cudaMemcpyBatchAsync is available.
func (r *Runtime) HasBatch() bool { return r.fn.memcpyBatch != nil }

// HasDriver reports whether the driver API was loaded.
func (r *Runtime) HasDriver() bool { return r.drv != nil }

func (r *Runtime) err(fn string, code int) error {
	if code == 0 {
		return nil
	}
	e := &CallError{Func: fn, Code: Error(code)}
	if r.fn.getErrorString != nil {
		e.Desc = callStr(r.fn.getErrorString, code)
	}
	return e
}

// ErrorName is the runtime's name for a status code (cudaGetErrorName).
func (r *Runtime) ErrorName(code Error) string { return callStr(r.fn.getErrorName, int(code)) }

// DeviceCount is the number of visible devices.
func (r *Runtime) DeviceCount() (int, error) {
	var n int32
	if err := r.err("cudaGetDeviceCount", callP(r.fn.getDeviceCount, unsafe.Pointer(&n))); err != nil {
		return 0, err
	}
	return int(n), nil
}

// SetDevice makes device d current on the calling thread.
func (r *Runtime) SetDevice(d int) error { return r.err("cudaSetDevice", callI(r.fn.setDevice, d)) }

// Device is the calling thread's current device.
func (r *Runtime) Device() (int, error) {
	var d int32
	if err := r.err("cudaGetDevice", callP(r.fn.getDevice, unsafe.Pointer(&d))); err != nil {
		return 0, err
	}
	return int(d), nil
}

// PCIBusID is device d's PCI address ("0000:3b:00.0").
func (r *Runtime) PCIBusID(d int) (string, error) {
	var buf [64]byte
	if err := r.err("cudaDeviceGetPCIBusId", callPII(r.fn.deviceGetPCIBusID, unsafe.Pointer(&buf[0]), len(buf), d)); err != nil {
		return "", err
	}
	for i, c := range buf {
		if c == 0 {
			return string(buf[:i]), nil
		}
	}
	return string(buf[:]), nil
}

// DeviceUUID is device d's UUID (cuDeviceGetUuid), the identity nvidia-smi
// prints as GPU-<uuid>: it names the same GPU in every process, whatever
// CUDA_VISIBLE_DEVICES makes of its ordinal. It fails with ErrUnavailable
// where the driver API is not loaded.
func (r *Runtime) DeviceUUID(d int) ([16]byte, error) {
	var uuid [16]byte
	if r.fn.cuDeviceGet == nil || r.fn.cuDeviceGetUuid == nil {
		return uuid, fmt.Errorf("%w: no cuDeviceGetUuid in the driver API", ErrUnavailable)
	}
	var dev int32
	if code := callPI(r.fn.cuDeviceGet, unsafe.Pointer(&dev), d); code != 0 {
		return uuid, fmt.Errorf("cuda: cuDeviceGet(%d): driver error %d", d, code)
	}
	if code := callPI(r.fn.cuDeviceGetUuid, unsafe.Pointer(&uuid[0]), int(dev)); code != 0 {
		return uuid, fmt.Errorf("cuda: cuDeviceGetUuid(%d): driver error %d", d, code)
	}
	return uuid, nil
}

// Attribute is cudaDeviceGetAttribute(attr) of device d.
func (r *Runtime) Attribute(attr, d int) (int, error) {
	var v int32
	if err := r.err("cudaDeviceGetAttribute", callPII(r.fn.deviceGetAttribute, unsafe.Pointer(&v), attr, d)); err != nil {
		return 0, err
	}
	return int(v), nil
}

// Stream is a cudaStream_t.
type Stream uintptr

// NewStream creates a non-blocking stream on the current device.
func (r *Runtime) NewStream() (Stream, error) {
	var s uintptr
	if err := r.err("cudaStreamCreateWithFlags", callPU(r.fn.streamCreate, unsafe.Pointer(&s), streamNonBlocking)); err != nil {
		return 0, err
	}
	return Stream(s), nil
}

// DestroyStream destroys s.
func (r *Runtime) DestroyStream(s Stream) error {
	return r.err("cudaStreamDestroy", callU(r.fn.streamDestroy, uintptr(s)))
}

// Sync waits for everything enqueued on s; an asynchronous failure of
// any of it is returned here.
func (r *Runtime) Sync(s Stream) error {
	return r.err("cudaStreamSynchronize", callU(r.fn.streamSync, uintptr(s)))
}

// Event is a cudaEvent_t.
type Event uintptr

// NewEvent creates an event without timing.
func (r *Runtime) NewEvent() (Event, error) { return r.newEvent(eventDisableTiming) }

// NewBlockingEvent creates an event without timing whose Wait puts the
// calling thread to sleep until the event completes, where Sync and the
// Wait of other events spin on a core (CUDA's default while a process
// has fewer contexts than cores).
func (r *Runtime) NewBlockingEvent() (Event, error) {
	return r.newEvent(eventDisableTiming | eventBlockingSync)
}

func (r *Runtime) newEvent(flags uint32) (Event, error) {
	var e uintptr
	if err := r.err("cudaEventCreateWithFlags", callPU(r.fn.eventCreate, unsafe.Pointer(&e), flags)); err != nil {
		return 0, err
	}
	return Event(e), nil
}

// Record records e on s.
func (r *Runtime) Record(e Event, s Stream) error {
	return r.err("cudaEventRecord", callUU(r.fn.eventRecord, uintptr(e), uintptr(s)))
}

// Wait waits for e.
func (r *Runtime) Wait(e Event) error {
	return r.err("cudaEventSynchronize", callU(r.fn.eventSync, uintptr(e)))
}

// Done reports whether the work recorded before e completed, without
// waiting (cudaEventQuery): false while it runs. If that work failed it
// returns Wait's error (and done true: the wait is over); done means
// nothing beside an error.
func (r *Runtime) Done(e Event) (bool, error) {
	return r.query("cudaEventQuery", r.fn.eventQuery, uintptr(e))
}

// StreamDone reports whether everything enqueued on s completed, without
// waiting (cudaStreamQuery): false while it runs. Like Done, it returns
// the error of failed work (done true); on a context broken by a sticky
// error it returns that error, whatever s holds (CUDA's note on the call:
// it may return errors of earlier asynchronous launches).
func (r *Runtime) StreamDone(s Stream) (bool, error) {
	return r.query("cudaStreamQuery", r.fn.streamQuery, uintptr(s))
}

// query calls fn, a query of event or stream h, reading
// cudaErrorNotReady as not done.
func (r *Runtime) query(name string, fn unsafe.Pointer, h uintptr) (bool, error) {
	code := callU(fn, h)
	if Error(code) == ErrorNotReady {
		return false, nil
	}
	return true, r.err(name, code)
}

// DestroyEvent destroys e.
func (r *Runtime) DestroyEvent(e Event) error {
	return r.err("cudaEventDestroy", callU(r.fn.eventDestroy, uintptr(e)))
}

// CopyH2D enqueues a copy of n bytes from host address src to device
// address dst on s.
func (r *Runtime) CopyH2D(dst, src, n uintptr, s Stream) error {
	return r.err("cudaMemcpyAsync", callMemcpyAsync(r.fn.memcpyAsync, dst, src, n, hostToDevice, uintptr(s)))
}

// CopyD2H enqueues a copy of n bytes from device address src to host
// address dst on s.
func (r *Runtime) CopyD2H(dst, src, n uintptr, s Stream) error {
	return r.err("cudaMemcpyAsync", callMemcpyAsync(r.fn.memcpyAsync, dst, src, n, deviceToHost, uintptr(s)))
}

// CopySync copies n bytes between any two addresses (cudaMemcpyDefault)
// and waits.
func (r *Runtime) CopySync(dst, src, n uintptr) error {
	return r.err("cudaMemcpy", callMemcpy(r.fn.memcpy, dst, src, n, 4))
}

// CopyMode chooses how a scatter/gather of many segments is enqueued.
type CopyMode int

// Copy modes.
const (
	// CopyAuto uses CopyBatch where available, else CopySegments.
	CopyAuto CopyMode = iota
	// CopySegments issues one cudaMemcpyAsync per segment (in one cgo call).
	CopySegments
	// CopyBatch issues one cudaMemcpyBatchAsync for all segments.
	CopyBatch
	// CopyKernel launches kvhost's copy kernel once for all segments
	// (Kernel.Launch; Enqueue refuses it).
	CopyKernel
)

// String names the mode.
func (m CopyMode) String() string {
	switch m {
	case CopySegments:
		return "segments"
	case CopyBatch:
		return "batch"
	case CopyKernel:
		return "kernel"
	}
	return "auto"
}

// ParseCopyMode reads a mode by its name (as String writes it; "" is
// auto).
func ParseCopyMode(s string) (CopyMode, error) {
	for _, m := range []CopyMode{CopyAuto, CopySegments, CopyBatch, CopyKernel} {
		if s == m.String() {
			return m, nil
		}
	}
	if s == "" {
		return CopyAuto, nil
	}
	return 0, fmt.Errorf("cuda: copy mode %q: want auto, kernel, batch or segments", s)
}

// Copies is a list of copies, one direction, to enqueue together: Dst[i]
// ← Src[i], Size[i] bytes. Reuse it with Reset to avoid allocation.
type Copies struct {
	// Dst, Src and Size hold, for copy i, its destination and source
	// addresses (host or device, by the direction) and its length in
	// bytes.
	Dst, Src, Size []uintptr
}

// Add appends a copy.
func (c *Copies) Add(dst, src, n uintptr) {
	c.Dst, c.Src, c.Size = append(c.Dst, dst), append(c.Src, src), append(c.Size, n)
}

// Reset empties the list, keeping its memory.
func (c *Copies) Reset() { c.Dst, c.Src, c.Size = c.Dst[:0], c.Src[:0], c.Size[:0] }

// Len is the number of copies.
func (c *Copies) Len() int { return len(c.Dst) }

// Enqueue enqueues every copy on s, host to device if h2d, else device to
// host, by mode. Nothing is complete until s is synchronized.
func (r *Runtime) Enqueue(c *Copies, h2d bool, mode CopyMode, s Stream) error {
	if mode == CopyAuto {
		mode = CopySegments
		if r.HasBatch() {
			mode = CopyBatch
		}
	}
	kind := deviceToHost
	if h2d {
		kind = hostToDevice
	}
	switch mode {
	case CopyKernel:
		return fmt.Errorf("cuda: Enqueue: %v copies are launched with Kernel.Launch", mode)
	case CopyBatch:
		if !r.HasBatch() {
			return ErrNoBatch
		}
		return r.err("cudaMemcpyBatchAsync", memcpyBatch(r.fn.memcpyBatch, r.version >= 13000, c.Dst, c.Src, c.Size, uintptr(s)))
	default:
		done, code := memcpyMany(r.fn.memcpyAsync, c.Dst, c.Src, c.Size, kind, uintptr(s))
		if code != 0 {
			return fmt.Errorf("copy %d of %d: %w", done, c.Len(), r.err("cudaMemcpyAsync", code))
		}
		return nil
	}
}
