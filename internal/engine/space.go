package engine

import (
	"cmp"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/kvhost/kvhost/fsys"
)

// space is the room on every mount: each mount's capacity and watermarks,
// the bytes its files, reservations and orphans take (used), its spare
// files and the spares made ahead of stores, and whether the spare maker
// has work. It is the bottom of the engine: it calls nothing else in the
// package, does no I/O and never calls the policy.
//
// Lock order: mount.evictMu > Engine.mu > index.mu > space.mu. Nothing
// holding space.mu takes another of the engine's locks. One mutex guards
// every mount: the spare maker decides across mounts, and before the
// split every mount's accounting was under the engine's lock.
//
// Invariants (check), for every mount, with mu held:
//   - 0 <= orphaned <= used; entries >= 0;
//   - 0 <= low <= high <= capacity;
//   - spareBytes is the sum of the spares' sizes, madeBytes that of the
//     spares made ahead (zeroed) among them; no size maps to an empty
//     list, and every spare is listed under its own size.
//
// What used holds beside the indexed files (reservations of stores and
// moves in flight, files being removed) is only known above: the
// Engine's check at rest compares used with the index.
type space struct {
	mu     sync.Mutex
	mounts []*mountSpace
	// closed: the engine is closing: no spare is kept or made.
	closed bool
	// quiet is closed while the spare maker has nothing to do
	// (WaitSpares); replaced by an open channel when work appears. Nil
	// without a maker.
	quiet chan struct{}
}

// mountSpace is one mount's room. Fields from capacity on are guarded by
// space.mu; the others are fixed at Open (reportMounts sets ahead,
// aheadFiles and aheadMax before any job).
type mountSpace struct {
	idx  int
	root string
	// configured is Mount.Capacity (0: the file system's size); reserve
	// is Mount.Reserve; highF and lowF the watermarks as fractions.
	configured, reserve int64
	derived             bool // configured was computed, not given (Mount.CapacityDerived)
	highF, lowF         float64
	// ahead is Mount.Preallocate (PreallocateAuto resolved at Open,
	// reportMounts; 0 where the mount keeps no spares), and aheadFiles the
	// most spares of a size it keeps (MaxAutoSpareFiles for
	// PreallocateAuto; 0: no bound but ahead's).
	ahead      int64
	aheadFiles int
	// aheadMax is the most the budget grows to after bursts of stores
	// larger than ahead (AutoPreallocateMax for PreallocateAuto; 0 where
	// a size was given: that budget is fixed).
	aheadMax int64

	// guarded by space.mu
	capacity  int64 // effective: min(configured, what the file system can hold)
	high, low int64
	// used is the bytes of the mount's indexed files, of reservations
	// (stores and moves in flight), of files dropped from the index
	// and not yet removed, and of spares and temporary files whose
	// removal failed.
	used int64
	// orphaned is the part of used that orphans hold: files dropped from
	// the index while another job held their path, which that job
	// removes when it lets the path go (flight.go). They are on their way
	// out: an eviction frees room down to the low watermark without them,
	// but no less than a store needs beside them below the capacity.
	orphaned  int64
	entries   int       // indexed files
	refreshed time.Time // last capacity refresh from statfs
	// spares are evicted files kept for stores to write into, by size
	// (spares.go; a size is present only with files); spareBytes is
	// their total. They are not part of used. madeBytes is the spares
	// made ahead among them (of any size).
	spares                map[int64][]spareFile
	spareBytes, madeBytes int64
	// aheadNS is what each namespace's declaration and stores say about
	// its files here (ahead.go: wantSparesLocked, predictSparesLocked;
	// dropped at Release, and where making one of its size failed).
	aheadNS map[NamespaceID]nsAhead
	// burst is the bytes of the stores reserved on the mount since it was
	// last quiet (a mount that makes spares ahead); grown is what earlier
	// bursts left the budget at (budgetLocked, endBurstLocked).
	burst, grown int64
	lastAdd      int64 // when the last store was added to the burst (UnixNano)
	// movedIn and movedOut count the files moved to and from the mount
	// (demotions, promotions, tick moves).
	movedIn, movedOut uint64
}

