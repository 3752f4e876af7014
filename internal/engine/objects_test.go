package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"sync"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/staging"
	"github.com/kvhost/kvhost/transfer"
)

// memObjects is an Objects in memory: Published copies the file at once.
type memObjects struct {
	mv   transfer.Mover // the CPU path: memObject's reads are copies
	mu   sync.Mutex
	objs map[string][]byte
	bad  []string
}

func objName(fp uint64, key []byte) string { return fmt.Sprintf("%016x/%x", fp, key) }

func (o *memObjects) Has(fp uint64, key []byte) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	_, ok := o.objs[objName(fp, key)]
	return ok
}

func (o *memObjects) Open(_ context.Context, fp uint64, key []byte) (fsys.File, error) {
	return &memObject{o: o, name: objName(fp, key)}, nil
}

func (o *memObjects) Published(fp uint64, key []byte, path string) {
	b, err := os.ReadFile(path)
	if err != nil {
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	o.objs[objName(fp, key)] = b
}

func (o *memObjects) Bad(fp uint64, key []byte, _ error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.bad = append(o.bad, objName(fp, key))
	delete(o.objs, objName(fp, key))
}

func (o *memObjects) Mover() transfer.Mover { return o.mv }

// newMemObjects returns an empty memObjects, its mover closed when t ends.
func newMemObjects(t *testing.T) *memObjects {
	mv, err := staging.NewMover(staging.Config{Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mv.Close() })
	return &memObjects{mv: mv, objs: map[string][]byte{}}
}

// memObject reads an object of memObjects; it writes nothing.
type memObject struct {
	fsys.File // nil: the methods a load does not call
	o         *memObjects
	name      string
}

func (f *memObject) ReadAt(p []byte, off int64) (int, error) {
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

// TestObjectMountServesKeysAnotherEngineStored: a key one engine stored
// (and told its object mount of) is a hit and loads, byte for byte, on an
// engine that shares no directory with it; a corrupted object fails its
// load and is reported bad, and a key in neither is a miss.
func TestObjectMountServesKeysAnotherEngineStored(t *testing.T) {
	objs := newMemObjects(t)
	a := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, abi.OrderLayerMajor), Objects: objs})
	b := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, abi.OrderLayerMajor), Objects: objs})
	_, ca := declareSmall(t, a, 64)
	nsB, cb := declareSmall(t, b, 64)
	r := rand.New(rand.NewPCG(1, 2))
	keys := testKeys("obj", 3)
	src := blockLists(r, 3, 4, 0)
	for _, bl := range src {
		ca.fill(r, bl)
	}
	storeAndCheck(t, a, ca, keys, src)
	want := make([][]byte, len(keys))
	for i := range keys {
		want[i] = ca.data(src[i])
	}
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
