//go:build invariants

package engine

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/clustercap"
	"github.com/kvhost/kvhost/internal/testwait"
)

// TestClusterAnAdopterLeavesTheFilesOfALiveNodeOfTheDeadNodesTag: node D
// runs beside node A (they pair: flocks shared), stores 2 files and
// stops. Node L, another node_id of D's owner tag, starts after D's
// summary went stale (its start's check finds no running node of its
// tag) and stores 2 files. A finds D dead: it must not adopt D while L
// runs, since a walk for D's tag indexes L's files as D's and A would
// then evict a running node's files. A stores far past a bound of 8
// files: L's files stay and load on L byte for byte.
func TestClusterAnAdopterLeavesTheFilesOfALiveNodeOfTheDeadNodesTag(t *testing.T) {
	ctx := context.Background()
	const deadID, liveID = "node32659", "node41684" // one owner tag (twinNodes)
	if clustercap.Tag(deadID) != clustercap.Tag(liveID) {
		t.Fatalf("node ids %s and %s: tags %#x and %#x, want one", deadID, liveID, clustercap.Tag(deadID), clustercap.Tag(liveID))
	}
	capacity := 8 * oneFileBytes(t)
	dir := t.TempDir()
	r := rand.New(rand.NewPCG(61, 61))
	clock := newTestClock()
	a := clusterNodeAt(t, dir, "a", capacity, time.Hour, clock.now)
	d := clusterNode(t, dir, deadID, capacity, time.Hour)
	m := a.e.mounts[0]
	m.cluster.Tick(ctx) // A finds D's lock held while D runs: flocks shared
	storeKeys(t, d, "d", 2, r)
	if err := d.e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	clock.advance(4 * time.Hour) // D's summary: stale, as A sees it

	liveClock := newTestClock()
	liveClock.advance(4 * time.Hour) // and as L sees it: L's start refuses no running node
	l := clusterNodeAt(t, dir, liveID, capacity, time.Hour, liveClock.now)
	before := map[string]bool{}
	for _, p := range kvFiles(t, dir) {
		before[p] = true
	}
	lkeys := testKeys("live", 2)
	blocks := [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}}
	want := make([][]byte, len(lkeys))
	for i, k := range lkeys {
		l.c.fill(r, blocks[i])
		want[i] = l.c.data(blocks[i])
		storeAndCheck(t, l.e, l.c, [][]byte{k}, [][]int{blocks[i]})
	}
	lm := l.e.mounts[0]
	lm.cluster.Tick(ctx) // L's summary counts its files
	liveFiles := map[string]bool{}
	for _, p := range kvFiles(t, dir) {
		if !before[p] {
			liveFiles[p] = true
		}
	}
	if len(before) != 2 || len(liveFiles) != 2 {
		t.Fatalf("%d data files of D's 2 stores, %d of L's 2", len(before), len(liveFiles))
	}

	m.cluster.Tick(ctx)
	for i := range 12 {
		bl := []int{4 * (i % 16), 4*(i%16) + 1, 4*(i%16) + 2, 4*(i%16) + 3}
		a.c.fill(r, bl)
		res := wait(t)(a.e.Store(ctx, StoreRequest{Cache: a.c.id, Keys: testKeys(fmt.Sprintf("a%02d", i), 1), Blocks: [][]int{bl}}))
		if kr := res.Keys[0]; kr.Outcome != OutcomeStored && (kr.Outcome != OutcomeFailed || !errors.Is(kr.Err, ErrNoSpace)) {
			t.Fatalf("A's store %d: %v, %v; want stored or refused for room", i, kr.Outcome, kr.Err)
		}
		m.cluster.Tick(ctx)
	}
	for p := range liveFiles {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("running node L's file %s is gone: A, adopting dead node D of L's tag, removed it (%v)", p, err)
		}
	}
	if isAdopted(a.e, deadID) {
		t.Errorf("A holds the adoption of dead node %s while node %s of its tag runs", deadID, liveID)
	}
	loadAndCompare(t, l.e, l.c, lkeys, [][]int{{16, 17, 18, 19}, {20, 21, 22, 23}}, want)
}

