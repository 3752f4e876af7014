package reliability

// The harness: the kvhost binary built once per run, daemons started from a
// TOML configuration on a temporary directory, and the suite's mode
// (bounded or long) and seed.

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/config"
)

var longFlag = flag.Bool("long", false, "run the long reliability suite (also KVHOST_RELIABILITY_LONG=1)")

// kvhostBin is the daemon binary TestMain builds for this run.
var kvhostBin string

func TestMain(m *testing.M) {
	flag.Parse()
	dir, err := os.MkdirTemp("", "kvhost-reliability-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	kvhostBin = filepath.Join(dir, "kvhost")
	cmd := exec.Command("go", "build", "-o", kvhostBin, "../../cmd/kvhost")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "reliability: building kvhost:", err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// long reports whether the long suite runs.
func long() bool {
	return *longFlag || os.Getenv("KVHOST_RELIABILITY_LONG") == "1"
}

// seed returns the run's random seed, logged so that a failure can be
// replayed with KVHOST_RELIABILITY_SEED.
func seed(t *testing.T) uint64 {
	t.Helper()
	s := uint64(time.Now().UnixNano())
	if v := os.Getenv("KVHOST_RELIABILITY_SEED"); v != "" {
		var err error
		if s, err = strconv.ParseUint(v, 10, 64); err != nil {
			t.Fatalf("KVHOST_RELIABILITY_SEED=%q: %v", v, err)
		}
	}
	t.Logf("seed %d (replay with KVHOST_RELIABILITY_SEED=%d)", s, s)
	return s
}

// daemonConfig is what a scenario sets in a daemon's configuration.
type daemonConfig struct {
	Socket         string
	Mount          string
	Capacity       string // "" leaves the default (derived from the file system)
	KeysPerFile    int    // 0 leaves the policy's default
	VerifyInterval time.Duration
	TempGrace      time.Duration
	Node           string // node identity, where the configuration has one
	LogLevel       string // "" is info
	// ClusterCapacity and ClusterInterval set the mount's cluster_capacity
	// and cluster_interval ("" and 0 leave them out).
	ClusterCapacity string
	ClusterInterval time.Duration
	// Policy names the policy ("" leaves lru); PolicyParams are more
	// [policy.params] lines ("key = value").
	Policy       string
	PolicyParams []string
	// TickInterval and RestartHold set the [engine] keys of those names
	// (0 and "" leave them out).
	TickInterval time.Duration
	RestartHold  string
	// More are the mounts after Mount, in order.
	More []mountConfig
	// Extra is more TOML, verbatim, after the mounts (an [objects] table).
	Extra string
	// NetNS names the network namespace the daemon runs in (ip netns
	// exec); "" is the test's.
	NetNS string
}

// mountConfig is a [[mount]] table after the first.
type mountConfig struct {
	Path     string
	Capacity string // "" leaves the default
}

// toml renders c. The policy's compilation cache is shared by the run.
func (c daemonConfig) toml() string {
	var b strings.Builder
	fmt.Fprintf(&b, "[server]\nsocket = %q\nshutdown_timeout = \"5s\"\n\n", c.Socket)
	level := c.LogLevel
	if level == "" {
		level = "info"
	}
	fmt.Fprintf(&b, "[log]\nlevel = %q\nformat = \"json\"\n\n", level)
	fmt.Fprintf(&b, "[policy]\ncache_dir = %q\n", filepath.Join(filepath.Dir(kvhostBin), "wasm-cache"))
	if c.Policy != "" {
		fmt.Fprintf(&b, "name = %q\n", c.Policy)
	}
	b.WriteString("\n")
	if c.KeysPerFile > 0 || len(c.PolicyParams) > 0 {
		b.WriteString("[policy.params]\n")
		if c.KeysPerFile > 0 {
			fmt.Fprintf(&b, "keys_per_file = %d\n", c.KeysPerFile)
		}
		for _, l := range c.PolicyParams {
			b.WriteString(l + "\n")
		}
		b.WriteString("\n")
	}
	b.WriteString("[engine]\n")
	if c.VerifyInterval > 0 {
		fmt.Fprintf(&b, "verify_interval = %q\n", c.VerifyInterval.String())
	}
	if c.TempGrace > 0 {
		fmt.Fprintf(&b, "temp_grace = %q\n", c.TempGrace.String())
	}
	if c.TickInterval != 0 {
		fmt.Fprintf(&b, "tick_interval = %q\n", c.TickInterval.String())
	}
	if c.RestartHold != "" {
		fmt.Fprintf(&b, "restart_hold = %q\n", c.RestartHold)
	}
	b.WriteString(nodeSetting(c.Node))
	fmt.Fprintf(&b, "\n[[mount]]\npath = %q\n", c.Mount)
	if c.Capacity != "" {
		fmt.Fprintf(&b, "capacity = %q\n", c.Capacity)
	}
	if c.ClusterCapacity != "" {
		fmt.Fprintf(&b, "cluster_capacity = %q\n", c.ClusterCapacity)
	}
	if c.ClusterInterval > 0 {
		fmt.Fprintf(&b, "cluster_interval = %q\n", c.ClusterInterval.String())
	}
	for _, m := range c.More {
		fmt.Fprintf(&b, "\n[[mount]]\npath = %q\n", m.Path)
		if m.Capacity != "" {
			fmt.Fprintf(&b, "capacity = %q\n", m.Capacity)
		}
	}
	if c.Extra != "" {
		b.WriteString("\n" + c.Extra)
	}
	return b.String()
}

// nodeKeys are the [engine] keys a node identity may be configured with;
// nodeSetting uses the first one the configuration accepts, so that the
// shared-directory scenario gives its daemons distinct identities once the
// configuration has them, and runs without them until then.
var nodeKeys = []string{"node", "node_id", "node_name"}

// nodeSetting returns the [engine] line that sets the node identity to
// name, or "" when name is empty or the configuration has no such key.
func nodeSetting(name string) string {
	if name == "" {
		return ""
	}
	for _, k := range nodeKeys {
		line := fmt.Sprintf("%s = %q\n", k, name)
		if _, err := config.Parse("probe.toml", []byte("[engine]\n"+line)); err == nil {
			return line
		}
	}
	return ""
}

// daemon is a kvhost process.
type daemon struct {
	t      testing.TB
	cfg    daemonConfig
	path   string // configuration file
	cmd    *exec.Cmd
	log    *syncBuffer
	exited chan struct{}
	err    error
}

// syncBuffer is a bytes.Buffer safe for the daemon's writer and the test.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// tail returns the last n bytes of the log.
func (s *syncBuffer) tail(n int) string {
	str := s.String()
	if len(str) > n {
		return "…" + str[len(str)-n:]
	}
	return str
}

// errDaemonExited: the daemon exited before it listened.
var errDaemonExited = errors.New("reliability: daemon exited")

// startDaemon writes cfg to a file and runs `kvhost serve --config` on it,
// waiting until the daemon says it listens. A daemon left running at the
// end of the test is killed.
func startDaemon(t testing.TB, cfg daemonConfig) *daemon {
	t.Helper()
	d, err := tryStartDaemon(t, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// tryStartDaemon is startDaemon returning the failure, with the daemon's
// log, instead of failing the test.
func tryStartDaemon(t testing.TB, cfg daemonConfig) (*daemon, error) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(cfg.Socket), 0o750); err != nil {
		return nil, err
	}
	path := cfg.Socket + ".toml"
	if err := os.WriteFile(path, []byte(cfg.toml()), 0o644); err != nil {
		return nil, err
	}
	d := &daemon{t: t, cfg: cfg, path: path, log: new(syncBuffer), exited: make(chan struct{})}
	d.cmd = exec.Command(kvhostBin, "serve", "--config", path)
	if cfg.NetNS != "" {
		// ip netns exec execs the daemon: the process is the daemon's.
		d.cmd = exec.Command("ip", "netns", "exec", cfg.NetNS, kvhostBin, "serve", "--config", path)
	}
	d.cmd.Env = append(os.Environ(), "XDG_CACHE_HOME="+filepath.Join(filepath.Dir(kvhostBin), "xdg-cache"))
	d.cmd.Stderr = d.log
	stdout, err := d.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := d.cmd.Start(); err != nil {
		return nil, err
	}
	listening := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			select {
			case listening <- sc.Text():
			default:
			}
		}
	}()
	go func() { d.err = d.cmd.Wait(); close(d.exited) }()
	t.Cleanup(func() {
		d.cmd.Process.Kill()
		<-d.exited
	})
	select {
	case l := <-listening:
		if want := "kvhost: listening on unix:" + cfg.Socket; l != want {
			d.kill()
			return nil, fmt.Errorf("daemon printed %q, want %q", l, want)
		}
	case <-d.exited:
		return nil, fmt.Errorf("%w: %v; log:\n%s", errDaemonExited, d.err, d.log.tail(4000))
	case <-time.After(60 * time.Second):
		d.kill()
		return nil, fmt.Errorf("daemon did not listen within 60s; log:\n%s", d.log.tail(4000))
	}
	return d, nil
}

