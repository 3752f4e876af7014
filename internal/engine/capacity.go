package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/engine/index"
	"github.com/kvhost/kvhost/internal/engine/space"
)

// capacity is the part that owns the room on the mounts a store or a
// move takes: a reservation (reserve) below the high watermark and, on a
// cluster mount, within the cluster's bound, evicting where there is
// none, within the budgets' floors, and demoting what the restart hold
// pins; and the eviction lock each mount's eviction holds. A store
// reserves through reserveFile alone (room, evicting and demoting as
// needed, and a spare to write into), gives back what no file took
// (unreserve) and makes room after ENOSPC (reclaim); a move between
// mounts reserves through moveRoom; a cluster mount's eviction ends its
// rounds through evicted. Open builds it before tiering, which moves
// through it; tier and hold are set once they are built, hits and maker
// once they start (nil before).
type capacity struct {
	ix     *index.Index // the entries the policy's victims name
	space  *space.Space // the room on every mount
	watch  *mountWatch  // refreshes a mount's capacity; whether it keeps spares
	own    *ownFiles    // trims a mount's spares
	rm     *remover     // removes the evicted files
	tables *tables      // the budgets' floors (budgetRound)
	fs     fsys.FS      // statfs, for why a file exceeds the capacity
	tier   *tiering     // the policy's victims and the demotions among them
	hold   *restartHold // demotes held files; counts them for ErrNoSpace
	hits   *hitRecorder // flushed before the policy ranks victims; nil before start
	// files are the files in flight, whose stores' end a store that
	// found no room waits for (fileSlots.waitEnded); nil: none is.
	files *fileSlots
	maker *spareMaker // told of the stores' sizes, woken by room freed; nil before start
	// waits counts the reservations that found no room (Stats.EvictWaits),
	// evictions the files evicted (Stats.Evictions).
	waits     *atomic.Int64
	evictions *atomic.Uint64
	// tell reports events to the policy (Engine.access).
	tell func(context.Context, []abi.AccessRecord)
	log  *slog.Logger
	now  func() time.Time
}

// victimBatch is the most victims asked of the policy at once.
const victimBatch = 256

// reserve accounts size bytes on m for a store, evicting first if usage
// would cross the high watermark. It fails with ErrNoSpace if the store
// cannot fit within the capacity even after eviction. The capacity is
// refreshed from statfs (at most once a second) before the engine evicts
// for a store, so that space freed on the file system counts.
//
// Where no room is found while other stores are in flight, it waits for
// one of them to end and tries again: in a burst of stores larger than
// the mount, the room is held by stores not yet published, whose files
// are evictable once they are (a single store of 32 keys of 33 MB into
// 256 MiB with 16 I/O workers lost 25 keys so).
func (c *capacity) reserve(ctx context.Context, m *mount, size int64) error {
	for {
		var gen uint64
		if c.files != nil {
			gen = c.files.generation()
		}
		err := c.reserveUsed(ctx, m, size)
		if err == nil {
			break
		}
		if !errors.Is(err, ErrNoSpace) || c.files == nil || !c.files.waitEnded(ctx, gen) {
			return err
		}
	}
	// Spares are free space that holds pages: the new file must fit
	// beside them (a store may then reuse one; a move between mounts
	// writes a fresh file).
	if c.watch.spareEligible(m) {
		c.own.trimSpares(m, false)
	}
	return nil
}

// reserveFile reserves size bytes on m for a store's file of namespace ns
// (reserve) and, where m keeps spares, takes one of exactly that size for
// it (none: the zero spareFile) and records the size for the spares made
// ahead (spareMaker.want, with full). In the common case, a reservation
// below the high watermark with the spares still fitting beside it, that
// is one hold of the space's lock (and, where m makes spares ahead, a
// shared hold of the engine's, for the namespace): every store takes it,
// and many short holds queue 2 MiB stores on many jobs (RATIONALE.md,
// "Why does a store take the engine's lock as few times as it can?").
func (c *capacity) reserveFile(ctx context.Context, m *mount, ns NamespaceID, size int64, full bool) (spareFile, error) {
	spares := c.watch.spareEligible(m)
	ahead := spares && c.maker != nil && m.sp.MakesAhead()
	// step is the reservation's step in the space (space.StoreReserve):
	// with fast, a reservation below the high watermark, or nothing. The
	// reservation is activity too: the maker's quiet period starts after
	// it, so a burst it ends has ended.
	step := func(fast bool) (reserved bool, sf spareFile, work bool) {
		var burst int64
		if ahead && m.sp.FollowsBursts() {
			burst = time.Now().UnixNano()
		}
		reserve := func(declared bool) {
			reserved, sf, work = c.space.StoreReserve(m.sp, size, fast, spares, burst, c.maker.want(m, ns, declared, full))
		}
		if ahead {
			c.tables.whileDeclared(ns, reserve) // want reads the namespace
		} else {
			reserve(false)
		}
		if reserved && burst != 0 {
			c.maker.activeAt(burst)
		}
		return reserved, sf, work
	}
	reserved := false
	var sf spareFile
	var work bool
	if m.cluster == nil { // a cluster mount claims first (cluster.go)
		reserved, sf, work = step(true)
	}
	if !reserved {
		if err := c.reserve(ctx, m, size); err != nil {
			return spareFile{}, err
		}
		_, sf, work = step(false)
	}
	c.maker.wake(work)
	return sf, nil
}

