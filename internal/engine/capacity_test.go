//go:build invariants

package engine

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/testwait"
)

// overlappingRemoves holds each removal of a data file until another
// one is in flight too (overlapped is then closed). Removals one after
// another never overlap: the first that waits for overlapWait (a hang
// guard, which removals in parallel never reach however slow the
// machine) gives up, and no removal waits after it, so that such an
// engine ends the test soon, failing it.
type overlappingRemoves struct {
	inflight   atomic.Int64
	once       sync.Once
	overlapped chan struct{}
	gaveUp     atomic.Bool
}

// overlapWait is how long a removal waits for another to overlap it.
const overlapWait = 60 * time.Second

func (o *overlappingRemoves) Inject(op fsys.Op, path string) fsys.Fault {
	if op != fsys.OpRemove || !strings.HasSuffix(path, ".kv") {
		return fsys.Fault{}
	}
	if o.inflight.Add(1) >= 2 {
		o.once.Do(func() { close(o.overlapped) })
	}
	if !o.gaveUp.Load() {
		select {
		case <-o.overlapped:
		case <-time.After(overlapWait):
			o.gaveUp.Store(true)
		}
	}
	o.inflight.Add(-1)
	return fsys.Fault{}
}

// twentyFileMount opens an engine over a directory holding 20 files of
// smallGeometry(true) keys (watermarks 0.9 and 0.3, no spares), its file
// system seen through inj, with a namespace and a cache of keys blocks.
func twentyFileMount(t *testing.T, inj fsys.Injector, keys int) (*Engine, NamespaceID, *testCache, string, int64) {
	t.Helper()
	g := smallGeometry(true)
	fileLen := int64(4096) + g.KeyBytes()
	dir := t.TempDir()
	mounts := []Mount{{Path: dir, Capacity: 20 * fileLen, HighWatermark: 0.9, LowWatermark: 0.3}}
	e, ns, c := injectedEngine(t, mounts, newTestPolicy(1, 0), inj, 4*keys)
	return e, ns, c, dir, fileLen
}

// An eviction of many files removes them in parallel, and every victim's
// file is gone afterwards while the kept keys still load their own bytes.
func TestAnEvictionRemovesItsFilesInParallel(t *testing.T) {
	inj := &overlappingRemoves{overlapped: make(chan struct{})}
	e, ns, c, dir, fileLen := twentyFileMount(t, inj, 20)
	r := rand.New(rand.NewPCG(9, 9))
	keys := testKeys("parallel", 19)
	want := make([][]byte, len(keys))
	for i := range keys {
		b := []int{4 * i, 4*i + 1, 4*i + 2, 4*i + 3}
		c.fill(r, b)
		want[i] = c.data(b)
		storeAndCheck(t, e, c, keys[i:i+1], [][]int{b})
	}
	// The 19th file crossed the high watermark (18 files): the eviction
	// removed 13 at once, down to the low watermark (6 files).
	st := e.Stats()
	if st.Evictions < 2 || st.Mounts[0].Used > 6*fileLen {
		t.Fatalf("%d evictions, %d bytes used: want an eviction down to 6 files", st.Evictions, st.Mounts[0].Used)
	}
	select {
	case <-inj.overlapped:
	default:
		t.Fatalf("the eviction's %d removals never overlapped", st.Evictions)
	}
	if n := len(dataFiles(t, dir)); n != st.Entries {
		t.Fatalf("%d data files for %d entries: an evicted file was left behind", n, st.Entries)
	}
	for i := range keys {
		if n, _ := e.Lookup(context.Background(), ns, keys[i:i+1]); n == 1 {
			loadAndCompare(t, e, c, keys[i:i+1], [][]int{{76, 77, 78, 79}}, want[i:i+1])
		}
	}
}

// heldRemoves holds every removal of a data file until gate is closed,
// after saying so on started.
type heldRemoves struct{ started, gate chan struct{} }

func (h *heldRemoves) Inject(op fsys.Op, path string) fsys.Fault {
	if op == fsys.OpRemove && strings.HasSuffix(path, ".kv") {
		select {
		case h.started <- struct{}{}:
		default:
		}
		<-h.gate
	}
	return fsys.Fault{}
}

