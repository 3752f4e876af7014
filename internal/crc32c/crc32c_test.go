package crc32c

import (
	"hash/crc32"
	"math/rand/v2"
	"testing"
	"time"
)

// TestMatchesHashCRC32: Update returns hash/crc32's CRC-32C for
// every length around the folding thresholds and block sizes, at odd
// offsets, from zero, random and chained initial values.
func TestMatchesHashCRC32(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	buf := make([]byte, 1<<20+300)
	for i := range buf {
		buf[i] = byte(r.Uint32())
	}
	lengths := []int{0, 1, 3, 4, 63, 64, 65, 127, 128, 255, clmulMin - 1, clmulMin, clmulMin + 1, clmulMin + 63, 319, 320, 4095, 4096, 4097, 65536 + 17, 1 << 20}
	for range 200 {
		lengths = append(lengths, r.IntN(20000))
	}
	for _, n := range lengths {
		for _, off := range []int{0, 1, 7, 64, 299} {
			p := buf[off : off+n]
			for _, init := range []uint32{0, 0xFFFFFFFF, r.Uint32()} {
				if got, want := Update(init, p), crc32.Update(init, table, p); got != want {
					t.Fatalf("len %d off %d init %08x: Update %08x, hash/crc32 %08x (folding %v)", n, off, init, got, want, hasCLMUL)
				}
			}
		}
	}
	// Chained over uneven pieces, as the movers feed it.
	want := crc32.Checksum(buf, table)
	var got uint32
	for rest := buf; len(rest) > 0; {
		k := min(len(rest), 1+r.IntN(70000))
		got = Update(got, rest[:k])
		rest = rest[k:]
	}
	if got != want {
		t.Fatalf("chained: %08x, want %08x", got, want)
	}
}

// BenchmarkCRC32C: Update against hash/crc32 (the ceiling to beat is the
// other way round: the fraction is hash/crc32's time over ours) on 256 KiB,
// the movers' default fused batch (staging's fuseBatch), in cache.
func BenchmarkCRC32C(b *testing.B) {
	buf := make([]byte, 256<<10)
	for i := range buf {
		buf[i] = byte(i * 7)
	}
	b.SetBytes(int64(len(buf)))
	var s uint32
	var ours, std int64
	for b.Loop() {
		t0 := nanotime()
		s = Update(s, buf)
		t1 := nanotime()
		s = crc32.Update(s, table, buf)
		ours += t1 - t0
		std += nanotime() - t1
	}
	b.ReportMetric(float64(b.N)*float64(len(buf))/float64(ours), "ours-GB/s")
	b.ReportMetric(float64(b.N)*float64(len(buf))/float64(std), "hash/crc32-GB/s")
	b.ReportMetric(float64(std)/float64(ours), "speedup")
	b.ReportMetric(0, "ns/op")
	_ = s
}

func nanotime() int64 { return time.Now().UnixNano() }
