package gpu

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime/trace"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/staging"
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
// the CPU only reads the pages once for the checksums (not at all with
// checksums on the device, devsums.go). Registration costs
// tens of milliseconds per 32 MiB file, more than a store, so it is never
// done on a job's path: after a job moved a file through the pinned
// buffers, the mover offers the file to a registrar goroutine, which maps
// and registers it in the background, and later jobs on the same file
// (the same inode: an evicted file the engine keeps as a spare and reuses
// for the next store stays registered) take the direct path. Files no
// job moved are offered too, below the bound only (Mover.Warm): the
// engine's spares made ahead of stores (Prepare, as a job's file), the
// files on a memory mount when the engine opens, and the files of other
// processes or nodes that a lookup discovers.
//
// A registration is only correct while the file keeps the pages it had
// when it was registered. Writes keep them; truncation and hole punching
// replace them (the GPU would then move bytes to pages no longer in the
// file), and the engine never does either to a file it may reuse (it
// zeroes a reused spare's tail with writes). A job takes a file's mapping
// only if the file has the device, inode, file handle and size it had when
// it was registered; Forget releases a registration before it returns
// (else when the last job using it ends), closes a waiting offer's
// descriptor at once (a taken one's file is released as soon as its
// registration ends, never used), and keeps the jobs in flight on the
// file from offering it when they end (expectOffer): a removed file
// keeps none of its pages here once those end. The
// registrar, which holds a descriptor of each file, drops at its next
// sweep the files that were unlinked or resized behind its back (by
// another engine on the directory), so that their memory is given back.
// At most Config.RegisterFiles files are kept, the least recently used
// dropped first.

// minIdle is how long a registered file must have gone unused before the
// registrar drops it for another: with more files in use than it keeps,
// registering each in turn would cost CPU and save nothing.
const minIdle = 10 * time.Second

// maxOffers bounds the offers waiting for the registrar. Each holds a
// descriptor of its file; an offer that finds the queue full is dropped,
// and the file is offered again by its next job. A burst of stores of
// small files offers thousands of files in a second, faster than one
// thread registers them; a queue shorter than the burst leaves most of
// its files to move through the pinned buffers at their next job too.
const maxOffers = 4096

// Jobs moving memory-mount files through the pinned buffers and
// registrations slow each other down: measured with 16 jobs on an H100,
// stores into fresh tmpfs files ran at 0.53–0.83 of the write ceiling
// beside the registrar, and at 0.67–0.87 when it waited for them, as
// without registration; loads of another daemon's files right after their
// lookup ran at 18.2–20.0 GB/s beside it and at 20.5–27.1 when it waited
// (RATIONALE: "Why does the registrar wait while jobs move through the
// pinned buffers?"). So before each registration the registrar waits while
// such jobs run: until they stop, or for at most streamShare-1 times its
// last registration's duration (and at most maxStreamWait), so that jobs
// that never stop leave it one part in streamShare of the time, and the
// files still get registered. firstReg
// stands for the duration of a registration before one was timed (a
// 32 MiB file's on an H100).
const (
	streamShare   = 8
	maxStreamWait = time.Second
	firstReg      = 4 * time.Millisecond
)

// sweepEvery is how often the registrar drops registered files that were
// unlinked or resized behind its back.
const sweepEvery = time.Second

// fileID is what identifies a file to the registry: its identity
// (fsys.FileID, whose generation on tmpfs keeps a recycled 32-bit inode
// number from being taken for the file that had it) and its size (a file
// truncated and extended by someone else no longer matches its mapping).
// The registry indexes files by key (fsys.FileID.Inode): one file per
// inode number, its whole fileID compared when a job finds it.
type fileID struct {
	fsys.FileID
	size int64
}

// key is id's index in the registry: device and inode number.
func (id fileID) key() fsys.FileID { return id.Inode() }

// regFile is a mapped, registered file.
type regFile struct {
	id   fileID
	fd   int    // a descriptor of the file, for the registrar's sweeps
	mem  []byte // the mapping, registered with CUDA
	refs int    // jobs moving through mem
	gone bool   // dropped from the index: released when refs is 0
	used time.Time
	elem *list.Element
}

// offer is a file a job moved, for the registrar to map and register.
// It holds a descriptor of the file, which keeps the file's pages even
// after the file is removed: Forget closes it at once unless the
// registrar has taken the offer.
type offer struct {
	id        fileID
	fd        int  // -1 before the offering job opened it and once closed or handed on
	taken     bool // the registrar is mapping and registering it
	forgotten bool // forgotten while taken: released as soon as registered
}

// pending is a file that jobs in flight will offer when they end
// (expectOffer).
type pending struct {
	jobs      int  // the jobs that will offer it
	forgotten bool // forgotten while one ran: none of them offers it
}

