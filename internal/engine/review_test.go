//go:build invariants

package engine

import (
	"context"
	"errors"
	"fmt"
	"github.com/kvhost/kvhost/internal/testwait"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
)

// TestGeometryLimits: geometries whose per-request metadata would be out of
// proportion to their bytes are refused, naming the field: tiny blocks, too
// many segments per key, and (at Declare) too many segments per file.
func TestGeometryLimits(t *testing.T) {
	for _, tc := range []struct {
		name, field string
		g           Geometry
	}{
		// The review's example: 4096 × 2 × 4096 one-byte blocks per key.
		{"one-byte blocks", "BlockBytes", Geometry{Model: "m", Layers: 4096, KVHeads: 1, HeadSize: 1, DtypeSize: 1, TokensPerBlock: 1, TokensPerKey: 4096, TPSize: 1}},
		{"256-byte blocks", "BlockBytes", Geometry{Model: "m", Layers: 2, KVHeads: 1, HeadSize: 64, DtypeSize: 2, TokensPerBlock: 2, TokensPerKey: 8, TPSize: 1}},
		{"segments per key", "SegmentsPerKey", Geometry{Model: "m", Layers: 512, KVHeads: 1, HeadSize: 256, DtypeSize: 2, TokensPerBlock: 1, TokensPerKey: 128, TPSize: 1}},
	} {
		err := tc.g.Validate()
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), " "+tc.field+" ") {
			t.Errorf("%s: %v, want ErrInvalid naming %s", tc.name, err, tc.field)
		}
	}
	// At the limits: accepted.
	for _, g := range []Geometry{
		{Model: "m", Layers: 2, KVHeads: 1, HeadSize: 128, DtypeSize: 2, TokensPerBlock: 2, TokensPerKey: 8, TPSize: 1},                // 512-byte blocks
		{Model: "m", Layers: 512, KVHeads: 1, HeadSize: 256, DtypeSize: 2, TokensPerBlock: 1, TokensPerKey: 64, TPSize: 1},             // 65536 segments
		{Model: "m", Layers: 80, KVHeads: 8, HeadSize: 128, DtypeSize: 2, TokensPerBlock: 16, TokensPerKey: 1024, TPSize: 1},           // Llama-70B, 1024-token keys
		{Model: "m", Layers: 61, KVHeads: 1, HeadSize: 576, DtypeSize: 2, MLA: true, TokensPerBlock: 64, TokensPerKey: 256, TPSize: 1}, // DeepSeek MLA
	} {
		if err := g.Validate(); err != nil {
			t.Errorf("%+v: %v", g, err)
		}
	}
	// A layout of 32 keys per file of 65536 segments is 2^21 segments per
	// file: Declare refuses it, naming KeysPerFile.
	ctx := context.Background()
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(32, abi.OrderLayerMajor)})
	g := Geometry{Model: "m", Layers: 512, KVHeads: 1, HeadSize: 256, DtypeSize: 2, TokensPerBlock: 1, TokensPerKey: 64, TPSize: 1}
	if _, err := e.Declare(ctx, g); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "KeysPerFile 32") {
		t.Fatalf("Declare of 2^21 segments per file: %v", err)
	}
	g.TokensPerKey = 2 // 2048 segments per key, 65536 per file
	if _, err := e.Declare(ctx, g); err != nil {
		t.Fatalf("Declare of 2^16 segments per file: %v", err)
	}
}

// failFirstWrite blocks the first write while armed until released, then
// fails it with EIO; later writes run.
type failFirstWrite struct {
	armed   atomic.Bool
	reached chan struct{}
	release chan struct{}
	fail    bool
	once    sync.Once
}

func (f *failFirstWrite) Inject(op fsys.Op, _ string) fsys.Fault {
	if op != fsys.OpWrite || !f.armed.Load() {
		return fsys.Fault{}
	}
	first := false
	f.once.Do(func() { first = true })
	if !first {
		return fsys.Fault{}
	}
	close(f.reached)
	<-f.release
	if f.fail {
		return fsys.Fault{Err: syscall.EIO}
	}
	return fsys.Fault{}
}

// settle waits until e's stores have waited for a path held by another job
// n times in all (a store that waits for the writer of its file's path has
// reached that point), or fails the test after 10 s: the tests below then
// catch a store that reports another job's file before that job is done.
func settle(t *testing.T, e *Engine, n int64) {
	t.Helper()
	testwait.Until(t, fmt.Sprintf("%d stores to wait for the path", n), testwait.Hang, func() bool { return e.st.pathWaits.Load() >= n })
}

