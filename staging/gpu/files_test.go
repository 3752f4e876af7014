package gpu

import (
	"bytes"
	"context"
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

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/cuda/cudatest"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/testtrace"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// filesGeometry is a small cache: these tests check paths and lifetimes,
// and every page still crosses a real mapping.
func filesGeometry() geometry {
	return geometry{layers: 4, numBlocks: 64, pageBytes: 16 << 10, blocksPerKey: 16, headerBytes: 4096}
}

// keyFile is one file of a registered-files test: its plan over the
// cache, opened as the engine opens a store's file (write-only,
// allocated to its size) on a directory the plan calls a memory file
// system (any directory maps alike).
type keyFile struct {
	path string
	f    fsys.File
	p    *transfer.Plan
	id   fileID
}

func newKeyFile(t *testing.T, kv *cache, dir, name string, seed uint64) *keyFile {
	t.Helper()
	g := kv.g
	p := kv.plan(keyBlocks(rand.New(rand.NewPCG(seed, 9)), g.numBlocks, g.blocksPerKey), false)
	p.Memory = true
	path := filepath.Join(dir, name)
	f, err := fsys.OS{}.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	if err := f.Allocate(p.End()); err != nil {
		t.Fatal(err)
	}
	id, ok := identify(f)
	if !ok {
		t.Fatalf("%s: no identity", path)
	}
	return &keyFile{path: path, f: f, p: p, id: id}
}

// store writes kf from the cache's pages, first set to orig (host: the
// layers' host copies), through its write-only descriptor, and checks the
// file's bytes and the checksums.
func store(t *testing.T, e *env, m *Mover, kv *cache, kf *keyFile, host map[region.Region][]byte, orig [][]byte) {
	t.Helper()
	for l, b := range orig {
		kv.set(t, e.w, l, b)
	}
	wantFile, wantSums := expect(kf.p, host)
	sums := make([]uint32, kf.p.Sums)
	if n, err := m.WriteFile(jobContext(t), kf.f, kf.p, sums); err != nil || n != kf.p.Bytes() {
		t.Fatalf("WriteFile = %d, %v; want %d", n, err, kf.p.Bytes())
	}
	got, err := os.ReadFile(kf.path)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) < kv.g.headerBytes+len(wantFile) || !bytes.Equal(got[kv.g.headerBytes:kv.g.headerBytes+len(wantFile)], wantFile) {
		t.Fatalf("%s: file bytes differ from the pages in plan order", kf.path)
	}
	if !equal(sums, wantSums) {
		t.Fatalf("store checksums %x, want %x", sums, wantSums)
	}
}

// load reads kf, opened read-only as a load opens it, into poisoned
// pages and checks them against orig, and the checksums.
func load(t *testing.T, e *env, m *Mover, kv *cache, kf *keyFile, host map[region.Region][]byte, orig [][]byte) {
	t.Helper()
	_, wantSums := expect(kf.p, host)
	kv.poison(t, e.w)
	f, err := fsys.OS{}.OpenFile(kf.path, os.O_RDONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	lsums := make([]uint32, kf.p.Sums)
	if n, err := m.ReadFile(jobContext(t), f, kf.p, lsums); err != nil || n != kf.p.Bytes() {
		t.Fatalf("ReadFile = %d, %v; want %d", n, err, kf.p.Bytes())
	}
	if !equal(lsums, wantSums) {
		t.Fatalf("load checksums %x, want %x", lsums, wantSums)
	}
	for l := range kv.g.layers {
		dev := kv.get(t, e.w, l)
		for _, x := range kf.p.Extents {
			if x.Region == kv.layers[l] && !bytes.Equal(dev[x.RegionOff:x.RegionOff+x.Len], orig[l][x.RegionOff:x.RegionOff+x.Len]) {
				t.Fatalf("layer %d page at %d differs after the round trip", l, x.RegionOff)
			}
		}
	}
}

// jobContext bounds a test job: a job that waits for a pinned buffer no
// one returns fails instead of hanging the test.
func jobContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Hang)
	t.Cleanup(cancel)
	return ctx
}

// roundTrip is store, then load.
func roundTrip(t *testing.T, e *env, m *Mover, kv *cache, kf *keyFile, host map[region.Region][]byte, orig [][]byte) {
	t.Helper()
	store(t, e, m, kv, kf, host, orig)
	load(t, e, m, kv, kf, host, orig)
}

// filesSetup makes a mover with cfg over the fake library and a small
// cache of random pages: orig per layer, host by region.
func filesSetup(t *testing.T, cfg Config) (*env, *Mover, *cache, [][]byte, map[region.Region][]byte) {
	t.Helper()
	e := newEnv(t)
	m := e.mover(t, cfg)
	kv := newCache(t, e.w, filesGeometry())
	orig := kv.randomize(t, e.w, 1)
	return e, m, kv, orig, hostCopies(kv, orig)
}

// registeredFile is filesSetup with one key file, stored once (through
// the pinned buffers) and then registered by the registrar.
func registeredFile(t *testing.T, cfg Config) (*env, *Mover, *cache, [][]byte, map[region.Region][]byte, *keyFile) {
	t.Helper()
	e, m, kv, orig, host := filesSetup(t, cfg)
	kf := newKeyFile(t, kv, t.TempDir(), "key", 1)
	store(t, e, m, kv, kf, host, orig)
	testwait.Until(t, "the file registered", testwait.Hang, func() bool { return m.FileStats().Files == 1 })
	return e, m, kv, orig, host, kf
}

// holdAllBuffers takes every pinned buffer of m until release is called:
// a job that needs one would then fail (jobContext) instead of moving.
func holdAllBuffers(m *Mover) (release func()) {
	var held []int
	for {
		i, ok, _ := m.bufs.take(context.Background(), false)
		if !ok {
			break
		}
		held = append(held, i)
	}
	return func() {
		for _, i := range held {
			m.bufs.put(i)
		}
	}
}

// hostCopies maps each layer's region to its host copy.
func hostCopies(kv *cache, orig [][]byte) map[region.Region][]byte {
	host := map[region.Region][]byte{}
	for l, b := range orig {
		host[kv.layers[l]] = b
	}
	return host
}

// TestRegisteredFilesMoveDirectlyFromTheSecondJob: a file's first job
// goes through the pinned buffers and offers the file; once registered,
// its stores and loads copy between the device and the file's own pages
// (one batch each for this one-chunk file, no pinned buffer taken), with the same bytes and
// checksums; Forget releases it, and the next job goes through the
// pinned buffers again.
func TestRegisteredFilesMoveDirectlyFromTheSecondJob(t *testing.T) {
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, Copy: cuda.CopyBatch, RegisterFiles: 4})
	kf := newKeyFile(t, kv, t.TempDir(), "key", 1)

	regs := e.fake.Count(cudatest.OpHostRegister)
	store(t, e, m, kv, kf, host, orig)
	testwait.Until(t, "the file registered", testwait.Hang, func() bool { return m.FileStats().Files == 1 })
	if st := m.FileStats(); st.Stores != 0 || st.Loads != 0 || st.Registered != 1 || st.Bytes != kf.p.End() {
		t.Fatalf("after the first jobs: %+v; want no direct jobs, 1 registered file of %d bytes", st, kf.p.End())
	}
	if n := e.fake.Count(cudatest.OpHostRegister) - regs; n != 1 {
		t.Fatalf("cudaHostRegister called %d times, want 1", n)
	}

	// New bytes in the pages: the direct store must write them, the direct
	// load must bring them back.
	orig = kv.randomize(t, e.w, 2)
	host = hostCopies(kv, orig)
	batches := e.fake.Count(cudatest.OpBatch)
	release := holdAllBuffers(m) // direct jobs need none
	roundTrip(t, e, m, kv, kf, host, orig)
	if st := m.FileStats(); st.Stores != 1 || st.Loads != 1 {
		t.Fatalf("after the second jobs: %+v; want 1 direct store and 1 direct load", st)
	}
	if n := e.fake.Count(cudatest.OpBatch) - batches; n != 2 {
		t.Fatalf("%d batched copies for a direct store and load, want one each", n)
	}
	release()

	m.Forget(kf.id.FileID)
	testwait.Until(t, "the forgotten file released", testwait.Hang, func() bool { return m.FileStats().Released == 1 })
	if st := m.FileStats(); st.Files != 0 || st.Bytes != 0 {
		t.Fatalf("after Forget: %+v; want no file", st)
	}
	store(t, e, m, kv, kf, host, orig)
	if st := m.FileStats(); st.Stores != 1 {
		t.Fatalf("after Forget the store went direct: %+v", st)
	}
	testwait.Until(t, "the file registered again after its next job", testwait.Hang, func() bool { return m.FileStats().Registered == 2 })
}

