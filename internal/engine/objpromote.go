package engine

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/kvhost/kvhost/internal/crc32c"
	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/region"
)

// Promotion from the object mount (docs/object.md): with a policy that
// decides what the object mount takes (objectTier.lazy), a key loaded
// whole from the bucket is offered to the policy as a store from a cache
// of the daemon's own, from the bytes the load already read: the object
// is not read again. The bytes are the daemon's before the load ends (the
// memory file a load into GPU memory verified them in, or a copy of the
// client's blocks made before the load answers, while the client may not
// write them), and the promotion checks them against the object's
// checksum once more, in the cache it stores from, before the store: a
// client that wrote its blocks during the load has its key not promoted.

// promoteQueue is the most keys waiting for promotion, each holding its
// object's bytes; one loaded while it is full is not promoted.
const promoteQueue = 8

// objectPromoter promotes the keys queued, one at a time.
type objectPromoter struct {
	host promoteHost
	// has reports whether the object mount still holds a key: one
	// deleted, purged or evicted from the bucket since its load is not
	// stored again.
	has   func(fp uint64, key []byte) bool
	down  <-chan struct{} // closed when the engine is: the promoter stops
	start sync.Once       // the promoter's goroutine, at the first offer
	mu    sync.Mutex      // guards closed and the sends on queue
	// closed: down was seen, the queue drained; an offer is released.
	closed bool
	queue  chan promotion
	// bufs are buffers of promotions from host memory, given back for
	// the next (a new one's zeroing and page faults halve the copy's
	// rate: BenchmarkPromotionCopy).
	bufs chan []byte
	// promoted counts the keys stored by promotions; dropped, those not
	// queued for want of room; unverified, those whose bytes did not
	// match the object's checksum when the promotion checked them.
	promoted, dropped, unverified atomic.Uint64
}

// promotion is a key of a namespace to promote, with the bytes of its
// object as a load read and verified them.
type promotion struct {
	ns  NamespaceID
	fp  uint64
	geo Geometry
	key []byte
	h   *format.Header // the object's, checked by the load
	k   int            // the key's index in h
	// obj holds the object's payload at its offsets in the object
	// (h.FileLen() bytes; the header's area is not read): the daemon's
	// memory, which no client writes.
	obj []byte
	// release gives obj back (a memory file to its pool); nil: nothing
	// to give back.
	release func()
}

// done gives pr's bytes back.
func (pr *promotion) done() {
	if pr.release != nil {
		pr.release()
		pr.release = nil
	}
}

// promoteHost is what a promotion asks of the engine: its public calls.
type promoteHost interface {
	RegisterCache(ns NamespaceID, layers []LayerTensor) (CacheID, error)
	UnregisterCache(id CacheID) error
	Store(ctx context.Context, req StoreRequest) (*Job, error)
}

// newObjectPromoter returns the promoter of host, which runs from its
// first offer until down is closed; has is the object mount's Has.
func newObjectPromoter(host promoteHost, has func(fp uint64, key []byte) bool, down <-chan struct{}) *objectPromoter {
	return &objectPromoter{host: host, has: has, down: down, queue: make(chan promotion, promoteQueue), bufs: make(chan []byte, promoteQueue+1)}
}

// buffer returns a buffer of size bytes for a promotion's bytes: one
// given back (giveBack) if it is large enough, else a new one.
func (p *objectPromoter) buffer(size int64) []byte {
	select {
	case b := <-p.bufs:
		if int64(cap(b)) >= size {
			return b[:size]
		}
	default:
	}
	return make([]byte, size)
}

// giveBack keeps b for a later promotion, unless enough are kept.
func (p *objectPromoter) giveBack(b []byte) {
	select {
	case p.bufs <- b:
	default:
	}
}

// run promotes the keys queued until down is closed, then gives back
// the bytes of those left.
func (p *objectPromoter) run() {
	for {
		select {
		case <-p.down:
			p.mu.Lock()
			p.closed = true
			p.mu.Unlock()
			for {
				select {
				case pr := <-p.queue:
					pr.done()
				default:
					return
				}
			}
		case pr := <-p.queue:
			p.promote(pr)
		}
	}
}

// room reports whether a promotion offered now would be queued: the
// caller then gathers its bytes. Another offer may take the room first
// (offer then drops it).
func (p *objectPromoter) room() bool {
	if len(p.queue) < cap(p.queue) {
		return true
	}
	p.dropped.Add(1)
	return false
}

// offer queues pr; it never blocks. Where the queue is full or the
// promoter stopped, pr's bytes are given back at once.
func (p *objectPromoter) offer(pr promotion) {
	p.start.Do(func() { go p.run() })
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.closed {
		select {
		case p.queue <- pr:
			return
		default:
			p.dropped.Add(1)
		}
	}
	pr.done()
}

// promote stores pr's key from a cache of its own, filled from pr's
// bytes and checked against the object's checksum there first. Any
// failure (the namespace gone, the key gone from the bucket, bytes that
// do not verify, no room, the policy's refusal) leaves the key where it
// was.
func (p *objectPromoter) promote(pr promotion) {
	defer pr.done()
	if !p.has(pr.fp, pr.key) {
		return
	}
	ctx := context.Background()
	g := pr.geo
	bpk, bb, planes := g.BlocksPerKey(), g.BlockBytes(), g.Planes()
	perLayer := int64(planes*bpk) * bb
	reg, err := region.NewHost("kvhost-promote", perLayer*int64(g.Layers))
	if err != nil {
		return
	}
	defer reg.Close()
	layers := make([]LayerTensor, g.Layers)
	for l := range layers {
		layers[l] = LayerTensor{Region: reg, Offset: int64(l) * perLayer, BlockStride: bb, PlaneStride: int64(bpk) * bb, NumBlocks: bpk}
	}
	if !fillPromotion(reg.Bytes(), layers, pr) {
		p.unverified.Add(1)
		return
	}
	pr.done() // the bytes are in the cache now
	id, err := p.host.RegisterCache(pr.ns, layers)
	if err != nil {
		return
	}
	defer p.host.UnregisterCache(id)
	blocks := make([]int, bpk)
	for i := range blocks {
		blocks[i] = i
	}
	j, err := p.host.Store(ctx, StoreRequest{Cache: id, Keys: [][]byte{pr.key}, Blocks: [][]int{blocks}})
	if err != nil {
		return
	}
	if res, _ := j.Wait(ctx); len(res.Keys) == 1 && res.Keys[0].Outcome == OutcomeStored {
		p.promoted.Add(1)
	}
}

// fillPromotion copies pr's key from pr.obj into mem, a cache's memory
// whose layers are layers (block b of the key is block b of each), and
// reports whether the CRC-32C of the bytes copied, in payload order, is
// the object's checksum of the key.
func fillPromotion(mem []byte, layers []LayerTensor, pr promotion) bool {
	hl, bb := int64(pr.h.Len()), int64(pr.h.BlockBytes)
	want := make([]bool, len(pr.h.Keys))
	want[pr.k] = true
	var sum uint32
	pr.h.Walk(want, func(_, b, l, p int, off int64) {
		t := &layers[l]
		at := t.Offset + int64(p)*t.PlaneStride + int64(b)*t.BlockStride
		dst := mem[at : at+bb]
		copy(dst, pr.obj[hl+off:hl+off+bb])
		sum = crc32c.Update(sum, dst)
	})
	return sum == pr.h.Keys[pr.k].Sum
}
