package engine

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/kvhost/kvhost/abi"
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
// marked (entry.held) and listed by mount (index.heldOrder), so that the
// release unpins only them and a demotion round visits only its own
// mount's, each in chunks of heldChunk under the index's write lock. A
// policy that replaces the current one is told of their pins as of
// every pin (reload.go).

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
	mu    sync.Mutex
	timer *time.Timer // the release; nil before the hold and once released
}

// accessor reports events to the policy (hits.go).
type accessor interface {
	access(ctx context.Context, recs []abi.AccessRecord)
}

// newRestartHold is the restart hold of e, whose tiering part is made.
func newRestartHold(e *Engine) *restartHold {
	return &restartHold{log: e.cfg.Logger, now: e.cfg.Now, ix: e.ix, space: e.space, tier: e.tier, events: e}
}

// start pins every indexed entry for d and tells the policy
// (AccessPin), then arms the release. Called by Open after the policy is
// restored, before the cluster's first count and any request.
func (h *restartHold) start(ctx context.Context, d time.Duration) {
	if d <= 0 {
		return
	}
	now := h.now().UnixNano()
	recs := h.ix.HoldAll(now)
	if len(recs) == 0 {
		return
	}
	h.events.access(ctx, recs)
	h.mu.Lock()
	h.timer = time.AfterFunc(d, func() { h.release(true) })
	h.mu.Unlock()
	h.log.Info("engine: files found at start are held from eviction", "files", len(recs), "for", d)
}

// release ends the hold of the files found at start, once: each
// still indexed loses its pin (one removed meanwhile lost it then:
// index.unindexLocked), and with tell the policy is told (AccessUnpin).
// Close calls it without telling (the policy is closing), as does a
// failed Open.
func (h *restartHold) release(tell bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.timer == nil {
		return
	}
	h.timer.Stop()
	h.timer = nil
	// Only a demotion round (serialized with this by h.mu) holds new
	// entries, so the lists visited are all there will be.
	n, recs := h.ix.EndHold(tell, h.now().UnixNano())
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
func (h *restartHold) held() int { return h.ix.HeldFound() }

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
	lifted, recs := h.ix.LiftHeld(m.idx, now)
	if len(lifted) == 0 {
		return nil
	}
	wctx := context.WithoutCancel(ctx) // records and moves begun finish
	h.events.access(wctx, recs)
	defer func() {
		h.events.access(wctx, h.ix.Unlift(lifted, h.now().UnixNano()))
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
