package main

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/host/engine"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/plugins/lru"
)

// TestTheLookupTableIsReadableByWhoeverMayConnectToTheSocket: connecting
// to a Unix socket takes write permission on it, so the table is readable
// by the classes (owner, group, others) socket_mode lets write, and only
// by them.
func TestTheLookupTableIsReadableByWhoeverMayConnectToTheSocket(t *testing.T) {
	ctx := context.Background()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	dir := t.TempDir()
	eng, err := engine.Open(ctx, engine.Config{
		Mounts: []engine.Mount{{Path: filepath.Join(dir, "blocks")}},
		NewPolicy: func(idx policy.Index) (policy.Policy, error) {
			return policy.NewNative(func() guest.Policy { return lru.New() }, idx, policy.Config{Shards: 1})
		},
		Logger: log,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close(ctx)
	for _, tc := range []struct {
		socket, table os.FileMode
	}{
		{0o600, 0o400},
		{0o660, 0o440},
		{0o666, 0o444},
		{0o640, 0o400}, // the group may read the socket but not connect
		{0o620, 0o440},
	} {
		t.Run(tc.socket.String(), func(t *testing.T) {
			cfg := config.Default()
			cfg.Server.Socket = filepath.Join(t.TempDir(), "kvhost.sock")
			cfg.Server.SocketMode = config.FileMode(tc.socket)
			tab, err := openLookupTable(cfg, eng, log)
			if err != nil {
				t.Fatal(err)
			}
			defer tab.Close()
			fi, err := os.Stat(tab.Path())
			if err != nil {
				t.Fatal(err)
			}
			if fi.Mode().Perm() != tc.table {
				t.Fatalf("socket_mode %v: the table's mode is %v, want %v", tc.socket, fi.Mode().Perm(), tc.table)
			}
		})
	}
}
