package index

import (
	"sync"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
)

// Files is the index's keyed store: the published files (entries) by
// id, by path and by key, which it counts by namespace fingerprint
// (Counts) and mirrors to a KeySet (Mirror). Its operations here read
// it, or change only it; those that change it with the other parts are
// Index's. It shares the index's lock.
type Files struct {
	mu      *sync.RWMutex // the Index's
	counts  *Counts
	entries map[uint64]*Entry
	byKey   map[KeyID]keyRef
	byPath  map[string]*Entry
	lastID  uint64
	keys    KeySet // Mirror's, or nil
}

// getLocked is the entry holding key of fingerprint fp, or nil.
func (f *Files) getLocked(fp uint64, key []byte) *Entry {
	if ref, ok := f.byKey[KeyID{fp, string(key)}]; ok {
		return ref.e
	}
	return nil
}

// addLocked gives en the next id and indexes it by id, path and key; a
// key another file holds is taken from it.
func (f *Files) addLocked(en *Entry) {
	f.lastID++
	en.ID = f.lastID
	f.entries[en.ID] = en
	f.byPath[en.Path] = en
	c := f.counts.countOf(en.FP)
	c.Files++
	c.Bytes += en.Size
	for i, k := range en.Keys {
		_, had := f.byKey[KeyID{en.FP, k}]
		f.byKey[KeyID{en.FP, k}] = keyRef{e: en, idx: i}
		if had { // a key taken from another file stays
			continue
		}
		c.Keys++
		if f.keys != nil {
			f.keys.Add(en.FP, k)
		}
	}
}

// removeLocked takes en out of the maps by id, path and key (those of
// its keys that still map to it) and out of its counts.
func (f *Files) removeLocked(en *Entry) {
	delete(f.entries, en.ID)
	if f.byPath[en.Path] == en {
		delete(f.byPath, en.Path)
	}
	c := f.counts.countOf(en.FP)
	c.Files--
	c.Bytes -= en.Size
	defer f.counts.dropEmptyLocked(en.FP, c)
	for _, k := range en.Keys {
		if ref, ok := f.byKey[KeyID{en.FP, k}]; ok && ref.e == en {
			delete(f.byKey, KeyID{en.FP, k})
			c.Keys--
			if f.keys != nil {
				f.keys.Remove(en.FP, k)
			}
		}
	}
}

// relinkLocked indexes en again for those of its keys that the index does
// not find (the key's entry pointed at another file, since dropped). It
// reports false if en is no longer indexed.
func (f *Files) relinkLocked(en *Entry) bool {
	if en.gone {
		return false
	}
	for i, k := range en.Keys {
		if _, ok := f.byKey[KeyID{en.FP, k}]; !ok {
			f.byKey[KeyID{en.FP, k}] = keyRef{e: en, idx: i}
			f.counts.countOf(en.FP).Keys++
			if f.keys != nil {
				f.keys.Add(en.FP, k)
			}
		}
	}
	return true
}

// Relink is relinkLocked taking the lock.
func (f *Files) Relink(en *Entry) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.relinkLocked(en)
}

// currentLocked returns the entry that holds key now if en, found for
// it, was moved meanwhile (unindexed, and the key's entry is a copy of the
// same file: the same header id, or the file at the target that the move
// dropped en for: its heir); otherwise en. The caller holds the lock.
func (f *Files) currentLocked(en *Entry, key []byte) *Entry {
	if !en.gone || en.FID == 0 && en.heir == nil {
		return en
	}
	if cur := f.getLocked(en.FP, key); cur != nil && !cur.gone && (en.FID != 0 && cur.FID == en.FID || cur == en.heir) {
		return cur
	}
	return en
}

// Current is currentLocked taking the lock.
func (f *Files) Current(en *Entry, key []byte) *Entry {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.currentLocked(en, key)
}

// handOverLocked points every key that the index finds in from at to, a
// file of the same keys (the same fingerprint, at the same positions), and
// makes to from's heir: unindexing from then leaves its keys indexed, and
// in the key set (MirrorKeys), whose misses a client may take for final.
func (f *Files) handOverLocked(from, to *Entry) {
	for i, k := range from.Keys {
		id := KeyID{from.FP, k}
		if ref, ok := f.byKey[id]; ok && ref.e == from {
			f.byKey[id] = keyRef{e: to, idx: i}
		}
	}
	from.heir = to
}

// Get is getLocked taking the lock.
func (f *Files) Get(fp uint64, key []byte) *Entry {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.getLocked(fp, key)
}

// GetAll is getLocked for the keys of the request indices idx (all keys
// where idx is nil), under one hold of the lock: the entry of the i-th
// is the i-th (nil: none).
func (f *Files) GetAll(fp uint64, keys [][]byte, idx []int) []*Entry {
	n := len(keys)
	if idx != nil {
		n = len(idx)
	}
	found := make([]*Entry, n)
	f.mu.RLock()
	defer f.mu.RUnlock()
	for t := range found {
		i := t
		if idx != nil {
			i = idx[t]
		}
		found[t] = f.getLocked(fp, keys[i])
	}
	return found
}

// Gone reports whether en is no longer indexed.
func (f *Files) Gone(en *Entry) bool {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return en.gone
}

// Each calls fn for every indexed entry, under the index's lock held for
// reading: fn reads the entry's fields and calls nothing of the engine
// (the policy's view, a rebuild's or a reload's walk).
func (f *Files) Each(fn func(*Entry)) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	for _, en := range f.entries {
		fn(en)
	}
}

// Matching returns the indexed entries that want accepts; want reads
// the entry under the lock held for reading. Where fps is not nil, an
// index holding nothing of those fingerprints is not scanned.
func (f *Files) Matching(fps map[uint64]int64, want func(*Entry) bool) []*Entry {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if fps != nil && !f.counts.holdsAnyLocked(fps) {
		return nil
	}
	var ens []*Entry
	for _, en := range f.entries {
		if want(en) {
			ens = append(ens, en)
		}
	}
	return ens
}

// Mirror makes ks the index's KeySet: it is told every key now and every
// change from then on (nil: none).
func (f *Files) Mirror(ks KeySet) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.keys = ks
	if ks == nil {
		return
	}
	for k := range f.byKey {
		ks.Add(k.FP, k.Key)
	}
}

// Size returns how many files and keys the index holds.
func (f *Files) Size() (files, keys int) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return len(f.entries), len(f.byKey)
}

// FileOf returns the path, namespace fingerprint and keys of entry id's
// file, and whether the index holds it.
func (f *Files) FileOf(id uint64) (path string, fp uint64, keys []string, ok bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	en, ok := f.entries[id]
	if !ok {
		return "", 0, nil, false
	}
	return en.Path, en.FP, en.Keys, true
}

// PolicyEntry returns the policy's view of entry id.
func (f *Files) PolicyEntry(id uint64) (policy.Entry, bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	en, ok := f.entries[id]
	if !ok {
		return policy.Entry{}, false
	}
	return en.policyEntry(), true
}

// PolicyEntries returns the policy's view of every entry, a snapshot.
func (f *Files) PolicyEntries() []policy.Entry {
	var snap []policy.Entry
	f.Each(func(en *Entry) { snap = append(snap, en.policyEntry()) })
	return snap
}

// Records returns an access record of kind for every entry, at its last
// access.
func (f *Files) Records(kind uint32) []abi.AccessRecord {
	var recs []abi.AccessRecord
	f.Each(func(en *Entry) { recs = append(recs, en.Access(kind, en.Last)) })
	return recs
}
