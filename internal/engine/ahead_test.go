//go:build invariants

package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// aheadFixture is an engine on a tmpfs directory whose mount makes spares
// ahead of stores, and a cache of the small geometry.
type aheadFixture struct {
	e       *Engine
	ns      NamespaceID
	c       *testCache
	dir     string
	fileLen int64 // a one-key file's length
	r       *rand.Rand
}

// newAheadFixture opens an engine on a fresh tmpfs directory with a
// capacity of capFiles one-key files, its low watermark at low and
// Preallocate of aheadFiles such files, declares the small geometry's
// namespace and waits for the spares its declaration has made ahead.
func newAheadFixture(t *testing.T, cfg Config, capFiles, aheadFiles int64, low float64) *aheadFixture {
	t.Helper()
	dir := tmpfsDir(t)
	g := smallGeometry(false) // files with a zero tail
	fileLen := int64(4096) + alignTo(g.KeyBytes(), format.Align)
	cfg.Mounts = []Mount{{Path: dir, Capacity: capFiles * fileLen, HighWatermark: max(low, 0.9), LowWatermark: low, Preallocate: aheadFiles * fileLen}}
	if cfg.Policy == nil {
		cfg.Policy = newTestPolicy(1, 0)
	}
	e := openEngine(t, cfg)
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	f := &aheadFixture{e: e, ns: ns, c: newTestCache(t, e, ns, g, 64, layoutPlaneFirst), dir: dir, fileLen: fileLen, r: rand.New(rand.NewPCG(3, 9))}
	f.waitSpares(t)
	return f
}

// secondNamespace declares a second namespace (of smaller files: two
// layers) and registers a cache of it.
func (f *aheadFixture) secondNamespace(t *testing.T) (NamespaceID, *testCache) {
	t.Helper()
	g2 := smallGeometry(false)
	g2.Layers = 2
	ns2, err := f.e.Declare(context.Background(), g2)
	if err != nil {
		t.Fatal(err)
	}
	return ns2, newTestCache(t, f.e, ns2, g2, 64, layoutPlaneFirst)
}

// store stores one key from fresh random blocks and returns its bytes.
func (f *aheadFixture) store(t *testing.T, key []byte) []byte {
	t.Helper()
	b := []int{0, 1, 2, 3}
	f.c.fill(f.r, b)
	want := f.c.data(b)
	storeAndCheck(t, f.e, f.c, [][]byte{key}, [][]int{b})
	return want
}

// storeJob stores keys in one job, each key from fresh random blocks
// (key i in blocks 4i..4i+3), and returns their bytes.
func (f *aheadFixture) storeJob(t *testing.T, keys [][]byte) [][]byte {
	t.Helper()
	blocks := make([][]int, len(keys))
	want := make([][]byte, len(keys))
	for i := range blocks {
		blocks[i] = []int{4 * i, 4*i + 1, 4*i + 2, 4*i + 3}
		f.c.fill(f.r, blocks[i])
		want[i] = f.c.data(blocks[i])
	}
	storeAndCheck(t, f.e, f.c, keys, blocks)
	return want
}

// waitSpares waits for the engine's maker to have nothing left to do.
func (f *aheadFixture) waitSpares(t *testing.T) {
	t.Helper()
	waitEngineSpares(t, f.e)
}

// waitEngineSpares waits for e's maker to have nothing left to do, and
// fails the test if that takes more than testwait.Hang.
func waitEngineSpares(t *testing.T, e *Engine) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Hang)
	defer cancel()
	if err := e.WaitSpares(ctx); err != nil {
		t.Fatalf("wait for the spares made ahead: %v", err)
	}
}

// aheadSizeOf is the size of namespace ns's files on e's first mount, as
// its declaration and stores say (0: not known).
func aheadSizeOf(e *Engine, ns NamespaceID) int64 {
	return e.space.Inspect(e.mounts[0].sp).AheadSizes[uint32(ns)]
}

// spareFiles lists the spare files under dir.
func spareFiles(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	for _, p := range leftovers(t, dir) {
		if strings.HasPrefix(filepath.Base(p), sparePrefix) {
			out = append(out, p)
		}
	}
	return out
}

func TestStoresOnTmpfsWriteIntoSparesMadeAheadAndLoadTheirOwnBytes(t *testing.T) {
	f := newAheadFixture(t, Config{}, 40, 3, 0.85)
	keys := testKeys("ahead", 10)
	// The namespace's declaration said the size: the spares exist before
	// the first store.
	st := f.e.Stats()
	if st.SparesMade != 3 || st.Mounts[0].SpareFiles != 3 || st.Mounts[0].SpareBytes != 3*f.fileLen {
		t.Fatalf("after the declaration: %d made, %d spares of %d bytes; want 3 made, 3 spares of %d bytes", st.SparesMade, st.Mounts[0].SpareFiles, st.Mounts[0].SpareBytes, 3*f.fileLen)
	}
	spares := spareFiles(t, f.dir)
	if len(spares) != 3 {
		t.Fatalf("spare files on disk: %v, want 3", spares)
	}
	for _, p := range spares {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if int64(len(b)) != f.fileLen || !bytes.Equal(b, make([]byte, len(b))) {
			t.Fatalf("spare %s: %d bytes, zero %v; want %d zero bytes", p, len(b), bytes.Equal(b, make([]byte, len(b))), f.fileLen)
		}
	}
	// Stores take the spares made ahead, and the maker makes them again
	// once the engine is idle.
	var want [][]byte
	for _, k := range keys[:4] {
		want = append(want, f.store(t, k))
	}
	if st := f.e.Stats(); st.Reused < 3 {
		t.Fatalf("%d stores into spares, want at least 3", st.Reused)
	}
	f.waitSpares(t)
	if st := f.e.Stats(); st.Mounts[0].SpareFiles != 3 || st.SparesMade < 6 {
		t.Fatalf("after four stores: %d spares, %d made; want 3 spares and at least 6 made", st.Mounts[0].SpareFiles, st.SparesMade)
	}
	// Several keys in one job, two files in flight at once.
	blocks := make([][]int, 6)
	for i := range blocks {
		blocks[i] = []int{4 + 4*i, 5 + 4*i, 6 + 4*i, 7 + 4*i}
		f.c.fill(f.r, blocks[i])
		want = append(want, f.c.data(blocks[i]))
	}
	storeAndCheck(t, f.e, f.c, keys[4:], blocks)
	into := make([][]int, len(keys))
	for i := range into {
		into[i] = []int{40 + i%6*4, 41 + i%6*4, 42 + i%6*4, 43 + i%6*4}
	}
	for i := range keys {
		loadAndCompare(t, f.e, f.c, keys[i:i+1], into[i:i+1], want[i:i+1])
	}
	// Close removes the spares, made ahead or not.
	if err := f.e.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if left := spareFiles(t, f.dir); len(left) != 0 {
		t.Fatalf("spares left after Close: %v", left)
	}
}