// FileStats describes the registered files (Mover.FileStats).
type FileStats struct {
	// Files is the number of files mapped and registered now.
	Files int
	// Bytes is the size of their mappings.
	Bytes int64
	// Limit is the most files kept (Config.RegisterFiles after the
	// descriptor and mapping limits).
	Limit int
	// LimitBytes is the most bytes kept (Config.RegisterBytes; 0: no
	// bound but Limit).
	LimitBytes int64
	// Registered counts registrations, Released the files unregistered
	// since (forgotten, unlinked, resized, dropped for others or at
	// Close), Failed the files that could not be mapped or registered,
	// Deferred the offers declined at the bound because they were a
	// file's first since the bound was reached.
	Registered, Released, Failed, Deferred uint64
	// Warmed counts the files offered ahead of any job of the mover
	// (Mover.Warm: files the engine found on a memory mount when it
	// opened, or discovered by a lookup) and queued for registration.
	Warmed uint64
	// Stores and Loads count the jobs that moved a registered file
	// directly and succeeded.
	Stores, Loads uint64
	// Queued is the files offered and not registered yet: waiting for
	// the registrar, or being registered.
	Queued int
	// Waits counts the registrations the registrar put off while stores
	// into memory-mount files moved through the pinned buffers (offers it
	// then registered, or found forgotten or not wanted any more).
	Waits uint64
	// Waited is how long the registrar waited, summed over Waits.
	Waited time.Duration
	// Mapped is the files not registered that the mover keeps mapped for
	// their loads now (fsys.MapCache; with registration off too).
	Mapped int
}

// errGone: a file offered for registration was removed or replaced
// before the registrar reached it (not a failure).
var errGone = errors.New("gpu: the file was removed or replaced")

// files is the mover's registered files and their registrar.
type files struct {
	m          *Mover
	limit      int
	limitBytes int64 // Config.RegisterBytes; 0: none
	device     int   // the device current on threads that unregister
	log        *slog.Logger
	offers     chan *offer
	stop       chan struct{}
	done       chan struct{}
	sweep      time.Duration

	// streaming counts the jobs moving memory-mount files through the
	// pinned buffers (beginStream, endStream); streamEnded has a token
	// when it fell to 0.
	streaming   atomic.Int32
	streamEnded chan struct{}
	// lastReg is how long the last successful registration took (the
	// registrar's own, in nanoseconds), waitCap the most it waits before
	// one (maxStreamWait; a field for tests).
	lastReg atomic.Int64
	waitCap time.Duration
	// idleParked counts the idle registrars waiting for the mover to
	// fall idle (runIdle; for tests).
	idleParked atomic.Int32
	// idleTook, if set (tests), is called when an idle registrar has
	// taken an offer, before it looks whether a job started meanwhile.
	idleTook func()

	mu     sync.Mutex
	byKey  map[fsys.FileID]*regFile
	lru    *list.List             // of *regFile, the most recently used first
	queued map[fsys.FileID]*offer // offered, not registered yet
	// pending is the files jobs in flight will offer (expectOffer), by
	// identity, generation included (a file that got a forgotten file's
	// inode number is another file): bounded by the jobs in flight.
	pending map[fsys.FileID]pending
	seen    map[fsys.FileID]bool // by identity: offered once at the bound (admitLocked)
	bytes   int64
	// registering and registeringBytes are the files being mapped and
	// registered now (taken offers), counted against the bounds with
	// the registered ones: the registrars run at once.
	registering      int
	registeringBytes int64
	st               FileStats
	warned           bool
	stopped          bool // close began: offers are declined, no job takes a mapping
	// live is every registered file not yet claimed for release
	// (claimLocked), in the index or dropped while a job held it: close
	// releases them all. busy counts the releases claimed and not done
	// (releaseNow), idle is signalled when it falls to 0: close waits
	// for those it did not claim (a job's, Forget's).
	live map[*regFile]struct{}
	busy int
	idle sync.Cond
	// minIdle: see the constant.
	minIdle time.Duration
}

