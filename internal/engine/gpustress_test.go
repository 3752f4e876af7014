//go:build invariants

package engine

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/cuda/cudatest"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/engine/accesslog"
	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/staging/gpu"
)

// The GPU stress (docs/gpu.md, "Tests on CPU"): workers store, load
// (NoBlock loads included), delete and look keys up at once through the
// engine and the GPU staging mover on the fake CUDA library, cancel
// their jobs at random points and inject CUDA faults, on a mount small
// enough that stores evict, with the registrar and spare files at work
// on a memory mount. Its size and seed come from the environment:
// KVHOST_GPU_STRESS_OPS (operations per worker), KVHOST_GPU_STRESS_WORKERS
// (stressWorkers by default) and KVHOST_GPU_STRESS_SEED (by default one
// the run chooses and logs).

// stressWorkers is the number of goroutines submitting operations, by
// default.
const stressWorkers = 4

// stressKeys is the number of distinct keys the workers draw from.
const stressKeys = 24

// stressMaxKeys is the most keys of one store or load.
const stressMaxKeys = 3

// stressEnvInt reads a positive integer from the environment variable
// name, or returns def.
func stressEnvInt(t *testing.T, name string, def uint64) uint64 {
	t.Helper()
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		t.Fatalf("%s=%q: %v", name, s, err)
	}
	return n
}

// TestGPUStressKeepsBytesAndLifetimes runs the stress on a memory mount
// and on a disk. During the run, every key a load reports loaded holds,
// in every block it was asked for, the bytes one store of that key wrote
// (one version for all of the key's blocks), no block the load did not
// name changes, and no job writes into device memory after it ended.
// Once the workers stop, every version loaded is one whose store
// reported it stored; no file the engine removed is still mapped or open
// in the process; the fake library's live registrations, the mover's
// registered files and the mappings and descriptors of the mount's files
// agree; the engine's used and spare bytes equal a walk of the mount; no
// file was dropped as corrupt; no copy ran over host memory neither
// pinned nor registered (nor over device memory freed), no stream was
// destroyed with copies queued, no call named a stream or event
// destroyed. After the engine's and the mover's
// Close: no registration, mapping or descriptor of the mount's files is
// left, no temporary or spare file, and no CUDA call comes after the
// runtime is marked unloaded. A third run checks the same after closing
// the engine and the mover while the workers go on (runAndClose).
func TestGPUStressKeepsBytesAndLifetimes(t *testing.T) {
	ops := int(stressEnvInt(t, "KVHOST_GPU_STRESS_OPS", 200))
	workers := int(stressEnvInt(t, "KVHOST_GPU_STRESS_WORKERS", stressWorkers))
	seed := stressEnvInt(t, "KVHOST_GPU_STRESS_SEED", uint64(time.Now().UnixNano()))
	t.Logf("KVHOST_GPU_STRESS_SEED=%d KVHOST_GPU_STRESS_OPS=%d KVHOST_GPU_STRESS_WORKERS=%d", seed, ops, workers)
	for i, mk := range []string{"memory", "disk", "memory, closed while busy"} {
		t.Run(mk, func(t *testing.T) {
			var dir string
			if strings.HasPrefix(mk, "memory") {
				dir = tmpfsDir(t)
			} else {
				dir = diskDir(t)
			}
			s := newGPUStress(t, dir, strings.HasPrefix(mk, "memory"), seed^uint64(i)*0x9E3779B97F4A7C15, ops, workers)
			if strings.HasSuffix(mk, "busy") {
				s.runAndClose(t)
				t.Logf("%s", s.counts())
				return
			}
			s.run(t)
			s.quiesced(t)
			s.closed(t)
			t.Logf("%s", s.counts())
		})
	}
}

// gpuStress is one run of the stress on one mount.
type gpuStress struct {
	dir     string
	seed    uint64
	ops     int
	workers int
	lib     string
	fake    *cudatest.Fake
	rt      *cuda.Runtime
	mv      *gpu.Mover
	e       *Engine
	ns      NamespaceID
	caches  []stressCache // each worker's own
	cfg     Config        // the engine's, but its policy
	kpf     uint32
	order   uint32
	// restarts: the engine is closed and a new one opened on the mount
	// in the middle of the run, with the same mover or
	// (newMoverAtRestart) a new one.
	restarts, newMoverAtRestart bool
	gcfg                        gpu.Config
	g                           Geometry
	per                         int // blocks each worker owns: a store area, then a load area
	keys                        [][]byte

	version atomic.Uint64 // the last version a store used

	stressClose
	stressHistory

	// Counts, for the log.
	n struct {
		stores, loads, noBlockLoads, deletes, lookups, cancels, faults atomic.Int64
		keysStored, keysPresent, keysLoaded, keysMissing, keysFailed   atomic.Int64
		cancelledKeys, recycles, restarts                              atomic.Int64
		blocksChecked                                                  atomic.Int64
	}
}

// stressClose is a gpuStress's closing while busy (runAndClose): closing
// is set before the engine's Close; unloaded, once the runtime is marked
// unloaded, under devMu, which the workers hold reading while they copy
// to or from device memory themselves.
type stressClose struct {
	closing  atomic.Bool
	devMu    sync.RWMutex
	unloaded bool
	opsDone  atomic.Int64
	// halfway is closed once the workers have begun half their
	// operations (opsDone reaching halfAt).
	halfway chan struct{}
	halfAt  int64
}

// stressHistory is what a gpuStress's workers stored and found, under mu.
type stressHistory struct {
	mu       sync.Mutex
	stored   map[uint64]bool // versions a store reported stored
	observed []observed      // versions loads found
	hot      [8]int          // the keys stored last, by any worker
	nhot     int
}

