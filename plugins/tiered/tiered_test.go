package tiered_test

import (
	"slices"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/plugins/internal/policytest"
	"github.com/kvhost/kvhost/plugins/tiered"
)

func mk() guest.Policy { return tiered.New() }

func TestCommon(t *testing.T) { policytest.CheckCommon(t, mk) }

func TestNames(t *testing.T) { policytest.CheckNames(t, mk, []uint32{1, 2, 4}) }

func TestAllocs(t *testing.T) { policytest.CheckAllocs(t, mk, 2) }

func TestFeatures(t *testing.T) {
	want := abi.FeatureNamespace | abi.FeatureAdmit | abi.FeatureAdmitMount | abi.FeatureMounts | abi.FeatureDemote | abi.FeatureTick | abi.FeatureRank
	if got := guest.Features(tiered.New()); got != want {
		t.Errorf("features %s, want %s", got, want)
	}
}

// seeded returns a driver that knows two mounts and entries 1..4 on the
// hot mount (times 1..4) and 5..6 on the cold one (times 5..6).
func seeded(t *testing.T, cfg ...string) *policytest.Driver {
	t.Helper()
	d := policytest.MustNew(t, tiered.New(), cfg...)
	if _, err := d.Namespace(policytest.Namespace(0, "m", 1, 0, 2)); err != nil {
		t.Fatal(err)
	}
	if err := d.Mounts(abi.MountRecord{Mount: 0, Capacity: 1000}, abi.MountRecord{Mount: 1, Capacity: 1 << 30}); err != nil {
		t.Fatal(err)
	}
	for e := uint64(1); e <= 6; e++ {
		if err := d.Access(policytest.OnMount(policytest.Rec(abi.AccessInsert, e, e, 100), uint32(e/5))); err != nil {
			t.Fatal(err)
		}
	}
	return d
}

// TestEvictDemotesHotDeletesCold: hot victims go to the cold mount (with
// delete-if-full), cold victims are deleted, both in LRU order.
func TestEvictDemotesHotDeletesCold(t *testing.T) {
	tests := []struct {
		name        string
		cfg         []string
		mount       uint32
		bytes       uint64
		wantVictims []uint64
		wantTarget  abi.VictimTarget
	}{
		{"hot pressure demotes", nil, 0, 250, []uint64{1, 2, 3}, abi.VictimTarget{Mount: 1, Flags: abi.MoveDeleteIfFull}},
		{"cold pressure deletes", nil, 1, 1 << 40, []uint64{5, 6}, abi.VictimTarget{Mount: abi.NoMount}},
		{"swapped tiers", []string{"hot", "1", "cold", "0"}, 1, 1 << 40, []uint64{5, 6}, abi.VictimTarget{Mount: 0, Flags: abi.MoveDeleteIfFull}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := seeded(t, tt.cfg...)
			n, err := d.EvictInPlace(abi.EvictRequest{Bytes: tt.bytes, Mount: tt.mount}, 64)
			if err != nil {
				t.Fatal(err)
			}
			if got := policytest.Entries(d.Victims(n)); !slices.Equal(got, tt.wantVictims) {
				t.Errorf("victims %v, want %v", got, tt.wantVictims)
			}
			for i, tg := range d.Targets(n) {
				if tg != tt.wantTarget {
					t.Errorf("target of victim %d: %+v, want %+v", i, tg, tt.wantTarget)
				}
			}
		})
	}
}

// TestADemotedEntryKeepsItsAgeOnTheColdMount: an entry demoted (inserted
// on the cold mount with its last access) goes among the cold entries by
// that time, not behind the ones used since.
func TestADemotedEntryKeepsItsAgeOnTheColdMount(t *testing.T) {
	d := seeded(t)
	for _, r := range []abi.AccessRecord{
		policytest.Rec(abi.AccessHit, 4, 50, 100),
		policytest.OnMount(policytest.Rec(abi.AccessHit, 5, 100, 100), 1),
		policytest.Rec(abi.AccessRemove, 4, 110, 0),
		policytest.OnMount(policytest.Rec(abi.AccessInsert, 7, 50, 100), 1), // entry 4, moved
	} {
		if err := d.Access(r); err != nil {
			t.Fatal(err)
		}
	}
	n, err := d.EvictInPlace(abi.EvictRequest{Bytes: 1 << 40, Mount: 1}, 64)
	if err != nil {
		t.Fatal(err)
	}
	if got := policytest.Entries(d.Victims(n)); !slices.Equal(got, []uint64{6, 7, 5}) {
		t.Errorf("victims %v, want [6 7 5]: the demoted entry 7 between 6 and the entry 5 hit later", got)
	}
}

// TestSingleMountDeletes: with one mount there is nowhere to demote to.
func TestSingleMountDeletes(t *testing.T) {
	d := policytest.MustNew(t, tiered.New())
	if _, err := d.Namespace(policytest.Namespace(0, "m", 1, 0, 1)); err != nil {
		t.Fatal(err)
	}
	if err := d.Access(policytest.Rec(abi.AccessInsert, 1, 1, 100)); err != nil {
		t.Fatal(err)
	}
	n, err := d.EvictInPlace(abi.EvictRequest{Bytes: 1, Mount: 0}, 4)
	if err != nil || n != 1 {
		t.Fatalf("evict: %d, %v", n, err)
	}
	if tg := d.Targets(1)[0]; tg.Mount != abi.NoMount {
		t.Errorf("target %+v with one mount, want deletion", tg)
	}
}

