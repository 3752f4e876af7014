//go:build invariants

package engine

import (
	"context"
	"encoding/json"
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

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/fsys/fsystest"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/clustercap"
	"github.com/kvhost/kvhost/internal/engine/cluster"
	"github.com/kvhost/kvhost/internal/testwait"
)

// clusterNode opens an engine as node id on dir with a cluster capacity
// of capacity bytes, publishing every interval.
func clusterNode(t *testing.T, dir, id string, capacity int64, interval time.Duration) *node {
	t.Helper()
	return clusterNodeAt(t, dir, id, capacity, interval, nil)
}

// clusterNodeAt is clusterNode with the engine's clock now (Config.Now;
// nil: the wall clock).
func clusterNodeAt(t *testing.T, dir, id string, capacity int64, interval time.Duration, now func() time.Time) *node {
	t.Helper()
	return clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: capacity, ClusterInterval: interval}}, NodeID: id, Now: now})
}

// clusterNodeOf opens an engine with cfg and the test policy, and
// declares a namespace and a cache of smallGeometry on it.
func clusterNodeOf(t *testing.T, cfg Config) *node {
	t.Helper()
	cfg.Policy = newTestPolicy(1, abi.OrderLayerMajor)
	e := openEngine(t, cfg)
	g := smallGeometry(true)
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	return &node{e: e, ns: ns, c: newTestCache(t, e, ns, g, 64, layoutPlaneFirst)}
}

// kvFiles lists the data files under dir, not the cluster's summaries and
// locks.
func kvFiles(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	for _, p := range dataFiles(t, dir) {
		if !strings.Contains(p, "/"+clustercap.DirName+"/") {
			out = append(out, p)
		}
	}
	return out
}

// diskBytes is the bytes of the data files under dir (not the cluster's
// summaries and locks).
func diskBytes(t *testing.T, dir string) int64 {
	t.Helper()
	var n int64
	for _, p := range kvFiles(t, dir) {
		if fi, err := os.Stat(p); err == nil {
			n += fi.Size()
		}
	}
	return n
}

// TestClusterCapacityBoundsTheMountAndKeepsAnotherLiveNodesFiles has a
// busy node store far past a cluster capacity of 8 files beside an idle
// node whose 2 files are the oldest (and that never publishes again): the
// files on the mount never pass the capacity, and the idle node's files,
// which the busy node has indexed, stay — the busy node evicts its own.
func TestClusterCapacityBoundsTheMountAndKeepsAnotherLiveNodesFiles(t *testing.T) {
	ctx := context.Background()
	probe := openNode(t, t.TempDir(), "probe", nil, 1)
	storeAndCheck(t, probe.e, probe.c, testKeys("p", 1), [][]int{{0, 1, 2, 3}})
	fileSize := probe.e.Stats().Mounts[0].Used
	capacity := 8 * fileSize

	dir := t.TempDir()
	idle := clusterNode(t, dir, "idle", capacity, time.Hour)
	busy := clusterNode(t, dir, "busy", capacity, 20*time.Millisecond)
	r := rand.New(rand.NewPCG(36, 36))
	idleKeys := testKeys("idle", 2)
	for i, k := range idleKeys {
		bl := []int{4 * i, 4*i + 1, 4*i + 2, 4*i + 3}
		idle.c.fill(r, bl)
		storeAndCheck(t, idle.e, idle.c, [][]byte{k}, [][]int{bl})
	}
	if n, _ := busy.e.Lookup(ctx, busy.ns, idleKeys[:1]); n != 1 {
		t.Fatalf("the busy node does not find the idle node's file: lookup %d", n)
	}
	for i := range 24 {
		bl := []int{4 * (i % 16), 4*(i%16) + 1, 4*(i%16) + 2, 4*(i%16) + 3}
		busy.c.fill(r, bl)
		storeAndCheck(t, busy.e, busy.c, testKeys("busy"+string(rune('a'+i)), 1), [][]int{bl})
		if got := diskBytes(t, dir); got > capacity {
			t.Fatalf("after store %d: %d bytes of files on the mount, over the cluster capacity of %d", i, got, capacity)
		}
	}
	for _, k := range idleKeys {
		if n, _ := idle.e.Lookup(ctx, idle.ns, [][]byte{k}); n != 1 {
			t.Fatalf("the idle node's key %s is gone: another node removed a live node's file", k)
		}
	}
	if ev := busy.e.Stats().Evictions; ev < 24-6 {
		t.Fatalf("busy node evicted %d files, want at least %d of its own", ev, 24-6)
	}
}

// TestClusterNodesOfOneTagStartedAtOnceRemoveNoneOfEachOthersFiles: two
// node ids of one owner tag start at once (each checks the directory
// before the other's first summary is there, so neither start refuses).
// The idle one stores 2 files; the busy one finds them and stores far
// past a bound of 8 files. It cannot tell the idle node's files from its
// own: it must remove none of them, its stores failing for room instead,
// and the files on the mount stay within the bound.
func TestClusterNodesOfOneTagStartedAtOnceRemoveNoneOfEachOthersFiles(t *testing.T) {
	ctx := context.Background()
	capacity := 8 * oneFileBytes(t)
	dir := t.TempDir()
	busy, idle := twinNodes(t, Mount{Path: dir, ClusterCapacity: capacity, ClusterInterval: 20 * time.Millisecond})
	r := rand.New(rand.NewPCG(41, 41))
	idleKeys := storeKeys(t, idle, "idle", 2, r)
	idleFiles := kvFiles(t, dir)
	if len(idleFiles) != 2 {
		t.Fatalf("%d data files after the idle node's 2 stores: %v", len(idleFiles), idleFiles)
	}
	if n, _ := busy.e.Lookup(ctx, busy.ns, idleKeys); n != 2 {
		t.Fatalf("the busy node finds %d of the idle node's 2 files", n)
	}
	for i := range 24 {
		bl := []int{4 * (i % 16), 4*(i%16) + 1, 4*(i%16) + 2, 4*(i%16) + 3}
		busy.c.fill(r, bl)
		res := wait(t)(busy.e.Store(ctx, StoreRequest{Cache: busy.c.id, Keys: testKeys(fmt.Sprintf("busy%02d", i), 1), Blocks: [][]int{bl}}))
		if kr := res.Keys[0]; kr.Outcome != OutcomeStored && (kr.Outcome != OutcomeFailed || !errors.Is(kr.Err, ErrNoSpace)) {
			t.Fatalf("busy node's store %d: %v, %v; want stored or refused for room", i, kr.Outcome, kr.Err)
		}
		if got := diskBytes(t, dir); got > capacity {
			t.Fatalf("after store %d: %d bytes of files on the mount, over the cluster capacity of %d", i, got, capacity)
		}
	}
	for _, f := range idleFiles {
		if _, err := os.Stat(f); err != nil {
			t.Errorf("the idle node's file %s is gone: the busy node of its tag removed it (%v)", f, err)
		}
	}
}

// twinNodes opens two nodes of one owner tag on mnt at once: the busy
// one on mnt, and, during its start (before its first summary is there,
// so that neither start refuses), the idle one, with mnt's cluster
// capacity and an hour's interval.
func twinNodes(t *testing.T, mnt Mount) (busy, idle *node) {
	t.Helper()
	const busyID, idleID = "node32659", "node41684"
	if clustercap.Tag(busyID) != clustercap.Tag(idleID) {
		t.Fatalf("node ids %s and %s: tags %#x and %#x, want one", busyID, idleID, clustercap.Tag(busyID), clustercap.Tag(idleID))
	}
	var once sync.Once
	idleStarts := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if op == fsys.OpRename && strings.HasSuffix(path, "/"+busyID+".summary") {
			once.Do(func() { idle = clusterNode(t, mnt.Path, idleID, mnt.ClusterCapacity, time.Hour) })
		}
		return fsys.Fault{}
	})
	busy = clusterNodeOf(t, Config{Mounts: []Mount{mnt}, NodeID: busyID, FS: &fsys.Faulty{FS: fsys.OS{}, Inj: idleStarts}})
	if idle == nil {
		t.Fatal("the idle node did not start during the busy node's start")
	}
	return busy, idle
}

// TestAStoreRefusedForLocalRoomBesideATwinNamesIt: two nodes of one owner
// tag run (twinNodes); the busy one indexes the idle one's 2 files and
// stores past its mount's own capacity of 4 files. It may evict none of
// the tag's files, so its stores fail for room, and the error names the
// other node, whose node_id the operator must change.
func TestAStoreRefusedForLocalRoomBesideATwinNamesIt(t *testing.T) {
	ctx := context.Background()
	fileBytes := oneFileBytes(t)
	busy, idle := twinNodes(t, Mount{Path: t.TempDir(), Capacity: 4 * fileBytes, ClusterCapacity: 1 << 30, ClusterInterval: 20 * time.Millisecond})
	r := rand.New(rand.NewPCG(43, 43))
	idleKeys := storeKeys(t, idle, "idle", 2, r)
	if n, _ := busy.e.Lookup(ctx, busy.ns, idleKeys); n != 2 {
		t.Fatalf("the busy node finds %d of the idle node's 2 files", n)
	}
	testwait.Until(t, "the busy node finding its twin", testwait.Hang, busy.e.mounts[0].cluster.Twinned)
	for i := range 8 {
		bl := []int{4 * (i % 16), 4*(i%16) + 1, 4*(i%16) + 2, 4*(i%16) + 3}
		busy.c.fill(r, bl)
		res := wait(t)(busy.e.Store(ctx, StoreRequest{Cache: busy.c.id, Keys: testKeys(fmt.Sprintf("busy%02d", i), 1), Blocks: [][]int{bl}}))
		kr := res.Keys[0]
		if kr.Outcome == OutcomeStored {
			continue
		}
		if !errors.Is(kr.Err, ErrNoSpace) || !strings.Contains(kr.Err.Error(), idle.e.own.node) {
			t.Fatalf("busy node's store %d beside its twin %s, its mount full: %v, %v; want ErrNoSpace naming the twin", i, idle.e.own.node, kr.Outcome, kr.Err)
		}
		return
	}
	t.Fatal("the busy node stored 8 files on a mount of 4 files' capacity, 2 of them its twin's")
}

