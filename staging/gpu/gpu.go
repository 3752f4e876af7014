// Package gpu is kvhost's staging path for GPU memory: a transfer.Mover
// that moves region.Device extents between device memory and files
// through a bounded pool of pinned host buffers.
//
// Each job (one file) runs a double-buffered pipeline on its own
// goroutine, locked to its OS thread with the device current, and its own
// CUDA stream (a lane, reused from job to job): a store gathers chunk i+1
// from the paged device layout into one pinned buffer (with
// cudaMemcpyBatchAsync, or one cudaMemcpyAsync per segment) while it
// checksums and writes chunk i from another; a load enqueues the scatter
// of chunk i right after reading and checksumming it, and reads chunk i+1
// while the copy runs. A buffer's copies are waited for on an event only
// when the buffer is needed again, so no job waits behind another's
// copies: the job polls the event for a while (Config.Poll), then sleeps
// on it (a blocking event), so that no thread spins for long. File I/O to
// a device with O_DIRECT is one large system call per chunk (4 MiB by
// default, 4 KiB-aligned: pinned buffers are page-aligned); to a memory
// file system
// or through the page cache, reads go in 256 KiB pieces, and so do writes
// with checksums, each piece checksummed right after its system call
// (fused; transfer.Plan.Memory says which files are on memory file
// systems). The pinned pool is allocated and registered once, when the
// Mover is made, never per request.
package gpu

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/crc32c"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/staging"
	"github.com/kvhost/kvhost/transfer"
)

// Errors of the package.
var (
	// errClosed: the mover is closed.
	errClosed = errors.New("gpu: mover closed")
	// errUnaligned: a direct write whose file range does not start on a
	// 4 KiB block.
	errUnaligned = errors.New("gpu: unaligned direct write")
	// errConfig: the configuration is invalid.
	errConfig = errors.New("gpu: invalid configuration")
)

// align is the alignment of pinned buffers and of direct I/O.
const align = staging.Align

// Config configures a Mover.
type Config struct {
	// Runtime is the open CUDA runtime (required).
	Runtime *cuda.Runtime
	// Devices are the device ordinals to serve (default: every device).
	Devices []int
	// MaxStaging bounds the pinned host memory, in bytes (default
	// 256 MiB); it is allocated once by New.
	MaxStaging int64
	// Chunk is the bytes of one pipeline stage (default 4 MiB, the best
	// of 2–32 MiB measured on tmpfs with 16 jobs; a multiple of 4 KiB).
	Chunk int
	// Depth is the most buffers one job holds at once (default 2: double
	// buffering).
	Depth int
	// Copy chooses how a chunk's segments move between its pinned buffer
	// and the device: CopyBatch (one cudaMemcpyBatchAsync), CopySegments
	// (one cudaMemcpyAsync each) or CopyKernel (one launch of kvhost's
	// copy kernel). The default, CopyAuto, is batched copies where the
	// runtime has them, else per segment: DMA copies run on the GPU's copy
	// engines, while the kernel runs on its SMs in the mover's own CUDA
	// context and so takes turns with the inference process's kernels
	// (it halved a concurrent matmul's throughput on the H100). With
	// CopyKernel, a chunk the kernel cannot move (segments not 16-byte
	// aligned, or more than its table holds) goes batched or per segment.
	Copy cuda.CopyMode
	// NoChecksums turns checksums off (Checksums reports false).
	NoChecksums bool
	// SumsOnDevice computes a job's checksums on the GPU, with kvhost's
	// checksum kernel, from the job's device memory: after a load's copies
	// (the bytes that arrived) and before a store's (the bytes that
	// leave), in one launch per job, so the CPU never reads the bytes
	// for them. A job whose spans the kernel cannot take (not 16-byte
	// aligned, or more than cuda.SumMaxEntries of them) is checksummed by
	// the CPU. Like the copy kernel, it runs on the SMs in the mover's own
	// context (docs/gpu.md, "Checksums on the GPU").
	SumsOnDevice bool
	// Poll is how long a job polls the event of copies it needs done
	// (cudaEventQuery in a loop, its thread on a core and its goroutine
	// holding a Go processor) before it blocks on the event, its thread
	// asleep until the copies complete: a woken thread waits for a core,
	// which with every core busy took longer than the copies (RATIONALE,
	// "Why does a job poll its copies' event for 500 µs before it
	// sleeps?"). 0 means DefaultPoll; NoPoll (or any negative Poll) blocks
	// at once.
	Poll time.Duration
	// RegisterFiles is the most files on memory file systems the mover
	// keeps mapped and registered with CUDA, so that jobs on them copy
	// between the device and the files' pages directly (files.go); 0
	// keeps none. It is lowered to a quarter of the process's descriptor
	// limit and of vm.max_map_count (the registrar holds one descriptor
	// and one mapping per file).
	RegisterFiles int
	// Registrars is how many threads register offered files at once
	// (0 means DefaultRegistrars).
	Registrars int
	// IdleRegistrars is how many more threads register offered files,
	// each only while the mover runs no job (0: none): registrations
	// beside jobs slow them, so Registrars stays small, but a mover with
	// files to register and no job to slow (a daemon just restarted, the
	// idle moment after a burst) registers them sooner with one more
	// thread (DefaultIdleRegistrars says by how much).
	IdleRegistrars int
	// RegisterBytes, if positive, bounds the bytes of the files kept
	// registered (their pages are pinned while registered): a file that
	// would pass it replaces the least recently used ones instead, or
	// waits. 0 bounds the files by RegisterFiles alone.
	RegisterBytes int64
	// Log receives the registrar's warnings (default: none).
	Log *slog.Logger
	// YieldBytes: a job gives its CPU up (sched_yield) after every
	// YieldBytes it copied or checksummed with the CPU (staging.Yielder);
	// 0 never.
	YieldBytes int64
}

