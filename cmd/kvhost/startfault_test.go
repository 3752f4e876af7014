package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/internal/testsock"
)

// TestStartFaultsOfAKeyNameTheKeyAndWhereItWasSet: a policy.name that is
// no built-in policy, a [policy.params] key the policy's kvhost_init
// refuses and a server.socket_group this machine lacks stop the daemon's
// start (exit 2, a configuration error) with an error that reads as the configuration's
// own errors do (docs/config.md): "config: FILE:LINE: KEY: ..." (or the
// flag that gave the value), with the fix where there is one.
func TestStartFaultsOfAKeyNameTheKeyAndWhereItWasSet(t *testing.T) {
	dir := t.TempDir()
	socket := filepath.Join(testsock.Dir(t), "run", "kvhost.sock")
	head := fmt.Sprintf("[server]\nsocket = %q\n", socket)
	tail := fmt.Sprintf("\n[log]\nformat = \"json\"\n\n[[mount]]\npath = %q\ncapacity = \"64MiB\"\n", filepath.Join(dir, "blocks"))
	for _, tt := range []struct {
		name  string
		extra string // after the [server] table's socket, line 3 on
		args  []string
		want  string // "FILE" stands for the file's path
	}{
		{"unknown policy", "\n[policy]\nname = \"lruu\"\n", nil,
			`config: FILE:5: policy.name: plugins: no built-in policy of that name: "lruu"`},
		{"unknown policy from the flag", "", []string{"--policy", "lruu"},
			`config: policy.name (from --policy): plugins: no built-in policy of that name: "lruu"`},
		{"a param the policy refuses", "\n[policy]\nname = \"lru\"\n\n[policy.params]\nkeys_per_fil = 8\n", nil,
			`config: FILE:8: policy.params.keys_per_fil: policy lru: kvhost_init (shard 0)`},
		{"unknown socket group", "socket_group = \"kvhost-no-such-group\"\n", nil,
			"config: FILE:3: server.socket_group: group: unknown group kvhost-no-such-group: " + server.UnknownGroupFix},
	} {
		t.Run(tt.name, func(t *testing.T) {
			file := filepath.Join(t.TempDir(), "kvhost.toml")
			if err := os.WriteFile(file, []byte(head+tt.extra+tail), 0o644); err != nil {
				t.Fatal(err)
			}
			var out, errb bytes.Buffer
			if code := runServe(t.Context(), append([]string{"--config", file}, tt.args...), &out, &errb); code != 2 {
				t.Fatalf("exit %d, want 2; stderr:\n%s", code, errb.String())
			}
			got := stoppedErr(t, errb.Bytes())
			if want := strings.ReplaceAll(tt.want, "FILE", file); !strings.HasPrefix(got, want) || strings.Count(got, "policy lru:") > 1 {
				t.Errorf("the daemon stopped with\n%s\nwant it to begin\n%s\n(naming the policy once)", got, want)
			}
		})
	}
}

// stoppedErr is the error a daemon's start stopped on: its stderr's last
// line, "kvhost: ERROR", plain whatever the log's format (no log record
// says it).
func stoppedErr(t *testing.T, stderr []byte) string {
	t.Helper()
	lines := strings.Split(strings.TrimSuffix(string(stderr), "\n"), "\n")
	last := lines[len(lines)-1]
	var rec map[string]any
	if json.Unmarshal([]byte(last), &rec) == nil || !strings.HasPrefix(last, "kvhost: ") {
		t.Fatalf("stderr does not end with a plain \"kvhost: ERROR\" line:\n%s", stderr)
	}
	return strings.TrimPrefix(last, "kvhost: ")
}

// TestFatalStartErrorsAreOneLineWithTheirExitStatus: the daemon's start
// stopping on its configuration exits 2, on anything else (here a mount
// directory it cannot make) 1; either way the error is one plain line on
// stderr, "kvhost: ERROR", after the JSON log's records, naming the
// file or flag and the cause. A policy refused at start is the only line
// the start prints.
func TestFatalStartErrorsAreOneLineWithTheirExitStatus(t *testing.T) {
	dir := t.TempDir()
	notwasm := filepath.Join(dir, "notwasm.wasm")
	writeTestFile(t, notwasm, []byte("hello\n"))
	blocker := filepath.Join(dir, "a-file")
	writeTestFile(t, blocker, nil)
	socket := filepath.Join(testsock.Dir(t), "kvhost.sock")
	for _, tt := range []struct {
		name string
		args []string
		code int
		want string
		only bool // the error is all of stderr
	}{
		{"a policy file that is not wasm", []string{"--policy", notwasm, "--dir", filepath.Join(dir, "blocks")}, 2,
			"config: policy.name (from --policy): policy " + notwasm + ": not a WebAssembly module", true},
		{"a mount that cannot be made", []string{"--dir", filepath.Join(blocker, "blocks")}, 1,
			"mount " + filepath.Join(blocker, "blocks") + ": ", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			args := append([]string{"--socket", socket, "--log-format", "json"}, tt.args...)
			if code := runServe(t.Context(), args, &out, &errb); code != tt.code {
				t.Fatalf("exit %d, want %d; stderr:\n%s", code, tt.code, errb.String())
			}
			if got := stoppedErr(t, errb.Bytes()); !strings.HasPrefix(got, tt.want) {
				t.Errorf("the daemon stopped with\n%s\nwant it to begin\n%s", got, tt.want)
			}
			if n := strings.Count(errb.String(), "\n"); tt.only && n != 1 {
				t.Errorf("stderr has %d lines, want the error alone:\n%s", n, errb.String())
			}
		})
	}
}
