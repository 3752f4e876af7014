package gpu

import (
	"container/list"
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/internal/cuda"
	"github.com/kvhost/kvhost/internal/fsys"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// Registered files (Config.RegisterFiles; docs/gpu.md, "Registered
// files").
//
// A file on a memory file system is its pages, in host memory. Mapped and
// registered with CUDA (cudaHostRegister), those pages are pinned memory
// the GPU's copy engines reach directly: a store then copies the paged
// device layout straight into the file and a load straight out of it, one
// batched DMA copy per file, with no pinned bounce buffer and no CPU copy;
// the CPU only reads the pages once for the checksums. Registration costs
// tens of milliseconds per 32 MiB file, more than a store, so it is never
// done on a job's path: after a job moved a file through the pinned
// buffers, the mover offers the file to a registrar goroutine, which maps
// and registers it in the background, and later jobs on the same file
// (the same inode: an evicted file the engine keeps as a spare and reuses
// for the next store stays registered) take the direct path.
//
// A registration is only correct while the file keeps the pages it had
// when it was registered. Writes keep them; truncation and hole punching
// replace them (the GPU would then move bytes to pages no longer in the
// file), and the engine never does either to a file it may reuse (it
// zeroes a reused spare's tail with writes). The registrar holds a
// descriptor of each file and drops the files that were unlinked (by this
// engine, which also calls Forget, or by another on the directory) at its
// next sweep, so that a removed file's memory is given back; at most
// Config.RegisterFiles files are kept, the least recently used dropped
// first.

// minIdle is how long a registered file must have gone unused before the
// registrar drops it for another: with more files in use than it keeps,
// registering each in turn would cost CPU and save nothing.
const minIdle = 10 * time.Second

// sweepEvery is how often the registrar drops registered files that were
// unlinked behind its back.
const sweepEvery = time.Second

// fileKey is a file's identity: its device and inode.
type fileKey struct{ dev, ino uint64 }

// regFile is a mapped, registered file.
type regFile struct {
	key  fileKey
	fd   int    // a descriptor of the file, for the registrar's sweeps
	mem  []byte // the mapping, registered with CUDA
	refs int    // jobs moving through mem
	gone bool   // forgotten or unlinked: released when refs is 0
	used time.Time
	elem *list.Element
}

// offer is a file a job moved, for the registrar to map and register.
type offer struct {
	key fileKey
	fd  int
}

// FileStats describes the registered files (Mover.FileStats).
type FileStats struct {
	// Files and Bytes are the files mapped and registered now.
	Files int
	Bytes int64
	// Limit is the most files kept (Config.RegisterFiles after the
	// descriptor limit).
	Limit int
	// Registered counts registrations, Released the files unregistered
	// since (forgotten, unlinked, dropped for others or at Close), Failed
	// the files that could not be mapped or registered.
	Registered, Released, Failed uint64
	// Stores and Loads count the jobs that moved a registered file
	// directly.
	Stores, Loads uint64
}

// files is the mover's registered files and their registrar.
type files struct {
	m      *Mover
	limit  int
	log    *slog.Logger
	offers chan offer
	wake   chan struct{} // files to release
	stop   chan struct{}
	done   chan struct{}
	sweep  time.Duration
	// minIdle: see the constant.
	minIdle time.Duration

	mu      sync.Mutex
	byKey   map[fileKey]*regFile
	lru     *list.List       // of *regFile, the most recently used first
	queued  map[fileKey]bool // offered, not registered yet; false: forgotten since
	release []*regFile       // gone, unused: to unregister on the registrar's thread
	bytes   int64
	st      FileStats
	warned  bool
}

// newFiles starts the registrar of at most limit files on a thread with
// device current.
func newFiles(m *Mover, limit, device int, log *slog.Logger) *files {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	g := &files{
		m: m, limit: limit, log: log, sweep: sweepEvery, minIdle: minIdle,
		offers: make(chan offer, 256), wake: make(chan struct{}, 1),
		stop: make(chan struct{}), done: make(chan struct{}),
		byKey: map[fileKey]*regFile{}, lru: list.New(), queued: map[fileKey]bool{},
	}
	go g.run(device)
	return g
}

// fileLimit bounds want by the descriptors the process may open: the
// registrar keeps one per file, and must leave most to the engine.
func fileLimit(want int) int {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err == nil && lim.Cur < uint64(4*want) {
		return int(lim.Cur / 4)
	}
	return want
}

// identify returns f's identity and whether it is a linked regular file.
func identify(f fsys.File) (fileKey, bool) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || st.Nlink == 0 || st.Size <= 0 {
		return fileKey{}, false
	}
	return fileKey{uint64(st.Dev), st.Ino}, true
}

