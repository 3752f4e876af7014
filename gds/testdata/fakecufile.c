/* A fake libcufile for gds's CPU tests, built with `go env CC` at test
 * time. It exports the cuFile symbols gds resolves and implements them
 * over pread/pwrite: a "device pointer" is a host pointer. Tests steer it
 * and read its counters through the exported struct fake_ctl (found with
 * dlsym), whose int64 fields are read and written atomically on both sides.
 *
 * Build with -DFAKE_NO_READ to leave out cuFileRead (a library missing a
 * required symbol). */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

typedef struct { int err; int cu_err; } CUfileError_t;

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
} CUfileDrvProps_t;

typedef struct {
	int type;
	union { int fd; void *handle; } handle;
	const void *fs_ops;
} CUfileDescr_t;

/* Field order is mirrored by fakeCtl in the Go tests. */
struct fake_ctl {
	/* knobs */
	int64_t driver_open_error;  /* nonzero: cuFileDriverOpen fails with it */
	int64_t register_error;     /* nonzero: cuFileHandleRegister fails with it */
	int64_t register_fail_dev;  /* nonzero: only files on this st_dev fail */
	int64_t read_fail_after;    /* >0: a read fails once this many bytes were read in all */
	int64_t read_fail_code;     /* the failing read's return: -code (5030) or -1 with EIO */
	int64_t read_truncate_at;   /* >0: reads see the file end here (short reads) */
	int64_t write_fail_after;   /* >0: a write fails once this many bytes were written */
	int64_t write_short;        /* nonzero: each write moves at most half (at least 1) */
	int64_t no_compat;          /* nonzero: properties say compat mode is not allowed */
	/* counters */
	int64_t driver_opens;
	int64_t driver_closes;
	int64_t handles_registered;
	int64_t handles_deregistered;
	int64_t handles_live;
	int64_t bad_handle_uses;    /* I/O or deregistration on a dead handle */
	int64_t bufs_live;
	int64_t bytes_read;
	int64_t bytes_written;
	int64_t reads;
	int64_t writes;
	int64_t register_calls;
};

struct fake_ctl fake_ctl;

#define LD(f) __atomic_load_n(&fake_ctl.f, __ATOMIC_SEQ_CST)
#define ADD(f, n) __atomic_add_fetch(&fake_ctl.f, (n), __ATOMIC_SEQ_CST)

#define MAGIC_LIVE 0x6b76686f7374ULL
#define MAGIC_DEAD 0xdeadULL

struct fake_handle {
	uint64_t magic;
	int fd;
};

static CUfileError_t ok(void) { CUfileError_t e = {0, 0}; return e; }
static CUfileError_t fail(int code) { CUfileError_t e = {code, 0}; return e; }

CUfileError_t cuFileDriverOpen(void) {
	int64_t e = LD(driver_open_error);
	if (e) return fail((int)e);
	ADD(driver_opens, 1);
	return ok();
}

CUfileError_t cuFileDriverClose_v2(void) { ADD(driver_closes, 1); return ok(); }
CUfileError_t cuFileDriverClose(void) { return cuFileDriverClose_v2(); }

CUfileError_t cuFileGetVersion(int *v) { *v = 1151; return ok(); }

CUfileError_t cuFileDriverGetProperties(CUfileDrvProps_t *p) {
	*p = (CUfileDrvProps_t){0};
	p->nvfs.max_direct_io_size = 16384;
	p->nvfs.dcontrolflags = LD(no_compat) ? 0 : (1u << 1);
	p->max_batch_io_size = 128;
	return ok();
}

CUfileError_t cuFileHandleRegister(void **fh, CUfileDescr_t *d) {
	ADD(register_calls, 1);
	if (d == NULL || d->type != 1) return fail(5022);
	int64_t e = LD(register_error);
	if (e) {
		int64_t dev = LD(register_fail_dev);
		struct stat st;
		if (dev == 0 || (fstat(d->handle.fd, &st) == 0 && (int64_t)st.st_dev == dev)) return fail((int)e);
	}
	struct fake_handle *h = malloc(sizeof *h);
	if (!h) return fail(5043);
	h->magic = MAGIC_LIVE;
	h->fd = d->handle.fd;
	*fh = h;
	ADD(handles_registered, 1);
	ADD(handles_live, 1);
	return ok();
}

static int live(void *fh) {
	struct fake_handle *h = fh;
	if (h == NULL || __atomic_load_n(&h->magic, __ATOMIC_SEQ_CST) != MAGIC_LIVE) {
		ADD(bad_handle_uses, 1);
		return 0;
	}
	return 1;
}

/* Deregistered handles are marked dead, never freed, so that a later use
 * is counted instead of touching freed memory. */
void cuFileHandleDeregister(void *fh) {
	if (!live(fh)) return;
	__atomic_store_n(&((struct fake_handle *)fh)->magic, MAGIC_DEAD, __ATOMIC_SEQ_CST);
	ADD(handles_deregistered, 1);
	ADD(handles_live, -1);
}

#define MAXBUF 256
static struct { const void *p; size_t n; } bufs[MAXBUF];
static pthread_mutex_t bufmu = PTHREAD_MUTEX_INITIALIZER;

CUfileError_t cuFileBufRegister(const void *p, size_t n, int flags) {
	(void)flags;
	CUfileError_t r = fail(5043);
	pthread_mutex_lock(&bufmu);
	for (int i = 0; i < MAXBUF; i++)
		if (bufs[i].p == p) { r = fail(5023); goto out; }
	for (int i = 0; i < MAXBUF; i++)
		if (bufs[i].p == NULL) { bufs[i].p = p; bufs[i].n = n; ADD(bufs_live, 1); r = ok(); break; }
out:
	pthread_mutex_unlock(&bufmu);
	return r;
}

CUfileError_t cuFileBufDeregister(const void *p) {
	CUfileError_t r = fail(5024);
	pthread_mutex_lock(&bufmu);
	for (int i = 0; i < MAXBUF; i++)
		if (bufs[i].p == p) { bufs[i].p = NULL; ADD(bufs_live, -1); r = ok(); break; }
	pthread_mutex_unlock(&bufmu);
	return r;
}

#ifndef FAKE_NO_READ
ssize_t cuFileRead(void *fh, void *base, size_t n, off_t off, off_t boff) {
	if (!live(fh)) return -5027;
	ADD(reads, 1);
	int64_t trunc = LD(read_truncate_at);
	if (trunc > 0) {
		if (off >= trunc) return 0;
		if ((int64_t)(off + n) > trunc) n = (size_t)(trunc - off);
	}
	int64_t after = LD(read_fail_after);
	if (after > 0 && LD(bytes_read) + (int64_t)n > after) {
		int64_t code = LD(read_fail_code);
		if (code == -1) { errno = EIO; return -1; }
		return -(ssize_t)code;
	}
	ssize_t r = pread(((struct fake_handle *)fh)->fd, (char *)base + boff, n, off);
	if (r > 0) ADD(bytes_read, r);
	return r;
}
#endif

ssize_t cuFileWrite(void *fh, const void *base, size_t n, off_t off, off_t boff) {
	if (!live(fh)) return -5027;
	ADD(writes, 1);
	if (LD(write_short) && n > 1) n /= 2;
	int64_t after = LD(write_fail_after);
	if (after > 0 && LD(bytes_written) + (int64_t)n > after) return -5044;
	ssize_t r = pwrite(((struct fake_handle *)fh)->fd, (const char *)base + boff, n, off);
	if (r > 0) ADD(bytes_written, r);
	return r;
}
