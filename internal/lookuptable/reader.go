package lookuptable

import (
	"encoding/binary"
	"fmt"
	"math/bits"
	"os"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Reader is a client's read-only mapping of a table: the reader's side
// of the format, which the daemon never takes. It stays as the format's
// Go reference: tests read the daemon's table through a mapping of their
// own with it, as a client does, seqlock included.
type Reader struct {
	mem   []byte
	slots []uint64
	mask  uint64
}

// Open maps the table at path read-only and checks its header.
func Open(path string) (*Reader, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("lookuptable: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("lookuptable: %w", err)
	}
	if fi.Size() < HeaderSize+8*MinSlots {
		return nil, fmt.Errorf("%w: %s is %d bytes", ErrFormat, path, fi.Size())
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(fi.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("lookuptable: map %s: %w", path, err)
	}
	shift := binary.LittleEndian.Uint32(mem[offShift:])
	switch {
	case string(mem[offMagic:offMagic+len(Magic)]) != Magic:
		err = fmt.Errorf("%w: %s has magic %q", ErrFormat, path, mem[offMagic:offMagic+len(Magic)])
	case binary.LittleEndian.Uint32(mem[offVersion:]) != Version:
		err = fmt.Errorf("%w: %s is version %d, want %d", ErrFormat, path, binary.LittleEndian.Uint32(mem[offVersion:]), Version)
	case shift >= 31 || int64(HeaderSize)+8<<shift != fi.Size():
		err = fmt.Errorf("%w: %s: 2^%d slots in %d bytes", ErrFormat, path, shift, fi.Size())
	}
	if err != nil {
		unix.Munmap(mem)
		return nil, err
	}
	n := 1 << shift
	return &Reader{mem: mem, slots: unsafe.Slice((*uint64)(unsafe.Pointer(&mem[HeaderSize])), n), mask: uint64(n - 1)}, nil
}

func (r *Reader) load(off int) uint64 {
	return atomic.LoadUint64((*uint64)(unsafe.Pointer(&r.mem[off])))
}

// Leading returns how many leading keys of the namespace with fingerprint
// fp the table holds. final reports that the first key it lacks (if any)
// is not stored; ok is false when the table cannot answer now (closed, or
// its slots rewritten meanwhile): the caller asks the daemon.
func (r *Reader) Leading(fp uint64, keys [][]byte) (n int, final, ok bool) {
	seq := r.load(offSeq)
	flags := r.load(offFlags)
	if seq&1 != 0 || flags&FlagClosed != 0 {
		return 0, false, false
	}
	n = len(keys)
	for i, k := range keys {
		if !r.holds(Hash(fp, k)) {
			n = i
			break
		}
	}
	if r.load(offSeq) != seq {
		return 0, false, false
	}
	return n, flags&(FlagMissesFinal|FlagIncomplete) == FlagMissesFinal, true
}

// holds probes for tag from its home slot.
func (r *Reader) holds(tag, home uint64) bool {
	for i, probes := home&r.mask, 0; probes < len(r.slots); i, probes = (i+1)&r.mask, probes+1 {
		switch atomic.LoadUint64(&r.slots[i]) {
		case tag:
			return true
		case slotEmpty:
			return false
		}
	}
	return false
}

// Close unmaps the table.
func (r *Reader) Close() error {
	if r.mem == nil {
		return nil
	}
	err := unix.Munmap(r.mem)
	r.mem, r.slots = nil, nil
	return err
}

// slotsFor is the slot count Create makes for a request of n.
func slotsFor(n int) int { return 1 << bits.Len(uint(max(n, MinSlots)-1)) }
