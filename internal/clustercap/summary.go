package clustercap

import (
	"encoding/json"
	"errors"
	"fmt"
)

// SummaryVersion is the version of the summary format this package
// writes. It reads that version and every later one, for the fields it
// knows (forward-compatible, so that nodes of two versions of kvhost can
// share a mount during a rolling upgrade): a later version may add fields,
// which this one ignores, but must keep the meaning of every field here,
// Bytes and Claim above all, which bound the mount; a format that cannot
// keep them must be written under another file name. A node whose summary
// does not decode at all still counts (docs/cluster.md, "Coordinator
// lost").
//
// Version 2 added the bound (Capacity, Bound, BoundFrom), the policy's
// name (Policy), the run (Run) and the bytes of files without an owner
// tag (Untagged); a version-1 summary decodes with them zero, read as
// "not said" (docs/cluster.md, "Summaries").
const SummaryVersion = 2

// MinSummaryVersion is the oldest summary version this package reads: a
// node of a kvhost before SummaryVersion still counts in the bound.
const MinSummaryVersion = 1

// MaxPolicyName bounds Summary.Policy.
const MaxPolicyName = 128

// MaxTouches bounds Summary.Touches: the other nodes' files a node reports
// having used since its last summary (the most recent first are kept).
const MaxTouches = 4096

// MaxBytes bounds the byte counts a summary states (Bytes, Claim and its
// sketch's): sums of a few such counts stay far from overflow, and the
// sums this package makes saturate at math.MaxInt64 beyond them.
const MaxBytes = 1 << 62

// MaxSummarySize bounds a summary file: a reader reads at most this many
// bytes of one (a full summary takes a few hundred KiB at most).
const MaxSummarySize = 1 << 20

// ErrSummary means a summary file does not decode or is inconsistent.
var ErrSummary = errors.New("clustercap: bad summary")

// Summary is what one node publishes about its files on a shared mount.
type Summary struct {
	Version int    `json:"version"` // SummaryVersion
	Node    string `json:"node"`    // the node's id, 1..64 bytes
	Tag     uint32 `json:"tag"`     // Tag(Node), the owner tag of the node's file ids
	// Seq grows with every summary the node publishes.
	Seq uint64 `json:"seq"`
	// Time is when it was published (Unix nanoseconds, the node's clock);
	// Interval the node's publication period (nanoseconds).
	Time     int64 `json:"time"`
	Interval int64 `json:"interval"` // publication period, nanoseconds (> 0)
	// Bytes is what the node's own files (and its stores in flight) take;
	// Claim is the most it may hold before it publishes again (>= Bytes).
	Bytes int64 `json:"bytes"`
	Claim int64 `json:"claim"` // bytes, >= Bytes
	// Cut is the cut-off rank the node evicted below when it last found
	// the cluster over its bound, at CutTime (0: none).
	Cut     uint64 `json:"cut,omitempty"`
	CutTime int64  `json:"cut_time,omitempty"` // Unix nanoseconds when Cut was computed; 0 without one
	// Sketch is the node's bytes by rank.
	Sketch Sketch `json:"sketch"`
	// Touches are other nodes' files this node used since its previous
	// summary, with their rank here: the owner ranks them at least that
	// high, so a file hot on another node is not evicted as cold.
	Touches []Touch `json:"touches,omitempty"`
	// Adopted names the dead nodes whose files Bytes counts: their
	// adoption is this node's and its walk of the mount for their files
	// completed. Until a live node's summary names a dead node so, every
	// node counts the dead node's last summary (Unclaimed). Summaries of
	// nodes that predate the field decode with none.
	Adopted []string `json:"adopted,omitempty"`
	// LockShared names the nodes with which this node found flocks shared
	// on the mount: a probe by one of the two found the other's lock file
	// held while the other ran. Only such a pair may take the other's
	// free lock for proof of death (docs/cluster.md, "Dead nodes"): on a
	// mount whose flocks stay on each node (NFS with local_lock=flock or
	// nolock) every probe of another node's lock finds it free. Summaries
	// of nodes that predate the field decode with none.
	LockShared []string `json:"lock_shared,omitempty"`
	// Capacity is the cluster_capacity this node's configuration gives
	// the mount (bytes; 0: not said, a node before version 2). Bound is
	// the bound the node applies, agreed with the others (Agree), and
	// BoundFrom the node whose configured capacity it is.
	Capacity  int64  `json:"capacity,omitempty"`
	Bound     int64  `json:"bound,omitempty"`
	BoundFrom string `json:"bound_from,omitempty"`
	// Policy names the node's placement policy ("" : not said): nodes
	// ranking by other policies evict by ranks that do not compare.
	Policy string `json:"policy,omitempty"`
	// Run is when the node's current run started (Unix nanoseconds, its
	// clock; 0: not said): a lock found free in two runs of a node says
	// nothing of whether flocks reach it (a node restarting between two
	// probes).
	Run int64 `json:"run,omitempty"`
	// Untagged is the bytes of the files without an owner tag (written by
	// a kvhost before owner tags) this node found on the mount: they count
	// against the bound once (Agree's callers take the largest report).
	Untagged int64 `json:"untagged,omitempty"`
}

