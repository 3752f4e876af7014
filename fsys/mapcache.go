package fsys

import (
	"container/list"
	"sync"
	"time"
)

// MapCache keeps read-only shared mappings of whole files for the reads
// that come back to them: a layer-wise load reads each file once per
// group of layers, one job each, within milliseconds. Each file is mapped
// at its first read and unmapped when the cache drops it, rather than
// mapped and unmapped by every job (MapForRead), whose munmap interrupts
// every CPU that runs the process's threads to flush its TLB.
//
// A mapping advised MADV_SEQUENTIAL leaves the pages' LRU state alone
// (see Mapping), so the first read of freshly written pages does not
// queue on the lock that read(2) takes to activate them.
//
// The cache keeps at most its limit of mappings (those it dropped while
// a reader held them are unmapped by the reader's release); one unused
// for its idle time is dropped by a timer, so that the pages of a file
// removed are given back at most that long after its last read. Forget
// drops a file the caller removes or replaces, and keeps a read that
// began before it from caching the file. A file truncated under its
// mapping fails the reads (ErrMapping), never the process.
type MapCache struct {
	limit int
	idle  time.Duration
	now   func() time.Time
	// unmap unmaps a mapping the cache dropped ((*Mapping).Close; tests
	// watch it).
	unmap func(*Mapping)

	mu     sync.Mutex
	byKey  map[FileID]*cachedMap // by FileID.Inode()
	lru    list.List             // *cachedMap, the most recently used first
	timer  *time.Timer           // the next sweep for idle mappings; nil: none armed
	closed bool
	// forgets counts the Forget calls by a hash of the inode number: a
	// read that mapped its file while one came does not cache it.
	forgets [64]uint64
}

// cachedMap is one file's mapping in a MapCache.
type cachedMap struct {
	id    FileID
	size  int64
	m     *Mapping
	refs  int       // readers using it now
	used  time.Time // the last release
	gone  bool      // dropped from the cache: unmapped at its last release
	where *list.Element
}

// NewMapCache returns a cache of at most limit mappings, each dropped
// once unused for idle.
func NewMapCache(limit int, idle time.Duration) *MapCache {
	return &MapCache{limit: limit, idle: idle, now: time.Now, byKey: map[FileID]*cachedMap{},
		unmap: func(m *Mapping) { m.Close() }}
}

// forgetSlot is key's counter in MapCache.forgets.
func forgetSlot(key FileID) int { return int((key.Dev*31 + key.Ino) % 64) }

