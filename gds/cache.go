package gds

import (
	"container/list"
	"errors"
	"fmt"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/fsys"
)

// handleKey names a cached handle: the file (fsys.FileID, with its
// generation) and the access mode of the descriptor it was registered
// with (O_ACCMODE and O_DIRECT), since a handle of a read-only descriptor
// cannot write.
type handleKey struct {
	fsys.FileID
	mode int
}

// slot is the key's place in the cache: the key without its generation.
// One handle per inode number and mode is cached; an acquisition that
// finds another generation in the slot (the number now names another
// file) drops it and registers its own file.
func (k handleKey) slot() handleKey { return handleKey{k.FileID.Inode(), k.mode} }

// handleModes are the access modes a handle can have, for Forget.
var handleModes = [...]int{
	unix.O_RDONLY, unix.O_WRONLY, unix.O_RDWR,
	unix.O_RDONLY | unix.O_DIRECT, unix.O_WRONLY | unix.O_DIRECT, unix.O_RDWR | unix.O_DIRECT,
}

// handle is a registered cuFile handle over the cache's own duplicate of
// the engine's descriptor, so that it stays valid after the engine closes
// its descriptor.
type handle struct {
	key   handleKey
	fd    int     // the cache's duplicate descriptor
	h     uintptr // CUfileHandle_t
	refs  int
	ready chan struct{} // closed once registration finished
	err   error         // registration's error, set before ready closes
	stale bool          // forgotten: deregister when refs reach zero
	elem  *list.Element // in lru while refs == 0 and cached
}

// HandleStats counts the handle cache's work.
type HandleStats struct {
	Cached        int    // handles registered now
	Registrations uint64 // cuFileHandleRegister calls that succeeded
	Failures      uint64 // cuFileHandleRegister calls that failed
	Hits          uint64 // acquisitions served from the cache
	Evictions     uint64 // unreferenced handles deregistered to keep the bound
	Forgotten     uint64 // handles dropped by Forget
	Reused        uint64 // handles dropped because their inode number now names another file (another generation)
	Unlinked      uint64 // unreferenced handles dropped because no name links their file (removed by another node)
}

// sweepEvery is how often, at most, a registration first drops the
// cached handles of files that no name links any more. Another node on a
// shared mount can remove a file this engine never forgets; the cache's
// descriptor would keep its blocks allocated until evicted. One sweeper
// runs at a time: a sweep due while it runs is left to it, to run once
// more when it is done. On a network file system that stopped answering
// its fstat hangs, and registrations then add no goroutine behind it
// (RATIONALE: "Why does one sweeper at a time look for unlinked files?").
const sweepEvery = time.Second

// handleCache is a refcounted cache of cuFile handles keyed by file
// identity, with an LRU list over the handles no transfer holds, bounded
// by max. A held handle is never deregistered.
type handleCache struct {
	api api
	max int
	// onThread runs a cuFile call on a thread locked to a device, as every
	// cuFile call is made: deregistration can come from any goroutine
	// (the last release, Forget, Close).
	onThread func(func() error) error

	mu  sync.Mutex
	m   map[handleKey]*handle // by handleKey.slot
	lru list.List             // of *handle, front = most recently released
	st  HandleStats
	// live is every registered handle not yet claimed for deregistration,
	// in the cache or not (a held handle that was forgotten): close
	// deregisters them all. busy counts the cuFile work close waits for:
	// registrations under way, claimed deregistrations not yet done, and
	// calls made through enter (a mount's probe); idle is signalled when
	// it falls to zero. Once closed, nothing calls cuFile (acquire and
	// enter refuse, and every registration is gone).
	live   map[*handle]struct{}
	busy   int
	idle   sync.Cond
	closed bool
	// sweepEvery is the constant of that name (a field for tests),
	// lastSweep when a registration last asked for a sweep, sweeping
	// whether the sweeper runs, and again whether a sweep was asked for
	// while it ran (guarded by mu).
	sweepEvery time.Duration
	lastSweep  time.Time
	sweeping   bool
	again      bool
	// fstat is unix.Fstat (a field for tests, which inject a file system
	// that reuses inode numbers or hangs).
	fstat func(fd int, st *unix.Stat_t) error
}

func newHandleCache(a api, max int) *handleCache {
	c := &handleCache{api: a, max: max, m: map[handleKey]*handle{}, live: map[*handle]struct{}{},
		onThread: func(f func() error) error { return f() }, sweepEvery: sweepEvery, fstat: unix.Fstat}
	c.idle.L = &c.mu
	return c
}

// identify returns the key of the file open at fd.
func (c *handleCache) identify(fd int) (handleKey, error) {
	var st unix.Stat_t
	if err := c.fstat(fd, &st); err != nil {
		return handleKey{}, fmt.Errorf("gds: fstat fd %d: %w", fd, err)
	}
	fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	if err != nil {
		return handleKey{}, fmt.Errorf("gds: fcntl fd %d: %w", fd, err)
	}
	return handleKey{fsys.FileIDOf(fd, &st), fl & (unix.O_ACCMODE | unix.O_DIRECT)}, nil
}

