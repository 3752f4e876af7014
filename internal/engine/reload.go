package engine

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/recent"
)

// ReplacePolicy builds a new placement policy from the engine's index and
// makes it the engine's policy (a configuration reload): calls that begin
// after the swap go to the new policy; the old one is closed once every
// call it was serving has returned. If build (or bringing the new policy
// up to date) fails, the engine keeps its policy and ReplacePolicy returns
// the error, wrapping ErrPolicy. The engine owns (and closes) the new
// policy. The chunk layout of namespaces declared before the swap does not
// change.
//
// The swap is atomic with respect to declarations and events: before it,
// with Declare held off and no policy call in flight through the engine,
// the new policy is told every namespace declared while it was built, a
// RESTORE of every entry stored and a REMOVE of every entry removed since
// its build read the index, and the current mount description. After it,
// every event goes to the new policy only.
//
// Every pin the old policy was told of and not of its release (loads',
// clients', the restart hold's: hold.go) is told to the new one too, a
// PIN each: a policy that does not know a pin offers the entry as a
// victim, which the engine skips, and an eviction offered only pinned
// entries frees nothing.
func (e *Engine) ReplacePolicy(ctx context.Context, build func(idx policy.Index) (policy.Policy, error)) error {
	if err := e.busy.calls.enter(); err != nil {
		return err
	}
	defer e.busy.calls.exit()
	sp, ok := e.pol.Policy.(*switchPolicy)
	if !ok {
		return fmt.Errorf("%w: the engine's policy cannot be replaced", ErrInvalid)
	}
	sp.replaceMu.Lock()
	defer sp.replaceMu.Unlock()
	if e.tables.isClosed() {
		return ErrClosed
	}
	view := &buildView{Index: e.Index(), nsSeen: map[uint32]int{}, seen: map[uint64]int{}}
	p, err := build(view)
	if err != nil {
		return fmt.Errorf("%w: new policy: %w", ErrPolicy, err)
	}
	old, err := e.catchUpAndSwap(ctx, sp, p, view)
	if err != nil {
		if cerr := p.Close(context.WithoutCancel(ctx)); cerr != nil {
			e.cfg.Logger.Warn("engine: closing the policy that failed to catch up", "err", cerr)
		}
		return fmt.Errorf("%w: new policy: %w", ErrPolicy, err)
	}
	old.calls.Wait()
	if old.owned {
		if err := old.p.Close(context.WithoutCancel(ctx)); err != nil {
			e.cfg.Logger.Warn("engine: closing the replaced policy", "err", err)
		}
	}
	return nil
}

// catchUpAndSwap tells p what changed while it was built from view (see
// ReplacePolicy) and swaps it in, returning the policy it replaced. The
// locks are taken in the engine's order: declarations (sp.declMu), the
// mount description (tiering.pauseMounts), policy calls (sp.mu), the index
// (index.mu, briefly) and the space (space.mu, briefly). Nothing holding
// the engine's own locks calls the policy.
func (e *Engine) catchUpAndSwap(ctx context.Context, sp *switchPolicy, p policy.Policy, view *buildView) (*heldPolicy, error) {
	ctx = context.WithoutCancel(ctx)
	sp.declMu.Lock() // no Declare between the namespaces told and the swap
	defer sp.declMu.Unlock()
	for _, ns := range view.missedNamespaces() {
		if _, err := p.Namespace(ctx, ns); err != nil {
			return nil, fmt.Errorf("namespace %d declared during the build: %w", ns.NS, err)
		}
	}
	tellMounts, done := e.tier.pauseMounts() // none sent to the old policy meanwhile
	defer done()
	sp.mu.Lock() // no policy call through the engine until the swap
	defer sp.mu.Unlock()
	old := sp.cur
	recs, pins := view.missedEvents(e, old.pinCounts())
	if len(recs) > 0 {
		for len(recs) > 0 {
			n := min(len(recs), abi.MaxBatch)
			if err := p.Access(ctx, recs[:n]); err != nil {
				return nil, fmt.Errorf("entries changed during the build: %w", err)
			}
			recs = recs[n:]
		}
	}
	if err := tellMounts(ctx, p); err != nil {
		return nil, fmt.Errorf("mount description: %w", err)
	}
	sp.cur = &heldPolicy{p: p, owned: true, pins: pins, removed: recent.NewIDs(heldRemovedWindow)}
	sp.told.Add(1)
	return old, nil
}

