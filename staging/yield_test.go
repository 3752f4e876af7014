package staging

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/crc32c"
)

// TestYielderYieldsOncePerEveryBytes: a Yielder yields each time the bytes
// reported since its last yield reach Every, and never with Every 0.
func TestYielderYieldsOncePerEveryBytes(t *testing.T) {
	for _, tc := range []struct {
		name  string
		every int64
		moves []int64
		want  int
	}{
		{"never", 0, []int64{1 << 30, 1 << 30}, 0},
		{"four pieces a yield", 1 << 20, []int64{256 << 10, 256 << 10, 256 << 10, 256 << 10, 256 << 10, 256 << 10, 256 << 10, 256 << 10}, 2},
		{"a large move yields once", 1 << 20, []int64{8 << 20}, 1},
		{"short of Every", 1 << 20, []int64{512 << 10, 511 << 10}, 0},
		{"uneven pieces keep their remainder", 1 << 20, []int64{252 << 10, 256 << 10, 256 << 10, 256 << 10, 256 << 10, 256 << 10, 256 << 10, 256 << 10, 4 << 10}, 2},
		{"a large move yields once, its remainder counts", 1 << 20, []int64{(8 << 20) + (512 << 10), 512 << 10}, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := 0
			y := Yielder{Every: tc.every, Yield: func() { n++ }}
			for _, m := range tc.moves {
				y.Moved(m)
			}
			if n != tc.want {
				t.Fatalf("%d yields, want %d", n, tc.want)
			}
		})
	}
	// The real sched_yield: returns, with nothing to count.
	y := Yielder{Every: 1}
	y.Moved(1)
}

// TestYielderStepsCutWorkAtEveryAndLimit: Steps covers [0, n) in order
// in ranges no longer than limit or Every, and yields once per Every.
func TestYielderStepsCutWorkAtEveryAndLimit(t *testing.T) {
	for _, tc := range []struct {
		name         string
		every        int64
		n, limit     int
		steps, yield int
	}{
		{"Every cuts", 512 << 10, 2 << 20, 0, 4, 4},
		{"limit cuts below Every", 1 << 20, 2 << 20, 256 << 10, 8, 2},
		{"no Every, no limit: one step", 0, 2 << 20, 0, 1, 0},
		{"a short tail", 1 << 20, (2 << 20) + 4096, 0, 3, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			yields := 0
			y := Yielder{Every: tc.every, Yield: func() { yields++ }}
			var got [][2]int
			y.Steps(tc.n, tc.limit, func(lo, hi int) { got = append(got, [2]int{lo, hi}) })
			next := 0
			for _, r := range got {
				if r[0] != next || r[1] <= r[0] || tc.limit > 0 && r[1]-r[0] > tc.limit || tc.every > 0 && int64(r[1]-r[0]) > tc.every {
					t.Fatalf("ranges %v: not consecutive, empty or too long", got)
				}
				next = r[1]
			}
			if next != tc.n || len(got) != tc.steps || yields != tc.yield {
				t.Fatalf("ranges %v cover [0, %d), %d yields; want [0, %d) in %d ranges, %d yields", got, next, yields, tc.n, tc.steps, tc.yield)
			}
		})
	}
}

// TestWorkersYieldEveryYieldBytes: a pool's workers yield their CPU after
// every Config.YieldBytes they move, with checksums fused (256 KiB
// batches) and in the 2 MiB batches of a tmpfs with huge pages (Folio:
// the checksum goes in steps of YieldBytes), the bytes unchanged.
func TestWorkersYieldEveryYieldBytes(t *testing.T) {
	for _, tc := range []struct {
		name  string
		folio int64
	}{
		{"fused batches", 0},
		{"2 MiB folio batches", 2 << 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := newPool(Config{Workers: 1, YieldBytes: 512 << 10})
			if err != nil {
				t.Fatal(err)
			}
			defer p.close()
			src := bytes.Repeat([]byte("kvhost!!"), (4<<20)/8)
			dst := make([]byte, len(src))
			r := roundTripYields(t, p, src, dst, options{Folio: tc.folio})
			want := crc32c.Update(0, src)
			if r.writes != 8 || r.reads != 8 || !bytes.Equal(dst, src) || r.wsum != want || r.rsum != want {
				t.Fatalf("4 MiB written and read with YieldBytes 512 KiB: %d and %d yields (want 8 each), bytes equal %v, checksums %08x and %08x (want %08x)",
					r.writes, r.reads, bytes.Equal(dst, src), r.wsum, r.rsum, want)
			}
		})
	}
}

// TestBouncedRunsYieldEveryYieldBytes: a direct write or read of memory
// that is not aligned copies through the bounce buffers, and the thread
// that copies gives its CPU up every Config.YieldBytes it copied, as the
// vectored path's does: 4 MiB with YieldBytes 512 KiB yields 8 times each
// way (here through 1 MiB bounce buffers), the bytes and checksums
// unchanged.
func TestBouncedRunsYieldEveryYieldBytes(t *testing.T) {
	p, err := newPool(Config{Workers: 1, BufferSize: 1 << 20, Buffers: 2, YieldBytes: 512 << 10})
	if err != nil {
		t.Fatal(err)
	}
	defer p.close()
	const size = 4 << 20
	srcMem, dstMem := fsys.AlignedBuffer(size+1), fsys.AlignedBuffer(size+1)
	src, dst := srcMem[1:], dstMem[1:] // not aligned: bounced
	copy(src, bytes.Repeat([]byte("kvhost!!"), size/8))
	r := roundTripYields(t, p, src, dst, options{Direct: true}) // options.Direct alone bounces unaligned memory
	want := crc32c.Update(0, src)
	if r.writes != 8 || r.reads != 8 || !bytes.Equal(dst, src) || r.wsum != want || r.rsum != want {
		t.Fatalf("4 MiB bounced out and in with YieldBytes 512 KiB: %d and %d yields (want 8 each), bytes equal %v, checksums %08x and %08x (want %08x)",
			r.writes, r.reads, bytes.Equal(dst, src), r.wsum, r.rsum, want)
	}
}

// roundTrip is what roundTripYields saw: the yields of the write and of
// the read, their checksums, and the first error.
type roundTrip struct {
	writes, reads int64
	wsum, rsum    uint32
	err           error
}

// roundTripYields writes src to a new file with one of p's workers, with
// opt and a checksum, then reads the file back into dst likewise, and
// returns the yields and checksums of each way. It fails the test on an
// error.
func roundTripYields(t *testing.T, p *Pool, src, dst []byte, opt options) roundTrip {
	t.Helper()
	f, err := fsys.OS{}.OpenFile(filepath.Join(t.TempDir(), "f"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	done := make(chan roundTrip, 1)
	if err := p.submit(context.Background(), func(w *worker) {
		var r roundTrip
		var yields atomic.Int64 // the goroutine that copies may not be the worker's
		w.yield.Yield = func() { yields.Add(1) }
		wsums, rsums := make([]uint32, 1), make([]uint32, 1)
		opt.Sums = wsums
		if _, r.err = w.write(context.Background(), f, []span{{Off: 0, Buf: src, Sum: 0}}, opt); r.err == nil {
			r.writes = yields.Swap(0)
			opt.Sums = rsums
			_, r.err = w.read(context.Background(), f, []span{{Off: 0, Buf: dst, Sum: 0}}, opt)
			r.reads = yields.Load()
		}
		r.wsum, r.rsum = wsums[0], rsums[0]
		done <- r
	}); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	return r
}
