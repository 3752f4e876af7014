//go:build invariants

package engine

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/plugins/lru"
)

// buildPolicy is a testPolicy built as policy.Host builds a plugin: from
// the index's namespaces and entries. Like the tiered plugin, it refuses to
// name a key of a namespace it was never told of. Its Namespace hook can
// be held at a gate.
type buildPolicy struct {
	*testPolicy
	nsMu    sync.Mutex
	nss     map[uint32]bool
	entered chan struct{} // closed when Namespace is first called (with gate)
	gate    chan struct{} // Namespace waits for it to close (nil: never)
}

func newBuildPolicy(idx policy.Index) *buildPolicy {
	p := &buildPolicy{testPolicy: newTestPolicy(1, 0), nss: map[uint32]bool{}}
	for _, ns := range idx.Namespaces() {
		p.nss[ns.NS] = true
	}
	var recs []abi.AccessRecord
	idx.Range(func(en policy.Entry) bool {
		recs = append(recs, abi.AccessRecord{Entry: en.ID, Kind: abi.AccessRestore, Size: en.Size, Mount: en.Mount, NS: en.NS, Time: en.LastAccess})
		return true
	})
	p.testPolicy.Access(context.Background(), recs)
	return p
}

func (p *buildPolicy) Namespace(ctx context.Context, rec abi.NamespaceRecord) (abi.NamespaceRecord, error) {
	if p.gate != nil {
		close(p.entered)
		<-p.gate
		p.gate = nil
	}
	p.nsMu.Lock()
	p.nss[rec.NS] = true
	p.nsMu.Unlock()
	return p.testPolicy.Namespace(ctx, rec)
}

func (p *buildPolicy) knows(ns NamespaceID) bool {
	p.nsMu.Lock()
	defer p.nsMu.Unlock()
	return p.nss[uint32(ns)]
}

func (p *buildPolicy) Name(ctx context.Context, recs []abi.NameRecord) error {
	for _, r := range recs {
		if !p.knows(NamespaceID(r.NS)) {
			return fmt.Errorf("namespace %d was not declared with kvhost_namespace", r.NS)
		}
	}
	return p.testPolicy.Name(ctx, recs)
}

func (p *buildPolicy) has(id uint64) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.entries[id] != nil
}

// TestReplacePolicyDuringDeclareTellsTheNewPolicy: a namespace whose
// declaration is in the old policy while the new one is built is declared
// to the new one before it serves, so that the new policy names its keys
// (issue 37: "namespace 0 was not declared with kvhost_namespace" after a
// reload while clients re-declared).
func TestReplacePolicyDuringDeclareTellsTheNewPolicy(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	built := make(chan *buildPolicy, 2)
	entered, gate := make(chan struct{}), make(chan struct{})
	first := true
	build := func(idx policy.Index) (policy.Policy, error) {
		p := newBuildPolicy(idx)
		if first {
			p.entered, p.gate, first = entered, gate, false
		}
		built <- p
		return p, nil
	}
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, NewPolicy: build})
	<-built
	var ns NamespaceID
	declared := make(chan error, 1)
	go func() {
		var err error
		ns, err = e.Declare(ctx, g)
		declared <- err
	}()
	<-entered // the declaration is in the old policy
	replaced := make(chan error, 1)
	go func() { replaced <- e.ReplacePolicy(ctx, build) }()
	next := <-built // built while the declaration was in the old policy
	close(gate)
	if err := <-declared; err != nil {
		t.Fatal(err)
	}
	if err := <-replaced; err != nil {
		t.Fatal(err)
	}
	if !next.knows(ns) {
		t.Fatalf("namespace %d, declared while the new policy was built, was never declared to it", ns)
	}
	c := newTestCache(t, e, ns, g, 2*g.BlocksPerKey(), layoutPlaneFirst)
	storeAndCheck(t, e, c, testKeys("k", 1), blockLists(rand.New(rand.NewPCG(1, 1)), 1, g.BlocksPerKey(), 0))
}

