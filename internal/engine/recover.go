package engine

import (
	"cmp"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/engine/index"
	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/internal/vllmfs"
)

// recovery is Open's rebuild of the index from the files on the mounts:
// it lives for the scan only.
type recovery struct {
	mounts  []*mount
	workers int // Config.IOWorkers: the scan reads headers with twice as many
	log     *slog.Logger
	fs      fsys.FS
	hd      *headerReader
	own     *ownFiles // temporary leftovers, owner files and live spares
	rm      *remover  // corrupt files and leftovers removed
	ix      *index.Index
	tables  *tables
	tier    *tiering       // copies left by a move cut short
	corrupt *atomic.Uint64 // Stats.Corrupt
	// journals are the mounts' access journals (accessPaths), read for
	// the files' last access and hits (restoreAccess) at now.
	journals []string
	now      func() time.Time
}

// rebuild scans every mount: it removes temporary leftovers (older than
// TempGrace) and indexes every file whose header decodes, reading headers
// only, in parallel. Files that are not kvhost files are left alone.
func (rc *recovery) rebuild(ctx context.Context) error {
	type item struct {
		mount int
		path  string
	}
	files := make(chan item, 1024)
	var (
		mu      sync.Mutex
		found   []*entry
		skipped int
		corrupt int
		cleaned atomic.Int64 // by the walkers, one per mount
		owners  liveOwners   // the owner files the walkers asked about
		// others counts, per mount, the owner files of other engines
		// running on its directory (sharedWithoutBound).
		others = make([]atomic.Int32, len(rc.mounts))
	)
	var readers sync.WaitGroup
	for range max(4, 2*rc.workers) {
		readers.Add(1)
		go func() {
			defer readers.Done()
			for it := range files {
				en, err := rc.hd.readEntry(it.mount, it.path)
				bad := err != nil && rc.removeCorrupt(rc.mounts[it.mount], it.path, err)
				mu.Lock()
				switch {
				case bad:
					corrupt++
				case err != nil:
					skipped++
					rc.log.Debug("engine: rebuild: skipping file", "path", it.path, "err", err)
				default:
					found = append(found, en)
				}
				mu.Unlock()
			}
		}()
	}
	var walkErr error
	var walk func(mount int, dir string) error
	walk = func(mount int, dir string) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		ents, err := rc.fs.ReadDir(dir)
		if err != nil {
			return err
		}
		for _, d := range ents {
			name := d.Name()
			path := filepath.Join(dir, name)
			if strings.HasPrefix(name, ".") {
				if strings.HasPrefix(name, ownerPrefix) && d.Type().IsRegular() {
					if dir == rc.mounts[mount].root {
						if !owners.held(rc.own, rc.mounts[mount], path) {
							// An ended engine's owner file: its flock is free
							// (this engine's own reads as held: ownerHeld).
							if err := rc.rm.removeFile(rc.mounts[mount], path, fsys.Identity{}); err == nil {
								cleaned.Add(1)
							}
						} else if name != rc.own.ownerName() {
							// Another engine's: another process's, in
							// another container maybe with this pid, or
							// one of this process (kvhost bench
							// --foreign's second, which says nothing
							// of it: SharedDirectoryWarning).
							others[mount].Add(1)
						}
					}
					continue
				}
				if rest, ok := strings.CutPrefix(name, sparePrefix); ok && d.Type().IsRegular() {
					if rc.own.spareLive(&owners, rc.mounts[mount], rest) {
						continue // a running engine's, about to be written
					}
					// Never anyone's data: a spare of an engine that
					// ended (or, named before owners, of one that will
					// find it gone and write a fresh file instead).
					if err := rc.rm.removeFile(rc.mounts[mount], path, fsys.Identity{}); err != nil {
						rc.log.Warn("engine: leftover spare file", "path", path, "err", err)
					} else {
						cleaned.Add(1)
					}
					continue
				}
				rest, tmp := tempRest(name)
				if !d.Type().IsRegular() || !tmp {
					continue // the host's other names, never a policy's
				}
				removed, err := rc.own.cleanTemp(rc.mounts[mount], path, rest)
				if err != nil {
					rc.log.Warn("engine: leftover temporary file", "path", path, "err", err)
				}
				if removed {
					cleaned.Add(1)
				}
				continue
			}
			switch {
			case d.IsDir():
				if err := walk(mount, path); err != nil {
					return err
				}
			case d.Type().IsRegular() && rc.mounts[mount].raw != nil && name == vllmfs.ConfigFile:
				// A vllm-fs base directory's fields, read at Open.
			case d.Type().IsRegular():
				files <- item{mount, path}
			}
		}
		return nil
	}
	start := time.Now()
	var walkers sync.WaitGroup
	var walkMu sync.Mutex
	for i, m := range rc.mounts {
		walkers.Add(1)
		go func() {
			defer walkers.Done()
			roots := []string{m.root}
			if m.raw != nil {
				// Only the base directory (config.json, and a temporary
				// file of it left by a crash) and the data directory: the
				// root may hold other geometries' directories, which are
				// not this mount's.
				roots = []string{filepath.Join(m.root, m.raw.layout.Base()), filepath.Join(m.root, m.raw.layout.DataDir())}
			}
			var err error
			for _, root := range roots {
				err = errors.Join(err, walk(i, root))
			}
			if err != nil {
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
	slices.SortFunc(found, func(a, b *entry) int { return cmp.Compare(a.Last, b.Last) })
	found = rc.tier.dedupe(found) // copies left by a move cut short (demote.go)
	// After the order by store time: the newest file wins a key, however
	// recently another was used.
	restoreAccess(found, readAccess(rc.fs, rc.log, rc.journals, journalBound(len(found))), rc.now().UnixNano())
	ids := make([]NamespaceID, len(found))
	for i, en := range found {
		en.NS = uint32(rc.tables.namespaceOf(en.FP))
		ids[i] = NamespaceID(en.NS)
	}
	rc.ix.InsertAll(found)
	rc.tables.adoptDone(ids...)
	rc.corrupt.Add(uint64(corrupt))
	for i := range others {
		if n := others[i].Load(); n > 0 {
			rc.sharedWithoutBound(rc.mounts[i], int(n))
		}
	}
	rc.log.Info("engine: index rebuilt", "files", len(found), "skipped", skipped, "corrupt_removed", corrupt, "leftovers_removed", cleaned.Load(), "took", time.Since(start))
	return nil
}

// removeCorrupt removes, at rebuild, a file that is a kvhost file (its
// magic and version are ours) but fails its header checks or is shorter
// than its header says: it would otherwise stay on disk, outside capacity
// accounting, forever. Files that are not kvhost files, or of a version
// this build does not read, are left alone. It reports whether the file
// was corrupt (and removed, if it was still the file read).
func (rc *recovery) removeCorrupt(m *mount, path string, readErr error) bool {
	if !errors.Is(readErr, ErrCorrupt) || errors.Is(readErr, format.ErrBadMagic) || errors.Is(readErr, format.ErrVersion) {
		return false
	}
	f, err := rc.hd.openNoLinks(m, path, os.O_RDONLY|checkOpen, 0)
	if err != nil {
		return false
	}
	defer f.Close()
	magic := make([]byte, len(format.Magic))
	if n, _ := f.ReadAt(magic, 0); n < len(magic) || string(magic) != format.Magic {
		return false // too short to say it is ours
	}
	id, err := fileIdentity(f)
	if err != nil {
		return false
	}
	fi, err := rc.fs.Stat(path)
	if err != nil {
		return false
	}
	if now, err := fsys.IdentityOf(fi); err != nil || !now.Same(id) {
		return false
	}
	rc.log.Warn("engine: corrupt file removed at start", "path", path, "err", readErr)
	if err := rc.rm.removeFile(m, path, id); err != nil {
		rc.log.Warn("engine: remove corrupt file", "path", path, "err", err)
	}
	return true
}

// sharedWithoutBound warns that n other engines run on m's directory
// without a cluster capacity there (their owner files are held: only an
// engine that keeps spares on a memory mount has one, and never on a
// mount with a cluster capacity; this engine may have one, they do not). Each engine then evicts files the others indexed, their
// clients' pins unseen, and writes another key into an evicted file it
// keeps as a spare: a load of a key another engine's client pinned fails
// where this engine evicted its file first, which stops vLLM's worker.
func (rc *recovery) sharedWithoutBound(m *mount, n int) {
	rc.log.Warn(SharedDirectoryWarning, "mount", m.root, "other_engines", n)
}

// SharedDirectoryWarning is the message Open logs, at warning level, for
// a memory mount where other engines run without a cluster capacity
// (their owner files held), with the mount ("mount") and their number
// ("other_engines"): each engine evicts and reuses files the others'
// clients may have pinned.
const SharedDirectoryWarning = "engine: other kvhost engines run on this mount's directory without a cluster capacity: each evicts and reuses files the others' clients may have pinned, and a load of such a key fails; give the mount a cluster_capacity on every engine sharing it (each with its own node_id), or give each engine a directory of its own"
