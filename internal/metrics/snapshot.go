package metrics

import (
	"strings"
	"time"

	"github.com/kvhost/kvhost/outcome"
)

// The snapshot types below are what the collector reads of the daemon's
// parts at every scrape: only the figures it exposes, in types of this
// package, so that metrics depends on no part of kvhost. The daemon's
// assembly fills them from the parts' own stats (internal/daemon's
// metrics adapter); each field is named as the part's field it copies.

// EngineStats is what the metrics read of the storage engine (its
// counters since it opened, and its state now).
type EngineStats struct {
	Entries   int // files in the index
	Keys      int // keys in the index
	HeldFound int // files found at start still held from eviction

	Stores          uint64 // keys written and published
	Loads           uint64 // keys read into their blocks and verified
	LayerLoadsByKey uint64 // keys of layer-range loads verified through the whole key (no layer sums)
	// LoadKeysCheckedBefore: keys loaded from a memory mount without
	// summing them again (verified before, the file unchanged since).
	LoadKeysCheckedBefore uint64
	// FilesVerifiedAhead: files found at start on a memory mount verified
	// in the background before their first load.
	FilesVerifiedAhead uint64
	Hits               uint64 // keys found by lookups and loads
	Misses             uint64 // keys not found by lookups and loads
	Evictions          uint64 // files evicted to make room
	Reused             uint64 // stores that wrote into a spare file
	SparesMade         uint64 // spare files made ahead of stores
	Corrupt            uint64 // files dropped because they failed verification
	Vanished           uint64 // files found missing or replaced behind the engine's back
	RemoveFailures     uint64 // files whose removal failed, each once
	BytesWritten       uint64 // payload bytes written to files
	BytesRead          uint64 // payload bytes read from files

	PinnedFilesOpen     int64  // files held open for client pins
	PinnedFilesUnopened uint64 // pins that found the bound of open files reached

	StoreFailures Failures  // failed keys of stores, by reason
	LoadFailures  Failures  // failed keys of loads, by reason
	Tiering       TierStats // moves between mounts

	// Namespaces are the namespaces with files indexed or declared now,
	// the most bytes first: the first MaxNamespaces get gauges of their
	// own.
	Namespaces []NamespaceStats
	// Budgets are the byte budgets per namespace ([[budget]]), in their
	// configured order.
	Budgets []BudgetStats
	// Mounts are the engine's mounts, in configuration order.
	Mounts []MountStats
}

// Failures counts the keys of jobs that failed, by reason.
type Failures struct {
	NoSpace  uint64 // no space on the mount or the file system
	Corrupt  uint64 // a file failed its checks
	Policy   uint64 // the policy failed, or its name was refused
	Canceled uint64 // the job was cancelled or the engine closed
	IO       uint64 // another I/O error
	Other    uint64 // anything else
}

// TierStats counts the engine's moves between mounts.
type TierStats struct {
	Demotions       uint64 // eviction victims moved to another mount
	Promotions      uint64 // moves to an earlier (faster) mount
	Moves           uint64 // moves the policy's tick asked for
	MoveFailures    uint64 // moves that failed
	DemotionDeletes uint64 // victims to demote deleted instead
	Deduped         uint64 // duplicate files removed at start
	// ObjectUploads, ObjectUploadBytes and ObjectUploadFailures count the
	// object demoter's uploads to the object mount, their bytes and its
	// uploads that failed (exposed only with Sources.Objects).
	ObjectUploads, ObjectUploadBytes, ObjectUploadFailures uint64
}

// NamespaceStats is what the index holds of one namespace.
type NamespaceStats struct {
	Fingerprint uint64 // the namespace's geometry fingerprint
	Model       string // the model id it was declared with, or ""
	Files       int    // files indexed
	Keys        int    // keys indexed
	Bytes       int64  // the files' bytes, headers included
}

// BudgetStats is the use of one byte budget ([[budget]]).
type BudgetStats struct {
	Model  string // the budget's model id or prefix pattern
	Bytes  int64  // the bytes of the indexed files of the namespaces it covers
	Budget int64  // its bytes (0: none)
	Floor  int64  // its floor (0: none)
	Over   int64  // files evictions took because the namespaces were over the budget
	Kept   int64  // files evictions skipped because taking them would cross the floor
}

