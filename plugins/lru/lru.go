// Package lru is kvhost's default placement policy: least-recently-used
// eviction over the files of every namespace, with the file naming of vLLM's
// FS offload tier and llm-d's fs connector.
//
// It is also the smallest complete example of a policy plugin. A policy is an
// ordinary Go type implementing guest.Policy (Init, Name, Access, Evict);
// implementing guest.Namespacer as well lets it choose the chunk layout of
// each model namespace. plugins/lru/wasm/main.go registers it, and
//
//	GOOS=wasip1 GOARCH=wasm go build -trimpath -buildmode=c-shared -o lru.wasm ./plugins/lru/wasm
//
// builds the module kvhost embeds. The same type runs natively under
// guest.NewDispatcher, which is how its tests run and how kvhost falls back
// when a plugin keeps failing.
//
// # Behaviour
//
//   - Names: <model>_<fingerprint: 12 hex>_r<rank>/<first byte of key hash,
//     2 hex>/<key as hex>.kv, on mount 0 (or the configured mount).
//   - Access: inserts and hits make an entry the most recent; pins nest and a
//     pinned entry is never a victim; a restore rebuilds the entry from the
//     host's index (its last access time); a remove forgets it.
//   - Evict: from the least recent entry on, skipping pinned entries and
//     entries on other mounts, until the victims' sizes cover the bytes asked
//     for. A victim's Score is its last access time, so the host can merge the
//     victims of several instances (shards) into one global LRU order.
//   - Rank (for a mount several nodes share): an entry's last access time,
//     comparable across nodes whose clocks agree.
//
// # Configuration
//
//	keys_per_file = 1        keys stored in one file (1..256)
//	order         = layer    layer | block: layout inside a file
//	mount         = 0        the mount every file goes to
package lru

import (
	"strconv"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/plugins/internal/policykit"
)

// Name is the policy's name, as kvhost's configuration spells it.
const Name = "lru"

// Policy is the LRU policy. The zero value is not usable; call New.
type Policy struct {
	layout policykit.Layout
	mount  uint32
	names  *policykit.Names
	track  *policykit.Tracker
}

// New returns an LRU policy with the default configuration.
func New() *Policy {
	names, _ := policykit.NewNames(1) // depth 1 is always valid
	return &Policy{
		layout: policykit.Layout{KeysPerFile: abi.DefaultKeysPerFile, Order: abi.DefaultOrder},
		names:  names,
		track:  policykit.NewTracker(1, nil),
	}
}

// Keys returns the configuration keys Init reads; it refuses any other
// (but the host's).
func Keys() []string { return append(policykit.LayoutKeys(), "mount") }

// Init reads the configuration.
func (p *Policy) Init(cfg guest.Config) error {
	if err := cfg.CheckKeys(Keys()...); err != nil {
		return policykit.ConfigFailure(Name, err)
	}
	layout, err := policykit.ParseLayout(cfg)
	if err != nil {
		return policykit.ConfigFailure(Name, err)
	}
	mount, err := policykit.MountIndex(cfg, "mount", 0)
	if err != nil {
		return policykit.ConfigFailure(Name, err)
	}
	p.layout, p.mount = layout, mount
	return nil
}

// Namespace gives the namespace the configured layout and records its
// directory name.
func (p *Policy) Namespace(r *abi.NamespaceRecord) error {
	if p.mount >= max(r.MountCount, 1) {
		return guest.Unsupported("lru: mount " + strconv.FormatUint(uint64(p.mount), 10) + " is configured but there are only " + strconv.FormatUint(uint64(r.MountCount), 10) + " mounts")
	}
	p.layout.Apply(r)
	return p.names.Declare(r)
}

// Name names every key on the configured mount.
func (p *Policy) Name(recs []abi.NameRecord) error {
	return p.names.PutAll(recs, p.mount)
}

// Access applies access records.
func (p *Policy) Access(recs []abi.AccessRecord) error {
	return p.track.ApplyAll(recs)
}

// Evict writes the least recently used unpinned entries on req.Mount until
// their sizes cover req.Bytes or out is full.
func (p *Policy) Evict(req *abi.EvictRequest, out []abi.Victim) (int, error) {
	t := p.track
	n, freed := 0, uint64(0)
	for i := t.Lists[0].Front(&t.Pool); i >= 0 && n < len(out) && freed < req.Bytes; i = t.Pool.Next(i) {
		e := t.Pool.At(i)
		if !policykit.Eligible(e, req) {
			continue
		}
		out[n] = abi.Victim{Entry: e.ID, Score: e.Time}
		n++
		freed += e.Size
	}
	return n, nil
}

// Rank ranks entries by their last access time (abi.FeatureRank).
func (p *Policy) Rank(recs []abi.RankRecord) error {
	p.track.Rank(recs, policykit.LastAccess)
	return nil
}
