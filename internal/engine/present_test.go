//go:build invariants

package engine

import (
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
)

// TestSharedMountNoFalsePresent is the false `present` of the
// shared-directory reliability scenario, step by step, on two engines
// sharing one directory with 4 keys per file:
//
//  1. B stores [x,k1,k2,k3]: file P(x), named after x.
//  2. A, which does not know x, stores [y,x,c,d]: file P(y).
//  3. B looks y up and indexes A's file: B's index now finds x in P(y).
//  4. A deletes y: P(y) goes.
//  5. B stores [x,k1]. x's entry (P(y)) is gone, so x is stored again,
//     in a file named after it: P(x), where B's file holding k1 is.
//
// k1 is in P(x), verified, so it may be answered present — but not if the
// same store then renames its new file over P(x): B's next load of k1
// must load it. And x, still in B's own file at P(x), is present there:
// the store must not replace a file that holds what it stores. A variant
// has B look x up before step 5: the lookup finds x in B's file under its
// name, and the index has it there again.
func TestSharedMountNoFalsePresent(t *testing.T) {
	for _, tc := range []struct {
		name string
		fs   func() fsys.FS
	}{
		{"real-files", func() fsys.FS { return fsys.OS{} }},
		{"simulated-ext4-reuse", func() fsys.FS { return newReuseFS(false) }},
	} {
		for _, lookupX := range []bool{false, true} {
			name := tc.name
			if lookupX {
				name += "/lookup-x-first"
			}
			t.Run(name, func(t *testing.T) {
				ctx := context.Background()
				dir := t.TempDir()
				fs := tc.fs()
				a, b := openNode(t, dir, "nodeA", fs, 4), openNode(t, dir, "nodeB", fs, 4)
				r := rand.New(rand.NewPCG(11, 11))
				key := func(s string) []byte { return []byte("fp-" + s) }
				store := func(n *node, keys [][]byte, first int) ([][]byte, Result) {
					t.Helper()
					bl := blockLists(r, len(keys), 4, first)
					var want [][]byte
					for _, b := range bl {
						n.c.fill(r, b)
						want = append(want, n.c.data(b))
					}
					return want, wait(t)(n.e.Store(ctx, StoreRequest{Cache: n.c.id, Keys: keys, Blocks: bl}))
				}

				// 1.
				bWant, res := store(b, [][]byte{key("x"), key("k1"), key("k2"), key("k3")}, 0)
				wantOutcomes(t, "B's store of [x,k1,k2,k3]", res, OutcomeStored)
				// 2.
				_, res = store(a, [][]byte{key("y"), key("x"), key("c"), key("d")}, 0)
				wantOutcomes(t, "A's store of [y,x,c,d]", res, OutcomeStored)
				// 3.
				if n, err := b.e.Lookup(ctx, b.ns, [][]byte{key("y"), key("x")}); n != 2 || err != nil {
					t.Fatalf("B's lookup of [y,x]: %d, %v; want 2", n, err)
				}
				// 4.
				if n, err := a.e.Delete(ctx, a.ns, [][]byte{key("y")}); n != 1 || err != nil {
					t.Fatalf("A's delete of y: %d, %v; want 1", n, err)
				}
				if lookupX {
					// 4b. B's lookup of x finds its entry (P(y)) gone and x
					// under its name, in B's own file: the index has it
					// again, so the store below finds it there.
					if n, err := b.e.Lookup(ctx, b.ns, [][]byte{key("x")}); n != 1 || err != nil {
						t.Fatalf("B's lookup of x: %d, %v; want 1", n, err)
					}
					path := func(k string) string {
						if en := b.e.find(b.e.tables.get(b.ns), key(k)); en != nil {
							return en.Path
						}
						return "no file"
					}
					if x, k1 := path("x"), path("k1"); x != k1 {
						t.Fatalf("B's index after the lookup of x: x in %s, k1 in %s; want both in B's file", x, k1)
					}
				}
				// 5.
				keys := [][]byte{key("x"), key("k1")}
				bl := [][]int{{16, 17, 18, 19}, {20, 21, 22, 23}}
				for i, b2 := range bl {
					// The payloads B stored in step 1: the store writes the
					// same bytes whether it answers stored or present.
					copyInto(b.c, b2, bWant[i])
				}
				res = wait(t)(b.e.Store(ctx, StoreRequest{Cache: b.c.id, Keys: keys, Blocks: bl}))
				for i, k := range res.Keys {
					if k.Outcome != OutcomeStored && k.Outcome != OutcomePresent {
						t.Fatalf("B's store of %s: %v (%v)", keys[i], k.Outcome, k.Err)
					}
					t.Logf("B's store of %s: %v", keys[i], k.Outcome)
				}
				into := [][]int{{32, 33, 34, 35}, {36, 37, 38, 39}}
				lres := wait(t)(b.e.Load(ctx, LoadRequest{Cache: b.c.id, Keys: keys, Blocks: into}))
				for i, k := range lres.Keys {
					if k.Outcome != OutcomeLoaded {
						t.Fatalf("B's store of %s answered %v, the next load: %v (%v)", keys[i], res.Keys[i].Outcome, k.Outcome, k.Err)
					}
					if got := b.c.data(into[i]); string(got) != string(bWant[i]) {
						t.Fatalf("B's load of %s: other bytes", keys[i])
					}
				}
				// x was in B's file at its own name: nothing had to be
				// written, and k2 and k3, stored with it, are still there.
				if o := res.Keys[0].Outcome; o != OutcomePresent {
					t.Errorf("B's store of x, held by B's file at x's name: %v, want present", o)
				}
				loadAndCompare(t, b.e, b.c, [][]byte{key("k2"), key("k3")}, [][]int{{40, 41, 42, 43}, {44, 45, 46, 47}}, bWant[2:])
			})
		}
	}
}