// countFailed counts a key whose store or load failed with err, and
// whether it failed because its job was cancelled.
func (s *gpuStress) countFailed(err error) {
	s.n.keysFailed.Add(1)
	if errors.Is(err, context.Canceled) {
		s.n.cancelledKeys.Add(1)
	}
}

// newMover makes the GPU staging mover.
func (s *gpuStress) newMover(t *testing.T) {
	mv, err := gpu.New(s.gcfg)
	if err != nil {
		t.Fatalf("gpu.New: %v", err)
	}
	s.mv = mv
	t.Cleanup(func() { mv.Close() })
}

// open opens an engine on the mount and declares the namespace.
func (s *gpuStress) open(t *testing.T) {
	cfg := s.cfg
	cfg.Policy = newTestPolicy(s.kpf, s.order)
	cfg.Movers = gpuMovers(s.mv)
	s.e = openEngine(t, cfg)
	var err error
	if s.ns, err = s.e.Declare(context.Background(), s.g); err != nil {
		t.Fatal(err)
	}
}

// restart closes the engine and opens a new one on the mount, with the
// same mover (the new engine offers the files it finds to a registrar
// that has them registered already) or, as a daemon's restart does, a
// new one (whose registrar registers the files found), after checking
// that the old one's Close left nothing; it registers the workers'
// device memory with the new engine.
func (s *gpuStress) restart(t *testing.T) {
	// A fault a worker armed and no call has met yet would fail the new
	// mover's gpu.New (its pinned pool's host allocation) or the new
	// engine's start: the restart checks what Close leaves, not how they
	// fail, so none stays armed across it. The workers are idle here.
	s.disarmFaults()
	if err := s.e.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if s.newMoverAtRestart {
		if err := s.mv.Close(); err != nil {
			t.Errorf("the mover's Close: %v", err)
		}
		if n := s.fake.Registrations(); n != 0 {
			t.Errorf("%d registrations left in the fake library after the mover's Close", n)
		}
		if maps, fds := mountFiles(t, s.dir); len(maps)+len(fds) != 0 {
			t.Errorf("after the mover's Close: mappings %v, descriptors %v of the mount's files", maps, fds)
		}
		s.newMover(t)
	}
	s.open(t)
	for w, c := range s.caches {
		bb := s.g.BlockBytes()
		layer := int64(s.g.Planes()) * int64(s.per) * bb
		var layers []LayerTensor
		for l := range s.g.Layers {
			layers = append(layers, LayerTensor{Region: c.mem, Offset: int64(l) * layer, BlockStride: bb, PlaneStride: int64(s.per) * bb, NumBlocks: s.per})
		}
		id, err := s.e.RegisterCache(s.ns, layers)
		if err != nil {
			t.Fatal(err)
		}
		s.caches[w].id = id
	}
	s.n.restarts.Add(1)
}

// stressCache is a worker's cache: device memory of its own, registered
// with the engine.
type stressCache struct {
	id  CacheID
	mem *cuda.DeviceMemory
}

// lockDevice makes device 0 current on this thread and holds devMu for
// reading, so that the runtime is not marked unloaded meanwhile; unlock
// gives both back. It reports false once the runtime is marked unloaded,
// or where the device cannot be made current.
func (s *gpuStress) lockDevice(t *testing.T) (unlock func(), ok bool) {
	s.devMu.RLock()
	if s.unloaded {
		s.devMu.RUnlock()
		return nil, false
	}
	release, err := s.rt.LockDevice(0)
	if err != nil {
		s.devMu.RUnlock()
		t.Error(err)
		return nil, false
	}
	return func() { release(); s.devMu.RUnlock() }, true
}

// newCache gives worker w a new cache of s.per blocks, unregistering
// and freeing the one it had (its jobs have ended: the engine and the
// mover must touch its memory no more). It reports false once the
// runtime is marked unloaded or the engine closed.
func (s *gpuStress) newCache(t *testing.T, w int) bool {
	unlock, ok := s.lockDevice(t)
	if !ok {
		return false
	}
	defer unlock()
	if old := s.caches[w]; old.mem != nil {
		// A closed engine refuses the unregistration (ErrClosed) and
		// has ended every job: the memory is the worker's to free.
		closed := false
		if err := s.e.UnregisterCache(old.id); errors.Is(err, ErrClosed) {
			closed = true
		} else if err != nil {
			t.Errorf("unregister a cache: %v", err)
		}
		if err := old.mem.Close(); err != nil {
			t.Errorf("free a cache's memory: %v", err)
		}
		s.caches[w] = stressCache{}
		if closed {
			return false
		}
	}
	bb := s.g.BlockBytes()
	layer := int64(s.g.Planes()) * int64(s.per) * bb
	mem, err := s.rt.Malloc(0, int64(s.g.Layers)*layer)
	if err != nil {
		t.Error(err)
		return false
	}
	var layers []LayerTensor
	for l := range s.g.Layers {
		layers = append(layers, LayerTensor{Region: mem, Offset: int64(l) * layer, BlockStride: bb, PlaneStride: int64(s.per) * bb, NumBlocks: s.per})
	}
	id, err := s.e.RegisterCache(s.ns, layers)
	if err != nil {
		mem.Close()
		if !s.closedErr(err) {
			t.Errorf("register a cache: %v", err)
		}
		return false
	}
	s.caches[w] = stressCache{id: id, mem: mem}
	s.n.recycles.Add(1)
	return true
}

// observed is a version a load found for a key.
type observed struct {
	key int
	v   uint64
}