func TestSparesAreMadeAheadOnlyBelowTheLowWatermark(t *testing.T) {
	// Room for ten files, the low watermark at six; preallocate asks for
	// a hundred.
	f := newAheadFixture(t, Config{}, 10, 100, 0.6)
	f.store(t, []byte("first"))
	f.waitSpares(t)
	st := f.e.Stats()
	m := st.Mounts[0]
	low := int64(float64(m.Capacity) * 0.6)
	if m.Used+m.SpareBytes > low || m.Used+m.SpareBytes+f.fileLen <= low {
		t.Fatalf("%d bytes used and %d in %d spares, low watermark %d: want as many spares as fit below it", m.Used, m.SpareBytes, m.SpareFiles, low)
	}
	if m.SpareFiles == 0 {
		t.Fatal("no spare made: the test checks nothing")
	}
}

// blockTempWrites blocks every write to a store's temporary file while
// armed, until release is closed, and counts the writes it blocked.
type blockTempWrites struct {
	release chan struct{}
	blocked atomic.Int64
}

func (b *blockTempWrites) Inject(op fsys.Op, path string) fsys.Fault {
	if op == fsys.OpWrite && strings.HasPrefix(filepath.Base(path), tmpPrefix) {
		b.blocked.Add(1)
		<-b.release
	}
	return fsys.Fault{}
}

func TestSparesAreMadeAheadOnlyWhileNoFileIsInFlight(t *testing.T) {
	inj := &blockTempWrites{release: make(chan struct{})}
	f := newAheadFixture(t, Config{FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}}, 40, 4, 0.85)
	b := []int{0, 1, 2, 3}
	f.c.fill(f.r, b)
	j, err := f.e.Store(context.Background(), StoreRequest{Cache: f.c.id, Keys: testKeys("held", 1), Blocks: [][]int{b}})
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	defer once.Do(func() { close(inj.release) })
	// The store took a spare made ahead and told the maker before it
	// wrote: the maker wakes, finds the store's file in flight and waits
	// for it.
	testwait.Until(t, "the maker to wait for the store in flight", testwait.Hang, func() bool {
		return inj.blocked.Load() > 0 && f.e.maker.waitedIdle.Load() > 0
	})
	if st := f.e.Stats(); st.SparesMade != 4 || len(spareFiles(t, f.dir)) != 3 {
		t.Fatalf("%d spares made, %d spare files while a store was in flight; want the 4 made before it, 3 left", st.SparesMade, len(spareFiles(t, f.dir)))
	}
	once.Do(func() { close(inj.release) })
	wantOutcomes(t, "store", waitJob(t, j, nil), OutcomeStored)
	f.waitSpares(t)
	if st := f.e.Stats(); st.SparesMade != 5 {
		t.Fatalf("%d spares made once the store ended, want 5", st.SparesMade)
	}
}

// failSpareAllocations fails the allocation of every spare made ahead.
type failSpareAllocations struct{ failed atomic.Int64 }

func (f *failSpareAllocations) Inject(op fsys.Op, path string) fsys.Fault {
	if op == fsys.OpAllocate && strings.HasPrefix(filepath.Base(path), sparePrefix) {
		f.failed.Add(1)
		return fsys.Fault{Err: syscall.ENOSPC}
	}
	return fsys.Fault{}
}

// A spare that cannot be made is not tried again until the next store:
// a file system that refuses it would otherwise keep the maker busy.
func TestAFailedSpareIsTriedAgainOnlyAfterTheNextStore(t *testing.T) {
	inj := &failSpareAllocations{}
	f := newAheadFixture(t, Config{FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}}, 40, 4, 0.85)
	if n := inj.failed.Load(); n != 1 {
		t.Fatalf("after the declaration: %d spares tried, want 1", n)
	}
	for i := range 3 {
		f.store(t, []byte(fmt.Sprintf("key-%d", i)))
		f.waitSpares(t)
		if n := inj.failed.Load(); n != int64(i+2) {
			t.Fatalf("after %d stores: %d spares tried, want %d", i+1, n, i+2)
		}
	}
	st := f.e.Stats()
	if st.SparesMade != 0 || st.Mounts[0].SpareFiles != 0 || len(spareFiles(t, f.dir)) != 0 {
		t.Fatalf("%d made, %d spares, files %v after failed allocations: want none", st.SparesMade, st.Mounts[0].SpareFiles, spareFiles(t, f.dir))
	}
}

// The movers are shown each spare made ahead before any store writes
// into it (the GPU path registers it), and told to forget it when the
// engine removes it.
func TestMoversPrepareSparesMadeAheadAndForgetThemWhenRemoved(t *testing.T) {
	mv := &fakeMover{}
	cfg := Config{Movers: map[region.Kind]MoverFactory{region.KindDevice: func(MountInfo) (transfer.Mover, error) { return mv, nil }}}
	f := newAheadFixture(t, cfg, 40, 3, 0.85)
	f.store(t, []byte("first"))
	f.waitSpares(t)
	spares := spareFiles(t, f.dir)
	if len(spares) != 3 {
		t.Fatalf("spare files %v, want 3", spares)
	}
	mv.mu.Lock()
	prepared := map[uint64]bool{}
	for _, ino := range mv.prepared {
		prepared[ino] = true
	}
	mv.mu.Unlock()
	inos := map[uint64]string{}
	for _, p := range spares {
		ino := inode(t, p)
		inos[ino] = p
		if !prepared[ino] {
			t.Fatalf("spare %s (inode %d) was not prepared; prepared %v", p, ino, prepared)
		}
	}
	if err := f.e.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	mv.mu.Lock()
	defer mv.mu.Unlock()
	forgotten := map[uint64]bool{}
	for _, ino := range mv.forgotten {
		forgotten[ino] = true
	}
	for ino, p := range inos {
		if !forgotten[ino] {
			t.Fatalf("spare %s (inode %d) removed at Close without being forgotten", p, ino)
		}
	}
}

