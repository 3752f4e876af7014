//go:build invariants

package engine

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
)

// plantLink replaces the first directory below the data directory on the
// way to key's row (<data dir>/<3 hex>) with a symbolic link to outside,
// and returns where key's row would land through it.
func plantLink(t *testing.T, tier fsTier, key []byte, outside string) string {
	t.Helper()
	p := tier.path(key)
	top := filepath.Dir(filepath.Dir(p)) // <data dir>/<3 hex>
	os.RemoveAll(top)
	if err := os.MkdirAll(filepath.Dir(top), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, top); err != nil {
		t.Fatal(err)
	}
	rel, err := filepath.Rel(top, p)
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Join(outside, rel)
}

// tierEngine opens an engine on tier's root as a vllm-fs mount of
// tier's fields and rows, through fs (nil: the OS), and declares the
// rows' geometry.
func tierEngine(t *testing.T, tier fsTier, fs fsys.FS) (*Engine, Geometry, NamespaceID) {
	t.Helper()
	e := openEngine(t, Config{FS: fs, Mounts: []Mount{{Path: tier.root, VLLMFS: &VLLMFS{Namespace: tierModel, Fields: tier.fields(), RowBytes: int64(tier.rowBytes)}}}, Policy: newTestPolicy(4, abi.OrderBlockMajor)})
	g := rowGeometry(tierModel, tier.rowBytes)
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	return e, g, ns
}

// plantRowOutside plants a link on the way to key's row (plantLink) and
// puts a file of the row's length, not a row of vLLM's, where the row
// lands through it; it returns that file's path and bytes.
func plantRowOutside(t *testing.T, tier fsTier, key []byte, outside string) (string, []byte) {
	t.Helper()
	through := plantLink(t, tier, key, outside)
	if err := os.MkdirAll(filepath.Dir(through), 0o755); err != nil {
		t.Fatal(err)
	}
	secret := bytes.Repeat([]byte("not a row of vLLM's "), tier.fileLen()/20+1)[:tier.fileLen()]
	if err := os.WriteFile(through, secret, 0o600); err != nil {
		t.Fatal(err)
	}
	return through, secret
}

// wantRowOutsideNeitherServedNorRemoved loads key (of ns, geometry g) on
// e and fails t if the load served the file at through (secret, planted
// by plantRowOutside), by its outcome or its bytes; then it deletes key
// and fails t if that removed the file.
func wantRowOutsideNeitherServedNorRemoved(t *testing.T, e *Engine, ns NamespaceID, g Geometry, key []byte, through string, secret []byte) {
	t.Helper()
	ctx := context.Background()
	c := newTestCache(t, e, ns, g, 2, layoutPlaneFirst)
	res := wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: [][]byte{key}, Blocks: [][]int{{0}}}))
	if k, got := res.Keys[0], c.data([]int{0}); k.Outcome == OutcomeLoaded || bytes.Equal(got, secret[:len(got)]) {
		t.Errorf("load served the file outside the directory (%s): %v", through, k.Outcome)
	}
	if _, err := e.Delete(ctx, ns, [][]byte{key}); err != nil {
		t.Logf("delete: %v", err)
	}
	if _, err := os.Stat(through); err != nil {
		t.Errorf("the file outside the vllm-fs directory, reached through the link, was removed: %v", err)
	}
}

// TestAVllmFSStoreNeverWritesThroughALinkPlantedInTheDirectory: someone
// who can write vLLM's shared directory replaced a directory of the
// layout with a symbolic link to a directory outside it. A store of a key
// whose row would go through the link fails and writes nothing outside,
// not even a directory; another key's store still succeeds.
func TestAVllmFSStoreNeverWritesThroughALinkPlantedInTheDirectory(t *testing.T) {
	ctx := context.Background()
	root, outside := t.TempDir(), t.TempDir()
	const row = 8192
	tier := newFSTier(root, row)
	e := openEngine(t, Config{Mounts: []Mount{{Path: root, VLLMFS: &VLLMFS{Namespace: tierModel, Fields: tier.fields()}}}, Policy: newTestPolicy(4, abi.OrderBlockMajor)})
	g := rowGeometry(tierModel, row)
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	keys := tierKeys(7, 2)
	through := plantLink(t, tier, keys[0], outside)
	c := newTestCache(t, e, ns, g, 4, layoutPlaneFirst)
	r := rand.New(rand.NewPCG(3, 4))
	c.fill(r, []int{0, 1})
	res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys[:1], Blocks: [][]int{{0}}}))
	if k := res.Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, ErrInvalid) {
		t.Errorf("store through a planted link: %v (%v), want failed with ErrInvalid", k.Outcome, k.Err)
	}
	if ents, _ := os.ReadDir(outside); len(ents) != 0 {
		t.Errorf("the store wrote outside the vllm-fs directory, through the link (%s): %v", through, ents)
	}
	if st := e.Stats(); st.Entries != 0 || st.Mounts[0].Used != 0 {
		t.Errorf("after the refused store: %d entries, %d bytes used; want none", st.Entries, st.Mounts[0].Used)
	}
	storeAndCheck(t, e, c, keys[1:], [][]int{{1}})
	if got := tier.load(t, keys[1]); !bytes.Equal(got, c.data([]int{1})) {
		t.Error("the store under real directories: the tier reads other bytes")
	}
}

