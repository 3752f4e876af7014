package server

import (
	"container/heap"
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/protocol"
)

// Pinner is the part of an engine that serves client pins (Pin and Unpin
// frames); *engine.Engine implements it. A server whose engine does not
// answers them with Error(unsupported).
type Pinner interface {
	// Pin pins the stored keys of ns until Unpin or the lease ends (lease
	// > 0); it returns the pin's id (0 when no key was stored) and, per
	// key, whether it is pinned.
	Pin(ctx context.Context, ns engine.NamespaceID, keys [][]byte, lease time.Duration) (engine.PinID, []bool, error)
	// Unpin releases a pin and returns how many keys it held; 0 if id is
	// not a pin any more.
	Unpin(ctx context.Context, id engine.PinID) int
	// PinHeld reports whether id is a pin still held.
	PinHeld(id engine.PinID) bool
}

var _ Pinner = (*engine.Engine)(nil)

// MaxPinsPerConnection bounds the pins one connection holds at once
// (pins whose lease ended do not count).
const MaxPinsPerConnection = 4096

// sessionPins maps a connection's pin ids to the engine's: a client can
// name only its own pins, and a connection's end releases them all. Only
// the session's run goroutine touches it.
type sessionPins struct {
	next uint64
	ids  map[uint64]sessionPin
}

// sessionPin is a pin of a connection: the engine's, and the keys it is
// counted to hold.
type sessionPin struct {
	id     engine.PinID
	ns     uint32 // the session's namespace id it pinned in
	charge *pinCharge
}

// pinCharge is the keys one client pin holds, counted against
// MaxPinnedKeys and MaxPinnedKeysPerPeer until the pin is released or its
// lease ends.
type pinCharge struct {
	peer *peer
	keys int64
	// ends is the lease's end, counted from the moment the engine's pin
	// was made (holdPins); zero without a lease, and while the engine
	// pins.
	ends    time.Time
	settled bool // given back
	index   int  // in Server.pinLeases; -1 if not there
}

// pinHeap orders the charges of pins with a lease by the end of their
// lease (container/heap).
type pinHeap []*pinCharge

func (h pinHeap) Len() int           { return len(h) }
func (h pinHeap) Less(i, j int) bool { return h[i].ends.Before(h[j].ends) }
func (h pinHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}
func (h *pinHeap) Push(x any) {
	c := x.(*pinCharge)
	c.index = len(*h)
	*h = append(*h, c)
}
func (h *pinHeap) Pop() any {
	old := *h
	c := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	c.index = -1
	return c
}

// chargePins counts n keys of a new pin of a session of p against
// MaxPinnedKeys and MaxPinnedKeysPerPeer, or says which it would pass;
// they count until the charge is settled (holdPins, settlePins). Pins
// whose lease has ended are given back first: the engine has released
// them, or does at that moment.
func (s *Server) chargePins(p *peer, n int64) (*pinCharge, error) {
	now := s.cfg.Now()
	s.pinMu.Lock()
	defer s.pinMu.Unlock()
	for len(s.pinLeases) > 0 && !s.pinLeases[0].ends.After(now) {
		s.settleLocked(heap.Pop(&s.pinLeases).(*pinCharge), 0)
	}
	if s.pinned+n > int64(s.cfg.MaxPinnedKeys) {
		return nil, s.refuse(boundPinnedKeys, "the pins of all clients hold %d keys; this pin's %d would pass the daemon's limit of %d (server.max_pinned_keys): unpin some first",
			s.pinned, n, s.cfg.MaxPinnedKeys)
	}
	if p.pinned+n > int64(s.cfg.MaxPinnedKeysPerPeer) {
		return nil, s.refuse(boundPinnedKeysPerPeer, "the pins of %s hold %d keys; this pin's %d would pass the most one process may hold, %d (server.max_pinned_keys_per_peer): unpin some first",
			p, p.pinned, n, s.cfg.MaxPinnedKeysPerPeer)
	}
	c := &pinCharge{peer: p, keys: n, index: -1}
	s.pinned += n
	p.pinned += n
	return c, nil
}

// holdPins counts c as holding keep keys (no more than it did), those
// of the pin the engine has just made, until the pin is released or,
// with a lease (> 0), until the lease ends. The engine's lease began
// while it made the pin, which can take longer than the lease: counted
// from now, the charge ends after the engine's lease, never before.
func (s *Server) holdPins(c *pinCharge, keep int64, lease time.Duration) {
	now := s.cfg.Now()
	s.pinMu.Lock()
	defer s.pinMu.Unlock()
	s.settleLocked(c, keep)
	if lease > 0 && !c.settled {
		c.ends = now.Add(lease)
		heap.Push(&s.pinLeases, c)
	}
}

// settlePins counts c as holding keep keys from now on (no more than it
// did); 0 gives it back.
func (s *Server) settlePins(c *pinCharge, keep int64) {
	s.pinMu.Lock()
	defer s.pinMu.Unlock()
	s.settleLocked(c, keep)
}

func (s *Server) settleLocked(c *pinCharge, keep int64) {
	if c.settled || keep >= c.keys {
		return
	}
	s.pinned -= c.keys - keep
	c.peer.pinned -= c.keys - keep
	c.keys = keep
	if keep == 0 {
		c.settled = true
		if c.index >= 0 {
			heap.Remove(&s.pinLeases, c.index)
		}
	}
}