// rankingPolicy is testPolicy with abi.FeatureRank: an entry ranks by its
// last access, plus 2^60 for the keys in keep (the policy wants them
// kept, whatever their age).
type rankingPolicy struct {
	*testPolicy
	keep  map[uint64]bool // key hashes
	calls atomic.Int64
}

func (p *rankingPolicy) Features() abi.Feature { return p.testPolicy.Features() | abi.FeatureRank }

func (p *rankingPolicy) Rank(_ context.Context, recs []abi.RankRecord) error {
	p.calls.Add(1)
	p.mu.Lock()
	defer p.mu.Unlock()
	for i := range recs {
		e := p.entries[recs[i].Entry]
		if e == nil {
			recs[i].State = abi.RankUnknown
			continue
		}
		recs[i].Rank, recs[i].State = e.Time, abi.RankKnown
		if p.keep[e.KeyHash] {
			recs[i].Rank += 1 << 60
		}
	}
	return nil
}

// TestClusterEvictionFollowsThePolicysRank: node A stores P, then Q; node
// B then stores until the cluster passes its bound and A evicts. With a
// policy that ranks P above everything (abi.FeatureRank), A evicts Q and
// keeps P, although P is the oldest file on the mount; with the same
// policy without the feature, ranks are last accesses and P goes first.
func TestClusterEvictionFollowsThePolicysRank(t *testing.T) {
	probe := openNode(t, t.TempDir(), "probe", nil, 1)
	storeAndCheck(t, probe.e, probe.c, testKeys("p", 1), [][]int{{0, 1, 2, 3}})
	fileSize := probe.e.Stats().Mounts[0].Used
	capacity := 6 * fileSize
	p, q := []byte("keep-me"), []byte("evict-me")
	// The test runs A's ticks (an hour's interval: its ticker never
	// fires). A tick of A between P's store and Q's lowers A's claim to
	// its one file and a grant (0.15 files); Q's store then raises it to 3
	// files, and A's next tick lowers it to 2.15 files, where without that
	// tick it is 2. B may then hold 3 files, never 4: the cluster (5
	// files) never passes its high watermark (5.7), no node computes a
	// cut-off, and B makes its room by evicting its own files at its
	// claim while A keeps its 2 lower-ranked ones, however long the test
	// waits. On a loaded machine, with A's ticker every 100 ms, this
	// happened (B evicted 37 of its own files). So A ticks once after Q
	// (its summary ranks P and Q) and after each of B's stores (it reads
	// B's latest summary, with a cut-off once B's claim passes the bound).
	// The nodes share a clock (Config.Now) that moves a microsecond per
	// reading: summaries and cuts age by the engines' work, not by how
	// slowly the machine runs them, and ranks follow the order of the
	// accesses.
	tests := []struct {
		name  string
		rank  bool
		keepP bool
	}{
		{"the policy ranks P above the rest", true, true},
		{"no FeatureRank: last access ranks P lowest", false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			dir := t.TempDir()
			var mu sync.Mutex
			now := time.Now()
			clock := func() time.Time {
				mu.Lock()
				defer mu.Unlock()
				now = now.Add(time.Microsecond)
				return now
			}
			tp := newTestPolicy(1, abi.OrderLayerMajor)
			rp := &rankingPolicy{testPolicy: tp, keep: map[uint64]bool{abi.KeyHash(p): true}}
			var pol policy.Policy = tp
			if tt.rank {
				pol = rp
			}
			ea := openEngine(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: capacity, ClusterInterval: time.Hour}},
				Policy: pol, NodeID: "a", Now: clock})
			g := smallGeometry(true)
			ns, err := ea.Declare(ctx, g)
			if err != nil {
				t.Fatal(err)
			}
			a := &node{e: ea, ns: ns, c: newTestCache(t, ea, ns, g, 64, layoutPlaneFirst)}
			m := a.e.mounts[0]
			tickA := func() { m.cluster.Tick(ctx) }
			b := clusterNodeAt(t, dir, "b", capacity, 100*time.Millisecond, clock)
			r := rand.New(rand.NewPCG(37, 37))
			for i, k := range [][]byte{p, q} {
				bl := []int{4 * i, 4*i + 1, 4*i + 2, 4*i + 3}
				a.c.fill(r, bl)
				storeAndCheck(t, a.e, a.c, [][]byte{k}, [][]int{bl})
			}
			tickA()
			if got := publishedBytes(a.e); got != 2*fileSize {
				t.Fatalf("node A's summary ranks %d bytes after its tick, want P's and Q's %d", got, 2*fileSize)
			}
			for i := 0; i < 40 && a.e.Stats().Evictions == 0; i++ {
				bl := []int{4 * (i % 16), 4*(i%16) + 1, 4*(i%16) + 2, 4*(i%16) + 3}
				b.c.fill(r, bl)
				storeAndCheck(t, b.e, b.c, testKeys(fmt.Sprintf("b%02d", i), 1), [][]int{bl})
				tickA()
			}
			if a.e.Stats().Evictions == 0 {
				t.Fatalf("node A evicted nothing after node B's 40 stores against a bound of 6 files (B evicted %d of its own)", b.e.Stats().Evictions)
			}
			hitP, _ := a.e.Lookup(ctx, a.ns, [][]byte{p})
			hitQ, _ := a.e.Lookup(ctx, a.ns, [][]byte{q})
			if got := hitP == 1; got != tt.keepP {
				t.Errorf("P kept: %v, want %v (Q kept: %v)", got, tt.keepP, hitQ == 1)
			}
			if tt.rank && hitQ == 1 {
				t.Errorf("A evicted a file but Q, the file its policy ranks lowest, is still there")
			}
			if tt.rank && rp.calls.Load() == 0 {
				t.Errorf("the policy's Rank was never called")
			}
		})
	}
}

// publishedBytes is the bytes of the files that e's last published summary
// ranks on its first mount (its sketch).
func publishedBytes(e *Engine) int64 {
	return e.mounts[0].cluster.Inspect().Sketch.Total()
}

// TestClusterAdoptsADeadNodesFiles: node D stores 3 files after node A
// started (A's index has none of them) and stops. Once D's summary is
// stale and its lock free, A takes D's adoption lock and indexes D's
// files; A's stores then push the cluster past its bound and A evicts
// D's files (the oldest) along with its own, the files on the mount never
// passing the bound. Without adoption D's files would stay, uncounted.
func TestClusterAdoptsADeadNodesFiles(t *testing.T) {
	ctx := context.Background()
	probe := openNode(t, t.TempDir(), "probe", nil, 1)
	storeAndCheck(t, probe.e, probe.c, testKeys("p", 1), [][]int{{0, 1, 2, 3}})
	fileSize := probe.e.Stats().Mounts[0].Used
	capacity := 8 * fileSize

	dir := t.TempDir()
	a := clusterNode(t, dir, "a", capacity, 20*time.Millisecond)
	d := clusterNode(t, dir, "d", capacity, 20*time.Millisecond)
	r := rand.New(rand.NewPCG(38, 38))
	for i, k := range testKeys("dead", 3) {
		bl := []int{4 * i, 4*i + 1, 4*i + 2, 4*i + 3}
		d.c.fill(r, bl)
		storeAndCheck(t, d.e, d.c, [][]byte{k}, [][]int{bl})
	}
	deadFiles := kvFiles(t, dir)
	if len(deadFiles) != 3 {
		t.Fatalf("%d data files after node D's 3 stores: %v", len(deadFiles), deadFiles)
	}
	if err := d.e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	m := a.e.mounts[0]
	adopted := func() bool { return m.cluster.Inspect().Dead[clustercap.Tag("d")] }
	testwait.Until(t, "node A adopting node D after D's stop", testwait.Hang, adopted)
	if got := a.e.Stats().Mounts[0].Entries; got < 3 {
		t.Fatalf("node A indexes %d files after adopting D, want D's 3", got)
	}
	for i := range 12 {
		bl := []int{4 * (i % 16), 4*(i%16) + 1, 4*(i%16) + 2, 4*(i%16) + 3}
		a.c.fill(r, bl)
		storeAndCheck(t, a.e, a.c, testKeys(fmt.Sprintf("a%02d", i), 1), [][]int{bl})
		if got := diskBytes(t, dir); got > capacity {
			t.Fatalf("after A's store %d: %d bytes of files on the mount, over the cluster capacity of %d", i, got, capacity)
		}
	}
	for _, p := range deadFiles {
		if _, err := os.Stat(p); err == nil {
			t.Errorf("dead node D's file %s is still on the mount after A's 12 stores against a bound of 8 files", p)
		}
	}
}

// TestClusterNeverEvictsTheFilesOfALiveNodeWhoseFlockItCannotSee: nodes
// L and A share a mount whose flocks stay on each node (an NFS mount with
// local_lock=flock: fsystest.LocalLocks), so A's probe of L's lock always
// finds it free. L runs, but its summary stops coming for more than three
// intervals (A's clock runs 4 intervals on: a publication that stalls on
// the shared file system). A must not take L for dead on a lock it cannot
// see: its stores past the bound must evict its own files, never L's,
// whose acknowledged keys still load on L byte for byte. A's probes of L's
// lock while L runs find it free, and A says once that flocks do not
// reach between them.
func TestClusterNeverEvictsTheFilesOfALiveNodeWhoseFlockItCannotSee(t *testing.T) {
	ctx := context.Background()
	capacity := 8 * oneFileBytes(t)
	dir := t.TempDir()
	clock := newTestClock()
	mnt := []Mount{{Path: dir, ClusterCapacity: capacity, ClusterInterval: time.Hour}}
	log, unshared := countingLogger(t, "flocks do not reach between the two nodes")
	a := clusterNodeOf(t, Config{Mounts: mnt, NodeID: "a", Now: clock.now, FS: fsystest.NewLocalLocks(fsys.OS{}), Logger: log})
	l := clusterNodeOf(t, Config{Mounts: mnt, NodeID: "l", FS: fsystest.NewLocalLocks(fsys.OS{})})
	r := rand.New(rand.NewPCG(39, 39))
	keys := storeKeys(t, l, "live", 3, r)
	blocks := [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}}
	want := make([][]byte, len(keys))
	for i, b := range blocks {
		want[i] = l.c.data(b)
	}
	m, lm := a.e.mounts[0], l.e.mounts[0]
	for range cluster.UnsharedProbes + 1 { // L runs: its summary fresh and growing
		lm.cluster.Tick(ctx)
		m.cluster.Tick(ctx)
	}
	if n := unshared.Load(); n != 1 {
		t.Errorf("A found L's lock free at %d reads while L ran: said %d times that flocks are not shared, want once", cluster.UnsharedProbes+1, n)
	}
	clock.advance(4 * time.Hour) // L's summary stalls, as A sees it
	m.cluster.Tick(ctx)
	storeKeys(t, a, "a", 12, r)
	if left := clusterFiles(dir, "l"); isAdopted(a.e, "l") || len(left) != 2 {
		t.Errorf("L's summary stalled: A holds L's adoption: %v; L's cluster files left: %v, want its summary and lock", isAdopted(a.e, "l"), left)
	}
	loadAndCompare(t, l.e, l.c, keys, [][]int{{16, 17, 18, 19}, {20, 21, 22, 23}, {24, 25, 26, 27}}, want)
}

