// Package config is kvhost's configuration: the TOML file an operator writes,
// its defaults, its validation (errors name the file, line and key), and the
// command-line flags that override it.
package config

import (
	"bufio"
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/BurntSushi/toml"

	"github.com/kvhost/kvhost/internal/vllmfs"
	"github.com/kvhost/kvhost/protocol"
)

// ErrInvalid is wrapped by every error about a configuration value.
var ErrInvalid = errors.New("config: invalid")

// invalidError is an error about the configuration other than a
// ValueError: a file the TOML decoder refused, an unknown key, a size or
// duration that does not parse. It reads as a ValueError does,
// "config: FILE:LINE: KEY: ...", and wraps ErrInvalid.
type invalidError struct{ msg string }

func (e *invalidError) Error() string { return "config: " + e.msg }

// Unwrap returns ErrInvalid, so that errors.Is(err, ErrInvalid) holds.
func (e *invalidError) Unwrap() error { return ErrInvalid }

// invalidf returns an invalidError of the formatted message, which
// follows "config: ".
func invalidf(format string, args ...any) error {
	return &invalidError{msg: fmt.Sprintf(format, args...)}
}

// Config is the whole configuration of a kvhost daemon.
type Config struct {
	Server  Server   `toml:"server"`  // [server]: the socket and per-client limits
	Log     Log      `toml:"log"`     // [log]: level and format
	Policy  Policy   `toml:"policy"`  // [policy]: the placement policy
	Engine  Engine   `toml:"engine"`  // [engine]: the storage engine's data path
	Mounts  []Mount  `toml:"mount"`   // [[mount]]: the cache roots; without any, <cache root>/blocks
	GPU     GPU      `toml:"gpu"`     // [gpu]: the data paths for GPU memory
	Metrics Metrics  `toml:"metrics"` // [metrics]: the metrics and probes listener
	Budgets []Budget `toml:"budget"`  // [[budget]]: byte budgets per namespace
	Objects Objects  `toml:"objects"` // [objects]: the object mount on S3
}

// Objects is the object mount ([objects]; docs/object.md): an S3 bucket
// behind the file mounts, shared by the nodes that name it. Off without
// an endpoint. Its keys apply at start.
type Objects struct {
	// Endpoint is the S3 endpoint's URL ("http://rgw.local:7480"); empty:
	// no object mount.
	Endpoint string `toml:"endpoint"`
	// Bucket holds the objects; Prefix goes before their names.
	Bucket string `toml:"bucket"`
	Prefix string `toml:"prefix"`
	// Region signs the requests ("us-east-1" when empty).
	Region string `toml:"region"`
	// AccessKey is the access key id; empty: $KVHOST_S3_ACCESS_KEY.
	AccessKey string `toml:"access_key"`
	// SecretKeyFile is a file holding the secret key (its first line);
	// empty: $KVHOST_S3_SECRET_KEY.
	SecretKeyFile string `toml:"secret_key_file"`
	// CreateBucket makes the bucket at start where it is missing.
	CreateBucket bool `toml:"create_bucket"`
	// RequestTimeout bounds every request (0: 30s).
	RequestTimeout Duration `toml:"request_timeout"`
	// PartSize is a multipart upload's part, and the largest single PUT
	// (0: 16MiB; at least 5MiB).
	PartSize Size `toml:"part_size"`
	// RangeSize is the most one ranged GET reads (0: 4MiB).
	RangeSize Size `toml:"range_size"`
	// Requests bounds the requests in flight (0: 32); Uploads, the files
	// copied at once (0: 4).
	Requests int `toml:"requests"`
	Uploads  int `toml:"uploads"`
	// ListInterval is the period of the listings that learn other nodes'
	// objects (0: 30s; negative: at start only).
	ListInterval Duration `toml:"list_interval"`
	// Capacity bounds the bytes of the objects under the prefix, every
	// node's (0: no bound): an upload past it evicts the least recently
	// used objects first. The first node with one writes it to the bucket;
	// a node without one takes it, a node with another does not start.
	Capacity Size `toml:"capacity"`
}

// Budget is a byte budget of the namespaces of a model id ([[budget]];
// docs/config.md, docs/engine.md "Byte budgets"). They apply at start: a
// reload keeps them and reports a change as needing a restart.
type Budget struct {
	// Model is the model id the budget covers, exactly, or every model id
	// beginning with it less its final "*" where it ends with one
	// ("vllm:meta-llama_Llama-3.1-8B-Instruct:*").
	Model string `toml:"model"`
	// Bytes is the budget: beyond it, evictions take the namespaces'
	// files first. 0: none, only the floor.
	Bytes Size `toml:"bytes"`
	// Floor is what an eviction for another namespace never takes them
	// below: at most Bytes, and all floors within the mounts' capacity.
	Floor Size `toml:"floor"`
}

// Metrics configures the optional HTTP listener serving Prometheus metrics
// (/metrics) and the probes /healthz and /readyz (docs/metrics.md).
type Metrics struct {
	// Listen is the TCP address to listen on, e.g. "127.0.0.1:9400"; empty
	// (the default) serves no metrics.
	Listen string `toml:"listen"`
	// Profiling also serves Go's runtime profiles and execution trace
	// (net/http/pprof) under /debug/pprof/ on the same listener; off by
	// default.
	Profiling bool `toml:"profiling"`
}

// GPU configures the data paths for GPU memory (docs/gpu.md).
type GPU struct {
	// Mode is "auto" (serve GPU memory when a CUDA runtime and a device are
	// found; the default), "off", or "on" (fail start-up without them).
	Mode string `toml:"mode"`
	// CuFile is "auto" (cuFile on mounts where it has a direct path; the
	// staging pipeline elsewhere), "off", or "compat" (also where cuFile
	// runs in compatibility mode, itself a host bounce).
	CuFile string `toml:"cufile"`
	// CUDALibrary, CUDADriverLibrary and CuFileLibrary, if set, are the
	// paths of libcudart, of the driver API's libcuda and of libcufile
	// (default: the usual CUDA locations).
	CUDALibrary       string `toml:"cuda_library"`
	CUDADriverLibrary string `toml:"cuda_driver_library"` // path of libcuda; empty: the usual locations
	CuFileLibrary     string `toml:"cufile_library"`      // path of libcufile; empty: the usual locations
	// StagingMemory bounds the pinned host memory of the GPU staging
	// pipeline, allocated once at start.
	StagingMemory Size `toml:"staging_memory"`
	// Lanes is no longer used: each job of the staging pipeline drives its
	// own CUDA stream. It is still accepted (and validated) so that
	// configurations that set it load; the daemon warns when it is set.
	Lanes int `toml:"lanes"`
	// Depth is the most pinned buffers one job of the staging pipeline
	// holds at once; 0 means 2 (double buffering).
	Depth int `toml:"depth"`
	// Chunk is the bytes of one pipeline stage, a multiple of 4 KiB; 0
	// means 4 MiB.
	Chunk Size `toml:"chunk"`
	// Copy is how the staging pipeline moves a chunk's pages between its
	// pinned buffer and the GPU: "auto" (the default: "batch" where the
	// runtime has it, else "segments"), "batch" (one cudaMemcpyBatchAsync
	// per chunk), "segments" (one cudaMemcpyAsync per page) or "kernel"
	// (one launch of kvhost's copy kernel per chunk: faster copies, but on
	// the GPU's SMs, taking turns with the inference process's kernels).
	Copy string `toml:"copy"`
	// ChecksumOn is where the staging pipeline computes payload checksums
	// of GPU stores and loads: "cpu" (the default: from the file's bytes
	// in host memory) or "gpu" (kvhost's checksum kernel, from the GPU
	// memory the bytes leave or arrive in: the CPU reads none of them,
	// but the kernel runs on the GPU's SMs, taking turns with the
	// inference process's kernels).
	ChecksumOn string `toml:"checksum_on"`
	// Poll is how long a job of the staging pipeline polls for copies it
	// needs done, its thread on a core, before the thread sleeps until
	// they complete (default 500us); 0 sleeps at once.
	Poll Duration `toml:"poll"`
	// RegisterFiles is the most files on memory file systems (tmpfs) the
	// staging pipeline keeps mapped and registered with CUDA, so that a
	// store into a reused file and a load of a file copy between the GPU
	// and the file's pages directly, without a pinned bounce (default
	// 1048576, lowered to what the descriptor and mapping limits allow);
	// 0 registers none.
	RegisterFiles int `toml:"register_files"`
	// RegisterBytes bounds the bytes of those files (their pages stay
	// pinned while registered); 0 means half of the machine's memory.
	RegisterBytes Size `toml:"register_bytes"`
	// IdleRegistrars is how many threads, besides the one that registers
	// those files in the background, register them only while no job of
	// the staging pipeline runs (default 1); 0: none.
	IdleRegistrars int `toml:"idle_registrars"`
}

// Server configures the daemon's Unix socket and per-client limits.
type Server struct {
	// Socket is the path of the Unix socket clients connect to.
	Socket string `toml:"socket"`
	// SocketMode is the permission of the socket file, octal ("0660").
	SocketMode FileMode `toml:"socket_mode"`
	// SocketGroup, if set, is the group that owns the socket.
	SocketGroup string `toml:"socket_group"`
	// MaxClients bounds concurrent connections.
	MaxClients int `toml:"max_clients"`
	// MaxClientsPerPeer bounds the connections of one client process;
	// 0: half of MaxClients, at least 1.
	MaxClientsPerPeer int `toml:"max_clients_per_peer"`
	// MaxDescriptors bounds the clients' descriptors the daemon holds
	// (registered host memory, descriptors sent with frames not yet
	// answered); 0: a quarter of the open-file limit and of
	// vm.max_map_count, whichever is fewer.
	MaxDescriptors int `toml:"max_descriptors"`
	// MaxDescriptorsPerPeer bounds the same for one client process; 0:
	// half of MaxDescriptors.
	MaxDescriptorsPerPeer int `toml:"max_descriptors_per_peer"`
	// MaxPinnedKeys bounds the keys the pins of all clients hold; 0: 4Mi.
	MaxPinnedKeys int `toml:"max_pinned_keys"`
	// MaxPinnedKeysPerPeer bounds the same for one client process; 0:
	// half of MaxPinnedKeys.
	MaxPinnedKeysPerPeer int `toml:"max_pinned_keys_per_peer"`
	// MaxCacheLayers bounds the layers of the caches all clients hold
	// registered; 0: 1Mi.
	MaxCacheLayers int `toml:"max_cache_layers"`
	// MaxCacheLayersPerPeer bounds the same for one client process; 0:
	// half of MaxCacheLayers.
	MaxCacheLayersPerPeer int `toml:"max_cache_layers_per_peer"`
	// MaxNamespacesPerPeer bounds the distinct geometries the
	// connections of one client process hold declared together; 0: 64,
	// what one connection may declare.
	MaxNamespacesPerPeer int `toml:"max_namespaces_per_peer"`
	// MaxInflightJobs bounds a client's unfinished store and load jobs.
	MaxInflightJobs int `toml:"max_inflight_jobs"`
	// MaxInflightBytes bounds the memory the jobs in flight of all
	// clients hold (docs/serve.md); 0: 1 GiB, or four times what one job
	// of MaxFrame holds if that is more.
	MaxInflightBytes Size `toml:"max_inflight_bytes"`
	// MaxInflightBytesPerPeer bounds the same for the jobs of one client
	// process; 0: half of MaxInflightBytes.
	MaxInflightBytesPerPeer Size `toml:"max_inflight_bytes_per_peer"`
	// MaxIncomingBytes bounds the bytes of the frames all clients have
	// the daemon hold while it reads and answers them (docs/serve.md); 0:
	// 256 MiB, or four times MaxFrame if that is more.
	MaxIncomingBytes Size `toml:"max_incoming_bytes"`
	// MaxIncomingBytesPerPeer bounds the same for the frames of one
	// client process; 0: half of MaxIncomingBytes.
	MaxIncomingBytesPerPeer Size `toml:"max_incoming_bytes_per_peer"`
	// MaxRegistrations bounds a client's registered memory regions.
	MaxRegistrations int `toml:"max_registrations"`
	// MaxFrame bounds one protocol frame.
	MaxFrame Size `toml:"max_frame"`
	// ShutdownTimeout is how long SIGTERM waits for in-flight jobs.
	ShutdownTimeout Duration `toml:"shutdown_timeout"`
	// StallTimeout is how long one file operation (open, read, write,
	// fsync, rename...) may stay in flight, or jobs with the data path
	// moving nothing, before the daemon calls itself stalled: /healthz
	// answers 503 and systemd's watchdog is no longer told it lives, so
	// that its supervisor restarts it. 0 never calls it stalled.
	StallTimeout Duration `toml:"stall_timeout"`
	// StatfsTimeout is how long the daemon's start, `kvhost check` and
	// `kvhost config show` wait for a mount's file system to answer
	// statfs, their first call to it, before they take the mount for
	// hung and refuse it (default DefaultStatfsTimeout).
	StatfsTimeout Duration `toml:"statfs_timeout"`
	// MaxHandshakes bounds connections that have not sent their Hello; a
	// new one beyond it closes the oldest.
	MaxHandshakes int `toml:"max_handshakes"`
	// HandshakeTimeout closes a connection that has not sent its whole
	// Hello by then.
	HandshakeTimeout Duration `toml:"handshake_timeout"`
	// FrameTimeout bounds how long a frame that has begun may take to arrive.
	FrameTimeout Duration `toml:"frame_timeout"`
	// IdleTimeout closes a connection that holds no region and no
	// namespace after this long without a frame.
	IdleTimeout Duration `toml:"idle_timeout"`
	// WriteTimeout closes a connection whose replies cannot be written for
	// this long (a client that stopped reading).
	WriteTimeout Duration `toml:"write_timeout"`
	// MaxRegisteredBytes bounds the memory one connection registers (0:
	// the machine's physical memory); each connection is further limited
	// to its share, MaxTotalRegisteredBytes / MaxClients.
	MaxRegisteredBytes Size `toml:"max_registered_bytes"`
	// MaxTotalRegisteredBytes bounds all registrations together (0: 64 TiB).
	MaxTotalRegisteredBytes Size `toml:"max_total_registered_bytes"`
	// MaxDeviceRegisteredBytes bounds the GPU memory all clients together
	// register on each device (0: 256 GiB).
	MaxDeviceRegisteredBytes Size `toml:"max_device_registered_bytes"`
}

// Log configures logging.
type Log struct {
	// Level is debug, info, warn or error.
	Level string `toml:"level"`
	// Format is auto (colour text on a terminal, JSON otherwise), text or json.
	Format string `toml:"format"`
}

// Policy chooses and limits the placement-policy plugin.
type Policy struct {
	// Name is a built-in policy name (lru, lfu, ttl, sharded, tiered) or the path of a
	// .wasm file.
	Name string `toml:"name"`
	// Shards is the number of plugin instances the state is spread over;
	// 0 means 4, at most one per Go processor (GOMAXPROCS: the daemon
	// runs at least its I/O workers plus one, and no fewer than the CPUs).
	Shards int `toml:"shards"`
	// MemoryLimit bounds each instance's linear memory.
	MemoryLimit Size `toml:"memory_limit"`
	// CallTimeout bounds every call into the plugin.
	CallTimeout Duration `toml:"call_timeout"`
	// CacheDir holds compiled plugins; empty means <cache root>/wasm-cache.
	CacheDir string `toml:"cache_dir"`
	// MaxFailures within FailureWindow switch to the native fallback policy.
	MaxFailures   int      `toml:"max_failures"`
	FailureWindow Duration `toml:"failure_window"` // the window MaxFailures are counted in; default 1m
	// LoadTimeout is the longest the start waits for a plugin file's
	// module (compiled, validated, its instances made) before it serves
	// the native fallback policy meanwhile; 0 serves it at once. A
	// built-in policy serves its native build from the start whatever
	// it says. Default 5s.
	LoadTimeout Duration `toml:"load_timeout"`
	// Params are passed to the plugin's kvhost_init as key=value lines.
	Params map[string]any `toml:"params"`
}

