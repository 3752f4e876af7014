//go:build invariants

package engine

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/testlog"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/region"
)

// refusal fails, while set, one operation on the engine's temporary files
// (a store's file before its rename) with an error: a mount that refuses
// stores from some moment on, and takes them again once cleared.
type refusal struct {
	mu  sync.Mutex
	op  fsys.Op
	err error
}

func (r *refusal) set(op fsys.Op, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.op, r.err = op, err
}

// Inject implements fsys.Injector.
func (r *refusal) Inject(op fsys.Op, path string) fsys.Fault {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.err != nil && op == r.op && strings.HasPrefix(filepath.Base(path), tmpPrefix) {
		return fsys.Fault{Err: r.err}
	}
	return fsys.Fault{}
}

// TestAMountThatRefusesStoresIsReportedUntilAStoreSucceeds: stores that
// fail for the mount's own reason (a read-only file system, an I/O error,
// no space left after eviction) make the mount's StoresFailing say since
// when, how many files and the latest error; a cancelled store changes
// nothing; the first store that succeeds there ends it.
func TestAMountThatRefusesStoresIsReportedUntilAStoreSucceeds(t *testing.T) {
	g := smallGeometry(true)
	for _, tc := range []struct {
		name string
		op   fsys.Op
		err  error
		want string // in StoresFailing.Err
	}{
		{"read-only", fsys.OpOpen, syscall.EROFS, "read-only file system"},
		{"an I/O error", fsys.OpWrite, syscall.EIO, "input/output error"},
		{"no space", fsys.OpOpen, syscall.ENOSPC, "no space"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			inj := &refusal{}
			dir := t.TempDir()
			e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, abi.OrderLayerMajor),
				FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}})
			ns, _ := e.Declare(context.Background(), g)
			c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
			c.fill(rand.New(rand.NewPCG(1, 2)), []int{0, 1, 2, 3})
			store := func(key string, ctx context.Context) Result {
				t.Helper()
				return wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: [][]byte{[]byte(key)}, Blocks: [][]int{{0, 1, 2, 3}}}))
			}
			failing := func() *StoreFailure { return e.Stats().Mounts[0].StoresFailing }

			wantOutcomes(t, "store on a working mount", store("before", context.Background()), OutcomeStored)
			if f := failing(); f != nil {
				t.Fatalf("StoresFailing after a store succeeded: %+v, want nil", f)
			}
			inj.set(tc.op, tc.err)
			for i := range 2 {
				wantOutcomes(t, "store on the refusing mount", store(fmt.Sprint("refused-", i), context.Background()), OutcomeFailed)
			}
			f := failing()
			if f == nil || f.Stores != 2 || !strings.Contains(f.Err, tc.want) || !strings.Contains(f.Err, dir) || f.Since.IsZero() || f.Last.Before(f.Since) {
				t.Fatalf("StoresFailing after 2 refused stores: %+v; want 2 stores, an error naming the mount and %q", f, tc.want)
			}
			cancelled, cancel := context.WithCancel(context.Background())
			cancel()
			wantOutcomes(t, "a cancelled store", store("cancelled", cancelled), OutcomeFailed)
			if g := failing(); g == nil || *g != *f {
				t.Fatalf("StoresFailing after a cancelled store: %+v, want it unchanged: %+v", g, f)
			}
			inj.set(0, nil)
			wantOutcomes(t, "store once the mount takes them again", store("after", context.Background()), OutcomeStored)
			if f := failing(); f != nil {
				t.Fatalf("StoresFailing after a store succeeded again: %+v, want nil", f)
			}
		})
	}
}

