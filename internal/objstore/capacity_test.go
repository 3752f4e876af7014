package objstore_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/engine/removals"
	"github.com/kvhost/kvhost/internal/objstore"
	"github.com/kvhost/kvhost/internal/objstore/objstoretest"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/plugins/tiered"
)

// objectLen is the bytes of one key's object: a one-key file of
// objstoretest.Geometry().
func objectLen() int64 { return 4096 + objstoretest.Geometry().KeyBytes() }

// subscribe opens a subscription to n's removal feed, closed when the
// test ends.
func subscribe(t testing.TB, n *objstoretest.Node) *removals.Subscription {
	t.Helper()
	sub, _, _, err := n.Eng.Removals().Subscribe(nil, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sub.Close)
	return sub
}

// recordsUntil reads sub's records until it holds one of each of keys,
// or fails the test after a minute; it returns them.
func recordsUntil(t testing.TB, sub *removals.Subscription, keys [][]byte) []removals.Record {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var recs []removals.Record
	seen := map[string]bool{}
	for len(seen) < len(keys) {
		b, err := sub.Next(ctx, 64)
		if err != nil {
			t.Fatalf("records %+v, then: %v; want one of each of %q", recs, err, keys)
		}
		for _, r := range b.Records {
			recs = append(recs, r)
			seen[r.Key] = true
		}
	}
	return recs
}

// wantRecords fails the test unless recs are one record of each of keys,
// for reason, from the object mount of n (one past its one file mount,
// of class "object").
func wantRecords(t testing.TB, n *objstoretest.Node, recs []removals.Record, reason removals.Reason, keys [][]byte) {
	t.Helper()
	if m := n.Eng.Removals().Mounts(); len(m) != 2 || m[1] != "object" {
		t.Fatalf("the feed's mounts: %v, want the object mount second", m)
	}
	var got, want []string
	for _, r := range recs {
		if r.Reason != reason || r.Mount != 1 || r.To != removals.NoMount {
			t.Fatalf("record %+v: want %v from the object mount, 1", r, reason)
		}
		got = append(got, r.Key)
	}
	for _, k := range keys {
		want = append(want, string(k))
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("records of %q, want %q", got, want)
	}
}

// present reports which of keys the bucket holds, asked of it.
func present(t testing.TB, n *objstoretest.Node, keys [][]byte) []bool {
	t.Helper()
	out := make([]bool, len(keys))
	for i, k := range keys {
		_, err := objstore.RawClient(n.Store).Get(context.Background(), n.Store.Name(n.Geo.Fingerprint(), k))
		switch {
		case err == nil:
			out[i] = true
		case !errors.Is(err, os.ErrNotExist):
			t.Fatal(err)
		}
	}
	return out
}

// TestTheBoundEvictsTheLeastRecentlyUsedObjectsAndReportsEachEviction: a
// bucket bound to three objects holds three that node A stored; node B,
// bound so, loads the first and stores a fourth: its upload first evicts
// the two it used least (down to 0.9 of the bound), every node's, and
// B's feed records each evicted from the object mount; node C, which
// holds them in the bucket only, records them vanished at its next
// listing. The used bytes stay within the bound, and what stays loads.
func TestTheBoundEvictsTheLeastRecentlyUsedObjectsAndReportsEachEviction(t *testing.T) {
	cfg := rgwConfig(t)
	a := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "a"), cfg)
	old, want := a.StoreKeys(t, "bound-old", 3)
	bounded := cfg
	bounded.Capacity = 3 * objectLen()
	b := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "b"), bounded)
	c := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "c"), cfg)
	subB, subC := subscribe(t, b), subscribe(t, c)
	b.LoadAndCompare(t, old[:1], want[:1]) // a use: the first stays
	added, _ := b.StoreKeys(t, "bound-new", 1)

	st := b.Store.Stats()
	if st.Evicted != 2 || st.Used > bounded.Capacity || st.Full != 0 {
		t.Fatalf("after an upload past the bound: %d evicted, %d of %d bytes used, %d refused; want 2 evicted, within the bound, none refused", st.Evicted, st.Used, bounded.Capacity, st.Full)
	}
	if got := present(t, b, append(slices.Clone(old), added...)); !slices.Equal(got, []bool{true, false, false, true}) {
		t.Fatalf("in the bucket after the eviction (the used key, the two others, the new one): %v, want [true false false true]", got)
	}
	wantRecords(t, b, recordsUntil(t, subB, old[1:]), removals.Evicted, old[1:])
	wantRecords(t, c, recordsUntil(t, subC, old[1:]), removals.Vanished, old[1:])
	c.LoadAndCompare(t, old[:1], want[:1])
	if n, _ := c.Eng.Lookup(context.Background(), c.NS, old[1:2]); n != 0 {
		t.Fatal("an evicted object is still a hit on another node")
	}
}