// Engine configures the storage engine's data path.
type Engine struct {
	// Fsync makes every store durable (file and directory fsync) before it
	// completes. It costs a device flush per store.
	Fsync bool `toml:"fsync"`
	// IOWorkers is the number of I/O worker threads; 0 means the runtime's
	// GOMAXPROCS at start (the CPUs it finds), at least 2. The daemon runs
	// one Go processor more than its workers (docs/config.md).
	IOWorkers int `toml:"io_workers"`
	// CPUs, if set, pins the I/O workers to these CPUs (e.g. the GPU's NUMA node).
	CPUs []int `toml:"cpus"`
	// RemovalRing is the records the removal feed keeps for its
	// subscribers (routers told of removals); 0 means 65,536.
	RemovalRing int `toml:"removal_ring"`
	// StagingMemory bounds the aligned bounce buffers.
	StagingMemory Size `toml:"staging_memory"`
	// YieldBytes: a thread copying a transfer's bytes (an I/O worker, a
	// GPU staging job) gives its CPU up (sched_yield) after every
	// YieldBytes it copied or checksummed, so that threads woken on that
	// CPU (the daemon's own lookups, the inference server's) wait for
	// about one such copy; 0 never yields (docs/config.md).
	YieldBytes Size `toml:"yield_bytes"`
	// VerifyInterval is how long a lookup trusts a file it checked (stat)
	// before checking it again; 0 checks on every lookup. Loads always check.
	VerifyInterval Duration `toml:"verify_interval"`
	// TempGrace is the age after which a start removes another node's
	// unlocked temporary file (or one without an owner in its name) as
	// abandoned; 0 means the engine's default, 10 minutes. This node's
	// leftovers go as soon as their process is gone, and a temporary file
	// whose writer holds its lock is never removed (docs/engine.md).
	TempGrace Duration `toml:"temp_grace"`
	// RestartHold is how long after start the files found there are not
	// evicted, so that clients that were loading keys when the last
	// daemon went can pin them again first; 0 holds none
	// (docs/config.md).
	RestartHold Duration `toml:"restart_hold"`
	// NodeID names this node in temporary file names on shared mounts
	// (default: the host name). Nodes sharing a mount need distinct ids.
	NodeID string `toml:"node_id"`
	// TickInterval is the period of the policy's tick hook (policies that
	// declare it: ageing, promotion between mounts); 0 means 100ms, a
	// negative duration never ticks.
	TickInterval Duration `toml:"tick_interval"`
	// MountUpdateInterval is how often, at most, changed mount
	// descriptions are sent to a policy that asks for them; 0 means 1s.
	MountUpdateInterval Duration `toml:"mount_update_interval"`
	// ReuseFiles, unless set to false, keeps files evicted from memory
	// file systems for later stores of the same size to write into
	// (spare files: docs/engine.md).
	ReuseFiles *bool `toml:"reuse_files"`
	// LookupTable, unless set to false, keeps a shared lookup table next
	// to the socket: clients map it read-only and answer lookups without
	// a round trip to the daemon (docs/protocol.md, "Shared lookup table").
	LookupTable *bool `toml:"lookup_table"`
	// LookupTableSlots is the table's slot count (8 bytes each; rounded up
	// to a power of two); 0 means DefaultLookupTableSlots. It holds up to
	// three quarters as many keys; past that, clients ask the daemon
	// about keys the table lacks.
	LookupTableSlots int `toml:"lookup_table_slots"`
}

// DefaultStatfsTimeout is server.statfs_timeout where the file sets
// none: how long a mount's file system may take to answer statfs at start
// before the mount is refused as hung (RATIONALE.md, "Why do check and
// the start give a mount's statfs 5 s by default?").
const DefaultStatfsTimeout = 5 * time.Second

// DefaultLookupTableSlots is the shared lookup table's slot count when
// engine.lookup_table_slots is not set: 2 Mi slots, 16 MiB, up to about
// 1.5 million keys.
const DefaultLookupTableSlots = 1 << 21

// Lookups reports whether the daemon keeps a shared lookup table
// (LookupTable unset or true).
func (e Engine) Lookups() bool { return e.LookupTable == nil || *e.LookupTable }

// Reuse reports whether evicted files are kept for reuse (ReuseFiles unset
// or true).
func (e Engine) Reuse() bool { return e.ReuseFiles == nil || *e.ReuseFiles }

// Mount is one cache root.
type Mount struct {
	// Path is the directory files are stored under.
	Path string `toml:"path"`
	// Capacity is the most bytes kvhost stores there; 0 means 90% of the file
	// system's size at start.
	Capacity Size `toml:"capacity"`
	// Eviction starts when usage exceeds HighWatermark × Capacity and frees
	// space down to LowWatermark × Capacity.
	HighWatermark float64 `toml:"high_watermark"`
	LowWatermark  float64 `toml:"low_watermark"` // fraction in (0, HighWatermark); unset: 0.85, or 0.1 below a HighWatermark at or under that
	// Reserve is space kvhost leaves free on the file system: the
	// effective capacity is the smaller of Capacity and the file system's
	// available space plus kvhost's own files, minus Reserve.
	Reserve Size `toml:"reserve"`
	// Preallocate is the most bytes of empty spare files kvhost makes
	// ahead of stores on a memory file system (tmpfs), while no file is
	// in flight, so that stores into a cache with room write into pages
	// that exist (and that the GPU path has registered). Unset or "auto":
	// an eighth of the mount's capacity, at most the larger of 4 GiB and a
	// sixteenth of the machine's memory and 4096 spares of a size, on a
	// memory file system (none elsewhere); 0 makes none.
	Preallocate AutoSize `toml:"preallocate"`
	// DeviceClass tells a tiering policy what the mount is: "memory",
	// "nvme", "ssd", "hdd" or "network"; empty detects it.
	DeviceClass string `toml:"device_class"`
	// IO is "auto" (probe O_DIRECT, fall back to buffered; the default),
	// "direct" or "buffered".
	IO string `toml:"io"`
	// Checksum, if set to false, turns payload checksums off on the mount
	// (default true).
	Checksum *bool `toml:"checksum"`
	// ChecksumEveryLoad, on a memory file system, verifies every load's
	// checksums, even where the file has not changed since this daemon
	// wrote or verified it (default false: those are not summed again).
	ChecksumEveryLoad bool `toml:"checksum_every_load"`
	// LoadReaders is the most files loads read at once from the mount,
	// on a file system other than memory: 0 (the default) tunes it by
	// measured throughput between 1 and engine.io_workers; a number
	// fixes it.
	LoadReaders int `toml:"load_readers"`
	// Layout is "kvhost" (the default: kvhost's own files) or "vllm-fs"
	// (vLLM's fs-tier directory, byte for byte; configured by VLLMFS).
	Layout string `toml:"layout"`
	// Shared says whether other nodes or programs write files into this
	// mount (a shared file system, a second daemon on the directory):
	// then a key missing from the daemon's index may still be on disk, and
	// clients ask the daemon about it instead of taking the shared lookup
	// table's miss as final. Unset: true on network and FUSE file systems
	// and for "vllm-fs" mounts, false elsewhere.
	Shared *bool `toml:"shared"`
	// VLLMFS configures a "vllm-fs" mount: the table [mount.vllm_fs].
	VLLMFS *VLLMFS `toml:"vllm_fs"`
	// ClusterCapacity, if set, is the most bytes every node sharing this
	// mount keeps there together (docs/cluster.md, "Cluster-wide
	// capacity"); 0: each node bounds only its own files (capacity).
	ClusterCapacity Size `toml:"cluster_capacity"`
	// ClusterInterval is how often a node publishes its summary on a
	// mount with a cluster capacity; 0 means 1s.
	ClusterInterval Duration `toml:"cluster_interval"`
}

// Mount layouts.
const (
	LayoutKVHost = "kvhost"
	LayoutVLLMFS = "vllm-fs"
)