// sharedNamePolicy is testPolicy naming every key that starts with
// "shared-" shared.kv: a policy whose names are not one per key (buckets,
// a hash truncated), where a new file can be renamed over another file
// holding other keys.
type sharedNamePolicy struct{ *testPolicy }

func (p sharedNamePolicy) Name(ctx context.Context, recs []abi.NameRecord) error {
	if err := p.testPolicy.Name(ctx, recs); err != nil {
		return err
	}
	for i := range recs {
		if strings.HasPrefix(string(recs[i].Key()), "shared-") {
			recs[i].Mount, recs[i].PathLen = 0, uint32(copy(recs[i].PathBuf[:], "shared.kv"))
		}
	}
	return nil
}

// TestStoreNeverReplacesWhatItAnsweredPresent: a store answers present
// for k1, held by the file at shared.kv, and then writes a new file for
// another key at that same name: the rename replaces k1's file. k1 is then
// stored again (its next load loads it), not left answered present with
// no data.
func TestStoreNeverReplacesWhatItAnsweredPresent(t *testing.T) {
	ctx := context.Background()
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: sharedNamePolicy{newTestPolicy(4, abi.OrderLayerMajor)}})
	g := smallGeometry(true)
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 64, layoutPlaneFirst)
	r := rand.New(rand.NewPCG(13, 13))
	k1, other := []byte("k1"), []byte("shared-b")
	bl := blockLists(r, 2, 4, 0)
	for _, b := range bl {
		c.fill(r, b)
	}
	want := c.data(bl[0])
	storeAndCheck(t, e, c, [][]byte{[]byte("shared-a"), k1}, bl)
	copyInto(c, bl[1], want)
	res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: [][]byte{k1, other}, Blocks: bl}))
	for i, k := range res.Keys {
		if k.Outcome != OutcomeStored && k.Outcome != OutcomePresent {
			t.Fatalf("store of key %d: %v (%v)", i, k.Outcome, k.Err)
		}
	}
	if o := res.Keys[0].Outcome; o != OutcomeStored {
		t.Errorf("store of k1, whose file the store replaced: %v, want stored", o)
	}
	loadAndCompare(t, e, c, [][]byte{k1}, [][]int{{32, 33, 34, 35}}, [][]byte{want})
}

// copyInto writes want (as data returns it) into blocks of c.
func copyInto(c *testCache, blocks []int, want []byte) {
	off := 0
	for l := range c.geo.Layers {
		for p := range c.geo.Planes() {
			for _, b := range blocks {
				off += copy(c.block(l, p, b), want[off:])
			}
		}
	}
}

// TestLoadMissingSaysWhy: every `missing` outcome of a load carries an
// error wrapping ErrNotFound that says why: the key is not indexed (nor
// under its name), its file vanished, or the file at its path was replaced
// by one that does not hold it.
func TestLoadMissingSaysWhy(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	a, b := openNode(t, dir, "nodeA", fsys.OS{}, 4), openNode(t, dir, "nodeB", fsys.OS{}, 4)
	r := rand.New(rand.NewPCG(12, 12))
	store := func(n *node, keys [][]byte) {
		t.Helper()
		bl := blockLists(r, len(keys), 4, 0)
		for _, b := range bl {
			n.c.fill(r, b)
		}
		storeAndCheck(t, n.e, n.c, keys, bl)
	}
	// Vanished: A's file removed behind its back.
	store(a, testKeys("why-v", 1))
	en := a.e.find(a.e.tables.get(a.ns), testKeys("why-v", 1)[0])
	if err := os.Remove(en.Path); err != nil {
		t.Fatal(err)
	}
	// Replaced: A stores [r0,r1]; B, which does not know r0, stores
	// [r0,z] at the same name: A's r1 is no longer in the file there.
	store(a, [][]byte{[]byte("why-r0"), []byte("why-r1")})
	store(b, [][]byte{[]byte("why-r0"), []byte("why-z")})
	for _, tc := range []struct {
		name string
		key  []byte
		want error
		says string
	}{
		{"vanished", testKeys("why-v", 1)[0], ErrNotFound, "vanished"},
		{"never-stored", []byte("why-never"), ErrNotFound, "not indexed"},
		{"replaced", []byte("why-r1"), ErrNotFound, "does not hold the key"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := wait(t)(a.e.Load(ctx, LoadRequest{Cache: a.c.id, Keys: [][]byte{tc.key}, Blocks: [][]int{{8, 9, 10, 11}}}))
			k := res.Keys[0]
			if k.Outcome != OutcomeMissing || !errors.Is(k.Err, tc.want) || !strings.Contains(k.Err.Error(), tc.says) {
				t.Fatalf("load: %v (%v), want missing with %v saying %q", k.Outcome, k.Err, tc.want, tc.says)
			}
			t.Log(k.Err)
		})
	}
}
