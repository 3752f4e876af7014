package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"path/filepath"
	"runtime"
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
computes at start resolved (the server's limits, engine.io_workers,
policy.shards, a mount's capacity when its path exists, the staging
pipeline's depth, chunk and register_bytes) and a comment saying what each
was derived from. The output is itself a valid configuration file. A bad
file (or flag) prints its error and exits 1; 2: usage.`

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
// start where they are left 0, as it would on mc, and returns notes
// saying what each was derived from. Values decided by probing at start
// (a mount's io, checksums on a file system, spare files ahead, gpu.mode
// "auto") are left as given.
func effectiveConfig(cfg config.Config, mc machine) (config.Config, config.Notes, error) {
	notes := config.Notes{}
	derived := func(key, why string) { notes[key] = "derived: " + why }

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
	}{
		{"max_clients_per_peer", &s.MaxClientsPerPeer, r.MaxClientsPerPeer, "half of max_clients, at least 1"},
		{"max_pinned_keys", &s.MaxPinnedKeys, r.MaxPinnedKeys, "the default"},
		{"max_pinned_keys_per_peer", &s.MaxPinnedKeysPerPeer, r.MaxPinnedKeysPerPeer, "half of max_pinned_keys"},
		{"max_cache_layers", &s.MaxCacheLayers, r.MaxCacheLayers, "the default"},
		{"max_cache_layers_per_peer", &s.MaxCacheLayersPerPeer, r.MaxCacheLayersPerPeer, "half of max_cache_layers"},
		{"max_namespaces_per_peer", &s.MaxNamespacesPerPeer, r.MaxNamespacesPerPeer, "what one connection may declare"},
		{"max_descriptors", &s.MaxDescriptors, r.MaxDescriptors, "a quarter of the open-file limit and of vm.max_map_count, whichever is fewer"},
		{"max_descriptors_per_peer", &s.MaxDescriptorsPerPeer, r.MaxDescriptorsPerPeer, "half of max_descriptors"},
	}
	for _, l := range ints {
		if *l.v == 0 {
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
		{"max_registered_bytes", &s.MaxRegisteredBytes, r.MaxRegisteredBytes, "the machine's memory"},
		{"max_total_registered_bytes", &s.MaxTotalRegisteredBytes, r.MaxTotalRegisteredBytes, "the default"},
		{"max_device_registered_bytes", &s.MaxDeviceRegisteredBytes, r.MaxDeviceBytes, "the default"},
	}
	for _, l := range sizes {
		if *l.v == 0 {
			*l.v = config.Size(l.resolved)
			derived("server."+l.key, l.why)
		}
	}

	workers := cfg.Engine.IOWorkers
	if workers <= 0 {
		workers = engine.DefaultIOWorkers()
		cfg.Engine.IOWorkers = workers
		derived("engine.io_workers", "the runtime's GOMAXPROCS, at least 2")
	}
	if cfg.Policy.Shards == 0 {
		procs := daemonProcessors(workers, mc.gomaxprocs(), gomaxprocsFromEnv())
		cfg.Policy.Shards = min(policy.DefaultShards, procs)
		derived("policy.shards", fmt.Sprintf("%d, at most one per Go processor (%d)", policy.DefaultShards, procs))
	}
	if cfg.Policy.CacheDir == "" {
		cfg.Policy.CacheDir = filepath.Join(config.DefaultRoot(), "wasm-cache")
		derived("policy.cache_dir", "the default")
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
			m.Capacity = config.Size(float64(size) * 0.9)
			derived(key, "90% of the file system now; the daemon measures it at start")
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
			g.RegisterBytes = config.Size(mem / 2)
			derived("gpu.register_bytes", "half of the machine's memory")
		}
	}
	if err := cfg.Validate(); err != nil {
		return cfg, nil, fmt.Errorf("config: the resolved configuration: %w", err)
	}
	return cfg, notes, nil
}

func ptr[T any](v T) *T { return &v }
