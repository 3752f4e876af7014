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
	gid, err := PrepareSocketDir(path, group)
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
			return cleanup(fmt.Errorf("server: chown socket to group %s: %w", group, err))
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
// group's too.
func PrepareSocketDir(path, group string) (int, error) {
	gid := -1
	if group != "" {
		g, err := LookupGroup(group)
		if err != nil {
			return -1, err
		}
		gid = g
	}
	if err := socketDir(filepath.Dir(filepath.Clean(path)), gid); err != nil {
		return -1, err
	}
	return gid, nil
}

// socketDir creates dir and its missing parents, mode 0750 whatever the
// umask; with a group (gid ≥ 0) the directories it creates belong to that
// group, whose members can then reach the socket. Directories that exist
// are left as they are.
func socketDir(dir string, gid int) error {
	var created []string
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Lstat(d); err == nil || !errors.Is(err, os.ErrNotExist) || d == filepath.Dir(d) {
			break
		}
		created = append(created, d)
	}
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return fmt.Errorf("server: socket directory: %w", err)
	}
	for _, d := range created {
		if err := os.Chmod(d, 0o750); err != nil {
			return fmt.Errorf("server: socket directory: %w", err)
		}
		if gid >= 0 {
			if err := os.Lchown(d, -1, gid); err != nil {
				return fmt.Errorf("server: socket directory %s to group %d: %w", d, gid, err)
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

// LookupGroup is the id of group, a name or a numeric id.
func LookupGroup(group string) (int, error) {
	if id, err := strconv.Atoi(group); err == nil && id >= 0 {
		return id, nil
	}
	g, err := user.LookupGroup(group)
	if err != nil {
		return 0, fmt.Errorf("server: socket group: %w", err)
	}
	id, err := strconv.Atoi(g.Gid)
	if err != nil {
		return 0, fmt.Errorf("server: socket group %s: gid %q", group, g.Gid)
	}
	return id, nil
}