// newFiles starts the registrars (n threads, 0 for DefaultRegistrars,
// and idle threads that register only while the mover runs no job) of at
// most limit files and limitBytes bytes (0: no bound but limit), each
// thread with device current; every field is set before the first
// thread starts. It returns once each thread has made the device current
// or failed to: where a registrar failed, the limit is 0 by then
// (registration off).
func newFiles(m *Mover, limit int, limitBytes int64, n, idle, device int, log *slog.Logger) *files {
	if n <= 0 {
		n = DefaultRegistrars
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	g := &files{
		m: m, limit: limit, limitBytes: limitBytes, device: device, log: log, sweep: sweepEvery, minIdle: minIdle,
		streamEnded: make(chan struct{}, 1), waitCap: maxStreamWait,
		offers: make(chan *offer, min(limit, maxOffers)), stop: make(chan struct{}), done: make(chan struct{}),
		byKey: map[fsys.FileID]*regFile{}, lru: list.New(), queued: map[fsys.FileID]*offer{}, pending: map[fsys.FileID]pending{}, seen: map[fsys.FileID]bool{},
		live: map[*regFile]struct{}{},
	}
	g.idle.L = &g.mu
	g.lastReg.Store(int64(firstReg))
	var wg, ready sync.WaitGroup
	for i := range n {
		wg.Add(1)
		ready.Add(1)
		go func() {
			defer wg.Done()
			g.run(i == 0, ready.Done)
		}()
	}
	for range idle {
		wg.Add(1)
		ready.Add(1)
		go func() {
			defer wg.Done()
			g.runIdle(ready.Done)
		}()
	}
	go func() {
		wg.Wait()
		close(g.done)
	}()
	ready.Wait()
	return g
}

// DefaultRegistrars is how many threads register offered files at once
// (Config.Registrars). On the H100 machine (TestGPURegistrationRate, 64
// files of 32 MiB on /dev/shm, nothing else running) one thread
// registered 149 files a second, two 392, four 412 and eight 381. But
// beside loads it did not pay: a 16 GiB burst loaded right after its
// stores (twice the spares) had 269 of 512 files registered in time with
// two registrars against 278 with one, and loaded at 20.2 GB/s against
// 37.5 (in another call, whose peer and ceilings also ran slower:
// docs/bench/h100-registrars.txt). One it stays.
const DefaultRegistrars = 1

// DefaultIdleRegistrars is the daemon's Config.IdleRegistrars
// (gpu.idle_registrars): one more thread registers offered files while
// the mover runs no job. Alone, on the H100 machine, two threads
// registered 374–392 files of 32 MiB a second against one thread's
// 149–150, and four threads 393–412 (TestGPURegistrationRate; see
// DefaultRegistrars). In the engine the gain was smaller: after a restart
// (kvhost bench --restart) the registrar and an idle one took the 256
// files found in 0.51–0.64 s against 0.64–0.75 s for the registrar alone,
// and 4.2–4.4 s against 4.7–4.9 s with the spares made at open (which
// the fallocates pace). More threads were not tried in the engine.
const DefaultIdleRegistrars = 1

// fileLimit bounds want by what one file costs besides its pages: the
// registrar keeps a descriptor (at most a quarter of the descriptor
// limit) and a mapping (at most a quarter of vm.max_map_count, which the
// Go runtime and the engine's mappings need too).
func fileLimit(want int) int {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err == nil && lim.Cur < uint64(4*want) {
		want = int(lim.Cur / 4)
	}
	if b, err := os.ReadFile("/proc/sys/vm/max_map_count"); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && n/4 < want {
			want = n / 4
		}
	}
	return want
}

// identify returns f's identity and whether it is a linked regular file
// with a generation (a file without one is never registered: its inode
// number alone could name another file by the time a job finds it).
func identify(f fsys.File) (fileID, bool) { return identifyFrom(f, 1) }

// identifyFrom is identify for files of least bytes or more: a smaller
// one is not identified, and costs one fstat (no file handle asked for).
func identifyFrom(f fsys.File, least int64) (fileID, bool) {
	var st unix.Stat_t
	fd := int(f.Fd())
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || st.Nlink == 0 || st.Size < max(least, 1) {
		return fileID{}, false
	}
	id := fileID{fsys.FileIDOf(fd, &st), st.Size}
	return id, id.Gen != ""
}

// acquire returns the registered file id whose mapping holds the first
// end bytes, counted as in use, or nil. A registered file under id's key
// that is not id (another file with a recycled inode number, or this one
// resized) is dropped.
func (g *files) acquire(id fileID, end int64) *regFile {
	g.mu.Lock()
	rf := g.byKey[id.key()]
	switch {
	case rf == nil || g.stopped:
		g.mu.Unlock()
		return nil
	case rf.id != id:
		release := g.dropLocked(rf) && g.claimLocked(rf)
		g.mu.Unlock()
		if release {
			g.releaseNow(rf)
		}
		return nil
	case int64(len(rf.mem)) < end:
		g.mu.Unlock()
		return nil
	}
	rf.refs++
	rf.used = time.Now()
	g.lru.MoveToFront(rf.elem)
	g.mu.Unlock()
	return rf
}

// put ends a job's use of rf, counting a successful job a store or a
// load, and releases rf if it was dropped meanwhile (unless close
// released it: a job ends its use after Close too).
func (g *files) put(rf *regFile, write, ok bool) {
	g.mu.Lock()
	switch {
	case ok && write:
		g.st.Stores++
	case ok:
		g.st.Loads++
	}
	rf.refs--
	release := rf.refs == 0 && rf.gone && g.claimLocked(rf)
	g.mu.Unlock()
	if release {
		g.releaseNow(rf)
	}
}