// TestPromotion: a cold entry hit promote_hits times within the window is
// moved to the hot mount at the next tick, once; hits spread wider than the
// window, or on hot entries, promote nothing.
func TestPromotion(t *testing.T) {
	const w = uint64(10 * time.Second)
	hit := func(e, at uint64) abi.AccessRecord { return policytest.Rec(abi.AccessHit, e, at, 0) }
	tests := []struct {
		name string
		hits []abi.AccessRecord
		want []abi.Move
	}{
		{"three hits in the window", []abi.AccessRecord{hit(5, 100), hit(5, 200), hit(5, 300)}, []abi.Move{{Entry: 5, Mount: 0}}},
		{"two hits", []abi.AccessRecord{hit(5, 100), hit(5, 200)}, nil},
		{"hits wider than the window", []abi.AccessRecord{hit(5, 100), hit(5, 100+w/2), hit(5, 100+2*w)}, nil},
		{"three hits in the window, first long after the demotion", []abi.AccessRecord{hit(5, w), hit(5, w+10), hit(5, w+20)}, []abi.Move{{Entry: 5, Mount: 0}}},
		{"hot entry", []abi.AccessRecord{hit(1, 100), hit(1, 200), hit(1, 300)}, nil},
		{"removed before the tick", []abi.AccessRecord{hit(6, 100), hit(6, 200), hit(6, 300), policytest.Rec(abi.AccessRemove, 6, 0, 0)}, nil},
		{"two entries", []abi.AccessRecord{hit(5, 1), hit(6, 2), hit(5, 3), hit(6, 4), hit(5, 5), hit(6, 6), hit(6, 7)}, []abi.Move{{Entry: 5, Mount: 0}, {Entry: 6, Mount: 0}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := seeded(t, "promote_window", "10s")
			if err := d.Access(tt.hits...); err != nil {
				t.Fatal(err)
			}
			got, err := d.Tick(1000, 16)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("moves %+v, want %+v", got, tt.want)
			}
			again, err := d.Tick(2000, 16)
			if err != nil || len(again) != 0 {
				t.Errorf("second tick: %+v, %v; want no move", again, err)
			}
		})
	}
}

// TestPromotionPinnedWaits: a pinned cold entry is promoted at the first
// tick after its unpin, and a full output carries moves to the next tick.
func TestPromotionPinnedWaits(t *testing.T) {
	d := seeded(t)
	recs := []abi.AccessRecord{policytest.Rec(abi.AccessPin, 5, 0, 0)}
	for i := uint64(1); i <= 3; i++ {
		recs = append(recs, policytest.Rec(abi.AccessHit, 5, i, 0), policytest.Rec(abi.AccessHit, 6, i, 0))
	}
	if err := d.Access(recs...); err != nil {
		t.Fatal(err)
	}
	got, _ := d.Tick(10, 16)
	if !slices.Equal(got, []abi.Move{{Entry: 6, Mount: 0}}) {
		t.Errorf("first tick %+v, want only the unpinned entry 6", got)
	}
	if err := d.Access(policytest.Rec(abi.AccessUnpin, 5, 0, 0)); err != nil {
		t.Fatal(err)
	}
	got, _ = d.Tick(20, 16)
	if !slices.Equal(got, []abi.Move{{Entry: 5, Mount: 0}}) {
		t.Errorf("tick after unpin %+v, want entry 5", got)
	}
}

// TestAdmitTarget: files go to the hot mount unless larger than its
// capacity; everything is admitted.
func TestAdmitTarget(t *testing.T) {
	d := seeded(t)
	recs := []abi.AdmitRecord{{KeyHash: 1, Size: 999, Mount: 0}, {KeyHash: 2, Size: 1001, Mount: 0}}
	if err := d.Admit(recs); err != nil {
		t.Fatal(err)
	}
	for i, want := range []uint32{0, 1} {
		if recs[i].Admit != 1 || recs[i].Target != want {
			t.Errorf("record %d (size %d): admit %d target %d, want 1 and %d", i, recs[i].Size, recs[i].Admit, recs[i].Target, want)
		}
	}
}

func TestConfig(t *testing.T) {
	tests := []struct {
		cfg []string
		ok  bool
	}{
		{nil, true},
		{[]string{"hot", "1", "cold", "0", "promote_hits", "0", "promote_window", "1m"}, true},
		{[]string{"hot", "1", "cold", "1"}, false},
		{[]string{"promote_hits", "-1"}, false},
		{[]string{"promote_window", "soon"}, false},
		{[]string{"cold", "5000"}, false},
		{[]string{"colder", "1"}, false},
	}
	for _, tt := range tests {
		_, err := policytest.New(tiered.New(), tt.cfg...)
		if (err == nil) != tt.ok {
			t.Errorf("config %v: err %v, want ok=%v", tt.cfg, err, tt.ok)
		}
	}
}

