package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/engine/index"
	"github.com/kvhost/kvhost/internal/engine/space"
)

// Holding the files found at start (Config.RestartHold): each is pinned
// once before anything may evict (the cluster's first count included)
// and unpinned when the hold ends, so that nothing is evicted, promoted
// or moved by a tick before clients that were loading keys when the last
// process went have pinned them again. What the hold promises is that
// those keys stay loadable: an eviction that finds nothing else to take
// may demote a held file to another mount, into free room there
// (restartHold.demote), and the copy keeps the hold's pin. A pin of the hold is
// not a client pin: Delete still removes a held file. Held entries are
// marked (entry.held) and listed by mount (index.Pins' heldOrder), so that the
// release unpins only them and a demotion round visits only its own
// mount's, each in chunks of heldChunk under the index's write lock. A
// policy that replaces the current one is told of their pins as of
// every pin (reload.go).
//
// A hold is not re-armed by restarts faster than it (holdRecord): the
// start of the hold running is kept beside Config.LockFile, and a
// process whose predecessor did not run for a whole restart_hold keeps
// only what is left of that hold, measured from its start, and none once
// it is over; only a process that runs for a whole restart_hold marks
// the hold done, so that the next restart holds for all of it again. A crash loop then holds its files for one
// restart_hold in all, and its stores evict by the policy's order after
// that, rather than failing, or evicting only the files stored since the
// last start, at every restart (RATIONALE.md, "Why is the restart hold
// not re-armed by every restart?").

// restartHold is the pin of the files found at start; the files it holds
// are the index's entries marked held.
type restartHold struct {
	log    *slog.Logger
	now    func() time.Time
	ix     *index.Index
	space  *space.Space
	tier   *tiering // demotes held files (demote)
	events accessor // the policy's events (AccessPin, AccessUnpin)

	// mu serializes the release and demote: Close returns only after
	// a release the timer began has told the policy, and a release never
	// comes between demote's lifting of the hold's pins in the
	// policy's view and their return.
	mu     sync.Mutex
	timer  *time.Timer // the release; nil before the hold and once released
	record holdRecord  // where the hold's start is kept across restarts
	settle *time.Timer // marks the hold done once this process ran for it; nil once run or stopped
}

// accessor reports events to the policy (hits.go).
type accessor interface {
	access(ctx context.Context, recs []abi.AccessRecord)
}

// newRestartHold is the restart hold of e, whose tiering part is made.
func newRestartHold(e *Engine) *restartHold {
	h := &restartHold{log: e.cfg.Logger, now: e.cfg.Now, ix: e.ix, space: e.space, tier: e.tier, events: e}
	if e.cfg.LockFile != "" {
		h.record = holdRecord{fs: e.fs, path: e.cfg.LockFile + holdSuffix}
	}
	return h
}

// start pins every indexed entry until the hold running ends (window:
// d from now, or what is left of the hold a predecessor began) and tells
// the policy (AccessPin), then arms the release. Called by Open after
// the policy is restored, before the cluster's first count and any
// request.
func (h *restartHold) start(ctx context.Context, d time.Duration) {
	if d <= 0 {
		return
	}
	at := h.now()
	left := h.window(at, d)
	if left <= 0 {
		return
	}
	recs := h.ix.Pins().HoldAll(at.UnixNano())
	if len(recs) == 0 {
		return
	}
	h.events.access(ctx, recs)
	h.mu.Lock()
	h.timer = time.AfterFunc(left, func() { h.release(true) })
	h.mu.Unlock()
	h.log.Info("engine: files found at start are held from eviction", "files", len(recs), "for", left.Round(time.Millisecond))
}

// window returns how long the files found at now are held, for a hold of
// d: d where the last hold is over (a process ran for a whole one, or
// none was recorded), else what is left of it, which is 0 or less once
// it has passed. It records a new hold's start and arms the mark of its
// end for d from now, when this process will have run for a whole hold.
// Without a record (no Config.LockFile), or where it cannot be read or
// written, every start holds for d, as each process did before records.
func (h *restartHold) window(now time.Time, d time.Duration) time.Duration {
	if h.record.path == "" {
		return d
	}
	began, ok, err := h.record.running()
	switch {
	case err != nil:
		h.log.Warn("engine: the restart hold's record cannot be read; this start holds for the whole restart_hold", "file", h.record.path, "err", err)
		ok = false
	case ok && began.After(now):
		ok = false // a clock set back: the record says nothing of now
	}
	left := d
	if ok {
		left = began.Add(d).Sub(now)
		if left > 0 {
			h.log.Info("engine: the restart hold a previous process began is continued, not re-armed: that process stopped within restart_hold",
				"began", began.Format(time.RFC3339Nano), "left", left.Round(time.Millisecond))
		} else {
			h.log.Warn("engine: files found at start are not held: the restart hold a previous process began is over, and no process since ran for restart_hold (restarts faster than the hold, a crash loop?); the next start after a process runs that long holds them again",
				"began", began.Format(time.RFC3339Nano), "restart_hold", d)
		}
	} else if err := h.record.begin(now); err != nil {
		h.log.Warn("engine: the restart hold's start cannot be recorded; a restart before it ends will hold its files again", "file", h.record.path, "err", err)
	}
	h.mu.Lock()
	h.settle = time.AfterFunc(d, h.done)
	h.mu.Unlock()
	return left
}

