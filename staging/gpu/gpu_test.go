package gpu

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/cuda/cudatest"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/crc32c"
	"github.com/kvhost/kvhost/internal/fstype"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/staging"
	"github.com/kvhost/kvhost/transfer"
)

type env struct {
	r    *cuda.Runtime
	fake *cudatest.Fake
	w    *cuda.Worker // for setup on device 0
}

func newEnv(t *testing.T) *env {
	t.Helper()
	path := cudatest.Build(t)
	r, w := openGPU(t, cuda.Config{Runtime: []string{path}, Driver: []string{path}})
	return &env{r: r, fake: cudatest.Open(t, path), w: w}
}

func (e *env) mover(t *testing.T, cfg Config) *Mover {
	t.Helper()
	cfg.Runtime = e.r
	m, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() {
		if free := m.bufs.free(); free != m.bufs.total() {
			t.Errorf("%d of %d pinned buffers not returned", m.bufs.total()-free, m.bufs.total())
		}
		m.Close()
	})
	return m
}

func testGeometry() geometry {
	if testing.Short() {
		return geometry{layers: 4, numBlocks: 64, pageBytes: 16 << 10, blocksPerKey: 16, headerBytes: 4096}
	}
	// Llama-3.1-8B bf16: 32 layers, 64 KiB page per layer per block, 16
	// blocks per 256-token key: 512 pages, a 32 MiB file.
	return geometry{layers: 32, numBlocks: 64, pageBytes: 64 << 10, blocksPerKey: 16, headerBytes: 4096}
}

func createFile(t *testing.T, name string) fsys.File {
	t.Helper()
	return createFileIn(t, t.TempDir(), name, 0)
}