// MountStats describes one mount.
type MountStats struct {
	Path       string // the mount's root: the metrics' mount label
	Capacity   int64  // effective capacity
	Used       int64  // bytes of files and reservations counted as used
	Entries    int    // the mount's files in the index
	SpareBytes int64  // bytes of spare files kept for stores
	IO         string // "direct" or "buffered"
	Backend    string // the data mover of host memory on the mount
	Checksums  bool   // payload checksums are written and verified
	MovedIn    uint64 // files moved to the mount from another tier
	MovedOut   uint64 // files moved from the mount to another tier
	// LoadReaders is the most files loads read at once from the mount
	// now; 0 where there is no such bound (a memory file system).
	LoadReaders int
	// LoadBuffered: the mount's loads read through the page cache now.
	LoadBuffered bool
	// LoadReadersChanged counts the times tuning moved the mount's load
	// readers (their count or mode); LoadRate is the rate it last
	// measured for the readers now, in bytes/s (0: not measured).
	LoadReadersChanged uint64
	LoadRate           float64
	// LoadArms are the arms tuning measured, each with its last rate.
	LoadArms []LoadArm
	// StoresFailing: the mount refuses stores now (its most recent
	// stores failed for a reason of its own).
	StoresFailing bool
}

// LoadArm is one way of reading a mount's loads that tuning measured:
// Readers files at once, through the page cache or not, at Rate
// bytes/s; Home: the one tuning settled on.
type LoadArm struct {
	Readers  int
	Buffered bool
	Rate     float64
	Home     bool
}

// ServerStats is what the metrics read of the socket server: its
// clients and what they hold against the server's bounds.
type ServerStats struct {
	Clients      int // connections through the handshake
	Handshakes   int // connections not through it yet
	InflightJobs int // store and load jobs of all connections

	// Each pair is what is held against a bound and the bound.
	InflightBytes, InflightLimit int64
	Descriptors, DescriptorLimit int64
	PinnedKeys, PinnedLimit      int64
	CacheLayers, CacheLayerLimit int64
	IncomingBytes, IncomingLimit int64

	IncomingWaiting int64  // frames whose body waits for room
	IncomingWaits   uint64 // frames whose body waited for room

	Regions         int64 // host memory regions registered
	RegisteredBytes int64 // their bytes
	RegisteredLimit int64 // the most bytes all clients may register

	// Caches counts the caches registered now, by namespace fingerprint.
	Caches map[uint64]uint32
	// Refusals counts requests refused with limit exceeded, by the bound.
	Refusals map[string]uint64
	// Devices are the GPUs clients register memory on.
	Devices []DeviceStats
	// Started is when the server started.
	Started time.Time
}

// DeviceStats is the GPU memory clients registered on one device.
type DeviceStats struct {
	Ordinal    uint32 // the daemon's CUDA device ordinal
	Regions    uint64 // registered regions on the device
	Registered uint64 // their bytes
	Limit      uint64 // the most bytes clients may register there
}

// PolicyState is the placement policy as the daemon runs it.
type PolicyState struct {
	Name  string      // the configured policy
	Stats PolicyStats // the policy host's counters
}

// PolicyStats are a policy host's counters and what answers its calls.
type PolicyStats struct {
	Backend        string            // what answers the policy's calls now (wasm or native)
	Fallback       bool              // the policy fell back to its native build
	FallbackReason string            // the failure that caused the fallback
	Calls          map[string]uint64 // hook calls, by export
	Records        map[string]uint64 // records passed to hooks, by export
	Failures       uint64            // failed calls
	Rejections     uint64            // outputs the host rejected
	Replacements   uint64            // instances rebuilt after a failure
	SlowCalls      uint64            // calls that finished after their deadline
	StaleVictims   uint64            // victims skipped: pinned or removed
	RemovedOffered uint64            // victims and moves of entries removed
}

