package main

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/fsys/fsystest"
	"github.com/kvhost/kvhost/internal/daemon/daemontest"
	"github.com/kvhost/kvhost/internal/testsock"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/protocol"
)

// TestServeTellsSystemdsWatchdogItLives: under a systemd watchdog

// ($WATCHDOG_USEC) the daemon sends WATCHDOG=1 again and again while it

// serves.

func TestServeTellsSystemdsWatchdogItLives(t *testing.T) {
	dir := t.TempDir()
	file, _, _ := testConfig(t, dir, "")
	notify := daemontest.NewNotifySocket(t, hangBound)
	startProc(t, []string{"NOTIFY_SOCKET=" + notify.Path, "WATCHDOG_USEC=200000"}, "serve", "--config", file)
	notify.Expect(t, "READY=1")
	for range 3 {
		notify.Expect(t, "WATCHDOG=1")
	}
}

// TestSystemdWatchdogReadsHalfOfWatchdogUsecForThisProcess checks the

// environment systemd sets for a service with WatchdogSec=.

// TestServeStopsTellingSystemdItLivesWhileAFileOperationHangs runs the

// daemon in this process under a systemd watchdog, on a file system that

// holds a store's fsync as a hung mount would, while other stores go on.

// Once the fsync has been held for server.stall_timeout, the daemon

// stops sending WATCHDOG=1

// (systemd would kill and restart it), /healthz answers 503 saying a

// file operation has not returned, and the log says so. When the fsync

// returns, the store ends stored, WATCHDOG=1 comes again and /healthz

// answers 200.

func TestServeStopsTellingSystemdItLivesWhileAFileOperationHangs(t *testing.T) {
	dir := testsock.Dir(t)
	socket, cache, file := filepath.Join(dir, "run", "kvhost.sock"), filepath.Join(dir, "blocks"), filepath.Join(dir, "kvhost.toml")
	src := fmt.Sprintf("[server]\nsocket = %q\nstall_timeout = \"300ms\"\n\n[log]\nformat = \"json\"\n\n[engine]\nfsync = true\n\n"+
		"[policy]\ncache_dir = %q\n\n[[mount]]\npath = %q\ncapacity = \"256MiB\"\n", socket, policyCache, cache)
	if err := os.WriteFile(file, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	notify := daemontest.NewNotifySocket(t, hangBound)
	t.Setenv("NOTIFY_SOCKET", notify.Path)
	t.Setenv("WATCHDOG_USEC", "200000") // a check every 100ms
	t.Setenv("WATCHDOG_PID", strconv.Itoa(os.Getpid()))
	hold := &fsystest.Hold{}
	ctx, cancel := context.WithTimeout(context.Background(), 2*hangBound) // the daemon's and the client's calls: a hang guard
	defer cancel()
	stdout, stderr, exit := serveHeld(ctx, hold, "--config", file, "--metrics", "127.0.0.1:0")
	defer func() {
		hold.Release() // a failed check must not leave the daemon held
		cancel()
		if code := <-exit; code != 0 {
			t.Errorf("serve exited %d:\n%s", code, stderr.String())
		}
	}()
	addr, _ := stderr.logLine(t, "metrics listening")["address"].(string)
	stdout.wait(t, "listening line", func(s string) bool { return s == "kvhost: listening on unix:"+socket })
	healthz := func() (int, string) { return httpGet(t, addr, "/healthz") }
	notify.Expect(t, "WATCHDOG=1")
	if code, body := healthz(); code != http.StatusOK {
		t.Fatalf("/healthz before the hang: %d %q", code, body)
	}

	k := newKVCache(t, socket)
	hold.Arm(fsys.OpSync)
	job, err := k.c.Store(ctx, k.id, [][]byte{[]byte("held")}, [][]uint32{{0, 1}})
	if err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, "the store's fsync to be held", hangBound, hold.Holding)
	// Other stores go on meanwhile (a hung mount beside a working one):
	// the data path keeps moving, so only the held operation's own age
	// can make the daemon stalled.
	stop, moved := make(chan struct{}), make(chan error, 1)
	var stored atomic.Int64
	go func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				moved <- nil
				return
			default:
			}
			if _, err := k.do(ctx, true, fmt.Sprintf("moving-%d", i), []uint32{2, 3}); err != nil {
				moved <- err
				return
			}
			stored.Add(1)
		}
	}()
	var body string
	testwait.Until(t, "/healthz to answer 503 saying a file operation has not returned", hangBound, func() bool {
		var code int
		code, body = healthz()
		return code == http.StatusServiceUnavailable && strings.Contains(body, "has not returned")
	})
	stderr.logLine(t, "watchdog: the daemon is not serving; its supervisor is no longer told it lives")
	// No WATCHDOG=1 while it hangs: those sent before the 503 are
	// drained (up to a marker of the test's own, so that one still in
	// the socket is not left for the count), then ten checks' time
	// passes with at most one (sent by a check that began before the
	// 503).
	notify.Drain(t)
	sent, quiet := 0, time.After(time.Second)
	for waiting := true; waiting; {
		select {
		case m := <-notify.Messages():
			if strings.Contains(m, "WATCHDOG=1") {
				sent++
			}
		case <-quiet:
			waiting = false
		}
	}
	if sent > 1 {
		t.Fatalf("%d WATCHDOG=1 sent in 1s while the store's fsync hangs (/healthz 503)", sent)
	}

	close(stop)
	if err := <-moved; err != nil {
		t.Fatalf("a store beside the held one: %v", err)
	}
	if n := stored.Load(); n < 2 {
		t.Errorf("%d stores ended beside the held one, want the data path moving", n)
	}
	hold.Release()
	res, err := job.Wait(ctx)
	if err != nil || res.Count(protocol.OutcomeStored) != 1 {
		t.Fatalf("the store after its fsync returned: %+v, %v", res, err)
	}
	notify.Expect(t, "WATCHDOG=1")
	testwait.Until(t, "/healthz to answer 200 again", hangBound, func() bool {
		code, _ := healthz()
		return code == http.StatusOK
	})
	stderr.logLine(t, "watchdog: the daemon serves again")
}
