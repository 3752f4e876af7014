package gds

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// MoverConfig configures a Mover. The zero value is usable.
type MoverConfig struct {
	// Workers is the number of OS threads issuing cuFile calls; 0 means 8.
	Workers int
	// AllowCompat lets the mover use mounts where cuFile runs in
	// compatibility mode (a host bounce inside libcufile). Off by default:
	// kvhost's own staging pipeline is the better host bounce, and the
	// mover answers transfer.ErrUnsupported there so the engine takes it.
	AllowCompat bool
	// MaxIO is the most bytes of one cuFile call or batch entry; larger
	// runs are split across workers. 0 means 8 MiB.
	MaxIO int64
	// IO chooses how a job's pieces reach cuFile: one cuFileRead or
	// cuFileWrite per piece, or batches (cuFileBatchIOSubmit). The zero
	// value, IOAuto, batches only where batches are known to pay (see
	// IOAuto).
	IO IOMode
	// BatchSize is the most entries of one batch; 0 means the driver's
	// max_batch_io_size (Properties.MaxBatchIO), or 128 when it reports
	// none. It is never more than the driver's limit.
	BatchSize int
	// BatchTimeout bounds the wait for one batch's completions; at expiry
	// the batch is canceled and the job fails (a batch timeout) once
	// every entry has come back: until then the library may still move
	// bytes into the job's memory, so the job is held (a batch whose
	// entries stay out for 5 s, or BatchTimeout, after the cancel also
	// counts as a device fault). 0 means one minute. It cannot bound a
	// cuFileBatchIOSubmit that never returns (seen in compatibility
	// mode): that call holds its worker and its share of the driver's
	// entry budget, which is why IOAuto never batches there.
	BatchTimeout time.Duration
}

// IOMode is how a Mover hands a job's pieces to cuFile.
type IOMode int

// IO modes.
const (
	// IOAuto batches on a mount where batches are known to pay: in direct
	// mode (nvidia-fs) when the driver reports batch I/O support (feature
	// flag CU_FILE_BATCH_IO_SUPPORTED), in compat mode only if batches
	// measured faster than per-call I/O (autoBatchCompat; docs/gds.md has
	// the measurement). Elsewhere it issues one call per piece.
	IOAuto IOMode = iota
	// IOPerCall issues one synchronous cuFileRead or cuFileWrite per piece.
	IOPerCall
	// IOBatch submits a job's pieces as batches wherever the library has
	// the batch API and the mount has not refused it.
	IOBatch
)

// String names the mode: "auto", "per-call" or "batch".
func (m IOMode) String() string {
	switch m {
	case IOAuto:
		return "auto"
	case IOPerCall:
		return "per-call"
	case IOBatch:
		return "batch"
	}
	return fmt.Sprintf("IOMode(%d)", int(m))
}

// autoBatchCompat says whether IOAuto batches on compat-mode mounts: set
// from the H100 measurement in docs/gds.md.
const autoBatchCompat = false

// featureBatchIO is CU_FILE_BATCH_IO_SUPPORTED's bit in the driver's
// feature flags (Properties.FeatureFlags).
const featureBatchIO = 1 << 1

// Mover moves plans between files and device regions (region.Device) with
// cuFileRead and cuFileWrite, on its own fixed pool of workers locked to
// OS threads. It implements transfer.Mover and transfer.Forgetter.
//
// A Mover never lets the CPU see the bytes, so it computes no checksums.
// A region that is not device memory, a mount cuFile refuses, a
// compat-mode mount (or a file open without O_DIRECT on a direct one) when
// AllowCompat is off, a file whose registration fails, a Direct plan with
// a piece whose file offset or length is not 4 KiB aligned, or a piece at
// a device address not 4 KiB aligned on a direct mount gets
// transfer.ErrUnsupported before any byte moves (docs/gds.md, "The
// fallback chain"); every other failure fails the transfer. A job whose
// context is done drops its work no worker has started (its file's
// registration, its pieces), and ends once the work started has.
type Mover struct {
	d         *Driver
	cfg       MoverConfig
	batchSize int
	tasks     chan *task
	wg        sync.WaitGroup
	// stopped is closed once the workers have ended, after the first
	// Close: every Close waits for it.
	stopped chan struct{}

	mu     sync.RWMutex // held for reading while a job queues tasks
	closed bool

	faultMu sync.Mutex
	// faults counts, per device ordinal, the jobs that failed with a
	// sticky CUDA error there (DeviceFaults).
	faults map[int]uint64
}

var (
	_ transfer.Mover     = (*Mover)(nil)
	_ transfer.Forgetter = (*Mover)(nil)
)

