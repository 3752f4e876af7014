//go:build invariants

package engine

import (
	"context"
	"errors"
	"testing"

	"github.com/kvhost/kvhost/abi"
)

// TestAStoreNeverReplacesAFileAClientPinned: with a policy that names two
// keys' files alike (onePathPolicy; a plugin's naming is its own), a store of key B would replace key A's file. While a
// client pin holds A's file the store is refused (ErrPolicy, naming the
// path), and A loads its own bytes; once the pin is released, B's store
// replaces the file.
func TestAStoreNeverReplacesAFileAClientPinned(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: onePathPolicy{newTestPolicy(1, abi.OrderLayerMajor)}})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	a, b := []byte("key-a"), []byte("key-b")
	blocksA, blocksB, into := []int{0, 1, 2, 3}, []int{4, 5, 6, 7}, []int{8, 9, 10, 11}
	keyContent(c, a, blocksA)
	keyContent(c, b, blocksB)
	wantA := c.data(blocksA)
	storeAndCheck(t, e, c, [][]byte{a}, [][]int{blocksA})

	id, held, err := e.Pin(ctx, ns, [][]byte{a}, 0)
	if err != nil || !held[0] {
		t.Fatalf("pin of A: %v %v", held, err)
	}
	res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: [][]byte{b}, Blocks: [][]int{blocksB}}))
	if kr := res.Keys[0]; kr.Outcome != OutcomeFailed || !errors.Is(kr.Err, ErrPolicy) {
		t.Fatalf("store of B onto pinned A's path: %v (%v), want failed with ErrPolicy", kr.Outcome, kr.Err)
	}
	loadAndCompare(t, e, c, [][]byte{a}, [][]int{into}, [][]byte{wantA})

	if n := e.Unpin(ctx, id); n != 1 {
		t.Fatalf("unpin: %d keys, want 1", n)
	}
	storeAndCheck(t, e, c, [][]byte{b}, [][]int{blocksB})
	loadAndCompare(t, e, c, [][]byte{b}, [][]int{into}, [][]byte{c.data(blocksB)})
}