const (
	// DefaultPoll is the default Config.Poll: several times the usual
	// wait for a chunk's copies, short enough that a stalled GPU costs a
	// polling job little CPU before its thread sleeps.
	DefaultPoll = 500 * time.Microsecond
	// NoPoll is a Config.Poll that blocks on every wait at once.
	NoPoll time.Duration = -1
)

// Mover moves plans of device regions through pinned staging buffers.
type Mover struct {
	cfg   Config
	r     *cuda.Runtime
	pin   *cuda.Pinned // allocated in the first served device's context (pinDevice)
	bufs  *freeBuffers
	bsize int // Chunk plus alignment slack
	devs  map[int]*device
	// With the copy kernel, buffer i's segment table (tableEntries
	// entries) is at tableSize·i after the buffers; 0 without it.
	tableEntries, tableSize int
	// fallback moves what the kernel does not (and everything without
	// the kernel): batched or per segment.
	fallback cuda.CopyMode

	// files are the registered files (nil: Config.RegisterFiles 0).
	files *files
	// maps keeps the mappings that loads of memory-mount files not
	// registered read through, for the file's next jobs (mapCacheFiles).
	maps *fsys.MapCache
	// sumsBesideLoad (set by the GPU benchmark only) makes a load of a
	// registered file of one chunk checksum its bytes while its copies
	// run, as larger files do, instead of after them.
	sumsBesideLoad bool
	// yieldHook, if set (tests), is called instead of sched_yield.
	yieldHook func()
	// act counts the jobs in flight (run), for sumAfterCopy and the
	// idle registrars.
	act *activity
	// sumJobs counts the jobs with checksums by where they were computed:
	// [0] the CPU, [1] the checksum kernel (SumJobs).
	sumJobs [2]atomic.Uint64

	mu     sync.RWMutex
	closed bool
}

// device is one GPU: its idle lanes, kept for reuse, and the copy kernel
// loaded there (nil when chunks move by DMA copies).
type device struct {
	ordinal int
	idle    chan *lane
	kernel  *cuda.Kernel
	// sum is the checksum kernel loaded there (nil: the CPU checksums).
	sum *cuda.SumKernel
	// faults counts the jobs that failed with a sticky CUDA error on the
	// device (cuda.Error.Sticky); the first is logged.
	faults atomic.Uint64
}

// Defaults of Config.Chunk and Config.Depth.
const (
	// DefaultChunk is Config.Chunk when zero: 4 MiB.
	DefaultChunk = 4 << 20
	// DefaultDepth is Config.Depth when zero: double buffering.
	DefaultDepth = 2
)

