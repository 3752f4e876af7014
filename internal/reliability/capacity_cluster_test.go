package reliability

// Cluster-wide capacity on the multi-node suite's shared file system
// (KVHOST_CLUSTER_MOUNTS, as cluster_test.go): three daemons, one bound for
// the files of all of them together. docs/cluster.md has the figures of the
// last run.

import (
	"context"
	"encoding/hex"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/testsock"
)

// Cluster capacity scenario: node 1 stores capStores keys, nodes 2 and 3
// a tenth of that each, one key per file, all at once, against a bound of
// capBound bytes (a few dozen files: far below what the stores write).
const (
	capStores   = 400
	capBound    = 512 << 10
	capInterval = 200 * time.Millisecond
)

// capDaemons starts a daemon on each of mounts with a cluster capacity
// of capBound and an interval of capInterval.
func capDaemons(t *testing.T, mounts []string) []*daemon {
	t.Helper()
	run := testsock.Dir(t)
	ds := make([]*daemon, len(mounts))
	for i, m := range mounts {
		cfg := clusterConfig(run, m, i)
		cfg.ClusterCapacity = fmt.Sprint(capBound)
		cfg.ClusterInterval = capInterval
		ds[i] = startDaemon(t, cfg)
	}
	return ds
}

// capKey is node's i-th key; capOwner recovers the node from a file's
// name (the built-in policy names a file by its key in hex).
func capKey(node, i int) []byte { return fmt.Appendf(nil, "cap-n%d-%05d", node, i) }

// capOwner returns the node whose key names the data file path (0 if it
// is none of the scenario's).
func capOwner(path string) (int, []byte) {
	name, ok := strings.CutSuffix(filepath.Base(path), ".kv")
	if !ok {
		return 0, nil
	}
	key, err := hex.DecodeString(name)
	if err != nil {
		return 0, nil
	}
	var node, i int
	if _, err := fmt.Sscanf(string(key), "cap-n%d-%05d", &node, &i); err != nil {
		return 0, nil
	}
	return node, key
}

// mountFiles walks dir (the shared mount, through one client) and returns
// the bytes of every file but the cluster's metadata directory and the
// nodes' model books, and the data files by path.
func mountFiles(dir string) (int64, map[string]int64) {
	var total int64
	files := map[string]int64{}
	filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil // removed meanwhile
		}
		if d.IsDir() {
			if d.Name() == ".kvhost-cluster" {
				return fs.SkipDir
			}
			return nil
		}
		if strings.HasPrefix(d.Name(), ".models-") {
			return nil // a node's model book: metadata, outside the bound (as the mount's used bytes)
		}
		fi, err := d.Info()
		if err != nil {
			return nil
		}
		total += fi.Size() // temporaries of stores in flight count too
		if !strings.HasPrefix(d.Name(), ".") {
			files[path] = fi.Size()
		}
		return nil
	})
	return total, files
}

