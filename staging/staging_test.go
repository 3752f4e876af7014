package staging

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/crc32c"
)

// layout returns spans covering [0, total) made of pieces of random sizes
// (multiples of unit), backed by buffers at random offsets of src when
// unaligned is set, and the expected checksums of two interleaved groups.
func layout(r *rand.Rand, src []byte, total, unit int, unaligned bool) ([]span, []uint32) {
	var spans []span
	sums := make([]uint32, 2)
	for off := 0; off < total; {
		n := min(total-off, unit*(1+r.IntN(8)))
		start := off
		if unaligned {
			start = off + r.IntN(64) // memory no longer aligned to the file
			if start+n > len(src) {
				start = off
			}
		}
		s := span{Off: int64(off), Buf: src[start : start+n], Sum: len(spans) % 2}
		sums[s.Sum] = crc32c.Update(sums[s.Sum], s.Buf)
		spans = append(spans, s)
		off += n
	}
	return spans, sums
}

func TestWriteRead(t *testing.T) {
	dirs := map[string]string{"tmp": t.TempDir()}
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		d, err := os.MkdirTemp("/dev/shm", "staging-test-")
		if err == nil {
			t.Cleanup(func() { os.RemoveAll(d) })
			dirs["shm"] = d
		}
	}
	p, err := newPool(Config{Workers: 2, BufferSize: 64 << 10, Buffers: 3})
	if err != nil {
		t.Fatal(err)
	}
	defer p.close()
	ctx := context.Background()
	for name, dir := range dirs {
		direct, err := fsys.ProbeDirect(fsys.OS{}, dir)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: O_DIRECT %v", name, direct)
		for _, tc := range []struct {
			unit      int
			unaligned bool
			overlap   bool
		}{{4096, false, false}, {4096, false, true}, {4096, true, false}, {512, false, true}, {1000, true, false}} {
			t.Run(fmt.Sprintf("%s/direct=%v/unit=%d/unaligned=%v/overlap=%v", name, direct, tc.unit, tc.unaligned, tc.overlap), func(t *testing.T) {
				r := rand.New(rand.NewPCG(1, uint64(tc.unit)))
				total := 300 * 4096 // several bounce chunks
				src := fsys.AlignedBuffer(total + 4096)
				for i := range src {
					src[i] = byte(r.Uint32())
				}
				spans, want := layout(r, src, total, tc.unit, tc.unaligned)
				flag := os.O_RDWR | os.O_CREATE | os.O_TRUNC
				if direct {
					flag |= unix.O_DIRECT
				}
				f, err := fsys.OS{}.OpenFile(filepath.Join(dir, "f"), flag, 0o600)
				if err != nil {
					t.Fatal(err)
				}
				defer f.Close()
				run := func(fn func(*worker)) {
					var wg sync.WaitGroup
					wg.Add(1)
					if err := p.submit(ctx, func(w *worker) { defer wg.Done(); fn(w) }); err != nil {
						t.Fatal(err)
					}
					wg.Wait()
				}
				sums := make([]uint32, 2)
				run(func(w *worker) {
					n, err := w.write(ctx, f, spans, options{Direct: direct, Sums: sums, Overlap: tc.overlap, Chunk: 8192 * (1 + tc.unit%3)})
					if err != nil || n != int64(total) {
						t.Errorf("write: %d, %v", n, err)
					}
				})
				if sums[0] != want[0] || sums[1] != want[1] {
					t.Fatalf("write sums %x, want %x", sums, want)
				}
				// Read into fresh memory with the same span shapes.
				dst := fsys.AlignedBuffer(len(src))
				rspans := make([]span, len(spans))
				for i, s := range spans {
					start := int(s.Off)
					if tc.unaligned {
						start += 7 // memory misaligned against the file
					}
					rspans[i] = span{Off: s.Off, Buf: dst[start : start+len(s.Buf)], Sum: s.Sum}
				}
				// Read back a subset too: every other span (gaps in the file).
				for _, subset := range []bool{false, true} {
					clear(dst)
					rs := rspans
					if subset {
						rs = nil
						for i := 0; i < len(rspans); i += 2 {
							rs = append(rs, rspans[i])
						}
					}
					got := make([]uint32, 2)
					run(func(w *worker) {
						if _, err := w.read(ctx, f, rs, options{Direct: direct, Sums: got, Overlap: tc.overlap}); err != nil {
							t.Errorf("read: %v", err)
						}
					})
					for i, s := range rs {
						j := i
						if subset {
							j = 2 * i
						}
						if !bytes.Equal(s.Buf, spans[j].Buf) {
							t.Fatalf("subset %v: span %d differs", subset, i)
						}
					}
					if !subset && (got[0] != want[0] || got[1] != want[1]) {
						t.Fatalf("read sums %x, want %x", got, want)
					}
				}
			})
		}
	}
}

// TestShortWrites drives writes through a file system that writes only half
// of every other request; the data must still arrive whole.
func TestShortWrites(t *testing.T) {
	var mu sync.Mutex
	n := 0
	fs := &fsys.Faulty{FS: fsys.OS{}, Inj: fsys.InjectorFunc(func(op fsys.Op, _ string) fsys.Fault {
		mu.Lock()
		defer mu.Unlock()
		if op == fsys.OpWrite {
			n++
			return fsys.Fault{Short: n%2 == 1}
		}
		return fsys.Fault{}
	})}
	p, err := newPool(Config{Workers: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer p.close()
	f, err := fs.OpenFile(filepath.Join(t.TempDir(), "f"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	src := make([]byte, 1<<20)
	for i := range src {
		src[i] = byte(i * 31)
	}
	spans := []span{{Off: 0, Buf: src[:3000], Sum: -1}, {Off: 3000, Buf: src[3000:], Sum: -1}}
	done := make(chan error, 1)
	if err := p.submit(context.Background(), func(w *worker) {
		_, err := w.write(context.Background(), f, spans, options{})
		done <- err
	}); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(src))
	if _, err := f.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, src) || n < 2 {
		t.Fatalf("data differs after short writes (%d writes)", n)
	}
}

func TestBuffersBounded(t *testing.T) {
	b := newBuffers(4096, 2)
	ctx := context.Background()
	x, _ := b.get(ctx)
	y, _ := b.get(ctx)
	if !aligned(x) || !aligned(y) {
		t.Fatal("unaligned buffer")
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := b.get(cctx); err == nil {
		t.Fatal("third buffer handed out")
	}
	b.put(x)
	if z, err := b.get(ctx); err != nil || &z[0] != &x[0] {
		t.Fatalf("buffer not reused: %v", err)
	}
}

func TestPinned(t *testing.T) {
	p, err := newPool(Config{Workers: 2, CPUs: []int{0}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.close()
	got := make(chan int, 1)
	if err := p.submit(context.Background(), func(w *worker) {
		var set unix.CPUSet
		if err := unix.SchedGetaffinity(0, &set); err != nil || set.Count() != 1 || !set.IsSet(0) || w.CPU != 0 {
			got <- -1
			return
		}
		got <- w.CPU
	}); err != nil {
		t.Fatal(err)
	}
	if c := <-got; c != 0 {
		t.Fatal("worker not pinned to CPU 0")
	}
}
