package client_test

// End-to-end tests: the kvhost binary runs as a real daemon process; Go
// clients (this process and child processes) and Python clients talk to it
// over its socket.

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/testsock"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/protocol"
)

var kvhostBin string

func TestMain(m *testing.M) {
	if os.Getenv("KVHOST_TEST_CHILD") != "" {
		os.Exit(childMain())
	}
	dir, err := testsock.MkdirTemp("kvhost-e2e-") // the default socket is in it
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	kvhostBin = filepath.Join(dir, "kvhost")
	cmd := exec.Command("go", "build", "-o", kvhostBin, "../cmd/kvhost")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building kvhost:", err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// daemon is a kvhost process.
type daemon struct {
	cmd    *exec.Cmd
	socket string
	dir    string
	log    *bytes.Buffer
	exited chan struct{}
	err    error
}

// startDaemon runs kvhost on dir (cache root) and waits for its socket.
func startDaemon(t *testing.T, dir, socket string, extra ...string) *daemon {
	t.Helper()
	return startDaemonArgs(t, socket, append([]string{"serve", "--dir", dir, "--socket", socket, "--log-format", "json", "--log-level", "debug"}, extra...)...)
}

// startDaemonArgs runs kvhost with exactly args.
func startDaemonArgs(t *testing.T, socket string, args ...string) *daemon {
	t.Helper()
	dir := ""
	for i, a := range args {
		if a == "--dir" && i+1 < len(args) {
			dir = args[i+1]
		}
	}
	cmd := exec.Command(kvhostBin, args...)
	// The policy's compilation cache goes under the test's directory, shared
	// by the daemons of this run.
	cmd.Env = append(os.Environ(), "XDG_CACHE_HOME="+filepath.Join(filepath.Dir(kvhostBin), "cache"))
	d := &daemon{cmd: cmd, socket: socket, dir: dir, log: new(bytes.Buffer), exited: make(chan struct{})}
	cmd.Stderr = &lockedWriter{w: d.log}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			select {
			case lines <- sc.Text():
			default:
			}
		}
	}()
	go func() { d.err = cmd.Wait(); close(d.exited) }()
	t.Cleanup(func() {
		d.cmd.Process.Kill()
		<-d.exited
		if t.Failed() {
			t.Logf("daemon log:\n%s", d.log)
		}
	})
	select {
	case l := <-lines:
		if want := "kvhost: listening on unix:" + socket; l != want {
			t.Fatalf("daemon printed %q, want %q", l, want)
		}
	case <-d.exited:
		t.Fatalf("daemon exited: %v\n%s", d.err, d.log)
	case <-time.After(testwait.Hang):
		t.Fatalf("daemon did not start\n%s", d.log)
	}
	return d
}

// stop sends SIGTERM and waits for a clean exit.
func (d *daemon) stop(t *testing.T) {
	t.Helper()
	d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.exited:
	case <-time.After(testwait.Hang):
		t.Fatal("daemon did not stop after SIGTERM")
	}
	if d.err != nil {
		t.Fatalf("daemon exit: %v\n%s", d.err, d.log)
	}
}

type lockedWriter struct {
	mu sync.Mutex
	w  *bytes.Buffer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

func dial(t testing.TB, socket string) *client.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Hang)
	defer cancel()
	c, err := client.Dial(ctx, socket, t.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// tempFiles lists the engine's temporary files under dir.
func tempFiles(t *testing.T, dir string) []string {
	t.Helper()
	var found []string
	filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err == nil && strings.HasPrefix(d.Name(), ".tmp-") {
			found = append(found, path)
		}
		return nil
	})
	return found
}

func newDirs(t *testing.T) (dir, socket string) {
	base := testsock.Dir(t)
	return filepath.Join(base, "cache"), filepath.Join(base, "run", "kvhost.sock")
}

