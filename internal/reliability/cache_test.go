package reliability

// A client's paged cache in a memfd and the deterministic payloads the
// scenarios store: every key's bytes are a function of the key, so any
// load can be checked without remembering what was stored.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"math/rand/v2"

	"github.com/kvhost/kvhost/client"
)

// geometry is small: 512-byte blocks (the engine's minimum), 2 blocks per
// key, 2 layers, K and V planes: 4 KiB per key.
var geometry = client.Geometry{
	Model: "reliability-model", Layers: 2, KVHeads: 1, HeadSize: 64, DtypeSize: 2,
	TokensPerBlock: 4, TokensPerKey: 8, TPSize: 1,
}

// keyBytes is the payload of one key in geometry.
const keyBytes = 4096

// payload returns the n bytes every scenario stores for key: a ChaCha8
// stream seeded with the key's SHA-256.
func payload(key []byte, n int) []byte {
	b := make([]byte, n)
	rand.NewChaCha8(sha256.Sum256(key)).Read(b)
	return b
}

// kvCache is a paged cache of slots, one key's blocks each, in a memfd
// registered on one connection: layer l, plane p, block b lives at
// l·2·N·bb + p·N·bb + b·bb for N blocks of bb bytes.
type kvCache struct {
	c     *client.Client
	mem   *client.Memfd
	ns    client.Namespace
	id    client.CacheID
	bb    int64
	bpk   int
	slots int
}

// newCache registers a cache of slots key slots on c in the namespace of
// g. The memfd is closed when the cache is.
func newCache(ctx context.Context, c *client.Client, g client.Geometry, slots int) (*kvCache, error) {
	bb := g.BlockBytes()
	bpk := g.BlocksPerKey()
	blocks := int64(slots * bpk)
	mem, err := client.NewMemfd("kvhost-reliability", int64(g.Layers)*2*blocks*bb)
	if err != nil {
		return nil, err
	}
	k := &kvCache{c: c, mem: mem, bb: bb, bpk: bpk, slots: slots}
	rid, err := c.RegisterMemfd(ctx, mem)
	if err != nil {
		mem.Close()
		return nil, fmt.Errorf("register memory: %w", err)
	}
	if k.ns, err = c.Declare(ctx, g); err != nil {
		mem.Close()
		return nil, fmt.Errorf("declare: %w", err)
	}
	layers := make([]client.Layer, g.Layers)
	for l := range layers {
		layers[l] = client.Layer{Region: uint32(rid), NumBlocks: uint32(blocks), Offset: int64(l) * 2 * blocks * bb, BlockStride: bb, PlaneStride: blocks * bb}
	}
	if k.id, err = c.RegisterCache(ctx, k.ns.ID, layers); err != nil {
		mem.Close()
		return nil, fmt.Errorf("register cache: %w", err)
	}
	return k, nil
}

// close unmaps the cache's memory (the connection must be closed first or
// the cache unregistered: the daemon maps the same memfd).
func (k *kvCache) close() { k.mem.Close() }

// blocks returns the block ids of slot s.
func (k *kvCache) blocks(s int) []uint32 {
	b := make([]uint32, k.bpk)
	for j := range b {
		b[j] = uint32(s*k.bpk + j)
	}
	return b
}

// segments returns the bytes of every (layer, plane, block) of slot s in
// payload order.
func (k *kvCache) segments(s int) [][]byte {
	mem := k.mem.Bytes()
	n := int64(k.slots * k.bpk)
	var segs [][]byte
	for l := 0; l < int(geometry.Layers); l++ {
		for p := int64(0); p < 2; p++ {
			for _, b := range k.blocks(s) {
				off := int64(l)*2*n*k.bb + p*n*k.bb + int64(b)*k.bb
				segs = append(segs, mem[off:off+k.bb])
			}
		}
	}
	return segs
}

// put writes key's payload into slot s.
func (k *kvCache) put(s int, key []byte) {
	want := payload(key, keyBytes)
	off := 0
	for _, seg := range k.segments(s) {
		off += copy(seg, want[off:])
	}
}

// clear zeroes slot s.
func (k *kvCache) clear(s int) {
	for _, seg := range k.segments(s) {
		clear(seg)
	}
}

// holds reports whether slot s holds key's payload.
func (k *kvCache) holds(s int, key []byte) bool {
	want := payload(key, keyBytes)
	off := 0
	for _, seg := range k.segments(s) {
		if !bytes.Equal(seg, want[off:off+len(seg)]) {
			return false
		}
		off += len(seg)
	}
	return true
}

// store stores keys from slots 0..len(keys)-1, filled with their payloads,
// and waits for the job. The error is non-nil when no completion arrived.
func (k *kvCache) store(ctx context.Context, keys [][]byte) (client.Result, error) {
	blocks := make([][]uint32, len(keys))
	for i, key := range keys {
		k.put(i, key)
		blocks[i] = k.blocks(i)
	}
	job, err := k.c.Store(ctx, k.id, keys, blocks)
	if err != nil {
		return client.Result{}, err
	}
	return job.Wait(ctx)
}

// loadResult is what a load found for each key.
type loadResult struct {
	outcomes []client.Outcome
	codes    []uint8 // the protocol code of a failed key
	match    []bool  // loaded and byte for byte the key's payload
	message  string
}

// load loads keys into the upper slots (len(keys) ≤ slots/2), zeroed
// first, and checks every loaded key's bytes.
func (k *kvCache) load(ctx context.Context, keys [][]byte) (loadResult, error) {
	base := k.slots / 2
	if len(keys) > k.slots-base {
		return loadResult{}, fmt.Errorf("load of %d keys into %d slots", len(keys), k.slots-base)
	}
	blocks := make([][]uint32, len(keys))
	for i := range keys {
		k.clear(base + i)
		blocks[i] = k.blocks(base + i)
	}
	job, err := k.c.Load(ctx, k.id, keys, blocks)
	if err != nil {
		return loadResult{}, err
	}
	res, err := job.Wait(ctx)
	if err != nil {
		return loadResult{}, err
	}
	if len(res.Keys) != len(keys) {
		return loadResult{}, fmt.Errorf("load of %d keys completed with %d outcomes", len(keys), len(res.Keys))
	}
	r := loadResult{outcomes: make([]client.Outcome, len(keys)), codes: make([]uint8, len(keys)), match: make([]bool, len(keys)), message: res.Message}
	for i, kr := range res.Keys {
		r.outcomes[i] = kr.Outcome
		r.codes[i] = uint8(kr.Code)
		r.match[i] = kr.Outcome == client.OutcomeLoaded && k.holds(base+i, keys[i])
	}
	return r, nil
}

// dialCache dials socket and registers a cache of slots on the connection.
func dialCache(ctx context.Context, socket, name string, slots int) (*client.Client, *kvCache, error) {
	return dialGeometry(ctx, socket, name, geometry, slots)
}

// dialGeometry is dialCache in the namespace of g.
func dialGeometry(ctx context.Context, socket, name string, g client.Geometry, slots int) (*client.Client, *kvCache, error) {
	c, err := client.Dial(ctx, socket, name)
	if err != nil {
		return nil, nil, err
	}
	k, err := newCache(ctx, c, g, slots)
	if err != nil {
		c.Close()
		return nil, nil, err
	}
	return c, k, nil
}
