//go:build invariants

package engine

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/clustercap"
)

// storeOne has n store one key (prefix and i name it, blocks of their
// own): true where stored, false where refused for room (ErrNoSpace);
// anything else fails t.
func storeOne(t *testing.T, n *node, prefix string, i int, r *rand.Rand) bool {
	t.Helper()
	bl := []int{4 * (i % 16), 4*(i%16) + 1, 4*(i%16) + 2, 4*(i%16) + 3}
	n.c.fill(r, bl)
	res := wait(t)(n.e.Store(context.Background(), StoreRequest{Cache: n.c.id, Keys: testKeys(fmt.Sprintf("%s%03d", prefix, i), 1), Blocks: [][]int{bl}}))
	switch kr := res.Keys[0]; {
	case kr.Outcome == OutcomeStored:
		return true
	case kr.Outcome == OutcomeFailed && errors.Is(kr.Err, ErrNoSpace):
		return false
	default:
		t.Fatalf("store %s%03d: %v, %v; want stored or refused for room", prefix, i, kr.Outcome, kr.Err)
		return false
	}
}

// forgeSummary writes s, encoded, as node s.Node's summary on dir, as
// anyone who can write the cluster directory may.
func forgeSummary(t *testing.T, dir string, s *clustercap.Summary) string {
	t.Helper()
	b, err := clustercap.Encode(s)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, clustercap.DirName, s.Node+".summary")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestClusterNodesOfDifferentBoundsKeepTheSmallestAndShareIt (issue 85,
// defect 1): three nodes on one directory with cluster capacities of 8, 8
// and 64 files (a rollout half done) store one key each in turn, 30
// rounds. Every node bounds the mount by the smallest capacity a running
// node configures: the files on the mount never pass 8 files by more than
// one, each node stores at least a third of what each other one does (on
// the code before, the big node's claims left the small ones a negative
// room: "may hold -134348 of the cluster's 2097152"), and a warning names
// the other capacity.
func TestClusterNodesOfDifferentBoundsKeepTheSmallestAndShareIt(t *testing.T) {
	file := oneFileBytes(t)
	dir := t.TempDir()
	log, said := countingLogger(t, "another node configures another cluster_capacity")
	caps := []int64{8 * file, 8 * file, 64 * file}
	var nodes []*node
	for i, c := range caps {
		nodes = append(nodes, clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: c, ClusterInterval: 20 * time.Millisecond}},
			NodeID: fmt.Sprintf("n%d", i+1), Logger: log}))
	}
	r := rand.New(rand.NewPCG(85, 1))
	stored := make([]int, len(nodes))
	peak := int64(0)
	for round := range 30 {
		for i, n := range nodes {
			if storeOne(t, n, fmt.Sprintf("n%d-", i+1), round, r) {
				stored[i]++
			}
			peak = max(peak, diskBytes(t, dir))
		}
	}
	if peak > caps[0]+file {
		t.Errorf("the files on the mount peaked at %d bytes, over the smallest bound of %d by more than one file (%d)", peak, caps[0], file)
	}
	for i := range stored {
		for j := range stored {
			if 3*stored[i] < stored[j] {
				t.Errorf("node n%d stored %d keys, node n%d %d: less than a third (stored %v)", i+1, stored[i], j+1, stored[j], stored)
			}
		}
	}
	if said.Load() == 0 {
		t.Error("no warning named the other cluster_capacity")
	}
	t.Logf("stored %v of 30 each, peak %d bytes of a bound of %d", stored, peak, caps[0])
}

