//go:build invariants

package engine

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/fstype"
	"github.com/kvhost/kvhost/internal/testwait"
)

// typedFS is the OS's file system reporting another statfs type (a
// network file system) for every path.
type typedFS struct {
	fsys.OS
	magic int64
}

func (f typedFS) Statfs(path string) (fsys.StatFS, error) {
	st, err := f.OS.Statfs(path)
	st.Type = f.magic
	return st, err
}

// sharedPair is nodes A and B on one directory: cluster mount members, or
// plain mounts of fs (a network file system's type, or the test
// machine's own).
func sharedPair(t *testing.T, cluster bool, fs fsys.FS) (a, b *node) {
	t.Helper()
	dir := t.TempDir()
	if cluster {
		return clusterNode(t, dir, "a", 1<<30, time.Hour), clusterNode(t, dir, "b", 1<<30, time.Hour)
	}
	m := Mount{Path: dir}
	return openNodeOn(t, m, "a", fs, 1), openNodeOn(t, m, "b", fs, 1)
}

// TestAKeyPinnedOnOneNodeLoadsAfterAnotherNodeRemovesItsFile: node A
// stores a key; node B's client pins it (B finds A's file); A then
// removes the file — its client's delete, its purge of the model, or, on
// a cluster mount, its tick applying a purge record B wrote — where A
// cannot see B's pin. B's load of the pinned key still returns its bytes,
// whether or not B noticed the removal first (a lookup there misses,
// taking the entry out of B's index): B's pin held the file open. Once
// the pin ends, B holds nothing open and the key is a miss.
func TestAKeyPinnedOnOneNodeLoadsAfterAnotherNodeRemovesItsFile(t *testing.T) {
	ceph := typedFS{magic: 0x00c36400}
	for _, tc := range []struct {
		name    string
		cluster bool
		fs      fsys.FS
		remove  func(t *testing.T, a, b *node, keys [][]byte)
		left    int // files on the mount after the removal
	}{
		{"cluster-delete", true, nil, deleteOnA, 1},
		{"cluster-purge", true, nil, purgeOnA, 0},
		{"cluster-purge-record", true, nil, func(t *testing.T, a, b *node, keys [][]byte) {
			if _, err := b.e.Purge(context.Background(), smallGeometry(true).Fingerprint()); err != nil {
				t.Fatal(err)
			}
			a.tick()
		}, 0},
		{"network-fs-delete", false, ceph, deleteOnA, 1},
		{"network-fs-purge", false, ceph, purgeOnA, 0},
	} {
		for _, noticed := range []bool{false, true} {
			name := tc.name
			if noticed {
				name += "-noticed-first"
			}
			t.Run(name, func(t *testing.T) {
				ctx := context.Background()
				a, b := sharedPair(t, tc.cluster, tc.fs)
				keys := storeKeys(t, a, "k", 2, rand.New(rand.NewPCG(21, 22)))
				want := keyBytes(a, 0)
				pin, held, err := b.e.Pin(ctx, b.ns, keys[:1], 0)
				if err != nil || !held[0] {
					t.Fatalf("B's pin of A's key: %v, %v", held, err)
				}
				if n := b.e.PinnedFilesOpen(); n != 1 {
					t.Fatalf("B holds %d files open for its pin, want 1", n)
				}
				tc.remove(t, a, b, keys)
				if n := len(kvFiles(t, a.e.mounts[0].root)); n != tc.left {
					t.Fatalf("%d files left after A's removal, want %d", n, tc.left)
				}
				if noticed {
					if n := b.hits(t, keys[:1]); n != 0 {
						t.Fatalf("B's lookup of the removed key: %d hits, want a miss", n)
					}
				}
				loadAndCompare(t, b.e, b.c, keys[:1], [][]int{{60, 61, 62, 63}}, [][]byte{want})
				checkIndex(t, b.e)
				if got := b.e.Unpin(ctx, pin); got != 1 {
					t.Fatalf("unpin released %d keys, want 1", got)
				}
				if n := b.e.PinnedFilesOpen(); n != 0 {
					t.Fatalf("B holds %d files open after its last unpin, want 0", n)
				}
				checkIndex(t, b.e)
				res := wait(t)(b.e.Load(ctx, LoadRequest{Cache: b.c.id, Keys: keys[:1], Blocks: [][]int{{60, 61, 62, 63}}}))
				if o := res.Keys[0].Outcome; o != OutcomeMissing {
					t.Fatalf("load after the pin ended: %v (%v), want missing", o, res.Keys[0].Err)
				}
			})
		}
	}
}