// TestReplacePolicyTellsTheNewPolicyOfChangesDuringItsBuild: an entry
// stored while the new policy is built is known to it, and an entry
// deleted meanwhile is not (it would be offered as a victim forever,
// skipped as stale every time).
func TestReplacePolicyTellsTheNewPolicyOfChangesDuringItsBuild(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, NewPolicy: func(idx policy.Index) (policy.Policy, error) {
		return newBuildPolicy(idx), nil
	}})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 4*g.BlocksPerKey(), layoutPlaneFirst)
	r := rand.New(rand.NewPCG(2, 2))
	keys := testKeys("k", 2)
	storeAndCheck(t, e, c, keys[:1], blockLists(r, 1, g.BlocksPerKey(), 0))
	gone := e.entryIDs()
	var next *buildPolicy
	err = e.ReplacePolicy(ctx, func(idx policy.Index) (policy.Policy, error) {
		next = newBuildPolicy(idx) // reads the index: one entry
		// Meanwhile (to the old policy): the entry read is deleted, a new one stored.
		if n, err := e.Delete(ctx, ns, keys[:1]); err != nil || n != 1 {
			return nil, fmt.Errorf("delete: %d, %w", n, err)
		}
		storeAndCheck(t, e, c, keys[1:], blockLists(r, 1, g.BlocksPerKey(), 2*g.BlocksPerKey()))
		return next, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range gone {
		if next.has(id) {
			t.Errorf("entry %d, deleted while the new policy was built, is still known to it", id)
		}
	}
	now := e.entryIDs()
	if len(now) != 1 || !next.has(now[0]) {
		t.Errorf("entries %v: the one stored while the new policy was built is unknown to it", now)
	}
}

// storeBetweenRanges is the index a replacement policy is built from,
// whose first Range (one shard's build) is followed, before the next
// Range (another shard's build), by stores through the engine: entries
// stored while the new policy is built.
type storeBetweenRanges struct {
	policy.Index
	mu    sync.Mutex
	calls int
	store func()
}

func (x *storeBetweenRanges) Range(fn func(policy.Entry) bool) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.Index.Range(fn)
	if x.calls++; x.calls == 1 {
		x.store()
	}
}

// TestReplacePolicyTellsEveryShardOfEntriesStoredBetweenItsRanges: a
// policy host builds each shard from its own Range of the index, keeping
// the entries routed to that shard. An entry stored after one shard's
// Range and before another's counts as read only if every Range passed it
// on, so it reaches the replacement as a RESTORE at the swap, whichever
// shard it is routed to: a shard that never learns of it never offers it
// as a victim.
func TestReplacePolicyTellsEveryShardOfEntriesStoredBetweenItsRanges(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	newLRU := func(idx policy.Index) (policy.Policy, error) {
		return policy.NewNative(func() guest.Policy { return lru.New() }, idx, policy.Config{Shards: 2, Logger: testLogger(t)})
	}
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, NewPolicy: newLRU})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 2*g.BlocksPerKey(), layoutPlaneFirst)
	r := rand.New(rand.NewPCG(7, 7))
	storeAndCheck(t, e, c, testKeys("before", 1), blockLists(r, 1, g.BlocksPerKey(), 0))
	var next *policy.Host
	err = e.ReplacePolicy(ctx, func(idx policy.Index) (policy.Policy, error) {
		view := &storeBetweenRanges{Index: idx, store: func() {
			keys := testKeys("during", 16)
			for i := range keys {
				storeAndCheck(t, e, c, keys[i:i+1], blockLists(r, 1, g.BlocksPerKey(), 0))
			}
		}}
		h, err := policy.NewNative(func() guest.Policy { return lru.New() }, view, policy.Config{Shards: 2, Logger: testLogger(t)})
		next = h
		return h, err
	})
	if err != nil {
		t.Fatal(err)
	}
	vs, err := next.Victims(ctx, abi.EvictRequest{Bytes: 1 << 62, Mount: abi.AnyMount}, 1024)
	if err != nil {
		t.Fatal(err)
	}
	offered := map[uint64]bool{}
	for _, v := range vs {
		offered[v.Entry] = true
	}
	var missing []uint64
	for _, id := range e.entryIDs() {
		if !offered[id] {
			missing = append(missing, id)
		}
	}
	if len(missing) > 0 {
		t.Fatalf("%d of %d entries are unknown to the replacement policy (never offered as victims): %v",
			len(missing), len(e.entryIDs()), missing)
	}
}

// entryIDs returns the ids of the indexed entries.
func (e *Engine) entryIDs() []uint64 {
	var out []uint64
	for _, en := range e.ix.Files().Entries() {
		out = append(out, en.ID)
	}
	return out
}
