//go:build gpu && linux && cgo

package gds

// The batch measurement: per-call against batch I/O for paged keys on the
// ext4 disk, with the O_DIRECT ceiling of the same files in the same run.
// Build and run as gpu_test.go says, opting in and selecting it with
//
//	KVHOST_GPU_BATCH=1 ./gds-gpu.test -test.v -test.run GPUBatch
//
// It needs root for the udev record cuFile registration needs on a VM and
// to drop the page cache before loads (without root it still runs, with
// posix_fadvise alone, and says so).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// pagedPlanAt is a key of pages × 64 KiB in file order from a random
// permutation of the pages of dev's window [base, base+pages×64 KiB).
func pagedPlanAt(dev region.Device, base int64, pages int, seed uint64) *transfer.Plan {
	const page = 64 << 10
	perm := rand.New(rand.NewPCG(seed, 5)).Perm(pages)
	p := &transfer.Plan{Direct: true}
	for i := range pages {
		p.Extents = append(p.Extents, transfer.Extent{FileOff: int64(i) * page, Region: dev, RegionOff: base + int64(perm[i])*page, Len: page, Sum: -1})
	}
	return p
}

// dropCache evicts the files from the page cache: posix_fadvise
// DONTNEED on each, sync, and (as root, unless KVHOST_GPU_NO_DROP is set,
// for a dry run on a shared machine) drop_caches. It says what it did.
func dropCache(paths []string) string {
	for _, p := range paths {
		if fd, err := unix.Open(p, unix.O_RDONLY|unix.O_CLOEXEC, 0); err == nil {
			unix.Fadvise(fd, 0, 0, unix.FADV_DONTNEED)
			unix.Close(fd)
		}
	}
	unix.Sync()
	if os.Getenv("KVHOST_GPU_NO_DROP") != "" {
		return "fadvise only (KVHOST_GPU_NO_DROP)"
	}
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3\n"), 0); err != nil {
		return "fadvise only (" + err.Error() + ")"
	}
	return "fadvise + drop_caches"
}

func median(v []float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	if len(s) == 0 {
		return 0
	}
	return s[len(s)/2]
}

