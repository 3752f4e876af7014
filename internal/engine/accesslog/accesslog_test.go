package accesslog

import (
	"errors"
	"maps"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvhost/kvhost/fsys"
)

func encoded(figs ...Figure) []byte {
	b := []byte(magic)
	for _, f := range figs {
		r := make([]byte, RecordSize)
		putRecord(r, f)
		b = append(b, r...)
	}
	return b
}

func TestDecodeTrustsOnlyWholeRecordsThatPassTheirChecksum(t *testing.T) {
	a, b := Figure{FID: 11, Last: 100, Hits: 1}, Figure{FID: 22, Last: 200, Hits: 2}
	a2 := Figure{FID: 11, Last: 300, Hits: 2}
	whole := encoded(a, b, a2)
	garble := func(at int) []byte {
		c := append([]byte(nil), whole...)
		c[at] ^= 0x40
		return c
	}
	rec := func(i int) int { return len(magic) + i*RecordSize }
	tests := []struct {
		name string
		b    []byte
		want map[uint64]Figure
		bad  int
		torn int
	}{
		{"the later record of a file wins", whole, map[uint64]Figure{11: a2, 22: b}, 0, 0},
		{"a torn last record is ignored", whole[:len(whole)-5], map[uint64]Figure{11: a, 22: b}, 0, RecordSize - 5},
		{"a garbled file id is ignored", garble(rec(1) + 2), map[uint64]Figure{11: a2}, 1, 0},
		{"garbled hits are ignored", garble(rec(2) + 16), map[uint64]Figure{11: a, 22: b}, 1, 0},
		{"a garbled checksum is ignored", garble(rec(0) + 21), map[uint64]Figure{11: a2, 22: b}, 1, 0},
		{"file id 0 is never a file's", encoded(Figure{FID: 0, Last: 5, Hits: 5}), map[uint64]Figure{}, 1, 0},
		{"an empty journal", []byte(magic), map[uint64]Figure{}, 0, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Decode(tc.b)
			if err != nil {
				t.Fatal(err)
			}
			if len(c.Figures) != len(tc.want) {
				t.Fatalf("figures %v, want %v", c.Figures, tc.want)
			}
			for fid, f := range tc.want {
				if c.Figures[fid] != f {
					t.Errorf("file %d: %+v, want %+v", fid, c.Figures[fid], f)
				}
			}
			if c.Bad != tc.bad || c.Torn != tc.torn {
				t.Errorf("bad %d, torn %d; want %d, %d", c.Bad, c.Torn, tc.bad, tc.torn)
			}
		})
	}
}

func TestDecodeRefusesAFileThatIsNotAJournal(t *testing.T) {
	for _, b := range [][]byte{nil, []byte("KVH"), []byte("not a journal at all")} {
		if _, err := Decode(b); !errors.Is(err, ErrNotJournal) {
			t.Errorf("Decode(%q) = %v, want ErrNotJournal", b, err)
		}
	}
}

func TestOpenAppendsOverATornRecord(t *testing.T) {
	path := filepath.Join(t.TempDir(), Prefix+"n")
	a, b, c := Figure{FID: 1, Last: 10, Hits: 1}, Figure{FID: 2, Last: 20, Hits: 2}, Figure{FID: 3, Last: 30, Hits: 3}
	whole := encoded(a, b)
	if err := os.WriteFile(path, whole[:len(whole)-7], 0o644); err != nil { // b torn
		t.Fatal(err)
	}
	j, err := Open(fsys.OS{}, path)
	if err != nil {
		t.Fatal(err)
	}
	if j.Records() != 1 {
		t.Fatalf("Records() = %d over one whole record and a torn one, want 1", j.Records())
	}
	if err := j.Append([]Figure{c}); err != nil {
		t.Fatal(err)
	}
	j.Close()
	got, err := Read(fsys.OS{}, path, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Figures) != 2 || got.Figures[1] != a || got.Figures[3] != c || got.Bad != 0 || got.Torn != 0 {
		t.Fatalf("after an append over the torn record: %+v, want files 1 and 3 whole", got)
	}
}

func TestOpenStartsAfreshOverAFileThatIsNotAJournal(t *testing.T) {
	path := filepath.Join(t.TempDir(), Prefix+"n")
	if err := os.WriteFile(path, []byte("something else"), 0o644); err != nil {
		t.Fatal(err)
	}
	j, err := Open(fsys.OS{}, path)
	if err != nil {
		t.Fatal(err)
	}
	f := Figure{FID: 9, Last: 90, Hits: 9}
	if err := j.Append([]Figure{f}); err != nil {
		t.Fatal(err)
	}
	j.Close()
	got, err := Read(fsys.OS{}, path, 0)
	if err != nil || got.Figures[9] != f || got.Records != 1 {
		t.Fatalf("Read = %+v, %v; want the one record appended", got, err)
	}
}

