package server_test

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/cuda/cudatest"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/protocol"
	"github.com/kvhost/kvhost/region"
	staginggpu "github.com/kvhost/kvhost/staging/gpu"
	"github.com/kvhost/kvhost/transfer"
)

// gateMover is the device mover of a test: calls that touch the device
// range [lo, hi) wait at the gate until it opens, whatever their context
// says (a DMA under way does not stop when its job is cancelled); every
// other call goes straight to the real mover.
type gateMover struct {
	transfer.Mover
	lo, hi  atomic.Uintptr
	open    chan struct{}
	opened  sync.Once
	arrived chan context.Context // one per held call
}

// release opens the gate (once).
func (g *gateMover) release() { g.opened.Do(func() { close(g.open) }) }

func (g *gateMover) held(p *transfer.Plan) bool {
	for _, e := range p.Extents {
		if d, ok := e.Region.(region.Device); ok && d.Ptr() >= g.lo.Load() && d.Ptr() < g.hi.Load() {
			return true
		}
	}
	return false
}

func (g *gateMover) WriteFile(ctx context.Context, f fsys.File, p *transfer.Plan, sums []uint32) (int64, error) {
	if g.held(p) {
		g.arrived <- ctx
		<-g.open
	}
	return g.Mover.WriteFile(ctx, f, p, sums)
}

func (g *gateMover) ReadFile(ctx context.Context, f fsys.File, p *transfer.Plan, sums []uint32) (int64, error) {
	if g.held(p) {
		g.arrived <- ctx
		<-g.open
	}
	return g.Mover.ReadFile(ctx, f, p, sums)
}

// gpuCache is a client's paged cache in device memory: geo's layers, each
// plane of numBlocks blocks, one allocation.
type gpuCache struct {
	mem    *cuda.DeviceMemory
	handle [cuda.IPCHandleSize]byte
	ns     client.Namespace
	region client.RegionID
	cache  client.CacheID
}

const gpuBlocks = 16

// registerGPUCache allocates and exports device memory on device 0 as c's
// process would, fills it with random bytes, and registers it as a cache.
func (g *gpu) registerGPUCache(t *testing.T, c *client.Client, seed uint64) *gpuCache {
	t.Helper()
	return g.registerGPUCacheOn(t, c, seed, 0)
}

// registerGPUCacheOn is registerGPUCache on device d.
func (g *gpu) registerGPUCacheOn(t *testing.T, c *client.Client, seed uint64, d int) *gpuCache {
	t.Helper()
	ctx := context.Background()
	bb := int64(geo.TokensPerBlock * geo.KVHeads * geo.HeadSize * geo.DtypeSize)
	layer := 2 * gpuBlocks * bb
	mem, h := g.alloc(t, d, int64(geo.Layers)*layer)
	fill := make([]byte, mem.Len())
	r := rand.New(rand.NewPCG(seed, 1))
	for i := range fill {
		fill[i] = byte(r.Uint32())
	}
	g.copyDevice(t, mem, fill, true)
	ns, err := c.Declare(ctx, geo)
	if err != nil {
		t.Fatal(err)
	}
	rid, err := c.RegisterCUDAIPC(ctx, d, h, 0, mem.Len())
	if err != nil {
		t.Fatal(err)
	}
	var layers []client.Layer
	for l := range int(geo.Layers) {
		layers = append(layers, client.Layer{Region: uint32(rid), NumBlocks: gpuBlocks, Offset: int64(l) * layer, BlockStride: bb, PlaneStride: gpuBlocks * bb})
	}
	cid, err := c.RegisterCache(ctx, ns.ID, layers)
	if err != nil {
		t.Fatal(err)
	}
	return &gpuCache{mem: mem, handle: h, ns: ns, region: rid, cache: cid}
}

// copyDevice copies between host bytes and fake device memory on device
// 0's client thread.
func (g *gpu) copyDevice(t *testing.T, mem *cuda.DeviceMemory, host []byte, toDevice bool) {
	t.Helper()
	h, dev := uintptr(unsafe.Pointer(&host[0])), mem.Ptr()
	err := g.dev[mem.Ordinal()].Do(context.Background(), func(*cuda.Worker) error {
		if toDevice {
			return g.rt.CopySync(dev, h, uintptr(len(host)))
		}
		return g.rt.CopySync(h, dev, uintptr(len(host)))
	})
	if err != nil {
		t.Fatal(err)
	}
}

