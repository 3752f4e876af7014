package index

import (
	"slices"
	"sync"
	"sync/atomic"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/host/policy"
)

// KeyID names a key across namespaces: its geometry fingerprint and bytes.
type KeyID struct {
	FP  uint64
	Key string
}

type keyRef struct {
	e   *Entry
	idx int // index of the key in the file
}

// Entry is one published file, or a spare or temporary file left on disk
// (spare). Fields
// other than pins, leases, hits, last, gone, orphan, retryAt, verified
// and removeFailed are immutable after it is indexed.
type Entry struct {
	ID    uint64
	NS    uint32 // the engine's NamespaceID
	FP    uint64
	Mount int
	Path  string
	Size  int64
	Keys  []string
	Ident fsys.Identity // of the file when it was indexed
	FID   uint64        // the header's file id (0: written before ids)
	// verified is when the file was last checked (Unix nanoseconds).
	Verified atomic.Int64
	// removeFailed: a removal of the file failed (disposeIfSame), which
	// counted in Stats.RemoveFailures; later failures are retries.
	RemoveFailed atomic.Bool
	// guarded by index.mu
	pins   int32
	leases int32 // client pins (Engine.Pin), also counted in pins
	hits   uint32
	Last   int64
	gone   bool // removed from the index
	// held: pinned by the restart hold (hold.go), in index.heldOrder under
	// its mount while indexed.
	held bool
	// lifted: held, and the hold's pin lifted in the policy's view for a
	// round of demoteHeld (hold.go): policyEntry does not count it.
	lifted bool
	// orphan: unindexed while another job held its path, which removes
	// the file (flight.go); counted in its mount's orphaned until then.
	orphan bool
	// retryAt: in left, when retryLeft may try to remove the file again
	// (Unix nanoseconds; 0: at the next eviction on its mount).
	retryAt int64
	// spare: not a published file but a spare (spares.go) or a temporary
	// file whose removal failed, only ever in left (index.leaveSpare): it
	// has no keys, and its name, this engine's own, says which file it is.
	Spare bool
	// heir: the file at a move's target, holding the same keys, that a
	// move dropped this entry for (demote.go, dropCopy); guarded by
	// index.mu.
	heir *Entry
	// file: the file held open for the entry's client pins, where
	// another engine may remove it (pinfiles.go); nil otherwise. Set
	// while leases > 0, cleared by the last client unpin, both with
	// index.mu held; a load reads it without the lock
	// (pinnedFile.acquire).
	File atomic.Pointer[PinnedFile]
}

// Index is what the engine knows is stored: the published files
// (entries) by id, by path and by key, and the paths that jobs of this
// engine hold (flight.go: a store writing there, a removal). It also
// guards the entries' mutable fields (pins, hits, last access, gone).
// It keeps each mount's count of files and their bytes in the space
// (entries, used) with its entries, and mirrors its keys to a KeySet
// (Engine.MirrorKeys). Besides the space it calls nothing of the engine:
// no I/O, no policy.
//
// Lock order: the engine's tables.mu > index.mu > space.mu. Only the index's own
// methods take mu: each operation the engine calls is whole, one hold of
// the lock (unindex and claim a path in one step, so that a store never
// publishes between them; pin, count a hit, move a file's entry), and
// only they change an entry's counts (pins, leases, hits, last access,
// the hold's marks). A caller's condition on an entry is a function the
// method calls with mu held (evict's may, drop's mayRemove), which reads
// the entry and never calls back into the index.
// The invariants below are checked with -tags invariants
// (invariants_on.go), not in the shipped binary.
//
// Invariants (check), with mu held:
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
//     held open (file) for its client pins (leases > 0).
type Index struct {
	mu       sync.RWMutex
	sp       Space
	entries  map[uint64]*Entry
	byKey    map[KeyID]keyRef
	byPath   map[string]*Entry
	inflight map[string]*Flight // paths being written or removed
	// reads holds the reads of files at paths that discoveries are
	// making (beginRead), by path.
	reads map[string][]*ReadMark
	// left holds the entries dropped from the index whose file could not
	// be removed (drop.go, disposeIfSame), and the spares whose removal
	// failed (leaveSpare), by the file's path: their mounts count their
	// bytes as used until an eviction there removes them (retryLeft) or
	// a file indexed at the path replaces them.
	left map[string]*Entry
	// nleft is len(left), read without mu: an eviction, which tries the
	// files left again first (takeLeft), takes no lock where there are
	// none.
	nleft atomic.Int64
	// removing holds the entries dropped from the index whose file is
	// being removed now (unindexLocked with remove: dropLocked, a move's
	// source; takeLeft) until their holder frees them (releaseLocked),
	// leaves them (leaveLocked) or keeps a spare (releaseKept): meanwhile
	// they are neither indexed nor in left, yet the file is on disk, and
	// may stay there. A cluster adopter retires no dead node while one of
	// its files is here (Engine.leftOf).
	removing map[*Entry]struct{}
	// pinnedGone holds, by key, the entries dropped from the index while
	// their client pins hold their file open (entry.file): a load of such
	// a key reads it there until the last of those pins ends, or a load
	// finds the file corrupt (unkeepPinned).
	// Two such files may hold one key (removed, stored again, removed),
	// each for its own pins: the key stays here until the last goes.
	pinnedGone map[KeyID][]*Entry
	lastID     uint64
	keys       KeySet // MirrorKeys's, or nil
	// heldN is the number of indexed entries the restart hold pins
	// (hold.go): those marked held.
	heldN int
	// heldOrder lists each mount's held entries in the order they were
	// held: a demotion round on one mount visits its own held files, not
	// the whole index, in chunks (inHeldChunks). It is only appended to
	// while the hold lasts, so a position stays the same entry between
	// chunks; it keeps entries no longer held (unindexed, released),
	// which visits skip, until the hold ends.
	heldOrder map[int][]*Entry
	// byFP counts the indexed files, keys and bytes of each namespace
	// fingerprint (NamespaceStats); a fingerprint with none is not kept.
	byFP map[uint64]*FPCount
}

