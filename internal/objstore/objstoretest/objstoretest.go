// Package objstoretest is for tests: engines whose object mount is an
// objstore.Store on an S3 endpoint, and keys stored and loaded through
// them.
package objstoretest

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/daemon/hostpath"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/objstore"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/plugins/lru"
	"github.com/kvhost/kvhost/region"
)

// NumBlocks is the blocks of each layer's K and V planes in a Node's
// cache.
const NumBlocks = 256

// Quiet returns a logger that writes nothing.
func Quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// Geometry is a Node's: keys of 8 MiB (8 layers, K and V, 16 blocks of
// 32 KiB), which upload in two parts of 5 MiB.
func Geometry() engine.Geometry {
	return engine.Geometry{Model: "test/objects", Layers: 8, KVHeads: 8, HeadSize: 128, DtypeSize: 2, TokensPerBlock: 16, TokensPerKey: 256, TPSize: 1}
}

// Node is an engine on a directory of its own with an object mount, its
// namespace of Geometry declared and one cache registered over host
// memory that stands in for a device's.
type Node struct {
	Dir   string // the engine's file mount
	Store *objstore.Store
	Eng   *engine.Engine
	NS    engine.NamespaceID
	Cache engine.CacheID
	Mem   []byte // the cache's memory: one tensor per layer, plane-first
	Geo   engine.Geometry
}

// Options are a Node's settings beside its mount and store; the zero
// value of a field takes its default.
type Options struct {
	// NewPolicy makes the engine's policy; nil: LRU.
	NewPolicy func() guest.Policy
	// IOWorkers is engine.Config.IOWorkers; 0: 4.
	IOWorkers int
}

// OpenNode opens a Node on dir with an LRU policy and a store of cfg,
// each closed when the test ends.
func OpenNode(t testing.TB, dir string, cfg objstore.Config) *Node {
	t.Helper()
	return OpenNodeWith(t, engine.Mount{Path: dir}, cfg, Options{})
}

// OpenNodeWith is OpenNode on mount with opt.
func OpenNodeWith(t testing.TB, mount engine.Mount, cfg objstore.Config, opt Options) *Node {
	t.Helper()
	newPolicy, workers := opt.NewPolicy, opt.IOWorkers
	if newPolicy == nil {
		newPolicy = func() guest.Policy { return lru.New() }
	}
	if workers == 0 {
		workers = 4
	}
	ctx := context.Background()
	st, err := objstore.Open(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	eng, err := engine.Open(ctx, engine.Config{
		Host:   hostpath.Staging,
		Mounts: []engine.Mount{mount},
		NewPolicy: func(idx policy.Index) (policy.Policy, error) {
			return policy.NewNative(newPolicy, idx, policy.Config{Shards: 1})
		},
		Objects:   st,
		IOWorkers: workers,
		Logger:    Quiet(),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close(ctx) })
	g := Geometry()
	ns, err := eng.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	bb := g.BlockBytes()
	perLayer := 2 * NumBlocks * bb
	reg, err := region.NewHost("kv", perLayer*int64(g.Layers))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { reg.Close() })
	var layers []engine.LayerTensor
	for l := range g.Layers {
		layers = append(layers, engine.LayerTensor{Region: reg, Offset: int64(l) * perLayer, NumBlocks: NumBlocks, BlockStride: bb, PlaneStride: NumBlocks * bb})
	}
	c, err := eng.RegisterCache(ns, layers)
	if err != nil {
		t.Fatal(err)
	}
	return &Node{Dir: mount.Path, Store: st, Eng: eng, NS: ns, Cache: c, Mem: reg.Bytes(), Geo: g}
}

// Blocks gives key i of keys the blocks [first+i*bpk, first+(i+1)*bpk),
// bpk being the geometry's blocks per key.
func (n *Node) Blocks(keys, first int) [][]int {
	bpk := n.Geo.BlocksPerKey()
	out := make([][]int, keys)
	for i := range out {
		for b := range bpk {
			out[i] = append(out[i], first+i*bpk+b)
		}
	}
	return out
}

// Block returns the bytes of block b of plane p of layer l.
func (n *Node) Block(l, p, b int) []byte {
	bb := n.Geo.BlockBytes()
	off := (int64(l)*2*NumBlocks + int64(p)*NumBlocks + int64(b)) * bb
	return n.Mem[off : off+bb]
}

