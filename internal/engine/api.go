// Package engine is kvhost's storage engine: it turns "store these KV-cache
// blocks under these keys" into files and "load these keys into these blocks"
// back, with a placement policy (package host/policy) deciding file names,
// chunk layout, admission and eviction victims, and the engine enforcing
// capacity, atomic publication and integrity.
//
// # Model
//
// A namespace (Declare) is one model geometry at one tensor-parallel rank;
// blocks of different geometries never mix: every file carries the geometry
// fingerprint and its keys, and a file that does not match is a miss. A cache
// (RegisterCache) is the paged KV layout of one worker: one tensor per layer
// in a memory region, blocks scattered. Store and Load name, per key, the
// cache's block ids; the engine derives the segments and moves them through
// the staging pipeline (package staging) into and out of files (docs/format.md).
//
// Store and Load are batched and asynchronous: they validate the request,
// return a Job at once and complete it in the background. Lookup answers how
// many leading keys are stored, as vLLM asks.
//
// docs/engine.md describes the behaviour in full: publication, recovery,
// capacity, the configuration knobs and their cost.
package engine

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/outcome"
	"github.com/kvhost/kvhost/region"
)

// Errors returned by the engine. Returned errors wrap them; test with errors.Is.
var (
	// ErrClosed: the engine is closed or closing.
	ErrClosed = errors.New("engine: closed")
	// ErrInvalid: a request, geometry, tensor or configuration is not valid.
	ErrInvalid = errors.New("engine: invalid argument")
	// ErrUnknownNamespace: the namespace id was not returned by Declare.
	ErrUnknownNamespace = errors.New("engine: unknown namespace")
	// ErrUnknownCache: the cache id was not returned by RegisterCache.
	ErrUnknownCache = errors.New("engine: unknown cache")
	// ErrNoSpace: a store could not get space on its mount, even after
	// eviction. The error names the mount.
	ErrNoSpace = errors.New("engine: no space")
	// ErrNotFound: a key is not stored (or its file vanished).
	ErrNotFound = errors.New("engine: not found")
	// ErrMismatch: a file exists under the key's name but belongs to another
	// geometry or key; it is treated as a miss.
	ErrMismatch = errors.New("engine: file does not match the request")
	// ErrCorrupt: a file failed its header or payload checksum (read again
	// into private memory, so that a client writing its destination blocks
	// cannot make a good file look corrupt); the entry is dropped and the
	// file removed.
	ErrCorrupt = errors.New("engine: corrupt file")
	// ErrDestinationChanged: a loaded key's checksum, computed from its
	// destination blocks, did not match, but the file verifies when read
	// again into private memory: the client's own memory (its
	// client-writable blocks) changed during the load. The file is good
	// and stays; the key's blocks hold no good copy of it.
	ErrDestinationChanged = errors.New("engine: the destination blocks changed during the load (the file verifies)")
	// ErrPolicy: the policy failed or returned something the engine refused.
	ErrPolicy = errors.New("engine: policy")
	// ErrLimit: a request is valid but would pass a bound of the
	// engine's (Config.MaxNamespaces): it may succeed once what counts
	// against the bound is released. The error names the bound.
	ErrLimit = errors.New("engine: limit exceeded")
	// ErrLocked: Config.LockFile is locked by another process (another
	// daemon on this node).
	ErrLocked = errors.New("engine: locked by another process")
	// ErrInFlight: Close gave up waiting for jobs, calls or background
	// work still in flight (a hung file system): the engine closes its
	// parts, the movers and the node lock among them, only once they
	// return. Until then, nothing they may use (a data path's GPU
	// memory) may be closed.
	ErrInFlight = errors.New("engine: still in flight")
)

// NamespaceID identifies a declared namespace: a geometry (fingerprint). It is
// small and dense, stable for the life of the engine, and equals the
// NamespaceRecord.NS the policy sees.
type NamespaceID uint32

// CacheID identifies a registered paged KV cache.
type CacheID uint64

// JobID identifies a store or load job, unique for the life of the engine.
type JobID uint64

