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
//     host knows as of the record's time (the entry's last access), halved
//     at every aging since, so that restores give alike histories alike
//     counts whatever order they come in. Entries are kept on frequency levels: level
//     bits.Len(accesses), at most 15 (so levels are powers of two: 1, 2-3,
//     4-7, ...), each level in last-access order.
//   - Aging: at every multiple of half_life since the Unix epoch that the
//     record times pass, every count is halved (an entry moves down one
//     level). Time comes from the records, as the sandbox has no clock; the
//     epochs are the same on every node, so nodes age alike. Aging is lazy:
//     an aging moves no entry, and an Access call moves at most 1024 (see
//     Policy for the one bounded exception).
//   - Evict: counts aged to the request's time first (as Rank does), so
//     that an instance that has seen no record for a while scores alike;
//     level 0 first, least recent first within a level; pinned entries and
//     entries on other mounts are skipped; stop when the victims' sizes
//     cover the bytes asked for. Score = level<<56 | last access>>8, so
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
	"math"
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
//
// It ages lazily, so that no aging walks the entries held (one that did
// ran out of fuel past about 200,000 entries): an entry's list (its Tracker class, a slot) has a key, the aging
// epoch at which the entry's count, as last set, halves to zero (the epoch
// it was set at plus its level then). Until then its level is the key less
// the epochs passed (an aging moves no entry); from then its count is zero,
// whatever Hits says, and its list, stale, is drained into the zero list a
// few entries per call. Evict merges by time the lists of a level: the zero
// list and the stale lists for level 0, the lists of levels 15 to 32 for
// level 15.
type Policy struct {
	halfLife uint64 // nanoseconds
	lastAged uint64 // the last aging epoch passed (a multiple of halfLife)
	epoch    uint64 // lastAged / halfLife once started, else 0
	started  bool   // a record with a time has set lastAged
	// nextAge is the earliest record time that may pass an aging epoch
	// (1 before a record with a time, lastAged + halfLife after,
	// saturating): Access's one comparison a record.
	nextAge uint64
	layout  policykit.Layout
	names   *policykit.Names
	track   *policykit.Tracker

	keys   []uint64    // each slot's key; slot zero's is 0
	active [ring]int32 // the slot of key k at k%ring, for keys epoch+1..epoch+32; none if no list
	stale  []int32     // slots whose key has passed, to drain into slot zero
	free   []int32     // slots on no use
	heads  []int32     // Evict's heap of list heads, by time
}

const (
	ring        = 32   // keys a count can be above the epoch: bits.Len32's range
	zero  int32 = 0    // the slot of entries whose count is zero
	none  int32 = -1   // no slot
	drain       = 1024 // entries an Access call moves from stale lists at most
)

// New returns an LFU policy with the default configuration.
func New() *Policy {
	names, _ := policykit.NewNames(1)
	p := &Policy{
		halfLife: uint64(DefaultHalfLife),
		nextAge:  1,
		layout:   policykit.Layout{KeysPerFile: abi.DefaultKeysPerFile, Order: abi.DefaultOrder},
		names:    names,
		keys:     make([]uint64, 1, policykit.MaxClasses),
		stale:    make([]int32, 0, policykit.MaxClasses),
		free:     make([]int32, 0, policykit.MaxClasses),
		heads:    make([]int32, 0, policykit.MaxClasses),
	}
	for k := range p.active {
		p.active[k] = none
	}
	p.track = policykit.NewTracker(1, p.class)
	return p
}

// class is the slot of entry e, whose Hits are its count as of the epoch:
// the zero slot for no count, else the slot of key epoch + bits.Len32(Hits),
// taken from the free slots if the key has none (reserve keeps one).
func (p *Policy) class(e *policykit.Entry) uint32 {
	if e.Hits == 0 {
		return uint32(zero)
	}
	k := p.epoch + uint64(bits.Len32(e.Hits))
	a := &p.active[k%ring]
	if *a == none {
		if n := len(p.free); n > 0 {
			*a, p.free = p.free[n-1], p.free[:n-1]
			p.keys[*a] = k
		} else {
			*a, p.keys = int32(len(p.keys)), append(p.keys, k)
		}
	}
	return uint32(*a)
}

// count returns entry e's count as of the epoch.
func (p *Policy) count(e *policykit.Entry) uint32 {
	k := p.keys[e.Class]
	if k <= p.epoch {
		return 0
	}
	set := k - uint64(bits.Len32(e.Hits)) // the epoch Hits were set at
	return e.Hits >> (p.epoch - set)
}

