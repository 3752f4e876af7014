//go:build invariants

package engine

import (
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/testwait"
)

// TestClusterCountsTheFilesAnotherWriterAddsWhileItRuns (issue 94, item
// 3): node A runs with a bound of 8 files and a 20 ms interval; then a
// daemon without a cluster capacity (as an old kvhost: its files' owner
// tags are no node's) starts on the same directory and stores back to
// back, A never looking its keys up. A's census finds its files: a
// warning names their bytes and the writer, "old", by its temporary
// files; once the writer stops, A counts every byte of its files against
// the bound, and A's own stores then keep the mount within the bound (or,
// where the old files take all of it, add nothing). On the code before, A
// counted none of them until its own restart.
func TestClusterCountsTheFilesAnotherWriterAddsWhileItRuns(t *testing.T) {
	file := oneFileBytes(t)
	capacity := 8 * file
	dir := t.TempDir()
	log, lines := lineLogger(t)
	a := clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: capacity, ClusterInterval: 20 * time.Millisecond}}, NodeID: "a", Logger: log})
	old := openNode(t, dir, "old", nil, 1)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		storeFor(old, "old-", 0, 0, 3, stop) // until A's warning names it: it names writers by files in flight
	}()
	named := func() bool { return lines.count("files without an owner tag", "writers=old") > 0 }
	testwait.Until(t, "a warning of the files without an owner tag naming the writer old", 30*time.Second, named)
	close(stop)
	wg.Wait()
	oldBytes := diskBytes(t, dir)
	m := a.e.mounts[0]
	testwait.Until(t, "A counting every byte of the old daemon's files", 30*time.Second, func() bool {
		return m.cluster.Inspect().Untagged == oldBytes
	})
	r := rand.New(rand.NewPCG(94, 4))
	for i := range 8 {
		storeOne(t, a, "a-", i, r)
		if got := diskBytes(t, dir); got > max(capacity, oldBytes) {
			t.Fatalf("after A's store %d: %d bytes of files on the mount, the old daemon's %d, over the bound of %d", i, got, oldBytes, capacity)
		}
	}
	if n := lines.count("files without an owner tag", "found_by=a"); n == 0 {
		t.Error("no warning of the files without an owner tag says A found them")
	}
	t.Logf("the old daemon's files: %d bytes, %.1f bounds", oldBytes, float64(oldBytes)/float64(capacity))
}
