package objstore_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/objstore/objstoretest"
	"github.com/kvhost/kvhost/internal/testlog"
	"github.com/kvhost/kvhost/internal/testwait"
)

// rgwCtl runs scripts/rgw.sh CMD with args on the test's RGW (KVHOST_RGW_DIR, which
// scripts/rgw.sh run sets), or skips without one.
func rgwCtl(t testing.TB, cmd string, args ...string) {
	t.Helper()
	dir := os.Getenv("KVHOST_RGW_DIR")
	if dir == "" {
		t.Skip("KVHOST_RGW_DIR is not set: the fault tests run under scripts/rgw.sh run (make test-objects)")
	}
	out, err := exec.Command(filepath.Join("..", "..", "scripts", "rgw.sh"), append([]string{cmd, dir}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("rgw.sh %s: %v\n%s", cmd, err, out)
	}
}

// restartRGW starts the radosgw again when the test ends (and now, if
// asked), waiting until it answers.
func restartRGW(t testing.TB) {
	t.Helper()
	t.Cleanup(func() { rgwCtl(t, "resume-rgw"); rgwCtl(t, "start-rgw") })
}

// checkOutcomes fails the test where a key loaded other bytes than
// stored, and returns how many loaded and failed.
func checkOutcomes(t testing.TB, n *objstoretest.Node, res engine.Result, keys, want [][]byte, into [][]int) (loaded, failed, missing int) {
	t.Helper()
	for i, k := range res.Keys {
		switch k.Outcome {
		case engine.OutcomeLoaded:
			loaded++
			if !bytes.Equal(n.Data(into[i]), want[i]) {
				t.Errorf("key %s: loaded with other bytes than stored", keys[i])
			}
		case engine.OutcomeFailed:
			failed++
			t.Logf("key %s: failed: %v", keys[i], k.Err)
		default:
			missing++
		}
	}
	return loaded, failed, missing
}

// TestRGWKilledMidGetFailsTheLoadWithinItsBoundAndLoadsNothingWrong: the
// radosgw SIGKILLed while a load's ranged GETs run (small ranges, one
// request at a time, so that the load lasts): the load ends within its
// bound, every key loaded with its bytes or failed (some failed), and
// once the radosgw is back the keys load whole.
func TestRGWKilledMidGetFailsTheLoadWithinItsBoundAndLoadsNothingWrong(t *testing.T) {
	cfg := rgwConfig(t)
	rgwCtl(t, "start-rgw")
	a := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "a"), cfg)
	keys, want := a.StoreKeys(t, "midget", 4)
	slow := cfg
	slow.Requests, slow.RangeSize, slow.RequestTimeout = 1, 64<<10, 2*time.Second
	b := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "b"), slow)
	into := b.Blocks(len(keys), 0)
	b.ClearBlocks(into)
	restartRGW(t)
	start := time.Now()
	j, err := b.Eng.Load(context.Background(), engine.LoadRequest{Cache: b.Cache, Keys: keys, Blocks: into})
	if err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, "the load's first GETs", time.Minute, func() bool { return b.Store.Stats().Gets >= 20 })
	rgwCtl(t, "kill-rgw")
	res := objstoretest.Wait(t)(j, nil)
	took := time.Since(start)
	loaded, failed, _ := checkOutcomes(t, b, res, keys, want, into)
	if failed == 0 {
		t.Fatalf("every key loaded (%d) before the radosgw was killed: the test did not kill it mid-GET", loaded)
	}
	// Three attempts of a request, each refused at once, and their backoff.
	if bound := 3 * (slow.RequestTimeout + time.Second); took > bound {
		t.Fatalf("the load took %v with the radosgw dead, past %v", took, bound)
	}
	t.Logf("killed mid-GET: %d loaded, %d failed, in %v", loaded, failed, took.Round(time.Millisecond))
	rgwCtl(t, "start-rgw")
	b.LoadAndCompare(t, keys, want)
}

// TestRGWPausedEndpointFailsTheLoadWithinTheRequestTimeout: a radosgw
// that accepts connections and never answers (SIGSTOP) fails a load
// within its requests' timeouts, loading nothing wrong.
func TestRGWPausedEndpointFailsTheLoadWithinTheRequestTimeout(t *testing.T) {
	cfg := rgwConfig(t)
	rgwCtl(t, "start-rgw")
	a := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "a"), cfg)
	keys, want := a.StoreKeys(t, "paused", 2)
	hung := cfg
	hung.RequestTimeout = time.Second
	b := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "b"), hung)
	restartRGW(t)
	rgwCtl(t, "pause-rgw")
	into := b.Blocks(len(keys), 0)
	start := time.Now()
	res := b.Load(t, keys, into)
	took := time.Since(start)
	loaded, failed, _ := checkOutcomes(t, b, res, keys, want, into)
	if loaded != 0 || failed != len(keys) {
		t.Fatalf("with the endpoint paused: %d loaded, %d failed, want every key failed", loaded, failed)
	}
	if bound := 3*hung.RequestTimeout + 2*time.Second; took > bound {
		t.Fatalf("the load took %v with the endpoint paused, past %v", took, bound)
	}
	t.Logf("paused endpoint: %d failed in %v", failed, took.Round(time.Millisecond))
}

