//go:build invariants

package engine

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/abi"
)

// TestThrowawayNamespacesReuseTheirIDs: a client that declares and
// releases distinct geometries that never hold a file does not use up
// namespace ids (the built-in policies accept ids below 65,536, and every
// id costs state for the engine's life): a released namespace without
// files gives its id back, and the next new geometry takes it. A released
// namespace with files keeps its id, and declaring it again returns it.
func TestThrowawayNamespacesReuseTheirIDs(t *testing.T) {
	ctx := context.Background()
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, abi.OrderLayerMajor)})
	kept := smallGeometry(true)
	kept.Model = "kept"
	keptID, err := e.Declare(ctx, kept)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, keptID, kept, 16, layoutPlaneFirst)
	keyContent(c, []byte("k"), []int{0, 1, 2, 3})
	storeAndCheck(t, e, c, [][]byte{[]byte("k")}, [][]int{{0, 1, 2, 3}})
	if err := e.UnregisterCache(c.id); err != nil {
		t.Fatal(err)
	}
	if err := e.Release(keptID); err != nil {
		t.Fatal(err)
	}
	seen := map[NamespaceID]bool{}
	for i := range 200 {
		g := smallGeometry(true)
		g.Model = fmt.Sprintf("throwaway-%d", i)
		id, err := e.Declare(ctx, g)
		if err != nil {
			t.Fatalf("throwaway %d: %v", i, err)
		}
		if id == keptID {
			t.Fatalf("throwaway %d was given id %d, which namespace %q holds with a file", i, id, kept.Model)
		}
		seen[id] = true
		if err := e.Release(id); err != nil {
			t.Fatal(err)
		}
	}
	if len(seen) > 1 {
		t.Fatalf("200 throwaway namespaces, declared and released one at a time, took %d ids; want 1", len(seen))
	}
	if id, err := e.Declare(ctx, kept); err != nil || id != keptID {
		t.Fatalf("declaring %q again: id %d, %v; want its id %d", kept.Model, id, err, keptID)
	}
}

// TestARefusedDeclarationCountsNoNamespace: a geometry the engine refuses
// after counting it against Config.MaxNamespaces (the policy's layout
// packs more segments per file than a file may hold) gives its count and
// its id back: refused declarations never lock a valid one out, and the
// valid one takes the first id.
func TestARefusedDeclarationCountsNoNamespace(t *testing.T) {
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(32, abi.OrderLayerMajor), MaxNamespaces: 2})
	big := smallGeometry(true)
	big.Layers, big.TokensPerKey = 4096, 8*big.TokensPerBlock
	for i := range 3 {
		g := big
		g.Model = fmt.Sprintf("big-%d", i)
		if _, err := e.Declare(context.Background(), g); err == nil {
			t.Fatal("a layout past MaxSegmentsPerFile was accepted")
		}
	}
	id, err := e.Declare(context.Background(), smallGeometry(true))
	if err != nil {
		t.Fatalf("a valid geometry after refused ones: %v", err)
	}
	if id != 0 {
		t.Fatalf("the valid geometry got id %d after 3 refused ones; want 0, theirs given back", id)
	}
}

// TestAGeometryWhoseFingerprintCollidesIsRefused plants what an FNV-1a
// collision would give (crafting one takes a search, not a test): a second
// geometry whose fingerprint names the first's namespace. Sharing it would
// serve one model's KV to the other, whose files carry the same
// fingerprint; the second is refused, while declared and after a release
// that left a file, and the first keeps its namespace and file.
func TestAGeometryWhoseFingerprintCollidesIsRefused(t *testing.T) {
	ctx := context.Background()
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, abi.OrderLayerMajor)})
	first := smallGeometry(true)
	first.Model = "first"
	id, err := e.Declare(ctx, first)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, id, first, 16, layoutPlaneFirst)
	keyContent(c, []byte("k"), []int{0, 1, 2, 3})
	want := c.data([]int{0, 1, 2, 3})
	storeAndCheck(t, e, c, [][]byte{[]byte("k")}, [][]int{{0, 1, 2, 3}})

	second := first
	second.Model = "second"
	e.tables.setFingerprint(second.Fingerprint(), id)
	declared := func(when string) {
		t.Helper()
		got, err := e.Declare(ctx, second)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "fingerprint") {
			t.Fatalf("%s: declaring %q with namespace %d's fingerprint: id %d, %v; want ErrInvalid naming the fingerprint", when, second.Model, id, got, err)
		}
	}
	declared("while the first is declared")
	if err := e.UnregisterCache(c.id); err != nil {
		t.Fatal(err)
	}
	if err := e.Release(id); err != nil {
		t.Fatal(err)
	}
	declared("after the first's release, its file kept")
	if got, err := e.Declare(ctx, first); err != nil || got != id {
		t.Fatalf("declaring %q again: id %d, %v; want its id %d", first.Model, got, err, id)
	}
	c = newTestCache(t, e, id, first, 16, layoutPlaneFirst)
	loadAndCompare(t, e, c, [][]byte{[]byte("k")}, [][]int{{4, 5, 6, 7}}, [][]byte{want})
}

// get returns namespace id, declared or not (tests).
func (t *tables) get(id NamespaceID) *namespace {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return t.nss[id]
}

// setFingerprint points fingerprint fp at namespace id (tests: a
// fingerprint collision).
func (t *tables) setFingerprint(fp uint64, id NamespaceID) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.byFP[fp] = id
}

// cache returns registered cache id, or nil (tests).
func (t *tables) cache(id CacheID) *cache {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return t.caches[id]
}

// cacheCount is the number of caches registered (tests).
func (t *tables) cacheCount() int {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return len(t.caches)
}