// TestStoreWaitsForWriter: a store whose file's path another job is writing
// waits for it and then reports only what is stored: if the writer fails,
// the key is stored by the waiting job; if the writer's file holds other
// keys under the same name, the waiting job's other keys are stored in a
// file of their own. A key repeated in a request gets the outcome of its
// first occurrence, failure included.
func TestStoreWaitsForWriter(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	r := rand.New(rand.NewPCG(21, 21))

	t.Run("writer fails", func(t *testing.T) {
		inj := &failFirstWrite{reached: make(chan struct{}), release: make(chan struct{}), fail: true}
		e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, abi.OrderLayerMajor), FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}})
		ns, _ := e.Declare(ctx, g)
		c := newTestCache(t, e, ns, g, 32, layoutPlaneFirst)
		c.fill(r, []int{0, 1, 2, 3, 4, 5, 6, 7})
		key := testKeys("w", 1)
		inj.armed.Store(true)
		ja, err := e.Store(ctx, StoreRequest{Cache: c.id, Keys: key, Blocks: [][]int{{0, 1, 2, 3}}})
		if err != nil {
			t.Fatal(err)
		}
		<-inj.reached
		jb, err := e.Store(ctx, StoreRequest{Cache: c.id, Keys: key, Blocks: [][]int{{4, 5, 6, 7}}})
		if err != nil {
			t.Fatal(err)
		}
		settle(t, e, 1)
		close(inj.release)
		if k := waitJob(t, ja, nil).Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, syscall.EIO) {
			t.Fatalf("writer: %v %v, want failed with EIO", k.Outcome, k.Err)
		}
		if k := waitJob(t, jb, nil).Keys[0]; k.Outcome != OutcomeStored {
			t.Fatalf("second store while the writer failed: %v %v, want stored", k.Outcome, k.Err)
		}
		if n, _ := e.Lookup(ctx, ns, key); n != 1 {
			t.Fatal("key reported stored is not stored")
		}
		loadAndCompare(t, e, c, key, [][]int{{8, 9, 10, 11}}, [][]byte{c.data([]int{4, 5, 6, 7})})
	})

	t.Run("same name, other keys", func(t *testing.T) {
		inj := &failFirstWrite{reached: make(chan struct{}), release: make(chan struct{})}
		e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(2, abi.OrderLayerMajor), FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}})
		ns, _ := e.Declare(ctx, g)
		c := newTestCache(t, e, ns, g, 64, layoutPlaneFirst)
		blocks := blockLists(r, 4, 4, 0)
		for _, b := range blocks {
			c.fill(r, b)
		}
		k := testKeys("grp", 3)
		inj.armed.Store(true)
		ja, err := e.Store(ctx, StoreRequest{Cache: c.id, Keys: [][]byte{k[0], k[1]}, Blocks: blocks[:2]})
		if err != nil {
			t.Fatal(err)
		}
		<-inj.reached
		// Grouped as [k0, k2], named after k0: the path ja is writing.
		jb, err := e.Store(ctx, StoreRequest{Cache: c.id, Keys: [][]byte{k[0], k[2]}, Blocks: [][]int{blocks[2], blocks[3]}})
		if err != nil {
			t.Fatal(err)
		}
		settle(t, e, 1)
		close(inj.release)
		wantOutcomes(t, "writer", waitJob(t, ja, nil), OutcomeStored)
		res := waitJob(t, jb, nil)
		if o := res.Keys[0].Outcome; o != OutcomePresent {
			t.Fatalf("k0: %v %v, want present", o, res.Keys[0].Err)
		}
		if o := res.Keys[1].Outcome; o != OutcomeStored {
			t.Fatalf("k2: %v %v, want stored", o, res.Keys[1].Err)
		}
		if n, _ := e.Lookup(ctx, ns, k[2:]); n != 1 {
			t.Fatal("k2 reported stored is not stored")
		}
		into := [][]int{{40, 41, 42, 43}, {44, 45, 46, 47}, {48, 49, 50, 51}}
		loadAndCompare(t, e, c, k, into, [][]byte{c.data(blocks[0]), c.data(blocks[1]), c.data(blocks[3])})
	})

	t.Run("repeated key", func(t *testing.T) {
		// Temporary names do not hold the key: fail the allocation of
		// files in the directory of the bad key's name.
		var failDir atomic.Value // string
		inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
			if d, _ := failDir.Load().(string); op == fsys.OpAllocate && filepath.Dir(path) == d {
				return fsys.Fault{Err: syscall.EIO}
			}
			return fsys.Fault{}
		})
		e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, abi.OrderLayerMajor), FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}})
		ns, _ := e.Declare(ctx, g)
		_, paths, _, err := e.nm.names(ctx, e.tables.get(ns), [][]byte{[]byte("bad")})
		if err != nil {
			t.Fatal(err)
		}
		failDir.Store(filepath.Dir(paths[0]))
		c := newTestCache(t, e, ns, g, 32, layoutPlaneFirst)
		bad := []byte("bad")
		good := []byte("good")
		_, gp, _, _ := e.nm.names(ctx, e.tables.get(ns), [][]byte{good})
		if filepath.Dir(gp[0]) == filepath.Dir(paths[0]) {
			t.Fatal("test keys share a directory")
		}
		res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: [][]byte{bad, good, bad, good}, Blocks: [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}}))
		var got []Outcome
		for _, k := range res.Keys {
			got = append(got, k.Outcome)
		}
		if want := []Outcome{OutcomeFailed, OutcomeStored, OutcomeFailed, OutcomeStored}; !slices.Equal(got, want) {
			t.Fatalf("outcomes %v, want %v", got, want)
		}
		if !errors.Is(res.Keys[2].Err, syscall.EIO) {
			t.Fatalf("repeated failed key: %v", res.Keys[2].Err)
		}
	})
}

