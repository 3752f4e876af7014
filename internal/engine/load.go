package engine

import (
	"context"
	"errors"
	"fmt"
	"golang.org/x/sys/unix"
	"runtime/trace"
	"slices"
	"sync"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/format"
)

// Load loads keys into cache blocks, asynchronously. The request is
// validated at once; the returned Job reports, per key, loaded, missing or
// failed. Files are pinned (never evicted) while the job reads them, every
// header is checked against the namespace and key, and payload checksums are
// verified: a corrupt file is a failed key and is dropped.
func (e *Engine) Load(ctx context.Context, req LoadRequest) (*Job, error) {
	c, err := e.tables.request(req.Cache, req.Keys, req.Blocks, true)
	if err != nil {
		return nil, err
	}
	if err := distinctBlocks(req.Blocks); err != nil {
		return nil, err
	}
	lr := req.Layers
	if err := lr.check(c.ns.geo.Layers); err != nil {
		return nil, err
	}
	if lr.Count == c.ns.geo.Layers {
		lr = LayerRange{} // every layer: verified by whole keys, the fewest checksums
	}
	keys, blocks := cloneRequest(req.Keys, req.Blocks)
	j, jctx, err := e.newJob(ctx, "load", len(keys))
	if err != nil {
		return nil, err
	}
	j.mem = c.kind
	turn := c.loads.take()
	go e.runLoad(jctx, j, c, keys, blocks, lr, turn)
	return j, nil
}

