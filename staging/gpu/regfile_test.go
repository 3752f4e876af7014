package gpu

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/internal/bench"
	"github.com/kvhost/kvhost/internal/crc32c"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// TestGPURegisteredFiles measures a path the mover does not take: mapping
// each file, registering its pages with CUDA (cudaHostRegister) and
// copying between the paged device layout and the file's own pages, with
// no pinned buffer and no CPU copy. With 4 KiB pages registration cost
// about 40 ms per 32 MiB file on the GPU machine; this measures it on
// each directory of KVHOST_GPU_REGDIRS (a comma list; a tmpfs with huge
// pages is the interesting one), 128 × 32 MiB fresh files, 16 jobs, next
// to the plain pwrite/pread ceiling of the same files, and checks the
// bytes. Then it measures the same files registered once and kept
// registered (registeredOnce). KVHOST_GPU=1 runs it.
func TestGPURegisteredFiles(t *testing.T) {
	if os.Getenv("KVHOST_GPU") != "1" || os.Getenv("KVHOST_GPU_REGDIRS") == "" {
		t.Skip("set KVHOST_GPU=1 and KVHOST_GPU_REGDIRS on a machine with a CUDA GPU to run it")
	}
	rep := &report{t: t}
	r, w := openGPU(t, benchCUDA(t))
	g := llama8B()
	kv := newCache(t, w, g)
	orig := kv.randomize(t, w, 1)
	host := map[region.Region][]byte{}
	for l, b := range orig {
		host[kv.layers[l]] = b
	}
	files, jobs := 128, 16
	if n, err := strconv.Atoi(os.Getenv("KVHOST_GPU_REGFILES")); err == nil {
		files = n
	}
	keyBytes := int64(g.layers * g.blocksPerKey * g.pageBytes)
	size := keyBytes + int64(g.headerBytes)
	rnd := rand.New(rand.NewPCG(5, 5))
	plans := make([]*transfer.Plan, files)
	for i := range plans {
		plans[i] = kv.plan(keyBlocks(rnd, g.numBlocks, g.blocksPerKey), false)
	}
	for _, dir := range strings.Split(os.Getenv("KVHOST_GPU_REGDIRS"), ",") {
		dir = filepath.Join(dir, "kvhost-regfiles")
		os.RemoveAll(dir)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		paths := make([]string, files)
		for i := range paths {
			paths[i] = filepath.Join(dir, fmt.Sprintf("k%d", i))
		}
		for round := range 2 {
			for _, p := range paths {
				os.Remove(p)
			}
			cw, cr := bufferedCeilings(t, r, paths, keyBytes, jobs)
			for _, p := range paths {
				os.Remove(p)
			}
			var reg, unreg, copies atomic.Int64
			ws, err := parallel(files, jobs, func(_, i int) error {
				return mappedMove(r, paths[i], size, plans[i], false, &reg, &unreg, &copies)
			})
			if err != nil {
				t.Fatalf("%s: store: %v", dir, err)
			}
			want, _ := expect(plans[0], host)
			got, err := os.ReadFile(paths[0])
			if err != nil || !bytes.Equal(got[g.headerBytes:], want) {
				t.Fatalf("%s: the first file's bytes differ from the pages (%v)", dir, err)
			}
			sreg, sunreg, scopy := reg.Swap(0), unreg.Swap(0), copies.Swap(0)
			kv.poison(t, w)
			ls, err := parallel(files, jobs, func(_, i int) error {
				return mappedMove(r, paths[i], size, plans[i], true, &reg, &unreg, &copies)
			})
			if err != nil {
				t.Fatalf("%s: load: %v", dir, err)
			}
			checkLoaded(t, kv, w, plans, orig, dir+": after the round trip")
			total := keyBytes * int64(files)
			per := func(ns int64) float64 { return float64(ns) / float64(files) / 1e6 }
			rep.printf("registered files %s round %d, %d × 32 MiB, %d jobs: store %.1f GB/s (pwrite ceiling %.1f: %.2f; per file register %.2f ms, copy %.2f ms, unregister %.2f ms), load %.1f GB/s (pread ceiling %.1f: %.2f; register %.2f, copy %.2f, unregister %.2f ms); verified",
				dir, round, files, jobs, gbps(total, ws), gbps(total, cw), gbps(total, ws)/gbps(total, cw), per(sreg), per(scopy), per(sunreg),
				gbps(total, ls), gbps(total, cr), gbps(total, ls)/gbps(total, cr), per(reg.Swap(0)), per(copies.Swap(0)), per(unreg.Swap(0)))
		}
		registeredOnce(t, rep, r, kv, w, orig, host, dir, paths, size, keyBytes, plans, jobs)
		os.RemoveAll(dir)
	}
}

