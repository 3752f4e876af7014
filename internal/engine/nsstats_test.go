//go:build invariants

package engine

import (
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
)

// TestStatsListsEachNamespaceWithItsKeysAndBytes: Stats.Namespaces counts
// each namespace's files, keys and bytes as stores and deletes change
// them, names a declared one by its model id, keeps a declared namespace
// with nothing stored, and after a restart lists the files found under
// their fingerprint, unnamed until a client declares them again.
func TestStatsListsEachNamespaceWithItsKeysAndBytes(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	cfg := Config{Mounts: []Mount{{Path: dir}}, NewPolicy: testPolicies(2, abi.OrderLayerMajor)}
	e := openEngine(t, cfg)
	ga, gb, gc := smallGeometry(false), smallGeometry(false), smallGeometry(false)
	ga.Model, gb.Model, gc.Model = "model-a", "model-b", "model-c"
	r := rand.New(rand.NewPCG(1, 2))
	store := func(g Geometry, n int) NamespaceID {
		ns, err := e.Declare(ctx, g)
		if err != nil {
			t.Fatal(err)
		}
		bpk := g.BlocksPerKey()
		c := newTestCache(t, e, ns, g, n*bpk, layoutPlaneFirst)
		src := blockLists(r, n, bpk, 0)
		res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: testKeys(g.Model, n), Blocks: src}))
		wantOutcomes(t, "store "+g.Model, res, OutcomeStored)
		return ns
	}
	nsA := store(ga, 6)
	store(gb, 2)
	if _, err := e.Declare(ctx, gc); err != nil {
		t.Fatal(err)
	}
	byModel := func(st Stats) map[string]NamespaceStats {
		t.Helper()
		out := map[string]NamespaceStats{}
		for i, ns := range st.Namespaces {
			if i > 0 && st.Namespaces[i-1].Bytes < ns.Bytes {
				t.Errorf("namespaces not the most bytes first: %+v", st.Namespaces)
			}
			out[ns.Model] = ns
		}
		return out
	}
	got := byModel(e.Stats())
	if len(got) != 3 {
		t.Fatalf("Stats lists %d namespaces, want 3: %+v", len(got), got)
	}
	a, b, c := got["model-a"], got["model-b"], got["model-c"]
	if a.Keys != 6 || b.Keys != 2 || c.Keys != 0 || !a.Declared || !b.Declared || !c.Declared {
		t.Fatalf("keys a %d, b %d, c %d (want 6, 2, 0), declared %v %v %v", a.Keys, b.Keys, c.Keys, a.Declared, b.Declared, c.Declared)
	}
	if a.Files == 0 || a.Bytes <= b.Bytes || c.Files != 0 || c.Bytes != 0 {
		t.Fatalf("files and bytes: a %+v, b %+v, c %+v", a, b, c)
	}
	if a.Fingerprint != ga.Fingerprint() {
		t.Fatalf("model-a's fingerprint %#x, want %#x", a.Fingerprint, ga.Fingerprint())
	}
	if n, err := e.Delete(ctx, nsA, testKeys("model-a", 6)[:2]); err != nil || n != 2 {
		t.Fatalf("Delete: %d, %v", n, err)
	}
	if k := byModel(e.Stats())["model-a"].Keys; k != 4 {
		t.Fatalf("model-a holds %d keys after the file of 2 of its 6 was deleted, want 4", k)
	}
	if err := e.ix.Check(); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}

	e = openEngine(t, cfg)
	st := e.Stats()
	if len(st.Namespaces) != 2 {
		t.Fatalf("after a restart: %d namespaces listed, want 2: %+v", len(st.Namespaces), st.Namespaces)
	}
	for _, ns := range st.Namespaces {
		if ns.Model != "" || ns.Declared {
			t.Fatalf("a namespace found at start is named or declared: %+v", ns)
		}
	}
	if _, err := e.Declare(ctx, gb); err != nil {
		t.Fatal(err)
	}
	if got := byModel(e.Stats())["model-b"]; got.Keys != 2 || !got.Declared || got.Fingerprint != gb.Fingerprint() {
		t.Fatalf("model-b declared again: %+v, want its 2 keys", got)
	}
}

