package staging

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/crc32c"
)

// randomSpans returns spans of random sizes over a file of runs separated by
// gaps, backed by src at offsets that are unaligned unless aligned is set
// (then every size, offset and address is a multiple of Align), at most
// maxSpan bytes long, each feeding
// one of sums checksums or none (-1). Some spans are empty.
func randomSpans(r *rand.Rand, src []byte, count, maxSpan, sums int, aligned bool) []span {
	var spans []span
	var off int64
	mem := 0
	for range count {
		var n int
		switch {
		case aligned:
			n = Align * r.IntN(maxSpan/Align+1)
		case r.IntN(10) == 0:
			n = 0
		default:
			n = 1 + r.IntN(maxSpan)
		}
		if !aligned {
			mem += r.IntN(100) // the memory's layout differs from the file's
		}
		if mem+n > len(src) {
			mem = 0
		}
		spans = append(spans, span{Off: off, Buf: src[mem : mem+n], Sum: r.IntN(sums+1) - 1})
		mem += n
		off += int64(n)
		if r.IntN(8) == 0 { // a gap: a new run
			gap := int64(1 + r.IntN(10_000))
			if aligned {
				gap = Align * int64(1+r.IntN(3))
			}
			off += gap
		}
	}
	return spans
}

// reference writes spans one by one with plain pwrite and checksums them in
// span order, the straightforward way.
func reference(t *testing.T, path string, spans []span, nsums int) ([]byte, []uint32) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sums := make([]uint32, nsums)
	for _, s := range spans {
		if _, err := f.WriteAt(s.Buf, s.Off); err != nil {
			t.Fatal(err)
		}
		if s.Sum >= 0 {
			sums[s.Sum] = crc32c.Update(sums[s.Sum], s.Buf)
		}
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return data, sums
}

