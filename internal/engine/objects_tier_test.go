//go:build invariants

package engine

import (
	"bytes"
	"context"
	"math/rand/v2"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/internal/engine/removals"
	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// The policy decides what the object mount takes: it is described to the
// policy as the last mount (MOUNT_OBJECT), a policy that demotes sends
// eviction victims there, and admission may send a file there.

// objectPolicy is demotingPolicy (mount 0's victims to mount 1, the object
// mount beside one file mount) that records the mount descriptions and,
// with admit, admits every file to mount 1.
type objectPolicy struct {
	*demotingPolicy
	admit  bool
	mu     sync.Mutex
	mounts []abi.MountRecord
}

func (p *objectPolicy) Features() abi.Feature {
	return p.demotingPolicy.Features() | abi.FeatureMounts | abi.FeatureAdmitMount
}

func (p *objectPolicy) UpdateMounts(_ context.Context, recs []abi.MountRecord) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.mounts = slices.Clone(recs)
	return nil
}

func (p *objectPolicy) Admit(ctx context.Context, recs []abi.AdmitRecord) error {
	err := p.testPolicy.Admit(ctx, recs)
	if p.admit {
		for i := range recs {
			recs[i].Target = 1
		}
	}
	return err
}

// openObjectTier opens an engine with one file mount of room for six
// files, objs as its object mount and pol as its policy, stores ten keys
// one by one, and returns the keys with their bytes.
func openObjectTier(t *testing.T, objs *memObjects, pol *objectPolicy) (*Engine, NamespaceID, *testCache, *removals.Subscription, [][]byte, [][]byte) {
	t.Helper()
	g := smallGeometry(true)
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir(), Capacity: 6 * (4096 + g.KeyBytes())}}, Policy: pol, Objects: objs})
	sub := subscribe(t, e)
	ns, c := declareSmall(t, e, 64)
	r := rand.New(rand.NewPCG(95, 3))
	keys := testKeys("tier", 10)
	var want [][]byte
	for i, k := range keys {
		bl := []int{4 * i, 4*i + 1, 4*i + 2, 4*i + 3}
		c.fill(r, bl)
		want = append(want, c.data(bl))
		storeAndCheck(t, e, c, [][]byte{k}, [][]int{bl})
	}
	return e, ns, c, sub, keys, want
}

// TestThePolicyDemotesToTheObjectMount: with a policy that demotes, the
// object mount is described to it last, with MOUNT_OBJECT; no file is
// copied when published; each eviction victim the policy sends there is
// copied before its file goes, recorded moved to the object mount, still
// a hit, and loads with its bytes.
func TestThePolicyDemotesToTheObjectMount(t *testing.T) {
	objs := newMemObjects(t)
	pol := &objectPolicy{demotingPolicy: &demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}}
	e, ns, c, sub, keys, want := openObjectTier(t, objs, pol)
	pol.mu.Lock()
	mounts := pol.mounts
	pol.mu.Unlock()
	if len(mounts) != 2 || mounts[1].Mount != 1 || mounts[1].Flags&abi.MountObject == 0 || mounts[0].Flags&abi.MountObject != 0 {
		t.Fatalf("the mounts described: %+v; want the file mount, then the object mount with MOUNT_OBJECT", mounts)
	}
	var demoted [][]byte
	var wantDemoted [][]byte
	for i, k := range keys {
		if e.find(e.tables.get(ns), k) == nil {
			demoted = append(demoted, k)
			wantDemoted = append(wantDemoted, want[i])
		}
	}
	objs.mu.Lock()
	published, uploads, held := objs.published, objs.uploads, len(objs.objs)
	objs.mu.Unlock()
	if len(demoted) == 0 || published != 0 || uploads != len(demoted) || held != len(demoted) {
		t.Fatalf("%d keys demoted; the object mount was told of %d published files and copied %d, holds %d; want the demoted alone, copied at their demotion", len(demoted), published, uploads, held)
	}
	if st := e.TierStats(); st.Demotions != uint64(len(demoted)) {
		t.Fatalf("TierStats.Demotions %d, want %d", st.Demotions, len(demoted))
	}
	var got []string
	for _, r := range feedRecords(t, sub) {
		if r.Reason != removals.Moved || r.Mount != 0 || r.To != 1 {
			t.Fatalf("record %+v: want moved from mount 0 to the object mount", r)
		}
		got = append(got, r.Key)
	}
	if len(got) != len(demoted) {
		t.Fatalf("records of %q, want one of each of the %d demoted keys", got, len(demoted))
	}
	if n, _ := e.Lookup(context.Background(), ns, keys); n != len(keys) {
		t.Fatalf("%d of %d keys hits after the demotions", n, len(keys))
	}
	loadAndCompare(t, e, c, demoted, fourBlocks(40, len(demoted)), wantDemoted)
}

