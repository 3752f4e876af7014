package crc32c

import (
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"testing"
)

// TestExtendJoinsPartsAsUpdate: the checksum of a buffer cut anywhere into
// parts, each known only by its register and length, equals Update's.
func TestExtendJoinsPartsAsUpdate(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	data := make([]byte, 300<<10)
	for i := range data {
		data[i] = byte(rng.Uint32())
	}
	for _, tc := range []struct {
		name string
		cuts []int
	}{
		{"whole", nil},
		{"empty parts", []int{0, 0, 5, 5}},
		{"one byte", []int{1}},
		{"16 KiB parts", []int{16 << 10, 32 << 10, 48 << 10, 64 << 10}},
		{"odd parts", []int{3, 1000, 4093, 70001, 200000}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, init := range []uint32{0, 0xFFFFFFFF, 0x12345678} {
				want := crc32.Update(init, crc32.MakeTable(crc32.Castagnoli), data)
				got, lo := init, 0
				for _, hi := range append(tc.cuts, len(data)) {
					got = Extend(got, Register(data[lo:hi]), int64(hi-lo))
					lo = hi
				}
				if got != want {
					t.Fatalf("init %#x: joined %#x, Update %#x", init, got, want)
				}
			}
		})
	}
}

// TestShiftIsZeroBytes: shifting a register past n bytes is feeding it n
// zero bytes, for lengths across several bits of n.
func TestShiftIsZeroBytes(t *testing.T) {
	tab := crc32.MakeTable(crc32.Castagnoli)
	for _, n := range []int64{0, 1, 2, 3, 16, 255, 4080, 4096, 65536, 100003} {
		for _, r := range []uint32{1, 0x80000000, 0xDEADBEEF} {
			want := r
			for range n {
				want = tab[byte(want)] ^ want>>8
			}
			if got := Shift(r, n); got != want {
				t.Errorf("Shift(%#x, %d) = %#x, zero bytes give %#x", r, n, got, want)
			}
		}
	}
}

// BenchmarkExtend is the cost of joining one span's register into a
// checksum (the GPU checksums' per-span work on the CPU), for the span
// lengths the mover uses most: with Extend, and with an Extender of the
// length made once (as the mover joins a run of spans of one length).
func BenchmarkExtend(b *testing.B) {
	for _, n := range []int64{16 << 10, 64 << 10, 48 << 10} {
		b.Run(fmt.Sprintf("Extend/%dKiB", n>>10), func(b *testing.B) {
			crc := uint32(0x12345678)
			for b.Loop() {
				crc = Extend(crc, 0x9ABCDEF0, n)
			}
		})
		b.Run(fmt.Sprintf("Extender/%dKiB", n>>10), func(b *testing.B) {
			crc, e := uint32(0x12345678), NewExtender(n)
			for b.Loop() {
				crc = e.Extend(crc, 0x9ABCDEF0)
			}
		})
	}
}

// TestExtenderIsExtend: an Extender of n joins a part of n bytes exactly
// as Extend does, for lengths across several bits of n, the zero Extender
// as a part of no bytes.
func TestExtenderIsExtend(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, n := range []int64{0, 1, 7, 4096, 65536, 256 << 10, 1<<20 + 13, 1 << 40} {
		e := NewExtender(n)
		if e.Len() != n {
			t.Fatalf("NewExtender(%d).Len() = %d", n, e.Len())
		}
		for range 50 {
			crc, reg := rng.Uint32(), rng.Uint32()
			if got, want := e.Extend(crc, reg), Extend(crc, reg, n); got != want {
				t.Fatalf("n %d, crc %#x, register %#x: Extender %#x, Extend %#x", n, crc, reg, got, want)
			}
		}
	}
	var zero Extender
	for _, crc := range []uint32{0, 0xFFFFFFFF, 0x12345678} {
		if got, want := zero.Extend(crc, 0), Extend(crc, 0, 0); got != want {
			t.Errorf("zero Extender of %#x: %#x, Extend of no bytes %#x", crc, got, want)
		}
	}
}
