//go:build invariants

package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/fsys/fsystest"
	"github.com/kvhost/kvhost/internal/fstype"
	"github.com/kvhost/kvhost/internal/testwait"
)

// reuseFS is the file system as ext4 shows it: an inode number freed by a
// remove (or a rename over a file) is given to the next new file at once.
// With coarseCtime every file's ctime reads 0, as on file systems whose
// timestamps are too coarse to tell two files of one second apart: then
// inode, size and ctime of a replacement all equal the replaced file's,
// and only the header's file id tells them apart.
type reuseFS struct {
	fsys.OS
	coarseCtime bool

	mu   sync.Mutex
	fake map[uint64]uint64 // real inode -> the inode shown
	free []uint64          // shown inodes freed, reused last-in first-out
	next uint64
}

func newReuseFS(coarse bool) *reuseFS {
	return &reuseFS{coarseCtime: coarse, fake: map[uint64]uint64{}, next: 1000}
}

func (r *reuseFS) shown(real uint64) uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	if f, ok := r.fake[real]; ok {
		return f
	}
	var f uint64
	if n := len(r.free); n > 0 {
		f, r.free = r.free[n-1], r.free[:n-1]
	} else {
		r.next++
		f = r.next
	}
	r.fake[real] = f
	return f
}

func (r *reuseFS) forget(name string) {
	var st syscall.Stat_t
	if syscall.Lstat(name, &st) != nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if f, ok := r.fake[st.Ino]; ok && st.Nlink <= 1 {
		delete(r.fake, st.Ino)
		r.free = append(r.free, f)
	}
}

func (r *reuseFS) info(fi os.FileInfo) os.FileInfo {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fi
	}
	c := *st
	c.Ino = r.shown(st.Ino)
	if r.coarseCtime {
		c.Ctim = syscall.Timespec{}
	}
	return fakeInfo{fi, &c}
}

type fakeInfo struct {
	os.FileInfo
	st *syscall.Stat_t
}

func (f fakeInfo) Sys() any { return f.st }

func (r *reuseFS) Stat(name string) (os.FileInfo, error) {
	fi, err := r.OS.Stat(name)
	if err != nil {
		return nil, err
	}
	return r.info(fi), nil
}

func (r *reuseFS) Remove(name string) error {
	r.forget(name)
	return r.OS.Remove(name)
}

func (r *reuseFS) Rename(oldpath, newpath string) error {
	r.forget(newpath)
	return r.OS.Rename(oldpath, newpath)
}

// RenameNoReplace is Rename's, for a path where nothing is.
func (r *reuseFS) RenameNoReplace(oldpath, newpath string) error {
	r.forget(newpath)
	return r.OS.RenameNoReplace(oldpath, newpath)
}

// StatAt, RemoveAt and RenameAt are Stat's, Remove's and Rename's, in a
// directory the engine holds open (fsys.AtFS).
func (r *reuseFS) StatAt(dir fsys.File, path string) (os.FileInfo, error) {
	fi, err := r.OS.StatAt(dir, path)
	if err != nil {
		return nil, err
	}
	return r.info(fi), nil
}

func (r *reuseFS) RemoveAt(dir fsys.File, path string) error {
	r.forget(path)
	return r.OS.RemoveAt(dir, path)
}

func (r *reuseFS) RenameAt(olddir fsys.File, oldpath string, newdir fsys.File, newpath string, noReplace bool) error {
	r.forget(newpath)
	return r.OS.RenameAt(olddir, oldpath, newdir, newpath, noReplace)
}

func (r *reuseFS) OpenFile(name string, flag int, perm os.FileMode) (fsys.File, error) {
	f, err := r.OS.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return reuseFile{f, r}, nil
}

// OpenAt is OpenFile relative to dir.
func (r *reuseFS) OpenAt(dir fsys.File, path string, flag int, perm os.FileMode) (fsys.File, error) {
	f, err := r.OS.OpenAt(dir, path, flag, perm)
	if err != nil {
		return nil, err
	}
	return reuseFile{f, r}, nil
}

type reuseFile struct {
	fsys.File
	r *reuseFS
}

