package gpu

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/cuda"
)

// TestGPURegistrationThreads measures how fast files already in a memory
// file system's page cache are mapped and registered with CUDA, as the
// registrar does, by 1, 2, 4 and 8 threads at once: whether several
// registrar threads register files faster or the driver serializes them,
// and what MAP_POPULATE before the registration costs or saves. 1 GiB of
// files of 2 MiB and of 32 MiB on KVHOST_GPU_TMPFS, two rounds with the
// thread counts in opposite orders, each mapping checked to hold its own
// file. KVHOST_GPU=1 runs it (KVHOST_GPU_CUDART: another CUDA runtime,
// such as the fake one).
func TestGPURegistrationThreads(t *testing.T) {
	needGPU(t)
	rep := newReport(t, "")
	r, _ := openGPU(t, envCUDA())
	dir := benchDir(t, "regrate")
	const total = 1 << 30
	for _, size := range []int{2 << 20, 32 << 20} {
		paths := make([]string, total/size)
		page := make([]byte, size)
		for i := range paths {
			paths[i] = filepath.Join(dir, fmt.Sprintf("f%05d-%d", i, size))
			page[0] = byte(i)
			if err := os.WriteFile(paths[i], page, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		for round, order := range [][]int{{1, 2, 4, 8}, {8, 4, 2, 1}} {
			for _, threads := range order {
				for _, populate := range []bool{true, false} {
					reg, unreg := registerFiles(t, r, paths, size, threads, populate)
					rep.printf("register %4d files of %2d MiB, %d threads, populate %-5v round %d: %6.2f GB/s (%5.0f files/s), unregister %6.2f GB/s",
						len(paths), size>>20, threads, populate, round, gbps(total, reg), float64(len(paths))/reg.Seconds(), gbps(total, unreg))
				}
			}
		}
		for _, p := range paths {
			os.Remove(p)
		}
	}
}

// registerFiles maps and registers every file (MAP_POPULATE where
// populate is set, as the registrar does, then cudaHostRegister) with
// threads threads, each call on a locked thread with device 0 current,
// checks that each mapping holds its file, then unregisters and unmaps
// them all; it returns the two phases' wall times.
func registerFiles(t *testing.T, r *cuda.Runtime, paths []string, size, threads int, populate bool) (reg, unreg time.Duration) {
	t.Helper()
	mems := make([][]byte, len(paths))
	defer func() { // on a failure, what is still registered
		for _, mem := range mems {
			if mem != nil {
				r.HostUnregister(mem)
				unix.Munmap(mem)
			}
		}
	}()
	// Each call on a thread locked with device 0 current (a few
	// microseconds, against the milliseconds of a registration).
	phase := func(fn func(i int) error) time.Duration {
		d, err := parallel(len(paths), threads, func(_, i int) error {
			unlock, err := r.LockDevice(0)
			if err != nil {
				return err
			}
			defer unlock()
			return fn(i)
		})
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	reg = phase(func(i int) error {
		fd, err := unix.Open(paths[i], unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open %s: %w", paths[i], err)
		}
		defer unix.Close(fd)
		flags := unix.MAP_SHARED
		if populate {
			flags |= unix.MAP_POPULATE
		}
		mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, flags)
		if err != nil {
			return fmt.Errorf("map %s: %w", paths[i], err)
		}
		if err := r.HostRegister(mem); err != nil {
			unix.Munmap(mem)
			return fmt.Errorf("register %s: %w", paths[i], err)
		}
		mems[i] = mem
		return nil
	})
	for i, mem := range mems {
		if mem[0] != byte(i) {
			t.Fatalf("file %d maps byte %d, want %d", i, mem[0], byte(i))
		}
	}
	unreg = phase(func(i int) error {
		err := errorsJoin(r.HostUnregister(mems[i]), unix.Munmap(mems[i]))
		mems[i] = nil
		return err
	})
	return reg, unreg
}
