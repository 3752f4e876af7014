package cuda_test

import (
	"context"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/cuda/cudatest"
	"github.com/kvhost/kvhost/internal/crc32c"
)

// TestSumKernelReadsBytesCopiedBeforeIt: a launch enqueued after a copy on
// the same stream checksums the copied bytes (the fake runs ops in stream
// order, as the GPU does), each span's register in its entry; spans the
// kernel cannot take are refused before the driver sees them.
func TestSumKernelReadsBytesCopiedBeforeIt(t *testing.T) {
	r, fake := open(t)
	w := worker(t, r, 0)
	const size = 256 << 10
	err := w.Do(context.Background(), func(w *cuda.Worker) error {
		k, err := r.LoadSumKernel()
		if err != nil {
			return err
		}
		defer k.Unload()
		m, h, free, err := deviceAndHost(r, 2*size)
		if err != nil {
			return err
		}
		defer free()
		data := h.Bytes()[:size]
		rng := rand.New(rand.NewPCG(5, 6))
		for i := range data {
			data[i] = byte(rng.Uint32())
		}
		table := h.Bytes()[size : size+64*cuda.SumEntryBytes]
		spans := []cuda.SumSpan{
			{Addr: m.Ptr(), Len: 16},
			{Addr: m.Ptr() + 4096, Len: cuda.SumMaxLen},
			{Addr: m.Ptr() + 80<<10, Len: 4080},
			{Addr: m.Ptr() + 160<<10, Len: 32 << 10},
		}
		var cp cuda.Copies
		cp.Add(m.Ptr(), h.Ptr(), size)
		if err := r.Enqueue(&cp, true, cuda.CopySegments, w.Stream()); err != nil {
			return err
		}
		if err := k.Launch(spans, table, w.Stream()); err != nil {
			return err
		}
		if err := r.Sync(w.Stream()); err != nil {
			return err
		}
		for i, sp := range spans {
			off := sp.Addr - m.Ptr()
			if got, want := cuda.SumRegister(table, i), crc32c.Register(data[off:off+uintptr(sp.Len)]); got != want {
				t.Errorf("span %d (%d bytes at %d): register %#x, want %#x", i, sp.Len, off, got, want)
			}
		}
		launches := fake.Count(cudatest.OpLaunch)
		for _, bad := range []struct {
			name  string
			spans []cuda.SumSpan
			table []byte
		}{
			{"unaligned address", []cuda.SumSpan{{Addr: m.Ptr() + 8, Len: 16}}, table},
			{"unaligned length", []cuda.SumSpan{{Addr: m.Ptr(), Len: 24}}, table},
			{"empty span", []cuda.SumSpan{{Addr: m.Ptr(), Len: 0}}, table},
			{"too long", []cuda.SumSpan{{Addr: m.Ptr(), Len: cuda.SumMaxLen + 16}}, table},
			{"no spans", nil, table},
			{"small table", spans, table[:3*cuda.SumEntryBytes]},
			{"misaligned table", spans[:1], table[1:]},
		} {
			if err := k.Launch(bad.spans, bad.table, w.Stream()); err == nil || !strings.Contains(err.Error(), "checksum kernel") {
				t.Errorf("%s: %v, want a refusal naming the checksum kernel", bad.name, err)
			}
		}
		if fake.Count(cudatest.OpLaunch) != launches {
			t.Error("a span the kernel cannot take reached the driver")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
