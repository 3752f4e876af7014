//go:build invariants

package engine

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/host/policy"
)

const crashChildEnv = "KVHOST_ENGINE_CRASH_CHILD"

func TestMain(m *testing.M) {
	if dir := os.Getenv(crashChildEnv); dir != "" {
		start, _ := strconv.Atoi(os.Getenv(crashChildEnv + "_START"))
		runChild("crash child", func() error { return crashChild(dir, start) })
	}
	if dir := os.Getenv(demoteChildEnv); dir != "" { // demote_test.go
		start, _ := strconv.Atoi(os.Getenv(demoteChildEnv + "_START"))
		nth, _ := strconv.Atoi(os.Getenv(demoteChildEnv + "_NTH"))
		runChild("demote crash child", func() error { return demoteChild(dir, start, os.Getenv(demoteChildEnv+"_KILL"), nth) })
	}
	if root := os.Getenv(vllmfsCrashEnv); root != "" {
		runChild("vllm-fs crash child", func() error { return vllmfsCrashChild(root) })
	}
	os.Exit(m.Run())
}

// runChild runs a crash child's role and exits the process: with status 1
// and the error on standard error if run fails, else 0 (the looping
// children only end when killed).
func runChild(what string, run func() error) {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, what+":", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// childCache declares g on a crash child's engine and makes a cache of
// blocks blocks in it.
func childCache(ctx context.Context, e *Engine, g Geometry, blocks int) (*testCache, error) {
	ns, err := e.Declare(ctx, g)
	if err != nil {
		return nil, err
	}
	return makeTestCache(e, ns, g, blocks, layoutPlaneFirst)
}

// scanStored reads a crash child's output until it has read want "stored
// N" lines (want < 0: until the output ends, the child dead), raising
// *stored to the highest N; it returns how many such lines it read.
func scanStored(sc *bufio.Scanner, stored *int, want int) int {
	read := 0
	for (want < 0 || read < want) && sc.Scan() {
		if n, err := strconv.Atoi(strings.TrimPrefix(sc.Text(), "stored ")); err == nil {
			*stored = max(*stored, n)
			read++
		}
	}
	return read
}

// awaitLeftover spins (a store's temporary file may live for only
// milliseconds) until dir holds a temporary file, for at most d.
func awaitLeftover(t *testing.T, dir string, d time.Duration) {
	deadline := time.Now().Add(d)
	for len(leftovers(t, dir)) == 0 && time.Now().Before(deadline) {
	}
}

// keyContent fills blocks with bytes derived from the key alone, so that
// another process can check what it loads.
func keyContent(c *testCache, key []byte, blocks []int) {
	c.fill(rand.New(rand.NewPCG(abi.KeyHash(key), 7)), blocks)
}

// startChild runs this test binary again, with no test to run and env
// added to its environment (the child's role), and returns the running
// command, a scanner of its standard output and its standard error.
func startChild(t *testing.T, env ...string) (*exec.Cmd, *bufio.Scanner, *bytes.Buffer) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr := &bytes.Buffer{}
	cmd.Stderr = stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return cmd, bufio.NewScanner(out), stderr
}

// storeBatches is a crash child's loop: from batch start on, it stores
// per keys named prefix-batch from cache c (their blocks drawn with seed
// stream), checks every key was stored (or was present: stored by an
// earlier, killed child), prints "stored <batch>" and calls after, until
// it is killed or something fails.
func storeBatches(ctx context.Context, e *Engine, c *testCache, prefix string, per int, stream uint64, start int, after func(batch int)) error {
	bpk := c.geo.BlocksPerKey()
	for batch := start; ; batch++ {
		keys := testKeys(fmt.Sprintf("%s-%d", prefix, batch), per)
		blocks := blockLists(rand.New(rand.NewPCG(uint64(batch), stream)), per, bpk, (batch%per)*per*bpk)
		for i, k := range keys {
			keyContent(c, k, blocks[i])
		}
		j, err := e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys, Blocks: blocks})
		if err != nil {
			return err
		}
		res, err := j.Wait(ctx)
		if err != nil {
			return err
		}
		if res.Count(OutcomeStored)+res.Count(OutcomePresent) != per {
			return fmt.Errorf("batch %d: %+v", batch, res)
		}
		fmt.Printf("stored %d\n", batch)
		if after != nil {
			after(batch)
		}
	}
}

// crashChild stores keys in a loop, printing each batch it saw stored,
// until it is killed.
func crashChild(dir string, start int) error {
	ctx := context.Background()
	e, err := testOpen(ctx, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(2, abi.OrderBlockMajor), IOWorkers: 2})
	if err != nil {
		return err
	}
	g := smallGeometry(true)
	g.Layers = 64 // 2 MiB per key: a kill often lands mid-file
	c, err := childCache(ctx, e, g, 64)
	if err != nil {
		return err
	}
	return storeBatches(ctx, e, c, "crash", 4, 1, start, nil)
}

// TestCrashMidStore kills (SIGKILL) a process that stores in a loop, then
// reopens its directory: no temporary file survives Open, no torn file is
// visible, every published file loads and verifies, and every batch the
// child saw stored is there.
func TestCrashMidStore(t *testing.T) {
	// Kill at random times and as soon as a temporary file appears, until
	// kills have landed mid-store (a temporary file was left behind) twice.
	dir := t.TempDir()
	stored := -1
	midStore := 0
	for round := 0; round < 10 && (round < 4 || midStore < 2); round++ {
		cmd, sc, stderr := startChild(t, crashChildEnv+"="+dir, fmt.Sprintf("%s_START=%d", crashChildEnv, stored+1))
		if scanStored(sc, &stored, 1) == 0 {
			cmd.Wait()
			t.Fatalf("child stored nothing: %s", stderr.String())
		}
		if round%2 == 0 {
			// Kill as soon as a store is writing a temporary file.
			awaitLeftover(t, dir, 10*time.Second)
		} else {
			time.Sleep(time.Duration(rand.IntN(10000)) * time.Microsecond)
		}
		cmd.Process.Signal(syscall.SIGKILL)
		scanStored(sc, &stored, -1)
		cmd.Wait()
		l := len(leftovers(t, dir))
		if l > 0 {
			midStore++
		}
		t.Logf("round %d: child killed after batch %d; temporary files left: %d", round, stored, l)
	}
	if midStore == 0 {
		t.Fatal("no kill landed mid-store")
	}

	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(2, abi.OrderBlockMajor)})
	if l := leftovers(t, dir); len(l) != 0 {
		t.Fatalf("leftovers after Open: %v", l)
	}
	g := smallGeometry(true)
	g.Layers = 64
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	want := newTestCache(t, e, ns, g, 8, layoutPlaneFirst)
	// Every published file holds two keys that load and verify.
	files := dataFiles(t, dir)
	if st := e.Stats(); st.Entries != len(files) || st.Keys != 2*len(files) {
		t.Fatalf("%d files, index has %d entries and %d keys", len(files), st.Entries, st.Keys)
	}
	var all [][]byte
	for batch := 0; ; batch++ {
		keys := testKeys(fmt.Sprintf("crash-%d", batch), 4)
		n, _ := e.Lookup(context.Background(), ns, keys)
		if batch <= stored && n != 4 {
			t.Fatalf("batch %d, reported stored, has %d keys", batch, n)
		}
		if n == 0 && batch > stored {
			break
		}
		all = append(all, keys[:n]...)
	}
	if len(all) != 2*len(files) {
		t.Fatalf("found %d keys by name, the index has %d", len(all), 2*len(files))
	}
	bpk := g.BlocksPerKey()
	for _, k := range all {
		res := wait(t)(e.Load(context.Background(), LoadRequest{Cache: c.id, Keys: [][]byte{k}, Blocks: [][]int{{0, 1, 2, 3}}}))
		wantOutcomes(t, "load "+string(k), res, OutcomeLoaded)
		keyContent(want, k, []int{0, 1, 2, 3}[:bpk])
		if !bytes.Equal(c.data([]int{0, 1, 2, 3}), want.data([]int{0, 1, 2, 3})) {
			t.Fatalf("key %s: content differs", k)
		}
	}
}

