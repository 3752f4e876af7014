package config

import (
	"errors"
	"flag"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestDefaultIsValid(t *testing.T) {
	c := Default()
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if c.Policy.Name != "lru" || len(c.Mounts) != 1 {
		t.Fatalf("defaults: policy %q, %d mounts", c.Policy.Name, len(c.Mounts))
	}
}

func TestParse(t *testing.T) {
	src := `
[server]
socket = "/run/kvhost.sock"
socket_mode = "0600"

[policy]
name = "sharded"
memory_limit = "32MiB"
call_timeout = "50ms"
[policy.params]
depth = 2
ttl = "2h"

[engine]
fsync = true
reuse_files = false
cpus = [0, 1]
node_id = "gpu-node-7"
removal_ring = 4096

[[mount]]
path = "/nvme/kv"
capacity = "100GiB"
io = "direct"
checksum = false
reserve = "2GiB"
preallocate = "4GiB"

[[mount]]
path = "/shared/kv"
capacity = 1099511627776
high_watermark = 0.9
low_watermark = 0.8
`
	c, err := Parse("kvhost.toml", []byte(src))
	if err != nil {
		t.Fatal(err)
	}
	if c.Server.SocketMode != 0o600 || c.Policy.Name != "sharded" || c.Policy.MemoryLimit != 32<<20 ||
		time.Duration(c.Policy.CallTimeout) != 50*time.Millisecond || !c.Engine.Fsync || len(c.Engine.CPUs) != 2 || c.Engine.Reuse() ||
		c.Engine.RemovalRing != 4096 {
		t.Fatalf("decoded %+v", c)
	}
	if len(c.Mounts) != 2 || c.Mounts[0].Capacity != 100<<30 || c.Mounts[1].Capacity != 1<<40 ||
		c.Mounts[0].HighWatermark != 0.95 || c.Mounts[1].LowWatermark != 0.8 {
		t.Fatalf("mounts %+v", c.Mounts)
	}
	if m := c.Mounts[0]; m.IO != "direct" || m.Checksums() || m.Reserve != 2<<30 || m.Preallocate != SizeOf(4<<30) || c.Engine.NodeID != "gpu-node-7" {
		t.Fatalf("mount 0 io %q checksums %v reserve %d preallocate %v, node id %q", m.IO, m.Checksums(), m.Reserve, m.Preallocate, c.Engine.NodeID)
	}
	if m := c.Mounts[1]; m.IO != "" || !m.Checksums() || m.Reserve != 0 || m.Preallocate != Auto() {
		t.Fatalf("mount 1 defaults: io %q checksums %v reserve %d preallocate %v", m.IO, m.Checksums(), m.Reserve, m.Preallocate)
	}
	params := c.Policy.PolicyParams()
	if params["depth"] != "2" || params["ttl"] != "2h" {
		t.Fatalf("params %v", params)
	}
	// Defaults survive where the file is silent.
	if c.Server.MaxClients != 64 || c.Log.Level != "info" {
		t.Fatalf("defaults lost: %+v", c.Server)
	}
}

func TestParseServerLimitsAndGPU(t *testing.T) {
	src := `
[server]
max_handshakes = 4
handshake_timeout = "2s"
frame_timeout = "3s"
idle_timeout = "5m"
write_timeout = "7s"
max_registered_bytes = "64GiB"
max_total_registered_bytes = "1TiB"
max_namespaces_per_peer = 8
max_inflight_bytes = "2GiB"
max_inflight_bytes_per_peer = "512MiB"
max_descriptors = 4096
max_descriptors_per_peer = 1024
max_pinned_keys = 65536
max_pinned_keys_per_peer = 8192
max_cache_layers = 65536
max_cache_layers_per_peer = 16384
max_incoming_bytes = "1GiB"
max_incoming_bytes_per_peer = "64MiB"

[gpu]
mode = "on"
cufile = "compat"
cuda_library = "/opt/cuda/lib64/libcudart.so.13"
staging_memory = "1GiB"
poll = "0s"
idle_registrars = 0
`
	c, err := Parse("kvhost.toml", []byte(src))
	if err != nil {
		t.Fatal(err)
	}
	s, g := c.Server, c.GPU
	if s.MaxHandshakes != 4 || time.Duration(s.HandshakeTimeout) != 2*time.Second || time.Duration(s.FrameTimeout) != 3*time.Second ||
		time.Duration(s.IdleTimeout) != 5*time.Minute || time.Duration(s.WriteTimeout) != 7*time.Second ||
		s.MaxRegisteredBytes != 64<<30 || s.MaxTotalRegisteredBytes != 1<<40 || s.MaxNamespacesPerPeer != 8 ||
		s.MaxInflightBytes != 2<<30 || s.MaxInflightBytesPerPeer != 512<<20 || s.MaxDescriptors != 4096 || s.MaxDescriptorsPerPeer != 1024 ||
		s.MaxPinnedKeys != 65536 || s.MaxPinnedKeysPerPeer != 8192 || s.MaxCacheLayers != 65536 || s.MaxCacheLayersPerPeer != 16384 ||
		s.MaxIncomingBytes != 1<<30 || s.MaxIncomingBytesPerPeer != 64<<20 {
		t.Errorf("server limits decoded as %+v", s)
	}
	if g.Mode != "on" || g.CuFile != "compat" || g.CUDALibrary != "/opt/cuda/lib64/libcudart.so.13" || g.StagingMemory != 1<<30 || g.Poll != 0 || g.IdleRegistrars != 0 {
		t.Errorf("gpu decoded as %+v", g)
	}
	d := Default()
	if d.GPU.Mode != "auto" || d.GPU.CuFile != "auto" || time.Duration(d.GPU.Poll) != 500*time.Microsecond || d.GPU.IdleRegistrars != 1 || d.Server.MaxHandshakes != 16 {
		t.Errorf("defaults: gpu %+v, max_handshakes %d", d.GPU, d.Server.MaxHandshakes)
	}
	if time.Duration(d.Engine.RestartHold) != 10*time.Second {
		t.Errorf("defaults: engine.restart_hold %v, want 10s", time.Duration(d.Engine.RestartHold))
	}
}

func TestParseErrors(t *testing.T) {
	tests := []struct {
		name, src string
		want      string // substring of the error
	}{
		{"syntax", "[server\nsocket = 1", "kvhost.toml:2"},
		{"unknown key", "[server]\nsokcet = \"/x\"", `kvhost.toml:2: unknown key "server.sokcet"`},
		{"bad size", "[policy]\nmemory_limit = \"lots\"", `kvhost.toml:2: policy.memory_limit: size "lots"`},
		{"a fraction of a byte", "[[mount]]\npath = \"/a\"\ncapacity = \"0.5\"", `kvhost.toml:3: mount.capacity: size "0.5": want a whole number of bytes (a fraction needs a unit, e.g. "0.5GiB")`},
		{"tiered hot mount beyond the mounts", "[policy]\nname = \"tiered\"\n[policy.params]\nhot = 5\n[[mount]]\npath = \"/a\"\n[[mount]]\npath = \"/b\"", `kvhost.toml:4: policy.params.hot: want a mount index from 0 to 1 (the tiered policy's hot mount; 2 mounts are configured), got 5`},
		{"tiered cold mount beyond the mounts", "[policy]\nname = \"tiered\"\n[policy.params]\ncold = \"2\"\n[[mount]]\npath = \"/a\"\n[[mount]]\npath = \"/b\"", `kvhost.toml:4: policy.params.cold: want a mount index from 0 to 1 (the tiered policy's cold mount; 2 mounts are configured), got 2`},
		{"tiered cold mount of one mount", "[policy]\nname = \"tiered\"\n[policy.params]\ncold = 1\n[[mount]]\npath = \"/a\"", `kvhost.toml:4: policy.params.cold: want a mount index from 0 to 0 (the tiered policy's cold mount; 1 mount is configured), got 1`},
		{"bad duration", "[policy]\ncall_timeout = \"soon\"", `kvhost.toml:2: policy.call_timeout: duration "soon"`},
		{"bad mode", "[server]\nsocket_mode = \"999\"", `file mode "999"`},
		{"socket path too long", "[server]\nsocket = \"/run/" + strings.Repeat("k", 103) + "\"", "kvhost.toml:2: server.socket: want a path of at most 107 bytes (a Unix socket's address holds no more; this one has 108)"},
		{"range", "[policy]\n\nshards = 65", "kvhost.toml:3: policy.shards: want between 0 (automatic) and 64, got 65"},
		{"relative mount", "[[mount]]\npath = \"rel\"", `kvhost.toml:2: mount.path: want an absolute directory path, got "rel"`},
		{"restart hold", "[engine]\nrestart_hold = \"2h\"", "engine.restart_hold: want a duration between 0s (hold none) and 1h"},
		{"watermarks", "[[mount]]\npath = \"/a\"\nhigh_watermark = 0.5\nlow_watermark = 0.6", "mount.low_watermark"},
		{"duplicate mount", "[[mount]]\npath = \"/a\"\n[[mount]]\npath = \"/a/\"", "each mount once"},
		{"io mode", "[[mount]]\npath = \"/a\"\nio = \"fast\"", `kvhost.toml:3: mount.io: want "auto", "direct" or "buffered", got "fast"`},
		{"negative load readers", "[[mount]]\npath = \"/a\"\nload_readers = -1", `kvhost.toml:3: mount.load_readers: want 0 (tuned) or 1..256, got -1`},
		{"checksum type", "[[mount]]\npath = \"/a\"\nchecksum = \"yes\"", "mount.checksum"},
		{"negative preallocate", "[[mount]]\npath = \"/a\"\npreallocate = -1", "kvhost.toml:3: mount.preallocate: size -1 is negative"},
		{"preallocate word", "[[mount]]\npath = \"/a\"\npreallocate = \"lots\"", `kvhost.toml:3: mount.preallocate: size "lots": want a number of bytes with an optional unit (KiB, MiB, GiB, TiB, KB, MB, GB, TB) (or "auto")`},
		{"log level", "[log]\nlevel = \"loud\"", `log.level: want debug, info, warn or error, got "loud"`},
		{"reserved param", "[policy.params]\n\"kvhost.shard\" = 1", "reserved prefix"},
		{"wrong type", "[server]\nmax_clients = \"many\"", "kvhost.toml:2: server.max_clients: want an integer, got a string"},
		{"handshake timeout", "[server]\nhandshake_timeout = \"0s\"", "kvhost.toml:2: server.handshake_timeout: want a positive duration"},
		{"stall timeout", "[server]\nstall_timeout = \"-1s\"", "kvhost.toml:2: server.stall_timeout: want a non-negative duration (0: never)"},
		{"max handshakes", "[server]\n\nmax_handshakes = 0", "kvhost.toml:3: server.max_handshakes: want at least 1, got 0"},
		{"inflight bytes", "[server]\nmax_inflight_bytes = -1", "kvhost.toml:2: server.max_inflight_bytes: size -1 is negative"},
		{"inflight bytes per peer", "[server]\nmax_inflight_bytes = \"1GiB\"\nmax_inflight_bytes_per_peer = \"2GiB\"", "kvhost.toml:3: server.max_inflight_bytes_per_peer: want 0 (half of max_inflight_bytes) to max_inflight_bytes"},
		{"descriptors", "[server]\nmax_descriptors = -1", "kvhost.toml:2: server.max_descriptors: want 0 (automatic) or more, got -1"},
		{"descriptors per peer", "[server]\nmax_descriptors = 100\nmax_descriptors_per_peer = 101", "kvhost.toml:3: server.max_descriptors_per_peer: want 0 (half of max_descriptors) to max_descriptors, got 101"},
		{"pinned keys", "[server]\nmax_pinned_keys = 100", "kvhost.toml:2: server.max_pinned_keys: want 0 (automatic) or at least 8192, got 100"},
		{"pinned keys per peer", "[server]\nmax_pinned_keys_per_peer = 4095", "kvhost.toml:2: server.max_pinned_keys_per_peer: want 0 (half of max_pinned_keys), or 4096 (the keys of one request) to max_pinned_keys, got 4095"},
		{"incoming bytes per peer", "[server]\nmax_incoming_bytes = \"64MiB\"\nmax_incoming_bytes_per_peer = \"128MiB\"", "kvhost.toml:3: server.max_incoming_bytes_per_peer: want 0 (half of max_incoming_bytes) to max_incoming_bytes"},
		{"incoming bytes per peer below a frame", "[server]\nmax_incoming_bytes_per_peer = \"1MiB\"", "kvhost.toml:2: server.max_incoming_bytes_per_peer: want 0 (half of max_incoming_bytes), or max_frame (4194304) to max_incoming_bytes: one frame must fit"},
		{"incoming bytes below two frames", "[server]\nmax_incoming_bytes = \"6MiB\"", "kvhost.toml:2: server.max_incoming_bytes: want 0 (automatic) or at least twice max_frame (8388608): half of it, a process's share, must hold one frame"},
		{"cache layers", "[server]\nmax_cache_layers = 4096", "kvhost.toml:2: server.max_cache_layers: want 0 (automatic) or at least 8192, got 4096"},
		{"cache layers per peer", "[server]\nmax_cache_layers = 8192\nmax_cache_layers_per_peer = 8193", "kvhost.toml:3: server.max_cache_layers_per_peer: want 0 (half of max_cache_layers), or 4096 (the layers of one cache) to max_cache_layers, got 8193"},
		{"namespaces per peer", "[server]\nmax_namespaces_per_peer = -1", "kvhost.toml:2: server.max_namespaces_per_peer: want 0 (64) or more, got -1"},
		{"device class", "[[mount]]\npath = \"/a\"\ndevice_class = \"tape\"", `kvhost.toml:3: mount.device_class: want "memory"`},
		{"gpu mode", "[gpu]\nmode = \"maybe\"", `kvhost.toml:2: gpu.mode: want auto, on or off, got "maybe"`},
		{"cufile mode", "[gpu]\ncufile = \"direct\"", `kvhost.toml:2: gpu.cufile: want auto, off or compat, got "direct"`},
		{"copy mode", "[gpu]\ncopy = \"dma\"", `kvhost.toml:2: gpu.copy: want auto, kernel, batch or segments, got "dma"`},
		{"checksum place", "[gpu]\nchecksum_on = \"tpu\"", `kvhost.toml:2: gpu.checksum_on: want cpu or gpu, got "tpu"`},
		{"gpu staging", "[gpu]\nstaging_memory = \"1MiB\"", "kvhost.toml:2: gpu.staging_memory: want at least 8MiB"},
		{"gpu poll", "[gpu]\npoll = \"2s\"", "kvhost.toml:2: gpu.poll: want between 0s (sleep at once) and 1s, got 2s"},
		{"negative gpu poll", "[gpu]\npoll = \"-1ms\"", "kvhost.toml:2: gpu.poll: want between 0s (sleep at once) and 1s"},
		{"idle registrars", "[gpu]\nidle_registrars = 9", "kvhost.toml:2: gpu.idle_registrars: want between 0 (none) and 8, got 9"},
		{"removal ring", "[engine]\nremoval_ring = -1", "kvhost.toml:2: engine.removal_ring: want between 0 (65,536 records) and 16,777,216, got -1"},
		{"metrics address", "[metrics]\nlisten = \"9400\"", `kvhost.toml:2: metrics.listen: want a TCP address "host:port"`},
		{"object capacity", "[objects]\nendpoint = \"http://rgw:7480\"\nbucket = \"kv\"\ncapacity = -1", "objects.capacity: size -1 is negative"},
		{"io mode of a second mount", "[[mount]]\npath = \"/a\"\nio = \"direct\"\n\n[[mount]]\npath = \"/b\"\nio = \"directt\"", `kvhost.toml:7: mount.io: want "auto", "direct" or "buffered", got "directt"`},
		{"unknown key of a second mount", "[[mount]]\npath = \"/a\"\n[[mount]]\npath = \"/b\"\ncapasity = 5", `kvhost.toml:5: unknown key "mount.capasity"`},
		{"unknown vllm_fs key of a second mount", "[[mount]]\npath = \"/a\"\n[[mount]]\npath = \"/b\"\nlayout = \"vllm-fs\"\n[mount.vllm_fs]\nbogus = 1", `kvhost.toml:7: unknown key "mount.vllm_fs.bogus"`},
		{"a second mount's duplicate path", "[[mount]]\npath = \"/a\"\n[[mount]]\npath = \"/a/\"", "kvhost.toml:4: mount.path: want each mount once"},
		{"high watermark zero", "[[mount]]\npath = \"/a\"\nhigh_watermark = 0", "kvhost.toml:3: mount.high_watermark: want a fraction in (0, 1], got 0"},
		{"low watermark zero", "[[mount]]\npath = \"/a\"\nlow_watermark = 0", "kvhost.toml:3: mount.low_watermark: want a fraction in (0, high_watermark), got 0"},
		{"budget without a model", "[[budget]]\nbytes = \"1GiB\"", `kvhost.toml: budget.model: want a model id, or a prefix of one ending in "*", got ""`},
		{"budget twice", "[[budget]]\nmodel = \"m\"\n[[budget]]\nmodel = \"m\"", `budget.model: want each model id once, got "m" twice`},
		{"budget floor above its bytes", "[[budget]]\nmodel = \"m\"\nbytes = \"1GiB\"\nfloor = \"2GiB\"", `kvhost.toml:4: budget.floor: want a size from 0 to the budget's bytes, got 2147483648, bytes 1073741824 (budget "m")`},
		{"budget floor beyond the mounts", "[[mount]]\npath = \"/a\"\ncapacity = \"1GiB\"\n[[budget]]\nmodel = \"big\"\nfloor = \"2GiB\"", `kvhost.toml:6: budget.floor: want floors that sum to at most the mounts' capacity, 1073741824, got 2147483648 in all (the largest: 2147483648, budget "big")`},
		{"vllm-fs mount first", "[[mount]]\npath = \"/v\"\nlayout = \"vllm-fs\"\n[[mount]]\npath = \"/k\"",
			`mount.layout: want every vllm-fs mount after every mount of kvhost's layout, got mount "/k" after a vllm-fs mount`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse("kvhost.toml", []byte(tt.src))
			if err == nil {
				t.Fatal("no error")
			}
			if !errors.Is(err, ErrInvalid) {
				t.Errorf("error %v does not wrap ErrInvalid", err)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %q does not contain %q", err, tt.want)
			}
		})
	}
}