// TestClusterNeverRetiresADeadNodeWhoseFileItCouldNotRemove: node A
// adopts dead node D (one file) and deletes D's key, but the removal of
// D's file fails (EIO): the file stays on the mount, counted by A as a
// file left for an eviction to try again. A must not retire D while that
// file is there: retired, D has no summary, and once A restarts (its
// count of files left gone with it) the file is counted and removed by no
// node. Once a retry removes it, A retires D.
func TestClusterNeverRetiresADeadNodeWhoseFileItCouldNotRemove(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	var failRemove atomic.Bool
	a, clock := besideDeadNode(t, dir, 1, fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if op == fsys.OpRemove && failRemove.Load() && !strings.Contains(path, clustercap.DirName) && strings.HasSuffix(path, ".kv") {
			return fsys.Fault{Err: syscall.EIO}
		}
		return fsys.Fault{}
	}))
	tickPastDeadNode(ctx, t, a, clock)
	ns, err := a.Declare(ctx, smallGeometry(true))
	if err != nil {
		t.Fatal(err)
	}
	files := kvFiles(t, dir)
	if len(files) != 1 {
		t.Fatalf("%d data files of D's one store: %v", len(files), files)
	}
	failRemove.Store(true)
	if _, err := a.Delete(ctx, ns, testKeys("d", 1)); err != nil {
		t.Logf("delete of D's key with its removal failing: %v", err)
	}
	wantRetiredOnceItsFileIsGone(t, a, dir, files[0], func() { failRemove.Store(false) })
}

// TestClusterNeverRetiresADeadNodeWhileARemovalOfItsFileIsUnderWay: node
// A adopts dead node D (one file), and an eviction of A's (local
// capacity) drops D's file from the index and removes it; the removal is
// held in flight, the file neither indexed nor yet on the list of files
// whose removal failed. A's tick meanwhile must not retire D: the removal
// then fails (EIO), and retired, D has no summary; once A restarts the
// file is counted and removed by no node. Once a retry removes the file,
// A retires D.
func TestClusterNeverRetiresADeadNodeWhileARemovalOfItsFileIsUnderWay(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	hold := newHeldRemoval(dir)
	a, clock := besideDeadNode(t, dir, 1, hold)
	m := tickPastDeadNode(ctx, t, a, clock)
	files := kvFiles(t, dir)
	if len(files) != 1 {
		t.Fatalf("%d data files of D's one store: %v", len(files), files)
	}
	evictErr := hold.retireNoneWhile(t, a, files[0], "an eviction", func() (err error) {
		m.withEvictLock(func() {
			_, err = a.capacity.evict(ctx, m, 1<<40) // room for more than the mount holds: every victim
		})
		return err
	})
	if evictErr != nil {
		t.Logf("eviction with the removal of D's file failing: %v", evictErr)
	}
	wantRetiredOnceItsFileIsGone(t, a, dir, files[0], nil)
}

// TestClusterNeverRetiresADeadNodeWhileAMoveRemovesItsFile: node A, with
// the cluster mount and a local one, adopts dead node D (one file) and
// moves D's file to the local mount (a demotion); the removal of the
// source is held in flight, the copy indexed in its place, the source
// neither indexed nor on the list of files whose removal failed. A's
// tick meanwhile must not retire D: the removal then fails (EIO), and
// retired, D has no summary; once A restarts, the file is counted and
// removed by no node. A move's removal of its source is the removal of
// a dropped file, tracked as an eviction's is. Once a retry removes the
// file, A retires D.
func TestClusterNeverRetiresADeadNodeWhileAMoveRemovesItsFile(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	hold := newHeldRemoval(dir)
	a, clock := besideDeadNode(t, dir, 1, hold, Mount{Path: t.TempDir()})
	tickPastDeadNode(ctx, t, a, clock)
	ens := entriesOf(a, "d")
	if len(ens) != 1 {
		t.Fatalf("A adopted D with %d of D's files indexed, want 1", len(ens))
	}
	files := kvFiles(t, dir)
	if len(files) != 1 {
		t.Fatalf("%d data files of D's one store: %v", len(files), files)
	}
	err := hold.retireNoneWhile(t, a, files[0], "a move", func() error {
		_, err := a.tier.move(ctx, ens[0].ID, 1, false)
		return err
	})
	if err != nil {
		t.Fatalf("the move, its source's removal failing: %v (the copy is indexed: want it moved)", err)
	}
	wantRetiredOnceItsFileIsGone(t, a, dir, files[0], nil)
}

