//go:build invariants

package engine

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/plugins/lru"
)

// holdFixture is a directory that one engine filled with found files,
// and a second engine opened on it with a restart hold, a capacity of
// capFiles files and a hostile policy (it offers pinned entries as
// victims first, so only the engine's pins keep them).
type holdFixture struct {
	e      *Engine
	pol    *testPolicy
	ns     NamespaceID
	c      *testCache
	keys   [][]byte
	blocks [][]int
	paths  []string
	want   [][]byte // the found keys' bytes
}

// newHoldFixture stores found keys with a first engine (room for all),
// closes it and opens a second one on the same directory with hold and
// room for capFiles files, eviction from 6 of 8 eighths of it.
func newHoldFixture(t *testing.T, found, capFiles int, hold time.Duration) *holdFixture {
	t.Helper()
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := int64(4096 + g.KeyBytes())
	dir := t.TempDir()
	f := &holdFixture{keys: testKeys("hold", 24)}
	r := rand.New(rand.NewPCG(5, 6))
	f.blocks = blockLists(r, len(f.keys), 4, 0)

	first, err := testOpen(ctx, Config{
		Mounts: []Mount{{Path: dir, Capacity: 64 * fileLen}}, Policy: newTestPolicy(1, abi.OrderLayerMajor),
		IOWorkers: 2, Logger: testLogger(t),
	})
	if err != nil {
		t.Fatal(err)
	}
	ns, err := first.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, first, ns, g, 160, layoutPlaneFirst)
	for _, b := range f.blocks {
		c.fill(r, b)
	}
	for i := range found {
		storeAndCheck(t, first, c, f.keys[i:i+1], f.blocks[i:i+1])
		f.want = append(f.want, c.data(f.blocks[i]))
	}
	if err := first.Close(ctx); err != nil {
		t.Fatal(err)
	}

	f.pol = newTestPolicy(1, abi.OrderLayerMajor)
	f.pol.hostile = true
	f.e = openEngine(t, Config{
		Mounts:      []Mount{{Path: dir, Capacity: int64(capFiles) * fileLen, HighWatermark: 0.75, LowWatermark: 0.5}},
		Policy:      f.pol,
		RestartHold: hold,
	})
	if f.ns, err = f.e.Declare(ctx, g); err != nil {
		t.Fatal(err)
	}
	// The same bytes in the second engine's cache: the blocks are refilled
	// from the same seed.
	f.c = newTestCache(t, f.e, f.ns, g, 160, layoutPlaneFirst)
	r = rand.New(rand.NewPCG(5, 6))
	blockLists(r, len(f.keys), 4, 0)
	for _, b := range f.blocks {
		f.c.fill(r, b)
	}
	_, f.paths, _, _ = f.e.nm.names(ctx, f.e.tables.get(f.ns), f.keys)
	return f
}

// policyPins is how many pins the policy was told of, over all entries.
func (p *testPolicy) policyPins() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, c := range p.pins {
		n += c
	}
	return n
}

// loadFound loads the found keys and compares them with their bytes.
func (f *holdFixture) loadFound(t *testing.T, found int) {
	t.Helper()
	into := make([][]int, found)
	for i := range into {
		into[i] = []int{100 + 4*i, 101 + 4*i, 102 + 4*i, 103 + 4*i}
	}
	loadAndCompare(t, f.e, f.c, f.keys[:found], into, f.want)
}

func TestRestartHoldKeepsFoundFilesFromEviction(t *testing.T) {
	const found = 4
	f := newHoldFixture(t, found, 8, time.Hour)
	if n := f.e.HeldFound(); n != found {
		t.Fatalf("HeldFound = %d, want %d", n, found)
	}
	if n := f.pol.policyPins(); n != found {
		t.Fatalf("the policy was told of %d pins, want %d (one per found file)", n, found)
	}
	for i := found; i < len(f.keys); i++ {
		storeAndCheck(t, f.e, f.c, f.keys[i:i+1], f.blocks[i:i+1])
	}
	if f.e.Stats().Evictions == 0 {
		t.Fatal("the stores evicted nothing: the test proves nothing")
	}
	for i := range found {
		if !exists(f.paths[i]) {
			t.Fatalf("found file %d was evicted during the hold", i)
		}
	}
	f.loadFound(t, found)
	// A hold is no client pin: Delete removes a held file.
	if n, err := f.e.Delete(context.Background(), f.ns, f.keys[:1]); err != nil || n != 1 {
		t.Fatalf("Delete of a held key = %d, %v; want 1", n, err)
	}
	if exists(f.paths[0]) {
		t.Fatal("the deleted held key's file is still there")
	}
}

func TestRestartHoldFailsAStoreRatherThanEvictAFoundFile(t *testing.T) {
	const found = 8
	f := newHoldFixture(t, found, found, time.Hour) // full at start
	res := wait(t)(f.e.Store(context.Background(), StoreRequest{Cache: f.c.id, Keys: f.keys[found : found+1], Blocks: f.blocks[found : found+1]}))
	if k := res.Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, ErrNoSpace) {
		t.Fatalf("store into a mount full of held files: %v (%v), want failed with ErrNoSpace", k.Outcome, k.Err)
	}
	if k := res.Keys[0]; !strings.Contains(k.Err.Error(), "restart hold") {
		t.Fatalf("the store's error does not name the restart hold as the reason: %v", k.Err)
	}
	if n := f.e.Stats().Evictions; n != 0 {
		t.Fatalf("%d evictions during the hold, want 0", n)
	}
	f.loadFound(t, found)
}