// task is one piece (or one batch of pieces) of a job, run on a worker
// bound to its device.
type task struct {
	ordinal int
	run     func(w *worker) error
	done    func(error)
	// state is taskQueued until a worker starts the task or its job,
	// whose context is done, drops it (start, drop): a dropped task is
	// not run, and its job calls done.
	state atomic.Int32
}

// Task states.
const (
	taskQueued = iota
	taskStarted
	taskDropped
)

// start claims t for the worker that took it from the queue: false if
// its job dropped it.
func (t *task) start() bool { return t.state.CompareAndSwap(taskQueued, taskStarted) }

// drop claims t for its job, which no longer waits for it: false if a
// worker started it.
func (t *task) drop() bool { return t.state.CompareAndSwap(taskQueued, taskDropped) }

// worker is one worker's state: the device its thread is bound to, its
// pool of reusable batch contexts, one per device (each set up on the
// worker's thread at its first batch there, destroyed when the mover
// closes or when a batch on it is abandoned), and a batch's scratch space.
type worker struct {
	m       *Mover
	bound   int // the thread's device, -1 before the first task
	batches map[int]batchCtx
	ios     []batchIO
	events  []batchEvent
	done    []bool
}

// NewMover starts a mover's workers.
func (d *Driver) NewMover(cfg MoverConfig) (*Mover, error) {
	if cfg.Workers <= 0 {
		cfg.Workers = 8
	}
	if cfg.MaxIO <= 0 {
		cfg.MaxIO = 8 << 20
	}
	if cfg.BatchTimeout <= 0 {
		cfg.BatchTimeout = time.Minute
	}
	if cfg.IO < IOAuto || cfg.IO > IOBatch {
		return nil, fmt.Errorf("gds: unknown MoverConfig.IO %v", cfg.IO)
	}
	bs := cfg.BatchSize
	if limit := d.props.MaxBatchIO; limit > 0 && (bs <= 0 || bs > limit) {
		bs = limit
	}
	if bs <= 0 {
		bs = 128
	}
	bs = min(bs, d.inflight.size)
	m := &Mover{d: d, cfg: cfg, batchSize: bs, tasks: make(chan *task, 4*cfg.Workers), stopped: make(chan struct{}), faults: map[int]uint64{}}
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil, errClosed
	}
	d.movers[m] = struct{}{}
	d.mu.Unlock()
	for range cfg.Workers {
		m.wg.Add(1)
		go m.worker()
	}
	return m, nil
}

// worker runs tasks on one OS thread, binding it to a task's device when it
// differs from the thread's current one: once per worker and device, not
// per request. The thread is never unlocked: its current device and
// cuFile's state on it are changed, so it ends with the worker
// (cuda's rule).
func (m *Mover) worker() {
	defer m.wg.Done()
	runtime.LockOSThread()
	w := &worker{m: m, bound: -1, batches: map[int]batchCtx{}}
	defer w.closeBatches()
	for t := range m.tasks {
		if !t.start() {
			continue
		}
		if t.ordinal != w.bound && m.d.cfg.BindDevice != nil {
			if err := m.d.cfg.BindDevice(t.ordinal); err != nil {
				w.bound = -1
				t.done(fmt.Errorf("gds: bind device %d: %w", t.ordinal, err))
				continue
			}
		}
		w.bound = t.ordinal
		t.done(t.run(w))
	}
}

// Name implements transfer.Mover.
func (m *Mover) Name() string { return "cufile" }

// Checksums implements transfer.Mover: false, the CPU never sees the bytes.
func (m *Mover) Checksums() bool { return false }

// Forget implements transfer.Forgetter.
func (m *Mover) Forget(id fsys.FileID) { m.d.forget(id) }

// Close stops the workers after the jobs in flight; a job held by a stuck
// batch holds Close too. A later Close waits for the workers as the first
// does (Driver.Close relies on it), and returns errClosed.
func (m *Mover) Close() error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		<-m.stopped
		return errClosed
	}
	m.closed = true
	close(m.tasks)
	m.mu.Unlock()
	m.wg.Wait()
	m.d.mu.Lock()
	delete(m.d.movers, m)
	m.d.mu.Unlock()
	close(m.stopped)
	return nil
}

// WriteFile implements transfer.Mover: it writes the plan's extents from
// device memory into f.
func (m *Mover) WriteFile(ctx context.Context, f fsys.File, p *transfer.Plan, sums []uint32) (int64, error) {
	return m.move(ctx, f, p, true)
}