func TestNoSparesAreMadeAheadWithoutPreallocateOrOnADisk(t *testing.T) {
	for _, tc := range []struct {
		name  string
		dir   func(t *testing.T) string
		ahead int64
	}{
		{"tmpfs without preallocate", tmpfsDir, 0},
		{"a directory that is not a memory file system", diskDir, 1 << 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := tc.dir(t)
			e := openEngine(t, Config{Mounts: []Mount{{Path: dir, Preallocate: tc.ahead}}, Policy: newTestPolicy(1, 0)})
			if e.maker != nil {
				t.Fatal("a maker started where no mount makes spares ahead")
			}
			g := smallGeometry(false)
			ns, err := e.Declare(context.Background(), g)
			if err != nil {
				t.Fatal(err)
			}
			c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
			c.fill(rand.New(rand.NewPCG(1, 1)), []int{0, 1, 2, 3})
			storeAndCheck(t, e, c, testKeys("k", 1), [][]int{{0, 1, 2, 3}})
			waitEngineSpares(t, e)
			if st := e.Stats(); st.SparesMade != 0 || len(spareFiles(t, dir)) != 0 {
				t.Fatalf("%d spares made", st.SparesMade)
			}
		})
	}
}

func TestWaitSparesReturnsOnceTheEngineIsClosed(t *testing.T) {
	f := newAheadFixture(t, Config{}, 40, 3, 0.85)
	f.store(t, []byte("k"))
	if err := f.e.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Hang)
	defer cancel()
	if err := f.e.WaitSpares(ctx); err != nil {
		t.Fatalf("WaitSpares after Close: %v", err)
	}
}

// Preallocate bounds the spares made ahead of every size together: when
// stores change size, the maker removes the spares it made of the old
// size to make room for the new one.
// Two namespaces that store on one mount share Preallocate evenly, each
// share in spares of its own namespace's size; a released namespace's
// share goes back to the other.
func TestPreallocateIsSharedEvenlyBetweenTheNamespacesThatStore(t *testing.T) {
	f := newAheadFixture(t, Config{}, 40, 4, 0.85)
	if m := f.e.Stats().Mounts[0]; m.SpareBytes != 4*f.fileLen {
		t.Fatalf("%d bytes in %d spares for one namespace, want its whole budget, four files of %d", m.SpareBytes, m.SpareFiles, f.fileLen)
	}
	ns2, c2 := f.secondNamespace(t)
	f.store(t, []byte("a"))
	c2.fill(f.r, []int{0, 1, 2, 3})
	storeAndCheck(t, f.e, c2, [][]byte{[]byte("b")}, [][]int{{0, 1, 2, 3}})
	f.waitSpares(t)
	size1, size2 := aheadSizeOf(f.e, f.ns), aheadSizeOf(f.e, ns2)
	m := f.e.mounts[0]
	v := f.e.space.Inspect(m.sp)
	big, small, made := v.Spares[size1], v.Spares[size2], v.MadeBytes
	half := 2 * f.fileLen
	if ahead, _, _ := m.sp.Ahead(); size1 != f.fileLen || size2 >= f.fileLen || big != 2 || small != int(half/size2) || made > ahead {
		t.Fatalf("sizes %d and %d: %d and %d spares, %d bytes made; want two of the first size and %d of the second (half of %d each)", size1, size2, big, small, made, half/size2, ahead)
	}
	// The second namespace goes: its share goes back to the first.
	if err := f.e.UnregisterCache(c2.id); err != nil {
		t.Fatal(err)
	}
	if err := f.e.Release(ns2); err != nil {
		t.Fatal(err)
	}
	f.waitSpares(t)
	v = f.e.space.Inspect(m.sp)
	big, small = v.Spares[size1], v.Spares[size2]
	if big != 4 || small != 0 {
		t.Fatalf("after the second namespace's release: %d and %d spares, want four of the first size and none of the second", big, small)
	}
}

func TestSparesAreMadeAheadAgainWhenADeleteFreesRoom(t *testing.T) {
	// Room for ten files, the low watermark at six: five stored files
	// leave room for one spare; their delete, for six.
	f := newAheadFixture(t, Config{}, 10, 6, 0.6)
	keys := testKeys("d", 5)
	for _, k := range keys {
		f.store(t, k)
	}
	f.waitSpares(t)
	before := f.e.Stats().Mounts[0].SpareFiles
	if _, err := f.e.Delete(context.Background(), f.ns, keys); err != nil {
		t.Fatal(err)
	}
	f.waitSpares(t)
	m := f.e.Stats().Mounts[0]
	low := int64(float64(m.Capacity) * 0.6)
	if m.Used != 0 || m.SpareFiles <= before || m.SpareBytes+f.fileLen <= low && m.SpareFiles < 6 {
		t.Fatalf("after the delete: %d used, %d spares (%d before it), low watermark %d: want the freed room filled", m.Used, m.SpareFiles, before, low)
	}
}

// Spares are made only once no file has been in flight for the quiet
// period, not in the gaps between a burst's jobs.
func TestNoSparesAreMadeAheadBetweenTheJobsOfABurst(t *testing.T) {
	f := newAheadFixture(t, Config{}, 40, 8, 0.85)
	f.store(t, []byte("first"))
	f.waitSpares(t)
	before := f.e.Stats()
	f.e.maker.quietFor.Store(int64(time.Hour)) // every gap is shorter
	for _, k := range testKeys("burst", 8) {
		f.store(t, k)
	}
	if st := f.e.Stats(); st.SparesMade != before.SparesMade || st.Reused-before.Reused != 8 {
		t.Fatalf("%d spares made during a burst of 8 stores, %d stores into spares; want none made, 8 into the spares made before it", st.SparesMade-before.SparesMade, st.Reused-before.Reused)
	}
}

