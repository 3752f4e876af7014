package gpu

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/cuda"
	"github.com/kvhost/kvhost/internal/fsys"
	"github.com/kvhost/kvhost/transfer"
)

// TestGPUWritePieces measures how the size of a store's write pieces, and
// checksumming each piece before or after its write, move store
// throughput on fresh, fallocated files, as the engine writes them: 128 × 32 MiB keys, 16
// jobs, on each directory of KVHOST_GPU_PIECEDIRS (a comma list; a tmpfs
// with and without huge pages are the interesting ones), next to the plain
// pwrite ceiling of fresh files in the same round and to stores without
// checksums (whole chunks). KVHOST_GPU=1 runs it.
func TestGPUWritePieces(t *testing.T) {
	if os.Getenv("KVHOST_GPU") != "1" || os.Getenv("KVHOST_GPU_PIECEDIRS") == "" {
		t.Skip("set KVHOST_GPU=1 and KVHOST_GPU_PIECEDIRS on a machine with a CUDA GPU to run it")
	}
	rep := &report{t: t}
	r, w := openGPU(t, cuda.Config{})
	g := llama8B()
	kv := newCache(t, w, g)
	kv.randomize(t, w, 1)
	const files, jobs = 128, 16
	keyBytes := int64(g.layers * g.blocksPerKey * g.pageBytes)
	total := keyBytes * files
	rnd := rand.New(rand.NewPCG(9, 9))
	plans := make([]*transfer.Plan, files)
	for i := range plans {
		plans[i] = kv.plan(keyBlocks(rnd, g.numBlocks, g.blocksPerKey), false)
		plans[i].Memory = true
	}
	m, err := New(Config{Runtime: r, Devices: []int{0}})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	mo, err := New(Config{Runtime: r, Devices: []int{0}, NoChecksums: true})
	if err != nil {
		t.Fatal(err)
	}
	defer mo.Close()
	for _, dir := range strings.Split(os.Getenv("KVHOST_GPU_PIECEDIRS"), ",") {
		dir = filepath.Join(dir, "kvhost-pieces")
		paths := make([]string, files)
		for i := range paths {
			paths[i] = filepath.Join(dir, fmt.Sprintf("k%d", i))
		}
		fresh := func() {
			os.RemoveAll(dir)
			if err := os.MkdirAll(dir, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		store := func(mv *Mover) time.Duration {
			d, err := parallel(files, jobs, func(_, i int) error {
				f, err := fsys.OS{}.OpenFile(paths[i], os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o644)
				if err != nil {
					return err
				}
				defer f.Close()
				if err := f.Allocate(keyBytes); err != nil {
					return err
				}
				p := plans[i]
				_, err = mv.WriteFile(context.Background(), f, p, make([]uint32, p.Sums))
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
			return d
		}
		fresh()
		store(m) // warm up: fault the memory in
		for round := range 2 {
			for _, v := range []struct {
				piece int
				first bool
			}{{256 << 10, false}, {256 << 10, true}, {1 << 20, true}, {4 << 20, true}, {-1, false}} {
				piece := v.piece
				fresh()
				c, err := hostPass(r, paths, keyBytes, g, jobs, true, false)
				if err != nil {
					t.Fatal(err)
				}
				fresh()
				var d time.Duration
				name := "checksums off"
				if piece > 0 {
					m.writePiece, m.crcFirst = piece, v.first
					d = store(m)
					name = fmt.Sprintf("pieces of %d KiB, checksum after the write", piece>>10)
					if v.first {
						name = fmt.Sprintf("pieces of %d KiB, checksum before the write", piece>>10)
					}
				} else {
					d = store(mo)
				}
				rep.printf("pieces %s round %d, %s: store %.2f GB/s (fresh-file write ceiling %.2f: %.2f)",
					dir, round, name, gbps(total, d), gbps(total, c), gbps(total, d)/gbps(total, c))
			}
		}
		os.RemoveAll(dir)
	}
}