// reserveFree is reserve without evicting, for a move to an earlier mount
// within an eviction (demote.go): it takes room below m's high watermark
// and, on a cluster mount, within this node's claim (never raising it,
// which may evict there), and trims m's spares as reserve does. It fails
// with ErrNoSpace where there is no such room.
func (c *capacity) reserveFree(m *mount, size int64) error {
	cl := m.cluster
	if cl != nil && !cl.ReserveClaimed(size) {
		return fmt.Errorf("%w: mount %s: no room within this node's cluster claim for a move of %d bytes", ErrNoSpace, m.root, size)
	}
	var ok bool
	if cl != nil {
		if ok = cl.ReserveGrant(size, space.High); !ok {
			cl.GiveBack(size)
		}
	} else {
		ok = c.space.ReserveBelow(m.sp, size, space.High)
	}
	if !ok {
		return fmt.Errorf("%w: mount %s: no room below the high watermark for a move of %d bytes", ErrNoSpace, m.root, size)
	}
	if c.watch.spareEligible(m) {
		c.own.trimSpares(m, false)
	}
	return nil
}

// reserveUsed is reserve without the spares.
func (c *capacity) reserveUsed(ctx context.Context, m *mount, size int64) (err error) {
	reserve := func(limit space.Limit) bool { return c.space.ReserveBelow(m.sp, size, limit) }
	if cl := m.cluster; cl != nil { // the cluster-wide bound first (cluster.go)
		if err := cl.Reserve(ctx, size); err != nil {
			return clusterNoSpace(err)
		}
		// The mount's space takes the grant, or it goes back.
		reserve = func(limit space.Limit) bool { return cl.ReserveGrant(size, limit) }
		defer func() {
			if err != nil {
				cl.GiveBack(size)
			}
		}()
	}
	if reserve(space.High) {
		return nil
	}
	c.waits.Add(1)
	m.evictMu.Lock()
	defer m.evictMu.Unlock()
	c.watch.refreshCapacity(m, false)
	if reserve(space.High) { // another store evicted meanwhile
		return nil
	}
	if _, capacity := c.space.Usage(m.sp); size > capacity {
		return c.exceedsCapacity(m, size, capacity)
	}
	note, stopped := c.evict(ctx, m, size)
	if reserve(space.Capacity) {
		return nil
	}
	if stopped != nil {
		return stopped // the caller gave up while files were evicted
	}
	used, capacity := c.space.Usage(m.sp)
	why := "no evictable entry left"
	if n := c.hold.held(); n > 0 {
		why = fmt.Sprintf("no evictable entry left (%d files found at start are kept by the restart hold, restart_hold, until it ends)", n)
	}
	if cl := m.cluster; cl != nil {
		if twin := cl.TwinNote(); twin != "" {
			why = twin
		}
	}
	if note != "" {
		why = note
	}
	return fmt.Errorf("%w: mount %s: %d of %d bytes used, %d more needed, %s", ErrNoSpace, m.root, used, capacity, size, why)
}

// reclaim makes room on m after a store's write failed with ENOSPC (the
// file system is fuller than the engine knew: other nodes, other
// programs): it drops m's spares (they hold pages), refreshes the
// capacity from statfs, less size, the failed store's reservation,
// which is still counted as used but holds no bytes there now (its file
// was removed), and evicts down to it. All under the eviction lock: a
// running eviction's files, removed but not yet uncounted, would count
// twice in the capacity (free in statfs, and used), and it would keep
// spares again right after the trim.
func (c *capacity) reclaim(ctx context.Context, m *mount, size int64) {
	m.withEvictLock(func() {
		c.own.trimSpares(m, true)
		c.watch.refreshCapacityLess(m, true, size)
		_, _ = c.evict(ctx, m, 0)
	})
}

