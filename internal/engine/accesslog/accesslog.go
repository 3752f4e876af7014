// Package accesslog keeps a mount's access journal: each file's last
// access and hit count, named by the file's id (its header's random
// id, format.Header.ID), so that a restarted engine tells its policy
// what the files' uses were (the RESTORE records of docs/abi.md), not
// only when each file was stored.
//
// A journal is one file under a mount's root, written by one engine:
// a header, then fixed-size records appended as files are used, each
// (file id, last access, hits) with its own checksum. Nothing is
// synced on an append: a crash loses the latest records at most, and a
// record torn by a crash, or that fails its checksum, is ignored when
// read; a later record of a file replaces an earlier one. A file is
// only ever given the figures of a record that names its own id: a
// file replaced by another (a new id) gets none of the old one's.
// Rewrite compacts the journal: a new file written beside it, synced
// and renamed over it, so that a crash leaves the old journal or the new
// one whole.
package accesslog

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"io/fs"
	"os"

	"github.com/kvhost/kvhost/fsys"
)

// Prefix starts a journal's name under a mount's root: Prefix + the
// engine's node id.
const Prefix = ".access-"

// magic starts every journal.
const magic = "KVHACC1\n"

// RecordSize is the size of one journal record in bytes: the file id
// (u64), the last access (i64, Unix nanoseconds), the hits (u32) and
// the CRC-32C of those 20 bytes (u32), little-endian.
const RecordSize = 24

// maxJournal bounds the record bytes Read takes from a journal where
// its caller sets no smaller bound.
const maxJournal = 1 << 30

// readChunk is the bytes Read decodes at a time: whole records, so that
// a journal's start holds one chunk in memory, not the journal.
const readChunk = (1 << 20) / RecordSize * RecordSize

// ErrNotJournal is returned by Read for a file that is not an access
// journal (its first bytes are not the journal's magic).
var ErrNotJournal = errors.New("accesslog: not an access journal")

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Figure is what a journal says of one file: its last access and the
// hits counted on it.
type Figure struct {
	FID  uint64 // the file's header id; never 0
	Last int64  // Unix nanoseconds
	Hits uint32
}

// Contents is what Read found in a journal.
type Contents struct {
	// Figures holds the last valid record of each file id.
	Figures map[uint64]Figure
	// Records counts the valid records; Bad those that failed their
	// checksum or named file id 0; Torn the bytes of a partial record
	// at the end (a write cut short).
	Records, Bad, Torn int
	// Skipped is the bytes of records Read left unread at the
	// journal's start: it read the last of them, up to its limit.
	Skipped int64
}

func putRecord(b []byte, f Figure) {
	binary.LittleEndian.PutUint64(b[0:], f.FID)
	binary.LittleEndian.PutUint64(b[8:], uint64(f.Last))
	binary.LittleEndian.PutUint32(b[16:], f.Hits)
	binary.LittleEndian.PutUint32(b[20:], crc32.Checksum(b[:20], castagnoli))
}

// Decode reads a journal's bytes.
func Decode(b []byte) (Contents, error) {
	if len(b) < len(magic) || string(b[:len(magic)]) != magic {
		return Contents{}, ErrNotJournal
	}
	c := Contents{Figures: map[uint64]Figure{}}
	c.Torn = len(c.decode(b[len(magic):]))
	return c, nil
}

// decode adds the whole records of b to c and returns the bytes after
// the last whole record.
func (c *Contents) decode(b []byte) []byte {
	for ; len(b) >= RecordSize; b = b[RecordSize:] {
		f := Figure{
			FID:  binary.LittleEndian.Uint64(b[0:]),
			Last: int64(binary.LittleEndian.Uint64(b[8:])),
			Hits: binary.LittleEndian.Uint32(b[16:]),
		}
		if crc32.Checksum(b[:20], castagnoli) != binary.LittleEndian.Uint32(b[20:]) || f.FID == 0 {
			c.Bad++
			continue
		}
		c.Records++
		c.Figures[f.FID] = f
	}
	return b
}

// Read reads the journal at path; a missing journal reads as empty
// (with an error matching fs.ErrNotExist), a file that does not start
// as a journal fails with ErrNotJournal after reading its first bytes
// alone. It reads at most limit bytes of records (limit ≤ 0: 1 GiB), the
// last ones (a later record of a file replaces an earlier one), a chunk
// at a time: the records before them are Contents.Skipped, so that a
// journal grown past what its writer keeps (compaction holds it to a
// few records per file), garbage appended to, costs its start at most
// limit bytes.
func Read(fsy fsys.FS, path string, limit int64) (Contents, error) {
	f, err := fsy.OpenFile(path, os.O_RDONLY|fsys.ONoLinks, 0)
	if err != nil {
		return Contents{}, fmt.Errorf("accesslog: %w", err)
	}
	defer f.Close()
	fi, err := fsy.Stat(path)
	if err != nil {
		return Contents{}, fmt.Errorf("accesslog: %w", err)
	}
	head := make([]byte, len(magic))
	if n, err := f.ReadAt(head, 0); n < len(head) || string(head) != magic {
		if err != nil && !errors.Is(err, io.EOF) {
			return Contents{}, fmt.Errorf("accesslog: read %s: %w", path, err)
		}
		return Contents{}, fmt.Errorf("%s: %w", path, ErrNotJournal)
	}
	if limit <= 0 || limit > maxJournal {
		limit = maxJournal
	}
	c := Contents{Figures: map[uint64]Figure{}}
	off, end := int64(len(magic)), fi.Size()
	if n := end - off; n > limit {
		c.Skipped = (n - limit + RecordSize - 1) / RecordSize * RecordSize
		off += c.Skipped
	}
	buf := make([]byte, min(end-off, readChunk))
	var rest []byte // a record cut by the end of a chunk
	for off < end {
		b := append(buf[:0], rest...)
		b = b[:len(rest)+int(min(end-off, int64(cap(buf)-len(rest))))]
		got, err := f.ReadAt(b[len(rest):], off)
		if err != nil && !errors.Is(err, io.EOF) {
			return Contents{}, fmt.Errorf("accesslog: read %s: %w", path, err)
		}
		off += int64(got)
		b = b[:len(rest)+got]
		rest = append(rest[:0:0], c.decode(b)...)
		if got == 0 || errors.Is(err, io.EOF) {
			break // shorter than its size said: truncated meanwhile
		}
	}
	c.Torn = len(rest)
	return c, nil
}

