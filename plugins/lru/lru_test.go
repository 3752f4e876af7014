package lru_test

import (
	"bytes"
	"slices"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/plugins/internal/policytest"
	"github.com/kvhost/kvhost/plugins/lru"
)

func mk() guest.Policy { return lru.New() }

func TestCommon(t *testing.T) { policytest.CheckCommon(t, mk) }

func TestNames(t *testing.T) {
	policytest.CheckNames(t, mk, []uint32{1, 3})
	policytest.CheckNames(t, mk, []uint32{3, 8}, "mount", "2")
}

func TestAllocs(t *testing.T) { policytest.CheckAllocs(t, mk, 2) }

// TestName pins the exact name format: the llm-d / vLLM FS tier layout.
func TestName(t *testing.T) {
	d := policytest.MustNew(t, lru.New())
	ns := policytest.Namespace(3, "meta-llama/Llama-3.1-8B", 0x0123456789abcdef, 2, 1)
	if _, err := d.Namespace(ns); err != nil {
		t.Fatal(err)
	}
	recs := []abi.NameRecord{policytest.NameRec(ns, []byte{0xde, 0xad, 0xbe, 0xef})}
	if err := d.Name(recs); err != nil {
		t.Fatal(err)
	}
	want := "meta-llama-Llama-3.1-8B_0123456789ab_r2/" + hexByte(byte(recs[0].KeyHash>>56)) + "/deadbeef.kv"
	if got := string(recs[0].Path()); got != want || recs[0].Mount != 0 {
		t.Errorf("name %q on mount %d, want %q on 0", got, recs[0].Mount, want)
	}
}

func hexByte(c byte) string {
	return string([]byte{"0123456789abcdef"[c>>4], "0123456789abcdef"[c&15]})
}

func TestNamespaceLayout(t *testing.T) {
	tests := []struct {
		cfg       []string
		wantKeys  uint32
		wantOrder uint32
		wantErr   string // substring of the Init error; "" for success
	}{
		{nil, 1, abi.OrderLayerMajor, ""},
		{[]string{"keys_per_file", "16", "order", "block"}, 16, abi.OrderBlockMajor, ""},
		{[]string{"keys_per_file", "256"}, 256, abi.OrderLayerMajor, ""},
		{[]string{"keys_per_file", "0"}, 0, 0, "keys_per_file"},
		{[]string{"keys_per_file", "257"}, 0, 0, "keys_per_file"},
		{[]string{"keys_per_file", "many"}, 0, 0, "keys_per_file"},
		{[]string{"order", "diagonal"}, 0, 0, "order"},
		{[]string{"mount", "-1"}, 0, 0, "mount"},
		{[]string{"mount", "x"}, 0, 0, "mount"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.cfg, "="), func(t *testing.T) {
			var cfg guest.Config
			for i := 0; i < len(tt.cfg); i += 2 {
				cfg.Set(tt.cfg[i], tt.cfg[i+1])
			}
			p := lru.New()
			err := p.Init(cfg)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) || !strings.HasPrefix(err.Error(), "unsupported: lru: config ") {
					t.Errorf("Init error %v, want one naming %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			r := policytest.Namespace(0, "m", 1, 0, 1)
			if err := p.Namespace(&r); err != nil {
				t.Fatal(err)
			}
			if r.KeysPerFile != tt.wantKeys || r.Order != tt.wantOrder {
				t.Errorf("layout %d keys, order %d; want %d, %d", r.KeysPerFile, r.Order, tt.wantKeys, tt.wantOrder)
			}
		})
	}
}

func TestMountConfig(t *testing.T) {
	d := policytest.MustNew(t, lru.New(), "mount", "2")
	if _, err := d.Namespace(policytest.Namespace(0, "m", 1, 0, 2)); err == nil {
		t.Error("mount 2 of 2 accepted")
	}
	ns := policytest.Namespace(0, "m", 1, 0, 3)
	if _, err := d.Namespace(ns); err != nil {
		t.Fatal(err)
	}
	recs := []abi.NameRecord{policytest.NameRec(ns, []byte("k"))}
	if err := d.Name(recs); err != nil || recs[0].Mount != 2 {
		t.Errorf("mount %d, %v; want 2", recs[0].Mount, err)
	}
}

const size = 10