// nestedPolicy names files two directories deep: x/y/<name>.
type nestedPolicy struct{ *testPolicy }

func (p nestedPolicy) Name(ctx context.Context, recs []abi.NameRecord) error {
	if err := p.testPolicy.Name(ctx, recs); err != nil {
		return err
	}
	for i := range recs {
		r := &recs[i]
		name := "x/y/" + filepath.Base(string(r.Path()))
		r.PathLen = uint32(copy(r.PathBuf[:], name))
	}
	return nil
}

// syncRecorder records the directories fsynced and can fail the first
// fsync of one.
type syncRecorder struct {
	mu     sync.Mutex
	synced []string
	fail   string
}

func (s *syncRecorder) Inject(op fsys.Op, path string) fsys.Fault {
	if op != fsys.OpSyncDir {
		return fsys.Fault{}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if path == s.fail {
		s.fail = ""
		return fsys.Fault{Err: syscall.EIO}
	}
	s.synced = append(s.synced, path)
	return fsys.Fault{}
}

func (s *syncRecorder) take() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := s.synced
	s.synced = nil
	slices.Sort(out)
	return slices.Compact(out)
}

// TestFsyncNewDirectories: with Fsync, every directory a store creates is
// fsynced with its parent (the mount root too, when Open creates it), a
// failed fsync fails the store and is tried again by the next, and
// without Fsync nothing is (but the model book a declaration makes,
// TestADeclarationInTheModelBookSurvivesAPowerLoss).
func TestFsyncNewDirectories(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	for _, fsync := range []bool{true, false} {
		t.Run(fmt.Sprintf("fsync=%v", fsync), func(t *testing.T) {
			base := t.TempDir()
			root := filepath.Join(base, "root")
			rec := &syncRecorder{fail: filepath.Join(root, "x")}
			e := openEngine(t, Config{Mounts: []Mount{{Path: root}}, Policy: nestedPolicy{newTestPolicy(1, abi.OrderLayerMajor)}, Fsync: fsync, FS: &fsys.Faulty{FS: fsys.OS{}, Inj: rec}})
			if got := rec.take(); fsync && !slices.Equal(got, []string{base, root}) {
				t.Fatalf("Open created the root: fsynced %v, want %v", got, []string{base, root})
			}
			ns, _ := e.Declare(ctx, g)
			rec.take() // the model book's root, synced whatever Fsync says
			c := newTestCache(t, e, ns, g, 32, layoutPlaneFirst)
			keys := testKeys("dir", 2)
			res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys[:1], Blocks: [][]int{{0, 1, 2, 3}}}))
			x, y := filepath.Join(root, "x"), filepath.Join(root, "x", "y")
			if !fsync {
				wantOutcomes(t, "store", res, OutcomeStored)
				if got := rec.take(); len(got) != 0 {
					t.Fatalf("without Fsync: fsynced %v", got)
				}
				return
			}
			if k := res.Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, syscall.EIO) {
				t.Fatalf("store with a failing directory fsync: %v %v", k.Outcome, k.Err)
			}
			rec.take()
			storeAndCheck(t, e, c, keys[:1], [][]int{{0, 1, 2, 3}})
			if got, want := rec.take(), []string{root, x, y}; !slices.Equal(got, want) {
				t.Fatalf("fsynced %v, want %v (the new directories, their parents, the file's directory)", got, want)
			}
			// The directories exist now: only the file's directory.
			storeAndCheck(t, e, c, keys[1:], [][]int{{4, 5, 6, 7}})
			if got, want := rec.take(), []string{y}; !slices.Equal(got, want) {
				t.Fatalf("second store: fsynced %v, want %v", got, want)
			}
		})
	}
}

