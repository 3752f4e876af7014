//go:build invariants

package engine

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"
	"unsafe"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/cuda/cudatest"
	"github.com/kvhost/kvhost/staging/gpu"
)

// TestLoadWithNoBlockRandom: loads of random NoBlock patterns (several
// keys per file, some leaving blocks out and some not, a key asked twice
// in one load, runs that alternate) put every named block's bytes where
// asked and change no other byte of the cache, and every key verifies
// (a key whose joined checksum failed would not load); for blocks of 4
// KiB and of sizes that are not multiples of it, MLA, both payload
// orders, 1 and 3 keys per file, buffered and direct I/O, a disk and a
// memory mount.
func TestLoadWithNoBlockRandom(t *testing.T) {
	geos := []Geometry{
		{Model: "p/a", Layers: 3, KVHeads: 2, HeadSize: 64, DtypeSize: 2, TokensPerBlock: 16, TokensPerKey: 64, TPSize: 1},
		{Model: "p/b", Layers: 2, KVHeads: 2, HeadSize: 40, DtypeSize: 2, TokensPerBlock: 16, TokensPerKey: 80, TPSize: 1},
		{Model: "p/c", Layers: 1, KVHeads: 1, HeadSize: 52, DtypeSize: 2, TokensPerBlock: 5, TokensPerKey: 20, TPSize: 1, MLA: true},
		{Model: "p/d", Layers: 2, KVHeads: 2, HeadSize: 100, DtypeSize: 1, TokensPerBlock: 3, TokensPerKey: 6, TPSize: 1},
	}
	for _, dk := range []string{"disk", "shm"} {
		for _, io := range []string{IOBuffered, IOAuto} {
			for _, order := range []uint32{abi.OrderLayerMajor, abi.OrderBlockMajor} {
				for _, kpf := range []uint32{1, 3} {
					for gi, g := range geos {
						t.Run(fmt.Sprintf("%s/io=%s/order=%d/keysPerFile=%d/geometry=%d", dk, io, order, kpf, gi), func(t *testing.T) {
							dir := t.TempDir()
							if dk == "shm" {
								if dir = shmDir(t); dir == "" {
									t.Skip("no /dev/shm")
								}
							}
							randomNoBlockLoads(t, dir, io, order, kpf, g, uint64(gi))
						})
					}
				}
			}
		}
	}
}

// randomNoBlockLoads stores 6 keys from blocks 0.. of a host cache on
// dir and loads them, 12 times, with random NoBlock patterns into random
// other blocks, checking every byte of the cache.
func randomNoBlockLoads(t *testing.T, dir, io string, order, kpf uint32, g Geometry, seed uint64) {
	ctx := context.Background()
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir, IO: io}}, Policy: newTestPolicy(kpf, order)})
	ns, keys, src, nb := declareNoBlock(t, e, g)
	bpk, nkeys := g.BlocksPerKey(), len(keys)
	c := newTestCache(t, e, ns, g, nb, layoutPlaneFirst)
	r := rand.New(rand.NewPCG(seed, uint64(order)*10+uint64(kpf)))
	for k := range src {
		c.fill(r, src[k])
	}
	storeAndCheck(t, e, c, keys, src)
	stored := bytes.Clone(c.reg.Bytes())
	at := func(l, p, b int) int64 {
		t := c.layers[l]
		return t.Offset + int64(p)*t.PlaneStride + int64(b)*t.BlockStride
	}
	for iter := range 12 {
		ks, into, from := randomBlocks(r, keys, src, bpk, nb)
		mem := c.reg.Bytes()
		copy(mem, stored) // the sources whole; the destinations get a pattern
		poisonBlocks(g, mem, at, nkeys*bpk, nb)
		want, loaded := noBlockWant(g, mem, stored, into, from, at)
		res := wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: ks, Blocks: into}))
		checkNoBlockLoad(t, iter, res, into, loaded)
		if i := firstDiff(mem, want); i >= 0 {
			t.Fatalf("iteration %d (%v): byte %d is 0x%02x, want 0x%02x (%s)", iter, into, i, mem[i], want[i], c.where(i))
		}
		if st := e.Stats(); st.Keys != nkeys {
			t.Fatalf("iteration %d: %d keys indexed, want %d", iter, st.Keys, nkeys)
		}
	}
}

