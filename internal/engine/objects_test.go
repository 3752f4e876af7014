//go:build invariants

package engine

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"github.com/kvhost/kvhost/internal/testwait"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/staging"
	"github.com/kvhost/kvhost/transfer"
)

// memObjects is an Objects in memory: Published copies the file at once.
type memObjects struct {
	mv     transfer.Mover // the CPU path: memObject's reads are copies
	mu     sync.Mutex
	objs   map[string][]byte
	bad    []string
	onGone []func(fp uint64, key []byte, evicted bool) // each engine's
	full   bool                                        // Upload fails with ENOSPC
	// refuse, where not nil, is the error of every Upload (an endpoint
	// that fails).
	refuse error
	// tried counts the Upload calls.
	tried atomic.Int64
	// published and uploads count the files Published was told of and
	// those Upload copied; reads, the reads of objects.
	published, uploads int
	reads              atomic.Int64
	readBytes          atomic.Int64 // the bytes those reads returned
	// opens counts the opens of each object: one per load of it, each
	// read of what it opens a ranged GET of the real store's.
	opens map[string]int
	// gate, where not nil, holds every Upload until it is closed (or
	// the upload's context ends); held counts the uploads it holds now.
	gate chan struct{}
	held atomic.Int64
	// slow, where not nil, holds every read of an object's payload (past
	// its first 4 KiB) until it is closed or the context of the object's
	// Open ends, as a GET that does not answer; stalled counts the reads
	// it held.
	slow    chan struct{}
	stalled atomic.Int64
}

// holdUploads holds every upload from now until release is called
// (once or more).
func (o *memObjects) holdUploads() (release func()) {
	gate := make(chan struct{})
	o.mu.Lock()
	o.gate = gate
	o.mu.Unlock()
	return sync.OnceFunc(func() {
		o.mu.Lock()
		o.gate = nil
		o.mu.Unlock()
		close(gate)
	})
}

// opened returns how many times the object of key was opened.
func (o *memObjects) opened(fp uint64, key []byte) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.opens[objName(fp, key)]
}

func objName(fp uint64, key []byte) string { return fmt.Sprintf("%016x/%x", fp, key) }

func (o *memObjects) Has(fp uint64, key []byte) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	_, ok := o.objs[objName(fp, key)]
	return ok
}

func (o *memObjects) Open(ctx context.Context, fp uint64, key []byte) (fsys.File, error) {
	o.mu.Lock()
	o.opens[objName(fp, key)]++
	o.mu.Unlock()
	return &memObject{o: o, name: objName(fp, key), ctx: ctx, slow: o.slow}, nil
}