// level is the frequency level of an entry: the bit length of its count,
// at most Levels-1.
func (p *Policy) level(e *policykit.Entry) uint32 {
	k := p.keys[e.Class]
	if k <= p.epoch {
		return 0
	}
	return uint32(min(k-p.epoch, Levels-1))
}

// Init reads the configuration.
func (p *Policy) Init(cfg guest.Config) error {
	layout, hl, err := policykit.LayoutAndDuration(cfg, Name, "half_life", DefaultHalfLife, "30m or 2h")
	if err != nil {
		return err
	}
	p.halfLife, p.layout = uint64(hl), layout
	p.setNextAge()
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
	t := p.track
	for i := range recs {
		r := &recs[i]
		if r.Time >= p.nextAge {
			p.age(r.Time) // an aging may be due
		}
		if r.Kind == abi.AccessHit {
			// The commonest record: one lookup, the Tracker's hit path;
			// a count that stays on its level stays on its list.
			j, ok := t.Pool.Lookup(r.Entry)
			if !ok {
				continue // unknown: ignored
			}
			e := t.Pool.At(j)
			c := p.count(e)
			p.reserve()
			n := c + 1 - uint32((uint64(c)+1)>>32) // saturating
			old := e.Time
			e.Time, e.Hits = max(old, r.Time), n
			a := p.active[(p.epoch+uint64(bits.Len32(n)))%ring] // the slot of n's level, if any
			if c != 0 && a == int32(e.Class) {
				// Tracker.Touch, inline: one call fewer.
				t.Lists[e.Class].TouchBack(&t.Pool, j, old)
				continue
			}
			if a != none && a != int32(e.Class) && int(a) < len(t.Lists) {
				// A count that changes level to a level with a list:
				// Tracker.Reclass, inline, to the back of that list
				// in one call.
				from := e.Class
				e.Class = uint16(a)
				t.Lists[from].MoveBack(&t.Pool, j, &t.Lists[a])
				continue
			}
			if err := t.Reclass(j, p.class(e), old); err != nil {
				return err
			}
			continue
		}
		if r.Kind == abi.AccessInsert {
			// Bring the count up to date before the Tracker adds one. Its
			// list's key stays that of the count, so the entry may stay on
			// it even if the record is refused.
			if j, ok := t.Pool.Lookup(r.Entry); ok {
				e := t.Pool.At(j)
				e.Hits = p.count(e)
			}
		} else if r.Kind == abi.AccessRestore && r.Time != 0 && r.Time < p.lastAged {
			// The host's count is as of the entry's last access: halve it
			// at every aging since, on a copy (the record is the host's).
			rr := *r
			rr.Hits >>= p.epoch - r.Time/p.halfLife
			r = &rr
		}
		p.reserve()
		if err := t.Apply(r); err != nil {
			return err
		}
	}
	for budget := drain; budget > 0 && len(p.stale) > 0; {
		budget -= p.drainList(len(p.stale)-1, budget)
	}
	return nil
}

// age passes the aging epochs up to now: once per half-life elapsed since
// the last aging, every count halves. It moves no entry: the lists of the
// keys passed become stale.
func (p *Policy) age(now uint64) {
	if now == 0 {
		return // pins, unpins and removes may carry no time
	}
	if !p.started {
		p.lastAged, p.started = now-now%p.halfLife, true // epochs shared by every node
		p.rekey(p.lastAged / p.halfLife)
		p.setNextAge()
		return
	}
	if now < p.lastAged {
		return // a late record does not move the aging clock back
	}
	halvings := (now - p.lastAged) / p.halfLife
	if halvings == 0 {
		return
	}
	p.lastAged += halvings * p.halfLife
	p.epoch = p.lastAged / p.halfLife
	p.setNextAge()
	for k, a := range p.active {
		if a != none && p.keys[a] <= p.epoch {
			p.active[k] = none
			p.stale = append(p.stale, a)
		}
	}
}

// setNextAge sets nextAge from lastAged and halfLife.
func (p *Policy) setNextAge() {
	if !p.started {
		p.nextAge = 1
		return
	}
	next, carry := bits.Add64(p.lastAged, p.halfLife, 0)
	if carry != 0 {
		next = math.MaxUint64
	}
	p.nextAge = next
}

// rekey moves the keys of the lists made before the first record with a
// time (at epoch 0) to the epoch, so that their counts are as they were.
func (p *Policy) rekey(epoch uint64) {
	old := p.active
	for k := range p.active {
		p.active[k] = none
	}
	for _, a := range old {
		if a != none {
			p.keys[a] += epoch
			p.active[p.keys[a]%ring] = a
		}
	}
	p.epoch = epoch
}