// TestParseBudgets: [[budget]] tables parse into Config.Budgets in
// their order, sizes with units, a floor within its bytes, and floors
// within mounts whose capacity is the file system's are left to start.
func TestParseBudgets(t *testing.T) {
	src := "[[mount]]\npath = \"/a\"\n[[budget]]\nmodel = \"vllm:meta-llama/Llama-3.1-8B:*\"\nbytes = \"2TiB\"\nfloor = \"1TiB\"\n[[budget]]\nmodel = \"tenant-b\"\nbytes = \"10GiB\"\n"
	c, err := Parse("kvhost.toml", []byte(src))
	if err != nil {
		t.Fatal(err)
	}
	want := []Budget{{Model: "vllm:meta-llama/Llama-3.1-8B:*", Bytes: 2 << 40, Floor: 1 << 40}, {Model: "tenant-b", Bytes: 10 << 30}}
	if !reflect.DeepEqual(c.Budgets, want) {
		t.Fatalf("Budgets = %+v, want %+v", c.Budgets, want)
	}
}

// TestMountDefaults: a mount's watermarks default where the file sets
// none (the low one below a high one given at or under 0.85), and a
// [[mount]] in a comment keeps the default mount.
func TestMountDefaults(t *testing.T) {
	for _, tc := range []struct {
		name      string
		src       string
		path      string // of the only mount
		high, low float64
	}{
		{"none set", "[[mount]]\npath = \"/a\"", "/a", 0.95, 0.85},
		{"high above the low default", "[[mount]]\npath = \"/a\"\nhigh_watermark = 0.9", "/a", 0.9, 0.85},
		{"high at the low default", "[[mount]]\npath = \"/a\"\nhigh_watermark = 0.85", "/a", 0.85, 0.75},
		{"high below it", "[[mount]]\npath = \"/a\"\nhigh_watermark = 0.5", "/a", 0.5, 0.4},
		{"high tiny", "[[mount]]\npath = \"/a\"\nhigh_watermark = 0.05", "/a", 0.05, 0.025},
		{"low set", "[[mount]]\npath = \"/a\"\nlow_watermark = 0.5", "/a", 0.95, 0.5},
		{"a mount only in a comment", "# [[mount]]\n# path = \"/nvme/kvhost\"\n[server]\nmax_clients = 8", Default().Mounts[0].Path, 0.95, 0.85},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Parse("kvhost.toml", []byte(tc.src))
			if err != nil {
				t.Fatal(err)
			}
			if len(c.Mounts) != 1 {
				t.Fatalf("%d mounts, want 1", len(c.Mounts))
			}
			m := c.Mounts[0]
			if m.Path != tc.path || math.Abs(m.HighWatermark-tc.high) > 1e-9 || math.Abs(m.LowWatermark-tc.low) > 1e-9 {
				t.Errorf("mount %s, watermarks %v/%v; want %s, %v/%v", m.Path, m.HighWatermark, m.LowWatermark, tc.path, tc.high, tc.low)
			}
		})
	}
}