// wantRetiredOnceItsFileIsGone checks that node A, whose removal of dead
// node D's file (at file, on A's mount 0, dir) failed, keeps D while the
// file is on the mount, and retires D at its first read after a retry
// removed it; fix, if not nil, mends the failure before the retry.
func wantRetiredOnceItsFileIsGone(t *testing.T, a *Engine, dir, file string, fix func()) {
	t.Helper()
	ctx := context.Background()
	m := a.mounts[0]
	if _, err := os.Stat(file); err != nil {
		t.Fatalf("D's file is gone though its removal failed: %v", err)
	}
	m.cluster.Tick(ctx)
	if left := clusterFiles(dir, "d"); len(left) != 3 || !isAdopted(a, "d") {
		t.Fatalf("D's file %s is still on the mount, yet A retired D: D's cluster files %v, adopted %v", file, left, isAdopted(a, "d"))
	}
	if fix != nil {
		fix()
	}
	a.rm.retryLeft(m)
	if _, err := os.Stat(file); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("D's file after A's retry: %v, want gone", err)
	}
	m.cluster.Tick(ctx)
	if left := clusterFiles(dir, "d"); len(left) > 0 || isAdopted(a, "d") {
		t.Fatalf("D has no file left on the mount, yet %v stay and A holds its adoption: %v", left, isAdopted(a, "d"))
	}
}

// heldRemoval holds the first removal of a data file under dir made once
// armed (retireNoneWhile) until the test releases it, then fails it
// (EIO).
type heldRemoval struct {
	dir         string
	armed, held atomic.Bool
	release     chan struct{}
}

func newHeldRemoval(dir string) *heldRemoval {
	return &heldRemoval{dir: dir, release: make(chan struct{})}
}

func (h *heldRemoval) Inject(op fsys.Op, path string) fsys.Fault {
	if op == fsys.OpRemove && strings.HasPrefix(path, h.dir) && !strings.Contains(path, clustercap.DirName) && strings.HasSuffix(path, ".kv") && h.armed.CompareAndSwap(true, false) {
		h.held.Store(true)
		<-h.release
		return fsys.Fault{Err: syscall.EIO}
	}
	return fsys.Fault{}
}

// retireNoneWhile runs op (what), which removes dead node D's file (at
// file, on A's mount 0), holds that removal and checks that A's read of
// the cluster directory meanwhile retires not D; then it lets the removal
// fail and returns op's error.
func (h *heldRemoval) retireNoneWhile(t *testing.T, a *Engine, file, what string, op func() error) error {
	t.Helper()
	m := a.mounts[0]
	h.armed.Store(true)
	done := make(chan error, 1)
	go func() { done <- op() }()
	var err error
	finish := sync.OnceFunc(func() { close(h.release); err = <-done })
	defer finish() // a failing check leaves no removal held
	testwait.Until(t, what+"'s removal of D's file to be held", testwait.Hang, h.held.Load)
	m.cluster.Tick(context.Background())
	if left := clusterFiles(h.dir, "d"); len(left) != 3 || !isAdopted(a, "d") {
		t.Fatalf("%s's removal of D's file %s is under way, yet A retired D: D's cluster files %v, adopted %v", what, file, left, isAdopted(a, "d"))
	}
	finish() // the removal goes on, and fails
	return err
}