// registeredOnce measures what a cache whose files stay mapped and
// registered would pay per store and load: every file is created, mapped
// and registered first, untimed (what keeping spare files registered
// would pay once per file), then stores copy straight into the files'
// pages (and checksum them, as the engine would, in a second pass) and
// loads copy straight out of them (a load's checksum pass, timed alike,
// reads the pages the engine would verify; this measurement does not
// compare the sums). The pwrite/pread ceiling of the same files is timed
// first. Every store pass writes into poisoned files, and the bytes are
// checked after each pass.
func registeredOnce(t *testing.T, rep *report, r *cuda.Runtime, kv *cache, w *cuda.Worker, orig [][]byte, host map[region.Region][]byte,
	dir string, paths []string, size, keyBytes int64, plans []*transfer.Plan, jobs int) {
	t.Helper()
	g := llama8B()
	cw, cr := bufferedCeilings(t, r, paths, keyBytes, jobs)
	maps := make([][]byte, len(paths))
	defer func() {
		for _, m := range maps {
			if m != nil {
				unlock, err := r.LockDevice(0)
				if err == nil {
					r.HostUnregister(m)
					unlock()
				}
				unix.Munmap(m)
			}
		}
	}()
	for i, p := range paths {
		os.Remove(p)
		m, err := mapNew(p, size)
		if err != nil {
			t.Fatal(err)
		}
		maps[i] = m
		unlock, err := r.LockDevice(0)
		if err != nil {
			t.Fatal(err)
		}
		err = r.HostRegister(m)
		unlock()
		if err != nil {
			t.Fatalf("%s: register: %v", p, err)
		}
	}
	crcs := make([]uint32, len(paths)) // the checksum pass's results, as a store keeps them
	move := func(load, checksum bool) (time.Duration, error) {
		return parallel(len(paths), jobs, func(_, i int) error {
			if err := copyMapped(r, maps[i], plans[i], load); err != nil {
				return err
			}
			if checksum {
				crcs[i] = crc32c.Update(0, maps[i][g.headerBytes:])
			}
			return nil
		})
	}
	for _, withSums := range []bool{true, false} {
		for _, m := range maps {
			for i := range m {
				m[i] = bench.Poison
			}
		}
		ws, err := move(false, withSums)
		if err != nil {
			t.Fatalf("%s: store into registered files: %v", dir, err)
		}
		for i, p := range plans {
			want, _ := expect(p, host)
			if !bytes.Equal(maps[i][g.headerBytes:g.headerBytes+int(keyBytes)], want) {
				t.Fatalf("%s: file %d's bytes differ from the pages after a store into its registered mapping", dir, i)
			}
		}
		kv.poison(t, w)
		ls, err := move(true, withSums)
		if err != nil {
			t.Fatalf("%s: load from registered files: %v", dir, err)
		}
		checkLoaded(t, kv, w, plans, orig, dir+": after a load from registered mappings")
		total := keyBytes * int64(len(paths))
		rep.printf("files registered once %s, %d × 32 MiB, %d jobs, checksum pass %v: store %.1f GB/s (pwrite ceiling %.1f: %.2f), load %.1f GB/s (pread ceiling %.1f: %.2f); verified",
			dir, len(paths), jobs, withSums, gbps(total, ws), gbps(total, cw), gbps(total, ws)/gbps(total, cw), gbps(total, ls), gbps(total, cr), gbps(total, ls)/gbps(total, cr))
	}
}