func (e *Engine) runLoad(ctx context.Context, j *Job, c *cache, keys [][]byte, blocks [][]int, lr LayerRange, turn loadTurn) {
	defer e.finish(j)
	// An execution trace (kvhost bench --trace, or the metrics
	// listener's /debug/pprof/trace) shows each load as a task and its
	// phases as regions (docs/performance.md).
	ctx, task := trace.NewTask(ctx, "load")
	defer task.End()
	if !lr.all() {
		trace.Log(ctx, "layers", lr.String())
	}
	ns := c.ns
	set := func(i int, o Outcome, err error) { j.res.Keys[i] = KeyResult{Outcome: o, Err: err} }

	// Find and pin the file of every key; one read task per file.
	byEntry := map[*entry][]int{}
	var order []*entry
	var pins []abi.AccessRecord
	var objs []int // request indices of keys read from the object mount
	dup := func(en *entry) bool { _, ok := byEntry[en]; return ok }
	pinning := trace.StartRegion(ctx, "load: pin")
	for i, k := range keys {
		// The index's entry is found and pinned in one hold of the lock
		// (every load takes it); a key it lacks is looked for on disk.
		en, pinned := e.ix.Pins().PinKey(ns.fp, k, dup, e.cfg.Now().UnixNano(), &pins)
		if en == nil {
			if en = e.shared.discover(ctx, ns, k); en != nil {
				en, pinned = e.ix.Pins().PinFound(en, k, dup, e.cfg.Now().UnixNano(), &pins)
			}
		}
		if !pinned && en == nil && e.objs.has(ns, k) {
			objs = append(objs, i) // in the object mount (objects.go)
			continue
		}
		if !pinned {
			e.st.misses.Add(1)
			set(i, OutcomeMissing, fmt.Errorf("%w: key %x: not indexed, and no file under its name holds it", ErrNotFound, k))
			continue
		}
		if _, ok := byEntry[en]; !ok {
			order = append(order, en)
		}
		byEntry[en] = append(byEntry[en], i)
	}
	e.access(ctx, pins)
	pinning.End()

	// The cache's earlier loads take their file slots first; the load of a
	// step's last layers waits for the previous load's end (loadOrder).
	waiting := trace.StartRegion(ctx, "load: turn")
	tail := lr.tail(c.ns.geo.Layers)
	if tail && turn.prev != nil {
		e.st.tailTurns.Add(1)
	}
	turn.wait(ctx, tail)
	waiting.End()
	slots := trace.StartRegion(ctx, "load: file slots")
	var wg sync.WaitGroup
	failAll := func(idx []int, err error) {
		for _, i := range idx {
			set(i, OutcomeFailed, err)
		}
	}
	// spawn runs fn on a goroutine of its own once acquire took its
	// slot, which release gives back after; where ctx ends first it fails
	// the keys idx (and reports false).
	spawn := func(idx []int, acquire func(context.Context) error, release func(), fn func()) bool {
		if err := acquire(ctx); err != nil {
			failAll(idx, err)
			return false
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer release()
			fn()
		}()
		return true
	}
	withSlot := func(idx []int, fn func()) bool { return spawn(idx, e.mv.slots.acquire, e.releaseSlot, fn) }
	for _, en := range order {
		idx := byEntry[en]
		// A disk's loads wait for one of its readers first (package
		// iotune: as many at once as it moves fastest), before a file
		// slot, which another mount's loads may want meanwhile.
		g := e.mounts[en.Mount].readers
		if g == nil {
			withSlot(idx, func() { e.loadFile(ctx, j, c, keys, blocks, lr, en, idx, !e.mounts[en.Mount].direct) })
			continue
		}
		rd, err := g.Acquire(ctx)
		if err != nil {
			failAll(idx, err)
			continue
		}
		if !withSlot(idx, func() {
			// Whole files measure the mount's rate; a layer range's
			// reads (a part of each file, the read-ahead past it) do not.
			if lr.all() {
				defer g.Release(rd, en.Size)
			} else {
				defer g.ReleaseUnmeasured(rd)
			}
			// A layer range reads just its bytes, with O_DIRECT where
			// the mount takes it, whatever the arm: through the page
			// cache the kernel reads ahead into the next layers, and a
			// layer-wise load's first layer waited for several layers'
			// reads (RATIONALE.md, "Why do a local disk's loads start
			// buffered, when its stores write with O_DIRECT?").
			e.loadFile(ctx, j, c, keys, blocks, lr, en, idx, rd.Buffered() && (lr.all() || !e.mounts[en.Mount].direct))
		}) {
			g.ReleaseUnmeasured(rd) // no file slot: ctx ended
		}
	}
	for _, i := range objs {
		// An object's key waits on the network: it takes a slot of the
		// object mount's, not a file slot.
		spawn([]int{i}, e.objs.takeSlot, e.objs.giveSlot, func() { e.objs.load(ctx, j, c, keys, blocks, lr, i) })
	}
	turn.done() // every file has its slot: the cache's next load may take slots
	slots.End()
	files := trace.StartRegion(ctx, "load: files")
	wg.Wait()
	files.End()
	turn.ended()

	// Unpin; loaded entries count as hits. A layer-wise load of a key
	// is one job per group of layers: only the group that starts at
	// layer 0 counts, so that the policy sees one use, not one per group.
	loaded := func(en *entry) bool {
		return lr.First == 0 && slices.ContainsFunc(byEntry[en], func(i int) bool { return j.res.Keys[i].Outcome == OutcomeLoaded })
	}
	e.access(ctx, e.ix.Pins().UnpinLoad(order, loaded, e.cfg.Now().UnixNano()))
}

