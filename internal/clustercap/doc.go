// Package clustercap bounds the bytes every node of a shared mount keeps
// there together (docs/cluster.md, "Cluster-wide capacity"), coordinating
// through the file system itself: no extra service.
//
// Each node publishes a small Summary of its own files under the mount's
// metadata directory (Dir), atomically (a temporary file renamed over the
// last one): its bytes, the bytes it may hold before it publishes again (its
// claim), a Sketch of its bytes by eviction rank, the cut-off rank it last
// evicted below, and the ranks of other nodes' files it touched. A node that
// sees the cluster over its bound reads every live node's summary, computes
// the global cut-off (Cutoff: the rank below which the nodes' bytes cover
// the excess) and evicts its own files below it; the others apply the same
// cut-off when they read its summary (Plan).
//
// A file's owner is part of its file id (FileID, Owner): the high bits are a
// tag of the writing node's id, so every node can tell, from a header it
// reads anyway, whose file it has indexed. A node removes only its own files
// and those of the dead nodes it adopted: a node proven dead (summary stale
// and lock free, to a node that found flocks shared with it:
// Summary.LockShared) is adopted by the one live node that takes its
// adoption lock (Dir.Adopt), which counts and evicts its files.
package clustercap
