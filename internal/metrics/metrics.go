// Package metrics exposes a kvhost daemon's state to Prometheus: a
// collector that reads snapshots of the engine's, the server's and the
// policy host's counters at every scrape, histograms fed by the engine's
// finished jobs, the policy host's calls and the server's requests, and
// an HTTP handler serving /metrics and the probes /healthz and /readyz.
// docs/metrics.md lists every name.
//
// The package imports no other package of kvhost: it reads the daemon's
// parts through the snapshot types and funcs it defines (Sources), which
// the daemon's assembly fills (internal/daemon's metrics adapter).
package metrics

import (
	"fmt"
	"maps"
	"net/http"
	"net/http/pprof"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Sources are what the collector reads at every scrape, in the snapshot
// types of this package (snapshot.go); the daemon's assembly adapts its
// parts to them. A nil field leaves its metrics out.
type Sources struct {
	Engine func() EngineStats // the storage engine's stats
	Server func() ServerStats // the socket server's stats
	// Policy is the policy's state; its counters must not go down when a
	// reload replaces the policy host (the daemon adds the old host's).
	Policy func() PolicyState
	// DataPaths are the fallback counts of the GPU data paths, per mount.
	DataPaths func() []DataPath
	// Staging reports the CPU staging pipeline's bounce buffers in use,
	// their limit and size.
	Staging func() (inUse, limit, size int)
	// Reloads counts configuration reloads that took effect and that
	// failed.
	Reloads func() (ok, failed uint64)
	// Removals reports the engine's removal feed: records published,
	// resyncs told to subscribers, subscriptions open (nil: left out).
	Removals func() RemovalStats
	// Objects reports the object mount's counts (nil without one).
	Objects func() ObjectStats
	// GPUFiles reports the files the GPU staging pipeline keeps
	// registered (nil without a GPU).
	GPUFiles func() GPUFileStats
	// GPUChecksumJobs counts the GPU staging pipeline's jobs with
	// checksums by where they were computed (nil without a GPU).
	GPUChecksumJobs func() (onCPU, onGPU uint64)
	// GPUStaging reports the GPU staging pipeline's pinned buffers in
	// use, in all, and the size of one (nil without a GPU).
	GPUStaging func() (inUse, total, size int)
	// GPUFaults reports, per device ordinal, the jobs and registrations
	// that failed with a sticky CUDA error, and the cuFile batches whose
	// I/O did not come back after a cancel (nil without a GPU).
	GPUFaults func() map[int]uint64
	// CuFile reports cuFile's handle cache (nil where cuFile is not
	// loaded).
	CuFile func() CuFileStats
	// Stalled says why the daemon is not serving (its watchdog: a file
	// operation that has not returned, a data path that moves nothing
	// with jobs in flight, a check that does not answer), or ""; nil
	// never.
	Stalled func() string
	// Statfs reads the space available on a mount's file system, in
	// bytes, for kvhost_mount_fs_available_bytes (the daemon's file
	// system's statfs); nil leaves those metrics out.
	Statfs func(path string) (avail int64, err error)
}

// MaxNamespaces is how many namespaces, those holding the most bytes,
// get gauges of their own (kvhost_namespace_keys...): as many as a stats
// reply lists.
const MaxNamespaces = 128

// Metrics is a daemon's metrics registry.
type Metrics struct {
	reg   *prometheus.Registry
	src   atomic.Pointer[Sources]
	ready atomic.Bool

	jobs        *prometheus.CounterVec
	jobBytes    *prometheus.CounterVec
	jobDuration *prometheus.HistogramVec
	jobKeys     *prometheus.CounterVec
	policyCall  *prometheus.HistogramVec
	request     *prometheus.HistogramVec

	fs fsProbes // the mounts' statfs, one call in flight per mount
}

// Histogram buckets, in seconds.
var (
	// jobBuckets: 100µs to 6.6s, ×4.
	jobBuckets = prometheus.ExponentialBuckets(100e-6, 4, 9)
	// policyBuckets: 1µs to 262ms, ×4.
	policyBuckets = prometheus.ExponentialBuckets(1e-6, 4, 10)
	// requestBuckets: 10µs to 164ms, ×2 (a lookup's target is 100µs).
	requestBuckets = prometheus.ExponentialBuckets(10e-6, 2, 15)
)

// New returns the registry of a daemon of the given version, with Go
// runtime and process metrics. Its collector reports nothing but the
// build until SetSources.
func New(version string) *Metrics {
	m := &Metrics{reg: prometheus.NewRegistry()}
	jobLabels := []string{"direction", "memory", "path"}
	m.jobs = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvhost_jobs_total",
		Help: "Store and load jobs finished, by direction, memory kind of the cache and data path."}, jobLabels)
	m.jobBytes = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvhost_job_bytes_total",
		Help: "Payload bytes moved by finished jobs."}, jobLabels)
	m.jobDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvhost_job_duration_seconds",
		Help: "Job latency from submission to completion.", Buckets: jobBuckets}, jobLabels)
	m.jobKeys = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvhost_job_keys_total",
		Help: "Keys of finished jobs by outcome (stored, present, not_admitted, loaded, missing, failed)."}, []string{"direction", "outcome"})
	m.policyCall = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvhost_policy_call_duration_seconds",
		Help: "Time a policy instance ran per hook call (without the host's validation).", Buckets: policyBuckets}, []string{"hook"})
	m.request = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvhost_request_duration_seconds",
		Help: "Time the daemon took to answer a control request (lookup, delete, declare...), from its frame read to its reply written.", Buckets: requestBuckets}, []string{"request"})
	build := prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvhost_build_info", Help: "The running build; always 1.",
		ConstLabels: prometheus.Labels{"version": version}})
	build.Set(1)
	m.reg.MustRegister(m.jobs, m.jobBytes, m.jobDuration, m.jobKeys, m.policyCall, m.request, build, &collector{m: m},
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Registry is the Prometheus registry (tests gather from it).
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// SetSources sets what the collector reads from then on.
func (m *Metrics) SetSources(s Sources) { m.src.Store(&s) }

// SetReady sets what /readyz answers: ready once the daemon accepts
// clients, not ready again once it drains.
func (m *Metrics) SetReady(ready bool) { m.ready.Store(ready) }

// ObserveJob records one finished store or load job: the daemon's
// assembly makes it the engine's job observer. It must be, and is, fast
// and safe for concurrent use.
func (m *Metrics) ObserveJob(ev JobEvent) {
	m.jobs.WithLabelValues(ev.Direction, ev.Memory, ev.Path).Inc()
	m.jobBytes.WithLabelValues(ev.Direction, ev.Memory, ev.Path).Add(float64(ev.Bytes))
	m.jobDuration.WithLabelValues(ev.Direction, ev.Memory, ev.Path).Observe(ev.Duration.Seconds())
	for o, n := range ev.Outcomes {
		if n > 0 {
			m.jobKeys.WithLabelValues(ev.Direction, Label(Outcome(o))).Add(float64(n))
		}
	}
}

// ObservePolicyCall records one call into a policy instance (a policy
// host's OnCall): its hook and how long the instance ran.
func (m *Metrics) ObservePolicyCall(hook string, _ int, took time.Duration) {
	m.policyCall.WithLabelValues(hook).Observe(took.Seconds())
}

// ObserveRequest records that the daemon answered one control request,
// named as the request label (lookup, delete, declare...), in took.
func (m *Metrics) ObserveRequest(request string, took time.Duration) {
	m.request.WithLabelValues(request).Observe(took.Seconds())
}

// Handler serves /metrics (Prometheus text or protobuf), /healthz (200
// while the process serves HTTP and its watchdog finds it serving, 503
// once it is stalled: liveness), /healthz/gpu (/healthz, but 503 also
// once a GPU's context is broken: liveness for a daemon that should
// restart then) and /readyz (200 once the daemon accepts clients, 503
// before and while it drains: readiness);
// with profiling, also Go's runtime profiles and execution trace under
// /debug/pprof/ (net/http/pprof).
func (m *Metrics) Handler(profiling bool) http.Handler {
	mux := http.NewServeMux()
	if profiling {
		mux.HandleFunc("GET /debug/pprof/", pprof.Index)
		mux.HandleFunc("GET /debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("GET /debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("GET /debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("GET /debug/pprof/trace", pprof.Trace)
	}
	mux.Handle("GET /metrics", promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		if why := m.stalled(); why != "" {
			http.Error(w, "unhealthy: "+why, http.StatusServiceUnavailable)
			return
		}
		w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /healthz/gpu", func(w http.ResponseWriter, _ *http.Request) {
		why := m.stalled()
		if why == "" {
			why = m.broken()
		}
		if why != "" {
			http.Error(w, "unhealthy: "+why, http.StatusServiceUnavailable)
			return
		}
		w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !m.ready.Load() {
			http.Error(w, "not ready: starting or draining", http.StatusServiceUnavailable)
			return
		}
		w.Write([]byte("ready\n"))
	})
	return mux
}

// stalled says why the daemon's watchdog finds it not serving, or "".
func (m *Metrics) stalled() string {
	if src := m.src.Load(); src != nil && src.Stalled != nil {
		return src.Stalled()
	}
	return ""
}

// broken says which GPU is faulted (a job or registration failed there
// with a sticky CUDA error, so every later job there fails until the
// daemon restarts, or a cuFile batch's I/O stayed out after its cancel,
// holding its job), or "".
func (m *Metrics) broken() string {
	src := m.src.Load()
	if src == nil || src.GPUFaults == nil {
		return ""
	}
	faults := src.GPUFaults()
	for _, d := range slices.Sorted(maps.Keys(faults)) {
		if n := faults[d]; n > 0 {
			return fmt.Sprintf("GPU %d: %d device faults (a sticky CUDA error, or a cuFile batch whose I/O did not come back); restart the daemon", d, n)
		}
	}
	return ""
}

// collector reads the Sources at every scrape.
type collector struct {
	m *Metrics
}

// Describe sends nothing: the collector is unchecked (the label sets of
// its metrics depend on the mounts, hooks and devices found at scrape).
func (c *collector) Describe(chan<- *prometheus.Desc) {}

func desc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc(name, help, labels, nil)
}

// The collector's metrics (docs/metrics.md).
var (
	dReady              = desc("kvhost_ready", "1 while the daemon accepts clients.")
	dEntries            = desc("kvhost_entries", "Files in the engine's index.")
	dKeys               = desc("kvhost_keys", "Keys in the engine's index.")
	dHeldFound          = desc("kvhost_restart_held_files", "Files found at start that are still held from eviction (engine.restart_hold).")
	dStored             = desc("kvhost_stored_keys_total", "Keys written and published.")
	dLoaded             = desc("kvhost_loaded_keys_total", "Keys read into their blocks and verified.")
	dCheckedBefore      = desc("kvhost_load_keys_checked_before_total", "Keys loaded from a memory mount without summing them again: their layers were summed as this daemon wrote them or verified by it, the file unchanged since.")
	dVerifiedAhead      = desc("kvhost_files_verified_ahead_total", "Files found at start on a memory mount that the daemon verified in the background before their first load, whose loads then take them as verified.")
	dLayersByKey        = desc("kvhost_layer_loads_by_key_total", "Keys of layer-range loads verified through the whole key's checksum: files without per-layer checksums, every layer read.")
	dHits               = desc("kvhost_hits_total", "Keys found by lookups and loads.")
	dMisses             = desc("kvhost_misses_total", "Keys not found by lookups and loads.")
	dEvictions          = desc("kvhost_evictions_total", "Files evicted to make room.")
	dReused             = desc("kvhost_reused_files_total", "Stores that wrote into a spare file (an evicted file kept, or one made ahead) instead of a fresh file (memory file systems).")
	dSparesMade         = desc("kvhost_spare_files_made_total", "Spare files made ahead of stores on memory file systems (mount.preallocate).")
	dCorrupt            = desc("kvhost_corrupt_files_total", "Files dropped because they failed verification.")
	dVanished           = desc("kvhost_vanished_files_total", "Files found missing or replaced behind the engine's back.")
	dRemoveFailed       = desc("kvhost_remove_failures_total", "Data, spare and temporary files whose removal failed, each counted once (the file stays counted as used; evictions on its mount try again).")
	dPinnedOpen         = desc("kvhost_pinned_files_open", "Files held open for client pins because another node may remove them (another node's file on a cluster mount; any file on a shared network file system but NFS).")
	dPinnedUnopened     = desc("kvhost_pinned_files_unopened_total", "Client pins of files another node may remove that found the bound of files held open reached and checked the file by name only.")
	dWritten            = desc("kvhost_written_bytes_total", "Payload bytes written to files.")
	dRead               = desc("kvhost_read_bytes_total", "Payload bytes read from files.")
	dFailures           = desc("kvhost_key_failures_total", "Keys of jobs that failed, by direction and reason.", "direction", "reason")
	dNamespaces         = desc("kvhost_namespaces", "Namespaces (a model at one geometry) with files indexed or declared now.")
	dNSKeys             = desc("kvhost_namespace_keys", "Keys indexed of a namespace, by its fingerprint and the model id it was declared with (empty for files found on the mounts whose namespace no client declared since the start); the 128 namespaces holding the most bytes.", "fingerprint", "model")
	dNSFiles            = desc("kvhost_namespace_files", "Files indexed of a namespace (labels as kvhost_namespace_keys).", "fingerprint", "model")
	dNSBytes            = desc("kvhost_namespace_bytes", "Bytes of a namespace's indexed files, headers included (labels as kvhost_namespace_keys).", "fingerprint", "model")
	dNSCaches           = desc("kvhost_namespace_caches", "Caches registered in a namespace now, on all connections: a vLLM offloading spec engine's workers (labels as kvhost_namespace_keys).", "fingerprint", "model")
	dBudgetUsed         = desc("kvhost_budget_used_bytes", "Bytes of the indexed files of the namespaces a byte budget ([[budget]]) covers, by its model pattern.", "budget")
	dBudgetBytes        = desc("kvhost_budget_bytes", "A byte budget's bytes (0: none, only a floor), by its model pattern.", "budget")
	dBudgetFloor        = desc("kvhost_budget_floor_bytes", "A byte budget's floor (0: none), by its model pattern.", "budget")
	dBudgetOver         = desc("kvhost_budget_over_evictions_total", "Files evictions took first because the namespaces of a budget held more than its bytes, by its model pattern.", "budget")
	dBudgetKept         = desc("kvhost_budget_floor_skips_total", "Eviction victims skipped because taking them would cross a budget's floor, by its model pattern: a rising count beside store failures for no space means the floors hold the mount.", "budget")
	dMountCap           = desc("kvhost_mount_capacity_bytes", "Effective capacity of a mount.", "mount")
	dMountReaders       = desc("kvhost_mount_load_readers", "Files loads read at once from a mount at most, now: mount.load_readers, or as tuned by measured throughput where it is 0; absent on a memory file system.", "mount")
	dMountBuffered      = desc("kvhost_mount_load_buffered", "1 where a mount's loads read through the page cache now (mount.io, or as tuned on a local disk read with O_DIRECT by default), else 0; absent on a memory file system.", "mount")
	dMountReaderMoves   = desc("kvhost_mount_load_reader_changes_total", "Times tuning moved a mount's load readers (their count, or whether they read through the page cache); absent on a memory file system.", "mount")
	dMountLoadRate      = desc("kvhost_mount_load_rate_bytes_per_second", "The rate tuning last measured for a mount's load readers now: bytes of whole files over their readers' shares of the time, while loads waited for the mount; absent until measured, and on a memory file system.", "mount")
	dMountArmRate       = desc("kvhost_mount_load_arm_rate_bytes_per_second", "The rate tuning last measured for each way of reading a mount's loads it tried: readers (files at once), io (buffered or direct), home (1: the one it settled on, which the readers now may differ from while it measures another again); absent until measured, and on a memory file system.", "mount", "readers", "io", "home")
	dMountUsed          = desc("kvhost_mount_used_bytes", "Bytes of published files, reservations of stores in flight, and files dropped from the index not yet removed.", "mount")
	dMountFree          = desc("kvhost_mount_free_bytes", "Capacity left to kvhost on a mount (capacity - used).", "mount")
	dMountFSFree        = desc("kvhost_mount_fs_available_bytes", "Space the file system of a mount has available (statfs), as it last answered; absent where it never answered or its last statfs failed.", "mount")
	dMountFSAge         = desc("kvhost_mount_fs_available_age_seconds", "How old kvhost_mount_fs_available_bytes is: the time since the mount's file system last answered statfs.", "mount")
	dMountStatfsPending = desc("kvhost_mount_statfs_pending_seconds", "How long the mount's statfs in flight has gone unanswered (a scrape waits 1 s for it, then reports the last answer); 0: none. A mount on a network file system that stopped answering (NFS, FUSE) grows it; never more than one call per mount is in flight.", "mount")
	dMountSpare         = desc("kvhost_mount_spare_bytes", "Bytes of evicted files kept for stores to write into (free space that holds pages; not in used).", "mount")
	dMountEntries       = desc("kvhost_mount_entries", "Files on a mount.", "mount")
	dMountFailing       = desc("kvhost_mount_stores_failing", "1 while a mount refuses stores: its most recent stores or moves there failed for a reason of its own (read-only file system, I/O error, no space left after eviction) and none succeeded since, or the start found it read-only or without room; 0 once a store or move there succeeds, or a probe (every 30 s) finds it writable with room.", "mount")
	dMountMovedIn       = desc("kvhost_mount_moved_in_files_total", "Files moved to a mount from another tier (demotions, promotions, tick moves).", "mount")
	dMountMovedOut      = desc("kvhost_mount_moved_out_files_total", "Files moved from a mount to another tier (demotions, promotions, tick moves).", "mount")
	dDemotions          = desc("kvhost_demotions_total", "Eviction victims moved to another mount instead of deleted (they stay stored; not in kvhost_evictions_total).")
	dPromotions         = desc("kvhost_promotions_total", "Files moved to an earlier (faster) mount, and keys promoted from the object mount.")
	dTickMoves          = desc("kvhost_tick_moves_total", "Moves the policy's tick asked for and the engine carried out (promotions included).")
	dMoveFailures       = desc("kvhost_move_failures_total", "Moves between mounts that failed (no space, I/O errors); the file stays where it was.")
	dDemoteDeletes      = desc("kvhost_demotion_deletes_total", "Victims the policy wanted demoted, deleted because the target had no room (MOVE_DELETE_IF_FULL) or held another file at the path; also in kvhost_evictions_total.")
	dDeduped            = desc("kvhost_duplicate_files_removed_total", "Files removed at start because the same file was also on another mount (a move between mounts that a crash cut short after its copy was in place); the copy the move made was kept.")
	dMountInfo          = desc("kvhost_mount_info", "A mount's I/O mode, host data mover and checksums; always 1.", "mount", "io", "backend", "checksums")
	dFallbacks          = desc("kvhost_data_path_fallbacks_total", "Transfer plans a GPU data mover passed on to the next (e.g. cufile to the staging copy).", "mount", "mover")
	dPolicyInfo         = desc("kvhost_policy_info", "The configured policy and what answers its calls now (wasm or native); always 1.", "policy", "backend")
	dPolicyFallback     = desc("kvhost_policy_fallback", "1 once the policy fell back to its native build; reason is the failure that caused it.", "reason")
	dPolicyCalls        = desc("kvhost_policy_calls_total", "Policy hook calls, by export.", "hook")
	dPolicyRecords      = desc("kvhost_policy_records_total", "Records passed to policy hooks, by export.", "hook")
	dPolicyFailures     = desc("kvhost_policy_failures_total", "Failed policy calls: traps, timeouts, failure statuses and rejected outputs.")
	dPolicyRejected     = desc("kvhost_policy_rejections_total", "Policy outputs the host rejected (a subset of the failures).")
	dPolicyRestarts     = desc("kvhost_policy_restarts_total", "Policy instances closed and rebuilt after a failure.")
	dPolicySlow         = desc("kvhost_policy_slow_calls_total", "Policy calls that finished within their fuel but after their deadline.")
	dPolicyStale        = desc("kvhost_policy_stale_victims_total", "Victims skipped because the engine had pinned or removed them.")
	dPolicyRemoved      = desc("kvhost_policy_removed_offered_total", "Victims and moves of entries the plugin had been sent a REMOVE for: each failed its call (a plugin that ignores REMOVE records).")
	dClients            = desc("kvhost_clients", "Connections through the handshake.")
	dHandshakes         = desc("kvhost_handshakes", "Connections not through the handshake yet.")
	dJobsInFlight       = desc("kvhost_jobs_in_flight", "Store and load jobs of all connections not finished.")
	dJobsHeld           = desc("kvhost_jobs_in_flight_bytes", "Memory the unfinished jobs of all connections hold, as the server counts it against server.max_inflight_bytes.")
	dJobsHeldLimit      = desc("kvhost_jobs_in_flight_bytes_limit", "The most memory the unfinished jobs of all connections may hold (server.max_inflight_bytes).")
	dRegions            = desc("kvhost_registered_regions", "Host memory regions registered by clients.")
	dRefusals           = desc("kvhost_limit_refusals_total", "Client requests refused with limit exceeded, by the bound that refused them: its configuration key (server.max_...), the protocol's per-connection limit (namespaces_per_connection, caches_per_connection, pins_per_connection), or namespaces_per_daemon (the geometries the daemon knows at a time).", "limit")
	dPinnedKeys         = desc("kvhost_client_pinned_keys", "Keys the pins of all connections hold, as counted against server.max_pinned_keys.")
	dPinnedLimit        = desc("kvhost_client_pinned_keys_limit", "The most keys the pins of all connections may hold (server.max_pinned_keys).")
	dIncoming           = desc("kvhost_incoming_frame_bytes", "Bytes of frame bodies over 64 KiB the daemon holds while it reads and answers them, as counted against server.max_incoming_bytes.")
	dIncomingLimit      = desc("kvhost_incoming_frame_bytes_limit", "The most bytes of frame bodies the daemon may hold while it reads and answers them (server.max_incoming_bytes).")
	dIncomingWait       = desc("kvhost_incoming_frames_waiting", "Frames whose body waits, unread, for room under server.max_incoming_bytes or server.max_incoming_bytes_per_peer.")
	dIncomingWaits      = desc("kvhost_incoming_frame_waits_total", "Frames whose body waited for room under server.max_incoming_bytes or server.max_incoming_bytes_per_peer before it was read.")
	dCacheLayers        = desc("kvhost_client_cache_layers", "Layers of the caches all connections hold registered, as counted against server.max_cache_layers.")
	dCacheLayersMax     = desc("kvhost_client_cache_layers_limit", "The most layers the caches of all connections may hold (server.max_cache_layers).")
	dClientFds          = desc("kvhost_client_descriptors", "Descriptors of clients the daemon holds: registered host memory and descriptors sent with frames not yet answered.")
	dClientFdsLimit     = desc("kvhost_client_descriptors_limit", "The most descriptors of clients the daemon may hold (server.max_descriptors).")
	dRegBytes           = desc("kvhost_registered_bytes", "Bytes of host memory registered by clients.")
	dRegLimit           = desc("kvhost_registered_bytes_limit", "The most bytes of host memory all clients may register.")
	dGPURegions         = desc("kvhost_gpu_registered_regions", "GPU memory regions registered by clients (CUDA IPC), per device.", "device")
	dGPUBytes           = desc("kvhost_gpu_registered_bytes", "Bytes of GPU memory registered by clients, per device.", "device")
	dGPULimit           = desc("kvhost_gpu_registered_bytes_limit", "The most bytes of GPU memory clients may register per device.", "device")
	dStagingInUse       = desc("kvhost_staging_buffers_in_use", "Bounce buffers of the CPU staging pipeline in use.")
	dStagingLimit       = desc("kvhost_staging_buffers_limit", "The most bounce buffers the CPU staging pipeline may have (engine.staging_memory).")
	dStagingSize        = desc("kvhost_staging_buffer_bytes", "Size of one bounce buffer.")
	dGPUFiles           = desc("kvhost_gpu_registered_files", "Memory-mount files kept mapped and registered with CUDA, for direct copies between the GPU and their pages.")
	dGPUFileBytes       = desc("kvhost_gpu_registered_file_bytes", "Bytes of the memory-mount files kept registered with CUDA.")
	dGPUFileLimit       = desc("kvhost_gpu_registered_files_limit", "The most files kept registered (gpu.register_files, bounded by the descriptor limit).")
	dGPUFileQueue       = desc("kvhost_gpu_file_registrations_queued", "Memory-mount files offered for registration and not registered yet (waiting for the registrar, or being registered).")
	dGPUFileMapped      = desc("kvhost_gpu_load_mapped_files", "Memory-mount files not registered with CUDA that the GPU staging pipeline keeps mapped for their next loads (at most 1024, each unmapped 5 s after its last load).")
	dGPUFileRegs        = desc("kvhost_gpu_file_registrations_total", "Files mapped and registered with CUDA (ok), given back (released), that could not be (failed), or not registered yet because the bound was reached (deferred: a file's first offer there).", "result")
	dGPUFileWarmed      = desc("kvhost_gpu_file_warm_offers_total", "Memory-mount files offered for registration ahead of any job (found at start, or another process's or node's file a lookup discovered) and queued: their registrations are counted in kvhost_gpu_file_registrations_total.")
	dGPUFileWaits       = desc("kvhost_gpu_file_registration_waits_total", "Registrations the registrar put off while stores moved through the pinned buffers.")
	dGPUFileWaited      = desc("kvhost_gpu_file_registration_wait_seconds_total", "Time the registrar waited for stores through the pinned buffers before registering files.")
	dGPUFileJobs        = desc("kvhost_gpu_direct_file_jobs_total", "Jobs that moved a registered file directly between the GPU and its pages, by direction.", "direction")
	dGPUSumJobs         = desc("kvhost_gpu_checksum_jobs_total", "GPU staging jobs that succeeded with payload checksums, by where they were computed: cpu or gpu (gpu.checksum_on).", "on")
	dGPUPinInUse        = desc("kvhost_gpu_staging_buffers_in_use", "Pinned buffers of the GPU staging pipeline that jobs hold now.")
	dGPUPinTotal        = desc("kvhost_gpu_staging_buffers", "Pinned buffers of the GPU staging pipeline, allocated once at start (gpu.staging_memory).")
	dGPUPinSize         = desc("kvhost_gpu_staging_buffer_bytes", "Size of one pinned buffer of the GPU staging pipeline.")
	dGPUFaults          = desc("kvhost_gpu_device_faults_total", "Staging and cuFile jobs and CUDA IPC registrations that failed with a sticky CUDA error on the device (an illegal address, a failed launch, an ECC error: its context is broken, and its jobs fail until the daemon restarts), and cuFile batches whose I/O did not come back after their cancel (their jobs are held until it does).", "device")
	dCuFileHandles      = desc("kvhost_cufile_handles", "Files registered with cuFile (cuFileHandleRegister) and cached now.")
	dCuFileRegs         = desc("kvhost_cufile_handle_registrations_total", "cuFile file registrations, by result (ok, failed).", "result")
	dCuFileHits         = desc("kvhost_cufile_handle_hits_total", "Transfers that found their file's cuFile handle cached (or being registered by another transfer).")
	dCuFileDropped      = desc("kvhost_cufile_handles_dropped_total", "Cached cuFile handles deregistered: to keep the bound (evicted), because the engine removed or replaced the file (forgotten), or because no name links the file any more (unlinked: another node removed it).", "reason")
	dStart              = desc("kvhost_start_time_seconds", "When the daemon's server started, in Unix seconds.")
	dReloads            = desc("kvhost_reloads_total", "Configuration reloads, by result (ok, failed).", "result")
	dRemovalRecords     = desc("kvhost_removal_records_total", "Keys recorded in the removal feed (removed, or moved to another mount) since its first subscription.")
	dRemovalResyncs     = desc("kvhost_removal_resyncs_total", "Resyncs told to removal subscribers: removals lost to them (a slow reader, or a cursor older than the ring).")
	dRemovalSubscribers = desc("kvhost_removal_subscribers", "Removal subscriptions open now.")
	dObjectKeys         = desc("kvhost_objects_keys", "Keys the object mount's bucket is known to hold (uploaded by this daemon, or found by a listing).")
	dObjectUploads      = desc("kvhost_objects_uploads_total", "Published files the object mount was given, by result (uploaded; skipped: the bucket held the key; failed; dropped: the queue was full).", "result")
	dObjectGets         = desc("kvhost_objects_get_requests_total", "Ranged GETs of loads from the object mount.")
	dObjectGetErrors    = desc("kvhost_objects_get_errors_total", "Ranged GETs of loads from the object mount that failed.")
	dObjectGetBytes     = desc("kvhost_objects_get_bytes_total", "Bytes loads read from the object mount.")
	dObjectRemoved      = desc("kvhost_objects_removed_total", "Objects removed from the bucket, by reason (bad: failed a load's checks; deleted: a client deleted the key; evicted: for room within the bound; purged: a purge of the namespace; vanished: found gone by a listing).", "reason")
	dObjectBytes        = desc("kvhost_objects_bytes", "Bytes of the objects the bucket is known to hold under the prefix.")
	dObjectFull         = desc("kvhost_objects_full_total", "Uploads refused for room: the bound ([objects] capacity) or the store's quota.")
	dObjectListings     = desc("kvhost_objects_listings_total", "Listings of the object mount's bucket.")
	dDemoterUploads     = desc("kvhost_objects_demoter_uploads_total", "Files the object demoter uploaded to the object mount, ahead of need or for an eviction that waited.")
	dDemoterBytes       = desc("kvhost_objects_demoter_upload_bytes_total", "Bytes of the files the object demoter uploaded to the object mount.")
	dDemoterFailures    = desc("kvhost_objects_demoter_upload_failures_total", "Uploads of the object demoter that failed (an error, a refusal such as a full bucket; not one cancelled, nor one of a file gone meanwhile).")
)

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	ready := 0.0
	if c.m.ready.Load() {
		ready = 1
	}
	gauge(dReady, ready)
	src := c.m.src.Load()
	if src == nil {
		return
	}
	var listed []NamespaceStats // the engine's namespaces with gauges, for their caches
	var tier *TierStats         // the engine's, for the object demoter's counters
	if src.Engine != nil {
		st := src.Engine()
		tier = &st.Tiering
		gauge(dEntries, float64(st.Entries))
		gauge(dKeys, float64(st.Keys))
		gauge(dHeldFound, float64(st.HeldFound))
		counter(dStored, st.Stores)
		counter(dLoaded, st.Loads)
		counter(dLayersByKey, st.LayerLoadsByKey)
		counter(dCheckedBefore, st.LoadKeysCheckedBefore)
		counter(dVerifiedAhead, st.FilesVerifiedAhead)
		counter(dHits, st.Hits)
		counter(dMisses, st.Misses)
		counter(dEvictions, st.Evictions)
		counter(dReused, st.Reused)
		counter(dSparesMade, st.SparesMade)
		counter(dCorrupt, st.Corrupt)
		counter(dVanished, st.Vanished)
		counter(dRemoveFailed, st.RemoveFailures)
		gauge(dPinnedOpen, float64(st.PinnedFilesOpen))
		counter(dPinnedUnopened, st.PinnedFilesUnopened)
		counter(dWritten, st.BytesWritten)
		counter(dRead, st.BytesRead)
		for dir, f := range map[string]Failures{"store": st.StoreFailures, "load": st.LoadFailures} {
			counter(dFailures, f.NoSpace, dir, "no_space")
			counter(dFailures, f.Corrupt, dir, "corrupt")
			counter(dFailures, f.Policy, dir, "policy")
			counter(dFailures, f.Canceled, dir, "canceled")
			counter(dFailures, f.IO, dir, "io")
			counter(dFailures, f.Other, dir, "other")
		}
		counter(dDemotions, st.Tiering.Demotions)
		counter(dPromotions, st.Tiering.Promotions)
		counter(dTickMoves, st.Tiering.Moves)
		counter(dMoveFailures, st.Tiering.MoveFailures)
		counter(dDemoteDeletes, st.Tiering.DemotionDeletes)
		counter(dDeduped, st.Tiering.Deduped)
		gauge(dNamespaces, float64(len(st.Namespaces)))
		listed = st.Namespaces[:min(len(st.Namespaces), MaxNamespaces)]
		for _, ns := range listed {
			// The model id is UTF-8, as a label must be: Declare refuses
			// others (Geometry.Validate).
			fp := fmt.Sprintf("%016x", ns.Fingerprint)
			gauge(dNSKeys, float64(ns.Keys), fp, ns.Model)
			gauge(dNSFiles, float64(ns.Files), fp, ns.Model)
			gauge(dNSBytes, float64(ns.Bytes), fp, ns.Model)
		}
		for _, b := range st.Budgets {
			gauge(dBudgetUsed, float64(b.Bytes), b.Model)
			gauge(dBudgetBytes, float64(b.Budget), b.Model)
			gauge(dBudgetFloor, float64(b.Floor), b.Model)
			counter(dBudgetOver, uint64(b.Over), b.Model)
			counter(dBudgetKept, uint64(b.Kept), b.Model)
		}
		for _, mt := range st.Mounts {
			counter(dMountMovedIn, mt.MovedIn, mt.Path)
			counter(dMountMovedOut, mt.MovedOut, mt.Path)
			gauge(dMountCap, float64(mt.Capacity), mt.Path)
			gauge(dMountUsed, float64(mt.Used), mt.Path)
			if mt.LoadReaders > 0 {
				gauge(dMountReaders, float64(mt.LoadReaders), mt.Path)
				buffered := 0.0
				if mt.LoadBuffered {
					buffered = 1
				}
				gauge(dMountBuffered, buffered, mt.Path)
				counter(dMountReaderMoves, mt.LoadReadersChanged, mt.Path)
				if mt.LoadRate > 0 {
					gauge(dMountLoadRate, mt.LoadRate, mt.Path)
				}
				for _, a := range mt.LoadArms {
					io, home := "direct", "0"
					if a.Buffered {
						io = "buffered"
					}
					if a.Home {
						home = "1"
					}
					gauge(dMountArmRate, a.Rate, mt.Path, strconv.Itoa(a.Readers), io, home)
				}
			}
			gauge(dMountFree, float64(max(mt.Capacity-mt.Used, 0)), mt.Path)
			gauge(dMountEntries, float64(mt.Entries), mt.Path)
			gauge(dMountSpare, float64(mt.SpareBytes), mt.Path)
			failing := 0.0
			if mt.StoresFailing {
				failing = 1
			}
			gauge(dMountFailing, failing, mt.Path)
			gauge(dMountInfo, 1, mt.Path, mt.IO, mt.Backend, strconv.FormatBool(mt.Checksums))
		}
		if src.Statfs != nil {
			paths := make([]string, len(st.Mounts))
			for i, mt := range st.Mounts {
				paths[i] = mt.Path
			}
			for i, r := range c.m.fs.read(paths, src.Statfs) {
				if r.ok {
					gauge(dMountFSFree, float64(r.avail), paths[i])
					gauge(dMountFSAge, r.age.Seconds(), paths[i])
				}
				gauge(dMountStatfsPending, r.pending.Seconds(), paths[i])
			}
		}
	}
	if src.DataPaths != nil {
		for _, dp := range src.DataPaths() {
			for mover, n := range dp.Fallbacks {
				counter(dFallbacks, n, dp.Mount, mover)
			}
		}
	}
	if src.Policy != nil {
		p := src.Policy()
		gauge(dPolicyInfo, 1, p.Name, p.Stats.Backend)
		fb := 0.0
		if p.Stats.Fallback {
			fb = 1
		}
		gauge(dPolicyFallback, fb, p.Stats.FallbackReason)
		for hook, n := range p.Stats.Calls {
			counter(dPolicyCalls, n, hook)
		}
		for hook, n := range p.Stats.Records {
			counter(dPolicyRecords, n, hook)
		}
		counter(dPolicyFailures, p.Stats.Failures)
		counter(dPolicyRejected, p.Stats.Rejections)
		counter(dPolicyRestarts, p.Stats.Replacements)
		counter(dPolicySlow, p.Stats.SlowCalls)
		counter(dPolicyStale, p.Stats.StaleVictims)
		counter(dPolicyRemoved, p.Stats.RemovedOffered)
	}
	if src.Server != nil {
		st := src.Server()
		gauge(dClients, float64(st.Clients))
		gauge(dHandshakes, float64(st.Handshakes))
		gauge(dJobsInFlight, float64(st.InflightJobs))
		gauge(dRegions, float64(st.Regions))
		// The server's bounds: what is held against each, and the bound.
		for _, b := range []struct {
			held, limit *prometheus.Desc
			n, most     int64
		}{
			{dJobsHeld, dJobsHeldLimit, st.InflightBytes, st.InflightLimit},
			{dClientFds, dClientFdsLimit, st.Descriptors, st.DescriptorLimit},
			{dPinnedKeys, dPinnedLimit, st.PinnedKeys, st.PinnedLimit},
			{dCacheLayers, dCacheLayersMax, st.CacheLayers, st.CacheLayerLimit},
			{dIncoming, dIncomingLimit, st.IncomingBytes, st.IncomingLimit},
			{dRegBytes, dRegLimit, st.RegisteredBytes, st.RegisteredLimit},
		} {
			gauge(b.held, float64(b.n))
			gauge(b.limit, float64(b.most))
		}
		gauge(dIncomingWait, float64(st.IncomingWaiting))
		counter(dIncomingWaits, st.IncomingWaits)
		for _, ns := range listed {
			gauge(dNSCaches, float64(st.Caches[ns.Fingerprint]), fmt.Sprintf("%016x", ns.Fingerprint), ns.Model)
		}
		for limit, n := range st.Refusals {
			counter(dRefusals, n, limit)
		}
		gauge(dStart, float64(st.Started.UnixNano())/1e9)
		for _, d := range st.Devices {
			dev := strconv.Itoa(int(d.Ordinal))
			gauge(dGPURegions, float64(d.Regions), dev)
			gauge(dGPUBytes, float64(d.Registered), dev)
			gauge(dGPULimit, float64(d.Limit), dev)
		}
	}
	if src.Staging != nil {
		inUse, limit, size := src.Staging()
		gauge(dStagingInUse, float64(inUse))
		gauge(dStagingLimit, float64(limit))
		gauge(dStagingSize, float64(size))
	}
	if src.GPUFiles != nil {
		f := src.GPUFiles()
		gauge(dGPUFiles, float64(f.Files))
		gauge(dGPUFileBytes, float64(f.Bytes))
		gauge(dGPUFileLimit, float64(f.Limit))
		gauge(dGPUFileQueue, float64(f.Queued))
		gauge(dGPUFileMapped, float64(f.Mapped))
		counter(dGPUFileRegs, f.Registered, "ok")
		counter(dGPUFileRegs, f.Released, "released")
		counter(dGPUFileRegs, f.Failed, "failed")
		counter(dGPUFileRegs, f.Deferred, "deferred")
		counter(dGPUFileWarmed, f.Warmed)
		counter(dGPUFileWaits, f.Waits)
		ch <- prometheus.MustNewConstMetric(dGPUFileWaited, prometheus.CounterValue, f.Waited.Seconds())
		counter(dGPUFileJobs, f.Stores, "store")
		counter(dGPUFileJobs, f.Loads, "load")
	}
	if src.GPUChecksumJobs != nil {
		onCPU, onGPU := src.GPUChecksumJobs()
		counter(dGPUSumJobs, onCPU, "cpu")
		counter(dGPUSumJobs, onGPU, "gpu")
	}
	if src.GPUStaging != nil {
		inUse, total, size := src.GPUStaging()
		gauge(dGPUPinInUse, float64(inUse))
		gauge(dGPUPinTotal, float64(total))
		gauge(dGPUPinSize, float64(size))
	}
	if src.GPUFaults != nil {
		for d, n := range src.GPUFaults() {
			counter(dGPUFaults, n, strconv.Itoa(d))
		}
	}
	if src.CuFile != nil {
		h := src.CuFile()
		gauge(dCuFileHandles, float64(h.Cached))
		counter(dCuFileRegs, h.Registrations, "ok")
		counter(dCuFileRegs, h.Failures, "failed")
		counter(dCuFileHits, h.Hits)
		counter(dCuFileDropped, h.Evictions, "evicted")
		counter(dCuFileDropped, h.Forgotten, "forgotten")
		counter(dCuFileDropped, h.Unlinked, "unlinked")
	}
	if src.Reloads != nil {
		ok, failed := src.Reloads()
		counter(dReloads, ok, "ok")
		counter(dReloads, failed, "failed")
	}
	if src.Removals != nil {
		r := src.Removals()
		counter(dRemovalRecords, r.Published)
		counter(dRemovalResyncs, r.Resyncs)
		gauge(dRemovalSubscribers, float64(r.Subscribers))
	}
	if src.Objects != nil {
		o := src.Objects()
		gauge(dObjectKeys, float64(o.Keys))
		counter(dObjectUploads, o.Uploaded, "uploaded")
		counter(dObjectUploads, o.Skipped, "skipped")
		counter(dObjectUploads, o.Failed, "failed")
		counter(dObjectUploads, o.Dropped, "dropped")
		counter(dObjectGets, o.Gets)
		counter(dObjectGetErrors, o.GetErrors)
		counter(dObjectGetBytes, o.GetBytes)
		counter(dObjectRemoved, o.Bad, "bad")
		counter(dObjectRemoved, o.Deleted, "deleted")
		counter(dObjectRemoved, o.Evicted, "evicted")
		counter(dObjectRemoved, o.Purged, "purged")
		counter(dObjectRemoved, o.Vanished, "vanished")
		gauge(dObjectBytes, float64(o.Used))
		counter(dObjectFull, o.Full)
		counter(dObjectListings, o.Listings)
		if tier != nil {
			counter(dDemoterUploads, tier.ObjectUploads)
			counter(dDemoterBytes, tier.ObjectUploadBytes)
			counter(dDemoterFailures, tier.ObjectUploadFailures)
		}
	}
}
