package staging

import (
	"context"
	"fmt"
	"io"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/crc32c"
	"github.com/kvhost/kvhost/region"
)

// span is Buf at file offset Off. Sum, if non-negative, is the index of the
// checksum (in the sums passed to write or read) that the span's bytes feed,
// in span order.
type span struct {
	Off int64
	Buf []byte
	Sum int
}

// options of one write or read.
type options struct {
	// Direct: the file is open with O_DIRECT; spans that are not aligned go
	// through bounce buffers.
	Direct bool
	// Sums, if non-nil, receives CRC-32C checksums (Castagnoli), updated
	// with the bytes of every span whose Sum indexes it, in span order.
	Sums []uint32
	// Chunk is the most bytes per system call. Without Sums it defaults to
	// 8 MiB. With Sums and without Overlap the checksum is fused with the
	// transfer: the run is cut into batches of Chunk bytes (default
	// 256 KiB; spans are split where a batch ends), and each batch is
	// checksummed right after the system call that moved it, while the
	// kernel's copy has left its bytes in the CPU's cache (for a write the
	// source, for a read the destination), so that they cross the memory
	// bus once: the right choice for memory file systems (tmpfs) and the
	// page cache, where the transfer is itself a CPU copy. (Checksumming a
	// write's batch before the write, the other order, runs ~25% slower:
	// the checksum loop pulls cold memory in more slowly than the kernel's
	// copy does; BenchmarkFused.) With Direct, Chunk is rounded down to a
	// multiple of Align.
	Chunk int
	// Overlap checksums batch i (of Chunk bytes, default 8 MiB, whole
	// spans) on a helper goroutine while batch i+1 is in flight: the right
	// choice for devices, where the CPU waits on I/O.
	Overlap bool
	// Folio, for a write, is the size of the file's large page-cache
	// folios (transfer.Plan.Folio), or 0. With it a write's batches are
	// cut at file offsets that are multiples of a multiple of Folio (at
	// least Chunk's batch), so that no folio is first written in part:
	// the kernel would zero the rest of it before the write. It is best
	// effort: a batch that reaches iovMax pieces first (spans of under
	// 2 KiB for 2 MiB folios) ends inside a folio, and direct writes of
	// unaligned spans (bounced) and Overlap's batches are not cut.
	Folio int64
}

const (
	iovMax = 1024 // IOV_MAX on Linux
	// fuseBatch is the default batch of a fused checksum (options.Chunk):
	// small enough that the batch and the page-cache pages the kernel
	// copies it to or from (twice the batch) stay in a core's L2 cache
	// (1–2 MiB on current server CPUs) until the checksum has read them;
	// large enough that the system call costs little against the copy.
	// On a 1 MiB L2, 128 KiB and 256 KiB measure alike, 512 KiB 15–25%
	// slower, 64 KiB slower too (BenchmarkFused).
	fuseBatch = 256 << 10
	// chunkMax is the default chunk otherwise.
	chunkMax = 8 << 20
)

// worker is one I/O worker. Tasks receive it from Pool.submit; it is valid
// only during the task.
type worker struct {
	// ID numbers the worker within its pool, from 0.
	ID   int
	CPU  int // the CPU it is pinned to, or -1
	pool *Pool
	// The current batch, reused from batch to batch: iov for the system
	// call (which may trim it), pieces for the checksums.
	iov    [][]byte
	pieces []span
	yield  Yielder
}

func (w *worker) do(ctx context.Context, f fsys.File, spans []span, opt options, write bool) (int64, error) {
	var total int64
	for i := 0; i < len(spans); {
		// A run: spans contiguous in the file.
		j := i + 1
		end := spans[i].Off + int64(len(spans[i].Buf))
		direct := !opt.Direct || aligned(spans[i].Buf) && spans[i].Off%Align == 0
		for j < len(spans) && spans[j].Off == end {
			end += int64(len(spans[j].Buf))
			direct = direct && (!opt.Direct || aligned(spans[j].Buf))
			j++
		}
		var n int64
		var err error
		if direct {
			n, err = w.vector(ctx, f, spans[i:j], opt, write)
		} else {
			n, err = w.bounce(ctx, f, spans[i:j], opt, write)
		}
		total += n
		if err != nil {
			return total, err
		}
		i = j
	}
	return total, nil
}

