package transfer

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/region"
)

// memRegion is a region of n bytes that no mover touches.
type memRegion int64

func (r memRegion) ID() uint64        { return 7 }
func (r memRegion) Len() int64        { return int64(r) }
func (r memRegion) Kind() region.Kind { return region.KindDevice }

// TestPlanCheckRefusesExtentsOutOfOrderOrBounds: Check accepts a plan
// whose extents are sorted by file offset, do not overlap, lie inside
// their regions and in the file's offsets (their ends do not overflow),
// and name checksum slots that exist; it refuses every other.
func TestPlanCheckRefusesExtentsOutOfOrderOrBounds(t *testing.T) {
	r := memRegion(1 << 20)
	x := func(fileOff, regionOff, n int64) Extent {
		return Extent{FileOff: fileOff, Region: r, RegionOff: regionOff, Len: n, Sum: -1}
	}
	cases := []struct {
		name    string
		extents []Extent
		ok      bool
	}{
		{"empty", nil, true},
		{"sorted, apart", []Extent{x(0, 0, 4096), x(4096, 8192, 4096), x(1<<30, 4096, 10)}, true},
		{"overlapping", []Extent{x(0, 0, 4096), x(4095, 8192, 4096)}, false},
		{"out of order", []Extent{x(8192, 0, 10), x(0, 4096, 10)}, false},
		{"negative file offset", []Extent{x(-1, 0, 10)}, false},
		{"negative length", []Extent{x(0, 0, -1)}, false},
		{"past the region", []Extent{x(0, 1<<20-10, 11)}, false},
		{"end past the largest file offset", []Extent{x(math.MaxInt64-10, 0, 100)}, false},
		{"end past the largest file offset, then one at 0", []Extent{x(math.MaxInt64-10, 0, 100), x(0, 4096, 10)}, false},
		{"ends at the largest file offset", []Extent{x(math.MaxInt64-10, 0, 10)}, true},
		{"no such checksum slot", []Extent{{FileOff: 0, Region: r, Len: 10, Sum: 1}}, false},
	}
	for _, c := range cases {
		p := &Plan{Extents: c.extents, Sums: 1}
		err := p.Check()
		if c.ok != (err == nil) {
			t.Errorf("%s: Check() = %v, want ok %v", c.name, err, c.ok)
		}
		if err != nil && c.name == "past the region" && !errors.Is(err, region.ErrBounds) {
			t.Errorf("%s: %v, want region.ErrBounds", c.name, err)
		}
	}
}

func TestPlanEndIsPastItsLastExtent(t *testing.T) {
	cases := []struct {
		name    string
		extents []Extent
		want    int64
	}{
		{"empty", nil, 0},
		{"one", []Extent{{FileOff: 4096, Len: 100}}, 4196},
		{"several", []Extent{{FileOff: 0, Len: 10}, {FileOff: 4096, Len: 8192}, {FileOff: 1 << 20, Len: 7}}, 1<<20 + 7},
	}
	for _, c := range cases {
		if got := (&Plan{Extents: c.extents}).End(); got != c.want {
			t.Errorf("%s: End() = %d, want %d", c.name, got, c.want)
		}
	}
}

// A plan on a memory file system is read through a mapping where it
// reads fsys.MapMin bytes or more; smaller plans (a few layers far into a
// large file too), and plans on other file systems, read the file
// itself.
func TestPlanReadSourceMapsLargeMemoryPlansOnly(t *testing.T) {
	f, err := fsys.OS{}.OpenFile(filepath.Join(t.TempDir(), "f"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	want := []byte("the file's last bytes")
	if _, err := f.WriteAt(want, fsys.MapMin-int64(len(want))); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name       string
		memory     bool
		start, end int64
		wantMapped bool
	}{
		{"memory, MapMin bytes", true, 0, fsys.MapMin, true},
		{"memory, less", true, 0, fsys.MapMin - 4096, false},
		{"memory, less, ending at MapMin", true, 4096, fsys.MapMin, false},
		{"other file system", false, 0, fsys.MapMin, false},
	}
	for _, c := range cases {
		p := &Plan{Extents: []Extent{{FileOff: c.start, Len: c.end - c.start}}, Memory: c.memory}
		src, release := p.ReadSource(f)
		got := make([]byte, len(want))
		n, err := src.ReadAt(got, fsys.MapMin-int64(len(want)))
		release()
		if mapped := src != f; mapped != c.wantMapped {
			t.Errorf("%s: mapped %v, want %v", c.name, mapped, c.wantMapped)
		}
		if c.end == fsys.MapMin && (n != len(want) || err != nil || string(got) != string(want)) {
			t.Errorf("%s: ReadAt = %d, %v, %q", c.name, n, err, got)
		}
	}
}
