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
	"github.com/kvhost/kvhost/internal/cuda"
	"github.com/kvhost/kvhost/internal/cuda/cudatest"
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
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	bpk := g.BlocksPerKey()
	const nkeys = 6
	nb := nkeys*bpk + 3*nkeys*bpk
	c := newTestCache(t, e, ns, g, nb, layoutPlaneFirst)
	r := rand.New(rand.NewPCG(seed, uint64(order)*10+uint64(kpf)))
	keys := testKeys("rnd", nkeys)
	src := make([][]int, nkeys)
	for k := range src {
		for b := range bpk {
			src[k] = append(src[k], k*bpk+b)
		}
		c.fill(r, src[k])
	}
	storeAndCheck(t, e, c, keys, src)
	stored := bytes.Clone(c.reg.Bytes())
	bb := g.BlockBytes()
	for iter := range 12 {
		// Destinations: blocks from nkeys*bpk on, shuffled.
		pool := r.Perm(nb - nkeys*bpk)
		var ks [][]byte
		var into [][]int
		var from [][]int
		n := 1 + r.IntN(nkeys+2)
		for range n {
			k := r.IntN(nkeys)
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
					blocks[b] = nkeys*bpk + pool[0]
					pool = pool[1:]
					named++
				}
			}
			if named == 0 {
				blocks[r.IntN(bpk)] = nkeys*bpk + pool[0]
				pool = pool[1:]
			}
			ks = append(ks, keys[k])
			into = append(into, blocks)
			from = append(from, src[k])
		}
		mem := c.reg.Bytes()
		copy(mem, stored) // the sources whole; the destinations get a pattern
		for l := range g.Layers {
			for p := range g.Planes() {
				for b := nkeys * bpk; b < nb; b++ {
					blk := c.block(l, p, b)
					for i := range blk {
						blk[i] = 0x3C
					}
				}
			}
		}
		want := bytes.Clone(mem)
		var loaded int64
		for i := range into {
			for b, dst := range into[i] {
				if dst == NoBlock {
					continue
				}
				loaded += int64(g.Layers*g.Planes()) * bb
				for l := range g.Layers {
					for p := range g.Planes() {
						t := c.layers[l]
						to := t.Offset + int64(p)*t.PlaneStride + int64(dst)*t.BlockStride
						fr := t.Offset + int64(p)*t.PlaneStride + int64(from[i][b])*t.BlockStride
						copy(want[to:to+bb], stored[fr:fr+bb])
					}
				}
			}
		}
		res := wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: ks, Blocks: into}))
		for i, kr := range res.Keys {
			if kr.Outcome != OutcomeLoaded {
				t.Fatalf("iteration %d: key %d (%v): %v (%v)", iter, i, into[i], kr.Outcome, kr.Err)
			}
		}
		if res.Bytes != loaded {
			t.Errorf("iteration %d: %d bytes, want %d", iter, res.Bytes, loaded)
		}
		if i := firstDiff(mem, want); i >= 0 {
			t.Fatalf("iteration %d (%v): byte %d is 0x%02x, want 0x%02x (%s)", iter, into, i, mem[i], want[i], c.where(i))
		}
		if st := e.Stats(); st.Keys != nkeys {
			t.Fatalf("iteration %d: %d keys indexed, want %d", iter, st.Keys, nkeys)
		}
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
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	bpk := g.BlocksPerKey()
	const nkeys = 6
	nb := nkeys*bpk + 3*nkeys*bpk
	c := newDeviceCache(t, e, rt, ns, g, nb)
	r := rand.New(rand.NewPCG(seed, uint64(order)*10+uint64(kpf)))
	mem := make([]byte, c.mem.Len())
	for i := range mem {
		mem[i] = byte(r.Uint32())
	}
	c.copyAll(t, mem, false)
	keys := testKeys("rnd", nkeys)
	src := make([][]int, nkeys)
	for k := range src {
		for b := range bpk {
			src[k] = append(src[k], k*bpk+b)
		}
	}
	wantOutcomes(t, "store", wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys, Blocks: src})), OutcomeStored)
	stored := bytes.Clone(mem)
	bb := g.BlockBytes()
	at := func(l, p, b int) int64 {
		return (int64(l)*int64(g.Planes())+int64(p))*int64(nb)*bb + int64(b)*bb
	}
	poison := bytes.Repeat([]byte{0x3C}, int(bb)) // a destination block before the load
	for iter := range 8 {
		pool := r.Perm(nb - nkeys*bpk)
		var ks [][]byte
		var into, from [][]int
		for range 1 + r.IntN(nkeys+2) {
			k := r.IntN(nkeys)
			blocks := make([]int, bpk)
			named := 0
			mode := r.IntN(4)
			for b := range blocks {
				skip := (mode == 1 && b%2 == 0) || (mode >= 2 && r.IntN(2) == 0)
				if skip {
					blocks[b] = NoBlock
				} else {
					blocks[b] = nkeys*bpk + pool[0]
					pool = pool[1:]
					named++
				}
			}
			if named == 0 {
				blocks[r.IntN(bpk)] = nkeys*bpk + pool[0]
				pool = pool[1:]
			}
			ks, into, from = append(ks, keys[k]), append(into, blocks), append(from, src[k])
		}
		cur := bytes.Clone(stored)
		for l := range g.Layers {
			for p := range g.Planes() {
				for b := nkeys * bpk; b < nb; b++ {
					copy(cur[at(l, p, b):at(l, p, b)+bb], poison)
				}
			}
		}
		c.copyAll(t, cur, false)
		want := bytes.Clone(cur)
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
		res := wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: ks, Blocks: into}))
		for i, kr := range res.Keys {
			if kr.Outcome != OutcomeLoaded {
				t.Fatalf("iteration %d: key %d (%v): %v (%v)", iter, i, into[i], kr.Outcome, kr.Err)
			}
		}
		if res.Bytes != loaded {
			t.Errorf("iteration %d: %d bytes, want %d", iter, res.Bytes, loaded)
		}
		got := make([]byte, len(cur))
		c.copyAll(t, got, true)
		if i := firstDiff(got, want); i >= 0 {
			t.Fatalf("iteration %d (%v): byte %d is 0x%02x, want 0x%02x", iter, into, i, got[i], want[i])
		}
	}
}
