//go:build invariants

package engine

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
)

// TestLoadsFromADiskMountPassThroughItsReaders: a disk mount's loads
// take one of its readers each: with load_readers fixed the bound is
// that number, tuned (0) it starts at the I/O workers, a memory mount
// has none; and every key loads its bytes through them.
func TestLoadsFromADiskMountPassThroughItsReaders(t *testing.T) {
	for _, tc := range []struct {
		name    string
		readers int
		workers int
		want    int
	}{
		{"fixed at one", 1, 4, 1},
		{"fixed above the workers is the workers", 9, 4, 4},
		{"tuned starts at the workers", 0, 4, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			pol := newTestPolicy(1, abi.OrderLayerMajor)
			e := openEngine(t, Config{IOWorkers: tc.workers, Mounts: []Mount{{Path: diskDir(t), LoadReaders: tc.readers}},
				NewPolicy: func(policy.Index) (policy.Policy, error) { return pol, nil }})
			g := smallGeometry(true)
			ns, err := e.Declare(ctx, g)
			if err != nil {
				t.Fatal(err)
			}
			const n = 12
			c := newTestCache(t, e, ns, g, 2*n*g.BlocksPerKey(), layoutPlaneFirst)
			r := rand.New(rand.NewPCG(1, 2))
			keys := testKeys("r", n)
			from := blockLists(r, n, g.BlocksPerKey(), 0)
			want := make([][]byte, n)
			for i := range keys {
				c.fill(r, from[i])
				want[i] = c.data(from[i])
			}
			storeAndCheck(t, e, c, keys, from)
			loadAndCompare(t, e, c, keys, blockLists(r, n, g.BlocksPerKey(), n*g.BlocksPerKey()), want)
			st := e.Stats()
			if got := st.Mounts[0].LoadReaders; got != tc.want {
				t.Fatalf("the mount's load readers: %d, want %d", got, tc.want)
			}
			if g := e.mounts[0].readers.Stats(); g.Inflight != 0 {
				t.Fatalf("%d readers still taken after the load", g.Inflight)
			}
		})
	}
	t.Run("a memory mount has none", func(t *testing.T) {
		pol := newTestPolicy(1, abi.OrderLayerMajor)
		e := openEngine(t, Config{Mounts: []Mount{{Path: shmDir(t)}}, NewPolicy: func(policy.Index) (policy.Policy, error) { return pol, nil }})
		if e.mounts[0].readers != nil || e.Stats().Mounts[0].LoadReaders != 0 {
			t.Fatal("a memory mount's loads are bounded by readers")
		}
	})
}