// createFileIn creates name in dir with the extra open flags flag.
func createFileIn(t *testing.T, dir, name string, flag int) fsys.File {
	t.Helper()
	f, err := fsys.OS{}.OpenFile(filepath.Join(dir, name), os.O_RDWR|os.O_CREATE|flag, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// fsDir returns a fresh directory on a memory file system (memory) or on
// one that is not, where O_DIRECT files can be opened, or skips the test
// naming what is missing.
func fsDir(t *testing.T, memory bool) string {
	t.Helper()
	base := os.TempDir()
	if memory {
		base = "/dev/shm"
	}
	var st unix.Statfs_t
	if err := unix.Statfs(base, &st); err != nil {
		t.Skipf("no %s: %v", base, err)
	}
	if k, _ := fstype.Of(st.Type); k.Memory != memory {
		t.Skipf("%s: memory file system %v, want %v", base, k.Memory, memory)
	}
	dir, err := os.MkdirTemp(base, "kvhost-gpu-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	probe, err := os.OpenFile(filepath.Join(dir, "probe"), os.O_RDWR|os.O_CREATE|unix.O_DIRECT, 0o644)
	if err != nil {
		t.Skipf("%s refuses O_DIRECT: %v", base, err)
	}
	probe.Close()
	return dir
}

// TestFusedUnlessDirectToADevice: checksums are fused with the system
// calls for buffered files and for O_DIRECT files on a memory file system
// (a CPU copy either way), not for O_DIRECT files on a device.
func TestFusedUnlessDirectToADevice(t *testing.T) {
	cases := []struct {
		name   string
		memory bool
		direct bool
		want   bool
	}{
		{"buffered-disk", false, false, true},
		{"direct-disk", false, true, false},
		{"buffered-tmpfs", true, false, true},
		{"direct-tmpfs", true, true, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := fusedIO(&transfer.Plan{Direct: c.direct, Memory: c.memory}); got != c.want {
				t.Fatalf("fusedIO = %v, want %v", got, c.want)
			}
			if got, want := PieceBytes(c.direct, c.memory), map[bool]int{true: fuseBatch, false: 0}[c.want]; got != want {
				t.Fatalf("PieceBytes = %d, want %d", got, want)
			}
		})
	}
}

// TestRoundTripScatteredPlan stores a key's scattered pages to a file and
// loads them back into poisoned device memory, in every copy mode, with
// and without direct-I/O rules and checksums: the file holds the pages in
// plan order, the device the original bytes, the checksums equal CRC-32C
// of the same bytes.
func TestRoundTripScatteredPlan(t *testing.T) {
	e := newEnv(t)
	g := testGeometry()
	cases := []struct {
		name   string
		mode   cuda.CopyMode
		direct bool
		nosums bool
		chunk  int
		// fs: "" a file opened buffered in t.TempDir(); "tmpfs" or "disk"
		// an O_DIRECT file (direct) on a memory file system (fused
		// checksums) or not (a checksum pass per chunk).
		fs string
		// onDevice: checksums on the device (Config.SumsOnDevice).
		onDevice bool
	}{
		{"batch", cuda.CopyBatch, false, false, 0, "", false},
		{"segments", cuda.CopySegments, false, false, 0, "", false},
		{"batch-direct", cuda.CopyBatch, true, false, 0, "", false},
		{"segments-direct-small-chunks", cuda.CopySegments, true, false, 3 * align, "", false},
		{"batch-no-checksums", cuda.CopyBatch, false, true, 1 << 20, "", false},
		{"batch-o-direct-tmpfs", cuda.CopyBatch, true, false, 0, "tmpfs", false},
		{"batch-o-direct-tmpfs-odd-chunks", cuda.CopyBatch, true, false, 67 * align, "tmpfs", false},
		{"batch-o-direct-disk", cuda.CopyBatch, true, false, 0, "disk", false},
		// Reads from memory file systems go in pieces without checksums too.
		{"batch-o-direct-tmpfs-no-checksums", cuda.CopyBatch, true, true, 0, "tmpfs", false},
		{"segments-o-direct-tmpfs-no-checksums-odd-chunks", cuda.CopySegments, true, true, 67 * align, "tmpfs", false},
		{"batch-buffered-no-checksums-odd-chunks", cuda.CopyBatch, false, true, 67 * align, "", false},
		// The copy kernel: one launch per chunk.
		{"kernel", cuda.CopyKernel, false, false, 0, "", false},
		{"kernel-direct-small-chunks", cuda.CopyKernel, true, false, 3 * align, "", false},
		{"kernel-o-direct-tmpfs-odd-chunks", cuda.CopyKernel, true, false, 67 * align, "tmpfs", false},
		{"kernel-o-direct-disk-no-checksums", cuda.CopyKernel, true, true, 0, "disk", false},
		{"auto", cuda.CopyAuto, false, false, 0, "", false},
		// Checksums on the device: one launch of the checksum kernel per
		// job, after a load's copies, before a store's.
		{"batch-sums-on-device", cuda.CopyBatch, false, false, 0, "", true},
		{"segments-sums-on-device-direct-small-chunks", cuda.CopySegments, true, false, 3 * align, "", true},
		{"batch-sums-on-device-o-direct-tmpfs-odd-chunks", cuda.CopyBatch, true, false, 67 * align, "tmpfs", true},
		{"batch-sums-on-device-o-direct-disk", cuda.CopyBatch, true, false, 0, "disk", true},
		{"kernel-sums-on-device", cuda.CopyKernel, false, false, 0, "", true},
		{"batch-sums-on-device-no-checksums", cuda.CopyBatch, false, true, 0, "", true},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := e.mover(t, Config{Devices: []int{0}, MaxStaging: 64 << 20, Chunk: c.chunk, Copy: c.mode, NoChecksums: c.nosums, SumsOnDevice: c.onDevice})
			wantMode := c.mode
			if c.mode == cuda.CopyAuto {
				wantMode = cuda.CopyBatch // never the kernel: it would take turns with inference kernels
			}
			if m.CopyMode() != wantMode {
				t.Fatalf("CopyMode() = %v, want %v", m.CopyMode(), wantMode)
			}
			launches, batches := e.fake.Count(cudatest.OpLaunch), e.fake.Count(cudatest.OpBatch)
			sumLaunches := 0 // a store's and a load's
			if c.onDevice && !c.nosums {
				sumLaunches = 2
			}
			defer func() {
				launched, batched := e.fake.Count(cudatest.OpLaunch)-launches, e.fake.Count(cudatest.OpBatch) > batches
				if (launched > sumLaunches) != (wantMode == cuda.CopyKernel) || batched != (wantMode == cuda.CopyBatch) {
					t.Errorf("mode %v: %d kernel launches (%d of them checksums), batched copies %v", wantMode, launched, sumLaunches, batched)
				}
				if wantMode != cuda.CopyKernel && launched != sumLaunches {
					t.Errorf("%d launches, want %d of the checksum kernel", launched, sumLaunches)
				}
			}()
			kv := newCache(t, e.w, g)
			orig := kv.randomize(t, e.w, uint64(i))
			host := map[region.Region][]byte{}
			for l, b := range orig {
				host[kv.layers[l]] = b
			}
			blocks := keyBlocks(rand.New(rand.NewPCG(uint64(i), 2)), g.numBlocks, g.blocksPerKey)
			p := kv.plan(blocks, c.direct)
			p.Memory = c.fs == "tmpfs"
			wantFile, wantSums := expect(p, host)
			var f fsys.File
			if c.fs == "" {
				f = createFile(t, "key")
			} else {
				f = createFileIn(t, fsDir(t, c.fs == "tmpfs"), "key", unix.O_DIRECT)
			}
			sums := make([]uint32, p.Sums)
			n, err := m.WriteFile(context.Background(), f, p, sums)
			if err != nil || n != p.Bytes() {
				t.Fatalf("WriteFile = %d, %v; want %d", n, err, p.Bytes())
			}
			got := fsys.AlignedBuffer(len(wantFile))
			if _, err := f.ReadAt(got, int64(g.headerBytes)); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, wantFile) {
				t.Fatalf("file bytes differ from the pages in plan order")
			}
			if c.nosums {
				if m.Checksums() || sums[0] != 0 {
					t.Fatalf("checksums off: Checksums() %v, sums %v", m.Checksums(), sums)
				}
			} else if !equal(sums, wantSums) {
				t.Fatalf("store checksums %x, want %x", sums, wantSums)
			}
			kv.poison(t, e.w)
			lsums := make([]uint32, p.Sums)
			if n, err := m.ReadFile(context.Background(), f, p, lsums); err != nil || n != p.Bytes() {
				t.Fatalf("ReadFile = %d, %v; want %d", n, err, p.Bytes())
			}
			if !c.nosums && !equal(lsums, wantSums) {
				t.Fatalf("load checksums %x, want %x", lsums, wantSums)
			}
			inKey := map[int]bool{}
			for _, b := range blocks {
				inKey[b] = true
			}
			for l := range g.layers {
				dev := kv.get(t, e.w, l)
				for b := range g.numBlocks {
					page := dev[b*g.pageBytes : (b+1)*g.pageBytes]
					want := orig[l][b*g.pageBytes : (b+1)*g.pageBytes]
					if inKey[b] && !bytes.Equal(page, want) {
						t.Fatalf("layer %d block %d: loaded bytes differ", l, b)
					}
					if !inKey[b] && !bytes.Equal(page, bytes.Repeat([]byte{0xEE}, g.pageBytes)) {
						t.Fatalf("layer %d block %d: a page outside the key was written", l, b)
					}
				}
			}
		})
	}
}

