package staging

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/crc32c"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

type deviceRegion struct{}

func (deviceRegion) ID() uint64        { return 9 }
func (deviceRegion) Len() int64        { return 1 << 20 }
func (deviceRegion) Kind() region.Kind { return region.KindDevice }

// newTestMover is a Mover of cfg, closed at the test's end.
func newTestMover(t *testing.T, cfg Config) *Mover {
	t.Helper()
	mv, err := NewMover(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(mv.Close)
	return mv
}

// hostRegion is a host region of size bytes, closed at the test's end.
func hostRegion(t *testing.T, name string, size int64) *region.Host {
	t.Helper()
	r, err := region.NewHost(name, size)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

// openFile opens the file name, read-write and created if missing, with
// the further flags flag (such as O_DIRECT), closed at the test's end.
func openFile(t *testing.T, name string, flag int) fsys.File {
	t.Helper()
	f, err := fsys.OS{}.OpenFile(name, os.O_RDWR|os.O_CREATE|flag, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// TestMoverRoundTrip: a plan of scattered extents (an unaligned last one,
// with O_DIRECT where the file system takes it) is written and read back
// through the Mover with the same CRC-32C per slot as a plain computation;
// the file's tail up to 4 KiB is zeros; a region the CPU cannot address
// is ErrUnsupported; a file shorter than the plan is transfer.ErrShortFile.
func TestMoverRoundTrip(t *testing.T) {
	ctx := context.Background()
	mv := newTestMover(t, Config{Workers: 2})
	src := hostRegion(t, "src", 1<<20)
	dst := hostRegion(t, "dst", 1<<20)
	for i := range src.Bytes() {
		src.Bytes()[i] = byte(i*31 + i>>9)
	}
	dir := t.TempDir()
	direct, _ := fsys.ProbeDirect(fsys.OS{}, dir)
	ext := func(r region.Region) []transfer.Extent {
		return []transfer.Extent{
			{FileOff: 0, Region: r, RegionOff: 8192, Len: 4096, Sum: 0},
			{FileOff: 4096, Region: r, RegionOff: 0, Len: 4096, Sum: 1},
			{FileOff: 8192, Region: r, RegionOff: 65536, Len: 2560, Sum: 1}, // ends unaligned
		}
	}
	p := &transfer.Plan{Extents: ext(src), Sums: 2, Direct: direct}
	name := filepath.Join(dir, "f")
	flag := 0
	if direct {
		flag = unix.O_DIRECT
	}
	f := openFile(t, name, flag)
	ws := make([]uint32, 2)
	if _, err := mv.For(false).WriteFile(ctx, f, p, ws); err != nil {
		t.Fatal(err)
	}
	b := src.Bytes()
	want := []uint32{crc32c.Checksum(b[8192:12288]), crc32c.Update(crc32c.Checksum(b[0:4096]), b[65536:65536+2560])}
	if ws[0] != want[0] || ws[1] != want[1] {
		t.Fatalf("write sums %x, want %x", ws, want)
	}
	rs := make([]uint32, 2)
	rp := &transfer.Plan{Extents: ext(dst), Sums: 2, Direct: direct}
	if _, err := mv.ReadFile(ctx, f, rp, rs); err != nil {
		t.Fatal(err)
	}
	if rs[0] != want[0] || rs[1] != want[1] || !bytes.Equal(dst.Bytes()[65536:65536+2560], b[65536:65536+2560]) {
		t.Fatalf("read sums %x, want %x", rs, want)
	}
	if direct {
		raw, _ := os.ReadFile(name)
		if len(raw) != 12288 || !bytes.Equal(raw[8192+2560:], make([]byte, 4096-2560)) {
			t.Fatalf("direct file of %d bytes: tail not zeros", len(raw))
		}
	}
	if _, err := mv.WriteFile(ctx, f, &transfer.Plan{Extents: ext(deviceRegion{}), Sums: 2}, nil); !errors.Is(err, transfer.ErrUnsupported) {
		t.Fatalf("device region: %v", err)
	}
	long := &transfer.Plan{Extents: []transfer.Extent{{FileOff: 1 << 20, Region: dst, Len: 4096, Sum: -1}}, Direct: direct}
	if _, err := mv.ReadFile(ctx, f, long, nil); !errors.Is(err, transfer.ErrShortFile) || !errors.Is(err, ErrShortFile) {
		t.Fatalf("read past the end: %v", err)
	}
}

// sharedRegion is a file of size bytes under /dev/shm registered as a
// shared-file region (skipping the test without /dev/shm); its owner's
// descriptor truncates it. Both go at the test's end.
func sharedRegion(t *testing.T, size int64) (*os.File, *region.Host) {
	t.Helper()
	shm, err := os.CreateTemp("/dev/shm", "kvhost-truncate-")
	if err != nil {
		t.Skipf("no /dev/shm: %v", err)
	}
	t.Cleanup(func() { shm.Close(); os.Remove(shm.Name()) })
	if err := shm.Truncate(size); err != nil {
		t.Fatal(err)
	}
	r, err := region.OpenShared(int(shm.Fd()), size)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return shm, r
}

// TestMoverSurvivesTruncatedSharedFile: a client truncates the shared file
// behind a registered region before (or while) a plan moves it. Every path
// that touches the region's bytes from user space — fused checksums on a
// write, checksums overlapped on a helper goroutine, the bounce buffers'
// gather and scatter — fails the plan with region.ErrFault instead of
// crashing the process, and the mover keeps working.
func TestMoverSurvivesTruncatedSharedFile(t *testing.T) {
	ctx := context.Background()
	mv := newTestMover(t, Config{Workers: 2, BufferSize: 64 << 10, Buffers: 4})
	const size = 1 << 20
	dir := t.TempDir()
	cases := []struct {
		name    string
		write   bool
		direct  bool // plan says O_DIRECT with unaligned memory: bounce buffers
		overlap bool
	}{
		{"write, fused checksums", true, false, false},
		{"write, overlapped checksums", true, false, true},
		{"write through bounce buffers", true, true, false},
		{"read, fused checksums", false, false, false},
		{"read through bounce buffers", false, true, false},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			shm, r := sharedRegion(t, size)
			name := filepath.Join(dir, "f"+string(rune('a'+i)))
			f := openFile(t, name, 0)
			if err := f.Allocate(size); err != nil {
				t.Fatal(err)
			}
			if _, err := f.WriteAt(make([]byte, size), 0); err != nil {
				t.Fatal(err)
			}
			// The second half of the region goes away under the mapping.
			if err := shm.Truncate(size / 2); err != nil {
				t.Fatal(err)
			}
			off := int64(size/2 + 100) // unaligned: bounce buffers with O_DIRECT
			if !c.direct {
				off = size / 2
			}
			var n int64
			sums := make([]uint32, 1)
			opt := options{Direct: c.direct, Sums: sums, Overlap: c.overlap}
			done := make(chan error, 1)
			if err := mv.Pool().submit(ctx, func(w *worker) {
				done <- region.Guard(func() (err error) {
					spans := []span{{Off: 0, Buf: r.Bytes()[off : off+128<<10], Sum: 0}}
					n, err = w.do(ctx, f, spans, opt, c.write)
					return err
				})
			}); err != nil {
				t.Fatal(err)
			}
			err := <-done
			if err == nil {
				t.Fatalf("moving a truncated region succeeded (%d bytes)", n)
			}
			// A preadv into a truncated mapping fails with EFAULT in the
			// kernel; every other path faults in Go.
			if !errors.Is(err, region.ErrFault) && !errors.Is(err, unix.EFAULT) {
				t.Fatalf("error %v, want region.ErrFault or EFAULT", err)
			}
			if _, err := mv.WriteFile(ctx, f, &transfer.Plan{Extents: []transfer.Extent{{FileOff: 0, Region: r, RegionOff: 0, Len: 4096, Sum: -1}}}, nil); err != nil {
				t.Fatalf("the mover fails after a fault: %v", err)
			}
		})
	}
}

// readCounter counts the reads that reach the file itself.
type readCounter struct {
	fsys.File
	reads int
}

func (f *readCounter) ReadAt(p []byte, off int64) (int, error) {
	f.reads++
	return f.File.ReadAt(p, off)
}

func (f *readCounter) ReadvAt(bufs [][]byte, off int64) (int, error) {
	f.reads++
	return f.File.ReadvAt(bufs, off)
}

func (f *readCounter) MapRead(n int64) (*fsys.Mapping, error) { return f.File.(fsys.Mapper).MapRead(n) }

// TestMoverLoadsFromMemoryFileSystemsThroughAMapping: a load of a plan on
// a memory file system copies from a mapping of the file (fsys.Mapping
// says why) with the bytes and checksums a read gives; other plans, and
// stores, read and write the file; a file truncated before the load fails
// it with ErrShortFile, as a read would.
func TestMoverLoadsFromMemoryFileSystemsThroughAMapping(t *testing.T) {
	ctx := context.Background()
	mv := newTestMover(t, Config{Workers: 2})
	const size = 2 * fsys.MapMin
	src := hostRegion(t, "src", size)
	for i := range src.Bytes() {
		src.Bytes()[i] = byte(i*29 + i>>10)
	}
	// A file of fsys.MapMin bytes and more, or of less.
	ext := func(r region.Region, small bool) []transfer.Extent {
		n := int64(fsys.MapMin)
		if small {
			n = 1 << 20
		}
		return []transfer.Extent{
			{FileOff: 4096, Region: r, RegionOff: n / 2, Len: n, Sum: 0},
			{FileOff: 4096 + n, Region: r, RegionOff: 0, Len: 100<<10 + 7, Sum: 1},
		}
	}
	cases := []struct {
		name       string
		memory     bool
		small      bool
		wantMapped bool
	}{
		{"memory file system", true, false, true},
		{"memory file system, file smaller than fsys.MapMin", true, true, false},
		{"other file system", false, false, false},
	}
	for _, c := range cases {
		memory := c.memory
		dst := hostRegion(t, "dst", size)
		f := openFile(t, filepath.Join(t.TempDir(), "f"), 0)
		rc := &readCounter{File: f}
		ws, rs := make([]uint32, 2), make([]uint32, 2)
		if _, err := mv.For(false).WriteFile(ctx, rc, &transfer.Plan{Extents: ext(src, c.small), Sums: 2, Memory: memory}, ws); err != nil {
			t.Fatal(err)
		}
		if _, err := mv.For(false).ReadFile(ctx, rc, &transfer.Plan{Extents: ext(dst, c.small), Sums: 2, Memory: memory}, rs); err != nil {
			t.Fatal(err)
		}
		if (rc.reads == 0) != c.wantMapped {
			t.Fatalf("%s: the load read the file %d times", c.name, rc.reads)
		}
		if rs[0] != ws[0] || rs[1] != ws[1] {
			t.Fatalf("memory file system %v: load checksums %x, store's %x", memory, rs, ws)
		}
		for _, x := range ext(nil, c.small) {
			if !bytes.Equal(dst.Bytes()[x.RegionOff:x.RegionOff+x.Len], src.Bytes()[x.RegionOff:x.RegionOff+x.Len]) {
				t.Fatalf("memory file system %v: loaded bytes differ", memory)
			}
		}
		if err := unix.Ftruncate(int(f.Fd()), 100<<10); err != nil { // shorter than the plan
			t.Fatal(err)
		}
		if _, err := mv.For(false).ReadFile(ctx, rc, &transfer.Plan{Extents: ext(dst, c.small), Sums: 2, Memory: memory}, rs); !errors.Is(err, ErrShortFile) {
			t.Fatalf("memory file system %v: load of a truncated file: %v, want ErrShortFile", memory, err)
		}
	}
}

// TestMoverReportsAKernelFaultOnATruncatedRegionAsAFault: a plan whose
// region lies in a shared file truncated before the move fails with
// region.ErrFault (the server's "bad descriptor") whether the fault is
// Go's (a copy or checksum of the region's bytes) or the kernel's (a
// preadv or pwritev straight to or from the missing pages: EFAULT).
func TestMoverReportsAKernelFaultOnATruncatedRegionAsAFault(t *testing.T) {
	ctx := context.Background()
	mv := newTestMover(t, Config{Workers: 2, BufferSize: 64 << 10, Buffers: 4})
	const size = 1 << 20
	dir := t.TempDir()
	for i, c := range []struct {
		name  string
		write bool
		sum   bool
	}{
		{"read, no checksum (preadv into the region)", false, false},
		{"write, no checksum (pwritev from the region)", true, false},
		{"read, checksummed", false, true},
		{"write, checksummed", true, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			shm, r := sharedRegion(t, size)
			f := openFile(t, filepath.Join(dir, "f"+string(rune('a'+i))), 0)
			if _, err := f.WriteAt(make([]byte, size), 0); err != nil {
				t.Fatal(err)
			}
			if err := shm.Truncate(size / 2); err != nil {
				t.Fatal(err)
			}
			x := transfer.Extent{FileOff: 0, Region: r, RegionOff: size / 2, Len: 128 << 10, Sum: -1}
			p := &transfer.Plan{Extents: []transfer.Extent{x}}
			var sums []uint32
			if c.sum {
				p.Extents[0].Sum, p.Sums, sums = 0, 1, make([]uint32, 1)
			}
			move := mv.ReadFile
			if c.write {
				move = mv.WriteFile
			}
			if _, err := move(ctx, f, p, sums); !errors.Is(err, region.ErrFault) {
				t.Fatalf("error %v, want region.ErrFault", err)
			}
		})
	}
}

// TestMoverRefusesPlansThatFailTheirCheck: a plan whose extents name a
// checksum slot past its Sums, or are out of file order, or overlap, is
// refused with an error before any byte moves (transfer.Plan.Check, as
// the GPU mover does), never a worker's panic (a slot past the sums
// given is an index out of range on a worker), and the mover keeps
// working.
func TestMoverRefusesPlansThatFailTheirCheck(t *testing.T) {
	ctx := context.Background()
	mv := newTestMover(t, Config{Workers: 1})
	mem := hostRegion(t, "mem", 1<<16)
	for _, tc := range []struct {
		name    string
		extents []transfer.Extent
	}{
		{"checksum slot past the plan's", []transfer.Extent{{FileOff: 0, Region: mem, Len: 4096, Sum: 0}, {FileOff: 4096, Region: mem, Len: 4096, Sum: 1}}},
		{"out of file order", []transfer.Extent{{FileOff: 4096, Region: mem, Len: 4096, Sum: -1}, {FileOff: 0, Region: mem, RegionOff: 4096, Len: 4096, Sum: -1}}},
		{"overlapping", []transfer.Extent{{FileOff: 0, Region: mem, Len: 8192, Sum: -1}, {FileOff: 4096, Region: mem, Len: 4096, Sum: -1}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			name := filepath.Join(t.TempDir(), "f")
			f := openFile(t, name, 0)
			// Two slots given for a plan of one: the plan's own bound
			// counts, not the slots given.
			p := &transfer.Plan{Extents: tc.extents, Sums: 1}
			if _, err := mv.WriteFile(ctx, f, p, make([]uint32, 2)); err == nil {
				t.Fatal("the plan was written")
			}
			if st, err := os.Stat(name); err != nil || st.Size() != 0 {
				t.Fatalf("after the refusal the file has %v bytes (%v); want none written", st.Size(), err)
			}
			if _, err := mv.ReadFile(ctx, f, p, make([]uint32, 2)); err == nil {
				t.Fatal("the plan was read")
			}
		})
	}
	// The mover still moves a good plan.
	f := openFile(t, filepath.Join(t.TempDir(), "g"), 0)
	if n, err := mv.WriteFile(ctx, f, &transfer.Plan{Extents: []transfer.Extent{{Region: mem, Len: 4096, Sum: 0}}, Sums: 1}, make([]uint32, 1)); err != nil || n != 4096 {
		t.Fatalf("a good plan after the refusals: %d bytes, %v", n, err)
	}
}