// deleteOnA deletes keys[0] through A.
func deleteOnA(t *testing.T, a, _ *node, keys [][]byte) {
	t.Helper()
	if n, err := a.e.Delete(context.Background(), a.ns, keys[:1]); err != nil || n != 1 {
		t.Fatalf("A's delete: %d, %v", n, err)
	}
}

// purgeOnA purges the model through A.
func purgeOnA(t *testing.T, a, _ *node, _ [][]byte) {
	t.Helper()
	if _, err := a.e.Purge(context.Background(), smallGeometry(true).Fingerprint()); err != nil {
		t.Fatal(err)
	}
}

// checkIndex fails t where e's index breaks an invariant.
func checkIndex(t *testing.T, e *Engine) {
	t.Helper()
	err := e.ix.Check()
	if err != nil {
		t.Fatal(err)
	}
}

// TestAPinHoldsOpenOnlyFilesAnotherEngineMayRemove: a pin opens no file
// where only this engine removes it (a local file system without a
// cluster capacity; this node's own file on a cluster mount), nor on NFS,
// where another client's removal ends the file under an open descriptor;
// it holds one open on a network file system and for another node's file
// on a cluster mount.
func TestAPinHoldsOpenOnlyFilesAnotherEngineMayRemove(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name     string
		cluster  bool
		fs       fsys.FS
		pinOnA   bool // A pins its own file, not B
		wantOpen int64
	}{
		{"local-fs", false, fsys.OS{}, false, 0},
		{"nfs", false, typedFS{magic: fstype.NFS}, false, 0},
		{"fuse", false, typedFS{magic: fstype.FUSE}, false, 1},
		{"cluster-own-file", true, nil, true, 0},
		{"cluster-other-nodes-file", true, nil, false, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := sharedPair(t, tc.cluster, tc.fs)
			keys := storeKeys(t, a, "k", 1, rand.New(rand.NewPCG(23, 24)))
			p := b
			if tc.pinOnA {
				p = a
			}
			pin, held, err := p.e.Pin(ctx, p.ns, keys, 0)
			if err != nil || !held[0] {
				t.Fatalf("pin: %v, %v", held, err)
			}
			if n := p.e.PinnedFilesOpen(); n != tc.wantOpen {
				t.Fatalf("%d files held open, want %d", n, tc.wantOpen)
			}
			// A second pin of the file shares the one held open.
			pin2, held, err := p.e.Pin(ctx, p.ns, keys, 0)
			if err != nil || !held[0] {
				t.Fatalf("second pin: %v, %v", held, err)
			}
			if n := p.e.PinnedFilesOpen(); n != tc.wantOpen {
				t.Fatalf("after a second pin, %d files held open, want %d", n, tc.wantOpen)
			}
			p.e.Unpin(ctx, pin)
			if n := p.e.PinnedFilesOpen(); n != tc.wantOpen {
				t.Fatalf("after the first unpin, %d files held open, want %d (the second pin holds it)", n, tc.wantOpen)
			}
			p.e.Unpin(ctx, pin2)
			if n := p.e.PinnedFilesOpen(); n != 0 {
				t.Fatalf("after the last unpin, %d files held open", n)
			}
		})
	}
}

// TestAPinOfAHeldFileThatVanishedMisses: B's first pin holds A's file
// open; A deletes it. A second pin of the key on B checks the name, finds
// nothing there and misses: a removed file is kept for the pins that held
// it, not for later ones. The first pin's load still reads it.
func TestAPinOfAHeldFileThatVanishedMisses(t *testing.T) {
	ctx := context.Background()
	a, b := sharedPair(t, true, nil)
	keys := storeKeys(t, a, "k", 1, rand.New(rand.NewPCG(25, 26)))
	want := keyBytes(a, 0)
	pin, held, err := b.e.Pin(ctx, b.ns, keys, 0)
	if err != nil || !held[0] {
		t.Fatalf("pin: %v, %v", held, err)
	}
	deleteOnA(t, a, b, keys)
	if _, held, err := b.e.Pin(ctx, b.ns, keys, 0); err != nil || held[0] {
		t.Fatalf("second pin after the removal: %v, %v; want the key not pinned", held, err)
	}
	loadAndCompare(t, b.e, b.c, keys, [][]int{{60, 61, 62, 63}}, [][]byte{want})
	b.e.Unpin(ctx, pin)
	if n := b.e.PinnedFilesOpen(); n != 0 {
		t.Fatalf("%d files held open after the unpin", n)
	}
}