func (f reuseFile) Stat() (os.FileInfo, error) {
	fi, err := fsys.Fstat(f.File)
	if err != nil {
		return nil, err
	}
	return f.r.info(fi), nil
}

// node is one engine of a shared-directory test, with its own policy and
// cache.
type node struct {
	e  *Engine
	ns NamespaceID
	c  *testCache
}

func openNode(t *testing.T, dir, id string, fs fsys.FS, kpf uint32) *node {
	t.Helper()
	return openNodeOn(t, Mount{Path: dir}, id, fs, kpf)
}

// openNodeOn is openNode on mount m.
func openNodeOn(t *testing.T, m Mount, id string, fs fsys.FS, kpf uint32) *node {
	t.Helper()
	e := openEngine(t, Config{Mounts: []Mount{m}, Policy: newTestPolicy(kpf, abi.OrderLayerMajor), FS: fs, NodeID: id})
	g := smallGeometry(true)
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	return &node{e: e, ns: ns, c: newTestCache(t, e, ns, g, 64, layoutPlaneFirst)}
}

// TestSharedMountInodeReuse is the reproduction of issue 7: daemons A and
// B on one directory, 4 keys per file. B stores [a,b,c,d]; A deletes a and
// stores [a,x,y,z], which ext4 gives the same inode (and here the same
// size). Then B must not answer present for c (its load would say
// missing), must not delete A's file when it deletes one of its own keys
// that are gone, loads nothing of the old file, and finds every key of A's
// file without a restart. Three file systems: simulated ext4 inode reuse,
// the same with coarse ctimes (only the file id tells the files apart),
// and real files (t.TempDir(), ext4 here).
func TestSharedMountInodeReuse(t *testing.T) {
	for _, tc := range []struct {
		name   string
		fs     func() fsys.FS
		coarse bool
	}{
		{"simulated-ext4-reuse", func() fsys.FS { return newReuseFS(false) }, false},
		{"simulated-reuse-coarse-ctime", func() fsys.FS { return newReuseFS(true) }, true},
		{"real-files", func() fsys.FS { return fsys.OS{} }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			dir := t.TempDir()
			fs := tc.fs()
			a, b := openNode(t, dir, "nodeA", fs, 4), openNode(t, dir, "nodeB", fs, 4)
			r := rand.New(rand.NewPCG(7, 7))

			// replace has B store [k0..k3], then A delete k0 and store
			// [k0,n1,n2,n3]: A's file takes the path of B's file (and,
			// on ext4, its inode). It returns B's keys and A's, and the
			// bytes A stored.
			replace := func(prefix string) (bKeys, aKeys [][]byte, aWant [][]byte) {
				bKeys = testKeys(prefix+"-b", 4)
				bBlocks := blockLists(r, 4, 4, 0)
				for _, bl := range bBlocks {
					b.c.fill(r, bl)
				}
				storeAndCheck(t, b.e, b.c, bKeys, bBlocks)
				before := b.e.find(b.e.tables.get(b.ns), bKeys[0])
				if n, _ := a.e.Lookup(ctx, a.ns, bKeys[:1]); n != 1 {
					t.Fatalf("A does not find B's file: lookup %d", n)
				}
				if n, err := a.e.Delete(ctx, a.ns, bKeys[:1]); n != 1 || err != nil {
					t.Fatalf("A's delete: %d %v", n, err)
				}
				aKeys = append([][]byte{bKeys[0]}, testKeys(prefix+"-a", 3)...)
				aBlocks := blockLists(r, 4, 4, 16)
				for _, bl := range aBlocks {
					a.c.fill(r, bl)
					aWant = append(aWant, a.c.data(bl))
				}
				storeAndCheck(t, a.e, a.c, aKeys, aBlocks)
				fi, err := fs.Stat(before.Path)
				if err != nil {
					t.Fatal(err)
				}
				id, _ := fsys.IdentityOf(fi)
				reused := id.Ino == before.Ident.Ino && id.Size == before.Ident.Size
				if _, sim := fs.(*reuseFS); sim && !reused {
					t.Fatalf("the simulation did not reuse the inode: %d, B indexed %d", id.Ino, before.Ident.Ino)
				}
				t.Logf("%s: A's file at inode %d, B's was %d (reused: %v)", prefix, id.Ino, before.Ident.Ino, reused)
				return bKeys, aKeys, aWant
			}
			checkA := func(aKeys, aWant [][]byte) {
				t.Helper()
				into := blockLists(r, 4, 4, 40)
				loadAndCompare(t, a.e, a.c, aKeys, into, aWant)
			}

			// 1. No false present: B's store of c writes it (and its load
			// then loads it); B's load of d reports it missing.
			bKeys, aKeys, aWant := replace("p")
			if !tc.coarse {
				if n, _ := b.e.Lookup(ctx, b.ns, bKeys); n != 1 {
					t.Fatalf("B's lookup of [a,b,c,d] after A replaced the file: %d, want 1 (a, in A's file)", n)
				}
			}
			cBlocks := [][]int{{32, 33, 34, 35}}
			b.c.fill(r, cBlocks[0])
			cWant := b.c.data(cBlocks[0])
			res := wait(t)(b.e.Store(ctx, StoreRequest{Cache: b.c.id, Keys: bKeys[2:3], Blocks: cBlocks}))
			if k := res.Keys[0]; k.Outcome != OutcomeStored {
				t.Fatalf("B's store of c after A replaced its file: %v (%v), want stored", k.Outcome, k.Err)
			}
			loadAndCompare(t, b.e, b.c, bKeys[2:3], [][]int{{44, 45, 46, 47}}, [][]byte{cWant})
			res = wait(t)(b.e.Load(ctx, LoadRequest{Cache: b.c.id, Keys: bKeys[3:4], Blocks: [][]int{{48, 49, 50, 51}}}))
			if k := res.Keys[0]; k.Outcome != OutcomeMissing {
				t.Fatalf("B's load of d: %v (%v), want missing", k.Outcome, k.Err)
			}
			if n, _ := b.e.Lookup(ctx, b.ns, bKeys[1:2]); n != 0 {
				t.Fatalf("B's lookup of b after a load saw the replacement: %d, want 0", n)
			}
			checkA(aKeys, aWant)
			// A's file is found by B without a restart, every key of it.
			if n, _ := b.e.Lookup(ctx, b.ns, aKeys); n != 4 {
				t.Fatalf("B's lookup of A's keys: %d, want 4", n)
			}

			// 2. No foreign delete: B deletes b (its stale entry points at
			// the path of A's file); A's file stays, whole.
			bKeys, aKeys, aWant = replace("q")
			if _, err := b.e.Delete(ctx, b.ns, bKeys[1:2]); err != nil {
				t.Fatal(err)
			}
			if n, _ := a.e.Lookup(ctx, a.ns, aKeys); n != 4 {
				t.Fatalf("A's lookup after B's delete of b: %d, want 4", n)
			}
			checkA(aKeys, aWant)
			if n, _ := b.e.Lookup(ctx, b.ns, aKeys); n != 4 {
				t.Fatalf("B's lookup of A's keys after its delete: %d, want 4", n)
			}
		})
	}
}