// offer hands f to the registrar, unless it is registered or queued
// already, the mover is closing, or the queue is full. A warm offer (a
// file no job of this mover moved yet: Mover.Warm) is taken only below
// the bound: it never takes a place a job's file holds or is promised
// (admitLocked), and is counted in FileStats.Warmed once queued. A file
// forgotten while a job on it ran (expectOffer), or unlinked since the
// caller read its identity, is not offered: its descriptor would keep
// the removed file's pages. offer reports whether the registrar would
// take another warm offer.
func (g *files) offer(f fsys.File, id fileID, warm bool) bool {
	g.mu.Lock()
	switch {
	case g.stopped || g.limit == 0: // closing, or no registrar (run): registered files are off
		g.mu.Unlock()
		return false
	case g.queued[id.key()] != nil || g.byKey[id.key()] != nil || g.forgottenLocked(id.FileID):
		more := g.belowBoundLocked()
		g.mu.Unlock()
		return more
	}
	admit := g.belowBoundLocked()
	if !warm {
		admit = g.admitLocked(id.FileID)
	}
	if !admit {
		g.mu.Unlock()
		return false
	}
	o := &offer{id: id, fd: -1}
	g.queued[id.key()] = o
	g.mu.Unlock()
	// A descriptor of its own, read-write (a store's file is open
	// write-only, which cannot be mapped shared): the registrar maps it
	// later, and sweeps it while it is registered.
	fd, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", f.Fd()), unix.O_RDWR|unix.O_CLOEXEC, 0)
	// Unlinked since the caller read its identity: the engine forgot it
	// before it was queued (a Forget from now on finds it), or someone
	// else removed it.
	var st unix.Stat_t
	linked := err == nil && unix.Fstat(fd, &st) == nil && st.Nlink > 0
	g.mu.Lock()
	mine := g.queued[id.key()] == o // not forgotten, nor the mover closed, meanwhile
	if err == nil && mine && linked && !g.stopped {
		select {
		case g.offers <- o:
			o.fd = fd
			if warm {
				g.st.Warmed++
			}
			more := g.belowBoundLocked()
			g.mu.Unlock()
			return more
		default:
		}
	}
	if mine {
		delete(g.queued, id.key())
	}
	// The queue is full, or the file cannot be reopened; or the file was
	// removed, which leaves room for another.
	more := err == nil && (!mine || !linked) && g.belowBoundLocked()
	warn := err != nil && !g.warned
	g.warned = g.warned || warn
	g.mu.Unlock()
	if err == nil {
		unix.Close(fd)
	} else if warn {
		g.log.Warn("gpu: a file could not be reopened for registration: its jobs move through the pinned buffers (logged once)", "err", err)
	}
	return more
}

// expectOffer records that a job starting on the file id will offer it
// when it ends, and endExpected that the job ended, after its offer: a
// file forgotten in between is not offered, by that job nor by any other
// on the same file (the same identity, generation included) while one of
// them runs. A file that got the forgotten file's inode number is
// another file: its jobs offer it. The engine removes a file while a load of it
// runs (a client's delete or a store of the same key: the load holds
// the key, not the name); the job's offer after that Forget would
// reopen the removed file, and no Forget would come to close it.
func (g *files) expectOffer(id fileID) {
	key := id.FileID
	g.mu.Lock()
	p := g.pending[key]
	p.jobs++
	g.pending[key] = p
	g.mu.Unlock()
}

// endExpected ends a job's expectOffer.
func (g *files) endExpected(id fileID) {
	key := id.FileID
	g.mu.Lock()
	p := g.pending[key]
	if p.jobs--; p.jobs == 0 {
		delete(g.pending, key)
	} else {
		g.pending[key] = p
	}
	g.mu.Unlock()
}

// forgottenLocked reports whether the file id (its identity, generation
// included) was forgotten while a job in flight on it ran (expectOffer).
func (g *files) forgottenLocked(id fsys.FileID) bool {
	return g.pending[id].forgotten
}

// belowBoundLocked reports whether the files registered and queued are
// fewer than the bound: a file offered now takes no other's place.
func (g *files) belowBoundLocked() bool {
	return !g.stopped && len(g.byKey)+len(g.queued) < g.limit && (g.limitBytes <= 0 || g.bytes < g.limitBytes)
}