// Jobs of five keys in files of four write a four-key file and a one-key
// file: spares are made in the four-key size (most of the bytes), whatever
// order the files are written in, and every job's four-key file writes
// into one.
func TestSparesAreMadeAheadInTheSizeOfWholeFiles(t *testing.T) {
	for _, workers := range []int{1, 4} {
		t.Run(fmt.Sprintf("%d workers", workers), func(t *testing.T) {
			f := newAheadFixture(t, Config{Policy: newTestPolicy(4, 0), IOWorkers: workers}, 200, 8, 0.85)
			for round := range 6 {
				f.storeJob(t, testKeys(fmt.Sprintf("job%d-", round), 5))
				f.waitSpares(t)
				var sizes []int64
				for size := range f.e.space.Inspect(f.e.mounts[0].sp).Spares {
					sizes = append(sizes, size)
				}
				if len(sizes) != 1 || sizes[0] <= 2*f.fileLen {
					t.Fatalf("round %d: spares of sizes %v; want only the four-key files' (one key: %d bytes)", round, sizes, f.fileLen)
				}
				if st := f.e.Stats(); st.Reused < uint64(round) {
					t.Fatalf("round %d: %d stores into spares, want at least %d (one per job after the first)", round, st.Reused, round)
				}
			}
		})
	}
}

// Spares made ahead beyond their size's share (another namespace came)
// stay where one of the size that wants the room would not fit below the
// low watermark anyway: removing them would lose them for nothing.
func TestSparesMadeAheadStayWhereTheNewSizeWouldNotFit(t *testing.T) {
	dir := tmpfsDir(t)
	big, small := smallGeometry(false), smallGeometry(false)
	small.Layers = 3
	bigLen := int64(4096) + alignTo(big.KeyBytes(), format.Align)     // 86016 bytes
	smallLen := int64(4096) + alignTo(small.KeyBytes(), format.Align) // 65536
	// The budget holds two small spares, which fit below the low
	// watermark (200000 bytes) beside a small file. Shared, it holds one
	// of each size: the big spare would not fit even in place of the
	// small one beyond its share, before the big store or after it.
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir, Capacity: 285715, HighWatermark: 0.9, LowWatermark: 0.7, Preallocate: 2 * bigLen}}, Policy: newTestPolicy(1, 0)})
	r := rand.New(rand.NewPCG(5, 5))
	caches := map[*Geometry]*testCache{}
	declare := func(g *Geometry) {
		ns, err := e.Declare(context.Background(), *g)
		if err != nil {
			t.Fatal(err)
		}
		caches[g] = newTestCache(t, e, ns, *g, 16, layoutPlaneFirst)
	}
	wait := func() {
		waitEngineSpares(t, e)
	}
	declare(&small) // the whole budget: its spares up to the low watermark
	caches[&small].fill(r, []int{0, 1, 2, 3})
	storeAndCheck(t, e, caches[&small], [][]byte{[]byte("s")}, [][]int{{0, 1, 2, 3}})
	wait()
	before := e.Stats()
	if before.Mounts[0].SpareFiles != 2 || before.Mounts[0].SpareBytes != 2*smallLen {
		t.Fatalf("%d small spares made (%d bytes), want 2 of %d", before.Mounts[0].SpareFiles, before.Mounts[0].SpareBytes, smallLen)
	}
	declare(&big) // half the budget each: one small spare is beyond its share
	caches[&big].fill(r, []int{0, 1, 2, 3})
	storeAndCheck(t, e, caches[&big], [][]byte{[]byte("b")}, [][]int{{0, 1, 2, 3}})
	wait()
	if after := e.Stats(); after.Mounts[0].SpareFiles != 2 || after.SparesMade != before.SparesMade {
		t.Fatalf("after a big store: %d spares (%d before), %d made (%d before): want the small ones kept, none made", after.Mounts[0].SpareFiles, before.Mounts[0].SpareFiles, after.SparesMade, before.SparesMade)
	}
}

// diskDir is a fresh directory beside the package's sources (a checkout
// is on a disk), failing the test where that is a memory file system.
func diskDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp(".", ".test-disk-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	if isMemoryFS(int64(st.Type)) {
		t.Fatalf("%s is on a memory file system: the test needs a disk", dir)
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		t.Fatal(err)
	}
	return abs
}

// A namespace's declaration says the size of its files before any store
// (a whole group of its keys): the spares are made in the idle moment
// after it, and the namespace's first store writes into one. A later
// declaration of another size leaves the size alone.
func TestSparesAreMadeAheadOfTheFirstStoreOnceANamespaceIsDeclared(t *testing.T) {
	f := newAheadFixture(t, Config{Policy: newTestPolicy(4, 0)}, 200, 8, 0.85)
	whole := f.e.tables.get(f.ns).wholeFileLen()
	var sizes []int64
	for size, n := range f.e.space.Inspect(f.e.mounts[0].sp).Spares {
		if n > 0 {
			sizes = append(sizes, size)
		}
	}
	if len(sizes) != 1 || sizes[0] != whole || whole <= 3*f.fileLen {
		t.Fatalf("spares of sizes %v after the declaration; want only a four-key file's, %d bytes (one key: %d)", sizes, whole, f.fileLen)
	}
	if st := f.e.Stats(); st.Reused != 0 || st.SparesMade == 0 {
		t.Fatalf("before any store: %d made, %d reused; want some made, none reused", st.SparesMade, st.Reused)
	}
	keys := testKeys("first", 4)
	blocks := make([][]int, 4)
	var want [][]byte
	for i := range blocks {
		blocks[i] = []int{4 * i, 4*i + 1, 4*i + 2, 4*i + 3}
		f.c.fill(f.r, blocks[i])
		want = append(want, f.c.data(blocks[i]))
	}
	storeAndCheck(t, f.e, f.c, keys, blocks)
	if st := f.e.Stats(); st.Reused != 1 {
		t.Fatalf("the first store of four keys wrote %d files into spares, want its one file", st.Reused)
	}
	into := [][]int{{40, 41, 42, 43}, {44, 45, 46, 47}, {48, 49, 50, 51}, {52, 53, 54, 55}}
	loadAndCompare(t, f.e, f.c, keys, into, want)

	g2 := smallGeometry(false)
	g2.Layers = 2
	ns2, err := f.e.Declare(context.Background(), g2)
	if err != nil {
		t.Fatal(err)
	}
	whole2 := f.e.tables.get(ns2).wholeFileLen()
	if size, size2 := aheadSizeOf(f.e, f.ns), aheadSizeOf(f.e, ns2); size != whole || size2 != whole2 {
		t.Fatalf("after a second namespace's declaration the sizes are %d and %d, want %d (the first's, unchanged) and %d (its own)", size, size2, whole, whole2)
	}
}

