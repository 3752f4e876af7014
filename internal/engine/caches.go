package engine

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/region"
)

type cache struct {
	id     CacheID
	ns     *namespace
	layers []LayerTensor
	kind   region.Kind // of every layer's region: picks the mover
	loads  loadOrder   // the order its loads take file slots in
}

// loadOrder makes the loads into one cache take their file slots in the
// order they were submitted: a load waits until the cache's previous load
// has a slot for each of its files. A layer-wise client submits a step's
// loads at once, one per group of layers, and reads layer 0 first; taking
// slots in turns between them would finish every group at about the same
// time, the first as late as the last. Loads into other caches (other
// clients) still take slots as they come.
//
// The load of a step's last layers (a range that ends at the model's last
// layer, after the first) waits until the previous load has ended
// instead: its files would otherwise run beside that load's last ones,
// which then ended with it (on the H200 their copies waited 2-4 ms
// behind the new files'), and the layers of both were left to compute
// after the loads rather than the last range's alone (RATIONALE: "Why 4
// layers per load job, one at both ends, and one throughout from a
// disk?").
type loadOrder struct {
	last atomic.Pointer[turnSignals] // the latest load's
}

// turnSignals is what one load tells the next of its cache.
type turnSignals struct {
	slots chan struct{} // closed once the load has a slot for each of its files
	ended chan struct{} // closed once its files have all ended
}

// take gives a load its turn, behind the cache's previous load; take is
// called in submission order (Engine.Load).
func (o *loadOrder) take() loadTurn {
	mine := &turnSignals{slots: make(chan struct{}), ended: make(chan struct{})}
	return loadTurn{prev: o.last.Swap(mine), mine: mine}
}

// loadTurn is one load's place in its cache's loadOrder.
type loadTurn struct {
	prev, mine *turnSignals // prev nil: the cache's first load
}

// wait returns once the previous load has its slots (afterEnd: once its
// files have all ended), or ctx is done (the order is then given up for
// this load: it never blocks a later one).
func (t loadTurn) wait(ctx context.Context, afterEnd bool) {
	if t.prev == nil {
		return
	}
	ch := t.prev.slots
	if afterEnd {
		ch = t.prev.ended
	}
	select {
	case <-ch:
	case <-ctx.Done():
	}
}

// done lets the next load take slots; runLoad calls it once, when each
// of its files has a slot (or failed to get one).
func (t loadTurn) done() { close(t.mine.slots) }

// ended lets a next load of the step's last layers take slots; runLoad
// calls it once, when its files have all ended.
func (t loadTurn) ended() { close(t.mine.ended) }

// RegisterCache registers the paged KV cache of one worker for namespace ns:
// one tensor per layer. Every block of every layer must lie inside its
// region; every region must be of one kind, for which every mount has a
// data mover (host memory: the staging pipeline, which needs
// host-addressable regions; device memory: Config.Movers).
func (e *Engine) RegisterCache(ns NamespaceID, layers []LayerTensor) (CacheID, error) {
	n, err := e.tables.namespace(ns)
	if err != nil {
		return 0, err
	}
	g := n.geo
	if len(layers) != g.Layers {
		return 0, fmt.Errorf("%w: %d layer tensors for %d layers", ErrInvalid, len(layers), g.Layers)
	}
	c := &cache{ns: n, layers: slices.Clone(layers)}
	bb := g.BlockBytes()
	for l, t := range layers {
		bad := func(format string, args ...any) error {
			return fmt.Errorf("%w: layer %d: "+format, append([]any{ErrInvalid, l}, args...)...)
		}
		if t.Region == nil {
			return 0, bad("no region")
		}
		kind := t.Region.Kind()
		if l == 0 {
			c.kind = kind
		} else if kind != c.kind {
			return 0, bad("%s region %d, but layer 0 is in %s memory: a cache's regions are of one kind", kind, t.Region.ID(), c.kind)
		}
		for _, m := range e.mounts {
			if _, err := m.mover(kind); err != nil {
				return 0, bad("%s region %d: %w", kind, t.Region.ID(), err)
			}
		}
		if kind == region.KindHost {
			a, ok := t.Region.(region.Addressable)
			if !ok {
				return 0, bad("host region %d is not host-addressable", t.Region.ID())
			}
			if a.Bytes() == nil {
				return 0, bad("region %d is closed", t.Region.ID())
			}
		}
		if t.NumBlocks <= 0 || t.Offset < 0 || t.BlockStride < 0 || t.PlaneStride < 0 {
			return 0, bad("num blocks %d, offset %d, block stride %d, plane stride %d", t.NumBlocks, t.Offset, t.BlockStride, t.PlaneStride)
		}
		if t.NumBlocks > 1 && t.BlockStride < bb {
			return 0, bad("block stride %d is less than a block (%d bytes)", t.BlockStride, bb)
		}
		if g.Planes() > 1 && t.PlaneStride < bb {
			return 0, bad("plane stride %d is less than a block (%d bytes)", t.PlaneStride, bb)
		}
		// The last block's offset, without overflow: every term is bounded
		// by what is left of the region before it is multiplied.
		rl := t.Region.Len()
		room := rl - t.Offset
		if room < 0 {
			return 0, bad("offset %d is outside region %d of %d bytes", t.Offset, t.Region.ID(), rl)
		}
		if t.NumBlocks > 1 && int64(t.NumBlocks-1) > room/max(t.BlockStride, 1) {
			return 0, bad("%d blocks of stride %d from offset %d do not fit in region %d of %d bytes", t.NumBlocks, t.BlockStride, t.Offset, t.Region.ID(), rl)
		}
		room -= int64(t.NumBlocks-1) * t.BlockStride
		if g.Planes() > 1 && t.PlaneStride > room {
			return 0, bad("plane stride %d from offset %d does not fit in region %d of %d bytes", t.PlaneStride, t.Offset, t.Region.ID(), rl)
		}
		last := region.Segment{Region: t.Region, Offset: t.Offset + int64(g.Planes()-1)*t.PlaneStride + int64(t.NumBlocks-1)*t.BlockStride, Length: bb}
		if last.Offset < 0 || last.Check() != nil {
			return 0, bad("last block [%d, +%d) is outside region %d of %d bytes", last.Offset, bb, t.Region.ID(), t.Region.Len())
		}
	}
	return e.tables.addCache(c)
}