func TestGPUBatchVersusPerCall(t *testing.T) {
	if os.Getenv("KVHOST_GPU_BATCH") != "1" {
		// Opt-in: batches hung cuFileBatchIOSubmit in compat mode once,
		// and a hung cuFile call ends the whole test binary (watchdog).
		t.Skip("batch measurement skipped: set KVHOST_GPU_BATCH=1 to run it (it may hang in compat mode; see docs/gds.md)")
	}
	cu, d, dir, logs := openDiskDriver(t, "BATCHBENCH", "kvhost-batch-")
	props := d.Properties()
	fmt.Printf("BATCHBENCH properties: version %d, mode %v, batch API %v, max_batch_io_size %d, batch timeout %d ms, feature flags %#x (batch bit %v), nvidia-fs %v, device cache %d KiB, per-buffer cache %d KiB, batch entries in flight at most %d\n",
		props.Version, props.Mode(), props.BatchAPI, props.MaxBatchIO, props.BatchTimeoutMsecs, props.FeatureFlags,
		props.FeatureFlags&featureBatchIO != 0, props.NVFSLoaded, props.MaxDeviceCache>>10, props.PerBufferCache>>10, d.inflight.size)
	if !props.BatchAPI {
		t.Fatalf("libcufile %s has no batch API: nothing to measure", props.Library)
	}

	// One probe batch through the library, to report its answer as is.
	probeBatch(t, d, cu, dir)

	// per-call and batch (the driver's batch size) are the comparison;
	// batch-32 shows whether smaller batches over more workers help.
	modes := []string{"per-call", "batch", "batch-32"}
	movers := map[string]*Mover{}
	for _, name := range modes {
		cfg := MoverConfig{Workers: 16, AllowCompat: true, IO: IOBatch, BatchTimeout: 10 * time.Second}
		switch name {
		case "per-call":
			cfg.IO = IOPerCall
		case "batch-32":
			cfg.BatchSize = 32
		}
		m, err := d.NewMover(cfg)
		if err != nil {
			t.Fatal(err)
		}
		movers[name] = m
	}

	const srcSize = 64 << 20
	const jobs = 8
	type keyCase struct {
		name  string
		pages int // 64 KiB pages per key
		keys  int
	}
	cases := []keyCase{{"32MiB", 512, 16}, {"2MiB", 32, 128}}
	maxDst := int64(0)
	for _, kc := range cases {
		maxDst = max(maxDst, int64(kc.pages*kc.keys)<<16)
	}
	src, dst, host := deviceSrcDst(t, cu, srcSize, maxDst, 43)
	back := make([]byte, maxDst)
	ctx := context.Background()

	// fanOut runs jobs goroutines over keys 0..n-1 and returns GB/s of
	// bytes in total.
	var failed sync.Map // mode → its first error: a failing mode is not run again
	fanOut := func(n int, bytes int64, job func(i int) error) float64 {
		d, err := overKeys(n, jobs, job)
		if err != nil {
			t.Error(err)
		}
		return float64(bytes) / d.Seconds() / 1e9
	}
	open := openDirect

	type series struct{ store, load []float64 }
	for _, kc := range cases {
		keyBytes := int64(kc.pages) << 16
		total := keyBytes * int64(kc.keys)
		paths := make([]string, kc.keys)
		for i := range paths {
			paths[i] = filepath.Join(dir, fmt.Sprintf("%s-%d", kc.name, i))
		}
		res := map[string]*series{"O_DIRECT ceiling": {}}
		for _, mode := range modes {
			res[mode] = &series{}
		}
		bufs := make(chan []byte, jobs)
		for range jobs {
			b, err := unix.Mmap(-1, 0, int(keyBytes), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Munmap(b)
			bufs <- b
		}
		const rounds = 3
		for round := 1; round <= rounds; round++ {
			// The ceiling first (a hang in cuFile below must not cost it):
			// O_DIRECT pwrite into fresh files, then pread of the same
			// files after dropping the cache, from host memory in 8 MiB
			// calls with the same jobs.
			direct := func(write bool) float64 {
				return fanOut(kc.keys, total, func(i int) error {
					buf := <-bufs
					defer func() { bufs <- buf }()
					fl := unix.O_RDONLY
					if write {
						fl = unix.O_WRONLY | unix.O_CREAT | unix.O_TRUNC
					}
					fd, err := unix.Open(paths[i], fl|unix.O_DIRECT|unix.O_CLOEXEC, 0o600)
					if err != nil {
						return err
					}
					defer unix.Close(fd)
					for off := 0; off < len(buf); off += 8 << 20 {
						chunk := buf[off:min(off+8<<20, len(buf))]
						var n int
						if write {
							n, err = unix.Pwrite(fd, chunk, int64(off))
						} else {
							n, err = unix.Pread(fd, chunk, int64(off))
						}
						if err != nil || n != len(chunk) {
							return fmt.Errorf("O_DIRECT I/O of %s at %d: %d, %v", paths[i], off, n, err)
						}
					}
					return nil
				})
			}
			for _, p := range paths {
				os.Remove(p)
			}
			cw := direct(true)
			dropCache(paths)
			cr := direct(false)
			res["O_DIRECT ceiling"].store = append(res["O_DIRECT ceiling"].store, cw)
			res["O_DIRECT ceiling"].load = append(res["O_DIRECT ceiling"].load, cr)
			fmt.Printf("BATCHBENCH %-5s j%d round %d %-8s write %6.2f GB/s  read %6.2f GB/s  (host memory, O_DIRECT, 8 MiB calls)\n",
				kc.name, jobs, round, "ceiling", cw, cr)
			for _, mode := range modes {
				if _, bad := failed.Load(mode); bad {
					continue
				}
				m := movers[mode]
				fail := func(err error) error {
					failed.LoadOrStore(mode, err)
					return err
				}
				for _, p := range paths {
					os.Remove(p)
				}
				dog := watchdog("BATCHBENCH", fmt.Sprintf("%s %s round %d store", kc.name, mode, round))
				st := fanOut(kc.keys, total, func(i int) error {
					f, err := open(paths[i], true)
					if err != nil {
						return err
					}
					defer f.Close()
					if _, err = m.WriteFile(ctx, f, pagedPlan(src, kc.pages, uint64(i)), nil); err != nil {
						return fail(fmt.Errorf("%s store of key %d: %w", mode, i, err))
					}
					return nil
				})
				dog.Stop()
				how := dropCache(paths)
				if err := cu.memsetDev(dst.ptr, 0xA5, maxDst); err != nil {
					t.Fatal(err)
				}
				dog = watchdog("BATCHBENCH", fmt.Sprintf("%s %s round %d load", kc.name, mode, round))
				ld := fanOut(kc.keys, total, func(i int) error {
					f, err := open(paths[i], false)
					if err != nil {
						return err
					}
					defer f.Close()
					if _, err = m.ReadFile(ctx, f, pagedPlanAt(dst, int64(i)*keyBytes, kc.pages, uint64(i)), nil); err != nil {
						return fail(fmt.Errorf("%s load of key %d: %w", mode, i, err))
					}
					return nil
				})
				dog.Stop()
				if v, bad := failed.Load(mode); bad {
					fmt.Printf("BATCHBENCH %-5s j%d round %d %-8s FAILED: %v\n", kc.name, jobs, round, mode, v)
					continue
				}
				if err := checkPaged(cu, back, host, src, dst, kc.keys, kc.pages); err != nil {
					t.Fatalf("%s %s round %d: %v", kc.name, mode, round, err)
				}
				res[mode].store = append(res[mode].store, st)
				res[mode].load = append(res[mode].load, ld)
				fmt.Printf("BATCHBENCH %-5s j%d round %d %-8s store %6.2f GB/s  load %6.2f GB/s  (%d keys, cache: %s, bytes checked)\n",
					kc.name, jobs, round, mode, st, ld, kc.keys, how)
			}
		}
		ceil := res["O_DIRECT ceiling"]
		cw, cr := median(ceil.store), median(ceil.load)
		for _, mode := range modes {
			s := res[mode]
			if len(s.store) == 0 {
				continue
			}
			fmt.Printf("BATCHBENCH SUMMARY %-5s j%d %-8s store %6.2f GB/s (%.2f of ceiling %.2f)  load %6.2f GB/s (%.2f of ceiling %.2f)  median of %d rounds\n",
				kc.name, jobs, mode, median(s.store), median(s.store)/cw, cw, median(s.load), median(s.load)/cr, cr, rounds)
		}
	}
	for _, m := range movers {
		m.Close()
	}
	st := d.batchStats()
	fmt.Printf("BATCHBENCH batch stats: %+v\n", st)
	capab, _ := d.capability(dir)
	fmt.Printf("BATCHBENCH disk after: %v\n", capab)
	if capab.batch == batchStateRefused {
		fmt.Printf("BATCHBENCH NOTE: the library refused batches on this mount (%v); the batch rows ran per call\n", capab.batchErr)
	}
	if n := strings.Count(logs.String(), "batch I/O refused"); n > 1 {
		t.Errorf("batch refusal logged %d times, want at most once", n)
	}
}

// overKeys runs job over keys 0..n-1 on jobs goroutines, each locked to
// its thread, and returns the time it took and every job's error: a job
// that fails stops its goroutine.
func overKeys(n, jobs int, job func(i int) error) (time.Duration, error) {
	q := make(chan int, n)
	for i := range n {
		q <- i
	}
	close(q)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var errs []error
	start := time.Now()
	for range jobs {
		wg.Go(func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			for i := range q {
				if err := job(i); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
					return
				}
			}
		})
	}
	wg.Wait()
	return time.Since(start), errors.Join(errs...)
}

