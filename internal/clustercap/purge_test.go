package clustercap

import (
	"math"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvhost/kvhost/fsys"
)

// TestAPurgeRecordIsReadByTheOtherNodesAndReplacesItsOlderRecord: node
// a's purge records reach node b's next ReadAll (its summaries read as
// before: a record is no summary), a second record of one fingerprint
// replaces the first on the mount, and names that are no records are
// ignored.
func TestAPurgeRecordIsReadByTheOtherNodesAndReplacesItsOlderRecord(t *testing.T) {
	root := t.TempDir()
	a := purgeDir(t, root, "a")
	b := purgeDir(t, root, "b")
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
	if _, ok := b.PurgedAt(0x1234, math.MaxInt64); ok {
		t.Fatal("b knows a record before it read the directory")
	}
	sums, bad, err := b.ReadAll()
	if err != nil || len(bad) != 0 || len(sums) != 1 || sums[0].Node != "a" {
		t.Fatalf("b's read: %v, %v, %v: want a's summary alone", sums, bad, err)
	}
	if at, ok := b.PurgedAt(0x1234, math.MaxInt64); !ok || at != first {
		t.Fatalf("b reads the record at %d (%v), want %d", at, ok, first)
	}
	if got, _ := b.Purges(math.MaxInt64); len(got) != 1 {
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
	if at, _ := b.PurgedAt(0x1234, math.MaxInt64); at != second {
		t.Fatalf("b reads the record at %d, want the second's %d", at, second)
	}
}

// TestAPurgeRecordFarAheadOfTheClockWaitsAndTheNextPurgeRemovesIt: a
// record dated past the reader's limit (its clock plus PurgeAhead) is
// not applied but reported ahead, and does not hide the record before
// it; the next purge of its fingerprint removes it from the mount, as it
// removes an older record.
func TestAPurgeRecordFarAheadOfTheClockWaitsAndTheNextPurgeRemovesIt(t *testing.T) {
	root := t.TempDir()
	a := purgeDir(t, root, "a")
	first, err := a.WritePurge(0x1234)
	if err != nil {
		t.Fatal(err)
	}
	far := filepath.Join(a.Path(), purgeName(0x1234, math.MaxInt64))
	if err := os.WriteFile(far, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, _, err := a.ReadAll(); err != nil {
		t.Fatal(err)
	}
	limit := time.Now().Add(PurgeAhead).UnixNano()
	applied, ahead := a.Purges(limit)
	if applied[0x1234] != first || ahead[0x1234] != math.MaxInt64 {
		t.Fatalf("applied %v, ahead %v: want the first record applied, the far one ahead", applied, ahead)
	}
	if at, ok := a.PurgedAt(0x1234, limit); !ok || at != first {
		t.Fatalf("PurgedAt: %d (%v), want %d", at, ok, first)
	}
	second, err := a.WritePurge(0x1234)
	if err != nil {
		t.Fatal(err)
	}
	gone := []string{far}
	if second != first {
		gone = append(gone, filepath.Join(a.Path(), purgeName(0x1234, first)))
	}
	for _, name := range gone {
		if _, err := os.Stat(name); !os.IsNotExist(err) {
			t.Fatalf("%s is still there after the next purge (%v)", name, err)
		}
	}
}

// purgeDir opens node's Dir on root, closed when the test ends.
func purgeDir(t *testing.T, root, node string) *Dir {
	t.Helper()
	d, err := OpenDir(fsys.OS{}, root, node)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}
