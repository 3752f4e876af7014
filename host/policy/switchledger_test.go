package policy_test

import (
	"context"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/host/policy/policytest"
)

// trap777Wasm's kvhost_access traps on any record whose Time is 777; its
// other hooks do nothing (kvhost_evict offers no victim).
const trap777Wasm = "" +
	"\x00\x61\x73\x6d\x01\x00\x00\x00\x01\x0e\x03\x60\x00\x01\x7e\x60\x01\x7f\x01\x7f\x60\x00\x01\x7f\x03\x08\x07\x00\x01\x01\x02\x01" +
	"\x01\x01\x05\x03\x01\x00\x08\x07\x7d\x08\x06\x6d\x65\x6d\x6f\x72\x79\x02\x00\x0f\x6b\x76\x68\x6f\x73\x74\x5f\x66\x65\x61\x74\x75" +
	"\x72\x65\x73\x00\x00\x0e\x6b\x76\x68\x6f\x73\x74\x5f\x73\x63\x72\x61\x74\x63\x68\x00\x01\x0b\x6b\x76\x68\x6f\x73\x74\x5f\x69\x6e" +
	"\x69\x74\x00\x02\x12\x6b\x76\x68\x6f\x73\x74\x5f\x61\x62\x69\x5f\x76\x65\x72\x73\x69\x6f\x6e\x00\x03\x0b\x6b\x76\x68\x6f\x73\x74" +
	"\x5f\x6e\x61\x6d\x65\x00\x04\x0c\x6b\x76\x68\x6f\x73\x74\x5f\x65\x76\x69\x63\x74\x00\x05\x0d\x6b\x76\x68\x6f\x73\x74\x5f\x61\x63" +
	"\x63\x65\x73\x73\x00\x06\x0a\x53\x07\x04\x00\x42\x00\x0b\x06\x00\x41\x80\x80\x04\x0b\x04\x00\x41\x00\x0b\x04\x00\x41\x01\x0b\x04" +
	"\x00\x41\x7f\x0b\x04\x00\x41\x00\x0b\x31\x01\x01\x7f\x02\x40\x03\x40\x20\x01\x20\x00\x4f\x0d\x01\x41\x80\x80\x04\x20\x01\x41\x30" +
	"\x6c\x6a\x29\x03\x08\x42\x89\x06\x51\x04\x40\x00\x0b\x20\x01\x41\x01\x6a\x21\x01\x0c\x00\x0b\x0b\x41\x00\x0b"

// TestASwitchInAnAccessBatchKeepsTheLaterShardsRecords: an Access batch
// whose record for shard 0 makes the plugin fail and switches the Host to
// its fallback still puts the later shards' records in their ledgers, from
// which the fallback is built: an UNPIN among them is not lost, and the
// entry, unpinned in the index, is offered again.
func TestASwitchInAnAccessBatchKeepsTheLaterShardsRecords(t *testing.T) {
	ctx := context.Background()
	idx := policytest.NewIndex()
	h, err := policy.Open(ctx, []byte(trap777Wasm), "trap777", idx, policy.Config{
		Shards: 2, MaxFailures: 1, Fallback: newLRU, FallbackName: "lru", Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close(ctx)
	var x, y uint64 // x on shard 1, y on shard 0
	for id := uint64(1); x == 0 || y == 0; id++ {
		if policy.Route(id, 2) == 1 && x == 0 {
			x = id
		} else if policy.Route(id, 2) == 0 && y == 0 {
			y = id
		}
	}
	send := func(recs ...abi.AccessRecord) {
		t.Helper()
		idx.Apply(recs)
		if err := h.Access(ctx, recs); err != nil {
			t.Fatalf("Access: %v", err)
		}
	}
	send(abi.AccessRecord{Entry: x, Time: 100, Size: 1 << 20, Kind: abi.AccessInsert},
		abi.AccessRecord{Entry: y, Time: 101, Size: 1 << 20, Kind: abi.AccessInsert},
		abi.AccessRecord{Entry: x, Time: 102, Kind: abi.AccessPin})
	// One batch: a record that makes shard 0 trap, and x's unpin for shard 1.
	send(abi.AccessRecord{Entry: y, Time: 777, Kind: abi.AccessHit},
		abi.AccessRecord{Entry: x, Time: 778, Kind: abi.AccessUnpin})
	if !h.Stats().Fallback {
		t.Fatal("no switch to the fallback")
	}
	if e, _ := idx.Lookup(x); e.Pins != 0 {
		t.Fatalf("index pins of x = %d", e.Pins)
	}
	vs, err := h.Victims(ctx, abi.EvictRequest{Bytes: 1 << 30, Mount: abi.AnyMount, Time: 1000}, 16)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, v := range vs {
		found = found || v.Entry == x
	}
	if !found {
		t.Fatalf("victims %v: entry %d, unpinned in the index, is never offered: the fallback was rebuilt with the pin whose UNPIN the switch dropped", vs, x)
	}
}
