package index

import (
	"slices"
	"sync"

	"github.com/kvhost/kvhost/abi"
)

// Index is what the engine knows is stored, in five parts of its state,
// each its own type and file, all under the index's one lock:
//   - Files (files.go), the keyed store: the published files (entries)
//     by id, by path and by key, mirrored to a KeySet;
//   - Counts (counts.go): the files, keys and bytes of each namespace
//     fingerprint;
//   - Flights (flight.go): the paths that jobs of this engine hold (a
//     store writing there, a move, a removal) and discoveries' reads;
//   - Pins (pins.go, hold.go): the entries' counts (pins, client pins,
//     hits, last access), the files held open for client pins, and the
//     restart hold's pins;
//   - Leaving (leaving.go): the files on disk that left the index, left
//     there or being removed.
//
// A part's operations read or change that part (and the entries'
// marks); Index's own change several parts in one step. It keeps each
// mount's count of files and their bytes in the space (entries, used)
// with its entries, through Space. Besides the space it calls nothing of
// the engine: no I/O, no policy.
//
// Lock order: the engine's tables.mu > Index.mu > space.mu. Only the
// index's methods and its parts' take mu: each operation the engine
// calls is whole, one hold of the lock (unindex and claim a path in one
// step, so that a store never publishes between them; pin, count a hit,
// move a file's entry), and only they change an entry's counts (pins,
// leases, hits, last access, the hold's marks). A caller's condition on
// an entry is a function the method calls with mu held (evict's may,
// drop's mayRemove), which reads the entry and never calls back into the
// index. The invariants below are checked with -tags invariants
// (invariants_on.go), not in the shipped binary.
//
// Invariants (Check), with mu held:
//   - entries holds every indexed entry under its id (at most lastID);
//     none is gone, and byPath maps its path to it;
//   - byPath maps only to indexed entries;
//   - byKey maps each key to an indexed entry that holds it, at the
//     key's position in its file and of the key's fingerprint (an
//     indexed entry may have lost a key to a newer file: relinkLocked);
//   - 0 <= leases <= pins for every entry, leases < pins where the
//     restart hold holds it (held), heldN counts those entries, and
//     each is in its own mount's heldOrder;
//   - the orphans left to a path held are gone and marked orphan;
//   - left holds no indexed entry, nor an orphan, and nleft is its length;
//   - removing holds entries gone, neither indexed nor in left;
//   - pinnedGone maps each key to gone entries that hold it, each once,
//     held open (file) for its client pins (leases > 0);
//   - byFP counts the entries and keys indexed of each fingerprint.
type Index struct {
	mu      sync.RWMutex
	sp      Space
	files   Files
	counts  Counts
	flights Flights
	pins    Pins
	leaving Leaving
}

// NewIndex returns an empty index that tells sp of its files.
func NewIndex(sp Space) *Index {
	ix := &Index{sp: sp}
	ix.counts.mu, ix.counts.byFP = &ix.mu, map[uint64]*FPCount{}
	f := &ix.files
	f.mu, f.counts = &ix.mu, &ix.counts
	f.entries, f.byKey, f.byPath = map[uint64]*Entry{}, map[KeyID]keyRef{}, map[string]*Entry{}
	fs := &ix.flights
	fs.mu, fs.inflight, fs.reads = &ix.mu, map[string]*Flight{}, map[string][]*ReadMark{}
	p := &ix.pins
	p.mu, p.files, p.flights, p.heldOrder = &ix.mu, f, fs, map[int][]*Entry{}
	l := &ix.leaving
	l.mu, l.sp, l.flights = &ix.mu, sp, fs
	l.left, l.removing = map[string]*Entry{}, map[*Entry]struct{}{}
	return ix
}

// Files is the index's keyed store.
func (ix *Index) Files() *Files { return &ix.files }

// Counts is the index's counts by namespace fingerprint.
func (ix *Index) Counts() *Counts { return &ix.counts }

// Flights is the index's part that holds paths and reads.
func (ix *Index) Flights() *Flights { return &ix.flights }

// Pins is the index's part that keeps the entries' counts and holds.
func (ix *Index) Pins() *Pins { return &ix.pins }

// Leaving is the index's part that holds the files that left it.
func (ix *Index) Leaving() *Leaving { return &ix.leaving }

// insertLocked indexes en, replacing any entry at its path or holding its
// keys (returned, already unindexed; their files are gone). reserved: the
// file's bytes are a reservation already counted on its mount.
func (ix *Index) insertLocked(en *Entry, reserved bool) []*Entry {
	var replaced []*Entry
	if old := ix.files.byPath[en.Path]; old != nil {
		ix.unindexLocked(old, false)
		replaced = append(replaced, old)
	}
	ix.leaving.replacedLocked(en.Path) // this file took its place
	ix.files.addLocked(en)
	ix.sp.Indexed(en.Mount, en.Size, reserved)
	return replaced
}

