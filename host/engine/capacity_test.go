package engine

import (
	"context"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/fsys"
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

// An eviction of many files removes them in parallel, and every victim's
// file is gone afterwards while the kept keys still load their own bytes.
func TestAnEvictionRemovesItsFilesInParallel(t *testing.T) {
	g := smallGeometry(true)
	fileLen := int64(4096) + g.KeyBytes()
	inj := &overlappingRemoves{overlapped: make(chan struct{})}
	dir := t.TempDir()
	mounts := []Mount{{Path: dir, Capacity: 20 * fileLen, HighWatermark: 0.9, LowWatermark: 0.3}}
	e := openEngine(t, Config{Mounts: mounts, Policy: newTestPolicy(1, 0), NoReuse: true, FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}})
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 4*20, layoutPlaneFirst)
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
