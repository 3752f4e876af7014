//go:build invariants

package engine

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/cuda/cudatest"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/staging/gpu"
	"github.com/kvhost/kvhost/transfer"
)

// The tests of files offered to the GPU path ahead of jobs (warm.go) run
// the real staging/gpu mover on the fake CUDA library (device memory is
// host memory there) over a directory on /dev/shm, a real tmpfs: the
// engine must see a memory mount, and the registrar maps real tmpfs
// files.

// warmGPU opens the fake CUDA runtime and a GPU staging mover that keeps
// at most regFiles files registered; both close after the test's engines
// (cleanups run last-in first-out).
func warmGPU(t *testing.T, regFiles int) (*cuda.Runtime, *gpu.Mover) {
	t.Helper()
	lib := cudatest.Build(t)
	rt, err := cuda.Open(cuda.Config{Runtime: []string{lib}, Driver: []string{lib}})
	if err != nil {
		t.Fatalf("cuda.Open: %v", err)
	}
	t.Cleanup(func() { rt.Close() })
	mv, err := gpu.New(gpu.Config{Runtime: rt, MaxStaging: 4 << 20, Chunk: 1 << 20, RegisterFiles: regFiles})
	if err != nil {
		t.Fatalf("gpu.New: %v", err)
	}
	t.Cleanup(func() { mv.Close() })
	return rt, mv
}

// warmShm returns a fresh directory on tmpfs, or skips the test.
func warmShm(t *testing.T) string {
	t.Helper()
	dir := shmDir(t)
	if dir == "" {
		t.Skip("no /dev/shm: the engine offers files ahead of jobs only on a memory file system")
	}
	return dir
}

// gpuMovers is Config.Movers with mv serving device memory.
func gpuMovers(mv *gpu.Mover) map[region.Kind]MoverFactory {
	return map[region.Kind]MoverFactory{region.KindDevice: func(MountInfo) (transfer.Mover, error) { return mv, nil }}
}

// storeHostFiles stores n keys, one file each, from a host-memory cache
// through an engine of its own on dir (no GPU mover: no file of it is
// offered to any registrar), and returns the keys and their bytes.
func storeHostFiles(t *testing.T, dir string, g Geometry, n int) ([][]byte, [][]byte) {
	t.Helper()
	ctx := context.Background()
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir, IO: IOBuffered}}, Policy: newTestPolicy(1, 0)})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	bpk := g.BlocksPerKey()
	c := newTestCache(t, e, ns, g, n*bpk, layoutPlaneFirst)
	keys := testKeys("warm", n)
	blocks := make([][]int, n)
	want := make([][]byte, n)
	r := rand.New(rand.NewPCG(3, 5))
	for i := range blocks {
		for b := range bpk {
			blocks[i] = append(blocks[i], i*bpk+b)
		}
		c.fill(r, blocks[i])
		want[i] = c.data(blocks[i])
	}
	storeAndCheck(t, e, c, keys, blocks)
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	return keys, want
}

// deviceCache is a paged cache of nb blocks in (fake) device memory,
// plane-first as newTestCache lays it out.
type deviceCache struct {
	id  CacheID
	rt  *cuda.Runtime
	mem *cuda.DeviceMemory
	g   Geometry
	nb  int
}

func newDeviceCache(t *testing.T, e *Engine, rt *cuda.Runtime, ns NamespaceID, g Geometry, nb int) *deviceCache {
	t.Helper()
	bb := g.BlockBytes()
	layer := int64(g.Planes()) * int64(nb) * bb
	mem, err := rt.Malloc(0, int64(g.Layers)*layer)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mem.Close() })
	var layers []LayerTensor
	for l := range g.Layers {
		layers = append(layers, LayerTensor{Region: mem, Offset: int64(l) * layer, BlockStride: bb, PlaneStride: int64(nb) * bb, NumBlocks: nb})
	}
	id, err := e.RegisterCache(ns, layers)
	if err != nil {
		t.Fatal(err)
	}
	return &deviceCache{id: id, rt: rt, mem: mem, g: g, nb: nb}
}

