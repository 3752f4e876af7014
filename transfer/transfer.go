// Package transfer is the seam between the storage engine and the paths
// that move bytes between memory regions and files.
//
// The engine walks a file's layout once (package format) and builds a Plan:
// every extent of the file's payload, each naming the region, the offset in
// the region, the offset in the file and the key whose checksum it feeds. A
// Mover carries out a Plan against an open file. The CPU staging pipeline
// (package staging) is one Mover; GPU paths (cuFile, a pinned-host staging
// pipeline for device memory) are others. Movers are chosen per mount and,
// where the region's kind matters, per request (docs/design.md).
//
// A Mover owns its concurrency: WriteFile and ReadFile block until the plan
// is done, run the work on the mover's own workers (GPU movers lock those to
// their OS threads and set the device there), and may be called from many
// goroutines at once.
package transfer

import (
	"context"
	"errors"
	"fmt"
	"math"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/region"
)

// ErrUnsupported is returned (wrapped) by a Mover asked to move a region
// kind or a file it cannot handle; the engine then picks the next path. It
// never means that bytes were moved.
var ErrUnsupported = errors.New("transfer: unsupported")

// ErrShortFile is returned (wrapped) by ReadFile when the file ends before
// the plan does: the file was truncated, and the engine judges it corrupt.
var ErrShortFile = errors.New("transfer: file shorter than the plan")

// Extent is Len bytes at FileOff in the file and at RegionOff in Region.
// Sum indexes the checksum (in the sums given to WriteFile or ReadFile) that
// the extent's bytes feed, in plan order, or is -1 for none.
type Extent struct {
	FileOff   int64         // where the extent starts in the file, in bytes
	Region    region.Region // the memory the extent's bytes come from or go to
	RegionOff int64         // where the extent starts in Region, in bytes
	Len       int64         // the extent's length in bytes
	Sum       int           // the checksum slot its bytes feed, -1 for none
}

// Plan is every payload extent of one file, sorted by FileOff and not
// overlapping. It is built once per file and not modified by movers.
type Plan struct {
	// Extents are the file's payload extents, by file offset.
	Extents []Extent
	// Sums is the number of checksum slots the extents index.
	Sums int
	// Direct says the file is open with O_DIRECT: file offsets and lengths
	// of I/O must be multiples of 4 KiB, and movers bounce what is not. A
	// written plan whose last extent ends inside a 4 KiB block is written
	// to the block's end, the tail as zeros (the file format's padding).
	Direct bool
	// Memory says the file is on a memory file system (tmpfs): its I/O is
	// a CPU copy even with Direct, so a mover that checksums should do it
	// right after each system call, while the bytes are in cache.
	Memory bool
	// Folio is the size of the page-cache folios that writes allocate on
	// the file's mount where they are larger than a page (a tmpfs with
	// huge pages: fstype.LargeFolio), else 0. The first write into such
	// a folio that covers only part of it makes the kernel zero the rest,
	// so a mover that writes in parts should cut them at file offsets
	// that are multiples of Folio.
	Folio int64
}

// Bytes is the payload length of the plan.
func (p *Plan) Bytes() int64 {
	var n int64
	for i := range p.Extents {
		n += p.Extents[i].Len
	}
	return n
}

// End is the file offset just past the plan's last extent (0 for an
// empty plan): the extents are sorted.
func (p *Plan) End() int64 {
	if len(p.Extents) == 0 {
		return 0
	}
	x := p.Extents[len(p.Extents)-1]
	return x.FileOff + x.Len
}

// ReadSource returns f as a mover should read the plan from it: on a
// memory file system, where the plan reads fsys.MapMin bytes or more,
// through a mapping of the file's first End bytes (fsys.Mapping says why
// that pays), else f itself. release undoes it once the reads are done.
//
// The plan's bytes decide, not how far into the file it reaches: a layer
// range of a large file reads a few MiB, and a mapping made for them (an
// mmap, a fault per 64 KiB, and an munmap that interrupts every CPU that
// runs the process's threads) moved them slower than pread did: on the
// H200 machine loads of 4-layer ranges of files not registered ran at
// 38–49 GB/s through pread and at 20–30 once their ranges ended past
// fsys.MapMin and were mapped.
func (p *Plan) ReadSource(f fsys.File) (src fsys.File, release func()) {
	if !p.Memory || p.Bytes() < fsys.MapMin {
		return f, func() {}
	}
	return fsys.MapForRead(f, p.End())
}