// acquire returns the registered handle of the file open at fd (whose key
// the caller computed with identify), registering it on a miss. A cached
// handle of another generation under the key's inode number is dropped
// first: it is another file's. The caller must be on a thread bound to
// the device, and must release the handle.
func (c *handleCache) acquire(fd int, key handleKey) (*handle, error) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, errClosed
	}
	slot := key.slot()
	var victims []*handle
	if e, ok := c.m[slot]; ok && e.key != key {
		c.st.Reused++
		victims = c.dropLocked(slot, e, victims)
	} else if ok {
		e.refs++
		if e.elem != nil {
			c.lru.Remove(e.elem)
			e.elem = nil
		}
		c.st.Hits++
		c.mu.Unlock()
		<-e.ready
		if e.err != nil {
			c.release(e)
			return nil, e.err
		}
		return e, nil
	}
	e := &handle{key: key, fd: -1, refs: 1, ready: make(chan struct{})}
	c.m[slot] = e
	c.busy++ // the registration, until it is recorded below
	sweep := false
	if time.Since(c.lastSweep) >= c.sweepEvery {
		c.lastSweep = time.Now()
		sweep = !c.sweeping
		c.sweeping = true
		c.again = !sweep
	}
	c.mu.Unlock()
	c.deregister(victims)

	if sweep {
		// In the background: the caller is a transfer (on a worker
		// bound to its device), and on a network file system each fstat
		// may ask the server, or hang.
		go c.sweeper()
	}
	e.err = c.register(e, fd)

	c.mu.Lock()
	victims = nil
	switch {
	case e.err != nil:
		c.st.Failures++
		if c.m[slot] == e {
			delete(c.m, slot)
		}
		e.stale = true
		c.doneLocked(1)
	case c.closed:
		// Closed while registering: deregistered at once (busy counts
		// it until then), never used.
		c.st.Registrations++
		e.stale = true
		e.err = errClosed
		victims = append(victims, e)
	default:
		c.st.Registrations++
		c.live[e] = struct{}{}
		c.doneLocked(1)
	}
	c.mu.Unlock()
	close(e.ready)
	c.deregister(victims)
	if e.err != nil {
		c.release(e)
		return nil, e.err
	}
	return e, nil
}

// register duplicates fd, checks that the duplicate is the keyed file, and
// registers it with cuFile.
func (c *handleCache) register(e *handle, fd int) error {
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("gds: dup fd %d: %w", fd, err)
	}
	if k, err := c.identify(dup); err != nil || k != e.key {
		unix.Close(dup)
		if err != nil {
			return err
		}
		return fmt.Errorf("gds: fd %d changed file while registering (%v, want %v)", fd, k, e.key)
	}
	h, err := c.api.handleRegister(dup)
	if err != nil {
		unix.Close(dup)
		return fmt.Errorf("gds: cuFileHandleRegister (dev %d:%d ino %d): %w",
			unix.Major(e.key.Dev), unix.Minor(e.key.Dev), e.key.Ino, err)
	}
	e.fd, e.h = dup, h
	return nil
}

// release drops a reference; the last one of a forgotten handle
// deregisters it, others put it on the LRU list and evict past the bound.
func (c *handleCache) release(e *handle) {
	var victims []*handle
	c.mu.Lock()
	e.refs--
	if e.refs < 0 {
		c.mu.Unlock()
		panic("gds: handle released more often than acquired")
	}
	if e.refs == 0 {
		if e.stale {
			if c.claimLocked(e) {
				victims = append(victims, e)
			}
		} else {
			e.elem = c.lru.PushFront(e)
			victims = c.evictLocked()
		}
	}
	c.mu.Unlock()
	c.deregister(victims)
}

// evictLocked removes unreferenced handles, least recently released
// first, until at most max are cached. Referenced handles are not on the
// list and so never evicted.
func (c *handleCache) evictLocked() []*handle {
	var victims []*handle
	for len(c.m) > c.max && c.lru.Len() > 0 {
		e := c.lru.Remove(c.lru.Back()).(*handle)
		e.elem = nil
		delete(c.m, e.key.slot())
		c.st.Evictions++
		if c.claimLocked(e) {
			victims = append(victims, e)
		}
	}
	return victims
}

// claimLocked claims e's deregistration for the caller, who must pass it
// to deregister: false if it was claimed already (close deregisters held
// handles too) or never registered. c.mu is held.
func (c *handleCache) claimLocked(e *handle) bool {
	if _, ok := c.live[e]; !ok {
		return false
	}
	delete(c.live, e)
	c.busy++
	return true
}

// doneLocked ends n units of busy work. c.mu is held.
func (c *handleCache) doneLocked(n int) {
	c.busy -= n
	if c.busy == 0 {
		c.idle.Broadcast()
	}
}

