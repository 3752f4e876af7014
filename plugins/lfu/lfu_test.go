package lfu_test

import (
	"cmp"
	"math/bits"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/plugins/internal/policytest"
	"github.com/kvhost/kvhost/plugins/lfu"
)

func mk() guest.Policy { return lfu.New() }

func TestCommon(t *testing.T) { policytest.CheckCommon(t, mk) }

func TestNames(t *testing.T) { policytest.CheckNames(t, mk, []uint32{1, 2}) }

func TestAllocs(t *testing.T) { policytest.CheckAllocs(t, mk, 2) }

func TestConfig(t *testing.T) {
	tests := []struct{ key, value, wantErr string }{
		{"half_life", "30m", ""},
		{"half_life", "0", "half_life"},
		{"half_life", "soon", "half_life"},
		{"keys_per_file", "1e3", "keys_per_file"},
	}
	for _, tt := range tests {
		var cfg guest.Config
		cfg.Set(tt.key, tt.value)
		err := lfu.New().Init(cfg)
		switch {
		case tt.wantErr == "" && err != nil:
			t.Errorf("%s=%s: %v", tt.key, tt.value, err)
		case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), "lfu: config "+tt.wantErr)):
			t.Errorf("%s=%s: error %v, want one naming %q", tt.key, tt.value, err, tt.wantErr)
		}
	}
}

func TestOrder(t *testing.T) {
	const size = 10
	m := uint64(time.Minute)
	ins := func(e, at uint64) abi.AccessRecord { return policytest.Rec(abi.AccessInsert, e, at, size) }
	hit := func(e, at uint64) abi.AccessRecord { return policytest.Rec(abi.AccessHit, e, at, size) }
	restore := func(e, at uint64, hits uint32) abi.AccessRecord {
		r := policytest.Rec(abi.AccessRestore, e, at, size)
		r.Hits = hits
		return r
	}
	tests := []struct {
		name   string
		events []abi.AccessRecord
		want   []uint64
	}{
		{"same count: least recent first", []abi.AccessRecord{ins(1, 1), ins(2, 2), ins(3, 3)}, []uint64{1, 2, 3}},
		{"frequent last", []abi.AccessRecord{ins(1, 1), ins(2, 2), ins(3, 3), hit(1, 4), hit(1, 5), hit(1, 6), hit(2, 7)}, []uint64{3, 2, 1}},
		{"levels are powers of two", []abi.AccessRecord{ins(1, 1), hit(1, 2), ins(2, 3), hit(2, 4), hit(2, 5), ins(3, 6)}, []uint64{3, 1, 2}},
		{"restore counts", []abi.AccessRecord{restore(1, 1, 9), restore(2, 2, 1), restore(3, 3, 0)}, []uint64{3, 2, 1}},
		{"aging demotes old favourites", []abi.AccessRecord{
			ins(1, 1), hit(1, 2), hit(1, 3), hit(1, 4), hit(1, 5), hit(1, 6), hit(1, 7), hit(1, 8), // 8 accesses: level 4
			ins(2, 10*m), // nine halvings: entry 1 is down to 0 accesses
			ins(3, 10*m+1),
		}, []uint64{1, 2, 3}},
		{"late records do not move the aging clock back", []abi.AccessRecord{
			ins(1, 10*m), hit(1, 10*m+1), hit(1, 10*m+2), hit(1, 10*m+3), // 4 accesses: level 3
			ins(2, 1), // a late record
			ins(3, 10*m+4), ins(4, 10*m+5),
		}, []uint64{2, 3, 4, 1}},
		{"no aging within a half-life", []abi.AccessRecord{
			ins(1, 1), hit(1, 2), hit(1, 3), hit(1, 4),
			ins(2, m-2), ins(3, m-1),
		}, []uint64{2, 3, 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := policytest.MustNew(t, lfu.New(), "half_life", "1m")
			if err := d.Access(tt.events...); err != nil {
				t.Fatal(err)
			}
			vs, err := d.Evict(abi.EvictRequest{Bytes: 1 << 30, Mount: abi.AnyMount}, 64)
			if err != nil {
				t.Fatal(err)
			}
			if got := policytest.Entries(vs); !slices.Equal(got, tt.want) {
				t.Errorf("victims %v, want %v", got, tt.want)
			}
			if !slices.IsSortedFunc(vs, func(a, b abi.Victim) int { return cmp.Compare(a.Score, b.Score) }) {
				t.Errorf("scores of %v are not ascending", vs)
			}
		})
	}
}

func TestScore(t *testing.T) {
	if lfu.Score(1, 0) <= lfu.Score(0, ^uint64(0)) {
		t.Error("a higher level does not score above every time of a lower level")
	}
	if lfu.Score(2, 1000) >= lfu.Score(2, 2000) {
		t.Error("within a level, older does not score lower")
	}
}

