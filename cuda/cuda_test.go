package cuda_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/cuda/cudatest"
)

func open(t *testing.T) (*cuda.Runtime, *cudatest.Fake) {
	t.Helper()
	path := cudatest.Build(t)
	r, err := cuda.Open(cuda.Config{Runtime: []string{path}, Driver: []string{path}})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { r.Close() })
	return r, cudatest.Open(t, path)
}

func worker(t *testing.T, r *cuda.Runtime, d int) *cuda.Worker {
	t.Helper()
	w, err := r.NewWorker(d)
	if err != nil {
		t.Fatalf("NewWorker(%d): %v", d, err)
	}
	t.Cleanup(func() { w.Close() })
	return w
}

func TestOpenMissingLibraryIsUnavailable(t *testing.T) {
	_, err := cuda.Open(cuda.Config{Runtime: []string{"/nonexistent/libcudart.so.13"}})
	if !errors.Is(err, cuda.ErrUnavailable) {
		t.Fatalf("err = %v, want ErrUnavailable", err)
	}
}

func TestErrorPrintsNameWithoutLibrary(t *testing.T) {
	for _, c := range []struct {
		e    cuda.Error
		want string
	}{
		{cuda.ErrorInvalidValue, "cudaErrorInvalidValue"},
		{cuda.ErrorIllegalAddress, "cudaErrorIllegalAddress"},
		{cuda.Error(12345), "cudaError(12345)"},
	} {
		if got := c.e.Error(); got != c.want {
			t.Errorf("Error(%d) = %q, want %q", int(c.e), got, c.want)
		}
	}
	var err error = &cuda.CallError{Func: "cudaMemcpyAsync", Code: cuda.ErrorIllegalAddress}
	if !errors.Is(err, cuda.ErrorIllegalAddress) || !strings.Contains(err.Error(), "cudaMemcpyAsync") {
		t.Errorf("CallError %q: not Is(ErrorIllegalAddress) or does not name the call", err)
	}
}

