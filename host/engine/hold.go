package engine

import (
	"context"
	"sync"
	"time"

	"github.com/kvhost/kvhost/abi"
)

// Holding the files found at start (Config.RestartHold): each is pinned
// once before anything may evict (the cluster's first count included)
// and unpinned when the hold ends, so that nothing is evicted, demoted,
// promoted or moved to make room before clients that were loading keys
// when the last process went have pinned them again. A pin of the hold
// is not a client pin: Delete still removes a held file. Held entries
// are marked (entry.held, counted in index.heldFound), so that the
// release unpins only them. A policy that replaces the current one is
// told of their pins as of every pin (reload.go).

// restartHold is the pin of the files found at start; the files it holds
// are the index's entries marked held.
type restartHold struct {
	// mu serializes the release: Close returns only after a release the
	// timer began has told the policy. Nothing else waits on it.
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
	e.ix.mu.Lock()
	recs := make([]abi.AccessRecord, 0, len(e.ix.entries))
	for _, en := range e.ix.entries {
		en.pins++
		en.held = true
		recs = append(recs, en.access(abi.AccessPin, now))
	}
	e.ix.heldFound = len(recs)
	e.ix.mu.Unlock()
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
	var recs []abi.AccessRecord
	now := e.now().UnixNano()
	e.ix.mu.Lock()
	n := e.ix.heldFound
	for _, en := range e.ix.entries {
		if !en.held {
			continue
		}
		en.pins--
		en.held = false
		if tell {
			recs = append(recs, en.access(abi.AccessUnpin, now))
		}
	}
	e.ix.heldFound = 0
	e.ix.mu.Unlock()
	e.access(context.Background(), recs)
	if tell {
		e.log.Info("engine: files found at start may be evicted again", "files", n)
	}
}

// HeldFound is the number of files found at start that the restart hold
// still pins and that are still stored (Config.RestartHold); 0 once it
// has ended. It waits for no policy call.
func (e *Engine) HeldFound() int {
	e.ix.mu.RLock()
	defer e.ix.mu.RUnlock()
	return e.ix.heldFound
}
