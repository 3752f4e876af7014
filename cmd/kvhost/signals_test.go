package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/fsys/fsystest"
	kvdaemon "github.com/kvhost/kvhost/internal/daemon"
	"github.com/kvhost/kvhost/internal/daemon/daemontest"
	"github.com/kvhost/kvhost/internal/testwait"
)

// daemonStats asks the daemon behind socket for its Stats.
func daemonStats(t *testing.T, socket string) client.Stats {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hangBound)
	defer cancel()
	c, err := client.Dial(ctx, socket, "test stats")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	st, err := c.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Daemon == nil {
		t.Fatal("no daemon section in the stats")
	}
	return st
}

// TestSIGHUPReloadsUnderLoadLosingNoRequest runs the daemon as a process
// under systemd-style notification while clients store and load without
// pause, and reloads it by SIGHUP several times with a changed policy and
// log level: every request succeeds and reads back what it wrote, every
// reload is reported (RELOADING=1, then READY=1; counted in Stats, with
// the keys that need a restart named), the new log level takes effect, and
// a bad configuration (by SIGHUP and by `kvhost reload`) is refused with
// its reason while the daemon runs on unchanged.
func TestSIGHUPReloadsUnderLoadLosingNoRequest(t *testing.T) {
	dir := t.TempDir()
	file, socket, cache := testConfig(t, dir, "")
	write := func(level string, shards, maxClients int, memoryLimit string) {
		src := fmt.Sprintf("[server]\nsocket = %q\nmax_clients = %d\n\n[log]\nformat = \"json\"\nlevel = %q\n\n"+
			"[policy]\ncache_dir = %q\nshards = %d\nmemory_limit = %q\n\n[[mount]]\npath = %q\ncapacity = \"256MiB\"\n",
			socket, maxClients, level, policyCache, shards, memoryLimit, cache)
		if err := os.WriteFile(file+".tmp", []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(file+".tmp", file); err != nil {
			t.Fatal(err)
		}
	}
	write("info", 1, 64, "64MiB")
	notify := daemontest.NewNotifySocket(t, hangBound)
	p := startProc(t, []string{"NOTIFY_SOCKET=" + notify.Path}, "serve", "--config", file)
	notify.Expect(t, "READY=1")

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var ops, failures atomic.Int64
	var firstErr atomic.Value
	var wg sync.WaitGroup
	const workers = 3
	ready := make(chan struct{}, workers)
	for w := range workers {
		k := newKVCache(t, socket)
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 9))
			for i := 0; ctx.Err() == nil; i++ {
				b := uint32(2 * (i % (opsBlocks / 2)))
				if err := k.roundTrip(ctx, fmt.Sprintf("w%d-%d", w, i), []uint32{b, b + 1}, rng); err != nil {
					if ctx.Err() != nil {
						return
					}
					failures.Add(1)
					firstErr.CompareAndSwap(nil, err)
				}
				if ops.Add(1) == int64(workers) {
					for range workers {
						ready <- struct{}{}
					}
				}
			}
		}()
	}
	<-ready // load is running

	// Three reloads, each changing the policy's sharding; the first also
	// the log level and a key that needs a restart.
	for i, shards := range []int{2, 1, 2} {
		write("debug", shards, 7, "64MiB")
		before := ops.Load()
		if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
			t.Fatal(err)
		}
		notify.Expect(t, "RELOADING=1")
		notify.Expect(t, "READY=1")
		st := daemonStats(t, socket)
		if st.Daemon.Reloads != uint64(i+1) || st.Daemon.ReloadFailures != 0 || !strings.Contains(st.Daemon.LastReload, "changed: policy") {
			t.Fatalf("after reload %d: reloads %d, failures %d, last %q", i+1, st.Daemon.Reloads, st.Daemon.ReloadFailures, st.Daemon.LastReload)
		}
		if i == 0 && (!strings.Contains(st.Daemon.LastReload, "log.level") || !strings.Contains(st.Daemon.LastReload, "needs restart: server.max_clients")) {
			t.Fatalf("first reload reported %q: want log.level changed and server.max_clients needing a restart", st.Daemon.LastReload)
		}
		// Requests went on through the reload.
		testwait.Until(t, "requests after the reload", 60*time.Second, func() bool { return ops.Load() > before+workers })
	}
	// debug now logs what info did not: a debug line appears.
	p.stderr.wait(t, "a debug log line after the reload", func(s string) bool { return strings.Contains(s, `"level":"DEBUG"`) })

	// A bad configuration: refused with its key, the daemon runs on.
	write("debug", 2, 7, "1KiB")
	before := ops.Load()
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	notify.Expect(t, "RELOADING=1")
	notify.Expect(t, "READY=1")
	st := daemonStats(t, socket)
	if st.Daemon.ReloadFailures != 1 || !strings.Contains(st.Daemon.LastReload, "policy.memory_limit") || st.Daemon.Reloads != 3 {
		t.Fatalf("bad config: reloads %d, failures %d, last %q", st.Daemon.Reloads, st.Daemon.ReloadFailures, st.Daemon.LastReload)
	}
	p.stderr.logLine(t, "reload failed; the running configuration is unchanged")
	testwait.Until(t, "requests after the failed reload", 60*time.Second, func() bool { return ops.Load() > before+workers })

	// kvhost reload reports the failure (exit 1) and, once the file is
	// good again, the success (exit 0).
	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"reload", "--socket", socket}, &out, &errb); code != 1 || !strings.Contains(out.String(), "policy.memory_limit") {
		t.Fatalf("kvhost reload of a bad config: exit %d, stdout %q, stderr %q", code, out.String(), errb.String())
	}
	write("debug", 2, 7, "64MiB")
	out.Reset()
	if code := run(context.Background(), []string{"reload", "--socket", socket}, &out, &errb); code != 0 || !strings.Contains(out.String(), "ok") {
		t.Fatalf("kvhost reload: exit %d, stdout %q, stderr %q", code, out.String(), errb.String())
	}

	cancel()
	wg.Wait()
	if n := failures.Load(); n != 0 {
		t.Fatalf("%d of %d round trips failed across the reloads; first: %v", n, ops.Load(), firstErr.Load())
	}
	t.Logf("%d round trips through 6 reloads, none failed", ops.Load())
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := p.waitExit(t); err != nil {
		t.Fatalf("exit after SIGTERM: %v", err)
	}
}

