package main

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/host/policy/policytest"
	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/internal/testwait"
)

// TestFailingPluginFallsBackToAMountAwarePolicy: a plugin that keeps
// failing falls back to tiered on a daemon with several kvhost mounts
// (it demotes; lru would delete and send every file to mount 0, issue 37)
// and to lru on a daemon with one.
func TestFailingPluginFallsBackToAMountAwarePolicy(t *testing.T) {
	kv := func(p string) config.Mount { return config.Mount{Path: p} }
	vllm := config.Mount{Path: "/v", Layout: config.LayoutVLLMFS}
	tests := []struct {
		name   string
		mounts []config.Mount
		want   string
		demote bool
	}{
		{"one mount", []config.Mount{kv("/a")}, "lru", false},
		{"memory and disk", []config.Mount{kv("/a"), kv("/b")}, "tiered", true},
		{"one kvhost mount and a vllm-fs mount", []config.Mount{kv("/a"), vllm}, "lru", false},
	}
	traversal := filepath.Join("..", "..", "host", "policy", "testdata", "traversal.wasm")
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			d := &daemon{log: slog.New(slog.DiscardHandler)}
			cfg := config.Config{Mounts: tt.mounts}
			cfg.Policy.Name, cfg.Policy.Shards, cfg.Policy.CacheDir = traversal, 1, t.TempDir()
			b, err := d.policyBuilder(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			idx := policytest.NewIndex()
			p, err := b.fn(idx)
			if err != nil {
				t.Fatalf("%v (build the fixtures with `make wasm`)", err)
			}
			defer p.Close(ctx)
			ns := abi.NamespaceRecord{Fingerprint: 1, MountCount: uint32(len(tt.mounts)), KeyBytes: 1}
			rec := abi.NameRecord{Fingerprint: 1, MountCount: ns.MountCount}
			rec.SetKey([]byte("k"))
			for range policy.DefaultMaxFailures {
				p.Name(ctx, []abi.NameRecord{rec}) // the traversal plugin fails each time
			}
			st := b.host.Stats()
			if !st.Fallback || st.FallbackPolicy != tt.want || p.Features().Has(abi.FeatureDemote) != tt.demote {
				t.Fatalf("fallback %v to %q, demotes %v; want a fallback to %q, demotes %v",
					st.Fallback, st.FallbackPolicy, p.Features().Has(abi.FeatureDemote), tt.want, tt.demote)
			}
		})
	}
}

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

// TestTheFallbackTakesTheParamsItKnows: the fallback gets the keys of
// [policy.params] it reads and names the others.
func TestTheFallbackTakesTheParamsItKnows(t *testing.T) {
	params := map[string]any{"x": 2, "keys_per_file": 2, "mount": 1, "hot": 1}
	tests := []struct {
		name    string
		mounts  []config.Mount
		want    string
		params  map[string]string
		ignored []string
	}{
		{"one mount", []config.Mount{{Path: "/a"}}, "lru",
			map[string]string{"keys_per_file": "2", "mount": "1"}, []string{"hot", "x"}},
		{"two mounts", []config.Mount{{Path: "/a"}, {Path: "/b"}}, "tiered",
			map[string]string{"keys_per_file": "2", "hot": "1"}, []string{"mount", "x"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := config.Config{Mounts: tt.mounts}
			cfg.Policy.Params = params
			fb := fallbackPolicy(cfg)
			if fb.name != tt.want || !maps.Equal(fb.params, tt.params) || !slices.Equal(fb.ignored, tt.ignored) {
				t.Fatalf("fallback %s with %v, ignoring %v; want %s with %v, ignoring %v",
					fb.name, fb.params, fb.ignored, tt.want, tt.params, tt.ignored)
			}
		})
	}
}