// done marks the hold over in its record, this process having run for a
// whole restart_hold: the next start holds its files for all of it.
func (h *restartHold) done() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.settle == nil {
		return // stopped by Close
	}
	h.settle = nil
	if err := h.record.end(); err != nil {
		h.log.Warn("engine: the end of the restart hold cannot be recorded; the next start holds only what is left of it", "file", h.record.path, "err", err)
	}
}

// release ends the hold of the files found at start, once: each
// still indexed loses its pin (one removed meanwhile lost it then:
// index.unindexLocked), and with tell the policy is told (AccessUnpin).
// Close calls it without telling (the policy is closing), as does a
// failed Open.
func (h *restartHold) release(tell bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !tell && h.settle != nil {
		// The process ends before it ran for a whole hold: the record
		// keeps the hold running for its successor.
		h.settle.Stop()
		h.settle = nil
	}
	if h.timer == nil {
		return
	}
	h.timer.Stop()
	h.timer = nil
	// Only a demotion round (serialized with this by h.mu) holds new
	// entries, so the lists visited are all there will be.
	n, recs := h.ix.Pins().EndHold(tell, h.now().UnixNano())
	h.events.access(context.Background(), recs)
	if tell {
		h.log.Info("engine: files found at start may be evicted again", "files", n)
	}
}

// HeldFound is the number of files found at start that the restart hold
// still pins and that are still stored (Config.RestartHold); 0 once it
// has ended. It waits for no policy call.
func (e *Engine) HeldFound() int { return e.hold.held() }

// held is HeldFound.
func (h *restartHold) held() int { return h.ix.Pins().HeldFound() }

