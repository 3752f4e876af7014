package transfer

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kvhost/kvhost/internal/fsys"
)

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

// A plan on a memory file system is read through a mapping where it is
// fsys.MapMin bytes or more; smaller plans, and plans on other file
// systems, read the file itself.
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
		end        int64
		wantMapped bool
	}{
		{"memory, MapMin bytes", true, fsys.MapMin, true},
		{"memory, less", true, fsys.MapMin - 4096, false},
		{"other file system", false, fsys.MapMin, false},
	}
	for _, c := range cases {
		p := &Plan{Extents: []Extent{{FileOff: 0, Len: c.end}}, Memory: c.memory}
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
