//go:build invariants

package engine

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// Removal (docs/engine.md, "Data movers"): every file the engine unlinks is
// forgotten by every mover first, so that what a mover holds of it (the
// GPU path's registration of its pages, a cuFile handle and descriptor)
// never outlives its name.

// hookedMover is fakeMover (a device mover that prepares and forgets)
// whose writes first call write with the write's number (0 for the
// first): an error from it fails the write.
type hookedMover struct {
	*fakeMover
	write  func(ctx context.Context, n int) error
	writes atomic.Int64
}

func (m *hookedMover) WriteFile(ctx context.Context, f fsys.File, p *transfer.Plan, sums []uint32) (int64, error) {
	n := int(m.writes.Add(1) - 1)
	if m.write != nil {
		if err := m.write(ctx, n); err != nil {
			return 0, err
		}
	}
	return m.fakeMover.WriteFile(ctx, f, p, sums)
}

// removal is one unlink the engine asked for: the file's name and inode,
// and whether the movers had forgotten the inode by then.
type removal struct {
	path      string
	ino       uint64
	forgotten bool
}

// removalWatch is an fsys injector that records, at each removal of a
// regular file (before the unlink), whether the mover has been told to
// forget that inode since the last removal of a file with it (inode
// numbers are reused).
type removalWatch struct {
	mv       *fakeMover
	mu       sync.Mutex
	consumed map[uint64]int // forgets of each inode matched to a removal
	removals []removal
}

func (w *removalWatch) Inject(op fsys.Op, path string) fsys.Fault {
	if op != fsys.OpRemove {
		return fsys.Fault{}
	}
	var st syscall.Stat_t
	if err := syscall.Lstat(path, &st); err != nil || st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		return fsys.Fault{} // gone already, or not a file
	}
	w.mv.mu.Lock()
	forgets := 0
	for _, ino := range w.mv.forgotten {
		if ino == st.Ino {
			forgets++
		}
	}
	w.mv.mu.Unlock()
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.consumed == nil {
		w.consumed = map[uint64]int{}
	}
	r := removal{path: path, ino: st.Ino, forgotten: forgets > w.consumed[st.Ino]}
	if r.forgotten {
		w.consumed[st.Ino]++
	}
	w.removals = append(w.removals, r)
	return fsys.Fault{}
}

func (w *removalWatch) seen() []removal {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.removals)
}

// removalEnv is an engine on one mount whose device caches move through
// mv, its file system watched by watch.
type removalEnv struct {
	e       *Engine
	ns      NamespaceID
	cid     CacheID
	mv      *hookedMover
	watch   *removalWatch
	dir     string
	fileLen int64
}

// removalGeometry is the geometry of the removal tests: files with a
// zero tail.
func removalGeometry() Geometry { return smallGeometry(false) }

// removalFileLen is the length of a one-key file of removalGeometry.
func removalFileLen() int64 {
	return 4096 + alignTo(removalGeometry().KeyBytes(), format.Align)
}

// openRemovalEnv opens an engine on mnt (buffered I/O: no probe file)
// whose device caches move through a hookedMover calling write, declares
// removalGeometry and registers a device cache of 64 blocks.
func openRemovalEnv(t *testing.T, mnt Mount, write func(ctx context.Context, n int) error) *removalEnv {
	t.Helper()
	mv := &hookedMover{fakeMover: &fakeMover{}, write: write}
	watch := &removalWatch{mv: mv.fakeMover}
	mnt.IO = IOBuffered
	e := openEngine(t, Config{Mounts: []Mount{mnt}, Policy: newTestPolicy(1, 0), FS: &fsys.Faulty{FS: fsys.OS{}, Inj: watch},
		Movers: map[region.Kind]MoverFactory{region.KindDevice: func(MountInfo) (transfer.Mover, error) { return mv, nil }}})
	g := removalGeometry()
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	cid, _ := registerFakeDevice(t, e, ns, g, 91, 64)
	waitEngineSpares(t, e)
	return &removalEnv{e: e, ns: ns, cid: cid, mv: mv, watch: watch, dir: mnt.Path, fileLen: removalFileLen()}
}

// store stores key from blocks 0-3 and returns the job's result.
func (env *removalEnv) store(t *testing.T, key string) Result {
	t.Helper()
	return wait(t)(env.e.Store(context.Background(), StoreRequest{Cache: env.cid, Keys: [][]byte{[]byte(key)}, Blocks: [][]int{{0, 1, 2, 3}}}))
}

// prepared reports whether the engine showed the mover the file with
// inode ino as a spare made ahead (Prepare).
func (env *removalEnv) prepared(ino uint64) bool {
	env.mv.mu.Lock()
	defer env.mv.mu.Unlock()
	return slices.Contains(env.mv.prepared, ino)
}

// failWrites fails every write of the mover.
func failWrites(context.Context, int) error {
	return errors.New("injected: the device copy failed")
}

