package main

import (
	"bytes"
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/testwait"
)

// TestAReloadKeepsTheFallbackOfTheRunningMounts: mounts change only at a
// restart, so a reload that changes the policy and drops a mount from
// the file builds the new policy's native fallback for the mounts that
// run: tiered on two, although the file now names one.
func TestAReloadKeepsTheFallbackOfTheRunningMounts(t *testing.T) {
	traversal, err := filepath.Abs(filepath.Join("..", "..", "host", "policy", "testdata", "traversal.wasm"))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	policy := fmt.Sprintf("name = %q\n", traversal) // a plugin that fails every name
	hot := fmt.Sprintf("[[mount]]\npath = %q\ncapacity = \"256MiB\"\n", filepath.Join(dir, "hot"))
	file, socket, _ := testConfig(t, dir, policy+"\n"+hot)
	p := startProc(t, nil, "serve", "--config", file)

	writeConfig(t, file, socket, filepath.Join(dir, "blocks"), policy+"\n[policy.params]\nkeys_per_file = 1\n")
	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"reload", "--socket", socket}, &out, &errb); code != 0 ||
		!strings.Contains(out.String(), "changed: policy") || !strings.Contains(out.String(), "needs restart: mount") {
		t.Fatalf("kvhost reload: exit %d, stdout %q, stderr %q", code, out.String(), errb.String())
	}
	k := newKVCache(t, socket)
	var st client.Stats
	testwait.Until(t, "the reloaded policy to fall back", hangBound, func() bool {
		k.do(context.Background(), true, "k", []uint32{0, 1}) // fails while the plugin runs
		st = daemonStats(t, socket)
		return st.Daemon.Fallback
	})
	if st.Daemon.FallbackPolicy != "tiered" {
		t.Fatalf("the reloaded policy fell back to %q on a daemon running two mounts, want tiered", st.Daemon.FallbackPolicy)
	}
	p.stderr.logLine(t, "reload done")
}
