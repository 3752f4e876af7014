package engine

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
)

// ReplacePolicy builds a new placement policy from the engine's index and
// makes it the engine's policy (a configuration reload): calls that begin
// after the swap go to the new policy; the old one is closed once every
// call it was serving has returned. If build fails, the engine keeps its
// policy and ReplacePolicy returns the error, wrapping ErrPolicy. The
// engine owns (and closes) the new policy. The chunk layout of namespaces
// declared before the swap does not change.
//
// Pins the old policy was told of are not replayed into the new one: its
// victims are checked against the index, which knows them (policy.Host
// skips a pinned victim).
func (e *Engine) ReplacePolicy(ctx context.Context, build func(idx policy.Index) (policy.Policy, error)) error {
	sp, ok := e.pol.(*switchPolicy)
	if !ok {
		return fmt.Errorf("%w: the engine's policy cannot be replaced", ErrInvalid)
	}
	sp.replaceMu.Lock()
	defer sp.replaceMu.Unlock()
	e.mu.RLock()
	closed := e.closed
	e.mu.RUnlock()
	if closed {
		return ErrClosed
	}
	p, err := build(e.Index())
	if err != nil {
		return fmt.Errorf("%w: new policy: %w", ErrPolicy, err)
	}
	old := sp.swap(&heldPolicy{p: p, owned: true})
	// Entries stored while the new policy was being built were reported
	// to the old one; telling the new one again is harmless (a restore
	// record of an entry it knows refreshes it).
	e.restore(ctx)
	if e.tier != nil {
		e.sendMounts(ctx, true) // the new policy's first mount description (demote.go)
	}
	old.calls.Wait()
	if old.owned {
		if err := old.p.Close(context.WithoutCancel(ctx)); err != nil {
			e.log.Warn("engine: closing the replaced policy", "err", err)
		}
	}
	return nil
}

// SetVerifyInterval changes Config.VerifyInterval of a running engine.
func (e *Engine) SetVerifyInterval(d time.Duration) {
	e.verifyIv.Store(int64(max(d, 0)))
}

// heldPolicy is a policy and the calls it is serving.
type heldPolicy struct {
	p     policy.Policy
	owned bool // closed by the engine
	calls sync.WaitGroup
}

// switchPolicy is the engine's policy: it forwards every call to the
// current policy and lets ReplacePolicy swap it, waiting for the calls of
// the old one before closing it.
type switchPolicy struct {
	replaceMu sync.Mutex // one replacement at a time

	mu  sync.RWMutex
	cur *heldPolicy
}

func newSwitchPolicy(p policy.Policy, owned bool) *switchPolicy {
	return &switchPolicy{cur: &heldPolicy{p: p, owned: owned}}
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

func (s *switchPolicy) swap(h *heldPolicy) *heldPolicy {
	s.mu.Lock()
	defer s.mu.Unlock()
	old := s.cur
	s.cur = h
	return old
}

func (s *switchPolicy) Features() abi.Feature {
	h := s.acquire()
	defer h.calls.Done()
	return h.p.Features()
}

func (s *switchPolicy) Namespace(ctx context.Context, rec abi.NamespaceRecord) (abi.NamespaceRecord, error) {
	h := s.acquire()
	defer h.calls.Done()
	return h.p.Namespace(ctx, rec)
}

func (s *switchPolicy) Name(ctx context.Context, recs []abi.NameRecord) error {
	h := s.acquire()
	defer h.calls.Done()
	return h.p.Name(ctx, recs)
}

func (s *switchPolicy) Admit(ctx context.Context, recs []abi.AdmitRecord) error {
	h := s.acquire()
	defer h.calls.Done()
	return h.p.Admit(ctx, recs)
}

func (s *switchPolicy) Access(ctx context.Context, recs []abi.AccessRecord) error {
	h := s.acquire()
	defer h.calls.Done()
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