// bufferedCeilings times a plain pwrite, then pread, of every path with
// jobs threads (hostPass, without O_DIRECT).
func bufferedCeilings(t *testing.T, r *cuda.Runtime, paths []string, keyBytes int64, jobs int) (write, read time.Duration) {
	t.Helper()
	write, err := hostPass(r, paths, keyBytes, llama8B(), jobs, true, false)
	if err != nil {
		t.Fatal(err)
	}
	if read, err = hostPass(r, paths, keyBytes, llama8B(), jobs, false, false); err != nil {
		t.Fatal(err)
	}
	return write, read
}

// checkLoaded fails t unless every page the plans load holds its original
// bytes (orig, per layer); when says after what.
func checkLoaded(t *testing.T, kv *cache, w *cuda.Worker, plans []*transfer.Plan, orig [][]byte, when string) {
	t.Helper()
	for l := range orig {
		dev := kv.get(t, w, l)
		for _, p := range plans {
			for _, x := range p.Extents {
				if x.Region == kv.layers[l] && !bytes.Equal(dev[x.RegionOff:x.RegionOff+x.Len], orig[l][x.RegionOff:x.RegionOff+x.Len]) {
					t.Fatalf("%s: layer %d page at %d differs", when, l, x.RegionOff)
				}
			}
		}
	}
}

// mapNew creates the file at path with size bytes allocated and maps it
// shared, read-write, its pages populated.
func mapNew(path string, size int64) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if err := unix.Fallocate(int(f.Fd()), 0, 0, size); err != nil {
		return nil, err
	}
	return unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
}

// copyMapped copies the plan's pages between the device and m, a
// registered mapping of the plan's file, on a thread with device 0
// current.
func copyMapped(r *cuda.Runtime, m []byte, p *transfer.Plan, load bool) error {
	unlock, err := r.LockDevice(0)
	if err != nil {
		return err
	}
	defer unlock()
	return copyOnStream(r, m, p, load)
}

// copyOnStream copies the plan's pages between the device and m in one
// batched copy on a stream of its own, and waits for it; the calling
// thread has the device current.
func copyOnStream(r *cuda.Runtime, m []byte, p *transfer.Plan, load bool) error {
	s, err := r.NewStream()
	if err != nil {
		return err
	}
	defer r.DestroyStream(s)
	var cp cuda.Copies
	base := unsafeSliceAddr(m)
	for _, x := range p.Extents {
		dev := x.Region.(region.Device).Ptr() + uintptr(x.RegionOff)
		if load {
			cp.Add(dev, base+uintptr(x.FileOff), uintptr(x.Len))
		} else {
			cp.Add(base+uintptr(x.FileOff), dev, uintptr(x.Len))
		}
	}
	err = r.Enqueue(&cp, load, cuda.CopyBatch, s)
	if serr := r.Sync(s); err == nil {
		err = serr
	}
	return err
}

// mappedMove stores (loads) one file by mapping it, registering the
// mapping with CUDA and copying the plan's pages between the device and
// the mapping on a stream of its own.
func mappedMove(r *cuda.Runtime, path string, size int64, p *transfer.Plan, load bool, reg, unreg, copies *atomic.Int64) error {
	flag := os.O_RDWR
	if !load {
		flag |= os.O_CREATE | os.O_EXCL
	}
	f, err := os.OpenFile(path, flag, 0o644)
	if err != nil {
		return err
	}
	defer f.Close()
	if !load {
		if err := unix.Fallocate(int(f.Fd()), 0, 0, size); err != nil {
			return err
		}
	}
	m, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return err
	}
	defer unix.Munmap(m)
	unlock, err := r.LockDevice(0)
	if err != nil {
		return err
	}
	defer unlock()
	t0 := time.Now()
	if err := r.HostRegister(m); err != nil {
		return err
	}
	t1 := time.Now()
	reg.Add(int64(t1.Sub(t0)))
	err = copyOnStream(r, m, p, load)
	t2 := time.Now()
	copies.Add(int64(t2.Sub(t1)))
	if uerr := r.HostUnregister(m); err == nil {
		err = uerr
	}
	unreg.Add(int64(time.Since(t2)))
	return err
}

func unsafeSliceAddr(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }
