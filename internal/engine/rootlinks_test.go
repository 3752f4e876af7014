//go:build invariants

package engine

import (
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/host/policy"
)

// The files the engine keeps in a mount's root for itself (its spare
// owner file, the O_DIRECT probe's) are made and removed never through a
// symbolic link put in place of the root since Open resolved its path:
// the mount's directory may be shared, and whoever can rename it (a
// user of the directory above, another node of a shared mount) must not
// have the daemon make, flock or remove files where a link points.

// rootUnderSwap makes a mount root, "root", in a fresh directory of a
// memory file system (spares, and so owner files, are kept only there),
// and a directory outside it on the same file system; it returns the
// parent, the root and the outside directory.
func rootUnderSwap(t *testing.T) (parent, root, outside string) {
	t.Helper()
	parent, outside = tmpfsDir(t), tmpfsDir(t)
	root = filepath.Join(parent, "root")
	if err := os.Mkdir(root, 0o755); err != nil {
		t.Fatal(err)
	}
	return parent, root, outside
}

// openOnRoot opens an engine on root through fs, failing the test where
// Open fails; the caller closes it.
func openOnRoot(t *testing.T, root string, fs fsys.FS) *Engine {
	t.Helper()
	pol := &fixedPathPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}
	name := "k.kv"
	pol.path.Store(&name)
	e, err := testOpen(context.Background(), Config{Mounts: []Mount{{Path: root}}, NodeID: "a", FS: fs, IOWorkers: 2, Logger: testLogger(t),
		NewPolicy: func(policy.Index) (policy.Policy, error) { return pol, nil }})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// inRoot reports whether path's directory is the mount root "root" (by
// its name: opens without links take the root's resolved path).
func inRoot(path string) bool { return filepath.Base(filepath.Dir(path)) == "root" }

// TestAnOwnerFileIsNeverMadeOrRemovedThroughALinkInPlaceOfTheRoot: an
// engine makes its spare owner file in the mount's root at Open (a
// temporary name, flocked, renamed) and removes it at Close. Someone
// replaces the root by a symbolic link to a directory outside the mount
// just before the make, or just before the removal, where a file of the
// owner file's name waits. Nothing is made outside, and the file there is
// not removed; the owner file made before the swap is removed from the
// directory it was made in.
func TestAnOwnerFileIsNeverMadeOrRemovedThroughALinkInPlaceOfTheRoot(t *testing.T) {
	t.Run("made", func(t *testing.T) {
		parent, _, outside := rootUnderSwap(t)
		p := &plantAt{outside: outside}
		p.at = func(op fsys.Op, path string) bool {
			return op == fsys.OpOpen && inRoot(path) && strings.HasPrefix(filepath.Base(path), tmpPrefix)
		}
		p.plant = func(string) { swapForLink(t, parent, "root", outside) }
		p.armed.Store(true)
		e := openOnRoot(t, filepath.Join(parent, "root"), &fsys.Faulty{FS: fsys.OS{}, Inj: p})
		planted := p.planted.Load()
		e.Close(context.Background())
		if !planted {
			t.Fatal("Open made no owner file: no link planted")
		}
		if names := p.seenOutside(); len(names) != 0 {
			t.Errorf("the owner file was made outside the mount, through the link: %v", names)
		}
	})
	t.Run("removed", func(t *testing.T) {
		parent, root, outside := rootUnderSwap(t)
		const theirs = "not kvhost's"
		var target string
		p := &plantAt{outside: outside}
		p.at = func(op fsys.Op, path string) bool {
			return (op == fsys.OpRemove || op == fsys.OpStat) && inRoot(path) && strings.HasPrefix(filepath.Base(path), ownerPrefix)
		}
		p.plant = func(path string) {
			target = filepath.Join(outside, filepath.Base(path))
			if err := os.WriteFile(target, []byte(theirs), 0o644); err != nil {
				t.Error(err)
			}
			swapForLink(t, parent, "root", outside)
		}
		e := openOnRoot(t, root, &fsys.Faulty{FS: fsys.OS{}, Inj: p})
		if len(ownerFiles(t, root)) != 1 {
			t.Fatalf("owner files after Open: %v, want one", ownerFiles(t, root))
		}
		p.armed.Store(true)
		e.Close(context.Background())
		if !p.planted.Load() {
			t.Fatal("Close removed no owner file: no link planted")
		}
		if b, err := os.ReadFile(target); err != nil || string(b) != theirs {
			t.Errorf("the file outside the mount, of the owner file's name, was removed through the link (%v)", err)
		}
		if left := ownerFiles(t, filepath.Join(parent, "root.old")); len(left) != 0 {
			t.Errorf("the owner file, in the root it was made in, was not removed: %v", left)
		}
	})
}