// TestConcurrentSameKey stores the same keys at once from two engines over
// one directory (as two nodes sharing a mount) and two jobs of one engine,
// with different contents: every key ends as one intact file holding one of
// the contents.
func TestConcurrentSameKey(t *testing.T) {
	dir := t.TempDir()
	g := smallGeometry(true)
	ctx := context.Background()
	type side struct {
		e *Engine
		c *testCache
	}
	var sides []side
	for i := range 2 {
		e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, abi.OrderLayerMajor)})
		ns, err := e.Declare(ctx, g)
		if err != nil {
			t.Fatal(err)
		}
		c := newTestCache(t, e, ns, g, 8, layoutPlaneFirst)
		c.fill(rand.New(rand.NewPCG(uint64(i), 3)), []int{0, 1, 2, 3})
		sides = append(sides, side{e, c})
	}
	contents := [][]byte{sides[0].c.data([]int{0, 1, 2, 3}), sides[1].c.data([]int{0, 1, 2, 3})}
	rounds := 40
	if testing.Short() {
		rounds = 10
	}
	for r := range rounds {
		key := [][]byte{fmt.Appendf(nil, "same-%d", r)}
		var wg sync.WaitGroup
		results := make([]Result, 4)
		for w := range 4 {
			wg.Go(func() {
				s := sides[w%2]
				results[w] = wait(t)(s.e.Store(ctx, StoreRequest{Cache: s.c.id, Keys: key, Blocks: [][]int{{0, 1, 2, 3}}}))
			})
		}
		wg.Wait()
		stored := 0
		for _, res := range results {
			switch res.Keys[0].Outcome {
			case OutcomeStored:
				stored++
			case OutcomePresent:
			default:
				t.Fatalf("round %d: %v %v", r, res.Keys[0].Outcome, res.Keys[0].Err)
			}
		}
		if stored == 0 {
			t.Fatalf("round %d: nobody stored", r)
		}
		// A third engine reads what is on disk.
		for i, s := range sides {
			s.c.clear([]int{4, 5, 6, 7})
			res := wait(t)(s.e.Load(ctx, LoadRequest{Cache: s.c.id, Keys: key, Blocks: [][]int{{4, 5, 6, 7}}}))
			if res.Keys[0].Outcome != OutcomeLoaded {
				t.Fatalf("round %d: engine %d: %v %v", r, i, res.Keys[0].Outcome, res.Keys[0].Err)
			}
			got := s.c.data([]int{4, 5, 6, 7})
			if !bytes.Equal(got, contents[0]) && !bytes.Equal(got, contents[1]) {
				t.Fatalf("round %d: engine %d loaded a torn mix", r, i)
			}
		}
	}
	if n := len(dataFiles(t, dir)); n != rounds {
		t.Fatalf("%d files for %d keys", n, rounds)
	}
	if l := leftovers(t, dir); len(l) != 0 {
		t.Fatalf("leftovers: %v", l)
	}
}

// TestExternalChanges: a file deleted or replaced behind the engine's back
// is a miss, never a stale hit (VerifyInterval 0: every hit is checked); a corrupt file is a failed load and is
// dropped.
func TestExternalChanges(t *testing.T) {
	dir := t.TempDir()
	ctx := context.Background()
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, abi.OrderLayerMajor)})
	g := smallGeometry(true)
	ns, _ := e.Declare(ctx, g)
	c := newTestCache(t, e, ns, g, 64, layoutBlockFirst)
	r := rand.New(rand.NewPCG(5, 5))
	keys := testKeys("ext", 6)
	blocks := blockLists(r, 6, 4, 0)
	for _, b := range blocks {
		c.fill(r, b)
	}
	storeAndCheck(t, e, c, keys, blocks)
	path := func(k []byte) string {
		_, paths, _, err := e.nm.names(ctx, e.tables.get(ns), [][]byte{k})
		if err != nil {
			t.Fatal(err)
		}
		return paths[0]
	}
	into := [][]int{{40, 41, 42, 43}}
	load := func(k []byte) KeyResult {
		return wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: [][]byte{k}, Blocks: into})).Keys[0]
	}

	// Deleted: lookup and load miss.
	os.Remove(path(keys[0]))
	if n, _ := e.Lookup(ctx, ns, keys); n != 0 {
		t.Fatalf("deleted first key: lookup %d", n)
	}
	if kr := load(keys[0]); kr.Outcome != OutcomeMissing {
		t.Fatalf("deleted key: %v %v", kr.Outcome, kr.Err)
	}
	// Deleted between lookup and load: the load finds it gone.
	if n, _ := e.Lookup(ctx, ns, keys[1:2]); n != 1 {
		t.Fatal("key 1 missing")
	}
	os.Remove(path(keys[1]))
	if kr := load(keys[1]); kr.Outcome != OutcomeMissing || !errors.Is(kr.Err, ErrNotFound) {
		t.Fatalf("deleted after lookup: %v %v", kr.Outcome, kr.Err)
	}
	// Replaced by another key's file: a miss, reported.
	if err := os.Rename(path(keys[3]), path(keys[2])); err != nil {
		t.Fatal(err)
	}
	if n, _ := e.Lookup(ctx, ns, keys[2:3]); n != 0 {
		t.Fatal("replaced file is a stale hit")
	}
	if kr := load(keys[2]); kr.Outcome != OutcomeMissing {
		t.Fatalf("replaced key: %v %v", kr.Outcome, kr.Err)
	}
	// Corrupt payload: a failed load, the entry dropped, the file removed.
	p4 := path(keys[4])
	f, err := os.OpenFile(p4, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt([]byte{0xff ^ c.block(2, 1, blocks[4][3])[100]}, 4096+int64(2*2*4+1*4+3)*4096+100)
	f.Close()
	kr := load(keys[4])
	if kr.Outcome != OutcomeFailed || !errors.Is(kr.Err, ErrCorrupt) {
		t.Fatalf("corrupt payload: %v %v", kr.Outcome, kr.Err)
	}
	if n, _ := e.Lookup(ctx, ns, keys[4:5]); n != 0 {
		t.Fatal("corrupt entry still indexed")
	}
	if _, err := os.Stat(p4); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("corrupt file kept: %v", err)
	}
	// Corrupt header.
	p5 := path(keys[5])
	f, _ = os.OpenFile(p5, os.O_RDWR, 0)
	f.WriteAt([]byte{0x55}, 40)
	f.Close()
	if kr := load(keys[5]); kr.Outcome != OutcomeFailed || !errors.Is(kr.Err, ErrCorrupt) {
		t.Fatalf("corrupt header: %v %v", kr.Outcome, kr.Err)
	}
	// Key 3's file was moved away: a miss too.
	if n, _ := e.Lookup(ctx, ns, keys[3:4]); n != 0 {
		t.Fatal("moved file is a stale hit")
	}
	if st := e.Stats(); st.Corrupt != 2 || st.Vanished < 3 || st.Entries != 0 {
		t.Fatalf("stats %+v", st)
	}
	// Delete through the API.
	storeAndCheck(t, e, c, keys[:2], blocks[:2])
	if n, err := e.Delete(ctx, ns, keys[:2]); n != 2 || err != nil {
		t.Fatalf("Delete: %d %v", n, err)
	}
	if n, _ := e.Lookup(ctx, ns, keys); n != 0 || len(dataFiles(t, dir)) != 1 {
		t.Fatalf("after delete: lookup %d, files %v", n, dataFiles(t, dir))
	}
}