// acquire returns the registered file key whose mapping holds the first
// end bytes, counted as in use, or nil.
func (g *files) acquire(key fileKey, end int64) *regFile {
	g.mu.Lock()
	defer g.mu.Unlock()
	rf := g.byKey[key]
	if rf == nil || int64(len(rf.mem)) < end {
		return nil
	}
	rf.refs++
	rf.used = time.Now()
	g.lru.MoveToFront(rf.elem)
	return rf
}

// put ends a job's use of rf, counting it a store or a load.
func (g *files) put(rf *regFile, write bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if write {
		g.st.Stores++
	} else {
		g.st.Loads++
	}
	rf.refs--
	if rf.refs == 0 && rf.gone {
		g.releaseLocked(rf)
	}
}

// offer hands f (identity key) to the registrar, unless it is registered
// or queued already, or the queue is full.
func (g *files) offer(f fsys.File, key fileKey) {
	g.mu.Lock()
	_, busy := g.queued[key]
	if busy || g.byKey[key] != nil {
		g.mu.Unlock()
		return
	}
	g.queued[key] = true
	g.mu.Unlock()
	// A descriptor of its own, read-write (a store's file is open
	// write-only, which cannot be mapped shared): the registrar maps it
	// later, and sweeps it while it is registered.
	fd, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", f.Fd()), unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err == nil {
		select {
		case g.offers <- offer{key: key, fd: fd}:
			return
		default:
			unix.Close(fd)
		}
	}
	g.mu.Lock()
	delete(g.queued, key)
	g.mu.Unlock()
}

// forget drops the file key: no job takes its mapping from now on, and it
// is released once the jobs using it are done.
func (g *files) forget(key fileKey) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, ok := g.queued[key]; ok {
		g.queued[key] = false
	}
	if rf := g.byKey[key]; rf != nil {
		g.dropLocked(rf)
	}
}

// dropLocked removes rf from the index and releases it once unused.
func (g *files) dropLocked(rf *regFile) {
	delete(g.byKey, rf.key)
	g.lru.Remove(rf.elem)
	g.bytes -= int64(len(rf.mem))
	rf.gone = true
	if rf.refs == 0 {
		g.releaseLocked(rf)
	}
}

func (g *files) releaseLocked(rf *regFile) {
	g.release = append(g.release, rf)
	select {
	case g.wake <- struct{}{}:
	default:
	}
}

// stats returns the registered files' counts.
func (g *files) stats() FileStats {
	g.mu.Lock()
	defer g.mu.Unlock()
	st := g.st
	st.Files, st.Bytes, st.Limit = len(g.byKey), g.bytes, g.limit
	return st
}

// close stops the registrar, which releases every file; the mover's jobs
// are done.
func (g *files) close() {
	close(g.stop)
	<-g.done
}

