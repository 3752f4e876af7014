//go:build invariants

package engine

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
)

// TestAStoreBurstLargerThanTheMountEvictsItsOwnEarlierFiles: one store
// of 24 keys into a mount of room for 4 of their files, with 8 files in
// flight at once (I/O workers), so that the room is held by stores not
// yet published when the 5th to 8th need it. Nothing is evictable then;
// once those stores publish, their files are. Every key is stored (the
// earlier ones evicted for the later), none refused for room: the H200
// lost 25 of 32 keys so at 16 workers.
func TestAStoreBurstLargerThanTheMountEvictsItsOwnEarlierFiles(t *testing.T) {
	g := smallGeometry(true)
	fileLen := 4096 + g.KeyBytes()
	pol := newTestPolicy(1, abi.OrderLayerMajor)
	e := openEngine(t, Config{IOWorkers: 8, Mounts: []Mount{{Path: t.TempDir(), Capacity: 4 * fileLen, HighWatermark: 1, LowWatermark: 0.5}},
		NewPolicy: func(policy.Index) (policy.Policy, error) { return pol, nil }})
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	const n = 24
	c := newTestCache(t, e, ns, g, n*g.BlocksPerKey(), layoutPlaneFirst)
	r := rand.New(rand.NewPCG(24, 8))
	from := blockLists(r, n, g.BlocksPerKey(), 0)
	for _, b := range from {
		c.fill(r, b)
	}
	for round := range 5 {
		keys := testKeys(string(rune('a'+round)), n)
		res := wait(t)(e.Store(context.Background(), StoreRequest{Cache: c.id, Keys: keys, Blocks: from}))
		for i, k := range res.Keys {
			if k.Outcome != OutcomeStored {
				t.Fatalf("round %d, key %d: %v (%v), want stored: a burst lost keys for room its own stores held", round, i, k.Outcome, k.Err)
			}
		}
	}
}