// VLLMFS is the [mount.vllm_fs] table of a "vllm-fs" mount: the fs tier's
// fields (as in its config.json; without model_name, the one base
// directory under the mount's path is adopted) and kvhost's binding.
type VLLMFS struct {
	// Namespace is the model id of the kvhost namespace the mount serves
	// (default "vllm-fs:<base directory name>", cut to 128 bytes for a
	// long model name: docs/engine.md).
	Namespace string `toml:"namespace"`
	// RowBytes, if set, is the row size the namespace must have.
	RowBytes Size `toml:"row_bytes"`
	// Rank is the data directory's rank, <base>_r<rank> (default 0, the
	// tier's).
	Rank int `toml:"rank"`

	ModelName     string `toml:"model_name"`      // the model's name; empty adopts the one base directory under the mount's path
	TokensPerHash int    `toml:"tokens_per_hash"` // tokens per block hash
	// BlocksPerFile, TPSize, PPSize, PCPSize and DCPSize default to 1.
	BlocksPerFile   int           `toml:"blocks_per_file"`
	TPSize          int           `toml:"tp_size"`          // tensor-parallel size
	PPSize          int           `toml:"pp_size"`          // pipeline-parallel size
	PCPSize         int           `toml:"pcp_size"`         // prefill-context-parallel size
	DCPSize         int           `toml:"dcp_size"`         // decode-context-parallel size
	Dtype           string        `toml:"dtype"`            // the effective dtype, e.g. "bfloat16"
	KVCacheGroups   []VLLMFSGroup `toml:"kv_cache_groups"`  // one per [[mount.vllm_fs.kv_cache_groups]] table
	InferenceEngine string        `toml:"inference_engine"` // empty means "vllm"
	// ParallelAgnostic leaves "parallel_agnostic": false out of the
	// fields (the tier writes it for layouts that depend on the
	// parallel sizes; default false, so it is written).
	ParallelAgnostic bool   `toml:"parallel_agnostic"`
	ReplicatedLayout bool   `toml:"replicated_layout"` // true writes "replicated_layout": true
	CanonicalFormat  string `toml:"canonical_format"`  // written as "canonical_format" when set
	StorageFormat    string `toml:"storage_format"`    // written as "storage_format" when set
}

// VLLMFSGroup is one [[mount.vllm_fs.kv_cache_groups]] entry.
type VLLMFSGroup struct {
	TokensPerBlock int      `toml:"tokens_per_block"` // tokens in one block of the group
	LayerNames     []string `toml:"layer_names"`      // the group's layer names, as vLLM gives them
}

// Fields returns the fs tier's fields, or nil when model_name is not set
// (the mount adopts the base directory it finds).
func (v *VLLMFS) Fields() *vllmfs.Fields {
	if v == nil || v.ModelName == "" {
		return nil
	}
	one := func(n int) int {
		if n == 0 {
			return 1
		}
		return n
	}
	f := &vllmfs.Fields{
		ModelName: v.ModelName, TokensPerHash: v.TokensPerHash, BlocksPerFile: one(v.BlocksPerFile),
		TPSize: one(v.TPSize), PPSize: one(v.PPSize), PCPSize: one(v.PCPSize), DCPSize: one(v.DCPSize),
		Dtype: v.Dtype, InferenceEngine: v.InferenceEngine, NotParallelAgnostic: !v.ParallelAgnostic,
		ReplicatedLayout: v.ReplicatedLayout, CanonicalFormat: v.CanonicalFormat, StorageFormat: v.StorageFormat,
	}
	for _, g := range v.KVCacheGroups {
		f.KVCacheGroups = append(f.KVCacheGroups, vllmfs.Group{TokensPerBlock: g.TokensPerBlock, LayerNames: g.LayerNames})
	}
	return f
}

// Checksums reports whether payload checksums are on (Checksum unset or true).
func (m Mount) Checksums() bool { return m.Checksum == nil || *m.Checksum }

// Default returns the configuration kvhost runs with when given none: the
// built-in lru policy and one mount under the user's cache directory.
func Default() Config {
	root := DefaultRoot()
	return Config{
		Server: Server{
			Socket:           DefaultSocket(root),
			SocketMode:       0o660,
			MaxClients:       64,
			MaxInflightJobs:  256,
			MaxRegistrations: 256,
			MaxFrame:         4 << 20,
			ShutdownTimeout:  Duration(10 * time.Second),
			StallTimeout:     Duration(time.Minute),
			StatfsTimeout:    Duration(DefaultStatfsTimeout),
			MaxHandshakes:    16,
			HandshakeTimeout: Duration(5 * time.Second),
			FrameTimeout:     Duration(10 * time.Second),
			IdleTimeout:      Duration(time.Minute),
			WriteTimeout:     Duration(10 * time.Second),
		},
		GPU: GPU{Mode: "auto", CuFile: "auto", StagingMemory: 256 << 20, Copy: "auto", ChecksumOn: "cpu", Poll: Duration(500 * time.Microsecond), RegisterFiles: 1 << 20, IdleRegistrars: 1},
		Log: Log{Level: "info", Format: "auto"},
		Policy: Policy{
			Name:          "lru",
			Shards:        0,
			MemoryLimit:   64 << 20,
			CallTimeout:   Duration(100 * time.Millisecond),
			MaxFailures:   3,
			FailureWindow: Duration(time.Minute),
			LoadTimeout:   Duration(5 * time.Second),
		},
		Engine: Engine{StagingMemory: 256 << 20, YieldBytes: 1 << 20, VerifyInterval: Duration(time.Second), RestartHold: Duration(10 * time.Second)},
		Mounts: []Mount{{Path: filepath.Join(root, "blocks"), HighWatermark: DefaultHighWatermark, LowWatermark: DefaultLowWatermark}},
		// Off without an endpoint; these apply once one is set
		// (objstore's defaults).
		Objects: Objects{Region: "us-east-1", RequestTimeout: Duration(30 * time.Second), PartSize: 16 << 20, RangeSize: 4 << 20,
			Requests: 32, Uploads: 4, ListInterval: Duration(30 * time.Second)},
	}
}

// DefaultRoot is the directory kvhost keeps its state under when the
// configuration names none: $XDG_CACHE_HOME/kvhost or ~/.cache/kvhost, else
// a directory under the system's temporary directory.
func DefaultRoot() string {
	if dir, err := os.UserCacheDir(); err == nil {
		return filepath.Join(dir, "kvhost")
	}
	return filepath.Join(os.TempDir(), "kvhost")
}

// DefaultSocket is the socket path used when the configuration names none:
// $KVHOST_SOCKET if that is set, else $XDG_RUNTIME_DIR/kvhost.sock if that
// is set, else root/kvhost.sock. The Go and Python clients use the same
// rule.
func DefaultSocket(root string) string {
	if p := os.Getenv("KVHOST_SOCKET"); p != "" {
		return p
	}
	if dir := os.Getenv("XDG_RUNTIME_DIR"); dir != "" {
		return filepath.Join(dir, "kvhost.sock")
	}
	return filepath.Join(root, "kvhost.sock")
}

// Load reads the TOML file at path over Default() and validates the result.
func Load(path string) (Config, error) {
	src, err := os.ReadFile(path)
	if err != nil {
		return Config{}, fmt.Errorf("config: %w", err)
	}
	return Parse(path, src)
}

// Socket reads the server.socket of the file at path, as the daemon
// would take it (Default's where the file names none), for the commands
// that only talk to a daemon: the rest of the file is not needed to find
// it. rest is the error Load finds in the file (another key's), nil where
// the whole file loads; err says why the socket itself cannot be read: a
// file that cannot be read or is no TOML, a socket that is not a
// non-empty string.
func Socket(path string) (socket string, rest, err error) {
	src, err := os.ReadFile(path)
	if err != nil {
		return "", nil, fmt.Errorf("config: %w", err)
	}
	c, rest := Parse(path, src)
	if rest == nil {
		return c.Server.Socket, nil, nil
	}
	var only struct {
		Server struct {
			Socket *string `toml:"socket"`
		} `toml:"server"`
	}
	if _, err := toml.NewDecoder(bytes.NewReader(src)).Decode(&only); err != nil {
		// Parse's error says where, as for any file: the socket is
		// unreadable when the file is.
		return "", nil, rest
	}
	switch s := only.Server.Socket; {
	case s == nil:
		return Default().Server.Socket, rest, nil
	case *s == "":
		return "", nil, &ValueError{File: path, Line: lineOf(src, "server.socket", 0), Key: "server.socket", Want: "a path", Got: `""`}
	default:
		return *s, rest, nil
	}
}