// FPCount is what the index holds of one namespace fingerprint.
type FPCount struct {
	Files, Keys int
	Bytes       int64
}

// NewIndex returns an empty index that tells sp of its files.
func NewIndex(sp Space) *Index {
	return &Index{
		sp:        sp,
		entries:   map[uint64]*Entry{},
		byKey:     map[KeyID]keyRef{},
		byPath:    map[string]*Entry{},
		inflight:  map[string]*Flight{},
		reads:     map[string][]*ReadMark{},
		left:      map[string]*Entry{},
		removing:  map[*Entry]struct{}{},
		heldOrder: map[int][]*Entry{},
		byFP:      map[uint64]*FPCount{},
	}
}

// countOf returns fp's counts, made where it has none.
func (ix *Index) countOf(fp uint64) *FPCount {
	c := ix.byFP[fp]
	if c == nil {
		c = &FPCount{}
		ix.byFP[fp] = c
	}
	return c
}

// Holds reports whether the index holds a file or key of fingerprint fp.
func (ix *Index) Holds(fp uint64) bool {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.holdsLocked(fp)
}

// holdsLocked is holds, called with ix.mu held.
func (ix *Index) holdsLocked(fp uint64) bool {
	c := ix.byFP[fp]
	return c != nil && (c.Files > 0 || c.Keys > 0)
}

// holdsAnyLocked reports whether the index holds a file or key of a
// fingerprint of fps. Called with ix.mu held.
func (ix *Index) holdsAnyLocked(fps map[uint64]int64) bool {
	for fp := range fps {
		if ix.holdsLocked(fp) {
			return true
		}
	}
	return false
}

// dropEmptyLocked forgets fp's counts once it has nothing indexed.
func (ix *Index) dropEmptyLocked(fp uint64, c *FPCount) {
	if c.Files == 0 && c.Keys == 0 {
		delete(ix.byFP, fp)
	}
}

// FingerprintCounts returns the files, keys and bytes indexed of each
// namespace fingerprint that has any.
func (ix *Index) FingerprintCounts() map[uint64]FPCount {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	out := make(map[uint64]FPCount, len(ix.byFP))
	for fp, c := range ix.byFP {
		out[fp] = *c
	}
	return out
}

// heldFoundLocked is the number of indexed entries the restart hold pins.
func (ix *Index) heldFoundLocked() int {
	return ix.heldN
}

// getLocked is the entry holding key of fingerprint fp, or nil.
func (ix *Index) getLocked(fp uint64, key []byte) *Entry {
	if ref, ok := ix.byKey[KeyID{fp, string(key)}]; ok {
		return ref.e
	}
	return nil
}

// Get is getLocked taking the lock.
func (ix *Index) Get(fp uint64, key []byte) *Entry {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.getLocked(fp, key)
}

// GetAll is getLocked for the keys of the request indices idx (all keys
// where idx is nil), under one hold of the lock: the entry of the i-th
// is the i-th (nil: none).
func (ix *Index) GetAll(fp uint64, keys [][]byte, idx []int) []*Entry {
	n := len(keys)
	if idx != nil {
		n = len(idx)
	}
	found := make([]*Entry, n)
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	for t := range found {
		i := t
		if idx != nil {
			i = idx[t]
		}
		found[t] = ix.getLocked(fp, keys[i])
	}
	return found
}

// Gone reports whether en is no longer indexed.
func (ix *Index) Gone(en *Entry) bool {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return en.gone
}

