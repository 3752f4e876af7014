package fsystest

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/kvhost/kvhost/fsys"
)

func TestPartlyFirstWrittenFindsFoliosCutByTheirFirstWrite(t *testing.T) {
	const folio = 100
	for _, c := range []struct {
		name   string
		writes [][2]int64
		want   []int64
	}{
		{"whole folios", [][2]int64{{0, 100}, {100, 300}}, nil},
		{"a header's folio, then the rest of it", [][2]int64{{10, 100}, {0, 10}}, []int64{0}},
		{"a file's last folio, written in part only", [][2]int64{{0, 100}, {100, 150}}, nil},
		{"a write that crosses into the next folio first", [][2]int64{{0, 110}, {110, 200}}, []int64{1}},
		{"pieces smaller than a folio", [][2]int64{{0, 25}, {25, 50}, {50, 100}}, []int64{0}},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := PartlyFirstWritten(c.writes, folio)
			slices.Sort(got)
			if !slices.Equal(got, c.want) {
				t.Fatalf("folios %v, want %v", got, c.want)
			}
		})
	}
}

// TestLocalLocksExcludeOnlyWithinOneClient: a flock through one
// LocalLocks excludes a second through it until the first is closed, and
// none through another LocalLocks on the same file.
func TestLocalLocksExcludeOnlyWithinOneClient(t *testing.T) {
	path := filepath.Join(t.TempDir(), "lock")
	one, other := NewLocalLocks(fsys.OS{}), NewLocalLocks(fsys.OS{})
	open := func(l *LocalLocks) fsys.File {
		t.Helper()
		f, err := l.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f
	}
	first := open(one)
	for _, c := range []struct {
		name string
		f    fsys.File
		want bool
	}{
		{"the holder again", first, true},
		{"another file of the same client", open(one), false},
		{"a file of another client", open(other), true},
	} {
		if got, err := fsys.TryLock(c.f); err != nil || got != c.want {
			t.Errorf("%s: TryLock %v, %v; want %v", c.name, got, err, c.want)
		}
	}
	first.Close()
	if got, err := fsys.TryLock(open(one)); err != nil || !got {
		t.Errorf("after the holder's close: TryLock %v, %v; want granted", got, err)
	}
}
