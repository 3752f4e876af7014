//go:build invariants

package engine

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io/fs"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/testlog"
	"github.com/kvhost/kvhost/region"
)

// smallGeometry: 4 layers, K and V, 4 blocks per key. With aligned set a
// block is 4 KiB (O_DIRECT straight from memory); otherwise 2560 bytes
// (bounce buffers on O_DIRECT mounts, and tail padding in files).
func smallGeometry(aligned bool) Geometry {
	g := Geometry{Model: "test/model", Layers: 4, KVHeads: 2, HeadSize: 64, DtypeSize: 2, TokensPerBlock: 16, TokensPerKey: 64, TPSize: 1}
	if !aligned {
		g.HeadSize = 40
	}
	return g
}

// Cache layouts of a layer tensor.
const (
	layoutPlaneFirst = iota // [2, num_blocks, ...] (vLLM flash-attn)
	layoutBlockFirst        // [num_blocks, 2, ...] (flashinfer)
)

// testCache is a paged KV cache in a memfd region: one tensor per layer.
type testCache struct {
	id     CacheID
	geo    Geometry
	reg    *region.Host
	layers []LayerTensor
}

func newTestCache(t testing.TB, e *Engine, ns NamespaceID, g Geometry, numBlocks, layout int) *testCache {
	t.Helper()
	c, err := makeTestCache(e, ns, g, numBlocks, layout)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.reg.Close() })
	return c
}

// makeTestCache is newTestCache without a testing.TB (for child processes);
// the caller closes c.reg.
func makeTestCache(e *Engine, ns NamespaceID, g Geometry, numBlocks, layout int) (*testCache, error) {
	bb := g.BlockBytes()
	perLayer := int64(g.Planes()) * int64(numBlocks) * bb
	perLayer = (perLayer + 4095) / 4096 * 4096
	reg, err := region.NewHost("kv", perLayer*int64(g.Layers))
	if err != nil {
		return nil, err
	}
	c := &testCache{geo: g, reg: reg}
	for l := range g.Layers {
		lt := LayerTensor{Region: reg, Offset: int64(l) * perLayer, NumBlocks: numBlocks}
		if layout == layoutPlaneFirst {
			lt.BlockStride, lt.PlaneStride = bb, int64(numBlocks)*bb
		} else {
			lt.BlockStride, lt.PlaneStride = int64(g.Planes())*bb, bb
		}
		c.layers = append(c.layers, lt)
	}
	if c.id, err = e.RegisterCache(ns, c.layers); err != nil {
		reg.Close()
		return nil, err
	}
	return c, nil
}

func (c *testCache) block(l, p, b int) []byte {
	t := c.layers[l]
	off := t.Offset + int64(p)*t.PlaneStride + int64(b)*t.BlockStride
	return c.reg.Bytes()[off : off+c.geo.BlockBytes()]
}

// fill writes random bytes into the blocks.
func (c *testCache) fill(r *rand.Rand, blocks []int) {
	for l := range c.geo.Layers {
		for p := range c.geo.Planes() {
			for _, b := range blocks {
				blk := c.block(l, p, b)
				i := 0
				for ; i+8 <= len(blk); i += 8 {
					binary.LittleEndian.PutUint64(blk[i:], r.Uint64())
				}
				for ; i < len(blk); i++ {
					blk[i] = byte(r.Uint32())
				}
			}
		}
	}
}

// data returns the bytes of a key's blocks, layer by layer.
func (c *testCache) data(blocks []int) []byte {
	var out []byte
	for l := range c.geo.Layers {
		for p := range c.geo.Planes() {
			for _, b := range blocks {
				out = append(out, c.block(l, p, b)...)
			}
		}
	}
	return out
}

func (c *testCache) clear(blocks []int) {
	for l := range c.geo.Layers {
		for p := range c.geo.Planes() {
			for _, b := range blocks {
				clear(c.block(l, p, b))
			}
		}
	}
}

func testKeys(prefix string, n int) [][]byte {
	keys := make([][]byte, n)
	for i := range keys {
		keys[i] = fmt.Appendf(nil, "%s-%04d", prefix, i)
	}
	return keys
}