// TestEveryFileTheEngineRemovesIsForgottenByTheMoversFirst: whatever
// removes a file (a failed, cancelled or retried store, a delete, an
// eviction, the clean-up at Open), the movers are told to forget it
// before it is unlinked. A store whose mover fails in a spare made ahead
// is the review's case: the GPU path had registered the spare (Prepare),
// and without Forget the registration pinned the pages of a file the
// engine counted free.
func TestEveryFileTheEngineRemovesIsForgottenByTheMoversFirst(t *testing.T) {
	fl := removalFileLen()
	onTmpfs := func(t *testing.T) Mount {
		return Mount{Path: tmpfsDir(t), Capacity: 40 * fl, HighWatermark: 0.9, LowWatermark: 0.85, Preallocate: 3 * fl}
	}
	onDisk := func(t *testing.T) Mount { return Mount{Path: diskDir(t), Capacity: 40 * fl} }
	for _, tc := range []struct {
		name  string
		mount func(*testing.T) Mount
		// before runs before the engine is opened on the mount's path.
		before func(t *testing.T, dir string)
		write  func(ctx context.Context, n int) error
		// act does what removes files, and returns the removals it
		// expects at least.
		act func(t *testing.T, env *removalEnv) int
	}{
		{
			name: "a store into a spare made ahead whose mover fails", mount: onTmpfs, write: failWrites,
			act: func(t *testing.T, env *removalEnv) int {
				if n := env.e.Stats().SparesMade; n == 0 {
					t.Fatal("no spare was made ahead")
				}
				res := env.store(t, "fails")
				wantOutcomes(t, "store", res, OutcomeFailed)
				rs := env.watch.seen()
				if !slices.ContainsFunc(rs, func(r removal) bool {
					return strings.HasPrefix(filepath.Base(r.path), tmpPrefix) && env.prepared(r.ino)
				}) {
					t.Fatalf("removals %+v: the failed store's file was not a spare made ahead (prepared)", rs)
				}
				return 1
			},
		},
		{
			name: "a store into a fresh file whose mover fails", mount: onDisk, write: failWrites,
			act: func(t *testing.T, env *removalEnv) int {
				wantOutcomes(t, "store", env.store(t, "fails"), OutcomeFailed)
				return 1
			},
		},
		{
			name: "a store cancelled while its mover writes", mount: onTmpfs,
			write: func(ctx context.Context, n int) error {
				<-ctx.Done() // the test cancels the job once the write began
				return ctx.Err()
			},
			act: func(t *testing.T, env *removalEnv) int {
				j, err := env.e.Store(context.Background(), StoreRequest{Cache: env.cid, Keys: [][]byte{[]byte("cancelled")}, Blocks: [][]int{{0, 1, 2, 3}}})
				if err != nil {
					t.Fatal(err)
				}
				testwait.Until(t, "the store's write to begin", testwait.Hang, func() bool { return env.mv.writes.Load() > 0 })
				j.Cancel()
				res := waitJob(t, j, nil)
				if k := res.Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, context.Canceled) {
					t.Fatalf("cancelled store: %v %v", k.Outcome, k.Err)
				}
				return 1
			},
		},
		{
			name: "a store whose first attempt finds no space", mount: onDisk,
			write: func(_ context.Context, n int) error {
				if n == 0 {
					return fmt.Errorf("injected: %w", syscall.ENOSPC)
				}
				return nil
			},
			act: func(t *testing.T, env *removalEnv) int {
				wantOutcomes(t, "store", env.store(t, "retried"), OutcomeStored)
				return 1
			},
		},
		{
			name: "a delete", mount: onTmpfs,
			act: func(t *testing.T, env *removalEnv) int {
				wantOutcomes(t, "store", env.store(t, "deleted"), OutcomeStored)
				if n, err := env.e.Delete(context.Background(), env.ns, [][]byte{[]byte("deleted")}); n != 1 || err != nil {
					t.Fatalf("delete: %d %v", n, err)
				}
				return 1
			},
		},
		{
			name: "evictions", mount: func(t *testing.T) Mount { return Mount{Path: diskDir(t), Capacity: 4 * fl} },
			act: func(t *testing.T, env *removalEnv) int {
				for i := range 8 {
					wantOutcomes(t, "store", env.store(t, fmt.Sprintf("churn-%d", i)), OutcomeStored)
				}
				if n := len(dataFiles(t, env.dir)); n > 4 {
					t.Fatalf("%d files on a mount with room for 4: nothing was evicted", n)
				}
				return 4
			},
		},
		{
			name: "files found at Open: a corrupt file, a leftover spare, an abandoned temporary file", mount: onDisk,
			before: func(t *testing.T, dir string) {
				first := openRemovalEnv(t, Mount{Path: dir, Capacity: 40 * fl}, nil)
				wantOutcomes(t, "store", first.store(t, "corrupt"), OutcomeStored)
				if err := first.e.Close(context.Background()); err != nil {
					t.Fatal(err)
				}
				files := dataFiles(t, dir)
				if len(files) != 1 {
					t.Fatalf("files %v", files)
				}
				f, err := os.OpenFile(files[0], os.O_RDWR, 0)
				if err != nil {
					t.Fatal(err)
				}
				f.WriteAt([]byte{0x55}, 40) // the header checksum fails
				f.Close()
				old := time.Now().Add(-time.Hour)
				for _, name := range []string{sparePrefix + "gone-1-0", tmpPrefix + "ownerless"} {
					p := filepath.Join(dir, name)
					if err := os.WriteFile(p, make([]byte, 4096), 0o644); err != nil {
						t.Fatal(err)
					}
					if err := os.Chtimes(p, old, old); err != nil {
						t.Fatal(err)
					}
				}
			},
			act: func(t *testing.T, env *removalEnv) int {
				if l := leftovers(t, env.dir); len(l) != 0 || len(dataFiles(t, env.dir)) != 0 {
					t.Fatalf("after Open: leftovers %v, files %v", l, dataFiles(t, env.dir))
				}
				return 3
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mnt := tc.mount(t)
			if tc.before != nil {
				tc.before(t, mnt.Path)
			}
			env := openRemovalEnv(t, mnt, tc.write)
			want := tc.act(t, env)
			testwait.Until(t, fmt.Sprintf("%d removals", want), testwait.Hang, func() bool { return len(env.watch.seen()) >= want })
			for _, r := range env.watch.seen() {
				if !r.forgotten {
					t.Errorf("%s (inode %d) was unlinked before the movers were told to forget it", filepath.Base(r.path), r.ino)
				}
			}
		})
	}
}
