package server_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/protocol"
)

// TestStatsDaemonSection: a Stats reply carries the daemon section —
// Config.Daemon's fields, every connection's regions and the engine's
// mounts with their paths and device classes — and Server.Stats counts clients and regions of
// all connections.
func TestStatsDaemonSection(t *testing.T) {
	f := newFixture(t, server.Config{Daemon: func() protocol.DaemonStats {
		return protocol.DaemonStats{Policy: "lru", PolicyBackend: "native", Reloads: 2, LastReload: "ok"}
	}})
	a, b := f.dial(t), f.dial(t)
	k := newCache(t, a)
	k.store(t, "key", []uint32{0, 1, 2, 3}[:geo.BlocksPerKey()], rand.New(rand.NewPCG(1, 1)))
	newCache(t, b)
	st, err := b.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	d := st.Daemon
	switch {
	case d == nil:
		t.Fatal("no daemon section")
	case d.Policy != "lru" || d.PolicyBackend != "native" || d.Reloads != 2 || d.LastReload != "ok":
		t.Errorf("daemon section %+v lost Config.Daemon's fields", d)
	case d.Started == 0:
		t.Error("no start time")
	case d.Regions != 2 || d.RegisteredBytes == 0:
		t.Errorf("daemon regions %d (%d bytes), want both connections' 2", d.Regions, d.RegisteredBytes)
	case len(d.Mounts) != 1 || d.Mounts[0].Path != f.dir || d.Mounts[0].Backend != "staging" || d.Mounts[0].IO == "":
		t.Errorf("mounts %+v, want one at %s", d.Mounts, f.dir)
	case d.Mounts[0].Class == "" || d.Mounts[0].Class != f.eng.Stats().Mounts[0].Class:
		t.Errorf("mount class %q, want the engine's %q", d.Mounts[0].Class, f.eng.Stats().Mounts[0].Class)
	case st.Regions != 1:
		t.Errorf("connection regions %d, want its own 1", st.Regions)
	}
	ss := f.srv.Stats()
	if ss.Clients != 2 || ss.Regions != 2 || ss.InflightJobs != 0 || ss.RegisteredLimit <= 0 {
		t.Errorf("server stats %+v", ss)
	}
}

// TestStatsSparesSectionHasEveryMount: a Stats reply carries the spares
// section, one entry per mount, matching the engine's figures.
func TestStatsSparesSectionHasEveryMount(t *testing.T) {
	f := newFixture(t, server.Config{})
	c := f.dial(t)
	st, err := c.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	es := f.eng.Stats()
	switch {
	case st.Spares == nil:
		t.Fatal("no spares section")
	case len(st.Spares.Mounts) != len(st.Mounts) || len(st.Mounts) != len(es.Mounts):
		t.Fatalf("%d spare entries for %d mounts (engine %d)", len(st.Spares.Mounts), len(st.Mounts), len(es.Mounts))
	case st.Spares.Reused != es.Reused || st.Spares.Made != es.SparesMade || st.Spares.Mounts[0].Files != uint64(es.Mounts[0].SpareFiles) || st.Spares.Mounts[0].Bytes != uint64(es.Mounts[0].SpareBytes):
		t.Fatalf("spares %+v, engine reused %d, mount %+v", st.Spares, es.Reused, es.Mounts[0])
	}
}