// TestPinsBeyondTheOpenFileBoundCheckByName: with a bound of one open
// file, B's pin of a second file of A's is checked by name only (its key
// is pinned, the file not held) and counted; the first file stays held.
func TestPinsBeyondTheOpenFileBoundCheckByName(t *testing.T) {
	ctx := context.Background()
	a, b := sharedPair(t, true, nil)
	b.e.pinTab.maxOpen = 1
	keys := storeKeys(t, a, "k", 2, rand.New(rand.NewPCG(27, 28)))
	_, held, err := b.e.Pin(ctx, b.ns, keys, 0)
	if err != nil || !held[0] || !held[1] {
		t.Fatalf("pin: %v, %v", held, err)
	}
	st := b.e.Stats()
	if st.PinnedFilesOpen != 1 || st.PinnedFilesUnopened != 1 {
		t.Fatalf("open %d, unopened %d; want 1 and 1", st.PinnedFilesOpen, st.PinnedFilesUnopened)
	}
}

// TestAPinThatCannotOpenItsFileDropsNothingOnAnUnclearError: where the
// pin's open fails with an error that says nothing of the file (EIO), the
// key is not pinned and the entry stays indexed, as a stat's failure
// leaves it.
func TestAPinThatCannotOpenItsFileDropsNothingOnAnUnclearError(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	a := clusterNode(t, dir, "a", 1<<30, time.Hour)
	keys := storeKeys(t, a, "k", 1, rand.New(rand.NewPCG(29, 30)))
	var failOpen atomic.Bool
	faulty := &fsys.Faulty{FS: fsys.OS{}, Inj: fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if op == fsys.OpOpen && failOpen.Load() && strings.HasSuffix(path, ".kv") {
			return fsys.Fault{Err: syscall.EIO}
		}
		return fsys.Fault{}
	})}
	b := clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: 1 << 30, ClusterInterval: time.Hour}}, NodeID: "b", FS: faulty})
	if n := b.hits(t, keys); n != 1 {
		t.Fatalf("B finds %d of A's keys, want 1", n)
	}
	failOpen.Store(true)
	if _, held, err := b.e.Pin(ctx, b.ns, keys, 0); err != nil || held[0] {
		t.Fatalf("pin with its open failing: %v, %v; want the key not pinned", held, err)
	}
	failOpen.Store(false)
	if n := b.e.PinnedFilesOpen(); n != 0 {
		t.Fatalf("%d files held open after a failed open", n)
	}
	if n := b.hits(t, keys); n != 1 {
		t.Fatalf("after the failed open, B finds %d keys, want 1 (the entry kept)", n)
	}
}

// TestLoadsRacingPinsAndUnpinsOfAHeldFileLeakNoDescriptor: B's loads of
// A's key run while B's pins of it come and go (the held file opened,
// shared by the loads, closed at each last unpin): every load reads the
// key's bytes, and at the end B holds no file open and the process has
// no more descriptors than before. Run with -race.
func TestLoadsRacingPinsAndUnpinsOfAHeldFileLeakNoDescriptor(t *testing.T) {
	ctx := context.Background()
	a, b := sharedPair(t, true, nil)
	keys := storeKeys(t, a, "k", 1, rand.New(rand.NewPCG(31, 32)))
	want := keyBytes(a, 0)
	if n := b.hits(t, keys); n != 1 {
		t.Fatalf("B finds %d keys, want 1", n)
	}
	before := openDescriptors(t)
	done := make(chan struct{})
	pinErr := make(chan error, 1)
	go func() {
		defer close(pinErr)
		for {
			select {
			case <-done:
				return
			default:
			}
			id, held, err := b.e.Pin(ctx, b.ns, keys, 0)
			if err != nil || !held[0] {
				pinErr <- fmt.Errorf("pin: %v, %v", held, err)
				return
			}
			b.e.Unpin(ctx, id)
		}
	}()
	for range 200 {
		loadAndCompare(t, b.e, b.c, keys, [][]int{{60, 61, 62, 63}}, [][]byte{want})
	}
	close(done)
	if err := <-pinErr; err != nil {
		t.Fatal(err)
	}
	if n := b.e.PinnedFilesOpen(); n != 0 {
		t.Fatalf("%d files held open after the last unpin", n)
	}
	// Another goroutine of the engine may hold one for a moment.
	testwait.Until(t, "the process's descriptors back to their count before the loads", time.Minute, func() bool {
		return openDescriptors(t) <= before
	})
}

