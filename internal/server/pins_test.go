package server_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/protocol"
)

// waitPins polls the engine until it holds want pins.
func waitPins(t *testing.T, f *fixture, want int) {
	t.Helper()
	testwait.Until(t, fmt.Sprintf("the engine to hold %d pins", want), testwait.Hang, func() bool {
		n, _ := f.eng.PinStats()
		return n == want
	})
}

func TestPinOverTheWire(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t, server.Config{})
	c := f.dial(t)
	k := newCache(t, c)
	rng := rand.New(rand.NewPCG(1, 2))
	k.store(t, "a", []uint32{0, 1}, rng)
	k.store(t, "b", []uint32{2, 3}, rng)

	p, err := c.Pin(ctx, k.ns.ID, [][]byte{[]byte("a"), []byte("nope"), []byte("b")}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if p.ID == 0 || !slices.Equal(p.Held, []bool{true, false, true}) {
		t.Fatalf("Pin = %+v; want an id and [true false true]", p)
	}
	// Delete refuses pinned keys: nothing removed, both still found.
	if n, err := c.Delete(ctx, k.ns.ID, [][]byte{[]byte("a"), []byte("b")}); err != nil || n != 0 {
		t.Fatalf("Delete of pinned keys = %d, %v; want 0", n, err)
	}
	if n, _ := c.Lookup(ctx, k.ns.ID, [][]byte{[]byte("a"), []byte("b")}); n != 2 {
		t.Fatalf("Lookup after a refused Delete = %d, want 2", n)
	}
	// Another connection cannot release it: ids are per connection.
	other := f.dial(t)
	if n, err := other.Unpin(ctx, p.ID); err != nil || n != 0 {
		t.Fatalf("another connection's Unpin = %d, %v; want 0", n, err)
	}
	if n, err := c.Unpin(ctx, p.ID); err != nil || n != 2 {
		t.Fatalf("Unpin = %d, %v; want 2", n, err)
	}
	if n, err := c.Delete(ctx, k.ns.ID, [][]byte{[]byte("a")}); err != nil || n != 1 {
		t.Fatalf("Delete after Unpin = %d, %v; want 1", n, err)
	}
	// Nothing stored: no pin id.
	if p, err := c.Pin(ctx, k.ns.ID, [][]byte{[]byte("a")}, time.Second); err != nil || p.ID != 0 || p.Held[0] {
		t.Fatalf("Pin of a deleted key = %+v, %v", p, err)
	}
}

func TestPinsEndWithTheConnectionAndTheLease(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t, server.Config{})
	c := f.dial(t)
	k := newCache(t, c)
	k.store(t, "a", []uint32{0, 1}, rand.New(rand.NewPCG(1, 2)))

	// Lease: released by the daemon; Unpin then finds nothing.
	p, err := c.Pin(ctx, k.ns.ID, [][]byte{[]byte("a")}, 20*time.Millisecond)
	if err != nil || !p.Held[0] {
		t.Fatalf("Pin = %+v, %v", p, err)
	}
	waitPins(t, f, 0)
	if n, err := c.Unpin(ctx, p.ID); err != nil || n != 0 {
		t.Fatalf("Unpin after the lease = %d, %v; want 0", n, err)
	}

	// Connection end: a second client's pin goes when it closes.
	c2 := f.dial(t)
	ns2, err := c2.Declare(ctx, geo)
	if err != nil {
		t.Fatal(err)
	}
	if p, err := c2.Pin(ctx, ns2.ID, [][]byte{[]byte("a")}, 0); err != nil || !p.Held[0] {
		t.Fatalf("Pin = %+v, %v", p, err)
	}
	waitPins(t, f, 1)
	c2.Close()
	waitPins(t, f, 0)
	if n, err := c.Delete(ctx, k.ns.ID, [][]byte{[]byte("a")}); err != nil || n != 1 {
		t.Fatalf("Delete after the pinning connection closed = %d, %v; want 1", n, err)
	}
}