// insertLocked indexes en, replacing any entry at its path or holding its
// keys (returned, already unindexed; their files are gone). reserved: the
// file's bytes are a reservation already counted on its mount.
func (ix *Index) insertLocked(en *Entry, reserved bool) []*Entry {
	var replaced []*Entry
	if old := ix.byPath[en.Path]; old != nil {
		ix.unindexLocked(old, false)
		replaced = append(replaced, old)
	}
	if old := ix.left[en.Path]; old != nil { // this file took its place
		delete(ix.left, en.Path)
		ix.nleft.Add(-1)
		ix.sp.Free(old.Mount, old.Size, false)
	}
	ix.lastID++
	en.ID = ix.lastID
	ix.entries[en.ID] = en
	ix.byPath[en.Path] = en
	c := ix.countOf(en.FP)
	c.Files++
	c.Bytes += en.Size
	for i, k := range en.Keys {
		_, had := ix.byKey[KeyID{en.FP, k}]
		ix.byKey[KeyID{en.FP, k}] = keyRef{e: en, idx: i}
		if had { // a key taken from another file stays
			continue
		}
		c.Keys++
		if ix.keys != nil {
			ix.keys.Add(en.FP, k)
		}
	}
	ix.sp.Indexed(en.Mount, en.Size, reserved)
	return replaced
}

// relinkLocked indexes en again for those of its keys that the index does
// not find (the key's entry pointed at another file, since dropped). It
// reports false if en is no longer indexed.
func (ix *Index) relinkLocked(en *Entry) bool {
	if en.gone {
		return false
	}
	for i, k := range en.Keys {
		if _, ok := ix.byKey[KeyID{en.FP, k}]; !ok {
			ix.byKey[KeyID{en.FP, k}] = keyRef{e: en, idx: i}
			ix.countOf(en.FP).Keys++
			if ix.keys != nil {
				ix.keys.Add(en.FP, k)
			}
		}
	}
	return true
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
		ix.keepPinnedLocked(en)
	}
	if en.held { // the restart hold lets it go now
		ix.unholdLocked(en)
	}
	delete(ix.entries, en.ID)
	if ix.byPath[en.Path] == en {
		delete(ix.byPath, en.Path)
	}
	c := ix.countOf(en.FP)
	c.Files--
	c.Bytes -= en.Size
	defer ix.dropEmptyLocked(en.FP, c)
	for _, k := range en.Keys {
		if ref, ok := ix.byKey[KeyID{en.FP, k}]; ok && ref.e == en {
			delete(ix.byKey, KeyID{en.FP, k})
			c.Keys--
			if ix.keys != nil {
				ix.keys.Remove(en.FP, k)
			}
		}
	}
	if remove {
		ix.removing[en] = struct{}{}
	} else {
		ix.sp.Unindexed(en.Mount, en.Size, false, false)
	}
	return true
}

// holdLocked pins en for the restart hold (hold.go): each file found at
// start, and the copy of a held file that a demotion moved (moveEntry),
// which keeps the hold's pin.
func (ix *Index) holdLocked(en *Entry) {
	en.held = true
	en.pins++
	ix.heldN++
	ix.heldOrder[en.Mount] = append(ix.heldOrder[en.Mount], en)
}

// unholdLocked ends the restart hold's pin of en, which it holds; en
// stays in heldOrder until the hold ends.
func (ix *Index) unholdLocked(en *Entry) {
	en.held = false
	en.pins--
	ix.heldN--
}

// heldChunk is the most held entries a visit of them (inHeldChunks,
// inChunks) handles in one hold of the index's write lock. Right after a
// restart most of a mount's files are held, hundreds of thousands on a
// large memory mount, and every request that pins, hits or publishes
// waits while the lock is held for writing: a chunk bounds that wait to
// 1024 entries' work (RATIONALE.md, "Why does the restart hold visit its
// files in chunks?").
const heldChunk = 1024

// inHeldChunks calls fn for each entry of mount mnt's heldOrder, or of
// every mount's where mnt is negative, with the index's lock held for
// writing, released after each heldChunk of them. An entry is found as
// it is then: fn checks that it is still held (one unindexed or
// released meanwhile stays listed) and what else it relies on. Entries
// appended to a list meanwhile are visited too.
func (ix *Index) inHeldChunks(mnt int, fn func(*Entry)) {
	ix.mu.RLock()
	var mounts []int
	for m := range ix.heldOrder {
		if mnt < 0 || m == mnt {
			mounts = append(mounts, m)
		}
	}
	ix.mu.RUnlock()
	for _, m := range mounts {
		for at := 0; ; at += heldChunk {
			ix.mu.Lock()
			list := ix.heldOrder[m]
			if at >= len(list) {
				ix.mu.Unlock()
				break
			}
			for _, en := range list[at:min(at+heldChunk, len(list))] {
				fn(en)
			}
			ix.mu.Unlock()
		}
	}
}

// inChunks calls fn for each of ens in order, with the index's lock held
// for writing, released after each heldChunk of them.
func (ix *Index) inChunks(ens []*Entry, fn func(*Entry)) {
	for len(ens) > 0 {
		part := ens[:min(len(ens), heldChunk)]
		ens = ens[len(part):]
		ix.mu.Lock()
		for _, en := range part {
			fn(en)
		}
		ix.mu.Unlock()
	}
}

// movePins is en's pins that keep it from moving: all of them, or with
// held those of loads and clients only, not the restart hold's.
// index.mu is held.
func (en *Entry) movePins(held bool) int32 {
	if held && en.held {
		return en.pins - 1
	}
	return en.pins
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
	claimed, fl := ix.claimLocked(en.Path)
	if !claimed {
		fl.orphans = append(fl.orphans, en)
		en.orphan = true
	}
	ix.sp.Unindexed(en.Mount, en.Size, true, en.orphan)
	return true, claimed
}

