//go:build invariants

package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"log/slog"
	"math/rand/v2"
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
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// tmpfsDir is shmDir for tests that need a memory file system: spare files
// exist only there.
func tmpfsDir(t *testing.T) string {
	t.Helper()
	d := shmDir(t)
	if d == "" {
		t.Fatal("no /dev/shm: spare files are kept only on a memory file system")
	}
	return d
}

// spareChurn opens an engine on dir with room for ten files (watermarks
// 0.9 and 0.6) and stores n keys one at a time, so that stores evict;
// it returns the engine, its namespace and cache, and each key's bytes.
func spareChurn(t *testing.T, dir string, cfg Config, n int) (*Engine, NamespaceID, *testCache, [][]byte, [][]byte) {
	t.Helper()
	g := smallGeometry(false) // files with a zero tail
	fileLen := int64(4096) + alignTo(g.KeyBytes(), format.Align)
	cfg.Mounts = []Mount{{Path: dir, Capacity: 10 * fileLen, HighWatermark: 0.9, LowWatermark: 0.6}}
	if cfg.Policy == nil {
		cfg.Policy = newTestPolicy(1, 0)
	}
	e := openEngine(t, cfg)
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 64, layoutPlaneFirst)
	r := rand.New(rand.NewPCG(8, 8))
	keys := testKeys("spare", n)
	var want [][]byte
	for i := range keys {
		b := [][]int{{0, 1, 2, 3}}
		c.fill(r, b[0])
		want = append(want, c.data(b[0]))
		storeAndCheck(t, e, c, keys[i:i+1], b)
	}
	return e, ns, c, keys, want
}

func alignTo(n int64, a int) int64 { return (n + int64(a) - 1) / int64(a) * int64(a) }

func TestStoresOnTmpfsWriteIntoEvictedFilesAndLoadTheirOwnBytes(t *testing.T) {
	dir := tmpfsDir(t)
	e, ns, c, keys, want := spareChurn(t, dir, Config{}, 30)
	st := e.Stats()
	if st.Evictions < 15 || st.Reused == 0 {
		t.Fatalf("%d evictions, %d stores into spare files: want evictions and reuse", st.Evictions, st.Reused)
	}
	// Every key still indexed loads its own bytes (not an evicted key's).
	into := [][]int{{8, 9, 10, 11}}
	loaded := 0
	for i, k := range keys {
		if n, _ := e.Lookup(context.Background(), ns, [][]byte{k}); n == 0 {
			continue
		}
		loadAndCompare(t, e, c, [][]byte{k}, into, [][]byte{want[i]})
		loaded++
	}
	if loaded < 5 {
		t.Fatalf("%d keys left to load", loaded)
	}
}

func TestReusedFilesKeepNoByteOfTheirPreviousContents(t *testing.T) {
	dir := tmpfsDir(t)
	e, _, c, _, _ := spareChurn(t, dir, Config{NoChecksum: true}, 12)
	spares := leftovers(t, dir)
	if len(spares) == 0 {
		t.Fatal("no spare file after evictions")
	}
	// Poison every spare: a store that reuses one must overwrite it all.
	for _, p := range spares {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, bytes.Repeat([]byte{0xAB}, int(fi.Size())), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	poisoned := map[uint64]bool{}
	for _, p := range spares {
		poisoned[inode(t, p)] = true
	}
	before := e.Stats().Reused
	r := rand.New(rand.NewPCG(9, 9))
	more := testKeys("after", len(spares))
	for i := range more {
		b := [][]int{{0, 1, 2, 3}}
		c.fill(r, b[0])
		storeAndCheck(t, e, c, more[i:i+1], b)
		loadAndCompare(t, e, c, more[i:i+1], [][]int{{8, 9, 10, 11}}, [][]byte{c.data(b[0])})
	}
	if e.Stats().Reused == before {
		t.Fatal("no store reused a poisoned spare")
	}
	poison := bytes.Repeat([]byte{0xAB}, 16)
	reusedPoisoned := 0
	for _, p := range dataFiles(t, dir) {
		if poisoned[inode(t, p)] {
			reusedPoisoned++
		}
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if i := bytes.Index(b, poison); i >= 0 {
			t.Fatalf("%s: a spare's old bytes at offset %d of %d", p, i, len(b))
		}
	}
	if reusedPoisoned == 0 {
		t.Fatal("no file stored after the poisoning is a poisoned spare: nothing was checked")
	}
}

func TestOpenRemovesSparesLeftBehindEvenUnderThisProcessesPid(t *testing.T) {
	dir := tmpfsDir(t)
	e, _, _, _, _ := spareChurn(t, dir, Config{}, 12)
	// A crashed daemon's spare, named as this process would name it (a
	// restarted container often gets the same pid and host name).
	left := e.own.tempName(dir, sparePrefix)
	if err := os.WriteFile(left, bytes.Repeat([]byte{1}, 8192), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0)})
	if l := leftovers(t, dir); len(l) != 0 {
		t.Fatalf("after Open: %v", l)
	}
}