// A vllm-fs namespace's files go to its own mount, never to a memory
// mount's spares: its declaration says no size.
func TestAVLLMFSNamespaceMakesNoSparesAhead(t *testing.T) {
	kv, rootFS := tmpfsDir(t), t.TempDir()
	tier := newFSTier(rootFS, 8192)
	v := &VLLMFS{Fields: tier.fields(), Namespace: tierModel}
	e := openEngine(t, Config{Mounts: []Mount{{Path: kv, Preallocate: 1 << 20}, {Path: rootFS, VLLMFS: v}}, Policy: newTestPolicy(1, 0)})
	if _, err := e.Declare(context.Background(), rowGeometry(tierModel, 8192)); err != nil {
		t.Fatal(err)
	}
	waitEngineSpares(t, e)
	sizes := len(e.space.Inspect(e.mounts[0].sp).AheadSizes)
	if st := e.Stats(); sizes != 0 || st.SparesMade != 0 || len(spareFiles(t, kv)) != 0 {
		t.Fatalf("after a vllm-fs namespace's declaration: %d sizes known, %d made; want none", sizes, st.SparesMade)
	}
	// A namespace of kvhost's layout does say one.
	ns, err := e.Declare(context.Background(), smallGeometry(false))
	if err != nil {
		t.Fatal(err)
	}
	waitEngineSpares(t, e)
	want := e.tables.get(ns).wholeFileLen()
	if size := aheadSizeOf(e, ns); size != want || e.Stats().SparesMade == 0 {
		t.Fatalf("after a kvhost namespace's declaration: size %d (want %d), %d made", size, want, e.Stats().SparesMade)
	}
}

// A store that fails gives back its room, and that wakes the maker, which
// nothing else would: the store itself left no room for a spare.
func TestSparesAreMadeAheadAgainWhenAFailedStoreFreesRoom(t *testing.T) {
	// Room for ten files, the low watermark at six, Preallocate of six:
	// six spares; a store into one leaves no room for another.
	inj := &failTempWrites{}
	f := newAheadFixture(t, Config{FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}}, 10, 6, 0.6)
	if n := f.e.Stats().Mounts[0].SpareFiles; n != 6 {
		t.Fatalf("%d spares after the declaration, want 6", n)
	}
	inj.fail.Store(true)
	b := []int{0, 1, 2, 3}
	f.c.fill(f.r, b)
	j, err := f.e.Store(context.Background(), StoreRequest{Cache: f.c.id, Keys: testKeys("fails", 1), Blocks: [][]int{b}})
	if err != nil {
		t.Fatal(err)
	}
	wantOutcomes(t, "store", waitJob(t, j, nil), OutcomeFailed)
	inj.fail.Store(false)
	if st := f.e.Stats(); st.Reused != 1 {
		t.Fatalf("the store wrote %d files into spares, want 1: the test checks nothing", st.Reused)
	}
	// Not WaitSpares: it would wake the maker itself.
	testwait.Until(t, "the failed store's room to be filled with a spare", testwait.Hang, func() bool {
		m := f.e.Stats().Mounts[0]
		return m.Used == 0 && m.SpareFiles == 6
	})
}

// failTempWrites fails every write to a store's temporary file while
// fail is set.
type failTempWrites struct{ fail atomic.Bool }

func (f *failTempWrites) Inject(op fsys.Op, path string) fsys.Fault {
	if f.fail.Load() && op == fsys.OpWrite && strings.HasPrefix(filepath.Base(path), tmpPrefix) {
		return fsys.Fault{Err: syscall.EIO}
	}
	return fsys.Fault{}
}

// A file copied between mounts (a tier move) takes no file slot, but it is
// a file in flight: the maker waits for it as for a store.
func TestNoSparesAreMadeAheadWhileAFileMovesBetweenMounts(t *testing.T) {
	ctx := context.Background()
	mem, disk := tmpfsDir(t), diskDir(t)
	release := make(chan struct{})
	var blocked atomic.Int64
	inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if op == fsys.OpWrite && strings.HasPrefix(path, disk+string(filepath.Separator)) && strings.HasPrefix(filepath.Base(path), tmpPrefix) {
			blocked.Add(1)
			<-release
		}
		return fsys.Fault{}
	})
	g := smallGeometry(false)
	fileLen := int64(4096) + alignTo(g.KeyBytes(), format.Align)
	e := openEngine(t, Config{Mounts: []Mount{{Path: mem, Capacity: 40 * fileLen, Preallocate: 4 * fileLen}, {Path: disk}},
		FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}, Policy: newTestPolicy(1, 0)})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	waitEngineSpares(t, e)
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	keys := testKeys("moves", 1)
	c.fill(rand.New(rand.NewPCG(4, 4)), []int{0, 1, 2, 3})
	want := c.data([]int{0, 1, 2, 3})
	// The store takes a spare; the maker may make another only after a
	// quiet period longer than the test.
	e.maker.quietFor.Store(int64(time.Hour))
	storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}})
	if keyMount(e, ns, keys[0]) != 0 {
		t.Fatalf("the key was stored on mount %d, want the memory mount", keyMount(e, ns, keys[0]))
	}
	made := e.Stats().SparesMade
	id := e.ix.Files().Get(e.tables.get(ns).fp, keys[0]).ID
	// From here the move's copy is the only file in flight: every wait
	// of the maker's is for it.
	testwait.Until(t, "the store's file slot to be released", testwait.Hang, func() bool { return !e.mv.slots.busy() })
	waited := e.maker.waitedIdle.Load()
	moved := make(chan error, 1)
	go func() {
		_, err := e.tier.move(ctx, id, 1, true)
		moved <- err
	}()
	var once sync.Once
	defer once.Do(func() { close(release) })
	testwait.Until(t, "the move's copy to be held", testwait.Hang, func() bool { return blocked.Load() > 0 })
	e.maker.quietFor.Store(0)
	e.maker.room() // the maker wakes and finds the copy in flight
	testwait.Until(t, "the maker to wait for the move", testwait.Hang, func() bool { return e.maker.waitedIdle.Load() > waited })
	if st := e.Stats(); st.SparesMade != made {
		t.Fatalf("%d spares made while a file moved between mounts", st.SparesMade-made)
	}
	once.Do(func() { close(release) })
	if err := <-moved; err != nil {
		t.Fatalf("move: %v", err)
	}
	waitEngineSpares(t, e)
	if st := e.Stats(); st.SparesMade <= made || keyMount(e, ns, keys[0]) != 1 {
		t.Fatalf("after the move: %d spares made, the key on mount %d; want more made, the key on the disk", st.SparesMade-made, keyMount(e, ns, keys[0]))
	}
	loadAndCompare(t, e, c, keys, [][]int{{4, 5, 6, 7}}, [][]byte{want})
}

