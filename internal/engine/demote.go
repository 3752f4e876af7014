package engine

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/engine/index"
	"github.com/kvhost/kvhost/internal/engine/space"
	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/internal/fstype"
)

// Tiering (docs/engine.md, "Tiering"): mount descriptions sent to the
// policy, admission to another mount, demotion of eviction victims to
// another mount, and the periodic tick whose moves promote (or demote)
// entries in the background.
//
// A move copies an entry's file to the same relative path on the target
// mount, under an owned temporary name, fsyncs it (Config.Fsync), renames
// it into place, swaps the index (the policy sees a REMOVE of the old
// handle and an INSERT of a new one), and only then removes the source,
// checked by identity. A SIGKILL at any point leaves the source loadable
// (before the rename), or both copies (after it): Open keeps one of two
// files with the same header id (dedupe).

// Defaults of the tiering knobs.
const (
	// DefaultMountUpdateInterval is Config.MountUpdateInterval when zero.
	DefaultMountUpdateInterval = time.Second
	// DefaultTickInterval is Config.TickInterval when zero.
	DefaultTickInterval = 100 * time.Millisecond
	// maxTickMoves is the most moves one tick asks of each policy shard.
	maxTickMoves = 256
	// copyChunk is the buffer of a move's copy.
	copyChunk = 1 << 20
)

// errMoveStale: the entry to move is gone, pinned, already moving or
// already on the target; not a failure of anyone.
var errMoveStale = errors.New("engine: entry not movable now")

// errPathTaken: the target of a move holds another file (of other keys)
// at the entry's path: a policy that named two keys alike (abi.md, "Paths
// must be unique across mounts"). It wraps ErrPolicy.
var errPathTaken = fmt.Errorf("%w: the target mount holds another file at the path", ErrPolicy)

// TierStats counts the engine's moves between mounts.
type TierStats struct {
	// Demotions counts eviction victims moved to another mount.
	Demotions uint64
	// Moves counts moves asked by the policy's tick (promotions included).
	Moves uint64
	// Promotions counts moves to an earlier (by convention faster) mount,
	// whatever asked for them, and keys promoted from the object mount
	// (objpromote.go).
	Promotions uint64
	// MoveFailures counts moves that failed (no space, I/O errors); the
	// entry stays where it was. A demotion stopped because the caller of
	// its eviction gave up is none.
	MoveFailures uint64
	// DemotionDeletes counts victims the policy wanted demoted, deleted
	// because the target had no room (abi.MoveDeleteIfFull) or held
	// another file at the victim's path (a policy naming two keys alike).
	DemotionDeletes uint64
	// Deduped counts files removed at Open because another copy of the same
	// file (a move interrupted after its rename) was kept.
	Deduped uint64
	// MountUpdates counts mount descriptions sent to the policy.
	MountUpdates uint64
	// Ticks counts tick calls.
	Ticks uint64
	// ObjectUploads and ObjectUploadBytes count the files the object
	// demoter copied to the object mount (objdemote.go), ahead of need or
	// for an eviction that waited, and their bytes; ObjectUploadFailures,
	// its uploads that failed (not those cancelled, nor those of files
	// gone meanwhile).
	ObjectUploads, ObjectUploadBytes, ObjectUploadFailures uint64
}

// tierCounters are the atomic counters behind TierStats.
type tierCounters struct {
	demotions, moves, promotions, moveFailures, demotionDeletes, deduped, mountUpdates, ticks atomic.Uint64
}

// mountDesc is what a mount's description says besides its usage; fixed
// at Open.
type mountDesc struct {
	class      uint32
	configured bool // class is Mount.DeviceClass, not detected
	fsType     uint32
	fsName     string
}

// className is the name of a device class, as Mount.DeviceClass takes it,
// or "unknown".
func className(c uint32) string {
	for name, v := range deviceClasses {
		if v == c {
			return name
		}
	}
	return "unknown"
}

