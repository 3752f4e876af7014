package reliability

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/testsock"
)

// Daemons in network namespaces of their own (ip netns; root): each
// reaches the bucket only through a relay on its veth pair's host end, so
// that taking that end down partitions it from the endpoint.

// netns is a network namespace joined to the test's by a veth pair whose
// test's end, hostDev, has hostIP.
type netns struct {
	name, hostDev, hostIP string
}

// newNetns makes network namespace i of the test, on the /30 at
// 10.251.x.4i, removed when the test ends; it skips where namespaces
// cannot be made (not root, no ip).
func newNetns(t *testing.T, x, i int) *netns {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("network namespaces need root")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("no ip (iproute2): no network namespaces")
	}
	tag := fmt.Sprintf("%02x%d", x, i)
	n := &netns{name: "kvhost-" + tag, hostDev: "kvh" + tag + "h", hostIP: fmt.Sprintf("10.251.%d.%d", x, 4*i+1)}
	nsDev := "kvh" + tag + "n"
	if out, err := exec.Command("ip", "netns", "add", n.name).CombinedOutput(); err != nil {
		t.Skipf("ip netns add: %v: %s", err, out)
	}
	t.Cleanup(func() {
		exec.Command("ip", "link", "del", n.hostDev).Run()
		exec.Command("ip", "netns", "del", n.name).Run()
	})
	for _, args := range [][]string{
		{"link", "add", n.hostDev, "type", "veth", "peer", "name", nsDev},
		{"link", "set", nsDev, "netns", n.name},
		{"addr", "add", n.hostIP + "/30", "dev", n.hostDev},
		{"link", "set", n.hostDev, "up"},
		{"-n", n.name, "addr", "add", fmt.Sprintf("10.251.%d.%d/30", x, 4*i+2), "dev", nsDev},
		{"-n", n.name, "link", "set", nsDev, "up"},
		{"-n", n.name, "link", "set", "lo", "up"},
	} {
		ipCmd(t, args...)
	}
	return n
}

// ipCmd runs ip with args, failing the test where it fails.
func ipCmd(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
}

// relay forwards every TCP connection accepted on host (port chosen) to
// target until the test ends, and returns the address it listens on: a
// slowRelay whose link is never slowed.
func relay(t *testing.T, host, target string) string {
	t.Helper()
	return newSlowRelay(t, host, target).addr
}

// storeAndShare stores n keys, prefix-NN, on nodes[0] and waits until
// every one is a hit on nodes[1] (a listing of its found them), failing
// the test past a minute; it returns the keys.
func storeAndShare(t *testing.T, nodes []clusterNode, prefix string, n int) [][]byte {
	t.Helper()
	ctx := t.Context()
	keys := make([][]byte, n)
	for i := range keys {
		keys[i] = fmt.Appendf(nil, "%s-%02d", prefix, i)
	}
	if _, err := nodes[0].k.store(ctx, keys); err != nil {
		t.Fatal(err)
	}
	if !waitFor(ctx, time.Minute, 50*time.Millisecond, func() bool {
		got, err := nodes[1].lookup(ctx, keys)
		return err == nil && got == len(keys)
	}) {
		t.Fatal("the keys daemon a stored are not hits on daemon b within a minute")
	}
	return keys
}

// netnsPair is two network namespaces of a test, a and b, and what their
// daemons share: the endpoint of scripts/rgw.sh run, a fresh bucket, and
// a directory for their sockets.
type netnsPair struct {
	ep          *url.URL
	a, b        *netns
	bucket, run string
}

// newNetnsPair makes a test's two namespaces and names a bucket for
// them (kvhost-TAG-…), or skips where there is no endpoint or no
// namespaces.
func newNetnsPair(t *testing.T, tag string) netnsPair {
	t.Helper()
	u, err := url.Parse(rgwEndpoint(t))
	if err != nil {
		t.Fatal(err)
	}
	x := 1 + rand.IntN(250)
	return netnsPair{ep: u, a: newNetns(t, x, 0), b: newNetns(t, x, 1), bucket: fmt.Sprintf("kvhost-%s-%08x", tag, rand.Uint32()), run: testsock.Dir(t)}
}

// config returns the configuration of daemon name in namespace n,
// reaching the pair's bucket at endpoint (host:port), each request
// bounded by timeout.
func (p netnsPair) config(t *testing.T, name string, n *netns, endpoint string, timeout time.Duration) daemonConfig {
	return daemonConfig{Socket: filepath.Join(p.run, name+".sock"), Mount: filepath.Join(t.TempDir(), name), KeysPerFile: 1, NetNS: n.name,
		Extra: objectsTOMLAt("http://"+endpoint, p.bucket, timeout)}
}

// TestObjectsDaemonsInTwoNetworkNamespacesShareOnlyTheBucket: two daemons,
// each in a network namespace of its own with a cache directory of its
// own, reach one bucket through their veth pairs (the endpoint's loopback
// address is out of reach there: a daemon given it does not start). Keys
// one stores load with their bytes on the other. With the second's link
// to the endpoint down (packets dropped, nothing refused), its load fails
// within its bound, twice the request timeout, with a message naming the
// GET of the key's object, and loads nothing; with the link up again the
// key loads.
func TestObjectsDaemonsInTwoNetworkNamespacesShareOnlyTheBucket(t *testing.T) {
	p := newNetnsPair(t, "netns")
	na, nb := p.a, p.b
	const timeout = 2 * time.Second
	cfg := func(name string, n *netns) daemonConfig {
		return p.config(t, name, n, relay(t, n.hostIP, p.ep.Host), timeout)
	}
	direct := cfg("direct", nb)
	direct.Extra = objectsTOMLAt(p.ep.String(), p.bucket, timeout)
	if d, err := tryStartDaemon(t, direct); !errors.Is(err, errDaemonExited) {
		if d != nil {
			d.kill()
		}
		t.Fatalf("a daemon in a namespace given the test's loopback endpoint: %v, want it not to start", err)
	}
	a, b := startDaemon(t, cfg("a", na)), startDaemon(t, cfg("b", nb))
	nodes := dialNodes(t, []*daemon{a, b}, "netns", 8)
	ctx := context.Background()
	keys := storeAndShare(t, nodes, "netns", 4)
	var wrong, missing int
	for _, k := range keys {
		nodes[1].checkLoad(t, 1, k, &wrong, &missing, "stored on daemon a, through the bucket, across namespaces")
	}

	ipCmd(t, "link", "set", nb.hostDev, "down")
	start := time.Now()
	r, err := nodes[1].k.load(ctx, keys[:1])
	took := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	if r.outcomes[0] != client.OutcomeFailed || took > 2*timeout {
		t.Fatalf("a load across the partition: %v in %v, want failed within %v", r.outcomes[0], took, 2*timeout)
	}
	if !strings.Contains(r.message, "objstore: get") || !strings.Contains(r.message, fmt.Sprintf("%x", keys[0])) {
		t.Fatalf("the partitioned load's message %q names no GET of the key's object", r.message)
	}
	ipCmd(t, "link", "set", nb.hostDev, "up")
	if !waitFor(ctx, time.Minute, 100*time.Millisecond, func() bool {
		r, err := nodes[1].k.load(ctx, keys[:1])
		return err == nil && r.match[0]
	}) {
		t.Fatal("the key does not load again within a minute of the link's return")
	}
	t.Logf("two namespaces, one bucket: keys=%d wrong_bytes=%d unloaded=%d; partitioned load failed in %v (request timeout %v)", len(keys), wrong, missing, took.Round(time.Millisecond), timeout)
}