func TestRewriteKeepsOnlyTheFiguresGivenOverALeftoverAndAppendsAfterThem(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, Prefix+"n")
	j, err := Open(fsys.OS{}, path)
	if err != nil {
		t.Fatal(err)
	}
	defer j.Close()
	for i := range 50 {
		if err := j.Append([]Figure{{FID: uint64(1 + i%5), Last: int64(i), Hits: uint32(i)}}); err != nil {
			t.Fatal(err)
		}
	}
	// A compaction's file left by a crash, longer than the new one.
	if err := os.WriteFile(path+".new", make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	keep := []Figure{{FID: 4, Last: 48, Hits: 48}, {FID: 5, Last: 49, Hits: 49}}
	if err := j.Rewrite(keep); err != nil {
		t.Fatal(err)
	}
	if j.Records() != 2 {
		t.Fatalf("Records() = %d after a rewrite of 2, want 2", j.Records())
	}
	later := Figure{FID: 4, Last: 60, Hits: 50}
	if err := j.Append([]Figure{later}); err != nil {
		t.Fatal(err)
	}
	got, err := Read(fsys.OS{}, path, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Figures) != 2 || got.Figures[4] != later || got.Figures[5] != keep[1] || got.Bad != 0 || got.Torn != 0 {
		t.Fatalf("after the rewrite and an append: %+v", got.Figures)
	}
	if _, err := os.Stat(path + ".new"); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the rewrite's temporary file is left: %v", err)
	}
}

// countFS counts the bytes read through the files it opens.
type countFS struct {
	fsys.OS
	read *int64
}

func (c countFS) OpenFile(name string, flag int, perm os.FileMode) (fsys.File, error) {
	f, err := c.OS.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return countFile{f, c.read}, nil
}

type countFile struct {
	fsys.File
	read *int64
}

func (f countFile) ReadAt(p []byte, off int64) (int, error) {
	n, err := f.File.ReadAt(p, off)
	*f.read += int64(n)
	return n, err
}

// TestReadTakesTheLastRecordsUpToItsLimit: a journal longer than Read's
// limit is read from its end, whole records at a time, the records
// before them skipped (and counted), however large the journal.
func TestReadTakesTheLastRecordsUpToItsLimit(t *testing.T) {
	a, b, a2 := Figure{FID: 11, Last: 100, Hits: 1}, Figure{FID: 22, Last: 200, Hits: 2}, Figure{FID: 11, Last: 300, Hits: 2}
	early := Figure{FID: 33, Last: 50, Hits: 5}
	path := filepath.Join(t.TempDir(), Prefix+"n")
	whole := encoded(early, a, b, a2)
	if err := os.WriteFile(path, whole[:len(whole)-3], 0o644); err != nil { // a2 torn
		t.Fatal(err)
	}
	for _, tc := range []struct {
		limit   int64
		want    map[uint64]Figure
		skipped int64
	}{
		{0, map[uint64]Figure{33: early, 11: a, 22: b}, 0},
		{3*RecordSize - 3, map[uint64]Figure{11: a, 22: b}, RecordSize},
		{2*RecordSize - 3, map[uint64]Figure{22: b}, 2 * RecordSize},
		{RecordSize, map[uint64]Figure{}, 3 * RecordSize},
	} {
		var read int64
		c, err := Read(countFS{read: &read}, path, tc.limit)
		if err != nil {
			t.Fatal(err)
		}
		if !maps.Equal(c.Figures, tc.want) || c.Skipped != tc.skipped || c.Torn != RecordSize-3 {
			t.Errorf("limit %d: %+v; want figures %v, %d bytes skipped, a torn record", tc.limit, c, tc.want, tc.skipped)
		}
		if max := int64(len(magic)) + int64(len(whole)) - 3 - tc.skipped; read > max {
			t.Errorf("limit %d: %d bytes read, want at most %d", tc.limit, read, max)
		}
	}
}

// TestReadOfALargeFileThatIsNotAJournalReadsOnlyItsFirstBytes: a start
// finds garbage where its journal is; Read refuses it after its first
// bytes, not after reading it whole.
func TestReadOfALargeFileThatIsNotAJournalReadsOnlyItsFirstBytes(t *testing.T) {
	path := filepath.Join(t.TempDir(), Prefix+"n")
	if err := os.WriteFile(path, []byte("garbage!"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, 64<<20); err != nil { // sparse
		t.Fatal(err)
	}
	var read int64
	if _, err := Read(countFS{read: &read}, path, 0); !errors.Is(err, ErrNotJournal) {
		t.Fatalf("Read = %v, want ErrNotJournal", err)
	}
	if read > int64(len(magic)) {
		t.Fatalf("%d bytes read of a file that is not a journal, want %d at most", read, len(magic))
	}
	j, err := Open(fsys.OS{}, path)
	if err != nil {
		t.Fatal(err)
	}
	j.Close()
	if fi, err := os.Stat(path); err != nil || fi.Size() != int64(len(magic)) {
		t.Fatalf("after Open started it afresh: %v, %v; want an empty journal", fi, err)
	}
}