// Mount is one storage root the engine writes under.
type Mount struct {
	// Path is the root directory. It is created if missing.
	Path string
	// Capacity is the most bytes (file lengths) the engine keeps under Path;
	// 0 means the size of the file system (statfs) at Open.
	Capacity int64
	// CapacityDerived says that Capacity was computed (kvhost's default of
	// 90% of the file system), not configured: Open then does not warn
	// that it is more than the file system can hold.
	CapacityDerived bool
	// HighWatermark and LowWatermark are fractions of Capacity: when usage
	// would cross High, the engine evicts until it is at or below Low. Zero
	// values mean 0.95 and 0.85.
	HighWatermark, LowWatermark float64
	// NoDirect disables O_DIRECT on this mount even where the probe says the
	// file system supports it (the same as IO = IOBuffered).
	NoDirect bool
	// IO chooses the I/O mode: IOAuto (the default, "" too) probes O_DIRECT
	// at Open and falls back to buffered I/O where the file system refuses
	// it or the probe fails (a full file system); IODirect forces O_DIRECT
	// (Open fails if the file system refuses it); IOBuffered uses the page
	// cache.
	IO string
	// NoChecksum turns payload checksums off on this mount (files are
	// flagged unchecked), as Config.NoChecksum does for every mount.
	NoChecksum bool
	// ChecksumEveryLoad verifies every load's checksums on a memory file
	// system. By default a load there takes the layers this engine wrote
	// (and summed) or verified as verified while the file's ctime has not
	// changed since (checked.go).
	ChecksumEveryLoad bool
	// LoadReaders bounds the files loads read at once from the mount, on
	// a file system other than memory (package iotune): 0 tunes the
	// bound by measured throughput between 1 and Config.IOWorkers; a
	// number fixes it (at most IOWorkers). Memory file systems are not
	// bounded.
	LoadReaders int
	// Reserve is space the engine leaves free on the file system: the
	// effective capacity is the smaller of Capacity and the file system's
	// available space plus the engine's own files, minus Reserve.
	Reserve int64
	// VLLMFS, if set, makes the mount a vllm-fs mount: it holds vLLM's
	// fs-tier directory byte for byte and serves one namespace
	// (docs/engine.md, "vllm-fs mounts"). Such mounts come after every
	// kvhost mount in Mounts.
	VLLMFS *VLLMFS
	// DeviceClass is the mount's device class as the policy sees it
	// (abi.MountRecord.Class): "memory", "nvme", "ssd", "hdd" or
	// "network"; empty detects it (statfs, sysfs).
	DeviceClass string
	// Preallocate is the most bytes of spare files the engine makes ahead
	// of stores on a memory file system in kvhost's layout (ignored
	// elsewhere, and with Config.NoReuse): while no file is in flight,
	// it makes empty files of the sizes stores will write (for each
	// namespace storing there, a file of a whole group of its keys, Policy
	// keys_per_file: guessed from its declaration where one mount makes
	// spares ahead, then taken from its stores; docs/engine.md), with
	// their pages allocated and shown to the movers (the GPU path
	// registers them), this many bytes split evenly between those
	// namespaces, until the spares would take the mount past its low
	// watermark; later
	// stores of that size write into them (docs/engine.md, "Spare files
	// made ahead"). 0 makes none; PreallocateAuto lets the engine choose.
	Preallocate int64
	// ClusterCapacity, if set, bounds the files of every node sharing the
	// mount together (docs/cluster.md, "Cluster-wide capacity"): each
	// node publishes a summary of its own files under .kvhost-cluster in
	// the mount every ClusterInterval (0: DefaultClusterInterval), and
	// removes only its own files, those ranked lowest across the cluster.
	// The watermarks apply to it too. Nodes need distinct NodeIDs.
	ClusterCapacity int64
	// ClusterInterval is how often the node publishes its summary on a
	// mount with a ClusterCapacity (0: DefaultClusterInterval).
	ClusterInterval time.Duration
}

// PreallocateAuto is a Mount.Preallocate that lets the engine choose: on
// a memory file system where it keeps spares, AutoPreallocate of the
// mount's capacity at Open, in at most MaxAutoSpareFiles spares of a size;
// elsewhere none.
const PreallocateAuto int64 = -1

// MaxAutoPreallocate is the most bytes PreallocateAuto makes ahead on a
// machine of at most 64 GiB of memory; larger machines allow a sixteenth
// of their memory (AutoPreallocate).
const MaxAutoPreallocate int64 = 4 << 30