// blockingFS blocks reads of one file until released, to hold a load (and
// its pin) in flight.
type blockingFS struct {
	path    atomic.Value // string
	reached chan struct{}
	release chan struct{}
	once    sync.Once
}

func (b *blockingFS) Inject(op fsys.Op, path string) fsys.Fault {
	if p, _ := b.path.Load().(string); op == fsys.OpRead && path == p {
		b.once.Do(func() { close(b.reached) })
		<-b.release
	}
	return fsys.Fault{}
}

// TestCapacityPinned fills a small mount while a load holds a pin: the
// hostile policy offers the pinned entry first, the engine never removes
// it, evicts others, and fails a store that cannot fit with ErrNoSpace
// naming the mount, harming nothing stored.
func TestCapacityPinned(t *testing.T) {
	dir := t.TempDir()
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := 4096 + g.KeyBytes()
	bfs := &blockingFS{reached: make(chan struct{}), release: make(chan struct{})}
	pol := newTestPolicy(1, abi.OrderLayerMajor)
	pol.hostile = true
	e := openEngine(t, Config{
		Mounts: []Mount{{Path: dir, Capacity: 8 * fileLen, HighWatermark: 0.75, LowWatermark: 0.5}},
		Policy: pol, FS: &fsys.Faulty{FS: fsys.OS{}, Inj: bfs},
	})
	ns, _ := e.Declare(ctx, g)
	c := newTestCache(t, e, ns, g, 128, layoutPlaneFirst)
	r := rand.New(rand.NewPCG(9, 9))
	keys := testKeys("cap", 20)
	blocks := blockLists(r, 20, 4, 0)
	for _, b := range blocks {
		c.fill(r, b)
	}
	storeAndCheck(t, e, c, keys[:1], blocks[:1])
	pinnedData := c.data(blocks[0])
	_, paths, _, _ := e.nm.names(ctx, e.tables.get(ns), keys[:1])
	bfs.path.Store(paths[0])
	loadJob, err := e.Load(ctx, LoadRequest{Cache: c.id, Keys: keys[:1], Blocks: [][]int{{100, 101, 102, 103}}})
	if err != nil {
		t.Fatal(err)
	}
	<-bfs.reached // the load is reading: key 0 is pinned

	for i := 1; i < 20; i++ {
		storeAndCheck(t, e, c, keys[i:i+1], blocks[i:i+1])
		st := e.Stats()
		if st.Mounts[0].Used > 8*fileLen {
			t.Fatalf("after key %d: %d bytes used of %d", i, st.Mounts[0].Used, 8*fileLen)
		}
	}
	st := e.Stats()
	if st.Evictions == 0 || st.Mounts[0].Used > 6*fileLen {
		t.Fatalf("no eviction: %+v", st)
	}
	if _, err := os.Stat(paths[0]); err != nil {
		t.Fatalf("pinned file evicted: %v", err)
	}
	// Latest keys survive (LRU): the last one is loadable.
	loadAndCompare(t, e, c, keys[19:], [][]int{{110, 111, 112, 113}}, [][]byte{c.data(blocks[19])})

	close(bfs.release)
	res := waitJob(t, loadJob, nil)
	wantOutcomes(t, "pinned load", res, OutcomeLoaded)
	if !bytes.Equal(c.data([]int{100, 101, 102, 103}), pinnedData) {
		t.Fatal("pinned load differs")
	}

	// A mount that fits one file, with it pinned: the next store fails
	// with ErrNoSpace naming the mount; the pinned file stays loadable.
	dir2 := t.TempDir()
	bfs2 := &blockingFS{reached: make(chan struct{}), release: make(chan struct{})}
	e2 := openEngine(t, Config{Mounts: []Mount{{Path: dir2, Capacity: fileLen + fileLen/2}}, Policy: pol, FS: &fsys.Faulty{FS: fsys.OS{}, Inj: bfs2}})
	ns2, _ := e2.Declare(ctx, g)
	c2 := newTestCache(t, e2, ns2, g, 128, layoutPlaneFirst)
	c2.fill(r, blocks[0])
	c2.fill(r, blocks[1])
	storeAndCheck(t, e2, c2, keys[:1], blocks[:1])
	_, paths2, _, _ := e2.nm.names(ctx, e2.tables.get(ns2), keys[:1])
	bfs2.path.Store(paths2[0])
	lj, _ := e2.Load(ctx, LoadRequest{Cache: c2.id, Keys: keys[:1], Blocks: [][]int{{100, 101, 102, 103}}})
	<-bfs2.reached
	res = wait(t)(e2.Store(ctx, StoreRequest{Cache: c2.id, Keys: keys[1:2], Blocks: blocks[1:2]}))
	if k := res.Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, ErrNoSpace) || !strings.Contains(k.Err.Error(), dir2) {
		t.Fatalf("store without space: %v %v", k.Outcome, k.Err)
	}
	close(bfs2.release)
	wantOutcomes(t, "pinned load", waitJob(t, lj, nil), OutcomeLoaded)
	if l := leftovers(t, dir2); len(l) != 0 {
		t.Fatalf("leftovers: %v", l)
	}
	// Unpinned now: the store evicts it and succeeds.
	storeAndCheck(t, e2, c2, keys[1:2], blocks[1:2])
}

// stepInjector counts file operations while armed and fails the at-th.
type stepInjector struct {
	armed atomic.Bool
	at    int64
	n     atomic.Int64
	err   error
	fired atomic.Bool
}

func (s *stepInjector) Inject(op fsys.Op, path string) fsys.Fault {
	// A temporary file's flock may fail without failing its store (it
	// only keeps another node's clean-up away: tempfiles.go); it is not
	// one of the steps. Nor is the close of a directory's descriptor,
	// held for the renames and unlinks in it (openDir): it carries no
	// data, and what was done through it is done.
	if !s.armed.Load() || op == fsys.OpLock || op == fsys.OpClose && isDir(path) {
		return fsys.Fault{}
	}
	if s.n.Add(1)-1 == s.at {
		s.fired.Store(true)
		if s.err == nil {
			return fsys.Fault{Short: true}
		}
		return fsys.Fault{Err: s.err}
	}
	return fsys.Fault{}
}

// isDir reports whether path is a directory.
func isDir(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.IsDir()
}