// TestConcurrentClients runs several Go and Python clients at once against
// one daemon, each storing and loading random blocks through its memfd.
func TestConcurrentClients(t *testing.T) {
	dir, socket := newDirs(t)
	startDaemon(t, dir, socket)
	goClients, pyClients, keys := 4, 2, 8
	if testing.Short() {
		goClients, keys = 2, 4
	}
	var wg sync.WaitGroup
	errs := make(chan error, goClients+pyClients)
	for i := 0; i < goClients; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := dial(t, socket)
			tc := newTestCache(t, c)
			rng := rand.New(rand.NewPCG(uint64(i), 1))
			for round := 0; round < 3; round++ {
				tc.roundTrip(t, rng, fmt.Sprintf("go%d-r%d", i, round), keys)
			}
		}()
	}
	for i := 0; i < pyClients; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if out, err := runPython(t, socket, fmt.Sprintf("py%d", i), "roundtrip"); err != nil {
				errs <- fmt.Errorf("python client %d: %v\n%s", i, err, out)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	// Python and Go clients share a namespace: Go sees Python's keys.
	c := dial(t, socket)
	tc := newTestCache(t, c)
	if n, err := c.Lookup(context.Background(), tc.ns.ID, [][]byte{[]byte("py0-0"), []byte("py1-0")}); err != nil || n != 2 {
		t.Fatalf("Go lookup of Python's keys: %d, %v", n, err)
	}
}

func runPython(t *testing.T, socket, prefix, mode string) ([]byte, error) {
	cmd := exec.Command("python3", "testdata/client_test.py", socket, prefix, mode)
	abs, err := filepath.Abs("python/src")
	if err != nil {
		t.Fatal(err)
	}
	cmd.Env = append(os.Environ(), "PYTHONPATH="+abs, "PYTHONDONTWRITEBYTECODE=1")
	return cmd.CombinedOutput()
}

// TestPythonClient runs the Python client's own checks (errors, stats,
// cancellation, CUDA refusal, torch tensors when torch is present).
func TestPythonClient(t *testing.T) {
	dir, socket := newDirs(t)
	startDaemon(t, dir, socket)
	out, err := runPython(t, socket, "pycheck", "checks")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	t.Logf("%s", out)
}

// TestRestart stores keys, stops the daemon with SIGTERM (no temporary
// files, no socket left), starts it again on the same directory and loads
// the keys back.
func TestRestart(t *testing.T) {
	dir, socket := newDirs(t)
	d := startDaemon(t, dir, socket)
	c := dial(t, socket)
	tc := newTestCache(t, c)
	rng := rand.New(rand.NewPCG(7, 7))
	keys := tc.roundTrip(t, rng, "restart", 6)
	want := make([][]byte, len(keys))
	for i, k := range keys {
		if want[i] = tc.load(t, k); want[i] == nil {
			t.Fatalf("key %s not loadable before restart", k)
		}
	}
	// A job in flight at SIGTERM is finished or cancelled, never torn.
	job, err := c.Store(context.Background(), tc.cache, [][]byte{[]byte("at-sigterm")}, [][]uint32{{40, 41}})
	if err != nil {
		t.Fatal(err)
	}
	d.stop(t)
	if _, err := job.Wait(context.Background()); err != nil && !errors.Is(err, client.ErrClosed) {
		t.Fatalf("job at SIGTERM: %v", err)
	}
	if _, err := os.Lstat(socket); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket left after SIGTERM: %v", err)
	}
	if tmp := tempFiles(t, dir); len(tmp) > 0 {
		t.Fatalf("temporary files left after SIGTERM: %v", tmp)
	}
	c.Close()

	startDaemon(t, dir, socket)
	c2 := dial(t, socket)
	tc2 := newTestCache(t, c2)
	if n, err := c2.Lookup(context.Background(), tc2.ns.ID, keys); err != nil || n != len(keys) {
		t.Fatalf("lookup after restart: %d, %v", n, err)
	}
	for i, k := range keys {
		if got := tc2.load(t, k); !bytes.Equal(got, want[i]) {
			t.Fatalf("key %s after restart: bytes differ (nil: %v)", k, got == nil)
		}
	}
}