// Pins protect a load from its own engine's evictions, not from another
// engine on the same directory: a load there that was reading a file
// when it was evicted and reused must fail, not report the new bytes
// loaded (checksums off, so that only the header check can tell).
func TestALoadFailsWhenAnotherEngineReusesItsFileMidRead(t *testing.T) {
	dir := tmpfsDir(t)
	g := smallGeometry(true)
	fileLen := int64(4096) + g.KeyBytes()
	mounts := []Mount{{Path: dir, Capacity: 10 * fileLen, HighWatermark: 0.9, LowWatermark: 0.6}}
	a := openEngine(t, Config{Mounts: mounts, Policy: newTestPolicy(1, 0), NoChecksum: true})
	nsA, err := a.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	ca := newTestCache(t, a, nsA, g, 16, layoutPlaneFirst)
	r := rand.New(rand.NewPCG(5, 5))
	victim := testKeys("victim", 1)
	ca.fill(r, []int{0, 1, 2, 3})
	storeAndCheck(t, a, ca, victim, [][]int{{0, 1, 2, 3}})
	path := dataFiles(t, dir)[0]
	victimIno := inode(t, path)

	// Engine b adopts the victim's file at Open, and its load stops
	// before its payload read until a has reused the file.
	pause := &pauseSecondRead{path: path, reached: make(chan struct{}), release: make(chan struct{})}
	b := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0), NoChecksum: true, FS: &fsys.Faulty{FS: fsys.OS{}, Inj: pause}})
	nsB, err := b.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	cb := newTestCache(t, b, nsB, g, 16, layoutPlaneFirst)
	var releaseOnce sync.Once
	release := func() { releaseOnce.Do(func() { close(pause.release) }) }
	t.Cleanup(release)      // a failure below must not leave b's load paused: Close waits for it
	pause.armed.Store(true) // b's Open read the header already
	job, err := b.Load(context.Background(), LoadRequest{Cache: cb.id, Keys: victim, Blocks: [][]int{{4, 5, 6, 7}}})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-pause.reached:
	case <-time.After(testwait.Hang):
		t.Fatal("the load never read the payload through the file system seam")
	}
	reused := false
	for i := 0; i < 40 && !reused; i++ {
		ca.fill(r, []int{0, 1, 2, 3})
		storeAndCheck(t, a, ca, testKeys(fmt.Sprintf("new-%d-", i), 1), [][]int{{0, 1, 2, 3}})
		for _, p := range dataFiles(t, dir) {
			if p != path && inode(t, p) == victimIno {
				reused = true
			}
		}
	}
	release()
	if !reused {
		t.Fatal("engine a never reused the victim's file: the test checked nothing")
	}
	res := waitJob(t, job, nil)
	if k := res.Keys[0]; k.Outcome == OutcomeLoaded || !errors.Is(k.Err, errReplaced) {
		t.Fatalf("load of a file rewritten mid-read: %v %v; want failed, replaced", k.Outcome, k.Err)
	}
}

// pauseSecondRead blocks the second read of path once armed (a load's
// payload, after its header) until release is closed.
type pauseSecondRead struct {
	path             string
	armed            atomic.Bool
	reads            atomic.Int64
	reached, release chan struct{}
}

func (p *pauseSecondRead) Inject(op fsys.Op, path string) fsys.Fault {
	if op == fsys.OpRead && path == p.path && p.armed.Load() && p.reads.Add(1) == 2 {
		close(p.reached)
		<-p.release
	}
	return fsys.Fault{}
}