// TestPinLoadableAnswersNoCacheWhileNoWorkerCanLoad checks PinLoadable: a
// scheduler's connection, which registers no cache, pins stored keys only
// while another connection has a cache of the namespace registered (its
// loads have somewhere to go), and a plain Pin is unchanged.
func TestPinLoadableAnswersNoCacheWhileNoWorkerCanLoad(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t, server.Config{})
	worker := f.dial(t)
	k := newCache(t, worker)
	k.store(t, "a", []uint32{0, 1}, rand.New(rand.NewPCG(1, 2)))
	sched := f.dial(t)
	ns, err := sched.Declare(ctx, geo)
	if err != nil {
		t.Fatal(err)
	}
	keys := [][]byte{[]byte("a"), []byte("nope")}

	p, err := sched.PinLoadable(ctx, ns.ID, keys, 0, "")
	if err != nil || p.ID == 0 || p.NoCache || !slices.Equal(p.Held, []bool{true, false}) {
		t.Fatalf("PinLoadable with the worker's cache registered = %+v, %v; want a pin of [true false]", p, err)
	}
	if n, err := sched.Unpin(ctx, p.ID); err != nil || n != 1 {
		t.Fatalf("Unpin = %d, %v; want 1", n, err)
	}

	if err := worker.UnregisterCache(ctx, k.id); err != nil {
		t.Fatal(err)
	}
	p, err = sched.PinLoadable(ctx, ns.ID, keys, 0, "")
	if err != nil || p.ID != 0 || !p.NoCache || !slices.Equal(p.Held, []bool{false, false}) {
		t.Fatalf("PinLoadable with no cache registered = %+v, %v; want NoCache and nothing pinned", p, err)
	}
	if n, _ := f.eng.PinStats(); n != 0 {
		t.Fatalf("the engine holds %d pins after a PinLoadable answered NoCache", n)
	}
	// A plain Pin does not ask for a cache: the key is stored.
	if p, err := sched.Pin(ctx, ns.ID, keys, 0); err != nil || p.ID == 0 || p.NoCache || !p.Held[0] {
		t.Fatalf("Pin with no cache registered = %+v, %v; want a pin of the stored key", p, err)
	}

	// A cache on a new connection counts again; its connection's end
	// takes it away.
	worker2 := f.dial(t)
	newCache(t, worker2)
	if p, err := sched.PinLoadable(ctx, ns.ID, keys, 0, ""); err != nil || p.NoCache || !p.Held[0] {
		t.Fatalf("PinLoadable with a second worker's cache = %+v, %v; want the stored key pinned", p, err)
	}
	worker2.Close()
	testwait.Until(t, "the closed connection's cache to stop counting", testwait.Hang, func() bool {
		p, err := sched.PinLoadable(ctx, ns.ID, keys, 0, "")
		return err == nil && p.NoCache
	})
}

