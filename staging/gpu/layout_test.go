package gpu

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/internal/crc32c"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// geometry is a paged KV-cache layout as vLLM keeps it: per layer one
// device tensor viewed as (numBlocks, pageBytes), K and V packed inside
// a page; a file holds blocksPerKey pages of every layer, layer-major,
// after a header of headerBytes.
type geometry struct {
	layers, numBlocks, pageBytes, blocksPerKey, headerBytes int
}

// cache is one device's paged KV cache.
type cache struct {
	g      geometry
	layers []*cuda.DeviceMemory
}

func newCache(t testing.TB, w *cuda.Worker, g geometry) *cache {
	t.Helper()
	c := &cache{g: g}
	err := w.Do(context.Background(), func(w *cuda.Worker) error {
		for range g.layers {
			m, err := w.Runtime().Malloc(w.Ordinal(), int64(g.numBlocks*g.pageBytes))
			if err != nil {
				return err
			}
			c.layers = append(c.layers, m)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("allocate cache: %v", err)
	}
	t.Cleanup(func() {
		w.Do(context.Background(), func(*cuda.Worker) error {
			for _, m := range c.layers {
				m.Close()
			}
			return nil
		})
	})
	return c
}

// fill writes b to layer l's whole tensor (host → device, synchronous).
func (c *cache) set(t testing.TB, w *cuda.Worker, l int, b []byte) {
	t.Helper()
	err := w.Do(context.Background(), func(w *cuda.Worker) error {
		return w.Runtime().CopySync(c.layers[l].Ptr(), uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
	})
	if err != nil {
		t.Fatalf("set layer %d: %v", l, err)
	}
}

// get reads layer l's whole tensor back to the host.
func (c *cache) get(t testing.TB, w *cuda.Worker, l int) []byte {
	t.Helper()
	b := make([]byte, c.g.numBlocks*c.g.pageBytes)
	err := w.Do(context.Background(), func(w *cuda.Worker) error {
		return w.Runtime().CopySync(uintptr(unsafe.Pointer(&b[0])), c.layers[l].Ptr(), uintptr(len(b)))
	})
	if err != nil {
		t.Fatalf("get layer %d: %v", l, err)
	}
	return b
}

// randomize fills every layer with random bytes and returns them. A
// ChaCha8 generator fills each buffer whole, in its own code: the race
// detector then checks one copy per refill instead of every 8-byte word
// of the generator's state and of the buffer, which took most of the
// round trip test's time (22 cases of 128 MiB each).
func (c *cache) randomize(t testing.TB, w *cuda.Worker, seed uint64) [][]byte {
	var key [32]byte
	binary.LittleEndian.PutUint64(key[:], seed)
	r := rand.NewChaCha8(key)
	var out [][]byte
	for l := range c.layers {
		b := make([]byte, c.g.numBlocks*c.g.pageBytes)
		r.Read(b)
		c.set(t, w, l, b)
		out = append(out, b)
	}
	return out
}

// poison fills every layer with 0xEE.
func (c *cache) poison(t testing.TB, w *cuda.Worker) {
	b := bytes.Repeat([]byte{0xEE}, c.g.numBlocks*c.g.pageBytes)
	for l := range c.layers {
		c.set(t, w, l, b)
	}
}

// plan is the file of one key whose pages are blocks: layer-major, one
// extent per (layer, block), checksum slot per layer modulo 3.
func (c *cache) plan(blocks []int, direct bool) *transfer.Plan { return c.planG(c.g, blocks, direct) }

// planG is plan with the file geometry g (its blocksPerKey may differ).
func (c *cache) planG(g geometry, blocks []int, direct bool) *transfer.Plan {
	p := &transfer.Plan{Sums: 3, Direct: direct}
	off := int64(g.headerBytes)
	for l := range g.layers {
		for _, b := range blocks {
			p.Extents = append(p.Extents, transfer.Extent{
				FileOff: off, Region: c.layers[l], RegionOff: int64(b * g.pageBytes), Len: int64(g.pageBytes), Sum: l % 3,
			})
			off += int64(g.pageBytes)
		}
	}
	return p
}

// expect returns what the plan's file holds (after the header) and the
// checksums of its slots, from the host copies of the layers.
func expect(p *transfer.Plan, host map[region.Region][]byte) ([]byte, []uint32) {
	var file []byte
	sums := make([]uint32, p.Sums)
	for _, x := range p.Extents {
		b := host[x.Region][x.RegionOff : x.RegionOff+x.Len]
		file = append(file, b...)
		if x.Sum >= 0 {
			sums[x.Sum] = crc32c.Update(sums[x.Sum], b)
		}
	}
	return file, sums
}

// keyBlocks picks n distinct random block ids of numBlocks.
func keyBlocks(r *rand.Rand, numBlocks, n int) []int {
	return r.Perm(numBlocks)[:n]
}

func (g geometry) String() string {
	return fmt.Sprintf("%dx%dB", g.layers*g.blocksPerKey, g.pageBytes)
}

// llama8B is Llama-3.1-8B bf16 as vLLM pages it: 32 layers of 512 pages of
// 64 KiB, 16 blocks (256 tokens) per key, behind a 4 KiB header: a 32 MiB
// key is 512 scattered pages.
func llama8B() geometry {
	return geometry{layers: 32, numBlocks: 512, pageBytes: 64 << 10, blocksPerKey: 16, headerBytes: 4096}
}
