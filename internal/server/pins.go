package server

import (
	"context"
	"time"

	"github.com/kvhost/kvhost/host/engine"
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
	ids  map[uint64]engine.PinID
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
	sp := &s.pins
	if len(sp.ids) >= MaxPinsPerConnection {
		for id, eid := range sp.ids { // forget pins whose lease ended
			if !p.PinHeld(eid) {
				delete(sp.ids, id)
			}
		}
		if len(sp.ids) >= MaxPinsPerConnection {
			return nil, s.srv.refuse(boundPins, "%d pins held on this connection: unpin some first", len(sp.ids))
		}
	}
	eid, held, err := p.Pin(s.ctx, ns.id, m.Keys, time.Duration(m.LeaseMillis)*time.Millisecond)
	if err != nil {
		return nil, err
	}
	reply := &protocol.Pinned{State: make([]uint8, len(held))}
	for i, h := range held {
		if h {
			reply.State[i] = protocol.PinHeld
		}
	}
	if eid != 0 {
		if sp.ids == nil {
			sp.ids = map[uint64]engine.PinID{}
		}
		sp.next++
		sp.ids[sp.next] = eid
		reply.Pin = sp.next
	}
	return reply, nil
}

func (s *session) unpin(m *protocol.Unpin) (protocol.Message, error) {
	n := 0
	if eid, ok := s.pins.ids[m.Pin]; ok {
		delete(s.pins.ids, m.Pin)
		n = s.srv.eng.(Pinner).Unpin(s.ctx, eid)
	}
	return &protocol.Count{T: protocol.TypeUnpin | protocol.TypeReply, Count: uint32(n)}, nil
}

// releasePins releases every pin of the connection (it is ending).
func (s *session) releasePins() {
	p, ok := s.srv.eng.(Pinner)
	if !ok {
		return
	}
	for _, eid := range s.pins.ids {
		p.Unpin(context.Background(), eid)
	}
	s.pins.ids = nil
}