// leaveLocked records that the file of en, dropped from the index, could
// not be removed and is at path at: its mount goes on counting its bytes
// as used, no longer as an orphan's (no job removes it now).
func (ix *Index) leaveLocked(en *Entry, at string) {
	if en.orphan {
		en.orphan = false
		ix.sp.Unorphan(en.Mount, en.Size)
	}
	delete(ix.removing, en) // its removal is over: en is left
	switch old := ix.left[at]; {
	case old == nil:
		ix.nleft.Add(1)
	case old != en: // one file at a path
		ix.sp.Free(old.Mount, old.Size, false)
	}
	ix.left[at] = en
}

// LeaveSpare records that the spare file at path, of size bytes on mount,
// which the mount no longer counts (taken from its spares, or made and
// not kept), or a temporary file not published (removeTemp), could not
// be removed: like a dropped file's (leaveLocked), its bytes count as
// used until an eviction there removes it (retryLeft).
func (ix *Index) LeaveSpare(mount int, path string, size int64) {
	en := &Entry{Mount: mount, Path: path, Size: size, Spare: true}
	en.RemoveFailed.Store(true)
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.sp.Left(mount, size)
	ix.leaveLocked(en, path)
}

// Leave is leaveLocked taking the lock.
func (ix *Index) Leave(en *Entry, at string) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.leaveLocked(en, at)
}

// ReleaseLeaving is release for a holder that has just tried to remove
// the file of one of ens: left (nil: none) is the one whose file is still
// there, at at (leaveLocked); the others are freed.
func (ix *Index) ReleaseLeaving(path string, ens []*Entry, left *Entry, at string) (*Flight, []*Entry) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	freed := ens
	if left != nil {
		freed = slices.DeleteFunc(slices.Clone(ens), func(en *Entry) bool { return en == left })
		ix.leaveLocked(left, at)
	}
	return ix.releaseLocked(path, freed)
}

// ReleaseKept is release for the holder of the path of en, evicted,
// whose file it has just kept as a spare (evictClaimed): en's removal is
// over, its bytes counted as the spare's.
func (ix *Index) ReleaseKept(path string, en *Entry) (*Flight, []*Entry) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	delete(ix.removing, en)
	return ix.releaseLocked(path, nil)
}

// TakeLeft takes from left the entries that want accepts (those of a
// mount due a try: retryLeft; those of a namespace: Purge) whose path it
// claims (none that a job holds now), by path, for the caller to remove
// and release (removeAt); each is next due next. Where left is empty it
// returns without taking the lock.
func (ix *Index) TakeLeft(want func(*Entry) bool, next int64) map[string]*Entry {
	if ix.nleft.Load() == 0 {
		return nil
	}
	ix.mu.Lock()
	defer ix.mu.Unlock()
	var took map[string]*Entry
	for at, en := range ix.left {
		if !want(en) {
			continue
		}
		if ok, _ := ix.claimLocked(at); !ok {
			continue
		}
		delete(ix.left, at)
		ix.nleft.Add(-1)
		ix.removing[en] = struct{}{}
		en.retryAt = next
		if took == nil {
			took = map[string]*Entry{}
		}
		took[at] = en
	}
	return took
}

// Each calls fn for every indexed entry, under the index's lock held for
// reading: fn reads the entry's fields and calls nothing of the engine
// (the policy's view, a rebuild's or a reload's walk).
func (ix *Index) Each(fn func(*Entry)) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	for _, en := range ix.entries {
		fn(en)
	}
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

// Hit counts a hit at now on each of ens and returns the policy's
// records of them.
func (ix *Index) Hit(ens []*Entry, now int64) []abi.AccessRecord {
	recs := make([]abi.AccessRecord, len(ens))
	ix.mu.Lock()
	defer ix.mu.Unlock()
	for i, en := range ens {
		en.hits++
		en.Last = now
		recs[i] = en.Access(abi.AccessHit, now)
	}
	return recs
}

// UnpinClient drops one client pin of each of ens (Engine.Pin) and, with
// tell, returns the policy's unpin records of those still indexed. It
// also returns the files held open for pins that no pin holds now
// (entry.file), for the caller to release once mu is let go.
func (ix *Index) UnpinClient(ens []*Entry, now int64, tell bool) ([]abi.AccessRecord, []*PinnedFile) {
	var recs []abi.AccessRecord
	var files []*PinnedFile
	ix.mu.Lock()
	defer ix.mu.Unlock()
	for _, en := range ens {
		en.pins--
		en.leases--
		if tell && !en.gone {
			recs = append(recs, en.Access(abi.AccessUnpin, now))
		}
		if pf := en.File.Load(); en.leases == 0 && pf != nil {
			files = append(files, pf)
			en.File.Store(nil)
			ix.unkeepPinnedLocked(en)
		}
	}
	return recs, files
}

