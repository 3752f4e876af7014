//go:build invariants

package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/testwait"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/internal/crc32c"
	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// layerFixture is an engine on one mount (dir) with smallGeometry(true)
// (4 layers, 4 blocks per key) declared and a cache of 40 blocks whose
// blocks 0-11 hold 3 keys stored from them (0-3, 4-7, 8-11).
type layerFixture struct {
	e      *Engine
	pol    *testPolicy
	ns     NamespaceID
	c      *testCache
	dir    string
	keys   [][]byte
	src    [][]int
	stored []byte // the cache's bytes after the store
}

func newLayerFixture(t testing.TB, io string, order, kpf uint32, layout int) *layerFixture {
	t.Helper()
	ctx := context.Background()
	dir := t.TempDir()
	pol := newTestPolicy(kpf, order)
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir, IO: io}}, Policy: pol})
	g := smallGeometry(true)
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	f := &layerFixture{e: e, pol: pol, ns: ns, c: newTestCache(t, e, ns, g, 40, layout), dir: dir, keys: testKeys("lr", 3), src: [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}}}
	r := rand.New(rand.NewPCG(uint64(order), uint64(kpf)))
	for _, b := range f.src {
		f.c.fill(r, b)
	}
	storeAndCheck(t, e, f.c, f.keys, f.src)
	f.stored = bytes.Clone(f.c.reg.Bytes())
	return f
}

// want returns what the cache holds after a load of the layers lr of the
// stored keys ks into blocks, over a cache of pattern bytes: the pattern
// everywhere but in those layers of the named blocks, which get their
// stored bytes; and the bytes the load moves.
func (f *layerFixture) want(pattern byte, ks []int, blocks [][]int, lr LayerRange) ([]byte, int64) {
	g := f.c.geo
	want := bytes.Repeat([]byte{pattern}, len(f.c.reg.Bytes()))
	var n int64
	for i, k := range ks {
		for b, dst := range blocks[i] {
			if dst == NoBlock {
				continue
			}
			for l := range g.Layers {
				if !lr.all() && (l < lr.First || l >= lr.First+lr.Count) {
					continue
				}
				for p := range g.Planes() {
					t := f.c.layers[l]
					to := t.Offset + int64(p)*t.PlaneStride + int64(dst)*t.BlockStride
					from := t.Offset + int64(p)*t.PlaneStride + int64(f.src[k][b])*t.BlockStride
					copy(want[to:to+g.BlockBytes()], f.stored[from:from+g.BlockBytes()])
					n += g.BlockBytes()
				}
			}
		}
	}
	return want, n
}

// TestLoadLayerRangeValidation: a load's layer range outside the
// namespace's layers, or a first layer with count 0, is refused with
// ErrInvalid naming the range and the layer count.
func TestLoadLayerRangeValidation(t *testing.T) {
	f := newLayerFixture(t, IOBuffered, abi.OrderLayerMajor, 1, layoutPlaneFirst)
	for _, tc := range []struct {
		name string
		r    LayerRange
		want string
	}{
		{"first without count", LayerRange{First: 1}, "first 1 with count 0"},
		{"negative first", LayerRange{First: -1, Count: 1}, "first -1 count 1"},
		{"negative count", LayerRange{First: 0, Count: -1}, "first 0 count -1"},
		{"past the last layer", LayerRange{First: 3, Count: 2}, "<= 4 layers"},
		{"first past the layers", LayerRange{First: 4, Count: 1}, "<= 4 layers"},
	} {
		_, err := f.e.Load(context.Background(), LoadRequest{Cache: f.c.id, Keys: f.keys[:1], Blocks: [][]int{{20, 21, 22, 23}}, Layers: tc.r})
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: load of %v: %v, want ErrInvalid naming %q", tc.name, tc.r, err, tc.want)
		}
	}
}

// layerRanges are the shapes of a layer range of 4 layers.
var layerRanges = []struct {
	name string
	r    LayerRange
}{
	{"first layer", LayerRange{First: 0, Count: 1}},
	{"last layer", LayerRange{First: 3, Count: 1}},
	{"middle layers", LayerRange{First: 1, Count: 2}},
	{"every layer named", LayerRange{First: 0, Count: 4}},
	{"zero range", LayerRange{}},
}

