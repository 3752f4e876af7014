//go:build invariants

package engine

import (
	"context"
	"os"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
)

// blockingOpen holds the first open of a file once armed, until release.
type blockingOpen struct {
	armed   atomic.Bool
	reached chan struct{}
	release chan struct{}
	once    sync.Once
}

func (b *blockingOpen) Inject(op fsys.Op, _ string) fsys.Fault {
	if op == fsys.OpOpen && b.armed.Load() {
		fired := false
		b.once.Do(func() { fired = true; close(b.reached) })
		if fired {
			<-b.release
		}
	}
	return fsys.Fault{}
}

// TestAPinOvertakenByItsEntrysRemovalIsNotKept: a load pins key a's
// entry, then looks for key b on disk (a miss of the index), and only
// then tells the policy of its pin. Meanwhile a's file vanishes and a
// lookup drops a: its REMOVE reaches the policy before the load's PIN,
// and the load, finding a gone, tells no UNPIN. The engine's count of the
// pins told to the policy (heldPolicy.pins, what a reload's new policy
// is told) kept a pin of a for good, one more at each such race, until a
// reload: nothing holds a pin once the load has ended.
func TestAPinOvertakenByItsEntrysRemovalIsNotKept(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	bo := &blockingOpen{reached: make(chan struct{}), release: make(chan struct{})}
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, abi.OrderLayerMajor), FS: &fsys.Faulty{FS: fsys.OS{}, Inj: bo}})
	g := smallGeometry(true)
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	keyContent(c, []byte("a"), []int{0, 1, 2, 3})
	storeAndCheck(t, e, c, [][]byte{[]byte("a")}, [][]int{{0, 1, 2, 3}})
	files := dataFiles(t, dir)
	if len(files) != 1 {
		t.Fatalf("files %v", files)
	}
	bo.armed.Store(true)
	j, err := e.Load(ctx, LoadRequest{Cache: c.id, Keys: [][]byte{[]byte("a"), []byte("b")}, Blocks: [][]int{{4, 5, 6, 7}, {8, 9, 10, 11}}})
	if err != nil {
		t.Fatal(err)
	}
	<-bo.reached // the load pinned a, and looks for b on disk
	// a's file vanishes (removed behind the engine's back), and a lookup
	// drops a: its REMOVE goes to the policy now.
	if err := os.Remove(files[0]); err != nil {
		t.Fatal(err)
	}
	if n, err := e.Lookup(ctx, ns, [][]byte{[]byte("a")}); err != nil || n != 0 {
		t.Fatalf("lookup of a vanished: %d %v", n, err)
	}
	close(bo.release)
	waitJob(t, j, nil)
	if pins, keys := e.PinStats(); pins != 0 || keys != 0 {
		t.Fatalf("client pins: %d, %d keys", pins, keys)
	}
	if pins := e.pol.Policy.(*switchPolicy).cur.pinCounts(); len(pins) != 0 {
		t.Fatalf("the load has ended and nothing is pinned, yet the engine counts pins told to the policy (entry: count): %v", pins)
	}
}