// UnkeepPinned takes en out of pinnedGone, if there: loads of its keys no
// longer read its file, which stays open until its client pins end (a
// file found corrupt: loadFile). It takes mu.
func (ix *Index) UnkeepPinned(en *Entry) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.unkeepPinnedLocked(en)
}

// unkeepPinnedLocked is unkeepPinned for a caller that holds mu.
func (ix *Index) unkeepPinnedLocked(en *Entry) {
	for _, k := range en.Keys {
		id := KeyID{en.FP, k}
		if ens := slices.DeleteFunc(ix.pinnedGone[id], func(o *Entry) bool { return o == en }); len(ens) > 0 {
			ix.pinnedGone[id] = ens
		} else {
			delete(ix.pinnedGone, id)
		}
	}
}

// holdOpenLocked makes pf the file held open for en's client pins, and
// reports true, unless one is held already or no client pin holds en any
// more. An entry already gone is kept for loads (keepPinnedLocked). The
// caller holds mu.
func (ix *Index) holdOpenLocked(en *Entry, pf *PinnedFile) bool {
	if en.File.Load() != nil || en.leases <= 0 {
		return false
	}
	en.File.Store(pf)
	if en.gone {
		ix.keepPinnedLocked(en)
	}
	return true
}

// keepPinnedLocked lists en, gone from the index and held open for its
// client pins, in pinnedGone under its keys. The caller holds mu.
func (ix *Index) keepPinnedLocked(en *Entry) {
	if ix.pinnedGone == nil {
		ix.pinnedGone = map[KeyID][]*Entry{}
	}
	for _, k := range en.Keys {
		id := KeyID{en.FP, k}
		if !slices.Contains(ix.pinnedGone[id], en) {
			ix.pinnedGone[id] = append(ix.pinnedGone[id], en)
		}
	}
}

// pinnedGoneLocked returns an entry of key that its client pins hold open
// although it left the index (pinnedGone; the latest kept of those), or
// nil. The caller holds mu.
func (ix *Index) pinnedGoneLocked(fp uint64, key []byte) *Entry {
	if len(ix.pinnedGone) == 0 {
		return nil // no key kept: every load's case but while pins hold removed files
	}
	if ens := ix.pinnedGone[KeyID{fp, string(key)}]; len(ens) > 0 {
		return ens[len(ens)-1]
	}
	return nil
}

// Release is releaseLocked taking the lock.
func (ix *Index) Release(path string, freed []*Entry) (*Flight, []*Entry) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	return ix.releaseLocked(path, freed)
}

// Mirror makes ks the index's KeySet: it is told every key now and every
// change from then on (nil: none).
func (ix *Index) Mirror(ks KeySet) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.keys = ks
	if ks == nil {
		return
	}
	for k := range ix.byKey {
		ks.Add(k.FP, k.Key)
	}
}

// Size returns how many files and keys the index holds.
func (ix *Index) Size() (files, keys int) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return len(ix.entries), len(ix.byKey)
}

// PolicyEntry returns the policy's view of entry id.
func (ix *Index) PolicyEntry(id uint64) (policy.Entry, bool) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	en, ok := ix.entries[id]
	if !ok {
		return policy.Entry{}, false
	}
	return en.policyEntry(), true
}

// PolicyEntries returns the policy's view of every entry, a snapshot.
func (ix *Index) PolicyEntries() []policy.Entry {
	var snap []policy.Entry
	ix.Each(func(en *Entry) { snap = append(snap, en.policyEntry()) })
	return snap
}

// Records returns an access record of kind for every entry, at its last
// access.
func (ix *Index) Records(kind uint32) []abi.AccessRecord {
	var recs []abi.AccessRecord
	ix.Each(func(en *Entry) { recs = append(recs, en.Access(kind, en.Last)) })
	return recs
}

func (en *Entry) policyEntry() policy.Entry {
	pins := en.pins
	if en.lifted {
		pins--
	}
	return policy.Entry{
		ID: en.ID, KeyHash: abi.KeyHash([]byte(en.Keys[0])), Size: uint64(en.Size), Mount: uint32(en.Mount),
		NS: uint32(en.NS), LastAccess: uint64(en.Last), Hits: en.hits, Pins: uint32(pins),
	}
}

// Access is the policy's record of an access of kind to en at t.
func (en *Entry) Access(kind uint32, t int64) abi.AccessRecord {
	return abi.AccessRecord{
		Entry: en.ID, Time: uint64(t), Size: uint64(en.Size), KeyHash: abi.KeyHash([]byte(en.Keys[0])),
		Kind: kind, Mount: uint32(en.Mount), NS: uint32(en.NS), Hits: en.hits,
	}
}

// SameKeys reports whether en and o hold the same keys of one namespace
// fingerprint, at the same positions, in files of one size: the same KV,
// whichever node wrote each file.
func (en *Entry) SameKeys(o *Entry) bool {
	return en.FP == o.FP && en.Size == o.Size && slices.Equal(en.Keys, o.Keys)
}