// TestPinLoadableOfAGroupCountsOnlyThatGroupsCaches checks groups: a
// PinLoadable naming a group pins only while a connection of that group
// has a cache of the namespace registered (another engine's workers, in
// another group or none, do not count), and a connection joins one group,
// before its caches.
func TestPinLoadableOfAGroupCountsOnlyThatGroupsCaches(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t, server.Config{})
	other := f.dial(t) // another engine's worker, in no group
	k := newCache(t, other)
	k.store(t, "a", []uint32{0, 1}, rand.New(rand.NewPCG(1, 2)))
	sched := f.dial(t)
	ns, err := sched.Declare(ctx, geo)
	if err != nil {
		t.Fatal(err)
	}
	keys := [][]byte{[]byte("a")}
	pin := func(group string) client.Pin {
		t.Helper()
		p, err := sched.PinLoadable(ctx, ns.ID, keys, 0, group)
		if err != nil {
			t.Fatal(err)
		}
		if p.ID != 0 {
			if _, err := sched.Unpin(ctx, p.ID); err != nil {
				t.Fatal(err)
			}
		}
		return p
	}
	if p := pin("engine-b"); !p.NoCache {
		t.Fatalf("PinLoadable of group engine-b with only another engine's cache = %+v; want NoCache", p)
	}
	if p := pin(""); p.NoCache || !p.Held[0] {
		t.Fatalf("PinLoadable of any group = %+v; want the key pinned", p)
	}

	worker := f.dial(t)
	if err := worker.JoinGroup(ctx, "engine-b"); err != nil {
		t.Fatal(err)
	}
	if err := worker.JoinGroup(ctx, "engine-b"); err != nil {
		t.Fatalf("joining the same group again: %v", err)
	}
	var pe *protocol.Error
	if err := worker.JoinGroup(ctx, "engine-c"); !errors.As(err, &pe) || pe.Code != protocol.CodeInvalid {
		t.Fatalf("joining a second group: %v; want invalid argument", err)
	}
	wk := newCache(t, worker)
	if p := pin("engine-b"); p.NoCache || !p.Held[0] {
		t.Fatalf("PinLoadable of group engine-b with its worker's cache = %+v; want the key pinned", p)
	}
	if p := pin("engine-c"); !p.NoCache {
		t.Fatalf("PinLoadable of group engine-c = %+v; want NoCache", p)
	}
	if err := worker.UnregisterCache(ctx, wk.id); err != nil {
		t.Fatal(err)
	}
	if p := pin("engine-b"); !p.NoCache {
		t.Fatalf("PinLoadable of group engine-b after its cache went = %+v; want NoCache", p)
	}
	if err := other.JoinGroup(ctx, "engine-c"); !errors.As(err, &pe) || pe.Code != protocol.CodeInUse {
		t.Fatalf("joining a group with a cache registered: %v; want in use", err)
	}
}

// TestStatsCountsTheCachesOfEachNamespace: the Stats reply's caches
// section counts, per namespace listed, the caches registered in it on
// all connections (what `kvhost stats` shows an operator whose vLLM
// engine answers MISS for want of a worker).
func TestStatsCountsTheCachesOfEachNamespace(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t, server.Config{})
	w1 := f.dial(t)
	k := newCache(t, w1)
	k.store(t, "a", []uint32{0, 1}, rand.New(rand.NewPCG(1, 2)))
	caches := func() uint32 {
		t.Helper()
		st, err := w1.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, ns := range st.Namespaces.List {
			if ns.Model == geo.Model {
				return ns.Caches
			}
		}
		t.Fatalf("namespace %q not listed in %+v", geo.Model, st.Namespaces)
		return 0
	}
	if n := caches(); n != 1 {
		t.Fatalf("caches with one worker = %d, want 1", n)
	}
	w2 := f.dial(t)
	if err := w2.JoinGroup(ctx, "engine-b"); err != nil {
		t.Fatal(err)
	}
	newCache(t, w2)
	if n := caches(); n != 2 {
		t.Fatalf("caches with a second worker, in a group = %d, want 2", n)
	}
	w2.Close()
	testwait.Until(t, "the closed connection's cache to stop counting", testwait.Hang, func() bool { return caches() == 1 })
	if err := w1.UnregisterCache(ctx, k.id); err != nil {
		t.Fatal(err)
	}
	if n := caches(); n != 0 {
		t.Fatalf("caches after the last was unregistered = %d, want 0", n)
	}
}

func TestPinErrors(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t, server.Config{})
	c := f.dial(t)
	_, err := c.Pin(ctx, 99, [][]byte{[]byte("a")}, 0)
	var pe *protocol.Error
	if !errors.As(err, &pe) || pe.Code != protocol.CodeUnknownNS {
		t.Fatalf("Pin in an undeclared namespace: %v", err)
	}
	r := f.raw(t)
	r.send(1, &protocol.Hello{Version: protocol.Version, Client: "raw"})
	if _, m, err := r.recv(); err != nil {
		t.Fatal(err)
	} else if _, ok := m.(*protocol.Welcome); !ok {
		t.Fatalf("hello answered with %#v", m)
	}
	r.send(7, &protocol.Pin{NS: 1, LeaseMillis: protocol.MaxLeaseMillis + 1, Keys: [][]byte{[]byte("a")}})
	r.expectCode(protocol.CodeMalformed)
}