// TestPreparedFilesAreRegisteredBeforeTheirFirstStore: a file the engine
// made ahead of stores (Prepare) is registered before any job touched it,
// so its first store already moves straight into its pages, with the
// bytes and checksums of the pages, and loads back.
func TestPreparedFilesAreRegisteredBeforeTheirFirstStore(t *testing.T) {
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, Copy: cuda.CopyBatch, RegisterFiles: 4})
	kf := newKeyFile(t, kv, t.TempDir(), "made-ahead", 1)
	m.Prepare(kf.f)
	testwait.Until(t, "the prepared file registered", testwait.Hang, func() bool { return m.FileStats().Files == 1 })
	release := holdAllBuffers(m) // direct jobs need none
	roundTrip(t, e, m, kv, kf, host, orig)
	release()
	if st := m.FileStats(); st.Stores != 1 || st.Loads != 1 || st.Registered != 1 {
		t.Fatalf("after the first store and load: %+v; want both direct, 1 registration", st)
	}
}

// TestPreparingWithoutRegisteredFilesDoesNothing: with register_files = 0
// a prepared file is not registered, and its jobs take the pinned path.
func TestPreparingWithoutRegisteredFilesDoesNothing(t *testing.T) {
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, Copy: cuda.CopyBatch})
	kf := newKeyFile(t, kv, t.TempDir(), "made-ahead", 1)
	regs := e.fake.Count(cudatest.OpHostRegister)
	m.Prepare(kf.f)
	roundTrip(t, e, m, kv, kf, host, orig)
	if n := e.fake.Count(cudatest.OpHostRegister) - regs; n != 0 {
		t.Fatalf("cudaHostRegister called %d times without registered files", n)
	}
}

// TestRegisteredFilesStoreChunkByChunk: a direct store of a file of many
// chunks moves one batch per chunk, checksumming each chunk after its
// copies, and its bytes and checksums are those of the pages; a direct
// load of it (one batch) brings them back. (How many chunks are in flight
// at once is not observed here.)
func TestRegisteredFilesStoreChunkByChunk(t *testing.T) {
	e, m, kv, _, _, kf := registeredFile(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, Chunk: 3 * align, Copy: cuda.CopyBatch, RegisterFiles: 4})
	orig := kv.randomize(t, e.w, 2) // new bytes: the direct store must write them
	host := hostCopies(kv, orig)
	chunks, _, err := m.plan(kf.p, true)
	if err != nil || len(chunks) < 3 {
		t.Fatalf("plan: %d chunks, %v; want several", len(chunks), err)
	}
	batches := e.fake.Count(cudatest.OpBatch)
	store(t, e, m, kv, kf, host, orig)
	if n := e.fake.Count(cudatest.OpBatch) - batches; n != len(chunks) {
		t.Fatalf("a direct store of %d chunks made %d batched copies", len(chunks), n)
	}
	batches = e.fake.Count(cudatest.OpBatch)
	load(t, e, m, kv, kf, host, orig)
	if n := e.fake.Count(cudatest.OpBatch) - batches; n != 1 {
		t.Fatalf("a direct load of %d chunks made %d batched copies, want 1", len(chunks), n)
	}
	if st := m.FileStats(); st.Stores != 1 || st.Loads != 1 {
		t.Fatalf("%+v; want one direct store and one direct load", st)
	}
}

// TestRegisteredFilesUnlinkedAreReleased: a registered file unlinked
// behind the mover's back (another engine on the directory) is released
// at the registrar's next sweep, so that its memory goes back.
func TestRegisteredFilesUnlinkedAreReleased(t *testing.T) {
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 4})
	dir := t.TempDir()
	kept, gone := newKeyFile(t, kv, dir, "kept", 1), newKeyFile(t, kv, dir, "gone", 2)
	roundTrip(t, e, m, kv, kept, host, orig)
	roundTrip(t, e, m, kv, gone, host, orig)
	testwait.Until(t, "both files registered", testwait.Hang, func() bool { return m.FileStats().Files == 2 })
	if err := os.Remove(gone.path); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, "the unlinked file released by the registrar's sweep", testwait.Hang, func() bool { return m.FileStats().Released == 1 })
	if m.files.acquire(gone.id, 1) != nil {
		t.Fatal("the unlinked file is still handed to jobs")
	}
	rf := m.files.acquire(kept.id, 1)
	if rf == nil {
		t.Fatal("the linked file was released")
	}
	m.files.put(rf, false, false)
}

// TestRegisteredFilesKeepTheMostRecentlyUsed: at the limit, a new file
// takes the place of the least recently used one that has been idle long
// enough; while every registered file is in recent use, none is dropped
// and the new file is not registered.
func TestRegisteredFilesKeepTheMostRecentlyUsed(t *testing.T) {
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 2})
	dir := t.TempDir()
	a, b, c := newKeyFile(t, kv, dir, "a", 1), newKeyFile(t, kv, dir, "b", 2), newKeyFile(t, kv, dir, "c", 3)
	roundTrip(t, e, m, kv, a, host, orig)
	roundTrip(t, e, m, kv, b, host, orig)
	testwait.Until(t, "a and b registered", testwait.Hang, func() bool { return m.FileStats().Registered == 2 })
	roundTrip(t, e, m, kv, a, host, orig) // a is now the most recently used

	// Both in recent use: c's store's offer is deferred (its first at the
	// bound), its load's is admitted and then declined for want of an
	// idle file to replace.
	roundTrip(t, e, m, kv, c, host, orig)
	testwait.Until(t, "c's offer handled", testwait.Hang, func() bool {
		m.files.mu.Lock()
		defer m.files.mu.Unlock()
		_, queued := m.files.queued[c.id.key()]
		return !queued
	})
	if st := m.FileStats(); st.Files != 2 || st.Registered != 2 || st.Deferred != 1 {
		t.Fatalf("with every file in recent use: %+v; want the two kept and one offer deferred", st)
	}

	m.files.mu.Lock()
	m.files.minIdle = 0
	m.files.mu.Unlock()
	roundTrip(t, e, m, kv, c, host, orig)
	testwait.Until(t, "c registered", testwait.Hang, func() bool { return m.FileStats().Registered == 3 })
	for _, x := range []struct {
		kf   *keyFile
		want bool
	}{{a, true}, {b, false}, {c, true}} {
		rf := m.files.acquire(x.kf.id, 1)
		if (rf != nil) != x.want {
			t.Fatalf("%s registered %v, want %v", x.kf.path, rf != nil, x.want)
		}
		if rf != nil {
			m.files.put(rf, false, false)
		}
	}
}