// AutoPreallocate is the budget PreallocateAuto gives a mount that keeps
// spares, of capacity bytes on a machine of memory bytes (0: unknown): an
// eighth of the capacity, at most the larger of MaxAutoPreallocate and a
// sixteenth of the memory. A burst of stores larger than the spares
// writes fresh files, which reach the GPU path's fast path only once
// registered: a machine with memory to spare holds more of a burst
// (docs/engine.md, "Spare files made ahead").
func AutoPreallocate(capacity, memory int64) int64 {
	return max(0, min(max(MaxAutoPreallocate, memory/16), capacity/8))
}

// AutoPreallocateMax is the most PreallocateAuto's budget grows to where
// bursts of stores are larger than AutoPreallocate: a quarter of the
// capacity, at most the larger of MaxAutoPreallocate and an eighth of the
// memory (0: unknown). The budget follows the largest recent bursts
// within it (docs/engine.md, "Spare files made ahead").
func AutoPreallocateMax(capacity, memory int64) int64 {
	return max(0, min(max(MaxAutoPreallocate, memory/8), capacity/4))
}

// MaxAutoSpareFiles is the most spares of one size PreallocateAuto keeps
// made ahead: small keys would otherwise make tens of thousands of files,
// each one offered to the GPU path's registrar, whose registered files are
// bounded (gpu.register_files).
const MaxAutoSpareFiles = 4096

// KeySet mirrors the keys of the engine's index (Engine.MirrorKeys): fp is
// the fingerprint of the key's namespace (protocol Declared.Fingerprint).
// Its methods are called with the engine's lock held, in the order the
// index changes: they must be quick and must not call the engine.
type KeySet interface {
	// Add is called for a key the index gains (and, at MirrorKeys, for
	// every key it holds).
	Add(fp uint64, key string)
	// Remove is called for a key the index loses (its file dropped,
	// replaced or vanished).
	Remove(fp uint64, key string)
}

