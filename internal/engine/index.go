package engine

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/format"
)

// keyID names a key across namespaces: its geometry fingerprint and bytes.
type keyID struct {
	fp  uint64
	key string
}

type keyRef struct {
	e   *entry
	idx int // index of the key in the file
}

// entry is one published file, or a spare or temporary file left on disk
// (spare). Fields
// other than pins, leases, hits, last, gone, orphan, retryAt, verified
// and removeFailed are immutable after it is indexed.
type entry struct {
	id    uint64
	ns    NamespaceID
	fp    uint64
	mount int
	path  string
	size  int64
	keys  []string
	ident fsys.Identity // of the file when it was indexed
	fid   uint64        // the header's file id (0: written before ids)
	// verified is when the file was last checked (Unix nanoseconds).
	verified atomic.Int64
	// removeFailed: a removal of the file failed (disposeIfSame), which
	// counted in Stats.RemoveFailures; later failures are retries.
	removeFailed atomic.Bool
	// guarded by index.mu
	pins   int32
	leases int32 // client pins (Engine.Pin), also counted in pins
	hits   uint32
	last   int64
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
	spare bool
	// heir: the file at a move's target, holding the same keys, that a
	// move dropped this entry for (demote.go, dropCopy); guarded by
	// index.mu.
	heir *entry
	// file: the file held open for the entry's client pins, where
	// another engine may remove it (pinfiles.go); nil otherwise. Set
	// while leases > 0, cleared by the last client unpin, both with
	// index.mu held; a load reads it without the lock
	// (pinnedFile.acquire).
	file atomic.Pointer[pinnedFile]
}

// index is what the engine knows is stored: the published files
// (entries) by id, by path and by key, and the paths that jobs of this
// engine hold (flight.go: a store writing there, a removal). It also
// guards the entries' mutable fields (pins, hits, last access, gone).
// It keeps each mount's count of files and their bytes in the space
// (entries, used) with its entries, and mirrors its keys to a KeySet
// (Engine.MirrorKeys). Besides the space it calls nothing of the engine:
// no I/O, no policy.
//
// Lock order: Engine.mu > index.mu > space.mu. Callers hold mu across
// compound steps (unindex and claim a path in one step, so that a store
// never publishes between them).
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
type index struct {
	mu       sync.RWMutex
	sp       *space
	entries  map[uint64]*entry
	byKey    map[keyID]keyRef
	byPath   map[string]*entry
	inflight map[string]*flight // paths being written or removed
	// reads holds the reads of files at paths that discoveries are
	// making (beginRead), by path.
	reads map[string][]*readMark
	// left holds the entries dropped from the index whose file could not
	// be removed (drop.go, disposeIfSame), and the spares whose removal
	// failed (leaveSpare), by the file's path: their mounts count their
	// bytes as used until an eviction there removes them (retryLeft) or
	// a file indexed at the path replaces them.
	left map[string]*entry
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
	removing map[*entry]struct{}
	// pinnedGone holds, by key, the entries dropped from the index while
	// their client pins hold their file open (entry.file): a load of such
	// a key reads it there until the last of those pins ends, or a load
	// finds the file corrupt (unkeepPinned).
	// Two such files may hold one key (removed, stored again, removed),
	// each for its own pins: the key stays here until the last goes.
	pinnedGone map[keyID][]*entry
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
	heldOrder map[int][]*entry
	// byFP counts the indexed files, keys and bytes of each namespace
	// fingerprint (NamespaceStats); a fingerprint with none is not kept.
	byFP map[uint64]*fpCount
}

// fpCount is what the index holds of one namespace fingerprint.
type fpCount struct {
	files, keys int
	bytes       int64
}

func newIndex(sp *space) *index {
	return &index{
		sp:        sp,
		entries:   map[uint64]*entry{},
		byKey:     map[keyID]keyRef{},
		byPath:    map[string]*entry{},
		inflight:  map[string]*flight{},
		reads:     map[string][]*readMark{},
		left:      map[string]*entry{},
		removing:  map[*entry]struct{}{},
		heldOrder: map[int][]*entry{},
		byFP:      map[uint64]*fpCount{},
	}
}

// countOf returns fp's counts, made where it has none.
func (ix *index) countOf(fp uint64) *fpCount {
	c := ix.byFP[fp]
	if c == nil {
		c = &fpCount{}
		ix.byFP[fp] = c
	}
	return c
}

