//go:build invariants

package engine

import (
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/internal/engine/removals"
	"github.com/kvhost/kvhost/internal/testwait"
)

// feedRecords returns every record sub has now: Next with a context
// already cancelled returns what there is, and the context's error once
// nothing is left.
func feedRecords(t *testing.T, sub *removals.Subscription) []removals.Record {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var out []removals.Record
	for {
		b, err := sub.Next(ctx, 64)
		if errors.Is(err, context.Canceled) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		if b.Resync {
			t.Fatal("a resync on a subscription that read everything")
		}
		out = append(out, b.Records...)
	}
}

// loadCorrupted writes over the payload of key's file and loads it into
// c: the load finds it corrupt (and drops it).
func loadCorrupted(t *testing.T, e *Engine, ns NamespaceID, c *testCache, key []byte) {
	t.Helper()
	en := e.find(e.tables.get(ns), key)
	f, err := os.OpenFile(en.Path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("not the stored bytes"), en.Size-64); err != nil {
		t.Fatal(err)
	}
	f.Close()
	res := wait(t)(e.Load(context.Background(), LoadRequest{Cache: c.id, Keys: [][]byte{key}, Blocks: [][]int{{0, 1, 2, 3}}}))
	if res.Keys[0].Outcome != OutcomeFailed || !errors.Is(res.Keys[0].Err, ErrCorrupt) {
		t.Fatalf("load of the corrupt file: %v %v", res.Keys[0].Outcome, res.Keys[0].Err)
	}
}

// subscribe opens a first subscription to e's feed, closed at the test's
// end.
func subscribe(t *testing.T, e *Engine) *removals.Subscription {
	t.Helper()
	sub, _, _, err := e.Removals().Subscribe(nil, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sub.Close)
	return sub
}

// missing returns the keys of keys that e no longer finds in ns.
func missing(t *testing.T, e *Engine, ns NamespaceID, keys [][]byte) []string {
	t.Helper()
	var out []string
	for _, k := range keys {
		if n, err := e.Lookup(context.Background(), ns, [][]byte{k}); err != nil {
			t.Fatal(err)
		} else if n == 0 {
			out = append(out, string(k))
		}
	}
	return out
}

