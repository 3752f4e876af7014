package engine

import (
	"errors"
	"os"
	"path/filepath"

	"github.com/kvhost/kvhost/internal/fsys"
)

// Spare files (docs/engine.md, "Spare files").
//
// On a memory file system, writing into a fresh file makes the kernel
// allocate and zero every page, and the first read of a freshly written
// page activates it under a lock all readers share; a file whose pages
// already exist is written at about 1.5 times the speed and read at about
// three times. So an evicted file on such a mount is not unlinked but
// renamed to a temporary name (.tmp-<node>-<pid>-<hex>, the name a store
// writes under) and kept as a spare, and the next store of a file of the
// same size renames the spare to its own temporary name and writes into
// it instead of creating a file. The store writes every byte of the file
// (header area, payload, zero tail), so nothing of the old file survives.
//
// A spare is free space that happens to hold pages: it does not count in
// the mount's used bytes, and before a store creates a fresh file the
// engine removes spares until its files, its reservations and its spares
// fit in the capacity. Close removes every spare; after a crash the
// spares are temporary files of a dead process, which the next Open
// removes. Only evictions make spares (a client's delete frees its
// space), and only on memory mounts in kvhost's layout: a vllm-fs file
// may be open in a reader that is not kvhost, which must keep reading the
// bytes it opened.

// spareEligible reports whether m keeps evicted files as spares.
func (e *Engine) spareEligible(m *mount) bool {
	return m.memory && m.raw == nil && !e.cfg.NoReuse
}

// keepSpare renames the file at path (its entry already forgotten, its
// identity id checked) to a temporary name and adds it to m's spares. It
// reports false where the caller should remove the file instead: spares
// are off on m, the engine is closing, the spares would not fit in the
// capacity, or the rename failed.
func (e *Engine) keepSpare(m *mount, path string, id fsys.Identity) bool {
	if !e.spareEligible(m) || id.Size <= 0 {
		return false
	}
	e.mu.Lock()
	fits := !e.closed && m.used+m.spareBytes+id.Size <= m.capacity
	e.mu.Unlock()
	if !fits {
		return false
	}
	spare := e.tempName(filepath.Dir(path), tmpPrefix)
	if err := e.fs.Rename(path, spare); err != nil {
		e.log.Debug("engine: keep a spare file", "path", path, "err", err)
		return false
	}
	e.mu.Lock()
	if m.spares == nil {
		m.spares = map[int64][]string{}
	}
	m.spares[id.Size] = append(m.spares[id.Size], spare)
	m.spareBytes += id.Size
	m.spareFiles++
	e.mu.Unlock()
	return true
}

// takeSpareLocked removes from m's spares one of exactly size bytes and
// returns its path, or "" if there is none.
func (m *mount) takeSpareLocked(size int64) string {
	list := m.spares[size]
	if len(list) == 0 {
		return ""
	}
	path := list[len(list)-1]
	if len(list) == 1 {
		delete(m.spares, size)
	} else {
		m.spares[size] = list[:len(list)-1]
	}
	m.spareBytes -= size
	m.spareFiles--
	return path
}

// reuseSpare opens a spare file of exactly size bytes on m as a store's
// temporary file in dir (renamed, opened with flag extra, flocked), or
// reports false if m has none or taking it failed (the spare is then
// removed; the caller creates a fresh file).
func (e *Engine) reuseSpare(m *mount, dir string, extra int, size int64) (fsys.File, string, bool) {
	e.mu.Lock()
	spare := m.takeSpareLocked(size)
	e.mu.Unlock()
	if spare == "" {
		return nil, "", false
	}
	fail := func(path, op string, err error) (fsys.File, string, bool) {
		e.log.Debug("engine: reuse a spare file", "path", path, "op", op, "err", err)
		e.removeTemp(path)
		return nil, "", false
	}
	if err := e.mkdir(dir, false); err != nil {
		return fail(spare, "mkdir", err)
	}
	tmp := e.tempName(dir, tmpPrefix)
	if err := e.fs.Rename(spare, tmp); err != nil {
		return fail(spare, "rename", err)
	}
	f, err := e.fs.OpenFile(tmp, os.O_WRONLY|extra, 0)
	if err != nil {
		return fail(tmp, "open", err)
	}
	if _, err := lockFile(f); err != nil {
		e.log.Debug("engine: flock of a temporary file", "path", tmp, "err", err)
	}
	e.st.reused.Add(1)
	return f, tmp, true
}

// openTemp opens the temporary file of a store of size bytes in dir on m:
// a spare of that size where m has one, else a fresh file (createTemp),
// after removing spares until the new file fits beside them.
func (e *Engine) openTemp(m *mount, dir string, extra int, size int64) (f fsys.File, tmp, op string, err error) {
	if e.spareEligible(m) {
		if f, tmp, ok := e.reuseSpare(m, dir, extra, size); ok {
			return f, tmp, "", nil
		}
		e.trimSpares(m, func(m *mount) bool { return m.used+m.spareBytes <= m.capacity })
	}
	return e.createTemp(dir, extra, size)
}

// trimSpares removes m's spares until enough reports true (called with
// Engine.mu held) or none is left.
func (e *Engine) trimSpares(m *mount, enough func(*mount) bool) {
	for {
		e.mu.Lock()
		if m.spareFiles == 0 || enough(m) {
			e.mu.Unlock()
			return
		}
		var path string
		for size := range m.spares {
			path = m.takeSpareLocked(size)
			break
		}
		e.mu.Unlock()
		if err := e.fs.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			e.log.Warn("engine: remove a spare file", "path", path, "err", err)
		}
	}
}

// dropSpares removes every spare file (Close).
func (e *Engine) dropSpares() {
	for _, m := range e.mounts {
		e.trimSpares(m, func(*mount) bool { return false })
	}
}