// TestRegisteredFilesStayWithinTheByteLimit: with a byte limit below the
// count limit, a file that would pass it replaces the least recently used
// idle file instead of adding to the pinned bytes.
func TestRegisteredFilesStayWithinTheByteLimit(t *testing.T) {
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 8, RegisterBytes: 1 << 30})
	if st := m.FileStats(); st.LimitBytes != 1<<30 {
		t.Fatalf("LimitBytes %d, want Config.RegisterBytes %d", st.LimitBytes, 1<<30)
	}
	dir := t.TempDir()
	a, b, c := newKeyFile(t, kv, dir, "a", 1), newKeyFile(t, kv, dir, "b", 2), newKeyFile(t, kv, dir, "c", 3)
	roundTrip(t, e, m, kv, a, host, orig)
	testwait.Until(t, "a registered", testwait.Hang, func() bool { return m.FileStats().Registered == 1 })
	size := m.FileStats().Bytes
	m.files.mu.Lock()
	m.files.limitBytes, m.files.minIdle = 2*size, 0 // two files' worth, far below the count
	m.files.mu.Unlock()
	roundTrip(t, e, m, kv, b, host, orig)
	testwait.Until(t, "b registered", testwait.Hang, func() bool { return m.FileStats().Registered == 2 })
	roundTrip(t, e, m, kv, c, host, orig)
	testwait.Until(t, "c registered", testwait.Hang, func() bool { return m.FileStats().Registered == 3 })
	if st := m.FileStats(); st.Files != 2 || st.Bytes != 2*size || st.Released != 1 {
		t.Fatalf("after a third file at a two-file byte limit: %+v; want 2 files, %d bytes, 1 released", st, 2*size)
	}
	for _, x := range []struct {
		kf   *keyFile
		want bool
	}{{a, false}, {b, true}, {c, true}} {
		rf := m.files.acquire(x.kf.id, 1)
		if (rf != nil) != x.want {
			t.Fatalf("%s registered %v, want %v (the least recently used gave its place)", x.kf.path, rf != nil, x.want)
		}
		if rf != nil {
			m.files.put(rf, false, false)
		}
	}
}

// TestRegisteredFilesMakeRoomWithSeveralIdleFiles: a file larger than any
// one idle registered file, at the byte limit, replaces as many of the
// least recently used idle files as make room for it.
func TestRegisteredFilesMakeRoomWithSeveralIdleFiles(t *testing.T) {
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 8, RegisterBytes: 1 << 30})
	dir := t.TempDir()
	a, b, c := newKeyFile(t, kv, dir, "a", 1), newKeyFile(t, kv, dir, "b", 2), newKeyFile(t, kv, dir, "c", 3)
	roundTrip(t, e, m, kv, a, host, orig)
	testwait.Until(t, "a registered", testwait.Hang, func() bool { return m.FileStats().Registered == 1 })
	size := m.FileStats().Bytes
	if err := c.f.Allocate(2 * size); err != nil { // c is twice as large as a and b
		t.Fatal(err)
	}
	var ok bool
	if c.id, ok = identify(c.f); !ok || c.id.size != 2*size {
		t.Fatalf("c: identity %+v, %v; want a size of %d", c.id, ok, 2*size)
	}
	m.files.mu.Lock()
	m.files.limitBytes, m.files.minIdle = 2*size, 0 // two of a's size, far below the count
	m.files.mu.Unlock()
	roundTrip(t, e, m, kv, b, host, orig)
	testwait.Until(t, "b registered", testwait.Hang, func() bool { return m.FileStats().Registered == 2 })
	roundTrip(t, e, m, kv, c, host, orig)
	testwait.Until(t, "c registered in a and b's place", testwait.Hang, func() bool { return m.FileStats().Registered == 3 })
	if st := m.FileStats(); st.Files != 1 || st.Bytes != 2*size || st.Released != 2 {
		t.Fatalf("after a file of two at a limit of two: %+v; want 1 file, %d bytes, 2 released", st, 2*size)
	}
	for _, x := range []struct {
		kf   *keyFile
		want bool
	}{{a, false}, {b, false}, {c, true}} {
		rf := m.files.acquire(x.kf.id, 1)
		if (rf != nil) != x.want {
			t.Fatalf("%s registered %v, want %v", x.kf.path, rf != nil, x.want)
		}
		if rf != nil {
			m.files.put(rf, false, false)
		}
	}
}

// TestRegisteredFilesFailedRegistrationLeavesTheStagedPath: a file the
// runtime refuses to register is counted, its jobs keep moving through
// the pinned buffers with the right bytes, and nothing is leaked.
func TestRegisteredFilesFailedRegistrationLeavesTheStagedPath(t *testing.T) {
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 4})
	kf := newKeyFile(t, kv, t.TempDir(), "key", 1)
	e.fake.Fail(cudatest.OpHostRegister, 1, 2) // cudaErrorMemoryAllocation
	store(t, e, m, kv, kf, host, orig)
	testwait.Until(t, "the registration failed", testwait.Hang, func() bool { return m.FileStats().Failed == 1 })
	load(t, e, m, kv, kf, host, orig)
	if st := m.FileStats(); st.Stores+st.Loads != 0 {
		t.Fatalf("after a failed registration: %+v", st)
	}
	store(t, e, m, kv, kf, host, orig) // offered again by both jobs
	testwait.Until(t, "the file registered on its second offer", testwait.Hang, func() bool { return m.FileStats().Files == 1 })
}

// TestRegisteredFilesOnlyOnMemoryFileSystems: files the plan does not
// place on a memory file system are never offered.
func TestRegisteredFilesOnlyOnMemoryFileSystems(t *testing.T) {
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 4})
	kf := newKeyFile(t, kv, t.TempDir(), "key", 1)
	kf.p.Memory = false
	roundTrip(t, e, m, kv, kf, host, orig)
	m.files.mu.Lock()
	queued := len(m.files.queued)
	m.files.mu.Unlock()
	if st := m.FileStats(); queued != 0 || st.Files != 0 || st.Failed != 0 {
		t.Fatalf("a file off memory file systems was offered: %d queued, %+v", queued, st)
	}
}

// TestFileLimitLeavesMostDescriptorsAndMappingsToOthers: the registrar
// keeps at most a quarter of the descriptor limit and a quarter of
// vm.max_map_count, and exactly what was asked below both.
func TestFileLimitLeavesMostDescriptorsAndMappingsToOthers(t *testing.T) {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	bound := int(lim.Cur / 4)
	if b, err := os.ReadFile("/proc/sys/vm/max_map_count"); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			bound = min(bound, n/4)
		}
	}
	for _, want := range []int{0, 1, bound, bound + 1, 1 << 30} {
		if got := fileLimit(want); got != min(want, bound) {
			t.Errorf("fileLimit(%d) = %d with %d descriptors allowed; want %d", want, got, lim.Cur, min(want, bound))
		}
	}
}

// TestRegisteredFilesCopyFailuresFailTheJob: a failed copy or a failed
// wait in a direct store or load fails that job with the CUDA error, and
// the next job on the file succeeds (the failed lane was not reused).
func TestRegisteredFilesCopyFailuresFailTheJob(t *testing.T) {
	e, m, kv, orig, host, kf := registeredFile(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, Chunk: 3 * align, Copy: cuda.CopyBatch, RegisterFiles: 4})
	for _, c := range []struct {
		name  string
		op    cudatest.Op
		write bool
	}{
		{"store, a copy fails", cudatest.OpCopy, true},
		{"store, a record fails", cudatest.OpRecord, true},
		{"store, a wait fails", cudatest.OpQuery, true},
		{"load, a copy fails", cudatest.OpCopy, false},
		{"load, a wait fails", cudatest.OpQuery, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			e.fake.Fail(c.op, 1, 700) // cudaErrorIllegalAddress
			sums := make([]uint32, kf.p.Sums)
			var err error
			if c.write {
				_, err = m.WriteFile(context.Background(), kf.f, kf.p, sums)
			} else {
				_, err = m.ReadFile(context.Background(), kf.f, kf.p, sums)
			}
			e.fake.Fail(c.op, 0, 0)
			if err == nil || !strings.Contains(err.Error(), "cuda") {
				t.Fatalf("a direct job with a failed CUDA call returned %v", err)
			}
			roundTrip(t, e, m, kv, kf, host, orig)
		})
	}
	if st := m.FileStats(); st.Stores < 5 || st.Loads < 5 {
		t.Fatalf("%+v: the jobs did not take the direct path", st)
	}
}