// newGPUStress opens the fake CUDA runtime, a GPU staging mover and an
// engine on dir, with the run's settings drawn from seed.
func newGPUStress(t *testing.T, dir string, memory bool, seed uint64, ops, workers int) *gpuStress {
	t.Helper()
	r := rand.New(rand.NewPCG(seed, 1))
	s := &gpuStress{dir: dir, seed: seed, ops: ops, workers: max(workers, 1), g: smallGeometry(false), stressHistory: stressHistory{stored: map[uint64]bool{}}}
	s.halfway, s.halfAt = make(chan struct{}), int64(max(s.workers*ops/2, 1))
	s.lib = cudatest.Build(t)
	s.fake = cudatest.Open(t, s.lib)
	rt, err := cuda.Open(cuda.Config{Runtime: []string{s.lib}, Driver: []string{s.lib}})
	if err != nil {
		t.Fatalf("cuda.Open: %v", err)
	}
	s.rt = rt
	t.Cleanup(func() {
		s.fake.Unload(false)
		rt.Close()
	})
	kpf := uint32(1 + r.IntN(2))
	order := []uint32{abi.OrderLayerMajor, abi.OrderBlockMajor}[r.IntN(2)]
	onDev := r.IntN(2) == 0
	fileLen := int64(4096) + int64(kpf)*alignTo(s.g.KeyBytes(), format.Align)
	regFiles := 4 + r.IntN(8)
	// A bound on the registered bytes in a third of the seeds: of 3 to
	// 5 files.
	regBytes := int64(0)
	if r.IntN(3) == 0 {
		regBytes = int64(3+r.IntN(3)) * fileLen
	}
	copyMode := []cuda.CopyMode{cuda.CopyAuto, cuda.CopySegments, cuda.CopyKernel}[r.IntN(3)]
	depth := 1 + r.IntN(3)
	// Events that answer "not ready" to the first queries after each
	// record (or to every query: the job then sleeps on them).
	busy := []int{0, 0, 3, -1}[r.IntN(4)]
	s.fake.Busy(busy)
	t.Cleanup(func() { s.fake.Busy(0) })
	// Buffers of 64 KiB chunks: a key of 80 KiB is two chunks, and the
	// pool holds fewer buffers than the jobs want.
	s.gcfg = gpu.Config{Runtime: rt, MaxStaging: 6 * (64<<10 + 8<<10), Chunk: 64 << 10, Depth: depth, Copy: copyMode,
		RegisterFiles: regFiles, RegisterBytes: regBytes, SumsOnDevice: onDev, IdleRegistrars: 1}
	s.newMover(t)
	mnt := Mount{Path: dir, Capacity: 10 * fileLen, HighWatermark: 0.9, LowWatermark: 0.7}
	if memory {
		mnt.Preallocate = 3 * fileLen
	}
	s.restarts = r.IntN(2) == 0
	s.newMoverAtRestart = r.IntN(2) == 0
	t.Logf("keys per file %d, order %d, checksums on the device %v, copies %v, depth %d, busy events %d, register files %d and %d bytes, file %d bytes, restarts %v (new mover %v)",
		kpf, order, onDev, copyMode, depth, busy, regFiles, regBytes, fileLen, s.restarts, s.newMoverAtRestart)
	s.cfg = Config{Mounts: []Mount{mnt}, IOWorkers: 4}
	s.kpf, s.order = kpf, order
	s.open(t)
	s.per = 2 * stressMaxKeys * s.g.BlocksPerKey()
	s.caches = make([]stressCache, s.workers)
	t.Cleanup(func() {
		for _, c := range s.caches {
			if c.mem != nil {
				c.mem.Close()
			}
		}
	})
	for w := range s.caches {
		if !s.newCache(t, w) {
			t.Fatal("no device cache")
		}
	}
	for k := range stressKeys {
		s.keys = append(s.keys, fmt.Appendf(nil, "stress-%02d", k))
	}
	return s
}

// The bytes of a block: each (layer, plane) piece of block j of key k as
// version v wrote it starts with a header naming all five, followed by
// bytes drawn from them.
const stressMagic = 0x6b767374

// fillPiece writes the piece of block j of key k, version v, at layer l
// and plane p into b.
func fillPiece(b []byte, k int, v uint64, j, l, p int) {
	binary.LittleEndian.PutUint32(b[0:], stressMagic)
	binary.LittleEndian.PutUint32(b[4:], uint32(k))
	binary.LittleEndian.PutUint64(b[8:], v)
	binary.LittleEndian.PutUint32(b[16:], uint32(j))
	binary.LittleEndian.PutUint32(b[20:], uint32(l))
	binary.LittleEndian.PutUint32(b[24:], uint32(p))
	binary.LittleEndian.PutUint32(b[28:], 0)
	r := rand.New(rand.NewPCG(v, uint64(k)<<32|uint64(j)<<16|uint64(l)<<8|uint64(p)))
	for i := 32; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], r.Uint64())
	}
	for i := len(b) &^ 7; i < len(b); i++ {
		b[i] = byte(i)
	}
}

// checkPiece checks that b is the piece of block j of key k at layer l
// and plane p of some version, and returns the version.
func checkPiece(b []byte, k, j, l, p int) (uint64, error) {
	v := binary.LittleEndian.Uint64(b[8:])
	want := make([]byte, len(b))
	fillPiece(want, k, v, j, l, p)
	if i := firstDiff(b, want); i >= 0 {
		return 0, fmt.Errorf("key %d block %d layer %d plane %d: byte %d is 0x%02x, want 0x%02x of version %d (header %x)", k, j, l, p, i, b[i], want[i], v, b[:32])
	}
	return v, nil
}