// TestAnObjectLargerThanTheBoundIsRefusedAndNothingIsLost: with a bound
// smaller than one object, the upload fails with a full bucket
// (objstore.ErrFull, counted in Full), nothing is evicted, and the key
// still loads from its file.
func TestAnObjectLargerThanTheBoundIsRefusedAndNothingIsLost(t *testing.T) {
	cfg := rgwConfig(t)
	a := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "a"), cfg)
	kept, _ := a.StoreKeys(t, "small-bound-kept", 1)
	small := cfg
	small.Capacity = objectLen() - 1
	b := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "b"), small)
	objstoretest.Fill(b.Mem, 5)
	keys := [][]byte{[]byte("too-large")}
	src := b.Blocks(1, 0)
	b.Put(t, keys, src)
	want := [][]byte{b.Data(src[0])}
	testwait.Until(t, "the upload's end", time.Minute, func() bool { return b.Store.Stats().Failed == 1 })
	if st := b.Store.Stats(); st.Full != 1 || st.Evicted != 0 || st.Uploaded != 0 {
		t.Fatalf("an object larger than the bound: %d refused for room, %d evicted, %d uploaded; want 1, 0, 0", st.Full, st.Evicted, st.Uploaded)
	}
	if got := present(t, b, append(slices.Clone(kept), keys...)); !slices.Equal(got, []bool{true, false}) {
		t.Fatalf("in the bucket: %v, want the object stored before and not the refused one", got)
	}
	b.LoadAndCompare(t, keys, want)
	if err := b.Store.Upload(context.Background(), b.Geo.Fingerprint(), keys[0], firstFile(t, b.Dir)); !errors.Is(err, objstore.ErrFull) {
		t.Fatalf("an upload larger than the bound: %v, want objstore.ErrFull", err)
	}
}

// firstFile returns the path of a data file under dir.
func firstFile(t testing.TB, dir string) string {
	t.Helper()
	var found string
	filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && filepath.Ext(path) == ".kv" && found == "" {
			found = path
		}
		return nil
	})
	if found == "" {
		t.Fatalf("no data file under %s", dir)
	}
	return found
}

// TestPurgeRemovesTheNamespacesObjectsFromTheBucket: a purge on a node
// that holds a namespace's keys only in the bucket removes every object
// of it from the bucket, counts them, records each purged from the
// object mount, and a node opened after finds none.
func TestPurgeRemovesTheNamespacesObjectsFromTheBucket(t *testing.T) {
	cfg := rgwConfig(t)
	a := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "a"), cfg)
	keys, _ := a.StoreKeys(t, "purged", 3)
	b := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "b"), cfg)
	sub := subscribe(t, b)
	r, err := b.Eng.Purge(context.Background(), b.Geo.Fingerprint())
	if err != nil || r.Objects != len(keys) {
		t.Fatalf("purge: %+v, %v; want %d objects removed", r, err, len(keys))
	}
	wantRecords(t, b, recordsUntil(t, sub, keys), removals.Purged, keys)
	if got := present(t, b, keys); slices.Contains(got, true) {
		t.Fatalf("objects in the bucket after the purge: %v", got)
	}
	c := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "c"), cfg)
	if n, _ := c.Eng.Lookup(context.Background(), c.NS, keys[:1]); n != 0 {
		t.Fatal("a node opened after the purge finds a purged key")
	}
	if st := b.Store.Stats(); st.Purged != uint64(len(keys)) {
		t.Fatalf("Stats.Purged %d, want %d", st.Purged, len(keys))
	}
}

