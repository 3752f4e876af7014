package engine

import (
	"sync"
)

// buffers are the moves' copy buffers (copyFile), reused.
type buffers struct {
	copies sync.Pool // *[]byte
}

// copyBuffer returns a buffer of n bytes for a move's copy, reused from
// earlier moves where one is large enough, and put to give it back.
// Moves run many at a time and one after another; a fresh buffer per
// move was a megabyte or more of garbage each.
func (b *buffers) copyBuffer(n int64) (buf []byte, put func()) {
	p, _ := b.copies.Get().(*[]byte)
	if p == nil || int64(cap(*p)) < n {
		buf := make([]byte, n)
		p = &buf
	}
	return (*p)[:n], func() { b.copies.Put(p) }
}