// openDirect opens a key file with O_DIRECT for reading and writing,
// created afresh when create is set.
// deviceSrcDst allocates a source of srcSize device bytes, filled with
// random bytes (seed) that it also returns as host, and a destination of
// dstSize; both are freed when t ends.
func deviceSrcDst(t *testing.T, cu *testCudart, srcSize, dstSize int64, seed uint64) (src, dst *devMem, host []byte) {
	t.Helper()
	srcPtr, err := cu.mallocDev(srcSize)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cu.freeDev(srcPtr) })
	dstPtr, err := cu.mallocDev(dstSize)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cu.freeDev(dstPtr) })
	host = make([]byte, srcSize)
	randomBytes(host, 42, seed)
	if err := cu.toDevice(srcPtr, host); err != nil {
		t.Fatal(err)
	}
	return &devMem{id: 1, ptr: srcPtr, size: srcSize}, &devMem{id: 2, ptr: dstPtr, size: dstSize}, host
}

func openDirect(path string, create bool) (fsys.File, error) {
	fl := os.O_RDWR | unix.O_DIRECT
	if create {
		fl |= os.O_CREATE | os.O_TRUNC
	}
	return fsys.OS{}.OpenFile(path, fl, 0o600)
}

// openDiskDriver opens the CUDA runtime and the cuFile driver on device 0
// (skipping the test where there is none) and a fresh directory under
// KVHOST_GPU_DIR (default /var/tmp), which cuFile must be able to register
// files in; it prints the directory's capability after prefix. logs holds
// the driver's log, which also goes to standard output.
func openDiskDriver(t *testing.T, prefix, pattern string) (cu *testCudart, d *Driver, dir string, logs *logBuffer) {
	t.Helper()
	cu, err := openTestCudart()
	if err != nil {
		t.Skipf("GPU check skipped: no CUDA runtime here (%v); run it on a GPU machine", err)
	}
	if err := cu.setDevice(0); err != nil {
		t.Skipf("GPU check skipped: no usable GPU (%v)", err)
	}
	logs = &logBuffer{}
	logger := slog.New(slog.NewTextHandler(io.MultiWriter(os.Stdout, logs), nil))
	d, err = Open(Config{BindDevice: cu.setDevice, Logger: logger})
	if err != nil {
		t.Fatalf("gds.Open on a GPU machine: %v", err)
	}
	t.Cleanup(func() { d.Close() })
	dir, err = os.MkdirTemp(envOr("KVHOST_GPU_DIR", "/var/tmp"), pattern)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	c, err := d.ProbeDir(dir)
	fmt.Printf("%s disk %s: %v (err %v)\n", prefix, dir, c, err)
	if err != nil || c.Mode == ModeUnusable {
		t.Fatalf("disk capability = %v, %v; cuFile registration must work there (udev record written?)", c, err)
	}
	return cu, d, dir, logs
}