func equal(a, b []uint32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestFailuresFailTheCall injects a CUDA or file failure into a store or a
// load and checks that the call returns an error naming it, and that every
// pinned buffer comes back (checked at cleanup). Waits fail where they
// poll (cudaEventQuery), where they block (cudaEventSynchronize), and
// where they block after polling in vain.
func TestFailuresFailTheCall(t *testing.T) {
	e := newEnv(t)
	g := geometry{layers: 4, numBlocks: 32, pageBytes: 16 << 10, blocksPerKey: 16, headerBytes: 4096}
	kv := newCache(t, e.w, g)
	kv.randomize(t, e.w, 7)
	p := kv.plan([]int{3, 1, 4, 15, 9, 2, 6, 5, 30, 8, 11, 20, 7, 0, 12, 31}, false)
	cfg := Config{Devices: []int{0}, MaxStaging: 8 << 20, Chunk: 64 << 10, Copy: cuda.CopyBatch}
	polling := e.mover(t, cfg)
	cfg.Poll = -1
	blocking := e.mover(t, cfg)
	cfg.Poll = 50 * time.Microsecond
	briefly := e.mover(t, cfg)
	m := polling
	good := createFile(t, "good")
	if _, err := m.WriteFile(context.Background(), good, p, make([]uint32, p.Sums)); err != nil {
		t.Fatal(err)
	}
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	// neverReady makes every event answer "not ready" to its queries, so
	// that a polling wait ends blocked.
	neverReady := func(fault func(*testing.T) (fsys.File, func())) func(*testing.T) (fsys.File, func()) {
		return func(t *testing.T) (fsys.File, func()) {
			e.fake.Busy(-1)
			f, undo := fault(t)
			return f, func() { undo(); e.fake.Busy(0) }
		}
	}
	cases := []struct {
		name  string
		m     *Mover // nil: polling
		write bool
		fault func(t *testing.T) (fsys.File, func())
		ctx   context.Context
		want  error
	}{
		{"store copy fault", nil, true, e.cudaFault(nil, cudatest.OpCopy, 40, cuda.ErrorIllegalAddress), nil, cuda.ErrorIllegalAddress},
		{"store query fault", nil, true, e.cudaFault(nil, cudatest.OpQuery, 3, cuda.ErrorLaunchFailure), nil, cuda.ErrorLaunchFailure},
		{"store sync fault", blocking, true, e.cudaFault(nil, cudatest.OpSync, 3, cuda.ErrorLaunchFailure), nil, cuda.ErrorLaunchFailure},
		{"store sync fault after polling", briefly, true, neverReady(e.cudaFault(nil, cudatest.OpSync, 3, cuda.ErrorLaunchFailure)), nil, cuda.ErrorLaunchFailure},
		{"load copy fault", nil, false, e.cudaFault(good, cudatest.OpCopy, 40, cuda.ErrorIllegalAddress), nil, cuda.ErrorIllegalAddress},
		{"store copy fault, not sticky", nil, true, e.cudaFault(nil, cudatest.OpCopy, 40, cuda.ErrorInvalidValue), nil, cuda.ErrorInvalidValue},
		{"load copy fault, not sticky", nil, false, e.cudaFault(good, cudatest.OpCopy, 40, cuda.ErrorInvalidValue), nil, cuda.ErrorInvalidValue},
		{"load query fault", nil, false, e.cudaFault(good, cudatest.OpQuery, 2, cuda.ErrorLaunchFailure), nil, cuda.ErrorLaunchFailure},
		{"load sync fault", blocking, false, e.cudaFault(good, cudatest.OpSync, 2, cuda.ErrorLaunchFailure), nil, cuda.ErrorLaunchFailure},
		{"load sync fault after polling", briefly, false, neverReady(e.cudaFault(good, cudatest.OpSync, 2, cuda.ErrorLaunchFailure)), nil, cuda.ErrorLaunchFailure},
		{"store record fault", nil, true, e.cudaFault(nil, cudatest.OpRecord, 2, cuda.ErrorLaunchFailure), nil, cuda.ErrorLaunchFailure},
		{"load record fault", nil, false, e.cudaFault(good, cudatest.OpRecord, 3, cuda.ErrorLaunchFailure), nil, cuda.ErrorLaunchFailure},
		{"store write fault", nil, true, faultyFile(fsys.OpWrite, 2, syscall.ENOSPC), nil, syscall.ENOSPC},
		{"load read fault", nil, false, faultyFile(fsys.OpRead, 2, syscall.EIO), nil, syscall.EIO},
		{"load short file", nil, false, func(t *testing.T) (fsys.File, func()) {
			f := createFile(t, "short")
			b := make([]byte, p.Bytes()/2)
			good.ReadAt(b, 0)
			f.WriteAt(b, 0)
			return f, func() {}
		}, nil, staging.ErrShortFile},
		{"store cancelled", nil, true, func(t *testing.T) (fsys.File, func()) { return createFile(t, "c"), func() {} }, cancelled, context.Canceled},
		{"load cancelled", nil, false, func(*testing.T) (fsys.File, func()) { return good, func() {} }, cancelled, context.Canceled},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := c.m
			if m == nil {
				m = polling
			}
			// No idle lanes: the call makes its own, and a lane that saw a
			// CUDA failure must not come back for reuse.
			if err := m.destroyIdle(m.devs[0]); err != nil {
				t.Fatal(err)
			}
			f, undo := c.fault(t)
			defer undo()
			ctx := c.ctx
			if ctx == nil {
				ctx = context.Background()
			}
			faults := m.DeviceFaults()[0]
			var err error
			if c.write {
				_, err = m.WriteFile(ctx, f, p, make([]uint32, p.Sums))
			} else {
				_, err = m.ReadFile(ctx, f, p, make([]uint32, p.Sums))
			}
			if !errors.Is(err, c.want) {
				t.Fatalf("err = %v, want %v", err, c.want)
			}
			var cudaErr cuda.Error
			if errors.As(c.want, &cudaErr) && len(m.devs[0].idle) != 0 {
				t.Fatalf("the lane of a call that failed in CUDA was kept for reuse")
			}
			// A sticky CUDA error counts once against the device; other
			// failures, an invalid value from CUDA among them, never do.
			want := faults
			if errors.As(c.want, &cudaErr) && cudaErr.Sticky() {
				want++
			}
			if got := m.DeviceFaults()[0]; got != want {
				t.Errorf("device 0's fault count went from %d to %d, want %d", faults, got, want)
			}
		})
	}
	// The movers still work after every failure.
	for _, m := range []*Mover{polling, blocking, briefly} {
		if _, err := m.ReadFile(context.Background(), good, p, make([]uint32, p.Sums)); err != nil {
			t.Fatalf("load after failures: %v", err)
		}
	}
}

