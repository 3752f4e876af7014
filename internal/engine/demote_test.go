//go:build invariants

package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"github.com/kvhost/kvhost/internal/testwait"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/plugins"
	"github.com/kvhost/kvhost/plugins/tiered"
)

// tieredPolicies returns constructors of the built-in tiered policy,
// native and (if plugins/wasm/tiered.wasm was built) in wasm.
func tieredPolicies(t testing.TB, params map[string]string) map[string]func(policy.Index) (policy.Policy, error) {
	cfg := policy.Config{Params: params, Logger: testLogger(t), Cache: sharedCompilationCache()}
	out := map[string]func(policy.Index) (policy.Policy, error){
		"native-tiered": func(idx policy.Index) (policy.Policy, error) {
			return policy.NewNative(func() guest.Policy { return tiered.New() }, idx, cfg)
		},
	}
	if mod, err := plugins.Wasm(tiered.Name); err == nil {
		out["wasm-tiered"] = func(idx policy.Index) (policy.Policy, error) {
			return policy.Open(context.Background(), mod, tiered.Name, idx, cfg)
		}
	} else {
		t.Logf("wasm tiered not built (%v): native only", err)
	}
	return out
}

// keyMount returns the mount of key's file in ns, or -1 if it is not
// indexed.
func keyMount(e *Engine, ns NamespaceID, key []byte) int {
	en := e.ix.Files().Get(e.tables.get(ns).fp, key)
	if en == nil {
		return -1
	}
	return en.Mount
}

// relFiles lists the published files under root, relative to it.
func relFiles(t testing.TB, root string) map[string]bool {
	out := map[string]bool{}
	for _, p := range dataFiles(t, root) {
		rel, _ := filepath.Rel(root, p)
		out[rel] = true
	}
	return out
}

// TestTieredDemotesAndPromotes runs the tiered policy over a small hot
// mount and a large cold one: under pressure the hot mount's least
// recently used files move to the cold mount (none is deleted, usage stays
// within the hot capacity and both mounts account their files); a cold key
// loaded twice moves back to the hot mount at the next tick; every key loads
// byte-equal from wherever it is, before and after a restart.
func TestTieredDemotesAndPromotes(t *testing.T) {
	for name, newPolicy := range tieredPolicies(t, map[string]string{"promote_hits": "2", "promote_window": "1m"}) {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			g := smallGeometry(true)
			fileLen := 4096 + g.KeyBytes()
			hot, cold := t.TempDir(), t.TempDir()
			mounts := []Mount{{Path: hot, Capacity: 8 * fileLen, HighWatermark: 0.9, LowWatermark: 0.6}, {Path: cold, DeviceClass: "network"}}
			cfg := Config{Mounts: mounts, NewPolicy: newPolicy, TickInterval: 5 * time.Millisecond, MountUpdateInterval: 5 * time.Millisecond}
			e := openEngine(t, cfg)
			ns, err := e.Declare(ctx, g)
			if err != nil {
				t.Fatal(err)
			}
			const n = 24
			c := newTestCache(t, e, ns, g, 4*n+4, layoutPlaneFirst)
			r := rand.New(rand.NewPCG(11, 12))
			keys := testKeys("tier", n)
			blocks := blockLists(r, n, g.BlocksPerKey(), 0)
			want := make([][]byte, n)
			for i := range keys {
				c.fill(r, blocks[i])
				want[i] = c.data(blocks[i])
				storeAndCheck(t, e, c, keys[i:i+1], blocks[i:i+1])
				if st := e.Stats(); st.Mounts[0].Used > 8*fileLen {
					t.Fatalf("key %d: %d bytes used on the hot mount of %d", i, st.Mounts[0].Used, 8*fileLen)
				}
			}
			ts := e.TierStats()
			st := e.Stats()
			if ts.Demotions == 0 || st.Evictions != 0 {
				t.Fatalf("%d demotions, %d deletions: want demotions only", ts.Demotions, st.Evictions)
			}
			// The demotions show in Stats, per mount too (issue 37).
			if st.Tiering.Demotions != ts.Demotions || st.Mounts[0].MovedOut < ts.Demotions || st.Mounts[1].MovedIn < ts.Demotions {
				t.Fatalf("Stats: tiering %+v, hot moved out %d, cold moved in %d; want %d demotions",
					st.Tiering, st.Mounts[0].MovedOut, st.Mounts[1].MovedIn, ts.Demotions)
			}
			if st.Entries != n || st.Mounts[0].Entries+st.Mounts[1].Entries != n {
				t.Fatalf("%d entries (hot %d, cold %d), want %d", st.Entries, st.Mounts[0].Entries, st.Mounts[1].Entries, n)
			}
			for i, m := range st.Mounts {
				if m.Used != int64(m.Entries)*fileLen {
					t.Errorf("mount %d: %d bytes used for %d files of %d", i, m.Used, m.Entries, fileLen)
				}
			}
			if m := keyMount(e, ns, keys[0]); m != 1 {
				t.Fatalf("the oldest key is on mount %d, want the cold mount 1", m)
			}
			if m := keyMount(e, ns, keys[n-1]); m != 0 {
				t.Fatalf("the newest key is on mount %d, want the hot mount 0", m)
			}
			for rel := range relFiles(t, hot) {
				if relFiles(t, cold)[rel] {
					t.Fatalf("%s is on both mounts", rel)
				}
			}
			into := blockLists(r, 1, g.BlocksPerKey(), 4*n)
			for i := range keys {
				loadAndCompare(t, e, c, keys[i:i+1], into, want[i:i+1])
			}
			// Every key was loaded once: the oldest one, on the cold mount, is
			// loaded once more and promoted at the next tick.
			loadAndCompare(t, e, c, keys[:1], into, want[:1])
			testwait.Until(t, "the promotion of the oldest key", testwait.Hang, func() bool { return keyMount(e, ns, keys[0]) == 0 && e.TierStats().Moves > 0 })
			if ts := e.TierStats(); ts.Ticks == 0 || ts.MountUpdates < 2 || ts.Promotions == 0 {
				t.Errorf("tier stats %+v: want ticks, several mount updates and a promotion", ts)
			}
			loadAndCompare(t, e, c, keys[:1], into, want[:1])
			if st := e.Stats(); st.Mounts[0].Used > 8*fileLen || st.Entries != n {
				t.Fatalf("after the promotion: hot %d bytes of %d, %d entries of %d", st.Mounts[0].Used, 8*fileLen, st.Entries, n)
			}

			if err := e.Close(ctx); err != nil {
				t.Fatal(err)
			}
			e = openEngine(t, cfg)
			if ns, err = e.Declare(ctx, g); err != nil {
				t.Fatal(err)
			}
			c = newTestCache(t, e, ns, g, 4*n+4, layoutPlaneFirst)
			if st := e.Stats(); st.Entries != n {
				t.Fatalf("after restart: %d entries, want %d", st.Entries, n)
			}
			for i := range keys {
				loadAndCompare(t, e, c, keys[i:i+1], into, want[i:i+1])
			}
		})
	}
}

// TestDemotionTargetFull: a demotion whose target has no room deletes the
// victim only when the policy said so (abi.MoveDeleteIfFull); otherwise the
// victim stays, and the store that needed the room fails with ErrNoSpace.
func TestDemotionTargetFull(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := 4096 + g.KeyBytes()
	for _, deleteIfFull := range []bool{true, false} {
		t.Run(fmt.Sprintf("deleteIfFull=%v", deleteIfFull), func(t *testing.T) {
			pol := &demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor), deleteIfFull: deleteIfFull}
			// The cold mount holds less than one file: every demotion finds it full.
			e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir(), Capacity: 4 * fileLen}, {Path: t.TempDir(), Capacity: fileLen / 2}}, Policy: pol})
			ns, err := e.Declare(ctx, g)
			if err != nil {
				t.Fatal(err)
			}
			c := newTestCache(t, e, ns, g, 64, layoutPlaneFirst)
			r := rand.New(rand.NewPCG(3, 4))
			keys := testKeys("full", 8)
			failed := 0
			for i := range keys {
				b := [][]int{{0, 1, 2, 3}}
				c.fill(r, b[0])
				res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys[i : i+1], Blocks: b}))
				if k := res.Keys[0]; k.Outcome == OutcomeFailed {
					if !errors.Is(k.Err, ErrNoSpace) {
						t.Fatalf("key %d: %v, want ErrNoSpace", i, k.Err)
					}
					failed++
				}
			}
			ts, st := e.TierStats(), e.Stats()
			if ts.Demotions != 0 || st.Mounts[1].Entries != 0 {
				t.Fatalf("%d demotions into a full mount", ts.Demotions)
			}
			if deleteIfFull {
				if failed != 0 || ts.DemotionDeletes == 0 || st.Evictions == 0 {
					t.Fatalf("%d failed stores, %d deletes instead of demotions: want none failed and some deleted", failed, ts.DemotionDeletes)
				}
			} else if failed == 0 || st.Evictions != 0 || st.Entries != 4 {
				t.Fatalf("%d failed stores, %d evictions, %d entries: want failures, no deletion, 4 entries", failed, st.Evictions, st.Entries)
			}
		})
	}
}