// withEvictLock runs fn holding m's eviction lock, the first of the
// engine's locks: no eviction on m runs meanwhile. capacity.go is the
// one file that takes the lock; others go through here.
func (m *mount) withEvictLock(fn func()) {
	m.evictMu.Lock()
	defer m.evictMu.Unlock()
	fn()
}

// ifNotEvicting runs fn holding m's eviction lock where no eviction
// holds it now, and reports whether it ran fn.
func (m *mount) ifNotEvicting(fn func()) bool {
	if !m.evictMu.TryLock() {
		return false
	}
	defer m.evictMu.Unlock()
	fn()
	return true
}

// noRoomFix is what to do where a mount's file system has no room left
// for kvhost (its free space plus kvhost's files there, less the mount's
// reserve, is below what kvhost needs): the warning at Open and a store's
// ErrNoSpace say it alike.
const noRoomFix = "free space on the file system, or lower the mount's reserve below what it has available"

// exceedsCapacity is the ErrNoSpace of a file of size bytes larger than
// m's capacity, capacity. Where the file system cut the capacity below
// the configured one (other programs filled it), the error says so and
// what to do: the configured capacity is not what is at fault.
func (c *capacity) exceedsCapacity(m *mount, size, capacity int64) error {
	err := fmt.Errorf("%w: mount %s: a file of %d bytes exceeds the capacity of %d", ErrNoSpace, m.root, size, capacity)
	configured, reserve, _ := m.sp.Configured()
	if configured > 0 && capacity >= configured {
		return err // the configured capacity itself is too small
	}
	st, serr := c.fs.Statfs(m.root)
	if serr != nil || st.Total == 0 {
		return err // no word from the file system on its room
	}
	of := "the file system's size"
	if configured > 0 {
		of = fmt.Sprintf("the configured %d bytes", configured)
	}
	return fmt.Errorf("%w: the file system has no room left (its %d bytes available plus what kvhost holds there, less the mount's reserve of %d, leave %d of %s); fix: %s",
		err, st.Avail, reserve, capacity, of, noRoomFix)
}

// unreserve gives back a reservation of size bytes on m that no file took
// (a store or a move failed), and wakes the spare maker for the room.
func (c *capacity) unreserve(m *mount, size int64) {
	c.maker.wake(c.space.Unreserve(m.sp, size)) // room for spares made ahead
}

// evict removes policy-chosen victims on m until usage plus size is at or
// below the low watermark, or the policy has nothing more to offer. Pinned
// entries are never removed, whatever the policy says. Where that leaves
// too little room, files the restart hold pins may still be demoted
// (demoteHeld). A caller that gives up (ctx cancelled) before room is
// needed or while it is made stops it before its next deletion or move,
// with ctx's error: the files already claimed are removed, and the
// policy told. m.evictMu is held. note says why files the policy
// offered were left: the budgets' floors that kept them
// (budgetRound.floorNote), or "".
func (c *capacity) evict(ctx context.Context, m *mount, size int64) (note string, err error) {
	note, err = c.evictRounds(ctx, m, size)
	if err != nil {
		return note, err
	}
	return note, c.hold.demote(ctx, m, size)
}

