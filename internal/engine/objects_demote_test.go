//go:build invariants

package engine

import (
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
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
	return openDemotingWith(t, objs, newObjectPolicy(), 0)
}

// newObjectPolicy returns a policy that demotes every victim to the
// object mount (mount 1).
func newObjectPolicy() *objectPolicy {
	return &objectPolicy{demotingPolicy: &demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}}
}

// openDemotingWith is openDemoting with pol as the policy and updates as
// Config.MountUpdateInterval.
func openDemotingWith(t *testing.T, objs *memObjects, pol policy.Policy, updates time.Duration) (*Engine, NamespaceID, *testCache) {
	t.Helper()
	g := smallGeometry(true)
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir(), Capacity: 10 * (4096 + g.KeyBytes()), HighWatermark: 0.95, LowWatermark: 0.5}},
		Policy: pol, Objects: objs, TickInterval: 10 * time.Millisecond, MountUpdateInterval: updates})
	ns, c := declareSmall(t, e, 96)
	return e, ns, c
}

// openFailingBucket is openDemoting with objs refusing every upload
// (EIO) until accept, and the demoter pausing 10 ms after a failure.
func openFailingBucket(t *testing.T, objs *memObjects) (*Engine, NamespaceID, *testCache) {
	t.Helper()
	objs.refuse = syscall.EIO
	e, ns, c := openDemoting(t, objs)
	d := e.tier.demoter
	d.mu.Lock()
	d.minPause, d.maxPause = 10*time.Millisecond, 10*time.Millisecond // before any failure
	d.mu.Unlock()
	return e, ns, c
}

