//go:build linux && cgo

package gds

/*
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/types.h>
#include <time.h>

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

// CUfileIOParams_t: mode first (CUFILE_BATCH = 1), then the batch union,
// the file handle, the opcode (CUFILE_READ = 0, CUFILE_WRITE = 1) and the
// caller's cookie.
typedef struct {
	int mode;
	union {
		struct {
			void *devPtr_base;
			off_t file_offset;
			off_t devPtr_offset;
			size_t size;
		} batch;
	} u;
	void *fh;
	int opcode;
	void *cookie;
} kv_io_params;

// CUfileIOEvents_t: ret is the bytes moved or a negative error.
typedef struct {
	void *cookie;
	int status;
	size_t ret;
} kv_io_event;

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
static ssize_t kv_read(void *f, uintptr_t h, uintptr_t base, size_t n, off_t off, off_t boff) {
	return ((ssize_t (*)(void *, void *, size_t, off_t, off_t))f)((void *)h, (void *)base, n, off, boff);
}
static ssize_t kv_write(void *f, uintptr_t h, uintptr_t base, size_t n, off_t off, off_t boff) {
	return ((ssize_t (*)(void *, const void *, size_t, off_t, off_t))f)((void *)h, (const void *)base, n, off, boff);
}
static uintptr_t kv_batch_setup(void *f, unsigned nr, int *code, int *cu) {
	void *b = NULL;
	kv_err(((kv_cufile_error (*)(void **, unsigned))f)(&b, nr), code, cu);
	return (uintptr_t)b;
}
static void kv_batch_fill(kv_io_params *p, unsigned i, uintptr_t fh, uintptr_t base, off_t boff, off_t off,
		size_t n, int write, uintptr_t cookie) {
	kv_io_params *e = &p[i];
	e->mode = 1;
	e->u.batch.devPtr_base = (void *)base;
	e->u.batch.file_offset = off;
	e->u.batch.devPtr_offset = boff;
	e->u.batch.size = n;
	e->fh = (void *)fh;
	e->opcode = write ? 1 : 0;
	e->cookie = (void *)cookie;
}
static void kv_batch_submit(void *f, uintptr_t b, unsigned nr, kv_io_params *p, int *code, int *cu) {
	kv_err(((kv_cufile_error (*)(void *, unsigned, kv_io_params *, unsigned))f)((void *)b, nr, p, 0), code, cu);
}
static unsigned kv_batch_status(void *f, uintptr_t b, unsigned min_nr, unsigned max_nr, kv_io_event *ev,
		long long ns, int *code, int *cu) {
	unsigned nr = max_nr;
	struct timespec ts;
	ts.tv_sec = ns / 1000000000LL;
	ts.tv_nsec = ns % 1000000000LL;
	kv_err(((kv_cufile_error (*)(void *, unsigned, unsigned *, kv_io_event *, struct timespec *))f)(
		(void *)b, min_nr, &nr, ev, &ts), code, cu);
	return nr;
}
static void kv_batch_event(kv_io_event *ev, unsigned i, uintptr_t *cookie, int *status, long long *ret) {
	*cookie = (uintptr_t)ev[i].cookie;
	*status = ev[i].status;
	*ret = (long long)(ssize_t)ev[i].ret;
}
static void kv_batch_cancel(void *f, uintptr_t b, int *code, int *cu) {
	kv_err(((kv_cufile_error (*)(void *))f)((void *)b), code, cu);
}
static void kv_batch_destroy(void *f, uintptr_t b) { ((void (*)(void *))f)((void *)b); }

*/
import "C"

import (
	"errors"
	"fmt"
	"time"
	"unsafe"

	"github.com/kvhost/kvhost/internal/dl"
)

// cgoLib is libcufile opened with dlopen, every required symbol resolved.
type cgoLib struct {
	lib *dl.Library

	driverOpenFn, driverCloseFn  unsafe.Pointer
	handleRegFn, handleDeregFn   unsafe.Pointer
	readFn, writeFn              unsafe.Pointer
	propsFn, versionFn           unsafe.Pointer // optional
	batchSetUpFn, batchSubmit    unsafe.Pointer // optional
	batchGetStatus, batchDestroy unsafe.Pointer // optional
	batchCancel                  unsafe.Pointer // optional
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
		{&l.batchSetUpFn, "cuFileBatchIOSetUp"},
		{&l.batchSubmit, "cuFileBatchIOSubmit"},
		{&l.batchGetStatus, "cuFileBatchIOGetStatus"},
		{&l.batchDestroy, "cuFileBatchIODestroy"},
		{&l.batchCancel, "cuFileBatchIOCancel"},
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
	return l.batchSetUpFn != nil && l.batchSubmit != nil && l.batchGetStatus != nil &&
		l.batchDestroy != nil && l.batchCancel != nil
}