// TestPurgeRemovesEveryFileOfOneNamespaceButPinnedOnes: Purge removes the
// files of one namespace fingerprint and no other's, keeps a file a client
// pin holds (counted), works on files found at start that no client
// declared since, and then the namespace's keys miss.
func TestPurgeRemovesEveryFileOfOneNamespaceButPinnedOnes(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	cfg := Config{Mounts: []Mount{{Path: dir}}, NewPolicy: testPolicies(1, abi.OrderLayerMajor)}
	e := openEngine(t, cfg)
	ga, gb := smallGeometry(false), smallGeometry(false)
	ga.Model, gb.Model = "model-a", "model-b"
	r := rand.New(rand.NewPCG(3, 4))
	declare := func(g Geometry) (NamespaceID, *testCache) {
		ns, err := e.Declare(ctx, g)
		if err != nil {
			t.Fatal(err)
		}
		return ns, newTestCache(t, e, ns, g, 8*g.BlocksPerKey(), layoutPlaneFirst)
	}
	nsA, ca := declare(ga)
	nsB, cb := declare(gb)
	bpk := ga.BlocksPerKey()
	storeAndCheck(t, e, ca, testKeys("a", 5), blockLists(r, 5, bpk, 0))
	storeAndCheck(t, e, cb, testKeys("b", 3), blockLists(r, 3, bpk, 0))
	pin, held, err := e.Pin(ctx, nsA, testKeys("a", 5)[4:], 0)
	if err != nil || !held[0] {
		t.Fatalf("Pin: %v, %v", held, err)
	}
	got, err := e.Purge(ctx, ga.Fingerprint())
	if err != nil {
		t.Fatal(err)
	}
	if got.Files != 4 || got.Keys != 4 || got.Pinned != 1 || got.Bytes <= 0 {
		t.Fatalf("Purge of model-a: %+v; want 4 files and keys removed, 1 pinned", got)
	}
	if n, _ := e.Lookup(ctx, nsA, testKeys("a", 4)); n != 0 {
		t.Fatalf("%d of model-a's purged keys still found", n)
	}
	if n, _ := e.Lookup(ctx, nsA, testKeys("a", 5)[4:]); n != 1 {
		t.Fatal("model-a's pinned key was purged")
	}
	if n, _ := e.Lookup(ctx, nsB, testKeys("b", 3)); n != 3 {
		t.Fatalf("model-b holds %d of its 3 keys after model-a's purge", n)
	}
	e.Unpin(ctx, pin)
	if err := e.ix.Check(); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Purge(ctx, 0xdead); !errors.Is(err, ErrUnknownNamespace) {
		t.Fatalf("Purge of a fingerprint the engine never saw: %v, want ErrUnknownNamespace", err)
	}
	if _, err := e.PurgeModel(ctx, "model-z"); !errors.Is(err, ErrUnknownNamespace) {
		t.Fatalf("PurgeModel of a model never declared: %v, want ErrUnknownNamespace", err)
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}

	e = openEngine(t, cfg) // model-b's files found, no client declares it
	got, err = e.Purge(ctx, gb.Fingerprint())
	if err != nil || got.Files != 3 || got.Keys != 3 || got.Pinned != 0 {
		t.Fatalf("Purge of model-b's files found at start: %+v, %v; want its 3 files", got, err)
	}
	st := e.Stats()
	if st.Keys != 1 || len(st.Namespaces) != 1 || st.Namespaces[0].Fingerprint != ga.Fingerprint() {
		t.Fatalf("after both purges: %d keys, namespaces %+v; want model-a's pinned key only", st.Keys, st.Namespaces)
	}
	if files := dataFiles(t, dir); len(files) != 1 {
		t.Fatalf("%d data files on the mount, want 1 (model-a's pinned key's)", len(files))
	}
}