// checkPaged copies dst back and compares every page of keys keys of
// pages pages each, loaded by pagedPlanAt, with the page of src they were
// stored from by pagedPlan (src's bytes are host).
func checkPaged(cu *testCudart, back, host []byte, src, dst *devMem, keys, pages int) error {
	if err := cu.toHost(back, dst.ptr); err != nil {
		return err
	}
	keyBytes := int64(pages) << 16
	for i := range keys {
		wp, rp := pagedPlan(src, pages, uint64(i)), pagedPlanAt(dst, int64(i)*keyBytes, pages, uint64(i))
		for j := range wp.Extents {
			w, rd := wp.Extents[j], rp.Extents[j]
			if string(back[rd.RegionOff:rd.RegionOff+rd.Len]) != string(host[w.RegionOff:w.RegionOff+w.Len]) {
				return fmt.Errorf("key %d page %d differs after the round trip", i, j)
			}
		}
	}
	return nil
}

// watchdog ends the process if a phase is still running after 40 s: a
// cuFile call that hangs cannot be interrupted, and the results printed
// so far must come back. It prints where the workers are, after prefix.
func watchdog(prefix, phase string) *time.Timer {
	return time.AfterFunc(40*time.Second, func() {
		buf := make([]byte, 8<<20)
		buf = buf[:runtime.Stack(buf, true)]
		calls := map[string]int{}
		for _, line := range strings.Split(string(buf), "\n") {
			if strings.HasPrefix(line, "github.com/kvhost/kvhost/gds._Cfunc_") {
				calls[line[len("github.com/kvhost/kvhost/gds._Cfunc_"):strings.Index(line, "(")]]++
			}
		}
		fmt.Printf("%s HANG: %s still running after 40 s; goroutines inside cuFile calls: %v\n", prefix, phase, calls)
		os.Exit(3)
	})
}

// probeBatch submits one 64 KiB write and one read through the raw batch
// API on a bound thread and prints what the library answered.
func probeBatch(t *testing.T, d *Driver, cu *testCudart, dir string) {
	p, err := cu.mallocDev(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer cu.freeDev(p)
	path := filepath.Join(dir, "probe")
	f, err := fsys.OS{}.OpenFile(path, os.O_RDWR|os.O_CREATE|unix.O_DIRECT, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	key, err := d.cache.identify(int(f.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	err = d.onDevice(0, func() error {
		h, err := d.cache.acquire(int(f.Fd()), key)
		if err != nil {
			return fmt.Errorf("register: %w", err)
		}
		defer d.cache.release(h)
		start := time.Now()
		b, err := d.api.batchSetUp(128)
		if err != nil {
			fmt.Printf("BATCHBENCH probe: cuFileBatchIOSetUp(128): %v\n", err)
			return nil
		}
		defer b.destroy()
		fmt.Printf("BATCHBENCH probe: cuFileBatchIOSetUp(128) ok in %v\n", time.Since(start))
		for _, write := range []bool{true, false} {
			start = time.Now()
			err := b.submit([]batchIO{{h: h.h, base: p, n: 64 << 10, write: write, cookie: 7}})
			if err != nil {
				fmt.Printf("BATCHBENCH probe: cuFileBatchIOSubmit (write %v): %v\n", write, err)
				return nil
			}
			ev := make([]batchEvent, 1)
			n, err := b.status(1, ev, 5*time.Second)
			fmt.Printf("BATCHBENCH probe: write %v: submit+status %v: %d events %+v, err %v\n", write, time.Since(start), n, ev[:n], err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
