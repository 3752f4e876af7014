package engine

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/engine/space"
)

// Holding the files found at start (Config.RestartHold): each is pinned
// once before anything may evict (the cluster's first count included)
// and unpinned when the hold ends, so that nothing is evicted, promoted
// or moved by a tick before clients that were loading keys when the last
// process went have pinned them again. What the hold promises is that
// those keys stay loadable: an eviction that finds nothing else to take
// may demote a held file to another mount, into free room there
// (demoteHeld), and the copy keeps the hold's pin. A pin of the hold is
// not a client pin: Delete still removes a held file. Held entries are
// marked (entry.held) and listed by mount (index.heldOrder), so that the
// release unpins only them and a demotion round visits only its own
// mount's, each in chunks of heldChunk under the index's write lock. A
// policy that replaces the current one is told of their pins as of
// every pin (reload.go).

// restartHold is the pin of the files found at start; the files it holds
// are the index's entries marked held.
type restartHold struct {
	// mu serializes the release and demoteHeld: Close returns only after
	// a release the timer began has told the policy, and a release never
	// comes between demoteHeld's lifting of the hold's pins in the
	// policy's view and their return.
	mu    sync.Mutex
	timer *time.Timer // the release; nil before the hold and once released
}

// holdFound pins every indexed entry for d and tells the policy
// (AccessPin), then arms the release. Called by Open after the policy is
// restored, before the cluster's first count and any request.
func (e *Engine) holdFound(ctx context.Context, d time.Duration) {
	if d <= 0 {
		return
	}
	now := e.now().UnixNano()
	recs := e.ix.HoldAll(now)
	if len(recs) == 0 {
		return
	}
	e.access(ctx, recs)
	h := &e.hold
	h.mu.Lock()
	h.timer = time.AfterFunc(d, func() { e.releaseFound(true) })
	h.mu.Unlock()
	e.log.Info("engine: files found at start are held from eviction", "files", len(recs), "for", d)
}

// releaseFound ends the hold of the files found at start, once: each
// still indexed loses its pin (one removed meanwhile lost it then:
// index.unindexLocked), and with tell the policy is told (AccessUnpin).
// Close calls it without telling (the policy is closing), as does a
// failed Open.
func (e *Engine) releaseFound(tell bool) {
	h := &e.hold
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.timer == nil {
		return
	}
	h.timer.Stop()
	h.timer = nil
	// Only a demotion round (serialized with this by h.mu) holds new
	// entries, so the lists visited are all there will be.
	n, recs := e.ix.EndHold(tell, e.now().UnixNano())
	e.access(context.Background(), recs)
	if tell {
		e.log.Info("engine: files found at start may be evicted again", "files", n)
	}
}

// HeldFound is the number of files found at start that the restart hold
// still pins and that are still stored (Config.RestartHold); 0 once it
// has ended. It waits for no policy call.
func (e *Engine) HeldFound() int {
	return e.ix.HeldFound()
}

// demoteHeld is the last round of an eviction on m (evict) that left too
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
func (e *Engine) demoteHeld(ctx context.Context, m *mount, size int64) error {
	if m.cluster != nil || e.HeldFound() == 0 || e.space.Need(m.sp, size) <= 0 {
		return nil
	}
	if _, ok := e.pol.(policy.Tiering); !ok || !e.pol.Features().Has(abi.FeatureDemote) {
		return nil
	}
	if !e.roomAfter(m, size) {
		return nil // nothing could move: lift no pin for nothing
	}
	if !m.heldIdle.IsZero() && e.now().Sub(m.heldIdle) < heldRetry {
		return nil // the last round moved nothing, just now
	}
	stopped := func() error {
		return fmt.Errorf("engine: mount %s: demotion of files the restart hold pins stopped: %w", m.root, ctx.Err())
	}
	if ctx.Err() != nil {
		return stopped()
	}
	h := &e.hold
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.timer == nil {
		return nil // released meanwhile
	}
	at := e.now()
	now := at.UnixNano()
	var moved int64
	defer func() {
		if moved == 0 && ctx.Err() == nil {
			m.heldIdle = at
		} else {
			m.heldIdle = time.Time{}
		}
	}()
	lifted, recs := e.ix.LiftHeld(m.idx, now)
	if len(lifted) == 0 {
		return nil
	}
	wctx := context.WithoutCancel(ctx) // records and moves begun finish
	e.access(wctx, recs)
	defer func() {
		e.access(wctx, e.ix.Unlift(lifted, e.now().UnixNano()))
	}()

	need := e.space.Need(m.sp, size)
	victims, err := e.evictions(wctx, abi.EvictRequest{Bytes: uint64(need), Time: uint64(now), Mount: uint32(m.idx)})
	if err != nil {
		e.log.Warn("engine: policy victims", "mount", m.root, "err", err)
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
		n, err := e.moveEntry(wctx, v.Entry, int(v.Target.Mount), false, true)
		switch {
		case err == nil:
			e.tierSt.demotions.Add(1)
			freed += n
			moved++
		case errors.Is(err, errMoveStale):
		default:
			e.tierSt.moveFailures.Add(1)
			e.log.Debug("engine: demotion of a file the restart hold pins failed; it stays", "entry", v.Entry, "mount", v.Target.Mount, "err", err)
		}
	}
	if moved > 0 {
		e.log.Debug("engine: files the restart hold pins demoted to make room", "mount", m.root, "files", moved, "bytes", freed)
	}
	return nil
}

// heldRetry is the least time between two rounds of demoteHeld on a
// mount where the first moved no file.
const heldRetry = time.Second

// roomAfter reports whether a kvhost mount after m (a colder tier) may
// take a file of size bytes into free room below its high watermark, as
// a demotion of a held file needs (reserveFree); a cluster mount's claim
// decides at the move, so one counts as room. Where none may, a round of
// demoteHeld would lift and give back every held pin of m, two policy
// records per file, and move nothing.
func (e *Engine) roomAfter(m *mount, size int64) bool {
	for i := m.idx + 1; i < e.kvMounts; i++ {
		t := e.mounts[i]
		if t.cluster != nil || e.space.Fits(t.sp, size, space.High) {
			return true
		}
	}
	return false
}
