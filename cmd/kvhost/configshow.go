package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/host/engine"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/staging/gpu"
)

// configShowUsage describes `kvhost config show`.
const configShowUsage = `usage: kvhost config show [--config FILE] [daemon flags]

Prints the configuration the daemon would run with on this machine, given
the file and the daemon's flags (kvhost --help lists them), as TOML: every
key, defaults included, with the values left 0 or "auto" that the daemon
computes at start from the file resolved (the server's limits, the
engine's intervals, the staging pipeline's depth and chunk) and a comment
saying what each was derived from. What the daemon computes from the
machine it runs on (engine.io_workers, policy.shards, policy.cache_dir, a
mount's capacity, gpu.register_bytes, server.max_descriptors and
max_registered_bytes) stays unset, its value on this machine now in the
comment: the output is itself a valid configuration file, which runs as
the original does on any machine. A bad file (or flag) prints its error
and exits 1; 2: usage.`

// runConfigShow implements `kvhost config show`.
func runConfigShow(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("kvhost config show", flag.ContinueOnError)
	fs.SetOutput(stderr)
	flags := config.BindFlags(fs)
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), configShowUsage)
		fmt.Fprintln(fs.Output(), "\nflags:")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fs.SetOutput(stdout)
			fs.Usage()
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kvhost config show: unexpected argument %q (the file goes after --config)\n", fs.Arg(0))
		return 2
	}
	cfg, err := flags.Load()
	if err == nil {
		err = checkPolicyName(flags.ConfigPath(), cfg.Policy.Name)
	}
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	cfg, notes, err := effectiveConfig(cfg, machine{})
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	if err := cfg.WriteTOML(stdout, notes); err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	return 0
}

// machine is what effectiveConfig asks of the machine it runs on; a
// test replaces its fields. A nil field asks the machine itself.
type machine struct {
	// procs is the runtime's Go processors (runtime.GOMAXPROCS).
	procs func() int
	// fsSize is the bytes of the file system at path, or false where the
	// path does not exist (nothing is created).
	fsSize func(path string) (int64, bool)
	// memory is the machine's memory in bytes.
	memory func() int64
}

func (m machine) gomaxprocs() int {
	if m.procs != nil {
		return m.procs()
	}
	return runtime.GOMAXPROCS(0)
}

func (m machine) fileSystemSize(path string) (int64, bool) {
	if m.fsSize != nil {
		return m.fsSize(path)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return 0, false
	}
	return int64(float64(st.Blocks) * float64(st.Bsize)), true
}

func (m machine) memoryBytes() int64 {
	if m.memory != nil {
		return m.memory()
	}
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil || si.Totalram == 0 {
		return 0
	}
	return int64(si.Totalram) * int64(si.Unit)
}

