package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/config"
)

// TestConfigShow: `kvhost config show` prints a configuration that reads
// back as what it printed, with the computed defaults resolved and
// commented, the values given kept, and a bad file's error.
func TestConfigShow(t *testing.T) {
	dir := t.TempDir()
	write := func(name, src string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	frame := write("frame.toml", "[server]\nmax_frame = \"512MiB\"\nmax_inflight_bytes_per_peer = \"3GiB\"\n[[mount]]\npath = \""+dir+"\"\n")
	given := write("given.toml", "[server]\nmax_inflight_bytes = \"2GiB\"\n[policy]\nshards = 5\n[engine]\nio_workers = 7\n[[mount]]\npath = \""+filepath.Join(dir, "absent")+"\"\ncapacity = \"1GiB\"\n")
	absent := write("absent.toml", "[[mount]]\npath = \""+filepath.Join(dir, "absent")+"\"\n")
	bad := write("bad.toml", "[server]\nmax_frame = \"4MiBx\"\n")
	vllm := write("vllm.toml", "[[mount]]\npath = \""+dir+"/kv\"\n[[mount]]\npath = \""+dir+"/v\"\nlayout = \"vllm-fs\"\n")
	tiered := filepath.Join("..", "..", "examples", "tiered.toml")
	cluster := write("cluster.toml", "[[mount]]\npath = \""+dir+"\"\ncluster_capacity = \"1GiB\"\n")

	cases := []struct {
		name     string
		args     []string
		code     int
		lines    []string // lines stdout holds (prefixes)
		stderrIn []string
	}{
		{"defaults derived and commented", nil, 0, []string{
			`max_inflight_bytes = "1GiB"  # derived: 1GiB, or four times`,
			`max_inflight_bytes_per_peer = "512MiB"  # derived: half of max_inflight_bytes`,
			`max_clients_per_peer = 32  # derived`,
			`tick_interval = "100ms"  # derived`,
			`depth = 2  # derived`,
			`cluster_interval = "0s"  # unused: no cluster_capacity (with one, 0 is 1s)`,
		}, nil},
		{"a larger max_frame raises the derived max_inflight_bytes", []string{"--config", frame}, 0, []string{
			`max_frame = "512MiB"`,
			`max_inflight_bytes = "`, // four times a job of 64 MiB: not 1GiB
			`max_inflight_bytes_per_peer = "3GiB"` + "\n",
			`capacity = "`,
		}, nil},
		{"values given are kept, without a comment", []string{"--config", given}, 0, []string{
			`max_inflight_bytes = "2GiB"` + "\n", `max_inflight_bytes_per_peer = "1GiB"  # derived`, "shards = 5\n", "io_workers = 7\n", `capacity = "1GiB"` + "\n",
		}, nil},
		{"a path not made yet leaves the capacity to the start", []string{"--config", absent}, 0, []string{`capacity = "0"  # 90% of the file system at start`}, nil},
		{"flags override the file", []string{"--config", given, "--io-workers", "3", "--policy", "tiered"}, 0, []string{"io_workers = 3\n", `name = "tiered"`}, nil},
		{"a vllm-fs mount", []string{"--config", vllm}, 0, []string{`layout = "vllm-fs"`}, nil},
		{"the tiered example", []string{"--config", tiered}, 0, []string{`name = "tiered"`}, nil},
		{"a mount with a cluster capacity makes no spares", []string{"--config", cluster}, 0, []string{`preallocate = "auto"  # none: a mount with cluster_capacity keeps no spare files`}, nil},
		{"a bad file fails with its error", []string{"--config", bad}, 1, nil, []string{bad + ":2", "max_frame", `"4MiBx"`}},
		{"a missing file fails naming it", []string{"--config", filepath.Join(dir, "nope.toml")}, 1, nil, []string{"nope.toml"}},
		{"an argument that is no flag is a usage error", []string{given}, 2, nil, []string{"--config"}},
		{"--help prints the usage", []string{"--help"}, 0, []string{"usage: kvhost config show"}, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			code := runConfig(context.Background(), append([]string{"show"}, c.args...), &out, &errb)
			if code != c.code {
				t.Fatalf("exit %d, want %d (stdout %q, stderr %q)", code, c.code, out.String(), errb.String())
			}
			text := out.String()
			for _, l := range c.lines {
				if !strings.HasPrefix(text, l) && !strings.Contains(text, "\n"+l) {
					t.Errorf("no line begins with %q in:\n%s", l, text)
				}
			}
			if c.name == "a larger max_frame raises the derived max_inflight_bytes" && strings.Contains(text, `max_inflight_bytes = "1GiB"`) {
				t.Errorf("max_inflight_bytes is the 1GiB default despite a max_frame of 512MiB:\n%s", text)
			}
			for _, s := range c.stderrIn {
				if !strings.Contains(errb.String(), s) {
					t.Errorf("stderr %q does not contain %q", errb.String(), s)
				}
			}
			if code != 0 || strings.HasPrefix(text, "usage") {
				return
			}
			back, err := config.Parse("shown.toml", out.Bytes())
			if err != nil {
				t.Fatalf("the output does not read back: %v\n%s", err, text)
			}
			// Read back and shown again, nothing changes: every value is
			// resolved already.
			again, notes, err := effectiveConfig(context.Background(), back, machine{})
			if err != nil {
				t.Fatal(err)
			}
			var out2 bytes.Buffer
			if err := again.WriteTOML(&out2, notes); err != nil {
				t.Fatal(err)
			}
			if strip(out2.String()) != strip(text) {
				t.Errorf("shown again it differs:\n%s\nfirst:\n%s", out2.String(), text)
			}
		})
	}
}