// run is the registrar: on its own thread, with device current, it
// registers the files offered, releases the files dropped and sweeps for
// unlinked ones.
func (g *files) run(device int) {
	defer close(g.done)
	unlock, err := g.m.r.LockDevice(device)
	if err != nil {
		g.log.Warn("gpu: registered files off: no thread for device", "device", device, "err", err)
		g.mu.Lock()
		g.limit = 0
		g.mu.Unlock()
	} else {
		defer unlock()
	}
	tick := time.NewTicker(g.sweep)
	defer tick.Stop()
	for {
		g.releaseGone()
		select {
		case <-g.stop:
			g.mu.Lock()
			for _, rf := range g.byKey {
				g.dropLocked(rf)
			}
			g.mu.Unlock()
			g.releaseGone()
			for {
				select {
				case o := <-g.offers:
					unix.Close(o.fd)
				default:
					return
				}
			}
		case o := <-g.offers:
			g.register(o)
		case <-g.wake:
		case <-tick.C:
			g.sweepUnlinked()
		}
	}
}

// register maps and registers an offered file, making room among the
// least recently used files first.
func (g *files) register(o offer) {
	g.mu.Lock()
	wanted := g.queued[o.key] && g.byKey[o.key] == nil && g.limit > 0
	for wanted && len(g.byKey) >= g.limit {
		var victim *regFile
		idle := time.Now().Add(-g.minIdle)
		for e := g.lru.Back(); e != nil; e = e.Prev() {
			if rf := e.Value.(*regFile); rf.refs == 0 && rf.used.Before(idle) {
				victim = rf
				break
			}
		}
		if victim == nil {
			wanted = false
			break
		}
		g.dropLocked(victim)
	}
	g.mu.Unlock()
	g.releaseGone()
	if !wanted {
		g.mu.Lock()
		delete(g.queued, o.key)
		g.mu.Unlock()
		unix.Close(o.fd)
		return
	}
	rf, err := g.mapAndRegister(o)
	g.mu.Lock()
	defer g.mu.Unlock()
	// Forgotten while it was being registered (queued false): released
	// at once, never used.
	forgotten := !g.queued[o.key]
	delete(g.queued, o.key)
	if err == nil && forgotten {
		rf.gone = true
		g.releaseLocked(rf)
		return
	}
	if err != nil {
		unix.Close(o.fd)
		g.st.Failed++
		if !g.warned {
			g.warned = true
			g.log.Warn("gpu: a file could not be registered: its jobs move through the pinned buffers (logged once)", "err", err)
		}
		return
	}
	g.st.Registered++
	rf.used = time.Now()
	rf.elem = g.lru.PushFront(rf)
	g.byKey[o.key] = rf
	g.bytes += int64(len(rf.mem))
}