func TestRestartHoldEnds(t *testing.T) {
	const found = 4
	f := newHoldFixture(t, found, 8, time.Hour)
	if n := f.e.HeldFound(); n != found {
		t.Fatalf("HeldFound = %d, want %d", n, found)
	}
	f.e.hold.timer.Reset(time.Millisecond) // the hour is up
	// HeldFound drops before the release tells the policy (Stats waits
	// for no policy call): wait for both.
	testwait.Until(t, "the restart hold to end and the policy to be told", testwait.Hang, func() bool {
		return f.e.HeldFound() == 0 && f.pol.policyPins() == 0
	})
	for i := found; i < len(f.keys); i++ {
		storeAndCheck(t, f.e, f.c, f.keys[i:i+1], f.blocks[i:i+1])
	}
	for i := range found {
		if exists(f.paths[i]) {
			t.Fatalf("found file %d survived eviction after the hold ended", i)
		}
	}
}

func TestRestartHoldOffHoldsNothing(t *testing.T) {
	f := newHoldFixture(t, 4, 8, 0)
	if n := f.e.HeldFound(); n != 0 {
		t.Fatalf("HeldFound = %d with no hold, want 0", n)
	}
	if n := f.pol.policyPins(); n != 0 {
		t.Fatalf("the policy was told of %d pins with no hold", n)
	}
}

// TestRestartHoldReachesAReplacementPolicy: a policy that replaces the
// current one during the hold (a reload) is told of the held files'
// pins, so that it offers the newer files as victims: stores go on
// evicting them rather than fail with no space. It fails when the new
// policy is told only of the files.
func TestRestartHoldReachesAReplacementPolicy(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := int64(4096 + g.KeyBytes())
	dir := t.TempDir()
	const found = 300 // more than one batch of the policy's victims
	newLRU := func(idx policy.Index) (policy.Policy, error) {
		return policy.NewNative(func() guest.Policy { return lru.New() }, idx, policy.Config{Shards: 1, Logger: testLogger(t)})
	}
	first := openEngine(t, Config{Mounts: []Mount{{Path: dir, Capacity: 1024 * fileLen}}, NewPolicy: newLRU})
	ns, err := first.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, first, ns, g, 8, layoutPlaneFirst)
	keys := testKeys("found", found)
	for i := range keys {
		storeAndCheck(t, first, c, keys[i:i+1], [][]int{{0, 1, 2, 3}})
	}
	first.Close(ctx)

	e := openEngine(t, Config{Mounts: []Mount{{Path: dir, Capacity: (found + 20) * fileLen, HighWatermark: 0.99, LowWatermark: 0.98}},
		NewPolicy: newLRU, RestartHold: time.Hour})
	if ns, err = e.Declare(ctx, g); err != nil {
		t.Fatal(err)
	}
	c = newTestCache(t, e, ns, g, 8, layoutPlaneFirst)
	store := func(what string, i int) {
		t.Helper()
		k := []byte(fmt.Sprintf("%s-%d", what, i))
		res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: [][]byte{k}, Blocks: [][]int{{0, 1, 2, 3}}}))
		if err := res.Keys[0].Err; err != nil {
			t.Fatalf("store %d %s: %v", i, what, err)
		}
	}
	for i := range 40 {
		store("before the reload", i)
	}
	if e.Stats().Evictions == 0 {
		t.Fatal("the stores evicted nothing: the test proves nothing")
	}
	if err := e.ReplacePolicy(ctx, newLRU); err != nil {
		t.Fatal(err)
	}
	for i := range 40 {
		store("after the reload", i)
	}
	if n := e.HeldFound(); n != found {
		t.Fatalf("HeldFound = %d, want %d: a found file was evicted", n, found)
	}
}

// TestRestartHoldComesBeforeTheClustersFirstCount: on a mount whose
// cluster is above its bound at start, Open's first count evicts none of
// the files it found while the hold lasts.
func TestRestartHoldComesBeforeTheClustersFirstCount(t *testing.T) {
	ctx := context.Background()
	probe := openNode(t, t.TempDir(), "probe", nil, 1)
	storeAndCheck(t, probe.e, probe.c, testKeys("p", 1), [][]int{{0, 1, 2, 3}})
	fileSize := probe.e.Stats().Mounts[0].Used
	dir := t.TempDir()
	a := clusterNode(t, dir, "a", 16*fileSize, time.Hour)
	for i := range 8 {
		storeAndCheck(t, a.e, a.c, testKeys(fmt.Sprintf("found%d", i), 1), [][]int{{0, 1, 2, 3}})
	}
	a.e.Close(ctx)
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: 4 * fileSize, ClusterInterval: time.Hour}},
		Policy: newTestPolicy(1, abi.OrderLayerMajor), NodeID: "a", RestartHold: time.Hour})
	if st := e.Stats(); st.Evictions != 0 || st.Entries != 8 || st.HeldFound != 8 {
		t.Fatalf("after Open: %d evictions, %d entries, %d held; want 0, 8, 8", st.Evictions, st.Entries, st.HeldFound)
	}
}