// cudaFault fails the nth next CUDA operation op during a call on f (a
// new file if nil).
func (e *env) cudaFault(f fsys.File, op cudatest.Op, n int, code cuda.Error) func(*testing.T) (fsys.File, func()) {
	return func(t *testing.T) (fsys.File, func()) {
		if f == nil {
			f = createFile(t, "new")
		}
		e.fake.Fail(op, n, int(code))
		return f, func() { e.fake.Fail(op, 0, 0) }
	}
}

func faultyFile(op fsys.Op, at int, errno error) func(*testing.T) (fsys.File, func()) {
	return func(t *testing.T) (fsys.File, func()) {
		fs := &fsys.Faulty{FS: fsys.OS{}, Inj: &fsys.Counter{Ops: []fsys.Op{op}, At: at, Fault: fsys.Fault{Err: errno}}}
		f, err := fs.OpenFile(filepath.Join(t.TempDir(), "f"), os.O_RDWR|os.O_CREATE, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		f.WriteAt(make([]byte, 1<<20), 0)
		return f, func() { f.Close() }
	}
}

func TestPlansTheMoverCannotServeAreRefused(t *testing.T) {
	e := newEnv(t)
	m := e.mover(t, Config{Devices: []int{0}, MaxStaging: 1 << 20, Chunk: 64 << 10})
	kv := newCache(t, e.w, geometry{layers: 1, numBlocks: 4, pageBytes: 4096, blocksPerKey: 2})
	host, err := region.NewHost("t", 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer host.Close()
	f := createFile(t, "x")
	cases := []struct {
		name string
		p    *transfer.Plan
		want error
	}{
		{"host region", &transfer.Plan{Extents: []transfer.Extent{{Region: host, Len: 4096, Sum: -1}}}, transfer.ErrUnsupported},
		{"unaligned direct write", &transfer.Plan{Direct: true, Extents: []transfer.Extent{{FileOff: 100, Region: kv.layers[0], Len: 4096, Sum: -1}}}, errUnaligned},
		{"out of region", &transfer.Plan{Extents: []transfer.Extent{{Region: kv.layers[0], RegionOff: 4096, Len: 4 * 4096, Sum: -1}}}, region.ErrBounds},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if _, err := m.WriteFile(context.Background(), f, c.p, nil); !errors.Is(err, c.want) {
				t.Fatalf("err = %v, want %v", err, c.want)
			}
		})
	}
}

