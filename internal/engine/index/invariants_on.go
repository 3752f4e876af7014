//go:build invariants

package index

import (
	"fmt"
	"slices"
)

// InvariantsOn: the index checks its invariants (Check, CheckAtRest).
// They are built with -tags invariants, as the race test run builds them,
// and are not in the shipped binary; without the tag they find nothing
// (invariants_off.go).
const InvariantsOn = true

// Check returns an error naming the first invariant of the index (see
// Index) that does not hold. Tests call it.
func (ix *Index) Check() error {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	for id, en := range ix.files.entries {
		switch {
		case en.ID != id || id > ix.files.lastID:
			return fmt.Errorf("index: entry %d under id %d (last %d)", en.ID, id, ix.files.lastID)
		case en.gone:
			return fmt.Errorf("index: entry %d (%s) is indexed and gone", id, en.Path)
		case ix.files.byPath[en.Path] != en:
			return fmt.Errorf("index: entry %d: its path %s maps to another entry", id, en.Path)
		}
	}
	for path, en := range ix.files.byPath {
		if ix.files.entries[en.ID] != en || en.Path != path {
			return fmt.Errorf("index: path %s maps to entry %d (%s), not indexed there", path, en.ID, en.Path)
		}
	}
	for k, ref := range ix.files.byKey {
		en := ref.e
		if ix.files.entries[en.ID] != en || en.FP != k.FP || ref.idx >= len(en.Keys) || en.Keys[ref.idx] != k.Key {
			return fmt.Errorf("index: key %q maps to entry %d (%s), which does not hold it or is not indexed", k.Key, en.ID, en.Path)
		}
	}
	for path, fl := range ix.flights.inflight {
		for _, en := range fl.orphans {
			if !en.gone || !en.orphan || en.Path != path {
				return fmt.Errorf("index: orphan %s of held path %s: gone %v, orphan %v", en.Path, path, en.gone, en.orphan)
			}
		}
	}
	if n := ix.leaving.nleft.Load(); n != int64(len(ix.leaving.left)) {
		return fmt.Errorf("index: %d files left on disk, counted %d", len(ix.leaving.left), n)
	}
	for at, en := range ix.leaving.left {
		if ix.files.entries[en.ID] == en || en.orphan {
			return fmt.Errorf("index: file %s left on disk: its entry %d is indexed (%v) or an orphan (%v)", at, en.ID, ix.files.entries[en.ID] == en, en.orphan)
		}
	}
	for en := range ix.leaving.removing {
		if !en.gone || ix.files.entries[en.ID] == en || ix.leaving.left[en.Path] == en {
			return fmt.Errorf("index: file %s being removed: its entry %d is not gone (%v), indexed (%v) or left (%v)", en.Path, en.ID, !en.gone, ix.files.entries[en.ID] == en, ix.leaving.left[en.Path] == en)
		}
	}
	for k, ens := range ix.pins.pinnedGone {
		if len(ens) == 0 {
			return fmt.Errorf("index: key %q kept for pinned files lists none", k.Key)
		}
		for i, en := range ens {
			if open := en.File.Load() != nil; !en.gone || !open || en.leases <= 0 || !slices.Contains(en.Keys, k.Key) || slices.Index(ens, en) != i {
				return fmt.Errorf("index: key %q of pinned file %s: gone %v, open %v, client pins %d, holds the key %v, listed at %d and %d", k.Key, en.Path, en.gone, open, en.leases, slices.Contains(en.Keys, k.Key), slices.Index(ens, en), i)
			}
		}
	}
	listed := map[*Entry]int{} // held entries by mount, as heldOrder lists them
	for m, ens := range ix.pins.heldOrder {
		for _, en := range ens {
			if en.held {
				listed[en] = m
			}
		}
	}
	held := 0
	for _, en := range ix.files.entries {
		if en.held {
			held++
			if m, ok := listed[en]; !ok || m != en.Mount {
				return fmt.Errorf("index: entry %d (%s): held by the restart hold, missing from mount %d's held entries", en.ID, en.Path, en.Mount)
			}
		}
		if en.held && en.pins <= en.leases {
			return fmt.Errorf("index: entry %d (%s): held by the restart hold with pins %d, leases %d", en.ID, en.Path, en.pins, en.leases)
		}
		if en.leases < 0 || en.pins < en.leases {
			return fmt.Errorf("index: entry %d (%s): pins %d, leases %d", en.ID, en.Path, en.pins, en.leases)
		}
	}
	if held != ix.pins.heldN {
		return fmt.Errorf("index: %d entries held by the restart hold, %d in the hold's count", held, ix.pins.heldN)
	}
	return ix.checkCounts()
}

// checkCounts checks byFP against the entries and keys indexed.
func (ix *Index) checkCounts() error {
	want := map[uint64]FPCount{}
	for _, en := range ix.files.entries {
		c := want[en.FP]
		c.Files++
		c.Bytes += en.Size
		want[en.FP] = c
	}
	for k := range ix.files.byKey {
		c := want[k.FP]
		c.Keys++
		want[k.FP] = c
	}
	if len(want) != len(ix.counts.byFP) {
		return fmt.Errorf("index: %d namespace fingerprints indexed, %d counted", len(want), len(ix.counts.byFP))
	}
	for fp, w := range want {
		if c := ix.counts.byFP[fp]; c == nil || *c != w {
			return fmt.Errorf("index: fingerprint %#x: %+v indexed, counted %+v", fp, w, c)
		}
	}
	return nil
}

// CheckAtRest returns an error where, with no path held by a job (no
// store, move or removal in flight), a file is counted as being removed,
// or where usage, given each of mounts mounts' bytes and number of its
// indexed files and those left on disk (used, the sum of their sizes;
// entries, the number of the indexed ones), says the space part counts
// otherwise. usage is called with the index's lock held (lock order:
// index > space). Tests call it (Engine.check).
func (ix *Index) CheckAtRest(mounts int, usage func(used []int64, entries []int) error) error {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	if len(ix.flights.inflight) > 0 {
		return nil
	}
	// Every removal holds its path (or is an orphan left to a held one).
	if n := len(ix.leaving.removing); n > 0 {
		return fmt.Errorf("index at rest: %d files counted as being removed", n)
	}
	used := make([]int64, mounts)
	n := make([]int, mounts)
	for _, en := range ix.files.entries {
		used[en.Mount] += en.Size
		n[en.Mount]++
	}
	for _, en := range ix.leaving.left {
		used[en.Mount] += en.Size
	}
	return usage(used, n)
}
