package ttl_test

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/plugins/internal/policytest"
	"github.com/kvhost/kvhost/plugins/ttl"
)

func mk() guest.Policy { return ttl.New() }

func TestCommon(t *testing.T) { policytest.CheckCommon(t, mk) }

func TestNames(t *testing.T) { policytest.CheckNames(t, mk, []uint32{1, 4}, "ttl", "1h") }

func TestAllocs(t *testing.T) { policytest.CheckAllocs(t, mk, 1) }

func TestConfig(t *testing.T) {
	tests := []struct {
		key, value string
		wantErr    string
	}{
		{"ttl", "90s", ""},
		{"ttl", "2h", ""},
		{"ttl", "0s", "ttl"},
		{"ttl", "-1h", "ttl"},
		{"ttl", "1 day", "ttl"},
		{"ttl", "3600", "ttl"},
		{"keys_per_file", "two", "keys_per_file"},
		{"order", "random", "order"},
		{"kvhost.shards", "4", ""},
		{"tll", "2h", "tll"}, // a typo fails at start
	}
	for _, tt := range tests {
		t.Run(tt.key+"="+tt.value, func(t *testing.T) {
			var cfg guest.Config
			cfg.Set(tt.key, tt.value)
			err := ttl.New().Init(cfg)
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatal(err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), "ttl: config "+tt.wantErr)):
				t.Errorf("error %v, want one naming %q", err, tt.wantErr)
			}
		})
	}
}

func TestExpiry(t *testing.T) {
	const size = 10
	h := uint64(time.Hour)
	ins := func(e, at uint64) abi.AccessRecord { return policytest.Rec(abi.AccessInsert, e, at, size) }
	hit := func(e, at uint64) abi.AccessRecord { return policytest.Rec(abi.AccessHit, e, at, size) }
	pin := func(e uint64) abi.AccessRecord { return policytest.Rec(abi.AccessPin, e, 0, 0) }
	tests := []struct {
		name   string
		events []abi.AccessRecord
		now    uint64
		bytes  uint64
		want   []uint64
	}{
		{"nothing expired, nothing needed", []abi.AccessRecord{ins(1, 1*h), ins(2, 2*h)}, 3 * h, 0, nil},
		{"expired beyond the bytes", []abi.AccessRecord{ins(1, 1*h), ins(2, 2*h), ins(3, 4*h)}, 4*h + 1, 0, []uint64{1, 2}},
		{"exactly ttl old is not expired", []abi.AccessRecord{ins(1, 1*h), ins(2, 2*h)}, 3 * h, 0, nil},
		{"expired, then LRU", []abi.AccessRecord{ins(1, 1*h), ins(2, 3*h), ins(3, 4*h)}, 3 * h, 2*size + 1, []uint64{1, 2, 3}},
		{"hit renews", []abi.AccessRecord{ins(1, 1*h), ins(2, 2*h), hit(1, 3*h)}, 4*h + 1, 0, []uint64{2}},
		{"pinned expired entry stays", []abi.AccessRecord{ins(1, 1*h), ins(2, 2*h), pin(1)}, 4*h + 1, 0, []uint64{2}},
		// The engine reports a lookup's hit after later inserts, and
		// inserts a file found on disk or moved with its last access.
		{"late hit behind a newer entry", []abi.AccessRecord{ins(1, 1*h), ins(2, 3*h), hit(1, 1*h+1)}, 3*h + 2, 0, []uint64{1}},
		{"old insert behind a newer entry", []abi.AccessRecord{ins(1, 3*h), ins(2, 1*h)}, 3*h + 1, 0, []uint64{2}},
		{"old insert between entries", []abi.AccessRecord{ins(1, 1*h), ins(2, 5*h), ins(3, 2*h)}, 4*h + 1, 0, []uint64{1, 3}},
		{"restored times", []abi.AccessRecord{policytest.Rec(abi.AccessRestore, 1, 5*h, size), policytest.Rec(abi.AccessRestore, 2, 1*h, size)}, 3*h + 1, 0, []uint64{2}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := policytest.MustNew(t, ttl.New(), "ttl", "2h")
			if err := d.Access(tt.events...); err != nil {
				t.Fatal(err)
			}
			vs, err := d.Evict(abi.EvictRequest{Bytes: tt.bytes, Time: tt.now, Mount: abi.AnyMount}, 64)
			if err != nil {
				t.Fatal(err)
			}
			if got := policytest.Entries(vs); !slices.Equal(got, tt.want) {
				t.Errorf("victims %v, want %v", got, tt.want)
			}
		})
	}
}

// TestExpiryOfAnOldInsertBehindManyEntries: an entry inserted with an old
// last access, behind more newer entries than the tracker walks past, is
// still offered first.
func TestExpiryOfAnOldInsertBehindManyEntries(t *testing.T) {
	h := uint64(time.Hour)
	d := policytest.MustNew(t, ttl.New(), "ttl", "2h")
	for e := uint64(1); e <= 1000; e++ {
		if err := d.Access(policytest.Rec(abi.AccessInsert, e, 3*h+e, 1)); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Access(policytest.Rec(abi.AccessInsert, 1001, 1*h, 1)); err != nil {
		t.Fatal(err)
	}
	vs, err := d.Evict(abi.EvictRequest{Time: 3*h + 1, Mount: abi.AnyMount}, 64)
	if err != nil {
		t.Fatal(err)
	}
	if got := policytest.Entries(vs); !slices.Equal(got, []uint64{1001}) {
		t.Errorf("victims %v, want the expired entry 1001", got)
	}
}

func TestExpiryBoundedByOutput(t *testing.T) {
	d := policytest.MustNew(t, ttl.New(), "ttl", "1s")
	for e := uint64(1); e <= 10; e++ {
		if err := d.Access(policytest.Rec(abi.AccessInsert, e, e, 1)); err != nil {
			t.Fatal(err)
		}
	}
	vs, err := d.Evict(abi.EvictRequest{Time: uint64(time.Hour), Mount: abi.AnyMount}, 4)
	if err != nil {
		t.Fatal(err)
	}
	if got := policytest.Entries(vs); !slices.Equal(got, []uint64{1, 2, 3, 4}) {
		t.Errorf("victims %v, want the 4 oldest", got)
	}
}

func BenchmarkHooks(b *testing.B) { policytest.BenchHooks(b, mk, 1) }
