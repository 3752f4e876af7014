package gpu

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvhost/kvhost/cuda"
)

// TestGPUSegmentCopyRates measures host-to-device copy rates from pinned
// memory by the shape of the copies, against one contiguous copy of the
// same bytes in the same run: pieces of 4 MiB, 1 MiB and 32 KiB (one
// paged-cache block of a Llama-8B-like layer: 16 tokens × 8 heads × 128 ×
// 2 bytes), to their own places or to shuffled blocks, in one batch on
// one stream or cut into per-file batches spread over several streams (as
// a layer-range load over many files runs), and with one
// cudaMemcpyAsync per piece. KVHOST_GPU=1 runs it (KVHOST_GPU_FAKE=1 on
// the fake CUDA library).
func TestGPUSegmentCopyRates(t *testing.T) {
	needGPU(t)
	rep := newReport(t, ".segrate")
	const (
		total = 512 << 20
		block = 32 << 10
		area  = 2 * total // destinations are shuffled over twice the bytes
	)
	rig := newCopyRig(t, area, total, 16)
	r, dev, host, streams := rig.r, rig.dev, rig.host, rig.streams
	slots := rand.New(rand.NewPCG(1, 2)).Perm(area / block)

	// copies lists piece-sized copies of the whole host buffer, each to its
	// own offset or (shuffle) to a shuffled block-sized slot's offset.
	copies := func(piece int, shuffle bool) *cuda.Copies {
		var c cuda.Copies
		for off := 0; off < total; off += piece {
			dst := dev.Ptr() + uintptr(off)
			if shuffle {
				dst = dev.Ptr() + uintptr(slots[off/block]*block)
			}
			c.Add(dst, host.Ptr()+uintptr(off), uintptr(piece))
		}
		return &c
	}
	// run enqueues c in batches of per copies, round robin over n streams,
	// and waits for them all.
	run := func(c *cuda.Copies, per, n int, mode cuda.CopyMode) (time.Duration, time.Duration) {
		start := time.Now()
		var part cuda.Copies
		for i, k := 0, 0; i < c.Len(); i, k = i+per, k+1 {
			j := min(c.Len(), i+per)
			part.Dst, part.Src, part.Size = c.Dst[i:j], c.Src[i:j], c.Size[i:j]
			if err := r.Enqueue(&part, true, mode, streams[k%n]); err != nil {
				t.Fatal(err)
			}
		}
		enq := time.Since(start)
		for _, s := range streams[:n] {
			if err := r.Sync(s); err != nil {
				t.Fatal(err)
			}
		}
		return time.Since(start), enq
	}
	one := &cuda.Copies{}
	one.Add(dev.Ptr(), host.Ptr(), total)
	cases := []struct {
		name   string
		c      *cuda.Copies
		per, n int
		mode   cuda.CopyMode
	}{
		{"contiguous, one copy", one, 1, 1, cuda.CopyAuto},
		{"4 MiB pieces, one batch", copies(4<<20, false), 1 << 20, 1, cuda.CopyAuto},
		{"1 MiB pieces, one batch", copies(1<<20, false), 1 << 20, 1, cuda.CopyAuto},
		{"32 KiB in place, one batch", copies(block, false), 1 << 20, 1, cuda.CopyAuto},
		{"32 KiB shuffled, one batch", copies(block, true), 1 << 20, 1, cuda.CopyAuto},
		{"32 KiB shuffled, 128/batch, 1 stream", copies(block, true), 128, 1, cuda.CopyAuto},
		{"32 KiB shuffled, 128/batch, 4 streams", copies(block, true), 128, 4, cuda.CopyAuto},
		{"32 KiB shuffled, 128/batch, 16 streams", copies(block, true), 128, 16, cuda.CopyAuto},
		{"32 KiB shuffled, 32/batch, 16 streams", copies(block, true), 32, 16, cuda.CopyAuto},
		{"1 MiB pieces, 4/batch, 16 streams", copies(1<<20, false), 4, 16, cuda.CopyAuto},
		{"32 KiB shuffled, per-piece async", copies(block, true), 1 << 20, 1, cuda.CopySegments},
	}
	for pass := range 3 {
		var base float64
		for _, c := range cases {
			d, enq := run(c.c, c.per, c.n, c.mode)
			g := gbps(total, d)
			if base == 0 {
				base = g
			}
			rep.printf("pass %d %-40s %5.1f GB/s (%.2f of contiguous), enqueue %6.2f ms", pass, c.name, g, g/base, float64(enq.Microseconds())/1e3)
		}
	}
}

// copyRig is what a copy-rate test copies with: the runtime, the test's
// goroutine locked to device 0, device memory, a pinned host buffer and
// streams, all released when the test ends.
type copyRig struct {
	r       *cuda.Runtime
	dev     *cuda.DeviceMemory
	host    *cuda.Pinned
	streams []cuda.Stream
}

// newCopyRig opens the benchmark's runtime and makes a copyRig of
// devBytes of device memory, hostBytes of pinned memory and n streams.
func newCopyRig(t *testing.T, devBytes int64, hostBytes, n int) *copyRig {
	t.Helper()
	r, _ := openGPU(t, benchCUDA(t))
	unlock, err := r.LockDevice(0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(unlock)
	rig := &copyRig{r: r, streams: make([]cuda.Stream, n)}
	if rig.dev, err = r.Malloc(0, devBytes); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rig.dev.Close() })
	if rig.host, err = r.HostAlloc(hostBytes); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rig.host.Free() })
	for i := range rig.streams {
		if rig.streams[i], err = r.NewStream(); err != nil {
			t.Fatal(err)
		}
		s := rig.streams[i]
		t.Cleanup(func() { r.DestroyStream(s) })
	}
	return rig
}
