//go:build invariants

package space

import "fmt"

// InvariantsOn: the space checks its invariants (Check, UsageAtRest).
// They are built with -tags invariants, as the race test run builds them,
// and are not in the shipped binary; without the tag they find nothing
// (invariants_off.go).
const InvariantsOn = true

// UsageAtRest returns an error where a mount's room does not hold exactly
// the indexed files and those left on disk, as the index counts them
// (index.Index.CheckAtRest): used bytes, entries, and no orphan.
func (s *Space) UsageAtRest(used []int64, n []int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, ms := range s.mounts {
		if ms.used != used[i] || ms.entries != n[i] || ms.orphaned != 0 {
			return fmt.Errorf("index at rest: mount %s: used %d, entries %d, orphaned %d; its files: %d bytes, %d entries", ms.root, ms.used, ms.entries, ms.orphaned, used[i], n[i])
		}
	}
	return nil
}

// Check returns an error naming the first invariant of the space (see
// Space) that does not hold. Tests call it.
func (s *Space) Check() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, ms := range s.mounts {
		if ms.used < 0 || ms.orphaned < 0 || ms.orphaned > ms.used || ms.entries < 0 {
			return fmt.Errorf("space: mount %s: used %d, orphaned %d, entries %d", ms.root, ms.used, ms.orphaned, ms.entries)
		}
		if ms.low < 0 || ms.low > ms.high || ms.high > ms.capacity {
			return fmt.Errorf("space: mount %s: low %d, high %d, capacity %d", ms.root, ms.low, ms.high, ms.capacity)
		}
		var bytes, made int64
		for size, list := range ms.spares {
			if len(list) == 0 {
				return fmt.Errorf("space: mount %s: an empty list of spares of %d bytes", ms.root, size)
			}
			for _, sf := range list {
				if sf.ID.Size != size {
					return fmt.Errorf("space: mount %s: spare %s of %d bytes listed under %d", ms.root, sf.Path, sf.ID.Size, size)
				}
				bytes += size
				if sf.Zeroed {
					made += size
				}
			}
		}
		if bytes != ms.spareBytes || made != ms.madeBytes {
			return fmt.Errorf("space: mount %s: spares of %d bytes (%d made), counted %d (%d)", ms.root, bytes, made, ms.spareBytes, ms.madeBytes)
		}
	}
	return nil
}