// TestTempFileRule: Open removes a temporary file only when it is provably
// abandoned: its flock is free and either its owner is a process of this
// node that is gone (a name with this process's pid but without this
// engine's token is a predecessor's that had the pid), or it is older than
// TempGrace. Files of a live process of this node, young files of other
// nodes (or without an owner), and locked files stay.
func TestTempFileRule(t *testing.T) {
	dir := t.TempDir()
	const me = "nodeA"
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	deadPID := dead.Process.Pid
	old := time.Now().Add(-time.Hour)
	locked := filepath.Join(dir, fmt.Sprintf(".tmp-nodeB-1-%016x", 7))
	files := []struct {
		name string
		old  bool
		keep bool
	}{
		{fmt.Sprintf(".tmp-%s-%d-%016x", me, os.Getppid(), 1), true, true}, // a live process of this node
		{fmt.Sprintf(".tmp-%s-%d-%016x", me, deadPID, 2), false, false},    // a process of this node that is gone
		{fmt.Sprintf(".probe-direct-%s-%d-%016x", me, deadPID, 3), false, false},
		// A predecessor's with this process's pid (a restarted container's
		// daemon has its pid and node name): not this engine's.
		{fmt.Sprintf(".tmp-%s-%d-%016x", me, os.Getpid(), 6), false, false},
		{fmt.Sprintf(".tmp-%s-%d-%032x", me, os.Getpid(), 8), false, false},
		{fmt.Sprintf(".tmp-nodeB-%d-%016x", os.Getpid(), 4), false, true}, // another node's, young
		{fmt.Sprintf(".tmp-nodeB-%d-%016x", os.Getpid(), 5), true, false}, // another node's, old
		{".tmp-0123456789abcdef", false, true},                            // no owner (older kvhost), young
		{".tmp-fedcba9876543210", true, false},                            // no owner, old
		{filepath.Base(locked), true, true},                               // old but locked by its writer
	}
	for _, f := range files {
		p := filepath.Join(dir, f.name)
		if err := os.WriteFile(p, []byte("partial"), 0o644); err != nil {
			t.Fatal(err)
		}
		if f.old {
			os.Chtimes(p, old, old)
		}
	}
	lf, err := os.Open(locked)
	if err != nil {
		t.Fatal(err)
	}
	defer lf.Close()
	if err := syscall.Flock(int(lf.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0), NodeID: me, TempGrace: time.Minute})
	for _, f := range files {
		_, err := os.Stat(filepath.Join(dir, f.name))
		if kept := err == nil; kept != f.keep {
			t.Errorf("%s: kept %v, want %v", f.name, kept, f.keep)
		}
	}
}

