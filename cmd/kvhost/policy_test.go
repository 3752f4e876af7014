package main

import (
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestPolicyCommand(t *testing.T) {
	const testdata = "../../host/policy/testdata/"
	tests := []struct {
		name     string
		args     []string
		code     int
		stdout   []string // substrings of stdout
		stderr   []string // substrings of stderr
		noStdout bool
	}{
		{"no args", []string{}, 2, nil, []string{"usage:", "kvhost policy test"}, true},
		{"unknown", []string{"frobnicate"}, 2, nil, []string{`unknown command "frobnicate"`}, true},
		{"--help", []string{"--help"}, 0, []string{"usage:", "kvhost policy inspect", "-json"}, nil, false},
		{"inspect --help", []string{"inspect", "--help"}, 0, []string{"usage:", "kvhost policy inspect", "-json"}, nil, false},
		{"test --help", []string{"test", "--help"}, 0, []string{"usage:", "kvhost policy test", "-json"}, nil, false},
		{"test -h after flags", []string{"test", "-shards", "3", "-h"}, 0, []string{"usage:", "-shards"}, nil, false},
		{"inspect builtin", []string{"inspect", "lru"}, 0,
			[]string{"abi version: 1", "features:    namespace", "kvhost_evict", "OK: lru implements ABI v1"}, nil, false},
		{"inspect missing export", []string{"inspect", testdata + "noevict.wasm"}, 1,
			[]string{"missing export kvhost_evict(i32) -> i32", "FAIL:"}, nil, false},
		{"inspect wrong abi", []string{"inspect", testdata + "wrongabi.wasm"}, 1,
			[]string{"abi version: 2", "kvhost_abi_version returned 2, want 1"}, nil, false},
		{"inspect unknown builtin", []string{"inspect", "nosuch"}, 1, nil, []string{"no built-in policy", `"nosuch"`}, true},
		{"test well-behaved", []string{"test", testdata + "wellbehaved.wasm"}, 0,
			[]string{"ok   pinned entries", "PASS: " + testdata + "wellbehaved.wasm: 25 passed, 0 failed"}, nil, false},
		{"test traversal", []string{"test", testdata + "traversal.wasm"}, 1,
			[]string{"FAIL names", `invalid path "../../etc/passwd"`, "FAIL: "}, nil, false},
		// Issue 85: a broken tiering rule is named by its own check, with
		// the rule, without -v.
		{"test tick past max", []string{"test", testdata + "tickmax.wasm"}, 1,
			[]string{"FAIL tick moves", "more than the 1 asked for", "rule: with FEATURE_TICK, a tick returns at most max moves", "FAIL: "}, nil, false},
		{"test loop", []string{"test", "-timeout", "30ms", testdata + "loop.wasm"}, 1,
			[]string{"exceeded the call deadline of 30ms"}, nil, false},
		{"test missing file", []string{"test", "nosuch/x.wasm"}, 1, nil, []string{"no such file"}, true},
		{"test bad flag", []string{"test", "-param", "novalue", "lru"}, 2, nil, []string{"want key=value"}, true},
		// Flags stop at NAME (Go's flag package): one after it is named, not
		// only answered with the usage.
		{"test flag after the plugin", []string{"test", "lru", "--json"}, 2, nil,
			[]string{`kvhost policy test: unexpected argument "--json" after lru (flags go before NAME|FILE.wasm)`, "usage:"}, true},
		{"inspect two plugins", []string{"inspect", "lru", "lfu"}, 2, nil, []string{`kvhost policy inspect: unexpected argument "lfu" after lru`}, true},
		{"test two plugins", []string{"test", "lru", "lfu"}, 2, nil, []string{`unexpected argument "lfu" after lru`}, true},
		// With the package's compilation cache: the daemons of earlier
		// tests compiled lru there (10 to 15 s under the race detector).
		{"test builtin", []string{"test", "-cache-dir", policyCache, "lru"}, 0, []string{"PASS: lru: 25 passed, 0 failed"}, nil, false},
		// Issue 11: a layout above 256 keys per file is a failed check, not a
		// Go panic; the report ends with the host's counters.
		{"test layout 300", []string{"test", testdata + "layout300.wasm"}, 1,
			[]string{"FAIL namespaces", "KeysPerFile 300 is outside [1, 256]", "rule: kvhost_namespace returns keys_per_file 1..256",
				"host stats: calls/records", "FAIL: "}, nil, false},
		{"test json", []string{"test", "--json", testdata + "refuse.wasm"}, 1,
			[]string{`"ok": false`, `"name": "admission"`, `"p99_us"`, `"stats"`}, nil, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			code := run(context.Background(), append([]string{"policy"}, tt.args...), &stdout, &stderr)
			if code != tt.code {
				t.Errorf("exit code %d, want %d\nstdout:\n%s\nstderr:\n%s", code, tt.code, &stdout, &stderr)
			}
			for _, s := range tt.stdout {
				if !strings.Contains(stdout.String(), s) {
					t.Errorf("stdout lacks %q:\n%s", s, &stdout)
				}
			}
			for _, s := range tt.stderr {
				if !strings.Contains(stderr.String(), s) {
					t.Errorf("stderr lacks %q:\n%s", s, &stderr)
				}
			}
			if tt.noStdout && stdout.Len() > 0 {
				t.Errorf("unexpected stdout:\n%s", &stdout)
			}
		})
	}
}

