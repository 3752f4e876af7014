//go:build invariants

package engine

import (
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/internal/engine/removals"
	"github.com/kvhost/kvhost/internal/testwait"
)

// Demotion to the object mount never makes a store wait for an upload
// where the bucket already holds enough victims (objdemote.go).

// openDemoting opens an engine with one file mount of room for ten
// one-key files, watermarks 0.95 and 0.5, objs as its object mount and
// a policy that demotes every victim there; it returns the engine, its
// namespace and a cache of 96 blocks.
func openDemoting(t *testing.T, objs *memObjects) (*Engine, NamespaceID, *testCache) {
	t.Helper()
	g := smallGeometry(true)
	pol := &objectPolicy{demotingPolicy: &demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}}
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir(), Capacity: 10 * (4096 + g.KeyBytes()), HighWatermark: 0.95, LowWatermark: 0.5}},
		Policy: pol, Objects: objs, TickInterval: 10 * time.Millisecond})
	ns, c := declareSmall(t, e, 96)
	return e, ns, c
}

// storeOneByOne stores keys[from:to] one by one, key i from blocks 4i to
// 4i+3 filled from r, and returns their bytes.
func storeOneByOne(t *testing.T, e *Engine, c *testCache, r *rand.Rand, keys [][]byte, from, to int) [][]byte {
	t.Helper()
	var want [][]byte
	for i, bl := range fourBlocks(4*from, to-from) {
		i += from
		c.fill(r, bl)
		want = append(want, c.data(bl))
		storeAndCheck(t, e, c, keys[i:i+1], [][]int{bl})
	}
	return want
}

// TestAStoreThatNeedsRoomUsesWhatTheBucketHoldsWhileUploadsAreBlocked:
// above the low watermark, the coldest files bound for the object mount
// are uploaded ahead of need; once the bucket's uploads block, a store
// that needs room still completes, evicting the files whose keys the
// bucket holds (recorded moved there), and nothing is lost: every key
// loads with its bytes, from its file or from the bucket, once the
// uploads go on.
func TestAStoreThatNeedsRoomUsesWhatTheBucketHoldsWhileUploadsAreBlocked(t *testing.T) {
	objs := newMemObjects(t)
	e, ns, c := openDemoting(t, objs)
	sub := subscribe(t, e)
	fp := c.geo.Fingerprint()
	r := rand.New(rand.NewPCG(95, 5))
	keys := testKeys("ahead", 11)
	want := storeOneByOne(t, e, c, r, keys, 0, 6) // 6 of 10 files: above the low watermark (5)
	testwait.Until(t, "the uploads ahead of need", 10*time.Second, func() bool {
		for _, k := range keys[:5] {
			if !objs.Has(fp, k) {
				return false
			}
		}
		return true
	})
	if st := e.TierStats(); st.Demotions != 0 {
		t.Fatalf("%d demotions before any eviction", st.Demotions)
	}
	release := objs.holdUploads()
	defer release()
	want = append(want, storeOneByOne(t, e, c, r, keys, 6, 9)...) // 9 files: below the high watermark (9.5)

	// The tenth file passes the high watermark: the eviction makes room
	// down to the low one, 5 files, all in the bucket already.
	want = append(want, storeOneByOne(t, e, c, r, keys, 9, 10)...)
	// One more file, above the low watermark again: its uploads ahead
	// of need are held, and the bucket takes nothing.
	want = append(want, storeOneByOne(t, e, c, r, keys, 10, 11)...)
	testwait.Until(t, "an upload held", 10*time.Second, func() bool { return objs.held.Load() > 0 })
	for i, k := range keys[6:] {
		if objs.Has(fp, k) {
			t.Fatalf("key %d reached the bucket while uploads were held", 6+i)
		}
	}
	if st := e.TierStats(); st.Demotions != 5 || st.MoveFailures != 0 {
		t.Fatalf("%d demotions, %d failures; want the 5 coldest files dropped for their objects", st.Demotions, st.MoveFailures)
	}
	for i, k := range keys[:5] {
		if e.find(e.tables.get(ns), k) != nil {
			t.Fatalf("key %d: its file stayed; the eviction should have taken the coldest", i)
		}
	}
	for _, rec := range feedRecords(t, sub) {
		if rec.Reason != removals.Moved || rec.To != 1 {
			t.Fatalf("record %+v: want moved to the object mount", rec)
		}
	}
	release()
	loadAndCompare(t, e, c, keys, fourBlocks(40, len(keys)), want)
}