// TestStatsBudgetsSectionFromTheEngine: a daemon whose engine has byte
// budgets sends each one's use in the daemon section, in configuration
// order: the bytes of the namespace stored under it against its budget
// and floor, and the evictions it caused once its namespace went over
// it; a budget covering nothing stored shows none. A daemon without
// budgets sends an empty list (none), not nil (a daemon that predates
// them).
func TestStatsBudgetsSectionFromTheEngine(t *testing.T) {
	const capacity, budget, floor = 96 << 10, 32 << 10, 8 << 10
	f := newFixtureWith(t, server.Config{}, func(cfg *engine.Config) {
		cfg.Mounts[0].Capacity = capacity
		cfg.Budgets = []engine.Budget{{Model: geo.Model, Bytes: budget, Floor: floor}, {Model: "other:*", Bytes: 1 << 20, Floor: 4 << 10}}
	}, nil)
	c := f.dial(t)
	k := newCache(t, c)
	rng := rand.New(rand.NewPCG(2, 2))
	for i := range 40 {
		k.store(t, fmt.Sprint("key", i), []uint32{0, 1, 2, 3}[:geo.BlocksPerKey()], rng)
	}
	st, err := c.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	bs := st.Daemon.Budgets
	if len(bs) != 2 {
		t.Fatalf("budgets %+v, want the engine's 2", bs)
	}
	m, other := bs[0], bs[1]
	switch {
	case m.Model != geo.Model || m.Budget != budget || m.Floor != floor:
		t.Errorf("first budget %+v, want %q of %d bytes, floor %d", m, geo.Model, budget, floor)
	case m.Used == 0 || m.Used > capacity:
		t.Errorf("first budget uses %d bytes, want the namespace's files (at most the mount's %d)", m.Used, capacity)
	case m.Over == 0:
		t.Errorf("first budget caused no evictions after 40 stores on a mount of %d bytes: %+v", capacity, m)
	case other != (protocol.BudgetStats{Model: "other:*", Budget: 1 << 20, Floor: 4 << 10}):
		t.Errorf("second budget %+v, want its pattern, budget and floor and nothing used or evicted", other)
	case st.Daemon.BudgetsLeftOut != 0:
		t.Errorf("%d budgets left out of 2", st.Daemon.BudgetsLeftOut)
	}
	plain, err := newFixture(t, server.Config{}).dial(t).Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if b := plain.Daemon.Budgets; b == nil || len(b) != 0 {
		t.Errorf("a daemon without budgets sends %#v, want an empty list", b)
	}
}

// manyBudgets is an engine whose Stats list the most budgets a reply
// carries, each of the longest pattern, beside bigStats' mounts and
// namespaces.
type manyBudgets struct{ bigStats }

func (b manyBudgets) Stats() engine.Stats {
	st := b.bigStats.Stats()
	st.Budgets = nil
	for i := range protocol.MaxStatsBudgets {
		st.Budgets = append(st.Budgets, engine.BudgetStats{Model: fmt.Sprintf("%0*d*", 254, i), Bytes: int64(i), Budget: 1 << 30})
	}
	return st
}

// TestStatsBudgetsFitTheSmallestFrame: with the smallest frames and two
// mounts of 8 KiB each, the most budgets of the longest patterns (38 KiB)
// are all sent and the namespaces listed beside them are those that fit,
// the rest counted as left out: the reply reaches the client.
func TestStatsBudgetsFitTheSmallestFrame(t *testing.T) {
	f := newFixtureWith(t, server.Config{MaxFrame: protocol.MinFrame}, nil, func(e *engine.Engine) server.Engine {
		return manyBudgets{bigStats{Engine: e, mounts: 2, namespaces: 200}}
	})
	st, err := f.dial(t).Stats(context.Background())
	if err != nil {
		t.Fatalf("Stats from a daemon of MinFrame frames: %v", err)
	}
	if bs := st.Daemon.Budgets; len(bs) != protocol.MaxStatsBudgets || bs[7].Used != 7 || len(bs[7].Model) != 255 {
		t.Fatalf("%d budgets, want %d of 255-byte patterns", len(bs), protocol.MaxStatsBudgets)
	}
	if nl := st.Namespaces; len(nl.List) == 0 || len(nl.List) >= protocol.MaxStatsNamespaces || len(nl.List)+int(nl.LeftOut) != 200 {
		t.Fatalf("namespaces listed %d, left out %d, of 200: want fewer than %d listed beside the budgets", len(nl.List), nl.LeftOut, protocol.MaxStatsNamespaces)
	}
	if sf := st.StoresFailing; len(sf) != 2 || len(sf[0].Err) != 4000 {
		t.Fatalf("mount failures %d, want 2 with their texts whole", len(sf))
	}
}