// holds reports whether the index holds a file or key of fingerprint fp.
func (ix *index) holds(fp uint64) bool {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.holdsLocked(fp)
}

// holdsLocked is holds, called with ix.mu held.
func (ix *index) holdsLocked(fp uint64) bool {
	c := ix.byFP[fp]
	return c != nil && (c.files > 0 || c.keys > 0)
}

// holdsAnyLocked reports whether the index holds a file or key of a
// fingerprint of fps. Called with ix.mu held.
func (ix *index) holdsAnyLocked(fps map[uint64]int64) bool {
	for fp := range fps {
		if ix.holdsLocked(fp) {
			return true
		}
	}
	return false
}

// dropEmptyLocked forgets fp's counts once it has nothing indexed.
func (ix *index) dropEmptyLocked(fp uint64, c *fpCount) {
	if c.files == 0 && c.keys == 0 {
		delete(ix.byFP, fp)
	}
}

// fingerprintCounts returns the files, keys and bytes indexed of each
// namespace fingerprint that has any.
func (ix *index) fingerprintCounts() map[uint64]fpCount {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	out := make(map[uint64]fpCount, len(ix.byFP))
	for fp, c := range ix.byFP {
		out[fp] = *c
	}
	return out
}

// heldFoundLocked is the number of indexed entries the restart hold pins.
func (ix *index) heldFoundLocked() int {
	return ix.heldN
}

// getLocked is the entry holding key of fingerprint fp, or nil.
func (ix *index) getLocked(fp uint64, key []byte) *entry {
	if ref, ok := ix.byKey[keyID{fp, string(key)}]; ok {
		return ref.e
	}
	return nil
}

// get is getLocked taking the lock.
func (ix *index) get(fp uint64, key []byte) *entry {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.getLocked(fp, key)
}

