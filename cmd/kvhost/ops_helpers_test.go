package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/fsys/fsystest"
	"github.com/kvhost/kvhost/internal/config"
	kvdaemon "github.com/kvhost/kvhost/internal/daemon"
	"github.com/kvhost/kvhost/internal/metrics/metricstest"
	"github.com/kvhost/kvhost/internal/testsock"
	"github.com/kvhost/kvhost/internal/testwasm"
)

// opsGeo is a small geometry: 2 blocks of 512 bytes per layer and plane
// per key.
var opsGeo = client.Geometry{Model: "ops/test", Layers: 2, KVHeads: 1, HeadSize: 64, DtypeSize: 2, TokensPerBlock: 4, TokensPerKey: 8, TPSize: 1}

const opsBlocks = 256 // blocks per layer tensor

// hangBound is how long a test waits for a daemon (run in this process or
// as a process) to do what the test waits for before it takes the daemon
// for hung. It only catches a hang, so it is long: a daemon's start
// compiles its wasm policy, which under the race detector on a loaded
// 2-core machine took more than a minute. A daemon that exits ends the
// wait at once (lines.end).
const hangBound = 5 * time.Minute

// runDir is the directory of the package's test run that holds what the
// tests share: the built kvhost (kvhostBinary), the policy's compilation
// cache and the default cache root. TestMain makes it and removes it, so
// that a test run leaves nothing behind.
var runDir string

// policyCache is the policy's compilation cache (policy.cache_dir) that
// the package's daemons share, in this process and in the processes it
// starts: the first start of a module compiles it (a built-in policy, Go
// compiled to wasm, took 10 s under the race detector on 2 cores), the
// others read the compiled code (under 0.2 s). It is the default cache
// (config.DefaultRoot()/wasm-cache) of a run that names none, as kvhost
// bench does: TestMain points XDG_CACHE_HOME into runDir, so that no test
// writes into the user's ~/.cache.
var policyCache string

