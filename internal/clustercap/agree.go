package clustercap

import "fmt"

// Agree is the bound every node of a mount applies: the smallest
// cluster_capacity configured among this node (own, named node) and the
// live peers that state theirs (Summary.Capacity; a node before
// SummaryVersion 2 states none and takes no part). So no node pushes the
// mount past what any running node's operator configured, whatever order
// a rollout changes the configurations in, and every node bounds the
// mount alike: nodes storing at equal rates get comparable shares. Ties
// go to the smallest node name, so every node names the same source. It
// returns the bound and the node whose capacity it is.
func Agree(own int64, node string, peers []*Summary) (int64, string) {
	bound, from := own, node
	for _, p := range peers {
		if p.Capacity <= 0 {
			continue
		}
		if p.Capacity < bound || p.Capacity == bound && p.Node < from {
			bound, from = p.Capacity, p.Node
		}
	}
	return bound, from
}

// WithCapacity returns b for a capacity of c bytes, its watermarks at the
// same fractions of it.
func (b Bound) WithCapacity(c int64) Bound {
	if c == b.Capacity || b.Capacity <= 0 {
		return b
	}
	f := float64(c) / float64(b.Capacity)
	return Bound{Capacity: c, High: int64(float64(b.High) * f), Low: int64(float64(b.Low) * f)}
}

// Untenable says why a peer's summary s states a claim that cannot hold
// under a bound of capacity bytes, or "" where it can: a claim beyond the
// bound (no node may hold more than the whole bound; a claim of 2^62
// bytes would have every node evict all its files).
func Untenable(s *Summary, capacity int64) string {
	if s.Claim > capacity {
		return fmt.Sprintf("claims %d bytes, more than the cluster's bound of %d", s.Claim, capacity)
	}
	return ""
}

// AtLeast returns s, or where it states fewer bytes than files (what this
// node found of the node's files on the mount, by owner tag) a copy
// stating files, its claim raised to match: a summary never counts less
// than the files seen (a summary forged under a node's name claiming 0).
func AtLeast(s *Summary, files int64) *Summary {
	if s.Bytes >= files {
		return s
	}
	g := *s
	g.Bytes = files
	g.Claim = max(g.Claim, files)
	return &g
}

// OddRanks reports whether sketch's ranks are not on the scale every node
// ranks by (Unix nanoseconds of a use, or a rank derived from it), at now
// (Unix nanoseconds): its highest rank is below now/1000, a rank in
// seconds or milliseconds, or a constant. Nodes ranking by another scale
// evict by cut-offs that do not compare with the others'.
func OddRanks(sketch Sketch, now int64) bool {
	n := len(sketch.Ranks)
	return n > 0 && now > 0 && sketch.Ranks[n-1] < uint64(now/1000)
}