// TestRegisteredFilesForgottenInUseWaitForTheirLastJob: a file forgotten
// while a job moves through its mapping is no longer handed out, and is
// released only when that job ends.
func TestRegisteredFilesForgottenInUseWaitForTheirLastJob(t *testing.T) {
	_, m, _, _, _, kf := registeredFile(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 4})
	rf := m.files.acquire(kf.id, 1) // a job in flight
	if rf == nil {
		t.Fatal("the registered file was not handed out")
	}
	m.Forget(kf.id.FileID)
	if st := m.FileStats(); st.Files != 0 || st.Released != 0 {
		t.Fatalf("after Forget with a job in flight: %+v; want it dropped, not released", st)
	}
	if m.files.acquire(kf.id, 1) != nil {
		t.Fatal("a forgotten file was handed to a new job")
	}
	m.files.put(rf, true, true)
	if st := m.FileStats(); st.Released != 1 {
		t.Fatalf("after the job ended: %+v; want the file released", st)
	}
}

// TestRegisteredFilesResizedOrReplacedAreDropped: a registered file whose
// size changed behind the mover's back (truncated and extended: its
// mapping may hold pages no longer in the file), or a file that has its
// inode number but not its file handle (a recycled number), is not
// moved through the old mapping: the mapping is released and the job
// goes through the pinned buffers, with the right bytes.
func TestRegisteredFilesResizedOrReplacedAreDropped(t *testing.T) {
	e, m, kv, orig, host, kf := registeredFile(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 4})

	other := kf.id
	other.Gen += "-another-file"
	if m.files.acquire(other, 1) != nil {
		t.Fatal("a file with another handle got the registered mapping")
	}
	testwait.Until(t, "the mapping released", testwait.Hang, func() bool { return m.FileStats().Released == 1 })
	store(t, e, m, kv, kf, host, orig)
	testwait.Until(t, "the file registered again", testwait.Hang, func() bool { return m.FileStats().Files == 1 })

	if err := os.Truncate(kf.path, kf.p.End()+2*align); err != nil {
		t.Fatal(err)
	}
	stores := m.FileStats().Stores
	store(t, e, m, kv, kf, host, orig)
	if st := m.FileStats(); st.Stores != stores || st.Released != 2 {
		t.Fatalf("after a resize: %+v; want the store staged and the old mapping released", st)
	}
	load(t, e, m, kv, kf, host, orig)
}

// TestRegisteredFilesCloseReleasesEveryFile: Close unregisters and unmaps
// every registered file and closes the registrar's descriptors; an offer
// after Close is declined.
func TestRegisteredFilesCloseReleasesEveryFile(t *testing.T) {
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 4})
	a := storeKeyFiles(t, e, m, kv, 2, host, orig)[0]
	testwait.Until(t, "both files registered", testwait.Hang, func() bool { return m.FileStats().Files == 2 })
	before := openDescriptors(t)
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if st := m.FileStats(); st.Files != 0 || st.Released != 2 {
		t.Fatalf("after Close: %+v; want both released", st)
	}
	if n := before - openDescriptors(t); n != 2 {
		t.Fatalf("Close closed %d descriptors, want the registrar's 2", n)
	}
	m.files.offer(a.f, a.id, false)
	m.files.mu.Lock()
	queued := len(m.files.queued)
	m.files.mu.Unlock()
	if n := before - openDescriptors(t); queued != 0 || n != 2 {
		t.Fatalf("an offer after Close was taken: %d queued, %d descriptors", queued, 2-n)
	}
}

// TestRegisteredFilesDirectStoreZeroesTheBlockTail: a direct (O_DIRECT)
// plan whose payload ends inside a 4 KiB block is written to the block's
// end with zeros, through a registered mapping as through the pinned
// buffers, whatever the file held there before.
func TestRegisteredFilesDirectStoreZeroesTheBlockTail(t *testing.T) {
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, Copy: cuda.CopyBatch, RegisterFiles: 4})
	kf := newKeyFile(t, kv, t.TempDir(), "key", 1)
	last := &kf.p.Extents[len(kf.p.Extents)-1]
	last.Len -= 100 // the payload now ends 100 bytes before a block's end
	kf.p.Direct = true
	end := kf.p.End()
	store(t, e, m, kv, kf, host, orig)
	testwait.Until(t, "the file registered", testwait.Hang, func() bool { return m.FileStats().Files == 1 })
	if _, err := kf.f.WriteAt(bytes.Repeat([]byte{0xEE}, 100), end); err != nil {
		t.Fatal(err)
	}
	store(t, e, m, kv, kf, host, orig)
	if st := m.FileStats(); st.Stores != 1 {
		t.Fatalf("%+v: the second store did not take the direct path", st)
	}
	got, err := os.ReadFile(kf.path)
	if err != nil {
		t.Fatal(err)
	}
	if tail := got[end : end+100]; !bytes.Equal(tail, make([]byte, 100)) {
		t.Fatalf("the block's tail after a direct store holds %x, want zeros", tail[:8])
	}
}

// TestRegisteredFilesAtTheBoundAdmitOnlyASecondOffer: below the bound
// every offered file is registered; at the bound a file replaces an idle
// one only at its second offer, so files used once in a cache larger than
// the bound cost no registration.
func TestRegisteredFilesAtTheBoundAdmitOnlyASecondOffer(t *testing.T) {
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 1})
	m.files.mu.Lock()
	m.files.minIdle = 0
	m.files.mu.Unlock()
	dir := t.TempDir()
	a, b := newKeyFile(t, kv, dir, "a", 1), newKeyFile(t, kv, dir, "b", 2)
	store(t, e, m, kv, a, host, orig)
	testwait.Until(t, "a registered", testwait.Hang, func() bool { return m.FileStats().Registered == 1 })
	regs := e.fake.Count(cudatest.OpHostRegister)
	store(t, e, m, kv, b, host, orig)
	if st := m.FileStats(); st.Deferred != 1 {
		t.Fatalf("b's first offer at the bound: %+v; want it deferred", st)
	}
	m.files.mu.Lock()
	queued := len(m.files.queued)
	m.files.mu.Unlock()
	if queued != 0 || e.fake.Count(cudatest.OpHostRegister) != regs {
		t.Fatalf("b's first offer at the bound was queued (%d) or registered", queued)
	}
	store(t, e, m, kv, b, host, orig)
	testwait.Until(t, "b registered at its second offer", testwait.Hang, func() bool { return m.FileStats().Registered == 2 })
	if m.files.acquire(a.id, 1) != nil {
		t.Fatal("a is still registered beside b with a bound of one file")
	}
}

// holdRegistrations makes the fake runtime hold every registration until
// the returned function (or the test's end) lets them go.
func holdRegistrations(t *testing.T, e *env) (release func()) {
	t.Helper()
	e.fake.HoldRegistrations(true)
	var once sync.Once
	release = func() { once.Do(func() { e.fake.HoldRegistrations(false) }) }
	t.Cleanup(release)
	return release
}

