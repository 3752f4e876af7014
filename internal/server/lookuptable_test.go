package server_test

import (
	"testing"

	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/protocol"
)

// TestLookupTableRequestNamesTheTableOrSaysThereIsNone: a daemon that keeps
// a shared lookup table tells a client its path; one that keeps none
// answers unsupported and keeps the connection.
func TestLookupTableRequestNamesTheTableOrSaysThereIsNone(t *testing.T) {
	t.Run("kept", func(t *testing.T) {
		f := newFixture(t, server.Config{LookupTable: "/run/kvhost/kvhost.sock.lookup"})
		rc := f.raw(t)
		rc.hello()
		rc.send(2, &protocol.LookupTableRequest{})
		_, m, err := rc.recv()
		if err != nil {
			t.Fatal(err)
		}
		if loc, ok := m.(*protocol.TableLocation); !ok || loc.Path != "/run/kvhost/kvhost.sock.lookup" {
			t.Fatalf("reply %#v, want the table's path", m)
		}
	})
	t.Run("none", func(t *testing.T) {
		f := newFixture(t, server.Config{})
		rc := f.raw(t)
		rc.hello()
		rc.send(2, &protocol.LookupTableRequest{})
		rc.expectCode(protocol.CodeUnsupported)
		rc.send(3, &protocol.StatsRequest{})
		if _, m, err := rc.recv(); err != nil {
			t.Fatal(err)
		} else if _, ok := m.(*protocol.Stats); !ok {
			t.Fatalf("after unsupported: reply %#v, want stats", m)
		}
	})
}