// TestInjectedFaults steps a failure (ENOSPC, EIO, a short write) through
// every file operation of a store workload but its flocks: each failure surfaces as a
// failed key (ENOSPC as ErrNoSpace), leaves no temporary file, and every
// block stored before, or reported stored, stays loadable.
func TestInjectedFaults(t *testing.T) {
	g := smallGeometry(false) // padding and bounce buffers too
	ctx := context.Background()
	for _, fault := range []error{syscall.ENOSPC, syscall.EIO, nil} {
		name := "short"
		if fault != nil {
			name = fault.Error()
		}
		t.Run(name, func(t *testing.T) {
			for at := int64(0); ; at++ {
				dir := t.TempDir()
				inj := &stepInjector{at: at, err: fault}
				e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(2, abi.OrderLayerMajor), Fsync: true, FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}})
				ns, _ := e.Declare(ctx, g)
				c := newTestCache(t, e, ns, g, 64, layoutPlaneFirst)
				r := rand.New(rand.NewPCG(uint64(at), 1))
				keys := testKeys("inj", 6)
				blocks := blockLists(r, 6, 4, 0)
				for _, b := range blocks {
					c.fill(r, b)
				}
				storeAndCheck(t, e, c, keys[:2], blocks[:2]) // earlier blocks
				inj.armed.Store(true)
				res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys[2:], Blocks: blocks[2:]}))
				inj.armed.Store(false)
				good := append([]int{0, 1}, nil...)
				failed := 0
				for i, k := range res.Keys {
					switch k.Outcome {
					case OutcomeStored:
						good = append(good, 2+i)
					case OutcomeFailed:
						failed++
						if fault == syscall.ENOSPC && !errors.Is(k.Err, ErrNoSpace) {
							t.Fatalf("at %d: ENOSPC surfaced as %v", at, k.Err)
						}
						if fault != nil && !errors.Is(k.Err, fault) {
							t.Fatalf("at %d: %v does not wrap %v", at, k.Err, fault)
						}
					default:
						t.Fatalf("at %d: key %d: %v", at, i, k.Outcome)
					}
				}
				// One ENOSPC is retried after an eviction (the file
				// system may be fuller than the engine knew), so the
				// store may succeed; other faults fail it.
				if fault != nil && fault != syscall.ENOSPC && inj.fired.Load() && failed == 0 {
					t.Fatalf("at %d: injected %v, nothing failed", at, fault)
				}
				if l := leftovers(t, dir); len(l) != 0 {
					t.Fatalf("at %d: leftovers %v", at, l)
				}
				var gk [][]byte
				var gi [][]int
				var gw [][]byte
				for n, i := range good {
					gk, gi, gw = append(gk, keys[i]), append(gi, []int{40 + n%6*4, 41 + n%6*4, 42 + n%6*4, 43 + n%6*4}[:4]), append(gw, c.data(blocks[i]))
				}
				loadAndCompare(t, e, c, gk, gi, gw)
				e.Close(ctx)
				if !inj.fired.Load() {
					t.Logf("%s: stepped through %d operations", name, at)
					if at < 10 {
						t.Fatalf("only %d operations", at)
					}
					return
				}
			}
		})
	}
}

// TestRealTmpfsFull stores into a real 2 MiB tmpfs (root only) that holds
// 1 MiB of another program's data, with a configured capacity of 1 GiB
// (the reproduction, scaled down): the capacity is what the file
// system can hold, so every store succeeds by evicting older keys, the
// foreign file is untouched, no temporary file is left, and the latest
// keys load. Then the file system is filled to the last byte: a new engine
// starts on it, serves what is stored, and fails stores with ErrNoSpace,
// counted in Stats.
func TestRealTmpfsFull(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a tmpfs")
	}
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=2m"); err != nil {
		t.Skipf("cannot mount a tmpfs here: %v", err)
	}
	defer unix.Unmount(dir, unix.MNT_DETACH)
	foreign := filepath.Join(dir, "foreign.bin")
	if err := os.WriteFile(foreign, bytes.Repeat([]byte{0xab}, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(dir, "kv")
	ctx := context.Background()
	g := smallGeometry(true) // 128 KiB keys
	e := openEngine(t, Config{Mounts: []Mount{{Path: root, Capacity: 1 << 30}}, Policy: newTestPolicy(1, abi.OrderLayerMajor)})
	ns, _ := e.Declare(ctx, g)
	c := newTestCache(t, e, ns, g, 128, layoutPlaneFirst)
	r := rand.New(rand.NewPCG(3, 3))
	keys := testKeys("full", 24)
	blocks := blockLists(r, 24, 4, 0)
	for i := range keys {
		c.fill(r, blocks[i])
		res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys[i : i+1], Blocks: blocks[i : i+1]}))
		if k := res.Keys[0]; k.Outcome != OutcomeStored {
			t.Fatalf("key %d: %v %v", i, k.Outcome, k.Err)
		}
	}
	st := e.Stats()
	if m := st.Mounts[0]; m.Capacity > 1<<20 || m.Used+m.SpareBytes > m.Capacity || st.Evictions == 0 || st.Failures != 0 {
		t.Fatalf("stats after 24 stores into 1 MiB of free space: %+v", st)
	}
	if b, err := os.ReadFile(foreign); err != nil || !bytes.Equal(b, bytes.Repeat([]byte{0xab}, 1<<20)) {
		t.Fatalf("foreign file harmed: %v", err)
	}
	// Evicted files kept for reuse (spares.go) are the only temporary files.
	if l := leftovers(t, dir); len(l) != st.Mounts[0].SpareFiles {
		t.Fatalf("leftovers: %v; %d spare files", l, st.Mounts[0].SpareFiles)
	}
	last := keys[len(keys)-2:]
	want := [][]byte{c.data(blocks[len(keys)-2]), c.data(blocks[len(keys)-1])}
	into := [][]int{{100, 101, 102, 103}, {104, 105, 106, 107}}
	loadAndCompare(t, e, c, last, into, want)
	e.Close(ctx)

	// 100% full.
	f, err := os.Create(filepath.Join(dir, "filler"))
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := f.Write(make([]byte, 4096)); err != nil {
			break
		}
	}
	f.Close()
	var sfs unix.Statfs_t
	unix.Statfs(dir, &sfs)
	t.Logf("file system full: %d blocks available", sfs.Bavail)
	e2 := openEngine(t, Config{Mounts: []Mount{{Path: root, Capacity: 1 << 30}}, Policy: newTestPolicy(1, abi.OrderLayerMajor)})
	ns2, _ := e2.Declare(ctx, g)
	c2 := newTestCache(t, e2, ns2, g, 128, layoutPlaneFirst)
	if n, _ := e2.Lookup(ctx, ns2, last); n != 2 {
		t.Fatalf("lookup on a full file system: %d, want 2", n)
	}
	loadAndCompare(t, e2, c2, last, into, want)
	c2.fill(r, blocks[0])
	res := wait(t)(e2.Store(ctx, StoreRequest{Cache: c2.id, Keys: testKeys("more", 1), Blocks: blocks[:1]}))
	switch k := res.Keys[0]; {
	case k.Outcome == OutcomeStored:
		// Eviction of older keys made room: also fine.
	case errors.Is(k.Err, ErrNoSpace):
		if f := e2.Stats().StoreFailures; f.NoSpace != 1 {
			t.Fatalf("store failures %+v, want one no-space", f)
		}
	default:
		t.Fatalf("store on a full file system: %v %v", k.Outcome, k.Err)
	}
	if l := leftovers(t, dir); len(l) != e2.Stats().Mounts[0].SpareFiles {
		t.Fatalf("leftovers: %v; %d spare files", l, e2.Stats().Mounts[0].SpareFiles)
	}
	e2.Close(ctx)
	if l := leftovers(t, dir); len(l) != 0 {
		t.Fatalf("leftovers after Close: %v", l)
	}
}

