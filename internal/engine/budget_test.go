//go:build invariants

package engine

import (
	"context"
	"errors"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/plugins/lru"
)

// burstResult is what burstOnOneMount leaves: which of the quiet
// namespace's and the burster's keys are still indexed, and the stats.
type burstResult struct {
	quietKept, burstKept []bool
	stats                Stats
}

// Sizes of burstOnOneMount: the mount holds burstMountFiles files of one key;
// the quiet namespace stores burstQuietKeys first, then the burster
// burstOwnKeys, one store each.
const (
	burstMountFiles = 30
	burstQuietKeys  = 12
	burstOwnKeys    = 40
)

// burstOnOneMount opens an engine of one mount of burstMountFiles one-key
// files with budgets, where namespace "tenant/quiet" stores burstQuietKeys
// keys, then "tenant/burst" burstOwnKeys, under the built-in lru policy
// (oldest evicted first). With reload, the policy is replaced (a
// configuration reload) between the two.
func burstOnOneMount(t *testing.T, budgets func(fileLen int64) []Budget, reload bool) burstResult {
	t.Helper()
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := int64(4096) + g.KeyBytes()
	newLRU := func(idx policy.Index) (policy.Policy, error) {
		return policy.NewNative(func() guest.Policy { return lru.New() }, idx, policy.Config{Shards: 1, Logger: testLogger(t)})
	}
	e := openEngine(t, Config{
		Mounts:    []Mount{{Path: t.TempDir(), Capacity: burstMountFiles * fileLen, HighWatermark: 0.9, LowWatermark: 0.8}},
		NewPolicy: newLRU,
		NoReuse:   true,
		Budgets:   budgets(fileLen),
	})
	r := rand.New(rand.NewPCG(8, 6))
	store := func(model string, n int) ([][]byte, NamespaceID) {
		keys := testKeys(model, n)
		ns, _ := storeAsModel(t, e, g, model, keys, r)
		return keys, ns
	}
	qk, qns := store("tenant/quiet", burstQuietKeys)
	if reload {
		if err := e.ReplacePolicy(ctx, newLRU); err != nil {
			t.Fatal(err)
		}
	}
	bk, bns := store("tenant/burst", burstOwnKeys)
	kept := func(ns NamespaceID, keys [][]byte) []bool {
		out := make([]bool, len(keys))
		for i, k := range keys {
			out[i] = entryOf(e, ns, k) != nil
		}
		return out
	}
	return burstResult{quietKept: kept(qns, qk), burstKept: kept(bns, bk), stats: e.Stats()}
}

// storeAsModel declares g as model in e and stores keys there, one a
// file, each with random bytes from r; it returns the namespace and the
// cache it registered.
func storeAsModel(t *testing.T, e *Engine, g Geometry, model string, keys [][]byte, r *rand.Rand) (NamespaceID, *testCache) {
	t.Helper()
	g.Model = model
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 4, layoutPlaneFirst)
	for i := range keys {
		c.fill(r, []int{0, 1, 2, 3})
		storeAndCheck(t, e, c, keys[i:i+1], [][]int{{0, 1, 2, 3}})
	}
	return ns, c
}

// countTrue is the number of true in bs.
func countTrue(bs []bool) int {
	n := 0
	for _, b := range bs {
		if b {
			n++
		}
	}
	return n
}

// budgetOf returns the stats of the budget of pattern model.
func budgetOf(t *testing.T, st Stats, model string) BudgetStats {
	t.Helper()
	i := slices.IndexFunc(st.Budgets, func(b BudgetStats) bool { return b.Model == model })
	if i < 0 {
		t.Fatalf("Stats.Budgets has no %q: %+v", model, st.Budgets)
	}
	return st.Budgets[i]
}