// pinnedKeys is the keys the pins of all connections hold, those whose
// lease has ended given back.
func (s *Server) pinnedKeys() int64 {
	now := s.cfg.Now()
	s.pinMu.Lock()
	defer s.pinMu.Unlock()
	for len(s.pinLeases) > 0 && !s.pinLeases[0].ends.After(now) {
		s.settleLocked(heap.Pop(&s.pinLeases).(*pinCharge), 0)
	}
	return s.pinned
}

func (s *session) pin(m *protocol.Pin) (protocol.Message, error) {
	p, ok := s.srv.eng.(Pinner)
	if !ok {
		return nil, perr(protocol.CodeUnsupported, "pins are not supported by this daemon's engine")
	}
	ns := s.namespaces[m.NS]
	if ns == nil {
		return nil, perr(protocol.CodeUnknownNS, "namespace %d", m.NS)
	}
	if m.Loadable && !s.srv.hasCache(ns.id, m.Group) {
		// No worker could load the keys: answer so without looking, and
		// without counting a hit or a miss.
		reply := &protocol.Pinned{State: make([]uint8, len(m.Keys)), Loadable: true}
		for i := range reply.State {
			reply.State[i] = protocol.PinNoCache
		}
		return reply, nil
	}
	sp := &s.pins
	if len(sp.ids) >= MaxPinsPerConnection {
		for id, pin := range sp.ids { // forget pins whose lease ended
			if !p.PinHeld(pin.id) {
				delete(sp.ids, id)
				s.srv.settlePins(pin.charge, 0)
			}
		}
		if len(sp.ids) >= MaxPinsPerConnection {
			return nil, s.srv.refuse(boundPins, "%d pins held on this connection: unpin some first", len(sp.ids))
		}
	}
	lease := time.Duration(m.LeaseMillis) * time.Millisecond
	charge, err := s.srv.chargePins(s.peer, int64(len(m.Keys)))
	if err != nil {
		return nil, err
	}
	eid, held, err := p.Pin(s.readCtx, ns.id, m.Keys, lease)
	if err != nil {
		s.srv.settlePins(charge, 0)
		return nil, err
	}
	reply := &protocol.Pinned{State: make([]uint8, len(held)), Loadable: m.Loadable}
	kept := int64(0)
	for i, h := range held {
		if h {
			reply.State[i] = protocol.PinHeld
			kept++
		}
	}
	if eid == 0 {
		kept = 0
	}
	s.srv.holdPins(charge, kept, lease) // what the pin holds: the keys found
	if eid != 0 {
		if sp.ids == nil {
			sp.ids = map[uint64]sessionPin{}
		}
		sp.next++
		sp.ids[sp.next] = sessionPin{id: eid, ns: m.NS, charge: charge}
		reply.Pin = sp.next
	}
	return reply, nil
}

// joinGroup puts the connection's caches in group m.Name, which a
// PinLoadable can name: once, before the connection registers a cache.
func (s *session) joinGroup(m *protocol.Group) (protocol.Message, error) {
	if s.group == m.Name {
		return &protocol.Empty{T: protocol.TypeGroup | protocol.TypeReply}, nil
	}
	if s.group != "" {
		return nil, perr(protocol.CodeInvalid, "this connection is in group %q already; a connection joins one group", s.group)
	}
	if len(s.caches) > 0 {
		return nil, perr(protocol.CodeInUse, "this connection has %d caches registered: join a group before registering caches", len(s.caches))
	}
	s.group = m.Name
	return &protocol.Empty{T: protocol.TypeGroup | protocol.TypeReply}, nil
}

func (s *session) unpin(m *protocol.Unpin) (protocol.Message, error) {
	n := 0
	if pin, ok := s.pins.ids[m.Pin]; ok {
		delete(s.pins.ids, m.Pin)
		n = s.srv.eng.(Pinner).Unpin(s.ctx, pin.id)
		s.srv.settlePins(pin.charge, 0)
	}
	return &protocol.Count{T: protocol.TypeUnpin | protocol.TypeReply, Count: uint32(n)}, nil
}

// heldPins returns, sorted, the ids of the connection's pins in its
// namespace ns that are still held, and forgets those whose lease ended.
func (s *session) heldPins(ns uint32) []uint64 {
	var held []uint64
	for id, pin := range s.pins.ids {
		if pin.ns != ns {
			continue
		}
		if !s.srv.eng.(Pinner).PinHeld(pin.id) { // only a Pinner's pins are here
			delete(s.pins.ids, id)
			s.srv.settlePins(pin.charge, 0)
			continue
		}
		held = append(held, id)
	}
	slices.Sort(held)
	return held
}

// releasePins releases every pin of the connection (it is ending).
func (s *session) releasePins() {
	p, ok := s.srv.eng.(Pinner)
	if !ok {
		return
	}
	for _, pin := range s.pins.ids {
		p.Unpin(context.Background(), pin.id)
		s.srv.settlePins(pin.charge, 0)
	}
	s.pins.ids = nil
}

// pinList names pin ids in a refusal: the first eight, then how many more.
func pinList(ids []uint64) string {
	const shown = 8
	var b strings.Builder
	for i, id := range ids[:min(len(ids), shown)] {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(strconv.FormatUint(id, 10))
	}
	if len(ids) > shown {
		fmt.Fprintf(&b, " and %d more", len(ids)-shown)
	}
	return b.String()
}