// TestPendingBounded: without ticks, hits on many cold entries queue at
// most maxPending promotions; a tick drains them 256 at a time, in order,
// and entries left out are queued again by later hits.
func TestPendingBounded(t *testing.T) {
	d := policytest.MustNew(t, tiered.New(), "promote_hits", "1")
	if _, err := d.Namespace(policytest.Namespace(0, "m", 1, 0, 2)); err != nil {
		t.Fatal(err)
	}
	if err := d.Mounts(abi.MountRecord{Mount: 0, Capacity: 1 << 30}, abi.MountRecord{Mount: 1, Capacity: 1 << 40}); err != nil {
		t.Fatal(err)
	}
	const n = 5000
	for start := uint64(1); start <= n; start += 500 {
		var recs []abi.AccessRecord
		for e := start; e < start+500; e++ {
			recs = append(recs, policytest.OnMount(policytest.Rec(abi.AccessInsert, e, e, 1), 1), policytest.Rec(abi.AccessHit, e, e+1, 0))
		}
		if err := d.Access(recs...); err != nil {
			t.Fatal(err)
		}
	}
	total := 0
	for {
		mv, err := d.Tick(1<<40, 256)
		if err != nil {
			t.Fatal(err)
		}
		if len(mv) == 0 {
			break
		}
		if mv[0].Entry != uint64(total+1) {
			t.Fatalf("tick drains from entry %d, want %d (in order)", mv[0].Entry, total+1)
		}
		total += len(mv)
	}
	if total != 4096 {
		t.Fatalf("%d promotions queued for %d hot-enough entries, want the bound 4096", total, n)
	}
	if err := d.Access(policytest.Rec(abi.AccessHit, n, n+2, 0)); err != nil {
		t.Fatal(err)
	}
	if mv, _ := d.Tick(1<<40, 256); len(mv) != 1 || mv[0].Entry != n {
		t.Fatalf("after another hit on entry %d: moves %+v", n, mv)
	}
}

// TestLateHitOfMovedEntry: a hit that arrives after the REMOVE of a moved
// entry (the engine reports lookup hits asynchronously) does not bring the
// entry back: it is never offered as a victim.
func TestLateHitOfMovedEntry(t *testing.T) {
	d := seeded(t)
	if err := d.Access(policytest.Rec(abi.AccessRemove, 1, 0, 0), policytest.OnMount(policytest.Rec(abi.AccessInsert, 7, 1, 100), 1),
		policytest.Rec(abi.AccessHit, 1, 10, 0)); err != nil {
		t.Fatal(err)
	}
	vs, err := d.Evict(abi.EvictRequest{Bytes: 1 << 40, Mount: abi.AnyMount}, 64)
	if err != nil {
		t.Fatal(err)
	}
	if got := policytest.Entries(vs); slices.Contains(got, 1) || !slices.Contains(got, 7) {
		t.Fatalf("victims %v: want the moved entry's new handle 7, never the removed 1", got)
	}
}

// TestNoTieringBeforeMountDescription: until the host describes the mounts,
// tiered neither demotes (a namespace's two mounts say nothing of which is
// cold, and the host refuses a demotion before a description) nor queues
// promotions; once described, the same entries are demoted and promoted.
func TestNoTieringBeforeMountDescription(t *testing.T) {
	tests := []struct {
		name       string
		describe   bool
		wantTarget abi.VictimTarget
		wantMoves  int
	}{
		{"before any description", false, abi.VictimTarget{Mount: abi.NoMount}, 0},
		{"once described", true, abi.VictimTarget{Mount: 1, Flags: abi.MoveDeleteIfFull}, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := policytest.MustNew(t, tiered.New(), "promote_hits", "1")
			if _, err := d.Namespace(policytest.Namespace(0, "m", 1, 0, 2)); err != nil {
				t.Fatal(err)
			}
			if tt.describe {
				if err := d.Mounts(abi.MountRecord{Mount: 0, Capacity: 1000}, abi.MountRecord{Mount: 1, Capacity: 1 << 30}); err != nil {
					t.Fatal(err)
				}
			}
			if err := d.Access(policytest.Rec(abi.AccessInsert, 1, 1, 100),
				policytest.OnMount(policytest.Rec(abi.AccessInsert, 2, 2, 100), 1), policytest.Rec(abi.AccessHit, 2, 3, 0)); err != nil {
				t.Fatal(err)
			}
			n, err := d.EvictInPlace(abi.EvictRequest{Bytes: 100, Mount: 0}, 64)
			if err != nil {
				t.Fatal(err)
			}
			if got := d.Targets(n); len(got) != 1 || got[0] != tt.wantTarget {
				t.Errorf("targets of the hot victims %+v, want one %+v", got, tt.wantTarget)
			}
			mv, err := d.Tick(10, 256)
			if err != nil {
				t.Fatal(err)
			}
			if len(mv) != tt.wantMoves {
				t.Errorf("tick moves %+v, want %d", mv, tt.wantMoves)
			}
		})
	}
}

func TestRank(t *testing.T) { policytest.CheckRank(t, mk) }
