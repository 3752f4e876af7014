package server_test

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/protocol"
)

// TestStatsDaemonSection: a Stats reply carries the daemon section —
// Config.Daemon's fields, every connection's regions and the engine's
// mounts with their paths — and Server.Stats counts clients and regions of
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
