package main

import (
	"bufio"
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
// start (exit 1) with an error that reads as the configuration's
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
			if code := runServe(t.Context(), append([]string{"--config", file}, tt.args...), &out, &errb); code != 1 {
				t.Fatalf("exit %d, want 1; stderr:\n%s", code, errb.String())
			}
			got := stoppedErr(t, errb.Bytes())
			if want := strings.ReplaceAll(tt.want, "FILE", file); !strings.HasPrefix(got, want) || strings.Count(got, "policy lru:") > 1 {
				t.Errorf("the daemon stopped with\n%s\nwant it to begin\n%s\n(naming the policy once)", got, want)
			}
		})
	}
}

// stoppedErr is the error of the "kvhost stopped" line of a daemon's JSON
// log.
func stoppedErr(t *testing.T, log []byte) string {
	t.Helper()
	sc := bufio.NewScanner(bytes.NewReader(log))
	for sc.Scan() {
		var line struct{ Msg, Err string }
		if json.Unmarshal(sc.Bytes(), &line) == nil && line.Msg == "kvhost stopped" {
			return line.Err
		}
	}
	t.Fatalf("no \"kvhost stopped\" line in the log:\n%s", log)
	return ""
}
