//go:build invariants

package engine

import (
	"context"
	"maps"
	"math/rand/v2"
	"os"
	"slices"
	"sync"
	"syscall"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/engine/removals"
)

// unlinkWatchFS checks, at each unlink (or rename away) of a data file,
// that the removal feed has not yet recorded the file's key: a record
// made before its file is gone is a key a crash at that moment leaves
// loadable after the restart, though subscribers were told it is gone.
// fail, where set, makes the first unlink of that path fail with EIO (a
// removal that leaves the file: index.Leaving's left).
type unlinkWatchFS struct {
	fsys.OS
	mu     sync.Mutex
	sub    *removals.Subscription
	keyOf  map[string]string // data file path -> its key
	told   map[string]bool   // keys the feed recorded so far
	early  []string          // keys recorded before their file was gone
	fail   string
	failed bool
}

// gone is called just before path goes; it reports the error to fail
// the operation with, if any.
func (w *unlinkWatchFS) gone(path string) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	key, ok := w.keyOf[path]
	if !ok || w.sub == nil {
		return nil
	}
	w.readLocked()
	if w.told[key] {
		w.early = append(w.early, key)
	}
	if path == w.fail && !w.failed {
		w.failed = true
		return &os.PathError{Op: "unlink", Path: path, Err: syscall.EIO}
	}
	return nil
}

// readLocked takes in what the feed recorded since the last read.
func (w *unlinkWatchFS) readLocked() {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for {
		b, err := w.sub.Next(ctx, 64)
		if err != nil {
			return
		}
		for _, r := range b.Records {
			w.told[r.Key] = true
		}
	}
}

// recorded returns the keys the feed recorded so far, and those recorded
// before their file was gone.
func (w *unlinkWatchFS) recorded() (told map[string]bool, early []string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.readLocked()
	return maps.Clone(w.told), slices.Clone(w.early)
}

func (w *unlinkWatchFS) Remove(name string) error {
	if err := w.gone(name); err != nil {
		return err
	}
	return w.OS.Remove(name)
}

func (w *unlinkWatchFS) RemoveAt(dir fsys.File, path string) error {
	if err := w.gone(path); err != nil {
		return err
	}
	return w.OS.RemoveAt(dir, path)
}

func (w *unlinkWatchFS) Rename(oldpath, newpath string) error {
	if err := w.gone(oldpath); err != nil {
		return err
	}
	return w.OS.Rename(oldpath, newpath)
}

func (w *unlinkWatchFS) RenameAt(olddir fsys.File, oldpath string, newdir fsys.File, newpath string, noReplace bool) error {
	if err := w.gone(oldpath); err != nil {
		return err
	}
	return w.OS.RenameAt(olddir, oldpath, newdir, newpath, noReplace)
}