// A client whose jobs hold fewer keys than a group writes only files of
// fewer keys: the first such store replaces the declaration's guess, and
// later stores write into spares of their own size.
func TestStoresOfFewerKeysThanAGroupReplaceTheDeclaredSpareSize(t *testing.T) {
	f := newAheadFixture(t, Config{Policy: newTestPolicy(4, 0)}, 200, 8, 0.85)
	for i, k := range testKeys("single", 6) {
		f.store(t, k) // one key: a file of one key, a quarter of a group
		f.waitSpares(t)
		if size := aheadSizeOf(f.e, f.ns); size != f.fileLen {
			t.Fatalf("after %d one-key stores spares are made of %d bytes, want a one-key file's %d", i+1, size, f.fileLen)
		}
	}
	if st := f.e.Stats(); st.Reused < 5 {
		t.Fatalf("%d of 6 one-key stores wrote into spares, want at least the 5 after the first", st.Reused)
	}
	// A whole group's file sets the size for good: a later one-key file
	// does not change it.
	blocks := make([][]int, 4)
	for i := range blocks {
		blocks[i] = []int{4 * i, 4*i + 1, 4*i + 2, 4*i + 3}
		f.c.fill(f.r, blocks[i])
	}
	storeAndCheck(t, f.e, f.c, testKeys("group", 4), blocks)
	f.store(t, []byte("single-after"))
	whole := f.e.tables.get(f.ns).wholeFileLen()
	if size := aheadSizeOf(f.e, f.ns); size != whole {
		t.Fatalf("after a four-key file and a one-key file spares are made of %d bytes, want the four-key file's %d", size, whole)
	}
}

// Where two mounts make spares ahead, a declaration says nothing: which
// of them the policy places files on is known only from the stores, and
// spares on a mount no store reaches would hold its memory for nothing.
func TestADeclarationMakesNoSparesWhereTwoMountsMakeThem(t *testing.T) {
	g := smallGeometry(false)
	fileLen := int64(4096) + alignTo(g.KeyBytes(), format.Align)
	a, b := tmpfsDir(t), tmpfsDir(t)
	e := openEngine(t, Config{Mounts: []Mount{{Path: a, Capacity: 40 * fileLen, Preallocate: 4 * fileLen}, {Path: b, Capacity: 40 * fileLen, Preallocate: 4 * fileLen}}, Policy: newTestPolicy(1, 0)})
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	waitEngineSpares(t, e)
	if st := e.Stats(); st.SparesMade != 0 {
		t.Fatalf("%d spares made after a declaration with two mounts making them, want none", st.SparesMade)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	c.fill(rand.New(rand.NewPCG(6, 6)), []int{0, 1, 2, 3})
	keys := testKeys("two", 1)
	storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}})
	waitEngineSpares(t, e)
	on := keyMount(e, ns, keys[0])
	st := e.Stats()
	if on < 0 || st.Mounts[on].SpareFiles != 4 || st.Mounts[1-on].SpareFiles != 0 {
		t.Fatalf("after a store on mount %d: spares %d and %d; want 4 on the store's mount, none on the other", on, st.Mounts[0].SpareFiles, st.Mounts[1].SpareFiles)
	}
}

// A move off the memory mount frees its room, and that wakes the maker,
// which nothing else would: the store before it left no room for a spare.
func TestSparesAreMadeAheadAgainWhenAMoveFreesRoom(t *testing.T) {
	ctx := context.Background()
	mem, disk := tmpfsDir(t), diskDir(t)
	g := smallGeometry(false)
	fileLen := int64(4096) + alignTo(g.KeyBytes(), format.Align)
	// Room for ten files, the low watermark at six, Preallocate of six.
	e := openEngine(t, Config{Mounts: []Mount{{Path: mem, Capacity: 10 * fileLen, HighWatermark: 0.9, LowWatermark: 0.6, Preallocate: 6 * fileLen}, {Path: disk}},
		Policy: newTestPolicy(1, 0)})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	waitEngineSpares(t, e)
	if n := e.Stats().Mounts[0].SpareFiles; n != 6 {
		t.Fatalf("%d spares after the declaration, want 6", n)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	c.fill(rand.New(rand.NewPCG(7, 7)), []int{0, 1, 2, 3})
	keys := testKeys("moved", 1)
	storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}})
	waitEngineSpares(t, e)
	if m := e.Stats().Mounts[0]; m.SpareFiles != 5 || m.Used != fileLen {
		t.Fatalf("after a store into a spare: %d spares, %d bytes used; want 5 and one file", m.SpareFiles, m.Used)
	}
	id := e.ix.Files().Get(e.tables.get(ns).fp, keys[0]).ID
	if _, err := e.tier.move(ctx, id, 1, true); err != nil {
		t.Fatalf("move: %v", err)
	}
	// Not WaitSpares: it would wake the maker itself.
	testwait.Until(t, "the moved file's room to be filled with a spare", testwait.Hang, func() bool {
		m := e.Stats().Mounts[0]
		return m.Used == 0 && m.SpareFiles == 6
	})
}

// Jobs shorter than a group but of varying length set the size only
// upwards: spares of the longer files stay, instead of the maker removing
// and remaking the whole budget after every job.
func TestSpareSizeFromFilesOfFewerKeysOnlyGrows(t *testing.T) {
	f := newAheadFixture(t, Config{Policy: newTestPolicy(4, 0)}, 200, 8, 0.85)
	h := f.e.tables.get(f.ns).header(0)
	h.Keys = make([]format.Key, 2)
	twoKeys := h.FileLen()
	for i := range 10 {
		n := 1 + i%2 // one key, two keys, one key, ...
		f.storeJob(t, testKeys(fmt.Sprintf("job%d-", i), n))
		f.waitSpares(t)
		size := aheadSizeOf(f.e, f.ns)
		want := f.fileLen
		if i > 0 {
			want = twoKeys
		}
		if size != want {
			t.Fatalf("after job %d (%d keys) spares are made of %d bytes, want %d", i, n, size, want)
		}
	}
	if st := f.e.Stats(); st.Reused < 4 {
		t.Fatalf("%d files written into spares, want at least the 4 two-key jobs after the first", st.Reused)
	}
}