// TestLeftoversAreRemovedWhereAnExclusiveFlockNeedsWriteAccess: on NFS
// (version 4) the client emulates flock with a POSIX lock of the whole
// file, and an exclusive one needs the file open for writing. A starting
// engine must still remove the leftovers the rule says are abandoned (a
// gone process's of this node, another node's past temp_grace) and keep
// one whose writer holds its lock.
func TestLeftoversAreRemovedWhereAnExclusiveFlockNeedsWriteAccess(t *testing.T) {
	dir := t.TempDir()
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	old := time.Now().Add(-time.Hour)
	files := []struct {
		name string
		keep bool
	}{
		{fmt.Sprintf(".tmp-n-%d-%016x", dead.Process.Pid, 1), false}, // this node's, its process gone
		{fmt.Sprintf(".tmp-other-%d-%016x", os.Getpid(), 2), false},  // another node's, old
		{fmt.Sprintf(".tmp-other-%d-%016x", os.Getpid(), 3), true},   // another node's, old, locked by its writer
	}
	for _, f := range files {
		p := filepath.Join(dir, f.name)
		if err := os.WriteFile(p, []byte("partial"), 0o644); err != nil {
			t.Fatal(err)
		}
		os.Chtimes(p, old, old)
	}
	lf, err := os.OpenFile(filepath.Join(dir, files[2].name), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer lf.Close()
	if err := syscall.Flock(int(lf.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0), NodeID: "n", TempGrace: time.Minute, FS: fsystest.NFSLocks{FS: fsys.OS{}}})
	for _, f := range files {
		_, err := os.Stat(filepath.Join(dir, f.name))
		if kept := err == nil; kept != f.keep {
			t.Errorf("%s: kept %v, want %v", f.name, kept, f.keep)
		}
	}
}