// TestABurstOverItsBudgetEvictsOnlyItsOwnFiles: a namespace storing 10×
// its budget on a mount too small for it, beside a quiet namespace that
// stored first (the policy's oldest), loses only its own files, whether
// the quiet one has a budget and floor or only a floor, and after a
// policy reload (the budgets are the engine's, kept); Stats shows each
// budget's bytes against its budget and floor, the evictions it caused,
// and each namespace's budget.
func TestABurstOverItsBudgetEvictsOnlyItsOwnFiles(t *testing.T) {
	cases := []struct {
		name    string
		budgets func(fileLen int64) []Budget
		reload  bool
	}{
		{"both budgeted, quiet with a floor", func(f int64) []Budget {
			return []Budget{{Model: "tenant/burst", Bytes: 4 * f}, {Model: "tenant/quiet", Bytes: 14 * f, Floor: 10 * f}}
		}, false},
		{"burst budgeted by prefix, quiet without a floor", func(f int64) []Budget {
			return []Budget{{Model: "tenant/bu*", Bytes: 4 * f}, {Model: "tenant/quiet", Bytes: 20 * f}}
		}, false},
		{"only the quiet one's floor", func(f int64) []Budget {
			return []Budget{{Model: "tenant/quiet", Floor: burstQuietKeys * f}}
		}, false},
		{"budgets kept across a policy reload", func(f int64) []Budget {
			return []Budget{{Model: "tenant/burst", Bytes: 4 * f}, {Model: "tenant/quiet", Bytes: 14 * f, Floor: 10 * f}}
		}, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			res := burstOnOneMount(t, tc.budgets, tc.reload)
			if n := countTrue(res.quietKept); n != burstQuietKeys {
				t.Fatalf("the quiet namespace keeps %d of its %d keys after the burst, want all: %v", n, burstQuietKeys, res.quietKept)
			}
			if n := countTrue(res.burstKept); n >= burstOwnKeys || n == 0 {
				t.Fatalf("the burster keeps %d of its %d keys: want its own evicted, its newest kept", n, burstOwnKeys)
			}
			if !res.burstKept[burstOwnKeys-1] {
				t.Fatal("the burster's newest key is gone")
			}
			if res.stats.Evictions == 0 {
				t.Fatal("no eviction counted")
			}
			quiet := budgetOf(t, res.stats, tc.budgets(1)[len(tc.budgets(1))-1].Model)
			if quiet.Bytes == 0 || quiet.Over != 0 {
				t.Fatalf("quiet budget %+v: want its bytes and no eviction over budget", quiet)
			}
			for _, ns := range res.stats.Namespaces {
				if ns.Model == "tenant/quiet" && ns.Budget != quiet.Model {
					t.Fatalf("namespace %q: budget %q, want %q", ns.Model, ns.Budget, quiet.Model)
				}
			}
		})
	}
}

// TestANamespaceUnderItsBudgetIsNotSingledOut: where every namespace is
// under its budget and none has a floor, an eviction takes what the
// policy ranks first, as without budgets: the same keys survive.
func TestANamespaceUnderItsBudgetIsNotSingledOut(t *testing.T) {
	none := burstOnOneMount(t, func(int64) []Budget { return nil }, false)
	under := burstOnOneMount(t, func(f int64) []Budget {
		return []Budget{{Model: "tenant/burst", Bytes: 100 * f}, {Model: "tenant/quiet", Bytes: 100 * f}}
	}, false)
	if countTrue(none.quietKept) == burstQuietKeys {
		t.Fatal("without budgets the burst evicted none of the quiet namespace's keys: the case shows nothing")
	}
	if !slices.Equal(none.quietKept, under.quietKept) || !slices.Equal(none.burstKept, under.burstKept) {
		t.Fatalf("keys kept under budgets differ from those kept without:\nquiet %v\n  vs %v\nburst %v\n  vs %v", under.quietKept, none.quietKept, under.burstKept, none.burstKept)
	}
	if b := budgetOf(t, under.stats, "tenant/burst"); b.Over != 0 || b.Kept != 0 {
		t.Fatalf("budget under its bytes counted %+v, want no eviction over budget or kept", b)
	}
}

