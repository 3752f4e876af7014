//go:build gpu && linux && cgo

package gds

// The stream measurement: cuFile's stream API (cuFileWriteAsync and
// cuFileReadAsync enqueued on a CUDA stream, then one synchronize per key)
// against the mover's per-call I/O, for paged keys on the ext4 disk. Build
// and run as gpu_test.go says, opting in and selecting it with
//
//	KVHOST_GPU_STREAM=1 ./gds-gpu.test -test.v -test.run GPUStream
//
// It needs root for the udev record cuFile registration needs on a VM and
// to drop the page cache before loads.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/bench"
	"github.com/kvhost/kvhost/transfer"
)

func TestGPUStreamVersusPerCall(t *testing.T) {
	if os.Getenv("KVHOST_GPU_STREAM") != "1" {
		// Opt-in like the batch measurement: a hung cuFile call ends
		// the whole test binary (watchdog).
		t.Skip("stream measurement skipped: set KVHOST_GPU_STREAM=1 to run it")
	}
	cu, d, dir, _ := openDiskDriver(t, "STREAMBENCH", "kvhost-stream-")
	props := d.Properties()
	fmt.Printf("STREAMBENCH properties: version %d, mode %v, stream API %v, feature flags %#x (streams bit %v), nvidia-fs %v\n",
		props.Version, props.Mode(), d.api.hasStream(), props.FeatureFlags, props.FeatureFlags&(1<<2) != 0, props.NVFSLoaded)
	if !d.api.hasStream() {
		t.Fatalf("libcufile %s has no stream API: nothing to measure", props.Library)
	}
	const (
		jobs   = 8
		pages  = 512 // 64 KiB pages: 32 MiB keys
		keys   = 16
		rounds = 3
	)
	keyBytes := int64(pages) << 16
	total := keyBytes * keys
	const srcSize = 64 << 20
	src, dst, host := deviceSrcDst(t, cu, srcSize, total, 44)
	back := make([]byte, total)
	paths := make([]string, keys)
	for i := range paths {
		paths[i] = filepath.Join(dir, fmt.Sprintf("k%d", i))
	}
	open := func(i int, create bool) (fsys.File, error) { return openDirect(paths[i], create) }
	plan := func(i int, load bool) *transfer.Plan {
		if load {
			return pagedPlanAt(dst, int64(i)*keyBytes, pages, uint64(i))
		}
		return pagedPlan(src, pages, uint64(i))
	}

	// Which way of setting up a stream does the library accept? One
	// 64 KiB write and read on a fresh stream per way; the measurement
	// uses the first way that moves both.
	type setup struct {
		name        string
		nonBlocking bool
		register    bool
		flags       uint32
		bufs        bool // device memory registered with cuFileBufRegister
	}
	setups := []setup{
		{"cudaStreamCreate, cuFileStreamRegister flags 0", false, true, 0, false},
		{"cudaStreamCreate, not registered", false, false, 0, false},
		{"non-blocking stream, not registered", true, false, 0, false},
		{"non-blocking stream, cuFileStreamRegister flags 0xf (fixed, aligned)", true, true, 0xf, false},
		{"cudaStreamCreate, cuFileStreamRegister flags 0, buffers registered", false, true, 0, true},
		{"non-blocking stream, not registered, buffers registered", true, false, 0, true},
	}
	regBufs := func(on bool) error {
		if !on {
			return errors.Join(d.deregisterBuffer(src.ptr), d.deregisterBuffer(dst.ptr))
		}
		return errors.Join(d.registerBuffer(0, src.ptr, src.size), d.registerBuffer(0, dst.ptr, dst.size))
	}
	newStream := func(st setup) (uintptr, error) {
		var s uintptr
		var err error
		if st.nonBlocking {
			s, err = cu.newNonBlockingStream()
		} else {
			s, err = cu.newStream()
		}
		if err != nil || !st.register {
			return s, err
		}
		if err := d.api.streamRegister(s, st.flags); err != nil {
			cu.destroyStream(s)
			return 0, fmt.Errorf("cuFileStreamRegister: %w", err)
		}
		return s, nil
	}
	dropStream := func(st setup, s uintptr) {
		if st.register {
			d.api.streamDeregister(s)
		}
		cu.destroyStream(s)
	}
	chosen := -1
	for k, st := range setups {
		if st.bufs {
			if err := regBufs(true); err != nil {
				t.Fatalf("cuFileBufRegister: %v", err)
			}
		}
		err := d.onDevice(0, func() error {
			s, err := newStream(st)
			if err != nil {
				return err
			}
			defer dropStream(st, s)
			return probeStream(cu, d, s, filepath.Join(dir, "probe"), src)
		})
		if st.bufs {
			if err := regBufs(false); err != nil {
				t.Fatalf("cuFileBufDeregister: %v", err)
			}
		}
		fmt.Printf("STREAMBENCH probe %-72s %v\n", st.name+":", errOr(err, "64 KiB written and read back"))
		if err == nil && chosen < 0 {
			chosen = k
		}
	}
	if chosen < 0 {
		fmt.Printf("STREAMBENCH no stream set-up moved bytes: the stream API is unusable here\n")
		t.Fatal("the stream API failed in every set-up (see the probe lines)")
	}
	use := setups[chosen]
	fmt.Printf("STREAMBENCH measuring with: %s (both paths)\n", use.name)
	if use.bufs {
		if err := regBufs(true); err != nil {
			t.Fatalf("cuFileBufRegister: %v", err)
		}
		defer regBufs(false)
	}
	// One stream per job.
	streams := make(chan uintptr, jobs)
	err := d.onDevice(0, func() error {
		for range jobs {
			s, err := newStream(use)
			if err != nil {
				return err
			}
			streams <- s
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	defer d.onDevice(0, func() error {
		for range jobs {
			dropStream(use, <-streams)
		}
		return nil
	})

	// streamKey moves one key, window pages at a time: each page of a
	// window enqueued on the job's stream, one synchronize, then every
	// page's byte count checked. Windows of 16, 4 and 1 tell the number of
	// I/Os in flight from the number of streams (docs/gds.md).
	streamKey := func(window int) func(i int, load bool) error {
		return func(i int, load bool) error {
			f, err := open(i, !load)
			if err != nil {
				return err
			}
			defer f.Close()
			s := <-streams
			defer func() { streams <- s }()
			return d.onDevice(0, func() error {
				h, err := fileHandle(d, int(f.Fd()))
				if err != nil {
					return err
				}
				defer d.cache.release(h)
				p := plan(i, load)
				for lo := 0; lo < len(p.Extents); lo += window {
					if err := streamWindow(cu, d, h.h, s, p.Extents[lo:min(lo+window, len(p.Extents))], !load); err != nil {
						return fmt.Errorf("key %d pages from %d: %w", i, lo, err)
					}
				}
				return nil
			})
		}
	}
	m, err := d.NewMover(MoverConfig{Workers: 16, AllowCompat: true, IO: IOPerCall})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	ctx := context.Background()
	perCallKey := func(i int, load bool) error {
		f, err := open(i, !load)
		if err != nil {
			return err
		}
		defer f.Close()
		if load {
			_, err = m.ReadFile(ctx, f, plan(i, true), nil)
		} else {
			_, err = m.WriteFile(ctx, f, plan(i, false), nil)
		}
		return err
	}

	fanOut := func(phase string, jobs int, job func(i int, load bool) error, load bool) (float64, float64, error) {
		dog := watchdog("STREAMBENCH", phase)
		defer dog.Stop()
		cpu0 := bench.CPUTime()
		el, err := overKeys(keys, jobs, func(i int) error { return job(i, load) })
		return float64(total) / 1e9 / el.Seconds(), bench.CPUMsPerGB(bench.CPUTime()-cpu0, total), err
	}
	type series struct{ store, load []float64 }
	// A mode is a way to move keys and how many jobs run it: the stream
	// API with windows of 16, 4 and 1 pages per synchronize with 8 jobs,
	// and with 16 pages and 1 job, to tell concurrency from window size.
	type mode struct {
		name string
		jobs int
		job  func(int, bool) error
	}
	modes := []mode{
		{"per-call", jobs, perCallKey},
		{"stream-w16", jobs, streamKey(16)},
		{"stream-w4", jobs, streamKey(4)},
		{"stream-w1", jobs, streamKey(1)},
		{"stream-w16", 1, streamKey(16)},
	}
	res := map[int]*series{}
	broken := map[int]bool{}
	for round := 1; round <= rounds; round++ {
		for k, md := range modes {
			if broken[k] {
				continue
			}
			for _, p := range paths {
				os.Remove(p)
			}
			st, stCPU, err := fanOut(fmt.Sprintf("%s j%d round %d store", md.name, md.jobs, round), md.jobs, md.job, false)
			var ld, ldCPU float64
			how := ""
			if err == nil {
				how = dropCache(paths)
				if err = cu.memsetDev(dst.ptr, 0xA5, total); err != nil {
					t.Fatal(err)
				}
				ld, ldCPU, err = fanOut(fmt.Sprintf("%s j%d round %d load", md.name, md.jobs, round), md.jobs, md.job, true)
			}
			if err == nil {
				err = checkPaged(cu, back, host, src, dst, keys, pages)
			}
			if err != nil {
				broken[k] = true
				fmt.Printf("STREAMBENCH 32MiB j%d round %d %-10s FAILED: %.600s\n", md.jobs, round, md.name, err)
				continue
			}
			if res[k] == nil {
				res[k] = &series{}
			}
			res[k].store = append(res[k].store, st)
			res[k].load = append(res[k].load, ld)
			fmt.Printf("STREAMBENCH 32MiB j%d round %d %-10s store %6.2f GB/s (%4.0f CPU ms/GB)  load %6.2f GB/s (%4.0f CPU ms/GB)  (%d keys, cache: %s, bytes checked)\n",
				md.jobs, round, md.name, st, stCPU, ld, ldCPU, keys, how)
		}
	}
	for k, md := range modes {
		if s := res[k]; s != nil {
			fmt.Printf("STREAMBENCH SUMMARY 32MiB j%d %-10s store %6.2f GB/s  load %6.2f GB/s  median of %d rounds\n",
				md.jobs, md.name, median(s.store), median(s.load), len(s.store))
		}
	}
	if broken[0] {
		t.Error("the per-call path failed (see above)")
	}
	if len(res) < 2 {
		t.Error("no stream mode completed a round: the stream API is unusable here (see above)")
	}
}

// streamWindow enqueues one asynchronous I/O per extent on stream s,
// synchronizes the stream and checks every I/O's byte count. It reports
// how many of the I/Os failed and the first failure.
func streamWindow(cu *testCudart, d *Driver, h, s uintptr, xs []transfer.Extent, write bool) error {
	ios := make([]asyncIO, 0, len(xs))
	defer func() {
		for _, a := range ios {
			a.free()
		}
	}()
	var enqueueErr error
	for _, x := range xs {
		a, err := d.api.ioAsync(write, h, x.Region.(*devMem).Ptr(), x.Len, x.FileOff, x.RegionOff, s)
		if err != nil {
			enqueueErr = fmt.Errorf("enqueue at %d: %w", x.FileOff, err)
			break
		}
		ios = append(ios, a)
	}
	// The enqueued I/Os must finish before their memory is freed.
	if err := cu.syncStream(s); err != nil {
		return errors.Join(enqueueErr, err)
	}
	failed := 0
	var first error
	for j, a := range ios {
		n, err := a.result()
		if err == nil && n != xs[j].Len {
			err = fmt.Errorf("%d of %d bytes", n, xs[j].Len)
		}
		if err != nil {
			if failed++; first == nil {
				first = fmt.Errorf("page at %d: %w", xs[j].FileOff, err)
			}
		}
	}
	if failed > 0 {
		return errors.Join(enqueueErr, fmt.Errorf("%d of %d I/Os failed, the first: %w", failed, len(ios), first))
	}
	return enqueueErr
}

// probeStream writes the first 64 KiB of src to a fresh file at path with
// cuFileWriteAsync on stream s, reads it back into src's second 64 KiB with
// cuFileReadAsync, and compares the two.
func probeStream(cu *testCudart, d *Driver, s uintptr, path string, src *devMem) error {
	const n = 64 << 10
	f, err := fsys.OS{}.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC|unix.O_DIRECT, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	h, err := fileHandle(d, int(f.Fd()))
	if err != nil {
		return err
	}
	defer d.cache.release(h)
	saved := make([]byte, n)
	if err := cu.toHost(saved, src.ptr+n); err != nil {
		return err
	}
	defer cu.toDevice(src.ptr+n, saved)
	for _, write := range []bool{true, false} {
		bufOff := int64(0)
		if !write {
			bufOff = n
		}
		x := transfer.Extent{FileOff: 0, Region: src, RegionOff: bufOff, Len: n}
		if err := streamWindow(cu, d, h.h, s, []transfer.Extent{x}, write); err != nil {
			if write {
				return fmt.Errorf("write: %w", err)
			}
			return fmt.Errorf("read back: %w", err)
		}
	}
	a, b := make([]byte, n), make([]byte, n)
	if err := errors.Join(cu.toHost(a, src.ptr), cu.toHost(b, src.ptr+n)); err != nil {
		return err
	}
	if string(a) != string(b) {
		return errors.New("the bytes read back differ from the bytes written")
	}
	return nil
}

func errOr(err error, ok string) string {
	if err != nil {
		return err.Error()
	}
	return ok
}
