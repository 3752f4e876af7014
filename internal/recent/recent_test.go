package recent

import "testing"

// TestIDsHoldsTheLastAddedUpToItsBound: a set of 3 holds the last 3 ids
// added, forgets the oldest as more come, ignores an id added twice, and
// forgets a deleted one.
func TestIDsHoldsTheLastAddedUpToItsBound(t *testing.T) {
	s := NewIDs(3)
	for _, id := range []uint64{1, 2, 2, 3, 4} {
		s.Add(id)
	}
	for id, want := range map[uint64]bool{1: false, 2: true, 3: true, 4: true, 5: false} {
		if s.Has(id) != want {
			t.Errorf("Has(%d) = %v, want %v", id, !want, want)
		}
	}
	s.Delete(3)
	if s.Has(3) {
		t.Error("Has(3) after Delete(3)")
	}
	var zero IDs
	zero.Add(7)
	if zero.Has(7) {
		t.Error("the zero set took an id")
	}
}
