package reliability

// The multi-node suite: three daemons, each on its own client mount of one
// distributed file system (KVHOST_CLUSTER_MOUNTS=a:b:c; `make test-cluster`
// starts a one-host CephFS with scripts/cephfs.sh and mounts it three
// times). Without the variable every test here skips, so `go test
// ./reliability` stays fast. docs/cluster.md has the figures of the last run.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/fstype"
	"github.com/kvhost/kvhost/internal/testsock"
)

// clusterEnv names the variable that lists the cluster's client mounts.
const clusterEnv = "KVHOST_CLUSTER_MOUNTS"

// clusterWait bounds the waits of the multi-node suite for a condition
// that must come (a hit on another node, a restart): a failure, never a
// measurement.
const clusterWait = 60 * time.Second

// clusterMounts returns the client mounts of KVHOST_CLUSTER_MOUNTS (two
// at least; `make test-cluster` gives three, `make test` two), each with a
// fresh directory for this test (made through the first mount, so that
// the others see one directory): the daemons' mount paths, one per node.
func clusterMounts(t testing.TB) []string {
	t.Helper()
	v := os.Getenv(clusterEnv)
	if v == "" {
		t.Skipf("the multi-node suite needs %s=a:b:c, client mounts of one shared file system (make test-cluster)", clusterEnv)
	}
	mounts := strings.Split(v, ":")
	if len(mounts) < 2 {
		t.Fatalf("%s=%q: the suite needs 2 mounts at least, got %d", clusterEnv, v, len(mounts))
	}
	sub := fmt.Sprintf("kvhost-%s-%d", strings.ReplaceAll(t.Name(), "/", "-"), time.Now().UnixNano())
	if err := os.Mkdir(filepath.Join(mounts[0], sub), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(filepath.Join(mounts[0], sub)) })
	out := make([]string, len(mounts))
	for i := range out {
		out[i] = filepath.Join(mounts[i], sub)
		if _, err := os.Stat(out[i]); err != nil {
			t.Fatalf("the directory made through %s is not seen through %s: %v", mounts[0], mounts[i], err)
		}
	}
	return out
}

// clusterConfig is node i's daemon on mount: its own node id and socket,
// one key per file (so that each key is found on another node under its
// own name), the shared scenarios' verify interval, no eviction.
func clusterConfig(run, mount string, i int) daemonConfig {
	node := fmt.Sprintf("node-%d", i+1)
	return daemonConfig{
		Socket:         filepath.Join(run, node, "kvhost.sock"),
		Mount:          mount,
		Capacity:       "4GiB",
		KeysPerFile:    1,
		VerifyInterval: sharedVerify,
		TempGrace:      10 * time.Minute,
		Node:           node,
	}
}

// startCluster starts one daemon per mount.
func startCluster(t *testing.T, mounts []string) []*daemon {
	t.Helper()
	run := testsock.Dir(t)
	ds := make([]*daemon, len(mounts))
	for i, m := range mounts {
		ds[i] = startDaemon(t, clusterConfig(run, m, i))
	}
	return ds
}

// clusterNode is a connection with a registered cache to one daemon.
type clusterNode struct {
	c *client.Client
	k *kvCache
}

// dialNodes connects to every daemon; the connections close at the end of
// the test.
func dialNodes(t *testing.T, ds []*daemon, name string, slots int) []clusterNode {
	t.Helper()
	ns := make([]clusterNode, len(ds))
	for i, d := range ds {
		c, k, err := dialCache(context.Background(), d.cfg.Socket, fmt.Sprintf("%s-%d", name, i), slots)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close(); k.close() })
		ns[i] = clusterNode{c, k}
	}
	return ns
}

func (n clusterNode) lookup(ctx context.Context, keys [][]byte) (int, error) {
	return n.c.Lookup(ctx, n.k.ns.ID, keys)
}

// checkLoad loads key on node n (node-who in messages): a load with other
// bytes counts in *wrong, one that does not load in *missing, explained
// by context.
func (n clusterNode) checkLoad(t *testing.T, who int, key []byte, wrong, missing *int, context string) {
	t.Helper()
	r, err := n.k.load(t.Context(), [][]byte{key})
	if err != nil {
		t.Fatal(err)
	}
	switch {
	case r.match[0]:
	case r.outcomes[0] == client.OutcomeLoaded:
		*wrong++
		t.Errorf("node-%d: %s loaded with other bytes", who, key)
	default:
		*missing++
		t.Errorf("node-%d: load of %s (%s): %v (%s)", who, key, context, r.outcomes[0], r.message)
	}
}