// New allocates the pinned pool.
func New(cfg Config) (*Mover, error) {
	if cfg.Runtime == nil {
		return nil, fmt.Errorf("%w: no CUDA runtime", errConfig)
	}
	if cfg.Chunk == 0 {
		cfg.Chunk = DefaultChunk
	}
	if cfg.Chunk < align || cfg.Chunk%align != 0 {
		return nil, fmt.Errorf("%w: chunk %d is not a positive multiple of %d", errConfig, cfg.Chunk, align)
	}
	if cfg.MaxStaging == 0 {
		cfg.MaxStaging = 256 << 20
	}
	if cfg.Depth == 0 {
		cfg.Depth = DefaultDepth
	}
	if cfg.Poll == 0 {
		cfg.Poll = DefaultPoll
	}
	if cfg.Depth < 1 {
		return nil, fmt.Errorf("%w: depth %d", errConfig, cfg.Depth)
	}
	if cfg.Copy == cuda.CopyBatch && !cfg.Runtime.HasBatch() {
		return nil, fmt.Errorf("%w: %w", errConfig, cuda.ErrNoBatch)
	}
	if cfg.Copy == cuda.CopyKernel && !cfg.Runtime.HasKernel() {
		return nil, fmt.Errorf("%w: %w", errConfig, cuda.ErrNoKernel)
	}
	bsize := cfg.Chunk + 2*align // a read's aligned range around a chunk
	// With the copy kernel, each buffer has a segment table: an entry per
	// 4 KiB of chunk and two more (the partial pages at its ends), enough
	// for any cache whose pages are 4 KiB or larger. The tables live in
	// the same pinned allocation, after the buffers.
	entries, tsize := 0, 0
	if cfg.Copy == cuda.CopyKernel {
		entries = cfg.Chunk/align + 2
		tsize = (entries*cuda.KernelEntryBytes + 63) &^ 63
	}
	n := int(cfg.MaxStaging / int64(bsize+tsize))
	if n < 1 {
		return nil, fmt.Errorf("%w: max staging %d bytes holds no %d-byte buffer", errConfig, cfg.MaxStaging, bsize+tsize)
	}
	count, err := cfg.Runtime.DeviceCount()
	if err != nil {
		return nil, fmt.Errorf("gpu: %w", err)
	}
	if len(cfg.Devices) == 0 {
		for d := range count {
			cfg.Devices = append(cfg.Devices, d)
		}
	}
	for _, d := range cfg.Devices {
		if d < 0 || d >= count {
			return nil, fmt.Errorf("%w: device %d: the runtime sees %d devices", errConfig, d, count)
		}
	}
	m := &Mover{cfg: cfg, r: cfg.Runtime, bsize: bsize, bufs: newFreeBuffers(n), devs: map[int]*device{}, act: newActivity(),
		maps: fsys.NewMapCache(mapCacheFiles, mapCacheIdle)}
	m.fallback = cuda.CopySegments
	if cfg.Copy == cuda.CopyBatch || cfg.Copy != cuda.CopySegments && m.r.HasBatch() {
		m.fallback = cuda.CopyBatch
	}
	if len(cfg.Devices) == 0 {
		return nil, fmt.Errorf("%w: no CUDA device", errConfig)
	}
	for _, d := range cfg.Devices {
		m.devs[d] = &device{ordinal: d, idle: make(chan *lane, maxIdleLanes)}
	}
	// Pinned memory is allocated in the current device's context: on a
	// thread locked to the first served device, as every CUDA call here.
	var pin *cuda.Pinned
	err = m.onDevice(m.pinDevice(), func() error {
		var err error
		pin, err = m.r.HostAlloc(n * (bsize + tsize))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("gpu: pinned pool of %d bytes: %w", n*(bsize+tsize), err)
	}
	m.pin = pin
	if sums := cfg.SumsOnDevice && !cfg.NoChecksums; entries > 0 || sums {
		if err := m.loadKernels(entries > 0, sums); err != nil {
			m.freePinned()
			return nil, fmt.Errorf("gpu: %w", err)
		}
		m.tableEntries, m.tableSize = entries, tsize
	}
	if cfg.RegisterFiles < 0 {
		m.Close()
		return nil, fmt.Errorf("%w: register files %d", errConfig, cfg.RegisterFiles)
	}
	if limit := fileLimit(cfg.RegisterFiles); limit > 0 {
		m.files = newFiles(m, limit, cfg.RegisterBytes, cfg.Registrars, cfg.IdleRegistrars, cfg.Devices[0], cfg.Log)
	}
	return m, nil
}

// loadKernels loads the copy kernel (copy) and the checksum kernel (sum)
// on every device, or, if one fails, none.
func (m *Mover) loadKernels(copy, sum bool) error {
	for _, d := range m.devs {
		if err := m.onDevice(d, func() (err error) {
			if copy {
				if d.kernel, err = m.r.LoadCopyKernel(); err != nil {
					return fmt.Errorf("copy kernel: %w", err)
				}
			}
			if sum {
				if d.sum, err = m.r.LoadSumKernel(); err != nil {
					return fmt.Errorf("checksum kernel: %w", err)
				}
			}
			return nil
		}); err != nil {
			m.unloadKernels()
			return fmt.Errorf("device %d: %w", d.ordinal, err)
		}
	}
	return nil
}

// unloadKernels unloads the copy and checksum kernels from every device
// that has them.
func (m *Mover) unloadKernels() error {
	var errs []error
	for _, d := range m.devs {
		if d.kernel != nil {
			errs = append(errs, m.onDevice(d, d.kernel.Unload))
			d.kernel = nil
		}
		if d.sum != nil {
			errs = append(errs, m.onDevice(d, d.sum.Unload))
			d.sum = nil
		}
	}
	return errors.Join(errs...)
}

// onDevice runs fn on a thread with d's device current.
func (m *Mover) onDevice(d *device, fn func() error) error {
	unlock, err := m.r.LockDevice(d.ordinal)
	if err != nil {
		return err
	}
	defer unlock()
	return fn()
}

// CopyMode is how chunks move between pinned buffers and devices:
// CopyKernel where the copy kernel is loaded, else CopyBatch or
// CopySegments.
func (m *Mover) CopyMode() cuda.CopyMode {
	if m.tableEntries > 0 {
		return cuda.CopyKernel
	}
	return m.fallback
}

// PollTime is how long a job polls for its copies before it blocks on
// them (Config.Poll after defaults); 0: it blocks at once.
func (m *Mover) PollTime() time.Duration { return max(m.cfg.Poll, 0) }

// ChunkBytes is the bytes of one pipeline stage (Config.Chunk after
// defaults).
func (m *Mover) ChunkBytes() int { return m.cfg.Chunk }

// Name is "gpu-staging".
func (m *Mover) Name() string { return "gpu-staging" }

// Checksums reports whether checksums are computed (the default).
func (m *Mover) Checksums() bool { return !m.cfg.NoChecksums }

// SumsWritten reports whether a store's checksums are of the bytes that
// went into the file (transfer.WrittenSummer): the CPU's are taken from
// the pinned buffer written, or the registered file's pages after their
// copies; the checksum kernel's (Config.SumsOnDevice) from the GPU memory
// before the copies read it again, which its owner may change meanwhile.
func (m *Mover) SumsWritten() bool { return !m.cfg.NoChecksums && !m.cfg.SumsOnDevice }

// ChecksumOn says where the mover computes checksums: "gpu" (the
// checksum kernel, Config.SumsOnDevice), "cpu", or "off".
func (m *Mover) ChecksumOn() string {
	switch {
	case m.cfg.NoChecksums:
		return "off"
	case m.cfg.SumsOnDevice:
		return "gpu"
	}
	return "cpu"
}

// SumJobs counts the jobs that succeeded and computed checksums, by
// where: with Config.SumsOnDevice, onCPU counts the jobs the kernel could
// not take (pieces not 16-byte aligned, too many spans, no pinned table).
func (m *Mover) SumJobs() (onCPU, onGPU uint64) {
	return m.sumJobs[0].Load(), m.sumJobs[1].Load()
}

// countSums counts a job that succeeded by where its checksums were
// computed; a job none of whose pieces feeds a checksum computed none,
// and is not counted.
func (m *Mover) countSums(chunks []chunk, sums []uint32, onDevice bool) {
	// A job the kernel took has spans (sumsOnDevice): only the CPU's jobs
	// need the look at their pieces.
	if sums == nil || !onDevice && !feedsSums(chunks) {
		return
	}
	if onDevice {
		m.sumJobs[1].Add(1)
	} else {
		m.sumJobs[0].Add(1)
	}
}

// feedsSums reports whether a piece of chunks feeds a checksum.
func feedsSums(chunks []chunk) bool {
	for i := range chunks {
		for _, p := range chunks[i].pieces {
			if p.sum >= 0 {
				return true
			}
		}
	}
	return false
}

// PinnedBytes is the pinned host memory of the mover's staging pool (its
// buffers and their kernel segment tables), allocated by New; the lanes'
// checksum tables (Config.SumsOnDevice) and registered files are pinned
// outside it.
func (m *Mover) PinnedBytes() int64 { return int64(len(m.pin.Bytes())) }

// Close waits for the calls in flight, stops the registrar and releases
// every registered file (those a job still holds included), drops the
// loads' kept mappings (fsys.MapCache.Close), destroys the
// idle lanes and frees the pinned pool; later calls fail with errClosed
// or do nothing. Nothing calls CUDA once it returned: the caller may then
// unload the runtime.
func (m *Mover) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return errClosed
	}
	m.closed = true
	// No job runs on a lane now, nor will (the lock waited for those that
	// did): the mappings are no longer used, held ones included.
	if m.files != nil {
		m.files.close()
	}
	m.maps.Close()
	var errs []error
	for _, d := range m.devs {
		errs = append(errs, m.destroyIdle(d))
	}
	errs = append(errs, m.unloadKernels())
	if m.pin != nil {
		errs = append(errs, m.freePinned())
	}
	return errors.Join(errs...)
}

