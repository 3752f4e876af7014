package reliability

// Issue 94's starved quiet nodes (docs/cluster.md, "Fair shares"), on
// the multi-node suite's shared file system (KVHOST_CLUSTER_MOUNTS; one
// local directory given three times runs it at local-disk rates, where
// the code before failed).

import (
	"testing"
	"time"
)

// fairFor is how long the nodes store in the fair-share scenario.
const fairFor = 10 * time.Second

// TestClusterQuietNodesAreNeverRefusedBesideABusyOne runs three daemons
// with a cluster capacity of capBound and a 200 ms interval on the three
// client mounts of one directory. Node 1 stores back to back for fairFor
// while nodes 2 and 3 store one key every agreePace: no store of the
// quiet nodes is refused (each holds less than its third of the bound,
// which the busy node leaves it), and the files on the mount never pass
// the bound by more than one file. On the code before (185434b), at
// local-disk rates, the quiet nodes' stores failed with "this node holds
// 0 bytes and may hold … of the cluster's …".
func TestClusterQuietNodesAreNeverRefusedBesideABusyOne(t *testing.T) {
	mounts := clusterMounts(t)
	nodes := dialNodes(t, capDaemons(t, mounts), "fair", 4)
	stopSampling := sampleMount(mounts[0])
	r := pacedEach(t, nodes, "fair", fairFor, func(n int) time.Duration {
		if n == 0 {
			return 0 // node 1 stores back to back
		}
		return agreePace
	})
	peak, file := stopSampling()
	t.Logf("%v: acknowledged %v, refused %v, peak %d bytes of a bound of %d (files of %d)", fairFor, r.acked, r.refused, peak, capBound, file)
	for n := range nodes {
		t.Logf("node-%d: a store took %v on average, %v at most", n+1, r.took[n]/time.Duration(max(r.acked[n]+r.refused[n], 1)), r.slowest[n])
	}
	for n := 1; n < len(nodes); n++ {
		if r.refused[n] > 0 {
			t.Errorf("quiet node-%d: %d of %d stores refused for room, want none (last: %s)", n+1, r.refused[n], r.acked[n]+r.refused[n], r.last[n])
		}
	}
	if peak > capBound+file {
		t.Errorf("the files on the mount peaked at %d bytes, over the bound of %d by more than one file (%d)", peak, capBound, file)
	}
}