// TestClusterASummaryClaimingMoreThanTheBoundChangesNothingButALogLine
// (issue 85, defect 2): a summary of node X, no node running under that
// name, claims 2^62 bytes, dated now or in the past. Node A, with a bound
// of 8 files, stores 12 keys: every store succeeds (evicting A's own
// oldest), the files stay within the bound, and one log line says X's
// claim cannot hold, naming its summary file. The one dated in the past (stale, no lock file) is
// retired: no node reads it after A's tick.
func TestClusterASummaryClaimingMoreThanTheBoundChangesNothingButALogLine(t *testing.T) {
	for _, tc := range []struct {
		name    string
		age     time.Duration
		retired bool
	}{
		{"dated now", 0, false},
		{"dated in the past", 10 * time.Hour, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			capacity := 8 * oneFileBytes(t)
			dir := t.TempDir()
			log, ignored := countingLogger(t, "a claim that cannot hold")
			a := clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: capacity, ClusterInterval: time.Hour}}, NodeID: "a", Logger: log})
			path := forgeSummary(t, dir, &clustercap.Summary{Version: clustercap.SummaryVersion, Node: "x", Tag: clustercap.Tag("x"), Seq: 1,
				Time: time.Now().Add(-tc.age).UnixNano(), Interval: int64(time.Second), Bytes: clustercap.MaxBytes, Claim: clustercap.MaxBytes,
				Sketch: clustercap.NewSketch([]clustercap.Item{{Rank: uint64(time.Now().UnixNano()), Bytes: clustercap.MaxBytes}}, 8)})
			a.e.mounts[0].cluster.Tick(ctx)
			r := rand.New(rand.NewPCG(85, 2))
			if got := storeWithinBound(t, a, dir, "a", 12, capacity, r); got != 12 {
				t.Errorf("A stored %d of 12 keys beside a summary claiming 2^62 bytes, want all", got)
			}
			if ignored.Load() != 1 {
				t.Errorf("%d log lines say %s cannot hold, want one", ignored.Load(), path)
			}
			if _, err := os.Stat(path); tc.retired != errors.Is(err, os.ErrNotExist) {
				t.Errorf("X's summary dated %v ago: stat %v, want it retired: %v", tc.age, err, tc.retired)
			}
		})
	}
}

// TestClusterASummaryForgedUnderALiveNodesNameIsOverwrittenWithAWarning
// (issue 85, defect 3): node N runs with 5 files of a bound of 8, and a
// summary forged under its name claims 0 bytes. Node A has looked N's
// keys up (it indexes N's files): it counts at least those files for N,
// so its stores keep the mount within the bound. N's next tick finds the
// summary under its name is not the one it wrote, says so, and publishes
// its own again.
func TestClusterASummaryForgedUnderALiveNodesNameIsOverwrittenWithAWarning(t *testing.T) {
	ctx := context.Background()
	file := oneFileBytes(t)
	capacity := 8 * file
	dir := t.TempDir()
	log, forged := countingLogger(t, "is not the one it wrote")
	n := clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: capacity, ClusterInterval: time.Hour}}, NodeID: "n", Logger: log})
	r := rand.New(rand.NewPCG(85, 3))
	keys := storeKeys(t, n, "n", 5, r)
	n.e.mounts[0].cluster.Tick(ctx)
	forgeSummary(t, dir, &clustercap.Summary{Version: clustercap.SummaryVersion, Node: "n", Tag: clustercap.Tag("n"), Seq: 1000,
		Time: time.Now().UnixNano(), Interval: int64(time.Hour)})
	a := clusterNode(t, dir, "a", capacity, 20*time.Millisecond)
	if got, _ := a.e.Lookup(ctx, a.ns, keys); got != len(keys) {
		t.Fatalf("A finds %d of N's %d keys", got, len(keys))
	}
	storeWithinBound(t, a, dir, "a", 8, capacity, r)
	n.e.mounts[0].cluster.Tick(ctx)
	if forged.Load() != 1 {
		t.Errorf("N's tick after the forgery: %d warnings that the summary under its name is not its own, want one", forged.Load())
	}
	b, err := os.ReadFile(filepath.Join(dir, clustercap.DirName, "n.summary"))
	if err != nil {
		t.Fatal(err)
	}
	// N holds its files, or its fair share of the bound where A's claim
	// asked the rest (four files of eight).
	if s, err := clustercap.Decode(b); err != nil || s.Bytes < 4*file || s.Bytes != n.e.mounts[0].cluster.Inspect().Own {
		t.Errorf("N's summary after its tick: %+v, %v; want its own, of its files (at least 4)", s, err)
	}
}

// TestClusterCountsFilesNoSummaryNamesAgainstTheBound (issue 85, defect
// 4): a kvhost without a cluster capacity (as one from before owner
// tags: its files' tags are no node's) has stored 6 files on the mount;
// node A, bound 8 files, starts beside them (its rebuild indexes them)
// and stores 8 keys: it counts those files against the bound, so the
// mount stays within it, and a warning names them.
func TestClusterCountsFilesNoSummaryNamesAgainstTheBound(t *testing.T) {
	file := oneFileBytes(t)
	capacity := 8 * file
	dir := t.TempDir()
	r := rand.New(rand.NewPCG(85, 4))
	old := openNode(t, dir, "old", nil, 1)
	storeKeys(t, old, "old", 6, r)
	old.e.Close(context.Background())
	log, said := countingLogger(t, "files without an owner tag")
	a := clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: capacity, ClusterInterval: 20 * time.Millisecond}}, NodeID: "a", Logger: log})
	storeWithinBound(t, a, dir, "a", 8, capacity, r)
	if said.Load() == 0 {
		t.Error("no warning named the files without an owner tag")
	}
}

