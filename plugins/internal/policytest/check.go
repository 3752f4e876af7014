package policytest

import (
	"bytes"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
)

// Factory returns a fresh policy instance.
type Factory func() guest.Policy

// MustNew is New for tests.
func MustNew(t testing.TB, p guest.Policy, cfg ...string) *Driver {
	t.Helper()
	d, err := New(p, cfg...)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// EdgeModels returns model ids that stress the namespace directory name.
func EdgeModels() []string {
	return []string{
		"", "meta-llama/Llama-3.1-8B-Instruct", ".hidden", "..", "a b\tc/d\\e", "\x00\xff",
		string(bytes.Repeat([]byte("m"), abi.MaxModelLen)),
		string(bytes.Repeat([]byte("/"), abi.MaxModelLen)),
		string(bytes.Repeat([]byte("."), abi.MaxModelLen)),
	}
}

// EdgeKeys are keys that stress file names.
func EdgeKeys() [][]byte {
	return [][]byte{
		{}, {0}, {0xff}, []byte("."), []byte("../../etc/passwd"),
		bytes.Repeat([]byte{0}, abi.MaxKeyLen), bytes.Repeat([]byte{0xff}, abi.MaxKeyLen),
		bytes.Repeat([]byte{'/'}, abi.MaxKeyLen),
	}
}

// CheckNames names edge and random keys in edge and ordinary namespaces and
// checks, for each of mountCounts, every name with abi.CheckPath, every
// mount against the mount count,
// and that the same input gives the same name in a second instance.
func CheckNames(t *testing.T, mk Factory, mountCounts []uint32, cfg ...string) {
	t.Helper()
	rng := rand.New(rand.NewPCG(1, 2))
	keys := EdgeKeys()
	for range 200 {
		k := make([]byte, rng.IntN(abi.MaxKeyLen+1))
		for i := range k {
			k[i] = byte(rng.Uint32())
		}
		keys = append(keys, k)
	}
	for mi, model := range EdgeModels() {
		for _, mounts := range mountCounts {
			a, b := MustNew(t, mk(), cfg...), MustNew(t, mk(), cfg...)
			ns := Namespace(uint32(mi), model, rng.Uint64(), ^uint32(0)-uint32(mi), mounts)
			for _, d := range []*Driver{a, b} {
				if _, err := d.Namespace(ns); err != nil {
					t.Fatalf("model %q: %v", model, err)
				}
			}
			for start := 0; start < len(keys); start += abi.MaxBatch / 4 {
				batch := keys[start:min(len(keys), start+abi.MaxBatch/4)]
				ra := make([]abi.NameRecord, len(batch))
				for i, k := range batch {
					ra[i] = NameRec(ns, k)
				}
				rb := slices.Clone(ra)
				if err := a.Name(ra); err != nil {
					t.Fatalf("model %q: %v", model, err)
				}
				if err := b.Name(rb); err != nil {
					t.Fatal(err)
				}
				for i := range ra {
					if err := abi.CheckPath(ra[i].Path()); err != nil {
						t.Errorf("model %q key %x: %v", model, batch[i], err)
					}
					if ra[i].Mount >= mounts {
						t.Errorf("key %x: mount %d of %d", batch[i], ra[i].Mount, mounts)
					}
					if !bytes.Equal(ra[i].Path(), rb[i].Path()) || ra[i].Mount != rb[i].Mount {
						t.Errorf("key %x: not deterministic: %q on %d, then %q on %d", batch[i], ra[i].Path(), ra[i].Mount, rb[i].Path(), rb[i].Mount)
					}
				}
			}
		}
	}
}

// CheckCommon checks the rules every built-in policy shares: pinned entries
// are never victims and pins nest, removed entries are forgotten, victims are
// on the requested mount, eviction stops when the bytes are covered or the
// output is full, unknown access kinds are rejected, and a name in an
// undeclared namespace is refused.
func CheckCommon(t *testing.T, mk Factory, cfg ...string) {
	t.Helper()
	const size = 100
	anyMount := abi.EvictRequest{Bytes: 1 << 40, Time: 1000, Mount: abi.AnyMount}
	seed := func(t *testing.T) *Driver {
		d := MustNew(t, mk(), cfg...)
		for e := uint64(1); e <= 6; e++ {
			if err := d.Access(OnMount(Rec(abi.AccessInsert, e, e, size), uint32(e%2))); err != nil {
				t.Fatal(err)
			}
		}
		return d
	}
	victims := func(t *testing.T, d *Driver, req abi.EvictRequest, max int) []uint64 {
		t.Helper()
		vs, err := d.Evict(req, max)
		if err != nil {
			t.Fatal(err)
		}
		ids := Entries(vs)
		if len(slices.Compact(slices.Sorted(slices.Values(ids)))) != len(ids) {
			t.Errorf("victims %v repeat an entry", ids)
		}
		return ids
	}
	tests := []struct {
		name   string
		events []abi.AccessRecord
		req    abi.EvictRequest
		max    int
		want   []uint64 // the victims, in anyMount order; nil: none
	}{
		{"all", nil, anyMount, 64, []uint64{1, 2, 3, 4, 5, 6}},
		{"pinned twice, unpinned once", []abi.AccessRecord{Rec(abi.AccessPin, 2, 0, 0), Rec(abi.AccessPin, 2, 0, 0), Rec(abi.AccessUnpin, 2, 0, 0)}, anyMount, 64, []uint64{1, 3, 4, 5, 6}},
		{"pinned twice, unpinned twice", []abi.AccessRecord{Rec(abi.AccessPin, 2, 0, 0), Rec(abi.AccessPin, 2, 0, 0), Rec(abi.AccessUnpin, 2, 0, 0), Rec(abi.AccessUnpin, 2, 0, 0)}, anyMount, 64, []uint64{1, 2, 3, 4, 5, 6}},
		{"extra unpin ignored", []abi.AccessRecord{Rec(abi.AccessUnpin, 3, 0, 0), Rec(abi.AccessPin, 3, 0, 0)}, anyMount, 64, []uint64{1, 2, 4, 5, 6}},
		{"removed", []abi.AccessRecord{Rec(abi.AccessRemove, 4, 0, 0), Rec(abi.AccessRemove, 99, 0, 0)}, anyMount, 64, []uint64{1, 2, 3, 5, 6}},
		{"mount 1", nil, abi.EvictRequest{Bytes: 1 << 40, Mount: 1}, 64, []uint64{1, 3, 5}},
		{"mount 0", nil, abi.EvictRequest{Bytes: 1 << 40, Mount: 0}, 64, []uint64{2, 4, 6}},
		{"mount 7", nil, abi.EvictRequest{Bytes: 1 << 40, Mount: 7}, 64, nil},
		{"output full", nil, anyMount, 2, nil},
		{"zero bytes", nil, abi.EvictRequest{Mount: abi.AnyMount}, 64, nil},
		{"hits without size keep it", []abi.AccessRecord{
			{Kind: abi.AccessHit, Entry: 1, Time: 7}, {Kind: abi.AccessHit, Entry: 2, Time: 8}, {Kind: abi.AccessHit, Entry: 3, Time: 9},
			{Kind: abi.AccessHit, Entry: 4, Time: 10}, {Kind: abi.AccessHit, Entry: 5, Time: 11},
		}, abi.EvictRequest{Bytes: 2*size + 1, Mount: abi.AnyMount}, 64, []uint64{1, 2, 6}},
		{"a pin of an unknown entry offers nothing new", []abi.AccessRecord{OnMount(Rec(abi.AccessPin, 9, 9, size), 1)}, abi.EvictRequest{Bytes: 1 << 40, Mount: 1}, 64, []uint64{1, 3, 5}},
		{"all pinned", []abi.AccessRecord{Rec(abi.AccessPin, 1, 0, 0), Rec(abi.AccessPin, 2, 0, 0), Rec(abi.AccessPin, 3, 0, 0), Rec(abi.AccessPin, 4, 0, 0), Rec(abi.AccessPin, 5, 0, 0), Rec(abi.AccessPin, 6, 0, 0)}, anyMount, 64, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := seed(t)
			if err := d.Access(tt.events...); err != nil {
				t.Fatal(err)
			}
			got := victims(t, d, tt.req, tt.max)
			switch tt.name {
			case "output full":
				if len(got) != tt.max {
					t.Errorf("got %d victims, want %d (the output is full)", len(got), tt.max)
				}
				return
			}
			if !slices.Equal(slices.Sorted(slices.Values(got)), tt.want) {
				t.Errorf("victims %v, want %v in anyMount order", got, tt.want)
			}
		})
	}
	t.Run("bytes covered", func(t *testing.T) {
		d := seed(t)
		got := victims(t, d, abi.EvictRequest{Bytes: 2*size + 1, Mount: abi.AnyMount}, 64)
		if len(got) != 3 {
			t.Errorf("victims %v for %d bytes of %d-byte entries, want 3", got, 2*size+1, size)
		}
	})
	t.Run("bad kind", func(t *testing.T) {
		d := seed(t)
		if err := d.Access(Rec(77, 1, 1, 1)); err == nil {
			t.Error("access kind 77 accepted")
		}
	})
	t.Run("undeclared namespace", func(t *testing.T) {
		d := seed(t)
		if err := d.Name([]abi.NameRecord{NameRec(Namespace(5, "m", 1, 0, 1), []byte("k"))}); err == nil {
			t.Error("name in an undeclared namespace accepted")
		}
	})
}

