// Package space is the engine's space part: the room on every mount —
// each mount's capacity and watermarks, the bytes its files, reservations
// and orphans take (used), its spare files and the spares made ahead of
// stores, and whether the spare maker has work. Its lock and state are
// its own: every operation is whole, one hold of the lock. It is the
// bottom of the engine: it calls nothing else, does no I/O and never
// calls the policy. The index tells it of its files through Counts (lock
// order: index before space). Its invariants are checked with -tags
// invariants (Space.Check).
package space

import (
	"sync"
	"time"

	"github.com/kvhost/kvhost/fsys"
)

// Space is the room on every mount.
//
// Lock order: mount.evictMu > the engine's tables.mu > index.mu > Space.mu. Nothing
// holding mu takes another of the engine's locks. One mutex guards
// every mount: the spare maker decides across mounts.
//
// Invariants (Check), for every mount, with mu held:
//   - 0 <= orphaned <= used; entries >= 0;
//   - 0 <= low <= high <= capacity;
//   - spareBytes is the sum of the spares' sizes, madeBytes that of the
//     spares made ahead (zeroed) among them; no size maps to an empty
//     list, and every spare is listed under its own size.
//
// What used holds beside the indexed files (reservations of stores and
// moves in flight, files being removed) is only known above: the
// engine's check at rest compares used with the index (UsageAtRest).
type Space struct {
	mu     sync.Mutex
	mounts []*Mount
	// closed: the engine is closing: no spare is kept or made.
	closed bool
	// quiet is closed while the spare maker has nothing to do
	// (Engine.WaitSpares); replaced by an open channel when work appears.
	// Nil without a maker.
	quiet chan struct{}
}

// New returns a space of no mount (Add adds them).
func New() *Space { return &Space{} }

// MountConfig is what a mount's room is made of, fixed at Open.
type MountConfig struct {
	// Index is the mount's position; Root its path (in errors).
	Index int
	Root  string
	// Configured is Mount.Capacity (0: the file system's size); Derived:
	// it was computed, not given (Mount.CapacityDerived); Reserve is
	// Mount.Reserve.
	Configured, Reserve int64
	Derived             bool
	// High and Low are the watermarks as fractions of the capacity.
	High, Low float64
	// Ahead is Mount.Preallocate as configured (SetAhead settles it).
	Ahead int64
}

// Mount is one mount's room. Its fields are the space's: read through
// the Space's operations, under its lock.
type Mount struct {
	idx  int
	root string
	// configured is Mount.Capacity (0: the file system's size); reserve
	// is Mount.Reserve; highF and lowF the watermarks as fractions.
	configured, reserve int64
	derived             bool // configured was computed, not given (Mount.CapacityDerived)
	highF, lowF         float64
	// ahead is Mount.Preallocate (PreallocateAuto resolved at Open,
	// SetAhead; 0 where the mount keeps no spares), and aheadFiles the
	// most spares of a size it keeps (MaxAutoSpareFiles for
	// PreallocateAuto; 0: no bound but ahead's). aheadMax is the most
	// the budget grows to after bursts of stores larger than ahead
	// (AutoPreallocateMax for PreallocateAuto; 0 where a size was given:
	// that budget is fixed). Set before any job; aheadFiles also by
	// tests, under mu.
	ahead      int64
	aheadFiles int
	aheadMax   int64

	// guarded by Space.mu
	capacity  int64 // effective: min(configured, what the file system can hold)
	high, low int64
	// used is the bytes of the mount's indexed files, of reservations
	// (stores and moves in flight), of files dropped from the index
	// and not yet removed, and of spares and temporary files whose
	// removal failed.
	used int64
	// orphaned is the part of used that orphans hold: files dropped from
	// the index while another job held their path, which that job
	// removes when it lets the path go. They are on their way out: an
	// eviction frees room down to the low watermark without them, but no
	// less than a store needs beside them below the capacity.
	orphaned  int64
	entries   int       // indexed files
	refreshed time.Time // last capacity refresh from statfs
	// spares are evicted files kept for stores to write into, by size
	// (a size is present only with files); spareBytes is their total.
	// They are not part of used. madeBytes is the spares made ahead
	// among them (of any size).
	spares                map[int64][]Spare
	spareBytes, madeBytes int64
	// aheadNS is what each namespace's declaration and stores say about
	// its files here (wantSparesLocked, GuessAhead; dropped at
	// ForgetAhead, and where making one of its size failed).
	aheadNS map[uint32]nsAhead
	// burst is the bytes of the stores reserved on the mount since it was
	// last quiet (a mount that makes spares ahead); grown is what earlier
	// bursts left the budget at (budgetLocked, endBurstLocked).
	burst, grown int64
	lastAdd      int64 // when the last store was added to the burst (UnixNano)
	// movedIn and movedOut count the files moved to and from the mount
	// (demotions, promotions, tick moves).
	movedIn, movedOut uint64
}

