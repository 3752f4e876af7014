//go:build linux && cgo

package cuda

/*
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <stdlib.h>

// Calls through function pointers resolved with dlsym. Device and C
// addresses travel as uintptr_t; Go memory as void*.
typedef int (*fn_p)(void *);
typedef int (*fn_u)(uintptr_t);
typedef int (*fn_i)(int);
typedef int (*fn_pu)(void *, unsigned);
typedef int (*fn_uu)(uintptr_t, uintptr_t);
typedef int (*fn_psu)(void *, size_t, unsigned);
typedef int (*fn_usu)(uintptr_t, size_t, unsigned);
typedef int (*fn_ps)(void *, size_t);
typedef int (*fn_pii)(void *, int, int);
typedef int (*fn_pi)(void *, int);
typedef int (*fn_ppu)(void *, void *, uintptr_t);
typedef int (*fn_pa)(void *, uintptr_t);
typedef int (*fn_memcpy_async)(uintptr_t, uintptr_t, size_t, int, uintptr_t);
typedef int (*fn_memcpy)(uintptr_t, uintptr_t, size_t, int);
typedef const char *(*fn_str)(int);

typedef struct { int srcAccessOrder; int srcType, srcId; int dstType, dstId; unsigned flags; } kv_memcpy_attrs;
typedef int (*fn_batch13)(const void *const *, const void *const *, const size_t *, size_t, kv_memcpy_attrs *, size_t *, size_t, uintptr_t);
typedef int (*fn_batch12)(const void *const *, const void *const *, const size_t *, size_t, kv_memcpy_attrs *, size_t *, size_t, size_t *, uintptr_t);

typedef struct { char reserved[64]; } kv_ipc_handle;
typedef int (*fn_ipc_open)(void **, kv_ipc_handle, unsigned);

static int kv_call_p(void *f, void *a) { return ((fn_p)f)(a); }
static int kv_call_u(void *f, uintptr_t a) { return ((fn_u)f)(a); }
static int kv_call_i(void *f, int a) { return ((fn_i)f)(a); }
static int kv_call_pu(void *f, void *a, unsigned b) { return ((fn_pu)f)(a, b); }
static int kv_call_uu(void *f, uintptr_t a, uintptr_t b) { return ((fn_uu)f)(a, b); }
static int kv_call_psu(void *f, void *a, size_t b, unsigned c) { return ((fn_psu)f)(a, b, c); }
static int kv_call_usu(void *f, uintptr_t a, size_t b, unsigned c) { return ((fn_usu)f)(a, b, c); }
static int kv_call_ps(void *f, void *a, size_t b) { return ((fn_ps)f)(a, b); }
static int kv_call_pii(void *f, void *a, int b, int c) { return ((fn_pii)f)(a, b, c); }
static int kv_call_pi(void *f, void *a, int b) { return ((fn_pi)f)(a, b); }
static int kv_call_ppu(void *f, void *a, void *b, uintptr_t c) { return ((fn_ppu)f)(a, b, c); }
static int kv_call_pa(void *f, void *a, uintptr_t b) { return ((fn_pa)f)(a, b); }
static int kv_call_memcpy_async(void *f, uintptr_t dst, uintptr_t src, size_t n, int kind, uintptr_t s) {
	return ((fn_memcpy_async)f)(dst, src, n, kind, s);
}
static int kv_call_memcpy(void *f, uintptr_t dst, uintptr_t src, size_t n, int kind) {
	return ((fn_memcpy)f)(dst, src, n, kind);
}
static const char *kv_call_str(void *f, int e) { return ((fn_str)f)(e); }

// One cudaMemcpyAsync per segment, in one cgo call. *done is the number
// enqueued before a failure.
static int kv_memcpy_many(void *f, const uintptr_t *dsts, const uintptr_t *srcs, const size_t *sizes,
			  size_t n, int kind, uintptr_t s, size_t *done) {
	for (size_t i = 0; i < n; i++) {
		int e = ((fn_memcpy_async)f)(dsts[i], srcs[i], sizes[i], kind, s);
		if (e) { *done = i; return e; }
	}
	*done = n;
	return 0;
}

// cudaMemcpyBatchAsync with one attribute (stream order) for every copy.
static int kv_memcpy_batch(void *f, int v13, const void *const *dsts, const void *const *srcs,
			   const size_t *sizes, size_t n, uintptr_t s) {
	kv_memcpy_attrs attr;
	memset(&attr, 0, sizeof attr);
	attr.srcAccessOrder = 1; // cudaMemcpySrcAccessOrderStream
	size_t idx = 0;
	if (v13) return ((fn_batch13)f)(dsts, srcs, sizes, n, &attr, &idx, 1, s);
	size_t fail = 0;
	return ((fn_batch12)f)(dsts, srcs, sizes, n, &attr, &idx, 1, &fail, s);
}

// cuModuleLoadDataEx with the JIT's error log in log (logSize bytes).
typedef int (*fn_modload)(void **, const void *, unsigned, int *, void **);
static int kv_module_load(void *f, void **mod, const char *image, char *log, size_t logSize) {
	int opts[2] = {5, 6}; // CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES
	void *vals[2] = {log, (void *)(uintptr_t)logSize};
	return ((fn_modload)f)(mod, image, 2, opts, vals);
}
typedef int (*fn_getfn)(void **, void *, const char *);
static int kv_module_function(void *f, void **fn, uintptr_t mod, const char *name) { return ((fn_getfn)f)(fn, (void *)mod, name); }

// cuLaunchKernel of a kernel whose one parameter is a 64-bit address.
typedef int (*fn_launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, uintptr_t, void **, void **);
static int kv_launch_u64(void *f, uintptr_t fn, unsigned gx, unsigned gy, unsigned bx, uintptr_t s, uint64_t arg) {
	void *params[1] = {&arg};
	return ((fn_launch)f)((void *)fn, gx, gy, 1, bx, 1, 1, 0, s, params, NULL);
}

static int kv_ipc_open(void *f, void **p, const void *handle, unsigned flags) {
	kv_ipc_handle h;
	memcpy(h.reserved, handle, sizeof h.reserved);
	return ((fn_ipc_open)f)(p, h, flags);
}
*/
import "C"