// TestOnlyTheMountsOwnErrorsMakeItRefuseStores: what counts as a mount
// refusing a store is an error of its file system or no space after
// eviction, not a cancelled job, a fault in the client's memory, the
// policy or an errno the client's memory causes (EFAULT).
func TestOnlyTheMountsOwnErrorsMakeItRefuseStores(t *testing.T) {
	pathErr := func(errno syscall.Errno) error {
		return fmt.Errorf("engine: store on mount /m: open: %w", &os.PathError{Op: "open", Path: "/m/.tmp-x", Err: errno})
	}
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"read-only", pathErr(syscall.EROFS), true},
		{"EIO", pathErr(syscall.EIO), true},
		{"not writable", pathErr(syscall.EACCES), true},
		{"quota", pathErr(syscall.EDQUOT), true},
		{"stale NFS handle", pathErr(syscall.ESTALE), true},
		{"no space after eviction", fmt.Errorf("%w: mount /m: 0 of 0 bytes used, 4096 more needed, no evictable entry left", ErrNoSpace), true},
		{"ENOSPC", fmt.Errorf("%w: mount /m: write: %w", ErrNoSpace, syscall.ENOSPC), true},
		{"cancelled", context.Canceled, false},
		{"engine closed", ErrClosed, false},
		{"client memory fault", fmt.Errorf("engine: store on mount /m: write: %w", region.ErrFault), false},
		{"client memory truncated", fmt.Errorf("engine: store on mount /m: write: %w", region.ErrTruncated), false},
		{"EFAULT", pathErr(syscall.EFAULT), false},
		{"policy", fmt.Errorf("%w: store on mount /m: /m/x is a directory", ErrPolicy), false},
		{"other", errors.New("gpu: cudaMemcpy: an illegal memory access"), false},
	} {
		if got := mountFault(tc.err); got != tc.want {
			t.Errorf("%s: mountFault(%v) = %v, want %v", tc.name, tc.err, got, tc.want)
		}
	}
}

// readOnlyFS is a file system mounted read-only: statfs says so, and
// every operation that would change it fails with EROFS.
type readOnlyFS struct{ fsys.FS }

func (f readOnlyFS) Statfs(path string) (fsys.StatFS, error) {
	st, err := f.FS.Statfs(path)
	st.ReadOnly = true
	return st, err
}

func (f readOnlyFS) OpenFile(name string, flag int, perm os.FileMode) (fsys.File, error) {
	if flag&(os.O_CREATE|os.O_WRONLY|os.O_RDWR|os.O_TRUNC) != 0 {
		return nil, &os.PathError{Op: "open", Path: name, Err: syscall.EROFS}
	}
	return f.FS.OpenFile(name, flag, perm)
}

func (f readOnlyFS) Rename(oldpath, newpath string) error {
	return &os.LinkError{Op: "rename", Old: oldpath, New: newpath, Err: syscall.EROFS}
}

func (f readOnlyFS) Remove(name string) error {
	return &os.PathError{Op: "remove", Path: name, Err: syscall.EROFS}
}

func (f readOnlyFS) MkdirAll(path string, perm os.FileMode) error {
	if _, err := f.FS.Stat(path); err == nil {
		return nil
	}
	return &os.PathError{Op: "mkdir", Path: path, Err: syscall.EROFS}
}