// evictRounds is evict without demoteHeld. With budgets (budget.go), a
// round asks the policy for up to victimBatch victims whatever their
// bytes, and takes first those of namespaces over their budget, then any
// other that leaves every floor kept, each pass in the policy's order.
func (c *capacity) evictRounds(ctx context.Context, m *mount, size int64) (note string, _ error) {
	stopped := func() error {
		return fmt.Errorf("engine: mount %s: eviction stopped: %w", m.root, ctx.Err())
	}
	c.rm.retryLeft(m) // files whose removal failed first: no one's data
	for round := 0; round < 16; round++ {
		// Orphans are on their way out (flight.go): room enough below the
		// low watermark without them, unless the file would not fit
		// beside them below the capacity.
		need := c.space.Need(m.sp, size)
		if need <= 0 {
			return note, nil
		}
		if ctx.Err() != nil {
			return note, stopped() // no file is deleted for a caller that gave up
		}
		if c.hits != nil {
			c.hits.flush() // rank with every hit reported so far
		}
		req := abi.EvictRequest{Bytes: uint64(need), Time: uint64(c.now().UnixNano()), Mount: uint32(m.idx)}
		br := c.tables.budgetRound(c.ix.Counts().ByFingerprint)
		passes := []int{passAny}
		if br != nil {
			// More victims than the room needs: some may be kept.
			used, _ := c.space.Usage(m.sp)
			req.Bytes, passes = uint64(max(need, used)), []int{passOver, passAny}
		}
		var victims []policy.Eviction
		var err error
		if m.cluster != nil {
			victims = m.cluster.Victims(req, victimBatch) // never another live node's file
		} else {
			victims, err = c.tier.evictions(context.WithoutCancel(ctx), req)
		}
		if err != nil {
			c.log.Warn("engine: policy victims", "mount", m.root, "err", err)
			return note, nil
		}
		var freed int64
		var recs []abi.AccessRecord
		var claimed []*entry // files to remove (or keep as spares), paths held
		var stop error
		taken := make([]bool, len(victims))
		// sweep takes victims for a pass, in the policy's order. Victims
		// bound for the object mount whose keys the bucket lacks are left
		// to the demoter's uploads (objdemote.go) and taken, waiting for
		// their uploads, only by the last sweep (upload), where the
		// others did not make the room.
		left := make([]bool, len(victims)) // bound for the object mount, left by a sweep without upload
		sweep := func(pass int, upload bool) {
			for i, v := range victims {
				if freed >= need || stop != nil {
					break
				}
				if taken[i] {
					continue
				}
				if ctx.Err() != nil {
					stop = stopped()
					break
				}
				if v.Target.Mount != abi.NoMount { // a demotion (demote.go)
					if pass != passAny || upload && !left[i] {
						continue // the key stays: not the budget's room, or tried
					}
					n, del := c.tier.demoteVictim(ctx, m, v, upload)
					freed += n
					if !del {
						if !upload {
							left[i] = c.tier.toObjects(int(v.Target.Mount))
						}
						continue
					}
				} else if upload {
					continue // tried
				}
				// Hold the path while removing: a store publishing there
				// meanwhile waits, and its new file is never removed. The
				// file counts as used until evictAll (or the path's holder)
				// has removed it, or kept it as a spare.
				en, claim, rec, ok := c.ix.EvictID(v.Entry, func(en *entry) bool {
					return en.Mount == m.idx && m.mayEvict(en) && br.pick(pass, en.FP, en.Size)
				}, c.now().UnixNano())
				if !ok {
					continue
				}
				taken[i] = true
				if claim {
					claimed = append(claimed, en)
				}
				recs = append(recs, rec)
				freed += en.Size
			}
		}
		for _, pass := range passes {
			sweep(pass, false)
		}
		sweep(passAny, true)
		br.done()
		for i := range left {
			if freed < need && left[i] && !taken[i] {
				note = "victims bound for the object mount are not uploaded yet (its uploads fail, or fell behind the stores)"
			}
		}
		if n := br.floorNote(); n != "" {
			note = "no entry evictable without crossing a budget's floor: " + n
		}
		c.evicted(ctx, claimed, recs)
		if stop != nil {
			return note, stop
		}
		if freed == 0 {
			return note, nil
		}
	}
	return note, nil
}

// evicted ends a round of eviction, here (evictRounds) or a cluster
// mount's (clusterHost.Evicted): it counts the evictions of recs, removes
// the files of claimed (evictAll) and tells the policy of recs.
func (c *capacity) evicted(ctx context.Context, claimed []*entry, recs []abi.AccessRecord) {
	c.evictions.Add(uint64(len(recs)))
	c.evictAll(claimed)
	c.tell(ctx, recs)
}

// evictWorkers is the most evicted files one eviction removes (or keeps
// as spares) at once (RATIONALE.md, "Why does an eviction remove its
// files in parallel?").
const evictWorkers = 8

// evictAll is evictClaimed for every entry of ens, up to evictWorkers at
// once: each file is a few system calls (open, fstat, a header read,
// close, then a rename or an unlink), and the stores that need the room
// wait for all of them.
func (c *capacity) evictAll(ens []*entry) {
	var next atomic.Int64
	var wg sync.WaitGroup
	for range min(evictWorkers, len(ens)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := next.Add(1) - 1; i < int64(len(ens)); i = next.Add(1) - 1 {
				c.rm.evictClaimed(ens[i])
			}
		}()
	}
	wg.Wait()
}
