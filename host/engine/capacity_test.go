package engine

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/fsys"
	"github.com/kvhost/kvhost/internal/testwait"
)

// overlappingRemoves holds each removal of a data file until another
// one is in flight too (overlapped is then closed), or until a bound
// passes: removals one after another never overlap.
type overlappingRemoves struct {
	inflight   atomic.Int64
	once       sync.Once
	overlapped chan struct{}
}

func (o *overlappingRemoves) Inject(op fsys.Op, path string) fsys.Fault {
	if op != fsys.OpRemove || !strings.HasSuffix(path, ".kv") {
		return fsys.Fault{}
	}
	if o.inflight.Add(1) >= 2 {
		o.once.Do(func() { close(o.overlapped) })
	}
	select {
	case <-o.overlapped:
	case <-time.After(2 * time.Second):
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
	e := openEngine(t, Config{Mounts: mounts, Policy: newTestPolicy(1, 0), NoReuse: true, FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}})
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	return e, ns, newTestCache(t, e, ns, g, 4*keys, layoutPlaneFirst), dir, fileLen
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
	case <-time.After(30 * time.Second):
		t.Fatal("the eviction never began to remove its files")
	}
	// More stores while the files are still there: each either ends
	// (room that was free) or waits for the eviction; stop at the first
	// that waits.
	waits := e.evictWaits.Load()
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
		testwait.Until(t, fmt.Sprintf("store %d to end or wait for the eviction", i), 30*time.Second, func() bool { return done() || e.evictWaits.Load() > waits })
		if e.evictWaits.Load() > waits {
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
