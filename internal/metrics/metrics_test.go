package metrics

import (
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/metrics/metricstest"
	"github.com/kvhost/kvhost/internal/testwait"
)

// scrape gets url and parses it as the Prometheus text format.
func scrape(t *testing.T, url string) metricstest.Families {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s", url, resp.Status)
	}
	fams, err := metricstest.Parse(resp.Body)
	if err != nil {
		t.Fatalf("parse %s: %v", url, err)
	}
	return fams
}

func status(t *testing.T, url string) int {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// fsAvail is the space fullSources' file systems have available.
const fsAvail = 3 << 30

// fullSources sets every source, with the mounts dir and refusing (a
// mount that refuses stores): every metric is exposed.
func fullSources(dir, refusing string) Sources {
	started := time.Unix(1700000000, 0)
	return Sources{
		Engine: func() EngineStats {
			return EngineStats{Entries: 3, Keys: 5, Stores: 5, Hits: 7, Misses: 2, Evictions: 1, RemoveFailures: 13, BytesWritten: 4096,
				StoreFailures: Failures{NoSpace: 4},
				Namespaces: []NamespaceStats{{Fingerprint: 0xfeed, Model: "vllm:m:0", Files: 2, Keys: 32, Bytes: 64 << 20},
					{Fingerprint: 1, Files: 1, Keys: 1, Bytes: 4096}},
				Budgets: []BudgetStats{{Model: "vllm:m:*", Bytes: 64 << 20, Budget: 32 << 20, Floor: 16 << 20, Over: 9, Kept: 2}},
				Tiering: TierStats{Demotions: 74700, Promotions: 12, Moves: 30, MoveFailures: 2, DemotionDeletes: 5, Deduped: 3,
					ObjectUploads: 6, ObjectUploadBytes: 6 << 20, ObjectUploadFailures: 1},
				Mounts: []MountStats{{Path: dir, Capacity: 1000, Used: 400, Entries: 3, IO: "buffered", Backend: "staging", Checksums: true, MovedIn: 8, MovedOut: 9, LoadReaders: 4, LoadBuffered: true, LoadReadersChanged: 3, LoadRate: 1.5e9,
					LoadArms: []LoadArm{{Readers: 4, Buffered: true, Rate: 1.5e9}, {Readers: 8, Buffered: true, Rate: 1.6e9, Home: true}}},
					{Path: refusing, IO: "buffered", Backend: "staging", StoresFailing: true}}}
		},
		Server: func() ServerStats {
			return ServerStats{Caches: map[uint64]uint32{0xfeed: 2}, Clients: 2, InflightJobs: 1, InflightBytes: 40 << 10, InflightLimit: 1 << 30, Descriptors: 4, DescriptorLimit: 16382, PinnedKeys: 12, PinnedLimit: 1 << 22, CacheLayers: 126, CacheLayerLimit: 1 << 20, IncomingBytes: 3 << 20, IncomingLimit: 256 << 20, IncomingWaiting: 2, IncomingWaits: 5, Refusals: map[string]uint64{"server.max_inflight_bytes_per_peer": 7}, Regions: 3, RegisteredBytes: 1 << 20, RegisteredLimit: 1 << 32, Started: started,
				Devices: []DeviceStats{{Ordinal: 1, Regions: 2, Registered: 5, Limit: 9}}}
		},
		Policy: func() PolicyState {
			return PolicyState{Name: "lru", Stats: PolicyStats{Backend: "native", Fallback: true, FallbackReason: "trap in kvhost_name",
				Calls: map[string]uint64{"kvhost_name": 11}, Records: map[string]uint64{"kvhost_name": 40}, Failures: 3, Replacements: 2, RemovedOffered: 6}}
		},
		DataPaths: func() []DataPath { return []DataPath{{Mount: dir, Fallbacks: map[string]uint64{"cufile": 6}}} },
		Reloads:   func() (uint64, uint64) { return 4, 1 },
		Removals:  func() RemovalStats { return RemovalStats{Published: 9, Resyncs: 1, Subscribers: 2} },
		Objects:   func() ObjectStats { return ObjectStats{Keys: 3, Uploaded: 2, Gets: 5, GetBytes: 1 << 20} },
		Staging:   func() (int, int, int) { return 2, 16, 4 << 20 },
		GPUFiles: func() GPUFileStats {
			return GPUFileStats{Files: 6, Bytes: 6 << 25, Limit: 100, Registered: 9, Released: 3, Failed: 1, Deferred: 2, Warmed: 7, Stores: 12, Loads: 14, Queued: 5, Waits: 4, Waited: 1500 * time.Millisecond, Mapped: 3}
		},
		GPUStaging:      func() (int, int, int) { return 3, 31, 4<<20 + 8192 },
		GPUChecksumJobs: func() (uint64, uint64) { return 17, 5 },
		GPUFaults:       func() map[int]uint64 { return map[int]uint64{0: 0, 1: 2} },
		CuFile: func() CuFileStats {
			return CuFileStats{Cached: 7, Registrations: 20, Failures: 2, Hits: 50, Evictions: 8, Forgotten: 4, Unlinked: 1}
		},
		Statfs: func(string) (int64, error) { return fsAvail, nil },
	}
}

// observeOneOfEach feeds each histogram: a store job, a policy call and
// two lookups.
func observeOneOfEach(m *Metrics) {
	m.ObserveJob(JobEvent{Direction: "store", Memory: "host", Path: "staging", Bytes: 4096, Duration: time.Millisecond,
		Outcomes: [NumOutcomes]int{OutcomeStored: 2, OutcomeNotAdmitted: 1}})
	m.ObservePolicyCall("kvhost_name", 4, 3*time.Microsecond)
	m.ObserveRequest("lookup", 40*time.Microsecond)
	m.ObserveRequest("lookup", 3*time.Millisecond)
}

// TestMetricsExposeSourcesAndObservations serves a registry over HTTP
// and checks, in the parsed text format, the collector's snapshot values,
// the histograms fed by ObserveJob and ObservePolicyCall, and the probes.
func TestMetricsExposeSourcesAndObservations(t *testing.T) {
	m := New("v1.2.3")
	ts := httptest.NewServer(m.Handler(false))
	defer ts.Close()

	if got := status(t, ts.URL+"/readyz"); got != http.StatusServiceUnavailable {
		t.Errorf("/readyz before SetReady: %d, want 503", got)
	}
	if got := status(t, ts.URL+"/healthz"); got != http.StatusOK {
		t.Errorf("/healthz: %d, want 200", got)
	}
	fams := scrape(t, ts.URL+"/metrics")
	if metricstest.Value(fams, "kvhost_build_info", map[string]string{"version": "v1.2.3"}) != 1 || metricstest.Value(fams, "kvhost_ready", nil) != 0 {
		t.Fatalf("build info or ready missing before sources: %v", fams["kvhost_build_info"])
	}

	dir, refusing := t.TempDir(), t.TempDir()
	m.SetSources(fullSources(dir, refusing))
	m.SetReady(true)
	if got := status(t, ts.URL+"/healthz/gpu"); got != http.StatusServiceUnavailable {
		t.Errorf("/healthz/gpu with 2 faults on device 1: %d, want 503", got)
	}
	if got := status(t, ts.URL+"/healthz"); got != http.StatusOK {
		t.Errorf("/healthz with 2 faults on device 1: %d, want 200 (the process serves)", got)
	}
	observeOneOfEach(m)

	fams = scrape(t, ts.URL+"/metrics")
	mount := map[string]string{"mount": dir}
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"kvhost_ready", nil, 1},
		{"kvhost_entries", nil, 3},
		{"kvhost_namespaces", nil, 2},
		{"kvhost_namespace_keys", map[string]string{"fingerprint": "000000000000feed", "model": "vllm:m:0"}, 32},
		{"kvhost_namespace_files", map[string]string{"fingerprint": "000000000000feed", "model": "vllm:m:0"}, 2},
		{"kvhost_namespace_bytes", map[string]string{"fingerprint": "000000000000feed", "model": "vllm:m:0"}, 64 << 20},
		{"kvhost_budget_used_bytes", map[string]string{"budget": "vllm:m:*"}, 64 << 20},
		{"kvhost_budget_bytes", map[string]string{"budget": "vllm:m:*"}, 32 << 20},
		{"kvhost_budget_floor_bytes", map[string]string{"budget": "vllm:m:*"}, 16 << 20},
		{"kvhost_budget_over_evictions_total", map[string]string{"budget": "vllm:m:*"}, 9},
		{"kvhost_budget_floor_skips_total", map[string]string{"budget": "vllm:m:*"}, 2},
		{"kvhost_namespace_keys", map[string]string{"fingerprint": "0000000000000001", "model": ""}, 1},
		{"kvhost_namespace_caches", map[string]string{"fingerprint": "000000000000feed", "model": "vllm:m:0"}, 2},
		{"kvhost_namespace_caches", map[string]string{"fingerprint": "0000000000000001", "model": ""}, 0},
		{"kvhost_stored_keys_total", nil, 5},
		{"kvhost_hits_total", nil, 7},
		{"kvhost_misses_total", nil, 2},
		{"kvhost_evictions_total", nil, 1},
		{"kvhost_remove_failures_total", nil, 13},
		{"kvhost_demotions_total", nil, 74700},
		{"kvhost_promotions_total", nil, 12},
		{"kvhost_tick_moves_total", nil, 30},
		{"kvhost_move_failures_total", nil, 2},
		{"kvhost_demotion_deletes_total", nil, 5},
		{"kvhost_duplicate_files_removed_total", nil, 3},
		{"kvhost_objects_demoter_uploads_total", nil, 6},
		{"kvhost_objects_demoter_upload_bytes_total", nil, 6 << 20},
		{"kvhost_objects_demoter_upload_failures_total", nil, 1},
		{"kvhost_mount_moved_in_files_total", mount, 8},
		{"kvhost_mount_moved_out_files_total", mount, 9},
		{"kvhost_written_bytes_total", nil, 4096},
		{"kvhost_key_failures_total", map[string]string{"direction": "store", "reason": "no_space"}, 4},
		{"kvhost_gpu_registered_files", nil, 6},
		{"kvhost_gpu_registered_file_bytes", nil, 6 << 25},
		{"kvhost_gpu_registered_files_limit", nil, 100},
		{"kvhost_gpu_file_registrations_queued", nil, 5},
		{"kvhost_gpu_load_mapped_files", nil, 3},
		{"kvhost_gpu_file_registrations_total", map[string]string{"result": "ok"}, 9},
		{"kvhost_gpu_file_registrations_total", map[string]string{"result": "released"}, 3},
		{"kvhost_gpu_file_registrations_total", map[string]string{"result": "failed"}, 1},
		{"kvhost_gpu_file_registrations_total", map[string]string{"result": "deferred"}, 2},
		{"kvhost_gpu_file_warm_offers_total", nil, 7},
		{"kvhost_gpu_file_registration_waits_total", nil, 4},
		{"kvhost_gpu_file_registration_wait_seconds_total", nil, 1.5},
		{"kvhost_gpu_direct_file_jobs_total", map[string]string{"direction": "store"}, 12},
		{"kvhost_gpu_direct_file_jobs_total", map[string]string{"direction": "load"}, 14},
		{"kvhost_gpu_checksum_jobs_total", map[string]string{"on": "cpu"}, 17},
		{"kvhost_gpu_checksum_jobs_total", map[string]string{"on": "gpu"}, 5},
		{"kvhost_gpu_staging_buffers_in_use", nil, 3},
		{"kvhost_gpu_staging_buffers", nil, 31},
		{"kvhost_gpu_staging_buffer_bytes", nil, 4<<20 + 8192},
		{"kvhost_gpu_device_faults_total", map[string]string{"device": "0"}, 0},
		{"kvhost_gpu_device_faults_total", map[string]string{"device": "1"}, 2},
		{"kvhost_cufile_handles", nil, 7},
		{"kvhost_cufile_handle_registrations_total", map[string]string{"result": "ok"}, 20},
		{"kvhost_cufile_handle_registrations_total", map[string]string{"result": "failed"}, 2},
		{"kvhost_cufile_handle_hits_total", nil, 50},
		{"kvhost_cufile_handles_dropped_total", map[string]string{"reason": "evicted"}, 8},
		{"kvhost_cufile_handles_dropped_total", map[string]string{"reason": "forgotten"}, 4},
		{"kvhost_cufile_handles_dropped_total", map[string]string{"reason": "unlinked"}, 1},
		{"kvhost_mount_capacity_bytes", mount, 1000},
		{"kvhost_mount_used_bytes", mount, 400},
		{"kvhost_mount_free_bytes", mount, 600},
		{"kvhost_mount_stores_failing", mount, 0},
		{"kvhost_mount_stores_failing", map[string]string{"mount": refusing}, 1},
		{"kvhost_mount_info", map[string]string{"mount": dir, "io": "buffered", "backend": "staging", "checksums": "true"}, 1},
		{"kvhost_data_path_fallbacks_total", map[string]string{"mount": dir, "mover": "cufile"}, 6},
		{"kvhost_policy_info", map[string]string{"policy": "lru", "backend": "native"}, 1},
		{"kvhost_policy_fallback", map[string]string{"reason": "trap in kvhost_name"}, 1},
		{"kvhost_policy_calls_total", map[string]string{"hook": "kvhost_name"}, 11},
		{"kvhost_policy_records_total", map[string]string{"hook": "kvhost_name"}, 40},
		{"kvhost_policy_failures_total", nil, 3},
		{"kvhost_policy_removed_offered_total", nil, 6},
		{"kvhost_policy_restarts_total", nil, 2},
		{"kvhost_clients", nil, 2},
		{"kvhost_jobs_in_flight", nil, 1},
		{"kvhost_jobs_in_flight_bytes", nil, 40 << 10},
		{"kvhost_jobs_in_flight_bytes_limit", nil, 1 << 30},
		{"kvhost_registered_regions", nil, 3},
		{"kvhost_client_descriptors", nil, 4},
		{"kvhost_client_pinned_keys", nil, 12},
		{"kvhost_client_pinned_keys_limit", nil, 1 << 22},
		{"kvhost_client_cache_layers", nil, 126},
		{"kvhost_client_cache_layers_limit", nil, 1 << 20},
		{"kvhost_incoming_frame_bytes", nil, 3 << 20},
		{"kvhost_incoming_frame_bytes_limit", nil, 256 << 20},
		{"kvhost_incoming_frames_waiting", nil, 2},
		{"kvhost_incoming_frame_waits_total", nil, 5},
		{"kvhost_limit_refusals_total", map[string]string{"limit": "server.max_inflight_bytes_per_peer"}, 7},
		{"kvhost_client_descriptors_limit", nil, 16382},
		{"kvhost_registered_bytes", nil, 1 << 20},
		{"kvhost_registered_bytes_limit", nil, 1 << 32},
		{"kvhost_gpu_registered_bytes", map[string]string{"device": "1"}, 5},
		{"kvhost_start_time_seconds", nil, 1700000000},
		{"kvhost_reloads_total", map[string]string{"result": "failed"}, 1},
		{"kvhost_staging_buffers_in_use", nil, 2},
		{"kvhost_staging_buffers_limit", nil, 16},
		{"kvhost_jobs_total", map[string]string{"direction": "store", "memory": "host", "path": "staging"}, 1},
		{"kvhost_job_bytes_total", map[string]string{"direction": "store"}, 4096},
		{"kvhost_job_duration_seconds", map[string]string{"direction": "store"}, 1},
		{"kvhost_job_keys_total", map[string]string{"direction": "store", "outcome": "stored"}, 2},
		{"kvhost_job_keys_total", map[string]string{"direction": "store", "outcome": "not_admitted"}, 1},
		{"kvhost_policy_call_duration_seconds", map[string]string{"hook": "kvhost_name"}, 1},
		{"kvhost_request_duration_seconds", map[string]string{"request": "lookup"}, 2},
	} {
		if got := metricstest.Value(fams, c.name, c.labels); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	if got := metricstest.Value(fams, "kvhost_mount_load_readers", mount); got != 4 {
		t.Errorf("load readers of the mount: %v, want 4", got)
	}
	if got := metricstest.Value(fams, "kvhost_mount_load_buffered", mount); got != 1 {
		t.Errorf("the mount's loads read buffered: %v, want 1", got)
	}
	if got := metricstest.Value(fams, "kvhost_mount_load_reader_changes_total", mount); got != 3 {
		t.Errorf("tuning's moves of the mount's load readers: %v, want 3", got)
	}
	if got := metricstest.Value(fams, "kvhost_mount_load_rate_bytes_per_second", mount); got != 1.5e9 {
		t.Errorf("the measured rate of the mount's load readers: %v, want 1.5e9", got)
	}
	for _, a := range []struct {
		readers, home string
		rate          float64
	}{{"4", "0", 1.5e9}, {"8", "1", 1.6e9}} {
		labels := map[string]string{"mount": mount["mount"], "readers": a.readers, "io": "buffered", "home": a.home}
		if got := metricstest.Value(fams, "kvhost_mount_load_arm_rate_bytes_per_second", labels); got != a.rate {
			t.Errorf("the measured rate of %s buffered readers (home %s): %v, want %v", a.readers, a.home, got, a.rate)
		}
	}
	if got := metricstest.Value(fams, "kvhost_mount_fs_available_bytes", mount); got != fsAvail {
		t.Errorf("file-system free space for the mount: %v, want %v", got, fsAvail)
	}
	if got := status(t, ts.URL+"/readyz"); got != http.StatusOK {
		t.Errorf("/readyz when ready: %d", got)
	}
	for name := range fams {
		if !strings.HasPrefix(name, "kvhost_") && !strings.HasPrefix(name, "go_") && !strings.HasPrefix(name, "process_") {
			t.Errorf("metric %s outside the documented prefixes", name)
		}
	}
	// Every source is set above, so every metric is exposed: each is named
	// in the first column of a table of docs/metrics.md, and each name
	// there is exposed.
	doc, err := os.ReadFile(filepath.Join("..", "..", "docs", "metrics.md"))
	if err != nil {
		t.Fatal(err)
	}
	documented := map[string]bool{}
	for _, row := range regexp.MustCompile("(?m)^\\| (`kvhost_[^|]*)\\|").FindAllStringSubmatch(string(doc), -1) {
		for _, n := range regexp.MustCompile("`(kvhost_[a-z0-9_]+)`").FindAllStringSubmatch(row[1], -1) {
			documented[n[1]] = true
		}
	}
	for name := range fams {
		if strings.HasPrefix(name, "kvhost_") && !documented[name] {
			t.Errorf("metric %s is not in the tables of docs/metrics.md", name)
		}
	}
	for name := range documented {
		if fams[name] == nil {
			t.Errorf("docs/metrics.md names %s, which is not exposed", name)
		}
	}
}