// openDescriptors is how many descriptors the process has open.
func openDescriptors(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// storeKeyFiles makes n key files in a fresh directory and stores each
// once, through the pinned buffers (so each is offered for registration).
func storeKeyFiles(t *testing.T, e *env, m *Mover, kv *cache, n int, host map[region.Region][]byte, orig [][]byte) []*keyFile {
	t.Helper()
	dir := t.TempDir()
	kfs := make([]*keyFile, n)
	for i := range kfs {
		kfs[i] = newKeyFile(t, kv, dir, strconv.Itoa(i), uint64(i+1))
		store(t, e, m, kv, kfs[i], host, orig)
	}
	return kfs
}

// TestRegisteredFilesTwoRegistrarsKeepTheBound: with two registrars, a
// file being registered counts against the byte bound: with room for one
// more file, while its registration is held, the other registrar does not
// take a second file beside it (nor replace the registered one, in use
// too recently), and once released two files are registered, not three.
func TestRegisteredFilesTwoRegistrarsKeepTheBound(t *testing.T) {
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 8, Registrars: 2})
	storeKeyFiles(t, e, m, kv, 1, host, orig)
	testwait.Until(t, "the first file registered", testwait.Hang, func() bool { return m.FileStats().Registered == 1 })
	size := m.FileStats().Bytes
	m.files.mu.Lock()
	m.files.limitBytes = 2 * size // room for one more
	m.files.mu.Unlock()
	release := holdRegistrations(t, e)
	storeKeyFiles(t, e, m, kv, 2, host, orig)
	testwait.Until(t, "one registration held and the other offer declined", testwait.Hang, func() bool {
		m.files.mu.Lock()
		defer m.files.mu.Unlock()
		return e.fake.WaitingRegistrations() == 1 && len(m.files.queued) == 1
	})
	release()
	testwait.Until(t, "the held registration done", testwait.Hang, func() bool { return m.FileStats().Registered == 2 })
	if st := m.FileStats(); st.Files != 2 || st.Bytes > 2*size {
		t.Fatalf("%+v: want two files within %d bytes", st, 2*size)
	}
}

// TestIdleRegistrarsRegisterOnlyWhileNoJobRuns: an idle registrar
// (Config.IdleRegistrars) takes no offer while a job of the mover runs,
// so that only the registrar registers beside jobs; once the mover is
// idle it registers beside the registrar, two files at once.
func TestIdleRegistrarsRegisterOnlyWhileNoJobRuns(t *testing.T) {
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 8, Registrars: 1, IdleRegistrars: 1})
	release := holdRegistrations(t, e)
	m.act.begin() // a job in flight throughout the stores below
	ended := false
	defer func() {
		if !ended {
			m.act.end()
		}
	}()
	testwait.Until(t, "the idle registrar waiting for the mover to fall idle", testwait.Hang, func() bool {
		return m.files.idleParked.Load() == 1
	})
	storeKeyFiles(t, e, m, kv, 3, host, orig)
	testwait.Until(t, "the registrar holding the first file", testwait.Hang, func() bool {
		return e.fake.WaitingRegistrations() == 1
	})
	if n, q, parked := e.fake.WaitingRegistrations(), m.FileStats().Queued, m.files.idleParked.Load(); n != 1 || q != 3 || parked != 1 {
		t.Fatalf("with a job in flight: %d registrations under way, %d files queued, %d idle registrars waiting; want 1, 3 and 1", n, q, parked)
	}
	m.act.end()
	ended = true
	testwait.Until(t, "the idle registrar registering a second file beside the registrar", testwait.Hang, func() bool {
		return e.fake.WaitingRegistrations() == 2
	})
	release()
	testwait.Until(t, "every file registered", testwait.Hang, func() bool { return m.FileStats().Registered == 3 })
	if st := m.FileStats(); st.Files != 3 || st.Queued != 0 {
		t.Fatalf("%+v: want the three files registered, none queued", st)
	}
}

// TestIdleRegistrarsLeaveAnOfferTakenAsAJobStartsToTheRegistrar: an
// idle registrar that takes an offer in the instant a job starts puts it
// back and waits for the mover to fall idle again, instead of
// registering beside the job.
func TestIdleRegistrarsLeaveAnOfferTakenAsAJobStartsToTheRegistrar(t *testing.T) {
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 8, Registrars: 1, IdleRegistrars: 1})
	release := holdRegistrations(t, e)
	var took atomic.Int32
	m.files.idleTook = func() {
		if took.Add(1) == 1 {
			m.act.begin() // a job starts as the idle registrar takes its first offer
		}
	}
	storeKeyFiles(t, e, m, kv, 2, host, orig)
	testwait.Until(t, "the idle registrar back to waiting, its offer put back, the registrar holding a file", testwait.Hang, func() bool {
		return took.Load() == 1 && m.files.idleParked.Load() == 1 && e.fake.WaitingRegistrations() == 1 && len(m.files.offers) == 1
	})
	if q := m.FileStats().Queued; q != 2 {
		t.Fatalf("%d files queued or in registration with the job running, want 2", q)
	}
	m.act.end()
	testwait.Until(t, "the idle registrar registering the offer it put back", testwait.Hang, func() bool {
		return took.Load() == 2 && e.fake.WaitingRegistrations() == 2
	})
	release()
	testwait.Until(t, "both files registered", testwait.Hang, func() bool { return m.FileStats().Registered == 2 })
}

// TestRegisteredFilesABurstOfStoresIsRegisteredWhole: a burst of stores
// offers its files faster than the registrar registers them (here the
// fake runtime holds the first registration until every store is done);
// every file of the burst waits in the queue and is registered, none is
// dropped to move through the pinned buffers at its next job.
func TestRegisteredFilesABurstOfStoresIsRegisteredWhole(t *testing.T) {
	const burst = 300 // more than the 256 offers the queue once held
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 2 * burst, Registrars: 1})
	release := holdRegistrations(t, e)
	kfs := storeKeyFiles(t, e, m, kv, burst, host, orig)
	testwait.Until(t, "the registrar waiting in its first registration", testwait.Hang, func() bool {
		return e.fake.WaitingRegistrations() == 1
	})
	if queued := m.FileStats().Queued; queued != burst {
		t.Fatalf("%d of the burst's %d files queued or in registration, want all", queued, burst)
	}
	release()
	testwait.Until(t, "the burst registered", testwait.Hang, func() bool { return m.FileStats().Registered == burst })
	if queued := m.FileStats().Queued; queued != 0 {
		t.Fatalf("%d files still queued after the burst was registered", queued)
	}
	for _, kf := range kfs[:3] {
		load(t, e, m, kv, kf, host, orig)
	}
	if st := m.FileStats(); st.Files != burst || st.Loads != 3 {
		t.Fatalf("%+v: want the burst's %d files registered and the three loads direct", st, burst)
	}
}

// TestRegisteredFilesForgottenWhileQueuedGiveTheirDescriptorsBackAtOnce:
// a queued offer holds a descriptor of its file, which keeps a removed
// file's pages; Forget closes a waiting offer's descriptor at once, not
// when the registrar reaches it, and an offer the registrar has taken is
// released as soon as it is registered, never used.
func TestRegisteredFilesForgottenWhileQueuedGiveTheirDescriptorsBackAtOnce(t *testing.T) {
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 8, Registrars: 1})
	release := holdRegistrations(t, e)
	kfs := storeKeyFiles(t, e, m, kv, 3, host, orig)
	testwait.Until(t, "the registrar holding the first file", testwait.Hang, func() bool {
		return e.fake.WaitingRegistrations() == 1
	})
	if q := m.FileStats().Queued; q != 3 {
		t.Fatalf("%d files queued, want 3", q)
	}
	before := openDescriptors(t)
	for _, kf := range kfs { // the engine removes the files
		m.Forget(kf.id.FileID)
	}
	if n := before - openDescriptors(t); n != 2 {
		t.Fatalf("Forget closed %d descriptors while the registrar held its file, want the two waiting offers'", n)
	}
	release()
	testwait.Until(t, "the taken file registered and released", testwait.Hang, func() bool {
		st := m.FileStats()
		return st.Registered == 1 && st.Released == 1 && st.Queued == 0
	})
	if n := before - openDescriptors(t); n != 3 || m.FileStats().Files != 0 {
		t.Fatalf("after the registrar went on: %d descriptors closed, %+v; want all three and no file kept", n, m.FileStats())
	}
}