// area is a worker's blocks of device memory: one []byte per (layer,
// plane), of per blocks each.
type area [][]byte

// at is the device offset of block b (of the whole cache) at layer l,
// plane p.
func (s *gpuStress) at(l, p, b int) int64 {
	return (int64(l)*int64(s.g.Planes())+int64(p))*int64(s.per)*s.g.BlockBytes() + int64(b)*s.g.BlockBytes()
}

// copyArea copies worker w's blocks [from, from+n) out of device memory
// into a (out) or into device memory from a; it reports false, copying
// nothing, once the runtime is marked unloaded.
func (s *gpuStress) copyArea(t *testing.T, w, from, n int, a area, out bool) bool {
	unlock, ok := s.lockDevice(t)
	if !ok {
		return false
	}
	defer unlock()
	bb := s.g.BlockBytes()
	for l := range s.g.Layers {
		for p := range s.g.Planes() {
			buf := a[l*s.g.Planes()+p]
			dev := s.caches[w].mem.Ptr() + uintptr(s.at(l, p, from))
			host := uintptr(unsafe.Pointer(&buf[0]))
			var err error
			if out {
				err = s.rt.CopySync(host, dev, uintptr(int64(n)*bb))
			} else {
				err = s.rt.CopySync(dev, host, uintptr(int64(n)*bb))
			}
			if err != nil {
				t.Error(err)
				return false
			}
		}
	}
	return true
}

// newArea allocates an area of n blocks.
func (s *gpuStress) newArea(n int) area {
	a := make(area, s.g.Layers*s.g.Planes())
	for i := range a {
		a[i] = make([]byte, int64(n)*s.g.BlockBytes())
	}
	return a
}

// piece is block b's piece at layer l, plane p in a.
func (s *gpuStress) piece(a area, l, p, b int) []byte {
	bb := s.g.BlockBytes()
	return a[l*s.g.Planes()+p][int64(b)*bb : int64(b+1)*bb]
}

// stressPhases is the number of phases of a run: between two, every
// worker is idle until the engine has made its spares ahead of stores
// (Mount.Preallocate, on a memory mount) and shown them to the mover.
const stressPhases = 4

// run runs the workers, in phases, and waits for them.
func (s *gpuStress) run(t *testing.T) {
	rs := make([]*rand.Rand, s.workers)
	recent := make([][]int, s.workers)
	for w := range rs {
		rs[w] = rand.New(rand.NewPCG(s.seed, uint64(w)+100))
	}
	for phase := range stressPhases {
		if s.restarts && phase == stressPhases/2 {
			s.restart(t)
		}
		var wg sync.WaitGroup
		for w := range s.workers {
			wg.Go(func() { s.worker(t, w, rs[w], &recent[w], s.ops/stressPhases) })
		}
		wg.Wait()
		if t.Failed() {
			break
		}
		waitEngineSpares(t, s.e)
	}
	s.disarmFaults() // no fault left armed for the checks
}

// disarmFaults disarms every fault the workers may have armed.
func (s *gpuStress) disarmFaults() {
	for _, op := range stressFaultOps {
		s.fake.Fail(op, 0, 0)
	}
}

// stressFaultOps are the operations whose faults the workers inject (a
// host allocation: a lane's pinned checksum table, with checksums on the
// device).
var stressFaultOps = []cudatest.Op{cudatest.OpCopy, cudatest.OpSync, cudatest.OpRecord, cudatest.OpQuery, cudatest.OpBatch,
	cudatest.OpHostRegister, cudatest.OpUnregister, cudatest.OpLaunch, cudatest.OpHostAlloc}

// worker runs ops operations with blocks of its own; recent is the keys
// it stored last, which its loads ask for more often than others.
func (s *gpuStress) worker(t *testing.T, w int, r *rand.Rand, recent *[]int, ops int) {
	half := s.per / 2
	src, dst := s.newArea(half), s.newArea(half)
	var after area // the load area as the last load left it
	for i := 0; i < ops && !t.Failed(); i++ {
		if s.opsDone.Add(1) == s.halfAt {
			close(s.halfway)
		}
		switch x := r.IntN(100); {
		case x < 35:
			var cancelled bool
			*recent, cancelled = s.store(t, r, w, src)
			// Memory of a cancelled job freed as soon as it ended.
			if cancelled && r.IntN(2) == 0 {
				if !s.newCache(t, w) {
					return
				}
				after = nil
			}
		case x < 75:
			if now := s.newArea(half); after != nil && s.copyArea(t, w, half, half, now, true) {
				for i := range now {
					if j := firstDiff(now[i], after[i]); j >= 0 {
						t.Errorf("worker %d: byte %d of layer %d plane %d of its load blocks changed after its last load ended", w, j%int(s.g.BlockBytes()), i/s.g.Planes(), i%s.g.Planes())
						return
					}
				}
			}
			var cancelled bool
			after, cancelled = s.load(t, r, w, dst, *recent)
			if cancelled && r.IntN(2) == 0 {
				if !s.newCache(t, w) {
					return
				}
				after = nil
			}
		case x < 90:
			n := 1 + r.IntN(2)
			var ks [][]byte
			for range n {
				// Mostly keys stored lately, by any worker: those
				// other workers are likely loading, so that files are
				// removed under jobs in flight on them.
				ks = append(ks, s.keys[s.hotKey(r)])
			}
			if _, err := s.e.Delete(context.Background(), s.ns, ks); err != nil && !s.closedErr(err) {
				t.Errorf("delete: %v", err)
			}
			s.n.deletes.Add(1)
		case x < 95:
			if _, err := s.e.Lookup(context.Background(), s.ns, [][]byte{s.keys[r.IntN(stressKeys)]}); err != nil && !s.closedErr(err) {
				t.Errorf("lookup: %v", err)
			}
			s.n.lookups.Add(1)
		default:
			op := stressFaultOps[r.IntN(len(stressFaultOps))]
			code := []int{1, 2, 700, 999}[r.IntN(4)]
			s.fake.Fail(op, 1+r.IntN(40), code)
			s.n.faults.Add(1)
		}
	}
}