// openDescriptors is how many descriptors the process has open.
func openDescriptors(t *testing.T) int {
	t.Helper()
	ds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ds)
}

// TestAKeyPinnedOnOneNodeLoadsAfterItsNodeEvictsTheFile: on a cluster
// mount bounded at 8 files, B's client pins A's oldest key; A's stores
// then pass the bound and A evicts its oldest files, that one included
// (B's pin is not A's to see). B's load of the key still returns its
// bytes, from the file B's pin holds open.
func TestAKeyPinnedOnOneNodeLoadsAfterItsNodeEvictsTheFile(t *testing.T) {
	ctx := context.Background()
	probe := openNode(t, t.TempDir(), "probe", nil, 1)
	storeAndCheck(t, probe.e, probe.c, testKeys("p", 1), [][]int{{0, 1, 2, 3}})
	capacity := 8 * probe.e.Stats().Mounts[0].Used

	dir := t.TempDir()
	a := clusterNode(t, dir, "a", capacity, time.Hour)
	b := clusterNode(t, dir, "b", capacity, time.Hour)
	r := rand.New(rand.NewPCG(33, 34))
	first := storeKeys(t, a, "first", 1, r)
	want := keyBytes(a, 0)
	pin, held, err := b.e.Pin(ctx, b.ns, first, 0)
	if err != nil || !held[0] {
		t.Fatalf("B's pin of A's key: %v, %v", held, err)
	}
	storeKeys(t, a, "more", 12, r)
	if n := a.hits(t, first); n != 0 {
		t.Fatalf("A still holds its oldest key after 12 more stores against a bound of 8 files")
	}
	loadAndCompare(t, b.e, b.c, first, [][]int{{60, 61, 62, 63}}, [][]byte{want})
	b.e.Unpin(ctx, pin)
	if n := b.e.PinnedFilesOpen(); n != 0 {
		t.Fatalf("%d files held open after the unpin", n)
	}
}

// TestAHeldFileFoundCorruptIsNotServedAgain: B's pin holds A's file open;
// the file's header is then damaged (through its name, so the held
// descriptor reads the damage too), and A's removal of it comes first or
// not at all. B's first load of the pinned key fails as corrupt, which
// drops the file; a second load misses, as it does for a corrupt file no
// pin holds open, rather than reading the held file again, failing again
// and counting the same file corrupt once more.
func TestAHeldFileFoundCorruptIsNotServedAgain(t *testing.T) {
	ctx := context.Background()
	for _, removed := range []bool{false, true} {
		t.Run(fmt.Sprintf("removed-by-its-node-%v", removed), func(t *testing.T) {
			a, b := sharedPair(t, true, nil)
			keys := storeKeys(t, a, "k", 1, rand.New(rand.NewPCG(33, 34)))
			pin, held, err := b.e.Pin(ctx, b.ns, keys, 0)
			if err != nil || !held[0] {
				t.Fatalf("pin: %v, %v", held, err)
			}
			files := kvFiles(t, a.e.mounts[0].root)
			if len(files) != 1 {
				t.Fatalf("%d files on the mount, want 1", len(files))
			}
			f, err := os.OpenFile(files[0], os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			_, err = f.WriteAt([]byte{0x55}, 40)
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				t.Fatal(err)
			}
			if removed {
				deleteOnA(t, a, b, keys)
				if n := b.hits(t, keys); n != 0 {
					t.Fatalf("B's lookup of the removed key: %d hits, want a miss", n)
				}
			}
			load := func() KeyResult {
				t.Helper()
				res := wait(t)(b.e.Load(ctx, LoadRequest{Cache: b.c.id, Keys: keys, Blocks: [][]int{{60, 61, 62, 63}}}))
				return res.Keys[0]
			}
			if kr := load(); kr.Outcome != OutcomeFailed || !errors.Is(kr.Err, ErrCorrupt) {
				t.Fatalf("first load of the damaged file: %v (%v), want failed, corrupt", kr.Outcome, kr.Err)
			}
			if kr := load(); kr.Outcome != OutcomeMissing {
				t.Fatalf("second load: %v (%v), want missing: the file was found corrupt", kr.Outcome, kr.Err)
			}
			if n := b.e.Stats().Corrupt; n != 1 {
				t.Fatalf("%d files counted corrupt, want 1", n)
			}
			checkIndex(t, b.e)
			b.e.Unpin(ctx, pin)
			if n := b.e.PinnedFilesOpen(); n != 0 {
				t.Fatalf("%d files held open after the unpin", n)
			}
			checkIndex(t, b.e)
		})
	}
}