// NewMount returns a mount's room, its capacity set from st, what statfs
// says of its file system. It is the caller's until Add.
func NewMount(c MountConfig, st fsys.StatFS) *Mount {
	ms := &Mount{idx: c.Index, root: c.Root, configured: c.Configured, derived: c.Derived, reserve: c.Reserve, highF: c.High, lowF: c.Low, ahead: c.Ahead}
	ms.setCapacityLocked(ms.fsCapacity(st, 0)) // not shared yet
	return ms
}

// Index is the mount's position (fixed).
func (ms *Mount) Index() int { return ms.idx }

// Configured returns Mount.Capacity, Mount.Reserve and whether the
// capacity was derived (fixed at Open).
func (ms *Mount) Configured() (capacity, reserve int64, derived bool) {
	return ms.configured, ms.reserve, ms.derived
}

// Watermarks returns the high and low watermarks as fractions (fixed).
func (ms *Mount) Watermarks() (high, low float64) { return ms.highF, ms.lowF }

// Ahead returns the bytes of spares the mount makes ahead (0: none), the
// most spares of a size it keeps and the most its budget grows to, as
// settled at Open (SetAhead).
func (ms *Mount) Ahead() (ahead int64, files int, most int64) {
	return ms.ahead, ms.aheadFiles, ms.aheadMax
}

// MakesAhead reports whether the mount makes spares ahead of stores
// (settled at Open: SetAhead).
func (ms *Mount) MakesAhead() bool { return ms.ahead > 0 }

// FollowsBursts reports whether the mount's budget grows after bursts of
// stores (PreallocateAuto with room above its starting budget); fixed at
// Open.
func (ms *Mount) FollowsBursts() bool { return ms.aheadMax > ms.ahead }

// Add adds ms to the mounts, at its position (Open, before any job).
func (s *Space) Add(ms *Mount) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.mounts = append(s.mounts, ms)
}

// Mounts returns how many mounts the space has.
func (s *Space) Mounts() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.mounts)
}

// SetAhead settles the spares ms makes ahead: ahead bytes (0: none), at
// most files of a size (0: no bound but ahead's), a budget growing to
// most after bursts (0: fixed). Open calls it before any job; tests
// lower the bound.
func (s *Space) SetAhead(ms *Mount, ahead int64, files int, most int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ms.ahead, ms.aheadFiles, ms.aheadMax = ahead, files, most
}