// submit runs a job and cancels it in three cases in ten (before it
// starts, at once, or after up to 3 ms); it returns its result, whether
// the job ran, and whether it was cancelled.
func (s *gpuStress) submit(t *testing.T, r *rand.Rand, start func(ctx context.Context) (*Job, error)) (res Result, ok, cancelled bool) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	mode := r.IntN(10)
	if mode == 0 {
		cancel()
	}
	j, err := start(ctx)
	if err != nil {
		if mode == 0 && errors.Is(err, context.Canceled) {
			s.n.cancels.Add(1)
			return Result{}, false, true
		}
		if !s.closedErr(err) {
			t.Errorf("submit: %v", err)
		}
		return Result{}, false, false
	}
	switch mode {
	case 0:
		s.n.cancels.Add(1)
	case 1:
		j.Cancel()
		s.n.cancels.Add(1)
	case 2:
		time.AfterFunc(time.Duration(r.IntN(3000))*time.Microsecond, j.Cancel)
		s.n.cancels.Add(1)
	}
	wctx, wcancel := context.WithTimeout(context.Background(), testwait.Hang)
	defer wcancel()
	res, err = j.Wait(wctx)
	if err != nil && wctx.Err() != nil {
		t.Errorf("a job did not end within %v", testwait.Hang)
		return Result{}, false, false
	}
	return res, true, mode <= 2
}

// store stores 1 to stressMaxKeys distinct keys, a new version each,
// from blocks of w's store area in a random order; it returns the keys,
// and whether the job was cancelled.
func (s *gpuStress) store(t *testing.T, r *rand.Rand, w int, src area) ([]int, bool) {
	bpk := s.g.BlocksPerKey()
	n := 1 + r.IntN(stressMaxKeys)
	ks := r.Perm(stressKeys)[:n]
	perm := r.Perm(n * bpk)
	blocks := make([][]int, n)
	vs := make([]uint64, n)
	for i, k := range ks {
		vs[i] = s.version.Add(1)
		for j := range bpk {
			b := perm[i*bpk+j]
			blocks[i] = append(blocks[i], b)
			for l := range s.g.Layers {
				for p := range s.g.Planes() {
					fillPiece(s.piece(src, l, p, b), k, vs[i], j, l, p)
				}
			}
		}
	}
	s.copyArea(t, w, 0, s.per/2, src, false)
	keys := make([][]byte, n)
	for i, k := range ks {
		keys[i] = s.keys[k]
	}
	res, ok, cancelled := s.submit(t, r, func(ctx context.Context) (*Job, error) {
		return s.e.Store(ctx, StoreRequest{Cache: s.caches[w].id, Keys: keys, Blocks: blocks})
	})
	s.n.stores.Add(1)
	if !ok {
		return ks, cancelled
	}
	for i, kr := range res.Keys {
		switch kr.Outcome {
		case OutcomeStored:
			s.n.keysStored.Add(1)
			s.mu.Lock()
			s.stored[vs[i]] = true
			s.hot[s.nhot%len(s.hot)] = ks[i]
			s.nhot++
			s.mu.Unlock()
		case OutcomePresent:
			s.n.keysPresent.Add(1)
		case OutcomeFailed:
			s.countFailed(kr.Err)
		}
	}
	return ks, cancelled
}

// hotKey draws a key: in two cases of three one of the keys stored last
// by any worker, else any.
func (s *gpuStress) hotKey(r *rand.Rand) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.nhot == 0 || r.IntN(3) == 0 {
		return r.IntN(stressKeys)
	}
	return s.hot[r.IntN(min(s.nhot, len(s.hot)))]
}

// stressPoison is the byte a load's area holds before the load.
const stressPoison = 0x5A

