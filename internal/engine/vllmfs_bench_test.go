//go:build invariants

package engine

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
)

// BenchmarkVLLMFSRows stores (loads) rows of vLLM's tier on a vllm-fs
// mount, against its ceiling measured in the same iterations: the same
// rows written (read) as plain files, one whole-row call per file, by as
// many threads as the engine's I/O workers, with the engine's open flags,
// from (into) the same memory. A row is 2 MiB (Llama-3.1-8B bf16, one
// 16-token block: 32 layers × 64 KiB); 64 rows per iteration, contiguous
// in one memfd as in vLLM's CPU region. The engine's extra work per file
// is the layout's: a temporary name, flock, fallocate, rename, and the
// index.
//
//	KVHOST_BENCH_DIR=/dev/shm go test -run '^$' -bench VLLMFSRows -benchtime 20x ./host/engine
func BenchmarkVLLMFSRows(b *testing.B) {
	const rowBytes, rows = 2 << 20, 64
	for _, op := range []string{"store", "load"} {
		b.Run(op, func(b *testing.B) {
			ctx := context.Background()
			dir := benchDir(b)
			workers := max(2, runtime.GOMAXPROCS(0))
			tier := newFSTier(filepath.Join(dir, "vllm"), rowBytes)
			e, err := testOpen(ctx, Config{
				Mounts:    []Mount{{Path: tier.root, VLLMFS: &VLLMFS{Fields: tier.fields(), Namespace: tierModel}}},
				Policy:    newTestPolicy(1, abi.OrderLayerMajor),
				IOWorkers: workers, Logger: testLogger(b),
			})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { e.Close(ctx) })
			g := rowGeometry(tierModel, rowBytes)
			ns, err := e.Declare(ctx, g)
			if err != nil {
				b.Fatal(err)
			}
			c := newTestCache(b, e, ns, g, 2*rows, layoutPlaneFirst)
			mem := c.reg.Bytes()
			for i := range mem {
				mem[i] = byte(i * 7)
			}
			direct := e.Stats().Mounts[0].Direct
			ceilDir := filepath.Join(dir, "ceiling")
			os.MkdirAll(ceilDir, 0o755)
			src := make([][]int, rows)
			dst := make([][]int, rows)
			for i := range src {
				src[i], dst[i] = []int{i}, []int{rows + i}
			}
			// ceiling writes or reads the rows as plain files, from or
			// into the half of the cache the engine uses.
			ceiling := func(write bool, half int) time.Duration {
				flag := os.O_RDONLY
				if write {
					flag = os.O_WRONLY | os.O_CREATE | os.O_TRUNC
				}
				if direct {
					flag |= unix.O_DIRECT
				}
				next := make(chan int, rows)
				for i := range rows {
					next <- i
				}
				close(next)
				start := time.Now()
				var wg sync.WaitGroup
				for range workers {
					wg.Go(func() {
						for i := range next {
							buf := mem[(half*rows+i)*rowBytes : (half*rows+i+1)*rowBytes]
							f, err := fsys.OS{}.OpenFile(filepath.Join(ceilDir, fmt.Sprintf("r%d.bin", i)), flag, 0o644)
							if err != nil {
								b.Error(err)
								return
							}
							if write {
								_, err = f.WriteAt(buf, 0)
							} else {
								_, err = f.ReadAt(buf, 0)
							}
							if err != nil {
								b.Error(err)
							}
							f.Close()
						}
					})
				}
				wg.Wait()
				return time.Since(start)
			}
			var eng, ceil time.Duration
			half := 0 // the half of the cache the ceiling moves: the engine's source or destination
			if op == "load" {
				half = 1
			}
			keys := tierKeys(1, rows)
			if op == "load" {
				res := wait(b)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys, Blocks: src}))
				if res.Count(OutcomeStored) != rows {
					b.Fatalf("store: %+v", res)
				}
				ceiling(true, 0)
			}
			b.SetBytes(rows * rowBytes)
			for i := 0; b.Loop(); i++ {
				if i%2 == 0 { // alternate who goes first
					ceil += ceiling(op == "store", half)
				}
				start := time.Now()
				var res Result
				if op == "store" {
					keys = tierKeys(uint64(100+i), rows)
					res = wait(b)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys, Blocks: src}))
				} else {
					res = wait(b)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: keys, Blocks: dst}))
				}
				eng += time.Since(start)
				if i%2 == 1 {
					ceil += ceiling(op == "store", half)
				}
				if res.Count(OutcomeStored)+res.Count(OutcomeLoaded) != rows {
					b.Fatalf("%s: %+v", op, res)
				}
				if op == "store" {
					b.StopTimer()
					e.Delete(ctx, ns, keys)
					for k := range rows {
						os.Remove(filepath.Join(ceilDir, fmt.Sprintf("r%d.bin", k)))
					}
					b.StartTimer()
				}
			}
			bytes := float64(b.N) * rows * rowBytes
			eg, cg := bytes/eng.Seconds()/1e9, bytes/ceil.Seconds()/1e9
			b.Logf("O_DIRECT %v, %d workers", direct, workers)
			b.ReportMetric(eg, "engine-GB/s")
			b.ReportMetric(cg, "ceiling-GB/s")
			b.ReportMetric(eg/cg, "engine/ceiling")
			b.ReportMetric(0, "ns/op")
		})
	}
}
