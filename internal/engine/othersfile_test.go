//go:build invariants

package engine

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
)

// TestAStoreNeverReplacesAFileThatIsNotKvhosts: a policy names a key's
// file where a file that is not kvhost's lies in the mount (a user's
// notes, a symbolic link). The store fails with ErrPolicy and the file is
// left as it was; where a kvhost file the index does not hold lies there
// (left by another engine), the store replaces it, as before.
func TestAStoreNeverReplacesAFileThatIsNotKvhosts(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	path := filepath.Join(dir, "one.kv") // onePathPolicy's name for every key
	g := smallGeometry(true)
	for _, tc := range []struct {
		name  string
		plant func(t *testing.T)
	}{
		{"a user's file", func(t *testing.T) {
			if err := os.WriteFile(path, []byte("my notes\n"), 0o644); err != nil {
				t.Fatal(err)
			}
		}},
		{"a symbolic link", func(t *testing.T) {
			if err := os.Symlink(filepath.Join(dir, "elsewhere"), path); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			os.Remove(path)
			tc.plant(t)
			before, err := os.Lstat(path)
			if err != nil {
				t.Fatal(err)
			}
			e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: onePathPolicy{newTestPolicy(1, abi.OrderLayerMajor)}})
			ns, err := e.Declare(ctx, g)
			if err != nil {
				t.Fatal(err)
			}
			c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
			keyContent(c, []byte("k"), []int{0, 1, 2, 3})
			res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: [][]byte{[]byte("k")}, Blocks: [][]int{{0, 1, 2, 3}}}))
			if kr := res.Keys[0]; kr.Outcome != OutcomeFailed || !errors.Is(kr.Err, ErrPolicy) {
				t.Fatalf("store onto %s: %v (%v), want failed with ErrPolicy", tc.name, kr.Outcome, kr.Err)
			}
			after, err := os.Lstat(path)
			if err != nil || !os.SameFile(before, after) {
				t.Fatalf("%s at the store's path was replaced or removed (%v)", tc.name, err)
			}
			if l := leftovers(t, dir); len(l) != 0 {
				t.Fatalf("leftovers after the refused store: %v", l)
			}
			e.Close(ctx)
		})
	}
	// A kvhost file another engine left at the path is replaced.
	os.Remove(path)
	a := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: onePathPolicy{newTestPolicy(1, abi.OrderLayerMajor)}})
	b := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: onePathPolicy{newTestPolicy(1, abi.OrderLayerMajor)}, NodeID: "b"})
	nsA, err := a.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	nsB, err := b.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	ca, cb := newTestCache(t, a, nsA, g, 16, layoutPlaneFirst), newTestCache(t, b, nsB, g, 16, layoutPlaneFirst)
	keyContent(ca, []byte("ka"), []int{0, 1, 2, 3})
	storeAndCheck(t, a, ca, [][]byte{[]byte("ka")}, [][]int{{0, 1, 2, 3}})
	keyContent(cb, []byte("kb"), []int{0, 1, 2, 3})
	storeAndCheck(t, b, cb, [][]byte{[]byte("kb")}, [][]int{{0, 1, 2, 3}})
	loadAndCompare(t, b, cb, [][]byte{[]byte("kb")}, [][]int{{4, 5, 6, 7}}, [][]byte{cb.data([]int{0, 1, 2, 3})})
}

// TestAStoreNeverReplacesAFileThatIsNotKvhostsWhereItsIndexHadOne: the
// index holds a file at the path a policy names for a new key (another
// key's: onePathPolicy), but that file was removed behind the engine's
// back and someone put a file of their own there (a user's notes, a
// symbolic link). The store that would replace the indexed file fails
// with ErrPolicy and leaves the file there as it was, with no temporary
// file left behind.
func TestAStoreNeverReplacesAFileThatIsNotKvhostsWhereItsIndexHadOne(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	for _, tc := range []struct {
		name  string
		plant func(t *testing.T, path string)
	}{
		{"a user's file", func(t *testing.T, path string) {
			if err := os.WriteFile(path, []byte("my notes\n"), 0o644); err != nil {
				t.Fatal(err)
			}
		}},
		{"a symbolic link", func(t *testing.T, path string) {
			if err := os.Symlink(filepath.Join(filepath.Dir(path), "elsewhere"), path); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "one.kv")
			// VerifyInterval: the index's file is not looked at again
			// before the second store, as between a daemon's checks.
			e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: onePathPolicy{newTestPolicy(1, abi.OrderLayerMajor)}, VerifyInterval: time.Hour})
			ns, err := e.Declare(ctx, g)
			if err != nil {
				t.Fatal(err)
			}
			c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
			keyContent(c, []byte("k1"), []int{0, 1, 2, 3})
			storeAndCheck(t, e, c, [][]byte{[]byte("k1")}, [][]int{{0, 1, 2, 3}})
			if err := os.Remove(path); err != nil {
				t.Fatal(err)
			}
			tc.plant(t, path)
			before, err := os.Lstat(path)
			if err != nil {
				t.Fatal(err)
			}
			keyContent(c, []byte("k2"), []int{4, 5, 6, 7})
			res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: [][]byte{[]byte("k2")}, Blocks: [][]int{{4, 5, 6, 7}}}))
			if kr := res.Keys[0]; kr.Outcome != OutcomeFailed || !errors.Is(kr.Err, ErrPolicy) {
				t.Errorf("store onto %s where the index had a file: %v (%v), want failed with ErrPolicy", tc.name, kr.Outcome, kr.Err)
			}
			after, err := os.Lstat(path)
			if err != nil || !os.SameFile(before, after) {
				t.Errorf("%s at the store's path was replaced or removed (%v)", tc.name, err)
			}
			if l := leftovers(t, dir); len(l) != 0 {
				t.Errorf("leftovers after the refused store: %v", l)
			}
		})
	}
}