// blockLists gives key i the blocks [first+i*bpk, first+(i+1)*bpk), shuffled.
func blockLists(r *rand.Rand, n, bpk, first int) [][]int {
	out := make([][]int, n)
	for i := range out {
		for b := range bpk {
			out[i] = append(out[i], first+i*bpk+b)
		}
		r.Shuffle(bpk, func(a, b int) { out[i][a], out[i][b] = out[i][b], out[i][a] })
	}
	return out
}

func testLogger(t testing.TB) *slog.Logger { return testlog.New(t) }

func openEngine(t testing.TB, cfg Config) *Engine {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	if cfg.IOWorkers == 0 {
		cfg.IOWorkers = 2
	}
	e, err := testOpen(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		e.Close(context.Background())
		// Every test's engine ends with its parts consistent.
		if err := e.check(); err != nil {
			t.Error(err)
		}
		// And takes its spare owner files with it.
		for _, m := range e.mounts {
			mine, _ := filepath.Glob(filepath.Join(m.root, ownerPrefix+"*-"+e.own.token))
			if len(mine) != 0 {
				t.Errorf("owner files left after Close: %v", mine)
			}
		}
	})
	return e
}

// wait returns a function that waits for the job a Store or Load returned:
// wait(t)(e.Store(ctx, req)).
func wait(t testing.TB) func(*Job, error) Result {
	return func(j *Job, err error) Result {
		t.Helper()
		return waitJob(t, j, err)
	}
}

func waitJob(t testing.TB, j *Job, err error) Result {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	res, _ := j.Wait(ctx)
	if ctx.Err() != nil {
		t.Fatal("job did not finish")
	}
	return res
}

func wantOutcomes(t testing.TB, what string, res Result, want Outcome) {
	t.Helper()
	for i, k := range res.Keys {
		if k.Outcome != want {
			t.Fatalf("%s: key %d: %v (%v), want %v", what, i, k.Outcome, k.Err, want)
		}
	}
}

// storeAndCheck stores keys and requires every one stored.
func storeAndCheck(t testing.TB, e *Engine, c *testCache, keys [][]byte, blocks [][]int) {
	t.Helper()
	res := wait(t)(e.Store(context.Background(), StoreRequest{Cache: c.id, Keys: keys, Blocks: blocks}))
	wantOutcomes(t, "store", res, OutcomeStored)
}

// loadAndCompare loads keys into fresh blocks and compares with want.
func loadAndCompare(t testing.TB, e *Engine, c *testCache, keys [][]byte, into [][]int, want [][]byte) {
	t.Helper()
	for _, b := range into {
		c.clear(b)
	}
	res := wait(t)(e.Load(context.Background(), LoadRequest{Cache: c.id, Keys: keys, Blocks: into}))
	wantOutcomes(t, "load", res, OutcomeLoaded)
	for i := range keys {
		if !bytes.Equal(c.data(into[i]), want[i]) {
			t.Fatalf("key %s: loaded bytes differ", keys[i])
		}
	}
}

// leftovers lists the temporary files and spares under dir (not the owner
// files of engines, whose own tests check them: ownerFiles).
func leftovers(t testing.TB, dir string) []string {
	t.Helper()
	var out []string
	filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err == nil && strings.HasPrefix(d.Name(), ".") && !strings.HasPrefix(d.Name(), ownerPrefix) && !isJournal(d.Name()) && !isModelBook(d.Name()) && !d.IsDir() {
			out = append(out, path)
		}
		return nil
	})
	return out
}

// dataFiles lists the published files under dir.
func dataFiles(t testing.TB, dir string) []string {
	t.Helper()
	var out []string
	filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && !strings.HasPrefix(d.Name(), ".") {
			out = append(out, path)
		}
		return nil
	})
	return out
}

// shmDir returns a fresh directory on tmpfs, or "" if there is none.
func shmDir(t testing.TB) string {
	if st, err := os.Stat("/dev/shm"); err != nil || !st.IsDir() {
		return ""
	}
	d, err := os.MkdirTemp("/dev/shm", "kvhost-test-")
	if err != nil {
		return ""
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

var _ fsys.FS = fsys.OS{}
