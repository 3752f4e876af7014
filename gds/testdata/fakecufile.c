/* A fake libcufile for gds's CPU tests, built with `go env CC` at test
 * time. It exports the cuFile symbols gds resolves and implements them
 * over pread/pwrite: a "device pointer" is a host pointer. Tests steer it
 * and read its counters through the exported struct fake_ctl (found with
 * dlsym), whose int64 fields are read and written atomically on both sides.
 *
 * The batch API (cuFileBatchIO*) runs each entry with pread/pwrite when it
 * is submitted (unless told to hold entries pending) and reports events in
 * reverse order, so that a caller must match them by cookie.
 *
 * Build with -DFAKE_NO_READ to leave out cuFileRead (a library missing a
 * required symbol), -DFAKE_NO_BATCH to leave out the batch API. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
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
	int64_t bytes_read;
	int64_t bytes_written;
	int64_t reads;
	int64_t writes;
	int64_t register_calls;
	/* batch knobs */
	int64_t batch_setup_error;  /* nonzero: cuFileBatchIOSetUp fails with it (5049: compat mode) */
	int64_t batch_submit_error; /* nonzero: cuFileBatchIOSubmit fails with it */
	int64_t batch_fail_entry;   /* >0: the entry of this ordinal (1-based, over all entries) fails */
	int64_t batch_fail_code;    /* its ret: -code (a status or an errno) */
	int64_t batch_short_entry;  /* >0: the entry of this ordinal moves half its bytes */
	int64_t batch_hold;         /* nonzero: entries stay pending until canceled */
	/* batch counters */
	int64_t batch_setups;
	int64_t batch_destroys;
	int64_t batch_live;
	int64_t batch_submits;
	int64_t batch_entries;
	int64_t batch_cancels;
	int64_t batch_pending;      /* entries held pending now */
	int64_t batch_bad_uses;     /* a dead context, a malformed entry, a submit over capacity */
	int64_t batch_max_entries;  /* the largest submission seen */
	int64_t batch_inflight;     /* entries submitted and not yet reaped, over all contexts */
	int64_t batch_inflight_max; /* the most ever in flight */
	int64_t batch_cancel_ignored; /* nonzero: cuFileBatchIOCancel succeeds but cancels nothing */
	/* the CUresult (cu_err) the injected failures above carry: driver_open_error,
	 * register_error, batch_setup_error, batch_submit_error */
	int64_t cu_error;
	/* nonzero: cuFileBatchIOGetStatus runs the entries held pending (by
	 * batch_hold, and not canceled) before it reports: a late completion,
	 * whose I/O still reaches the entry's memory and file through its handle */
	int64_t batch_release;
	/* lifetime counters: calls into the library after cuFileDriverClose
	 * (until the next cuFileDriverOpen), and the handles still registered
	 * when the driver was closed */
	int64_t calls_after_close;
	int64_t handles_live_at_close;
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

/* closed: cuFileDriverClose was called; a call after it counts in
 * calls_after_close (late: the caller could be past dlclose). */
static int64_t closed;
#define LATE() do { if (__atomic_load_n(&closed, __ATOMIC_SEQ_CST)) ADD(calls_after_close, 1); } while (0)

static CUfileError_t ok(void) { CUfileError_t e = {0, 0}; return e; }
static CUfileError_t fail(int code) { CUfileError_t e = {code, 0}; return e; }
/* injected is a knob's failure: code, with the CUresult cu_error (as cuFile
 * reports a CUDA driver call that failed inside it, with 5011). */
static CUfileError_t injected(int64_t code) { CUfileError_t e = {(int)code, (int)LD(cu_error)}; return e; }

CUfileError_t cuFileDriverOpen(void) {
	int64_t e = LD(driver_open_error);
	if (e) return injected(e);
	ADD(driver_opens, 1);
	__atomic_store_n(&closed, 0, __ATOMIC_SEQ_CST);
	return ok();
}