// opGate holds the first operation op on one path until a signal.
type opGate struct {
	op      fsys.Op
	path    atomic.Value // string
	reached chan struct{}
	proceed chan struct{}
	once    sync.Once
}

func (g *opGate) Inject(op fsys.Op, path string) fsys.Fault {
	if p, _ := g.path.Load().(string); op == g.op && path == p {
		first := false
		g.once.Do(func() { first = true })
		if first {
			close(g.reached)
			<-g.proceed
		}
	}
	return fsys.Fault{}
}

// race runs op in the background until it reaches the gate at path, runs
// meanwhile while op waits there, then lets op go on (even if meanwhile
// fails) and waits for it to end.
func (g *opGate) race(path string, op, meanwhile func()) {
	g.path.Store(path)
	done := make(chan struct{})
	go func() {
		defer close(done)
		op()
	}()
	<-g.reached
	func() {
		defer close(g.proceed)
		meanwhile()
	}()
	<-done
}

// gatedKey is an engine on one mount whose file system holds the first
// operation of a kind on a path (gate), and one key stored in it.
type gatedKey struct {
	e    *Engine
	ns   NamespaceID
	c    *testCache
	keys [][]byte
	path string // the key's file
	gate *opGate
}

// storeGatedKey opens a gatedKey's engine, whose gate holds op once armed
// (opGate.race), and stores its key.
func storeGatedKey(t *testing.T, op fsys.Op) *gatedKey {
	t.Helper()
	ctx := context.Background()
	g := smallGeometry(true)
	k := &gatedKey{gate: &opGate{op: op, reached: make(chan struct{}), proceed: make(chan struct{})}}
	k.e = openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, abi.OrderLayerMajor), FS: &fsys.Faulty{FS: fsys.OS{}, Inj: k.gate}})
	k.ns, _ = k.e.Declare(ctx, g)
	k.c = newTestCache(t, k.e, k.ns, g, 32, layoutPlaneFirst)
	k.keys = testKeys("raced", 1)
	storeAndCheck(t, k.e, k.c, k.keys, [][]int{{0, 1, 2, 3}})
	_, paths, _, _ := k.e.nm.names(ctx, k.e.tables.get(k.ns), k.keys)
	k.path = paths[0]
	return k
}

// TestRemoveKeepsNewerFile: a delete removing a key's file while a store
// publishes the key again never removes the new file: the store waits for
// the removal, and the key stays stored and loads the new bytes.
func TestRemoveKeepsNewerFile(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	gate := &opGate{op: fsys.OpRemove, reached: make(chan struct{}), proceed: make(chan struct{})}
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, abi.OrderLayerMajor), FS: &fsys.Faulty{FS: fsys.OS{}, Inj: gate}})
	ns, _ := e.Declare(ctx, g)
	c := newTestCache(t, e, ns, g, 32, layoutPlaneFirst)
	r := rand.New(rand.NewPCG(4, 4))
	c.fill(r, []int{0, 1, 2, 3, 4, 5, 6, 7})
	key := testKeys("del", 1)
	storeAndCheck(t, e, c, key, [][]int{{0, 1, 2, 3}})
	_, paths, _, _ := e.nm.names(ctx, e.tables.get(ns), key)
	gate.path.Store(paths[0])

	stored := make(chan Result, 1)
	go func() {
		<-gate.reached // the delete has unindexed the key and is removing its file
		j, err := e.Store(ctx, StoreRequest{Cache: c.id, Keys: key, Blocks: [][]int{{4, 5, 6, 7}}})
		if err != nil {
			stored <- Result{Keys: []KeyResult{{Outcome: OutcomeFailed, Err: err}}}
			return
		}
		func() {
			defer close(gate.proceed) // the delete goes on even if settle fails
			settle(t, e, 1)
		}()
		res, _ := j.Wait(ctx)
		stored <- res
	}()
	if n, err := e.Delete(ctx, ns, key); n != 1 || err != nil {
		t.Fatalf("Delete: %d %v", n, err)
	}
	res := <-stored
	wantOutcomes(t, "store during the delete", res, OutcomeStored)
	if _, err := os.Stat(paths[0]); err != nil {
		t.Fatalf("the new file was removed: %v", err)
	}
	if n, _ := e.Lookup(ctx, ns, key); n != 1 {
		t.Fatal("key stored after the delete is a miss")
	}
	loadAndCompare(t, e, c, key, [][]int{{8, 9, 10, 11}}, [][]byte{c.data([]int{4, 5, 6, 7})})
}

