package policykit

import (
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
)

// TestTableAgainstMap runs random puts and deletes against a Go map.
func TestTableAgainstMap(t *testing.T) {
	for _, keyspace := range []uint64{16, 1000, 1 << 40} {
		rng := rand.New(rand.NewPCG(keyspace, 7))
		var tab Table
		ref := map[uint64]int32{}
		for op := range 50000 {
			id := rng.Uint64N(keyspace)
			switch rng.IntN(3) {
			case 0, 1:
				tab.Put(id, int32(op))
				ref[id] = int32(op)
			case 2:
				_, want := ref[id]
				if got := tab.Delete(id); got != want {
					t.Fatalf("Delete(%d) = %v, want %v", id, got, want)
				}
				delete(ref, id)
			}
			if tab.Len() != len(ref) {
				t.Fatalf("Len %d, want %d", tab.Len(), len(ref))
			}
		}
		for id, want := range ref {
			if got, ok := tab.Get(id); !ok || got != want {
				t.Fatalf("Get(%d) = %d, %v; want %d", id, got, ok, want)
			}
		}
		for range 1000 {
			id := rng.Uint64N(keyspace) + keyspace // never stored
			if _, ok := tab.Get(id); ok {
				t.Fatalf("Get(%d) found an id never stored", id)
			}
		}
		tab.Reset()
		if _, ok := tab.Get(0); ok || tab.Len() != 0 {
			t.Fatal("Reset left ids behind")
		}
	}
}

func TestPoolReusesSlots(t *testing.T) {
	var p Pool
	a, _ := p.Add(10)
	b, _ := p.Add(20)
	if i, created := p.Add(10); created || i != a {
		t.Fatalf("Add of a present id created a slot")
	}
	p.Delete(a)
	c, created := p.Add(30)
	if !created || c != a {
		t.Errorf("slot %d for a new id, want the freed slot %d", c, a)
	}
	var live []uint64
	p.Range(func(i int32) { live = append(live, p.At(i).ID) })
	if slices.Sort(live); !slices.Equal(live, []uint64{20, 30}) || p.Len() != 2 {
		t.Errorf("live %v (Len %d), want [20 30]", live, p.Len())
	}
	_ = b
}

// listOrder returns the ids of l front to back, after checking that l is
// a whole treap: links that agree both ways, the priorities a heap, the
// walks from either end the same entries in time order, Len their number.
func listOrder(t *testing.T, p *Pool, l *List) []uint64 {
	t.Helper()
	var walk func(i, up int32) int
	walk = func(i, up int32) int {
		if i == none {
			return 0
		}
		e := p.At(i)
		if e.up != up || up != none && priority(up) < priority(i) {
			t.Fatalf("slot %d: up %d, want %d; or a priority above its parent's", i, e.up, up)
		}
		return 1 + walk(e.left, i) + walk(e.right, i)
	}
	if n := walk(l.root, none); n != l.Len() {
		t.Fatalf("%d entries in the tree, Len %d", n, l.Len())
	}
	var ids []uint64
	for i := l.Front(p); i >= 0; i = p.Next(i) {
		if len(ids) > 0 && p.At(i).Time < p.At(p.prev(i)).Time {
			t.Fatalf("entry %d out of time order", p.At(i).ID)
		}
		ids = append(ids, p.At(i).ID)
	}
	back, tail := []uint64(nil), l.root
	for tail != none && p.At(tail).right != none {
		tail = p.At(tail).right
	}
	if l.tail != tail {
		t.Fatalf("tail %d, want %d", l.tail, tail)
	}
	for i := tail; i >= 0; i = p.prev(i) {
		back = append(back, p.At(i).ID)
	}
	slices.Reverse(back)
	if !slices.Equal(ids, back) || len(ids) != l.Len() {
		t.Fatalf("list %v, backwards %v, Len %d", ids, back, l.Len())
	}
	return ids
}

