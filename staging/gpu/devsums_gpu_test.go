package gpu

import (
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/crc32c"
	"github.com/kvhost/kvhost/internal/testwait"
)

// TestGPUSumKernel checks the checksum kernel on a real GPU (KVHOST_GPU=1):
// the registers of spans of many lengths against crc32c.Register, its
// speed over a 32 MiB key's 512 spans of 64 KiB beside one CPU core's
// CRC of the same bytes, and round trips of the mover with checksums on
// the device, through the pinned buffers and through a registered file,
// bytes and checksums compared with the CPU's.
func TestGPUSumKernel(t *testing.T) {
	needGPU(t)
	rep := newReport(t, ".sums")
	r, w := openGPU(t, envCUDA())
	ctx := context.Background()
	const size = 64 << 20
	rng := rand.New(rand.NewPCG(7, 8))
	err := w.Do(ctx, func(w *cuda.Worker) error {
		k, err := r.LoadSumKernel()
		if err != nil {
			return err
		}
		defer k.Unload()
		dev, err := r.Malloc(0, size)
		if err != nil {
			return err
		}
		defer dev.Close()
		host, err := r.HostAlloc(size + 65536*cuda.SumEntryBytes)
		if err != nil {
			return err
		}
		defer host.Free()
		data, table := host.Bytes()[:size], host.Bytes()[size:]
		for i := range data {
			data[i] = byte(rng.Uint32())
		}
		if err := r.CopySync(dev.Ptr(), host.Ptr(), size); err != nil {
			return err
		}
		// Spans of chosen and random lengths at random aligned offsets.
		lens := []int{16, 32, 48, 4080, 4096, 4112, 8192, 32 << 10, 64<<10 - 16, 64 << 10}
		for range 2000 {
			lens = append(lens, (1+rng.IntN(cuda.SumMaxLen/16))*16)
		}
		spans := make([]cuda.SumSpan, len(lens))
		for i, n := range lens {
			off := rng.IntN((size-n)/16) * 16
			spans[i] = cuda.SumSpan{Addr: dev.Ptr() + uintptr(off), Len: n}
		}
		if err := k.Launch(spans, table, w.Stream()); err != nil {
			return err
		}
		if err := r.Sync(w.Stream()); err != nil {
			return err
		}
		bad := 0
		for i, sp := range spans {
			off := sp.Addr - dev.Ptr()
			if got, want := cuda.SumRegister(table, i), crc32c.Register(data[off:off+uintptr(sp.Len)]); got != want {
				if bad++; bad <= 5 {
					t.Errorf("span %d (%d bytes at %d): register %#x, want %#x", i, sp.Len, off, got, want)
				}
			}
		}
		rep.printf("checksum kernel: %d spans of 16 B to 64 KiB, %d registers differ from the CPU's", len(spans), bad)

		// Speed: a 32 MiB key in 512 spans of 64 KiB, best of 20.
		key := make([]cuda.SumSpan, 512)
		for i := range key {
			key[i] = cuda.SumSpan{Addr: dev.Ptr() + uintptr(i)*(64<<10), Len: 64 << 10}
		}
		best := time.Duration(1 << 62)
		for range 20 {
			start := time.Now()
			if err := k.Launch(key, table, w.Stream()); err != nil {
				return err
			}
			if err := r.Sync(w.Stream()); err != nil {
				return err
			}
			best = min(best, time.Since(start))
		}
		start := time.Now()
		crc32c.Checksum(data[:32<<20])
		cpu := time.Since(start)
		rep.printf("checksum kernel, 32 MiB in 512 spans of 64 KiB: %.1f GB/s (%.0f µs, launch to synchronized); one CPU core: %.1f GB/s", gbps(32<<20, best), float64(best.Microseconds()), gbps(32<<20, cpu))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	// The mover, checksums on the device, files on a memory mount.
	dir := benchDir(t, "sums")
	g := llama8B()
	g.numBlocks = 32
	kv := newCache(t, w, g)
	orig := kv.randomize(t, w, 3)
	host := hostCopies(kv, orig)
	m, err := New(Config{Runtime: r, Devices: []int{0}, RegisterFiles: 16, SumsOnDevice: true})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	p := kv.plan(keyBlocks(rand.New(rand.NewPCG(9, 9)), g.numBlocks, g.blocksPerKey), false)
	p.Memory = true
	wantFile, wantSums := expect(p, host)
	path := filepath.Join(dir, "key")
	f, err := fsys.OS{}.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, registered := range []bool{false, true} {
		if registered {
			testwait.Until(t, "the key file registered", testwait.Hang, func() bool { return m.FileStats().Files == 1 })
		}
		sums := make([]uint32, p.Sums)
		if _, err := m.WriteFile(ctx, f, p, sums); err != nil {
			t.Fatalf("registered %v: WriteFile: %v", registered, err)
		}
		got := make([]byte, len(wantFile))
		if _, err := f.ReadAt(got, int64(g.headerBytes)); err != nil {
			t.Fatal(err)
		}
		if string(got) != string(wantFile) || !equal(sums, wantSums) {
			t.Fatalf("registered %v: store: bytes equal %v, checksums equal %v", registered, string(got) == string(wantFile), equal(sums, wantSums))
		}
		kv.poison(t, w)
		sums = make([]uint32, p.Sums)
		if _, err := m.ReadFile(ctx, f, p, sums); err != nil {
			t.Fatalf("registered %v: ReadFile: %v", registered, err)
		}
		if !equal(sums, wantSums) {
			t.Fatalf("registered %v: load checksums %x, want %x", registered, sums, wantSums)
		}
		for l := range g.layers {
			dev := kv.get(t, w, l)
			for _, x := range p.Extents {
				if x.Region == kv.layers[l] && string(dev[x.RegionOff:x.RegionOff+x.Len]) != string(orig[l][x.RegionOff:x.RegionOff+x.Len]) {
					t.Fatalf("registered %v: layer %d page at %d differs after the round trip", registered, l, x.RegionOff)
				}
			}
		}
		st := m.FileStats()
		rep.printf("mover, checksums on the GPU, registered %v: a 32 MiB key stored and loaded, bytes and checksums equal (direct stores %d, loads %d)", registered, st.Stores, st.Loads)
	}
}