// TestPurgeCountsEachKeyOnceAsStatsDoes: two files of one namespace that
// share a key (found at start: another node's, or written under another
// grouping) hold three keys, as Stats.Namespaces counts them; Purge
// removes both files and reports those three, not the four the files
// list.
func TestPurgeCountsEachKeyOnceAsStatsDoes(t *testing.T) {
	ctx := context.Background()
	x, y := t.TempDir(), t.TempDir()
	g := smallGeometry(false)
	g.Model = "m"
	r := rand.New(rand.NewPCG(5, 6))
	cfg := func(dir string) Config {
		return Config{Mounts: []Mount{{Path: dir}}, NewPolicy: testPolicies(2, abi.OrderLayerMajor)}
	}
	storeIn := func(dir string, keys [][]byte) {
		e := openEngine(t, cfg(dir))
		ns, err := e.Declare(ctx, g)
		if err != nil {
			t.Fatal(err)
		}
		c := newTestCache(t, e, ns, g, 4*g.BlocksPerKey(), layoutPlaneFirst)
		storeAndCheck(t, e, c, keys, blockLists(r, len(keys), g.BlocksPerKey(), 0))
		if err := e.Close(ctx); err != nil {
			t.Fatal(err)
		}
	}
	k := testKeys("k", 3)
	storeIn(x, [][]byte{k[0], k[1]})
	storeIn(y, [][]byte{k[1], k[2]})
	for _, p := range dataFiles(t, y) { // y's file joins x's mount
		rel, err := filepath.Rel(y, p)
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Dir(filepath.Join(x, rel)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(x, rel), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	e := openEngine(t, cfg(x))
	st := e.Stats()
	if len(st.Namespaces) != 1 || st.Namespaces[0].Files != 2 || st.Namespaces[0].Keys != 3 {
		t.Fatalf("before the purge: %+v; want 2 files holding 3 keys", st.Namespaces)
	}
	got, err := e.Purge(ctx, g.Fingerprint())
	if err != nil || got.Files != 2 || got.Keys != 3 {
		t.Fatalf("Purge: %+v, %v; want 2 files and the 3 keys Stats counted", got, err)
	}
}

// TestPurgeModelRemovesEveryNamespaceOfTheModel: PurgeModel removes the
// files of each namespace declared with the model id (here two ranks of
// one model), declared now or released, and none of another model's; a
// second purge finds nothing and is no error.
func TestPurgeModelRemovesEveryNamespaceOfTheModel(t *testing.T) {
	ctx := context.Background()
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, NewPolicy: testPolicies(1, abi.OrderLayerMajor)})
	r := rand.New(rand.NewPCG(7, 8))
	store := func(g Geometry, prefix string, n int) NamespaceID {
		ns, err := e.Declare(ctx, g)
		if err != nil {
			t.Fatal(err)
		}
		c := newTestCache(t, e, ns, g, n*g.BlocksPerKey(), layoutPlaneFirst)
		storeAndCheck(t, e, c, testKeys(prefix, n), blockLists(r, n, g.BlocksPerKey(), 0))
		return ns
	}
	rank0, rank1, other := smallGeometry(false), smallGeometry(false), smallGeometry(false)
	rank0.Model, rank1.Model, other.Model = "m", "m", "other"
	rank0.TPSize, rank1.TPSize, rank1.TPRank = 2, 2, 1
	store(rank0, "r0", 2)
	store(rank1, "r1", 3)
	nsOther := store(other, "o", 4)
	got, err := e.PurgeModel(ctx, "m")
	if err != nil || got.Namespaces != 2 || got.Files != 5 || got.Keys != 5 {
		t.Fatalf("PurgeModel(m): %+v, %v; want its 2 namespaces' 5 files", got, err)
	}
	if n, _ := e.Lookup(ctx, nsOther, testKeys("o", 4)); n != 4 {
		t.Fatalf("the other model holds %d of its 4 keys", n)
	}
	if got, err = e.PurgeModel(ctx, "m"); err != nil || got.Files != 0 {
		t.Fatalf("PurgeModel(m) again: %+v, %v; want nothing removed, no error", got, err)
	}
	if _, err := e.PurgeModel(ctx, ""); !errors.Is(err, ErrInvalid) {
		t.Fatalf("PurgeModel of an empty id: %v, want ErrInvalid (files found at start have none)", err)
	}
}