// TestListAgainstASortedSlice runs random inserts (with ties), removes and
// touches (remove, new time, insert; or Touch, often of the back, with
// the time unchanged, a little later or at the back's) against a slice kept in time
// order, equal times in insertion order.
func TestListAgainstASortedSlice(t *testing.T) {
	for _, span := range []uint64{4, 1000, 1 << 40} {
		rng := rand.New(rand.NewPCG(span, 3))
		var p Pool
		l := NewList()
		var ref []int32 // slots in list order
		// place puts slot i in ref by its time; insert also in l.
		place := func(i int32) {
			tm := p.At(i).Time
			k, _ := slices.BinarySearchFunc(ref, tm, func(j int32, tm uint64) int {
				if p.At(j).Time <= tm {
					return -1
				}
				return 1
			})
			ref = slices.Insert(ref, k, i)
		}
		insert := func(i int32) {
			place(i)
			l.Insert(&p, i)
		}
		for op := range 5000 {
			switch {
			case len(ref) == 0 || rng.IntN(3) == 0:
				i, _ := p.Add(uint64(op))
				p.At(i).Time = rng.Uint64N(span)
				insert(i)
			case rng.IntN(2) == 0:
				k := rng.IntN(len(ref))
				i := ref[k]
				ref = slices.Delete(ref, k, k+1)
				l.Remove(&p, i)
				p.Delete(i)
			case rng.IntN(2) == 0:
				k := rng.IntN(len(ref))
				i := ref[k]
				ref = slices.Delete(ref, k, k+1)
				l.Remove(&p, i)
				p.At(i).Time = rng.Uint64N(span)
				insert(i)
			default:
				k := rng.IntN(len(ref))
				if rng.IntN(3) == 0 {
					k = len(ref) - 1
				}
				i := ref[k]
				ref = slices.Delete(ref, k, k+1)
				old := p.At(i).Time
				switch rng.IntN(4) {
				case 0:
					p.At(i).Time = rng.Uint64N(span)
				case 1:
					p.At(i).Time = min(old+rng.Uint64N(3), span-1)
				case 2:
					// A hit: to the back's time or later (TouchBack).
					if len(ref) > 0 {
						p.At(i).Time = max(old, p.At(ref[len(ref)-1]).Time+rng.Uint64N(2))
					}
				}
				place(i)
				l.Touch(&p, i, old)
			}
			if op%97 == 0 || op == 4999 {
				want := make([]uint64, len(ref))
				for k, i := range ref {
					want[k] = p.At(i).ID
				}
				if got := listOrder(t, &p, &l); !slices.Equal(got, want) {
					t.Fatalf("span %d, op %d: list %v, want %v", span, op, got, want)
				}
			}
		}
	}
}

// TestMoveBackIsRemoveThenInsert: random moves of entries between three
// lists (to the back's time or later, the commonest, or to any time), and
// hits within a list (TouchBack, to the back's time or a little later),
// leave the lists, links and all, as Remove then Insert leaves them; the
// entries also take ordinary inserts and removes between them.
func TestMoveBackIsRemoveThenInsert(t *testing.T) {
	for _, span := range []uint64{4, 1000, 1 << 40} {
		rng := rand.New(rand.NewPCG(span, 5))
		var pa, pb Pool // pa moves with MoveBack, pb with Remove and Insert
		la := []List{NewList(), NewList(), NewList()}
		lb := []List{NewList(), NewList(), NewList()}
		on := map[int32]int{} // the list of each slot
		var slots []int32
		for op := range 5000 {
			switch {
			case len(slots) == 0 || rng.IntN(4) == 0:
				ia, _ := pa.Add(uint64(op))
				ib, _ := pb.Add(uint64(op))
				if ia != ib {
					t.Fatalf("slots %d and %d for one add", ia, ib)
				}
				tm, c := rng.Uint64N(span), rng.IntN(3)
				pa.At(ia).Time, pb.At(ib).Time = tm, tm
				la[c].Insert(&pa, ia)
				lb[c].Insert(&pb, ib)
				on[ia] = c
				slots = append(slots, ia)
			case rng.IntN(5) == 0:
				k := rng.IntN(len(slots))
				i := slots[k]
				slots = slices.Delete(slots, k, k+1)
				la[on[i]].Remove(&pa, i)
				lb[on[i]].Remove(&pb, i)
				pa.Delete(i)
				pb.Delete(i)
				delete(on, i)
			case rng.IntN(3) == 0:
				// A hit within the list: TouchBack, the time not lower.
				i := slots[rng.IntN(len(slots))]
				c, old := on[i], pa.At(i).Time
				tm := old + rng.Uint64N(3)
				if back := la[c].tail; rng.IntN(4) != 0 {
					tm = max(old, pa.At(back).Time+rng.Uint64N(2))
				}
				lb[c].Remove(&pb, i)
				pa.At(i).Time, pb.At(i).Time = tm, tm
				la[c].TouchBack(&pa, i, old)
				lb[c].Insert(&pb, i)
			default:
				i := slots[rng.IntN(len(slots))]
				from, to := on[i], rng.IntN(3)
				if from == to {
					to = (to + 1) % 3
				}
				tm := rng.Uint64N(span)
				if back := la[to].tail; back != none && rng.IntN(4) != 0 {
					tm = pa.At(back).Time + rng.Uint64N(2) // a hit
				}
				lb[from].Remove(&pb, i)
				pa.At(i).Time, pb.At(i).Time = tm, tm
				la[from].MoveBack(&pa, i, &la[to])
				lb[to].Insert(&pb, i)
				on[i] = to
			}
			for c := range la {
				if la[c] != lb[c] {
					t.Fatalf("span %d, op %d: list %d %+v, want %+v", span, op, c, la[c], lb[c])
				}
			}
			for _, i := range slots {
				a, b := pa.At(i), pb.At(i)
				if a.left != b.left || a.right != b.right || a.up != b.up {
					t.Fatalf("span %d, op %d: slot %d links %d,%d,%d, want %d,%d,%d", span, op, i, a.left, a.right, a.up, b.left, b.right, b.up)
				}
			}
		}
		for c := range la {
			if got := listOrder(t, &pa, &la[c]); len(got) != la[c].Len() {
				t.Fatalf("list %d: %d entries in order, Len %d", c, len(got), la[c].Len())
			}
		}
	}
}