// TestRGWKilledMidPutPublishesNoHalfObject: the radosgw SIGKILLed while
// multipart uploads run (one part at a time): every key another node then
// finds in the bucket loads with its bytes, the others are misses, and
// none fails its checks.
func TestRGWKilledMidPutPublishesNoHalfObject(t *testing.T) {
	cfg := rgwConfig(t)
	rgwCtl(t, "start-rgw")
	slow := cfg
	slow.Requests, slow.Uploads, slow.RequestTimeout = 1, 1, 2*time.Second
	a := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "a"), slow)
	restartRGW(t)
	objstoretest.Fill(a.Mem, 11)
	const n = 8
	keys := make([][]byte, n)
	for i := range keys {
		keys[i] = []byte("midput-" + string(rune('a'+i)))
	}
	src := a.Blocks(n, 0)
	a.Put(t, keys, src)
	want := make([][]byte, n)
	for i := range keys {
		want[i] = a.Data(src[i])
	}
	testwait.Until(t, "the first upload", time.Minute, func() bool { return a.Store.Stats().Uploaded >= 1 })
	rgwCtl(t, "kill-rgw")
	testwait.Until(t, "every upload to end", 2*time.Minute, func() bool {
		st := a.Store.Stats()
		return st.Uploaded+st.Failed == n
	})
	st := a.Store.Stats()
	if st.Failed == 0 {
		t.Fatalf("every upload succeeded (%+v): the test did not kill the radosgw mid-PUT", st)
	}
	rgwCtl(t, "start-rgw")
	b := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "b"), cfg)
	into := b.Blocks(n, 0)
	res := b.Load(t, keys, into)
	loaded, failed, missing := checkOutcomes(t, b, res, keys, want, into)
	if failed != 0 || loaded == 0 {
		t.Fatalf("after the kill: %d loaded, %d failed, %d missing; want none failed and some loaded", loaded, failed, missing)
	}
	t.Logf("killed mid-PUT: uploads %d done, %d failed; another node loads %d, misses %d", st.Uploaded, st.Failed, loaded, missing)
}

// TestFullBucketFailsUploadsAndKeepsWhatItHas: a bucket whose quota holds
// one object of the three stored refuses the others' uploads (counted as
// failed, nothing published); another node loads what the bucket holds
// and misses the rest, none failing its checks.
func TestFullBucketFailsUploadsAndKeepsWhatItHas(t *testing.T) {
	cfg := rgwConfig(t)
	rgwCtl(t, "start-rgw")
	// One upload at a time: parts of concurrent uploads would each find
	// room for themselves, and then none for the whole.
	one := cfg
	one.Uploads, one.Requests = 1, 1
	one.Logger = testlog.New(t) // why an upload failed
	a := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "a"), one)
	rgwCtl(t, "bucket-quota", cfg.Bucket, "12582912") // 12 MiB: one object of 8 MiB
	objstoretest.Fill(a.Mem, 13)
	keys := [][]byte{[]byte("full-a"), []byte("full-b"), []byte("full-c")}
	src := a.Blocks(len(keys), 0)
	a.Put(t, keys, src)
	want := make([][]byte, len(keys))
	for i := range keys {
		want[i] = a.Data(src[i])
	}
	testwait.Until(t, "every upload to end", time.Minute, func() bool {
		st := a.Store.Stats()
		return st.Uploaded+st.Failed == uint64(len(keys))
	})
	st := a.Store.Stats()
	if st.Failed == 0 || st.Uploaded == 0 || st.Full != st.Failed {
		t.Fatalf("uploads into a bucket with room for one object: %d done, %d failed, %d of them for room; want both, every failure for room", st.Uploaded, st.Failed, st.Full)
	}
	b := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "b"), cfg)
	into := b.Blocks(len(keys), 0)
	res := b.Load(t, keys, into)
	loaded, failed, missing := checkOutcomes(t, b, res, keys, want, into)
	if failed != 0 || uint64(loaded) != st.Uploaded {
		t.Fatalf("from the full bucket: %d loaded, %d failed, %d missing; want the %d uploaded loaded", loaded, failed, missing, st.Uploaded)
	}
	t.Logf("full bucket: %d uploaded, %d refused; another node loads %d, misses %d", st.Uploaded, st.Failed, loaded, missing)
}
