package space

import (
	"cmp"
	"maps"
	"slices"
	"time"

	"github.com/kvhost/kvhost/fsys"
)

// Spare is a spare file: its name and the identity of the file.
type Spare struct {
	Path string
	ID   fsys.Identity
	// Zeroed: made ahead of stores, never written: every byte is zero
	// and no reader has it open.
	Zeroed bool
}

// sizeSource is what set the size of a namespace's files on a mount.
type sizeSource uint8

const (
	sizeUnknown sizeSource = iota
	sizeGuessed            // a declaration (GuessAhead)
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

// spareFilesLocked counts ms's spares.
func (ms *Mount) spareFilesLocked() int {
	n := 0
	for _, list := range ms.spares {
		n += len(list)
	}
	return n
}

// addSpareLocked adds sf to ms's spares.
func (ms *Mount) addSpareLocked(sf Spare) {
	if ms.spares == nil {
		ms.spares = map[int64][]Spare{}
	}
	ms.spares[sf.ID.Size] = append(ms.spares[sf.ID.Size], sf)
	ms.spareBytes += sf.ID.Size
	if sf.Zeroed {
		ms.madeBytes += sf.ID.Size
	}
}

// removeSpareLocked removes sf from ms's spares, if it is one.
func (ms *Mount) removeSpareLocked(sf Spare) {
	size := sf.ID.Size
	list := ms.spares[size]
	i := slices.IndexFunc(list, func(x Spare) bool { return x.Path == sf.Path })
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
	if sf.Zeroed {
		ms.madeBytes -= size
	}
}

// takeSpareLocked removes from ms's spares one of exactly size bytes and
// returns it, or one with no path if there is none. It takes the oldest:
// the GPU path registers a spare in the background after it is kept or
// made, and the oldest has had the longest to be registered.
func (ms *Mount) takeSpareLocked(size int64) Spare {
	list := ms.spares[size]
	if len(list) == 0 {
		return Spare{}
	}
	sf := list[0]
	ms.removeSpareLocked(sf)
	return sf
}

// KeepSpare adds sf, the file of an evicted entry whose evicted bytes ms
// still counts as used, to ms's spares if it fits beside the files,
// reservations and spares in the capacity and the space is not closed;
// the bytes then move from used to the spares. It reports whether it
// kept it.
func (s *Space) KeepSpare(ms *Mount, sf Spare, evicted int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || ms.used-evicted+ms.spareBytes+sf.ID.Size > ms.capacity {
		return false
	}
	ms.used -= evicted
	ms.addSpareLocked(sf)
	return true
}

// TrimOne takes one of ms's spares for the caller to remove, and reports
// false where none is left or, unless all, where ms's files,
// reservations and spares fit in its capacity already.
func (s *Space) TrimOne(ms *Mount, all bool) (Spare, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(ms.spares) == 0 || !all && ms.used+ms.spareBytes <= ms.capacity {
		return Spare{}, false
	}
	for size := range ms.spares {
		return ms.takeSpareLocked(size), true
	}
	return Spare{}, false
}

// Spares made ahead of stores (the engine's ahead.go runs the maker).

// setAheadLocked records what namespace ns says about its files on ms.
func (ms *Mount) setAheadLocked(ns uint32, a nsAhead) {
	if ms.aheadNS == nil {
		ms.aheadNS = map[uint32]nsAhead{}
	}
	ms.aheadNS[ns] = a
}

// budgetLocked is the bytes of spares ms makes ahead now: Preallocate,
// or more where bursts of stores were larger (at most aheadMax), the
// burst in progress included. A workload whose bursts outgrow the spares
// writes the rest of each burst into fresh files, which the GPU path
// moves through its pinned buffers; spares sized to the bursts it shows
// take whole bursts (docs/engine.md, "Spare files made ahead").
func (ms *Mount) budgetLocked() int64 {
	return min(max(ms.ahead, ms.grown, ms.burst), max(ms.ahead, ms.aheadMax))
}

// addBurstLocked counts a store of size bytes reserved on ms at now
// (UnixNano); the caller checked FollowsBursts. The maker ends the burst
// once the engine is quiet (EndBursts): a burst pending is work for it.
func (ms *Mount) addBurstLocked(size, now int64) {
	ms.burst += size
	ms.lastAdd = now
}

// endBurstLocked ends the burst in progress, if any: the budget keeps the
// larger of it and three quarters of what it was, so that it follows the
// largest recent bursts down a quarter per burst. Only a mount that
// follows bursts has one (addBurstLocked).
func (ms *Mount) endBurstLocked() {
	if ms.burst == 0 {
		return
	}
	ms.grown = min(ms.aheadMax, max(ms.burst, ms.grown-ms.grown/4))
	ms.burst = 0
}

// burstPendingLocked reports whether a mount has a burst to fold in
// (EndBursts): work for the maker once the engine is quiet, whether or
// not it then makes a spare.
func (s *Space) burstPendingLocked() bool {
	for _, ms := range s.mounts {
		if ms.burst > 0 {
			return true
		}
	}
	return false
}

// EndBursts ends every mount's burst in progress at now (UnixNano), the
// engine having been quiet for quiet: a mount whose last store came
// within quiet before now (one that began after the quiet moment was
// seen) keeps its burst for the next one, so that one burst is not
// ended twice.
func (s *Space) EndBursts(now int64, quiet time.Duration) {
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
func (ms *Mount) aheadTargetsLocked() map[int64]int64 {
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
func (ms *Mount) failedLocked(size int64) bool {
	for _, a := range ms.aheadNS {
		if a.size == size && !a.failed {
			return false
		}
	}
	return true
}

// aheadWantLocked is how many spares of size ms keeps for target bytes:
// as many as fit in them, at most aheadFiles where that bounds them.
func (ms *Mount) aheadWantLocked(size, target int64) int {
	n := int(target / size)
	if ms.aheadFiles > 0 {
		n = min(n, ms.aheadFiles)
	}
	return n
}

// madeFitsLocked reports whether one more spare of size made ahead stays
// within Preallocate and, beside ms's files, reservations and spares,
// below the low watermark.
func (ms *Mount) madeFitsLocked(size int64) bool {
	return ms.madeBytes+size <= ms.budgetLocked() && ms.used+ms.spareBytes+size <= ms.low
}

// excessMadeLocked returns the bytes of ms's spares made ahead beyond
// their sizes' shares (targets), of sizes other than size, and one of
// them (the made spares of a size beyond its share: at most as many as
// its spares beyond what the share holds).
func (ms *Mount) excessMadeLocked(targets map[int64]int64, size int64) (Spare, int64) {
	var one Spare
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
			if sf.Zeroed {
				if one.Path == "" {
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
func (s *Space) nextSpareLocked() (*Mount, int64, Spare) {
	if s.closed {
		return nil, 0, Spare{}
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
				return ms, size, Spare{}
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
	return nil, 0, Spare{}
}

// GuessAhead records a declaration's guess of namespace ns's file size on
// ms, where ms knows nothing of ns yet, and reports whether the maker then
// has work (the engine's spareMaker.predict).
func (s *Space) GuessAhead(ms *Mount, ns uint32, size int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ms.aheadNS[ns].from != sizeUnknown {
		return false
	}
	ms.setAheadLocked(ns, nsAhead{size: size, from: sizeGuessed})
	return s.spareWorkLocked()
}

// ForgetAhead drops what every mount knows of released namespace ns's
// files, and reports whether the maker then has work.
func (s *Space) ForgetAhead(ns uint32) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, ms := range s.mounts {
		delete(ms.aheadNS, ns)
	}
	return s.spareWorkLocked()
}

// FailedAhead marks that making a spare of size on ms failed: not again
// until a namespace of that size stores there again (StoreReserve).
func (s *Space) FailedAhead(ms *Mount, size int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for ns, a := range ms.aheadNS {
		if a.size == size {
			a.failed = true
			ms.aheadNS[ns] = a
		}
	}
}

// KeepMade adds sf, a spare just made ahead, to ms's spares if it still
// fits (madeFitsLocked: stores may have taken the room while it was
// made) and the space is not closed, and reports whether it did.
func (s *Space) KeepMade(ms *Mount, sf Spare) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || !ms.madeFitsLocked(sf.ID.Size) {
		return false
	}
	ms.addSpareLocked(sf)
	return true
}

// TrackMaker makes the space track whether the spare maker has work
// (SpareWork, QuietChan): Open calls it before the maker starts and any
// job. Without it the maker has none.
func (s *Space) TrackMaker() {
	s.mu.Lock()
	defer s.mu.Unlock()
	quiet := make(chan struct{})
	close(quiet)
	s.quiet = quiet
}

// SpareWorkOrQuiet reports whether the maker has a spare to make or
// remove; if not, it marks the maker quiet (WaitSpares returns), in the
// same step, so that work added after the look reopens it.
func (s *Space) SpareWorkOrQuiet() bool {
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

// NextSpare returns the mount whose spares the maker should work on, or
// nil, the size of the spare to make there, and a made spare to remove
// first (no path: none), taken from the spares for the caller to remove.
func (s *Space) NextSpare() (*Mount, int64, Spare) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ms, size, stale := s.nextSpareLocked()
	if ms != nil && stale.Path != "" {
		ms.removeSpareLocked(stale)
	}
	return ms, size, stale
}

// QuietChan is the channel closed while the maker is quiet (WaitSpares).
func (s *Space) QuietChan() chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.quiet
}

// makerQuietLocked reports whether the maker found nothing to do when it
// last looked (and nothing marked it busy since).
func (s *Space) makerQuietLocked() bool {
	select {
	case <-s.quiet:
		return true
	default:
		return false
	}
}

// spareWorkLocked reports whether the spare maker has work, and if so
// marks it busy for WaitSpares. False without a maker.
func (s *Space) spareWorkLocked() bool {
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

// SpareWork reports whether the spare maker has work, and if so marks it
// busy for WaitSpares. False without a maker (TrackMaker).
func (s *Space) SpareWork() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.spareWorkLocked()
}

// StoreAhead is what a store tells the spares made ahead: its namespace,
// declared, and whether its file holds a whole group of keys.
type StoreAhead struct {
	NS   uint32
	Full bool
}

// StoreReserve is a store's step in the space, in one hold of the lock.
// With fast, it reserves size bytes on ms where they fit below the high
// watermark with the spares beside them below the capacity, and reports
// false (doing nothing else) where they do not: the caller then reserves
// by evicting and calls it again without fast. Where spares, it then
// takes a spare of exactly size (none: the zero Spare); with burst (not
// zero) it adds the store to ms's burst at that time; and where want is
// not nil it records size as the size of namespace want.NS's files
// (wantSparesLocked) and reports in work whether the spare maker has
// work.
func (s *Space) StoreReserve(ms *Mount, size int64, fast, spares bool, burst int64, want *StoreAhead) (reserved bool, sf Spare, work bool) {
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
		work = s.wantSparesLocked(ms, want.NS, size, want.Full)
	}
	return true, sf, work
}

// wantSparesLocked records size, the size of a file of namespace ns
// stored on ms, for the spares made ahead (the engine's spareMaker.want says which
// size wins) and reports whether the maker has work. The caller holds
// mu.
func (s *Space) wantSparesLocked(ms *Mount, ns uint32, size int64, full bool) bool {
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
