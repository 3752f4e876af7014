// Package removals is the engine's removal feed (docs/engine.md,
// "Removal"): a record of every key that leaves the engine's index or
// changes mount, in a bounded in-memory ring with sequence numbers, read
// by subscribers (the daemon's removal streams, docs/protocol.md
// "Removal streams") that each keep a cursor into it.
//
// Publishing never waits on a subscriber: a record goes into the ring
// and the ring overwrites its oldest record when full. A subscriber whose
// cursor falls behind the ring's oldest record (a slow reader, or a
// client reconnecting after more removals than the ring holds) is told
// to resync instead of being handed a gap: its view of what is stored is
// stale, and it must treat every key as possibly removed. The ring is
// the bounded queue of every subscriber at once: a subscriber costs a
// cursor, not a copy of the records.
//
// Nothing is recorded until the feed's first subscription: before it, no
// client has a sequence number to catch up from, and a daemon without
// subscribers pays one atomic load per removal.
package removals

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/outcome"
)

// Reason is why a key left the index: the vocabulary's (outcome.Reason),
// which the wire protocol's removal records speak too (docs/protocol.md,
// "Removal streams").
type Reason = outcome.Reason

// Reasons of a record (outcome.Evicted, ...: documented there).
const (
	Evicted        = outcome.Evicted        // evicted for room on its mount, or a demotion's victim deleted
	ClusterEvicted = outcome.ClusterEvicted // evicted by this node to keep a cluster mount within its capacity
	Deleted        = outcome.Deleted        // a client deleted the key (Delete)
	Purged         = outcome.Purged         // its namespace was purged (Purge, PurgeModel, a purge record)
	Corrupt        = outcome.Corrupt        // its file failed its checks and was removed
	Vanished       = outcome.Vanished       // its file removed or replaced behind this engine's back
	Moved          = outcome.Moved          // still stored, on another mount (Record.To)
)

// NoMount is Record.To of a record that is not a move.
const NoMount = -1

// Record is one key that left the index (or changed mount).
type Record struct {
	// Seq is the record's sequence number in its feed, from 1; set by
	// Publish.
	Seq uint64
	// FP is the fingerprint of the key's namespace (the Declared reply's).
	FP uint64
	// Key is the key.
	Key string
	// Reason is why it left.
	Reason Reason
	// Mount is the mount the key left (its file's).
	Mount int
	// To is the mount the key is on now where Reason is Moved, else
	// NoMount.
	To int
	// Time is when the record was published (Unix nanoseconds; set by
	// Publish): a subscriber measures its lag from it.
	Time int64
}

// DefaultSize is the records a feed's ring holds when its size is not
// set: a burst of evictions of 64 Ki keys (128 GiB of 2 MiB keys) before
// a subscriber that fell behind is told to resync; some 10 MiB at most.
const DefaultSize = 1 << 16

// Errors of the package.
var (
	// ErrFuture: a subscription's since is past the feed's last record
	// in the same epoch: the client's sequence numbers are not this
	// feed's.
	ErrFuture = errors.New("removals: since is past the feed's last record")
	// ErrClosed: the feed was closed.
	ErrClosed = errors.New("removals: feed closed")
)

// Feed is a removal feed. Its zero value is a feed of DefaultSize
// records; SetSize changes that before the first subscription.
type Feed struct {
	on atomic.Bool // a subscription was made: Publish records

	mu     sync.Mutex
	size   int
	ring   []Record // grows to size, then wraps: ring[(seq-1) % size]
	head   uint64   // the last sequence number given (0: none)
	epoch  uint64   // this feed's, random, never 0; set by the first subscription
	wake   chan struct{}
	closed bool

	mounts []string // the mounts' device classes, by mount index (SetMounts)

	published   atomic.Uint64
	resyncs     atomic.Uint64
	subscribers atomic.Int64
}

// SetMounts names the device class of each mount ("memory", "nvme",
// "ssd", "hdd", "network", "unknown"), by the index records carry: what a
// subscriber maps a record's mount to a medium by.
func (f *Feed) SetMounts(classes []string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.mounts = slices.Clone(classes)
}

// Mounts returns the mounts' device classes (SetMounts).
func (f *Feed) Mounts() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.mounts)
}

// SetSize sets the records the ring holds (at least 1). It fails once
// the feed records (after its first subscription).
func (f *Feed) SetSize(n int) error {
	if n < 1 {
		return fmt.Errorf("removals: ring of %d records: want at least 1", n)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.epoch != 0 {
		return errors.New("removals: the ring's size is set before the first subscription")
	}
	f.size = n
	return nil
}

// startLocked makes the feed record from now on, if it does not yet.
func (f *Feed) startLocked() {
	if f.epoch != 0 {
		return
	}
	if f.size == 0 {
		f.size = DefaultSize
	}
	var b [8]byte
	for f.epoch == 0 {
		if _, err := rand.Read(b[:]); err != nil {
			// No entropy: the clock still tells two runs apart.
			binary.LittleEndian.PutUint64(b[:], uint64(time.Now().UnixNano()))
		}
		f.epoch = binary.LittleEndian.Uint64(b[:])
	}
	f.wake = make(chan struct{})
	f.on.Store(true)
}

// Recording reports whether Publish records: a subscription was made.
// Callers that build records only for the feed ask it first.
func (f *Feed) Recording() bool { return f.on.Load() }

// Publish records recs, giving each its sequence number and time, and
// wakes the subscribers. It never waits on one. It does nothing before
// the first subscription (Recording).
func (f *Feed) Publish(recs ...Record) {
	if len(recs) == 0 || !f.on.Load() {
		return
	}
	now := time.Now().UnixNano()
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		return
	}
	for _, r := range recs {
		f.head++
		r.Seq, r.Time = f.head, now
		if len(f.ring) < f.size {
			f.ring = append(f.ring, r)
		} else {
			f.ring[(r.Seq-1)%uint64(f.size)] = r
		}
	}
	wake := f.wake
	f.wake = make(chan struct{})
	f.mu.Unlock()
	close(wake)
	f.published.Add(uint64(len(recs)))
}

