package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/kvhost/kvhost/internal/clustercap"
)

// Purges on a cluster mount (docs/cluster.md, "Purges"). A node removes
// only the files it may evict (mayEvict: its own, an adopted dead
// node's), since another node's client pin or load is invisible to it and
// a load that finds its pinned file gone fails the inference server's
// worker. So a purge tells the other nodes through the cluster
// directory: a purge record (clustercap.Dir.WritePurge) that covers every
// file of the namespace on the mount last written at or before it, and
// on each node's mounts without a cluster capacity (covers). Each
// node applies the records at every tick (applyPurges: the first, before
// the engine opens, after its rebuild), as it evicts, its client pins
// keeping their files until they end, and refuses to index a covered
// file found on the disk meanwhile (discover).

// recordPurges writes a purge record of each of fps on every cluster
// mount, unless ctx ended (a purge cut short tells no other node). It
// returns ctx's error, or the records it could not write, each naming
// its mount.
func (e *Engine) recordPurges(ctx context.Context, fps []uint64) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	var errs []error
	for _, m := range e.mounts {
		if m.cluster == nil {
			continue
		}
		for _, fp := range fps {
			if _, err := m.cluster.dir.WritePurge(fp); err != nil {
				errs = append(errs, fmt.Errorf("engine: mount %s: the other nodes are not told of the purge of namespace %016x (purge again): %w", m.root, fp, err))
			}
		}
	}
	return errors.Join(errs...)
}

// clustered reports whether mounts has one with a cluster capacity,
// which a purge tells of every fingerprint asked (recordPurges).
func clustered(mounts []*mount) bool {
	return slices.ContainsFunc(mounts, func(m *mount) bool { return m.cluster != nil })
}

// purgedOnCluster reports whether en, an entry of a file found on the
// disk, is one that a purge record covers (a record of its namespace,
// the file last written at or before it): one on its mount, a cluster
// mount, or on any cluster mount for a file on a mount without a cluster
// capacity (covers).
func (e *Engine) purgedOnCluster(en *entry) bool {
	limit := purgeLimit(e.now())
	for _, m := range e.mounts {
		if m.cluster == nil || !covers(e, m, en) {
			continue
		}
		if t, ok := m.cluster.dir.PurgedAt(en.FP, limit); ok && en.Ident.Mtime <= t {
			return true
		}
	}
	return false
}

// covers reports whether the purge records of m, a cluster mount, apply
// to en: a file on m, or on a mount without a cluster capacity (this
// node's hot tier, a file it moved off m), which the node would serve
// after the purge otherwise. Another cluster mount has its own records.
func covers(e *Engine, m *mount, en *entry) bool {
	return en.Mount == m.idx || e.mounts[en.Mount].cluster == nil
}

// purgeLimit is the latest purge record time that applies at now, this
// node's clock: now plus clustercap.PurgeAhead. A record further ahead (a
// garbage name, or a file system clock far off) would purge the
// namespace's files written until then, new ones too, at every tick.
func purgeLimit(now time.Time) int64 {
	return now.Add(clustercap.PurgeAhead).UnixNano()
}

// mayPurge reports whether a purge removes en's file rather than only
// dropping it from the index: everywhere but on a cluster mount, where
// only a file this node may evict (mayEvict) goes; another node's is its
// node's to remove. A file without an owner tag (written before tags) is
// no node's, and every node indexing it may have a client pin on it,
// which no other node sees: it leaves every index and stays on the mount,
// as no eviction removes it either. Called with index.mu held.
func (e *Engine) mayPurge(en *entry) bool {
	m := e.mounts[en.Mount]
	return m.mayEvict(en)
}

// applyPurges drops the entries that a purge record of m covers (the
// records the last read listed, and those this node wrote; m's entries,
// and those of this node's mounts without a cluster capacity: covers),
// as Purge does: a file
// this node may remove is removed (mayPurge), another node's only leaves
// the index, and a file a client pin holds stays, to go at the first tick
// after its pin ends. Called with c.mu held (tick).
func (c *clusterMount) applyPurges(ctx context.Context, e *Engine, m *mount) {
	purges, ahead := c.dir.Purges(purgeLimit(e.now()))
	for fp, t := range ahead {
		if c.ahead[fp] != t {
			e.log.Warn("engine: cluster: a purge record is dated too far ahead of this node's clock to apply (a clock far off, or a file that is no record); it applies once this node's clock is within the bound, and the next purge of the namespace removes it",
				"mount", m.root, "fingerprint", fmt.Sprintf("%016x", fp), "record_time", time.Unix(0, t).UTC(), "bound", clustercap.PurgeAhead)
		}
	}
	c.ahead = ahead
	if len(purges) == 0 {
		return
	}
	// The records stay after their namespace's files went: one of a
	// namespace with no file indexed costs no scan of the index.
	ens := e.ix.Matching(purges, func(en *entry) bool {
		t, ok := purges[en.FP]
		return ok && covers(e, m, en) && !en.Spare && en.Ident.Mtime <= t
	})
	var r PurgeResult
	e.rm.purgeEntries(ctx, ens, e.mayPurge, &r, "purged on the cluster")
	if r.Files+r.Left+r.Others > 0 {
		e.log.Info("engine: cluster: dropped the files of purged namespaces (a purge record)", "mount", m.root,
			"files", r.Files, "keys", r.Keys, "bytes", r.Bytes, "others", r.Others, "pinned", r.Pinned, "left", r.Left)
	}
}