// addCache gives c an id and registers it (RegisterCache).
func (t *tables) addCache(c *cache) (CacheID, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return 0, ErrClosed
	}
	t.lastCach++
	c.id = CacheID(t.lastCach)
	t.caches[c.id] = c
	return c.id, nil
}

// UnregisterCache forgets a cache. Jobs already submitted keep using it:
// the caller must wait for them before unmapping the regions. It fails
// with ErrClosed once Close has begun, as RegisterCache does.
func (e *Engine) UnregisterCache(id CacheID) error { return e.tables.removeCache(id) }

// removeCache forgets cache id (UnregisterCache).
func (t *tables) removeCache(id CacheID) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return ErrClosed
	}
	if _, ok := t.caches[id]; !ok {
		return fmt.Errorf("%w: %d", ErrUnknownCache, id)
	}
	delete(t.caches, id)
	return nil
}

// request validates the common part of store and load requests (load:
// a load's, whose blocks may be NoBlock).
func (t *tables) request(id CacheID, keys [][]byte, blocks [][]int, load bool) (*cache, error) {
	t.mu.RLock()
	c, ok := t.caches[id]
	closed := t.closed
	t.mu.RUnlock()
	if closed {
		return nil, ErrClosed
	}
	if !ok {
		return nil, fmt.Errorf("%w: %d", ErrUnknownCache, id)
	}
	if len(keys) != len(blocks) {
		return nil, fmt.Errorf("%w: %d keys and %d block lists", ErrInvalid, len(keys), len(blocks))
	}
	bpk := c.ns.geo.BlocksPerKey()
	nb := c.layers[0].NumBlocks
	for _, t := range c.layers {
		nb = min(nb, t.NumBlocks)
	}
	for i, k := range keys {
		if len(k) == 0 || len(k) > abi.MaxKeyLen {
			return nil, fmt.Errorf("%w: key %d: length %d: want 1..%d", ErrInvalid, i, len(k), abi.MaxKeyLen)
		}
		if len(blocks[i]) != bpk {
			return nil, fmt.Errorf("%w: key %d: %d blocks: want %d", ErrInvalid, i, len(blocks[i]), bpk)
		}
		skipped := 0
		for _, b := range blocks[i] {
			if b == NoBlock {
				if !load {
					return nil, fmt.Errorf("%w: key %d: block NoBlock (%d) in a store: only a load may leave blocks of a key out", ErrInvalid, i, NoBlock)
				}
				skipped++
				continue
			}
			if b < 0 || b >= nb {
				return nil, fmt.Errorf("%w: key %d: block %d outside 0..%d", ErrInvalid, i, b, nb-1)
			}
		}
		if skipped == bpk {
			return nil, fmt.Errorf("%w: key %d: every block is NoBlock: a load must name at least one block of each key", ErrInvalid, i)
		}
	}
	return c, nil
}