// TestTempFileOfStoreInFlightKept: a store in flight holds its temporary
// file's flock; another engine opening the same directory, even with a
// TempGrace that makes the file old, leaves it alone, and the store
// completes.
func TestTempFileOfStoreInFlightKept(t *testing.T) {
	dir := t.TempDir()
	g := smallGeometry(true)
	bfs := &blockingWrites{reached: make(chan struct{}), release: make(chan struct{})}
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0), NodeID: "writer", FS: &fsys.Faulty{FS: fsys.OS{}, Inj: bfs}})
	ns, _ := e.Declare(context.Background(), g)
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	bfs.armed.Store(true)
	j, err := e.Store(context.Background(), StoreRequest{Cache: c.id, Keys: testKeys("f", 1), Blocks: [][]int{{0, 1, 2, 3}}})
	if err != nil {
		t.Fatal(err)
	}
	<-bfs.reached
	tmp := leftovers(t, dir)
	if len(tmp) != 1 {
		t.Fatalf("store in flight: temporary files %v", tmp)
	}
	openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0), NodeID: "cleaner", TempGrace: time.Nanosecond})
	if _, err := os.Stat(tmp[0]); err != nil {
		t.Fatalf("another engine's Open removed a temporary file in use: %v", err)
	}
	close(bfs.release)
	bfs.armed.Store(false)
	if res := waitJob(t, j, nil); res.Keys[0].Outcome != OutcomeStored {
		t.Fatalf("store: %v %v", res.Keys[0].Outcome, res.Keys[0].Err)
	}
}

// TestATemporaryFileCreatedBesideAnotherEnginesStartIsKept: two engines of
// one node name and one pid (daemons in containers of their own, each
// pid 1) share a directory. A store of the first has created its
// temporary file but not yet flocked it when the second opens: the
// second takes the file, of its node and pid but not its token, for a
// predecessor's, and its flock is free. The store must still complete
// (holding its file's flock before it relies on it, and writing a file
// of its own if the one it created was removed meanwhile).
func TestATemporaryFileCreatedBesideAnotherEnginesStartIsKept(t *testing.T) {
	dir := t.TempDir()
	g := smallGeometry(true)
	var hold fsystest.Hold
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0), NodeID: "n", FS: &fsys.Faulty{FS: fsys.OS{}, Inj: &hold}})
	ns, _ := e.Declare(context.Background(), g)
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	c.fill(rand.New(rand.NewPCG(15, 15)), []int{0, 1, 2, 3})
	hold.Arm(fsys.OpLock) // the store's flock of its temporary file
	j, err := e.Store(context.Background(), StoreRequest{Cache: c.id, Keys: testKeys("f", 1), Blocks: [][]int{{0, 1, 2, 3}}})
	if err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, "the store's flock of its temporary file held", testwait.Hang, hold.Holding)
	openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0), NodeID: "n"})
	hold.Release()
	if res := waitJob(t, j, nil); res.Keys[0].Outcome != OutcomeStored {
		t.Fatalf("a store whose temporary file another engine of the node opened beside: %v %v", res.Keys[0].Outcome, res.Keys[0].Err)
	}
	loadAndCompare(t, e, c, testKeys("f", 1), [][]int{{4, 5, 6, 7}}, [][]byte{c.data([]int{0, 1, 2, 3})})
}

// TestLockFile: a second engine given the node's lock file fails with
// ErrLocked before it touches the mount (a leftover it would remove is
// still there), and ProbeNodeLock names the holder; once the first
// closes, the probe finds the lock free and a new engine opens and cleans.
func TestLockFile(t *testing.T) {
	dir, state := t.TempDir(), t.TempDir()
	lock := filepath.Join(state, "kvhost.lock")
	cfg := Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0), NodeID: "n", LockFile: lock, Logger: testLogger(t), IOWorkers: 2}
	first, err := testOpen(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	leftover := filepath.Join(dir, fmt.Sprintf(".tmp-n-%d-%016x", dead.Process.Pid, 9))
	if err := os.WriteFile(leftover, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := ProbeNodeLock(lock); !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), fmt.Sprintf("process %d", os.Getpid())) {
		t.Fatalf("ProbeNodeLock of the held lock: %v, want ErrLocked naming process %d", err, os.Getpid())
	}
	second, err := testOpen(context.Background(), cfg)
	if !errors.Is(err, ErrLocked) {
		if second != nil {
			second.Close(context.Background())
		}
		t.Fatalf("second Open: %v, want ErrLocked", err)
	}
	t.Log(err)
	if _, err := os.Stat(leftover); err != nil {
		t.Fatalf("the refused engine touched the mount: %v", err)
	}
	if err := first.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := ProbeNodeLock(lock); err != nil {
		t.Fatalf("ProbeNodeLock once the first closed: %v", err)
	}
	if err := ProbeNodeLock(filepath.Join(state, "none.lock")); err != nil {
		t.Fatalf("ProbeNodeLock of no file: %v", err)
	}
	third, err := testOpen(context.Background(), cfg)
	if err != nil {
		t.Fatalf("Open after the first closed: %v", err)
	}
	defer third.Close(context.Background())
	if _, err := os.Stat(leftover); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("leftover of a dead process kept: %v", err)
	}
}

