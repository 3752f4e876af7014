package server_test

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/protocol"
)

// TestHelloVersions: the daemon answers a Hello of version 1 with a
// version-1 Welcome (no features: a version-1 client's decoder refuses
// bytes after the server name) and one of version 2 with a version-2
// Welcome announcing layer-range loads and removal streams; it refuses other versions naming
// the ones it speaks, and closes the connection.
func TestHelloVersions(t *testing.T) {
	f := newFixture(t, server.Config{})
	for _, tc := range []struct {
		version  uint16
		features protocol.Feature
	}{
		{1, 0},
		{2, protocol.FeatureLayerLoads | protocol.FeatureRemovals},
	} {
		r := f.raw(t)
		r.send(1, &protocol.Hello{Version: tc.version})
		_, m, err := r.recv()
		if err != nil {
			t.Fatalf("version %d: %v", tc.version, err)
		}
		w, ok := m.(*protocol.Welcome)
		if !ok || w.Version != tc.version || w.Features != tc.features {
			t.Fatalf("version %d answered with %#v, want a Welcome of version %d, features %#x", tc.version, m, tc.version, uint64(tc.features))
		}
	}
	for _, v := range []uint16{0, protocol.Version + 1} {
		r := f.raw(t)
		r.send(1, &protocol.Hello{Version: v})
		_, m, err := r.recv()
		if e, ok := m.(*protocol.Error); err != nil || !ok || e.Code != protocol.CodeVersion || !strings.Contains(e.Message, "this daemon speaks 1 to 2") {
			t.Fatalf("version %d answered with %#v, %v; want unsupported version naming 1 to 2", v, m, err)
		}
		r.expectClosed()
	}
}

// TestLoadLayersRefusals: a LoadLayers whose range passes the
// namespace's layers is refused as invalid, naming the range and the
// layer count; one whose range no namespace can have is malformed,
// naming it; both keep the connection, which goes on serving.
func TestLoadLayersRefusals(t *testing.T) {
	f := newFixture(t, server.Config{})
	c := f.dial(t)
	if !c.Supports(client.FeatureLayerLoads) {
		t.Fatalf("the daemon's Welcome %+v announces no layer-range loads", c.Limits())
	}
	k := newCache(t, c)
	ctx := context.Background()
	key := [][]byte{[]byte("k")}
	for _, r := range []struct{ first, count int }{{1, 2}, {2, 1}, {0, 3}} {
		_, err := c.LoadLayers(ctx, k.id, key, [][]uint32{{4, 5}}, r.first, r.count)
		var pe *protocol.Error
		if !errors.As(err, &pe) || pe.Code != protocol.CodeInvalid ||
			!strings.Contains(pe.Message, "layer range first") || !strings.Contains(pe.Message, "2 layers") {
			t.Fatalf("layers [%d, %d) of a 2-layer namespace: %v; want invalid argument naming the range and 2 layers", r.first, r.first+r.count, err)
		}
	}
	if n, err := c.Lookup(ctx, k.ns.ID, key); n != 0 || err != nil {
		t.Fatalf("lookup after the refusals: %d, %v", n, err)
	}

	raw := f.raw(t)
	raw.hello()
	for i, lr := range []protocol.LayerRange{{First: 2, Count: 0}, {First: protocol.MaxLayers, Count: 1}, {First: 0xFFFFFFFF, Count: 2}} {
		lr := lr
		raw.send(uint64(10+i), &protocol.Transfer{Kind: protocol.JobLoad, Cache: 1, Keys: key, Blocks: [][]uint32{{0, 1}}, Layers: &lr})
		_, m, err := raw.recv()
		if e, ok := m.(*protocol.Error); err != nil || !ok || e.Code != protocol.CodeMalformed || !strings.Contains(e.Message, "layer range first") {
			t.Fatalf("%s: %#v, %v; want malformed naming the range", lr, m, err)
		}
	}
	raw.send(20, &protocol.StatsRequest{})
	if _, m, err := raw.recv(); err != nil || m.Type() != protocol.TypeStats|protocol.TypeReply {
		t.Fatalf("stats after the refusals: %#v, %v", m, err)
	}
}