func TestSparesFitInTheCapacityAndCloseRemovesThem(t *testing.T) {
	dir := tmpfsDir(t)
	e, _, _, _, _ := spareChurn(t, dir, Config{}, 30)
	st := e.Stats()
	m := st.Mounts[0]
	spares := leftovers(t, dir)
	if m.SpareFiles == 0 || m.SpareFiles != len(spares) {
		t.Fatalf("stats say %d spare files, %d on disk", m.SpareFiles, len(spares))
	}
	if m.Used+m.SpareBytes > m.Capacity {
		t.Fatalf("used %d + spares %d > capacity %d", m.Used, m.SpareBytes, m.Capacity)
	}
	for _, p := range spares {
		// A spare's name says what it is: the next Open removes it.
		rest, ok := strings.CutPrefix(filepath.Base(p), sparePrefix)
		node, pid, owned := tempOwner(rest)
		if !ok || !owned || node != e.own.node || pid != os.Getpid() {
			t.Fatalf("spare %s: not a spare name of this process", p)
		}
	}
	if err := e.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if left := leftovers(t, dir); len(left) != 0 {
		t.Fatalf("after Close: %v", left)
	}
}

func TestSparesAreKeptOnlyWhereTheyHelp(t *testing.T) {
	var disk syscall.Statfs_t
	diskDir := t.TempDir()
	if err := syscall.Statfs(diskDir, &disk); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name  string
		dir   string
		cfg   Config
		spare bool
	}{
		{"tmpfs", tmpfsDir(t), Config{}, true},
		{"tmpfs, NoReuse", tmpfsDir(t), Config{NoReuse: true}, false},
		{fmt.Sprintf("TempDir (statfs magic %#x)", disk.Type), diskDir, Config{}, isMemoryFS(int64(disk.Type))},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e, _, _, _, _ := spareChurn(t, tc.dir, tc.cfg, 20)
			st := e.Stats()
			if st.Evictions == 0 {
				t.Fatal("no eviction")
			}
			if got := st.Mounts[0].SpareFiles > 0 && st.Reused > 0; got != tc.spare {
				t.Fatalf("%d spare files, %d reused: want spares %v", st.Mounts[0].SpareFiles, st.Reused, tc.spare)
			}
			if !tc.spare && len(leftovers(t, tc.dir)) != 0 {
				t.Fatalf("temporary files left: %v", leftovers(t, tc.dir))
			}
		})
	}
}

// Loads pin their files, and eviction never takes a pinned file, so a
// spare is never a file a load still reads: with checksums off (nothing
// would catch it) every key a concurrent load reports loaded has its own
// bytes.
func TestLoadsBesideReusingStoresNeverSeeAnotherKeysBytes(t *testing.T) {
	dir := tmpfsDir(t)
	g := smallGeometry(true)
	fileLen := int64(4096) + g.KeyBytes()
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir, Capacity: 8 * fileLen, HighWatermark: 0.9, LowWatermark: 0.5}},
		Policy: newTestPolicy(1, 0), NoChecksum: true})
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	const loaders = 4
	c := newTestCache(t, e, ns, g, 4*(loaders+1), layoutPlaneFirst)
	var mu sync.Mutex
	stored := map[string][]byte{}
	var names []string
	done := make(chan struct{})
	var wg sync.WaitGroup
	var loadedCount [loaders]int
	for l := range loaders {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(l), 1))
			into := []int{4 + 4*l, 5 + 4*l, 6 + 4*l, 7 + 4*l}
			for {
				select {
				case <-done:
					return
				default:
				}
				mu.Lock()
				if len(names) == 0 {
					mu.Unlock()
					continue
				}
				k := names[len(names)-1-r.IntN(min(len(names), 12))]
				want := stored[k]
				mu.Unlock()
				j, err := e.Load(context.Background(), LoadRequest{Cache: c.id, Keys: [][]byte{[]byte(k)}, Blocks: [][]int{into}})
				if err != nil {
					t.Error(err)
					return
				}
				res, err := j.Wait(context.Background())
				if err != nil {
					t.Error(err)
					return
				}
				if res.Keys[0].Outcome != OutcomeLoaded {
					continue // evicted: a miss is fine
				}
				loadedCount[l]++
				if !bytes.Equal(c.data(into), want) {
					t.Errorf("key %s: loaded another key's bytes", k)
					return
				}
			}
		}()
	}
	r := rand.New(rand.NewPCG(3, 3))
	for i := range 200 {
		k := fmt.Sprintf("race-%03d", i)
		src := []int{0, 1, 2, 3}
		c.fill(r, src)
		data := c.data(src)
		storeAndCheck(t, e, c, [][]byte{[]byte(k)}, [][]int{src})
		mu.Lock()
		stored[k] = data
		names = append(names, k)
		mu.Unlock()
	}
	close(done)
	wg.Wait()
	st := e.Stats()
	total := 0
	for _, n := range loadedCount {
		total += n
	}
	if st.Reused == 0 || total == 0 {
		t.Fatalf("%d stores reused spares, %d loads loaded: the test did not exercise both", st.Reused, total)
	}
}