// TestADemotionOntoAFileAlreadyAtItsPath demotes a victim whose path on
// the cold mount already holds a file another node stored there (a cold
// mount shared by several nodes), indexed at Open: where that file holds
// the same key (stored before or after the victim: the index's key points
// at either), the victim's hot copy is dropped and the key loads from the
// cold file; where it holds another key (a policy naming two keys alike),
// the victim is deleted. Either way the victim leaves the hot mount at the
// first eviction there, no move fails, and the cold file is left as it
// was; a delete that found the victim's entry before it was dropped for
// the same key's file deletes the key there.
func TestADemotionOntoAFileAlreadyAtItsPath(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := 4096 + g.KeyBytes()
	for _, tc := range []struct {
		name       string
		other      string // the key of the other node's file; "": the victim's
		otherFirst bool   // the other node stores before the victim is stored
	}{
		{name: "same key stored after the victim"},
		{name: "same key stored before the victim", otherFirst: true},
		{name: "another key", other: "another"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sameKey := tc.other == ""
			hot, cold := t.TempDir(), t.TempDir()
			keys := testKeys("taken", 3) // keys[0] the victim; each store of the others evicts on the hot mount
			blocks := [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}}
			hotMount := Mount{Path: hot, Capacity: 2 * fileLen, HighWatermark: 0.9, LowWatermark: 0.5}
			open := func(mounts ...Mount) (*Engine, NamespaceID, *testCache) {
				e := openEngine(t, Config{Mounts: mounts, Policy: &demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}, NodeID: "a"})
				ns, err := e.Declare(ctx, g)
				if err != nil {
					t.Fatal(err)
				}
				return e, ns, newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
			}
			// The other node stores on the cold mount the same key, or
			// another key whose file then lies at the victim's path.
			other := keys[0]
			if !sameKey {
				other = []byte(tc.other)
			}
			storeOther := func() {
				b := openNode(t, cold, "b", nil, 1)
				keyContent(b.c, other, blocks[0])
				storeAndCheck(t, b.e, b.c, [][]byte{other}, blocks[:1])
				b.e.Close(ctx)
			}
			if tc.otherFirst {
				storeOther()
			}
			// The victim is stored on the hot mount alone: its store never
			// finds the other node's file.
			e, _, c := open(hotMount)
			keyContent(c, keys[0], blocks[0])
			want := [][]byte{c.data(blocks[0])}
			storeAndCheck(t, e, c, keys[:1], blocks[:1])
			e.Close(ctx)
			files := dataFiles(t, hot)
			if len(files) != 1 {
				t.Fatalf("%d files on the hot mount, want 1", len(files))
			}
			rel, _ := filepath.Rel(hot, files[0])
			taken := filepath.Join(cold, rel)
			if !tc.otherFirst {
				storeOther()
			}
			if !sameKey {
				if err := os.MkdirAll(filepath.Dir(taken), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.Rename(dataFiles(t, cold)[0], taken); err != nil {
					t.Fatal(err)
				}
			}
			before, err := os.Stat(taken)
			if err != nil {
				t.Fatal(err)
			}
			coldBytes, err := os.ReadFile(taken)
			if err != nil {
				t.Fatal(err)
			}

			e, ns, c := open(hotMount, Mount{Path: cold})
			if st := e.Stats(); st.Mounts[0].Entries != 1 || st.Mounts[1].Entries != 1 {
				t.Fatalf("indexed at Open: %d files on the hot mount, %d on the cold one; want 1 and 1: the test proves nothing", st.Mounts[0].Entries, st.Mounts[1].Entries)
			}
			victim := e.ix.Files().ByPath(files[0])
			storeAndCheck(t, e, c, keys[1:2], blocks[1:2])
			storeAndCheck(t, e, c, keys[2:3], blocks[2:3])
			ts, st := e.TierStats(), e.Stats()
			if relFiles(t, hot)[rel] || ts.MoveFailures != 0 {
				t.Fatalf("after two stores that evict on the hot mount: the victim's file there %v, %d moves failed (tier stats %+v); want it gone and none failed",
					relFiles(t, hot)[rel], ts.MoveFailures, ts)
			}
			if sameKey {
				if ts.Demotions != 2 || ts.DemotionDeletes != 0 || st.Evictions != 0 {
					t.Fatalf("%d demotions, %d deletes instead, %d evictions; want 2 demotions and nothing deleted", ts.Demotions, ts.DemotionDeletes, st.Evictions)
				}
				if m := keyMount(e, ns, keys[0]); m != 1 {
					t.Fatalf("the victim's key is on mount %d, want the cold mount 1", m)
				}
				loadAndCompare(t, e, c, keys[:1], [][]int{{12, 13, 14, 15}}, want)
			} else {
				if ts.Demotions != 1 || ts.DemotionDeletes != 1 || st.Evictions != 1 {
					t.Fatalf("%d demotions, %d deletes instead, %d evictions; want 1 demotion and the victim deleted", ts.Demotions, ts.DemotionDeletes, st.Evictions)
				}
				if n, err := e.Lookup(ctx, ns, keys[:1]); n != 0 || err != nil {
					t.Fatalf("Lookup of the deleted victim = %d, %v; want a miss", n, err)
				}
			}
			for i, m := range st.Mounts {
				if m.Used != int64(m.Entries)*fileLen {
					t.Errorf("mount %d: %d bytes used for %d files of %d", i, m.Used, m.Entries, fileLen)
				}
			}
			after, err := os.Stat(taken)
			if err != nil {
				t.Fatal(err)
			}
			if got, err := os.ReadFile(taken); err != nil || !os.SameFile(before, after) || !bytes.Equal(got, coldBytes) {
				t.Fatalf("the other node's file at %s was replaced or changed (%v)", taken, err)
			}
			if sameKey {
				if d := e.rm.dropUnpinned(ctx, victim, keys[0], nil, "deleted"); d.en == nil {
					t.Fatal("a delete through the victim's entry, found before the demotion, deleted nothing")
				}
				if n, _ := e.Lookup(ctx, ns, keys[:1]); n != 0 || len(dataFiles(t, cold)) != 1 {
					t.Fatalf("after the delete: Lookup = %d, cold files %v; want a miss and only the other key's demoted file", n, dataFiles(t, cold))
				}
			}
		})
	}
}

// demotingPolicy is testPolicy with demotion: every victim on mount 0 is
// demoted to mount 1.
type demotingPolicy struct {
	*testPolicy
	deleteIfFull bool
}

func (p *demotingPolicy) Features() abi.Feature { return p.testPolicy.Features() | abi.FeatureDemote }

func (p *demotingPolicy) Name(ctx context.Context, recs []abi.NameRecord) error {
	err := p.testPolicy.Name(ctx, recs)
	for i := range recs {
		recs[i].Mount = 0
	}
	return err
}

func (p *demotingPolicy) UpdateMounts(context.Context, []abi.MountRecord) error { return nil }

func (p *demotingPolicy) Tick(context.Context, abi.TickRequest, int) ([]abi.Move, error) {
	return nil, nil
}

func (p *demotingPolicy) Evictions(ctx context.Context, req abi.EvictRequest, max int) ([]policy.Eviction, error) {
	vs, err := p.Victims(ctx, req, max)
	out := make([]policy.Eviction, len(vs))
	for i, v := range vs {
		out[i] = policy.Eviction{Victim: v, Target: abi.VictimTarget{Mount: abi.NoMount}}
		if req.Mount == 0 {
			out[i].Target.Mount = 1
			if p.deleteIfFull {
				out[i].Target.Flags = abi.MoveDeleteIfFull
			}
		}
	}
	return out, err
}

// twoCopies stores one key on mount hot and copies its file to the same
// path under cold, as a move killed between its rename and the removal of
// its source leaves it. It returns the key, its bytes and the file's.
func twoCopies(t *testing.T, hot, cold string) (keys, want, data [][]byte) {
	t.Helper()
	ctx := context.Background()
	g := smallGeometry(true)
	e := openEngine(t, Config{Mounts: []Mount{{Path: hot}}, Policy: newTestPolicy(1, abi.OrderLayerMajor)})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	keys = testKeys("dup", 1)
	b := [][]int{{0, 1, 2, 3}}
	c.fill(rand.New(rand.NewPCG(1, 2)), b[0])
	want = [][]byte{c.data(b[0])}
	storeAndCheck(t, e, c, keys, b)
	e.Close(ctx)
	files := dataFiles(t, hot)
	if len(files) != 1 {
		t.Fatalf("%d files", len(files))
	}
	rel, _ := filepath.Rel(hot, files[0])
	file, err := os.ReadFile(files[0])
	if err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(cold, rel)
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dst, file, 0o644); err != nil {
		t.Fatal(err)
	}
	return keys, want, [][]byte{file}
}

