package main

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// TestTheDaemonGivesTheSocketDirectoriesItMakesToTheSocketGroup: the
// directories of the socket's path that the daemon creates are 0750 and
// socket_group's, whatever its umask, although the engine's lock and the
// lookup table, made before the socket, go there first: otherwise a
// client whose only group is socket_group cannot reach the socket.
func TestTheDaemonGivesTheSocketDirectoriesItMakesToTheSocketGroup(t *testing.T) {
	gid := os.Getgid()
	if os.Geteuid() == 0 {
		gid = 4242 // root may give a directory to any group
	}
	dir := t.TempDir()
	socket := filepath.Join(dir, "run", "sub", "kvhost.sock")
	file := filepath.Join(dir, "kvhost.toml")
	writeConfig(t, file, socket, filepath.Join(dir, "blocks"), "[gpu]\nmode = \"off\"")
	src, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	src = []byte(strings.Replace(string(src), "[server]\n", "[server]\nsocket_group = \""+strconv.Itoa(gid)+"\"\n", 1))
	if err := os.WriteFile(file, src, 0o644); err != nil {
		t.Fatal(err)
	}
	old := syscall.Umask(0o077) // the daemon inherits it
	startProc(t, nil, "--config", file)
	syscall.Umask(old)
	for _, d := range []string{filepath.Join(dir, "run"), filepath.Join(dir, "run", "sub")} {
		fi, err := os.Lstat(d)
		if err != nil {
			t.Fatal(err)
		}
		if st := fi.Sys().(*syscall.Stat_t); fi.Mode().Perm() != 0o750 || int(st.Gid) != gid {
			t.Errorf("%s: mode %v group %d, want 0750 and socket_group %d", d, fi.Mode().Perm(), st.Gid, gid)
		}
	}
}
