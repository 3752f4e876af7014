package cuda

import (
	"encoding/binary"
	"errors"
	"fmt"

	"unsafe"

	"github.com/kvhost/kvhost/internal/dl"
)

// ErrNoKernel is returned where the driver API lacks what kvhost's
// kernels (the copy and the checksum kernel) need: no libcuda, or one
// without module loading and kernel launches.
var ErrNoKernel = errors.New("cuda: kernels unavailable (no driver API)")

// Kernel copies: every address and length must be a multiple of
// KernelAlign; one launch copies at most KernelMaxEntries segments, each
// described by KernelEntryBytes of its table.
const (
	KernelAlign      = 16
	KernelEntryBytes = 24
	KernelMaxEntries = 65535 // a grid's y dimension
)

// Launch shape: kernelThreads threads per block, each moving 16 bytes per
// step; a segment gets enough blocks for one step each, at most
// kernelMaxBlocks (longer segments loop).
const (
	kernelThreads   = 256
	kernelMaxBlocks = 64
)

// copyKernelName is the entry point in copyKernelPTX.
const copyKernelName = "kv_copy_segments"

// copyKernelPTX is the copy kernel, written in PTX by hand and compiled
// by the driver's JIT when it is loaded, so kvhost builds without the CUDA
// toolkit. Block (x, y) copies part of segment y of the table: thread 0
// reads the entry (dst, src, len: three little-endian u64) into shared
// memory, then every thread copies 16 bytes at (x·blockDim + thread)·16
// and steps by gridDim.x·blockDim·16 until len. The table and the data
// may be in pinned host memory or on the device: under unified
// addressing both are global addresses, so one kernel serves stores and
// loads. PTX ISA 7.0 for sm_75 and later (CUDA 13's oldest target); the
// driver compiles it for the device at hand.
const copyKernelPTX = `.version 7.0
.target sm_75
.address_size 64

.visible .entry kv_copy_segments(
	.param .u64 table
)
{
	.reg .pred %p<3>;
	.reg .b32 %r<12>;
	.reg .b64 %rd<12>;
	.shared .align 8 .b8 seg[24];

	mov.u32 %r1, %ctaid.y;
	mov.u32 %r2, %tid.x;
	setp.ne.u32 %p1, %r2, 0;
	@%p1 bra LOADED;
	ld.param.u64 %rd1, [table];
	cvta.to.global.u64 %rd1, %rd1;
	mul.wide.u32 %rd2, %r1, 24;
	add.s64 %rd3, %rd1, %rd2;
	ld.global.u64 %rd4, [%rd3];
	ld.global.u64 %rd5, [%rd3+8];
	ld.global.u64 %rd6, [%rd3+16];
	st.shared.u64 [seg], %rd4;
	st.shared.u64 [seg+8], %rd5;
	st.shared.u64 [seg+16], %rd6;
LOADED:
	bar.sync 0;
	ld.shared.u64 %rd4, [seg];
	ld.shared.u64 %rd5, [seg+8];
	ld.shared.u64 %rd6, [seg+16];
	cvta.to.global.u64 %rd4, %rd4;
	cvta.to.global.u64 %rd5, %rd5;
	mov.u32 %r3, %ctaid.x;
	mov.u32 %r4, %ntid.x;
	mov.u32 %r5, %nctaid.x;
	mad.lo.u32 %r6, %r3, %r4, %r2;
	mul.wide.u32 %rd7, %r6, 16;
	mul.lo.u32 %r7, %r5, %r4;
	mul.wide.u32 %rd8, %r7, 16;
STEP:
	setp.ge.u64 %p2, %rd7, %rd6;
	@%p2 bra DONE;
	add.s64 %rd9, %rd5, %rd7;
	ld.global.v4.u32 {%r8, %r9, %r10, %r11}, [%rd9];
	add.s64 %rd10, %rd4, %rd7;
	st.global.v4.u32 [%rd10], {%r8, %r9, %r10, %r11};
	add.s64 %rd7, %rd7, %rd8;
	bra.uni STEP;
DONE:
	ret;
}
`

