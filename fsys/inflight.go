package fsys

import (
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"
)

// inFlightSlots is how many calls InFlight tracks without a lock; more at
// once go to a map under a mutex.
const inFlightSlots = 64

// InFlight tracks calls in flight by when each began, so that a
// supervisor can find one that has not returned (a hung mount, a copy
// that never completes) while other calls go on. Begin and End take no
// lock while at most 64 calls are in flight (Begin tries the slots from
// a random one on, most often finding the first free). The zero
// InFlight is ready and safe for concurrent use.
type InFlight struct {
	once  sync.Once
	base  time.Time // the first Begin or Oldest: slots count from it, on the monotonic clock
	slots [inFlightSlots]inFlightSlot

	mu   sync.Mutex
	id   uint64
	more map[uint64]int64 // calls beyond the slots: id -> began, as in a slot
}

// inFlightSlot holds when its call began (1 + ns since InFlight.base),
// 0 when free; one cache line each, so that calls on different CPUs do
// not share one.
type inFlightSlot struct {
	began atomic.Int64
	_     [56]byte
}

// Call is one call in flight, from Begin, for End.
type Call struct {
	slot int    // 1 + index into slots; 0: in more
	id   uint64 // key in more
}

// Begin records a call beginning now; End its return.
func (w *InFlight) Begin() Call {
	now := w.since()
	// A random first slot, from the runtime's per-thread generator: a
	// shared counter would be one cache line every call on every CPU
	// writes (on 16 CPUs at once, 2 µs of processor time per pair).
	start := rand.Uint32()
	for i := range uint32(inFlightSlots) { // 7 and 64 are coprime: every slot once
		s := int((start + i*7) % inFlightSlots)
		if w.slots[s].began.CompareAndSwap(0, now) {
			return Call{slot: s + 1}
		}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.more == nil {
		w.more = map[uint64]int64{}
	}
	w.id++
	w.more[w.id] = now
	return Call{id: w.id}
}

// End records c's return.
func (w *InFlight) End(c Call) {
	if c.slot > 0 {
		w.slots[c.slot-1].began.Store(0)
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.more, c.id)
}

// Oldest returns when the oldest call in flight began; zero with none.
func (w *InFlight) Oldest() time.Time {
	w.since() // sets base
	var oldest int64
	take := func(b int64) {
		if b != 0 && (oldest == 0 || b < oldest) {
			oldest = b
		}
	}
	for i := range w.slots {
		take(w.slots[i].began.Load())
	}
	w.mu.Lock()
	for _, b := range w.more {
		take(b)
	}
	w.mu.Unlock()
	if oldest == 0 {
		return time.Time{}
	}
	return w.base.Add(time.Duration(oldest - 1))
}

// since is now as a slot holds it: 1 + ns since base, never 0 (a free
// slot). The monotonic clock, as time.Since: a step of the wall clock
// neither makes nor hides a stall.
func (w *InFlight) since() int64 {
	w.once.Do(func() { w.base = time.Now() })
	return int64(time.Since(w.base)) + 1
}
