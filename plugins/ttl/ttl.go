// Package ttl is a placement policy that expires entries: an entry not
// accessed for longer than a time-to-live is evicted first, whether or not
// space is short; beyond the expired entries, eviction falls back to
// least-recently-used order.
//
// It shows how a plugin deals with time without a clock: the sandbox has no
// clock import, so "now" is the Time of the eviction request, and an entry's
// age is that minus the Time of its last access record.
//
// # Behaviour
//
//   - Names and access tracking as package lru (same file names, pins,
//     restores, removals).
//   - Evict: first every unpinned entry on the requested mount whose last
//     access is more than ttl before req.Time, oldest first, even beyond the
//     bytes asked for (so one eviction pass also cleans up stale files), up to
//     the size of the output; then, if the bytes are not covered yet, the
//     least recently used of the rest. Score is the last access time.
//
// # Configuration
//
//	ttl           = 24h      time-to-live since the last access (Go duration)
//	keys_per_file = 1        keys stored in one file (1..256)
//	order         = layer    layer | block: layout inside a file
package ttl

import (
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/plugins/internal/policykit"
)

// Name is the policy's name, as kvhost's configuration spells it.
const Name = "ttl"

// DefaultTTL is the time-to-live when none is configured.
const DefaultTTL = 24 * time.Hour

// Policy is the TTL policy. The zero value is not usable; call New.
type Policy struct {
	ttl    uint64 // nanoseconds
	layout policykit.Layout
	names  *policykit.Names
	track  *policykit.Tracker
}

// New returns a TTL policy with the default configuration.
func New() *Policy {
	names, _ := policykit.NewNames(1)
	return &Policy{
		ttl:    uint64(DefaultTTL),
		layout: policykit.Layout{KeysPerFile: abi.DefaultKeysPerFile, Order: abi.DefaultOrder},
		names:  names,
		track:  policykit.NewTracker(1, nil),
	}
}

// Init reads the configuration.
func (p *Policy) Init(cfg guest.Config) error {
	layout, ttl, err := policykit.LayoutAndDuration(cfg, Name, "ttl", DefaultTTL, "90s or 2h")
	if err != nil {
		return err
	}
	p.ttl, p.layout = uint64(ttl), layout
	return nil
}

// Namespace gives the namespace the configured layout.
func (p *Policy) Namespace(r *abi.NamespaceRecord) error {
	p.layout.Apply(r)
	return p.names.Declare(r)
}

// Name names every key on mount 0.
func (p *Policy) Name(recs []abi.NameRecord) error {
	return p.names.PutAll(recs, 0)
}

// Access applies access records.
func (p *Policy) Access(recs []abi.AccessRecord) error {
	return p.track.ApplyAll(recs)
}

// Evict writes the expired entries, then least recently used ones until the
// bytes are covered.
func (p *Policy) Evict(req *abi.EvictRequest, out []abi.Victim) (int, error) {
	t := p.track
	n, freed := 0, uint64(0)
	// The list is in last-access order, so the expired entries are a prefix
	// of it and LRU order continues from where they end: one walk does both.
	for i := t.Lists[0].Front(&t.Pool); i >= 0 && n < len(out); i = t.Pool.Next(i) {
		e := t.Pool.At(i)
		expired := e.Time+p.ttl < req.Time && e.Time+p.ttl >= e.Time // no wrap
		if !expired && freed >= req.Bytes {
			break
		}
		if !policykit.Eligible(e, req) {
			continue
		}
		out[n] = abi.Victim{Entry: e.ID, Score: e.Time}
		n++
		freed += e.Size
	}
	return n, nil
}