// buildView is the index a replacement policy is built from: it records
// what the build read (the namespaces of each Namespaces call, the entries
// each Range call passed on) until done, so that ReplacePolicy can tell the
// policy what changed since.
//
// A read counts as the policy's knowledge only if every read returned it:
// a policy host builds each shard from a Range of its own, keeping the
// entries routed to that shard, so an entry stored after one shard's Range
// and before another's was passed on by the later call only, and the shard
// it is routed to may be the one that never saw it.
type buildView struct {
	policy.Index
	mu     sync.Mutex
	done   bool
	calls  int            // Namespaces calls
	nsSeen map[uint32]int // namespace → Namespaces calls that returned it
	ranges int            // Range calls
	seen   map[uint64]int // entry → Range calls that passed it on
}

// Namespaces implements policy.Index.
func (v *buildView) Namespaces() []abi.NamespaceRecord {
	out := v.Index.Namespaces()
	v.mu.Lock()
	defer v.mu.Unlock()
	if !v.done {
		v.calls++
		for _, ns := range out {
			v.nsSeen[ns.NS]++
		}
	}
	return out
}

// Range implements policy.Index.
func (v *buildView) Range(fn func(policy.Entry) bool) {
	v.mu.Lock()
	if !v.done {
		v.ranges++
	}
	v.mu.Unlock()
	v.Index.Range(func(en policy.Entry) bool {
		v.mu.Lock()
		if !v.done {
			v.seen[en.ID]++
		}
		v.mu.Unlock()
		return fn(en)
	})
}

// missedNamespaces returns the namespaces declared now that some read of
// the build did not return (every one when the build never asked).
func (v *buildView) missedNamespaces() []abi.NamespaceRecord {
	v.mu.Lock()
	defer v.mu.Unlock()
	var out []abi.NamespaceRecord
	for _, ns := range v.Index.Namespaces() {
		if v.nsSeen[ns.NS] < v.calls || v.calls == 0 {
			out = append(out, ns)
		}
	}
	return out
}

// missedEvents returns, and stops recording, a RESTORE of every entry of
// the index some Range call of the build did not pass on (every one when
// the build never asked; a RESTORE of an entry the policy knows is an
// update), a REMOVE of every entry a Range call passed on that is gone, and
// a PIN for each of the pins told, by entry, of those still
// indexed (their unpins reach the new policy), with the pins it tells. The
// caller holds sp.mu: no access call takes the old policy any more.
func (v *buildView) missedEvents(e *Engine, told map[uint64]int) ([]abi.AccessRecord, map[uint64]int) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.done = true
	var recs, pinRecs []abi.AccessRecord
	pins := map[uint64]int{}
	now := e.cfg.Now().UnixNano()
	indexed := map[uint64]bool{}
	e.ix.Files().Each(func(en *entry) {
		indexed[en.ID] = true
		if n := v.seen[en.ID]; n < v.ranges || v.ranges == 0 {
			recs = append(recs, en.Access(abi.AccessRestore, en.Last))
		}
		if n := told[en.ID]; n > 0 {
			pins[en.ID] = n
			for range n {
				pinRecs = append(pinRecs, en.Access(abi.AccessPin, now))
			}
		}
	})
	for id := range v.seen {
		if !indexed[id] {
			recs = append(recs, abi.AccessRecord{Entry: id, Time: uint64(now), Kind: abi.AccessRemove})
		}
	}
	v.seen = nil
	return append(recs, pinRecs...), pins
}

// SetVerifyInterval changes Config.VerifyInterval of a running engine.
func (e *Engine) SetVerifyInterval(d time.Duration) {
	e.chk.interval.Store(int64(max(d, 0)))
}