// TestLoadLayerRange: a load of a layer range puts those layers of each
// named block's bytes where it asked and writes nothing else of the cache
// (other layers, and blocks left out, keep a pattern written before the
// load), and reports the bytes it moved; for every range shape, both
// payload orders, one and several keys per file, buffered and direct
// I/O, keys with and without NoBlock blocks. The files of both orders
// carry layer sums, and a range load of them is verified per layer (none
// through the whole key: Stats.LayerLoadsByKey stays 0).
func TestLoadLayerRange(t *testing.T) {
	cases := append([]struct {
		name   string
		keys   []int
		blocks [][]int
	}{{"every block of every key", []int{0, 1, 2}, [][]int{{20, 21, 22, 23}, {24, 25, 26, 27}, {28, 29, 30, 31}}}}, noBlockCases...)
	for _, io := range []string{IOBuffered, IOAuto} {
		for _, order := range []uint32{abi.OrderLayerMajor, abi.OrderBlockMajor} {
			for _, kpf := range []uint32{1, 3} {
				t.Run(fmt.Sprintf("io=%s/order=%d/keysPerFile=%d", io, order, kpf), func(t *testing.T) {
					ctx := context.Background()
					f := newLayerFixture(t, io, order, kpf, layoutPlaneFirst)
					for _, path := range dataFiles(t, f.dir) {
						if h := decodeFile(t, path); h.LayerSums == nil {
							t.Fatalf("%s: no layer sums in a file of order %d", path, order)
						}
					}
					for _, lr := range layerRanges {
						for _, tc := range cases {
							t.Run(lr.name+"/"+tc.name, func(t *testing.T) {
								mem := f.c.reg.Bytes()
								for i := range mem {
									mem[i] = 0xA5
								}
								want, n := f.want(0xA5, tc.keys, tc.blocks, lr.r)
								var ks [][]byte
								for _, k := range tc.keys {
									ks = append(ks, f.keys[k])
								}
								res := wait(t)(f.e.Load(ctx, LoadRequest{Cache: f.c.id, Keys: ks, Blocks: tc.blocks, Layers: lr.r}))
								wantOutcomes(t, "load", res, OutcomeLoaded)
								if res.Bytes != n {
									t.Errorf("the job reports %d bytes, want the %d bytes of the range's layers of the named blocks", res.Bytes, n)
								}
								if i := firstDiff(mem, want); i >= 0 {
									t.Fatalf("byte %d of the cache is 0x%02x, want 0x%02x (%s)", i, mem[i], want[i], f.c.where(i))
								}
								if got := f.e.Stats().LayerLoadsByKey; got != 0 {
									t.Errorf("LayerLoadsByKey %d, want 0", got)
								}
							})
						}
					}
				})
			}
		}
	}
}

// stripLayerSums rewrites the header area of the file at path without its
// layer sums, as a writer built before them wrote it.
func stripLayerSums(t testing.TB, path string, h *format.Header) {
	t.Helper()
	h.LayerSums = nil
	b := make([]byte, h.Len())
	if err := h.Encode(b); err != nil {
		t.Fatal(err)
	}
	if err := writeAt(path, b, 0); err != nil {
		t.Fatal(err)
	}
}