// roundTrip stores keys from blocks 0..3 of gc, poisons blocks 8..11,
// loads the keys there and compares every block of every layer and plane.
func (g *gpu) roundTrip(t *testing.T, c *client.Client, gc *gpuCache, keys [][]byte) {
	t.Helper()
	ctx := context.Background()
	bpk := int(geo.TokensPerKey / geo.TokensPerBlock)
	var src, dst [][]uint32
	for i := range keys {
		var s, d []uint32
		for b := range bpk {
			s = append(s, uint32(i*bpk+b))
			d = append(d, uint32(8+i*bpk+b))
		}
		src, dst = append(src, s), append(dst, d)
	}
	job, err := c.Store(ctx, gc.cache, keys, src)
	if err != nil {
		t.Fatal(err)
	}
	if res, err := job.Wait(ctx); err != nil || res.Count(protocol.OutcomeStored) != len(keys) {
		t.Fatalf("store: %+v, %v", res, err)
	}
	before := make([]byte, gc.mem.Len())
	g.copyDevice(t, gc.mem, before, false)
	poisoned := bytes.Clone(before)
	bb := int64(geo.TokensPerBlock * geo.KVHeads * geo.HeadSize * geo.DtypeSize)
	block := func(l, p int, b uint32) int64 { return int64(l)*2*gpuBlocks*bb + int64(p)*gpuBlocks*bb + int64(b)*bb }
	for l := range int(geo.Layers) {
		for p := range 2 {
			for _, d := range dst {
				for _, b := range d {
					for i := block(l, p, b); i < block(l, p, b)+bb; i++ {
						poisoned[i] = 0xA5
					}
				}
			}
		}
	}
	g.copyDevice(t, gc.mem, poisoned, true)
	if job, err = c.Load(ctx, gc.cache, keys, dst); err != nil {
		t.Fatal(err)
	}
	if res, err := job.Wait(ctx); err != nil || res.Count(protocol.OutcomeLoaded) != len(keys) {
		t.Fatalf("load: %+v, %v", res, err)
	}
	after := make([]byte, gc.mem.Len())
	g.copyDevice(t, gc.mem, after, false)
	for l := range int(geo.Layers) {
		for p := range 2 {
			for k := range src {
				for j := range src[k] {
					s, d := block(l, p, src[k][j]), block(l, p, dst[k][j])
					if !bytes.Equal(after[d:d+bb], before[s:s+bb]) {
						t.Fatalf("layer %d plane %d: block %d loaded into %d differs", l, p, src[k][j], dst[k][j])
					}
				}
			}
		}
	}
}

// newGatedGPU is newGPU whose engine moves device regions with the
// staging pipeline over the fake runtime, behind a gate (see gateMover).
func newGatedGPU(t *testing.T) (*gpu, *gateMover) {
	t.Helper()
	gate := &gateMover{open: make(chan struct{}), arrived: make(chan context.Context, 8)}
	var once sync.Once
	// The daemon reports the mover's device faults, as kvhost serve wires
	// them (the mover exists once the engine is open, before any Stats).
	var mover *staginggpu.Mover
	faults := func() map[int]uint64 { return mover.DeviceFaults() }
	g := newGPUWith(t, server.Config{DeviceFaults: faults}, func(rt *cuda.Runtime, c *engine.Config) {
		c.IOWorkers = 4 // the held call must not take every I/O worker
		c.Movers = map[region.Kind]engine.MoverFactory{region.KindDevice: func(engine.MountInfo) (transfer.Mover, error) {
			var err error
			once.Do(func() {
				var m *staginggpu.Mover
				if m, err = staginggpu.New(staginggpu.Config{Runtime: rt, MaxStaging: 4 << 20, Chunk: 1 << 20}); err == nil {
					gate.Mover, mover = m, m
					t.Cleanup(func() { m.Close() })
				}
			})
			return gate, err
		}}
	})
	// A failed check must not leave a held copy (and the daemon's stop)
	// waiting: this cleanup runs before the fixture's.
	t.Cleanup(gate.release)
	return g, gate
}

