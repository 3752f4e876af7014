package fsys

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

func fileIDOfPath(t *testing.T, path string) FileID {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	return FileIDOf(int(f.Fd()), &st)
}

// TestFileIDKeepsItsGenerationWhileTheFileLives: a file written in place
// and renamed (a spare reused) is the same file; another file is not,
// even in the inode number's slot.
func TestFileIDKeepsItsGenerationWhileTheFileLives(t *testing.T) {
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a"), filepath.Join(dir, "b")
	for _, p := range []string{a, b} {
		if err := os.WriteFile(p, []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	first := fileIDOfPath(t, a)
	if first.Gen == "" {
		t.Skipf("the file system of %s gives files no generation (no file handles, no birth time)", dir)
	}
	if err := os.WriteFile(a, []byte("written in place"), 0o600); err != nil {
		t.Fatal(err)
	}
	moved := filepath.Join(dir, "moved")
	if err := os.Rename(a, moved); err != nil {
		t.Fatal(err)
	}
	if again := fileIDOfPath(t, moved); again != first {
		t.Fatalf("identity changed by a write and a rename: %+v, was %+v", again, first)
	}
	other := fileIDOfPath(t, b)
	if other == first {
		t.Fatalf("two files share an identity: %+v, %+v", first, other)
	}
	if first.Inode() != (FileID{Dev: first.Dev, Ino: first.Ino}) {
		t.Fatalf("Inode kept the generation: %+v", first.Inode())
	}
}

func TestIdentitySameComparesGenerationsOnlyWhereBothHaveOne(t *testing.T) {
	at := func(gen string, size, ctime int64) Identity {
		return Identity{FileID: FileID{Dev: 1, Ino: 2, Gen: gen}, Size: size, Ctime: ctime}
	}
	for _, tt := range []struct {
		name string
		a, b Identity
		same bool
	}{
		{"no generations", at("", 10, 5), at("", 10, 5), true},
		{"one generation", at("h1", 10, 5), at("", 10, 5), true},
		{"equal generations", at("h1", 10, 5), at("h1", 10, 5), true},
		{"other generations", at("h1", 10, 5), at("h2", 10, 5), false},
		{"other size", at("", 10, 5), at("", 11, 5), false},
		{"other ctime", at("", 10, 5), at("", 10, 6), false},
		{"other inode", at("", 10, 5), Identity{FileID: FileID{Dev: 1, Ino: 3}, Size: 10, Ctime: 5}, false},
	} {
		if got := tt.a.Same(tt.b); got != tt.same {
			t.Errorf("%s: Same = %v, want %v", tt.name, got, tt.same)
		}
	}
}