// writeAt writes b at off of the file at path.
func writeAt(path string, b []byte, off int64) error {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	if _, err := f.WriteAt(b, off); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// TestLoadLayerRangeVerifies: a byte changed in the file inside a loaded
// layer fails the key as corrupt (the file dropped), as does one in a
// NoBlock block of a loaded layer (its layer's checksum covers it); a
// byte changed outside the range of a file with layer sums goes unseen:
// the range loads, and only its bytes are read. A file without layer sums
// (written before them) verifies a range through the whole key: a byte
// changed outside the range fails it.
func TestLoadLayerRangeVerifies(t *testing.T) {
	lr := LayerRange{First: 1, Count: 2}
	for _, tc := range []struct {
		name    string
		order   uint32
		strip   bool // rewrite the header without layer sums
		layer   int  // of the changed byte
		block   int  // of the key, whose byte changes
		corrupt bool
	}{
		{"layer sums: byte in a loaded layer", abi.OrderLayerMajor, false, 2, 1, true},
		{"layer sums: byte in a NoBlock block of a loaded layer", abi.OrderLayerMajor, false, 1, 0, true},
		{"layer sums: byte in a layer before the range", abi.OrderLayerMajor, false, 0, 1, false},
		{"layer sums: byte in a layer after the range", abi.OrderLayerMajor, false, 3, 2, false},
		{"no layer sums: byte in a loaded layer", abi.OrderLayerMajor, true, 2, 1, true},
		{"no layer sums: byte in a layer outside the range", abi.OrderLayerMajor, true, 3, 2, true},
		{"block-major layer sums: byte in a loaded layer", abi.OrderBlockMajor, false, 1, 3, true},
		{"block-major layer sums: byte in a layer outside the range", abi.OrderBlockMajor, false, 0, 3, false},
		{"block-major, no layer sums: byte in a layer outside the range", abi.OrderBlockMajor, true, 0, 3, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			f := newLayerFixture(t, IOBuffered, tc.order, 1, layoutPlaneFirst)
			// Key 1's file alone: the fixture stored 3 files.
			h, path := f.fileOf(t, 1)
			if tc.strip {
				stripLayerSums(t, path, h)
			}
			raw, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			off := int64(h.Len()) + h.Offset(0, tc.block, tc.layer, 1) + 5
			if err := writeAt(path, []byte{raw[off] ^ 0xFF}, off); err != nil {
				t.Fatal(err)
			}
			mem := f.c.reg.Bytes()
			for i := range mem {
				mem[i] = 0x3C
			}
			blocks := [][]int{{NoBlock, 20, 21, 22}}
			want, n := f.want(0x3C, []int{1}, blocks, lr)
			read := f.e.Stats().BytesRead
			res := wait(t)(f.e.Load(ctx, LoadRequest{Cache: f.c.id, Keys: f.keys[1:2], Blocks: blocks, Layers: lr}))
			if tc.corrupt {
				if o := res.Keys[0].Outcome; o != OutcomeFailed || !errors.Is(res.Keys[0].Err, ErrCorrupt) {
					t.Fatalf("load: %v (%v), want failed as corrupt", o, res.Keys[0].Err)
				}
				if n, _ := f.e.Lookup(ctx, f.ns, f.keys[1:2]); n != 0 {
					t.Fatal("the corrupt file is still indexed")
				}
				return
			}
			wantOutcomes(t, "load", res, OutcomeLoaded)
			if i := firstDiff(mem, want); i >= 0 {
				t.Fatalf("byte %d of the cache is 0x%02x, want 0x%02x (%s)", i, mem[i], want[i], f.c.where(i))
			}
			// Read: the range's layers of the key, its NoBlock block too.
			if got, wantRead := f.e.Stats().BytesRead-read, uint64(int64(lr.Count)*h.LayerBytes()); got != wantRead {
				t.Errorf("read %d bytes, want %d (the range's layers; %d moved)", got, wantRead, n)
			}
		})
	}
}

// fileOf returns the header and path of the file holding the stored key
// k (one key per file).
func (f *layerFixture) fileOf(t testing.TB, k int) (*format.Header, string) {
	t.Helper()
	for _, path := range dataFiles(t, f.dir) {
		if h := decodeFile(t, path); h != nil {
			if _, err := h.Match(h.Fingerprint, f.keys[k]); err == nil {
				return h, path
			}
		}
	}
	t.Fatalf("no file holds key %d", k)
	return nil, ""
}

