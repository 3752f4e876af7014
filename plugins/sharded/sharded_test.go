package sharded_test

import (
	"fmt"
	"math"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/plugins/internal/policytest"
	"github.com/kvhost/kvhost/plugins/sharded"
)

func mk() guest.Policy { return sharded.New() }

func TestCommon(t *testing.T) { policytest.CheckCommon(t, mk) }

func TestNames(t *testing.T) {
	policytest.CheckNames(t, mk, []uint32{1, 2, 7})
	policytest.CheckNames(t, mk, []uint32{3}, "depth", "4", "mounts", "1,2,3")
	policytest.CheckNames(t, mk, []uint32{1}, "depth", "0")
}

func TestAllocs(t *testing.T) { policytest.CheckAllocs(t, mk, 3) }

func TestConfig(t *testing.T) {
	tests := []struct{ key, value, wantErr string }{
		{"depth", "3", ""},
		{"depth", "5", "depth"},
		{"depth", "-1", "depth"},
		{"depth", "deep", "depth"},
		{"mounts", "1, 2.5 ,1", ""},
		{"mounts", "1,0", "mounts"},
		{"mounts", "1,-1", "mounts"},
		{"mounts", "1,,1", "mounts"},
		{"mounts", "NaN", "mounts"},
		{"mounts", "+Inf", "mounts"},
		{"order", "block", ""},
	}
	for _, tt := range tests {
		var cfg guest.Config
		cfg.Set(tt.key, tt.value)
		err := sharded.New().Init(cfg)
		switch {
		case tt.wantErr == "" && err != nil:
			t.Errorf("%s=%s: %v", tt.key, tt.value, err)
		case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), "sharded: config "+tt.wantErr)):
			t.Errorf("%s=%s: error %v, want one naming %q", tt.key, tt.value, err, tt.wantErr)
		}
	}
}

func TestWeightsMustMatchMounts(t *testing.T) {
	d := policytest.MustNew(t, sharded.New(), "mounts", "1,1,1")
	if _, err := d.Namespace(policytest.Namespace(0, "m", 1, 0, 2)); err == nil {
		t.Error("3 weights accepted for 2 mounts")
	}
	if _, err := d.Namespace(policytest.Namespace(0, "m", 1, 0, 3)); err != nil {
		t.Error(err)
	}
}

func TestNameFormat(t *testing.T) {
	for _, depth := range []int{0, 1, 2, 4} {
		d := policytest.MustNew(t, sharded.New(), "depth", fmt.Sprint(depth))
		ns := policytest.Namespace(0, "Qwen/Qwen3-32B", 0xfedcba9876543210, 1, 4)
		if _, err := d.Namespace(ns); err != nil {
			t.Fatal(err)
		}
		recs := []abi.NameRecord{policytest.NameRec(ns, []byte{1, 2, 3})}
		if err := d.Name(recs); err != nil {
			t.Fatal(err)
		}
		want := "Qwen-Qwen3-32B_fedcba987654_r1/"
		for k := range depth {
			want += fmt.Sprintf("%02x/", byte(recs[0].KeyHash>>(56-8*k)))
		}
		want += "010203.kv"
		if got := string(recs[0].Path()); got != want {
			t.Errorf("depth %d: %q, want %q", depth, got, want)
		}
	}
}

// names the keys 0..n-1 (8-byte big-endian) and returns their mounts.
func mounts(t *testing.T, n int, mountCount uint32, cfg ...string) []uint32 {
	t.Helper()
	d := policytest.MustNew(t, sharded.New(), cfg...)
	ns := policytest.Namespace(0, "m", 1, 0, mountCount)
	if _, err := d.Namespace(ns); err != nil {
		t.Fatal(err)
	}
	out := make([]uint32, 0, n)
	for start := 0; start < n; start += abi.MaxBatch {
		recs := make([]abi.NameRecord, min(abi.MaxBatch, n-start))
		for i := range recs {
			k := uint64(start + i)
			recs[i] = policytest.NameRec(ns, []byte{byte(k >> 56), byte(k >> 48), byte(k >> 40), byte(k >> 32), byte(k >> 24), byte(k >> 16), byte(k >> 8), byte(k)})
		}
		if err := d.Name(recs); err != nil {
			t.Fatal(err)
		}
		for _, r := range recs {
			out = append(out, r.Mount)
		}
	}
	return out
}