// TestEachRemovalReasonRecordsEachRemovedKeyOnce: every way a key leaves
// the index (an eviction, a delete, a purge, a corrupt file, a file
// removed behind the engine's back) records each key that left exactly
// once, with its reason and mount, and no key still stored; a demotion
// records each key it moved, with the mount it is on now.
func TestEachRemovalReasonRecordsEachRemovedKeyOnce(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := 4096 + g.KeyBytes()
	for _, tc := range []struct {
		name   string
		reason removals.Reason
		mounts func(t *testing.T) []Mount
		demote bool
		// act removes some of keys (all stored, one per file) and
		// returns how many it removed at least.
		act func(t *testing.T, e *Engine, ns NamespaceID, keys [][]byte) int
	}{
		{name: "evicted", reason: removals.Evicted,
			mounts: func(t *testing.T) []Mount { return []Mount{{Path: t.TempDir(), Capacity: 6 * fileLen}} },
			act:    func(t *testing.T, e *Engine, ns NamespaceID, keys [][]byte) int { return 1 }, // the stores past 6 files evicted
		},
		{name: "deleted", reason: removals.Deleted,
			act: func(t *testing.T, e *Engine, ns NamespaceID, keys [][]byte) int {
				if n, err := e.Delete(ctx, ns, [][]byte{keys[1], keys[3], keys[3]}); n != 2 || err != nil {
					t.Fatalf("Delete: %d, %v", n, err)
				}
				return 2
			},
		},
		{name: "purged", reason: removals.Purged,
			act: func(t *testing.T, e *Engine, ns NamespaceID, keys [][]byte) int {
				fp, _ := e.Fingerprint(ns)
				if r, err := e.Purge(ctx, fp); err != nil || r.Files != len(keys) {
					t.Fatalf("Purge: %+v, %v", r, err)
				}
				return len(keys)
			},
		},
		{name: "corrupt", reason: removals.Corrupt,
			act: func(t *testing.T, e *Engine, ns NamespaceID, keys [][]byte) int {
				loadCorrupted(t, e, ns, newTestCache(t, e, ns, g, 16, layoutPlaneFirst), keys[2])
				return 1
			},
		},
		{name: "vanished", reason: removals.Vanished,
			act: func(t *testing.T, e *Engine, ns NamespaceID, keys [][]byte) int {
				if err := os.Remove(e.find(e.tables.get(ns), keys[0]).Path); err != nil {
					t.Fatal(err)
				}
				return 1 // found by the lookups that follow
			},
		},
		{name: "moved", reason: removals.Moved, demote: true,
			mounts: func(t *testing.T) []Mount {
				return []Mount{{Path: t.TempDir(), Capacity: 6 * fileLen}, {Path: t.TempDir()}}
			},
			act: func(t *testing.T, e *Engine, ns NamespaceID, keys [][]byte) int { return 1 }, // the stores past 6 files demoted
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mounts := []Mount{{Path: t.TempDir()}}
			if tc.mounts != nil {
				mounts = tc.mounts(t)
			}
			cfg := Config{Mounts: mounts, Policy: newTestPolicy(1, abi.OrderLayerMajor)}
			if tc.demote {
				cfg.Policy = &demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}
			}
			e := openEngine(t, cfg)
			sub := subscribe(t, e)
			ns, err := e.Declare(ctx, g)
			if err != nil {
				t.Fatal(err)
			}
			fp, _ := e.Fingerprint(ns)
			n := &node{e: e, ns: ns, c: newTestCache(t, e, ns, g, 64, layoutPlaneFirst)}
			keys := storeKeys(t, n, tc.name, 10, rand.New(rand.NewPCG(86, 86)))
			least := tc.act(t, e, ns, keys)
			gone := missing(t, e, ns, keys)
			recs := feedRecords(t, sub)
			var got []string
			for _, r := range recs {
				if r.Reason != tc.reason || r.FP != fp {
					t.Fatalf("record %+v: want reason %v, namespace %016x", r, tc.reason, fp)
				}
				if tc.reason == removals.Moved && (r.Mount != 0 || r.To != 1) || tc.reason != removals.Moved && (r.Mount != 0 || r.To != removals.NoMount) {
					t.Fatalf("record %+v: wrong mounts", r)
				}
				got = append(got, r.Key)
			}
			sort.Strings(got)
			if len(got) < least || len(slices.Compact(slices.Clone(got))) != len(got) {
				t.Fatalf("records of %v: want at least %d, each once", got, least)
			}
			want := gone
			if tc.reason == removals.Moved {
				want = nil
				for _, k := range keys {
					if en := e.find(e.tables.get(ns), k); en != nil && en.Mount == 1 {
						want = append(want, string(k))
					}
				}
				if len(gone) != 0 {
					t.Fatalf("keys %v lost by demotions", gone)
				}
			}
			sort.Strings(want)
			if !slices.Equal(got, want) {
				t.Fatalf("records of %v; want exactly %v", got, want)
			}
		})
	}
}

