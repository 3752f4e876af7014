package engine

import (
	"cmp"
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvhost/kvhost/abi"
)

// rebuild scans every mount: it removes temporary leftovers (older than
// TempGrace) and indexes every file whose header decodes, reading headers
// only, in parallel. Files that are not kvhost files are left alone.
func (e *Engine) rebuild(ctx context.Context) error {
	type item struct {
		mount int
		path  string
	}
	files := make(chan item, 1024)
	var (
		mu      sync.Mutex
		found   []*entry
		skipped int
		cleaned int
	)
	var readers sync.WaitGroup
	for range max(4, 2*e.cfg.IOWorkers) {
		readers.Add(1)
		go func() {
			defer readers.Done()
			for it := range files {
				en, err := e.readEntry(it.mount, it.path)
				mu.Lock()
				if err != nil {
					skipped++
					e.log.Debug("engine: rebuild: skipping file", "path", it.path, "err", err)
				} else {
					found = append(found, en)
				}
				mu.Unlock()
			}
		}()
	}
	cutoff := e.now().Add(-e.cfg.TempGrace)
	var walkErr error
	var walk func(mount int, dir string) error
	walk = func(mount int, dir string) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		ents, err := e.fs.ReadDir(dir)
		if err != nil {
			return err
		}
		for _, d := range ents {
			name := d.Name()
			path := filepath.Join(dir, name)
			if strings.HasPrefix(name, ".") {
				if !d.Type().IsRegular() || !(strings.HasPrefix(name, tmpPrefix) || strings.HasPrefix(name, probePrefix)) {
					continue // the host's other names, never a policy's
				}
				if e.cfg.TempGrace > 0 {
					if fi, err := d.Info(); err != nil || fi.ModTime().After(cutoff) {
						continue
					}
				}
				if err := e.fs.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
					e.log.Warn("engine: remove leftover", "path", path, "err", err)
				} else {
					cleaned++
				}
				continue
			}
			switch {
			case d.IsDir():
				if err := walk(mount, path); err != nil {
					return err
				}
			case d.Type().IsRegular():
				files <- item{mount, path}
			}
		}
		return nil
	}
	start := time.Now()
	var walkers sync.WaitGroup
	var walkMu sync.Mutex
	for i, m := range e.mounts {
		walkers.Add(1)
		go func() {
			defer walkers.Done()
			if err := walk(i, m.root); err != nil {
				walkMu.Lock()
				walkErr = errors.Join(walkErr, err)
				walkMu.Unlock()
			}
		}()
	}
	walkers.Wait()
	close(files)
	readers.Wait()
	if walkErr != nil {
		return walkErr
	}

	// Oldest first, so that where two files hold one key (e.g. renamed by
	// hand) the newest wins the key; both stay indexed by path.
	slices.SortFunc(found, func(a, b *entry) int { return cmp.Compare(a.last, b.last) })
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, en := range found {
		id, ok := e.nsByFP[en.fp]
		if !ok {
			id = e.newNamespaceLocked(en.fp)
		}
		en.ns = id
		e.insertLocked(en)
	}
	e.log.Info("engine: index rebuilt", "files", len(found), "skipped", skipped, "leftovers_removed", cleaned, "took", time.Since(start))
	return nil
}

// restore tells the policy about every indexed entry (AccessRestore).
func (e *Engine) restore(ctx context.Context) {
	e.mu.Lock()
	recs := make([]abi.AccessRecord, 0, len(e.entries))
	for _, en := range e.entries {
		recs = append(recs, en.access(abi.AccessRestore, en.last))
	}
	e.mu.Unlock()
	e.access(ctx, recs)
}
