//go:build invariants

package engine

import (
	"bytes"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/engine/accesslog"
)

// journalReadFS counts the bytes read from access journals.
type journalReadFS struct {
	fsys.OS
	read atomic.Int64
}

func (j *journalReadFS) wrap(path string, f fsys.File, err error) (fsys.File, error) {
	if err != nil || !strings.HasPrefix(filepath.Base(path), accesslog.Prefix) {
		return f, err
	}
	return journalReadFile{f, &j.read}, nil
}

func (j *journalReadFS) OpenFile(name string, flag int, perm os.FileMode) (fsys.File, error) {
	f, err := j.OS.OpenFile(name, flag, perm)
	return j.wrap(name, f, err)
}

func (j *journalReadFS) OpenAt(dir fsys.File, path string, flag int, perm os.FileMode) (fsys.File, error) {
	f, err := j.OS.OpenAt(dir, path, flag, perm)
	return j.wrap(path, f, err)
}

type journalReadFile struct {
	fsys.File
	read *atomic.Int64
}

func (f journalReadFile) ReadAt(p []byte, off int64) (int, error) {
	n, err := f.File.ReadAt(p, off)
	f.read.Add(int64(n))
	return n, err
}

// TestALargeGarbageAccessJournalCostsAStartAtMostItsBound: a start
// finds its access journal grown far past what kvhost keeps one at
// (garbage, here 72 MiB of zeros, sparse, before the last records), or
// replaced by a file that is not a journal. It reads at most
// journalBound of the first (its last records, which still restore the
// files they name) and only the first bytes of the second, and says so
// at warning level: a gigabyte of garbage delayed a start by 11-23 s,
// reported at info level.
func TestALargeGarbageAccessJournalCostsAStartAtMostItsBound(t *testing.T) {
	garbage := int64(accesslog.RecordSize) * 3 << 20
	for _, tc := range []struct {
		name    string
		journal func(records []byte) []byte // what goes before the sparse garbage; nil: garbage alone
		max     int64                       // bytes of the journal read at most
		hits    uint32                      // key 0's hits restored
		warn    string
	}{
		{name: "garbage before the last records",
			journal: func(records []byte) []byte { return records[:8] },
			max:     8 + 32<<20, hits: 2, // journalBound of 3 files: 26.7 MB
			warn: "engine: access journal larger than kvhost keeps one: only its last records read, the files named only before them restore with their store times and no hits"},
		{name: "not a journal",
			max:  8,
			warn: "engine: access journal unread: its files restore with their store times and no hits"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newAccessFixture(t, 3)
			s := f.open("n1")
			storeAndCheck(t, s.e, s.c, f.keys, f.blocks)
			hit := s.hit(t, f.keys[0], 2)
			s.close(t)

			path := filepath.Join(f.dir, accesslog.Prefix+"n1")
			records, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			var head, tail []byte
			if tc.journal != nil {
				head, tail = tc.journal(records), records[8:]
			} else {
				head = []byte("not a kvhost journal")
			}
			if err := os.WriteFile(path, head, 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(path, int64(len(head))+garbage); err != nil {
				t.Fatal(err)
			}
			w, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := w.Write(tail); err != nil {
				t.Fatal(err)
			}
			w.Close()

			fs := &journalReadFS{}
			var logs lockedBuffer
			log := slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))
			pol := newTestPolicy(1, abi.OrderLayerMajor)
			s = f.openWith("n1", Config{Policy: pol, FS: fs, Logger: log})
			s.pol = pol
			if read, max := fs.read.Load(), tc.max; read > max {
				t.Errorf("the start read %d bytes of a journal of %d, want at most %d", read, int64(len(head))+garbage+int64(len(tail)), max)
			}
			if tc.hits > 0 {
				wantRestored(t, "key 0, hit twice, its records last in the journal", s.restored(t, f.keys[0]), hit, tc.hits)
			}
			recs := logs.records(t, tc.warn)
			if len(recs) != 1 || recs[0]["level"] != "WARN" {
				var all bytes.Buffer
				logs.mu.Lock()
				all.Write(logs.b.Bytes())
				logs.mu.Unlock()
				t.Fatalf("log records %v of %q, want one warning; the log:\n%s", recs, tc.warn, all.String())
			}
		})
	}
}