// reserve makes sure that a slot is free for class to take: when every
// slot of the Tracker's is in use, it drains the smallest stale list, the
// one call that may move more than the drain budget: at most about 1/991
// of the entries, since more than 991 lists are stale then.
func (p *Policy) reserve() {
	if len(p.free) == 0 && len(p.keys) >= policykit.MaxClasses {
		p.drainSmallest()
	}
}

// drainSmallest drains the stale list with the fewest entries, freeing
// its slot (reserve's slow path, out of line so that reserve inlines).
func (p *Policy) drainSmallest() {
	lists, best := p.track.Lists, 0
	for j, s := range p.stale {
		if lists[s].Len() < lists[p.stale[best]].Len() {
			best = j
		}
	}
	p.drainList(best, math.MaxInt)
}

// drainList moves up to budget entries from stale list p.stale[j] to the
// zero list, freeing its slot once it is empty, and returns how many it
// moved.
func (p *Policy) drainList(j, budget int) int {
	t := p.track
	s := p.stale[j]
	l, z := &t.Lists[s], &t.Lists[zero]
	moved := 0
	for ; moved < budget && l.Len() > 0; moved++ {
		i := l.Front(&t.Pool)
		l.Remove(&t.Pool, i)
		t.Pool.At(i).Class = uint16(zero)
		z.Insert(&t.Pool, i)
	}
	if l.Len() == 0 {
		last := len(p.stale) - 1
		p.stale[j], p.stale = p.stale[last], p.stale[:last]
		p.free = append(p.free, s)
	}
	return moved
}

// Evict writes the least frequently used unpinned entries on req.Mount until
// their sizes cover req.Bytes or out is full, their counts aged to req.Time.
func (p *Policy) Evict(req *abi.EvictRequest, out []abi.Victim) (int, error) {
	p.age(req.Time)
	t := p.track
	n, freed := 0, uint64(0)
	for lv := range uint64(Levels) {
		p.heads = p.heads[:0]
		switch {
		case lv == 0:
			p.push(zero)
			for _, s := range p.stale {
				p.push(s)
			}
		case lv < Levels-1:
			p.push(p.active[(p.epoch+lv)%ring])
		default:
			for k := p.epoch + lv; k <= p.epoch+ring; k++ {
				p.push(p.active[k%ring])
			}
		}
		for j := len(p.heads)/2 - 1; j >= 0; j-- {
			p.down(j)
		}
		for len(p.heads) > 0 {
			if n == len(out) || freed >= req.Bytes {
				return n, nil
			}
			i := p.heads[0]
			if e := t.Pool.At(i); policykit.Eligible(e, req) {
				out[n] = abi.Victim{Entry: e.ID, Score: Score(uint32(lv), e.Time)}
				n++
				freed += e.Size
			}
			if next := t.Pool.Next(i); next >= 0 {
				p.heads[0] = next
			} else {
				last := len(p.heads) - 1
				p.heads[0], p.heads = p.heads[last], p.heads[:last]
			}
			p.down(0)
		}
	}
	return n, nil
}

// push adds the front of slot s's list, if any, to Evict's heap (not yet
// in heap order).
func (p *Policy) push(s int32) {
	if s == none {
		return
	}
	if i := p.track.Lists[s].Front(&p.track.Pool); i >= 0 {
		p.heads = append(p.heads, i)
	}
}

// down sifts Evict's heap entry j down to its place: least recent first,
// entries of one time by slot.
func (p *Policy) down(j int) {
	h, pool := p.heads, &p.track.Pool
	less := func(a, b int32) bool {
		ta, tb := pool.At(a).Time, pool.At(b).Time
		return ta < tb || ta == tb && a < b
	}
	for {
		c := 2*j + 1
		if c >= len(h) {
			return
		}
		if c+1 < len(h) && less(h[c+1], h[c]) {
			c++
		}
		if !less(h[c], h[j]) {
			return
		}
		h[j], h[c] = h[c], h[j]
		j = c
	}
}

// Score orders victims by level, then by last access (at 256 ns resolution).
func Score(level uint32, time uint64) uint64 {
	return uint64(level)<<56 | min(time>>8, 1<<56-1)
}

// Rank ranks entries by last access plus one half-life per frequency level
// (abi.FeatureRank).
func (p *Policy) Rank(recs []abi.RankRecord) error {
	if len(recs) > 0 {
		p.age(recs[0].Time)
	}
	p.track.Rank(recs, func(e *policykit.Entry, _ uint64) uint64 {
		return Rank(p.level(e), e.Time, p.halfLife)
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
