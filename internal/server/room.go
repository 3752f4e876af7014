package server

import (
	"container/list"
	"context"
	"sync"
	"sync/atomic"
)

// room is a number of bytes shared by those who take some of it: a take
// beyond what is left waits, first come first served, until enough is
// given back. Waiting in order keeps a large take from being passed over
// for ever by small ones.
type room struct {
	mu      sync.Mutex
	size    int64
	used    int64
	waiters list.List // of *roomWaiter, oldest first
	// waiting, if set, counts the takes waiting, with those of other
	// rooms sharing it; it changes with used, under mu.
	waiting *atomic.Int64
}

// roomWaiter is a take waiting for room; ready is closed once it has it.
type roomWaiter struct {
	n     int64
	ready chan struct{}
}

// take takes n bytes, waiting until that many are free and every earlier
// take has been served, or until ctx is done (then it takes nothing and
// returns ctx's error). It reports whether it had to wait. n must not
// exceed the room's size.
func (r *room) take(ctx context.Context, n int64) (waited bool, err error) {
	r.mu.Lock()
	if r.waiters.Len() == 0 && r.used+n <= r.size {
		r.used += n
		r.mu.Unlock()
		return false, nil
	}
	w := &roomWaiter{n: n, ready: make(chan struct{})}
	e := r.waiters.PushBack(w)
	r.count(1)
	r.mu.Unlock()
	select {
	case <-w.ready:
		return true, nil
	case <-ctx.Done():
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	select {
	case <-w.ready:
		// Served as ctx ended: give it back.
		r.used -= n
	default:
		r.waiters.Remove(e)
		r.count(-1)
	}
	// Either way the takes behind it may fit now.
	r.serveLocked()
	return true, ctx.Err()
}

// give gives back n bytes a take took.
func (r *room) give(n int64) {
	r.mu.Lock()
	r.used -= n
	r.serveLocked()
	r.mu.Unlock()
}

// taken returns the bytes taken.
func (r *room) taken() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.used
}

// serveLocked hands room to the oldest waiting takes that fit, in order.
func (r *room) serveLocked() {
	for e := r.waiters.Front(); e != nil; e = r.waiters.Front() {
		w := e.Value.(*roomWaiter)
		if r.used+w.n > r.size {
			return
		}
		r.used += w.n
		r.waiters.Remove(e)
		r.count(-1)
		close(w.ready)
	}
}

// count adds d to the takes waiting, where they are counted.
func (r *room) count(d int64) {
	if r.waiting != nil {
		r.waiting.Add(d)
	}
}
