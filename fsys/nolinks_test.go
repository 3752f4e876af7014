package fsys

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/internal/testlinks"
)

// TestONoLinksOpensNothingThroughALink: OpenFile with ONoLinks opens a
// file whose every component is a real directory or file (and creates
// one), and fails with ELOOP where a directory of the name or the name
// itself is a symbolic link, creating nothing where it points; the walk
// that stands in for openat2 on older kernels does the same.
func TestONoLinksOpensNothingThroughALink(t *testing.T) {
	dir := t.TempDir()
	outside := testlinks.NewTarget(t, map[string][]byte{"f": []byte("y")})
	if err := os.MkdirAll(filepath.Join(dir, "real"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "real", "f"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	testlinks.Plant(t, filepath.Join(dir, "real", "link"), outside.Dir)
	testlinks.Plant(t, filepath.Join(dir, "real", "flink"), filepath.Join(outside.Dir, "f"))
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
	outside.Untouched(t)
}

// TestAtOpsActInTheDirectoryOpenedNotWhereALinkPoints: OpenAt, StatAt,
// RemoveAt, RenameAt and MkdirAt act on the name in the directory opened
// (O_PATH, ONoLinks), after that directory was moved away and a symbolic
// link to another put in its place: the files where the link points are
// left as they were. OpenAt with ONoLinks refuses a link at the name.
func TestAtOpsActInTheDirectoryOpenedNotWhereALinkPoints(t *testing.T) {
	d := filepath.Join(t.TempDir(), "d")
	if err := os.MkdirAll(d, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"gone", "from"} {
		if err := os.WriteFile(filepath.Join(d, n), []byte(d), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	outside := testlinks.NewTarget(t, map[string][]byte{"gone": []byte("outside"), "from": []byte("outside")})
	var fs FS = OS{}
	df, err := fs.OpenFile(d, unix.O_PATH|unix.O_DIRECTORY|ONoLinks, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer df.Close()
	testlinks.Swap(t, d, outside.Dir)
	if fi, err := StatAt(fs, df, filepath.Join(d, "gone")); err != nil || fi.Size() != int64(len(d)) {
		t.Errorf("StatAt: %v, %v: not the file in the directory opened", fi, err)
	}
	if err := RemoveAt(fs, df, filepath.Join(d, "gone")); err != nil {
		t.Fatal(err)
	}
	if err := RenameAt(fs, df, filepath.Join(d, "from"), df, filepath.Join(d, "to"), true); err != nil && !errors.Is(err, errors.ErrUnsupported) {
		t.Fatal(err)
	}
	if err := MkdirAt(fs, df, filepath.Join(d, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := OpenAt(fs, df, filepath.Join(d, "made"), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	if err := os.Symlink(filepath.Join(outside.Dir, "from"), filepath.Join(d+".old", "link")); err != nil {
		t.Fatal(err)
	}
	if f, err := OpenAt(fs, df, filepath.Join(d, "link"), os.O_RDONLY|ONoLinks, 0); !errors.Is(err, syscall.ELOOP) {
		if err == nil {
			f.Close()
		}
		t.Errorf("OpenAt of a link with ONoLinks: %v, want ELOOP", err)
	}
	if err := os.Remove(filepath.Join(d+".old", "link")); err != nil {
		t.Fatal(err)
	}
	if err := MkdirAt(fs, df, filepath.Join(d, "sub"), 0o755); !errors.Is(err, os.ErrExist) {
		t.Errorf("MkdirAt of a name there: %v, want ErrExist", err)
	}
	outside.Untouched(t)
	var names []string
	ents, _ := os.ReadDir(d + ".old")
	for _, e := range ents {
		names = append(names, e.Name())
	}
	if len(names) != 3 || names[0] != "made" || names[1] != "sub" || names[2] != "to" {
		t.Errorf("in the directory opened: %v, want [made sub to]", names)
	}
}