// TestADemotionToAFullObjectMountDeletesOnlyWhereThePolicySaysSo: where
// the object mount has no room, a victim the policy sends there with
// MOVE_DELETE_IF_FULL is deleted (recorded evicted, a miss after), and
// nothing is copied.
func TestADemotionToAFullObjectMountDeletesOnlyWhereThePolicySaysSo(t *testing.T) {
	objs := newMemObjects(t)
	objs.full = true
	pol := &objectPolicy{demotingPolicy: &demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor), deleteIfFull: true}}
	e, ns, _, sub, keys, _ := openObjectTier(t, objs, pol)
	gone := missing(t, e, ns, keys)
	if st := e.TierStats(); len(gone) == 0 || st.DemotionDeletes != uint64(len(gone)) || st.Demotions != 0 {
		t.Fatalf("%d keys gone, %d demotion deletes, %d demotions; want the victims deleted, none demoted", len(gone), st.DemotionDeletes, st.Demotions)
	}
	for _, r := range feedRecords(t, sub) {
		if r.Reason != removals.Evicted || r.To != removals.NoMount {
			t.Fatalf("record %+v: want evicted", r)
		}
	}
	if objs.Has(smallGeometry(true).Fingerprint(), []byte(gone[0])) {
		t.Fatal("a full object mount took a victim")
	}
}

// TestAdmissionSendsAFileToTheObjectMount: a policy that demotes and
// admits every file to the object mount has each written on its name's
// mount and copied to the object mount once published.
func TestAdmissionSendsAFileToTheObjectMount(t *testing.T) {
	objs := newMemObjects(t)
	pol := &objectPolicy{demotingPolicy: &demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}, admit: true}
	_, _, _, _, keys, _ := openObjectTier(t, objs, pol)
	objs.mu.Lock()
	defer objs.mu.Unlock()
	if objs.published != len(keys) || objs.uploads != 0 {
		t.Fatalf("%d files published to the object mount, %d copied at demotions; want every one of %d published, none demoted (they were there)", objs.published, objs.uploads, len(keys))
	}
}

// TestAKeyLoadedFromTheObjectMountIsPromotedWhereThePolicyAdmitsIt: with
// a policy that decides what the object mount takes, a key demoted there
// and then loaded whole is stored again on the file mount, from the
// bytes its load read: its object is opened once, by the load; the
// promoted file verifies and holds the key's bytes, and the key's next
// load is from that file, not the object mount.
func TestAKeyLoadedFromTheObjectMountIsPromotedWhereThePolicyAdmitsIt(t *testing.T) {
	objs := newMemObjects(t)
	pol := &objectPolicy{demotingPolicy: &demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}}
	e, ns, c, _, keys, want := openObjectTier(t, objs, pol)
	i := slices.IndexFunc(keys, func(k []byte) bool { return e.find(e.tables.get(ns), k) == nil })
	if i < 0 {
		t.Fatal("no key was demoted")
	}
	into := [][]int{{40, 41, 42, 43}}
	loadAndCompare(t, e, c, keys[i:i+1], into, want[i:i+1])
	testwait.Until(t, "the promotion", 10*time.Second, func() bool { return e.TierStats().Promotions == 1 })
	if n := objs.opened(c.geo.Fingerprint(), keys[i]); n != 1 {
		t.Fatalf("the promoted key's object was opened %d times, want once (its load)", n)
	}
	promotedFileVerifies(t, e, ns, keys[i], want[i])
	gets := objs.reads.Load()
	loadAndCompare(t, e, c, keys[i:i+1], into, want[i:i+1])
	if objs.reads.Load() != gets {
		t.Fatal("the promoted key's next load read the object mount")
	}
}

