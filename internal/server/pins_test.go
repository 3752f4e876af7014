package server_test

import (
	"context"
	"errors"
	"fmt"
	"github.com/kvhost/kvhost/internal/testwait"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/protocol"
)

// waitPins polls the engine until it holds want pins.
func waitPins(t *testing.T, f *fixture, want int) {
	t.Helper()
	testwait.Until(t, fmt.Sprintf("the engine to hold %d pins", want), 10*time.Second, func() bool {
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