// effectiveConfig resolves the values of cfg that the daemon computes at
// start from the configuration where they are left 0, and returns notes
// saying what each was derived from. Values the daemon computes from the
// machine it runs on (its processors, memory, descriptor limits, a file
// system's size, the user's cache directory) stay 0, with a note saying
// what they are on mc now: pinned, they would make the output run
// otherwise than cfg on another machine, or on this one once it changed.
// Values decided by probing at start (a mount's io, checksums on a file
// system, spare files ahead, gpu.mode "auto") are left as given.
func effectiveConfig(cfg config.Config, mc machine) (config.Config, config.Notes, error) {
	notes := config.Notes{}
	derived := func(key, why string) { notes[key] = "derived: " + why }
	atStart := func(key, now, why string) {
		notes[key] = fmt.Sprintf("computed at start from the machine: %s here now (%s)", now, why)
	}
	cfg.Mounts = slices.Clone(cfg.Mounts) // resolved here, not in the caller's

	r, err := serverLimits(cfg).WithDefaults()
	if err != nil {
		return cfg, nil, fmt.Errorf("config: [server]: %w", err)
	}
	s := &cfg.Server
	ints := []struct {
		key      string
		v        *int
		resolved int
		why      string
		machine  bool // from the machine: noted, not set
	}{
		{"max_clients_per_peer", &s.MaxClientsPerPeer, r.MaxClientsPerPeer, "half of max_clients, at least 1", false},
		{"max_pinned_keys", &s.MaxPinnedKeys, r.MaxPinnedKeys, "the default", false},
		{"max_pinned_keys_per_peer", &s.MaxPinnedKeysPerPeer, r.MaxPinnedKeysPerPeer, "half of max_pinned_keys", false},
		{"max_cache_layers", &s.MaxCacheLayers, r.MaxCacheLayers, "the default", false},
		{"max_cache_layers_per_peer", &s.MaxCacheLayersPerPeer, r.MaxCacheLayersPerPeer, "half of max_cache_layers", false},
		{"max_namespaces_per_peer", &s.MaxNamespacesPerPeer, r.MaxNamespacesPerPeer, "what one connection may declare", false},
		{"max_descriptors", &s.MaxDescriptors, r.MaxDescriptors, "a quarter of the open-file limit and of vm.max_map_count, whichever is fewer", true},
		{"max_descriptors_per_peer", &s.MaxDescriptorsPerPeer, r.MaxDescriptorsPerPeer, "half of max_descriptors", s.MaxDescriptors == 0},
	}
	for _, l := range ints {
		switch {
		case *l.v != 0:
		case l.machine:
			atStart("server."+l.key, strconv.Itoa(l.resolved), l.why)
		default:
			*l.v = l.resolved
			derived("server."+l.key, l.why)
		}
	}
	sizes := []struct {
		key      string
		v        *config.Size
		resolved int64
		why      string
	}{
		{"max_inflight_bytes", &s.MaxInflightBytes, r.MaxInflightBytes, "1GiB, or four times what one job of max_frame holds if more"},
		{"max_inflight_bytes_per_peer", &s.MaxInflightBytesPerPeer, r.MaxInflightBytesPerPeer, "half of max_inflight_bytes"},
		{"max_incoming_bytes", &s.MaxIncomingBytes, r.MaxIncomingBytes, "256MiB, or four times max_frame if more"},
		{"max_incoming_bytes_per_peer", &s.MaxIncomingBytesPerPeer, r.MaxIncomingBytesPerPeer, "half of max_incoming_bytes"},
		{"max_registered_bytes", &s.MaxRegisteredBytes, r.MaxRegisteredBytes, "the machine's memory"}, // noted below
		{"max_total_registered_bytes", &s.MaxTotalRegisteredBytes, r.MaxTotalRegisteredBytes, "the default"},
		{"max_device_registered_bytes", &s.MaxDeviceRegisteredBytes, r.MaxDeviceBytes, "the default"},
	}
	for _, l := range sizes {
		switch {
		case *l.v != 0:
		case l.v == &s.MaxRegisteredBytes:
			atStart("server."+l.key, config.Size(l.resolved).String(), l.why)
		default:
			*l.v = config.Size(l.resolved)
			derived("server."+l.key, l.why)
		}
	}

	workers := cfg.Engine.IOWorkers
	if workers <= 0 {
		workers = max(2, mc.gomaxprocs())
		atStart("engine.io_workers", strconv.Itoa(workers), "the runtime's GOMAXPROCS, at least 2")
	}
	if cfg.Policy.Shards == 0 {
		procs := daemonProcessors(workers, mc.gomaxprocs(), gomaxprocsFromEnv())
		atStart("policy.shards", strconv.Itoa(min(policy.DefaultShards, procs)), fmt.Sprintf("%d, at most one per Go processor (%d)", policy.DefaultShards, procs))
	}
	if cfg.Policy.CacheDir == "" {
		atStart("policy.cache_dir", filepath.Join(config.DefaultRoot(), "wasm-cache"), "wasm-cache in the cache directory of the user the daemon runs as")
	}
	e := &cfg.Engine
	durations := []struct {
		key      string
		v        *config.Duration
		resolved time.Duration
	}{
		{"temp_grace", &e.TempGrace, engine.DefaultTempGrace},
		{"tick_interval", &e.TickInterval, engine.DefaultTickInterval},
		{"mount_update_interval", &e.MountUpdateInterval, engine.DefaultMountUpdateInterval},
	}
	for _, d := range durations {
		if *d.v == 0 {
			*d.v = config.Duration(d.resolved)
			derived("engine."+d.key, "the default")
		}
	}
	if e.LookupTableSlots == 0 {
		e.LookupTableSlots = config.DefaultLookupTableSlots
		derived("engine.lookup_table_slots", "the default")
	}
	if e.ReuseFiles == nil {
		e.ReuseFiles = ptr(true)
		derived("engine.reuse_files", "the default")
	}
	if e.LookupTable == nil {
		e.LookupTable = ptr(true)
		derived("engine.lookup_table", "the default")
	}
	if e.NodeID == "" {
		notes["engine.node_id"] = "empty: the host name"
	}
	for i := range cfg.Mounts {
		m := &cfg.Mounts[i]
		at := func(key string) string { return fmt.Sprintf("mount.%d.%s", i, key) }
		if m.Layout == "" {
			m.Layout = config.LayoutKVHost
			derived(at("layout"), "the default")
		}
		if m.IO == "" {
			m.IO = "auto"
			derived(at("io"), "the default: O_DIRECT where the probe at start finds it")
		}
		if m.Checksum == nil {
			m.Checksum = ptr(m.Layout != config.LayoutVLLMFS)
			derived(at("checksum"), "the default of the layout")
		}
		if m.ClusterCapacity != 0 && m.ClusterInterval == 0 {
			m.ClusterInterval = config.Duration(engine.DefaultClusterInterval)
			derived(at("cluster_interval"), "the default")
		}
		if m.DeviceClass == "" {
			notes[at("device_class")] = "empty: detected at start"
		}
		if m.Shared == nil {
			notes[at("shared")] = "detected at start: true on network and FUSE file systems and for vllm-fs mounts"
		}
		if m.Preallocate == config.Auto() {
			notes[at("preallocate")] = "on a memory file system: an eighth of the capacity, at most the larger of 4GiB and a sixteenth of memory"
		}
		if m.Capacity != 0 {
			continue
		}
		key := at("capacity")
		if size, ok := mc.fileSystemSize(m.Path); ok && size > 0 {
			atStart(key, config.Size(float64(size)*0.9).String(), "90% of the file system")
		} else {
			notes[key] = "90% of the file system at start (the path does not exist yet)"
		}
	}
	g := &cfg.GPU
	if g.Depth == 0 {
		g.Depth = gpu.DefaultDepth
		derived("gpu.depth", "double buffering")
	}
	if g.Chunk == 0 {
		g.Chunk = gpu.DefaultChunk
		derived("gpu.chunk", "the default")
	}
	if g.RegisterBytes == 0 {
		if mem := mc.memoryBytes(); mem > 0 {
			atStart("gpu.register_bytes", config.Size(mem/2).String(), "half of the machine's memory")
		}
	}
	if err := cfg.Validate(); err != nil {
		return cfg, nil, fmt.Errorf("config: the resolved configuration: %w", err)
	}
	return cfg, notes, nil
}

func ptr[T any](v T) *T { return &v }
