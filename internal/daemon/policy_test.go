package daemon

import (
	"bytes"
	"context"
	"errors"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/host/policy/policytest"
	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/internal/testwasm"
	"github.com/kvhost/kvhost/plugins"
)

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
			_, name, builtin, err := Module(c.arg)
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
	module, name, builtin, err := Module("lru.wasm")
	if err != nil || name != "lru" || !builtin || !bytes.Equal(module, builtinLRU) {
		t.Fatalf("lru.wasm, absent: %q builtin %v, %d bytes, %v; want the embedded lru", name, builtin, len(module), err)
	}
	if _, _, _, err := Module("no-such-builtin.wasm"); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("no-such-builtin.wasm: error %v, want one wrapping os.ErrNotExist", err)
	}
	if _, _, _, err := Module("./lru.wasm"); !errors.Is(err, os.ErrNotExist) || !strings.Contains(err.Error(), "./lru.wasm") {
		t.Fatalf("./lru.wasm: error %v, want one naming ./lru.wasm and wrapping os.ErrNotExist", err)
	}
	onDisk := []byte("\x00asm\x01\x00\x00\x00")
	writeTestFile(t, "lru.wasm", onDisk)
	if module, _, builtin, err := Module("lru.wasm"); err != nil || builtin || !bytes.Equal(module, onDisk) {
		t.Fatalf("lru.wasm, present: builtin %v, %d bytes, %v; want the file's", builtin, len(module), err)
	}
	writeTestFile(t, "notwasm.wasm", []byte("hello\n"))
	_, _, _, err = Module("notwasm.wasm")
	if !errors.Is(err, ErrNotWasm) || err.Error() != "policy notwasm.wasm: "+ErrNotWasm.Error() {
		t.Fatalf("notwasm.wasm: error %v, want %q", err, "policy notwasm.wasm: "+ErrNotWasm.Error())
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
	_, _, _, err := Module("vendor.wasm")
	if !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("error %v, want one wrapping os.ErrNotExist", err)
	}
	want := "policy: open vendor.wasm: no such file or directory (a relative path is taken against the working directory, " + dir + ", not the configuration file's)"
	if err.Error() != want {
		t.Fatalf("error %q, want %q", err, want)
	}
	// An absolute path needs no such note.
	missing := filepath.Join(dir, "missing.wasm")
	if _, _, _, err := Module(missing); err == nil || err.Error() != "policy: open "+missing+": no such file or directory" {
		t.Fatalf("error %v for an absolute path", err)
	}
}

// TestFailingPluginFallsBackToAMountAwarePolicy: a plugin that keeps
// failing falls back to tiered on a daemon with several kvhost mounts
// (it demotes; lru would delete and send every file to mount 0, issue 37)
// and to lru on a daemon with one.
func TestFailingPluginFallsBackToAMountAwarePolicy(t *testing.T) {
	kv := func(p string) config.Mount { return config.Mount{Path: p} }
	vllm := config.Mount{Path: "/v", Layout: config.LayoutVLLMFS}
	tests := []struct {
		name   string
		mounts []config.Mount
		want   string
		demote bool
	}{
		{"one mount", []config.Mount{kv("/a")}, "lru", false},
		{"memory and disk", []config.Mount{kv("/a"), kv("/b")}, "tiered", true},
		{"one kvhost mount and a vllm-fs mount", []config.Mount{kv("/a"), vllm}, "lru", false},
	}
	traversal := filepath.Join("..", "..", "host", "policy", "testdata", "traversal.wasm")
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			cfg := config.Config{Mounts: tt.mounts}
			cfg.Policy.Name, cfg.Policy.Shards, cfg.Policy.CacheDir = traversal, 1, t.TempDir()
			b, err := Build(ctx, cfg, BuildOptions{})
			if err != nil {
				t.Fatal(err)
			}
			idx := policytest.NewIndex()
			p, err := b.New(idx)
			if err != nil {
				t.Fatalf("%v (build the fixtures with `make wasm`)", err)
			}
			defer p.Close(ctx)
			if err := b.Host().WaitLoaded(ctx); err != nil { // the fallback serves until the plugin has loaded
				t.Fatal(err)
			}
			ns := abi.NamespaceRecord{Fingerprint: 1, MountCount: uint32(len(tt.mounts)), KeyBytes: 1}
			rec := abi.NameRecord{Fingerprint: 1, MountCount: ns.MountCount}
			rec.SetKey([]byte("k"))
			for range policy.DefaultMaxFailures {
				p.Name(ctx, []abi.NameRecord{rec}) // the traversal plugin fails each time
			}
			st := b.Host().Stats()
			if !st.Fallback || st.FallbackPolicy != tt.want || p.Features().Has(abi.FeatureDemote) != tt.demote {
				t.Fatalf("fallback %v to %q, demotes %v; want a fallback to %q, demotes %v",
					st.Fallback, st.FallbackPolicy, p.Features().Has(abi.FeatureDemote), tt.want, tt.demote)
			}
		})
	}
}

// TestTheFallbackTakesTheParamsItKnows: the fallback gets the keys of
// [policy.params] it reads and names the others.
func TestTheFallbackTakesTheParamsItKnows(t *testing.T) {
	params := map[string]any{"x": 2, "keys_per_file": 2, "mount": 1, "hot": 1}
	tests := []struct {
		name    string
		mounts  []config.Mount
		want    string
		params  map[string]string
		ignored []string
	}{
		{"one mount", []config.Mount{{Path: "/a"}}, "lru",
			map[string]string{"keys_per_file": "2", "mount": "1"}, []string{"hot", "x"}},
		{"two mounts", []config.Mount{{Path: "/a"}, {Path: "/b"}}, "tiered",
			map[string]string{"keys_per_file": "2", "hot": "1"}, []string{"mount", "x"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := config.Config{Mounts: tt.mounts}
			cfg.Policy.Params = params
			fb := FallbackFor(cfg)
			if fb.Name != tt.want || !maps.Equal(fb.Params, tt.params) || !slices.Equal(fb.Ignored, tt.ignored) {
				t.Fatalf("fallback %s with %v, ignoring %v; want %s with %v, ignoring %v",
					fb.Name, fb.Params, fb.Ignored, tt.want, tt.params, tt.ignored)
			}
		})
	}
}