// percentile returns the p-th percentile (0 < p ≤ 100) of ds, sorted in
// place; nearest rank.
func percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	slices.Sort(ds)
	i := int(float64(len(ds))*p/100+0.5) - 1
	return ds[max(0, min(i, len(ds)-1))]
}

// TestClusterKeyStoredOnOneNodeHitsAndLoadsOnTheOthers stores keys one at a
// time, each on the next node in turn, and at once looks each up on the
// node after it: the lookup is a hit (polled until it is, counting the
// first lookups that missed), and a load there and on every other node
// returns the key's bytes. It logs the first lookup's latency (p50/p99),
// against a second lookup of the same key, now indexed.
func TestClusterKeyStoredOnOneNodeHitsAndLoadsOnTheOthers(t *testing.T) {
	mounts := clusterMounts(t)
	ds := startCluster(t, mounts)
	nodes := dialNodes(t, ds, "hit", 4)
	ctx := context.Background()
	const keys = 100
	var first, again, ackToHit []time.Duration
	var firstMisses, wrong, unloaded int
	nn := len(nodes)
	for i := range keys {
		key := fmt.Appendf(nil, "hit-%04d", i)
		src, dst := nodes[i%nn], nodes[(i+1)%nn]
		res, err := src.k.store(ctx, [][]byte{key})
		if err != nil {
			t.Fatal(err)
		}
		if o := res.Keys[0].Outcome; o != client.OutcomeStored {
			t.Fatalf("node-%d: store of %s: %v (%s)", i%nn+1, key, o, res.Message)
		}
		acked := time.Now()
		sent := time.Now()
		n, err := dst.lookup(ctx, [][]byte{key})
		if err != nil {
			t.Fatal(err)
		}
		if n == 1 {
			first = append(first, time.Since(sent))
		} else {
			firstMisses++
			if !waitFor(ctx, clusterWait, 5*time.Millisecond, func() bool {
				n, err := dst.lookup(ctx, [][]byte{key})
				return err == nil && n == 1
			}) {
				t.Fatalf("node-%d: %s, stored on node-%d, is no hit after %v", (i+1)%nn+1, key, i%nn+1, clusterWait)
			}
		}
		ackToHit = append(ackToHit, time.Since(acked))
		sent = time.Now()
		if n, err := dst.lookup(ctx, [][]byte{key}); err != nil || n != 1 {
			t.Fatalf("node-%d: second lookup of %s: %d, %v", (i+1)%nn+1, key, n, err)
		}
		again = append(again, time.Since(sent))
		for j := 1; j < nn; j++ {
			x := (i + j) % nn
			nodes[x].checkLoad(t, x+1, key, &wrong, &unloaded, fmt.Sprintf("stored on node-%d", i%nn+1))
		}
	}
	summary := fmt.Sprintf("cluster cross-node hit: nodes=%d keys=%d loads=%d first_lookup_misses=%d wrong_bytes=%d unloaded=%d first_hit_p50=%v p99=%v ack_to_hit_p50=%v p99=%v indexed_hit_p50=%v p99=%v",
		nn, keys, keys*(nn-1), firstMisses, wrong, unloaded,
		percentile(first, 50).Round(time.Microsecond), percentile(first, 99).Round(time.Microsecond),
		percentile(ackToHit, 50).Round(time.Microsecond), percentile(ackToHit, 99).Round(time.Microsecond),
		percentile(again, 50).Round(time.Microsecond), percentile(again, 99).Round(time.Microsecond))
	t.Log(summary)
	fmt.Println(summary)
}