// demote is the last round of an eviction on m (evict) that left too
// little room, while the restart hold pins files there: where the policy
// demotes (abi.FeatureDemote) and picks m's victims (not a cluster
// mount), the hold's pins of m's files that nothing else pins are lifted
// in the policy's view (AccessUnpin), the policy is asked for victims, and
// those it gives a later target mount (a colder tier) are moved there
// (moveEntry with held), into free room only: no eviction on the target
// is made for them, none is promoted to an earlier mount, and
// no victim is deleted, whatever the policy says. A moved file keeps the
// hold's pin, so its keys stay loadable and kept, which is all the hold
// promises (RATIONALE.md, "Why may a file the restart hold pins be
// demoted?"). The pins of the files left where they were are given back
// (AccessPin). A round that moves no file is not run again on m within
// heldRetry of it: the stores meanwhile fail with no space at once
// (RATIONALE.md, "Why is a demotion round of held files that moved none
// not run again at once?"). A caller that gives up (ctx cancelled) before
// the round or while it runs stops it before its next move, with ctx's
// error: the move in flight and the policy's records finish. m.evictMu is
// held; the hold's lock is held throughout, so that its release waits for
// the pins' return.
func (h *restartHold) demote(ctx context.Context, m *mount, size int64) error {
	if m.cluster != nil || h.held() == 0 || h.space.Need(m.sp, size) <= 0 {
		return nil
	}
	if !h.tier.demotes() {
		return nil
	}
	if !h.tier.roomAfter(m, size) {
		return nil // nothing could move: lift no pin for nothing
	}
	if !m.heldIdle.IsZero() && h.now().Sub(m.heldIdle) < heldRetry {
		return nil // the last round moved nothing, just now
	}
	stopped := func() error {
		return fmt.Errorf("engine: mount %s: demotion of files the restart hold pins stopped: %w", m.root, ctx.Err())
	}
	if ctx.Err() != nil {
		return stopped()
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.timer == nil {
		return nil // released meanwhile
	}
	at := h.now()
	now := at.UnixNano()
	var moved int64
	defer func() {
		if moved == 0 && ctx.Err() == nil {
			m.heldIdle = at
		} else {
			m.heldIdle = time.Time{}
		}
	}()
	lifted, recs := h.ix.Pins().LiftHeld(m.idx, now)
	if len(lifted) == 0 {
		return nil
	}
	wctx := context.WithoutCancel(ctx) // records and moves begun finish
	h.events.access(wctx, recs)
	defer func() {
		h.events.access(wctx, h.ix.Pins().Unlift(lifted, h.now().UnixNano()))
	}()

	need := h.space.Need(m.sp, size)
	victims, err := h.tier.evictions(wctx, abi.EvictRequest{Bytes: uint64(need), Time: uint64(now), Mount: uint32(m.idx)})
	if err != nil {
		h.log.Warn("engine: policy victims", "mount", m.root, "err", err)
		return nil
	}
	var freed int64
	for _, v := range victims {
		if freed >= need {
			break
		}
		if ctx.Err() != nil {
			return stopped()
		}
		if v.Target.Mount == abi.NoMount || int(v.Target.Mount) <= m.idx {
			// Held files are never deleted, nor promoted (an earlier
			// mount, the hotter tier): only demoted; the others had
			// their turn.
			continue
		}
		if n, ok := h.tier.demoteHeld(wctx, v); ok {
			freed += n
			moved++
		}
	}
	if moved > 0 {
		h.log.Debug("engine: files the restart hold pins demoted to make room", "mount", m.root, "files", moved, "bytes", freed)
	}
	return nil
}

// heldRetry is the least time between two rounds of demote on a
// mount where the first moved no file.
const heldRetry = time.Second

// holdSuffix names the restart hold's record beside Config.LockFile.
const holdSuffix = ".hold"

// holdRecord is the file that keeps the restart hold running across
// restarts (the hold above): the start of the last hold, and whether a
// process ran for a whole restart_hold since. Only the holder of
// Config.LockFile's flock writes it, so that no two processes do; it is
// replaced whole (a temporary file renamed over it), so that a crash
// leaves the old record or the new one.
type holdRecord struct {
	fs   fsys.FS
	path string // "": no record (no Config.LockFile)
}

// holdState is a holdRecord's content.
type holdState struct {
	Began int64 `json:"began_unix_nano"` // the hold's start
	Done  bool  `json:"done"`            // a process ran for a whole hold since
}

// maxHoldRecord bounds what running reads of a record.
const maxHoldRecord = 4096

// running returns the start of the hold the record keeps running, with
// ok; ok is false where there is no record, or its hold is done.
func (r holdRecord) running() (began time.Time, ok bool, err error) {
	f, err := r.fs.OpenFile(r.path, os.O_RDONLY, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return time.Time{}, false, nil
	}
	if err != nil {
		return time.Time{}, false, fmt.Errorf("engine: restart hold record: %w", err)
	}
	defer f.Close()
	buf := make([]byte, maxHoldRecord)
	n, err := f.ReadAt(buf, 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return time.Time{}, false, fmt.Errorf("engine: restart hold record %s: %w", r.path, err)
	}
	var st holdState
	if err := json.Unmarshal(buf[:n], &st); err != nil {
		return time.Time{}, false, fmt.Errorf("engine: restart hold record %s: %w", r.path, err)
	}
	if st.Done || st.Began <= 0 {
		return time.Time{}, false, nil
	}
	return time.Unix(0, st.Began), true, nil
}

// begin records a hold begun at now and not done.
func (r holdRecord) begin(now time.Time) error {
	return r.write(holdState{Began: now.UnixNano()})
}

// end records the hold done, whenever it began.
func (r holdRecord) end() error { return r.write(holdState{Done: true}) }

// write replaces the record with st.
func (r holdRecord) write(st holdState) error {
	b, err := json.Marshal(st)
	if err != nil {
		return fmt.Errorf("engine: restart hold record: %w", err)
	}
	tmp := r.path + ".tmp"
	// A new file, not a truncated one: the engine truncates no file
	// (TestEngineNeverTruncatesItsFiles); a leftover of a crash mid-write
	// is removed first.
	if err := r.fs.Remove(tmp); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("engine: restart hold record: %w", err)
	}
	f, err := r.fs.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return fmt.Errorf("engine: restart hold record: %w", err)
	}
	_, werr := f.WriteAt(append(b, '\n'), 0)
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr == nil {
		werr = r.fs.Rename(tmp, r.path)
	}
	if werr != nil {
		r.fs.Remove(tmp)
		return fmt.Errorf("engine: restart hold record %s: %w", r.path, werr)
	}
	return nil
}
