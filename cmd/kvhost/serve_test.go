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

// TestARelativePluginPathThatIsMissingNamesTheWorkingDirectory: a
// policy.name of "vendor.wasm" is read against the daemon's working
// directory, not the configuration file's (under systemd, /), and the
// start's error said only "open vendor.wasm: no such file or
// directory", leaving the operator to guess where it was looked for.
func TestARelativePluginPathThatIsMissingNamesTheWorkingDirectory(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	_, _, _, err := policyModule("vendor.wasm")
	if !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("error %v, want one wrapping os.ErrNotExist", err)
	}
	want := "policy: open vendor.wasm: no such file or directory (a relative path is taken against the working directory, " + dir + ", not the configuration file's)"
	if err.Error() != want {
		t.Fatalf("error %q, want %q", err, want)
	}
	// An absolute path needs no such note.
	missing := filepath.Join(dir, "missing.wasm")
	if _, _, _, err := policyModule(missing); err == nil || err.Error() != "policy: open "+missing+": no such file or directory" {
		t.Fatalf("error %v for an absolute path", err)
	}
}
