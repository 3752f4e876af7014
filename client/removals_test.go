package client_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/protocol"
)

// TestRemovalsNeedTheFeature: to a daemon whose Welcome announces no
// removal streams Removals returns ErrUnsupported and sends nothing.
func TestRemovalsNeedTheFeature(t *testing.T) {
	sock, next := fakeDaemonAnsweringALookup(t, &protocol.Welcome{Version: 2, MaxFrame: protocol.MinFrame, MaxKeys: 4096,
		MaxKeyLen: 64, Server: "layers only", Features: protocol.FeatureLayerLoads})
	c := dialFake(t, sock)
	ctx := context.Background()
	if _, err := c.Removals(ctx, client.RemovalCursor{}); !errors.Is(err, client.ErrUnsupported) {
		t.Fatalf("Removals: %v, want ErrUnsupported", err)
	}
	if _, err := c.Lookup(ctx, 1, [][]byte{[]byte("k")}); err != nil {
		t.Fatal(err)
	}
	if got := <-next; got != protocol.TypeLookup {
		t.Fatalf("the daemon read %s after the refused subscription, want the lookup", got)
	}
}

// nextBatch is Next within testwait.Hang.
func nextBatch(t *testing.T, s *client.RemovalSubscription) client.RemovalBatch {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Hang)
	defer cancel()
	b, err := s.Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// removedKeys reads batches of s until they hold n records, and returns
// their keys; a resync fails the test.
func removedKeys(t *testing.T, s *client.RemovalSubscription, n int, reason client.RemovalReason, fp uint64) []string {
	t.Helper()
	var keys []string
	for len(keys) < n {
		b := nextBatch(t, s)
		if b.Resync {
			t.Fatal("a resync")
		}
		for _, r := range b.Records {
			if r.Reason != reason || r.Fingerprint != fp || r.To != protocol.NoRemovalMount || r.Time == 0 {
				t.Fatalf("record %+v: want %v of namespace %016x", r, reason, fp)
			}
			keys = append(keys, string(r.Key))
		}
	}
	return keys
}

// TestARemovalStreamResumesFromItsCursor against a real daemon: a
// subscriber sees each key another connection deletes, once, as deleted;
// subscribing again on a new connection from its cursor gets exactly the
// deletions it missed; a cursor of another epoch (a restarted daemon)
// gets a resync; and closing a subscription ends its Next.
func TestARemovalStreamResumesFromItsCursor(t *testing.T) {
	dir, socket := newDirs(t)
	startDaemon(t, dir, socket)
	ctx := context.Background()
	worker := dial(t, socket)
	if !worker.Supports(client.FeatureRemovals) {
		t.Fatal("the daemon does not announce removal streams")
	}
	tc := newTestCache(t, worker)
	keys := tc.roundTrip(t, rand.New(rand.NewPCG(8, 6)), "rm", 6)

	router := dial(t, socket)
	ns, err := router.Declare(ctx, testGeometry)
	if err != nil {
		t.Fatal(err)
	}
	sub, err := router.Removals(ctx, client.RemovalCursor{}, ns.ID)
	if err != nil {
		t.Fatal(err)
	}
	if m := sub.Mounts(); len(m) != 1 || m[0] == "" {
		t.Fatalf("mounts %q: want the daemon's one mount's class", m)
	}
	if n, err := worker.Delete(ctx, tc.ns.ID, keys[:2]); n != 2 || err != nil {
		t.Fatalf("delete: %d, %v", n, err)
	}
	got := removedKeys(t, sub, 2, protocol.RemovalDeleted, ns.Fingerprint)
	if want := []string{string(keys[0]), string(keys[1])}; !slices.Equal(got, want) {
		t.Fatalf("records of %v, want %v", got, want)
	}
	cursor := sub.Cursor()
	router.Close()
	if _, err := sub.Next(ctx); !errors.Is(err, client.ErrClosed) {
		t.Fatalf("Next after the connection closed: %v", err)
	}

	// Deleted while no one listened: the next subscription from the
	// cursor gets exactly it, and nothing of before.
	if n, err := worker.Delete(ctx, tc.ns.ID, keys[2:3]); n != 1 || err != nil {
		t.Fatalf("delete: %d, %v", n, err)
	}
	again := dial(t, socket)
	sub, err = again.Removals(ctx, cursor) // every namespace
	if err != nil {
		t.Fatal(err)
	}
	if got := removedKeys(t, sub, 1, protocol.RemovalDeleted, ns.Fingerprint); !slices.Equal(got, []string{string(keys[2])}) {
		t.Fatalf("records after resuming: %v, want %s", got, keys[2])
	}

	stale, err := again.Removals(ctx, client.RemovalCursor{Epoch: cursor.Epoch + 1, Last: cursor.Last})
	if err != nil {
		t.Fatal(err)
	}
	if b := nextBatch(t, stale); !b.Resync || len(b.Records) != 0 || b.Cursor.Epoch != cursor.Epoch {
		t.Fatalf("first batch of another epoch's cursor: %+v, want a resync in the daemon's epoch", b)
	}
	if err := stale.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := stale.Next(ctx); !errors.Is(err, client.ErrClosed) {
		t.Fatalf("Next after Close: %v", err)
	}
	// The other subscription goes on.
	if n, err := worker.Delete(ctx, tc.ns.ID, keys[3:4]); n != 1 || err != nil {
		t.Fatalf("delete: %d, %v", n, err)
	}
	if got := removedKeys(t, sub, 1, protocol.RemovalDeleted, ns.Fingerprint); !slices.Equal(got, []string{string(keys[3])}) {
		t.Fatalf("records after another subscription closed: %v", got)
	}
}

// ExampleClient_Removals follows the removals of one namespace, as a
// router's feeder does, and subscribes again from its cursor after the
// connection is lost. It needs a running daemon, so it is compiled but not
// run.
func ExampleClient_Removals() {
	ctx := context.Background()
	g := client.Geometry{Model: "llama-3.1-8b", Layers: 32, KVHeads: 8, HeadSize: 128, DtypeSize: 2,
		TokensPerBlock: 16, TokensPerKey: 256, TPSize: 1}
	var cursor client.RemovalCursor // the zero cursor: from now on
	for {
		c, err := client.Dial(ctx, client.DefaultSocket(), "router-feeder")
		if err != nil {
			log.Fatal(err)
		}
		ns, err := c.Declare(ctx, g)
		if err != nil {
			log.Fatal(err)
		}
		sub, err := c.Removals(ctx, cursor, ns.ID)
		if err != nil {
			log.Fatal(err)
		}
		for {
			b, err := sub.Next(ctx)
			if err != nil {
				break // the connection went: subscribe again from the cursor
			}
			if b.Resync {
				fmt.Println("every key may be gone: clear the router's view of this pod")
			}
			for _, r := range b.Records {
				fmt.Printf("%x: %s (medium %s)\n", r.Key, r.Reason, sub.Mounts()[r.Mount])
			}
			cursor = b.Cursor
		}
		c.Close()
	}
}
