// Package fsystest holds test helpers for code that goes through package
// fsys: a file that records where it was written, and the check that
// stores fill large page-cache folios in one write each (WriteLog); an
// injector that holds one operation (Hold); a client that caches
// directory listings (ListingCache); a file system that refuses direct
// I/O (RefusesDirect); flocks as an NFS client takes them (NFSLocks), and
// flocks that stay on each simulated node (LocalLocks).
package fsystest

import (
	"sync"

	"github.com/kvhost/kvhost/fsys"
)

// WriteLog is an fsys.File that records the file ranges its writes
// (WriteAt, WritevAt) covered, in order.
type WriteLog struct {
	fsys.File
	mu     sync.Mutex
	writes [][2]int64 // [off, end)
}

// WriteAt writes through the file and records the range written.
func (w *WriteLog) WriteAt(b []byte, off int64) (int, error) {
	n, err := w.File.WriteAt(b, off)
	w.record(off, n)
	return n, err
}

// WritevAt writes through the file and records the range written.
func (w *WriteLog) WritevAt(bufs [][]byte, off int64) (int, error) {
	n, err := w.File.WritevAt(bufs, off)
	w.record(off, n)
	return n, err
}

func (w *WriteLog) record(off int64, n int) {
	if n <= 0 {
		return
	}
	w.mu.Lock()
	w.writes = append(w.writes, [2]int64{off, off + int64(n)})
	w.mu.Unlock()
}

// Writes returns the ranges written so far, [off, end), in order.
func (w *WriteLog) Writes() [][2]int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([][2]int64(nil), w.writes...)
}

// PartlyFirstWritten returns the indices of the folios of size folio,
// among those the writes touch, whose first write covered only part of
// what all the writes put in them: the kernel zeroes the rest of a large
// folio before such a write, a second pass over its memory.
func PartlyFirstWritten(writes [][2]int64, folio int64) []int64 {
	first := map[int64][2]int64{}   // folio index -> its first write's part of it
	covered := map[int64][2]int64{} // folio index -> the span all writes cover in it
	for _, w := range writes {
		for k := w[0] / folio; k*folio < w[1]; k++ {
			part := [2]int64{max(w[0], k*folio), min(w[1], (k+1)*folio)}
			if _, ok := first[k]; !ok {
				first[k], covered[k] = part, part
			}
			c := covered[k]
			covered[k] = [2]int64{min(c[0], part[0]), max(c[1], part[1])}
		}
	}
	var bad []int64
	for k, f := range first {
		if f != covered[k] {
			bad = append(bad, k)
		}
	}
	return bad
}