// tiering is the part that moves entries between mounts: it describes
// the mounts to the policy, runs the tick and its moves, demotes the
// victims of evictions, places admitted files on the mount admission
// chose and, at Open, drops the second copies a move cut short left. It
// owns its driver and its counters; the rest of the
// engine it reaches through the index, the space, the remover, the
// engine's own files, buffers and spare maker, and two narrow seams: room
// on the mounts (moveRoom) and the files' headers, publication and the
// policy's events (moveFiles).
type tiering struct {
	log      *slog.Logger
	now      func() time.Time
	ix       *index.Index
	space    *space.Space
	mounts   []*mount // fixed at Open
	kvMounts int
	slots    *fileSlots // a copy is a file in flight that takes no slot
	room     moveRoom
	files    moveFiles
	hd       *headerReader // the source's open (openSame)
	watch    *mountWatch   // the targets' refusals of stores, and their probes
	rm       *remover      // removes sources, copies and temporary files; holds paths
	own      *ownFiles     // creates the copies' temporary files
	bufs     *buffers      // the copies' buffers
	maker    *spareMaker   // told of the copies in flight and the room freed; nil before start
	shared   confirmer     // confirms the file at the target's path (sharedDir)
	// pol is the engine's policy (the switch), set once Open has it,
	// before any eviction.
	pol policy.Policy
	// tickEvery and updateEvery are Config.TickInterval and
	// Config.MountUpdateInterval with their defaults.
	tickEvery, updateEvery time.Duration

	driver *tierDriver  // nil before start and without policy.Tiering
	hits   *hitRecorder // flushed before each tick; nil before start
	st     tierCounters
	// objs is the object mount, described last to the policy: a target
	// of admission and of demotion (demoteToObjects). Set once at Open.
	objs *objectTier
	// demoter uploads files to the object mount ahead of their
	// demotion (objdemote.go); nil before start and without an object
	// mount.
	demoter *objectDemoter
}

// moveRoom is what a move asks of the room on the mounts (capacity.go).
type moveRoom interface {
	reserve(ctx context.Context, m *mount, size int64) error
	reserveFree(m *mount, size int64) error
	unreserve(m *mount, size int64)
}

// moveFiles is what a move asks of the files' life besides removal
// (remover), temporary files (ownFiles) and opens and checks
// (headerReader): publishing the copy (publish.go) and the policy's
// events (hits.go).
type moveFiles interface {
	publish(ctx context.Context, m *mount, f fsys.File, tmp string, en, replaces *entry, op string) (published bool, left *entry, err error)
	access(ctx context.Context, recs []abi.AccessRecord)
}

// newTiering is the tiering part of e, whose mounts are open.
func newTiering(e *Engine) *tiering {
	t := &tiering{
		log: e.cfg.Logger, now: e.cfg.Now, ix: e.ix, space: e.space, mounts: e.mounts, kvMounts: e.nm.kvMounts,
		slots: &e.mv.slots, room: e.capacity, files: e, hd: e.hd, watch: e.watch, rm: e.rm, own: e.own, bufs: new(buffers), shared: e.shared,
		tickEvery: e.cfg.TickInterval, updateEvery: e.cfg.MountUpdateInterval,
	}
	if t.tickEvery == 0 {
		t.tickEvery = DefaultTickInterval
	}
	if t.updateEvery == 0 {
		t.updateEvery = DefaultMountUpdateInterval
	}
	return t
}

// confirmer confirms that an entry's file is still at its path
// (sharedDir.confirm).
type confirmer interface {
	confirm(ctx context.Context, en *entry) bool
}

// tierDriver runs the tick and the mount updates.
type tierDriver struct {
	pol   policy.Tiering
	descs []mountDesc
	stop  chan struct{}
	done  chan struct{}
	mu    sync.Mutex // guards last
	last  []abi.MountRecord
}

// TierStats returns the engine's move counters.
func (e *Engine) TierStats() TierStats { return e.tier.stats() }

// stats returns the move counters.
func (t *tiering) stats() TierStats {
	c := &t.st
	promotions := c.promotions.Load()
	if t.objs != nil && t.objs.promoter != nil {
		promotions += t.objs.promoter.promoted.Load()
	}
	st := TierStats{
		Demotions: c.demotions.Load(), Moves: c.moves.Load(), Promotions: promotions, MoveFailures: c.moveFailures.Load(),
		DemotionDeletes: c.demotionDeletes.Load(), Deduped: c.deduped.Load(),
		MountUpdates: c.mountUpdates.Load(), Ticks: c.ticks.Load(),
	}
	if d := t.demoter; d != nil {
		st.ObjectUploads, st.ObjectUploadBytes, st.ObjectUploadFailures = d.uploaded.Load(), d.uploadedBytes.Load(), d.failed.Load()
	}
	return st
}

// moved is the sum of the move counters, for Activity.Moved.
func (t *tiering) moved() uint64 {
	c := &t.st
	return c.demotions.Load() + c.demotionDeletes.Load() + c.promotions.Load() + c.moves.Load() + c.moveFailures.Load()
}