// TestDedupeAtOpen: two copies of one file on two mounts (a move killed
// between its rename and the removal of its source) become one at Open:
// one copy is kept, the key loads, the mounts account one file.
func TestDedupeAtOpen(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	hot, cold := t.TempDir(), t.TempDir()
	keys, want, files := twoCopies(t, hot, cold)
	data := files[0]

	e := openEngine(t, Config{Mounts: []Mount{{Path: hot}, {Path: cold}}, Policy: newTestPolicy(1, abi.OrderLayerMajor)})
	if ts := e.TierStats(); ts.Deduped != 1 {
		t.Fatalf("%d copies removed, want 1", ts.Deduped)
	}
	// The newer copy is kept; file times are coarse (a clock tick), so
	// the two may tie, and then the one on the first mount is kept.
	kept := 1
	if len(dataFiles(t, cold)) == 0 {
		kept = 0
	}
	if len(dataFiles(t, hot))+len(dataFiles(t, cold)) != 1 {
		t.Fatalf("files: hot %v, cold %v; want one copy", dataFiles(t, hot), dataFiles(t, cold))
	}
	if st := e.Stats(); st.Entries != 1 || st.Mounts[kept].Used != int64(len(data)) || st.Mounts[1-kept].Used != 0 {
		t.Fatalf("stats %+v: want one entry, on mount %d", st.Mounts, kept)
	}
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	loadAndCompare(t, e, c, keys, [][]int{{4, 5, 6, 7}}, want)
}

// TestDedupeCountsACopyItCouldNotRemove: where the removal of the second
// copy fails at Open, the copy is one of the files left on disk: its
// mount counts its bytes as used, and an eviction there removes it.
func TestDedupeCountsACopyItCouldNotRemove(t *testing.T) {
	ctx := context.Background()
	hot, cold := t.TempDir(), t.TempDir()
	_, _, files := twoCopies(t, hot, cold)
	size := int64(len(files[0]))
	var failing atomic.Bool
	failing.Store(true)
	inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if op == fsys.OpRemove && failing.Load() && !strings.HasPrefix(filepath.Base(path), ".") {
			return fsys.Fault{Err: syscall.EIO}
		}
		return fsys.Fault{}
	})
	e := openEngine(t, Config{Mounts: []Mount{{Path: hot}, {Path: cold}}, FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj},
		Policy: newTestPolicy(1, abi.OrderLayerMajor)})
	st := e.Stats()
	if st.Entries != 1 || st.Mounts[0].Used != size || st.Mounts[1].Used != size {
		t.Fatalf("%d entries, used %d and %d; want one entry and the %d bytes of each copy counted",
			st.Entries, st.Mounts[0].Used, st.Mounts[1].Used, size)
	}
	if e.TierStats().Deduped != 0 || st.RemoveFailures != 1 || len(dataFiles(t, hot))+len(dataFiles(t, cold)) != 2 {
		t.Fatalf("deduped %d, %d removals failed, files: hot %v, cold %v; want 0 (none removed), 1 and both copies left",
			e.TierStats().Deduped, st.RemoveFailures, dataFiles(t, hot), dataFiles(t, cold))
	}
	dropped := -1
	for _, en := range e.ix.Leaving().LeftOnDisk() {
		dropped = en.Mount
	}
	if dropped < 0 {
		t.Fatal("no file left on disk")
	}
	failing.Store(false)
	_, _ = e.capacity.evict(ctx, e.mounts[dropped], 0) // tries the files left first
	if len(dataFiles(t, hot))+len(dataFiles(t, cold)) != 1 || e.Stats().Mounts[dropped].Used != 0 {
		t.Fatalf("after an eviction: files hot %v, cold %v, used %d; want the copy left removed",
			dataFiles(t, hot), dataFiles(t, cold), e.Stats().Mounts[dropped].Used)
	}
}

// TestMountDescriptions: the policy receives every mount's description at
// Open (capacity, watermarks, class, file system, backend) and an update
// once usage changes; Stats names each mount's class.
func TestMountDescriptions(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := 4096 + g.KeyBytes()
	pol := &recordingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}
	dirs := []string{t.TempDir(), t.TempDir()}
	e := openEngine(t, Config{Mounts: []Mount{{Path: dirs[0], Capacity: 10 * fileLen, DeviceClass: "nvme"}, {Path: dirs[1], Capacity: 20 * fileLen, DeviceClass: "network"}},
		Policy: pol, MountUpdateInterval: time.Millisecond})
	first := pol.last()
	if len(first) != 2 {
		t.Fatalf("%d mount records at Open, want 2", len(first))
	}
	for i, want := range []struct {
		capacity int64
		class    uint32
	}{{10 * fileLen, abi.ClassNVMe}, {20 * fileLen, abi.ClassNetwork}} {
		r := first[i]
		if r.Mount != uint32(i) || r.Capacity != uint64(want.capacity) || r.Class != want.class || r.Used != 0 || r.Free != r.Capacity ||
			r.High != uint64(float64(want.capacity)*0.95) || r.FSType == 0 || r.BackendString() != "staging" {
			t.Errorf("mount %d: %+v (fs %q, backend %q)", i, r, r.FSNameString(), r.BackendString())
		}
	}
	for i, want := range []string{"nvme", "network"} {
		if got := e.Stats().Mounts[i].Class; got != want {
			t.Errorf("Stats: mount %d class %q, want %q", i, got, want)
		}
	}
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	storeAndCheck(t, e, c, testKeys("desc", 1), [][]int{{0, 1, 2, 3}})
	testwait.Until(t, "a mount update with the stored file", testwait.Hang, func() bool {
		l := pol.last()
		return len(l) == 2 && l[0].Entries+l[1].Entries == 1 && l[0].Used+l[1].Used == uint64(fileLen)
	})
}

// recordingPolicy is testPolicy that keeps the mount descriptions.
type recordingPolicy struct {
	*testPolicy
	mounts atomic.Pointer[[]abi.MountRecord]
}

func (p *recordingPolicy) UpdateMounts(_ context.Context, recs []abi.MountRecord) error {
	c := append([]abi.MountRecord(nil), recs...)
	p.mounts.Store(&c)
	return nil
}

func (p *recordingPolicy) last() []abi.MountRecord {
	if m := p.mounts.Load(); m != nil {
		return *m
	}
	return nil
}

func (p *recordingPolicy) Evictions(ctx context.Context, req abi.EvictRequest, max int) ([]policy.Eviction, error) {
	return nil, errors.New("recordingPolicy: no FeatureDemote, Evictions must not be called")
}

func (p *recordingPolicy) Tick(context.Context, abi.TickRequest, int) ([]abi.Move, error) {
	return nil, errors.New("recordingPolicy: no FeatureTick, Tick must not be called")
}

// TestAdmissionChoosesMount: a policy with abi.FeatureAdmitMount sends a
// file to another mount than its name's; the file is stored and loads from
// there, at the same relative path.
func TestAdmissionChoosesMount(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	hot, cold := t.TempDir(), t.TempDir()
	pol := &redirectingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}
	e := openEngine(t, Config{Mounts: []Mount{{Path: hot}, {Path: cold}}, Policy: pol})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	keys := testKeys("adm", 2)
	b := [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}}
	r := rand.New(rand.NewPCG(5, 6))
	c.fill(r, b[0])
	c.fill(r, b[1])
	want := [][]byte{c.data(b[0]), c.data(b[1])}
	storeAndCheck(t, e, c, keys, b)
	for _, k := range keys {
		if m := keyMount(e, ns, k); m != 1 {
			t.Fatalf("key %s on mount %d, want 1 (admission's choice)", k, m)
		}
	}
	if len(dataFiles(t, hot)) != 0 || len(dataFiles(t, cold)) != 2 {
		t.Fatalf("files: hot %v, cold %v", dataFiles(t, hot), dataFiles(t, cold))
	}
	loadAndCompare(t, e, c, keys, [][]int{{8, 9, 10, 11}, {12, 13, 14, 15}}, want)
}

// redirectingPolicy names every key on mount 0 and admits it to mount 1.
type redirectingPolicy struct{ *testPolicy }

func (p *redirectingPolicy) Features() abi.Feature {
	return p.testPolicy.Features() | abi.FeatureAdmitMount
}

func (p *redirectingPolicy) Name(ctx context.Context, recs []abi.NameRecord) error {
	err := p.testPolicy.Name(ctx, recs)
	for i := range recs {
		recs[i].Mount = 0
	}
	return err
}

func (p *redirectingPolicy) Admit(ctx context.Context, recs []abi.AdmitRecord) error {
	err := p.testPolicy.Admit(ctx, recs)
	for i := range recs {
		recs[i].Target = 1
	}
	return err
}

// The demotion crash test: a child process stores (and loads, for
// promotions) through the tiered policy over a small hot mount and a cold
// one, and is killed at a point of a move: while copying, before the
// rename that publishes the copy, before the removal of the source, or at
// a random time.
const demoteChildEnv = "KVHOST_ENGINE_DEMOTE_CHILD"

// Kill points of demoteChild (KVHOST_ENGINE_DEMOTE_CHILD_KILL).
const (
	killCopy    = "copy"    // a write of a copy on the cold mount
	killPublish = "publish" // the rename of a copy onto the cold mount
	killRemove  = "remove"  // the removal of a moved file's source
	killRandom  = "random"  // the parent kills at a random time
)

