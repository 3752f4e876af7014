// A fake CUDA runtime and driver API for CPU tests: "device memory" is host
// memory, copies are memcpy, run when their stream is synchronized (so a
// caller that reads a buffer before waiting sees stale bytes), IPC handles
// carry a magic and a pointer checked against a registry of live
// allocations. An allocation freed while imported stays mapped for its
// importers until the last cudaIpcCloseMemHandle, as the driver keeps it
// (on an H100, store and load jobs on memory its owner freed mid-job
// completed), but no new import or export finds it.
// fake_set_fault fails the Nth operation of a kind; fake_set_peer_access
// makes an import of another device's allocation succeed, as the driver
// does over peer access (NVLink; it then reports the memory as the
// importing device's), where by default it fails (no peer access);
// fake_set_busy makes cudaEventQuery answer "not ready" a number of times
// after each record before it runs the event's copies; fake_break_device
// makes every later call on a device fail with one code, as a context
// broken by a sticky error does; fake_unload marks the library unloaded,
// as a dlclose would, and counts the calls made into it after;
// fake_contexts reports on which devices a primary context was made and
// fake_thread which one is current on the calling thread;
// fake_registrations counts the live host registrations
// (cudaHostRegister not yet undone).
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum {
	errSuccess = 0,
	errInvalidValue = 1,
	errMemoryAllocation = 2,
	errInvalidDevice = 101,
	errInvalidResourceHandle = 400,
	errIllegalAddress = 700,
	errLaunchFailure = 719,
	errMapBufferObjectFailed = 205,
	errNotReady = 600,
	errHostMemoryAlreadyRegistered = 712,
	errHostMemoryNotRegistered = 713,
};

// Kinds of operation, for faults and counters.
enum { opCopy, opSync, opIpcOpen, opHostAlloc, opHostRegister, opBatch, opSegCall, opRecord, opLaunch, opModuleLoad, opModuleUnload, opQuery, opAddressRange, opIpcClose, opHostUnregister, nOps };

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static long counts[nOps];
static long faultAt[nOps]; // fail when counts reaches this (1-based); 0: none
static int faultCode[nOps];
static __thread int curDevice;
// curCtx is the calling thread's current context: 0 none (a new thread's
// state, whatever cudaGetDevice answers), else its device + 1. made is the
// devices whose primary context was made (bit d), as cudaSetDevice does
// since CUDA 12, taking GPU memory there; ctxs stand for those contexts.
static __thread int curCtx;
static long made;
static char ctxs[8];
static int numDevices = 2;
static int peerAccess;
static long busyQueries; // "not ready" answers per event record
// fake_set_busy makes every event answer n queries "not ready" after each
// record (n < 0: always) before a query runs its copies and answers.
void fake_set_busy(long n) {
	pthread_mutex_lock(&mu);
	busyQueries = n;
	pthread_mutex_unlock(&mu);
}

// fake_set_peer_access turns on (1) or off (0) imports across devices.
void fake_set_peer_access(int on) {
	pthread_mutex_lock(&mu);
	peerAccess = on;
	pthread_mutex_unlock(&mu);
}

// fake_set_fault makes the nth next operation of kind op (counted from now)
// fail with code; n <= 0 clears it.
void fake_set_fault(int op, long n, int code) {
	pthread_mutex_lock(&mu);
	faultAt[op] = n > 0 ? counts[op] + n : 0;
	faultCode[op] = code;
	pthread_mutex_unlock(&mu);
}

// broken is, per device, the error every later call there returns (0:
// none), as a real context does after a sticky error (an illegal
// address, a GPU lost): fake_break_device.
#define maxDevices 8
static int broken[maxDevices];

// fake_break_device makes every later call on device d fail with code
// (0 mends it, which a real context never is).
void fake_break_device(int d, int code) {
	pthread_mutex_lock(&mu);
	if (d >= 0 && d < maxDevices) broken[d] = code;
	pthread_mutex_unlock(&mu);
}

// sticky is device d's broken code, or 0.
static int sticky(int d) {
	pthread_mutex_lock(&mu);
	int code = d >= 0 && d < maxDevices ? broken[d] : 0;
	pthread_mutex_unlock(&mu);
	return code;
}
#define STICKY(d) do { int c_ = sticky(d); if (c_) return c_; } while (0)