// TestLoadDestinationChanged: a load naming one block twice is refused, and
// a load whose destination blocks change under it (here: two keys read into
// the same blocks, bypassing that check) fails the key without declaring
// the file corrupt: the file is kept and loads afterwards.
func TestLoadDestinationChanged(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(2, abi.OrderLayerMajor)})
	ns, _ := e.Declare(ctx, g)
	c := newTestCache(t, e, ns, g, 32, layoutPlaneFirst)
	r := rand.New(rand.NewPCG(8, 8))
	keys := testKeys("dst", 2)
	blocks := [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}}
	for _, b := range blocks {
		c.fill(r, b)
	}
	want := [][]byte{c.data(blocks[0]), c.data(blocks[1])}
	storeAndCheck(t, e, c, keys, blocks)
	_, paths, _, _ := e.nm.names(ctx, e.tables.get(ns), keys[:1])

	same := [][]int{{8, 9, 10, 11}, {8, 9, 10, 11}}
	for _, bl := range [][][]int{same, {{8, 9, 10, 11}, {12, 13, 9, 14}}, {{8, 9, 10, 8}, {12, 13, 14, 15}}} {
		j, err := e.Load(ctx, LoadRequest{Cache: c.id, Keys: keys, Blocks: bl})
		if err == nil {
			waitJob(t, j, nil) // before the cache is unmapped
		}
		if !errors.Is(err, ErrInvalid) {
			t.Fatalf("load into blocks %v: %v, want ErrInvalid", bl, err)
		}
	}

	// Past the check: the second key's bytes land on the first key's
	// blocks before its checksum is computed from them.
	cc := e.tables.cache(c.id)
	j, jctx, err := e.newJob(ctx, "load", 2)
	if err != nil {
		t.Fatal(err)
	}
	go e.runLoad(jctx, j, cc, keys, same, LayerRange{}, cc.loads.take())
	res := waitJob(t, j, nil)
	failed := 0
	for i, k := range res.Keys {
		if k.Outcome == OutcomeFailed {
			failed++
			if errors.Is(k.Err, ErrCorrupt) || !strings.Contains(k.Err.Error(), "changed during the load") {
				t.Fatalf("key %d: %v, want an error saying the destination changed", i, k.Err)
			}
		}
	}
	if failed == 0 {
		t.Fatal("no key failed: the test did not change a destination under the load")
	}
	if st := e.Stats(); st.Corrupt != 0 || st.Entries != 1 {
		t.Fatalf("a good file was taken for corrupt: %+v", st)
	}
	if _, err := os.Stat(paths[0]); err != nil {
		t.Fatalf("good file removed: %v", err)
	}
	loadAndCompare(t, e, c, keys, [][]int{{16, 17, 18, 19}, {20, 21, 22, 23}}, want)
}

// replaceOnRead renames from over to on the first read of to while armed.
type replaceOnRead struct {
	armed    atomic.Bool
	from, to string
	once     sync.Once
}

func (r *replaceOnRead) Inject(op fsys.Op, path string) fsys.Fault {
	if op == fsys.OpRead && path == r.to && r.armed.Load() {
		r.once.Do(func() { os.Rename(r.from, r.to) })
	}
	return fsys.Fault{}
}