// freePinned frees the pinned pool on a thread with its device current,
// or, where that device cannot be made current (a fault broke it), on
// this one: the pool is freed either way.
func (m *Mover) freePinned() error {
	unlock, err := m.r.LockDevice(m.pinDevice().ordinal)
	if err == nil {
		defer unlock()
	}
	return errors.Join(err, m.pin.Free())
}

// pinDevice is the device in whose context the pinned pool lives: the
// first served.
func (m *Mover) pinDevice() *device { return m.devs[m.cfg.Devices[0]] }

// buf returns buffer i's memory and its address.
func (m *Mover) buf(i int) ([]byte, uintptr) {
	b := m.pin.Bytes()[i*m.bsize : (i+1)*m.bsize : (i+1)*m.bsize]
	return b, m.pin.Ptr() + uintptr(i*m.bsize)
}

// table returns buffer i's kernel segment table.
func (m *Mover) table(i int) []byte {
	off := m.bufs.total()*m.bsize + i*m.tableSize
	return m.pin.Bytes()[off : off+m.tableSize : off+m.tableSize]
}

// piece is Len bytes of a chunk at BufOff in its buffer, at Dev on the
// device, feeding checksum Sum (or -1).
type piece struct {
	dev    uintptr
	bufOff int
	n      int
	sum    int
}

