package engine

import (
	"errors"
	"io/fs"
	"log/slog"
	"path/filepath"
	"slices"
	"sync"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/engine/accesslog"
	"github.com/kvhost/kvhost/internal/engine/index"
)

// Bounds of the access journals.
const (
	// maxPendingAccess bounds the files whose figures wait for the
	// journal's writer; the uses of others are not journaled meanwhile.
	maxPendingAccess = 1 << 20
	// compactMin is the fewest records a journal holds before it is
	// compacted; beyond it, a journal is compacted once it holds twice
	// as many records as its mount has files (and compactMin more).
	compactMin = 1 << 16
)

// accessLog keeps the files' last access and hit counts across restarts:
// one journal per mount of kvhost's layout (package accesslog), named by
// this node, written off the paths of the uses. Engine.access tells it
// of every use the policy is told of (note); the hit recorder's
// goroutine (hits.go) appends the files' figures, as the index has them,
// to their mounts' journals (write), and compacts a journal from the
// index when it grows; only it writes. rebuild reads the
// journals back (readAccess), so that the policy's RESTORE records carry
// each file's last access and hits. A store writes nothing here: a new
// file's figures are its store time (its mtime) and no hits.
type accessLog struct {
	ix  *index.Index
	fs  fsys.FS
	log *slog.Logger
	// paths holds each mount's journal ("" where there is none: a
	// vllm-fs mount, whose files have no ids, or an unwritable one).
	paths []string
	// off: a write to the mount's journal failed (logged once); it is
	// written no more.
	off []bool

	mu      sync.Mutex          // guards pending
	pending map[uint64]struct{} // entry ids whose figures changed
}

// journalPath is the access journal of node on the mount rooted at root.
func journalPath(root, node string) string {
	return filepath.Join(root, accesslog.Prefix+node)
}

// accessPaths returns the journal of node on each mount, "" where the
// mount keeps none.
func accessPaths(mounts []*mount, node string) []string {
	paths := make([]string, len(mounts))
	for i, m := range mounts {
		if m.raw == nil {
			paths[i] = journalPath(m.root, node)
		}
	}
	return paths
}

// writableAccessPaths is accessPaths less the mounts where Open found
// that no file can be made.
func writableAccessPaths(mounts []*mount, node string) []string {
	paths := accessPaths(mounts, node)
	for i, m := range mounts {
		if m.unwritable != nil {
			paths[i] = ""
		}
	}
	return paths
}

// newAccessLog returns the writer of the journals at paths; the hit
// recorder runs it (hitRecorder.run).
func newAccessLog(ix *index.Index, fsy fsys.FS, log *slog.Logger, paths []string) *accessLog {
	return &accessLog{
		ix: ix, fs: fsy, log: log, paths: paths,
		off:     make([]bool, len(paths)),
		pending: map[uint64]struct{}{},
	}
}

// note queues the entries whose hits or last access recs report (hits;
// an insert carrying hits: a file moved or deduplicated), and reports
// whether it queued any.
func (a *accessLog) note(recs []abi.AccessRecord) bool {
	if a == nil || !slices.ContainsFunc(recs, journaled) {
		return false // a store's INSERT: no lock taken
	}
	queued := false
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, r := range recs {
		if journaled(r) && len(a.pending) < maxPendingAccess {
			a.pending[r.Entry] = struct{}{}
			queued = true
		}
	}
	return queued
}

// journaled reports whether r tells of a use the journal keeps.
func journaled(r abi.AccessRecord) bool {
	return r.Kind == abi.AccessHit || r.Kind == abi.AccessInsert && r.Hits > 0
}

// write appends the figures of the entries pending to their journals.
func (a *accessLog) write() {
	if a == nil {
		return
	}
	a.mu.Lock()
	ids := make([]uint64, 0, len(a.pending))
	for id := range a.pending {
		ids = append(ids, id)
	}
	clear(a.pending)
	a.mu.Unlock()
	if len(ids) == 0 {
		return
	}
	byMount := make([][]accesslog.Figure, len(a.paths))
	for _, f := range a.ix.Files().Figures(ids) {
		if f.Mount < len(byMount) {
			byMount[f.Mount] = append(byMount[f.Mount], accesslog.Figure{FID: f.FID, Last: f.Last, Hits: f.Hits})
		}
	}
	for m, figs := range byMount {
		if len(figs) > 0 {
			a.append(m, figs)
		}
	}
}

