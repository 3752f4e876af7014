package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/internal/config"
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

// TestConfigCheckRefusesAPolicyFileThatIsNotWasm: config check printed
// "ok" for a policy file the daemon's start refuses: one that is not a
// WebAssembly module, and one that does not exist here (named at its
// line, with the hint to check on the node where it may exist).
func TestConfigCheckRefusesAPolicyFileThatIsNotWasm(t *testing.T) {
	dir := t.TempDir()
	notwasm := filepath.Join(dir, "notwasm.wasm")
	writeTestFile(t, notwasm, []byte("hello\n"))
	tests := []struct {
		policy string
		code   int
		want   string
	}{
		{notwasm, 1, "policy.name: policy " + notwasm + ": not a WebAssembly module"},
		{filepath.Join(dir, "elsewhere", "vendor.wasm"), 1, ":2: policy.name: plugin " + filepath.Join(dir, "elsewhere", "vendor.wasm") + ": no such file here"},
	}
	for i, tt := range tests {
		file := filepath.Join(dir, fmt.Sprintf("c%d.toml", i))
		writeTestFile(t, file, []byte(fmt.Sprintf("[policy]\nname = %q\n", tt.policy)))
		var out, errb bytes.Buffer
		code := runConfig(context.Background(), []string{"check", file}, &out, &errb)
		if code != tt.code || !strings.Contains(out.String()+errb.String(), tt.want) {
			t.Errorf("config check, policy %s: exit %d, stdout %q, stderr %q; want %d and %q", tt.policy, code, out.String(), errb.String(), tt.code, tt.want)
		}
	}
}

// writeTestFile writes b to file, failing t where it cannot.
func writeTestFile(t *testing.T, file string, b []byte) {
	t.Helper()
	if err := os.WriteFile(file, b, 0o644); err != nil {
		t.Fatal(err)
	}
}