// unloaded is set while the library stands for one its user unloaded
// (fake_unload); callsAfterUnload counts the calls into it since, each
// of which would jump into unmapped code.
static int unloaded;
static long callsAfterUnload;

// late counts a call made while the library is marked unloaded; every
// CUDA entry point calls it first.
static void late(void) {
	if (__atomic_load_n(&unloaded, __ATOMIC_SEQ_CST)) __atomic_add_fetch(&callsAfterUnload, 1, __ATOMIC_SEQ_CST);
}

// fake_unload marks the library unloaded (on = 1, which zeroes the count)
// or loaded again (0); on < 0 changes nothing. It returns the calls made
// while it was marked unloaded.
long fake_unload(int on) {
	pthread_mutex_lock(&mu);
	if (on == 1) __atomic_store_n(&callsAfterUnload, 0, __ATOMIC_SEQ_CST);
	if (on >= 0) __atomic_store_n(&unloaded, on, __ATOMIC_SEQ_CST);
	long n = __atomic_load_n(&callsAfterUnload, __ATOMIC_SEQ_CST);
	pthread_mutex_unlock(&mu);
	return n;
}

// fake_count is the number of operations of kind op so far.
long fake_count(int op) {
	pthread_mutex_lock(&mu);
	long n = counts[op];
	pthread_mutex_unlock(&mu);
	return n;
}

// tick counts an operation and returns its injected error, or 0.
static int tick(int op) {
	pthread_mutex_lock(&mu);
	long n = ++counts[op];
	int code = 0;
	if (faultAt[op] && n == faultAt[op]) {
		code = faultCode[op];
		faultAt[op] = 0;
	}
	pthread_mutex_unlock(&mu);
	return code;
}

// Device allocations.
// imports counts cudaIpcOpenMemHandle calls not yet closed; freed marks
// an allocation its owner freed while imported.
typedef struct alloc { uintptr_t base; size_t size; int device; int imports, freed; struct alloc *next; } alloc;
static alloc *allocs;

// find returns the live (not freed) allocation holding p.
static alloc *find(uintptr_t p) {
	for (alloc *a = allocs; a; a = a->next)
		if (!a->freed && p >= a->base && p < a->base + a->size) return a;
	return NULL;
}

// unlink removes the allocation based at p, freed or not; called with mu held.
static alloc *unlink_alloc(uintptr_t p) {
	for (alloc **a = &allocs; *a; a = &(*a)->next) {
		if ((*a)->base == p) {
			alloc *x = *a;
			*a = x->next;
			return x;
		}
	}
	return NULL;
}

// Streams: a queue of copies run at synchronization. done counts the
// copies ever run; an event records how many had been enqueued when it was
// recorded (upto) and its synchronization runs those only, as the real
// one waits for the work before the record and not for later work.
// An op is a copy, or (table set) a launch of the copy kernel (or, sum
// set, of the checksum kernel) over n entries of its table, read when the
// op runs as the GPU reads it.
typedef struct { void *dst; const void *src; size_t n; const uint64_t *table; int sum; } op;
typedef struct { pthread_mutex_t mu; op *ops; size_t n, cap; size_t done; int device; int err; } stream;
typedef struct { stream *s; size_t upto; long queries; int device; } event;

// crc_table is the CRC-32C table, a byte at a time, made when the
// library loads.
static uint32_t crc_table[256];
__attribute__((constructor)) static void make_crc_table(void) {
	for (uint32_t i = 0; i < 256; i++) {
		uint32_t r = i;
		for (int b = 0; b < 8; b++) r = (r >> 1) ^ (0x82F63B78u & -(r & 1));
		crc_table[i] = r;
	}
}

// crc_register is the CRC-32C register of n bytes from state 0, with no
// inversions: what the checksum kernel computes.
static uint32_t crc_register(const uint8_t *p, size_t n) {
	uint32_t r = 0;
	for (size_t i = 0; i < n; i++) r = crc_table[(r ^ p[i]) & 0xff] ^ (r >> 8);
	return r;
}