// The files an eviction is still removing keep their room: stores that
// come meanwhile wait for it instead of taking room the files still hold,
// and the files on disk never exceed the capacity.
func TestFilesAnEvictionIsStillRemovingKeepTheirRoom(t *testing.T) {
	inj := &heldRemoves{started: make(chan struct{}, 1), gate: make(chan struct{})}
	var openGate sync.Once
	release := func() { openGate.Do(func() { close(inj.gate) }) }
	e, _, c, dir, _ := twentyFileMount(t, inj, 40)
	t.Cleanup(release) // runs before the engine's Close, which waits for the held eviction
	r := rand.New(rand.NewPCG(9, 10))
	keys := testKeys("room", 40)
	store := func(i int) *Job {
		b := []int{4 * i, 4*i + 1, 4*i + 2, 4*i + 3}
		c.fill(r, b)
		j, err := e.Store(context.Background(), StoreRequest{Cache: c.id, Keys: keys[i : i+1], Blocks: [][]int{b}})
		if err != nil {
			t.Fatal(err)
		}
		return j
	}
	for i := range 18 {
		wantOutcomes(t, "store", waitJob(t, store(i), nil), OutcomeStored)
	}
	jobs := []*Job{store(18)} // crosses the high watermark: evicts 13 files, whose removals are held
	select {
	case <-inj.started:
	case <-time.After(testwait.Hang):
		t.Fatal("the eviction never began to remove its files")
	}
	// More stores while the files are still there: each either ends
	// (room that was free) or waits for the eviction; stop at the first
	// that waits.
	waits := e.st.evictWaits.Load()
	for i := 19; i < 40; i++ {
		j := store(i)
		jobs = append(jobs, j)
		done := func() bool {
			select {
			case <-j.Done():
				return true
			default:
				return false
			}
		}
		testwait.Until(t, fmt.Sprintf("store %d to end or wait for the eviction", i), testwait.Hang, func() bool { return done() || e.st.evictWaits.Load() > waits })
		if e.st.evictWaits.Load() > waits {
			break
		}
	}
	onDisk := len(dataFiles(t, dir))
	release()
	for _, j := range jobs {
		wantOutcomes(t, "store", waitJob(t, j, nil), OutcomeStored)
	}
	if onDisk > 20 {
		t.Fatalf("%d data files on disk while the eviction removed its files, for a capacity of 20", onDisk)
	}
}

// unindexedCase is a way the engine unindexes a key's file on a hot mount
// (mount 0 of a demotingPolicy engine) and removes it.
type unindexedCase struct {
	name string
	// at reports whether op on path, on a hot mount at hot and a cold
	// one at cold, is the moment the file is still there.
	at func(op fsys.Op, path, hot, cold string) bool
	// during runs at that moment.
	during func(e *Engine, ns NamespaceID, keys [][]byte)
	// run sets the case going: a delete or a move of the key's file.
	run func(t *testing.T, e *Engine, ns NamespaceID, keys [][]byte)
}

// unindexedCases: a delete, a move (its source), and a delete during a
// move (the file becomes an orphan, which the move removes when it
// releases the path).
func unindexedCases(ctx context.Context) []unindexedCase {
	return []unindexedCase{{
		name: "deleted",
		at: func(op fsys.Op, path, hot, _ string) bool {
			return op == fsys.OpRemove && strings.HasPrefix(path, hot) && strings.HasSuffix(path, ".kv")
		},
		run: func(t *testing.T, e *Engine, ns NamespaceID, keys [][]byte) {
			if n, err := e.Delete(ctx, ns, keys); n != 1 || err != nil {
				t.Fatalf("delete: %d, %v; want 1 key", n, err)
			}
		},
	}, {
		name: "moved source",
		at: func(op fsys.Op, path, hot, _ string) bool {
			return op == fsys.OpRemove && strings.HasPrefix(path, hot) && strings.HasSuffix(path, ".kv")
		},
		run: func(t *testing.T, e *Engine, ns NamespaceID, keys [][]byte) {
			if _, err := e.tier.move(ctx, entryOf(e, ns, keys[0]).ID, 1, true); err != nil {
				t.Fatalf("move: %v", err)
			}
		},
	}, {
		// The delete finds the path held by the move: the file becomes an
		// orphan, which the move removes when it releases the path.
		name: "deleted while moved",
		at: func(op fsys.Op, path, _, cold string) bool {
			return op == fsys.OpRename && strings.HasPrefix(path, cold)
		},
		during: func(e *Engine, ns NamespaceID, keys [][]byte) {
			e.Delete(ctx, ns, keys)
		},
		run: func(t *testing.T, e *Engine, ns NamespaceID, keys [][]byte) {
			if _, err := e.tier.move(ctx, entryOf(e, ns, keys[0]).ID, 1, true); !errors.Is(err, errMoveStale) {
				t.Fatalf("move of a file deleted during it: %v, want errMoveStale", err)
			}
		},
	}}
}