// DataPath is the data mover chain of one mount for GPU memory and the
// plans each of its movers passed on to the next.
type DataPath struct {
	Mount     string            // the mount's path, the metrics' mount label
	Fallbacks map[string]uint64 // by mover name
}

// GPUFileStats are the memory-mount files the GPU staging pipeline keeps
// registered with CUDA.
type GPUFileStats struct {
	Files      int           // files registered now
	Bytes      int64         // their bytes
	Limit      int           // the most files kept registered
	Queued     int           // files offered and not registered yet
	Registered uint64        // files registered
	Released   uint64        // registrations given back
	Failed     uint64        // registrations that failed
	Deferred   uint64        // first offers put off by the bound
	Warmed     uint64        // files offered ahead of any job
	Waits      uint64        // registrations put off while stores ran
	Waited     time.Duration // time the registrar waited so
	Stores     uint64        // store jobs that moved a registered file directly
	Loads      uint64        // load jobs that moved a registered file directly
	Mapped     int           // files not registered kept mapped for their loads
}

// CuFileStats are cuFile's cached file handles.
type CuFileStats struct {
	Cached        int    // handles registered now
	Registrations uint64 // registrations that succeeded
	Failures      uint64 // registrations that failed
	Hits          uint64 // acquisitions served from the cache
	Evictions     uint64 // handles deregistered to keep the bound
	Forgotten     uint64 // handles dropped because the engine removed or replaced the file
	Unlinked      uint64 // handles dropped because no name links the file
}

// JobEvent describes one finished store or load job (ObserveJob).
type JobEvent struct {
	Direction string        // "store" or "load"
	Memory    string        // the kind of memory of the job's cache ("host", "device")
	Path      string        // the data mover(s) its files went through
	Bytes     int64         // payload moved
	Duration  time.Duration // from submission to completion
	// Outcomes counts the job's keys by outcome.
	Outcomes [NumOutcomes]int
}

// Outcome is what happened to one key of a job: the vocabulary's
// (outcome.Outcome), which the engine speaks too; its label of
// kvhost_job_keys_total is Label's.
type Outcome = outcome.Outcome

// Outcomes of a key in a job that the metrics count (the wire's
// cancelled is no engine outcome).
const (
	OutcomePending     = outcome.Pending     // not finished (never in a finished job)
	OutcomeStored      = outcome.Stored      // written and published
	OutcomePresent     = outcome.Present     // already stored
	OutcomeNotAdmitted = outcome.NotAdmitted // the policy declined the key
	OutcomeLoaded      = outcome.Loaded      // read into its blocks and verified
	OutcomeMissing     = outcome.Missing     // not stored
	OutcomeFailed      = outcome.Failed      // failed
	// NumOutcomes is the number of outcomes counted, the length of
	// JobEvent.Outcomes.
	NumOutcomes = int(OutcomeFailed) + 1
)

// Label is o's label value: its name, in a label's spelling
// ("not_admitted").
func Label(o Outcome) string {
	return strings.ReplaceAll(o.String(), " ", "_")
}

// RemovalStats is what the metrics read of the engine's removal feed.
type RemovalStats struct {
	Published   uint64 // records published since the first subscription
	Resyncs     uint64 // resyncs told to subscribers
	Subscribers int64  // subscriptions open now
}

// ObjectStats is what the metrics read of the object mount
// (docs/object.md).
type ObjectStats struct {
	Keys                               int    // keys the bucket is known to hold
	Uploaded, Skipped, Failed, Dropped uint64 // published files copied, not copied (held), failed, not queued
	Gets, GetErrors, GetBytes          uint64 // loads' GET requests, those that failed, bytes read
	Bad, Deleted                       uint64 // objects removed as bad, and as their keys were deleted
	Evicted, Purged                    uint64 // objects removed for room (the bound), and by purges
	Vanished                           uint64 // objects a listing found gone (another node removed them)
	Full                               uint64 // uploads refused for room (the bound, or the store's quota)
	Listings                           uint64 // listings of the bucket
	Used                               int64  // bytes of the objects the bucket is known to hold
}
