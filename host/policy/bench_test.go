package policy_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/host/policy/policytest"
	"github.com/kvhost/kvhost/plugins"
)

// Ceilings of the policy boundary on the 2-core CI machine (issue 2).
const (
	ceilingNsPerKey = 300                    // per key at batch 256
	ceilingStart    = 100 * time.Millisecond // policy ready, compilation cache warm
)

// benchEntries is the number of entries the benchmark's index holds.
const benchEntries = 1 << 16

// benchHost opens the lru policy as wasm (plugins/wasm/lru.wasm) or natively
// (plugins/lru), the WAT fixture ("wat") or the C SDK example ("c",
// examples/c-policy/policy.wasm), with one shard so that a batch is one
// call, and fills it with benchEntries entries.
func benchHost(b *testing.B, kind string) policy.Policy {
	b.Helper()
	ctx := context.Background()
	idx := policytest.NewIndex()
	cfg := policy.Config{Shards: 1, Logger: quietLogger()}
	var h *policy.Host
	var err error
	switch kind {
	case "wat":
		h, err = policy.Open(ctx, fixture(b, "wellbehaved"), "wellbehaved", idx, cfg)
	case "c":
		mod, rerr := os.ReadFile(filepath.Join("..", "..", "examples", "c-policy", "policy.wasm"))
		if rerr != nil {
			b.Fatalf("%v (build it with `make wasm`)", rerr)
		}
		h, err = policy.Open(ctx, mod, "c-policy", idx, cfg)
	case "wasm":
		mod, werr := plugins.Wasm("lru")
		if werr != nil {
			b.Fatalf("%v (build the plugins with `make wasm`)", werr)
		}
		h, err = policy.Open(ctx, mod, "lru", idx, cfg)
	default:
		h, err = policy.NewNative(newLRU, idx, cfg)
	}
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { h.Close(ctx) })
	ns, err := h.Namespace(ctx, testNS)
	if err != nil {
		b.Fatal(err)
	}
	idx.AddNamespace(ns)
	recs := make([]abi.AccessRecord, 0, abi.MaxBatch)
	for id := uint64(1); id <= benchEntries; id++ {
		recs = append(recs, abi.AccessRecord{Entry: id, Time: id, Size: 1 << 20, KeyHash: id * 0x9E3779B97F4A7C15, Kind: abi.AccessInsert})
		if len(recs) == cap(recs) || id == benchEntries {
			idx.Apply(recs)
			if err := h.Access(ctx, recs); err != nil {
				b.Fatal(err)
			}
			recs = recs[:0]
		}
	}
	return h
}

// BenchmarkBoundary measures the per-key cost of batched calls through the
// policy boundary: the lru plugin in wasm (sandboxed: metered by fuel), the
// same Go policy natively, the hand-written WAT fixture (host overhead
// with a minimal guest) and the C SDK example (an LRU list in C, built
// freestanding with clang).
func BenchmarkBoundary(b *testing.B) {
	ctx := context.Background()
	for _, kind := range []string{"wasm", "native", "wat", "c"} {
		h := benchHost(b, kind)
		for _, hook := range []string{"access", "victims", "name"} {
			for _, n := range []int{1, 32, 256} {
				b.Run(fmt.Sprintf("%s/%s/batch=%d", kind, hook, n), func(b *testing.B) {
					var run func(i int) error
					switch hook {
					case "access":
						recs := make([]abi.AccessRecord, n)
						run = func(i int) error {
							for j := range recs {
								id := uint64((i*n+j)%benchEntries) + 1
								recs[j] = abi.AccessRecord{Entry: id, Time: uint64(benchEntries + i*n + j), Size: 1 << 20, Kind: abi.AccessHit}
							}
							return h.Access(ctx, recs)
						}
					case "victims":
						req := abi.EvictRequest{Bytes: uint64(n) << 20, Mount: abi.AnyMount}
						run = func(int) error {
							v, err := h.Victims(ctx, req, n)
							if err == nil && len(v) != n {
								err = fmt.Errorf("%d victims, want %d", len(v), n)
							}
							return err
						}
					case "name":
						recs := nameRecords(n, 0)
						run = func(int) error { return h.Name(ctx, recs) }
					}
					b.ResetTimer()
					for i := 0; b.Loop(); i++ {
						if err := run(i); err != nil {
							b.Fatal(err)
						}
					}
					perKey := float64(b.Elapsed().Nanoseconds()) / float64(b.N*n)
					b.ReportMetric(perKey, "ns/key")
					if n == 256 {
						b.ReportMetric(perKey/ceilingNsPerKey, "of-ceiling")
					}
				})
			}
		}
	}
}