// TestAMountThatCannotStoreIsNamedOnceAtStart: Open on a read-only file
// system, or on one with no room left for kvhost (its reserve is more
// than the file system has, as one filled from outside leaves it), logs
// one warning naming the mount, why every store there fails and what to
// do, and no other warning about it (the O_DIRECT probe's, the spare
// owner file's, the configured capacity's); the mount refuses stores from
// the start. A writable mount with room gets no warning.
func TestAMountThatCannotStoreIsNamedOnceAtStart(t *testing.T) {
	for _, tc := range []struct {
		name  string
		fs    fsys.FS
		tmpfs bool // the mount on a tmpfs (spare files, their owner file)
		mount Mount
		want  string // in the warning and StoresFailing.Err; "" for none
		fix   string // in the warning's fix
	}{
		{"read-only", readOnlyFS{fsys.OS{}}, false, Mount{}, "read-only", "remount it read-write"},
		{"read-only tmpfs", readOnlyFS{fsys.OS{}}, true, Mount{}, "read-only", "remount it read-write"},
		{"no room", fsys.OS{}, false, Mount{Reserve: 1 << 60}, "no room", "reserve"},
		{"no room, capacity configured", fsys.OS{}, false, Mount{Capacity: 1 << 30, Reserve: 1 << 60}, "no room", "reserve"},
		{"writable, with room", fsys.OS{}, false, Mount{}, "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var buf lockedBuffer
			log := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelWarn}))
			dir := t.TempDir()
			if tc.tmpfs {
				dir = tmpfsDir(t)
			}
			tc.mount.Path = dir
			e := openEngine(t, Config{Logger: log, Mounts: []Mount{tc.mount}, Policy: newTestPolicy(1, abi.OrderLayerMajor), FS: tc.fs})
			var warned []map[string]any
			buf.mu.Lock()
			for line := range bytes.Lines(buf.b.Bytes()) {
				var r map[string]any
				if err := json.Unmarshal(line, &r); err != nil {
					t.Fatalf("log line %q: %v", line, err)
				}
				warned = append(warned, r)
			}
			buf.mu.Unlock()
			f := e.Stats().Mounts[0].StoresFailing
			if tc.want == "" {
				if len(warned) != 0 || f != nil {
					t.Fatalf("warnings %v, StoresFailing %+v on a writable mount with room; want none", warned, f)
				}
				return
			}
			if len(warned) != 1 {
				t.Fatalf("%d warnings: %v; want one", len(warned), warned)
			}
			w := warned[0]
			msg, _ := w["msg"].(string)
			fix, _ := w["fix"].(string)
			if w["mount"] != dir || !strings.Contains(msg, tc.want) || !strings.Contains(fix, tc.fix) {
				t.Errorf("warning %v: want the mount %s, %q in its message and %q in its fix", w, dir, tc.want, tc.fix)
			}
			if f == nil || f.Stores != 0 || !strings.Contains(f.Err, tc.want) {
				t.Errorf("StoresFailing after the start: %+v; want it set, no store counted, %q in its error", f, tc.want)
			}
		})
	}
}

// TestAMoveIntoAMountUpdatesItsRefusalOfStores: a demotion into a mount
// is a file written there as a store's is. A demotion that fails for the
// mount's own reason (EROFS) extends its refusal of stores; once the
// mount takes files again, a demotion into it that succeeds ends the
// refusal, though no client stored there since.
func TestAMoveIntoAMountUpdatesItsRefusalOfStores(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := int64(4096 + g.KeyBytes())
	hot, cold := t.TempDir(), t.TempDir()
	var refusing atomic.Bool
	inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if refusing.Load() && op == fsys.OpOpen && strings.HasPrefix(path, cold+string(filepath.Separator)) {
			return fsys.Fault{Err: syscall.EROFS}
		}
		return fsys.Fault{}
	})
	// "hot" keys to the hot mount, the others to the cold one; the hot
	// mount's victims demoted to the cold one.
	pol := &heldUnpinCounter{evictPromotingPolicy: &evictPromotingPolicy{&demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}}}
	e := openEngine(t, Config{
		Mounts: []Mount{{Path: hot, Capacity: 4 * fileLen, HighWatermark: 0.75, LowWatermark: 0.5}, {Path: cold}},
		Policy: pol, FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj},
	})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	c.fill(rand.New(rand.NewPCG(3, 4)), []int{0, 1, 2, 3})
	store := func(key string) Result {
		t.Helper()
		return wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: [][]byte{[]byte(key)}, Blocks: [][]int{{0, 1, 2, 3}}}))
	}
	failing := func() *StoreFailure { return e.Stats().Mounts[1].StoresFailing }

	refusing.Store(true)
	wantOutcomes(t, "a store on the refusing cold mount", store("cold-0"), OutcomeFailed)
	if f := failing(); f == nil || f.Stores != 1 {
		t.Fatalf("the cold mount's StoresFailing after a refused store: %+v, want 1 store", f)
	}
	for i := 0; e.TierStats().MoveFailures == 0; i++ {
		if i == 8 {
			t.Fatal("8 stores on the hot mount and no demotion failed: the test proves nothing")
		}
		store(fmt.Sprint("hot-", i))
	}
	if f := failing(); f == nil || f.Stores < 2 || !strings.Contains(f.Err, "read-only") {
		t.Errorf("the cold mount's StoresFailing after a demotion there failed with EROFS: %+v, want more than the 1 store", f)
	}
	refusing.Store(false)
	moved := e.TierStats().Demotions
	for i := 0; e.TierStats().Demotions == moved; i++ {
		if i == 8 {
			t.Fatal("8 stores on the hot mount and no demotion: the test proves nothing")
		}
		wantOutcomes(t, "a store on the hot mount", store(fmt.Sprint("hot-again-", i)), OutcomeStored)
	}
	if f := failing(); f != nil {
		t.Errorf("the cold mount's StoresFailing after a demotion there succeeded: %+v, want nil", f)
	}
}