// TestRegisteredFilesRemovedDuringTheirJobAreNotOfferedWhenItEnds: a job
// through the pinned buffers offers its file when it ends; a file the
// engine removes while the job runs (Forget, then the unlink: a client's
// delete of a key being loaded, or a store replacing it) is not offered,
// whether the unlink comes before the job's end or after it. The offer's
// descriptor would keep the removed file's pages until the registrar
// reached it (here the registrar waits, as behind jobs that run on), and
// no Forget would come for it again.
func TestRegisteredFilesRemovedDuringTheirJobAreNotOfferedWhenItEnds(t *testing.T) {
	for _, tc := range []struct {
		name        string
		unlinkAfter bool
	}{{"unlinked before the job ends", false}, {"unlinked after the job ends", true}} {
		t.Run(tc.name, func(t *testing.T) {
			_, m, kv, _, _ := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 4, YieldBytes: 64 << 10})
			m.files.waitCap = time.Hour
			m.files.lastReg.Store(int64(time.Hour))
			m.files.beginStream() // another job through the pinned buffers runs on
			t.Cleanup(m.files.endStream)
			kf, release := heldJob(t, m, kv, t.TempDir(), true, false) // a load
			unlink := func() {
				if err := os.Remove(kf.path); err != nil {
					t.Fatal(err)
				}
			}
			before := openDescriptors(t)
			m.Forget(kf.id.FileID)
			if !tc.unlinkAfter {
				unlink()
			}
			if err := release(); err != nil {
				t.Fatal(err)
			}
			if tc.unlinkAfter {
				unlink()
			}
			if st, n := m.FileStats(), openDescriptors(t)-before; st.Queued != 0 || n != 0 {
				t.Fatalf("after the job ended: %d offers queued, %d more descriptors open; want the removed file not offered", st.Queued, n)
			}
		})
	}
}

// TestRegisteredFilesANewFileWithAForgottenFilesInodeNumberIsOffered: a
// job on a file the engine forgot while the job ran does not offer that
// file when it ends; a new file that got the forgotten file's inode
// number meanwhile (tmpfs's 32-bit numbers wrap) is another file, with
// another generation: its own job, begun and ended while the forgotten
// file's job still runs, offers it, and it is registered.
func TestRegisteredFilesANewFileWithAForgottenFilesInodeNumberIsOffered(t *testing.T) {
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 4})
	kf := newKeyFile(t, kv, t.TempDir(), "new", 1)
	old := kf.id // the removed file that had the new one's inode number
	old.Gen += "-the-removed-file"
	m.files.expectOffer(old) // a job on it in flight
	m.Forget(old.FileID)     // the engine removes it
	store(t, e, m, kv, kf, host, orig)
	if st := m.FileStats(); st.Queued+st.Files != 1 {
		t.Fatalf("after a job on the new file: %+v; want the new file offered", st)
	}
	testwait.Until(t, "the new file registered", testwait.Hang, func() bool { return m.FileStats().Files == 1 })
	m.files.endExpected(old) // the forgotten file's job ends
	if rf := m.files.acquire(kf.id, 1); rf == nil {
		t.Fatal("the new file's registration was not handed to its job")
	} else {
		m.files.put(rf, true, true)
	}
}

// TestRegisteredFilesARegistrarWithoutItsDeviceRefusesEveryOffer: a
// registrar that cannot make its device current registers nothing (its
// limit is 0); the offers jobs and Prepare make are then refused at once,
// opening no descriptor and queueing nothing, and none is counted as
// deferred at the bound, which a second offer of the file would pass.
func TestRegisteredFilesARegistrarWithoutItsDeviceRefusesEveryOffer(t *testing.T) {
	e, m, kv, _, _ := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20}) // no registrar of its own
	const illegalAddress = 700
	e.fake.BreakDevice(1, illegalAddress)
	t.Cleanup(func() { e.fake.BreakDevice(1, 0) }) // the library is the binary's
	g := newFiles(m, 4, 0, 1, 0, 1, nil)           // on device 1, which fails every call
	t.Cleanup(g.close)
	testwait.Until(t, "the registrar off", testwait.Hang, func() bool { return g.stats().Limit == 0 })
	kf := newKeyFile(t, kv, t.TempDir(), "key", 1)
	before := openDescriptors(t)
	for range 2 { // a file's jobs offer it again and again
		g.offer(kf.f, kf.id, false)
	}
	if st, n := g.stats(), openDescriptors(t)-before; st.Deferred != 0 || st.Queued != 0 || n != 0 {
		t.Fatalf("two offers to a registrar that registers nothing: %d deferred, %d queued, %d more descriptors open; want all refused at once, none counted", st.Deferred, st.Queued, n)
	}
}

// TestRegisteredFilesWarmOffersOfFilesRemovedSinceTheirIdentityAreDropped:
// Warm reads its file's identity, then offers it; a file the engine
// removes in between (Forget finds nothing of it, then the unlink) is not
// queued, whose descriptor would keep the removed file's pages, and the
// engine's warmer is told to go on with other files.
func TestRegisteredFilesWarmOffersOfFilesRemovedSinceTheirIdentityAreDropped(t *testing.T) {
	_, m, kv, _, _ := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 4})
	m.files.waitCap = time.Hour
	m.files.lastReg.Store(int64(time.Hour))
	m.files.beginStream() // a job through the pinned buffers runs on: an offer would stay queued
	t.Cleanup(m.files.endStream)
	kf := newKeyFile(t, kv, t.TempDir(), "found", 1) // its identity read, as Warm reads it
	before := openDescriptors(t)
	m.Forget(kf.id.FileID)
	if err := os.Remove(kf.path); err != nil {
		t.Fatal(err)
	}
	more := m.files.offer(kf.f, kf.id, true) // the rest of Warm
	if st, n := m.FileStats(), openDescriptors(t)-before; st.Queued != 0 || st.Warmed != 0 || n != 0 || !more {
		t.Fatalf("a removed file offered: %d queued, %d warmed, %d more descriptors open, more = %v; want none queued and more", st.Queued, st.Warmed, n, more)
	}
}