// TestSingleMountPolicyIsNamedOnlyWithSeveralKvhostMounts: a policy
// without admission to a mount or demotion is reported when it is given
// two kvhost mounts, never with one (a vllm-fs mount beside it does not
// count) nor when it places files by mount.
func TestSingleMountPolicyIsNamedOnlyWithSeveralKvhostMounts(t *testing.T) {
	one := []config.Mount{{Path: "/a"}}
	two := []config.Mount{{Path: "/a"}, {Path: "/b"}}
	withFS := []config.Mount{{Path: "/a"}, {Path: "/v", Layout: config.LayoutVLLMFS}}
	for _, tc := range []struct {
		name   string
		f      abi.Feature
		mounts []config.Mount
		warn   bool
	}{
		{"lru, two mounts", abi.FeatureNamespace, two, true},
		{"native lru (no features), two mounts", 0, two, true},
		{"lru, one mount", abi.FeatureNamespace, one, false},
		{"lru, one mount and a vllm-fs mount", abi.FeatureNamespace, withFS, false},
		{"tiered, two mounts", abi.FeatureNamespace | abi.FeatureAdmit | abi.FeatureMounts | abi.FeatureAdmitMount | abi.FeatureDemote | abi.FeatureTick, two, false},
		{"admission to a mount only, two mounts", abi.FeatureAdmitMount, two, false},
		{"demotion only, two mounts", abi.FeatureDemote, two, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			why := SingleMountPolicy("lru", nil, tc.f, tc.mounts)
			if (why != "") != tc.warn {
				t.Fatalf("SingleMountPolicy = %q, want a warning: %v", why, tc.warn)
			}
			if tc.warn && (!strings.Contains(why, "/a") || !strings.Contains(why, "tiered")) {
				t.Errorf("the warning %q names neither the first mount nor the tiered policy", why)
			}
		})
	}
}

// TestSingleMountPolicyNamesTheMountItsMountParamPicks: lru with
// policy.params.mount = 1 places every file on the second kvhost mount
// (the policy's mounts count from 0), and the warning names that mount,
// not the first; without the parameter, or with one naming no mount, it
// names the first.
func TestSingleMountPolicyNamesTheMountItsMountParamPicks(t *testing.T) {
	mounts := []config.Mount{{Path: "/hot"}, {Path: "/cold"}, {Path: "/v", Layout: config.LayoutVLLMFS}}
	for _, tc := range []struct {
		name     string
		params   map[string]any
		want     string
		wantNot  string
		wantText string
	}{
		{"no mount param", nil, "/hot", "/cold", "the first mount"},
		{"mount = 0", map[string]any{"mount": int64(0)}, "/hot", "/cold", "mount 0"},
		{"mount = 1", map[string]any{"mount": int64(1)}, "/cold", "/hot", "mount 1"},
		{"mount = 1 as a string", map[string]any{"mount": "1"}, "/cold", "/hot", "mount 1"},
		{"mount = 2 (the vllm-fs mount is not the policy's)", map[string]any{"mount": int64(2)}, "/hot", "/cold", "the first mount"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			why := SingleMountPolicy("lru", tc.params, abi.FeatureNamespace, mounts)
			if !strings.Contains(why, tc.want) || strings.Contains(why, tc.wantNot) || !strings.Contains(why, tc.wantText) {
				t.Fatalf("the warning %q: want it to name %s as %q and not %s", why, tc.want, tc.wantText, tc.wantNot)
			}
			if tc.want != "/hot" && strings.Contains(why, "first") {
				t.Errorf("the warning %q says first of a policy placing on mount 1", why)
			}
		})
	}
}

// writeTestFile writes b to file, failing t where it cannot.
func writeTestFile(t *testing.T, file string, b []byte) {
	t.Helper()
	if err := os.WriteFile(file, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestBuiltinServesItsNativeBuildWhileItsModuleLoads: a daemon's start
// does not wait for a built-in policy's module to compile (seconds
// without the compilation cache): the policy's native build serves at
// once, and the module replaces it once loaded.
func TestBuiltinServesItsNativeBuildWhileItsModuleLoads(t *testing.T) {
	ctx := context.Background()
	cfg := config.Default()
	cfg.Policy.Name, cfg.Policy.Shards, cfg.Policy.CacheDir = "lfu", 2, testwasm.Dir()
	if cfg.Policy.CacheDir == "" {
		cfg.Policy.CacheDir = t.TempDir()
	}
	b, err := Build(ctx, cfg, BuildOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p, err := b.New(policytest.NewIndex())
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close(ctx)
	if st := b.Host().Stats(); !st.Loading || st.Backend != "native" {
		t.Fatalf("right after the start: loading %v, backend %q; want lfu's native build serving while its module loads", st.Loading, st.Backend)
	}
	if err := b.Host().WaitLoaded(ctx); err != nil {
		t.Fatal(err)
	}
	if st := b.Host().Stats(); st.Loading || st.Backend != "wasm" || st.Fallback {
		t.Fatalf("once loaded: loading %v, backend %q, fallback %v; want the module serving", st.Loading, st.Backend, st.Fallback)
	}
}