// TestCancelAndClose: a cancelled store fails its keys, and Close cancels
// a store stuck in I/O and leaves no temporary file.
func TestCancelAndClose(t *testing.T) {
	dir := t.TempDir()
	g := smallGeometry(true)
	bfs := &blockingWrites{reached: make(chan struct{}), release: make(chan struct{})}
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0), FS: &fsys.Faulty{FS: fsys.OS{}, Inj: bfs}})
	ns, _ := e.Declare(context.Background(), g)
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	cctx, cancel := context.WithCancel(context.Background())
	cancel()
	res := wait(t)(e.Store(cctx, StoreRequest{Cache: c.id, Keys: testKeys("c", 1), Blocks: [][]int{{0, 1, 2, 3}}}))
	if k := res.Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, context.Canceled) {
		t.Fatalf("cancelled store: %v %v", k.Outcome, k.Err)
	}
	bfs.armed.Store(true)
	j, err := e.Store(context.Background(), StoreRequest{Cache: c.id, Keys: testKeys("d", 1), Blocks: [][]int{{0, 1, 2, 3}}})
	if err != nil {
		t.Fatal(err)
	}
	<-bfs.reached
	if l := leftovers(t, dir); len(l) != 1 {
		t.Fatalf("store in flight: temporary files %v", l)
	}
	// The write stuck in I/O is let go only once Close has cancelled its
	// job (at its deadline): let go sooner, the store could publish
	// before the cancellation, as a loaded machine's scheduler may run it.
	var release sync.Once
	e.busy.jobs.mu.Lock()
	for _, jj := range e.busy.jobs.jobs {
		cancelJob := jj.cancel
		jj.cancel = func() { cancelJob(); release.Do(func() { close(bfs.release) }) }
	}
	e.busy.jobs.mu.Unlock()
	closeCtx, ccancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer ccancel()
	if err := e.Close(closeCtx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Close: %v", err)
	}
	res = waitJob(t, j, nil)
	if k := res.Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, context.Canceled) {
		t.Fatalf("store cancelled by Close: %v %v", k.Outcome, k.Err)
	}
	if l := leftovers(t, dir); len(l) != 0 || len(dataFiles(t, dir)) != 0 {
		t.Fatalf("after Close: leftovers %v, files %v", l, dataFiles(t, dir))
	}
	if _, err := e.Store(context.Background(), StoreRequest{Cache: c.id}); !errors.Is(err, ErrClosed) {
		t.Fatalf("store after Close: %v", err)
	}
}

type blockingWrites struct {
	armed   atomic.Bool
	reached chan struct{}
	release chan struct{}
	once    sync.Once
}

func (b *blockingWrites) Inject(op fsys.Op, _ string) fsys.Fault {
	if op == fsys.OpWrite && b.armed.Load() {
		b.once.Do(func() { close(b.reached) })
		<-b.release
	}
	return fsys.Fault{}
}

// TestVerifyInterval: with Config.VerifyInterval, a lookup trusts an entry
// checked within the interval, a load of its vanished file is still reported
// missing (never loaded), and once the interval has passed the lookup checks
// the file again and misses.
func TestVerifyInterval(t *testing.T) {
	dir := t.TempDir()
	ctx := context.Background()
	var mu sync.Mutex
	now := time.Unix(1_700_000_000, 0)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, abi.OrderLayerMajor),
		VerifyInterval: time.Second, Now: clock})
	g := smallGeometry(true)
	ns, _ := e.Declare(ctx, g)
	c := newTestCache(t, e, ns, g, 64, layoutBlockFirst)
	r := rand.New(rand.NewPCG(9, 9))
	keys := testKeys("iv", 2)
	blocks := blockLists(r, 2, 4, 0)
	for _, b := range blocks {
		c.fill(r, b)
	}
	storeAndCheck(t, e, c, keys, blocks)
	_, paths, _, err := e.nm.names(ctx, e.tables.get(ns), keys[:1])
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(paths[0]); err != nil {
		t.Fatal(err)
	}
	if n, _ := e.Lookup(ctx, ns, keys); n != 2 {
		t.Fatalf("within the interval: lookup %d, want 2 (trusted)", n)
	}
	res := wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: keys[:1], Blocks: [][]int{{40, 41, 42, 43}}}))
	if kr := res.Keys[0]; kr.Outcome != OutcomeMissing {
		t.Fatalf("load of a vanished file: %v %v, want missing", kr.Outcome, kr.Err)
	}
	// The failed load dropped the entry; a fresh vanished entry is found
	// once the interval has passed.
	_, paths, _, _ = e.nm.names(ctx, e.tables.get(ns), keys[1:])
	os.Remove(paths[0])
	if n, _ := e.Lookup(ctx, ns, keys[1:]); n != 1 {
		t.Fatalf("second key within the interval: lookup %d, want 1", n)
	}
	advance(2 * time.Second)
	if n, _ := e.Lookup(ctx, ns, keys[1:]); n != 0 {
		t.Fatalf("after the interval: lookup %d, want 0", n)
	}
}

// faultyStore is injectedEngine on one mount, its cache holding n keys'
// random bytes (seeded by seed).
func faultyStore(t *testing.T, pol policy.Policy, inj fsys.Injector, name string, n, numBlocks int, seed uint64) (*Engine, NamespaceID, *testCache, [][]byte, [][]int) {
	t.Helper()
	e, ns, c := injectedEngine(t, []Mount{{Path: t.TempDir()}}, pol, inj, numBlocks)
	r := rand.New(rand.NewPCG(seed, seed+1))
	keys, blocks := testKeys(name, n), blockLists(r, n, 4, 0)
	for _, b := range blocks {
		c.fill(r, b)
	}
	return e, ns, c, keys, blocks
}

// TestAStoreOutlivesAFailedFlockOfItsTemporaryFile: the flock of a store's
// temporary file only keeps another node's clean-up away; a file system
// that refuses it (EIO on every flock) still stores, byte for byte.
func TestAStoreOutlivesAFailedFlockOfItsTemporaryFile(t *testing.T) {
	locks := &fsys.Counter{Ops: []fsys.Op{fsys.OpLock}, Fault: fsys.Fault{Err: syscall.EIO}, Sticky: true}
	e, _, c, keys, blocks := faultyStore(t, newTestPolicy(1, abi.OrderLayerMajor), locks, "nolock", 3, 64, 7)
	before := locks.Fired()
	storeAndCheck(t, e, c, keys, blocks)
	if locks.Fired() == before {
		t.Fatal("no flock was refused: the test proves nothing")
	}
	loadAndCompare(t, e, c, keys, [][]int{{40, 41, 42, 43}, {44, 45, 46, 47}, {48, 49, 50, 51}},
		[][]byte{c.data(blocks[0]), c.data(blocks[1]), c.data(blocks[2])})
}

// onePathPolicy names every key's file "one.kv": a store of a new key
// replaces the file of another.
type onePathPolicy struct{ *testPolicy }

func (p onePathPolicy) Name(ctx context.Context, recs []abi.NameRecord) error {
	if err := p.testPolicy.Name(ctx, recs); err != nil {
		return err
	}
	for i := range recs {
		recs[i].PathLen = uint32(copy(recs[i].PathBuf[:], "one.kv"))
	}
	return nil
}