// TestClusterANodeWhoseLockFileIsRemovedWhileItRunsLocksItAgain: node
// X's lock file leaves the cluster directory while X runs (another node
// took X for dead and retired it: X's NFS lease lapsed in a partition, its
// lock with it). X's next tick must lock the file at its lock path again:
// otherwise every later probe finds X's lock free, a stall of its
// summary has X adopted again, and a second copy of X may start beside it.
func TestClusterANodeWhoseLockFileIsRemovedWhileItRunsLocksItAgain(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	x := clusterNode(t, dir, "x", 1<<30, time.Hour)
	if err := os.Remove(filepath.Join(dir, clustercap.DirName, "x.lock")); err != nil {
		t.Fatal(err)
	}
	m := x.e.mounts[0]
	m.cluster.Tick(ctx)
	probe, err := clustercap.OpenDir(fsys.OS{}, dir, "probe")
	if err != nil {
		t.Fatal(err)
	}
	defer probe.Close()
	if free, err := probe.LockFree("x"); err != nil || free {
		t.Fatalf("node X runs, its lock file removed before its tick: another node's probe finds its lock free: %v, %v", free, err)
	}
}

// TestClusterANodeWhoseLockAnotherCopyTookRemovesNoneOfItsFiles: node X's
// lock file is removed while X runs, and a second copy of X takes the new
// one (two engines of one node id on the mount, which X's lock was to
// prevent). X's next tick finds its lock held by another process: like a
// node beside a twin of its owner tag, it removes none of the tag's files,
// which it cannot tell from the copy's; once the copy stops, X locks the
// file again and evicts as before.
func TestClusterANodeWhoseLockAnotherCopyTookRemovesNoneOfItsFiles(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	x := clusterNode(t, dir, "x", 1<<30, time.Hour)
	if err := os.Remove(filepath.Join(dir, clustercap.DirName, "x.lock")); err != nil {
		t.Fatal(err)
	}
	copyOfX, err := clustercap.OpenDir(fsys.OS{}, dir, "x")
	if err != nil {
		t.Fatal(err)
	}
	m := x.e.mounts[0]
	m.cluster.Tick(ctx)
	if !m.cluster.Twinned() {
		t.Fatalf("another copy of node X holds X's lock: X still removes files of its owner tag")
	}
	if err := copyOfX.Close(); err != nil {
		t.Fatal(err)
	}
	m.cluster.Tick(ctx)
	if m.cluster.Twinned() {
		t.Fatalf("the other copy of X stopped: X still removes none of its files")
	}
}

// TestAStoreRefusedForRoomOnAClusterMountGivesItsClusterGrantBack: a
// store that the cluster's bound admits but that finds no room on the
// mount itself (its one file pinned) fails with ErrNoSpace, and leaves the
// node's count of its bytes there as it was.
func TestAStoreRefusedForRoomOnAClusterMountGivesItsClusterGrantBack(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := 4096 + g.KeyBytes()
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir(), Capacity: fileLen + fileLen/2, ClusterCapacity: 100 * fileLen, ClusterInterval: time.Hour}},
		Policy: newTestPolicy(1, abi.OrderLayerMajor), NodeID: "a"})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	keys := testKeys("pinned", 2)
	storeAndCheck(t, e, c, keys[:1], [][]int{{0, 1, 2, 3}})
	id, _, err := e.Pin(ctx, ns, keys[:1], 0)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Unpin(ctx, id)
	before := ownBytes(e.mounts[0])
	res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys[1:], Blocks: [][]int{{4, 5, 6, 7}}}))
	if kr := res.Keys[0]; kr.Outcome != OutcomeFailed || !errors.Is(kr.Err, ErrNoSpace) {
		t.Fatalf("store beside a pinned file filling the mount: %v, %v; want failed, ErrNoSpace", kr.Outcome, kr.Err)
	}
	if after := ownBytes(e.mounts[0]); after != before {
		t.Fatalf("after a store refused for room, the node counts %d bytes of its own on the cluster mount, %d before", after, before)
	}
}

// testClock is a clock for Config.Now that moves only when told.
type testClock struct {
	mu sync.Mutex
	t  time.Time
}

func newTestClock() *testClock { return &testClock{t: time.Now()} }

func (c *testClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *testClock) advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// oneFileBytes is the bytes one key of smallGeometry takes on a mount.
func oneFileBytes(t *testing.T) int64 {
	t.Helper()
	probe := openNode(t, t.TempDir(), "probe", nil, 1)
	storeAndCheck(t, probe.e, probe.c, testKeys("p", 1), [][]int{{0, 1, 2, 3}})
	return probe.e.Stats().Mounts[0].Used
}

// storeKeys stores one key per file on n: keys prefix-0000 and on, with
// blocks of their own.
func storeKeys(t *testing.T, n *node, prefix string, count int, r *rand.Rand) [][]byte {
	t.Helper()
	keys := testKeys(prefix, count)
	for i, k := range keys {
		bl := []int{4 * (i % 16), 4*(i%16) + 1, 4*(i%16) + 2, 4*(i%16) + 3}
		n.c.fill(r, bl)
		storeAndCheck(t, n.e, n.c, [][]byte{k}, [][]int{bl})
	}
	return keys
}

// isAdopted reports whether e holds the adoption of node on its first
// mount.
func isAdopted(e *Engine, node string) bool {
	return e.mounts[0].cluster.Inspect().Dead[clustercap.Tag(node)]
}

// tickPastDeadBound moves a's clock 4 hours on, past the dead-node bound
// of the nodes that stopped (their summaries stale at
// clustercap.StaleIntervals of their hour-long intervals), and runs a's
// cluster tick on its first mount, which it returns. It checks nothing:
// tickPastDeadNode checks that a adopted D.
func tickPastDeadBound(ctx context.Context, a *Engine, clock *testClock) *mount {
	clock.advance(4 * time.Hour) // D's summary: stale
	m := a.mounts[0]
	m.cluster.Tick(ctx)
	return m
}

// tickPastDeadNode is tickPastDeadBound, failing t unless a adopted dead
// node D.
func tickPastDeadNode(ctx context.Context, t *testing.T, a *Engine, clock *testClock) *mount {
	t.Helper()
	m := tickPastDeadBound(ctx, a, clock)
	if !isAdopted(a, "d") {
		t.Fatal("A did not adopt dead node D")
	}
	return m
}

// adoptableDeadNode starts node A on a test clock and node D on dir (each
// of capacity bytes, interval an hour), has D store count keys (prefix
// "d", from r) and close: A's first tick past the dead-node bound
// (tickPastDeadNode) adopts D. It returns A, its clock and D's keys.
func adoptableDeadNode(t *testing.T, dir string, capacity int64, count int, r *rand.Rand) (*node, *testClock, [][]byte) {
	t.Helper()
	clock := newTestClock()
	a := clusterNodeAt(t, dir, "a", capacity, time.Hour, clock.now)
	d := clusterNode(t, dir, "d", capacity, time.Hour)
	keys := storeKeys(t, d, "d", count, r)
	if err := d.e.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	return a, clock, keys
}

// TestClusterTickLeavesTheFilesOfANodeItFindsLiveAgain: node A adopted
// dead node D (3 files). D runs again (its lock held, a fresh summary
// counting its 3 files). A's next tick must take D's files for D's: the
// cluster then holds 6 files against a bound of 5, and A's cut-off must
// not remove any of D's.
func TestClusterTickLeavesTheFilesOfANodeItFindsLiveAgain(t *testing.T) {
	ctx := context.Background()
	fileSize := oneFileBytes(t)
	capacity := 5 * fileSize
	dir := t.TempDir()
	a, clock, _ := adoptableDeadNode(t, dir, capacity, 3, rand.New(rand.NewPCG(11, 11)))
	files := dataFiles(t, dir)
	m := tickPastDeadNode(ctx, t, a.e, clock)
	if n := a.e.Stats().Mounts[0].Entries; n != 3 {
		t.Fatalf("A adopted D with %d entries indexed, want D's 3", n)
	}
	// D runs again: its lock, a fresh summary of its 3 files.
	dd, err := clustercap.OpenDir(fsys.OS{}, dir, "d")
	if err != nil {
		t.Fatal(err)
	}
	defer dd.Close()
	if err := dd.Publish(&clustercap.Summary{Version: clustercap.SummaryVersion, Node: "d", Tag: clustercap.Tag("d"), Seq: 100,
		Time: time.Now().UnixNano(), Interval: int64(time.Hour), Bytes: 3 * fileSize, Claim: 3 * fileSize}); err != nil {
		t.Fatal(err)
	}
	m.cluster.Tick(ctx)
	for _, f := range files {
		if _, err := os.Stat(f); err != nil {
			t.Fatalf("A's tick, whose read found D live again, removed D's file %s", f)
		}
	}
	if got := ownBytes(m); got != 0 {
		t.Errorf("after D runs again A counts %d bytes of its own, want 0", got)
	}
}

