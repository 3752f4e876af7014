package server_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/protocol"
)

// TestHelloVersions: the daemon answers a Hello of version 1 with a
// version-1 Welcome (no features: a version-1 client's decoder refuses
// bytes after the server name) and one of version 2 with a version-2
// Welcome announcing layer-range loads; it refuses other versions naming
// the ones it speaks, and closes the connection.
func TestHelloVersions(t *testing.T) {
	f := newFixture(t, server.Config{})
	for _, tc := range []struct {
		version  uint16
		features protocol.Feature
	}{
		{1, 0},
		{2, protocol.FeatureLayerLoads},
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