// spareFile is a spare: its name and the identity of the file.
type spareFile struct {
	path string
	id   fsys.Identity
	// zeroed: made ahead of stores (ahead.go), never written: every
	// byte is zero and no reader has it open.
	zeroed bool
}

// sizeSource is what set the size of a namespace's files on a mount.
type sizeSource uint8

const (
	sizeUnknown sizeSource = iota
	sizeGuessed            // a declaration (predictSparesLocked)
	sizePartial            // a stored file of fewer keys than a group
	sizeWhole              // a stored file of a whole group of keys
)

// nsAhead is what a namespace's declaration and stores say about the
// files it stores on a mount that makes spares ahead: their size (0:
// unknown), and what set it.
type nsAhead struct {
	size   int64
	from   sizeSource
	failed bool
}

// fsCapacity is the capacity of ms given what statfs says and used, the
// bytes the engine holds on it: the configured capacity (or the file
// system's size), but at most what the file system can hold for us, free
// space plus our own files, minus the reserve.
func (ms *mountSpace) fsCapacity(st fsys.StatFS, used int64) int64 {
	if st.Total == 0 {
		// A file system that counts no blocks (ramfs): statfs says
		// nothing of what it can hold, and the configured capacity is
		// all there is (Open refuses such a mount without one).
		return ms.configured
	}
	c := ms.configured
	if c == 0 {
		c = st.Total
	}
	return max(0, min(c, st.Avail+used-ms.reserve))
}

// setCapacityLocked sets the effective capacity and the watermarks.
func (ms *mountSpace) setCapacityLocked(c int64) {
	ms.capacity = c
	ms.high = int64(float64(c) * ms.highF)
	ms.low = int64(float64(c) * ms.lowF)
}

// refreshDue reports whether ms's capacity is due a refresh from statfs
// at now (at most once a second unless force) and, if so, marks it
// refreshed.
func (s *space) refreshDue(ms *mountSpace, now time.Time, force bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !force && now.Sub(ms.refreshed) < time.Second {
		return false
	}
	ms.refreshed = now
	return true
}

// refresh sets ms's capacity from statfs. Space of stores in flight is
// part of used but not yet (all) taken from the file system, and a file
// just removed is free there while used counts it until its remover
// uncounts it: counting them as ours errs towards a larger capacity,
// which an ENOSPC then corrects (the store's retry refreshes under the
// eviction lock, out of the evictions' removals). notOnDisk is bytes of
// used known to hold nothing on the file system: the reservation of the
// store whose file the ENOSPC removed, which would otherwise count as
// room the file system has (and so leave nothing to evict for the
// retry).
func (s *space) refresh(ms *mountSpace, st fsys.StatFS, notOnDisk int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ms.setCapacityLocked(ms.fsCapacity(st, ms.used+ms.spareBytes-notOnDisk))
}

// reserveBelow accounts size bytes on ms if used stays at or below
// limit(ms), and reports whether it did.
func (s *space) reserveBelow(ms *mountSpace, size int64, limit func(*mountSpace) int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ms.used+size <= limit(ms) {
		ms.used += size
		return true
	}
	return false
}

// fits reports whether size bytes fit on ms below limit now: reserveBelow
// without the reservation.
func (s *space) fits(ms *mountSpace, size int64, limit func(*mountSpace) int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return ms.used+size <= limit(ms)
}

// high and capacity are the limits of reserveBelow.
func high(ms *mountSpace) int64     { return ms.high }
func capacity(ms *mountSpace) int64 { return ms.capacity }

// unreserve gives back size bytes reserved on ms that no file took, and
// reports whether the spare maker then has work.
func (s *space) unreserve(ms *mountSpace, size int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	ms.used -= size
	return s.spareWorkLocked()
}

