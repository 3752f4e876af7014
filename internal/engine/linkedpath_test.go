//go:build invariants

package engine

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
)

// namedEngine opens an engine on the mount dir whose policy names every
// key's file name (relative to dir), declares smallGeometry(true) and
// registers a cache of 16 blocks.
func namedEngine(t *testing.T, dir, name, node string) (*Engine, *fixedPathPolicy, *testCache, NamespaceID) {
	t.Helper()
	pol := &fixedPathPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}
	pol.path.Store(&name)
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, NodeID: node, NewPolicy: func(policy.Index) (policy.Policy, error) { return pol, nil }})
	g := smallGeometry(true)
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	return e, pol, newTestCache(t, e, ns, g, 16, layoutPlaneFirst), ns
}

// dataNames lists the names in dir that are not kvhost's own (no leading
// dot: neither temporary files, spares nor owner files).
func dataNames(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, d := range ents {
		if !strings.HasPrefix(d.Name(), ".") {
			out = append(out, d.Name())
		}
	}
	return out
}

// TestAStoreNeverWritesThroughALinkPlantedAfterItsDirectoryWasChecked: a
// store checks a directory of its policy's name for planted links once,
// when it first makes or meets it (mkdir, mkdirIn). Someone with write
// access to the mount then replaces that directory with a symbolic link
// to a directory outside the mount. The next store named there fails with
// ErrPolicy, and nothing is written outside the mount: no temporary file,
// no published one.
func TestAStoreNeverWritesThroughALinkPlantedAfterItsDirectoryWasChecked(t *testing.T) {
	ctx := context.Background()
	dir, outside := t.TempDir(), t.TempDir()
	e, pol, c, _ := namedEngine(t, dir, "d/k1.kv", "a")
	k1, k2 := []byte("k1"), []byte("k2")
	keyContent(c, k1, []int{0, 1, 2, 3})
	keyContent(c, k2, []int{4, 5, 6, 7})
	storeAndCheck(t, e, c, [][]byte{k1}, [][]int{{0, 1, 2, 3}})

	if err := os.Rename(filepath.Join(dir, "d"), filepath.Join(dir, "d.old")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(dir, "d")); err != nil {
		t.Fatal(err)
	}
	name := "d/k2.kv"
	pol.path.Store(&name)
	res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: [][]byte{k2}, Blocks: [][]int{{4, 5, 6, 7}}}))
	if k := res.Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, ErrPolicy) {
		t.Errorf("store named %s, its directory now a link out of the mount: %v (%v), want failed with ErrPolicy", name, k.Outcome, k.Err)
	}
	if ents, _ := os.ReadDir(outside); len(ents) != 0 {
		var names []string
		for _, d := range ents {
			names = append(names, d.Name())
		}
		t.Errorf("the store wrote outside its mount, through the link: %v", names)
	}
}

// TestAnEngineNeverServesOrRemovesAFileOutsideItsMountThroughALink: a
// symbolic link planted in a mount leads to another engine's mount, whose
// file holds a key of the same namespace (same geometry), under the name
// this engine's policy gives the key through the link. The link is planted
// either where the policy's name has a directory no store made, or in
// place of a directory holding a file of this engine's. Neither a lookup,
// a load nor a delete of the key takes the other mount's file for this
// engine's: it is never loaded, and the delete leaves it where it is.
func TestAnEngineNeverServesOrRemovesAFileOutsideItsMountThroughALink(t *testing.T) {
	ctx := context.Background()
	key := []byte("k")
	for _, tc := range []struct {
		name string
		// plant makes the link in the mount dir to outside, given the
		// engine and cache of dir, before the lookup.
		plant func(t *testing.T, e *Engine, c *testCache, dir, outside string)
	}{
		{"planted where no store went", func(t *testing.T, e *Engine, c *testCache, dir, outside string) {
			if err := os.Symlink(outside, filepath.Join(dir, "d")); err != nil {
				t.Fatal(err)
			}
		}},
		{"in place of a directory of this engine's file", func(t *testing.T, e *Engine, c *testCache, dir, outside string) {
			keyContent(c, key, []int{0, 1, 2, 3})
			storeAndCheck(t, e, c, [][]byte{key}, [][]int{{0, 1, 2, 3}})
			if err := os.Rename(filepath.Join(dir, "d"), filepath.Join(dir, "d.old")); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(outside, filepath.Join(dir, "d")); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir, outside := t.TempDir(), t.TempDir()
			// The other engine's file, with other bytes than this
			// engine's, at outside/k.kv.
			b, _, cb, _ := namedEngine(t, outside, "k.kv", "b")
			for _, blk := range []int{8, 9, 10, 11} {
				for l := range cb.geo.Layers {
					for p := range cb.geo.Planes() {
						for i := range cb.block(l, p, blk) {
							cb.block(l, p, blk)[i] = 0xb
						}
					}
				}
			}
			storeAndCheck(t, b, cb, [][]byte{key}, [][]int{{8, 9, 10, 11}})
			theirs := cb.data([]int{8, 9, 10, 11})
			if err := b.Close(ctx); err != nil {
				t.Fatal(err)
			}
			before, err := os.Stat(filepath.Join(outside, "k.kv"))
			if err != nil {
				t.Fatal(err)
			}

			e, _, c, ns := namedEngine(t, dir, "d/k.kv", "a")
			tc.plant(t, e, c, dir, outside)
			c.clear([]int{12, 13, 14, 15})
			res := wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: [][]byte{key}, Blocks: [][]int{{12, 13, 14, 15}}}))
			if k := res.Keys[0]; k.Outcome == OutcomeLoaded || bytes.Equal(c.data([]int{12, 13, 14, 15}), theirs) {
				t.Errorf("load through the link: %v (%v): the other mount's file was served", k.Outcome, k.Err)
			}
			if n, err := e.Lookup(ctx, ns, [][]byte{key}); err != nil || n != 0 {
				t.Errorf("lookup through the link: %d keys stored (%v), want 0", n, err)
			}
			if _, err := e.Delete(ctx, ns, [][]byte{key}); err != nil {
				t.Fatal(err)
			}
			after, err := os.Stat(filepath.Join(outside, "k.kv"))
			if err != nil || !os.SameFile(before, after) {
				t.Errorf("the other mount's file, reached through the link, was removed or replaced (%v); left there: %v", err, dataNames(t, outside))
			}
		})
	}
}

// TestAMountWhoseRootIsASymbolicLinkStoresBelowIt: a mount's root is the
// operator's to place, by a link if so (resolved once at Open); only the
// directories below it must not be links. A store named in a directory
// below such a root is made, found and deleted as on any mount.
func TestAMountWhoseRootIsASymbolicLinkStoresBelowIt(t *testing.T) {
	ctx := context.Background()
	target := t.TempDir()
	dir := filepath.Join(t.TempDir(), "alias")
	if err := os.Symlink(target, dir); err != nil {
		t.Fatal(err)
	}
	e, _, c, ns := namedEngine(t, dir, "d/k1.kv", "a")
	key := []byte("k1")
	keyContent(c, key, []int{0, 1, 2, 3})
	storeAndCheck(t, e, c, [][]byte{key}, [][]int{{0, 1, 2, 3}})
	if names := dataNames(t, filepath.Join(target, "d")); len(names) != 1 {
		t.Fatalf("the store under the linked root: %v, want its file", names)
	}
	if _, err := e.Delete(ctx, ns, [][]byte{key}); err != nil {
		t.Fatal(err)
	}
	if names := dataNames(t, filepath.Join(target, "d")); len(names) != 0 {
		t.Errorf("the delete under the linked root left %v", names)
	}
}