func TestParseSize(t *testing.T) {
	tests := []struct {
		in   string
		want Size
		ok   bool
	}{
		{"4096", 4096, true},
		{"64MiB", 64 << 20, true},
		{"1.5GiB", 3 << 29, true},
		{"2 GB", 2e9, true},
		{"10K", 10 << 10, true},
		{"", 0, false},
		{"-1", 0, false},
		{"12XB", 0, false},
		{"0.5GiB", 1 << 29, true},
		{"1.5KB", 1500, true},
		{"0.5", 0, false},    // half a byte, not the default's 0
		{"100.5B", 0, false}, // not a whole number of bytes
		{"0.0001KiB", 0, false},
	}
	for _, tt := range tests {
		got, err := ParseSize(tt.in)
		if (err == nil) != tt.ok || (tt.ok && got != tt.want) {
			t.Errorf("ParseSize(%q) = %v, %v; want %v ok=%v", tt.in, got, err, tt.want, tt.ok)
		}
	}
	if s := Size(64 << 20).String(); s != "64MiB" {
		t.Errorf("String = %q", s)
	}
}

func TestFlagsOverride(t *testing.T) {
	fs := flag.NewFlagSet("kvhost", flag.ContinueOnError)
	f := BindFlags(fs)
	if err := fs.Parse([]string{"-policy", "ttl", "-dir", "/tmp/kv", "-capacity", "1GiB", "-preallocate", "2GiB", "-log-level", "debug", "-fsync", "-metrics", "127.0.0.1:9400"}); err != nil {
		t.Fatal(err)
	}
	c, err := f.Load()
	if err != nil {
		t.Fatal(err)
	}
	if c.Policy.Name != "ttl" || len(c.Mounts) != 1 || c.Mounts[0].Path != "/tmp/kv" ||
		c.Mounts[0].Capacity != 1<<30 || c.Mounts[0].Preallocate != SizeOf(2<<30) || c.Log.Level != "debug" || !c.Engine.Fsync || c.Metrics.Listen != "127.0.0.1:9400" {
		t.Fatalf("flags not applied: %+v", c)
	}

	fs = flag.NewFlagSet("kvhost", flag.ContinueOnError)
	f = BindFlags(fs)
	if err := fs.Parse([]string{"-policy-shards", "-1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Load(); err == nil || !strings.Contains(err.Error(), "policy.shards") {
		t.Fatalf("bad flag value accepted: %v", err)
	}
}

func TestParseVLLMFSMount(t *testing.T) {
	src := `
[[mount]]
path = "/nvme/kv"

[[mount]]
path = "/nvme/vllm"
layout = "vllm-fs"
capacity = "1TiB"
[mount.vllm_fs]
namespace = "vllm:llama:0123"
row_bytes = "64KiB"
model_name = "meta-llama/Llama-3.1-8B-Instruct"
tokens_per_hash = 16
dtype = "bfloat16"
[[mount.vllm_fs.kv_cache_groups]]
tokens_per_block = 16
layer_names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]

[[mount]]
path = "/nvme/adopted"
layout = "vllm-fs"
`
	c, err := Parse("kvhost.toml", []byte(src))
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Mounts) != 3 || c.Mounts[0].Layout != "" || c.Mounts[1].Layout != LayoutVLLMFS {
		t.Fatalf("mounts %+v", c.Mounts)
	}
	v := c.Mounts[1].VLLMFS
	f := v.Fields()
	if v.Namespace != "vllm:llama:0123" || v.RowBytes != 64<<10 || f == nil || f.TPSize != 1 || f.BlocksPerFile != 1 ||
		!f.NotParallelAgnostic || len(f.KVCacheGroups) != 1 || len(f.KVCacheGroups[0].LayerNames) != 2 {
		t.Fatalf("vllm_fs %+v, fields %+v", v, f)
	}
	if err := f.Validate(); err != nil {
		t.Fatal(err)
	}
	if c.Mounts[2].VLLMFS.Fields() != nil {
		t.Fatal("a vllm-fs mount without fields must adopt (nil fields)")
	}
}

