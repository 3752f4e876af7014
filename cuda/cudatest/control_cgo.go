//go:build linux && cgo

package cudatest

/*
typedef void (*set_fault_fn)(int, long, int);
typedef long (*count_fn)(int);
typedef void (*set_peer_fn)(int);
typedef void (*set_busy_fn)(long);
typedef long (*hold_fn)(int);
typedef void (*break_fn)(int, int);
typedef long (*regs_fn)(void);
typedef long (*misuse_fn)(int);
static void call_set_fault(void *f, int op, long n, int code) { ((set_fault_fn)f)(op, n, code); }
static long call_count(void *f, int op) { return ((count_fn)f)(op); }
static void call_set_peer(void *f, int on) { ((set_peer_fn)f)(on); }
static void call_set_busy(void *f, long n) { ((set_busy_fn)f)(n); }
static long call_hold(void *f, int on) { return ((hold_fn)f)(on); }
static void call_break(void *f, int d, int code) { ((break_fn)f)(d, code); }
static long call_regs(void *f) { return ((regs_fn)f)(); }
static long call_misuse(void *f, int which) { return ((misuse_fn)f)(which); }
*/
import "C"

import (
	"testing"
	"unsafe"

	"github.com/kvhost/kvhost/internal/dl"
)

const supported = true

// Fake controls a loaded fake library (the same library a cuda.Runtime
// opened from the path Build returned: dlopen shares one instance).
type Fake struct {
	lib                                                  *dl.Library
	setFault, count, setPeer, setBusy, hold, brk, unload unsafe.Pointer
	contexts, thread, regs, misuse                       unsafe.Pointer
}

// Open opens the fake library for control; it is closed with the test.
func Open(t testing.TB, path string) *Fake {
	t.Helper()
	lib, err := dl.Open(path)
	if err != nil {
		t.Fatalf("cudatest: %v", err)
	}
	t.Cleanup(func() { lib.Close() })
	f := &Fake{lib: lib}
	if f.setFault, err = lib.Sym("fake_set_fault"); err != nil {
		t.Fatalf("cudatest: %v", err)
	}
	if f.count, err = lib.Sym("fake_count"); err != nil {
		t.Fatalf("cudatest: %v", err)
	}
	if f.setPeer, err = lib.Sym("fake_set_peer_access"); err != nil {
		t.Fatalf("cudatest: %v", err)
	}
	if f.setBusy, err = lib.Sym("fake_set_busy"); err != nil {
		t.Fatalf("cudatest: %v", err)
	}
	if f.hold, err = lib.Sym("fake_hold_registrations"); err != nil {
		t.Fatalf("cudatest: %v", err)
	}
	if f.brk, err = lib.Sym("fake_break_device"); err != nil {
		t.Fatalf("cudatest: %v", err)
	}
	if f.unload, err = lib.Sym("fake_unload"); err != nil {
		t.Fatalf("cudatest: %v", err)
	}
	if f.contexts, err = lib.Sym("fake_contexts"); err != nil {
		t.Fatalf("cudatest: %v", err)
	}
	if f.thread, err = lib.Sym("fake_thread"); err != nil {
		t.Fatalf("cudatest: %v", err)
	}
	if f.regs, err = lib.Sym("fake_registrations"); err != nil {
		t.Fatalf("cudatest: %v", err)
	}
	if f.misuse, err = lib.Sym("fake_misuse"); err != nil {
		t.Fatalf("cudatest: %v", err)
	}
	return f
}

// Fail makes the nth next operation of kind op fail with status code;
// n <= 0 clears the fault.
func (f *Fake) Fail(op Op, n int, code int) {
	C.call_set_fault(f.setFault, C.int(op), C.long(n), C.int(code))
}

// Count is the number of operations of kind op so far.
func (f *Fake) Count(op Op) int { return int(C.call_count(f.count, C.int(op))) }

// PeerAccess makes imports of another device's allocation succeed (on),
// as the driver maps them over peer access, or fail (off, the default).
// The library is shared by the tests of a binary: turn it off again.
func (f *Fake) PeerAccess(on bool) {
	v := 0
	if on {
		v = 1
	}
	C.call_set_peer(f.setPeer, C.int(v))
}