// unpinGate is a test policy whose first call with an unpin waits for
// release.
type unpinGate struct {
	*testPolicy
	once             sync.Once
	entered, release chan struct{}
}

func (p *unpinGate) Access(ctx context.Context, recs []abi.AccessRecord) error {
	for _, r := range recs {
		if r.Kind == abi.AccessUnpin {
			p.once.Do(func() { close(p.entered); <-p.release })
			break
		}
	}
	return p.testPolicy.Access(ctx, recs)
}

// TestStatsWaitsForNoPolicyCallOfTheRestartHold: while the hold's release
// is in its policy call, Stats (the watchdog's probe, /metrics) answers.
func TestStatsWaitsForNoPolicyCallOfTheRestartHold(t *testing.T) {
	f := newHoldFixture(t, 4, 8, time.Hour)
	dir := f.e.mounts[0].root
	f.e.Close(context.Background())
	pol := &unpinGate{testPolicy: newTestPolicy(1, abi.OrderLayerMajor), entered: make(chan struct{}), release: make(chan struct{})}
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: pol, RestartHold: time.Hour})
	e.hold.timer.Reset(time.Millisecond)
	<-pol.entered
	done := make(chan Stats, 1)
	go func() { done <- e.Stats() }()
	select {
	case st := <-done:
		if st.HeldFound != 0 {
			t.Errorf("HeldFound = %d during the release, want 0", st.HeldFound)
		}
	case <-time.After(time.Minute):
		t.Error("Stats waited for the restart hold's policy call")
	}
	close(pol.release)
}

// TestCloseWaitsForTheRestartHoldsRelease: a Close that comes while the
// hold's timer is telling the policy of its unpins returns only after
// that call, so that a caller may close its policy once Close returns;
// nothing is told the policy after Close.
func TestCloseWaitsForTheRestartHoldsRelease(t *testing.T) {
	f := newHoldFixture(t, 4, 8, time.Hour)
	dir := f.e.mounts[0].root
	f.e.Close(context.Background())
	pol := &unpinGate{testPolicy: newTestPolicy(1, abi.OrderLayerMajor), entered: make(chan struct{}), release: make(chan struct{})}
	e, err := testOpen(context.Background(), Config{Mounts: []Mount{{Path: dir}}, Policy: pol, RestartHold: time.Hour,
		IOWorkers: 2, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	if got := pol.policyPins(); got != 4 {
		t.Fatalf("policy told of %d pins after Open, want 4 (the found files)", got)
	}
	e.hold.timer.Reset(time.Millisecond)
	<-pol.entered // the release is in its policy call
	closed := make(chan error, 1)
	go func() { closed <- e.Close(context.Background()) }()
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) while the hold's release was in its policy call", err)
	case <-time.After(100 * time.Millisecond): // a check of absence: a slow machine can only pass it
	}
	close(pol.release)
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	if got := pol.policyPins(); got != 0 {
		t.Errorf("policy holds %d pins after the release and Close, want 0", got)
	}
	if e.hold.timer != nil || e.HeldFound() != 0 {
		t.Errorf("after Close: timer %v, %d held; want none", e.hold.timer, e.HeldFound())
	}
}