// TestAStoreFailingAfterItsRenameUnindexesTheFileItReplaced: a store whose
// new file replaces another key's file at its path and then fails to close
// (after the rename): the new file is removed, and the old one, gone, is
// no longer indexed or counted (a lookup of its key does not find it, the
// mount's used bytes are 0).
func TestAStoreFailingAfterItsRenameUnindexesTheFileItReplaced(t *testing.T) {
	ctx := context.Background()
	var failClose atomic.Bool
	inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		// The close of a temporary file: only seal's, after the rename.
		if op == fsys.OpClose && failClose.Load() && strings.HasPrefix(filepath.Base(path), tmpPrefix) {
			return fsys.Fault{Err: syscall.EIO}
		}
		return fsys.Fault{}
	})
	e, ns, c, keys, blocks := faultyStore(t, onePathPolicy{newTestPolicy(1, abi.OrderLayerMajor)}, inj, "replaced", 2, 32, 3)
	storeAndCheck(t, e, c, keys[:1], blocks[:1])
	failClose.Store(true)
	res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys[1:], Blocks: blocks[1:]}))
	failClose.Store(false)
	if res.Keys[0].Outcome != OutcomeFailed {
		t.Fatalf("the store whose close failed after its rename: %+v, want failed", res.Keys[0])
	}
	// Before any lookup, which would find the file gone and drop it.
	if st := e.Stats(); st.Entries != 0 || st.Mounts[0].Used != 0 {
		t.Errorf("after the failed store: %d entries, %d bytes used; want none", st.Entries, st.Mounts[0].Used)
	}
	if n, err := e.Lookup(ctx, ns, keys[:1]); err != nil || n != 0 {
		t.Errorf("lookup of the replaced key after the failed store: %d, %v; want 0", n, err)
	}
	if err := e.check(); err != nil {
		t.Error(err)
	}
}

// TestAStoreWhoseFstatFailsAfterItsRenameLeavesNoFile: a store whose fstat
// of its file, just renamed into place, fails (so that the file's identity
// is unknown) fails, and its file is removed, as after a failed close: not
// left on disk unindexed and uncounted. The key stores again afterwards.
func TestAStoreWhoseFstatFailsAfterItsRenameLeavesNoFile(t *testing.T) {
	ctx := context.Background()
	var renamed, failed atomic.Bool
	inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		switch {
		case op == fsys.OpRename && strings.HasSuffix(path, ".kv"):
			renamed.Store(true)
		case op == fsys.OpStat && renamed.Load() && strings.HasPrefix(filepath.Base(path), tmpPrefix) && failed.CompareAndSwap(false, true):
			return fsys.Fault{Err: syscall.EIO} // seal's fstat, after the rename
		}
		return fsys.Fault{}
	})
	e, ns, c, keys, blocks := faultyStore(t, newTestPolicy(1, abi.OrderLayerMajor), inj, "nofstat", 1, 16, 5)
	res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys, Blocks: blocks}))
	if !failed.Load() {
		t.Fatal("no fstat after the rename failed: the test proves nothing")
	}
	if res.Keys[0].Outcome != OutcomeFailed {
		t.Fatalf("the store whose fstat failed after its rename: %+v, want failed", res.Keys[0])
	}
	if files, st := dataFiles(t, e.mounts[0].root), e.Stats(); len(files) != 0 || st.Entries != 0 || st.Mounts[0].Used != 0 {
		t.Fatalf("after the failed store: data files %v, %d entries, %d bytes used; want none", files, st.Entries, st.Mounts[0].Used)
	}
	if n, _ := e.Lookup(ctx, ns, keys); n != 0 {
		t.Fatal("the key of the failed store is found")
	}
	storeAndCheck(t, e, c, keys, blocks)
}

// TestAFileWhoseRemovalFailsAfterAFailedPublishStaysCounted: a store, or
// a move's copy, whose close fails after its rename removes its file
// again; where that removal fails too, or where the file cannot be told
// from another (its fstat after the rename and the stat of its name
// fail), the file stays on disk, and its mount counts its bytes (not its
// reservation given back) until a later eviction there removes it.
func TestAFileWhoseRemovalFailsAfterAFailedPublishStaysCounted(t *testing.T) {
	ctx := context.Background()
	cases := []struct {
		name string
		// fail runs the store or move that fails, the faults armed.
		fail func(t *testing.T, e *Engine, ns NamespaceID, c *testCache, keys [][]byte)
	}{{
		name: "store",
		fail: func(t *testing.T, e *Engine, _ NamespaceID, c *testCache, keys [][]byte) {
			res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys, Blocks: [][]int{{0, 1, 2, 3}}}))
			if res.Keys[0].Outcome != OutcomeFailed {
				t.Fatalf("the store that failed after its rename: %+v, want failed", res.Keys[0])
			}
		},
	}, {
		name: "move",
		fail: func(t *testing.T, e *Engine, ns NamespaceID, _ *testCache, keys [][]byte) {
			if _, err := e.tier.move(ctx, entryOf(e, ns, keys[0]).ID, 1, true); err == nil {
				t.Fatal("the move that failed after its rename succeeded")
			}
		},
	}}
	faults := []struct {
		name string
		// fault is the fault of op on path once the file was renamed
		// into place.
		fault func(op fsys.Op, path string) fsys.Fault
	}{{
		name: "its close and its unlink fail",
		fault: func(op fsys.Op, path string) fsys.Fault {
			switch {
			case op == fsys.OpClose && strings.HasPrefix(filepath.Base(path), tmpPrefix):
				return fsys.Fault{Err: syscall.EIO} // seal's close
			case op == fsys.OpRemove && strings.HasSuffix(path, ".kv"):
				return fsys.Fault{Err: syscall.EACCES}
			}
			return fsys.Fault{}
		},
	}, {
		name: "its fstat and every stat of its name fail",
		fault: func(op fsys.Op, path string) fsys.Fault {
			if op == fsys.OpStat && (strings.HasPrefix(filepath.Base(path), tmpPrefix) || strings.HasSuffix(path, ".kv")) {
				return fsys.Fault{Err: syscall.EIO} // seal's fstat, then the name's
			}
			return fsys.Fault{}
		},
	}}
	for _, tc := range cases {
		for _, fc := range faults {
			t.Run(tc.name+", "+fc.name, func(t *testing.T) {
				var failing, renamed atomic.Bool
				inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
					switch {
					case !failing.Load():
					case op == fsys.OpRename && strings.HasSuffix(path, ".kv"):
						renamed.Store(true)
					case renamed.Load():
						return fc.fault(op, path)
					}
					return fsys.Fault{}
				})
				mounts := []Mount{{Path: t.TempDir()}, {Path: t.TempDir()}}
				e, ns, c := injectedEngine(t, mounts, &demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}, inj, 16)
				keys := testKeys("publeft", 1)
				if tc.name == "move" {
					storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}})
				}
				fileLen := 4096 + smallGeometry(true).KeyBytes()
				failing.Store(true)
				tc.fail(t, e, ns, c, keys)
				failing.Store(false)
				counted := func(when string) {
					t.Helper()
					st := e.Stats()
					for i, m := range mounts {
						if n := int64(len(dataFiles(t, m.Path))); n*fileLen != st.Mounts[i].Used {
							t.Fatalf("%s: mount %d holds %d data files, %d bytes used; want %d", when, i, n, st.Mounts[i].Used, n*fileLen)
						}
					}
				}
				counted("after a failed publish whose removal failed")
				if n := e.Stats().RemoveFailures; n != 1 {
					t.Fatalf("%d failed removals, want 1", n)
				}
				if n, _ := e.Lookup(ctx, ns, keys); tc.name == "store" && n != 0 {
					t.Fatal("a lookup indexed the file of the failed store")
				}
				counted("after a lookup")
				for _, m := range e.mounts {
					e.rm.retryLeft(m) // as the next eviction there does
				}
				counted("after the removal was tried again")
			})
		}
	}
}

