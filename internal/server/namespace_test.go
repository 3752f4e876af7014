package server_test

import (
	"bytes"
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
	"github.com/kvhost/kvhost/host/engine"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/protocol"
)

// throwaway is the i-th of many different geometries.
func throwaway(i int) client.Geometry {
	g := geo
	g.Model = fmt.Sprintf("throwaway-%d", i)
	g.Layers = uint32(1 + i%5)
	g.HeadSize = uint32(64 * (1 + i%3))
	return g
}

// fewNamespaces makes the engine refuse new namespaces beyond 100 (the
// default is 1024): 1,000 declarations exceed it tenfold.
func fewNamespaces(cfg *engine.Config) { cfg.MaxNamespaces = 100 }

// TestThrowawayDeclarationsAreReleased reproduces issue 7: ~1,000 clients
// that each declared a geometry of their own and went away used to exhaust
// the engine's namespaces until a restart, refusing a real model. A
// namespace is now released when its last connection closes. (It passes
// once the engine's Release stops counting the namespace.)
func TestThrowawayDeclarationsAreReleased(t *testing.T) {
	f := newFixtureWith(t, server.Config{}, fewNamespaces, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for i := 0; i < 1000; i++ {
		c, err := client.Dial(ctx, f.socket, "throwaway")
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.Declare(ctx, throwaway(i))
		c.Close()
		if err != nil {
			t.Fatalf("throwaway declaration %d refused (namespaces of closed connections are not released): %v", i, err)
		}
		if err := f.srv.WaitSessions(ctx, 0); err != nil {
			t.Fatal(err)
		}
	}
	checkRealModel(t, f)
}

// TestUndeclareReleases: one connection that declares and undeclares 1,000
// geometries leaves room for a real model.
func TestUndeclareReleases(t *testing.T) {
	f := newFixtureWith(t, server.Config{}, fewNamespaces, nil)
	c := f.dial(t)
	ctx := context.Background()
	for i := 0; i < 1000; i++ {
		ns, err := c.Declare(ctx, throwaway(i))
		if err != nil {
			t.Fatalf("throwaway declaration %d refused (undeclared namespaces are not released): %v", i, err)
		}
		if err := c.Undeclare(ctx, ns.ID); err != nil {
			t.Fatal(err)
		}
	}
	checkRealModel(t, f)
}

// checkRealModel declares the test geometry on a new client and stores and
// loads a key in it.
func checkRealModel(t *testing.T, f *fixture) {
	t.Helper()
	c := f.dial(t)
	k := newCache(t, c)
	rng := rand.New(rand.NewPCG(7, 7))
	want := k.store(t, "real", []uint32{0, 1}, rng)
	if got := k.load(t, "real", []uint32{2, 3}); !bytes.Equal(got, want) {
		t.Fatal("the real model's key does not load its bytes")
	}
}

// TestGeometriesBeyondTheDaemonsAreRefusedAsALimit: once the engine knows
// as many namespaces as it may (Config.MaxNamespaces), a new geometry is
// refused with limit exceeded naming the bound, not invalid argument (the
// geometry is valid: a client may retry once others are released), and
// declaring one the daemon knows still works.
func TestGeometriesBeyondTheDaemonsAreRefusedAsALimit(t *testing.T) {
	f := newFixtureWith(t, server.Config{}, func(cfg *engine.Config) { cfg.MaxNamespaces = 2 }, nil)
	ctx := context.Background()
	for i := range 2 {
		if _, err := f.dial(t).Declare(ctx, throwaway(i)); err != nil {
			t.Fatalf("geometry %d of 2: %v", i, err)
		}
	}
	c := f.dial(t)
	_, err := c.Declare(ctx, throwaway(2))
	var pe *protocol.Error
	if !errors.As(err, &pe) || pe.Code != protocol.CodeLimit || !strings.Contains(pe.Message, "namespaces_per_daemon") {
		t.Fatalf("a geometry beyond the daemon's 2 namespaces: %v, want limit exceeded naming namespaces_per_daemon", err)
	}
	if _, err := c.Declare(ctx, throwaway(1)); err != nil {
		t.Fatalf("a geometry the daemon knows, once another was refused: %v", err)
	}
}

// releaseLog records the engine's Release calls.
type releaseLog struct {
	*engine.Engine
	mu  sync.Mutex
	ids []engine.NamespaceID
}

func (r *releaseLog) Release(ns engine.NamespaceID) error {
	r.mu.Lock()
	r.ids = append(r.ids, ns)
	r.mu.Unlock()
	return r.Engine.Release(ns)
}

func (r *releaseLog) released() []engine.NamespaceID {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.ids)
}

// TestNamespaceRefcount: a namespace several connections declared is
// released once, when the last of them closes or undeclares it; undeclaring
// a namespace that a registered cache uses is refused.
func TestNamespaceRefcount(t *testing.T) {
	var log *releaseLog
	f := newFixtureWith(t, server.Config{}, nil, func(e *engine.Engine) server.Engine {
		log = &releaseLog{Engine: e}
		return log
	})
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Hang)
	defer cancel()
	a, err := client.Dial(ctx, f.socket, "a")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.Declare(ctx, geo); err != nil {
		t.Fatal(err)
	}
	b := f.dial(t)
	k := newCache(t, b) // declares geo too
	want, err := f.eng.Declare(ctx, engine.Geometry{Model: geo.Model, Layers: int(geo.Layers), KVHeads: int(geo.KVHeads), HeadSize: int(geo.HeadSize),
		DtypeSize: int(geo.DtypeSize), TokensPerBlock: int(geo.TokensPerBlock), TokensPerKey: int(geo.TokensPerKey), TPSize: int(geo.TPSize)})
	if err != nil {
		t.Fatal(err)
	}

	a.Close()
	if err := f.srv.WaitSessions(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if got := log.released(); len(got) != 0 {
		t.Fatalf("released %v while another connection uses the namespace", got)
	}
	if err := b.Undeclare(ctx, k.ns.ID); !errors.Is(err, &protocol.Error{Code: protocol.CodeInUse}) {
		t.Fatalf("undeclaring a namespace with a registered cache: %v, want %s", err, protocol.CodeInUse)
	}
	if err := b.UnregisterCache(ctx, k.id); err != nil {
		t.Fatal(err)
	}
	if err := b.Undeclare(ctx, k.ns.ID); err != nil {
		t.Fatal(err)
	}
	if got := log.released(); !slices.Equal(got, []engine.NamespaceID{want}) {
		t.Fatalf("released %v after the last user undeclared, want [%d]", got, want)
	}
	if err := b.Undeclare(ctx, k.ns.ID); !errors.Is(err, &protocol.Error{Code: protocol.CodeUnknownNS}) {
		t.Fatalf("undeclaring twice: %v, want %s", err, protocol.CodeUnknownNS)
	}
	if _, err := b.Declare(ctx, geo); err != nil {
		t.Fatal(err)
	}
	b.Close()
	if err := f.srv.WaitSessions(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if got := log.released(); !slices.Equal(got, []engine.NamespaceID{want, want}) {
		t.Fatalf("released %v after the last user closed, want [%d %d]", got, want, want)
	}
}
