//go:build invariants

package engine

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/format"
)

// Tests of how the spares made ahead are shared between namespaces
// (ahead.go: aheadTargetsLocked, nextSpareLocked), from a review's probes.

func fileLenOf(g Geometry) int64 { return int64(4096) + alignTo(g.KeyBytes(), format.Align) }

// sparesBySize counts e's first mount's spares of each size.
func sparesBySize(e *Engine) map[int64]int {
	return e.space.Inspect(e.mounts[0].sp).Spares
}

// A size whose spare does not fit below the low watermark does not hold
// the other sizes back: the maker makes the spares that fit.
func TestASizeThatDoesNotFitLeavesTheOtherSizesTheirSpares(t *testing.T) {
	dir := tmpfsDir(t)
	big, small := smallGeometry(false), smallGeometry(false)
	big.Layers, small.Layers = 16, 1
	bl, sl := fileLenOf(big), fileLenOf(small)
	low := 200000.0
	capacity := int64(low / 0.85)
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir, Capacity: capacity, HighWatermark: 0.9, LowWatermark: 0.85, Preallocate: 2 * bl}}, Policy: newTestPolicy(1, 0)})
	for _, g := range []Geometry{small, big} {
		if _, err := e.Declare(context.Background(), g); err != nil {
			t.Fatal(err)
		}
	}
	waitEngineSpares(t, e)
	t.Logf("big %d small %d low %.0f budget %d: spares by size %v (small alone would get %d)", bl, sl, low, 2*bl, sparesBySize(e), int64(low)/sl)
	if n := sparesBySize(e)[sl]; n < 2 {
		t.Errorf("only %d small spares made; %d fit below the low watermark and its share holds %d", n, int64(low)/sl, bl/sl)
	}
}

// Where the low watermark binds before the budget, a namespace that comes
// later still gets spares: the first one's beyond its share make room.
func TestSparesBeyondTheirShareMakeRoomWhereTheLowWatermarkBinds(t *testing.T) {
	dir := tmpfsDir(t)
	a, b := smallGeometry(false), smallGeometry(false)
	b.Layers = 2
	al := fileLenOf(a)
	capacity := int64(6.5 * float64(al) / 0.85)
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir, Capacity: capacity, HighWatermark: 0.9, LowWatermark: 0.85, Preallocate: 8 * al}}, Policy: newTestPolicy(1, 0)})
	if _, err := e.Declare(context.Background(), a); err != nil {
		t.Fatal(err)
	}
	waitEngineSpares(t, e)
	t.Logf("A alone: %v", sparesBySize(e))
	if _, err := e.Declare(context.Background(), b); err != nil {
		t.Fatal(err)
	}
	waitEngineSpares(t, e)
	sp := sparesBySize(e)
	t.Logf("after B: %v (A's share holds %d, B's %d)", sp, 4, 4*al/fileLenOf(b))
	if sp[fileLenOf(b)] == 0 {
		t.Errorf("B has no spares while A keeps %d, beyond its share of 4", sp[al])
	}
}

// A store that ends after its namespace was released does not give the
// namespace its share back.
func TestAStoreInFlightGivesAReleasedNamespaceNoShare(t *testing.T) {
	inj := &blockSpareRename{hit: make(chan struct{}), release: make(chan struct{})}
	f := newAheadFixture(t, Config{FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}}, 40, 4, 0.85)
	ns2, c2 := f.secondNamespace(t)
	f.waitSpares(t)
	inj.armed.Store(true)
	c2.fill(f.r, []int{0, 1, 2, 3})
	j, err := f.e.Store(context.Background(), StoreRequest{Cache: c2.id, Keys: testKeys("x", 1), Blocks: [][]int{{0, 1, 2, 3}}})
	if err != nil {
		t.Fatal(err)
	}
	<-inj.hit
	if err := f.e.UnregisterCache(c2.id); err != nil {
		t.Fatal(err)
	}
	if err := f.e.Release(ns2); err != nil {
		t.Fatal(err)
	}
	close(inj.release)
	waitJob(t, j, nil)
	f.waitSpares(t)
	_, has := f.e.space.Inspect(f.e.mounts[0].sp).AheadSizes[uint32(ns2)]
	declared := f.e.tables.get(ns2).declared
	t.Logf("after release: entry for ns2 %v, declared %v, spares %v", has, declared, sparesBySize(f.e))
	if has && !declared {
		t.Errorf("released namespace %d keeps a share", ns2)
	}
}