// TestAMendedMountThatNoStoreReachesStopsRefusingStores: a mount whose
// refusal of stores stands with no store or move there to end it (the
// policy sends it none) is probed once reprobeAfter has passed since its
// latest failure: while the probe finds it still refusing (read-only; no
// room below its high watermark) the refusal stands; once the operator
// has mended it (remounted read-write; deleted files), the next probe
// ends it.
func TestAMendedMountThatNoStoreReachesStopsRefusingStores(t *testing.T) {
	// probing counts the probes of dir, and fails them and the stores
	// there with EROFS while refusing.
	type probing struct {
		refusing atomic.Bool
		probes   atomic.Int64
	}
	injector := func(p *probing, dir string) fsys.Injector {
		return fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
			if op != fsys.OpOpen || !strings.HasPrefix(path, dir+string(filepath.Separator)) {
				return fsys.Fault{}
			}
			base := filepath.Base(path)
			if strings.HasPrefix(base, probePrefix) {
				p.probes.Add(1)
			}
			if p.refusing.Load() && (strings.HasPrefix(base, probePrefix) || strings.HasPrefix(base, tmpPrefix)) {
				return fsys.Fault{Err: syscall.EROFS}
			}
			return fsys.Fault{}
		})
	}
	// probed advances clock past reprobeAfter and waits for a probe of
	// the mount after it to have opened its file and to have ended, its
	// outcome applied (ended: probeLogger's count).
	probed := func(t *testing.T, ended *atomic.Int64, clock *testClock, p *probing) {
		t.Helper()
		n, done := p.probes.Load(), ended.Load()
		clock.advance(reprobeAfter)
		testwait.Until(t, "a probe of the refusing mount", testwait.Hang, func() bool {
			return p.probes.Load() > n && ended.Load() > done
		})
	}
	t.Run("read-only at start, remounted read-write", func(t *testing.T) {
		clock, p, dir := newTestClock(), &probing{}, t.TempDir()
		p.refusing.Store(true)
		pol := &demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}
		log, ended := probeLogger(t)
		e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: pol, Now: clock.now, MountUpdateInterval: time.Millisecond, Logger: log,
			FS: &fsys.Faulty{FS: fsys.OS{}, Inj: injector(p, dir)}})
		failing := func() *StoreFailure { return e.Stats().Mounts[0].StoresFailing }
		if f := failing(); f == nil || !strings.Contains(f.Err, "read-only") {
			t.Fatalf("StoresFailing after a start on a read-only mount: %+v, want read-only", f)
		}
		probed(t, ended, clock, p)
		if f := failing(); f == nil {
			t.Fatal("StoresFailing ended by a probe of a mount still read-only")
		}
		p.refusing.Store(false)
		clock.advance(reprobeAfter)
		testwait.Until(t, "the refusal of the remounted mount to end", testwait.Hang, func() bool { return failing() == nil })
	})
	t.Run("no room, then files deleted", func(t *testing.T) {
		const found = 4
		clock, p := newTestClock(), &probing{}
		var hot string
		log, ended := probeLogger(t)
		f := newHeldHot(t, found, 1, func(h, cold string) Config {
			hot = h
			return Config{Now: clock.now, MountUpdateInterval: time.Millisecond, Logger: log, FS: &fsys.Faulty{FS: fsys.OS{}, Inj: fsys.InjectorFunc(
				func(op fsys.Op, path string) fsys.Fault {
					if op == fsys.OpOpen && strings.HasPrefix(path, cold+string(filepath.Separator)) {
						return fsys.Fault{Err: syscall.EROFS} // no demotion: the held files fill the hot mount
					}
					return injector(p, h).Inject(op, path)
				})}}
		})
		failing := func() *StoreFailure { return f.e.Stats().Mounts[0].StoresFailing }
		res := wait(t)(f.e.Store(context.Background(), StoreRequest{Cache: f.c.id, Keys: f.keys[found:], Blocks: f.blocks[found:]}))
		if k := res.Keys[0]; !errors.Is(k.Err, ErrNoSpace) {
			t.Fatalf("store on the hot mount full of held files: %v, want ErrNoSpace", k.Err)
		}
		if failing() == nil {
			t.Fatal("no StoresFailing on the hot mount after a store failed with no space")
		}
		probed(t, ended, clock, p)
		if g := failing(); g == nil {
			t.Fatalf("StoresFailing of %s ended by a probe while it has no room below its high watermark", hot)
		}
		if n, err := f.e.Delete(context.Background(), f.ns, f.keys[:found/2]); n != found/2 || err != nil {
			t.Fatalf("Delete = %d, %v; want %d", n, err, found/2)
		}
		clock.advance(reprobeAfter)
		testwait.Until(t, "the refusal of the mount with room again to end", testwait.Hang, func() bool { return failing() == nil })
	})
}