// TestAMovedFileIsNeverTakenForItsCopyLeftOnDisk: a move keeps its file's
// header id, so two files of one id are on disk for a while, the source
// and the copy, and one of them stays there where its removal fails
// (index.Leaving's left; where its identity is unknown, the id alone tells it). The
// file left is the only one removed later: the other, live one stays,
// loads, and is indexed again by a lookup that finds it; and the mounts
// count each file once. So too where a move back puts a copy of the same
// id at the path of the file left.
func TestAMovedFileIsNeverTakenForItsCopyLeftOnDisk(t *testing.T) {
	ctx := context.Background()
	cases := []struct {
		name string
		// leave moves keys[0] (stored on mount 0) so that a file of its
		// id stays left on mount 0 where fault fails its removal: the
		// source of a move to mount 1, or the copy of a move back.
		leave func(t *testing.T, e *Engine, ns NamespaceID, keys [][]byte, arm func())
		// fault is the fault of op on path on mount 0, once armed and a
		// file was renamed into place.
		fault func(op fsys.Op, path string) fsys.Fault
	}{{
		name: "the source of a move to a later mount",
		leave: func(t *testing.T, e *Engine, ns NamespaceID, keys [][]byte, arm func()) {
			arm()
			if _, err := e.tier.move(ctx, entryOf(e, ns, keys[0]).ID, 1, true); err != nil {
				t.Fatalf("the move to mount 1: %v", err)
			}
		},
		fault: func(op fsys.Op, path string) fsys.Fault {
			if op == fsys.OpRemove && strings.HasSuffix(path, ".kv") {
				return fsys.Fault{Err: syscall.EACCES}
			}
			return fsys.Fault{}
		},
	}, {
		name: "the copy of unknown identity of a move to an earlier mount",
		leave: func(t *testing.T, e *Engine, ns NamespaceID, keys [][]byte, arm func()) {
			if _, err := e.tier.move(ctx, entryOf(e, ns, keys[0]).ID, 1, true); err != nil {
				t.Fatalf("the move to mount 1: %v", err)
			}
			arm()
			if _, err := e.tier.move(ctx, entryOf(e, ns, keys[0]).ID, 0, false); err == nil {
				t.Fatal("the move back whose copy's identity is unknown succeeded")
			}
		},
		fault: func(op fsys.Op, path string) fsys.Fault {
			if op == fsys.OpStat && (strings.HasPrefix(filepath.Base(path), tmpPrefix) || strings.HasSuffix(path, ".kv")) {
				return fsys.Fault{Err: syscall.EIO} // seal's fstat, the name's, and the removal's
			}
			return fsys.Fault{}
		},
	}}
	thens := []struct {
		name string
		// then acts on the file left at path on mount 0, the faults still
		// armed (disarm ends them), and returns the mount of the key's
		// file.
		then func(t *testing.T, e *Engine, ns NamespaceID, keys [][]byte, path string, disarm func()) int
	}{{
		name: "an eviction tries again",
		then: func(t *testing.T, e *Engine, ns NamespaceID, keys [][]byte, path string, _ func()) int {
			for _, m := range e.mounts {
				e.rm.retryLeft(m)
			}
			if !exists(path) {
				t.Fatal("the file left was removed while its removal fails")
			}
			if n, err := e.Lookup(ctx, ns, keys); n != 1 {
				t.Fatalf("a lookup of the key found %d keys (%v), want 1", n, err)
			}
			return 1
		},
	}, {
		name: "a move puts the key's file at the path left",
		then: func(t *testing.T, e *Engine, ns NamespaceID, keys [][]byte, _ string, disarm func()) int {
			disarm() // the rename replaces the file left, still there
			if _, err := e.tier.move(ctx, entryOf(e, ns, keys[0]).ID, 0, false); err != nil {
				t.Fatalf("the move back onto the file left: %v", err)
			}
			// A lookup that finds the file by name (its entry lost)
			// indexes it: it is not the file left.
			e.rm.drop(ctx, entryOf(e, ns, keys[0]), false, "test: forgotten")
			if n, err := e.Lookup(ctx, ns, keys); n != 1 {
				t.Fatalf("a lookup of the key moved back found %d keys (%v), want 1", n, err)
			}
			return 0
		},
	}}
	for _, tc := range cases {
		for _, th := range thens {
			t.Run(tc.name+", "+th.name, func(t *testing.T) {
				var (
					failing, renamed atomic.Bool
					mu               sync.Mutex
					now              = time.Unix(1_700_000_000, 0)
				)
				mounts := []Mount{{Path: t.TempDir()}, {Path: t.TempDir()}}
				inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
					switch {
					case !failing.Load():
					case op == fsys.OpRename && strings.HasSuffix(path, ".kv"):
						renamed.Store(true)
					case renamed.Load() && strings.HasPrefix(path, mounts[0].Path+string(filepath.Separator)):
						return tc.fault(op, path)
					}
					return fsys.Fault{}
				})
				clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
				e, ns, c := openFaultyDemoting(t, mounts, inj, clock)
				keys := testKeys("movedleft", 1)
				c.fill(rand.New(rand.NewPCG(7, 7)), []int{0, 1, 2, 3})
				want := [][]byte{c.data([]int{0, 1, 2, 3})}
				storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}})
				path := entryOf(e, ns, keys[0]).Path
				tc.leave(t, e, ns, keys, func() { failing.Store(true) })
				counted := func(when string) { t.Helper(); wantFilesCounted(t, e, mounts, when) }
				if !exists(path) || e.Stats().RemoveFailures != 1 {
					t.Fatalf("%d failed removals, the file left there: %v; want 1, true", e.Stats().RemoveFailures, exists(path))
				}
				counted("after the removal of the file left failed")
				wantMount := th.then(t, e, ns, keys, path, func() { failing.Store(false) })
				counted("then")
				failing.Store(false)
				mu.Lock()
				now = now.Add(leftRetryInterval)
				mu.Unlock()
				for _, m := range e.mounts {
					e.rm.retryLeft(m) // as the next eviction there does
				}
				counted("after the removal was tried again")
				if got := keyMount(e, ns, keys[0]); got != wantMount {
					t.Fatalf("the key's file is on mount %d, want %d", got, wantMount)
				}
				for i, m := range mounts {
					w := 0
					if i == wantMount {
						w = 1
					}
					if n := len(dataFiles(t, m.Path)); n != w {
						t.Fatalf("mount %d holds %d data files, want %d", i, n, w)
					}
				}
				loadAndCompare(t, e, c, keys, [][]int{{8, 9, 10, 11}}, want)
				if err := e.check(); err != nil {
					t.Fatal(err)
				}
			})
		}
	}
}

// openFaultyDemoting opens an engine on mounts whose file system faults
// as inj says, on clock, whose policy demotes: a namespace of
// smallGeometry and a cache of 16 blocks in it.
func openFaultyDemoting(t *testing.T, mounts []Mount, inj fsys.Injector, clock func() time.Time) (*Engine, NamespaceID, *testCache) {
	t.Helper()
	g := smallGeometry(true)
	e := openEngine(t, Config{Mounts: mounts, FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}, Now: clock, NoReuse: true,
		Policy: &demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}})
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	return e, ns, newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
}

// wantFilesCounted fails t unless each of mounts counts as used the bytes
// of the files on it.
func wantFilesCounted(t *testing.T, e *Engine, mounts []Mount, when string) {
	t.Helper()
	st := e.Stats()
	for i, m := range mounts {
		if on := bytesOnDisk(t, m.Path); on != st.Mounts[i].Used {
			t.Fatalf("%s: mount %d: %d bytes of files on it, %d used", when, i, on, st.Mounts[i].Used)
		}
	}
}

