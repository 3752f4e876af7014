// Package lookuptable is the daemon's shared lookup table: a file of
// fixed-size slots, mapped by the daemon (the one writer) and by its
// clients (readers, read-only), that says which keys the engine's index
// holds. A client answers a lookup from its own mapping, without a round
// trip to the daemon and without waiting behind the daemon's data path.
//
// The file (docs/protocol.md, "Shared lookup table"; the u32 fields
// little-endian, the u64 words in the machine's byte order: the daemon and
// its readers share a machine, and a u64 is stored and loaded atomically):
//
//	0   magic "KVHLKT01"
//	8   u32 version (1)
//	12  u32 log2 of the slot count
//	16  u64 sequence: odd while the writer moves keys between slots
//	24  u64 flags: FlagMissesFinal, FlagIncomplete, FlagClosed
//	32  u64 keys held
//	40  reserved up to 64
//	64  slots: u64 each, 0 empty, 1 removed, else a key's tag
//
// A key's tag and home slot come from SHA-256 of its namespace
// fingerprint (u64, little-endian) followed by its bytes: the tag is the
// first 8 bytes of the digest (2 added where they read 0 or 1), the home
// slot the next 8 modulo the slot count. A reader probes from the home
// slot to the first empty slot: the tag found is a hit, an empty slot a
// miss. The writer holds keys in at most three quarters of the slots and
// lets a new key take a removed slot on its probe. Once a sixteenth of the
// slots are removed it sweeps them: each add and removal that follows
// rewrites, between two increments of the sequence, the clusters (runs of
// used slots) that hold removed slots among the next few slots, until the
// sweep has passed every slot. So removed slots stay below an eighth, at
// most seven eighths of the slots are ever in use and every probe ends. A
// reader that saw the sequence odd or changed asks the daemon instead.
package lookuptable

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Magic opens every table file.
const Magic = "KVHLKT01"

// Version is the table format this package writes and reads.
const Version = 1

// HeaderSize is the size of the header before the slots.
const HeaderSize = 64

// Slot values that are not tags.
const (
	slotEmpty   = 0
	slotRemoved = 1
)

// sweepStep is how many slots each add and removal moves a sweep in
// progress on (to the end of the cluster it reaches): a sweep of n slots
// ends within n/sweepStep removals, so the removed slots, a sixteenth when
// it starts, stay below an eighth.
const sweepStep = 64

// Flags of the table's header.
const (
	// FlagMissesFinal: a key the table does not hold is not stored; a
	// reader answers a miss itself. Unset, a reader asks the daemon
	// about the keys from the first one the table lacks (files other
	// nodes or programs wrote are found that way).
	FlagMissesFinal uint64 = 1 << 0
	// FlagIncomplete: the table filled up and lacks keys the engine
	// holds; misses are not final whatever FlagMissesFinal says.
	FlagIncomplete uint64 = 1 << 1
	// FlagClosed: the daemon closed the table; readers ask the daemon.
	FlagClosed uint64 = 1 << 2
)

// Header offsets.
const (
	offMagic   = 0
	offVersion = 8
	offShift   = 12
	offSeq     = 16
	offFlags   = 24
	offKeys    = 32
)

// MinSlots and MaxSlots bound a table's slot count.
const (
	MinSlots = 1 << 10
	MaxSlots = 1 << 30
)

// ErrFormat means a file is not a lookup table this package reads.
var ErrFormat = errors.New("lookuptable: not a lookup table")

// Hash is a key's tag and home slot number (before the modulo).
func Hash(fp uint64, key []byte) (tag, home uint64) {
	var sum [sha256.Size]byte
	var buf [8 + 256]byte // protocol keys (at most protocol.MaxKeyLen, 64 bytes) fit: no allocation
	binary.LittleEndian.PutUint64(buf[:8], fp)
	if len(key) <= len(buf)-8 {
		sum = sha256.Sum256(buf[:8+copy(buf[8:], key)])
	} else {
		h := sha256.New()
		h.Write(buf[:8])
		h.Write(key)
		h.Sum(sum[:0])
	}
	tag = binary.LittleEndian.Uint64(sum[0:8])
	if tag <= slotRemoved {
		tag += 2
	}
	return tag, binary.LittleEndian.Uint64(sum[8:16])
}