// Data returns the bytes of blocks, layer by layer and plane by plane.
func (n *Node) Data(blocks []int) []byte {
	var out []byte
	for l := range n.Geo.Layers {
		for p := range 2 {
			for _, b := range blocks {
				out = append(out, n.Block(l, p, b)...)
			}
		}
	}
	return out
}

// ClearBlocks zeroes the blocks.
func (n *Node) ClearBlocks(blocks [][]int) {
	for _, bl := range blocks {
		for l := range n.Geo.Layers {
			for p := range 2 {
				for _, b := range bl {
					clear(n.Block(l, p, b))
				}
			}
		}
	}
}

// Put stores keys from blocks and fails the test unless each is stored.
func (n *Node) Put(t testing.TB, keys [][]byte, blocks [][]int) {
	t.Helper()
	res := Wait(t)(n.Eng.Store(context.Background(), engine.StoreRequest{Cache: n.Cache, Keys: keys, Blocks: blocks}))
	for i, k := range res.Keys {
		if k.Outcome != engine.OutcomeStored {
			t.Fatalf("store of key %d: %v (%v)", i, k.Outcome, k.Err)
		}
	}
}

// Load zeroes the blocks and loads keys into them.
func (n *Node) Load(t testing.TB, keys [][]byte, blocks [][]int) engine.Result {
	t.Helper()
	n.ClearBlocks(blocks)
	return Wait(t)(n.Eng.Load(context.Background(), engine.LoadRequest{Cache: n.Cache, Keys: keys, Blocks: blocks}))
}

// LoadAndCompare loads keys into the blocks after the first len(keys)
// keys' and fails the test unless each loads with its bytes in want.
func (n *Node) LoadAndCompare(t testing.TB, keys, want [][]byte) {
	t.Helper()
	into := n.Blocks(len(keys), n.Geo.BlocksPerKey()*len(keys))
	res := n.Load(t, keys, into)
	for i, k := range res.Keys {
		if k.Outcome != engine.OutcomeLoaded {
			t.Fatalf("load of key %s: %v (%v)", keys[i], k.Outcome, k.Err)
		}
		if !bytes.Equal(n.Data(into[i]), want[i]) {
			t.Fatalf("key %s: the bytes loaded differ from those stored", keys[i])
		}
	}
}

// StoreKeys is TryStoreKeys that fails the test if an upload fails.
func (n *Node) StoreKeys(t testing.TB, prefix string, count int) (keys, want [][]byte) {
	t.Helper()
	keys, want, ok := n.TryStoreKeys(t, prefix, count)
	if !ok {
		t.Fatalf("uploads failed: %+v", n.Store.Stats())
	}
	return keys, want
}

// TryStoreKeys fills the node's memory with random bytes, seeded by
// count, stores count keys named prefix-000, prefix-001, ... from the
// first blocks and waits until each one's upload has ended. It returns
// the keys, each key's bytes, and whether no upload failed.
func (n *Node) TryStoreKeys(t testing.TB, prefix string, count int) (keys, want [][]byte, ok bool) {
	t.Helper()
	Fill(n.Mem, uint64(count))
	keys = make([][]byte, count)
	for i := range keys {
		keys[i] = fmt.Appendf(nil, "%s-%03d", prefix, i)
	}
	src := n.Blocks(count, 0)
	before := n.Store.Stats()
	n.Put(t, keys, src)
	want = make([][]byte, count)
	for i := range keys {
		want[i] = n.Data(src[i])
	}
	testwait.Until(t, "the uploads", time.Minute, func() bool {
		st := n.Store.Stats()
		return st.Uploaded+st.Skipped+st.Failed >= before.Uploaded+before.Skipped+before.Failed+uint64(count)
	})
	return keys, want, n.Store.Stats().Failed == before.Failed
}

// Wait returns a function that waits for the job a Store or Load
// returned, failing the test on an error or after 2 minutes:
// Wait(t)(e.Store(ctx, req)).
func Wait(t testing.TB) func(*engine.Job, error) engine.Result {
	return func(j *engine.Job, err error) engine.Result {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		res, _ := j.Wait(ctx) // the outcomes are per key, in res
		if ctx.Err() != nil {
			t.Fatal("job did not finish within 2 minutes")
		}
		return res
	}
}

// Fill fills b with random bytes seeded by seed: the same seed, the same
// bytes.
func Fill(b []byte, seed uint64) {
	var s [32]byte
	binary.LittleEndian.PutUint64(s[:], seed)
	rand.NewChaCha8(s).Read(b) // never fails
}