// TestClusterCountsReservedAndGrantedBytesOnceEach: one store's grant is
// reserved on the mount's space (its file not indexed yet), another's is
// granted by the cluster but not yet reserved there. A tick in between
// counts both; and the second grant, given back after the tick, leaves
// the first counted.
func TestClusterCountsReservedAndGrantedBytesOnceEach(t *testing.T) {
	const s = 1 << 20
	tests := []struct {
		name     string
		giveBack bool // the second grant goes back after the tick
		want     int64
	}{
		{"both held", false, 2 * s},
		{"the granted one given back", true, s},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			n := clusterNode(t, t.TempDir(), "a", 1<<30, time.Hour)
			m := n.e.mounts[0]
			if err := n.e.capacity.reserveUsed(ctx, m, s); err != nil { // granted, reserved
				t.Fatal(err)
			}
			t.Cleanup(func() { n.e.capacity.unreserve(m, s) })
			if err := m.cluster.Reserve(ctx, s); err != nil { // granted only
				t.Fatal(err)
			}
			m.cluster.Tick(ctx)
			if tt.giveBack {
				m.cluster.GiveBack(s)
			} else {
				t.Cleanup(func() { m.cluster.GiveBack(s) })
			}
			if got := ownBytes(m); got != tt.want {
				t.Fatalf("the node counts %d bytes of its own, want %d", got, tt.want)
			}
		})
	}
}

// entriesOf lists e's entries on its first mount of node's files.
func entriesOf(e *Engine, node string) []*entry {
	var out []*entry
	e.ix.Files().Each(func(en *entry) {
		if o, ok := clustercap.Owner(en.FID); ok && o == clustercap.Tag(node) && en.Mount == 0 && !en.Marks().Gone {
			out = append(out, en)
		}
	})
	return out
}

// TestClusterAnAdopterThatCannotReadLetsGoOfTheNodesItAdopted: node A
// adopted dead node D; then A's reads of the cluster directory fail
// (ESTALE) and D starts again. A cannot tell whether D runs: from its
// first failed read it must neither count nor evict D's files, nor hold
// D's adoption.
func TestClusterAnAdopterThatCannotReadLetsGoOfTheNodesItAdopted(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	var fail atomic.Bool
	a, clock := besideDeadNode(t, dir, 1, fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if fail.Load() && op == fsys.OpReadDir && strings.HasSuffix(path, clustercap.DirName) {
			return fsys.Fault{Err: syscall.ESTALE}
		}
		return fsys.Fault{}
	}))
	m := tickPastDeadNode(ctx, t, a, clock)
	ens := entriesOf(a, "d")
	if len(ens) != 1 {
		t.Fatalf("A adopted D with %d of D's files indexed, want 1", len(ens))
	}
	fail.Store(true)
	clusterNode(t, dir, "d", 1<<30, time.Hour) // D runs again
	m.cluster.Tick(ctx)
	if m.mayEvict(ens[0]) || isAdopted(a, "d") || len(m.cluster.Dir().Adopted()) > 0 {
		t.Fatalf("A, its read failing, may still evict the file of D, which runs again (adoption lock held: %v)", m.cluster.Dir().Adopted())
	}
	if got := ownBytes(m); got != 0 {
		t.Errorf("A, its read failing, counts %d bytes of its own, want 0 (D's file is D's)", got)
	}
}

// besideDeadNode opens node A on dir (its mount 0; more: A's mounts after
// it), on a test clock and through a file system that injects inj's
// faults, and a node D (an hour's interval, as A's) that stores keys keys
// there and stops; A reads the cluster directory once while D runs,
// finding its lock held (flocks shared).
func besideDeadNode(t *testing.T, dir string, keys int, inj fsys.Injector, more ...Mount) (*Engine, *testClock) {
	t.Helper()
	clock := newTestClock()
	a := openEngine(t, Config{Mounts: append([]Mount{{Path: dir, ClusterCapacity: 1 << 30, ClusterInterval: time.Hour}}, more...),
		Policy: newTestPolicy(1, abi.OrderLayerMajor), NodeID: "a", FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}, Now: clock.now})
	d := clusterNode(t, dir, "d", 1<<30, time.Hour)
	storeKeys(t, d, "d", keys, rand.New(rand.NewPCG(uint64(keys), 9)))
	m := a.mounts[0]
	m.cluster.Tick(context.Background()) // A finds D's lock held while D runs: flocks shared
	if err := d.e.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	return a, clock
}

// deadNodeBesideAFailingWalk is besideDeadNode with 8 keys and A's reads
// of the mount's directories (its own and the cluster directory aside)
// failing with what fail returns.
func deadNodeBesideAFailingWalk(t *testing.T, fail func() error) (*Engine, *testClock) {
	t.Helper()
	dir := t.TempDir()
	a, clock := besideDeadNode(t, dir, 8, fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if op == fsys.OpReadDir && path != dir && !strings.Contains(path, clustercap.DirName) {
			if err := fail(); err != nil {
				return fsys.Fault{Err: err}
			}
		}
		return fsys.Fault{}
	}))
	return a, clock
}

// TestClusterAnAdoptionWalkCutShortIsDoneAgain: node A adopts dead node
// D (8 files); one directory read of A's walk of the mount fails
// (ESTALE, once). The walk goes on past that directory, and A's tick an
// interval later walks again: A then indexes all 8 of D's files.
func TestClusterAnAdoptionWalkCutShortIsDoneAgain(t *testing.T) {
	ctx := context.Background()
	var armed atomic.Bool
	a, clock := deadNodeBesideAFailingWalk(t, func() error {
		if armed.CompareAndSwap(true, false) {
			return syscall.ESTALE
		}
		return nil
	})
	armed.Store(true)
	m := tickPastDeadNode(ctx, t, a, clock)
	if armed.Load() {
		t.Fatal("A's first tick adopted D, but no directory read of its walk failed")
	}
	clock.advance(time.Hour) // one interval: the walk is due again
	m.cluster.Tick(ctx)
	if got := len(entriesOf(a, "d")); got != 8 {
		t.Fatalf("A adopted D (8 files on the mount) but indexes %d of them, a tick after one failed directory read of its walk", got)
	}
}

// TestClusterAWalkThatKeepsFailingIsPutOffLongerEachTime: a directory of
// the mount that stays unreadable does not cost a walk of the whole mount
// at every read: after each failed walk of an adopted node's files the
// next waits one interval, then twice as long each time; once the
// directory reads again, the due walk indexes every file.
func TestClusterAWalkThatKeepsFailingIsPutOffLongerEachTime(t *testing.T) {
	ctx := context.Background()
	var failing atomic.Bool
	var failed atomic.Int64
	a, clock := deadNodeBesideAFailingWalk(t, func() error {
		if failing.Load() {
			failed.Add(1)
			return syscall.EIO
		}
		return nil
	})
	failing.Store(true)
	m := tickPastDeadNode(ctx, t, a, clock)
	perWalk := failed.Load()
	if perWalk == 0 {
		t.Fatal("A's first tick adopted D, but no directory read of its walk failed")
	}
	for range 7 { // reads at 1..7 intervals: walks due at 1, 3 and 7
		clock.advance(time.Hour)
		m.cluster.Tick(ctx)
	}
	if walks := failed.Load() / perWalk; walks != 4 {
		t.Fatalf("8 reads an interval apart, a directory failing throughout: %d walks of the mount, want 4 (at 0, 1, 3 and 7 intervals)", walks)
	}
	failing.Store(false)
	for range 8 { // the next walk is due 8 intervals after the last
		clock.advance(time.Hour)
		m.cluster.Tick(ctx)
	}
	if got := len(entriesOf(a, "d")); got != 8 {
		t.Fatalf("the directory readable again: A indexes %d of D's 8 files after the due walk", got)
	}
}