// start describes the mounts to the policy and starts the driver of
// ticks (Config.TickInterval), mount updates (Config.MountUpdateInterval)
// and probes of mounts that refuse stores (reprobe) when the policy
// implements policy.Tiering: always, as the engine's policy is the
// switch (switchPolicy), which passes on what its current policy takes
// of the tiering calls. hits is flushed before each tick; maker is told
// of the moves from now on.
func (t *tiering) start(ctx context.Context, hits *hitRecorder, maker *spareMaker) {
	t.maker = maker
	tp, ok := t.pol.(policy.Tiering)
	if !ok {
		return
	}
	t.hits = hits
	if t.objs != nil && t.objs.objs != nil {
		t.demoter = newObjectDemoter(t, cmp.Or(max(t.tickEvery, 0), DefaultTickInterval))
		go t.demoter.run()
	}
	d := &tierDriver{pol: tp, stop: make(chan struct{}), done: make(chan struct{})}
	for _, m := range t.mounts {
		d.descs = append(d.descs, m.desc)
	}
	t.driver = d
	t.sendMounts(ctx, true)
	go t.drive()
}

// stop stops the driver and the demoter and waits for the move and the
// uploads in flight.
func (t *tiering) stop() {
	if t.demoter != nil {
		t.demoter.close()
	}
	if t.driver == nil {
		return
	}
	close(t.driver.stop)
	<-t.driver.done
}

func (t *tiering) drive() {
	d := t.driver
	defer close(d.done)
	ctx := context.Background()
	var mountC, tickC <-chan time.Time
	probe := time.NewTicker(reprobeTick)
	defer probe.Stop()
	if t.updateEvery > 0 {
		tk := time.NewTicker(t.updateEvery)
		defer tk.Stop()
		mountC = tk.C
	}
	if t.tickEvery > 0 {
		// The policy's features are asked at each tick: a policy replaced
		// at run time may gain or lose the hook.
		tk := time.NewTicker(t.tickEvery)
		defer tk.Stop()
		tickC = tk.C
	}
	for {
		select {
		case <-d.stop:
			return
		case <-mountC:
			t.sendMounts(ctx, false)
		case <-tickC:
			t.tick(ctx, d.stop)
		case <-probe.C:
			t.watch.reprobe()
		}
	}
}

// pauseMounts holds back the mount descriptions for a policy swap
// (catchUpAndSwap): none is sent until done is called. tell describes
// the mounts to p, the policy swapped in, as the last description sent;
// it does nothing without the driver or where p does not implement
// policy.Tiering.
func (t *tiering) pauseMounts() (tell func(ctx context.Context, p policy.Policy) error, done func()) {
	d := t.driver
	if d == nil {
		return func(context.Context, policy.Policy) error { return nil }, func() {}
	}
	d.mu.Lock()
	tell = func(ctx context.Context, p policy.Policy) error {
		tp, ok := p.(policy.Tiering)
		if !ok {
			return nil
		}
		recs := t.mountRecords(d.descs)
		if err := tp.UpdateMounts(ctx, recs); err != nil {
			return err
		}
		d.last = recs
		t.st.mountUpdates.Add(1)
		return nil
	}
	return tell, d.mu.Unlock
}

// mountRecords describes every mount as it is now.
func (t *tiering) mountRecords(descs []mountDesc) []abi.MountRecord {
	recs := make([]abi.MountRecord, len(t.mounts))
	rooms := t.space.Usages()
	for i, m := range t.mounts {
		sp := rooms[i]
		r := &recs[i]
		r.Mount = uint32(i)
		if m.direct {
			r.Flags |= abi.MountDirect
		}
		if m.checksums {
			r.Flags |= abi.MountChecksums
		}
		if m.raw != nil {
			r.Flags |= abi.MountVLLMFS
		}
		r.Capacity, r.Used = uint64(max(sp.Capacity, 0)), uint64(max(sp.Used, 0))
		r.Free = uint64(max(sp.Capacity-sp.Used, 0))
		r.High, r.Low, r.Entries = uint64(max(sp.High, 0)), uint64(max(sp.Low, 0)), uint64(max(sp.Entries, 0))
		r.Class, r.FSType = descs[i].class, descs[i].fsType
		copy(r.FSName[:], descs[i].fsName)
		copy(r.Backend[:], m.backend)
	}
	if t.objs != nil {
		if r, ok := t.objs.description(); ok {
			recs = append(recs, r)
		}
	}
	return recs
}

// sendMounts sends the mount description to the policy if it changed since
// the last one sent (or always, with force).
func (t *tiering) sendMounts(ctx context.Context, force bool) {
	d := t.driver
	recs := t.mountRecords(d.descs)
	d.mu.Lock()
	defer d.mu.Unlock()
	if !force && slices.Equal(recs, d.last) {
		return
	}
	if err := d.pol.UpdateMounts(context.WithoutCancel(ctx), recs); err != nil {
		t.log.Warn("engine: policy mount update", "err", err)
		return
	}
	d.last = recs
	t.st.mountUpdates.Add(1)
}