// Parse is Load for a file already read; name is used in error messages.
func Parse(name string, src []byte) (Config, error) {
	c := Default()
	explicitMounts, mountSets := mountKeys(src)
	if explicitMounts {
		c.Mounts = nil
	}
	md, err := toml.NewDecoder(bytes.NewReader(src)).Decode(&c)
	if err != nil {
		var pe toml.ParseError
		if errors.As(err, &pe) {
			// A value our types refused (sizes, durations, modes) carries
			// our own error; name the key it was given for.
			msg := strings.TrimPrefix(pe.Message, "config: ")
			if hint := unquotedUnitHint(src, pe.Position.Line, pe.LastKey); hint != "" {
				// capacity = 4GiB: TOML's own words ("expected a
				// top-level item to end with a newline ... but got
				// 'G'") name neither the key nor the fix.
				return Config{}, invalidf("%s:%d: %s", name, pe.Position.Line, hint)
			}
			if pe.LastKey != "" && !strings.Contains(msg, pe.LastKey) {
				msg = pe.LastKey + ": " + msg
			}
			return Config{}, invalidf("%s:%d: %s", name, pe.Position.Line, msg)
		}
		// Type mismatches read "toml: line N (last key "k"): message",
		// the message in Go's types (plainTypeError words it in TOML's).
		msg := strings.TrimPrefix(err.Error(), "toml: ")
		var line int
		if _, serr := fmt.Sscanf(msg, "line %d", &line); serr == nil {
			key := ""
			if _, after, ok := strings.Cut(msg, `(last key "`); ok {
				key, _, _ = strings.Cut(after, `"`)
			}
			if i := strings.Index(msg, "): "); i >= 0 {
				msg = plainTypeError(key, msg[i+3:])
				if key != "" {
					msg = key + ": " + msg
				}
			}
			return Config{}, invalidf("%s:%d: %s", name, line, msg)
		}
		return Config{}, invalidf("%s: %s", name, msg)
	}
	if undecoded := md.Undecoded(); len(undecoded) > 0 {
		var unknown []string
		for _, k := range undecoded {
			if len(k) > 2 && k[0] == "policy" && k[1] == "params" {
				continue // the plugin validates its own parameters
			}
			unknown = append(unknown, k.String())
		}
		if len(unknown) > 0 {
			k := unknown[0]
			// The key of a mount is in one of the [[mount]] tables: the
			// first that assigns it.
			line := 0
			for i := 0; line == 0 && i < max(len(mountSets), 1); i++ {
				line = lineOf(src, k, i)
			}
			where := name
			if line > 0 {
				where += fmt.Sprintf(":%d", line)
			}
			return Config{}, invalidf("%s: unknown key %q (known keys are listed in docs/config.md)", where, k)
		}
	}
	for i := range c.Mounts {
		m := &c.Mounts[i]
		sets := func(k string) bool { return i < len(mountSets) && mountSets[i][k] }
		// A value given, 0 included, is Validate's to judge.
		if !sets("high_watermark") {
			m.HighWatermark = DefaultHighWatermark
		}
		if !sets("low_watermark") {
			m.LowWatermark = defaultLowWatermark(m.HighWatermark)
		}
	}
	if err := c.Validate(); err != nil {
		var ve *ValueError
		if errors.As(err, &ve) {
			ve.File, ve.Line = name, lineOf(src, ve.Key, ve.Mount)
		}
		return Config{}, err
	}
	return c, nil
}

// Default watermarks of a mount: eviction starts above DefaultHighWatermark
// of its capacity and frees down to DefaultLowWatermark, or to 0.1 below a
// high watermark given at or under it (half of one at or under 0.1).
const (
	DefaultHighWatermark = 0.95
	DefaultLowWatermark  = 0.85
)

// defaultLowWatermark is the low watermark of a mount that sets none.
func defaultLowWatermark(high float64) float64 {
	switch {
	case high > DefaultLowWatermark:
		return DefaultLowWatermark
	case high > 0.1:
		return high - 0.1
	default:
		return high / 2
	}
}

// mountKeys reports whether src defines mount tables (a [[mount]] in a
// comment or a string does not), and the keys each sets, in order. A file
// that does not parse is Decode's to report.
func mountKeys(src []byte) (defined bool, sets []map[string]bool) {
	var probe struct {
		Mount []map[string]any `toml:"mount"`
	}
	md, err := toml.NewDecoder(bytes.NewReader(src)).Decode(&probe)
	if err != nil || !md.IsDefined("mount") {
		return false, nil
	}
	for _, m := range probe.Mount {
		keys := make(map[string]bool, len(m))
		for k := range m {
			keys[k] = true
		}
		sets = append(sets, keys)
	}
	return true, sets
}

// ValueError says which key holds an unacceptable value and what was expected.
type ValueError struct {
	File string // set when the value came from a file
	Line int    // 0 when unknown
	Key  string // dotted key, e.g. "policy.shards" or "mount.path"
	Want string // what was expected, e.g. "at least 1"
	Got  any    // the value found
	// Mount is, for a key of a mount, the index of its [[mount]] table.
	Mount int
}

// Error names the file, line and key (where known) and what was expected.
func (e *ValueError) Error() string {
	return fmt.Sprintf("config: %s%s: want %s, got %v", fileLine(e.File, e.Line), e.Key, e.Want, e.Got)
}

// fileLine is "FILE:LINE: ", "FILE: " where the line is 0, or "" where
// the file is "": where an error message says a key is.
func fileLine(file string, line int) string {
	switch {
	case file == "":
		return ""
	case line > 0:
		return fmt.Sprintf("%s:%d: ", file, line)
	}
	return file + ": "
}

// Unwrap returns ErrInvalid, so that errors.Is(err, ErrInvalid) holds.
func (e *ValueError) Unwrap() error { return ErrInvalid }

// KeyError is a fault of a key's value in a configuration that loads,
// found by what uses the value: the daemon's start (a group this machine
// lacks, a policy this binary lacks), or the checks running what the
// start runs (a plugin's kvhost_init refusing a [policy.params] key,
// mounts that overlap on disk). It reads "config: FILE:LINE: KEY: ERR",
// as Load's errors do, or names the flag that gave the value.
type KeyError struct {
	File string // "" where the value came from no file
	Line int    // 0 when unknown
	Flag string // the command-line flag that gave the value ("--policy"); "" for none
	Key  string // dotted key, e.g. "policy.params.hot" or "mount.path"
	Err  error  // what is wrong with the value, and the fix
}

// Error names where the value came from, the key and what is wrong.
func (e *KeyError) Error() string {
	if e.Flag != "" {
		return fmt.Sprintf("config: %s (from %s): %v", e.Key, e.Flag, e.Err)
	}
	return fmt.Sprintf("config: %s%s: %v", fileLine(e.File, e.Line), e.Key, e.Err)
}

// Unwrap returns what is wrong with the value, and ErrInvalid.
func (e *KeyError) Unwrap() []error { return []error{e.Err, ErrInvalid} }

// AtKey returns err as a *KeyError of key in the file at path ("": none),
// its line found by reading the file again: for a key of a mount (key
// "mount.path", say), in the file's mount'th [[mount]] table. The line is
// 0 where the file cannot be read or does not set the key.
func AtKey(path, key string, mount int, err error) *KeyError {
	e := &KeyError{File: path, Key: key, Err: err}
	if path != "" {
		if src, rerr := os.ReadFile(path); rerr == nil {
			e.Line = lineOf(src, key, mount)
		}
	}
	return e
}

// MaxSocketPath is the longest server.socket: a Unix socket's address
// (sun_path) holds 108 bytes on Linux, the last a NUL. A longer path
// fails the daemon's bind with a bare "invalid argument".
const MaxSocketPath = 107