// TestPinnedPoolAllocatedOnceAndHammered runs many concurrent round trips
// through a pool smaller than the jobs' combined depth: every job
// finishes with the right bytes (no deadlock when jobs wait for buffers),
// no pinned memory is allocated or registered per request, and every
// buffer and every lane comes back.
func TestPinnedPoolAllocatedOnceAndHammered(t *testing.T) {
	e := newEnv(t)
	g := geometry{layers: 4, numBlocks: 256, pageBytes: 8 << 10, blocksPerKey: 8, headerBytes: 4096}
	allocs, regs := e.fake.Count(cudatest.OpHostAlloc), e.fake.Count(cudatest.OpHostRegister)
	m := e.mover(t, Config{Devices: []int{0}, MaxStaging: 3 * (32<<10 + 2*align), Chunk: 32 << 10})
	if got := e.fake.Count(cudatest.OpHostAlloc) - allocs; got != 1 {
		t.Fatalf("New made %d pinned allocations, want 1", got)
	}
	allocs = e.fake.Count(cudatest.OpHostAlloc)
	kv := newCache(t, e.w, g)
	orig := kv.randomize(t, e.w, 99)
	host := map[region.Region][]byte{}
	for l, b := range orig {
		host[kv.layers[l]] = b
	}
	jobs, rounds := 12, 20
	if testing.Short() {
		rounds = 5
	}
	var wg sync.WaitGroup
	errs := make(chan error, jobs)
	for j := range jobs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f, err := fsys.OS{}.OpenFile(filepath.Join(t.TempDir(), "k"), os.O_RDWR|os.O_CREATE, 0o644)
			if err != nil {
				errs <- err
				return
			}
			defer f.Close()
			r := rand.New(rand.NewPCG(uint64(j), 3))
			for range rounds {
				// Keys of one job use their own blocks: loads write back
				// the same bytes, so jobs never disturb each other.
				blocks := keyBlocks(r, g.numBlocks/jobs, g.blocksPerKey)
				for i := range blocks {
					blocks[i] += j * (g.numBlocks / jobs)
				}
				p := kv.plan(blocks, false)
				_, want := expect(p, host)
				ws, rs := make([]uint32, p.Sums), make([]uint32, p.Sums)
				if _, err := m.WriteFile(context.Background(), f, p, ws); err != nil {
					errs <- err
					return
				}
				if _, err := m.ReadFile(context.Background(), f, p, rs); err != nil {
					errs <- err
					return
				}
				if !equal(ws, want) || !equal(rs, want) {
					errs <- errors.New("checksums differ")
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for l := range g.layers {
		if !bytes.Equal(kv.get(t, e.w, l), orig[l]) {
			t.Fatalf("layer %d changed after round trips of its own bytes", l)
		}
	}
	if a, r := e.fake.Count(cudatest.OpHostAlloc)-allocs, e.fake.Count(cudatest.OpHostRegister)-regs; a != 0 || r != 0 {
		t.Fatalf("requests allocated %d and registered %d pinned buffers, want 0", a, r)
	}
	// Every job's lane (stream and events) came back for the next job: at
	// most one per job that ran at once, not one per request.
	if n := len(m.devs[0].idle); n < 1 || n > jobs {
		t.Fatalf("%d idle lanes after %d jobs × %d rounds, want 1..%d", n, jobs, rounds, jobs)
	}
}

// TestKernelFallsBackPerChunkAndLaunchFailuresFailTheCall: with the copy
// kernel, a chunk whose segments are not 16-byte aligned moves by batched
// copies in the same call (the bytes still arrive), and a launch the
// driver refuses fails the call and retires its lane.
func TestKernelFallsBackPerChunkAndLaunchFailuresFailTheCall(t *testing.T) {
	e := newEnv(t)
	g := geometry{layers: 2, numBlocks: 16, pageBytes: 8 << 10, blocksPerKey: 4, headerBytes: 4096}
	kv := newCache(t, e.w, g)
	orig := kv.randomize(t, e.w, 5)
	m := e.mover(t, Config{Devices: []int{0}, MaxStaging: 4 << 20, Chunk: 16 << 10, Copy: cuda.CopyKernel})
	p := kv.plan([]int{3, 9, 0, 14}, false)
	// One more extent of 8 bytes at an odd device offset, at the end of
	// the file: its chunk cannot go through the kernel.
	odd := p.Extents[0]
	odd.FileOff, odd.RegionOff, odd.Len, odd.Sum = p.Extents[len(p.Extents)-1].FileOff+p.Extents[len(p.Extents)-1].Len, 40, 8, -1
	p.Extents = append(p.Extents, odd)
	f := createFile(t, "key")
	launches, batches := e.fake.Count(cudatest.OpLaunch), e.fake.Count(cudatest.OpBatch)
	if _, err := m.WriteFile(context.Background(), f, p, make([]uint32, p.Sums)); err != nil {
		t.Fatal(err)
	}
	kv.poison(t, e.w)
	if _, err := m.ReadFile(context.Background(), f, p, make([]uint32, p.Sums)); err != nil {
		t.Fatal(err)
	}
	if e.fake.Count(cudatest.OpLaunch) == launches || e.fake.Count(cudatest.OpBatch) == batches {
		t.Errorf("kernel launches %d, batched copies %d: want both (aligned chunks and the odd one)",
			e.fake.Count(cudatest.OpLaunch)-launches, e.fake.Count(cudatest.OpBatch)-batches)
	}
	for _, x := range p.Extents {
		l := slices.IndexFunc(kv.layers, func(d *cuda.DeviceMemory) bool { return region.Region(d) == x.Region })
		dev := kv.get(t, e.w, l)
		if !bytes.Equal(dev[x.RegionOff:x.RegionOff+x.Len], orig[l][x.RegionOff:x.RegionOff+x.Len]) {
			t.Fatalf("layer %d bytes at %d differ after the round trip", l, x.RegionOff)
		}
	}
	for _, write := range []bool{true, false} {
		if err := m.destroyIdle(m.devs[0]); err != nil {
			t.Fatal(err)
		}
		e.fake.Fail(cudatest.OpLaunch, 2, 719)
		var err error
		if write {
			_, err = m.WriteFile(context.Background(), createFile(t, "new"), p, make([]uint32, p.Sums))
		} else {
			_, err = m.ReadFile(context.Background(), f, p, make([]uint32, p.Sums))
		}
		e.fake.Fail(cudatest.OpLaunch, 0, 0)
		var de *cuda.DriverError
		if !errors.As(err, &de) || de.Func != "cuLaunchKernel" {
			t.Errorf("write %v: err = %v, want the failed cuLaunchKernel", write, err)
		}
		if len(m.devs[0].idle) != 0 {
			t.Errorf("write %v: the lane of a failed launch was kept for reuse", write)
		}
	}
}

func TestNewRejectsBadConfig(t *testing.T) {
	e := newEnv(t)
	for _, c := range []Config{
		{Runtime: e.r, Chunk: 1000},
		{Runtime: e.r, MaxStaging: 4096},
		{Runtime: e.r, Devices: []int{9}},
		{},
	} {
		if m, err := New(c); err == nil {
			m.Close()
			t.Errorf("New(%+v) succeeded", c)
		}
	}
}

// TestUnalignedDirectLoadFromTmpfs loads byte ranges that start and end
// inside 4 KiB blocks from an O_DIRECT file on a memory file system (fused
// pieces, an aligned read around the range, a lead to skip): the device
// gets the file's bytes and the checksum is CRC-32C of exactly them.
func TestUnalignedDirectLoadFromTmpfs(t *testing.T) {
	e := newEnv(t)
	g := testGeometry()
	kv := newCache(t, e.w, g)
	f := createFileIn(t, fsDir(t, true), "key", unix.O_DIRECT)
	file := fsys.AlignedBuffer(2 << 20)
	rnd := rand.New(rand.NewPCG(7, 7))
	for i := range file {
		file[i] = byte(rnd.Uint32())
	}
	if _, err := f.WriteAt(file, 0); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name     string
		off, len int64
		chunk    int
	}{
		{"inside-one-piece", 100, 3000, 0},
		{"across-pieces", 4096 + 17, 700 << 10, 0},
		{"across-chunks", 123, 1<<20 - 5, 67 * align},
		{"to-the-end", 2<<20 - 9999, 9999, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := e.mover(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, Chunk: c.chunk})
			kv.poison(t, e.w)
			p := &transfer.Plan{Sums: 1, Direct: true, Memory: true, Extents: []transfer.Extent{{FileOff: c.off, Region: kv.layers[0], Len: c.len, Sum: 0}}}
			sums := make([]uint32, 1)
			if n, err := m.ReadFile(context.Background(), f, p, sums); err != nil || n != c.len {
				t.Fatalf("ReadFile = %d, %v; want %d", n, err, c.len)
			}
			want := file[c.off : c.off+c.len]
			if got := kv.get(t, e.w, 0)[:c.len]; !bytes.Equal(got, want) {
				t.Fatalf("loaded bytes differ from the file's")
			}
			if w := crc32c.Checksum(want); sums[0] != w {
				t.Fatalf("checksum %08x, want %08x", sums[0], w)
			}
		})
	}
}

