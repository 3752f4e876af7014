package reliability

// Issue 85's cluster scenarios (docs/cluster.md, "One bound", "Checked
// claims", "Untagged files"), on the multi-node suite's shared file
// system (KVHOST_CLUSTER_MOUNTS; one local directory given three times
// runs them too).

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/clustercap"
	"github.com/kvhost/kvhost/internal/testsock"
	"github.com/kvhost/kvhost/internal/testwait"
)

// agreeFor is how long each node stores in the mismatched-bounds phase;
// agreePace how often it stores (equal rates); agreeAfter how long the
// later phases store.
const (
	agreeFor   = 30 * time.Second
	agreePace  = 20 * time.Millisecond
	agreeAfter = 5 * time.Second
)

// paced has every node of nodes store a key of its own (prefix, node,
// its count) every agreePace for d, at once, and returns the keys each
// acknowledged and the stores each had refused for room. Anything else
// fails t.
func paced(t *testing.T, nodes []clusterNode, prefix string, d time.Duration) (acked, refused []int) {
	t.Helper()
	r := pacedEach(t, nodes, prefix, d, func(int) time.Duration { return agreePace })
	return r.acked, r.refused
}

// pacedStores is what pacedEach's stores got, by node: acknowledged,
// refused for room (with the last refusal's message), and the time the
// stores took in all and at most.
type pacedStores struct {
	acked, refused []int
	last           []string
	took, slowest  []time.Duration
}