// admitLocked reports whether a file offered now should be registered.
// Below the bound, every file is. At the bound a file takes another's
// place only at its second offer since the bound was reached (the first
// is remembered in seen, itself bounded): in a cache of many more files
// than the bound, files used once would otherwise cost a registration
// and an unregistration each and save nothing.
func (g *files) admitLocked(id fsys.FileID) bool {
	if len(g.byKey)+len(g.queued) < g.limit {
		return true
	}
	if g.seen[id] {
		delete(g.seen, id)
		return true
	}
	if len(g.seen) >= g.limit {
		clear(g.seen)
	}
	g.seen[id] = true
	g.st.Deferred++
	return false
}

// forget drops what is kept under id's device and inode number, of any
// generation (transfer.Forgetter): no job takes its mapping from now on,
// and it is released now, or when the last job using it ends; a waiting
// offer's descriptor is closed now, an offer the registrar has taken is
// released as soon as its registration ends (register), and the jobs on
// it in flight do not offer it. A job that begins later on another file with that number
// (another generation) offers its own file.
func (g *files) forget(id fsys.FileID) {
	key := id.Inode()
	g.mu.Lock()
	for pid, p := range g.pending { // the files of the jobs in flight
		if pid.Inode() == key && !p.forgotten {
			p.forgotten = true
			g.pending[pid] = p
		}
	}
	fd := -1
	if o := g.queued[key]; o != nil {
		if o.taken {
			o.forgotten = true
		} else { // waiting: its descriptor goes now, and the file's pages with it
			delete(g.queued, key)
			fd, o.fd = o.fd, -1
		}
	}
	rf := g.byKey[key]
	release := rf != nil && g.dropLocked(rf) && g.claimLocked(rf)
	g.mu.Unlock()
	if fd >= 0 {
		unix.Close(fd)
	}
	if release {
		g.releaseNow(rf)
	}
}

// dropLocked removes rf from the index and reports whether the caller
// must release it now (no job uses it; else the last put does).
func (g *files) dropLocked(rf *regFile) bool {
	delete(g.byKey, rf.id.key())
	g.lru.Remove(rf.elem)
	g.bytes -= int64(len(rf.mem))
	rf.gone = true
	return rf.refs == 0
}

// claimLocked claims rf's release for the caller, who must then call
// releaseNow: false where it was claimed already (close releases files
// jobs still hold).
func (g *files) claimLocked(rf *regFile) bool {
	if _, ok := g.live[rf]; !ok {
		return false
	}
	delete(g.live, rf)
	g.busy++
	return true
}

// releaseNow unregisters, unmaps and closes rf, whose release the caller
// claimed, on the calling goroutine (its thread locked, with the device
// current, for the unregistration): the memory goes back before the
// caller goes on (an engine that removes a file counts its space as
// free).
func (g *files) releaseNow(rf *regFile) {
	if unlock, err := g.m.r.LockDevice(g.device); err != nil {
		g.log.Debug("gpu: unregister a file", "err", err)
	} else {
		if err := g.m.r.HostUnregister(rf.mem); err != nil {
			g.log.Debug("gpu: unregister a file", "err", err)
		}
		unlock()
	}
	unix.Munmap(rf.mem)
	unix.Close(rf.fd)
	g.mu.Lock()
	g.st.Released++
	if g.busy--; g.busy == 0 {
		g.idle.Broadcast()
	}
	g.mu.Unlock()
}

// stats returns the registered files' counts.
func (g *files) stats() FileStats {
	g.mu.Lock()
	defer g.mu.Unlock()
	st := g.st
	st.Files, st.Bytes, st.Limit, st.LimitBytes, st.Queued = len(g.byKey), g.bytes, g.limit, g.limitBytes, len(g.queued)
	return st
}

// close stops the registrar, releases every registered file, those jobs
// still hold included, and waits for the releases under way elsewhere (a
// job's, Forget's): afterwards nothing calls CUDA, and the runtime may be
// unloaded. The mover is closed and no job runs on a lane, where alone
// jobs touch a mapping: a job holding a file only ends its use (put),
// which then has nothing to release; no job takes a mapping any more.
func (g *files) close() {
	g.mu.Lock()
	g.stopped = true // a job's offer after this finds no registrar
	g.mu.Unlock()
	close(g.stop)
	<-g.done
	g.mu.Lock()
	var fds []int
	for _, o := range g.queued { // the registrar has stopped: none is taken
		if o.fd >= 0 {
			fds = append(fds, o.fd)
			o.fd = -1
		}
	}
	clear(g.queued)
	for _, rf := range g.byKey {
		g.dropLocked(rf)
	}
	rel := make([]*regFile, 0, len(g.live))
	for rf := range g.live {
		g.claimLocked(rf)
		rel = append(rel, rf)
	}
	g.mu.Unlock()
	for _, fd := range fds {
		unix.Close(fd)
	}
	for _, rf := range rel {
		g.releaseNow(rf)
	}
	g.mu.Lock()
	for g.busy > 0 {
		g.idle.Wait()
	}
	g.mu.Unlock()
}