// Host memory the copy engines may reach: pinned allocations
// (cudaHostAlloc) and live registrations (below). A copy that runs over
// host memory that is neither counts as stray (fake_misuse): the
// driver would stage it through memory of its own, and where it is a
// mapping some code unregistered, or unmapped, it reads or writes pages
// no longer meant for it.
typedef struct pinned { uintptr_t base; size_t size; struct pinned *next; } pinned;
static pinned *pins;
static long strayCopies, busyDestroys, deadUses;
static int inRegs(uintptr_t p, size_t n);

// reachable reports whether [p, p+n) is device memory, pinned memory or
// inside a live registration; called with mu held.
static int reachable(uintptr_t p, size_t n) {
	for (alloc *a = allocs; a; a = a->next)
		if (p >= a->base && p + n <= a->base + a->size) return 1;
	for (pinned *h = pins; h; h = h->next)
		if (p >= h->base && p + n <= h->base + h->size) return 1;
	return inRegs(p, n);
}

// check_copy counts a copy of n bytes between dst and src that reaches
// host memory the copy engines may not (stray).
static void check_copy(const void *dst, const void *src, size_t n) {
	pthread_mutex_lock(&mu);
	if (!reachable((uintptr_t)dst, n) || !reachable((uintptr_t)src, n)) strayCopies++;
	pthread_mutex_unlock(&mu);
}

// fake_misuse returns, for which 0, the copies that ran over host
// memory neither pinned nor registered; for 1, the streams destroyed
// with copies still queued (a real GPU runs them after the destroy
// returned, into memory their job may have handed back); for 2, the
// calls that named a stream or event destroyed (or never made).
long fake_misuse(int which) {
	pthread_mutex_lock(&mu);
	long n = which == 0 ? strayCopies : which == 1 ? busyDestroys : __atomic_load_n(&deadUses, __ATOMIC_SEQ_CST);
	pthread_mutex_unlock(&mu);
	return n;
}

// run_op runs one op; a kernel entry that is not 16-byte aligned fails
// it, as the kernel's vector accesses would, and so does a checksum
// entry that is empty or longer than 64 KiB.
static int run_op(const op *o) {
	if (!o->table) {
		check_copy(o->dst, o->src, o->n);
		memcpy(o->dst, o->src, o->n);
		return 0;
	}
	if (o->sum) {
		for (size_t i = 0; i < o->n; i++) {
			uint64_t *e = (uint64_t *)o->table + 2 * i;
			uint32_t n = (uint32_t)e[1];
			if ((e[0] | n) % 16 || n == 0 || n > 65536) return errLaunchFailure;
			check_copy((void *)(uintptr_t)e[0], (void *)(uintptr_t)e[0], n);
			uint32_t reg = crc_register((const uint8_t *)(uintptr_t)e[0], n);
			memcpy((char *)e + 12, &reg, 4);
		}
		return 0;
	}
	for (size_t i = 0; i < o->n; i++) {
		const uint64_t *e = o->table + 3 * i;
		if ((e[0] | e[1] | e[2]) % 16) return errLaunchFailure;
		check_copy((void *)(uintptr_t)e[0], (const void *)(uintptr_t)e[1], e[2]);
		memcpy((void *)(uintptr_t)e[0], (const void *)(uintptr_t)e[1], e[2]);
	}
	return 0;
}

// push queues o on s; on the legacy default stream (NULL) it runs at once.
static int push(stream *s, op o) {
	if (!s) return run_op(&o);
	pthread_mutex_lock(&s->mu);
	if (s->n == s->cap) {
		s->cap = s->cap ? 2 * s->cap : 64;
		s->ops = realloc(s->ops, s->cap * sizeof(op));
	}
	s->ops[s->n++] = o;
	pthread_mutex_unlock(&s->mu);
	return 0;
}

static int enqueue(stream *s, void *dst, const void *src, size_t n) { return push(s, (op){dst, src, n, NULL, 0}); }

