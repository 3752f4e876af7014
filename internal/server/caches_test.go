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

// tallLayers is the most layers a cache registration carries
// (protocol.MaxLayers).
const tallLayers = 4096

// tallGeo is a geometry of tallLayers layers, of a block per key.
var tallGeo = client.Geometry{Model: "tall", Layers: tallLayers, KVHeads: 1, HeadSize: 64, DtypeSize: 2, TokensPerBlock: 4, TokensPerKey: 4, TPSize: 1}

// registerTall registers on c a cache of tallGeo, every layer a block of
// one memfd, and returns its id or the error it got.
func registerTall(tb testing.TB, c *client.Client) (client.CacheID, error) {
	tb.Helper()
	bb := tallGeo.BlockBytes()
	_, rid := registerMemfd(tb, c, "tall", 2*bb)
	_, id, err := registerCache(tb, c, tallGeo, func(int) client.Layer {
		return client.Layer{Region: uint32(rid), NumBlocks: 1, BlockStride: bb, PlaneStride: bb}
	})
	return id, err
}

// TestOneProcessCannotRegisterEveryCacheLayer: the layers of one
// process's caches, on all its connections, are bounded by
// server.max_cache_layers_per_peer (each costs the daemon some 52 bytes:
// a connection's 64 caches of 4096 layers hold 13 MiB, a process's 32
// connections 418 MiB). A cache beyond it is refused with limit exceeded
// naming the key; another process still registers one; a cache
// unregistered or closed gives its layers back.
func TestOneProcessCannotRegisterEveryCacheLayer(t *testing.T) {
	const perPeer = 2 * tallLayers
	f := newFixture(t, server.Config{MaxCacheLayers: 3 * tallLayers, MaxCacheLayersPerPeer: perPeer})
	ctx := context.Background()
	a, b := f.dial(t), f.dial(t)
	first, err := registerTall(t, a)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := registerTall(t, b); err != nil {
		t.Fatal(err)
	}
	_, err = registerTall(t, b)
	if held := f.srv.Stats().CacheLayers; held > perPeer {
		t.Errorf("one process's caches hold %d layers, more than server.max_cache_layers_per_peer (%d)", held, perPeer)
	}
	var pe *protocol.Error
	if !errors.As(err, &pe) || pe.Code != protocol.CodeLimit || !strings.Contains(pe.Message, "server.max_cache_layers_per_peer") {
		t.Fatalf("a cache beyond the process's layers: %v, want limit exceeded naming server.max_cache_layers_per_peer", err)
	}
	otherProcess(t, f, peerStoreEnv+"=1") // registers a cache of its own

	if err := a.UnregisterCache(ctx, first); err != nil {
		t.Fatal(err)
	}
	if _, err := registerTall(t, b); err != nil {
		t.Fatalf("a cache once another was unregistered: %v", err)
	}
	b.Close()
	if err := f.srv.WaitSessions(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if st := f.srv.Stats(); st.CacheLayers != 0 || st.CacheLayerLimit != 3*tallLayers {
		t.Errorf("the daemon counts %d cache layers of %d once the caches were unregistered or closed, want 0 of %d", st.CacheLayers, st.CacheLayerLimit, 3*tallLayers)
	}
}