// fsCapacity is the capacity of ms given what statfs says and used, the
// bytes the engine holds on it: the configured capacity (or the file
// system's size), but at most what the file system can hold for us, free
// space plus our own files, minus the reserve.
func (ms *Mount) fsCapacity(st fsys.StatFS, used int64) int64 {
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
func (ms *Mount) setCapacityLocked(c int64) {
	ms.capacity = c
	ms.high = int64(float64(c) * ms.highF)
	ms.low = int64(float64(c) * ms.lowF)
}

// RefreshDue reports whether ms's capacity is due a refresh from statfs
// at now (at most once a second unless force) and, if so, marks it
// refreshed.
func (s *Space) RefreshDue(ms *Mount, now time.Time, force bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !force && now.Sub(ms.refreshed) < time.Second {
		return false
	}
	ms.refreshed = now
	return true
}

// Refresh sets ms's capacity from statfs. Space of stores in flight is
// part of used but not yet (all) taken from the file system, and a file
// just removed is free there while used counts it until its remover
// uncounts it: counting them as ours errs towards a larger capacity,
// which an ENOSPC then corrects (the store's retry refreshes under the
// eviction lock, out of the evictions' removals). notOnDisk is bytes of
// used known to hold nothing on the file system: the reservation of the
// store whose file the ENOSPC removed, which would otherwise count as
// room the file system has (and so leave nothing to evict for the
// retry).
func (s *Space) Refresh(ms *Mount, st fsys.StatFS, notOnDisk int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ms.setCapacityLocked(ms.fsCapacity(st, ms.used+ms.spareBytes-notOnDisk))
}

// Limit is a bound on a mount's used bytes (ReserveBelow, Fits).
type Limit uint8

const (
	// High is the mount's high watermark.
	High Limit = iota
	// Capacity is the mount's capacity.
	Capacity
)

// of is the limit's bytes on ms; the caller holds mu.
func (l Limit) of(ms *Mount) int64 {
	if l == High {
		return ms.high
	}
	return ms.capacity
}

// ReserveBelow accounts size bytes on ms if used stays at or below
// limit, and reports whether it did.
func (s *Space) ReserveBelow(ms *Mount, size int64, limit Limit) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ms.used+size <= limit.of(ms) {
		ms.used += size
		return true
	}
	return false
}

// Fits reports whether size bytes fit on ms below limit now: ReserveBelow
// without the reservation.
func (s *Space) Fits(ms *Mount, size int64, limit Limit) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return ms.used+size <= limit.of(ms)
}

// Unreserve gives back size bytes reserved on ms that no file took, and
// reports whether the spare maker then has work.
func (s *Space) Unreserve(ms *Mount, size int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	ms.used -= size
	return s.spareWorkLocked()
}

// Left counts size bytes of a spare of ms, no longer among its spares,
// or of a temporary file not published, as used: its removal failed.
func (s *Space) Left(ms *Mount, size int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ms.used += size
}

// Need is how many bytes an eviction on ms must free for a file of size
// bytes: down to the low watermark without the orphans (on their way
// out), unless the file would not fit beside them below the capacity.
func (s *Space) Need(ms *Mount, size int64) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return max(ms.used-ms.orphaned+size-ms.low, ms.used+size-ms.capacity)
}

// Usage returns ms's used bytes and capacity.
func (s *Space) Usage(ms *Mount) (used, capacity int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return ms.used, ms.capacity
}

// Usage is a mount's room at one moment (Usages).
type Usage struct {
	Capacity, Configured, Reserve, High, Low, Used int64
	Entries, SpareFiles                            int
	SpareBytes, Ahead                              int64
	MovedIn, MovedOut                              uint64
}

// Usages returns every mount's room, by mount index, in one hold of the
// lock (Stats, the policy's mount descriptions).
func (s *Space) Usages() []Usage {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Usage, len(s.mounts))
	for i, ms := range s.mounts {
		out[i] = Usage{
			Capacity: ms.capacity, Configured: ms.configured, Reserve: ms.reserve, High: ms.high, Low: ms.low, Used: ms.used,
			Entries: ms.entries, SpareFiles: ms.spareFilesLocked(), SpareBytes: ms.spareBytes, Ahead: ms.budgetLocked(),
			MovedIn: ms.movedIn, MovedOut: ms.movedOut,
		}
	}
	return out
}

// Close marks the space closed: no spare is kept or made from now on.
func (s *Space) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
}
