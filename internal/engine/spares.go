package engine

import (
	"errors"
	"os"
	"path/filepath"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/format"
)

// Spare files (docs/engine.md, "Spare files").
//
// On a memory file system, writing into a fresh file makes the kernel
// allocate and zero every page, and the first read of a freshly written
// page activates it under a lock all readers share; a file whose pages
// already exist is written at about 1.5 times the speed and read at about
// three times. So an evicted file on such a mount is not unlinked but
// renamed to .spare-<node>-<pid>-<hex> and kept, and the next store of a
// file of the same size renames the spare to its own temporary name and
// writes into it instead of creating a file. Nothing of the old file
// survives: the store first zeroes the header's first page and the tail
// past its payload, then writes the header area and the payload.
//
// Within the engine, a spare is never a file a load reads: eviction takes
// only unpinned entries, and loads pin theirs. Another engine sharing the
// directory may still be reading it; so the store zeroes the header before
// the payload, and a load from a memory mount reads the header again after
// the payload: a different file id means the file was rewritten under it,
// and the load fails instead of reporting another key's bytes loaded.
//
// A spare is free space that happens to hold pages: it does not count in
// the mount's used bytes; after every reservation the engine removes
// spares until its files, its reservations and its spares fit in the
// capacity, and an eviction keeps a spare only where it fits. Close
// removes every spare, and Open removes every spare it finds but those
// of engines still running (owner.go: a crashed process's go, even one
// whose pid this process now has). Only evictions
// make spares (a client's delete frees its
// space), and only on memory mounts in kvhost's layout: a vllm-fs file
// may be open in a reader that is not kvhost, which must keep reading the
// bytes it opened. Nor on a mount with a cluster capacity (cluster.go),
// where none is kept or made ahead: a spare is a file on the mount that no
// node's summary counts, and the bound is of every file there.

// keepSpare renames the file at path (its entry already forgotten, its
// identity id checked; an evicted file of which m counts evicted bytes as
// used) to a temporary name and adds it to m's spares, the bytes moving
// from used to the spares (Space.KeepSpare). dir is path's directory,
// open (openDir): the rename is of the name there, and only where it
// still names id's inode, so that a directory replaced by a link since
// the check takes no file of that name where it points. It reports false
// where the caller should remove the file instead, with the name it has
// now (path, or the spare's name where it was renamed): spares are off
// on m, the name is another file's, the rename failed, the spare would
// not fit in the capacity, or the engine is closing. Evictions call it
// for each of their files, several at a time (evictAll), beside the
// stores.
func (o *ownFiles) keepSpare(m *mount, dir fsys.File, path string, id fsys.Identity, evicted int64) (bool, string) {
	if !o.eligible(m) || id.Size <= 0 || dir == nil {
		return false, path
	}
	if fi, err := fsys.StatAt(o.fs, dir, path); err != nil {
		return false, path
	} else if now, err := fsys.IdentityOf(fi); err != nil || now.Inode() != id.Inode() {
		return false, path
	}
	spare := o.tempName(filepath.Dir(path), sparePrefix)
	if err := fsys.RenameAt(o.fs, dir, path, dir, spare, false); err != nil {
		o.log.Debug("engine: keep a spare file", "path", path, "err", err)
		return false, path
	}
	return o.sp.KeepSpare(m.sp, spareFile{Path: spare, ID: id}, evicted), spare
}

// useSpare opens sf, a spare of exactly size bytes on m taken for a store
// (reserveFile), as the store's temporary file in dir (renamed, opened with
// flag extra, flocked, its first page and every byte from end on zeroed),
// or reports false if that failed (the spare is then removed: removeSpare;
// the caller creates a fresh file). The rename is from and into the
// spare's and dir's directories opened without following a link
// (openDir): one replaced by a link since mkdir checked it never takes
// the spare outside the mount, and a spare whose open fails after the
// rename is removed from the directory it was renamed into.
func (o *ownFiles) useSpare(m *mount, sf spareFile, dir string, extra int, size, end int64) (fsys.File, string, bool) {
	var into fsys.File // dir, open: where the spare is once renamed
	fail := func(path, op string, err error) (fsys.File, string, bool) {
		o.log.Debug("engine: reuse a spare file", "path", path, "op", op, "err", err)
		d := into
		if path == sf.Path {
			d = nil
		}
		o.rm.removeOwnIn(m, d, path, sf.ID, "spare file")
		return nil, "", false
	}
	if err := o.dirs.mkdir(m, dir, false); err != nil {
		return fail(sf.Path, "mkdir", err)
	}
	nd, err := m.openDir(o.fs, dir)
	if err != nil {
		return fail(sf.Path, "open the directory", err)
	}
	defer nd.Close()
	od := nd
	if sd := filepath.Dir(sf.Path); sd != dir {
		if od, err = m.openDir(o.fs, sd); err != nil {
			return fail(sf.Path, "open the directory", err)
		}
		defer od.Close()
	}
	tmp := o.tempName(dir, tmpPrefix)
	if err := fsys.RenameAt(o.fs, od, sf.Path, nd, tmp, false); err != nil {
		return fail(sf.Path, "rename", err)
	}
	into = nd
	// Never written through a link planted since (openNoLinks): the
	// caller then makes a fresh file, which says why.
	f, err := m.openNoLinks(o.fs, tmp, os.O_WRONLY|extra, 0)
	if err != nil {
		return fail(tmp, "open", err)
	}
	if err := o.lockTemp(f, tmp, sf.ID.FileID, false); err != nil {
		f.Close()
		return fail(tmp, "lock", err)
	}
	// A spare made ahead never had a header, nor any byte but zeros.
	if !sf.Zeroed {
		if op, err := clearSpare(f, size, end); err != nil {
			f.Close()
			return fail(tmp, op, err)
		}
	}
	o.reused.Add(1)
	return f, tmp, true
}

