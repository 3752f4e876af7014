package cluster

import (
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/kvhost/kvhost/internal/clustercap"
)

// clusterTwin is what this node found of nodes of its own owner tag: a
// twin of another node_id, or a second copy of itself (guarded by
// Mount.mu but where a field says otherwise).
type clusterTwin struct {
	// twin is a running node whose summary carries this node's owner tag,
	// as the last read found ("" if none): another node_id of the tag that
	// the start's check did not see (both started at once). Neither can
	// tell its files from the other's, so while twinned this node removes
	// none of the tag's (mayEvict: twinned is read anywhere).
	twin    string
	twinned atomic.Bool
	// copied: at the last tick another process held this node's lock file
	// (clustercap.Dir.Relock), a second copy of this node: set the twin.
	copied bool
	// heldTicks counts the ticks running at which another process held
	// it: a second copy is logged as such at the second (relock).
	heldTicks int
}

// twinNote says why none of this node's files is evictable while a twin
// runs (setTwin), naming it; "" without one. Called with Mount.mu held.
func (t *clusterTwin) twinNote() string {
	if t.twin == "" {
		return ""
	}
	return fmt.Sprintf("none of its files evictable while node %q runs with its owner tag", t.twin)
}

// setTwin records twin, a running node of this node's owner tag that a
// read found ("" if none), logging when one is found and when none is
// left; but not a copy of this node (copied: another process holds its
// lock file), which relock logs, as an error only where it lasts. Called
// with Mount.mu held.
func (t *clusterTwin) setTwin(at *site, twin string, copied bool) {
	switch {
	case twin == t.twin:
	case copied:
	case twin != "":
		at.log.Error("engine: cluster: another running node has this node's owner tag; removing none of the tag's files, which cannot be told apart, until one of them runs with another node_id",
			"mount", at.root, "node", at.node, "other", twin, "tag", fmt.Sprintf("%#x", at.tag))
	default:
		at.log.Info("engine: cluster: no other running node has this node's owner tag any more", "mount", at.root, "other", t.twin)
	}
	t.twin = twin
	t.twinned.Store(twin != "")
}

// relock checks that this node's lock is still on the file at its lock
// path, and locks the file there anew where it is not (Dir.Relock): a
// node that took this one for dead may have retired it, removing its lock
// file, while it ran. Where another process holds the file there, a
// second copy of this node runs: t.copied makes it this node's twin at
// the next read (setTwin), so that it removes none of their files, which
// it cannot tell apart. Called with Mount.mu held.
func (t *clusterTwin) relock(at *site) {
	renewed, err := at.dir.Relock()
	switch {
	case errors.Is(err, clustercap.ErrNodeLocked):
		// Another node's probe holds the lock for a moment (one that read
		// this node's summary stale, as after the directory came back):
		// only a lock held at two ticks running is a second copy.
		switch t.heldTicks++; t.heldTicks {
		case 1:
			at.log.Warn("engine: cluster: another process holds this node's lock file, which this node no longer held (another node's probe, for a moment, or a second copy of this node); removing none of this node's files until it can lock it again",
				"mount", at.root, "node", at.node, "err", err)
		case 2:
			at.log.Error("engine: cluster: another process still holds this node's lock file: a second copy of this node runs on the mount; removing none of this node's files until it can lock it again",
				"mount", at.root, "node", at.node, "err", err)
		}
		t.copied = true
		return
	case err != nil:
		at.log.Warn("engine: cluster: checking this node's lock", "mount", at.root, "err", err)
	case renewed:
		at.log.Warn("engine: cluster: this node's lock file was removed while it ran (another node took it for dead and retired it?); locked anew", "mount", at.root, "node", at.node)
	}
	if t.copied && err == nil {
		at.log.Info("engine: cluster: this node holds its lock file again", "mount", at.root, "node", at.node)
		t.copied = false
	}
	if err == nil {
		t.heldTicks = 0
	}
}