func demoteMounts(dir string, fileLen int64) []Mount {
	return []Mount{{Path: filepath.Join(dir, "hot"), Capacity: 6 * fileLen, HighWatermark: 0.9, LowWatermark: 0.5}, {Path: filepath.Join(dir, "cold")}}
}

func demoteGeometry() Geometry {
	g := smallGeometry(true)
	g.Layers = 16 // 512 KiB per key
	return g
}

// demoteChild stores two keys per batch in a loop, printing each batch it
// saw stored, and loads an older key twice every third batch (a
// promotion), until it is killed. With a kill point it kills itself
// (SIGKILL) at the nth operation of that kind.
func demoteChild(dir string, start int, kill string, nth int) error {
	ctx := context.Background()
	g := demoteGeometry()
	cold := filepath.Join(dir, "cold") + string(filepath.Separator)
	hot := filepath.Join(dir, "hot") + string(filepath.Separator)
	var seen atomic.Int64
	die := func() {
		if seen.Add(1) == int64(nth) {
			syscall.Kill(os.Getpid(), syscall.SIGKILL)
		}
	}
	inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		name := filepath.Base(path)
		switch {
		case kill == killCopy && op == fsys.OpWrite && strings.HasPrefix(path, cold) && strings.HasPrefix(name, tmpPrefix):
			die()
		case kill == killPublish && op == fsys.OpRename && strings.HasPrefix(path, cold):
			die()
		case kill == killRemove && op == fsys.OpRemove && strings.HasPrefix(path, hot) && !strings.HasPrefix(name, "."):
			die()
		}
		return fsys.Fault{}
	})
	params := map[string]string{"promote_hits": "2", "promote_window": "1m"}
	e, err := testOpen(ctx, Config{Mounts: demoteMounts(dir, 4096+g.KeyBytes()), FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}, IOWorkers: 2,
		TickInterval: 2 * time.Millisecond, NewPolicy: func(idx policy.Index) (policy.Policy, error) {
			return policy.NewNative(func() guest.Policy { return tiered.New() }, idx, policy.Config{Params: params})
		}})
	if err != nil {
		return err
	}
	fmt.Printf("deduped %d\n", e.TierStats().Deduped)
	c, err := childCache(ctx, e, g, 24)
	if err != nil {
		return err
	}
	bpk := g.BlocksPerKey()
	return storeBatches(ctx, e, c, "demote", 2, 2, start, func(batch int) {
		if batch%3 == 0 && batch-start >= 6 {
			old := testKeys(fmt.Sprintf("demote-%d", batch-6), 1)
			for range 2 {
				if j, err := e.Load(ctx, LoadRequest{Cache: c.id, Keys: old, Blocks: [][]int{blockLists(rand.New(rand.NewPCG(1, 1)), 1, bpk, 4*bpk)[0]}}); err == nil {
					j.Wait(ctx)
				}
			}
		}
	})
}

// TestCrashMidDemotion kills (SIGKILL) a process that stores through the
// tiered policy while it demotes (and promotes): at a write of a copy,
// before the rename that publishes it, before the removal of the source,
// and at random times. Afterwards Open leaves no temporary file and no file
// on both mounts, and every key the child saw stored loads byte-equal.
func TestCrashMidDemotion(t *testing.T) {
	dir := t.TempDir()
	g := demoteGeometry()
	stored := -1
	modes := []string{killCopy, killPublish, killRemove, killRandom}
	killedAt := map[string]int{}
	onBoth := 0 // files the last round left on both mounts
	for round := range 12 {
		mode := modes[round%len(modes)]
		nth := 1 + rand.IntN(4)
		cmd, sc, stderr := startChild(t, demoteChildEnv+"="+dir, fmt.Sprintf("%s_START=%d", demoteChildEnv, stored+1),
			demoteChildEnv+"_KILL="+mode, fmt.Sprintf("%s_NTH=%d", demoteChildEnv, nth))
		timer := time.AfterFunc(60*time.Second, func() { cmd.Process.Kill() })
		// The child's Open removes every second copy the last kill left.
		if !sc.Scan() {
			t.Fatalf("round %d: the child did not open: %s", round, stderr.String())
		}
		if n, err := strconv.Atoi(strings.TrimPrefix(sc.Text(), "deduped ")); err != nil || n < onBoth {
			t.Fatalf("round %d: the child's Open says %q; %d files were on both mounts", round, sc.Text(), onBoth)
		}
		if mode == killRandom {
			scanStored(sc, &stored, 1)
			time.Sleep(time.Duration(rand.IntN(20000)) * time.Microsecond)
			cmd.Process.Signal(syscall.SIGKILL)
		}
		scanStored(sc, &stored, -1)
		err := cmd.Wait()
		if !timer.Stop() {
			t.Fatalf("round %d (%s): the child never reached its kill point in 60s: %s", round, mode, stderr.String())
		}
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
			t.Fatalf("round %d (%s): child ended with %v, not SIGKILL: %s", round, mode, err, stderr.String())
		}
		killedAt[mode]++
		hot, cold := relFiles(t, filepath.Join(dir, "hot")), relFiles(t, filepath.Join(dir, "cold"))
		both := 0
		for rel := range hot {
			if cold[rel] {
				both++
			}
		}
		switch tmp := len(leftovers(t, filepath.Join(dir, "cold"))); {
		case (mode == killCopy || mode == killPublish) && tmp == 0:
			t.Fatalf("round %d: killed at %s, but no copy in progress on the cold mount", round, mode)
		case mode == killRemove && both == 0:
			t.Fatalf("round %d: killed before removing a moved file's source, but no file is on both mounts", round)
		}
		onBoth = both
		t.Logf("round %d: killed at %s #%d after batch %d; temporary files: %d", round, mode, nth, stored, len(leftovers(t, dir)))
	}
	if stored < 0 {
		t.Fatal("the children stored nothing")
	}

	ctx := context.Background()
	e := openEngine(t, Config{Mounts: demoteMounts(dir, 4096+g.KeyBytes()), NewPolicy: tieredPolicies(t, nil)["native-tiered"]})
	if l := leftovers(t, dir); len(l) != 0 {
		t.Fatalf("temporary files after Open: %v", l)
	}
	hot, cold := relFiles(t, filepath.Join(dir, "hot")), relFiles(t, filepath.Join(dir, "cold"))
	for rel := range hot {
		if cold[rel] {
			t.Fatalf("%s is on both mounts after Open", rel)
		}
	}
	if len(cold) == 0 {
		t.Fatal("nothing was demoted")
	}
	st := e.Stats()
	if st.Entries != len(hot)+len(cold) || st.Keys != st.Entries {
		t.Fatalf("%d + %d files, the index has %d entries and %d keys", len(hot), len(cold), st.Entries, st.Keys)
	}
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	want := newTestCache(t, e, ns, g, 8, layoutPlaneFirst)
	bpk := g.BlocksPerKey()
	blocks := []int{0, 1, 2, 3}[:bpk]
	loaded := 0
	for batch := 0; batch <= stored; batch++ {
		for _, k := range testKeys(fmt.Sprintf("demote-%d", batch), 2) {
			res := wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: [][]byte{k}, Blocks: [][]int{blocks}}))
			wantOutcomes(t, fmt.Sprintf("load of %s (batch %d, reported stored)", k, batch), res, OutcomeLoaded)
			keyContent(want, k, blocks)
			if !bytes.Equal(c.data(blocks), want.data(blocks)) {
				t.Fatalf("key %s: loaded bytes differ", k)
			}
			loaded++
		}
	}
	t.Logf("kills %v, %d keys loaded byte-equal, %d on the hot mount, %d on the cold one", killedAt, loaded, len(hot), len(cold))
}

