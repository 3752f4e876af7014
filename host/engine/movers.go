package engine

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/internal/fsys"
	"github.com/kvhost/kvhost/internal/region"
	"github.com/kvhost/kvhost/internal/transfer"
)

// Data movers (docs/engine.md, "Data movers"; docs/design.md).
//
// Every file's payload moves as a transfer.Plan, built once per file from
// the format's layout walk, handed to the mover of the file's mount for the
// cache's region kind: host memory goes through the CPU staging pipeline
// (staging.Mover) unless Config.Movers names another; other kinds (device
// memory) need a mover from Config.Movers.

// MountInfo describes a mount to a MoverFactory.
type MountInfo struct {
	Index  int    // the mount's index in Config.Mounts
	Path   string // the mount's root, absolute
	Direct bool   // files are opened with O_DIRECT
	Memory bool   // a memory file system (tmpfs)
}

// MoverFactory builds the data mover of one mount for one region kind. The
// engine does not close the movers it returns (a factory may share one
// mover between mounts).
type MoverFactory func(MountInfo) (transfer.Mover, error)

// buildMovers sets every mount's movers: the staging pipeline for host
// memory, and what cfg.Movers builds.
func (e *Engine) buildMovers() error {
	for _, m := range e.mounts {
		info := MountInfo{Index: m.idx, Path: m.root, Direct: m.direct, Memory: m.memory}
		m.movers = map[region.Kind]transfer.Mover{region.KindHost: e.host.For(m.direct && !m.memory)}
		for kind, build := range e.cfg.Movers {
			if build == nil {
				continue
			}
			mv, err := build(info)
			if err != nil {
				return fmt.Errorf("engine: mount %s: %s mover: %w", m.root, kind, err)
			}
			if mv == nil {
				return fmt.Errorf("%w: mount %s: the %s mover factory returned nil", ErrInvalid, m.root, kind)
			}
			m.movers[kind] = mv
		}
		host := m.movers[region.KindHost]
		m.backend = host.Name()
		m.checksums = m.checksums && host.Checksums()
	}
	// The movers never change: their names are joined once, not per job.
	e.paths = map[region.Kind]string{}
	for _, m := range e.mounts {
		for kind := range m.movers {
			e.paths[kind] = e.pathName(kind)
		}
	}
	return nil
}

// mover returns the mover of m for regions of kind, or an error naming
// both when there is none.
func (m *mount) mover(kind region.Kind) (transfer.Mover, error) {
	if mv := m.movers[kind]; mv != nil {
		return mv, nil
	}
	return nil, fmt.Errorf("%w: %w: no data mover for %s memory on mount %s (Config.Movers)", ErrInvalid, transfer.ErrUnsupported, kind, m.root)
}

// forget tells every mover that caches per-file state that the file with
// identity id is being removed or replaced (movers key their state by
// inode: fsys.FileID.Inode).
func (e *Engine) forget(id fsys.Identity) {
	for _, m := range e.mounts {
		for _, mv := range m.movers {
			if f, ok := mv.(transfer.Forgetter); ok {
				f.Forget(id.FileID)
			}
		}
	}
}

// plan builds the transfer plan of the keys want (nil: all) of a file with
// header h: key k's blocks are the cache blocks blocks(k). Extents of one
// region that are contiguous in both the file and the region, for one
// checksum slot, are merged.
func (c *cache) plan(h *format.Header, want []bool, blocks func(k int) []int, m *mount) *transfer.Plan {
	hl := int64(h.Len())
	bb := int64(h.BlockBytes)
	n := int(h.Layers * h.Planes * h.BlocksPerKey)
	if want == nil {
		n *= len(h.Keys)
	} else {
		k := 0
		for _, w := range want {
			if w {
				k++
			}
		}
		n *= k
	}
	p := &transfer.Plan{Extents: make([]transfer.Extent, 0, n), Sums: len(h.Keys), Direct: m.direct, Memory: m.memory, Folio: m.folio}
	h.Walk(want, func(k, b, l, pl int, off int64) {
		t := &c.layers[l]
		x := transfer.Extent{FileOff: hl + off, Region: t.Region, RegionOff: t.Offset + int64(pl)*t.PlaneStride + int64(blocks(k)[b])*t.BlockStride, Len: bb, Sum: k}
		if i := len(p.Extents) - 1; i >= 0 {
			prev := &p.Extents[i]
			if prev.Region == x.Region && prev.Sum == x.Sum && prev.FileOff+prev.Len == x.FileOff && prev.RegionOff+prev.Len == x.RegionOff {
				prev.Len += x.Len
				return
			}
		}
		p.Extents = append(p.Extents, x)
	})
	return p
}

// fileSlots bounds the files in flight: a store or a load moves a file
// while it holds a slot (Config.IOWorkers of them); a copy between mounts
// takes none but counts as in flight (moving), so that the spare maker
// waits for it too.
type fileSlots struct {
	tokens chan struct{}
	moving atomic.Int64
}

// acquire takes a slot, or fails with ctx's error.
func (s *fileSlots) acquire(ctx context.Context) error {
	select {
	case s.tokens <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// busy reports whether a file is in flight: a slot taken, or a copy
// between mounts.
func (s *fileSlots) busy() bool { return len(s.tokens) > 0 || s.moving.Load() > 0 }

// releaseSlot gives back a slot e.slots.acquire took.
func (e *Engine) releaseSlot() {
	<-e.slots.tokens
	e.fileEnded()
}

// isShort reports whether a mover's error says the file ended early.
func isShort(err error) bool { return errors.Is(err, transfer.ErrShortFile) }

// fileEnded is called after a file in flight released its slot, and
// after a copy between mounts ended.
func (e *Engine) fileEnded() {
	mk := e.maker
	if mk == nil {
		return
	}
	mk.lastEnd.Store(time.Now().UnixNano())
	if !e.slots.busy() {
		select {
		case mk.idle <- struct{}{}:
		default:
		}
	}
}
