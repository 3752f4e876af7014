//go:build invariants

package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// fakeDevice is "device memory": a region the CPU path cannot address
// (it is not region.Addressable); only fakeMover reaches its bytes.
type fakeDevice struct {
	id  uint64
	mem []byte
}

// registerFakeDevice registers a cache of nb blocks per layer, K and V
// planes, in fake device memory with the given region id.
func registerFakeDevice(t testing.TB, e *Engine, ns NamespaceID, g Geometry, id uint64, nb int) (CacheID, *fakeDevice) {
	t.Helper()
	bb := g.BlockBytes()
	dev := &fakeDevice{id: id, mem: make([]byte, int64(g.Layers)*2*int64(nb)*bb)}
	var layers []LayerTensor
	for l := range g.Layers {
		layers = append(layers, LayerTensor{Region: dev, Offset: int64(l) * 2 * int64(nb) * bb, BlockStride: bb, PlaneStride: int64(nb) * bb, NumBlocks: nb})
	}
	cid, err := e.RegisterCache(ns, layers)
	if err != nil {
		t.Fatal(err)
	}
	return cid, dev
}

func (d *fakeDevice) ID() uint64        { return d.id }
func (d *fakeDevice) Len() int64        { return int64(len(d.mem)) }
func (d *fakeDevice) Kind() region.Kind { return region.KindDevice }

// fakeMover moves plans of fakeDevice regions with plain pread/pwrite, as
// a GPU path would with cuFile: it computes no checksums, and records the
// files it was told to forget.
type fakeMover struct {
	mu        sync.Mutex
	forgotten []uint64
	prepared  []uint64
	plans     int
	folios    []int64 // each plan's Folio
}

func (m *fakeMover) Name() string    { return "fake-gpu" }
func (m *fakeMover) Checksums() bool { return false }

func (m *fakeMover) WriteFile(ctx context.Context, f fsys.File, p *transfer.Plan, sums []uint32) (int64, error) {
	return m.move(f, p, true)
}

func (m *fakeMover) ReadFile(ctx context.Context, f fsys.File, p *transfer.Plan, sums []uint32) (int64, error) {
	return m.move(f, p, false)
}

func (m *fakeMover) move(f fsys.File, p *transfer.Plan, write bool) (int64, error) {
	if err := p.Check(); err != nil {
		return 0, err
	}
	m.mu.Lock()
	m.plans++
	m.folios = append(m.folios, p.Folio)
	m.mu.Unlock()
	var n int64
	for _, x := range p.Extents {
		d, ok := x.Region.(*fakeDevice)
		if !ok {
			return n, fmt.Errorf("%w: %s region", transfer.ErrUnsupported, x.Region.Kind())
		}
		b := d.mem[x.RegionOff : x.RegionOff+x.Len]
		var err error
		if write {
			_, err = f.WriteAt(b, x.FileOff)
		} else {
			_, err = f.ReadAt(b, x.FileOff)
		}
		if err != nil {
			return n, err
		}
		n += x.Len
	}
	return n, nil
}

func (m *fakeMover) Forget(id fsys.FileID) {
	m.mu.Lock()
	m.forgotten = append(m.forgotten, id.Ino)
	m.mu.Unlock()
}

// Prepare records the inode of each file the engine made ahead of stores.
func (m *fakeMover) Prepare(f fsys.File) {
	id, err := fileIdentity(f)
	if err != nil {
		panic(err)
	}
	m.mu.Lock()
	m.prepared = append(m.prepared, id.Ino)
	m.mu.Unlock()
}

