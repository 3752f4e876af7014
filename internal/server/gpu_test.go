package server_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/cuda/cudatest"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/internal/server/cudaipc"
	"github.com/kvhost/kvhost/protocol"
)

// gpu is a daemon whose GPU registrations import real cuda.IPCMemory
// through a fake libcudart (two devices, "device memory" in host memory),
// and the "client process" side that allocates and exports memory.
type gpu struct {
	*fixture
	rt   *cuda.Runtime
	fake *cudatest.Fake
	im   *cudaipc.Importer
	dev  []*cuda.Worker // the client's threads, one per device
}

func newGPU(t *testing.T, cfg server.Config) *gpu {
	t.Helper()
	return newGPUWith(t, cfg, nil)
}

// newGPUWith is newGPU with the engine's configuration edited by edit
// (given the runtime, so that it can build a device mover over it).
func newGPUWith(t *testing.T, cfg server.Config, edit func(*cuda.Runtime, *engine.Config)) *gpu {
	t.Helper()
	path := cudatest.Build(t)
	rt, err := cuda.Open(cuda.Config{Runtime: []string{path}, Driver: []string{path}})
	if err != nil {
		t.Fatal(err)
	}
	g := &gpu{rt: rt, fake: cudatest.Open(t, path)}
	// Cleanups run last-registered first: the daemon stops before the
	// importer and the runtime close.
	t.Cleanup(func() { rt.Close() })
	if g.im, err = cudaipc.New(rt, 0); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.im.Close() })
	for d := range g.im.Devices() {
		w, err := rt.NewWorker(d)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { w.Close() })
		g.dev = append(g.dev, w)
	}
	cfg.OpenDevice, cfg.Devices = g.im.Open, g.im.Devices()
	var editEngine func(*engine.Config)
	if edit != nil {
		editEngine = func(c *engine.Config) { edit(rt, c) }
	}
	g.fixture = newFixtureWith(t, cfg, editEngine, nil)
	return g
}

// alloc allocates n bytes on device d as a client would, and exports it.
func (g *gpu) alloc(t *testing.T, d int, n int64) (*cuda.DeviceMemory, [cuda.IPCHandleSize]byte) {
	t.Helper()
	var m *cuda.DeviceMemory
	var h [cuda.IPCHandleSize]byte
	err := g.dev[d].Do(context.Background(), func(w *cuda.Worker) error {
		var err error
		if m, err = g.rt.Malloc(d, n); err != nil {
			return err
		}
		h, err = m.IPCHandle()
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.free(m) })
	return m, h
}

func (g *gpu) free(m *cuda.DeviceMemory) {
	g.dev[m.Ordinal()].Do(context.Background(), func(*cuda.Worker) error { return m.Close() })
}

// deviceStats returns the daemon's per-device figures as c sees them.
func deviceStats(t *testing.T, c *client.Client) []protocol.DeviceStats {
	t.Helper()
	st, err := c.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return st.Devices
}

func wantCode(t *testing.T, err error, code protocol.Code) {
	t.Helper()
	if code == protocol.CodeOK {
		if err != nil {
			t.Fatalf("err = %v, want success", err)
		}
		return
	}
	if !errors.Is(err, &protocol.Error{Code: code}) {
		t.Fatalf("err = %v, want code %q", err, code)
	}
}

// TestGPURegistrationNamesItsDevice: one daemon serves both GPUs; each
// registration lands on the device it names, is counted there in stats,
// and is closed (cudaIpcCloseMemHandle) when unregistered.
func TestGPURegistrationNamesItsDevice(t *testing.T) {
	g := newGPU(t, server.Config{})
	c := g.dial(t)
	ctx := context.Background()
	m0, h0 := g.alloc(t, 0, 1<<20)
	m1, h1 := g.alloc(t, 1, 2<<20)
	r0, err := c.RegisterCUDAIPC(ctx, 0, h0, 4096, 8192)
	wantCode(t, err, protocol.CodeOK)
	r1, err := c.RegisterCUDAIPC(ctx, 1, h1, 0, 2<<20)
	wantCode(t, err, protocol.CodeOK)
	if r0 == r1 {
		t.Fatalf("two registrations got the same region id %d", r0)
	}
	want := []protocol.DeviceStats{
		{Ordinal: 0, Regions: 1, Registered: 8192, Limit: server.DefaultMaxDeviceBytes},
		{Ordinal: 1, Regions: 1, Registered: 2 << 20, Limit: server.DefaultMaxDeviceBytes},
	}
	if got := deviceStats(t, c); len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("device stats %+v, want %+v", got, want)
	}
	if g.im.Live() != 2 {
		t.Fatalf("%d imports live, want 2", g.im.Live())
	}
	wantCode(t, c.UnregisterMemory(ctx, r0), protocol.CodeOK)
	wantCode(t, c.UnregisterMemory(ctx, r1), protocol.CodeOK)
	if got := deviceStats(t, c); got[0].Registered != 0 || got[1].Registered != 0 || got[0].Regions != 0 {
		t.Fatalf("after unregistering: %+v", got)
	}
	if g.im.Live() != 0 {
		t.Fatalf("%d imports live after unregistering, want 0", g.im.Live())
	}
	_, _ = m0, m1
}