// TestCloseBeforeTheRestartHoldEndsTellsThePolicyNothing: Close during the
// hold stops its timer and unpins without a policy call (the policy is
// closing), and the timer never fires after it.
func TestCloseBeforeTheRestartHoldEndsTellsThePolicyNothing(t *testing.T) {
	f := newHoldFixture(t, 4, 8, time.Hour)
	dir := f.e.mounts[0].root
	f.e.Close(context.Background())
	pol := &unpinGate{testPolicy: newTestPolicy(1, abi.OrderLayerMajor), entered: make(chan struct{}), release: make(chan struct{})}
	close(pol.release) // never wait: entered closes on the first unpin
	e, err := testOpen(context.Background(), Config{Mounts: []Mount{{Path: dir}}, Policy: pol, RestartHold: time.Hour,
		IOWorkers: 2, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	timer := e.hold.timer
	if err := e.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if timer.Stop() {
		t.Error("the hold's timer was still armed after Close")
	}
	select {
	case <-pol.entered:
		t.Error("the policy was told of an unpin by Close")
	default:
	}
	if got := pol.policyPins(); got != 4 {
		t.Errorf("policy told of %d pins at Close, want the 4 of Open unchanged", got)
	}
	if e.HeldFound() != 0 {
		t.Errorf("%d held after Close, want 0", e.HeldFound())
	}
}

// TestRestartHoldDemotesHeldFilesToMakeRoom: a restart with a hot mount
// full of found files and room on the cold one. The stores after the
// start succeed: the tiered policy's eviction demotes held files to the
// cold mount, where they stay held (pinned, counted, never deleted) and
// loadable; nothing is deleted.
func TestRestartHoldDemotesHeldFilesToMakeRoom(t *testing.T) {
	for name, newPolicy := range tieredPolicies(t, nil) {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			g := smallGeometry(true)
			fileLen := int64(4096 + g.KeyBytes())
			const found, n = 8, 16
			hot, cold := t.TempDir(), t.TempDir()
			keys := testKeys("held", n)
			r := rand.New(rand.NewPCG(7, 8))
			blocks := blockLists(r, n, g.BlocksPerKey(), 0)
			fill := func(e *Engine) (NamespaceID, *testCache) {
				ns, err := e.Declare(ctx, g)
				if err != nil {
					t.Fatal(err)
				}
				c := newTestCache(t, e, ns, g, 4*n+4, layoutPlaneFirst)
				r := rand.New(rand.NewPCG(7, 8))
				blockLists(r, n, g.BlocksPerKey(), 0)
				for _, b := range blocks {
					c.fill(r, b)
				}
				return ns, c
			}
			first := openEngine(t, Config{
				Mounts:    []Mount{{Path: hot, Capacity: 4 * found * fileLen}, {Path: cold, Capacity: 4 * n * fileLen}},
				NewPolicy: newPolicy,
			})
			_, c := fill(first)
			want := make([][]byte, n)
			for i := range found {
				storeAndCheck(t, first, c, keys[i:i+1], blocks[i:i+1])
			}
			for i := range n {
				want[i] = c.data(blocks[i])
			}
			if err := first.Close(ctx); err != nil {
				t.Fatal(err)
			}

			e := openEngine(t, Config{
				Mounts: []Mount{
					{Path: hot, Capacity: found * fileLen, HighWatermark: 0.9, LowWatermark: 0.6},
					{Path: cold, Capacity: 4 * n * fileLen},
				},
				NewPolicy:   newPolicy,
				RestartHold: time.Hour,
			})
			ns, c := fill(e)
			if h := e.HeldFound(); h != found {
				t.Fatalf("HeldFound = %d, want %d", h, found)
			}
			for i := found; i < n; i++ {
				storeAndCheck(t, e, c, keys[i:i+1], blocks[i:i+1])
			}
			st, ts := e.Stats(), e.TierStats()
			if st.Evictions != 0 || ts.Demotions == 0 {
				t.Fatalf("%d deletions, %d demotions: want demotions only", st.Evictions, ts.Demotions)
			}
			if h := e.HeldFound(); h != found {
				t.Fatalf("HeldFound = %d after the demotions, want %d: a demoted file stays held", h, found)
			}
			demoted := 0
			for i := range found {
				if keyMount(e, ns, keys[i]) == 1 {
					demoted++
				}
			}
			if demoted == 0 {
				t.Fatal("no found key is on the cold mount")
			}
			if err := e.check(); err != nil {
				t.Fatal(err)
			}
			// The policy was told one pin per held file, on the file
			// where it is now: the moved ones' copies, the others' own.
			h := e.pol.Policy.(*switchPolicy).acquire()
			pins := h.pinCounts()
			h.calls.Done()
			e.ix.Files().Each(func(en *entry) {
				if held := en.Marks().Held; map[bool]int{true: 1}[held] != pins[en.ID] {
					t.Errorf("entry %d (mount %d, held %v): the policy was told of %d pins, want %d", en.ID, en.Mount, held, pins[en.ID], map[bool]int{true: 1}[held])
				}
			})
			into := blockLists(r, 1, g.BlocksPerKey(), 4*n)
			for i := range keys {
				loadAndCompare(t, e, c, keys[i:i+1], into, want[i:i+1])
			}
		})
	}
}

// TestRestartHoldPromotesNoHeldFile: a restart with a cold mount full of
// found files and room on the hot one, under a policy whose evictions on
// the cold mount move their victims to the hot one. A store on the cold
// mount may not take room by moving held files to an earlier mount: the
// hold lets them be demoted only, and promotions wait for its end. The
// store fails with no space naming the hold; the found files stay where
// they are, loadable.
func TestRestartHoldPromotesNoHeldFile(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := int64(4096 + g.KeyBytes())
	const found, n = 4, 5
	hot, cold := t.TempDir(), t.TempDir()
	keys := testKeys("cold", n)
	newPolicy := func() *evictPromotingPolicy {
		return &evictPromotingPolicy{&demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}}
	}
	fill := func(e *Engine) (NamespaceID, *testCache, [][]int) {
		ns, err := e.Declare(ctx, g)
		if err != nil {
			t.Fatal(err)
		}
		c := newTestCache(t, e, ns, g, 8*n, layoutPlaneFirst)
		r := rand.New(rand.NewPCG(9, 10))
		blocks := blockLists(r, n, g.BlocksPerKey(), 0)
		for _, b := range blocks {
			c.fill(r, b)
		}
		return ns, c, blocks
	}
	first := openEngine(t, Config{
		Mounts: []Mount{{Path: hot, Capacity: 4 * n * fileLen}, {Path: cold, Capacity: 4 * n * fileLen}},
		Policy: newPolicy(),
	})
	_, c, blocks := fill(first)
	want := make([][]byte, found)
	for i := range found {
		storeAndCheck(t, first, c, keys[i:i+1], blocks[i:i+1])
		want[i] = c.data(blocks[i])
	}
	if err := first.Close(ctx); err != nil {
		t.Fatal(err)
	}

	e := openEngine(t, Config{
		Mounts: []Mount{
			{Path: hot, Capacity: 4 * n * fileLen},
			{Path: cold, Capacity: found * fileLen, HighWatermark: 0.9, LowWatermark: 0.6},
		},
		Policy:      newPolicy(),
		RestartHold: time.Hour,
	})
	ns, c, blocks := fill(e)
	if h := e.HeldFound(); h != found {
		t.Fatalf("HeldFound = %d, want %d", h, found)
	}
	res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys[found:], Blocks: blocks[found:]}))
	for i := range found {
		if m := keyMount(e, ns, keys[i]); m != 1 {
			t.Errorf("found key %d is on mount %d during the hold, want 1: a held file was promoted", i, m)
		}
	}
	if p := e.TierStats().Promotions; p != 0 {
		t.Errorf("%d promotions during the hold, want 0", p)
	}
	if k := res.Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, ErrNoSpace) {
		t.Errorf("store into a cold mount full of held files: %v (%v), want failed with ErrNoSpace", k.Outcome, k.Err)
	}
	if err := e.check(); err != nil {
		t.Fatal(err)
	}
	into := blockLists(rand.New(rand.NewPCG(1, 2)), found, g.BlocksPerKey(), 4*n)
	loadAndCompare(t, e, c, keys[:found], into, want)
}