// TestLoadsDuringDemotions looks up and loads stored keys in a loop while
// stores demote files to the cold mount: a lookup or load never misses a
// stored key (a key whose file moved between its lookup and its check or
// pin is found at the new place; a pinned file is not moved) and a load
// always gets its bytes. Every lookup checks the file (VerifyInterval 0).
// A store the loads' pins refuse room is stored once they let a file go
// (storeBesideLoads).
func TestLoadsDuringDemotions(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := 4096 + g.KeyBytes()
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir(), Capacity: 4 * fileLen, HighWatermark: 0.9, LowWatermark: 0.5}, {Path: t.TempDir()}},
		NewPolicy: tieredPolicies(t, nil)["native-tiered"]})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	const n = 40
	c := newTestCache(t, e, ns, g, 4*n+8, layoutPlaneFirst)
	keys := testKeys("busy", n)
	blocks := blockLists(rand.New(rand.NewPCG(7, 7)), n, g.BlocksPerKey(), 0)
	want := make([][]byte, n)
	for i := range keys {
		keyContent(c, keys[i], blocks[i])
		want[i] = c.data(blocks[i])
	}
	storeAndCheck(t, e, c, keys[:2], blocks[:2])
	var stored atomic.Int64
	stored.Store(2)
	done := make(chan struct{})
	loadErr := make(chan error, 1)
	stopped := false
	stop := func() error {
		stopped = true
		close(done)
		return <-loadErr
	}
	defer func() {
		if !stopped {
			stop() // a failed store: the loader ends before the cache goes
		}
	}()
	go func() {
		defer close(loadErr)
		into := [][]int{{4 * n, 4*n + 1, 4*n + 2, 4*n + 3}}
		r := rand.New(rand.NewPCG(8, 8))
		for {
			select {
			case <-done:
				return
			default:
			}
			i := r.IntN(int(stored.Load()))
			if n, err := e.Lookup(ctx, ns, keys[i:i+1]); n != 1 || err != nil {
				loadErr <- fmt.Errorf("lookup of stored key %d: %d, %v", i, n, err)
				return
			}
			j, err := e.Load(ctx, LoadRequest{Cache: c.id, Keys: keys[i : i+1], Blocks: into})
			if err == nil {
				var res Result
				if res, err = j.Wait(ctx); err == nil && res.Keys[0].Outcome != OutcomeLoaded {
					err = fmt.Errorf("load of stored key %d: %v (%v)", i, res.Keys[0].Outcome, res.Keys[0].Err)
				}
			}
			if err == nil && !bytes.Equal(c.data(into[0]), want[i]) {
				err = fmt.Errorf("load of stored key %d: bytes differ", i)
			}
			if err != nil {
				loadErr <- err
				return
			}
		}
	}()
	refused := 0
	for i := 2; i < n; i++ {
		refused += storeBesideLoads(t, e, c, keys[i], blocks[i])
		stored.Store(int64(i + 1))
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if ts := e.TierStats(); ts.Demotions < n/2 {
		t.Fatalf("%d demotions of %d keys on a mount of 4 files", ts.Demotions, n)
	}
	t.Logf("%d stores refused room while loads pinned the files their demotions moved", refused)
}

// storeBesideLoads stores key (its blocks) while loads of the stored keys
// run, and returns how many times the store was refused room first. The
// loads pin the few files of a small hot mount one after another, and a
// file a load pins is not moved: a demotion whose source a load pins
// during its copy drops the copy. Where the loads pinned every file an
// eviction tried to demote, nothing is freed and the store fails with
// ErrNoSpace, as it must; it is stored again once the loads let a file
// go. Any other outcome fails the test.
func storeBesideLoads(t *testing.T, e *Engine, c *testCache, key []byte, blocks []int) (refused int) {
	t.Helper()
	testwait.Until(t, fmt.Sprintf("room for the store of %q beside the loads", key), testwait.Hang, func() bool {
		res := wait(t)(e.Store(context.Background(), StoreRequest{Cache: c.id, Keys: [][]byte{key}, Blocks: [][]int{blocks}}))
		switch k := res.Keys[0]; {
		case k.Outcome == OutcomeStored:
			return true
		case k.Outcome == OutcomeFailed && errors.Is(k.Err, ErrNoSpace):
			refused++
			return false
		default:
			t.Fatalf("store of %q: %v (%v), want stored, or refused room while loads pin the files", key, k.Outcome, k.Err)
			return false
		}
	})
	return refused
}

// TestAStoreWhoseDemotionsPinsOvertakeIsRefusedRoomUntilTheyEnd pins
// each file of a full hot mount while its demotion copies it, as a load
// does that comes then: a pinned file is not moved, so each copy is
// dropped and the eviction frees nothing. The store fails with
// ErrNoSpace, with no move failed and no copy left on the cold mount;
// once the pins end, the store is stored (what TestLoadsDuringDemotions's
// stores wait for).
func TestAStoreWhoseDemotionsPinsOvertakeIsRefusedRoomUntilTheyEnd(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := 4096 + g.KeyBytes()
	var (
		e      *Engine
		ns     NamespaceID
		mu     sync.Mutex
		toPin  = map[string][]byte{} // a hot file's path -> its key, pinned when a copy opens it
		pinned []PinID
	)
	inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if op != fsys.OpOpen {
			return fsys.Fault{}
		}
		mu.Lock()
		key, ok := toPin[path]
		delete(toPin, path) // the pin's own opening of the file is no copy's
		mu.Unlock()
		if ok {
			id, got, err := e.Pin(ctx, ns, [][]byte{key}, 0)
			if err != nil || !got[0] {
				t.Errorf("pin of %q during its demotion: %v, %v", key, got, err)
			}
			mu.Lock()
			pinned = append(pinned, id)
			mu.Unlock()
		}
		return fsys.Fault{}
	})
	cold := t.TempDir()
	e = openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir(), Capacity: 4 * fileLen, HighWatermark: 0.9, LowWatermark: 0.5}, {Path: cold}},
		FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}, TickInterval: -1, NewPolicy: tieredPolicies(t, nil)["native-tiered"]})
	var err error
	if ns, err = e.Declare(ctx, g); err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	blocks := [][]int{{0, 1, 2, 3}}
	c.fill(rand.New(rand.NewPCG(9, 9)), blocks[0])
	keys := testKeys("overtaken", 5)
	armAll := func(ks [][]byte) {
		mu.Lock()
		defer mu.Unlock()
		for _, k := range ks {
			toPin[entryOf(e, ns, k).Path] = k
		}
	}
	store := func(k []byte) KeyResult {
		return wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: [][]byte{k}, Blocks: blocks})).Keys[0]
	}
	for _, k := range keys[:3] { // 3 files: below the high watermark (3.6)
		storeAndCheck(t, e, c, [][]byte{k}, blocks)
	}
	// The fourth file's eviction demotes two, each pinned during its
	// copy: nothing is freed, and the file fits below the capacity.
	armAll(keys[:3])
	if k := store(keys[3]); k.Outcome != OutcomeStored {
		t.Fatalf("store of the fourth file: %v (%v), want stored below the capacity", k.Outcome, k.Err)
	}
	// The fifth's eviction finds the two files left unpinned, and each is
	// pinned during its copy: no room.
	armAll(keys[2:4])
	k := store(keys[4])
	if k.Outcome != OutcomeFailed || !errors.Is(k.Err, ErrNoSpace) {
		t.Fatalf("store of a fifth file on a hot mount of 4, each file pinned during its demotion: %v (%v), want ErrNoSpace", k.Outcome, k.Err)
	}
	mu.Lock()
	n := len(pinned)
	mu.Unlock()
	if n != 4 {
		t.Fatalf("%d files pinned during their demotions, want 4: the test proves nothing", n)
	}
	if ts := e.TierStats(); ts.Demotions != 0 || ts.MoveFailures != 0 {
		t.Fatalf("%d demotions, %d move failures; want none: a move whose file a pin overtook is dropped, and is no failure", ts.Demotions, ts.MoveFailures)
	}
	if left := dataFiles(t, cold); len(left) != 0 {
		t.Fatalf("copies left on the cold mount: %v", left)
	}
	for _, id := range pinned {
		if n := e.Unpin(ctx, id); n != 1 {
			t.Fatalf("unpin of %d let %d files go, want 1", id, n)
		}
	}
	if k := store(keys[4]); k.Outcome != OutcomeStored {
		t.Fatalf("store of the fifth file once the pins ended: %v (%v), want stored", k.Outcome, k.Err)
	}
	if ts := e.TierStats(); ts.Demotions == 0 {
		t.Fatal("the fifth file was stored with no demotion")
	}
}

// TestLookupDuringMove moves a key's file to the other mount between the
// lookup's index read and its check of the file (the check's stat runs the
// move first): the lookup still hits, at the new place, and nothing counts
// the file as vanished.
func TestLookupDuringMove(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	var (
		e     *Engine
		armed atomic.Pointer[entry]
		moved atomic.Bool
	)
	inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if en := armed.Load(); op == fsys.OpStat && en != nil && path == en.Path && armed.CompareAndSwap(en, nil) {
			_, err := e.tier.move(ctx, en.ID, 1, true)
			moved.Store(err == nil)
		}
		return fsys.Fault{}
	})
	e = openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}, {Path: t.TempDir()}}, FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj},
		Policy: &demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	keys := testKeys("mid", 1)
	storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}})
	en := e.ix.Files().Get(e.tables.get(ns).fp, keys[0])
	armed.Store(en)
	if n, err := e.Lookup(ctx, ns, keys); n != 1 || err != nil {
		t.Fatalf("lookup during a move: %d, %v; want a hit", n, err)
	}
	if !moved.Load() || keyMount(e, ns, keys[0]) != 1 {
		t.Fatalf("the move did not happen (moved %v, mount %d)", moved.Load(), keyMount(e, ns, keys[0]))
	}
	if st := e.Stats(); st.Vanished != 0 || st.Entries != 1 {
		t.Fatalf("%d vanished, %d entries; want 0 and 1", st.Vanished, st.Entries)
	}
}

