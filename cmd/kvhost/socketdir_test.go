package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/kvhost/kvhost/fsys/fsystest"
	"github.com/kvhost/kvhost/internal/testsock"
)

// TestTheDaemonGivesTheSocketDirectoriesItMakesToTheSocketGroup: the
// directories of the socket's path that the daemon creates are 0750 and
// socket_group's, whatever its umask, although the engine's lock and the
// lookup table, made before the socket, go there first, and the policy's
// compilation cache or a mount may lie in the socket's directory (as in
// the default layout without $XDG_RUNTIME_DIR, all under
// ~/.cache/kvhost): otherwise a client whose only group is socket_group
// cannot reach the socket.
func TestTheDaemonGivesTheSocketDirectoriesItMakesToTheSocketGroup(t *testing.T) {
	gid := os.Getgid()
	if os.Geteuid() == 0 {
		gid = 4242 // root may give a directory to any group
	}
	tests := []struct {
		name                    string
		socket, cacheDir, mount string // under the test's directory
		capacity                string
		made                    []string // the socket's directories the daemon makes
	}{
		{"the socket alone", "run/sub/kvhost.sock", "wasm-cache", "blocks", "256MiB", []string{"run", "run/sub"}},
		{"the policy's compilation cache in the socket's directory", "state/kvhost.sock", "state/wasm-cache", "blocks", "256MiB", []string{"state"}},
		{"a mount sized from its file system in the socket's directory", "state/kvhost.sock", "wasm-cache", "state/blocks", "0", []string{"state"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := testsock.Dir(t)
			file := filepath.Join(dir, "kvhost.toml")
			src := fmt.Sprintf("[server]\nsocket = %q\nsocket_group = \"%d\"\n\n[log]\nformat = \"json\"\n\n[gpu]\nmode = \"off\"\n\n"+
				"[policy]\ncache_dir = %q\n\n[[mount]]\npath = %q\ncapacity = %q\npreallocate = 0\n",
				filepath.Join(dir, tt.socket), gid, filepath.Join(dir, tt.cacheDir), filepath.Join(dir, tt.mount), tt.capacity)
			if err := os.WriteFile(file, []byte(src), 0o644); err != nil {
				t.Fatal(err)
			}
			old := syscall.Umask(0o077) // the daemon inherits it
			startProc(t, nil, "--config", file)
			syscall.Umask(old)
			for _, d := range tt.made {
				fi, err := os.Lstat(filepath.Join(dir, d))
				if err != nil {
					t.Fatal(err)
				}
				if st := fi.Sys().(*syscall.Stat_t); fi.Mode().Perm() != 0o750 || int(st.Gid) != gid {
					t.Errorf("%s: mode %v group %d, want 0750 and socket_group %d", d, fi.Mode().Perm(), st.Gid, gid)
				}
			}
		})
	}
}

// TestARelativeSocketServesWhereItsAbsolutePathIsTooLong: a Unix socket's
// path is at most 107 bytes, and a relative one is the way around that in
// a deep working directory: the daemon binds it as given.
func TestARelativeSocketServesWhereItsAbsolutePathIsTooLong(t *testing.T) {
	dir := t.TempDir()
	deep := filepath.Join(dir, strings.Repeat("d", 60), strings.Repeat("e", 30))
	if err := os.MkdirAll(deep, 0o750); err != nil {
		t.Fatal(err)
	}
	if n := len(filepath.Join(deep, "k.sock")); n < 108 {
		t.Fatalf("the socket's absolute path is %d bytes, which fits: the test needs one that does not", n)
	}
	t.Chdir(deep)
	file, _, _ := testConfig(t, dir, "")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stdout, stderr, exit := serveHeld(ctx, &fsystest.Hold{}, "--config", file, "--socket", "k.sock")
	defer func() {
		cancel()
		if code := <-exit; code != 0 {
			t.Errorf("serve with --socket k.sock in a deep directory exited %d; stderr:\n%s", code, stderr.String())
		}
	}()
	stdout.wait(t, "listening line", func(s string) bool { return s == "kvhost: listening on unix:k.sock" })
}