// drain_upto runs the queued copies up to the upto-th ever enqueued (all
// with (size_t)-1). A failed synchronization drops what it would have run.
static int run_upto(stream *s, size_t upto, int code);
static int drain_upto(stream *s, size_t upto) {
	if (!s) return 0;
	return run_upto(s, upto, tick(opSync));
}
// run_upto runs what drain_upto runs, unless code (an injected failure of
// the call) is set: then it drops it.
static int run_upto(stream *s, size_t upto, int code) {
	pthread_mutex_lock(&s->mu);
	size_t k = s->n;
	if (upto != (size_t)-1) k = upto > s->done ? upto - s->done : 0;
	if (k > s->n) k = s->n;
	for (size_t i = 0; i < k && !code; i++) code = run_op(&s->ops[i]);
	memmove(s->ops, s->ops + k, (s->n - k) * sizeof(op));
	s->n -= k;
	s->done += k;
	pthread_mutex_unlock(&s->mu);
	return code;
}

static int drain(stream *s) { return drain_upto(s, (size_t)-1); }

const char *cudaGetErrorName(int e) {
	late();
	switch (e) {
	case errSuccess: return "cudaSuccess";
	case errInvalidValue: return "cudaErrorInvalidValue";
	case errMemoryAllocation: return "cudaErrorMemoryAllocation";
	case errInvalidDevice: return "cudaErrorInvalidDevice";
	case errIllegalAddress: return "cudaErrorIllegalAddress";
	case errLaunchFailure: return "cudaErrorLaunchFailure";
	case errInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
	case errMapBufferObjectFailed: return "cudaErrorMapBufferObjectFailed";
	case errNotReady: return "cudaErrorNotReady";
	case errHostMemoryAlreadyRegistered: return "cudaErrorHostMemoryAlreadyRegistered";
	case errHostMemoryNotRegistered: return "cudaErrorHostMemoryNotRegistered";
	}
	return "cudaErrorUnknown";
}
const char *cudaGetErrorString(int e) { late(); return e ? "fake failure" : "no error"; }
int cudaRuntimeGetVersion(int *v) { late(); *v = 13000; return 0; }
int cudaGetDeviceCount(int *n) { late(); *n = numDevices; return 0; }
int cudaSetDevice(int d) {
	late();
	if (d < 0 || d >= numDevices) return errInvalidDevice;
	curDevice = d;
	curCtx = d + 1;
	pthread_mutex_lock(&mu);
	made |= 1L << d;
	pthread_mutex_unlock(&mu);
	return sticky(d); // current all the same: later calls fail there too
}
// cudaGetDevice makes no context: without one current it answers the
// device last chosen on the thread, 0 on a new thread.
int cudaGetDevice(int *d) { late(); *d = curCtx ? curCtx - 1 : curDevice; return 0; }
int cudaDeviceGetPCIBusId(char *buf, int len, int d) {
	late();
	if (d < 0 || d >= numDevices) return errInvalidDevice;
	snprintf(buf, len, "0000:%02x:00.0", 0x10 + d);
	return 0;
}
int cudaDeviceGetAttribute(int *v, int attr, int d) { late(); if (d < 0 || d >= numDevices) return errInvalidDevice; *v = attr; return 0; }

// Live streams and events: a call that names one destroyed (or never
// made) counts as a dead use (fake_misuse) and fails with
// cudaErrorInvalidResourceHandle, without touching it.
static void **handles;
static size_t nhandles, caphandles;

static void add_handle(void *h) {
	pthread_mutex_lock(&mu);
	if (nhandles == caphandles) {
		caphandles = caphandles ? 2 * caphandles : 64;
		handles = realloc(handles, caphandles * sizeof(void *));
	}
	handles[nhandles++] = h;
	pthread_mutex_unlock(&mu);
}

// find_handle returns h's index, or -1; called with mu held.
static long find_handle(void *h) {
	for (size_t i = 0; i < nhandles; i++)
		if (handles[i] == h) return (long)i;
	return -1;
}

// live_handle reports whether h is live; a null stream (the legacy
// default stream) is.
static int live_handle(void *h) {
	if (!h) return 1;
	pthread_mutex_lock(&mu);
	int ok = find_handle(h) >= 0;
	pthread_mutex_unlock(&mu);
	return ok;
}

// drop_handle forgets h and reports whether it was live.
static int drop_handle(void *h) {
	pthread_mutex_lock(&mu);
	long i = find_handle(h);
	if (i >= 0) handles[i] = handles[--nhandles];
	pthread_mutex_unlock(&mu);
	return i >= 0;
}