// Config configures an Engine. The zero value of every optional field is a
// sensible default.
type Config struct {
	// Mounts are the storage roots, in the order the policy's mount indices
	// refer to. At least one is required.
	Mounts []Mount
	// Policy is the placement policy. The engine does not close it.
	Policy policy.Policy
	// NewPolicy, used when Policy is nil, builds the policy from the
	// engine's index (policy hosts need one); the engine closes it.
	NewPolicy func(idx policy.Index) (policy.Policy, error)
	// Fsync makes every store durable before it is reported stored: fsync of
	// every directory the store creates and of its parent, fsync of the
	// file, rename, fsync of the directory. It costs one or two device
	// flushes per file (docs/engine.md).
	Fsync bool
	// VerifyInterval lets Lookup trust an entry whose file was checked (a
	// stat: same inode, same size) within the interval, instead of checking
	// it again. 0 checks every hit of every lookup. A file removed or
	// replaced behind the engine's back then stays a hit for at most the
	// interval, and is a miss once checked; a load always opens the file
	// and checks its header, so it never reports a vanished or replaced
	// file loaded.
	VerifyInterval time.Duration
	// NoChecksum skips the CRC-32C of payloads on store (files are flagged
	// as unchecked) and skips verification on load. Headers are always
	// checksummed.
	NoChecksum bool
	// NoReuse removes evicted files on memory file systems instead of
	// keeping them for later stores of the same size to write into
	// (spare files: docs/engine.md).
	NoReuse bool
	// Memory is the machine's memory in bytes, which bounds the spares
	// PreallocateAuto makes ahead (AutoPreallocate); 0 reads it from the
	// kernel (sysinfo).
	Memory int64
	// IOWorkers is the number of I/O workers: files in flight (default:
	// DefaultIOWorkers).
	IOWorkers int
	// CPUs, if set, pins the I/O workers to these CPUs (e.g. the GPU's NUMA
	// node), round-robin.
	CPUs []int
	// YieldBytes: an I/O worker gives its CPU up (sched_yield) after every
	// YieldBytes it moved (HostSpec.YieldBytes); 0 never.
	YieldBytes int64
	// StagingBytes bounds the memory of bounce buffers (default 64 MiB); it
	// is used only when segments cannot go to the file directly.
	StagingBytes int64
	// TempGrace is the age after which Open removes an unlocked temporary
	// file of another node (or one without an owner in its name) as
	// abandoned (default DefaultTempGrace). This node's own leftovers go
	// as soon as their process is gone; a file whose flock is held is never
	// removed (docs/engine.md, "Temporary files").
	TempGrace time.Duration
	// RestartHold, if positive, pins every file Open finds for that long
	// after it returns: none is evicted (by a store or the cluster's
	// count), demoted, promoted or moved to make room meanwhile, so that
	// a client that was loading keys when the last process went can pin
	// them again before the room is needed (a store that finds no other
	// room fails with ErrNoSpace). Delete still removes a held file.
	// HeldFound reports the files still held. With a LockFile, restarts
	// do not re-arm it: the hold's start is kept in LockFile+".hold", and
	// an Open whose predecessor ran for less than RestartHold holds only
	// for what is left of the hold running (none once it is over); a
	// process that runs for RestartHold marks it over (hold.go).
	RestartHold time.Duration
	// NodeID names this node in temporary file names (default: the host
	// name). Nodes sharing a mount must have distinct ids.
	NodeID string
	// PolicyName names the placement policy (a built-in's name, or a
	// plugin's file) in this node's summaries on a cluster mount, so that
	// a node beside one of another policy warns: their ranks do not
	// compare (docs/cluster.md). "" says none.
	PolicyName string
	// LockFile, if set, is a node-local file Open creates and locks
	// (flock, exclusive, not waiting) before it touches any mount, and
	// holds until Close: a second engine given the same file fails with
	// ErrLocked before it cleans or writes anything.
	LockFile string
	// MaxNamespaces bounds the namespaces declared and not yet released
	// at one time (default DefaultMaxNamespaces): each one holds state in
	// the engine and in every policy shard.
	// Namespaces of files found on disk do not count until declared.
	// Declare refuses a new one beyond it with ErrLimit.
	MaxNamespaces int
	// Budgets are byte budgets per namespace (budget.go, docs/engine.md
	// "Byte budgets"): at most one budget applies to a namespace, the one
	// whose Model matches its model id (Budget.Matches) with the longest
	// pattern. Open refuses a budget without a pattern, one whose floor
	// exceeds its bytes, two of one pattern, and floors whose sum exceeds
	// the mounts' capacity. They apply at Open: a reload keeps them.
	Budgets []Budget
	// Logger receives the engine's logs (default: slog.Default()).
	Logger *slog.Logger
	// Host builds the CPU path, the mover of host memory (called once, at
	// Open; required): the daemon's builds the staging pipeline.
	Host HostFactory
	// Movers builds, per region kind, the data mover of each mount (called
	// once per mount at Open): region.KindDevice for GPU paths, or
	// region.KindHost to replace the CPU staging pipeline. Without an entry
	// for a kind, caches in that kind of memory are refused.
	Movers map[region.Kind]MoverFactory
	// Objects is the object mount behind the file mounts (objects.go),
	// or nil for none: keys no file holds are loaded from it, and every
	// one-key file a store publishes is told to it.
	Objects Objects
	// ObjectKeys bounds the keys loads read from the object mount at
	// once (0: DefaultObjectKeys, at least IOWorkers). They wait on the
	// network, not on a disk or a CPU: they take no file slot, which
	// IOWorkers bounds.
	ObjectKeys int
	// Observer, if set, is told about every finished job (metrics).
	Observer Observer
	// FS is the file system (default fsys.OS); tests inject faults here.
	FS fsys.FS
	// Now is the clock for access times (default time.Now).
	Now func() time.Time
	// TickInterval is the period of the policy's tick hook
	// (abi.FeatureTick): ageing and background moves, such as promotions.
	// 0 means DefaultTickInterval; negative calls no tick. Policies without
	// the hook are never called.
	TickInterval time.Duration
	// MountUpdateInterval is how often, at most, a changed mount
	// description is sent to the policy (abi.FeatureMounts); default
	// DefaultMountUpdateInterval, negative sends only the one at Open.
	MountUpdateInterval time.Duration
}