// run is the registrar: on its own thread, with the device current, it
// registers the files offered and sweeps for unlinked or resized ones.
// It calls ready once the device is current, or, where it cannot be
// made current, once the limit is 0, which turns registration off: no
// offer is taken from then on (offer), and the registrar ends.
func (g *files) run(sweeper bool, ready func()) {
	unlock, err := g.m.r.LockDevice(g.device)
	if err != nil {
		g.log.Warn("gpu: registered files off: no thread for device", "device", g.device, "err", err)
		g.mu.Lock()
		g.limit = 0
		g.mu.Unlock()
		ready()
		return
	}
	defer unlock()
	ready()
	var sweep <-chan time.Time // one registrar sweeps
	if sweeper {
		tick := time.NewTicker(g.sweep)
		defer tick.Stop()
		sweep = tick.C
	}
	for {
		select {
		case <-g.stop:
			return // close closes the offers' descriptors
		case o := <-g.offers:
			g.register(o)
		case <-sweep:
			g.sweepStale()
		}
	}
}

// runIdle is an idle registrar: on its own thread, with the device
// current, it registers offered files beside the registrar, but takes an
// offer only while the mover runs no job (Config.IdleRegistrars). A job
// that starts while it registers a file runs beside that one
// registration; it takes no other until the mover is idle again.
func (g *files) runIdle(ready func()) {
	unlock, err := g.m.r.LockDevice(g.device)
	ready()
	if err != nil {
		g.log.Warn("gpu: an idle registrar has no thread for the device: files are registered by the registrar alone", "device", g.device, "err", err)
		return
	}
	defer unlock()
	for {
		idle, _ := g.m.act.signals()
		g.idleParked.Add(1)
		select {
		case <-g.stop:
			g.idleParked.Add(-1)
			return
		case <-idle:
		}
		g.idleParked.Add(-1)
		_, busy := g.m.act.signals()
		select {
		case <-g.stop:
			return
		case <-busy: // a job started: wait for the next idle moment
		case o := <-g.offers:
			if g.idleTook != nil {
				g.idleTook()
			}
			if g.m.act.jobs() > 0 {
				// A job started as the offer came: leave it to the
				// registrar, unless the queue filled meanwhile.
				select {
				case g.offers <- o:
					continue
				default:
				}
			}
			g.register(o)
		}
	}
}

// roomLocked reports whether o's file is to be registered now, and
// which registered files it would replace: none where there is room (the
// files registered never outnumber the limit, nor their bytes the byte
// limit), else the least recently used ones that no job uses and that
// have gone unused for minIdle, as many as make room. A file already
// registered, or one for which the idle files cannot make room, is not
// wanted.
func (g *files) roomLocked(o *offer) (wanted bool, victims []*regFile) {
	if g.byKey[o.id.key()] != nil || g.limit == 0 || (g.limitBytes > 0 && o.id.size > g.limitBytes) {
		return false, nil
	}
	count := len(g.byKey) + g.registering
	if count < g.limit && g.fitsLocked(o.id.size, 0) {
		return true, nil
	}
	idle := time.Now().Add(-g.minIdle)
	var freed int64
	for e := g.lru.Back(); e != nil; e = e.Prev() {
		rf := e.Value.(*regFile)
		if rf.refs != 0 || !rf.used.Before(idle) {
			continue
		}
		victims = append(victims, rf)
		freed += int64(len(rf.mem))
		if count-len(victims) < g.limit && g.fitsLocked(o.id.size, freed) {
			return true, victims
		}
	}
	return false, nil
}

// fitsLocked reports whether size more bytes fit the byte limit once
// freed bytes are released.
func (g *files) fitsLocked(size, freed int64) bool {
	return g.limitBytes <= 0 || g.bytes+g.registeringBytes-freed+size <= g.limitBytes
}

// beginStream counts a job moving a memory-mount file through the pinned
// buffers (a store or a load of a file not registered), until endStream.
func (g *files) beginStream() { g.streaming.Add(1) }

// endStream ends a job counted by beginStream.
func (g *files) endStream() {
	if g.streaming.Add(-1) == 0 {
		select {
		case g.streamEnded <- struct{}{}:
		default:
		}
	}
}

// awaitStreams waits, before a registration, while jobs move memory-mount
// files through the pinned buffers: until they stop,
// or for at most streamShare-1 times the last registration's duration
// (see streamShare). It reports false if the mover closed meanwhile.
func (g *files) awaitStreams() bool {
	if g.streaming.Load() == 0 {
		return true
	}
	start := time.Now()
	timer := time.NewTimer(min(g.waitCap, (streamShare-1)*time.Duration(g.lastReg.Load())))
	defer timer.Stop()
	g.mu.Lock()
	g.st.Waits++
	g.mu.Unlock()
	defer func() {
		g.mu.Lock()
		g.st.Waited += time.Since(start)
		g.mu.Unlock()
	}()
	for g.streaming.Load() > 0 {
		select {
		case <-g.stop:
			return false
		case <-timer.C:
			return true
		case <-g.streamEnded: // maybe a stale token: the loop checks again
		}
	}
	return true
}