// free uncounts size bytes of a file removed from ms (orphan: counted in
// orphaned too). The caller may hold index.mu.
func (s *space) free(ms *mountSpace, size int64, orphan bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ms.used -= size
	if orphan {
		ms.orphaned -= size
	}
}

// left counts size bytes of a spare of ms, no longer among its spares,
// or of a temporary file not published, as used: its removal failed
// (index.leaveSpare).
func (s *space) left(ms *mountSpace, size int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ms.used += size
}

// unorphan uncounts size bytes of an orphan of ms from orphaned: its
// removal failed, and its bytes stay in used (index.leaveLocked).
func (s *space) unorphan(ms *mountSpace, size int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ms.orphaned -= size
}

// indexed counts a file of size bytes indexed on ms; reserved: its bytes
// are those of a reservation, already in used. Called by the index.
func (s *space) indexed(ms *mountSpace, size int64, reserved bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !reserved {
		ms.used += size
	}
	ms.entries++
}

// unindexed uncounts a file of size bytes dropped from ms's index.
// removing: its file is still there, on its way out, and counts as used
// until removed (free); orphan: another job holds its path and removes
// it, so it also counts in orphaned. Called by the index.
func (s *space) unindexed(ms *mountSpace, size int64, removing, orphan bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ms.entries--
	if !removing {
		ms.used -= size
	}
	if orphan {
		ms.orphaned += size
	}
}

// moved counts a file moved from src to dst: its entry left src's index
// (its bytes count as used on src until the source is removed: free) and
// its copy, indexed on dst, holds the reservation made there.
func (s *space) moved(src, dst *mountSpace) {
	s.mu.Lock()
	defer s.mu.Unlock()
	src.movedOut++
	src.entries--
	dst.movedIn++
}

// need is how many bytes an eviction on ms must free for a file of size
// bytes: down to the low watermark without the orphans (on their way
// out), unless the file would not fit beside them below the capacity.
func (s *space) need(ms *mountSpace, size int64) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return max(ms.used-ms.orphaned+size-ms.low, ms.used+size-ms.capacity)
}

// usage returns ms's used bytes and capacity.
func (s *space) usage(ms *mountSpace) (used, capacity int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return ms.used, ms.capacity
}

// usage is a mount's room at one moment (space.usages).
type usage struct {
	capacity, configured, reserve, high, low, used int64
	entries, spareFiles                            int
	spareBytes, ahead                              int64
	movedIn, movedOut                              uint64
}

// usages returns every mount's room, by mount index, in one hold of the
// lock (Stats, the policy's mount descriptions).
func (s *space) usages() []usage {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]usage, len(s.mounts))
	for i, ms := range s.mounts {
		out[i] = usage{
			capacity: ms.capacity, configured: ms.configured, reserve: ms.reserve, high: ms.high, low: ms.low, used: ms.used,
			entries: ms.entries, spareFiles: ms.spareFilesLocked(), spareBytes: ms.spareBytes, ahead: ms.budgetLocked(),
			movedIn: ms.movedIn, movedOut: ms.movedOut,
		}
	}
	return out
}

// close marks the space closed: no spare is kept or made from now on.
func (s *space) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
}

// Spares (spares.go).

// spareFilesLocked counts ms's spares.
func (ms *mountSpace) spareFilesLocked() int {
	n := 0
	for _, list := range ms.spares {
		n += len(list)
	}
	return n
}

// addSpareLocked adds sf to ms's spares.
func (ms *mountSpace) addSpareLocked(sf spareFile) {
	if ms.spares == nil {
		ms.spares = map[int64][]spareFile{}
	}
	ms.spares[sf.id.Size] = append(ms.spares[sf.id.Size], sf)
	ms.spareBytes += sf.id.Size
	if sf.zeroed {
		ms.madeBytes += sf.id.Size
	}
}