// TestClusterReclaimsTheAbandonedTemporaryFilesOfADeadNode: node D dies
// with a store in flight, leaving its temporary file (its flock gone with
// the process). Node A adopts D: it keeps the file while it is younger
// than temp_grace (another node's store may still finish it) and removes
// it once it is older, without a daemon's start.
func TestClusterReclaimsTheAbandonedTemporaryFilesOfADeadNode(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	clock := newTestClock()
	a := clusterNodeAt(t, dir, "a", 1<<30, time.Hour, clock.now)
	d := clusterNode(t, dir, "d", 1<<30, time.Second)
	f, tmp, _, err := d.e.own.createTemp(d.e.mounts[0], dir, 0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	f.Close() // the process died: its flock went with it
	if err := d.e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	clock.advance(time.Minute) // D's summary: stale
	m := a.e.mounts[0]
	m.cluster.Tick(ctx)
	if !isAdopted(a.e, "d") {
		t.Fatal("A did not adopt D")
	}
	if _, err := os.Stat(tmp); err != nil {
		t.Fatalf("A removed dead node D's temporary file, younger than temp_grace: %v", err)
	}
	clock.advance(time.Hour)
	m.cluster.Tick(ctx)
	if _, err := os.Stat(tmp); err == nil {
		t.Fatalf("dead node D's abandoned temporary file, an hour past temp_grace, is still on the mount after A adopted D")
	}
}

// TestClusterAnotherNodesUseFromItsFutureCountsAsNow: node B, its clock
// an hour ahead of node A's, reports a use of A's file. A takes the use
// for an access at its own now, not an hour into its future (where the
// file would outrank every file used in that hour).
func TestClusterAnotherNodesUseFromItsFutureCountsAsNow(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	clock := newTestClock()
	a := clusterNodeAt(t, dir, "a", 1<<30, time.Hour, clock.now)
	storeKeys(t, a, "a", 1, rand.New(rand.NewPCG(5, 5)))
	en := entriesOf(a.e, "a")[0]
	b, err := clustercap.OpenDir(fsys.OS{}, dir, "b")
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	now := clock.now()
	use := clustercap.Touch{ID: en.FID, Time: now.Add(time.Hour).UnixNano(), Rank: 1}
	if err := b.Publish(&clustercap.Summary{Version: clustercap.SummaryVersion, Node: "b", Tag: clustercap.Tag("b"), Seq: 1,
		Time: now.Add(time.Hour).UnixNano(), Interval: int64(time.Hour), Touches: []clustercap.Touch{use}}); err != nil {
		t.Fatal(err)
	}
	m := a.e.mounts[0]
	m.cluster.Tick(ctx)
	var last int64
	a.e.ix.Inspect(func() { last = en.Marks().Last })
	if last > now.UnixNano() {
		t.Fatalf("A's file, used by B at B's clock an hour ahead, was last accessed %v after A's now", time.Duration(last-now.UnixNano()))
	}
}

// TestClusterAdoptsADeadNodeWhoseSummaryDoesNotDecode: node D stores 3
// files and dies, its summary left truncated (a crash while publishing),
// its lock free. Once the file is older than three of A's intervals, A
// adopts D and counts D's files as its own; while the file is younger, or
// while it cannot be read at all (D unknown), A leaves D alone.
func TestClusterAdoptsADeadNodeWhoseSummaryDoesNotDecode(t *testing.T) {
	tests := []struct {
		name       string
		age        time.Duration // the summary file's age on A's clock
		unreadable bool          // opening D's summary fails (EIO)
		adopted    bool
	}{
		{"stale", 4 * time.Hour, false, true},
		{"fresh", 0, false, false},
		{"stale but unreadable", 4 * time.Hour, true, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			dir := t.TempDir()
			sum := filepath.Join(dir, clustercap.DirName, "d.summary")
			var fail atomic.Bool
			fail.Store(tt.unreadable) // from the start: A never reads D's summary, none stands in
			a, clock := besideDeadNode(t, dir, 3, fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
				if op == fsys.OpOpen && path == sum && fail.Load() {
					return fsys.Fault{Err: syscall.EIO}
				}
				return fsys.Fault{}
			}))
			b, err := os.ReadFile(sum)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(sum, b[:len(b)/2], 0o644); err != nil { // truncated by the crash
				t.Fatal(err)
			}
			m := a.mounts[0]
			m.cluster.MarkShared("d") // as a read of D's summary while D ran would have found
			clock.advance(tt.age)
			m.cluster.Tick(ctx)
			if !tt.adopted {
				if isAdopted(a, "d") || len(m.cluster.Dir().Adopted()) > 0 {
					t.Fatalf("A adopted D, its summary %v old on A's clock (unreadable: %v)", tt.age, tt.unreadable)
				}
				return
			}
			if !isAdopted(a, "d") || len(entriesOf(a, "d")) != 3 {
				t.Fatalf("dead node D (summary truncated, lock free, file %v old) not adopted: adopted %v, %d of its 3 files indexed", tt.age, isAdopted(a, "d"), len(entriesOf(a, "d")))
			}
			if got, want := ownBytes(m), diskBytes(t, dir); got != want {
				t.Fatalf("A adopted D and counts %d bytes of its own, want the %d bytes of D's files on the mount", got, want)
			}
		})
	}
}

// clusterFiles lists the files of node left in dir's cluster directory:
// its summary, lock and adoption file.
func clusterFiles(dir, node string) []string {
	var left []string
	for _, s := range []string{".summary", ".lock", ".adopt"} {
		if _, err := os.Stat(filepath.Join(dir, clustercap.DirName, node+s)); err == nil {
			left = append(left, node+s)
		}
	}
	return left
}

// TestClusterRetiresADeadNodeWithNoFilesLeft: node A adopts dead node D
// (one file). While D's file stays, A keeps D; once it is gone, A's next
// tick retires D: D's summary, lock and adoption files leave the cluster
// directory and A holds no adoption.
func TestClusterRetiresADeadNodeWithNoFilesLeft(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	a, clock, keys := adoptableDeadNode(t, dir, 1<<30, 1, rand.New(rand.NewPCG(3, 3)))
	m := tickPastDeadBound(ctx, a.e, clock)
	m.cluster.Tick(ctx)
	if !isAdopted(a.e, "d") || len(clusterFiles(dir, "d")) != 3 {
		t.Fatalf("A, D's file still on the mount: adopted D %v, D's cluster files %v", isAdopted(a.e, "d"), clusterFiles(dir, "d"))
	}
	if n, err := a.e.Delete(ctx, a.ns, keys); err != nil || n != 1 {
		t.Fatalf("delete D's key on A: %d %v", n, err)
	}
	if got := diskBytes(t, dir); got != 0 {
		t.Fatalf("%d bytes left on the mount after deleting D's one key", got)
	}
	m.cluster.Tick(ctx)
	if left := clusterFiles(dir, "d"); len(left) > 0 || len(m.cluster.Dir().Adopted()) > 0 || isAdopted(a.e, "d") {
		t.Fatalf("dead node D has no file left on the mount, yet %v stay and A holds the adoption of %v", left, m.cluster.Dir().Adopted())
	}
}

// TestClusterAnAdopterRemovesADeadNodesFileShorterThanItsHeaderSays:
// dead node D's one file on the mount is cut short (its header whole,
// its payload not), as a crash of the file system may leave it. Node A
// adopts D: it must remove that file, corrupt and of a dead owner, or
// count it; never retire D and leave it on the mount, counted and removed
// by no node until some node's restart.
func TestClusterAnAdopterRemovesADeadNodesFileShorterThanItsHeaderSays(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	a, clock, _ := adoptableDeadNode(t, dir, 1<<30, 1, rand.New(rand.NewPCG(6, 6)))
	files := kvFiles(t, dir)
	if len(files) != 1 {
		t.Fatalf("%d data files after D's one store: %v", len(files), files)
	}
	fi, err := os.Stat(files[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(files[0], fi.Size()/2); err != nil {
		t.Fatal(err)
	}
	m := tickPastDeadBound(ctx, a.e, clock)
	m.cluster.Tick(ctx)
	if got, want := ownBytes(m), diskBytes(t, dir); got != want {
		t.Fatalf("dead node D's file cut short (%d bytes of files on the mount): adopter A counts %d bytes; A holds D's adoption: %v, D's cluster files left: %v",
			want, got, isAdopted(a.e, "d"), clusterFiles(dir, "d"))
	}
	if left := clusterFiles(dir, "d"); len(left) > 0 {
		t.Fatalf("D's corrupt file gone, yet D is not retired: %v stay", left)
	}
}

// TestClusterNeverRetiresADeadNodeWhoseFileACachedListingHid: node A's
// file system client caches directory listings (NFS mounted nocto, say),
// and A listed the mount at its start. Dead node D's last file went,
// through D's client, into a directory of that listing. A adopts D, and
// once D's other file is gone, its ticks must neither retire D nor leave
// that file uncounted: counted and removed by no node, it would hold
// room of the cluster's bound for good.
func TestClusterNeverRetiresADeadNodeWhoseFileACachedListingHid(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	r := rand.New(rand.NewPCG(4, 4))
	d := clusterNode(t, dir, "d", 1<<30, time.Hour)
	first := storeKeys(t, d, "d", 1, r)
	clock := newTestClock()
	a := clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: 1 << 30, ClusterInterval: time.Hour}},
		NodeID: "a", FS: fsystest.NewListingCache(fsys.OS{}), Now: clock.now}) // its start lists the mount
	keys := make([][]byte, 4096) // leading digits: the test policy's directory is the key hash's top byte
	for i := range keys {
		keys[i] = fmt.Appendf(nil, "%04d-dlast", i)
	}
	_, paths, _, err := d.e.nm.names(ctx, d.e.tables.get(d.ns), append(first, keys...))
	if err != nil {
		t.Fatal(err)
	}
	last := -1 // a key whose file goes where D's first did
	for i, p := range paths[1:] {
		if filepath.Dir(p) == filepath.Dir(paths[0]) {
			last = i
			break
		}
	}
	if last < 0 {
		t.Fatalf("none of %d keys goes into %s", len(keys), filepath.Dir(paths[0]))
	}
	bl := []int{4, 5, 6, 7}
	d.c.fill(r, bl)
	storeAndCheck(t, d.e, d.c, keys[last:last+1], [][]int{bl})
	if err := d.e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	m := tickPastDeadBound(ctx, a.e, clock)
	if n, err := a.e.Delete(ctx, a.ns, first); err != nil || n != 1 {
		t.Fatalf("delete D's first key on A: %d %v", n, err)
	}
	m.cluster.Tick(ctx)
	wantDeadNodeStillAdopted(t, a, m, dir, "D's last file")
}

// wantDeadNodeStillAdopted fails t unless node a, on mount m of dir,
// still holds dead node d's adoption and counts every byte of files on
// the mount, what (a file of d's) among them.
func wantDeadNodeStillAdopted(t *testing.T, a *node, m *mount, dir, what string) {
	t.Helper()
	if got, want := ownBytes(m), diskBytes(t, dir); got != want || !isAdopted(a.e, "d") {
		t.Fatalf("%s on the mount (%d bytes of files there): A counts %d bytes; A holds D's adoption: %v, D's cluster files left: %v",
			what, want, got, isAdopted(a.e, "d"), clusterFiles(dir, "d"))
	}
}

