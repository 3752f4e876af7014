package policy_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/host/policy/policytest"
)

// interimConfig is a Config that serves the native lru policy from the
// start while the module loads.
func interimConfig() policy.Config {
	return policy.Config{Shards: 2, Logger: quietLogger(), Interim: newLRU, InterimName: "lru"}
}

// sortedVictims returns, sorted, the entries p offers to free bytes on
// any mount.
func sortedVictims(t *testing.T, p policy.Policy, bytes uint64, max int) []uint64 {
	t.Helper()
	v, err := p.Victims(context.Background(), abi.EvictRequest{Bytes: bytes, Mount: abi.AnyMount}, max)
	if err != nil {
		t.Fatalf("Victims: %v", err)
	}
	return victimIDs(v)
}

// TestInterimServesUntilTheModuleLoads checks that Open with an Interim
// policy returns before the module has loaded, serving Interim, and that
// the switch to the plugin keeps what the Interim was told: the entries
// (rebuilt from the index) and the pins (from the ledger).
func TestInterimServesUntilTheModuleLoads(t *testing.T) {
	ctx := context.Background()
	idx := policytest.NewIndex()
	var found []abi.AccessRecord // entries found before the start
	for id := uint64(1); id <= 4; id++ {
		found = append(found, abi.AccessRecord{Entry: id, Time: 1000 + id, Size: 100, KeyHash: id, Kind: abi.AccessInsert})
	}
	idx.Apply(found)
	h, err := policy.Open(ctx, fixture(t, "wellbehaved"), "wellbehaved", idx, interimConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close(ctx)
	if st := h.Stats(); !st.Loading || st.Backend != "native" || st.Fallback {
		t.Fatalf("right after Open: loading %v, backend %q, fallback %v; want the interim native policy serving while the module loads",
			st.Loading, st.Backend, st.Fallback)
	}
	ns, err := h.Namespace(ctx, testNS)
	if err != nil {
		t.Fatal(err)
	}
	idx.AddNamespace(ns)
	insert(t, h, idx, 5, 4, 100, 6) // stored and pinned while the interim serves
	if got := sortedVictims(t, h, 1<<30, 100); !slices.Equal(got, []uint64{1, 2, 3, 4, 5, 7, 8}) {
		t.Fatalf("interim victims %v, want every unpinned entry", got)
	}
	if err := h.WaitLoaded(ctx); err != nil {
		t.Fatalf("WaitLoaded: %v", err)
	}
	if st := h.Stats(); st.Loading || st.Backend != "wasm" || st.Fallback {
		t.Fatalf("after the load: loading %v, backend %q, fallback %v; want the plugin serving", st.Loading, st.Backend, st.Fallback)
	}
	if got := sortedVictims(t, h, 1<<30, 100); !slices.Equal(got, []uint64{1, 2, 3, 4, 5, 7, 8}) {
		t.Fatalf("plugin victims after the switch %v, want every unpinned entry, 6 still pinned", got)
	}
}

// TestInterimGoesOnWhenTheModuleFails checks that a module that fails to
// load after Open returned leaves the interim policy serving as the
// fallback, with the reason, and that WaitLoaded returns the module
// error.
func TestInterimGoesOnWhenTheModuleFails(t *testing.T) {
	ctx := context.Background()
	idx := policytest.NewIndex()
	h, err := policy.Open(ctx, fixture(t, "noevict"), "noevict", idx, interimConfig())
	if err != nil {
		t.Fatalf("Open with an interim policy: %v; want the interim serving, the module's error from WaitLoaded", err)
	}
	defer h.Close(ctx)
	if err := h.WaitLoaded(ctx); !errors.Is(err, policy.ErrModule) {
		t.Fatalf("WaitLoaded: %v; want ErrModule", err)
	}
	st := h.Stats()
	if !st.Fallback || st.FallbackPolicy != "lru" || st.Backend != "native" || st.Loading {
		t.Fatalf("stats %+v; want the interim lru serving as the fallback", st)
	}
	insert(t, h, idx, 1, 3, 100)
	if got := sortedVictims(t, h, 1<<30, 100); !slices.Equal(got, []uint64{1, 2, 3}) {
		t.Fatalf("victims %v, want 1 2 3", got)
	}
}

// TestLoadTimeoutWaitsForAModuleThatLoadsInTime checks that Open serves
// the plugin itself when it loads within LoadTimeout.
func TestLoadTimeoutWaitsForAModuleThatLoadsInTime(t *testing.T) {
	ctx := context.Background()
	cfg := interimConfig()
	cfg.LoadTimeout = time.Minute
	h, err := policy.Open(ctx, fixture(t, "wellbehaved"), "wellbehaved", policytest.NewIndex(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close(ctx)
	if st := h.Stats(); st.Loading || st.Backend != "wasm" {
		t.Fatalf("loading %v, backend %q; want the plugin, loaded within the timeout", st.Loading, st.Backend)
	}
	if err := h.WaitLoaded(ctx); err != nil {
		t.Fatalf("WaitLoaded: %v", err)
	}
}

// TestCloseWhileTheModuleLoads checks that a Host closed before its
// module loaded closes the module when it arrives and says so.
func TestCloseWhileTheModuleLoads(t *testing.T) {
	ctx := context.Background()
	h, err := policy.Open(ctx, fixture(t, "wellbehaved"), "wellbehaved", policytest.NewIndex(), interimConfig())
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if err := h.WaitLoaded(ctx); !errors.Is(err, policy.ErrClosed) {
		t.Fatalf("WaitLoaded after Close: %v; want ErrClosed", err)
	}
}

// TestInterimParamsRefusedFailOpen checks that configuration the interim
// policy refuses fails Open, as the plugin's own refusal would.
func TestInterimParamsRefusedFailOpen(t *testing.T) {
	cfg := interimConfig()
	cfg.InterimParams = map[string]string{"no_such_key": "1"}
	_, err := policy.Open(context.Background(), fixture(t, "wellbehaved"), "wellbehaved", policytest.NewIndex(), cfg)
	var pe *policy.Error
	if !errors.As(err, &pe) || pe.Hook != "kvhost_init" {
		t.Fatalf("Open: %v; want the interim's kvhost_init refusal", err)
	}
}

// TestOpenGivesUpWhenItsCallerDoes checks that Open, waiting for a module
// within LoadTimeout, returns its caller's context error once the caller
// gives up, rather than waiting out the timeout.
func TestOpenGivesUpWhenItsCallerDoes(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	cfg := interimConfig()
	cfg.LoadTimeout = time.Hour
	if _, err := policy.Open(ctx, fixture(t, "wellbehaved"), "wellbehaved", policytest.NewIndex(), cfg); !errors.Is(err, context.Canceled) {
		t.Fatalf("Open with a cancelled context: %v; want context.Canceled", err)
	}
}