// removeSpareLocked removes sf from ms's spares, if it is one.
func (ms *mountSpace) removeSpareLocked(sf spareFile) {
	size := sf.id.Size
	list := ms.spares[size]
	i := slices.IndexFunc(list, func(x spareFile) bool { return x.path == sf.path })
	if i < 0 {
		return
	}
	if i == 0 { // the oldest (takeSpareLocked): no copy
		list = list[1:]
	} else {
		list = append(list[:i:i], list[i+1:]...)
	}
	if len(list) == 0 {
		delete(ms.spares, size)
	} else {
		ms.spares[size] = list
	}
	ms.spareBytes -= size
	if sf.zeroed {
		ms.madeBytes -= size
	}
}

// takeSpareLocked removes from ms's spares one of exactly size bytes and
// returns it, or one with no path if there is none. It takes the oldest:
// the GPU path registers a spare in the background after it is kept or
// made, and the oldest has had the longest to be registered.
func (ms *mountSpace) takeSpareLocked(size int64) spareFile {
	list := ms.spares[size]
	if len(list) == 0 {
		return spareFile{}
	}
	sf := list[0]
	ms.removeSpareLocked(sf)
	return sf
}

// sparesFitLocked reports whether ms's files, reservations and spares fit
// in its capacity.
func (ms *mountSpace) sparesFitLocked() bool { return ms.used+ms.spareBytes <= ms.capacity }

// keepSpare adds sf, the file of an evicted entry whose evicted bytes ms
// still counts as used, to ms's spares if it fits beside the files,
// reservations and spares in the capacity and the space is not closed;
// the bytes then move from used to the spares. It reports whether it
// kept it.
func (s *space) keepSpare(ms *mountSpace, sf spareFile, evicted int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || ms.used-evicted+ms.spareBytes+sf.id.Size > ms.capacity {
		return false
	}
	ms.used -= evicted
	ms.addSpareLocked(sf)
	return true
}

// trimOne takes one of ms's spares for the caller to remove, unless
// enough reports true (called with space.mu held) or none is left.
func (s *space) trimOne(ms *mountSpace, enough func(*mountSpace) bool) (spareFile, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(ms.spares) == 0 || enough(ms) {
		return spareFile{}, false
	}
	for size := range ms.spares {
		return ms.takeSpareLocked(size), true
	}
	return spareFile{}, false
}

// Spares made ahead of stores (ahead.go).

// setAheadLocked records what namespace ns says about its files on ms.
func (ms *mountSpace) setAheadLocked(ns NamespaceID, a nsAhead) {
	if ms.aheadNS == nil {
		ms.aheadNS = map[NamespaceID]nsAhead{}
	}
	ms.aheadNS[ns] = a
}

// budgetLocked is the bytes of spares ms makes ahead now: Preallocate,
// or more where bursts of stores were larger (at most aheadMax), the
// burst in progress included. A workload whose bursts outgrow the spares
// writes the rest of each burst into fresh files, which the GPU path
// moves through its pinned buffers; spares sized to the bursts it shows
// take whole bursts (docs/engine.md, "Spare files made ahead").
func (ms *mountSpace) budgetLocked() int64 {
	return min(max(ms.ahead, ms.grown, ms.burst), max(ms.ahead, ms.aheadMax))
}

// followsBursts reports whether ms's budget grows after bursts of stores
// (PreallocateAuto with room above its starting budget); fixed at Open.
func (ms *mountSpace) followsBursts() bool { return ms.aheadMax > ms.ahead }

// addBurstLocked counts a store of size bytes reserved on ms at now
// (UnixNano); the caller checked followsBursts. The maker ends the burst
// once the engine is quiet (endBursts): a burst pending is work for it.
func (ms *mountSpace) addBurstLocked(size, now int64) {
	ms.burst += size
	ms.lastAdd = now
}

// endBurstLocked ends the burst in progress, if any: the budget keeps the
// larger of it and three quarters of what it was, so that it follows the
// largest recent bursts down a quarter per burst. Only a mount that
// follows bursts has one (addBurstLocked).
func (ms *mountSpace) endBurstLocked() {
	if ms.burst == 0 {
		return
	}
	ms.grown = min(ms.aheadMax, max(ms.burst, ms.grown-ms.grown/4))
	ms.burst = 0
}