// TestDeleteDuringMove deletes a key while its file is being moved (after
// the copy, before its rename): the delete wins, and neither the source
// nor the copy survives on any mount.
func TestDeleteDuringMove(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	hot, cold := t.TempDir(), t.TempDir()
	var (
		e       *Engine
		armed   atomic.Bool
		deleted atomic.Int64
		ns      NamespaceID
	)
	keys := testKeys("del", 1)
	inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if op == fsys.OpRename && strings.HasPrefix(path, cold) && armed.CompareAndSwap(true, false) {
			n, _ := e.Delete(ctx, ns, keys)
			deleted.Store(int64(n))
		}
		return fsys.Fault{}
	})
	e = openEngine(t, Config{Mounts: []Mount{{Path: hot}, {Path: cold}}, FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj},
		Policy: &demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}})
	var err error
	if ns, err = e.Declare(ctx, g); err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}})
	id := e.ix.Files().Get(e.tables.get(ns).fp, keys[0]).ID
	armed.Store(true)
	if _, err := e.tier.move(ctx, id, 1, true); !errors.Is(err, errMoveStale) {
		t.Fatalf("move of a file deleted during it: %v, want errMoveStale", err)
	}
	if deleted.Load() != 1 {
		t.Fatalf("the delete during the move removed %d keys, want 1", deleted.Load())
	}
	if f := append(dataFiles(t, hot), dataFiles(t, cold)...); len(f) != 0 {
		t.Fatalf("files left after the delete: %v", f)
	}
	if l := append(leftovers(t, hot), leftovers(t, cold)...); len(l) != 0 {
		t.Fatalf("temporary files left: %v", l)
	}
	if st := e.Stats(); st.Entries != 0 || st.Mounts[0].Used != 0 || st.Mounts[1].Used != 0 {
		t.Fatalf("stats after the delete: %d entries, used %d and %d", st.Entries, st.Mounts[0].Used, st.Mounts[1].Used)
	}
	if n, _ := e.Lookup(ctx, ns, keys); n != 0 {
		t.Fatal("the deleted key is found")
	}
}

// TestMovesCopyInWholeLargeFolios: a move onto a mount whose writes
// allocate large folios (a tmpfs with huge pages) copies the file in
// pieces of the folio, so that no folio is first written in part; onto
// one without, in pieces of copyChunk. The moved key loads byte-equal.
func TestMovesCopyInWholeLargeFolios(t *testing.T) {
	ctx := context.Background()
	// 4 MiB of payload behind a 4 KiB header.
	g := Geometry{Model: "test/folio", Layers: 4, KVHeads: 16, HeadSize: 64, DtypeSize: 2, TokensPerBlock: 16, TokensPerKey: 256, TPSize: 1}
	blocks := make([]int, 16)
	for i := range blocks {
		blocks[i] = i
	}
	for _, folio := range []int64{0, 2 << 20} {
		hot, cold := t.TempDir(), t.TempDir()
		var writes atomic.Int64
		inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
			if op == fsys.OpWrite && strings.HasPrefix(path, cold+string(filepath.Separator)) {
				writes.Add(1)
			}
			return fsys.Fault{}
		})
		e := openEngine(t, Config{Mounts: []Mount{{Path: hot}, {Path: cold}}, FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj},
			Policy: newTestPolicy(1, abi.OrderLayerMajor)})
		e.mounts[1].folio = folio // as openMount finds on a tmpfs with huge pages
		ns, err := e.Declare(ctx, g)
		if err != nil {
			t.Fatal(err)
		}
		c := newTestCache(t, e, ns, g, 32, layoutPlaneFirst)
		c.fill(rand.New(rand.NewPCG(5, 5)), blocks)
		want := c.data(blocks)
		keys := testKeys("folio-move", 1)
		storeAndCheck(t, e, c, keys, [][]int{blocks})
		en := e.ix.Files().Get(e.tables.get(ns).fp, keys[0])
		id, size := en.ID, en.Size
		writes.Store(0) // the start's O_DIRECT probe wrote there too
		if _, err := e.tier.move(ctx, id, 1, true); err != nil {
			t.Fatalf("folio %d: move: %v", folio, err)
		}
		if keyMount(e, ns, keys[0]) != 1 {
			t.Fatalf("folio %d: the key is on mount %d after the move, want 1", folio, keyMount(e, ns, keys[0]))
		}
		piece := max(int64(copyChunk), folio)
		if n, wantN := writes.Load(), (size+piece-1)/piece; n != wantN {
			t.Fatalf("folio %d: the move wrote a %d-byte file in %d writes, want %d of up to %d bytes", folio, size, n, wantN, piece)
		}
		into := make([]int, 16)
		for i := range into {
			into[i] = 16 + i
		}
		loadAndCompare(t, e, c, keys, [][]int{into}, [][]byte{want})
	}
}

// TestCopyBuffersHaveTheSizeAskedAndAreNeverShared: a move's copy
// buffer has the length it asked for whatever buffers earlier moves gave
// back, and two moves at once never share one.
func TestCopyBuffersHaveTheSizeAskedAndAreNeverShared(t *testing.T) {
	var bufs buffers
	for _, sizes := range [][]int64{{1 << 20, 1 << 20}, {4096, 1 << 20}, {2 << 20, 4096}, {1, 2 << 20}} {
		a, putA := bufs.copyBuffer(sizes[0])
		b, putB := bufs.copyBuffer(sizes[1])
		if int64(len(a)) != sizes[0] || int64(len(b)) != sizes[1] {
			t.Fatalf("sizes %v: buffers of %d and %d bytes", sizes, len(a), len(b))
		}
		a[0], b[0] = 1, 2
		if a[0] != 1 {
			t.Fatalf("sizes %v: two moves at once share a buffer", sizes)
		}
		putA()
		putB()
	}
}

// moveTrap moves the file of the armed entry to mount 1 at the first file
// operation its trigger accepts, once; moved says whether that move
// succeeded.
type moveTrap struct {
	armed atomic.Pointer[entry]
	moved atomic.Bool
}

// movingEngine is injectedEngine on mounts hot and cold with a demoting
// policy, its file system springing the returned trap.
func movingEngine(t *testing.T, hot, cold string, trigger func(op fsys.Op, path string, en *entry) bool) (*moveTrap, *Engine, NamespaceID, *testCache) {
	t.Helper()
	trap := &moveTrap{}
	var e *Engine
	inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if en := trap.armed.Load(); en != nil && trigger(op, path, en) && trap.armed.CompareAndSwap(en, nil) {
			_, err := e.tier.move(context.Background(), en.ID, 1, true)
			trap.moved.Store(err == nil)
		}
		return fsys.Fault{}
	})
	e, ns, c := injectedEngine(t, []Mount{{Path: hot}, {Path: cold}}, &demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}, inj, 16)
	return trap, e, ns, c
}

// TestDeleteRemovesAKeyMovedAfterItWasFound deletes two keys of two files
// and, while the first file is removed, moves the second key's file to the
// other mount: the delete, which found the second key's entry before the
// move, removes the moved file, and both keys are gone.
func TestDeleteRemovesAKeyMovedAfterItWasFound(t *testing.T) {
	ctx := context.Background()
	hot, cold := t.TempDir(), t.TempDir()
	keys := testKeys("delmoved", 2)
	trap, e, ns, c := movingEngine(t, hot, cold, func(op fsys.Op, path string, en *entry) bool {
		return op == fsys.OpRemove && path != en.Path // the other file's removal
	})
	storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}})
	trap.armed.Store(entryOf(e, ns, keys[1]))
	n, err := e.Delete(ctx, ns, keys)
	if !trap.moved.Load() {
		t.Fatal("the second key's file was not moved during the delete: the test proves nothing")
	}
	if n != 2 || err != nil {
		t.Fatalf("Delete = %d, %v; want 2", n, err)
	}
	if f := append(dataFiles(t, hot), dataFiles(t, cold)...); len(f) != 0 {
		t.Fatalf("files left after the delete: %v", f)
	}
	if got, _ := e.Lookup(ctx, ns, keys[1:]); got != 0 {
		t.Fatal("the deleted key moved during the delete is still found")
	}
}

// insertHook is demotingPolicy calling onInsert, when set, with the entry
// of each insert it is told of, before it takes the record.
type insertHook struct {
	*demotingPolicy
	onInsert atomic.Pointer[func(id uint64)]
}

func (p *insertHook) Access(ctx context.Context, recs []abi.AccessRecord) error {
	if fn := p.onInsert.Load(); fn != nil {
		for _, r := range recs {
			if r.Kind == abi.AccessInsert {
				(*fn)(r.Entry)
			}
		}
	}
	return p.demotingPolicy.Access(ctx, recs)
}

// TestPinHoldsAKeyMovedAfterItWasFound pins a key whose file the index has
// lost, so that the pin finds it on disk, and moves the file to the other
// mount as soon as it is indexed, before the pin takes hold: the pin holds
// the moved file, which an eviction then leaves alone.
func TestPinHoldsAKeyMovedAfterItWasFound(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	var (
		e     *Engine
		moved atomic.Bool
	)
	pol := &insertHook{demotingPolicy: &demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}}
	e = openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}, {Path: t.TempDir()}}, Policy: pol})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	keys := testKeys("pinmoved", 1)
	storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}})
	e.rm.drop(ctx, entryOf(e, ns, keys[0]), false, "forgotten by the test") // the file stays
	move := func(id uint64) {
		pol.onInsert.Store(nil)
		_, err := e.tier.move(ctx, id, 1, true)
		moved.Store(err == nil)
	}
	pol.onInsert.Store(&move)
	id, held, err := e.Pin(ctx, ns, keys, 0)
	if !moved.Load() {
		t.Fatal("the key's file was not moved during the pin: the test proves nothing")
	}
	if err != nil || id == 0 || !held[0] {
		t.Fatalf("Pin = %d, %v, %v; want the moved key pinned", id, held, err)
	}
	en := e.ix.Files().Get(e.tables.get(ns).fp, keys[0])
	var pinned bool
	e.ix.Inspect(func() { pinned = en.ClientPinned() })
	mount := en.Mount
	if mount != 1 || !pinned {
		t.Fatalf("the key's entry after the pin: mount %d, pinned %v; want mount 1, pinned", mount, pinned)
	}
	e.Unpin(ctx, id)
}

