package cluster

import (
	"cmp"
	"maps"
	"slices"

	"github.com/kvhost/kvhost/internal/clustercap"
)

// clusterFlocks is what this node found of flocks shared with the other
// nodes of a cluster mount (guarded by Mount.mu).
type clusterFlocks struct {
	// shared holds the nodes with which this node found flocks shared on
	// the mount (Summary.LockShared), while a summary of theirs is on the
	// mount (forgetGone): a probe of
	// the node's lock found it held while the node ran (its summary
	// fresh, or stale with its lock held), or its summary names this
	// node. A free lock proves a node dead only where flocks are so
	// shared (mayAdopt): on a mount whose flocks stay on each node every
	// probe finds another node's lock free.
	shared map[string]bool
	// probes holds, per running node not in shared, this node's probes of
	// its lock (probeLocks), while a summary of its is on the mount
	// (forgetGone).
	probes map[string]*lockProbe
	// unproven holds the dead nodes not adopted for want of shared
	// flocks, as the last read found them (logged once).
	unproven map[string]bool
	// shadowed holds the dead nodes not adopted because a running peer
	// carries their owner tag (read), as the last read found them
	// (logged once).
	shadowed map[string]bool
}

// lockProbe is this node's probing of a running node's lock (probeLocks).
type lockProbe struct {
	at   int64  // the last probe (Unix ns)
	seq  uint64 // the node's summary at the last probe that found the lock free
	run  int64  // the node's run (Summary.Run) at that probe
	free int    // probes that found it free, each with the node's summary grown since the last
	said bool   // logged that flocks are not shared with it
}

// Lock probes of running nodes (probeLocks).
const (
	// maxLockProbes bounds the probes of one read.
	maxLockProbes = 4
	// UnsharedProbes is how many probes must find a running node's lock
	// free, its summary growing in between, before this node logs that
	// flocks are not shared with it.
	UnsharedProbes = 3
)

// probeLocks probes, once a tick, the locks of running nodes (fresh:
// their summaries are fresh) with which flocks are not yet found shared
// (f.shared), at most maxLockProbes of them, those probed longest ago
// first: a lock found held proves flocks shared between the two nodes (a
// probe reaches the other's lock), so that its being free may later prove
// the other dead (read). A node whose lock is found free UnsharedProbes
// times, its summary grown between each two, ran through the probes:
// flocks do not reach between the two nodes (an NFS mount with
// local_lock=flock, local_lock=all or nolock on either), and this node
// says so, once; but not of a node without a lock file, nor where this
// node found flocks shared with another node: such a summary is stray
// or forged (or its node's own mount keeps flocks local), which a
// warning naming the summary file says, once. Called with Mount.mu held.
func (f *clusterFlocks) probeLocks(at *site, fresh []*clustercap.Summary, now int64) {
	var due []*clustercap.Summary
	for _, s := range fresh {
		if f.shared[s.Node] {
			delete(f.probes, s.Node)
			continue
		}
		if f.probes[s.Node] == nil {
			f.probes[s.Node] = &lockProbe{}
		}
		due = append(due, s)
	}
	slices.SortFunc(due, func(a, b *clustercap.Summary) int { return cmp.Compare(f.probes[a.Node].at, f.probes[b.Node].at) })
	for _, s := range due[:min(len(due), maxLockProbes)] {
		p := f.probes[s.Node]
		p.at = now
		free, err := at.dir.LockFree(s.Node)
		switch {
		case err != nil:
			at.log.Debug("engine: cluster lock probe of a running node", "mount", at.root, "node", s.Node, "err", err)
		case !free:
			f.shared[s.Node] = true
			delete(f.probes, s.Node)
			at.log.Debug("engine: cluster: flocks shared with another node", "mount", at.root, "node", s.Node)
		case s.Run != p.run:
			// Another run of the node since the last free probe: it
			// restarted in between (its lock free while it was down), which
			// says nothing of whether flocks reach it. Counted anew.
			p.free, p.seq, p.run = 1, s.Seq, s.Run
		case at.dir.LockMissing(s.Node) || len(f.shared) > 0:
			// No lock file at all: no node runs under the name (a running
			// one locks its file again at its next interval). Or flocks
			// reach between this node and another: a free lock says more of
			// the summary than of the file system. Either way a stray or
			// forged summary, or (a lock file there) a node whose own mount
			// keeps its flocks local: not the diagnosis below.
			if !p.said {
				p.said = true
				at.log.Warn("engine: cluster: a fresh summary whose node does not hold its lock (no process holds its lock file, or there is none), where this node found flocks shared with another node or the lock file missing: a stray or forged summary, or a node whose mount keeps its flocks local; it is never adopted while its summary stays fresh; remove the file if no such node runs",
					"mount", at.root, "summary", at.dir.SummaryPath(s.Node), "lock_file_missing", at.dir.LockMissing(s.Node), "shared_with", len(f.shared))
			}
		case p.free == 0 || s.Seq > p.seq:
			p.free++
			p.seq = s.Seq
			if p.free >= UnsharedProbes && !p.said {
				p.said = true
				at.log.Error("engine: cluster: another node's lock file reads free while it runs: flocks do not reach between the two nodes (an NFS mount with local_lock=flock, local_lock=all or nolock?); neither will take the other for dead, and a dead node's files stay counted but not evicted until it runs again",
					"mount", at.root, "node", s.Node, "probes", p.free)
			}
		}
	}
}

// noteUnproven logs, once per node while it stays so, each dead node
// (unproven) that this node does not adopt for want of shared flocks
// (f.shared): its lock's being free proves nothing. Called with Mount.mu
// held.
func (f *clusterFlocks) noteUnproven(at *site, unproven map[string]bool) {
	for node := range unproven {
		if !f.unproven[node] {
			at.log.Warn("engine: cluster: a node looks dead (summary stale, lock free), but this node never found flocks shared with it, so a free lock proves nothing: not adopted; its files stay, evicted by no node, until it runs again",
				"mount", at.root, "node", node)
		}
	}
	f.unproven = unproven
}

// lockShared names the nodes with which this node found flocks shared
// (Summary.LockShared), at most clustercap.MaxAdopted of them. Called
// with Mount.mu held.
func (f *clusterFlocks) lockShared() []string {
	out := slices.Sorted(maps.Keys(f.shared))
	return out[:min(len(out), clustercap.MaxAdopted)]
}
