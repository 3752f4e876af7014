package daemon

import (
	"time"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/gds"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/metrics"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/protocol"
	"github.com/kvhost/kvhost/staging/gpu"
)

// This file adapts the daemon's parts to what package metrics reads:
// metrics imports no part of kvhost and defines its own snapshot types
// (metrics.Sources); each func here wraps a part's stats call into the
// metrics source that copies the figures metrics exposes, field by field
// under the same names.

// EngineMetrics is the metrics source of the engine's stats (stats is
// engine.Engine.Stats).
func EngineMetrics(stats func() engine.Stats) func() metrics.EngineStats {
	return func() metrics.EngineStats { return engineSnapshot(stats()) }
}

// ServerMetrics is the metrics source of the socket server's stats
// (stats is server.Server.Stats).
func ServerMetrics(stats func() server.Stats) func() metrics.ServerStats {
	return func() metrics.ServerStats { return serverSnapshot(stats()) }
}

// PolicyMetrics is the metrics source of the running policy (state is
// PolicyState.State).
func PolicyMetrics(state func() PolicyInfo) func() metrics.PolicyState {
	return func() metrics.PolicyState {
		p := state()
		s := p.Stats
		return metrics.PolicyState{Name: p.Name, Stats: metrics.PolicyStats{
			Backend: s.Backend, Fallback: s.Fallback, FallbackReason: s.FallbackReason,
			Calls: s.Calls, Records: s.Records,
			Failures: s.Failures, Rejections: s.Rejections, Replacements: s.Replacements,
			SlowCalls: s.SlowCalls, StaleVictims: s.StaleVictims, RemovedOffered: s.RemovedOffered,
		}}
	}
}

// GPUFileMetrics is the metrics source of the files the GPU staging
// pipeline keeps registered (stats is gpu.Mover.FileStats).
func GPUFileMetrics(stats func() gpu.FileStats) func() metrics.GPUFileStats {
	return func() metrics.GPUFileStats {
		f := stats()
		return metrics.GPUFileStats{
			Files: f.Files, Bytes: f.Bytes, Limit: f.Limit, Queued: f.Queued,
			Registered: f.Registered, Released: f.Released, Failed: f.Failed, Deferred: f.Deferred,
			Warmed: f.Warmed, Waits: f.Waits, Waited: f.Waited, Stores: f.Stores, Loads: f.Loads,
			Mapped: f.Mapped,
		}
	}
}

// CuFileMetrics is the metrics source of cuFile's handle cache (stats is
// gds.Driver.HandleStats).
func CuFileMetrics(stats func() gds.HandleStats) func() metrics.CuFileStats {
	return func() metrics.CuFileStats {
		h := stats()
		return metrics.CuFileStats{
			Cached: h.Cached, Registrations: h.Registrations, Failures: h.Failures, Hits: h.Hits,
			Evictions: h.Evictions, Forgotten: h.Forgotten, Unlinked: h.Unlinked,
		}
	}
}

// StatfsMetrics is the metrics source of the mounts' available space:
// the statfs of fs, the engine's file system (nil: the operating
// system's).
func StatfsMetrics(fs fsys.FS) func(path string) (int64, error) {
	if fs == nil {
		fs = fsys.OS{}
	}
	return func(path string) (int64, error) {
		st, err := fs.Statfs(path)
		return st.Avail, err
	}
}

// JobObserver is the engine's job observer (engine.Config.Observer) that
// feeds m's job metrics.
func JobObserver(m *metrics.Metrics) engine.Observer { return jobObserver{m} }

// RequestObserver is the server's request observer
// (server.Config.OnRequest) that feeds m's request latencies.
func RequestObserver(m *metrics.Metrics) func(protocol.Type, time.Duration) {
	return func(t protocol.Type, took time.Duration) { m.ObserveRequest(t.String(), took) }
}

// jobObserver passes the engine's finished jobs to the metrics.
type jobObserver struct{ m *metrics.Metrics }

// ObserveJob implements engine.Observer.
func (o jobObserver) ObserveJob(ev engine.JobEvent) {
	out := metrics.JobEvent{Direction: ev.Direction, Memory: ev.Memory.String(), Path: ev.Path, Bytes: ev.Bytes, Duration: ev.Duration}
	// One vocabulary (package outcome): the engine's outcomes are the
	// metrics', counted at the same positions.
	for o, n := range ev.Outcomes {
		if o < len(out.Outcomes) {
			out.Outcomes[o] += n
		}
	}
	o.m.ObserveJob(out)
}

