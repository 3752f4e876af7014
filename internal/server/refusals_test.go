package server_test

import (
	"context"
	"errors"
	"maps"
	"testing"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/protocol"
)

// TestRefusalsAreCountedByTheirBound: a request refused with limit
// exceeded is counted under the bound that refused it (its configuration
// key, or the protocol's per-connection limit), and under no other.
func TestRefusalsAreCountedByTheirBound(t *testing.T) {
	ctx := context.Background()
	register := func(t *testing.T, c *client.Client) error {
		mem, err := client.NewMemfd("refused", 4096)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { mem.Close() })
		_, err = c.RegisterMemfd(ctx, mem)
		return err
	}
	declare := func(t *testing.T, c *client.Client, i int) error {
		_, err := c.Declare(ctx, throwaway(i))
		return err
	}
	tests := []struct {
		limit  string
		cfg    server.Config
		engine func(*engine.Config)                 // edits the engine's configuration, if not nil
		twice  func(t *testing.T, f *fixture) error // succeeds once, then is refused
	}{
		{"server.max_clients", server.Config{MaxClients: 1}, nil, func(t *testing.T, f *fixture) error {
			f.dial(t)
			_, err := client.Dial(ctx, f.socket, "second")
			return err
		}},
		{"server.max_registrations", server.Config{MaxRegistrations: 1}, nil, func(t *testing.T, f *fixture) error {
			c := f.dial(t)
			register(t, c)
			return register(t, c)
		}},
		{"server.max_descriptors", server.Config{MaxDescriptors: 1, MaxDescriptorsPerPeer: 1}, nil, func(t *testing.T, f *fixture) error {
			c := f.dial(t)
			register(t, c)
			return register(t, c)
		}},
		{"server.max_namespaces_per_peer", server.Config{MaxNamespacesPerPeer: 1}, nil, func(t *testing.T, f *fixture) error {
			c := f.dial(t)
			declare(t, c, 0)
			return declare(t, c, 1)
		}},
		{"namespaces_per_connection", server.Config{MaxNamespaces: 1, MaxNamespacesPerPeer: 2}, nil, func(t *testing.T, f *fixture) error {
			c := f.dial(t)
			declare(t, c, 0)
			return declare(t, c, 1)
		}},
		{"server.max_cache_layers", server.Config{MaxCacheLayers: tallLayers, MaxCacheLayersPerPeer: tallLayers}, nil, func(t *testing.T, f *fixture) error {
			registerTall(t, f.dial(t))
			_, err := registerTall(t, f.dial(t))
			return err
		}},
		{"namespaces_per_daemon", server.Config{}, func(cfg *engine.Config) { cfg.MaxNamespaces = 1 }, func(t *testing.T, f *fixture) error {
			declare(t, f.dial(t), 0)
			return declare(t, f.dial(t), 1)
		}},
	}
	for _, tc := range tests {
		t.Run(tc.limit, func(t *testing.T) {
			f := newFixtureWith(t, tc.cfg, tc.engine, nil)
			if err := tc.twice(t, f); !errors.Is(err, &protocol.Error{Code: protocol.CodeLimit}) {
				t.Fatalf("the second request: %v, want limit exceeded", err)
			}
			got := f.srv.Stats().Refusals
			if want := map[string]uint64{tc.limit: 1}; !maps.Equal(got, want) {
				t.Errorf("refusals counted %v, want %v", got, want)
			}
		})
	}
}