// Budget is a byte budget of the namespaces whose model id matches Model
// (Config.Budgets). Beyond Bytes, the files of the namespaces it covers
// are the first an eviction takes, in the policy's order. Floor, at most
// Bytes, is what an eviction never takes them below (whichever store it
// makes room for): a store that finds no other room fails with
// ErrNoSpace naming the budget and its floor.
type Budget struct {
	// Model is the model id (Geometry.Model) the budget covers, exactly,
	// or every model id that begins with it less its final "*" where it
	// ends with one ("vllm:meta-llama_Llama-3.1-8B-Instruct:*": every identity
	// of that model the vLLM tier declares).
	Model string
	// Bytes is the budget: the bytes the namespaces hold before an
	// eviction takes their files first. 0: no budget, only the floor.
	Bytes int64
	// Floor is the bytes an eviction never takes them below (0: none).
	Floor int64
}

// BudgetStats is the use of one budget (Stats.Budgets).
type BudgetStats struct {
	Model  string // the budget's pattern (Budget.Model)
	Bytes  int64  // the bytes of the indexed files of the namespaces it covers
	Budget int64  // Budget.Bytes
	Floor  int64  // Budget.Floor
	// Over is how many times an eviction took a file of its namespaces
	// because they were over the budget.
	Over int64
	// Kept is how many times an eviction skipped a file of its
	// namespaces because taking it would cross the floor.
	Kept int64
}

// DefaultMaxNamespaces is Config.MaxNamespaces when it is zero.
const DefaultMaxNamespaces = 1024

// LayerTensor is the KV-cache tensor of one layer in a paged cache: block b
// of plane p (0 = K, 1 = V; MLA has only plane 0) starts at
// Offset + p*PlaneStride + b*BlockStride in Region and is
// Geometry.BlockBytes() long. vLLM's [2, num_blocks, block_size, heads,
// head_size] layout has PlaneStride = NumBlocks*BlockBytes and BlockStride =
// BlockBytes; [num_blocks, 2, ...] has BlockStride = 2*BlockBytes and
// PlaneStride = BlockBytes.
type LayerTensor struct {
	// Region is the memory the tensor lives in; the layers of one cache
	// are all in memory of one kind.
	Region region.Region
	// Offset is where block 0 of plane 0 starts in Region, in bytes.
	Offset int64
	// BlockStride is the distance in bytes from one block of a plane to
	// the next (at least BlockBytes where NumBlocks > 1).
	BlockStride int64
	// PlaneStride is the distance in bytes from the K plane to the V plane
	// (at least BlockBytes; unused with MLA's single plane).
	PlaneStride int64
	// NumBlocks is the number of GPU blocks in the tensor; block ids in
	// requests must be below it.
	NumBlocks int
}

// StoreRequest stores Keys[i] from the cache blocks Blocks[i]
// (len(Blocks[i]) == Geometry.BlocksPerKey()).
type StoreRequest struct {
	// Cache is the registered cache (Engine.RegisterCache) the blocks are
	// read from.
	Cache CacheID
	// Keys are the keys to store, each 1..abi.MaxKeyLen bytes.
	Keys [][]byte
	// Blocks[i] are the block ids holding Keys[i], in order; each is
	// below every layer tensor's NumBlocks.
	Blocks [][]int
}

// NoBlock, as a block id of a LoadRequest, says that block of the key is
// not loaded (the protocol's NoBlock): nothing is written for it, but the
// whole key is still read and its payload checksum verified. A store may
// not carry it.
const NoBlock = -1

// LoadRequest loads Keys[i] into the cache blocks Blocks[i].
type LoadRequest struct {
	// Cache is the registered cache (Engine.RegisterCache) the blocks are
	// written to.
	Cache CacheID
	// Keys are the keys to load, each 1..abi.MaxKeyLen bytes.
	Keys [][]byte
	// Blocks[i] are the block ids Keys[i] is loaded into
	// (Geometry.BlocksPerKey() of them, each below every layer tensor's
	// NumBlocks, or NoBlock for a block of the key that is not loaded;
	// at least one of them not NoBlock); no block may appear twice in
	// one request.
	Blocks [][]int
	// Layers, when not zero, restricts the load to those layers of every
	// key: only their bytes are read, moved and verified (with the file's
	// per-layer checksums where it has them, else through the key's
	// checksum, for which the key's other layers are read too but never
	// written); the other layers of the blocks are left as they are. The
	// zero value loads every layer.
	Layers LayerRange
}