static int dead_use(void) {
	__atomic_add_fetch(&deadUses, 1, __ATOMIC_SEQ_CST);
	return errInvalidResourceHandle;
}
#define DEAD(h) do { if (!live_handle(h)) return dead_use(); } while (0)

int cudaStreamCreateWithFlags(stream **s, unsigned flags) {
	late();
	(void)flags;
	STICKY(curDevice);
	*s = calloc(1, sizeof(stream));
	pthread_mutex_init(&(*s)->mu, NULL);
	(*s)->device = curDevice;
	add_handle(*s);
	return 0;
}
int cudaStreamDestroy(stream *s) {
	late();
	if (!s) return errInvalidResourceHandle;
	if (!drop_handle(s)) return dead_use();
	int code = sticky(s->device); // freed all the same: the fake leaks nothing
	pthread_mutex_lock(&s->mu);
	int queued = s->n > 0;
	pthread_mutex_unlock(&s->mu);
	if (queued && !code) {
		pthread_mutex_lock(&mu);
		busyDestroys++;
		pthread_mutex_unlock(&mu);
	}
	free(s->ops);
	free(s);
	return code;
}
int cudaStreamSynchronize(stream *s) {
	late();
	DEAD(s);
	if (s) STICKY(s->device);
	return drain(s);
}
// cudaStreamQuery runs what s holds (the fake's copies complete when
// looked at) and answers; a broken device answers its sticky error, an
// idle stream's query included, as a real broken context does.
int cudaStreamQuery(stream *s) {
	late();
	DEAD(s);
	STICKY(s ? s->device : curDevice);
	return s ? run_upto(s, (size_t)-1, 0) : 0;
}
int cudaEventCreateWithFlags(event **e, unsigned flags) {
	late();
	(void)flags;
	STICKY(curDevice);
	*e = calloc(1, sizeof(event));
	(*e)->device = curDevice;
	add_handle(*e);
	return 0;
}
int cudaEventRecord(event *e, stream *s) {
	late();
	if (!e) return errInvalidResourceHandle;
	DEAD(e);
	DEAD(s);
	STICKY(e->device);
	int code = tick(opRecord);
	if (code) return code;
	e->s = s;
	e->queries = 0;
	if (s) {
		pthread_mutex_lock(&s->mu);
		e->upto = s->done + s->n;
		pthread_mutex_unlock(&s->mu);
	}
	return 0;
}
int cudaEventSynchronize(event *e) {
	late();
	if (!e) return errInvalidResourceHandle;
	DEAD(e);
	STICKY(e->device);
	if (!live_handle(e->s)) return 0; // its stream was destroyed since: nothing to wait for
	return e->s ? drain_upto(e->s, e->upto) : 0;
}
int cudaEventQuery(event *e) {
	late();
	if (!e) return errInvalidResourceHandle;
	DEAD(e);
	STICKY(e->device);
	int code = tick(opQuery);
	if (!live_handle(e->s)) return code; // its stream was destroyed since
	pthread_mutex_lock(&mu);
	long busy = busyQueries;
	pthread_mutex_unlock(&mu);
	if (!code && e->s && (busy < 0 || e->queries < busy)) {
		pthread_mutex_lock(&e->s->mu);
		int ran = e->s->done >= e->upto; // run by a synchronization since
		pthread_mutex_unlock(&e->s->mu);
		if (!ran) {
			e->queries++;
			return errNotReady;
		}
	}
	return e->s ? run_upto(e->s, e->upto, code) : code;
}
int cudaEventDestroy(event *e) {
	late();
	if (!e) return errInvalidResourceHandle;
	if (!drop_handle(e)) return dead_use();
	int code = sticky(e->device);
	free(e);
	return code;
}

int cudaHostAlloc(void **p, size_t n, unsigned flags) {
	late();
	(void)flags;
	STICKY(curDevice);
	int code = tick(opHostAlloc);
	if (code) return code;
	if (posix_memalign(p, 4096, n ? n : 1)) return errMemoryAllocation;
	pinned *h = malloc(sizeof(pinned));
	pthread_mutex_lock(&mu);
	*h = (pinned){(uintptr_t)*p, n, pins};
	pins = h;
	pthread_mutex_unlock(&mu);
	return 0;
}
int cudaFreeHost(void *p) {
	late();
	pthread_mutex_lock(&mu);
	for (pinned **h = &pins; *h; h = &(*h)->next) {
		if ((*h)->base == (uintptr_t)p) {
			pinned *x = *h;
			*h = x->next;
			free(x);
			break;
		}
	}
	pthread_mutex_unlock(&mu);
	free(p);
	return sticky(curDevice);
}
static pthread_cond_t regCond = PTHREAD_COND_INITIALIZER;
static int regHeld;       // registrations wait while set
static long regWaiting;   // registrations waiting

