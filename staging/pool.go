// Package staging is kvhost's CPU data path: a fixed pool of I/O workers
// (optionally pinned to CPUs), a bounded pool of 4 KiB-aligned bounce
// buffers, and gather/scatter of many small memory spans into large file I/O.
//
// Spans go to the file straight from their memory with pwritev/preadv when
// the file is opened buffered, or with O_DIRECT when every span is aligned;
// otherwise they are copied through bounce buffers, with the copy of one
// chunk overlapping the I/O of the previous one. CRC-32C checksums are
// computed on the way.
package staging

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/transfer"
)

// Errors of the package.
var (
	// errClosed: the pool is closed.
	errClosed = errors.New("staging: closed")
	// errUnaligned: a direct write whose file range does not start on a
	// 4 KiB boundary.
	errUnaligned = errors.New("staging: unaligned direct I/O")
	// ErrShortFile: a read reached the end of the file early. It is
	// transfer.ErrShortFile, what every mover returns.
	ErrShortFile = transfer.ErrShortFile
)

// Align is the alignment of bounce buffers and of direct I/O.
const Align = fsys.DirectAlign

// Config configures a Pool.
type Config struct {
	// Workers is the number of I/O workers (default DefaultWorkers).
	Workers int
	// CPUs, if set, pins worker i to CPUs[i%len(CPUs)].
	CPUs []int
	// BufferSize is the size of a bounce buffer (default 4 MiB, rounded up to Align).
	BufferSize int
	// Buffers bounds the number of bounce buffers (default 2 per worker).
	Buffers int
	// QueueLen is the number of tasks that may wait for a worker (default 4 per worker).
	QueueLen int
	// YieldBytes: a worker gives its CPU up (sched_yield) after every
	// YieldBytes it moved, and so does the goroutine that copies a
	// bounced run's bytes (Yielder); 0 never.
	YieldBytes int64
}

// Pool is a fixed set of I/O workers and a bounded set of bounce buffers.
type Pool struct {
	cfg   Config
	tasks chan func(*worker)
	bufs  *Buffers
	wg    sync.WaitGroup

	mu     sync.RWMutex
	closed bool
}

// DefaultWorkers is the number of I/O workers of a Config whose Workers
// is 0: runtime.GOMAXPROCS as it is now, at least 2.
func DefaultWorkers() int { return max(2, runtime.GOMAXPROCS(0)) }

// newPool starts the workers. It fails if a worker cannot be pinned.
func newPool(cfg Config) (*Pool, error) {
	if cfg.Workers <= 0 {
		cfg.Workers = DefaultWorkers()
	}
	if cfg.BufferSize <= 0 {
		cfg.BufferSize = 4 << 20
	}
	cfg.BufferSize = (cfg.BufferSize + Align - 1) / Align * Align
	if cfg.Buffers <= 0 {
		cfg.Buffers = 2 * cfg.Workers
	}
	if cfg.Buffers < 2 {
		cfg.Buffers = 2 // one chunk in copy, one in I/O
	}
	if cfg.QueueLen <= 0 {
		cfg.QueueLen = 4 * cfg.Workers
	}
	p := &Pool{
		cfg:   cfg,
		tasks: make(chan func(*worker), cfg.QueueLen),
		bufs:  newBuffers(cfg.BufferSize, cfg.Buffers),
	}
	errs := make(chan error, cfg.Workers)
	for i := range cfg.Workers {
		p.wg.Add(1)
		go p.run(i, errs)
	}
	var err error
	for range cfg.Workers {
		err = errors.Join(err, <-errs)
	}
	if err != nil {
		p.close()
		return nil, err
	}
	return p, nil
}

func (p *Pool) run(i int, started chan<- error) {
	defer p.wg.Done()
	w := &worker{ID: i, pool: p, yield: Yielder{Every: p.cfg.YieldBytes}}
	if len(p.cfg.CPUs) > 0 {
		runtime.LockOSThread()
		prev := threadCPUs() // set back before the thread is unlocked
		defer unpin(prev)
		cpu := p.cfg.CPUs[i%len(p.cfg.CPUs)]
		var set unix.CPUSet
		set.Set(cpu)
		if err := unix.SchedSetaffinity(0, &set); err != nil {
			started <- fmt.Errorf("staging: pin worker %d to CPU %d: %w", i, cpu, err)
			return
		}
		w.CPU = cpu
	} else {
		w.CPU = -1
	}
	started <- nil
	for fn := range p.tasks {
		fn(w)
	}
}

// threadCPUs returns the calling thread's CPU set, or nil if it cannot be read.
func threadCPUs() *unix.CPUSet {
	var set unix.CPUSet
	if unix.SchedGetaffinity(0, &set) != nil {
		return nil
	}
	return &set
}

// unpin gives the calling goroutine's thread its CPU set prev back and
// unlocks it. A thread whose set cannot be restored stays locked: the
// runtime ends it with the goroutine rather than hand it, pinned, to
// other goroutines (and to the threads it would create).
func unpin(prev *unix.CPUSet) {
	if prev != nil && unix.SchedSetaffinity(0, prev) == nil {
		runtime.UnlockOSThread()
	}
}

// Buffers returns the pool's bounce buffers.
func (p *Pool) Buffers() *Buffers { return p.bufs }

// submit queues fn to run on a worker, waiting while the queue is full. It
// returns ctx's error if ctx ends first, or errClosed.
func (p *Pool) submit(ctx context.Context, fn func(*worker)) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed {
		return errClosed
	}
	select {
	case p.tasks <- fn:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// close runs the queued tasks, stops the workers and waits for them.
func (p *Pool) close() {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		close(p.tasks)
	}
	p.mu.Unlock()
	p.wg.Wait()
}

// Buffers is a bounded pool of Align-aligned buffers of one size.
type Buffers struct {
	size int
	sem  chan struct{} // one token per buffer that may exist
	free chan []byte
}

// newBuffers returns a pool of at most n buffers of size bytes, allocated
// on first use.
func newBuffers(size, n int) *Buffers {
	return &Buffers{size: size, sem: make(chan struct{}, n), free: make(chan []byte, n)}
}

// Size is the size of every buffer.
func (b *Buffers) Size() int { return b.size }

// get returns a buffer, waiting while all are in use.
func (b *Buffers) get(ctx context.Context) ([]byte, error) {
	select {
	case buf := <-b.free:
		return buf, nil
	default:
	}
	select {
	case buf := <-b.free:
		return buf, nil
	case b.sem <- struct{}{}:
		return fsys.AlignedBuffer(b.size), nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// put returns a buffer obtained from get.
func (b *Buffers) put(buf []byte) { b.free <- buf[:b.size] }

func aligned(b []byte) bool {
	return len(b)%Align == 0 && (len(b) == 0 || uintptr(unsafe.Pointer(unsafe.SliceData(b)))%Align == 0)
}

// Usage reports the buffers handed out and not returned, and the most that
// may exist (metrics). The two are read without a lock: a snapshot.
func (b *Buffers) Usage() (inUse, limit int) {
	return max(len(b.sem)-len(b.free), 0), cap(b.sem)
}