// TestAVllmFSNeverServesOrRemovesAFileThroughALinkPlantedInTheDirectory:
// a directory of the layout is a symbolic link to a directory outside,
// holding a file of the row's length under the key's name. A lookup does
// not index it (a miss), a load does not serve its bytes, and a delete of
// the key leaves it where it is.
func TestAVllmFSNeverServesOrRemovesAFileThroughALinkPlantedInTheDirectory(t *testing.T) {
	ctx := context.Background()
	root, outside := t.TempDir(), t.TempDir()
	tier := newFSTier(root, 8192)
	tier.init(t)
	e, g, ns := tierEngine(t, tier, nil)
	keys := tierKeys(8, 1)
	through, secret := plantRowOutside(t, tier, keys[0], outside)
	if got, err := e.Lookup(ctx, ns, keys); err != nil || got != 0 {
		t.Errorf("lookup of the key whose name goes through the link: %d, %v; want a miss", got, err)
	}
	wantRowOutsideNeitherServedNorRemoved(t, e, ns, g, keys[0], through, secret)
}

// TestAVllmFSLoadNeverServesAFileThroughALinkPlantedAfterItsRowWasIndexed:
// a row is indexed; then a directory on its way is replaced by a symbolic
// link to a directory outside holding a file of the row's length under
// the same name. A load of the key does not serve that file's bytes, and
// it stays where it is, through a delete of the key.
func TestAVllmFSLoadNeverServesAFileThroughALinkPlantedAfterItsRowWasIndexed(t *testing.T) {
	root, outside := t.TempDir(), t.TempDir()
	const row = 8192
	tier := newFSTier(root, row)
	tier.init(t)
	keys := tierKeys(10, 1)
	tier.store(t, keys[0], randomRow(rand.New(rand.NewPCG(5, 6)), row))
	e, g, ns := tierEngine(t, tier, nil)
	if st := e.Stats(); st.Entries != 1 {
		t.Fatalf("%d entries after open, want the row", st.Entries)
	}
	through, secret := plantRowOutside(t, tier, keys[0], outside)
	wantRowOutsideNeitherServedNorRemoved(t, e, ns, g, keys[0], through, secret)
}

// TestAVllmFSNeverServesARowThatIsASymbolicLink: a key's row name is a
// symbolic link to a file of the row's length outside vLLM's directory,
// whether found by a lookup or put over a row indexed before. Neither is
// served.
func TestAVllmFSNeverServesARowThatIsASymbolicLink(t *testing.T) {
	ctx := context.Background()
	root, outside := t.TempDir(), t.TempDir()
	const row = 8192
	tier := newFSTier(root, row)
	tier.init(t)
	keys := tierKeys(11, 2)
	tier.store(t, keys[1], randomRow(rand.New(rand.NewPCG(5, 6)), row))
	e, g, ns := tierEngine(t, tier, nil)
	secret := filepath.Join(outside, "secret")
	if err := os.WriteFile(secret, bytes.Repeat([]byte{0x5a}, tier.fileLen()), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		p := tier.path(k)
		os.MkdirAll(filepath.Dir(p), 0o755)
		os.Remove(p)
		if err := os.Symlink(secret, p); err != nil {
			t.Fatal(err)
		}
	}
	if got, err := e.Lookup(ctx, ns, keys[:1]); err != nil || got != 0 {
		t.Errorf("lookup of a key whose row is a link: %d, %v; want a miss", got, err)
	}
	c := newTestCache(t, e, ns, g, 2, layoutPlaneFirst)
	res := wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: keys, Blocks: [][]int{{0}, {1}}}))
	for i, k := range res.Keys {
		if k.Outcome == OutcomeLoaded {
			t.Errorf("key %d: load served the file a link at its row name points to", i)
		}
	}
}

