package gpu

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/internal/bench"
)

// TestGPUWritesBesideDMA measures what a store's own DMA costs its file
// writes. A GPU store copies each chunk from the device into pinned host
// memory (the DMA writes host memory) while the CPU writes the previous
// chunk to the file, so the writes share host memory with the DMA; the
// write ceiling it is held to runs alone. Here 16 threads write 128 fresh
// 32 MiB files on a memory file system in 4 MiB pwrites from per-thread
// pinned buffers, as the mover does: alone, and beside a stream of
// device-to-host (and, for comparison, host-to-device) copies into a
// separate pinned region, unthrottled and at 25 GB/s (about a store's own
// rate). Each pass checks one file's bytes. KVHOST_GPU=1 runs it; the
// directory is KVHOST_GPU_TMPFS (default /dev/shm/kvhost-gpu-dma), and
// KVHOST_GPU_FAKE=1 runs it on the fake CUDA library instead.
func TestGPUWritesBesideDMA(t *testing.T) {
	needGPU(t)
	rep := newReport(t, ".dma")
	const (
		size    = 32 << 20
		chunk   = 4 << 20
		region  = 256 << 20
		threads = 16
		files   = 128
	)
	r, _ := openGPU(t, benchCUDA(t))
	unlock, err := r.LockDevice(0)
	if err != nil {
		t.Fatal(err)
	}
	dev, err := r.Malloc(0, region)
	unlock()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dev.Close() })
	pin := func(n int) *cuda.Pinned {
		p, err := r.HostAlloc(n)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.Free() })
		return p
	}
	src, other := pin(threads*2*chunk), pin(region)
	wb := src.Bytes()
	for i := range wb {
		wb[i] = byte(i*7 + 3)
	}
	dir := benchDir(t, "dma")

	pass := 0
	run := func(name string, dma int, rate float64) {
		pass++
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			os.Remove(filepath.Join(dir, e.Name()))
		}
		path := func(i int) string { return filepath.Join(dir, fmt.Sprintf("p%d-%d", pass, i)) }
		var stop atomic.Bool
		var moved atomic.Int64
		var dmaErr error
		var wg sync.WaitGroup
		c0 := bench.CPUTime()
		if dma != 0 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				dmaErr = copyUntil(r, dev, other, dma > 0, rate, &stop, &moved)
			}()
		}
		d, err := parallel(files, threads, func(j, i int) error {
			f, err := os.OpenFile(path(i), os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_DIRECT, 0o644)
			if err != nil {
				return err
			}
			defer f.Close()
			for off, k := 0, 0; off < size; off, k = off+chunk, k+1 {
				if _, err := f.WriteAt(wb[(j*2+k%2)*chunk:][:chunk], int64(off)); err != nil {
					return err
				}
			}
			return nil
		})
		stop.Store(true)
		wg.Wait()
		cpu := bench.CPUTime() - c0
		if err != nil || dmaErr != nil {
			t.Fatalf("%s: writes: %v; copies: %v", name, err, dmaErr)
		}
		// File 0 went to thread 0: its buffers 0 and 1, alternately.
		got, err := os.ReadFile(path(0))
		if err != nil {
			t.Fatal(err)
		}
		for off, k := 0, 0; off < size; off, k = off+chunk, k+1 {
			if !bytes.Equal(got[off:off+chunk], wb[(k%2)*chunk:][:chunk]) {
				t.Fatalf("%s: file 0 differs from its buffer at %d", name, off)
			}
		}
		total := int64(files) * size
		rep.printf("%-38s writes %5.1f GB/s, %4.0f CPU ms/GB; copies beside them %4.1f GB/s",
			name, gbps(total, d), bench.CPUMsPerGB(cpu, total), float64(moved.Load())/1e9/d.Seconds())
	}
	for range 3 {
		run("alone", 0, 0)
		run("beside device-to-host copies", 1, 0)
		run("beside device-to-host at 25 GB/s", 1, 25)
		run("alone", 0, 0)
		run("beside host-to-device copies", -1, 0)
		run("beside host-to-device at 25 GB/s", -1, 25)
	}
}

// copyUntil streams 4 MiB copies between dev and host (device to host when
// d2h), 16 MiB per event on each of two streams, at most rate GB/s (0: as
// fast as they go), until stop is set; moved counts the bytes completed.
func copyUntil(r *cuda.Runtime, dev *cuda.DeviceMemory, host *cuda.Pinned, d2h bool, rate float64, stop *atomic.Bool, moved *atomic.Int64) error {
	const chunk, perEvent = 4 << 20, 4
	n := min(int(dev.Len()), len(host.Bytes()))
	unlock, err := r.LockDevice(dev.Ordinal())
	if err != nil {
		return err
	}
	defer unlock()
	var streams [2]cuda.Stream
	var events [2]cuda.Event
	for i := range streams {
		if streams[i], err = r.NewStream(); err != nil {
			return err
		}
		defer r.DestroyStream(streams[i])
		if events[i], err = r.NewBlockingEvent(); err != nil {
			return err
		}
		defer r.DestroyEvent(events[i])
	}
	var pending [2]bool
	wait := func(s int) error {
		if !pending[s] {
			return nil
		}
		pending[s] = false
		if err := r.Wait(events[s]); err != nil {
			return err
		}
		moved.Add(chunk * perEvent)
		return nil
	}
	start := time.Now()
	for k := 0; !stop.Load(); k++ {
		s := k % 2
		if err := wait(s); err != nil {
			return err
		}
		if rate > 0 { // pace: wait until the bytes moved so far are due
			time.Sleep(time.Until(start.Add(time.Duration(float64(moved.Load()) / rate))))
		}
		for j := range perEvent {
			off := uintptr(((k*perEvent + j) * chunk) % n)
			if d2h {
				err = r.CopyD2H(host.Ptr()+off, dev.Ptr()+off, chunk, streams[s])
			} else {
				err = r.CopyH2D(dev.Ptr()+off, host.Ptr()+off, chunk, streams[s])
			}
			if err != nil {
				return err
			}
		}
		if err := r.Record(events[s], streams[s]); err != nil {
			return err
		}
		pending[s] = true
	}
	return errorsJoin(wait(0), wait(1))
}
