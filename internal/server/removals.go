package server

import (
	"context"
	"errors"

	"github.com/kvhost/kvhost/internal/engine/removals"
	"github.com/kvhost/kvhost/protocol"
)

// Removal streams (docs/protocol.md, "Removal streams"): a session's
// subscriptions to the engine's removal feed (package removals), each a
// goroutine that waits for the feed's records of its namespaces and
// pushes them as Removals events. A stream never holds the engine: the
// feed's ring is every subscriber's queue, and a stream whose client reads
// too slowly falls behind it and is told to resync (or, past
// WriteTimeout, loses its connection as any client that does not read
// does).

// RemovalSource is an Engine with a removal feed (*engine.Engine): New
// serves removal streams where its engine is one.
type RemovalSource interface {
	Removals() *removals.Feed
}

// maxStreams bounds a connection's removal subscriptions.
const maxStreams = 16

// removalStream is one subscription of a session.
type removalStream struct {
	cancel context.CancelFunc
	done   chan struct{} // closed when its goroutine has ended
}

// removalBatch is the most records one Removals event of a frame of
// maxFrame bytes carries (keys of MaxKeyLen bytes).
func removalBatch(maxFrame int) int {
	return min(protocol.MaxRemovalBatch, (maxFrame-protocol.HeaderSize-64)/protocol.RemovalSize(protocol.MaxKeyLen))
}

// subscribeRemovals opens a subscription of the session to the removals
// of m's namespaces (those declared on the session; none: all). It
// returns the reply and, on success, start, which the caller calls once
// the reply is sent: no event of the subscription goes before its reply.
func (s *session) subscribeRemovals(m *protocol.SubscribeRemovals) (reply protocol.Message, start func(), err error) {
	feed := s.srv.feed
	if feed == nil {
		return nil, nil, perr(protocol.CodeUnsupported, "this daemon keeps no removal feed")
	}
	if len(s.streams) >= maxStreams {
		return nil, nil, perr(protocol.CodeLimit, "at most %d removal subscriptions per connection", maxStreams)
	}
	fps := make([]uint64, 0, len(m.NS))
	for _, id := range m.NS {
		ns := s.namespaces[id]
		if ns == nil {
			return nil, nil, perr(protocol.CodeUnknownNS, "namespace %d", id)
		}
		fp, err := s.srv.eng.Fingerprint(ns.id)
		if err != nil {
			return nil, nil, err
		}
		fps = append(fps, fp)
	}
	sub, epoch, last, err := feed.Subscribe(fps, m.Epoch, m.Since)
	switch {
	case errors.Is(err, removals.ErrFuture):
		return nil, nil, perr(protocol.CodeInvalid, "%v: subscribe with the epoch and last of this daemon's events", err)
	case errors.Is(err, removals.ErrClosed):
		return nil, nil, errShuttingDown()
	case err != nil:
		return nil, nil, err
	}
	if s.streams == nil {
		s.streams = make(map[uint32]*removalStream)
	}
	s.nextStream++
	for s.nextStream == 0 || s.streams[s.nextStream] != nil {
		s.nextStream++
	}
	id := s.nextStream
	ctx, cancel := context.WithCancel(s.ctx)
	st := &removalStream{cancel: cancel, done: make(chan struct{})}
	s.streams[id] = st
	start = func() {
		s.writeWG.Add(1)
		go func() {
			defer s.writeWG.Done()
			defer close(st.done)
			defer sub.Close()
			s.stream(ctx, id, sub)
		}()
	}
	return &protocol.RemovalsSubscribed{Subscription: id, Epoch: epoch, Last: last, Mounts: feed.Mounts()}, start, nil
}

// stream pushes sub's batches as Removals events of subscription id until
// ctx ends (an unsubscription, the session's end) or the feed closes.
func (s *session) stream(ctx context.Context, id uint32, sub *removals.Subscription) {
	n := removalBatch(s.srv.cfg.MaxFrame)
	for {
		b, err := sub.Next(ctx, n)
		if err != nil {
			return
		}
		ev := &protocol.Removals{Subscription: id, Resync: b.Resync, Last: b.Last, Records: make([]protocol.Removal, len(b.Records))}
		for i, r := range b.Records {
			to := uint16(protocol.NoRemovalMount)
			if r.To != removals.NoMount {
				to = uint16(r.To)
			}
			ev.Records[i] = protocol.Removal{Seq: r.Seq, Fingerprint: r.FP, Reason: r.Reason, Mount: uint16(r.Mount), To: to, Time: uint64(r.Time), Key: []byte(r.Key)}
		}
		s.send(0, ev)
	}
}

// unsubscribeRemovals ends a subscription of the session, and waits for
// its goroutine: no event of it follows the reply.
func (s *session) unsubscribeRemovals(m *protocol.UnsubscribeRemovals) (protocol.Message, error) {
	st := s.streams[m.Subscription]
	if st == nil {
		return nil, perr(protocol.CodeInvalid, "no removal subscription %d on this connection", m.Subscription)
	}
	delete(s.streams, m.Subscription)
	st.cancel()
	<-st.done
	return &protocol.Empty{T: protocol.TypeUnsubscribeRemovals | protocol.TypeReply}, nil
}

// features are the features the server announces in a version-2
// Welcome.
func (s *Server) features() protocol.Feature {
	f := protocol.FeatureLayerLoads
	if s.feed != nil {
		f |= protocol.FeatureRemovals
	}
	return f
}
