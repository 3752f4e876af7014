package engine

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/crc32c"
	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// Data movers (docs/engine.md, "Data movers"; docs/design.md).
//
// Every file's payload moves as a transfer.Plan, built once per file from
// the format's layout walk, handed to the mover of the file's mount for the
// cache's region kind: host memory goes through the CPU path that
// Config.Host builds (the daemon's: the staging pipeline) unless
// Config.Movers names another; other kinds (device memory) need a mover
// from Config.Movers. The engine imports no data path: the daemon's
// assembly picks them all.

// HostPath is the CPU path: the mover of host memory on every mount, whose
// workers are the engine's I/O workers (Config.Host builds it; the
// daemon's is the staging pipeline, staging.Mover). The engine closes it
// at Close.
type HostPath interface {
	// For returns the path's mover for a mount whose files are opened
	// with O_DIRECT (direct) or not.
	For(direct bool) transfer.Mover
	// Buffers reports the path's bounce buffers: in use now, the most
	// that may exist, and their size in bytes.
	Buffers() (inUse, limit, size int)
	// Close stops the path's workers.
	Close()
}

// HostSpec is what the engine asks of its CPU path (Config.Host), from
// its Config: Workers I/O workers (Config.IOWorkers), pinned to CPUs
// round-robin where set, bounce buffers of BufferSize bytes, at most
// Buffers of them (Config.StagingBytes), and a worker's CPU given up after
// every YieldBytes it moved (0: never).
type HostSpec struct {
	Workers    int
	CPUs       []int
	BufferSize int
	Buffers    int
	YieldBytes int64
}

// HostFactory builds the CPU path of an engine (Config.Host).
type HostFactory func(HostSpec) (HostPath, error)

// movers is how the engine moves payloads: the CPU path, the name of
// each memory kind's movers, and the slots that bound the files in
// flight. Open sets them; they never change after.
type movers struct {
	host  HostPath               // the CPU path; its workers are the engine's I/O workers
	paths map[region.Kind]string // pathName of each kind with a mover, set with the movers
	slots fileSlots              // the files in flight
}

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