// load loads 1 to stressMaxKeys keys (a key may come twice) into blocks
// of w's load area, some of them with NoBlock, and checks the area: it
// returns the area as the load left it (nil once the runtime is marked
// unloaded), and whether the job was cancelled. Half of the keys come
// from recent.
func (s *gpuStress) load(t *testing.T, r *rand.Rand, w int, dst area, recent []int) (area, bool) {
	bpk := s.g.BlocksPerKey()
	half := s.per / 2
	for i := range dst {
		for j := range dst[i] {
			dst[i][j] = stressPoison
		}
	}
	s.copyArea(t, w, half, half, dst, false)
	n := 1 + r.IntN(stressMaxKeys)
	pool := r.Perm(half)
	ks := make([]int, n)
	keys := make([][]byte, n)
	blocks := make([][]int, n)
	noBlock := false
	for i := range n {
		ks[i] = s.hotKey(r)
		if len(recent) > 0 && r.IntN(2) == 0 {
			ks[i] = recent[r.IntN(len(recent))]
		}
		keys[i] = s.keys[ks[i]]
		blocks[i] = make([]int, bpk)
		skip := r.IntN(3) == 0
		named := 0
		for j := range bpk {
			if skip && r.IntN(2) == 0 {
				blocks[i][j] = NoBlock
				noBlock = true
				continue
			}
			blocks[i][j] = half + pool[0]
			pool = pool[1:]
			named++
		}
		if named == 0 {
			j := r.IntN(bpk)
			blocks[i][j] = half + pool[0]
			pool = pool[1:]
		}
	}
	if noBlock {
		s.n.noBlockLoads.Add(1)
	}
	res, ok, cancelled := s.submit(t, r, func(ctx context.Context) (*Job, error) {
		return s.e.Load(ctx, LoadRequest{Cache: s.caches[w].id, Keys: keys, Blocks: blocks})
	})
	s.n.loads.Add(1)
	got := s.newArea(half)
	if !s.copyArea(t, w, half, half, got, true) {
		return nil, cancelled
	}
	if !ok {
		return got, cancelled
	}
	touched := map[int]bool{} // blocks a key that did not load may have written
	for i, kr := range res.Keys {
		switch kr.Outcome {
		case OutcomeLoaded:
			s.n.keysLoaded.Add(1)
		case OutcomeMissing:
			s.n.keysMissing.Add(1)
		case OutcomeFailed:
			s.countFailed(kr.Err)
		}
		if kr.Outcome != OutcomeLoaded {
			for _, b := range blocks[i] {
				if b != NoBlock {
					touched[b-half] = true
				}
			}
			continue
		}
		var ver uint64
		for j, b := range blocks[i] {
			if b == NoBlock {
				continue
			}
			b -= half
			for l := range s.g.Layers {
				for p := range s.g.Planes() {
					v, err := checkPiece(s.piece(got, l, p, b), ks[i], j, l, p)
					if err != nil {
						t.Errorf("worker %d: a load reported key %d loaded: %v", w, ks[i], err)
						return got, cancelled
					}
					if ver != 0 && v != ver {
						t.Errorf("worker %d: key %d loaded with blocks of versions %d and %d", w, ks[i], ver, v)
						return got, cancelled
					}
					ver = v
				}
			}
			s.n.blocksChecked.Add(1)
		}
		s.mu.Lock()
		s.observed = append(s.observed, observed{ks[i], ver})
		s.mu.Unlock()
	}
	// Blocks no key named, or named only by keys that missed, keep the
	// poison.
	named := map[int]bool{}
	for i, kr := range res.Keys {
		for _, b := range blocks[i] {
			if b != NoBlock && kr.Outcome != OutcomeMissing {
				named[b-half] = true
			}
		}
	}
	for b := range half {
		if named[b] || touched[b] && !s.missedOnly(res, blocks, half+b) {
			continue
		}
		for l := range s.g.Layers {
			for p := range s.g.Planes() {
				pc := s.piece(got, l, p, b)
				if i := slices.IndexFunc(pc, func(c byte) bool { return c != stressPoison }); i >= 0 {
					t.Errorf("worker %d: block %d (layer %d, plane %d), which no loaded key named (%v: %v), was written at byte %d", w, b, l, p, blocks, outcomes(res), i)
					return got, cancelled
				}
			}
		}
	}
	return got, cancelled
}

// missedOnly reports whether every key of res naming block b missed.
func (s *gpuStress) missedOnly(res Result, blocks [][]int, b int) bool {
	for i, kr := range res.Keys {
		if slices.Contains(blocks[i], b) && kr.Outcome != OutcomeMissing {
			return false
		}
	}
	return true
}

// outcomes lists res's outcomes.
func outcomes(res Result) []Outcome {
	var out []Outcome
	for _, k := range res.Keys {
		out = append(out, k.Outcome)
	}
	return out
}

// closedErr reports whether err is the engine's refusal once it is
// closing (runAndClose).
func (s *gpuStress) closedErr(err error) bool {
	return s.closing.Load() && errors.Is(err, ErrClosed)
}

// runAndClose runs the workers in one phase and, once they have done
// half of their operations, closes the engine (with a context already
// cancelled in half of the seeds: its jobs are cancelled; in a third of
// them the device breaks for good first, as on a sticky error, so that
// every later CUDA call there fails) and the mover,
// as the daemon does, and marks the runtime unloaded, while the workers
// go on submitting. Once they stopped, nothing of the mount's files is
// left, and no CUDA call came after the mark.
func (s *gpuStress) runAndClose(t *testing.T) {
	r := rand.New(rand.NewPCG(s.seed, 9))
	cancelled := r.IntN(2) == 0
	broken := r.IntN(3) == 0
	var wg, workers sync.WaitGroup
	for w := range s.workers {
		rw := rand.New(rand.NewPCG(s.seed, uint64(w)+100))
		var recent []int
		workers.Go(func() { s.worker(t, w, rw, &recent, s.ops) })
	}
	stopped := make(chan struct{}) // every worker has returned (a failure stops them early)
	go func() { workers.Wait(); close(stopped) }()
	wg.Go(func() {
		select {
		case <-s.halfway:
		case <-stopped:
		}
		if broken {
			s.devMu.Lock() // the workers' own copies would fail
			s.fake.BreakDevice(0, 700)
			s.unloaded = true
			s.devMu.Unlock()
		}
		s.closing.Store(true)
		ctx, cancel := context.WithCancel(context.Background())
		if cancelled {
			cancel()
		}
		defer cancel()
		if err := s.e.Close(ctx); err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("the engine's Close: %v", err)
		}
		if err := s.mv.Close(); err != nil && !broken {
			t.Errorf("the mover's Close: %v", err)
		}
		s.devMu.Lock()
		s.unloaded = true
		s.fake.Unload(true)
		s.devMu.Unlock()
	})
	wg.Wait()
	<-stopped
	s.fake.BreakDevice(0, 0)
	t.Logf("closed while busy, with a cancelled context: %v, the device broken: %v", cancelled, broken)
	if l := leftovers(t, s.dir); len(l) != 0 {
		t.Errorf("temporary or spare files left after the engine's Close: %v", l)
	}
	// A broken device takes no unregistration (the mover cannot make it
	// current): the registrations stay with the broken context, which
	// only the process's end destroys. The mappings go all the same.
	if n := s.fake.Registrations(); n != 0 && !broken {
		t.Errorf("%d registrations left in the fake library after Close", n)
	}
	if maps, fds := mountFiles(t, s.dir); len(maps)+len(fds) != 0 {
		t.Errorf("after Close: mappings %v, descriptors %v of the mount's files", maps, fds)
	}
	if n := s.fake.CallsAfterUnload(); n != 0 {
		t.Errorf("%d CUDA calls after Close returned and the runtime was marked unloaded", n)
	}
	s.misuse(t)
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, o := range s.observed {
		if !s.stored[o.v] {
			t.Errorf("key %d loaded as version %d, which no store reported stored", o.key, o.v)
		}
	}
}