// TestReadEntryOpenFile: the entry read from a file's header carries that
// file's inode and size, even if the name is replaced while it is read.
func TestReadEntryOpenFile(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	inj := &replaceOnRead{}
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, abi.OrderLayerMajor), FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}})
	ns, _ := e.Declare(ctx, g)
	c := newTestCache(t, e, ns, g, 32, layoutPlaneFirst)
	keys := testKeys("fstat", 2)
	storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}})
	_, paths, _, _ := e.nm.names(ctx, e.tables.get(ns), keys)
	fi, err := os.Stat(paths[0])
	if err != nil {
		t.Fatal(err)
	}
	inj.from, inj.to = paths[1], paths[0]
	inj.armed.Store(true)
	en, err := e.hd.readEntry(0, paths[0])
	if err != nil {
		t.Fatal(err)
	}
	if en.Keys[0] != string(keys[0]) {
		t.Fatalf("header of %q, want %q", en.Keys[0], keys[0])
	}
	want, err := fsys.IdentityOf(fi)
	if err != nil {
		t.Fatal(err)
	}
	if en.Ident.Ino != want.Ino || en.Size != fi.Size() {
		t.Fatalf("entry of key 0 has inode %d size %d, the file read has inode %d size %d", en.Ident.Ino, en.Size, want.Ino, fi.Size())
	}
}

// TestMaxNamespaces: Declare refuses new namespaces beyond the limit
// (default 1024) with ErrLimit and an error naming it, not ErrInvalid
// (the geometry is valid); declared ones stay usable.
func TestMaxNamespaces(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct{ cfg, limit int }{{0, 1024}, {3, 3}} {
		cfg := Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, abi.OrderLayerMajor)}
		setMaxNamespaces(&cfg, tc.cfg)
		e := openEngine(t, cfg)
		g := smallGeometry(true)
		for i := range tc.limit {
			g.Model = fmt.Sprintf("m-%d", i)
			if _, err := e.Declare(ctx, g); err != nil {
				t.Fatalf("limit %d: namespace %d: %v", tc.limit, i, err)
			}
		}
		g.Model = "one-too-many"
		if _, err := e.Declare(ctx, g); !errors.Is(err, ErrLimit) || errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "MaxNamespaces") {
			t.Fatalf("limit %d: namespace beyond: %v", tc.limit, err)
		}
		g.Model = "m-0"
		if _, err := e.Declare(ctx, g); err != nil {
			t.Fatalf("limit %d: declaring again: %v", tc.limit, err)
		}
	}
}

func setMaxNamespaces(cfg *Config, n int) { cfg.MaxNamespaces = n }

func TestKeysPerFileIsTheLayoutThePolicyChose(t *testing.T) {
	ctx := context.Background()
	for _, want := range []int{1, 3} {
		e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(uint32(want), abi.OrderBlockMajor)})
		ns, err := e.Declare(ctx, smallGeometry(true))
		if err != nil {
			t.Fatal(err)
		}
		if got, err := e.KeysPerFile(ns); got != want || err != nil {
			t.Errorf("KeysPerFile of a namespace whose policy packs %d: %d, %v", want, got, err)
		}
		if _, err := e.KeysPerFile(ns + 1); !errors.Is(err, ErrUnknownNamespace) {
			t.Errorf("KeysPerFile of a namespace never declared: %v, want ErrUnknownNamespace", err)
		}
	}
}

// TestDeleteCount: Delete counts the requested keys that were stored and
// are now removed — not the other keys of a removed file, not a repeated
// key twice, not an unknown key — and the other keys of the file go too.
func TestDeleteCount(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(2, abi.OrderLayerMajor)})
	ns, _ := e.Declare(ctx, g)
	c := newTestCache(t, e, ns, g, 32, layoutPlaneFirst)
	keys := testKeys("dc", 4)
	storeAndCheck(t, e, c, keys, blockLists(rand.New(rand.NewPCG(1, 1)), 4, 4, 0))
	if n, err := e.Delete(ctx, ns, [][]byte{keys[0], keys[0], []byte("unknown")}); n != 1 || err != nil {
		t.Fatalf("Delete of one key of a two-key file: %d %v, want 1", n, err)
	}
	if n, _ := e.Lookup(ctx, ns, keys[1:2]); n != 0 {
		t.Fatal("the file's other key survived")
	}
	if n, err := e.Delete(ctx, ns, [][]byte{keys[0], keys[2], keys[3]}); n != 2 || err != nil {
		t.Fatalf("Delete of both keys of a file and a deleted key: %d %v, want 2", n, err)
	}
	if files := dataFiles(t, e.mounts[0].root); len(files) != 0 {
		t.Fatalf("files left: %v", files)
	}
}

