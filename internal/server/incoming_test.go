package server_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/protocol"
)

// TestFrameBodiesAreBounded: connections that send the headers of frames
// of max_frame bytes, and hold back the rest, no longer have the daemon
// allocate every body: the bodies it holds while it reads and answers
// them stay within server.max_incoming_bytes, and those of one process
// within server.max_incoming_bytes_per_peer; the frames beyond wait,
// unread. Once the clients send the rest, every frame is read and
// answered, in turn, the connections serve on and the room is given
// back. One frame of max_frame fits a process's share of max_frame.
func TestFrameBodiesAreBounded(t *testing.T) {
	const (
		maxFrame = 1 << 20
		body     = maxFrame - protocol.HeaderSize
		conns    = 6
	)
	tests := []struct {
		bound string
		cfg   server.Config
		held  int // frames read at once
	}{
		{"server.max_incoming_bytes", server.Config{MaxIncomingBytes: 4 << 20, MaxIncomingBytesPerPeer: 4 << 20}, 4},
		{"server.max_incoming_bytes_per_peer", server.Config{MaxIncomingBytes: 16 << 20, MaxIncomingBytesPerPeer: maxFrame}, 1},
	}
	for _, tc := range tests {
		t.Run(tc.bound, func(t *testing.T) {
			tc.cfg.MaxFrame = maxFrame
			f := newFixture(t, tc.cfg)
			// A Lookup frame of max_frame bytes of zeros: malformed, and
			// answered so once read, on a connection that serves on.
			frame := make([]byte, maxFrame)
			binary.LittleEndian.PutUint32(frame[0:], body)
			binary.LittleEndian.PutUint16(frame[4:], uint16(protocol.TypeLookup))
			binary.LittleEndian.PutUint64(frame[8:], 2)
			const first = protocol.HeaderSize + 128<<10 // sent at once; the rest once rest is closed
			rest := make(chan struct{})
			wrote := make(chan error, conns)
			raws := make([]*rawConn, conns)
			for i := range raws {
				r := f.raw(t)
				r.hello()
				raws[i] = r
				// The daemon does not read a frame that waits for room:
				// its writes block, so they are not the test's.
				go func() {
					if _, err := r.c.Write(frame[:first]); err != nil {
						wrote <- err
						return
					}
					<-rest
					_, err := r.c.Write(frame[first:])
					wrote <- err
				}()
			}
			testwait.Until(t, "every connection's frame to be read or to wait for room", time.Minute, func() bool {
				st := f.srv.Stats()
				return st.IncomingBytes+st.IncomingWaiting*body == conns*body
			})
			st := f.srv.Stats()
			if st.IncomingBytes > int64(tc.held)*body {
				t.Errorf("the daemon holds %d bytes of frame bodies for %d connections (%d frames of %d bytes), more than %s (%d frames) lets it",
					st.IncomingBytes, conns, conns, body, tc.bound, tc.held)
			}
			if st.IncomingWaiting != conns-int64(tc.held) {
				t.Errorf("%d frames wait for room, want %d", st.IncomingWaiting, conns-tc.held)
			}
			close(rest)
			for range conns {
				if err := <-wrote; err != nil {
					t.Fatalf("a client sending its frame: %v", err)
				}
			}
			for i, r := range raws {
				r.expectCode(protocol.CodeMalformed)
				r.send(3, &protocol.StatsRequest{})
				if _, m, err := r.recv(); err != nil || m.Type() != protocol.TypeStats|protocol.TypeReply {
					t.Fatalf("connection %d after its frame of max_frame: %#v %v", i, m, err)
				}
			}
			st = f.srv.Stats()
			if st.IncomingBytes != 0 || st.IncomingWaiting != 0 || st.IncomingWaits != uint64(conns-tc.held) {
				t.Errorf("once every frame was answered the daemon holds %d bytes of frame bodies with %d frames waiting and %d that waited, want 0, 0 and %d",
					st.IncomingBytes, st.IncomingWaiting, st.IncomingWaits, conns-tc.held)
			}
		})
	}
}

// blockedLookups is an engine whose lookups wait until unblock is
// closed, saying on entered that one has begun.
type blockedLookups struct {
	*engine.Engine
	entered chan struct{}
	unblock chan struct{}
}

func (b *blockedLookups) Lookup(ctx context.Context, ns engine.NamespaceID, keys [][]byte) (int, error) {
	b.entered <- struct{}{}
	<-b.unblock
	return b.Engine.Lookup(ctx, ns, keys)
}

// TestStopEndsAFrameWaitingForRoom: a connection whose frame waits for
// room (here server.max_incoming_bytes_per_peer, held by a lookup the
// engine is slow to answer) is released at a shutdown without waiting
// for that room.
func TestStopEndsAFrameWaitingForRoom(t *testing.T) {
	const maxFrame = 1 << 20
	eng := &blockedLookups{entered: make(chan struct{}, 1), unblock: make(chan struct{})}
	f := newFixtureWith(t, server.Config{MaxFrame: maxFrame, MaxIncomingBytesPerPeer: maxFrame}, nil, func(e *engine.Engine) server.Engine {
		eng.Engine = e
		return eng
	})
	holder := f.raw(t)
	holder.hello()
	holder.send(2, &protocol.Declare{Geometry: geo})
	_, m, err := holder.recv()
	if err != nil {
		t.Fatal(err)
	}
	ns, ok := m.(*protocol.Declared)
	if !ok {
		t.Fatalf("declare: %#v", m)
	}
	keys := make([][]byte, protocol.MaxKeysPerRequest)
	for i := range keys {
		keys[i] = fmt.Appendf(nil, "held-%015d", i)
	}
	holder.send(3, &protocol.Lookup{NS: ns.NS, Keys: keys}) // more than UncountedBody
	<-eng.entered

	waiter := f.raw(t)
	waiter.hello()
	var hdr [protocol.HeaderSize]byte
	binary.LittleEndian.PutUint32(hdr[0:], maxFrame-protocol.HeaderSize)
	binary.LittleEndian.PutUint16(hdr[4:], uint16(protocol.TypeLookup))
	waiter.write(hdr[:])
	testwait.Until(t, "the second frame to wait for room", time.Minute, func() bool { return f.srv.Stats().IncomingWaiting == 1 })

	go f.srv.Shutdown()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err = f.srv.WaitSessions(ctx, 1) // the holder's lookup still runs
	close(eng.unblock)
	if err != nil {
		t.Fatalf("the connection waiting for room was not released at the shutdown: %v", err)
	}
	if st := f.srv.Stats(); st.IncomingWaiting != 0 {
		t.Errorf("%d frames wait for room after the shutdown, want none", st.IncomingWaiting)
	}
}