// Validate checks every value and returns a *ValueError for the first bad one.
func (c *Config) Validate() error {
	bad := func(key, want string, got any) error { return &ValueError{Key: key, Want: want, Got: got} }
	switch {
	case c.Server.Socket == "":
		return bad("server.socket", "a path", `""`)
	case len(c.Server.Socket) > MaxSocketPath:
		return bad("server.socket", fmt.Sprintf("a path of at most %d bytes (a Unix socket's address holds no more; this one has %d)", MaxSocketPath, len(c.Server.Socket)), strconv.Quote(c.Server.Socket))
	case c.Server.SocketMode&^0o777 != 0 || c.Server.SocketMode&0o600 != 0o600:
		return bad("server.socket_mode", "octal permissions that include owner read and write (e.g. \"0660\")", c.Server.SocketMode)
	case c.Server.MaxClients < 1:
		return bad("server.max_clients", "at least 1", c.Server.MaxClients)
	case c.Server.MaxClientsPerPeer < 0 || c.Server.MaxClientsPerPeer > c.Server.MaxClients:
		return bad("server.max_clients_per_peer", "0 (half of max_clients) to max_clients", c.Server.MaxClientsPerPeer)
	case c.Server.MaxInflightBytes < 0:
		return bad("server.max_inflight_bytes", "a non-negative size (0: automatic)", c.Server.MaxInflightBytes)
	case c.Server.MaxInflightBytesPerPeer < 0 || (c.Server.MaxInflightBytes > 0 && c.Server.MaxInflightBytesPerPeer > c.Server.MaxInflightBytes):
		return bad("server.max_inflight_bytes_per_peer", "0 (half of max_inflight_bytes) to max_inflight_bytes", c.Server.MaxInflightBytesPerPeer)
	case c.Server.MaxDescriptors < 0:
		return bad("server.max_descriptors", "0 (automatic) or more", c.Server.MaxDescriptors)
	case c.Server.MaxDescriptorsPerPeer < 0 || (c.Server.MaxDescriptors > 0 && c.Server.MaxDescriptorsPerPeer > c.Server.MaxDescriptors):
		return bad("server.max_descriptors_per_peer", "0 (half of max_descriptors) to max_descriptors", c.Server.MaxDescriptorsPerPeer)
	case c.Server.MaxPinnedKeys != 0 && c.Server.MaxPinnedKeys < 2*protocol.MaxKeysPerRequest:
		return bad("server.max_pinned_keys", fmt.Sprintf("0 (automatic) or at least %d", 2*protocol.MaxKeysPerRequest), c.Server.MaxPinnedKeys)
	case c.Server.MaxPinnedKeysPerPeer != 0 && (c.Server.MaxPinnedKeysPerPeer < protocol.MaxKeysPerRequest || (c.Server.MaxPinnedKeys > 0 && c.Server.MaxPinnedKeysPerPeer > c.Server.MaxPinnedKeys)):
		return bad("server.max_pinned_keys_per_peer", fmt.Sprintf("0 (half of max_pinned_keys), or %d (the keys of one request) to max_pinned_keys", protocol.MaxKeysPerRequest), c.Server.MaxPinnedKeysPerPeer)
	case c.Server.MaxCacheLayers != 0 && c.Server.MaxCacheLayers < 2*protocol.MaxLayers:
		return bad("server.max_cache_layers", fmt.Sprintf("0 (automatic) or at least %d", 2*protocol.MaxLayers), c.Server.MaxCacheLayers)
	case c.Server.MaxCacheLayersPerPeer != 0 && (c.Server.MaxCacheLayersPerPeer < protocol.MaxLayers || (c.Server.MaxCacheLayers > 0 && c.Server.MaxCacheLayersPerPeer > c.Server.MaxCacheLayers)):
		return bad("server.max_cache_layers_per_peer", fmt.Sprintf("0 (half of max_cache_layers), or %d (the layers of one cache) to max_cache_layers", protocol.MaxLayers), c.Server.MaxCacheLayersPerPeer)
	case c.Server.MaxNamespacesPerPeer < 0:
		return bad("server.max_namespaces_per_peer", "0 (64) or more", c.Server.MaxNamespacesPerPeer)
	case c.Server.MaxInflightJobs < 1:
		return bad("server.max_inflight_jobs", "at least 1", c.Server.MaxInflightJobs)
	case c.Server.MaxRegistrations < 1:
		return bad("server.max_registrations", "at least 1", c.Server.MaxRegistrations)
	case c.Server.MaxFrame < 64<<10 || c.Server.MaxFrame > 1<<30:
		return bad("server.max_frame", "between 64KiB and 1GiB", c.Server.MaxFrame)
	case c.Server.MaxIncomingBytes < 0:
		return bad("server.max_incoming_bytes", "a non-negative size (0: automatic)", c.Server.MaxIncomingBytes)
	case c.Server.MaxIncomingBytesPerPeer < 0 || (c.Server.MaxIncomingBytes > 0 && c.Server.MaxIncomingBytesPerPeer > c.Server.MaxIncomingBytes):
		return bad("server.max_incoming_bytes_per_peer", "0 (half of max_incoming_bytes) to max_incoming_bytes", c.Server.MaxIncomingBytesPerPeer)
	case c.Server.MaxIncomingBytesPerPeer != 0 && c.Server.MaxIncomingBytesPerPeer < c.Server.MaxFrame:
		return bad("server.max_incoming_bytes_per_peer", fmt.Sprintf("0 (half of max_incoming_bytes), or max_frame (%d) to max_incoming_bytes: one frame must fit", int64(c.Server.MaxFrame)), c.Server.MaxIncomingBytesPerPeer)
	case c.Server.MaxIncomingBytesPerPeer == 0 && c.Server.MaxIncomingBytes != 0 && c.Server.MaxIncomingBytes/2 < c.Server.MaxFrame:
		return bad("server.max_incoming_bytes", fmt.Sprintf("0 (automatic) or at least twice max_frame (%d): half of it, a process's share, must hold one frame", 2*int64(c.Server.MaxFrame)), c.Server.MaxIncomingBytes)
	case c.Server.ShutdownTimeout < 0:
		return bad("server.shutdown_timeout", "a non-negative duration", c.Server.ShutdownTimeout)
	case c.Server.StallTimeout < 0:
		return bad("server.stall_timeout", "a non-negative duration (0: never)", c.Server.StallTimeout)
	case c.Server.StatfsTimeout <= 0:
		return bad("server.statfs_timeout", "a positive duration", c.Server.StatfsTimeout)
	case c.Server.MaxHandshakes < 1:
		return bad("server.max_handshakes", "at least 1", c.Server.MaxHandshakes)
	case c.Server.HandshakeTimeout <= 0:
		return bad("server.handshake_timeout", "a positive duration", c.Server.HandshakeTimeout)
	case c.Server.FrameTimeout <= 0:
		return bad("server.frame_timeout", "a positive duration", c.Server.FrameTimeout)
	case c.Server.IdleTimeout <= 0:
		return bad("server.idle_timeout", "a positive duration", c.Server.IdleTimeout)
	case c.Server.WriteTimeout <= 0:
		return bad("server.write_timeout", "a positive duration", c.Server.WriteTimeout)
	case c.Server.MaxRegisteredBytes < 0:
		return bad("server.max_registered_bytes", "a non-negative size", c.Server.MaxRegisteredBytes)
	case c.Server.MaxTotalRegisteredBytes < 0:
		return bad("server.max_total_registered_bytes", "a non-negative size", c.Server.MaxTotalRegisteredBytes)
	case c.Server.MaxDeviceRegisteredBytes < 0:
		return bad("server.max_device_registered_bytes", "a non-negative size", c.Server.MaxDeviceRegisteredBytes)
	}
	switch c.GPU.Mode {
	case "auto", "on", "off":
	default:
		return bad("gpu.mode", "auto, on or off", fmt.Sprintf("%q", c.GPU.Mode))
	}
	switch c.GPU.CuFile {
	case "auto", "off", "compat":
	default:
		return bad("gpu.cufile", "auto, off or compat", fmt.Sprintf("%q", c.GPU.CuFile))
	}
	switch c.GPU.Copy {
	case "auto", "kernel", "batch", "segments":
	default:
		return bad("gpu.copy", "auto, kernel, batch or segments", fmt.Sprintf("%q", c.GPU.Copy))
	}
	switch c.GPU.ChecksumOn {
	case "cpu", "gpu":
	default:
		return bad("gpu.checksum_on", "cpu or gpu", fmt.Sprintf("%q", c.GPU.ChecksumOn))
	}
	if c.GPU.StagingMemory < 8<<20 {
		return bad("gpu.staging_memory", "at least 8MiB", c.GPU.StagingMemory)
	}
	if c.GPU.Lanes < 0 || c.GPU.Lanes > 64 {
		return bad("gpu.lanes", "between 0 (automatic) and 64", c.GPU.Lanes)
	}
	if c.GPU.Depth < 0 || c.GPU.Depth > 64 {
		return bad("gpu.depth", "between 0 (automatic: 2) and 64", c.GPU.Depth)
	}
	if c.GPU.Chunk < 0 || c.GPU.Chunk%4096 != 0 || c.GPU.Chunk > 256<<20 {
		return bad("gpu.chunk", "a multiple of 4KiB up to 256MiB (0: 4MiB)", c.GPU.Chunk)
	}
	if c.GPU.Poll < 0 || c.GPU.Poll > Duration(time.Second) {
		return bad("gpu.poll", "between 0s (sleep at once) and 1s", c.GPU.Poll)
	}
	if c.GPU.RegisterFiles < 0 || c.GPU.RegisterFiles > 1<<20 {
		return bad("gpu.register_files", "between 0 (none) and 1048576", c.GPU.RegisterFiles)
	}
	if c.GPU.IdleRegistrars < 0 || c.GPU.IdleRegistrars > 8 {
		return bad("gpu.idle_registrars", "between 0 (none) and 8", c.GPU.IdleRegistrars)
	}
	switch c.Log.Level {
	case "debug", "info", "warn", "error":
	default:
		return bad("log.level", "debug, info, warn or error", fmt.Sprintf("%q", c.Log.Level))
	}
	switch c.Log.Format {
	case "auto", "text", "json":
	default:
		return bad("log.format", "auto, text or json", fmt.Sprintf("%q", c.Log.Format))
	}
	switch {
	case c.Policy.Name == "":
		return bad("policy.name", "a built-in policy name or a .wasm path", `""`)
	case c.Policy.Shards < 0 || c.Policy.Shards > 64:
		return bad("policy.shards", "between 0 (automatic) and 64", c.Policy.Shards)
	case c.Policy.MemoryLimit < 1<<20 || c.Policy.MemoryLimit > 4<<30:
		return bad("policy.memory_limit", "between 1MiB and 4GiB", c.Policy.MemoryLimit)
	case c.Policy.CallTimeout <= 0:
		return bad("policy.call_timeout", "a positive duration", c.Policy.CallTimeout)
	case c.Policy.MaxFailures < 1:
		return bad("policy.max_failures", "at least 1", c.Policy.MaxFailures)
	case c.Policy.FailureWindow <= 0:
		return bad("policy.failure_window", "a positive duration", c.Policy.FailureWindow)
	case c.Policy.LoadTimeout < 0:
		return bad("policy.load_timeout", "0 or a positive duration", c.Policy.LoadTimeout)
	}
	for k, v := range c.Policy.Params {
		switch v.(type) {
		case string, int64, float64, bool:
		default:
			return bad("policy.params."+k, "a string, number or boolean", fmt.Sprintf("%T", v))
		}
		if strings.ContainsAny(k, "=\n") || strings.HasPrefix(k, "kvhost.") {
			return bad("policy.params."+k, "a key without '=', newline or the reserved prefix kvhost.", k)
		}
	}
	switch {
	case c.Engine.IOWorkers < 0 || c.Engine.IOWorkers > 256:
		return bad("engine.io_workers", "between 0 (automatic) and 256", c.Engine.IOWorkers)
	case c.Engine.RemovalRing < 0 || c.Engine.RemovalRing > 1<<24:
		return bad("engine.removal_ring", "between 0 (65,536 records) and 16,777,216", c.Engine.RemovalRing)
	case c.Engine.StagingMemory < 1<<20:
		return bad("engine.staging_memory", "at least 1MiB", c.Engine.StagingMemory)
	case c.Engine.YieldBytes != 0 && (c.Engine.YieldBytes < 64<<10 || c.Engine.YieldBytes > 1<<30):
		return bad("engine.yield_bytes", "0 (never yield) or between 64KiB and 1GiB", c.Engine.YieldBytes)
	case c.Engine.LookupTableSlots < 0 || c.Engine.LookupTableSlots > 1<<30:
		return bad("engine.lookup_table_slots", "0 (the default) or a slot count up to 1073741824", c.Engine.LookupTableSlots)
	case c.Engine.VerifyInterval < 0:
		return bad("engine.verify_interval", "a non-negative duration", c.Engine.VerifyInterval)
	case c.Engine.TempGrace < 0:
		return bad("engine.temp_grace", "a non-negative duration", c.Engine.TempGrace)
	case c.Engine.RestartHold < 0 || c.Engine.RestartHold > Duration(time.Hour):
		return bad("engine.restart_hold", "a duration between 0s (hold none) and 1h", c.Engine.RestartHold)
	}
	for _, cpu := range c.Engine.CPUs {
		if cpu < 0 {
			return bad("engine.cpus", "CPU numbers ≥ 0", c.Engine.CPUs)
		}
	}
	if c.Metrics.Listen != "" {
		if _, port, err := net.SplitHostPort(c.Metrics.Listen); err != nil || port == "" {
			return bad("metrics.listen", `a TCP address "host:port" (e.g. "127.0.0.1:9400", ":9400")`, fmt.Sprintf("%q", c.Metrics.Listen))
		}
	}
	if o := c.Objects; o.Endpoint != "" {
		switch {
		case !strings.HasPrefix(o.Endpoint, "http://") && !strings.HasPrefix(o.Endpoint, "https://"):
			return bad("objects.endpoint", `an http:// or https:// URL ("http://127.0.0.1:7480")`, fmt.Sprintf("%q", o.Endpoint))
		case o.Bucket == "":
			return bad("objects.bucket", "a bucket name", `""`)
		case o.PartSize != 0 && o.PartSize < 5<<20:
			return bad("objects.part_size", "0 (16MiB) or at least 5MiB, S3's least", o.PartSize)
		case o.Capacity < 0:
			return bad("objects.capacity", "0 (no bound) or a size", o.Capacity)
		case o.RangeSize < 0 || o.Requests < 0 || o.Uploads < 0 || o.RequestTimeout < 0:
			return bad("objects", "range_size, requests, uploads and request_timeout ≥ 0", fmt.Sprintf("%+v", o))
		}
	}
	if len(c.Mounts) == 0 {
		return bad("mount", "at least one [[mount]] table", "none")
	}
	seen := map[string]bool{}
	vllmFS := false // a vllm-fs mount came before
	for i, m := range c.Mounts {
		bad := func(key, want string, got any) error { return &ValueError{Key: key, Want: want, Got: got, Mount: i} }
		switch {
		case vllmFS && m.Layout != LayoutVLLMFS:
			return bad("mount.layout", "every vllm-fs mount after every mount of kvhost's layout", fmt.Sprintf("mount %q after a vllm-fs mount", m.Path))
		case m.Path == "" || !filepath.IsAbs(m.Path):
			return bad("mount.path", "an absolute directory path", fmt.Sprintf("%q", m.Path))
		case seen[filepath.Clean(m.Path)]:
			return bad("mount.path", "each mount once", fmt.Sprintf("%q twice", m.Path))
		case m.Capacity < 0:
			return bad("mount.capacity", "a size ≥ 0", m.Capacity)
		case m.HighWatermark <= 0 || m.HighWatermark > 1:
			return bad("mount.high_watermark", "a fraction in (0, 1]", m.HighWatermark)
		case m.LowWatermark <= 0 || m.LowWatermark >= m.HighWatermark:
			return bad("mount.low_watermark", "a fraction in (0, high_watermark)", m.LowWatermark)
		case m.Reserve < 0:
			return bad("mount.reserve", "a size ≥ 0", m.Reserve)
		case m.Preallocate.Bytes < 0:
			return bad("mount.preallocate", `a size ≥ 0 or "auto"`, m.Preallocate.Bytes)
		case m.IO != "" && m.IO != "auto" && m.IO != "direct" && m.IO != "buffered":
			return bad("mount.io", `"auto", "direct" or "buffered"`, fmt.Sprintf("%q", m.IO))
		case m.LoadReaders < 0 || m.LoadReaders > 256:
			return bad("mount.load_readers", "0 (tuned) or 1..256", m.LoadReaders)
		case !slices.Contains([]string{"", "memory", "nvme", "ssd", "hdd", "network"}, m.DeviceClass):
			return bad("mount.device_class", `"memory", "nvme", "ssd", "hdd" or "network" (or nothing: detected)`, fmt.Sprintf("%q", m.DeviceClass))
		case m.Layout != "" && m.Layout != LayoutKVHost && m.Layout != LayoutVLLMFS:
			return bad("mount.layout", `"kvhost" or "vllm-fs"`, fmt.Sprintf("%q", m.Layout))
		case m.Layout != LayoutVLLMFS && m.VLLMFS != nil:
			return bad("mount.vllm_fs", `only with layout = "vllm-fs"`, "a [mount.vllm_fs] table")
		case m.ClusterCapacity < 0 || (m.ClusterCapacity > 0 && m.Layout == LayoutVLLMFS):
			return bad("mount.cluster_capacity", "a size ≥ 0, on a mount of kvhost's layout", m.ClusterCapacity)
		case m.ClusterInterval < 0:
			return bad("mount.cluster_interval", "a duration ≥ 0", m.ClusterInterval)
		}
		if m.Layout == LayoutVLLMFS {
			if m.Checksum != nil && *m.Checksum {
				return bad("mount.checksum", "unset or false on a vllm-fs mount (the layout has no checksums)", true)
			}
			v := m.VLLMFS
			if v == nil {
				v = &VLLMFS{}
			}
			if v.Rank < 0 || v.RowBytes < 0 {
				return bad("mount.vllm_fs.rank", "a rank and row_bytes ≥ 0", fmt.Sprint(v.Rank, " ", v.RowBytes))
			}
			if v.ParallelAgnostic {
				// vLLM's file mapper then hashes sizes of 1 and writes
				// rank 0's directory, whatever its parallelism.
				for _, f := range []struct {
					key string
					n   int
				}{{"tp_size", v.TPSize}, {"pp_size", v.PPSize}, {"pcp_size", v.PCPSize}, {"dcp_size", v.DCPSize}, {"rank", v.Rank}} {
					if f.n > 1 || (f.key == "rank" && f.n != 0) {
						return bad("mount.vllm_fs."+f.key, "1 (rank 0), or unset, with parallel_agnostic = true (vLLM hashes those, whatever its parallelism)", f.n)
					}
				}
			} else if v.ReplicatedLayout {
				// vLLM's file mapper records a replicated layout only
				// with the parallel sizes collapsed: these fields would
				// name a directory no vLLM writes or reads.
				return bad("mount.vllm_fs.replicated_layout", "false, or parallel_agnostic = true (vLLM's fs tier collapses a replicated layout's parallel sizes)", true)
			}
			if f := v.Fields(); f != nil {
				var fe *vllmfs.FieldError
				if err := f.Validate(); errors.As(err, &fe) {
					key, _, _ := strings.Cut(fe.Field, "[")
					return bad("mount.vllm_fs."+key, fe.Want+" (as in the tier's config.json)", fe.Got)
				} else if err != nil {
					return bad("mount.vllm_fs", "the fs tier's fields", err.Error())
				}
			}
		}
		seen[filepath.Clean(m.Path)] = true
		vllmFS = vllmFS || m.Layout == LayoutVLLMFS
	}
	if err := c.validateBudgets(); err != nil {
		return err
	}
	return c.validateTieredMounts()
}