func (o *memObjects) Published(fp uint64, key []byte, path string) {
	b, err := os.ReadFile(path)
	if err != nil {
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	o.objs[objName(fp, key)] = b
	o.published++
}

func (o *memObjects) Bad(fp uint64, key []byte, _ error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.bad = append(o.bad, objName(fp, key))
	delete(o.objs, objName(fp, key))
}

func (o *memObjects) Mover() transfer.Mover { return o.mv }

func (o *memObjects) Delete(fp uint64, key []byte) {
	o.mu.Lock()
	defer o.mu.Unlock()
	delete(o.objs, objName(fp, key))
}

func (o *memObjects) Purge(_ context.Context, fp uint64) ([][]byte, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	var keys [][]byte
	for name := range o.objs {
		if k, ok := strings.CutPrefix(name, fmt.Sprintf("%016x/", fp)); ok {
			b, err := hex.DecodeString(k)
			if err != nil {
				return nil, err
			}
			keys = append(keys, b)
			delete(o.objs, name)
		}
	}
	return keys, nil
}

func (o *memObjects) Upload(ctx context.Context, fp uint64, key []byte, path string) error {
	o.tried.Add(1)
	o.mu.Lock()
	gate, refuse := o.gate, o.refuse
	o.mu.Unlock()
	if refuse != nil {
		return fmt.Errorf("memObjects: upload of %s: %w", path, refuse)
	}
	if gate != nil {
		o.held.Add(1)
		select {
		case <-gate:
			o.held.Add(-1)
		case <-ctx.Done():
			o.held.Add(-1)
			return fmt.Errorf("memObjects: upload of %s: %w", path, ctx.Err())
		}
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.full {
		return fmt.Errorf("memObjects: %w", syscall.ENOSPC)
	}
	o.objs[objName(fp, key)] = b
	o.uploads++
	return nil
}

func (o *memObjects) Usage() (used, capacity int64, objects int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, b := range o.objs {
		used += int64(len(b))
	}
	return used, 0, len(o.objs)
}

func (o *memObjects) OnGone(fn func(fp uint64, key []byte, evicted bool)) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.onGone = append(o.onGone, fn)
}

// evict removes key's object as an eviction for room does, telling every
// engine.
func (o *memObjects) evict(fp uint64, key []byte) {
	o.mu.Lock()
	delete(o.objs, objName(fp, key))
	fns := o.onGone
	o.mu.Unlock()
	for _, fn := range fns {
		fn(fp, key, true)
	}
}

// newMemObjects returns an empty memObjects, its mover closed when t ends.
func newMemObjects(t testing.TB) *memObjects {
	mv, err := staging.NewMover(staging.Config{Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mv.Close() })
	return &memObjects{mv: mv, objs: map[string][]byte{}, opens: map[string]int{}}
}

// memObject reads an object of memObjects; it writes nothing.
type memObject struct {
	fsys.File // nil: the methods a load does not call
	o         *memObjects
	name      string
	ctx       context.Context // the Open's: it bounds a read held by slow
	slow      chan struct{}   // memObjects.slow at the Open
}

func (f *memObject) ReadAt(p []byte, off int64) (int, error) {
	f.o.reads.Add(1)
	if f.slow != nil && off+int64(len(p)) > objectHeaderRead {
		f.o.stalled.Add(1)
		select {
		case <-f.slow:
		case <-f.ctx.Done():
			return 0, fmt.Errorf("object %s: get bytes=%d-%d: %w", f.name, off, off+int64(len(p))-1, f.ctx.Err())
		}
	}
	f.o.mu.Lock()
	b, ok := f.o.objs[f.name]
	f.o.mu.Unlock()
	if !ok {
		return 0, fmt.Errorf("object %s: %w", f.name, fs.ErrNotExist)
	}
	if off >= int64(len(b)) {
		return 0, io.EOF
	}
	n := copy(p, b[off:])
	f.o.readBytes.Add(int64(n))
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

func (f *memObject) ReadvAt(bufs [][]byte, off int64) (int, error) {
	var n int
	for _, b := range bufs {
		got, err := f.ReadAt(b, off+int64(n))
		n += got
		if err != nil {
			if errors.Is(err, io.EOF) {
				return n, nil
			}
			return n, err
		}
	}
	return n, nil
}

func (f *memObject) Close() error { return nil }

// objectNode is an engine of a pair sharing one memObjects.
type objectNode struct {
	e  *Engine
	ns NamespaceID
	c  *testCache
}

// objectPair opens two engines on directories of their own with one
// memObjects, stores n keys of prefix on the first and returns the keys
// and the bytes of each.
func objectPair(t *testing.T, prefix string, n int) (*memObjects, objectNode, objectNode, [][]byte, [][]byte) {
	t.Helper()
	objs := newMemObjects(t)
	var nodes [2]objectNode
	for i := range nodes {
		e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, abi.OrderLayerMajor), Objects: objs})
		ns, c := declareSmall(t, e, 64)
		nodes[i] = objectNode{e, ns, c}
	}
	a := nodes[0]
	r := rand.New(rand.NewPCG(uint64(n), 2))
	keys := testKeys(prefix, n)
	src := blockLists(r, n, 4, 0)
	for _, bl := range src {
		a.c.fill(r, bl)
	}
	storeAndCheck(t, a.e, a.c, keys, src)
	want := make([][]byte, n)
	for i := range keys {
		want[i] = a.c.data(src[i])
	}
	return objs, nodes[0], nodes[1], keys, want
}