import "unsafe"

// Loadable reports whether this build can load the CUDA runtime at all:
// true with cgo on Linux (shim_stub.go has the other case).
const Loadable = true

// Calls by shape of signature; f is a resolved symbol. Each returns the
// function's status code.

func callP(f, a unsafe.Pointer) int         { return int(C.kv_call_p(f, a)) }
func callU(f unsafe.Pointer, a uintptr) int { return int(C.kv_call_u(f, C.uintptr_t(a))) }
func callI(f unsafe.Pointer, a int) int     { return int(C.kv_call_i(f, C.int(a))) }
func callPU(f, a unsafe.Pointer, b uint32) int {
	return int(C.kv_call_pu(f, a, C.unsigned(b)))
}
func callUU(f unsafe.Pointer, a, b uintptr) int {
	return int(C.kv_call_uu(f, C.uintptr_t(a), C.uintptr_t(b)))
}
func callPSU(f, a unsafe.Pointer, b uintptr, c uint32) int {
	return int(C.kv_call_psu(f, a, C.size_t(b), C.unsigned(c)))
}
func callUSU(f unsafe.Pointer, a, b uintptr, c uint32) int {
	return int(C.kv_call_usu(f, C.uintptr_t(a), C.size_t(b), C.unsigned(c)))
}
func callPS(f, a unsafe.Pointer, b uintptr) int { return int(C.kv_call_ps(f, a, C.size_t(b))) }
func callPII(f, a unsafe.Pointer, b, c int) int {
	return int(C.kv_call_pii(f, a, C.int(b), C.int(c)))
}
func callPI(f, a unsafe.Pointer, b int) int { return int(C.kv_call_pi(f, a, C.int(b))) }
func callPPU(f, a, b unsafe.Pointer, c uintptr) int {
	return int(C.kv_call_ppu(f, a, b, C.uintptr_t(c)))
}
func callPA(f, a unsafe.Pointer, b uintptr) int { return int(C.kv_call_pa(f, a, C.uintptr_t(b))) }

