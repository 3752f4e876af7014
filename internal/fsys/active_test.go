package fsys

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

func TestActivatePagesTouchesEveryPageAndKeepsTheBytes(t *testing.T) {
	page := int64(unix.Getpagesize())
	cases := []struct {
		name      string
		size, n   int64
		wantPages int
	}{
		{"whole file", 5*page + 100, 1 << 20, 6},
		{"a prefix", 5*page + 100, 2*page + 1, 3},
		{"empty file", 0, 1 << 20, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f, m, want := mapped(t, c.size, c.size)
			m.Close()
			got, err := ActivatePages(f, c.n)
			if err != nil {
				t.Fatal(err)
			}
			if got != c.wantPages {
				t.Fatalf("%d pages touched, want %d", got, c.wantPages)
			}
			b := make([]byte, c.size)
			if _, err := f.ReadAt(b, 0); err != nil && c.size > 0 {
				t.Fatal(err)
			}
			if !bytes.Equal(b, want) {
				t.Fatal("the file's bytes changed")
			}
		})
	}
}

func TestActivatePagesZeroesAllocatedPagesNeverWritten(t *testing.T) {
	f, err := OS{}.OpenFile(filepath.Join(t.TempDir(), "f"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Allocate(64 << 10); err != nil {
		t.Fatal(err)
	}
	if n, err := ActivatePages(f, 64<<10); err != nil || n != int(64<<10/int64(unix.Getpagesize())) {
		t.Fatalf("ActivatePages = %d, %v", n, err)
	}
	b := make([]byte, 64<<10)
	if _, err := f.ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b, make([]byte, len(b))) {
		t.Fatal("allocated pages read as something other than zeros")
	}
}

func TestPagesActiveSaysWhatMarkPagesActiveMarked(t *testing.T) {
	dir := t.TempDir()
	open := func(name string) File {
		f, err := OS{}.OpenFile(filepath.Join(dir, name), os.O_RDWR|os.O_CREATE, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f
	}
	marked, plain := open("marked"), open("plain")
	if PagesActive(marked) || PagesActive(plain) {
		t.Fatal("a new file reads as marked")
	}
	if err := MarkPagesActive(marked); err != nil {
		t.Fatal(err)
	}
	if !PagesActive(marked) || PagesActive(plain) {
		t.Fatalf("after marking one: marked %v, plain %v", PagesActive(marked), PagesActive(plain))
	}
	// The mark is the file's, not the descriptor's: a new open sees it,
	// and so does a rename.
	if err := os.Rename(filepath.Join(dir, "marked"), filepath.Join(dir, "renamed")); err != nil {
		t.Fatal(err)
	}
	if !PagesActive(open("renamed")) {
		t.Fatal("a renamed marked file reads as unmarked")
	}
	// Another value under the attribute's name is not the mark.
	if err := unix.Fsetxattr(int(plain.(*osFile).fd), activeAttr, []byte("stale"), 0); err != nil {
		t.Fatal(err)
	}
	if PagesActive(plain) {
		t.Fatal("a file whose attribute holds another value reads as marked")
	}
}

func TestFilesOtherThanTheSystemsCannotBeActivated(t *testing.T) {
	fs := &Faulty{FS: OS{}, Inj: InjectorFunc(func(Op, string) Fault { return Fault{} })}
	f, err := fs.OpenFile(filepath.Join(t.TempDir(), "f"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := ActivatePages(f, 4096); !errors.Is(err, ErrNoActivation) {
		t.Fatalf("ActivatePages: %v, want ErrNoActivation", err)
	}
	if err := MarkPagesActive(f); !errors.Is(err, ErrNoActivation) {
		t.Fatalf("MarkPagesActive: %v, want ErrNoActivation", err)
	}
	if PagesActive(f) {
		t.Fatal("a Faulty file reads as marked")
	}
}