// TestAKeyAnotherNodeRemovesBecomesARecordHere: two engines on one
// cluster mount; B has indexed A's files (a lookup). A deletes some of
// its keys and its cluster capacity evicts others: B's sweep finds their
// files gone and records each of those keys once, vanished, and none of
// the keys still stored; A records them deleted and cluster-evicted.
func TestAKeyAnotherNodeRemovesBecomesARecordHere(t *testing.T) {
	ctx := context.Background()
	fileLen := oneFileBytes(t)
	dir := t.TempDir()
	a := clusterNode(t, dir, "a", 8*fileLen, 20*time.Millisecond)
	b := clusterNode(t, dir, "b", 8*fileLen, time.Hour)
	b.e.rm.sweep.every = 10 * time.Millisecond
	sub := subscribe(t, b.e)
	subA := subscribe(t, a.e)
	r := rand.New(rand.NewPCG(8, 6))
	keys := storeKeys(t, a, "a", 6, r)
	if n, err := b.e.Lookup(ctx, b.ns, keys); n != len(keys) || err != nil {
		t.Fatalf("B finds %d of A's %d keys (%v)", n, len(keys), err)
	}
	paths := map[string]string{}
	for _, k := range keys {
		paths[string(k)] = a.e.find(a.e.tables.get(a.ns), k).Path
	}
	if n, err := a.e.Delete(ctx, a.ns, keys[:2]); n != 2 || err != nil {
		t.Fatalf("A's delete: %d, %v", n, err)
	}
	storeKeys(t, a, "more", 6, r) // past the cluster's 8 files: A evicts its oldest
	testwait.Until(t, "A's eviction", testwait.Hang, func() bool { return a.e.Stats().Evictions > 0 })
	// The keys whose files are gone from the mount: A's deletes and
	// evictions (A's tick may evict more meanwhile).
	gone := func() map[string]bool {
		out := map[string]bool{}
		for k, p := range paths {
			if _, err := os.Stat(p); errors.Is(err, os.ErrNotExist) {
				out[k] = true
			}
		}
		return out
	}
	seen := map[string]int{}
	testwait.Until(t, "B's records of exactly the keys A removed", testwait.Hang, func() bool {
		for _, rec := range feedRecords(t, sub) {
			if rec.Reason != removals.Vanished {
				t.Fatalf("record %+v: want vanished", rec)
			}
			if seen[rec.Key]++; seen[rec.Key] > 1 {
				t.Fatalf("key %s recorded twice on B", rec.Key)
			}
		}
		g := gone()
		if len(g) != len(seen) {
			return false
		}
		for k := range g {
			if seen[k] == 0 {
				return false
			}
		}
		return true
	})
	for k := range seen {
		if n, _ := a.e.Lookup(ctx, a.ns, [][]byte{[]byte(k)}); n != 0 {
			t.Fatalf("key %s recorded on B, still stored on A", k)
		}
	}
	// A recorded its own removals with their reasons.
	for _, rec := range feedRecords(t, subA) {
		want := removals.ClusterEvicted
		if slices.Contains([]string{string(keys[0]), string(keys[1])}, rec.Key) {
			want = removals.Deleted
		}
		if rec.Reason != want {
			t.Fatalf("A's record %+v: want %v", rec, want)
		}
	}
}

// benchNodeDirs returns the directories of nodes "a" and "b" of a
// benchmark of two nodes on one mount: one temporary directory, or, where
// KVHOST_CLUSTER_MOUNTS names two client mounts of one distributed file
// system (scripts/cephfs.sh run 2 ...), a new directory seen through the
// first by a and through the second by b.
func benchNodeDirs(b *testing.B) map[string]string {
	mounts := strings.Split(os.Getenv("KVHOST_CLUSTER_MOUNTS"), ":")
	if len(mounts) < 2 {
		d := b.TempDir()
		return map[string]string{"a": d, "b": d}
	}
	d, err := os.MkdirTemp(mounts[0], "removal-bench-")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { os.RemoveAll(d) })
	b.Logf("nodes on %s and %s", d, filepath.Join(mounts[1], filepath.Base(d)))
	return map[string]string{"a": d, "b": filepath.Join(mounts[1], filepath.Base(d))}
}

// benchNodes opens nodes "a" and "b" on benchNodeDirs' cluster mount of
// that capacity and interval, each with a declared namespace and a cache.
func benchNodes(b *testing.B, capacity int64, interval time.Duration) (a, n *node) {
	dirs := benchNodeDirs(b)
	open := func(id string) *node {
		e := openEngine(b, Config{Mounts: []Mount{{Path: dirs[id], ClusterCapacity: capacity, ClusterInterval: interval}}, NodeID: id,
			Policy: newTestPolicy(1, abi.OrderLayerMajor)})
		g := smallGeometry(true)
		ns, err := e.Declare(context.Background(), g)
		if err != nil {
			b.Fatal(err)
		}
		return &node{e: e, ns: ns, c: newTestCache(b, e, ns, g, 64, layoutPlaneFirst)}
	}
	return open("a"), open("b")
}

