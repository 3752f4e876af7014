// Package outcome is the vocabulary of what becomes of a key in kvhost:
// what a job did with it (Outcome) and why it left the store (Reason).
// The engine, the wire protocol and the metrics speak it, each under its
// own names (aliases); the values are the protocol's, on the wire
// (docs/protocol.md). It imports nothing of the module.
package outcome

import "fmt"

// Outcome is what happened to one key of a job.
type Outcome uint8

// Outcomes of a key in a job. The values are on the wire.
const (
	// Pending: the job has not finished the key (never in the result of
	// a finished job).
	Pending Outcome = 0
	// Stored: the key was written and published.
	Stored Outcome = 1
	// Present: the key was already stored, by an earlier job or by
	// another job writing its file, which this one waited for; nothing
	// was written.
	Present Outcome = 2
	// NotAdmitted: the policy declined the key.
	NotAdmitted Outcome = 3
	// Loaded: the key was read into its blocks and verified.
	Loaded Outcome = 4
	// Missing: the key is not stored (or its file vanished or belongs to
	// another geometry); its blocks were not written.
	Missing Outcome = 5
	// Failed: the key failed (an error says why). A failed load may have
	// written into its blocks: their content is undefined.
	Failed Outcome = 6
	// Cancelled: the job was cancelled before the key was done. Only the
	// wire has it: the engine fails such a key with context.Canceled,
	// which the server sends as cancelled.
	Cancelled Outcome = 7
)

// String names the outcome.
func (o Outcome) String() string {
	switch o {
	case Pending:
		return "pending"
	case Stored:
		return "stored"
	case Present:
		return "present"
	case NotAdmitted:
		return "not admitted"
	case Loaded:
		return "loaded"
	case Missing:
		return "missing"
	case Failed:
		return "failed"
	case Cancelled:
		return "cancelled"
	}
	return fmt.Sprintf("outcome(%d)", uint8(o))
}

// Reason is why a key left the store (a removal record's reason).
type Reason uint8

// Reasons of a removal. The values are on the wire.
const (
	// Evicted: the key's file was evicted to make room on its mount (the
	// policy's victim), or deleted as a demotion's victim whose target
	// had no room.
	Evicted Reason = 1
	// ClusterEvicted: evicted to keep a cluster mount within its shared
	// capacity.
	ClusterEvicted Reason = 2
	// Deleted: a client deleted the key.
	Deleted Reason = 3
	// Purged: its namespace was purged (by this node, or by another
	// node's purge record on a cluster mount).
	Purged Reason = 4
	// Corrupt: its file failed its checks and was removed.
	Corrupt Reason = 5
	// Vanished: its file was removed or replaced behind the daemon's
	// back: another node evicted or deleted it on a shared mount, or an
	// operator removed it.
	Vanished Reason = 6
	// Moved: the key stays stored, on another mount: a demotion or
	// promotion changed its medium.
	Moved Reason = 7
)

// String names the reason as the protocol's documentation does.
func (r Reason) String() string {
	switch r {
	case Evicted:
		return "evicted"
	case ClusterEvicted:
		return "cluster-evicted"
	case Deleted:
		return "deleted"
	case Purged:
		return "purged"
	case Corrupt:
		return "corrupt"
	case Vanished:
		return "vanished"
	case Moved:
		return "moved"
	}
	return fmt.Sprintf("reason(%d)", uint8(r))
}