// LayerRange is the layers [First, First+Count) of a load; the zero value
// is every layer.
type LayerRange struct {
	// First is the first layer of the range (0 when Count is 0).
	First int
	// Count is the number of layers; 0 means every layer.
	Count int
}

// all reports whether r is the zero value: every layer.
func (r LayerRange) all() bool { return r.Count == 0 }

// tail reports whether r is the last layers of a model of layers layers,
// after the first: the last load of a layer-wise step (loadOrder).
func (r LayerRange) tail(layers int) bool {
	return r.Count > 0 && r.First > 0 && r.First+r.Count == layers
}

// of is r's layers of a file of layers layers, as [first, end).
func (r LayerRange) of(layers int) (first, end int) {
	if r.all() {
		return 0, layers
	}
	return r.First, r.First + r.Count
}

// String writes r as [first, first+count), or "all layers".
func (r LayerRange) String() string {
	if r.all() && r.First == 0 {
		return "all layers"
	}
	return fmt.Sprintf("layers [%d, %d)", r.First, r.First+r.Count)
}

// check validates r against a namespace of layers layers.
func (r LayerRange) check(layers int) error {
	if r.Count == 0 {
		if r.First != 0 {
			return fmt.Errorf("%w: layer range first %d with count 0: count 0 means every layer, first must be 0 then", ErrInvalid, r.First)
		}
		return nil
	}
	if r.First < 0 || r.Count < 1 || r.First+r.Count > layers {
		return fmt.Errorf("%w: layer range first %d count %d: want 0 <= first, count >= 1, first+count <= %d layers", ErrInvalid, r.First, r.Count, layers)
	}
	return nil
}

// Outcome is what happened to one key of a job: the vocabulary's
// (outcome.Outcome), which the wire protocol and the metrics speak too.
// The engine never reports a cancelled outcome: a key of a cancelled job
// fails with context.Canceled, which the server sends as cancelled.
type Outcome = outcome.Outcome

// Outcomes of a key in a job (outcome.Pending, ...: documented there).
const (
	OutcomePending     = outcome.Pending     // not finished; never in a finished job's result
	OutcomeStored      = outcome.Stored      // written and published
	OutcomePresent     = outcome.Present     // already stored; nothing written
	OutcomeNotAdmitted = outcome.NotAdmitted // the policy declined the key
	OutcomeLoaded      = outcome.Loaded      // read into its blocks and verified
	OutcomeMissing     = outcome.Missing     // not stored; its blocks not written
	OutcomeFailed      = outcome.Failed      // failed (KeyResult.Err says why)
)

// KeyResult is the outcome of one key.
type KeyResult struct {
	Outcome Outcome // what happened to the key
	Err     error   // set when Outcome is OutcomeFailed (or explains a miss)
}

// Result is the outcome of a finished job.
type Result struct {
	Keys     []KeyResult   // one per request key, in request order
	Bytes    int64         // payload bytes moved
	Duration time.Duration // from submission to completion
}

// Err joins the errors of every failed key, or returns nil.
func (r Result) Err() error {
	var errs []error
	for _, k := range r.Keys {
		if k.Outcome == OutcomeFailed && k.Err != nil {
			errs = append(errs, k.Err)
		}
	}
	return errors.Join(errs...)
}

// Count returns how many keys ended with outcome o.
func (r Result) Count(o Outcome) int {
	n := 0
	for _, k := range r.Keys {
		if k.Outcome == o {
			n++
		}
	}
	return n
}

// LoadArm is one way of reading a disk mount's loads that tuning
// measured: Readers files at once, through the page cache or not, at
// Rate bytes/s (whole files while loads waited for the mount); Home
// says tuning settled on it.
type LoadArm struct {
	Readers  int
	Buffered bool
	Rate     float64
	Home     bool
}