// validateBudgets checks the [[budget]] tables: each names a model id
// once, with a floor within its bytes, and the floors together fit in
// the capacity of the mounts of kvhost's layout where each sets one (the
// engine checks again at start, against the capacity it finds).
func (c *Config) validateBudgets() error {
	bad := func(key, want string, got any) error { return &ValueError{Key: key, Want: want, Got: got} }
	seen := map[string]bool{}
	var floors Size
	for _, b := range c.Budgets {
		switch {
		case b.Model == "" || b.Model == "*":
			return bad("budget.model", `a model id, or a prefix of one ending in "*"`, strconv.Quote(b.Model))
		case seen[b.Model]:
			return bad("budget.model", "each model id once", fmt.Sprintf("%q twice", b.Model))
		case b.Bytes < 0:
			return bad("budget.bytes", "a size ≥ 0", fmt.Sprintf("%d (budget %q)", b.Bytes, b.Model))
		case b.Floor < 0 || (b.Bytes > 0 && b.Floor > b.Bytes):
			return bad("budget.floor", "a size from 0 to the budget's bytes", fmt.Sprintf("%d, bytes %d (budget %q)", b.Floor, b.Bytes, b.Model))
		}
		seen[b.Model] = true
		floors += b.Floor
	}
	var capacity Size
	for _, m := range c.Mounts {
		if m.Layout == LayoutVLLMFS {
			continue
		}
		if m.Capacity == 0 {
			return nil // the file system's size: known at start
		}
		capacity += m.Capacity
	}
	if floors > capacity {
		largest := slices.MaxFunc(c.Budgets, func(a, b Budget) int { return cmp.Compare(a.Floor, b.Floor) })
		return bad("budget.floor", fmt.Sprintf("floors that sum to at most the mounts' capacity, %d", capacity),
			fmt.Sprintf("%d in all (the largest: %d, budget %q)", floors, largest.Floor, largest.Model))
	}
	return nil
}

