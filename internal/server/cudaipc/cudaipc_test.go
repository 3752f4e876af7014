package cudaipc_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/cuda/cudatest"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/internal/server/cudaipc"
	"github.com/kvhost/kvhost/protocol"
	"github.com/kvhost/kvhost/region"
)

// open opens a runtime on a fresh fake library and returns it and the
// library's path (for cudatest.Open, to control that runtime's fake).
func open(t *testing.T) (*cuda.Runtime, string) {
	t.Helper()
	path := cudatest.Build(t)
	rt, err := cuda.Open(cuda.Config{Runtime: []string{path}, Driver: []string{path}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rt.Close() })
	return rt, path
}

// newImporter starts an Importer of devices 0..devices-1 of rt (0: all),
// closed when the test ends.
func newImporter(t *testing.T, rt *cuda.Runtime, devices int) *cudaipc.Importer {
	t.Helper()
	im, err := cudaipc.New(rt, devices)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { im.Close() })
	return im
}

// exportAllocation allocates n bytes on device ordinal (on a worker of
// that device) and returns the allocation and its IPC handle; the
// allocation is freed, on that worker, when the test ends.
func exportAllocation(t *testing.T, rt *cuda.Runtime, ordinal int, n int64) (*cuda.DeviceMemory, [cuda.IPCHandleSize]byte) {
	t.Helper()
	w, err := rt.NewWorker(ordinal)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	ctx := context.Background()
	var mem *cuda.DeviceMemory
	var h [cuda.IPCHandleSize]byte
	if err := w.Do(ctx, func(*cuda.Worker) error {
		var err error
		if mem, err = rt.Malloc(ordinal, n); err != nil {
			return err
		}
		h, err = mem.IPCHandle()
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := w.Do(ctx, func(*cuda.Worker) error { return mem.Close() }); err != nil {
			t.Errorf("free the exported allocation: %v", err)
		}
	})
	return mem, h
}