// TestClusterCapacityHoldsTheBoundUnderSkewedStores runs three daemons with
// cluster_capacity on the three client mounts of one directory. Node 1
// stores ten times the keys of nodes 2 and 3, all at once, through real
// clients, far past the bound. While they store, the files on the mount
// are summed (temporaries included) and must never pass the bound. Then
// every key still on the mount loads with its own bytes on the node that
// stored it and on the next one (0 wrong bytes, 0 missing), and for each
// node its keys gone from the mount are at most its own evictions: no
// node deleted another live node's file.
func TestClusterCapacityHoldsTheBoundUnderSkewedStores(t *testing.T) {
	mounts := clusterMounts(t)
	nodes := dialNodes(t, capDaemons(t, mounts), "cap", 4)
	ctx := context.Background()

	var peak atomic.Int64
	var samples atomic.Int64
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			total, _ := mountFiles(mounts[0])
			samples.Add(1)
			if total > peak.Load() {
				peak.Store(total)
			}
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()

	stores := []int{capStores, capStores / 10, capStores / 10}
	stored := make([][][]byte, len(nodes)) // acknowledged keys, by node
	refused := make([]int, len(nodes))
	var wg sync.WaitGroup
	errs := make(chan error, len(nodes))
	start := time.Now()
	for n := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range stores[n] {
				key := capKey(n+1, i)
				res, err := nodes[n].k.store(ctx, [][]byte{key})
				if err != nil {
					errs <- fmt.Errorf("node-%d: store of %s: %w", n+1, key, err)
					return
				}
				switch o := res.Keys[0].Outcome; o {
				case client.OutcomeStored:
					stored[n] = append(stored[n], key)
				case client.OutcomeFailed:
					if !strings.Contains(res.Message, "no space") {
						errs <- fmt.Errorf("node-%d: store of %s: %v (%s)", n+1, key, o, res.Message)
						return
					}
					refused[n]++ // its claim did not fit and nothing of its own was left to evict
				default:
					errs <- fmt.Errorf("node-%d: store of %s: %v (%s)", n+1, key, o, res.Message)
					return
				}
			}
		}()
	}
	wg.Wait()
	took := time.Since(start)
	close(stop)
	<-sampled
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}

	// What is left, who holds it, and whether it loads.
	total, files := mountFiles(mounts[0])
	present := make([]map[string]bool, len(nodes))
	for i := range present {
		present[i] = map[string]bool{}
	}
	for path := range files {
		if n, key := capOwner(path); n >= 1 && n <= len(nodes) {
			present[n-1][string(key)] = true
		}
	}
	paths := map[string]string{} // key → its file
	for path := range files {
		if _, key := capOwner(path); key != nil {
			paths[string(key)] = path
		}
	}
	// Every key on the mount loads with its bytes on its node and the
	// next, unless its file went meanwhile (an eviction the cut-off a node
	// published a moment ago still asks for).
	var wrong, missing, loaded, evictedMeanwhile int
	for n := range nodes {
		for key := range present[n] {
			for _, at := range []int{n, (n + 1) % len(nodes)} {
				r, err := nodes[at].k.load(ctx, [][]byte{[]byte(key)})
				if err != nil {
					t.Fatal(err)
				}
				_, statErr := os.Stat(paths[key])
				switch {
				case r.match[0]:
					loaded++
				case r.outcomes[0] == client.OutcomeLoaded:
					wrong++
					t.Errorf("node-%d: %s, stored on node-%d, loaded with other bytes", at+1, key, n+1)
				case statErr != nil:
					evictedMeanwhile++
				default:
					missing++
					t.Errorf("node-%d: %s, stored on node-%d, its file on the mount: %v (%s)", at+1, key, n+1, r.outcomes[0], r.message)
				}
			}
		}
	}
	var foreign int
	perNode := make([]string, len(nodes))
	for n := range nodes {
		st, err := nodes[n].c.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		gone := len(stored[n]) - len(present[n])
		if gone > int(st.Evictions) {
			foreign += gone - int(st.Evictions)
			t.Errorf("node-%d: %d of its %d stored keys are gone from the mount, but it evicted only %d: another node deleted its files",
				n+1, gone, len(stored[n]), st.Evictions)
		}
		perNode[n] = fmt.Sprintf("node-%d stored=%d refused=%d evictions=%d left=%d", n+1, len(stored[n]), refused[n], st.Evictions, len(present[n]))
	}
	fileSize := int64(0)
	for _, size := range files {
		fileSize = max(fileSize, size)
	}
	t.Logf("cluster capacity: bound=%d B (%d files of %d B) interval=%v stores=%d peak_total=%d B (%d samples) final_total=%d B %s loads_ok=%d evicted_before_load=%d wrong_bytes=%d missing=%d foreign_deleted=%d duration=%v",
		capBound, capBound/max(fileSize, 1), fileSize, capInterval, stores[0]+stores[1]+stores[2], peak.Load(), samples.Load(), total,
		strings.Join(perNode, " "), loaded, evictedMeanwhile, wrong, missing, foreign, took.Round(time.Millisecond))
	if p := peak.Load(); p > capBound {
		t.Errorf("the files on the mount reached %d bytes, over the cluster bound of %d", p, capBound)
	}
	if total > capBound {
		t.Errorf("the files on the mount hold %d bytes after the stores, over the cluster bound of %d", total, capBound)
	}
	if len(stored[0]) <= capBound/max(int(fileSize), 1) {
		t.Errorf("node-1 stored %d keys, no more than the bound holds: the scenario did not push past the bound", len(stored[0]))
	}
	for n := 1; n < len(nodes); n++ {
		if len(stored[n]) == 0 {
			t.Errorf("node-%d stored nothing", n+1)
		}
	}
}
