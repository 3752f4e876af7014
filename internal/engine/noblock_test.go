//go:build invariants

package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/crc32c"
	"github.com/kvhost/kvhost/internal/format"
)

// noBlockCases are loads of 3 stored keys of 4 blocks each (keys 0, 1, 2
// stored from blocks 0-3, 4-7, 8-11) into blocks from 20 on, some of them
// NoBlock: what vLLM's chunks of several GPU blocks ask when the GPU
// prefix cache holds a chunk's first blocks, or when a load ends inside
// a chunk.
var noBlockCases = []struct {
	name   string
	keys   []int   // stored keys to load
	blocks [][]int // their destinations
}{
	{"starts inside the first key", []int{0, 1, 2}, [][]int{{NoBlock, NoBlock, 20, 21}, {22, 23, 24, 25}, {26, 27, 28, 29}}},
	{"ends inside the last key", []int{0, 1, 2}, [][]int{{20, 21, 22, 23}, {24, 25, 26, 27}, {28, NoBlock, NoBlock, NoBlock}}},
	{"starts and ends inside keys", []int{1, 2}, [][]int{{NoBlock, NoBlock, NoBlock, 20}, {21, 22, NoBlock, NoBlock}}},
	{"starts and ends inside one key", []int{2}, [][]int{{NoBlock, 20, 21, NoBlock}}},
	{"one block of the middle key of a file", []int{1}, [][]int{{NoBlock, NoBlock, 20, NoBlock}}},
	{"blocks left out between others", []int{0, 2}, [][]int{{20, NoBlock, 21, NoBlock}, {NoBlock, 22, NoBlock, 23}}},
}

// TestLoadWithNoBlock: a load whose keys leave blocks out (NoBlock) puts
// each named block's bytes where it asked, writes nothing else of the
// cache (every other byte keeps a pattern written before the load), and
// reports the bytes it loaded; for both payload orders, one and several
// keys per file, both cache layouts, blocks of 4 KiB and of 2560 bytes,
// buffered and direct I/O.
func TestLoadWithNoBlock(t *testing.T) {
	for _, io := range []string{IOBuffered, IOAuto} {
		for _, order := range []uint32{abi.OrderLayerMajor, abi.OrderBlockMajor} {
			for _, kpf := range []uint32{1, 3} {
				for _, layout := range []int{layoutPlaneFirst, layoutBlockFirst} {
					for _, aligned := range []bool{true, false} {
						name := fmt.Sprintf("io=%s/order=%d/keysPerFile=%d/layout=%d/aligned=%v", io, order, kpf, layout, aligned)
						t.Run(name, func(t *testing.T) {
							loadWithNoBlock(t, io, order, kpf, layout, aligned)
						})
					}
				}
			}
		}
	}
}

func loadWithNoBlock(t *testing.T, io string, order, kpf uint32, layout int, aligned bool) {
	ctx := context.Background()
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir(), IO: io}}, Policy: newTestPolicy(kpf, order)})
	g := smallGeometry(aligned)
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 40, layout)
	r := rand.New(rand.NewPCG(uint64(order), uint64(kpf)))
	keys := testKeys("nb", 3)
	src := [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}}
	for _, b := range src {
		c.fill(r, b)
	}
	storeAndCheck(t, e, c, keys, src)
	stored := bytes.Clone(c.reg.Bytes()) // the stored keys' bytes are in their source blocks
	for _, tc := range noBlockCases {
		t.Run(tc.name, func(t *testing.T) {
			mem := c.reg.Bytes()
			for i := range mem {
				mem[i] = 0xA5
			}
			// want: the pattern everywhere but in the named blocks,
			// which get their stored bytes.
			want := bytes.Clone(mem)
			var ks [][]byte
			var loaded int64
			for i, k := range tc.keys {
				ks = append(ks, keys[k])
				for b, dst := range tc.blocks[i] {
					if dst == NoBlock {
						continue
					}
					loaded += int64(g.Layers*g.Planes()) * g.BlockBytes()
					for l := range g.Layers {
						for p := range g.Planes() {
							to := c.layers[l].Offset + int64(p)*c.layers[l].PlaneStride + int64(dst)*c.layers[l].BlockStride
							from := c.layers[l].Offset + int64(p)*c.layers[l].PlaneStride + int64(src[k][b])*c.layers[l].BlockStride
							copy(want[to:to+g.BlockBytes()], stored[from:from+g.BlockBytes()])
						}
					}
				}
			}
			res := wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: ks, Blocks: tc.blocks}))
			wantOutcomes(t, "load", res, OutcomeLoaded)
			if res.Bytes != loaded {
				t.Errorf("the job reports %d bytes, want the %d bytes of the named blocks", res.Bytes, loaded)
			}
			if i := firstDiff(mem, want); i >= 0 {
				t.Fatalf("byte %d of the cache is 0x%02x, want 0x%02x (%s)", i, mem[i], want[i], c.where(i))
			}
		})
	}
}