// A file the engine has unindexed counts as used on its mount until it is
// gone from the disk: the room is not free before. Each case catches the
// moment the file is still there (its removal about to begin, or the
// move's rename of its copy) and reads the hot mount's usage.
func TestUnindexedFilesCountAsUsedUntilRemoved(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := 4096 + g.KeyBytes()
	for _, tc := range unindexedCases(ctx) {
		t.Run(tc.name, func(t *testing.T) {
			hot, cold := t.TempDir(), t.TempDir()
			var (
				e     *Engine
				ns    NamespaceID
				keys  = testKeys("used", 1)
				armed atomic.Bool
				seen  atomic.Int64 // the hot mount's usage at the moment; -1 before
				onHot atomic.Int64 // data files on the hot mount then
			)
			seen.Store(-1)
			inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
				if tc.at(op, path, hot, cold) && armed.CompareAndSwap(true, false) {
					if tc.during != nil {
						tc.during(e, ns, keys)
					}
					onHot.Store(int64(len(dataFiles(t, hot))))
					seen.Store(e.Stats().Mounts[0].Used)
				}
				return fsys.Fault{}
			})
			var c *testCache
			e, ns, c = injectedEngine(t, []Mount{{Path: hot}, {Path: cold}}, &demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}, inj, 16)
			storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}})
			armed.Store(true)
			tc.run(t, e, ns, keys)
			if seen.Load() < 0 {
				t.Fatal("the moment to read the usage never came")
			}
			if onHot.Load() != 1 || seen.Load() != fileLen {
				t.Fatalf("with %d data files on the hot mount, it counted %d bytes used; want 1 file and its %d bytes", onHot.Load(), seen.Load(), fileLen)
			}
			if n := len(dataFiles(t, hot)); n != 0 {
				t.Fatalf("%d data files left on the hot mount", n)
			}
			if used, orphaned := e.Stats().Mounts[0].Used, orphanedBytes(e, 0); used != 0 || orphaned != 0 {
				t.Fatalf("the hot mount counts %d bytes used, %d of orphans, with its file gone", used, orphaned)
			}
		})
	}
}

// A file whose removal fails stays on disk, and its mount goes on
// counting its bytes as used (not as an orphan's) until a later eviction
// there removes it; each failure is counted.
func TestAFileWhoseRemovalFailsStaysCounted(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := 4096 + g.KeyBytes()
	for _, tc := range unindexedCases(ctx) {
		t.Run(tc.name, func(t *testing.T) {
			hot, cold := t.TempDir(), t.TempDir()
			var (
				e       *Engine
				ns      NamespaceID
				keys    = testKeys("stuck", 4)
				armed   atomic.Bool
				failing atomic.Bool
			)
			inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
				if tc.during != nil && tc.at(op, path, hot, cold) && armed.CompareAndSwap(true, false) {
					tc.during(e, ns, keys[:1])
				}
				if op == fsys.OpRemove && failing.Load() && strings.HasPrefix(path, hot) && strings.HasSuffix(path, ".kv") {
					return fsys.Fault{Err: syscall.EACCES}
				}
				return fsys.Fault{}
			})
			var c *testCache
			// The hot mount evicts (demotes) from its fourth file on.
			mounts := []Mount{{Path: hot, Capacity: 4 * fileLen, HighWatermark: 0.75, LowWatermark: 0.5}, {Path: cold}}
			e, ns, c = injectedEngine(t, mounts, &demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}, inj, 16)
			storeAndCheck(t, e, c, keys[:1], [][]int{{0, 1, 2, 3}})
			stuck := dataFiles(t, hot)
			armed.Store(true)
			failing.Store(true)
			tc.run(t, e, ns, keys[:1])
			failing.Store(false)
			if n := len(dataFiles(t, hot)); n != 1 {
				t.Fatalf("%d data files on the hot mount after a failed removal, want 1", n)
			}
			if st := e.Stats(); st.Mounts[0].Used != fileLen || orphanedBytes(e, 0) != 0 || st.RemoveFailures != 1 {
				t.Fatalf("with the file left on disk, the hot mount counts %d bytes used, %d of orphans, %d failed removals; want %d, 0 and 1",
					st.Mounts[0].Used, orphanedBytes(e, 0), st.RemoveFailures, fileLen)
			}
			// Three more files: an eviction on the hot mount, which
			// removes the file now.
			storeAndCheck(t, e, c, keys[1:], [][]int{{4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}})
			if exists(stuck[0]) {
				t.Fatal("the eviction did not remove the file left on disk")
			}
			if n, used := int64(len(dataFiles(t, hot))), e.Stats().Mounts[0].Used; n*fileLen != used {
				t.Fatalf("%d data files on the hot mount, %d bytes used; want %d", n, used, n*fileLen)
			}
		})
	}
}