// TestRelease: a released namespace stops counting against MaxNamespaces,
// is unknown to requests until declared again (same id), and its files
// stay servable. Release refuses unknown ids and namespaces with caches.
func TestRelease(t *testing.T) {
	ctx := context.Background()
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, 0), MaxNamespaces: 2})
	geo := func(i int) Geometry { g := smallGeometry(true); g.Model = fmt.Sprintf("m%d", i); return g }
	ns0, err := e.Declare(ctx, geo(0))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.Declare(ctx, geo(1)); err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns0, geo(0), 16, layoutPlaneFirst)
	r := rand.New(rand.NewPCG(3, 3))
	c.fill(r, []int{0, 1, 2, 3})
	want := c.data([]int{0, 1, 2, 3})
	storeAndCheck(t, e, c, testKeys("r", 1), [][]int{{0, 1, 2, 3}})
	if _, err := e.Declare(ctx, geo(2)); !errors.Is(err, ErrLimit) {
		t.Fatalf("third namespace over a limit of 2: %v", err)
	}
	if err := e.Release(ns0); !errors.Is(err, ErrInvalid) {
		t.Fatalf("release with a cache registered: %v", err)
	}
	if err := e.Release(99); !errors.Is(err, ErrUnknownNamespace) {
		t.Fatalf("release of an unknown id: %v", err)
	}
	if err := e.UnregisterCache(c.id); err != nil {
		t.Fatal(err)
	}
	if err := e.Release(ns0); err != nil {
		t.Fatal(err)
	}
	if err := e.Release(ns0); err != nil {
		t.Fatalf("second release: %v", err)
	}
	if _, err := e.Lookup(ctx, ns0, testKeys("r", 1)); !errors.Is(err, ErrUnknownNamespace) {
		t.Fatalf("lookup in a released namespace: %v", err)
	}
	ns2, err := e.Declare(ctx, geo(2))
	if err != nil {
		t.Fatalf("a new namespace after a release: %v", err)
	}
	if err := e.Release(ns2); err != nil {
		t.Fatal(err)
	}
	again, err := e.Declare(ctx, geo(0))
	if err != nil || again != ns0 {
		t.Fatalf("declared again: %d %v, want %d", again, err, ns0)
	}
	if n, _ := e.Lookup(ctx, ns0, testKeys("r", 1)); n != 1 {
		t.Fatalf("file of a released namespace not servable when declared again: lookup %d", n)
	}
	c2 := newTestCache(t, e, ns0, geo(0), 16, layoutPlaneFirst)
	into := [][]int{{8, 9, 10, 11}}
	loadAndCompare(t, e, c2, testKeys("r", 1), into, [][]byte{want})
}

// nfsFS is a directory as one node's NFS client shows it (close-to-open
// consistency): what is written to a temporary file stays in the client
// (here, in memory) until an fsync, an fstat of the file (Linux's client
// sends the dirty pages before a GETATTR) or its close, while a rename is
// sent to the server at once. At the rename of a file with writes not
// sent yet, the writes sent picks are sent first (what writeback sent
// meanwhile), and after it renamed (where set) is called before Rename
// returns: meanwhile the other nodes see the file as the server holds
// it. With allocate, fallocate reaches the server (NFS 4.2's ALLOCATE:
// the file has its whole length at once); without, it is refused and a
// no-op, as on older servers. statfs says NFS.
type nfsFS struct {
	fsys.OS
	allocate bool
	sent     func(off int64) bool
	renamed  func(path string)

	mu   sync.Mutex
	open map[string]*nfsFile // temporary files open for writing, by name
}