// Busy makes every event answer its first n queries after each record
// "not ready" (n < 0: every query) before a query runs the event's copies
// and answers; 0, the default, answers the first. Synchronizing the event
// or its stream runs them whatever was queried. The library is shared by
// the tests of a binary: set it back to 0.
func (f *Fake) Busy(n int) { C.call_set_busy(f.setBusy, C.long(n)) }

// HoldRegistrations makes cudaHostRegister wait until it is called with
// false, which lets the waiting ones go. The library is shared by the
// tests of a binary: let them go again.
func (f *Fake) HoldRegistrations(hold bool) {
	v := 0
	if hold {
		v = 1
	}
	C.call_hold(f.hold, C.int(v))
}

// WaitingRegistrations is how many cudaHostRegister calls are waiting
// (HoldRegistrations).
func (f *Fake) WaitingRegistrations() int { return int(C.call_hold(f.hold, -1)) }

// BreakDevice makes every later CUDA call on device d fail with code, as
// a context broken by a sticky error (an illegal address, a lost GPU)
// does; code 0 mends it, which a real context never is. The library is
// shared by the tests of a binary: mend it again.
func (f *Fake) BreakDevice(d int, code int) { C.call_break(f.brk, C.int(d), C.int(code)) }

// Unload marks the library unloaded, as its user's dlclose would (it
// stays loaded: the tests of a binary share it), and starts counting the
// calls made into it (CallsAfterUnload); Unload(false) ends the mark. The
// library is shared by the tests of a binary: end it again.
func (f *Fake) Unload(on bool) {
	v := 0
	if on {
		v = 1
	}
	C.call_hold(f.unload, C.int(v))
}

// CallsAfterUnload is how many CUDA calls were made while the library
// was marked unloaded (Unload), each of which would jump into unmapped
// code after a real dlclose.
func (f *Fake) CallsAfterUnload() int { return int(C.call_hold(f.unload, -1)) }

// Contexts lists the devices on which a primary context was made (as
// cudaSetDevice makes one since CUDA 12, taking GPU memory there) since
// the last ForgetContexts, in order.
func (f *Fake) Contexts() []int {
	m := int64(C.call_hold(f.contexts, 0))
	var out []int
	for d := 0; m != 0; d, m = d+1, m>>1 {
		if m&1 != 0 {
			out = append(out, d)
		}
	}
	return out
}

// ForgetContexts empties Contexts. The library is shared by the tests of
// a binary, which made contexts before.
func (f *Fake) ForgetContexts() { C.call_hold(f.contexts, 1) }

// CurrentContext is the device of the calling thread's current context,
// or -1 for none. Call it from a goroutine locked to its thread.
func (f *Fake) CurrentContext() int { return int(C.call_hold(f.thread, 0)) }

// NewThread gives the calling thread a new thread's CUDA state: no
// context current, device 0 chosen (so cudaGetDevice answers 0). Call it
// from a goroutine locked to its thread.
func (f *Fake) NewThread() { C.call_hold(f.thread, 1) }

// Registrations is the number of live host registrations: ranges
// cudaHostRegister registered that no cudaHostUnregister undid. The fake
// refuses a registration that overlaps a live one
// (cudaErrorHostMemoryAlreadyRegistered) and the unregistration of an
// address that starts none (cudaErrorHostMemoryNotRegistered).
func (f *Fake) Registrations() int { return int(C.call_regs(f.regs)) }

// StrayCopies is how many copies (and kernel table entries, of the copy
// and checksum kernels) ran (at their stream's synchronization) over
// host memory that was neither pinned (cudaHostAlloc) nor inside a
// live registration at that moment: the mapping of a file unregistered
// before its job's copies ran, or memory of the Go heap. cudaMemcpy, the
// synchronous copy tests use to reach device memory, is not counted.
func (f *Fake) StrayCopies() int { return int(C.call_misuse(f.misuse, 0)) }

// BusyDestroys is how many streams were destroyed with copies still
// queued on a device that is not broken: a real GPU runs those after
// cudaStreamDestroy returned, into memory their job may have handed
// back (the fake drops them).
func (f *Fake) BusyDestroys() int { return int(C.call_misuse(f.misuse, 1)) }

// DeadHandles is how many calls named a stream or event that was
// destroyed, or never made: each fails with
// cudaErrorInvalidResourceHandle without touching it (a real runtime
// may crash, or act on whatever took the handle's place).
func (f *Fake) DeadHandles() int { return int(C.call_misuse(f.misuse, 2)) }