// TestClientKilledMidStore SIGKILLs a client process while its stores are in
// flight: the daemon releases it, keeps serving, leaves no temporary file,
// and every key the child saw stored loads with the child's bytes.
func TestClientKilledMidStore(t *testing.T) {
	dir, socket := newDirs(t)
	startDaemon(t, dir, socket)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "KVHOST_TEST_CHILD=store-forever", "KVHOST_TEST_SOCKET="+socket)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(stdout)
	stored := map[string]uint64{} // key → seed of its bytes
	for sc.Scan() && len(stored) < 20 {
		var key string
		var seed uint64
		if _, err := fmt.Sscanf(sc.Text(), "stored %s %d", &key, &seed); err != nil {
			t.Fatalf("child said %q", sc.Text())
		}
		stored[key] = seed
	}
	cmd.Process.Kill()
	cmd.Wait()
	if len(stored) < 20 {
		t.Fatalf("child stored only %d keys", len(stored))
	}

	c := dial(t, socket)
	tc := newTestCache(t, c)
	// The child's session is released once the daemon has ended its
	// stores in flight (their writes and fsyncs): only this client is
	// left. The bound only stops a hang.
	testwait.Until(t, "the killed child's session to be released (1 client connected)", time.Minute, func() bool {
		st, err := c.Stats(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		return st.Clients == 1
	})
	if tmp := tempFiles(t, dir); len(tmp) > 0 {
		t.Fatalf("temporary files left by the killed client's jobs: %v", tmp)
	}
	for key, seed := range stored {
		got := tc.load(t, []byte(key))
		if want := childBytes(seed, len(got)); got == nil || !bytes.Equal(got, want) {
			t.Fatalf("key %s stored by the killed child does not load its bytes", key)
		}
	}
	tc.roundTrip(t, rand.New(rand.NewPCG(3, 3)), "after-kill", 4)
}

// childBytes is the content a child writes for a key: deterministic in seed.
func childBytes(seed uint64, n int) []byte {
	rng := rand.New(rand.NewPCG(seed, seed))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	return b
}

// childMain is the body of a child client process.
func childMain() int {
	socket := os.Getenv("KVHOST_TEST_SOCKET")
	t := &childT{}
	c, err := client.Dial(context.Background(), socket, "child")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	tc := newTestCache(t, c)
	ctx := context.Background()
	bpk := tc.ns.BlocksPerKey
	for i := 0; ; i++ {
		// Many keys per job so that jobs are in flight when the kill comes;
		// each job's keys use their own blocks.
		const perJob = 16
		keys := make([][]byte, perJob)
		blocks := make([][]uint32, perJob)
		seeds := make([]uint64, perJob)
		for k := range keys {
			keys[k] = fmt.Appendf(nil, "child-%d-%d", i, k)
			for j := 0; j < bpk; j++ {
				blocks[k] = append(blocks[k], uint32(k*bpk+j))
			}
			seeds[k] = uint64(i*perJob + k + 1)
			want := childBytes(seeds[k], int(testGeometry.Layers)*2*bpk*int(tc.bb))
			off := 0
			for _, s := range tc.segments(blocks[k]) {
				off += copy(s, want[off:])
			}
		}
		job, err := c.Store(ctx, tc.cache, keys, blocks)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		res, err := job.Wait(ctx)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		for k, r := range res.Keys {
			if r.Outcome == client.OutcomeStored {
				fmt.Printf("stored %s %d\n", keys[k], seeds[k])
			}
		}
	}
}

// childT satisfies testing.TB's subset the helpers use, outside a test.
type childT struct{ testing.TB }

func (*childT) Helper()           {}
func (*childT) Cleanup(func())    {}
func (*childT) Fatal(args ...any) { fmt.Fprintln(os.Stderr, args...); os.Exit(1) }
func (*childT) Fatalf(f string, args ...any) {
	fmt.Fprintf(os.Stderr, f+"\n", args...)
	os.Exit(1)
}

