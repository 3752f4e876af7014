//go:build invariants

package cluster

import (
	"context"
	"maps"
	"slices"

	"github.com/kvhost/kvhost/internal/clustercap"
)

// View is a copy of a Mount's state, for tests.
type View struct {
	Own        int64           // this node's bytes as last counted, with reservations since
	Claim      int64           // its claim
	Shared     []string        // the nodes found with flocks shared (sorted)
	Probed     []string        // the running nodes whose locks it probes (sorted)
	LockShared []string        // what its summary publishes of Shared
	Unclaimed  int             // the dead nodes' summaries no live node counts yet
	Dead       map[uint32]bool // the adopted dead nodes' tags
	Untagged   int64           // the bytes of files no summary counts that this node found (index, census)
	Sketch     clustercap.Sketch
}

// Inspect returns a copy of c's state.
func (c *Mount) Inspect() View {
	c.mu.Lock()
	defer c.mu.Unlock()
	return View{Own: c.own, Claim: c.claim,
		Shared:     slices.Sorted(maps.Keys(c.shared)),
		Probed:     slices.Sorted(maps.Keys(c.probes)),
		LockShared: c.clusterFlocks.lockShared(),
		Unclaimed:  len(c.unclaimed),
		Dead:       maps.Clone(*c.dead.Load()),
		Untagged:   c.untagged,
		Sketch:     c.lastSketch()}
}

// Dir is c's cluster directory, for tests.
func (c *Mount) Dir() *clustercap.Dir { return c.dir }

// Tag is this node's owner tag.
func (c *Mount) Tag() uint32 { return c.tag }

// Read reads the other nodes' summaries as a Tick does, and nothing else:
// for tests.
func (c *Mount) Read(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.read(ctx)
}

// MarkShared records flocks found shared with node, as a read of its
// summary while it ran would have found: for tests.
func (c *Mount) MarkShared(node string) {
	c.mu.Lock()
	c.shared[node] = true
	c.mu.Unlock()
}

// Count takes stock of the mount as a Tick does, and nothing else: for
// benchmarks.
func (c *Mount) Count(ctx context.Context) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.count(ctx)
}

// ApplyPurges applies the purge records as a Tick does, and nothing else:
// for benchmarks.
func (c *Mount) ApplyPurges(ctx context.Context) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.applyPurges(ctx)
}