// A store that finds the file system full removes the spares (they hold
// pages) before it evicts and tries again, and the key is stored.
func TestENOSPCRemovesSparesBeforeTheRetry(t *testing.T) {
	dir := tmpfsDir(t)
	inj := &enospcOnWrite{}
	e, _, c, _, _ := spareChurn(t, dir, Config{FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}}, 20)
	before := leftovers(t, dir)
	if len(before) == 0 {
		t.Fatal("no spares before the full file system")
	}
	inj.armed.Store(true)
	storeAndCheck(t, e, c, testKeys("full", 1), [][]int{{0, 1, 2, 3}})
	if n := inj.fired.Load(); n != 1 {
		t.Fatalf("ENOSPC injected %d times, want 1", n)
	}
	for _, p := range before {
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("spare %s survived the ENOSPC: %v", p, err)
		}
	}
}

// enospcOnWrite fails the first write after it is armed with ENOSPC.
type enospcOnWrite struct {
	armed atomic.Bool
	fired atomic.Int64
}

func (f *enospcOnWrite) Inject(op fsys.Op, _ string) fsys.Fault {
	if op == fsys.OpWrite && f.armed.Load() && f.fired.CompareAndSwap(0, 1) {
		return fsys.Fault{Err: syscall.ENOSPC}
	}
	return fsys.Fault{}
}

// inode is the inode number of the file at path.
func inode(t *testing.T, path string) uint64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// TestSparesKeepTheirInodeAndMoversForgetOnlyRemovedFiles: an evicted
// file kept as a spare keeps its inode and its pages, so the engine does
// not tell movers to forget it (the GPU path keeps its registration for
// the store that reuses it); a spare the engine removes is forgotten
// first.
func TestSparesKeepTheirInodeAndMoversForgetOnlyRemovedFiles(t *testing.T) {
	dir := tmpfsDir(t)
	mv := &fakeMover{}
	cfg := Config{Movers: map[region.Kind]MoverFactory{region.KindDevice: func(MountInfo) (transfer.Mover, error) { return mv, nil }}}
	e, _, _, _, _ := spareChurn(t, dir, cfg, 30)
	if e.Stats().Reused == 0 {
		t.Fatal("no store reused a spare")
	}
	spares := map[uint64]string{}
	filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err == nil && strings.HasPrefix(d.Name(), sparePrefix) {
			var st syscall.Stat_t
			if syscall.Stat(path, &st) == nil {
				spares[st.Ino] = path
			}
		}
		return nil
	})
	if len(spares) == 0 {
		t.Fatal("no spare left after the churn")
	}
	forgotten := func() map[uint64]bool {
		mv.mu.Lock()
		defer mv.mu.Unlock()
		out := map[uint64]bool{}
		for _, ino := range mv.forgotten {
			out[ino] = true
		}
		return out
	}
	before := forgotten()
	for ino, path := range spares {
		if before[ino] {
			t.Fatalf("spare %s (inode %d) was forgotten when it was kept", path, ino)
		}
	}
	if err := e.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	after := forgotten()
	for ino, path := range spares {
		if !after[ino] {
			t.Fatalf("spare %s (inode %d) was removed at Close without being forgotten", path, ino)
		}
	}
}