func TestAutoPreallocateIsAnEighthOfAMemoryMountsCapacityBoundedByMemory(t *testing.T) {
	g := smallGeometry(false)
	fileLen := int64(4096) + alignTo(g.KeyBytes(), format.Align)
	tests := []struct {
		name        string
		dir         func(t *testing.T) string
		huge        bool // the file system says it holds 1 PiB
		memory      int64
		capacity    int64
		preallocate int64
		noReuse     bool
		want        int64 // 0: none; -8: an eighth of the effective capacity
	}{
		{"auto on a memory mount", tmpfsDir, false, 0, 64 * fileLen, PreallocateAuto, false, -8},
		{"auto on a memory mount of 1 PiB, 32 GiB of memory", tmpfsDir, true, 32 << 30, 0, PreallocateAuto, false, MaxAutoPreallocate},
		{"auto on a memory mount of 1 PiB, 256 GiB of memory", tmpfsDir, true, 256 << 30, 0, PreallocateAuto, false, 16 << 30},
		{"auto on a disk", func(t *testing.T) string { return t.TempDir() }, false, 0, 64 * fileLen, PreallocateAuto, false, 0},
		{"auto without reuse_files", tmpfsDir, false, 0, 64 * fileLen, PreallocateAuto, true, 0},
		{"0 turns it off", tmpfsDir, false, 0, 64 * fileLen, 0, false, 0},
		{"a size given", tmpfsDir, false, 0, 64 * fileLen, 3 * fileLen, false, 3 * fileLen},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var fs fsys.FS = fsys.OS{}
			if tt.huge {
				fs = hugeFS{fs}
			}
			e := openEngine(t, Config{Mounts: []Mount{{Path: tt.dir(t), Capacity: tt.capacity, Preallocate: tt.preallocate}},
				Policy: newTestPolicy(1, 0), NoReuse: tt.noReuse, FS: fs, Memory: tt.memory})
			m := e.Stats().Mounts[0]
			want := tt.want
			if want == -8 {
				want = m.Capacity / 8
			}
			if m.Preallocate != want {
				t.Fatalf("Preallocate %d with capacity %d, want %d", m.Preallocate, m.Capacity, want)
			}
		})
	}
}

// hugeFS is a file system whose every mount says it holds 1 PiB, free.
type hugeFS struct{ fsys.FS }

func (f hugeFS) Statfs(path string) (fsys.StatFS, error) {
	st, err := f.FS.Statfs(path)
	st.Total, st.Free, st.Avail = 1<<50, 1<<50, 1<<50
	return st, err
}

func TestAutoPreallocateMakesSparesOnceANamespaceIsDeclared(t *testing.T) {
	g := smallGeometry(false)
	fileLen := int64(4096) + alignTo(g.KeyBytes(), format.Align)
	e := openEngine(t, Config{Mounts: []Mount{{Path: tmpfsDir(t), Capacity: 64 * fileLen, Preallocate: PreallocateAuto}}, Policy: newTestPolicy(1, 0)})
	if _, err := e.Declare(context.Background(), g); err != nil {
		t.Fatal(err)
	}
	waitEngineSpares(t, e)
	// An eighth of 64 files' capacity: 8 spares of a one-key file.
	if m := e.Stats().Mounts[0]; m.SpareFiles != 8 || m.SpareBytes != 8*fileLen {
		t.Fatalf("%d spares of %d bytes made ahead, want 8 of %d", m.SpareFiles, m.SpareBytes, 8*fileLen)
	}
}

func TestANegativePreallocateOtherThanAutoIsRefused(t *testing.T) {
	_, err := testOpen(context.Background(), Config{Mounts: []Mount{{Path: t.TempDir(), Preallocate: -2}}, Policy: newTestPolicy(1, 0), Logger: testLogger(t)})
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "preallocate -2") {
		t.Fatalf("Open with preallocate -2: %v, want ErrInvalid naming it", err)
	}
}

func TestAutoPreallocateKeepsAtMostMaxAutoSpareFilesOfASize(t *testing.T) {
	g := smallGeometry(false)
	fileLen := int64(4096) + alignTo(g.KeyBytes(), format.Align)
	for _, tt := range []struct {
		name        string
		preallocate int64
		wantBound   int
	}{
		{"auto", PreallocateAuto, MaxAutoSpareFiles},
		{"a size given", 8 * fileLen, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e := openEngine(t, Config{Mounts: []Mount{{Path: tmpfsDir(t), Capacity: 64 * fileLen, Preallocate: tt.preallocate}}, Policy: newTestPolicy(1, 0)})
			m := e.mounts[0]
			ahead, bound, most := m.sp.Ahead()
			if tt.wantBound > 0 {
				// The bound itself is thousands of files; three stand for
				// it here, within a budget of eight.
				e.space.SetAhead(m.sp, ahead, 3, most)
			}
			if bound != tt.wantBound {
				t.Fatalf("spares of a size bounded at %d, want %d", bound, tt.wantBound)
			}
			if _, err := e.Declare(context.Background(), g); err != nil {
				t.Fatal(err)
			}
			waitEngineSpares(t, e)
			want := 8 // the byte budget: an eighth of 64 files, or 8 files given
			if tt.wantBound > 0 {
				want = 3
			}
			if st := e.Stats().Mounts[0]; st.SpareFiles != want {
				t.Fatalf("%d spares made ahead, want %d", st.SpareFiles, want)
			}
		})
	}
}