// TestClusterPinnedKeyLoadsAfterItsNodeDeletesTheFile: node 1 stores
// keys; node 2's client pins them (node 2 finds node 1's files); node 1's
// client then deletes them, which node 1 may do (node 2's pins are not
// its own), and the files are gone from the mount. Node 2's load of the
// pinned keys still returns their bytes: its pin held each file open, and
// the file system keeps a file removed through one client readable
// through a descriptor another holds. After the unpin the keys miss on
// node 2 too, once its verify interval has passed.
func TestClusterPinnedKeyLoadsAfterItsNodeDeletesTheFile(t *testing.T) {
	mounts := clusterMounts(t)
	ds := startCluster(t, mounts)
	nodes := dialNodes(t, ds, "pinned", 8)
	ctx := context.Background()
	var keys [][]byte
	for i := range 8 {
		keys = append(keys, fmt.Appendf(nil, "pinned-%d", i))
	}
	mustStore(t, nodes[0].k, "node-1", keys)
	pin, err := nodes[1].c.Pin(ctx, nodes[1].k.ns.ID, keys, 0)
	if err != nil {
		t.Fatal(err)
	}
	for i, h := range pin.Held {
		if !h {
			t.Fatalf("node-2: %s, stored on node-1, is not pinned", keys[i])
		}
	}
	if n, err := nodes[0].c.Delete(ctx, nodes[0].k.ns.ID, keys); err != nil || n != len(keys) {
		t.Fatalf("node-1: delete: %d of %d, %v", n, len(keys), err)
	}
	if left := scanFiles(mounts[0]); len(left) != 0 {
		t.Fatalf("files left on the mount after node-1's delete: %v", left)
	}
	var wrong, missing int
	for _, k := range keys {
		nodes[1].checkLoad(t, 2, k, &wrong, &missing, "pinned on node-2, deleted by node-1")
	}
	if _, err := nodes[1].c.Unpin(ctx, pin.ID); err != nil {
		t.Fatal(err)
	}
	// A hit stays one for up to the verify interval.
	if !waitFor(ctx, clusterWait, 5*time.Millisecond, func() bool {
		n, err := nodes[1].lookup(ctx, keys)
		return err == nil && n == 0
	}) {
		t.Fatalf("node-2: the deleted keys still hit %v after the unpin", clusterWait)
	}
	summary := fmt.Sprintf("cluster pinned then deleted: keys=%d wrong_bytes=%d unloaded=%d", len(keys), wrong, missing)
	t.Log(summary)
	fmt.Println(summary)
}

// TestClusterConcurrentStoresOfOneKeyLoadOnEveryNode stores one key from all
// three nodes at once, round after round, then loads it on every node:
// every store is `stored` or `present`, and every load returns the key's
// bytes (0 wrong bytes, 0 acknowledged stores that do not load).
func TestClusterConcurrentStoresOfOneKeyLoadOnEveryNode(t *testing.T) {
	mounts := clusterMounts(t)
	ds := startCluster(t, mounts)
	nodes := dialNodes(t, ds, "same", 4)
	ctx := context.Background()
	rounds := 40
	if long() {
		rounds = 400
	}
	var stored, present, failed, loads, wrong, lost int
	for r := range rounds {
		key := fmt.Appendf(nil, "same-%04d", r)
		outcomes := make([]client.Outcome, len(nodes))
		msgs := make([]string, len(nodes))
		errs := make([]error, len(nodes))
		var start, wg sync.WaitGroup
		start.Add(1)
		for i, n := range nodes {
			wg.Add(1)
			go func() {
				defer wg.Done()
				start.Wait()
				res, err := n.k.store(ctx, [][]byte{key})
				if errs[i] = err; err == nil {
					outcomes[i], msgs[i] = res.Keys[0].Outcome, res.Message
				}
			}()
		}
		start.Done()
		wg.Wait()
		for i, o := range outcomes {
			switch {
			case errs[i] != nil:
				t.Fatalf("node-%d: store of %s: %v", i+1, key, errs[i])
			case o == client.OutcomeStored:
				stored++
			case o == client.OutcomePresent:
				present++
			default:
				failed++
				t.Errorf("node-%d: store of %s: %v (%s)", i+1, key, o, msgs[i])
			}
		}
		for i, n := range nodes {
			loads++
			n.checkLoad(t, i+1, key, &wrong, &lost, "after three acknowledged stores")
		}
	}
	if tmp := tempFiles(mounts[0]); len(tmp) > 0 {
		t.Errorf("temporary files left with no store in flight: %v", tmp)
	}
	summary := fmt.Sprintf("cluster same key: rounds=%d stores=%d stored=%d present=%d failed=%d loads=%d wrong_bytes=%d lost=%d files=%d",
		rounds, 3*rounds, stored, present, failed, loads, wrong, lost, len(scanFiles(mounts[0])))
	t.Log(summary)
	fmt.Println(summary)
}