// TestProfilesServedOnlyWhenAsked: /debug/pprof/ answers 404 by default
// and serves the profile index and a heap profile with profiling on.
func TestProfilesServedOnlyWhenAsked(t *testing.T) {
	for _, profiling := range []bool{false, true} {
		ts := httptest.NewServer(New("v").Handler(profiling))
		want := http.StatusNotFound
		if profiling {
			want = http.StatusOK
		}
		for _, path := range []string{"/debug/pprof/", "/debug/pprof/heap", "/debug/pprof/goroutine?debug=1"} {
			if got := status(t, ts.URL+path); got != want {
				t.Errorf("profiling %v: GET %s = %d, want %d", profiling, path, got, want)
			}
		}
		if got := status(t, ts.URL+"/metrics"); got != http.StatusOK {
			t.Errorf("profiling %v: /metrics = %d", profiling, got)
		}
		ts.Close()
	}
}

// TestHealthzGPUFailsOnceAGPUsContextIsBroken: /healthz/gpu answers 503,
// naming the device, once a job failed there with a sticky CUDA error (the
// context stays broken until the daemon restarts); 200 with no GPU or no
// faults. /healthz answers 200 whatever the GPUs: the process serves.
func TestHealthzGPUFailsOnceAGPUsContextIsBroken(t *testing.T) {
	for _, tc := range []struct {
		name   string
		faults func() map[int]uint64
		want   int
		body   string
	}{
		{"no GPU", nil, http.StatusOK, "ok"},
		{"no faults", func() map[int]uint64 { return map[int]uint64{0: 0, 1: 0} }, http.StatusOK, "ok"},
		{"a broken GPU", func() map[int]uint64 { return map[int]uint64{0: 0, 3: 2} }, http.StatusServiceUnavailable, "GPU 3: 2 device faults (a sticky CUDA error, or a cuFile batch whose I/O did not come back)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := New("v")
			m.SetSources(Sources{GPUFaults: tc.faults})
			ts := httptest.NewServer(m.Handler(false))
			defer ts.Close()
			resp, err := http.Get(ts.URL + "/healthz/gpu")
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			body, err := io.ReadAll(resp.Body)
			if err != nil {
				t.Fatal(err)
			}
			if resp.StatusCode != tc.want || !strings.Contains(string(body), tc.body) {
				t.Fatalf("/healthz/gpu: %d %q, want %d and %q", resp.StatusCode, body, tc.want, tc.body)
			}
			if got := status(t, ts.URL+"/healthz"); got != http.StatusOK {
				t.Fatalf("/healthz: %d, want 200", got)
			}
		})
	}
}

