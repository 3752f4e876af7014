package engine

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/kvhost/kvhost/fsys"
)

// The model books (docs/engine.md, "Byte budgets"): a file's header
// names its namespace by fingerprint only, and a budget covers
// namespaces by model id, which only a client's Declare told until now.
// So after a restart no budget counted the files found until their
// clients declared them again, and an eviction meanwhile took a quiet
// namespace below its floor (issue 94: all 120 files of a namespace
// with a 3 MiB floor, its client back 4 s after the restart hold). Each
// node keeps, on every writable mount of kvhost's layout, a book of the
// geometries declared (`<root>/.models-<node>`, one JSON line each,
// appended at the namespace's first Declare); Open reads every node's
// books, and the budgets count the files found of each namespace a book
// names from the start.
//
// A line is trusted for what it can prove: its geometry's fingerprint is
// computed, not read, so a line names the model id of exactly the files
// a client declaring that geometry would own. A line that does not
// decode or validate is skipped (and counted in a warning).

// modelBookPrefix starts a model book's name under a mount's root:
// modelBookPrefix + the node id.
const modelBookPrefix = ".models-"

// isModelBook reports whether name (a file under a mount's root) is a
// model book, or a rewrite's temporary file of one: like the access
// journals, not counted in the mount's used bytes.
func isModelBook(name string) bool {
	return strings.HasPrefix(name, modelBookPrefix)
}

// maxModelBook bounds the bytes Open reads of one book: some 20,000
// geometries. Open rewrites this node's books to the namespaces that
// have files, so a book past it is not kvhost's alone.
const maxModelBook = 4 << 20

// modelBook is the model books of the engine's mounts: the model id of
// each fingerprint read at Open (fixed from then on) and the writer of
// this node's books.
type modelBook struct {
	fs  fsys.FS
	log *slog.Logger
	// paths is this node's book on each writable mount of kvhost's
	// layout.
	paths []string
	// models is the model id of each fingerprint the books named at Open,
	// fixed once the tables hold the book (setBooks).
	models map[uint64]string

	mu      sync.Mutex
	written map[uint64]bool // fingerprints this node's books name
	off     bool            // a write failed (logged once): no more
}

// newModelBook returns the books of node on mounts, before any is read.
func newModelBook(fsy fsys.FS, log *slog.Logger, mounts []*mount, node string) *modelBook {
	b := &modelBook{fs: fsy, log: log, models: map[uint64]string{}, written: map[uint64]bool{}}
	for _, m := range mounts {
		if m.raw == nil && m.unwritable == nil {
			b.paths = append(b.paths, filepath.Join(m.root, modelBookPrefix+node))
		}
	}
	return b
}

// setBooks makes b, read, the tables' model books.
func (t *tables) setBooks(b *modelBook) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.books = b
}

// noteModel adds g, just declared, to the model books (modelBook.note).
func (t *tables) noteModel(g Geometry) {
	t.mu.RLock()
	b := t.books
	t.mu.RUnlock()
	b.note(g)
}

// model returns the model id the books named for fingerprint fp at Open
// ("" for none).
func (b *modelBook) model(fp uint64) string {
	if b == nil {
		return ""
	}
	return b.models[fp]
}

// read reads every node's book on mounts of kvhost's layout into
// b.models, and this node's into b.written. It returns the geometries
// this node's books name.
func (b *modelBook) read(mounts []*mount) map[uint64]Geometry {
	own := map[uint64]Geometry{}
	bad := 0
	for _, m := range mounts {
		if m.raw != nil {
			continue
		}
		ents, err := b.fs.ReadDir(m.root)
		if err != nil {
			continue // the walk said why
		}
		for _, d := range ents {
			if !isModelBook(d.Name()) || !d.Type().IsRegular() || strings.HasSuffix(d.Name(), ".new") {
				continue
			}
			path := filepath.Join(m.root, d.Name())
			geos, n, err := readModelBook(b.fs, path)
			bad += n
			if err != nil {
				b.log.Warn("engine: model book unread: budgets count the files of its namespaces once their clients declare them", "path", path, "err", err)
			}
			for fp, g := range geos {
				b.models[fp] = g.Model
				if b.own(path) {
					own[fp] = g
					b.written[fp] = true
				}
			}
		}
	}
	if bad > 0 {
		b.log.Warn("engine: model books: lines skipped (not a geometry kvhost accepts)", "lines", bad)
	}
	return own
}

// own reports whether path is one of this node's books.
func (b *modelBook) own(path string) bool {
	for _, p := range b.paths {
		if p == path {
			return true
		}
	}
	return false
}

