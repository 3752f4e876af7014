package client

import (
	"context"
	"fmt"
	"sync"

	"github.com/kvhost/kvhost/protocol"
)

// FeatureRemovals: the daemon serves removal streams (Client.Removals).
const FeatureRemovals = protocol.FeatureRemovals

// Types of removal streams, shared with the protocol.
type (
	// Removal is one key that left the daemon (or changed mount: its
	// Reason is protocol.RemovalMoved and To the mount it is on now).
	Removal = protocol.Removal
	// RemovalReason is why a key left.
	RemovalReason = protocol.RemovalReason
)

// RemovalCursor is where a removal subscription resumes: the daemon's
// epoch and the last sequence number read. Its zero value is a first
// subscription (the removals from now on).
type RemovalCursor struct {
	Epoch uint64
	Last  uint64
}

// RemovalBatch is what a subscription delivers: removals in sequence
// order, or a resync.
type RemovalBatch struct {
	// Resync: removals were lost to the subscription (it fell behind the
	// daemon's ring or this client's queue, or resumed from a cursor the
	// daemon no longer holds or of a daemon since restarted): every key
	// of its namespaces may have been removed. Records is empty; a
	// router treats every key as possibly gone (vLLM's AllBlocksCleared)
	// and learns them again by lookups.
	Resync  bool
	Records []Removal
	// Cursor is where to resume after this batch.
	Cursor RemovalCursor
}

// removalQueue is the most batches a subscription holds for its reader;
// past it the queue is dropped for a resync.
const removalQueue = 256

// RemovalSubscription is a removal stream of a Client: the daemon pushes
// its batches, which Next returns in order. Its queue is bounded: a reader
// that falls more than 256 batches behind gets a resync in place of them.
type RemovalSubscription struct {
	c      *Client
	id     uint32
	epoch  uint64
	first  RemovalCursor // the daemon's epoch and last when it subscribed
	mounts []string      // the daemon's mounts' device classes

	mu     sync.Mutex
	queue  []RemovalBatch
	lost   bool          // the queue overflowed: a resync is due
	lostAt uint64        // the Last of the newest batch dropped
	wake   chan struct{} // closed and replaced when a batch comes
	err    error         // the connection's, once lost, or ErrClosed after Close
	cursor RemovalCursor // of the last batch Next returned
}

// Removals subscribes to the removals of namespaces ns (declared on this
// connection; none: every namespace of the daemon) after from: the zero
// cursor the first time, then the Cursor of the last batch read, on this
// connection or another. Where the daemon cannot serve from without a gap
// (a cursor older than its ring, or of a daemon since restarted) the first
// batch is a resync. It returns ErrUnsupported, sending nothing, where
// the daemon did not announce FeatureRemovals.
func (c *Client) Removals(ctx context.Context, from RemovalCursor, ns ...NamespaceID) (*RemovalSubscription, error) {
	if !c.Supports(FeatureRemovals) {
		return nil, fmt.Errorf("%w: removal streams: the daemon %q announced none (protocol version %d, features %#x)",
			ErrUnsupported, c.Limits().Server, c.Limits().Version, uint64(c.Limits().Features))
	}
	if len(ns) > protocol.MaxKeysPerRequest {
		return nil, fmt.Errorf("%w: %d namespaces: at most %d", ErrInvalid, len(ns), protocol.MaxKeysPerRequest)
	}
	m := &protocol.SubscribeRemovals{Epoch: from.Epoch, Since: from.Last, NS: make([]uint32, len(ns))}
	for i, id := range ns {
		m.NS[i] = uint32(id)
	}
	r, err := c.create(ctx, m, nil, func(r protocol.Message) {
		id := r.(*protocol.RemovalsSubscribed).Subscription
		c.undo(func(ctx context.Context) error {
			_, err := c.call(ctx, &protocol.UnsubscribeRemovals{Subscription: id}, nil)
			c.mu.Lock()
			delete(c.subs, id)
			c.mu.Unlock()
			return err
		})
	})
	if err != nil {
		return nil, err
	}
	id := r.(*protocol.RemovalsSubscribed).Subscription
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.subs[id] // made by the reader with the reply (subscribed)
	if s == nil {
		return nil, fmt.Errorf("%w: removal subscription %d lost", ErrClosed, id)
	}
	return s, nil
}

