package client_test

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/kvhost/kvhost/client"
)

// testGeometry is small: 512-byte blocks (the engine's minimum), 2 blocks
// per key, 4 KiB per key.
var testGeometry = client.Geometry{
	Model: "test-model", Layers: 2, KVHeads: 1, HeadSize: 64, DtypeSize: 2,
	TokensPerBlock: 4, TokensPerKey: 8, TPSize: 1,
}

const testBlocks = 64

// testCache is a paged cache in a memfd, registered on one connection:
// layer l, plane p, block b at l*2*testBlocks*bb + p*testBlocks*bb + b*bb.
type testCache struct {
	c     *client.Client
	mem   *client.Memfd
	ns    client.Namespace
	cache client.CacheID
	bb    int64
}

func newTestCache(t testing.TB, c *client.Client) *testCache {
	t.Helper()
	ctx := context.Background()
	g := testGeometry
	bb := g.BlockBytes()
	mem, err := client.NewMemfd("kvhost-test", int64(g.Layers)*2*testBlocks*bb)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mem.Close() })
	rid, err := c.RegisterMemfd(ctx, mem)
	if err != nil {
		t.Fatal(err)
	}
	ns, err := c.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	layers := make([]client.Layer, g.Layers)
	for l := range layers {
		layers[l] = client.Layer{Region: uint32(rid), NumBlocks: testBlocks, Offset: int64(l) * 2 * testBlocks * bb, BlockStride: bb, PlaneStride: testBlocks * bb}
	}
	cid, err := c.RegisterCache(ctx, ns.ID, layers)
	if err != nil {
		t.Fatal(err)
	}
	return &testCache{c: c, mem: mem, ns: ns, cache: cid, bb: bb}
}

// segments returns the bytes of every (layer, plane, block) of blocks, in
// a fixed order.
func (tc *testCache) segments(blocks []uint32) [][]byte {
	mem := tc.mem.Bytes()
	var segs [][]byte
	for l := 0; l < int(testGeometry.Layers); l++ {
		for p := 0; p < 2; p++ {
			for _, b := range blocks {
				off := int64(l)*2*testBlocks*tc.bb + int64(p)*testBlocks*tc.bb + int64(b)*tc.bb
				segs = append(segs, mem[off:off+tc.bb])
			}
		}
	}
	return segs
}

// fill writes random bytes into blocks and returns them.
func (tc *testCache) fill(rng *rand.Rand, blocks []uint32) []byte {
	var all []byte
	for _, s := range tc.segments(blocks) {
		for i := range s {
			s[i] = byte(rng.Uint32())
		}
		all = append(all, s...)
	}
	return all
}

func (tc *testCache) read(blocks []uint32) []byte {
	var all []byte
	for _, s := range tc.segments(blocks) {
		all = append(all, s...)
	}
	return all
}

func (tc *testCache) zero(blocks []uint32) {
	for _, s := range tc.segments(blocks) {
		clear(s)
	}
}

// roundTrip stores n random keys named prefix-i from the first blocks,
// loads them back into other blocks and compares.
func (tc *testCache) roundTrip(t testing.TB, rng *rand.Rand, prefix string, n int) [][]byte {
	t.Helper()
	ctx := context.Background()
	bpk := tc.ns.BlocksPerKey
	keys := make([][]byte, n)
	src := make([][]uint32, n)
	dst := make([][]uint32, n)
	want := make([][]byte, n)
	for i := range keys {
		keys[i] = fmt.Appendf(nil, "%s-%d", prefix, i)
		for j := 0; j < bpk; j++ {
			src[i] = append(src[i], uint32(i*bpk+j))
			dst[i] = append(dst[i], uint32(testBlocks/2+i*bpk+j))
		}
		want[i] = tc.fill(rng, src[i])
	}
	job, err := tc.c.Store(ctx, tc.cache, keys, src)
	if err != nil {
		t.Fatal(err)
	}
	res, err := job.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := res.Err(); err != nil || res.Count(client.OutcomeStored)+res.Count(client.OutcomePresent) != n {
		t.Fatalf("store: %v outcomes %v", err, res.Keys)
	}
	if got, err := tc.c.Lookup(ctx, tc.ns.ID, keys); err != nil || got != n {
		t.Fatalf("lookup: %d, %v; want %d", got, err, n)
	}
	for i := range dst {
		tc.zero(dst[i])
	}
	job, err = tc.c.Load(ctx, tc.cache, keys, dst)
	if err != nil {
		t.Fatal(err)
	}
	if res, err = job.Wait(ctx); err != nil || res.Count(client.OutcomeLoaded) != n {
		t.Fatalf("load: %v outcomes %v (%s)", err, res.Keys, res.Message)
	}
	for i := range dst {
		if got := tc.read(dst[i]); !bytes.Equal(got, want[i]) {
			t.Fatalf("key %s: loaded bytes differ from stored ones", keys[i])
		}
	}
	return keys
}

// load loads key into the upper blocks and returns its bytes, or nil when
// it is not loaded.
func (tc *testCache) load(t testing.TB, key []byte) []byte {
	t.Helper()
	ctx := context.Background()
	dst := make([]uint32, tc.ns.BlocksPerKey)
	for j := range dst {
		dst[j] = uint32(testBlocks - tc.ns.BlocksPerKey + j)
	}
	tc.zero(dst)
	job, err := tc.c.Load(ctx, tc.cache, [][]byte{key}, [][]uint32{dst})
	if err != nil {
		t.Fatal(err)
	}
	res, err := job.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if res.Keys[0].Outcome != client.OutcomeLoaded {
		return nil
	}
	return tc.read(dst)
}
