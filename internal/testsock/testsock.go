// Package testsock gives tests a directory to bind Unix sockets in.
package testsock

import (
	"os"
	"testing"

	"github.com/kvhost/kvhost/internal/config"
)

// Room is how many bytes a socket's path may add to the directory Dir
// returns (a name, or a few directories and a name, such as
// "/run/kvhost/kvhost.sock") and still fit config.MaxSocketPath.
const Room = 48

// Dir returns a new directory, removed when tb ends, whose path leaves
// Room bytes for a socket below it: tb.TempDir() where that is short
// enough, else a directory made in /tmp. A socket's path holds at most
// config.MaxSocketPath bytes (the kernel's sun_path), and a TMPDIR of 60
// bytes or more (CI runners often have one) left no room for one under
// tb.TempDir().
func Dir(tb testing.TB) string {
	tb.Helper()
	if dir := tb.TempDir(); fits(dir) {
		return dir
	}
	dir, err := os.MkdirTemp("/tmp", "kv")
	if err != nil {
		tb.Fatalf("a directory short enough for a socket: %v", err)
	}
	tb.Cleanup(func() {
		if err := os.RemoveAll(dir); err != nil {
			tb.Errorf("remove the socket directory: %v", err)
		}
	})
	return dir
}

// MkdirTemp is Dir for a TestMain, which has no testing.TB: a new
// directory named by pattern (os.MkdirTemp) in the temporary directory,
// or in /tmp where that would leave fewer than Room bytes for a socket
// below it. The caller removes it.
func MkdirTemp(pattern string) (string, error) {
	dir, err := os.MkdirTemp("", pattern)
	if err != nil || fits(dir) {
		return dir, err
	}
	if err := os.Remove(dir); err != nil {
		return "", err
	}
	return os.MkdirTemp("/tmp", pattern)
}

// fits reports whether dir leaves Room bytes for a socket below it.
func fits(dir string) bool { return len(dir)+Room <= config.MaxSocketPath }
