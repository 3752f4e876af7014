package transfer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/kvhost/kvhost/fsys"
)

// Chain is a Mover that tries its movers in order: a mover that answers
// ErrUnsupported (before moving any byte, by that error's contract) passes
// the plan to the next one. The first fallback from each mover, with its
// reason, is logged once; every fallback is counted. Any other error fails
// the call: a failure never becomes a success on another path.
//
// A chain is how a mount serves device memory: cuFile where the mount
// allows a direct path, the pinned staging pipeline otherwise.
type Chain struct {
	movers []Mover
	log    *slog.Logger
	mount  string
	// fallbacks[i] counts plans mover i passed on.
	fallbacks []atomic.Uint64
	logged    []sync.Once
}

// NewChain chains movers (at least one) for the mount named mount (for
// logs). A nil logger discards.
func NewChain(mount string, log *slog.Logger, movers ...Mover) (*Chain, error) {
	if len(movers) == 0 {
		return nil, errors.New("transfer: empty chain")
	}
	for i, m := range movers {
		if m == nil {
			return nil, fmt.Errorf("transfer: chain mover %d is nil", i)
		}
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Chain{
		movers:    movers,
		log:       log,
		mount:     mount,
		fallbacks: make([]atomic.Uint64, len(movers)),
		logged:    make([]sync.Once, len(movers)),
	}, nil
}

// Name names the chain: its movers' names joined by "→".
func (c *Chain) Name() string {
	s := c.movers[0].Name()
	for _, m := range c.movers[1:] {
		s += "→" + m.Name()
	}
	return s
}

// Checksums is true only if every mover of the chain checksums: the
// engine must know before the transfer whether the file will carry
// checksums.
func (c *Chain) Checksums() bool {
	for _, m := range c.movers {
		if !m.Checksums() {
			return false
		}
	}
	return true
}

// SumsWritten is true only if every mover of the chain's write checksums
// are of the bytes written (WrittenSummer): any of them may take a plan.
func (c *Chain) SumsWritten() bool {
	for _, m := range c.movers {
		if !SumsWritten(m) {
			return false
		}
	}
	return true
}

// WriteFile writes through the first mover that supports the plan.
func (c *Chain) WriteFile(ctx context.Context, f fsys.File, p *Plan, sums []uint32) (int64, error) {
	return c.do(ctx, func(m Mover) (int64, error) { return m.WriteFile(ctx, f, p, sums) })
}

// ReadFile reads through the first mover that supports the plan.
func (c *Chain) ReadFile(ctx context.Context, f fsys.File, p *Plan, sums []uint32) (int64, error) {
	return c.do(ctx, func(m Mover) (int64, error) { return m.ReadFile(ctx, f, p, sums) })
}

func (c *Chain) do(ctx context.Context, call func(Mover) (int64, error)) (int64, error) {
	var last error
	for i, m := range c.movers {
		n, err := call(m)
		if err == nil || !errors.Is(err, ErrUnsupported) {
			return n, err
		}
		if n != 0 {
			return n, fmt.Errorf("transfer: %s moved %d bytes and then answered unsupported: %w", m.Name(), n, err)
		}
		last = err
		if i+1 < len(c.movers) {
			// The last mover passes nothing on: its ErrUnsupported
			// fails the call, and is no fallback.
			c.fallbacks[i].Add(1)
			c.logged[i].Do(func() {
				c.log.Warn("data path falls back", "mount", c.mount, "from", m.Name(), "to", c.movers[i+1].Name(), "reason", err.Error())
			})
		}
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
	}
	return 0, last
}

// Fallbacks reports, per mover name, how many plans it passed on.
func (c *Chain) Fallbacks() map[string]uint64 {
	out := make(map[string]uint64, len(c.movers))
	for i, m := range c.movers {
		out[m.Name()] += c.fallbacks[i].Load()
	}
	return out
}

// Forget forwards to every mover that caches per-file state.
func (c *Chain) Forget(id fsys.FileID) {
	for _, m := range c.movers {
		if f, ok := m.(Forgetter); ok {
			f.Forget(id)
		}
	}
}

// Prepare forwards to every mover that sets up per-file state ahead of
// a file's first job.
func (c *Chain) Prepare(f fsys.File) {
	for _, m := range c.movers {
		if p, ok := m.(Preparer); ok {
			p.Prepare(f)
		}
	}
}

// Warm forwards to every mover that sets up per-file state ahead of a
// file's first job, and reports whether any of them would take another
// file.
func (c *Chain) Warm(f fsys.File) bool {
	more := false
	for _, m := range c.movers {
		if w, ok := m.(Warmer); ok && w.Warm(f) {
			more = true
		}
	}
	return more
}