// TestAPurgeUnderALoadIsNotAVanishedFile: a Purge that removes a file a
// load has pinned but not yet opened (a load's pin stops no purge) is
// this engine's own removal: the load reports the key missing, saying it
// was deleted, and Stats.Vanished (files removed behind the engine's
// back) does not count it.
func TestAPurgeUnderALoadIsNotAVanishedFile(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	var (
		e      *Engine
		armed  atomic.Pointer[string]
		purged atomic.Int64
	)
	g := smallGeometry(true)
	inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if p := armed.Load(); p != nil && op == fsys.OpOpen && path == *p && armed.CompareAndSwap(p, nil) {
			r, _ := e.Purge(ctx, g.Fingerprint())
			purged.Store(int64(r.Files))
		}
		return fsys.Fault{}
	})
	e, ns, c := injectedEngine(t, []Mount{{Path: dir}}, newTestPolicy(1, abi.OrderLayerMajor), inj, 16)
	keys := testKeys("vanish", 1)
	storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}})
	path := entryOf(e, ns, keys[0]).Path
	armed.Store(&path)
	res := wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: keys, Blocks: [][]int{{4, 5, 6, 7}}}))
	if purged.Load() != 1 {
		t.Fatalf("the purge during the load removed %d files, want 1", purged.Load())
	}
	if k := res.Keys[0]; k.Outcome != OutcomeMissing || !errors.Is(k.Err, ErrNotFound) || !strings.Contains(k.Err.Error(), "deleted") {
		t.Fatalf("load of a key purged under it: %v (%v), want missing, deleted", k.Outcome, k.Err)
	}
	if v := e.Stats().Vanished; v != 0 {
		t.Fatalf("Stats.Vanished = %d after this engine's own purge removed the file; want 0", v)
	}
}

// TestPurgeCountsAFileItCouldNotRemoveAsLeftAndRemovesItNextTime: where a
// purged file's unlink fails (EACCES), Purge counts it in Left, not in
// Files; the next Purge of the namespace tries it again, with the file
// a Delete could not remove, and removes both.
func TestPurgeCountsAFileItCouldNotRemoveAsLeftAndRemovesItNextTime(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	var failing atomic.Bool
	inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if failing.Load() && op == fsys.OpRemove && strings.HasSuffix(path, ".kv") {
			return fsys.Fault{Err: syscall.EACCES}
		}
		return fsys.Fault{}
	})
	e, ns, c := injectedEngine(t, []Mount{{Path: dir}}, newTestPolicy(1, abi.OrderLayerMajor), inj, 16)
	keys := testKeys("purgefail", 2)
	storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}})
	fp := smallGeometry(true).Fingerprint()
	failing.Store(true)
	if n, err := e.Delete(ctx, ns, keys[1:]); n != 1 || err != nil {
		t.Fatalf("Delete whose unlink fails: %d removed, %v; want 1 (deleted from the cache)", n, err)
	}
	r, err := e.Purge(ctx, fp)
	if err != nil || r.Files != 0 || r.Left != 2 {
		t.Fatalf("Purge whose unlink fails: %+v, %v; want no file removed, 2 left (the deleted one tried again)", r, err)
	}
	if files := dataFiles(t, dir); len(files) != 2 {
		t.Fatalf("data files after the failed removals: %v, want both still there", files)
	}
	failing.Store(false)
	r, err = e.Purge(ctx, fp)
	if err != nil || r.Files != 2 || r.Left != 0 || r.Bytes == 0 {
		t.Fatalf("Purge once the unlink works: %+v, %v; want the 2 files left before removed", r, err)
	}
	if files := dataFiles(t, dir); len(files) != 0 {
		t.Fatalf("data files after the second purge: %v, want none", files)
	}
	if err := e.check(); err != nil {
		t.Fatal(err)
	}
}
