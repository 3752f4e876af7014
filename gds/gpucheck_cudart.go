//go:build gpu && linux && cgo

package gds

// A minimal libcudart binding for the GPU check (gpu_test.go) only: device
// memory to move and a way to bind threads. kvhost's CUDA runtime binding
// is package cuda; this file is compiled only with -tags gpu.

/*
#include <stddef.h>
#include <stdint.h>
static int kv_cuda_malloc(void *f, void **p, size_t n) { return ((int (*)(void **, size_t))f)(p, n); }
static int kv_cuda_free(void *f, uintptr_t p) { return ((int (*)(void *))f)((void *)p); }
static int kv_cuda_h2d(void *f, uintptr_t dst, const void *src, size_t n) {
	return ((int (*)(void *, const void *, size_t, int))f)((void *)dst, src, n, 1);
}
static int kv_cuda_d2h(void *f, void *dst, uintptr_t src, size_t n) {
	return ((int (*)(void *, const void *, size_t, int))f)(dst, (const void *)src, n, 2);
}
static int kv_cuda_memset(void *f, uintptr_t p, int v, size_t n) { return ((int (*)(void *, int, size_t))f)((void *)p, v, n); }
static int kv_cuda_int(void *f, int v) { return ((int (*)(int))f)(v); }
*/
import "C"

import (
	"fmt"
	"unsafe"

	"github.com/kvhost/kvhost/internal/dl"
)

type testCudart struct {
	lib                                  *dl.Library
	malloc, free, memcpy, memset, setDev unsafe.Pointer
}

func openTestCudart() (*testCudart, error) {
	lib, err := dl.Open("libcudart.so.13", "libcudart.so.12", "libcudart.so",
		"/usr/local/cuda/targets/x86_64-linux/lib/libcudart.so.13", "/usr/local/cuda/lib64/libcudart.so")
	if err != nil {
		return nil, err
	}
	c := &testCudart{lib: lib}
	for _, s := range []struct {
		p    *unsafe.Pointer
		name string
	}{{&c.malloc, "cudaMalloc"}, {&c.free, "cudaFree"}, {&c.memcpy, "cudaMemcpy"}, {&c.memset, "cudaMemset"}, {&c.setDev, "cudaSetDevice"}} {
		if *s.p, err = lib.Sym(s.name); err != nil {
			return nil, err
		}
	}
	return c, nil
}

func cudaErr(what string, rc C.int) error {
	if rc != 0 {
		return fmt.Errorf("%s: cudaError %d", what, int(rc))
	}
	return nil
}

func (c *testCudart) setDevice(ordinal int) error {
	return cudaErr("cudaSetDevice", C.kv_cuda_int(c.setDev, C.int(ordinal)))
}

func (c *testCudart) mallocDev(n int64) (uintptr, error) {
	var p unsafe.Pointer
	if err := cudaErr("cudaMalloc", C.kv_cuda_malloc(c.malloc, &p, C.size_t(n))); err != nil {
		return 0, err
	}
	return uintptr(p), nil
}

func (c *testCudart) freeDev(p uintptr) error {
	return cudaErr("cudaFree", C.kv_cuda_free(c.free, C.uintptr_t(p)))
}

// toDevice copies host bytes to device address dst (cudaMemcpyHostToDevice).
func (c *testCudart) toDevice(dst uintptr, src []byte) error {
	return cudaErr("cudaMemcpy H2D", C.kv_cuda_h2d(c.memcpy, C.uintptr_t(dst), unsafe.Pointer(&src[0]), C.size_t(len(src))))
}

// toHost copies device bytes at src into dst (cudaMemcpyDeviceToHost).
func (c *testCudart) toHost(dst []byte, src uintptr) error {
	return cudaErr("cudaMemcpy D2H", C.kv_cuda_d2h(c.memcpy, unsafe.Pointer(&dst[0]), C.uintptr_t(src), C.size_t(len(dst))))
}

func (c *testCudart) memsetDev(p uintptr, v byte, n int64) error {
	return cudaErr("cudaMemset", C.kv_cuda_memset(c.memset, C.uintptr_t(p), C.int(v), C.size_t(n)))
}