// TestClusterNeverRetiresADeadNodeThatRanAgainBetweenTwoReads: node A
// adopted dead node D and walked the mount for D's files; A's ticks are
// then held up while D's one file is deleted, D runs again, stores a file
// and stops again, its new summary stale by A's next read. That read
// finds D dead as before, but of a newer run: A must walk the mount for
// D's files again, not retire D on the walk of its earlier run and leave
// D's new file counted and removed by no node. Where that read cannot
// read D's new summary (EIO: D's last summary read stands in for it), A
// must not retire D on it either, and walks again once it reads it.
func TestClusterNeverRetiresADeadNodeThatRanAgainBetweenTwoReads(t *testing.T) {
	tests := []struct {
		name       string
		unreadable bool // A's first read after D's second run cannot open D's summary
	}{
		{"its summary read", false},
		{"its summary unreadable at first", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			dir := t.TempDir()
			r := rand.New(rand.NewPCG(5, 5))
			clock := newTestClock()
			sum := filepath.Join(dir, clustercap.DirName, "d.summary")
			var fail atomic.Bool
			a := clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: 1 << 30, ClusterInterval: time.Hour}}, NodeID: "a", Now: clock.now,
				FS: &fsys.Faulty{FS: fsys.OS{}, Inj: fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
					if op == fsys.OpOpen && path == sum && fail.Load() {
						return fsys.Fault{Err: syscall.EIO}
					}
					return fsys.Fault{}
				})}})
			d := clusterNode(t, dir, "d", 1<<30, time.Hour)
			first := storeKeys(t, d, "d", 1, r)
			if err := d.e.Close(ctx); err != nil {
				t.Fatal(err)
			}
			m := tickPastDeadNode(ctx, t, a.e, clock)
			if n := a.e.Stats().Mounts[0].Entries; n != 1 {
				t.Fatalf("A adopted D with %d entries indexed, want D's 1", n)
			}
			if n, err := a.e.Delete(ctx, a.ns, first); err != nil || n != 1 {
				t.Fatalf("delete D's first key on A: %d %v", n, err)
			}
			d = clusterNode(t, dir, "d", 1<<30, time.Hour) // D runs again, on the wall clock: stale by A's
			storeKeys(t, d, "dagain", 1, r)
			if err := d.e.Close(ctx); err != nil {
				t.Fatal(err)
			}
			if tt.unreadable {
				fail.Store(true)
				m.cluster.Tick(ctx)
				fail.Store(false)
			}
			m.cluster.Tick(ctx)
			wantDeadNodeStillAdopted(t, a, m, dir, "D's file of its second run")
		})
	}
}

// TestClusterLetsGoOfADeadNodeRetiredElsewhere: node A adopted dead node
// D; D's summary, lock and adoption files then leave the directory (as
// when another node retires D). D is no longer in A's read: A's next tick
// lets go of D's adoption.
func TestClusterLetsGoOfADeadNodeRetiredElsewhere(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	a, clock, _ := adoptableDeadNode(t, dir, 1<<30, 1, rand.New(rand.NewPCG(3, 3)))
	m := tickPastDeadNode(ctx, t, a.e, clock)
	for _, f := range clusterFiles(dir, "d") {
		if err := os.Remove(filepath.Join(dir, clustercap.DirName, f)); err != nil {
			t.Fatal(err)
		}
	}
	m.cluster.Tick(ctx)
	if got := m.cluster.Dir().Adopted(); len(got) > 0 || isAdopted(a.e, "d") {
		t.Fatalf("D's cluster files gone (retired elsewhere), A still holds the adoption of %v", got)
	}
}

// TestClusterNeverRetiresADeadNodeWhoseFileItsWalkCouldNotRead: node A
// adopts dead node D, whose one file A's walk of the mount cannot open,
// or whose name's stat, after the walk read the file, fails (EIO): the
// walk cannot tell whose the file is, or whether it is there, so it has
// not completed. A must not retire D, which would leave the file counted
// and removed by no node, and once the file reads again A's next walk
// counts it.
func TestClusterNeverRetiresADeadNodeWhoseFileItsWalkCouldNotRead(t *testing.T) {
	tests := []struct {
		name      string
		op        fsys.Op // fails on D's file
		afterRead bool    // only once the file was read and closed
	}{
		{"open", fsys.OpOpen, false},
		{"stat after its read", fsys.OpStat, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			dir := t.TempDir()
			var unreadable atomic.Value // the path whose op fails
			unreadable.Store("")
			var read atomic.Bool // the file was read and closed
			a, clock := besideDeadNode(t, dir, 1, fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
				if path != unreadable.Load() {
					return fsys.Fault{}
				}
				if op == fsys.OpClose {
					read.Store(true)
				}
				if op == tt.op && (!tt.afterRead || read.Load()) {
					return fsys.Fault{Err: syscall.EIO}
				}
				return fsys.Fault{}
			}))
			files := kvFiles(t, dir)
			if len(files) != 1 {
				t.Fatalf("%d data files after D's one store: %v", len(files), files)
			}
			unreadable.Store(files[0])
			m := tickPastDeadBound(ctx, a, clock)
			if !isAdopted(a, "d") || len(clusterFiles(dir, "d")) != 3 {
				t.Fatalf("A's walk could not %s D's file, yet A retired D: adopted %v, D's cluster files %v", tt.op, isAdopted(a, "d"), clusterFiles(dir, "d"))
			}
			unreadable.Store("")
			clock.advance(time.Hour) // one interval: the walk is due again
			m.cluster.Tick(ctx)
			wantDeadNodeStillAdopted(t, &node{e: a}, m, dir, "D's file, unreadable at A's first walk")
		})
	}
}

// TestClusterCloseStopsAnAdoptionWalkUnderWay: node A's cluster loop
// adopts dead node D (8 files) and walks the mount for D's files. Close,
// called while the walk lists D's directory, stops the walk there: it
// must not wait for the walk to read the files and directories left
// (minutes on a large mount).
func TestClusterCloseStopsAnAdoptionWalkUnderWay(t *testing.T) {
	dir := t.TempDir()
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	var released atomic.Bool
	var after atomic.Int64 // the walk's reads of data files and directories after the release
	a := openEngine(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: 1 << 30, ClusterInterval: 20 * time.Millisecond}},
		Policy: newTestPolicy(1, abi.OrderLayerMajor), NodeID: "a",
		FS: &fsys.Faulty{FS: fsys.OS{}, Inj: fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
			switch {
			case strings.Contains(path, clustercap.DirName):
			case op == fsys.OpReadDir && path != dir && !released.Load():
				once.Do(func() { close(entered); <-release })
			case op == fsys.OpReadDir && path != dir, op == fsys.OpOpen && strings.HasSuffix(path, ".kv"):
				if released.Load() {
					after.Add(1)
				}
			}
			return fsys.Fault{}
		})}})
	d := clusterNode(t, dir, "d", 1<<30, 20*time.Millisecond)
	storeKeys(t, d, "d", 8, rand.New(rand.NewPCG(8, 9)))
	if err := d.e.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	isClosed := func(ch <-chan struct{}) func() bool {
		return func() bool {
			select {
			case <-ch:
				return true
			default:
				return false
			}
		}
	}
	testwait.Until(t, "A adopting dead node D and walking the mount", testwait.Hang, isClosed(entered))
	stop := a.clusterRun.Done()
	closed := make(chan error, 1)
	go func() { closed <- a.Close(context.Background()) }()
	testwait.Until(t, "A's Close stopping its cluster loop", testwait.Hang, isClosed(stop))
	released.Store(true)
	close(release)
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	if n := after.Load(); n > 0 {
		t.Fatalf("A's Close waited for its adoption walk to read %d more files and directories", n)
	}
}

// TestClusterAnAdopterSparesTheFilesOfANodeWhoseRebuildRuns: node A
// adopted dead node D (3 files, a bound of 4). D starts again; while its
// rebuild reads the mount (D has read a header of its own), A stores 3
// keys, which take A past its claim: A's claim raise reads the directory,
// and must find D running (it holds its lock from before its scan) and
// evict none of the files D is indexing. Else D's index holds files gone,
// counted by D and pinned by its restart hold.
func TestClusterAnAdopterSparesTheFilesOfANodeWhoseRebuildRuns(t *testing.T) {
	ctx := context.Background()
	capacity := 4 * oneFileBytes(t)
	dir := t.TempDir()
	a, clock, _ := adoptableDeadNode(t, dir, capacity, 3, rand.New(rand.NewPCG(12, 12)))
	files := dataFiles(t, dir)
	tickPastDeadNode(ctx, t, a.e, clock)
	if n := len(entriesOf(a.e, "d")); n != 3 {
		t.Fatalf("A adopted D with %d of D's 3 files indexed", n)
	}
	var once sync.Once
	var stored []KeyResult // A's stores during D's rebuild
	var gone []string      // D's files A removed meanwhile
	restarted := clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: capacity, ClusterInterval: time.Hour}}, NodeID: "d",
		FS: &fsys.Faulty{FS: fsys.OS{}, Inj: fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
			if op != fsys.OpClose || !strings.HasSuffix(path, ".kv") { // a header of D's read by its rebuild
				return fsys.Fault{}
			}
			once.Do(func() {
				r := rand.New(rand.NewPCG(13, 13))
				for i, k := range testKeys("a", 3) {
					bl := []int{4 * i, 4*i + 1, 4*i + 2, 4*i + 3}
					a.c.fill(r, bl)
					j, err := a.e.Store(ctx, StoreRequest{Cache: a.c.id, Keys: [][]byte{k}, Blocks: [][]int{bl}})
					if err != nil {
						stored = append(stored, KeyResult{Outcome: OutcomeFailed, Err: err})
						continue
					}
					res, _ := j.Wait(ctx) // refused for room or not: D's files stay
					stored = append(stored, res.Keys...)
				}
				for _, f := range files {
					if _, err := os.Stat(f); err != nil {
						gone = append(gone, filepath.Base(f))
					}
				}
			})
			return fsys.Fault{}
		})}})
	if len(stored) != 3 {
		t.Fatalf("D's rebuild read no header of its files: A stored %d keys meanwhile", len(stored))
	}
	if len(gone) > 0 {
		t.Fatalf("A removed %d of D's 3 files while D's rebuild indexed them (A's stores: %v): %v", len(gone), stored, gone)
	}
	for _, en := range entriesOf(restarted.e, "d") {
		if _, err := os.Stat(en.Path); err != nil {
			t.Errorf("D indexes its file %s, gone from the mount: %v", en.Path, err)
		}
	}
}