func TestMain(m *testing.M) {
	dir, err := testsock.MkdirTemp("kvhost-cmd-test-") // the default socket is in it
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	runDir = dir
	// The go builds of the tests (kvhostBinary, buildGoClientExample) use
	// the Go build cache they would use without the XDG_CACHE_HOME below,
	// where it was go test's own: under an empty one each built every
	// package from scratch (40 s of kvhostBinary's on 2 cores).
	if os.Getenv("GOCACHE") == "" {
		if out, err := exec.Command("go", "env", "GOCACHE").Output(); err == nil && strings.TrimSpace(string(out)) != "" {
			os.Setenv("GOCACHE", strings.TrimSpace(string(out)))
		}
	}
	if err := os.Setenv("XDG_CACHE_HOME", filepath.Join(dir, "cache")); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	policyCache = filepath.Join(config.DefaultRoot(), "wasm-cache")
	if err := shareCompiledPlugins(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// shareCompiledPlugins makes the package's default compilation caches
// (policyCache, and the one config check and show compile through) links
// to the run's shared directory where `make test` names one (testwasm):
// the plugins compiled there before the race tests are not compiled
// again under the race detector.
func shareCompiledPlugins() error {
	shared := testwasm.Dir()
	if shared == "" {
		return nil
	}
	if err := os.MkdirAll(config.DefaultRoot(), 0o750); err != nil {
		return err
	}
	for _, name := range []string{"wasm-cache", "check-wasm-cache"} {
		if err := os.Symlink(shared, filepath.Join(config.DefaultRoot(), name)); err != nil {
			return err
		}
	}
	return nil
}

// testConfig writes a daemon configuration under dir and returns its
// path, socket (in a directory of its own that leaves room for one:
// testsock.Dir) and cache directory. extra is appended to the file.
func testConfig(t *testing.T, dir, extra string) (file, socket, cache string) {
	t.Helper()
	socket = filepath.Join(testsock.Dir(t), "run", "kvhost.sock")
	cache = filepath.Join(dir, "blocks")
	file = filepath.Join(dir, "kvhost.toml")
	writeConfig(t, file, socket, cache, extra)
	return file, socket, cache
}

func writeConfig(t *testing.T, file, socket, cache, extra string) {
	t.Helper()
	src := fmt.Sprintf("[server]\nsocket = %q\n\n[log]\nformat = \"json\"\n\n[policy]\ncache_dir = %q\n\n%s\n\n[[mount]]\npath = %q\ncapacity = \"256MiB\"\n",
		socket, policyCache, extra, cache)
	// Written whole and renamed: a reload never reads half a file.
	tmp := file + ".tmp"
	if err := os.WriteFile(tmp, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, file); err != nil {
		t.Fatal(err)
	}
}

// kvCache is a client with a registered memfd cache of opsGeo.
type kvCache struct {
	c   *client.Client
	mem *client.Memfd
	id  client.CacheID
	ns  client.Namespace
	bb  int64
}

func newKVCache(t *testing.T, socket string) *kvCache {
	t.Helper()
	ctx := context.Background()
	c, err := client.Dial(ctx, socket, t.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	bb := opsGeo.BlockBytes()
	mem, err := client.NewMemfd("kv", opsCacheBytes())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mem.Close() })
	rid, err := c.RegisterMemfd(ctx, mem)
	if err != nil {
		t.Fatal(err)
	}
	ns, id := registerOpsCache(t, c, rid)
	return &kvCache{c: c, mem: mem, id: id, ns: ns, bb: bb}
}

// opsCacheBytes is the size of a region holding an opsGeo cache.
func opsCacheBytes() int64 { return int64(opsGeo.Layers) * 2 * opsBlocks * opsGeo.BlockBytes() }

// registerOpsCache declares opsGeo and registers a cache of it laid over
// region rid (opsCacheBytes): per layer a tensor of opsBlocks K blocks,
// then as many V blocks.
func registerOpsCache(t *testing.T, c *client.Client, rid client.RegionID) (client.Namespace, client.CacheID) {
	t.Helper()
	ctx := context.Background()
	ns, err := c.Declare(ctx, opsGeo)
	if err != nil {
		t.Fatal(err)
	}
	bb := opsGeo.BlockBytes()
	layers := make([]client.Layer, opsGeo.Layers)
	for l := range layers {
		layers[l] = client.Layer{Region: uint32(rid), NumBlocks: opsBlocks, Offset: int64(l) * 2 * opsBlocks * bb, BlockStride: bb, PlaneStride: opsBlocks * bb}
	}
	id, err := c.RegisterCache(ctx, ns.ID, layers)
	if err != nil {
		t.Fatal(err)
	}
	return ns, id
}

// statsJSON is `kvhost stats --json` against the daemon at socket, parsed.
func statsJSON(t *testing.T, ctx context.Context, socket string) statsReport {
	t.Helper()
	var out, errb bytes.Buffer
	if code := run(ctx, []string{"stats", "--socket", socket, "--json"}, &out, &errb); code != 0 {
		t.Fatalf("kvhost stats: exit %d: %s", code, errb.String())
	}
	var st statsReport
	if err := json.Unmarshal(out.Bytes(), &st); err != nil {
		t.Fatalf("stats --json: %v\n%s", err, out.String())
	}
	return st
}

// span returns the byte slices of blocks (every layer and plane).
func (k *kvCache) span(blocks []uint32) [][]byte {
	var out [][]byte
	m := k.mem.Bytes()
	for l := range int64(opsGeo.Layers) {
		for p := range int64(2) {
			for _, b := range blocks {
				off := l*2*opsBlocks*k.bb + p*opsBlocks*k.bb + int64(b)*k.bb
				out = append(out, m[off:off+k.bb])
			}
		}
	}
	return out
}

// roundTrip fills blocks with random bytes, stores them under key, clears
// them, loads them back and compares. It returns an error rather than
// failing, for goroutines.
func (k *kvCache) roundTrip(ctx context.Context, key string, blocks []uint32, rng *rand.Rand) error {
	var want []byte
	for _, s := range k.span(blocks) {
		for i := range s {
			s[i] = byte(rng.Uint32())
		}
		want = append(want, s...)
	}
	res, err := k.do(ctx, true, key, blocks)
	if err != nil {
		return err
	}
	if o := res.Keys[0].Outcome; o != client.OutcomeStored && o != client.OutcomePresent {
		return fmt.Errorf("store %s: %v (%s)", key, o, res.Message)
	}
	for _, s := range k.span(blocks) {
		clear(s)
	}
	if res, err = k.do(ctx, false, key, blocks); err != nil {
		return err
	}
	if o := res.Keys[0].Outcome; o != client.OutcomeLoaded {
		return fmt.Errorf("load %s: %v (%s)", key, o, res.Message)
	}
	var got []byte
	for _, s := range k.span(blocks) {
		got = append(got, s...)
	}
	if !bytes.Equal(got, want) {
		return fmt.Errorf("load %s: bytes differ from those stored", key)
	}
	return nil
}

func (k *kvCache) do(ctx context.Context, store bool, key string, blocks []uint32) (client.Result, error) {
	keys, bl := [][]byte{[]byte(key)}, [][]uint32{blocks}
	var j *client.Job
	var err error
	if store {
		j, err = k.c.Store(ctx, k.id, keys, bl)
	} else {
		j, err = k.c.Load(ctx, k.id, keys, bl)
	}
	if err != nil {
		return client.Result{}, err
	}
	return j.Wait(ctx)
}

// lines is an io.Writer that keeps what was written and hands every
// complete line to the waiters.
type lines struct {
	mu      sync.Mutex
	all     bytes.Buffer
	partial []byte
	seen    []string
	ended   bool // its writer writes no more (end)
	changed chan struct{}
}

func newLines() *lines { return &lines{changed: make(chan struct{})} }

// end says that nothing more will be written (the daemon exited): a
// wait for a line not written yet fails at once.
func (l *lines) end() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.ended = true
	close(l.changed)
	l.changed = make(chan struct{})
}