// TestOneProcessCannotPinEveryKey: the keys one process's pins hold, on
// all its connections, are bounded by server.max_pinned_keys_per_peer
// (half of server.max_pinned_keys by default); a pin beyond it is
// refused with limit exceeded naming the key, while another process
// still pins. Keys pinned with a lease count until the lease ends.
func TestOneProcessCannotPinEveryKey(t *testing.T) {
	const limit, perPeer, keys = 2 * protocol.MaxKeysPerRequest, protocol.MaxKeysPerRequest, 64
	ctx := context.Background()
	f := newFixture(t, server.Config{MaxPinnedKeys: limit})
	conns := []*client.Client{f.dial(t), f.dial(t)}
	k := newCache(t, conns[0])
	names := make([][]byte, keys)
	blocks := make([][]uint32, keys)
	for i := range names {
		names[i] = fmt.Appendf(nil, "pinned-%d", i)
		blocks[i] = []uint32{0, 1}
	}
	job, err := conns[0].Store(ctx, k.id, names, blocks)
	if err != nil {
		t.Fatal(err)
	}
	if res, err := job.Wait(ctx); err != nil || res.Keys[keys-1].Outcome != client.OutcomeStored {
		t.Fatalf("store: %v %v", res.Keys, err)
	}
	ns := []client.NamespaceID{k.ns.ID, 0}
	d, err := conns[1].Declare(ctx, geo)
	if err != nil {
		t.Fatal(err)
	}
	ns[1] = d.ID
	var refused error
	for i := 0; i < 4*limit/keys && refused == nil; i++ {
		_, refused = conns[i%2].Pin(ctx, ns[i%2], names, 0)
	}
	if _, pinned := f.eng.PinStats(); pinned > perPeer {
		t.Errorf("one process's pins hold %d keys, more than server.max_pinned_keys_per_peer (%d)", pinned, perPeer)
	}
	var pe *protocol.Error
	if !errors.As(refused, &pe) || pe.Code != protocol.CodeLimit || !strings.Contains(pe.Message, "server.max_pinned_keys_per_peer") {
		t.Fatalf("a pin beyond the process's keys: %v, want limit exceeded naming server.max_pinned_keys_per_peer", refused)
	}
	otherProcess(t, f, peerPinEnv+"="+string(names[0]))

	// A pin with a lease counts until the lease ends.
	conns[0].Close()
	conns[1].Close()
	if err := f.srv.WaitSessions(ctx, 0); err != nil {
		t.Fatal(err)
	}
	c := f.dial(t)
	d, err = c.Declare(ctx, geo)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Pin(ctx, d.ID, names, 20*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, "the leased pin's keys to be given back", time.Minute, func() bool { return f.srv.Stats().PinnedKeys == 0 })
	for range perPeer / keys {
		if _, err := c.Pin(ctx, d.ID, names, 0); err != nil {
			t.Fatalf("a pin once the leased one ended: %v", err)
		}
	}
}

// slowPins is an engine whose pins wait until release is closed, saying
// on entered that one has begun.
type slowPins struct {
	*engine.Engine
	entered chan struct{}
	release chan struct{}
}

func (e *slowPins) Pin(ctx context.Context, ns engine.NamespaceID, keys [][]byte, lease time.Duration) (engine.PinID, []bool, error) {
	e.entered <- struct{}{}
	<-e.release
	return e.Engine.Pin(ctx, ns, keys, lease)
}

