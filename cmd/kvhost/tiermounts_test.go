package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/internal/config"
	kvdaemon "github.com/kvhost/kvhost/internal/daemon"
	"github.com/kvhost/kvhost/internal/testsock"
)

// TestDaemonWarnsAtStartWhenLRUGetsTwoMounts: the default policy with a
// second [[mount]] logs the warning at start, naming the policy.
func TestDaemonWarnsAtStartWhenLRUGetsTwoMounts(t *testing.T) {
	dir := t.TempDir()
	file, _, _ := testConfig(t, dir, fmt.Sprintf("[[mount]]\npath = %q\ncapacity = \"64MiB\"\n", filepath.Join(dir, "cold")))
	p := startProc(t, nil, "--config", file)
	if m := p.stderr.logLine(t, kvdaemon.SingleMountMsg); m["policy"] != "lru" {
		t.Fatalf("the warning names the policy %v, want lru: %v", m["policy"], m)
	}
}

// TestCheckWarnsWhenASingleMountPolicyGetsTwoMounts: kvhost check gives
// the same finding from the configuration, and an OK for tiered, but a
// warning for tiered whose second, cold, mount is the memory one.
func TestCheckWarnsWhenASingleMountPolicyGetsTwoMounts(t *testing.T) {
	dir := t.TempDir()
	mounts := fmt.Sprintf("[[mount]]\npath = %q\n\n[[mount]]\npath = %q\n", filepath.Join(dir, "hot"), filepath.Join(dir, "cold"))
	for _, tc := range []struct {
		policy string
		level  string
	}{
		{"lru", levelWarn},
		{"tiered", levelOK},
		{"tiered, memory second", levelWarn},
	} {
		t.Run(tc.policy, func(t *testing.T) {
			file := filepath.Join(dir, strings.ReplaceAll(tc.policy, " ", "")+".toml")
			policy, ms, _ := strings.Cut(tc.policy, ",")
			src := fmt.Sprintf("[policy]\nname = %q\n\n%s", policy, mounts)
			if ms != "" {
				src += "device_class = \"memory\"\n" // the second, cold, mount
			}
			if err := os.WriteFile(file, []byte(src), 0o644); err != nil {
				t.Fatal(err)
			}
			got, _ := policyFindings(t, file)
			if len(got) != 1 || got[0].Level != tc.level {
				t.Fatalf("policy findings %+v, want one %s", got, tc.level)
			}
		})
	}
}

// TestCheckNamesTheMountLRUsMountParamPicks: kvhost check of lru with
// policy.params.mount = 1 and two mounts warns that every file goes to
// the second mount (the policy's mounts count from 0), naming its path
// and not the first's.
func TestCheckNamesTheMountLRUsMountParamPicks(t *testing.T) {
	dir := t.TempDir()
	hot, cold := filepath.Join(dir, "hot"), filepath.Join(dir, "cold")
	file := filepath.Join(dir, "lru1.toml")
	src := fmt.Sprintf("[policy]\nname = \"lru\"\n\n[policy.params]\nmount = 1\n\n[[mount]]\npath = %q\n\n[[mount]]\npath = %q\n", hot, cold)
	if err := os.WriteFile(file, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	got, _ := policyFindings(t, file)
	if len(got) != 1 || got[0].Level != levelWarn {
		t.Fatalf("policy findings %+v, want one %s", got, levelWarn)
	}
	if what := got[0].What; !strings.Contains(what, cold) || strings.Contains(what, hot) || strings.Contains(what, "first") {
		t.Fatalf("the finding %q: want it to name the second mount %s, not the first %s", what, cold, hot)
	}
}

// policyFindings runs kvhost check --json on the configuration file and
// returns its findings about the policy, and its exit code.
func policyFindings(t *testing.T, file string) ([]checkItem, int) {
	t.Helper()
	var out, errb bytes.Buffer
	code := run(context.Background(), []string{"check", "--config", file, "--json"}, &out, &errb)
	var rep checkReport
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
		t.Fatalf("check --json: %v\n%s\n%s", err, out.String(), errb.String())
	}
	var got []checkItem
	for _, it := range rep.Items {
		if it.Area == "policy" {
			got = append(got, it)
		}
	}
	return got, code
}

// TestTieredExampleIsAMemoryAndDiskDaemon: examples/tiered.toml loads,
// names the tiered policy with a memory mount first and a second mount,
// and the built-in tiered module draws no single-mount warning for it.
func TestTieredExampleIsAMemoryAndDiskDaemon(t *testing.T) {
	cfg, err := config.Load(filepath.Join("..", "..", "examples", "tiered.toml"))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Policy.Name != "tiered" || len(cfg.Mounts) != 2 || cfg.Mounts[0].DeviceClass != "memory" {
		t.Fatalf("policy %q, mounts %+v: want tiered over a memory mount and a second one", cfg.Policy.Name, cfg.Mounts)
	}
	var rep checkReport
	checkPolicyMounts(context.Background(), &rep, cfg, "", cfg.Mounts, func(i int) bool { return checkOptions{}.onMemoryFS(context.Background(), cfg.Mounts[i].Path) })
	if len(rep.Items) != 1 || rep.Items[0].Level != levelOK {
		t.Fatalf("findings %+v, want one OK (needs the embedded wasm: make build)", rep.Items)
	}
}