// accept has o take uploads again (refuse no more).
func (o *memObjects) accept() {
	o.mu.Lock()
	o.refuse = nil
	o.mu.Unlock()
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
	e, ns, c := openFailingBucket(t, objs)
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
	objs.accept()
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

// bucketUploads returns how many files Upload copied to objs and the
// bytes of every object it holds, and how many Published copied.
func (o *memObjects) bucketUploads() (uploads, published int, bytes uint64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, b := range o.objs {
		bytes += uint64(len(b))
	}
	return o.uploads, o.published, bytes
}

// TestTheDemoterCountsEachFileItUploadsAndItsBytes: the files a demoter
// pass uploads ahead of need are counted in TierStats, one upload each
// with its file's bytes, as many and as large as what the bucket took,
// and no failure.
func TestTheDemoterCountsEachFileItUploadsAndItsBytes(t *testing.T) {
	objs := newMemObjects(t)
	e, _, c := openDemoting(t, objs)
	r := rand.New(rand.NewPCG(95, 8))
	keys := testKeys("counted", 6)
	storeOneByOne(t, e, c, r, keys, 0, 6) // above the low watermark: the 5 coldest at least are uploaded
	var st TierStats
	testwait.Until(t, "the uploads ahead of need, counted", 10*time.Second, func() bool {
		st = e.TierStats()
		n, _, bytes := objs.bucketUploads()
		return n >= 5 && st.ObjectUploads == uint64(n) && st.ObjectUploadBytes == bytes
	})
	if n, published, _ := objs.bucketUploads(); published != 0 {
		t.Fatalf("%d files published to the bucket besides %d uploads; want its objects the demoter's alone", published, n)
	}
	if st.ObjectUploadBytes != st.ObjectUploads*uint64(4096+c.geo.KeyBytes()) {
		t.Fatalf("%d uploads of %d bytes; want %d bytes each", st.ObjectUploads, st.ObjectUploadBytes, 4096+c.geo.KeyBytes())
	}
	if st.ObjectUploadFailures != 0 {
		t.Fatalf("%d upload failures, none refused", st.ObjectUploadFailures)
	}
}

// TestAFailedDemoterUploadCountsAFailureAndNoUpload: an upload the bucket
// refuses counts a failure, not an upload nor its bytes; once the bucket
// takes them again, the uploads count and the failures stay.
func TestAFailedDemoterUploadCountsAFailureAndNoUpload(t *testing.T) {
	objs := newMemObjects(t)
	e, _, c := openFailingBucket(t, objs)
	r := rand.New(rand.NewPCG(95, 9))
	keys := testKeys("refused", 6)
	storeOneByOne(t, e, c, r, keys, 0, 6)
	var st TierStats
	testwait.Until(t, "a refused upload, counted", 10*time.Second, func() bool {
		st = e.TierStats()
		return st.ObjectUploadFailures > 0 && st.ObjectUploadFailures == uint64(objs.tried.Load())
	})
	if st.ObjectUploads != 0 || st.ObjectUploadBytes != 0 {
		t.Fatalf("%d uploads of %d bytes counted; the bucket refused every one", st.ObjectUploads, st.ObjectUploadBytes)
	}
	objs.accept()
	failed := e.TierStats().ObjectUploadFailures
	testwait.Until(t, "the uploads once the bucket takes them", 10*time.Second, func() bool {
		st = e.TierStats()
		n, _, bytes := objs.bucketUploads()
		return n >= 5 && st.ObjectUploads == uint64(n) && st.ObjectUploadBytes == bytes
	})
	if st.ObjectUploadFailures != failed {
		t.Fatalf("%d upload failures after the bucket took them again, %d before", st.ObjectUploadFailures, failed)
	}
}

// askingPolicy is an objectPolicy that counts the victims asked of it.
type askingPolicy struct {
	*objectPolicy
	asked atomic.Int64
}

func (p *askingPolicy) Evictions(ctx context.Context, req abi.EvictRequest, max int) ([]policy.Eviction, error) {
	p.asked.Add(1)
	return p.objectPolicy.Evictions(ctx, req, max)
}

// TestAnIdleDemoterAsksThePolicyNothingUntilSomethingChanges: above the
// low watermark, once its uploads are done, the demoter's passes ask the
// policy for no victims while nothing changes; once the bucket loses an
// object (with no mount description sent to the policy since), a pass
// asks and uploads it again, and once a load hits a key, a pass asks
// again.
func TestAnIdleDemoterAsksThePolicyNothingUntilSomethingChanges(t *testing.T) {
	objs := newMemObjects(t)
	pol := &askingPolicy{objectPolicy: newObjectPolicy()}
	e, _, c := openDemotingWith(t, objs, pol, -1) // the mounts described at Open only
	d := e.tier.demoter
	d.mu.Lock()
	d.recheck = time.Hour // only changes make a pass ask
	d.mu.Unlock()
	fp := c.geo.Fingerprint()
	r := rand.New(rand.NewPCG(95, 10))
	keys := testKeys("idle", 6)
	want := storeOneByOne(t, e, c, r, keys, 0, 6)
	testwait.Until(t, "the uploads ahead of need", 10*time.Second, func() bool {
		_, _, n := objs.Usage()
		return n == len(keys)
	})
	// idle waits for passes that skip (a pass skips only once the last
	// that asked left nothing to retry) and returns the victims asked
	// meanwhile.
	idle := func(passes uint64) int64 {
		s := d.skipped.Load()
		testwait.Until(t, "a pass that skips", 10*time.Second, func() bool { return d.skipped.Load() > s })
		asked := pol.asked.Load()
		s = d.skipped.Load()
		testwait.Until(t, "passes that skip", 10*time.Second, func() bool { return d.skipped.Load() >= s+passes })
		return pol.asked.Load() - asked
	}
	if n := idle(20); n != 0 {
		t.Fatalf("20 idle passes asked the policy %d times; nothing changed", n)
	}

	asked := pol.asked.Load()
	objs.evict(fp, keys[0])
	testwait.Until(t, "the lost object uploaded again", 10*time.Second, func() bool { return objs.Has(fp, keys[0]) })
	if pol.asked.Load() == asked {
		t.Fatal("the object was uploaded again with no victims asked")
	}

	_ = idle(1)
	asked = pol.asked.Load()
	loadAndCompare(t, e, c, keys[:1], fourBlocks(40, 1), want[:1])
	testwait.Until(t, "a pass that asks after a hit", 10*time.Second, func() bool { return pol.asked.Load() > asked })
}
