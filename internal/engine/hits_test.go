//go:build invariants

package engine

import (
	"context"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
)

// TestLookupHitsReachThePolicy: hits are reported off the lookup's path, but
// an eviction ranks with every hit reported before it, and Close reports
// what is pending.
func TestLookupHitsReachThePolicy(t *testing.T) {
	ctx := context.Background()
	var mu sync.Mutex
	now := time.Unix(1_700_000_000, 0)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); now = now.Add(time.Millisecond); return now }
	pol := newTestPolicy(1, abi.OrderLayerMajor)
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: pol, Now: clock})
	g := smallGeometry(true)
	ns, _ := e.Declare(ctx, g)
	c := newTestCache(t, e, ns, g, 64, layoutBlockFirst)
	r := rand.New(rand.NewPCG(3, 3))
	keys := testKeys("hit", 3)
	blocks := blockLists(r, 3, 4, 0)
	for _, b := range blocks {
		c.fill(r, b)
	}
	storeAndCheck(t, e, c, keys, blocks)
	// Key 0 is the oldest; a hit makes it the newest.
	if n, _ := e.Lookup(ctx, ns, keys[:1]); n != 1 {
		t.Fatal("lookup missed")
	}
	e.pol.hitRec.flush() // what an eviction does first
	v, err := pol.Victims(ctx, abi.EvictRequest{Mount: abi.AnyMount}, 1)
	if err != nil || len(v) != 1 {
		t.Fatalf("victims %v %v", v, err)
	}
	en := e.find(e.tables.get(ns), keys[0])
	if v[0].Entry == en.ID {
		t.Fatal("the looked-up key is still the least recently used: its hit did not reach the policy")
	}
	// A hit still pending at Close is reported by Close.
	id1 := e.find(e.tables.get(ns), keys[1]).ID
	pol.mu.Lock()
	stored := pol.entries[id1].Time
	pol.mu.Unlock()
	e.Lookup(ctx, ns, keys[1:2])
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	pol.mu.Lock()
	hit := pol.entries[id1].Time
	pol.mu.Unlock()
	if hit <= stored {
		t.Fatalf("key 1: policy time %d after Close, stored at %d: the pending hit was lost", hit, stored)
	}
	if e.pol.hitRec.pending != nil {
		t.Fatalf("%d hits still pending after Close", len(e.pol.hitRec.pending))
	}
}