// TestAMemoryMountFoundReadOnlyAtStartKeepsSparesOnceItTakesFiles: a
// memory mount that Open found read-only (no spares kept, no spare owner
// file made) and that takes files again — its refusal of stores ended
// by the tier driver's probe, or by a store that succeeded there — keeps
// evicted files as spares from then on, under an owner file of this
// engine's, as a mount writable at start does.
func TestAMemoryMountFoundReadOnlyAtStartKeepsSparesOnceItTakesFiles(t *testing.T) {
	for _, by := range []string{"a probe", "a store"} {
		t.Run(by, func(t *testing.T) {
			clock, dir := newTestClock(), tmpfsDir(t)
			var refusing atomic.Bool // read-only until remounted
			refusing.Store(true)
			inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
				base := filepath.Base(path)
				if refusing.Load() && op == fsys.OpOpen && strings.HasPrefix(path, dir+string(filepath.Separator)) &&
					(strings.HasPrefix(base, probePrefix) || strings.HasPrefix(base, tmpPrefix)) {
					return fsys.Fault{Err: syscall.EROFS}
				}
				return fsys.Fault{}
			})
			g := smallGeometry(false)
			fileLen := int64(4096) + alignTo(g.KeyBytes(), 4096)
			e := openEngine(t, Config{
				Mounts: []Mount{{Path: dir, Capacity: 10 * fileLen, HighWatermark: 0.9, LowWatermark: 0.6}},
				// A policy that deletes its victims (the tier driver,
				// which probes, runs whatever the policy).
				Policy: &recordingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}, Now: clock.now,
				FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj},
			})
			failing := func() *StoreFailure { return e.Stats().Mounts[0].StoresFailing }
			if f := failing(); f == nil || !strings.Contains(f.Err, "read-only") {
				t.Fatalf("StoresFailing after a start on a read-only mount: %+v, want read-only", f)
			}
			ns, err := e.Declare(context.Background(), g)
			if err != nil {
				t.Fatal(err)
			}
			c := newTestCache(t, e, ns, g, 64, layoutPlaneFirst)
			r := rand.New(rand.NewPCG(8, 9))
			keys := testKeys("remounted", 30)
			b := [][]int{{0, 1, 2, 3}}
			c.fill(r, b[0])
			refusing.Store(false) // remounted read-write
			if by == "a probe" {
				clock.advance(reprobeAfter)
				testwait.Until(t, "the probe to end the refusal", testwait.Hang, func() bool { return failing() == nil })
			}
			for i := range keys {
				storeAndCheck(t, e, c, keys[i:i+1], b)
			}
			if f := failing(); f != nil {
				t.Fatalf("StoresFailing after stores succeeded: %+v, want nil", f)
			}
			st := e.Stats()
			if st.Evictions == 0 || st.Reused == 0 {
				t.Errorf("%d evictions, %d stores into spare files on the remounted memory mount: want both", st.Evictions, st.Reused)
			}
			owner := filepath.Join(dir, e.own.ownerName())
			if _, err := os.Stat(owner); err != nil {
				t.Errorf("the engine's spare owner file on the remounted mount: %v", err)
			}
		})
	}
}