// CheckAllocs checks that steady-state Access (insert, hit, pin, unpin,
// remove churn), Name and Evict allocate nothing per call.
func CheckAllocs(t *testing.T, mk Factory, mounts uint32, cfg ...string) {
	t.Helper()
	d := MustNew(t, mk(), cfg...)
	ns := Namespace(0, "meta-llama/Llama-3.1-8B", 0x0123456789abcdef, 0, mounts)
	if _, err := d.Namespace(ns); err != nil {
		t.Fatal(err)
	}
	const batch, live = 256, 4096
	next := uint64(0)
	clock := uint64(1)
	churn := func() {
		recs := d.AccessRecords(batch)
		for i := range recs {
			e := next
			next++
			kind := abi.AccessInsert
			switch i % 4 {
			case 1:
				kind, e = abi.AccessHit, e-1
			case 2:
				kind, e = abi.AccessPin, e-2
			case 3:
				kind, e = abi.AccessUnpin, e-3
			}
			clock++
			recs[i] = abi.AccessRecord{Kind: kind, Entry: e, Time: clock, Size: 4096, Mount: uint32(e % uint64(mounts))}
		}
		if err := d.AccessInPlace(batch); err != nil {
			t.Fatal(err)
		}
		recs = d.AccessRecords(batch)
		for i := range recs { // keep the live set constant
			if next < live {
				break
			}
			recs[i] = abi.AccessRecord{Kind: abi.AccessRemove, Entry: next - live - uint64(batch) + uint64(i)}
		}
		if next >= live {
			if err := d.AccessInPlace(batch); err != nil {
				t.Fatal(err)
			}
		}
	}
	for range 4 * live / batch {
		churn()
	}
	if n := testing.AllocsPerRun(20, churn); n != 0 {
		t.Errorf("Access: %v allocations per batch of %d, want 0", n, batch)
	}
	keys := make([][]byte, batch)
	for i := range keys {
		keys[i] = []byte{byte(i), byte(i >> 8), 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14}
	}
	name := func() {
		recs := d.NameRecords(batch)
		for i := range recs {
			recs[i] = NameRec(ns, keys[i])
		}
		if err := d.NameInPlace(batch); err != nil {
			t.Fatal(err)
		}
	}
	name()
	if n := testing.AllocsPerRun(20, name); n != 0 {
		t.Errorf("Name: %v allocations per batch of %d, want 0", n, batch)
	}
	evict := func() {
		if _, err := d.EvictInPlace(abi.EvictRequest{Bytes: 1 << 30, Time: clock, Mount: abi.AnyMount}, batch); err != nil {
			t.Fatal(err)
		}
		if _, err := d.EvictInPlace(abi.EvictRequest{Bytes: 1 << 30, Time: clock, Mount: 0}, batch); err != nil {
			t.Fatal(err)
		}
	}
	evict()
	if n := testing.AllocsPerRun(20, evict); n != 0 {
		t.Errorf("Evict: %v allocations per call, want 0", n)
	}
}

