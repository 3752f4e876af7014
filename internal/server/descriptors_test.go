package server_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/protocol"
)

// hogSocketEnv names the socket TestHelperDescriptorHog connects to.
const hogSocketEnv = "KVHOST_TEST_HOG_SOCKET"

// hogReport prefixes the line TestHelperDescriptorHog reports on.
const hogReport = "HOG: "

// TestHelperDescriptorHog is not a test: run by
// TestOneProcessCannotTakeEveryDescriptor in a process of its own, it
// registers one memfd over and over on a connection until the daemon
// refuses or drops it, and where it was dropped (the daemon ran out of
// descriptors), registers as many on a new connection as the first held:
// the daemon then has no descriptor left for itself. It reports what
// happened on stdout and holds its registrations until its stdin closes.
func TestHelperDescriptorHog(t *testing.T) {
	socket := os.Getenv(hogSocketEnv)
	if socket == "" {
		t.Skip("run by TestOneProcessCannotTakeEveryDescriptor")
	}
	ctx := context.Background()
	mem, err := client.NewMemfd("hog", 4096)
	if err != nil {
		t.Fatal(err)
	}
	register := func(most int) (int, error) {
		c, err := client.Dial(ctx, socket, "hog")
		if err != nil {
			return 0, err
		}
		for n := range most {
			if _, err := c.RegisterMemfd(ctx, mem); err != nil {
				return n, err
			}
		}
		return most, nil
	}
	n, err := register(256) // a connection's own bound
	report := fmt.Sprintf("%d registrations, then: %v", n, err)
	if !errors.Is(err, &protocol.Error{Code: protocol.CodeLimit}) && n > 1 {
		// Dropped: the daemon's descriptors ran out. Until its release of
		// that connection gives them back, a new one may be dropped too.
		for try := range 100 {
			m, err := register(n - try/10)
			if err == nil {
				report += fmt.Sprintf("; %d on a new connection", m)
				break
			}
		}
	}
	fmt.Println(hogReport + report)
	io.Copy(io.Discard, os.Stdin)
}

// parallelLimitEnv has TestHelperParallelFileLimit run, calling
// t.Parallel before lowerFileLimit ("before") or after it ("after").
const parallelLimitEnv = "KVHOST_TEST_PARALLEL_FILE_LIMIT"

// TestHelperParallelFileLimit is not a test: run by
// TestLowerFileLimitRefusesParallelTests in a process of its own, it
// lowers the open-file limit in a parallel test.
func TestHelperParallelFileLimit(t *testing.T) {
	order := os.Getenv(parallelLimitEnv)
	if order == "" {
		t.Skip("run by TestLowerFileLimitRefusesParallelTests")
	}
	if order == "before" {
		t.Parallel()
	}
	lowerFileLimit(t, 192)
	if order == "after" {
		t.Parallel()
	}
}

// TestLowerFileLimitRefusesParallelTests: the open-file limit is the
// process's, so a test that lowers it must run alone; one that also calls
// t.Parallel, before or after, fails at once rather than starving the
// tests that run beside it of descriptors.
func TestLowerFileLimitRefusesParallelTests(t *testing.T) {
	for _, order := range []string{"before", "after"} {
		t.Run("t.Parallel "+order, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestHelperParallelFileLimit$", "-test.count=1")
			cmd.Env = append(os.Environ(), parallelLimitEnv+"="+order)
			out, err := cmd.CombinedOutput()
			if err == nil || !strings.Contains(string(out), "can not use t.Parallel") {
				t.Errorf("a parallel test that lowers the open-file limit: %v, want it to fail saying it can not use t.Parallel:\n%s", err, out)
			}
		})
	}
}

// lowerFileLimitEnv is set, while lowerFileLimit holds the open-file
// limit lowered, to that limit.
const lowerFileLimitEnv = "KVHOST_TEST_LOWERED_NOFILE"

// lowerFileLimit sets the process's soft limit of open files to those
// open now and slack more, until the test ends. The limit is the
// process's: a test beside this one would run out of descriptors, and
// its descriptors would take this one's. So that none runs beside it,
// lowerFileLimit sets an environment variable with t.Setenv, which fails
// the test at once where it, or one of its parents, calls t.Parallel,
// before or after.
func lowerFileLimit(t *testing.T, slack int) {
	var old unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &old); err != nil {
		t.Fatal(err)
	}
	low := old
	low.Cur = uint64(countFds(t) + slack)
	t.Setenv(lowerFileLimitEnv, strconv.FormatUint(low.Cur, 10))
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &low); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Setrlimit(unix.RLIMIT_NOFILE, &old) })
}

