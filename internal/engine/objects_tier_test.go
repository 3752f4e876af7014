//go:build invariants

package engine

import (
	"context"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/internal/engine/removals"
	"github.com/kvhost/kvhost/internal/testwait"
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
	into := make([][]int, len(demoted))
	for i := range into {
		into[i] = []int{40 + 4*i, 41 + 4*i, 42 + 4*i, 43 + 4*i}
	}
	loadAndCompare(t, e, c, demoted, into, wantDemoted)
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
// and then loaded whole is stored again on the file mount, with its
// bytes, and its next load is from that file, not the object mount.
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
	en := e.find(e.tables.get(ns), keys[i])
	if en == nil || en.Mount != 0 {
		t.Fatalf("the promoted key's entry: %+v, want a file on mount 0", en)
	}
	gets := objs.reads.Load()
	loadAndCompare(t, e, c, keys[i:i+1], into, want[i:i+1])
	if objs.reads.Load() != gets {
		t.Fatal("the promoted key's next load read the object mount")
	}
}
