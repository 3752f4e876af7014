// Package tiered is kvhost's two-tier placement policy: a hot local mount
// (by default mount 0, a local NVMe) in front of a cold shared mount (by
// default mount 1, a shared file system), the hierarchy LMCache users run.
// It uses every tiering feature of ABI v1 (docs/abi.md, "Tiering").
//
// # Behaviour
//
//   - Names: as lru (<model>_<fingerprint>_r<rank>/<hash byte>/<key>.kv),
//     always on the hot mount; moves keep the relative path.
//   - Admission (FeatureAdmit, FeatureAdmitMount): every file is admitted,
//     to the hot mount, or to the cold one when the file is larger than the
//     hot mount's whole capacity (from the mount descriptions).
//   - Eviction (FeatureDemote): under pressure on the hot mount, its least
//     recently used unpinned entries are demoted to the cold mount (deleted
//     instead if the cold mount has no room, abi.MoveDeleteIfFull); on the
//     cold mount, its least recently used entries are deleted.
//   - Promotion (FeatureTick): a cold entry hit promote_hits times within
//     promote_window of the first of those hits is moved back to the hot
//     mount at the next tick; a hit past the window starts a new count.
//   - Mounts (FeatureMounts): the last description is kept for admission,
//     and decides whether the cold mount exists.
//
// With a single mount (or cold ≥ the mount count) it behaves as lru, and so
// it does until the host has described the mounts: it never demotes or
// promotes on a guess of the hierarchy (the host refuses that).
//
// # Configuration
//
//	keys_per_file  = 1      keys stored in one file (1..256)
//	order          = layer  layer | block: layout inside a file
//	hot            = 0      the hot mount
//	cold           = 1      the cold mount
//	promote_hits   = 3      hits within the window that promote a cold entry (0: never)
//	promote_window = 60s    the window
package tiered

import (
	"strconv"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/plugins/internal/policykit"
)

// Name is the policy's name, as kvhost's configuration spells it.
const Name = "tiered"

// Defaults of the configuration.
const (
	DefaultPromoteHits   = 3
	DefaultPromoteWindow = 60 * time.Second
)

// maxPending bounds the entries waiting for promotion, so that a host that
// never ticks (or ticks rarely) cannot make the queue grow without bound.
const maxPending = 4096

// Policy is the tiered policy. The zero value is not usable; call New.
type Policy struct {
	layout      policykit.Layout
	hot, cold   uint32
	promoteHits uint32
	window      uint64 // nanoseconds
	names       *policykit.Names
	track       *policykit.Tracker // one list per mount
	mounts      []abi.MountRecord  // the last description (nil before the first)

	// win is, per pool slot, the hits of the entry in that slot within the
	// current window: indexed by slot so that hits allocate nothing.
	win     []hitWindow
	pending []uint64 // cold entries to promote at the next tick
	heads   []int32  // scratch cursors of a merged walk over the lists
}

// hitWindow counts an entry's hits since start, the time of the first of
// them (none yet when hits is 0).
type hitWindow struct {
	start  uint64
	hits   uint32
	queued bool // in pending
}

// New returns a tiered policy with the default configuration.
func New() *Policy {
	names, _ := policykit.NewNames(1) // depth 1 is always valid
	p := &Policy{
		layout:      policykit.Layout{KeysPerFile: abi.DefaultKeysPerFile, Order: abi.DefaultOrder},
		hot:         0,
		cold:        1,
		promoteHits: DefaultPromoteHits,
		window:      uint64(DefaultPromoteWindow),
		names:       names,
	}
	p.track = policykit.NewTrackerByMount(2)
	return p
}

// Keys returns the configuration keys Init reads; it refuses any other
// (but the host's).
func Keys() []string {
	return append(policykit.LayoutKeys(), "hot", "cold", "promote_hits", "promote_window")
}

