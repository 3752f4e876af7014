//go:build gpu && linux && cgo

package gds

// The GPU check: build with
//
//	CGO_ENABLED=1 go test -c -tags gpu -o gds-gpu.test ./gds
//
// and run on a GPU machine (as root, for the udev record cuFile needs on a
// VM without udev):
//
//	mkdir -p /run/udev/data
//	printf 'E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=%s\n' "$(stat -f -c %T /var/tmp)" > /run/udev/data/b$(stat -c '%Hd:%Ld' /var/tmp)
//	./gds-gpu.test -test.v -test.run GPU
//
// KVHOST_GPU_DIR (default /var/tmp) is the disk directory, KVHOST_GPU_TMPFS
// (default /dev/shm) the tmpfs one. Without libcudart it skips.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// devMem is cudaMalloc'ed memory as a region.Device.
type devMem struct {
	id   uint64
	ptr  uintptr
	size int64
}

func (d *devMem) ID() uint64        { return d.id }
func (d *devMem) Len() int64        { return d.size }
func (d *devMem) Kind() region.Kind { return region.KindDevice }
func (d *devMem) Ordinal() int      { return 0 }
func (d *devMem) Ptr() uintptr      { return d.ptr }

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

// pagedPlan is a key of pages × 64 KiB laid out in file order from random
// pages of dev (vLLM's paged layout: a key's blocks are scattered).
func pagedPlan(dev region.Device, pages int, seed uint64) *transfer.Plan {
	const page = 64 << 10
	perm := rand.New(rand.NewPCG(seed, 3)).Perm(int(dev.Len() / page))
	p := &transfer.Plan{Direct: true}
	for i := range pages {
		p.Extents = append(p.Extents, transfer.Extent{FileOff: int64(i) * page, Region: dev, RegionOff: int64(perm[i]) * page, Len: page, Sum: -1})
	}
	return p
}