// TestDeviceMover: a mover registered for region.KindDevice (Config.Movers)
// carries stores and loads of caches in device memory; the engine builds
// the plan and the mover never sees host memory; a mover without checksums
// yields files flagged unchecked, which load; Forget is called with the
// file's inode before a delete removes it. The mount reports its host
// backend and I/O mode.
func TestDeviceMover(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	mv := &fakeMover{}
	var infos []MountInfo
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir, IO: IOBuffered}}, Policy: newTestPolicy(2, abi.OrderBlockMajor),
		Movers: map[region.Kind]MoverFactory{region.KindDevice: func(mi MountInfo) (transfer.Mover, error) {
			infos = append(infos, mi)
			return mv, nil
		}}})
	if m := e.Stats().Mounts[0]; m.Backend != "staging" || m.IO != IOBuffered || m.Direct || !m.Checksums || len(infos) != 1 || infos[0].Path != m.Path {
		t.Fatalf("mount %+v, factory saw %+v", m, infos)
	}
	g := smallGeometry(true)
	ns, _ := e.Declare(ctx, g)
	const nb = 32
	bb := g.BlockBytes()
	cid, dev := registerFakeDevice(t, e, ns, g, 77, nb)
	r := rand.New(rand.NewPCG(8, 8))
	for i := range dev.mem {
		dev.mem[i] = byte(r.Uint32())
	}
	keys := testKeys("gpu", 2)
	before := bytes.Clone(dev.mem)
	res := wait(t)(e.Store(ctx, StoreRequest{Cache: cid, Keys: keys, Blocks: [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}}}))
	wantOutcomes(t, "store", res, OutcomeStored)
	files := dataFiles(t, dir)
	if len(files) != 1 {
		t.Fatalf("files %v", files)
	}
	raw, _ := os.ReadFile(files[0])
	h, err := format.Decode(raw)
	if err != nil {
		t.Fatal(err)
	}
	if h.Flags&format.FlagPayloadSums != 0 {
		t.Fatal("a file written by a mover without checksums is flagged checked")
	}
	clear(dev.mem)
	res = wait(t)(e.Load(ctx, LoadRequest{Cache: cid, Keys: keys, Blocks: [][]int{{10, 11, 12, 13}, {14, 15, 16, 17}}}))
	wantOutcomes(t, "load", res, OutcomeLoaded)
	for l := range g.Layers {
		for p := range 2 {
			for i, b := range []int{0, 1, 2, 3, 4, 5, 6, 7} {
				src := int64(l)*2*nb*bb + int64(p)*nb*bb + int64(b)*bb
				dst := int64(l)*2*nb*bb + int64(p)*nb*bb + int64(10+i)*bb
				if !bytes.Equal(before[src:src+bb], dev.mem[dst:dst+bb]) {
					t.Fatalf("layer %d plane %d block %d: loaded bytes differ", l, p, b)
				}
			}
		}
	}
	fi, _ := os.Stat(files[0])
	id, _ := fsys.IdentityOf(fi)
	if n, err := e.Delete(ctx, ns, keys[:1]); n != 1 || err != nil {
		t.Fatalf("delete: %d %v", n, err)
	}
	mv.mu.Lock()
	defer mv.mu.Unlock()
	if mv.plans != 2 || len(mv.forgotten) != 1 || mv.forgotten[0] != id.Ino {
		t.Fatalf("mover saw %d plans, forgot %v, want 2 plans and inode %d", mv.plans, mv.forgotten, id.Ino)
	}
}

// TestPlansCarryTheMountsLargeFolio: the plans of a store and a load on a
// mount whose writes allocate large folios carry the folio size
// (transfer.Plan.Folio), and a mount without them carries 0.
func TestPlansCarryTheMountsLargeFolio(t *testing.T) {
	for _, folio := range []int64{0, 2 << 20} {
		ctx := context.Background()
		mv := &fakeMover{}
		e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir(), IO: IOBuffered}}, Policy: newTestPolicy(2, abi.OrderBlockMajor),
			Movers: map[region.Kind]MoverFactory{region.KindDevice: func(MountInfo) (transfer.Mover, error) { return mv, nil }}})
		e.mounts[0].folio = folio // as openMount finds on a tmpfs with huge pages
		g := smallGeometry(true)
		ns, _ := e.Declare(ctx, g)
		cid, _ := registerFakeDevice(t, e, ns, g, 78, 32)
		keys := testKeys("folio", 2)
		wantOutcomes(t, "store", wait(t)(e.Store(ctx, StoreRequest{Cache: cid, Keys: keys, Blocks: [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}}})), OutcomeStored)
		wantOutcomes(t, "load", wait(t)(e.Load(ctx, LoadRequest{Cache: cid, Keys: keys, Blocks: [][]int{{8, 9, 10, 11}, {12, 13, 14, 15}}})), OutcomeLoaded)
		mv.mu.Lock()
		got := slices.Clone(mv.folios)
		mv.mu.Unlock()
		if len(got) != 2 || got[0] != folio || got[1] != folio {
			t.Fatalf("mount folio %d: plans carried %v, want it on a store's and a load's", folio, got)
		}
	}
}

// refusingMover is a host mover that refuses every plan.
type refusingMover struct{}