// nfsWrite is a write the client has not sent to the server.
type nfsWrite struct {
	off int64
	b   []byte
}

type nfsFile struct {
	fsys.File
	fs   *nfsFS
	name string

	mu    sync.Mutex
	dirty []nfsWrite
}

func (n *nfsFS) Statfs(path string) (fsys.StatFS, error) {
	st, err := n.OS.Statfs(path)
	st.Type = fstype.NFS
	return st, err
}

func (n *nfsFS) OpenFile(name string, flag int, perm os.FileMode) (fsys.File, error) {
	f, err := n.OS.OpenFile(name, flag, perm)
	return n.opened(f, err, name, flag)
}

// OpenAt is OpenFile relative to dir.
func (n *nfsFS) OpenAt(dir fsys.File, path string, flag int, perm os.FileMode) (fsys.File, error) {
	f, err := n.OS.OpenAt(dir, path, flag, perm)
	return n.opened(f, err, path, flag)
}

// opened keeps the writes to a temporary file just opened at name, as an
// NFS client keeps them until a flush.
func (n *nfsFS) opened(f fsys.File, err error, name string, flag int) (fsys.File, error) {
	if err != nil || flag&os.O_CREATE == 0 || !strings.HasPrefix(filepath.Base(name), tmpPrefix) {
		return f, err
	}
	nf := &nfsFile{File: f, fs: n, name: name}
	n.mu.Lock()
	if n.open == nil {
		n.open = map[string]*nfsFile{}
	}
	n.open[name] = nf
	n.mu.Unlock()
	return nf, nil
}

func (n *nfsFS) Rename(oldpath, newpath string) error {
	return n.rename(oldpath, newpath, func() error { return n.OS.Rename(oldpath, newpath) })
}

// RenameAt is Rename in the directories the engine holds open
// (fsys.AtFS); with noReplace it fails as RenameNoReplace does.
func (n *nfsFS) RenameAt(olddir fsys.File, oldpath string, newdir fsys.File, newpath string, noReplace bool) error {
	if noReplace {
		return n.RenameNoReplace(oldpath, newpath)
	}
	return n.rename(oldpath, newpath, func() error { return n.OS.RenameAt(olddir, oldpath, newdir, newpath, false) })
}

// rename sends what Rename sends, then renames with do.
func (n *nfsFS) rename(oldpath, newpath string, do func() error) error {
	n.mu.Lock()
	f := n.open[oldpath]
	delete(n.open, oldpath)
	n.mu.Unlock()
	if f != nil {
		if err := f.send(n.sent); err != nil {
			return err
		}
	}
	if err := do(); err != nil {
		return err
	}
	if f != nil && n.renamed != nil {
		n.renamed(newpath)
	}
	return nil
}

// RenameNoReplace fails as on NFS, whose client refuses the flag: the
// engine then renames with Rename.
func (n *nfsFS) RenameNoReplace(oldpath, newpath string) error {
	return &os.LinkError{Op: "rename", Old: oldpath, New: newpath, Err: errors.ErrUnsupported}
}

// send writes to the file the writes not sent yet that pick picks (nil:
// all of them).
func (f *nfsFile) send(pick func(off int64) bool) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	kept := f.dirty[:0]
	for _, w := range f.dirty {
		if pick != nil && !pick(w.off) {
			kept = append(kept, w)
			continue
		}
		if _, err := f.File.WriteAt(w.b, w.off); err != nil {
			return err
		}
	}
	f.dirty = kept
	return nil
}

func (f *nfsFile) WriteAt(p []byte, off int64) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.dirty = append(f.dirty, nfsWrite{off, bytes.Clone(p)})
	return len(p), nil
}

func (f *nfsFile) WritevAt(bufs [][]byte, off int64) (int, error) {
	n := 0
	for _, b := range bufs {
		f.WriteAt(b, off+int64(n))
		n += len(b)
	}
	return n, nil
}

func (f *nfsFile) Allocate(size int64) error {
	if !f.fs.allocate {
		return nil
	}
	return f.File.Allocate(size)
}