func TestParseVLLMFSErrors(t *testing.T) {
	const head = "[[mount]]\npath = \"/a\"\nlayout = \"vllm-fs\"\n[mount.vllm_fs]\nmodel_name = \"m\"\ntokens_per_hash = 16\ndtype = \"bfloat16\"\n"
	const group = "[[mount.vllm_fs.kv_cache_groups]]\ntokens_per_block = 16\nlayer_names = [\"l0\"]\n"
	for _, tt := range []struct{ name, src, want string }{
		{"unknown layout", "[[mount]]\npath = \"/a\"\nlayout = \"lmcache\"", `kvhost.toml:3: mount.layout: want "kvhost" or "vllm-fs", got "lmcache"`},
		{"fields without the layout", "[[mount]]\npath = \"/a\"\n[mount.vllm_fs]\nmodel_name = \"m\"", `mount.vllm_fs: want only with layout = "vllm-fs"`},
		{"negative tp_size", head + "tp_size = -2\n" + group, "kvhost.toml:8: mount.vllm_fs.tp_size: want a positive size (as in the tier's config.json), got -2"},
		{"no groups", head, "mount.vllm_fs.kv_cache_groups: want at least one group"},
		{"group without layers", head + "[[mount.vllm_fs.kv_cache_groups]]\ntokens_per_block = 16\n", "mount.vllm_fs.kv_cache_groups: want the group's layer names"},
		{"checksums on", "[[mount]]\npath = \"/a\"\nlayout = \"vllm-fs\"\nchecksum = true", "mount.checksum: want unset or false on a vllm-fs mount"},
		{"unknown field", head + "hash_block_size = 16\n" + group, `unknown key "mount.vllm_fs.hash_block_size"`},
		{"parallel agnostic with a size", head + "parallel_agnostic = true\ntp_size = 2\n" + group, "kvhost.toml:9: mount.vllm_fs.tp_size: want 1 (rank 0), or unset, with parallel_agnostic = true"},
		{"parallel agnostic with a rank", "[[mount]]\npath = \"/a\"\nlayout = \"vllm-fs\"\n[mount.vllm_fs]\nrank = 1\nparallel_agnostic = true\n", "kvhost.toml:5: mount.vllm_fs.rank: want 1 (rank 0), or unset, with parallel_agnostic = true"},
		// vLLM's fs tier collapses a replicated layout's parallel sizes:
		// its config.json never has "replicated_layout": true beside
		// "parallel_agnostic": false, so such a base directory is no vLLM's.
		{"replicated layout not parallel agnostic", head + "replicated_layout = true\n" + group, "kvhost.toml:8: mount.vllm_fs.replicated_layout: want false, or parallel_agnostic = true"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse("kvhost.toml", []byte(tt.src))
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %v does not contain %q", err, tt.want)
			}
		})
	}
}