// tick calls the policy's tick and carries out the moves it asks for, one
// at a time, until done or stop is closed.
func (t *tiering) tick(ctx context.Context, stop <-chan struct{}) {
	if !t.pol.Features().Has(abi.FeatureTick) {
		return
	}
	if t.hits != nil {
		t.hits.flush() // the policy counts every hit reported so far
	}
	iv := t.tickEvery
	moves, err := t.driver.pol.Tick(ctx, abi.TickRequest{Time: uint64(t.now().UnixNano()), Interval: uint64(iv)}, maxTickMoves)
	t.st.ticks.Add(1)
	if err != nil {
		t.log.Warn("engine: policy tick", "err", err)
		return
	}
	for _, mv := range moves {
		select {
		case <-stop:
			return
		default:
		}
		switch _, err := t.move(ctx, mv.Entry, int(mv.Mount), true); {
		case err == nil:
			t.st.moves.Add(1)
		case errors.Is(err, errMoveStale):
		default:
			t.st.moveFailures.Add(1)
			t.log.Debug("engine: move asked by the policy's tick", "entry", mv.Entry, "mount", mv.Mount, "err", err)
		}
	}
}

// evictions asks the policy for victims of req, with their targets when
// the policy demotes (abi.FeatureDemote).
func (t *tiering) evictions(ctx context.Context, req abi.EvictRequest) ([]policy.Eviction, error) {
	if t.demotes() {
		return t.pol.(policy.Tiering).Evictions(ctx, req, victimBatch)
	}
	vs, err := t.pol.Victims(ctx, req, victimBatch)
	if err != nil {
		return nil, err
	}
	out := make([]policy.Eviction, len(vs))
	for i, v := range vs {
		out[i] = policy.Eviction{Victim: v, Target: abi.VictimTarget{Mount: abi.NoMount}}
	}
	return out, nil
}

// demotes reports whether the policy demotes eviction victims
// (policy.Tiering with abi.FeatureDemote).
func (t *tiering) demotes() bool {
	_, ok := t.pol.(policy.Tiering)
	return ok && t.pol.Features().Has(abi.FeatureDemote)
}

// demoteHeld moves victim v, a file the restart hold pins, to its target
// mount, into free room only, the copy keeping the hold's pin
// (restartHold.demote), and returns the bytes freed and whether it moved.
func (t *tiering) demoteHeld(ctx context.Context, v policy.Eviction) (int64, bool) {
	n, err := t.moveEntry(ctx, v.Entry, int(v.Target.Mount), false, true)
	switch {
	case err == nil:
		t.st.demotions.Add(1)
		return n, true
	case errors.Is(err, errMoveStale):
	default:
		t.st.moveFailures.Add(1)
		t.log.Debug("engine: demotion of a file the restart hold pins failed; it stays", "entry", v.Entry, "mount", v.Target.Mount, "err", err)
	}
	return 0, false
}

// roomAfter reports whether a kvhost mount after m (a colder tier) may
// take a file of size bytes into free room below its high watermark, as
// a demotion of a held file needs (reserveFree); a cluster mount's claim
// decides at the move, so one counts as room. Where none may, a round of
// restartHold.demote would lift and give back every held pin of m, two policy
// records per file, and move nothing.
func (t *tiering) roomAfter(m *mount, size int64) bool {
	for i := m.idx + 1; i < t.kvMounts; i++ {
		tm := t.mounts[i]
		if tm.cluster != nil || t.space.Fits(tm.sp, size, space.High) {
			return true
		}
	}
	return false
}

// demoteVictim moves victim v of an eviction on m to its target mount. It
// returns the bytes freed on m, and whether the caller should delete the
// victim instead: the target had no room and the policy said so, or the
// target holds another file at the victim's path, where no demotion of it
// can ever go (RATIONALE.md, "Why is a victim whose demotion target holds
// another file at its path deleted?"). A move that fails once ctx is
// cancelled (the reservation on the target stopped its eviction, or found
// no room there) leaves the victim, deleted in no case, and counts no
// move failure.
//
// A move to a later mount (a slower tier, by convention) may evict there;
// a move to an earlier one only takes free room: evictMu is taken in mount
// order, so nested evictions never deadlock.
//
// A victim bound for the object mount is dropped at once where the
// bucket holds its key; else, with upload, it is uploaded now (or its
// upload under way waited for), and without, left to the demoter's
// background upload (objdemote.go) and kept.
func (t *tiering) demoteVictim(ctx context.Context, m *mount, v policy.Eviction, upload bool) (int64, bool) {
	target := int(v.Target.Mount)
	if t.toObjects(target) {
		return 0, t.demoteToObjects(ctx, v, upload)
	}
	n, err := t.move(ctx, v.Entry, target, target > m.idx)
	switch {
	case err == nil:
		t.st.demotions.Add(1)
		return n, false
	case errors.Is(err, errMoveStale):
		return 0, false
	case ctx.Err() != nil:
		// The caller gave up (its eviction on the target stopped, or the
		// target had no room once it had): no failure of the move's or
		// of either mount's, and no file deleted for a caller that gave
		// up (evict).
		return 0, false
	case errors.Is(err, ErrNoSpace) && v.Target.Flags&abi.MoveDeleteIfFull != 0:
		t.st.demotionDeletes.Add(1)
		return 0, true
	case errors.Is(err, errPathTaken):
		t.st.demotionDeletes.Add(1)
		t.log.Warn("engine: demotion target holds another file at the victim's path; the victim is deleted", "entry", v.Entry, "mount", target, "err", err)
		return 0, true
	}
	t.st.moveFailures.Add(1)
	t.log.Debug("engine: demotion failed; the victim stays", "entry", v.Entry, "mount", target, "err", err)
	return 0, false
}

