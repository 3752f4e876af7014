package engine

import (
	"context"
	"sync"

	"github.com/kvhost/kvhost/abi"
)

// maxPendingHits bounds the hits waiting for the recorder; beyond it a
// lookup reports its hits itself.
const maxPendingHits = 1 << 16

// hitRecorder reports lookup hits to the policy off the lookup's path. Hits
// only feed the policy's ordering (recency, frequency): a lookup need not
// wait for a plugin call to answer. Pins, inserts and removals, which
// eviction depends on, stay synchronous; eviction flushes the pending hits
// first, so it ranks with every hit reported before it.
//
// Its goroutine also writes the access journals (access.go): the files'
// uses kept across restarts, written after the hits are reported.
type hitRecorder struct {
	e       *Engine
	journal *accessLog // nil: none
	mu      sync.Mutex
	pending []abi.AccessRecord
	closed  bool
	wake    chan struct{}
	done    chan struct{}
}

func newHitRecorder(e *Engine, journal *accessLog) *hitRecorder {
	r := &hitRecorder{e: e, journal: journal, wake: make(chan struct{}, 1), done: make(chan struct{})}
	go r.run()
	return r
}

// add queues recs, or reports them at once when the recorder is closed or
// behind.
func (r *hitRecorder) add(ctx context.Context, recs []abi.AccessRecord) {
	if len(recs) == 0 {
		return
	}
	r.mu.Lock()
	if r.closed || len(r.pending) >= maxPendingHits {
		r.mu.Unlock()
		r.e.access(ctx, recs)
		return
	}
	r.pending = append(r.pending, recs...)
	r.mu.Unlock()
	r.poke()
}

// poke wakes the recorder's goroutine.
func (r *hitRecorder) poke() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// flush reports the pending hits now.
func (r *hitRecorder) flush() {
	r.mu.Lock()
	batch := r.pending
	r.pending = nil
	r.mu.Unlock()
	r.e.access(context.Background(), batch)
}

func (r *hitRecorder) run() {
	defer close(r.done)
	for range r.wake {
		r.flush()
		r.mu.Lock()
		closed := r.closed
		r.mu.Unlock()
		if closed {
			r.flush()
			r.journal.close()
			return
		}
		r.journal.write()
	}
}

// close reports what is pending, writes the journals and stops the
// recorder.
func (r *hitRecorder) close() {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return
	}
	r.closed = true
	r.mu.Unlock()
	r.poke()
	<-r.done
}

// access reports events to the policy, in batches. A policy failure here is
// logged, never fatal to the operation that caused it.
func (e *Engine) access(ctx context.Context, recs []abi.AccessRecord) {
	if e.pol.hitRec != nil && e.pol.hitRec.journal.note(recs) {
		e.pol.hitRec.poke() // the uses kept across restarts (access.go)
	}
	for len(recs) > 0 {
		n := min(len(recs), abi.MaxBatch)
		if err := e.pol.Access(context.WithoutCancel(ctx), recs[:n]); err != nil {
			e.cfg.Logger.Warn("engine: policy access", "err", err)
		}
		recs = recs[n:]
	}
}
