package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/client"
)

// TestMetricsMoveDuringAnEndToEndRun runs the daemon in this process with
// --metrics on a free port, stores and loads through a client, and scrapes
// /metrics (parsed with the Prometheus text parser) before and after:
// the counters, gauges and histograms of the run move. kvhost stats and
// kvhost health read the same daemon, and every log line is JSON with
// durations as strings.
func TestMetricsMoveDuringAnEndToEndRun(t *testing.T) {
	dir := t.TempDir()
	file, socket, cache := testConfig(t, dir, "")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stdout, stderr, exit := runInProcess(ctx, "serve", "--config", file, "--metrics", "127.0.0.1:0")
	addr, _ := stderr.logLine(t, "metrics listening")["address"].(string)
	stdout.wait(t, "listening line", func(s string) bool { return s == "kvhost: listening on unix:"+socket })

	before := scrapeMetrics(t, addr)
	for _, c := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"kvhost_ready", nil, 1},
		{"kvhost_stored_keys_total", nil, 0},
		{"kvhost_clients", nil, 0},
		{"kvhost_policy_info", []string{"policy", "lru"}, 1},
		{"kvhost_policy_fallback", nil, 0},
	} {
		if got := metricValue(before, c.name, c.labels...); got != c.want {
			t.Errorf("before: %s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}

	k := newKVCache(t, socket)
	rng := rand.New(rand.NewPCG(1, 2))
	const keys = 3
	for i := range keys {
		if err := k.roundTrip(ctx, fmt.Sprintf("key-%d", i), []uint32{uint32(2 * i), uint32(2*i + 1)}, rng); err != nil {
			t.Fatal(err)
		}
	}
	if res, err := k.do(ctx, false, "absent", []uint32{100, 101}); err != nil || res.Keys[0].Outcome.String() != "missing" {
		t.Fatalf("load of an absent key: %v %v", res.Keys, err)
	}
	keyBytes := float64(int64(opsGeo.Layers) * 2 * 2 * opsGeo.BlockBytes()) // layers × K,V × 2 blocks

	after := scrapeMetrics(t, addr)
	for _, c := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"kvhost_stored_keys_total", nil, keys},
		{"kvhost_loaded_keys_total", nil, keys},
		{"kvhost_keys", nil, keys},
		{"kvhost_written_bytes_total", nil, keys * keyBytes},
		{"kvhost_jobs_total", []string{"direction", "store", "memory", "host", "path", "staging"}, keys},
		{"kvhost_jobs_total", []string{"direction", "load", "memory", "host", "path", "staging"}, keys + 1},
		{"kvhost_job_bytes_total", []string{"direction", "load"}, keys * keyBytes},
		{"kvhost_job_duration_seconds", []string{"direction", "store"}, keys},
		{"kvhost_job_keys_total", []string{"direction", "load", "outcome", "missing"}, 1},
		{"kvhost_job_keys_total", []string{"direction", "store", "outcome", "stored"}, keys},
		{"kvhost_clients", nil, 1},
		{"kvhost_registered_regions", nil, 1},
		{"kvhost_registered_bytes", nil, float64(len(k.mem.Bytes()))},
		{"kvhost_request_duration_seconds", []string{"request", "declare"}, 1},
		{"kvhost_request_duration_seconds", []string{"request", "register-cache"}, 1},
		{"kvhost_mount_used_bytes", []string{"mount", cache}, -2}, // checked below
	} {
		got := metricValue(after, c.name, c.labels...)
		if c.want == -2 {
			if got <= 0 {
				t.Errorf("after: %s%v = %v, want > 0", c.name, c.labels, got)
			}
			continue
		}
		if got != c.want {
			t.Errorf("after: %s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	if metricValue(after, "kvhost_policy_calls_total", "hook", "kvhost_name") <= 0 ||
		metricValue(after, "kvhost_policy_call_duration_seconds", "hook", "kvhost_name") <= 0 {
		t.Error("policy calls not counted or timed")
	}
	if metricValue(after, "kvhost_staging_buffers_limit") <= 0 || metricValue(after, "kvhost_staging_buffers_in_use") != 0 {
		t.Errorf("staging buffers: limit %v, in use %v (want > 0 and 0 when idle)",
			metricValue(after, "kvhost_staging_buffers_limit"), metricValue(after, "kvhost_staging_buffers_in_use"))
	}

	// kvhost stats --json against the same daemon.
	st := statsJSON(t, ctx, socket)
	var out, errb bytes.Buffer
	switch {
	case st.Policy.Name != "lru" || st.Policy.Backend == "" || st.Policy.Fallback:
		t.Errorf("stats policy %+v", st.Policy)
	case len(st.Mounts) != 1 || st.Mounts[0].Path != cache || st.Mounts[0].Backend != "staging" || st.Mounts[0].Used == 0 || st.Mounts[0].Capacity != 256<<20:
		t.Errorf("stats mounts %+v", st.Mounts)
	case st.Keys != keys || st.Counters.StoredKeys != keys || st.Clients != 2 || st.Regions != 1 || st.Uptime == "" || !strings.HasPrefix(st.Version, "kvhost "):
		t.Errorf("stats %+v", st)
	}
	out.Reset()
	if code := run(ctx, []string{"stats", "--socket", socket}, &out, &errb); code != 0 || !strings.Contains(out.String(), cache) || !strings.Contains(out.String(), "policy") {
		t.Errorf("kvhost stats: exit %d:\n%s", code, out.String())
	}
	if code := run(ctx, []string{"health", "--socket", socket}, &out, &errb); code != 0 {
		t.Errorf("kvhost health: exit %d: %s", code, errb.String())
	}
	errb.Reset()
	if code := run(ctx, []string{"health", "--socket", filepath.Join(dir, "nothing.sock"), "--timeout", "2s"}, &out, &errb); code != 1 || !strings.Contains(errb.String(), "unhealthy") {
		t.Errorf("kvhost health without a daemon: exit %d, stderr %q", code, errb.String())
	}

	// A removal subscriber and a deleted key move the removal metrics.
	sub, err := k.c.Removals(ctx, client.RemovalCursor{}, k.ns.ID)
	if err != nil {
		t.Fatal(err)
	}
	if n, err := k.c.Delete(ctx, k.ns.ID, [][]byte{[]byte("key-0")}); err != nil || n != 1 {
		t.Fatalf("delete: %d %v", n, err)
	}
	if b, err := sub.Next(ctx); err != nil || b.Resync || len(b.Records) != 1 {
		t.Fatalf("removal batch %+v, %v: want the deleted key's", b, err)
	}
	removed := scrapeMetrics(t, addr)
	if r, s := metricValue(removed, "kvhost_removal_records_total"), metricValue(removed, "kvhost_removal_subscribers"); r != 1 || s != 1 {
		t.Errorf("removal metrics: records %v, subscribers %v; want 1 and 1", r, s)
	}
	sub.Close(ctx)

	cancel()
	if code := <-exit; code != 0 {
		t.Fatalf("serve exited %d:\n%s", code, stderr.String())
	}
	if _, err := os.Lstat(socket); !os.IsNotExist(err) {
		t.Errorf("socket left after shutdown: %v", err)
	}
	checkJSONLogs(t, stderr.String())
}

// checkJSONLogs requires every line to be a JSON object and every field
// named like a duration to be a string.
func checkJSONLogs(t *testing.T, logs string) {
	t.Helper()
	for _, line := range strings.Split(strings.TrimSpace(logs), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Errorf("log line is not JSON: %q", line)
			continue
		}
		for _, k := range []string{"took", "rebuild", "in", "interval", "grace"} {
			if v, ok := m[k]; ok {
				if _, isString := v.(string); !isString {
					t.Errorf("log field %q is %T, want a duration string: %s", k, v, line)
				}
			}
		}
	}
}
