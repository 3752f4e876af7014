package gpu

import (
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/cuda"
)

// TestGPUHostSourceCopyRates measures host-to-device copy rates by where
// the host bytes live, against one contiguous copy from cudaHostAlloc
// memory in the same pass: memory from cudaHostAlloc, a tmpfs file mapped
// shared and registered (as the mover keeps memory-mount files), anonymous
// memory registered with 4 KiB pages and with transparent huge pages, and,
// where KVHOST_GPU_HUGE_TMPFS names a directory on a tmpfs mounted with
// huge=always, a file there. Each source is copied whole in one copy, and
// by 16 goroutines each driving its own stream (as the mover's file slots
// do) in 1 MiB pieces and in 32 KiB pieces to shuffled blocks, batched
// 128 a call (a layer range of a Llama-8B-like key). It tells whether the
// source's pages, rather than the copies' shape, keep registered loads
// under the link. KVHOST_GPU=1 runs it (KVHOST_GPU_FAKE=1 on the fake
// CUDA library).
func TestGPUHostSourceCopyRates(t *testing.T) {
	needGPU(t)
	rep := newReport(t, ".srcrate")
	const (
		total   = 512 << 20
		block   = 32 << 10
		area    = 2 * total
		workers = 16
	)
	rig := newCopyRig(t, area, total, workers)
	r, dev, streams := rig.r, rig.dev, rig.streams

	type source struct {
		name string
		mem  []byte
	}
	sources := []source{{"cudaHostAlloc", rig.host.Bytes()}}
	// register maps and registers mem, filled first so that every page
	// exists, and unregisters and unmaps it when the test ends.
	register := func(name string, mem []byte) {
		for i := 0; i < len(mem); i += 4096 {
			mem[i] = byte(i >> 12)
		}
		if err := r.HostRegister(mem); err != nil {
			unix.Munmap(mem)
			t.Fatalf("%s: %v", name, err)
		}
		t.Cleanup(func() {
			r.HostUnregister(mem)
			unix.Munmap(mem)
		})
		sources = append(sources, source{name, mem})
	}
	file := func(name, dir string) {
		f, err := os.Create(filepath.Join(dir, "source"))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := f.Truncate(total); err != nil {
			t.Fatal(err)
		}
		mem, err := unix.Mmap(int(f.Fd()), 0, total, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
		if err != nil {
			t.Fatal(err)
		}
		register(name, mem)
	}
	anon := func(name string, advice int) {
		mem, err := unix.Mmap(-1, 0, total, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.Madvise(mem, advice); err != nil {
			t.Logf("%s: madvise: %v", name, err)
		}
		register(name, mem)
	}
	file("tmpfs file, registered", benchDir(t, "srcrate"))
	if dir := os.Getenv("KVHOST_GPU_HUGE_TMPFS"); dir != "" {
		file("huge-page tmpfs file, registered", dir)
	}
	anon("anonymous 4 KiB pages, registered", unix.MADV_NOHUGEPAGE)
	anon("anonymous huge pages, registered", unix.MADV_HUGEPAGE)

	slots := rand.New(rand.NewPCG(1, 2)).Perm(area / block)
	var spreadOver func(c *cuda.Copies, per, workers, nstreams int) time.Duration
	// pieces lists src's bytes in piece-sized copies, each to its own
	// offset or (shuffle) to a shuffled block-sized slot's.
	pieces := func(src []byte, piece int, shuffle bool) *cuda.Copies {
		var c cuda.Copies
		base := unsafeSliceAddr(src)
		for off := 0; off < total; off += piece {
			dst := dev.Ptr() + uintptr(off)
			if shuffle {
				dst = dev.Ptr() + uintptr(slots[off/block]*block)
			}
			c.Add(dst, base+uintptr(off), uintptr(piece))
		}
		return &c
	}
	// fanOut runs fn(w, share) on n goroutines, each with the device
	// current, released at once, and returns how long they took; share
	// is how many of count items each takes (w's: [w·share, (w+1)·share)).
	fanOut := func(n, count int, fn func(w, share int) error) time.Duration {
		var start, done sync.WaitGroup
		start.Add(1)
		errs := make([]error, n)
		share := (count + n - 1) / n
		for w := range n {
			done.Add(1)
			go func() {
				defer done.Done()
				unlock, err := r.LockDevice(0)
				if err != nil {
					errs[w] = err
					return
				}
				defer unlock()
				start.Wait()
				errs[w] = fn(w, share)
			}()
		}
		t0 := time.Now()
		start.Done()
		done.Wait()
		d := time.Since(t0)
		for _, err := range errs {
			if err != nil {
				t.Fatal(err)
			}
		}
		return d
	}
	// spreadOver copies c by workers goroutines, each its own share (a
	// contiguous run of pieces, as a file slot takes one file's) in
	// batches of per on stream w mod nstreams, and waits for them all;
	// spread gives each goroutine a stream of its own.
	spreadOver = func(c *cuda.Copies, per, workers, nstreams int) time.Duration {
		return fanOut(workers, c.Len(), func(w, share int) error {
			var part cuda.Copies
			for i := w * share; i < min(c.Len(), (w+1)*share); i += per {
				j := min(c.Len(), (w+1)*share, i+per)
				part.Dst, part.Src, part.Size = c.Dst[i:j], c.Src[i:j], c.Size[i:j]
				if err := r.Enqueue(&part, true, cuda.CopyAuto, streams[w%nstreams]); err != nil {
					return err
				}
			}
			return r.Sync(streams[w%nstreams])
		})
	}
	spread := func(c *cuda.Copies, per int) time.Duration { return spreadOver(c, per, workers, workers) }
	// staged copies src in 4 MiB ranges (a 4-layer range of one key's
	// file), by workers goroutines as spread does: each range in one copy
	// into the worker's device staging buffer, then scattered from there
	// in 32 KiB pieces to shuffled blocks by one device-to-device batch,
	// on the same stream. It tells what loads would reach that copy
	// their file's bytes whole and scatter them on the device.
	const rangeBytes = 4 << 20
	stage, err := r.Malloc(0, workers*2*rangeBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer stage.Close()
	staged := func(src []byte) time.Duration {
		h2d := pieces(src, rangeBytes, false)
		perRange := rangeBytes / block
		return fanOut(workers, h2d.Len(), func(w, share int) error {
			var one, part cuda.Copies
			for i, k := w*share, 0; i < min(h2d.Len(), (w+1)*share); i, k = i+1, k+1 {
				buf := stage.Ptr() + uintptr((2*w+k%2)*rangeBytes)
				one.Reset()
				one.Add(buf, h2d.Src[i], rangeBytes)
				if err := r.Enqueue(&one, true, cuda.CopyAuto, streams[w]); err != nil {
					return err
				}
				part.Reset()
				for j := i * perRange; j < (i+1)*perRange; j++ {
					off := j * block // the piece's offset in src, and in the range's buffer modulo rangeBytes
					part.Add(dev.Ptr()+uintptr(slots[off/block]*block), buf+uintptr(off%rangeBytes), block)
				}
				if err := r.Enqueue(&part, true, cuda.CopyAuto, streams[w]); err != nil {
					return err
				}
			}
			return r.Sync(streams[w])
		})
	}
	whole := func(src []byte) time.Duration {
		t0 := time.Now()
		if err := r.CopyH2D(dev.Ptr(), unsafeSliceAddr(src), total, streams[0]); err != nil {
			t.Fatal(err)
		}
		if err := r.Sync(streams[0]); err != nil {
			t.Fatal(err)
		}
		return time.Since(t0)
	}
	// How many streams the goroutines share: 16 goroutines (file slots)
	// enqueueing onto 1, 2, 4, 8 or 16 streams, and as many goroutines as
	// streams, from the registered tmpfs file.
	for pass := range 2 {
		base := gbps(total, whole(sources[1].mem))
		for _, g := range []int{16, 0} {
			for _, n := range []int{1, 2, 4, 8, 16} {
				for _, sh := range []struct {
					name  string
					piece int
					per   int
				}{{"32 KiB shuffled", block, 128}, {"4 MiB pieces", rangeBytes, 1}} {
					goroutines := g
					if g == 0 {
						goroutines = n
					}
					d := spreadOver(pieces(sources[1].mem, sh.piece, sh.piece == block), sh.per, goroutines, n)
					rep.printf("streams pass %d %2d goroutines on %2d streams %-16s %5.1f GB/s (%.2f of one copy)", pass, goroutines, n, sh.name, gbps(total, d), gbps(total, d)/base)
				}
			}
		}
	}
	for pass := range 3 {
		var base float64
		for _, s := range sources {
			shapes := []struct {
				name string
				run  func() time.Duration
			}{
				{"one copy", func() time.Duration { return whole(s.mem) }},
				{"1 MiB pieces, 16 streams", func() time.Duration { return spread(pieces(s.mem, 1<<20, false), 4) }},
				{"32 KiB shuffled, 16 streams", func() time.Duration { return spread(pieces(s.mem, block, true), 128) }},
				{"4 MiB pieces, 16 streams", func() time.Duration { return spread(pieces(s.mem, rangeBytes, false), 1) }},
				{"4 MiB staged, 32 KiB scattered", func() time.Duration { return staged(s.mem) }},
			}
			for _, sh := range shapes {
				g := gbps(total, sh.run())
				if base == 0 {
					base = g
				}
				rep.printf("pass %d %-36s %-28s %5.1f GB/s (%.2f of cudaHostAlloc, one copy)", pass, s.name, sh.name, g, g/base)
			}
		}
	}
}