// heldPolicy is a policy, the calls it is serving and the pins it was
// told of.
type heldPolicy struct {
	p     policy.Policy
	owned bool // closed by the engine
	calls sync.WaitGroup

	// pins counts, by entry, the pins p was sent (AccessPin) and not
	// their release (AccessUnpin, AccessRemove): what a policy that
	// replaces p is told. An access call counts its records as it takes p
	// (switchPolicy.Access, under switchPolicy.mu), so that at a swap
	// the count holds every pin sent to p, delivered yet or not.
	pinMu sync.Mutex
	pins  map[uint64]int
	// removed holds the last heldRemovedWindow entries p was sent a
	// REMOVE for: a PIN of one of them is not counted. A load or a client
	// pin sends its PIN after it lets go of the index's lock, and the
	// entry may be dropped meanwhile (its file vanished, as another lookup
	// found): its REMOVE then comes first, and its UNPIN never (the engine
	// tells no release of an entry gone), so the count would be kept until
	// the next reload.
	removed recent.IDs
}

// heldRemovedWindow is how many removed entries a heldPolicy remembers
// (about 50 bytes each): a PIN is overtaken by the REMOVEs of the moment
// it waits (a load's lookups of other keys on disk), not by many.
const heldRemovedWindow = 1 << 12

// countPins counts the pins and releases of recs, sent to h.
func (h *heldPolicy) countPins(recs []abi.AccessRecord) {
	if !slices.ContainsFunc(recs, func(r abi.AccessRecord) bool { return pinKind(r.Kind) }) {
		return // the common batch: inserts, hits
	}
	h.pinMu.Lock()
	defer h.pinMu.Unlock()
	if h.pins == nil {
		h.pins = map[uint64]int{}
	}
	for i := range recs {
		switch id := recs[i].Entry; recs[i].Kind {
		case abi.AccessPin:
			if h.removed.Has(id) {
				continue // overtaken by its entry's REMOVE: no UNPIN comes
			}
			h.pins[id]++
		case abi.AccessUnpin:
			if n := h.pins[id]; n > 1 {
				h.pins[id] = n - 1
			} else {
				delete(h.pins, id) // an unpin never told of its pin: nothing
			}
		case abi.AccessRemove:
			delete(h.pins, id)
			h.removed.Add(id)
		}
	}
}

// pinCounts returns a copy of the pins h was told of, by entry.
func (h *heldPolicy) pinCounts() map[uint64]int {
	h.pinMu.Lock()
	defer h.pinMu.Unlock()
	return maps.Clone(h.pins)
}

// pinKind reports whether an access record of kind changes a pin count.
func pinKind(kind uint32) bool {
	return kind == abi.AccessPin || kind == abi.AccessUnpin || kind == abi.AccessRemove
}

// switchPolicy is the engine's policy: it forwards every call to the
// current policy and lets ReplacePolicy swap it, waiting for the calls of
// the old one before closing it.
type switchPolicy struct {
	replaceMu sync.Mutex // one replacement at a time
	// declMu is held for reading by Declare from its policy call until
	// the namespace is marked declared, and for writing by ReplacePolicy
	// from telling the new policy the namespaces it missed until the
	// swap: a declaration reaches the old policy and the new one's
	// catch-up, or the new policy itself.
	declMu sync.RWMutex

	mu  sync.RWMutex
	cur *heldPolicy

	// told counts the calls that may change what the policy answers:
	// declarations, names, admissions, access records, mount
	// descriptions and swaps (changes). A call counts once it returned:
	// a count read while one is under way moves after it.
	told atomic.Uint64
}

// changes returns a count that has not moved since an earlier call of
// it only where the policy was told nothing since, nor swapped: the
// policy's victims then change with time alone (objectDemoter.pass).
func (s *switchPolicy) changes() uint64 { return s.told.Load() }

func newSwitchPolicy(p policy.Policy, owned bool) *switchPolicy {
	return &switchPolicy{cur: &heldPolicy{p: p, owned: owned, removed: recent.NewIDs(heldRemovedWindow)}}
}

// acquire returns the current policy, counting a call on it until its
// release.
func (s *switchPolicy) acquire() *heldPolicy {
	s.mu.RLock()
	h := s.cur
	h.calls.Add(1)
	s.mu.RUnlock()
	return h
}

func (s *switchPolicy) Features() abi.Feature {
	h := s.acquire()
	defer h.calls.Done()
	return h.p.Features()
}