// buildMovers sets every mount's movers: the CPU path for host memory,
// and what cfg.Movers builds.
func (e *Engine) buildMovers() error {
	for _, m := range e.mounts {
		info := MountInfo{Index: m.idx, Path: m.root, Direct: m.direct, Memory: m.memory}
		m.movers = map[region.Kind]transfer.Mover{region.KindHost: e.mv.host.For(m.direct && !m.memory)}
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
	e.mv.paths = map[region.Kind]string{}
	for _, m := range e.mounts {
		for kind := range m.movers {
			e.mv.paths[kind] = e.pathName(kind)
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

// verify is how a plan's checksum slots verify the keys it reads.
type verify uint8

// How a plan verifies its keys.
const (
	// verifyNone: nothing is verified (the file has no payload sums, or
	// the mover computes none); only the moved bytes are read.
	verifyNone verify = iota
	// verifyKeys: each key's checksum (format.Key.Sum) over the whole
	// key: its bytes the plan does not move (NoBlock blocks, layers
	// outside the range) are read for it (checks.read).
	verifyKeys
	// verifyLayers: one checksum per layer of the range of each key
	// (format.Header.LayerSums): bytes of other layers are neither
	// moved nor read; NoBlock blocks of the range's layers are read.
	verifyLayers
	// verifyBlockLayers: one checksum per (key, block, layer), both
	// planes: a store's of a block-major file, whose keys' layer sums
	// and key sums are both joined from them (checks.stored).
	verifyBlockLayers
)

// plan builds the transfer plan of the layers lr of the keys want (nil:
// all) of a file with header h: key k's blocks are the cache blocks
// blocks(k). Extents of one region that are contiguous in both the file
// and the region, for one checksum slot, are merged.
//
// Only the segments of the range's layers whose block is not NoBlock have
// extents in the plan: no mover writes into a cache block, or a layer of
// it, the request did not name. The checks say how the slots verify the
// keys (by): each verified unit (a key, or a layer of a key) feeds one
// checksum slot per run of its payload that the plan moves or leaves out,
// which checks.sum joins into the unit's checksum. What a unit needs that
// the plan does not move is in checks.reads, for the engine to read and
// checksum itself (checks.read).
func (c *cache) plan(h *format.Header, want []bool, blocks func(k int) []int, m *mount, lr LayerRange, by verify) (*transfer.Plan, *checks) {
	hl := int64(h.Len())
	bb := int64(h.BlockBytes)
	first, end := lr.of(int(h.Layers))
	count := end - first
	wanted := 0
	for k := range h.Keys {
		if want == nil || want[k] {
			wanted++
		}
	}
	ck := &checks{by: by, first: first, layers: int(h.Layers), per: 1, moved: make([]int64, len(h.Keys)), skipped: make([]int64, len(h.Keys))}
	switch by {
	case verifyLayers:
		ck.per = count
	case verifyBlockLayers:
		ck.per = int(h.BlocksPerKey) * count
	}
	ck.units = make([][]part, len(h.Keys)*ck.per)
	n := count * int(h.Planes*h.BlocksPerKey)
	p := &transfer.Plan{Extents: make([]transfer.Extent, 0, n*wanted), Direct: m.direct, Memory: m.memory, Folio: m.folio}
	h.Walk(want, func(k, b, l, pl int, off int64) {
		blk := blocks(k)[b]
		in := l >= first && l < first+count
		skip := !in || blk == NoBlock
		if skip && (by == verifyNone || by == verifyLayers && !in) {
			return // neither moved nor verified
		}
		u := ck.unit(k, b, l)
		// A new slot where the unit's payload turns from moved to
		// skipped bytes or back.
		ps := ck.units[u]
		if len(ps) == 0 || ps[len(ps)-1].skip != skip {
			ps = append(ps, part{slot: p.Sums, skip: skip})
			p.Sums++
		}
		last := &ps[len(ps)-1]
		last.n += bb
		ck.units[u] = ps
		sum := last.slot
		if skip {
			ck.skipped[k] += bb
			x := transfer.Extent{FileOff: hl + off, Len: bb, Sum: sum}
			if i := len(ck.reads) - 1; i >= 0 {
				prev := &ck.reads[i]
				if prev.Sum == x.Sum && prev.FileOff+prev.Len == x.FileOff {
					prev.Len += x.Len
					return
				}
			}
			ck.reads = append(ck.reads, x)
			return
		}
		ck.moved[k] += bb
		t := &c.layers[l]
		x := transfer.Extent{FileOff: hl + off, Region: t.Region, RegionOff: t.Offset + int64(pl)*t.PlaneStride + int64(blk)*t.BlockStride, Len: bb, Sum: sum}
		if i := len(p.Extents) - 1; i >= 0 {
			prev := &p.Extents[i]
			if prev.Region == x.Region && prev.Sum == x.Sum && prev.FileOff+prev.Len == x.FileOff && prev.RegionOff+prev.Len == x.RegionOff {
				prev.Len += x.Len
				return
			}
		}
		p.Extents = append(p.Extents, x)
	})
	return p, ck
}

// checks are how a plan's checksum slots verify its keys (cache.plan):
// the units verified (a key, or each layer of a key's range), the runs of
// each unit's payload and their slots, and the bytes the plan leaves out
// that the engine reads only to verify the units.
type checks struct {
	by     verify
	first  int // the range's first layer
	layers int // the file's layers
	per    int // units per file key: 1, the range's layers (verifyLayers), blocks·layers (verifyBlockLayers)
	// units[u] are the runs of unit u's payload, in payload order, each
	// feeding a slot of its own: unit k for file key k (verifyKeys,
	// verifyNone), k·per + l - first for its layer l (verifyLayers),
	// k·per + b·layers + l for its block b's layer l (verifyBlockLayers,
	// every layer).
	// Empty for a key the plan does not read.
	units [][]part
	// reads are the skipped bytes' extents, by file offset: Region is
	// nil, Sum the checksum slot they feed.
	reads []transfer.Extent
	// moved[k] is the payload bytes of file key k the plan moves;
	// skipped[k] those it reads only to verify the key (checks.read).
	moved, skipped []int64
}

// part is a run of n bytes of a unit's payload, moved by the plan or
// skipped, whose CRC-32C (from 0) is checksum slot slot.
type part struct {
	slot int
	n    int64
	skip bool
}

// unit returns the unit of block b's layer l of file key k.
func (ck *checks) unit(k, b, l int) int {
	switch ck.by {
	case verifyLayers:
		return k*ck.per + l - ck.first
	case verifyBlockLayers:
		return k*ck.per + b*ck.layers + l
	}
	return k
}

// sum returns unit u's checksum from the slots of its runs, joined in
// payload order: the CRC-32C of a followed by b is a's shifted past
// len(b) zero bytes xored with b's CRC from 0 (crc32c.Shift).
func (ck *checks) sum(u int, sums []uint32) uint32 {
	var crc uint32
	for _, pt := range ck.units[u] {
		if crc != 0 {
			crc = crc32c.Shift(crc, pt.n)
		}
		crc ^= sums[pt.slot]
	}
	return crc
}

// mismatch compares the checksums of file key k's units with h's: it
// returns the first unit's that differs (its layer, -1 for the whole key)
// and whether one does.
func (ck *checks) mismatch(h *format.Header, k int, sums []uint32) (layer int, got, want uint32, bad bool) {
	for i := range ck.per {
		u := k*ck.per + i
		got = ck.sum(u, sums)
		if ck.by == verifyLayers {
			layer, want = ck.first+i, h.LayerSum(k, ck.first+i)
		} else {
			layer, want = -1, h.Keys[k].Sum
		}
		if got != want {
			return layer, got, want, true
		}
	}
	return 0, 0, 0, false
}

// stored sets the checksums of h's keys from a store's slots (of every
// layer): with verifyKeys, each key's checksum; with verifyLayers
// (layer-major), h.LayerSums, and each key's checksum joined from its
// layers' (a key's payload is its layers in turn); with
// verifyBlockLayers (block-major), each layer's checksum joined from its
// blocks', and each key's from its blocks' layers' (a key's payload is
// its blocks in turn, each its layers in turn).
func (ck *checks) stored(h *format.Header, sums []uint32) {
	switch ck.by {
	case verifyLayers, verifyBlockLayers:
	default:
		for k := range h.Keys {
			h.Keys[k].Sum = ck.sum(k, sums)
		}
		return
	}
	L, B := int(h.Layers), int(h.BlocksPerKey)
	h.LayerSums = make([]uint32, len(h.Keys)*L)
	if ck.by == verifyLayers {
		n := h.LayerBytes()
		for k := range h.Keys {
			var crc uint32
			for l := range L {
				s := ck.sum(ck.unit(k, 0, l), sums)
				h.LayerSums[k*L+l] = s
				crc = crc32c.Shift(crc, n) ^ s
			}
			h.Keys[k].Sum = crc
		}
		return
	}
	n := int64(h.Planes) * int64(h.BlockBytes) // a block's layer
	for k := range h.Keys {
		var crc uint32
		layers := h.LayerSums[k*L : (k+1)*L]
		for b := range B {
			for l := range L {
				s := ck.sum(ck.unit(k, b, l), sums)
				layers[l] = crc32c.Shift(layers[l], n) ^ s
				crc = crc32c.Shift(crc, n) ^ s
			}
		}
		h.Keys[k].Sum = crc
	}
}

// read reads the skipped extents from f (on the engine's goroutine,
// 4 KiB-aligned as an O_DIRECT file needs) and folds their bytes into
// their checksum slots. It reads the 4 KiB blocks that hold skipped
// bytes and no others: extents whose aligned spans touch are read
// together (up to recheckChunk at a time), and the file between spans
// apart is not read (in the layer-major order a key's skipped blocks
// lie a layer's worth of payload apart, a file's worth of keys apart
// with several keys per file).
func (ck *checks) read(ctx context.Context, f fsys.File, sums []uint32) error {
	if len(ck.reads) == 0 {
		return nil
	}
	const a = format.Align
	// ends[i] is the aligned end of the run of touching spans that holds
	// extent i.
	ends := make([]int64, len(ck.reads))
	var widest int64
	for i := 0; i < len(ck.reads); {
		start := ck.reads[i].FileOff &^ (a - 1)
		end := (ck.reads[i].FileOff + ck.reads[i].Len + a - 1) &^ (a - 1)
		j := i + 1
		for ; j < len(ck.reads) && ck.reads[j].FileOff&^(a-1) <= end; j++ {
			end = max(end, (ck.reads[j].FileOff+ck.reads[j].Len+a-1)&^(a-1))
		}
		for k := i; k < j; k++ {
			ends[k] = end
		}
		widest = max(widest, end-start)
		i = j
	}
	buf := fsys.AlignedBuffer(int(min(recheckChunk, widest)))
	var at, n int64 // buf holds the file's bytes [at, at+n)
	for i, x := range ck.reads {
		for pos, end := x.FileOff, x.FileOff+x.Len; pos < end; {
			if pos < at || pos >= at+n {
				if err := ctx.Err(); err != nil {
					return err
				}
				at = pos &^ (a - 1)
				got, err := f.ReadAt(buf[:min(int64(len(buf)), ends[i]-at)], at)
				n = int64(got)
				if errors.Is(err, io.EOF) {
					err = nil
				}
				if err == nil && pos >= at+n {
					err = fmt.Errorf("%w: %w: read at %d returned %d bytes", ErrCorrupt, transfer.ErrShortFile, at, got)
				}
				if err != nil {
					return err
				}
			}
			stop := min(end, at+n)
			sums[x.Sum] = crc32c.Update(sums[x.Sum], buf[pos-at:stop-at])
			pos = stop
		}
	}
	return nil
}

// fileSlots bounds the files in flight: a store or a load moves a file
// while it holds a slot (Config.IOWorkers of them); a copy between mounts
// takes none but counts as in flight (moving), so that the spare maker
// waits for it too.
type fileSlots struct {
	tokens chan struct{}
	moving atomic.Int64
	// mu guards what waitEnded needs: gen counts the stores ended, end
	// (made by a waiter, nil without one) is closed at the next, stores
	// counts the stores' files in flight and waiting the reservations
	// waiting for one to end.
	mu      sync.Mutex
	gen     uint64
	end     chan struct{}
	stores  int
	waiting int
}

// generation returns the count of stores ended so far, for waitEnded.
func (s *fileSlots) generation() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.gen
}

// storeBegan counts a store's file in flight (it holds a slot).
func (s *fileSlots) storeBegan() {
	s.mu.Lock()
	s.stores++
	s.mu.Unlock()
}

// storeEnded counts a store's file ended (published, or its room given
// back) and wakes waitEnded's waiters.
func (s *fileSlots) storeEnded() {
	s.mu.Lock()
	s.stores--
	s.gen++
	if s.end != nil {
		close(s.end)
		s.end = nil
	}
	s.mu.Unlock()
}

// waitEnded waits, for a store's reservation that found no room, until
// another store's file ends after generation gen: a burst's stores hold
// room that each publishes (its file then evictable) or gives back.
// Loads free no room: they are not waited for. It reports true at once
// where a store ended since gen, false at once where no store is in
// flight but the caller and those waiting so, and false when ctx ends.
func (s *fileSlots) waitEnded(ctx context.Context, gen uint64) bool {
	s.mu.Lock()
	if s.gen != gen {
		s.mu.Unlock()
		return true
	}
	if s.stores-1-s.waiting <= 0 {
		s.mu.Unlock()
		return false
	}
	if s.end == nil {
		s.end = make(chan struct{})
	}
	ch := s.end
	s.waiting++
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.waiting--
		s.mu.Unlock()
	}()
	select {
	case <-ch:
		return true
	case <-ctx.Done():
		return false
	}
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

// releaseSlot gives back a slot e.mv.slots.acquire took.
func (e *Engine) releaseSlot() {
	<-e.mv.slots.tokens
	e.maker.fileEnded()
}

// isShort reports whether a mover's error says the file ended early.
func isShort(err error) bool { return errors.Is(err, transfer.ErrShortFile) }