// subscribed makes the subscription a RemovalsSubscribed reply names,
// before the reader reads its first event. Called with c.mu held.
func (c *Client) subscribed(m *protocol.RemovalsSubscribed) {
	if c.subs == nil {
		c.subs = make(map[uint32]*RemovalSubscription)
	}
	cur := RemovalCursor{Epoch: m.Epoch, Last: m.Last}
	c.subs[m.Subscription] = &RemovalSubscription{c: c, id: m.Subscription, epoch: m.Epoch, first: cur, cursor: cur, mounts: m.Mounts, wake: make(chan struct{})}
}

// removals hands a Removals event to its subscription; one of a
// subscription no longer open (ended meanwhile) is dropped.
func (c *Client) removals(m *protocol.Removals) {
	c.mu.Lock()
	s := c.subs[m.Subscription]
	c.mu.Unlock()
	if s == nil {
		return
	}
	s.push(RemovalBatch{Resync: m.Resync, Records: m.Records, Cursor: RemovalCursor{Epoch: s.epoch, Last: m.Last}})
}

// endSubscriptions ends every subscription with err (the connection's).
// Called with c.mu held.
func (c *Client) endSubscriptions(err error) {
	for _, s := range c.subs {
		s.end(err)
	}
	c.subs = nil
}

// push queues b for the reader, or, past removalQueue batches, drops the
// queue for a resync.
func (s *RemovalSubscription) push(b RemovalBatch) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return
	}
	switch {
	case s.lost:
		s.lostAt = b.Cursor.Last
	case len(s.queue) >= removalQueue:
		s.queue, s.lost, s.lostAt = nil, true, b.Cursor.Last
	default:
		s.queue = append(s.queue, b)
	}
	close(s.wake)
	s.wake = make(chan struct{})
}

// end fails the subscription's Next with err once its queue is read.
func (s *RemovalSubscription) end(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err == nil {
		s.err = err
		close(s.wake)
	}
}

// Next returns the next batch, waiting for one until ctx ends. Once the
// subscription is closed, or its connection lost, it returns the batches
// queued and then ErrClosed (wrapped with the connection's error).
func (s *RemovalSubscription) Next(ctx context.Context) (RemovalBatch, error) {
	for {
		s.mu.Lock()
		switch {
		case s.lost:
			s.lost = false
			b := RemovalBatch{Resync: true, Cursor: RemovalCursor{Epoch: s.epoch, Last: s.lostAt}}
			s.cursor = b.Cursor
			s.mu.Unlock()
			return b, nil
		case len(s.queue) > 0:
			b := s.queue[0]
			s.queue = s.queue[1:]
			s.cursor = b.Cursor
			s.mu.Unlock()
			return b, nil
		case s.err != nil:
			err := s.err
			s.mu.Unlock()
			return RemovalBatch{}, err
		}
		wake := s.wake
		s.mu.Unlock()
		select {
		case <-ctx.Done():
			return RemovalBatch{}, ctx.Err()
		case <-wake:
		}
	}
}

// Cursor is where to resume after the last batch Next returned (before
// any: the daemon's epoch and last sequence number when it subscribed).
func (s *RemovalSubscription) Cursor() RemovalCursor {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cursor
}

// Subscribed is the daemon's epoch and last sequence number when the
// subscription was made.
func (s *RemovalSubscription) Subscribed() RemovalCursor { return s.first }

// Mounts are the device classes of the daemon's mounts ("memory", "nvme",
// "ssd", "hdd", "network", "unknown"; "object" for its object mount, last)
// by the index a Removal's Mount and To name: the medium a key left, or
// moved to.
func (s *RemovalSubscription) Mounts() []string { return s.mounts }

// Close ends the subscription: the daemon sends none of its batches after
// its answer, and Next returns ErrClosed once the batches queued are read.
func (s *RemovalSubscription) Close(ctx context.Context) error {
	s.c.mu.Lock()
	open := s.c.subs[s.id] == s
	s.c.mu.Unlock()
	if !open {
		return nil
	}
	_, err := s.c.call(ctx, &protocol.UnsubscribeRemovals{Subscription: s.id}, nil)
	s.c.mu.Lock()
	if s.c.subs[s.id] == s {
		delete(s.c.subs, s.id)
	}
	s.c.mu.Unlock()
	s.end(fmt.Errorf("%w: the removal subscription was closed", ErrClosed))
	return err
}