func TestPreallocateIsAutoUnlessASizeIsGiven(t *testing.T) {
	tests := []struct {
		name, line string // the mount's preallocate line ("" for none)
		flag       []string
		want       AutoSize
	}{
		{"unset", "", nil, Auto()},
		{"auto", `preallocate = "auto"`, nil, Auto()},
		{"AUTO", `preallocate = " AUTO "`, nil, Auto()},
		{"zero turns it off", `preallocate = 0`, nil, SizeOf(0)},
		{"zero as a string", `preallocate = "0"`, nil, SizeOf(0)},
		{"a size", `preallocate = "4GiB"`, nil, SizeOf(4 << 30)},
		{"an integer", `preallocate = 1048576`, nil, SizeOf(1 << 20)},
		{"the flag overrides", `preallocate = "4GiB"`, []string{"-preallocate", "0"}, SizeOf(0)},
		{"the flag sets auto", `preallocate = "4GiB"`, []string{"-preallocate", "auto"}, Auto()},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "kvhost.toml")
			if err := os.WriteFile(path, []byte("[[mount]]\npath = \"/dev/shm/kv\"\n"+tt.line+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			fs := flag.NewFlagSet("kvhost", flag.ContinueOnError)
			f := BindFlags(fs)
			if err := fs.Parse(append([]string{"-config", path}, tt.flag...)); err != nil {
				t.Fatal(err)
			}
			c, err := f.Load()
			if err != nil {
				t.Fatal(err)
			}
			if got := c.Mounts[0].Preallocate; got != tt.want {
				t.Fatalf("preallocate %v (%+v), want %v (%+v)", got, got, tt.want, tt.want)
			}
		})
	}
}