// A deleted key whose file could not be removed stays deleted: a lookup,
// a load or a pin that finds the file under the key's name does not index
// it again. A store of the key writes a new file in its place, which its
// mount counts instead.
func TestADeletedKeyWhoseFileCouldNotBeRemovedStaysDeleted(t *testing.T) {
	ctx := context.Background()
	var failing atomic.Bool
	inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if op == fsys.OpRemove && failing.Load() && strings.HasSuffix(path, ".kv") {
			return fsys.Fault{Err: syscall.EACCES}
		}
		return fsys.Fault{}
	})
	e, ns, c, keys, blocks := faultyStore(t, newTestPolicy(1, abi.OrderLayerMajor), inj, "delstuck", 1, 16, 5)
	storeAndCheck(t, e, c, keys, blocks)
	failing.Store(true)
	if n, err := e.Delete(ctx, ns, keys); n != 1 || err != nil {
		t.Fatalf("Delete = %d, %v; want 1", n, err)
	}
	if len(dataFiles(t, e.mounts[0].root)) != 1 || e.Stats().RemoveFailures != 1 {
		t.Fatal("the deleted key's file was removed: the test proves nothing")
	}
	if n, err := e.Lookup(ctx, ns, keys); n != 0 || err != nil {
		t.Fatalf("Lookup of the deleted key = %d, %v; want 0", n, err)
	}
	res := wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: keys, Blocks: [][]int{{8, 9, 10, 11}}}))
	if kr := res.Keys[0]; kr.Outcome != OutcomeMissing {
		t.Fatalf("Load of the deleted key: %v, %v; want missing", kr.Outcome, kr.Err)
	}
	if id, held, err := e.Pin(ctx, ns, keys, 0); err != nil || held[0] {
		e.Unpin(ctx, id)
		t.Fatalf("Pin of the deleted key = %v, %v; want it not held", held, err)
	}
	storeAndCheck(t, e, c, keys, blocks)
	if st := e.Stats(); st.Entries != 1 || st.Mounts[0].Used != 4096+smallGeometry(true).KeyBytes() {
		t.Fatalf("after the key is stored again: %d entries, %d bytes used; want one file's", st.Entries, st.Mounts[0].Used)
	}
}

// A file whose removal keeps failing (a read-only remount) counts once in
// Stats.RemoveFailures, and the evictions that follow try it again at most
// once per leftRetryInterval, however many they are; once the interval
// has passed and the removal works, the next eviction removes it.
func TestAFileWhoseRemovalKeepsFailingCountsOnceAndIsTriedOncePerInterval(t *testing.T) {
	ctx := context.Background()
	var (
		mu    sync.Mutex
		now   = time.Unix(1_700_000_000, 0)
		stuck atomic.Pointer[string]
		tries atomic.Int64
	)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if p := stuck.Load(); op == fsys.OpRemove && p != nil && path == *p {
			tries.Add(1)
			return fsys.Fault{Err: syscall.EROFS}
		}
		return fsys.Fault{}
	})
	g := smallGeometry(true)
	fileLen := 4096 + g.KeyBytes()
	dir := t.TempDir()
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir, Capacity: 4 * fileLen, HighWatermark: 0.75, LowWatermark: 0.5}},
		FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}, Policy: newTestPolicy(1, abi.OrderLayerMajor), NoReuse: true, Now: clock})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	keys := testKeys("rofs", 1)
	storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}})
	path := entryOf(e, ns, keys[0]).Path
	stuck.Store(&path)
	if n, err := e.Delete(ctx, ns, keys); n != 1 || err != nil {
		t.Fatalf("Delete = %d, %v; want 1", n, err)
	}
	// Every store from the third evicts, with the stuck file counted.
	for i, k := range testKeys("more", 12) {
		storeAndCheck(t, e, c, [][]byte{k}, [][]int{{4 + i%3*4, 5 + i%3*4, 6 + i%3*4, 7 + i%3*4}})
	}
	st := e.Stats()
	if st.Evictions < 4 {
		t.Fatalf("%d evictions: the test proves nothing", st.Evictions)
	}
	if st.RemoveFailures != 1 || tries.Load() != 2 {
		t.Fatalf("after %d evictions, %d removals of the stuck file tried, %d failed removals counted; want 2 (the delete's, one retry) and 1",
			st.Evictions, tries.Load(), st.RemoveFailures)
	}
	if !exists(path) {
		t.Fatal("the stuck file is gone")
	}
	mu.Lock()
	now = now.Add(leftRetryInterval)
	mu.Unlock()
	stuck.Store(nil)
	for i, k := range testKeys("last", 2) {
		storeAndCheck(t, e, c, [][]byte{k}, [][]int{{4 + i*4, 5 + i*4, 6 + i*4, 7 + i*4}})
	}
	if exists(path) {
		t.Fatal("the stuck file is still there once the interval passed and its removal works")
	}
}

