package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"
)

// Purges on a cluster mount (docs/cluster.md, "Purges"; package cluster
// says how the records work): a purge writes a record of each namespace
// it purges on every cluster mount (recordPurges), each node applies the
// records at every tick, and a file a record covers that is found on the
// disk meanwhile is not indexed (purgedOnCluster).

// recordPurges writes a purge record of each of fps on every cluster
// mount of mounts, unless ctx ended (a purge cut short tells no other
// node). It returns ctx's error, or the records it could not write, each
// naming its mount.
func recordPurges(ctx context.Context, mounts []*mount, fps []uint64) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	var errs []error
	for _, m := range mounts {
		if m.cluster == nil {
			continue
		}
		for _, fp := range fps {
			if err := m.cluster.WritePurge(fp); err != nil {
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
// disk, is one that a purge record of a cluster mount of mounts covers at
// now (cluster.Mount.Purged).
func purgedOnCluster(mounts []*mount, now time.Time, en *entry) bool {
	return slices.ContainsFunc(mounts, func(m *mount) bool { return m.cluster != nil && m.cluster.Purged(en, now) })
}

// mayPurge is, for the mounts of mounts, whether a purge removes an
// entry's file rather than only dropping it from the index: everywhere
// but on a cluster mount, where only a file this node may evict
// (mayEvict) goes; another node's is its node's to remove. A file without
// an owner tag (written before tags) is no node's, and every node
// indexing it may have a client pin on it, which no other node sees: it
// leaves every index and stays on the mount, as no eviction removes it
// either.
func mayPurge(mounts []*mount) func(en *entry) bool {
	return func(en *entry) bool { return mounts[en.Mount].mayEvict(en) }
}