// TestLoadLayersLoadsOnlyThoseLayers: a LoadLayers through the socket
// writes the named layers of the named blocks with the stored bytes, and
// no other byte of the cache; NoBlock leaves a block out as in a Load;
// count 0 loads every layer. The completion counts the bytes loaded.
func TestLoadLayersLoadsOnlyThoseLayers(t *testing.T) {
	f := newFixture(t, server.Config{})
	c := f.dial(t)
	g := geo
	g.Model, g.Layers = "layers", 4
	bb := g.BlockBytes()
	mem, rid := registerMemfd(t, c, "layers", int64(g.Layers)*2*numBlocks*bb)
	_, id, err := registerCache(t, c, g, planesFirst(rid, numBlocks, bb))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	buf := mem.Bytes()
	rng := rand.New(rand.NewPCG(8, 4))
	for i := range buf {
		buf[i] = byte(rng.UintN(256))
	}
	stored := bytes.Clone(buf)
	keys := [][]byte{[]byte("a"), []byte("b")}
	job, err := c.Store(ctx, id, keys, [][]uint32{{0, 1}, {2, 3}})
	if err != nil {
		t.Fatal(err)
	}
	if res, err := job.Wait(ctx); err != nil || res.Count(client.OutcomeStored) != 2 {
		t.Fatalf("store: %+v %v", res, err)
	}
	// at is the offset of layer l, plane p, block b of the cache.
	at := func(l, p int, b uint32) int64 {
		return int64(l)*2*numBlocks*bb + int64(p)*numBlocks*bb + int64(b)*bb
	}
	for _, tc := range []struct {
		name         string
		first, count int
		blocks       [][]uint32
		from         map[uint32]uint32 // loaded block -> the stored block whose bytes it gets
	}{
		{"layers 1 and 2", 1, 2, [][]uint32{{10, 11}, {12, 13}}, map[uint32]uint32{10: 0, 11: 1, 12: 2, 13: 3}},
		{"the last layer, from inside a key", 3, 1, [][]uint32{{client.NoBlock, 14}, {15, 16}}, map[uint32]uint32{14: 1, 15: 2, 16: 3}},
		{"the first layer, ending inside a key", 0, 1, [][]uint32{{17, 18}, {19, client.NoBlock}}, map[uint32]uint32{17: 0, 18: 1, 19: 2}},
		{"count 0: every layer", 0, 0, [][]uint32{{20, 21}, {22, 23}}, map[uint32]uint32{20: 0, 21: 1, 22: 2, 23: 3}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for i := range buf {
				buf[i] = 0xC3
			}
			want := bytes.Clone(buf)
			layers := tc.count
			if layers == 0 {
				layers = int(g.Layers)
			}
			for to, from := range tc.from {
				for l := tc.first; l < tc.first+layers; l++ {
					for p := range 2 {
						copy(want[at(l, p, to):at(l, p, to)+bb], stored[at(l, p, from):at(l, p, from)+bb])
					}
				}
			}
			job, err := c.LoadLayers(ctx, id, keys, tc.blocks, tc.first, tc.count)
			if err != nil {
				t.Fatal(err)
			}
			res, err := job.Wait(ctx)
			if err != nil || res.Count(client.OutcomeLoaded) != 2 {
				t.Fatalf("load: %+v %v", res, err)
			}
			if n := int64(len(tc.from)) * int64(layers) * 2 * bb; res.Bytes != n {
				t.Fatalf("the completion says %d bytes, want the %d of the layers and blocks loaded", res.Bytes, n)
			}
			if !bytes.Equal(buf, want) {
				t.Fatal("the cache's bytes are not the named layers of the named blocks loaded and the rest untouched")
			}
		})
	}
}