// register maps and registers an offered file, making room among the
// least recently used files first, once stores through the pinned
// buffers let it (awaitStreams).
func (g *files) register(o *offer) {
	// An offer that will not be registered is not worth a wait.
	g.mu.Lock()
	wait := g.queued[o.id.key()] == o
	if wait {
		wait, _ = g.roomLocked(o)
	}
	g.mu.Unlock()
	if wait && !g.awaitStreams() {
		return // closing: close closes the offer's descriptor
	}
	g.mu.Lock()
	if g.queued[o.id.key()] != o { // forgotten (its descriptor closed) or replaced
		g.mu.Unlock()
		return
	}
	wanted, victims := g.roomLocked(o)
	var release []*regFile
	for _, rf := range victims {
		g.dropLocked(rf) // released below, outside the lock; no job uses it
		if g.claimLocked(rf) {
			release = append(release, rf)
		}
	}
	fd := o.fd
	if wanted {
		o.taken = true
		g.registering++
		g.registeringBytes += o.id.size
	} else {
		delete(g.queued, o.id.key())
		o.fd = -1
	}
	g.mu.Unlock()
	for _, rf := range release {
		g.releaseNow(rf)
	}
	if !wanted {
		unix.Close(fd)
		return
	}
	start := time.Now()
	rf, err := g.mapAndRegister(o)
	if err == nil {
		g.lastReg.Store(int64(time.Since(start)))
	}
	g.mu.Lock()
	g.registering--
	g.registeringBytes -= o.id.size
	// Forgotten while it was being registered: released at once, never
	// used.
	forgotten := o.forgotten
	delete(g.queued, o.id.key())
	o.fd = -1 // closed below, or the registered file's now
	switch {
	case errors.Is(err, errGone):
		g.mu.Unlock()
		unix.Close(fd)
	case err != nil:
		g.st.Failed++
		warn := !g.warned
		g.warned = true
		g.mu.Unlock()
		unix.Close(fd)
		if warn {
			g.log.Warn("gpu: a file could not be registered: its jobs move through the pinned buffers (logged once)", "err", err)
		}
	case forgotten:
		g.st.Registered++
		g.busy++ // a release as claimed ones are (never live)
		g.mu.Unlock()
		g.releaseNow(rf)
	default:
		g.st.Registered++
		g.live[rf] = struct{}{}
		rf.used = time.Now()
		rf.elem = g.lru.PushFront(rf)
		g.byKey[o.id.key()] = rf
		g.bytes += int64(len(rf.mem))
		g.mu.Unlock()
	}
}