// chunk is one pipeline stage: file bytes [off, end) (read: the aligned
// range [aoff, aend) around them) and the device pieces they map to.
type chunk struct {
	off, end   int64
	aoff, aend int64
	pieces     []piece
}

// plan cuts a Plan into chunks of at most Chunk bytes of contiguous file
// range, and finds the device every extent lives on.
func (m *Mover) plan(p *transfer.Plan, write bool) ([]chunk, *device, error) {
	if err := p.Check(); err != nil {
		return nil, nil, err
	}
	ordinal := -1
	var chunks []chunk
	var cur *chunk
	limit := int64(m.cfg.Chunk)
	// Written to large folios, chunks hold a whole number of folios and end
	// at file offsets that are multiples of their size, so that no folio is
	// first written in part by one chunk and then by the next: the kernel
	// would zero the rest of it in between (transfer.Plan.Folio). A chunk
	// size that is not a multiple of the folio is rounded down to one; one
	// smaller than a folio leaves the chunks as they are.
	aligned := write && p.Folio > 0 && limit >= p.Folio
	if aligned {
		limit = limit / p.Folio * p.Folio
	}
	for i := range p.Extents {
		x := &p.Extents[i]
		if x.Len == 0 {
			continue
		}
		d, ok := x.Region.(region.Device)
		if !ok {
			return nil, nil, fmt.Errorf("%w: gpu: extent %d is in a %s region", transfer.ErrUnsupported, i, x.Region.Kind())
		}
		if ordinal == -1 {
			ordinal = d.Ordinal()
		} else if d.Ordinal() != ordinal {
			return nil, nil, fmt.Errorf("%w: gpu: one file's extents on devices %d and %d", transfer.ErrUnsupported, ordinal, d.Ordinal())
		}
		off, roff, rest := x.FileOff, x.RegionOff, x.Len
		for rest > 0 {
			if cur == nil || cur.end != off || cur.end-cur.off >= limit || aligned && cur.end > cur.off && cur.end%limit == 0 {
				chunks = append(chunks, chunk{off: off, end: off})
				cur = &chunks[len(chunks)-1]
			}
			room := limit - (cur.end - cur.off)
			if aligned {
				room = min(room, limit-cur.end%limit)
			}
			n := min(rest, room)
			cur.pieces = append(cur.pieces, piece{dev: d.Ptr() + uintptr(roff), bufOff: int(cur.end - cur.off), n: int(n), sum: x.Sum})
			cur.end += n
			off, roff, rest = off+n, roff+n, rest-n
		}
	}
	for i := range chunks {
		c := &chunks[i]
		c.aoff, c.aend = c.off, c.end
		if p.Direct {
			// A direct write must start on a block; a plan that ends
			// inside one is written to the block's end with zeros
			// (transfer.Plan.Direct), as writeChunk does.
			if write && c.off%align != 0 {
				return nil, nil, fmt.Errorf("%w: [%d, %d)", errUnaligned, c.off, c.end)
			}
			c.aoff = c.off / align * align
			c.aend = (c.end + align - 1) / align * align
		}
	}
	if len(chunks) == 0 {
		return nil, nil, nil
	}
	dev := m.devs[ordinal]
	if dev == nil {
		return nil, nil, fmt.Errorf("%w: gpu: device %d is not served", transfer.ErrUnsupported, ordinal)
	}
	return chunks, dev, nil
}