// TestGPUClientGoneMidJob is issue 8's "a client that exits mid-job" on
// CPU: a client leaves while its store copies from its GPU memory. The
// daemon cancels the job, keeps the client's import mapped until the copy
// has returned (never unmapping memory under a running copy), serves
// another client's GPU round trips meanwhile, then closes the import and
// gives the device's registered bytes back; the cancelled store
// publishes nothing.
func TestGPUClientGoneMidJob(t *testing.T) {
	g, gate := newGatedGPU(t)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Hang)
	defer cancel()
	stay := g.dial(t)
	kept := g.registerGPUCache(t, stay, 1)
	base := deviceStats(t, stay)[0]
	leave, err := client.Dial(ctx, g.socket, "leaving")
	if err != nil {
		t.Fatal(err)
	}
	gone := g.registerGPUCache(t, leave, 2)
	gate.lo.Store(gone.mem.Ptr())
	gate.hi.Store(gone.mem.Ptr() + uintptr(gone.mem.Len()))
	if _, err := leave.Store(ctx, gone.cache, [][]byte{[]byte("gone-0")}, [][]uint32{{0, 1}}); err != nil {
		t.Fatal(err)
	}
	var jobCtx context.Context
	select {
	case jobCtx = <-gate.arrived:
	case <-ctx.Done():
		t.Fatal("the leaving client's store never reached the mover")
	}
	leave.Close()
	select {
	case <-jobCtx.Done():
	case <-ctx.Done():
		t.Fatal("the daemon did not cancel the job of a client that left")
	}
	// The copy has not returned: the import stays, and the other client
	// is served.
	if g.im.Live() != 2 {
		t.Fatalf("%d imports live while the departed client's copy runs, want 2 (its memory unmapped under the copy?)", g.im.Live())
	}
	g.roundTrip(t, stay, kept, [][]byte{[]byte("kept-0"), []byte("kept-1")})
	gate.release()
	if err := g.srv.WaitSessions(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if g.im.Live() != 1 || g.im.Imports() != 1 {
		t.Fatalf("after the client left: %d regions, %d imports live, want 1, 1 (the other client's)", g.im.Live(), g.im.Imports())
	}
	if got := deviceStats(t, stay)[0]; got != base {
		t.Fatalf("device 0 after the client left: %+v, want %+v", got, base)
	}
	if n, err := stay.Lookup(ctx, kept.ns.ID, [][]byte{[]byte("gone-0")}); err != nil || n != 0 {
		t.Fatalf("the departed client's cancelled store: lookup %d, %v; want 0 stored", n, err)
	}
	g.roundTrip(t, stay, kept, [][]byte{[]byte("kept-2")})
}

// TestGPUClientFreesMemoryMidJob is issue 8's "a client that frees its
// memory mid-job" on CPU, with the fake runtime keeping freed memory
// mapped for its importers as the driver does (on an H100 the jobs
// completed: scripts/gpu-ipc-hostile.py, case f). The owner frees its
// allocation while its store is in the mover: the store and a later load
// complete, nothing crashes, another client is served (and reads back the
// bytes stored from the freed memory), unregistering closes the import
// and gives the bytes back, and then the handle is refused as stale.
func TestGPUClientFreesMemoryMidJob(t *testing.T) {
	g, gate := newGatedGPU(t)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Hang)
	defer cancel()
	stay := g.dial(t)
	kept := g.registerGPUCache(t, stay, 1)
	base := deviceStats(t, stay)[0]
	freer := g.dial(t)
	freed := g.registerGPUCache(t, freer, 3)
	orig := make([]byte, freed.mem.Len())
	g.copyDevice(t, freed.mem, orig, false)
	gate.lo.Store(freed.mem.Ptr())
	gate.hi.Store(freed.mem.Ptr() + uintptr(freed.mem.Len()))
	store, err := freer.Store(ctx, freed.cache, [][]byte{[]byte("freed-0")}, [][]uint32{{0, 1}})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-gate.arrived:
	case <-ctx.Done():
		t.Fatal("the store never reached the mover")
	}
	if err := g.dev[0].Do(ctx, func(*cuda.Worker) error { return freed.mem.Close() }); err != nil {
		t.Fatalf("the owner's cudaFree of memory the daemon imported: %v", err)
	}
	gate.release()
	if res, err := store.Wait(ctx); err != nil || res.Count(protocol.OutcomeStored) != 1 {
		t.Fatalf("store from memory freed mid-job: %+v, %v", res, err)
	}
	load, err := freer.Load(ctx, freed.cache, [][]byte{[]byte("freed-0")}, [][]uint32{{8, 9}})
	if err != nil {
		t.Fatal(err)
	}
	if res, err := load.Wait(ctx); err != nil || res.Count(protocol.OutcomeLoaded) != 1 {
		t.Fatalf("load into freed memory: %+v, %v", res, err)
	}
	g.roundTrip(t, stay, kept, [][]byte{[]byte("kept-0")})
	// The other client loads the key stored from the freed memory.
	load, err = stay.Load(ctx, kept.cache, [][]byte{[]byte("freed-0")}, [][]uint32{{12, 13}})
	if err != nil {
		t.Fatal(err)
	}
	if res, err := load.Wait(ctx); err != nil || res.Count(protocol.OutcomeLoaded) != 1 {
		t.Fatalf("the other client's load of the key: %+v, %v", res, err)
	}
	got := make([]byte, kept.mem.Len())
	g.copyDevice(t, kept.mem, got, false)
	bb := int64(geo.TokensPerBlock * geo.KVHeads * geo.HeadSize * geo.DtypeSize)
	for l := range int64(geo.Layers) {
		for p := range int64(2) {
			for i := range int64(2) {
				src := l*2*gpuBlocks*bb + p*gpuBlocks*bb + i*bb
				dst := src + 12*bb
				if !bytes.Equal(got[dst:dst+bb], orig[src:src+bb]) {
					t.Fatalf("layer %d plane %d block %d: the bytes stored from the freed memory differ", l, p, i)
				}
			}
		}
	}
	wantCode(t, freer.UnregisterCache(ctx, freed.cache), protocol.CodeOK)
	wantCode(t, freer.UnregisterMemory(ctx, freed.region), protocol.CodeOK)
	if g.im.Live() != 1 || g.im.Imports() != 1 {
		t.Fatalf("after unregistering: %d regions, %d imports live, want 1, 1 (the other client's)", g.im.Live(), g.im.Imports())
	}
	if got := deviceStats(t, stay)[0]; got != base {
		t.Fatalf("device 0 after unregistering: %+v, want %+v", got, base)
	}
	// With the import closed the memory is gone: its handle is stale.
	_, err = stay.RegisterCUDAIPC(ctx, 0, freed.handle, 0, 4096)
	wantCode(t, err, protocol.CodeBadHandle)
}