// TestListInsert: an entry inserted goes in front of the entries with a
// later time, after those with an equal one, however many it passes.
func TestListInsert(t *testing.T) {
	tests := []struct {
		name  string
		times []uint64 // the last is the entry inserted last
		want  []uint64 // ids front to back
	}{
		{"alone", []uint64{5}, []uint64{0}},
		{"in place", []uint64{1, 2, 3}, []uint64{0, 1, 2}},
		{"after an equal time", []uint64{1, 2, 2}, []uint64{0, 1, 2}},
		{"middle", []uint64{1, 3, 4, 2}, []uint64{0, 3, 1, 2}},
		{"front", []uint64{3, 4, 1}, []uint64{2, 0, 1}},
		{"behind many", []uint64{3, 4, 5, 6, 7, 8, 9, 10, 1}, []uint64{8, 0, 1, 2, 3, 4, 5, 6, 7}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var p Pool
			l := NewList()
			for k, tm := range tt.times {
				i, _ := p.Add(uint64(k))
				p.At(i).Time = tm
				l.Insert(&p, i)
			}
			if got := listOrder(t, &p, &l); !slices.Equal(got, tt.want) {
				t.Errorf("list %v, want %v", got, tt.want)
			}
		})
	}
}

func TestNamespaceDir(t *testing.T) {
	tests := []struct {
		model string
		max   int
		want  string
	}{
		{"meta-llama/Llama-3.1-8B", 96, "meta-llama-Llama-3.1-8B_0123456789ab_r7"},
		{"", 96, "model_0123456789ab_r7"},
		{".hidden", 96, "-hidden_0123456789ab_r7"},
		{"abcdef", 3, "abc_0123456789ab_r7"},
		{"a b\x00", 96, "a-b-_0123456789ab_r7"},
	}
	for _, tt := range tests {
		if got := string(NamespaceDir([]byte(tt.model), 0x0123456789abcdef, 7, tt.max)); got != tt.want {
			t.Errorf("NamespaceDir(%q) = %q, want %q", tt.model, got, tt.want)
		}
	}
}

func TestNamesDepth(t *testing.T) {
	if _, err := NewNames(MaxDepth + 1); err == nil {
		t.Error("depth beyond MaxDepth accepted")
	}
	n, err := NewNames(MaxDepth)
	if err != nil {
		t.Fatal(err)
	}
	ns := abi.NamespaceRecord{NS: 1, Fingerprint: ^uint64(0), TPRank: ^uint32(0)}
	long := make([]byte, abi.MaxModelLen)
	for i := range long {
		long[i] = 'x'
	}
	ns.SetModelID(string(long))
	if err := n.Declare(&ns); err != nil {
		t.Fatal(err)
	}
	r := abi.NameRecord{NS: 1, Fingerprint: ns.Fingerprint, TPRank: ns.TPRank}
	r.SetKey(make([]byte, abi.MaxKeyLen))
	if err := n.Put(&r); err != nil {
		t.Fatal(err)
	}
	if err := abi.CheckPath(r.Path()); err != nil || r.PathLen != abi.MaxPathLen {
		t.Errorf("longest name %q (%d bytes): %v; want exactly %d bytes", r.Path(), r.PathLen, err, abi.MaxPathLen)
	}
	r.KeyLen = abi.MaxKeyLen + 1
	if err := n.Put(&r); err == nil {
		t.Error("key longer than MaxKeyLen accepted")
	}
	r.KeyLen, r.Fingerprint = 1, 1
	if err := n.Put(&r); err == nil {
		t.Error("fingerprint other than the declaration accepted")
	}
	if err := n.Declare(&abi.NamespaceRecord{NS: MaxNamespaces}); err == nil {
		t.Error("namespace id beyond MaxNamespaces accepted")
	}
}