// TestAKeyLoadedIntoDeviceMemoryIsPromotedFromItsVerifiedBounce: a key
// only the object mount holds, loaded whole into device memory (the fake
// GPU mover) on an engine whose policy demotes, is promoted from the
// memory file its load verified it in: each object is opened once, and
// the promoted files verify and load into host memory with the keys'
// bytes.
func TestAKeyLoadedIntoDeviceMemoryIsPromotedFromItsVerifiedBounce(t *testing.T) {
	objs, _, _, keys, want := objectPair(t, "devpromote", 2)
	pol := &objectPolicy{demotingPolicy: &demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}}
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: pol, Objects: objs,
		Movers: map[region.Kind]MoverFactory{region.KindDevice: func(MountInfo) (transfer.Mover, error) { return &fakeMover{}, nil }}})
	ns, c := declareSmall(t, e, 64)
	cid, _ := registerFakeDevice(t, e, ns, c.geo, 92, 32)
	res := wait(t)(e.Load(context.Background(), LoadRequest{Cache: cid, Keys: keys, Blocks: [][]int{{3, 2, 1, 0}, {4, 5, 6, 7}}}))
	wantOutcomes(t, "load into device memory", res, OutcomeLoaded)
	testwait.Until(t, "the promotions", 10*time.Second, func() bool { return e.TierStats().Promotions == uint64(len(keys)) })
	for i, k := range keys {
		if n := objs.opened(c.geo.Fingerprint(), k); n != 1 {
			t.Fatalf("key %s: its object was opened %d times, want once (its load)", k, n)
		}
		promotedFileVerifies(t, e, ns, k, want[i])
	}
	gets := objs.reads.Load()
	loadAndCompare(t, e, c, keys, [][]int{{8, 9, 10, 11}, {12, 13, 14, 15}}, want)
	if objs.reads.Load() != gets {
		t.Fatal("the promoted keys' loads read the object mount")
	}
}

// TestAPromotionWhoseBytesChangedIsNotStored: a promotion whose bytes no
// longer match the object's checksum (a client that wrote its blocks
// before the copy was made) stores nothing, and is counted.
func TestAPromotionWhoseBytesChangedIsNotStored(t *testing.T) {
	objs, _, _, keys, _ := objectPair(t, "changed", 1)
	pol := &objectPolicy{demotingPolicy: &demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}}
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: pol, Objects: objs})
	ns, c := declareSmall(t, e, 16)
	fp := c.geo.Fingerprint()
	f, err := objs.Open(context.Background(), fp, keys[0])
	if err != nil {
		t.Fatal(err)
	}
	h, err := readObjectHeader(f)
	if err != nil {
		t.Fatal(err)
	}
	objs.mu.Lock()
	obj := bytes.Clone(objs.objs[objName(fp, keys[0])])
	objs.mu.Unlock()
	obj[len(obj)-1] ^= 1 // a byte of the payload, changed after the load verified it
	p := e.objs.promoter
	p.promote(promotion{ns: ns, fp: fp, geo: c.geo, key: keys[0], h: h, k: 0, obj: obj})
	if p.unverified.Load() != 1 || p.promoted.Load() != 0 {
		t.Fatalf("%d promotions unverified, %d stored; want the changed one refused", p.unverified.Load(), p.promoted.Load())
	}
	if e.find(e.tables.get(ns), keys[0]) != nil {
		t.Fatal("a promotion whose bytes changed was stored")
	}
}

