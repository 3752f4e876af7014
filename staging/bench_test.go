package staging

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvhost/kvhost/fsys"
)

// BenchmarkFused measures the cost of checksums fused with the transfer, by
// batch size, on the directory named by KVHOST_BENCH_DIR (default
// /dev/shm, where the transfer is a CPU copy):
//
//	go test -run '^$' -bench Fused ./staging
//
// One worker writes (reads) a 32 MiB file from (into) 1024 segments of
// 32 KiB scattered over 256 MiB, buffered. The ceiling is the same transfer
// without checksums, in the same iteration; sums/ceiling is the throughput
// ratio.
func BenchmarkFused(b *testing.B) {
	dir := os.Getenv("KVHOST_BENCH_DIR")
	if dir == "" {
		dir = "/dev/shm"
	}
	dir, err := os.MkdirTemp(dir, "staging-bench-")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { os.RemoveAll(dir) })
	const seg, segs, spread = 32 << 10, 1024, 8
	mem := fsys.AlignedBuffer(seg * segs * spread)
	for i := range mem {
		mem[i] = byte(i * 7)
	}
	r := rand.New(rand.NewPCG(1, 1))
	perm := r.Perm(segs * spread)
	spans := make([]span, segs)
	for i := range spans {
		spans[i] = span{Off: int64(i) * seg, Buf: mem[perm[i]*seg : (perm[i]+1)*seg], Sum: i / 256}
	}
	f, err := fsys.OS{}.OpenFile(filepath.Join(dir, "f"), os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	w := &worker{}
	ctx := context.Background()
	sums := make([]uint32, 4)
	for _, write := range []bool{true, false} {
		for _, chunk := range []int{64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 4 << 20} {
			name := fmt.Sprintf("read/batch=%dK", chunk>>10)
			if write {
				name = fmt.Sprintf("write/batch=%dK", chunk>>10)
			}
			b.Run(name, func(b *testing.B) {
				b.SetBytes(seg * segs)
				if _, err := w.do(ctx, f, spans, options{}, true); err != nil {
					b.Fatal(err)
				}
				var with, without time.Duration
				for i := 0; b.Loop(); i++ {
					for k := range 2 {
						opt := options{}
						if (i+k)%2 == 0 { // alternate who goes first
							opt = options{Sums: sums, Chunk: chunk}
						}
						start := time.Now()
						if _, err := w.do(ctx, f, spans, opt, write); err != nil {
							b.Fatal(err)
						}
						if opt.Sums != nil {
							with += time.Since(start)
						} else {
							without += time.Since(start)
						}
					}
				}
				b.ReportMetric(float64(b.N*seg*segs)/with.Seconds()/1e9, "GB/s")
				b.ReportMetric(float64(b.N*seg*segs)/without.Seconds()/1e9, "ceiling-GB/s")
				b.ReportMetric(without.Seconds()/with.Seconds(), "sums/ceiling")
				b.ReportMetric(0, "ns/op")
			})
		}
	}
}