// TestAStoreWhoseVictimsAreNotInTheBucketLosesNothing: where no victim's
// key is in the bucket and the uploads block, a store that needs room
// waits for them no longer than its context, fails, and drops no file;
// once the uploads go on, every key loads with its bytes and the store
// completes.
func TestAStoreWhoseVictimsAreNotInTheBucketLosesNothing(t *testing.T) {
	objs := newMemObjects(t)
	release := objs.holdUploads()
	defer release()
	e, ns, c := openDemoting(t, objs)
	r := rand.New(rand.NewPCG(95, 6))
	keys := testKeys("behind", 10)
	want := storeOneByOne(t, e, c, r, keys, 0, 9)
	testwait.Until(t, "an upload held", 10*time.Second, func() bool { return objs.held.Load() > 0 })

	bl := [][]int{{36, 37, 38, 39}}
	c.fill(r, bl[0])
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys[9:], Blocks: bl}))
	if o, err := res.Keys[0].Outcome, res.Keys[0].Err; o == OutcomeStored || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("store whose victims' uploads block: %v (%v), want failed at its deadline", o, err)
	}
	for i, k := range keys[:9] {
		if e.find(e.tables.get(ns), k) == nil {
			t.Fatalf("key %d: its file was dropped before its upload succeeded", i)
		}
	}
	release()
	loadAndCompare(t, e, c, keys[:9], fourBlocks(40, 9), want)
	storeAndCheck(t, e, c, keys[9:], bl)
}

// TestAStoreDoesNotWaitOnABucketThatFails: once an upload to the
// object mount failed (and none succeeded since), a store that needs
// room whose victims the bucket lacks fails for room at once, with no
// upload tried for it and every file kept; once uploads succeed again,
// the same store completes.
func TestAStoreDoesNotWaitOnABucketThatFails(t *testing.T) {
	objs := newMemObjects(t)
	objs.refuse = syscall.EIO
	e, ns, c := openDemoting(t, objs)
	d := e.tier.demoter
	d.mu.Lock()
	d.minPause, d.maxPause = 10*time.Millisecond, 10*time.Millisecond // before any failure
	d.mu.Unlock()
	r := rand.New(rand.NewPCG(95, 7))
	keys := testKeys("failing", 11)
	want := storeOneByOne(t, e, c, r, keys, 0, 6) // above the low watermark: the demoter tries, and fails
	testwait.Until(t, "a failed upload", 10*time.Second, func() bool { return e.tier.demoter.failed.Load() > 0 })
	// Up to the capacity: the last of these found no victim to drop.
	want = append(want, storeOneByOne(t, e, c, r, keys, 6, 10)...)

	bl := [][]int{{40, 41, 42, 43}}
	c.fill(r, bl[0])
	tried := objs.tried.Load()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys[10:], Blocks: bl}))
	if o, err := res.Keys[0].Outcome, res.Keys[0].Err; o == OutcomeStored || !errors.Is(err, ErrNoSpace) || !strings.Contains(err.Error(), "not uploaded yet") {
		t.Fatalf("store needing room from a failing bucket: %v (%v), want failed with ErrNoSpace, saying its victims are not uploaded", o, err)
	}
	// The demoter tries again after each pause (10 ms here), the store
	// not: no more than the demoter's few.
	if n := objs.tried.Load() - tried; n > 2*demoteUploads {
		t.Fatalf("%d uploads tried during the store; a store does not wait on a failing bucket", n)
	}
	for i, k := range keys[:10] {
		if e.find(e.tables.get(ns), k) == nil {
			t.Fatalf("key %d: its file was dropped, not uploaded", i)
		}
	}
	objs.mu.Lock()
	objs.refuse = nil
	objs.mu.Unlock()
	testwait.Until(t, "the uploads after the failure", 30*time.Second, func() bool {
		failing, _ := e.tier.demoter.failing()
		return !failing && objs.Has(c.geo.Fingerprint(), keys[0])
	})
	storeAndCheck(t, e, c, keys[10:], bl)
	want = append(want, c.data(bl[0]))
	loadAndCompare(t, e, c, keys, fourBlocks(44, len(keys)), want)
}

// fourBlocks returns n lists of 4 blocks, from first on: first to
// first+3, then the next 4, and so on.
func fourBlocks(first, n int) [][]int {
	out := make([][]int, n)
	for i := range out {
		b := first + 4*i
		out[i] = []int{b, b + 1, b + 2, b + 3}
	}
	return out
}