// TestGPUCopyFaultFailsItsJobAndTheDaemonKeepsServing is issue 8's "a GPU
// error mid-transfer fails that job as failed, and the daemon keeps
// serving" on CPU: the fake runtime fails one DMA copy of a store, then
// one of a load (cudaErrorIllegalAddress). Each of those jobs ends with
// its key failed (the store publishing nothing) and is counted as a fault
// of device 0 in Stats (what `kvhost health` reads), and the same client's
// round trips then succeed byte for byte.
func TestGPUCopyFaultFailsItsJobAndTheDaemonKeepsServing(t *testing.T) {
	g, _ := newGatedGPU(t)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Hang)
	defer cancel()
	c := g.dial(t)
	gc := g.registerGPUCache(t, c, 4)
	const illegalAddress = 700

	g.fake.Fail(cudatest.OpCopy, 1, illegalAddress)
	job, err := c.Store(ctx, gc.cache, [][]byte{[]byte("fault-store")}, [][]uint32{{0, 1}})
	if err != nil {
		t.Fatal(err)
	}
	res, err := job.Wait(ctx)
	g.fake.Fail(cudatest.OpCopy, 0, 0)
	if err != nil || res.Count(protocol.OutcomeFailed) != 1 {
		t.Fatalf("store with a failed copy: %+v, %v; want its key failed", res, err)
	}
	if n, err := c.Lookup(ctx, gc.ns.ID, [][]byte{[]byte("fault-store")}); err != nil || n != 0 {
		t.Fatalf("the failed store: lookup %d, %v; want nothing stored", n, err)
	}
	wantFaults := func(want uint64) {
		t.Helper()
		if d := deviceStats(t, c); len(d) != 2 || d[0].Faults != want || d[1].Faults != 0 {
			t.Fatalf("device stats %+v: want %d faults on device 0, none on device 1", d, want)
		}
	}
	wantFaults(1)
	g.roundTrip(t, c, gc, [][]byte{[]byte("after-store-fault")})

	g.fake.Fail(cudatest.OpCopy, 1, illegalAddress)
	job, err = c.Load(ctx, gc.cache, [][]byte{[]byte("after-store-fault")}, [][]uint32{{12, 13}})
	if err != nil {
		t.Fatal(err)
	}
	res, err = job.Wait(ctx)
	g.fake.Fail(cudatest.OpCopy, 0, 0)
	if err != nil || res.Count(protocol.OutcomeFailed) != 1 {
		t.Fatalf("load with a failed copy: %+v, %v; want its key failed", res, err)
	}
	wantFaults(2)
	g.roundTrip(t, c, gc, [][]byte{[]byte("after-load-fault-0"), []byte("after-load-fault-1")})
}