// loadFile reads the layers lr of the keys idx (request indices) from en's
// file into their blocks and verifies them; buffered through the page
// cache (on a mount that reads with O_DIRECT, as its readers chose:
// the file's pages are dropped after).
func (e *Engine) loadFile(ctx context.Context, j *Job, c *cache, keys [][]byte, blocks [][]int, lr LayerRange, en *entry, idx []int, buffered bool) {
	set := func(i int, o Outcome, err error) { j.res.Keys[i] = KeyResult{Outcome: o, Err: err} }
	all := func(o Outcome, err error) {
		for _, i := range idx {
			set(i, o, err)
		}
		if o == OutcomeMissing {
			e.st.misses.Add(uint64(len(idx)))
		}
	}
	if err := ctx.Err(); err != nil {
		all(OutcomeFailed, err)
		return
	}
	m := e.mounts[en.Mount]
	// Never through a link planted below the root since the file was
	// indexed: a file reached so is not in the mount, neither this
	// engine's to serve nor to index (openNoLinks). The entry's file is
	// gone from its path as much as one removed. Nor waiting on a named
	// pipe put at the name (checkOpen; openData). A file its client
	// pins hold open is read there (openLoad).
	opening := trace.StartRegion(ctx, "load: open")
	f, id, idErr, err := e.chk.openLoad(m, en, buffered)
	opening.End()
	if err != nil {
		all(e.shared.vanished(ctx, en, err))
		return
	}
	defer f.Close()
	if buffered && m.direct {
		// Read through the page cache for its read-ahead, not to fill
		// it (whole files only: a layer range reads such a mount with
		// O_DIRECT).
		defer dropPages(f)
	}
	corrupt := func(err error) {
		e.st.corrupt.Add(1)
		e.cfg.Logger.Warn("engine: corrupt file dropped", "path", en.Path, "err", err)
		e.rm.drop(ctx, en, true, "corrupt")
		// Nor is a file its client pins hold open read again: later
		// loads miss, as they do where no pin held it.
		e.ix.Pins().UnkeepPinned(en)
	}
	// One fstat (openData's) serves the header (vllm-fs mounts) and the
	// checks below.
	var h *format.Header
	if idErr != nil && m.raw != nil {
		err = idErr // a vllm-fs header needs the file's size
	} else {
		h, err = e.hd.fileHeader(en.Mount, en.Path, f, id)
	}
	if err != nil {
		if errors.Is(err, ErrCorrupt) {
			corrupt(err) // not an I/O error: the file stays for the next load
		}
		all(OutcomeFailed, fmt.Errorf("engine: load %s: %w", en.Path, err))
		return
	}
	if en, err = e.shared.replaced(ctx, c.ns, m, en, h, id, idErr); err != nil {
		all(OutcomeMissing, err)
		return
	}
	// A file shorter than its header says was truncated behind our back:
	// corrupt, whatever the keys asked.
	if idErr == nil && id.Size < h.FileLen() {
		err := fmt.Errorf("%w: %s: %d bytes, the header says %d", ErrCorrupt, en.Path, id.Size, h.FileLen())
		corrupt(err)
		all(OutcomeFailed, err)
		return
	}
	// The file's identity at its open, where a load may rely on layers
	// verified before (checked.go): none where the fstat failed.
	var known fsys.Identity
	if idErr == nil {
		known = id
	}
	// The destinations of each key of the file, in request order. A key
	// asked twice (into different blocks) is read once per destination:
	// round r reads the r-th destination of every key asked r+1 times.
	dsts := make([][]int, len(h.Keys))
	for _, i := range idx {
		k, err := h.Match(c.ns.fp, keys[i])
		if err != nil {
			e.st.misses.Add(1)
			set(i, OutcomeMissing, fmt.Errorf("%w: %w: %s: the file there (replaced behind this engine's back) does not hold the key: %w", ErrNotFound, ErrMismatch, en.Path, err))
			continue
		}
		dsts[k] = append(dsts[k], i)
	}
	for round := 0; ; round++ {
		dst := make([]int, len(h.Keys)) // file key -> request index, this round
		var read []int
		for k, d := range dsts {
			if len(d) > round {
				dst[k] = d[round]
				read = append(read, k)
			}
		}
		if len(read) == 0 {
			return // nothing (more) asked of this file
		}
		if !e.loadRound(ctx, j, c, blocks, lr, en, f, h, m, known, dst, read, corrupt) {
			// The file was judged corrupt: later destinations fail alike,
			// unread. A key that verified in this round loaded into
			// this round's blocks only: its later destinations fail.
			for k, d := range dsts {
				for _, i := range d[min(len(d), round+1):] {
					o, err := j.res.Keys[dst[k]].Outcome, j.res.Keys[dst[k]].Err
					if o == OutcomeLoaded {
						o, err = OutcomeFailed, fmt.Errorf("%w: %s: another key of the file failed its checksum before this destination of key %d was read", ErrCorrupt, en.Path, k)
					}
					set(i, o, err)
				}
			}
			return
		}
	}
}

