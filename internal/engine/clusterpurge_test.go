//go:build invariants

package engine

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/clustercap"
	"github.com/kvhost/kvhost/internal/engine/cluster"
	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/internal/testwait"
)

// purgeNode is a cluster node on dir (a bound no test reaches, ticks only
// when the test ticks it) and a node of model "other" on the same engine.
func purgeNode(t *testing.T, dir, id string) (*node, *node) {
	t.Helper()
	n := clusterNode(t, dir, id, 1<<30, time.Hour)
	g := smallGeometry(false)
	g.Model = "other"
	ns, err := n.e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	return n, &node{e: n.e, ns: ns, c: newTestCache(t, n.e, ns, g, 64, layoutPlaneFirst)}
}

// tick runs n's cluster tick on its first mount now.
func (n *node) tick() {
	m := n.e.mounts[0]
	m.cluster.Tick(context.Background())
}

// hits is how many of keys a lookup on n finds.
func (n *node) hits(t *testing.T, keys [][]byte) int {
	t.Helper()
	got, err := n.e.Lookup(context.Background(), n.ns, keys)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// keyBytes is the bytes storeKeys stored for its i-th key on n.
func keyBytes(n *node, i int) []byte {
	return n.c.data([]int{4 * (i % 16), 4*(i%16) + 1, 4*(i%16) + 2, 4*(i%16) + 3})
}

// TestPurgeOnAClusterMountRemovesEveryNodesFilesOfTheNamespace: nodes A,
// B and C share a cluster mount; each stores keys of the model and of
// another model, and A finds one of C's keys (a lookup indexes it) but
// never B's. A's purge of the model removes A's own files (its reply
// counts them; C's file it indexed is left to C), and at once A's lookups
// of B's keys miss; B's and C's next ticks remove theirs: no file of the
// model is left on the mount, no node finds a key of it, and every
// file of the other model, on every node, stays and loads.
func TestPurgeOnAClusterMountRemovesEveryNodesFilesOfTheNamespace(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	r := rand.New(rand.NewPCG(5, 6))
	a, ao := purgeNode(t, dir, "a")
	b, bo := purgeNode(t, dir, "b")
	c, co := purgeNode(t, dir, "c")
	aKeys := storeKeys(t, a, "a", 2, r)
	bKeys := storeKeys(t, b, "b", 3, r)
	cKeys := storeKeys(t, c, "c", 2, r)
	others := map[*node][][]byte{ao: storeKeys(t, ao, "ao", 1, r), bo: storeKeys(t, bo, "bo", 2, r), co: storeKeys(t, co, "co", 1, r)}
	if n := a.hits(t, cKeys[:1]); n != 1 {
		t.Fatalf("A finds %d of C's first key, want 1", n)
	}
	res, err := a.e.Purge(ctx, smallGeometry(true).Fingerprint())
	if err != nil {
		t.Fatal(err)
	}
	if res.Files != 2 || res.Keys != 2 || res.Others != 1 || res.Pinned != 0 || res.Left != 0 {
		t.Fatalf("A's purge: %+v, want its own 2 files and keys removed, C's 1 file it indexed left to C", res)
	}
	if n := a.hits(t, append(bKeys, cKeys...)); n != 0 {
		t.Fatalf("after A's purge, A finds %d of B's and C's keys, written before it: want none", n)
	}
	b.tick()
	c.tick()
	if left := len(kvFiles(t, dir)); left != 4 {
		t.Fatalf("after B's and C's ticks, %d files on the mount, want the other model's 4: %v", left, kvFiles(t, dir))
	}
	for _, n := range []*node{a, b, c} {
		if got := n.hits(t, append(append(aKeys, bKeys...), cKeys...)); got != 0 {
			t.Fatalf("node %s finds %d keys of the purged model", n.e.own.node, got)
		}
	}
	for n, keys := range others {
		for i, k := range keys {
			loadAndCompare(t, n.e, n.c, [][]byte{k}, [][]int{{60, 61, 62, 63}}, [][]byte{keyBytes(n, i)})
		}
	}
}

// TestAPurgeRecordKeepsAFileAnotherNodesClientPinsUntilItsPinEnds: node B
// pins one of its 2 keys (an inference server's HIT, which it loads
// next); node A purges the model. B's tick removes the other file, but
// the pinned one stays and loads with its bytes (a load of a pinned key
// that failed would stop vLLM's worker); once unpinned, B's next tick
// removes it.
func TestAPurgeRecordKeepsAFileAnotherNodesClientPinsUntilItsPinEnds(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	a, _ := purgeNode(t, dir, "a")
	b, _ := purgeNode(t, dir, "b")
	keys := storeKeys(t, b, "b", 2, rand.New(rand.NewPCG(7, 8)))
	want := keyBytes(b, 0)
	pin, held, err := b.e.Pin(ctx, b.ns, keys[:1], 0)
	if err != nil || !held[0] {
		t.Fatalf("pin: %v, %v", held, err)
	}
	if _, err := a.e.Purge(ctx, smallGeometry(true).Fingerprint()); err != nil {
		t.Fatal(err)
	}
	b.tick()
	if n := len(kvFiles(t, dir)); n != 1 {
		t.Fatalf("after B's tick, %d files, want the pinned one", n)
	}
	loadAndCompare(t, b.e, b.c, keys[:1], [][]int{{60, 61, 62, 63}}, [][]byte{want})
	b.e.Unpin(ctx, pin)
	b.tick()
	if n := len(kvFiles(t, dir)); n != 0 {
		t.Fatalf("after the unpin and B's next tick, %d files, want none", n)
	}
	if n := b.hits(t, keys); n != 0 {
		t.Fatalf("B finds %d keys of the purged model", n)
	}
}

// TestAPurgeRecordSparesFilesStoredAfterItAndReachesANodeThatWasDown:
// node B is down (closed) with 2 files of the model when node A purges
// it; B starting again removes them before it opens. A key B stores
// after the purge (the model's new weights) stays through its ticks and
// loads.
func TestAPurgeRecordSparesFilesStoredAfterItAndReachesANodeThatWasDown(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	a, _ := purgeNode(t, dir, "a")
	b, _ := purgeNode(t, dir, "b")
	old := storeKeys(t, b, "old", 2, rand.New(rand.NewPCG(9, 10)))
	if err := b.e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := a.e.Purge(ctx, smallGeometry(true).Fingerprint()); err != nil {
		t.Fatal(err)
	}
	at, ok := a.e.mounts[0].cluster.Dir().PurgedAt(smallGeometry(true).Fingerprint(), cluster.PurgeLimit(a.e.cfg.Now()))
	if !ok {
		t.Fatal("no purge record after A's purge")
	}
	b, _ = purgeNode(t, dir, "b")
	if n := len(kvFiles(t, dir)); n != 0 {
		t.Fatalf("B started after the purge: %d files of the model left, want none", n)
	}
	if n := b.hits(t, old); n != 0 {
		t.Fatalf("B finds %d keys stored before the purge", n)
	}
	waitPastFSClock(t, at)
	fresh := storeKeys(t, b, "new", 1, rand.New(rand.NewPCG(11, 12)))
	b.tick()
	a.tick()
	loadAndCompare(t, b.e, b.c, fresh, [][]int{{60, 61, 62, 63}}, [][]byte{keyBytes(b, 0)})
	if n := a.hits(t, fresh); n != 1 {
		t.Fatalf("A finds %d of the key B stored after the purge, want 1", n)
	}
}

// TestAPurgeOfAFingerprintThisNodeNeverSawReachesTheNodesThatHoldIt:
// node A never declared B's namespace nor indexed a file of it (A was
// running before B stored them, and never looked them up), the case
// docs/cluster.md sends to --fingerprint; A's purge of the fingerprint
// still writes the record, counting none of A's files, and B's next tick
// removes its files.
func TestAPurgeOfAFingerprintThisNodeNeverSawReachesTheNodesThatHoldIt(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	a := clusterNode(t, dir, "a", 1<<30, time.Hour)
	_, bo := purgeNode(t, dir, "b")
	keys := storeKeys(t, bo, "bo", 2, rand.New(rand.NewPCG(13, 14)))
	g := smallGeometry(false)
	g.Model = "other"
	res, err := a.e.Purge(ctx, g.Fingerprint())
	if err != nil {
		t.Fatalf("A's purge of a fingerprint only B holds: %v", err)
	}
	if res.Files != 0 || res.Others != 0 {
		t.Fatalf("A's purge: %+v, want none of A's files", res)
	}
	bo.tick()
	if n := len(kvFiles(t, dir)); n != 0 {
		t.Fatalf("after B's tick, %d files of the purged namespace left: %v", n, kvFiles(t, dir))
	}
	if n := bo.hits(t, keys); n != 0 {
		t.Fatalf("B finds %d keys of the purged namespace", n)
	}
}

// TestAPurgeLeavesAFileWithoutAnOwnerTagThatAnotherNodePins: a file
// written before owner tags (no file id) is no node's, and both nodes
// index it. Node B pins its key (an inference server's HIT, loaded
// next); node A's purge and A's tick must not unlink it under B's pin,
// which A cannot see: B's load reads the bytes. Once B's pin ended, B's
// tick drops it too: no node finds the key, and the file stays on the
// mount, as no eviction removes such a file either.
func TestAPurgeLeavesAFileWithoutAnOwnerTagThatAnotherNodePins(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	p := openNode(t, dir, "plain", nil, 1)
	keys := storeKeys(t, p, "untagged", 1, rand.New(rand.NewPCG(15, 16)))
	want := keyBytes(p, 0)
	if err := p.e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	untag(t, kvFiles(t, dir)[0])
	a, _ := purgeNode(t, dir, "a")
	b, _ := purgeNode(t, dir, "b")
	if n := a.hits(t, keys); n != 1 {
		t.Fatalf("A finds %d of the untagged key, want 1", n)
	}
	pin, held, err := b.e.Pin(ctx, b.ns, keys, 0)
	if err != nil || !held[0] {
		t.Fatalf("B's pin: %v, %v", held, err)
	}
	if _, err := a.e.Purge(ctx, smallGeometry(true).Fingerprint()); err != nil {
		t.Fatal(err)
	}
	a.tick()
	loadAndCompare(t, b.e, b.c, keys, [][]int{{60, 61, 62, 63}}, [][]byte{want})
	b.e.Unpin(ctx, pin)
	b.tick()
	for _, n := range []*node{a, b} {
		if got := n.hits(t, keys); got != 0 {
			t.Fatalf("node %s finds the purged untagged key", n.e.own.node)
		}
	}
	if n := len(kvFiles(t, dir)); n != 1 {
		t.Fatalf("%d files on the mount, want the untagged one, no node's to remove", n)
	}
}

// untag rewrites the header of the file at path with no file id, as a
// kvhost before file ids wrote it: no owner tag.
func untag(t *testing.T, path string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	h, err := format.Decode(bytes.Clone(b)) // its keys alias what it decodes
	if err != nil {
		t.Fatal(err)
	}
	h.ID = 0
	if err := h.Encode(b); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestAPurgeRecordFarAheadOfTheClockIsNotApplied: a record dated far in
// the future (a garbage name, or a node whose file system clock is far
// off) would purge every file of the namespace written until then, the
// new weights' too, at every tick. It is not applied; A's real purge
// after it still is: B's file written before that purge goes, the file B
// stores after it stays and loads, and A finds it.
func TestAPurgeRecordFarAheadOfTheClockIsNotApplied(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	a, _ := purgeNode(t, dir, "a")
	b, _ := purgeNode(t, dir, "b")
	fp := smallGeometry(true).Fingerprint()
	planted := filepath.Join(dir, clustercap.DirName, fmt.Sprintf("%016x-%d.purge", fp, int64(math.MaxInt64)))
	if err := os.WriteFile(planted, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	old := storeKeys(t, b, "old", 1, rand.New(rand.NewPCG(17, 18)))
	a.tick()
	b.tick()
	if n := b.hits(t, old); n != 1 {
		t.Fatalf("B finds %d of its key after reading the far-future record, want 1", n)
	}
	if _, err := a.e.Purge(ctx, fp); err != nil {
		t.Fatal(err)
	}
	at, ok := a.e.mounts[0].cluster.Dir().PurgedAt(fp, cluster.PurgeLimit(a.e.cfg.Now()))
	if !ok {
		t.Fatal("no purge record after A's purge")
	}
	waitPastFSClock(t, at)
	fresh := storeKeys(t, b, "new", 1, rand.New(rand.NewPCG(19, 20)))
	b.tick()
	a.tick()
	if n := b.hits(t, old); n != 0 {
		t.Fatal("B finds its key written before A's purge")
	}
	loadAndCompare(t, b.e, b.c, fresh, [][]int{{60, 61, 62, 63}}, [][]byte{keyBytes(b, 0)})
	if n := a.hits(t, fresh); n != 1 {
		t.Fatalf("A finds %d of the key B stored after the purge, want 1", n)
	}
}

// waitPastFSClock waits for the file system's clock to pass at (Unix
// nanoseconds): a file written then is newer than a record made at at.
func waitPastFSClock(t *testing.T, at int64) {
	t.Helper()
	probe := filepath.Join(t.TempDir(), "probe")
	testwait.Until(t, "the file system's clock to pass the purge record's", 10*time.Second, func() bool {
		if err := os.WriteFile(probe, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		fi, err := os.Stat(probe)
		return err == nil && fi.ModTime().UnixNano() > at
	})
}

// TestAPurgeRecordReachesTheFilesANodeKeepsOnItsOwnMounts: node B stores
// on a node-local mount before the cluster mount (a hot tier; a file it
// promoted off the cluster mount is one too). A's purge must reach those
// files as well, or B serves the purged model's KV from its hot tier
// after the purge: B's tick removes its local file written before the
// record, and one B stores after the record stays and loads.
func TestAPurgeRecordReachesTheFilesANodeKeepsOnItsOwnMounts(t *testing.T) {
	ctx := context.Background()
	shared, local := t.TempDir(), t.TempDir()
	a, _ := purgeNode(t, shared, "a")
	b := clusterNodeOf(t, Config{Mounts: []Mount{{Path: local}, {Path: shared, ClusterCapacity: 1 << 30, ClusterInterval: time.Hour}}, NodeID: "b"})
	tickB := func() { b.e.mounts[1].cluster.Tick(ctx) }
	old := storeKeys(t, b, "old", 2, rand.New(rand.NewPCG(21, 22)))
	if n := len(kvFiles(t, local)); n != 2 {
		t.Fatalf("B's keys: %d files on its local mount, want 2", n)
	}
	fp := smallGeometry(true).Fingerprint()
	if _, err := a.e.Purge(ctx, fp); err != nil {
		t.Fatal(err)
	}
	at, ok := a.e.mounts[0].cluster.Dir().PurgedAt(fp, cluster.PurgeLimit(a.e.cfg.Now()))
	if !ok {
		t.Fatal("no purge record after A's purge")
	}
	tickB()
	if n := b.hits(t, old); n != 0 {
		t.Fatalf("after B's tick, B finds %d of its keys stored on its local mount before the purge", n)
	}
	if n := len(kvFiles(t, local)); n != 0 {
		t.Fatalf("after B's tick, %d files on B's local mount, want none", n)
	}
	waitPastFSClock(t, at)
	fresh := storeKeys(t, b, "new", 1, rand.New(rand.NewPCG(23, 24)))
	tickB()
	loadAndCompare(t, b.e, b.c, fresh, [][]int{{60, 61, 62, 63}}, [][]byte{keyBytes(b, 0)})
}

// TestAnAdopterAppliesThePurgeRecordsToADeadNodesFiles: node D stores a
// key of the model, node A purges the model (a record; A never indexed
// D's file), D stores a second key after the record and dies. A, adopting
// D past the dead-node bound, indexes D's files in its walk and applies
// the record in the same tick: the key stored before the purge is gone
// from the mount and misses on A; the one stored after it stays and
// loads there.
func TestAnAdopterAppliesThePurgeRecordsToADeadNodesFiles(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	clock := newTestClock()
	a := clusterNodeAt(t, dir, "a", 1<<30, time.Hour, clock.now)
	d := clusterNode(t, dir, "d", 1<<30, time.Hour)
	r := rand.New(rand.NewPCG(15, 16))
	old := storeKeys(t, d, "old", 1, r)
	if _, err := a.e.Purge(ctx, smallGeometry(true).Fingerprint()); err != nil {
		t.Fatal(err)
	}
	at, ok := a.e.mounts[0].cluster.Dir().PurgedAt(smallGeometry(true).Fingerprint(), cluster.PurgeLimit(a.e.cfg.Now()))
	if !ok {
		t.Fatal("no purge record after A's purge")
	}
	waitPastFSClock(t, at)
	fresh := testKeys("new", 1)
	d.c.fill(r, []int{8, 9, 10, 11})
	storeAndCheck(t, d.e, d.c, fresh, [][]int{{8, 9, 10, 11}})
	want := d.c.data([]int{8, 9, 10, 11})
	if err := d.e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if n := len(kvFiles(t, dir)); n != 2 {
		t.Fatalf("%d files of dead node D on the mount, want 2", n)
	}
	tickPastDeadNode(ctx, t, a.e, clock)
	if n := len(kvFiles(t, dir)); n != 1 {
		t.Fatalf("after A adopted D, %d of D's files on the mount, want 1 (the one stored after the purge)", n)
	}
	if n := a.hits(t, old); n != 0 {
		t.Fatal("A finds D's key stored before the purge")
	}
	loadAndCompare(t, a.e, a.c, fresh, [][]int{{60, 61, 62, 63}}, [][]byte{want})
}
