//go:build invariants

package index

import (
	"maps"
	"slices"
)

// Whole operations that read the index, or change it as a fault would,
// for the engine's tests: each takes the index's lock once.

// ByPath returns the entry indexed at path, or nil.
func (f *Files) ByPath(path string) *Entry {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.byPath[path]
}

// Entries returns the indexed entries.
func (f *Files) Entries() []*Entry {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return slices.Collect(maps.Values(f.entries))
}

// LeftOnDisk returns the entries dropped whose file could not be removed.
func (l *Leaving) LeftOnDisk() []*Entry {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return slices.Collect(maps.Values(l.left))
}

// Keys returns the keys indexed.
func (f *Files) Keys() []KeyID {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return slices.Collect(maps.Keys(f.byKey))
}

// Inspect calls fn with the index's lock held, where fn may read the
// marks of en (Marks): as one step, not torn by an operation.
func (ix *Index) Inspect(fn func()) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	fn()
}

// Marks are an entry's mutable marks, as Entry.Marks reads them.
type Marks struct {
	Gone, Held, Orphan bool
	Last               int64
}

// Marks reads en's marks. Call it in a function the index calls (its lock
// held: Each, Inspect).
func (en *Entry) Marks() Marks {
	return Marks{Gone: en.gone, Held: en.held, Orphan: en.orphan, Last: en.Last}
}

// Forget drops en from the index, its file left on disk unknown, as when
// another file took its keys.
func (ix *Index) Forget(en *Entry) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.unindexLocked(en, false)
}

// ForgetAndClaim is Forget of the entry at path and a claim of the path
// (a store's) in one step, and reports whether the path was free.
func (ix *Index) ForgetAndClaim(path string) bool {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.unindexLocked(ix.files.byPath[path], false)
	claimed, _ := ix.flights.claimLocked(path)
	return claimed
}

// ForgetKey drops key of fingerprint fp from the index, its file still
// indexed, as when a newer file took the key.
func (f *Files) ForgetKey(fp uint64, key []byte) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.byKey, KeyID{fp, string(key)})
	f.counts.byFP[fp].Keys-- // as unindexLocked counts a key it deletes
}

// AddUnlinked indexes ens by id only (not by path or key), counted as
// files of fingerprint fp, as a benchmark of a scan of many entries does,
// and returns the function that removes them again.
func (f *Files) AddUnlinked(fp uint64, ens func(id uint64) *Entry, n int) (remove func()) {
	f.mu.Lock()
	defer f.mu.Unlock()
	base := f.lastID + 1
	for i := range uint64(n) {
		en := ens(base + i)
		en.ID = base + i
		f.entries[base+i] = en
	}
	f.counts.countOf(fp).Files += n
	return func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		for i := range uint64(n) {
			delete(f.entries, base+i)
		}
		c := f.counts.countOf(fp)
		c.Files -= n
		f.counts.dropEmptyLocked(fp, c)
	}
}
