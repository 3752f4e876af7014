// Package policytest provides an in-memory policy.Index for tests, the
// conformance suite and benchmarks of policy hosts.
package policytest

import (
	"sort"
	"sync"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
)

// Index is an in-memory policy.Index that also turns events into the access
// records a storage engine would send. It is safe for concurrent use.
type Index struct {
	mu      sync.Mutex
	entries map[uint64]policy.Entry
	ns      []abi.NamespaceRecord
}

// NewIndex returns an empty Index.
func NewIndex() *Index { return &Index{entries: map[uint64]policy.Entry{}} }

// Lookup implements policy.Index.
func (x *Index) Lookup(id uint64) (policy.Entry, bool) {
	x.mu.Lock()
	defer x.mu.Unlock()
	e, ok := x.entries[id]
	return e, ok
}

// Range implements policy.Index, in ascending ID order.
func (x *Index) Range(fn func(policy.Entry) bool) {
	x.mu.Lock()
	entries := make([]policy.Entry, 0, len(x.entries))
	for _, e := range x.entries {
		entries = append(entries, e)
	}
	x.mu.Unlock()
	sort.Slice(entries, func(i, j int) bool { return entries[i].ID < entries[j].ID })
	for _, e := range entries {
		if !fn(e) {
			return
		}
	}
}

// Namespaces implements policy.Index.
func (x *Index) Namespaces() []abi.NamespaceRecord {
	x.mu.Lock()
	defer x.mu.Unlock()
	return append([]abi.NamespaceRecord(nil), x.ns...)
}

// AddNamespace records a declared namespace.
func (x *Index) AddNamespace(r abi.NamespaceRecord) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.ns = append(x.ns, r)
}

// Len returns the number of entries.
func (x *Index) Len() int {
	x.mu.Lock()
	defer x.mu.Unlock()
	return len(x.entries)
}

// Apply updates the index with access records, as the engine does before
// it reports them to the policy: inserts and restores add entries, hits
// update them, removes delete them, pins and unpins count.
func (x *Index) Apply(recs []abi.AccessRecord) {
	x.mu.Lock()
	defer x.mu.Unlock()
	for _, r := range recs {
		e, ok := x.entries[r.Entry]
		switch r.Kind {
		case abi.AccessInsert, abi.AccessRestore:
			e = policy.Entry{ID: r.Entry, KeyHash: r.KeyHash, Size: r.Size, Mount: r.Mount, NS: r.NS,
				LastAccess: r.Time, Hits: r.Hits, Pins: e.Pins}
		case abi.AccessHit:
			if !ok {
				continue
			}
			e.LastAccess = r.Time
			e.Hits++
		case abi.AccessRemove:
			delete(x.entries, r.Entry)
			continue
		case abi.AccessPin:
			if !ok {
				continue
			}
			e.Pins++
		case abi.AccessUnpin:
			if !ok || e.Pins == 0 {
				continue
			}
			e.Pins--
		default:
			continue
		}
		x.entries[r.Entry] = e
	}
}