// failsWithEIO is a fault of a temporary file: op on it fails with EIO.
func failsWithEIO(failing fsys.Op) func(op fsys.Op, tmp string) fsys.Fault {
	return func(op fsys.Op, _ string) fsys.Fault {
		if op == failing {
			return fsys.Fault{Err: syscall.EIO}
		}
		return fsys.Fault{}
	}
}

// TestATemporaryFileWhoseRemovalFailsStaysCounted: a store or a move's
// copy that fails before its rename (or a store's first try, before its
// retry after an ENOSPC) removes its temporary file; where that removal
// fails, the file stays on disk, so its mount goes on counting it, as
// used, until an eviction there removes it: the bytes on disk are the
// bytes the mount counts.
func TestATemporaryFileWhoseRemovalFailsStaysCounted(t *testing.T) {
	ctx := context.Background()
	cases := []struct {
		name string
		// fault is the fault of op on the temporary file tmp while armed
		// (its removal fails whatever it returns).
		fault func(op fsys.Op, tmp string) fsys.Fault
		// fail runs the store or move, the faults armed.
		fail func(t *testing.T, e *Engine, ns NamespaceID, c *testCache, keys [][]byte)
	}{{
		name:  "a store whose write fails",
		fault: failsWithEIO(fsys.OpWrite),
		fail: func(t *testing.T, e *Engine, _ NamespaceID, c *testCache, keys [][]byte) {
			res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys, Blocks: [][]int{{0, 1, 2, 3}}}))
			wantOutcomes(t, "the store whose write failed", res, OutcomeFailed)
		},
	}, {
		name:  "a store whose allocation fails",
		fault: failsWithEIO(fsys.OpAllocate),
		fail: func(t *testing.T, e *Engine, _ NamespaceID, c *testCache, keys [][]byte) {
			res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys, Blocks: [][]int{{0, 1, 2, 3}}}))
			wantOutcomes(t, "the store whose allocation failed", res, OutcomeFailed)
		},
	}, {
		name: "a store retried after an ENOSPC",
		fault: func() func(op fsys.Op, _ string) fsys.Fault {
			var once atomic.Bool
			return func(op fsys.Op, _ string) fsys.Fault {
				if op == fsys.OpWrite && once.CompareAndSwap(false, true) {
					return fsys.Fault{Err: syscall.ENOSPC}
				}
				return fsys.Fault{}
			}
		}(),
		fail: func(t *testing.T, e *Engine, _ NamespaceID, c *testCache, keys [][]byte) {
			storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}})
		},
	}, {
		name:  "a move whose write fails",
		fault: failsWithEIO(fsys.OpWrite),
		fail: func(t *testing.T, e *Engine, ns NamespaceID, _ *testCache, keys [][]byte) {
			if _, err := e.tier.move(ctx, entryOf(e, ns, keys[0]).ID, 1, true); err == nil {
				t.Fatal("the move whose write failed succeeded")
			}
		},
	}}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var (
				failing atomic.Bool
				mu      sync.Mutex
				stuck   []string
				now     = time.Unix(1_700_000_000, 0)
			)
			inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
				if !failing.Load() || !strings.HasPrefix(filepath.Base(path), tmpPrefix) {
					return fsys.Fault{}
				}
				if op == fsys.OpRemove {
					mu.Lock()
					defer mu.Unlock()
					stuck = append(stuck, path)
					return fsys.Fault{Err: syscall.EACCES}
				}
				return tc.fault(op, path)
			})
			clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
			mounts := []Mount{{Path: t.TempDir()}, {Path: t.TempDir()}}
			e, ns, c := openFaultyDemoting(t, mounts, inj, clock)
			keys := testKeys("tmpleft", 1)
			storeAndCheck(t, e, c, testKeys("kept", 1), [][]int{{4, 5, 6, 7}})
			if strings.HasPrefix(tc.name, "a move") {
				storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}})
			}
			counted := func(when string) { t.Helper(); wantFilesCounted(t, e, mounts, when) }
			failing.Store(true)
			tc.fail(t, e, ns, c, keys)
			failing.Store(false)
			mu.Lock()
			left := slices.Compact(slices.Sorted(slices.Values(stuck)))
			mu.Unlock()
			if len(left) == 0 {
				t.Fatal("no temporary file's removal failed: the test proves nothing")
			}
			counted("after a temporary file's removal failed")
			if n := e.Stats().RemoveFailures; n != uint64(len(left)) {
				t.Fatalf("%d failed removals counted, want %d: one per temporary file left", n, len(left))
			}
			mu.Lock()
			now = now.Add(leftRetryInterval)
			mu.Unlock()
			for _, m := range e.mounts {
				e.rm.retryLeft(m) // as the next eviction there does
			}
			for _, p := range left {
				if exists(p) {
					t.Fatalf("temporary file %s is still there after its removal was tried again", p)
				}
			}
			counted("after the removal was tried again")
			if err := e.check(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestAnIOErrorReadingAHeaderIsNoCorruption: a read of a file's header
// that fails with EIO (a transient fault of the device or of a network
// mount), in a load or in the rebuild at Open, neither removes the file nor
// counts it corrupt: the load fails its key, the rebuild skips the file,
// and the next load of the key reads it byte for byte.
func TestAnIOErrorReadingAHeaderIsNoCorruption(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	for _, at := range []string{"load", "rebuild"} {
		t.Run(at, func(t *testing.T) {
			dir := t.TempDir()
			var armed atomic.Bool
			var target atomic.Value // string
			inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
				if p, _ := target.Load().(string); op == fsys.OpRead && path == p && armed.CompareAndSwap(true, false) {
					return fsys.Fault{Err: syscall.EIO}
				}
				return fsys.Fault{}
			})
			cfg := Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, abi.OrderLayerMajor), FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}}
			e := openEngine(t, cfg)
			ns, _ := e.Declare(ctx, g)
			c := newTestCache(t, e, ns, g, 32, layoutPlaneFirst)
			r := rand.New(rand.NewPCG(5, 5))
			keys := testKeys("eio", 1)
			blocks := [][]int{{0, 1, 2, 3}}
			c.fill(r, blocks[0])
			storeAndCheck(t, e, c, keys, blocks)
			want := [][]byte{c.data(blocks[0])}
			_, paths, _, _ := e.nm.names(ctx, e.tables.get(ns), keys)
			target.Store(paths[0])
			armed.Store(true)
			if at == "load" {
				res := wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: keys, Blocks: [][]int{{8, 9, 10, 11}}}))
				if k := res.Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, syscall.EIO) {
					t.Fatalf("load with EIO: %v %v, want failed with EIO", k.Outcome, k.Err)
				}
			} else {
				e.Close(ctx)
				e = openEngine(t, cfg)
				if armed.Load() {
					t.Fatal("the rebuild did not read the file")
				}
				ns, _ = e.Declare(ctx, g)
				c = newTestCache(t, e, ns, g, 32, layoutPlaneFirst)
			}
			if _, err := os.Stat(paths[0]); err != nil {
				t.Fatalf("the file that could not be read once was removed: %v", err)
			}
			if st := e.Stats(); st.Corrupt != 0 {
				t.Fatalf("an I/O error counted as %d corrupt files", st.Corrupt)
			}
			loadAndCompare(t, e, c, keys, [][]int{{12, 13, 14, 15}}, want)
		})
	}
}