// TestTheDirectProbeNeverMakesAFileThroughALinkInPlaceOfTheRoot: Open
// probes whether a mount takes O_DIRECT with a file it creates, writes
// and removes in the mount's root. Someone replaces the root by a
// symbolic link to a directory outside the mount just before the probe's
// create, after Open resolved the root's path. The probe makes no file
// outside (it fails, naming the root: buffered I/O on the mount), and
// removes nothing there.
func TestTheDirectProbeNeverMakesAFileThroughALinkInPlaceOfTheRoot(t *testing.T) {
	parent, root, outside := rootUnderSwap(t)
	p := &plantAt{outside: outside}
	p.at = func(op fsys.Op, path string) bool {
		return op == fsys.OpOpen && inRoot(path) && strings.HasPrefix(filepath.Base(path), probePrefix)
	}
	p.plant = func(string) { swapForLink(t, parent, "root", outside) }
	p.armed.Store(true)
	e := openOnRoot(t, root, &fsys.Faulty{FS: fsys.OS{}, Inj: p})
	why := e.mounts[0].ioWhy
	e.Close(context.Background())
	if !p.planted.Load() {
		t.Fatal("Open probed no O_DIRECT: no link planted")
	}
	if names := p.seenOutside(); len(names) != 0 {
		t.Errorf("the probe made a file outside the mount, through the link: %v", names)
	}
	if !strings.Contains(why, "symbolic link") || !strings.Contains(why, root) {
		t.Errorf("the mount's I/O mode: %q, want the probe's failure naming the root and the link", why)
	}
}

// TestAClusterWalkMakesNoFileThroughALinkPlantedInTheMount: a node that
// adopts a dead node walks the mount for its files, and first makes and
// removes a file in each directory it lists, so that the listing is
// fresh on a client that caches listings. Someone replaces a directory
// the walk found by a symbolic link to one outside the mount just before
// that file is made. Nothing is made, or removed, outside.
func TestAClusterWalkMakesNoFileThroughALinkPlantedInTheMount(t *testing.T) {
	ctx := context.Background()
	dir, outside := t.TempDir(), t.TempDir()
	r := rand.New(rand.NewPCG(6, 6))
	d := clusterNode(t, dir, "d", 1<<30, time.Hour)
	storeKeys(t, d, "d", 1, r)
	var sub string // the directory of D's file
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, ent := range ents {
		if ent.IsDir() && !strings.HasPrefix(ent.Name(), ".") {
			sub = ent.Name()
		}
	}
	if sub == "" {
		t.Fatalf("no directory of D's file under %s", dir)
	}
	clock := newTestClock()
	p := &plantAt{outside: outside}
	p.at = func(op fsys.Op, path string) bool {
		return op == fsys.OpOpen && filepath.Dir(path) == filepath.Join(dir, sub) && strings.HasPrefix(filepath.Base(path), tmpPrefix)
	}
	p.plant = func(string) { swapForLink(t, dir, sub, outside) }
	a := clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: 1 << 30, ClusterInterval: time.Hour}}, NodeID: "a",
		FS: &fsys.Faulty{FS: fsys.OS{}, Inj: p}, Now: clock.now})
	if err := d.e.Close(ctx); err != nil { // after A's start, which sees D run
		t.Fatal(err)
	}
	t.Cleanup(func() { // the directory back, for the engine's last check
		if p.planted.Load() {
			os.Remove(filepath.Join(dir, sub))
			os.Rename(filepath.Join(dir, sub+".old"), filepath.Join(dir, sub))
		}
	})
	p.armed.Store(true)
	tickPastDeadBound(ctx, a.e, clock)
	if !p.planted.Load() {
		t.Fatal("the tick walked no directory of D's file: no link planted")
	}
	if names := p.seenOutside(); len(names) != 0 {
		t.Errorf("the walk made a file outside the mount, through the link: %v", names)
	}
}