// TestObjectMountServesKeysAnotherEngineStored: a key one engine stored
// (and told its object mount of) is a hit and loads, byte for byte, on an
// engine that shares no directory with it; a corrupted object fails its
// load and is reported bad, and a key in neither is a miss.
func TestObjectMountServesKeysAnotherEngineStored(t *testing.T) {
	objs, _, nb, keys, want := objectPair(t, "obj", 3)
	b, nsB, cb := nb.e, nb.ns, nb.c
	r := rand.New(rand.NewPCG(1, 2))
	if n, err := b.Lookup(context.Background(), nsB, keys); err != nil || n != len(keys) {
		t.Fatalf("lookup on the other engine: %d of %d, %v", n, len(keys), err)
	}
	into := blockLists(r, 3, 4, 16)
	loadAndCompare(t, b, cb, keys, into, want)

	// One byte of the last key's payload changed in the store.
	name := objName(cb.geo.Fingerprint(), keys[2])
	objs.mu.Lock()
	objs.objs[name][len(objs.objs[name])-1] ^= 1
	objs.mu.Unlock()
	res := wait(t)(b.Load(context.Background(), LoadRequest{Cache: cb.id, Keys: keys[2:], Blocks: into[2:]}))
	if o, err := res.Keys[0].Outcome, res.Keys[0].Err; o != OutcomeFailed || !errors.Is(err, ErrCorrupt) {
		t.Fatalf("load of a corrupted object: %v (%v), want failed with ErrCorrupt", o, err)
	}
	if len(objs.bad) != 1 || objs.bad[0] != name {
		t.Fatalf("objects reported bad: %v, want [%s]", objs.bad, name)
	}
	if n, err := b.Lookup(context.Background(), nsB, keys[2:]); err != nil || n != 0 {
		t.Fatalf("lookup of the dropped object: %d, %v; want a miss", n, err)
	}
	res = wait(t)(b.Load(context.Background(), LoadRequest{Cache: cb.id, Keys: [][]byte{[]byte("nowhere")}, Blocks: into[:1]}))
	wantOutcomes(t, "load of a key in neither", res, OutcomeMissing)
}

// TestObjectLoadRefusesAnObjectOfAnotherKey: an object whose header names
// another key (copied under this key's name) is corrupt, and nothing of
// it reaches the blocks.
func TestObjectLoadRefusesAnObjectOfAnotherKey(t *testing.T) {
	objs := newMemObjects(t)
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, abi.OrderLayerMajor), Objects: objs})
	_, c := declareSmall(t, e, 64)
	r := rand.New(rand.NewPCG(3, 4))
	keys := testKeys("other", 1)
	src := blockLists(r, 1, 4, 0)
	c.fill(r, src[0])
	storeAndCheck(t, e, c, keys, src)
	fp := c.geo.Fingerprint()
	objs.mu.Lock()
	objs.objs[objName(fp, []byte("thief"))] = objs.objs[objName(fp, keys[0])]
	objs.mu.Unlock()
	into := blockLists(r, 1, 4, 16)
	c.clear(into[0])
	res := wait(t)(e.Load(context.Background(), LoadRequest{Cache: c.id, Keys: [][]byte{[]byte("thief")}, Blocks: into}))
	if o, err := res.Keys[0].Outcome, res.Keys[0].Err; o != OutcomeFailed || !errors.Is(err, ErrCorrupt) {
		t.Fatalf("load of another key's object: %v (%v), want failed with ErrCorrupt", o, err)
	}
	if !bytes.Equal(c.data(into[0]), make([]byte, len(c.data(into[0])))) {
		t.Fatal("bytes of another key's object reached the blocks")
	}
}

// TestDeleteRemovesTheKeysObject: a deleted key is gone from the object
// mount too, counted once, whether a file held it or the bucket only,
// and is a miss everywhere after.
func TestDeleteRemovesTheKeysObject(t *testing.T) {
	objs, na, nb, keys, _ := objectPair(t, "del", 2)
	a, nsA, ca, b, nsB := na.e, na.ns, na.c, nb.e, nb.ns
	// Key 0 on a, which holds its file; key 1 on b, which has none.
	if n, err := a.Delete(context.Background(), nsA, keys[:1]); err != nil || n != 1 {
		t.Fatalf("delete of a key with a file: %d, %v; want 1", n, err)
	}
	if n, err := b.Delete(context.Background(), nsB, keys[1:]); err != nil || n != 1 {
		t.Fatalf("delete of a key only the bucket holds: %d, %v; want 1", n, err)
	}
	for i, k := range keys {
		if objs.Has(ca.geo.Fingerprint(), k) {
			t.Errorf("key %d's object outlived its delete", i)
		}
	}
	if n, _ := b.Lookup(context.Background(), nsB, keys[:1]); n != 0 {
		t.Fatal("a deleted key is still a hit on another engine")
	}
}