// TestCheckFailsAPolicyTheDaemonCannotLoad: on a node of one mount too,
// kvhost check loads the configured policy as the daemon would at start,
// and FAILs (exit status 1) where it cannot: a name that is not built in,
// a .wasm file that is not there or is not WebAssembly. The default
// policy there gets an OK.
func TestCheckFailsAPolicyTheDaemonCannotLoad(t *testing.T) {
	dir := t.TempDir()
	notWasm := filepath.Join(dir, "text.wasm")
	if err := os.WriteFile(notWasm, []byte("hello\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, policy string
		level        string
		code         int
	}{
		{"unknown built-in", "lruu", levelFail, 1},
		{"missing file", filepath.Join(dir, "none.wasm"), levelFail, 1},
		{"not wasm", notWasm, levelFail, 1},
		{"default", "lru", levelOK, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			file := filepath.Join(t.TempDir(), "kvhost.toml")
			src := fmt.Sprintf("[gpu]\nmode = \"off\"\ncufile = \"off\"\n\n[policy]\nname = %q\n\n[[mount]]\npath = %q\n", tc.policy, t.TempDir())
			if err := os.WriteFile(file, []byte(src), 0o644); err != nil {
				t.Fatal(err)
			}
			got, code := policyFindings(t, file)
			if len(got) != 1 || got[0].Level != tc.level || code != tc.code {
				t.Fatalf("exit %d, policy findings %+v; want exit %d and one %s", code, got, tc.code, tc.level)
			}
		})
	}
}

// TestReversedTiersAreNamed: the tiered policy whose cold mount holds
// memory (a memory file system, or device_class = "memory") and whose hot
// mount does not is reported, with its hot and cold parameters or their
// defaults; tiers the right way round, two memory mounts, a configured
// class over the file system's, and other policies are not.
func TestReversedTiersAreNamed(t *testing.T) {
	disk, shm := config.Mount{Path: "/disk"}, config.Mount{Path: "/dev/shm/kv"}
	onFS := func(i int, mounts []config.Mount) bool { return strings.HasPrefix(mounts[i].Path, "/dev/shm") }
	for _, tc := range []struct {
		name   string
		policy string
		params map[string]any
		mounts []config.Mount
		warn   bool
	}{
		{"memory first", "tiered", nil, []config.Mount{shm, disk}, false},
		{"memory second", "tiered", nil, []config.Mount{disk, shm}, true},
		{"memory second, swapped by params", "tiered", map[string]any{"hot": int64(1), "cold": int64(0)}, []config.Mount{disk, shm}, false},
		{"memory first, swapped by params", "tiered", map[string]any{"hot": "1", "cold": "0"}, []config.Mount{shm, disk}, true},
		{"configured memory class second", "tiered", nil, []config.Mount{disk, {Path: "/nvme", DeviceClass: "memory"}}, true},
		{"configured disk class on a tmpfs second", "tiered", nil, []config.Mount{disk, {Path: "/dev/shm/kv", DeviceClass: "ssd"}}, false},
		{"two memory mounts", "tiered", nil, []config.Mount{shm, {Path: "/dev/shm/b"}}, false},
		{"lru", "lru", nil, []config.Mount{disk, shm}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := config.Default()
			cfg.Policy.Name, cfg.Policy.Params, cfg.Mounts = tc.policy, tc.params, tc.mounts
			why := kvdaemon.ReversedTiers(cfg, func(i int) bool { return onFS(i, tc.mounts) })
			if (why != "") != tc.warn {
				t.Fatalf("ReversedTiers = %q, want a warning: %v", why, tc.warn)
			}
		})
	}
}

// TestDaemonWarnsAtStartWhenTiersAreReversed: the tiered policy given a
// disk mount first and a memory one second logs the warning at start,
// naming both mounts.
func TestDaemonWarnsAtStartWhenTiersAreReversed(t *testing.T) {
	dir := testsock.Dir(t)
	hot, cold := filepath.Join(dir, "disk"), filepath.Join(dir, "memory")
	file := filepath.Join(dir, "kvhost.toml")
	src := fmt.Sprintf(`[server]
socket = %q

[log]
format = "json"

[policy]
name = "tiered"
cache_dir = %q

[[mount]]
path = %q
capacity = "64MiB"

[[mount]]
path = %q
capacity = "64MiB"
device_class = "memory"
`, filepath.Join(dir, "run", "kvhost.sock"), policyCache, hot, cold)
	if err := os.WriteFile(file, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	p := startProc(t, nil, "--config", file)
	m := p.stderr.logLine(t, kvdaemon.ReversedTiersMsg)
	if why, _ := m["why"].(string); !strings.Contains(why, hot) || !strings.Contains(why, cold) {
		t.Fatalf("the warning %v names not both mounts %s and %s", m, hot, cold)
	}
}
