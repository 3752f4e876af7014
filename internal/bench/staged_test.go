package bench

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

// lazyStager is a Stager whose copies happen as late as a stream may run
// them: a started copy runs only when its slot is waited for. A pipeline
// that reuses a slot before waiting for it, writes a chunk out before its
// copy from the device, or finishes a file with a copy outstanding moves
// the wrong bytes here. It also refuses calls from outside Do and a start
// on a slot whose copy was never waited for.
type lazyStager struct {
	t       *testing.T
	mu      *sync.Mutex // guards *chunks, *next
	chunks  *[][]byte   // every chunk copied to the device, in copy order
	next    *uint64     // the next chunk id the device hands out
	inside  bool
	pending [2]struct {
		p        []byte
		toDevice bool
		started  bool
	}
	fail      error // Start returns it, after failAfter starts
	failAfter int
	starts    int
}

// busy reports whether a started copy was never waited for.
func (s *lazyStager) busy() bool { return s.pending[0].started || s.pending[1].started }

func (s *lazyStager) Do(ctx context.Context, fn func() error) error {
	s.inside = true
	defer func() { s.inside = false }()
	return fn()
}

func (s *lazyStager) Start(i int, p []byte, toDevice bool) error {
	if !s.inside {
		s.t.Error("Start outside Do")
	}
	if s.pending[i].started {
		s.t.Errorf("Start on slot %d before its last copy was waited for", i)
	}
	if s.starts++; s.fail != nil && s.starts > s.failAfter {
		return s.fail
	}
	s.pending[i].p, s.pending[i].toDevice, s.pending[i].started = p, toDevice, true
	return nil
}

func (s *lazyStager) Wait(i int) error {
	if !s.inside {
		s.t.Error("Wait outside Do")
	}
	c := &s.pending[i]
	if !c.started {
		return nil
	}
	c.started = false
	s.mu.Lock()
	defer s.mu.Unlock()
	if c.toDevice {
		*s.chunks = append(*s.chunks, bytes.Clone(c.p))
		return nil
	}
	// From the device: a chunk that names itself (its id in each 8
	// bytes), so a file shows which chunks landed where.
	id := *s.next
	*s.next++
	for off := 0; off+8 <= len(c.p); off += 8 {
		binary.LittleEndian.PutUint64(c.p[off:], id)
	}
	return nil
}

// stagedSetup is threads lazy stagers sharing one device log, and
// threads buffers of two chunks.
func stagedSetup(t *testing.T, threads int, chunk int64) ([]Stager, []*lazyStager, [][]byte, *[][]byte) {
	var mu sync.Mutex
	var chunks [][]byte
	var next uint64
	var st []Stager
	var lazy []*lazyStager
	var bufs [][]byte
	for range threads {
		s := &lazyStager{t: t, mu: &mu, chunks: &chunks, next: &next}
		st, lazy = append(st, s), append(lazy, s)
		bufs = append(bufs, make([]byte, 2*chunk))
	}
	return st, lazy, bufs, &chunks
}

// TestStagedReadCopiesEveryChunkOfEveryFileToTheDevice: every chunk of
// every file reaches the device whole, including files that end inside a
// chunk and an empty file, however late the copies run, whether a chunk
// is read in one call or in pieces (one that does not divide it too).
func TestStagedReadCopiesEveryChunkOfEveryFileToTheDevice(t *testing.T) {
	const chunk = 8 << 10
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(1, 2))
	want := map[string]int{} // chunk contents → count
	var paths []string
	var total int64
	for i, size := range []int64{5 * chunk, chunk, 3*chunk + 100, 0, 2*chunk - 4096, 7 * chunk} {
		b := make([]byte, size)
		for j := range b {
			b[j] = byte(rng.Uint32())
		}
		p := filepath.Join(dir, fmt.Sprintf("f%d", i))
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		for off := int64(0); off < size; off += chunk {
			want[string(b[off:min(off+chunk, size)])]++
		}
		paths, total = append(paths, p), total+size
	}
	for _, tc := range []struct {
		threads int
		piece   int64
	}{{1, 0}, {3, 0}, {3, 4096}, {2, 3 * 4096}} {
		t.Run(fmt.Sprintf("%d threads, pieces of %d", tc.threads, tc.piece), func(t *testing.T) {
			st, _, bufs, chunks := stagedSetup(t, tc.threads, chunk)
			n, _, err := StagedRead(context.Background(), paths, bufs, chunk, tc.piece, st, false)
			if err != nil {
				t.Fatal(err)
			}
			checkDevice(t, n, total, *chunks, want)
		})
	}
}