// getAll is getLocked for the keys of the request indices idx (all keys
// where idx is nil), under one hold of the lock: the entry of the i-th
// is the i-th (nil: none).
func (ix *index) getAll(fp uint64, keys [][]byte, idx []int) []*entry {
	n := len(keys)
	if idx != nil {
		n = len(idx)
	}
	found := make([]*entry, n)
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

// gone reports whether en is no longer indexed.
func (ix *index) gone(en *entry) bool {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return en.gone
}

// insertLocked indexes en, replacing any entry at its path or holding its
// keys (returned, already unindexed; their files are gone). reserved: the
// file's bytes are a reservation already counted on its mount.
func (ix *index) insertLocked(en *entry, reserved bool) []*entry {
	var replaced []*entry
	if old := ix.byPath[en.path]; old != nil {
		ix.unindexLocked(old, false)
		replaced = append(replaced, old)
	}
	if old := ix.left[en.path]; old != nil { // this file took its place
		delete(ix.left, en.path)
		ix.nleft.Add(-1)
		ix.sp.free(ix.sp.mounts[old.mount], old.size, false)
	}
	ix.lastID++
	en.id = ix.lastID
	ix.entries[en.id] = en
	ix.byPath[en.path] = en
	c := ix.countOf(en.fp)
	c.files++
	c.bytes += en.size
	for i, k := range en.keys {
		_, had := ix.byKey[keyID{en.fp, k}]
		ix.byKey[keyID{en.fp, k}] = keyRef{e: en, idx: i}
		if had { // a key taken from another file stays
			continue
		}
		c.keys++
		if ix.keys != nil {
			ix.keys.Add(en.fp, k)
		}
	}
	ix.sp.indexed(ix.sp.mounts[en.mount], en.size, reserved)
	return replaced
}

// relinkLocked indexes en again for those of its keys that the index does
// not find (the key's entry pointed at another file, since dropped). It
// reports false if en is no longer indexed.
func (ix *index) relinkLocked(en *entry) bool {
	if en.gone {
		return false
	}
	for i, k := range en.keys {
		if _, ok := ix.byKey[keyID{en.fp, k}]; !ok {
			ix.byKey[keyID{en.fp, k}] = keyRef{e: en, idx: i}
			ix.countOf(en.fp).keys++
			if ix.keys != nil {
				ix.keys.Add(en.fp, k)
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
func (ix *index) unindexLocked(en *entry, remove bool) bool {
	if en.gone {
		return false
	}
	en.gone = true
	if en.file.Load() != nil {
		ix.keepPinnedLocked(en)
	}
	if en.held { // the restart hold lets it go now
		ix.unholdLocked(en)
	}
	delete(ix.entries, en.id)
	if ix.byPath[en.path] == en {
		delete(ix.byPath, en.path)
	}
	c := ix.countOf(en.fp)
	c.files--
	c.bytes -= en.size
	defer ix.dropEmptyLocked(en.fp, c)
	for _, k := range en.keys {
		if ref, ok := ix.byKey[keyID{en.fp, k}]; ok && ref.e == en {
			delete(ix.byKey, keyID{en.fp, k})
			c.keys--
			if ix.keys != nil {
				ix.keys.Remove(en.fp, k)
			}
		}
	}
	if remove {
		ix.removing[en] = struct{}{}
	} else {
		ix.sp.unindexed(ix.sp.mounts[en.mount], en.size, false, false)
	}
	return true
}

// holdLocked pins en for the restart hold (hold.go): each file found at
// start, and the copy of a held file that a demotion moved (moveEntry),
// which keeps the hold's pin.
func (ix *index) holdLocked(en *entry) {
	en.held = true
	en.pins++
	ix.heldN++
	ix.heldOrder[en.mount] = append(ix.heldOrder[en.mount], en)
}

// unholdLocked ends the restart hold's pin of en, which it holds; en
// stays in heldOrder until the hold ends.
func (ix *index) unholdLocked(en *entry) {
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
func (ix *index) inHeldChunks(mnt int, fn func(*entry)) {
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
func (ix *index) inChunks(ens []*entry, fn func(*entry)) {
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
func (en *entry) movePins(held bool) int32 {
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
func (ix *index) dropLocked(en *entry, remove bool) (was, claimed bool) {
	if !ix.unindexLocked(en, remove) {
		return false, false
	}
	if !remove {
		return true, false
	}
	claimed, fl := ix.claimLocked(en.path)
	if !claimed {
		fl.orphans = append(fl.orphans, en)
		en.orphan = true
	}
	ix.sp.unindexed(ix.sp.mounts[en.mount], en.size, true, en.orphan)
	return true, claimed
}

// leaveLocked records that the file of en, dropped from the index, could
// not be removed and is at path at: its mount goes on counting its bytes
// as used, no longer as an orphan's (no job removes it now).
func (ix *index) leaveLocked(en *entry, at string) {
	if en.orphan {
		en.orphan = false
		ix.sp.unorphan(ix.sp.mounts[en.mount], en.size)
	}
	delete(ix.removing, en) // its removal is over: en is left
	switch old := ix.left[at]; {
	case old == nil:
		ix.nleft.Add(1)
	case old != en: // one file at a path
		ix.sp.free(ix.sp.mounts[old.mount], old.size, false)
	}
	ix.left[at] = en
}

// leaveSpare records that the spare file at path, of size bytes on mount,
// which the mount no longer counts (taken from its spares, or made and
// not kept), or a temporary file not published (removeTemp), could not
// be removed: like a dropped file's (leaveLocked), its bytes count as
// used until an eviction there removes it (retryLeft).
func (ix *index) leaveSpare(mount int, path string, size int64) {
	en := &entry{mount: mount, path: path, size: size, spare: true}
	en.removeFailed.Store(true)
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.sp.left(ix.sp.mounts[mount], size)
	ix.leaveLocked(en, path)
}

// leave is leaveLocked taking the lock.
func (ix *index) leave(en *entry, at string) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.leaveLocked(en, at)
}

// releaseLeaving is release for a holder that has just tried to remove
// the file of one of ens: left (nil: none) is the one whose file is still
// there, at at (leaveLocked); the others are freed.
func (ix *index) releaseLeaving(path string, ens []*entry, left *entry, at string) (*flight, []*entry) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	freed := ens
	if left != nil {
		freed = slices.DeleteFunc(slices.Clone(ens), func(en *entry) bool { return en == left })
		ix.leaveLocked(left, at)
	}
	return ix.releaseLocked(path, freed)
}

// releaseKept is release for the holder of the path of en, evicted,
// whose file it has just kept as a spare (evictClaimed): en's removal is
// over, its bytes counted as the spare's.
func (ix *index) releaseKept(path string, en *entry) (*flight, []*entry) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	delete(ix.removing, en)
	return ix.releaseLocked(path, nil)
}

// takeLeft takes from left the entries that want accepts (those of a
// mount due a try: retryLeft; those of a namespace: Purge) whose path it
// claims (none that a job holds now), by path, for the caller to remove
// and release (removeAt); each is next due next. Where left is empty it
// returns without taking the lock.
func (ix *index) takeLeft(want func(*entry) bool, next int64) map[string]*entry {
	if ix.nleft.Load() == 0 {
		return nil
	}
	ix.mu.Lock()
	defer ix.mu.Unlock()
	var took map[string]*entry
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
			took = map[string]*entry{}
		}
		took[at] = en
	}
	return took
}

// each calls fn for every indexed entry, under the index's lock held for
// reading: fn reads the entry's fields and calls nothing of the engine
// (the policy's view, a rebuild's or a reload's walk).
func (ix *index) each(fn func(*entry)) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	for _, en := range ix.entries {
		fn(en)
	}
}

// insertAll indexes the entries found at Open (rebuild), in order: where
// two files hold one key, the later wins it.
func (ix *index) insertAll(ens []*entry) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	for _, en := range ens {
		ix.insertLocked(en, false)
	}
}

// hit counts a hit at now on each of ens and returns the policy's
// records of them.
func (ix *index) hit(ens []*entry, now int64) []abi.AccessRecord {
	recs := make([]abi.AccessRecord, len(ens))
	ix.mu.Lock()
	defer ix.mu.Unlock()
	for i, en := range ens {
		en.hits++
		en.last = now
		recs[i] = en.access(abi.AccessHit, now)
	}
	return recs
}

// unpinClient drops one client pin of each of ens (Engine.Pin) and, with
// tell, returns the policy's unpin records of those still indexed. It
// also returns the files held open for pins that no pin holds now
// (entry.file), for the caller to release once mu is let go.
func (ix *index) unpinClient(ens []*entry, now int64, tell bool) ([]abi.AccessRecord, []*pinnedFile) {
	var recs []abi.AccessRecord
	var files []*pinnedFile
	ix.mu.Lock()
	defer ix.mu.Unlock()
	for _, en := range ens {
		en.pins--
		en.leases--
		if tell && !en.gone {
			recs = append(recs, en.access(abi.AccessUnpin, now))
		}
		if pf := en.file.Load(); en.leases == 0 && pf != nil {
			files = append(files, pf)
			en.file.Store(nil)
			ix.unkeepPinnedLocked(en)
		}
	}
	return recs, files
}

// unkeepPinned takes en out of pinnedGone, if there: loads of its keys no
// longer read its file, which stays open until its client pins end (a
// file found corrupt: loadFile). It takes mu.
func (ix *index) unkeepPinned(en *entry) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.unkeepPinnedLocked(en)
}

// unkeepPinnedLocked is unkeepPinned for a caller that holds mu.
func (ix *index) unkeepPinnedLocked(en *entry) {
	for _, k := range en.keys {
		id := keyID{en.fp, k}
		if ens := slices.DeleteFunc(ix.pinnedGone[id], func(o *entry) bool { return o == en }); len(ens) > 0 {
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
func (ix *index) holdOpenLocked(en *entry, pf *pinnedFile) bool {
	if en.file.Load() != nil || en.leases <= 0 {
		return false
	}
	en.file.Store(pf)
	if en.gone {
		ix.keepPinnedLocked(en)
	}
	return true
}

// keepPinnedLocked lists en, gone from the index and held open for its
// client pins, in pinnedGone under its keys. The caller holds mu.
func (ix *index) keepPinnedLocked(en *entry) {
	if ix.pinnedGone == nil {
		ix.pinnedGone = map[keyID][]*entry{}
	}
	for _, k := range en.keys {
		id := keyID{en.fp, k}
		if !slices.Contains(ix.pinnedGone[id], en) {
			ix.pinnedGone[id] = append(ix.pinnedGone[id], en)
		}
	}
}

// pinnedGoneLocked returns an entry of key that its client pins hold open
// although it left the index (pinnedGone; the latest kept of those), or
// nil. The caller holds mu.
func (ix *index) pinnedGoneLocked(fp uint64, key []byte) *entry {
	if len(ix.pinnedGone) == 0 {
		return nil // no key kept: every load's case but while pins hold removed files
	}
	if ens := ix.pinnedGone[keyID{fp, string(key)}]; len(ens) > 0 {
		return ens[len(ens)-1]
	}
	return nil
}

// release is releaseLocked taking the lock.
func (ix *index) release(path string, freed []*entry) (*flight, []*entry) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	return ix.releaseLocked(path, freed)
}

// mirror makes ks the index's KeySet: it is told every key now and every
// change from then on (nil: none).
func (ix *index) mirror(ks KeySet) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.keys = ks
	if ks == nil {
		return
	}
	for k := range ix.byKey {
		ks.Add(k.fp, k.key)
	}
}

// size returns how many files and keys the index holds.
func (ix *index) size() (files, keys int) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return len(ix.entries), len(ix.byKey)
}

// policyEntry returns the policy's view of entry id.
func (ix *index) policyEntry(id uint64) (policy.Entry, bool) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	en, ok := ix.entries[id]
	if !ok {
		return policy.Entry{}, false
	}
	return en.policyEntry(), true
}