// TestClusterDeleteOnOneNodeRacingStoreOnAnother deletes a key on node 1
// while node 2 stores it, round after round, beside keys the last node
// stored before. The delete starts after a random delay of up to twice the last
// store's duration, so that it lands before, during and after the store. Either order is right, but afterwards every node agrees with the
// disk: a key on disk loads with its bytes on every node, a key gone is a
// miss everywhere within the verify interval; the last node's keys all still load
// (0 deleted by another key's delete); no temporary file is left.
func TestClusterDeleteOnOneNodeRacingStoreOnAnother(t *testing.T) {
	mounts := clusterMounts(t)
	rng := rand.New(rand.NewPCG(seed(t), 4))
	ds := startCluster(t, mounts)
	nodes := dialNodes(t, ds, "race", 16)
	ctx := context.Background()
	rounds := 40
	if long() {
		rounds = 400
	}
	var bystanders [][]byte
	for i := range 8 {
		bystanders = append(bystanders, fmt.Appendf(nil, "bystander-%d", i))
	}
	last := len(nodes) - 1
	mustStore(t, nodes[last].k, fmt.Sprintf("node-%d", last+1), bystanders)
	var kept, gone, wrong, disagree, stale int
	stores, loads := len(bystanders), 0
	storeTook := 10 * time.Millisecond
	for r := range rounds {
		key := fmt.Appendf(nil, "race-%04d", r)
		// node 1 must know the key for its delete to race: store it there
		// first half of the time, else let node 1 find node 2's file.
		if r%2 == 0 {
			mustStore(t, nodes[0].k, "node-1", [][]byte{key})
			stores++
		}
		var wg sync.WaitGroup
		var storeErr, delErr error
		var outcome client.Outcome
		wg.Add(2)
		jitter := time.Duration(rng.Int64N(int64(2 * storeTook)))
		go func() {
			defer wg.Done()
			start := time.Now()
			res, err := nodes[1].k.store(ctx, [][]byte{key})
			if storeErr = err; err == nil {
				outcome = res.Keys[0].Outcome
			}
			storeTook = max(time.Since(start), time.Millisecond)
		}()
		go func() {
			defer wg.Done()
			<-time.After(jitter)
			if r%2 == 1 {
				nodes[0].lookup(ctx, [][]byte{key})
			}
			_, delErr = nodes[0].c.Delete(ctx, nodes[0].k.ns.ID, [][]byte{key})
		}()
		wg.Wait()
		if storeErr != nil || delErr != nil {
			t.Fatalf("round %d: store %v, delete %v", r, storeErr, delErr)
		}
		if outcome != client.OutcomeStored && outcome != client.OutcomePresent {
			t.Fatalf("round %d: node-2's store of %s: %v", r, key, outcome)
		}
		stores++
		onDisk := len(scanFiles(mounts[0])[string(key)]) > 0
		if onDisk {
			kept++
			for i, n := range nodes {
				loads++
				n.checkLoad(t, i+1, key, &wrong, &disagree, "on disk")
			}
			continue
		}
		gone++
		seen := time.Now() // the scan saw the file gone
		for i, n := range nodes {
			missed, late := awaitMiss(ctx, seen, func() (int, error) { return n.lookup(ctx, [][]byte{key}) })
			switch {
			case late > 0:
				stale++
				t.Errorf("node-%d: %s is gone from disk, its lookup sent %v later still hits (verify_interval %v, slack %v)", i+1, key, late.Round(time.Millisecond), sharedVerify, sharedSlack)
			case !missed:
				stale++
				t.Errorf("node-%d: %s is gone from disk, its lookup neither missed nor answered within %v", i+1, key, clusterWait)
			}
			res, err := n.k.load(ctx, [][]byte{key})
			if err != nil {
				t.Fatal(err)
			}
			loads++
			if res.outcomes[0] == client.OutcomeLoaded {
				wrong++
				t.Errorf("node-%d: %s is gone from disk, yet it loaded", i+1, key)
			}
		}
	}
	var foreign int
	for i, n := range nodes {
		res, err := n.k.load(ctx, bystanders)
		if err != nil {
			t.Fatal(err)
		}
		loads += len(bystanders)
		for j, ok := range res.match {
			if !ok {
				foreign++
				t.Errorf("node-%d: node-%d's %s after the races: %v (%s)", i+1, last+1, bystanders[j], res.outcomes[j], res.message)
			}
		}
	}
	if tmp := tempFiles(mounts[0]); len(tmp) > 0 {
		t.Errorf("temporary files left with no store in flight: %v", tmp)
	}
	summary := fmt.Sprintf("cluster delete vs store: rounds=%d stores=%d loads=%d kept=%d deleted=%d wrong_bytes=%d disagree=%d stale_hits=%d foreign_deleted=%d",
		rounds, stores, loads, kept, gone, wrong, disagree, stale, foreign)
	t.Log(summary)
	fmt.Println(summary)
}