CUfileError_t cuFileDriverClose_v2(void) {
	LATE();
	__atomic_store_n(&fake_ctl.handles_live_at_close, LD(handles_live), __ATOMIC_SEQ_CST);
	__atomic_store_n(&closed, 1, __ATOMIC_SEQ_CST);
	ADD(driver_closes, 1);
	return ok();
}
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
	LATE();
	ADD(register_calls, 1);
	if (d == NULL || d->type != 1) return fail(5022);
	int64_t e = LD(register_error);
	if (e) {
		int64_t dev = LD(register_fail_dev);
		struct stat st;
		if (dev == 0 || (fstat(d->handle.fd, &st) == 0 && (int64_t)st.st_dev == dev)) return injected(e);
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
	LATE();
	if (!live(fh)) return;
	__atomic_store_n(&((struct fake_handle *)fh)->magic, MAGIC_DEAD, __ATOMIC_SEQ_CST);
	ADD(handles_deregistered, 1);
	ADD(handles_live, -1);
}

#ifndef FAKE_NO_READ
ssize_t cuFileRead(void *fh, void *base, size_t n, off_t off, off_t boff) {
	LATE();
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
	LATE();
	if (!live(fh)) return -5027;
	ADD(writes, 1);
	if (LD(write_short) && n > 1) n /= 2;
	int64_t after = LD(write_fail_after);
	if (after > 0 && LD(bytes_written) + (int64_t)n > after) return -5044;
	ssize_t r = pwrite(((struct fake_handle *)fh)->fd, (const char *)base + boff, n, off);
	if (r > 0) ADD(bytes_written, r);
	return r;
}

#ifndef FAKE_NO_BATCH
typedef struct {
	int mode; /* CUFILE_BATCH = 1 */
	union {
		struct {
			void *devPtr_base;
			off_t file_offset;
			off_t devPtr_offset;
			size_t size;
		} batch;
	} u;
	void *fh;
	int opcode; /* CUFILE_READ 0, CUFILE_WRITE 1 */
	void *cookie;
} CUfileIOParams_t;

typedef struct {
	void *cookie;
	int status;
	size_t ret;
} CUfileIOEvents_t;

enum { ST_PENDING = 2, ST_CANCELED = 8, ST_COMPLETE = 16, ST_FAILED = 64 };

struct fake_entry {
	void *cookie;
	int status;
	ssize_t ret;
	int reaped;
	CUfileIOParams_t p; /* kept while held pending, for batch_release */
	int64_t ordinal;
};

struct fake_batch {
	uint64_t magic;
	unsigned max, n;
	struct fake_entry e[];
};

static int batch_live_ctx(void *b) {
	struct fake_batch *fb = b;
	if (fb == NULL || fb->magic != MAGIC_LIVE) {
		ADD(batch_bad_uses, 1);
		return 0;
	}
	return 1;
}