// TestObjectLoadsIntoDeviceMemoryThroughAVerifiedBounce: a key only the
// object mount holds loads into a cache in device memory (the fake GPU
// mover, which computes no checksums) with its bytes; a corrupted object
// fails with ErrCorrupt, checked before the mover runs.
func TestObjectLoadsIntoDeviceMemoryThroughAVerifiedBounce(t *testing.T) {
	objs, _, _, keys, want := objectPair(t, "dev", 2)
	e, mv, cid, dev := deviceNode(t, objs, 91)
	into := [][]int{{3, 2, 1, 0}, {4, 5, 6, 7}}
	res := wait(t)(e.Load(context.Background(), LoadRequest{Cache: cid, Keys: keys, Blocks: into}))
	wantOutcomes(t, "load into device memory", res, OutcomeLoaded)
	dev.requireKeys(t, keys, into, want)
	mv.mu.Lock()
	plans := mv.plans
	mv.mu.Unlock()
	name := objName(smallGeometry(true).Fingerprint(), keys[1])
	objs.mu.Lock()
	objs.objs[name][len(objs.objs[name])-1] ^= 1
	objs.mu.Unlock()
	res = wait(t)(e.Load(context.Background(), LoadRequest{Cache: cid, Keys: keys[1:], Blocks: into[1:]}))
	if o, err := res.Keys[0].Outcome, res.Keys[0].Err; o != OutcomeFailed || !errors.Is(err, ErrCorrupt) {
		t.Fatalf("load of a corrupted object into device memory: %v (%v), want failed with ErrCorrupt", o, err)
	}
	mv.mu.Lock()
	defer mv.mu.Unlock()
	if mv.plans != plans {
		t.Fatal("the mover moved a corrupted object's bytes")
	}
}

// changedDestinations is a mover whose loads see their destination
// blocks change under them: each ReadFile's first checksum slot comes
// back altered, as where the client wrote its blocks while they were
// loaded, once armed.
type changedDestinations struct {
	transfer.Mover
	armed atomic.Bool
}

func (m *changedDestinations) ReadFile(ctx context.Context, f fsys.File, p *transfer.Plan, sums []uint32) (int64, error) {
	n, err := m.Mover.ReadFile(ctx, f, p, sums)
	if err == nil && len(sums) > 0 && m.armed.Load() {
		sums[0] ^= 1
	}
	return n, err
}

// TestAnObjectLoadWhoseBlocksChangedDoesNotBlameTheObject: a load from
// the object mount whose checksum, computed from the client's blocks,
// fails while a private re-read of the object verifies fails the key
// with ErrDestinationChanged; the object is not reported bad, and loads
// with its bytes afterwards.
func TestAnObjectLoadWhoseBlocksChangedDoesNotBlameTheObject(t *testing.T) {
	objs, _, nb, keys, want := objectPair(t, "changed", 1)
	mv := &changedDestinations{Mover: objs.mv}
	objs.mv = mv
	mv.armed.Store(true)
	into := [][]int{{16, 17, 18, 19}}
	res := wait(t)(nb.e.Load(context.Background(), LoadRequest{Cache: nb.c.id, Keys: keys, Blocks: into}))
	if o, err := res.Keys[0].Outcome, res.Keys[0].Err; o != OutcomeFailed || !errors.Is(err, ErrDestinationChanged) || errors.Is(err, ErrCorrupt) {
		t.Fatalf("load whose blocks changed: %v (%v), want failed with ErrDestinationChanged", o, err)
	}
	objs.mu.Lock()
	bad := len(objs.bad)
	objs.mu.Unlock()
	if bad != 0 || nb.e.Stats().Corrupt != 0 {
		t.Fatalf("%d objects reported bad, %d corrupt; want none: the object is good", bad, nb.e.Stats().Corrupt)
	}
	mv.armed.Store(false)
	loadAndCompare(t, nb.e, nb.c, keys, into, want)
}