// TestStagedWriteWritesEachChunkAfterItsCopy: every file holds, chunk
// by chunk, whole chunks the device handed out, each once, in the order
// one thread copied them; sizes that end inside a chunk are written to
// the byte. With overwrite the files that exist are written in place.
func TestStagedWriteWritesEachChunkAfterItsCopy(t *testing.T) {
	const chunk = 8 << 10
	sizes := []int64{5 * chunk, chunk, 3*chunk + 96, 2*chunk - 4096, 7 * chunk}
	for _, tc := range []struct {
		threads   int
		overwrite bool
	}{{1, false}, {3, false}, {3, true}} {
		t.Run(fmt.Sprintf("%d threads, overwrite %v", tc.threads, tc.overwrite), func(t *testing.T) {
			dir := t.TempDir()
			var paths []string
			for i := range sizes {
				p := filepath.Join(dir, fmt.Sprintf("f%d", i))
				if tc.overwrite {
					if err := os.WriteFile(p, bytes.Repeat([]byte{0xEE}, int(sizes[i])), 0o600); err != nil {
						t.Fatal(err)
					}
				}
				paths = append(paths, p)
			}
			st, _, bufs, _ := stagedSetup(t, tc.threads, chunk)
			n, _, err := StagedWrite(context.Background(), paths, sizes, bufs, chunk, st, false, false, tc.overwrite)
			if err != nil {
				t.Fatal(err)
			}
			var total int64
			seen := map[uint64]bool{}
			for i, p := range paths {
				total += sizes[i]
				b, err := os.ReadFile(p)
				if err != nil {
					t.Fatal(err)
				}
				if int64(len(b)) != sizes[i] {
					t.Fatalf("%s: %d bytes, want %d", p, len(b), sizes[i])
				}
				var prev uint64
				for off := int64(0); off < sizes[i]; off += chunk {
					c := b[off:min(off+chunk, sizes[i])]
					id := binary.LittleEndian.Uint64(c)
					for k := 0; k+8 <= len(c); k += 8 {
						if got := binary.LittleEndian.Uint64(c[k:]); got != id {
							t.Fatalf("%s chunk at %d: byte %d is of device chunk %d, the chunk's start of %d", p, off, k, got, id)
						}
					}
					if seen[id] {
						t.Fatalf("%s: device chunk %d written twice", p, id)
					}
					if off > 0 && id <= prev {
						t.Fatalf("%s: chunk at %d is device chunk %d, after %d", p, off, id, prev)
					}
					seen[id], prev = true, id
				}
			}
			if n != total {
				t.Errorf("wrote %d bytes, want %d", n, total)
			}
		})
	}
}