// TestGPURegistrationRefusesBadInput: a handle for another device (without
// peer access between the devices), a stale or forged handle, a range
// outside the exported allocation, a device the daemon does not serve and
// a driver failure each get a clear error code; nothing stays imported,
// and the daemon then registers good memory for the same client.
func TestGPURegistrationRefusesBadInput(t *testing.T) {
	g := newGPU(t, server.Config{})
	c := g.dial(t)
	ctx := context.Background()
	_, h0 := g.alloc(t, 0, 1<<20)
	_, h1 := g.alloc(t, 1, 1<<20)
	freed, stale := g.alloc(t, 0, 1<<20)
	g.free(freed)
	forged := h0
	forged[0] ^= 0xff
	tests := []struct {
		name         string
		device       int
		handle       [64]byte
		offset, size int64
		fault        bool // the driver fails the import (cudaErrorDevicesUnavailable)
		want         protocol.Code
		says         string // in the error message
	}{
		{"another device's handle", 0, h1, 0, 4096, false, protocol.CodeBadHandle, "IPC handle"},
		{"stale handle", 0, stale, 0, 4096, false, protocol.CodeBadHandle, "IPC handle"},
		{"forged handle", 0, forged, 0, 4096, false, protocol.CodeBadHandle, "IPC handle"},
		{"range past the allocation", 0, h0, 4096, 1 << 20, false, protocol.CodeInvalid, "not inside the exported allocation"},
		{"allocation larger than it is", 0, h0, 0, 2 << 20, false, protocol.CodeInvalid, "not inside the exported allocation"},
		{"offset far past the allocation", 0, h0, 1 << 40, 4096, false, protocol.CodeInvalid, "not inside the exported allocation"},
		{"device not served", 2, h0, 0, 4096, false, protocol.CodeInvalid, "device 2"},
		{"larger than the device bound", 0, h0, 0, server.DefaultMaxDeviceBytes + 1, false, protocol.CodeLimit, "exceeds"},
		{"driver failure", 0, h0, 0, 4096, true, protocol.CodeBadHandle, "IPC handle"},
		{"good range after all that", 0, h0, 0, 1 << 20, false, protocol.CodeOK, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.fault {
				g.fake.Fail(cudatest.OpIPCOpen, 1, 46)
				defer g.fake.Fail(cudatest.OpIPCOpen, 0, 0)
			}
			_, err := c.RegisterCUDAIPC(ctx, tc.device, tc.handle, tc.offset, tc.size)
			wantCode(t, err, tc.want)
			if err != nil && !strings.Contains(err.Error(), tc.says) {
				t.Fatalf("error %q does not say %q", err, tc.says)
			}
			live := 0
			if tc.want == protocol.CodeOK {
				live = 1
			}
			if g.im.Live() != live {
				t.Fatalf("%d imports live, want %d", g.im.Live(), live)
			}
			if got := deviceStats(t, c); got[0].Regions != uint64(live) {
				t.Fatalf("device 0 counts %d regions, want %d", got[0].Regions, live)
			}
		})
	}
}

// TestGPUAnotherDevicesHandleOverPeerAccessIsCountedOnTheClaimedDevice:
// where the devices have peer access the driver imports another device's
// allocation and reports it as the importing device's (measured on two
// H200s over NVLink), so the daemon cannot refuse it: the registration is
// accepted and counted, bytes and region, on the device the client named,
// and unregistering it returns them.
func TestGPUAnotherDevicesHandleOverPeerAccessIsCountedOnTheClaimedDevice(t *testing.T) {
	g := newGPU(t, server.Config{})
	c := g.dial(t)
	ctx := context.Background()
	_, h1 := g.alloc(t, 1, 1<<20)
	g.fake.PeerAccess(true)
	defer g.fake.PeerAccess(false)
	id, err := c.RegisterCUDAIPC(ctx, 0, h1, 0, 1<<20)
	wantCode(t, err, protocol.CodeOK)
	if got := deviceStats(t, c); got[0].Regions != 1 || got[0].Registered != 1<<20 || got[1].Regions != 0 || got[1].Registered != 0 {
		t.Fatalf("device stats %+v: want device 0 (the one named) to count the region and its bytes", got)
	}
	wantCode(t, c.UnregisterMemory(ctx, id), protocol.CodeOK)
	if got := deviceStats(t, c); got[0].Regions != 0 || got[0].Registered != 0 || g.im.Live() != 0 {
		t.Fatalf("after unregistering: %+v, %d imports live", got, g.im.Live())
	}
}

