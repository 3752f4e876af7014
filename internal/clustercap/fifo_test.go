package clustercap

import (
	"errors"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/testwait"
)

// TestReadAllOfANamedPipeAtASummaryNameNeitherWaitsNorStopsTheOthers:
// someone who can write the shared cluster directory put a named pipe
// at node x's summary name. ReadAll returns: it reports x's entry as a
// *SummaryError wrapping ErrSummary and naming the path, and still reads
// node b's summary. A read that waited for a writer of the pipe would
// hold every later cluster tick of the node.
func TestReadAllOfANamedPipeAtASummaryNameNeitherWaitsNorStopsTheOthers(t *testing.T) {
	root := t.TempDir()
	b := &Summary{Version: SummaryVersion, Node: "b", Tag: Tag("b"), Time: 1, Interval: 10, Bytes: 3, Claim: 4, Sketch: NewSketch([]Item{{5, 3}}, 8)}
	if err := openAndPublish(fsys.OS{}, root, b); err != nil {
		t.Fatal(err)
	}
	a, err := OpenDir(fsys.OS{}, root, "a")
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	pipe := filepath.Join(a.Path(), "x"+summarySuffix)
	if err := syscall.Mkfifo(pipe, 0o644); err != nil {
		t.Fatal(err)
	}
	testwait.ReturnsDespitePipe(t, "ReadAll", pipe, func() {
		got, bad, err := a.ReadAll()
		if err != nil || len(got) != 1 || got[0].Node != "b" {
			t.Errorf("ReadAll: %v, %v; want b's summary read past the pipe", got, err)
		}
		var se *SummaryError
		if len(bad) != 1 || !errors.As(bad[0], &se) || se.Node != "x" || !errors.Is(se, ErrSummary) || !strings.Contains(se.Error(), pipe) {
			t.Errorf("errors %v, want x's pipe refused as a *SummaryError wrapping ErrSummary naming %s", bad, pipe)
		}
	})
}
