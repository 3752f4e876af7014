// Package cluster is the cluster-wide capacity of a mount that several
// nodes share (docs/cluster.md, "Cluster-wide capacity").
//
// A mount with a cluster capacity is shared by several nodes whose
// files together stay within that bound. Each node publishes a summary of
// its own files (package clustercap) every interval and whenever a
// store needs more than it claimed; a node that finds the cluster over the
// high watermark evicts its own files ranked below the cut-off that every
// node's summaries give, and the others follow the cut-off it publishes.
// A node removes only its own files (the owner tag in the file id) and
// those of nodes proven dead (summary stale, lock file free, flocks found
// shared with them: probeLocks).
//
// The bound is agreed (agree, clustercap.Agree): the smallest capacity a
// running node configures, read from the summaries at every read. Those
// summaries are checked there too: a claim beyond the bound is ignored
// (unless its node's lock is held), a capacity, untagged bytes or a
// cut-off counts only from a node whose lock is held, and a capacity only
// above a floor (checkFields), a summary whose node has no lock file
// claims nothing (checkClaims), a peer counts at least its files this
// node saw lately, files of no summary's tag count once as untagged (as
// this node's index and its census of the mount find them: census.go),
// and peers of another policy or rank scale are named. Each tick checks
// the summary under this node's name (checkOwn) before it publishes its
// own.
//
// Fair shares: a node below its share of the bound whose store does not
// fit asks the room (its published claim) and waits for the nodes above
// theirs to evict down, which they do at their next claim raise or tick
// (Reserve, Tick).
//
// Ranks come from the policy (Host.Rank): comparable across nodes, lower
// evicted first. An entry the policy does not rank (a plugin without the
// feature, an entry it was not told of yet, a failed call) is ranked by
// its last access time.
//
// A Mount's lock and state are its own: the engine calls its whole
// operations (Tick, Reserve, ReserveGrant, GiveBack, Victims, ...), and
// the Mount reaches the engine only through its Group: the index, the
// space and a Host. Its state beside the claim is in parts, each a type
// and file of its own, under the Mount's lock: what the last read found
// (clusterView), the checks of the others' summaries (clusterAgree,
// agree.go), the adoption of dead nodes (clusterAdoption, adoption.go),
// the lock probes (clusterFlocks, flocks.go), this node's twins
// (clusterTwin, twin.go) and the census (census.go). A part's methods
// reach the rest of the Mount only through what they are passed: the
// site (the directory, this node's id and tag, the interval) and the
// values they read.
//
// Purges (docs/cluster.md, "Purges"): a node removes only the files it
// may evict (MayEvict: its own, an adopted dead node's), since another
// node's client pin or load is invisible to it and a load that finds its
// pinned file gone fails the inference server's worker. So a purge tells
// the other nodes through the cluster directory: a purge record
// (WritePurge) that covers every file of the namespace on the mount last
// written at or before it, and on each node's mounts without a cluster
// capacity (Covers). Each node applies the records at every tick
// (applyPurges: the first, before the engine opens, after its rebuild),
// as it evicts, its client pins keeping their files until they end, and
// refuses to index a covered file found on the disk meanwhile (PurgedAt).
package cluster
