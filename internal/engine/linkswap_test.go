//go:build invariants

package engine

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/host/policy"
)

// plantAt is an injector that plants a symbolic link in a mount at the
// exact moment the engine is about to act on a name there: at the first
// operation that at matches once armed, after the engine's checks of the
// name and its directories and before the operation itself runs. Every
// operation after that lists outside (the directory the link points to)
// and keeps the names it ever saw there: a file the engine put there even
// for a moment.
type plantAt struct {
	at      func(op fsys.Op, path string) bool
	plant   func(path string)
	outside string

	armed   atomic.Bool
	planted atomic.Bool
	mu      sync.Mutex
	seen    map[string]bool
}

func (p *plantAt) Inject(op fsys.Op, path string) fsys.Fault {
	if p.armed.Load() && p.at(op, path) && p.armed.CompareAndSwap(true, false) {
		p.plant(path)
		p.planted.Store(true)
	}
	if p.planted.Load() {
		p.look()
	}
	return fsys.Fault{}
}

// look records the names in outside now.
func (p *plantAt) look() {
	ents, _ := os.ReadDir(p.outside)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.seen == nil {
		p.seen = map[string]bool{}
	}
	for _, d := range ents {
		p.seen[d.Name()] = true
	}
}

// seenOutside lists the names ever seen in outside but those in before.
func (p *plantAt) seenOutside(before ...string) []string {
	p.look()
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []string
	for n := range p.seen {
		if !slices.Contains(before, n) {
			out = append(out, n)
		}
	}
	slices.Sort(out)
	return out
}

// swapForLink moves the directory sub of the mount dir to sub+".old" (as
// another program on the mount may) and puts a symbolic link to outside
// in its place.
func swapForLink(t *testing.T, dir, sub, outside string) {
	t.Helper()
	if err := os.Rename(filepath.Join(dir, sub), filepath.Join(dir, sub+".old")); err != nil {
		t.Error(err)
	}
	if err := os.Symlink(outside, filepath.Join(dir, sub)); err != nil {
		t.Error(err)
	}
}

// namedEngineOn is namedEngine on the file system fs, with the mount mt
// (its Path set to dir).
func namedEngineOn(t *testing.T, dir, name string, fs fsys.FS, mt Mount) (*Engine, *fixedPathPolicy, *testCache, NamespaceID) {
	t.Helper()
	pol := &fixedPathPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}
	pol.path.Store(&name)
	mt.Path = dir
	e := openEngine(t, Config{Mounts: []Mount{mt}, NodeID: "a", FS: fs, NewPolicy: func(policy.Index) (policy.Policy, error) { return pol, nil }})
	g := smallGeometry(true)
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	return e, pol, newTestCache(t, e, ns, g, 16, layoutPlaneFirst), ns
}

// TestARemovalNeverUnlinksThroughALinkPlantedAfterItsCheck: a delete
// checks that the file at its entry's path is the entry's, then unlinks
// it. Someone who can write the mount replaces the file's directory by a
// symbolic link to a directory outside the mount holding a file of the
// same name, between the check and the unlink. The unlink removes the
// engine's file, in the directory it checked (moved away), and the file
// outside is left where it is.
func TestARemovalNeverUnlinksThroughALinkPlantedAfterItsCheck(t *testing.T) {
	ctx := context.Background()
	dir, outside := t.TempDir(), t.TempDir()
	if err := os.WriteFile(filepath.Join(outside, "k.kv"), []byte("not kvhost's"), 0o644); err != nil {
		t.Fatal(err)
	}
	p := &plantAt{outside: outside}
	p.at = func(op fsys.Op, path string) bool {
		return op == fsys.OpRemove && path == filepath.Join(dir, "d", "k.kv")
	}
	p.plant = func(string) { swapForLink(t, dir, "d", outside) }
	e, _, c, ns := namedEngineOn(t, dir, "d/k.kv", &fsys.Faulty{FS: fsys.OS{}, Inj: p}, Mount{})
	key := []byte("k")
	keyContent(c, key, []int{0, 1, 2, 3})
	storeAndCheck(t, e, c, [][]byte{key}, [][]int{{0, 1, 2, 3}})

	p.armed.Store(true)
	if _, err := e.Delete(ctx, ns, [][]byte{key}); err != nil {
		t.Fatal(err)
	}
	if !p.planted.Load() {
		t.Fatal("the delete never unlinked the file: no link planted")
	}
	if b, err := os.ReadFile(filepath.Join(outside, "k.kv")); err != nil || string(b) != "not kvhost's" {
		t.Errorf("the file outside the mount, of the name the delete unlinked, was removed through the link (%v)", err)
	}
	if names := dataNames(t, filepath.Join(dir, "d.old")); len(names) != 0 {
		t.Errorf("the engine's file, in the directory checked, was not removed: %v", names)
	}
}

