package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/client"
)

// runReload implements `kvhost reload`: it finds the daemon behind the
// socket (its pid, from the socket's peer credentials), sends it SIGHUP
// and waits until the daemon's Stats count the reload, then prints how it
// went. Exit status 0: reloaded; 1: the reload failed (the daemon runs on
// with its old configuration) or the daemon could not be reached.
func runReload(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("kvhost reload", "usage: kvhost reload [--socket PATH | --config FILE] [--timeout D]\n\nReloads the daemon's configuration (SIGHUP) and reports the result.", stderr)
	df := bindDaemonFlags(fs, 2*time.Minute, "how long to wait for the reload")
	if code, ok := df.parse(fs, args, stdout, stderr); !ok {
		return code
	}
	ctx, cancel := df.withTimeout(ctx)
	defer cancel()
	if err := reloadDaemon(ctx, *df.socket, stdout); err != nil {
		fmt.Fprintf(stderr, "kvhost reload: %s: %v\n", *df.socket, df.explain(err))
		return 1
	}
	return 0
}

func reloadDaemon(ctx context.Context, socket string, stdout io.Writer) error {
	c, err := dialDaemon(ctx, socket, "kvhost reload")
	if err != nil {
		return err
	}
	defer c.Close()
	before, err := c.Stats(ctx)
	if err != nil {
		return err
	}
	if before.Daemon == nil {
		return errors.New("the daemon predates reload reporting (no daemon section in its stats)")
	}
	pid, err := peerPID(socket)
	if err != nil {
		return explainDial(err)
	}
	if err := syscall.Kill(pid, syscall.SIGHUP); err != nil {
		return fmt.Errorf("signal the daemon (pid %d): %w (run as the daemon's user or root)", pid, err)
	}
	count := func(s client.Stats) uint64 { return s.Daemon.Reloads + s.Daemon.ReloadFailures }
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		st, err := c.Stats(ctx)
		if err != nil {
			return err
		}
		if st.Daemon != nil && count(st) > count(before) {
			fmt.Fprintf(stdout, "kvhost reload (pid %d): %s\n", pid, st.Daemon.LastReload)
			if st.Daemon.ReloadFailures > before.Daemon.ReloadFailures {
				return errors.New("the reload failed")
			}
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("no reload reported: %w", ctx.Err())
		case <-tick.C:
		}
	}
}

// peerPID is the pid of the process listening on a Unix socket (SO_PEERCRED).
func peerPID(socket string) (int, error) {
	conn, err := net.DialTimeout("unix", socket, 5*time.Second)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	raw, err := conn.(*net.UnixConn).SyscallConn()
	if err != nil {
		return 0, err
	}
	var cred *unix.Ucred
	var serr error
	if err := raw.Control(func(fd uintptr) { cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) }); err != nil {
		return 0, err
	}
	if serr != nil {
		return 0, fmt.Errorf("peer credentials of %s: %w", socket, serr)
	}
	if cred.Pid <= 0 {
		return 0, fmt.Errorf("the daemon behind %s is in another pid namespace; send it SIGHUP there", socket)
	}
	return int(cred.Pid), nil
}