// cgoBatch is a batch context with its entries and events in C memory:
// the library may read a submitted entry until it completes, so the
// entries must not move and must outlive the submission.
type cgoBatch struct {
	l      *cgoLib
	h      C.uintptr_t
	max    int
	params *C.kv_io_params
	events *C.kv_io_event
}

func (l *cgoLib) batchSetUp(maxNr int) (batchCtx, error) {
	if !l.hasBatch() {
		return nil, fmt.Errorf("%w: no batch API in %s", ErrUnavailable, l.path())
	}
	if maxNr <= 0 {
		return nil, fmt.Errorf("gds: batch of %d entries", maxNr)
	}
	var code, cu C.int
	h := C.kv_batch_setup(l.batchSetUpFn, C.unsigned(maxNr), &code, &cu)
	if err := statusError(int(code), int(cu)); err != nil {
		return nil, err
	}
	// cgo panics when C.malloc fails but not when C.calloc does: a NULL
	// here would be written through at the first submit.
	params := (*C.kv_io_params)(C.calloc(C.size_t(maxNr), C.size_t(unsafe.Sizeof(C.kv_io_params{}))))
	events := (*C.kv_io_event)(C.calloc(C.size_t(maxNr), C.size_t(unsafe.Sizeof(C.kv_io_event{}))))
	if params == nil || events == nil {
		C.free(unsafe.Pointer(params))
		C.free(unsafe.Pointer(events))
		C.kv_batch_destroy(l.batchDestroy, h)
		return nil, fmt.Errorf("gds: batch of %d entries: out of memory", maxNr)
	}
	return &cgoBatch{l: l, h: h, max: maxNr, params: params, events: events}, nil
}

func (b *cgoBatch) submit(ios []batchIO) error {
	if len(ios) == 0 || len(ios) > b.max {
		return fmt.Errorf("gds: batch of %d entries, context holds %d", len(ios), b.max)
	}
	for i, io := range ios {
		w := C.int(0)
		if io.write {
			w = 1
		}
		C.kv_batch_fill(b.params, C.unsigned(i), C.uintptr_t(io.h), C.uintptr_t(io.base), C.off_t(io.bufOff),
			C.off_t(io.fileOff), C.size_t(io.n), w, C.uintptr_t(io.cookie))
	}
	var code, cu C.int
	C.kv_batch_submit(b.l.batchSubmit, b.h, C.unsigned(len(ios)), b.params, &code, &cu)
	return statusError(int(code), int(cu))
}

func (b *cgoBatch) status(minNr int, ev []batchEvent, timeout time.Duration) (int, error) {
	maxNr := min(len(ev), b.max)
	var code, cu C.int
	n := int(C.kv_batch_status(b.l.batchGetStatus, b.h, C.unsigned(minNr), C.unsigned(maxNr), b.events,
		C.longlong(timeout.Nanoseconds()), &code, &cu))
	if err := statusError(int(code), int(cu)); err != nil {
		return 0, err
	}
	if n > maxNr {
		return 0, fmt.Errorf("gds: cuFileBatchIOGetStatus returned %d events, room for %d", n, maxNr)
	}
	for i := range n {
		var cookie C.uintptr_t
		var st C.int
		var ret C.longlong
		C.kv_batch_event(b.events, C.unsigned(i), &cookie, &st, &ret)
		ev[i] = batchEvent{cookie: uintptr(cookie), status: batchStatus(st), ret: int64(ret)}
	}
	return n, nil
}

func (b *cgoBatch) cancel() error {
	var code, cu C.int
	C.kv_batch_cancel(b.l.batchCancel, b.h, &code, &cu)
	return statusError(int(code), int(cu))
}

func (b *cgoBatch) destroy() {
	if b.params == nil {
		return
	}
	C.kv_batch_destroy(b.l.batchDestroy, b.h)
	C.free(unsafe.Pointer(b.params))
	C.free(unsafe.Pointer(b.events))
	b.params, b.events = nil, nil
}

func (l *cgoLib) unload() error { return l.lib.Close() }