// Stats counts what a writer did.
type Stats struct {
	Keys    uint64 // keys held now
	Slots   uint64 // slots of the table
	Sweeps  uint64 // sweeps of the slots (removed slots reclaimed) finished
	Swept   uint64 // slots the sweeps went over
	Dropped uint64 // keys not held at their Add because the table was full
	Lacking uint64 // keys the index holds that the table lacks now
}

// Table is the writer's side: it creates the file and keeps it equal to
// the keys it is told of. Its methods are safe for concurrent use and do
// not block on I/O (the file lives in memory: its directory must be on a
// memory file system for readers to see writes at memory speed; any
// file system works, as a shared mapping).
type Table struct {
	mu      sync.Mutex
	path    string
	mem     []byte
	slots   []uint64 // the mapping's slots
	mask    uint64
	where   map[uint64]placed // tag → where it is
	ino     uint64            // the file's inode: Close removes only it
	removed int               // slots marked removed
	dropped map[uint64]uint64 // tag → home of keys the full table lacks
	flags   uint64
	st      Stats

	// The sweep that reclaims removed slots (sweepLocked).
	cursor  uint64   // the slot it goes on from
	left    int      // how many slots it has yet to pass: one is in progress while above 0
	cluster []uint64 // scratch: the tags of the cluster it rewrites
}

// placed is where a tag sits and where its probe starts.
type placed struct {
	slot uint32
	home uint64
}

// Create makes a table of slots slots (rounded up to a power of two,
// within MinSlots..MaxSlots) at path, readable with mode perm (and
// group gid when gid ≥ 0), replacing any file there. missesFinal sets
// FlagMissesFinal.
func Create(path string, slots int, perm os.FileMode, gid int, missesFinal bool) (*Table, error) {
	if slots < MinSlots {
		slots = MinSlots
	}
	if slots > MaxSlots {
		return nil, fmt.Errorf("lookuptable: %d slots: at most %d", slots, MaxSlots)
	}
	n := slotsFor(slots)
	shift := bits.TrailingZeros(uint(n))
	size := HeaderSize + 8*n
	// A fresh name then a rename: a reader never maps a half-made file.
	// The name is random and made exclusively (O_EXCL), so that nothing
	// planted in a directory others can write (a link) is followed.
	f, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".*.tmp")
	if err != nil {
		return nil, fmt.Errorf("lookuptable: create beside %s: %w", path, err)
	}
	tmp := f.Name()
	defer f.Close()
	fail := func(err error) (*Table, error) {
		os.Remove(tmp)
		return nil, err
	}
	if err := f.Chmod(perm & 0o666); err != nil {
		return fail(fmt.Errorf("lookuptable: chmod %s: %w", tmp, err))
	}
	if gid >= 0 {
		if err := f.Chown(-1, gid); err != nil {
			return fail(fmt.Errorf("lookuptable: chown %s to group %d: %w", tmp, gid, err))
		}
	}
	if err := f.Truncate(int64(size)); err != nil {
		return fail(fmt.Errorf("lookuptable: size %s to %d bytes: %w", tmp, size, err))
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fail(fmt.Errorf("lookuptable: map %s: %w", tmp, err))
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		unix.Munmap(mem)
		return fail(fmt.Errorf("lookuptable: stat %s: %w", tmp, err))
	}
	t := &Table{path: path, mem: mem, mask: uint64(n - 1), where: map[uint64]placed{}, dropped: map[uint64]uint64{}, ino: st.Ino}
	t.slots = unsafe.Slice((*uint64)(unsafe.Pointer(&mem[HeaderSize])), n)
	copy(mem[offMagic:], Magic)
	binary.LittleEndian.PutUint32(mem[offVersion:], Version)
	binary.LittleEndian.PutUint32(mem[offShift:], uint32(shift))
	if missesFinal {
		t.flags = FlagMissesFinal
	}
	t.storeHeader(offFlags, t.flags)
	t.st.Slots = uint64(n)
	if err := os.Rename(tmp, path); err != nil {
		unix.Munmap(mem)
		return fail(fmt.Errorf("lookuptable: publish %s: %w", path, err))
	}
	return t, nil
}