// policyEntries returns the policy's view of every entry, a snapshot.
func (ix *index) policyEntries() []policy.Entry {
	var snap []policy.Entry
	ix.each(func(en *entry) { snap = append(snap, en.policyEntry()) })
	return snap
}

// records returns an access record of kind for every entry, at its last
// access.
func (ix *index) records(kind uint32) []abi.AccessRecord {
	var recs []abi.AccessRecord
	ix.each(func(en *entry) { recs = append(recs, en.access(kind, en.last)) })
	return recs
}

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

func (en *entry) policyEntry() policy.Entry {
	pins := en.pins
	if en.lifted {
		pins--
	}
	return policy.Entry{
		ID: en.id, KeyHash: abi.KeyHash([]byte(en.keys[0])), Size: uint64(en.size), Mount: uint32(en.mount),
		NS: uint32(en.ns), LastAccess: uint64(en.last), Hits: en.hits, Pins: uint32(pins),
	}
}

func (en *entry) access(kind uint32, t int64) abi.AccessRecord {
	return abi.AccessRecord{
		Entry: en.id, Time: uint64(t), Size: uint64(en.size), KeyHash: abi.KeyHash([]byte(en.keys[0])),
		Kind: kind, Mount: uint32(en.mount), NS: uint32(en.ns), Hits: en.hits,
	}
}