// Check validates the plan: extents sorted, not overlapping, ending at
// file offsets an int64 holds, inside their regions, checksum indices in
// range.
func (p *Plan) Check() error {
	var end int64
	for i, x := range p.Extents {
		if x.FileOff < end || x.Len < 0 {
			return fmt.Errorf("transfer: extent %d at file offset %d (+%d) overlaps or precedes %d", i, x.FileOff, x.Len, end)
		}
		if x.Len > math.MaxInt64-x.FileOff { // x.FileOff >= end >= 0
			return fmt.Errorf("transfer: extent %d at file offset %d (+%d) ends past the largest file offset", i, x.FileOff, x.Len)
		}
		if err := (region.Segment{Region: x.Region, Offset: x.RegionOff, Length: x.Len}).Check(); err != nil {
			return fmt.Errorf("transfer: extent %d: %w", i, err)
		}
		if x.Sum < -1 || x.Sum >= p.Sums {
			return fmt.Errorf("transfer: extent %d: checksum index %d of %d", i, x.Sum, p.Sums)
		}
		end = x.FileOff + x.Len
	}
	return nil
}

// Mover moves plans between regions and files.
type Mover interface {
	// Name names the path for logs, stats and metrics ("staging", "posix",
	// "cufile", "gpu-staging", ...).
	Name() string
	// Checksums reports whether the mover computes the CRC-32C
	// (Castagnoli) of each checksum slot while it moves the bytes. A mover
	// that never lets the CPU see the bytes returns false, and the engine
	// records the file as unchecked.
	Checksums() bool
	// WriteFile writes the plan's extents from their regions into f. If
	// sums is non-nil (len Plan.Sums) and Checksums is true, it receives
	// the checksum of each slot.
	WriteFile(ctx context.Context, f fsys.File, p *Plan, sums []uint32) (int64, error)
	// ReadFile reads the plan's extents from f into their regions, and the
	// checksums as WriteFile does. A file shorter than the plan fails.
	ReadFile(ctx context.Context, f fsys.File, p *Plan, sums []uint32) (int64, error)
}

// WrittenSummer is implemented by movers whose checksums of a write are
// computed from the bytes that went into the file (the mover's own copy
// of them, or the file's pages once copied), never read again from the
// source region, which its owner may change meanwhile. The engine takes
// such a write's checksums as a verification of the file's bytes: loads
// from a memory file system do not sum them again while the file is
// unchanged.
type WrittenSummer interface {
	// SumsWritten reports whether WriteFile's checksums are of the
	// bytes written.
	SumsWritten() bool
}

// SumsWritten reports whether m's write checksums are of the bytes
// written (WrittenSummer); false for a mover that does not say.
func SumsWritten(m Mover) bool {
	w, ok := m.(WrittenSummer)
	return ok && w.SumsWritten()
}

// Forgetter is implemented by movers that cache per-file state (cuFile
// handles, CUDA registrations of a file's pages): the engine calls Forget
// before it removes or replaces a file, with the file's identity. Forget
// drops what the mover keeps under id's device and inode number whatever
// its generation (id.Gen may be empty): the engine forgets a file it is
// about to unlink, and anything kept under that number is either that
// file's or a dead one's. The movers compare generations where they find
// a file's state for a job, never serving one file's state to another.
type Forgetter interface {
	// Forget drops what the mover keeps under id's device and inode.
	Forget(id fsys.FileID)
}

// Preparer is implemented by movers that set up per-file state ahead of
// a file's first job (the GPU staging mover registers files on memory
// file systems with CUDA): the engine calls Prepare with each spare file
// it makes ahead of stores on a memory file system, open for writing,
// before any store writes into it. Prepare must not wait for work on the
// file: it may hand the file to a background worker with a descriptor of
// its own, and the engine closes f when Prepare returns. The engine calls
// Forget when it removes the file.
type Preparer interface {
	// Prepare sets up the mover's state for f, a spare file made ahead.
	Prepare(f fsys.File)
}

// Warmer is implemented by movers that set up per-file state ahead of a
// file's first job (the GPU staging mover registers files on memory file
// systems with CUDA), for files the engine indexed without moving them:
// found on a memory file system when it opened, or discovered by a lookup
// (another process's or node's file). The engine calls Warm off any job's
// path, the most recently used files first, with f open read-only. Warm
// must not wait for work on the file (as Prepare), and the engine closes
// f when it returns. Warm never makes room by dropping what the mover
// keeps for files jobs used: it reports whether the mover would take
// another file, false once it keeps or has queued as many as it may, so
// that the engine offers no more of a batch. The engine calls Forget when
// it removes the file.
type Warmer interface {
	// Warm sets up the mover's state for f, and reports whether the
	// mover would take another file.
	Warm(f fsys.File) bool
}
