package gpu

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestGPURegistrationRate measures what registering tmpfs files with CUDA
// costs, the registrar's work after a burst of stores into fresh files:
// 64 files of 32 MiB, written first, then each mapped (MAP_POPULATE) and
// registered (cudaHostRegister) by 1, 2, 4 and 8 threads at once, each
// thread with the device current, and unregistered again. It reports the
// files per second and the time split between mapping and registering, so
// that whether the registrar would gain from more threads is measured, not
// guessed. Every registration must succeed. KVHOST_GPU=1 runs it (the
// directory is KVHOST_GPU_TMPFS, default /dev/shm); KVHOST_GPU_FAKE=1 runs
// it on the fake CUDA library.
func TestGPURegistrationRate(t *testing.T) {
	needGPU(t)
	rep := newReport(t, ".register")
	r, _ := openGPU(t, benchCUDA(t))
	base := os.Getenv("KVHOST_GPU_TMPFS")
	if base == "" {
		base = "/dev/shm"
	}
	dir, err := os.MkdirTemp(base, "kvhost-register-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	const files, size = 64, 32 << 20
	block := make([]byte, 1<<20)
	for i := range block {
		block[i] = byte(i * 7)
	}
	paths := make([]string, files)
	for i := range paths {
		paths[i] = filepath.Join(dir, fmt.Sprintf("f%03d", i))
		f, err := os.Create(paths[i])
		if err != nil {
			t.Fatal(err)
		}
		for off := 0; off < size; off += len(block) {
			if _, err := f.Write(block); err != nil {
				t.Fatal(err)
			}
		}
		f.Close()
	}
	for _, threads := range []int{1, 2, 4, 8} {
		var mapped, registered time.Duration
		var mu sync.Mutex
		var wg sync.WaitGroup
		errs := make(chan error, files)
		next := make(chan string, files)
		for _, p := range paths {
			next <- p
		}
		close(next)
		start := time.Now()
		for range threads {
			wg.Add(1)
			go func() {
				defer wg.Done()
				unlock, err := r.LockDevice(0)
				if err != nil {
					errs <- err
					return
				}
				defer unlock()
				for p := range next {
					fd, err := unix.Open(p, unix.O_RDWR|unix.O_CLOEXEC, 0)
					if err != nil {
						errs <- err
						return
					}
					t0 := time.Now()
					mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
					unix.Close(fd)
					if err != nil {
						errs <- err
						return
					}
					t1 := time.Now()
					if err := r.HostRegister(mem); err != nil {
						unix.Munmap(mem)
						errs <- err
						return
					}
					t2 := time.Now()
					mu.Lock()
					mapped += t1.Sub(t0)
					registered += t2.Sub(t1)
					mu.Unlock()
					if err := r.HostUnregister(mem); err != nil {
						errs <- err
					}
					unix.Munmap(mem)
				}
			}()
		}
		wg.Wait()
		wall := time.Since(start)
		close(errs)
		for err := range errs {
			t.Fatalf("%d threads: %v", threads, err)
		}
		rep.printf("register %d files of 32 MiB, %d threads: %.0f files/s (%.1f GB/s) wall %v; per file: map %v, register %v (unregistering included in wall)",
			files, threads, float64(files)/wall.Seconds(), gbps(int64(files)*size, wall), wall.Round(time.Millisecond),
			(mapped / files).Round(time.Microsecond), (registered / files).Round(time.Microsecond))
	}
}