// unindexLocked removes en from the index and reports whether it was
// indexed. Without remove, en's file is gone (replaced or vanished): its
// mount stops counting it. With remove, the file is still there, on its
// way out (dropLocked; a move's source): its bytes stay counted as used
// until it is removed, en is in removing until then, and the caller
// updates its mount's count of files (space.unindexed, space.moved).
func (ix *Index) unindexLocked(en *Entry, remove bool) bool {
	if en.gone {
		return false
	}
	en.gone = true
	if en.File.Load() != nil {
		ix.pins.keepPinnedLocked(en)
	}
	if en.held { // the restart hold lets it go now
		ix.pins.unholdLocked(en)
	}
	ix.files.removeLocked(en)
	if remove {
		ix.leaving.removingLocked(en)
	} else {
		ix.sp.Unindexed(en.Mount, en.Size, false, false)
	}
	return true
}

// dropLocked unindexes en and, with remove, arranges the removal of its
// file: if the path is free it claims it and claimed is true, and the
// caller removes the file (removeClaimed, evictClaimed) without the lock;
// if the path is held, the holder removes the file when it releases the
// path, unless the file was replaced. Either way the file counts as used
// on its mount until it is removed (but an orphan is on its way out:
// evictions leave it out of what they must free). was reports whether en
// was still indexed; nothing is done otherwise.
func (ix *Index) dropLocked(en *Entry, remove bool) (was, claimed bool) {
	if !ix.unindexLocked(en, remove) {
		return false, false
	}
	if !remove {
		return true, false
	}
	claimed, fl := ix.flights.claimLocked(en.Path)
	if !claimed {
		fl.orphans = append(fl.orphans, en)
		en.orphan = true
	}
	ix.sp.Unindexed(en.Mount, en.Size, true, en.orphan)
	return true, claimed
}

// releaseLocked ends the claim on path and returns its flight, whose done
// the caller closes once it has unlocked Index.mu; or, where orphans were
// left to the claim, keeps the claim and returns them (taken from the
// flight) for the caller to remove before it releases the path again.
// freed are entries whose files the holder has just removed (or found
// gone), which their mounts counted as used until then: they stop
// counting in the same step, and leave Leaving's removing.
func (ix *Index) releaseLocked(path string, freed []*Entry) (*Flight, []*Entry) {
	for _, en := range freed {
		ix.sp.Free(en.Mount, en.Size, en.orphan)
		ix.leaving.removedLocked(en)
	}
	return ix.flights.releaseLocked(path)
}

// Release is releaseLocked taking the lock.
func (ix *Index) Release(path string, freed []*Entry) (*Flight, []*Entry) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	return ix.releaseLocked(path, freed)
}

// ReleaseLeaving is release for a holder that has just tried to remove
// the file of one of ens: left (nil: none) is the one whose file is still
// there, at at (Leaving.leaveLocked); the others are freed.
func (ix *Index) ReleaseLeaving(path string, ens []*Entry, left *Entry, at string) (*Flight, []*Entry) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	freed := ens
	if left != nil {
		freed = slices.DeleteFunc(slices.Clone(ens), func(en *Entry) bool { return en == left })
		ix.leaving.leaveLocked(left, at)
	}
	return ix.releaseLocked(path, freed)
}

// ReleaseKept is release for the holder of the path of en, evicted,
// whose file it has just kept as a spare (evictClaimed): en's removal is
// over, its bytes counted as the spare's.
func (ix *Index) ReleaseKept(path string, en *Entry) (*Flight, []*Entry) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.leaving.removedLocked(en)
	return ix.releaseLocked(path, nil)
}

// InsertAll indexes the entries found at Open (rebuild), in order: where
// two files hold one key, the later wins it.
func (ix *Index) InsertAll(ens []*Entry) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	for _, en := range ens {
		ix.insertLocked(en, false)
	}
}

// Whole operations: each takes the lock once and leaves the index's
// invariants holding. Nothing outside the index takes its lock or edits
// an entry's counts (pins, leases, hits, last access, hold marks).

// Drop unindexes en and, with remove, arranges the removal of its file
// (dropLocked), in one hold of the lock; rec is the policy's REMOVE
// record of en at now.
func (ix *Index) Drop(en *Entry, remove bool, now int64) (was, claimed bool, rec abi.AccessRecord) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	was, claimed = ix.dropLocked(en, remove)
	return was, claimed, en.Access(abi.AccessRemove, now)
}

// DropResult is what DropUnpinned did: the entry it dropped (the file
// en moved to meanwhile, where it moved), whether a client pin kept it,
// how many keys the index found in it, and whether its file is to be
// removed (claimed: by the caller).
type DropResult struct {
	En              *Entry
	Pinned          bool
	Keys            int
	Remove, Claimed bool
	Rec             abi.AccessRecord
}

