package server_test

import (
	"context"
	"errors"
	"io"
	"testing"
	"time"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/protocol"
	"github.com/kvhost/kvhost/server"
)

// silent opens n connections that never send a byte.
func (f *fixture) silent(tb testing.TB, n int) []*rawConn {
	tb.Helper()
	conns := make([]*rawConn, n)
	for i := range conns {
		conns[i] = f.raw(tb)
	}
	return conns
}

// TestSilentConnectionsDoNotLockOutClients reproduces issue 7: 64
// connections that never say Hello (as many as the daemon serves clients)
// used to make it refuse every new client. Now a client that speaks gets in
// at once, and can work, however many silent connections came before it.
func TestSilentConnectionsDoNotLockOutClients(t *testing.T) {
	f := newFixture(t, server.Config{})
	f.silent(t, 64)
	for i := 0; i < 3; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		c, err := client.Dial(ctx, f.socket, "real")
		cancel()
		if err != nil {
			t.Fatalf("client %d locked out by silent connections: %v", i, err)
		}
		if _, err := c.Declare(context.Background(), geo); err != nil {
			t.Fatalf("client %d: declare: %v", i, err)
		}
		c.Close()
		f.silent(t, 64)
	}
}

// isClosedAfter reads from r until the daemon closes the connection and
// returns the error frames it sent before.
func (r *rawConn) closedWith() []*protocol.Error {
	r.tb.Helper()
	var errs []*protocol.Error
	for {
		_, m, err := r.recv()
		if errors.Is(err, io.EOF) {
			return errs
		}
		if err != nil {
			r.tb.Fatalf("connection not closed by the daemon: %v", err)
		}
		if e, ok := m.(*protocol.Error); ok {
			errs = append(errs, e)
		}
	}
}