// heldUnpinCounter names "hot" keys to mount 0 and the others to mount 1
// (evictPromotingPolicy), demotes mount 0's victims to mount 1
// (demotingPolicy), counts the UNPINs it is sent and the calls for
// victims, and calls evicting, where set, at each of those.
type heldUnpinCounter struct {
	*evictPromotingPolicy
	unpins, evictions atomic.Int64
	evicting          func()
}

func (p *heldUnpinCounter) Evictions(ctx context.Context, req abi.EvictRequest, max int) ([]policy.Eviction, error) {
	p.evictions.Add(1)
	if p.evicting != nil {
		p.evicting()
	}
	return p.demotingPolicy.Evictions(ctx, req, max)
}

func (p *heldUnpinCounter) Access(ctx context.Context, recs []abi.AccessRecord) error {
	for _, r := range recs {
		if r.Kind == abi.AccessUnpin {
			p.unpins.Add(1)
		}
	}
	return p.testPolicy.Access(ctx, recs)
}

// TestRestartHoldLiftsNoPinWhereNoMountHasRoom: a restart with both
// mounts full of found files. A store on either finds no room that a
// demotion could take (the cold mount is full; nothing is later than
// it), so it fails at once with no space: the hold's pins are not lifted
// in the policy's view for a demotion round that cannot move anything,
// which cost two policy records per held file of the mount, per store.
func TestRestartHoldLiftsNoPinWhereNoMountHasRoom(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := int64(4096 + g.KeyBytes())
	const found = 4
	hot, cold := t.TempDir(), t.TempDir()
	keys := append(testKeys("hot", found+1), testKeys("cold", found+1)...)
	newPolicy := func() *heldUnpinCounter {
		return &heldUnpinCounter{evictPromotingPolicy: &evictPromotingPolicy{&demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}}}
	}
	fill := func(e *Engine) (NamespaceID, *testCache, [][]int) {
		ns, err := e.Declare(ctx, g)
		if err != nil {
			t.Fatal(err)
		}
		c := newTestCache(t, e, ns, g, 4*len(keys), layoutPlaneFirst)
		r := rand.New(rand.NewPCG(11, 12))
		blocks := blockLists(r, len(keys), g.BlocksPerKey(), 0)
		for _, b := range blocks {
			c.fill(r, b)
		}
		return ns, c, blocks
	}
	mounts := func(capFiles int64) []Mount {
		return []Mount{
			{Path: hot, Capacity: capFiles * fileLen, HighWatermark: 0.9, LowWatermark: 0.6},
			{Path: cold, Capacity: capFiles * fileLen, HighWatermark: 0.9, LowWatermark: 0.6},
		}
	}
	first := openEngine(t, Config{Mounts: mounts(4 * found), Policy: newPolicy()})
	_, c, blocks := fill(first)
	for i := range found {
		storeAndCheck(t, first, c, keys[i:i+1], blocks[i:i+1])                             // hot
		storeAndCheck(t, first, c, keys[found+1+i:found+2+i], blocks[found+1+i:found+2+i]) // cold
	}
	if err := first.Close(ctx); err != nil {
		t.Fatal(err)
	}

	pol := newPolicy()
	e := openEngine(t, Config{Mounts: mounts(found), Policy: pol, RestartHold: time.Hour})
	ns, c, blocks := fill(e)
	if h := e.HeldFound(); h != 2*found {
		t.Fatalf("HeldFound = %d, want %d", h, 2*found)
	}
	for _, i := range []int{found, 2*found + 1} { // the hot key, the cold one
		res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys[i : i+1], Blocks: blocks[i : i+1]}))
		if k := res.Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, ErrNoSpace) {
			t.Errorf("store of %s: %v (%v), want failed with ErrNoSpace", keys[i], k.Outcome, k.Err)
		}
	}
	if n := pol.unpins.Load(); n != 0 {
		t.Errorf("the policy was sent %d UNPINs during the hold, want 0: no mount had room for a demotion", n)
	}
	if n := pol.policyPins(); n != 2*found {
		t.Errorf("the policy was told of %d pins, want %d", n, 2*found)
	}
	for i, k := range keys {
		want := 0 // a found hot key
		switch {
		case i == found || i == 2*found+1:
			want = -1 // not stored
		case i > found:
			want = 1 // a found cold key
		}
		if m := keyMount(e, ns, k); m != want {
			t.Errorf("key %s on mount %d, want %d", k, m, want)
		}
	}
	if err := e.check(); err != nil {
		t.Fatal(err)
	}
}

