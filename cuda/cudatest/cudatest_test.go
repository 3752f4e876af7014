package cudatest_test

import (
	"errors"
	"io/fs"
	"os"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/cuda/cudatest"
)

// TestBuildLeavesNothingBehindOnceTheTestEnds builds the fake library
// in a subtest with the temporary directory pointed at an empty one:
// the library is there while the subtest runs, and once it ends neither
// the library nor the compiler's directory is left.
func TestBuildLeavesNothingBehindOnceTheTestEnds(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	var lib string
	t.Run("build", func(t *testing.T) {
		lib = cudatest.Build(t)
		if st, err := os.Stat(lib); err != nil || st.Size() == 0 {
			t.Fatalf("the built library %s: %v, %v", lib, st, err)
		}
	})
	if _, err := os.Stat(lib); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the library %s is still there after its test: %v", lib, err)
	}
	left, err := os.ReadDir(tmp)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range left {
		t.Errorf("left in the temporary directory: %s", e.Name())
	}
}

// TestFakeKeepsLiveHostRegistrations: the fake counts the registrations
// not undone, refuses one that overlaps a live one and the
// unregistration of an address that starts none, as the runtime does,
// and undoes a registration whose unregistration failed (an injected
// fault) all the same.
func TestFakeKeepsLiveHostRegistrations(t *testing.T) {
	fake, rt := openFake(t)
	mem, err := unix.Mmap(-1, 0, 3<<12, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(mem) })
	a, b, c := mem[:1<<12], mem[1<<12:2<<12], mem[:2<<12]
	for _, step := range []struct {
		name string
		do   func() error
		want cuda.Error // 0: success
		live int
	}{
		{"register a", func() error { return rt.HostRegister(a) }, 0, 1},
		{"register b", func() error { return rt.HostRegister(b) }, 0, 2},
		{"register a again", func() error { return rt.HostRegister(a) }, 712, 2},
		{"register a range overlapping a and b", func() error { return rt.HostRegister(c) }, 712, 2},
		{"unregister a", func() error { return rt.HostUnregister(a) }, 0, 1},
		{"unregister a again", func() error { return rt.HostUnregister(a) }, 713, 1},
		{"unregister b with a fault", func() error {
			fake.Fail(cudatest.OpUnregister, 1, 1)
			return rt.HostUnregister(b)
		}, 1, 0},
		{"register the overlapping range", func() error { return rt.HostRegister(c) }, 0, 1},
		{"unregister it", func() error { return rt.HostUnregister(c) }, 0, 0},
	} {
		err := step.do()
		if step.want == 0 && err != nil || step.want != 0 && !errors.Is(err, step.want) {
			t.Errorf("%s: %v, want %v", step.name, err, step.want)
		}
		if n := fake.Registrations(); n != step.live {
			t.Errorf("after %s: %d live registrations, want %d", step.name, n, step.live)
		}
	}
}

// TestFakeCountsStrayCopiesAndBusyDestroys: a copy that runs over host
// memory neither pinned nor registered counts as stray, one over a live
// registration or pinned memory does not; a stream destroyed with a copy
// queued counts, one synchronized first does not.
func TestFakeCountsStrayCopiesAndBusyDestroys(t *testing.T) {
	fake, rt := openFake(t)
	unlock, err := rt.LockDevice(0)
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	dev, err := rt.Malloc(0, 1<<12)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	mem, err := unix.Mmap(-1, 0, 1<<12, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	host := uintptr(unsafe.Pointer(&mem[0]))
	s, err := rt.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	for _, step := range []struct {
		name            string
		do              func() error
		stray, destroys int
	}{
		{"a copy from unregistered memory", func() error {
			return errors.Join(rt.CopyH2D(dev.Ptr(), host, 1<<12, s), rt.Sync(s))
		}, 1, 0},
		{"a copy from registered memory", func() error {
			return errors.Join(rt.HostRegister(mem), rt.CopyD2H(host, dev.Ptr(), 1<<12, s), rt.Sync(s))
		}, 1, 0},
		{"a copy queued and run after the unregistration", func() error {
			return errors.Join(rt.CopyD2H(host, dev.Ptr(), 1<<12, s), rt.HostUnregister(mem), rt.Sync(s))
		}, 2, 0},
		{"a stream destroyed with a copy queued", func() error {
			err := errors.Join(rt.CopyH2D(dev.Ptr(), host, 1<<12, s), rt.DestroyStream(s))
			s, _ = rt.NewStream()
			return err
		}, 2, 1},
	} {
		if err := step.do(); err != nil {
			t.Fatalf("%s: %v", step.name, err)
		}
		if n, m := fake.StrayCopies(), fake.BusyDestroys(); n != step.stray || m != step.destroys {
			t.Errorf("after %s: %d stray copies and %d busy destroys, want %d and %d", step.name, n, m, step.stray, step.destroys)
		}
	}
	rt.DestroyStream(s)
}

// TestFakeCountsCallsOnDestroyedHandles: a call that names a stream or
// event destroyed fails with cudaErrorInvalidResourceHandle and counts;
// calls on live ones do not.
func TestFakeCountsCallsOnDestroyedHandles(t *testing.T) {
	fake, rt := openFake(t)
	unlock, err := rt.LockDevice(0)
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	s, err := rt.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	if err := rt.Sync(s); err != nil || fake.DeadHandles() != 0 {
		t.Fatalf("sync of a live stream: %v, %d dead uses", err, fake.DeadHandles())
	}
	if err := rt.DestroyStream(s); err != nil {
		t.Fatal(err)
	}
	for i, call := range []func() error{
		func() error { return rt.Sync(s) },
		func() error { return rt.DestroyStream(s) },
	} {
		if err := call(); !errors.Is(err, cuda.Error(400)) {
			t.Errorf("call %d on the destroyed stream: %v, want cudaErrorInvalidResourceHandle", i, err)
		}
		if n := fake.DeadHandles(); n != i+1 {
			t.Errorf("after call %d on the destroyed stream: %d dead uses, want %d", i, n, i+1)
		}
	}
}

// openFake builds the fake library, opens its control and a runtime on
// it, closed when the test ends.
func openFake(t *testing.T) (*cudatest.Fake, *cuda.Runtime) {
	t.Helper()
	lib := cudatest.Build(t)
	fake := cudatest.Open(t, lib)
	rt, err := cuda.Open(cuda.Config{Runtime: []string{lib}, Driver: []string{lib}})
	if err != nil {
		t.Fatalf("cuda.Open: %v", err)
	}
	t.Cleanup(func() { rt.Close() })
	return fake, rt
}
