package objstore_test

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/objstore"
	"github.com/kvhost/kvhost/internal/objstore/objstoretest"
)

// BenchmarkLoadAgainstParallelGet loads 8 keys of 8 MiB from the bucket
// into a node's cache through the engine (header check, ranged GETs into
// the blocks, CRC-32C) and, in the same iterations, each first in turn,
// reads the same objects with the S3 client's own parallel ranged GETs
// (the same ranges, 1 MiB, as many requests per object, and requests in
// flight, 32) into a buffer: the ceiling. It reports both rates and
// load/ceiling, with the engine's I/O workers at 2 (a 2-core machine's)
// and 8: keys loaded from the bucket take the object mount's slots
// (engine.DefaultObjectKeys), not the I/O workers', so every key is in
// flight at either.
func BenchmarkLoadAgainstParallelGet(b *testing.B) {
	for _, workers := range []int{2, 8} {
		b.Run(fmt.Sprintf("io_workers=%d", workers), func(b *testing.B) { benchLoad(b, workers) })
	}
}

func benchLoad(b *testing.B, workers int) {
	cfg := rgwConfig(b)
	cfg.RangeSize = 1 << 20
	a := objstoretest.OpenNode(b, filepath.Join(b.TempDir(), "a"), cfg)
	const n = 8
	keys, _ := a.StoreKeys(b, "bench", n)
	c := objstoretest.OpenNodeWith(b, engine.Mount{Path: filepath.Join(b.TempDir(), "c")}, cfg, objstoretest.Options{IOWorkers: workers})
	into := c.Blocks(n, 0)
	names := make([]string, n)
	for i, k := range keys {
		names[i] = c.Store.Name(c.Geo.Fingerprint(), k)
	}
	size := 4096 + c.Geo.KeyBytes() // one key's file
	buf := make([]byte, n*size)
	raw := objstore.RawClient(c.Store)
	ctx := context.Background()
	var load, ceiling time.Duration
	getAll := func() {
		t := time.Now()
		if err := raw.ParallelGet(ctx, names, size, cfg.RangeSize, objstore.DefaultRequests, buf); err != nil {
			b.Fatal(err)
		}
		ceiling += time.Since(t)
	}
	loadAll := func() {
		t := time.Now()
		res := objstoretest.Wait(b)(c.Eng.Load(ctx, engine.LoadRequest{Cache: c.Cache, Keys: keys, Blocks: into}))
		load += time.Since(t)
		for i, k := range res.Keys {
			if k.Outcome != engine.OutcomeLoaded {
				b.Fatalf("key %s: %v (%v)", keys[i], k.Outcome, k.Err)
			}
		}
	}
	for i := 0; b.Loop(); i++ {
		if i%2 == 0 {
			getAll()
			loadAll()
		} else {
			loadAll()
			getAll()
		}
	}
	bytes := float64(b.N) * float64(n*size)
	b.ReportMetric(bytes/load.Seconds()/1e9, "load-GB/s")
	b.ReportMetric(bytes/ceiling.Seconds()/1e9, "ceiling-GB/s")
	b.ReportMetric(ceiling.Seconds()/load.Seconds(), "load/ceiling")
}