func TestMountSpread(t *testing.T) {
	const n = 40000
	tests := []struct {
		mounts  uint32
		weights string
		want    []float64
	}{
		{4, "", []float64{0.25, 0.25, 0.25, 0.25}},
		{3, "1,2,1", []float64{0.25, 0.5, 0.25}},
		{2, "9,1", []float64{0.9, 0.1}},
	}
	for _, tt := range tests {
		var cfg []string
		if tt.weights != "" {
			cfg = []string{"mounts", tt.weights}
		}
		count := make([]int, tt.mounts)
		for _, m := range mounts(t, n, tt.mounts, cfg...) {
			count[m]++
		}
		for m, c := range count {
			// 4 standard deviations of a binomial count.
			sd := math.Sqrt(n * tt.want[m] * (1 - tt.want[m]))
			if math.Abs(float64(c)-n*tt.want[m]) > 4*sd {
				t.Errorf("weights %q: mount %d got %d of %d keys, want about %.0f", tt.weights, m, c, n, n*tt.want[m])
			}
		}
	}
}

// TestMountStable checks that adding a mount only moves keys to the new one.
func TestMountStable(t *testing.T) {
	const n = 20000
	before, after := mounts(t, n, 3), mounts(t, n, 4)
	moved := 0
	for i := range before {
		if before[i] != after[i] {
			moved++
			if after[i] != 3 {
				t.Fatalf("key %d moved from mount %d to old mount %d", i, before[i], after[i])
			}
		}
	}
	if frac := float64(moved) / n; frac < 0.2 || frac > 0.3 {
		t.Errorf("%.2f of the keys moved to the 4th mount, want about 0.25", frac)
	}
}

func TestEvictPerMount(t *testing.T) {
	const size = 10
	d := policytest.MustNew(t, sharded.New())
	// Entries 1..9 on mount e%3, inserted in order; entry 4 pinned; 1 hit last.
	for e := uint64(1); e <= 9; e++ {
		if err := d.Access(policytest.OnMount(policytest.Rec(abi.AccessInsert, e, e, size), uint32(e%3))); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Access(policytest.Rec(abi.AccessPin, 4, 0, 0), policytest.OnMount(policytest.Rec(abi.AccessHit, 1, 10, size), 1)); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		mount uint32
		bytes uint64
		want  []uint64
	}{
		{0, 1 << 20, []uint64{3, 6, 9}},
		{1, 1 << 20, []uint64{7, 1}},
		{1, 1, []uint64{7}},
		{2, 1 << 20, []uint64{2, 5, 8}},
		{5, 1 << 20, nil},
		{abi.AnyMount, 1 << 20, []uint64{2, 3, 5, 6, 7, 8, 9, 1}},
		{abi.AnyMount, 3 * size, []uint64{2, 3, 5}},
	}
	for _, tt := range tests {
		vs, err := d.Evict(abi.EvictRequest{Bytes: tt.bytes, Mount: tt.mount}, 64)
		if err != nil {
			t.Fatal(err)
		}
		if got := policytest.Entries(vs); !slices.Equal(got, tt.want) {
			t.Errorf("mount %d, %d bytes: victims %v, want %v", tt.mount, tt.bytes, got, tt.want)
		}
	}
}

var nameRE = regexp.MustCompile(`^[A-Za-z0-9._-]+_[0-9a-f]{12}_r[0-9]+(/[0-9a-f]{2}){2}/[0-9a-f]+\.kv$`)

func TestNameShape(t *testing.T) {
	d := policytest.MustNew(t, sharded.New())
	ns := policytest.Namespace(0, "x/y", 1, 0, 2)
	if _, err := d.Namespace(ns); err != nil {
		t.Fatal(err)
	}
	recs := []abi.NameRecord{policytest.NameRec(ns, []byte("a")), policytest.NameRec(ns, []byte("b"))}
	if err := d.Name(recs); err != nil {
		t.Fatal(err)
	}
	for _, r := range recs {
		if !nameRE.Match(r.Path()) {
			t.Errorf("name %q does not have the documented shape", r.Path())
		}
	}
}

func BenchmarkHooks(b *testing.B) {
	for _, mounts := range []uint32{1, 4} {
		b.Run(fmt.Sprintf("mounts=%d", mounts), func(b *testing.B) { policytest.BenchHooks(b, mk, mounts) })
	}
}
