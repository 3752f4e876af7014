//go:build invariants

package engine

import (
	"context"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/fsys/fsystest"
	"github.com/kvhost/kvhost/internal/testwait"
)

// TestActivityShowsAHeldJobAndMovesOnlyAsWorkEnds: a store held in its
// mover's write is in Activity (one job, begun when it was submitted)
// and Moved stays put while it is held; once it goes on, Moved grows and
// no job is left. A watchdog tells a stalled engine from a busy one by
// these.
func TestActivityShowsAHeldJobAndMovesOnlyAsWorkEnds(t *testing.T) {
	held, release := make(chan struct{}), make(chan struct{})
	env := openRemovalEnv(t, Mount{Path: t.TempDir()}, func(ctx context.Context, n int) error {
		if n == 0 {
			close(held)
			<-release
		}
		return nil
	})
	before := env.e.Activity()
	if before.Jobs != 0 || !before.Oldest.IsZero() {
		t.Fatalf("idle engine: %+v", before)
	}
	submitted := time.Now()
	job, err := env.e.Store(context.Background(), StoreRequest{Cache: env.cid, Keys: [][]byte{[]byte("held")}, Blocks: [][]int{{0, 1, 2, 3}}})
	if err != nil {
		t.Fatal(err)
	}
	<-held
	during := env.e.Activity()
	if during.Jobs != 1 || during.Oldest.Before(submitted.Add(-time.Second)) || during.Oldest.After(time.Now()) {
		t.Errorf("a store held in its write: %+v (submitted %s)", during, submitted)
	}
	if during.Moved != before.Moved {
		t.Errorf("Moved went from %d to %d while the only job was held", before.Moved, during.Moved)
	}
	if during.OldestIO.IsZero() || during.OldestIO.Before(during.Oldest) {
		t.Errorf("the held write is not the oldest I/O in flight: %+v", during)
	}
	close(release)
	if res, err := job.Wait(context.Background()); err != nil || res.Keys[0].Outcome != OutcomeStored {
		t.Fatalf("the store: %+v, %v", res, err)
	}
	after := env.e.Activity()
	if after.Jobs != 0 || after.Moved <= during.Moved || !after.OldestIO.IsZero() {
		t.Errorf("after the store ended: %+v (Moved was %d)", after, during.Moved)
	}
}

// TestActivityMovesWhileAStoreDemotesFilesToTheColdMount: a store whose
// reservation demotes files one after another (its job in flight the
// whole time, nothing of its own moved) shows the demotions in Moved,
// so that a watchdog does not take a long demotion pass for a stall.
func TestActivityMovesWhileAStoreDemotesFilesToTheColdMount(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := 4096 + g.KeyBytes()
	cold := t.TempDir()
	var e *Engine
	var mu sync.Mutex
	var seen []Activity // at the start of each demotion's copy to the cold mount
	armed := false
	inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if op == fsys.OpOpen && strings.HasPrefix(path, cold) && strings.Contains(path, tmpPrefix) {
			mu.Lock()
			if armed {
				seen = append(seen, e.Activity())
			}
			mu.Unlock()
		}
		return fsys.Fault{}
	})
	pol := &demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}
	e = openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir(), Capacity: 10 * fileLen, HighWatermark: 0.95, LowWatermark: 0.05}, {Path: cold}},
		Policy: pol, FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 64, layoutPlaneFirst)
	r := rand.New(rand.NewPCG(3, 4))
	keys := testKeys("d", 10)
	for i := range 9 {
		b := [][]int{{0, 1, 2, 3}}
		c.fill(r, b[0])
		wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys[i : i+1], Blocks: b}))
	}
	mu.Lock()
	armed = true
	mu.Unlock()
	b := [][]int{{0, 1, 2, 3}}
	c.fill(r, b[0])
	wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys[9:10], Blocks: b}))
	mu.Lock()
	defer mu.Unlock()
	if len(seen) < 2 {
		t.Fatalf("the store's reservation demoted %d files, want several", len(seen))
	}
	for i := 1; i < len(seen); i++ {
		if seen[i].Jobs == 0 || seen[i].Moved <= seen[i-1].Moved {
			t.Errorf("demotion %d: %+v; Moved did not grow since the last (%d)", i, seen[i], seen[i-1].Moved)
		}
	}
}

// TestActivityShowsAHeldFileOperation: a store or load held in any
// operation on its file (here by an injector: the open, the fsync, the
// rename, the close, the read of a header) is Activity's OldestIO while
// held, and none is once it returns; the job then ends as it would have.
// A hung mount holds these, not only the movers' copies.
func TestActivityShowsAHeldFileOperation(t *testing.T) {
	g := smallGeometry(false)
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		load bool
		op   fsys.Op
	}{
		{"store's open", false, fsys.OpOpen},
		{"store's fsync", false, fsys.OpSync},
		{"store's rename", false, fsys.OpRename},
		{"store's close", false, fsys.OpClose},
		{"load's open", true, fsys.OpOpen},
		{"load's close", true, fsys.OpClose},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hold := &fsystest.Hold{}
			e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, 0), Fsync: true,
				FS: &fsys.Faulty{FS: fsys.OS{}, Inj: hold}})
			ns, _ := e.Declare(ctx, g)
			c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
			r := rand.New(rand.NewPCG(1, 2))
			keys, blocks := testKeys("held", 1), blockLists(r, 1, 4, 0)
			c.fill(r, blocks[0])
			if tc.load {
				storeAndCheck(t, e, c, keys, blocks)
			}
			before := e.Activity()
			if !before.OldestIO.IsZero() {
				t.Fatalf("before the job: %+v", before)
			}
			hold.Arm(tc.op)
			var job *Job
			var err error
			if tc.load {
				job, err = e.Load(ctx, LoadRequest{Cache: c.id, Keys: keys, Blocks: [][]int{{8, 9, 10, 11}}})
			} else {
				job, err = e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys, Blocks: blocks})
			}
			if err != nil {
				t.Fatal(err)
			}
			testwait.Until(t, "the "+tc.name+" to be held", testwait.Hang, hold.Holding)
			if during := e.Activity(); during.Jobs != 1 || during.OldestIO.IsZero() {
				t.Errorf("a held %s: %+v, want one job and an I/O in flight", tc.name, during)
			}
			hold.Release()
			res := wait(t)(job, nil)
			want := OutcomeStored
			if tc.load {
				want = OutcomeLoaded
			}
			if res.Keys[0].Outcome != want {
				t.Fatalf("after the held %s: %+v", tc.name, res)
			}
			if after := e.Activity(); after.Jobs != 0 {
				t.Errorf("after the %s returned: %+v, want no job", tc.name, after)
			}
			// A load's hit is written to the mount's access journal in the
			// background after the job ends (access.go): that I/O shows too,
			// until it returns.
			testwait.Until(t, "no I/O in flight after the "+tc.name, testwait.Hang, func() bool { return e.Activity().OldestIO.IsZero() })
		})
	}
}