// TestASpareIsNeverRenamedOutOfTheMountThroughALink: a store takes a
// spare file (an evicted file kept on a memory mount) and renames it to
// its temporary name in the directory of its policy's name, which mkdir
// checked. Someone replaces that directory by a symbolic link to one
// outside the mount at the moment of the rename. The spare never lands
// outside, not even for a moment; the store fails with ErrPolicy, and the
// spare is removed from the directory it was renamed into.
func TestASpareIsNeverRenamedOutOfTheMountThroughALink(t *testing.T) {
	ctx := context.Background()
	dir, outside := tmpfsDir(t), tmpfsDir(t) // one file system: a rename may cross
	p := &plantAt{outside: outside}
	p.at = func(op fsys.Op, path string) bool {
		return op == fsys.OpRename && filepath.Dir(path) == filepath.Join(dir, "d") && strings.HasPrefix(filepath.Base(path), tmpPrefix)
	}
	p.plant = func(string) { swapForLink(t, dir, "d", outside) }
	g := smallGeometry(true)
	fileLen := int64(4096) + alignTo(g.KeyBytes(), 4096)
	e, pol, c, _ := namedEngineOn(t, dir, "s/0.kv", &fsys.Faulty{FS: fsys.OS{}, Inj: p},
		Mount{Capacity: 10 * fileLen, HighWatermark: 0.9, LowWatermark: 0.6})
	// Files in s/ until evictions keep spares there; then d/ is made.
	for i := 0; e.Stats().Evictions == 0 || len(spareNames(t, filepath.Join(dir, "s"))) == 0; i++ {
		if i == 40 {
			t.Fatal("no spare kept after 40 stores")
		}
		name := "s/" + string(rune('a'+i%26)) + string(rune('a'+i/26)) + ".kv"
		pol.path.Store(&name)
		key := []byte(name)
		keyContent(c, key, []int{0, 1, 2, 3})
		storeAndCheck(t, e, c, [][]byte{key}, [][]int{{0, 1, 2, 3}})
	}
	if err := os.Mkdir(filepath.Join(dir, "d"), 0o755); err != nil {
		t.Fatal(err)
	}
	name := "d/k.kv"
	pol.path.Store(&name)
	key := []byte("k")
	keyContent(c, key, []int{4, 5, 6, 7})
	p.armed.Store(true)
	res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: [][]byte{key}, Blocks: [][]int{{4, 5, 6, 7}}}))
	if !p.planted.Load() {
		t.Fatal("the store renamed no spare into d: no link planted")
	}
	if k := res.Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, ErrPolicy) {
		t.Errorf("store named %s, its directory a link out of the mount since its spare's rename: %v (%v), want failed with ErrPolicy", name, k.Outcome, k.Err)
	}
	if names := p.seenOutside(); len(names) != 0 {
		t.Errorf("the spare was renamed outside the mount, through the link: %v", names)
	}
	if l := leftovers(t, filepath.Join(dir, "d.old")); len(l) != 0 {
		t.Errorf("the spare renamed into the directory checked was left there: %v", l)
	}
}

// spareNames lists the spare files in dir.
func spareNames(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, d := range ents {
		if strings.HasPrefix(d.Name(), sparePrefix) {
			out = append(out, d.Name())
		}
	}
	return out
}