// An eviction whose removals fail leaves the mount counting the files it
// could not remove: the bytes on disk are the bytes used.
func TestAnEvictionWhoseRemovalsFailKeepsTheirBytesCounted(t *testing.T) {
	var failing atomic.Bool
	inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if op == fsys.OpRemove && failing.Load() && strings.HasSuffix(path, ".kv") {
			return fsys.Fault{Err: syscall.EIO}
		}
		return fsys.Fault{}
	})
	e, _, c, dir, fileLen := twentyFileMount(t, inj, 20)
	keys := testKeys("evstuck", 20)
	onDisk := func(when string) {
		t.Helper()
		if n, used := int64(len(dataFiles(t, dir))), e.Stats().Mounts[0].Used; n*fileLen != used {
			t.Fatalf("%s: %d data files (%d bytes) on the mount, %d bytes used", when, n, n*fileLen, used)
		}
	}
	failing.Store(true)
	for i := range 19 { // the 19th crosses the high watermark
		storeAndCheck(t, e, c, keys[i:i+1], [][]int{{4 * i, 4*i + 1, 4*i + 2, 4*i + 3}})
	}
	if st := e.Stats(); st.Evictions == 0 {
		t.Fatal("no eviction: the test proves nothing")
	}
	onDisk("after an eviction whose removals failed")
	if st := e.Stats(); st.RemoveFailures != st.Evictions {
		t.Fatalf("%d evictions, %d failed removals; want one per eviction", st.Evictions, st.RemoveFailures)
	}
	failing.Store(false)
	storeAndCheck(t, e, c, keys[19:], [][]int{{76, 77, 78, 79}})
	onDisk("after the next eviction")
}

// injectedEngine opens an engine over mounts with policy pol, its file
// system seen through inj, without spares, and declares a namespace of
// smallGeometry(true) with a cache of the given blocks.
func injectedEngine(t *testing.T, mounts []Mount, pol policy.Policy, inj fsys.Injector, blocks int) (*Engine, NamespaceID, *testCache) {
	t.Helper()
	g := smallGeometry(true)
	e := openEngine(t, Config{Mounts: mounts, FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}, Policy: pol, NoReuse: true})
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	return e, ns, newTestCache(t, e, ns, g, blocks, layoutPlaneFirst)
}

// entryOf returns the entry that holds key in namespace ns.
func entryOf(e *Engine, ns NamespaceID, key []byte) *entry {
	return e.ix.Files().Get(e.tables.get(ns).fp, key)
}

// oneMountPolicy is testPolicy naming every key on mount 0, without
// demotion.
type oneMountPolicy struct{ *testPolicy }

func (p *oneMountPolicy) Name(ctx context.Context, recs []abi.NameRecord) error {
	err := p.testPolicy.Name(ctx, recs)
	for i := range recs {
		recs[i].Mount = 0
	}
	return err
}