// ReadFile implements transfer.Mover: it reads the plan's extents from f
// into device memory. A file shorter than the plan fails.
func (m *Mover) ReadFile(ctx context.Context, f fsys.File, p *transfer.Plan, sums []uint32) (int64, error) {
	return m.move(ctx, f, p, false)
}

// piece is one cuFile call's worth of a plan: contiguous in the file and
// in one device region.
type piece struct {
	ordinal int
	base    uintptr // cuFile's bufPtr_base: a registered buffer's base, or the address itself
	bufOff  int64   // bufPtr_offset from base
	fileOff int64
	n       int64
}

// pieces coalesces extents contiguous in both the file and the same
// region's memory, and splits runs longer than maxIO.
func (m *Mover) pieces(p *transfer.Plan) ([]piece, int, error) {
	var out []piece
	var prev *transfer.Extent
	var prevDev region.Device
	ordinal := -1
	for i := range p.Extents {
		x := &p.Extents[i]
		dev, ok := x.Region.(region.Device)
		if !ok || x.Region.Kind() != region.KindDevice {
			return nil, 0, fmt.Errorf("%w: cufile moves device memory, extent %d is %s region %d",
				transfer.ErrUnsupported, i, x.Region.Kind(), x.Region.ID())
		}
		if ordinal < 0 {
			ordinal = dev.Ordinal()
		}
		if x.Len == 0 {
			continue
		}
		if prev != nil && prevDev.ID() == dev.ID() && prevDev.Ptr() == dev.Ptr() &&
			prev.FileOff+prev.Len == x.FileOff && prev.RegionOff+prev.Len == x.RegionOff {
			out[len(out)-1].n += x.Len
		} else {
			out = append(out, piece{ordinal: dev.Ordinal(), base: dev.Ptr() + uintptr(x.RegionOff), fileOff: x.FileOff, n: x.Len})
		}
		prev, prevDev = x, dev
	}
	// Split into pieces of at most MaxIO.
	var split []piece
	for _, pc := range out {
		for off := int64(0); off < pc.n; off += m.cfg.MaxIO {
			s := pc
			s.base = pc.base + uintptr(off)
			s.fileOff = pc.fileOff + off
			s.n = min(m.cfg.MaxIO, pc.n-off)
			split = append(split, s)
		}
	}
	return split, ordinal, nil
}

// directAlign is the alignment of O_DIRECT I/O that transfer.Plan.Direct
// promises movers handle.
const directAlign = 4096

// directAligned answers transfer.ErrUnsupported if a piece of a Direct
// plan has a file offset or length that is not a multiple of
// directAlign, before anything is registered or moved. cuFile would pass
// such I/O to the O_DIRECT descriptor unchanged (a POSIX path fails with
// EINVAL where the device's block is 4 KiB, and two workers' pieces
// would share a block), and nothing would write the plan's zero tail:
// the staging pipeline, next in the chain, bounces them. Device
// addresses are checked where the mount's mode is known (usable).
func directAligned(pcs []piece) error {
	for _, pc := range pcs {
		if pc.fileOff%directAlign != 0 || pc.n%directAlign != 0 {
			return fmt.Errorf("%w: cufile: O_DIRECT piece of %d bytes at file offset %d is not %d-byte aligned",
				transfer.ErrUnsupported, pc.n, pc.fileOff, directAlign)
		}
	}
	return nil
}

