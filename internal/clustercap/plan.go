package clustercap

import (
	"fmt"
	"math"
)

// StaleIntervals is how many of its publication intervals a node's summary
// may age before the node may be dead: it is dead once its summary is that
// stale and its lock file is free (Live).
const StaleIntervals = 3

// Bound is the cluster-wide bound of a shared mount: the most bytes every
// node's files may take together, and the watermarks between which
// eviction runs (usage above High evicts down to Low).
type Bound struct {
	Capacity, High, Low int64 // bytes: the bound, the high watermark and the low watermark
}

// NewBound returns the bound of capacity bytes with watermarks high and
// low, fractions with 0 < low <= high <= 1.
func NewBound(capacity int64, high, low float64) (Bound, error) {
	if capacity <= 0 || low <= 0 || low > high || high > 1 {
		return Bound{}, fmt.Errorf("clustercap: capacity %d, watermarks high %v low %v: want capacity > 0, 0 < low <= high <= 1", capacity, high, low)
	}
	return Bound{Capacity: capacity, High: int64(float64(capacity) * high), Low: int64(float64(capacity) * low)}, nil
}

// Grant is the headroom one of nodes live nodes claims beyond its bytes:
// an equal share of the room between the high watermark and the capacity,
// at least min (a node must be able to claim one file).
func (b Bound) Grant(nodes int, min int64) int64 {
	g := (b.Capacity - b.High) / int64(max(nodes, 1))
	return max(g, min)
}

// Live reports whether the node of summary s may still be running at now
// (Unix nanoseconds): its summary is younger than StaleIntervals of its
// intervals, or its lock is held (lockFree says whether it is free; it is
// asked only for a stale summary).
func Live(s *Summary, now int64, lockFree func(node string) (bool, error)) (bool, error) {
	return LiveAt(s.Node, s.Time, s.Interval, now, lockFree)
}

// LiveAt is Live for a node whose last sign of life was at (Unix
// nanoseconds) and which publishes every interval: a summary's time and
// interval, or, for a summary that cannot be read, its file's
// modification time and the reader's interval.
func LiveAt(node string, at, interval, now int64, lockFree func(node string) (bool, error)) (bool, error) {
	if now-at < StaleIntervals*interval {
		return true, nil
	}
	free, err := lockFree(node)
	if err != nil {
		return true, err // unknown: never take a live node's files
	}
	return !free, nil
}

// Unclaimed returns, of dead (the summaries of nodes found dead), those
// whose files no live node counts yet: no summary of live names the node
// in its Adopted, and covered (this node's own completed adoptions; nil:
// none) does not report it. A dead node's files stay on the mount until
// its adopter evicts them, and until the adopter's summary counts them
// (its walk of the mount may take minutes) the dead node's last summary
// is the only count of them: every node counts it beside its live peers
// (Claims, Decide), so that no claim is granted into their room. Each is
// returned as a copy without its cut-off and touches: a dead node's last
// cut-off and uses are not in force.
func Unclaimed(dead, live []*Summary, covered func(node string) bool) []*Summary {
	named := map[string]bool{}
	for _, s := range live {
		for _, n := range s.Adopted {
			named[n] = true
		}
	}
	var out []*Summary
	for _, s := range dead {
		if named[s.Node] || covered != nil && covered(s.Node) {
			continue
		}
		g := *s
		g.Cut, g.CutTime, g.Touches, g.Adopted = 0, 0, nil, nil
		out = append(out, &g)
	}
	return out
}

// Claims is the sum of the claims of peers (live nodes' summaries),
// math.MaxInt64 if it passes that.
func Claims(peers []*Summary) int64 {
	var n int64
	for _, p := range peers {
		n = addSat(n, p.Claim)
	}
	return n
}

// addSat returns a+b for byte counts a, b >= 0, or math.MaxInt64 where
// the sum passes it.
func addSat(a, b int64) int64 {
	if s := a + b; s >= a {
		return s
	}
	return math.MaxInt64
}

// Fits reports whether a node claiming claim bytes beside peers (every
// other live node's summary) stays within the bound's capacity.
func (b Bound) Fits(claim int64, peers []*Summary) bool {
	return addSat(claim, Claims(peers)) <= b.Capacity
}

// Plan is what a node does about the cluster's usage now.
type Plan struct {
	// Total is the cluster's bytes as the node sees them: its own now and
	// every peer's last summary.
	Total int64
	// Cut is the rank below which the node evicts its files (0: none):
	// the cut-off it computed, or a peer's recent one, whichever is higher.
	Cut uint64
	// Computed says the node computed Cut itself (the cluster is over the
	// high watermark): it publishes it with its next summary.
	Computed bool
}