func TestParseLayoutErrors(t *testing.T) {
	for _, kv := range [][2]string{{"keys_per_file", "0x"}, {"keys_per_file", "-3"}, {"order", "Layer"}} {
		var cfg guest.Config
		cfg.Set(kv[0], kv[1])
		_, err := ParseLayout(cfg)
		var ce *guest.ConfigError
		if !errors.As(err, &ce) || ce.Key != kv[0] {
			t.Errorf("%s=%s: error %v, want a ConfigError for %s", kv[0], kv[1], err, kv[0])
		}
	}
}

func TestTrackerClasses(t *testing.T) {
	tr := NewTracker(1, func(e *Entry) uint32 { return uint32(e.Mount) })
	rec := func(kind uint32, e uint64, mount uint32) *abi.AccessRecord {
		return &abi.AccessRecord{Kind: kind, Entry: e, Time: e, Size: 1, Mount: mount}
	}
	for _, r := range []*abi.AccessRecord{rec(abi.AccessInsert, 1, 0), rec(abi.AccessInsert, 2, 3), rec(abi.AccessInsert, 1, 3), rec(abi.AccessHit, 2, 0)} {
		if err := tr.Apply(r); err != nil {
			t.Fatal(err)
		}
	}
	if len(tr.Lists) != 4 || tr.Lists[0].Len() != 0 || tr.Lists[3].Len() != 2 {
		t.Errorf("lists %+v: want entry 1 moved to class 3 by its re-insert, entry 2 kept there by a hit without a mount", tr.Lists)
	}
	if err := tr.Apply(rec(abi.AccessInsert, 3, MaxClasses)); err == nil || tr.Pool.Len() != 2 {
		t.Errorf("class beyond MaxClasses: %v, %d entries; want an error and no entry", err, tr.Pool.Len())
	}
	// A known entry asked onto a class beyond the limit stays on its list,
	// in the place of its new time.
	r := rec(abi.AccessInsert, 2, MaxClasses)
	r.Time = 0
	if err := tr.Apply(r); err == nil || tr.Pool.Len() != 2 {
		t.Errorf("known entry to a class beyond MaxClasses: %v, %d entries; want an error and both entries", err, tr.Pool.Len())
	}
	if got := listOrder(t, &tr.Pool, &tr.Lists[3]); !slices.Equal(got, []uint64{2, 1}) {
		t.Errorf("class 3 %v, want [2 1]: entry 2 before 1 by its new time", got)
	}
}

// TestEntryIs48Bytes: an entry's size sets how many entries a plugin
// instance's memory holds (RATIONALE.md); Mount and Class are indexes that
// take 16 bits each.
func TestEntryIs48Bytes(t *testing.T) {
	if n := unsafe.Sizeof(Entry{}); n != 48 {
		t.Errorf("an Entry takes %d bytes, want 48", n)
	}
}