// burstPendingLocked reports whether a mount has a burst to fold in
// (endBursts): work for the maker once the engine is quiet, whether or not
// it then makes a spare.
func (s *space) burstPendingLocked() bool {
	for _, ms := range s.mounts {
		if ms.burst > 0 {
			return true
		}
	}
	return false
}

// endBursts ends every mount's burst in progress at now (UnixNano), the
// engine having been quiet for quiet: a mount whose last store came
// within quiet before now (one that began after the quiet moment was
// seen) keeps its burst for the next one, so that one burst is not
// ended twice.
func (s *space) endBursts(now int64, quiet time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, ms := range s.mounts {
		if now-ms.lastAdd > int64(quiet) {
			ms.endBurstLocked()
		}
	}
}

// aheadTargetsLocked returns the bytes of spares of each size ms makes
// ahead: Preallocate split evenly between the namespaces whose file size
// on ms is known, each share going to its namespace's size.
func (ms *mountSpace) aheadTargetsLocked() map[int64]int64 {
	k := int64(0)
	for _, a := range ms.aheadNS {
		if a.size > 0 {
			k++
		}
	}
	if k == 0 {
		return nil
	}
	t := make(map[int64]int64, k)
	budget := ms.budgetLocked()
	for _, a := range ms.aheadNS {
		if a.size > 0 {
			t[a.size] += budget / k
		}
	}
	return t
}

// failedLocked reports whether every namespace of size on ms failed to get one.
func (ms *mountSpace) failedLocked(size int64) bool {
	for _, a := range ms.aheadNS {
		if a.size == size && !a.failed {
			return false
		}
	}
	return true
}

// aheadWantLocked is how many spares of size ms keeps for target bytes:
// as many as fit in them, at most aheadFiles where that bounds them.
func (ms *mountSpace) aheadWantLocked(size, target int64) int {
	n := int(target / size)
	if ms.aheadFiles > 0 {
		n = min(n, ms.aheadFiles)
	}
	return n
}

// madeFitsLocked reports whether one more spare of size made ahead stays
// within Preallocate and, beside ms's files, reservations and spares,
// below the low watermark.
func (ms *mountSpace) madeFitsLocked(size int64) bool {
	return ms.madeBytes+size <= ms.budgetLocked() && ms.used+ms.spareBytes+size <= ms.low
}

// excessMadeLocked returns the bytes of ms's spares made ahead beyond
// their sizes' shares (targets), of sizes other than size, and one of
// them (the made spares of a size beyond its share: at most as many as
// its spares beyond what the share holds).
func (ms *mountSpace) excessMadeLocked(targets map[int64]int64, size int64) (spareFile, int64) {
	var one spareFile
	var excess int64
	sizes := slices.Sorted(maps.Keys(ms.spares))
	for _, sz := range sizes {
		list := ms.spares[sz]
		if sz == size {
			continue
		}
		over := len(list) - ms.aheadWantLocked(sz, targets[sz])
		for _, sf := range list {
			if over <= 0 {
				break
			}
			if sf.zeroed {
				if one.path == "" {
					one = sf
				}
				excess += sz
				over--
			}
		}
	}
	return one, excess
}