// pacedEach is paced with node n storing every pace(n) (0: back to back).
func pacedEach(t *testing.T, nodes []clusterNode, prefix string, d time.Duration, pace func(n int) time.Duration) pacedStores {
	t.Helper()
	ctx := context.Background()
	r := pacedStores{acked: make([]int, len(nodes)), refused: make([]int, len(nodes)), last: make([]string, len(nodes)),
		took: make([]time.Duration, len(nodes)), slowest: make([]time.Duration, len(nodes))}
	errs := make(chan error, len(nodes))
	var wg sync.WaitGroup
	end := time.Now().Add(d)
	for n := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var tick <-chan time.Time
			if p := pace(n); p > 0 {
				tk := time.NewTicker(p)
				defer tk.Stop()
				tick = tk.C
			}
			for i := 0; time.Now().Before(end); i++ {
				if tick != nil {
					<-tick
				}
				key := fmt.Appendf(nil, "%s-n%d-%06d", prefix, n+1, i)
				start := time.Now()
				res, err := nodes[n].k.store(ctx, [][]byte{key})
				took := time.Since(start)
				r.took[n] += took
				r.slowest[n] = max(r.slowest[n], took)
				if err != nil {
					errs <- fmt.Errorf("node-%d: store of %s: %w", n+1, key, err)
					return
				}
				switch o := res.Keys[0].Outcome; {
				case o == client.OutcomeStored:
					r.acked[n]++
				case o == client.OutcomeFailed && strings.Contains(res.Message, "no space"):
					r.refused[n]++
					r.last[n] = res.Message
				default:
					errs <- fmt.Errorf("node-%d: store of %s: %v (%s)", n+1, key, o, res.Message)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	return r
}

// sampleMount sums the files on dir every 20 ms until the returned stop
// is called, which returns the peak and the largest data file seen.
func sampleMount(dir string) (stop func() (peak, file int64)) {
	var peak, file atomic.Int64
	done := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			total, files := mountFiles(dir)
			peak.Store(max(peak.Load(), total))
			for _, sz := range files {
				file.Store(max(file.Load(), sz))
			}
			select {
			case <-done:
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	return func() (int64, int64) {
		close(done)
		<-sampled
		return peak.Load(), file.Load()
	}
}

// logLines counts the lines of d's log holding s.
func logLines(d *daemon, s string) int {
	return strings.Count(d.log.String(), s)
}

// TestClusterNodesOfMismatchedBoundsForgedClaimsAndAnUntaggedDaemon runs
// three daemons on one directory with cluster capacities of 1x, 1x and
// 8x capBound, storing one key each every agreePace:
//
//   - for agreeFor: the files on the mount never pass capBound (the
//     smallest configured) by more than one file, each node acknowledges
//     at least a third of what each other does, and a warning names the
//     other capacity;
//   - then a summary claiming 2^62 bytes is written for a node that does
//     not run: the stores go on as before (the mount within the bound,
//     each node acknowledging at least half its earlier share), and each
//     daemon logs one line naming the summary file;
//   - then a daemon without a cluster capacity (its files' owner tags no
//     summary names) stores a quarter of the bound on the mount, on top
//     of the nodes' files, and the three nodes look its keys up: they
//     count its files against the bound, evicting their own until the
//     mount is back within it, where it stays as they store on, and a
//     warning names them.
func TestClusterNodesOfMismatchedBoundsForgedClaimsAndAnUntaggedDaemon(t *testing.T) {
	mounts := clusterMounts(t)
	if len(mounts) < 3 {
		t.Skipf("needs three mounts, %s gives %d", clusterEnv, len(mounts))
	}
	mounts = mounts[:3]
	run := testsock.Dir(t)
	bounds := []int64{capBound, capBound, 8 * capBound}
	ds := make([]*daemon, len(mounts))
	for i, m := range mounts {
		cfg := clusterConfig(run, m, i)
		cfg.ClusterCapacity = fmt.Sprint(bounds[i])
		cfg.ClusterInterval = capInterval
		ds[i] = startDaemon(t, cfg)
	}
	nodes := dialNodes(t, ds, "agree", 4)

	stop := sampleMount(mounts[0])
	acked, refused := paced(t, nodes, "agree", agreeFor)
	peak, file := stop()
	t.Logf("mismatched bounds, %v: acknowledged %v, refused %v, peak %d bytes of a bound of %d (files of %d)", agreeFor, acked, refused, peak, capBound, file)
	if peak > capBound+file {
		t.Errorf("the files on the mount peaked at %d bytes, over the smallest bound of %d by more than one file of %d", peak, capBound, file)
	}
	for i := range acked {
		for j := range acked {
			if 3*acked[i] < acked[j] {
				t.Errorf("node-%d acknowledged %d keys, node-%d %d: less than a third", i+1, acked[i], j+1, acked[j])
			}
		}
	}
	warned := 0
	for _, d := range ds {
		warned += logLines(d, "another node configures another cluster_capacity")
	}
	if warned == 0 {
		t.Error("no daemon warned of the other cluster_capacity")
	}

	// A summary claiming 2^62 bytes, for a node that does not run.
	b, err := clustercap.Encode(&clustercap.Summary{Version: clustercap.SummaryVersion, Node: "forged", Tag: clustercap.Tag("forged"), Seq: 1,
		Time: time.Now().UnixNano(), Interval: int64(time.Hour), Bytes: clustercap.MaxBytes, Claim: clustercap.MaxBytes})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(mounts[0], clustercap.DirName, "forged.summary"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	stop = sampleMount(mounts[0])
	after, refusedAfter := paced(t, nodes, "forged", agreeAfter)
	peak, file = stop()
	t.Logf("beside a summary claiming 2^62, %v: acknowledged %v, refused %v, peak %d bytes", agreeAfter, after, refusedAfter, peak)
	if peak > capBound+file {
		t.Errorf("beside the forged summary the files on the mount peaked at %d bytes, over the bound of %d by more than one file", peak, capBound)
	}
	for i := range after {
		// Rates: acknowledged per store tried, against the first phase's.
		if tried, was := after[i]+refusedAfter[i], float64(acked[i])/float64(max(acked[i]+refused[i], 1)); tried == 0 || 2*float64(after[i])/float64(tried) < was {
			t.Errorf("node-%d acknowledged %d of %d stores beside the forged summary, against %d of %d before", i+1, after[i], tried, acked[i], acked[i]+refused[i])
		}
		if n := logLines(ds[i], "a claim that cannot hold"); n != 1 {
			t.Errorf("node-%d logged %d lines that the forged summary cannot hold, want one", i+1, n)
		}
	}
	if err := os.Remove(filepath.Join(mounts[0], clustercap.DirName, "forged.summary")); err != nil {
		t.Fatal(err)
	}

	// A daemon without a cluster capacity: files of no summary's tag.
	cfg := clusterConfig(run, mounts[0], 3)
	old := startDaemon(t, cfg)
	oldNode := dialNodes(t, []*daemon{old}, "untagged", 4)[0]
	ctx := context.Background()
	untagged := int(capBound / 4 / max(file, 1))
	var keys [][]byte
	for i := range untagged {
		key := fmt.Appendf(nil, "untagged-%06d", i)
		if res, err := oldNode.k.store(ctx, [][]byte{key}); err != nil || res.Keys[0].Outcome != client.OutcomeStored {
			t.Fatalf("the daemon without a cluster capacity: store of %s: %v, %v", key, res, err)
		}
		keys = append(keys, key)
	}
	for i, n := range nodes {
		if hits, err := n.lookup(ctx, keys); err != nil || hits != len(keys) {
			t.Fatalf("node-%d finds %d of the %d keys of the daemon without a cluster capacity: %v", i+1, hits, len(keys), err)
		}
	}
	// The files came on top of the nodes' (no node could refuse them):
	// once the nodes count them they evict their own to make room.
	testwait.Until(t, "the mount back within the bound beside the untagged files", 20*time.Second, func() bool {
		total, _ := mountFiles(mounts[0])
		return total <= capBound+file
	})
	stop = sampleMount(mounts[0])
	last, lastRefused := paced(t, nodes, "beside", agreeAfter)
	peak, _ = stop()
	t.Logf("beside %d untagged files, %v: acknowledged %v, refused %v, peak %d bytes", untagged, agreeAfter, last, lastRefused, peak)
	if peak > capBound+file {
		t.Errorf("beside the untagged files the files on the mount peaked at %d bytes, over the bound of %d by more than one file", peak, capBound)
	}
	warned = 0
	for _, d := range ds {
		warned += logLines(d, "files without an owner tag")
	}
	if warned == 0 {
		t.Error("no daemon warned of the files without an owner tag")
	}
}