// DriverError is a failed driver API call (a CUresult, numbered apart
// from the runtime's codes), with the JIT's log where it gave one. It
// unwraps to its code as a Result, so a sticky one (a launch on a
// context an illegal address broke) matches ErrSticky.
type DriverError struct {
	Func string // the driver function that failed, e.g. "cuLaunchKernel"
	Code int    // its CUresult
	Log  string // the JIT's error log, for a module load; else empty
}

// driverErrorName names the CUresults the copy kernel's calls can return.
func driverErrorName(code int) string {
	switch code {
	case 1:
		return "CUDA_ERROR_INVALID_VALUE"
	case 2:
		return "CUDA_ERROR_OUT_OF_MEMORY"
	case 3:
		return "CUDA_ERROR_NOT_INITIALIZED"
	case 200:
		return "CUDA_ERROR_INVALID_IMAGE"
	case 201:
		return "CUDA_ERROR_INVALID_CONTEXT"
	case 209:
		return "CUDA_ERROR_NO_BINARY_FOR_GPU"
	case 218:
		return "CUDA_ERROR_INVALID_PTX"
	case 221:
		return "CUDA_ERROR_JIT_COMPILER_NOT_FOUND"
	case 222:
		return "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"
	case 400:
		return "CUDA_ERROR_INVALID_HANDLE"
	case 500:
		return "CUDA_ERROR_NOT_FOUND"
	case 700:
		return "CUDA_ERROR_ILLEGAL_ADDRESS"
	case 701:
		return "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"
	case 719:
		return "CUDA_ERROR_LAUNCH_FAILED"
	}
	return fmt.Sprintf("CUresult(%d)", code)
}

// Unwrap returns the CUresult.
func (e *DriverError) Unwrap() error { return Result(e.Code) }

// Error names the function, the CUresult and the JIT's log.
func (e *DriverError) Error() string {
	name := driverErrorName(e.Code)
	if e.Log != "" {
		return fmt.Sprintf("cuda: %s: %s: %s", e.Func, name, e.Log)
	}
	return fmt.Sprintf("cuda: %s: %s", e.Func, name)
}

// loadKernelSymbols resolves the driver functions the copy kernel needs:
// all of them, or none.
func (r *Runtime) loadKernelSymbols(drv *dl.Library) {
	f := &r.fn
	syms := []struct {
		p    *unsafe.Pointer
		name string
	}{
		{&f.cuModuleLoadDataEx, "cuModuleLoadDataEx"}, {&f.cuModuleGetFunction, "cuModuleGetFunction"},
		{&f.cuModuleUnload, "cuModuleUnload"}, {&f.cuLaunchKernel, "cuLaunchKernel"},
	}
	var got [4]unsafe.Pointer
	for i, s := range syms {
		p, err := drv.Sym(s.name)
		if err != nil {
			return
		}
		got[i] = p
	}
	for i, s := range syms {
		*s.p = got[i]
	}
}

// HasKernel reports whether the driver API can load and launch the copy
// kernel (it still has to compile for the device: LoadCopyKernel).
func (r *Runtime) HasKernel() bool { return r.fn.cuLaunchKernel != nil }

// Kernel is the copy kernel loaded on one device: one launch copies many
// segments between pinned host memory and that device's memory, either
// way, in place of one DMA descriptor per segment.
type Kernel struct {
	r       *Runtime
	mod, fn uintptr
}

// LoadCopyKernel compiles and loads the copy kernel on the calling
// thread's current device (its primary context, the one the runtime
// uses). A PTX the driver refuses is a *DriverError with the JIT's log.
func (r *Runtime) LoadCopyKernel() (*Kernel, error) {
	mod, fn, err := r.loadModule(copyKernelPTX, copyKernelName)
	if err != nil {
		return nil, err
	}
	return &Kernel{r: r, mod: mod, fn: fn}, nil
}