// A store that publishes over an orphan: the index lost a key of a file
// (as when another file that held it too was dropped), a store of that key
// claims the file's path, and while it looks at the file there a delete
// of the file's other key drops it (an orphan of the store, which holds
// the path). The store writes its own file, renamed over the orphan's;
// the mount ends counting the new file alone, no orphans, and nothing
// once it is deleted too.
func TestAStorePublishedOverAnOrphanLeavesItsFileCounted(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := 4096 + 2*g.KeyBytes()
	dir := t.TempDir()
	keys := testKeys("orphan", 3) // A, B in the first file; A, D in the store's
	var (
		e       *Engine
		ns      NamespaceID
		armed   atomic.Bool
		deleted atomic.Int64
	)
	inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if op == fsys.OpOpen && strings.HasSuffix(path, ".kv") && armed.CompareAndSwap(true, false) {
			n, _ := e.Delete(ctx, ns, keys[1:2])
			deleted.Store(int64(n))
		}
		return fsys.Fault{}
	})
	var c *testCache
	e, ns, c = injectedEngine(t, []Mount{{Path: dir}}, &oneMountPolicy{newTestPolicy(2, abi.OrderLayerMajor)}, inj, 16)
	storeAndCheck(t, e, c, keys[:2], [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}})
	first := entryOf(e, ns, keys[0])
	e.ix.Files().ForgetKey(e.tables.get(ns).fp, keys[0])
	armed.Store(true)
	storeAndCheck(t, e, c, [][]byte{keys[0], keys[2]}, [][]int{{8, 9, 10, 11}, {12, 13, 14, 15}})
	var orphan bool
	e.ix.Inspect(func() { orphan = first.Marks().Orphan })
	if deleted.Load() != 1 || !orphan {
		t.Fatalf("the delete during the store removed %d keys, orphan %v: want 1, and the first file an orphan of the store", deleted.Load(), orphan)
	}
	st := e.Stats().Mounts[0]
	if files := len(dataFiles(t, dir)); st.Entries != 1 || files != 1 || st.Used != fileLen || orphanedBytes(e, 0) != 0 {
		t.Fatalf("%d entries, %d files, %d bytes used, %d of orphans; want 1, 1, %d and 0", st.Entries, files, st.Used, orphanedBytes(e, 0), fileLen)
	}
	if n, err := e.Delete(ctx, ns, [][]byte{keys[0]}); n != 1 || err != nil {
		t.Fatalf("delete: %d, %v; want 1 key", n, err)
	}
	if used := e.Stats().Mounts[0].Used; used != 0 {
		t.Fatalf("%d bytes used with nothing stored", used)
	}
}

// An eviction whose victim is an orphan (its path held by a move) counts
// it as on its way out: it evicts no other entry for the room the orphan
// still holds, unless the store could not fit beside it below the
// capacity (watermarks at 1: no room between the low one and the
// capacity), where it evicts one more and the store succeeds.
func TestAnEvictionEvictsForItsOrphansOnlyWhatTheCapacityNeeds(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := 4096 + g.KeyBytes()
	cases := []struct {
		name      string
		high, low float64
		before    int // files stored before the move and the store
		left      int // entries left on the hot mount at the end
	}{
		// 3 files cross the high watermark (2.97 files); evicting the
		// oldest (the orphan) brings usage to the low one (2.1).
		{name: "room below the capacity", high: 0.99, low: 0.7, before: 2, left: 2},
		// A 4th file does not fit beside the orphan's: one more goes.
		{name: "watermarks at the capacity", high: 1, low: 1, before: 3, left: 2},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			hot, cold := t.TempDir(), t.TempDir()
			var (
				armed   atomic.Bool
				reached = make(chan struct{})
				resume  = make(chan struct{})
				once    sync.Once
			)
			t.Cleanup(func() { once.Do(func() { close(resume) }) }) // before the engine's Close
			inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
				if op == fsys.OpRename && strings.HasPrefix(path, cold) && armed.CompareAndSwap(true, false) {
					close(reached)
					<-resume
				}
				return fsys.Fault{}
			})
			e, ns, c := injectedEngine(t, []Mount{{Path: hot, Capacity: 3 * fileLen, HighWatermark: tc.high, LowWatermark: tc.low}, {Path: cold}},
				&oneMountPolicy{newTestPolicy(1, abi.OrderLayerMajor)}, inj, 16)
			keys := testKeys("over", tc.before+1)
			for i := range tc.before {
				storeAndCheck(t, e, c, keys[i:i+1], [][]int{{4 * i, 4*i + 1, 4*i + 2, 4*i + 3}})
			}
			armed.Store(true)
			moved := make(chan error, 1)
			go func() {
				_, err := e.tier.move(ctx, entryOf(e, ns, keys[0]).ID, 1, true)
				moved <- err
			}()
			select {
			case <-reached:
			case err := <-moved:
				t.Fatalf("the move ended before its rename: %v", err)
			case <-time.After(testwait.Hang):
				t.Fatal("the move never reached its rename")
			}
			i := tc.before
			storeAndCheck(t, e, c, keys[i:], [][]int{{4 * i, 4*i + 1, 4*i + 2, 4*i + 3}})
			once.Do(func() { close(resume) })
			if err := <-moved; !errors.Is(err, errMoveStale) {
				t.Fatalf("move of an evicted file: %v, want errMoveStale", err)
			}
			st := e.Stats().Mounts[0]
			if files := len(dataFiles(t, hot)); st.Entries != tc.left || files != tc.left || st.Used != int64(tc.left)*fileLen {
				t.Fatalf("%d entries, %d files, %d bytes used on the hot mount; want %d, %d and %d", st.Entries, files, st.Used, tc.left, tc.left, int64(tc.left)*fileLen)
			}
			if n := orphanedBytes(e, 0); n != 0 {
				t.Fatalf("%d bytes still counted as orphans with every orphan removed", n)
			}
		})
	}
}

