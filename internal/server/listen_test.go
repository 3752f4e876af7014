package server_test

import (
	"errors"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
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

// TestPrepareSocketDirFindsASocketGroupItCannotUse: a socket_group the
// machine lacks, or one the daemon's user may not give files to (chown
// refuses with EPERM: the user is not a member), is a *GroupError at
// once, with the fix (create the group; add the user to it or run as
// root), before the daemon's slow start; the probe file leaves nothing
// behind, whatever its chown did. (EPERM is made up: root may give a file
// to any group.)
func TestPrepareSocketDirFindsASocketGroupItCannotUse(t *testing.T) {
	gid := strconv.Itoa(os.Getgid())
	eperm := func(*os.File, int, int) error { return syscall.EPERM }
	for _, tt := range []struct {
		name    string
		group   string
		chown   func(f *os.File, uid, gid int) error
		want    []string // in the error; none: no error
		wantErr error
	}{
		{"member", gid, (*os.File).Chown, nil, nil},
		{"unknown group", "kvhost-no-such-group", (*os.File).Chown,
			[]string{"unknown group kvhost-no-such-group", server.UnknownGroupFix}, user.UnknownGroupError("kvhost-no-such-group")},
		{"not a member", gid, eperm,
			[]string{"is not a member of group", "operation not permitted", "SupplementaryGroups=", "or run the daemon as root"}, syscall.EPERM},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			_, err := server.PrepareSocketDirChown(filepath.Join(dir, "kvhost.sock"), tt.group, tt.chown)
			if tt.want == nil {
				if err != nil {
					t.Fatal(err)
				}
			} else {
				var ge *server.GroupError
				if !errors.As(err, &ge) || ge.Group != tt.group || !errors.Is(err, tt.wantErr) {
					t.Fatalf("%v: want a *GroupError of %q wrapping %v", err, tt.group, tt.wantErr)
				}
				for _, w := range tt.want {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("%v: want it to say %q", err, w)
					}
				}
			}
			if left, _ := os.ReadDir(dir); len(left) != 0 {
				t.Errorf("the probe left %v in the socket's directory", left)
			}
		})
	}
}

// TestPrepareSocketDirRemovesTheDirectoriesItMadeWhenTheGroupRefuses: a
// daemon whose user may not give files to socket_group stops at the
// first directory it made for the socket, which it cannot give to the
// group. That directory stayed, 0750 and of the daemon's own group, so
// that the next start, once the user was added to the group, found it
// existing and left it as it was: the group's members could not reach
// the socket in it. The directories a refused start made are removed;
// the next start makes them anew and gives them to the group. (EPERM is
// made up: root may give a directory to any group.)
func TestPrepareSocketDirRemovesTheDirectoriesItMadeWhenTheGroupRefuses(t *testing.T) {
	gid := 4242
	base := testsock.Dir(t)
	path := filepath.Join(base, "run", "kvhost", "kvhost.sock")
	eperm := func(string, int, int) error { return syscall.EPERM }
	_, err := server.PrepareSocketDirChowns(path, strconv.Itoa(gid), eperm, (*os.File).Chown)
	var ge *server.GroupError
	if !errors.As(err, &ge) || !errors.Is(err, syscall.EPERM) {
		t.Fatalf("%v: want a *GroupError wrapping EPERM", err)
	}
	if _, err := os.Lstat(filepath.Join(base, "run")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the refused start left %s (%v); want it removed", filepath.Join(base, "run"), err)
	}
	if os.Geteuid() != 0 {
		return // only root may give the directories to a made-up group
	}
	if _, err := server.PrepareSocketDirChowns(path, strconv.Itoa(gid), os.Lchown, (*os.File).Chown); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{filepath.Join(base, "run"), filepath.Dir(path)} {
		fi, err := os.Lstat(d)
		if err != nil {
			t.Fatal(err)
		}
		if st := fi.Sys().(*syscall.Stat_t); int(st.Gid) != gid || fi.Mode().Perm() != 0o750 {
			t.Errorf("%s: mode %v gid %d, want 0750 gid %d", d, fi.Mode().Perm(), st.Gid, gid)
		}
	}
}