// TestEngineNeverTruncatesItsFiles: nothing in the engine truncates,
// punches or shrinks a file, apart from the node lock's pid line. A data
// file's pages must stay the pages it had: the GPU path keeps tmpfs files
// registered with CUDA across stores, and a truncated page would leave
// the registration on memory no longer in the file (spares.go zeroes a
// reused spare's tail with writes for that reason).
func TestEngineNeverTruncatesItsFiles(t *testing.T) {
	fset := token.NewFileSet()
	ents, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	forbidden := map[string]bool{"Ftruncate": true, "Truncate": true, "Fallocate": true, "FALLOC_FL_PUNCH_HOLE": true, "O_TRUNC": true}
	found := 0
	for _, ent := range ents {
		name := ent.Name()
		if !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
			continue
		}
		file, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, decl := range file.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok {
				continue
			}
			ast.Inspect(fn, func(n ast.Node) bool {
				sel, ok := n.(*ast.SelectorExpr)
				if !ok || !forbidden[sel.Sel.Name] {
					return true
				}
				found++
				if name == "tempfiles.go" && fn.Name.Name == "lockNode" && sel.Sel.Name == "Ftruncate" {
					return true // the node lock file's pid line
				}
				t.Errorf("%s: %s calls %s: the engine must not truncate or punch its files", fset.Position(sel.Pos()), fn.Name.Name, sel.Sel.Name)
				return true
			})
		}
	}
	if found == 0 {
		t.Fatal("found not even the node lock's Ftruncate: the check reads nothing")
	}
}

// ownerFiles lists the spare owner files under dir.
func ownerFiles(t *testing.T, dir string) []string {
	t.Helper()
	out, err := filepath.Glob(filepath.Join(dir, ownerPrefix+"*"))
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestOpenKeepsTheSparesOfAnEngineStillRunning: a second engine opening
// on the directory (another daemon of the node, with its own socket)
// leaves the first engine's spares, whose owner file the first engine
// holds, and the first engine's next store writes into one of them.
// Both engines' owner files go with their Close, and the spares with
// them.
func TestOpenKeepsTheSparesOfAnEngineStillRunning(t *testing.T) {
	dir := tmpfsDir(t)
	a, _, ca, _, _ := spareChurn(t, dir, Config{}, 12)
	before := spareFiles(t, dir)
	if len(before) == 0 {
		t.Fatal("the first engine kept no spare: nothing to check")
	}
	b := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0), NodeID: "other"})
	if after := spareFiles(t, dir); !slices.Equal(after, before) {
		t.Fatalf("the first engine's spares after the second opened: %v, want %v", after, before)
	}
	if o := ownerFiles(t, dir); len(o) != 2 {
		t.Fatalf("owner files with two engines open: %v, want two", o)
	}
	reused := a.Stats().Reused
	ca.fill(rand.New(rand.NewPCG(9, 9)), []int{0, 1, 2, 3})
	storeAndCheck(t, a, ca, testKeys("after-b", 1), [][]int{{0, 1, 2, 3}})
	if a.Stats().Reused != reused+1 {
		t.Fatalf("the first engine's store after the second opened reused %d spares, want 1", a.Stats().Reused-reused)
	}
	for _, e := range []*Engine{b, a} {
		if err := e.Close(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if l, o := leftovers(t, dir), ownerFiles(t, dir); len(l) != 0 || len(o) != 0 {
		t.Fatalf("after both closed: leftovers %v, owner files %v; want none", l, o)
	}
}

// TestOpenRemovesTheSparesOfEnginesThatEnded: spares whose owner file is
// not locked (the engine crashed: the kernel released its flock) or gone,
// and spares named before owner files, are removed at Open, and so is
// the ended engine's owner file.
func TestOpenRemovesTheSparesOfEnginesThatEnded(t *testing.T) {
	dir := tmpfsDir(t)
	const node, pid = "crashed", 4194000
	crashed, gone := strings.Repeat("a", tokenLen), strings.Repeat("b", tokenLen)
	owner := filepath.Join(dir, ownerName(node, pid, crashed))
	names := []string{
		owner,
		filepath.Join(dir, fmt.Sprintf("%s%s-%d-%s%016x", sparePrefix, node, pid, crashed, 1)),
		filepath.Join(dir, fmt.Sprintf("%s%s-%d-%s%016x", sparePrefix, node, pid, gone, 2)),
		filepath.Join(dir, fmt.Sprintf("%s%s-%d-%016x", sparePrefix, node, pid, 3)), // before owners
	}
	for _, p := range names {
		if err := os.WriteFile(p, make([]byte, 8192), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0)})
	for _, p := range names {
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s after Open: %v, want removed", filepath.Base(p), err)
		}
	}
	if o := ownerFiles(t, dir); len(o) != 1 || filepath.Base(o[0]) != e.own.ownerName() {
		t.Fatalf("owner files after Open: %v, want only the engine's own", o)
	}
}