// serveHeld runs the daemon with args in the background on the real file
// system, each operation hold is armed for held there, and returns what
// it writes and its exit status, once it exits.
func serveHeld(ctx context.Context, hold *fsystest.Hold, args ...string) (stdout, stderr *lines, exit <-chan int) {
	return runBackground(func(stdout, stderr io.Writer) int {
		return runServeWith(ctx, kvdaemon.Options{FS: &fsys.Faulty{FS: fsys.OS{}, Inj: hold}}, args, stdout, stderr)
	})
}

// runInProcess runs the command line args (run) in the background and
// returns what it writes and its exit status, once it exits.
func runInProcess(ctx context.Context, args ...string) (stdout, stderr *lines, exit <-chan int) {
	return runBackground(func(stdout, stderr io.Writer) int { return run(ctx, args, stdout, stderr) })
}

// serveWithMetrics runs the daemon of config file in this process with
// --metrics on a free port, until the test ends (or ctx does), and waits
// for it to listen on socket; it returns the metrics address and the
// daemon's log. The test fails if the daemon exits other than with 0.
func serveWithMetrics(t *testing.T, ctx context.Context, file, socket string) (addr string, stderr *lines) {
	t.Helper()
	stderr = serveUntilDone(t, ctx, file, socket, "--metrics", "127.0.0.1:0")
	addr, _ = stderr.logLine(t, "metrics listening")["address"].(string)
	return addr, stderr
}

// serveUntilDone runs the daemon of file with extra flags in this process
// until the test ends (its exit status checked then), waits until it
// listens on socket, and returns its stderr.
func serveUntilDone(t *testing.T, ctx context.Context, file, socket string, extra ...string) *lines {
	t.Helper()
	ctx, cancel := context.WithCancel(ctx)
	stdout, stderr, exit := runInProcess(ctx, append([]string{"serve", "--config", file}, extra...)...)
	t.Cleanup(func() {
		cancel()
		if code := <-exit; code != 0 {
			t.Errorf("serve exited %d:\n%s", code, stderr.String())
		}
	})
	stdout.wait(t, "listening line", func(s string) bool { return s == "kvhost: listening on unix:"+socket })
	return stderr
}

// runBackground runs f on new lines in the background and returns them
// and f's exit status, once it returns; then the lines end.
func runBackground(f func(stdout, stderr io.Writer) int) (stdout, stderr *lines, exit <-chan int) {
	stdout, stderr = newLines(), newLines()
	code := make(chan int, 1)
	go func() {
		c := f(stdout, stderr)
		stdout.end()
		stderr.end()
		code <- c
	}()
	return stdout, stderr, code
}

