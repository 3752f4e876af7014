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
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/engine"
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

// gatedDeclares is an engine whose next declaration of model, once armed,
// waits in Declare until open is closed (as one waiting on a slow policy
// plugin), and which records its Release calls.
type gatedDeclares struct {
	releaseLog
	model   string
	armed   atomic.Bool
	entered chan struct{} // closed when the armed declaration waits
	open    chan struct{}
}

func newGatedDeclares(e *engine.Engine, model string) *gatedDeclares {
	return &gatedDeclares{releaseLog: releaseLog{Engine: e}, model: model, entered: make(chan struct{}), open: make(chan struct{})}
}

func (g *gatedDeclares) Declare(ctx context.Context, geo engine.Geometry) (engine.NamespaceID, error) {
	if geo.Model == g.model && g.armed.CompareAndSwap(true, false) {
		close(g.entered)
		select {
		case <-g.open:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
	return g.Engine.Declare(ctx, geo)
}

// declareAsync declares g on c and delivers the outcome on the channel.
func declareAsync(ctx context.Context, c *client.Client, g client.Geometry) <-chan error {
	done := make(chan error, 1)
	go func() {
		_, err := c.Declare(ctx, g)
		done <- err
	}()
	return done
}

// TestReleasesDoNotWaitForASlowDeclaration: while one connection's
// declaration waits in the engine, another connection's undeclare is
// answered and a closing connection's namespaces are let go; the engine

// newGatedFixture returns a fixture whose engine holds declarations of
// model's geometries at eng's gate until the test opens it (the gate
// opens at the test's end if the test did not), and a context that
// bounds the test's calls by testwait.Hang.
func newGatedFixture(t *testing.T, model string) (*fixture, *gatedDeclares, context.Context) {
	t.Helper()
	var eng *gatedDeclares
	f := newFixtureWith(t, server.Config{}, nil, func(e *engine.Engine) server.Engine {
		eng = newGatedDeclares(e, model)
		return eng
	})
	t.Cleanup(func() { // before the fixture's: cleanups run last first
		select {
		case <-eng.open:
		default:
			close(eng.open)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Hang)
	t.Cleanup(cancel)
	return f, eng, ctx
}

// releases them once the declaration is done.
func TestReleasesDoNotWaitForASlowDeclaration(t *testing.T) {
	f, eng, ctx := newGatedFixture(t, "slow")
	a, c := f.dial(t), f.dial(t)
	nsA, err := a.Declare(ctx, throwaway(0))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Declare(ctx, throwaway(1)); err != nil {
		t.Fatal(err)
	}
	slow := throwaway(2)
	slow.Model = "slow"
	eng.armed.Store(true)
	declared := declareAsync(ctx, f.dial(t), slow)
	<-eng.entered

	if err := a.Undeclare(ctx, nsA.ID); err != nil {
		t.Fatalf("undeclare while another connection's declaration waits in the engine: %v", err)
	}
	c.Close()
	if err := f.srv.WaitSessions(ctx, 2); err != nil {
		t.Fatalf("a closing connection while another's declaration waits in the engine: %v", err)
	}
	close(eng.open)
	if err := <-declared; err != nil {
		t.Fatalf("the slow declaration: %v", err)
	}
	if got := eng.released(); len(got) != 2 {
		t.Fatalf("released %v once the slow declaration was done, want the 2 namespaces let go meanwhile", got)
	}
}

// TestNamespaceDeclaredWhileLetGoIsKept: the last user of a namespace
// undeclares it while another connection's declaration of the same
// geometry waits in the engine: the namespace is not released under the
// new user, who can use it, and it is released once that user closes.
func TestNamespaceDeclaredWhileLetGoIsKept(t *testing.T) {
	f, eng, ctx := newGatedFixture(t, geo.Model)
	a, b := f.dial(t), f.dial(t)
	nsA, err := a.Declare(ctx, geo)
	if err != nil {
		t.Fatal(err)
	}
	eng.armed.Store(true)
	declared := declareAsync(ctx, b, geo)
	<-eng.entered
	if err := a.Undeclare(ctx, nsA.ID); err != nil {
		t.Fatalf("undeclare while another connection's declaration of the geometry waits in the engine: %v", err)
	}
	close(eng.open)
	if err := <-declared; err != nil {
		t.Fatalf("the declaration of the geometry let go meanwhile: %v", err)
	}
	if got := eng.released(); len(got) != 0 {
		t.Fatalf("released %v, a namespace a connection has just declared", got)
	}
	nsB, err := b.Declare(ctx, geo) // the connection's namespace, declared above
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Lookup(ctx, nsB.ID, [][]byte{[]byte("key")}); err != nil {
		t.Fatalf("lookup in the namespace declared while it was let go: %v", err)
	}
	b.Close()
	if err := f.srv.WaitSessions(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if got := eng.released(); len(got) != 1 {
		t.Fatalf("released %v after the namespace's last user closed, want it once", got)
	}
}

// bigStats is an engine whose Stats list many mounts with long paths and
// many namespaces with long model ids.
type bigStats struct {
	*engine.Engine
	mounts, namespaces int
}

func (b bigStats) Stats() engine.Stats {
	st := b.Engine.Stats()
	st.Mounts = nil
	for i := range b.mounts {
		st.Mounts = append(st.Mounts, engine.MountStats{Path: fmt.Sprintf("/%0*d", 4000, i), IO: "buffered", Backend: "staging",
			StoresFailing: &engine.StoreFailure{Since: time.Unix(1, 0), Last: time.Unix(2, 0), Stores: 1, Err: strings.Repeat("e", 4000)}})
	}
	st.Namespaces = nil
	for i := range b.namespaces {
		st.Namespaces = append(st.Namespaces, engine.NamespaceStats{Fingerprint: uint64(i + 1), Model: fmt.Sprintf("%0*d", abi.MaxModelLen, i), Keys: 1})
	}
	return st
}

// TestStatsListsAsManyNamespacesAsTheFrameHolds: a daemon whose frames are
// the smallest (MinFrame) and whose other sections take most of one
// lists only the namespaces that fit beside them, counting the rest as
// left out, so that its Stats reply still reaches the client; with room,
// it lists MaxStatsNamespaces and counts the rest.
func TestStatsListsAsManyNamespacesAsTheFrameHolds(t *testing.T) {
	for _, tc := range []struct {
		name               string
		mounts, namespaces int
		fits               func(listed int) bool
	}{
		{"beside 6 mounts of 8 KiB each", 6, 200, func(n int) bool { return n > 0 && n < protocol.MaxStatsNamespaces }},
		{"with room", 0, 200, func(n int) bool { return n == protocol.MaxStatsNamespaces }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixtureWith(t, server.Config{MaxFrame: protocol.MinFrame}, nil, func(e *engine.Engine) server.Engine {
				return bigStats{Engine: e, mounts: tc.mounts, namespaces: tc.namespaces}
			})
			st, err := f.dial(t).Stats(context.Background())
			if err != nil {
				t.Fatalf("Stats from a daemon of MinFrame frames: %v", err)
			}
			nl := st.Namespaces
			if nl == nil || !tc.fits(len(nl.List)) || len(nl.List)+int(nl.LeftOut) != tc.namespaces {
				t.Fatalf("namespaces listed %d, left out %d, of %d", len(nl.List), nl.LeftOut, tc.namespaces)
			}
		})
	}
}

// TestStatsReplyFitsTheFrameByCuttingFailureTexts: where the sections
// before the namespaces do not fit the frame (MinFrame, 12 mounts with
// paths and failure texts of 4000 bytes), the daemon cuts the failure
// texts, each marked, instead of sending a frame the client refuses (it
// ended the whole connection); with 40 such mounts even their paths do
// not fit, and Stats is refused with a limit error naming the key, the
// connection kept.
func TestStatsReplyFitsTheFrameByCuttingFailureTexts(t *testing.T) {
	for _, tc := range []struct {
		mounts int
		fits   bool
	}{{12, true}, {40, false}} {
		t.Run(fmt.Sprint(tc.mounts, " mounts"), func(t *testing.T) {
			f := newFixtureWith(t, server.Config{MaxFrame: protocol.MinFrame}, nil, func(e *engine.Engine) server.Engine {
				return bigStats{Engine: e, mounts: tc.mounts}
			})
			c := f.dial(t)
			st, err := c.Stats(context.Background())
			if !tc.fits {
				if !errors.Is(err, &protocol.Error{Code: protocol.CodeLimit}) || !strings.Contains(err.Error(), "server.max_frame") {
					t.Fatalf("Stats of %d mounts in MinFrame: %v, want a limit error naming server.max_frame", tc.mounts, err)
				}
				var pe *protocol.Error
				if _, err := c.Lookup(context.Background(), 1, [][]byte{[]byte("k")}); !errors.As(err, &pe) || pe.Code != protocol.CodeUnknownNS {
					t.Fatalf("a lookup after the refused Stats: %v, want the daemon's answer (unknown namespace) on the same connection", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("Stats of %d mounts in MinFrame: %v", tc.mounts, err)
			}
			if len(st.StoresFailing) != tc.mounts {
				t.Fatalf("%d mounts' failures, want %d", len(st.StoresFailing), tc.mounts)
			}
			for i, sf := range st.StoresFailing {
				if !strings.HasSuffix(sf.Err, "…") || !strings.HasPrefix(sf.Err, "eee") || len(sf.Err) >= 4000 {
					t.Fatalf("mount %d's failure text: %d bytes %q..., want it cut and marked", i, len(sf.Err), sf.Err[:min(len(sf.Err), 8)])
				}
			}
		})
	}
}
