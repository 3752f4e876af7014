package main

import (
	"context"
	"log/slog"
	"path/filepath"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/host/policy/policytest"
	"github.com/kvhost/kvhost/internal/config"
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
