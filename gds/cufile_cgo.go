//go:build linux && cgo

package gds

/*
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

// The cuFile types this package needs, declared here because kvhost builds
// without the CUDA toolkit's headers. Layouts follow cufile.h.
typedef struct { int err; int cu_err; } kv_cufile_error;

typedef struct {
	struct {
		unsigned int major_version;
		unsigned int minor_version;
		size_t poll_thresh_size;
		size_t max_direct_io_size;
		unsigned int dstatusflags;
		unsigned int dcontrolflags;
	} nvfs;
	unsigned int fflags;
	unsigned int max_device_cache_size;
	unsigned int per_buffer_cache_size;
	unsigned int max_device_pinned_mem_size;
	unsigned int max_batch_io_size;
	unsigned int max_batch_io_timeout_msecs;
} kv_cufile_props;

typedef struct {
	int type; // CU_FILE_HANDLE_TYPE_OPAQUE_FD = 1
	union { int fd; void *handle; } handle;
	const void *fs_ops;
} kv_cufile_descr;

static void kv_err(kv_cufile_error e, int *code, int *cu) { *code = e.err; *cu = e.cu_err; }

static void kv_call_void_err(void *f, int *code, int *cu) {
	kv_err(((kv_cufile_error (*)(void))f)(), code, cu);
}
static void kv_get_props(void *f, kv_cufile_props *p, int *code, int *cu) {
	kv_err(((kv_cufile_error (*)(kv_cufile_props *))f)(p), code, cu);
}
static void kv_get_version(void *f, int *v, int *code, int *cu) {
	kv_err(((kv_cufile_error (*)(int *))f)(v), code, cu);
}
static uintptr_t kv_handle_register(void *f, int fd, int *code, int *cu) {
	void *h = NULL;
	kv_cufile_descr d = {0};
	d.type = 1;
	d.handle.fd = fd;
	kv_err(((kv_cufile_error (*)(void **, kv_cufile_descr *))f)(&h, &d), code, cu);
	return (uintptr_t)h;
}
static void kv_handle_deregister(void *f, uintptr_t h) { ((void (*)(void *))f)((void *)h); }
static void kv_buf_register(void *f, uintptr_t p, size_t n, int flags, int *code, int *cu) {
	kv_err(((kv_cufile_error (*)(const void *, size_t, int))f)((const void *)p, n, flags), code, cu);
}
static void kv_buf_deregister(void *f, uintptr_t p, int *code, int *cu) {
	kv_err(((kv_cufile_error (*)(const void *))f)((const void *)p), code, cu);
}
static ssize_t kv_read(void *f, uintptr_t h, uintptr_t base, size_t n, off_t off, off_t boff) {
	return ((ssize_t (*)(void *, void *, size_t, off_t, off_t))f)((void *)h, (void *)base, n, off, boff);
}
static ssize_t kv_write(void *f, uintptr_t h, uintptr_t base, size_t n, off_t off, off_t boff) {
	return ((ssize_t (*)(void *, const void *, size_t, off_t, off_t))f)((void *)h, (const void *)base, n, off, boff);
}
*/
import "C"

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/kvhost/kvhost/internal/dl"
)

// cgoLib is libcufile opened with dlopen, every required symbol resolved.
type cgoLib struct {
	lib *dl.Library

	driverOpenFn, driverCloseFn  unsafe.Pointer
	handleRegFn, handleDeregFn   unsafe.Pointer
	bufRegFn, bufDeregFn         unsafe.Pointer
	readFn, writeFn              unsafe.Pointer
	propsFn, versionFn           unsafe.Pointer // optional
	batchSetUp, batchSubmit      unsafe.Pointer // optional
	batchGetStatus, batchDestroy unsafe.Pointer // optional
}

// loadAPI opens the first of paths that loads and resolves its symbols. A
// missing required symbol fails here, not at the first call.
func loadAPI(paths []string) (api, error) {
	lib, err := dl.Open(paths...)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	l := &cgoLib{lib: lib}
	required := []struct {
		p     *unsafe.Pointer
		names []string
	}{
		{&l.driverOpenFn, []string{"cuFileDriverOpen"}},
		// cufile.h maps cuFileDriverClose to _v2 where it exists.
		{&l.driverCloseFn, []string{"cuFileDriverClose_v2", "cuFileDriverClose"}},
		{&l.handleRegFn, []string{"cuFileHandleRegister"}},
		{&l.handleDeregFn, []string{"cuFileHandleDeregister"}},
		{&l.bufRegFn, []string{"cuFileBufRegister"}},
		{&l.bufDeregFn, []string{"cuFileBufDeregister"}},
		{&l.readFn, []string{"cuFileRead"}},
		{&l.writeFn, []string{"cuFileWrite"}},
	}
	for _, r := range required {
		var errs []error
		for _, n := range r.names {
			p, err := lib.Sym(n)
			if err == nil {
				*r.p = p
				break
			}
			errs = append(errs, err)
		}
		if *r.p == nil {
			lib.Close()
			return nil, fmt.Errorf("%w: %w", ErrUnavailable, errors.Join(errs...))
		}
	}
	optional := []struct {
		p    *unsafe.Pointer
		name string
	}{
		{&l.propsFn, "cuFileDriverGetProperties"},
		{&l.versionFn, "cuFileGetVersion"},
		{&l.batchSetUp, "cuFileBatchIOSetUp"},
		{&l.batchSubmit, "cuFileBatchIOSubmit"},
		{&l.batchGetStatus, "cuFileBatchIOGetStatus"},
		{&l.batchDestroy, "cuFileBatchIODestroy"},
	}
	for _, o := range optional {
		if p, err := lib.Sym(o.name); err == nil {
			*o.p = p
		}
	}
	return l, nil
}