// Read returns f with its reads (ReadAt, ReadvAt) served by the cache's
// mapping of the whole file, size bytes, whose identity is id: kept from
// an earlier read, or made now. release ends this use. It reports false
// (and f itself, a no-op release) where f cannot be mapped, or is
// shorter than size now, where the file was forgotten while it was
// mapped, the cache is closed, or every mapping it holds is in use: the
// caller reads f.
func (c *MapCache) Read(f File, id FileID, size int64) (src File, release func(), ok bool) {
	key := id.Inode()
	c.mu.Lock()
	if cm := c.byKey[key]; cm != nil && cm.id == id && cm.size == size && !c.closed {
		cm.refs++
		c.lru.MoveToFront(cm.where)
		c.mu.Unlock()
		return readThrough(f, cm.m), func() { c.release(cm) }, true
	}
	forgets := c.forgets[forgetSlot(key)]
	room := !c.closed && (c.lru.Len() < c.limit || c.oldestUnusedLocked() != nil)
	c.mu.Unlock()
	mf, isMapper := f.(Mapper)
	if !isMapper || size <= 0 || !room {
		return f, func() {}, false
	}
	m, err := mf.MapRead(size)
	if err != nil {
		return f, func() {}, false
	}
	var drop []*Mapping
	defer func() {
		for _, m := range drop {
			c.unmap(m)
		}
	}()
	if m.Len() < size {
		// Truncated since the caller's fstat: a mapping kept under size
		// would fail the reads that the file, written again, serves.
		drop = append(drop, m)
		return f, func() {}, false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed || c.forgets[forgetSlot(key)] != forgets {
		// Closed, or the file (or another of the slot's) forgotten while
		// it was mapped: the caller is removing or replacing it.
		drop = append(drop, m)
		return f, func() {}, false
	}
	cm := c.byKey[key]
	switch {
	case cm != nil && cm.id == id && cm.size == size:
		// Mapped by another reader meanwhile: share that one.
		drop = append(drop, m)
	case cm != nil:
		// Another file in the inode number's slot, or this one resized.
		drop = c.dropLocked(cm, drop)
		fallthrough
	default:
		for c.lru.Len() >= c.limit {
			victim := c.oldestUnusedLocked()
			if victim == nil { // every mapping is being read
				drop = append(drop, m)
				return f, func() {}, false
			}
			drop = c.dropLocked(victim, drop)
		}
		cm = &cachedMap{id: id, size: size, m: m}
		cm.where = c.lru.PushFront(cm)
		c.byKey[key] = cm
	}
	cm.refs++
	return readThrough(f, cm.m), func() { c.release(cm) }, true
}

// release ends a use of cm: unmapped if it was dropped meanwhile, else
// idle from now, with a sweep armed for it.
func (c *MapCache) release(cm *cachedMap) {
	c.mu.Lock()
	cm.refs--
	cm.used = c.now()
	unmap := cm.gone && cm.refs == 0
	if !unmap && cm.refs == 0 && c.timer == nil && !c.closed {
		c.timer = time.AfterFunc(c.idle, c.sweep)
	}
	c.mu.Unlock()
	if unmap {
		c.unmap(cm.m)
	}
}

// sweep drops the mappings unused for the idle time, and arms itself
// again while any is left.
func (c *MapCache) sweep() {
	c.mu.Lock()
	c.timer = nil
	var drop []*Mapping
	cutoff := c.now().Add(-c.idle)
	var next time.Duration
	for e := c.lru.Back(); e != nil; {
		cm := e.Value.(*cachedMap)
		e = e.Prev()
		switch {
		case cm.refs > 0:
		case !cm.used.After(cutoff):
			drop = c.dropLocked(cm, drop)
		case next == 0 || cm.used.Sub(cutoff) < next:
			next = cm.used.Sub(cutoff)
		}
	}
	if c.lru.Len() > 0 && !c.closed {
		c.timer = time.AfterFunc(max(next, c.idle/8), c.sweep)
	}
	c.mu.Unlock()
	for _, m := range drop {
		c.unmap(m)
	}
}

// oldestUnusedLocked returns the least recently used mapping no reader
// holds, or nil.
func (c *MapCache) oldestUnusedLocked() *cachedMap {
	for e := c.lru.Back(); e != nil; e = e.Prev() {
		if cm := e.Value.(*cachedMap); cm.refs == 0 {
			return cm
		}
	}
	return nil
}

// dropLocked removes cm from the cache; its mapping is appended to drop
// (for the caller to unmap after the lock) where no reader holds it, else
// unmapped by its last release.
func (c *MapCache) dropLocked(cm *cachedMap, drop []*Mapping) []*Mapping {
	if cm.gone {
		return drop
	}
	cm.gone = true
	c.lru.Remove(cm.where)
	delete(c.byKey, cm.id.Inode())
	if cm.refs == 0 {
		drop = append(drop, cm.m)
	}
	return drop
}

// Forget drops the mapping of any file under id's device and inode
// number (the caller removes or replaces the file): unmapped now, or by
// its last reader.
func (c *MapCache) Forget(id FileID) {
	c.mu.Lock()
	c.forgets[forgetSlot(id.Inode())]++
	var drop []*Mapping
	if cm := c.byKey[id.Inode()]; cm != nil {
		drop = c.dropLocked(cm, drop)
	}
	c.mu.Unlock()
	for _, m := range drop {
		c.unmap(m)
	}
}

// Len is the number of files mapped in the cache.
func (c *MapCache) Len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lru.Len()
}

// Close drops every mapping (those in use at their last release); later
// reads are not mapped.
func (c *MapCache) Close() error {
	c.mu.Lock()
	c.closed = true
	if c.timer != nil {
		c.timer.Stop()
		c.timer = nil
	}
	var drop []*Mapping
	for e := c.lru.Front(); e != nil; {
		cm := e.Value.(*cachedMap)
		e = e.Next()
		drop = c.dropLocked(cm, drop)
	}
	c.mu.Unlock()
	for _, m := range drop {
		c.unmap(m)
	}
	return nil
}