// TestAdoptLeavesAPathAJobHoldsToItsHolder: a file found on disk (by a
// lookup's discovery, or a load that found its file replaced) is not
// indexed at a path a store or removal of this engine holds: the store
// decided what it replaces when it claimed the path, and indexing another
// file there meanwhile would have it write over a file holding keys it
// never looked at. Once the path is free the file is adopted.
func TestAdoptLeavesAPathAJobHoldsToItsHolder(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, abi.OrderLayerMajor)})
	ns, _ := e.Declare(ctx, g)
	c := newTestCache(t, e, ns, g, 32, layoutPlaneFirst)
	keys := testKeys("held", 1)
	storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}})
	_, paths, _, _ := e.nm.names(ctx, e.tables.get(ns), keys)
	path := paths[0]

	// The index loses the file (as when another file holding its key was
	// dropped), while the file stays on disk.
	claimed := e.ix.ForgetAndClaim(path) // a store claims the path
	if !claimed {
		t.Fatal("the path was held before the test claimed it")
	}
	found, err := e.hd.readEntry(0, path)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := e.shared.adopt(ctx, found, nil); got != nil || !errors.Is(err, errPathHeld) {
		t.Fatalf("adopt at a path a store held: %v, %v; want nil, errPathHeld", got, err)
	}
	indexed := e.ix.Files().ByPath(path)
	if indexed != nil {
		t.Fatalf("the index holds %s at a held path", indexed.Path)
	}
	if en := e.shared.discover(ctx, e.tables.get(ns), keys[0]); en != nil {
		t.Fatal("discover indexed the file at a held path")
	}

	e.rm.release(path)
	if en := e.shared.discover(ctx, e.tables.get(ns), keys[0]); en == nil || e.ix.Files().Gone(en) {
		t.Fatal("discover did not index the file once the path was free")
	}
	if n, err := e.Lookup(ctx, ns, keys); err != nil || n != 1 {
		t.Fatalf("lookup after the path was released: %d, %v; want 1", n, err)
	}
}

// TestALookupNeverIndexesAFileThisEngineRemovedOrReplacedWhileItReadIt: a
// lookup that finds a key's file on disk, unindexed, reads its header;
// if meanwhile a job of this engine removes that file (a delete or an
// eviction, which another lookup let index it first) or replaces it (a
// store of the key), the lookup does not index what it read: an entry of
// a file gone, counted, or in place of the file there now.
func TestALookupNeverIndexesAFileThisEngineRemovedOrReplacedWhileItReadIt(t *testing.T) {
	ctx := context.Background()
	// The other lookup indexes the file first, so that Delete finds it.
	cases := removedOrReplaced(func(t *testing.T, k *gatedKey) {
		if n, err := k.e.Lookup(ctx, k.ns, k.keys); n != 1 || err != nil {
			t.Fatalf("the other lookup: %d, %v; want 1", n, err)
		}
	})
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			k := storeGatedKey(t, fsys.OpClose)
			// The index loses the file (as when another node published it),
			// while the file stays on disk.
			k.e.ix.Forget(k.e.ix.Files().ByPath(k.path))

			k.gate.race(k.path, func() { // held after its header read, at its close
				k.e.Lookup(ctx, k.ns, k.keys)
			}, func() { tc.meanwhile(t, k) })
			indexHoldsTheFileAt(t, k.e, k.path)
		})
	}
}

// removedOrReplaced is what a gatedKey's engine does to the key's file
// while a discovery has read it: delete it, once index has indexed it, or
// store the key again.
func removedOrReplaced(index func(t *testing.T, k *gatedKey)) []struct {
	name      string
	meanwhile func(t *testing.T, k *gatedKey)
} {
	return []struct {
		name      string
		meanwhile func(t *testing.T, k *gatedKey)
	}{{
		name: "deleted",
		meanwhile: func(t *testing.T, k *gatedKey) {
			index(t, k)
			if n, err := k.e.Delete(context.Background(), k.ns, k.keys); n != 1 || err != nil {
				t.Fatalf("Delete: %d, %v; want 1", n, err)
			}
		},
	}, {
		name: "replaced by a store",
		meanwhile: func(t *testing.T, k *gatedKey) {
			storeAndCheck(t, k.e, k.c, k.keys, [][]int{{4, 5, 6, 7}})
		},
	}}
}

