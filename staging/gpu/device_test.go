package gpu

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/cuda/cudatest"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// The GPU check and benchmark. It needs a real GPU: run the test binary
// with KVHOST_GPU=1 (KVHOST_GPU_TMPFS and KVHOST_GPU_DISK name the
// directories, KVHOST_GPU_OUT a file for the report). Every figure is
// printed next to its ceiling, measured in the same run.

type report struct {
	t  *testing.T
	sb strings.Builder
}

func (r *report) printf(format string, args ...any) {
	s := fmt.Sprintf(format, args...)
	r.t.Log(s)
	r.sb.WriteString(s + "\n")
}

// newReport starts a test's report; when the test ends it is also
// written to the file KVHOST_GPU_OUT names, plus suffix, if set.
func newReport(t *testing.T, suffix string) *report {
	rep := &report{t: t}
	t.Cleanup(func() {
		if out := os.Getenv("KVHOST_GPU_OUT"); out != "" {
			os.WriteFile(out+suffix, []byte(rep.sb.String()), 0o644)
		}
	})
	return rep
}

// envCUDA is the CUDA configuration of the GPU benchmarks: the system's
// libraries, or those KVHOST_GPU_CUDART names (a smoke test on the fake
// library).
func envCUDA() cuda.Config {
	if p := os.Getenv("KVHOST_GPU_CUDART"); p != "" {
		return cuda.Config{Runtime: []string{p}, Driver: []string{p}}
	}
	return cuda.Config{}
}

// benchCUDA is envCUDA, or with KVHOST_GPU_FAKE=1 the fake CUDA library
// built for the test (a smoke test of a GPU benchmark on any machine).
func benchCUDA(t *testing.T) cuda.Config {
	t.Helper()
	if os.Getenv("KVHOST_GPU_FAKE") == "1" {
		p := cudatest.Build(t)
		return cuda.Config{Runtime: []string{p}, Driver: []string{p}}
	}
	return envCUDA()
}

func gbps(bytes int64, d time.Duration) float64 { return float64(bytes) / d.Seconds() / 1e9 }

