package main

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/plugins"
)

// TestExampleConfig checks that examples/kvhost.toml is accepted as
// `kvhost --config examples/kvhost.toml` reads it.
func TestExampleConfig(t *testing.T) {
	c, err := config.Load(filepath.Join("..", "..", "examples", "kvhost.toml"))
	if err != nil {
		t.Fatal(err)
	}
	if c.Server.Socket != config.Default().Server.Socket || c.Server.SocketMode != 0o660 || len(c.Mounts) != 1 || c.Mounts[0].Capacity != 10<<30 {
		t.Fatalf("example config read as %+v", c)
	}
}

func TestPolicyModule(t *testing.T) {
	file := filepath.Join(t.TempDir(), "vendor.wasm")
	if err := os.WriteFile(file, []byte("\x00asm"), 0o644); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		arg     string
		name    string
		builtin bool
		err     error
	}{
		{"lru", "lru", true, nil},
		{file, "vendor", false, nil},
		{"no-such-policy", "", false, plugins.ErrUnknown},
		{filepath.Join(t.TempDir(), "missing.wasm"), "", false, os.ErrNotExist},
	}
	for _, c := range cases {
		t.Run(filepath.Base(c.arg), func(t *testing.T) {
			_, name, builtin, err := policyModule(c.arg)
			if c.err != nil {
				if !errors.Is(err, c.err) {
					t.Fatalf("error %v, want %v", err, c.err)
				}
				return
			}
			if err != nil || name != c.name || builtin != c.builtin {
				t.Fatalf("got %q %v %v", name, builtin, err)
			}
		})
	}
}
