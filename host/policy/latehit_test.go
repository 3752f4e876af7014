package policy_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/host/policy/policytest"
)

// TestALateHitOfARemovedEntryIsNoFailure: the engine flushes lookups' hits
// after the fact, so a HIT can reach the policy after the REMOVE of its
// entry. The host drops it: a plugin that learns unknown entries (the Go
// example does; the ABI says to ignore them) would otherwise offer the
// removed entry, which the host counts as a failure of the plugin and
// rebuilds its shard (three within a minute switch to the fallback).
func TestALateHitOfARemovedEntryIsNoFailure(t *testing.T) {
	ctx := context.Background()
	for _, kind := range []string{"native lru", "go example"} {
		t.Run(kind, func(t *testing.T) {
			idx := policytest.NewIndex()
			cfg := policy.Config{Shards: 1, Logger: quietLogger()}
			var h *policy.Host
			var err error
			if kind == "native lru" {
				h, err = policy.NewNative(newLRU, idx, cfg)
			} else {
				mod, rerr := os.ReadFile(filepath.Join("..", "..", "examples", "go-policy", "policy.wasm"))
				if rerr != nil {
					t.Fatalf("%v (build it with `make wasm`)", rerr)
				}
				h, err = policy.Open(ctx, mod, "go-policy", idx, cfg)
			}
			if err != nil {
				t.Fatal(err)
			}
			defer h.Close(ctx)
			send := func(recs ...abi.AccessRecord) {
				t.Helper()
				idx.Apply(recs)
				if err := h.Access(ctx, recs); err != nil {
					t.Fatalf("Access: %v", err)
				}
			}
			send(abi.AccessRecord{Entry: 1, Time: 10, Size: 100, Kind: abi.AccessInsert},
				abi.AccessRecord{Entry: 2, Time: 11, Size: 100, Kind: abi.AccessInsert})
			send(abi.AccessRecord{Entry: 1, Time: 12, Kind: abi.AccessRemove})
			send(abi.AccessRecord{Entry: 1, Time: 9, Size: 100, Kind: abi.AccessHit})
			vs, err := h.Victims(ctx, abi.EvictRequest{Bytes: 1000, Mount: abi.AnyMount, Time: 20}, 8)
			if err != nil || h.Stats().Failures != 0 || len(vs) != 1 || vs[0].Entry != 2 {
				t.Fatalf("Victims = %v, %v, %d failures; want entry 2 alone and no failure", vs, err, h.Stats().Failures)
			}
		})
	}
}