// TestSIGTERMFinishesJobsAndRemovesTheSocket sends SIGTERM while a
// client submits store jobs without pause: every job the daemon accepted
// completes stored (none is lost or cancelled), later submissions are
// refused, the daemon says STOPPING=1, exits 0 and leaves no socket.
func TestSIGTERMFinishesJobsAndRemovesTheSocket(t *testing.T) {
	dir := t.TempDir()
	file, socket, _ := testConfig(t, dir, "[engine]\nfsync = true")
	notify := daemontest.NewNotifySocket(t, hangBound)
	p := startProc(t, []string{"NOTIFY_SOCKET=" + notify.Path}, "serve", "--config", file)
	notify.Expect(t, "READY=1")
	k := newKVCache(t, socket)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var jobs []*client.Job
	var refused error
	for i := 0; ; i++ {
		b := uint32(2 * (i % (opsBlocks / 2)))
		j, err := k.c.Store(ctx, k.id, [][]byte{fmt.Appendf(nil, "key-%d", i)}, [][]uint32{{b, b + 1}})
		if err != nil {
			refused = err
			break
		}
		jobs = append(jobs, j)
		if i == 32 {
			if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
				t.Fatal(err)
			}
		}
	}
	if len(jobs) <= 32 || ctx.Err() != nil {
		t.Fatalf("%d jobs accepted, submission ended with %v: want the daemon to refuse new jobs once draining", len(jobs), refused)
	}
	for i, j := range jobs {
		res, err := j.Wait(ctx)
		if err != nil || res.Keys[0].Outcome != client.OutcomeStored {
			t.Fatalf("job %d of %d accepted: %v %v %s", i, len(jobs), res.Keys, err, res.Message)
		}
	}
	t.Logf("%d jobs accepted, all stored; the next submission got: %v", len(jobs), refused)
	notify.Expect(t, "STOPPING=1")
	k.c.Close()
	if err := p.waitExit(t); err != nil {
		t.Fatalf("exit after SIGTERM: %v", err)
	}
	if _, err := os.Lstat(socket); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket left: %v", err)
	}
	p.stderr.logLine(t, "kvhost stopped")
}

// TestOtherSignalsDoNotStopTheDaemon: SIGQUIT writes every goroutine's
// stack and the daemon serves on; SIGUSR1, SIGUSR2 and SIGPIPE are
// ignored.
func TestOtherSignalsDoNotStopTheDaemon(t *testing.T) {
	file, socket, _ := testConfig(t, t.TempDir(), "")
	p := startProc(t, nil, "serve", "--config", file)
	for _, sig := range []syscall.Signal{syscall.SIGQUIT, syscall.SIGUSR1, syscall.SIGUSR2, syscall.SIGPIPE} {
		if err := p.cmd.Process.Signal(sig); err != nil {
			t.Fatal(err)
		}
	}
	p.stderr.wait(t, "a goroutine dump", func(s string) bool { return strings.HasPrefix(s, "goroutine ") })
	p.stderr.logLine(t, "signal ignored")
	k := newKVCache(t, socket)
	if err := k.roundTrip(context.Background(), "after-signals", []uint32{0, 1}, rand.New(rand.NewPCG(1, 1))); err != nil {
		t.Fatalf("the daemon does not serve after the signals: %v", err)
	}
	select {
	case <-p.exited:
		t.Fatalf("the daemon exited: %v", p.err)
	default:
	}
}