// TestFusedMatchesReference: writes and reads with the checksum fused into
// batches give byte-identical files and the same checksums as the
// reference, for random layouts and batch sizes that split spans or not.
func TestFusedMatchesReference(t *testing.T) {
	dirs := map[string]string{"tmp": t.TempDir()}
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		if d, err := os.MkdirTemp("/dev/shm", "staging-test-"); err == nil {
			t.Cleanup(func() { os.RemoveAll(d) })
			dirs["shm"] = d
		}
	}
	const nsums = 3
	ctx := context.Background()
	for name, dir := range dirs {
		direct, err := fsys.ProbeDirect(fsys.OS{}, dir)
		if err != nil {
			t.Fatal(err)
		}
		for _, tc := range []struct {
			direct  bool
			chunk   int
			count   int
			maxSpan int
		}{
			{false, 1, 40, 3000},              // a byte per batch: every span split
			{false, 1000, 60, 70_000},         // odd batches
			{false, 32 << 10, 200, 70_000},    // spans split and not
			{false, 0, 200, 70_000},           // fuseBatch
			{false, 1 << 20, 200, 70_000},     // many spans per batch
			{false, 1 << 20, 3000, 200},       // iovMax pieces before the limit
			{true, 3 * Align, 60, 80 << 10},   // aligned splits
			{true, 5000, 40, 80 << 10},        // rounded down to Align
			{true, 0, 200, 80 << 10},          // fuseBatch
			{true, 64 * Align, 200, 32 << 10}, // batches of whole spans, mostly
		} {
			if tc.direct && !direct {
				continue
			}
			t.Run(fmt.Sprintf("%s/direct=%v/chunk=%d/spans=%d", name, tc.direct, tc.chunk, tc.count), func(t *testing.T) {
				r := rand.New(rand.NewPCG(uint64(tc.chunk), uint64(tc.count)))
				src := fsys.AlignedBuffer(8 << 20)
				rand.NewChaCha8([32]byte{byte(tc.chunk), byte(tc.count)}).Read(src)
				spans := randomSpans(r, src, tc.count, tc.maxSpan, nsums, tc.direct)
				want, wantSums := reference(t, filepath.Join(dir, "ref"), spans, nsums)

				flag := os.O_RDWR | os.O_CREATE | os.O_TRUNC
				if tc.direct {
					flag |= unix.O_DIRECT
				}
				path := filepath.Join(dir, "fused")
				f, err := fsys.OS{}.OpenFile(path, flag, 0o600)
				if err != nil {
					t.Fatal(err)
				}
				defer f.Close()
				w := &worker{}
				sums := make([]uint32, nsums)
				opt := options{Direct: tc.direct, Sums: sums, Chunk: tc.chunk}
				n, err := w.write(ctx, f, spans, opt)
				if err != nil {
					t.Fatal(err)
				}
				var total int64
				for _, s := range spans {
					total += int64(len(s.Buf))
				}
				if n != total {
					t.Fatalf("wrote %d bytes, want %d", n, total)
				}
				got, err := os.ReadFile(path)
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got, want) {
					t.Fatalf("file differs from the reference (%d vs %d bytes)", len(got), len(want))
				}
				if fmt.Sprint(sums) != fmt.Sprint(wantSums) {
					t.Fatalf("write sums %x, want %x", sums, wantSums)
				}

				// Read back into other memory of the same shapes, spans not
				// overlapping, unaligned unless direct.
				dst := fsys.AlignedBuffer(int(total) + 16*len(spans))
				rspans := make([]span, len(spans))
				mem := 0
				for i, s := range spans {
					if !tc.direct {
						mem += 1 + i%13
					}
					rspans[i] = span{Off: s.Off, Buf: dst[mem : mem+len(s.Buf)], Sum: s.Sum}
					mem += len(s.Buf)
				}
				rsums := make([]uint32, nsums)
				if _, err := w.read(ctx, f, rspans, options{Direct: tc.direct, Sums: rsums, Chunk: tc.chunk}); err != nil {
					t.Fatal(err)
				}
				for i, s := range rspans {
					if !bytes.Equal(s.Buf, want[s.Off:s.Off+int64(len(s.Buf))]) {
						t.Fatalf("read span %d differs", i)
					}
				}
				if fmt.Sprint(rsums) != fmt.Sprint(wantSums) {
					t.Fatalf("read sums %x, want %x", rsums, wantSums)
				}
			})
		}
	}
}

// memFile is a File in memory that allocates nothing per call.
type memFile struct {
	fsys.File
	data []byte
}

func (m *memFile) WritevAt(bufs [][]byte, off int64) (int, error) {
	n := 0
	for _, b := range bufs {
		n += copy(m.data[off+int64(n):], b)
	}
	return n, nil
}

func (m *memFile) ReadvAt(bufs [][]byte, off int64) (int, error) {
	n := 0
	for _, b := range bufs {
		n += copy(b, m.data[off+int64(n):])
	}
	return n, nil
}

// TestFusedAllocs: in steady state a fused write or read allocates nothing,
// however many batches it takes.
func TestFusedAllocs(t *testing.T) {
	src := make([]byte, 4<<20)
	var spans []span
	for off := 0; off < len(src); off += 32 << 10 {
		spans = append(spans, span{Off: int64(off), Buf: src[off : off+32<<10], Sum: off / (1 << 20)})
	}
	f := &memFile{data: make([]byte, len(src))}
	w := &worker{}
	ctx := context.Background()
	sums := make([]uint32, 4)
	for _, write := range []bool{true, false} {
		for _, chunk := range []int{0, 48 << 10} {
			allocs := testing.AllocsPerRun(10, func() {
				if _, err := w.do(ctx, f, spans, options{Sums: sums, Chunk: chunk}, write); err != nil {
					t.Fatal(err)
				}
			})
			if allocs != 0 {
				t.Errorf("write %v, chunk %d: %v allocations per call", write, chunk, allocs)
			}
		}
	}
}