// indexHoldsTheFileAt fails t unless the index holds the file at path,
// and only it (none where none is there), and the engine's parts agree.
func indexHoldsTheFileAt(t *testing.T, e *Engine, path string) {
	t.Helper()
	en := e.ix.Files().ByPath(path)
	fi, err := os.Stat(path)
	switch {
	case err != nil && en != nil:
		t.Fatalf("the index holds %s, whose file is gone (%v)", path, err)
	case err == nil && en == nil:
		t.Fatalf("the index lost the file at %s", path)
	case err == nil:
		if id, _ := fsys.IdentityOf(fi); !id.Same(en.Ident) {
			t.Fatalf("the index holds a file at %s that was replaced: inode %d, the file there %d", path, en.Ident.Ino, id.Ino)
		}
	}
	if err := e.check(); err != nil {
		t.Fatal(err)
	}
}

// TestALoadNeverIndexesAFileThisEngineRemovedOrReplacedWhileItReadIt: a
// load that finds its key's file replaced behind the engine's back
// (another node's file at the path) indexes the file it found; if, while
// it read that file's header, a job of this engine removed the file (a
// delete, which another load let index it first) or replaced it (a store
// of the key), the load does not index what it read.
func TestALoadNeverIndexesAFileThisEngineRemovedOrReplacedWhileItReadIt(t *testing.T) {
	ctx := context.Background()
	// The other load indexes the file first, so that Delete finds it.
	cases := removedOrReplaced(func(t *testing.T, k *gatedKey) {
		res := wait(t)(k.e.Load(ctx, LoadRequest{Cache: k.c.id, Keys: k.keys, Blocks: [][]int{{8, 9, 10, 11}}}))
		wantOutcomes(t, "the other load", res, OutcomeLoaded)
	})
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			k := storeGatedKey(t, fsys.OpRead)
			// Another node publishes the same bytes at the path: another
			// file than the one indexed.
			b, err := os.ReadFile(k.path)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(k.path+".other", b, 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.Rename(k.path+".other", k.path); err != nil {
				t.Fatal(err)
			}

			k.gate.race(k.path, func() { // held after its open, at its header read
				if j, err := k.e.Load(ctx, LoadRequest{Cache: k.c.id, Keys: k.keys, Blocks: [][]int{{12, 13, 14, 15}}}); err == nil {
					j.Wait(ctx)
				}
			}, func() { tc.meanwhile(t, k) })
			indexHoldsTheFileAt(t, k.e, k.path)
		})
	}
}

// TestTheClusterAdoptionWalkNeverIndexesAFileThisEngineRemovedWhileItReadIt:
// node A's walk of a cluster mount reads the header of each file of a
// dead node it adopted, then indexes it; if meanwhile A removed that file
// (a delete, a lookup having indexed it first), the walk does not index
// what it read. (A's stores on the mount wait for the walk: a store's
// cluster reservation takes the lock the walk runs under.)
func TestTheClusterAdoptionWalkNeverIndexesAFileThisEngineRemovedWhileItReadIt(t *testing.T) {
	ctx := context.Background()
	gate := &opGate{op: fsys.OpClose, reached: make(chan struct{}), proceed: make(chan struct{})}
	a, clock := besideDeadNode(t, t.TempDir(), 1, gate)
	ns, err := a.Declare(ctx, smallGeometry(true))
	if err != nil {
		t.Fatal(err)
	}
	keys := testKeys("d", 1) // dead node D's key (storeKeys)
	_, paths, _, _ := a.nm.names(ctx, a.tables.get(ns), keys)
	path := paths[0]
	if !exists(path) {
		t.Fatalf("no file of D's key at %s", path)
	}
	gate.race(path, func() { // held after a header read, at its close
		tickPastDeadBound(ctx, a, clock)
	}, func() {
		if n, err := a.Lookup(ctx, ns, keys); n != 1 || err != nil {
			t.Fatalf("A's lookup of D's key: %d, %v; want 1", n, err)
		}
		if n, err := a.Delete(ctx, ns, keys); n != 1 || err != nil {
			t.Fatalf("A's Delete of D's key: %d, %v; want 1", n, err)
		}
	})
	indexHoldsTheFileAt(t, a, path)
}