// mapAndRegister maps the offered file whole, shared, and registers the
// mapping; errGone where the file is no longer the one offered.
func (g *files) mapAndRegister(o *offer) (*regFile, error) {
	var st unix.Stat_t
	if err := unix.Fstat(o.fd, &st); err != nil {
		return nil, fmt.Errorf("gpu: stat a file to register: %w", err)
	}
	if fsys.Generation(o.fd) != o.id.Gen || st.Nlink == 0 || st.Size != o.id.size {
		return nil, errGone
	}
	mem, err := unix.Mmap(o.fd, 0, int(st.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("gpu: map a file of %d bytes: %w", st.Size, err)
	}
	if err := g.m.r.HostRegister(mem); err != nil {
		unix.Munmap(mem)
		return nil, fmt.Errorf("gpu: register a file of %d bytes: %w", st.Size, err)
	}
	return &regFile{id: o.id, fd: o.fd, mem: mem}, nil
}

// sweepStale drops the registered files that no name links any more, or
// whose size changed (truncated by someone else: their mapping may hold
// pages no longer in the file).
func (g *files) sweepStale() {
	g.mu.Lock()
	all := make([]*regFile, 0, len(g.byKey))
	for _, rf := range g.byKey {
		all = append(all, rf)
	}
	g.mu.Unlock()
	for _, rf := range all {
		var st unix.Stat_t
		if err := unix.Fstat(rf.fd, &st); err == nil && st.Nlink > 0 && st.Size == int64(len(rf.mem)) {
			continue
		}
		g.mu.Lock()
		release := g.byKey[rf.id.key()] == rf && g.dropLocked(rf) && g.claimLocked(rf)
		g.mu.Unlock()
		if release {
			g.releaseNow(rf)
		}
	}
}

// sumAfterCopy reports whether a load of a registered file of the given
// chunks checksums them after its copies rather than while they run: a
// file of one chunk, while other jobs are in flight (RATIONALE: "Why
// does a load of a small registered file checksum its bytes after their
// copy?"). A lone load checksums beside its copy, which then overlaps it.
func (m *Mover) sumAfterCopy(chunks int) bool {
	return chunks == 1 && m.act.jobs() > 1 && !m.sumsBesideLoad
}

// runMapped moves the plan's chunks between the device and mem, a
// registered mapping of its file, with DMA copies on a lane of dev (never
// the copy kernel) and no pinned buffer. A store keeps up to Config.Depth
// chunks' copies in flight and checksums each chunk's file bytes as soon
// as its copies are done, while the next ones run. A load enqueues all
// its copies at once; a file of several chunks is checksummed while they
// run, a file of one chunk only after them while other jobs are in
// flight (sumAfterCopy). With checksums on the device the checksum
// kernel runs once, before a store's copies or after a load's, and the
// CPU reads no byte.
func (m *Mover) runMapped(ctx context.Context, mem []byte, p *transfer.Plan, chunks []chunk, dev *device, sums []uint32, write bool) (int64, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	return m.onLane(dev, func(ln *lane) (total int64, err error) {
		base := uintptr(unsafe.Pointer(unsafe.SliceData(mem)))
		d := len(ln.events)
		run := m.startRun(ctx, dev, ln, d)
		cpuSums, onDevice := m.sumsWhere(dev, ln, chunks, sums)
		defer func() {
			if werr := run.finish(); err == nil && werr != nil {
				total, err = 0, werr
			}
			if err == nil {
				m.countSums(chunks, sums, onDevice)
			}
		}()
		wait := run.wait
		y := staging.Yielder{Every: m.cfg.YieldBytes, Yield: m.yieldHook}
		var cp cuda.Copies
		// enqueue enqueues chunks [from, to), then (sum) the checksum
		// kernel, and records event s after them.
		enqueue := func(from, to, s int, sum bool) error {
			defer trace.StartRegion(ctx, "gpu: enqueue").End()
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
			eerr := m.r.Enqueue(&cp, !write, m.fallback, ln.stream)
			if eerr == nil && sum {
				eerr = ln.sums.launch(dev, ln)
			}
			return run.recorded(s, eerr)
		}
		// sumChunk folds chunk k's file bytes into their checksum slots
		// (unless the device checksums them), piece by piece (the yields'
		// granularity), and counts the chunk.
		sumChunk := func(k int) error {
			c := &chunks[k]
			n := int(c.end - c.off)
			if cpuSums != nil {
				defer trace.StartRegion(ctx, "gpu: checksum").End()
				if err := region.Guard(func() error {
					for lo := 0; lo < n; lo += fuseBatch {
						hi := min(n, lo+fuseBatch)
						sum(c, mem[c.off:c.end:c.end], 0, lo, hi, cpuSums)
						y.Moved(int64(hi - lo))
					}
					return nil
				}); err != nil {
					return fmt.Errorf("gpu: registered file: %w", err)
				}
			}
			total += int64(n)
			return nil
		}
		if end := p.End(); write && p.Direct {
			// As writeChunk: a direct plan ending inside a block is written
			// to the block's end, the tail as zeros.
			if err := region.Guard(func() error {
				clear(mem[end:min(int64(len(mem)), (end+align-1)/align*align)])
				return nil
			}); err != nil {
				return 0, fmt.Errorf("gpu: registered file: %w", err)
			}
		}
		if !write {
			// With checksums on the device, the kernel runs after every
			// copy, over the bytes that arrived.
			if err := enqueue(0, len(chunks), 0, onDevice); err != nil {
				return 0, err
			}
			if onDevice || cpuSums != nil && m.sumAfterCopy(len(chunks)) {
				if err := wait(0); err != nil {
					return 0, err
				}
			}
			for k := range chunks {
				if err := sumChunk(k); err != nil {
					return 0, err
				}
			}
			if onDevice {
				ln.sums.fold(sums)
			}
			return total, nil // the deferred wait reports the copies' errors
		}
		if onDevice {
			// Before the copies, on the same stream: the kernel reads the
			// bytes the store takes, and is done by chunk 0's event.
			if err := run.called(ln.sums.launch(dev, ln)); err != nil {
				return 0, err
			}
		}
		for k := range min(d, len(chunks)) {
			if err := enqueue(k, k+1, k, false); err != nil {
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
				if err := enqueue(k+d, k+d+1, s, false); err != nil {
					return 0, err
				}
			}
			if err := sumChunk(k); err != nil {
				return 0, err
			}
		}
		if onDevice {
			ln.sums.fold(sums)
		}
		return total, nil
	})
}
