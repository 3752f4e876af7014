package objstore_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/objstore"
)

// BenchmarkLoadAgainstParallelGet loads 8 keys of 8 MiB from the bucket
// into a node's cache through the engine (header check, ranged GETs into
// the blocks, CRC-32C) and, in the same iterations, reads the same
// objects with the S3 client's own parallel ranged GETs (the same range
// size, 1 MiB, and requests in flight) into a buffer: the ceiling. It
// reports both rates and load/ceiling.
func BenchmarkLoadAgainstParallelGet(b *testing.B) {
	cfg := rgwConfig(b)
	cfg.RangeSize = 1 << 20
	a := openNode(b, filepath.Join(b.TempDir(), "a"), cfg)
	const n = 8
	keys, _ := storeKeys(b, a, "bench", n)
	c := openNode(b, filepath.Join(b.TempDir(), "c"), cfg)
	into := c.blocks(n, 0)
	names := make([]string, n)
	for i, k := range keys {
		names[i] = c.store.Name(c.geo.Fingerprint(), k)
	}
	size := 4096 + c.geo.KeyBytes() // one key's file
	buf := make([]byte, n*size)
	raw := objstore.RawClient(c.store)
	ctx := context.Background()
	var load, ceiling time.Duration
	for b.Loop() {
		t0 := time.Now()
		if err := raw.ParallelGet(ctx, names, size, cfg.RangeSize, objstore.DefaultRequests, buf); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		res := wait(b)(c.eng.Load(ctx, engine.LoadRequest{Cache: c.cache, Keys: keys, Blocks: into}))
		load += time.Since(t1)
		ceiling += t1.Sub(t0)
		for i, k := range res.Keys {
			if k.Outcome != engine.OutcomeLoaded {
				b.Fatalf("key %s: %v (%v)", keys[i], k.Outcome, k.Err)
			}
		}
	}
	bytes := float64(b.N) * float64(n*size)
	b.ReportMetric(bytes/load.Seconds()/1e9, "load-GB/s")
	b.ReportMetric(bytes/ceiling.Seconds()/1e9, "ceiling-GB/s")
	b.ReportMetric(ceiling.Seconds()/load.Seconds(), "load/ceiling")
}
