package client_test

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/testsock"
	"github.com/kvhost/kvhost/protocol"
)

// TestLoadLayersNeedsTheFeature: to a daemon whose Welcome announces no
// layer-range loads (version 1, or version 2 without the bit) LoadLayers
// returns ErrUnsupported and sends nothing: the next frame the daemon
// reads is the request after it.
func TestLoadLayersNeedsTheFeature(t *testing.T) {
	for _, w := range []*protocol.Welcome{
		{Version: 1, MaxFrame: protocol.MinFrame, MaxKeys: 4096, MaxKeyLen: 64, Server: "v1"},
		{Version: 2, MaxFrame: protocol.MinFrame, MaxKeys: 4096, MaxKeyLen: 64, Server: "v2 without the bit"},
	} {
		t.Run(w.Server, func(t *testing.T) {
			sock, next := fakeDaemonAnsweringALookup(t, w)
			c := dialFake(t, sock)
			if c.Supports(client.FeatureLayerLoads) {
				t.Fatal("Supports(FeatureLayerLoads) of a daemon that did not announce it")
			}
			ctx := context.Background()
			_, err := c.LoadLayers(ctx, 1, [][]byte{[]byte("k")}, [][]uint32{{0}}, 0, 1)
			if !errors.Is(err, client.ErrUnsupported) || !strings.Contains(err.Error(), "announced no layer-range loads") {
				t.Fatalf("LoadLayers: %v, want ErrUnsupported", err)
			}
			if _, err := c.Lookup(ctx, 1, [][]byte{[]byte("k")}); err != nil {
				t.Fatal(err)
			}
			if got := <-next; got != protocol.TypeLookup {
				t.Fatalf("the daemon read %s after the refused LoadLayers, want the lookup", got)
			}
		})
	}
}

// TestLoadLayersRefusesRangesLocally: a range no namespace can have is
// refused with ErrInvalid, naming it, before anything is sent.
func TestLoadLayersRefusesRangesLocally(t *testing.T) {
	sock := fakeDaemonWelcoming(t, &protocol.Welcome{Version: 2, MaxFrame: protocol.MinFrame, MaxKeys: 4096, MaxKeyLen: 64,
		Features: protocol.FeatureLayerLoads}, func(c *net.UnixConn) {
		readRequest(c) // until the client closes
	})
	c := dialFake(t, sock)
	if !c.Supports(client.FeatureLayerLoads) {
		t.Fatal("Supports(FeatureLayerLoads) false after a Welcome announcing it")
	}
	for _, tc := range []struct {
		first, count int
		want         string
	}{
		{-1, 2, "first -1 count 2"},
		{0, -2, "first 0 count -2"},
		{3, 0, "count 0 means every layer"},
		{protocol.MaxLayers, 1, "ends past layer 4096"},
		{1 << 40, 1, "first 1099511627776"},
	} {
		_, err := c.LoadLayers(context.Background(), 1, [][]byte{[]byte("k")}, [][]uint32{{0}}, tc.first, tc.count)
		if !errors.Is(err, client.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("LoadLayers(first %d, count %d): %v, want ErrInvalid saying %q", tc.first, tc.count, err, tc.want)
		}
	}
}

// TestDialSpeaksVersion1ToADaemonThatRefusesVersion2: a daemon older than
// version 2 refuses the Hello and closes the connection; Dial connects
// again in version 1 and the client sees no features.
func TestDialSpeaksVersion1ToADaemonThatRefusesVersion2(t *testing.T) {
	sock := filepath.Join(testsock.Dir(t), "old.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	hellos := make(chan uint16, 2)
	go func() {
		for range 2 {
			c, err := l.AcceptUnix()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() })
			h, m, err := readRequest(c)
			if err != nil {
				return
			}
			v := m.(*protocol.Hello).Version
			hellos <- v
			if v != 1 {
				c.Write(protocol.AppendFrame(nil, h.ID, &protocol.Error{Code: protocol.CodeVersion, Message: "client speaks version 2, this daemon speaks 1"}))
				c.Close()
				continue
			}
			c.Write(protocol.AppendFrame(nil, h.ID, &protocol.Welcome{Version: 1, MaxFrame: protocol.MinFrame, MaxKeys: 4096, MaxKeyLen: 64, Server: "old"}))
			go readRequest(c) // until the client closes
		}
	}()
	c := dialFake(t, sock)
	if a, b := <-hellos, <-hellos; a != protocol.Version || b != protocol.MinVersion {
		t.Fatalf("Hellos of versions %d then %d, want %d then %d", a, b, protocol.Version, protocol.MinVersion)
	}
	if lim := c.Limits(); lim.Version != 1 || lim.Server != "old" || lim.Features != 0 || c.Supports(client.FeatureLayerLoads) {
		t.Fatalf("limits %+v after the fallback, want version 1 of %q without features", lim, "old")
	}
}

// fakeDaemonAnsweringALookup is a fake daemon that sends welcome, reads
// one request, says its type on next (closed if none came) and answers it
// as a lookup: a client that refuses a request locally sends the next one
// instead.
func fakeDaemonAnsweringALookup(t *testing.T, welcome *protocol.Welcome) (sock string, next <-chan protocol.Type) {
	ch := make(chan protocol.Type, 1)
	sock = fakeDaemonWelcoming(t, welcome, func(c *net.UnixConn) {
		h, _, err := readRequest(c)
		if err != nil {
			close(ch)
			return
		}
		ch <- h.Type
		c.Write(protocol.AppendFrame(nil, h.ID, &protocol.Count{T: protocol.TypeLookup | protocol.TypeReply}))
	})
	return sock, ch
}