func (refusingMover) Name() string    { return "refusing" }
func (refusingMover) Checksums() bool { return true }
func (refusingMover) WriteFile(context.Context, fsys.File, *transfer.Plan, []uint32) (int64, error) {
	return 0, fmt.Errorf("%w: this test's mover moves nothing", transfer.ErrUnsupported)
}
func (refusingMover) ReadFile(context.Context, fsys.File, *transfer.Plan, []uint32) (int64, error) {
	return 0, fmt.Errorf("%w: this test's mover moves nothing", transfer.ErrUnsupported)
}

// TestUnsupportedRegionKind: a cache in a kind of memory no mover handles
// is refused at registration with an error naming the kind; a mover that
// refuses a plan at run time fails the job's keys with its error, no
// panic, no leftover.
func TestUnsupportedRegionKind(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0)})
	g := smallGeometry(true)
	ns, _ := e.Declare(ctx, g)
	dev := &fakeDevice{id: 5, mem: make([]byte, 1<<20)}
	layers := make([]LayerTensor, g.Layers)
	for l := range layers {
		layers[l] = LayerTensor{Region: dev, BlockStride: g.BlockBytes(), PlaneStride: 8 * g.BlockBytes(), NumBlocks: 8}
	}
	_, err := e.RegisterCache(ns, layers)
	if !errors.Is(err, ErrInvalid) || !errors.Is(err, transfer.ErrUnsupported) || !strings.Contains(err.Error(), "device") {
		t.Fatalf("device cache without a device mover: %v", err)
	}

	e2 := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0),
		Movers: map[region.Kind]MoverFactory{region.KindHost: func(MountInfo) (transfer.Mover, error) { return refusingMover{}, nil }}})
	if b := e2.Stats().Mounts[0].Backend; b != "refusing" {
		t.Fatalf("backend %q", b)
	}
	ns2, _ := e2.Declare(ctx, g)
	c := newTestCache(t, e2, ns2, g, 16, layoutPlaneFirst)
	res := wait(t)(e2.Store(ctx, StoreRequest{Cache: c.id, Keys: testKeys("u", 1), Blocks: [][]int{{0, 1, 2, 3}}}))
	if k := res.Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, transfer.ErrUnsupported) {
		t.Fatalf("store through a refusing mover: %v %v", k.Outcome, k.Err)
	}
	if l := leftovers(t, dir); len(l) != 0 {
		t.Fatalf("leftovers %v", l)
	}
}

// TestMountChecksumOff: checksum off on one mount writes unchecked files
// there, which load; the other mount keeps checksums.
func TestMountChecksumOff(t *testing.T) {
	ctx := context.Background()
	d0, d1 := t.TempDir(), t.TempDir()
	e := openEngine(t, Config{Mounts: []Mount{{Path: d0, NoChecksum: true}, {Path: d1}}, Policy: newTestPolicy(1, 0)})
	st := e.Stats()
	if st.Mounts[0].Checksums || !st.Mounts[1].Checksums {
		t.Fatalf("mounts %+v", st.Mounts)
	}
	g := smallGeometry(true)
	ns, _ := e.Declare(ctx, g)
	c := newTestCache(t, e, ns, g, 128, layoutPlaneFirst)
	r := rand.New(rand.NewPCG(2, 9))
	keys := testKeys("sum", 8)
	blocks := blockLists(r, 8, 4, 0)
	var want [][]byte
	for _, b := range blocks {
		c.fill(r, b)
		want = append(want, c.data(b))
	}
	storeAndCheck(t, e, c, keys, blocks)
	loadAndCompare(t, e, c, keys, blockLists(r, 8, 4, 64), want)
	for i, d := range []string{d0, d1} {
		for _, f := range dataFiles(t, d) {
			raw, _ := os.ReadFile(f)
			h, err := format.Decode(raw)
			if err != nil {
				t.Fatal(err)
			}
			if checked := h.Flags&format.FlagPayloadSums != 0; checked != (i == 1) {
				t.Fatalf("mount %d: file flagged checked %v", i, checked)
			}
		}
	}
}

// TestOpenRefusesAConfigWithoutACPUPath: the engine builds no data path
// of its own, so Open refuses a Config whose Host is nil, naming it,
// before it touches a mount.
func TestOpenRefusesAConfigWithoutACPUPath(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "mount")
	_, err := Open(context.Background(), Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0), Logger: testLogger(t)})
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "Config.Host") {
		t.Fatalf("Open without Config.Host: %v, want ErrInvalid naming Config.Host", err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("Open without Config.Host made the mount's root: %v", err)
	}
}