// loadRound reads the layers lr of the file keys read of f into the
// blocks of the request indices dst[k], verifies them and sets their
// outcomes. It reports false if the file was found corrupt (the caller
// stops). id is the file's identity at its open (zero if unknown).
//
// A key is verified by its layers' checksums where the file has them
// (format.Header.LayerSums) and lr is not every layer: only lr's bytes
// are read. Otherwise by the key's checksum, over the whole key: its
// bytes not loaded (NoBlock blocks, layers outside lr) are read for it.
//
// On a memory mount, layers the engine wrote or verified at the file's
// present ctime are not summed again (checkedBefore): the load checks
// instead that the ctime did not move while it read, and where it did
// reads the round again, verifying it.
func (e *Engine) loadRound(ctx context.Context, j *Job, c *cache, blocks [][]int, lr LayerRange, en *entry, f fsys.File, h *format.Header, m *mount, id fsys.Identity, dst []int, read []int, corrupt func(error)) bool {
	set := func(i int, o Outcome, err error) { j.res.Keys[i] = KeyResult{Outcome: o, Err: err} }
	want := make([]bool, len(h.Keys))
	for _, k := range read {
		want[k] = true
	}
	mv, err := m.mover(c.kind)
	if err != nil {
		for _, k := range read {
			set(dst[k], OutcomeFailed, err)
		}
		return true
	}
	check := h.Flags&format.FlagPayloadSums != 0 && m.checksums && mv.Checksums()
	trusted := check && checkedBefore(m, en, h, id, read, lr)
	if trusted {
		check = false
	}
	by := verifyNone
	switch {
	case check && !lr.all() && h.LayerSums != nil:
		by = verifyLayers
	case check:
		by = verifyKeys
	}
	plan, sk := c.plan(h, want, func(k int) []int { return blocks[dst[k]] }, m, lr, by)
	var sums []uint32
	if check {
		sums = make([]uint32, plan.Sums)
	}
	reading := trace.StartRegion(ctx, "load: read")
	err = readPlan(ctx, mv, f, plan, sk, sums, &e.busy.io)
	reading.End()
	if err != nil {
		ok := true
		if isShort(err) {
			// Truncated while we read it.
			if !errors.Is(err, ErrCorrupt) {
				err = fmt.Errorf("%w: %w", ErrCorrupt, err)
			}
			corrupt(err)
			ok = false
		}
		for _, k := range read {
			set(dst[k], OutcomeFailed, fmt.Errorf("engine: load %s: %w", en.Path, err))
		}
		return ok
	}
	if trusted {
		if !unchangedSince(f, id) {
			// Its ctime moved while it was read: written, or only
			// renamed or unlinked (which set it too). The round is read
			// again and verified (nothing marked: no ctime is known).
			en.Checked.Store(nil)
			return e.loadRound(ctx, j, c, blocks, lr, en, f, h, m, fsys.Identity{}, dst, read, corrupt)
		}
		e.st.checkedBefore.Add(uint64(len(read)))
	}
	if e.shared.rewritten(ctx, en, m, f, h) {
		for _, k := range read {
			set(dst[k], OutcomeFailed, fmt.Errorf("engine: load %s: %w: rewritten while it was read (evicted and reused by another engine on the directory)", en.Path, errReplaced))
		}
		return false
	}
	var errs []error // file key -> why it failed; nil: all verified
	bad := false
	if check {
		verifying := trace.StartRegion(ctx, "load: verify")
		errs, bad = verifyRead(ctx, f, h, sk, sums, read, en.Path)
		verifying.End()
	}
	for _, k := range read {
		if errs != nil && errs[k] != nil {
			set(dst[k], OutcomeFailed, errs[k])
			continue
		}
		set(dst[k], OutcomeLoaded, nil)
		e.st.loaded(j, lr, by == verifyKeys, sk.moved[k]+sk.skipped[k], sk.moved[k])
	}
	if bad {
		corrupt(fmt.Errorf("%w: payload checksum", format.ErrCorrupt))
	} else if check && errs == nil {
		// Every key read verified: by its layers' sums, or whole.
		marked := lr
		if by == verifyKeys {
			marked = LayerRange{}
		}
		markChecked(m, en, h, id.Ctime, read, marked)
	}
	return !bad
}

// dropPages asks the kernel to drop f's cached pages: a load that read
// through the page cache for its read-ahead leaves the cache to the
// machine's other users (best effort: the pages are clean).
func dropPages(f fsys.File) {
	_ = unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
}