// stage is a chunk and the pinned buffer it moves through.
type stage struct {
	c   *chunk
	buf int
}

// sum folds bytes [lo, hi) of the chunk's data (buffer b, data starting
// at lead) into their checksum slots.
func sum(c *chunk, b []byte, lead, lo, hi int, sums []uint32) {
	for _, p := range c.pieces {
		if p.sum < 0 {
			continue
		}
		s, e := max(lo, p.bufOff), min(hi, p.bufOff+p.n)
		if s < e {
			sums[p.sum] = crc32c.Update(sums[p.sum], b[lead+s:lead+e])
		}
	}
}

// fuseBatch: where the kernel's transfer is a CPU copy (buffered I/O, or
// any I/O to a memory file system), a chunk's system calls are cut into
// pieces of this size, each checksummed right after the kernel copied it,
// while it is in cache (as package staging does). It is a multiple of
// align, so that direct pieces stay aligned.
const fuseBatch = 256 << 10

// fusedIO reports whether a plan's file I/O goes in pieces, each
// checksummed right after its system call, rather than one system call
// per chunk. It does unless the file is open with O_DIRECT on a device:
// there the DMA leaves no bytes in the CPU's cache, and large requests
// serve the device best. A memory file system (tmpfs, which accepts
// O_DIRECT since Linux 6.6) copies with the CPU either way, so a direct
// file there is fused too: checksumming a chunk after its one large read
// would be a second pass over memory.
func fusedIO(p *transfer.Plan) bool { return PieceBytes(p.Direct, p.Memory) > 0 }

// PieceBytes is the size of the system calls a chunk's file I/O is cut
// into on a mount (fusedIO): 256 KiB where the kernel's transfer is a CPU
// copy (buffered I/O, or a memory file system), 0 (one call per chunk)
// for O_DIRECT on a device.
func PieceBytes(direct, memory bool) int {
	if direct && !memory {
		return 0
	}
	return fuseBatch
}

// WriteFile gathers the plan's device extents into pinned buffers and
// writes them to f, checksumming on the way.
func (m *Mover) WriteFile(ctx context.Context, f fsys.File, p *transfer.Plan, sums []uint32) (int64, error) {
	return m.run(ctx, f, p, sums, true)
}

// ReadFile reads the plan's bytes from f into pinned buffers, checksums
// them and scatters them to the device extents.
func (m *Mover) ReadFile(ctx context.Context, f fsys.File, p *transfer.Plan, sums []uint32) (int64, error) {
	return m.run(ctx, f, p, sums, false)
}

func (m *Mover) run(ctx context.Context, f fsys.File, p *transfer.Plan, sums []uint32, write bool) (n int64, err error) {
	if m.cfg.NoChecksums {
		sums = nil
	}
	if sums != nil && len(sums) != p.Sums {
		return 0, fmt.Errorf("gpu: %d checksum slots for a plan of %d", len(sums), p.Sums)
	}
	chunks, dev, err := m.plan(p, write)
	if err != nil || len(chunks) == 0 {
		return 0, err
	}
	m.act.begin()
	defer m.act.end()
	// Reads from memory file systems and buffered files go in pieces
	// whether or not there are checksums (the CPU copy is the same; the
	// pieces measured faster, BenchmarkTmpfsDirect/load/sums=off); writes
	// are cut only to fuse their checksums (pieces measured no faster).
	fused := fusedIO(p)
	if write && sums == nil {
		fused = false
	}
	// A memory-mount file's identity: for its registration, and a load's
	// mapping (readSource), which only files of fsys.MapMin bytes or more
	// get: without registration a smaller file costs one fstat.
	var id fileID
	identified := false
	switch {
	case p.Memory && m.files != nil:
		id, identified = identify(f)
	case p.Memory && !write:
		id, identified = identifyFrom(f, fsys.MapMin)
	}
	if m.files != nil && identified {
		if rf := m.files.acquire(id, p.End()); rf != nil {
			n, err = m.runMapped(ctx, rf.mem, p, chunks, dev, sums, write)
			m.files.put(rf, write, err == nil)
			return n, err
		}
		// Registered later, off the job's path, for the next job;
		// not if the file is removed meanwhile.
		m.files.expectOffer(id)
		file := f
		defer func() {
			if err == nil {
				m.files.offer(file, id, false)
			}
			m.files.endExpected(id)
		}()
	}
	if !write {
		var release func()
		f, release = m.readSource(f, p, id, identified)
		defer release()
	}
	if m.files != nil && p.Memory {
		// The registrar waits for these stores and loads (streamShare).
		// Jobs on registered files are not counted: registrations beside
		// them cost them about a tenth, less than putting the
		// registrations off would cost the pinned path's jobs
		// (TestGPURegisteredJobsBesideRegistrations, RATIONALE).
		// Jobs on a disk are not counted: they run at the disk's speed,
		// and a slow disk's jobs would hold the memory mounts'
		// registrations back (their cost beside registrations was not
		// measured).
		m.files.beginStream()
		defer m.files.endStream()
	}
	return m.runStreamed(ctx, f, chunks, dev, sums, write, fused, p.Folio)
}