// TestAProbeLeavesARefusalForRoomWhereAStoreOfItsSizeStillFails: a
// mount whose stores fail for lack of room (its one file pinned) has
// room for the probe's small file but not for a file of the size that
// failed: below the mount's high watermark, or, on a cluster mount,
// within this node's share of the cluster's capacity. The probe leaves
// the refusal, which the next store would start again.
func TestAProbeLeavesARefusalForRoomWhereAStoreOfItsSizeStillFails(t *testing.T) {
	g := smallGeometry(true)
	fileLen := int64(4096 + g.KeyBytes())
	for _, tc := range []struct {
		name  string
		mount Mount
	}{
		{"the mount's room", Mount{Capacity: fileLen + fileLen/2, HighWatermark: 0.9, LowWatermark: 0.5}},
		{"the node's share of a cluster", Mount{Capacity: 100 * fileLen, ClusterCapacity: fileLen + fileLen/2, ClusterInterval: time.Hour}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			clock := newTestClock()
			log, probes := probeLogger(t) // the probes that ended, passed or not
			mnt := tc.mount
			mnt.Path = t.TempDir()
			e := openEngine(t, Config{Mounts: []Mount{mnt}, Policy: newTestPolicy(1, abi.OrderLayerMajor), NodeID: "a", Now: clock.now, Logger: log})
			ns, err := e.Declare(ctx, g)
			if err != nil {
				t.Fatal(err)
			}
			c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
			keys := testKeys("full", 3)
			storeAndCheck(t, e, c, keys[:1], [][]int{{0, 1, 2, 3}})
			id, _, err := e.Pin(ctx, ns, keys[:1], 0)
			if err != nil {
				t.Fatal(err)
			}
			defer e.Unpin(ctx, id)
			store := func(key []byte) KeyResult {
				t.Helper()
				c.fill(rand.New(rand.NewPCG(5, 6)), []int{4, 5, 6, 7})
				return wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: [][]byte{key}, Blocks: [][]int{{4, 5, 6, 7}}})).Keys[0]
			}
			if kr := store(keys[1]); !errors.Is(kr.Err, ErrNoSpace) {
				t.Fatalf("store beside the pinned file: %v, %v; want ErrNoSpace", kr.Outcome, kr.Err)
			}
			failing := func() *StoreFailure { return e.Stats().Mounts[0].StoresFailing }
			if failing() == nil {
				t.Fatal("no StoresFailing after a store failed with no space")
			}
			n := probes.Load()
			clock.advance(reprobeAfter)
			testwait.Until(t, "a probe of the refusing mount", testwait.Hang, func() bool { return probes.Load() > n })
			if f := failing(); f == nil {
				kr := store(keys[2])
				t.Fatalf("StoresFailing ended by a probe where a file of the size that failed has no room; the next store: %v, %v", kr.Outcome, kr.Err)
			}
		})
	}
}