func (l *cgoLib) path() string { return l.lib.Path() }

func (l *cgoLib) driverOpen() error {
	var code, cu C.int
	C.kv_call_void_err(l.driverOpenFn, &code, &cu)
	return statusError(int(code), int(cu))
}

func (l *cgoLib) driverClose() error {
	var code, cu C.int
	C.kv_call_void_err(l.driverCloseFn, &code, &cu)
	return statusError(int(code), int(cu))
}

func (l *cgoLib) properties() (rawProps, bool, error) {
	if l.propsFn == nil {
		return rawProps{}, false, nil
	}
	var p C.kv_cufile_props
	var code, cu C.int
	C.kv_get_props(l.propsFn, &p, &code, &cu)
	if err := statusError(int(code), int(cu)); err != nil {
		return rawProps{}, true, err
	}
	return rawProps{
		nvfsMajor:              uint32(p.nvfs.major_version),
		nvfsMinor:              uint32(p.nvfs.minor_version),
		pollThreshKiB:          uint64(p.nvfs.poll_thresh_size),
		maxDirectIOKiB:         uint64(p.nvfs.max_direct_io_size),
		statusFlags:            uint32(p.nvfs.dstatusflags),
		controlFlags:           uint32(p.nvfs.dcontrolflags),
		featureFlags:           uint32(p.fflags),
		maxDeviceCacheKiB:      uint32(p.max_device_cache_size),
		perBufferCacheKiB:      uint32(p.per_buffer_cache_size),
		maxDevicePinnedKiB:     uint32(p.max_device_pinned_mem_size),
		maxBatchIOSize:         uint32(p.max_batch_io_size),
		maxBatchIOTimeoutMsecs: uint32(p.max_batch_io_timeout_msecs),
	}, true, nil
}

func (l *cgoLib) version() (int, bool, error) {
	if l.versionFn == nil {
		return 0, false, nil
	}
	var v, code, cu C.int
	C.kv_get_version(l.versionFn, &v, &code, &cu)
	return int(v), true, statusError(int(code), int(cu))
}

func (l *cgoLib) handleRegister(fd int) (uintptr, error) {
	var code, cu C.int
	h := C.kv_handle_register(l.handleRegFn, C.int(fd), &code, &cu)
	if err := statusError(int(code), int(cu)); err != nil {
		return 0, err
	}
	return uintptr(h), nil
}

func (l *cgoLib) handleDeregister(h uintptr) { C.kv_handle_deregister(l.handleDeregFn, C.uintptr_t(h)) }

func (l *cgoLib) bufRegister(ptr uintptr, size int64, flags int) error {
	var code, cu C.int
	C.kv_buf_register(l.bufRegFn, C.uintptr_t(ptr), C.size_t(size), C.int(flags), &code, &cu)
	return statusError(int(code), int(cu))
}

func (l *cgoLib) bufDeregister(ptr uintptr) error {
	var code, cu C.int
	C.kv_buf_deregister(l.bufDeregFn, C.uintptr_t(ptr), &code, &cu)
	return statusError(int(code), int(cu))
}

func (l *cgoLib) read(h, base uintptr, size, off, bufOff int64) (int64, error) {
	n, errno := C.kv_read(l.readFn, C.uintptr_t(h), C.uintptr_t(base), C.size_t(size), C.off_t(off), C.off_t(bufOff))
	if n < 0 {
		return 0, ioError(int64(n), errno)
	}
	return int64(n), nil
}

func (l *cgoLib) write(h, base uintptr, size, off, bufOff int64) (int64, error) {
	n, errno := C.kv_write(l.writeFn, C.uintptr_t(h), C.uintptr_t(base), C.size_t(size), C.off_t(off), C.off_t(bufOff))
	if n < 0 {
		return 0, ioError(int64(n), errno)
	}
	return int64(n), nil
}

func (l *cgoLib) hasBatch() bool {
	return l.batchSetUp != nil && l.batchSubmit != nil && l.batchGetStatus != nil && l.batchDestroy != nil
}

func (l *cgoLib) unload() error { return l.lib.Close() }
