package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
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
	writeTestFile(t, file, []byte("\x00asm"))
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

// TestAMissingBareWasmFileIsTheBuiltInOfThatName: `kvhost --policy
// lru.wasm`, the usage line of the docs, serves the embedded lru where no
// such file is in the working directory (a file that is there is read
// from disk); a name with a path separator stays a file, and a file that
// is not a WebAssembly module is refused naming its path.
func TestAMissingBareWasmFileIsTheBuiltInOfThatName(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	builtinLRU, err := plugins.Wasm("lru")
	if err != nil {
		t.Fatal(err)
	}
	module, name, builtin, err := policyModule("lru.wasm")
	if err != nil || name != "lru" || !builtin || !bytes.Equal(module, builtinLRU) {
		t.Fatalf("lru.wasm, absent: %q builtin %v, %d bytes, %v; want the embedded lru", name, builtin, len(module), err)
	}
	if _, _, _, err := policyModule("no-such-builtin.wasm"); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("no-such-builtin.wasm: error %v, want one wrapping os.ErrNotExist", err)
	}
	if _, _, _, err := policyModule("./lru.wasm"); !errors.Is(err, os.ErrNotExist) || !strings.Contains(err.Error(), "./lru.wasm") {
		t.Fatalf("./lru.wasm: error %v, want one naming ./lru.wasm and wrapping os.ErrNotExist", err)
	}
	onDisk := []byte("\x00asm\x01\x00\x00\x00")
	writeTestFile(t, "lru.wasm", onDisk)
	if module, _, builtin, err := policyModule("lru.wasm"); err != nil || builtin || !bytes.Equal(module, onDisk) {
		t.Fatalf("lru.wasm, present: builtin %v, %d bytes, %v; want the file's", builtin, len(module), err)
	}
	writeTestFile(t, "notwasm.wasm", []byte("hello\n"))
	_, _, _, err = policyModule("notwasm.wasm")
	if !errors.Is(err, errNotWasm) || err.Error() != "policy notwasm.wasm: "+errNotWasm.Error() {
		t.Fatalf("notwasm.wasm: error %v, want %q", err, "policy notwasm.wasm: "+errNotWasm.Error())
	}
}

// TestConfigCheckRefusesAPolicyFileThatIsNotWasm: config check printed
// "ok" for a policy file the daemon's start refuses; one that does not
// exist here (it may exist only on the node) is not checked.
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
		{filepath.Join(dir, "elsewhere", "vendor.wasm"), 0, ": ok"},
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

// writeTestFile writes b to file, failing t where it cannot.
func writeTestFile(t *testing.T, file string, b []byte) {
	t.Helper()
	if err := os.WriteFile(file, b, 0o644); err != nil {
		t.Fatal(err)
	}
}