// toObjects reports whether mount index target is the object mount's.
func (t *tiering) toObjects(target int) bool {
	return t.objs != nil && t.objs.objs != nil && target == t.objs.index()
}

// demoteToObjects reports whether the caller should evict victim v's
// file, bound for the object mount: where the bucket holds its key (the
// key stays stored there, and the removal feed records it moved:
// remover.published). Where it does not, without upload the victim stays
// and the demoter is woken to upload it in the background; with upload
// it is copied now (joining the demoter's upload of it under way), and
// evicted once copied, unless the bucket fails (objectDemoter.failing):
// then it stays at once. Where the copy fails (or the bucket is full)
// the victim stays, unless the store had no room and v says
// MoveDeleteIfFull.
func (t *tiering) demoteToObjects(ctx context.Context, v policy.Eviction, upload bool) bool {
	path, fp, keys, ok := t.ix.Files().FileOf(v.Entry)
	if !ok {
		return false // gone meanwhile: stale
	}
	if len(keys) == 1 && t.objs.holds(fp, []byte(keys[0])) {
		t.st.demotions.Add(1)
		return true
	}
	if !upload {
		if t.demoter != nil {
			t.demoter.wake()
		}
		return false
	}
	var err error
	if t.demoter != nil {
		if failing, full := t.demoter.failing(); failing {
			// The bucket fails: no store waits on it. One full
			// refuses this victim too.
			if full && v.Target.Flags&abi.MoveDeleteIfFull != 0 {
				t.st.demotionDeletes.Add(1)
				return true
			}
			return false
		}
		err = t.demoter.upload(ctx, v.Entry, fp, keys, path)
	} else {
		_, err = t.objs.copy(ctx, fp, keys, path)
	}
	switch {
	case err == nil:
		t.st.demotions.Add(1)
		return true
	case ctx.Err() != nil:
		return false // the caller gave up (demoteVictim)
	case errors.Is(err, syscall.ENOSPC) && v.Target.Flags&abi.MoveDeleteIfFull != 0:
		t.st.demotionDeletes.Add(1)
		return true
	}
	t.st.moveFailures.Add(1)
	t.log.Debug("engine: demotion to the object mount failed; the victim stays", "entry", v.Entry, "path", path, "err", err)
	return false
}

// move moves entry id's file to mount target (the same relative path under
// its root) and returns its size. mayEvict lets the reservation on the
// target evict there; without it the move takes only free room there
// (reserveFree). Where the target already holds a file of the same keys
// at the path, the entry is dropped for it instead (dropCopy). It fails
// with errMoveStale when the entry is gone, pinned, busy or another live
// node's, with ErrNoSpace when the target has no room, and with
// errPathTaken when the target holds another file at the path.
func (t *tiering) move(ctx context.Context, id uint64, target int, mayEvict bool) (int64, error) {
	return t.moveEntry(ctx, id, target, mayEvict, false)
}

