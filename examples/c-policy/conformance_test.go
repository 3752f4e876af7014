// Package cpolicy tests the C example policy (policy.c, built with
// `make wasm` into policy.wasm): the conformance suite, and its LRU order.
package cpolicy

import (
	"context"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/host/policy/conformance"
	"github.com/kvhost/kvhost/host/policy/policytest"
)

func module(t *testing.T) []byte {
	t.Helper()
	wasm, err := os.ReadFile("policy.wasm")
	if err != nil {
		t.Fatalf("%v (build it with `make wasm`, which needs clang and lld: scripts/ensure-clang.sh)", err)
	}
	return wasm
}

// TestConformance runs kvhost's plugin conformance suite (what
// `kvhost policy test examples/c-policy/policy.wasm` runs) on the module.
func TestConformance(t *testing.T) {
	// A generous deadline: this test checks behaviour, and CI runs it
	// beside the race suite on two cores (`make test`'s test-norace).
	r := conformance.Run(context.Background(), module(t), conformance.Options{CallTimeout: time.Second, Name: "c-policy"})
	if !r.OK() {
		var b strings.Builder
		r.WriteTo(&b)
		t.Fatalf("the C example fails the conformance suite:\n%s", b.String())
	}
}

// TestEvictsLeastRecentlyUsed checks the policy's own behaviour through the
// host: the victims come least recent first (a RESTORE with an old time
// included), a hit makes an entry recent, pinned entries and other mounts
// are skipped, and the scores are the last access times.
func TestEvictsLeastRecentlyUsed(t *testing.T) {
	ctx := context.Background()
	idx := policytest.NewIndex()
	h, err := policy.Open(ctx, module(t), "c-policy", idx, policy.Config{Shards: 1, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close(ctx)
	ev := func(id, at uint64, kind, mount uint32) abi.AccessRecord {
		return abi.AccessRecord{Entry: id, Time: at, Size: 100, Kind: kind, Mount: mount}
	}
	recs := []abi.AccessRecord{
		ev(1, 10, abi.AccessInsert, 0),
		ev(2, 20, abi.AccessInsert, 0),
		ev(3, 30, abi.AccessInsert, 1),
		ev(4, 40, abi.AccessInsert, 0),
		ev(5, 5, abi.AccessRestore, 0), // an old entry found at start
		ev(1, 50, abi.AccessHit, 0),    // 1 is now the most recent
		ev(2, 60, abi.AccessPin, 0),    // 2 is in use
	}
	idx.Apply(recs)
	if err := h.Access(ctx, recs); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name  string
		req   abi.EvictRequest
		max   int
		want  []uint64
		score []uint64
	}{
		{"least recent first, pinned skipped", abi.EvictRequest{Bytes: 1 << 20, Mount: abi.AnyMount}, 10, []uint64{5, 3, 4, 1}, []uint64{5, 30, 40, 50}},
		{"only what covers the bytes", abi.EvictRequest{Bytes: 150, Mount: abi.AnyMount}, 10, []uint64{5, 3}, []uint64{5, 30}},
		{"only the requested mount", abi.EvictRequest{Bytes: 1 << 20, Mount: 0}, 10, []uint64{5, 4, 1}, []uint64{5, 40, 50}},
		{"at most max", abi.EvictRequest{Bytes: 1 << 20, Mount: abi.AnyMount}, 1, []uint64{5}, []uint64{5}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v, err := h.Victims(ctx, tt.req, tt.max)
			if err != nil {
				t.Fatal(err)
			}
			if len(v) != len(tt.want) {
				t.Fatalf("victims %+v, want entries %v", v, tt.want)
			}
			for i := range v {
				if v[i].Entry != tt.want[i] || v[i].Score != tt.score[i] {
					t.Fatalf("victims %+v, want entries %v with scores %v", v, tt.want, tt.score)
				}
			}
		})
	}
}
