package server_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/protocol"
)

// peerSocketEnv names the socket a re-executed test binary connects to as
// another process (TestHelperOtherProcessClient); peerStoreEnv, if set,
// has it also start a store (otherProcess).
const (
	peerSocketEnv = "KVHOST_TEST_PEER_SOCKET"
	peerStoreEnv  = "KVHOST_TEST_PEER_STORE"
	peerPinEnv    = "KVHOST_TEST_PEER_PIN"
)

// TestHelperOtherProcessClient is not a test: run by otherProcess in a
// process of its own, it connects to the socket in
// $KVHOST_TEST_PEER_SOCKET, registers 1 MiB and declares a namespace;
// with $KVHOST_TEST_PEER_PIN set, it pins that key of the namespace; with
// $KVHOST_TEST_PEER_STORE set, it also registers a cache of wideGeo and
// has a store of a fat job accepted.
func TestHelperOtherProcessClient(t *testing.T) {
	socket := os.Getenv(peerSocketEnv)
	if socket == "" {
		t.Skip("run by otherProcess")
	}
	ctx := context.Background()
	c, err := client.Dial(ctx, socket, "other-process")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	holdMiB(t, c)
	ns, err := c.Declare(ctx, geo)
	if err != nil {
		t.Fatal(err)
	}
	if key := os.Getenv(peerPinEnv); key != "" {
		p, err := c.Pin(ctx, ns.ID, [][]byte{[]byte(key)}, 0)
		if err != nil || !p.Held[0] {
			t.Fatalf("pin %q: %+v, %v", key, p, err)
		}
	}
	if os.Getenv(peerStoreEnv) != "" {
		k := newWideCache(t, c)
		if _, err := k.store(ctx, "other", 0); err != nil {
			t.Fatalf("store: %v", err)
		}
	}
}

// otherProcess runs TestHelperOtherProcessClient against f in a process of
// its own, with env added to its environment, and fails t if it fails.
func otherProcess(t *testing.T, f *fixture, env ...string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperOtherProcessClient$", "-test.count=1")
	cmd.Env = append(append(os.Environ(), peerSocketEnv+"="+f.socket), env...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("another process is locked out: %v\n%s", err, out)
	}
}

// holdMiB registers a 1 MiB memfd on c: the connection then holds a region
// and is never closed for being idle.
func holdMiB(tb testing.TB, c *client.Client) {
	tb.Helper()
	registerMemfd(tb, c, "hold", 1<<20)
}

// TestOneProcessCannotTakeEveryClientSlot: one process opening as many
// connections as the daemon serves clients (64 by default), each holding a
// 1 MiB region, gets half of them, refused beyond with limit exceeded;
// another process then still connects and works.
func TestOneProcessCannotTakeEveryClientSlot(t *testing.T) {
	f := newFixture(t, server.Config{})
	const maxClients, perPeer = 64, 32 // the defaults
	admitted := 0
	for range maxClients {
		c, err := client.Dial(context.Background(), f.socket, "greedy")
		if err != nil {
			var pe *protocol.Error
			if !errors.As(err, &pe) || pe.Code != protocol.CodeLimit {
				t.Fatalf("connection %d: %v, want limit exceeded", admitted+1, err)
			}
			continue
		}
		t.Cleanup(func() { c.Close() })
		holdMiB(t, c)
		admitted++
	}
	if admitted != perPeer {
		t.Errorf("one process got %d of %d client slots, want %d", admitted, maxClients, perPeer)
	}
	otherProcess(t, f)
}

// TestOneProcessCannotTakeEveryNamespace: one process declaring new
// geometries on connection after connection gets
// server.max_namespaces_per_peer of them (64 by default, what one
// connection may declare), refused beyond with limit exceeded naming the
// key, however many connections it opens; another process then still
// declares a new geometry. The engine here knows at most 100 namespaces
// (fewNamespaces), so that two connections' 64 each would exceed it.
func TestOneProcessCannotTakeEveryNamespace(t *testing.T) {
	f := newFixtureWith(t, server.Config{}, fewNamespaces, nil)
	ctx := context.Background()
	const perPeer = 64 // the default
	declared, next := 0, 0
	var refused error
	for range 3 {
		c := f.dial(t)
		holdMiB(t, c)
		for range 64 { // a connection's own bound
			_, err := c.Declare(ctx, throwaway(next))
			next++
			if err != nil {
				refused = err
				break
			}
			declared++
		}
	}
	if declared != perPeer {
		t.Errorf("one process declared %d namespaces on 3 connections, want %d", declared, perPeer)
	}
	var pe *protocol.Error
	if !errors.As(refused, &pe) || pe.Code != protocol.CodeLimit || !strings.Contains(pe.Message, "server.max_namespaces_per_peer") {
		t.Errorf("declaration beyond the process's namespaces: %v, want limit exceeded naming server.max_namespaces_per_peer", refused)
	}
	otherProcess(t, f)
}