// loadModule compiles ptx with the driver's JIT on the calling thread's
// current device (its primary context, the one the runtime uses) and
// finds its entry name. A PTX the driver refuses is a *DriverError with
// the JIT's log.
func (r *Runtime) loadModule(ptx, name string) (mod, fn uintptr, err error) {
	if !r.HasKernel() {
		return 0, 0, ErrNoKernel
	}
	// Make the runtime create the device's primary context and make it
	// current, so the driver API loads the module there.
	if err := r.err("cudaFree", callU(r.fn.free, 0)); err != nil {
		return 0, 0, err
	}
	mod, log, code := moduleLoad(r.fn.cuModuleLoadDataEx, ptx)
	if code != 0 {
		return 0, 0, &DriverError{Func: "cuModuleLoadDataEx", Code: code, Log: log}
	}
	fn, code = moduleFunction(r.fn.cuModuleGetFunction, mod, name)
	if code != 0 {
		callU(r.fn.cuModuleUnload, mod)
		return 0, 0, &DriverError{Func: "cuModuleGetFunction", Code: code}
	}
	return mod, fn, nil
}

// unloadModule unloads *mod and clears it and *fn.
func (r *Runtime) unloadModule(mod, fn *uintptr) error {
	if *mod == 0 {
		return ErrClosed
	}
	code := callU(r.fn.cuModuleUnload, *mod)
	*mod, *fn = 0, 0
	if code != 0 {
		return &DriverError{Func: "cuModuleUnload", Code: code}
	}
	return nil
}

// Unload unloads the kernel, on a thread with its device current, after
// every launch of it completed.
func (k *Kernel) Unload() error { return k.r.unloadModule(&k.mod, &k.fn) }

// KernelCopyable reports whether the kernel can move every copy of c:
// at most maxEntries of them, each address and length a multiple of
// KernelAlign.
func KernelCopyable(c *Copies, maxEntries int) bool {
	if c.Len() == 0 || c.Len() > min(maxEntries, KernelMaxEntries) {
		return false
	}
	for i := range c.Dst {
		if (c.Dst[i]|c.Src[i]|c.Size[i])%KernelAlign != 0 {
			return false
		}
	}
	return true
}

// Launch writes c's segments into table, 8-byte aligned pinned host
// memory of at least KernelEntryBytes·c.Len() bytes, and enqueues one
// launch on s; the kernel reads the table at its host address (unified
// addressing). The kernel reads the table when it runs: leave it
// untouched until an event recorded after the launch has completed.
func (k *Kernel) Launch(c *Copies, table []byte, s Stream) error {
	if len(table) == 0 || uintptr(unsafe.Pointer(&table[0]))%8 != 0 {
		return fmt.Errorf("cuda: copy kernel: a table of %d bytes that is not 8-byte aligned", len(table))
	}
	tableAddr := uintptr(unsafe.Pointer(&table[0]))
	if !KernelCopyable(c, len(table)/KernelEntryBytes) {
		return fmt.Errorf("cuda: copy kernel: %d copies do not fit a %d-byte table or are not %d-byte aligned", c.Len(), len(table), KernelAlign)
	}
	var longest uintptr
	for i := range c.Dst {
		e := table[i*KernelEntryBytes : (i+1)*KernelEntryBytes]
		binary.LittleEndian.PutUint64(e[0:], uint64(c.Dst[i]))
		binary.LittleEndian.PutUint64(e[8:], uint64(c.Src[i]))
		binary.LittleEndian.PutUint64(e[16:], uint64(c.Size[i]))
		longest = max(longest, c.Size[i])
	}
	step := uintptr(kernelThreads * KernelAlign)
	blocks := uint32(min((longest+step-1)/step, kernelMaxBlocks))
	if code := launchU64(k.r.fn.cuLaunchKernel, k.fn, max(blocks, 1), uint32(c.Len()), kernelThreads, uintptr(s), uint64(tableAddr)); code != 0 {
		return &DriverError{Func: "cuLaunchKernel", Code: code}
	}
	return nil
}