// TestAVllmFSRootAndDataDirectoryMayBeSymbolicLinks: the root and the
// data directory are the operator's to place, by a link if so; only the
// directories below the data directory, and the rows, must not be links.
// A mount whose root and data directory are links adopts the row vLLM
// wrote there, serves it, and stores another through them.
func TestAVllmFSRootAndDataDirectoryMayBeSymbolicLinks(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	const row = 8192
	for _, d := range []string{"root", "data"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	root := filepath.Join(dir, "alias")
	if err := os.Symlink(filepath.Join(dir, "root"), root); err != nil {
		t.Fatal(err)
	}
	tier := newFSTier(root, row)
	tier.init(t)
	if err := os.Symlink(filepath.Join(dir, "data"), tier.base()+"_r0"); err != nil {
		t.Fatal(err)
	}
	keys := tierKeys(13, 2)
	want := randomRow(rand.New(rand.NewPCG(7, 7)), row)
	tier.store(t, keys[0], want)
	e, g, ns := tierEngine(t, tier, nil)
	if st := e.Stats(); st.Entries != 1 {
		t.Fatalf("%d entries after open, want the row", st.Entries)
	}
	c := newTestCache(t, e, ns, g, 2, layoutPlaneFirst)
	res := wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: keys[:1], Blocks: [][]int{{0}}}))
	if k := res.Keys[0]; k.Outcome != OutcomeLoaded || !bytes.Equal(c.data([]int{0}), want) {
		t.Errorf("load of the row under the linked data directory: %v (%v)", k.Outcome, k.Err)
	}
	c.fill(rand.New(rand.NewPCG(8, 8)), []int{1})
	storeAndCheck(t, e, c, keys[1:], [][]int{{1}})
	if got := tier.load(t, keys[1]); !bytes.Equal(got, c.data([]int{1})) {
		t.Error("the store through the linked root and data directory: the tier reads other bytes")
	}
}

// TestAVllmFSRemovalNeverUnlinksThroughALinkPlantedAfterItsCheck: a
// delete of an indexed row checks the file at its name, then unlinks it.
// Someone who can write vLLM's shared directory replaces a directory of
// the layout on the row's way by a symbolic link to a directory outside
// holding a file of the same name, between the check and the unlink. The
// unlink removes the row in the directory checked (moved away), and the
// file outside is left where it is.
func TestAVllmFSRemovalNeverUnlinksThroughALinkPlantedAfterItsCheck(t *testing.T) {
	ctx := context.Background()
	root, outside := t.TempDir(), t.TempDir()
	const row = 8192
	tier := newFSTier(root, row)
	tier.init(t)
	keys := tierKeys(14, 1)
	tier.store(t, keys[0], randomRow(rand.New(rand.NewPCG(3, 3)), row))
	p := tier.path(keys[0])
	top := filepath.Dir(filepath.Dir(p)) // <data dir>/<3 hex>
	rel, err := filepath.Rel(top, p)
	if err != nil {
		t.Fatal(err)
	}
	through := filepath.Join(outside, rel)
	if err := os.MkdirAll(filepath.Dir(through), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(through, []byte("not a row of vLLM's"), 0o644); err != nil {
		t.Fatal(err)
	}
	pl := &plantAt{outside: outside}
	pl.at = func(op fsys.Op, path string) bool { return op == fsys.OpRemove && path == p }
	pl.plant = func(string) { swapForLink(t, filepath.Dir(top), filepath.Base(top), outside) }
	e, _, ns := tierEngine(t, tier, &fsys.Faulty{FS: fsys.OS{}, Inj: pl})
	if st := e.Stats(); st.Entries != 1 {
		t.Fatalf("%d entries after open, want the row", st.Entries)
	}
	pl.armed.Store(true)
	if _, err := e.Delete(ctx, ns, keys); err != nil {
		t.Fatal(err)
	}
	if !pl.planted.Load() {
		t.Fatal("the delete never unlinked the row: no link planted")
	}
	if b, err := os.ReadFile(through); err != nil || string(b) != "not a row of vLLM's" {
		t.Errorf("the file outside the vllm-fs directory, of the row's name, was removed through the link (%v)", err)
	}
	if _, err := os.Stat(filepath.Join(top+".old", rel)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the row, in the directory checked, was not removed: %v", err)
	}
}

// TestAVllmFSConfigIsNeverReadThroughALink: someone who can write vLLM's
// shared directory put a symbolic link at the base directory's
// config.json, to a file outside that holds the very fields configured.
// Open refuses the mount, naming the path and the link, rather than
// take a file outside the directory for the base directory's config; the
// file outside is left as it was.
func TestAVllmFSConfigIsNeverReadThroughALink(t *testing.T) {
	root, outside := t.TempDir(), t.TempDir()
	tier := newFSTier(root, 8192)
	theirs := filepath.Join(outside, "config.json")
	if err := os.WriteFile(theirs, []byte(tier.configJSON()), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(tier.base(), 0o755); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(tier.base(), "config.json")
	if err := os.Symlink(theirs, link); err != nil {
		t.Fatal(err)
	}
	e, err := testOpen(context.Background(), Config{Mounts: []Mount{{Path: root, VLLMFS: &VLLMFS{Namespace: tierModel, Fields: tier.fields()}}},
		Policy: newTestPolicy(4, abi.OrderBlockMajor), Logger: testLogger(t), IOWorkers: 2})
	if err == nil {
		e.Close(context.Background())
		t.Fatal("Open took a config.json that is a symbolic link to a file outside the directory")
	}
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), link) || !strings.Contains(err.Error(), "symbolic link") {
		t.Errorf("Open: %v, want ErrInvalid naming %s as a symbolic link", err, link)
	}
	if b, err := os.ReadFile(theirs); err != nil || string(b) != tier.configJSON() {
		t.Errorf("the file outside was changed (%v)", err)
	}
}