func (s *switchPolicy) Namespace(ctx context.Context, rec abi.NamespaceRecord) (abi.NamespaceRecord, error) {
	h := s.acquire()
	defer h.calls.Done()
	defer s.told.Add(1)
	return h.p.Namespace(ctx, rec)
}

func (s *switchPolicy) Name(ctx context.Context, recs []abi.NameRecord) error {
	h := s.acquire()
	defer h.calls.Done()
	defer s.told.Add(1)
	return h.p.Name(ctx, recs)
}

func (s *switchPolicy) Admit(ctx context.Context, recs []abi.AdmitRecord) error {
	h := s.acquire()
	defer h.calls.Done()
	defer s.told.Add(1)
	return h.p.Admit(ctx, recs)
}

func (s *switchPolicy) Access(ctx context.Context, recs []abi.AccessRecord) error {
	// acquire, counting the pins in the same hold of mu: a swap finds
	// every pin sent to the policy it replaces counted.
	s.mu.RLock()
	h := s.cur
	h.calls.Add(1)
	h.countPins(recs)
	s.mu.RUnlock()
	defer h.calls.Done()
	defer s.told.Add(1)
	return h.p.Access(ctx, recs)
}

func (s *switchPolicy) Victims(ctx context.Context, req abi.EvictRequest, max int) ([]abi.Victim, error) {
	h := s.acquire()
	defer h.calls.Done()
	return h.p.Victims(ctx, req, max)
}

// UpdateMounts implements policy.Tiering for the current policy (nothing
// for a policy without it).
func (s *switchPolicy) UpdateMounts(ctx context.Context, recs []abi.MountRecord) error {
	h := s.acquire()
	defer h.calls.Done()
	defer s.told.Add(1)
	if t, ok := h.p.(policy.Tiering); ok {
		return t.UpdateMounts(ctx, recs)
	}
	return nil
}

// Evictions implements policy.Tiering: the current policy's victims, with
// their targets when it has them.
func (s *switchPolicy) Evictions(ctx context.Context, req abi.EvictRequest, max int) ([]policy.Eviction, error) {
	h := s.acquire()
	defer h.calls.Done()
	if t, ok := h.p.(policy.Tiering); ok {
		return t.Evictions(ctx, req, max)
	}
	vs, err := h.p.Victims(ctx, req, max)
	out := make([]policy.Eviction, len(vs))
	for i, v := range vs {
		out[i] = policy.Eviction{Victim: v, Target: abi.VictimTarget{Mount: abi.NoMount}}
	}
	return out, err
}

// Tick implements policy.Tiering for the current policy (no moves for a
// policy without it).
func (s *switchPolicy) Tick(ctx context.Context, req abi.TickRequest, max int) ([]abi.Move, error) {
	h := s.acquire()
	defer h.calls.Done()
	if t, ok := h.p.(policy.Tiering); ok {
		return t.Tick(ctx, req, max)
	}
	return nil, nil
}

// Close closes the current policy if the engine owns it.
func (s *switchPolicy) Close(ctx context.Context) error {
	s.replaceMu.Lock() // a replacement in progress ends first
	defer s.replaceMu.Unlock()
	h := s.acquire()
	h.calls.Done()
	h.calls.Wait()
	if !h.owned {
		return nil
	}
	return h.p.Close(ctx)
}

var (
	_ policy.Policy  = (*switchPolicy)(nil)
	_ policy.Tiering = (*switchPolicy)(nil)
)

// Index returns the engine's index as a policy host sees it.
func (e *Engine) Index() policy.Index { return indexView{e} }

// indexView implements policy.Index over the engine.
type indexView struct{ e *Engine }

var _ policy.Index = indexView{}

// Lookup returns the entry with the given id.
func (v indexView) Lookup(id uint64) (policy.Entry, bool) { return v.e.ix.Files().PolicyEntry(id) }

// Range calls fn for every entry until fn returns false. fn runs without the
// index's lock held, on a snapshot.
func (v indexView) Range(fn func(policy.Entry) bool) {
	for _, en := range v.e.ix.Files().PolicyEntries() {
		if !fn(en) {
			return
		}
	}
}

// Namespaces returns every declared namespace.
func (v indexView) Namespaces() []abi.NamespaceRecord {
	return v.e.tables.records()
}