// TestSIGTERMDuringStartUpExitsZero cancels the daemon (SIGTERM) while
// its start-up rebuilds the index: the start ends with an info log line
// and exit status 0, as a drain does, systemd is told STOPPING=1 and
// never READY=1.
func TestSIGTERMDuringStartUpExitsZero(t *testing.T) {
	dir := t.TempDir()
	file, _, cache := testConfig(t, dir, "")
	// A directory in the mount: the rebuild's walk looks at the context
	// before it reads one.
	if err := os.MkdirAll(filepath.Join(cache, "sub"), 0o750); err != nil {
		t.Fatal(err)
	}
	notify := daemontest.NewNotifySocket(t, hangBound)
	t.Setenv("NOTIFY_SOCKET", notify.Path)
	hold := &fsystest.Hold{}
	hold.Arm(fsys.OpReadDir)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, stderr, exit := serveHeld(ctx, hold, "--config", file)
	testwait.Until(t, "the rebuild's ReadDir to be held", hangBound, hold.Holding)
	cancel()
	hold.Release()
	if code := <-exit; code != 0 {
		t.Fatalf("exit status %d after SIGTERM during start-up, want 0; stderr:\n%s", code, stderr.String())
	}
	if l := stderr.logLine(t, "kvhost stopped during start-up"); l["level"] != "INFO" {
		t.Errorf("stopped during start-up logged at %v, want INFO", l["level"])
	}
	if got := notify.Drain(t); !slices.Contains(got, "STOPPING=1") || slices.ContainsFunc(got, isReady) {
		t.Errorf("notifications %q, want STOPPING=1 and no READY=1", got)
	}
}

// isReady reports whether a notification says READY=1.
func isReady(msg string) bool { return slices.Contains(strings.Split(msg, "\n"), "READY=1") }

// TestSIGQUITDumpsStacksWhileTheDaemonStartsOrCloses: SIGQUIT writes
// every goroutine's stack to stderr while the daemon is stuck in its
// start-up (the index rebuild held, as on a hung mount) and while it is
// stuck closing the engine after SIGTERM: the moments a dump is wanted
// most, not only while it serves.
func TestSIGQUITDumpsStacksWhileTheDaemonStartsOrCloses(t *testing.T) {
	tests := []struct {
		name    string
		op      fsys.Op
		serving bool // hold op once the daemon serves, then stop it
	}{
		{"start-up", fsys.OpReadDir, false},
		{"close", fsys.OpClose, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			file, socket, _ := testConfig(t, t.TempDir(), "")
			hold := &fsystest.Hold{}
			if !tt.serving {
				hold.Arm(tt.op)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			stdout, stderr, exit := serveHeld(ctx, hold, "--config", file)
			defer func() {
				hold.Release() // a failed check must not leave the daemon held
				cancel()
				if code := <-exit; code != 0 {
					t.Errorf("serve exited %d:\n%s", code, stderr.String())
				}
			}()
			if tt.serving {
				stdout.wait(t, "listening line", func(s string) bool { return s == "kvhost: listening on unix:"+socket })
				hold.Arm(tt.op)
				cancel()
			}
			testwait.Until(t, "the "+tt.op.String()+" to be held", hangBound, hold.Holding)
			if tt.serving {
				stderr.logLine(t, "kvhost shutting down") // held in the engine's close
			}
			if err := syscall.Kill(os.Getpid(), syscall.SIGQUIT); err != nil {
				t.Fatal(err)
			}
			stderr.wait(t, "goroutine dump", func(s string) bool { return strings.HasPrefix(s, "goroutine ") })
		})
	}
}