// Init reads the configuration.
func (p *Policy) Init(cfg guest.Config) error {
	if err := cfg.CheckKeys(Keys()...); err != nil {
		return policykit.ConfigFailure(Name, err)
	}
	layout, err := policykit.ParseLayout(cfg)
	if err != nil {
		return policykit.ConfigFailure(Name, err)
	}
	hot, err := policykit.MountIndex(cfg, "hot", 0)
	if err != nil {
		return policykit.ConfigFailure(Name, err)
	}
	cold, err := policykit.MountIndex(cfg, "cold", 1)
	if err != nil {
		return policykit.ConfigFailure(Name, err)
	}
	if hot == cold {
		return policykit.ConfigFailure(Name, &guest.ConfigError{Key: "cold", Value: cfg.String("cold", "1"), Want: "a mount other than hot"})
	}
	hits, err := cfg.Int("promote_hits", DefaultPromoteHits)
	if err == nil && (hits < 0 || hits > 1<<20) {
		err = &guest.ConfigError{Key: "promote_hits", Value: cfg.String("promote_hits", ""), Want: "an integer from 0 (never) to 1048576"}
	}
	if err != nil {
		return policykit.ConfigFailure(Name, err)
	}
	window, err := cfg.Duration("promote_window", DefaultPromoteWindow)
	if err != nil {
		return policykit.ConfigFailure(Name, err)
	}
	p.layout, p.hot, p.cold, p.promoteHits, p.window = layout, hot, cold, uint32(hits), uint64(window)
	return nil
}

// Namespace gives the namespace the configured layout.
func (p *Policy) Namespace(r *abi.NamespaceRecord) error {
	if p.hot >= max(r.MountCount, 1) {
		return guest.Unsupported("tiered: hot mount " + strconv.FormatUint(uint64(p.hot), 10) + " is configured but there are only " + strconv.FormatUint(uint64(r.MountCount), 10) + " mounts")
	}
	p.layout.Apply(r)
	return p.names.Declare(r)
}

// Name names every key on the hot mount.
func (p *Policy) Name(recs []abi.NameRecord) error {
	return p.names.PutAll(recs, p.hot)
}

// ExtraFeatures declares that Admit chooses the mount (abi.FeatureAdmitMount).
func (p *Policy) ExtraFeatures() abi.Feature { return abi.FeatureAdmitMount }

// Admit admits every file: to the hot mount, or to the cold one when the
// file is larger than the hot mount's capacity.
func (p *Policy) Admit(recs []abi.AdmitRecord) error {
	for i := range recs {
		r := &recs[i]
		r.Admit, r.Target = 1, p.hot
		if p.tiers() && int(p.hot) < len(p.mounts) && p.mounts[p.hot].Capacity < r.Size {
			r.Target = p.cold
		}
	}
	return nil
}

// Mounts keeps the mount description.
func (p *Policy) Mounts(recs []abi.MountRecord) error {
	p.mounts = append(p.mounts[:0], recs...)
	return nil
}

// tiers reports whether the host has described a cold mount that is not a
// vllm-fs mount (which takes no other files). Before any description it
// does not know the hierarchy: a namespace's mount count says how many
// mounts there are, not which is cold, and abi.md forbids a demotion
// before the description.
func (p *Policy) tiers() bool {
	return int(p.cold) < len(p.mounts) && p.mounts[p.cold].Flags&abi.MountVLLMFS == 0
}

// Access applies access records and counts the hits of cold entries.
func (p *Policy) Access(recs []abi.AccessRecord) error {
	t := p.track
	for i := range recs {
		r := &recs[i]
		if r.Kind != abi.AccessHit {
			if err := t.Apply(r); err != nil {
				return err
			}
			if slot, ok := t.Pool.Lookup(r.Entry); ok && (r.Kind == abi.AccessInsert || r.Kind == abi.AccessRestore) {
				*p.windowOf(slot) = hitWindow{}
			}
			continue
		}
		// The commonest record: one lookup, the Tracker's hit path (a
		// hit keeps the mount, so the list), and for a hit on a hot
		// entry, nothing else.
		slot, ok := t.Pool.Lookup(r.Entry)
		if !ok {
			continue
		}
		e := t.Pool.At(slot) // Tracker.Touch, inline: one call fewer
		old := e.Time
		e.Time = max(old, r.Time)
		e.Hits += 1 - uint32((uint64(e.Hits)+1)>>32) // saturating
		t.Lists[e.Class].TouchBack(&t.Pool, slot, old)
		if p.promoteHits == 0 || uint32(e.Mount) != p.cold || !p.tiers() {
			continue
		}
		w := p.windowOf(slot)
		// The window opens at the first hit it counts: an entry
		// demoted long ago has not used up its window.
		if w.hits == 0 || r.Time-w.start > p.window || r.Time < w.start {
			w.start, w.hits = r.Time, 0
		}
		w.hits++
		if w.hits >= p.promoteHits && !w.queued && len(p.pending) < maxPending {
			// A full queue (no tick, or ticks slower than promotions)
			// takes the entry at a later hit.
			w.queued = true
			p.pending = append(p.pending, r.Entry)
		}
	}
	return nil
}

