package engine

import (
	"sync"
	"sync/atomic"
)

// callGate counts the calls in flight that are not jobs (Lookup, Pin,
// Unpin, Delete, Purge, Declare, Release, ReplacePolicy and the like:
// those that reach the files, the policy or the movers), so that Close
// refuses new ones and waits for those running before it closes what they
// use (RATIONALE.md, "Why does Close wait for lookups, pins and deletes,
// and not only for jobs?"). Jobs have their own count (jobTable).
type callGate struct {
	// n is the calls in flight, plus gateClosed once close ran: one
	// atomic add on the way in and one on the way out, no lock, for
	// lookups are the daemon's most frequent request.
	n    atomic.Int64
	idle chan struct{} // closed once close ran and no call is in flight
	once sync.Once     // closes idle
}

// gateClosed marks callGate.n closed; the calls in flight are counted
// below it.
const gateClosed = 1 << 40

func newCallGate() callGate { return callGate{idle: make(chan struct{})} }

// enter counts a call in, or fails with ErrClosed once close ran. A call
// that entered calls exit when it returns.
func (g *callGate) enter() error {
	if g.n.Add(1) >= gateClosed {
		g.exit()
		return ErrClosed
	}
	return nil
}

// exit counts a call out.
func (g *callGate) exit() {
	if g.n.Add(-1) == gateClosed {
		g.once.Do(func() { close(g.idle) })
	}
}

// close refuses new calls; idle is closed once those in flight have
// returned. It runs once (Close, under the engine's lock).
func (g *callGate) close() {
	if g.n.Add(gateClosed) == gateClosed {
		g.once.Do(func() { close(g.idle) })
	}
}

// inFlight returns the calls in flight.
func (g *callGate) inFlight() int { return int(g.n.Load() % gateClosed) }

// closing reports whether close ran.
func (g *callGate) closing() bool { return g.n.Load() >= gateClosed }

// enterNamespace is the prologue of a public call on namespace ns: it
// enters the call (calls.enter: refused once the engine closes) and finds
// ns. On success the caller defers e.busy.calls.exit(), which ends the
// call; it is not returned as a func value, which escaped to the heap
// on every lookup.
func (e *Engine) enterNamespace(ns NamespaceID) (*namespace, error) {
	if err := e.busy.calls.enter(); err != nil {
		return nil, err
	}
	n, err := e.tables.namespace(ns)
	if err != nil {
		e.busy.calls.exit()
		return nil, err
	}
	return n, nil
}
