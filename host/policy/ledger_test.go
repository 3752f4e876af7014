package policy_test

import (
	"context"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/host/policy/policytest"
	"github.com/kvhost/kvhost/plugins/lru"
	"github.com/kvhost/kvhost/plugins/ttl"
)

// The engine updates its index before it reports an event to the policy, so
// a victim the plugin offers may have been pinned or removed a moment
// before: such a victim is skipped, and is not held against the plugin.
func TestStaleVictimsAreSkipped(t *testing.T) {
	ctx := context.Background()
	idx := policytest.NewIndex()
	h, err := policy.NewNative(func() guest.Policy { return lru.New() }, idx, policy.Config{Shards: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close(ctx)
	var recs []abi.AccessRecord
	for id := uint64(1); id <= 3; id++ {
		recs = append(recs, abi.AccessRecord{Entry: id, Time: id, Size: 100, Kind: abi.AccessInsert})
	}
	idx.Apply(recs)
	if err := h.Access(ctx, recs); err != nil {
		t.Fatal(err)
	}
	// Entry 1 pinned and entry 2 removed in the index, not yet reported.
	idx.Apply([]abi.AccessRecord{{Entry: 1, Kind: abi.AccessPin}, {Entry: 2, Kind: abi.AccessRemove}})
	v, err := h.Victims(ctx, abi.EvictRequest{Bytes: 300, Mount: abi.AnyMount}, 8)
	if err != nil {
		t.Fatalf("victims: %v", err)
	}
	if len(v) != 1 || v[0].Entry != 3 {
		t.Fatalf("victims %+v, want only entry 3", v)
	}
	st := h.Stats()
	if st.StaleVictims != 2 || st.Failures != 0 || st.Replacements != 0 {
		t.Fatalf("stats %+v: want 2 stale victims, no failure", st)
	}
}

// failOnce fails its first Access call that carries a pin, after applying
// nothing: the host replaces the instance, rebuilt from the index and its
// ledger of delivered pins, and must not then send the batch again.
type failOnce struct {
	*lru.Policy
	failed *bool
	pins   map[uint64]int
}

func (p failOnce) Access(recs []abi.AccessRecord) error {
	for _, r := range recs {
		if r.Kind == abi.AccessPin && !*p.failed {
			*p.failed = true
			return guest.InvalidInput("injected failure")
		}
	}
	for _, r := range recs {
		switch r.Kind {
		case abi.AccessPin:
			p.pins[r.Entry]++
		case abi.AccessUnpin:
			p.pins[r.Entry]--
		case abi.AccessRestore:
			p.pins[r.Entry] = 0
		}
	}
	return p.Policy.Access(recs)
}

func TestFailedAccessIsNotReplayedTwice(t *testing.T) {
	ctx := context.Background()
	idx := policytest.NewIndex()
	failed := false
	var last map[uint64]int
	h, err := policy.NewNative(func() guest.Policy {
		last = map[uint64]int{}
		return failOnce{Policy: lru.New(), failed: &failed, pins: last}
	}, idx, policy.Config{Shards: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close(ctx)
	ins := []abi.AccessRecord{{Entry: 1, Time: 1, Size: 100, Kind: abi.AccessInsert}}
	idx.Apply(ins)
	if err := h.Access(ctx, ins); err != nil {
		t.Fatal(err)
	}
	pin := []abi.AccessRecord{{Entry: 1, Time: 2, Kind: abi.AccessPin}}
	idx.Apply(pin)
	h.Access(ctx, pin) // fails once; the replacement is rebuilt with the pin
	if !failed {
		t.Fatal("the injected failure did not happen")
	}
	if got := last[1]; got != 1 {
		t.Fatalf("the rebuilt instance counts %d pins of entry 1, want 1", got)
	}
	unpin := []abi.AccessRecord{{Entry: 1, Time: 3, Kind: abi.AccessUnpin}}
	idx.Apply(unpin)
	if err := h.Access(ctx, unpin); err != nil {
		t.Fatal(err)
	}
	// Unpinned on both sides: the entry can be evicted again.
	v, err := h.Victims(ctx, abi.EvictRequest{Bytes: 100, Mount: abi.AnyMount}, 8)
	if err != nil || len(v) != 1 || v[0].Entry != 1 {
		t.Fatalf("victims %+v, %v: want entry 1", v, err)
	}
}

// A failure status carries the reason the plugin logged, so that an operator
// sees "config tll ..." rather than a bare status code.
func TestFailureCarriesPluginMessage(t *testing.T) {
	_, err := policy.NewNative(func() guest.Policy { return ttl.New() }, policytest.NewIndex(),
		policy.Config{Shards: 1, Params: map[string]string{"tll": "2h"}})
	if err == nil || !strings.Contains(err.Error(), `config tll = "2h": want a known key`) {
		t.Fatalf("error %v, want the plugin's reason", err)
	}
}