// counts describes what the run did.
func (s *gpuStress) counts() string {
	st := s.e.Stats()
	fst := s.mv.FileStats()
	cpu, dev := s.mv.SumJobs()
	return fmt.Sprintf("stores %d (keys stored %d, present %d), loads %d (NoBlock %d; keys loaded %d, missing %d; blocks checked %d), keys failed %d (cancelled %d), deletes %d, lookups %d, jobs cancelled %d, caches freed and made anew %d, faults injected %d, engine restarts %d; engine: evictions %d, spares reused %d, made %d, corrupt %d; registrar: registered %d (found at open %d), released %d, failed %d, direct stores %d, loads %d; checksum jobs cpu %d gpu %d; device faults %v",
		s.n.stores.Load(), s.n.keysStored.Load(), s.n.keysPresent.Load(), s.n.loads.Load(), s.n.noBlockLoads.Load(), s.n.keysLoaded.Load(), s.n.keysMissing.Load(), s.n.blocksChecked.Load(),
		s.n.keysFailed.Load(), s.n.cancelledKeys.Load(), s.n.deletes.Load(), s.n.lookups.Load(), s.n.cancels.Load(), s.n.recycles.Load()-int64(s.workers), s.n.faults.Load(), s.n.restarts.Load(),
		st.Evictions, st.Reused, st.SparesMade, st.Corrupt, fst.Registered, fst.Warmed, fst.Released, fst.Failed, fst.Stores, fst.Loads, cpu, dev, s.mv.DeviceFaults())
}

// mountFiles lists what the process holds of files under dir: the paths
// of its mappings (a removed file's ends in " (deleted)") and of its
// descriptors.
func mountFiles(t *testing.T, dir string) (maps, fds []string) {
	t.Helper()
	abs, err := filepath.Abs(dir)
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(b)) {
		f := strings.Fields(line)
		if len(f) >= 6 {
			p := strings.Join(f[5:], " ")
			if strings.HasPrefix(p, abs+"/") {
				maps = append(maps, p)
			}
		}
	}
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		p, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name()))
		if err == nil && strings.HasPrefix(p, abs+"/") {
			fds = append(fds, p)
		}
	}
	return maps, fds
}

// walk sums the lengths of the published files and of the spares under
// dir, and lists the temporary files.
func walkMount(t *testing.T, dir string) (used, spares int64, nspares int, tmps []string) {
	t.Helper()
	filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return nil
		}
		switch name := d.Name(); {
		case strings.HasPrefix(name, sparePrefix):
			spares += info.Size()
			nspares++
		case strings.HasPrefix(name, tmpPrefix):
			tmps = append(tmps, path)
		case !strings.HasPrefix(name, "."):
			used += info.Size()
		}
		return nil
	})
	return used, spares, nspares, tmps
}