// TestStagedCeilingsRefuseBadArgumentsAndNameFailures: a buffer that
// cannot hold two chunks, a chunk that is not a multiple of Align, a
// stager per thread missing, a missing file and a failing copy are each
// refused with an error that says what was wrong.
func TestStagedCeilingsRefuseBadArgumentsAndNameFailures(t *testing.T) {
	const chunk = 8 << 10
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	if err := os.WriteFile(p, make([]byte, 3*chunk), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	st, lazy, bufs, _ := stagedSetup(t, 2, chunk)
	broken := errors.New("copy engine on fire")
	for _, tc := range []struct {
		name string
		run  func() error
		want string
	}{
		{"small buffer", func() error {
			_, _, err := StagedRead(ctx, []string{p}, [][]byte{bufs[0][:chunk], bufs[1]}, chunk, 0, st, false)
			if !errors.Is(err, errStagedBuffer) {
				t.Errorf("want errStagedBuffer, got %v", err)
			}
			return err
		}, "thread 0"},
		{"unaligned chunk", func() error {
			_, _, err := StagedWrite(ctx, []string{p}, []int64{chunk}, bufs, chunk+1, st, false, false, true)
			return err
		}, "multiple of 4096"},
		{"unaligned pieces", func() error {
			_, _, err := StagedRead(ctx, []string{p}, bufs, chunk, 100, st, false)
			return err
		}, "pieces of 100 bytes"},
		{"stagers missing", func() error {
			_, _, err := StagedRead(ctx, []string{p}, bufs, chunk, 0, st[:1], false)
			return err
		}, "1 stagers for 2 threads"},
		{"missing file", func() error {
			_, _, err := StagedRead(ctx, []string{filepath.Join(dir, "nope")}, bufs, chunk, 0, st, false)
			return err
		}, "nope"},
		{"failing copy", func() error {
			for _, s := range lazy {
				s.fail = broken
			}
			defer func() {
				for _, s := range lazy {
					s.fail = nil
				}
			}()
			_, _, err := StagedWrite(ctx, []string{p}, []int64{3 * chunk}, bufs, chunk, st, false, false, true)
			if !errors.Is(err, broken) {
				t.Errorf("want the copy's error wrapped, got %v", err)
			}
			return err
		}, "staged write " + p},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.run()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err %v, want one naming %q", err, tc.want)
			}
		})
	}
}

// TestStagedCeilingsLeaveNoCopyRunningWhenACopyFails: a copy that fails
// to start in the middle of a file fails the pass, and by then every copy
// started before it has been waited for (the caller's buffers are free),
// reading and writing alike.
func TestStagedCeilingsLeaveNoCopyRunningWhenACopyFails(t *testing.T) {
	const chunk = 8 << 10
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	if err := os.WriteFile(p, make([]byte, 5*chunk), 0o600); err != nil {
		t.Fatal(err)
	}
	broken := errors.New("copy engine on fire")
	for _, tc := range []struct {
		name string
		run  func([]Stager, [][]byte) error
	}{
		{"read", func(st []Stager, bufs [][]byte) error {
			_, _, err := StagedRead(context.Background(), []string{p}, bufs, chunk, 0, st, false)
			return err
		}},
		{"write", func(st []Stager, bufs [][]byte) error {
			_, _, err := StagedWrite(context.Background(), []string{p}, []int64{5 * chunk}, bufs, chunk, st, false, false, true)
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st, lazy, bufs, _ := stagedSetup(t, 1, chunk)
			lazy[0].fail, lazy[0].failAfter = broken, 2 // the third chunk's copy
			if err := tc.run(st, bufs); !errors.Is(err, broken) {
				t.Fatalf("err %v, want the copy's", err)
			}
			if lazy[0].busy() {
				t.Fatal("a copy started before the failure was still running when the pass returned")
			}
		})
	}
}

// TestStagedCeilingsWithODirect: with direct I/O the staged read and write
// move whole aligned chunks, the tail of a size that ends inside a block
// rounded up, and every byte of the file reaches the device. It skips where
// the test's directory refuses O_DIRECT.
func TestStagedCeilingsWithODirect(t *testing.T) {
	const chunk = 8 << 10
	dir := t.TempDir()
	probe := filepath.Join(dir, "probe")
	f, err := os.OpenFile(probe, os.O_CREATE|os.O_WRONLY|unix.O_DIRECT, 0o600)
	if err != nil {
		t.Skipf("O_DIRECT refused here: %v", err)
	}
	f.Close()
	paths := []string{filepath.Join(dir, "a"), filepath.Join(dir, "b")}
	sizes := []int64{3*chunk + 100, chunk}
	st, _, _, chunks := stagedSetup(t, 2, chunk)
	var bufs [][]byte
	for range 2 {
		b, err := AlignedBuffer(2 * chunk)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { FreeBuffer(b) })
		bufs = append(bufs, b)
	}
	n, _, err := StagedWrite(context.Background(), paths, sizes, bufs, chunk, st, true, false, false)
	if err != nil {
		t.Fatal(err)
	}
	if want := RoundUp(sizes[0]) + sizes[1]; n != want {
		t.Errorf("wrote %d bytes, want %d (the first size rounded up to %d)", n, want, Align)
	}
	var total int64
	want := map[string]int{}
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if int64(len(b))%Align != 0 {
			t.Errorf("%s: %d bytes, not whole blocks", p, len(b))
		}
		for off := 0; off < len(b); off += chunk {
			want[string(b[off:min(off+chunk, len(b))])]++
		}
		total += int64(len(b))
	}
	n, _, err = StagedRead(context.Background(), paths, bufs, chunk, 4096, st, true)
	if err != nil {
		t.Fatal(err)
	}
	checkDevice(t, n, total, *chunks, want)
}