// firstDiff is the index of the first byte where a and b differ, or -1.
func firstDiff(a, b []byte) int {
	// One comparison of the whole first: the race detector checks a
	// byte-by-byte loop's every read, most of the random no-block tests'
	// time.
	if bytes.Equal(a, b) {
		return -1
	}
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	if len(a) != len(b) {
		return min(len(a), len(b))
	}
	return -1
}

// where names the layer, plane and block of byte i of c's region.
func (c *testCache) where(i int) string {
	for l, t := range c.layers {
		for p := range c.geo.Planes() {
			for b := range t.NumBlocks {
				off := t.Offset + int64(p)*t.PlaneStride + int64(b)*t.BlockStride
				if int64(i) >= off && int64(i) < off+c.geo.BlockBytes() {
					return fmt.Sprintf("layer %d plane %d block %d", l, p, b)
				}
			}
		}
	}
	return "outside every block"
}

// TestLoadWithNoBlockVerifiesTheWholeKey: the payload checksum covers the
// whole key, so a byte changed in the file inside a block the load leaves
// out still fails the key as corrupt (the file is dropped), as one inside
// a loaded block does; and the blocks the load left out stay untouched.
func TestLoadWithNoBlockVerifiesTheWholeKey(t *testing.T) {
	for _, order := range []uint32{abi.OrderLayerMajor, abi.OrderBlockMajor} {
		for _, tc := range []struct {
			name string
			b    int // the key's block whose byte changes in the file
		}{
			{"in a block left out", 0},
			{"in a loaded block", 3},
		} {
			t.Run(fmt.Sprintf("order=%d/%s", order, tc.name), func(t *testing.T) {
				ctx := context.Background()
				dir := t.TempDir()
				e := openEngine(t, Config{Mounts: []Mount{{Path: dir, IO: IOBuffered}}, Policy: newTestPolicy(1, order)})
				g := smallGeometry(true)
				ns, err := e.Declare(ctx, g)
				if err != nil {
					t.Fatal(err)
				}
				c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
				c.fill(rand.New(rand.NewPCG(1, 2)), []int{0, 1, 2, 3})
				keys := testKeys("sum", 1)
				storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}})
				files := dataFiles(t, dir)
				if len(files) != 1 {
					t.Fatalf("files %v", files)
				}
				raw, err := os.ReadFile(files[0])
				if err != nil {
					t.Fatal(err)
				}
				h, err := format.Decode(raw)
				if err != nil {
					t.Fatal(err)
				}
				if h.Flags&format.FlagPayloadSums == 0 {
					t.Fatal("the file carries no payload checksums")
				}
				off := int64(h.Len()) + h.Offset(0, tc.b, 2, 1) + 7
				f, err := os.OpenFile(files[0], os.O_WRONLY, 0)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := f.WriteAt([]byte{raw[off] ^ 0xFF}, off); err != nil {
					t.Fatal(err)
				}
				f.Close()
				c.clear([]int{8, 9, 10, 11})
				res := wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: keys, Blocks: [][]int{{NoBlock, NoBlock, 10, 11}}}))
				if o := res.Keys[0].Outcome; o != OutcomeFailed || !errors.Is(res.Keys[0].Err, ErrCorrupt) {
					t.Fatalf("load of a key changed in the file: %v (%v), want failed as corrupt", o, res.Keys[0].Err)
				}
				if blk := c.data([]int{8, 9}); slices.ContainsFunc(blk, func(b byte) bool { return b != 0 }) {
					t.Fatal("the load wrote into blocks it did not name")
				}
				if st := e.Stats(); st.Keys != 0 {
					t.Fatalf("%d keys indexed after a corrupt load: want the file dropped", st.Keys)
				}
			})
		}
	}
}