// TestAVllmFSConfigIsWrittenInTheBaseDirectoryRead: Open writes a
// configured base directory's config.json (a temporary file, then a
// rename) where it has none or one that does not parse, and wrote it by
// path: where the base directory's name was swapped for a symbolic link
// after Open had read it (its config.json checked, or its absence), the
// temporary file and the rename went through the link, and config.json,
// written with the daemon's rights, landed in the directory the link
// reached. The directory is now opened once, its config.json read and
// written relative to that descriptor: the write lands in the directory
// read, wherever its name now points, and nothing reaches the link's
// target. The swap is made by the file system seam at the create of the
// temporary file, after the read and before the write.
func TestAVllmFSConfigIsWrittenInTheBaseDirectoryRead(t *testing.T) {
	for _, tc := range []struct {
		name string
		cut  bool // the base directory exists with an empty config.json; else none exists
	}{
		{"a config.json cut by a crash", true},
		{"no base directory yet", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root, outside := t.TempDir(), t.TempDir()
			tier := newFSTier(root, 8192)
			base := tier.base()
			if tc.cut {
				if err := os.MkdirAll(base, 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(base, "config.json"), nil, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			moved := filepath.Join(root, "moved")
			swapped, err := openSwappingBase(t, tier, outside, func(op fsys.Op, path string) bool {
				return op == fsys.OpOpen && filepath.Dir(path) == base && strings.HasPrefix(filepath.Base(path), tmpPrefix)
			})
			if !swapped {
				t.Fatalf("Open made no temporary file in %s (%v)", base, err)
			}
			if ents, rerr := os.ReadDir(outside); rerr != nil || len(ents) != 0 {
				t.Errorf("the link's target %s holds %v (%v): want nothing written there", outside, ents, rerr)
			}
			if b, rerr := os.ReadFile(filepath.Join(moved, "config.json")); rerr != nil || string(b) != tier.configJSON() {
				t.Errorf("the base directory read (now %s) holds config.json %q (%v): want the configured one", moved, b, rerr)
			}
			if err != nil {
				t.Errorf("Open: %v", err)
			}
		})
	}
}

// TestAVllmFSBaseDirectoryThatIsALinkAtStartIsTheOperators: a configured
// base directory that is a symbolic link when Open runs is the
// operator's (the directory put elsewhere), as a linked root or data
// directory is: its config.json is read, and written where it has none,
// in the directory the link reaches. Its config.json is checked as any
// base directory's: the directory listing skips links, so one recording
// other fields than configured was not read at all, and Open wrote the
// configured one over it; it is now refused, as in a directory.
func TestAVllmFSBaseDirectoryThatIsALinkAtStartIsTheOperators(t *testing.T) {
	for _, tc := range []struct {
		name   string
		config string // the target's config.json before Open; "" none
		refuse bool
	}{
		{"without a config.json", "", false},
		{"with the configured config.json", "configured", false},
		{"with another geometry's config.json", "other", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root, elsewhere := t.TempDir(), t.TempDir()
			tier := newFSTier(root, 8192)
			var before string
			switch tc.config {
			case "configured":
				before = tier.configJSON()
			case "other":
				other := tier
				other.tp = 2
				before = other.configJSON()
			}
			if before != "" {
				if err := os.WriteFile(filepath.Join(elsewhere, "config.json"), []byte(before), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			if err := os.Symlink(elsewhere, tier.base()); err != nil {
				t.Fatal(err)
			}
			e, err := testOpen(context.Background(), Config{Mounts: []Mount{{Path: root, VLLMFS: &VLLMFS{Namespace: tierModel, Fields: tier.fields()}}},
				Policy: newTestPolicy(4, abi.OrderBlockMajor), Logger: testLogger(t), IOWorkers: 2})
			if err == nil {
				e.Close(context.Background())
			}
			got, rerr := os.ReadFile(filepath.Join(elsewhere, "config.json"))
			switch {
			case tc.refuse:
				if !errors.Is(err, ErrInvalid) || string(got) != before {
					t.Errorf("Open: %v, config.json %q after: want ErrInvalid and the file left as it was", err, got)
				}
			case err != nil:
				t.Errorf("Open: %v", err)
			case rerr != nil || string(got) != tier.configJSON():
				t.Errorf("config.json in the link's target: %q (%v): want the configured one", got, rerr)
			}
		})
	}
}

// TestAVllmFSBaseDirectoryListedThenSwappedForALinkIsRefused: Open lists
// the root (a base directory there is opened O_NOFOLLOW, its config.json
// read), then opens the configured base directory again to read and
// write its config.json. That second open followed a link at the name,
// so a base directory the listing had shown as a directory, swapped for
// a symbolic link between the two opens, was taken for the operator's:
// its config.json was read in the link's target and, missing there,
// written there with the daemon's rights. A name the listing showed as a
// directory is now opened O_NOFOLLOW again: a link there was put after
// the engine looked, and Open refuses it, writing nothing anywhere. The
// swap is made by the file system seam at the second open of the name.
func TestAVllmFSBaseDirectoryListedThenSwappedForALinkIsRefused(t *testing.T) {
	for _, tc := range []struct {
		name   string
		config []byte // the base directory's config.json before Open; nil: none
	}{
		{"a config.json cut by a crash", []byte{}},
		{"no config.json", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root, outside := t.TempDir(), t.TempDir()
			tier := newFSTier(root, 8192)
			base := tier.base()
			if err := os.MkdirAll(base, 0o755); err != nil {
				t.Fatal(err)
			}
			if tc.config != nil {
				if err := os.WriteFile(filepath.Join(base, "config.json"), tc.config, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			var opens atomic.Int32
			swapped, err := openSwappingBase(t, tier, outside, func(op fsys.Op, path string) bool {
				return op == fsys.OpOpen && path == base && opens.Add(1) == 2
			})
			if !swapped {
				t.Fatalf("Open opened the base directory %d times, want a listing's and the configured one's (%v)", opens.Load(), err)
			}
			if ents, rerr := os.ReadDir(outside); rerr != nil || len(ents) != 0 {
				t.Errorf("the link's target %s holds %v (%v): want nothing written there", outside, ents, rerr)
			}
			if !errors.Is(err, ErrInvalid) {
				t.Errorf("Open: %v, want ErrInvalid (the link refused)", err)
			}
		})
	}
}

// openSwappingBase opens an engine on tier's root as a vllm-fs mount of
// its fields through a file system seam that, before the first operation
// at reports, moves tier's base directory to "moved" under the root and
// puts a symbolic link to outside at its name; the engine is closed
// again. It returns whether the swap was made, and Open's error.
func openSwappingBase(t *testing.T, tier fsTier, outside string, at func(op fsys.Op, path string) bool) (bool, error) {
	t.Helper()
	base := tier.base()
	var swapped atomic.Bool
	swap := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if at(op, path) && swapped.CompareAndSwap(false, true) {
			if err := os.Rename(base, filepath.Join(filepath.Dir(base), "moved")); err != nil {
				t.Error(err)
			}
			if err := os.Symlink(outside, base); err != nil {
				t.Error(err)
			}
		}
		return fsys.Fault{}
	})
	e, err := testOpen(context.Background(), Config{FS: &fsys.Faulty{FS: fsys.OS{}, Inj: swap},
		Mounts: []Mount{{Path: tier.root, VLLMFS: &VLLMFS{Namespace: tierModel, Fields: tier.fields()}}},
		Policy: newTestPolicy(4, abi.OrderBlockMajor), Logger: testLogger(t), IOWorkers: 2})
	if err == nil {
		e.Close(context.Background())
	}
	return swapped.Load(), err
}
