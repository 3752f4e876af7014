package main

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/internal/testsock"
	"github.com/kvhost/kvhost/protocol"
)

// TestAMountWithNoRoomIsNamedByHealthStatsAndMetrics runs the daemon on a
// mount whose reserve is more than its file system holds, as a file
// system filled from outside leaves it: capacity 0, so every store there
// fails. The start warns once, naming the mount; after a store fails,
// kvhost_mount_stores_failing is 1 for the mount, kvhost stats and
// kvhost health name it and the store's error, and health still exits 0
// (unless --allow-failing-mounts=false), as /healthz and /readyz still
// answer 200: a restart would not give the file system room.
func TestAMountWithNoRoomIsNamedByHealthStatsAndMetrics(t *testing.T) {
	dir := testsock.Dir(t)
	socket := filepath.Join(dir, "run", "kvhost.sock")
	cache := filepath.Join(dir, "blocks")
	file := filepath.Join(dir, "kvhost.toml")
	src := fmt.Sprintf("[server]\nsocket = %q\n\n[log]\nformat = \"json\"\n\n[policy]\ncache_dir = %q\n\n[[mount]]\npath = %q\nreserve = \"1000TiB\"\n",
		socket, policyCache, cache)
	if err := os.WriteFile(file, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*hangBound) // a hang guard
	defer cancel()
	addr, stderr := serveWithMetrics(t, ctx, file, socket)

	var warned []string
	for _, l := range strings.Split(stderr.String(), "\n") {
		if strings.Contains(l, `"level":"WARN"`) && strings.Contains(l, cache) {
			warned = append(warned, l)
		}
	}
	if len(warned) != 1 || !strings.Contains(warned[0], "no room") || !strings.Contains(warned[0], "reserve") {
		t.Errorf("the start's warnings naming the mount: %q; want one saying it has no room and what to change (reserve)", warned)
	}

	k := newKVCache(t, socket)
	res, err := k.do(ctx, true, "refused", []uint32{0, 1})
	if err != nil {
		t.Fatal(err)
	}
	if res.Count(protocol.OutcomeFailed) != 1 {
		t.Fatalf("store on a mount with no room: %+v, want its key failed", res)
	}

	if got := metricValue(scrapeMetrics(t, addr), "kvhost_mount_stores_failing", "mount", cache); got != 1 {
		t.Errorf("kvhost_mount_stores_failing{mount=%q} = %v, want 1", cache, got)
	}
	st := statsJSON(t, ctx, socket)
	if len(st.Mounts) != 1 || st.Mounts[0].StoresFailing == nil || !strings.Contains(st.Mounts[0].StoresFailing.Err, "no space") {
		t.Errorf("kvhost stats --json mounts: %+v; want the mount's stores failing, with the error", st.Mounts)
	}
	var out, errb bytes.Buffer
	if code := run(ctx, []string{"stats", "--socket", socket}, &out, &errb); code != 0 || !strings.Contains(out.String(), "STORES FAILING") {
		t.Errorf("kvhost stats: exit %d:\n%s%s\nwant the mount's stores failing named", code, out.String(), errb.String())
	}
	for _, tc := range []struct {
		args []string
		code int
	}{
		{nil, 0},
		{[]string{"--quiet"}, 0},
		{[]string{"--allow-failing-mounts=false"}, 1},
	} {
		var out, errb bytes.Buffer
		code := run(ctx, append([]string{"health", "--socket", socket}, tc.args...), &out, &errb)
		msg := out.String() + errb.String()
		if code != tc.code || !strings.Contains(msg, cache) || !strings.Contains(msg, "no space") {
			t.Errorf("kvhost health %v: exit %d, %q; want %d, naming the mount %s and its error", tc.args, code, msg, tc.code, cache)
		}
	}
	for _, path := range []string{"/healthz", "/readyz"} {
		if code, body := httpGet(t, addr, path); code != http.StatusOK {
			t.Errorf("%s with a mount refusing stores: %d %q; want 200", path, code, body)
		}
	}
}
