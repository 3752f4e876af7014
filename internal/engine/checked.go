package engine

import (
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/engine/index"
	"github.com/kvhost/kvhost/internal/format"
)

// Loads verified once (docs/engine.md, "The load path"; RATIONALE: "Why does
// a load from a memory mount not sum again what was verified?").
//
// A file on a memory file system is RAM: its bytes change only when
// something writes them, and every write, truncation and rename sets the
// file's ctime. So the layers of keys a store summed from the bytes it
// wrote (a mover that says so: transfer.WrittenSummer; one that sums its
// source again could sum other bytes than it wrote, if their owner
// changed them meanwhile), or that a load verified, are recorded with
// the file's ctime (index.Checked), and a later load that finds the same
// ctime at its open takes them as verified: it moves them without
// summing, then stats the file again, and where the ctime moved
// meanwhile reads the round again, verifying it. The
// header is read at every load as before (its own checksum, its file id),
// and read again after the payload: a spare reused by another engine
// zeroes it first.

// checkedBefore reports whether the layers lr of the file keys read of
// en's file, whose header is h and whose identity a load took at its open
// (id), are recorded as verified at the file's present ctime, on a mount
// where loads may rely on it.
func checkedBefore(m *mount, en *entry, h *format.Header, id fsys.Identity, read []int, lr LayerRange) bool {
	if !m.memory || m.raw != nil || m.checkEvery || id.Ctime == 0 {
		return false
	}
	c := en.Checked.Load()
	if c == nil || c.Ctime != id.Ctime || !c.Of(len(h.Keys), int(h.Layers)) {
		return false
	}
	first, end := lr.of(int(h.Layers))
	return c.Covers(read, first, end)
}

// markChecked records the layers lr of the file keys of en's file (header
// h) as verified at ctime: summed by the store that wrote them, or by a
// load. A record of another ctime is replaced; a mark lost to a
// concurrent replacement only costs a later load its sums.
func markChecked(m *mount, en *entry, h *format.Header, ctime int64, keys []int, lr LayerRange) {
	if !m.memory || m.raw != nil || ctime == 0 {
		return
	}
	c := en.Checked.Load()
	if c == nil || c.Ctime != ctime || !c.Of(len(h.Keys), int(h.Layers)) {
		n := index.NewChecked(ctime, len(h.Keys), int(h.Layers))
		if !en.Checked.CompareAndSwap(c, n) {
			return
		}
		c = n
	}
	first, end := lr.of(int(h.Layers))
	c.Mark(keys, first, end)
}

// allKeys is the indices of h's keys.
func allKeys(h *format.Header) []int {
	keys := make([]int, len(h.Keys))
	for k := range keys {
		keys[k] = k
	}
	return keys
}

// unchangedSince reports whether f's ctime and size are still id's (a
// load that relied on checkedBefore, after its reads).
func unchangedSince(f fsys.File, id fsys.Identity) bool {
	now, err := fileIdentity(f)
	return err == nil && now.Ctime == id.Ctime && now.Size == id.Size
}
