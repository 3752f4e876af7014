package engine

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/kvhost/kvhost/region"
)

// Promotion from the object mount (docs/object.md): with a policy that
// decides what the object mount takes (objectTier.lazy), a key loaded
// whole from the bucket is offered to the policy as a store from a cache
// of the daemon's own: it is loaded again from the bucket into that cache,
// verified as every load is, and stored from there, named and admitted by
// the policy as a client's store is. The client's blocks are never the
// source: the client may write them as soon as its load ends.

// promoteQueue is the most keys waiting for promotion; one loaded while
// it is full is not promoted.
const promoteQueue = 64

// objectPromoter promotes the keys queued, one at a time.
type objectPromoter struct {
	host  promoteHost
	down  <-chan struct{} // closed when the engine is: the promoter stops
	start sync.Once       // the promoter's goroutine, at the first offer
	queue chan promotion
	// own is the cache a promotion loads into now (0: none): a load into
	// it queues no promotion.
	own atomic.Uint64
	// promoted counts the keys stored by promotions; dropped, those not
	// queued for want of room.
	promoted, dropped atomic.Uint64
}

// promotion is a key of a namespace to promote.
type promotion struct {
	ns  NamespaceID
	geo Geometry
	key []byte
}

// promoteHost is what a promotion asks of the engine: its public calls.
type promoteHost interface {
	RegisterCache(ns NamespaceID, layers []LayerTensor) (CacheID, error)
	UnregisterCache(id CacheID) error
	Load(ctx context.Context, req LoadRequest) (*Job, error)
	Store(ctx context.Context, req StoreRequest) (*Job, error)
}

// newObjectPromoter returns the promoter of host, which runs from its
// first offer until down is closed.
func newObjectPromoter(host promoteHost, down <-chan struct{}) *objectPromoter {
	return &objectPromoter{host: host, down: down, queue: make(chan promotion, promoteQueue)}
}

// run promotes the keys queued until down is closed.
func (p *objectPromoter) run() {
	for {
		select {
		case <-p.down:
			return
		case pr := <-p.queue:
			p.promote(pr)
		}
	}
}

// offer queues key of c's namespace for promotion, unless c is the
// promoter's own cache; it never blocks.
func (p *objectPromoter) offer(c *cache, key []byte) {
	if uint64(c.id) == p.own.Load() {
		return
	}
	p.start.Do(func() { go p.run() })
	select {
	case p.queue <- promotion{ns: c.ns.id, geo: c.ns.geo, key: append([]byte(nil), key...)}:
	default:
		p.dropped.Add(1)
	}
}

// promote loads pr's key into a cache of its own and stores it from
// there. Any failure (the namespace gone, the object gone, no room, the
// policy's refusal) leaves the key where it was.
func (p *objectPromoter) promote(pr promotion) {
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
	id, err := p.host.RegisterCache(pr.ns, layers)
	if err != nil {
		return
	}
	defer p.host.UnregisterCache(id)
	p.own.Store(uint64(id))
	defer p.own.Store(0)
	blocks := make([]int, bpk)
	for i := range blocks {
		blocks[i] = i
	}
	run := func(j *Job, err error) Outcome {
		if err != nil {
			return OutcomeFailed
		}
		res, _ := j.Wait(ctx)
		if len(res.Keys) != 1 {
			return OutcomeFailed
		}
		return res.Keys[0].Outcome
	}
	keys, bl := [][]byte{pr.key}, [][]int{blocks}
	if run(p.host.Load(ctx, LoadRequest{Cache: id, Keys: keys, Blocks: bl})) != OutcomeLoaded {
		return
	}
	if run(p.host.Store(ctx, StoreRequest{Cache: id, Keys: keys, Blocks: bl})) == OutcomeStored {
		p.promoted.Add(1)
	}
}