// TestGPUStatsNameEachDeviceByUUID: the UUIDs of Config.DeviceUUIDs reach
// the clients in Stats, by ordinal; a device without one reads zero.
func TestGPUStatsNameEachDeviceByUUID(t *testing.T) {
	u0, u1 := [16]byte{0: 0xA, 15: 0x1}, [16]byte{0: 0xB}
	g := newGPU(t, server.Config{DeviceUUIDs: [][16]byte{u0}})
	c := g.dial(t)
	got := deviceStats(t, c)
	if len(got) != 2 || got[0].UUID != u0 || got[1].UUID != ([16]byte{}) {
		t.Fatalf("device stats %+v: want device 0 named %x and device 1 unnamed", got, u0)
	}
	ctx := context.Background()
	if d, err := c.DeviceByUUID(ctx, u0); err != nil || d != 0 {
		t.Fatalf("DeviceByUUID(%x) = %d, %v; want device 0", u0, d, err)
	}
	for _, u := range [][16]byte{u1, {}} { // a GPU it does not serve; the zero UUID names nothing
		if _, err := c.DeviceByUUID(ctx, u); !errors.Is(err, client.ErrUnknownDevice) {
			t.Fatalf("DeviceByUUID(%x): %v, want ErrUnknownDevice", u, err)
		}
	}
}

// TestGPURegistrationLimits: the registered bytes of a device are bounded
// over all clients, independently per device; MaxRegistrations counts GPU
// regions too; bytes come back when a region is unregistered.
func TestGPURegistrationLimits(t *testing.T) {
	const bound = 1 << 20
	g := newGPU(t, server.Config{MaxDeviceBytes: bound, MaxRegistrations: 3})
	ctx := context.Background()
	a, b := g.dial(t), g.dial(t)
	_, h0 := g.alloc(t, 0, bound)
	_, h1 := g.alloc(t, 1, bound)
	first, err := a.RegisterCUDAIPC(ctx, 0, h0, 0, bound/2)
	wantCode(t, err, protocol.CodeOK)
	_, err = a.RegisterCUDAIPC(ctx, 0, h0, bound/2, bound/2)
	wantCode(t, err, protocol.CodeOK)
	_, err = b.RegisterCUDAIPC(ctx, 0, h0, 0, 4096)
	wantCode(t, err, protocol.CodeLimit) // device 0 is full, whoever asks
	_, err = b.RegisterCUDAIPC(ctx, 1, h1, 0, bound)
	wantCode(t, err, protocol.CodeOK) // device 1 has its own bound
	_, err = a.RegisterCUDAIPC(ctx, 1, h1, 0, 4096)
	wantCode(t, err, protocol.CodeLimit)
	wantCode(t, a.UnregisterMemory(ctx, first), protocol.CodeOK)
	_, err = b.RegisterCUDAIPC(ctx, 0, h0, 0, 4096)
	wantCode(t, err, protocol.CodeOK)
	// a holds one region; two more reach MaxRegistrations.
	_, err = a.RegisterCUDAIPC(ctx, 0, h0, 0, 4096)
	wantCode(t, err, protocol.CodeOK)
	_, err = a.RegisterCUDAIPC(ctx, 0, h0, 0, 4096)
	wantCode(t, err, protocol.CodeOK)
	_, err = a.RegisterCUDAIPC(ctx, 0, h0, 0, 4096)
	wantCode(t, err, protocol.CodeLimit)
	if st := deviceStats(t, a); st[0].Limit != bound || st[0].Regions != 4 || st[1].Registered != bound {
		t.Fatalf("device stats %+v", st)
	}
}

// TestSessionEndClosesGPUMemory: a client that goes away without
// unregistering gets every import closed and its bytes given back, and
// the daemon keeps serving the other client.
func TestSessionEndClosesGPUMemory(t *testing.T) {
	g := newGPU(t, server.Config{})
	ctx := context.Background()
	stay := g.dial(t)
	leave, err := client.Dial(ctx, g.socket, "leaving")
	if err != nil {
		t.Fatal(err)
	}
	_, h0 := g.alloc(t, 0, 1<<20)
	_, h1 := g.alloc(t, 1, 1<<20)
	for _, r := range []struct {
		dev int
		h   [64]byte
	}{{0, h0}, {0, h0}, {1, h1}} {
		_, err := leave.RegisterCUDAIPC(ctx, r.dev, r.h, 0, 1<<20)
		wantCode(t, err, protocol.CodeOK)
	}
	kept, err := stay.RegisterCUDAIPC(ctx, 1, h1, 0, 4096)
	wantCode(t, err, protocol.CodeOK)
	if g.im.Live() != 4 {
		t.Fatalf("%d imports live, want 4", g.im.Live())
	}
	leave.Close()
	if err := g.srv.WaitSessions(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if g.im.Live() != 1 || g.im.Imports() != 1 {
		t.Fatalf("%d regions, %d imports live after the client left, want 1, 1 (the other client's)", g.im.Live(), g.im.Imports())
	}
	st := deviceStats(t, stay)
	if st[0].Regions != 0 || st[0].Registered != 0 || st[1].Regions != 1 || st[1].Registered != 4096 {
		t.Fatalf("device stats after the client left: %+v", st)
	}
	wantCode(t, stay.UnregisterMemory(ctx, kept), protocol.CodeOK)
}
