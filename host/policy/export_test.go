package policy

import (
	"context"
	"sync/atomic"
	"time"
)

// CountFuel makes every wasm instance h has now count the fuel its calls
// spend and the time they take; the returned function reads the totals. It
// lets benchmarks relate fuel to time.
func CountFuel(h *Host) func() (fuel, ns int64) {
	c := &fuelCounts{}
	h.mu.RLock()
	defer h.mu.RUnlock()
	for _, s := range h.mu.shards {
		s.mu.Lock()
		switch in := s.inst.(type) {
		case *wasmInstance:
			s.inst = &countingInstance{wasmInstance: in, c: c}
		case *countingInstance:
			s.inst = &countingInstance{wasmInstance: in.wasmInstance, c: c}
		}
		s.mu.Unlock()
	}
	return func() (int64, int64) { return c.fuel.Load(), c.ns.Load() }
}

type fuelCounts struct{ fuel, ns atomic.Int64 }

// countingInstance is a wasmInstance that counts its calls' fuel and time.
type countingInstance struct {
	*wasmInstance
	c *fuelCounts
}

func (in *countingInstance) call(ctx context.Context, h hook, arg int32) (int32, error) {
	start := time.Now()
	r, err := in.wasmInstance.call(ctx, h, arg)
	in.c.ns.Add(int64(time.Since(start)))
	in.c.fuel.Add(fuelFor(in.b.cfg.CallTimeout) - int64(in.fuel.Get()))
	return r, err
}

// Route is the shard among n that a record of id x goes to.
func Route(x uint64, n int) int { return route(x, n) }