// TestJobsYieldEveryYieldBytesOfCPUWork: with Config.YieldBytes a job
// gives its CPU up once per YieldBytes of bytes its thread copied or
// checksummed: staged stores and loads (the pinned-buffer copies), a
// staged store written in folios larger than YieldBytes, and stores and
// loads of a registered file (its checksums).
func TestJobsYieldEveryYieldBytesOfCPUWork(t *testing.T) {
	const every = 512 << 10
	var yields atomic.Int64
	count := func(t *testing.T, what string, job func(), want int64) {
		t.Helper()
		yields.Store(0)
		job()
		if got := yields.Load(); got != want {
			t.Errorf("%s: %d yields, want %d", what, got, want)
		}
	}
	t.Run("staged", func(t *testing.T) {
		e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, Copy: cuda.CopyBatch, YieldBytes: every})
		m.yieldHook = func() { yields.Add(1) }
		kf := newKeyFile(t, kv, t.TempDir(), "key", 1)
		want := (kf.p.End() - int64(kv.g.headerBytes)) / every
		count(t, "store", func() { store(t, e, m, kv, kf, host, orig) }, want)
		count(t, "load", func() { load(t, e, m, kv, kf, host, orig) }, want)
	})
	t.Run("staged store in large folios", func(t *testing.T) {
		// Pieces of 1 MiB folios, eight times YieldBytes: still a yield
		// per YieldBytes.
		const small = 128 << 10
		e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, Copy: cuda.CopyBatch, YieldBytes: small})
		m.yieldHook = func() { yields.Add(1) }
		kf := newKeyFile(t, kv, t.TempDir(), "key", 1)
		kf.p.Folio = 1 << 20
		want := (kf.p.End() - int64(kv.g.headerBytes)) / small
		count(t, "store", func() { store(t, e, m, kv, kf, host, orig) }, want)
	})
	t.Run("registered", func(t *testing.T) {
		e, m, kv, orig, host, kf := registeredFile(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, Copy: cuda.CopyBatch, RegisterFiles: 4, YieldBytes: every})
		m.yieldHook = func() { yields.Add(1) }
		want := (kf.p.End() - int64(kv.g.headerBytes)) / every
		count(t, "store", func() { store(t, e, m, kv, kf, host, orig) }, want)
		count(t, "load", func() { load(t, e, m, kv, kf, host, orig) }, want)
		if st := m.FileStats(); st.Stores != 1 || st.Loads != 1 {
			t.Fatalf("%+v; want one direct store and one direct load", st)
		}
	})
}

// TestSmallLoadsChecksumAfterTheirCopyOnlyBesideOtherJobs: a load of a
// registered file of one chunk checksums after its copy while other jobs
// are in flight; a lone load, a file of several chunks and the
// benchmark's switch checksum beside the copy.
func TestSmallLoadsChecksumAfterTheirCopyOnlyBesideOtherJobs(t *testing.T) {
	m := Mover{act: newActivity()}
	for _, tc := range []struct {
		chunks int
		jobs   int32
		beside bool
		want   bool
	}{
		{chunks: 1, jobs: 2, want: true},
		{chunks: 1, jobs: 16, want: true},
		{chunks: 1, jobs: 1, want: false},
		{chunks: 2, jobs: 16, want: false},
		{chunks: 8, jobs: 2, want: false},
		{chunks: 1, jobs: 16, beside: true, want: false},
	} {
		m.act.n.Store(tc.jobs)
		m.sumsBesideLoad = tc.beside
		if got := m.sumAfterCopy(tc.chunks); got != tc.want {
			t.Errorf("%d chunks, %d jobs in flight, switch %v: after = %v, want %v", tc.chunks, tc.jobs, tc.beside, got, tc.want)
		}
	}
}

// TestJobsInFlightCountEachJobWhileItRuns: a job counts itself in the
// mover's jobs in flight while it runs (seen from inside it, at a yield)
// and not after.
func TestJobsInFlightCountEachJobWhileItRuns(t *testing.T) {
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, Copy: cuda.CopyBatch, YieldBytes: 64 << 10})
	var seen atomic.Int32
	m.yieldHook = func() { seen.Store(m.act.jobs()) }
	kf := newKeyFile(t, kv, t.TempDir(), "key", 1)
	store(t, e, m, kv, kf, host, orig)
	if got, after := seen.Load(), m.act.jobs(); got != 1 || after != 0 {
		t.Fatalf("jobs in flight during a lone store %d, after it %d; want 1 and 0", got, after)
	}
}

// holdFirstYield makes the first yield of the mover's jobs (a job's,
// after Config.YieldBytes of its copies) wait until release, which the
// test's end calls too; reached is closed when that yield is reached.
// Later yields pass.
func holdFirstYield(t *testing.T, m *Mover) (reached <-chan struct{}, release func()) {
	t.Helper()
	at, hold := make(chan struct{}), make(chan struct{})
	var first atomic.Bool
	var once sync.Once
	m.yieldHook = func() {
		if first.CompareAndSwap(false, true) { // not a sync.Once: later yields must not wait for this one
			close(at)
			<-hold
		}
	}
	release = func() { once.Do(func() { close(hold) }) }
	t.Cleanup(release)
	return at, release
}

// heldStore starts a store of a new key file, on a memory mount or not,
// that stops at its first yield (holdFirstYield) and waits until it is
// there; release lets it finish and returns its error.
func heldStore(t *testing.T, m *Mover, kv *cache, dir string, memory bool) (release func() error) {
	_, release = heldJob(t, m, kv, dir, memory, true)
	return release
}

// heldJob is heldStore for a store (write) or a load of a new key file,
// which the load reads through a descriptor of its own; it returns the
// key file too.
func heldJob(t *testing.T, m *Mover, kv *cache, dir string, memory, write bool) (kf *keyFile, release func() error) {
	t.Helper()
	reached, let := holdFirstYield(t, m)
	kf = newKeyFile(t, kv, dir, "held", 99)
	kf.p.Memory = memory
	f := kf.f
	if !write {
		r, err := fsys.OS{}.OpenFile(kf.path, os.O_RDONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { r.Close() })
		f = r
	}
	done := make(chan error, 1)
	go func() {
		var err error
		if write {
			_, err = m.WriteFile(jobContext(t), f, kf.p, make([]uint32, kf.p.Sums))
		} else {
			_, err = m.ReadFile(jobContext(t), f, kf.p, make([]uint32, kf.p.Sums))
		}
		done <- err
	}()
	select {
	case <-reached:
	case err := <-done:
		t.Fatalf("the job ended (%v) before its first yield", err)
	}
	return kf, func() error { let(); return <-done }
}

// TestRegisteredFilesWaitForJobsThroughThePinnedBuffers: while a store or
// a load moves a memory-mount file through the pinned buffers, the
// registrar puts a file's registration off (here for up to an hour) and
// registers it, and the job's own file, once the job ends.
func TestRegisteredFilesWaitForJobsThroughThePinnedBuffers(t *testing.T) {
	for _, tc := range []struct {
		name  string
		write bool
	}{{"store", true}, {"load", false}} {
		t.Run(tc.name, func(t *testing.T) {
			e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 4, YieldBytes: 64 << 10})
			m.files.waitCap = time.Hour
			m.files.lastReg.Store(int64(time.Hour)) // read by the registrar after the offers below
			dir := t.TempDir()
			_, release := heldJob(t, m, kv, dir, true, tc.write)
			store(t, e, m, kv, newKeyFile(t, kv, dir, "key", 1), host, orig)
			testwait.Until(t, "the registrar waiting for the held job", testwait.Hang, func() bool { return m.FileStats().Waits == 1 })
			if st := m.FileStats(); e.fake.Count(cudatest.OpHostRegister) != 0 || st.Files != 0 || st.Queued != 1 {
				t.Fatalf("%+v, %d registrations while the job runs; want the offer queued and nothing registered", st, e.fake.Count(cudatest.OpHostRegister))
			}
			if err := release(); err != nil {
				t.Fatal(err)
			}
			testwait.Until(t, "both files registered once the job ended", testwait.Hang, func() bool { return m.FileStats().Files == 2 })
			if st := m.FileStats(); st.Waited <= 0 || st.Waits != 1 {
				t.Fatalf("%+v: want one wait of some time", st)
			}
		})
	}
}

// TestRegisteredFilesAreRegisteredBesideStoresThatNeverEnd: the
// registrar's wait for stores through the pinned buffers is bounded (by
// seven times its last registration's duration), so files are still
// registered while such a store runs on and on.
func TestRegisteredFilesAreRegisteredBesideStoresThatNeverEnd(t *testing.T) {
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 4, YieldBytes: 64 << 10})
	dir := t.TempDir()
	release := heldStore(t, m, kv, dir, true)
	kf := newKeyFile(t, kv, dir, "key", 1)
	store(t, e, m, kv, kf, host, orig)
	testwait.Until(t, "the file registered while the store runs", testwait.Hang, func() bool { return m.FileStats().Files == 1 })
	if st := m.FileStats(); st.Waits != 1 {
		t.Fatalf("%+v: want the registration to have waited once", st)
	}
	load(t, e, m, kv, kf, host, orig)
	if st := m.FileStats(); st.Loads != 1 {
		t.Fatalf("%+v: want the load direct", st)
	}
	if err := release(); err != nil {
		t.Fatal(err)
	}
}