// TestTrackerRefusesAMountBeyondMaxMount: an insert or restore whose mount
// does not fit an Entry (above MaxMount) is refused, naming the mount, and
// changes nothing; a hit's mount, which the tracker does not keep, is not
// looked at.
func TestTrackerRefusesAMountBeyondMaxMount(t *testing.T) {
	const bad = MaxMount + 1
	tests := []struct {
		name  string
		kind  uint32
		entry uint64 // 1 is known (mount 3, time 1), 2 is not
	}{
		{"insert", abi.AccessInsert, 2},
		{"restore", abi.AccessRestore, 2},
		{"insert of a known entry", abi.AccessInsert, 1},
		{"restore of a known entry", abi.AccessRestore, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr := NewTracker(1, nil)
			if err := tr.Apply(&abi.AccessRecord{Kind: abi.AccessInsert, Entry: 1, Time: 1, Size: 1, Mount: 3}); err != nil {
				t.Fatal(err)
			}
			err := tr.Apply(&abi.AccessRecord{Kind: tt.kind, Entry: tt.entry, Time: 2, Size: 2, Mount: bad})
			var se *guest.StatusError
			if !errors.As(err, &se) || se.Status != abi.StatusInvalidInput || !strings.Contains(err.Error(), "mount 65536 ") {
				t.Errorf("error %v, want invalid input naming mount 65536", err)
			}
			i, ok := tr.Pool.Lookup(1)
			e := *tr.Pool.At(i)
			e.left, e.right, e.up = 0, 0, 0
			if tr.Pool.Len() != 1 || !ok || e != (Entry{ID: 1, Time: 1, Size: 1, Mount: 3, Hits: 1}) {
				t.Errorf("%d entries, entry 1 %+v; want entry 1 alone, unchanged", tr.Pool.Len(), e)
			}
		})
	}
	t.Run("hit", func(t *testing.T) {
		tr := NewTracker(1, nil)
		for _, r := range []abi.AccessRecord{{Kind: abi.AccessInsert, Entry: 1, Time: 1, Size: 1, Mount: 3}, {Kind: abi.AccessHit, Entry: 1, Time: 2, Mount: bad}} {
			if err := tr.Apply(&r); err != nil {
				t.Fatal(err)
			}
		}
		if i, _ := tr.Pool.Lookup(1); tr.Pool.At(i).Mount != 3 || tr.Pool.At(i).Time != 2 {
			t.Errorf("entry 1 %+v, want mount 3 and time 2", *tr.Pool.At(i))
		}
	})
}

// TestTrackerIgnoresWhatItDoesNotKnow: a hit or pin of an unknown entry
// (a lookup's hit delivered after the entry's REMOVE) learns nothing, and
// a hit older than the entry's last access keeps its time (times are not
// monotonic; a rank never goes down after a hit).
func TestTrackerIgnoresWhatItDoesNotKnow(t *testing.T) {
	for _, tc := range []struct {
		name     string
		recs     []abi.AccessRecord
		entries  int
		time1    uint64 // entry 1's Time, where it is tracked
		pinsOf1  uint32
		tracked1 bool
	}{
		{"hit after remove", []abi.AccessRecord{{Kind: abi.AccessInsert, Entry: 1, Time: 10, Size: 1},
			{Kind: abi.AccessRemove, Entry: 1, Time: 12}, {Kind: abi.AccessHit, Entry: 1, Time: 11, Size: 1}}, 0, 0, 0, false},
		{"pin of an unknown entry", []abi.AccessRecord{{Kind: abi.AccessPin, Entry: 1, Time: 10, Size: 1}}, 0, 0, 0, false},
		{"late hit", []abi.AccessRecord{{Kind: abi.AccessInsert, Entry: 1, Time: 10, Size: 1},
			{Kind: abi.AccessHit, Entry: 1, Time: 20}, {Kind: abi.AccessHit, Entry: 1, Time: 15}}, 1, 20, 0, true},
		{"reinsert sets the time", []abi.AccessRecord{{Kind: abi.AccessInsert, Entry: 1, Time: 20, Size: 1},
			{Kind: abi.AccessInsert, Entry: 1, Time: 15, Size: 1}}, 1, 15, 0, true},
		{"pin of a known entry", []abi.AccessRecord{{Kind: abi.AccessInsert, Entry: 1, Time: 10, Size: 1},
			{Kind: abi.AccessPin, Entry: 1, Time: 11}}, 1, 10, 1, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := NewTracker(1, nil)
			if err := tr.ApplyAll(tc.recs); err != nil {
				t.Fatal(err)
			}
			i, ok := tr.Pool.Lookup(1)
			if tr.Pool.Len() != tc.entries || ok != tc.tracked1 {
				t.Fatalf("%d entries, entry 1 tracked %v; want %d, %v", tr.Pool.Len(), ok, tc.entries, tc.tracked1)
			}
			if ok {
				if e := tr.Pool.At(i); e.Time != tc.time1 || e.Pins != tc.pinsOf1 {
					t.Errorf("entry 1: time %d, %d pins; want %d, %d", e.Time, e.Pins, tc.time1, tc.pinsOf1)
				}
			}
		})
	}
}