// TestAQuotaBelowTheBoundEvictsAndTriesAgain: a bucket whose quota holds
// two objects, under a bound of ten: the third upload, refused by the
// quota, evicts the least recently used object and succeeds; the bucket
// holds the two newest, and nothing was refused for good.
func TestAQuotaBelowTheBoundEvictsAndTriesAgain(t *testing.T) {
	cfg := rgwConfig(t)
	rgwCtl(t, "start-rgw")
	one := cfg
	one.Uploads, one.Requests, one.Capacity = 1, 1, 10*objectLen()
	a := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "a"), one)
	rgwCtl(t, "bucket-quota", cfg.Bucket, "20971520") // 20 MiB: two objects of 8 MiB
	var keys [][]byte
	for i := range 3 {
		k, _ := a.StoreKeys(t, fmt.Sprintf("quota-%d", i), 1)
		keys = append(keys, k...)
	}
	st := a.Store.Stats()
	if st.Uploaded != 3 || st.Evicted != 1 || st.Full != 0 {
		t.Fatalf("three uploads into a quota of two: %d uploaded, %d evicted, %d refused; want 3, 1, 0", st.Uploaded, st.Evicted, st.Full)
	}
	if got := present(t, a, keys); !slices.Equal(got, []bool{false, true, true}) {
		t.Fatalf("in the bucket: %v, want the two newest", got)
	}
}

// TestTieredDemotesToTheBucketAndAnotherNodeLoadsWhatItDemoted: the
// built-in tiered policy over one file mount, of room for three keys,
// sees the object mount as its cold mount (mount 1): no file is copied
// when published; the keys evicted from the file mount are uploaded at
// their demotion and stay hits there, and another node loads them with
// their bytes; one loaded on the first node is promoted back to its file
// mount, and its next load reads no object.
func TestTieredDemotesToTheBucketAndAnotherNodeLoadsWhatItDemoted(t *testing.T) {
	cfg := rgwConfig(t)
	mount := engine.Mount{Path: filepath.Join(t.TempDir(), "a"), Capacity: 3 * objectLen()}
	a := objstoretest.OpenNodeWith(t, mount, cfg, objstoretest.Options{NewPolicy: func() guest.Policy { return tiered.New() }})
	objstoretest.Fill(a.Mem, 6)
	keys := make([][]byte, 6)
	var want [][]byte
	for i := range keys {
		keys[i] = fmt.Appendf(nil, "tiered-%d", i)
		src := a.Blocks(1, i*a.Geo.BlocksPerKey())
		a.Put(t, keys[i:i+1], src)
		want = append(want, a.Data(src[0]))
	}
	var demoted, wantDemoted [][]byte
	for i, k := range keys {
		if a.Store.Has(a.Geo.Fingerprint(), k) {
			demoted = append(demoted, k)
			wantDemoted = append(wantDemoted, want[i])
		}
	}
	st, ts := a.Store.Stats(), a.Eng.TierStats()
	if len(demoted) == 0 || st.Uploaded != 0 || ts.Demotions != uint64(len(demoted)) {
		t.Fatalf("%d keys in the bucket, %d uploaded in the background, %d demotions; want the demoted alone, none copied when published", len(demoted), st.Uploaded, ts.Demotions)
	}
	if n, err := a.Eng.Lookup(context.Background(), a.NS, keys); err != nil || n != len(keys) {
		t.Fatalf("%d of %d keys hits on the demoting node (%v)", n, len(keys), err)
	}
	b := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "b"), cfg)
	b.LoadAndCompare(t, demoted, wantDemoted)

	// A demoted key loaded on the demoting node is promoted back to its
	// file mount, and loads from there.
	a.LoadAndCompare(t, demoted[:1], wantDemoted[:1])
	testwait.Until(t, "the promotion", time.Minute, func() bool { return a.Eng.TierStats().Promotions >= 1 })
	gets := a.Store.Stats().Gets
	a.LoadAndCompare(t, demoted[:1], wantDemoted[:1])
	if a.Store.Stats().Gets != gets {
		t.Fatal("the promoted key's next load read the bucket")
	}
	t.Logf("tiered over one mount of 3 keys and the bucket: %d of %d keys demoted to the bucket, 0 copied when published; another node loads them; one loaded on the first node is promoted back", len(demoted), len(keys))
}