// mapCacheFiles and mapCacheIdle bound the mappings a mover keeps for
// loads of files not registered (Mover.maps): a file's layer jobs of a
// step come within milliseconds of each other, and the next step's
// within seconds. A file removed keeps its pages that long at most after
// its last load: one the engine forgets is unmapped at once, but a load
// that identified it just before can map it again.
const (
	mapCacheFiles = 1024
	mapCacheIdle  = 5 * time.Second
)

// readSource returns f as a load of plan p reads it: a file of
// fsys.MapMin bytes or more on a memory file system (the file id,
// identified) through the mover's mapping of the whole file, made by the
// file's first job and kept for its next (a layer-wise load reads each
// file once per group of layers), else as the plan says
// (transfer.Plan.ReadSource: smaller files are read, since a file loaded
// once would cost a mapping and an unmapping all the same).
func (m *Mover) readSource(f fsys.File, p *transfer.Plan, id fileID, identified bool) (fsys.File, func()) {
	if identified && id.size >= fsys.MapMin {
		if src, release, ok := m.maps.Read(f, id.FileID, id.size); ok {
			return src, release
		}
	}
	return p.ReadSource(f)
}

// Forget implements transfer.Forgetter: the file is being removed or
// replaced, so its registration and its load mapping (if any) are
// dropped.
func (m *Mover) Forget(id fsys.FileID) {
	if m.files != nil {
		m.files.forget(id)
	}
	m.maps.Forget(id)
}

// Prepare implements transfer.Preparer: a file the engine made ahead of
// stores (a spare, on a memory file system) is offered to the registrar
// as a file is after its first job, so that the first store into it
// already moves straight into its pages.
func (m *Mover) Prepare(f fsys.File) {
	if m.files == nil {
		return
	}
	if id, ok := identify(f); ok {
		m.files.offer(f, id, false)
	}
}

// Warm implements transfer.Warmer: a file the engine indexed without a
// job (found on a memory mount at start, or another process's or node's
// file a lookup discovered) is offered to the registrar, so that its
// first load already copies straight out of its pages. Unlike a job's
// file it is taken only while fewer files than the bound are registered
// and queued: it never displaces a file jobs used, nor counts towards
// the second offer that admits a file at the bound. Warm reports whether
// the registrar would take another such file.
func (m *Mover) Warm(f fsys.File) bool {
	if m.files == nil {
		return false
	}
	id, ok := identify(f)
	if !ok {
		m.files.mu.Lock()
		defer m.files.mu.Unlock()
		return m.files.belowBoundLocked()
	}
	return m.files.offer(f, id, true)
}

// deviceFault records that a job on dev failed with err if err holds a
// sticky CUDA error (cuda.ErrSticky): the process's context on the device
// is broken, and every later job there fails until the daemon restarts.
// The first is logged at error level, for the operator.
func (m *Mover) deviceFault(dev *device, err error) {
	if !errors.Is(err, cuda.ErrSticky) {
		return
	}
	if dev.faults.Add(1) == 1 && m.cfg.Log != nil {
		m.cfg.Log.Error("gpu: a sticky CUDA error on the device: its context is broken, and its jobs fail until the daemon restarts",
			"device", dev.ordinal, "err", err.Error())
	}
}

// DeviceFaults reports, per device ordinal, the jobs that failed with a
// sticky CUDA error there (a device that has any needs the daemon
// restarted, or the GPU reset).
func (m *Mover) DeviceFaults() map[int]uint64 {
	out := make(map[int]uint64, len(m.devs))
	for d, dev := range m.devs {
		out[d] = dev.faults.Load()
	}
	return out
}

// PinnedUsage reports the pinned staging buffers: in use by jobs now, in
// all (gpu.staging_memory), and the bytes of one.
func (m *Mover) PinnedUsage() (inUse, total, size int) {
	total = m.bufs.total()
	return total - m.bufs.free(), total, m.bsize
}