// BenchmarkOtherNodeRemovalLag measures the time from a delete on node A
// of a cluster mount to the record of it on node B (whose sweep runs at
// its default interval), B having indexed the key; it reports the p50 and
// p99 of that lag. The mount is benchNodeDirs'.
func BenchmarkOtherNodeRemovalLag(b *testing.B) {
	ctx := context.Background()
	a, n := benchNodes(b, 1<<30, time.Second)
	sub, _, _, err := n.e.Removals().Subscribe(nil, 0, 0)
	if err != nil {
		b.Fatal(err)
	}
	defer sub.Close()
	r := rand.New(rand.NewPCG(1, 2))
	var lags []time.Duration
	for i := 0; b.Loop(); i++ {
		b.StopTimer()
		key := testKeys("lag"+string(rune('a'+i%26))+time.Now().Format("150405.000000"), 1)
		a.c.fill(r, []int{0, 1, 2, 3})
		storeAndCheck(b, a.e, a.c, key, [][]int{{0, 1, 2, 3}})
		if got, _ := n.e.Lookup(ctx, n.ns, key); got != 1 {
			b.Fatal("B does not find A's key")
		}
		b.StartTimer()
		t0 := time.Now()
		if got, err := a.e.Delete(ctx, a.ns, key); got != 1 || err != nil {
			b.Fatalf("delete: %d %v", got, err)
		}
		for found := false; !found; {
			bt, err := sub.Next(ctx, 64)
			if err != nil {
				b.Fatal(err)
			}
			found = slices.ContainsFunc(bt.Records, func(rec removals.Record) bool { return rec.Key == string(key[0]) })
		}
		lags = append(lags, time.Since(t0))
	}
	slices.Sort(lags)
	if len(lags) > 0 {
		b.ReportMetric(float64(lags[len(lags)/2].Milliseconds()), "p50-ms")
		b.ReportMetric(float64(lags[len(lags)*99/100].Milliseconds()), "p99-ms")
	}
}

// TestAnEvictionOfAHeldPathIsRecordedWhenItsHolderRemovesTheFile: files
// evicted while a job of the engine holds their paths are removed by
// that job when it lets the path go (orphans): each key is recorded
// evicted then, once; a key deleted while its path was held is recorded
// deleted once, then too (its file is still there until the holder
// removes it).
func TestAnEvictionOfAHeldPathIsRecordedWhenItsHolderRemovesTheFile(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir(), Capacity: 8 * (4096 + g.KeyBytes()), HighWatermark: 0.9, LowWatermark: 0.5}},
		Policy: newTestPolicy(1, abi.OrderLayerMajor)})
	sub := subscribe(t, e)
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	n := &node{e: e, ns: ns, c: newTestCache(t, e, ns, g, 64, layoutPlaneFirst)}
	r := rand.New(rand.NewPCG(5, 5))
	held := storeKeys(t, n, "held", 6, r)
	var paths []string
	for _, k := range held {
		p := e.find(e.tables.get(ns), k).Path
		if ok, _, _ := e.ix.Claim(p); !ok {
			t.Fatalf("path %s already held", p)
		}
		paths = append(paths, p)
	}
	if d, err := e.Delete(ctx, ns, held[5:]); d != 1 || err != nil {
		t.Fatalf("delete: %d, %v", d, err)
	}
	more := storeKeys(t, n, "more", 3, r) // evicts held files: orphans, their paths held
	if e.Stats().Evictions == 0 {
		t.Fatal("nothing evicted")
	}
	recs := feedRecords(t, sub)
	for _, rec := range recs {
		if strings.HasPrefix(rec.Key, "held") {
			t.Fatalf("record %+v while its path is held", rec)
		}
	}
	for _, p := range paths {
		e.rm.release(p)
	}
	recs = append(recs, feedRecords(t, sub)...)
	gone := missing(t, e, ns, append(held[:5:5], more...))
	var got []string
	deleted := 0
	for _, rec := range recs {
		if rec.Key == string(held[5]) && rec.Reason == removals.Deleted {
			deleted++
			continue
		}
		if rec.Reason != removals.Evicted {
			t.Fatalf("record %+v: want evicted", rec)
		}
		got = append(got, rec.Key)
	}
	if deleted != 1 {
		t.Fatalf("records %+v: want the deleted key once", recs)
	}
	sort.Strings(got)
	sort.Strings(gone)
	if !slices.ContainsFunc(gone, func(k string) bool { return strings.HasPrefix(k, "held") }) || !slices.Equal(got, gone) {
		t.Fatalf("records of %v once the paths were let go; want exactly the evicted %v, held ones among them", got, gone)
	}
	e.rm.pending.Range(func(k, _ any) bool {
		t.Errorf("entry %s left pending", k.(*entry).Path)
		return true
	})
}