func TestGPUCheckAndBenchmark(t *testing.T) {
	needGPU(t)
	rep := newReport(t, "")
	small := os.Getenv("KVHOST_GPU_SMALL") == "1"
	r, err := cuda.Open(envCUDA())
	if err != nil {
		t.Fatalf("cuda.Open: %v", err)
	}
	defer r.Close()
	n, err := r.DeviceCount()
	if err != nil || n == 0 {
		t.Fatalf("DeviceCount = %d, %v", n, err)
	}
	bus, _ := r.PCIBusID(0)
	rep.printf("runtime %s version %d, batch %v, driver API %v, %d device(s), device 0 at %s", r.Path(), r.Version(), r.HasBatch(), r.HasDriver(), n, bus)
	w, err := r.NewWorker(0)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	ctx := context.Background()

	// Ceilings: pinned copies of 256 MiB.
	const big = 256 << 20
	err = w.Do(ctx, func(w *cuda.Worker) error {
		h2d, d2h, err := w.PinnedCopyTimes(big, 5)
		if err != nil {
			return err
		}
		rep.printf("ceiling: pinned H2D 256 MiB, one copy: %.1f GB/s", gbps(big, h2d))
		rep.printf("ceiling: pinned D2H 256 MiB, one copy: %.1f GB/s", gbps(big, d2h))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	g := llama8B()
	if small {
		g.numBlocks = 32
	}
	kv := newCache(t, w, g)
	orig := kv.randomize(t, w, 1)
	host := map[region.Region][]byte{}
	for l, b := range orig {
		host[kv.layers[l]] = b
	}

	// Scatter/gather: 512 pages of 64 KiB to/from one pinned 32 MiB
	// buffer, batched vs one copy per segment, one stream.
	modes := []cuda.CopyMode{cuda.CopySegments}
	if r.HasBatch() {
		modes = append(modes, cuda.CopyBatch)
	}
	if r.HasKernel() {
		modes = append(modes, cuda.CopyKernel)
	}
	err = w.Do(ctx, func(w *cuda.Worker) error {
		h, err := r.HostAlloc(32 << 20)
		if err != nil {
			return err
		}
		defer h.Free()
		table, err := r.HostAlloc(512 * cuda.KernelEntryBytes)
		if err != nil {
			return err
		}
		defer table.Free()
		var kernel *cuda.Kernel
		if r.HasKernel() {
			if kernel, err = r.LoadCopyKernel(); err != nil {
				return err
			}
			defer kernel.Unload()
		}
		blocks := keyBlocks(rand.New(rand.NewPCG(5, 5)), g.numBlocks, g.blocksPerKey)
		p := kv.plan(blocks, false)
		for _, mode := range modes {
			for _, h2d := range []bool{false, true} {
				var cp cuda.Copies
				var off uintptr
				for _, x := range p.Extents {
					dev := x.Region.(region.Device).Ptr() + uintptr(x.RegionOff)
					if h2d {
						cp.Add(dev, h.Ptr()+off, uintptr(x.Len))
					} else {
						cp.Add(h.Ptr()+off, dev, uintptr(x.Len))
					}
					off += uintptr(x.Len)
				}
				best := time.Duration(1 << 62)
				for range 10 {
					start := time.Now()
					if mode == cuda.CopyKernel {
						if err := kernel.Launch(&cp, table.Bytes(), w.Stream()); err != nil {
							return errorsJoin(err, r.Sync(w.Stream()))
						}
					} else if err := r.Enqueue(&cp, h2d, mode, w.Stream()); err != nil {
						return fmt.Errorf("%v: %w", mode, errorsJoin(err, r.Sync(w.Stream())))
					}
					if err := r.Sync(w.Stream()); err != nil {
						return err
					}
					best = min(best, time.Since(start))
				}
				dir := "gather D2H"
				if h2d {
					dir = "scatter H2D"
				}
				rep.printf("copy %s 512×64 KiB (32 MiB), %v: %.1f GB/s (%.0f µs)", dir, mode, gbps(32<<20, best), float64(best.Microseconds()))
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	dirs := []struct{ name, dir string }{
		{"tmpfs", envOr("KVHOST_GPU_TMPFS", "/dev/shm/kvhost-gpu-bench")},
		{"ext4", envOr("KVHOST_GPU_DISK", "/var/tmp/kvhost-gpu-bench")},
	}
	for _, d := range dirs {
		os.RemoveAll(d.dir)
		if err := os.MkdirAll(d.dir, 0o755); err != nil {
			t.Fatal(err)
		}
		defer os.RemoveAll(d.dir)
	}
	type scenario struct {
		fs        string
		dir       string
		direct    bool
		keyBlocks int
		files     int
	}
	var scenarios []scenario
	for _, d := range dirs {
		direct := d.name != "tmpfs"
		files32, files2 := 128, 1024
		if direct {
			files32, files2 = 32, 256
		}
		if small {
			files32, files2 = 4, 16
		}
		scenarios = append(scenarios, scenario{d.name, d.dir, direct, 16, files32}, scenario{d.name, d.dir, direct, 1, files2})
	}
	for _, sc := range scenarios {
		for l := range g.layers { // undo the poison of the last scenario
			kv.set(t, w, l, orig[l])
		}
		gk := g
		gk.blocksPerKey = sc.keyBlocks
		keyBytes := int64(gk.layers * gk.blocksPerKey * gk.pageBytes)
		plans, paths := keyFiles(kv, gk, sc.dir, sc.files, 9, sc.direct)
		total := keyBytes * int64(sc.files)
		label := fmt.Sprintf("%s %d MiB keys × %d", sc.fs, keyBytes>>20, sc.files)
		for _, jobs := range []int{1, 8, 16} {
			// Host ceilings: the same files, the same number of threads,
			// one pwrite/pread per file into pinned memory. The first
			// write pass creates the files (tmpfs faults its pages in).
			if jobs == 1 {
				if _, err := hostPass(r, paths, keyBytes, gk, 16, true, sc.direct); err != nil {
					t.Fatal(err)
				}
			}
			cw, err := hostPass(r, paths, keyBytes, gk, jobs, true, sc.direct)
			if err != nil {
				t.Fatal(err)
			}
			for _, nosums := range []bool{false, true} {
				if nosums && jobs != 16 {
					continue
				}
				for _, mode := range modes {
					if mode != modes[len(modes)-1] && jobs != 16 {
						continue // fewer jobs: the default mode only
					}
					m, err := New(Config{Runtime: r, Devices: []int{0}, MaxStaging: int64(jobs) * 2 * (8<<20 + 2*align), Copy: mode, NoChecksums: nosums})
					if err != nil {
						t.Fatal(err)
					}
					ws, err := moverPass(m, paths, plans, jobs, true, sc.direct)
					if err != nil {
						m.Close()
						t.Fatalf("%s store: %v", label, err)
					}
					dropCaches()
					cr, err := hostPass(r, paths, keyBytes, gk, jobs, false, sc.direct)
					if err != nil {
						m.Close()
						t.Fatal(err)
					}
					kv.poison(t, w)
					dropCaches()
					ls, err := moverPass(m, paths, plans, jobs, false, sc.direct)
					m.Close()
					if err != nil {
						t.Fatalf("%s load: %v", label, err)
					}
					// Check every loaded page byte for byte.
					for l := range g.layers {
						dev := kv.get(t, w, l)
						for _, p := range plans {
							for _, x := range p.Extents {
								if x.Region != kv.layers[l] {
									continue
								}
								if !bytes.Equal(dev[x.RegionOff:x.RegionOff+x.Len], orig[l][x.RegionOff:x.RegionOff+x.Len]) {
									t.Fatalf("%s jobs %d: layer %d page at %d differs after the round trip", label, jobs, l, x.RegionOff)
								}
							}
						}
					}
					sums := "checksums on"
					if nosums {
						sums = "checksums off"
					}
					wsg, lsg, cwg, crg := gbps(total, ws), gbps(total, ls), gbps(total, cw), gbps(total, cr)
					rep.printf("%s, %2d jobs, %v, %s: store %.2f GB/s (host write ceiling %.2f: %.2f), load %.2f GB/s (host read ceiling %.2f: %.2f); verified",
						label, jobs, mode, sums, wsg, cwg, wsg/cwg, lsg, crg, lsg/crg)
				}
				if !sc.direct {
					registeredPass(t, rep, r, kv, w, orig, paths, plans, keyBytes, gk, jobs, nosums, label, cw)
				}
			}
		}
		for _, p := range paths {
			os.Remove(p)
		}
	}
}

// registeredPass measures the mover with every file of a memory file
// system registered (Config.RegisterFiles): an untimed store offers the
// files to the registrar and waits until all are registered, then a
// timed store and a timed load copy straight between the paged layout
// and the files' pages. The read ceiling is timed between them, as for
// the staged rows; cw is the write ceiling of the same files. Every
// loaded page is checked.
func registeredPass(t *testing.T, rep *report, r *cuda.Runtime, kv *cache, w *cuda.Worker, orig [][]byte, paths []string, plans []*transfer.Plan,
	keyBytes int64, g geometry, jobs int, nosums bool, label string, cw time.Duration) {
	t.Helper()
	memory := make([]*transfer.Plan, len(plans))
	for i, p := range plans {
		q := *p
		q.Memory = true
		memory[i] = &q
	}
	m, err := New(Config{Runtime: r, Devices: []int{0}, MaxStaging: int64(jobs) * 2 * (8<<20 + 2*align), NoChecksums: nosums, RegisterFiles: len(paths)})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	registerAll(t, m, paths, memory, jobs, label)
	before := m.FileStats()
	ws, err := moverPass(m, paths, memory, jobs, true, false)
	if err != nil {
		t.Fatalf("%s: store into registered files: %v", label, err)
	}
	cr, err := hostPass(r, paths, keyBytes, g, jobs, false, false)
	if err != nil {
		t.Fatal(err)
	}
	kv.poison(t, w)
	ls, err := moverPass(m, paths, memory, jobs, false, false)
	if err != nil {
		t.Fatalf("%s: load from registered files: %v", label, err)
	}
	checkLoaded(t, kv, w, memory, orig, label+": after a round trip through registered files")
	st := m.FileStats()
	if want := uint64(len(paths)); st.Stores-before.Stores != want || st.Loads-before.Loads != want {
		t.Fatalf("%s: %d stores and %d loads moved registered files directly, want %d each", label, st.Stores-before.Stores, st.Loads-before.Loads, want)
	}
	sums := "checksums on"
	if nosums {
		sums = "checksums off"
	}
	total := keyBytes * int64(len(paths))
	wsg, lsg, cwg, crg := gbps(total, ws), gbps(total, ls), gbps(total, cw), gbps(total, cr)
	rep.printf("%s, %2d jobs, registered files, %s: store %.2f GB/s (host write ceiling %.2f: %.2f), load %.2f GB/s (host read ceiling %.2f: %.2f); verified",
		label, jobs, sums, wsg, cwg, wsg/cwg, lsg, crg, lsg/crg)
}

// keyFiles returns n plans of keys of geometry gk at random blocks of
// kv (seeded by n and seed) and the paths of their files in dir.
func keyFiles(kv *cache, gk geometry, dir string, n int, seed uint64, direct bool) ([]*transfer.Plan, []string) {
	rnd := rand.New(rand.NewPCG(uint64(n), seed))
	plans := make([]*transfer.Plan, n)
	paths := make([]string, n)
	for i := range plans {
		plans[i] = kv.planG(gk, keyBlocks(rnd, gk.numBlocks, gk.blocksPerKey), direct)
		paths[i] = filepath.Join(dir, fmt.Sprintf("k%05d-%d", i, gk.blocksPerKey))
	}
	return plans, paths
}

// registerAll stores every file through m (plans on a memory file system)
// until m has registered them all: each store offers its file, and the
// offers the registrar's queue has no room for are dropped until the
// file's next job.
func registerAll(t *testing.T, m *Mover, paths []string, plans []*transfer.Plan, jobs int, label string) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Minute)
	for m.FileStats().Files < len(paths) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: %d of %d files registered after 3 minutes of stores: %+v", label, m.FileStats().Files, len(paths), m.FileStats())
		}
		if _, err := moverPass(m, paths, plans, jobs, true, false); err != nil {
			t.Fatalf("%s: store before registration: %v", label, err)
		}
		testwait.Until(t, "the registrar's queue handled", time.Minute, func() bool {
			m.files.mu.Lock()
			defer m.files.mu.Unlock()
			return len(m.files.queued) == 0
		})
	}
}

func errorsJoin(a, b error) error {
	if a == nil {
		return b
	}
	if b == nil {
		return a
	}
	return fmt.Errorf("%w; %w", a, b)
}

// needGPU skips t unless KVHOST_GPU=1 (a machine with a CUDA GPU, or
// KVHOST_GPU_CUDART naming another runtime, such as the fake one).
func needGPU(t *testing.T) {
	t.Helper()
	if os.Getenv("KVHOST_GPU") != "1" {
		t.Skip("set KVHOST_GPU=1 on a machine with a CUDA GPU to run it")
	}
}

// benchDir is an empty directory for a GPU test's files, name under
// KVHOST_GPU_TMPFS (default /dev/shm/kvhost-gpu-bench), removed with what
// it holds when the test ends.
func benchDir(t *testing.T, name string) string {
	t.Helper()
	dir := filepath.Join(envOr("KVHOST_GPU_TMPFS", "/dev/shm/kvhost-gpu-bench"), name)
	os.RemoveAll(dir)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

func dropCaches() { os.WriteFile("/proc/sys/vm/drop_caches", []byte("3\n"), 0o200) }

func openFlags(write, direct bool) int {
	fl := os.O_RDONLY
	if write {
		fl = os.O_RDWR | os.O_CREATE
	}
	if direct {
		fl |= unix.O_DIRECT
	}
	return fl
}

// hostPass writes (or reads) every file whole with plain pwrite (pread)
// from (into) a pinned buffer per thread; writes to a direct (disk) file
// are synced, as stores are.
func hostPass(r *cuda.Runtime, paths []string, keyBytes int64, g geometry, jobs int, write, direct bool) (time.Duration, error) {
	size := int(keyBytes) + g.headerBytes
	bufs := make([]*cuda.Pinned, jobs)
	for i := range bufs {
		b, err := r.HostAlloc(size)
		if err != nil {
			return 0, err
		}
		defer b.Free()
		bufs[i] = b
	}
	return parallel(len(paths), jobs, func(j, i int) error {
		f, err := fsys.OS{}.OpenFile(paths[i], openFlags(write, direct), 0o644)
		if err != nil {
			return err
		}
		defer f.Close()
		b := bufs[j].Bytes()
		if write {
			if err := writeFull(f, b, 0); err != nil {
				return err
			}
			if direct {
				return f.Sync()
			}
			return nil
		}
		return readAtLeast(f, b, size, 0)
	})
}

// moverPass stores (loads) every file through the mover with jobs
// concurrent calls.
func moverPass(m *Mover, paths []string, plans []*transfer.Plan, jobs int, write, direct bool) (time.Duration, error) {
	return parallel(len(paths), jobs, func(_, i int) error {
		f, err := fsys.OS{}.OpenFile(paths[i], openFlags(write, direct), 0o644)
		if err != nil {
			return err
		}
		defer f.Close()
		p := plans[i]
		sums := make([]uint32, p.Sums)
		if write {
			if _, err := m.WriteFile(context.Background(), f, p, sums); err != nil {
				return err
			}
			if direct {
				return f.Sync()
			}
			return nil
		}
		_, err = m.ReadFile(context.Background(), f, p, sums)
		return err
	})
}

// parallel runs fn(job, item) over n items on jobs goroutines and times it.
func parallel(n, jobs int, fn func(j, i int) error) (time.Duration, error) {
	var mu sync.Mutex
	next := 0
	var first error
	var wg sync.WaitGroup
	start := time.Now()
	for j := range jobs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				mu.Lock()
				i := next
				next++
				stop := first != nil
				mu.Unlock()
				if i >= n || stop {
					return
				}
				if err := fn(j, i); err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	return time.Since(start), first
}