// currentLocked returns the entry that holds key now if en, found for
// it, was moved meanwhile (unindexed, and the key's entry is a copy of the
// same file: the same header id, or the file at the target that the move
// dropped en for: its heir); otherwise en. The caller holds index.mu.
func (ix *Index) currentLocked(en *Entry, key []byte) *Entry {
	if !en.gone || en.FID == 0 && en.heir == nil {
		return en
	}
	if cur := ix.getLocked(en.FP, key); cur != nil && !cur.gone && (en.FID != 0 && cur.FID == en.FID || cur == en.heir) {
		return cur
	}
	return en
}

// handOverLocked points every key that the index finds in from at to, a
// file of the same keys (the same fingerprint, at the same positions), and
// makes to from's heir: unindexing from then leaves its keys indexed, and
// in the key set (MirrorKeys), whose misses a client may take for final.
func (ix *Index) handOverLocked(from, to *Entry) {
	for i, k := range from.Keys {
		id := KeyID{from.FP, k}
		if ref, ok := ix.byKey[id]; ok && ref.e == from {
			ix.byKey[id] = keyRef{e: to, idx: i}
		}
	}
	from.heir = to
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

// DropResult is what dropUnpinned did: the entry it dropped (the file
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
// currentLocked), unless a client pin holds it or it is gone; the check
// and the unindexing are one step, so a pin that took hold is never
// dropped under it. Where mayRemove is not nil and says no (asked with
// the lock held), the entry leaves the index and its file stays.
func (ix *Index) DropUnpinned(en *Entry, key []byte, mayRemove func(*Entry) bool, now int64) DropResult {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	en = ix.currentLocked(en, key)
	if en.gone {
		return DropResult{}
	}
	if en.leases > 0 {
		return DropResult{En: en, Pinned: true}
	}
	keys := 0
	for _, k := range en.Keys {
		if ref, ok := ix.byKey[KeyID{en.FP, k}]; ok && ref.e == en {
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

// EvictID is evict for the entry of id, which it returns (nil: none).
func (ix *Index) EvictID(id uint64, may func(*Entry) bool, now int64) (en *Entry, claimed bool, rec abi.AccessRecord, ok bool) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if en = ix.entries[id]; en == nil {
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

// Matching returns the indexed entries that want accepts; want reads
// the entry under the lock held for reading. Where fps is not nil, an
// index holding nothing of those fingerprints is not scanned.
func (ix *Index) Matching(fps map[uint64]int64, want func(*Entry) bool) []*Entry {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	if fps != nil && !ix.holdsAnyLocked(fps) {
		return nil
	}
	var ens []*Entry
	for _, en := range ix.entries {
		if want(en) {
			ens = append(ens, en)
		}
	}
	return ens
}

// AnyOut reports whether of accepts an entry whose file is still on disk
// though it left the index: left there (left) or being removed
// (removing).
func (ix *Index) AnyOut(of func(*Entry) bool) bool {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	for _, en := range ix.left {
		if of(en) {
			return true
		}
	}
	for en := range ix.removing {
		if of(en) {
			return true
		}
	}
	return false
}

// Touch records uses by other nodes of the indexed files on mount: at
// returns the time of the use of a file by its header id (ok false:
// none); a use later than the file's last access becomes its last
// access, and a hit record of it is returned.
func (ix *Index) Touch(mount int, at func(fid uint64) (int64, bool)) []abi.AccessRecord {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	var recs []abi.AccessRecord
	for _, en := range ix.entries {
		if en.Mount != mount {
			continue
		}
		t, ok := at(en.FID)
		if ok && t > en.Last {
			en.Last = t
			recs = append(recs, en.Access(abi.AccessHit, en.Last))
		}
	}
	return recs
}

// Current is currentLocked taking the lock.
func (ix *Index) Current(en *Entry, key []byte) *Entry {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.currentLocked(en, key)
}

// AdoptResult is what adoptLocked did with an entry found on disk.
type AdoptResult int

const (
	AdoptIndexed AdoptResult = iota // indexed (or the same file already was: relinked)
	AdoptHeld                       // a job holds the path, or the read went stale
	AdoptLeft                       // the file is one this engine dropped and left
)

// Adopt indexes en, an entry of a file found on disk, unless read (the
// read of the file; nil: none) went stale or a job holds its path
// (adoptHeld), or the file is one this engine dropped and could not
// remove (adoptLeft). Where the index holds the same file at the path,
// that entry is returned instead, its keys relinked. recs are the
// policy's records of the change (the entries replaced, en's INSERT).
func (ix *Index) Adopt(en *Entry, read *ReadMark) (got *Entry, res AdoptResult, recs []abi.AccessRecord) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if read != nil && read.stale || ix.heldLocked(en.Path) {
		return nil, AdoptHeld, nil
	}
	same := func(old *Entry) bool { return old != nil && old.Ident.Same(en.Ident) && old.FID == en.FID }
	if old := ix.byPath[en.Path]; same(old) {
		ix.relinkLocked(old) // found by a key the index had lost
		return old, AdoptIndexed, nil
	}
	if left := ix.left[en.Path]; same(left) || left != nil && left.UnknownWithID(en.FID) {
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

// PinKey finds the entry of key of fingerprint fp, or the entry a client
// pin holds open out of the index (pinnedGone), and pins it for a load
// (pinLoadLocked); nil where neither has one. An entry held open is
// preferred to an indexed one that is not: a newer file of the key,
// found after the held one left the index, may be removed by its node
// too, and the client's pin promised a load.
func (ix *Index) PinKey(fp uint64, key []byte, dup func(*Entry) bool, now int64, pins *[]abi.AccessRecord) (*Entry, bool) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	en := ix.getLocked(fp, key)
	if en == nil || en.File.Load() == nil {
		// Dropped from the index (another engine removed its file)
		// while a client pin holds the file open (pinfiles.go).
		if held := ix.pinnedGoneLocked(fp, key); held != nil {
			en = held
		}
	}
	if en == nil {
		return nil, false
	}
	return ix.pinLoadLocked(en, key, dup, now, pins)
}

// PinFound is pinKey for en, an entry found on disk for key.
func (ix *Index) PinFound(en *Entry, key []byte, dup func(*Entry) bool, now int64, pins *[]abi.AccessRecord) (*Entry, bool) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	return ix.pinLoadLocked(en, key, dup, now, pins)
}

// pinLoadLocked pins en (or the file it moved to meanwhile, demote.go)
// for a load of key, once per file of the load (dup reports the files it
// pinned already), and appends the policy's pin record to pins. It
// returns the entry and whether the load holds a pin on it.
func (ix *Index) pinLoadLocked(en *Entry, key []byte, dup func(*Entry) bool, now int64, pins *[]abi.AccessRecord) (*Entry, bool) {
	en = ix.currentLocked(en, key)
	if dup(en) {
		return en, true // another key of this load pinned it
	}
	if en.gone {
		if en.File.Load() == nil {
			return en, false
		}
		en.pins++ // read through the file its client pins hold open; the policy knows it no more
		return en, true
	}
	en.pins++
	*pins = append(*pins, en.Access(abi.AccessPin, now))
	return en, true
}

// UnpinLoad drops a load's pin of each of ens; those loaded count a hit
// at now. It returns the policy's records (hits, unpins) of those still
// indexed.
func (ix *Index) UnpinLoad(ens []*Entry, loaded func(*Entry) bool, now int64) []abi.AccessRecord {
	var recs []abi.AccessRecord
	ix.mu.Lock()
	defer ix.mu.Unlock()
	for _, en := range ens {
		en.pins--
		if en.gone {
			continue
		}
		if loaded(en) {
			en.hits++
			en.Last = now
			recs = append(recs, en.Access(abi.AccessHit, now))
		}
		recs = append(recs, en.Access(abi.AccessUnpin, now))
	}
	return recs
}

// PinClient takes a client pin (Engine.Pin) of en, found for key, or of
// the file it moved to meanwhile (returned), unless dup says the pin
// holds it already; gone reports an entry no longer indexed, or whose
// file a store replaces now (flight.replaces), which is not pinned.
func (ix *Index) PinClient(en *Entry, key []byte, dup func(*Entry) bool) (cur *Entry, isDup, gone bool) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	en = ix.currentLocked(en, key) // moved since it was found (demote.go)
	isDup = dup(en)
	gone = en.gone
	if fl := ix.inflight[en.Path]; fl != nil && fl.replaces == en {
		gone = true // a store replaces its file now (Engine.replacing)
	}
	if !isDup && !gone {
		en.pins++
		en.leases++
	}
	return en, isDup, gone
}

// HitPinned counts a hit at now on each of ens, just pinned by a client,
// and returns the policy's records (a hit and a pin) of those indexed.
func (ix *Index) HitPinned(ens []*Entry, now int64) []abi.AccessRecord {
	var recs []abi.AccessRecord
	ix.mu.Lock()
	defer ix.mu.Unlock()
	for _, en := range ens {
		en.hits++
		en.Last = now
		if !en.gone {
			recs = append(recs, en.Access(abi.AccessHit, now), en.Access(abi.AccessPin, now))
		}
	}
	return recs
}

// HoldOpen is holdOpenLocked taking the lock.
func (ix *Index) HoldOpen(en *Entry, pf *PinnedFile) bool {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	return ix.holdOpenLocked(en, pf)
}

// HoldAll pins every indexed entry for the restart hold (holdLocked) and
// returns the policy's pin records at now.
func (ix *Index) HoldAll(now int64) []abi.AccessRecord {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	recs := make([]abi.AccessRecord, 0, len(ix.entries))
	for _, en := range ix.entries {
		ix.holdLocked(en)
		recs = append(recs, en.Access(abi.AccessPin, now))
	}
	return recs
}

// EndHold ends the restart hold's pin of every entry it holds, in chunks
// (inHeldChunks), and forgets its lists. It returns how many it let go
// and, with tell, the policy's unpin records at now.
func (ix *Index) EndHold(tell bool, now int64) (n int, recs []abi.AccessRecord) {
	ix.inHeldChunks(-1, func(en *Entry) {
		if !en.held { // unindexed meanwhile (it let the hold go then), or listed twice
			return
		}
		ix.unholdLocked(en)
		n++
		if tell {
			recs = append(recs, en.Access(abi.AccessUnpin, now))
		}
	})
	ix.mu.Lock()
	clear(ix.heldOrder)
	ix.mu.Unlock()
	return n, recs
}

// HeldFound is the number of indexed entries the restart hold pins.
func (ix *Index) HeldFound() int {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.heldN
}

// LiftHeld lifts, in the policy's view, the restart hold's pin of mount
// mnt's held entries that nothing else pins (entry.lifted), in chunks,
// and returns them with the policy's unpin records at now.
func (ix *Index) LiftHeld(mnt int, now int64) (lifted []*Entry, recs []abi.AccessRecord) {
	ix.inHeldChunks(mnt, func(en *Entry) {
		if en.held && !en.lifted && en.pins == 1 {
			en.lifted = true
			lifted = append(lifted, en)
			recs = append(recs, en.Access(abi.AccessUnpin, now))
		}
	})
	return lifted, recs
}

// Unlift ends liftHeld's lift of lifted and returns the policy's pin
// records at now of those still indexed and held (not moved: a move's
// copy was pinned by the move).
func (ix *Index) Unlift(lifted []*Entry, now int64) []abi.AccessRecord {
	var recs []abi.AccessRecord
	ix.inChunks(lifted, func(en *Entry) {
		en.lifted = false
		if !en.gone && en.held {
			recs = append(recs, en.Access(abi.AccessPin, now))
		}
	})
	return recs
}

// Claim marks path in flight for a store (claimLocked) and returns the
// entry indexed there now (the file the store replaces; nil: none), or
// returns false and the holder's flight.
func (ix *Index) Claim(path string) (ok bool, old *Entry, fl *Flight) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if ok, fl = ix.claimLocked(path); ok {
		old = ix.byPath[path]
	}
	return ok, old, fl
}

// Relink is relinkLocked taking the lock.
func (ix *Index) Relink(en *Entry) bool {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	return ix.relinkLocked(en)
}

// Replacing marks the store holding path as one that replaces old, the
// file indexed there, so that no pin takes hold of old from then on
// (pinClient), unless a client pin holds old already: then it reports
// false. Both in one step: a pin either comes first and refuses the
// store, or finds the path being replaced and pins nothing.
func (ix *Index) Replacing(path string, old *Entry) bool {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if old.leases > 0 && !old.gone {
		return false
	}
	if fl := ix.inflight[path]; fl != nil {
		fl.replaces = old
	}
	return true
}

// PublishReleasing indexes en, a store's file, its reservation becoming
// the entry, and releases the store's claim on its path in the same
// step (releaseLocked): every store takes the lock, and many short
// holds queue small stores on many jobs. Only the path's holder indexes
// a file there (adopt), so what the insert replaces is the file the
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
	en = ix.entries[id]
	if en == nil || en.gone || en.movePins(held) > 0 || !may(en) {
		return nil, nil, "", true, nil
	}
	if dst, err = target(en); err != nil {
		return nil, nil, "", false, err
	}
	dup = ix.byPath[dst]
	if dup != nil && !dup.SameKeys(en) {
		return en, dup, dst, false, nil
	}
	if ok, _ := ix.claimLocked(en.Path); !ok {
		return nil, nil, "", true, nil
	}
	if ok, _ := ix.claimLocked(dst); !ok {
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
		ix.holdLocked(to)
		recs = append(recs, to.Access(abi.AccessPin, to.Last))
	}
	return recs, true
}

// MovedTo drops en for dup, a file of the same keys at the target of
// its move, in one step: en's keys are handed over to dup first
// (handOverLocked), dup takes en's last access and hits where en was
// used last, and where the restart hold held en it holds dup. It
// reports false, changing nothing, where either left the index or pins
// keep en meanwhile; otherwise it returns the policy's records.
func (ix *Index) MovedTo(en, dup *Entry, held bool) ([]abi.AccessRecord, bool) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if en.gone || en.movePins(held) > 0 || dup.gone {
		return nil, false
	}
	wasHeld := en.held
	ix.handOverLocked(en, dup)
	ix.unindexLocked(en, true)
	ix.sp.Moved(en.Mount, dup.Mount)
	recs := []abi.AccessRecord{en.Access(abi.AccessRemove, en.Last)}
	if en.Last > dup.Last {
		dup.hits, dup.Last = max(dup.hits, en.hits), en.Last
		recs = append(recs, dup.Access(abi.AccessInsert, dup.Last))
	}
	if wasHeld && !dup.held { // the hold keeps the keys in dup
		ix.holdLocked(dup)
		recs = append(recs, dup.Access(abi.AccessPin, dup.Last))
	}
	return recs, true
}

// UnknownWithID reports whether en is an entry of unknown identity, never
// indexed (publish: the fstat after its rename and the stat of its name
// failed, so it was left), whose file is the one with header id fid: the
// id alone decides, as it never repeats.
func (en *Entry) UnknownWithID(fid uint64) bool {
	return en.Ident.Ino == 0 && en.FID != 0 && en.FID == fid
}