// TestHealthzAnswers503WhileTheWatchdogFindsTheDaemonStalled: /healthz
// and /healthz/gpu follow Sources.Stalled, saying why; /readyz does not.
func TestHealthzAnswers503WhileTheWatchdogFindsTheDaemonStalled(t *testing.T) {
	m := New("v1")
	ts := httptest.NewServer(m.Handler(false))
	defer ts.Close()
	why := "2 jobs in flight, the oldest for 1m5s, and the data path has moved nothing for 1m0s"
	stalled := ""
	var mu sync.Mutex
	m.SetSources(Sources{Stalled: func() string { mu.Lock(); defer mu.Unlock(); return stalled }})
	m.SetReady(true)
	for _, path := range []string{"/healthz", "/healthz/gpu", "/readyz"} {
		if got := status(t, ts.URL+path); got != http.StatusOK {
			t.Errorf("%s serving: %d, want 200", path, got)
		}
	}
	mu.Lock()
	stalled = why
	mu.Unlock()
	for _, path := range []string{"/healthz", "/healthz/gpu"} {
		resp, err := http.Get(ts.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), why) {
			t.Errorf("%s stalled: %d %q, want 503 saying why", path, resp.StatusCode, body)
		}
	}
	if got := status(t, ts.URL+"/readyz"); got != http.StatusOK {
		t.Errorf("/readyz stalled: %d, want 200 (liveness restarts a stalled daemon; readiness is about accepting clients)", got)
	}
}