// MountStats describes one mount.
type MountStats struct {
	// Path is the mount's root (Mount.Path made absolute).
	Path string
	// Capacity is the effective limit: the smaller of Configured (or the
	// file system's size) and what the file system can hold for the
	// engine (available space plus its own files, minus Reserve).
	Capacity   int64
	Configured int64 // Mount.Capacity (0: the file system's size)
	Reserve    int64 // Mount.Reserve: bytes left free on the file system
	// Used is the bytes of published files, of reservations of stores in
	// flight, and of files dropped from the index (evicted, deleted, moved
	// away) that are not yet removed.
	Used    int64
	Entries int // the mount's files in the index
	// SpareFiles and SpareBytes are the evicted files kept for stores to
	// write into (memory file systems; not part of Used).
	SpareFiles int
	SpareBytes int64 // their total size
	// Preallocate is the most bytes of spares the engine makes ahead of
	// stores on this mount now (Mount.Preallocate, PreallocateAuto
	// resolved and grown after larger bursts of stores; 0 where it makes
	// none).
	Preallocate int64
	Direct      bool // O_DIRECT is used on this mount
	Memory      bool // a memory file system (tmpfs): the kernel's I/O is a CPU copy
	// Class is the mount's device class, configured (Mount.DeviceClass)
	// or detected: "memory", "nvme", "ssd", "hdd", "network" or "unknown".
	Class     string
	IO        string // "direct" or "buffered"
	Backend   string // the data mover of host memory on this mount ("staging")
	Checksums bool   // payload checksums are written and verified
	Layout    string // LayoutKVHost or LayoutVLLMFS
	// MovedIn and MovedOut count the files moved to and from the mount
	// between tiers (demotions, promotions, tick moves).
	MovedIn, MovedOut uint64
	// Namespace is the model id a vllm-fs mount serves; Base its base
	// directory's name (both empty on a kvhost mount).
	Namespace, Base string
	// LoadReaders is the most files loads read at once from the mount
	// now (Mount.LoadReaders, tuned where 0); 0 on a memory file
	// system, which has no such bound. LoadBuffered says that loads read
	// through the page cache now (tuning may choose it on a local disk
	// read with O_DIRECT by default). LoadReadersChanged counts the
	// times tuning moved either. LoadRate is the rate tuning last
	// measured for the readers now (bytes/s of whole files while loads
	// waited for the mount); 0 until measured.
	LoadReaders        int
	LoadBuffered       bool
	LoadReadersChanged uint64
	LoadRate           float64
	// LoadArms are the arms tuning measured (each count and mode of the
	// load readers, with its last rate), ordered by mode then count;
	// Home marks the one it settled on, which the arm now may differ
	// from while a neighbour is measured again. Empty until measured.
	LoadArms []LoadArm
	// StoresFailing says that the mount refuses stores: its most recent
	// stores failed for a reason of the mount's own, and none succeeded
	// since; nil while they succeed.
	StoresFailing *StoreFailure
}

// StoreFailure is a mount that refuses stores: the files stored or moved
// there (a move between mounts writes its copy as a store writes its
// file) most recently failed for a reason of the mount's own — a
// read-only file system, an I/O error, no space with nothing left to
// evict — not one of the client's (a cancelled job, a fault in its
// memory), the policy's or a GPU's. The next store or move that succeeds
// there ends it. Open also starts one on a mount it finds read-only or
// without room (Stores 0).
type StoreFailure struct {
	// Since is when the first of these failures happened (or Open found
	// the mount refusing); Last when the latest did.
	Since, Last time.Time
	// Stores counts the files whose store or move there failed so since
	// the last one that succeeded.
	Stores uint64
	// Err is the latest failure's text (Open's finding, before any).
	Err string
	// room is the size of the file whose store or move failed last for
	// lack of room, or 0 for a failure of another kind (reprobe).
	room int64
}