// TestARemovalIsRecordedOnlyOnceItsFileIsGone: every way this engine
// removes a key's file (an eviction, an eviction keeping the file as a
// spare, one whose path a job held, a delete, a purge, a corrupt file)
// records the key only after the file is gone from its path, so that a
// crash at any moment never leaves a key loadable after the restart that
// subscribers were told is gone; a removal whose unlink fails records
// nothing (the file, left, would load again after a restart) until a
// later try removes it, then records the key once, with the first
// removal's reason.
func TestARemovalIsRecordedOnlyOnceItsFileIsGone(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := 4096 + g.KeyBytes()
	for _, tc := range []struct {
		name   string
		mount  Mount // Path set by the test
		tmpfs  bool  // the mount on a memory file system, where evicted files are kept as spares
		reason removals.Reason
		// act removes keys (all stored, one per file); fail, where not
		// "", is the key whose first unlink fails.
		act  func(t *testing.T, e *Engine, n *node, keys [][]byte)
		fail string
	}{
		{name: "evicted", mount: Mount{Capacity: 6 * fileLen}, reason: removals.Evicted,
			act: func(t *testing.T, e *Engine, n *node, keys [][]byte) {
				storeKeys(t, n, "more", 6, rand.New(rand.NewPCG(1, 2)))
			}},
		{name: "evicted as a spare", mount: Mount{Capacity: 6 * fileLen}, tmpfs: true, reason: removals.Evicted,
			act: func(t *testing.T, e *Engine, n *node, keys [][]byte) {
				storeKeys(t, n, "more", 6, rand.New(rand.NewPCG(1, 2)))
				if e.Stats().Reused == 0 {
					t.Fatal("no evicted file kept as a spare and reused")
				}
			}},
		{name: "evicted while its path is held", mount: Mount{Capacity: 6 * fileLen}, reason: removals.Evicted,
			act: func(t *testing.T, e *Engine, n *node, keys [][]byte) {
				var paths []string
				for _, k := range keys {
					p := e.find(e.tables.get(n.ns), k).Path
					if ok, _, _ := e.ix.Claim(p); !ok {
						t.Fatalf("path %s already held", p)
					}
					paths = append(paths, p)
				}
				storeKeys(t, n, "more", 3, rand.New(rand.NewPCG(1, 2)))
				for _, p := range paths {
					e.rm.release(p)
				}
			}},
		{name: "deleted", reason: removals.Deleted,
			act: func(t *testing.T, e *Engine, n *node, keys [][]byte) {
				if d, err := e.Delete(ctx, n.ns, keys[1:4]); d != 3 || err != nil {
					t.Fatalf("Delete: %d, %v", d, err)
				}
			}},
		{name: "deleted while its path is held", reason: removals.Deleted,
			act: func(t *testing.T, e *Engine, n *node, keys [][]byte) {
				p := e.find(e.tables.get(n.ns), keys[2]).Path
				if ok, _, _ := e.ix.Claim(p); !ok {
					t.Fatalf("path %s already held", p)
				}
				if d, err := e.Delete(ctx, n.ns, keys[2:3]); d != 1 || err != nil {
					t.Fatalf("Delete: %d, %v", d, err)
				}
				e.rm.release(p)
			}},
		{name: "purged", reason: removals.Purged,
			act: func(t *testing.T, e *Engine, n *node, keys [][]byte) {
				fp, _ := e.Fingerprint(n.ns)
				if r, err := e.Purge(ctx, fp); err != nil || r.Files != len(keys) {
					t.Fatalf("Purge: %+v, %v", r, err)
				}
			}},
		{name: "corrupt", reason: removals.Corrupt,
			act: func(t *testing.T, e *Engine, n *node, keys [][]byte) {
				loadCorrupted(t, e, n.ns, n.c, keys[2])
			}},
		{name: "deleted, its unlink failing once", reason: removals.Deleted, fail: "order-0001",
			act: func(t *testing.T, e *Engine, n *node, keys [][]byte) {
				if d, err := e.Delete(ctx, n.ns, keys[1:2]); d != 1 || err != nil {
					t.Fatalf("Delete: %d, %v", d, err)
				}
			}},
		{name: "evicted, its unlink failing once", mount: Mount{Capacity: 6 * fileLen}, reason: removals.Evicted, fail: "order-0000",
			act: func(t *testing.T, e *Engine, n *node, keys [][]byte) {
				storeKeys(t, n, "more", 1, rand.New(rand.NewPCG(1, 2)))
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := &unlinkWatchFS{keyOf: map[string]string{}, told: map[string]bool{}}
			m := tc.mount
			m.Path = t.TempDir()
			if tc.tmpfs {
				m.Path = tmpfsDir(t)
			}
			m.HighWatermark, m.LowWatermark = 0.9, 0.5
			e := openEngine(t, Config{Mounts: []Mount{m}, Policy: newTestPolicy(1, abi.OrderLayerMajor), FS: w})
			sub := subscribe(t, e)
			watch, _, _, err := e.Removals().Subscribe(nil, 0, 0)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(watch.Close)
			ns, err := e.Declare(ctx, g)
			if err != nil {
				t.Fatal(err)
			}
			n := &node{e: e, ns: ns, c: newTestCache(t, e, ns, g, 64, layoutPlaneFirst)}
			keys := storeKeys(t, n, "order", 5, rand.New(rand.NewPCG(8, 6)))
			w.mu.Lock()
			for _, k := range keys {
				en := e.find(e.tables.get(ns), k)
				w.keyOf[en.Path] = string(k)
				if string(k) == tc.fail {
					w.fail = en.Path
				}
			}
			w.sub = watch
			w.mu.Unlock()

			tc.act(t, e, n, keys)
			told, early := w.recorded()
			if len(early) != 0 {
				t.Fatalf("keys %v recorded removed while their files were still at their paths", early)
			}
			if len(told) == 0 && tc.fail == "" {
				t.Fatal("nothing recorded: the scenario removed nothing")
			}
			if tc.fail != "" {
				if !w.failed {
					t.Fatalf("the unlink of %s's file never ran", tc.fail)
				}
				if told[tc.fail] {
					t.Fatalf("key %s recorded removed though its unlink failed: its file is still there", tc.fail)
				}
				// The next eviction's retry, or a purge, removes it.
				fp, _ := e.Fingerprint(ns)
				if _, err := e.Purge(ctx, fp); err != nil {
					t.Fatal(err)
				}
				if told, _ = w.recorded(); !told[tc.fail] {
					t.Fatalf("key %s not recorded once its file was removed", tc.fail)
				}
			}
			var got []removals.Record
			for _, r := range feedRecords(t, sub) {
				if r.Key == tc.fail {
					got = append(got, r)
				}
				if tc.fail == "" && r.Reason != tc.reason {
					t.Fatalf("record %+v: want reason %v", r, tc.reason)
				}
			}
			if tc.fail != "" && (len(got) != 1 || got[0].Reason != tc.reason) {
				t.Fatalf("records of %s: %+v; want one, %v", tc.fail, got, tc.reason)
			}
			for path, key := range w.keyOf {
				if _, err := os.Stat(path); err == nil && told[key] {
					t.Errorf("key %s recorded removed, its file %s still there", key, path)
				}
			}
		})
	}
}