// BenchmarkStartWarmCache measures Open of the lru plugin with a warm
// on-disk compilation cache: from module bytes to a policy ready for calls.
func BenchmarkStartWarmCache(b *testing.B) {
	ctx := context.Background()
	mod, err := plugins.Wasm("lru")
	if err != nil {
		b.Fatalf("%v (build the plugins with `make wasm`)", err)
	}
	// 4 shards is the daemon's default (config.Default).
	for _, shards := range []int{1, 4} {
		b.Run(fmt.Sprintf("shards=%d", shards), func(b *testing.B) {
			cfg := policy.Config{Shards: shards, CacheDir: b.TempDir(), Logger: quietLogger()}
			warm, err := policy.Open(ctx, mod, "lru", policytest.NewIndex(), cfg)
			if err != nil {
				b.Fatal(err)
			}
			warm.Close(ctx)
			for b.Loop() {
				h, err := policy.Open(ctx, mod, "lru", policytest.NewIndex(), cfg)
				if err != nil {
					b.Fatal(err)
				}
				h.Close(ctx)
			}
			per := b.Elapsed() / time.Duration(b.N)
			b.ReportMetric(float64(per.Microseconds())/1000, "ms/start")
			b.ReportMetric(float64(per)/float64(ceilingStart), "of-ceiling")
		})
	}
}

// BenchmarkRunaway measures how long an endless loop (the loop fixture)
// runs before its fuel stops it, as a multiple of the call deadline. Each
// Name call runs the loop twice (the call and its retry on a fresh
// instance). Ceiling: 3 deadlines per runaway call.
func BenchmarkRunaway(b *testing.B) {
	const timeout = 20 * time.Millisecond
	ctx := context.Background()
	h, err := policy.Open(ctx, fixture(b, "loop"), "loop", policytest.NewIndex(),
		policy.Config{Shards: 1, CallTimeout: timeout, MaxFailures: 1 << 30, Logger: quietLogger()})
	if err != nil {
		b.Fatal(err)
	}
	defer h.Close(ctx)
	recs := nameRecords(1, 0)
	for b.Loop() {
		if err := h.Name(ctx, recs); err == nil {
			b.Fatal("the endless loop returned")
		}
	}
	per := b.Elapsed() / time.Duration(2*b.N)
	b.ReportMetric(float64(per.Microseconds())/1000, "ms/runaway-call")
	b.ReportMetric(float64(per)/float64(timeout), "deadlines")
	b.ReportMetric(float64(per)/float64(3*timeout), "of-ceiling")
}

// BenchmarkFuelRate measures how fast plugin code spends fuel: units per
// nanosecond of call time, for the lru plugin and the WAT fixture, per hook
// at batch 256. It is what relates the fuel budget (2 units per nanosecond
// of the deadline) to time; no ceiling.
func BenchmarkFuelRate(b *testing.B) {
	ctx := context.Background()
	for _, kind := range []string{"wasm", "wat", "c"} {
		h := benchHost(b, kind).(*policy.Host)
		for _, hook := range []string{"access", "victims", "name"} {
			b.Run(kind+"/"+hook, func(b *testing.B) {
				const n = 256
				recs := make([]abi.AccessRecord, n)
				names := nameRecords(n, 0)
				read := policy.CountFuel(h)
				for i := 0; b.Loop(); i++ {
					var err error
					switch hook {
					case "access":
						for j := range recs {
							id := uint64((i*n+j)%benchEntries) + 1
							recs[j] = abi.AccessRecord{Entry: id, Time: uint64(benchEntries + i*n + j), Size: 1 << 20, Kind: abi.AccessHit}
						}
						err = h.Access(ctx, recs)
					case "victims":
						_, err = h.Victims(ctx, abi.EvictRequest{Bytes: n << 20, Mount: abi.AnyMount}, n)
					case "name":
						err = h.Name(ctx, names)
					}
					if err != nil {
						b.Fatal(err)
					}
				}
				fuel, ns := read()
				b.ReportMetric(float64(fuel)/float64(ns), "units/ns")
				b.ReportMetric(float64(fuel)/float64(b.N*n), "units/key")
			})
		}
	}
}
