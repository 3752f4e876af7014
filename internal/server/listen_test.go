package server_test

import (
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"

	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/internal/testsock"
)

// TestListenGivesCreatedDirectoriesToTheSocketGroup: the directories
// Listen creates for the socket are 0750 and belong to socket_group, so its
// members can reach the socket; a directory that existed is left alone.
func TestListenGivesCreatedDirectoriesToTheSocketGroup(t *testing.T) {
	gid := os.Getgid()
	if os.Geteuid() == 0 {
		gid = 4242 // root may give a directory to any group
	}
	base := testsock.Dir(t)
	if err := os.Chmod(base, 0o700); err != nil {
		t.Fatal(err)
	}
	old := syscall.Umask(0o077) // the daemon's umask must not matter
	defer syscall.Umask(old)
	path := filepath.Join(base, "run", "kvhost", "kvhost.sock")
	sock, err := server.Listen(path, 0o660, strconv.Itoa(gid))
	if err != nil {
		t.Fatal(err)
	}
	defer sock.Close()
	for _, c := range []struct {
		path string
		mode os.FileMode
		gid  int
	}{
		{filepath.Join(base, "run"), 0o750, gid},
		{filepath.Join(base, "run", "kvhost"), 0o750, gid},
		{path, 0o660, gid},
		{base, 0o700, -1},
	} {
		fi, err := os.Lstat(c.path)
		if err != nil {
			t.Fatal(err)
		}
		st := fi.Sys().(*syscall.Stat_t)
		if fi.Mode().Perm() != c.mode || (c.gid >= 0 && int(st.Gid) != c.gid) {
			t.Errorf("%s: mode %v gid %d, want %v gid %d", c.path, fi.Mode().Perm(), st.Gid, c.mode, c.gid)
		}
	}
}
