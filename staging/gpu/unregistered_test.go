package gpu

import (
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/internal/crc32c"
)

// cudaDevAttrPageableMemoryAccess is the device attribute that says
// whether the GPU can read host memory that is neither pinned nor
// registered (HMM or ATS): a plain mapping of a file.
const cudaDevAttrPageableMemoryAccess = 88

// TestGPUPathsForFilesNotRegistered measures, in one run, the ways a load
// could move a memory-mount file that no one has registered yet (a
// restarted daemon's files, another engine's) into GPU memory, each on
// files written moments before and never mapped, as such loads find them:
//
//   - "mapped copy": the staging pipeline's way, simplified: map the file,
//     copy 4 MiB at a time into one of two pinned buffers, one DMA each;
//   - the same with the copy cut in 256 KiB pieces as the pipeline cuts
//     it, without and with each piece checksummed after its copy; in
//     1 MiB pieces each checksummed in the mapping first; in one piece
//     checksummed after (Go's copy stores around the cache from 1 MiB);
//   - "pread": the same with pread into the pinned buffers (the way
//     engines that read files into bounce buffers take);
//   - "pageable DMA": cudaMemcpyAsync straight from the mapping, which
//     the driver stages through pinned memory of its own;
//   - "registered on the path": map with MAP_POPULATE, cudaHostRegister,
//     one DMA, unregister, every job for itself;
//   - "kernel from the mapping": kvhost's copy kernel reading the
//     mapping itself, which needs pageable memory access (HMM or ATS);
//     where the device reports none it is not launched (a kernel reading
//     such memory there fails with an illegal address and poisons the
//     context) and the report says so.
//
// Every file's bytes on the device are checked. 256 files of 32 MiB by
// default (KVHOST_GPU_FILES, KVHOST_GPU_FILE_MIB), 16 jobs
// (KVHOST_GPU_JOBS), two rounds in opposite orders, on KVHOST_GPU_TMPFS.
// KVHOST_GPU_PATHS picks paths by name (a comma list), KVHOST_GPU_ROUNDS
// sets the rounds. KVHOST_GPU=1 runs it.
func TestGPUPathsForFilesNotRegistered(t *testing.T) {
	needGPU(t)
	rep := newReport(t, "")
	r, _ := openGPU(t, envCUDA())
	files := envInt(t, "KVHOST_GPU_FILES", 256)
	size := envInt(t, "KVHOST_GPU_FILE_MIB", 32) << 20
	jobs := envInt(t, "KVHOST_GPU_JOBS", 16)
	const chunk = 4 << 20
	if size%chunk != 0 {
		t.Fatalf("KVHOST_GPU_FILE_MIB must be a multiple of 4, got %d MiB", size>>20)
	}
	dir := benchDir(t, "unregistered")

	pageable, err := r.Attribute(cudaDevAttrPageableMemoryAccess, 0)
	if err != nil {
		t.Fatalf("cudaDeviceGetAttribute(PageableMemoryAccess): %v", err)
	}
	rep.printf("device 0 pageable memory access: %d", pageable)

	ws := make([]*cuda.Worker, jobs)
	bufs := make([][2]*cuda.Pinned, jobs)
	tables := make([]*cuda.Pinned, jobs)
	for j := range jobs {
		if ws[j], err = r.NewWorker(0); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ws[j].Close() })
		for k := range bufs[j] {
			if bufs[j][k], err = r.HostAlloc(chunk); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { bufs[j][k].Free() })
		}
		if tables[j], err = r.HostAlloc(64 << 10); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tables[j].Free() })
	}
	var kern *cuda.Kernel
	if pageable != 0 {
		if err := ws[0].Do(context.Background(), func(*cuda.Worker) error {
			kern, err = r.LoadCopyKernel()
			return err
		}); err != nil {
			t.Fatalf("copy kernel: %v", err)
		}
		t.Cleanup(func() { ws[0].Do(context.Background(), func(*cuda.Worker) error { return kern.Unload() }) })
	}
	dev, err := r.Malloc(0, int64(files)*int64(size))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dev.Close() })
	check, err := r.HostAlloc(size)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { check.Free() })

	type path struct {
		name string
		load func(w *cuda.Worker, j int, file string, dst uintptr) error
	}
	sinks := make([]uint32, jobs) // the checksums, kept
	mappedCopy := func(piece int, where sumOrder) func(w *cuda.Worker, j int, file string, dst uintptr) error {
		return func(w *cuda.Worker, j int, file string, dst uintptr) error {
			return withMapping(file, size, false, func(m []byte) error {
				unix.Madvise(m, unix.MADV_SEQUENTIAL)
				return doubleBuffered(r, w, bufs[j], dst, size, chunk, func(b []byte, off int) error {
					for lo := 0; lo < len(b); lo += piece {
						dst, src := b[lo:lo+piece], m[off+lo:off+lo+piece]
						if where == sumSourceFirst {
							sinks[j] = crc32c.Update(sinks[j], src)
						}
						copy(dst, src)
						if where == sumPieceAfter {
							sinks[j] = crc32c.Update(sinks[j], dst)
						}
					}
					return nil
				})
			})
		}
	}
	paths := []path{
		{"mapped copy", func(w *cuda.Worker, j int, file string, dst uintptr) error {
			return withMapping(file, size, false, func(m []byte) error {
				unix.Madvise(m, unix.MADV_SEQUENTIAL)
				return doubleBuffered(r, w, bufs[j], dst, size, chunk, func(b []byte, off int) error {
					copy(b, m[off:off+len(b)])
					return nil
				})
			})
		}},
		// The staging pipeline's fused pieces, without and with their
		// checksums, and two other orders of the copy and the checksum:
		// whether the copy's pieces, their stores (Go's copy stores
		// around the cache from 1 MiB up) or the checksum's pass bound
		// these loads.
		{"mapped copy 256K", mappedCopy(256<<10, sumNone)},
		{"mapped copy 256K summed", mappedCopy(256<<10, sumPieceAfter)},
		{"mapped copy 1M source summed", mappedCopy(1<<20, sumSourceFirst)},
		{"mapped copy 4M summed after", mappedCopy(chunk, sumPieceAfter)},
		{"pread", func(w *cuda.Worker, j int, file string, dst uintptr) error {
			f, err := os.Open(file)
			if err != nil {
				return err
			}
			defer f.Close()
			return doubleBuffered(r, w, bufs[j], dst, size, chunk, func(b []byte, off int) error {
				_, err := f.ReadAt(b, int64(off))
				return err
			})
		}},
		{"pageable DMA", func(w *cuda.Worker, j int, file string, dst uintptr) error {
			return withMapping(file, size, false, func(m []byte) error {
				if err := r.CopyH2D(dst, uintptr(unsafe.Pointer(&m[0])), uintptr(size), w.Stream()); err != nil {
					return err
				}
				return r.Sync(w.Stream())
			})
		}},
		{"registered on the path", func(w *cuda.Worker, j int, file string, dst uintptr) error {
			return withMapping(file, size, true, func(m []byte) error {
				if err := r.HostRegister(m); err != nil {
					return err
				}
				err := r.CopyH2D(dst, uintptr(unsafe.Pointer(&m[0])), uintptr(size), w.Stream())
				if err == nil {
					err = r.Sync(w.Stream())
				}
				return errorsJoin(err, r.HostUnregister(m))
			})
		}},
	}
	if kern != nil {
		paths = append(paths, path{"kernel from the mapping", func(w *cuda.Worker, j int, file string, dst uintptr) error {
			return withMapping(file, size, false, func(m []byte) error {
				var c cuda.Copies
				src := uintptr(unsafe.Pointer(&m[0]))
				for off := 0; off < size; off += chunk {
					c.Add(dst+uintptr(off), src+uintptr(off), chunk)
				}
				if err := kern.Launch(&c, tables[j].Bytes(), w.Stream()); err != nil {
					return err
				}
				return r.Sync(w.Stream())
			})
		}})
	} else {
		rep.printf("kernel from the mapping: not run, the device cannot read pageable memory")
	}

	if only := os.Getenv("KVHOST_GPU_PATHS"); only != "" {
		var picked []path
		for _, name := range strings.Split(only, ",") {
			i := slices.IndexFunc(paths, func(p path) bool { return p.name == name })
			if i < 0 {
				t.Fatalf("KVHOST_GPU_PATHS: no path %q", name)
			}
			picked = append(picked, paths[i])
		}
		paths = picked
	}
	for round := range envInt(t, "KVHOST_GPU_ROUNDS", 2) {
		order := make([]path, len(paths))
		for i := range paths {
			order[i] = paths[i]
			if round%2 == 1 {
				order[i] = paths[len(paths)-1-i]
			}
		}
		for _, p := range order {
			salt := uint64(round*100+len(p.name)) ^ uint64(time.Now().UnixNano())
			names := writePatternFiles(t, dir, files, size, jobs, salt)
			var before, after syscall.Rusage
			syscall.Getrusage(syscall.RUSAGE_SELF, &before)
			took, err := parallel(files, jobs, func(j, i int) error {
				return ws[j].Do(context.Background(), func(w *cuda.Worker) error {
					if err := p.load(w, j, names[i], dev.Ptr()+uintptr(i)*uintptr(size)); err != nil {
						return fmt.Errorf("%s: file %d: %w", p.name, i, err)
					}
					return nil
				})
			})
			syscall.Getrusage(syscall.RUSAGE_SELF, &after)
			if err != nil {
				t.Fatal(err)
			}
			wrong := 0
			if err := ws[0].Do(context.Background(), func(w *cuda.Worker) error {
				for i := range files {
					if err := r.CopyD2H(check.Ptr(), dev.Ptr()+uintptr(i)*uintptr(size), uintptr(size), w.Stream()); err != nil {
						return err
					}
					if err := r.Sync(w.Stream()); err != nil {
						return err
					}
					if !patternHolds(check.Bytes(), i, salt) {
						wrong++
					}
				}
				return nil
			}); err != nil {
				t.Fatal(err)
			}
			total := int64(files) * int64(size)
			gb := float64(total) / 1e9
			user := float64(after.Utime.Nano()-before.Utime.Nano()) / 1e6 / gb
			sys := float64(after.Stime.Nano()-before.Stime.Nano()) / 1e6 / gb
			rep.printf("round %d %-30s %6.1f GB/s  CPU %4.0f ms/GB user, %4.0f kernel  (%d files of %d MiB, %d jobs)",
				round, p.name, gbps(total, took), user, sys, files, size>>20, jobs)
			if wrong != 0 {
				t.Errorf("%s: %d of %d files differ on the device", p.name, wrong, files)
			}
			for _, n := range names {
				os.Remove(n)
			}
		}
	}
}

