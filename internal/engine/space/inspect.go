//go:build invariants

package space

// View is what a mount's room holds at one moment, beyond Usage, for the
// engine's tests (Inspect).
type View struct {
	// Spares is how many spares of each size the mount keeps.
	Spares map[int64]int
	// MadeBytes is the bytes of the spares made ahead among them.
	MadeBytes int64
	// Orphaned is the part of used that orphans hold.
	Orphaned int64
	// AheadSizes is the size each namespace's files have on the mount
	// for the spares made ahead, as its declaration and stores say (0:
	// not known), by namespace.
	AheadSizes map[uint32]int64
}

// Inspect returns what ms holds now, in one hold of the lock.
func (s *Space) Inspect(ms *Mount) View {
	s.mu.Lock()
	defer s.mu.Unlock()
	v := View{Spares: map[int64]int{}, MadeBytes: ms.madeBytes, Orphaned: ms.orphaned, AheadSizes: map[uint32]int64{}}
	for size, list := range ms.spares {
		v.Spares[size] = len(list)
	}
	for ns, a := range ms.aheadNS {
		v.AheadSizes[ns] = a.size
	}
	return v
}