// Close ends every subscription's wait (Next returns ErrClosed) and stops
// recording.
func (f *Feed) Close() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return
	}
	f.closed = true
	if f.wake != nil {
		close(f.wake)
	}
}

// oldestLocked is the sequence number of the oldest record in the ring
// (head + 1 where it is empty).
func (f *Feed) oldestLocked() uint64 { return f.head - uint64(len(f.ring)) + 1 }

// Subscribers returns the subscriptions open now.
func (f *Feed) Subscribers() int64 { return f.subscribers.Load() }

// Stats are a feed's counters and state.
type Stats struct {
	Published   uint64 // records published since the first subscription
	Resyncs     uint64 // resyncs told to subscribers
	Subscribers int64  // subscriptions open now
	Head        uint64 // the last sequence number (0: none)
	Oldest      uint64 // the oldest sequence number the ring holds (Head+1: none)
	Size        int    // the records the ring holds at most (0 before the first subscription)
	Epoch       uint64 // the feed's epoch (0 before the first subscription)
}

// Stats returns the feed's counters and state.
func (f *Feed) Stats() Stats {
	f.mu.Lock()
	head, oldest, size, epoch := f.head, f.oldestLocked(), f.size, f.epoch
	f.mu.Unlock()
	return Stats{Published: f.published.Load(), Resyncs: f.resyncs.Load(), Subscribers: f.subscribers.Load(),
		Head: head, Oldest: oldest, Size: size, Epoch: epoch}
}

// Subscription is a reader of a feed: a cursor into its ring and the
// namespaces it reads. Next is called from one goroutine at a time.
type Subscription struct {
	f      *Feed
	fps    map[uint64]bool // nil: every namespace
	next   uint64          // the next sequence number to read
	resync bool            // a resync is due before any record
	closed atomic.Bool
}

// Subscribe opens a subscription to the records of the namespaces of fps
// (nil or empty: every namespace) after since in epoch: where epoch is the
// feed's, the records after since that the ring still holds; where the
// ring no longer holds the record after since, or epoch is another feed's
// (the daemon restarted), a resync first (Batch.Resync), then the records
// from now on. Epoch 0 with since 0 is a first subscription: the records
// from now on, no resync. It returns the feed's epoch and last sequence
// number now. It fails with ErrFuture where since is past the feed's last
// record in its own epoch, and ErrClosed once the feed is closed.
func (f *Feed) Subscribe(fps []uint64, epoch, since uint64) (*Subscription, uint64, uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return nil, 0, 0, ErrClosed
	}
	f.startLocked()
	s := &Subscription{f: f, next: f.head + 1}
	if len(fps) > 0 {
		s.fps = make(map[uint64]bool, len(fps))
		for _, fp := range fps {
			s.fps[fp] = true
		}
	}
	switch {
	case epoch == 0 && since == 0:
	case epoch != f.epoch:
		s.resync = true
	case since > f.head:
		return nil, 0, 0, fmt.Errorf("%w: since %d, the feed's last is %d", ErrFuture, since, f.head)
	case since+1 < f.oldestLocked():
		s.resync = true
	default:
		s.next = since + 1
	}
	f.subscribers.Add(1)
	return s, f.epoch, f.head, nil
}

// Batch is what Next returns: records in sequence order, or a resync.
type Batch struct {
	// Resync: records were lost to this subscription (it fell behind the
	// ring, or its since was older than the ring or of another epoch):
	// every key of its namespaces may have been removed. Records is
	// empty; the records after Last follow.
	Resync bool
	// Records are the subscription's records, at most the n asked.
	Records []Record
	// Last is the sequence number the subscription has read up to, the
	// since to subscribe with again: at least the last record's (records
	// of other namespaces after it were read too).
	Last uint64
}

// Next waits until the subscription has records or a resync is due, or
// ctx ends, and returns at most n of its records (n < 1: 1). It fails
// with ctx's error, or ErrClosed where the feed or the subscription was
// closed.
func (s *Subscription) Next(ctx context.Context, n int) (Batch, error) {
	n = max(n, 1)
	f := s.f
	for {
		if s.closed.Load() {
			return Batch{}, ErrClosed
		}
		f.mu.Lock()
		if f.closed {
			f.mu.Unlock()
			return Batch{}, ErrClosed
		}
		if s.next < f.oldestLocked() && s.next <= f.head {
			s.resync = true // it fell behind the ring
		}
		if s.resync {
			s.resync, s.next = false, f.head+1
			last := f.head
			f.mu.Unlock()
			f.resyncs.Add(1)
			return Batch{Resync: true, Last: last}, nil
		}
		var b Batch
		for ; s.next <= f.head && len(b.Records) < n; s.next++ {
			r := f.ring[(s.next-1)%uint64(f.size)]
			if s.fps == nil || s.fps[r.FP] {
				b.Records = append(b.Records, r)
			}
		}
		b.Last = s.next - 1
		wake := f.wake
		f.mu.Unlock()
		if len(b.Records) > 0 {
			return b, nil
		}
		select {
		case <-ctx.Done():
			return Batch{}, ctx.Err()
		case <-wake:
		}
	}
}

// Close ends the subscription: a Next waiting returns ErrClosed at the
// feed's next record, and at once if its context is cancelled with it.
func (s *Subscription) Close() {
	if s.closed.CompareAndSwap(false, true) {
		s.f.subscribers.Add(-1)
	}
}