// fake_hold_registrations makes cudaHostRegister wait (on = 1) until it is
// called with 0 (let them go); on < 0 changes nothing. It returns how many
// registrations are waiting.
long fake_hold_registrations(int on) {
	pthread_mutex_lock(&mu);
	if (on >= 0) regHeld = on;
	long n = regWaiting;
	pthread_cond_broadcast(&regCond);
	pthread_mutex_unlock(&mu);
	return n;
}

// Live registrations: the ranges cudaHostRegister registered and no
// cudaHostUnregister undid, as the driver keeps them. A range that
// overlaps a live one is refused (cudaErrorHostMemoryAlreadyRegistered),
// and so is the unregistration of an address that starts none
// (cudaErrorHostMemoryNotRegistered), as the runtime refuses both.
typedef struct reg { uintptr_t base; size_t size; struct reg *next; } reg;
static reg *regs;
static long liveRegs;

// inRegs reports whether [p, p+n) is inside a live registration;
// called with mu held.
static int inRegs(uintptr_t p, size_t n) {
	for (reg *r = regs; r; r = r->next)
		if (p >= r->base && p + n <= r->base + r->size) return 1;
	return 0;
}

// fake_registrations is the number of live registrations.
long fake_registrations(void) {
	pthread_mutex_lock(&mu);
	long n = liveRegs;
	pthread_mutex_unlock(&mu);
	return n;
}

int cudaHostRegister(void *p, size_t n, unsigned flags) {
	late();
	(void)flags;
	STICKY(curDevice);
	pthread_mutex_lock(&mu);
	regWaiting++;
	while (regHeld) pthread_cond_wait(&regCond, &mu);
	regWaiting--;
	pthread_mutex_unlock(&mu);
	int code = tick(opHostRegister);
	if (code) return code;
	uintptr_t b = (uintptr_t)p;
	pthread_mutex_lock(&mu);
	for (reg *r = regs; r; r = r->next) {
		if (b < r->base + r->size && r->base < b + n) {
			pthread_mutex_unlock(&mu);
			return errHostMemoryAlreadyRegistered;
		}
	}
	reg *r = malloc(sizeof(reg));
	*r = (reg){b, n, regs};
	regs = r;
	liveRegs++;
	pthread_mutex_unlock(&mu);
	return 0;
}
// cudaHostUnregister undoes a live registration starting at p; an
// injected failure or a broken device is returned with the registration
// undone all the same.
int cudaHostUnregister(void *p) {
	late();
	int code = tick(opHostUnregister);
	int found = 0;
	pthread_mutex_lock(&mu);
	for (reg **r = &regs; *r; r = &(*r)->next) {
		if ((*r)->base == (uintptr_t)p) {
			reg *x = *r;
			*r = x->next;
			free(x);
			liveRegs--;
			found = 1;
			break;
		}
	}
	pthread_mutex_unlock(&mu);
	int c = sticky(curDevice);
	if (c) return c;
	if (code) return code;
	return found ? 0 : errHostMemoryNotRegistered;
}

int cudaMalloc(void **p, size_t n) {
	late();
	STICKY(curDevice);
	if (posix_memalign(p, 256, n ? n : 1)) return errMemoryAllocation;
	alloc *a = malloc(sizeof(alloc));
	*a = (alloc){(uintptr_t)*p, n, curDevice, 0, 0, NULL};
	pthread_mutex_lock(&mu);
	a->next = allocs;
	allocs = a;
	pthread_mutex_unlock(&mu);
	return 0;
}
int cudaFree(void *p) {
	late();
	if (!p) return sticky(curDevice); // cudaFree(0): initializes the context, frees nothing
	STICKY(curDevice);
	pthread_mutex_lock(&mu);
	alloc *a = find((uintptr_t)p);
	if (!a || a->base != (uintptr_t)p) {
		pthread_mutex_unlock(&mu);
		return errInvalidValue;
	}
	if (a->imports > 0) { // still mapped by importers: freed with the last close
		a->freed = 1;
		pthread_mutex_unlock(&mu);
		return 0;
	}
	free(unlink_alloc((uintptr_t)p));
	pthread_mutex_unlock(&mu);
	free(p);
	return 0;
}