// moveEntry is move; with held, the restart hold's pin does not keep the
// entry where it is (demoteHeld): a file the hold pins moves with its pin,
// which the copy takes over (index.Pins.holdLocked), and the policy is told
// of it (AccessPin after the copy's INSERT).
func (t *tiering) moveEntry(ctx context.Context, id uint64, target int, mayEvict, held bool) (int64, error) {
	if target < 0 || target >= t.kvMounts {
		return 0, fmt.Errorf("%w: move to mount %d: the kvhost mounts are 0..%d", ErrPolicy, target, t.kvMounts-1)
	}
	tm := t.mounts[target]
	ix := t.ix
	// A move removes its source, so it needs the right an eviction needs:
	// on a cluster mount, only this node's files and those of a dead node
	// it adopted (a policy knows other nodes' files it found).
	may := func(en *entry) bool {
		return en.Mount != target && en.Mount < t.kvMounts && t.mounts[en.Mount].mayEvict(en)
	}
	to := func(en *entry) (string, error) {
		sm := t.mounts[en.Mount]
		rel, err := filepath.Rel(sm.root, en.Path)
		if err != nil || rel == ".." || strings.HasPrefix(rel, ".."+string(filepath.Separator)) {
			return "", fmt.Errorf("engine: move: %s is not under its mount %s", en.Path, sm.root)
		}
		return filepath.Join(tm.root, rel), nil
	}
	en, dup, dst, stale, err := ix.ClaimMove(id, held, may, to)
	switch {
	case err != nil:
		return 0, err
	case stale:
		return 0, errMoveStale
	case dup != nil && !dup.SameKeys(en):
		return 0, fmt.Errorf("%w: move of %s: %s holds other keys", errPathTaken, en.Path, dst)
	}
	sm := t.mounts[en.Mount]
	size := en.Size
	unindexed := false // en left the index for its copy: removeMoved releases en.path
	defer func() {
		if !unindexed {
			t.rm.release(en.Path)
		}
	}()
	defer t.rm.release(dst)
	if dup != nil {
		if err := t.dropCopy(ctx, en, dup, held); err != nil {
			return 0, err
		}
		unindexed = true
		return t.removeMoved(en), nil
	}

	if mayEvict {
		if err := t.room.reserve(ctx, tm, size); err != nil {
			// No room on tm after evicting what could be, as a store's
			// reservation there fails: tm refuses stores (mountfail.go).
			// A move into free room only (reserveFree) tried no eviction.
			t.watch.storeEnded(tm, size, err)
			return 0, err
		}
	} else if err := t.room.reserveFree(tm, size); err != nil {
		return 0, err
	}
	t.slots.moving.Add(1) // a file in flight that takes no slot (spareMaker.fileEnded)
	en2, left, err := t.copyFile(en, tm, dst)
	t.slots.moving.Add(-1)
	t.maker.fileEnded()
	if err != nil {
		if left != nil {
			ix.Leaving().Leave(left, dst) // the reservation counts the copy left
		} else {
			t.room.unreserve(tm, size)
		}
		return 0, err
	}
	// The source counts as used until it is removed (free, below); the
	// reservation becomes the copy's entry. The copy is indexed first:
	// the keys never leave the index's key set (MirrorKeys), a miss of
	// which a client of the shared lookup table may take for final.
	recs, ok := ix.Moved(en, en2, held)
	if !ok {
		// Deleted, evicted or pinned by a load while it was copied: the
		// copy goes; the source stays (or goes with its own removal).
		if left := t.rm.removeIfSame(dst, []*entry{en2}); left != nil {
			ix.Leaving().Leave(left, dst) // the reservation counts the copy left
		} else {
			t.room.unreserve(tm, size)
		}
		return 0, errMoveStale
	}
	if tm.idx < sm.idx {
		t.st.promotions.Add(1)
	}
	t.rm.movedKeys(en, en2)
	t.files.access(ctx, recs)
	unindexed = true
	return t.removeMoved(en), nil
}

// removeMoved removes the file of en, the source of a move whose copy (or
// the file already at the target: dropCopy) took its place in the index,
// and returns its size. The move holds en's path, which it releases. The
// removal is a dropped entry's (removeAt): en is among the files being
// removed (index.Leaving's removing) from its unindexing on, and where the unlink
// fails its file is left for an eviction to try again (index.Leaving's left), its
// bytes still counted; a cluster adopter retires no dead node meanwhile
// (leftOf).
func (t *tiering) removeMoved(en *entry) int64 {
	t.rm.removeAt(en.Path, en)
	t.maker.room() // the source's room
	return en.Size
}

// dropCopy ends the move of en onto a mount whose file at the same path,
// dup, holds the same keys: another node's copy on a shared mount, or an
// older one of this node's. Their bytes are the same KV, so nothing is
// copied: en leaves the index for dup (its keys handed over first, so that
// they never leave the index's key set; a lookup, load, pin, delete or
// store that found en acts on dup) and its file is removed, checked by
// identity. The policy sees a REMOVE of en and, where en was used last, an
// INSERT that updates dup with en's last access and hits. It fails with
// errMoveStale where en was pinned or dropped meanwhile, or dup's file is
// no longer at its path (its entry dropped: a later move copies); once it
// returns nil, en's file is the caller's to remove (removeMoved).
// The caller holds both paths. With held, the restart hold's pin does not
// keep en (moveEntry): where en was held, dup is held in its place.
func (t *tiering) dropCopy(ctx context.Context, en, dup *entry, held bool) error {
	if !t.shared.confirm(ctx, dup) {
		return errMoveStale
	}
	recs, ok := t.ix.MovedTo(en, dup, held)
	if !ok {
		return errMoveStale
	}
	t.rm.movedKeys(en, dup)
	if t.mounts[dup.Mount].idx < t.mounts[en.Mount].idx {
		t.st.promotions.Add(1)
	}
	t.files.access(ctx, recs)
	return nil
}