// TestAStoreOfAKeyMovedAfterItWasFoundAnswersPresent stores a key again
// and moves its file to the other mount just as the store opens it to
// confirm it: the store follows the key to the moved copy and answers
// present, with no file counted vanished and no second copy written.
func TestAStoreOfAKeyMovedAfterItWasFoundAnswersPresent(t *testing.T) {
	ctx := context.Background()
	hot, cold := t.TempDir(), t.TempDir()
	keys := testKeys("storemoved", 1)
	trap, e, ns, c := movingEngine(t, hot, cold, func(op fsys.Op, path string, en *entry) bool {
		return op == fsys.OpOpen && path == en.Path // the store's check of the file
	})
	storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}})
	trap.armed.Store(entryOf(e, ns, keys[0]))
	res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys, Blocks: [][]int{{0, 1, 2, 3}}}))
	if !trap.moved.Load() {
		t.Fatal("the key's file was not moved during the store: the test proves nothing")
	}
	files := append(dataFiles(t, hot), dataFiles(t, cold)...)
	if st := e.Stats(); res.Keys[0].Outcome != OutcomePresent || st.Vanished != 0 || len(files) != 1 {
		t.Fatalf("store of a key moved after it was found: outcome %v, %d vanished, data files %v; want present, 0, one file",
			res.Keys[0].Outcome, st.Vanished, files)
	}
}

// evictPromotingPolicy is demotingPolicy naming "hot" keys to mount 0 and the
// others to mount 1; an eviction on mount 1 moves its victims to mount 0
// (an earlier mount), one on mount 0 evicts them.
type evictPromotingPolicy struct{ *demotingPolicy }

func (p *evictPromotingPolicy) Name(ctx context.Context, recs []abi.NameRecord) error {
	err := p.testPolicy.Name(ctx, recs)
	for i := range recs {
		recs[i].Mount = 1
		if bytes.HasPrefix(recs[i].Key(), []byte("hot")) {
			recs[i].Mount = 0
		}
	}
	return err
}

func (p *evictPromotingPolicy) Admit(ctx context.Context, recs []abi.AdmitRecord) error {
	err := p.testPolicy.Admit(ctx, recs)
	for i := range recs {
		recs[i].Target = recs[i].Mount
	}
	return err
}

func (p *evictPromotingPolicy) Evictions(ctx context.Context, req abi.EvictRequest, max int) ([]policy.Eviction, error) {
	vs, err := p.Victims(ctx, req, max)
	out := make([]policy.Eviction, len(vs))
	for i, v := range vs {
		out[i] = policy.Eviction{Victim: v, Target: abi.VictimTarget{Mount: abi.NoMount}}
		if req.Mount == 1 {
			out[i].Target.Mount = 0
		}
	}
	return out, err
}

// TestMovesToAnEarlierMountTrimItsSpares: an eviction on mount 1 moves its
// victims to mount 0, a memory mount holding spares: the moves take room
// below its high watermark and trim its spares as a store's reservation
// does, so that its files and spares stay within its capacity.
func TestMovesToAnEarlierMountTrimItsSpares(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := 4096 + g.KeyBytes()
	pol := &evictPromotingPolicy{&demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}}
	e := openEngine(t, Config{Mounts: []Mount{
		{Path: tmpfsDir(t), Capacity: 10 * fileLen, HighWatermark: 0.9, LowWatermark: 0.5},
		{Path: t.TempDir(), Capacity: 4 * fileLen, HighWatermark: 0.75, LowWatermark: 0.25},
	}, Policy: pol})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	// Ten files on mount 0: the tenth evicts five, kept as spares, and
	// takes one of them.
	for _, k := range testKeys("hot", 10) {
		storeAndCheck(t, e, c, [][]byte{k}, [][]int{{0, 1, 2, 3}})
	}
	if m := e.Stats().Mounts[0]; m.SpareBytes < 3*fileLen {
		t.Fatalf("mount 0 keeps %d bytes of spares: the test proves nothing", m.SpareBytes)
	}
	// Four files on mount 1: the fourth moves three to mount 0.
	for _, k := range testKeys("cold", 4) {
		storeAndCheck(t, e, c, [][]byte{k}, [][]int{{0, 1, 2, 3}})
	}
	if p := e.TierStats().Promotions; p < 2 {
		t.Fatalf("%d moves to mount 0: the test proves nothing", p)
	}
	if m := e.Stats().Mounts[0]; m.Used+m.SpareBytes > m.Capacity {
		t.Fatalf("mount 0: used %d + spares %d > capacity %d", m.Used, m.SpareBytes, m.Capacity)
	}
}

// TestMovesToAnEarlierClusterMountStayWithinTheClusterCapacity: an
// eviction on mount 1 moves its victims to mount 0, a cluster mount whose
// bound this node's files fill: the moves, which may not evict there,
// take room only within this node's claim, and the files on the cluster
// mount stay within its capacity (the victims stay where they are).
func TestMovesToAnEarlierClusterMountStayWithinTheClusterCapacity(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := 4096 + g.KeyBytes()
	shared := t.TempDir()
	pol := &evictPromotingPolicy{&demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}}
	e := openEngine(t, Config{Mounts: []Mount{
		{Path: shared, ClusterCapacity: 3 * fileLen, ClusterInterval: time.Hour},
		{Path: t.TempDir(), Capacity: 4 * fileLen, HighWatermark: 0.75, LowWatermark: 0.25},
	}, Policy: pol, NodeID: "a"})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	for _, k := range testKeys("hot", 3) { // the cluster's bound
		storeAndCheck(t, e, c, [][]byte{k}, [][]int{{0, 1, 2, 3}})
	}
	for _, k := range testKeys("cold", 4) { // the fourth evicts on mount 1
		storeAndCheck(t, e, c, [][]byte{k}, [][]int{{0, 1, 2, 3}})
	}
	var n int64
	for _, p := range dataFiles(t, shared) {
		if strings.HasSuffix(p, ".kv") { // not the cluster's summaries
			n++
		}
	}
	ts := e.TierStats()
	if ts.Promotions+ts.MoveFailures == 0 {
		t.Fatal("no move to the cluster mount was tried: the test proves nothing")
	}
	if n*fileLen > 3*fileLen {
		t.Fatalf("%d files on the cluster mount, whose capacity is 3 (%d moves to it)", n, ts.Promotions)
	}
}

// ownBytes is the node's count of its bytes on m's cluster mount.
func ownBytes(m *mount) int64 {
	return m.cluster.Inspect().Own
}

// TestAFailedMoveToAnEarlierClusterMountGivesItsClusterGrantBack: moves
// to a cluster mount that has room within the node's claim but none below
// its own high watermark fail, and leave the node's count of its bytes
// there (which its claim must cover) as it was.
func TestAFailedMoveToAnEarlierClusterMountGivesItsClusterGrantBack(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := 4096 + g.KeyBytes()
	pol := &evictPromotingPolicy{&demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}}
	e := openEngine(t, Config{Mounts: []Mount{
		{Path: t.TempDir(), Capacity: 3 * fileLen, HighWatermark: 0.75, LowWatermark: 0.5, ClusterCapacity: 100 * fileLen, ClusterInterval: time.Hour},
		{Path: t.TempDir(), Capacity: 4 * fileLen, HighWatermark: 0.75, LowWatermark: 0.25},
	}, Policy: pol, NodeID: "a"})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	for _, k := range testKeys("hot", 2) { // mount 0 at its high watermark
		storeAndCheck(t, e, c, [][]byte{k}, [][]int{{0, 1, 2, 3}})
	}
	before := ownBytes(e.mounts[0])
	for _, k := range testKeys("cold", 4) { // the fourth evicts on mount 1: moves to mount 0 fail
		storeAndCheck(t, e, c, [][]byte{k}, [][]int{{0, 1, 2, 3}})
	}
	ts := e.TierStats()
	if ts.MoveFailures == 0 || ts.Promotions != 0 {
		t.Fatalf("%d moves to mount 0 failed, %d were made; want failures only", ts.MoveFailures, ts.Promotions)
	}
	if after := ownBytes(e.mounts[0]); after != before {
		t.Fatalf("after %d failed moves to the cluster mount, the node counts %d bytes of its own there, %d before", ts.MoveFailures, after, before)
	}
}