// TestClusterSIGKILLOfOneNodeLosesNoAcknowledgedKey stores fresh keys from
// two clients on every node while the last node's daemon (the victim) is
// SIGKILLed at random moments and restarted, the other nodes storing on
// all the while. Every key any node acknowledged, the victim's included,
// loads byte for byte on every node at the end; no store on a surviving
// node fails (the victim's restart, which cleans temporary files, removes
// none of theirs in flight); the victim's temporary files that the kill
// left are gone once it has restarted (its own node, a dead pid: removed
// at its start, engine.md), and when the stores stop no temporary file is
// left on the shared directory.
func TestClusterSIGKILLOfOneNodeLosesNoAcknowledgedKey(t *testing.T) {
	mounts := clusterMounts(t)
	rng := rand.New(rand.NewPCG(seed(t), 3))
	run := testsock.Dir(t)
	n := len(mounts)
	victim := n - 1
	cfgs := make([]daemonConfig, n)
	ds := make([]*daemon, n)
	for i := range cfgs {
		cfgs[i] = clusterConfig(run, mounts[i], i)
		ds[i] = startDaemon(t, cfgs[i])
	}
	kills, perNode, perJob := 3, 2, 8
	if long() {
		kills = 20
	}
	var counts, survivors tortureCounts
	var orphaned, orphansLeft int
	acks := &ackSet{}
	seqs := make([]int, n*perNode)
	ctx := context.Background()
	// Temporary names carry the node id with '-' turned into '_'.
	victimTemp := fmt.Sprintf(".tmp-%s-", strings.ReplaceAll(cfgs[victim].Node, "-", "_"))
	// progress waits until perJob·want more keys than now are acknowledged.
	progress := func(want int) bool {
		before := len(acks.snapshot())
		return waitFor(ctx, clusterWait, 10*time.Millisecond, func() bool { return len(acks.snapshot()) >= before+want*perJob })
	}
	for counts.kills < kills {
		var wg sync.WaitGroup
		stop := make(chan struct{})
		for node := range n {
			c := &survivors
			if node == victim {
				c = &counts
			}
			for j := range perNode {
				i := node*perNode + j
				wg.Add(1)
				go func() {
					defer wg.Done()
					clusterStorer(ctx, ds[node].cfg.Socket, i, &seqs[i], perJob, stop, acks, c)
				}()
			}
		}
		// Kill once a few jobs have been acknowledged and a random time
		// more has passed; the others go on storing through the victim's
		// restart.
		if !progress(n * perNode) {
			close(stop)
			wg.Wait()
			t.Fatalf("fewer than %d keys acknowledged in %v after %d kills", n*perNode*perJob, clusterWait, counts.kills)
		}
		<-time.After(time.Duration(rng.Int64N(int64(300 * time.Millisecond))))
		ds[victim].kill()
		counts.kills++
		var left []string
		for _, p := range tempFiles(mounts[0]) {
			if strings.HasPrefix(filepath.Base(p), victimTemp) {
				left = append(left, p)
			}
		}
		orphaned += len(left)
		progress(1)
		d, err := tryStartDaemon(t, cfgs[victim])
		if err != nil {
			close(stop)
			wg.Wait()
			t.Fatalf("restart of node-%d after kill %d: %v", victim+1, counts.kills, err)
		}
		ds[victim] = d
		for _, p := range left {
			if _, err := os.Lstat(p); err == nil {
				orphansLeft++
				acks.report("after kill %d: node-%d's temporary file %s outlived its restart", counts.kills, victim+1, p)
			}
		}
		progress(1)
		close(stop)
		wg.Wait()
		if tmp := tempFiles(mounts[0]); len(tmp) > 0 {
			counts.leftovers += len(tmp)
			acks.report("after kill %d, node-%d's restart and the stores' end: temporary files left: %v", counts.kills, victim+1, tmp)
		}
	}
	for x := range n {
		if err := verifyAcked(ctx, cfgs[x].Socket, 2, acks, &counts); err != nil {
			t.Fatalf("verifying on node-%d: %v", x+1, err)
		}
	}
	counts.acked = len(acks.snapshot())
	summary := fmt.Sprintf("cluster SIGKILL: nodes=%d %s survivor_failed_stores=%d victim_temp_after_kill=%d victim_temp_after_restart=%d",
		n, counts.String(), survivors.unacked.Load(), orphaned, orphansLeft)
	t.Log(summary)
	fmt.Println(summary)
	if counts.wrong.Load() > 0 || counts.lost.Load() > 0 || counts.failed.Load() > 0 || counts.leftovers > 0 || survivors.unacked.Load() > 0 || orphansLeft > 0 {
		t.Fatalf("%s\nexamples:\n%v", summary, acks.bad)
	}
	if counts.verified.Load() < int64(n*counts.acked) {
		t.Fatalf("only %d verified loads of %d acknowledged keys on %d nodes", counts.verified.Load(), counts.acked, n)
	}
}