// A size whose spares cannot be made keeps its namespace's share, so the
// other namespace's spares are neither grown into it nor removed again at
// its next store.
func TestASizeThatCannotBeMadeDoesNotChurnTheOtherSizes(t *testing.T) {
	a := smallGeometry(false)
	al := fileLenOf(a)
	fs := &failSizeFS{FS: fsys.OS{}, size: al}
	// 8 files of A: B alone could hold them all.
	f := newAheadFixture(t, Config{FS: fs}, 80, 8, 0.85)
	f.secondNamespace(t) // declared: B's share
	f.waitSpares(t)
	before := f.e.Stats()
	for i := range 10 {
		f.store(t, fmt.Appendf(nil, "a%d", i)) // A's spare cannot be made
		f.waitSpares(t)
	}
	st := f.e.Stats()
	made, reused := st.SparesMade-before.SparesMade, st.Reused-before.Reused
	removed := int(made) - int(reused) - (st.Mounts[0].SpareFiles - before.Mounts[0].SpareFiles)
	t.Logf("10 stores of A (its spares fail, %d tries): %d B spares made, %d reused, %d removed; spares %v", fs.tries.Load(), made, reused, removed, sparesBySize(f.e))
	if removed > 0 {
		t.Errorf("%d of B's spares removed and remade for A's spares that cannot be made", removed)
	}
}

// Which spares beyond their share are removed does not depend on map
// order: three namespaces declared in turn end with the same spares.
func TestTheSparesThreeNamespacesShareAreTheSameEveryRun(t *testing.T) {
	seen := map[string]int{}
	for range 20 {
		dir := tmpfsDir(t)
		a, b, c := smallGeometry(false), smallGeometry(false), smallGeometry(false)
		a.Layers, b.Layers, c.Layers = 2, 3, 1
		e := openEngine(t, Config{Mounts: []Mount{{Path: dir, Capacity: 100 << 20, HighWatermark: 0.9, LowWatermark: 0.85, Preallocate: 12 * fileLenOf(smallGeometry(false))}}, Policy: newTestPolicy(1, 0)})
		for _, g := range []Geometry{a, b, c} {
			if _, err := e.Declare(context.Background(), g); err != nil {
				t.Fatal(err)
			}
			waitEngineSpares(t, e)
		}
		seen[fmt.Sprint(sparesBySize(e))]++
		e.Close(context.Background())
	}
	t.Logf("final spares over 20 runs: %v", seen)
	if len(seen) > 1 {
		t.Errorf("%d different outcomes", len(seen))
	}
}

type blockSpareRename struct {
	armed   atomic.Bool
	hit     chan struct{}
	release chan struct{}
}

func (b *blockSpareRename) Inject(op fsys.Op, path string) fsys.Fault {
	if op == fsys.OpRename && b.armed.Load() && strings.HasPrefix(filepath.Base(path), tmpPrefix) {
		b.armed.Store(false)
		close(b.hit)
		<-b.release
	}
	return fsys.Fault{}
}

type failSizeFS struct {
	fsys.FS
	size  int64
	tries atomic.Int64
}
type failSizeFile struct {
	fsys.File
	fs   *failSizeFS
	name string
}

func (f *failSizeFS) OpenFile(name string, flag int, perm os.FileMode) (fsys.File, error) {
	file, err := f.FS.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return &failSizeFile{File: file, fs: f, name: name}, nil
}

func (f *failSizeFile) Allocate(size int64) error {
	if size == f.fs.size && strings.HasPrefix(filepath.Base(f.name), sparePrefix) {
		f.fs.tries.Add(1)
		return syscall.ENOSPC
	}
	return f.File.Allocate(size)
}

// BenchmarkSpareWorkPerStore is what every store on a mount that makes
// spares ahead pays under the engine's lock to ask whether the maker has
// work (wantSparesLocked → spareWorkLocked), with the spares already made, for
// one namespace and for nine sharing the budget.
func BenchmarkSpareWorkPerStore(b *testing.B) {
	for _, n := range []int{1, 9} {
		b.Run(fmt.Sprintf("namespaces=%d", n), func(b *testing.B) {
			dir, err := os.MkdirTemp("/dev/shm", "kvhost-bench-")
			if err != nil {
				b.Fatal(err)
			}
			defer os.RemoveAll(dir)
			g := smallGeometry(false)
			e, err := testOpen(context.Background(), Config{Mounts: []Mount{{Path: dir, Capacity: 1 << 30, Preallocate: 64 * fileLenOf(g)}}, Policy: newTestPolicy(1, 0), Logger: slog.New(slog.DiscardHandler)})
			if err != nil {
				b.Fatal(err)
			}
			defer e.Close(context.Background())
			for i := range n {
				gi := g
				gi.Layers = 1 + i%4
				gi.Model = fmt.Sprintf("model-%d", i)
				if _, err := e.Declare(context.Background(), gi); err != nil {
					b.Fatal(err)
				}
			}
			if err := e.WaitSpares(context.Background()); err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for range b.N {
				e.space.SpareWork()
			}
		})
	}
}
