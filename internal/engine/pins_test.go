//go:build invariants

package engine

import (
	"context"
	"fmt"
	"github.com/kvhost/kvhost/internal/testwait"
	"math/rand/v2"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/plugins/lru"
)

// pinFixture: a mount of 8 files, a hostile policy (it offers pinned
// entries as victims first, so only the engine's pin check saves them),
// and 20 keys whose blocks are filled.
type pinFixture struct {
	e      *Engine
	ns     NamespaceID
	c      *testCache
	keys   [][]byte
	blocks [][]int
	paths  []string
}

func newPinFixture(t *testing.T, cfg Config) *pinFixture {
	t.Helper()
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := 4096 + g.KeyBytes()
	pol := newTestPolicy(1, abi.OrderLayerMajor)
	pol.hostile = true
	cfg.Mounts = []Mount{{Path: t.TempDir(), Capacity: 8 * fileLen, HighWatermark: 0.75, LowWatermark: 0.5}}
	cfg.Policy = pol
	e := openEngine(t, cfg)
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	f := &pinFixture{e: e, ns: ns, c: newTestCache(t, e, ns, g, 128, layoutPlaneFirst), keys: testKeys("pin", 20)}
	r := rand.New(rand.NewPCG(3, 4))
	f.blocks = blockLists(r, 20, 4, 0)
	for _, b := range f.blocks {
		f.c.fill(r, b)
	}
	_, f.paths, _, _ = e.nm.names(ctx, e.tables.get(ns), f.keys)
	return f
}

func (f *pinFixture) pin(t *testing.T, keys [][]byte, lease time.Duration) (PinID, []bool) {
	t.Helper()
	id, held, err := f.e.Pin(context.Background(), f.ns, keys, lease)
	if err != nil {
		t.Fatal(err)
	}
	return id, held
}

func (f *pinFixture) fillMount(t *testing.T, from int) {
	t.Helper()
	for i := from; i < len(f.keys); i++ {
		storeAndCheck(t, f.e, f.c, f.keys[i:i+1], f.blocks[i:i+1])
	}
	if f.e.Stats().Evictions == 0 {
		t.Fatal("filling the mount evicted nothing: the test proves nothing")
	}
}

func exists(path string) bool { _, err := os.Stat(path); return err == nil }

func TestPinAnswersPerKeyAndProtectsFromEviction(t *testing.T) {
	f := newPinFixture(t, Config{})
	storeAndCheck(t, f.e, f.c, f.keys[:1], f.blocks[:1])
	want := f.c.data(f.blocks[0])
	id, held := f.pin(t, [][]byte{f.keys[0], []byte("never-stored"), f.keys[0]}, 0)
	if id == 0 || !slices.Equal(held, []bool{true, false, true}) {
		t.Fatalf("Pin = %d, %v; want an id and [true false true]", id, held)
	}
	f.fillMount(t, 1)
	if !exists(f.paths[0]) {
		t.Fatal("the pinned key's file was evicted")
	}
	loadAndCompare(t, f.e, f.c, f.keys[:1], [][]int{{100, 101, 102, 103}}, [][]byte{want})

	if n := f.e.Unpin(context.Background(), id); n != 2 {
		t.Fatalf("Unpin = %d keys, want 2 (both requests of the key)", n)
	}
	if n := f.e.Unpin(context.Background(), id); n != 0 {
		t.Fatalf("second Unpin = %d, want 0", n)
	}
	// Unpinned, it is the hostile policy's first victim again.
	if _, err := f.e.Delete(context.Background(), f.ns, f.keys[1:]); err != nil {
		t.Fatal(err)
	}
	f.fillMount(t, 1)
	if exists(f.paths[0]) {
		t.Fatal("the unpinned key survived eviction pressure under a policy that offers it first")
	}
}

func TestPinLeaseEnds(t *testing.T) {
	f := newPinFixture(t, Config{})
	storeAndCheck(t, f.e, f.c, f.keys[:1], f.blocks[:1])
	id, held := f.pin(t, f.keys[:1], 30*time.Millisecond)
	if id == 0 || !held[0] {
		t.Fatalf("Pin = %d, %v", id, held)
	}
	testwait.Until(t, "the lease to end", testwait.Hang, func() bool { pins, _ := f.e.PinStats(); return pins == 0 })
	if n := f.e.Unpin(context.Background(), id); n != 0 {
		t.Fatalf("Unpin after the lease = %d, want 0", n)
	}
	f.fillMount(t, 1)
	if exists(f.paths[0]) {
		t.Fatal("the key whose lease ended was not evicted")
	}
}

