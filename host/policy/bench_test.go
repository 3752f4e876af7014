package policy_test

import (
	"context"
	"fmt"
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
// (plugins/lru), with one shard so that a batch is one call, and fills it
// with benchEntries entries.
func benchHost(b *testing.B, kind string) policy.Policy {
	b.Helper()
	ctx := context.Background()
	idx := policytest.NewIndex()
	cfg := policy.Config{Shards: 1, Logger: quietLogger(), Trusted: kind == "wasm-trusted"}
	var h *policy.Host
	var err error
	switch kind {
	case "wat":
		h, err = policy.Open(ctx, fixture(b, "wellbehaved"), "wellbehaved", idx, cfg)
	case "wasm", "wasm-trusted":
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
// policy boundary: the lru plugin in wasm (sandboxed, and Trusted: without
// wazero's interruption checks), the same Go policy natively, and the
// hand-written WAT fixture (host overhead with a minimal guest).
func BenchmarkBoundary(b *testing.B) {
	ctx := context.Background()
	for _, kind := range []string{"wasm", "wasm-trusted", "native", "wat"} {
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
	cfg := policy.Config{CacheDir: b.TempDir(), Logger: quietLogger()}
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
}
