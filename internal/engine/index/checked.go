package index

import "sync/atomic"

// Checked records which layers of which keys of a file's payload the
// engine knows to match the file's checksums (it wrote and summed them,
// or a load verified them), at one state of the file: its status-change
// time, which the kernel sets at every write, truncation and rename of
// the file. A load of a file whose ctime is still Ctime may take the
// marked layers as verified. Its marks are set concurrently by loads and
// never cleared: a file that changes gets a new Checked.
type Checked struct {
	// Ctime is the file's status-change time (Unix nanoseconds) when
	// the marks were made.
	Ctime  int64
	keys   int
	layers int
	bits   []atomic.Uint64 // bit k·layers+l: key k's layer l
}

// NewChecked returns a record of a file of keys keys of layers layers
// at ctime, nothing marked.
func NewChecked(ctime int64, keys, layers int) *Checked {
	return &Checked{Ctime: ctime, keys: keys, layers: layers, bits: make([]atomic.Uint64, (keys*layers+63)/64)}
}

// Of reports whether c describes a file of keys keys of layers layers.
func (c *Checked) Of(keys, layers int) bool { return c.keys == keys && c.layers == layers }

// Mark marks layers [first, end) of the keys. Indices out of range are
// ignored.
func (c *Checked) Mark(keys []int, first, end int) {
	c.each(keys, first, end, func(w *atomic.Uint64, bit uint64) bool {
		w.Or(bit)
		return true
	})
}

// Covers reports whether layers [first, end) of every one of keys are
// marked; indices out of range are not.
func (c *Checked) Covers(keys []int, first, end int) bool {
	return c.each(keys, first, end, func(w *atomic.Uint64, bit uint64) bool {
		return w.Load()&bit != 0
	})
}

// each calls f with the word and bit of each key's layer in [first,
// end), and reports false as soon as f does or an index is out of range.
func (c *Checked) each(keys []int, first, end int, f func(w *atomic.Uint64, bit uint64) bool) bool {
	if first < 0 || end > c.layers || first > end {
		return false
	}
	for _, k := range keys {
		if k < 0 || k >= c.keys {
			return false
		}
		for l := first; l < end; l++ {
			i := k*c.layers + l
			if !f(&c.bits[i/64], 1<<(i%64)) {
				return false
			}
		}
	}
	return true
}