// vector moves a run straight between the spans and the file, in batches
// of at most iovMax pieces.
//
// Fused (checksums, no Overlap): batches of Chunk bytes, spans split at
// batch ends, each checksummed right after its transfer, from cache.
// Overlap: batches of whole spans, checksummed on a helper goroutine while
// the next batch is in flight. Otherwise: batches of whole spans.
func (w *worker) vector(ctx context.Context, f fsys.File, run []span, opt options, write bool) (total int64, err error) {
	fused := opt.Sums != nil && !opt.Overlap
	limit := int64(chunkMax)
	if fused {
		limit = fuseBatch
	}
	if opt.Chunk > 0 {
		limit = int64(opt.Chunk)
	}
	if fused && opt.Direct {
		// Split points must keep direct I/O aligned.
		limit = max(Align, limit/Align*Align)
	}
	// Overlap hands whole spans to its helper, so its batches stay whole
	// (it serves devices, which have no folios to fill).
	folios := write && opt.Folio > 0 && !(opt.Sums != nil && opt.Overlap)
	if folios {
		limit = max(opt.Folio, limit/opt.Folio*opt.Folio)
	}
	var pending chan []span
	var sumDone chan struct{}
	if opt.Sums != nil && opt.Overlap {
		pending, sumDone = make(chan []span, 1), make(chan struct{})
		var sumErr error // set before sumDone closes
		go func() {
			defer close(sumDone)
			sumErr = region.Guard(func() error {
				for spans := range pending {
					sum(spans, opt.Sums)
				}
				return nil
			})
			for range pending { // after a fault: drain, the write fails
			}
		}()
		defer func() {
			close(pending)
			<-sumDone
			if err == nil {
				err = sumErr
			}
		}()
	}
	off := run[0].Off
	for i, at := 0, 0; i < len(run); {
		if err := ctx.Err(); err != nil {
			return total, err
		}
		first := i
		var n int64
		if folios {
			// Batches end where the folios do, spans split there.
			i, at, n = w.batch(run, i, at, limit-off%limit, true)
		} else {
			i, at, n = w.batch(run, i, at, limit, fused)
		}
		if err := rw(f, w.iov, off, write); err != nil {
			return total, err
		}
		reported := int64(0)
		switch {
		case pending != nil:
			pending <- run[first:i] // whole spans: at is 0
		case fused:
			// The bytes the kernel just copied, still in cache.
			reported = w.sumPieces(opt.Sums)
		}
		total += n
		off += n
		w.yield.Moved(n - reported)
	}
	return total, nil
}

// sumPieces checksums the batch's pieces (w.pieces) in the yielder's
// steps (Yielder.Steps), so that a batch larger than Every (a 2 MiB
// folio's) still yields once per Every bytes of CPU work. It returns the
// bytes it reported.
func (w *worker) sumPieces(sums []uint32) int64 {
	var reported int64
	for _, s := range w.pieces {
		if s.Sum < 0 {
			continue
		}
		w.yield.Steps(len(s.Buf), 0, func(lo, hi int) {
			sums[s.Sum] = crc32c.Update(sums[s.Sum], s.Buf[lo:hi])
		})
		reported += int64(len(s.Buf))
	}
	return reported
}

// batch fills w.iov and w.pieces with the next bytes of run, from byte at
// of span i: up to limit bytes in at most iovMax pieces. With split, a span
// that crosses limit is cut there; otherwise batches hold whole spans (a
// first span longer than limit alone). It returns where the next batch
// starts and the batch's length.
func (w *worker) batch(run []span, i, at int, limit int64, split bool) (int, int, int64) {
	w.iov, w.pieces = w.iov[:0], w.pieces[:0]
	var n int64
	for i < len(run) && len(w.iov) < iovMax && n < limit {
		s := &run[i]
		b := s.Buf[at:]
		if rest := limit - n; int64(len(b)) > rest {
			if split {
				b = b[:rest]
			} else if n > 0 {
				break
			}
		}
		if len(b) > 0 {
			w.iov = append(w.iov, b)
			w.pieces = append(w.pieces, span{Off: s.Off + int64(at), Buf: b, Sum: s.Sum})
		}
		n += int64(len(b))
		at += len(b)
		if at == len(s.Buf) {
			i, at = i+1, 0
		}
	}
	return i, at, n
}

// rw writes or reads iov at off completely, looping over short transfers.
func rw(f fsys.File, iov [][]byte, off int64, write bool) error {
	for len(iov) > 0 {
		var n int
		var err error
		if write {
			n, err = f.WritevAt(iov, off)
		} else {
			n, err = f.ReadvAt(iov, off)
		}
		if err != nil {
			return err
		}
		if n == 0 {
			if write {
				return fmt.Errorf("staging: write at %d: %w", off, io.ErrShortWrite)
			}
			return fmt.Errorf("%w: read at %d returned 0 bytes", ErrShortFile, off)
		}
		off += int64(n)
		for n > 0 {
			if n >= len(iov[0]) {
				n -= len(iov[0])
				iov = iov[1:]
			} else {
				iov[0] = iov[0][n:]
				n = 0
			}
		}
	}
	return nil
}

func sum(spans []span, sums []uint32) {
	if sums == nil {
		return
	}
	for _, s := range spans {
		if s.Sum >= 0 {
			sums[s.Sum] = crc32c.Update(sums[s.Sum], s.Buf)
		}
	}
}

// cursor walks the bytes of a run of spans in order.
type cursor struct {
	spans []span
	i     int // current span
	off   int // offset in it
	sums  []uint32
}