// TestGPUBrokenForGoodFailsItsJobsWhileTheOtherServes is issue 8's "a GPU
// that disappears" on CPU: after the fake runtime breaks device 0 for good
// (every later CUDA call there fails with cudaErrorIllegalAddress, as a
// context broken by a sticky error or a lost GPU does), a store and a load
// on device 0 end as failed rather than hang, each counted as a fault of
// device 0, and a registration there is refused as the daemon's failure
// (not as a bad handle); the other GPU's round trips still succeed byte
// for byte, with no fault counted there; and the daemon and its GPU mover
// stop without hanging.
func TestGPUBrokenForGoodFailsItsJobsWhileTheOtherServes(t *testing.T) {
	g, gate := newGatedGPU(t)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Hang)
	defer cancel()
	c := g.dial(t)
	on0 := g.registerGPUCacheOn(t, c, 5, 0)
	on1 := g.registerGPUCacheOn(t, c, 6, 1)
	g.roundTrip(t, c, on0, [][]byte{[]byte("before-0")})
	g.roundTrip(t, c, on1, [][]byte{[]byte("before-1")})
	_, fresh := g.alloc(t, 0, 1<<16) // exported now, imported after the break

	const illegalAddress = 700
	g.fake.BreakDevice(0, illegalAddress)
	mended := false
	mend := func() {
		if !mended {
			g.fake.BreakDevice(0, 0)
			mended = true
		}
	}
	defer mend() // the library is shared with the binary's other tests

	for n, tc := range []struct {
		name string
		run  func() (*client.Job, error)
	}{
		{"store", func() (*client.Job, error) {
			return c.Store(ctx, on0.cache, [][]byte{[]byte("broken-0")}, [][]uint32{{0, 1}})
		}},
		{"load", func() (*client.Job, error) {
			return c.Load(ctx, on0.cache, [][]byte{[]byte("before-0")}, [][]uint32{{12, 13}})
		}},
	} {
		job, err := tc.run()
		if err != nil {
			t.Fatal(err)
		}
		res, err := job.Wait(ctx)
		if err != nil || res.Count(protocol.OutcomeFailed) != 1 {
			t.Fatalf("%s on the broken device: %+v, %v; want its key failed", tc.name, res, err)
		}
		if d := deviceStats(t, c); len(d) != 2 || d[0].Faults != uint64(n+1) || d[1].Faults != 0 {
			t.Fatalf("after the %s: device stats %+v; want %d faults on device 0, none on device 1", tc.name, d, n+1)
		}
	}
	// A registration there is refused as the daemon's failure, not the
	// client's handle (the client's own context on device 0 is broken in
	// the fake too, so the handle is one made before).
	_, err := c.RegisterCUDAIPC(ctx, 0, fresh, 0, 4096)
	if !errors.Is(err, &protocol.Error{Code: protocol.CodeInternal}) || !strings.Contains(err.Error(), "context on this GPU is broken") {
		t.Fatalf("registration on the broken device: %v; want an internal error saying the daemon's context is broken", err)
	}
	g.roundTrip(t, c, on1, [][]byte{[]byte("after-1a"), []byte("after-1b")})
	if d := deviceStats(t, c); d[1].Faults != 0 {
		t.Fatalf("device 1 after its round trip: %+v, want no fault", d[1])
	}

	// The daemon, then its GPU mover, stop with the device still broken
	// (the mover's pinned pool lives on device 0: freeing it reports the
	// broken context, and must not hang).
	stopped := make(chan error, 1)
	go func() {
		g.stop(t)
		stopped <- gate.Mover.(*staginggpu.Mover).Close()
	}()
	select {
	case err := <-stopped:
		if err != nil && !errors.Is(err, cuda.ErrSticky) {
			t.Errorf("the mover's close on the broken device: %v, want nil or the sticky error", err)
		}
	case <-ctx.Done():
		// Not t.Fatal: its cleanups would stop the fixture again beside
		// the stop that hangs; a panic prints every goroutine instead.
		panic("the daemon did not stop with device 0 broken")
	}
	mend()
}