// enter counts a cuFile call made outside the cache (a mount's probe) as
// busy, so that close waits for it; false once closed: the call must not
// be made. The caller calls exit after the call.
func (c *handleCache) enter() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return false
	}
	c.busy++
	return true
}

// exit ends a call counted by enter.
func (c *handleCache) exit() {
	c.mu.Lock()
	c.doneLocked(1)
	c.mu.Unlock()
}

// deregister deregisters handles no one can reach any more, each claimed
// (claimLocked) by the caller.
func (c *handleCache) deregister(hs []*handle) {
	if len(hs) == 0 {
		return
	}
	defer func() {
		c.mu.Lock()
		c.doneLocked(len(hs))
		c.mu.Unlock()
	}()
	for _, e := range hs {
		if e.h != 0 {
			h := e.h
			if err := c.onThread(func() error { c.api.handleDeregister(h); return nil }); err != nil {
				// The thread could not be bound to the device: deregister
				// here rather than leave a registration over a closed
				// descriptor.
				c.api.handleDeregister(h)
			}
			e.h = 0
		}
		if e.fd >= 0 {
			unix.Close(e.fd)
			e.fd = -1
		}
	}
}

// forget drops every handle of the file's inode number, of any
// generation; held ones are deregistered when released.
func (c *handleCache) forget(id fsys.FileID) {
	var victims []*handle
	c.mu.Lock()
	for _, mode := range handleModes {
		k := handleKey{id.Inode(), mode}
		e, ok := c.m[k]
		if !ok {
			continue
		}
		c.st.Forgotten++
		victims = c.dropLocked(k, e, victims)
	}
	c.mu.Unlock()
	c.deregister(victims)
}

// sweeper sweeps (dropUnlinked) until no sweep was asked for while it
// ran: the cache's one sweeping goroutine.
func (c *handleCache) sweeper() {
	for {
		c.dropUnlinked()
		c.mu.Lock()
		if !c.again || c.closed {
			c.sweeping = false
			c.mu.Unlock()
			return
		}
		c.again = false
		c.mu.Unlock()
	}
}

// dropUnlinked deregisters the unreferenced cached handles whose file no
// name links any more (st_nlink 0, or ESTALE on a network file system,
// where another node removed it). The descriptors are checked without
// the lock: a handle evicted meanwhile is no longer in the cache when the
// lock is taken again, and is skipped (its descriptor may have been closed
// and reused under the check).
func (c *handleCache) dropUnlinked() {
	type idle struct {
		e  *handle
		fd int
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	idles := make([]idle, 0, c.lru.Len())
	for el := c.lru.Front(); el != nil; el = el.Next() {
		e := el.Value.(*handle)
		idles = append(idles, idle{e, e.fd})
	}
	c.mu.Unlock()
	var gone []*handle
	for _, x := range idles {
		var st unix.Stat_t
		if err := c.fstat(x.fd, &st); errors.Is(err, unix.ESTALE) || err == nil && st.Nlink == 0 {
			gone = append(gone, x.e)
		}
	}
	if len(gone) == 0 {
		return
	}
	var victims []*handle
	c.mu.Lock()
	for _, e := range gone {
		if k := e.key.slot(); c.m[k] == e && e.refs == 0 && e.elem != nil {
			victims = c.dropLocked(k, e, victims)
			c.st.Unlinked++
		}
	}
	c.mu.Unlock()
	c.deregister(victims)
}

// close deregisters every registered handle, held ones included, and
// waits for the cuFile work under way (registrations, deregistrations,
// probes): afterwards nothing calls cuFile, and the driver may be closed
// and the library unloaded. The caller has closed every mover first, so
// no transfer uses a held handle any more; its holder only releases it,
// which then deregisters nothing. Acquisitions fail with errClosed.
func (c *handleCache) close() {
	var victims []*handle
	c.mu.Lock()
	c.closed = true
	for k, e := range c.m {
		victims = c.dropLocked(k, e, victims)
	}
	for e := range c.live { // held ones, in the cache or forgotten
		e.stale = true
		if c.claimLocked(e) {
			victims = append(victims, e)
		}
	}
	c.mu.Unlock()
	c.deregister(victims)
	c.mu.Lock()
	for c.busy > 0 {
		c.idle.Wait()
	}
	c.mu.Unlock()
}

// dropLocked removes handle e (in slot k) from the cache and marks it stale:
// it is deregistered by the caller (appended to victims) if no transfer
// holds it, else when its last transfer releases it. c.mu is held.
func (c *handleCache) dropLocked(k handleKey, e *handle, victims []*handle) []*handle {
	delete(c.m, k)
	e.stale = true
	if e.refs == 0 {
		if e.elem != nil {
			c.lru.Remove(e.elem)
			e.elem = nil
		}
		if c.claimLocked(e) {
			victims = append(victims, e)
		}
	}
	return victims
}

func (c *handleCache) stats() HandleStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.st
	s.Cached = len(c.m)
	return s
}