func callMemcpyAsync(f unsafe.Pointer, dst, src, n uintptr, kind int, s uintptr) int {
	return int(C.kv_call_memcpy_async(f, C.uintptr_t(dst), C.uintptr_t(src), C.size_t(n), C.int(kind), C.uintptr_t(s)))
}
func callMemcpy(f unsafe.Pointer, dst, src, n uintptr, kind int) int {
	return int(C.kv_call_memcpy(f, C.uintptr_t(dst), C.uintptr_t(src), C.size_t(n), C.int(kind)))
}

// callStr returns the C string a function returns for code e.
func callStr(f unsafe.Pointer, e int) string {
	s := C.kv_call_str(f, C.int(e))
	if s == nil {
		return ""
	}
	return C.GoString(s)
}

// memcpyMany enqueues one copy per segment; done is how many were enqueued.
func memcpyMany(f unsafe.Pointer, dsts, srcs, sizes []uintptr, kind int, s uintptr) (done int, code int) {
	if len(dsts) == 0 {
		return 0, 0
	}
	var d C.size_t
	code = int(C.kv_memcpy_many(f, (*C.uintptr_t)(unsafe.Pointer(&dsts[0])), (*C.uintptr_t)(unsafe.Pointer(&srcs[0])),
		(*C.size_t)(unsafe.Pointer(&sizes[0])), C.size_t(len(dsts)), C.int(kind), C.uintptr_t(s), &d))
	return int(d), code
}

// memcpyBatch calls cudaMemcpyBatchAsync with the CUDA 13 signature (v13)
// or the CUDA 12.8 one (with failIdx).
func memcpyBatch(f unsafe.Pointer, v13 bool, dsts, srcs, sizes []uintptr, s uintptr) int {
	if len(dsts) == 0 {
		return 0
	}
	v := C.int(0)
	if v13 {
		v = 1
	}
	return int(C.kv_memcpy_batch(f, v, (*unsafe.Pointer)(unsafe.Pointer(&dsts[0])), (*unsafe.Pointer)(unsafe.Pointer(&srcs[0])),
		(*C.size_t)(unsafe.Pointer(&sizes[0])), C.size_t(len(dsts)), C.uintptr_t(s)))
}

// moduleLoad loads a PTX image (cuModuleLoadDataEx); a failure's JIT log
// is returned with its code.
func moduleLoad(f unsafe.Pointer, image string) (mod uintptr, log string, code int) {
	img := C.CString(image)
	defer C.free(unsafe.Pointer(img))
	buf := (*C.char)(C.calloc(4096, 1))
	defer C.free(unsafe.Pointer(buf))
	var m unsafe.Pointer
	code = int(C.kv_module_load(f, &m, img, buf, 4096))
	return uintptr(m), C.GoString(buf), code
}

// moduleFunction looks a kernel up by name (cuModuleGetFunction).
func moduleFunction(f unsafe.Pointer, mod uintptr, name string) (uintptr, int) {
	n := C.CString(name)
	defer C.free(unsafe.Pointer(n))
	var fn unsafe.Pointer
	code := int(C.kv_module_function(f, &fn, C.uintptr_t(mod), n))
	return uintptr(fn), code
}

// launchU64 launches kernel fn with grid (gx, gy), bx threads per block and
// one 64-bit parameter on stream s (cuLaunchKernel).
func launchU64(f unsafe.Pointer, fn uintptr, gx, gy, bx uint32, s uintptr, arg uint64) int {
	return int(C.kv_launch_u64(f, C.uintptr_t(fn), C.unsigned(gx), C.unsigned(gy), C.unsigned(bx), C.uintptr_t(s), C.uint64_t(arg)))
}

// ipcOpen calls cudaIpcOpenMemHandle with the 64-byte handle by value.
func ipcOpen(f unsafe.Pointer, h *[IPCHandleSize]byte, flags uint32) (uintptr, int) {
	var p unsafe.Pointer
	code := int(C.kv_ipc_open(f, &p, unsafe.Pointer(&h[0]), C.unsigned(flags)))
	return uintptr(p), code
}