// append writes figs to mount m's journal, compacting it where it grew.
// The journal is open only meanwhile: the engine holds no descriptor of
// it between writes.
func (a *accessLog) append(m int, figs []accesslog.Figure) {
	if a.paths[m] == "" || a.off[m] {
		return
	}
	j, err := accesslog.Open(a.fs, a.paths[m])
	if err != nil {
		a.fail(m, err)
		return
	}
	defer j.Close()
	if err := j.Append(figs); err != nil {
		a.fail(m, err)
		return
	}
	if j.Records() < compactMin {
		return
	}
	all := a.ix.Files().MountFigures(m)
	if j.Records() < compactMin+2*len(all) {
		return
	}
	keep := make([]accesslog.Figure, len(all))
	for i, f := range all {
		keep[i] = accesslog.Figure{FID: f.FID, Last: f.Last, Hits: f.Hits}
	}
	if err := j.Rewrite(keep); err != nil {
		a.log.Warn("engine: access journal not compacted", "path", a.paths[m], "err", err)
	}
}

// fail stops journaling on mount m: its files' uses after this are lost
// at the next restart (their RESTORE carries what was journaled before).
func (a *accessLog) fail(m int, err error) {
	a.off[m] = true
	a.log.Warn("engine: access journal failed: the files' uses on this mount are no longer kept across restarts", "path", a.paths[m], "err", err)
}

// close writes what is pending.
func (a *accessLog) close() {
	a.write()
}

// journalBound is the most bytes of records a start reads of a journal
// when files were found on the mounts: what its writer lets it hold
// (append compacts it past compactMin records and two per file of its
// mount, and one write adds at most maxPendingAccess). A journal larger
// than that was not written by kvhost alone (garbage, a copy appended
// to): its start reads the last records only, 26 MiB for a few files,
// instead of up to a gigabyte (seconds to a start).
func journalBound(files int) int64 {
	return int64(compactMin+2*files+maxPendingAccess) * accesslog.RecordSize
}

// journalBadMany is the ignored records past which a start's note of
// them is a warning: a crash tears one record, a journal of garbage
// millions.
const journalBadMany = 1024

// readAccess reads the journals at paths into one figure per file id,
// at most limit bytes of records each (journalBound): where two
// journals name a file (moved between mounts), the later last access
// wins. A journal read in part, or holding many bad records, is
// logged at warning level.
func readAccess(fsy fsys.FS, log *slog.Logger, paths []string, limit int64) map[uint64]accesslog.Figure {
	all := map[uint64]accesslog.Figure{}
	for _, p := range paths {
		if p == "" {
			continue
		}
		c, err := accesslog.Read(fsy, p, limit)
		if err != nil {
			if !errors.Is(err, fs.ErrNotExist) {
				log.Warn("engine: access journal unread: its files restore with their store times and no hits", "path", p, "err", err)
			}
			continue
		}
		switch {
		case c.Skipped > 0:
			log.Warn("engine: access journal larger than kvhost keeps one: only its last records read, the files named only before them restore with their store times and no hits",
				"path", p, "skipped_bytes", c.Skipped, "read_bytes", limit, "bad", c.Bad)
		case c.Bad >= journalBadMany:
			log.Warn("engine: access journal: many records ignored (not kvhost's, or damaged)", "path", p, "bad", c.Bad, "valid", c.Records, "torn_bytes", c.Torn)
		case c.Bad > 0 || c.Torn > 0:
			log.Info("engine: access journal: records ignored", "path", p, "bad", c.Bad, "torn_bytes", c.Torn)
		}
		for fid, f := range c.Figures {
			if o, ok := all[fid]; !ok || f.Last > o.Last {
				all[fid] = f
			}
		}
	}
	return all
}

// restoreAccess gives each entry found at rebuild what the journals kept
// of its file (by its header id; a file without one, or unnamed by the
// journals, keeps its store time and no hits). A last access may be
// earlier than the file's mtime: a move's copy keeps its header id and
// its last access, as the move's INSERT told the policy (docs/abi.md);
// it is never taken later than now, nor at or before the epoch.
func restoreAccess(found []*entry, figs map[uint64]accesslog.Figure, now int64) {
	if len(figs) == 0 {
		return
	}
	for _, en := range found {
		f, ok := figs[en.FID]
		if en.FID == 0 || !ok || f.Last <= 0 {
			continue
		}
		en.Restore(min(f.Last, max(en.Last, now)), f.Hits)
	}
}
