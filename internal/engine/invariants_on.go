//go:build invariants

package engine

import (
	"fmt"
	"slices"
)

// invariantsOn: the parts check their invariants (index.check,
// space.check, index.checkAtRest; Engine.check calls them). They are
// built with -tags invariants, as the race test run builds them, and are
// not in the shipped binary; without the tag they find nothing
// (invariants_off.go).
const invariantsOn = true

// check returns an error naming the first invariant of the index (see
// index) that does not hold. Tests call it.
func (ix *index) check() error {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	for id, en := range ix.entries {
		switch {
		case en.id != id || id > ix.lastID:
			return fmt.Errorf("index: entry %d under id %d (last %d)", en.id, id, ix.lastID)
		case en.gone:
			return fmt.Errorf("index: entry %d (%s) is indexed and gone", id, en.path)
		case ix.byPath[en.path] != en:
			return fmt.Errorf("index: entry %d: its path %s maps to another entry", id, en.path)
		}
	}
	for path, en := range ix.byPath {
		if ix.entries[en.id] != en || en.path != path {
			return fmt.Errorf("index: path %s maps to entry %d (%s), not indexed there", path, en.id, en.path)
		}
	}
	for k, ref := range ix.byKey {
		en := ref.e
		if ix.entries[en.id] != en || en.fp != k.fp || ref.idx >= len(en.keys) || en.keys[ref.idx] != k.key {
			return fmt.Errorf("index: key %q maps to entry %d (%s), which does not hold it or is not indexed", k.key, en.id, en.path)
		}
	}
	for path, fl := range ix.inflight {
		for _, en := range fl.orphans {
			if !en.gone || !en.orphan || en.path != path {
				return fmt.Errorf("index: orphan %s of held path %s: gone %v, orphan %v", en.path, path, en.gone, en.orphan)
			}
		}
	}
	if n := ix.nleft.Load(); n != int64(len(ix.left)) {
		return fmt.Errorf("index: %d files left on disk, counted %d", len(ix.left), n)
	}
	for at, en := range ix.left {
		if ix.entries[en.id] == en || en.orphan {
			return fmt.Errorf("index: file %s left on disk: its entry %d is indexed (%v) or an orphan (%v)", at, en.id, ix.entries[en.id] == en, en.orphan)
		}
	}
	for en := range ix.removing {
		if !en.gone || ix.entries[en.id] == en || ix.left[en.path] == en {
			return fmt.Errorf("index: file %s being removed: its entry %d is not gone (%v), indexed (%v) or left (%v)", en.path, en.id, !en.gone, ix.entries[en.id] == en, ix.left[en.path] == en)
		}
	}
	for k, ens := range ix.pinnedGone {
		if len(ens) == 0 {
			return fmt.Errorf("index: key %q kept for pinned files lists none", k.key)
		}
		for i, en := range ens {
			if open := en.file.Load() != nil; !en.gone || !open || en.leases <= 0 || !slices.Contains(en.keys, k.key) || slices.Index(ens, en) != i {
				return fmt.Errorf("index: key %q of pinned file %s: gone %v, open %v, client pins %d, holds the key %v, listed at %d and %d", k.key, en.path, en.gone, open, en.leases, slices.Contains(en.keys, k.key), slices.Index(ens, en), i)
			}
		}
	}
	listed := map[*entry]int{} // held entries by mount, as heldOrder lists them
	for m, ens := range ix.heldOrder {
		for _, en := range ens {
			if en.held {
				listed[en] = m
			}
		}
	}
	held := 0
	for _, en := range ix.entries {
		if en.held {
			held++
			if m, ok := listed[en]; !ok || m != en.mount {
				return fmt.Errorf("index: entry %d (%s): held by the restart hold, missing from mount %d's held entries", en.id, en.path, en.mount)
			}
		}
		if en.held && en.pins <= en.leases {
			return fmt.Errorf("index: entry %d (%s): held by the restart hold with pins %d, leases %d", en.id, en.path, en.pins, en.leases)
		}
		if en.leases < 0 || en.pins < en.leases {
			return fmt.Errorf("index: entry %d (%s): pins %d, leases %d", en.id, en.path, en.pins, en.leases)
		}
	}
	if held != ix.heldN {
		return fmt.Errorf("index: %d entries held by the restart hold, %d in the hold's count", held, ix.heldN)
	}
	return ix.checkCounts()
}

// checkCounts checks byFP against the entries and keys indexed.
func (ix *index) checkCounts() error {
	want := map[uint64]fpCount{}
	for _, en := range ix.entries {
		c := want[en.fp]
		c.files++
		c.bytes += en.size
		want[en.fp] = c
	}
	for k := range ix.byKey {
		c := want[k.fp]
		c.keys++
		want[k.fp] = c
	}
	if len(want) != len(ix.byFP) {
		return fmt.Errorf("index: %d namespace fingerprints indexed, %d counted", len(want), len(ix.byFP))
	}
	for fp, w := range want {
		if c := ix.byFP[fp]; c == nil || *c != w {
			return fmt.Errorf("index: fingerprint %#x: %+v indexed, counted %+v", fp, w, c)
		}
	}
	return nil
}

// checkAtRest returns an error where, with no path held by a job (no
// store, move or removal in flight), a mount's room does not hold exactly
// its indexed files and those left on disk: used the sum of their sizes,
// entries the number of the indexed ones.
// Tests call it (Engine.check).
func (ix *index) checkAtRest() error {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	if len(ix.inflight) > 0 {
		return nil
	}
	// Every removal holds its path (or is an orphan left to a held one).
	if n := len(ix.removing); n > 0 {
		return fmt.Errorf("index at rest: %d files counted as being removed", n)
	}
	used := make([]int64, len(ix.sp.mounts))
	n := make([]int, len(ix.sp.mounts))
	for _, en := range ix.entries {
		used[en.mount] += en.size
		n[en.mount]++
	}
	for _, en := range ix.left {
		used[en.mount] += en.size
	}
	ix.sp.mu.Lock()
	defer ix.sp.mu.Unlock()
	for i, ms := range ix.sp.mounts {
		if ms.used != used[i] || ms.entries != n[i] || ms.orphaned != 0 {
			return fmt.Errorf("index at rest: mount %s: used %d, entries %d, orphaned %d; its files: %d bytes, %d entries", ms.root, ms.used, ms.entries, ms.orphaned, used[i], n[i])
		}
	}
	return nil
}

// check returns an error naming the first invariant of the space (see
// space) that does not hold. Tests call it.
func (s *space) check() error {
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
				if sf.id.Size != size {
					return fmt.Errorf("space: mount %s: spare %s of %d bytes listed under %d", ms.root, sf.path, sf.id.Size, size)
				}
				bytes += size
				if sf.zeroed {
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