// checkDevice checks a staged read: n bytes read of total, and the
// chunks that reached the device are want's, each as many times.
func checkDevice(t *testing.T, n, total int64, chunks [][]byte, want map[string]int) {
	t.Helper()
	if n != total {
		t.Errorf("read %d bytes, want %d", n, total)
	}
	got := map[string]int{}
	for _, c := range chunks {
		got[string(c)]++
	}
	if len(got) != len(want) {
		t.Errorf("%d distinct chunks reached the device, want %d", len(got), len(want))
	}
	for c, k := range want {
		if got[c] != k {
			t.Errorf("a %d-byte chunk of the files reached the device %d times, want %d", len(c), got[c], k)
		}
	}
}

// TestTableKeepsEveryCellOfARunThatMovedNothing: a load that moved
// nothing (--hit-ratio 0) still prints its reread and staged fractions
// (0.00), so its row has as many figures as any load's; a store leaves
// only of reread empty.
func TestTableKeepsEveryCellOfARunThatMovedNothing(t *testing.T) {
	staged := Ceiling{Name: "staged", GBps: 20, Threads: 16}
	r := &Report{Schema: Schema, Dir: "/x", FSType: "tmpfs", Memory: "gpu", Ceilings: []Ceiling{{Name: CeilingH2D, GBps: 55}, {Name: CeilingD2H, GBps: 55}}}
	r.Runs = []Run{
		{Path: "auto", Mover: "gpu-staging", IO: "direct", Direction: Store, Jobs: 16, KeyBytes: 32 << 20, Keys: 8, Hits: 8, GBps: 20,
			Ceiling: Ceiling{Name: "pwrite", GBps: 25, Threads: 16}, Fraction: 0.8, CeilingStaged: staged, FractionStaged: 1},
		{Path: "auto", Mover: "gpu-staging", IO: "direct", Direction: Load, Jobs: 16, KeyBytes: 32 << 20, Keys: 8,
			Ceiling: Ceiling{Name: "pread", GBps: 25, Threads: 16}, CeilingReread: Ceiling{Name: "pread, second read", GBps: 35, Threads: 16}, CeilingStaged: staged},
	}
	r.Finish()
	var b bytes.Buffer
	if err := r.WriteTable(&b); err != nil {
		t.Fatal(err)
	}
	want := map[string]int{Store: 10, Load: 11} // 8 always, of reread (loads), of staged, of link
	rows := 0
	for _, line := range strings.Split(b.String(), "\n") {
		f := strings.Fields(line)
		if len(f) < 8 || (f[6] != Store && f[6] != Load) {
			continue
		}
		rows++
		n := 0
		for _, x := range f[8:] {
			if _, err := strconv.ParseFloat(x, 64); err != nil {
				break
			}
			n++
		}
		n-- // the verified size ("0" here) ends the figures
		if n != want[f[6]] {
			t.Errorf("%s row has %d figures before its verified size, want %d:\n%s", f[6], n, want[f[6]], b.String())
		}
	}
	if rows != 2 {
		t.Fatalf("%d rows, want 2:\n%s", rows, b.String())
	}
}