// TestUnalignedEndDirectWriteIsPadded: a direct write whose plan ends inside
// a 4 KiB block is written to the block's end with zeros (the
// transfer.Plan.Direct contract the engine relies on), its checksum covers
// the data only, and a buffer reused from a previous write leaks nothing
// into the padding.
func TestUnalignedEndDirectWriteIsPadded(t *testing.T) {
	e := newEnv(t)
	g := testGeometry()
	kv := newCache(t, e.w, g)
	host := kv.randomize(t, e.w, 11)
	for _, c := range []struct {
		name  string
		len   int64
		chunk int
		memFS bool
	}{
		{"one-block-tmpfs", 100, 0, true},
		{"across-chunks-tmpfs", 3*align + 5, 2 * align, true},
		{"across-pieces-disk", 700<<10 + 1, 0, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			m := e.mover(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, Chunk: c.chunk})
			f := createFileIn(t, fsDir(t, c.memFS), "key", unix.O_DIRECT)
			// Dirty the staging buffers and the file's first MiB first: the
			// padding must overwrite it with zeros, not old bytes.
			full := &transfer.Plan{Direct: true, Memory: c.memFS, Extents: []transfer.Extent{{FileOff: 0, Region: kv.layers[0], Len: 1 << 20, Sum: -1}}}
			if _, err := m.WriteFile(context.Background(), f, full, nil); err != nil {
				t.Fatal(err)
			}
			p := &transfer.Plan{Sums: 1, Direct: true, Memory: c.memFS, Extents: []transfer.Extent{{FileOff: 0, Region: kv.layers[1], Len: c.len, Sum: 0}}}
			sums := make([]uint32, 1)
			if n, err := m.WriteFile(context.Background(), f, p, sums); err != nil || n != c.len {
				t.Fatalf("WriteFile = %d, %v; want %d", n, err, c.len)
			}
			padded := (c.len + align - 1) / align * align
			got := make([]byte, padded)
			if _, err := f.ReadAt(got, 0); err != nil {
				t.Fatal(err)
			}
			if want := host[1][:c.len]; !bytes.Equal(got[:c.len], want) {
				t.Fatal("written bytes differ from the device's")
			}
			if tail := got[c.len:]; !bytes.Equal(tail, make([]byte, len(tail))) {
				t.Fatal("the padding to the block's end is not zeros")
			}
			if w := crc32c.Checksum(host[1][:c.len]); sums[0] != w {
				t.Fatalf("checksum %08x, want %08x (the data only)", sums[0], w)
			}
		})
	}
}

// TestCopyKernelOnlyWhenAsked: CopyAuto never loads the copy kernel (it
// would take turns with the inference process's kernels on the SMs);
// CopyKernel loads it on every served device, fails New with the driver's
// error when the driver refuses the PTX, and unloads it at Close.
func TestCopyKernelOnlyWhenAsked(t *testing.T) {
	e := newEnv(t)
	loads := e.fake.Count(cudatest.OpModuleLoad)
	m := e.mover(t, Config{Devices: []int{0, 1}, MaxStaging: 16 << 20})
	if e.fake.Count(cudatest.OpModuleLoad) != loads || m.CopyMode() != cuda.CopyBatch {
		t.Fatalf("auto: %d module loads, copy mode %v; want none and batched copies", e.fake.Count(cudatest.OpModuleLoad)-loads, m.CopyMode())
	}

	m, err := New(Config{Runtime: e.r, Devices: []int{0, 1}, MaxStaging: 16 << 20, Copy: cuda.CopyKernel})
	if err != nil {
		t.Fatal(err)
	}
	if n := e.fake.Count(cudatest.OpModuleLoad) - loads; n != 2 || m.CopyMode() != cuda.CopyKernel {
		t.Fatalf("kernel: %d module loads, copy mode %v; want one per device and the kernel", n, m.CopyMode())
	}
	unloads := e.fake.Count(cudatest.OpModuleUnload)
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if n := e.fake.Count(cudatest.OpModuleUnload) - unloads; n != 2 {
		t.Fatalf("Close unloaded the kernel %d times, want once per device", n)
	}

	// The second device's load fails: the first device's module must go.
	e.fake.Fail(cudatest.OpModuleLoad, 2, 218) // CUDA_ERROR_INVALID_PTX
	loads, unloads = e.fake.Count(cudatest.OpModuleLoad), e.fake.Count(cudatest.OpModuleUnload)
	m, err = New(Config{Runtime: e.r, Devices: []int{0, 1}, MaxStaging: 16 << 20, Copy: cuda.CopyKernel})
	var de *cuda.DriverError
	if !errors.As(err, &de) || de.Func != "cuModuleLoadDataEx" || !strings.Contains(err.Error(), "CUDA_ERROR_INVALID_PTX") {
		if m != nil {
			m.Close()
		}
		t.Fatalf("a refused PTX: %v, want a DriverError from cuModuleLoadDataEx naming CUDA_ERROR_INVALID_PTX", err)
	}
	if loaded, unloaded := e.fake.Count(cudatest.OpModuleLoad)-loads, e.fake.Count(cudatest.OpModuleUnload)-unloads; loaded != 2 || unloaded != 1 {
		t.Fatalf("after the second device's load failed: %d load calls, %d unloads; want 2 and 1 (all or none)", loaded, unloaded)
	}
}

// mapWatch is a file that counts its preads and can act right after it
// is mapped (the truncation of another process, say).
type mapWatch struct {
	fsys.File
	reads    int
	maps     int
	afterMap func()
}