// Journal appends to a journal. It is not safe for concurrent use.
type Journal struct {
	fs   fsys.FS
	path string
	f    fsys.File
	off  int64 // where the next record goes
	n    int   // records in the journal
	buf  []byte
}

// Open opens the journal at path for appending, after the records
// already there (a torn record at its end is written over), creating
// it, or starting it afresh, a new empty file, where it is not a
// journal.
func Open(fsy fsys.FS, path string) (*Journal, error) {
	f, err := fsy.OpenFile(path, os.O_RDWR|os.O_CREATE|fsys.ONoLinks, 0o644)
	if err != nil {
		return nil, fmt.Errorf("accesslog: %w", err)
	}
	j := &Journal{fs: fsy, path: path, f: f}
	fi, err := fsy.Stat(path)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("accesslog: %w", err)
	}
	head := make([]byte, len(magic))
	if n, _ := f.ReadAt(head, 0); n == len(magic) && string(head) == magic {
		j.n = int((fi.Size() - int64(len(magic))) / RecordSize)
		j.off = int64(len(magic)) + int64(j.n)*RecordSize
		return j, nil
	}
	if fi.Size() > 0 {
		// Not a journal: it goes, lest a start read its bytes (Read);
		// a file is made anew, never truncated.
		f.Close()
		if err := fsy.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("accesslog: start %s: %w", path, err)
		}
		if f, err = fsy.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL|fsys.ONoLinks, 0o644); err != nil {
			return nil, fmt.Errorf("accesslog: start %s: %w", path, err)
		}
		j.f = f
	}
	if _, err := f.WriteAt([]byte(magic), 0); err != nil {
		f.Close()
		return nil, fmt.Errorf("accesslog: start %s: %w", path, err)
	}
	j.off = int64(len(magic))
	return j, nil
}

// Records is the number of records in the journal, valid or not.
func (j *Journal) Records() int { return j.n }

// Append writes a record of each figure at the journal's end, in one
// write, unsynced.
func (j *Journal) Append(figs []Figure) error {
	if len(figs) == 0 {
		return nil
	}
	b := j.encode(figs, nil)
	if _, err := j.f.WriteAt(b, j.off); err != nil {
		return fmt.Errorf("accesslog: append to %s: %w", j.path, err)
	}
	j.off += int64(len(b))
	j.n += len(figs)
	return nil
}

func (j *Journal) encode(figs []Figure, head []byte) []byte {
	need := len(head) + len(figs)*RecordSize
	if cap(j.buf) < need {
		j.buf = make([]byte, need)
	}
	b := j.buf[:need]
	copy(b, head)
	for i, f := range figs {
		putRecord(b[len(head)+i*RecordSize:], f)
	}
	return b
}

// Rewrite replaces the journal with one record of each figure: written
// beside it, synced, renamed over it. On an error the journal is the
// one before, still appended to.
func (j *Journal) Rewrite(figs []Figure) error {
	tmp := j.path + ".new"
	// A compaction's file left by a crash goes first: a file is made
	// anew, never truncated.
	if err := j.fs.Remove(tmp); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("accesslog: compact %s: %w", j.path, err)
	}
	f, err := j.fs.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_EXCL|fsys.ONoLinks, 0o644)
	if err != nil {
		return fmt.Errorf("accesslog: compact %s: %w", j.path, err)
	}
	b := j.encode(figs, []byte(magic))
	_, err = f.WriteAt(b, 0)
	if err == nil {
		err = f.Sync()
	}
	if err == nil {
		err = j.fs.Rename(tmp, j.path)
	}
	if err != nil {
		f.Close()
		j.fs.Remove(tmp)
		return fmt.Errorf("accesslog: compact %s: %w", j.path, err)
	}
	j.f.Close()
	j.f, j.off, j.n = f, int64(len(b)), len(figs)
	return nil
}

// Close closes the journal's file.
func (j *Journal) Close() error {
	if err := j.f.Close(); err != nil {
		return fmt.Errorf("accesslog: %w", err)
	}
	return nil
}
