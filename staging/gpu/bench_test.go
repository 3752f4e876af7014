package gpu

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/cuda/cudatest"
	"github.com/kvhost/kvhost/transfer"
)

// BenchmarkTmpfsDirect measures the mover on CPU (the fake CUDA library:
// "device" memory is host memory, copies are memcpy) storing and loading
// 32 MiB keys of the paged layout to and from O_DIRECT files on tmpfs,
// checksums on and off, against the host ceiling of the same run: plain pwrite
// (pread) of the same files, whole, with the same number of threads, into
// pinned buffers. The GPU copy here is a CPU copy too, so the fraction is
// lower than on a GPU machine; what it shows is the mover's own overhead
// on memory file systems (the checksum pass, fused or not).
//
//	go test -run '^$' -bench TmpfsDirect ./staging/gpu
func BenchmarkTmpfsDirect(b *testing.B) {
	path := cudatest.Build(b)
	r, err := cuda.Open(cuda.Config{Runtime: []string{path}, Driver: []string{path}})
	if err != nil {
		b.Fatalf("cuda.Open: %v", err)
	}
	defer r.Close()
	w, err := r.NewWorker(0)
	if err != nil {
		b.Fatal(err)
	}
	defer w.Close()
	dir, err := os.MkdirTemp("/dev/shm", "kvhost-gpu-bench-")
	if err != nil {
		b.Skipf("no /dev/shm: %v", err)
	}
	defer os.RemoveAll(dir)
	if !fsDirectOK(dir) {
		b.Skipf("%s refuses O_DIRECT", dir)
	}
	const files, jobs = 8, 2
	g := geometry{layers: 32, numBlocks: 64, pageBytes: 64 << 10, blocksPerKey: 16, headerBytes: 4096}
	kv := newCache(b, w, g)
	kv.randomize(b, w, 1)
	rnd := rand.New(rand.NewPCG(3, 3))
	plans := make([]*transfer.Plan, files)
	paths := make([]string, files)
	for i := range plans {
		plans[i] = kv.plan(keyBlocks(rnd, g.numBlocks, g.blocksPerKey), true)
		plans[i].Memory = true // tmpfs
		paths[i] = filepath.Join(dir, fmt.Sprintf("k%d", i))
	}
	keyBytes := int64(g.layers * g.blocksPerKey * g.pageBytes)
	if _, err := hostPass(r, paths, keyBytes, g, jobs, true, true); err != nil { // create, fault pages in
		b.Fatal(err)
	}
	for _, sums := range []bool{true, false} {
		m, err := New(Config{Runtime: r, Devices: []int{0}, MaxStaging: 64 << 20, NoChecksums: !sums})
		if err != nil {
			b.Fatal(err)
		}
		defer m.Close()
		for _, write := range []bool{true, false} {
			name := "load"
			if write {
				name = "store"
			}
			if sums {
				name += "/sums=on"
			} else {
				name += "/sums=off"
			}
			benchTmpfsDirect(b, name, r, m, paths, plans, keyBytes, g, jobs, write)
		}
	}
}

// benchTmpfsDirect is one sub-benchmark of BenchmarkTmpfsDirect.
func benchTmpfsDirect(b *testing.B, name string, r *cuda.Runtime, m *Mover, paths []string, plans []*transfer.Plan, keyBytes int64, g geometry, jobs int, write bool) {
	files := len(paths)
	{
		b.Run(name, func(b *testing.B) {
			b.SetBytes(int64(files) * keyBytes)
			var mv, ceil time.Duration
			for i := 0; b.Loop(); i++ {
				pass := func() {
					d, err := moverPass(m, paths, plans, jobs, write, true)
					if err != nil {
						b.Fatal(err)
					}
					mv += d
				}
				if i%2 == 1 { // alternate who goes first
					pass()
				}
				d, err := hostPass(r, paths, keyBytes, g, jobs, write, true)
				if err != nil {
					b.Fatal(err)
				}
				ceil += d
				if i%2 == 0 {
					pass()
				}
			}
			bytes := float64(b.N) * float64(files) * float64(keyBytes)
			b.ReportMetric(bytes/mv.Seconds()/1e9, "mover-GB/s")
			b.ReportMetric(bytes/ceil.Seconds()/1e9, "ceiling-GB/s")
			b.ReportMetric(ceil.Seconds()/mv.Seconds(), "mover/ceiling")
			b.ReportMetric(0, "ns/op")
		})
	}
}

// fsDirectOK reports whether dir's file system accepts O_DIRECT files.
func fsDirectOK(dir string) bool {
	f, err := os.OpenFile(filepath.Join(dir, "probe"), os.O_RDWR|os.O_CREATE|unix.O_DIRECT, 0o644)
	if err != nil {
		return false
	}
	f.Close()
	return true
}