// heldHot is a restart with the restart hold: the hot mount (0) is full of
// found files (capacity found files, eviction from 0.9 to 0.6) and the
// cold one (1) has room for all of them; the policy names "hot" keys to
// the hot mount and demotes its victims to the cold one.
type heldHot struct {
	e      *Engine
	pol    *heldUnpinCounter
	ns     NamespaceID
	c      *testCache
	keys   [][]byte // found+n "hot" keys, the first found stored before the restart
	blocks [][]int
	found  int
}

// newHeldHot stores found keys on the hot mount with a first engine and
// opens a second one on the same mounts with the hold, with the Config
// cfg returns for them (its FS and clock; Mounts, Policy and RestartHold
// are set here), or none where cfg is nil.
func newHeldHot(t *testing.T, found, n int, cfg func(hot, cold string) Config) *heldHot {
	t.Helper()
	ctx := context.Background()
	g := smallGeometry(true)
	fileLen := int64(4096 + g.KeyBytes())
	hot, cold := t.TempDir(), t.TempDir()
	f := &heldHot{keys: testKeys("hot", found+n), found: found}
	newPolicy := func() *heldUnpinCounter {
		return &heldUnpinCounter{evictPromotingPolicy: &evictPromotingPolicy{&demotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}}}
	}
	fill := func(e *Engine) *testCache {
		ns, err := e.Declare(ctx, g)
		if err != nil {
			t.Fatal(err)
		}
		f.ns = ns
		c := newTestCache(t, e, ns, g, 4*len(f.keys), layoutPlaneFirst)
		r := rand.New(rand.NewPCG(13, 14))
		f.blocks = blockLists(r, len(f.keys), g.BlocksPerKey(), 0)
		for _, b := range f.blocks {
			c.fill(r, b)
		}
		return c
	}
	first := openEngine(t, Config{Mounts: []Mount{{Path: hot, Capacity: 4 * int64(found) * fileLen}, {Path: cold}}, Policy: newPolicy()})
	c := fill(first)
	for i := range found {
		storeAndCheck(t, first, c, f.keys[i:i+1], f.blocks[i:i+1])
	}
	if err := first.Close(ctx); err != nil {
		t.Fatal(err)
	}
	var c2 Config
	if cfg != nil {
		c2 = cfg(hot, cold)
	}
	c2.Mounts = []Mount{
		{Path: hot, Capacity: int64(found) * fileLen, HighWatermark: 0.9, LowWatermark: 0.6},
		{Path: cold, Capacity: 4 * int64(found+n) * fileLen},
	}
	f.pol = newPolicy()
	c2.Policy, c2.RestartHold = f.pol, time.Hour
	f.e = openEngine(t, c2)
	f.c = fill(f.e)
	if h := f.e.HeldFound(); h != found {
		t.Fatalf("HeldFound = %d, want %d", h, found)
	}
	return f
}

// TestADemotionOfHeldFilesStopsWhenItsCallerGivesUp: a reservation on a
// mount full of files the restart hold pins, for a caller whose context is
// cancelled before it or while the policy picks the victims of the
// demotion round (the hold's pins lifted), demotes
// nothing and fails with the context's error: the store that gave up
// does not wait for the moves. The pins lifted are given back.
func TestADemotionOfHeldFilesStopsWhenItsCallerGivesUp(t *testing.T) {
	for _, when := range []string{"before", "while"} {
		t.Run(when, func(t *testing.T) {
			f := newHeldHot(t, 4, 1, nil)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if when == "before" {
				cancel()
			} else { // once the round has lifted the hold's pins
				f.pol.evicting = func() {
					if f.pol.unpins.Load() > 0 {
						cancel()
					}
				}
			}
			m, size := f.e.mounts[0], f.e.Stats().Mounts[0].Used/int64(f.found)
			wantReserveStopped(t, f.e, ctx, m, size, "reserve with a cancelled context")
			if n := f.e.TierStats().Demotions; n != 0 {
				t.Errorf("%d held files demoted for a caller that gave up, want 0", n)
			}
			if n := f.pol.policyPins(); n != f.found {
				t.Errorf("the policy was told of %d pins, want %d: the hold's pins given back", n, f.found)
			}
		})
	}
}