// FileStats describes the registered files (zero without them), and the
// files mapped for loads.
func (m *Mover) FileStats() FileStats {
	var st FileStats
	if m.files != nil {
		st = m.files.stats()
	}
	st.Mapped = m.maps.Len()
	return st
}

// writeChunk writes a gathered chunk and checksums it: fused, piece by
// piece right after each write; else in one write. Fused pieces end at
// file offsets that are multiples of their size: fuseBatch, or folio
// where that is larger (transfer.Plan.Folio: a piece that began or ended
// inside a large folio would make the kernel zero the rest of it first).
func (m *Mover) writeChunk(f fsys.File, st *stage, sums []uint32, fused bool, folio int64, y *staging.Yielder) error {
	b, _ := m.buf(st.buf)
	c := st.c
	n := int(c.end - c.off)
	// With O_DIRECT a chunk ending inside a block is written to the
	// block's end (c.aend): the tail is zeros, never a reused buffer's
	// old bytes. The checksums cover the data only.
	total := int(c.aend - c.off)
	clear(b[n:total])
	for lo := 0; lo < total; {
		hi := total
		if fused {
			step := max(fuseBatch, folio)
			hi = min(total, lo+int(step-(c.off+int64(lo))%step))
		}
		if err := writeFull(f, b[lo:hi], c.off+int64(lo)); err != nil {
			return err
		}
		done := lo
		if sums != nil && lo < n {
			// In steps of at most fuseBatch and YieldBytes, each reported
			// to the yielder: a piece of a large folio still yields every
			// YieldBytes of CPU work.
			done = min(hi, n)
			y.Steps(done-lo, fuseBatch, func(a, e int) { sum(c, b, 0, lo+a, lo+e, sums) })
		}
		y.Moved(int64(hi - done))
		lo = hi
	}
	return nil
}

// readChunk reads a chunk's (aligned) range and checksums its bytes:
// piece by piece, each checksummed right after its read (fused; with or
// without checksums), else in one read.
func (m *Mover) readChunk(f fsys.File, st *stage, sums []uint32, fused bool, y *staging.Yielder) error {
	b, _ := m.buf(st.buf)
	c := st.c
	lead := int(c.off - c.aoff)
	need := int(c.end - c.aoff) // the bytes that must be in the file
	span := int(c.aend - c.aoff)
	step := span
	if fused {
		step = fuseBatch
	}
	// Pieces start at multiples of step and end there or at span: aligned
	// when the chunk is (direct I/O). The last piece may reach past need
	// (the aligned tail of a direct read past the end of file).
	for lo := 0; lo < need; {
		hi := min(span, lo+step)
		if err := readAtLeast(f, b[lo:hi], min(need, hi)-lo, c.aoff+int64(lo)); err != nil {
			return err
		}
		// Data bytes of this piece: buffer [lo, min(hi, need)) minus the lead.
		if s, e := max(lo, lead)-lead, min(hi, need)-lead; sums != nil && s < e {
			sum(c, b, lead, s, e, sums)
		}
		y.Moved(int64(hi - lo))
		lo = hi
	}
	return nil
}

// writeFull writes b at off, looping over short writes.
func writeFull(f fsys.File, b []byte, off int64) error {
	for len(b) > 0 {
		n, err := f.WriteAt(b, off)
		if err != nil {
			return fmt.Errorf("gpu: write at %d: %w", off, err)
		}
		if n == 0 {
			return fmt.Errorf("gpu: write at %d wrote nothing", off)
		}
		b, off = b[n:], off+int64(n)
	}
	return nil
}

// readAtLeast reads into b at off until at least need bytes are in (b
// may be longer: the aligned tail of a direct read past the end of file).
func readAtLeast(f fsys.File, b []byte, need int, off int64) error {
	got := 0
	for got < need {
		n, err := f.ReadAt(b[got:], off+int64(got))
		got += n
		if got >= need {
			break
		}
		if err != nil && !errors.Is(err, io.EOF) {
			return fmt.Errorf("gpu: read at %d: %w", off+int64(got), err)
		}
		if n == 0 || err != nil {
			return fmt.Errorf("%w: read at %d: %d of %d bytes", staging.ErrShortFile, off, got, need)
		}
	}
	return nil
}

var (
	_ transfer.Mover     = (*Mover)(nil)
	_ transfer.Forgetter = (*Mover)(nil)
	_ transfer.Preparer  = (*Mover)(nil)
	_ transfer.Warmer    = (*Mover)(nil)
)