// CheckRank checks a policy's kvhost_rank (abi.FeatureRank): every record
// is answered, an entry the policy was never told of is RankUnknown, two
// instances told the same history under other handles (another node)
// rank it alike, and a hit never lowers an entry's rank.
func CheckRank(t *testing.T, mk Factory, cfg ...string) {
	t.Helper()
	if _, ok := mk().(guest.Ranker); !ok {
		t.Fatal("the policy does not implement guest.Ranker")
	}
	const size, now = 100, uint64(1) << 62
	history := func(t *testing.T, base uint64) *Driver {
		t.Helper()
		d := MustNew(t, mk(), cfg...)
		for e := uint64(1); e <= 6; e++ {
			if err := d.Access(Rec(abi.AccessInsert, base+e, now-100+e, size)); err != nil {
				t.Fatal(err)
			}
		}
		for _, e := range []uint64{2, 2, 5} {
			if err := d.Access(Rec(abi.AccessHit, base+e, now-50+e, size)); err != nil {
				t.Fatal(err)
			}
		}
		return d
	}
	rank := func(t *testing.T, d *Driver, entries ...uint64) []abi.RankRecord {
		t.Helper()
		recs, err := d.Rank(now, entries...)
		if err != nil {
			t.Fatal(err)
		}
		return recs
	}
	a, b := history(t, 0), history(t, 1000)
	ra := rank(t, a, 1, 2, 3, 4, 5, 6, 99)
	rb := rank(t, b, 1001, 1002, 1003, 1004, 1005, 1006)
	for i, r := range ra[:6] {
		if r.State != abi.RankKnown {
			t.Errorf("entry %d: state %d, want %d (known)", r.Entry, r.State, abi.RankKnown)
		}
		if r.Rank != rb[i].Rank || rb[i].State != abi.RankKnown {
			t.Errorf("entry %d ranks %d, the same history under handle %d on another instance %d (state %d): ranks must not depend on handles",
				r.Entry, r.Rank, rb[i].Entry, rb[i].Rank, rb[i].State)
		}
	}
	if ra[6].State != abi.RankUnknown {
		t.Errorf("entry 99, never reported: state %d, want %d (unknown)", ra[6].State, abi.RankUnknown)
	}
	before := rank(t, a, 3)[0].Rank
	if err := a.Access(Rec(abi.AccessHit, 3, now-1, size)); err != nil {
		t.Fatal(err)
	}
	if after := rank(t, a, 3)[0].Rank; after < before {
		t.Errorf("entry 3 ranks %d after a hit, %d before: a hit must not lower a rank", after, before)
	}
	if cold, hot := ra[0].Rank, ra[1].Rank; hot < cold {
		t.Errorf("entry 2 (inserted later, hit twice) ranks %d, below entry 1 (inserted first, never hit) at %d", hot, cold)
	}
}