// TestTieredMountsWithinTheMounts: the tiered policy's hot and cold
// mounts are accepted where they name mounts of kvhost's layout, or are
// left to their defaults (one mount: the policy then works as lru), and
// other policies' parameters of those names are theirs to judge.
func TestTieredMountsWithinTheMounts(t *testing.T) {
	two := "[[mount]]\npath = \"/a\"\n[[mount]]\npath = \"/b\"\n"
	for _, tc := range []struct{ name, src string }{
		{"defaults on two mounts", "[policy]\nname = \"tiered\"\n" + two},
		{"defaults on one mount", "[policy]\nname = \"tiered\"\n[[mount]]\npath = \"/a\"\n"},
		{"swapped", "[policy]\nname = \"tiered\"\n[policy.params]\nhot = 1\ncold = \"0\"\n" + two},
		{"another policy's param", "[policy]\nname = \"/p/vendor.wasm\"\n[policy.params]\nhot = 7\n" + two},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Parse("kvhost.toml", []byte(tc.src)); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestParseErrorsShareOneForm: every error about a file reads
// "config: FILE:LINE: KEY: ...", whichever step found it (the TOML
// decoder, a size or duration refused, an unknown key, a bad value), and
// wraps ErrInvalid.
func TestParseErrorsShareOneForm(t *testing.T) {
	tests := []struct {
		name, src, want string
	}{
		{"unknown key", "[server]\nmax_clientz = 3", `config: kvhost.toml:2: unknown key "server.max_clientz"`},
		{"type mismatch", "[server]\nmax_clients = \"many\"", "config: kvhost.toml:2: server.max_clients: "},
		{"bad size", "[server]\nmax_frame = \"4MiBx\"", `config: kvhost.toml:2: server.max_frame: size "4MiBx": want`},
		{"bad duration", "[server]\nidle_timeout = \"soon\"", `config: kvhost.toml:2: server.idle_timeout: duration "soon": want`},
		{"bad value", "[policy]\nshards = 65", "config: kvhost.toml:2: policy.shards: want between 0 (automatic) and 64, got 65"},
		{"syntax", "[server\n", "config: kvhost.toml:2: expected"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse("kvhost.toml", []byte(tt.src))
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v does not wrap ErrInvalid", err)
			}
			if !strings.HasPrefix(err.Error(), tt.want) {
				t.Fatalf("error %q, want it to begin with %q", err, tt.want)
			}
		})
	}
}