// Watch is a reading node's record, on its own clock, of when it saw each
// peer's summary change (a new Seq): how long a summary has stood as it
// is, which the summary itself cannot say (its Time is on the peer's
// clock, and a peer whose publications stalled says nothing). The zero
// Watch is empty and ready; a Watch is not safe for concurrent use.
type Watch struct {
	seen map[string]watched
}

// watched is what a Watch knows of one peer's summary.
type watched struct {
	seq     uint64
	changed int64 // this node's clock when it read seq first after another; 0: only this seq read
}

// See records the summaries of a read of the directory at now (Unix
// nanoseconds, this node's clock) and forgets the nodes not among them.
func (w *Watch) See(sums []*Summary, now int64) {
	next := make(map[string]watched, len(sums))
	for _, s := range sums {
		v, ok := w.seen[s.Node]
		switch {
		case !ok:
			v = watched{seq: s.Seq}
		case v.seq != s.Seq:
			v = watched{seq: s.Seq, changed: now}
		}
		next[s.Node] = v
	}
	w.seen = next
}

// Cuts returns peers with the cut-off of each that may be older than
// window at now cleared (a copy: peers are not changed), judged without
// comparing clocks: the cut's age when its summary was written (the
// summary's time minus the cut's, both on the peer's clock) plus how long
// this node has seen that summary stand (on its own clock, from the read
// that first found it changed). A cut of a summary this node has not yet
// seen change is not in force: how long it has stood is unknown (a peer
// whose publications stalled keeps its last summary, cut and all). So a
// stalled peer's cut goes within window of this node's seeing its last
// change, and a node's first read follows no peer's cut (it computes its
// own above the high watermark; Decide).
func (w *Watch) Cuts(peers []*Summary, now, window int64) []*Summary {
	out := make([]*Summary, len(peers))
	for i, s := range peers {
		out[i] = s
		if s.Cut == 0 {
			continue
		}
		v, ok := w.seen[s.Node]
		if ok && v.seq == s.Seq && v.changed != 0 {
			if age := s.Time - s.CutTime; age >= 0 && age <= window && now-v.changed <= window-age {
				continue
			}
		}
		g := *s
		g.Cut, g.CutTime = 0, 0
		out[i] = &g
	}
	return out
}

// Decide plans a node's eviction at now (Unix nanoseconds): its own bytes
// and sketch (fresh), the summaries of every other live node (peers), and
// window, how long a peer's cut-off stays in force (its interval or two:
// every node applies it at its next summary), measured on the peer's
// clock, from the cut's time to its summary's; a caller drops beforehand
// the cuts of summaries that may have stood longer than that since
// (Watch.Cuts). If the cluster is above the
// high watermark, the cut-off is the rank below which every node's files
// together cover the excess down to the low watermark (Cutoff); each node
// evicts its own files below it, so the cluster loses its lowest-ranked
// bytes whoever holds them.
func (b Bound) Decide(now int64, own Sketch, ownBytes int64, peers []*Summary, window int64) Plan {
	p := Plan{Total: ownBytes}
	sketches := make([]Sketch, 0, len(peers)+1)
	sketches = append(sketches, own)
	for _, s := range peers {
		p.Total = addSat(p.Total, s.Bytes)
		sketches = append(sketches, s.Sketch)
		// The cut's age on the peer's own clock: a clock skewed from
		// this node's neither keeps a cut in force nor drops it early.
		if age := s.Time - s.CutTime; s.Cut > 0 && age >= 0 && age <= window {
			p.Cut = max(p.Cut, s.Cut)
		}
	}
	if p.Total > b.High {
		// Bytes a peer holds beyond its sketch (stores in flight) are not
		// ranked: the excess counts them but only sketched bytes can go.
		cut, _ := Cutoff(sketches, p.Total-b.Low)
		if cut > p.Cut {
			p.Cut, p.Computed = cut, true
		}
	}
	return p
}

// Share is a live node's fair share of the bound: an equal part, among
// nodes live nodes, of what the rest of the cluster (rest: bytes no live
// node may evict or give back, the unclaimed dead nodes' and the untagged
// files') leaves of the capacity. A node below its share always gets room
// for a store: the others evict down to theirs to make it
// (docs/cluster.md, "Fair shares").
func (b Bound) Share(nodes int, rest int64) int64 {
	return max(b.Capacity-rest, 0) / int64(max(nodes, 1))
}