// scrapeOrHang is scrape with a bound that only catches a hang: a scrape
// that blocks (on a mount's statfs) fails the test instead of hanging it.
func scrapeOrHang(t *testing.T, url string) metricstest.Families {
	t.Helper()
	c := &http.Client{Timeout: testwait.Hang}
	resp, err := c.Get(url)
	if err != nil {
		t.Fatalf("scrape: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s", url, resp.Status)
	}
	fams, err := metricstest.Parse(resp.Body)
	if err != nil {
		t.Fatalf("parse %s: %v", url, err)
	}
	return fams
}

// TestScrapesBesideAHungMountKeepOneStatfsInFlight: a mount whose statfs
// stops answering (an NFS or FUSE server gone) neither blocks the scrapes
// nor gathers a stuck call per scrape. Each scrape answers with the space
// the mount last reported, how old that is and how long the call in
// flight has gone unanswered; the scrapes share that one call; once it
// answers, the next scrape reports fresh space and no call pending.
func TestScrapesBesideAHungMountKeepOneStatfsInFlight(t *testing.T) {
	dir := t.TempDir()
	var calls atomic.Int32
	var hung atomic.Bool
	release := make(chan struct{})
	defer func() {
		hung.Store(false)
		select {
		case <-release:
		default:
			close(release)
		}
	}()
	avail := atomic.Int64{}
	avail.Store(4096)
	m := New("test")
	m.SetSources(Sources{
		Engine: func() EngineStats { return EngineStats{Mounts: []MountStats{{Path: dir}}} },
		Statfs: func(string) (int64, error) {
			calls.Add(1)
			if hung.Load() {
				<-release
			}
			return avail.Load(), nil
		},
	})
	ts := httptest.NewServer(m.Handler(false))
	defer ts.Close()
	mount := map[string]string{"mount": dir}

	fams := scrapeOrHang(t, ts.URL+"/metrics")
	if got := metricstest.Value(fams, "kvhost_mount_fs_available_bytes", mount); got != 4096 {
		t.Fatalf("available %v, want 4096", got)
	}
	if got := metricstest.Value(fams, "kvhost_mount_statfs_pending_seconds", mount); got != 0 {
		t.Fatalf("statfs pending for %v s on a mount that answers", got)
	}

	hung.Store(true)
	avail.Store(8192)
	for i := range 3 {
		fams = scrapeOrHang(t, ts.URL+"/metrics")
		if got := metricstest.Value(fams, "kvhost_mount_fs_available_bytes", mount); got != 4096 {
			t.Errorf("scrape %d beside the hung mount: available %v, want the last answer, 4096", i, got)
		}
		if got := metricstest.Value(fams, "kvhost_mount_statfs_pending_seconds", mount); got <= 0 {
			t.Errorf("scrape %d beside the hung mount: statfs pending %v s, want > 0", i, got)
		}
		if got := metricstest.Value(fams, "kvhost_mount_fs_available_age_seconds", mount); got < 0 {
			t.Errorf("scrape %d beside the hung mount: no age of the last answer", i)
		}
	}
	if n := calls.Load(); n != 2 {
		t.Errorf("%d statfs calls after 4 scrapes, one hung: want 2 (the hung one shared)", n)
	}

	hung.Store(false)
	close(release)
	testwait.Until(t, "a scrape to find the mount answering", testwait.Hang, func() bool {
		fams := scrapeOrHang(t, ts.URL+"/metrics")
		return metricstest.Value(fams, "kvhost_mount_statfs_pending_seconds", mount) == 0 &&
			metricstest.Value(fams, "kvhost_mount_fs_available_bytes", mount) == 8192
	})
}