func (f *nfsFile) Sync() error {
	if err := f.send(nil); err != nil {
		return err
	}
	return f.File.Sync()
}

func (f *nfsFile) Stat() (os.FileInfo, error) {
	if err := f.send(nil); err != nil {
		return nil, err
	}
	return fsys.Fstat(f.File)
}

func (f *nfsFile) Close() error {
	f.fs.mu.Lock()
	delete(f.fs.open, f.name)
	f.fs.mu.Unlock()
	return errors.Join(f.send(nil), f.File.Close())
}

// TestAStoreOnNFSIsWholeWhenAnotherNodeSeesIt: on NFS with buffered I/O
// (an NFS client sends a file's dirty pages asynchronously, at an fsync,
// fstat or close at the latest, and a rename at once), another node that
// finds a store's file between its rename and its close finds it whole:
// the node loads it byte for byte, a node starting then indexes it, and
// neither takes it for corrupt nor removes it, whatever part of the data
// the writer's client sent before the rename.
func TestAStoreOnNFSIsWholeWhenAnotherNodeSeesIt(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name     string
		allocate bool
		sent     func(off int64) bool
	}{
		// Writeback sent the first pages (the header, written last, and
		// two blocks): the file is shorter than its header says.
		{"a prefix sent", false, func(off int64) bool { return off < 3*4096 }},
		// The file has its length (ALLOCATE) and its header: its payload
		// is zeros.
		{"the header sent into a preallocated file", true, func(off int64) bool { return off == 0 }},
		// Nothing sent: an empty file.
		{"nothing sent", false, func(int64) bool { return false }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			renamed := make(chan string, 1)
			release := make(chan struct{})
			var once sync.Once
			letGo := func() { once.Do(func() { close(release) }) }
			writer := &nfsFS{allocate: tc.allocate, sent: tc.sent, renamed: func(p string) {
				renamed <- p
				<-release
			}}
			m := Mount{Path: dir, IO: IOBuffered}
			a := openNodeOn(t, m, "a", writer, 1)
			b := openNodeOn(t, m, "b", &nfsFS{}, 1)
			t.Cleanup(letGo) // before the engines close

			keys := testKeys("nfs", 1)
			a.c.fill(rand.New(rand.NewPCG(22, 1)), []int{0, 1, 2, 3})
			want := [][]byte{a.c.data([]int{0, 1, 2, 3})}
			j, err := a.e.Store(ctx, StoreRequest{Cache: a.c.id, Keys: keys, Blocks: [][]int{{0, 1, 2, 3}}})
			if err != nil {
				t.Fatal(err)
			}
			path := <-renamed // the name is visible, the writer's close not done

			res := wait(t)(b.e.Load(ctx, LoadRequest{Cache: b.c.id, Keys: keys, Blocks: [][]int{{8, 9, 10, 11}}}))
			if k := res.Keys[0]; k.Outcome != OutcomeLoaded {
				t.Errorf("another node's load after the rename: %v %v", k.Outcome, k.Err)
			} else if got := b.c.data([]int{8, 9, 10, 11}); !bytes.Equal(got, want[0]) {
				t.Error("another node's load after the rename: wrong bytes")
			}
			c := openNodeOn(t, m, "c", &nfsFS{}, 1) // its rebuild reads the file
			if st := c.e.Stats(); st.Entries != 1 {
				t.Errorf("a node starting after the rename indexed %d files, want 1", st.Entries)
			}

			letGo()
			wantOutcomes(t, "store", waitJob(t, j, nil), OutcomeStored)
			if _, err := os.Stat(path); err != nil {
				t.Fatalf("the stored file is gone: %v", err)
			}
			for _, n := range []*node{b, c} {
				if st := n.e.Stats(); st.Corrupt != 0 || st.LoadFailures.Corrupt != 0 {
					t.Errorf("node %s counted the file corrupt: %d at start, %d in loads", n.e.cfg.NodeID, st.Corrupt, st.LoadFailures.Corrupt)
				}
				loadAndCompare(t, n.e, n.c, keys, [][]int{{12, 13, 14, 15}}, want)
			}
		})
	}
}
