// Package recent keeps the ids most recently added to a set, up to a
// bound: what was removed lately, so that a message about it that comes
// late can be told from one about a live id without a set that grows with
// every removal of the process's life.
package recent

// IDs is a set of at most its bound of ids: adding one beyond forgets the
// one added longest ago. The zero value holds nothing and takes nothing;
// make one with NewIDs. It is not safe for concurrent use.
type IDs struct {
	max  int
	set  map[uint64]struct{}
	ring []uint64 // ids in the order added (a deleted one stays until its turn)
	next int      // the ring's oldest slot once it is full
}

// NewIDs returns an empty set of at most max ids.
func NewIDs(max int) IDs {
	return IDs{max: max, set: map[uint64]struct{}{}}
}

// Add adds id, forgetting the id added longest ago where the set is full.
// Adding an id the set holds changes nothing.
func (s *IDs) Add(id uint64) {
	if s.max <= 0 {
		return
	}
	if _, ok := s.set[id]; ok {
		return
	}
	if len(s.ring) < s.max {
		s.ring = append(s.ring, id)
	} else {
		delete(s.set, s.ring[s.next])
		s.ring[s.next] = id
		s.next = (s.next + 1) % s.max
	}
	s.set[id] = struct{}{}
}

// Has reports whether the set holds id.
func (s *IDs) Has(id uint64) bool {
	_, ok := s.set[id]
	return ok
}

// Delete removes id from the set.
func (s *IDs) Delete(id uint64) { delete(s.set, id) }