// TestAKeyAnotherNodeStoresAgainAtItsPathIsNoRemoval: node A has indexed
// node B's file of a key; B deletes the key and stores it again (a new
// file at the path). A's load finds the new file and reads it: A records
// no removal of the key; once B deletes it for good, A's next load records
// it vanished, once.
func TestAKeyAnotherNodeStoresAgainAtItsPathIsNoRemoval(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	a, b := openNode(t, dir, "a", nil, 1), openNode(t, dir, "b", nil, 1)
	sub := subscribe(t, a.e)
	r := rand.New(rand.NewPCG(4, 2))
	key := storeKeys(t, b, "again", 1, r)
	if n, err := a.e.Lookup(ctx, a.ns, key); n != 1 || err != nil {
		t.Fatalf("A's lookup of B's key: %d, %v", n, err)
	}
	if n, err := b.e.Delete(ctx, b.ns, key); n != 1 || err != nil {
		t.Fatalf("B's delete: %d, %v", n, err)
	}
	b.c.fill(r, []int{4, 5, 6, 7})
	storeAndCheck(t, b.e, b.c, key, [][]int{{4, 5, 6, 7}})
	load := func() Outcome {
		res := wait(t)(a.e.Load(ctx, LoadRequest{Cache: a.c.id, Keys: key, Blocks: [][]int{{8, 9, 10, 11}}}))
		return res.Keys[0].Outcome
	}
	if o := load(); o != OutcomeLoaded {
		t.Fatalf("A's load of the key B stored again: %v", o)
	}
	if v := a.e.Stats().Vanished; v != 1 {
		t.Fatalf("A counted %d files vanished, want B's first (replaced at its path)", v)
	}
	if recs := feedRecords(t, sub); len(recs) != 0 {
		t.Fatalf("records %+v of a key still stored", recs)
	}
	if n, err := b.e.Delete(ctx, b.ns, key); n != 1 || err != nil {
		t.Fatalf("B's second delete: %d, %v", n, err)
	}
	if o := load(); o != OutcomeMissing {
		t.Fatalf("A's load of the key B deleted: %v", o)
	}
	if recs := feedRecords(t, sub); len(recs) != 1 || recs[0].Key != string(key[0]) || recs[0].Reason != removals.Vanished {
		t.Fatalf("records %+v, want the key vanished once", recs)
	}
}

// BenchmarkSweepRound measures one round of the sweep over 2,000 files
// of another node on a cluster mount (benchNodeDirs'), all present (the
// common round: a listing of each directory, no stat); it reports the
// round's cost per file.
func BenchmarkSweepRound(b *testing.B) {
	ctx := context.Background()
	a, n := benchNodes(b, 1<<40, time.Hour)
	const files = 2000
	keys := testKeys("sweep", files)
	a.c.fill(rand.New(rand.NewPCG(1, 1)), []int{0, 1, 2, 3})
	for at := 0; at < files; at += 8 {
		blocks := make([][]int, 8)
		for i := range blocks {
			blocks[i] = []int{4 * i, 4*i + 1, 4*i + 2, 4*i + 3}
		}
		storeAndCheck(b, a.e, a.c, keys[at:at+8], blocks)
	}
	if got, _ := n.e.Lookup(ctx, n.ns, keys); got != files {
		b.Fatalf("B finds %d of A's %d files", got, files)
	}
	listed := map[string]bool{}
	for _, k := range keys {
		listed[filepath.Dir(n.e.find(n.e.tables.get(n.ns), k).Path)] = true
	}
	for b.Loop() {
		n.e.rm.sweep.round(ctx, sweepOf(n.e))
	}
	if n.e.rm.sweep.found.Load() != 0 {
		b.Fatal("the sweep found present files gone")
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/files, "ns/file")
	b.ReportMetric(float64(len(listed)), "dirs")
}