/* store_max raises *p to v if v is larger. */
static void store_max(int64_t *p, int64_t v) {
	int64_t cur;
	while ((cur = __atomic_load_n(p, __ATOMIC_SEQ_CST)) < v &&
	       !__atomic_compare_exchange_n(p, &cur, v, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
	}
}

CUfileError_t cuFileBatchIOSetUp(void **b, unsigned nr) {
	LATE();
	int64_t e = LD(batch_setup_error);
	if (e) return injected(e);
	if (b == NULL || nr == 0 || nr > 128) return fail(5022);
	struct fake_batch *fb = calloc(1, sizeof *fb + nr * sizeof(struct fake_entry));
	if (!fb) return fail(5043);
	fb->magic = MAGIC_LIVE;
	fb->max = nr;
	*b = fb;
	ADD(batch_setups, 1);
	ADD(batch_live, 1);
	return ok();
}

/* run performs one entry now: pread or pwrite, honoring read_truncate_at
 * and the batch failure knobs. */
static void run(struct fake_entry *en, const CUfileIOParams_t *p, int64_t ordinal) {
	struct fake_handle *h = p->fh;
	if (!live(h)) { /* deregistered while the entry was held: counted */
		en->status = ST_FAILED;
		en->ret = -5027;
		return;
	}
	size_t n = p->u.batch.size;
	off_t off = p->u.batch.file_offset;
	char *mem = (char *)p->u.batch.devPtr_base + p->u.batch.devPtr_offset;
	if (ordinal == LD(batch_fail_entry)) {
		en->status = ST_FAILED;
		en->ret = -(ssize_t)LD(batch_fail_code);
		return;
	}
	if (ordinal == LD(batch_short_entry) && n > 1) n /= 2;
	ssize_t r;
	if (p->opcode == 1) {
		r = pwrite(h->fd, mem, n, off);
		if (r > 0) ADD(bytes_written, r);
	} else {
		int64_t trunc = LD(read_truncate_at);
		if (trunc > 0) {
			if (off >= trunc) n = 0;
			else if ((int64_t)(off + n) > trunc) n = (size_t)(trunc - off);
		}
		r = n ? pread(h->fd, mem, n, off) : 0;
		if (r > 0) ADD(bytes_read, r);
	}
	en->status = r < 0 ? ST_FAILED : ST_COMPLETE;
	en->ret = r < 0 ? -errno : r;
}

CUfileError_t cuFileBatchIOSubmit(void *b, unsigned nr, CUfileIOParams_t *p, unsigned flags) {
	LATE();
	if (!batch_live_ctx(b)) return fail(5022);
	struct fake_batch *fb = b;
	int64_t e = LD(batch_submit_error);
	if (e) return injected(e);
	for (unsigned i = 0; i < fb->n; i++)
		if (!fb->e[i].reaped) { ADD(batch_bad_uses, 1); return fail(5037); }
	if (nr == 0 || nr > fb->max || flags != 0 || p == NULL) { ADD(batch_bad_uses, 1); return fail(5022); }
	for (unsigned i = 0; i < nr; i++) {
		if (p[i].mode != 1 || (p[i].opcode != 0 && p[i].opcode != 1) || !live(p[i].fh)) {
			ADD(batch_bad_uses, 1);
			return fail(5022);
		}
	}
	ADD(batch_submits, 1);
	store_max(&fake_ctl.batch_max_entries, nr);
	store_max(&fake_ctl.batch_inflight_max, ADD(batch_inflight, nr));
	fb->n = nr;
	for (unsigned i = 0; i < nr; i++) {
		struct fake_entry *en = &fb->e[i];
		*en = (struct fake_entry){.cookie = p[i].cookie};
		int64_t ordinal = ADD(batch_entries, 1);
		if (LD(batch_hold)) {
			en->status = ST_PENDING;
			en->p = p[i];
			en->ordinal = ordinal;
			ADD(batch_pending, 1);
			continue;
		}
		run(en, &p[i], ordinal);
	}
	return ok();
}

CUfileError_t cuFileBatchIOGetStatus(void *b, unsigned min_nr, unsigned *nr, CUfileIOEvents_t *ev, struct timespec *timeout) {
	LATE();
	if (!batch_live_ctx(b)) return fail(5022);
	struct fake_batch *fb = b;
	if (nr == NULL || ev == NULL || *nr < min_nr) { ADD(batch_bad_uses, 1); return fail(5022); }
	unsigned got = 0;
	if (LD(batch_release)) {
		for (unsigned i = 0; i < fb->n; i++) {
			struct fake_entry *en = &fb->e[i];
			if (en->status != ST_PENDING) continue;
			run(en, &en->p, en->ordinal);
			ADD(batch_pending, -1);
		}
	}
	for (unsigned k = fb->n; k > 0 && got < *nr; k--) { /* reverse order */
		struct fake_entry *en = &fb->e[k - 1];
		if (en->reaped || en->status == ST_PENDING) continue;
		ev[got].cookie = en->cookie;
		ev[got].status = en->status;
		ev[got].ret = (size_t)en->ret;
		en->reaped = 1;
		ADD(batch_inflight, -1);
		got++;
	}
	if (got < min_nr && timeout != NULL) nanosleep(timeout, NULL);
	*nr = got;
	return ok();
}

CUfileError_t cuFileBatchIOCancel(void *b) {
	LATE();
	if (!batch_live_ctx(b)) return fail(5022);
	struct fake_batch *fb = b;
	ADD(batch_cancels, 1);
	if (LD(batch_cancel_ignored)) return ok();
	for (unsigned i = 0; i < fb->n; i++) {
		if (fb->e[i].status == ST_PENDING) {
			fb->e[i].status = ST_CANCELED;
			fb->e[i].ret = 0;
			ADD(batch_pending, -1);
		}
	}
	return ok();
}

/* Destroyed contexts are marked dead, never freed (see handles). */
void cuFileBatchIODestroy(void *b) {
	LATE();
	if (!batch_live_ctx(b)) return;
	struct fake_batch *fb = b;
	for (unsigned i = 0; i < fb->n; i++) {
		if (fb->e[i].status == ST_PENDING) ADD(batch_pending, -1);
		if (!fb->e[i].reaped) ADD(batch_inflight, -1);
	}
	fb->magic = MAGIC_DEAD;
	ADD(batch_destroys, 1);
	ADD(batch_live, -1);
}
#endif