// sameKeys reports whether en and o hold the same keys of one namespace
// fingerprint, at the same positions, in files of one size: the same KV,
// whichever node wrote each file.
func (en *entry) sameKeys(o *entry) bool {
	return en.fp == o.fp && en.size == o.size && slices.Equal(en.keys, o.keys)
}

func (en *entry) match(fp uint64, key []byte) (int, error) {
	if en.fp != fp {
		return -1, fmt.Errorf("%w: %w: file 0x%016x, want 0x%016x", ErrMismatch, format.ErrFingerprint, en.fp, fp)
	}
	for i, k := range en.keys {
		if k == string(key) {
			return i, nil
		}
	}
	return -1, fmt.Errorf("%w: %w", ErrMismatch, format.ErrKey)
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

// currentLocked returns the entry that holds key now if en, found for
// it, was moved meanwhile (unindexed, and the key's entry is a copy of the
// same file: the same header id, or the file at the target that the move
// dropped en for: its heir); otherwise en. The caller holds index.mu.
func (ix *index) currentLocked(en *entry, key []byte) *entry {
	if !en.gone || en.fid == 0 && en.heir == nil {
		return en
	}
	if cur := ix.getLocked(en.fp, key); cur != nil && !cur.gone && (en.fid != 0 && cur.fid == en.fid || cur == en.heir) {
		return cur
	}
	return en
}

// handOverLocked points every key that the index finds in from at to, a
// file of the same keys (the same fingerprint, at the same positions), and
// makes to from's heir: unindexing from then leaves its keys indexed, and
// in the key set (MirrorKeys), whose misses a client may take for final.
func (ix *index) handOverLocked(from, to *entry) {
	for i, k := range from.keys {
		id := keyID{from.fp, k}
		if ref, ok := ix.byKey[id]; ok && ref.e == from {
			ix.byKey[id] = keyRef{e: to, idx: i}
		}
	}
	from.heir = to
}