func BenchmarkHooks(b *testing.B) { policytest.BenchHooks(b, mk, 1) }

func TestRank(t *testing.T) { policytest.CheckRank(t, mk) }

// TestRankFrequencyIsWorthHalfLives: an entry hit 2^k times more than
// another ranks k half-lives above it at the same last access, and the
// rank saturates instead of wrapping.
func TestRankFrequencyIsWorthHalfLives(t *testing.T) {
	hl := uint64(time.Minute)
	tests := []struct {
		level      uint32
		time, want uint64
	}{
		{0, 5, 5},
		{1, 5, 5 + hl},
		{4, 5, 5 + 4*hl},
		{15, ^uint64(0) - hl, ^uint64(0)},
	}
	for _, tt := range tests {
		if got := lfu.Rank(tt.level, tt.time, hl); got != tt.want {
			t.Errorf("Rank(level %d, time %d) = %d, want %d", tt.level, tt.time, got, tt.want)
		}
	}
	d := policytest.MustNew(t, lfu.New(), "half_life", "1m")
	now := 100 * hl
	evs := []abi.AccessRecord{policytest.Rec(abi.AccessInsert, 1, now, 10), policytest.Rec(abi.AccessInsert, 2, now, 10)}
	for range 3 {
		evs = append(evs, policytest.Rec(abi.AccessHit, 2, now, 10)) // 4 accesses: level 3
	}
	if err := d.Access(evs...); err != nil {
		t.Fatal(err)
	}
	recs, err := d.Rank(now, 1, 2)
	if err != nil {
		t.Fatal(err)
	}
	if got := recs[1].Rank - recs[0].Rank; got != 2*hl {
		t.Errorf("level 3 ranks %d ns above level 1 at the same time, want 2 half-lives (%d)", got, 2*hl)
	}
}

// TestAgingMatchesHalvingEveryCount runs random records, over many
// half-lives and with counts above the top level, through the policy and
// through a model that halves every count at each aging, and checks that
// both give the same victims, scores and ranks: aging lazily changes no
// order.
func TestAgingMatchesHalvingEveryCount(t *testing.T) {
	const entries, hl = 3000, uint64(time.Minute) // more than an Access call drains
	type entry struct {
		time  uint64
		hits  uint32
		pins  uint32
		known bool
	}
	rng := rand.New(rand.NewPCG(1, 2))
	d := policytest.MustNew(t, lfu.New(), "half_life", "1m")
	var model [entries]entry
	clock := 1000 * hl
	lastAged := clock - clock%hl
	var recs []abi.AccessRecord
	for id := range uint64(entries) {
		clock++
		r := policytest.Rec(abi.AccessRestore, id, clock, 10)
		r.Hits = uint32(rng.IntN(4)) << rng.IntN(30)
		model[id] = entry{known: true, time: clock, hits: r.Hits}
		if err := d.Access(r); err != nil {
			t.Fatal(err)
		}
	}
	for round := range 200 {
		for range 1 + rng.IntN(20) {
			clock += 1 + uint64(rng.IntN(int(hl/4))) // times of no two records alike
			if rng.IntN(30) == 0 {
				clock += uint64(rng.IntN(40)) * hl // a lull: several agings at once
			}
			if halvings := (clock - lastAged) / hl; halvings > 0 {
				lastAged += halvings * hl
				for i := range model {
					model[i].hits >>= min(halvings, 32)
				}
			}
			id := uint64(rng.IntN(entries))
			m := &model[id]
			r := policytest.Rec(abi.AccessHit, id, clock, 10)
			switch k := rng.IntN(10); {
			case k < 4:
				r.Kind = abi.AccessInsert
				m.known, m.time, m.hits = true, clock, m.hits+1
			case k < 7:
				if m.known {
					m.time, m.hits = max(m.time, clock), m.hits+1
				}
			case k == 7:
				r.Kind, r.Hits = abi.AccessRestore, uint32(rng.IntN(4))<<(rng.IntN(30))
				m.known, m.time, m.hits = true, clock, r.Hits
			case k == 8:
				r.Kind = abi.AccessRemove
				*m = entry{}
			default:
				r.Kind = abi.AccessPin
				if rng.IntN(2) == 0 {
					r.Kind = abi.AccessUnpin
				}
				if m.known && r.Kind == abi.AccessPin {
					m.pins++
				} else if m.known && m.pins > 0 {
					m.pins--
				}
			}
			recs = append(recs, r)
		}
		if err := d.Access(recs...); err != nil {
			t.Fatal(err)
		}
		recs = recs[:0]
		var want []abi.Victim
		var ids []uint64
		for id, m := range model {
			if m.known {
				ids = append(ids, uint64(id))
				if m.pins == 0 {
					lv := min(uint32(bits.Len32(m.hits)), lfu.Levels-1)
					want = append(want, abi.Victim{Entry: uint64(id), Score: lfu.Score(lv, m.time)})
				}
			}
		}
		slices.SortFunc(want, func(a, b abi.Victim) int { return cmp.Or(cmp.Compare(a.Score, b.Score), cmp.Compare(a.Entry, b.Entry)) })
		want = want[:rng.IntN(min(len(want), abi.MaxBatch)+1)]
		got, err := d.Evict(abi.EvictRequest{Bytes: 10 * uint64(len(want)), Mount: abi.AnyMount}, abi.MaxBatch)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, want) {
			t.Fatalf("round %d: victims\n%v\nwant\n%v", round, got, want)
		}
		for len(ids) > 0 {
			n := min(len(ids), abi.MaxBatch)
			ranks, err := d.Rank(clock, ids[:n]...)
			if err != nil {
				t.Fatal(err)
			}
			ids = ids[n:]
			for _, r := range ranks {
				m := model[r.Entry]
				if want := lfu.Rank(min(uint32(bits.Len32(m.hits)), lfu.Levels-1), m.time, hl); r.Rank != want {
					t.Fatalf("round %d: entry %d ranks %d, want %d", round, r.Entry, r.Rank, want)
				}
			}
		}
	}
}

