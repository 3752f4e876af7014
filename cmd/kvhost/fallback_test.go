package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"testing"

	"github.com/kvhost/kvhost/internal/testwait"
)

// TestAFallbackServesWhateverThePluginsParams: a plugin's [policy.params]
// that its native fallback does not know (x, a vendor's key) do not stop
// the fallback: once the failing plugin falls back, keys are stored and
// loaded again, and the start names the params the fallback ignores.
func TestAFallbackServesWhateverThePluginsParams(t *testing.T) {
	traversal, err := filepath.Abs(filepath.Join("..", "..", "host", "policy", "testdata", "traversal.wasm"))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	// A plugin that fails every name, with a key of its own and one lru
	// knows.
	file, socket, _ := testConfig(t, dir, fmt.Sprintf("name = %q\n\n[policy.params]\nx = 2\nkeys_per_file = 2\n", traversal))
	p := startProc(t, nil, "serve", "--config", file)
	k := newKVCache(t, socket)
	rng := rand.New(rand.NewPCG(1, 2))
	testwait.Until(t, "a key to round-trip through the fallback", hangBound, func() bool {
		return k.roundTrip(context.Background(), "k", []uint32{0, 1}, rng) == nil // fails while the plugin runs
	})
	if st := daemonStats(t, socket); !st.Daemon.Fallback || st.Daemon.FallbackPolicy != "lru" {
		t.Fatalf("fallback %v to %q, want a fallback to lru", st.Daemon.Fallback, st.Daemon.FallbackPolicy)
	}
	if m := p.stderr.logLine(t, "the native fallback policy ignores these [policy.params]"); m["keys"] != "x" || m["fallback"] != "lru" {
		t.Fatalf("the start logged %v; want the key x ignored by lru", m)
	}
}
