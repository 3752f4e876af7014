package policy

import "sync/atomic"

// hook identifies a plugin export the host calls.
type hook int

const (
	hookInit hook = iota
	hookNamespace
	hookName
	hookAdmit
	hookAccess
	hookEvict
	hookMounts
	hookTick
	hookRank
	numHooks
)

var hookNames = [numHooks]string{
	hookInit:      "kvhost_init",
	hookNamespace: "kvhost_namespace",
	hookName:      "kvhost_name",
	hookAdmit:     "kvhost_admit",
	hookAccess:    "kvhost_access",
	hookEvict:     "kvhost_evict",
	hookMounts:    "kvhost_mounts",
	hookTick:      "kvhost_tick",
	hookRank:      "kvhost_rank",
}

func (h hook) String() string { return hookNames[h] }

// Stats are a Host's counters since Open, for metrics.
type Stats struct {
	// Calls counts hook calls by export name ("kvhost_name", ...), retries
	// and state rebuilding included.
	Calls map[string]uint64
	// Records counts records passed, by export name.
	Records map[string]uint64
	// Failures counts failed calls: traps, timeouts, failure statuses and
	// outputs the host rejected.
	Failures uint64
	// Rejections counts the failures that were outputs the host rejected
	// (a subset of Failures).
	Rejections uint64
	// Replacements counts instances closed and rebuilt after a failure.
	Replacements uint64
	// StaleVictims counts victims skipped because the engine had pinned or
	// removed them before the plugin could know; not failures.
	StaleVictims uint64
	// RemovedOffered counts victims and moves of entries the plugin had
	// been sent a REMOVE for: each fails the call (a plugin that ignores
	// REMOVE records), and is also counted in Failures and Rejections.
	RemovedOffered uint64
	// SlowCalls counts calls of the wasm plugin that finished within their
	// fuel but after their wall-clock deadline (an overloaded machine); not
	// failures.
	SlowCalls uint64
	// Fallback is true once the Host runs its native fallback policy.
	Fallback bool
	// FallbackReason is the failure that caused the switch.
	FallbackReason string
	// FallbackPolicy names the fallback (Config.FallbackName), set with
	// Fallback.
	FallbackPolicy string
	// Backend is "wasm" or "native": what answers calls now.
	Backend string
	// Loading is true while the Host serves Config.Interim and its
	// module is still loading.
	Loading bool
}

// counters are the atomic counters behind Stats.
type counters struct {
	calls        [numHooks]atomic.Uint64
	records      [numHooks]atomic.Uint64
	failures     atomic.Uint64
	rejections   atomic.Uint64
	replacements atomic.Uint64
	staleVictims atomic.Uint64
	slowCalls    atomic.Uint64
	removed      atomic.Uint64
}

func (c *counters) snapshot() Stats {
	s := Stats{Calls: map[string]uint64{}, Records: map[string]uint64{}}
	for h := range numHooks {
		s.Calls[h.String()] = c.calls[h].Load()
		s.Records[h.String()] = c.records[h].Load()
	}
	s.Failures = c.failures.Load()
	s.Rejections = c.rejections.Load()
	s.Replacements = c.replacements.Load()
	s.StaleVictims = c.staleVictims.Load()
	s.SlowCalls = c.slowCalls.Load()
	s.RemovedOffered = c.removed.Load()
	return s
}
