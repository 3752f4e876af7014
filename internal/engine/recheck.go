package engine

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/crc32c"
	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/transfer"
)

// recheckChunk is the private buffer of recheck.
const recheckChunk = 4 << 20

// recheck reads the payload of the keys marked in want from f into private
// memory and returns their CRC-32C, computed as a store computes them (each
// key's segments in payload order). It is the second opinion on keys whose
// checksum failed when computed from their destination blocks, which the
// client can write to during the load: only a mismatch here shows that the
// file is corrupt. Reads are 4 KiB-aligned, so f may be opened O_DIRECT.
func recheck(ctx context.Context, f fsys.File, h *format.Header, want []bool) ([]uint32, error) {
	hl := int64(h.Len())
	bb := int64(h.BlockBytes)
	sums := make([]uint32, len(h.Keys))
	buf := fsys.AlignedBuffer(recheckChunk)
	var at, n int64 // buf holds the file's bytes [at, at+n)
	var err error
	// Walk visits segments in increasing file offset: each chunk is read
	// once.
	h.Walk(want, func(k, _, _, _ int, off int64) {
		for pos, end := hl+off, hl+off+bb; pos < end && err == nil; {
			if pos >= at+n {
				if err = ctx.Err(); err != nil {
					return
				}
				at = pos &^ (format.Align - 1)
				var got int
				got, err = f.ReadAt(buf, at)
				n = int64(got)
				if errors.Is(err, io.EOF) {
					err = nil
				}
				if err == nil && pos >= at+n {
					err = fmt.Errorf("%w: %w: read at %d returned %d bytes", ErrCorrupt, transfer.ErrShortFile, at, got)
				}
				if err != nil {
					return
				}
			}
			stop := min(end, at+n)
			sums[k] = crc32c.Update(sums[k], buf[pos-at:stop-at])
			pos = stop
		}
	})
	if err != nil {
		return nil, err
	}
	return sums, nil
}

// distinctBlocks rejects a load that names one destination block twice
// (for two keys, or twice for one): the second write would overwrite the
// first, and the first key's checksum, computed from its blocks, would
// fail for a good file. NoBlock, which names no block, may repeat.
func distinctBlocks(blocks [][]int) error {
	n := 0
	for _, bs := range blocks {
		n += len(bs)
	}
	seen := make(map[int]int, n)
	for i, bs := range blocks {
		for _, b := range bs {
			if b == NoBlock {
				continue
			}
			if first, dup := seen[b]; dup {
				return fmt.Errorf("%w: key %d: destination block %d is also a block of key %d: a load's blocks must be distinct", ErrInvalid, i, b, first)
			}
			seen[b] = i
		}
	}
	return nil
}