// TestAStoreMakesNoDirectoryOutsideItsMountThroughALink: a store whose
// policy names a file in directories not there yet makes them; someone
// plants a symbolic link to a directory outside the mount where the first
// of them is to be, at the moment it is made. No directory is made
// outside the mount, and the store fails with ErrPolicy.
func TestAStoreMakesNoDirectoryOutsideItsMountThroughALink(t *testing.T) {
	ctx := context.Background()
	dir, outside := t.TempDir(), t.TempDir()
	p := &plantAt{outside: outside}
	p.at = func(op fsys.Op, path string) bool {
		return op == fsys.OpMkdir && strings.HasPrefix(path, filepath.Join(dir, "a"))
	}
	p.plant = func(string) {
		if err := os.Symlink(outside, filepath.Join(dir, "a")); err != nil {
			t.Error(err)
		}
	}
	e, _, c, _ := namedEngineOn(t, dir, "a/b/k.kv", &fsys.Faulty{FS: fsys.OS{}, Inj: p}, Mount{})
	key := []byte("k")
	keyContent(c, key, []int{0, 1, 2, 3})
	p.armed.Store(true)
	res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: [][]byte{key}, Blocks: [][]int{{0, 1, 2, 3}}}))
	if !p.planted.Load() {
		t.Fatal("the store made no directory: no link planted")
	}
	if k := res.Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, ErrPolicy) {
		t.Errorf("store named a/b/k.kv, a a link out of the mount made as it was made: %v (%v), want failed with ErrPolicy", k.Outcome, k.Err)
	}
	if names := p.seenOutside(); len(names) != 0 {
		t.Errorf("directories made outside the mount, through the link: %v", names)
	}
}

// TestAStoreNeverPublishesThroughALinkPlantedBeforeItsRename: a store
// renames its temporary file to its name. Someone moves the directory
// away and plants a symbolic link to a directory outside the mount in
// its place, there putting a file of the temporary file's name, at the
// moment of the rename. Nothing outside the mount is renamed: the names
// there are what they were, and the store's file is published in the
// directory it was written in.
func TestAStoreNeverPublishesThroughALinkPlantedBeforeItsRename(t *testing.T) {
	ctx := context.Background()
	dir, outside := t.TempDir(), t.TempDir()
	var planted []string // the names put outside
	p := &plantAt{outside: outside}
	p.at = func(op fsys.Op, path string) bool {
		return op == fsys.OpRename && path == filepath.Join(dir, "d", "k.kv")
	}
	p.plant = func(string) {
		for _, l := range leftovers(t, filepath.Join(dir, "d")) {
			if n := filepath.Base(l); strings.HasPrefix(n, tmpPrefix) {
				if err := os.WriteFile(filepath.Join(outside, n), []byte("not kvhost's"), 0o644); err != nil {
					t.Error(err)
				}
				planted = append(planted, n)
			}
		}
		swapForLink(t, dir, "d", outside)
	}
	e, _, c, _ := namedEngineOn(t, dir, "d/k.kv", &fsys.Faulty{FS: fsys.OS{}, Inj: p}, Mount{})
	key := []byte("k")
	keyContent(c, key, []int{0, 1, 2, 3})
	p.armed.Store(true)
	wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: [][]byte{key}, Blocks: [][]int{{0, 1, 2, 3}}}))
	if !p.planted.Load() || len(planted) == 0 {
		t.Fatalf("the store renamed no temporary file to d/k.kv (%v): no link planted", planted)
	}
	if names := p.seenOutside(planted...); len(names) != 0 {
		t.Errorf("the store renamed a file outside its mount, through the link: %v", names)
	}
	for _, n := range planted {
		if _, err := os.Stat(filepath.Join(outside, n)); err != nil {
			t.Errorf("the file outside the mount was renamed away through the link: %v", err)
		}
	}
	if names := dataNames(t, filepath.Join(dir, "d.old")); !slices.Equal(names, []string{"k.kv"}) {
		t.Errorf("published in the directory written in: %v, want [k.kv]", names)
	}
}