// MaxAdopted bounds Summary.Adopted, and Summary.LockShared too.
const MaxAdopted = 4096

// Touch is a use of another node's file: its file id, its rank after the
// use on the node that used it (the policy's, or for LRU the time of the
// use) and the time of the use (Unix nanoseconds; 0 from nodes that did
// not send it), which the owner reports to its policy as a hit.
type Touch struct {
	ID   uint64 `json:"id"`             // the file's id (its header's, owner tag in the high bits)
	Rank uint64 `json:"rank"`           // its rank after the use, on the node that used it
	Time int64  `json:"time,omitempty"` // Unix nanoseconds of the use; 0 if not sent
}

// Encode validates s, of SummaryVersion, and returns its encoding.
func Encode(s *Summary) ([]byte, error) {
	if s.Version != SummaryVersion {
		return nil, fmt.Errorf("%w: node %q: writing version %d, want %d", ErrSummary, s.Node, s.Version, SummaryVersion)
	}
	if err := s.Validate(); err != nil {
		return nil, err
	}
	return json.Marshal(s)
}

// Decode decodes and validates a summary: of MinSummaryVersion or a
// later one, whose fields this version does not know are ignored.
func Decode(b []byte) (*Summary, error) {
	var s Summary
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrSummary, err)
	}
	if err := s.Validate(); err != nil {
		return nil, err
	}
	return &s, nil
}

// Validate checks the summary's fields: its version is MinSummaryVersion
// or a later one (read for the fields this version knows).
func (s *Summary) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: node %q: %s", ErrSummary, s.Node, fmt.Sprintf(format, args...))
	}
	switch {
	case s.Version < MinSummaryVersion:
		return bad("version %d, want %d or later", s.Version, MinSummaryVersion)
	case s.Node == "" || len(s.Node) > 64:
		return bad("node name of %d bytes, want 1..64", len(s.Node))
	case s.Tag != Tag(s.Node):
		return bad("tag %#x, want %#x (the tag of its name)", s.Tag, Tag(s.Node))
	case s.Interval <= 0:
		return bad("interval %d, want > 0", s.Interval)
	case s.Bytes < 0 || s.Claim < s.Bytes || s.Claim > MaxBytes:
		return bad("bytes %d, claim %d: want 0 <= bytes <= claim <= %d", s.Bytes, s.Claim, int64(MaxBytes))
	case s.Capacity < 0 || s.Capacity > MaxBytes || s.Bound < 0 || s.Bound > MaxBytes:
		return bad("capacity %d, bound %d: want 0..%d", s.Capacity, s.Bound, int64(MaxBytes))
	case s.Untagged < 0 || s.Untagged > MaxBytes:
		return bad("untagged bytes %d: want 0..%d", s.Untagged, int64(MaxBytes))
	case len(s.Policy) > MaxPolicyName:
		return bad("policy name of %d bytes, want at most %d", len(s.Policy), MaxPolicyName)
	case len(s.BoundFrom) > 64:
		return bad("bound_from of %d bytes, want at most 64", len(s.BoundFrom))
	case len(s.Touches) > MaxTouches:
		return bad("%d touches, want at most %d", len(s.Touches), MaxTouches)
	case len(s.Adopted) > MaxAdopted:
		return bad("%d adopted nodes, want at most %d", len(s.Adopted), MaxAdopted)
	case len(s.LockShared) > MaxAdopted:
		return bad("%d nodes sharing flocks, want at most %d", len(s.LockShared), MaxAdopted)
	}
	for _, n := range s.Adopted {
		if err := checkNode(n); err != nil || len(n) > 64 || n == s.Node {
			return bad("adopted node %q: want another node's name of 1..64 bytes", n)
		}
	}
	for _, n := range s.LockShared {
		if err := checkNode(n); err != nil || len(n) > 64 || n == s.Node {
			return bad("node %q sharing flocks: want another node's name of 1..64 bytes", n)
		}
	}
	if err := s.Sketch.Validate(); err != nil {
		return bad("%v", err)
	}
	return nil
}
