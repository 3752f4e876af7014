//go:build invariants

package index

// Block takes the index's write lock and returns the function that lets
// it go: a test stands for an operation that holds it. It is built only
// with -tags invariants (the race suite's build), so that no code of the
// shipped binary can hold the index's lock from outside the index.
func (ix *Index) Block() (release func()) {
	ix.mu.Lock()
	return ix.mu.Unlock
}