// TestAKeyHeldInTwoRemovedFilesLoadsUntilItsLastPinEnds: B's first pin
// holds A's file of a key; A deletes it and stores the key again, in a new
// file, which B's second pin holds; A deletes that one too, and B noticed
// both removals. The second pin ends first: the first pin's load still
// reads its own held file, which the second file's end does not take from
// the loads.
func TestAKeyHeldInTwoRemovedFilesLoadsUntilItsLastPinEnds(t *testing.T) {
	ctx := context.Background()
	a, b, keys, want, pin1 := storedAgainAfterAHeldRemoval(t, 35)
	pin2 := mustPin(t, b, keys)
	if n := b.e.PinnedFilesOpen(); n != 2 {
		t.Fatalf("B holds %d files open, want 2", n)
	}
	deleteOnA(t, a, b, keys)
	if n := b.hits(t, keys); n != 0 {
		t.Fatalf("B's lookup after the second removal: %d hits, want a miss", n)
	}
	checkIndex(t, b.e)
	b.e.Unpin(ctx, pin2)
	checkIndex(t, b.e)
	loadAndCompare(t, b.e, b.c, keys, [][]int{{60, 61, 62, 63}}, [][]byte{want})
	b.e.Unpin(ctx, pin1)
	if n := b.e.PinnedFilesOpen(); n != 0 {
		t.Fatalf("%d files held open after the last unpin", n)
	}
	checkIndex(t, b.e)
}

// storedAgainAfterAHeldRemoval: A stores a key (its bytes: want); B's pin
// holds A's file of it; A deletes it, and B's lookup notices (the entry
// leaves B's index, kept for the pin's loads); A stores the key again, in
// a new file of other bytes. The rand seeds are seed to seed+3.
func storedAgainAfterAHeldRemoval(t *testing.T, seed uint64) (a, b *node, keys [][]byte, want []byte, pin PinID) {
	t.Helper()
	a, b = sharedPair(t, true, nil)
	keys = storeKeys(t, a, "k", 1, rand.New(rand.NewPCG(seed, seed+1)))
	want = keyBytes(a, 0)
	pin = mustPin(t, b, keys)
	deleteOnA(t, a, b, keys)
	if n := b.hits(t, keys); n != 0 {
		t.Fatalf("B's lookup after A's removal: %d hits, want a miss", n)
	}
	storeKeys(t, a, "k", 1, rand.New(rand.NewPCG(seed+2, seed+3)))
	return a, b, keys, want, pin
}

// mustPin pins keys on n, failing t unless every one is pinned.
func mustPin(t *testing.T, n *node, keys [][]byte) PinID {
	t.Helper()
	id, held, err := n.e.Pin(context.Background(), n.ns, keys, 0)
	if err != nil || slices.Contains(held, false) {
		t.Fatalf("pin of %d keys: %v, %v", len(keys), held, err)
	}
	return id
}

// TestAPinnedKeyLoadsFromItsHeldFileOverANewerFileThatVanished: B's pin
// holds A's file of a key; A deletes it, and B's lookup notices. A stores
// the key again in a new file, which B's lookup finds and indexes (no pin
// holds it), and A deletes that one too, unnoticed by B. B's load of the
// pinned key reads the file its pin holds open, not the newer indexed
// file, whose name is gone.
func TestAPinnedKeyLoadsFromItsHeldFileOverANewerFileThatVanished(t *testing.T) {
	ctx := context.Background()
	a, b, keys, want, pin := storedAgainAfterAHeldRemoval(t, 39)
	if n := b.hits(t, keys); n != 1 {
		t.Fatalf("B's lookup of the key stored again: %d hits, want 1", n)
	}
	deleteOnA(t, a, b, keys)
	loadAndCompare(t, b.e, b.c, keys, [][]int{{60, 61, 62, 63}}, [][]byte{want})
	checkIndex(t, b.e)
	b.e.Unpin(ctx, pin)
	if n := b.e.PinnedFilesOpen(); n != 0 {
		t.Fatalf("%d files held open after the unpin", n)
	}
	checkIndex(t, b.e)
}