// TestIsolation checks that ids are per connection: a client cannot name
// another client's region, namespace, cache or job.
func TestIsolation(t *testing.T) {
	dir, socket := newDirs(t)
	startDaemon(t, dir, socket)
	ctx := context.Background()
	a := dial(t, socket)
	tca := newTestCache(t, a)
	job, err := a.Store(ctx, tca.cache, [][]byte{[]byte("a")}, [][]uint32{{0, 1}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := job.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	b := dial(t, socket)
	cases := []struct {
		name string
		do   func() error
		code protocol.Code
	}{
		{"cache", func() error {
			_, err := b.Store(ctx, tca.cache, [][]byte{[]byte("b")}, [][]uint32{{0, 1}})
			return err
		}, protocol.CodeUnknownCache},
		{"namespace", func() error { _, err := b.Lookup(ctx, tca.ns.ID, [][]byte{[]byte("a")}); return err }, protocol.CodeUnknownNS},
		{"region", func() error {
			ns, err := b.Declare(ctx, testGeometry)
			if err != nil {
				return err
			}
			l := client.Layer{Region: 1, NumBlocks: 1, BlockStride: tca.bb, PlaneStride: tca.bb}
			_, err = b.RegisterCache(ctx, ns.ID, []client.Layer{l, l})
			return err
		}, protocol.CodeUnknownRegion},
		{"unregister region", func() error { return b.UnregisterMemory(ctx, 1) }, protocol.CodeUnknownRegion},
		{"cuda", func() error {
			_, err := b.RegisterCUDAIPC(ctx, 0, [64]byte{1}, 0, 1<<20)
			return err
		}, protocol.CodeUnsupported},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := c.do()
			if !errors.Is(err, &protocol.Error{Code: c.code}) {
				t.Fatalf("got %v, want code %q", err, c.code)
			}
		})
	}
	// The client refuses to cancel a Job through another connection; the
	// daemon, asked anyway, touches no job of another connection.
	if in, err := b.Cancel(ctx, job); !errors.Is(err, client.ErrInvalid) || in {
		t.Fatalf("cancel of another client's job: %v, %v; want %v", in, err, client.ErrInvalid)
	}
	if in := rawCancel(t, socket, job.ID()); in {
		t.Fatalf("a Cancel of job %d, another connection's, answered in flight", job.ID())
	}
	// A region in use by a cache cannot be unregistered.
	if err := a.UnregisterMemory(ctx, 1); !errors.Is(err, &protocol.Error{Code: protocol.CodeInUse}) {
		t.Fatalf("unregister of a region in use: %v", err)
	}
}

// rawCancel sends a Cancel of job on a connection of its own, which
// started no job, and returns the daemon's answer.
func rawCancel(t *testing.T, socket string, job uint64) bool {
	t.Helper()
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: socket, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for i, m := range []protocol.Message{&protocol.Hello{Version: protocol.Version, Client: "raw"}, &protocol.Cancel{Job: job}} {
		if _, err := c.Write(protocol.AppendFrame(nil, uint64(i+1), m)); err != nil {
			t.Fatal(err)
		}
		_, r, err := readRequest(c)
		if err != nil {
			t.Fatal(err)
		}
		if cm, ok := r.(*protocol.Cancelled); ok {
			return cm.InFlight
		}
		if _, ok := r.(*protocol.Welcome); !ok {
			t.Fatalf("%s answered with %#v", m.Type(), r)
		}
	}
	t.Fatal("no answer to the cancel")
	return false
}

