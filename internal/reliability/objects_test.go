package reliability

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/testsock"
)

// objectsTOML returns an [objects] table for a fresh bucket on the S3
// endpoint of scripts/rgw.sh run (make test-objects), whose keys the
// daemons take from the environment, or skips.
func objectsTOML(t *testing.T) string {
	t.Helper()
	return objectsTOMLAt(rgwEndpoint(t), fmt.Sprintf("kvhost-rel-%08x", rand.Uint32()), 5*time.Second)
}

// rgwEndpoint returns the S3 endpoint of scripts/rgw.sh run, or skips.
func rgwEndpoint(t *testing.T) string {
	t.Helper()
	ep := os.Getenv("KVHOST_S3_ENDPOINT")
	if ep == "" {
		t.Skip("KVHOST_S3_ENDPOINT is not set: this test runs under scripts/rgw.sh run (make test-objects)")
	}
	return ep
}

// objectsTOMLAt returns an [objects] table for bucket on endpoint, made
// where missing, each request bounded by timeout.
func objectsTOMLAt(endpoint, bucket string, timeout time.Duration) string {
	return fmt.Sprintf("[objects]\nendpoint = %q\nbucket = %q\ncreate_bucket = true\nlist_interval = \"200ms\"\nrequest_timeout = %q\n",
		endpoint, bucket, timeout.String())
}

// TestObjectsPrefixStoredByOneDaemonLoadsOnAnotherAndAfterAWipe: two
// daemons with a cache directory each and one bucket. Keys one stores are
// hits on the other (its listing finds them) and load there with their
// bytes; the first daemon, stopped, its directory wiped and started
// again, finds and loads them from the bucket.
func TestObjectsPrefixStoredByOneDaemonLoadsOnAnotherAndAfterAWipe(t *testing.T) {
	objects := objectsTOML(t)
	run := testsock.Dir(t)
	cfg := func(name string) daemonConfig {
		return daemonConfig{Socket: filepath.Join(run, name+".sock"), Mount: filepath.Join(t.TempDir(), name), KeysPerFile: 1, Extra: objects}
	}
	ca, cb := cfg("a"), cfg("b")
	a, b := startDaemon(t, ca), startDaemon(t, cb)
	nodes := dialNodes(t, []*daemon{a, b}, "objects", 8)
	ctx := context.Background()
	keys := make([][]byte, 8)
	for i := range keys {
		keys[i] = fmt.Appendf(nil, "objects-%02d", i)
	}
	res, err := nodes[0].k.store(ctx, keys)
	if err != nil {
		t.Fatal(err)
	}
	if res.Message != "" {
		t.Logf("store: %s", res.Message)
	}
	hits := func(n clusterNode) bool {
		got, err := n.lookup(ctx, keys)
		return err == nil && got == len(keys)
	}
	if !waitFor(ctx, time.Minute, 50*time.Millisecond, func() bool { return hits(nodes[1]) }) {
		t.Fatal("the keys daemon a stored are not hits on daemon b within a minute")
	}
	var wrong, missing int
	for _, k := range keys {
		nodes[1].checkLoad(t, 2, k, &wrong, &missing, "stored on daemon a, through the bucket")
	}

	a.stop(t)
	if err := os.RemoveAll(ca.Mount); err != nil {
		t.Fatal(err)
	}
	a = startDaemon(t, ca)
	again := dialNodes(t, []*daemon{a}, "objects-again", 8)[0]
	if !waitFor(ctx, time.Minute, 50*time.Millisecond, func() bool { return hits(again) }) {
		t.Fatal("after the wipe, daemon a does not find its keys in the bucket within a minute")
	}
	for _, k := range keys {
		again.checkLoad(t, 1, k, &wrong, &missing, "after daemon a's directory was wiped")
	}
	t.Logf("objects across daemons: keys=%d wrong_bytes=%d unloaded=%d", len(keys), wrong, missing)
}