// copyFile copies en's file (checked to be en's by identity and header id)
// to dst on mount tm: an owned temporary file, fsynced with Config.Fsync,
// renamed into place. It returns the unindexed entry of the copy, or an
// error and, where the copy was published and could not be removed again,
// its entry left (publish). The caller holds both paths.
func (t *tiering) copyFile(en *entry, tm *mount, dst string) (en2, left *entry, err error) {
	src, h, err := t.hd.openSame(en, os.O_RDONLY)
	if err != nil {
		return nil, nil, fmt.Errorf("engine: move: open %s: %w", en.Path, err)
	}
	defer src.Close()
	// From here the copy is a file written on tm, as a store's is: how it
	// ends starts, extends or ends tm's refusal of stores (mountfail.go),
	// but where reading the source failed, which is no fault of tm's.
	readFailed := false
	defer func() {
		if !readFailed {
			t.watch.storeEnded(tm, en.Size, err)
		}
	}()
	f, tmp, op, err := t.own.createTemp(tm, filepath.Dir(dst), 0, en.Size)
	if err != nil {
		return nil, nil, ioError(tm, "move: "+op, err)
	}
	published := false
	defer func() {
		if !published {
			t.rm.removeTemp(tm, tmp, f, en.Size)
		}
		if f != nil {
			f.Close()
		}
	}()
	// Whole large folios on the target (a tmpfs with huge pages): a write
	// of part of one would have the kernel zero the rest first.
	buf, put := t.bufs.copyBuffer(min(max(int64(copyChunk), tm.folio), max(en.Size, 1)))
	defer put()
	for off := int64(0); off < en.Size; {
		n, rerr := src.ReadAt(buf[:min(int64(len(buf)), en.Size-off)], off)
		if n > 0 {
			if _, err := f.WriteAt(buf[:n], off); err != nil {
				return nil, nil, ioError(tm, "move: write", err)
			}
			off += int64(n)
		}
		if rerr != nil && (!errors.Is(rerr, io.EOF) || off < en.Size) {
			if errors.Is(rerr, io.EOF) {
				rerr = fmt.Errorf("%w: %s shrank to %d bytes while it was copied", ErrCorrupt, en.Path, off)
			}
			readFailed = true
			return nil, nil, fmt.Errorf("engine: move: read %s: %w", en.Path, rerr)
		}
	}
	if t.hd.rewrittenUnder(t.mounts[en.Mount], src, h) {
		// Another engine on the directory evicted the source and a store
		// of it wrote into it (spare files) while it was copied, as a
		// load checks (loadRound): the copy may hold its header over
		// another key's bytes. The source is no longer en's file; the
		// copy is removed unpublished.
		readFailed = true
		t.rm.dropVanished(context.Background(), en, "rewritten while moved")
		return nil, nil, fmt.Errorf("%w: %s was rewritten while it was copied (evicted and reused by another engine on the directory): %w", errMoveStale, en.Path, errReplaced)
	}
	// The copy keeps the source's modification time, which Open takes for
	// the last access: a restart ranks a moved file as before the move.
	mt := unix.NsecToTimeval(en.Ident.Mtime)
	if err := unix.Futimes(int(f.Fd()), []unix.Timeval{mt, mt}); err != nil {
		t.log.Debug("engine: move: keep the modification time", "path", tmp, "err", err)
	}
	// Not cancelled once copied: the move finishes what it began (the
	// source stays where the copy fails).
	en2 = &entry{NS: en.NS, FP: en.FP, Mount: tm.idx, Path: dst, Size: en.Size, Keys: en.Keys, FID: en.FID}
	published, left, err = t.files.publish(context.Background(), tm, f, tmp, en2, nil, "move: ")
	if published {
		f = nil // closed
	}
	if err != nil {
		return nil, left, err
	}
	return en2, nil, nil
}