// clusterStorer stores jobs of fresh keys (client i, numbered from *seq)
// on the daemon at socket until stop is closed or the connection is lost
// (its daemon killed), adding every acknowledged key to acks.
func clusterStorer(ctx context.Context, socket string, i int, seq *int, perJob int, stop <-chan struct{}, acks *ackSet, counts *tortureCounts) {
	c, k, err := dialCache(ctx, socket, fmt.Sprintf("storer-%d", i), 2*perJob)
	if err != nil {
		return
	}
	defer k.close()
	defer c.Close()
	for {
		select {
		case <-stop:
			return
		default:
		}
		if !storeFresh(ctx, k, fmt.Sprintf("c%d", i), seq, perJob, acks, counts) {
			return
		}
	}
}

// TestClusterSharedInodeReuse runs the reliability suite's inode-reuse and
// stale-attribute scenario (inodeReuse, shared_test.go) with one daemon
// per client mount: a file replaced through one client while another
// client has it indexed, open and cached.
func TestClusterSharedInodeReuse(t *testing.T) {
	inodeReuse(t, clusterMounts(t))
}

// TestClusterSharedMixedWorkload runs the reliability suite's mixed
// workload (mixedWorkload, shared_test.go) with one daemon per client
// mount: random stores, replacements, deletes, lookups and loads on every
// node, checked against the files on disk.
func TestClusterSharedMixedWorkload(t *testing.T) {
	duration := 8 * time.Second
	if long() {
		duration = 3 * time.Minute
	}
	mixedWorkload(t, clusterMounts(t), duration)
}

// TestClusterFlockSharingMatchesTheFUSETable takes an exclusive flock on a
// file through the first client mount and tries one through each other
// client: whether it is refused (the lock is shared between clients, as
// between nodes) must be what package fstype's table says of the file
// system, which `kvhost check` reports. Once the first lock is released,
// the others' lock is granted.
func TestClusterFlockSharingMatchesTheFUSETable(t *testing.T) {
	mounts := clusterMounts(t)
	mnt, err := fstype.MountOf(mounts[0])
	if err != nil {
		t.Fatal(err)
	}
	kind, known := fstype.FUSEOf(mnt.Subtype())
	name := filepath.Join(mounts[0], "flock-probe")
	first, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	if err := unix.Flock(int(first.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		t.Fatalf("flock through %s: %v", mounts[0], err)
	}
	others := make([]*os.File, 0, len(mounts)-1)
	shared := 0
	for _, m := range mounts[1:] {
		f, err := os.OpenFile(filepath.Join(m, "flock-probe"), os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		others = append(others, f)
		switch err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); {
		case errors.Is(err, unix.EWOULDBLOCK):
			shared++
		case err != nil:
			t.Fatalf("flock through %s: %v", m, err)
		default:
			unix.Flock(int(f.Fd()), unix.LOCK_UN)
		}
	}
	t.Logf("%s (%s): a flock through one client refused through %d of %d others", mnt.Type, mnt.Point, shared, len(others))
	switch {
	case !known:
		t.Logf("package fstype does not know %q: nothing to compare", mnt.Subtype())
	case kind.SharedFlock && shared != len(others):
		t.Errorf("%s: the table says flock is shared between clients, but %d of %d other clients got the lock", kind.Name, len(others)-shared, len(others))
	case !kind.SharedFlock && shared > 0:
		t.Errorf("%s: the table says flock is not shared between clients, but %d of %d other clients were refused", kind.Name, shared, len(others))
	}
	if shared == 0 {
		return
	}
	if err := unix.Flock(int(first.Fd()), unix.LOCK_UN); err != nil {
		t.Fatal(err)
	}
	f := others[0]
	if !waitFor(t.Context(), clusterWait, 10*time.Millisecond, func() bool {
		return unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) == nil
	}) {
		t.Fatalf("the lock released through %s is still refused through %s after %v", mounts[0], mounts[1], clusterWait)
	}
}
