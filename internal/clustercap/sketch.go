package clustercap

import (
	"cmp"
	"fmt"
	"slices"
	"sort"
)

// Item is one file as ranked for eviction: lower ranks are evicted first.
// Ranks are comparable across nodes (the policy's cluster rank, or the
// last access time in Unix nanoseconds).
type Item struct {
	Rank  uint64 // the file's rank
	Bytes int64  // the file's size in bytes
}

// SketchPoints is the number of points NewSketch keeps: the bytes of a
// node are known at every 1/SketchPoints of them, exactly below the first.
const SketchPoints = 128

// MaxSketchPoints bounds the points of a sketch a summary carries.
const MaxSketchPoints = 4 * SketchPoints

// Sketch is a node's cumulative bytes by rank, compact: Bytes[i] is the
// bytes of the node's files whose rank is at most Ranks[i]. Ranks are
// ascending, Bytes strictly ascending, and the last point holds every
// byte. Between points the bytes are interpolated linearly.
type Sketch struct {
	Ranks []uint64 `json:"ranks"` // ranks of the points, ascending
	Bytes []int64  `json:"bytes"` // bytes of files ranked at most Ranks[i], strictly ascending
}

// NewSketch returns the sketch of items (which it sorts by rank) with at
// most points points: the first and last item's ranks, and the ranks at
// which the cumulative bytes pass each 1/points of the total.
func NewSketch(items []Item, points int) Sketch {
	slices.SortFunc(items, func(a, b Item) int { return cmp.Compare(a.Rank, b.Rank) })
	var total int64
	for _, it := range items {
		total += max(it.Bytes, 0)
	}
	var s Sketch
	if total == 0 {
		return s
	}
	points = max(points, 2)
	var cum int64
	next := int64(0) // the next cumulative byte count that makes a point
	for i, it := range items {
		cum += max(it.Bytes, 0)
		last := i == len(items)-1
		if !last && items[i+1].Rank == it.Rank {
			continue // one point per rank
		}
		if cum < next && !last {
			continue
		}
		if n := len(s.Ranks); n > 0 && s.Bytes[n-1] == cum {
			continue
		}
		s.Ranks = append(s.Ranks, it.Rank)
		s.Bytes = append(s.Bytes, cum)
		next = cum + total/int64(points)
	}
	return s
}

// Total is every byte of the sketch.
func (s Sketch) Total() int64 {
	if len(s.Bytes) == 0 {
		return 0
	}
	return s.Bytes[len(s.Bytes)-1]
}

// Below estimates the bytes of files with a rank below r: exact at a
// point's rank, interpolated between two points.
func (s Sketch) Below(r uint64) int64 {
	i := sort.Search(len(s.Ranks), func(i int) bool { return s.Ranks[i] >= r })
	switch {
	case i == 0:
		return 0 // every file ranks at or above r
	case i == len(s.Ranks):
		return s.Total()
	}
	// Files of ranks in (Ranks[i-1], Ranks[i]] hold Bytes[i]-Bytes[i-1];
	// those of rank Ranks[i] are at or above r.
	lo, hi := s.Ranks[i-1], s.Ranks[i]
	span := float64(hi - lo)
	frac := float64(r-lo-1) / span
	return s.Bytes[i-1] + int64(frac*float64(s.Bytes[i]-s.Bytes[i-1]))
}

// Validate checks the sketch's shape.
func (s Sketch) Validate() error {
	if len(s.Ranks) != len(s.Bytes) {
		return fmt.Errorf("sketch: %d ranks but %d byte counts", len(s.Ranks), len(s.Bytes))
	}
	if len(s.Ranks) > MaxSketchPoints {
		return fmt.Errorf("sketch: %d points, want at most %d", len(s.Ranks), MaxSketchPoints)
	}
	if s.Total() > MaxBytes {
		return fmt.Errorf("sketch: %d bytes, want at most %d", s.Total(), int64(MaxBytes))
	}
	for i := range s.Ranks {
		if s.Bytes[i] <= 0 {
			return fmt.Errorf("sketch: point %d: %d bytes, want > 0", i, s.Bytes[i])
		}
		if i > 0 && (s.Ranks[i] <= s.Ranks[i-1] || s.Bytes[i] <= s.Bytes[i-1]) {
			return fmt.Errorf("sketch: point %d (rank %d, %d bytes) does not follow point %d (rank %d, %d bytes)",
				i, s.Ranks[i], s.Bytes[i], i-1, s.Ranks[i-1], s.Bytes[i-1])
		}
	}
	return nil
}

// Cutoff returns the smallest rank r at which the files ranked below r in
// every sketch hold at least excess bytes, and false when all of them
// together hold less (then every file is below the returned rank, the
// largest rank plus one).
func Cutoff(sketches []Sketch, excess int64) (uint64, bool) {
	if excess <= 0 {
		return 0, true
	}
	below := func(r uint64) int64 {
		var n int64
		for _, s := range sketches {
			n = addSat(n, s.Below(r))
		}
		return n
	}
	var top uint64
	for _, s := range sketches {
		if n := len(s.Ranks); n > 0 {
			top = max(top, s.Ranks[n-1])
		}
	}
	if top == ^uint64(0) || below(top+1) < excess {
		return top + 1, false
	}
	// below is non-decreasing in r: the smallest r with below(r) >= excess.
	lo, hi := uint64(0), top+1 // below(lo) < excess <= below(hi)
	for hi-lo > 1 {
		mid := lo + (hi-lo)/2
		if below(mid) >= excess {
			hi = mid
		} else {
			lo = mid
		}
	}
	return hi, true
}