// validateTieredMounts checks the mounts the built-in tiered policy's
// hot and cold parameters name, where given, against the mounts of
// kvhost's layout (the mounts the policy is told of). The plugin cannot
// at its start: it learns the mount count from the first namespace, so
// a hot mount beyond them started a daemon that refused every
// namespace, and a cold one beyond them one that never tiered.
func (c *Config) validateTieredMounts() error {
	if c.Policy.Name != "tiered" {
		return nil
	}
	n := 0
	for _, m := range c.Mounts {
		if m.Layout != LayoutVLLMFS {
			n++
		}
	}
	for _, k := range []string{"hot", "cold"} {
		v, ok := c.Policy.Params[k]
		if !ok {
			continue
		}
		i, err := strconv.ParseInt(fmt.Sprint(v), 10, 64)
		if err != nil || i < 0 {
			continue // the plugin names what it wants
		}
		if i >= int64(n) {
			configured := fmt.Sprintf("%d mounts are configured", n)
			if n == 1 {
				configured = "1 mount is configured"
			}
			return &ValueError{Key: "policy.params." + k, Got: i,
				Want: fmt.Sprintf("a mount index from 0 to %d (the tiered policy's %s mount; %s)", n-1, k, configured)}
		}
	}
	return nil
}

// PolicyParams renders Policy.Params as the key=value lines kvhost_init takes.
func (p Policy) PolicyParams() map[string]string {
	out := make(map[string]string, len(p.Params))
	for k, v := range p.Params {
		out[k] = fmt.Sprint(v)
	}
	return out
}

// lineOf finds the line of a dotted key ("policy.shards", "mount.path") in a
// TOML source: the first line assigning the last component inside a table
// whose name is the rest, for a mount's key inside its mount'th [[mount]]
// table. It returns 0 when it cannot tell.
func lineOf(src []byte, key string, mount int) int {
	table, leaf := "", key
	if i := strings.LastIndexByte(key, '.'); i >= 0 {
		table, leaf = key[:i], key[i+1:]
	}
	cur := ""
	mounts := -1 // the [[mount]] tables seen, less one
	inMount := func() bool { return table != "mount" && !strings.HasPrefix(table, "mount.") || mounts == mount }
	sc := bufio.NewScanner(bytes.NewReader(src))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(line, "[") {
			cur = strings.Trim(line, "[] \t")
			if i := strings.IndexByte(cur, '#'); i >= 0 {
				cur = strings.TrimSpace(strings.Trim(cur[:i], "[] \t"))
			}
			if cur == "mount" && strings.HasPrefix(line, "[[") {
				mounts++
			}
			if cur == key && inMount() {
				return n
			}
			continue
		}
		k, _, ok := strings.Cut(line, "=")
		if ok && cur == table && strings.Trim(strings.TrimSpace(k), `"`) == leaf && inMount() {
			return n
		}
	}
	return 0
}