// TestNamesEndInTheKeyInHex: every key length, 0 to MaxKeyLen, of random
// bytes and of the bytes whose hex digits are the extremes, named one by
// one (Put) and in one batch (PutAll, PutEach), ends in the key in
// lower-case hex and ".kv" (an empty key in "_.kv") after the fan-out
// directories, and the batch sets Mount only where asked.
func TestNamesEndInTheKeyInHex(t *testing.T) {
	n, err := NewNames(2)
	if err != nil {
		t.Fatal(err)
	}
	ns := abi.NamespaceRecord{NS: 0, Fingerprint: 0xfeedface, MountCount: 3}
	ns.SetModelID("m")
	if err := n.Declare(&ns); err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(9, 9))
	var recs []abi.NameRecord
	for l := range abi.MaxKeyLen + 1 {
		for k := range 20 {
			key := make([]byte, l)
			for i := range key {
				key[i] = byte(rng.Uint32())
			}
			if l > 0 && k%4 == 0 {
				key[0], key[l-1] = 0xff, 0x0a
			}
			r := abi.NameRecord{NS: 0, Fingerprint: ns.Fingerprint, MountCount: 3, Mount: 7}
			r.SetKey(key)
			recs = append(recs, r)
		}
	}
	want := func(r *abi.NameRecord) string {
		h := hex.EncodeToString(r.Key())
		if h == "" {
			h = "_"
		}
		dir := string(NamespaceDir([]byte("m"), ns.Fingerprint, 0, n.modelMax))
		return fmt.Sprintf("%s/%02x/%02x/%s.kv", dir, byte(r.KeyHash>>56), byte(r.KeyHash>>48), h)
	}
	one := slices.Clone(recs)
	for i := range one {
		if err := n.Put(&one[i]); err != nil {
			t.Fatal(err)
		}
	}
	all, each := slices.Clone(recs), slices.Clone(recs)
	if err := n.PutAll(all, 2); err != nil {
		t.Fatal(err)
	}
	if err := n.PutEach(each); err != nil {
		t.Fatal(err)
	}
	for i := range recs {
		w := want(&recs[i])
		for _, c := range []struct {
			how   string
			r     *abi.NameRecord
			mount uint32
		}{{"Put", &one[i], 7}, {"PutAll", &all[i], 2}, {"PutEach", &each[i], 7}} {
			if got := string(c.r.Path()); got != w || c.r.Mount != c.mount {
				t.Fatalf("%s of key %x: %q on mount %d, want %q on mount %d", c.how, recs[i].Key(), got, c.r.Mount, w, c.mount)
			}
		}
	}
}

// TestPutAllReportsTheFirstFailingRecord: a batch whose records fail in
// several ways fails with the first record's failure, whichever check it
// is.
func TestPutAllReportsTheFirstFailingRecord(t *testing.T) {
	n, err := NewNames(1)
	if err != nil {
		t.Fatal(err)
	}
	if err := n.Declare(&abi.NamespaceRecord{NS: 0, Fingerprint: 5}); err != nil {
		t.Fatal(err)
	}
	good := abi.NameRecord{NS: 0, Fingerprint: 5, MountCount: 2}
	good.SetKey([]byte("k"))
	undeclared, oneMount := good, good
	undeclared.NS = 3
	oneMount.MountCount = 1
	for _, c := range []struct {
		recs []abi.NameRecord
		want string
	}{
		{[]abi.NameRecord{good, undeclared, oneMount}, "namespace 3 was not declared"},
		{[]abi.NameRecord{good, oneMount, undeclared}, "configured mount 1 is not below the record's mount count 1"},
	} {
		if err := n.PutAll(c.recs, 1); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("PutAll: %v, want %q", err, c.want)
		}
	}
}

// BenchmarkTrackerHit measures a hit, at a time later than any before, on
// a tracker of 2^16 entries on one list: on the least recent entry (which
// goes from the front to the back: the lru plugin's common touch), and on
// the most recent one (already at the back).
func BenchmarkTrackerHit(b *testing.B) {
	const n = 1 << 16
	for _, tc := range []struct {
		name  string
		entry func(k uint64) uint64 // of the hit that follows k hits
	}{
		{"front to back", func(k uint64) uint64 { return k%n + 1 }},
		{"back again", func(uint64) uint64 { return n }},
	} {
		b.Run(tc.name, func(b *testing.B) {
			tr := NewTracker(1, nil)
			for id := uint64(1); id <= n; id++ {
				if err := tr.Apply(&abi.AccessRecord{Kind: abi.AccessInsert, Entry: id, Time: id, Size: 1}); err != nil {
					b.Fatal(err)
				}
			}
			r := abi.AccessRecord{Kind: abi.AccessHit}
			for k := uint64(0); b.Loop(); k++ {
				r.Entry, r.Time = tc.entry(k), n+1+k
				if err := tr.Apply(&r); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