// windowOf returns the hit window of slot, growing the windows to it.
func (p *Policy) windowOf(slot int32) *hitWindow {
	for int(slot) >= len(p.win) {
		p.win = append(p.win, hitWindow{})
	}
	return &p.win[slot]
}

// Evict deletes the least recently used unpinned entries on req.Mount (for
// a host that does not ask for targets).
func (p *Policy) Evict(req *abi.EvictRequest, out []abi.Victim) (int, error) {
	return p.walk(req, out, nil), nil
}

// EvictTo writes the least recently used unpinned entries on req.Mount:
// hot entries are demoted to the cold mount, cold entries deleted.
func (p *Policy) EvictTo(req *abi.EvictRequest, out []abi.Victim, targets []abi.VictimTarget) (int, error) {
	return p.walk(req, out, targets), nil
}

// walk writes victims in ascending last access over the lists of the
// requested mounts until their sizes cover req.Bytes or out is full, with
// their targets when targets is not nil.
func (p *Policy) walk(req *abi.EvictRequest, out []abi.Victim, targets []abi.VictimTarget) int {
	t := p.track
	p.heads = p.heads[:0]
	for c := range t.Lists {
		if req.Mount == abi.AnyMount || uint32(c) == req.Mount {
			p.heads = append(p.heads, t.Lists[c].Front(&t.Pool))
		}
	}
	n, freed := 0, uint64(0)
	for n < len(out) && freed < req.Bytes {
		best := -1
		for h, i := range p.heads {
			if i >= 0 && (best < 0 || t.Pool.At(i).Time < t.Pool.At(p.heads[best]).Time) {
				best = h
			}
		}
		if best < 0 {
			break
		}
		i := p.heads[best]
		p.heads[best] = t.Pool.Next(i)
		e := t.Pool.At(i)
		if !policykit.Eligible(e, req) {
			continue
		}
		out[n] = abi.Victim{Entry: e.ID, Score: e.Time}
		if targets != nil {
			targets[n] = abi.VictimTarget{Mount: abi.NoMount}
			if uint32(e.Mount) == p.hot && p.tiers() {
				targets[n] = abi.VictimTarget{Mount: p.cold, Flags: abi.MoveDeleteIfFull}
			}
		}
		n++
		freed += e.Size
	}
	return n
}

// Tick asks for the promotion of every cold entry hit promote_hits times
// within the window since the last tick, if it is still cold and unpinned.
func (p *Policy) Tick(req *abi.TickRequest, out []abi.Move) (int, error) {
	t := p.track
	n, i := 0, 0
	kept := p.pending[:0] // compacted in place: kept never passes i
	for ; i < len(p.pending) && n < len(out); i++ {
		id := p.pending[i]
		slot, ok := t.Pool.Lookup(id)
		if !ok {
			continue // removed (or moved: a new handle) since
		}
		e := t.Pool.At(slot)
		switch {
		case uint32(e.Mount) != p.cold || !p.tiers():
			p.win[slot].queued = false
		case e.Pins > 0:
			kept = append(kept, id) // next tick
		default:
			p.win[slot].queued = false
			out[n] = abi.Move{Entry: id, Mount: p.hot}
			n++
		}
	}
	p.pending = append(kept, p.pending[i:]...) // the rest waits for the next tick
	return n, nil
}

// Rank ranks entries by their last access time, as eviction orders them
// (abi.FeatureRank).
func (p *Policy) Rank(recs []abi.RankRecord) error {
	p.track.Rank(recs, policykit.LastAccess)
	return nil
}