// declareNoBlock declares g on e for a random NoBlock test of 6 keys:
// the namespace; the keys, keys[k] stored from the source blocks src[k]
// (blocks 0 on, in order); and nb, the blocks of the cache: the sources,
// then three times as many for destinations.
func declareNoBlock(t *testing.T, e *Engine, g Geometry) (ns NamespaceID, keys [][]byte, src [][]int, nb int) {
	t.Helper()
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	bpk := g.BlocksPerKey()
	const nkeys = 6
	keys = testKeys("rnd", nkeys)
	src = make([][]int, nkeys)
	for k := range src {
		for b := range bpk {
			src[k] = append(src[k], k*bpk+b)
		}
	}
	return ns, keys, src, nkeys*bpk + 3*nkeys*bpk
}

// randomBlocks draws one load of a random NoBlock pattern: 1 to
// len(keys)+2 of keys (a key may come twice), with the source blocks
// src[k] of each keys[k] in from. Each key's bpk blocks in into are left
// out by r's choice in one of three ways (none, every other one from the
// first, each at random), at least one named; the named ones go to
// distinct blocks from len(keys)*bpk to nb-1 in random order.
func randomBlocks(r *rand.Rand, keys [][]byte, src [][]int, bpk, nb int) (ks [][]byte, into, from [][]int) {
	first := len(keys) * bpk
	pool := r.Perm(nb - first) // the destinations, shuffled
	for range 1 + r.IntN(len(keys)+2) {
		k := r.IntN(len(keys))
		blocks := make([]int, bpk)
		named := 0
		mode := r.IntN(4)
		for b := range blocks {
			skip := false
			switch mode {
			case 0: // none
			case 1: // alternating
				skip = b%2 == 0
			default:
				skip = r.IntN(2) == 0
			}
			if skip {
				blocks[b] = NoBlock
			} else {
				blocks[b] = first + pool[0]
				pool = pool[1:]
				named++
			}
		}
		if named == 0 {
			blocks[r.IntN(bpk)] = first + pool[0]
			pool = pool[1:]
		}
		ks, into, from = append(ks, keys[k]), append(into, blocks), append(from, src[k])
	}
	return ks, into, from
}

// poisonBlocks fills blocks first to nb-1 of mem, every layer and plane
// (at gives a block's offset in mem), with 0x3C: the destinations before
// a load.
func poisonBlocks(g Geometry, mem []byte, at func(l, p, b int) int64, first, nb int) {
	bb := g.BlockBytes()
	for l := range g.Layers {
		for p := range g.Planes() {
			for b := first; b < nb; b++ {
				for i := range bb {
					mem[at(l, p, b)+i] = 0x3C
				}
			}
		}
	}
}

// noBlockWant is what a load of into gives: before with every named
// block of into, every layer and plane (at gives a block's offset),
// copied from its source block of from in stored; and the bytes the load
// moves.
func noBlockWant(g Geometry, before, stored []byte, into, from [][]int, at func(l, p, b int) int64) ([]byte, int64) {
	want := bytes.Clone(before)
	bb := g.BlockBytes()
	var loaded int64
	for i := range into {
		for b, dst := range into[i] {
			if dst == NoBlock {
				continue
			}
			loaded += int64(g.Layers*g.Planes()) * bb
			for l := range g.Layers {
				for p := range g.Planes() {
					copy(want[at(l, p, dst):at(l, p, dst)+bb], stored[at(l, p, from[i][b]):at(l, p, from[i][b])+bb])
				}
			}
		}
	}
	return want, loaded
}

// checkNoBlockLoad fails iteration iter of a random NoBlock test unless
// every key of res loaded and res moved loaded bytes.
func checkNoBlockLoad(t *testing.T, iter int, res Result, into [][]int, loaded int64) {
	t.Helper()
	for i, kr := range res.Keys {
		if kr.Outcome != OutcomeLoaded {
			t.Fatalf("iteration %d: key %d (%v): %v (%v)", iter, i, into[i], kr.Outcome, kr.Err)
		}
	}
	if res.Bytes != loaded {
		t.Errorf("iteration %d: %d bytes, want %d", iter, res.Bytes, loaded)
	}
}

