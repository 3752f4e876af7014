package index

import "sync"

// FPCount is what the index holds of one namespace fingerprint.
type FPCount struct {
	Files, Keys int
	Bytes       int64
}

// Counts is the index's part that counts the indexed files, keys and
// bytes of each namespace fingerprint (NamespaceStats, the budgets); a
// fingerprint with none is not kept. The keyed store (Files) keeps it
// with its entries; it shares the index's lock.
type Counts struct {
	mu   *sync.RWMutex // the Index's
	byFP map[uint64]*FPCount
}

// countOf returns fp's counts, made where it has none.
func (c *Counts) countOf(fp uint64) *FPCount {
	n := c.byFP[fp]
	if n == nil {
		n = &FPCount{}
		c.byFP[fp] = n
	}
	return n
}

// Holds reports whether the index holds a file or key of fingerprint fp.
func (c *Counts) Holds(fp uint64) bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.holdsLocked(fp)
}

// holdsLocked is Holds, called with the index's lock held.
func (c *Counts) holdsLocked(fp uint64) bool {
	n := c.byFP[fp]
	return n != nil && (n.Files > 0 || n.Keys > 0)
}

// holdsAnyLocked reports whether the index holds a file or key of a
// fingerprint of fps. Called with the index's lock held.
func (c *Counts) holdsAnyLocked(fps map[uint64]int64) bool {
	for fp := range fps {
		if c.holdsLocked(fp) {
			return true
		}
	}
	return false
}

// dropEmptyLocked forgets fp's counts n once it has nothing indexed.
func (c *Counts) dropEmptyLocked(fp uint64, n *FPCount) {
	if n.Files == 0 && n.Keys == 0 {
		delete(c.byFP, fp)
	}
}

// ByFingerprint returns the files, keys and bytes indexed of each
// namespace fingerprint that has any.
func (c *Counts) ByFingerprint() map[uint64]FPCount {
	c.mu.RLock()
	defer c.mu.RUnlock()
	out := make(map[uint64]FPCount, len(c.byFP))
	for fp, n := range c.byFP {
		out[fp] = *n
	}
	return out
}