// TestAnObjectLoadFromAStoreThatDoesNotAnswerEndsAtItsDeadline: where
// the store holds the GETs of an object's payload, a load of the key
// fails at its context's deadline, while they are still held, with an
// error naming the object and the deadline; nothing counts as loaded or
// corrupt, the object stays, and the key loads with its bytes once the
// store answers.
func TestAnObjectLoadFromAStoreThatDoesNotAnswerEndsAtItsDeadline(t *testing.T) {
	objs, _, nb, keys, want := objectPair(t, "slow", 2)
	slow := make(chan struct{})
	objs.mu.Lock()
	objs.slow = slow
	objs.mu.Unlock()
	into := [][]int{{16, 17, 18, 19}, {20, 21, 22, 23}}
	loads := nb.e.Stats().Loads
	// Long enough for the load to reach its GETs on a loaded machine.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	res := wait(t)(nb.e.Load(ctx, LoadRequest{Cache: nb.c.id, Keys: keys, Blocks: into}))
	// slow is still open: the load ended on its own deadline, not on an
	// answer of the store's.
	if objs.stalled.Load() == 0 {
		t.Fatal("no GET was held: the test held nothing")
	}
	for i, k := range res.Keys {
		if k.Outcome != OutcomeFailed || !errors.Is(k.Err, context.DeadlineExceeded) || !strings.Contains(k.Err.Error(), fmt.Sprintf("%x", keys[i])) {
			t.Fatalf("key %d of a store that does not answer: %v (%v), want failed at the deadline, naming the key's object", i, k.Outcome, k.Err)
		}
	}
	if st := nb.e.Stats(); st.Loads != loads || st.Corrupt != 0 {
		t.Fatalf("%d loads counted, %d corrupt; want none", st.Loads-loads, st.Corrupt)
	}
	objs.mu.Lock()
	bad := len(objs.bad)
	objs.slow = nil
	objs.mu.Unlock()
	close(slow)
	if bad != 0 {
		t.Fatalf("%d objects reported bad; a slow store is not a corrupt object", bad)
	}
	loadAndCompare(t, nb.e, nb.c, keys, into, want)
}

// TestLayerRangesOfAnObjectLoadIntoDeviceMemoryReadingEachByteOnce: a
// layer-wise load of keys from the object mount into device memory
// (one job per group of layers, as the vLLM connector sends) reads
// only each group's bytes of the object, verified by their layer
// checksums: the groups together read the payload once, not once per
// group; a byte flipped in one layer fails the group holding it with
// ErrCorrupt and not a group before it.
func TestLayerRangesOfAnObjectLoadIntoDeviceMemoryReadingEachByteOnce(t *testing.T) {
	objs, _, _, keys, want := objectPair(t, "lay", 2)
	e, _, cid, dev := deviceNode(t, objs, 92)
	into := [][]int{{3, 2, 1, 0}, {4, 5, 6, 7}}
	payload := int64(0)
	for _, w := range want {
		payload += int64(len(w))
	}
	before := objs.readBytes.Load()
	for _, lr := range []LayerRange{{0, 1}, {1, 2}, {3, 1}} {
		res := wait(t)(e.Load(context.Background(), LoadRequest{Cache: cid, Keys: keys, Blocks: into, Layers: lr}))
		wantOutcomes(t, fmt.Sprintf("load of layers %+v", lr), res, OutcomeLoaded)
	}
	// The header's first read (objectHeaderRead) of each key per job,
	// and the payload once.
	if got, most := objs.readBytes.Load()-before, payload+int64(3*len(keys)*objectHeaderRead); got > most {
		t.Fatalf("three layer groups read %d bytes of objects holding %d of payload: want at most %d", got, payload, most)
	}
	dev.requireKeys(t, keys, into, want)
	// The last layer's last byte of key 1 flipped: layers 0-2 still load,
	// layer 3 fails.
	name := objName(smallGeometry(true).Fingerprint(), keys[1])
	objs.mu.Lock()
	objs.objs[name][len(objs.objs[name])-1] ^= 1
	objs.mu.Unlock()
	res := wait(t)(e.Load(context.Background(), LoadRequest{Cache: cid, Keys: keys[1:], Blocks: into[1:], Layers: LayerRange{0, 3}}))
	wantOutcomes(t, "load of layers 0-2 beside a corrupt layer 3", res, OutcomeLoaded)
	res = wait(t)(e.Load(context.Background(), LoadRequest{Cache: cid, Keys: keys[1:], Blocks: into[1:], Layers: LayerRange{3, 1}}))
	if o, err := res.Keys[0].Outcome, res.Keys[0].Err; o != OutcomeFailed || !errors.Is(err, ErrCorrupt) {
		t.Fatalf("load of the corrupted layer: %v (%v), want failed with ErrCorrupt", o, err)
	}
}

