package staging

import (
	"context"
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// Mover is the CPU data path as a transfer.Mover: it moves plans of
// host-addressable regions (region.Addressable) with the pool's workers,
// computing CRC-32C checksums on the way. NewMover starts its pool; For
// returns views that share it with other options (one per mount).
type Mover struct {
	pool *Pool
	// overlap: with O_DIRECT, checksum each batch on a helper goroutine
	// while the next is in flight (devices); otherwise fused (memory file
	// systems, where the transfer is itself a CPU copy).
	overlap bool
	owner   bool
}

var _ transfer.Mover = (*Mover)(nil)

// NewMover starts a pool (Config) and returns a Mover over it.
func NewMover(cfg Config) (*Mover, error) {
	p, err := newPool(cfg)
	if err != nil {
		return nil, err
	}
	return &Mover{pool: p, owner: true}, nil
}

// For returns a Mover sharing m's pool for files on a device (overlap:
// direct I/O to a block device, where checksums overlap the next transfer)
// or on a memory file system or the page cache (fused checksums).
func (m *Mover) For(device bool) *Mover {
	return &Mover{pool: m.pool, overlap: device}
}

// Pool returns the mover's pool.
func (m *Mover) Pool() *Pool { return m.pool }

// Close stops the pool (of the Mover NewMover returned; views do nothing).
func (m *Mover) Close() {
	if m.owner {
		m.pool.close()
	}
}

// Name implements transfer.Mover.
func (m *Mover) Name() string { return "staging" }

// Checksums implements transfer.Mover: the CPU sees every byte.
func (m *Mover) Checksums() bool { return true }

// WriteFile implements transfer.Mover.
func (m *Mover) WriteFile(ctx context.Context, f fsys.File, p *transfer.Plan, sums []uint32) (int64, error) {
	return m.run(ctx, f, p, sums, true)
}

// ReadFile implements transfer.Mover.
func (m *Mover) ReadFile(ctx context.Context, f fsys.File, p *transfer.Plan, sums []uint32) (int64, error) {
	return m.run(ctx, f, p, sums, false)
}

func (m *Mover) run(ctx context.Context, f fsys.File, p *transfer.Plan, sums []uint32, write bool) (int64, error) {
	if sums != nil && len(sums) < p.Sums {
		return 0, fmt.Errorf("staging: %d checksum slots for a plan of %d", len(sums), p.Sums)
	}
	// Sorted extents keep the bounce buffers' zero tails off bytes
	// already written; slot indices in range keep the workers' checksums
	// from indexing past sums (a panic would end the process).
	if err := p.Check(); err != nil {
		return 0, fmt.Errorf("staging: %w", err)
	}
	spans := make([]span, len(p.Extents))
	var mem []byte
	var last region.Region
	for i, x := range p.Extents {
		if x.Region != last {
			a, ok := x.Region.(region.Addressable)
			if !ok {
				return 0, fmt.Errorf("%w: staging moves host memory; extent %d is in %s region %d", transfer.ErrUnsupported, i, x.Region.Kind(), x.Region.ID())
			}
			if mem = a.Bytes(); mem == nil {
				return 0, fmt.Errorf("staging: extent %d: %w", i, region.ErrClosed)
			}
			last = x.Region
		}
		if x.RegionOff < 0 || x.Len < 0 || x.RegionOff > int64(len(mem)) || x.Len > int64(len(mem))-x.RegionOff {
			return 0, fmt.Errorf("staging: extent %d: %w: [%d, +%d) in %d bytes", i, region.ErrBounds, x.RegionOff, x.Len, len(mem))
		}
		spans[i] = span{Off: x.FileOff, Buf: mem[x.RegionOff : x.RegionOff+x.Len : x.RegionOff+x.Len], Sum: x.Sum}
	}
	opt := options{Direct: p.Direct, Sums: sums, Overlap: m.overlap && p.Direct, Folio: p.Folio}
	if !write {
		var release func()
		f, release = p.ReadSource(f)
		defer release()
	}
	type result struct {
		n   int64
		err error
	}
	done := make(chan result, 1)
	if err := m.pool.submit(ctx, func(w *worker) {
		// Guarded: a client may truncate the shared file behind a region
		// under a running job; the fault fails this plan, not the daemon.
		var n int64
		err := region.Guard(func() (err error) {
			n, err = w.do(ctx, f, spans, opt, write)
			return err
		})
		// The kernel's side of the same fault: a preadv or pwritev
		// straight to or from pages of the truncated file fails with
		// EFAULT. Only region memory reaches those calls from user
		// space (bounce buffers are the daemon's own, never truncated).
		if errors.Is(err, unix.EFAULT) && !errors.Is(err, region.ErrFault) {
			err = fmt.Errorf("%w: %w", region.ErrFault, err)
		}
		done <- result{n, err}
	}); err != nil {
		return 0, err
	}
	r := <-done
	return r.n, r.err
}