// TestRegisteredFilesDoNotWaitForStoresToDisks: only stores into
// memory-mount files hold registrations back; a file is registered at
// once beside a store to a disk.
func TestRegisteredFilesDoNotWaitForStoresToDisks(t *testing.T) {
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 4, YieldBytes: 64 << 10})
	m.files.waitCap = time.Hour
	m.files.lastReg.Store(int64(time.Hour)) // read by the registrar after the offer below
	dir := t.TempDir()
	release := heldStore(t, m, kv, dir, false)
	store(t, e, m, kv, newKeyFile(t, kv, dir, "key", 1), host, orig)
	testwait.Until(t, "the file registered beside the store to a disk", testwait.Hang, func() bool { return m.FileStats().Files == 1 })
	if st := m.FileStats(); st.Waits != 0 {
		t.Fatalf("%+v: want no wait", st)
	}
	if err := release(); err != nil {
		t.Fatal(err)
	}
}

// TestRegisteredFilesForgottenOffersCostNoWait: offers forgotten before
// the registrar reaches them are dropped at once, not after a wait for
// the stores running meanwhile; only the offers it registers wait. (The
// fake runtime holds the first registration while the others are
// offered and forgotten; every wait, however short, is counted.)
func TestRegisteredFilesForgottenOffersCostNoWait(t *testing.T) {
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 8, Registrars: 1})
	m.files.lastReg.Store(int64(time.Millisecond)) // short waits; read by the registrar after the offers below
	m.files.beginStream()                          // a store into a memory-mount file, running throughout
	t.Cleanup(m.files.endStream)
	release := holdRegistrations(t, e)
	dir := t.TempDir()
	first := newKeyFile(t, kv, dir, "first", 1)
	store(t, e, m, kv, first, host, orig)
	testwait.Until(t, "the registrar in the first registration", testwait.Hang, func() bool { return e.fake.WaitingRegistrations() == 1 })
	kfs := storeKeyFiles(t, e, m, kv, 3, host, orig)
	for _, kf := range kfs {
		m.Forget(kf.id.FileID)
	}
	store(t, e, m, kv, newKeyFile(t, kv, dir, "last", 9), host, orig) // queued behind the forgotten ones
	release()
	testwait.Until(t, "the first and last files registered", testwait.Hang, func() bool { return m.FileStats().Files == 2 })
	if st := m.FileStats(); st.Waits != 2 || st.Registered != 2 {
		t.Fatalf("%+v: want two waits (the first and the last offer's) and two registrations", st)
	}
}

// TestRegisteredFilesAFailedRegistrationDoesNotShortenTheWait: the wait
// is bounded by the last successful registration's duration; a
// registration that failed at once does not make the next wait short.
func TestRegisteredFilesAFailedRegistrationDoesNotShortenTheWait(t *testing.T) {
	const lastReg = 50 * time.Millisecond
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 8})
	m.files.lastReg.Store(int64(lastReg))
	m.files.beginStream()
	t.Cleanup(m.files.endStream)
	e.fake.Fail(cudatest.OpHostRegister, 1, 2) // cudaErrorMemoryAllocation
	dir := t.TempDir()
	store(t, e, m, kv, newKeyFile(t, kv, dir, "a", 1), host, orig)
	testwait.Until(t, "the first registration failed", testwait.Hang, func() bool { return m.FileStats().Failed == 1 })
	store(t, e, m, kv, newKeyFile(t, kv, dir, "b", 2), host, orig)
	testwait.Until(t, "the second file registered", testwait.Hang, func() bool { return m.FileStats().Files == 1 })
	// Each wait ran to its timer (the store never ends), which never fires early.
	if st, want := m.FileStats(), 2*(streamShare-1)*lastReg; st.Waits != 2 || st.Waited < want {
		t.Fatalf("%+v: want two waits of %v in all at least", st, want)
	}
}

// TestRegisteredFilesCloseEndsTheRegistrarsWait: a mover closed while its
// registrar waits for stores does not wait for the wait's end, and the
// waiting offer's descriptor is closed.
func TestRegisteredFilesCloseEndsTheRegistrarsWait(t *testing.T) {
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 4})
	m.files.waitCap = time.Hour
	m.files.lastReg.Store(int64(time.Hour))
	m.files.beginStream() // counted, and never ended before the close
	store(t, e, m, kv, newKeyFile(t, kv, t.TempDir(), "key", 1), host, orig)
	testwait.Until(t, "the registrar waiting", testwait.Hang, func() bool { return m.FileStats().Waits == 1 })
	before := openDescriptors(t)
	closed := make(chan error, 1)
	go func() { closed <- m.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(testwait.Hang):
		t.Fatalf("Close still waiting for the registrar after %v", testwait.Hang)
	}
	if after := openDescriptors(t); after != before-1 {
		t.Fatalf("%d descriptors open after Close, %d before; want the waiting offer's closed", after, before)
	}
	m.files.endStream()
}

// TestARegisteredLoadShowsItsPhasesInAnExecutionTrace: a load of a
// registered file, in an execution trace, has regions for its copies'
// enqueue, its wait for them and its checksum, each ended.
func TestARegisteredLoadShowsItsPhasesInAnExecutionTrace(t *testing.T) {
	e, m, kv, orig, host, kf := registeredFile(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, Copy: cuda.CopyBatch, RegisterFiles: 4})
	evs := testtrace.Record(t, func() { load(t, e, m, kv, kf, host, orig) })
	if st := m.FileStats(); st.Loads != 1 {
		t.Fatalf("%+v: the load did not go through the registered file", st)
	}
	regions, ended := testtrace.Regions(evs, "")
	for _, r := range []string{"gpu: enqueue", "gpu: copy wait", "gpu: checksum"} {
		if !slices.Contains(regions, r) {
			t.Errorf("no region %q in the trace; it has %q", r, regions)
		}
	}
	if !ended {
		t.Errorf("a region was not ended: %v", evs)
	}
}

// TestIdentifyFromLeavesSmallerFilesUnidentified: identifyFrom identifies
// a file of its min bytes or more as identify does, and not a smaller one
// (a load of it without registration needs no identity), nor an empty
// file whatever min says.
func TestIdentifyFromLeavesSmallerFilesUnidentified(t *testing.T) {
	dir := t.TempDir()
	open := func(name string, size int64) fsys.File {
		t.Helper()
		path := filepath.Join(dir, name)
		f, err := fsys.OS{}.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		if err := os.Truncate(path, size); err != nil {
			t.Fatal(err)
		}
		return f
	}
	// Where the file system gives no file handles, nothing is identified.
	_, handles := identify(open("probe", 1))
	for _, tc := range []struct {
		name      string
		size, min int64
		want      bool
	}{
		{"at-min", 1 << 20, 1 << 20, handles},
		{"over-min", 2 << 20, 1 << 20, handles},
		{"under-min", 1<<20 - 1, 1 << 20, false},
		{"empty-min-0", 0, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := open(tc.name, tc.size)
			id, ok := identifyFrom(f, tc.min)
			if ok != tc.want {
				t.Fatalf("identifyFrom(%d-byte file, %d) = %v, want %v", tc.size, tc.min, ok, tc.want)
			}
			if full, _ := identify(f); ok && full != id {
				t.Fatalf("identify = %+v, identifyFrom = %+v", full, id)
			}
		})
	}
}