// TestPolicyTestCacheDirKeepsTheCompiledPlugin: kvhost policy test
// -cache-dir DIR keeps the compiled plugin in DIR, as the daemon's
// policy.cache_dir does, and a second run takes it from there without
// rewriting it; a DIR that cannot be a directory is refused, named.
func TestPolicyTestCacheDirKeepsTheCompiledPlugin(t *testing.T) {
	const plugin = "../../host/policy/testdata/wellbehaved.wasm"
	dir := filepath.Join(t.TempDir(), "cache")
	snapshot := func() map[string]int64 {
		t.Helper()
		files := map[string]int64{}
		err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return err
			}
			info, err := d.Info()
			if err != nil {
				return err
			}
			files[p] = info.ModTime().UnixNano()
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return files
	}
	policyTestRun := func(args ...string) (int, string, string) {
		var stdout, stderr bytes.Buffer
		code := run(context.Background(), append([]string{"policy", "test"}, args...), &stdout, &stderr)
		return code, stdout.String(), stderr.String()
	}
	if code, stdout, stderr := policyTestRun("-cache-dir", dir, plugin); code != 0 || !strings.Contains(stdout, "PASS: ") {
		t.Fatalf("first run: exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	first := snapshot()
	if len(first) == 0 {
		t.Fatalf("nothing compiled into %s", dir)
	}
	if code, stdout, stderr := policyTestRun("-cache-dir", dir, plugin); code != 0 || !strings.Contains(stdout, "PASS: ") {
		t.Fatalf("second run: exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	if second := snapshot(); fmt.Sprint(first) != fmt.Sprint(second) {
		t.Fatalf("the second run rewrote the cache:\n%v\n%v", first, second)
	}

	file := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr := policyTestRun("-cache-dir", file, plugin)
	if code != 1 || stdout != "" || !strings.Contains(stderr, "kvhost policy test: -cache-dir "+file) {
		t.Fatalf("-cache-dir on a file: exit %d, stdout %q, stderr %q; want 1 and an error naming it", code, stdout, stderr)
	}
}

// TestPolicyInspectRefusesAnUnknownFlagAsAUsageError: `kvhost policy
// inspect --bogus` is a usage error (exit 2, the flag named on stderr,
// nothing on stdout), not a built-in policy of that name that does not
// exist (exit 1); a plugin file whose name begins with '-' is inspected
// as ./-x.wasm, or after --, which ends the flags.
func TestPolicyInspectRefusesAnUnknownFlagAsAUsageError(t *testing.T) {
	plugin, err := os.ReadFile(filepath.Join("..", "..", "host", "policy", "testdata", "wellbehaved.wasm"))
	if err != nil {
		t.Fatal(err)
	}
	t.Chdir(t.TempDir())
	if err := os.WriteFile("-x.wasm", plugin, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []cmdLine{
		{[]string{"--bogus"}, 2, "", "-bogus"},
		{[]string{"--bogus", "lru"}, 2, "", "-bogus"},
		{[]string{"lru", "--bogus"}, 2, "", `unexpected argument "--bogus" after lru`},
		{[]string{"./-x.wasm"}, 0, "OK: ./-x.wasm", ""},
		{[]string{"--", "-x.wasm"}, 0, "OK: -x.wasm", ""},
	} {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			c.args = append([]string{"policy", "inspect"}, c.args...)
			c.check(t)
		})
	}
}
