//go:build invariants

package engine

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/kvhost/kvhost/abi"
)

// BenchmarkLoadLayerRange: a load of one layer of N keys against a load
// of every layer of them, in bytes moved per second (buffered I/O, files
// in the page cache: the engine's cost, not the disk's), for both payload
// orders, and for files without layer sums (as written before them), of
// which one layer is verified through the whole key (every layer read).
// Llama-3.1-8B's layers (32, 8 KV heads of 128, bf16), 64 tokens per key
// (2 MiB keys); KVHOST_BENCH_DIR picks the directory.
func BenchmarkLoadLayerRange(b *testing.B) {
	const nkeys = 16
	for _, order := range []uint32{abi.OrderLayerMajor, abi.OrderBlockMajor} {
		ctx := context.Background()
		dir := benchDir(b)
		e, g, c, keys, dst := storedForLayerBench(b, dir, order, nkeys, fmt.Sprintf("bench%d", order))
		bpk := g.BlocksPerKey()
		for _, tc := range []struct {
			name  string
			r     LayerRange
			strip bool // rewrite the files without layer sums first
		}{
			{"every layer", LayerRange{}, false},
			{"one layer", LayerRange{First: g.Layers / 2, Count: 1}, false},
			{"one layer without layer sums", LayerRange{First: g.Layers / 2, Count: 1}, true},
		} {
			if tc.strip {
				for _, path := range dataFiles(b, dir) {
					stripLayerSums(b, path, decodeFile(b, path))
				}
			}
			b.Run(fmt.Sprintf("order=%d/%s", order, tc.name), func(b *testing.B) {
				layers := g.Layers
				if tc.r.Count > 0 {
					layers = tc.r.Count
				}
				b.SetBytes(int64(nkeys*bpk*layers*g.Planes()) * g.BlockBytes())
				for b.Loop() {
					res := wait(b)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: keys, Blocks: dst, Layers: tc.r}))
					if res.Count(OutcomeLoaded) != nkeys {
						b.Fatalf("load: %+v", res)
					}
				}
			})
		}
	}
}

// BenchmarkLoadLayerWise: every layer of N keys loaded as a layer-wise
// client loads them, one job per layer submitted at once, against one job
// of every layer: the cost of the per-layer jobs (each pins, opens, reads
// the header of and plans every file again), in bytes moved per second.
// Buffered I/O from the page cache; the layout of BenchmarkLoadLayerRange.
func BenchmarkLoadLayerWise(b *testing.B) {
	const nkeys = 16
	ctx := context.Background()
	e, g, c, keys, dst := storedForLayerBench(b, benchDir(b), abi.OrderLayerMajor, nkeys, "layerwise")
	bpk := g.BlocksPerKey()
	for _, perJob := range []int{g.Layers, 4, 1} {
		b.Run(fmt.Sprintf("layers per job=%d", perJob), func(b *testing.B) {
			b.SetBytes(int64(nkeys*bpk*g.Layers*g.Planes()) * g.BlockBytes())
			for b.Loop() {
				var jobs []*Job
				for first := 0; first < g.Layers; first += perJob {
					j, err := e.Load(ctx, LoadRequest{Cache: c.id, Keys: keys, Blocks: dst, Layers: LayerRange{First: first, Count: perJob}})
					if err != nil {
						b.Fatal(err)
					}
					jobs = append(jobs, j)
				}
				for _, j := range jobs {
					if res := waitJob(b, j, nil); res.Count(OutcomeLoaded) != nkeys {
						b.Fatalf("load: %+v", res)
					}
				}
			}
		})
	}
}

// storedForLayerBench opens an engine on dir whose files have the payload
// order order, declares Llama-3.1-8B's layers with 64 tokens per key (2 MiB
// keys), and stores nkeys keys named after tag from random blocks of a
// cache twice their size; it returns the engine, the geometry, the cache,
// the keys and the blocks (in the cache's other half) to load them into.
func storedForLayerBench(b *testing.B, dir string, order uint32, nkeys int, tag string) (*Engine, Geometry, *testCache, [][]byte, [][]int) {
	b.Helper()
	e := openEngine(b, Config{Mounts: []Mount{{Path: dir, IO: IOBuffered}}, Policy: newTestPolicy(1, order)})
	g := llama8B()
	g.TokensPerKey = 64
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		b.Fatal(err)
	}
	bpk := g.BlocksPerKey()
	c := newTestCache(b, e, ns, g, 2*nkeys*bpk, layoutPlaneFirst)
	keys := testKeys(tag, nkeys)
	r := rand.New(rand.NewPCG(2, 3))
	src, dst := blockLists(r, nkeys, bpk, 0), blockLists(r, nkeys, bpk, nkeys*bpk)
	for _, bs := range src {
		c.fill(rand.New(rand.NewPCG(1, uint64(bs[0]))), bs)
	}
	storeAndCheck(b, e, c, keys, src)
	return e, g, c, keys, dst
}
