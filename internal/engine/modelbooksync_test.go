//go:build invariants

package engine

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
)

// powerLossFS keeps, for the model books (by name), what a power loss
// now would lose: data written to a book since its last fsync, and a
// book's name created or renamed into its directory since the
// directory's last fsync.
type powerLossFS struct {
	fsys.OS
	mu       sync.Mutex
	dirty    map[string]bool // books written since their last Sync
	unlinked map[string]bool // books whose name their directory has not synced
}

func newPowerLossFS() *powerLossFS {
	return &powerLossFS{dirty: map[string]bool{}, unlinked: map[string]bool{}}
}

// watched reports whether path is a model book (or a rewrite's
// temporary file of one).
func watched(path string) bool { return isModelBook(filepath.Base(path)) }

// lost returns what a power loss now would lose of the books, sorted.
func (w *powerLossFS) lost() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var l []string
	for p, d := range w.dirty {
		if d {
			l = append(l, "data of "+p)
		}
	}
	for p, u := range w.unlinked {
		if u {
			l = append(l, "name of "+p)
		}
	}
	slices.Sort(l)
	return l
}

// opened wraps f, just opened at path (new: it did not exist before).
func (w *powerLossFS) opened(f fsys.File, path string, flag int, existed bool) fsys.File {
	if !watched(path) {
		return f
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if flag&os.O_CREATE != 0 && !existed {
		w.unlinked[path] = true
	}
	return &powerLossFile{File: f, fs: w, path: path}
}

func (w *powerLossFS) OpenFile(name string, flag int, perm os.FileMode) (fsys.File, error) {
	_, err := os.Lstat(name)
	existed := !errors.Is(err, fs.ErrNotExist)
	f, err := w.OS.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return w.opened(f, name, flag, existed), nil
}

func (w *powerLossFS) OpenAt(dir fsys.File, path string, flag int, perm os.FileMode) (fsys.File, error) {
	_, err := os.Lstat(path)
	existed := !errors.Is(err, fs.ErrNotExist)
	f, err := w.OS.OpenAt(dir, path, flag, perm)
	if err != nil {
		return nil, err
	}
	return w.opened(f, path, flag, existed), nil
}

// renamed moves what a power loss would lose of oldpath's data to
// newpath, whose name is then unsynced.
func (w *powerLossFS) renamed(oldpath, newpath string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if watched(newpath) {
		w.dirty[newpath], w.unlinked[newpath] = w.dirty[oldpath], true
	}
	delete(w.dirty, oldpath)
	delete(w.unlinked, oldpath)
}

func (w *powerLossFS) Rename(oldpath, newpath string) error {
	if err := w.OS.Rename(oldpath, newpath); err != nil {
		return err
	}
	w.renamed(oldpath, newpath)
	return nil
}

func (w *powerLossFS) RenameAt(olddir fsys.File, oldpath string, newdir fsys.File, newpath string, noReplace bool) error {
	if err := w.OS.RenameAt(olddir, oldpath, newdir, newpath, noReplace); err != nil {
		return err
	}
	w.renamed(oldpath, newpath)
	return nil
}

func (w *powerLossFS) SyncDir(path string) error {
	if err := w.OS.SyncDir(path); err != nil {
		return err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for p := range w.unlinked {
		if filepath.Dir(p) == filepath.Clean(path) {
			delete(w.unlinked, p)
		}
	}
	return nil
}

// powerLossFile marks its book dirty at each write, clean at each Sync.
type powerLossFile struct {
	fsys.File
	fs   *powerLossFS
	path string
}

func (f *powerLossFile) mark(dirty bool) {
	f.fs.mu.Lock()
	defer f.fs.mu.Unlock()
	f.fs.dirty[f.path] = dirty
}

func (f *powerLossFile) WriteAt(p []byte, off int64) (int, error) {
	f.mark(true)
	return f.File.WriteAt(p, off)
}

func (f *powerLossFile) WritevAt(bufs [][]byte, off int64) (int, error) {
	f.mark(true)
	return f.File.WritevAt(bufs, off)
}

func (f *powerLossFile) Sync() error {
	if err := f.File.Sync(); err != nil {
		return err
	}
	f.mark(false)
	return nil
}

// TestADeclarationInTheModelBookSurvivesAPowerLoss: once Declare returns,
// the line its namespace added to this node's model book is on the
// device, and so is the book's name where the line made the book; a
// start's rewrite of the book (a namespace with no files dropped)
// leaves it on the device too. A power loss at either point keeps what
// the books named: the budgets count the namespaces' files from the
// next start. Before, the appends were not synced (issue 94).
func TestADeclarationInTheModelBookSurvivesAPowerLoss(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	pfs := newPowerLossFS()
	cfg := Config{Mounts: []Mount{{Path: dir}}, FS: pfs, NodeID: "n1"}
	book := filepath.Join(dir, modelBookPrefix+"n1")

	cfg.Policy = newTestPolicy(1, abi.OrderLayerMajor)
	e := openEngine(t, cfg)
	g := smallGeometry(true)
	for _, model := range []string{"tenant/a", "tenant/b"} {
		g.Model = model
		if _, err := e.Declare(ctx, g); err != nil {
			t.Fatal(err)
		}
		if lost := pfs.lost(); len(lost) != 0 {
			t.Fatalf("Declare of %s returned, but a power loss now loses %v", model, lost)
		}
	}
	if b, err := os.ReadFile(book); err != nil || len(b) == 0 {
		t.Fatalf("the model book %s: %d bytes, %v; want its two lines", book, len(b), err)
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}

	// Neither namespace has files: the next start rewrites the book.
	before, err := os.Stat(book)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Policy = newTestPolicy(1, abi.OrderLayerMajor)
	e = openEngine(t, cfg)
	defer e.Close(ctx)
	after, err := os.Stat(book)
	if err != nil {
		t.Fatal(err)
	}
	if os.SameFile(before, after) {
		t.Fatalf("the start did not rewrite the book (%d bytes before, %d after): the check below checks nothing", before.Size(), after.Size())
	}
	if lost := pfs.lost(); len(lost) != 0 {
		t.Fatalf("the start rewrote the model book, but a power loss now loses %v", lost)
	}
}