// pinBeforeInsert is a policy host that, told of an INSERT while armed,
// first runs the armed function (a pin of the inserted file): its PIN
// reaches the host before the INSERT, as when a load pins a moved file
// between the move's index swap and the move's report of it.
type pinBeforeInsert struct {
	*policy.Host
	armed atomic.Pointer[func()]
}

func (p *pinBeforeInsert) Access(ctx context.Context, recs []abi.AccessRecord) error {
	if slices.ContainsFunc(recs, func(r abi.AccessRecord) bool { return r.Kind == abi.AccessInsert }) {
		if fn := p.armed.Swap(nil); fn != nil {
			(*fn)()
		}
	}
	return p.Host.Access(ctx, recs)
}

// TestAPinThatOvertakesAMovesInsertIsNoPluginFailure pins a moved file
// before the policy is told of the move's INSERT: the policy, which
// ignores the pin of an entry it does not know yet, may offer the file as
// a victim, and the host skips it as pinned rather than take the plugin
// for failed.
func TestAPinThatOvertakesAMovesInsertIsNoPluginFailure(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	var host *pinBeforeInsert
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}, {Path: t.TempDir()}}, TickInterval: -1,
		NewPolicy: func(idx policy.Index) (policy.Policy, error) {
			h, err := policy.NewNative(func() guest.Policy { return tiered.New() }, idx, policy.Config{Shards: 1, Logger: testLogger(t)})
			host = &pinBeforeInsert{Host: h}
			return host, err
		}})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	keys := testKeys("overtaken", 1)
	storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}})
	var id PinID
	pin := func() { id, _, _ = e.Pin(ctx, ns, keys, 0) }
	host.armed.Store(&pin)
	if _, err := e.tier.move(ctx, entryOf(e, ns, keys[0]).ID, 1, true); err != nil {
		t.Fatal(err)
	}
	if id == 0 {
		t.Fatal("the pin did not take hold during the move: the test proves nothing")
	}
	vs, err := e.tier.evictions(ctx, abi.EvictRequest{Bytes: 1, Mount: 1, Time: uint64(time.Now().UnixNano())})
	if st := host.Stats(); err != nil || len(vs) != 0 || st.Failures != 0 {
		t.Fatalf("victims on the moved file's mount: %v, %v; plugin failures %d (%+v); want none, and no failure", vs, err, st.Failures, st)
	}
	e.Unpin(ctx, id)
}

// coldEvictionHook is evictPromotingPolicy's naming ("hot" keys on mount
// 0, the others on mount 1) with demotingPolicy's evictions (mount 0's
// victims demoted to mount 1, mount 1's deleted), calling onCold, where
// set, when it is asked for victims on mount 1.
type coldEvictionHook struct {
	*evictPromotingPolicy
	onCold func()
}

func (p *coldEvictionHook) Evictions(ctx context.Context, req abi.EvictRequest, max int) ([]policy.Eviction, error) {
	if req.Mount == 1 && p.onCold != nil {
		p.onCold()
	}
	return p.demotingPolicy.Evictions(ctx, req, max)
}

// hotOverFullCold is an engine whose hot mount (10 files, high watermark
// 0.9) holds 9 files and demotes to a cold mount holding 10, full.
type hotOverFullCold struct {
	e       *Engine
	ns      NamespaceID
	c       *testCache
	blocks  [][]int  // the blocks of every key
	cold    [][]byte // the keys on the cold mount
	fileLen int64    // the size of each file
}

// newHotOverFullCold opens that engine with pol, and stores its files.
func newHotOverFullCold(t *testing.T, pol policy.Policy) *hotOverFullCold {
	t.Helper()
	g := smallGeometry(true)
	f := &hotOverFullCold{blocks: [][]int{{0, 1, 2, 3}}, cold: testKeys("cold", 10), fileLen: int64(4096) + g.KeyBytes()}
	f.e = openEngine(t, Config{Policy: pol, Mounts: []Mount{
		{Path: t.TempDir(), Capacity: 10 * f.fileLen, HighWatermark: 0.9, LowWatermark: 0.6},
		{Path: t.TempDir(), Capacity: 10 * f.fileLen, HighWatermark: 1, LowWatermark: 0.5}, // full at 10 files
	}})
	var err error
	if f.ns, err = f.e.Declare(context.Background(), g); err != nil {
		t.Fatal(err)
	}
	f.c = newTestCache(t, f.e, f.ns, g, 16, layoutPlaneFirst)
	f.c.fill(rand.New(rand.NewPCG(5, 6)), f.blocks[0])
	for _, k := range append(f.cold, testKeys("hot", 9)...) {
		storeAndCheck(t, f.e, f.c, [][]byte{k}, f.blocks)
	}
	if u := f.e.Stats().Mounts; u[0].Entries != 9 || u[1].Entries != 10 {
		t.Fatalf("%d files on the hot mount, %d on the cold one; want 9 and 10", u[0].Entries, u[1].Entries)
	}
	return f
}

// pinCold pins the cold mount's keys until the test ends: its eviction
// finds no victim.
func (f *hotOverFullCold) pinCold(t *testing.T) {
	t.Helper()
	id, pinned, err := f.e.Pin(context.Background(), f.ns, f.cold, 0)
	if err != nil || slices.Contains(pinned, false) {
		t.Fatalf("Pin of the cold keys = %v, %v; want all pinned", pinned, err)
	}
	t.Cleanup(func() { f.e.Unpin(context.Background(), id) })
}

// TestADemotionStoppedByItsCallerIsNoMoveFailure: an eviction on the hot
// mount demotes a victim to the full cold mount, whose own eviction for
// it stops because the store that asked for room gave up (its context
// cancelled while the policy picks the cold mount's victims). The store
// fails with the context's error, and nothing failed of the move or of
// either mount: no move failure is counted, no file moved or deleted.
func TestADemotionStoppedByItsCallerIsNoMoveFailure(t *testing.T) {
	pol := &coldEvictionHook{evictPromotingPolicy: &evictPromotingPolicy{&demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}}}
	f := newHotOverFullCold(t, pol)
	e := f.e
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pol.onCold = cancel
	m, size := e.mounts[0], 2*f.fileLen // more than is left below the capacity
	wantReserveStopped(t, e, ctx, m, size, "reserve with a context cancelled during the demotion")
	if ts := e.TierStats(); ts.MoveFailures != 0 || ts.Demotions != 0 {
		t.Errorf("tier stats after a demotion stopped by its caller: %d move failures, %d demotions; want none", ts.MoveFailures, ts.Demotions)
	}
	if n := e.Stats().Evictions; n != 0 {
		t.Errorf("%d files deleted for a caller that gave up, want 0", n)
	}
}

// TestAVictimIsNotDeletedForACallerThatGaveUpDuringItsDemotion: an
// eviction on the hot mount demotes a victim (MOVE_DELETE_IF_FULL) to the
// cold mount, full of pinned files; the store that asked for room gives
// up while the policy is asked for the cold mount's victims (it has
// none), so the move fails with no space. The victim whose demotion
// failed so is not deleted instead: no file is deleted for a caller that
// gave up, and the reservation fails with the context's error.
func TestAVictimIsNotDeletedForACallerThatGaveUpDuringItsDemotion(t *testing.T) {
	dp := &demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor), deleteIfFull: true}
	pol := &coldEvictionHook{evictPromotingPolicy: &evictPromotingPolicy{dp}}
	f := newHotOverFullCold(t, pol)
	e := f.e
	f.pinCold(t) // the cold mount: no victim
	rctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pol.onCold = cancel
	m, size := e.mounts[0], 2*f.fileLen // more than is left below the capacity
	wantReserveStopped(t, e, rctx, m, size, "reserve with a context cancelled during the demotion")
	if n, ts := e.Stats().Evictions, e.TierStats(); n != 0 || ts.DemotionDeletes != 0 || ts.MoveFailures != 0 {
		t.Errorf("%d files deleted (%d demotion deletes, %d move failures) for a caller that gave up, want none", n, ts.DemotionDeletes, ts.MoveFailures)
	}
}

// TestADemotionWithNoRoomOnItsTargetStartsItsRefusalOfStores: a demotion
// into a cold mount full of pinned files, which its eviction there could
// not make room for, fails with no space as a store there would: the
// cold mount refuses stores from then, as after such a store.
func TestADemotionWithNoRoomOnItsTargetStartsItsRefusalOfStores(t *testing.T) {
	pol := &coldEvictionHook{evictPromotingPolicy: &evictPromotingPolicy{&demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}}}
	f := newHotOverFullCold(t, pol)
	e := f.e
	f.pinCold(t) // nothing to evict on the cold mount
	res := wait(t)(e.Store(context.Background(), StoreRequest{Cache: f.c.id, Keys: testKeys("hot-more", 1), Blocks: f.blocks}))
	if ts := e.TierStats(); ts.MoveFailures == 0 {
		t.Fatalf("a store on the full hot mount (%v, %v): no demotion failed; the test proves nothing", res.Keys[0].Outcome, res.Keys[0].Err)
	}
	if f := e.Stats().Mounts[1].StoresFailing; f == nil || !strings.Contains(f.Err, "no space") {
		t.Errorf("the cold mount's StoresFailing after a demotion there failed with no room: %+v, want no space", f)
	}
}
