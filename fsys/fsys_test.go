package fsys

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

func TestOSFile(t *testing.T) {
	dir := t.TempDir()
	name := filepath.Join(dir, "f")
	f, err := OS{}.OpenFile(name, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Allocate(8192); err != nil {
		t.Fatal(err)
	}
	if n, err := f.WritevAt([][]byte{[]byte("hello "), []byte("world")}, 10); n != 11 || err != nil {
		t.Fatalf("WritevAt: %d %v", n, err)
	}
	a, b := make([]byte, 6), make([]byte, 5)
	if n, err := f.ReadvAt([][]byte{a, b}, 10); n != 11 || err != nil || string(a)+string(b) != "hello world" {
		t.Fatalf("ReadvAt: %d %v %q %q", n, err, a, b)
	}
	if n, err := f.ReadAt(make([]byte, 10), 8190); n != 2 || err != io.EOF {
		t.Fatalf("ReadAt past the end: %d %v", n, err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err == nil {
		t.Fatal("second Close succeeded")
	}
	if _, err := (OS{}).OpenFile(name, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600); !errors.Is(err, os.ErrExist) {
		t.Fatalf("O_EXCL: %v", err)
	}
	if err := (OS{}).SyncDir(dir); err != nil {
		t.Fatal(err)
	}
	st, err := OS{}.Statfs(dir)
	if err != nil || st.Total <= 0 || st.BlockSize <= 0 {
		t.Fatalf("Statfs: %+v %v", st, err)
	}
}

func TestFaulty(t *testing.T) {
	dir := t.TempDir()
	c := &Counter{Ops: []Op{OpWrite}, At: 1, Fault: Fault{Err: syscall.ENOSPC}}
	fs := &Faulty{FS: OS{}, Inj: c}
	f, err := fs.OpenFile(filepath.Join(dir, "f"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt([]byte("a"), 0); err != nil {
		t.Fatalf("write 0: %v", err)
	}
	if _, err := f.WritevAt([][]byte{[]byte("b")}, 1); !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("write 1: %v, want ENOSPC", err)
	}
	if _, err := f.WriteAt([]byte("c"), 1); err != nil || c.Count() != 3 || c.Fired() != 1 {
		t.Fatalf("write 2: %v (count %d, fired %d)", err, c.Count(), c.Fired())
	}
	// Short writes: half of the iovecs, or half of one in 4 KiB units.
	short := &Faulty{FS: OS{}, Inj: InjectorFunc(func(Op, string) Fault { return Fault{Short: true} })}
	g, err := short.OpenFile(filepath.Join(dir, "g"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if n, err := g.WritevAt([][]byte{[]byte("ab"), []byte("cd")}, 0); n != 2 || err != nil {
		t.Fatalf("short writev: %d %v", n, err)
	}
	big := bytes.Repeat([]byte{1}, 3*4096)
	if n, err := g.WritevAt([][]byte{big}, 0); n != 4096 || err != nil {
		t.Fatalf("short writev of one iovec: %d %v", n, err)
	}
	if n, err := g.WriteAt(big, 0); n != 4096 || !errors.Is(err, io.ErrShortWrite) {
		t.Fatalf("short WriteAt: %d %v", n, err)
	}
	if OpWrite.String() != "write" || Op(200).String() != "op(?)" {
		t.Fatal("Op names")
	}
}

// TestFstatIdentity: Fstat of an open file (OS and Faulty) and Stat of its
// name give the same identity, with the file's size and a regular mode.
func TestFstatIdentity(t *testing.T) {
	dir := t.TempDir()
	name := filepath.Join(dir, "f")
	for _, fsys := range []FS{OS{}, &Faulty{FS: OS{}, Inj: InjectorFunc(func(Op, string) Fault { return Fault{} })}} {
		f, err := fsys.OpenFile(name, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteAt([]byte("hello"), 0); err != nil {
			t.Fatal(err)
		}
		fi, err := Fstat(f)
		if err != nil {
			t.Fatal(err)
		}
		a, err := IdentityOf(fi)
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
		si, err := fsys.Stat(name)
		if err != nil {
			t.Fatal(err)
		}
		b, err := IdentityOf(si)
		if err != nil {
			t.Fatal(err)
		}
		if !a.Same(b) || a.Size != 5 || !a.Mode.IsRegular() {
			t.Fatalf("fstat %+v, stat %+v", a, b)
		}
		if err := fsys.Remove(name); err != nil {
			t.Fatal(err)
		}
	}
}

// TestIsAtFollowsTheNameNotTheFile: IsAt reports true while path names
// the open file, and false once the name is removed or given to another.
func TestIsAtFollowsTheNameNotTheFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "f")
	create := func(name string) File {
		t.Helper()
		f, err := OS{}.OpenFile(name, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f
	}
	f := create(path)
	other := create(filepath.Join(dir, "other"))
	for _, tc := range []struct {
		name  string
		setup func() error
		want  bool
	}{
		{"the file's own name", func() error { return nil }, true},
		{"removed", func() error { return os.Remove(path) }, false},
		{"given to another file", func() error { return os.Rename(filepath.Join(dir, "other"), path) }, false},
	} {
		if err := tc.setup(); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if got, err := IsAt(OS{}, f, path); err != nil || got != tc.want {
			t.Errorf("%s: IsAt = %v, %v; want %v", tc.name, got, err, tc.want)
		}
	}
	if got, err := IsAt(OS{}, other, path); err != nil || !got {
		t.Errorf("the file renamed there: IsAt = %v, %v; want true", got, err)
	}
}