// TestLoadWithNoBlockThroughADeviceMover: a mover of another region kind
// (cuFile's place) is handed only the blocks a load names: the device
// blocks the load leaves out keep their bytes, the named ones get the
// key's; its plans name no skipped block.
func TestLoadWithNoBlockThroughADeviceMover(t *testing.T) {
	ctx := context.Background()
	const nb = 24
	keys := testKeys("dev", 2)
	e, g, cid, dev, stored := storedOnFakeDevice(t, 2, 77, nb, keys, [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}})
	bb := g.BlockBytes()
	for i := range dev.mem {
		dev.mem[i] = 0x5A
	}
	want := bytes.Clone(dev.mem)
	into := [][]int{{NoBlock, NoBlock, 10, 11}, {12, NoBlock, NoBlock, NoBlock}}
	for k, bs := range into {
		for b, dst := range bs {
			if dst == NoBlock {
				continue
			}
			for l := range g.Layers {
				for p := range 2 {
					from := int64(l)*2*nb*bb + int64(p)*nb*bb + int64(k*4+b)*bb
					to := int64(l)*2*nb*bb + int64(p)*nb*bb + int64(dst)*bb
					copy(want[to:to+bb], stored[from:from+bb])
				}
			}
		}
	}
	res := wait(t)(e.Load(ctx, LoadRequest{Cache: cid, Keys: keys, Blocks: into}))
	wantOutcomes(t, "load", res, OutcomeLoaded)
	if i := firstDiff(dev.mem, want); i >= 0 {
		t.Fatalf("device byte %d is 0x%02x, want 0x%02x", i, dev.mem[i], want[i])
	}
	if want := 3 * int64(g.Layers) * 2 * bb; res.Bytes != want {
		t.Fatalf("the job reports %d bytes, want %d (3 blocks)", res.Bytes, want)
	}
}

// TestLoadRequestNoBlock: NoBlock is a load's only: a store carrying it
// is refused, as is a load of a key whose every block is NoBlock, naming
// the key; a load may leave out blocks of several keys (NoBlock repeats),
// and still names each other block once.
func TestLoadRequestNoBlock(t *testing.T) {
	ctx := context.Background()
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, 0)})
	g := smallGeometry(true)
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 8, layoutPlaneFirst)
	keys := testKeys("v", 2)
	for _, tc := range []struct {
		name   string
		store  bool
		blocks [][]int
		want   string // "" for accepted
	}{
		{"store with NoBlock", true, [][]int{{0, 1, 2, 3}, {NoBlock, 5, 6, 7}}, "key 1: block NoBlock (-1) in a store"},
		{"load of a key of NoBlocks only", false, [][]int{{0, 1, 2, 3}, {NoBlock, NoBlock, NoBlock, NoBlock}}, "key 1: every block is NoBlock"},
		{"load with a block below NoBlock", false, [][]int{{0, 1, 2, 3}, {-2, 5, 6, 7}}, "key 1: block -2 outside 0..7"},
		{"load naming a block twice beside NoBlocks", false, [][]int{{NoBlock, 1, 2, 3}, {NoBlock, 3, 6, 7}}, "destination block 3 is also a block of key 0"},
		{"load leaving blocks of two keys out", false, [][]int{{NoBlock, NoBlock, 2, 3}, {4, 5, NoBlock, NoBlock}}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var j *Job
			var err error
			if tc.store {
				j, err = e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys, Blocks: tc.blocks})
			} else {
				j, err = e.Load(ctx, LoadRequest{Cache: c.id, Keys: keys, Blocks: tc.blocks})
			}
			if tc.want == "" {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				<-j.Done()
				return
			}
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want ErrInvalid saying %q", err, tc.want)
			}
		})
	}
}

// TestSkipsSumJoinsRuns: the checksum joined from the runs of a key's
// payload (checks.sum) is the CRC-32C of the whole payload, for runs of
// any lengths, empty ones among them.
func TestSkipsSumJoinsRuns(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	data := make([]byte, 1<<16)
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	for _, cuts := range [][]int{{}, {1}, {4096}, {0, 100}, {3, 4, 5, 60000}, {12288, 12288, 20480}} {
		t.Run(fmt.Sprint(cuts), func(t *testing.T) {
			bounds := append(append([]int{0}, cuts...), len(data))
			s := &checks{units: [][]part{{}}}
			var sums []uint32
			for i := range len(bounds) - 1 {
				piece := data[bounds[i]:bounds[i+1]]
				s.units[0] = append(s.units[0], part{slot: len(sums), n: int64(len(piece)), skip: i%2 == 1})
				sums = append(sums, crc32c.Checksum(piece))
			}
			if got, want := s.sum(0, sums), crc32c.Checksum(data); got != want {
				t.Fatalf("joined 0x%08x, want 0x%08x", got, want)
			}
		})
	}
}

// countingFile counts the bytes read through ReadAt.
type countingFile struct {
	fsys.File
	n int64
}

func (f *countingFile) ReadAt(p []byte, off int64) (int, error) {
	n, err := f.File.ReadAt(p, off)
	f.n += int64(n)
	return n, err
}

