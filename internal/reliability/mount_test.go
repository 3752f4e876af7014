package reliability

// File systems the scenarios create (a loop-mounted ext4 image, a small
// tmpfs) and what is on them (kvhost files read by their headers).

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/internal/format"
)

// errNoMount: the file system cannot be created here (not root, no tool,
// no loop device); the message says which.
var errNoMount = errors.New("reliability: cannot mount")

// mountExt4 creates an ext4 image of sizeMiB in a temporary directory and
// loop-mounts it; the mount is removed at the end of the test.
func mountExt4(t testing.TB, sizeMiB int) (string, error) {
	t.Helper()
	if os.Geteuid() != 0 {
		return "", fmt.Errorf("%w: mounting an ext4 image needs root (running as uid %d)", errNoMount, os.Geteuid())
	}
	mkfs, err := exec.LookPath("mkfs.ext4")
	if err != nil {
		return "", fmt.Errorf("%w: no mkfs.ext4 in PATH", errNoMount)
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		return "", fmt.Errorf("%w: no loop devices (/dev/loop-control: %v)", errNoMount, err)
	}
	base := t.TempDir()
	img, dir := filepath.Join(base, "ext4.img"), filepath.Join(base, "mnt")
	if err := os.Mkdir(dir, 0o755); err != nil {
		return "", err
	}
	f, err := os.Create(img)
	if err != nil {
		return "", err
	}
	err = f.Truncate(int64(sizeMiB) << 20)
	f.Close()
	if err != nil {
		return "", err
	}
	if out, err := exec.Command(mkfs, "-q", "-F", img).CombinedOutput(); err != nil {
		return "", fmt.Errorf("%w: mkfs.ext4: %v: %s", errNoMount, err, out)
	}
	if out, err := exec.Command("mount", "-o", "loop", img, dir).CombinedOutput(); err != nil {
		return "", fmt.Errorf("%w: mount -o loop: %v: %s", errNoMount, err, out)
	}
	t.Cleanup(func() { unmount(t, dir) })
	return dir, nil
}

// mountTmpfs mounts a tmpfs of sizeMiB on a temporary directory; the mount
// is removed at the end of the test.
func mountTmpfs(t testing.TB, sizeMiB int) (string, error) {
	t.Helper()
	if os.Geteuid() != 0 {
		return "", fmt.Errorf("%w: mounting a tmpfs needs root (running as uid %d)", errNoMount, os.Geteuid())
	}
	dir := filepath.Join(t.TempDir(), "tmpfs")
	if err := os.Mkdir(dir, 0o755); err != nil {
		return "", err
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, fmt.Sprintf("size=%dm,mode=0755", sizeMiB)); err != nil {
		return "", fmt.Errorf("%w: mount tmpfs on %s: %v", errNoMount, dir, err)
	}
	t.Cleanup(func() { unmount(t, dir) })
	return dir, nil
}

// unmount unmounts dir, lazily if it is still busy.
func unmount(t testing.TB, dir string) {
	if err := unix.Unmount(dir, 0); err != nil {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
	}
}

// onDisk is a kvhost file found on disk.
type onDisk struct {
	path string
	ino  uint64
	keys []string
}

// fileID names one file: a path and the inode it had.
type fileID struct {
	path string
	ino  uint64
}

func (f onDisk) id() fileID { return fileID{f.path, f.ino} }

// scanFiles reads the header of every kvhost file under dir (names not
// starting with "."; files that vanish meanwhile or are not kvhost files
// are skipped) and returns the files holding each key (a key may be in
// several files: two daemons can each store it in a file of its own).
func scanFiles(dir string) map[string][]onDisk {
	byKey := map[string][]onDisk{}
	walkFiles(dir, func(path string, f *os.File, h *format.Header) {
		if h == nil {
			return
		}
		var st syscall.Stat_t
		if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
			return
		}
		fd := onDisk{path: path, ino: st.Ino}
		for _, k := range h.Keys {
			fd.keys = append(fd.keys, string(k.Key))
		}
		for _, k := range fd.keys {
			byKey[k] = append(byKey[k], fd)
		}
	})
	return byKey
}

// walkFiles calls fn with every regular file under dir whose name does
// not start with ".", open, and its kvhost header (nil where it is no
// kvhost file); files that vanish meanwhile are skipped.
func walkFiles(dir string, fn func(path string, f *os.File, h *format.Header)) {
	buf := make([]byte, 64<<10)
	filepath.WalkDir(dir, func(path string, de fs.DirEntry, err error) error {
		if err != nil || !de.Type().IsRegular() || strings.HasPrefix(de.Name(), ".") {
			return nil
		}
		f, err := os.Open(path)
		if err != nil {
			return nil
		}
		defer f.Close()
		var h *format.Header
		if n, err := f.ReadAt(buf, 0); err == nil || errors.Is(err, io.EOF) {
			h, _ = format.Decode(buf[:n])
		}
		fn(path, f, h)
		return nil
	})
}

// fillFile writes zeros to path until the file system is full (or max
// bytes are written, when max > 0) and returns how many bytes it wrote.
func fillFile(path string, max int64) (int64, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	buf := make([]byte, 1<<20)
	var total int64
	for max <= 0 || total < max {
		chunk := buf
		if max > 0 && max-total < int64(len(chunk)) {
			chunk = chunk[:max-total]
		}
		n, err := f.Write(chunk)
		total += int64(n)
		if err != nil {
			if errors.Is(err, syscall.ENOSPC) {
				if len(chunk) > 4096 { // fill the last blocks too
					buf = buf[:4096]
					continue
				}
				return total, nil
			}
			return total, err
		}
	}
	return total, nil
}