// decodeFile returns the header of the kvhost file at path.
func decodeFile(t testing.TB, path string) *format.Header {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	h, err := format.Decode(raw)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// TestLoadLayerRangeOnVLLMFSMount: a layer range load of a vllm-fs row
// (no header, no checksums) reads the range's layers at their offsets in
// the row as the engine lays a namespace's key out there (an MLA
// geometry of several layers), and writes nothing else of the cache.
func TestLoadLayerRangeOnVLLMFSMount(t *testing.T) {
	ctx := context.Background()
	// An MLA geometry of 4 layers (vLLM's row of a K/V one has no layers
	// kvhost could place).
	g := smallGeometry(true)
	g.Model, g.MLA, g.KVHeads = tierModel, true, 1
	tier := newFSTier(t.TempDir(), int(g.KeyBytes()))
	e := openEngine(t, Config{Mounts: []Mount{{Path: tier.root, VLLMFS: &VLLMFS{Fields: tier.fields(), Namespace: tierModel}}}, Policy: newTestPolicy(1, abi.OrderBlockMajor)})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	f := &layerFixture{e: e, ns: ns, c: newTestCache(t, e, ns, g, 40, layoutPlaneFirst), keys: tierKeys(9, 2), src: [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}}}
	r := rand.New(rand.NewPCG(9, 10))
	for _, b := range f.src {
		f.c.fill(r, b)
	}
	storeAndCheck(t, e, f.c, f.keys, f.src)
	f.stored = bytes.Clone(f.c.reg.Bytes())
	for _, lr := range layerRanges {
		t.Run(lr.name, func(t *testing.T) {
			mem := f.c.reg.Bytes()
			for i := range mem {
				mem[i] = 0x77
			}
			blocks := [][]int{{20, 21, NoBlock, 22}, {23, 24, 25, 26}}
			want, n := f.want(0x77, []int{0, 1}, blocks, lr.r)
			res := wait(t)(e.Load(ctx, LoadRequest{Cache: f.c.id, Keys: f.keys, Blocks: blocks, Layers: lr.r}))
			wantOutcomes(t, "load", res, OutcomeLoaded)
			if res.Bytes != n {
				t.Errorf("the job reports %d bytes, want %d", res.Bytes, n)
			}
			if i := firstDiff(mem, want); i >= 0 {
				t.Fatalf("byte %d of the cache is 0x%02x, want 0x%02x (%s)", i, mem[i], want[i], f.c.where(i))
			}
		})
	}
}

// TestLoadLayerRangeThroughADeviceMover: a mover of another region kind
// (cuFile's place) is handed only the range's layers of the blocks a load
// names: the device's other layers keep their bytes. Its files have no
// payload sums (the mover computes none): nothing else is read.
func TestLoadLayerRangeThroughADeviceMover(t *testing.T) {
	ctx := context.Background()
	const nb = 16
	keys := testKeys("devlr", 1)
	e, g, cid, dev, stored := storedOnFakeDevice(t, 1, 78, nb, keys, [][]int{{0, 1, 2, 3}})
	bb := g.BlockBytes()
	for i := range dev.mem {
		dev.mem[i] = 0x5A
	}
	want := bytes.Clone(dev.mem)
	into := []int{10, 11, NoBlock, 12}
	lr := LayerRange{First: 2, Count: 2}
	for b, dst := range into {
		if dst == NoBlock {
			continue
		}
		for l := lr.First; l < lr.First+lr.Count; l++ {
			for p := range 2 {
				from := int64(l)*2*nb*bb + int64(p)*nb*bb + int64(b)*bb
				to := int64(l)*2*nb*bb + int64(p)*nb*bb + int64(dst)*bb
				copy(want[to:to+bb], stored[from:from+bb])
			}
		}
	}
	read := e.Stats().BytesRead
	res := wait(t)(e.Load(ctx, LoadRequest{Cache: cid, Keys: keys, Blocks: [][]int{into}, Layers: lr}))
	wantOutcomes(t, "load", res, OutcomeLoaded)
	if i := firstDiff(dev.mem, want); i >= 0 {
		t.Fatalf("device byte %d is 0x%02x, want 0x%02x", i, dev.mem[i], want[i])
	}
	moved := 3 * int64(lr.Count) * 2 * bb
	if res.Bytes != moved || e.Stats().BytesRead-read != uint64(moved) {
		t.Fatalf("the job reports %d bytes, the engine read %d: want %d (3 blocks of 2 layers)", res.Bytes, e.Stats().BytesRead-read, moved)
	}
}