// TestSecondSignalExitsWhileAStoreHangsInTheMount: a store whose write
// hangs in the mount (an NFS or FUSE server that stopped answering) holds
// the drain of the first SIGTERM without end, since the server waits for
// every job before it unmaps the client's memory; a second SIGTERM ends
// the daemon at once, with status 1 and a log line saying what was in
// flight. Once the write is let go, what the daemon had left winds down
// (this process goes on, as a killed one would not).
func TestSecondSignalExitsWhileAStoreHangsInTheMount(t *testing.T) {
	file, socket, _ := testConfig(t, t.TempDir(), "")
	hold := &fsystest.Hold{}
	term := make(chan os.Signal, 2)
	stdout, stderr, exit := runBackground(func(stdout, stderr io.Writer) int {
		// Each reading of the clock a second later: the second signal
		// comes well after the first.
		o := kvdaemon.Options{FS: &fsys.Faulty{FS: fsys.OS{}, Inj: hold}, Now: steppingClock(time.Second), Term: term}
		return runServeWith(context.Background(), o, []string{"--config", file}, stdout, stderr)
	})
	defer func() {
		hold.Release()
		// The daemon's goroutines end once the write returns: the socket
		// goes last.
		testwait.Until(t, "the daemon left behind to remove its socket", hangBound, func() bool {
			_, err := os.Lstat(socket)
			return errors.Is(err, os.ErrNotExist)
		})
	}()
	stdout.wait(t, "listening line", func(s string) bool { return s == "kvhost: listening on unix:"+socket })
	k := newKVCache(t, socket)
	hold.Arm(fsys.OpWrite)
	if _, err := k.c.Store(context.Background(), k.id, [][]byte{[]byte("hung")}, [][]uint32{{0, 1}}); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, "the store's write to be held", hangBound, hold.Holding)

	term <- syscall.SIGTERM
	stderr.logLine(t, kvdaemon.MsgStopping)
	term <- syscall.SIGTERM
	var code int
	select {
	case code = <-exit:
	case <-time.After(hangBound):
		t.Fatalf("the daemon did not exit at the second SIGTERM while a store hung; stderr:\n%s", stderr.String())
	}
	if code != 1 {
		t.Errorf("exit status %d at the second signal, want 1", code)
	}
	l := stderr.logLine(t, kvdaemon.MsgForcedExit)
	if l["level"] != "ERROR" || l["signal"] != syscall.SIGTERM.String() || l["jobs_in_flight"] != float64(1) || l["oldest_file_operation_age"] == nil {
		t.Errorf("forced exit logged %v, want ERROR with the signal, 1 job in flight and the oldest file operation's age", l)
	}
}

// steppingClock is a clock each reading of which is step later than the
// one before.
func steppingClock(step time.Duration) func() time.Time {
	var mu sync.Mutex
	t := time.Unix(1_000_000, 0)
	return func() time.Time {
		mu.Lock()
		defer mu.Unlock()
		t = t.Add(step)
		return t
	}
}

// TestAStopSignalRepeatedAtOnceDrainsAsTheFirst: wrappers such as
// timeout(1) signal their child and then its process group, so the
// daemon gets SIGTERM twice within microseconds. That is one request to
// stop: the daemon keeps draining (here, a store held in the mount) and,
// once the store ends, exits with status 0 and removes its socket,
// instead of exiting at once with status 1 as at a second signal sent
// later.
func TestAStopSignalRepeatedAtOnceDrainsAsTheFirst(t *testing.T) {
	file, socket, _ := testConfig(t, t.TempDir(), "")
	hold := &fsystest.Hold{}
	term := make(chan os.Signal, 2)
	stdout, stderr, exit := runBackground(func(stdout, stderr io.Writer) int {
		// A clock that stands still: every signal comes at once.
		o := kvdaemon.Options{FS: &fsys.Faulty{FS: fsys.OS{}, Inj: hold}, Now: steppingClock(0), Term: term}
		return runServeWith(context.Background(), o, []string{"--config", file}, stdout, stderr)
	})
	defer hold.Release()
	stdout.wait(t, "listening line", func(s string) bool { return s == "kvhost: listening on unix:"+socket })
	k := newKVCache(t, socket)
	hold.Arm(fsys.OpWrite)
	if _, err := k.c.Store(context.Background(), k.id, [][]byte{[]byte("held")}, [][]uint32{{0, 1}}); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, "the store's write to be held", hangBound, hold.Holding)

	term <- syscall.SIGTERM
	term <- syscall.SIGTERM
	stderr.logLine(t, kvdaemon.MsgStopping)
	if l := stderr.logLine(t, kvdaemon.MsgRepeatedStop); l["signal"] != syscall.SIGTERM.String() {
		t.Errorf("the repeated signal logged %v, want its signal", l)
	}
	select {
	case code := <-exit:
		t.Fatalf("the daemon exited with status %d at a repeat of the stop signal; stderr:\n%s", code, stderr.String())
	default:
	}
	hold.Release()
	select {
	case code := <-exit:
		if code != 0 {
			t.Errorf("exit status %d after the drain, want 0; stderr:\n%s", code, stderr.String())
		}
	case <-time.After(hangBound):
		t.Fatalf("the daemon did not exit once the held store ended; stderr:\n%s", stderr.String())
	}
	if strings.Contains(stderr.String(), kvdaemon.MsgForcedExit) {
		t.Errorf("a repeat of the stop signal forced the exit; stderr:\n%s", stderr.String())
	}
	if _, err := os.Lstat(socket); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket after the drain: %v, want it removed", err)
	}
}
