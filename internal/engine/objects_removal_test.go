//go:build invariants

package engine

import (
	"context"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/internal/engine/removals"
)

// The object mount on the removal feed: its records name it by the index
// one past the engine's mounts, whose device class is "object".

// wantObjectRecords checks that recs are exactly one record of reason,
// on the object mount of e, of each key of keys.
func wantObjectRecords(t *testing.T, e *Engine, recs []removals.Record, reason removals.Reason, keys [][]byte) {
	t.Helper()
	idx := len(e.mounts)
	if m := e.Removals().Mounts(); len(m) != idx+1 || m[idx] != "object" {
		t.Fatalf("the feed's mounts %v: want %d, the last \"object\"", m, idx+1)
	}
	var got, want []string
	for _, r := range recs {
		if r.Reason != reason || r.Mount != idx || r.To != removals.NoMount {
			t.Fatalf("record %+v: want %v from mount %d", r, reason, idx)
		}
		got = append(got, r.Key)
	}
	for _, k := range keys {
		want = append(want, string(k))
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("records of keys %q, want %q", got, want)
	}
}

// TestAnObjectEvictedForRoomIsRecordedFromTheObjectMount: an object the
// store evicts is recorded evicted, from the object mount, on an engine
// that held its key only there, and not at all on one whose file still
// holds the key.
func TestAnObjectEvictedForRoomIsRecordedFromTheObjectMount(t *testing.T) {
	objs, a, b, keys, _ := objectPair(t, "evobj", 3)
	subA, subB := subscribe(t, a.e), subscribe(t, b.e)
	fp := a.c.geo.Fingerprint()
	objs.evict(fp, keys[1])
	wantObjectRecords(t, b.e, feedRecords(t, subB), removals.Evicted, keys[1:2])
	if recs := feedRecords(t, subA); len(recs) != 0 {
		t.Fatalf("records on the engine whose file holds the key: %+v, want none", recs)
	}
	if n, _ := b.e.Lookup(context.Background(), b.ns, keys[1:2]); n != 0 {
		t.Fatal("the evicted object is still a hit")
	}
}

// TestPurgeRemovesTheNamespacesObjects: a purge on an engine that holds
// a namespace's keys only in the object mount removes every object of
// it, counts them, records each key purged from the object mount, and
// leaves no hit; the other engine keeps its files.
func TestPurgeRemovesTheNamespacesObjects(t *testing.T) {
	objs, a, b, keys, _ := objectPair(t, "purgeobj", 4)
	sub := subscribe(t, b.e)
	fp := b.c.geo.Fingerprint()
	r, err := b.e.Purge(context.Background(), fp)
	if err != nil || r.Objects != len(keys) || r.Files != 0 {
		t.Fatalf("Purge: %+v, %v; want %d objects, no file", r, err, len(keys))
	}
	for _, k := range keys {
		if objs.Has(fp, k) {
			t.Fatalf("key %s's object outlived the purge", k)
		}
	}
	wantObjectRecords(t, b.e, feedRecords(t, sub), removals.Purged, keys)
	if n, _ := b.e.Lookup(context.Background(), b.ns, keys); n != 0 {
		t.Fatalf("%d keys still hits after the purge", n)
	}
	if n, _ := a.e.Lookup(context.Background(), a.ns, keys); n != len(keys) {
		t.Fatalf("the storing engine's files: %d of %d hits after another's purge", n, len(keys))
	}
}

// TestAnEvictedFileWhoseObjectStaysIsRecordedMovedToTheObjectMount: a
// file evicted for room whose key the object mount holds is recorded
// moved there, not evicted, and its key stays a hit.
func TestAnEvictedFileWhoseObjectStaysIsRecordedMovedToTheObjectMount(t *testing.T) {
	g := smallGeometry(true)
	fileLen := 4096 + g.KeyBytes()
	objs := newMemObjects(t)
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir(), Capacity: 6 * fileLen}}, Policy: newTestPolicy(1, abi.OrderLayerMajor), Objects: objs})
	sub := subscribe(t, e)
	ns, c := declareSmall(t, e, 64)
	keys := storeKeys(t, &node{e: e, ns: ns, c: c}, "moved", 10, rand.New(rand.NewPCG(95, 1)))
	var moved []string
	for _, k := range keys {
		if e.find(e.tables.get(ns), k) == nil {
			moved = append(moved, string(k))
		}
	}
	if len(moved) == 0 {
		t.Fatal("no file was evicted: the test's mount is too large")
	}
	var got []string
	for _, r := range feedRecords(t, sub) {
		if r.Reason != removals.Moved || r.Mount != 0 || r.To != 1 {
			t.Fatalf("record %+v: want moved from mount 0 to the object mount, 1", r)
		}
		got = append(got, r.Key)
	}
	slices.Sort(got)
	slices.Sort(moved)
	if !slices.Equal(got, moved) {
		t.Fatalf("records of %q, want the evicted files' keys %q", got, moved)
	}
	if n, _ := e.Lookup(context.Background(), ns, keys); n != len(keys) {
		t.Fatalf("%d of %d keys hits after their files' evictions", n, len(keys))
	}
}
