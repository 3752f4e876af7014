//go:build invariants

package engine

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/clustercap"
	"github.com/kvhost/kvhost/internal/testwait"
)

// TestClusterExactlyOneLiveNodeAdoptsADeadNode (issue 94, item 6): nodes
// A and B run beside node D (20 ms intervals, flocks shared: each probed
// D's lock while D ran). D stops three times, running again in between.
// Each time a node adopts D and, while D stays dead, never both: neither
// as the nodes hold it (their adoption locks) nor as their summaries
// publish it (Summary.Adopted), sampled every few milliseconds.
func TestClusterExactlyOneLiveNodeAdoptsADeadNode(t *testing.T) {
	dir := t.TempDir()
	mnt := []Mount{{Path: dir, ClusterCapacity: 1 << 30, ClusterInterval: 20 * time.Millisecond}}
	a := clusterNodeOf(t, Config{Mounts: mnt, NodeID: "a"})
	b := clusterNodeOf(t, Config{Mounts: mnt, NodeID: "b"})
	// summary is node's published summary (zero where none decodes).
	summary := func(node string) clustercap.Summary {
		raw, err := os.ReadFile(filepath.Join(dir, clustercap.DirName, node+".summary"))
		if err != nil {
			return clustercap.Summary{}
		}
		s, err := clustercap.Decode(raw)
		if err != nil {
			return clustercap.Summary{}
		}
		return *s
	}
	published := func(node string) bool { return slices.Contains(summary(node).Adopted, "d") }
	r := rand.New(rand.NewPCG(94, 6))
	for round := range 3 {
		d := clusterNodeOf(t, Config{Mounts: mnt, NodeID: "d"})
		storeKeys(t, d, fmt.Sprintf("d%d-", round), 2, r)
		testwait.Until(t, "A and B finding flocks shared with D while it runs", 30*time.Second, func() bool {
			return slices.Contains(a.e.mounts[0].cluster.Inspect().Shared, "d") && slices.Contains(b.e.mounts[0].cluster.Inspect().Shared, "d")
		})
		d.e.Close(context.Background())
		testwait.Until(t, "a node adopting D", 30*time.Second, func() bool {
			return isAdopted(a.e, "d") || isAdopted(b.e, "d")
		})
		// D stays dead: over ten publications of each node, its adopter
		// keeps it and the other never takes it too.
		for range 10 {
			seqA, seqB := summary("a").Seq, summary("b").Seq
			if isAdopted(a.e, "d") && isAdopted(b.e, "d") {
				t.Fatalf("round %d: A and B both hold the adoption of dead node D", round)
			}
			if published("a") && published("b") {
				t.Fatalf("round %d: A's and B's summaries both name dead node D adopted", round)
			}
			testwait.Until(t, "A and B publishing their next summaries", 30*time.Second, func() bool {
				return summary("a").Seq > seqA && summary("b").Seq > seqB
			})
		}
	}
}

// TestClusterANextAdopterDoesNotNameADeadNodeItsLastAdopterStillNames
// (issue 94, item 6): A adopts dead node D and stops (as a SIGKILL
// leaves it: its lock free, its last summary naming D adopted, fresh for
// three intervals). B takes D's adoption, counting D's files, but its
// summary names D adopted only once no other live summary does: never two
// summaries naming one dead node (on the code before, both did, as in
// the kill runs of issue 94).
func TestClusterANextAdopterDoesNotNameADeadNodeItsLastAdopterStillNames(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	clock := newTestClock()
	mnt := []Mount{{Path: dir, ClusterCapacity: 1 << 30, ClusterInterval: time.Hour}}
	a := clusterNodeOf(t, Config{Mounts: mnt, NodeID: "a", Now: clock.now})
	b := clusterNodeOf(t, Config{Mounts: mnt, NodeID: "b", Now: clock.now})
	d := clusterNodeOf(t, Config{Mounts: mnt, NodeID: "d", Now: clock.now})
	storeKeys(t, d, "d", 2, rand.New(rand.NewPCG(94, 7)))
	for _, n := range []*node{d, a, b} {
		n.e.mounts[0].cluster.Tick(ctx) // A and B probe D's lock: held, flocks shared
	}
	d.e.Close(ctx)
	clock.advance(4 * time.Hour) // D's summary: stale
	a.e.mounts[0].cluster.Tick(ctx)
	if !adoptedIn(t, dir, "a") {
		t.Fatal("A's summary does not name dead node D adopted")
	}
	a.e.Close(ctx) // its last summary stays, fresh, naming D
	bm := b.e.mounts[0]
	bm.cluster.Tick(ctx)
	if !isAdopted(b.e, "d") {
		t.Fatal("B did not take dead node D's adoption, which A let go of")
	}
	if adoptedIn(t, dir, "b") {
		t.Error("B's summary names dead node D adopted while A's last summary, fresh, still does: two adopters published")
	}
	clock.advance(4 * time.Hour) // A's summary: stale, A dead
	bm.cluster.Tick(ctx)
	if !adoptedIn(t, dir, "b") {
		t.Error("B's summary does not name D adopted once A's summary is stale")
	}
}

// adoptedIn reports whether node's summary on dir names node D adopted.
func adoptedIn(t *testing.T, dir, node string) bool {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(dir, clustercap.DirName, node+".summary"))
	if err != nil {
		t.Fatal(err)
	}
	s, err := clustercap.Decode(raw)
	if err != nil {
		t.Fatal(err)
	}
	return slices.Contains(s.Adopted, "d")
}