// orphanedBytes returns what mount i counts as orphans' bytes.
func orphanedBytes(e *Engine, i int) int64 {
	return e.space.Inspect(e.mounts[i].sp).Orphaned
}

// sizelessFS is a file system that keeps no count of its blocks, as
// ramfs (and a FUSE file system without statfs): statfs says 0 blocks,
// none free.
type sizelessFS struct{ fsys.FS }

func (f sizelessFS) Statfs(path string) (fsys.StatFS, error) {
	st, err := f.FS.Statfs(path)
	st.Total, st.Free, st.Avail = 0, 0, 0
	return st, err
}

// TestAFileSystemThatReportsNoSizeTakesTheConfiguredCapacity: on a file
// system whose statfs counts no blocks (ramfs), the configured capacity
// is the capacity, and stores fit in it; without one, Open says that the
// mount needs one.
func TestAFileSystemThatReportsNoSizeTakesTheConfiguredCapacity(t *testing.T) {
	g := smallGeometry(true)
	const capacity = 16 << 20
	for _, tt := range []struct {
		name     string
		capacity int64
	}{
		{"configured", capacity},
		{"not configured", 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			cfg := Config{Mounts: []Mount{{Path: dir, Capacity: tt.capacity}}, Policy: newTestPolicy(1, abi.OrderLayerMajor), FS: sizelessFS{fsys.OS{}}, Logger: testLogger(t), IOWorkers: 2}
			if tt.capacity == 0 {
				e, err := testOpen(context.Background(), cfg)
				if err == nil {
					e.Close(context.Background())
					t.Fatal("Open without a capacity on a file system that reports no size succeeded")
				}
				if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), dir) || !strings.Contains(err.Error(), "capacity") {
					t.Fatalf("Open: %v: want ErrInvalid naming the mount and its capacity", err)
				}
				return
			}
			e := openEngine(t, cfg)
			if got := e.Stats().Mounts[0].Capacity; got != capacity {
				t.Fatalf("capacity %d, want the configured %d", got, capacity)
			}
			ns, _ := e.Declare(context.Background(), g)
			c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
			keys, blocks := testKeys("sizeless", 1), [][]int{{0, 1, 2, 3}}
			c.fill(rand.New(rand.NewPCG(9, 9)), blocks[0])
			storeAndCheck(t, e, c, keys, blocks)
			loadAndCompare(t, e, c, keys, [][]int{{4, 5, 6, 7}}, [][]byte{c.data(blocks[0])})
		})
	}
}

// victimsHook is testPolicy that calls victims, where set, at each call
// for victims.
type victimsHook struct {
	*testPolicy
	victims func()
}

func (p *victimsHook) Victims(ctx context.Context, req abi.EvictRequest, max int) ([]abi.Victim, error) {
	if p.victims != nil {
		p.victims()
	}
	return p.testPolicy.Victims(ctx, req, max)
}

// TestAnEvictionStopsWhenItsCallerGivesUp: a reservation that must evict,
// for a caller whose context is cancelled before it or while the policy
// picks the victims, deletes no file and fails with the context's error:
// no file is lost for a store that gave up, nor does it wait for the
// deletions.
func TestAnEvictionStopsWhenItsCallerGivesUp(t *testing.T) {
	for _, when := range []string{"before", "while"} {
		t.Run(when, func(t *testing.T) {
			g := smallGeometry(true)
			fileLen := int64(4096) + g.KeyBytes()
			pol := &victimsHook{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}
			e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir(), Capacity: 10 * fileLen, HighWatermark: 0.9, LowWatermark: 0.6}}, Policy: pol})
			fillWithoutEviction(t, e, g, "full", 9) // at the high watermark
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if when == "before" {
				cancel()
			} else {
				pol.victims = cancel
			}
			// Two files' room: more than is left below the capacity.
			m, size := e.mounts[0], 2*fileLen
			wantReserveStopped(t, e, ctx, m, size, "reserve with a cancelled context")
			if n := e.Stats().Evictions; n != 0 {
				t.Errorf("%d files deleted for a caller that gave up, want 0", n)
			}
		})
	}
}