// mapAndRegister maps the offered file whole, shared, and registers the
// mapping; it fails for a file unlinked meanwhile.
func (g *files) mapAndRegister(o offer) (*regFile, error) {
	var st unix.Stat_t
	if err := unix.Fstat(o.fd, &st); err != nil {
		return nil, fmt.Errorf("gpu: stat a file to register: %w", err)
	}
	if st.Nlink == 0 || st.Size <= 0 || uint64(st.Ino) != o.key.ino {
		return nil, fmt.Errorf("gpu: a file to register was removed or emptied")
	}
	mem, err := unix.Mmap(o.fd, 0, int(st.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("gpu: map a file of %d bytes: %w", st.Size, err)
	}
	if err := g.m.r.HostRegister(mem); err != nil {
		unix.Munmap(mem)
		return nil, fmt.Errorf("gpu: register a file of %d bytes: %w", st.Size, err)
	}
	return &regFile{key: o.key, fd: o.fd, mem: mem}, nil
}

// releaseGone unregisters, unmaps and closes the files released.
func (g *files) releaseGone() {
	g.mu.Lock()
	rel := g.release
	g.release = nil
	g.st.Released += uint64(len(rel))
	g.mu.Unlock()
	for _, rf := range rel {
		if err := g.m.r.HostUnregister(rf.mem); err != nil {
			g.log.Debug("gpu: unregister a file", "err", err)
		}
		unix.Munmap(rf.mem)
		unix.Close(rf.fd)
	}
}

// sweepUnlinked drops the registered files that no name links any more.
func (g *files) sweepUnlinked() {
	g.mu.Lock()
	all := make([]*regFile, 0, len(g.byKey))
	for _, rf := range g.byKey {
		all = append(all, rf)
	}
	g.mu.Unlock()
	for _, rf := range all {
		var st unix.Stat_t
		if err := unix.Fstat(rf.fd, &st); err == nil && st.Nlink > 0 {
			continue
		}
		g.mu.Lock()
		if g.byKey[rf.key] == rf {
			g.dropLocked(rf)
		}
		g.mu.Unlock()
	}
}

// runMapped moves the plan's chunks between the device and mem, a
// registered mapping of its file, with DMA copies on a lane of dev (never
// the copy kernel) and no pinned buffer. A load enqueues every chunk's
// copies at once and checksums the file's bytes while they run; a store
// keeps up to Config.Depth chunks' copies in flight and checksums each
// chunk as soon as its copies are done, while the next ones run.
func (m *Mover) runMapped(ctx context.Context, mem []byte, p *transfer.Plan, chunks []chunk, dev *device, sums []uint32, write bool) (int64, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	return m.onLane(dev, func(ln *lane) (total int64, err error) {
		base := uintptr(unsafe.Pointer(unsafe.SliceData(mem)))
		d := len(ln.events)
		run := m.startRun(dev, ln, d)
		defer func() {
			if werr := run.finish(); err == nil && werr != nil {
				total, err = 0, werr
			}
		}()
		wait := run.wait
		var cp cuda.Copies
		// enqueue enqueues chunks [from, to) and records event s after them.
		enqueue := func(from, to, s int) error {
			cp.Reset()
			for k := from; k < to; k++ {
				c := &chunks[k]
				for _, pc := range c.pieces {
					host := base + uintptr(c.off) + uintptr(pc.bufOff)
					if write {
						cp.Add(host, pc.dev, uintptr(pc.n))
					} else {
						cp.Add(pc.dev, host, uintptr(pc.n))
					}
				}
			}
			return run.recorded(s, m.r.Enqueue(&cp, !write, m.fallback, ln.stream))
		}
		// sumChunk folds chunk k's file bytes into their checksum slots.
		sumChunk := func(k int) error {
			if sums == nil {
				return nil
			}
			c := &chunks[k]
			return region.Guard(func() error {
				sum(c, mem[c.off:c.end:c.end], 0, 0, int(c.end-c.off), sums)
				return nil
			})
		}
		if end := p.End(); write && p.Direct {
			// As writeChunk: a direct plan ending inside a block is written
			// to the block's end, the tail as zeros.
			if err := region.Guard(func() error {
				clear(mem[end:min(int64(len(mem)), (end+Align-1)/Align*Align)])
				return nil
			}); err != nil {
				return 0, fmt.Errorf("gpu: registered file: %w", err)
			}
		}
		if !write {
			if err := enqueue(0, len(chunks), 0); err != nil {
				return 0, err
			}
			for k := range chunks {
				if err := sumChunk(k); err != nil {
					return 0, fmt.Errorf("gpu: registered file: %w", err)
				}
				total += chunks[k].end - chunks[k].off
			}
			return total, nil // the deferred wait reports the copies' errors
		}
		for k := range min(d, len(chunks)) {
			if err := enqueue(k, k+1, k); err != nil {
				return 0, err
			}
		}
		for k := range chunks {
			if err := ctx.Err(); err != nil {
				return 0, err
			}
			s := k % d
			if err := wait(s); err != nil {
				return 0, err
			}
			if k+d < len(chunks) {
				if err := enqueue(k+d, k+d+1, s); err != nil {
					return 0, err
				}
			}
			if err := sumChunk(k); err != nil {
				return 0, fmt.Errorf("gpu: registered file: %w", err)
			}
			total += chunks[k].end - chunks[k].off
		}
		return total, nil
	})
}