// TestSocket checks the socket's mode, that a live daemon's socket is not
// taken over, and that a stale one is.
func TestSocket(t *testing.T) {
	dir, socket := newDirs(t)
	d := startDaemon(t, dir, socket, "--config", writeConfig(t, `[server]
socket_mode = "0600"
`))
	fi, err := os.Lstat(socket)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode %v, want socket 0600", fi.Mode())
	}
	second := exec.Command(kvhostBin, "serve", "--dir", t.TempDir(), "--socket", socket)
	second.Env = append(os.Environ(), "XDG_CACHE_HOME="+t.TempDir())
	out, err := second.CombinedOutput()
	// The node lock beside the socket stops it before it touches a mount.
	if err == nil || !strings.Contains(string(out), "another kvhost runs on this node") {
		t.Fatalf("second daemon on a live socket: %v\n%s", err, out)
	}
	// SIGKILL leaves a stale socket; the next daemon replaces it.
	d.cmd.Process.Kill()
	<-d.exited
	if _, err := os.Lstat(socket); err != nil {
		t.Fatalf("expected a stale socket after SIGKILL: %v", err)
	}
	startDaemon(t, dir, socket)
	dial(t, socket)
}

func writeConfig(t *testing.T, src string) string {
	p := filepath.Join(t.TempDir(), "kvhost.toml")
	if err := os.WriteFile(p, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestExampleConfigServes runs the daemon with examples/kvhost.toml (socket
// and directory overridden by flags) and stores through it.
func TestExampleConfigServes(t *testing.T) {
	dir, socket := newDirs(t)
	startDaemon(t, dir, socket, "--config", "../examples/kvhost.toml")
	tc := newTestCache(t, dial(t, socket))
	tc.roundTrip(t, rand.New(rand.NewPCG(5, 5)), "example", 2)
}

// TestDefaultCommand runs kvhost with no subcommand: it serves, and stops
// cleanly on SIGINT.
func TestDefaultCommand(t *testing.T) {
	dir, socket := newDirs(t)
	d := startDaemonArgs(t, socket, "--dir", dir, "--socket", socket)
	tc := newTestCache(t, dial(t, socket))
	tc.roundTrip(t, rand.New(rand.NewPCG(9, 9)), "default", 1)
	d.cmd.Process.Signal(os.Interrupt)
	select {
	case <-d.exited:
	case <-time.After(testwait.Hang):
		t.Fatal("no exit after SIGINT")
	}
	if d.err != nil {
		t.Fatalf("exit: %v", d.err)
	}
	if _, err := os.Lstat(socket); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket left: %v", err)
	}
}

// flipContext is live for its first live asks and cancelled ever after:
// it ends "while" the request is in flight. A Store asks once before its
// send and twice in it (before and after waiting for its turn to write),
// then once after the reply.
type flipContext struct {
	context.Context
	live  int32
	asked atomic.Int32
}

func (f *flipContext) Err() error {
	if f.asked.Add(1) <= f.live {
		return nil
	}
	return context.Canceled
}

// TestTransferContextEndsInFlight: when ctx ends after a Store was sent, the
// caller still gets the Job (with the error), so it can wait before reusing
// the blocks the daemon may be reading.
func TestTransferContextEndsInFlight(t *testing.T) {
	dir, socket := newDirs(t)
	startDaemon(t, dir, socket)
	c := dial(t, socket)
	tc := newTestCache(t, c)
	rng := rand.New(rand.NewPCG(7, 7))
	blocks := make([]uint32, tc.ns.BlocksPerKey)
	for j := range blocks {
		blocks[j] = uint32(j)
	}
	tc.fill(rng, blocks)
	job, err := c.Store(&flipContext{Context: context.Background(), live: 3}, tc.cache, [][]byte{[]byte("flip")}, [][]uint32{blocks})
	if !errors.Is(err, context.Canceled) || job == nil {
		t.Fatalf("Store with a context that ended in flight: job %v, err %v; want the job and context.Canceled", job, err)
	}
	res, err := job.Wait(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Keys) != 1 {
		t.Fatalf("completion has %d keys", len(res.Keys))
	}
	// Cancelled before it was sent: no job at all.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if job, err := c.Store(ctx, tc.cache, [][]byte{[]byte("never")}, [][]uint32{blocks}); job != nil || !errors.Is(err, context.Canceled) {
		t.Fatalf("Store with a cancelled context: %v %v", job, err)
	}
}