// copyAll copies b into the whole of c's device memory, or out of it.
func (c *deviceCache) copyAll(t *testing.T, b []byte, out bool) {
	t.Helper()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := c.rt.SetDevice(0); err != nil {
		t.Fatal(err)
	}
	var err error
	if out {
		err = c.rt.CopySync(uintptr(unsafe.Pointer(&b[0])), c.mem.Ptr(), uintptr(len(b)))
	} else {
		err = c.rt.CopySync(c.mem.Ptr(), uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
	}
	if err != nil {
		t.Fatal(err)
	}
}

// TestLoadWithNoBlockRandomThroughTheGPUMover: random NoBlock loads (as
// TestLoadWithNoBlockRandom) into device memory through the GPU staging
// mover on the fake CUDA library, its checksums on the CPU and on the
// device, through pinned buffers and registered files, from a disk and
// a memory mount (direct I/O where the file system takes it): every
// named block gets its bytes, no other byte of the device changes, and
// every key verifies (a key whose joined checksum failed would not load).
func TestLoadWithNoBlockRandomThroughTheGPUMover(t *testing.T) {
	lib := cudatest.Build(t)
	rt, err := cuda.Open(cuda.Config{Runtime: []string{lib}, Driver: []string{lib}})
	if err != nil {
		t.Fatalf("cuda.Open: %v", err)
	}
	t.Cleanup(func() { rt.Close() })
	// 2560-byte blocks, 5 per key: no block is 4 KiB-aligned in the file.
	g := Geometry{Model: "p/b", Layers: 2, KVHeads: 2, HeadSize: 40, DtypeSize: 2, TokensPerBlock: 16, TokensPerKey: 80, TPSize: 1}
	for _, onDev := range []bool{false, true} {
		for _, reg := range []int{0, 8} {
			mv, err := gpu.New(gpu.Config{Runtime: rt, MaxStaging: 4 << 20, Chunk: 64 << 10, RegisterFiles: reg, SumsOnDevice: onDev})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { mv.Close() })
			for _, dk := range []string{"disk", "shm"} {
				for _, order := range []uint32{abi.OrderLayerMajor, abi.OrderBlockMajor} {
					t.Run(fmt.Sprintf("sumsOnDevice=%v/registerFiles=%d/%s/order=%d", onDev, reg, dk, order), func(t *testing.T) {
						dir := t.TempDir()
						if dk == "shm" {
							if dir = shmDir(t); dir == "" {
								t.Skip("no /dev/shm")
							}
						}
						randomNoBlockLoadsGPU(t, rt, mv, dir, order, g, uint64(order))
					})
				}
			}
		}
	}
}

// randomNoBlockLoadsGPU is randomNoBlockLoads for a device cache moved by
// mv: 3 keys per file, direct I/O where dir takes it.
func randomNoBlockLoadsGPU(t *testing.T, rt *cuda.Runtime, mv *gpu.Mover, dir string, order uint32, g Geometry, seed uint64) {
	ctx := context.Background()
	const kpf = 3
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(kpf, order), Movers: gpuMovers(mv)})
	ns, keys, src, nb := declareNoBlock(t, e, g)
	bpk, nkeys := g.BlocksPerKey(), len(keys)
	c := newDeviceCache(t, e, rt, ns, g, nb)
	r := rand.New(rand.NewPCG(seed, uint64(order)*10+uint64(kpf)))
	mem := make([]byte, c.mem.Len())
	for i := range mem {
		mem[i] = byte(r.Uint32())
	}
	c.copyAll(t, mem, false)
	wantOutcomes(t, "store", wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys, Blocks: src})), OutcomeStored)
	stored := bytes.Clone(mem)
	bb := g.BlockBytes()
	at := func(l, p, b int) int64 {
		return (int64(l)*int64(g.Planes())+int64(p))*int64(nb)*bb + int64(b)*bb
	}
	for iter := range 8 {
		ks, into, from := randomBlocks(r, keys, src, bpk, nb)
		cur := bytes.Clone(stored)
		poisonBlocks(g, cur, at, nkeys*bpk, nb)
		c.copyAll(t, cur, false)
		want, loaded := noBlockWant(g, cur, stored, into, from, at)
		res := wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: ks, Blocks: into}))
		checkNoBlockLoad(t, iter, res, into, loaded)
		got := make([]byte, len(cur))
		c.copyAll(t, got, true)
		if i := firstDiff(got, want); i >= 0 {
			t.Fatalf("iteration %d (%v): byte %d is 0x%02x, want 0x%02x", iter, into, i, got[i], want[i])
		}
	}
}