// fillWithoutEviction declares g on e and stores n keys named prefix one
// at a time, each checked, and fails the test if any store evicted.
func fillWithoutEviction(t *testing.T, e *Engine, g Geometry, prefix string, n int) {
	t.Helper()
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	b := [][]int{{0, 1, 2, 3}}
	c.fill(rand.New(rand.NewPCG(3, 4)), b[0])
	keys := testKeys(prefix, n)
	for i := range keys {
		storeAndCheck(t, e, c, keys[i:i+1], b)
	}
	if got := e.Stats().Evictions; got != 0 {
		t.Fatalf("%d evictions while filling, want 0", got)
	}
}

// wantReserveStopped reserves size bytes on m for a caller whose ctx is
// cancelled (or is cancelled while room is made), and wants the context's
// error; what names the reservation in the failure.
func wantReserveStopped(t *testing.T, e *Engine, ctx context.Context, m *mount, size int64, what string) {
	t.Helper()
	err := e.capacity.reserve(ctx, m, size)
	if err == nil {
		e.capacity.unreserve(m, size)
	}
	if !errors.Is(err, context.Canceled) {
		t.Errorf("%s: %v, want context.Canceled", what, err)
	}
}

// TestAClusterEvictionStopsWhenItsCallerGivesUp: a reservation on a
// cluster mount past this node's share of the cluster's capacity, for a
// caller whose context is cancelled, deletes none of the node's files to
// make room in the cluster, and fails with the context's error, as an
// eviction for the mount's own capacity does.
func TestAClusterEvictionStopsWhenItsCallerGivesUp(t *testing.T) {
	g := smallGeometry(true)
	fileLen := int64(4096) + g.KeyBytes()
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir(), Capacity: 100 * fileLen, ClusterCapacity: 2 * fileLen, ClusterInterval: time.Hour}},
		Policy: newTestPolicy(1, abi.OrderLayerMajor), NodeID: "a"})
	fillWithoutEviction(t, e, g, "cluster", 2) // the node's whole share
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	m := e.mounts[0]
	wantReserveStopped(t, e, ctx, m, fileLen, "reserve past the cluster share with a cancelled context")
	if n := e.Stats().Evictions; n != 0 {
		t.Errorf("%d files deleted for a caller that gave up, want 0", n)
	}
}

// TestAFileSystemFilledByOthersSaysSoInTheNoSpaceError: where other
// programs filled a mount's file system, so that its free space plus the
// engine's files, less the reserve, is below the configured capacity, a
// store's ErrNoSpace says that the file system has no room left and what
// to do (the warning at Open's fix), not only that the file exceeds a
// capacity the operator never configured; where the configured capacity
// itself is too small, it says nothing of the file system.
func TestAFileSystemFilledByOthersSaysSoInTheNoSpaceError(t *testing.T) {
	const (
		total = 4 << 20
		size  = 64 << 10
	)
	for _, tt := range []struct {
		name              string
		capacity, reserve int64
		foreign           int64 // bytes other programs take after Open
		want              []string
		wantNot           []string
	}{
		{
			name: "filled", capacity: 1 << 20, foreign: total,
			want: []string{"exceeds the capacity of 0", "the file system has no room left", "its 0 bytes available",
				"reserve of 0", "of the configured 1048576 bytes", "fix: " + noRoomFix},
		},
		{
			name: "below the reserve", capacity: 1 << 20, reserve: 1 << 20, foreign: total - 512<<10,
			want: []string{"the file system has no room left", "its 524288 bytes available", "reserve of 1048576", "fix: " + noRoomFix},
		},
		{
			name: "configured capacity too small", capacity: 16 << 10,
			want:    []string{"a file of 65536 bytes exceeds the capacity of 16384"},
			wantNot: []string{"file system", "fix"},
		},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			disk := &smallDisk{root: dir, total: total}
			e := openEngine(t, Config{Mounts: []Mount{{Path: dir, Capacity: tt.capacity, Reserve: tt.reserve}},
				Policy: newTestPolicy(1, 0), FS: disk})
			disk.foreign = tt.foreign
			m := e.mounts[0]
			m.withEvictLock(func() { e.watch.refreshCapacity(m, true) })
			err := e.capacity.reserveUsed(context.Background(), m, size)
			if err == nil {
				t.Fatal("a reservation beyond the capacity succeeded")
			}
			if !errors.Is(err, ErrNoSpace) {
				t.Fatalf("%v: want ErrNoSpace", err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("%v: want it to say %q", err, w)
				}
			}
			for _, w := range tt.wantNot {
				if strings.Contains(err.Error(), w) {
					t.Errorf("%v: want it not to say %q", err, w)
				}
			}
		})
	}
}
