//go:build invariants

package engine

import (
	"context"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"
)

// keyMirror is a KeySet that keeps what it is told, and counts the keys
// it was told to remove.
type keyMirror struct {
	mu      sync.Mutex
	keys    map[keyID]bool
	removed int
}

func newKeyMirror() *keyMirror { return &keyMirror{keys: map[keyID]bool{}} }

func (m *keyMirror) Add(fp uint64, key string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.keys[keyID{FP: fp, Key: key}] = true
}

func (m *keyMirror) Remove(fp uint64, key string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.keys, keyID{FP: fp, Key: key})
	m.removed++
}

// checkMirror fails unless m holds exactly the keys of e's index.
func checkMirror(t *testing.T, what string, e *Engine, m *keyMirror) {
	t.Helper()
	indexed := e.ix.Files().Keys()
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, k := range indexed {
		if !m.keys[k] {
			t.Errorf("%s: the index holds %q, the key set does not", what, k.Key)
		}
	}
	for k := range m.keys {
		if !slices.Contains(indexed, k) {
			t.Errorf("%s: the key set holds %q, the index does not", what, k.Key)
		}
	}
	if len(indexed) == 0 {
		t.Errorf("%s: the index is empty: nothing was compared", what)
	}
}

// TestKeySetFollowsTheIndexThroughEvictionDeletionDemotionAndRestart: the
// keys the engine reports to MirrorKeys's set are, after every kind of change,
// exactly the keys its index holds (the daemon's shared lookup table
// answers lookups from them).
func TestKeySetFollowsTheIndexThroughEvictionDeletionDemotionAndRestart(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := 4096 + g.KeyBytes()
	newTiered := tieredPolicies(t, nil)["native-tiered"]
	tests := []struct {
		name string
		cfg  func(hot, cold string) Config
	}{
		{"evicting one mount", func(hot, _ string) Config {
			return Config{Mounts: []Mount{{Path: hot, Capacity: 8 * fileLen, HighWatermark: 0.9, LowWatermark: 0.6}}, NewPolicy: testPolicies(1, 0)}
		}},
		{"demoting to a second mount", func(hot, cold string) Config {
			return Config{Mounts: []Mount{{Path: hot, Capacity: 8 * fileLen, HighWatermark: 0.9, LowWatermark: 0.6}, {Path: cold, DeviceClass: "network"}},
				NewPolicy: newTiered, TickInterval: 5 * time.Millisecond, MountUpdateInterval: 5 * time.Millisecond}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.cfg(t.TempDir(), t.TempDir())
			mirror := newKeyMirror()
			e := openEngine(t, cfg)
			e.MirrorKeys(mirror)
			ns, err := e.Declare(ctx, g)
			if err != nil {
				t.Fatal(err)
			}
			const n = 24
			c := newTestCache(t, e, ns, g, 4*n+4, layoutPlaneFirst)
			r := rand.New(rand.NewPCG(5, 6))
			keys := testKeys("keyset", n)
			blocks := blockLists(r, n, g.BlocksPerKey(), 0)
			for i := range keys {
				c.fill(r, blocks[i])
				storeAndCheck(t, e, c, keys[i:i+1], blocks[i:i+1])
			}
			checkMirror(t, "after stores", e, mirror)
			if st := e.Stats(); st.Evictions == 0 && e.TierStats().Demotions == 0 {
				t.Fatalf("stats %+v: nothing was evicted or demoted", st)
			}
			if _, err := e.Delete(ctx, ns, keys[n-2:]); err != nil {
				t.Fatal(err)
			}
			checkMirror(t, "after deletes", e, mirror)
			if err := e.Close(ctx); err != nil {
				t.Fatal(err)
			}
			restarted := newKeyMirror()
			e = openEngine(t, cfg)
			e.MirrorKeys(restarted)
			checkMirror(t, "after a restart", e, restarted)
		})
	}
}

// TestAMoveKeepsItsKeysInTheKeySet: a file moved to another mount keeps
// its keys in MirrorKeys's set throughout: the set is never told to
// remove them, not even for the moment between the source's unindexing
// and the copy's indexing, when a client reading the daemon's shared
// lookup table (whose misses may be final) would miss a stored key.
func TestAMoveKeepsItsKeysInTheKeySet(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}, {Path: t.TempDir()}},
		Policy: &demotingPolicy{testPolicy: newTestPolicy(2, 0)}})
	mirror := newKeyMirror()
	e.MirrorKeys(mirror)
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	keys := testKeys("moved", 2) // one file of both
	storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}})
	if _, err := e.tier.move(ctx, entryOf(e, ns, keys[0]).ID, 1, true); err != nil {
		t.Fatal(err)
	}
	if keyMount(e, ns, keys[0]) != 1 || keyMount(e, ns, keys[1]) != 1 {
		t.Fatal("the file was not moved")
	}
	mirror.mu.Lock()
	removed := mirror.removed
	mirror.mu.Unlock()
	if removed != 0 {
		t.Fatalf("the key set was told to remove %d keys of the moved file", removed)
	}
	checkMirror(t, "after the move", e, mirror)
}
