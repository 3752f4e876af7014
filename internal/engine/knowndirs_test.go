//go:build invariants

package engine

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// knownDirs counts the directories e's mkdir remembers (Engine.dirs).
func knownDirs(e *Engine) int64 {
	var n int64
	e.own.dirs.known.Range(func(any, any) bool { n++; return true })
	return n
}

// TestTheEngineForgetsDirectoriesPastItsBound: stores named into many
// distinct directories (as a vllm-fs layout's 4096 × 256 per group, or a
// policy's names) leave the engine's cache of directories it made or
// checked (Engine.dirs) no larger than its bound (maxKnownDirs, lowered
// here): the cache was never pruned, and grew with every directory met
// over the engine's life. A directory forgotten is checked again at its
// next store: one that still stands is stored into, one removed is made
// again, and one replaced by a symbolic link out of the mount fails the
// store with ErrPolicy and nothing is written where the link points.
func TestTheEngineForgetsDirectoriesPastItsBound(t *testing.T) {
	old := maxKnownDirs
	maxKnownDirs = 8
	t.Cleanup(func() { maxKnownDirs = old })
	ctx := context.Background()
	dir, outside := t.TempDir(), t.TempDir()
	e, pol, c, ns := namedEngine(t, dir, "a/0/k.kv", "a")
	const dirs = 40
	name := func(i int) string { return fmt.Sprintf("a/%d/k.kv", i) }
	keyOf := func(i int) []byte { return []byte(fmt.Sprintf("k%d", i)) }
	// store stores key into directory i (each key a file name once:
	// a store of a key stored is present, and writes nothing).
	store := func(i, key int) KeyResult {
		t.Helper()
		n := name(i)
		pol.path.Store(&n)
		keyContent(c, keyOf(key), []int{0, 1, 2, 3})
		return wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: [][]byte{keyOf(key)}, Blocks: [][]int{{0, 1, 2, 3}}})).Keys[0]
	}
	for i := range dirs {
		if k := store(i, i); k.Outcome != OutcomeStored {
			t.Fatalf("store into %s: %v (%v)", name(i), k.Outcome, k.Err)
		}
		if n := knownDirs(e); n > maxKnownDirs {
			t.Fatalf("after %d stores into distinct directories the engine remembers %d directories, want at most %d", i+1, n, maxKnownDirs)
		}
	}
	if n, err := e.Lookup(ctx, ns, [][]byte{keyOf(0), keyOf(dirs - 1)}); err != nil || n != 2 {
		t.Fatalf("lookup of the first and last keys: %d (%v), want 2", n, err)
	}

	// Directories 0, 1 and 2 were forgotten (the bound is below dirs).
	for i := range 3 {
		if _, ok := e.own.dirs.known.Load(filepath.Join(dir, filepath.Dir(name(i)))); ok {
			t.Fatalf("%s is still remembered", filepath.Dir(name(i)))
		}
	}
	// Standing: stored into again (the first key's file replaced by
	// another's, as the policy names it).
	if k := store(0, dirs); k.Outcome != OutcomeStored {
		t.Errorf("store into the forgotten %s: %v (%v)", name(0), k.Outcome, k.Err)
	}
	// Removed: made again.
	if err := os.RemoveAll(filepath.Join(dir, "a", "1")); err != nil {
		t.Fatal(err)
	}
	if k := store(1, dirs+1); k.Outcome != OutcomeStored {
		t.Errorf("store into the forgotten, removed %s: %v (%v)", name(1), k.Outcome, k.Err)
	}
	if _, err := os.Stat(filepath.Join(dir, name(1))); err != nil {
		t.Errorf("the store into the forgotten, removed directory: %v", err)
	}
	// A link out of the mount: refused.
	d2 := filepath.Join(dir, "a", "2")
	if err := os.Rename(d2, d2+".old"); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, d2); err != nil {
		t.Fatal(err)
	}
	if k := store(2, dirs+2); k.Outcome != OutcomeFailed || !errors.Is(k.Err, ErrPolicy) {
		t.Errorf("store into the forgotten %s, now a link out of the mount: %v (%v), want failed with ErrPolicy", name(2), k.Outcome, k.Err)
	}
	if ents, _ := os.ReadDir(outside); len(ents) != 0 {
		t.Errorf("the store wrote outside its mount, through the link: %d names", len(ents))
	}
	if n := knownDirs(e); n > maxKnownDirs {
		t.Errorf("the engine remembers %d directories, want at most %d", n, maxKnownDirs)
	}
}
