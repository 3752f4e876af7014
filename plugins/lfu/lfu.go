// Package lfu is a placement policy that evicts the least frequently used
// entries first, with aging so that an entry that was popular long ago does
// not stay forever.
//
// It shows how a policy keeps several recency lists and gives victims a Score
// that the host can compare across instances.
//
// # Behaviour
//
//   - Names as package lru.
//   - Every insert and hit counts one access; AccessRestore sets the count the
//     host knows. Entries are kept on frequency levels: level
//     bits.Len(accesses), at most 15 (so levels are powers of two: 1, 2-3,
//     4-7, ...), each level a list in last-access order.
//   - Aging: at every multiple of half_life since the Unix epoch that the
//     record times pass, every count is halved (an entry moves down one
//     level). Time comes from the records, as the sandbox has no clock; the
//     epochs are the same on every node, so nodes age alike.
//   - Evict: level 0 first, least recent first within a level; pinned
//     entries and entries on other mounts are skipped; stop when the victims'
//     sizes cover the bytes asked for. Score = level<<56 | last access>>8, so
//     that victims of several instances merge into one LFU order.
//   - Rank (for a mount several nodes share): last access + level ×
//     half_life: each doubling of an entry's (aged) count is worth one
//     half-life of recency, so ranks stay on the scale of access times and
//     compare across nodes, with the host's last-access ranks too.
//
// # Configuration
//
//	half_life     = 1h       time after which access counts are halved
//	keys_per_file = 1        keys stored in one file (1..256)
//	order         = layer    layer | block: layout inside a file
package lfu

import (
	"math/bits"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/plugins/internal/policykit"
)

// Name is the policy's name, as kvhost's configuration spells it.
const Name = "lfu"

// DefaultHalfLife is the aging period when none is configured.
const DefaultHalfLife = time.Hour

// Levels is the number of frequency levels.
const Levels = 16

// Policy is the LFU policy. The zero value is not usable; call New.
type Policy struct {
	halfLife uint64 // nanoseconds
	lastAged uint64 // the last aging epoch passed (a multiple of halfLife)
	started  bool   // a record with a time has set lastAged
	layout   policykit.Layout
	names    *policykit.Names
	track    *policykit.Tracker
}

// New returns an LFU policy with the default configuration.
func New() *Policy {
	names, _ := policykit.NewNames(1)
	return &Policy{
		halfLife: uint64(DefaultHalfLife),
		layout:   policykit.Layout{KeysPerFile: abi.DefaultKeysPerFile, Order: abi.DefaultOrder},
		names:    names,
		track:    policykit.NewTracker(Levels, level),
	}
}

// level is the frequency level of an entry: the bit length of its count.
func level(e *policykit.Entry) uint32 {
	return min(uint32(bits.Len32(e.Hits)), Levels-1)
}

// Init reads the configuration.
func (p *Policy) Init(cfg guest.Config) error {
	if err := cfg.CheckKeys(append(policykit.LayoutKeys(), "half_life")...); err != nil {
		return policykit.ConfigFailure(Name, err)
	}
	hl, err := policykit.PositiveDuration(cfg, "half_life", DefaultHalfLife, "30m or 2h")
	if err != nil {
		return policykit.ConfigFailure(Name, err)
	}
	layout, err := policykit.ParseLayout(cfg)
	if err != nil {
		return policykit.ConfigFailure(Name, err)
	}
	p.halfLife, p.layout = uint64(hl), layout
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

// Access applies access records, aging the counts when time has advanced by
// a half-life.
func (p *Policy) Access(recs []abi.AccessRecord) error {
	for i := range recs {
		r := &recs[i]
		if err := p.age(r.Time); err != nil {
			return err
		}
		if err := p.track.Apply(r); err != nil {
			return err
		}
	}
	return nil
}

// age halves every count once per half-life elapsed since the last aging.
// It walks every entry, but at most once per half-life of record time.
func (p *Policy) age(now uint64) error {
	if now == 0 {
		return nil // pins, unpins and removes may carry no time
	}
	if !p.started {
		p.lastAged, p.started = now-now%p.halfLife, true // epochs shared by every node
		return nil
	}
	if now < p.lastAged {
		return nil // a late record does not move the aging clock back
	}
	halvings := (now - p.lastAged) / p.halfLife
	if halvings == 0 {
		return nil
	}
	p.lastAged += halvings * p.halfLife
	shift := min(halvings, 32)
	pool := &p.track.Pool
	pool.Range(func(i int32) { pool.At(i).Hits = uint32(uint64(pool.At(i).Hits) >> shift) })
	return p.track.Reclassify()
}

// Evict writes the least frequently used unpinned entries on req.Mount until
// their sizes cover req.Bytes or out is full.
func (p *Policy) Evict(req *abi.EvictRequest, out []abi.Victim) (int, error) {
	t := p.track
	n, freed := 0, uint64(0)
	for lv := range t.Lists {
		for i := t.Lists[lv].Front(&t.Pool); i >= 0; i = t.Pool.Next(i) {
			if n == len(out) || freed >= req.Bytes {
				return n, nil
			}
			e := t.Pool.At(i)
			if !policykit.Eligible(e, req) {
				continue
			}
			out[n] = abi.Victim{Entry: e.ID, Score: Score(uint32(lv), e.Time)}
			n++
			freed += e.Size
		}
	}
	return n, nil
}

// Score orders victims by level, then by last access (at 256 ns resolution).
func Score(level uint32, time uint64) uint64 {
	return uint64(level)<<56 | min(time>>8, 1<<56-1)
}

// Rank ranks entries by last access plus one half-life per frequency level
// (abi.FeatureRank).
func (p *Policy) Rank(recs []abi.RankRecord) error {
	if len(recs) > 0 {
		if err := p.age(recs[0].Time); err != nil {
			return err
		}
	}
	p.track.Rank(recs, func(e *policykit.Entry, _ uint64) uint64 {
		return Rank(level(e), e.Time, p.halfLife)
	})
	return nil
}

// Rank is an entry's cluster rank: its last access plus level half-lives,
// saturating.
func Rank(level uint32, time, halfLife uint64) uint64 {
	hi, lo := bits.Mul64(uint64(level), halfLife)
	if hi != 0 {
		return ^uint64(0)
	}
	r, carry := bits.Add64(time, lo, 0)
	if carry != 0 {
		return ^uint64(0)
	}
	return r
}