// TestAtKeyPlacesAStartErrorAtItsKey: an error the daemon's start finds
// in a configuration that loads reads as Load's do, "config: FILE:LINE:
// KEY: ...", the line that of the key in the file (a mount's key in its
// own [[mount]] table), and wraps both its cause and ErrInvalid.
func TestAtKeyPlacesAStartErrorAtItsKey(t *testing.T) {
	file := filepath.Join(t.TempDir(), "kvhost.toml")
	src := "[policy]\nname = \"tiered\"\n\n[policy.params]\nhot = 0\npromote_window = \"sixty\"\n\n[[mount]]\npath = \"/a\"\n\n[[mount]]\npath = \"/a/b\"\n"
	if err := os.WriteFile(file, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	cause := errors.New("refused")
	tests := []struct {
		name, path, key string
		mount           int
		want            string
	}{
		{"a parameter", file, "policy.params.promote_window", 0, "config: " + file + ":6: policy.params.promote_window: refused"},
		{"the parameters' table", file, "policy.params", 0, "config: " + file + ":4: policy.params: refused"},
		{"the second mount's path", file, "mount.path", 1, "config: " + file + ":12: mount.path: refused"},
		{"a key the file does not set", file, "policy.params.cold", 0, "config: " + file + ": policy.params.cold: refused"},
		{"no file", "", "mount.path", 0, "config: mount.path: refused"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := AtKey(tt.path, tt.key, tt.mount, cause)
			if err.Error() != tt.want {
				t.Fatalf("error %q, want %q", err, tt.want)
			}
			if !errors.Is(err, cause) || !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v does not wrap its cause and ErrInvalid", err)
			}
		})
	}
}

// TestParseSizeRefusesNotANumber: "NaN" and "Inf" with a unit are no
// sizes. NaN passed the range checks (every comparison with it is false)
// and converted to the most negative int64, so that a key without a
// range of its own (gpu.register_bytes) took "NaNKiB" and `config show`
// printed it as "-8388608TiB", which no file reads back; the others
// refused it as "-8388608TiB", a value nobody wrote.
func TestParseSizeRefusesNotANumber(t *testing.T) {
	quoted := func(s string) string { return `"` + s + `"` }
	for _, in := range []string{"NaNKiB", "nanGiB", "NaN B", "NaN", "InfKiB", "-InfGiB", "+Inf"} {
		if got, err := ParseSize(in); err == nil || !errors.Is(err, ErrInvalid) {
			t.Errorf("ParseSize(%q) = %v, %v; want an error", in, got, err)
		} else if !strings.Contains(err.Error(), quoted(in)) {
			t.Errorf("ParseSize(%q): %v; want the error to quote what was written, not a converted value", in, err)
		}
	}
	if _, err := Parse("kvhost.toml", []byte("[gpu]\nregister_bytes = \"NaNKiB\"\n")); err == nil ||
		!strings.Contains(err.Error(), "kvhost.toml:2: gpu.register_bytes") {
		t.Errorf("register_bytes = \"NaNKiB\": %v; want an error at kvhost.toml:2: gpu.register_bytes", err)
	}
}

