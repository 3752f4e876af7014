package gpu

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/cuda"
)

// TestGPURegistrationBesideCopies measures whether registering memory
// with CUDA holds up the copies other streams have in flight, which is
// what the registrar's rule of waiting only for jobs through the pinned
// buffers assumes it does not do much of: 8 workers, each on its own
// stream, copy 6 GiB from pinned memory to the device in back-to-back
// copies of 32 MiB (then of 4 MiB, the pipeline's chunk), with nothing
// beside them, and while one more thread maps, registers, unregisters
// and unmaps files of 2 MiB or of 32 MiB on KVHOST_GPU_TMPFS one after
// another, as the registrar does, timing its register and unregister
// calls; then that thread alone for a fixed number of files, for the
// registrations' own rate with no copies beside them. Two rounds per copy size, the order turned each
// round. Every registration must succeed and map its own file, and each
// device buffer must hold its worker's bytes at the end. KVHOST_GPU=1
// runs it.
func TestGPURegistrationBesideCopies(t *testing.T) {
	needGPU(t)
	rep := newReport(t, "")
	r, _ := openGPU(t, envCUDA())
	dir := benchDir(t, "regstall")
	files := registrationFiles(t, dir)

	const workers, n = 8, 32 << 20
	ws := make([]*cuda.Worker, workers)
	host := make([]*cuda.Pinned, workers)
	dev := make([]*cuda.DeviceMemory, workers)
	for i := range ws {
		w, err := r.NewWorker(0)
		if err != nil {
			t.Fatal(err)
		}
		defer w.Close()
		ws[i] = w
		if err := w.Do(context.Background(), func(w *cuda.Worker) error {
			if host[i], err = r.HostAlloc(n); err != nil {
				return err
			}
			dev[i], err = r.Malloc(0, n)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		defer host[i].Free()
		defer dev[i].Close()
		b := host[i].Bytes()[:n]
		for j := range b {
			b[j] = byte(i + j)
		}
	}

	// copyFor copies perWorker bytes from every worker's pinned buffer to
	// its device buffer, size bytes at a time, one synchronized copy after
	// another, and returns the bytes copied and the time it took.
	copyFor := func(perWorker int64, size int) (int64, time.Duration) {
		copies := int(perWorker / int64(size))
		errs := make([]error, workers)
		var wg sync.WaitGroup
		start := time.Now()
		for i, w := range ws {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[i] = w.Do(context.Background(), func(w *cuda.Worker) error {
					for range copies {
						if err := r.CopyH2D(dev[i].Ptr(), host[i].Ptr(), uintptr(size), w.Stream()); err != nil {
							return err
						}
						if err := r.Sync(w.Stream()); err != nil {
							return err
						}
					}
					return nil
				})
			}()
		}
		wg.Wait()
		took := time.Since(start)
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
		return int64(workers*copies) * int64(size), took
	}

	// Each phase moves 6 GiB per worker (about a second on the H100);
	// the warm-up 1 GiB.
	const perWorker = 6 << 30
	copyFor(1<<30, n)
	type result struct {
		st  registered
		err error
	}
	// perCall says a thread's registrations a second over took and the
	// mean time of each register and unregister call.
	perCall := func(st registered, took time.Duration) string {
		n := time.Duration(max(st.n, 1))
		return fmt.Sprintf("%.0f registrations/s (register %v, unregister %v each)",
			float64(st.n)/took.Seconds(), (st.reg / n).Round(time.Microsecond), (st.unreg / n).Round(time.Microsecond))
	}
	// registerFor registers count files of size in turn, with nothing
	// beside it, and says how fast.
	registerFor := func(size, count int) string {
		start := time.Now()
		st, err := registerInTurn(r, files[size], size, nil, count)
		if err != nil {
			t.Fatal(err)
		}
		return perCall(st, time.Since(start))
	}
	// alone is how many files of each size registerFor registers (about
	// a second each on the H100).
	alone := map[int]int{2 << 20: 2000, 32 << 20: 200}
	beside := []int{0, 2 << 20, 32 << 20}
	round := 0
	// Copies of 32 MiB, then of 4 MiB (the pipeline's default chunk): a
	// registration that waited for the copies in flight would take
	// about one copy's time, and so less beside the shorter copies.
	for _, copySize := range []int{n, 4 << 20} {
		for range 2 {
			for k := range beside {
				size := beside[(k+round)%len(beside)]
				stop := make(chan struct{})
				done := make(chan result, 1)
				if size > 0 {
					go func() {
						st, err := registerInTurn(r, files[size], size, stop, 0)
						done <- result{st, err}
					}()
				}
				moved, took := copyFor(perWorker, copySize)
				close(stop)
				what, rate := "nothing", ""
				if size > 0 {
					res := <-done
					if res.err != nil {
						t.Fatal(res.err)
					}
					what = fmt.Sprintf("registrations of %d MiB", size>>20)
					rate = ": " + perCall(res.st, took)
				}
				rep.printf("copies H2D, %d streams of %2d MiB, round %d, beside %-26s %6.2f GB/s%s", workers, copySize>>20, round, what+":", gbps(moved, took), rate)
			}
			for _, size := range beside[1:] {
				rep.printf("registrations of %2d MiB, round %d, with no copies beside them: %s", size>>20, round, registerFor(size, alone[size]))
			}
			round++
		}
	}

	// Every device buffer holds its worker's bytes.
	check, err := r.HostAlloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer check.Free()
	for i, w := range ws {
		if err := w.Do(context.Background(), func(w *cuda.Worker) error {
			if err := r.CopyD2H(check.Ptr(), dev[i].Ptr(), n, w.Stream()); err != nil {
				return err
			}
			return r.Sync(w.Stream())
		}); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(check.Bytes()[:n], host[i].Bytes()[:n]) {
			t.Fatalf("device buffer %d does not hold its worker's bytes", i)
		}
	}
}

// registered is what registerInTurn did: how many files it registered
// and the time spent in the register and the unregister calls.
type registered struct {
	n          int
	reg, unreg time.Duration
}

// registerInTurn maps and registers the files of size in turn, then
// unregisters and unmaps each, on a thread with device 0 current, as the
// registrar does, until stop is closed or, if count > 0, count files are
// done. Each mapping must hold its file's first byte (the file's index).
func registerInTurn(r *cuda.Runtime, paths []string, size int, stop <-chan struct{}, count int) (st registered, err error) {
	unlock, err := r.LockDevice(0)
	if err != nil {
		return st, err
	}
	defer unlock()
	for ; count <= 0 || st.n < count; st.n++ {
		select {
		case <-stop:
			return st, nil
		default:
		}
		i := st.n % len(paths)
		fd, err := unix.Open(paths[i], unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return st, err
		}
		mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
		unix.Close(fd)
		if err != nil {
			return st, err
		}
		t0 := time.Now()
		err = r.HostRegister(mem)
		st.reg += time.Since(t0)
		if err == nil && mem[0] != byte(i) {
			err = fmt.Errorf("%s maps byte %d, want %d", paths[i], mem[0], byte(i))
		}
		if err == nil {
			t0 = time.Now()
			err = r.HostUnregister(mem)
			st.unreg += time.Since(t0)
		}
		if err = errors.Join(err, unix.Munmap(mem)); err != nil {
			return st, err
		}
	}
	return st, nil
}

// registrationFiles writes 256 MiB of files of each size (2 MiB and
// 32 MiB) in dir for registerInTurn, file i's first byte i.
func registrationFiles(t *testing.T, dir string) map[int][]string {
	t.Helper()
	files := map[int][]string{}
	for _, size := range []int{2 << 20, 32 << 20} {
		page := make([]byte, size)
		for i := range (256 << 20) / size {
			p := filepath.Join(dir, fmt.Sprintf("f%03d-%d", i, size))
			page[0] = byte(i)
			if err := os.WriteFile(p, page, 0o644); err != nil {
				t.Fatal(err)
			}
			files[size] = append(files[size], p)
		}
	}
	return files
}

// TestGPURegisteredJobsBesideRegistrations measures what registrations
// cost the jobs the registrar does not wait for, those on registered
// files (one batch of copies per job): 16 jobs load 128 registered keys
// of 32 MiB through the mover, ten times over (40 GiB), with nothing
// beside them and while one more thread registers and unregisters tmpfs
// files of 2 MiB or 32 MiB as the registrar does (registerInTurn).
// Three rounds, the order turned each round. Every load must move its
// file directly, and every loaded page must hold its bytes at the end.
// KVHOST_GPU=1 runs it.
func TestGPURegisteredJobsBesideRegistrations(t *testing.T) {
	needGPU(t)
	rep := newReport(t, "")
	r, w := openGPU(t, envCUDA())
	g := llama8B()
	kv := newCache(t, w, g)
	orig := kv.randomize(t, w, 1)
	dir := benchDir(t, "regjobs")
	gk := g
	gk.blocksPerKey = 16
	const keys, jobs = 128, 16
	plans, paths := keyFiles(kv, gk, dir, keys, 9, false)
	for _, p := range plans {
		p.Memory = true
	}
	m, err := New(Config{Runtime: r, Devices: []int{0}, MaxStaging: jobs * 2 * (8<<20 + 2*align), RegisterFiles: keys})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	registerAll(t, m, paths, plans, jobs, "keys to load")
	files := registrationFiles(t, benchDir(t, "regjobs-other"))
	keyBytes := int64(gk.layers * gk.blocksPerKey * gk.pageBytes)

	// loadFor loads every key count times over (10 times, 40 GiB, is
	// about a second on the H100).
	passes := 0
	loadFor := func(count int) float64 {
		start := time.Now()
		for range count {
			if _, err := moverPass(m, paths, plans, jobs, false, false); err != nil {
				t.Fatal(err)
			}
		}
		passes += count
		return gbps(keyBytes*keys*int64(count), time.Since(start))
	}
	before := m.FileStats()
	beside := []int{0, 2 << 20, 32 << 20}
	for round := range 3 {
		for k := range beside {
			size := beside[(k+round)%len(beside)]
			stop := make(chan struct{})
			type result struct {
				st  registered
				err error
			}
			done := make(chan result, 1)
			start := time.Now()
			if size > 0 {
				go func() {
					st, err := registerInTurn(r, files[size], size, stop, 0)
					done <- result{st, err}
				}()
			}
			rate := loadFor(10)
			took := time.Since(start)
			close(stop)
			what, regs := "nothing", ""
			if size > 0 {
				res := <-done
				if res.err != nil {
					t.Fatal(res.err)
				}
				what = fmt.Sprintf("registrations of %d MiB", size>>20)
				regs = fmt.Sprintf(": %.0f registrations/s", float64(res.st.n)/took.Seconds())
			}
			rep.printf("loads of registered files, %d jobs of 32 MiB, round %d, beside %-26s %6.2f GB/s%s", jobs, round, what+":", rate, regs)
		}
	}
	kv.poison(t, w)
	if _, err := moverPass(m, paths, plans, jobs, false, false); err != nil {
		t.Fatal(err)
	}
	checkLoaded(t, kv, w, plans, orig, "after the loads beside registrations")
	if st, want := m.FileStats(), uint64((passes+1)*keys); st.Loads-before.Loads != want || st.Files != keys {
		t.Fatalf("%d loads moved their files directly, of %d; %d files registered, want %d", st.Loads-before.Loads, want, st.Files, keys)
	}
}