// TestSkipsReadReadsOnlyTheBlocksLeftOut: the engine's read of the blocks
// a load leaves out (checks.read) reads their bytes, to the 4 KiB blocks
// that hold them, and not the file between them: in the layer-major
// order a key's skipped blocks lie one per layer and plane, a layer's
// worth of the file apart (a file's worth of keys apart with several
// keys per file). Each skipped run's checksum slot gets the CRC-32C of
// its bytes; a file cut short fails as corrupt.
func TestSkipsReadReadsOnlyTheBlocksLeftOut(t *testing.T) {
	for _, order := range []uint32{abi.OrderLayerMajor, abi.OrderBlockMajor} {
		for _, kpf := range []uint32{1, 4} {
			t.Run(fmt.Sprintf("order=%d/keysPerFile=%d", order, kpf), func(t *testing.T) {
				ctx := context.Background()
				dir := t.TempDir()
				e := openEngine(t, Config{Mounts: []Mount{{Path: dir, IO: IOBuffered}}, Policy: newTestPolicy(kpf, order)})
				// 8 KiB blocks, 16 per key, 8 layers: a key is 2 MiB, a
				// layer's plane of it 128 KiB.
				g := Geometry{Model: "test/skips", Layers: 8, KVHeads: 2, HeadSize: 128, DtypeSize: 2, TokensPerBlock: 16, TokensPerKey: 256, TPSize: 1}
				ns, err := e.Declare(ctx, g)
				if err != nil {
					t.Fatal(err)
				}
				bpk := g.BlocksPerKey()
				tc := newTestCache(t, e, ns, g, int(kpf)*bpk, layoutPlaneFirst)
				keys := testKeys("skips", int(kpf))
				src := make([][]int, kpf)
				for k := range src {
					for b := range bpk {
						src[k] = append(src[k], k*bpk+b)
					}
					tc.fill(rand.New(rand.NewPCG(7, uint64(k))), src[k])
				}
				storeAndCheck(t, e, tc, keys, src)
				files := dataFiles(t, dir)
				if len(files) != 1 {
					t.Fatalf("files %v, want one", files)
				}
				raw, err := os.ReadFile(files[0])
				if err != nil {
					t.Fatal(err)
				}
				h, err := format.Decode(raw)
				if err != nil {
					t.Fatal(err)
				}
				// Key 0 of the file loads all but its first block.
				blocks := slices.Clone(src[0])
				blocks[0] = NoBlock
				want := make([]bool, len(h.Keys))
				want[0] = true
				plan, sk := e.tables.cache(tc.id).plan(h, want, func(int) []int { return blocks }, e.mounts[0], LayerRange{}, verifyKeys)
				f, err := fsys.OS{}.OpenFile(files[0], os.O_RDONLY, 0)
				if err != nil {
					t.Fatal(err)
				}
				defer f.Close()
				cf := &countingFile{File: f}
				sums := make([]uint32, plan.Sums)
				if err := sk.read(ctx, cf, sums); err != nil {
					t.Fatal(err)
				}
				// The skipped bytes, run by run, from the file.
				var limit int64
				wantSums := make([]uint32, plan.Sums)
				run := -1
				prevSkip := false
				h.Walk(want, func(k, b, l, p int, off int64) {
					skip := blocks[b] == NoBlock
					if run < 0 || skip != prevSkip {
						run++
						prevSkip = skip
					}
					if !skip {
						return
					}
					at := int64(h.Len()) + off
					slot := sk.units[k][run].slot
					wantSums[slot] = crc32c.Update(wantSums[slot], raw[at:at+int64(h.BlockBytes)])
					limit += (at+int64(h.BlockBytes)+format.Align-1)&^(format.Align-1) - at&^(format.Align-1)
				})
				for _, pt := range sk.units[0] {
					if pt.skip && sums[pt.slot] != wantSums[pt.slot] {
						t.Errorf("slot %d: checksum 0x%08x, want 0x%08x", pt.slot, sums[pt.slot], wantSums[pt.slot])
					}
				}
				if cf.n > limit {
					t.Errorf("read %d bytes of the file for %d skipped bytes (%d in the 4 KiB blocks that hold them)", cf.n, sk.skipped[0], limit)
				}
				// A file cut inside the last skipped block: the read
				// fails as corrupt, the file short.
				last := sk.reads[len(sk.reads)-1]
				if err := os.Truncate(files[0], last.FileOff+last.Len-1); err != nil {
					t.Fatal(err)
				}
				if err := sk.read(ctx, f, make([]uint32, plan.Sums)); !errors.Is(err, ErrCorrupt) || !isShort(err) {
					t.Errorf("read of a file cut short: %v, want ErrCorrupt and a short file", err)
				}
			})
		}
	}
}
