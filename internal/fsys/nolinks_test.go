package fsys

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// TestONoLinksOpensNothingThroughALink: OpenFile with ONoLinks opens a
// file whose every component is a real directory or file (and creates
// one), and fails with ELOOP where a directory of the name or the name
// itself is a symbolic link, creating nothing where it points; the walk
// that stands in for openat2 on older kernels does the same.
func TestONoLinksOpensNothingThroughALink(t *testing.T) {
	dir, outside := t.TempDir(), t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "real"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "real", "f"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(outside, "f"), []byte("y"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(dir, "real", "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(outside, "f"), filepath.Join(dir, "real", "flink")); err != nil {
		t.Fatal(err)
	}
	opens := map[string]func(name string, flag int) error{
		"OpenFile": func(name string, flag int) error {
			f, err := OS{}.OpenFile(name, flag|ONoLinks, 0o644)
			if err == nil {
				f.Close()
			}
			return err
		},
		"walk": func(name string, flag int) error {
			fd, err := openWalkNoLinks(name, flag|unix.O_CLOEXEC, 0o644)
			if err == nil {
				unix.Close(fd)
			}
			return err
		},
	}
	for how, open := range opens {
		for _, name := range []string{"real/f", "real/new-" + how} {
			if err := open(filepath.Join(dir, name), os.O_RDWR|os.O_CREATE); err != nil {
				t.Errorf("%s of %s, no link on the way: %v", how, name, err)
			}
		}
		for _, name := range []string{"real/link/f", "real/link/new", "real/flink"} {
			for _, flag := range []int{os.O_RDONLY, os.O_RDWR | os.O_CREATE} {
				if err := open(filepath.Join(dir, name), flag); !errors.Is(err, syscall.ELOOP) {
					t.Errorf("%s of %s (flag %#x), through a link: %v, want ELOOP", how, name, flag, err)
				}
			}
		}
	}
	if ents, _ := os.ReadDir(outside); len(ents) != 1 {
		t.Errorf("files made through the link: %d names outside, want 1", len(ents))
	}
}