// TestClusterNamesANodeOfAnotherPolicy (issue 85, defect 5): an lfu node
// beside an lru node: a warning names it (summaries carry the policy).
func TestClusterNamesANodeOfAnotherPolicy(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	log, said := countingLogger(t, "another placement policy")
	mnt := []Mount{{Path: dir, ClusterCapacity: 1 << 30, ClusterInterval: time.Hour}}
	clusterNodeOf(t, Config{Mounts: mnt, NodeID: "lfu", PolicyName: "lfu"})
	a := clusterNodeOf(t, Config{Mounts: mnt, NodeID: "a", PolicyName: "lru", Logger: log})
	a.e.mounts[0].cluster.Tick(ctx)
	a.e.mounts[0].cluster.Tick(ctx)
	if said.Load() != 1 {
		t.Errorf("%d warnings named the lfu node beside an lru one, want one", said.Load())
	}
}

// TestClusterNamesANodeRankingOnAnotherScale (issue 85, defect 5): a
// node whose sketch ranks its files in Unix seconds (a policy's rank of
// another scale) beside one ranking by Unix nanoseconds of use: a warning
// names it, once.
func TestClusterNamesANodeRankingOnAnotherScale(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	log, said := countingLogger(t, "on another scale")
	a := clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: 1 << 30, ClusterInterval: time.Hour}}, NodeID: "a", Logger: log})
	storeKeys(t, a, "a", 2, rand.New(rand.NewPCG(85, 5)))
	a.e.mounts[0].cluster.Tick(ctx) // its sketch: ranks in Unix nanoseconds
	now := time.Now()
	l, err := clustercap.OpenDir(fsys.OS{}, dir, "secs")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if err := l.Publish(&clustercap.Summary{Version: clustercap.SummaryVersion, Node: "secs", Tag: clustercap.Tag("secs"), Seq: 1,
		Time: now.UnixNano(), Interval: int64(time.Hour), Bytes: 100, Claim: 100,
		Sketch: clustercap.NewSketch([]clustercap.Item{{Rank: uint64(now.Unix()), Bytes: 100}}, 8)}); err != nil {
		t.Fatal(err)
	}
	a.e.mounts[0].cluster.Tick(ctx)
	a.e.mounts[0].cluster.Tick(ctx)
	if said.Load() != 1 {
		t.Errorf("%d warnings named the node ranking in seconds, want one", said.Load())
	}
}

// TestClusterRetiresAStaleSummaryOfANodeItNeverSawRunning (issue 85,
// defect 2): beside a running node P, with which A finds flocks shared,
// lies the summary of node X, dated ten hours ago, its lock file there
// and free: X never ran while A did. A adopts X (nothing of X's is left
// on the mount) and retires it at its next tick, whatever the summary's
// date, so no node counts it for good.
func TestClusterRetiresAStaleSummaryOfANodeItNeverSawRunning(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	mnt := []Mount{{Path: dir, ClusterCapacity: 1 << 30, ClusterInterval: time.Hour}}
	clusterNodeOf(t, Config{Mounts: mnt, NodeID: "p"})
	a := clusterNodeOf(t, Config{Mounts: mnt, NodeID: "a"})
	m := a.e.mounts[0]
	m.cluster.Tick(ctx) // probes P's lock: held, flocks shared
	if v := m.cluster.Inspect(); len(v.Shared) == 0 {
		t.Fatalf("A found flocks shared with no node beside running P: %+v", v)
	}
	if err := os.WriteFile(filepath.Join(dir, clustercap.DirName, "x.lock"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	path := forgeSummary(t, dir, &clustercap.Summary{Version: clustercap.SummaryVersion, Node: "x", Tag: clustercap.Tag("x"), Seq: 7,
		Time: time.Now().Add(-10 * time.Hour).UnixNano(), Interval: int64(time.Second), Bytes: 1 << 20, Claim: 1 << 20})
	m.cluster.Tick(ctx)
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("X's summary, dated ten hours ago, its lock free, after A's tick: %v; want it retired", err)
	}
}
