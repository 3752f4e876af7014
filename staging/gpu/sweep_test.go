package gpu

import (
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"testing"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/transfer"
)

// TestGPUSweep measures the mover's pipeline settings (chunk, depth) on tmpfs, 128 × 32 MiB keys, 16 jobs, checksums on, next to the
// host ceilings of the same run. KVHOST_GPU=1 runs it.
func TestGPUSweep(t *testing.T) {
	needGPU(t)
	rep := newReport(t, ".sweep")
	r, w := openGPU(t, cuda.Config{})
	g := llama8B()
	kv := newCache(t, w, g)
	kv.randomize(t, w, 1)
	dir := benchDir(t, "sweep")
	const files, jobs = 128, 16
	rnd := rand.New(rand.NewPCG(3, 3))
	plans := make([]*transfer.Plan, files)
	paths := make([]string, files)
	for i := range plans {
		plans[i] = kv.plan(keyBlocks(rnd, g.numBlocks, g.blocksPerKey), false)
		paths[i] = filepath.Join(dir, fmt.Sprintf("k%d", i))
	}
	keyBytes := int64(g.layers * g.blocksPerKey * g.pageBytes)
	total := keyBytes * files
	hostPass(r, paths, keyBytes, g, jobs, true, false) // create, fault pages in
	for _, c := range []struct{ chunk, depth int }{
		{8 << 20, 2}, {4 << 20, 2}, {4 << 20, 3}, {2 << 20, 4}, {1 << 20, 4}, {16 << 20, 2}, {32 << 20, 2},
	} {
		cw, err := hostPass(r, paths, keyBytes, g, jobs, true, false)
		if err != nil {
			t.Fatal(err)
		}
		m, err := New(Config{Runtime: r, Devices: []int{0}, Chunk: c.chunk, Depth: c.depth,
			MaxStaging: int64(jobs*c.depth) * int64(c.chunk+2*align)})
		if err != nil {
			t.Fatal(err)
		}
		ws, err := moverPass(m, paths, plans, jobs, true, false)
		if err != nil {
			t.Fatal(err)
		}
		cr, err := hostPass(r, paths, keyBytes, g, jobs, false, false)
		if err != nil {
			t.Fatal(err)
		}
		ls, err := moverPass(m, paths, plans, jobs, false, false)
		m.Close()
		if err != nil {
			t.Fatal(err)
		}
		rep.printf("sweep tmpfs 128×32 MiB, 16 jobs, chunk %d MiB depth %d: store %.1f GB/s (ceiling %.1f: %.2f), load %.1f GB/s (ceiling %.1f: %.2f)",
			c.chunk>>20, c.depth, gbps(total, ws), gbps(total, cw), gbps(total, ws)/gbps(total, cw), gbps(total, ls), gbps(total, cr), gbps(total, ls)/gbps(total, cr))
	}
}

// openGPU opens the CUDA runtime of cfg and a worker on device 0, both
// closed when the test ends.
func openGPU(t *testing.T, cfg cuda.Config) (*cuda.Runtime, *cuda.Worker) {
	t.Helper()
	r, err := cuda.Open(cfg)
	if err != nil {
		t.Fatalf("cuda.Open: %v", err)
	}
	t.Cleanup(func() { r.Close() })
	w, err := r.NewWorker(0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	return r, w
}