// Path is the table's file.
func (t *Table) Path() string { return t.path }

// Slots is the table's slot count.
func (t *Table) Slots() int { return len(t.slots) }

// header returns the address of the header's u64 at off.
func (t *Table) header(off int) *uint64 { return (*uint64)(unsafe.Pointer(&t.mem[off])) }

func (t *Table) storeHeader(off int, v uint64) { atomic.StoreUint64(t.header(off), v) }

// Add records that the index holds key of the namespace with fingerprint fp.
func (t *Table) Add(fp uint64, key string) {
	tag, home := Hash(fp, unsafe.Slice(unsafe.StringData(key), len(key)))
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.mem == nil {
		return
	}
	if _, ok := t.where[tag]; ok {
		return
	}
	if _, ok := t.dropped[tag]; ok {
		return
	}
	if !t.addLocked(tag, home) {
		t.dropped[tag] = home
		t.st.Dropped++
		t.storeHeader(offFlags, t.flags|FlagIncomplete)
	}
	t.sweepLocked(sweepStep)
}

// addLocked places tag if the table has room for it and reports whether
// it did. The caller holds t.mu.
//
// At most three quarters of the slots hold keys. A new key takes the
// first removed or empty slot of its probe: a removed one leaves as many
// slots in use; an empty one is taken while fewer than an eighth of the
// slots are removed, which the sweeps ensure (sweepLocked; should they
// not have, a whole sweep runs first). So at most seven eighths of the
// slots are ever in use, and every probe ends.
func (t *Table) addLocked(tag, home uint64) bool {
	if len(t.where)+1 > len(t.slots)/4*3 {
		return false
	}
	i := t.freeLocked(home)
	if atomic.LoadUint64(&t.slots[i]) == slotRemoved {
		t.removed--
	} else if t.removed >= len(t.slots)/8 {
		t.left = len(t.slots)
		t.sweepLocked(len(t.slots))
		i = t.freeLocked(home)
	}
	atomic.StoreUint64(&t.slots[i], tag)
	t.where[tag] = placed{i, home}
	t.storeHeader(offKeys, uint64(len(t.where)))
	return true
}

// freeLocked returns the first removed or empty slot of the probe from
// home. The caller holds t.mu, and the table has one.
func (t *Table) freeLocked(home uint64) uint32 {
	for i := home & t.mask; ; i = (i + 1) & t.mask {
		if atomic.LoadUint64(&t.slots[i]) <= slotRemoved {
			return uint32(i)
		}
	}
}

// Remove records that the index no longer holds key.
func (t *Table) Remove(fp uint64, key string) {
	tag, _ := Hash(fp, unsafe.Slice(unsafe.StringData(key), len(key)))
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.mem == nil {
		return
	}
	if p, ok := t.where[tag]; ok {
		delete(t.where, tag)
		atomic.StoreUint64(&t.slots[p.slot], slotRemoved)
		t.removed++
		t.storeHeader(offKeys, uint64(len(t.where)))
	} else {
		delete(t.dropped, tag)
	}
	// Room made: a key the table lacks takes it, and once it lacks none
	// its misses are final again.
	for dtag, dhome := range t.dropped {
		if t.addLocked(dtag, dhome) {
			delete(t.dropped, dtag)
		}
		break
	}
	if len(t.dropped) == 0 && atomic.LoadUint64(t.header(offFlags))&FlagIncomplete != 0 {
		t.storeHeader(offFlags, t.flags)
	}
	t.sweepLocked(sweepStep)
}