func TestDeviceUUIDNamesEachDeviceAndNeedsTheDriverAPI(t *testing.T) {
	r, _ := open(t)
	for d := range 2 {
		got, err := r.DeviceUUID(d)
		want := [16]byte{}
		copy(want[:], "kvhost-fake-gpu")
		want[15] = byte(d)
		if err != nil || got != want {
			t.Fatalf("DeviceUUID(%d) = %x, %v; want %x", d, got, err, want)
		}
	}
	if _, err := r.DeviceUUID(2); err == nil {
		t.Fatal("DeviceUUID(2) of a two-device runtime: no error")
	}
	path := cudatest.Build(t)
	noDriver, err := cuda.Open(cuda.Config{Runtime: []string{path}, Driver: []string{"/nonexistent/libcuda.so.1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer noDriver.Close()
	if _, err := noDriver.DeviceUUID(0); !errors.Is(err, cuda.ErrUnavailable) {
		t.Fatalf("DeviceUUID without the driver API: %v, want ErrUnavailable", err)
	}
}

func TestDevicesAndWorkerSetsDevice(t *testing.T) {
	r, _ := open(t)
	if r.Version() != 13000 || !r.HasBatch() || !r.HasDriver() {
		t.Fatalf("version %d batch %v driver %v, want 13000 true true", r.Version(), r.HasBatch(), r.HasDriver())
	}
	n, err := r.DeviceCount()
	if err != nil || n != 2 {
		t.Fatalf("DeviceCount = %d, %v; want 2", n, err)
	}
	id, err := r.PCIBusID(1)
	if err != nil || id != "0000:11:00.0" {
		t.Fatalf("PCIBusID(1) = %q, %v", id, err)
	}
	if _, err := r.PCIBusID(7); !errors.Is(err, cuda.ErrorInvalidDevice) {
		t.Fatalf("PCIBusID(7): %v, want ErrorInvalidDevice", err)
	}
	if name := r.ErrorName(cuda.ErrorInvalidValue); name != "cudaErrorInvalidValue" {
		t.Fatalf("ErrorName = %q", name)
	}
	for d := range 2 {
		w := worker(t, r, d)
		err := w.Do(context.Background(), func(w *cuda.Worker) error {
			got, err := w.Runtime().Device()
			if err == nil && got != d {
				err = errors.New("wrong current device")
			}
			return err
		})
		if err != nil {
			t.Fatalf("worker %d: %v", d, err)
		}
	}
	if _, err := r.NewWorker(5); !errors.Is(err, cuda.ErrorInvalidDevice) {
		t.Fatalf("NewWorker(5): %v, want ErrorInvalidDevice", err)
	}
}

// TestLockDeviceRestoresTheThreadsDevice: LockDevice makes its device
// current, and its unlock gives a thread that was already on another
// device (a Worker's) that device back.
func TestLockDeviceRestoresTheThreadsDevice(t *testing.T) {
	r, _ := open(t)
	w := worker(t, r, 1)
	err := w.Do(context.Background(), func(w *cuda.Worker) error {
		unlock, err := r.LockDevice(0)
		if err != nil {
			return err
		}
		if d, err := r.Device(); err != nil || d != 0 {
			unlock()
			return fmt.Errorf("inside LockDevice(0): device %d, %v", d, err)
		}
		unlock()
		if d, err := r.Device(); err != nil || d != 1 {
			return fmt.Errorf("after unlock: device %d, %v; want the worker's 1", d, err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.LockDevice(9); !errors.Is(err, cuda.ErrorInvalidDevice) {
		t.Fatalf("LockDevice(9): %v, want ErrorInvalidDevice", err)
	}
}

// TestLockDeviceOnANewThreadMakesNoOtherContext: on a thread that never
// had a device (cudaGetDevice answers 0 there without a context),
// LockDevice(1) and its unlock make a context on device 1 only, never on
// device 0, which a process serving only device 1 must not touch, and
// hand the thread back with no context current, as before.
func TestLockDeviceOnANewThreadMakesNoOtherContext(t *testing.T) {
	r, fake := open(t)
	done := make(chan error)
	go func() {
		runtime.LockOSThread() // for the fake's view of this thread; never handed back
		done <- func() error {
			fake.NewThread()
			fake.ForgetContexts()
			unlock, err := r.LockDevice(1)
			if err != nil {
				return err
			}
			if d := fake.CurrentContext(); d != 1 {
				unlock()
				return fmt.Errorf("inside LockDevice(1): context of device %d current", d)
			}
			unlock()
			if got := fake.Contexts(); !slices.Equal(got, []int{1}) {
				return fmt.Errorf("contexts made on devices %v, want [1]", got)
			}
			if d := fake.CurrentContext(); d != -1 {
				return fmt.Errorf("after unlock: context of device %d current, want none as before", d)
			}
			return nil
		}()
	}()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestScatterGatherRoundTrip gathers scattered device pages into pinned
// memory and scatters them back elsewhere, in both copy modes, and checks
// the bytes appear only after the stream is synchronized (Sync) or a
// blocking event recorded after the copies is waited for.
func TestScatterGatherRoundTrip(t *testing.T) {
	r, fake := open(t)
	w := worker(t, r, 0)
	for _, mode := range []cuda.CopyMode{cuda.CopySegments, cuda.CopyBatch, cuda.CopyKernel} {
		t.Run(mode.String(), func(t *testing.T) {
			const page, pages = 4096, 64
			err := w.Do(context.Background(), func(w *cuda.Worker) error {
				// enqueue moves c by mode: the kernel through its table.
				enqueue := func(c *cuda.Copies, h2d bool) error { return r.Enqueue(c, h2d, mode, w.Stream()) }
				if mode == cuda.CopyKernel {
					k, err := r.LoadCopyKernel()
					if err != nil {
						return err
					}
					defer k.Unload()
					table, err := r.HostAlloc(pages * cuda.KernelEntryBytes)
					if err != nil {
						return err
					}
					defer table.Free()
					enqueue = func(c *cuda.Copies, _ bool) error { return k.Launch(c, table.Bytes(), w.Stream()) }
				}
				src, err := r.Malloc(0, page*pages)
				if err != nil {
					return err
				}
				defer src.Close()
				dst, err := r.Malloc(0, page*pages)
				if err != nil {
					return err
				}
				defer dst.Close()
				host, err := r.HostAlloc(page * pages)
				if err != nil {
					return err
				}
				defer host.Free()
				want := make([]byte, page*pages)
				for i := range want {
					want[i] = byte(i*7 + i/page)
				}
				if err := r.CopySync(src.Ptr(), uintptr(unsafe.Pointer(&want[0])), uintptr(len(want))); err != nil {
					return err
				}
				// Gather pages in reverse order.
				var c cuda.Copies
				for i := range pages {
					c.Add(host.Ptr()+uintptr(i*page), src.Ptr()+uintptr((pages-1-i)*page), page)
				}
				batches, launches := fake.Count(cudatest.OpBatch), fake.Count(cudatest.OpLaunch)
				if err := enqueue(&c, false); err != nil {
					return err
				}
				if (fake.Count(cudatest.OpBatch) > batches) != (mode == cuda.CopyBatch) {
					t.Errorf("mode %v: batch calls %d → %d", mode, batches, fake.Count(cudatest.OpBatch))
				}
				if n := fake.Count(cudatest.OpLaunch) - launches; (mode == cuda.CopyKernel) != (n == 1) {
					t.Errorf("mode %v: %d kernel launches for one gather", mode, n)
				}
				if bytes.Equal(host.Bytes()[:page], want[(pages-1)*page:]) {
					t.Errorf("bytes arrived before the stream was synchronized: the fake must defer copies")
				}
				if err := r.Sync(w.Stream()); err != nil {
					return err
				}
				for i := range pages {
					if !bytes.Equal(host.Bytes()[i*page:(i+1)*page], want[(pages-1-i)*page:(pages-i)*page]) {
						// Not t.Fatalf: this runs on the worker's thread, and
						// Goexit there would leave Do waiting forever.
						return fmt.Errorf("gathered page %d differs", i)
					}
				}
				c.Reset()
				for i := range pages {
					c.Add(dst.Ptr()+uintptr((pages-1-i)*page), host.Ptr()+uintptr(i*page), page)
				}
				if err := enqueue(&c, true); err != nil {
					return err
				}
				// The data paths' wait: a blocking event on the stream.
				ev, err := r.NewBlockingEvent()
				if err != nil {
					return err
				}
				defer r.DestroyEvent(ev)
				if err := r.Record(ev, w.Stream()); err != nil {
					return err
				}
				if err := r.Wait(ev); err != nil {
					return err
				}
				got := make([]byte, len(want))
				if err := r.CopySync(uintptr(unsafe.Pointer(&got[0])), dst.Ptr(), uintptr(len(got))); err != nil {
					return err
				}
				if !bytes.Equal(got, want) {
					return errors.New("scattered bytes differ")
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestParseCopyModeReadsWhatStringWrites(t *testing.T) {
	for _, m := range []cuda.CopyMode{cuda.CopyAuto, cuda.CopySegments, cuda.CopyBatch, cuda.CopyKernel} {
		if got, err := cuda.ParseCopyMode(m.String()); err != nil || got != m {
			t.Errorf("ParseCopyMode(%q) = %v, %v", m.String(), got, err)
		}
	}
	if got, err := cuda.ParseCopyMode(""); err != nil || got != cuda.CopyAuto {
		t.Errorf("ParseCopyMode(\"\") = %v, %v; want auto", got, err)
	}
	if _, err := cuda.ParseCopyMode("dma"); err == nil || !strings.Contains(err.Error(), `"dma"`) {
		t.Errorf("ParseCopyMode(\"dma\"): %v, want an error naming it", err)
	}
}

func TestKernelCopyableNeedsAlignedCopiesThatFitTheTable(t *testing.T) {
	cases := []struct {
		name           string
		dst, src, size uintptr
		n, maxEntries  int
		want           bool
	}{
		{"aligned pages", 1 << 20, 2 << 20, 64 << 10, 4, 4, true},
		{"more copies than entries", 1 << 20, 2 << 20, 64 << 10, 5, 4, false},
		{"no copies", 1 << 20, 2 << 20, 64 << 10, 0, 4, false},
		{"odd length", 1 << 20, 2 << 20, 64<<10 + 8, 1, 4, false},
		{"odd source", 1 << 20, 2<<20 + 4, 64 << 10, 1, 4, false},
		{"odd destination", 1<<20 + 1, 2 << 20, 64 << 10, 1, 4, false},
		{"16-byte granules", 1<<20 + 16, 2<<20 + 32, 48, 2, 4, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var cp cuda.Copies
			for i := range c.n {
				cp.Add(c.dst+uintptr(i)*c.size, c.src+uintptr(i)*c.size, c.size)
			}
			if got := cuda.KernelCopyable(&cp, c.maxEntries); got != c.want {
				t.Errorf("KernelCopyable = %v, want %v", got, c.want)
			}
		})
	}
}

func TestKernelFaultsAreDriverErrorsAndBadCopiesAreRefused(t *testing.T) {
	r, fake := open(t)
	w := worker(t, r, 0)
	err := withCopyKernel(w, r, 4, func(k *cuda.Kernel, m *cuda.DeviceMemory, h *cuda.Pinned, table []byte) error {
		var cp cuda.Copies
		cp.Add(h.Ptr(), m.Ptr(), 1<<12)
		fake.Fail(cudatest.OpLaunch, 1, 719)
		err := k.Launch(&cp, table, w.Stream())
		var de *cuda.DriverError
		if !errors.As(err, &de) || de.Code != 719 || !strings.Contains(err.Error(), "cuLaunchKernel: CUDA_ERROR_LAUNCH_FAILED") {
			t.Errorf("failed launch: %v, want a DriverError naming cuLaunchKernel and CUDA_ERROR_LAUNCH_FAILED", err)
		}
		cp.Reset()
		cp.Add(h.Ptr()+8, m.Ptr(), 1<<12)
		launches := fake.Count(cudatest.OpLaunch)
		if err := k.Launch(&cp, table, w.Stream()); err == nil || !strings.Contains(err.Error(), "aligned") {
			t.Errorf("unaligned copy: %v, want a refusal naming the alignment", err)
		}
		if fake.Count(cudatest.OpLaunch) != launches {
			t.Error("an unaligned copy reached the driver")
		}
		cp.Reset()
		cp.Add(h.Ptr(), m.Ptr(), 1<<12)
		if err := k.Launch(&cp, table[1:], w.Stream()); err == nil || !strings.Contains(err.Error(), "table") {
			t.Errorf("a table that is not 8-byte aligned: %v, want a refusal naming it", err)
		}
		if fake.Count(cudatest.OpLaunch) != launches {
			t.Error("a launch with a misaligned table reached the driver")
		}
		if err := r.Enqueue(&cp, false, cuda.CopyKernel, w.Stream()); err == nil {
			t.Error("Enqueue accepted CopyKernel, which only Kernel.Launch moves")
		}
		return r.Sync(w.Stream())
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := (&cuda.DriverError{Func: "cuModuleLoadDataEx", Code: 218, Log: "ptxas: syntax error"}).Error(); err != "cuda: cuModuleLoadDataEx: CUDA_ERROR_INVALID_PTX: ptxas: syntax error" {
		t.Errorf("DriverError prints %q", err)
	}
}

// TestKernelLaunchOnABrokenContextIsSticky: a kernel launch on a device
// whose context a sticky error broke fails with the driver's code for it,
// and that DriverError matches ErrSticky as the runtime's and cuFile's
// sticky codes do: the GPU movers count the job as a device fault.
func TestKernelLaunchOnABrokenContextIsSticky(t *testing.T) {
	r, fake := open(t)
	w := worker(t, r, 0)
	err := withCopyKernel(w, r, 1, func(k *cuda.Kernel, m *cuda.DeviceMemory, h *cuda.Pinned, table []byte) error {
		var cp cuda.Copies
		cp.Add(h.Ptr(), m.Ptr(), 1<<12)
		fake.BreakDevice(0, int(cuda.ErrorIllegalAddress))
		err := k.Launch(&cp, table, w.Stream())
		fake.BreakDevice(0, 0)
		var de *cuda.DriverError
		if !errors.As(err, &de) || de.Code != int(cuda.ErrorIllegalAddress) {
			t.Fatalf("launch on a broken context: %v, want a DriverError of CUDA_ERROR_ILLEGAL_ADDRESS", err)
		}
		if !errors.Is(err, cuda.ErrSticky) {
			t.Errorf("launch on a broken context: errors.Is(%v, ErrSticky) = false", err)
		}
		if errors.Is(&cuda.DriverError{Func: "cuModuleLoadDataEx", Code: 218}, cuda.ErrSticky) {
			t.Error("CUDA_ERROR_INVALID_PTX matches ErrSticky")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestCopyFaultsAreErrors(t *testing.T) {
	r, fake := open(t)
	w := worker(t, r, 0)
	cases := []struct {
		name string
		op   cudatest.Op
		mode cuda.CopyMode
		code cuda.Error
	}{
		{"enqueue-segments", cudatest.OpCopy, cuda.CopySegments, cuda.ErrorInvalidValue},
		{"enqueue-batch", cudatest.OpCopy, cuda.CopyBatch, cuda.ErrorIllegalAddress},
		{"sync", cudatest.OpSync, cuda.CopySegments, cuda.ErrorLaunchFailure},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := w.Do(context.Background(), func(w *cuda.Worker) error {
				m, h, free, err := deviceAndHost(r, 1<<16)
				if err != nil {
					return err
				}
				defer free()
				var cp cuda.Copies
				for i := range 4 {
					cp.Add(h.Ptr()+uintptr(i<<12), m.Ptr()+uintptr(i<<12), 1<<12)
				}
				fake.Fail(c.op, 3, int(c.code))
				defer fake.Fail(c.op, 0, 0)
				if err := r.Enqueue(&cp, false, c.mode, w.Stream()); err != nil {
					// Copies enqueued before the failure still run: wait
					// for them before the memory is freed.
					return errors.Join(err, r.Sync(w.Stream()))
				}
				// Two syncs: the fault is the third operation.
				if err := r.Sync(w.Stream()); err != nil {
					return err
				}
				if err := r.Sync(w.Stream()); err != nil {
					return err
				}
				return r.Sync(w.Stream())
			})
			if !errors.Is(err, c.code) {
				t.Fatalf("err = %v, want %v", err, c.code)
			}
		})
	}
}

func TestOpenIPCChecksHandleDeviceAndBounds(t *testing.T) {
	r, fake := open(t)
	w0, w1 := worker(t, r, 0), worker(t, r, 1)
	ctx := context.Background()
	var mem *cuda.DeviceMemory
	var handle [cuda.IPCHandleSize]byte
	err := w0.Do(ctx, func(w *cuda.Worker) error {
		var err error
		if mem, err = r.Malloc(0, 1<<20); err != nil {
			return err
		}
		handle, err = mem.IPCHandle()
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	forged := handle
	forged[0] ^= 0xff
	cases := []struct {
		name             string
		w                *cuda.Worker
		h                [cuda.IPCHandleSize]byte
		off, n, declared int64
		peer             bool // the driver maps other devices' memory (peer access)
		want             error
	}{
		{"whole", w0, handle, 0, 1 << 20, 1 << 20, false, nil},
		{"inner range", w0, handle, 4096, 8192, 1 << 20, false, nil},
		{"past declared size", w0, handle, 4096, 1 << 20, 1 << 20, false, cuda.ErrBounds},
		{"negative offset", w0, handle, -1, 10, 1 << 20, false, cuda.ErrBounds},
		{"declared larger than the allocation", w0, handle, 0, 2 << 20, 2 << 20, false, cuda.ErrBounds},
		{"forged handle", w0, forged, 0, 4096, 1 << 20, false, cuda.ErrorMapBufferObjectFailed},
		{"other device", w1, handle, 0, 4096, 1 << 20, false, cuda.ErrorInvalidDevice},
		// As on two H200s over NVLink: imported, and the driver cannot say
		// it is another device's (docs/gpu.md).
		{"other device over peer access is imported", w1, handle, 0, 4096, 1 << 20, true, nil},
		{"own device with peer access on", w0, handle, 0, 4096, 1 << 20, true, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			fake.PeerAccess(c.peer)
			defer fake.PeerAccess(false)
			err := c.w.Do(ctx, func(w *cuda.Worker) error {
				m, err := r.OpenIPC(w.Ordinal(), c.h, c.off, c.n, c.declared)
				if err != nil {
					return err
				}
				defer m.Close()
				if m.Ptr() != mem.Ptr()+uintptr(c.off) || m.Len() != c.n || m.AllocSize != 1<<20 {
					t.Errorf("import at %#x len %d alloc %d, want %#x %d %d", m.Ptr(), m.Len(), m.AllocSize, mem.Ptr()+uintptr(c.off), c.n, 1<<20)
				}
				return nil
			})
			if c.want == nil && err != nil || c.want != nil && !errors.Is(err, c.want) {
				t.Fatalf("err = %v, want %v", err, c.want)
			}
		})
	}
	// A freed allocation's handle is stale.
	w0.Do(ctx, func(*cuda.Worker) error { return mem.Close() })
	err = w0.Do(ctx, func(w *cuda.Worker) error {
		_, err := r.OpenIPC(0, handle, 0, 4096, 1<<20)
		return err
	})
	if !errors.Is(err, cuda.ErrorMapBufferObjectFailed) {
		t.Fatalf("stale handle: %v, want ErrorMapBufferObjectFailed", err)
	}
}

func TestWorkerClosedRefusesWork(t *testing.T) {
	r, _ := open(t)
	w, err := r.NewWorker(0)
	if err != nil {
		t.Fatal(err)
	}
	ran := false
	if err := w.Do(context.Background(), func(*cuda.Worker) error { ran = true; return nil }); err != nil || !ran {
		t.Fatalf("Do: %v ran %v", err, ran)
	}
	w.Close()
	if err := w.Do(context.Background(), func(*cuda.Worker) error { return nil }); !errors.Is(err, cuda.ErrClosed) {
		t.Fatalf("Do after Close: %v, want ErrClosed", err)
	}
}

func TestPinnedCopyTimesMeasuresBothDirectionsAndReportsFaults(t *testing.T) {
	r, fake := open(t)
	w, err := r.NewWorker(0)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	var h2d, d2h time.Duration
	if err := w.Do(context.Background(), func(w *cuda.Worker) (err error) {
		h2d, d2h, err = w.PinnedCopyTimes(1<<20, 3)
		return err
	}); err != nil || h2d <= 0 || d2h <= 0 {
		t.Fatalf("PinnedCopyTimes = %v, %v, %v", h2d, d2h, err)
	}
	before := fake.Count(cudatest.OpCopy)
	fake.Fail(cudatest.OpCopy, 1, int(cuda.ErrorIllegalAddress))
	err = w.Do(context.Background(), func(w *cuda.Worker) error {
		_, _, err := w.PinnedCopyTimes(1<<20, 3)
		return err
	})
	if !errors.Is(err, cuda.ErrorIllegalAddress) {
		t.Fatalf("a failed copy gave %v (copies before: %d), want ErrorIllegalAddress", err, before)
	}
}

// deviceAndHost allocates n bytes on device 0 and n pinned host bytes;
// free releases both.
// withCopyKernel runs f on w with the copy kernel loaded, 64 KiB of
// device memory m and of pinned memory h, and a table of entries kernel
// entries in h, away from the copy's bytes: the table lives in pinned
// memory as the mover's do (a Go byte slice need not be 8-byte aligned).
func withCopyKernel(w *cuda.Worker, r *cuda.Runtime, entries int, f func(k *cuda.Kernel, m *cuda.DeviceMemory, h *cuda.Pinned, table []byte) error) error {
	return w.Do(context.Background(), func(w *cuda.Worker) error {
		k, err := r.LoadCopyKernel()
		if err != nil {
			return err
		}
		defer k.Unload()
		m, h, free, err := deviceAndHost(r, 1<<16)
		if err != nil {
			return err
		}
		defer free()
		const tableOff = 32 << 10
		return f(k, m, h, h.Bytes()[tableOff:tableOff+entries*cuda.KernelEntryBytes])
	})
}

func deviceAndHost(r *cuda.Runtime, n int) (*cuda.DeviceMemory, *cuda.Pinned, func(), error) {
	m, err := r.Malloc(0, int64(n))
	if err != nil {
		return nil, nil, nil, err
	}
	h, err := r.HostAlloc(n)
	if err != nil {
		m.Close()
		return nil, nil, nil, err
	}
	return m, h, func() { h.Free(); m.Close() }, nil
}

// TestDoneAnswersWithoutWaitingAndReportsFailedCopies: Done is false while
// the copies run (the fake answers "not ready" busy times), true once they
// completed, with their bytes on the device, and a failure ends the polls
// with the failure's error.
func TestDoneAnswersWithoutWaitingAndReportsFailedCopies(t *testing.T) {
	r, fake := open(t)
	w := worker(t, r, 0)
	cases := []struct {
		name  string
		busy  int        // "not ready" answers the fake gives first
		fault cuda.Error // the query's injected failure, or 0
	}{
		{"ready-at-once", 0, 0},
		{"ready-after-three-polls", 3, 0},
		{"failed after two polls", 2, cuda.ErrorIllegalAddress},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			fake.Busy(c.busy)
			defer fake.Busy(0)
			err := w.Do(context.Background(), func(w *cuda.Worker) error {
				m, h, free, err := deviceAndHost(r, 1<<16)
				if err != nil {
					return err
				}
				defer free()
				src := h.Bytes()
				for i := range src {
					src[i] = byte(i * 7)
				}
				ev, err := r.NewBlockingEvent()
				if err != nil {
					return err
				}
				defer r.DestroyEvent(ev)
				if err := r.CopyH2D(m.Ptr(), h.Ptr(), uintptr(len(src)), w.Stream()); err != nil {
					return err
				}
				if err := r.Record(ev, w.Stream()); err != nil {
					return err
				}
				if c.fault != 0 { // the poll after the busy ones fails
					fake.Fail(cudatest.OpQuery, c.busy+1, int(c.fault))
					defer fake.Fail(cudatest.OpQuery, 0, 0)
				}
				polls := 0
				for {
					polls++
					done, err := r.Done(ev)
					if err != nil {
						if !done {
							return fmt.Errorf("poll %d: Done = false, %v: an error must end the wait", polls, err)
						}
						if polls != c.busy+1 {
							return fmt.Errorf("the failure came at poll %d, want %d", polls, c.busy+1)
						}
						return errors.Join(err, r.Sync(w.Stream()))
					}
					if done {
						break
					}
					if polls > c.busy {
						return fmt.Errorf("still not done after %d polls, want done at poll %d", polls, c.busy+1)
					}
				}
				if polls != c.busy+1 {
					return fmt.Errorf("done at poll %d, want %d", polls, c.busy+1)
				}
				got := make([]byte, len(src))
				if err := r.CopySync(uintptr(unsafe.Pointer(&got[0])), m.Ptr(), uintptr(len(got))); err != nil {
					return err
				}
				if !bytes.Equal(got, src) {
					return errors.New("Done said done, but the copy's bytes are not on the device")
				}
				return nil
			})
			if c.fault != 0 {
				if !errors.Is(err, c.fault) {
					t.Fatalf("err = %v, want %v", err, c.fault)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestOpenIPCRefusesARangeItCannotCheck(t *testing.T) {
	path := cudatest.Build(t)
	cases := []struct {
		name   string
		driver []string // the driver API's paths; a missing one: not loaded
		fail   bool     // cuMemGetAddressRange fails
	}{
		{"no driver API", []string{filepath.Join(t.TempDir(), "libcuda-missing.so")}, false},
		{"the driver cannot say", []string{path}, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r, err := cuda.Open(cuda.Config{Runtime: []string{path}, Driver: c.driver})
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			fake := cudatest.Open(t, path)
			w := worker(t, r, 0)
			ctx := context.Background()
			err = w.Do(ctx, func(w *cuda.Worker) error {
				mem, err := r.Malloc(0, 1<<20)
				if err != nil {
					return err
				}
				defer mem.Close()
				handle, err := mem.IPCHandle()
				if err != nil {
					return err
				}
				if c.fail {
					fake.Fail(cudatest.OpAddressRange, 1, 1)
					defer fake.Fail(cudatest.OpAddressRange, 0, 0)
				}
				opened, closed := fake.Count(cudatest.OpIPCOpen), fake.Count(cudatest.OpIPCClose)
				m, err := r.OpenIPC(0, handle, 0, 4096, 1<<20)
				if err == nil {
					m.Close()
				}
				if o, c := fake.Count(cudatest.OpIPCOpen)-opened, fake.Count(cudatest.OpIPCClose)-closed; o != c {
					t.Errorf("%d imports, %d closed: a refused import stays mapped", o, c)
				}
				return err
			})
			if !errors.Is(err, cuda.ErrUnchecked) {
				t.Fatalf("OpenIPC = %v, want ErrUnchecked", err)
			}
		})
	}
}

func TestStickyErrorsAreTheDeviceFaults(t *testing.T) {
	cases := []struct {
		code cuda.Error
		want bool
	}{
		{cuda.ErrorIllegalAddress, true},
		{cuda.ErrorLaunchFailure, true},
		{214, true}, // cudaErrorECCUncorrectable
		{716, true}, // cudaErrorMisalignedAddress
		// CUDA's documentation says of each of these that the process
		// must be terminated and relaunched to use CUDA again.
		{226, true},  // cudaErrorContained: a bad access to a peer's memory over NVLink, contained
		{721, true},  // cudaErrorTensorMemoryLeak
		{810, true},  // cudaErrorMpsClientTerminated
		{911, true},  // cudaErrorExternalDevice
		{720, false}, // cudaErrorCooperativeLaunchTooLarge
		{cuda.ErrorInvalidValue, false},
		{cuda.ErrorMemoryAllocation, false},
		{cuda.ErrorNotReady, false},
		{cuda.ErrorMapBufferObjectFailed, false},
	}
	for _, c := range cases {
		if got := c.code.Sticky(); got != c.want {
			t.Errorf("%v.Sticky() = %v, want %v", c.code, got, c.want)
		}
	}
}

func TestErrStickyMatchesThroughWrappedAndJoinedErrors(t *testing.T) {
	sticky := &cuda.CallError{Func: "cudaStreamSynchronize", Code: cuda.ErrorIllegalAddress}
	plain := &cuda.CallError{Func: "cudaMemcpyBatchAsync", Code: cuda.ErrorInvalidValue}
	cases := []struct {
		name string
		err  error
		want bool
	}{
		{"nil", nil, false},
		{"a plain error", plain, false},
		{"a sticky call error", sticky, true},
		{"wrapped", fmt.Errorf("gpu: %w", sticky), true},
		{"joined after a plain one", errors.Join(plain, sticky), true},
		{"joined, none sticky", errors.Join(plain, errors.New("x")), false},
		{"wrapped in a join", errors.Join(plain, fmt.Errorf("sync: %w", sticky)), true},
		{"a sticky driver result, wrapped", fmt.Errorf("cufile: %w", cuda.Result(700)), true}, // CUDA_ERROR_ILLEGAL_ADDRESS
		{"a driver result that is not sticky", cuda.Result(2), false},                         // CUDA_ERROR_OUT_OF_MEMORY
	}
	for _, c := range cases {
		if got := errors.Is(c.err, cuda.ErrSticky); got != c.want {
			t.Errorf("%s: errors.Is(%v, ErrSticky) = %v, want %v", c.name, c.err, got, c.want)
		}
	}
}

// TestStreamDoneReportsABrokenContextOnAnIdleStream: a query of a stream
// with nothing on it answers done, and a sticky error where the device's
// context is broken (the probe of a registration that makes no other
// call), on that device only.
func TestStreamDoneReportsABrokenContextOnAnIdleStream(t *testing.T) {
	r, fake := open(t)
	query := func(w *cuda.Worker) (done bool, err error) {
		err = w.Do(context.Background(), func(w *cuda.Worker) error {
			var err error
			done, err = r.StreamDone(w.Stream())
			return err
		})
		return done, err
	}
	w0, w1 := worker(t, r, 0), worker(t, r, 1)
	if done, err := query(w1); !done || err != nil {
		t.Fatalf("idle stream: StreamDone = %v, %v; want done", done, err)
	}
	fake.BreakDevice(1, int(cuda.ErrorIllegalAddress))
	defer fake.BreakDevice(1, 0)
	if done, err := query(w1); !done || !errors.Is(err, cuda.ErrSticky) {
		t.Fatalf("broken device: StreamDone = %v, %v; want done and the sticky error", done, err)
	}
	if done, err := query(w0); !done || err != nil {
		t.Fatalf("the other device: StreamDone = %v, %v; want done", done, err)
	}
}
