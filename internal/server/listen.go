package server

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// Socket is the daemon's listening Unix socket.
type Socket struct {
	*net.UnixListener
	path string
	dev  uint64
	ino  uint64
}

// Path is the socket's file name.
func (s *Socket) Path() string { return s.path }

// Close stops listening and removes the socket file if it is still the one
// Listen created (a successor daemon's socket is left alone).
func (s *Socket) Close() error {
	err := s.UnixListener.Close()
	var st unix.Stat_t
	if unix.Lstat(s.path, &st) == nil && st.Dev == s.dev && st.Ino == s.ino {
		if rerr := os.Remove(s.path); rerr != nil && err == nil {
			err = rerr
		}
	}
	return err
}

// Listen creates the daemon's socket at path with permissions mode and, if
// group is not empty, that group (a name or a numeric id). Directories of
// path that Listen creates are made 0750 and, with a group, given to it.
//
// The socket is bound, chmod'ed and chown'ed before listen(2), so that no
// client can connect while it is more permissive than mode, whatever the
// process umask. A socket left by a dead daemon (connecting is refused) is
// replaced; a live one, or any file that is not a socket, is an error.
func Listen(path string, mode os.FileMode, group string) (*Socket, error) {
	if mode&^0o777 != 0 {
		return nil, fmt.Errorf("server: socket mode %o: want permission bits only", mode)
	}
	path = filepath.Clean(path)
	// No probe of the group: the socket's own chown below is the test.
	gid, err := prepareSocketDir(path, group, chowns{})
	if err != nil {
		return nil, err
	}
	if err := removeStale(path); err != nil {
		return nil, err
	}
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("server: socket: %w", err)
	}
	f := os.NewFile(uintptr(fd), "kvhost-listener")
	defer f.Close()
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: path}); err != nil {
		return nil, fmt.Errorf("server: bind %s: %w", path, err)
	}
	cleanup := func(err error) (*Socket, error) {
		os.Remove(path)
		return nil, err
	}
	if err := os.Chmod(path, mode); err != nil {
		return cleanup(fmt.Errorf("server: chmod socket: %w", err))
	}
	if gid >= 0 {
		if err := os.Lchown(path, -1, gid); err != nil {
			return cleanup(ChownGroupError(group, gid, err))
		}
	}
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		return cleanup(fmt.Errorf("server: stat socket: %w", err))
	}
	if err := unix.Listen(fd, unix.SOMAXCONN); err != nil {
		return cleanup(fmt.Errorf("server: listen: %w", err))
	}
	l, err := net.FileListener(f)
	if err != nil {
		return cleanup(fmt.Errorf("server: listener: %w", err))
	}
	return &Socket{UnixListener: l.(*net.UnixListener), path: path, dev: st.Dev, ino: st.Ino}, nil
}

// PrepareSocketDir creates the directories of the socket at path that are
// missing as Listen does (0750 whatever the umask and, if group is not
// empty, given to that group), and returns the group's id (-1 for none).
// A daemon that puts other files next to the socket (its lock, its lookup
// table) calls it first, so that the directories it creates are the
// group's too. With a group, it also checks that the daemon's user may
// give files to it (a member of it, or root), by giving it a probe file
// in the socket's directory: the socket and the lookup table are given
// to it later, after the engine's start (an index rebuild, which may take
// long). A group the machine lacks, or one the user may not give files
// to, is a *GroupError.
func PrepareSocketDir(path, group string) (int, error) {
	return prepareSocketDir(path, group, chowns{probe: (*os.File).Chown})
}

// chowns are how prepareSocketDir gives files to the socket's group (the
// tests fail them as for a user outside the group).
type chowns struct {
	dir   func(name string, uid, gid int) error // the directories it makes; nil: os.Lchown
	probe func(f *os.File, uid, gid int) error  // the probe file; nil: no probe
}

// prepareSocketDir is PrepareSocketDir with the chowns c.
func prepareSocketDir(path, group string, c chowns) (int, error) {
	gid := -1
	if group != "" {
		g, err := LookupGroup(group)
		if err != nil {
			return -1, err
		}
		gid = g
	}
	dir := filepath.Dir(filepath.Clean(path))
	lchown := c.dir
	if lchown == nil {
		lchown = os.Lchown
	}
	if err := socketDir(dir, gid, group, lchown); err != nil {
		return -1, err
	}
	if gid >= 0 && c.probe != nil {
		if err := probeGroup(dir, group, gid, c.probe); err != nil {
			return -1, err
		}
	}
	return gid, nil
}