// TestStoreWritesLayerSums: a store's file holds, for each key and
// layer, the CRC-32C of that layer's segments of the key in payload
// order, and each key's checksum over its whole payload, joined from the
// same pass; for both orders, one and several keys per file.
func TestStoreWritesLayerSums(t *testing.T) {
	for _, order := range []uint32{abi.OrderLayerMajor, abi.OrderBlockMajor} {
		for _, kpf := range []uint32{1, 3} {
			t.Run(fmt.Sprintf("order=%d/keysPerFile=%d", order, kpf), func(t *testing.T) {
				f := newLayerFixture(t, IOBuffered, order, kpf, layoutBlockFirst)
				for _, path := range dataFiles(t, f.dir) {
					raw, err := os.ReadFile(path)
					if err != nil {
						t.Fatal(err)
					}
					h := decodeFile(t, path)
					L := int(h.Layers)
					layers, keys := make([]uint32, len(h.Keys)*L), make([]uint32, len(h.Keys))
					h.Walk(nil, func(k, _, l, _ int, off int64) {
						seg := raw[int64(h.Len())+off:][:h.BlockBytes]
						layers[k*L+l] = crc32c.Update(layers[k*L+l], seg)
						keys[k] = crc32c.Update(keys[k], seg)
					})
					if !slices.Equal(h.LayerSums, layers) {
						t.Errorf("%s: layer sums %x, want %x", path, h.LayerSums, layers)
					}
					for k, key := range h.Keys {
						if key.Sum != keys[k] {
							t.Errorf("%s: key %d: checksum 0x%08x, want 0x%08x", path, k, key.Sum, keys[k])
						}
					}
				}
			})
		}
	}
}

// TestStoreLeavesOutLayerSumsThatDoNotFit: a layer-major file of 50 keys
// of 4 layers has no room for their layer sums in its 4096-byte header
// area (the engine never enlarges it): it is written without them, and a
// layer range load of its keys verifies them through their whole keys
// (counted in Stats.LayerLoadsByKey; a range of every layer is not).
func TestStoreLeavesOutLayerSumsThatDoNotFit(t *testing.T) {
	const n = 50
	ctx := context.Background()
	dir := t.TempDir()
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir, IO: IOBuffered}}, Policy: newTestPolicy(n, abi.OrderLayerMajor)})
	g := smallGeometry(true)
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	bpk := g.BlocksPerKey()
	c := newTestCache(t, e, ns, g, 2*n*bpk, layoutPlaneFirst)
	r := rand.New(rand.NewPCG(11, 12))
	keys, src, dst := testKeys("many", n), blockLists(r, n, bpk, 0), blockLists(r, n, bpk, n*bpk)
	for _, bs := range src {
		c.fill(r, bs)
	}
	storeAndCheck(t, e, c, keys, src)
	files := dataFiles(t, dir)
	if len(files) != 1 {
		t.Fatalf("files %v, want one", files)
	}
	if h := decodeFile(t, files[0]); h.Len() != format.Align || h.LayerSumsFit() || h.LayerSums != nil {
		t.Fatalf("header area %d bytes, layer sums fit %v, layer sums %v: want 4096 bytes without them", h.Len(), h.LayerSumsFit(), h.LayerSums)
	}
	res := wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: keys, Blocks: dst, Layers: LayerRange{First: 3, Count: 1}}))
	wantOutcomes(t, "load", res, OutcomeLoaded)
	if got := e.Stats().LayerLoadsByKey; got != n {
		t.Fatalf("LayerLoadsByKey %d, want %d", got, n)
	}
	for i := range keys {
		if got, want := c.block(3, 1, dst[i][2]), c.block(3, 1, src[i][2]); !bytes.Equal(got, want) {
			t.Fatalf("key %d: layer 3 of its block 2 differs from the stored one", i)
		}
	}
	// A range of every layer is a whole load: not counted.
	res = wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: keys, Blocks: dst, Layers: LayerRange{First: 0, Count: g.Layers}}))
	wantOutcomes(t, "load of every layer", res, OutcomeLoaded)
	if got := e.Stats().LayerLoadsByKey; got != n {
		t.Fatalf("LayerLoadsByKey %d after a load of every layer, want %d", got, n)
	}
}

// storedOnFakeDevice opens an engine whose mount moves device memory with
// a fakeMover (kpf keys per file, layer-major), registers a fake device
// cache of nb blocks of smallGeometry(true) filled with random bytes, and
// stores keys from blocks. It returns the device's bytes as stored.
func storedOnFakeDevice(t *testing.T, kpf uint32, id uint64, nb int, keys [][]byte, blocks [][]int) (*Engine, Geometry, CacheID, *fakeDevice, []byte) {
	t.Helper()
	e, _, cid, dev := fakeDeviceEngine(t, Config{Mounts: []Mount{{Path: t.TempDir(), IO: IOBuffered}},
		Policy: newTestPolicy(kpf, abi.OrderLayerMajor)}, id, nb)
	g := smallGeometry(true)
	r := rand.New(rand.NewPCG(id, id))
	for i := range dev.mem {
		dev.mem[i] = byte(r.Uint32())
	}
	stored := bytes.Clone(dev.mem)
	wantOutcomes(t, "store", wait(t)(e.Store(context.Background(), StoreRequest{Cache: cid, Keys: keys, Blocks: blocks})), OutcomeStored)
	return e, g, cid, dev, stored
}

