package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/internal/testsock"
)

// dialingCommand is a command that dials the daemon's socket, with the
// arguments it needs besides --socket.
type dialingCommand struct {
	name  string
	run   func(ctx context.Context, args []string, stdout, stderr io.Writer) int
	extra []string
}

// dialingCommands are the commands that dial the daemon: stats, health,
// purge and reload.
func dialingCommands() []dialingCommand {
	return []dialingCommand{
		{"stats", runStats, nil},
		{"health", runHealth, nil},
		{"purge", runPurge, []string{"--model", "m"}},
		{"reload", runReload, nil},
	}
}

// TestEveryCommandThatDialsSaysWhatToDoWhenNoDaemonAnswers: stats,
// health, purge and reload, given a socket where no daemon listens (no
// file there; a socket file nobody listens on), exit 1 with one wording:
// the socket's path once, the system call's error and the hint to check
// that the daemon runs and to give its socket.
func TestEveryCommandThatDialsSaysWhatToDoWhenNoDaemonAnswers(t *testing.T) {
	dir := testsock.Dir(t) // a socket's path must be short: not under a long TMPDIR
	missing := filepath.Join(dir, "nothing.sock")
	stale := filepath.Join(dir, "stale.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: stale, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false)
	l.Close() // the file stays; connecting is refused
	cmds := dialingCommands()
	for _, sock := range []struct {
		name, path, errno string
	}{
		{"no file", missing, "connect: no such file or directory"},
		{"nobody listens", stale, "connect: connection refused"},
	} {
		for _, c := range cmds {
			t.Run(sock.name+"/"+c.name, func(t *testing.T) {
				var out, errb bytes.Buffer
				if code := c.run(t.Context(), append([]string{"--socket", sock.path}, c.extra...), &out, &errb); code != 1 {
					t.Fatalf("exit %d, want 1; stderr:\n%s", code, errb.String())
				}
				msg := errb.String()
				if n := strings.Count(msg, sock.path); n != 1 {
					t.Errorf("the socket's path appears %d times, want once:\n%s", n, msg)
				}
				if want := sock.errno + ": " + hintNoDaemon; !strings.Contains(msg, want) {
					t.Errorf("stderr lacks %q:\n%s", want, msg)
				}
			})
		}
	}
}

// TestExplainDial: a connection the socket's permissions refuse says to
// run as a member of server.socket_group (or root), and every explained
// error still unwraps to the system call's errno; an error other than a
// failed connect is left as it is. (EACCES is made up: the tests run as
// root, whom no permission refuses.)
func TestExplainDial(t *testing.T) {
	dialErr := func(errno syscall.Errno) error {
		op := &net.OpError{Op: "dial", Net: "unix", Addr: &net.UnixAddr{Name: "/run/k.sock", Net: "unix"}, Err: os.NewSyscallError("connect", errno)}
		return fmt.Errorf("client: dial /run/k.sock: %w", op)
	}
	other := errors.New("client: handshake: EOF")
	for _, tt := range []struct {
		name  string
		err   error
		want  string // the whole message
		errno error
	}{
		{"no file", dialErr(syscall.ENOENT), "connect: no such file or directory: " + hintNoDaemon, syscall.ENOENT},
		{"refused", dialErr(syscall.ECONNREFUSED), "connect: connection refused: " + hintNoDaemon, syscall.ECONNREFUSED},
		{"permission", dialErr(syscall.EACCES), "connect: " + hintNoAccess, syscall.EACCES},
		{"not permitted", dialErr(syscall.EPERM), "connect: " + hintNoAccess, syscall.EPERM},
		{"other", other, other.Error(), other},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got := explainDial(tt.err)
			if got.Error() != tt.want {
				t.Errorf("got %q, want %q", got, tt.want)
			}
			if !errors.Is(got, tt.errno) {
				t.Errorf("%v does not unwrap to %v", got, tt.errno)
			}
		})
	}
}

// TestEveryCommandThatDialsSaysItsTimeoutPassed: stats, health, purge
// and reload, given a socket whose listener accepts and never answers
// (a daemon stuck on a hung mount, another program's socket), said only
// "client: handshake: context deadline exceeded" once --timeout passed.
// They exit 1 saying that no answer came within --timeout, and its value.
func TestEveryCommandThatDialsSaysItsTimeoutPassed(t *testing.T) {
	sock := filepath.Join(testsock.Dir(t), "silent.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() { // accept, read, never answer
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() { io.Copy(io.Discard, c); c.Close() }()
		}
	}()
	for _, c := range dialingCommands() {
		t.Run(c.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			if code := c.run(t.Context(), append([]string{"--socket", sock, "--timeout", "50ms"}, c.extra...), &out, &errb); code != 1 {
				t.Fatalf("exit %d, want 1; stderr:\n%s", code, errb.String())
			}
			if want := sock + ": no answer within --timeout 50ms"; !strings.Contains(errb.String(), want) {
				t.Fatalf("stderr lacks %q:\n%s", want, errb.String())
			}
		})
	}
}

// TestEveryCommandThatDialsRefusesASocketPathTooLong: a Unix socket's
// address holds at most config.MaxSocketPath bytes, so a daemon on a
// deep directory listens on a relative path (config.md). Given that
// socket's absolute path, the commands said only "connect: invalid
// argument". They exit 1 naming the limit, the path's length and the
// way around it.
func TestEveryCommandThatDialsRefusesASocketPathTooLong(t *testing.T) {
	long := "/tmp/" + strings.Repeat("d", config.MaxSocketPath) + "/kvhost.sock"
	for _, c := range dialingCommands() {
		t.Run(c.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			if code := c.run(t.Context(), append([]string{"--socket", long}, c.extra...), &out, &errb); code != 1 {
				t.Fatalf("exit %d, want 1; stderr:\n%s", code, errb.String())
			}
			want := fmt.Sprintf("a Unix socket's path holds at most %d bytes, and this one has %d: give it relative to a directory nearer the socket (cd there first)", config.MaxSocketPath, len(long))
			if !strings.Contains(errb.String(), want) {
				t.Fatalf("stderr lacks %q:\n%s", want, errb.String())
			}
		})
	}
}