// TestTheNodesOfAPrefixAgreeOnOneBound: the first node with a bound writes
// it to the bucket; a node without one takes it; a node with another
// fails to open, naming both, and what the bucket holds is untouched.
func TestTheNodesOfAPrefixAgreeOnOneBound(t *testing.T) {
	cfg := rgwConfig(t)
	bounded := cfg
	bounded.Capacity = 3 * objectLen()
	a := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "a"), bounded)
	keys, _ := a.StoreKeys(t, "agreed", 1)
	b := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "b"), cfg)
	if _, capacity, _ := b.Store.Usage(); capacity != bounded.Capacity {
		t.Fatalf("a node without a bound has %d, want the agreed %d", capacity, bounded.Capacity)
	}
	other := cfg
	other.Capacity = 5 * objectLen()
	_, err := objstore.Open(context.Background(), other)
	if !errors.Is(err, objstore.ErrConfig) || !strings.Contains(err.Error(), strconv.FormatInt(bounded.Capacity, 10)) || !strings.Contains(err.Error(), strconv.FormatInt(other.Capacity, 10)) {
		t.Fatalf("a node with another bound: %v, want ErrConfig naming both bounds", err)
	}
	if got := present(t, a, keys); !got[0] {
		t.Fatal("a refused node's open removed an object")
	}
}

// TestABoundObjectThatHoldsNoBoundIsRefused: a bound's object whose
// bytes are not a size in range fails every open with ErrConfig naming
// it, and removes nothing.
func TestABoundObjectThatHoldsNoBoundIsRefused(t *testing.T) {
	for _, tc := range []struct{ name, body string }{
		{"words", "ten terabytes\n"},
		{"negative", "-5\n"},
		{"zero", "0\n"},
		{"past 2^60", "1152921504606846977\n"},
		{"long", strings.Repeat("9", 40) + "\n"},
		{"empty", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := rgwConfig(t)
			a := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "a"), cfg)
			keys, _ := a.StoreKeys(t, "hostile", 1)
			if err := objstore.RawClient(a.Store).Put(context.Background(), cfg.Prefix+"kvhost-capacity", []byte(tc.body)); err != nil {
				t.Fatal(err)
			}
			for _, capacity := range []int64{0, 3 * objectLen()} {
				c := cfg
				c.Capacity = capacity
				if _, err := objstore.Open(context.Background(), c); !errors.Is(err, objstore.ErrConfig) || !strings.Contains(err.Error(), "kvhost-capacity") {
					t.Fatalf("open with capacity %d beside a bound's object of %q: %v, want ErrConfig naming the object", capacity, tc.body, err)
				}
			}
			if got := present(t, a, keys); !got[0] {
				t.Fatal("a refused open removed an object")
			}
		})
	}
}

// TestABoundObjectTheStoreRefusesStopsOnlyANodeWithABound: where the
// store refuses to read the bound's object, a node without a bound opens
// without one, and a node with one fails, naming the object.
func TestABoundObjectTheStoreRefusesStopsOnlyANodeWithABound(t *testing.T) {
	cfg := rgwConfig(t)
	a := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "a"), cfg)
	if err := objstore.RawClient(a.Store).DenyGet(context.Background(), cfg.Prefix+"kvhost-capacity"); err != nil {
		t.Fatal(err)
	}
	st, err := objstore.Open(context.Background(), cfg)
	if err != nil {
		t.Fatalf("a node without a bound beside a bound's object it may not read: %v, want it open", err)
	}
	st.Close()
	bounded := cfg
	bounded.Capacity = objectLen()
	if _, err := objstore.Open(context.Background(), bounded); err == nil || !strings.Contains(err.Error(), "kvhost-capacity") {
		t.Fatalf("a node with a bound beside a bound's object it may not read: %v, want a failure naming the object", err)
	}
}