func TestGPUCuFileRoundTripAndThroughput(t *testing.T) {
	cu, err := openTestCudart()
	if err != nil {
		t.Skipf("GPU check skipped: no CUDA runtime here (%v); run it on a GPU machine", err)
	}
	if err := cu.setDevice(0); err != nil {
		t.Skipf("GPU check skipped: no usable GPU (%v)", err)
	}
	d, err := Open(Config{BindDevice: cu.setDevice, Logger: slog.New(slog.NewTextHandler(os.Stdout, nil))})
	if err != nil {
		t.Fatalf("gds.Open on a GPU machine: %v", err)
	}
	defer d.Close()
	t.Logf("properties: %+v (mode %v)", d.Properties(), d.Properties().Mode())
	disk, shm := envOr("KVHOST_GPU_DIR", "/var/tmp"), envOr("KVHOST_GPU_TMPFS", "/dev/shm")
	dir, err := os.MkdirTemp(disk, "kvhost-gds-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)

	c, err := d.ProbeDir(shm)
	t.Logf("tmpfs %s: %v (err %v)", shm, c, err)
	if err != nil || c.Mode != ModeUnusable {
		t.Errorf("tmpfs capability = %v, %v; want unusable", c, err)
	}
	c, err = d.ProbeDir(dir)
	t.Logf("disk %s: %v (err %v)", dir, c, err)
	if err != nil || c.Mode == ModeUnusable {
		t.Fatalf("disk capability = %v, %v; cuFile registration must work there (udev record written?)", c, err)
	}
	m, err := d.NewMover(MoverConfig{Workers: 16, AllowCompat: true})
	if err != nil {
		t.Fatal(err)
	}

	const regionSize = 64 << 20
	var regs []*devMem
	for i := range 2 {
		p, err := cu.mallocDev(regionSize)
		if err != nil {
			t.Fatal(err)
		}
		defer cu.freeDev(p)
		regs = append(regs, &devMem{id: uint64(i + 1), ptr: p, size: regionSize})
	}
	src, dst := regs[0], regs[1]
	host := make([]byte, regionSize)
	randomBytes(host, 42, 42)
	if err := cu.toDevice(src.ptr, host); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	open := func(path string, direct bool) fsys.File {
		fl := os.O_RDWR | os.O_CREATE
		if direct {
			fl |= unix.O_DIRECT
		}
		f, err := fsys.OS{}.OpenFile(path, fl, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		return f
	}

	// tmpfs: the mover refuses, nothing moves.
	{
		f := open(filepath.Join(shm, "kvhost-gds-check"), false)
		n, err := m.WriteFile(ctx, f, pagedPlan(src, 32, 1), nil)
		f.Close()
		os.Remove(filepath.Join(shm, "kvhost-gds-check"))
		t.Logf("tmpfs WriteFile: %d bytes, %v", n, err)
		if !errors.Is(err, transfer.ErrUnsupported) || n != 0 {
			t.Errorf("tmpfs WriteFile = %d, %v; want 0, ErrUnsupported", n, err)
		}
	}

	// Round trip GPU → file → GPU, 32 MiB in 512 scattered 64 KiB pages,
	// the destination poisoned, checked byte for byte.
	{
		path := filepath.Join(dir, "roundtrip")
		f := open(path, true)
		wp := pagedPlan(src, 512, 7)
		if n, err := m.WriteFile(ctx, f, wp, nil); err != nil || n != 32<<20 {
			t.Fatalf("WriteFile = %d, %v", n, err)
		}
		if err := cu.memsetDev(dst.ptr, 0xA5, regionSize); err != nil {
			t.Fatal(err)
		}
		rp := pagedPlan(dst, 512, 8)
		if n, err := m.ReadFile(ctx, f, rp, nil); err != nil || n != 32<<20 {
			t.Fatalf("ReadFile = %d, %v", n, err)
		}
		f.Close()
		back := make([]byte, regionSize)
		if err := cu.toHost(back, dst.ptr); err != nil {
			t.Fatal(err)
		}
		file, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		for i := range wp.Extents {
			w, rd := wp.Extents[i], rp.Extents[i]
			want := host[w.RegionOff : w.RegionOff+w.Len]
			if !bytes.Equal(file[w.FileOff:w.FileOff+w.Len], want) {
				t.Fatalf("page %d: file bytes differ from GPU source", i)
			}
			if !bytes.Equal(back[rd.RegionOff:rd.RegionOff+rd.Len], want) {
				t.Fatalf("page %d: bytes read back into the GPU differ", i)
			}
		}
		t.Logf("round trip: 32 MiB, 512 pages GPU → %s → GPU, byte for byte equal", path)
	}

	// Throughput.
	type run struct {
		name         string
		pages, files int
		jobs         int
		contiguous   bool
		buffered     bool
	}
	plan := func(rn run, dev region.Device, i int) *transfer.Plan {
		if rn.contiguous {
			return &transfer.Plan{Direct: true, Extents: []transfer.Extent{{Region: dev, RegionOff: int64(i%2) * int64(rn.pages) << 16, Len: int64(rn.pages) << 16, Sum: -1}}}
		}
		return pagedPlan(dev, rn.pages, uint64(i))
	}
	// fanOut runs rn.jobs goroutines, each calling job with the queue of
	// file indices 0..rn.files-1 they share, and returns the GB/s of the
	// rn.files files of rn.pages 64 KiB pages over the wall time.
	fanOut := func(rn run, job func(files <-chan int)) float64 {
		files := make(chan int, rn.files)
		for i := range rn.files {
			files <- i
		}
		close(files)
		var wg sync.WaitGroup
		start := time.Now()
		for range rn.jobs {
			wg.Go(func() { job(files) })
		}
		wg.Wait()
		return float64(rn.files*rn.pages<<16) / time.Since(start).Seconds() / 1e9
	}
	measure := func(rn run, write bool) float64 {
		return fanOut(rn, func(paths <-chan int) {
			for i := range paths {
				f := open(filepath.Join(dir, fmt.Sprintf("%s-%d", rn.name, i)), !rn.buffered)
				var err error
				if write {
					_, err = m.WriteFile(ctx, f, plan(rn, src, i), nil)
				} else {
					_, err = m.ReadFile(ctx, f, plan(rn, dst, i), nil)
				}
				f.Close()
				if err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	// Ceiling: plain O_DIRECT pwrite/pread of the same sizes from host
	// memory, same files, same concurrency.
	ceiling := func(rn run, write bool) float64 {
		return fanOut(rn, func(paths <-chan int) {
			buf, err := unix.Mmap(-1, 0, rn.pages<<16, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
			if err != nil {
				t.Error(err)
				return
			}
			defer unix.Munmap(buf)
			for i := range paths {
				fd, err := unix.Open(filepath.Join(dir, fmt.Sprintf("ceil-%s-%d", rn.name, i)), unix.O_RDWR|unix.O_CREAT|unix.O_DIRECT, 0o600)
				if err != nil {
					t.Error(err)
					return
				}
				for off := 0; off < len(buf); off += 8 << 20 {
					chunk := buf[off:min(off+8<<20, len(buf))]
					if write {
						_, err = unix.Pwrite(fd, chunk, int64(off))
					} else {
						_, err = unix.Pread(fd, chunk, int64(off))
					}
					if err != nil {
						t.Error(err)
					}
				}
				unix.Close(fd)
			}
		})
	}
	runs := []run{
		{name: "32MiB-paged-j1", pages: 512, files: 8, jobs: 1},
		{name: "32MiB-paged-j8", pages: 512, files: 16, jobs: 8},
		{name: "2MiB-paged-j1", pages: 32, files: 64, jobs: 1},
		{name: "2MiB-paged-j8", pages: 32, files: 128, jobs: 8},
		{name: "32MiB-contig-j8", pages: 512, files: 16, jobs: 8, contiguous: true},
		{name: "32MiB-paged-j8-buffered", pages: 512, files: 16, jobs: 8, buffered: true},
	}
	fmt.Printf("GDSBENCH %-26s %10s %10s %12s %12s\n", "run (cuFile compat, ext4)", "write GB/s", "read GB/s", "ceil write", "ceil read")
	for _, rn := range runs {
		w := measure(rn, true)
		rd := measure(rn, false)
		cw, cr := 0.0, 0.0
		if !rn.buffered {
			cw, cr = ceiling(rn, true), ceiling(rn, false)
		}
		fmt.Printf("GDSBENCH %-26s %10.2f %10.2f %12.2f %12.2f\n", rn.name, w, rd, cw, cr)
	}
	t.Logf("handle cache: %+v", d.HandleStats())
}

// randomBytes fills b (a multiple of 8 bytes long) from a PCG seeded with
// seed1, seed2.
func randomBytes(b []byte, seed1, seed2 uint64) {
	r := rand.New(rand.NewPCG(seed1, seed2))
	for i := 0; i < len(b); i += 8 {
		v := r.Uint64()
		for j := range 8 {
			b[i+j] = byte(v >> (8 * j))
		}
	}
}

// TestGPUCuFileMovesOrPassesOnPlansOfAnyBlockSize (KVHOST_GPU=1): plans of
// block sizes the engine accepts (down to 512 bytes; MLA's 16 × 576 × 2 =
// 18432), on files open with O_DIRECT and without, either move byte for
// byte or, on an O_DIRECT file whose pieces are not 4 KiB aligned, are
// passed on (ErrUnsupported, nothing moved) to the staging pipeline,
// which bounces them. Then cuFileRead and cuFileWrite are made to fail,
// and each error must read as an errno or a cuFile status this package
// knows, not as an unknown status (a negated errno taken for one).
func TestGPUCuFileMovesOrPassesOnPlansOfAnyBlockSize(t *testing.T) {
	if os.Getenv("KVHOST_GPU") != "1" {
		t.Skip("block-size check skipped: set KVHOST_GPU=1 to run it on a GPU machine")
	}
	cu, d, dir, _ := openDiskDriver(t, "BLOCKS", "kvhost-gds-blocks-")
	m := newMover(t, d, MoverConfig{Workers: 16, AllowCompat: true, IO: IOPerCall})
	const regionSize, hl = 64 << 20, 4096
	src, dst, host := deviceSrcDst(t, cu, regionSize, regionSize, 7)
	back := make([]byte, regionSize)
	ctx := context.Background()
	for _, bb := range []int64{4096, 18432, 1536, 512, 6144} {
		for _, direct := range []bool{true, false} {
			t.Run(fmt.Sprintf("%d-byte blocks, O_DIRECT %v", bb, direct), func(t *testing.T) {
				n := min(512, (8<<20)/bb)
				pw := rand.New(rand.NewPCG(uint64(bb), 1)).Perm(int(regionSize / bb))
				pr := rand.New(rand.NewPCG(uint64(bb), 2)).Perm(int(regionSize / bb))
				wp, rp := &transfer.Plan{Direct: direct}, &transfer.Plan{Direct: direct}
				for i := range n {
					wp.Extents = append(wp.Extents, transfer.Extent{FileOff: hl + i*bb, Region: src, RegionOff: int64(pw[i]) * bb, Len: bb, Sum: -1})
					rp.Extents = append(rp.Extents, transfer.Extent{FileOff: hl + i*bb, Region: dst, RegionOff: int64(pr[i]) * bb, Len: bb, Sum: -1})
				}
				path := filepath.Join(dir, fmt.Sprintf("blocks-%d-%v", bb, direct))
				fl := os.O_RDWR | os.O_CREATE
				if direct {
					fl |= unix.O_DIRECT
				}
				f, err := fsys.OS{}.OpenFile(path, fl, 0o600)
				if err != nil {
					t.Fatal(err)
				}
				defer f.Close()
				if err := unix.Fallocate(int(f.Fd()), 0, 0, hl+(n*bb+4095)/4096*4096); err != nil {
					t.Fatal(err)
				}
				nw, werr := m.WriteFile(ctx, f, wp, nil)
				t.Logf("WriteFile of %d blocks: %d, %v", n, nw, werr)
				if direct && bb%directAlign != 0 {
					if !errors.Is(werr, transfer.ErrUnsupported) || nw != 0 {
						t.Errorf("WriteFile = %d, %v; want 0, ErrUnsupported", nw, werr)
					}
					if nr, rerr := m.ReadFile(ctx, f, rp, nil); !errors.Is(rerr, transfer.ErrUnsupported) || nr != 0 {
						t.Errorf("ReadFile = %d, %v; want 0, ErrUnsupported", nr, rerr)
					}
					return
				}
				if werr != nil || nw != wp.Bytes() {
					t.Fatalf("WriteFile = %d, %v; want %d", nw, werr, wp.Bytes())
				}
				file, err := os.ReadFile(path)
				if err != nil {
					t.Fatal(err)
				}
				if err := cu.memsetDev(dst.ptr, 0xA5, regionSize); err != nil {
					t.Fatal(err)
				}
				if nr, rerr := m.ReadFile(ctx, f, rp, nil); rerr != nil || nr != rp.Bytes() {
					t.Fatalf("ReadFile = %d, %v; want %d", nr, rerr, rp.Bytes())
				}
				if err := cu.toHost(back, dst.ptr); err != nil {
					t.Fatal(err)
				}
				for i := range wp.Extents {
					w, r := wp.Extents[i], rp.Extents[i]
					want := host[w.RegionOff : w.RegionOff+w.Len]
					if !bytes.Equal(file[w.FileOff:w.FileOff+w.Len], want) {
						t.Fatalf("block %d: file bytes differ from the GPU source", i)
					}
					if !bytes.Equal(back[r.RegionOff:r.RegionOff+r.Len], want) {
						t.Fatalf("block %d: bytes read back into the GPU differ", i)
					}
				}
			})
		}
	}

	// Failing calls: a write-only descriptor read, a read-only one
	// written, unaligned O_DIRECT I/O, a read past the end of the file.
	path := filepath.Join(dir, "raw")
	if err := os.WriteFile(path, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		flags  int
		write  bool
		off, n int64
	}{
		{"read of a write-only descriptor", unix.O_WRONLY, false, 0, 4096},
		{"write of a read-only descriptor", unix.O_RDONLY, true, 0, 4096},
		{"unaligned O_DIRECT read", unix.O_RDONLY | unix.O_DIRECT, false, 4096 + 512, 18432},
		{"unaligned O_DIRECT write", unix.O_WRONLY | unix.O_DIRECT, true, 4096 + 512, 18432},
		{"O_DIRECT read past the end", unix.O_RDONLY | unix.O_DIRECT, false, 2 << 20, 4096},
	} {
		fd, err := unix.Open(path, tc.flags|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Errorf("%s: open: %v", tc.name, err)
			continue
		}
		err = d.onDevice(0, func() error {
			h, err := d.api.handleRegister(fd)
			if err != nil {
				t.Logf("%s: cuFileHandleRegister: %v", tc.name, err)
				return nil
			}
			defer d.api.handleDeregister(h)
			var n int64
			if tc.write {
				n, err = d.api.write(h, src.ptr, tc.n, tc.off, 0)
			} else {
				n, err = d.api.read(h, src.ptr, tc.n, tc.off, 0)
			}
			t.Logf("%s: %d, %v", tc.name, n, err)
			var st Status
			if errors.As(err, &st) && st.Name() == "CU_FILE_UNKNOWN" {
				t.Errorf("%s: %v reads as an unknown cuFile status", tc.name, err)
			}
			return nil
		})
		unix.Close(fd)
		if err != nil {
			t.Fatal(err)
		}
	}
}