// sumOrder is where a mapped copy's checksum reads the bytes: nowhere,
// each piece of the pinned buffer right after its copy, or each piece of
// the mapping right before its copy.
type sumOrder int

const (
	sumNone sumOrder = iota
	sumPieceAfter
	sumSourceFirst
)

// withMapping maps file's first size bytes shared (read-write with
// MAP_POPULATE where populate is set, as the registrar maps, else read
// only) and calls fn with the mapping.
func withMapping(file string, size int, populate bool, fn func([]byte) error) error {
	mode, prot, flags := unix.O_RDONLY, unix.PROT_READ, unix.MAP_SHARED
	if populate {
		mode, prot, flags = unix.O_RDWR, unix.PROT_READ|unix.PROT_WRITE, flags|unix.MAP_POPULATE
	}
	fd, err := unix.Open(file, mode|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	m, err := unix.Mmap(fd, 0, size, prot, flags)
	if err != nil {
		return err
	}
	return errorsJoin(fn(m), unix.Munmap(m))
}

// doubleBuffered fills chunk-sized pieces of a size-byte load with fill,
// alternating between two pinned buffers, and copies each to dst+offset
// on w's stream, waiting before it refills a buffer for that buffer's
// copy to end.
func doubleBuffered(r *cuda.Runtime, w *cuda.Worker, bufs [2]*cuda.Pinned, dst uintptr, size, chunk int, fill func(b []byte, off int) error) error {
	var evs [2]cuda.Event
	for k := range evs {
		e, err := r.NewEvent()
		if err != nil {
			return err
		}
		defer r.DestroyEvent(e)
		evs[k] = e
	}
	for off, k := 0, 0; off < size; off, k = off+chunk, k+1 {
		b := k % 2
		if k >= 2 {
			if err := r.Wait(evs[b]); err != nil {
				return err
			}
		}
		if err := fill(bufs[b].Bytes()[:chunk], off); err != nil {
			return err
		}
		if err := r.CopyH2D(dst+uintptr(off), bufs[b].Ptr(), uintptr(chunk), w.Stream()); err != nil {
			return err
		}
		if err := r.Record(evs[b], w.Stream()); err != nil {
			return err
		}
	}
	return r.Sync(w.Stream())
}

// patternWord is word w of file i's content under salt.
func patternWord(i, w int, salt uint64) uint64 {
	return (uint64(i)<<40 | uint64(w)) ^ salt*0x9e3779b97f4a7c15
}

// patternHolds reports whether b holds file i's content: every 509th word
// and the last.
func patternHolds(b []byte, i int, salt uint64) bool {
	last := len(b)/8 - 1
	for w := 0; w < last; w += 509 {
		if binary.LittleEndian.Uint64(b[w*8:]) != patternWord(i, w, salt) {
			return false
		}
	}
	return binary.LittleEndian.Uint64(b[last*8:]) == patternWord(i, last, salt)
}

// writePatternFiles writes files files of size bytes into dir with jobs
// writers (write(2), never mapped: their pages are in the page cache and
// in no page table, as a restarted daemon finds them) and returns their
// paths.
func writePatternFiles(t *testing.T, dir string, files, size, jobs int, salt uint64) []string {
	t.Helper()
	names := make([]string, files)
	for i := range names {
		names[i] = filepath.Join(dir, fmt.Sprintf("f%05d", i))
	}
	bufs := make([][]byte, jobs)
	if _, err := parallel(files, jobs, func(j, i int) error {
		if bufs[j] == nil {
			bufs[j] = make([]byte, size)
		}
		for w := 0; w*8 < size; w++ {
			binary.LittleEndian.PutUint64(bufs[j][w*8:], patternWord(i, w, salt))
		}
		return os.WriteFile(names[i], bufs[j], 0o600)
	}); err != nil {
		t.Fatal(err)
	}
	return names
}

// envInt is the positive integer in environment variable k, or def.
func envInt(t *testing.T, k string, def int) int {
	t.Helper()
	v := os.Getenv(k)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		t.Fatalf("%s=%q: want a positive integer", k, v)
	}
	return n
}