func (f *mapWatch) ReadAt(p []byte, off int64) (int, error) {
	f.reads++
	return f.File.ReadAt(p, off)
}

func (f *mapWatch) MapRead(n int64) (*fsys.Mapping, error) {
	f.maps++
	mp, err := f.File.(fsys.Mapper).MapRead(n)
	if f.afterMap != nil {
		f.afterMap()
	}
	return mp, err
}

// mapMinSetup returns a test environment with a cache of 16 pages of
// 256 KiB in each of 4 layers, randomized from seed (its bytes orig), a
// key's 16 blocks of it (a 16 MiB file, as large as fsys.MapMin) and a
// mover of 1 MiB chunks.
func mapMinSetup(t *testing.T, seed uint64) (*env, geometry, *cache, [][]byte, []int, *Mover) {
	t.Helper()
	e := newEnv(t)
	g := geometry{layers: 4, numBlocks: 32, pageBytes: 256 << 10, blocksPerKey: 16, headerBytes: 4096}
	kv := newCache(t, e.w, g)
	orig := kv.randomize(t, e.w, seed)
	blocks := []int{3, 1, 4, 15, 9, 2, 6, 5, 30, 8, 11, 20, 7, 0, 12, 31}
	m := e.mover(t, Config{Devices: []int{0}, MaxStaging: 8 << 20, Chunk: 1 << 20, Copy: cuda.CopyBatch})
	return e, g, kv, orig, blocks, m
}

// TestLoadsFromMemoryFileSystemsCopyFromAMapping: a load of a file on a
// memory file system copies from a mapping of it instead of reading it
// (fsys.Mapping says why), with the same bytes and checksums; a file that
// cannot be mapped is read; stores and loads from other file systems read
// and write as before; and a file truncated under its mapping fails that
// load with region.ErrFault while the mover goes on serving.
func TestLoadsFromMemoryFileSystemsCopyFromAMapping(t *testing.T) {
	e, g, kv, orig, blocks, m := mapMinSetup(t, 11)
	host := map[region.Region][]byte{}
	for l, b := range orig {
		host[kv.layers[l]] = b
	}
	cases := []struct {
		name      string
		memory    bool
		mappable  bool
		blocks    int
		wantMaps  int
		wantReads bool
	}{
		{"memory file system", true, true, 16, 1, false},
		{"memory file system, file smaller than fsys.MapMin", true, true, 15, 0, true},
		{"memory file system, file not mappable", true, false, 16, 0, true},
		{"other file system", false, true, 16, 0, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			for l, b := range orig { // undo the last case's poison
				kv.set(t, e.w, l, b)
			}
			p := kv.plan(blocks[:c.blocks], false)
			p.Memory = c.memory
			wantFile, wantSums := expect(p, host)
			w := &mapWatch{File: createFile(t, "key")}
			var f fsys.File = w
			if !c.mappable {
				f = struct{ fsys.File }{w} // hides MapRead
			}
			sums := make([]uint32, p.Sums)
			if _, err := m.WriteFile(context.Background(), f, p, sums); err != nil {
				t.Fatal(err)
			}
			if w.maps != 0 {
				t.Fatalf("a store mapped the file")
			}
			got := make([]byte, len(wantFile))
			if _, err := w.File.ReadAt(got, int64(g.headerBytes)); err != nil || !bytes.Equal(got, wantFile) || !equal(sums, wantSums) {
				t.Fatalf("stored file or checksums differ (read error %v)", err)
			}
			kv.poison(t, e.w)
			lsums := make([]uint32, p.Sums)
			if n, err := m.ReadFile(context.Background(), f, p, lsums); err != nil || n != p.Bytes() {
				t.Fatalf("ReadFile = %d, %v; want %d", n, err, p.Bytes())
			}
			if w.maps != c.wantMaps || (w.reads > 0) != c.wantReads {
				t.Fatalf("load mapped the file %d times and read it %d times; want %d maps, reads %v", w.maps, w.reads, c.wantMaps, c.wantReads)
			}
			if !equal(lsums, wantSums) {
				t.Fatalf("load checksums %x, want %x", lsums, wantSums)
			}
			for l := range g.layers {
				dev := kv.get(t, e.w, l)
				for _, b := range blocks[:c.blocks] {
					if !bytes.Equal(dev[b*g.pageBytes:(b+1)*g.pageBytes], orig[l][b*g.pageBytes:(b+1)*g.pageBytes]) {
						t.Fatalf("layer %d block %d: loaded bytes differ", l, b)
					}
				}
			}
		})
	}
	t.Run("truncated under the mapping", func(t *testing.T) {
		p := kv.plan(blocks, false)
		p.Memory = true
		dir := t.TempDir()
		w := &mapWatch{File: createFileIn(t, dir, "key", 0)}
		if _, err := m.WriteFile(context.Background(), w, p, make([]uint32, p.Sums)); err != nil {
			t.Fatal(err)
		}
		w.afterMap = func() {
			if err := os.Truncate(filepath.Join(dir, "key"), 8192); err != nil {
				t.Error(err)
			}
		}
		_, err := m.ReadFile(context.Background(), w, p, make([]uint32, p.Sums))
		if !errors.Is(err, region.ErrFault) || !errors.Is(err, fsys.ErrMapping) {
			t.Fatalf("load of a file truncated under its mapping: %v; want region.ErrFault", err)
		}
		good := &mapWatch{File: createFile(t, "good")}
		if _, err := m.WriteFile(context.Background(), good, p, make([]uint32, p.Sums)); err != nil {
			t.Fatal(err)
		}
		if _, err := m.ReadFile(context.Background(), good, p, make([]uint32, p.Sums)); err != nil {
			t.Fatalf("load after the fault: %v", err)
		}
	})
}

