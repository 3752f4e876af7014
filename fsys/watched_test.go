package fsys_test

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/fsys/fsystest"
	"github.com/kvhost/kvhost/internal/testwait"
)

// TestWatchedHoldsEveryOperationInFlight: each operation of a Watched FS
// and of its files is in the InFlight while it runs (here, held by an
// injector) and leaves it when it returns.
func TestWatchedHoldsEveryOperationInFlight(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "f")
	if err := os.WriteFile(path, make([]byte, 8192), 0o644); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	for _, tc := range []struct {
		name string
		op   fsys.Op
		run  func(wfs fsys.FS, f fsys.File) error // f: path, opened before the hold is armed
	}{
		{"open", fsys.OpOpen, func(wfs fsys.FS, _ fsys.File) error {
			f, err := wfs.OpenFile(path, os.O_RDONLY, 0)
			if err == nil {
				f.Close()
			}
			return err
		}},
		{"rename", fsys.OpRename, func(wfs fsys.FS, _ fsys.File) error { return wfs.Rename(path, path) }},
		{"remove", fsys.OpRemove, func(wfs fsys.FS, _ fsys.File) error {
			return ignore(wfs.Remove(filepath.Join(dir, "absent")), os.ErrNotExist)
		}},
		{"mkdir", fsys.OpMkdir, func(wfs fsys.FS, _ fsys.File) error { return wfs.MkdirAll(filepath.Join(dir, "d"), 0o755) }},
		{"readdir", fsys.OpReadDir, func(wfs fsys.FS, _ fsys.File) error { _, err := wfs.ReadDir(dir); return err }},
		{"stat", fsys.OpStat, func(wfs fsys.FS, _ fsys.File) error { _, err := wfs.Stat(path); return err }},
		{"statfs", fsys.OpStatfs, func(wfs fsys.FS, _ fsys.File) error { _, err := wfs.Statfs(dir); return err }},
		{"syncdir", fsys.OpSyncDir, func(wfs fsys.FS, _ fsys.File) error { return wfs.SyncDir(dir) }},
		{"read", fsys.OpRead, func(_ fsys.FS, f fsys.File) error { _, err := f.ReadAt(buf, 0); return err }},
		{"readv", fsys.OpRead, func(_ fsys.FS, f fsys.File) error { _, err := f.ReadvAt([][]byte{buf}, 0); return err }},
		{"write", fsys.OpWrite, func(_ fsys.FS, f fsys.File) error { _, err := f.WriteAt(buf, 0); return err }},
		{"writev", fsys.OpWrite, func(_ fsys.FS, f fsys.File) error { _, err := f.WritevAt([][]byte{buf}, 0); return err }},
		{"allocate", fsys.OpAllocate, func(_ fsys.FS, f fsys.File) error { return f.Allocate(8192) }},
		{"sync", fsys.OpSync, func(_ fsys.FS, f fsys.File) error { return f.Sync() }},
		{"fstat", fsys.OpStat, func(_ fsys.FS, f fsys.File) error { _, err := fsys.Fstat(f); return err }},
		{"trylock", fsys.OpLock, func(_ fsys.FS, f fsys.File) error {
			if ok, err := fsys.TryLock(f); err != nil || !ok {
				return fmt.Errorf("TryLock = %v, %v; want true", ok, err)
			}
			return nil
		}},
		{"lock", fsys.OpLock, func(_ fsys.FS, f fsys.File) error { return fsys.Lock(f) }},
		{"close", fsys.OpClose, func(_ fsys.FS, f fsys.File) error { return f.Close() }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hold := &fsystest.Hold{}
			var w fsys.InFlight
			wfs := fsys.Watched(&fsys.Faulty{FS: fsys.OS{}, Inj: hold}, &w)
			f, err := wfs.OpenFile(path, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close() // a second Close (the close case) fails harmlessly
			hold.Arm(tc.op)
			done := make(chan error, 1)
			go func() { done <- tc.run(wfs, f) }()
			testwait.Until(t, "the "+tc.name+" to be held", testwait.Hang, hold.Holding)
			if w.Oldest().IsZero() {
				t.Errorf("a held %s is not in flight", tc.name)
			}
			hold.Release()
			if err := <-done; err != nil {
				t.Errorf("%s: %v", tc.name, err)
			}
			if got := w.Oldest(); !got.IsZero() {
				t.Errorf("after the %s returned, Oldest = %v, want zero", tc.name, got)
			}
		})
	}
}

func ignore(err, target error) error {
	if errors.Is(err, target) {
		return nil
	}
	return err
}

// TestWatchedKeepsWhatItsFilesCanDo: a watched file stats itself and is
// mapped for reading where the wrapped file is (the operating system's),
// and read with pread where it is not (Faulty's, whose reads take
// faults).
func TestWatchedKeepsWhatItsFilesCanDo(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(path, make([]byte, fsys.MapMin), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		fs     fsys.FS
		mapped bool
	}{
		{"os", fsys.OS{}, true},
		{"faulty", &fsys.Faulty{FS: fsys.OS{}, Inj: fsys.InjectorFunc(func(fsys.Op, string) fsys.Fault { return fsys.Fault{} })}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var w fsys.InFlight
			f, err := fsys.Watched(tc.fs, &w).OpenFile(path, os.O_RDONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			fi, err := fsys.Fstat(f)
			if err != nil || fi.Size() != fsys.MapMin {
				t.Fatalf("Fstat of a watched file: %v, %v", fi, err)
			}
			r, release := fsys.MapForRead(f, fsys.MapMin)
			defer release()
			if mapped := r != f; mapped != tc.mapped {
				t.Fatalf("MapForRead mapped the file: %v, want %v", mapped, tc.mapped)
			}
			buf := make([]byte, 4096)
			if _, err := r.ReadAt(buf, fsys.MapMin-4096); err != nil {
				t.Fatal(err)
			}
		})
	}
}