func (l *lines) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.all.Write(b)
	l.partial = append(l.partial, b...)
	for {
		i := bytes.IndexByte(l.partial, '\n')
		if i < 0 {
			break
		}
		l.seen = append(l.seen, string(l.partial[:i]))
		l.partial = l.partial[i+1:]
	}
	close(l.changed)
	l.changed = make(chan struct{})
	return len(b), nil
}

func (l *lines) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.all.String()
}

// wait returns the first line for which match is true, waiting up to
// hangBound for it; it fails at once if the lines end (the daemon exited)
// without one.
func (l *lines) wait(t *testing.T, what string, match func(string) bool) string {
	t.Helper()
	deadline := time.After(hangBound)
	for i := 0; ; {
		l.mu.Lock()
		for ; i < len(l.seen); i++ {
			if match(l.seen[i]) {
				s := l.seen[i]
				l.mu.Unlock()
				return s
			}
		}
		ch, ended := l.changed, l.ended
		l.mu.Unlock()
		if ended {
			t.Fatalf("no %s: the daemon exited; output:\n%s", what, l.String())
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("no %s within %v; output:\n%s", what, hangBound, l.String())
		}
	}
}

// logLine waits for the JSON log line with message msg and returns its
// fields.
func (l *lines) logLine(t *testing.T, msg string) map[string]any {
	t.Helper()
	var m map[string]any
	l.wait(t, "log line "+msg, func(s string) bool {
		m = nil
		return json.Unmarshal([]byte(s), &m) == nil && m["msg"] == msg
	})
	return m
}

// scrapeMetrics gets http://addr/metrics and parses the text format.
func scrapeMetrics(t *testing.T, addr string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/metrics: %s", resp.Status)
	}
	fams, err := metricstest.Parse(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return fams
}

// metricValue is the value (a histogram's count) of the first series of
// name whose labels include want (name, value pairs); -1 if there is none.
func metricValue(fams map[string]*dto.MetricFamily, name string, want ...string) float64 {
	labels := map[string]string{}
	for i := 0; i+1 < len(want); i += 2 {
		labels[want[i]] = want[i+1]
	}
	return metricstest.Value(fams, name, labels)
}

var (
	binOnce sync.Once
	binPath string
	binErr  error
)

// kvhostBinary builds this command once per test run, into runDir.
func kvhostBinary(t *testing.T) string {
	t.Helper()
	binOnce.Do(func() {
		binPath = filepath.Join(runDir, "kvhost")
		out, err := exec.Command("go", "build", "-o", binPath, ".").CombinedOutput()
		if err != nil {
			binErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if binErr != nil {
		t.Fatal(binErr)
	}
	return binPath
}

// proc is a kvhost daemon process.
type proc struct {
	cmd    *exec.Cmd
	stdout *lines
	stderr *lines
	exited chan struct{}
	err    error
}

// startProc runs the built kvhost with args and env added, and waits for
// its listening line on stdout.
func startProc(t *testing.T, env []string, args ...string) *proc {
	t.Helper()
	p := &proc{cmd: exec.Command(kvhostBinary(t), args...), stdout: newLines(), stderr: newLines(), exited: make(chan struct{})}
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.Stdout, p.cmd.Stderr = p.stdout, p.stderr
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		p.err = p.cmd.Wait()
		p.stdout.end()
		p.stderr.end()
		close(p.exited)
	}()
	t.Cleanup(func() {
		p.cmd.Process.Kill()
		<-p.exited
		if t.Failed() {
			t.Logf("daemon stderr:\n%s", p.stderr.String())
		}
	})
	p.stdout.wait(t, "listening line", func(s string) bool { return strings.HasPrefix(s, "kvhost: listening on unix:") })
	return p
}

// waitExit waits for the process to exit and returns its error.
func (p *proc) waitExit(t *testing.T) error {
	t.Helper()
	select {
	case <-p.exited:
		return p.err
	case <-time.After(hangBound):
		t.Fatalf("the daemon did not exit within %v", hangBound)
		return nil
	}
}

var _ io.Writer = (*lines)(nil)

// httpGet asks the daemon's metrics listener at addr for path: the
// status code and the body.
func httpGet(t *testing.T, addr, path string) (int, string) {
	t.Helper()
	resp, err := http.Get("http://" + addr + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}