// TestALeasedPinCountsWhileTheEngineHoldsIt: the engine's lease of a pin
// begins once the engine has pinned its keys, which can take longer than
// the lease; the keys count against server.max_pinned_keys_per_peer
// until that lease ends, not until the lease's time has passed since the
// Pin arrived: a process pinning with short leases cannot hold more keys
// than its share.
func TestALeasedPinCountsWhileTheEngineHoldsIt(t *testing.T) {
	const keys, lease = 64, time.Minute
	// The server's clock, moved by the test: the engine's lease runs on
	// its own timer, a minute, which the test does not wait out.
	var mu sync.Mutex
	now := time.Unix(1e9, 0)
	clock := func() time.Time {
		mu.Lock()
		defer mu.Unlock()
		return now
	}
	ctx := context.Background()
	eng := &slowPins{entered: make(chan struct{}, 1), release: make(chan struct{})}
	f := newFixtureWith(t, server.Config{Now: clock}, nil, func(e *engine.Engine) server.Engine {
		eng.Engine = e
		return eng
	})
	c := f.dial(t)
	k := newCache(t, c)
	names := make([][]byte, keys)
	blocks := make([][]uint32, keys)
	for i := range names {
		names[i] = fmt.Appendf(nil, "leased-%d", i)
		blocks[i] = []uint32{0, 1}
	}
	job, err := c.Store(ctx, k.id, names, blocks)
	if err != nil {
		t.Fatal(err)
	}
	if res, err := job.Wait(ctx); err != nil || res.Keys[keys-1].Outcome != client.OutcomeStored {
		t.Fatalf("store: %v %v", res.Keys, err)
	}
	pinned := make(chan error, 1)
	go func() {
		_, err := c.Pin(ctx, k.ns.ID, names, lease)
		pinned <- err
	}()
	<-eng.entered
	// The engine pins the keys once the lease's time has passed, on the
	// server's clock, since the Pin arrived: its lease begins then.
	mu.Lock()
	now = now.Add(2 * lease)
	mu.Unlock()
	close(eng.release)
	if err := <-pinned; err != nil {
		t.Fatal(err)
	}
	_, held := f.eng.PinStats()
	if counted := f.srv.Stats().PinnedKeys; counted < int64(held) {
		t.Errorf("the daemon counts %d pinned keys while the engine holds %d under the pin's lease, want at least %d", counted, held, held)
	}
}

// TestUndeclareIsRefusedWhilePinsAreHeld: a pin lasts until Unpin, its
// lease's end or the connection's end, so Undeclare of the namespace a
// held pin is in is refused with in use naming the pin (as for a
// registered cache); once the pin is released, or its lease has ended,
// the namespace is given up. Before, Undeclare went through and left the
// connection holding only pins, closed as idle after the idle limit.
func TestUndeclareIsRefusedWhilePinsAreHeld(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t, server.Config{})
	k := newCache(t, f.dial(t))
	k.store(t, "a", []uint32{0, 1}, rand.New(rand.NewPCG(1, 2)))

	c := f.dial(t)
	ns, err := c.Declare(ctx, geo)
	if err != nil {
		t.Fatal(err)
	}
	p, err := c.Pin(ctx, ns.ID, [][]byte{[]byte("a")}, 0)
	if err != nil || !p.Held[0] {
		t.Fatalf("Pin = %+v, %v", p, err)
	}
	err = c.Undeclare(ctx, ns.ID)
	var pe *protocol.Error
	if !errors.As(err, &pe) || pe.Code != protocol.CodeInUse || !strings.Contains(pe.Message, fmt.Sprintf("held pin(s) %d", p.ID)) {
		t.Fatalf("Undeclare with pin %d held: %v; want in use naming the pin", p.ID, err)
	}
	// Still declared: the pin and the namespace work.
	if n, err := c.Lookup(ctx, ns.ID, [][]byte{[]byte("a")}); err != nil || n != 1 {
		t.Fatalf("Lookup after the refused Undeclare = %d, %v; want 1", n, err)
	}
	if n, err := c.Unpin(ctx, p.ID); err != nil || n != 1 {
		t.Fatalf("Unpin = %d, %v; want 1", n, err)
	}
	if err := c.Undeclare(ctx, ns.ID); err != nil {
		t.Fatalf("Undeclare after Unpin: %v", err)
	}

	// A pin whose lease has ended holds nothing: it does not refuse.
	ns, err = c.Declare(ctx, geo)
	if err != nil {
		t.Fatal(err)
	}
	if p, err := c.Pin(ctx, ns.ID, [][]byte{[]byte("a")}, 20*time.Millisecond); err != nil || !p.Held[0] {
		t.Fatalf("leased Pin = %+v, %v", p, err)
	}
	waitPins(t, f, 0)
	if err := c.Undeclare(ctx, ns.ID); err != nil {
		t.Fatalf("Undeclare after the pin's lease ended: %v", err)
	}
}
