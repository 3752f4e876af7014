package testsock_test

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/internal/testsock"
)

// TestDirLeavesRoomForASocket: under a short TMPDIR and under one of 80
// bytes and more, Dir is a directory in which a socket path of Room more
// bytes fits, and it is gone once its test has ended.
func TestDirLeavesRoomForASocket(t *testing.T) {
	root, err := os.MkdirTemp("/tmp", "ts")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	for name, tmp := range map[string]string{"short": root, "long": filepath.Join(root, strings.Repeat("a", 80))} {
		if err := os.MkdirAll(tmp, 0o700); err != nil {
			t.Fatal(err)
		}
		var dir string
		t.Run(name, func(t *testing.T) {
			t.Setenv("TMPDIR", tmp)
			dir = testsock.Dir(t)
			if n := len(dir) + testsock.Room; n > config.MaxSocketPath {
				t.Errorf("Dir under TMPDIR %s is %s: a socket of %d bytes more is %d bytes, over %d", tmp, dir, testsock.Room, n, config.MaxSocketPath)
			}
			if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
				t.Errorf("Dir %s: %v, want a directory", dir, err)
			}
		})
		if _, err := os.Stat(dir); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("Dir %s after its test ended: %v, want it removed", dir, err)
		}
	}
}

// TestMkdirTempLeavesRoomForASocket: MkdirTemp under a TMPDIR of 80 bytes
// and more is a directory in which a socket path of Room more bytes fits.
func TestMkdirTempLeavesRoomForASocket(t *testing.T) {
	long := filepath.Join(testsock.Dir(t), strings.Repeat("a", 80))
	if err := os.Mkdir(long, 0o700); err != nil {
		t.Fatal(err)
	}
	t.Setenv("TMPDIR", long)
	dir, err := testsock.MkdirTemp("kv-main-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	if n := len(dir) + testsock.Room; n > config.MaxSocketPath || !strings.HasPrefix(filepath.Base(dir), "kv-main-") {
		t.Errorf("MkdirTemp under TMPDIR %s is %s: want kv-main-*, and a socket of %d bytes more is %d bytes, over %d", long, dir, testsock.Room, n, config.MaxSocketPath)
	}
}