// TestOneProcessCannotTakeEveryDescriptor: a daemon that may open 192
// files more than it has open is started; a client registers a cache,
// then another process registers memory until it can register no more.
// That process gets limit exceeded naming
// server.max_descriptors_per_peer, and the first client still stores
// and loads (the daemon kept descriptors for its files).
func TestOneProcessCannotTakeEveryDescriptor(t *testing.T) {
	lowerFileLimit(t, 192)
	f := newFixture(t, server.Config{})
	k := newCache(t, f.dial(t))

	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperDescriptorHog$", "-test.count=1")
	cmd.Env = append(os.Environ(), hogSocketEnv+"="+f.socket)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	stop := func() {
		stdin.Close()
		cmd.Wait()
	}
	t.Cleanup(stop)
	var report string
	for sc := bufio.NewScanner(stdout); sc.Scan(); {
		if line, ok := strings.CutPrefix(sc.Text(), hogReport); ok {
			report = line
			break
		}
	}
	if !strings.Contains(report, "server.max_descriptors_per_peer") {
		t.Errorf("the process registering memory: %q, want limit exceeded naming server.max_descriptors_per_peer", report)
	}
	rng := rand.New(rand.NewPCG(3, 3))
	want := k.store(t, "beside the hog", []uint32{0, 1}, rng)
	if got := k.load(t, "beside the hog", []uint32{2, 3}); string(got) != string(want) {
		t.Fatal("the key stored beside the process that registered memory does not load its bytes")
	}
	stop()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := f.srv.WaitSessions(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if st := f.srv.Stats(); st.Descriptors != 1 {
		t.Errorf("the daemon counts %d descriptors of clients held once the other process left, want 1 (the cache's region)", st.Descriptors)
	}
}

// TestDescriptorsOfAllConnectionsAreBounded: registrations on all
// connections together hold at most server.max_descriptors descriptors; a
// registration beyond it is refused with limit exceeded naming the key,
// the connection serves on, and a registration given back makes room.
// Descriptors sent with a frame that claims none count until it is
// answered.
func TestDescriptorsOfAllConnectionsAreBounded(t *testing.T) {
	const limit = 8
	f := newFixture(t, server.Config{MaxDescriptors: limit, MaxDescriptorsPerPeer: limit})
	ctx := context.Background()
	mem, err := client.NewMemfd("fds", 4096)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mem.Close() })
	conns := []*client.Client{f.dial(t), f.dial(t)}
	var ids []client.RegionID
	for i := range limit {
		id, err := conns[i%2].RegisterMemfd(ctx, mem)
		if err != nil {
			t.Fatalf("registration %d of %d: %v", i+1, limit, err)
		}
		ids = append(ids, id)
	}
	_, err = conns[0].RegisterMemfd(ctx, mem)
	var pe *protocol.Error
	if !errors.As(err, &pe) || pe.Code != protocol.CodeLimit || !strings.Contains(pe.Message, "server.max_descriptors)") {
		t.Fatalf("registration %d: %v, want limit exceeded naming server.max_descriptors", limit+1, err)
	}
	if st := f.srv.Stats(); st.Descriptors != limit || st.DescriptorLimit != limit {
		t.Errorf("the daemon counts %d descriptors held of %d, want %d of %d", st.Descriptors, st.DescriptorLimit, limit, limit)
	}
	if err := conns[1].UnregisterMemory(ctx, ids[1]); err != nil {
		t.Fatal(err)
	}
	if _, err := conns[0].RegisterMemfd(ctx, mem); err != nil {
		t.Fatalf("a registration once another was given back: %v", err)
	}

	// A descriptor with a frame that takes none is held until the frame
	// is answered, and given back then.
	if err := conns[1].UnregisterMemory(ctx, ids[3]); err != nil {
		t.Fatal(err)
	}
	r := f.raw(t)
	r.hello()
	r.send(2, &protocol.StatsRequest{}, mem.Fd())
	if _, m, err := r.recv(); err != nil || m.Type() != protocol.TypeStats|protocol.TypeReply {
		t.Fatalf("stats with a descriptor: %#v %v", m, err)
	}
	// The reply is written before the frame's descriptors are closed.
	testwait.Until(t, "the stats frame's descriptor to be given back", time.Minute, func() bool { return f.srv.Stats().Descriptors == limit-1 })
}