// dedupe drops, from the files found at Open, every second copy of a file
// (the same header id, fingerprint and keys at two paths): what a move
// killed between its rename and the removal of its source leaves. The copy
// with the newest ctime (the move's target) is kept, the other removed, if
// it is still the file read; where its removal fails, it is a file left on
// disk (index.Leaving's left), counted as used until an eviction on its mount
// removes it. Files without an id are never merged.
func (t *tiering) dedupe(found []*entry) []*entry {
	type fileKey struct{ fp, fid uint64 }
	keep := map[fileKey]*entry{}
	var drop []*entry
	dropped := map[*entry]bool{}
	for _, en := range found {
		if en.FID == 0 {
			continue
		}
		k := fileKey{en.FP, en.FID}
		other, ok := keep[k]
		if !ok || !slices.Equal(other.Keys, en.Keys) {
			if !ok {
				keep[k] = en
			}
			continue
		}
		if en.Ident.Ctime > other.Ident.Ctime || en.Ident.Ctime == other.Ident.Ctime && en.Mount < other.Mount {
			keep[k], en = en, other
		}
		drop = append(drop, en)
		dropped[en] = true
	}
	if len(drop) == 0 {
		return found
	}
	out := found[:0]
	for _, en := range found {
		if !dropped[en] {
			out = append(out, en)
		}
	}
	for _, en := range drop {
		t.log.Info("engine: second copy of a moved file removed", "path", en.Path, "kept", keep[fileKey{en.FP, en.FID}].Path)
		if left := t.rm.removeIfSame(en.Path, []*entry{en}); left != nil {
			t.space.Left(t.mounts[left.Mount].sp, left.Size)
			t.ix.Leaving().Leave(left, en.Path)
			continue
		}
		t.st.deduped.Add(1)
	}
	return out
}

// retarget sends the file of group gr to mount target, as admission chose
// (abi.FeatureAdmitMount): the same relative path under the target's root.
func (t *tiering) retarget(ns *namespace, gr *group, target uint32) error {
	if ns.layout != nil || int(target) == gr.mount {
		return nil // a vllm-fs namespace's files are its mount's
	}
	if t.toObjects(int(target)) {
		// Written on its name's mount, whence it is copied (published).
		gr.toObjects = true
		return nil
	}
	if int(target) >= t.kvMounts {
		return fmt.Errorf("%w: admission chose mount %d: the kvhost mounts are 0..%d", ErrPolicy, target, t.kvMounts-1)
	}
	rel, err := filepath.Rel(t.mounts[gr.mount].root, gr.path)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrPolicy, err)
	}
	m := t.mounts[target]
	gr.mount, gr.path = int(target), filepath.Join(m.root, rel)
	gr.hdr.Flags &^= format.FlagPayloadSums
	if m.checksums {
		gr.hdr.Flags |= format.FlagPayloadSums
	}
	return nil
}

// fsClass is the device class a file system kind implies.
func fsClass(k fstype.Kind) uint32 {
	switch {
	case k.Memory:
		return abi.ClassMemory
	case k.Network:
		return abi.ClassNetwork
	}
	return abi.ClassUnknown
}

// DeviceClasses are the names Mount.DeviceClass takes.
var deviceClasses = map[string]uint32{
	"memory": abi.ClassMemory, "nvme": abi.ClassNVMe, "ssd": abi.ClassSSD, "hdd": abi.ClassHDD, "network": abi.ClassNetwork,
}

// describeMount finds m's file system and device class: configured
// (Mount.DeviceClass) or detected from statfs and, for a local block
// device, sysfs (nvme in the device's path; queue/rotational). Open
// describes every mount once (reportMounts, mount.desc).
func describeMount(fs fsys.FS, log *slog.Logger, m *mount, configured string) mountDesc {
	var d mountDesc
	st, err := fs.Statfs(m.root)
	if err == nil {
		d.fsType = uint32(st.Type)
		if k, ok := fstype.Of(st.Type); ok {
			d.fsName, d.class = k.Name, fsClass(k)
		}
	}
	if c, ok := deviceClasses[configured]; ok {
		d.class, d.configured = c, true
		return d
	}
	if configured != "" {
		log.Warn("engine: unknown device class; detecting it", "mount", m.root, "device_class", configured)
	}
	if d.class == abi.ClassUnknown {
		d.class = blockClass(m.root)
	}
	return d
}

// blockClass is the class of the block device under dir, from sysfs.
func blockClass(dir string) uint32 {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return abi.ClassUnknown
	}
	dev := fmt.Sprintf("/sys/dev/block/%d:%d", unix.Major(st.Dev), unix.Minor(st.Dev))
	link, err := os.Readlink(dev)
	if err != nil {
		return abi.ClassUnknown
	}
	if strings.Contains(link, "/nvme") {
		return abi.ClassNVMe
	}
	for _, p := range []string{dev + "/queue/rotational", dev + "/../queue/rotational"} {
		if b, err := os.ReadFile(p); err == nil {
			if strings.TrimSpace(string(b)) == "1" {
				return abi.ClassHDD
			}
			return abi.ClassSSD
		}
	}
	return abi.ClassUnknown
}