// strip drops the comments of a TOML text.
func strip(s string) string {
	var b strings.Builder
	for l := range strings.Lines(s) {
		if i := strings.Index(l, "  # "); i >= 0 {
			l = l[:i] + "\n"
		}
		if strings.HasPrefix(l, "#") {
			continue
		}
		b.WriteString(l)
	}
	return b.String()
}

// TestConfigShowLeavesWhatTheMachineDecidesToTheDaemon: the output of
// config show, fed back as the configuration on a machine that differs
// (processors, memory, a file system's size), is the configuration the
// original file is there: a value the daemon computes at start from the
// machine it runs on (io_workers, policy.shards, a mount's capacity,
// gpu.register_bytes, server.max_registered_bytes, server.max_descriptors)
// is shown in its comment, not pinned to what this machine said.
func TestConfigShowLeavesWhatTheMachineDecidesToTheDaemon(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "kvhost.toml")
	if err := os.WriteFile(file, []byte("[[mount]]\npath = \""+dir+"\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Load(file)
	if err != nil {
		t.Fatal(err)
	}
	here := machine{
		procs:  func() int { return 1 },
		statfs: func(string) (fsys.StatFS, error) { return fsys.StatFS{Total: 100 << 30}, nil },
		memory: func() int64 { return 16 << 30 },
	}
	there := machine{
		procs:  func() int { return 64 },
		statfs: func(string) (fsys.StatFS, error) { return fsys.StatFS{Total: 400 << 30}, nil },
		memory: func() int64 { return 256 << 30 },
	}
	shown, notes, err := effectiveConfig(context.Background(), cfg, here)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := shown.WriteTOML(&out, notes); err != nil {
		t.Fatal(err)
	}
	back, err := config.Parse("shown.toml", out.Bytes())
	if err != nil {
		t.Fatalf("the output does not read back: %v\n%s", err, out.String())
	}
	write := func(c config.Config) string {
		var b bytes.Buffer
		if err := c.WriteTOML(&b, nil); err != nil {
			t.Fatal(err)
		}
		return b.String()
	}
	want, _, err := effectiveConfig(context.Background(), cfg, there)
	if err != nil {
		t.Fatal(err)
	}
	got, _, err := effectiveConfig(context.Background(), back, there)
	if err != nil {
		t.Fatal(err)
	}
	wl, gl := strings.Split(write(want), "\n"), strings.Split(write(got), "\n")
	for i := range min(len(wl), len(gl)) {
		if wl[i] != gl[i] {
			t.Errorf("fed back on another machine: %s, want %s (what the file gives there)", gl[i], wl[i])
		}
	}
	// What this machine says is shown, in the comments.
	for key, now := range map[string]string{
		"mount.0.capacity":   config.Size(90 << 30).String(),
		"gpu.register_bytes": config.Size(8 << 30).String(),
	} {
		if !strings.Contains(notes[key], now) {
			t.Errorf("the note of %s is %q: it does not say %s, its value on this machine now", key, notes[key], now)
		}
	}
}