// DropUnpinned drops en, found for key (or the file it moved to since,
// Files.currentLocked), unless a client pin holds it or it is gone; the
// check and the unindexing are one step, so a pin that took hold is
// never dropped under it. Where mayRemove is not nil and says no (asked
// with the lock held), the entry leaves the index and its file stays.
func (ix *Index) DropUnpinned(en *Entry, key []byte, mayRemove func(*Entry) bool, now int64) DropResult {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	en = ix.files.currentLocked(en, key)
	if en.gone {
		return DropResult{}
	}
	if en.leases > 0 {
		return DropResult{En: en, Pinned: true}
	}
	keys := 0
	for _, k := range en.Keys {
		if ref, ok := ix.files.byKey[KeyID{en.FP, k}]; ok && ref.e == en {
			keys++
		}
	}
	remove := mayRemove == nil || mayRemove(en)
	was, claimed := ix.dropLocked(en, remove)
	if !was {
		return DropResult{}
	}
	return DropResult{En: en, Keys: keys, Remove: remove, Claimed: claimed, Rec: en.Access(abi.AccessRemove, now)}
}

// Evict drops en and claims its path for the removal of its file
// (dropLocked) where no pin holds it, it is indexed and may accepts it,
// all in one step: rec is the policy's REMOVE record at now. ok reports
// whether it was dropped; claimed, whether the caller removes the file
// (otherwise the path's holder does).
func (ix *Index) Evict(en *Entry, may func(*Entry) bool, now int64) (claimed bool, rec abi.AccessRecord, ok bool) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	return ix.evictLocked(en, may, now)
}

// EvictID is Evict for the entry of id, which it returns (nil: none).
func (ix *Index) EvictID(id uint64, may func(*Entry) bool, now int64) (en *Entry, claimed bool, rec abi.AccessRecord, ok bool) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if en = ix.files.entries[id]; en == nil {
		return nil, false, rec, false
	}
	claimed, rec, ok = ix.evictLocked(en, may, now)
	return en, claimed, rec, ok
}

func (ix *Index) evictLocked(en *Entry, may func(*Entry) bool, now int64) (claimed bool, rec abi.AccessRecord, ok bool) {
	if en.pins != 0 || en.gone || !may(en) {
		return false, rec, false
	}
	_, claimed = ix.dropLocked(en, true)
	return claimed, en.Access(abi.AccessRemove, now), true
}

// AdoptResult is what Adopt did with an entry found on disk.
type AdoptResult int

const (
	AdoptIndexed AdoptResult = iota // indexed (or the same file already was: relinked)
	AdoptHeld                       // a job holds the path, or the read went stale
	AdoptLeft                       // the file is one this engine dropped and left
)

// Adopt indexes en, an entry of a file found on disk, unless read (the
// read of the file; nil: none) went stale or a job holds its path
// (AdoptHeld), or the file is one this engine dropped and could not
// remove (AdoptLeft). Where the index holds the same file at the path,
// that entry is returned instead, its keys relinked. recs are the
// policy's records of the change (the entries replaced, en's INSERT).
func (ix *Index) Adopt(en *Entry, read *ReadMark) (got *Entry, res AdoptResult, recs []abi.AccessRecord) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if read != nil && read.stale || ix.flights.heldLocked(en.Path) {
		return nil, AdoptHeld, nil
	}
	same := func(old *Entry) bool { return old != nil && old.Ident.Same(en.Ident) && old.FID == en.FID }
	if old := ix.files.byPath[en.Path]; same(old) {
		ix.files.relinkLocked(old) // found by a key the index had lost
		return old, AdoptIndexed, nil
	}
	if left := ix.leaving.left[en.Path]; same(left) || left != nil && left.UnknownWithID(en.FID) {
		return nil, AdoptLeft, nil
	}
	return en, AdoptIndexed, ix.publishLocked(en, false, nil)
}

// publishLocked indexes en (insertLocked) and returns the policy's
// records of the change: a REMOVE of each entry it replaced and en's
// INSERT, at en's last access; extra records follow them.
func (ix *Index) publishLocked(en *Entry, reserved bool, extra []abi.AccessRecord) []abi.AccessRecord {
	replaced := ix.insertLocked(en, reserved)
	recs := make([]abi.AccessRecord, 0, len(replaced)+1+len(extra))
	for _, r := range replaced {
		recs = append(recs, r.Access(abi.AccessRemove, en.Last))
	}
	recs = append(recs, en.Access(abi.AccessInsert, en.Last))
	return append(recs, extra...)
}

