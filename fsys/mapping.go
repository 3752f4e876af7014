package fsys

import (
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/kvhost/kvhost/region"
	"golang.org/x/sys/unix"
)

// Mapper is implemented by files whose bytes can be read through a
// read-only shared memory mapping (the operating system's files; Faulty's
// files are not Mappers, so injected faults keep going through ReadAt).
type Mapper interface {
	// MapRead maps the file's first n bytes, rounded up to whole pages
	// (fewer if the file is shorter: reads past its end then return
	// io.EOF), advised for reading in order (MADV_SEQUENTIAL, which
	// leaves the pages' LRU state alone).
	MapRead(n int64) (*Mapping, error)
}

// ErrMapping means a mapping's bytes could not be read (a file truncated under
// it: the fault is caught and the read fails).
var ErrMapping = errors.New("fsys: mapped read failed")

// Mapping is part of a file mapped read-only and shared, read by copying
// from it (ReadAt).
//
// Why: on a memory file system (tmpfs) read(2) marks every 4 KiB page
// accessed, and the first read of a page written since moves it to the
// kernel's active list under a lock that every reading CPU shares; with
// 16 readers that bookkeeping costs more CPU than the copy (a first read
// of freshly written files at 21–28 GB/s, a second at 56–65 GB/s, on the
// 16-core GPU machine). A copy from a mapping advised MADV_SEQUENTIAL
// leaves the pages' LRU state alone (the kernel neither marks them on
// fault nor on unmap): 36–42 GB/s for the same first read. See
// RATIONALE.md, "Why do loads from tmpfs copy from a mapping?".
type Mapping struct {
	b    []byte // the mapped bytes; nil for an empty file
	name string
}

// ReadAt copies the mapped bytes at off into p; like io.ReaderAt it
// returns io.EOF with fewer bytes at the mapping's end. A fault while
// copying (the file was truncated under the mapping) fails the read with
// an error wrapping ErrMapping and region.ErrFault, not the process.
func (m *Mapping) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("%w: %s: negative offset %d", ErrMapping, m.name, off)
	}
	if off >= int64(len(m.b)) {
		return 0, io.EOF
	}
	n, err := region.SafeCopy(p, m.b[off:])
	if err != nil {
		return 0, fmt.Errorf("%w: %s at %d: %w", ErrMapping, m.name, off, err)
	}
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

// Len is the number of bytes mapped.
func (m *Mapping) Len() int64 { return int64(len(m.b)) }

// Close unmaps the bytes.
func (m *Mapping) Close() error {
	if m.b == nil {
		return nil
	}
	b := m.b
	m.b = nil
	if err := unix.Munmap(b); err != nil {
		return &os.PathError{Op: "munmap", Path: m.name, Err: err}
	}
	return nil
}

// ReadvAt fills the buffers in order from the mapped bytes at off, like
// File.ReadvAt: fewer bytes at the mapping's end, 0 at or past it.
func (m *Mapping) ReadvAt(bufs [][]byte, off int64) (int, error) {
	total := 0
	for _, b := range bufs {
		n, err := m.ReadAt(b, off+int64(total))
		total += n
		if err == io.EOF {
			break
		}
		if err != nil {
			return total, err
		}
	}
	return total, nil
}

// readThrough returns f with its reads (ReadAt, ReadvAt) served by m, a
// mapping of f; writes and everything else go to f. Closing it closes f,
// not m.
func readThrough(f File, m *Mapping) File { return &mappedFile{File: f, m: m} }

type mappedFile struct {
	File
	m *Mapping
}

func (f *mappedFile) ReadAt(p []byte, off int64) (int, error) { return f.m.ReadAt(p, off) }

func (f *mappedFile) ReadvAt(bufs [][]byte, off int64) (int, error) { return f.m.ReadvAt(bufs, off) }

// MapMin is the smallest read MapForRead maps, and the smallest file a
// MapCache is used for (by the GPU path's loads). Every mapping is an mmap
// and an munmap, and an munmap in a process whose threads all copy
// interrupts each of their CPUs to flush its TLB: on the H100 machine
// (16 jobs) loads of 2 MiB files through mappings ran at half the speed of
// preads in one call, while 32 MiB files gained a quarter or more.
const MapMin = 16 << 20

// MapForRead maps f's first n bytes for a load to read through
// (its reads served by the mapping), where n is at least MapMin and f can be mapped: it
// returns f itself and a no-op release otherwise (the load then reads with
// pread; see Mapping for when a mapping is worth it).
func MapForRead(f File, n int64) (File, func()) {
	mf, ok := f.(Mapper)
	if !ok || n < MapMin {
		return f, func() {}
	}
	m, err := mf.MapRead(n)
	if err != nil {
		return f, func() {}
	}
	return readThrough(f, m), func() { m.Close() }
}
