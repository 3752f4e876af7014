package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"runtime"
	"slices"
	"time"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/config"
	kvdaemon "github.com/kvhost/kvhost/internal/daemon"
	"github.com/kvhost/kvhost/internal/engine"
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
the original does on any machine. A bad file (or flag), or one the
daemon's start refuses (a policy refusing its [policy.params], mounts
one inside another, a mount whose file system does not answer statfs
within server.statfs_timeout, 5 s by default), prints its error and
exits 1; 2: usage.`

// runConfigShow implements `kvhost config show`.
func runConfigShow(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runConfigShowOn(ctx, machine{}, args, stdout, stderr)
}

// runConfigShowOn is runConfigShow asking mc about the machine.
func runConfigShowOn(ctx context.Context, mc machine, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("kvhost config show", configShowUsage, stderr)
	flags := config.BindFlags(fs)
	if code, ok := parseFlags(fs, args, stdout); !ok {
		return code
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kvhost config show: unexpected argument %q (the file goes after --config)\n", fs.Arg(0))
		return 2
	}
	cfg, err := flags.Load()
	if err == nil {
		err = checkAtStart(ctx, flags.ConfigPath(), cfg)
	}
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	cfg, notes, err := effectiveConfig(ctx, cfg, mc)
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
	// statfs is statfs(2) of a mount's path (nothing is created); nil is
	// fsys.OS's.
	statfs func(path string) (fsys.StatFS, error)
	// memory is the machine's memory in bytes.
	memory func() int64
}

func (m machine) gomaxprocs() int {
	if m.procs != nil {
		return m.procs()
	}
	return runtime.GOMAXPROCS(0)
}

// fileSystemSize is the bytes of the file system at path, or false
// where its statfs fails (the path does not exist: nothing is created).
// The statfs is bounded as the daemon's start bounds it (kvdaemon.AnswerWithin),
// by wait (server.statfs_timeout): a mount whose file system does not
// answer is an error naming it (daemon.HungMount), the start refusing it too,
// not a wait without end.
func (m machine) fileSystemSize(ctx context.Context, path string, wait time.Duration) (int64, bool, error) {
	statfs := m.statfs
	if statfs == nil {
		statfs = fsys.OS{}.Statfs
	}
	st, err := kvdaemon.AnswerWithin(ctx, wait, func() (fsys.StatFS, error) { return statfs(path) })
	switch {
	case errors.Is(err, kvdaemon.ErrNoAnswer):
		return 0, false, kvdaemon.HungMount(path, err)
	case ctx.Err() != nil:
		return 0, false, ctx.Err()
	case err != nil:
		return 0, false, nil
	}
	return st.Total, true, nil
}

func (m machine) memoryBytes() int64 {
	if m.memory != nil {
		return m.memory()
	}
	return engine.MachineMemory()
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
// A mount whose file system does not answer statfs is an error
// (machine.fileSystemSize).
func effectiveConfig(ctx context.Context, cfg config.Config, mc machine) (config.Config, config.Notes, error) {
	notes := config.Notes{}
	cfg.Mounts = slices.Clone(cfg.Mounts) // resolved here, not in the caller's

	r, err := kvdaemon.ServerLimits(cfg).WithDefaults()
	if err != nil {
		return cfg, nil, fmt.Errorf("config: [server]: %w", err)
	}
	s := &cfg.Server
	derive(notes, "server.max_clients_per_peer", &s.MaxClientsPerPeer, r.MaxClientsPerPeer, "half of max_clients, at least 1")
	derive(notes, "server.max_pinned_keys", &s.MaxPinnedKeys, r.MaxPinnedKeys, "the default")
	derive(notes, "server.max_pinned_keys_per_peer", &s.MaxPinnedKeysPerPeer, r.MaxPinnedKeysPerPeer, "half of max_pinned_keys")
	derive(notes, "server.max_cache_layers", &s.MaxCacheLayers, r.MaxCacheLayers, "the default")
	derive(notes, "server.max_cache_layers_per_peer", &s.MaxCacheLayersPerPeer, r.MaxCacheLayersPerPeer, "half of max_cache_layers")
	derive(notes, "server.max_namespaces_per_peer", &s.MaxNamespacesPerPeer, r.MaxNamespacesPerPeer, "what one connection may declare")
	fromMachine(notes, "server.max_descriptors", s.MaxDescriptors, r.MaxDescriptors, "a quarter of the open-file limit and of vm.max_map_count, whichever is fewer")
	if s.MaxDescriptors == 0 {
		fromMachine(notes, "server.max_descriptors_per_peer", s.MaxDescriptorsPerPeer, r.MaxDescriptorsPerPeer, "half of max_descriptors")
	} else {
		derive(notes, "server.max_descriptors_per_peer", &s.MaxDescriptorsPerPeer, r.MaxDescriptorsPerPeer, "half of max_descriptors")
	}
	derive(notes, "server.max_inflight_bytes", &s.MaxInflightBytes, config.Size(r.MaxInflightBytes), "1GiB, or four times what one job of max_frame holds if more")
	derive(notes, "server.max_inflight_bytes_per_peer", &s.MaxInflightBytesPerPeer, config.Size(r.MaxInflightBytesPerPeer), "half of max_inflight_bytes")
	derive(notes, "server.max_incoming_bytes", &s.MaxIncomingBytes, config.Size(r.MaxIncomingBytes), "256MiB, or four times max_frame if more")
	derive(notes, "server.max_incoming_bytes_per_peer", &s.MaxIncomingBytesPerPeer, config.Size(r.MaxIncomingBytesPerPeer), "half of max_incoming_bytes")
	fromMachine(notes, "server.max_registered_bytes", s.MaxRegisteredBytes, config.Size(r.MaxRegisteredBytes), "the machine's memory")
	derive(notes, "server.max_total_registered_bytes", &s.MaxTotalRegisteredBytes, config.Size(r.MaxTotalRegisteredBytes), "the default")
	derive(notes, "server.max_device_registered_bytes", &s.MaxDeviceRegisteredBytes, config.Size(r.MaxDeviceBytes), "the default")

	workers := cfg.Engine.IOWorkers
	if workers <= 0 {
		workers = max(2, mc.gomaxprocs())
		atStart(notes, "engine.io_workers", workers, "the runtime's GOMAXPROCS, at least 2")
	}
	procs := kvdaemon.Processors(workers, mc.gomaxprocs())
	fromMachine(notes, "policy.shards", cfg.Policy.Shards, min(policy.DefaultShards, procs), fmt.Sprintf("%d, at most one per Go processor (%d)", policy.DefaultShards, procs))
	fromMachine(notes, "policy.cache_dir", cfg.Policy.CacheDir, filepath.Join(config.DefaultRoot(), "wasm-cache"), "wasm-cache in the cache directory of the user the daemon runs as")

	e := &cfg.Engine
	derive(notes, "engine.temp_grace", &e.TempGrace, config.Duration(engine.DefaultTempGrace), "the default")
	derive(notes, "engine.tick_interval", &e.TickInterval, config.Duration(engine.DefaultTickInterval), "the default")
	derive(notes, "engine.mount_update_interval", &e.MountUpdateInterval, config.Duration(engine.DefaultMountUpdateInterval), "the default")
	derive(notes, "engine.lookup_table_slots", &e.LookupTableSlots, config.DefaultLookupTableSlots, "the default")
	derive(notes, "engine.reuse_files", &e.ReuseFiles, ptr(true), "the default")
	derive(notes, "engine.lookup_table", &e.LookupTable, ptr(true), "the default")
	if e.NodeID == "" {
		notes["engine.node_id"] = "empty: the host name"
	}
	for i := range cfg.Mounts {
		if err := resolveMount(ctx, notes, fmt.Sprintf("mount.%d.", i), &cfg.Mounts[i], mc, time.Duration(cfg.Server.StatfsTimeout)); err != nil {
			return cfg, nil, err
		}
	}
	g := &cfg.GPU
	derive(notes, "gpu.depth", &g.Depth, gpu.DefaultDepth, "double buffering")
	derive(notes, "gpu.chunk", &g.Chunk, gpu.DefaultChunk, "the default")
	if mem := mc.memoryBytes(); mem > 0 {
		fromMachine(notes, "gpu.register_bytes", g.RegisterBytes, config.Size(mem/2), "half of the machine's memory")
	}
	if err := cfg.Validate(); err != nil {
		return cfg, nil, fmt.Errorf("config: the resolved configuration: %w", err)
	}
	return cfg, notes, nil
}

// resolveMount resolves m as effectiveConfig does, its keys noted under
// prefix ("mount.0."); its error is a hung mount's (fileSystemSize, its
// statfs bounded by wait).
func resolveMount(ctx context.Context, notes config.Notes, prefix string, m *config.Mount, mc machine, wait time.Duration) error {
	derive(notes, prefix+"layout", &m.Layout, config.LayoutKVHost, "the default")
	derive(notes, prefix+"io", &m.IO, "auto", "the default: O_DIRECT where the probe at start finds it")
	derive(notes, prefix+"checksum", &m.Checksum, ptr(m.Layout != config.LayoutVLLMFS), "the default of the layout")
	if m.ClusterCapacity != 0 {
		derive(notes, prefix+"cluster_interval", &m.ClusterInterval, config.Duration(engine.DefaultClusterInterval), "the default")
	} else {
		notes[prefix+"cluster_interval"] = "unused: no cluster_capacity (with one, 0 is " + engine.DefaultClusterInterval.String() + ")"
	}
	if m.DeviceClass == "" {
		notes[prefix+"device_class"] = "empty: detected at start"
	}
	if m.Shared == nil {
		notes[prefix+"shared"] = "detected at start: true on network and FUSE file systems and for vllm-fs mounts"
	}
	switch {
	case m.ClusterCapacity != 0:
		notes[prefix+"preallocate"] = "none: a mount with cluster_capacity keeps no spare files"
	case m.Preallocate == config.Auto():
		notes[prefix+"preallocate"] = "on a memory file system: an eighth of the capacity, at most the larger of 4GiB and a sixteenth of memory"
	}
	if m.Capacity != 0 {
		return nil
	}
	size, ok, err := mc.fileSystemSize(ctx, m.Path, wait)
	switch {
	case err != nil:
		return err
	case ok && size > 0:
		atStart(notes, prefix+"capacity", config.Size(kvdaemon.DefaultCapacity(size)), "90% of the file system")
	default:
		notes[prefix+"capacity"] = "90% of the file system at start (the path does not exist yet)"
	}
	return nil
}

// derive sets *v, where it is zero, to the value the daemon derives from
// the configuration, and notes key with why.
func derive[T comparable](notes config.Notes, key string, v *T, resolved T, why string) {
	var zero T
	if *v == zero {
		*v = resolved
		notes[key] = "derived: " + why
	}
}

// fromMachine notes key, where its value v is zero, with what the daemon
// computes for it at start from the machine, here now: v stays zero.
func fromMachine[T comparable](notes config.Notes, key string, v, now T, why string) {
	var zero T
	if v == zero {
		atStart(notes, key, now, why)
	}
}

// atStart notes key as computed at start from the machine: now here, by why.
func atStart(notes config.Notes, key string, now any, why string) {
	notes[key] = fmt.Sprintf("computed at start from the machine: %v here now (%s)", now, why)
}

func ptr[T any](v T) *T { return &v }
