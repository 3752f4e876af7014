//go:build !invariants

package index

// InvariantsOn is false: built without -tags invariants, the index's
// checks find nothing (invariants_on.go has them).
const InvariantsOn = false

// Check finds nothing without the invariants tag.
func (ix *Index) Check() error { return nil }

// CheckAtRest finds nothing without the invariants tag.
func (ix *Index) CheckAtRest(int, func([]int64, []int) error) error { return nil }