func TestNewChecksDevices(t *testing.T) {
	rt, _ := open(t)
	tests := []struct {
		name    string
		devices int
		want    int // 0: New fails
	}{
		{"every device", 0, 2},
		{"first only", 1, 1},
		{"more than there are", 3, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			im, err := cudaipc.New(rt, tc.devices)
			if tc.want == 0 {
				if err == nil {
					im.Close()
					t.Fatal("New succeeded")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer im.Close()
			if im.Devices() != tc.want {
				t.Fatalf("Devices() = %d, want %d", im.Devices(), tc.want)
			}
		})
	}
}

// TestOpenImportsOnTheNamedDevice: the import runs on the named device's
// thread (a handle of device 1 opens only there), points at the range
// asked for, maps a range outside the allocation to region.ErrBounds, and
// Close releases it once.
func TestOpenImportsOnTheNamedDevice(t *testing.T) {
	rt, _ := open(t)
	im := newImporter(t, rt, 0)
	ctx := context.Background()
	mem, h := exportAllocation(t, rt, 1, 1<<20)
	if _, err := im.Open(ctx, 0, h, 0, 4096); err == nil || errors.Is(err, region.ErrBounds) {
		t.Fatalf("device 1's handle opened on device 0: %v", err)
	}
	if _, err := im.Open(ctx, 1, h, 4096, 1<<20); !errors.Is(err, region.ErrBounds) {
		t.Fatalf("range past the allocation: %v, want region.ErrBounds", err)
	}
	m, err := im.Open(ctx, 1, h, 4096, 8192)
	if err != nil {
		t.Fatal(err)
	}
	if m.Ordinal() != 1 || m.Len() != 8192 || m.Ptr() != mem.Ptr()+4096 || m.Kind() != region.KindDevice || m.(*cudaipc.Memory).AllocSize() != 1<<20 {
		t.Fatalf("import: device %d len %d ptr %#x kind %v", m.Ordinal(), m.Len(), m.Ptr(), m.Kind())
	}
	if im.Live() != 1 {
		t.Fatalf("Live() = %d, want 1", im.Live())
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	m.Close()
	if im.Live() != 0 {
		t.Fatalf("Live() = %d after Close twice, want 0", im.Live())
	}
	im.Close()
	if _, err := im.Open(ctx, 1, h, 0, 4096); !errors.Is(err, cudaipc.ErrClosed) {
		t.Fatalf("Open after Close: %v, want ErrClosed", err)
	}
}

// TestOpenSharesOneImportPerAllocation: ranges of one allocation (layers
// that are views of one tensor) share one driver import, checked against
// the allocation's size, and the import is closed with the last range.
func TestOpenSharesOneImportPerAllocation(t *testing.T) {
	rt, _ := open(t)
	im := newImporter(t, rt, 1)
	ctx := context.Background()
	mem, h := exportAllocation(t, rt, 0, 1<<20)
	a, err := im.Open(ctx, 0, h, 0, 4096)
	if err != nil {
		t.Fatal(err)
	}
	b, err := im.Open(ctx, 0, h, 512<<10, 512<<10)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := im.Open(ctx, 0, h, 512<<10, 512<<10+1); !errors.Is(err, region.ErrBounds) {
		t.Fatalf("range past the shared allocation: %v, want region.ErrBounds", err)
	}
	if im.Imports() != 1 || im.Live() != 2 {
		t.Fatalf("%d imports, %d regions; want 1, 2", im.Imports(), im.Live())
	}
	if a.Ptr() != mem.Ptr() || b.Ptr() != mem.Ptr()+512<<10 || a.ID() == b.ID() {
		t.Fatalf("ranges at %#x and %#x (ids %d, %d) of an allocation at %#x", a.Ptr(), b.Ptr(), a.ID(), b.ID(), mem.Ptr())
	}
	a.Close()
	if im.Imports() != 1 || im.Live() != 1 {
		t.Fatalf("after closing one range: %d imports, %d regions; want 1, 1", im.Imports(), im.Live())
	}
	b.Close()
	if im.Imports() != 0 || im.Live() != 0 {
		t.Fatalf("after closing both: %d imports, %d regions; want 0, 0", im.Imports(), im.Live())
	}
}

// TestAnImportOnABrokenDeviceIsTheDaemonsFaultAndCounted: where the
// daemon's context on a device is broken (every call there fails with a
// sticky error), a registration is refused as an internal error naming
// the broken context, not as the client's bad handle, and counted as a
// fault of that device only: it may be the first sign of a device that
// broke while no job ran there. That holds for a handle the daemon
// imports now and for one it imported before the device broke (a second
// region over the same allocation: no import call, the context is
// probed); the earlier region still closes, or fails naming the sticky
// error.
func TestAnImportOnABrokenDeviceIsTheDaemonsFaultAndCounted(t *testing.T) {
	rt, lib := open(t)
	fake := cudatest.Open(t, lib)
	tests := []struct {
		name     string
		imported bool // the handle was imported before the device broke
	}{
		{"a handle imported now", false},
		{"a handle already imported", true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			im := newImporter(t, rt, 0)
			ctx := context.Background()
			_, h := exportAllocation(t, rt, 1, 1<<16)
			var first server.DeviceMemory
			if tc.imported {
				var err error
				if first, err = im.Open(ctx, 1, h, 0, 4096); err != nil {
					t.Fatal(err)
				}
			}
			const illegalAddress = 700
			fake.BreakDevice(1, illegalAddress)
			defer fake.BreakDevice(1, 0) // before the allocation is freed
			_, err := im.Open(ctx, 1, h, 8192, 4096)
			var pe *protocol.Error
			if !errors.As(err, &pe) || pe.Code != protocol.CodeInternal || !strings.Contains(pe.Message, "context on this GPU is broken") {
				t.Fatalf("registration on the broken device: %v; want an internal error naming the broken context", err)
			}
			if f := im.Faults(); f[0] != 0 || f[1] != 1 {
				t.Fatalf("faults %v: want 1 on device 1, none on device 0", f)
			}
			if first == nil {
				return
			}
			if im.Live() != 1 || im.Imports() != 1 {
				t.Fatalf("after the refusal: %d regions, %d imports; want the first region's 1, 1", im.Live(), im.Imports())
			}
			if err := first.Close(); err != nil && !errors.Is(err, cuda.ErrSticky) {
				t.Fatalf("closing the first region on the broken device: %v; want success or the sticky error", err)
			}
			if im.Live() != 0 || im.Imports() != 0 {
				t.Fatalf("after closing the first region: %d regions, %d imports; want 0, 0", im.Live(), im.Imports())
			}
		})
	}
}