// nextSpareLocked returns the mount whose spares the maker should work
// on, or nil, the size of the spare to make there, and a made spare
// beyond its size's share to remove first (no path: make one of size). A
// mount wants a spare of a size while its spares of that size (made or
// evicted) are fewer than that size's share of Preallocate holds (and
// than aheadFiles, where that bounds them), the spares it made ahead (of
// any size) leave room for one more within Preallocate, and one more
// stays below the low watermark. Of the sizes that want one, the one with
// the least of its share comes first.
func (s *space) nextSpareLocked() (*mountSpace, int64, spareFile) {
	if s.closed {
		return nil, 0, spareFile{}
	}
	for _, ms := range s.mounts {
		if ms.ahead <= 0 {
			continue
		}
		targets := ms.aheadTargetsLocked()
		type cand struct {
			size int64
			f    float64
		}
		var cands []cand
		for sz, target := range targets {
			if ms.failedLocked(sz) {
				continue
			}
			want := ms.aheadWantLocked(sz, target)
			have := len(ms.spares[sz])
			if have >= want {
				continue // enough of that size
			}
			cands = append(cands, cand{sz, float64(have) / float64(want)})
		}
		slices.SortFunc(cands, func(a, b cand) int {
			if a.f != b.f {
				return cmp.Compare(a.f, b.f)
			}
			return cmp.Compare(a.size, b.size)
		})
		for _, c := range cands {
			size := c.size
			if ms.madeFitsLocked(size) {
				return ms, size, spareFile{}
			}
			// Made spares beyond their sizes' shares take the room:
			// remove them, but only where one of this size then fits
			// (else they would go for nothing).
			sf, excess := ms.excessMadeLocked(targets, size)
			if excess > 0 && ms.madeBytes-excess+size <= ms.budgetLocked() && ms.used+ms.spareBytes-excess+size <= ms.low {
				return ms, size, sf
			}
		}
	}
	return nil, 0, spareFile{}
}

// guessAhead records a declaration's guess of namespace ns's file size on
// ms, where ms knows nothing of ns yet, and reports whether the maker then
// has work (Engine.predictSparesLocked).
func (s *space) guessAhead(ms *mountSpace, ns NamespaceID, size int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ms.aheadNS[ns].from != sizeUnknown {
		return false
	}
	ms.setAheadLocked(ns, nsAhead{size: size, from: sizeGuessed})
	return s.spareWorkLocked()
}

// forgetAhead drops what every mount knows of released namespace ns's
// files, and reports whether the maker then has work.
func (s *space) forgetAhead(ns NamespaceID) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, ms := range s.mounts {
		delete(ms.aheadNS, ns)
	}
	return s.spareWorkLocked()
}

// failedAhead marks that making a spare of size on ms failed: not again
// until a namespace of that size stores there again (wantSparesLocked).
func (s *space) failedAhead(ms *mountSpace, size int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for ns, a := range ms.aheadNS {
		if a.size == size {
			a.failed = true
			ms.aheadNS[ns] = a
		}
	}
}

// keepMade adds sf, a spare just made ahead, to ms's spares if it still
// fits (madeFitsLocked: stores may have taken the room while it was
// made) and the space is not closed, and reports whether it did.
func (s *space) keepMade(ms *mountSpace, sf spareFile) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || !ms.madeFitsLocked(sf.id.Size) {
		return false
	}
	ms.addSpareLocked(sf)
	return true
}

// spareWorkOrQuiet reports whether the maker has a spare to make or
// remove; if not, it marks the maker quiet (WaitSpares returns), in the
// same step, so that work added after the look reopens it.
func (s *space) spareWorkOrQuiet() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ms, _, _ := s.nextSpareLocked(); ms != nil || s.burstPendingLocked() {
		return true
	}
	if !s.makerQuietLocked() {
		close(s.quiet)
	}
	return false
}

// nextSpare is nextSpareLocked, the made spare to remove first (if any)
// taken from the spares for the caller to remove.
func (s *space) nextSpare() (*mountSpace, int64, spareFile) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ms, size, stale := s.nextSpareLocked()
	if ms != nil && stale.path != "" {
		ms.removeSpareLocked(stale)
	}
	return ms, size, stale
}

// quietChan is the channel closed while the maker is quiet (WaitSpares).
func (s *space) quietChan() chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.quiet
}

// makerQuietLocked reports whether the maker found nothing to do when it
// last looked (and nothing marked it busy since).
func (s *space) makerQuietLocked() bool {
	select {
	case <-s.quiet:
		return true
	default:
		return false
	}
}