// promotedFileVerifies checks that key's file on e (the one a promotion
// stored) has payload checksums, that its key's checksum is its
// payload's, and that its payload is want.
func promotedFileVerifies(t *testing.T, e *Engine, ns NamespaceID, key, want []byte) {
	t.Helper()
	en := e.find(e.tables.get(ns), key)
	if en == nil || en.Mount != 0 {
		t.Fatalf("key %s: entry %+v, want a file on mount 0", key, en)
	}
	b, err := os.ReadFile(en.Path)
	if err != nil {
		t.Fatal(err)
	}
	h, err := format.Decode(b)
	if err != nil {
		t.Fatalf("key %s: the promoted file's header: %v", key, err)
	}
	if len(h.Keys) != 1 || h.Flags&format.FlagPayloadSums == 0 {
		t.Fatalf("key %s: the promoted file holds %d keys, flags %#x; want the key alone, with payload checksums", key, len(h.Keys), h.Flags)
	}
	if sum := memorySums(b, h, []bool{true})[0]; sum != h.Keys[0].Sum {
		t.Fatalf("key %s: the promoted file's payload checksum 0x%08x, its header says 0x%08x", key, sum, h.Keys[0].Sum)
	}
	var got []byte
	h.Walk(nil, func(_, _, _, _ int, off int64) {
		got = append(got, b[int64(h.Len())+off:int64(h.Len())+off+int64(h.BlockBytes)]...)
	})
	if !bytes.Equal(got, want) {
		t.Fatalf("key %s: the promoted file holds other bytes than stored", key)
	}
}

// BenchmarkPromotionCopy measures what a promotion adds to a load into
// host memory from the object mount: the copy of the key's blocks into
// the daemon's memory before the load answers (promoteFromBlocks), for a
// key of 8 MiB in 16 blocks of 8 layers, into the buffer the last
// promotion gave back, against the same run's ceiling, one copy of the
// key's bytes from one buffer into another made once.
func BenchmarkPromotionCopy(b *testing.B) {
	g := Geometry{Model: "bench/promote", Layers: 8, KVHeads: 8, HeadSize: 128, DtypeSize: 2, TokensPerBlock: 16, TokensPerKey: 256, TPSize: 1}
	e := openEngine(b, Config{Mounts: []Mount{{Path: b.TempDir()}}, Policy: newTestPolicy(1, abi.OrderLayerMajor)})
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		b.Fatal(err)
	}
	const nb = 64
	c := newTestCache(b, e, ns, g, nb, layoutPlaneFirst)
	r := rand.New(rand.NewPCG(8, 9))
	var src []int
	for i := range g.BlocksPerKey() {
		src = append(src, 2*i+1) // every other block: no run of the key is one copy
	}
	c.fill(r, src)
	key := testKeys("promote", 1)
	storeAndCheck(b, e, c, key, [][]int{src})
	en := e.find(e.tables.get(ns), key[0])
	file, err := os.ReadFile(en.Path)
	if err != nil {
		b.Fatal(err)
	}
	h, err := format.Decode(file)
	if err != nil {
		b.Fatal(err)
	}
	cc := e.tables.cache(c.id)
	p := &objectPromoter{queue: make(chan promotion, 1), bufs: make(chan []byte, 1)}
	p.start.Do(func() {}) // nothing promotes: the benchmark drains the queue
	o := &objectTier{promoter: p}
	from, to := make([]byte, g.KeyBytes()), make([]byte, g.KeyBytes())
	var dCopy, dCeiling time.Duration
	for b.Loop() {
		t0 := time.Now()
		o.promoteFromBlocks(cc, h, 0, src)
		dCopy += time.Since(t0)
		pr := <-p.queue
		pr.done() // its buffer serves the next, as a promotion's does
		t0 = time.Now()
		copy(to, from)
		dCeiling += time.Since(t0)
	}
	n := float64(b.N) * float64(g.KeyBytes())
	b.ReportMetric(n/dCopy.Seconds()/1e9, "copy-GB/s")
	b.ReportMetric(n/dCeiling.Seconds()/1e9, "ceiling-GB/s")
	b.ReportMetric(dCeiling.Seconds()/dCopy.Seconds(), "copy/ceiling")
}