// TestALayerWiseLoadCountsOneHit: a key loaded layer by layer, one job per
// layer as a layer-wise client sends them, is one use of the key: the
// policy is told of one hit and Stats.Hits grows by one, not by one per
// layer, so that layer-wise loads do not rank keys above whole loads.
func TestALayerWiseLoadCountsOneHit(t *testing.T) {
	ctx := context.Background()
	f := newLayerFixture(t, IOBuffered, abi.OrderLayerMajor, 1, layoutPlaneFirst)
	pol := f.pol
	hits := func() int { pol.mu.Lock(); defer pol.mu.Unlock(); return pol.hits }
	before, statsBefore := hits(), f.e.Stats().Hits
	for l := range f.c.geo.Layers {
		res := wait(t)(f.e.Load(ctx, LoadRequest{Cache: f.c.id, Keys: f.keys[:1], Blocks: [][]int{{20, 21, 22, 23}}, Layers: LayerRange{First: l, Count: 1}}))
		wantOutcomes(t, "load", res, OutcomeLoaded)
	}
	testwait.Until(t, "the policy told of the layer-wise load's hit", time.Minute, func() bool { return hits() > before })
	if got := hits() - before; got != 1 {
		t.Errorf("the policy was told of %d hits, want 1 for one layer-wise load of %d layers", got, f.c.geo.Layers)
	}
	if got := f.e.Stats().Hits - statsBefore; got != 1 {
		t.Errorf("Stats.Hits grew by %d, want 1", got)
	}
}

// orderMover is a fakeMover whose reads record the layer each plan loads
// (layer tensors lie one after another in the fake device: registerFakeDevice)
// and wait, the first of them, until gate is closed.
type orderMover struct {
	fakeMover
	layerBytes int64
	gate       chan struct{}
	first      sync.Once
	mu         sync.Mutex
	layers     []int
}

func (m *orderMover) ReadFile(ctx context.Context, f fsys.File, p *transfer.Plan, sums []uint32) (int64, error) {
	m.first.Do(func() { <-m.gate })
	m.mu.Lock()
	m.layers = append(m.layers, int(p.Extents[0].RegionOff/m.layerBytes))
	m.mu.Unlock()
	return m.fakeMover.ReadFile(ctx, f, p, sums)
}

// fakeBlocks is the blocks per layer plane of fourFilesOnFakeDevice's cache.
const fakeBlocks = 40

// fakeLayerBytes is the bytes of one layer tensor of
// fourFilesOnFakeDevice's cache (layer tensors lie one after another in
// the fake device: registerFakeDevice).
func fakeLayerBytes(g Geometry) int64 { return 2 * fakeBlocks * g.BlockBytes() }

// fourFilesOnFakeDevice opens an engine on a buffered mount whose device
// loads go through mv, with workers I/O slots, and stores four keys of
// geometry g, one file each, from a fake device cache; it returns the
// engine, the cache, the keys and blocks of that cache to load them into.
func fourFilesOnFakeDevice(t *testing.T, g Geometry, mv transfer.Mover, workers int) (*Engine, CacheID, [][]byte, [][]int) {
	t.Helper()
	ctx := context.Background()
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir(), IO: IOBuffered}}, Policy: newTestPolicy(1, abi.OrderLayerMajor), IOWorkers: workers,
		Movers: map[region.Kind]MoverFactory{region.KindDevice: func(MountInfo) (transfer.Mover, error) { return mv, nil }}})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	cid, _ := registerFakeDevice(t, e, ns, g, 7, fakeBlocks)
	keys := testKeys("four", 4)
	src := [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}
	dst := [][]int{{20, 21, 22, 23}, {24, 25, 26, 27}, {28, 29, 30, 31}, {32, 33, 34, 35}}
	wantOutcomes(t, "store", wait(t)(e.Store(ctx, StoreRequest{Cache: cid, Keys: keys, Blocks: src})), OutcomeStored)
	return e, cid, keys, dst
}