// TestLoadsOfAFileNotRegisteredShareOneMapping: the jobs that load parts
// of a memory-mount file of fsys.MapMin bytes or more (a layer-wise
// load's layer ranges, each under MapMin) read through one mapping of
// the whole file, made by the first and kept for the others; a file the
// engine forgets (removes or replaces) is mapped anew by its next load.
func TestLoadsOfAFileNotRegisteredShareOneMapping(t *testing.T) {
	e, g, kv, orig, blocks, m := mapMinSetup(t, 5) // loaded in quarters
	p := kv.plan(blocks, false)
	p.Memory = true
	w := &mapWatch{File: createFile(t, "key")}
	if _, err := m.WriteFile(context.Background(), w, p, make([]uint32, p.Sums)); err != nil {
		t.Fatal(err)
	}
	id, ok := identify(w)
	if !ok {
		t.Fatal("the test's file has no identity (a file system without file handles or birth times): the mover maps only identified files")
	}
	quarter := func(i int) *transfer.Plan {
		q := *p
		n := len(p.Extents) / 4
		q.Extents = p.Extents[i*n : (i+1)*n]
		if q.Bytes() >= fsys.MapMin {
			t.Fatalf("a quarter of the file reads %d bytes, not under fsys.MapMin", q.Bytes())
		}
		return &q
	}
	kv.poison(t, e.w)
	for i := range 4 {
		if n, err := m.ReadFile(context.Background(), w, quarter(i), make([]uint32, p.Sums)); err != nil || n != quarter(i).Bytes() {
			t.Fatalf("quarter %d: ReadFile = %d, %v", i, n, err)
		}
	}
	if w.maps != 1 || w.reads != 0 || m.FileStats().Mapped != 1 {
		t.Fatalf("four loads mapped the file %d times and read it %d times, %d kept mapped; want one mapping, kept, no read", w.maps, w.reads, m.FileStats().Mapped)
	}
	for l := range g.layers {
		if !blocksEqual(kv.get(t, e.w, l), orig[l], blocks, g.pageBytes) {
			t.Fatalf("layer %d: loaded bytes differ", l)
		}
	}
	m.Forget(id.FileID)
	if got := m.FileStats().Mapped; got != 0 {
		t.Fatalf("%d files kept mapped after Forget; want 0", got)
	}
	if _, err := m.ReadFile(context.Background(), w, quarter(0), make([]uint32, p.Sums)); err != nil {
		t.Fatal(err)
	}
	if w.maps != 2 {
		t.Fatalf("a load after Forget mapped the file %d times in all; want 2", w.maps)
	}
}

// blocksEqual reports whether the pages blocks of got and want are equal.
func blocksEqual(got, want []byte, blocks []int, page int) bool {
	for _, b := range blocks {
		if !bytes.Equal(got[b*page:(b+1)*page], want[b*page:(b+1)*page]) {
			return false
		}
	}
	return true
}

// TestWaitsPollBeforeTheyBlock checks how a job waits for its copies: by
// polling the event while the copies run (no cudaEventSynchronize), by
// blocking on it once its Poll has passed with the copies still running,
// and by blocking at once with a negative Poll; the bytes arrive whole
// every way.
func TestWaitsPollBeforeTheyBlock(t *testing.T) {
	e := newEnv(t)
	g := geometry{layers: 4, numBlocks: 32, pageBytes: 16 << 10, blocksPerKey: 16, headerBytes: 4096}
	kv := newCache(t, e.w, g)
	orig := kv.randomize(t, e.w, 11)
	blocks := []int{3, 1, 4, 15, 9, 2, 6, 5, 30, 8, 11, 20, 7, 0, 12, 31}
	p := kv.plan(blocks, false)
	cases := []struct {
		name          string
		poll          time.Duration
		busy          int  // "not ready" answers before a query runs the copies (-1: always)
		polls, sleeps bool // whether the waits query, and whether they block
	}{
		{"copies done while polling", testwait.Hang, 3, true, false}, // three answers, however slow the machine
		{"copies still running when the poll ends", 200 * time.Microsecond, -1, true, true},
		{"no polling", -1, 0, false, true},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := e.mover(t, Config{Devices: []int{0}, MaxStaging: 8 << 20, Chunk: 64 << 10, Copy: cuda.CopyBatch, Poll: c.poll})
			e.fake.Busy(c.busy)
			defer e.fake.Busy(0)
			queries, syncs := e.fake.Count(cudatest.OpQuery), e.fake.Count(cudatest.OpSync)
			f := createFile(t, fmt.Sprintf("key-%d", i))
			if _, err := m.WriteFile(context.Background(), f, p, make([]uint32, p.Sums)); err != nil {
				t.Fatalf("WriteFile: %v", err)
			}
			kv.poison(t, e.w)
			// A poll that never ended would hang the load: fail instead.
			done := make(chan error, 1)
			go func() {
				_, err := m.ReadFile(context.Background(), f, p, make([]uint32, p.Sums))
				done <- err
			}()
			select {
			case err := <-done:
				if err != nil {
					t.Fatalf("ReadFile: %v", err)
				}
			case <-time.After(testwait.Hang):
				t.Fatal("the load did not end: its waits never stopped polling")
			}
			queried, synced := e.fake.Count(cudatest.OpQuery)-queries, e.fake.Count(cudatest.OpSync)-syncs
			if (queried > 0) != c.polls || (synced > 0) != c.sleeps {
				t.Errorf("%d event queries, %d synchronizations: want queries %v, synchronizations %v", queried, synced, c.polls, c.sleeps)
			}
			for l := range g.layers {
				dev := kv.get(t, e.w, l)
				for _, b := range blocks {
					if !bytes.Equal(dev[b*g.pageBytes:(b+1)*g.pageBytes], orig[l][b*g.pageBytes:(b+1)*g.pageBytes]) {
						t.Fatalf("layer %d block %d: loaded bytes differ", l, b)
					}
				}
			}
		})
	}
}