// TestAStoreThatWouldCrossAFloorFailsNamingIt: where the only files left
// to evict are a namespace's at its floor, another namespace's store
// fails with ErrNoSpace naming that namespace and its floor, and the
// floor's files stay.
func TestAStoreThatWouldCrossAFloorFailsNamingIt(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := int64(4096) + g.KeyBytes()
	e := openEngine(t, Config{
		Mounts:  []Mount{{Path: t.TempDir(), Capacity: 9 * fileLen, HighWatermark: 0.9, LowWatermark: 0.8}},
		Policy:  newTestPolicy(1, 0),
		NoReuse: true,
		Budgets: []Budget{{Model: "tenant/floor", Floor: 9 * fileLen}},
	})
	r := rand.New(rand.NewPCG(3, 1))
	declare := func(model string) (NamespaceID, *testCache) {
		gm := g
		gm.Model = model
		ns, err := e.Declare(ctx, gm)
		if err != nil {
			t.Fatal(err)
		}
		return ns, newTestCache(t, e, ns, gm, 4, layoutPlaneFirst)
	}
	fns, fc := declare("tenant/floor")
	keys := testKeys("floor", 9)
	for i := range keys {
		fc.fill(r, []int{0, 1, 2, 3})
		storeAndCheck(t, e, fc, keys[i:i+1], [][]int{{0, 1, 2, 3}})
	}
	_, oc := declare("tenant/other")
	oc.fill(r, []int{0, 1, 2, 3})
	res := wait(t)(e.Store(ctx, StoreRequest{Cache: oc.id, Keys: testKeys("other", 1), Blocks: [][]int{{0, 1, 2, 3}}}))
	err := res.Keys[0].Err
	if !errors.Is(err, ErrNoSpace) || !strings.Contains(err.Error(), `"tenant/floor"`) || !strings.Contains(err.Error(), "floor") {
		t.Fatalf("store beside a namespace at its floor: %v (%v), want ErrNoSpace naming tenant/floor and its floor", res.Keys[0].Outcome, err)
	}
	t.Logf("the store's error: %v", err)
	for i, k := range keys {
		if entryOf(e, fns, k) == nil {
			t.Fatalf("key %d of the namespace at its floor was evicted", i)
		}
	}
	if b := budgetOf(t, e.Stats(), "tenant/floor"); b.Kept == 0 || b.Bytes != 9*fileLen {
		t.Fatalf("budget stats %+v: want its 9 files' bytes and files kept counted", b)
	}
}

// TestOpenRefusesBadBudgets: Open refuses, naming the budget, a floor
// larger than the mounts' capacity, floors summing beyond it, a floor
// above its budget, a budget without a model id and one given twice.
func TestOpenRefusesBadBudgets(t *testing.T) {
	const capacity = 1 << 20
	cases := []struct {
		name    string
		budgets []Budget
		want    string
	}{
		{"floor beyond the mount", []Budget{{Model: "big", Floor: 2 * capacity}}, `budget "big": its floor of 2097152 bytes exceeds the mounts' capacity of 1048576`},
		{"floors summing beyond", []Budget{{Model: "a", Floor: capacity / 2}, {Model: "b", Floor: capacity/2 + 1}}, `floors sum to 1048577 bytes`},
		{"floor above budget", []Budget{{Model: "a", Bytes: 10, Floor: 20}}, `budget "a": its floor of 20 bytes exceeds its budget of 10`},
		{"no model", []Budget{{Bytes: 10}}, `budget 0: no model id`},
		{"twice", []Budget{{Model: "a", Bytes: 10}, {Model: "a", Bytes: 20}}, `budget "a": given twice`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := testOpen(context.Background(), Config{
				Mounts:    []Mount{{Path: t.TempDir(), Capacity: capacity}},
				Policy:    newTestPolicy(1, 0),
				Budgets:   tc.budgets,
				Logger:    testLogger(t),
				IOWorkers: 2,
			})
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Open: %v, want ErrInvalid with %q", err, tc.want)
			}
		})
	}
}

// TestBudgetMatchesItsModelIDExactlyOrByPrefix: a pattern without "*"
// matches its model id only; one ending in "*" every id it begins; the
// longest matching pattern wins.
func TestBudgetMatchesItsModelIDExactlyOrByPrefix(t *testing.T) {
	set, err := newBudgetSet([]Budget{{Model: "vllm:m:*"}, {Model: "vllm:m:abc"}, {Model: "vllm:*"}})
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		model string
		want  int
	}{
		{"vllm:m:abc", 1},
		{"vllm:m:abd", 0},
		{"vllm:n:abc", 2},
		{"vllm:m:abcd", 0},
		{"other", -1},
		{"", -1},
	}
	for _, tc := range cases {
		if got := set.match(tc.model); got != tc.want {
			t.Errorf("match(%q) = %d, want %d", tc.model, got, tc.want)
		}
	}
}