// spareWorkLocked reports whether the spare maker has work, and if so
// marks it busy for WaitSpares. False without a maker.
func (s *space) spareWorkLocked() bool {
	if s.quiet == nil {
		return false
	}
	if ms, _, _ := s.nextSpareLocked(); ms == nil && !s.burstPendingLocked() {
		return false
	}
	if s.makerQuietLocked() {
		s.quiet = make(chan struct{})
	}
	return true
}

// spareWork is spareWorkLocked taking the lock.
func (s *space) spareWork() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.spareWorkLocked()
}

// storeReserve is a store's step in the space, in one hold of the lock.
// With fast, it reserves size bytes on ms where they fit below the high
// watermark with the spares beside them below the capacity, and reports
// false (doing nothing else) where they do not: the caller then reserves
// by evicting (Engine.reserve) and calls it again without fast. Where
// spares, it then takes a spare of exactly size (none: the zero
// spareFile); with burst (not zero) it adds the store to ms's burst at
// that time; and where want is not nil it records size as the size of
// namespace ns's files (wantSparesLocked, with full) and reports in work
// whether the spare maker has work.
func (s *space) storeReserve(ms *mountSpace, size int64, fast, spares bool, burst int64, want *storeAhead) (reserved bool, sf spareFile, work bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if fast {
		if ms.used+size > ms.high || spares && ms.used+size+ms.spareBytes > ms.capacity {
			return false, sf, false
		}
		ms.used += size
	}
	if !spares {
		return true, sf, false
	}
	sf = ms.takeSpareLocked(size)
	if burst != 0 {
		ms.addBurstLocked(size, burst)
	}
	if want != nil {
		work = s.wantSparesLocked(ms, want.ns, size, want.full)
	}
	return true, sf, work
}

// storeAhead is what a store tells the spares made ahead: its
// namespace, declared, and whether its file holds a whole group of keys.
type storeAhead struct {
	ns   NamespaceID
	full bool
}

// wantSparesLocked records size, the size of a file of namespace ns
// stored on ms, for the spares made ahead (Engine.wantSpares says
// which size wins) and reports whether the maker has work. The caller
// holds mu.
func (s *space) wantSparesLocked(ms *mountSpace, ns NamespaceID, size int64, full bool) bool {
	was := ms.aheadNS[ns]
	a := was
	a.failed = false
	switch {
	case full:
		a = nsAhead{size: size, from: sizeWhole}
	case a.from < sizePartial || a.from == sizePartial && size > a.size:
		a = nsAhead{size: size, from: sizePartial}
	}
	if a == was && !s.makerQuietLocked() {
		// Nothing changed, and the maker already knows it has work (it
		// looks again once the files in flight end): a store of a burst
		// skips the shares' computation under the lock.
		return false
	}
	ms.setAheadLocked(ns, a)
	return s.spareWorkLocked()
}

// indexCounts is the space as the index tells it of its files
// (index.Space): by the mount's position.
type indexCounts struct{ s *space }

// Free implements index.Space.
func (c indexCounts) Free(mount int, size int64, orphan bool) {
	c.s.free(c.s.mounts[mount], size, orphan)
}

// Left implements index.Space.
func (c indexCounts) Left(mount int, size int64) { c.s.left(c.s.mounts[mount], size) }

// Unorphan implements index.Space.
func (c indexCounts) Unorphan(mount int, size int64) { c.s.unorphan(c.s.mounts[mount], size) }

// Indexed implements index.Space.
func (c indexCounts) Indexed(mount int, size int64, reserved bool) {
	c.s.indexed(c.s.mounts[mount], size, reserved)
}

// Unindexed implements index.Space.
func (c indexCounts) Unindexed(mount int, size int64, removing, orphan bool) {
	c.s.unindexed(c.s.mounts[mount], size, removing, orphan)
}

// Moved implements index.Space.
func (c indexCounts) Moved(from, to int) { c.s.moved(c.s.mounts[from], c.s.mounts[to]) }