// TestOpenThatFailsLeavesNoOwnerFile: an Open that fails after it made
// its owner file (here its policy fails to start) removes it.
func TestOpenThatFailsLeavesNoOwnerFile(t *testing.T) {
	dir := tmpfsDir(t)
	_, err := testOpen(context.Background(), Config{
		Mounts: []Mount{{Path: dir}}, IOWorkers: 2, Logger: testLogger(t),
		NewPolicy: func(policy.Index) (policy.Policy, error) { return nil, errors.New("no policy today") },
	})
	if err == nil {
		t.Fatal("Open succeeded with a policy that fails to start")
	}
	if o, l := ownerFiles(t, dir), leftovers(t, dir); len(o) != 0 || len(l) != 0 {
		t.Fatalf("after the failed Open: owner files %v, leftovers %v; want none", o, l)
	}
}

// A spare whose removal fails (trimmed to fit a store, removed after an
// ENOSPC, or given up by the store that took it) stays on disk, so its
// mount goes on counting it, as used, until an eviction there removes it:
// the bytes on disk are the bytes the mount counts.
func TestASpareWhoseRemovalFailsStaysCounted(t *testing.T) {
	cases := []struct {
		name string
		// fail stores with spare removals failing, the faults armed.
		fail func(t *testing.T, e *Engine, c *testCache, inj *stuckSpares)
	}{{
		name: "trimmed to fit a store",
		fail: func(t *testing.T, e *Engine, c *testCache, inj *stuckSpares) {
			// Every store takes a spare of its size; spares of another
			// size only go when a reservation trims them.
			other := otherCache(t, e)
			for _, k := range testKeys("other", 10) {
				storeAndCheck(t, e, other, [][]byte{k}, [][]int{{0, 1, 2, 3}})
				if len(inj.stuck()) > 0 {
					return
				}
			}
		},
	}, {
		name: "removed after an ENOSPC",
		fail: func(t *testing.T, e *Engine, c *testCache, inj *stuckSpares) {
			// A size no spare has: the store's first write is its own.
			other := otherCache(t, e)
			inj.enospc.Store(true)
			storeAndCheck(t, e, other, testKeys("full", 1), [][]int{{0, 1, 2, 3}})
		},
	}, {
		name: "given up by the store that took it",
		fail: func(t *testing.T, e *Engine, c *testCache, inj *stuckSpares) {
			inj.noReuse.Store(true)
			storeAndCheck(t, e, c, testKeys("fresh", 1), [][]int{{0, 1, 2, 3}})
		},
	}, {
		name: "given up by the store that took it, renamed",
		fail: func(t *testing.T, e *Engine, c *testCache, inj *stuckSpares) {
			inj.temps.Store(true)
			inj.noClear.Store(true)
			storeAndCheck(t, e, c, testKeys("fresh", 1), [][]int{{0, 1, 2, 3}})
		},
	}}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := tmpfsDir(t)
			var (
				mu  sync.Mutex
				now = time.Unix(1_700_000_000, 0)
			)
			clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
			inj := &stuckSpares{}
			e, _, c, _, _ := spareChurn(t, dir, Config{FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}, Now: clock}, 20)
			if e.Stats().Mounts[0].SpareFiles == 0 {
				t.Fatal("no spare after the churn: the test proves nothing")
			}
			counted := func(when string) {
				t.Helper()
				m := e.Stats().Mounts[0]
				if on := bytesOnDisk(t, dir); on != m.Used+m.SpareBytes {
					t.Fatalf("%s: %d bytes of files on the mount, %d counted (%d used, %d of spares)", when, on, m.Used+m.SpareBytes, m.Used, m.SpareBytes)
				}
			}
			inj.failing.Store(true)
			tc.fail(t, e, c, inj)
			inj.failing.Store(false)
			stuck := inj.stuck()
			if len(stuck) == 0 {
				t.Fatal("no spare's removal failed: the test proves nothing")
			}
			counted("after spare removals failed")
			if n, want := e.Stats().RemoveFailures, len(slices.Compact(slices.Sorted(slices.Values(stuck)))); n != uint64(want) {
				t.Fatalf("%d failed removals counted, want %d: one per spare left", n, want)
			}
			mu.Lock()
			now = now.Add(leftRetryInterval)
			mu.Unlock()
			e.rm.retryLeft(e.mounts[0]) // as the next eviction there does
			for _, p := range stuck {
				if exists(p) {
					t.Fatalf("spare %s is still there after its removal was tried again", p)
				}
			}
			counted("after the removals were tried again")
		})
	}
}