// Two models whose stores alternate keep spares of both sizes: every
// store after the first of each writes into one, and the maker removes
// none to make the other size's (it used to follow the last size stored
// and remake the whole budget at every switch).
func TestTwoNamespacesWhoseStoresAlternateKeepSparesOfBothSizes(t *testing.T) {
	f := newAheadFixture(t, Config{}, 60, 4, 0.85)
	_, c2 := f.secondNamespace(t)
	f.waitSpares(t) // the shares change once: half the first size's spares go
	before := f.e.Stats()
	for i := range 6 {
		f.store(t, fmt.Appendf(nil, "a%d", i))
		c2.fill(f.r, []int{0, 1, 2, 3})
		storeAndCheck(t, f.e, c2, [][]byte{fmt.Appendf(nil, "b%d", i)}, [][]int{{0, 1, 2, 3}})
		f.waitSpares(t)
	}
	st := f.e.Stats()
	// Made since = taken by stores + the change in spares: none removed.
	made, reused := st.SparesMade-before.SparesMade, st.Reused-before.Reused
	if reused != 12 || int(made) != int(reused)+st.Mounts[0].SpareFiles-before.Mounts[0].SpareFiles {
		t.Fatalf("12 stores: %d into spares, %d spares made, %d left (%d before); want every store into a spare and none removed", reused, made, st.Mounts[0].SpareFiles, before.Mounts[0].SpareFiles)
	}
}

// TestAutoPreallocateFollowsTheLargestRecentBurst: with PreallocateAuto,
// a burst of stores larger than the budget raises it to the burst, at
// most AutoPreallocateMax; a smaller burst then lowers it by a quarter at
// most; a size given stays as given.
func TestAutoPreallocateFollowsTheLargestRecentBurst(t *testing.T) {
	g := smallGeometry(false)
	fileLen := int64(4096) + alignTo(g.KeyBytes(), format.Align)
	const capFiles = 32 // auto: 4 files' budget (an eighth), at most 8 (a quarter)
	type burst struct {
		keys      int
		wantFiles float64 // the budget after it, in files
	}
	for _, tt := range []struct {
		name        string
		preallocate int64
		bursts      []burst
	}{
		// 12 is capped at 8; then 6 is three quarters of 8, 4.5 of 6, and
		// the budget never goes below the 4 it started at.
		{"auto", PreallocateAuto, []burst{{6, 6}, {12, 8}, {2, 6}, {1, 4.5}, {1, 4}}},
		{"a size given", 4 * fileLen, []burst{{6, 4}, {12, 4}}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e := openEngine(t, Config{Mounts: []Mount{{Path: tmpfsDir(t), Capacity: capFiles * fileLen, HighWatermark: 0.9, LowWatermark: 0.8, Preallocate: tt.preallocate}},
				Policy: newTestPolicy(1, 0), Memory: 1 << 40})
			// A burst is what comes between quiet moments. The test says
			// when they are: the quiet period is an hour while a burst's
			// job runs, so that no pause of a slow machine inside the job
			// splits it, and none once the job has ended, so that the
			// maker ends the burst at once.
			e.maker.quietFor.Store(0)
			ns, err := e.Declare(context.Background(), g)
			if err != nil {
				t.Fatal(err)
			}
			c := newTestCache(t, e, ns, g, 64, layoutPlaneFirst)
			waitEngineSpares(t, e)
			if got := e.Stats().Mounts[0].Preallocate; got != 4*fileLen {
				t.Fatalf("budget at start %d, want %d (4 files)", got, 4*fileLen)
			}
			r := rand.New(rand.NewPCG(5, 6))
			for i, b := range tt.bursts {
				keys := make([][]byte, b.keys)
				blocks := make([][]int, b.keys)
				for k := range keys {
					keys[k] = fmt.Appendf(nil, "burst-%d-key-%d", i, k)
					blocks[k] = []int{(4 * k) % 64, (4*k + 1) % 64, (4*k + 2) % 64, (4*k + 3) % 64}
					c.fill(r, blocks[k])
				}
				e.maker.quietFor.Store(int64(time.Hour))
				storeAndCheck(t, e, c, keys, blocks) // one job: one burst
				e.maker.quietFor.Store(0)
				waitEngineSpares(t, e) // wakes the maker, which ends the burst
				m := e.Stats().Mounts[0]
				if m.Preallocate != int64(b.wantFiles*float64(fileLen)) {
					t.Fatalf("after a burst of %d files: budget %d (%.3f files), want %g files", b.keys, m.Preallocate, float64(m.Preallocate)/float64(fileLen), b.wantFiles)
				}
				// The spares are there too (those a smaller budget no
				// longer needs stay until a store or a reservation takes
				// them).
				if want := int(b.wantFiles); m.SpareFiles < want {
					t.Fatalf("after a burst of %d files: %d spares, want at least %d", b.keys, m.SpareFiles, want)
				}
				if _, err := e.Delete(context.Background(), ns, keys); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}

// noFallocateFS is a file system without fallocate, as ramfs: Allocate
// does nothing (fsys.OS's Allocate returns nil on EOPNOTSUPP), and a new
// file keeps its length of 0.
type noFallocateFS struct{ fsys.FS }

func (f noFallocateFS) OpenFile(name string, flag int, perm os.FileMode) (fsys.File, error) {
	file, err := f.FS.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return noFallocateFile{file}, nil
}

type noFallocateFile struct{ fsys.File }

func (noFallocateFile) Allocate(int64) error { return nil }

// TestAMemoryMountWithoutFallocateMakesNoEmptySpares: where the file
// system cannot preallocate (ramfs), the maker keeps no spare ahead (it
// would be an empty file counted as none, and the maker would make more
// without end): it goes quiet with no spare file on disk, and stores work.
func TestAMemoryMountWithoutFallocateMakesNoEmptySpares(t *testing.T) {
	g := smallGeometry(false)
	fileLen := int64(4096) + alignTo(g.KeyBytes(), format.Align)
	dir := tmpfsDir(t)
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir, Capacity: 64 * fileLen, Preallocate: 8 * fileLen}}, Policy: newTestPolicy(1, 0), FS: noFallocateFS{fsys.OS{}}})
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	waitEngineSpares(t, e)
	if m := e.Stats().Mounts[0]; m.SpareFiles != 0 || m.SpareBytes != 0 {
		t.Fatalf("%d spares of %d bytes made ahead without fallocate, want none", m.SpareFiles, m.SpareBytes)
	}
	if l := leftovers(t, dir); len(l) != 0 {
		t.Fatalf("files left by the maker: %d, the first %v", len(l), l[0])
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	keys, blocks := testKeys("nofalloc", 1), [][]int{{0, 1, 2, 3}}
	c.fill(rand.New(rand.NewPCG(4, 4)), blocks[0])
	storeAndCheck(t, e, c, keys, blocks)
	loadAndCompare(t, e, c, keys, [][]int{{4, 5, 6, 7}}, [][]byte{c.data(blocks[0])})
}
