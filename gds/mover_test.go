//go:build linux && cgo

package gds

import (
	"bytes"
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/dl"
	"github.com/kvhost/kvhost/internal/fstype"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// scatterPlan lays pages of pageSize out in file order from random pages of
// dev; pairs of pages are kept adjacent in memory to give the mover
// extents to coalesce.
func scatterPlan(dev region.Device, pages, pageSize int, seed uint64) *transfer.Plan {
	r := rand.New(rand.NewPCG(seed, 1))
	slots := int(dev.Len()) / pageSize / 2
	perm := r.Perm(slots)
	p := &transfer.Plan{}
	for i := range pages {
		slot := perm[i/2]*2 + i%2
		p.Extents = append(p.Extents, transfer.Extent{
			FileOff: int64(i * pageSize), Region: dev, RegionOff: int64(slot * pageSize), Len: int64(pageSize), Sum: -1,
		})
	}
	return p
}

// gather returns the plan's bytes in file order, read from host memory.
func gather(p *transfer.Plan, mem []byte) []byte {
	var out []byte
	for _, x := range p.Extents {
		out = append(out, mem[x.RegionOff:x.RegionOff+x.Len]...)
	}
	return out
}

// retarget returns the plan with every extent in another region.
func retarget(p *transfer.Plan, dev region.Device) *transfer.Plan {
	q := &transfer.Plan{Sums: p.Sums, Direct: p.Direct, Extents: append([]transfer.Extent(nil), p.Extents...)}
	for i := range q.Extents {
		q.Extents[i].Region = dev
	}
	return q
}

func fill(b []byte, seed uint64) {
	r := rand.New(rand.NewPCG(seed, 2))
	for i := range b {
		b[i] = byte(r.Uint32())
	}
}

func newMover(t *testing.T, d *Driver, cfg MoverConfig) *Mover {
	t.Helper()
	m, err := d.NewMover(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

func TestMoverRoundTripsScatteredPlanThroughFakeCuFile(t *testing.T) {
	e := openFake(t, Config{}, nil)
	m := newMover(t, e.d, MoverConfig{Workers: 4, AllowCompat: true, MaxIO: 64 << 10})
	const page, pages = 16 << 10, 64
	src := newHostDevice(t, 1, 4<<20, 0)
	dst := newHostDevice(t, 2, 4<<20, 0)
	fill(src.mem, 1)
	wp := scatterPlan(src, pages, page, 3)
	roundTrip(t, m, filepath.Join(t.TempDir(), "key"), wp, src, dst)
	rp := retarget(wp, dst)
	// Pages adjacent in both file and memory coalesce into one call (at
	// most 32 runs: the plan pairs pages, and random pairs may abut).
	runs := 0
	for i, x := range rp.Extents {
		if i == 0 || rp.Extents[i-1].RegionOff+page != x.RegionOff {
			runs++
		}
	}
	if r := e.ctl.get(&e.ctl.Reads); r != int64(runs) || runs > pages/2 {
		t.Fatalf("%d cuFileRead calls for %d pages in %d runs; want %d", r, pages, runs, runs)
	}
	if bad := e.ctl.get(&e.ctl.BadHandleUses); bad != 0 {
		t.Fatalf("%d uses of dead handles", bad)
	}
}

func TestMoverSplitsLongRunsAtMaxIO(t *testing.T) {
	e := openFake(t, Config{}, nil)
	m := newMover(t, e.d, MoverConfig{Workers: 2, AllowCompat: true, MaxIO: 256 << 10})
	src := newHostDevice(t, 1, 2<<20, 0)
	fill(src.mem, 4)
	p := &transfer.Plan{Extents: []transfer.Extent{{FileOff: 0, Region: src, RegionOff: 0, Len: 2 << 20, Sum: -1}}}
	f := openFile(t, filepath.Join(t.TempDir(), "key"), os.O_RDWR)
	if _, err := m.WriteFile(context.Background(), f, p, nil); err != nil {
		t.Fatal(err)
	}
	if w := e.ctl.get(&e.ctl.Writes); w != 8 {
		t.Fatalf("%d cuFileWrite calls for 2 MiB at MaxIO 256 KiB; want 8", w)
	}
}

func TestMoverRefusesCompatMountUnlessAllowed(t *testing.T) {
	e := openFake(t, Config{}, nil)
	m := newMover(t, e.d, MoverConfig{Workers: 2})
	src := newHostDevice(t, 1, 1<<20, 0)
	p := scatterPlan(src, 8, 4096, 1)
	f := openFile(t, filepath.Join(t.TempDir(), "key"), os.O_RDWR)
	n, err := m.WriteFile(context.Background(), f, p, nil)
	if !errors.Is(err, transfer.ErrUnsupported) || n != 0 {
		t.Fatalf("WriteFile on a compat mount = %d, %v; want 0, ErrUnsupported", n, err)
	}
	if w := e.ctl.get(&e.ctl.Writes); w != 0 {
		t.Fatalf("%d writes issued on a refused mount", w)
	}
}

// A file open without O_DIRECT on a direct mount can only go through
// cuFile's POSIX (compat) path: the mover treats it as compat, and so
// answers ErrUnsupported unless AllowCompat, before anything moves.
func TestMoverTreatsABufferedFileOnADirectMountAsCompat(t *testing.T) {
	e, dir := openDirectFake(t)
	m := newMover(t, e.d, MoverConfig{Workers: 1}) // the daemon's gpu.cufile = "auto"
	src := newHostDevice(t, 1, 1<<20, 0)
	p := sparsePlan(src, 4, 4096, 1)
	f := openFile(t, filepath.Join(dir, "key"), os.O_RDWR) // no O_DIRECT
	if n, err := m.WriteFile(context.Background(), f, p, nil); !errors.Is(err, transfer.ErrUnsupported) || n != 0 {
		t.Errorf("WriteFile through a buffered descriptor on a direct mount = %d, %v; want 0, ErrUnsupported", n, err)
	}
	if w := e.ctl.get(&e.ctl.Writes); w != 0 {
		t.Errorf("%d writes issued", w)
	}
	mc := newMover(t, e.d, MoverConfig{Workers: 1, AllowCompat: true})
	if n, err := mc.WriteFile(context.Background(), f, p, nil); err != nil || n != p.Bytes() {
		t.Errorf("WriteFile with AllowCompat = %d, %v; want %d", n, err, p.Bytes())
	}
}

// openDirectFake is openFake with nvidia-fs loaded, and a directory whose
// mount cuFile then serves in direct mode (ext4, xfs); the test is
// skipped where the test directory's mount is not one.
func openDirectFake(t *testing.T) (*fakeEnv, string) {
	t.Helper()
	nvfs := filepath.Join(t.TempDir(), "nvidia-fs-version")
	if err := os.WriteFile(nvfs, []byte("2.17\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	e := openFake(t, Config{NVFSPath: nvfs}, nil)
	dir := t.TempDir()
	if c, err := e.d.ProbeDir(dir); err != nil || c.Mode != ModeDirect {
		t.Skipf("the test directory's mount is not direct for cuFile: %v, %v", c, err)
	}
	return e, dir
}

// On a direct mount (nvidia-fs, a file open with O_DIRECT), a plan with a
// piece whose device address is not 4 KiB aligned is passed on
// (ErrUnsupported) before anything moves: nvidia-fs DMAs only to 4 KiB
// aligned GPU addresses (EINVAL otherwise), so cuFile would fail the
// piece or bounce it through its own GPU buffers. Aligned pieces are moved, and so is a
// file open without O_DIRECT there, which cuFile moves in compat mode
// (a host bounce, where the address does not matter).
func TestMoverPassesOnAPieceAtAnUnalignedDeviceAddressOnADirectMount(t *testing.T) {
	for _, tc := range []struct {
		name     string
		off      int64 // the first piece's offset in the region
		buffered bool  // the file is open without O_DIRECT
		moved    bool
	}{
		{"unaligned", 512, false, false},
		{"aligned", 4096, false, true},
		{"unaligned, file open without O_DIRECT", 512, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, dir := openDirectFake(t)
			m := newMover(t, e.d, MoverConfig{Workers: 2, AllowCompat: true, IO: IOPerCall})
			src := newHostDevice(t, 1, 1<<20, 0)
			fill(src.mem, 5)
			// File pieces 4 KiB aligned; memory never adjacent: one piece per extent.
			p := &transfer.Plan{Direct: !tc.buffered}
			for i := range int64(4) {
				p.Extents = append(p.Extents, transfer.Extent{FileOff: i * 8192, Region: src, RegionOff: tc.off + i*64<<10, Len: 8192, Sum: -1})
			}
			flags := os.O_RDWR | unix.O_DIRECT
			if tc.buffered {
				flags = os.O_RDWR
			}
			f := openFile(t, filepath.Join(dir, "key"), flags)
			ctx := context.Background()
			nw, werr := m.WriteFile(ctx, f, p, nil)
			nr, rerr := m.ReadFile(ctx, f, p, nil)
			if tc.moved {
				if werr != nil || nw != p.Bytes() || rerr != nil || nr != p.Bytes() {
					t.Fatalf("WriteFile = %d, %v; ReadFile = %d, %v; want %d moved each way", nw, werr, nr, rerr, p.Bytes())
				}
				return
			}
			if !errors.Is(werr, transfer.ErrUnsupported) || nw != 0 || !errors.Is(rerr, transfer.ErrUnsupported) || nr != 0 {
				t.Errorf("WriteFile = %d, %v; ReadFile = %d, %v; want 0, ErrUnsupported each way", nw, werr, nr, rerr)
			}
			c := e.ctl
			if r, w := c.get(&c.Reads), c.get(&c.Writes); r != 0 || w != 0 {
				t.Errorf("%d reads, %d writes for plans passed on; want none", r, w)
			}
		})
	}
}

// A plan on an O_DIRECT file (Plan.Direct) whose pieces are not 4 KiB
// multiples in file offset or length, as the engine makes for a
// BlockBytes that is not one (MLA's 16 × 576 × 2 = 18432), is passed on
// (ErrUnsupported) before anything is registered or moved: cuFile would
// hand it to O_DIRECT unchanged (EINVAL) and never write the plan's zero
// tail, which the staging pipeline does. Aligned plans are moved.
func TestMoverPassesOnADirectPlanWithUnalignedPieces(t *testing.T) {
	const hl = 4096
	for _, tc := range []struct {
		name    string
		block   int64
		aligned bool
	}{
		{"2500-byte blocks", 2500, false},
		{"MLA 18432-byte blocks", 18432, false},
		{"4 KiB blocks", 4096, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := openFake(t, Config{}, nil)
			m := newMover(t, e.d, MoverConfig{Workers: 2, AllowCompat: true, IO: IOPerCall})
			src := newHostDevice(t, 1, 4<<20, 0)
			fill(src.mem, 9)
			p := &transfer.Plan{Direct: true}
			for i := range int64(8) {
				// Memory 4 KiB aligned and never adjacent: one piece per block.
				p.Extents = append(p.Extents, transfer.Extent{FileOff: hl + i*tc.block, Region: src, RegionOff: i * 64 << 10, Len: tc.block, Sum: -1})
			}
			f, err := fsys.OS{}.OpenFile(filepath.Join(t.TempDir(), "key"), os.O_RDWR|os.O_CREATE|unix.O_DIRECT, 0o600)
			if err != nil {
				t.Skipf("no O_DIRECT here: %v", err)
			}
			t.Cleanup(func() { f.Close() })
			ctx := context.Background()
			n, err := m.WriteFile(ctx, f, p, nil)
			if tc.aligned {
				if err != nil || n != p.Bytes() {
					t.Fatalf("WriteFile of an aligned Direct plan = %d, %v; want %d", n, err, p.Bytes())
				}
				return
			}
			if !errors.Is(err, transfer.ErrUnsupported) || n != 0 {
				t.Errorf("WriteFile of a Direct plan of %d-byte blocks = %d, %v; want 0, ErrUnsupported", tc.block, n, err)
			}
			if n, err := m.ReadFile(ctx, f, p, nil); !errors.Is(err, transfer.ErrUnsupported) || n != 0 {
				t.Errorf("ReadFile of a Direct plan of %d-byte blocks = %d, %v; want 0, ErrUnsupported", tc.block, n, err)
			}
			c := e.ctl
			if r, w, reg := c.get(&c.Reads), c.get(&c.Writes), c.get(&c.RegisterCalls); r != 0 || w != 0 || reg != 0 {
				t.Errorf("%d reads, %d writes, %d registrations for plans passed on; want none", r, w, reg)
			}
		})
	}
}

func TestMoverFallsBackOnUnusableMountAndLogsOnce(t *testing.T) {
	e := openFake(t, Config{}, func(c *fakeCtl) { c.set(&c.RegisterError, int64(StatusHandleNotRegistered)) })
	m := newMover(t, e.d, MoverConfig{Workers: 2, AllowCompat: true})
	src := newHostDevice(t, 1, 1<<20, 0)
	p := scatterPlan(src, 8, 4096, 1)
	dir := t.TempDir()
	for i := range 3 {
		f := openFile(t, filepath.Join(dir, string(rune('a'+i))), os.O_RDWR)
		n, err := m.WriteFile(context.Background(), f, p, nil)
		if !errors.Is(err, transfer.ErrUnsupported) || n != 0 {
			t.Fatalf("transfer %d on an unusable mount = %d, %v; want 0, ErrUnsupported", i, n, err)
		}
		if i == 0 && !errors.Is(err, StatusHandleNotRegistered) {
			t.Fatalf("first refusal %v does not carry the registration status", err)
		}
	}
	if c := e.ctl.get(&e.ctl.RegisterCalls); c != 1 {
		t.Fatalf("%d registration attempts on an unusable mount; want 1 (the probe)", c)
	}
	logs := e.logs.String()
	if got := strings.Count(logs, "unusable: "); got != 1 || !strings.Contains(logs, "CU_FILE_HANDLE_NOT_REGISTERED (5027)") {
		t.Fatalf("unusable mount reported %d times, want once; logs:\n%s", got, logs)
	}
	c, err := e.d.capability(dir)
	if err != nil || c.Mode != ModeUnusable || !errors.Is(c.Err, StatusHandleNotRegistered) {
		t.Fatalf("Capability = %+v, %v; want unusable with 5027", c, err)
	}
}

func TestProbeDirFindsCompatModeAndCachesIt(t *testing.T) {
	e := openFake(t, Config{}, nil)
	dir := t.TempDir()
	c, err := e.d.ProbeDir(dir)
	if err != nil || c.Mode != ModeCompat || c.Err != nil {
		t.Fatalf("ProbeDir = %+v, %v; want compat", c, err)
	}
	if live := e.ctl.get(&e.ctl.HandlesLive); live != 0 {
		t.Fatalf("probe left %d handles registered", live)
	}
	if _, err := e.d.capability(dir); err != nil {
		t.Fatal(err)
	}
	if calls := e.ctl.get(&e.ctl.RegisterCalls); calls != 1 {
		t.Fatalf("%d registrations; the second look must come from the cache", calls)
	}
	if left, _ := filepath.Glob(filepath.Join(dir, ".kvhost-cufile-probe-*")); len(left) != 0 {
		t.Fatalf("probe files left behind: %v", left)
	}
}

// A registration failure that says nothing of the mount (settles) is the
// probe's error, not the mount's capability: the next probe settles it.
func TestProbeDirDoesNotSettleOnATransientFailure(t *testing.T) {
	e := openFake(t, Config{}, func(c *fakeCtl) { c.set(&c.RegisterError, int64(statusNoMemory)) })
	dir := t.TempDir()
	if c, err := e.d.ProbeDir(dir); !errors.Is(err, statusNoMemory) {
		t.Errorf("ProbeDir with cuFile out of memory = %v, %v; want the CU_FILE_NOMEM_ERROR as its error", c, err)
	}
	e.ctl.set(&e.ctl.RegisterError, 0)
	if c, err := e.d.ProbeDir(dir); err != nil || c.Mode != ModeCompat {
		t.Errorf("ProbeDir once registration works = %v, %v; want compat", c, err)
	}
}

func TestProbeDirReportsDirectWithNVFSAndUnusableWithoutCompat(t *testing.T) {
	nvfs := filepath.Join(t.TempDir(), "version")
	if err := os.WriteFile(nvfs, []byte("2.17\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	e := openFake(t, Config{NVFSPath: nvfs}, nil)
	if got := e.d.Properties().Mode(); got != ModeDirect {
		t.Fatalf("platform mode with nvidia-fs = %v, want direct", got)
	}
	dir := t.TempDir()
	var sfs unix.Statfs_t
	if err := unix.Statfs(dir, &sfs); err != nil {
		t.Fatal(err)
	}
	want := ModeCompat
	if k, _ := fstype.Of(int64(sfs.Type)); k.CuFileDirect {
		want = ModeDirect
	}
	if c, err := e.d.ProbeDir(dir); err != nil || c.Mode != want {
		t.Fatalf("ProbeDir on %s = %+v, %v; want %v", fstype.Name(int64(sfs.Type)), c, err, want)
	}

	e2 := openFake(t, Config{}, func(c *fakeCtl) { c.set(&c.NoCompat, 1) })
	if p := e2.d.Properties(); p.CompatAllowed || p.Mode() != ModeUnusable {
		t.Fatalf("properties without compat = %+v, want unusable", p)
	}
	if c, err := e2.d.ProbeDir(t.TempDir()); err != nil || c.Mode != ModeUnusable {
		t.Fatalf("ProbeDir without nvidia-fs and compat = %+v, %v; want unusable", c, err)
	}
}

func TestOpenReadsPropertiesAndCloseReleasesEverything(t *testing.T) {
	e := openFake(t, Config{}, nil)
	p := e.d.Properties()
	if p.Version != 1151 || !p.CompatAllowed || p.CompatSource != "properties" || p.NVFSLoaded ||
		p.MaxDirectIO != 16<<20 || p.MaxBatchIO != 128 || p.Library != e.lib || p.Mode() != ModeCompat {
		t.Fatalf("Properties = %+v", p)
	}
	m := newMover(t, e.d, MoverConfig{Workers: 2, AllowCompat: true})
	src := newHostDevice(t, 1, 1<<20, 0)
	f := openFile(t, filepath.Join(t.TempDir(), "key"), os.O_RDWR)
	if _, err := m.WriteFile(context.Background(), f, scatterPlan(src, 8, 4096, 1), nil); err != nil {
		t.Fatal(err)
	}
	if l := e.ctl.get(&e.ctl.HandlesLive); l != 1 {
		t.Fatalf("before close: %d handles live; want 1", l)
	}
	ctl := e.ctl
	if err := e.d.Close(); err != nil {
		t.Fatal(err)
	}
	if l, c := ctl.get(&ctl.HandlesLive), ctl.get(&ctl.DriverCloses); l != 0 || c != 1 {
		t.Fatalf("after close: %d handles live, %d driver closes; want 0, 1", l, c)
	}
	if _, err := m.WriteFile(context.Background(), f, scatterPlan(src, 8, 4096, 1), nil); !errors.Is(err, errClosed) {
		t.Fatalf("WriteFile after Close = %v, want errClosed", err)
	}
}

func TestOpenFailsWhenARequiredSymbolIsMissing(t *testing.T) {
	lib := buildFake(t, "-DFAKE_NO_READ")
	_, err := Open(Config{LibraryPaths: []string{lib}})
	if !errors.Is(err, ErrUnavailable) || !errors.Is(err, dl.ErrSymbol) || !strings.Contains(err.Error(), "cuFileRead") {
		t.Fatalf("Open of a library without cuFileRead = %v; want ErrUnavailable, dl.ErrSymbol naming cuFileRead", err)
	}
}

func TestOpenFailsWhenDriverOpenFails(t *testing.T) {
	lib := buildFake(t)
	ctl := fakeControl(t, lib)
	ctl.set(&ctl.DriverOpenError, int64(statusDriverNotInitialized))
	_, err := Open(Config{LibraryPaths: []string{lib}})
	if !errors.Is(err, ErrUnavailable) || !errors.Is(err, statusDriverNotInitialized) {
		t.Fatalf("Open with cuFileDriverOpen failing = %v", err)
	}
}

func TestMoverReadFailuresFailTheTransfer(t *testing.T) {
	tests := []struct {
		name  string
		setup func(c *fakeCtl, total int64)
		check func(err error) bool
	}{
		{"cufile status midway", func(c *fakeCtl, total int64) {
			c.set(&c.ReadFailCode, int64(statusInternalError))
			c.set(&c.ReadFailAfter, total/2)
		}, func(err error) bool { return errors.Is(err, statusInternalError) }},
		{"errno midway", func(c *fakeCtl, total int64) {
			c.set(&c.ReadFailCode, -1)
			c.set(&c.ReadFailAfter, total/2)
		}, func(err error) bool { return errors.Is(err, syscall.EIO) }},
		{"negated errno midway", func(c *fakeCtl, total int64) {
			// cuFile's compat path returns -errno itself, as its
			// asynchronous I/O does: -5 is EIO, not a Status.
			c.set(&c.ReadFailCode, int64(syscall.EIO))
			c.set(&c.ReadFailAfter, total/2)
		}, func(err error) bool { return errors.Is(err, syscall.EIO) }},
		{"short file", func(c *fakeCtl, total int64) {
			c.set(&c.ReadTruncateAt, total/2+100)
		}, func(err error) bool {
			return errors.Is(err, io.ErrUnexpectedEOF) && errors.Is(err, transfer.ErrShortFile)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := openFake(t, Config{}, nil)
			m := newMover(t, e.d, MoverConfig{Workers: 1, AllowCompat: true, MaxIO: 8192})
			src := newHostDevice(t, 1, 1<<20, 0)
			fill(src.mem, 5)
			p := scatterPlan(src, 32, 8192, 3)
			path := filepath.Join(t.TempDir(), "key")
			f := openFile(t, path, os.O_RDWR)
			if _, err := m.WriteFile(context.Background(), f, p, nil); err != nil {
				t.Fatal(err)
			}
			tt.setup(e.ctl, p.Bytes())
			dst := newHostDevice(t, 2, 1<<20, 0)
			n, err := m.ReadFile(context.Background(), f, retarget(p, dst), nil)
			if err == nil || n >= p.Bytes() {
				t.Fatalf("ReadFile = %d, %v; a failed read reported success", n, err)
			}
			if errors.Is(err, transfer.ErrUnsupported) || !tt.check(err) {
				t.Fatalf("ReadFile error %v: wrong kind (must fail, not fall back)", err)
			}
		})
	}
}

func TestMoverWriteFailureFailsAndShortWritesComplete(t *testing.T) {
	e := openFake(t, Config{}, nil)
	m := newMover(t, e.d, MoverConfig{Workers: 2, AllowCompat: true})
	src := newHostDevice(t, 1, 1<<20, 0)
	fill(src.mem, 6)
	p := scatterPlan(src, 32, 8192, 4)
	f := openFile(t, filepath.Join(t.TempDir(), "key"), os.O_RDWR)

	e.ctl.set(&e.ctl.WriteShort, 1)
	if n, err := m.WriteFile(context.Background(), f, p, nil); err != nil || n != p.Bytes() {
		t.Fatalf("WriteFile with short writes = %d, %v; want %d", n, err, p.Bytes())
	}
	dst := newHostDevice(t, 2, 1<<20, 0)
	rp := retarget(p, dst)
	if _, err := m.ReadFile(context.Background(), f, rp, nil); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(gather(rp, dst.mem), gather(p, src.mem)) {
		t.Fatal("short writes lost bytes")
	}
	e.ctl.set(&e.ctl.WriteShort, 0)
	e.ctl.set(&e.ctl.WriteFailAfter, e.ctl.get(&e.ctl.BytesWritten)+p.Bytes()/2)
	n, err := m.WriteFile(context.Background(), f, p, nil)
	if err == nil || !errors.Is(err, statusIOError) || errors.Is(err, transfer.ErrUnsupported) || n >= p.Bytes() {
		t.Fatalf("WriteFile failing midway = %d, %v; want a CU_FILE_IO_ERROR failure", n, err)
	}
}

func TestMoverRejectsHostRegionsAsUnsupported(t *testing.T) {
	e := openFake(t, Config{}, nil)
	m := newMover(t, e.d, MoverConfig{Workers: 1, AllowCompat: true})
	host, err := region.NewHost("gds-test", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer host.Close()
	p := &transfer.Plan{Extents: []transfer.Extent{{Region: host, Len: 4096, Sum: -1}}}
	f := openFile(t, filepath.Join(t.TempDir(), "key"), os.O_RDWR)
	if n, err := m.WriteFile(context.Background(), f, p, nil); !errors.Is(err, transfer.ErrUnsupported) || n != 0 {
		t.Fatalf("WriteFile of host memory = %d, %v; want ErrUnsupported", n, err)
	}
}

func TestMoverBindsEachWorkerToItsDeviceOncePerDevice(t *testing.T) {
	var binds atomic.Int64
	var mu sync.Mutex
	tids := map[int]map[int]int{} // tid → ordinal → binds
	bind := func(ordinal int) error {
		binds.Add(1)
		mu.Lock()
		defer mu.Unlock()
		tid := unix.Gettid()
		if tids[tid] == nil {
			tids[tid] = map[int]int{}
		}
		tids[tid][ordinal]++
		return nil
	}
	e := openFake(t, Config{BindDevice: bind}, nil)
	const workers = 3
	m := newMover(t, e.d, MoverConfig{Workers: workers, AllowCompat: true, MaxIO: 4096})
	mu.Lock()
	clear(tids)
	mu.Unlock()
	dev := newHostDevice(t, 1, 1<<20, 1)
	p := scatterPlan(dev, 16, 4096, 1)
	dir := t.TempDir()
	for i := range 10 {
		f := openFile(t, filepath.Join(dir, string(rune('a'+i))), os.O_RDWR)
		if _, err := m.WriteFile(context.Background(), f, p, nil); err != nil {
			t.Fatal(err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(tids) > workers {
		t.Fatalf("cuFile work ran on %d threads, more than the %d workers", len(tids), workers)
	}
	for tid, byDev := range tids {
		if byDev[1] != 1 || len(byDev) != 1 {
			t.Fatalf("thread %d bound %v; want device 1 exactly once", tid, byDev)
		}
	}
}

func TestMoverForgetDropsTheHandle(t *testing.T) {
	e := openFake(t, Config{}, nil)
	m := newMover(t, e.d, MoverConfig{Workers: 2, AllowCompat: true})
	src := newHostDevice(t, 1, 1<<20, 0)
	p := scatterPlan(src, 8, 4096, 1)
	f := openFile(t, filepath.Join(t.TempDir(), "key"), os.O_RDWR)
	for range 3 {
		if _, err := m.WriteFile(context.Background(), f, p, nil); err != nil {
			t.Fatal(err)
		}
	}
	if r := e.ctl.get(&e.ctl.HandlesRegistered); r != 1 {
		t.Fatalf("%d registrations for three transfers of one file; want 1", r)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	m.Forget(fsys.FileID{Dev: uint64(st.Dev), Ino: st.Ino})
	if l := e.ctl.get(&e.ctl.HandlesLive); l != 0 {
		t.Fatalf("%d handles live after Forget", l)
	}
	if _, err := m.WriteFile(context.Background(), f, p, nil); err != nil {
		t.Fatal(err)
	}
	if r := e.ctl.get(&e.ctl.HandlesRegistered); r != 2 {
		t.Fatalf("%d registrations after Forget and another transfer; want 2", r)
	}
}

func TestMoverCanceledContextMovesNothing(t *testing.T) {
	e := openFake(t, Config{}, nil)
	m := newMover(t, e.d, MoverConfig{Workers: 2, AllowCompat: true})
	src := newHostDevice(t, 1, 1<<20, 0)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	f := openFile(t, filepath.Join(t.TempDir(), "key"), os.O_RDWR)
	if n, err := m.WriteFile(ctx, f, scatterPlan(src, 8, 4096, 1), nil); !errors.Is(err, context.Canceled) || n != 0 {
		t.Fatalf("WriteFile with a canceled context = %d, %v", n, err)
	}
	if w := e.ctl.get(&e.ctl.Writes); w != 0 {
		t.Fatalf("%d writes after cancellation", w)
	}
}

// gatedRegisterFake's registration of a file that has a gate says so on
// registering (the file's inode number) and waits until the gate is
// closed: a registration that takes long (a network file system that does
// not answer) holds its worker. It counts writes by inode number.
type gatedRegisterFake struct {
	*goFake
	registering chan uint64
	gates       map[uint64]chan struct{} // by inode number; fixed before the driver opens
	writes      map[uint64]int           // guarded by goFake.mu
}

func (g *gatedRegisterFake) handleRegister(fd int) (uintptr, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err == nil {
		if gate, ok := g.gates[st.Ino]; ok {
			g.registering <- st.Ino
			<-gate
		}
	}
	return g.goFake.handleRegister(fd)
}

func (g *gatedRegisterFake) write(h, b uintptr, n, o, bo int64) (int64, error) {
	g.mu.Lock()
	var st unix.Stat_t
	if fd, ok := g.live[h]; ok && unix.Fstat(fd, &st) == nil {
		g.writes[st.Ino]++
	}
	g.mu.Unlock()
	return g.goFake.write(h, b, n, o, bo)
}

// TestMoverEndsACanceledJobWithoutWaitingForWorkQueuedBeforeIt: a job
// whose context is done while its tasks wait behind other jobs' work
// (here registrations that hold the only worker) ends at once, with the
// context's error: its queued tasks never run, so nothing of it moves,
// and no handle is registered for it.
func TestMoverEndsACanceledJobWithoutWaitingForWorkQueuedBeforeIt(t *testing.T) {
	tests := []struct {
		name string
		// pieces says which of the job's tasks wait: its pieces (its
		// file registered, the worker then taken by another job's
		// registration), else its file's registration.
		pieces bool
		// registrations is how many files are registered in the end:
		// the canceled job's only where its registration ran.
		registrations uint64
	}{
		{"its file's registration queued", false, 1},
		{"its pieces queued", true, 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			files := map[string]fsys.File{}
			g := &gatedRegisterFake{goFake: newGoFake(), registering: make(chan uint64, 3), gates: map[uint64]chan struct{}{}, writes: map[uint64]int{}}
			for _, name := range []string{"held", "then", "canceled"} {
				f := openFile(t, filepath.Join(dir, name), os.O_RDWR)
				files[name] = f
				if name != "canceled" {
					g.gates[fdIno(t, int(f.Fd()))] = make(chan struct{})
				}
			}
			d := openGoAPI(t, g)
			m := newMover(t, d, MoverConfig{Workers: 1, AllowCompat: true})
			src := newHostDevice(t, 1, 1<<20, 0)
			p := sparsePlan(src, 2, 4096, 1)
			type result struct {
				name string
				n    int64
				err  error
			}
			res := make(chan result, 3)
			start := func(ctx context.Context, name string) {
				go func() {
					n, err := m.WriteFile(ctx, files[name], p, nil)
					res <- result{name, n, err}
				}()
			}
			open := func(name string) {
				gate := g.gates[fdIno(t, int(files[name].Fd()))]
				select {
				case <-gate:
				default:
					close(gate)
				}
			}
			defer func() { // whatever fails, the registrations end before the mover closes
				open("held")
				open("then")
			}()
			queued := func(n int) func() bool { return func() bool { return len(m.tasks) == n } }

			start(context.Background(), "held")
			<-g.registering // the worker is held
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			start(ctx, "canceled")
			waitFor(t, "the canceled job's registration queued", queued(1))
			jobs := 2
			if tt.pieces {
				// "then" registers after "canceled" and holds the
				// worker while "canceled"'s pieces wait behind it
				// (with "held"'s).
				start(context.Background(), "then")
				jobs++
				waitFor(t, "the next job's registration queued", queued(2))
				open("held")
				<-g.registering
				waitFor(t, "the canceled job's pieces queued", queued(2*len(p.Extents)))
			}
			cancel()
			var r result
			waitFor(t, "the canceled job ending", func() bool {
				select {
				case r = <-res:
					return true
				default:
					return false
				}
			})
			if r.name != "canceled" || !errors.Is(r.err, context.Canceled) || errors.Is(r.err, transfer.ErrUnsupported) || r.n != 0 {
				t.Fatalf("job %s ended first: %d, %v; want canceled: 0, context.Canceled (not passed on)", r.name, r.n, r.err)
			}
			open("held")
			open("then")
			for range jobs - 1 {
				if r := <-res; r.err != nil || r.n != p.Bytes() {
					t.Errorf("job %s = %d, %v; want %d, nil", r.name, r.n, r.err, p.Bytes())
				}
			}
			g.mu.Lock()
			defer g.mu.Unlock()
			if n := g.writes[fdIno(t, int(files["canceled"].Fd()))]; n != 0 {
				t.Errorf("%d writes for the canceled job", n)
			}
			if n := d.HandleStats().Registrations; n != tt.registrations {
				t.Errorf("%d files registered; want %d", n, tt.registrations)
			}
		})
	}
}

func TestMoverConcurrentJobsOnManyFiles(t *testing.T) {
	e := openFake(t, Config{MaxHandles: 4}, nil)
	m := newMover(t, e.d, MoverConfig{Workers: 4, AllowCompat: true, MaxIO: 8192})
	src := newHostDevice(t, 1, 2<<20, 0)
	fill(src.mem, 8)
	dir := t.TempDir()
	const files, jobs = 12, 6
	var wg sync.WaitGroup
	for j := range jobs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			dst := newHostDevice(t, uint64(10+j), 2<<20, 0)
			for i := range files {
				p := scatterPlan(src, 16, 8192, uint64(i))
				f := openFile(t, filepath.Join(dir, string(rune('a'+i))+string(rune('0'+j))), os.O_RDWR)
				if _, err := m.WriteFile(context.Background(), f, p, nil); err != nil {
					t.Error(err)
					return
				}
				rp := retarget(p, dst)
				if _, err := m.ReadFile(context.Background(), f, rp, nil); err != nil {
					t.Error(err)
					return
				}
				if !bytes.Equal(gather(rp, dst.mem), gather(p, src.mem)) {
					t.Errorf("job %d file %d: bytes differ", j, i)
					return
				}
			}
		}()
	}
	wg.Wait()
	if bad := e.ctl.get(&e.ctl.BadHandleUses); bad != 0 {
		t.Fatalf("%d uses of dead handles", bad)
	}
	if st := e.d.HandleStats(); st.Cached > 4 || st.Evictions == 0 {
		t.Fatalf("handle stats %+v: want at most 4 cached and evictions", st)
	}
}

// bindWait bounds the waits of the binds in
// TestMoverCountsJobsFailingWithAStickyCUDAErrorAsDeviceFaults for each
// other: a hang guard, never reached by a mover that runs both units.
const bindWait = 60 * time.Second

// TestMoverCountsJobsFailingWithAStickyCUDAErrorAsDeviceFaults: a job that
// fails with a sticky CUDA error (a CUresult cuFile reports with
// CU_FILE_CUDA_DRIVER_ERROR, or a failed binding of a worker to the
// device) counts once as a fault of the device its failing piece is on,
// and the first is logged; other failures count nothing, nor does a job
// the mover passes on (transfer.ErrUnsupported: the staging pipeline runs
// it, and counts its own fault).
func TestMoverCountsJobsFailingWithAStickyCUDAErrorAsDeviceFaults(t *testing.T) {
	const illegalAddress, outOfMemory = 700, 2 // CUresults
	submitFails := func(cu int64) func(c *fakeCtl) {
		return func(c *fakeCtl) {
			c.set(&c.CUError, cu)
			c.set(&c.BatchSubmitError, int64(statusCUDADriverError))
		}
	}
	tests := []struct {
		name        string
		devices     []int // the plan's regions' devices, in file order
		setup       func(c *fakeCtl)
		bindBroken  bool   // binding a thread to device 1 fails with a sticky error
		unsupported bool   // the mover passes the job on
		want        uint64 // device 1's faults after the job
		// bind0: binding a thread to device 0 fails with this error (not
		// sticky), where not nil; the job's error may then be either.
		bind0 error
	}{
		{"batch submission fails with a sticky CUresult", []int{1}, submitFails(illegalAddress), false, false, 1, nil},
		{"batch submission fails with a CUresult that is not sticky", []int{1}, submitFails(outOfMemory), false, false, 0, nil},
		{"a batch entry fails with a CUDA driver error (no CUresult)", []int{1}, func(c *fakeCtl) {
			c.set(&c.BatchFailCode, int64(statusCUDADriverError))
			c.set(&c.BatchFailEntry, c.get(&c.BatchEntries)+1)
		}, false, false, 0, nil},
		{"binding a worker to the second device of a plan fails", []int{0, 1}, nil, true, false, 1, nil},
		{"binding for the file's registration fails", []int{1}, nil, true, true, 0, nil},
		{"device 0 fails with an error that is not sticky, device 1 with a sticky one", []int{0, 1}, nil, true, false, 1,
			&cuda.CallError{Func: "cudaSetDevice", Code: cuda.ErrorInvalidValue}},
		{"the file's registration fails with a sticky CUresult", []int{1}, func(c *fakeCtl) {
			c.set(&c.CUError, illegalAddress)
			c.set(&c.RegisterError, int64(statusCUDADriverError))
		}, false, true, 0, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// The file's registration binds the plan's first device, 0:
			// bind0 fails the binds after it, the units'. Device 0's
			// failing bind waits until device 1's unit is binding (the
			// mover stops queueing units after a failure, so device 1's
			// might never run), and device 1's until device 0 failed (so
			// that device 0's error is the job's first). A mover that
			// runs both units does both without help from the clock; the
			// waits are bounded (a hang guard, long enough for any slow
			// machine) only so that a mover that runs them otherwise
			// still ends, and then fails the checks below.
			var armed atomic.Bool
			var binds0 atomic.Int64
			tried1, failed0 := make(chan struct{}), make(chan struct{})
			var once1, once0 sync.Once
			bind := func(ordinal int) error {
				switch {
				case tt.bindBroken && ordinal == 1:
					if tt.bind0 != nil {
						once1.Do(func() { close(tried1) })
						select {
						case <-failed0:
						case <-time.After(bindWait):
						}
					}
					return &cuda.CallError{Func: "cudaSetDevice", Code: cuda.ErrorIllegalAddress}
				case ordinal == 0 && tt.bind0 != nil && armed.Load() && binds0.Add(1) > 1:
					select {
					case <-tried1:
					case <-time.After(bindWait):
					}
					once0.Do(func() { close(failed0) })
					return tt.bind0
				}
				return nil
			}
			e := openFake(t, Config{BindDevice: bind}, tt.setup)
			m := newMover(t, e.d, MoverConfig{Workers: 2, AllowCompat: true, IO: IOBatch, BatchSize: 16})
			armed.Store(true)
			p := &transfer.Plan{}
			const pages, pageSize = 48, 4096
			for i, ordinal := range tt.devices {
				for _, x := range sparsePlan(newHostDevice(t, uint64(i+1), 1<<20, ordinal), pages, pageSize, uint64(i)).Extents {
					x.FileOff += int64(i * pages * pageSize)
					p.Extents = append(p.Extents, x)
				}
			}
			f := openFile(t, filepath.Join(t.TempDir(), "key"), os.O_RDWR)
			_, err := m.WriteFile(context.Background(), f, p, nil)
			if err == nil || errors.Is(err, transfer.ErrUnsupported) != tt.unsupported {
				t.Fatalf("WriteFile: %v; want a failure, passed on: %v", err, tt.unsupported)
			}
			if sticky := errors.Is(err, cuda.ErrSticky); !tt.unsupported && tt.bind0 == nil && sticky != (tt.want > 0) {
				t.Fatalf("WriteFile: %v; sticky %v, want %v", err, sticky, tt.want > 0)
			}
			if f := m.DeviceFaults(); f[0] != 0 || f[1] != tt.want {
				t.Fatalf("faults %v; want %d on device 1, none on device 0", f, tt.want)
			}
			if logged := strings.Contains(e.logs.String(), "sticky CUDA error"); logged != (tt.want > 0) {
				t.Fatalf("the fault logged: %v, want %v; log:\n%s", logged, tt.want > 0, e.logs)
			}
		})
	}
}