// readModelBook reads the book at path: the geometries of its lines that
// decode and validate, by fingerprint, and how many did not. It reads
// at most maxModelBook bytes.
func readModelBook(fsy fsys.FS, path string) (map[uint64]Geometry, int, error) {
	f, err := fsy.OpenFile(path, os.O_RDONLY|fsys.ONoLinks, 0)
	if err != nil {
		return nil, 0, err
	}
	defer f.Close()
	geos := map[uint64]Geometry{}
	bad := 0
	sc := bufio.NewScanner(io.NewSectionReader(f, 0, maxModelBook))
	sc.Buffer(make([]byte, 0, 4096), 4096)
	for sc.Scan() {
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 {
			continue
		}
		var g Geometry
		if err := json.Unmarshal(line, &g); err != nil || g.Validate() != nil {
			bad++
			continue
		}
		geos[g.Fingerprint()] = g
	}
	if err := sc.Err(); err != nil && !errors.Is(err, io.EOF) {
		return geos, bad, fmt.Errorf("engine: read model book %s: %w", path, err)
	}
	return geos, bad, nil
}

// note adds g, just declared, to this node's books where they do not
// name it yet: appended and synced, with the mount's root where the book
// is new, before the declaration is acknowledged, so that a power loss
// keeps it (a lost line costs the namespace's budget its files until
// its client declares it again, as before the books). A failed write is
// logged once, and the books are written no more.
func (b *modelBook) note(g Geometry) {
	if b == nil {
		return
	}
	fp := g.Fingerprint()
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.off || b.written[fp] || len(b.paths) == 0 {
		return
	}
	line, err := json.Marshal(g)
	if err != nil {
		return // a Geometry always marshals
	}
	line = append(line, '\n')
	for _, p := range b.paths {
		if err := appendLine(b.fs, p, line); err != nil {
			b.off = true
			b.log.Warn("engine: model book not written: after a restart, budgets count the files of namespaces declared since only once their clients declare them again", "path", p, "err", err)
			return
		}
	}
	b.written[fp] = true
}

// appendLine appends line to the file at path, creating it, and syncs
// it, and its directory where it was empty (new). Only this node writes
// its books, under modelBook.mu.
func appendLine(fsy fsys.FS, path string, line []byte) error {
	f, err := fsy.OpenFile(path, os.O_RDWR|os.O_CREATE|fsys.ONoLinks, 0o644)
	if err != nil {
		return err
	}
	fi, err := fsy.Stat(path)
	if err == nil && fi.Size() > 0 {
		// A line torn by a crash ends here: the new one starts a line.
		last := make([]byte, 1)
		if _, err = f.ReadAt(last, fi.Size()-1); err == nil && last[0] != '\n' {
			line = append([]byte{'\n'}, line...)
		}
	}
	if err == nil {
		_, err = f.WriteAt(line, fi.Size())
	}
	if err == nil {
		err = f.Sync()
	}
	if err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if fi.Size() == 0 {
		return fsy.SyncDir(filepath.Dir(path)) // the book's name, new
	}
	return nil
}

// prune rewrites this node's books to the geometries of own (read) that
// keep reports true for (a namespace with files indexed), where any
// other is named: a book grows by the namespaces declared and is cut
// back at each start. A rewrite is a file beside the book, synced,
// renamed over it, and the directory synced: one that fails, or a power
// loss at any point, leaves the book as it was or as rewritten.
func (b *modelBook) prune(own map[uint64]Geometry, keep func(fp uint64) bool) {
	var lines []byte
	dropped := 0
	for fp, g := range own {
		if !keep(fp) {
			dropped++
			continue
		}
		line, _ := json.Marshal(g)
		lines = append(append(lines, line...), '\n')
	}
	if dropped == 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for fp := range own {
		if !keep(fp) {
			delete(b.written, fp)
		}
	}
	for _, p := range b.paths {
		tmp := p + ".new"
		err := writeWhole(b.fs, tmp, lines)
		if err == nil {
			err = b.fs.Rename(tmp, p)
		}
		if err == nil {
			err = b.fs.SyncDir(filepath.Dir(p))
		}
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			b.fs.Remove(tmp)
			b.log.Debug("engine: model book not pruned", "path", p, "err", err)
		}
	}
}

// writeWhole writes b as a new file at path, removing any there first,
// and syncs it: a file is made anew, never truncated.
func writeWhole(fsy fsys.FS, path string, b []byte) error {
	if err := fsy.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	f, err := fsy.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL|fsys.ONoLinks, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.WriteAt(b, 0); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