// submit queues t on the workers, unless the mover is closed or ctx is
// done first.
func (m *Mover) submit(ctx context.Context, t *task) error {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if m.closed {
		return errClosed
	}
	select {
	case m.tasks <- t:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// runOne runs f on a worker bound to the device and waits for it. If
// ctx is done before a worker starts it, f is not run, and runOne
// returns ctx's error.
func (m *Mover) runOne(ctx context.Context, ordinal int, f func() error) error {
	ch := make(chan error, 1)
	run := func(*worker) error { return f() }
	t := &task{ordinal: ordinal, run: run, done: func(err error) { ch <- err }}
	if err := m.submit(ctx, t); err != nil {
		return err
	}
	select {
	case err := <-ch:
		return err
	case <-ctx.Done():
		if t.drop() {
			return ctx.Err()
		}
		return <-ch
	}
}

func (m *Mover) move(ctx context.Context, f fsys.File, p *transfer.Plan, write bool) (int64, error) {
	op := "cuFileRead"
	if write {
		op = "cuFileWrite"
	}
	if err := p.Check(); err != nil {
		return 0, fmt.Errorf("gds: %s: %w", op, err)
	}
	pcs, ordinal, err := m.pieces(p)
	if err != nil || len(pcs) == 0 {
		return 0, err
	}
	if p.Direct {
		if err := directAligned(pcs); err != nil {
			return 0, err
		}
	}
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	fd := int(f.Fd())
	key, err := m.d.cache.identify(fd)
	if err != nil {
		return 0, err
	}
	capab := m.d.caps.get(key.Dev)
	if err := m.usable(capab.forFile(key.mode), pcs); err != nil {
		return 0, err
	}
	var h *handle
	err = m.runOne(ctx, ordinal, func() error {
		var err error
		h, err = m.d.cache.acquire(fd, key)
		if capab.Mode == ModeUnknown && settles(err) {
			capab = m.d.caps.settle(key.Dev, fd, err)
		}
		return err
	})
	if cerr := ctx.Err(); err != nil && cerr != nil && errors.Is(err, cerr) {
		return 0, err // the registration never ran: canceled while it waited
	}
	if err != nil {
		// Registration failed: nothing moved, the engine may take
		// another path.
		return 0, fmt.Errorf("%w: %w", transfer.ErrUnsupported, err)
	}
	defer m.d.cache.release(h)
	if err := m.usable(capab.forFile(key.mode), pcs); err != nil {
		return 0, err
	}

	// A unit is one task's work: one piece, or one batch of pieces.
	type unit struct {
		ordinal int
		run     func(w *worker) (int64, error)
	}
	var units []unit
	if m.useBatch(m.d.caps.get(key.Dev).forFile(key.mode)) {
		for _, chunk := range chunks(pcs, m.batchSize) {
			units = append(units, unit{chunk[0].ordinal, func(w *worker) (int64, error) {
				return w.runBatch(ctx, h, key.Dev, chunk, write)
			}})
		}
	} else {
		for _, pc := range pcs {
			units = append(units, unit{pc.ordinal, func(*worker) (int64, error) {
				return m.ioPiece(h, pc, write)
			}})
		}
	}

	var (
		moved  atomic.Int64
		failed atomic.Bool
		wg     sync.WaitGroup
		emu    sync.Mutex
		first  error
		// sticky is the first sticky CUDA error of each device whose
		// units failed with one: a device is counted even where another
		// unit's error came first.
		sticky map[int]error
	)
	fail := func(ordinal int, err error) {
		emu.Lock()
		if first == nil {
			first = err
		}
		if errors.Is(err, cuda.ErrSticky) && sticky[ordinal] == nil {
			if sticky == nil {
				sticky = map[int]error{}
			}
			sticky[ordinal] = err
		}
		emu.Unlock()
		failed.Store(true)
	}
	queued := make([]*task, 0, len(units))
	for _, u := range units {
		if failed.Load() {
			break
		}
		if err := ctx.Err(); err != nil {
			fail(u.ordinal, err)
			break
		}
		wg.Add(1)
		t := &task{ordinal: u.ordinal, done: func(err error) {
			if err != nil {
				fail(u.ordinal, err)
			}
			wg.Done()
		}}
		t.run = func(w *worker) error {
			if failed.Load() {
				return nil
			}
			if err := ctx.Err(); err != nil {
				return err
			}
			n, err := u.run(w)
			moved.Add(n)
			return err
		}
		if err := m.submit(ctx, t); err != nil {
			wg.Done()
			fail(u.ordinal, err)
			break
		}
		queued = append(queued, t)
	}
	// Once ctx is done, the tasks no worker has started are dropped: the
	// job does not wait for the work queued before them (other jobs', a
	// stuck batch's), and they never run.
	// A context that is never done (Background) needs no watch.
	stop := func() bool { return false }
	if ctx.Done() != nil {
		stop = context.AfterFunc(ctx, func() {
			for _, t := range queued {
				if t.drop() {
					t.done(ctx.Err())
				}
			}
		})
	}
	wg.Wait()
	stop()
	for ordinal, err := range sticky {
		m.deviceFault(ordinal, err)
	}
	return moved.Load(), first
}

// deviceFault records that a job failed on device ordinal with err, a
// sticky CUDA error (cuda.ErrSticky; move keeps only those): the
// process's context on the device is broken. Only some failures say so:
// cuFile's CUfileError_t carries the CUDA driver's result (the batch
// calls'), and binding a worker to the device is cudaSetDevice; a failed
// cuFileRead or cuFileWrite, or a batch entry, says only
// CU_FILE_CUDA_DRIVER_ERROR, so a broken context there is not seen here.
// A job the mover passes on (transfer.ErrUnsupported) is not counted: the
// next mover of the chain runs it and counts its own fault. The first
// fault of a device is logged at error level, for the operator.
func (m *Mover) deviceFault(ordinal int, err error) {
	if m.countFault(ordinal) == 1 {
		m.d.log.Error("cufile: a sticky CUDA error on the device: its context is broken, and its jobs fail until the daemon restarts",
			"device", ordinal, "err", err.Error())
	}
}

// batchStuck records that a canceled batch on device ordinal still has
// outstanding of its entries out after the drain (abandon): the job
// that err (the reason it was abandoned) fails is held until they come
// back, and the device counts as faulted, for the operator: a GPU or
// driver that loses I/O is not to be trusted, and a held job says nothing
// to anyone else. serr is the last cuFileBatchIOGetStatus error, if any.
// Each is logged at error level.
func (m *Mover) batchStuck(ordinal, outstanding int, err, serr error) {
	m.countFault(ordinal)
	args := []any{"device", ordinal, "outstanding", outstanding, "err", err.Error()}
	if serr != nil {
		args = append(args, "status_err", serr.Error())
	}
	m.d.log.Error("cufile: a canceled batch's entries did not come back: the library may still move bytes into its job's memory, "+
		"so the job is held, with its memory and file handle, until they do; the device counts as faulted", args...)
}

// countFault counts a fault of device ordinal and returns its count.
func (m *Mover) countFault(ordinal int) uint64 {
	m.faultMu.Lock()
	defer m.faultMu.Unlock()
	m.faults[ordinal]++
	return m.faults[ordinal]
}

// DeviceFaults reports, per device ordinal, the jobs that failed with a
// sticky CUDA error there, and the batches there whose entries did not
// come back after cuFileBatchIOCancel (each holds its
// job until they do): a device that has any needs the daemon restarted,
// or the GPU reset. A device without any is absent.
func (m *Mover) DeviceFaults() map[int]uint64 {
	m.faultMu.Lock()
	defer m.faultMu.Unlock()
	return maps.Clone(m.faults)
}

// usable says whether the mover may move the pieces pcs on a mount, as a
// file meets it (Capability.forFile). In direct mode every piece's device
// address (its registered buffer's base plus its offset, or the address
// itself) must be a multiple of directAlign: nvidia-fs DMAs only to GPU
// addresses 4 KiB aligned and fails the I/O with EINVAL otherwise, so
// cuFile would fail such a piece or bounce it through its own GPU
// buffers; the staging pipeline, next in the chain, moves it. In compat
// mode cuFile bounces through host memory, and the address does not
// matter. The file side of O_DIRECT is directAligned's.
func (m *Mover) usable(c Capability, pcs []piece) error {
	switch c.Mode {
	case ModeUnusable:
		return fmt.Errorf("%w: cufile: %s", transfer.ErrUnsupported, c)
	case ModeCompat:
		if !m.cfg.AllowCompat {
			return fmt.Errorf("%w: cufile: %s, and compat mode is not allowed for this mover", transfer.ErrUnsupported, c)
		}
	case ModeDirect:
		for _, pc := range pcs {
			if addr := pc.base + uintptr(pc.bufOff); addr%directAlign != 0 {
				return fmt.Errorf("%w: cufile: %s: piece of %d bytes at device address %#x is not %d-byte aligned",
					transfer.ErrUnsupported, c, pc.n, addr, directAlign)
			}
		}
	}
	return nil
}

// ioPiece moves one piece with per-call I/O (io), naming the piece in its
// error.
func (m *Mover) ioPiece(h *handle, pc piece, write bool) (int64, error) {
	n, err := m.io(h, pc, write)
	if err != nil {
		op := "cuFileRead"
		if write {
			op = "cuFileWrite"
		}
		return n, fmt.Errorf("gds: %s %d bytes at file offset %d: %w", op, pc.n, pc.fileOff, err)
	}
	return n, nil
}

// io moves one piece, looping over short transfers. A read that reaches
// the end of the file before the piece's end fails with
// io.ErrUnexpectedEOF; a write that moves nothing fails with
// io.ErrShortWrite.
func (m *Mover) io(h *handle, pc piece, write bool) (int64, error) {
	var done int64
	for done < pc.n {
		var n int64
		var err error
		if write {
			n, err = m.d.api.write(h.h, pc.base, pc.n-done, pc.fileOff+done, pc.bufOff+done)
		} else {
			n, err = m.d.api.read(h.h, pc.base, pc.n-done, pc.fileOff+done, pc.bufOff+done)
		}
		if err != nil {
			return done, err
		}
		if n == 0 {
			if write {
				return done, io.ErrShortWrite
			}
			return done, fmt.Errorf("file ends at %d, plan needs %d: %w (%w)", pc.fileOff+done, pc.fileOff+pc.n, transfer.ErrShortFile, io.ErrUnexpectedEOF)
		}
		done += n
	}
	return done, nil
}