// TestAProbeAllocatesTheSizeThatFailedForLackOfRoom: a mount whose
// stores fail for the file system's own lack of room, which statfs need
// not show (a quota's EDQUOT), keeps refusing while the probe cannot
// allocate a file of the size that failed, and stops once it can.
func TestAProbeAllocatesTheSizeThatFailedForLackOfRoom(t *testing.T) {
	clock, dir := newTestClock(), t.TempDir()
	// While quota is set, a store's file cannot be made, and a probe's
	// file takes its first allocation (its own 4 KiB) but no later one
	// (the size that failed): the quota has room for the one, not the
	// other, and statfs shows the file system's room, not the quota's.
	var quota atomic.Bool
	var mu sync.Mutex
	allocations := map[string]int{} // by probe file
	later := 0                      // probes' allocations after their first
	inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		base := filepath.Base(path)
		switch {
		case op == fsys.OpOpen && strings.HasPrefix(base, tmpPrefix) && quota.Load():
			return fsys.Fault{Err: syscall.EDQUOT}
		case op == fsys.OpAllocate && strings.HasPrefix(base, probePrefix):
			mu.Lock()
			defer mu.Unlock()
			if allocations[path]++; allocations[path] > 1 {
				later++
				if quota.Load() {
					return fsys.Fault{Err: syscall.EDQUOT}
				}
			}
		}
		return fsys.Fault{}
	})
	log, ended := probeLogger(t)
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, abi.OrderLayerMajor), Now: clock.now,
		MountUpdateInterval: time.Millisecond, Logger: log, FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}})
	g := smallGeometry(true)
	ns, _ := e.Declare(context.Background(), g)
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	c.fill(rand.New(rand.NewPCG(1, 2)), []int{0, 1, 2, 3})
	quota.Store(true)
	res := wait(t)(e.Store(context.Background(), StoreRequest{Cache: c.id, Keys: [][]byte{[]byte("over-quota")}, Blocks: [][]int{{0, 1, 2, 3}}}))
	wantOutcomes(t, "a store over the quota", res, OutcomeFailed)
	failing := func() *StoreFailure { return e.Stats().Mounts[0].StoresFailing }
	f := failing()
	if f == nil || f.room <= probeBytes {
		t.Fatalf("StoresFailing after a store failed with EDQUOT: %+v, want a refusal for lack of room for more than %d bytes", f, probeBytes)
	}
	probe := func() {
		t.Helper()
		done := ended.Load()
		clock.advance(reprobeAfter)
		testwait.Until(t, "a probe of the refusing mount", testwait.Hang, func() bool { return ended.Load() > done })
	}
	probe()
	mu.Lock()
	n := later
	mu.Unlock()
	if n == 0 {
		t.Error("the probe allocated no more than its own 4 KiB")
	}
	if failing() == nil {
		t.Fatal("StoresFailing ended by a probe that could not allocate the size that failed")
	}
	quota.Store(false)
	probe()
	if f := failing(); f != nil {
		t.Fatalf("StoresFailing after a probe allocated the size that failed: %+v, want nil", f)
	}
}

// probeLogger is a logger for a test engine that counts the probes of
// refusing mounts that ended (reprobe), passed or not: their outcome is
// applied before either log line.
func probeLogger(t *testing.T) (*slog.Logger, *atomic.Int64) {
	probes := &atomic.Int64{}
	h := slog.NewTextHandler(testlog.Writer(t), &slog.HandlerOptions{Level: slog.LevelDebug})
	return slog.New(logCount{logCount{h, "the mount still refuses stores", probes}, "the mount takes stores again", probes}), probes
}
