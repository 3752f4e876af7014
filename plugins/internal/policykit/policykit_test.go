package policykit

import (
	"encoding/hex"
	"errors"
	"math/rand/v2"
	"slices"
	"testing"

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

func TestSortByTime(t *testing.T) {
	for _, n := range []int{0, 1, 2, 3, 7, 64, 1000} {
		rng := rand.New(rand.NewPCG(uint64(n), 1))
		var p Pool
		l := NewList()
		for k := range n {
			i, _ := p.Add(uint64(k))
			p.At(i).Time = rng.Uint64N(uint64(n/2 + 1)) // with ties
			l.PushBack(&p, i)
		}
		l.SortByTime(&p)
		var got []Entry
		for i := l.Front(); i >= 0; i = p.Next(i) {
			got = append(got, *p.At(i))
		}
		if len(got) != n || l.Len() != n {
			t.Fatalf("n=%d: %d entries after sort", n, len(got))
		}
		for k := 1; k < n; k++ {
			if got[k].Time < got[k-1].Time || got[k].Time == got[k-1].Time && got[k].ID < got[k-1].ID {
				t.Fatalf("n=%d: not a stable sort by time at %d", n, k)
			}
		}
		// Back links: walk from the tail.
		count := 0
		for i := l.tail; i >= 0; i = p.At(i).prev {
			count++
		}
		if count != n {
			t.Fatalf("n=%d: %d entries walking back", n, count)
		}
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
	tr := NewTracker(1, func(e *Entry) uint32 { return e.Mount })
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

func TestPutHex(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 9))
	for n := range abi.MaxKeyLen + 1 {
		for range 20 {
			key := make([]byte, n)
			for i := range key {
				key[i] = byte(rng.Uint32())
			}
			if n > 0 && rng.IntN(4) == 0 {
				key[0], key[n-1] = 0xff, 0x0a
			}
			dst := make([]byte, 2*n)
			putHex(dst, key)
			if want := hex.EncodeToString(key); string(dst) != want {
				t.Fatalf("putHex(%x) = %s", key, dst)
			}
		}
	}
}