// Stats are the engine's counters since Open.
type Stats struct {
	Mounts  []MountStats // one per mount, in Config.Mounts order
	Entries int          // files in the index
	Keys    int          // keys in the index
	Stores  uint64       // keys written to files by stores
	Loads   uint64       // keys loaded (read and verified)
	Hits    uint64       // keys found by Lookup or Load
	Misses  uint64       // keys not found by Lookup, Load or Pin
	// Evictions counts files deleted to make room; a victim moved to
	// another mount instead is a demotion (Tiering.Demotions): the key
	// stays stored.
	Evictions  uint64
	Reused     uint64 // stores that wrote into a spare file instead of a fresh one
	SparesMade uint64 // spare files made ahead of stores (Mount.Preallocate)
	Failures   uint64 // keys that ended OutcomeFailed
	Corrupt    uint64 // files dropped because they failed verification
	Vanished   uint64 // files found missing or replaced behind the engine's back
	// RemoveFailures counts data files, spare files and temporary files
	// whose removal failed (an unlink, or the open and header read before
	// it, refused: EACCES, EIO, a read-only file system), each file once,
	// at its first failure. Such a file stays counted as used on its mount; the next
	// eviction there tries again, and later ones at most once every 10
	// seconds, whose failures are not counted again.
	RemoveFailures uint64
	BytesWritten   uint64 // payload bytes stored (no headers or padding)
	BytesRead      uint64 // payload bytes of the keys loaded
	// LayerLoadsByKey counts the keys of layer-range loads
	// (LoadRequest.Layers) verified by the whole key's checksum, from
	// files without layer sums: their other layers were read too (the
	// slow way; BytesRead counts those bytes).
	LayerLoadsByKey uint64
	// LoadKeysCheckedBefore counts the keys loads from a memory mount
	// moved without summing them again: layers this engine wrote or
	// verified, the file unchanged since (Mount.ChecksumEveryLoad).
	LoadKeysCheckedBefore uint64
	// FilesVerifiedAhead counts the files found at start on a memory
	// mount that the engine verified in the background before their
	// first load, so that their loads take them as verified.
	FilesVerifiedAhead uint64
	// PinnedFilesOpen is the files held open now for client pins, where
	// another engine sharing the directory may remove them (a cluster
	// mount's other nodes' files; every file of a shared network file
	// system but NFS): a pinned key loads from the open file even after
	// its removal. PinnedFilesUnopened counts the pins of such files
	// that found the engine's bound of open files reached
	// (DefaultMaxPinnedOpen) and checked the file by name only.
	PinnedFilesOpen     int64
	PinnedFilesUnopened uint64
	// StoreFailures and LoadFailures break Failures down by reason. Every
	// failed key is counted, and logged (warning; at most one line per
	// reason every 10 s, saying how many were not logged).
	StoreFailures Failures
	LoadFailures  Failures // failed keys of loads, by reason
	// Tiering counts the moves between mounts (TierStats).
	Tiering TierStats
	// HeldFound is the files found at start that the restart hold still
	// pins and that are still stored (Config.RestartHold).
	HeldFound int
	// Namespaces is what the index holds of each namespace: those with
	// files indexed, and those declared now with none, the most bytes
	// first.
	Namespaces []NamespaceStats
	// Budgets is the use of each of Config.Budgets, in its order.
	Budgets []BudgetStats
}

// NamespaceStats is what the index holds of one namespace.
type NamespaceStats struct {
	// Fingerprint identifies the namespace: its geometry's fingerprint,
	// in the header of every file of its keys.
	Fingerprint uint64
	// Model is the model id of the namespace's declaration (Geometry.Model;
	// the vLLM tier's vllm:<model>:<digest>), or "" where no client
	// declared it since the engine opened: files found on the mounts.
	Model string
	// Declared: a client declared the namespace and has not released it.
	Declared bool
	Files    int   // files indexed
	Keys     int   // keys indexed
	Bytes    int64 // the files' bytes, headers included
	// Budget is the pattern of the budget that covers the namespace
	// (Budget.Model; "" for none): its use is in Stats.Budgets. A
	// namespace found on the mounts has one by the model id its model
	// book names (docs/engine.md, "Byte budgets"), though Model is "".
	Budget string
}

// The Engine's methods, for reference (implemented in engine.go, store.go,
// load.go):
//
//	Open(ctx, Config) (*Engine, error)
//	(*Engine).Index() policy.Index  // the engine's index, for policy hosts
//	(*Engine).Declare(ctx, Geometry) (NamespaceID, error)
//	(*Engine).RegisterCache(ns, []LayerTensor) (CacheID, error)
//	(*Engine).UnregisterCache(CacheID) error
//	(*Engine).Store(ctx, StoreRequest) (*Job, error)
//	(*Engine).Load(ctx, LoadRequest) (*Job, error)
//	(*Engine).Lookup(ctx, ns, keys) (int, error)
//	(*Engine).Delete(ctx, ns, keys) (int, error)
//	(*Engine).Stats() Stats
//	(*Engine).Close(ctx) error
//	(*Job).ID() JobID; Done() <-chan struct{}; Wait(ctx) (Result, error); Cancel()
