package engine

import (
	"sync"

	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/staging"
)

// buffers are the engine's reused buffers: moves' copy buffers and
// readHeader's first-read buffers.
type buffers struct {
	copies sync.Pool // *[]byte: moves' copy buffers (copyFile), reused
	heads  sync.Pool // *[]byte: readHeader's first read, format.Align bytes, aligned
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

// header returns an aligned buffer of format.Align bytes for a header's
// first read, reused where one is free, and put to give it back.
func (b *buffers) header() (buf []byte, put func()) {
	p, _ := b.heads.Get().(*[]byte)
	if p == nil {
		buf := staging.AlignedBuffer(format.Align)
		p = &buf
	}
	return *p, func() { b.heads.Put(p) }
}