// TestACachesLoadsTakeFileSlotsInTheOrderTheyCame: three one-layer loads
// of the same four files (one key each), submitted at once into one cache
// as a layer-wise client submits a step's layers, with one I/O slot: every
// file of the first load is read before any of the second's, and the
// second's before the third's, so the first layer is ready after a third
// of the work, not at the end with the others.
func TestACachesLoadsTakeFileSlotsInTheOrderTheyCame(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	mv := &orderMover{layerBytes: fakeLayerBytes(g), gate: make(chan struct{})}
	e, cid, keys, dst := fourFilesOnFakeDevice(t, g, mv, 1)
	var jobs []*Job
	for l := range 3 {
		j, err := e.Load(ctx, LoadRequest{Cache: cid, Keys: keys, Blocks: dst, Layers: LayerRange{First: l, Count: 1}})
		if err != nil {
			t.Fatal(err)
		}
		jobs = append(jobs, j)
	}
	close(mv.gate)
	for _, j := range jobs {
		wantOutcomes(t, "load", waitJob(t, j, nil), OutcomeLoaded)
	}
	want := []int{0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2}
	if !slices.Equal(mv.layers, want) {
		t.Errorf("files read for layers %v, want %v: each load's files before the next load's", mv.layers, want)
	}
}

// tailMover is a fakeMover whose reads record, in order, the layer each
// plan loads as it starts ("s1") and ends ("e1"), and whose read number
// hold of layer holdLayer waits until gate is closed.
type tailMover struct {
	fakeMover
	layerBytes int64
	holdLayer  int
	hold       int // the read of holdLayer that waits (1: its first)
	gate       chan struct{}
	mu         sync.Mutex
	seen       int // reads of holdLayer so far
	events     []string
}

func (m *tailMover) ReadFile(ctx context.Context, f fsys.File, p *transfer.Plan, sums []uint32) (int64, error) {
	layer := int(p.Extents[0].RegionOff / m.layerBytes)
	m.mu.Lock()
	m.events = append(m.events, fmt.Sprintf("s%d", layer))
	wait := false
	if layer == m.holdLayer {
		m.seen++
		wait = m.seen == m.hold
	}
	m.mu.Unlock()
	if wait {
		<-m.gate
	}
	n, err := m.fakeMover.ReadFile(ctx, f, p, sums)
	m.mu.Lock()
	m.events = append(m.events, fmt.Sprintf("e%d", layer))
	m.mu.Unlock()
	return n, err
}

// TestTheLoadOfAStepsLastLayersWaitsForTheLoadBeforeItToEnd: a layer-wise
// step's loads of layers 1, 2 and 3 (the last) of four files, with two
// I/O slots, the load of layer 2's last file held: layer 3's load takes
// its turn only once every file of layer 2's has ended, while layer 2's
// files took slots as soon as layer 1's had theirs.
func TestTheLoadOfAStepsLastLayersWaitsForTheLoadBeforeItToEnd(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true) // 4 layers
	mv := &tailMover{layerBytes: fakeLayerBytes(g), holdLayer: 2, hold: 4, gate: make(chan struct{})}
	e, cid, keys, dst := fourFilesOnFakeDevice(t, g, mv, 2)
	var jobs []*Job
	for l := 1; l < g.Layers; l++ {
		j, err := e.Load(ctx, LoadRequest{Cache: cid, Keys: keys, Blocks: dst, Layers: LayerRange{First: l, Count: 1}})
		if err != nil {
			t.Fatal(err)
		}
		jobs = append(jobs, j)
	}
	testwait.Until(t, "the last layers' load waiting for its turn", 30*time.Second, func() bool { return e.st.tailTurns.Load() == 1 })
	mv.mu.Lock()
	early := slices.Contains(mv.events, "s3")
	mv.mu.Unlock()
	close(mv.gate)
	for _, j := range jobs {
		wantOutcomes(t, "load", waitJob(t, j, nil), OutcomeLoaded)
	}
	if early {
		t.Errorf("a file of the last layers' load was read while the load before it still ran: %v", mv.events)
	}
	lastEnd := -1
	for i, ev := range mv.events {
		if ev == "e2" {
			lastEnd = i
		}
	}
	if first := slices.Index(mv.events, "s3"); first < lastEnd {
		t.Errorf("reads %v: layer 3's first read began before layer 2's last ended", mv.events)
	}
}