// data returns the bytes of blocks, layer by layer and plane by plane
// (testCache.data's order), copied out of device memory.
func (c *deviceCache) data(t *testing.T, blocks []int) []byte {
	t.Helper()
	all := make([]byte, c.mem.Len())
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := c.rt.SetDevice(0); err != nil {
		t.Fatal(err)
	}
	if err := c.rt.CopySync(uintptr(unsafe.Pointer(&all[0])), c.mem.Ptr(), uintptr(len(all))); err != nil {
		t.Fatal(err)
	}
	bb := c.g.BlockBytes()
	var out []byte
	for l := range c.g.Layers {
		for p := range c.g.Planes() {
			for _, b := range blocks {
				off := (int64(l)*int64(c.g.Planes())+int64(p))*int64(c.nb)*bb + int64(b)*bb
				out = append(out, all[off:off+bb]...)
			}
		}
	}
	return out
}

// loadDevice loads keys into the device cache, key i into blocks
// i*BlocksPerKey on, and compares their bytes with want.
func loadDevice(t *testing.T, e *Engine, c *deviceCache, keys, want [][]byte) {
	t.Helper()
	bpk := c.g.BlocksPerKey()
	into := make([][]int, len(keys))
	for i := range into {
		for b := range bpk {
			into[i] = append(into[i], i*bpk+b)
		}
	}
	res := wait(t)(e.Load(context.Background(), LoadRequest{Cache: c.id, Keys: keys, Blocks: into}))
	wantOutcomes(t, "load", res, OutcomeLoaded)
	for i := range keys {
		if !bytes.Equal(c.data(t, into[i]), want[i]) {
			t.Fatalf("key %s: loaded bytes differ", keys[i])
		}
	}
}

// TestWarmRegistersFilesFoundAtOpen: files already on a memory mount when
// the engine opens (a restart) are registered by the GPU path's
// registrar without any job, counted as offered ahead of jobs.
func TestWarmRegistersFilesFoundAtOpen(t *testing.T) {
	dir := warmShm(t)
	_, mv := warmGPU(t, 16)
	const n = 3
	storeHostFiles(t, dir, smallGeometry(true), n)
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir, IO: IOBuffered}}, Policy: newTestPolicy(1, 0), Movers: gpuMovers(mv)})
	testwait.Until(t, "the files found at open registered", testwait.Hang, func() bool { return mv.FileStats().Files == n })
	st := mv.FileStats()
	if st.Warmed != n || st.Registered != n || st.Stores != 0 || st.Loads != 0 {
		t.Errorf("registrar %+v: want %d files offered ahead of jobs and registered, no job", st, n)
	}
	if s := e.Stats(); s.Loads != 0 || s.Stores != 0 {
		t.Errorf("engine ran jobs: %d loads, %d stores", s.Loads, s.Stores)
	}
}

// TestWarmAtOpenOffersTheMostRecentlyUsedFilesUpToTheBound: with more
// files on the mount than the registrar keeps, the engine offers the most
// recently used ones, and no more than the bound: a load of the oldest
// file moves through the pinned buffers, loads of the newest copy straight
// from their pages.
func TestWarmAtOpenOffersTheMostRecentlyUsedFilesUpToTheBound(t *testing.T) {
	dir := warmShm(t)
	rt, mv := warmGPU(t, 2)
	g := smallGeometry(true)
	keys, want := storeHostFiles(t, dir, g, 3)
	// Key 0's file the oldest, key 2's the newest (the index's last use
	// at start is a file's modification time).
	ctx := context.Background()
	idx := openEngine(t, Config{Mounts: []Mount{{Path: dir, IO: IOBuffered}}, Policy: newTestPolicy(1, 0)})
	ns, _ := idx.Declare(ctx, g)
	n, err := idx.tables.namespace(ns)
	if err != nil {
		t.Fatal(err)
	}
	base := time.Now().Add(-time.Hour)
	for i, k := range keys {
		en := idx.find(n, k)
		if en == nil {
			t.Fatalf("key %s not indexed", k)
		}
		at := base.Add(time.Duration(i) * time.Minute)
		if err := os.Chtimes(en.Path, at, at); err != nil {
			t.Fatal(err)
		}
	}
	idx.Close(ctx)
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir, IO: IOBuffered}}, Policy: newTestPolicy(1, 0), Movers: gpuMovers(mv)})
	testwait.Until(t, "two files registered", testwait.Hang, func() bool { return mv.FileStats().Files == 2 })
	if st := mv.FileStats(); st.Warmed != 2 || st.Deferred != 0 {
		t.Fatalf("registrar %+v: want 2 offers ahead of jobs, none deferred", st)
	}
	ns, _ = e.Declare(ctx, g)
	c := newDeviceCache(t, e, rt, ns, g, 3*g.BlocksPerKey())
	loadDevice(t, e, c, keys[:1], want[:1])
	if st := mv.FileStats(); st.Loads != 0 {
		t.Fatalf("the oldest file loaded directly: %+v", st)
	}
	loadDevice(t, e, c, keys[1:], want[1:])
	if st := mv.FileStats(); st.Loads != 2 {
		t.Fatalf("registrar %+v: the two newest files' loads should have copied from their pages", st)
	}
}

