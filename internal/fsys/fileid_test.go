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
