package server

import (
	"time"

	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/protocol"
)

// Stats are a Server's daemon-wide figures (metrics, kvhost stats).
type Stats struct {
	// Caches counts the caches registered now on all connections, by the
	// fingerprint of their namespace.
	Caches       map[uint64]uint32
	Clients      int // connections through the handshake
	Handshakes   int // connections not through it yet
	InflightJobs int // store and load jobs of all connections
	// InflightBytes is what those jobs hold, as JobBytes counts it;
	// InflightLimit is Config.MaxInflightBytes.
	InflightBytes, InflightLimit int64
	// Descriptors are the clients' descriptors the daemon holds
	// (registered host memory, descriptors sent with frames not yet
	// answered); DescriptorLimit is Config.MaxDescriptors.
	Descriptors, DescriptorLimit int64
	// PinnedKeys are the keys the pins of all connections hold, as
	// counted against Config.MaxPinnedKeys (PinnedLimit).
	PinnedKeys, PinnedLimit int64
	// CacheLayers are the layers of the caches all connections hold
	// registered, as counted against Config.MaxCacheLayers
	// (CacheLayerLimit).
	CacheLayers, CacheLayerLimit int64
	// IncomingBytes are the bytes of the frame bodies all connections
	// have the daemon hold while it reads and answers them, as counted
	// against Config.MaxIncomingBytes (IncomingLimit; bodies of
	// UncountedBody bytes or less are not counted). IncomingWaiting is
	// the frames waiting for room now, and IncomingWaits those that
	// waited since the Server was created.
	IncomingBytes, IncomingLimit int64
	IncomingWaiting              int64
	IncomingWaits                uint64
	// Refusals counts the requests refused with limit exceeded by the
	// bound that refused them: its configuration key (server.max_...),
	// namespaces_per_connection, caches_per_connection,
	// pins_per_connection, or namespaces_per_daemon (the engine's
	// MaxNamespaces). Bounds that refused none are left out.
	Refusals        map[string]uint64
	Regions         int64 // host memory regions registered by all connections
	RegisteredBytes int64 // their bytes
	// RegisteredLimit is Config.MaxTotalRegisteredBytes.
	RegisteredLimit int64
	// Devices is the GPU memory registered per device.
	Devices []protocol.DeviceStats
	// Started is when the Server was created.
	Started time.Time
}

// Stats returns the server's daemon-wide figures.
func (s *Server) Stats() Stats {
	st := s.figures()
	st.Devices = s.deviceStats()
	return st
}

// figures is Stats without Devices.
func (s *Server) figures() Stats {
	s.mu.Lock()
	sessions := make([]*session, 0, len(s.sessions))
	for sess := range s.sessions {
		sessions = append(sessions, sess)
	}
	st := Stats{Clients: s.admitted, Handshakes: len(s.pending)}
	s.mu.Unlock()
	for _, sess := range sessions {
		sess.jmu.Lock()
		st.InflightJobs += len(sess.jobs)
		sess.jmu.Unlock()
	}
	st.InflightBytes, st.InflightLimit = s.jobBytes.Load(), s.cfg.MaxInflightBytes
	st.Descriptors, st.DescriptorLimit = s.fds.Load(), int64(s.cfg.MaxDescriptors)
	st.PinnedKeys, st.PinnedLimit = s.pinnedKeys(), int64(s.cfg.MaxPinnedKeys)
	st.Caches = s.cachesByFingerprint()
	st.CacheLayers, st.CacheLayerLimit = s.layers.Load(), int64(s.cfg.MaxCacheLayers)
	st.IncomingBytes, st.IncomingLimit = s.incoming.taken(), s.cfg.MaxIncomingBytes
	st.IncomingWaiting, st.IncomingWaits = s.incomingWaiting.Load(), s.incomingWaits.Load()
	for b := range numBounds {
		if n := s.refusals[b].Load(); n > 0 {
			if st.Refusals == nil {
				st.Refusals = make(map[string]uint64)
			}
			st.Refusals[boundNames[b]] = n
		}
	}
	st.Regions, st.RegisteredBytes = s.regions.Load(), s.regBytes.Load()
	st.RegisteredLimit = s.cfg.MaxTotalRegisteredBytes
	st.Started = s.started
	return st
}

// daemonStats is the daemon section of a Stats reply: the server's
// figures, the engine's mounts (from the engine.Stats the reply was built
// from), its byte budgets and what Config.Daemon adds.
func (s *Server) daemonStats(mounts []engine.MountStats, budgets []engine.BudgetStats) *protocol.DaemonStats {
	var d protocol.DaemonStats
	if s.cfg.Daemon != nil {
		d = s.cfg.Daemon()
	}
	st := s.figures()
	if d.Started == 0 {
		d.Started = st.Started.UnixNano()
	}
	d.InflightJobs, d.Regions, d.RegisteredBytes = uint64(st.InflightJobs), uint64(st.Regions), uint64(st.RegisteredBytes)
	d.Mounts = nil
	for _, mt := range mounts {
		d.Mounts = append(d.Mounts, protocol.MountInfo{Path: mt.Path, Backend: mt.Backend, IO: mt.IO, Checksums: mt.Checksums,
			Configured: uint64(max(mt.Configured, 0)), Reserve: uint64(max(mt.Reserve, 0)), Class: mt.Class})
	}
	d.Budgets = budgetList(budgets)
	return &d
}

// budgetList is the budgets section of a Stats reply: empty, not nil,
// without budgets (the reply then says there are none).
func budgetList(bs []engine.BudgetStats) []protocol.BudgetStats {
	out := make([]protocol.BudgetStats, 0, len(bs))
	for _, b := range bs {
		out = append(out, protocol.BudgetStats{Model: b.Model, Used: uint64(max(b.Bytes, 0)), Budget: uint64(max(b.Budget, 0)),
			Floor: uint64(max(b.Floor, 0)), Over: uint64(max(b.Over, 0)), Kept: uint64(max(b.Kept, 0))})
	}
	return out
}