// Claim marks path in flight for a store (Flights.claimLocked) and
// returns the entry indexed there now (the file the store replaces; nil:
// none), or returns false and the holder's flight.
func (ix *Index) Claim(path string) (ok bool, old *Entry, fl *Flight) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if ok, fl = ix.flights.claimLocked(path); ok {
		old = ix.files.byPath[path]
	}
	return ok, old, fl
}

// PublishReleasing indexes en, a store's file, its reservation becoming
// the entry, and releases the store's claim on its path in the same
// step (releaseLocked): every store takes the lock, and many short
// holds queue small stores on many jobs. Only the path's holder indexes
// a file there (Adopt), so what the insert replaces is the file the
// store knew of. It returns the policy's records and what release
// returns.
func (ix *Index) PublishReleasing(en *Entry) ([]abi.AccessRecord, *Flight, []*Entry) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	recs := ix.publishLocked(en, true, nil)
	fl, orphans := ix.releaseLocked(en.Path, nil)
	return recs, fl, orphans
}

// ClaimMove claims the paths of a move of the entry of id: its own and
// dst, the path target returns for it (an error from target is
// returned). It reports stale where the entry is not indexed, pins keep
// it (movePins: with held, the restart hold's does not) or may refuses
// it, or a job holds either path; and dup, the entry at dst, where it
// holds other keys than the entry's (the paths are then not claimed).
// On success the caller holds both paths, and dup is the entry of the
// same keys at dst (nil: none).
func (ix *Index) ClaimMove(id uint64, held bool, may func(*Entry) bool, target func(*Entry) (string, error)) (en, dup *Entry, dst string, stale bool, err error) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	en = ix.files.entries[id]
	if en == nil || en.gone || en.movePins(held) > 0 || !may(en) {
		return nil, nil, "", true, nil
	}
	if dst, err = target(en); err != nil {
		return nil, nil, "", false, err
	}
	dup = ix.files.byPath[dst]
	if dup != nil && !dup.SameKeys(en) {
		return en, dup, dst, false, nil
	}
	if ok, _ := ix.flights.claimLocked(en.Path); !ok {
		return nil, nil, "", true, nil
	}
	if ok, _ := ix.flights.claimLocked(dst); !ok {
		fl, _ := ix.releaseLocked(en.Path, nil) // none can have orphaned it: the lock was held
		close(fl.Done)
		return nil, nil, "", true, nil
	}
	return en, dup, dst, false, nil
}

// Moved puts to, the copy of en made by a move, in en's place in one
// step: to is indexed (its reservation becoming the entry, with en's
// hits and last access) before en leaves the index, so that the keys
// never leave its key set, and where the restart hold held en it holds
// to. It reports false, changing nothing, where en left the index or
// pins keep it (movePins) meanwhile; otherwise it returns the policy's
// records of the move.
func (ix *Index) Moved(en, to *Entry, held bool) ([]abi.AccessRecord, bool) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if en.gone || en.movePins(held) > 0 {
		return nil, false
	}
	to.hits, to.Last = en.hits, en.Last
	wasHeld := en.held
	replaced := ix.insertLocked(to, true)
	ix.unindexLocked(en, true)
	ix.sp.Moved(en.Mount, to.Mount)
	recs := make([]abi.AccessRecord, 0, len(replaced)+3)
	for _, r := range replaced {
		recs = append(recs, r.Access(abi.AccessRemove, to.Last))
	}
	recs = append(recs, en.Access(abi.AccessRemove, to.Last), to.Access(abi.AccessInsert, to.Last))
	if wasHeld { // the hold's pin goes with the file
		ix.pins.holdLocked(to)
		recs = append(recs, to.Access(abi.AccessPin, to.Last))
	}
	return recs, true
}

// MovedTo drops en for dup, a file of the same keys at the target of
// its move, in one step: en's keys are handed over to dup first
// (Files.handOverLocked), dup takes en's last access and hits where en
// was used last, and where the restart hold held en it holds dup. It
// reports false, changing nothing, where either left the index or pins
// keep en meanwhile; otherwise it returns the policy's records.
func (ix *Index) MovedTo(en, dup *Entry, held bool) ([]abi.AccessRecord, bool) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if en.gone || en.movePins(held) > 0 || dup.gone {
		return nil, false
	}
	wasHeld := en.held
	ix.files.handOverLocked(en, dup)
	ix.unindexLocked(en, true)
	ix.sp.Moved(en.Mount, dup.Mount)
	recs := []abi.AccessRecord{en.Access(abi.AccessRemove, en.Last)}
	if en.Last > dup.Last {
		dup.hits, dup.Last = max(dup.hits, en.hits), en.Last
		recs = append(recs, dup.Access(abi.AccessInsert, dup.Last))
	}
	if wasHeld && !dup.held { // the hold keeps the keys in dup
		ix.pins.holdLocked(dup)
		recs = append(recs, dup.Access(abi.AccessPin, dup.Last))
	}
	return recs, true
}