// quiesced checks, once the workers stopped and the engine's background
// work settled, what no job may leave behind, then loads every key.
func (s *gpuStress) quiesced(t *testing.T) {
	if t.Failed() {
		return
	}
	waitEngineSpares(t, s.e)
	wctx, cancel := context.WithTimeout(context.Background(), testwait.Hang)
	defer cancel()
	if err := s.e.WaitWarmed(wctx); err != nil { // the files found at a restart offered
		t.Fatalf("wait for the files found at open to be offered: %v", err)
	}
	var why string
	ok := func() bool {
		maps, fds := mountFiles(t, s.dir)
		fst := s.mv.FileStats()
		regs := s.fake.Registrations()
		st := s.e.Stats()
		used, spares, nspares, tmps := walkMount(t, s.dir)
		ms := st.Mounts[0]
		switch {
		case slices.ContainsFunc(maps, func(p string) bool { return strings.HasSuffix(p, " (deleted)") }):
			why = fmt.Sprintf("removed files still mapped: %v", maps)
		case slices.ContainsFunc(fds, func(p string) bool { return strings.HasSuffix(p, " (deleted)") }):
			why = fmt.Sprintf("removed files still open: %v", fds)
		case fst.Queued != 0:
			why = fmt.Sprintf("%d offers queued", fst.Queued)
		case regs != fst.Files || len(maps) != fst.Files:
			why = fmt.Sprintf("%d registrations in the fake library, %d files registered by the mover, %d mappings of the mount's files (%v)", regs, fst.Files, len(maps), maps)
		case !slices.Equal(slices.Sorted(slices.Values(maps)), slices.Sorted(slices.Values(slices.DeleteFunc(fds, func(p string) bool {
			// The owner files are held open; the access journal only
			// while an append to it runs (accessLog.append), which no
			// job waits for.
			return strings.HasPrefix(filepath.Base(p), ownerPrefix) || strings.HasPrefix(filepath.Base(p), accesslog.Prefix)
		})))):
			why = fmt.Sprintf("descriptors of the mount's files %v, beside the owner files' and the access journal's, are not those of the registered files %v", fds, maps)
		case ms.Used != used || ms.SpareBytes != spares || ms.SpareFiles != nspares || len(tmps) != 0:
			why = fmt.Sprintf("the engine counts %d bytes used and %d spares of %d bytes; the mount holds %d bytes of files, %d spares of %d bytes, temporary files %v", ms.Used, ms.SpareFiles, ms.SpareBytes, used, nspares, spares, tmps)
		default:
			return true
		}
		return false
	}
	// The registrar may still be registering spares made ahead: once it
	// has taken every offer, the rest must hold at once, with no job in
	// flight.
	testwait.Until(t, "the registrar to take every offer", testwait.Hang, func() bool { return s.mv.FileStats().Queued == 0 })
	if !ok() {
		t.Fatalf("after the workers stopped: %s", why)
	}
	if st := s.e.Stats(); st.Corrupt != 0 {
		t.Errorf("%d files dropped as corrupt", st.Corrupt)
	}
	s.misuse(t)
	// Every key left loads with a version one store reported stored.
	for k := 0; k < stressKeys; k += stressMaxKeys {
		s.finalLoad(t, k)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, o := range s.observed {
		if !s.stored[o.v] {
			t.Errorf("key %d loaded as version %d, which no store reported stored", o.key, o.v)
		}
	}
}

// misuse checks that no copy ran over host memory neither pinned nor
// registered (a file's mapping after its registration was released),
// that no stream was destroyed with copies queued, and that no call named
// a stream or event destroyed.
func (s *gpuStress) misuse(t *testing.T) {
	if n := s.fake.StrayCopies(); n != 0 {
		t.Errorf("%d copies ran over host memory neither pinned nor registered", n)
	}
	if n := s.fake.BusyDestroys(); n != 0 {
		t.Errorf("%d streams destroyed with copies queued", n)
	}
	if n := s.fake.DeadHandles(); n != 0 {
		t.Errorf("%d calls named a stream or event destroyed", n)
	}
}

// finalLoad loads keys [k, k+stressMaxKeys) into worker 0's load area and
// checks the keys that load.
func (s *gpuStress) finalLoad(t *testing.T, k int) {
	bpk := s.g.BlocksPerKey()
	half := s.per / 2
	var keys [][]byte
	var blocks [][]int
	for i := k; i < min(k+stressMaxKeys, stressKeys); i++ {
		keys = append(keys, s.keys[i])
		var bs []int
		for j := range bpk {
			bs = append(bs, half+(i-k)*bpk+j)
		}
		blocks = append(blocks, bs)
	}
	res := wait(t)(s.e.Load(context.Background(), LoadRequest{Cache: s.caches[0].id, Keys: keys, Blocks: blocks}))
	got := s.newArea(half)
	s.copyArea(t, 0, half, half, got, true)
	for i, kr := range res.Keys {
		switch kr.Outcome {
		case OutcomeMissing:
			continue
		case OutcomeLoaded:
		default:
			t.Errorf("key %d: %v (%v) after the workers stopped", k+i, kr.Outcome, kr.Err)
			continue
		}
		var ver uint64
		for j := range bpk {
			for l := range s.g.Layers {
				for p := range s.g.Planes() {
					v, err := checkPiece(s.piece(got, l, p, i*bpk+j), k+i, j, l, p)
					if err != nil {
						t.Errorf("after the workers stopped: %v", err)
						return
					}
					if ver != 0 && v != ver {
						t.Errorf("key %d loaded with blocks of versions %d and %d", k+i, ver, v)
					}
					ver = v
				}
			}
		}
		s.mu.Lock()
		s.observed = append(s.observed, observed{k + i, ver})
		s.mu.Unlock()
	}
}

// closed closes the engine and then the mover, as the daemon does, and
// checks that nothing of the mount's files is left in the process or
// the fake library, and that no CUDA call comes once the runtime is
// marked unloaded.
func (s *gpuStress) closed(t *testing.T) {
	if t.Failed() {
		return
	}
	if err := s.e.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if l := leftovers(t, s.dir); len(l) != 0 {
		t.Errorf("temporary or spare files left after the engine's Close: %v", l)
	}
	if err := s.mv.Close(); err != nil {
		t.Errorf("the mover's Close: %v", err)
	}
	s.misuse(t)
	s.fake.Unload(true)
	if n := s.fake.Registrations(); n != 0 {
		t.Errorf("%d registrations left in the fake library after Close", n)
	}
	if maps, fds := mountFiles(t, s.dir); len(maps)+len(fds) != 0 {
		t.Errorf("after Close: mappings %v, descriptors %v of the mount's files", maps, fds)
	}
	// What the engine could still call: nothing reaches CUDA.
	name := filepath.Join(s.dir, "after-close")
	if f, err := (fsys.OS{}).OpenFile(name, os.O_RDWR|os.O_CREATE, 0o644); err == nil {
		f.WriteAt(make([]byte, 4096), 0)
		s.mv.Prepare(f)
		s.mv.Warm(f)
		f.Close()
		os.Remove(name)
	}
	if n := s.fake.CallsAfterUnload(); n != 0 {
		t.Errorf("%d CUDA calls after Close returned and the runtime was marked unloaded", n)
	}
	s.fake.Unload(false)
}