// TestMetricNamesStayAsDocumented: with every source set and each
// histogram fed, the registry exposes exactly the metrics of
// testdata/metric-names.txt, each with its type and label names.
// Dashboards and alerts name them: a change here is a change of the
// interface (and of docs/metrics.md), made on purpose by editing the file.
func TestMetricNamesStayAsDocumented(t *testing.T) {
	m := New("v")
	m.SetSources(fullSources(t.TempDir(), t.TempDir()))
	m.SetReady(true)
	observeOneOfEach(m)
	fams, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, f := range fams {
		if !strings.HasPrefix(f.GetName(), "kvhost_") {
			continue
		}
		labels := map[string]bool{}
		for _, mm := range f.Metric {
			for _, l := range mm.Label {
				labels[l.GetName()] = true
			}
		}
		got = append(got, fmt.Sprintf("%s %s %v", f.GetName(), f.GetType(), slices.Sorted(maps.Keys(labels))))
	}
	slices.Sort(got)
	b, err := os.ReadFile(filepath.Join("testdata", "metric-names.txt"))
	if err != nil {
		t.Fatal(err)
	}
	want := strings.Split(strings.TrimSpace(string(b)), "\n")
	for _, w := range want {
		if !slices.Contains(got, w) {
			t.Errorf("not exposed: %s", w)
		}
	}
	for _, g := range got {
		if !slices.Contains(want, g) {
			t.Errorf("exposed, not in testdata/metric-names.txt: %s", g)
		}
	}
}
