package server_test

import (
	"bytes"
	"context"
	"maps"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/protocol"
)

// TestOnRequestSeesControlRequestsNotJobs: Config.OnRequest is called
// once per answered control request, refused ones included, with the
// request's type and a positive duration; stores and loads (jobs, seen by
// the engine's observer) are not reported.
func TestOnRequestSeesControlRequestsNotJobs(t *testing.T) {
	var mu sync.Mutex
	seen := map[protocol.Type]int{}
	var bad []time.Duration
	f := newFixture(t, server.Config{OnRequest: func(typ protocol.Type, took time.Duration) {
		mu.Lock()
		defer mu.Unlock()
		seen[typ]++
		if took <= 0 {
			bad = append(bad, took)
		}
	}})
	c := f.dial(t)
	k := newCache(t, c)
	rng := rand.New(rand.NewPCG(3, 4))
	want := k.store(t, "key", []uint32{0, 1}, rng)
	if got := k.load(t, "key", []uint32{2, 3}); !bytes.Equal(got, want) {
		t.Fatal("loaded bytes differ")
	}
	ctx := context.Background()
	if n, err := c.Lookup(ctx, k.ns.ID, [][]byte{[]byte("key")}); err != nil || n != 1 {
		t.Fatalf("lookup: %d, %v", n, err)
	}
	if _, err := c.Lookup(ctx, k.ns.ID+100, [][]byte{[]byte("key")}); err == nil {
		t.Fatal("a lookup in an undeclared namespace succeeded")
	}
	if _, err := c.Stats(ctx); err != nil {
		t.Fatal(err)
	}
	expect := map[protocol.Type]int{
		protocol.TypeRegisterMemory: 1, protocol.TypeDeclare: 1, protocol.TypeRegisterCache: 1,
		protocol.TypeLookup: 2, protocol.TypeStats: 1,
	}
	testwait.Until(t, "every reply observed", testwait.Hang, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return seen[protocol.TypeStats] == 1
	})
	mu.Lock()
	defer mu.Unlock()
	if !maps.Equal(seen, expect) || len(bad) > 0 {
		t.Fatalf("observed %v (durations not positive: %v), want %v", seen, bad, expect)
	}
}