// TestObjectKeysLoadBeyondTheFileSlots: keys loaded from the object
// mount wait on the network, not on a disk or a CPU, so more of them are
// read at once than the engine's I/O workers (2 here): a load of 6 keys
// from a store that holds every payload GET has all 6 keys' objects open
// together (their headers read; this fake's mover then queues them on
// the CPU path's workers, the real store's sends their ranges), and every
// key loads once the store answers.
func TestObjectKeysLoadBeyondTheFileSlots(t *testing.T) {
	objs, _, nb, keys, want := objectPair(t, "wide", 6)
	if w := nb.e.cfg.IOWorkers; w >= len(keys) {
		t.Fatalf("%d I/O workers: the test needs fewer than its %d keys", w, len(keys))
	}
	slow := make(chan struct{})
	release := sync.OnceFunc(func() { close(slow) })
	t.Cleanup(release) // a failure below still lets the engines close
	objs.mu.Lock()
	objs.slow = slow
	objs.mu.Unlock()
	into := blockLists(rand.New(rand.NewPCG(6, 6)), len(keys), 4, 16)
	j, err := nb.e.Load(context.Background(), LoadRequest{Cache: nb.c.id, Keys: keys, Blocks: into})
	if err != nil {
		t.Fatal(err)
	}
	fp := smallGeometry(true).Fingerprint()
	testwait.Until(t, "every key's object open at once", 10*time.Second, func() bool {
		n := 0
		for _, k := range keys {
			n += objs.opened(fp, k)
		}
		return n >= len(keys)
	})
	objs.mu.Lock()
	objs.slow = nil
	objs.mu.Unlock()
	release()
	wantOutcomes(t, "load of keys held together", waitJob(t, j, nil), OutcomeLoaded)
	for i := range keys {
		if !bytes.Equal(nb.c.data(into[i]), want[i]) {
			t.Fatalf("key %s: loaded bytes differ", keys[i])
		}
	}
}

// deviceNodeBlocks is the blocks of deviceNode's fake device cache.
const deviceNodeBlocks = 32

// deviceNode opens an engine over objs whose cache of the small geometry
// is in (fake) device memory, loaded by a fakeMover: the engine, that
// mover, the cache and its device, of id.
func deviceNode(t *testing.T, objs *memObjects, id uint64) (*Engine, *fakeMover, CacheID, *fakeDevice) {
	t.Helper()
	return fakeDeviceEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, abi.OrderLayerMajor), Objects: objs},
		id, deviceNodeBlocks)
}

// fakeDeviceEngine opens an engine of cfg whose device memory a
// fakeMover moves, and registers a fake device cache of nb blocks of
// smallGeometry(true), of id: the engine, the mover, the cache and its
// device.
func fakeDeviceEngine(t *testing.T, cfg Config, id uint64, nb int) (*Engine, *fakeMover, CacheID, *fakeDevice) {
	t.Helper()
	mv := &fakeMover{}
	cfg.Movers = map[region.Kind]MoverFactory{region.KindDevice: func(MountInfo) (transfer.Mover, error) { return mv, nil }}
	e := openEngine(t, cfg)
	ns, err := e.Declare(context.Background(), smallGeometry(true))
	if err != nil {
		t.Fatal(err)
	}
	cid, dev := registerFakeDevice(t, e, ns, smallGeometry(true), id, nb)
	return e, mv, cid, dev
}

// requireKeys requires the device's blocks into[i] to hold want[i], key
// i's payload in file order (layer, plane, block), as deviceNode lays
// its cache out.
func (d *fakeDevice) requireKeys(t *testing.T, keys [][]byte, into [][]int, want [][]byte) {
	t.Helper()
	g, nb := smallGeometry(true), int64(deviceNodeBlocks)
	bb := g.BlockBytes()
	for i := range keys {
		var got []byte
		for l := range g.Layers {
			for p := range 2 {
				for _, b := range into[i] {
					off := int64(l)*2*nb*bb + int64(p)*nb*bb + int64(b)*bb
					got = append(got, d.mem[off:off+bb]...)
				}
			}
		}
		if !bytes.Equal(got, want[i]) {
			t.Fatalf("key %s: the device memory holds other bytes than stored", keys[i])
		}
	}
}