int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, stream *s) {
	late();
	DEAD(s);
	(void)kind;
	STICKY(s ? s->device : curDevice);
	int code = tick(opCopy);
	if (code) return code;
	return enqueue(s, dst, src, n);
}
int cudaMemcpy(void *dst, const void *src, size_t n, int kind) {
	late();
	(void)kind;
	STICKY(curDevice);
	memcpy(dst, src, n);
	return 0;
}

// CUDA 13 signature: no failIdx.
typedef struct { int srcAccessOrder; int srcType, srcId; int dstType, dstId; unsigned flags; } memcpyAttrs;
int cudaMemcpyBatchAsync(void *const *dsts, const void *const *srcs, const size_t *sizes, size_t count,
			 memcpyAttrs *attrs, size_t *attrsIdxs, size_t numAttrs, stream *s) {
	late();
	DEAD(s);
	tick(opBatch);
	if (s) STICKY(s->device);
	if (!s || numAttrs < 1 || !attrs || !attrsIdxs || attrsIdxs[0] != 0) return errInvalidValue;
	for (size_t i = 0; i < numAttrs; i++)
		if (attrs[i].srcAccessOrder < 1 || attrs[i].srcAccessOrder > 3) return errInvalidValue;
	for (size_t i = 0; i < count; i++) {
		int code = tick(opCopy);
		if (code) return code;
		enqueue(s, dsts[i], srcs[i], sizes[i]);
	}
	return 0;
}

typedef struct { uint32_t magic; uint32_t pad; uint64_t ptr; uint64_t size; char rest[40]; } ipcHandle;
#define IPC_MAGIC 0x6b766970u

int cudaIpcGetMemHandle(ipcHandle *h, void *p) {
	late();
	STICKY(curDevice);
	pthread_mutex_lock(&mu);
	alloc *a = find((uintptr_t)p);
	pthread_mutex_unlock(&mu);
	if (!a) return errInvalidValue;
	memset(h, 0, sizeof *h);
	*h = (ipcHandle){.magic = IPC_MAGIC, .ptr = a->base, .size = a->size};
	return 0;
}
int cudaIpcOpenMemHandle(void **p, ipcHandle h, unsigned flags) {
	late();
	if (flags != 1) return errInvalidValue; // cudaIpcMemLazyEnablePeerAccess
	STICKY(curDevice);
	int code = tick(opIpcOpen);
	if (code) return code;
	if (h.magic != IPC_MAGIC) return errMapBufferObjectFailed;
	pthread_mutex_lock(&mu);
	alloc *a = find(h.ptr);
	int ok = a && a->base == h.ptr && (a->device == curDevice || peerAccess);
	int other = a && a->device != curDevice && !peerAccess;
	if (ok) a->imports++;
	pthread_mutex_unlock(&mu);
	if (other) return errInvalidDevice;
	if (!ok) return errMapBufferObjectFailed;
	*p = (void *)h.ptr;
	return 0;
}
int cudaIpcCloseMemHandle(void *p) {
	late();
	tick(opIpcClose);
	STICKY(curDevice);
	pthread_mutex_lock(&mu);
	alloc *a = allocs;
	while (a && a->base != (uintptr_t)p) a = a->next;
	if (!a || a->imports == 0) {
		pthread_mutex_unlock(&mu);
		return errInvalidValue;
	}
	if (--a->imports == 0 && a->freed) {
		free(unlink_alloc((uintptr_t)p));
		pthread_mutex_unlock(&mu);
		free(p);
		return 0;
	}
	pthread_mutex_unlock(&mu);
	return 0;
}

