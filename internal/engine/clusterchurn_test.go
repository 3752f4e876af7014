//go:build invariants

package engine

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/fsys/fsystest"
	"github.com/kvhost/kvhost/internal/clustercap"
)

// TestClusterForgetsThePairingsOfNodesRetired: nodes come and go on a
// shared mount, each under a name of its own (a pod's host name). Node A
// pairs with each (its probe finds the other's lock held), adopts it once
// dead and retires it, its summary and lock removed. A must not keep the
// pairing of a node no summary on the mount names any more: over a long
// uptime the set grew by one name per node ever seen, published in full
// in every summary A writes (lock_shared, up to clustercap.MaxAdopted
// names, and past that the live nodes' names cut off).
func TestClusterForgetsThePairingsOfNodesRetired(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	clock := newTestClock()
	a := clusterNodeAt(t, dir, "a", 1<<30, time.Hour, clock.now)
	m := a.e.mounts[0]
	const churn = 20
	for i := range churn {
		name := fmt.Sprintf("d%d", i)
		d := clusterNodeAt(t, dir, name, 1<<30, time.Hour, clock.now)
		dm := d.e.mounts[0]
		dm.cluster.Tick(ctx)
		m.cluster.Tick(ctx) // D runs: A's probe finds its lock held
		paired := slices.Contains(m.cluster.Inspect().Shared, name)
		if !paired {
			t.Fatalf("A did not pair with running node %s on a file system that shares flocks", name)
		}
		if err := d.e.Close(ctx); err != nil {
			t.Fatal(err)
		}
		tickPastDeadBound(ctx, a.e, clock) // D's lock free: adopted and, with no file, retired
		m.cluster.Tick(ctx)
		if left := clusterFiles(dir, name); len(left) > 0 {
			t.Fatalf("dead node %s with no file was not retired: %v left", name, left)
		}
	}
	v := m.cluster.Inspect()
	shared, shares := len(v.Shared), v.LockShared
	if shared != 0 || len(shares) != 0 {
		t.Fatalf("after %d nodes came, died and were retired, A keeps %d pairings and publishes %v; want none", churn, shared, shares)
	}
}

// TestClusterForgetsTheProbesOfNodesGone: on a mount whose flocks stay on
// each node, node A probes every running node's lock and never pairs.
// Nodes come and go under names of their own; once a node's summary has
// left the mount (another node retired it, or the operator removed it),
// A must not keep its probe: the map grew by one per node ever seen.
func TestClusterForgetsTheProbesOfNodesGone(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	mnt := []Mount{{Path: dir, ClusterCapacity: 1 << 30, ClusterInterval: time.Hour}}
	a := clusterNodeOf(t, Config{Mounts: mnt, NodeID: "a", FS: fsystest.NewLocalLocks(fsys.OS{})})
	m := a.e.mounts[0]
	const churn = 20
	for i := range churn {
		name := fmt.Sprintf("l%d", i)
		l := clusterNodeOf(t, Config{Mounts: mnt, NodeID: name, FS: fsystest.NewLocalLocks(fsys.OS{})})
		lm := l.e.mounts[0]
		lm.cluster.Tick(ctx)
		m.cluster.Tick(ctx) // L runs: A probes its lock (free)
		probed := slices.Contains(m.cluster.Inspect().Probed, name)
		if !probed {
			t.Fatalf("A did not probe running node %s", name)
		}
		if err := l.e.Close(ctx); err != nil {
			t.Fatal(err)
		}
		for _, f := range clusterFiles(dir, name) {
			if err := os.Remove(filepath.Join(dir, clustercap.DirName, f)); err != nil {
				t.Fatal(err)
			}
		}
		m.cluster.Tick(ctx)
	}
	probes := len(m.cluster.Inspect().Probed)
	if probes != 0 {
		t.Fatalf("after %d nodes came and went, their summaries gone, A keeps %d probes; want none", churn, probes)
	}
}
