package clustercap

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/testlinks"
)

// TestADirNeverActsThroughALinkInPlaceOfItsDirectory: the cluster
// directory is shared by every node of the mount. Someone who can write
// the mount's root renames it away and puts a symbolic link to a
// directory outside the mount in its place, where a summary of node b
// (valid) and b's adoption file wait. No node then publishes, reads,
// flocks, opens or retires through the link: each operation fails with
// an error that names the path and wraps ELOOP, and the files outside
// are as they were, with none added.
func TestADirNeverActsThroughALinkInPlaceOfItsDirectory(t *testing.T) {
	root := t.TempDir()
	a, err := OpenDir(fsys.OS{}, root, "a")
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	sum := &Summary{Version: SummaryVersion, Node: "b", Tag: Tag("b"), Time: 1, Interval: 10, Bytes: 3, Claim: 4, Sketch: NewSketch([]Item{{5, 3}}, 8)}
	b, err := Encode(sum)
	if err != nil {
		t.Fatal(err)
	}
	outside := testlinks.NewTarget(t, map[string][]byte{"b" + summarySuffix: b, "b" + adoptSuffix: []byte("not kvhost's")})
	if ok, err := a.Adopt("b"); err != nil || !ok {
		t.Fatalf("adopt b: %v %v", ok, err)
	}
	testlinks.Swap(t, filepath.Join(root, DirName), outside.Dir)

	refused := func(what string, err error) {
		t.Helper()
		if !errors.Is(err, syscall.ELOOP) {
			t.Errorf("%s through the link: %v, want an error wrapping ELOOP", what, err)
		}
	}
	a.listing.changed = true // no touch: the read's own open is what is looked at
	refused("publish", a.Publish(&Summary{Version: SummaryVersion, Node: "a", Tag: Tag("a"), Time: 2, Interval: 10, Sketch: NewSketch(nil, 8)}))
	got, bad, err := a.ReadAll()
	if err != nil || len(got) != 0 || len(bad) != 1 {
		t.Errorf("read all: %v %v %v, want b's summary refused, not read", got, bad, err)
	} else {
		refused("read b's summary", bad[0])
	}
	_, err = a.LockFree("b")
	refused("probe b's lock", err)
	_, err = a.Retire("b")
	refused("retire b", err)
	c, err := OpenDir(fsys.OS{}, root, "c")
	if err == nil {
		c.Close()
	}
	refused("open the directory as node c", err)
	outside.Untouched(t)
}

// TestReadAllTimesALinkAtASummaryNameByTheLinkNotByItsTarget: someone who
// can write the shared cluster directory put a symbolic link at node x's
// summary name, pointing to an old file. ReadAll refuses it (no summary is
// read through a link) and reports it as a *SummaryError whose ModTime,
// which the cluster tick takes for x's last sign of life, is the link's
// own, not the old file's: a stat that followed the link made a live x
// look long dead.
func TestReadAllTimesALinkAtASummaryNameByTheLinkNotByItsTarget(t *testing.T) {
	root := t.TempDir()
	a, err := OpenDir(fsys.OS{}, root, "a")
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	old := filepath.Join(testlinks.NewTarget(t, map[string][]byte{"old": []byte("not a summary")}).Dir, "old")
	oldTime := time.Date(2001, 1, 1, 0, 0, 0, 0, time.UTC)
	if err := os.Chtimes(old, oldTime, oldTime); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(a.Path(), "x"+summarySuffix)
	testlinks.Plant(t, link, old)
	lfi, err := os.Lstat(link)
	if err != nil {
		t.Fatal(err)
	}
	_, bad, err := a.ReadAll()
	var se *SummaryError
	if err != nil || len(bad) != 1 || !errors.As(bad[0], &se) || se.Node != "x" {
		t.Fatalf("ReadAll: %v, %v; want x's link reported as a *SummaryError", bad, err)
	}
	if !se.ModTime.Equal(lfi.ModTime()) {
		t.Errorf("x's time %v, want the link's own %v (its target's is %v)", se.ModTime, lfi.ModTime(), oldTime)
	}
}