func TestOrder(t *testing.T) {
	ins := func(e, time uint64) abi.AccessRecord { return policytest.Rec(abi.AccessInsert, e, time, size) }
	hit := func(e, time uint64) abi.AccessRecord { return policytest.Rec(abi.AccessHit, e, time, size) }
	restore := func(e, time uint64) abi.AccessRecord { return policytest.Rec(abi.AccessRestore, e, time, size) }
	rem := func(e, time uint64) abi.AccessRecord { return policytest.Rec(abi.AccessRemove, e, time, size) }
	tests := []struct {
		name   string
		events []abi.AccessRecord
		bytes  uint64
		want   []uint64
	}{
		{"insert order", []abi.AccessRecord{ins(1, 1), ins(2, 2), ins(3, 3)}, 100, []uint64{1, 2, 3}},
		{"hit moves to back", []abi.AccessRecord{ins(1, 1), ins(2, 2), ins(3, 3), hit(1, 4)}, 100, []uint64{2, 3, 1}},
		{"reinsert moves to back", []abi.AccessRecord{ins(1, 1), ins(2, 2), ins(1, 3)}, 100, []uint64{2, 1}},
		{"hit of an unknown entry ignored", []abi.AccessRecord{ins(1, 1), hit(9, 2)}, 100, []uint64{1}},
		{"hit after remove ignored", []abi.AccessRecord{ins(1, 1), ins(2, 2), rem(1, 3), hit(1, 4)}, 100, []uint64{2}},
		{"bytes covered", []abi.AccessRecord{ins(1, 1), ins(2, 2), ins(3, 3)}, size + 1, []uint64{1, 2}},
		{"exact bytes", []abi.AccessRecord{ins(1, 1), ins(2, 2), ins(3, 3)}, size, []uint64{1}},
		{"restore sorts by time", []abi.AccessRecord{restore(5, 50), restore(1, 10), restore(3, 30), restore(2, 20)}, 100, []uint64{1, 2, 3, 5}},
		{"restore then hit", []abi.AccessRecord{restore(5, 50), restore(1, 10), hit(1, 60)}, 100, []uint64{5, 1}},
		{"restore overwrites time", []abi.AccessRecord{ins(1, 1), ins(2, 2), restore(1, 3)}, 100, []uint64{2, 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := policytest.MustNew(t, lru.New())
			if err := d.Access(tt.events...); err != nil {
				t.Fatal(err)
			}
			vs, err := d.Evict(abi.EvictRequest{Bytes: tt.bytes, Mount: abi.AnyMount}, 64)
			if err != nil {
				t.Fatal(err)
			}
			if got := policytest.Entries(vs); !slices.Equal(got, tt.want) {
				t.Errorf("victims %v, want %v", got, tt.want)
			}
			for i := 1; i < len(vs); i++ {
				if vs[i].Score < vs[i-1].Score {
					t.Errorf("scores %v are not ascending", vs)
				}
			}
		})
	}
}

// TestRestoreRebuilds checks that an instance rebuilt from restore records
// (in any order) evicts exactly as the instance that saw the live events.
func TestRestoreRebuilds(t *testing.T) {
	live := policytest.MustNew(t, lru.New())
	var restore []abi.AccessRecord
	for e := uint64(1); e <= 200; e++ {
		if err := live.Access(policytest.Rec(abi.AccessInsert, e, e, size)); err != nil {
			t.Fatal(err)
		}
	}
	for e := uint64(1); e <= 200; e += 3 {
		if err := live.Access(policytest.Rec(abi.AccessHit, e, 1000+e, size)); err != nil {
			t.Fatal(err)
		}
	}
	for e := uint64(1); e <= 200; e++ {
		time := e
		if e%3 == 1 {
			time = 1000 + e
		}
		restore = append(restore, policytest.Rec(abi.AccessRestore, e, time, size))
	}
	// The host's index order is not time order.
	slices.SortFunc(restore, func(a, b abi.AccessRecord) int { return bytes.Compare(hash(a.Entry), hash(b.Entry)) })
	rebuilt := policytest.MustNew(t, lru.New())
	if err := rebuilt.Access(restore...); err != nil {
		t.Fatal(err)
	}
	req := abi.EvictRequest{Bytes: 1 << 30, Mount: abi.AnyMount}
	a, err := live.Evict(req, 1024)
	if err != nil {
		t.Fatal(err)
	}
	b, err := rebuilt.Evict(req, 1024)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(a, b) {
		t.Errorf("rebuilt instance evicts\n%v\nlive one\n%v", policytest.Entries(b), policytest.Entries(a))
	}
}

func hash(e uint64) []byte {
	h := abi.KeyHash([]byte{byte(e), byte(e >> 8)})
	return []byte{byte(h >> 56), byte(h >> 48), byte(h >> 40)}
}

func BenchmarkHooks(b *testing.B) { policytest.BenchHooks(b, mk, 1) }

func TestRank(t *testing.T) { policytest.CheckRank(t, mk) }