// TestARoundThatDemotesNoHeldFileIsNotRepeatedAtEachStore: a restart with
// the hot mount full of held files and a cold mount that refuses every
// file written there (EROFS). The first store's demotion round lifts the
// hold's pins, asks for victims and moves none; the stores after it, at
// the same instant, fail with no space without another round (which cost
// two policy records per held file of the mount, a call for victims and
// a failed copy per victim, each store). Once heldRetry has passed, a
// store runs a round again.
func TestARoundThatDemotesNoHeldFileIsNotRepeatedAtEachStore(t *testing.T) {
	const found, stores = 4, 5
	clock := newTestClock()
	f := newHeldHot(t, found, stores, func(hot, cold string) Config {
		inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
			if op == fsys.OpOpen && strings.HasPrefix(path, cold+string(filepath.Separator)) {
				return fsys.Fault{Err: syscall.EROFS}
			}
			return fsys.Fault{}
		})
		return Config{FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}, Now: clock.now}
	})
	store := func(i int) {
		t.Helper()
		res := wait(t)(f.e.Store(context.Background(), StoreRequest{Cache: f.c.id, Keys: f.keys[i : i+1], Blocks: f.blocks[i : i+1]}))
		if k := res.Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, ErrNoSpace) {
			t.Fatalf("store %d: %v (%v), want failed with ErrNoSpace", i, k.Outcome, k.Err)
		}
	}
	for i := found; i < found+stores-1; i++ {
		store(i)
	}
	if n := f.e.TierStats().MoveFailures; n == 0 {
		t.Fatal("no demotion to the cold mount failed: the test proves nothing")
	}
	if n := f.pol.unpins.Load(); n != found {
		t.Errorf("the policy was sent %d UNPINs by %d stores, want %d: one round, for the first", n, stores-1, found)
	}
	clock.advance(heldRetry)
	store(found + stores - 1)
	if n := f.pol.unpins.Load(); n != 2*found {
		t.Errorf("the policy was sent %d UNPINs once heldRetry had passed, want %d: a second round", n, 2*found)
	}
	if n := f.pol.policyPins(); n != found {
		t.Errorf("the policy was told of %d pins, want %d", n, found)
	}
}

// restarts is one mount and one lock file that successive engines open,
// as a daemon's restarts do, on a clock the test moves.
type restarts struct {
	dir, lock string
	clock     *testClock
	g         Geometry
	fileLen   int64
}

func newRestarts(t *testing.T) *restarts {
	g := smallGeometry(true)
	return &restarts{dir: t.TempDir(), lock: filepath.Join(t.TempDir(), "kvhost.sock.lock"), clock: newTestClock(), g: g, fileLen: int64(4096 + g.KeyBytes())}
}

// start opens the next engine with hold, room for capFiles files (0:
// plenty) and the lru policy, and its namespace's cache.
func (r *restarts) start(t *testing.T, hold time.Duration, capFiles int) (*Engine, *testCache) {
	e, c, _ := r.startNS(t, hold, capFiles)
	return e, c
}

// startNS is start, with the namespace.
func (r *restarts) startNS(t *testing.T, hold time.Duration, capFiles int) (*Engine, *testCache, NamespaceID) {
	t.Helper()
	capacity := 64 * r.fileLen
	if capFiles > 0 {
		capacity = int64(capFiles) * r.fileLen
	}
	newLRU := func(idx policy.Index) (policy.Policy, error) {
		return policy.NewNative(func() guest.Policy { return lru.New() }, idx, policy.Config{Shards: 1, Logger: testLogger(t)})
	}
	e, err := testOpen(context.Background(), Config{
		Mounts: []Mount{{Path: r.dir, Capacity: capacity, HighWatermark: 0.75, LowWatermark: 0.5}}, NewPolicy: newLRU,
		IOWorkers: 2, Logger: testLogger(t), LockFile: r.lock, RestartHold: hold, Now: r.clock.now,
	})
	if err != nil {
		t.Fatal(err)
	}
	ns, err := e.Declare(context.Background(), r.g)
	if err != nil {
		t.Fatal(err)
	}
	return e, newTestCache(t, e, ns, r.g, 64, layoutPlaneFirst), ns
}

// stop closes e, as a crash would end it (Close writes nothing of the
// hold: the process ends before its hold is over).
func stop(t *testing.T, e *Engine) {
	t.Helper()
	if err := e.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// TestRestartHoldIsNotReArmedByRestartsFasterThanIt: a daemon that
// restarts again and again before its hold is over (a crash loop) holds
// the files it finds only for what is left of the first start's hold: a
// restart inside it holds them for the rest, one after it holds none, and
// a store into the mount they fill evicts one rather than failing.
func TestRestartHoldIsNotReArmedByRestartsFasterThanIt(t *testing.T) {
	const found = 4
	r := newRestarts(t)
	e, c := r.start(t, time.Hour, 0)
	keys := testKeys("loop", found+1)
	blocks := [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}, {16, 17, 18, 19}}
	for i := range found {
		storeAndCheck(t, e, c, keys[i:i+1], blocks[i:i+1])
	}
	stop(t, e)

	r.clock.advance(30 * time.Minute) // a restart inside the hold
	e, _ = r.start(t, time.Hour, found)
	if n := e.HeldFound(); n != found {
		t.Fatalf("a restart 30m into a 1h hold holds %d files, want %d: the rest of the hold", n, found)
	}
	stop(t, e)

	r.clock.advance(31 * time.Minute) // the first start's hour is over
	e, c = r.start(t, time.Hour, found)
	t.Cleanup(func() { e.Close(context.Background()) })
	if n := e.HeldFound(); n != 0 {
		t.Fatalf("a restart after the first start's hold, with no process having run for a whole hold, holds %d files, want 0: the hold was re-armed", n)
	}
	res := wait(t)(e.Store(context.Background(), StoreRequest{Cache: c.id, Keys: keys[found:], Blocks: blocks[found:]}))
	if k := res.Keys[0]; k.Outcome != OutcomeStored {
		t.Fatalf("a store into the full mount after the hold: %v (%v), want stored", k.Outcome, k.Err)
	}
	if e.Stats().Evictions == 0 {
		t.Fatal("the store evicted nothing: the test proves nothing")
	}
}

