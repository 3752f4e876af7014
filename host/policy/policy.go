// Package policy hosts placement-policy plugins: wasm modules that implement
// ABI v1 (package abi), run in wazero, and the native Go policies kvhost falls
// back to when a plugin keeps failing.
//
// The engine talks to a Policy. Every implementation is safe for concurrent
// use, validates everything a plugin returns, and never lets a plugin name a
// path outside the cache root, pick a pinned or unknown victim, or stall a call
// beyond its deadline.
package policy

import (
	"context"

	"github.com/kvhost/kvhost/abi"
)

// Policy is what the storage engine asks of a placement policy.
type Policy interface {
	// Features reports the optional hooks the policy implements.
	Features() abi.Feature
	// Namespace returns the chunk layout of a namespace: rec.KeysPerFile and
	// rec.Order are filled in and validated. Without abi.FeatureNamespace it
	// returns the default layout.
	Namespace(ctx context.Context, rec abi.NamespaceRecord) (abi.NamespaceRecord, error)
	// Name fills Mount and PathBuf/PathLen of every record. Every returned
	// path has passed abi.CheckPath and every mount is < MountCount.
	Name(ctx context.Context, recs []abi.NameRecord) error
	// Admit fills Admit of every record (1 when the policy has no admit hook).
	Admit(ctx context.Context, recs []abi.AdmitRecord) error
	// Access reports events on stored entries.
	Access(ctx context.Context, recs []abi.AccessRecord) error
	// Victims returns eviction candidates for req, lowest score first, at most
	// max of them. Every victim exists in the Index, is unpinned, is on the
	// requested mount and appears once.
	Victims(ctx context.Context, req abi.EvictRequest, max int) ([]abi.Victim, error)
	// Close releases the policy's resources.
	Close(ctx context.Context) error
}

// Entry is what the engine's index knows about one stored entry (a file).
type Entry struct {
	ID         uint64 // the handle the policy sees as AccessRecord.Entry
	KeyHash    uint64 // abi.KeyHash of the entry's first key
	Size       uint64 // bytes of the file
	Mount      uint32 // index of the entry's mount
	NS         uint32 // namespace id
	LastAccess uint64 // Unix nanoseconds
	Hits       uint32 // accesses counted so far (AccessRecord.Hits of a restore)
	Pins       uint32 // outstanding pins; a pinned entry is never a victim
}

// Index is the engine's view of what is stored. A policy host uses it to
// validate victims and to rebuild a replaced instance's state. Implementations
// must be safe for concurrent use.
type Index interface {
	// Lookup returns the entry with the given ID.
	Lookup(id uint64) (Entry, bool)
	// Range calls fn for every entry until fn returns false.
	Range(fn func(Entry) bool)
	// Namespaces returns every namespace declared so far.
	Namespaces() []abi.NamespaceRecord
}

// Ranker is the part of a policy that ranks entries for a bound several
// nodes share (abi.FeatureRank). Host implements it.
type Ranker interface {
	// Rank fills Rank and State of every record (Entry and Time are the
	// caller's): abi.RankKnown with the plugin's rank, or abi.RankUnknown
	// where the plugin does not know the entry, and for every record when
	// the policy has no abi.FeatureRank (the caller then ranks the entry
	// itself, by its last access).
	Rank(ctx context.Context, recs []abi.RankRecord) error
}

// Eviction is one victim and what to do with it: delete it (Target.Mount
// abi.NoMount) or move its file to another mount (abi.FeatureDemote).
type Eviction struct {
	abi.Victim
	Target abi.VictimTarget // Mount abi.NoMount deletes the victim; another mount moves it there
}

// Tiering is the part of a policy that uses the ABI's tiering features
// (abi.FeatureMounts, abi.FeatureAdmitMount, abi.FeatureDemote,
// abi.FeatureTick). Host implements it; each method does nothing a plugin
// without the feature could notice.
type Tiering interface {
	// UpdateMounts describes every mount, in index order. The policy keeps
	// the last description, sends it to plugins with abi.FeatureMounts and
	// checks the mounts of their outputs against its length.
	UpdateMounts(ctx context.Context, recs []abi.MountRecord) error
	// Evictions is Victims with a target per victim: abi.NoMount (delete)
	// unless the policy has abi.FeatureDemote and chose a mount.
	Evictions(ctx context.Context, req abi.EvictRequest, max int) ([]Eviction, error)
	// Tick calls the plugin's tick hook (abi.FeatureTick) on every shard and
	// returns the moves it asks for, at most max per shard, validated: each
	// entry exists, is unpinned, and the target is another valid mount.
	// Without the feature it returns nothing.
	Tick(ctx context.Context, req abi.TickRequest, max int) ([]abi.Move, error)
}
