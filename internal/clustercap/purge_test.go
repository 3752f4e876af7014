package clustercap

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kvhost/kvhost/internal/fsys"
)

// TestAPurgeRecordIsReadByTheOtherNodesAndReplacesItsOlderRecord: node
// a's purge records reach node b's next ReadAll (its summaries read as
// before: a record is no summary), a second record of one fingerprint
// replaces the first on the mount, and names that are no records are
// ignored.
func TestAPurgeRecordIsReadByTheOtherNodesAndReplacesItsOlderRecord(t *testing.T) {
	root := t.TempDir()
	a, err := OpenDir(fsys.OS{}, root, "a")
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := OpenDir(fsys.OS{}, root, "b")
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if err := a.Publish(&Summary{Version: SummaryVersion, Node: "a", Tag: Tag("a"), Seq: 1, Time: 1, Interval: 1}); err != nil {
		t.Fatal(err)
	}
	first, err := a.WritePurge(0x1234)
	if err != nil {
		t.Fatal(err)
	}
	// Not records: a fingerprint too short, a time that is no number.
	for _, name := range []string{"1234-5.purge", "0000000000001234-x.purge"} {
		if err := os.WriteFile(filepath.Join(a.Path(), name), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if _, ok := b.PurgedAt(0x1234); ok {
		t.Fatal("b knows a record before it read the directory")
	}
	sums, bad, err := b.ReadAll()
	if err != nil || len(bad) != 0 || len(sums) != 1 || sums[0].Node != "a" {
		t.Fatalf("b's read: %v, %v, %v: want a's summary alone", sums, bad, err)
	}
	if at, ok := b.PurgedAt(0x1234); !ok || at != first {
		t.Fatalf("b reads the record at %d (%v), want %d", at, ok, first)
	}
	if got := b.Purges(); len(got) != 1 {
		t.Fatalf("b reads records %v, want 0x1234's alone", got)
	}
	second, err := a.WritePurge(0x1234)
	if err != nil || second < first {
		t.Fatalf("second record at %d (%v), first at %d", second, err, first)
	}
	if second != first {
		if _, err := os.Stat(filepath.Join(a.Path(), purgeName(0x1234, first))); !os.IsNotExist(err) {
			t.Fatalf("the older record is still there (%v)", err)
		}
	}
	if _, _, err := b.ReadAll(); err != nil {
		t.Fatal(err)
	}
	if at, _ := b.PurgedAt(0x1234); at != second {
		t.Fatalf("b reads the record at %d, want the second's %d", at, second)
	}
}
