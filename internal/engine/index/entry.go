package index

import (
	"slices"
	"sync/atomic"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/host/policy"
)

// KeyID names a key across namespaces: its geometry fingerprint and bytes.
type KeyID struct {
	FP  uint64
	Key string
}

type keyRef struct {
	e   *Entry
	idx int // index of the key in the file
}

// Entry is one published file, or a spare or temporary file left on disk
// (spare). Fields
// other than pins, leases, hits, last, gone, orphan, retryAt, verified,
// checked and removeFailed are immutable after it is indexed.
type Entry struct {
	ID    uint64
	NS    uint32 // the engine's NamespaceID
	FP    uint64
	Mount int
	Path  string
	Size  int64
	Keys  []string
	Ident fsys.Identity // of the file when it was indexed
	FID   uint64        // the header's file id (0: written before ids)
	// verified is when the file was last checked (Unix nanoseconds).
	Verified atomic.Int64
	// Checked is what of the file's payload is known to match its
	// checksums, and at which ctime (nil: nothing).
	Checked atomic.Pointer[Checked]
	// removeFailed: a removal of the file failed (disposeIfSame), which
	// counted in Stats.RemoveFailures; later failures are retries.
	RemoveFailed atomic.Bool
	// guarded by Index.mu
	pins   int32
	leases int32 // client pins (Engine.Pin), also counted in pins
	hits   uint32
	Last   int64
	gone   bool // removed from the index
	// held: pinned by the restart hold (hold.go), in Pins.heldOrder under
	// its mount while indexed.
	held bool
	// lifted: held, and the hold's pin lifted in the policy's view for a
	// round of demoteHeld (hold.go): policyEntry does not count it.
	lifted bool
	// orphan: unindexed while another job held its path, which removes
	// the file (flight.go); counted in its mount's orphaned until then.
	orphan bool
	// retryAt: in left, when retryLeft may try to remove the file again
	// (Unix nanoseconds; 0: at the next eviction on its mount).
	retryAt int64
	// spare: not a published file but a spare (spares.go) or a temporary
	// file whose removal failed, only ever in Leaving.left (LeaveSpare): it
	// has no keys, and its name, this engine's own, says which file it is.
	Spare bool
	// heir: the file at a move's target, holding the same keys, that a
	// move dropped this entry for (demote.go, dropCopy); guarded by
	// Index.mu.
	heir *Entry
	// file: the file held open for the entry's client pins, where
	// another engine may remove it (pinfiles.go); nil otherwise. Set
	// while leases > 0, cleared by the last client unpin, both with
	// Index.mu held; a load reads it without the lock
	// (pinnedFile.acquire).
	File atomic.Pointer[PinnedFile]
}

// movePins is en's pins that keep it from moving: all of them, or with
// held those of loads and clients only, not the restart hold's.
// Index.mu is held.
func (en *Entry) movePins(held bool) int32 {
	if held && en.held {
		return en.pins - 1
	}
	return en.pins
}

func (en *Entry) policyEntry() policy.Entry {
	pins := en.pins
	if en.lifted {
		pins--
	}
	return policy.Entry{
		ID: en.ID, KeyHash: abi.KeyHash([]byte(en.Keys[0])), Size: uint64(en.Size), Mount: uint32(en.Mount),
		NS: uint32(en.NS), LastAccess: uint64(en.Last), Hits: en.hits, Pins: uint32(pins),
	}
}

// Access is the policy's record of an access of kind to en at t.
func (en *Entry) Access(kind uint32, t int64) abi.AccessRecord {
	return abi.AccessRecord{
		Entry: en.ID, Time: uint64(t), Size: uint64(en.Size), KeyHash: abi.KeyHash([]byte(en.Keys[0])),
		Kind: kind, Mount: uint32(en.Mount), NS: uint32(en.NS), Hits: en.hits,
	}
}

// SameKeys reports whether en and o hold the same keys of one namespace
// fingerprint, at the same positions, in files of one size: the same KV,
// whichever node wrote each file.
func (en *Entry) SameKeys(o *Entry) bool {
	return en.FP == o.FP && en.Size == o.Size && slices.Equal(en.Keys, o.Keys)
}

// UnknownWithID reports whether en is an entry of unknown identity, never
// indexed (publish: the fstat after its rename and the stat of its name
// failed, so it was left), whose file is the one with header id fid: the
// id alone decides, as it never repeats.
func (en *Entry) UnknownWithID(fid uint64) bool {
	return en.Ident.Ino == 0 && en.FID != 0 && en.FID == fid
}
