package plugins

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"testing"
)

// wasmBuild builds the main package ./plugins/NAME/wasm into out with the
// command the Makefile's plugins/wasm/%.wasm rule runs.
func wasmBuild(t *testing.T, goBin, root, name, out string) []byte {
	t.Helper()
	cmd := exec.Command(goBin, "build", "-trimpath", "-buildmode=c-shared", "-o", out, "./plugins/"+name+"/wasm")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "GOOS=wasip1", "GOARCH=wasm", "GOFLAGS=")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building %s: %v\n%s", name, err, b)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

var goVersionRE = regexp.MustCompile(`go1\.[0-9]+(\.[0-9]+)?`)

// TestCommittedModulesMatchSources rebuilds every built-in policy from its
// source and compares the bytes with the committed plugins/wasm/NAME.wasm,
// which `go build ./cmd/kvhost` embeds as it is: a plugin changed without
// `make plugins` would otherwise ship its old module.
func TestCommittedModulesMatchSources(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("go is not on PATH: cannot rebuild the built-in modules to compare them with the committed ones")
	}
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	names := Names()
	if len(names) == 0 {
		t.Fatal("no built-in module is embedded: plugins/wasm/*.wasm are committed; run `make plugins`")
	}
	sources, err := filepath.Glob(filepath.Join(root, "plugins", "*", "wasm", "main.go"))
	if err != nil {
		t.Fatal(err)
	}
	if len(sources) != len(names) {
		t.Errorf("%d plugins/*/wasm sources, %d committed modules (%v): run `make plugins` and commit plugins/wasm/*.wasm",
			len(sources), len(names), names)
	}
	dir := t.TempDir()

	// The comparison means something only when the build is reproducible:
	// two builds of one source, to different paths, give the same bytes.
	first := wasmBuild(t, goBin, root, names[0], filepath.Join(dir, "a.wasm"))
	if second := wasmBuild(t, goBin, root, names[0], filepath.Join(dir, "b.wasm")); !bytes.Equal(first, second) {
		t.Fatalf("two builds of %s differ (%d and %d bytes): the build is not reproducible here", names[0], len(first), len(second))
	}

	for _, name := range names {
		t.Run(name, func(t *testing.T) {
			built := wasmBuild(t, goBin, root, name, filepath.Join(dir, name+".wasm"))
			committed, err := Wasm(name)
			if err != nil {
				t.Fatal(err)
			}
			if bytes.Equal(built, committed) {
				return
			}
			msg := "plugins/wasm/%s.wasm (%d bytes) differs from a build of ./plugins/%s/wasm (%d bytes): " +
				"run `make plugins` and commit plugins/wasm/*.wasm"
			args := []any{name, len(committed), name, len(built)}
			if was, now := goVersionRE.Find(committed), goVersionRE.Find(built); !bytes.Equal(was, now) {
				msg += " (the committed module was built with %s, this go is %s; runtime %s)"
				args = append(args, was, now, runtime.Version())
			}
			t.Errorf(msg, args...)
		})
	}
}

// TestEveryBuiltinHasItsNativeBuild checks that each embedded module has
// a native build of the same name, which serves while the
// module compiles.
func TestEveryBuiltinHasItsNativeBuild(t *testing.T) {
	for _, name := range Names() {
		newPolicy, ok := Native(name)
		if !ok {
			t.Errorf("built-in %s has no native build", name)
			continue
		}
		if p := newPolicy(); p == nil {
			t.Errorf("the native build of %s is nil", name)
		}
	}
	if _, ok := Native("no-such-policy"); ok {
		t.Error("Native knows a policy that is not built in")
	}
}