// kill SIGKILLs the daemon and waits for it to be gone.
func (d *daemon) kill() {
	d.cmd.Process.Signal(syscall.SIGKILL)
	<-d.exited
}

// stop sends SIGTERM and waits for a clean exit.
func (d *daemon) stop(t testing.TB) {
	t.Helper()
	d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.exited:
	case <-time.After(60 * time.Second):
		d.kill()
		t.Fatalf("daemon did not stop within 60s of SIGTERM; log:\n%s", d.log.tail(4000))
	}
	if d.err != nil {
		t.Fatalf("daemon exit after SIGTERM: %v; log:\n%s", d.err, d.log.tail(4000))
	}
}

// alive reports whether the daemon process is still running.
func (d *daemon) alive() bool {
	select {
	case <-d.exited:
		return false
	default:
		return true
	}
}

// tempFiles lists the engine's temporary files under dir: names starting
// with ".tmp" (stores in progress, whatever owner tag they carry) or
// ".probe" (the O_DIRECT probe).
func tempFiles(dir string) []string {
	var found []string
	filepath.WalkDir(dir, func(path string, de fs.DirEntry, err error) error {
		if err == nil && !de.IsDir() && (strings.HasPrefix(de.Name(), ".tmp") || strings.HasPrefix(de.Name(), ".probe")) {
			found = append(found, path)
		}
		return nil
	})
	return found
}

// waitFor polls cond every step until it holds or timeout passes, and
// reports whether it held.
func waitFor(ctx context.Context, timeout, step time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return false
		}
		select {
		case <-ctx.Done():
		case <-time.After(step):
		}
	}
}