// stuckSpares is an injector that, while failing, fails the removal of
// every spare with EACCES (with temps, of every temporary file too) and
// records its name; with enospc, the next write fails with ENOSPC; with
// noClear, with EIO; with noReuse, the next rename of a spare to a
// store's temporary name fails with EIO.
type stuckSpares struct {
	failing, temps, enospc, noClear, noReuse atomic.Bool

	mu    sync.Mutex
	paths []string
}

func (s *stuckSpares) Inject(op fsys.Op, path string) fsys.Fault {
	name := filepath.Base(path)
	switch {
	case !s.failing.Load():
	case op == fsys.OpRemove && (strings.HasPrefix(name, sparePrefix) || s.temps.Load() && strings.HasPrefix(name, tmpPrefix)):
		s.mu.Lock()
		defer s.mu.Unlock()
		s.paths = append(s.paths, path)
		return fsys.Fault{Err: syscall.EACCES}
	case op == fsys.OpWrite && s.enospc.CompareAndSwap(true, false):
		return fsys.Fault{Err: syscall.ENOSPC}
	case op == fsys.OpWrite && s.noClear.CompareAndSwap(true, false):
		return fsys.Fault{Err: syscall.EIO}
	case op == fsys.OpRename && strings.HasPrefix(name, tmpPrefix) && s.noReuse.CompareAndSwap(true, false):
		return fsys.Fault{Err: syscall.EIO}
	}
	return fsys.Fault{}
}

// otherCache declares smallGeometry(true), whose files are of another
// size than spareChurn's, and registers a cache of 4 blocks for it.
func otherCache(t *testing.T, e *Engine) *testCache {
	t.Helper()
	g := smallGeometry(true)
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	return newTestCache(t, e, ns, g, 4, layoutPlaneFirst)
}

// stuck returns the spares whose removal failed.
func (s *stuckSpares) stuck() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.paths)
}

// bytesOnDisk is the size of every file under dir but the owner files.
func bytesOnDisk(t *testing.T, dir string) int64 {
	t.Helper()
	var n int64
	filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || strings.HasPrefix(d.Name(), ownerPrefix) || isJournal(d.Name()) || isModelBook(d.Name()) {
			return nil
		}
		if fi, err := d.Info(); err == nil {
			n += fi.Size()
		}
		return nil
	})
	return n
}

// TestAnEngineOpeningBesideAnotherOnAMemoryDirectoryWithoutABoundWarns:
// an engine opening on a memory directory without a cluster capacity
// where another engine runs (its owner file there, flocked: another
// process's, maybe in another container with this process's pid) warns
// once, naming the mount and the number of other engines: each would
// evict and reuse files the others' clients pin. A second engine opening
// then counts both. An owner file no one holds (an engine that ended)
// counts for nothing.
func TestAnEngineOpeningBesideAnotherOnAMemoryDirectoryWithoutABoundWarns(t *testing.T) {
	for _, tc := range []struct {
		name        string
		other       bool // another engine runs (its owner file held)
		first, then int  // other engines each warning names; 0: no warning
	}{
		{"another engine runs", true, 1, 2},
		{"an ended engine's owner file", false, 0, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := tmpfsDir(t)
			owner := filepath.Join(dir, ownerName("elsewhere", os.Getpid(), strings.Repeat("c", tokenLen)))
			f, err := os.OpenFile(owner, os.O_RDWR|os.O_CREATE, 0o644)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if tc.other {
				if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
					t.Fatal(err)
				}
			}
			for i, want := range []int{tc.first, tc.then} {
				var buf lockedBuffer
				openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0), NodeID: fmt.Sprintf("n%d", i),
					Logger: slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelWarn}))})
				got := buf.records(t, SharedDirectoryWarning)
				switch {
				case want == 0 && len(got) != 0:
					t.Fatalf("engine %d: warnings %v; want none", i+1, got)
				case want > 0 && (len(got) != 1 || got[0]["mount"] != dir || got[0]["other_engines"] != float64(want)):
					t.Fatalf("engine %d: warnings %v; want one naming %s and %d other engines", i+1, got, dir, want)
				}
			}
		})
	}
}