// TestRestartHoldIsReArmedOnceAProcessRanThroughIt: a process that runs
// for a whole restart_hold marks the hold over, and the next start holds
// the files it finds again, for all of a new hold.
func TestRestartHoldIsReArmedOnceAProcessRanThroughIt(t *testing.T) {
	const found = 3
	r := newRestarts(t)
	e, c := r.start(t, 50*time.Millisecond, 0)
	keys := testKeys("settled", found)
	for i := range found {
		storeAndCheck(t, e, c, keys[i:i+1], [][]int{{4 * i, 4*i + 1, 4*i + 2, 4*i + 3}})
	}
	testwait.Until(t, "the process to run through its hold and record it over", testwait.Hang, func() bool {
		_, running, err := e.hold.record.running()
		return err == nil && !running
	})
	stop(t, e)

	r.clock.advance(time.Minute) // long after the first hold's start
	e, _ = r.start(t, time.Hour, 0)
	t.Cleanup(func() { e.Close(context.Background()) })
	if n := e.HeldFound(); n != found {
		t.Fatalf("a restart after a process ran through its hold holds %d files, want %d", n, found)
	}
}

// TestRestartHoldRecordThatCannotBeReadHoldsForTheWholeHold: a record
// that does not decode (a torn or foreign file) is no reason to hold
// nothing: the start holds its files for the whole restart_hold and
// writes a record of its own.
func TestRestartHoldRecordThatCannotBeReadHoldsForTheWholeHold(t *testing.T) {
	const found = 2
	r := newRestarts(t)
	e, c := r.start(t, time.Hour, 0)
	keys := testKeys("torn", found)
	for i := range found {
		storeAndCheck(t, e, c, keys[i:i+1], [][]int{{4 * i, 4*i + 1, 4*i + 2, 4*i + 3}})
	}
	stop(t, e)
	if err := os.WriteFile(r.lock+holdSuffix, []byte("{\"began_unix"), 0o644); err != nil {
		t.Fatal(err)
	}
	r.clock.advance(2 * time.Hour)
	e, _ = r.start(t, time.Hour, 0)
	t.Cleanup(func() { e.Close(context.Background()) })
	if n := e.HeldFound(); n != found {
		t.Fatalf("a start beside a torn record holds %d files, want %d", n, found)
	}
	began, running, err := e.hold.record.running()
	if err != nil || !running || !began.Equal(r.clock.now()) {
		t.Fatalf("the record after the start: began %v, running %v, %v; want this start's hold running", began, running, err)
	}
}

// TestACrashLoopEvictsItsOldestKeysNotItsNewest: after a restart that
// comes once the hold a crashed process began is over, stores into a
// full mount evict the oldest keys found there, by the policy's order,
// and every key acknowledged since stays: a hold re-armed by the restart
// left the stores only each other to evict, the newest first.
func TestACrashLoopEvictsItsOldestKeysNotItsNewest(t *testing.T) {
	const found, later = 4, 3
	ctx := context.Background()
	r := newRestarts(t)
	e, c := r.start(t, time.Hour, 0)
	keys := testKeys("newest", found+later)
	blocks := make([][]int, len(keys))
	for i := range blocks {
		blocks[i] = []int{4 * i, 4*i + 1, 4*i + 2, 4*i + 3}
	}
	for i := range found {
		r.clock.advance(time.Second)
		storeAndCheck(t, e, c, keys[i:i+1], blocks[i:i+1])
	}
	stop(t, e) // a crash 4 s into a 1 h hold

	r.clock.advance(time.Hour) // the next start comes after that hold
	e, c, ns := r.startNS(t, time.Hour, found+2)
	t.Cleanup(func() { e.Close(context.Background()) })
	for i := found; i < len(keys); i++ {
		r.clock.advance(time.Second)
		storeAndCheck(t, e, c, keys[i:i+1], blocks[i:i+1])
	}
	if e.Stats().Evictions == 0 {
		t.Fatal("the stores evicted nothing: the test proves nothing")
	}
	stored := func(i int) bool {
		n, err := e.Lookup(ctx, ns, keys[i:i+1])
		return err == nil && n == 1
	}
	for i := found; i < len(keys); i++ {
		if !stored(i) {
			t.Fatalf("key %d, stored after the restart, was evicted while keys found at start stayed", i)
		}
	}
	if stored(0) {
		t.Fatal("the oldest key found at start stayed while the stores evicted")
	}
}