// TestEvictAgesToTheRequestTime: victims are scored at the eviction's time,
// so that the host, merging the victims of shards by score, ranks an old
// favourite of a shard that has seen no record since below a fresh entry
// of another shard.
func TestEvictAgesToTheRequestTime(t *testing.T) {
	hl := uint64(time.Minute)
	start := 1000 * hl
	old := policytest.MustNew(t, lfu.New(), "half_life", "1m") // a shard with no record since
	evs := []abi.AccessRecord{policytest.Rec(abi.AccessInsert, 1, start, 10)}
	for k := range uint64(7) {
		evs = append(evs, policytest.Rec(abi.AccessHit, 1, start+1+k, 10)) // 8 accesses: level 4
	}
	if err := old.Access(evs...); err != nil {
		t.Fatal(err)
	}
	now := start + 10*hl // ten halvings: entry 1 is down to 0 accesses
	fresh := policytest.MustNew(t, lfu.New(), "half_life", "1m")
	if err := fresh.Access(policytest.Rec(abi.AccessInsert, 2, now, 10)); err != nil {
		t.Fatal(err)
	}
	req := abi.EvictRequest{Bytes: 1 << 30, Time: now + 1, Mount: abi.AnyMount}
	var vs []abi.Victim
	for _, d := range []*policytest.Driver{old, fresh} {
		got, err := d.Evict(req, 64)
		if err != nil {
			t.Fatal(err)
		}
		vs = append(vs, got...)
	}
	if want := lfu.Score(0, start+7); vs[0].Score != want {
		t.Errorf("entry 1, its count aged to 0 at the request's time, scores %#x, want %#x (level 0)", vs[0].Score, want)
	}
	if vs[0].Score >= vs[1].Score {
		t.Errorf("entry 1 (8 accesses ten half-lives ago) scores %#x, not below entry 2 (1 access now) at %#x", vs[0].Score, vs[1].Score)
	}
}

// TestRestoreAgesTheCountFromItsLastAccess: a restored count is the host's
// count as of the entry's last access, halved at every aging since, so
// that an instance rebuilt from RESTORE records ranks alike entries alike
// whatever order they come in.
func TestRestoreAgesTheCountFromItsLastAccess(t *testing.T) {
	hl := uint64(time.Minute)
	start := 1000 * hl
	restore := func(e, at uint64, hits uint32) abi.AccessRecord {
		r := policytest.Rec(abi.AccessRestore, e, at, 10)
		r.Hits = hits
		return r
	}
	d := policytest.MustNew(t, lfu.New(), "half_life", "1m")
	// Entries 1 and 3 have the same history: 8 accesses, the last at start.
	if err := d.Access(restore(1, start, 8), restore(2, start+10*hl, 1), restore(3, start, 8)); err != nil {
		t.Fatal(err)
	}
	recs, err := d.Rank(start+10*hl, 1, 2, 3)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range []abi.RankRecord{recs[0], recs[2]} {
		if want := lfu.Rank(0, start, hl); r.Rank != want {
			t.Errorf("entry %d (8 accesses ten half-lives ago) ranks %d, want %d (level 0)", r.Entry, r.Rank, want)
		}
	}
}
