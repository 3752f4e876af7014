//go:build invariants

package engine

import (
	"context"
	"fmt"
	"testing"

	"github.com/kvhost/kvhost/abi"
)

// TestNamespacesWhoseFilesWentReuseTheirIDs: models come and go, each
// storing a file, released while the file stays (its id kept: declaring
// it again returns it), the file going later (purged here; evicted or
// deleted as well). The ids of namespaces whose files have all gone must
// be given back: the built-in policies accept ids below 65,536 and every
// id holds state, so a daemon through which that many models ever stored
// a file refused every new one until a restart. A namespace that keeps a
// file keeps its id throughout.
func TestNamespacesWhoseFilesWentReuseTheirIDs(t *testing.T) {
	ctx := context.Background()
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, abi.OrderLayerMajor)})
	store := func(g Geometry) NamespaceID {
		t.Helper()
		id, err := e.Declare(ctx, g)
		if err != nil {
			t.Fatal(err)
		}
		c := newTestCache(t, e, id, g, 16, layoutPlaneFirst)
		keyContent(c, []byte("k"), []int{0, 1, 2, 3})
		storeAndCheck(t, e, c, [][]byte{[]byte("k")}, [][]int{{0, 1, 2, 3}})
		if err := e.UnregisterCache(c.id); err != nil {
			t.Fatal(err)
		}
		if err := e.Release(id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	kept := smallGeometry(true)
	kept.Model = "kept"
	keptID := store(kept)
	seen := map[NamespaceID]bool{}
	const models = 1000
	for i := range models {
		g := smallGeometry(true)
		g.Model = fmt.Sprintf("model-%d", i)
		id := store(g)
		if id == keptID {
			t.Fatalf("model %d was given id %d, which %q holds with a file", i, id, kept.Model)
		}
		seen[id] = true
		if r, err := e.Purge(ctx, g.Fingerprint()); err != nil || r.Files != 1 {
			t.Fatalf("purge model %d: %+v %v", i, r, err)
		}
	}
	if len(seen) > 2*64 {
		t.Fatalf("%d models, each released with a file that went later, took %d ids; want at most %d", models, len(seen), 2*64)
	}
	if id, err := e.Declare(ctx, kept); err != nil || id != keptID {
		t.Fatalf("declaring %q again: id %d, %v; want its id %d", kept.Model, id, err, keptID)
	}
}