// clearSpare zeroes what an evicted file's old contents would leave in a
// store of size bytes whose payload ends at end: the header's first
// block, then the tail. It returns the failed step's name with an error.
func clearSpare(f fsys.File, size, end int64) (op string, err error) {
	// The header first: a reader of the old file (another engine on the
	// directory) then finds its file id gone when it checks after its read.
	if _, err := f.WriteAt(fsys.AlignedBuffer(format.Align), 0); err != nil {
		return "zero the header", err
	}
	if end < size {
		// The zero tail: movers write the payload, and on O_DIRECT
		// mounts some write exact extents only. Written, not truncated
		// away and back: the file keeps its pages, which a mover may have
		// registered with a GPU (truncation would leave the registration
		// on pages no longer in the file).
		// From the block the payload ends in (the payload, written
		// next, covers its start), so that O_DIRECT writes stay aligned:
		// sizes are whole blocks (format.Header.FileLen).
		if err := zeroRange(f, end/format.Align*format.Align, size); err != nil {
			return "zero the tail", err
		}
	}
	return "", nil
}

// zeroRange writes zeros over bytes [from, to) of f, in writes of whole
// blocks where from and to are block-aligned.
func zeroRange(f fsys.File, from, to int64) error {
	zeros := fsys.AlignedBuffer(int(min(to-from, 1<<20)+format.Align) &^ (format.Align - 1))
	for off := from; off < to; {
		n, err := f.WriteAt(zeros[:min(int64(len(zeros)), to-off)], off)
		if err != nil {
			return err
		}
		if n == 0 {
			return errors.New("engine: a zeroing write wrote nothing")
		}
		off += int64(n)
	}
	return nil
}

// openTemp opens the temporary file of a store of size bytes, whose
// payload ends at end, in dir on m: sf, a spare of that size the store
// took (reserveFile), where it has one, else a fresh file (createTemp).
// The reservation made room for a fresh file beside the spares (reserve),
// and keepSpare keeps a spare only where it fits.
func (o *ownFiles) openTemp(m *mount, sf spareFile, dir string, extra int, size, end int64) (f fsys.File, tmp, op string, err error) {
	if sf.Path != "" {
		if f, tmp, ok := o.useSpare(m, sf, dir, extra, size, end); ok {
			return f, tmp, "", nil
		}
	}
	return o.createTemp(m, dir, extra, size)
}

// trimSpares removes m's spares until, unless all, m's files,
// reservations and spares fit in its capacity, or none is left.
func (o *ownFiles) trimSpares(m *mount, all bool) {
	for {
		sf, ok := o.sp.TrimOne(m.sp, all)
		if !ok {
			return
		}
		o.removeSpare(m, sf.Path, sf.ID)
	}
}

// removeSpare removes the spare file at path on m, of identity id (of
// which the size is what m counted; a zero id is read from the name),
// which m no longer counts: taken from its spares, or made and not kept.
// A file whose removal fails stays counted (removeOwn).
func (o *ownFiles) removeSpare(m *mount, path string, id fsys.Identity) {
	o.rm.removeOwn(m, path, id, "spare file")
}

// dropSpares removes every spare file (Close).
func (o *ownFiles) dropSpares(mounts []*mount) {
	for _, m := range mounts {
		o.trimSpares(m, true)
	}
}

// keepSpare is ownFiles.keepSpare (removalHost: an eviction keeps its
// files as spares).
func (e *Engine) keepSpare(m *mount, dir fsys.File, path string, id fsys.Identity, evicted int64) (bool, string) {
	return e.own.keepSpare(m, dir, path, id, evicted)
}
