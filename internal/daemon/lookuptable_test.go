package daemon

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/internal/daemon/hostpath"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/plugins/lru"
)

// TestTheLookupTableIsReadableByWhoeverMayConnectToTheSocket: connecting
// to a Unix socket takes write permission on it, so the table is readable
// by the classes (owner, group, others) socket_mode lets write, and only
// by them.
func TestTheLookupTableIsReadableByWhoeverMayConnectToTheSocket(t *testing.T) {
	eng, log := openLookupTestEngine(t)
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

// TestARelativeSocketsLookupTableIsNamedAbsolutely: clients are told the
// table's path and do not share the daemon's working directory, against
// which a relative socket is bound: the table's path is absolute.
func TestARelativeSocketsLookupTableIsNamedAbsolutely(t *testing.T) {
	eng, log := openLookupTestEngine(t)
	dir := t.TempDir()
	t.Chdir(dir)
	cfg := config.Default()
	cfg.Server.Socket = filepath.Join("run", "kvhost.sock")
	tab, err := openLookupTable(cfg, eng, log)
	if err != nil {
		t.Fatal(err)
	}
	defer tab.Close()
	if want := filepath.Join(dir, "run", "kvhost.sock.lookup"); tab.Path() != want {
		t.Fatalf("the table clients are told of: %q, want %q", tab.Path(), want)
	}
}

// openLookupTestEngine opens an engine on a mount of its own with the
// native lru, closed when t ends, and its logger.
func openLookupTestEngine(t *testing.T) (*engine.Engine, *slog.Logger) {
	t.Helper()
	ctx := context.Background()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	eng, err := engine.Open(ctx, engine.Config{
		Host:   hostpath.Staging,
		Mounts: []engine.Mount{{Path: filepath.Join(t.TempDir(), "blocks")}},
		NewPolicy: func(idx policy.Index) (policy.Policy, error) {
			return policy.NewNative(func() guest.Policy { return lru.New() }, idx, policy.Config{Shards: 1})
		},
		Logger: log,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close(ctx) })
	return eng, log
}