// gather copies the next len(dst) bytes of the run into dst, checksumming
// them, and returns how many it copied (less only at the end of the run).
func (c *cursor) gather(dst []byte) int { return c.move(dst, true) }

// scatter copies src into the next bytes of the run, checksumming them.
func (c *cursor) scatter(src []byte) int { return c.move(src, false) }

func (c *cursor) move(buf []byte, out bool) int {
	n := 0
	for n < len(buf) && c.i < len(c.spans) {
		s := &c.spans[c.i]
		var k int
		if out {
			k = copy(buf[n:], s.Buf[c.off:])
		} else {
			k = copy(s.Buf[c.off:], buf[n:])
		}
		if c.sums != nil && s.Sum >= 0 {
			c.sums[s.Sum] = crc32c.Update(c.sums[s.Sum], s.Buf[c.off:c.off+k])
		}
		n += k
		c.off += k
		if c.off == len(s.Buf) {
			c.i++
			c.off = 0
		}
	}
	return n
}

type chunk struct {
	buf []byte
	off int64 // file offset of buf[0]
	n   int   // bytes of buf to transfer
	ok  int   // bytes of buf that belong to the run (read: from lead)
	err error
}

// bounce moves a run through bounce buffers, overlapping the copy of one
// chunk with the I/O of another: for a write a helper goroutine gathers
// while the worker writes; for a read the worker reads while a helper
// scatters.
func (w *worker) bounce(ctx context.Context, f fsys.File, run []span, opt options, write bool) (int64, error) {
	start := run[0].Off
	var length int64
	for _, s := range run {
		length += int64(len(s.Buf))
	}
	end := start + length
	if write && start%Align != 0 {
		return 0, fmt.Errorf("%w: write of [%d, %d)", errUnaligned, start, end)
	}
	astart := start / Align * Align
	aend := (end + Align - 1) / Align * Align
	bufs := w.pool.bufs
	size := int64(bufs.Size())
	cur := &cursor{spans: run, sums: opt.Sums}
	// The helper copies (and checksums) the run's bytes: it yields, as
	// the vectored path's worker does, every Every bytes it copied.
	y := Yielder{Every: w.yield.Every, Yield: w.yield.Yield}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	full := make(chan chunk, 1)
	done := make(chan error, 1)
	if write {
		go func() { // gather
			defer close(full)
			for off := astart; off < aend; off += size {
				// A cancelled context stops the run between chunks:
				// get prefers a free buffer to a done context.
				if err := ctx.Err(); err != nil {
					full <- chunk{err: err}
					return
				}
				buf, err := bufs.get(ctx)
				if err != nil {
					full <- chunk{err: err}
					return
				}
				n := min(size, aend-off)
				// A run ending inside a 4 KiB block is written to the
				// block's end: the tail is zeros (the file's padding),
				// never a reused buffer's old bytes.
				if err := region.Guard(func() error {
					got := 0
					y.Steps(int(n), 0, func(lo, hi int) { got += cur.gather(buf[lo:hi]) })
					clear(buf[got:n])
					return nil
				}); err != nil {
					full <- chunk{buf: buf, err: err}
					return
				}
				full <- chunk{buf: buf, off: off, n: int(n)}
			}
		}()
		var err error
		for c := range full {
			if err == nil {
				err = c.err
			}
			if err == nil {
				err = ctx.Err() // cancelled while the chunk was gathered
			}
			if err == nil {
				err = rw(f, [][]byte{c.buf[:c.n]}, c.off, true)
			}
			if c.buf != nil {
				bufs.put(c.buf)
			}
			if err != nil {
				cancel()
			}
		}
		if err != nil {
			return 0, err
		}
		return length, nil
	}
	go func() { // scatter
		var err error
		for c := range full {
			if err == nil && c.err == nil {
				err = region.Guard(func() error {
					y.Steps(c.n-c.ok, 0, func(lo, hi int) { cur.scatter(c.buf[c.ok+lo : c.ok+hi]) })
					return nil
				})
				if err != nil {
					cancel() // the reader stops at its next chunk
				}
			}
			bufs.put(c.buf)
		}
		done <- err
	}()
	var err error
	for off := astart; off < aend && err == nil; off += size {
		if err = ctx.Err(); err != nil {
			break // get prefers a free buffer to a done context
		}
		var buf []byte
		buf, err = bufs.get(ctx)
		if err != nil {
			break
		}
		n := min(size, aend-off)
		if err = rw(f, [][]byte{buf[:n]}, off, false); err != nil {
			bufs.put(buf)
			break
		}
		// The bytes of the run: skip the lead of the first chunk and the
		// tail of the last.
		lo, hi := max(start, off)-off, min(end, off+n)-off
		full <- chunk{buf: buf, off: off, n: int(hi), ok: int(lo)}
	}
	close(full)
	// The scatter's fault is the cause where it stopped the reader (whose
	// error is then the cancel).
	if serr := <-done; serr != nil {
		err = serr
	}
	if err != nil {
		return 0, err
	}
	return length, nil
}