func TestDeleteRefusesPinnedKeys(t *testing.T) {
	ctx := context.Background()
	f := newPinFixture(t, Config{})
	storeAndCheck(t, f.e, f.c, f.keys[:2], f.blocks[:2])
	id, _ := f.pin(t, f.keys[:1], 0)
	n, err := f.e.Delete(ctx, f.ns, f.keys[:2])
	if err != nil || n != 1 {
		t.Fatalf("Delete = %d, %v; want 1 (the unpinned key only)", n, err)
	}
	if !exists(f.paths[0]) || exists(f.paths[1]) {
		t.Fatalf("after Delete: pinned file exists %v, unpinned file exists %v", exists(f.paths[0]), exists(f.paths[1]))
	}
	if got, _ := f.e.Lookup(ctx, f.ns, f.keys[:1]); got != 1 {
		t.Fatal("the pinned key is no longer found")
	}
	f.e.Unpin(ctx, id)
	if n, err := f.e.Delete(ctx, f.ns, f.keys[:1]); err != nil || n != 1 {
		t.Fatalf("Delete after Unpin = %d, %v; want 1", n, err)
	}
}

func TestPinChecksTheFileWhateverVerifyInterval(t *testing.T) {
	ctx := context.Background()
	f := newPinFixture(t, Config{VerifyInterval: time.Hour})
	storeAndCheck(t, f.e, f.c, f.keys[:2], f.blocks[:2])
	if err := os.Remove(f.paths[1]); err != nil {
		t.Fatal(err)
	}
	if n, _ := f.e.Lookup(ctx, f.ns, f.keys[1:2]); n != 1 {
		t.Fatalf("Lookup within VerifyInterval = %d: the test expects the unchecked hit", n)
	}
	id, held := f.pin(t, f.keys[:2], 0)
	if id == 0 || !slices.Equal(held, []bool{true, false}) {
		t.Fatalf("Pin = %d, %v; want [true false] (the removed file is not pinned)", id, held)
	}
	if pins, keys := f.e.PinStats(); pins != 1 || keys != 1 {
		t.Fatalf("PinStats = %d pins, %d keys; want 1, 1", pins, keys)
	}
	if id, held := f.pin(t, f.keys[1:2], 0); id != 0 || held[0] {
		t.Fatalf("Pin of a missing key = %d, %v; want 0, [false]", id, held)
	}
}

func TestPinRefusesBadRequests(t *testing.T) {
	f := newPinFixture(t, Config{})
	if _, _, err := f.e.Pin(context.Background(), f.ns+7, f.keys[:1], 0); err == nil {
		t.Fatal("Pin in an undeclared namespace succeeded")
	}
	if _, _, err := f.e.Pin(context.Background(), f.ns, f.keys[:1], -time.Second); err == nil {
		t.Fatal("Pin with a negative lease succeeded")
	}
}

func TestCloseReleasesPins(t *testing.T) {
	f := newPinFixture(t, Config{})
	storeAndCheck(t, f.e, f.c, f.keys[:1], f.blocks[:1])
	f.pin(t, f.keys[:1], time.Hour)
	if err := f.e.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if pins, _ := f.e.PinStats(); pins != 0 {
		t.Fatalf("%d pins after Close", pins)
	}
	if _, _, err := f.e.Pin(context.Background(), f.ns, f.keys[:1], 0); err == nil {
		t.Fatal("Pin after Close succeeded")
	}
}

// TestClientPinsReachAReplacementPolicy: a policy that replaces the
// current one (a reload) is told of the client pins held, so that it
// offers the unpinned files as victims, not the pinned ones it would
// otherwise take for the least recent: stores go on evicting rather than
// fail with no space. It fails when the new policy is told only of the
// files.
func TestClientPinsReachAReplacementPolicy(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := int64(4096 + g.KeyBytes())
	newLRU := func(idx policy.Index) (policy.Policy, error) {
		return policy.NewNative(func() guest.Policy { return lru.New() }, idx, policy.Config{Shards: 1, Logger: testLogger(t)})
	}
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir(), Capacity: 8 * fileLen, HighWatermark: 0.75, LowWatermark: 0.5}}, NewPolicy: newLRU})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 8, layoutPlaneFirst)
	// The least recent files, pinned: more than an eviction on a full
	// mount needs, so a policy that offers them first frees nothing.
	pinned := testKeys("pinned", 5)
	for i := range pinned {
		storeAndCheck(t, e, c, pinned[i:i+1], [][]int{{0, 1, 2, 3}})
	}
	id, held, err := e.Pin(ctx, ns, pinned, 0)
	if err != nil || !slices.Equal(held, []bool{true, true, true, true, true}) {
		t.Fatalf("Pin = %v, %v; want every key pinned", held, err)
	}
	if err := e.ReplacePolicy(ctx, newLRU); err != nil {
		t.Fatal(err)
	}
	for i := range 12 {
		k := []byte(fmt.Sprintf("after the reload-%d", i))
		res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: [][]byte{k}, Blocks: [][]int{{0, 1, 2, 3}}}))
		if err := res.Keys[0].Err; err != nil {
			t.Fatalf("store %d after the reload: %v", i, err)
		}
	}
	if n, _ := e.Lookup(ctx, ns, pinned); n != len(pinned) {
		t.Fatalf("%d of the %d pinned keys found", n, len(pinned))
	}
	e.Unpin(ctx, id)
}
