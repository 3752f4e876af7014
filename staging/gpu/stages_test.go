package gpu

import (
	"bytes"
	"context"
	"math/rand/v2"
	"testing"

	"github.com/kvhost/kvhost/internal/cuda"
	"github.com/kvhost/kvhost/internal/cuda/cudatest"
)

// TestPinnedStagesOfMemoryFilesHoldAtMost2MiB: a store or load of a file
// on a memory file system through the pinned buffers moves in stages of at
// most memoryChunk (one batched copy each), while a file on a device keeps
// the configured chunk; both round-trip their bytes.
func TestPinnedStagesOfMemoryFilesHoldAtMost2MiB(t *testing.T) {
	e := newEnv(t)
	// 8 layers x 16 blocks x 64 KiB: an 8 MiB key.
	g := geometry{layers: 8, numBlocks: 32, pageBytes: 64 << 10, blocksPerKey: 16, headerBytes: 4096}
	kv := newCache(t, e.w, g)
	orig := kv.randomize(t, e.w, 5)
	blocks := keyBlocks(rand.New(rand.NewPCG(5, 2)), g.numBlocks, g.blocksPerKey)
	m := e.mover(t, Config{Devices: []int{0}, MaxStaging: 32 << 20, Chunk: 4 << 20, Copy: cuda.CopyBatch})
	cases := []struct {
		name       string
		memory     bool
		wantStages int
	}{
		{"memory file system", true, 8 << 20 / memoryChunk},
		{"device", false, 8 << 20 / (4 << 20)},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := kv.plan(blocks, false)
			p.Memory = c.memory
			f := createFile(t, "key")
			for _, write := range []bool{true, false} {
				before := e.fake.Count(cudatest.OpBatch)
				var err error
				if write {
					_, err = m.WriteFile(context.Background(), f, p, make([]uint32, p.Sums))
				} else {
					kv.poison(t, e.w)
					_, err = m.ReadFile(context.Background(), f, p, make([]uint32, p.Sums))
				}
				if err != nil {
					t.Fatal(err)
				}
				if got := e.fake.Count(cudatest.OpBatch) - before; got != c.wantStages {
					t.Errorf("write %v: %d batched copies, want %d stages", write, got, c.wantStages)
				}
			}
			pb := g.pageBytes
			for l := range g.layers {
				dev := kv.get(t, e.w, l)
				for _, b := range blocks {
					if !bytes.Equal(dev[b*pb:(b+1)*pb], orig[l][b*pb:(b+1)*pb]) {
						t.Fatalf("layer %d block %d: loaded bytes differ", l, b)
					}
				}
			}
		})
	}
}