// sweepLocked moves the sweep that reclaims removed slots on by at least
// budget slots, to the end of the cluster (run of used slots) it reaches,
// first starting one if none is in progress and a sixteenth of the slots
// are removed. A sweep ends once it has passed every slot. The caller
// holds t.mu, and the engine's index lock (KeySet): a call goes over
// budget slots and the clusters at its ends, never the whole table.
//
// A cluster holding removed slots is rewritten: its slots emptied, then
// its keys placed again in the order they were in, each at the first
// empty slot of its probe. A key's probe starts within its cluster (the
// slot before the cluster is empty) and each key lands no later than it
// was, so the cluster's keys stay in it, no other key's probe crosses it,
// and its removed slots become empty ones. Readers are sent to the daemon
// while the cluster is rewritten: the rewrites of one call lie between two
// increments of the sequence.
func (t *Table) sweepLocked(budget int) {
	if t.left <= 0 {
		if t.removed < len(t.slots)/16 {
			return
		}
		t.left = len(t.slots)
	}
	odd := false
	for budget > 0 && t.left > 0 {
		// The cluster the cursor is in, or the one after it where the
		// cursor's slot is empty (where the last call left it, unless a
		// key took it since).
		start, seen := t.cursor, 1
		if atomic.LoadUint64(&t.slots[start]) == slotEmpty {
			start = (start + 1) & t.mask
		} else {
			for atomic.LoadUint64(&t.slots[(start-1)&t.mask]) != slotEmpty {
				start = (start - 1) & t.mask
				seen++
			}
		}
		end, removed, tags := start, 0, t.cluster[:0]
		for v := atomic.LoadUint64(&t.slots[end]); v != slotEmpty; v = atomic.LoadUint64(&t.slots[end]) {
			if v == slotRemoved {
				removed++
			} else {
				tags = append(tags, v)
			}
			end = (end + 1) & t.mask
			seen++
		}
		if removed > 0 {
			if !odd {
				atomic.AddUint64(t.header(offSeq), 1) // odd: readers ask the daemon
				odd = true
			}
			for i := start; i != end; i = (i + 1) & t.mask {
				atomic.StoreUint64(&t.slots[i], slotEmpty)
			}
			for _, tag := range tags {
				p := t.where[tag]
				i := t.freeLocked(p.home)
				atomic.StoreUint64(&t.slots[i], tag)
				if p.slot != i {
					p.slot = i
					t.where[tag] = p
				}
			}
			t.removed -= removed
		}
		t.cluster = tags[:0]
		passed := int((end - t.cursor) & t.mask)
		if passed == 0 { // the cluster took every slot but one: none is left to pass
			passed = len(t.slots)
		}
		t.cursor = end
		budget -= passed
		t.left -= passed
		t.st.Swept += uint64(seen)
	}
	if odd {
		atomic.AddUint64(t.header(offSeq), 1)
	}
	if t.left <= 0 {
		t.st.Sweeps++
	}
}

// Stats is what the table holds and did.
func (t *Table) Stats() Stats {
	t.mu.Lock()
	defer t.mu.Unlock()
	st := t.st
	st.Keys = uint64(len(t.where))
	st.Lacking = uint64(len(t.dropped))
	return st
}

// Close marks the table closed for readers still mapping it, removes its
// file and unmaps it. Later calls to Add and Remove do nothing.
func (t *Table) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.mem == nil {
		return nil
	}
	t.storeHeader(offFlags, t.flags|FlagClosed|FlagIncomplete)
	var err error
	if fi, serr := os.Stat(t.path); serr == nil {
		if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Ino == t.ino {
			err = os.Remove(t.path)
		}
	}
	if uerr := unix.Munmap(t.mem); err == nil {
		err = uerr
	}
	t.mem, t.slots = nil, nil
	return err
}