// TestClusterNeverRetiresADeadNodeWhoseFileAFailedStoreHeld: node A
// stores a key that dead node D's one file holds (A never indexed it),
// and A's walk for D's files runs while that store holds the file's
// path: the walk cannot index the file there, which is the store's to
// replace. The store then fails, leaving D's file. A must not have taken
// that walk for complete and retired D, leaving the file counted and
// removed by no node; its next walk counts the file.
func TestClusterNeverRetiresADeadNodeWhoseFileAFailedStoreHeld(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	clock := newTestClock()
	var armed atomic.Bool
	entered, release := make(chan struct{}), make(chan struct{})
	a := clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: 1 << 30, ClusterInterval: time.Hour}}, NodeID: "a", Now: clock.now,
		FS: &fsys.Faulty{FS: fsys.OS{}, Inj: fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
			// A's store's temporary file (the walk's own come after).
			if op == fsys.OpOpen && strings.HasPrefix(filepath.Base(path), tmpPrefix+"a-") && armed.CompareAndSwap(true, false) {
				close(entered)
				<-release
				return fsys.Fault{Err: syscall.EIO}
			}
			return fsys.Fault{}
		})}})
	d := clusterNode(t, dir, "d", 1<<30, time.Hour)
	keys := storeKeys(t, d, "d", 1, rand.New(rand.NewPCG(6, 6)))
	if err := d.e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	armed.Store(true)
	a.c.fill(rand.New(rand.NewPCG(7, 7)), []int{0, 1, 2, 3})
	j, err := a.e.Store(ctx, StoreRequest{Cache: a.c.id, Keys: keys, Blocks: [][]int{{0, 1, 2, 3}}})
	if err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, "A's store holding the path of D's file", testwait.Hang, func() bool {
		select {
		case <-entered:
			return true
		default:
			return false
		}
	})
	m := tickPastDeadBound(ctx, a.e, clock)
	close(release)
	if res, _ := j.Wait(ctx); res.Keys[0].Outcome != OutcomeFailed {
		t.Fatalf("A's store of D's key, its temporary file failing: %v, want failed", res.Keys[0].Outcome)
	}
	if !isAdopted(a.e, "d") || len(clusterFiles(dir, "d")) != 3 {
		t.Fatalf("A's walk skipped D's file, whose path A's store held, yet A retired D: adopted %v, D's cluster files %v", isAdopted(a.e, "d"), clusterFiles(dir, "d"))
	}
	clock.advance(time.Hour) // one interval: the walk is due again
	m.cluster.Tick(ctx)
	wantDeadNodeStillAdopted(t, a, m, dir, "D's file, held by A's failed store at A's first walk")
}

// TestClusterKeepsADeadNodesClaimUntilItsAdopterCountsIt: dead node D
// left 4 files on a mount bounded to 8. Node A adopts D, and its walk of
// the mount for D's files is held (a slow mount: the walk may take
// minutes). Meanwhile node B, which cannot adopt D (A holds its adoption
// lock), stores 6 keys. D's files are counted by no published summary
// until A's walk ends: B must still count them, and the files on the
// mount never pass the bound.
func TestClusterKeepsADeadNodesClaimUntilItsAdopterCountsIt(t *testing.T) {
	ctx := context.Background()
	fileSize := oneFileBytes(t)
	capacity := 8 * fileSize
	dir := t.TempDir()
	clockA, clockB := newTestClock(), newTestClock()
	var armed atomic.Bool
	held, release := make(chan struct{}), make(chan struct{})
	a := clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: capacity, ClusterInterval: time.Hour}}, NodeID: "a", Now: clockA.now,
		FS: &fsys.Faulty{FS: fsys.OS{}, Inj: fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
			if op == fsys.OpReadDir && path == dir && armed.CompareAndSwap(true, false) { // the walk's first listing
				close(held)
				<-release
			}
			return fsys.Fault{}
		})}})
	b := clusterNodeAt(t, dir, "b", capacity, time.Hour, clockB.now)
	d := clusterNode(t, dir, "d", capacity, time.Hour)
	r := rand.New(rand.NewPCG(14, 14))
	storeKeys(t, d, "d", 4, r)
	if err := d.e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	clockA.advance(4 * time.Hour) // D's summary: stale to A and B
	clockB.advance(4 * time.Hour)
	m := a.e.mounts[0]
	armed.Store(true)
	ticked := make(chan struct{})
	go func() {
		defer close(ticked)
		m.cluster.Tick(ctx)
	}()
	<-held
	var failed []error
	for i, k := range testKeys("b", 6) {
		bl := []int{4 * i, 4*i + 1, 4*i + 2, 4*i + 3}
		b.c.fill(r, bl)
		res := wait(t)(b.e.Store(ctx, StoreRequest{Cache: b.c.id, Keys: [][]byte{k}, Blocks: [][]int{bl}}))
		if kr := res.Keys[0]; kr.Outcome == OutcomeFailed {
			failed = append(failed, kr.Err)
		}
		if got := diskBytes(t, dir); got > capacity {
			close(release)
			<-ticked
			t.Fatalf("B's store %d while A walked for dead node D's 4 files: %d bytes of files on the mount, over the cluster capacity of %d (%d files; B's failed stores: %v)",
				i, got, capacity, got/fileSize, failed)
		}
	}
	close(release)
	<-ticked
	if !isAdopted(a.e, "d") || len(entriesOf(a.e, "d")) != 4 {
		t.Fatalf("A did not adopt D: adopted %v, %d of D's 4 files indexed", isAdopted(a.e, "d"), len(entriesOf(a.e, "d")))
	}
	// A's summary now counts D's files and names D adopted: B stops
	// counting D's own summary beside it.
	mb := b.e.mounts[0]
	mb.cluster.Tick(ctx)
	unclaimed := mb.cluster.Inspect().Unclaimed
	if unclaimed != 0 {
		t.Fatalf("B still counts %d dead nodes' summaries after A's summary counted D's files", unclaimed)
	}
}

// TestClusterAdoptsAndRetiresADeadNodeWhereAnExclusiveFlockNeedsWriteAccess:
// node A's mount is NFS (version 4), whose client emulates flock with a
// POSIX lock that, exclusive, needs the file open for writing. Dead node
// D left one file and one abandoned temporary file. A must find D dead
// (probing D's lock), adopt it, remove its temporary file, and once D's
// file is gone retire D (locking D's lock file).
func TestClusterAdoptsAndRetiresADeadNodeWhereAnExclusiveFlockNeedsWriteAccess(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	clock := newTestClock()
	a := clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: 1 << 30, ClusterInterval: time.Hour}}, NodeID: "a", Now: clock.now,
		FS: fsystest.NFSLocks{FS: fsys.OS{}}})
	d := clusterNode(t, dir, "d", 1<<30, time.Hour)
	keys := storeKeys(t, d, "d", 1, rand.New(rand.NewPCG(16, 16)))
	if err := d.e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	tmp := filepath.Join(dir, fmt.Sprintf("%sd-%d-%016x", tmpPrefix, 1<<22+1, 5)) // a store of D's cut short
	if err := os.WriteFile(tmp, []byte("partial"), 0o644); err != nil {
		t.Fatal(err)
	}
	m := tickPastDeadNode(ctx, t, a.e, clock) // D's temporary file past temp_grace too
	if n := len(entriesOf(a.e, "d")); n != 1 {
		t.Fatalf("A adopted dead node D with %d of D's 1 file indexed", n)
	}
	if _, err := os.Stat(tmp); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("dead node D's abandoned temporary file stays after A's tick: %v", err)
	}
	if n, err := a.e.Delete(ctx, a.ns, keys); err != nil || n != 1 {
		t.Fatalf("delete D's key on A: %d %v", n, err)
	}
	m.cluster.Tick(ctx)
	if left := clusterFiles(dir, "d"); len(left) > 0 || isAdopted(a.e, "d") {
		t.Fatalf("dead node D has no file left on the mount, yet %v stay and A still adopts it: %v", left, isAdopted(a.e, "d"))
	}
}

// TestClusterAStalledPeersCutIsInForceOnlyWhileItsSummaryIsRecent: a
// peer P (running, its lock held) publishes a cut-off above node A's
// files' ranks, then its publications stall. A follows the cut only while
// it has seen P's summary stand for less than the window (two of A's
// intervals, on A's clock): a cut of a summary A never saw change (its
// first read of P is 10 minutes after the cut) is not followed, nor one
// A has seen stand for 3 hours (window 2 hours), and one A saw published
// a minute ago is, whatever the clocks (the cut's age on P's clock is
// P's summary time minus its cut time).
func TestClusterAStalledPeersCutIsInForceOnlyWhileItsSummaryIsRecent(t *testing.T) {
	ctx := context.Background()
	fileSize := oneFileBytes(t)
	for _, tc := range []struct {
		name      string
		seenFirst bool          // A read P's summary before its cut (it then saw it change)
		stall     time.Duration // from P's cut to A's tick, on A's clock
		evicted   uint64
	}{
		{"first read long after the cut", false, 10 * time.Minute, 0},
		{"seen changed, then stalled past the window", true, 3 * time.Hour, 0},
		{"seen changed a minute ago", true, time.Minute, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			clock := newTestClock()
			a := clusterNodeAt(t, dir, "a", 100*fileSize, time.Hour, clock.now)
			storeKeys(t, a, "a", 3, rand.New(rand.NewPCG(7, 8)))
			p, err := clustercap.OpenDir(fsys.OS{}, dir, "p")
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			m := a.e.mounts[0]
			c := m.cluster
			// P's summaries, on a clock an hour behind A's.
			skew := -int64(time.Hour)
			publish := func(seq uint64, cut uint64) {
				at := clock.now().UnixNano() + skew
				s := &clustercap.Summary{Version: clustercap.SummaryVersion, Node: "p", Tag: clustercap.Tag("p"), Seq: seq,
					Time: at, Interval: int64(time.Second), Bytes: fileSize, Claim: fileSize,
					Sketch: clustercap.Sketch{Ranks: []uint64{uint64(at)}, Bytes: []int64{fileSize}}}
				if cut > 0 {
					s.Cut, s.CutTime = cut, at
				}
				if err := p.Publish(s); err != nil {
					t.Fatal(err)
				}
			}
			readNow := func() {
				if err := c.Read(ctx); err != nil {
					t.Fatal(err)
				}
			}
			if tc.seenFirst {
				publish(8, 0)
				readNow()
			}
			clock.advance(time.Second)
			publish(9, uint64(clock.now().UnixNano())) // above A's files' ranks
			if tc.seenFirst {
				readNow() // A sees P's summary change
			}
			clock.advance(tc.stall)
			c.Tick(ctx)
			if ev := a.e.Stats().Evictions; ev != tc.evicted {
				t.Fatalf("with 4 files on the mount of a bound of 100, A evicted %d of its 3 files below P's cut-off %v after it, want %d", ev, tc.stall, tc.evicted)
			}
		})
	}
}

