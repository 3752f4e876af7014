package engine

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/internal/engine/index"
)

// PinID identifies a client pin (Engine.Pin), unique for the life of the
// engine; 0 is never a pin.
type PinID uint64

// pinTable is the pins part: the engine's client pins, and the files held
// open for them (pinfiles.go). Its mutex is taken before index.mu, never
// while holding it; the counts of the files held open are atomic.
type pinTable struct {
	ix   *index.Index
	now  func() time.Time
	tell func(context.Context, []abi.AccessRecord) // the policy's access events (Engine.access)

	mu     sync.Mutex
	last   uint64
	closed bool
	pins   map[PinID]*clientPin

	// open counts the files held open for client pins, at most maxOpen
	// (DefaultMaxPinnedOpen); unopened, the pins of files another engine
	// may remove that were not held open: maxOpen were.
	open     atomic.Int64
	maxOpen  int64
	unopened atomic.Uint64
}

// clientPin is one Pin call's hold: one count on pins and leases of each
// distinct entry it found, and its lease timer (nil without a lease).
type clientPin struct {
	entries []*entry
	keys    int
	timer   *time.Timer
}

// Pin pins the stored keys of ns: their files are neither evicted nor
// deleted (Delete refuses them) until Unpin(id), the lease ends (lease > 0)
// or the engine closes. It returns the pin's id (0 when no key was stored)
// and, per key in order, whether it is pinned. Unlike Lookup, every file is
// checked now (a stat: same inode, same size; an open that then holds the
// file until the last client pin of it ends where another engine may
// remove it: pinfiles.go), whatever Config.VerifyInterval says, after it
// is pinned: a key reported pinned was stored and unchanged after the pin
// took hold, so a load of it does not miss unless the file is removed
// behind the engine's back and not held open. A file
// that fails the check is dropped as in Lookup, and the key is not pinned.
// Pinning counts as a hit (or a miss) as Lookup does.
func (e *Engine) Pin(ctx context.Context, ns NamespaceID, keys [][]byte, lease time.Duration) (PinID, []bool, error) {
	n, err := e.enterNamespace(ns)
	if err != nil {
		return 0, nil, err
	}
	defer e.busy.calls.exit()
	if lease < 0 {
		return 0, nil, fmt.Errorf("%w: lease %v: want >= 0", ErrInvalid, lease)
	}
	held := make([]bool, len(keys))
	byEntry := map[*entry][]int{} // request indices per pinned entry
	var order []*entry
	for i, k := range keys {
		if err := ctx.Err(); err != nil {
			e.pinTab.unpin(ctx, order, false)
			return 0, nil, err
		}
		en := e.find(n, k)
		if en == nil {
			en = e.shared.discover(ctx, n, k)
		}
		if en == nil {
			continue
		}
		en, dup, gone := e.ix.Pins().PinClient(en, k, func(en *entry) bool { _, ok := byEntry[en]; return ok })
		if !dup {
			if gone {
				continue
			}
			// Checked after pinning: no eviction or delete can come
			// between the check and the hold.
			if !e.chk.verifyPinned(ctx, en) {
				e.pinTab.unpin(ctx, []*entry{en}, false)
				continue
			}
			order = append(order, en)
		}
		byEntry[en] = append(byEntry[en], i)
	}
	pinned := 0
	for _, en := range order {
		for _, i := range byEntry[en] {
			held[i] = true
			pinned++
		}
	}
	recs := e.ix.Pins().HitPinned(order, e.cfg.Now().UnixNano())
	e.st.hits.Add(uint64(pinned))
	e.st.misses.Add(uint64(len(keys) - pinned))
	e.access(ctx, recs)
	if len(order) == 0 {
		return 0, held, nil
	}

	id, err := e.pinTab.add(order, pinned, lease, func(id PinID) { e.Unpin(context.Background(), id) })
	if err != nil {
		e.pinTab.unpin(ctx, order, true)
		return 0, nil, err
	}
	return id, held, nil
}

// add records a pin of the entries order, holding keys keys, and returns
// its id; with a lease, expire(id) runs when it ends. It fails with
// ErrClosed once the engine closes (close).
func (t *pinTable) add(order []*entry, keys int, lease time.Duration, expire func(PinID)) (PinID, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return 0, ErrClosed
	}
	if t.pins == nil {
		t.pins = map[PinID]*clientPin{}
	}
	t.last++
	id := PinID(t.last)
	p := &clientPin{entries: order, keys: keys}
	if lease > 0 {
		p.timer = time.AfterFunc(lease, func() { expire(id) })
	}
	t.pins[id] = p
	return id, nil
}

// Unpin releases a pin and returns how many keys it held; 0 if id is not
// a pin (any more: released, or its lease ended).
func (e *Engine) Unpin(ctx context.Context, id PinID) int {
	if e.busy.calls.enter() != nil {
		return 0 // Close releases every pin
	}
	defer e.busy.calls.exit()
	return e.pinTab.remove(ctx, id)
}

// remove releases pin id and returns how many keys it held (0: no such
// pin).
func (t *pinTable) remove(ctx context.Context, id PinID) int {
	t.mu.Lock()
	p := t.pins[id]
	delete(t.pins, id)
	closed := t.closed
	t.mu.Unlock()
	if p == nil {
		return 0
	}
	if p.timer != nil {
		p.timer.Stop()
	}
	t.unpin(ctx, p.entries, !closed)
	return p.keys
}

// unpin drops one client pin count of each entry; tell reports the
// unpins to the policy.
func (t *pinTable) unpin(ctx context.Context, ens []*entry, tell bool) {
	if len(ens) == 0 {
		return
	}
	recs, files := t.ix.Pins().UnpinClient(ens, t.now().UnixNano(), tell)
	for _, pf := range files {
		t.releaseFile(pf)
	}
	t.tell(ctx, recs)
}

// PinStats returns the client pins held and the keys they hold.
func (e *Engine) PinStats() (pins, keys int) { return e.pinTab.stats() }

func (t *pinTable) stats() (pins, keys int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, p := range t.pins {
		keys += p.keys
	}
	return len(t.pins), keys
}

// close releases every client pin when the engine closes, without
// telling the policy (it is closing too); later pins fail (add).
func (t *pinTable) close() {
	t.mu.Lock()
	t.closed = true
	pins := t.pins
	t.pins = nil
	t.mu.Unlock()
	for _, p := range pins {
		if p.timer != nil {
			p.timer.Stop()
		}
		t.unpin(context.Background(), p.entries, false)
	}
}

// PinHeld reports whether id is a pin still held (not unpinned, lease not
// ended).
func (e *Engine) PinHeld(id PinID) bool {
	t := &e.pinTab
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.pins[id] != nil
}
