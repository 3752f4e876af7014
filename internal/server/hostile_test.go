package server_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/protocol"
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
// The silent connections never time out here (HandshakeTimeout of an
// hour): only the bound on handshakes can let the client in, so the dial
// needs no time limit but a hang guard.
func TestSilentConnectionsDoNotLockOutClients(t *testing.T) {
	f := newFixture(t, server.Config{HandshakeTimeout: time.Hour})
	f.silent(t, 64)
	for i := 0; i < 3; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
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

// closedWith reads from r until the daemon closes the connection and
// returns the error frames it sent before. A reset is a close too: the
// daemon closed the connection with bytes of the client's unread (written
// after its deadline had passed).
func (r *rawConn) closedWith() []*protocol.Error {
	r.tb.Helper()
	var errs []*protocol.Error
	for {
		_, m, err := r.recv()
		if errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) {
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

// TestHandshakeBoundEvictsOldestSilent: beyond MaxHandshakes connections
// that have not said Hello, a new connection closes the oldest of them,
// telling it why; the others are kept.
func TestHandshakeBoundEvictsOldestSilent(t *testing.T) {
	f := newFixture(t, server.Config{MaxHandshakes: 2, HandshakeTimeout: time.Hour})
	first := f.raw(t)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Hang)
	defer cancel()
	if err := f.srv.WaitSessions(ctx, 1); err != nil {
		t.Fatal(err)
	}
	second := f.raw(t)
	if err := f.srv.WaitSessions(ctx, 2); err != nil {
		t.Fatal(err)
	}
	f.raw(t) // the third: the first must go
	if errs := first.closedWith(); len(errs) != 1 || errs[0].Code != protocol.CodeTimeout {
		t.Fatalf("oldest silent connection closed with %v, want one %s error", errs, protocol.CodeTimeout)
	}
	second.hello() // still served
}

// TestConnectionDeadlines: a connection that misses a deadline (Hello,
// the rest of a frame, idle holding nothing) is told so and closed. The
// deadlines are short, and on a slow machine one may pass before the
// client's steps after the one that starts it (the rest of the hello, the
// request after the hello): those steps tolerate a connection already
// closed, and the outcome checked is the same either way.
func TestConnectionDeadlines(t *testing.T) {
	const short = 100 * time.Millisecond
	header := protocol.AppendFrame(nil, 9, &protocol.Lookup{NS: 1, Keys: [][]byte{[]byte("k")}})
	tests := []struct {
		name string
		cfg  server.Config
		act  func(r *rawConn)
	}{
		{"no hello", server.Config{HandshakeTimeout: short}, func(r *rawConn) {}},
		{"half a hello", server.Config{HandshakeTimeout: short}, func(r *rawConn) {
			// The handshake's deadline runs from the connection.
			r.writeRacing(protocol.AppendFrame(nil, 1, &protocol.Hello{Version: protocol.Version})[:20])
		}},
		{"half a header", server.Config{FrameTimeout: short}, func(r *rawConn) {
			r.hello()
			r.write(header[:5])
		}},
		{"header without its body", server.Config{FrameTimeout: short}, func(r *rawConn) {
			r.hello()
			r.write(header[:protocol.HeaderSize+3])
		}},
		{"idle holding nothing", server.Config{IdleTimeout: short}, func(r *rawConn) {
			r.hello()
			// The idle limit runs from the welcome: the request may
			// come after it (closedWith skips the reply, if any).
			r.writeRacing(protocol.AppendFrame(nil, 2, &protocol.StatsRequest{}))
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, tc.cfg)
			r := f.raw(t)
			tc.act(r)
			if errs := r.closedWith(); len(errs) != 1 || errs[0].Code != protocol.CodeTimeout {
				t.Fatalf("closed with %v, want one %s error", errs, protocol.CodeTimeout)
			}
		})
	}
}

func (r *rawConn) write(b []byte) {
	r.tb.Helper()
	if _, err := r.c.Write(b); err != nil {
		r.tb.Fatal(err)
	}
}

// writeRacing writes b where a deadline of the daemon's may already have
// passed: a failed write means the daemon closed the connection, which
// the test then sees (closedWith).
func (r *rawConn) writeRacing(b []byte) { r.c.Write(b) }

// TestIdleLimitSparesHolders: the idle limit closes only connections that
// hold nothing; one with a declared namespace stays, however long it is
// silent.
func TestIdleLimitSparesHolders(t *testing.T) {
	f := newFixture(t, server.Config{IdleTimeout: 50 * time.Millisecond})
	// The holder's Hello and Declare go in one write: the daemon reads
	// the Declare with the Hello, so the holder is never idle holding
	// nothing, however slowly the machine runs.
	holder := f.raw(t)
	holder.write(protocol.AppendFrame(protocol.AppendFrame(nil, 1, &protocol.Hello{Version: protocol.Version}), 2, &protocol.Declare{Geometry: geo}))
	if _, m, err := holder.recv(); err != nil || m.Type() != protocol.TypeHello|protocol.TypeReply {
		t.Fatalf("welcome: %#v %v", m, err)
	}
	_, m, err := holder.recv()
	d, ok := m.(*protocol.Declared)
	if err != nil || !ok {
		t.Fatalf("declare: %#v %v", m, err)
	}
	// Two idle connections in turn, the second opened once the first is
	// gone: by then the holder has been silent for two idle limits.
	for i := 0; i < 2; i++ {
		r := f.raw(t)
		r.hello()
		if errs := r.closedWith(); len(errs) != 1 || errs[0].Code != protocol.CodeTimeout {
			t.Fatalf("idle connection %d closed with %v", i, errs)
		}
	}
	holder.send(3, &protocol.Lookup{NS: d.NS, Keys: [][]byte{[]byte("k")}})
	if _, m, err := holder.recv(); err != nil || m.Type() != protocol.TypeLookup|protocol.TypeReply {
		t.Fatalf("a silent connection holding a namespace was closed: %#v %v", m, err)
	}
}

// TestClientThatDoesNotReadIsClosed: a client that sends requests but never
// reads its replies used to keep its session (and a client slot) for ever;
// its writes now time out and the session ends while the client still has
// the connection open.
func TestClientThatDoesNotReadIsClosed(t *testing.T) {
	f := newFixture(t, server.Config{WriteTimeout: 100 * time.Millisecond})
	r := f.raw(t)
	r.send(1, &protocol.Hello{Version: protocol.Version})
	r.send(2, &protocol.Declare{Geometry: protocol.Geometry{Model: "m", Layers: 2, KVHeads: 1, HeadSize: 64, DtypeSize: 2, TokensPerBlock: 4, TokensPerKey: 8, TPSize: 1}})
	frame := protocol.AppendFrame(nil, 3, &protocol.StatsRequest{})
	var burst []byte
	for i := 0; i < 4096; i++ {
		burst = append(burst, frame...)
	}
	// Write until both directions' socket buffers are full.
	r.c.SetWriteDeadline(time.Now().Add(500 * time.Millisecond))
	for {
		if _, err := r.c.Write(burst); err != nil {
			break
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Hang)
	defer cancel()
	if err := f.srv.WaitSessions(ctx, 0); err != nil {
		t.Fatalf("the session of a client that does not read was not ended: %v", err)
	}
}

// TestFrameBeforeHelloIsBoundedByTheHandshakeLimit: before its Hello a
// connection may send frames of at most protocol.MaxHandshakeFrame bytes,
// whatever MaxFrame says: a larger header is answered with
// Error(malformed) and the connection closed, without waiting for (and
// allocating) its body. After the Hello, frames up to MaxFrame are read.
func TestFrameBeforeHelloIsBoundedByTheHandshakeLimit(t *testing.T) {
	f := newFixture(t, server.Config{MaxFrame: 4 << 20})
	r := f.raw(t)
	hdr := protocol.AppendFrame(nil, 1, &protocol.Hello{Version: protocol.Version})[:protocol.HeaderSize]
	binary.LittleEndian.PutUint32(hdr, protocol.MaxHandshakeFrame-protocol.HeaderSize+1)
	r.write(hdr)
	if errs := r.closedWith(); len(errs) != 1 || errs[0].Code != protocol.CodeMalformed {
		t.Fatalf("a %d-byte frame before hello: closed with %v, want one %s error", protocol.MaxHandshakeFrame+1, errs, protocol.CodeMalformed)
	}

	r = f.raw(t)
	r.hello()
	keys := make([][]byte, protocol.MaxKeysPerRequest)
	for i := range keys {
		keys[i] = bytes.Repeat([]byte{byte(i)}, protocol.MaxKeyLen)
	}
	lookup := protocol.AppendFrame(nil, 2, &protocol.Lookup{NS: 1, Keys: keys})
	if len(lookup) <= protocol.MaxHandshakeFrame {
		t.Fatalf("lookup frame of %d bytes: want more than %d", len(lookup), protocol.MaxHandshakeFrame)
	}
	r.write(lookup)
	r.expectCode(protocol.CodeUnknownNS)
}