// TestWarmRegistersDiscoveredFileBeforeItsLoad: a file another process
// stored on the shared memory mount, found by a lookup, is registered
// before any load of it, and its load then copies straight from its pages
// (FileStats.Loads, kvhost_gpu_direct_file_jobs_total{direction="load"}).
func TestWarmRegistersDiscoveredFileBeforeItsLoad(t *testing.T) {
	dir := warmShm(t)
	rt, mv := warmGPU(t, 16)
	ctx := context.Background()
	g := smallGeometry(true)
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir, IO: IOBuffered}}, Policy: newTestPolicy(1, 0), Movers: gpuMovers(mv)})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	keys, want := storeHostFiles(t, dir, g, 2) // the other process
	if got, err := e.Lookup(ctx, ns, keys); err != nil || got != 2 {
		t.Fatalf("lookup: %d, %v; want both keys found", got, err)
	}
	testwait.Until(t, "the discovered files registered", testwait.Hang, func() bool { return mv.FileStats().Files == 2 })
	if st := mv.FileStats(); st.Warmed != 2 || st.Loads != 0 || st.Stores != 0 {
		t.Fatalf("registrar %+v: want 2 files offered ahead of jobs, no job", st)
	}
	c := newDeviceCache(t, e, rt, ns, g, 2*g.BlocksPerKey())
	loadDevice(t, e, c, keys, want)
	if st := mv.FileStats(); st.Loads != 2 {
		t.Fatalf("registrar %+v: the loads of the discovered files should have copied from their pages", st)
	}
}

// gatedWarmer is a device-memory mover that takes every file offered
// ahead of jobs, each offer held until gate closes; it moves no bytes.
type gatedWarmer struct {
	gate  chan struct{}
	calls atomic.Int64
}

func (w *gatedWarmer) Name() string    { return "gated" }
func (w *gatedWarmer) Checksums() bool { return false }
func (w *gatedWarmer) WriteFile(context.Context, fsys.File, *transfer.Plan, []uint32) (int64, error) {
	return 0, errors.New("gatedWarmer moves no bytes")
}
func (w *gatedWarmer) ReadFile(context.Context, fsys.File, *transfer.Plan, []uint32) (int64, error) {
	return 0, errors.New("gatedWarmer moves no bytes")
}
func (w *gatedWarmer) Warm(fsys.File) bool {
	w.calls.Add(1)
	<-w.gate
	return true
}

// TestWaitWarmedWaitsForTheOffersOfTheFilesFoundAtOpen: WaitWarmed does
// not return while a file found at Open is still being offered (a context
// that ended is its error then), and returns once every one was offered.
func TestWaitWarmedWaitsForTheOffersOfTheFilesFoundAtOpen(t *testing.T) {
	dir := warmShm(t)
	const n = 3
	storeHostFiles(t, dir, smallGeometry(true), n)
	w := &gatedWarmer{gate: make(chan struct{})}
	movers := map[region.Kind]MoverFactory{region.KindDevice: func(MountInfo) (transfer.Mover, error) { return w, nil }}
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir, IO: IOBuffered}}, Policy: newTestPolicy(1, 0), Movers: movers})
	release := sync.OnceFunc(func() { close(w.gate) })
	t.Cleanup(release) // before the engine closes (cleanups run last-in first-out): its warmer must not stay held
	testwait.Until(t, "the first file offered", testwait.Hang, func() bool { return w.calls.Load() >= 1 })
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	if err := e.WaitWarmed(ended); !errors.Is(err, context.Canceled) {
		t.Fatalf("WaitWarmed while the first of %d offers is held: %v, want context.Canceled", n, err)
	}
	release()
	if err := e.WaitWarmed(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := w.calls.Load(); got != n {
		t.Fatalf("WaitWarmed returned after %d offers, want %d", got, n)
	}
}