// engineSnapshot copies what the metrics expose of the engine's stats.
func engineSnapshot(st engine.Stats) metrics.EngineStats {
	out := metrics.EngineStats{
		Entries: st.Entries, Keys: st.Keys, HeldFound: st.HeldFound,
		Stores: st.Stores, Loads: st.Loads, LayerLoadsByKey: st.LayerLoadsByKey, LoadKeysCheckedBefore: st.LoadKeysCheckedBefore, FilesVerifiedAhead: st.FilesVerifiedAhead, Hits: st.Hits, Misses: st.Misses,
		Evictions: st.Evictions, Reused: st.Reused, SparesMade: st.SparesMade,
		Corrupt: st.Corrupt, Vanished: st.Vanished, RemoveFailures: st.RemoveFailures,
		BytesWritten: st.BytesWritten, BytesRead: st.BytesRead,
		PinnedFilesOpen: st.PinnedFilesOpen, PinnedFilesUnopened: st.PinnedFilesUnopened,
		StoreFailures: failuresSnapshot(st.StoreFailures), LoadFailures: failuresSnapshot(st.LoadFailures),
		Tiering: metrics.TierStats{
			Demotions: st.Tiering.Demotions, Promotions: st.Tiering.Promotions, Moves: st.Tiering.Moves,
			MoveFailures: st.Tiering.MoveFailures, DemotionDeletes: st.Tiering.DemotionDeletes, Deduped: st.Tiering.Deduped,
			ObjectUploads: st.Tiering.ObjectUploads, ObjectUploadBytes: st.Tiering.ObjectUploadBytes, ObjectUploadFailures: st.Tiering.ObjectUploadFailures,
		},
		Namespaces: make([]metrics.NamespaceStats, len(st.Namespaces)),
		Mounts:     make([]metrics.MountStats, len(st.Mounts)),
	}
	for i, ns := range st.Namespaces {
		out.Namespaces[i] = metrics.NamespaceStats{Fingerprint: ns.Fingerprint, Model: ns.Model, Files: ns.Files, Keys: ns.Keys, Bytes: ns.Bytes}
	}
	for _, b := range st.Budgets {
		out.Budgets = append(out.Budgets, metrics.BudgetStats{Model: b.Model, Bytes: b.Bytes, Budget: b.Budget, Floor: b.Floor, Over: b.Over, Kept: b.Kept})
	}
	for i, mt := range st.Mounts {
		out.Mounts[i] = metrics.MountStats{
			Path: mt.Path, Capacity: mt.Capacity, Used: mt.Used, Entries: mt.Entries, SpareBytes: mt.SpareBytes,
			IO: mt.IO, Backend: mt.Backend, Checksums: mt.Checksums, MovedIn: mt.MovedIn, MovedOut: mt.MovedOut,
			StoresFailing: mt.StoresFailing != nil, LoadReaders: mt.LoadReaders, LoadBuffered: mt.LoadBuffered,
			LoadReadersChanged: mt.LoadReadersChanged, LoadRate: mt.LoadRate,
		}
		for _, a := range mt.LoadArms {
			out.Mounts[i].LoadArms = append(out.Mounts[i].LoadArms, metrics.LoadArm{Readers: a.Readers, Buffered: a.Buffered, Rate: a.Rate, Home: a.Home})
		}
	}
	return out
}

// failuresSnapshot copies failed keys by reason.
func failuresSnapshot(f engine.Failures) metrics.Failures {
	return metrics.Failures{NoSpace: f.NoSpace, Corrupt: f.Corrupt, Policy: f.Policy, Canceled: f.Canceled, IO: f.IO, Other: f.Other}
}

// serverSnapshot copies what the metrics expose of the server's stats.
func serverSnapshot(st server.Stats) metrics.ServerStats {
	out := metrics.ServerStats{
		Clients: st.Clients, Handshakes: st.Handshakes, InflightJobs: st.InflightJobs,
		InflightBytes: st.InflightBytes, InflightLimit: st.InflightLimit,
		Descriptors: st.Descriptors, DescriptorLimit: st.DescriptorLimit,
		PinnedKeys: st.PinnedKeys, PinnedLimit: st.PinnedLimit,
		CacheLayers: st.CacheLayers, CacheLayerLimit: st.CacheLayerLimit,
		IncomingBytes: st.IncomingBytes, IncomingLimit: st.IncomingLimit,
		IncomingWaiting: st.IncomingWaiting, IncomingWaits: st.IncomingWaits,
		Regions: st.Regions, RegisteredBytes: st.RegisteredBytes, RegisteredLimit: st.RegisteredLimit,
		Caches: st.Caches, Refusals: st.Refusals, Started: st.Started,
		Devices: make([]metrics.DeviceStats, len(st.Devices)),
	}
	for i, d := range st.Devices {
		out.Devices[i] = metrics.DeviceStats{Ordinal: d.Ordinal, Regions: d.Regions, Registered: d.Registered, Limit: d.Limit}
	}
	return out
}