// rewriteSummary replaces node's summary on dir with what edit makes of
// its bytes, as a node publishes (a temporary renamed over it).
func rewriteSummary(t *testing.T, dir, node string, edit func([]byte) []byte) {
	t.Helper()
	path := filepath.Join(dir, clustercap.DirName, node+".summary")
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path+".tmp", edit(b), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		t.Fatal(err)
	}
}

// editedNode starts node "n" on a fresh directory with a cluster bound
// of 8 files, has it store 5 keys and replaces its summary by edit's
// (rewriteSummary). It returns the directory, the bound, the node and
// the keys' source (seeded with seed).
func editedNode(t *testing.T, seed uint64, edit func([]byte) []byte) (string, int64, *node, *rand.Rand) {
	t.Helper()
	capacity := 8 * oneFileBytes(t)
	dir := t.TempDir()
	r := rand.New(rand.NewPCG(5, seed))
	n := clusterNode(t, dir, "n", capacity, time.Hour)
	storeKeys(t, n, "n", 5, r)
	rewriteSummary(t, dir, "n", edit)
	return dir, capacity, n, r
}

// storeWithinBound has n store count one-key stores (prefix), each stored
// or refused for room (ErrNoSpace), and fails the test where the data
// files on dir pass capacity after one. It returns how many were stored.
func storeWithinBound(t *testing.T, n *node, dir, prefix string, count int, capacity int64, r *rand.Rand) int {
	t.Helper()
	stored := 0
	for i := range count {
		bl := []int{4 * (i % 16), 4*(i%16) + 1, 4*(i%16) + 2, 4*(i%16) + 3}
		n.c.fill(r, bl)
		res := wait(t)(n.e.Store(context.Background(), StoreRequest{Cache: n.c.id, Keys: testKeys(fmt.Sprintf("%s%02d", prefix, i), 1), Blocks: [][]int{bl}}))
		switch kr := res.Keys[0]; {
		case kr.Outcome == OutcomeStored:
			stored++
		case kr.Outcome != OutcomeFailed || !errors.Is(kr.Err, ErrNoSpace):
			t.Fatalf("store %d: %v, %v; want stored or refused for room", i, kr.Outcome, kr.Err)
		}
		if got := diskBytes(t, dir); got > capacity {
			t.Fatalf("after store %d: %d bytes of files on the mount, over the cluster bound of %d", i, got, capacity)
		}
	}
	return stored
}

// TestClusterALiveNodeOfALaterSummaryVersionCountsInTheBound: node N
// runs and holds 5 files of a bound of 8, its summary of a later format
// version (a rolling upgrade) with a field this version does not know.
// Node A, starting beside it, reads N's claim from the fields it knows,
// so A's stores keep the files on the mount within the bound.
func TestClusterALiveNodeOfALaterSummaryVersionCountsInTheBound(t *testing.T) {
	dir, capacity, _, r := editedNode(t, 6, func(b []byte) []byte {
		var s map[string]any
		if err := json.Unmarshal(b, &s); err != nil {
			t.Fatal(err)
		}
		s["version"] = clustercap.SummaryVersion + 1
		s["a_later_field"] = []int{1, 2}
		out, err := json.Marshal(s)
		if err != nil {
			t.Fatal(err)
		}
		return out
	})
	a := clusterNode(t, dir, "a", capacity, 20*time.Millisecond)
	if got := storeWithinBound(t, a, dir, "a", 8, capacity, r); got == 0 {
		t.Fatal("A stored none of 8 keys: it could not read N's summary of a later version")
	}
}

// TestClusterALiveNodeWhoseSummaryDoesNotDecodeStillBoundsTheOthers: node
// N runs (its lock held) with 5 files of a bound of 8, and its summary is
// cut short (nothing of it decodes, and A never read an earlier one). A,
// starting beside it, cannot count N's files, so its claim grows no
// further: its stores are refused for room rather than take N's room, and
// the files on the mount stay within the bound. Once N publishes a
// summary A can read, A stores again.
func TestClusterALiveNodeWhoseSummaryDoesNotDecodeStillBoundsTheOthers(t *testing.T) {
	ctx := context.Background()
	dir, capacity, n, r := editedNode(t, 7, func(b []byte) []byte { return b[:len(b)/2] })
	a := clusterNode(t, dir, "a", capacity, time.Hour)
	storeWithinBound(t, a, dir, "a", 8, capacity, r)
	m := n.e.mounts[0]
	m.cluster.Tick(ctx) // N's summary readable again
	if got := storeWithinBound(t, a, dir, "b", 2, capacity, r); got == 0 {
		t.Fatal("A stored none of 2 keys once N's summary decoded again (2 files of room left)")
	}
}

// TestClusterARefusedStoreLeavesNoRaisedClaimPublished: node N runs with
// 5 files of a bound of 8 and a summary A cannot decode, so A's claim
// grows no further. A store beyond A's claim publishes a raised claim
// before it reads the others (so that two nodes raising at once see each
// other); where the store is then refused, the summary A leaves published
// claims no more than A's claim in memory, which the others count in the
// bound until A's next tick (an hour here).
func TestClusterARefusedStoreLeavesNoRaisedClaimPublished(t *testing.T) {
	dir, capacity, _, r := editedNode(t, 8, func(b []byte) []byte { return b[:len(b)/2] })
	a := clusterNode(t, dir, "a", capacity, time.Hour)
	if stored := storeWithinBound(t, a, dir, "a", 8, capacity, r); stored == 8 {
		t.Fatal("A stored all 8 keys beside a node it cannot count: no store was refused")
	}
	b, err := os.ReadFile(filepath.Join(dir, clustercap.DirName, "a.summary"))
	if err != nil {
		t.Fatal(err)
	}
	s, err := clustercap.Decode(b)
	if err != nil {
		t.Fatal(err)
	}
	claim := a.e.mounts[0].cluster.Inspect().Claim
	if s.Claim > claim {
		t.Fatalf("A's published claim is %d bytes after a refused store, above its claim of %d", s.Claim, claim)
	}
}

// mountBytes is the bytes of every regular file under dir but the
// cluster's metadata and the model books: data files, temporaries and
// spares alike.
func mountBytes(t *testing.T, dir string) int64 {
	t.Helper()
	var n int64
	filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || filepath.Base(filepath.Dir(path)) == clustercap.DirName || isModelBook(d.Name()) {
			return nil
		}
		if fi, err := d.Info(); err == nil && fi.Mode().IsRegular() {
			n += fi.Size()
		}
		return nil
	})
	return n
}

// TestClusterAMemoryMountWithAClusterCapacityKeepsNoSpares: on a tmpfs
// mount with a cluster capacity of 8 files (and preallocate asked for),
// a node fills the bound with files of one size and then stores 24 of
// another, evicting: no eviction keeps a spare and none is made ahead,
// so every file on the mount (data, temporaries, spares) stays within
// the bound, which counts only the nodes' data files and stores.
func TestClusterAMemoryMountWithAClusterCapacityKeepsNoSpares(t *testing.T) {
	fileSize := oneFileBytes(t)
	capacity := 8 * fileSize
	dir := tmpfsDir(t)
	a := clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: capacity, ClusterInterval: 20 * time.Millisecond, Preallocate: 4 * fileSize}}, NodeID: "a"})
	r := rand.New(rand.NewPCG(9, 9))
	storeKeys(t, a, "small", 8, r) // the bound full of one size
	// Keys of another geometry (another file size): each store evicts
	// small files, which no store of this size could reuse.
	g := smallGeometry(false)
	g.Model = "other"
	ns, err := a.e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	a = &node{e: a.e, ns: ns, c: newTestCache(t, a.e, ns, g, 64, layoutPlaneFirst)}
	for i := range 24 {
		storeKeys(t, a, fmt.Sprintf("k%02d", i), 1, r)
		if got := mountBytes(t, dir); got > capacity {
			st := a.e.Stats().Mounts[0]
			t.Fatalf("after store %d: %d bytes of files on the cluster mount, over the bound of %d (%d data files, %d spares of %d bytes)",
				i, got, capacity, len(kvFiles(t, dir)), st.SpareFiles, st.SpareBytes)
		}
	}
	if st := a.e.Stats().Mounts[0]; st.SpareFiles != 0 || st.Preallocate != 0 {
		t.Fatalf("%d spares, preallocate %d on a cluster mount: want none", st.SpareFiles, st.Preallocate)
	}
}

// TestPurgeOnASharedMountWithoutAClusterCapacityRemovesOnlyTheFilesThisDaemonIndexes:
// without a cluster capacity no channel reaches the other nodes, so Purge
// removes the files the daemon indexes (docs/serve.md, kvhost purge): on
// a directory nodes A and B share, B stores 3 keys, A looks one of them
// up (indexing its file) and purges the namespace: that file goes, B's
// other 2, which A never found, stay; B's purge then removes the rest. On
// a cluster mount one purge reaches every node
// (TestPurgeOnAClusterMountRemovesEveryNodesFilesOfTheNamespace).
func TestPurgeOnASharedMountWithoutAClusterCapacityRemovesOnlyTheFilesThisDaemonIndexes(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	a := openNode(t, dir, "node-a", nil, 1)
	b := openNode(t, dir, "node-b", nil, 1)
	keys := storeKeys(t, b, "b", 3, rand.New(rand.NewPCG(1, 2)))
	if n := len(dataFiles(t, dir)); n != 3 {
		t.Fatalf("%d data files after B's stores, want 3", n)
	}
	if n, _ := a.e.Lookup(ctx, a.ns, keys[:1]); n != 1 {
		t.Fatalf("A finds %d of B's first key, want 1", n)
	}
	fp := smallGeometry(true).Fingerprint()
	res, err := a.e.Purge(ctx, fp)
	if err != nil {
		t.Fatal(err)
	}
	if left := dataFiles(t, dir); res.Files != 1 || len(left) != 2 {
		t.Fatalf("A's purge (%+v) left %d files, want B's 2 that A never found: %v", res, len(left), left)
	}
	if _, err := b.e.Purge(ctx, fp); err != nil {
		t.Fatal(err)
	}
	if left := dataFiles(t, dir); len(left) != 0 {
		t.Fatalf("after B's purge too, %d files left: %v", len(left), left)
	}
}