// Driver API.
int cuInit(unsigned flags) { late(); (void)flags; return 0; }
int cuCtxGetCurrent(void **ctx) { late(); *ctx = curCtx ? &ctxs[curCtx - 1] : NULL; return 0; }
// cuCtxSetCurrent binds a context made before (one of ctxs), or none.
int cuCtxSetCurrent(void *ctx) {
	late();
	if (!ctx) {
		curCtx = 0;
		return 0;
	}
	int d = (int)((char *)ctx - ctxs);
	if (d < 0 || d >= numDevices) return 201; // CUDA_ERROR_INVALID_CONTEXT
	curCtx = d + 1;
	curDevice = d;
	return 0;
}

// fake_contexts returns the devices whose primary context was made (bit
// d), and forgets them when reset is 1.
long fake_contexts(int reset) {
	pthread_mutex_lock(&mu);
	long m = made;
	if (reset) made = 0;
	pthread_mutex_unlock(&mu);
	return m;
}

// fake_thread returns the device of the calling thread's current context,
// or -1 for none; with forget 1 it first gives the thread a new thread's
// state (no context current, device 0 chosen).
long fake_thread(int forget) {
	if (forget) curCtx = curDevice = 0;
	return curCtx - 1;
}
// Device d's UUID is "kvhost-fake-gpu" followed by the byte d.
int cuDeviceGet(int *dev, int ordinal) {
	late();
	if (ordinal < 0 || ordinal >= numDevices) return 101; // CUDA_ERROR_INVALID_DEVICE
	*dev = ordinal;
	return 0;
}
int cuDeviceGetUuid_v2(unsigned char *uuid, int dev) {
	late();
	if (dev < 0 || dev >= numDevices) return 101;
	memcpy(uuid, "kvhost-fake-gpu", 15);
	uuid[15] = (unsigned char)dev;
	return 0;
}
int cuMemGetAddressRange_v2(uint64_t *base, size_t *size, uint64_t p) {
	late();
	STICKY(curDevice);
	int code = tick(opAddressRange);
	if (code) return code;
	pthread_mutex_lock(&mu);
	alloc *a = find(p);
	if (a) { *base = a->base; *size = a->size; }
	pthread_mutex_unlock(&mu);
	return a ? 0 : 1;
}

// The kernels: a module is a copy of its PTX, which must define the entry
// kv_copy_segments or kv_crc32c_spans; a launch queues a kernel op over
// gridDimY entries of the table its one parameter points to. A function
// is its module's address, plus one for the checksum kernel.
int cuModuleLoadDataEx(void **mod, const void *image, unsigned n, int *opts, void **vals) {
	late();
	(void)n; (void)opts; (void)vals;
	STICKY(curDevice);
	int code = tick(opModuleLoad);
	if (code) return code;
	const char *ptx = image;
	if (!strstr(ptx, ".version") || (!strstr(ptx, ".entry kv_copy_segments(") && !strstr(ptx, ".entry kv_crc32c_spans(")))
		return 218; // CUDA_ERROR_INVALID_PTX
	*mod = strdup(ptx);
	return 0;
}
int cuModuleGetFunction(void **fn, void *mod, const char *name) {
	late();
	char entry[64];
	snprintf(entry, sizeof entry, ".entry %s(", name);
	if (!strstr(mod, entry) || (strcmp(name, "kv_copy_segments") && strcmp(name, "kv_crc32c_spans"))) return 500; // CUDA_ERROR_NOT_FOUND
	*fn = (char *)mod + (strcmp(name, "kv_crc32c_spans") == 0);
	return 0;
}
int cuModuleUnload(void *mod) {
	late();
	int code = tick(opModuleUnload);
	free(mod);
	return code ? code : sticky(curDevice);
}
int cuLaunchKernel(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
		   unsigned shared, stream *s, void **params, void **extra) {
	late();
	DEAD(s);
	(void)shared; (void)extra;
	STICKY(s ? s->device : curDevice);
	int code = tick(opLaunch);
	if (code) return code;
	if (!fn || !params || gx < 1 || gy < 1 || gy > 65535 || gz != 1 || bx < 1 || bx > 1024 || by != 1 || bz != 1) return 1;
	const uint64_t *table = (const uint64_t *)(uintptr_t)(*(uint64_t *)params[0]);
	return push(s, (op){NULL, NULL, gy, table, (uintptr_t)fn & 1});
}
