//go:build invariants

package engine

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/tetratelabs/wazero"

	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/testwasm"
	"github.com/kvhost/kvhost/plugins"
	"github.com/kvhost/kvhost/plugins/lru"
)

// builtinPolicies returns constructors of the built-in lru policy, native
// and (if plugins/wasm/lru.wasm was built) in wasm, with a layout.
func builtinPolicies(t *testing.T, cache wazero.CompilationCache, kpf int, order string) map[string]func(policy.Index) (policy.Policy, error) {
	cfg := policy.Config{Params: map[string]string{"keys_per_file": fmt.Sprint(kpf), "order": order}, Logger: testLogger(t), Cache: cache}
	out := map[string]func(policy.Index) (policy.Policy, error){
		"native-lru": func(idx policy.Index) (policy.Policy, error) {
			return policy.NewNative(func() guest.Policy { return lru.New() }, idx, cfg)
		},
	}
	if mod, err := plugins.Wasm(lru.Name); err == nil {
		out["wasm-lru"] = func(idx policy.Index) (policy.Policy, error) {
			return policy.Open(context.Background(), mod, "lru", idx, cfg)
		}
	} else {
		t.Logf("wasm lru not built (%v): native only", err)
	}
	return out
}

// TestRoundTripBuiltinPolicies runs the round trip (store, lookup, load,
// restart, load) through the built-in lru policy, natively and in wasm,
// with every layout it produces.
func TestRoundTripBuiltinPolicies(t *testing.T) {
	cache := sharedCompilationCache()
	for _, kpf := range []int{1, 4} {
		for _, order := range []string{"layer", "block"} {
			for name, newPolicy := range builtinPolicies(t, cache, kpf, order) {
				t.Run(fmt.Sprintf("%s/keysPerFile=%d/order=%s", name, kpf, order), func(t *testing.T) {
					roundTrip(t, t.TempDir(), newPolicy, layoutPlaneFirst, kpf == 1)
				})
			}
		}
	}
}

// TestEvictionBuiltinPolicies fills a small mount through the lru policy:
// stores keep succeeding, usage stays within capacity, the newest keys
// survive, and the oldest are evicted.
func TestEvictionBuiltinPolicies(t *testing.T) {
	for name, newPolicy := range builtinPolicies(t, sharedCompilationCache(), 1, "layer") {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			g := smallGeometry(true)
			fileLen := 4096 + g.KeyBytes()
			e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir(), Capacity: 10 * fileLen, HighWatermark: 0.9, LowWatermark: 0.6}}, NewPolicy: newPolicy})
			ns, err := e.Declare(ctx, g)
			if err != nil {
				t.Fatal(err)
			}
			c := newTestCache(t, e, ns, g, 64, layoutPlaneFirst)
			r := rand.New(rand.NewPCG(4, 4))
			keys := testKeys("ev", 30)
			for i := range keys {
				b := [][]int{{0, 1, 2, 3}}
				c.fill(r, b[0])
				storeAndCheck(t, e, c, keys[i:i+1], b)
				if st := e.Stats(); st.Mounts[0].Used > 10*fileLen {
					t.Fatalf("key %d: %d bytes used", i, st.Mounts[0].Used)
				}
			}
			st := e.Stats()
			if st.Evictions < 15 {
				t.Fatalf("%d evictions", st.Evictions)
			}
			if n, _ := e.Lookup(ctx, ns, keys[len(keys)-5:]); n != 5 {
				t.Fatalf("newest keys: %d of 5", n)
			}
			if n, _ := e.Lookup(ctx, ns, keys[:1]); n != 0 {
				t.Fatal("oldest key survived")
			}
		})
	}
}

var (
	compileOnce  sync.Once
	compileCache wazero.CompilationCache
)

// sharedCompilationCache returns the wazero compilation cache of the
// package's tests, so that each built-in module compiles once per test
// run however many tests and hosts open it: under the race detector on
// 2 cores the lru module took 16 s to compile and the tiered one 14 s,
// which every test (and every restart in it) paid again with a cache of
// its own or none. It lives until the test process exits.
func sharedCompilationCache() wazero.CompilationCache {
	compileOnce.Do(func() { compileCache = testwasm.Cache() })
	return compileCache
}