// TestStatfsTimeoutIsSetByTheFileAndRefusedUnlessPositive: how long the
// start, `kvhost check` and `kvhost config show` wait for a mount's
// statfs was a constant, 5 s, so a mount that merely answered slower (an
// NFS server under load, a FUSE mount waking) stopped the start with no
// way to allow it more. server.statfs_timeout sets it: 5 s where the file
// sets none, any positive duration given; zero, a negative or unparsable
// duration, or a value of another type is refused, naming the key and
// its line.
func TestStatfsTimeoutIsSetByTheFileAndRefusedUnlessPositive(t *testing.T) {
	for _, tc := range []struct {
		name, src string
		want      time.Duration // the value parsed, where wantErr is ""
		wantErr   string        // substring of the error
	}{
		{"unset", "[server]\n", 5 * time.Second, ""},
		{"longer", "[server]\nstatfs_timeout = \"30s\"", 30 * time.Second, ""},
		{"shorter", "[server]\nstatfs_timeout = \"500ms\"", 500 * time.Millisecond, ""},
		{"zero", "[server]\nstatfs_timeout = \"0s\"", 0, "kvhost.toml:2: server.statfs_timeout: want a positive duration, got 0s"},
		{"negative", "[server]\n\nstatfs_timeout = \"-5s\"", 0, "kvhost.toml:3: server.statfs_timeout: want a positive duration, got -5s"},
		{"garbage", "[server]\nstatfs_timeout = \"a while\"", 0, `kvhost.toml:2: server.statfs_timeout: duration "a while"`},
		{"a number", "[server]\nstatfs_timeout = 5", 0, "kvhost.toml:2: server.statfs_timeout: duration: want a string"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Parse("kvhost.toml", []byte(tc.src))
			if tc.wantErr == "" {
				if err != nil {
					t.Fatal(err)
				}
				if got := time.Duration(c.Server.StatfsTimeout); got != tc.want {
					t.Errorf("server.statfs_timeout %v, want %v", got, tc.want)
				}
				return
			}
			if !errors.Is(err, ErrInvalid) || err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("error %v: want one wrapping ErrInvalid containing %q", err, tc.wantErr)
			}
		})
	}
}

// TestAValueOfTheWrongTypeSaysWhatToWrite: the TOML decoder words a
// value of the wrong type in Go's types ("incompatible types: TOML value
// has type map[string]any; destination has type slice"), which left an
// operator who wrote [mount] for [[mount]], or a size with its unit
// unquoted (capacity = 4GiB: "expected a top-level item to end with a
// newline, comment, or EOF, but got 'G' instead", at the key "mount"),
// to guess what was wrong. Each error names the key, in the file's
// terms, and what to write.
func TestAValueOfTheWrongTypeSaysWhatToWrite(t *testing.T) {
	tests := []struct {
		name, src, want string
	}{
		{"[mount] for [[mount]]", "[mount]\npath = \"/a\"",
			"config: kvhost.toml:1: mount: want an array of tables, one [[mount]] (two brackets) before the keys of each, got a table: write [[mount]], not [mount]"},
		{"[[server]] for [server]", "[[server]]\nmax_clients = 1",
			"config: kvhost.toml:1: server: want a table, got an array of tables: write [server], not [[server]]"},
		{"a string for a boolean", "[engine]\nfsync = \"yes\"",
			"config: kvhost.toml:2: engine.fsync: want true or false, got a string"},
		{"a string for an integer", "[server]\nmax_clients = \"many\"",
			"config: kvhost.toml:2: server.max_clients: want an integer, got a string"},
		{"an integer for a string", "[server]\nsocket = 5",
			"config: kvhost.toml:2: server.socket: want a string (in quotes), got an integer"},
		{"a string for a list of CPUs", "[engine]\ncpus = \"0-3\"",
			"config: kvhost.toml:2: engine.cpus: want an array, got a string"},
		{"a size's unit unquoted", "[[mount]]\npath = \"/a\"\ncapacity = 4GiB",
			`config: kvhost.toml:3: mount.capacity: a size or duration with a unit is a string: write capacity = "4GiB"`},
		{"a size's unit unquoted after a space", "[[mount]]\npath = \"/a\"\ncapacity = 4 GiB  # RAM",
			`config: kvhost.toml:3: mount.capacity: a size or duration with a unit is a string: write capacity = "4 GiB"`},
		{"a duration's unit unquoted", "[server]\nmax_clients = 3\nshutdown_timeout = 10s\n",
			`config: kvhost.toml:3: server.shutdown_timeout: a size or duration with a unit is a string: write shutdown_timeout = "10s"`},
		{"a parameter's unit unquoted", "[policy.params]\nttl = 2h",
			`config: kvhost.toml:2: policy.params.ttl: a size or duration with a unit is a string: write ttl = "2h"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse("kvhost.toml", []byte(tt.src))
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v does not wrap ErrInvalid", err)
			}
			if err.Error() != tt.want {
				t.Fatalf("error %q, want %q", err, tt.want)
			}
		})
	}
}