// probeGroup gives group (id gid) a file it makes in dir, then removes it:
// a *GroupError where chown refuses (EPERM: the daemon's user is not a
// member of the group). A file it cannot make says nothing of the group:
// what needs one there (the engine's lock) reports that.
func probeGroup(dir, group string, gid int, chown func(f *os.File, uid, gid int) error) error {
	f, err := os.CreateTemp(dir, ".kvhost-group-probe-*")
	if err != nil {
		return nil
	}
	defer os.Remove(f.Name())
	defer f.Close()
	if err := chown(f, -1, gid); err != nil {
		return ChownGroupError(group, gid, err)
	}
	return nil
}

// UnknownGroupFix is what to do about a server.socket_group that names a
// group this machine does not have.
const UnknownGroupFix = "create the group, or give its numeric id"

// GroupError is a fault of the socket's group, server.socket_group: the
// machine has no such group, or the daemon's user may not give files to
// it. Its text names neither the key nor the daemon (the daemon's start
// adds the key, and the file and line that set it); Fix says what to do.
type GroupError struct {
	Group string // as given: a name or a numeric id
	Err   error  // what failed
	Fix   string // what to do about it
}

// Error is what failed and, where known, the fix.
func (e *GroupError) Error() string {
	if e.Fix == "" {
		return e.Err.Error()
	}
	return fmt.Sprintf("%v: %s", e.Err, e.Fix)
}

// Unwrap returns what failed.
func (e *GroupError) Unwrap() error { return e.Err }

// ChownGroupError is the *GroupError of err, a failure to give a file to
// group (id gid): where chown refused (EPERM), the daemon's user is not a
// member of the group, and the fix says to make it one or to run the
// daemon as root; other failures have no fix of the group's.
func ChownGroupError(group string, gid int, err error) *GroupError {
	fix := ""
	if errors.Is(err, unix.EPERM) {
		name := group
		if g, lerr := user.LookupGroupId(strconv.Itoa(gid)); lerr == nil {
			name = g.Name
		}
		err = fmt.Errorf("the daemon's user (uid %d) is not a member of group %s (gid %d), and may not give files to it: %w", os.Geteuid(), name, gid, err)
		fix = fmt.Sprintf("add the daemon's user to the group (usermod -aG %s USER; under systemd, SupplementaryGroups=%s), or run the daemon as root", name, name)
	}
	return &GroupError{Group: group, Err: err, Fix: fix}
}

// socketDir creates dir and its missing parents, mode 0750 whatever the
// umask; with a group (gid ≥ 0) the directories it creates belong to that
// group, whose members can then reach the socket. Directories that exist
// are left as they are, so where it cannot give one it made to the group
// or set its mode, it removes those it made: a later start, by a user
// who may, makes them anew instead of keeping a directory the group's
// members cannot search.
func socketDir(dir string, gid int, group string, lchown func(name string, uid, gid int) error) error {
	var created []string // deepest first
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Lstat(d); err == nil || !errors.Is(err, os.ErrNotExist) || d == filepath.Dir(d) {
			break
		}
		created = append(created, d)
	}
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return fmt.Errorf("server: socket directory: %w", err)
	}
	undo := func(err error) error {
		for _, d := range created {
			os.Remove(d) // empty, unless another process wrote there since
		}
		return err
	}
	for _, d := range created {
		if err := os.Chmod(d, 0o750); err != nil {
			return undo(fmt.Errorf("server: socket directory: %w", err))
		}
		if gid >= 0 {
			if err := lchown(d, -1, gid); err != nil {
				return undo(ChownGroupError(group, gid, err))
			}
		}
	}
	return nil
}

// removeStale removes a socket at path that nobody listens on.
func removeStale(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("server: socket path: %w", err)
	}
	if fi.Mode()&os.ModeSocket == 0 {
		return fmt.Errorf("server: %s exists and is not a socket; not replacing it", path)
	}
	c, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		c.Close()
		return fmt.Errorf("server: %s: another daemon is listening there", path)
	}
	if !errors.Is(err, unix.ECONNREFUSED) {
		return fmt.Errorf("server: %s: cannot tell whether a daemon listens there: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("server: remove stale socket: %w", err)
	}
	return nil
}

// LookupGroup is the id of group, a name or a numeric id; a *GroupError,
// with the fix, where this machine has no group of that name.
func LookupGroup(group string) (int, error) {
	if id, err := strconv.Atoi(group); err == nil && id >= 0 {
		return id, nil
	}
	g, err := user.LookupGroup(group)
	if err != nil {
		return 0, &GroupError{Group: group, Err: err, Fix: UnknownGroupFix}
	}
	id, err := strconv.Atoi(g.Gid)
	if err != nil {
		return 0, fmt.Errorf("server: socket group %s: gid %q", group, g.Gid)
	}
	return id, nil
}
