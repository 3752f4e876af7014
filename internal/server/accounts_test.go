package server_test

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/protocol"
)

// The bounds the hostile clients run into: small enough that every one
// of them refuses requests, large enough for the Config's checks.
const (
	hostileMaxFrame  = 256 << 10
	hostileMemfd     = 64 << 10 // bytes of a hostile client's memfd
	hostileBlocks    = 32       // blocks of a layer of a hostile cache
	hostileKeyLen    = 16
	hostileKeySpace  = 64 // small keys are drawn from these, so loads hit
	hostileReplyWait = time.Minute
)

// hostileConfig is the daemon the hostile clients hammer.
func hostileConfig() server.Config {
	return server.Config{
		MaxFrame:                hostileMaxFrame,
		MaxClientsPerPeer:       11,
		MaxInflightJobs:         6,
		MaxDescriptors:          40,
		MaxDescriptorsPerPeer:   20,
		MaxInflightBytes:        2 * server.MaxJobBytes(hostileMaxFrame),
		MaxInflightBytesPerPeer: server.MaxJobBytes(hostileMaxFrame),
		MaxPinnedKeys:           2 * protocol.MaxKeysPerRequest,
		MaxPinnedKeysPerPeer:    protocol.MaxKeysPerRequest,
		MaxCacheLayers:          2 * protocol.MaxLayers,
		MaxCacheLayersPerPeer:   protocol.MaxLayers,
		MaxIncomingBytes:        4 * hostileMaxFrame,
		MaxIncomingBytesPerPeer: 2 * hostileMaxFrame,
		MaxNamespacesPerPeer:    4,
		HandshakeTimeout:        time.Second,
		FrameTimeout:            time.Second,
	}
}

// hostileGeos are the geometries the hostile clients declare: more than
// a process may hold (MaxNamespacesPerPeer 4) and than the engine knows
// at once (MaxNamespaces 4). A cache of acct-wide's 2,100 layers is
// registered in a frame of more than UncountedBody bytes, and a second
// one passes server.max_cache_layers_per_peer.
var hostileGeos = []protocol.Geometry{
	{Model: "acct-a", Layers: 2, KVHeads: 1, HeadSize: 64, DtypeSize: 2, TokensPerBlock: 4, TokensPerKey: 8, TPSize: 1},
	{Model: "acct-b", Layers: 2, KVHeads: 1, HeadSize: 64, DtypeSize: 2, TokensPerBlock: 4, TokensPerKey: 4, TPSize: 1},
	{Model: "acct-wide", Layers: 2100, KVHeads: 1, HeadSize: 64, DtypeSize: 2, TokensPerBlock: 4, TokensPerKey: 4, TPSize: 1},
	{Model: "acct-c", Layers: 2, KVHeads: 1, HeadSize: 64, DtypeSize: 2, TokensPerBlock: 4, TokensPerKey: 4, TPSize: 1},
	{Model: "acct-d", Layers: 2, KVHeads: 1, HeadSize: 64, DtypeSize: 2, TokensPerBlock: 4, TokensPerKey: 4, TPSize: 1},
}

// flakyEngine fails a share of the calls that can fail, before the
// engine sees them, and keeps the namespaces declared and not released.
type flakyEngine struct {
	*engine.Engine
	mu       sync.Mutex
	rng      *rand.Rand
	declared map[engine.NamespaceID]bool
}

var errFlaky = errors.New("flaky engine: injected failure")

func (e *flakyEngine) fail() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.rng.IntN(10) == 0
}

func (e *flakyEngine) Declare(ctx context.Context, g engine.Geometry) (engine.NamespaceID, error) {
	if e.fail() {
		return 0, fmt.Errorf("%w: declare", errFlaky)
	}
	id, err := e.Engine.Declare(ctx, g)
	if err == nil {
		e.mu.Lock()
		e.declared[id] = true
		e.mu.Unlock()
	}
	return id, err
}

func (e *flakyEngine) Release(id engine.NamespaceID) error {
	e.mu.Lock()
	delete(e.declared, id)
	e.mu.Unlock()
	return e.Engine.Release(id)
}

// unreleased returns the namespaces declared and not released.
func (e *flakyEngine) unreleased() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.declared)
}

func (e *flakyEngine) Fingerprint(ns engine.NamespaceID) (uint64, error) {
	if e.fail() {
		return 0, fmt.Errorf("%w: fingerprint", errFlaky)
	}
	return e.Engine.Fingerprint(ns)
}

func (e *flakyEngine) RegisterCache(ns engine.NamespaceID, layers []engine.LayerTensor) (engine.CacheID, error) {
	if e.fail() {
		return 0, fmt.Errorf("%w: register cache", errFlaky)
	}
	return e.Engine.RegisterCache(ns, layers)
}

func (e *flakyEngine) Store(ctx context.Context, req engine.StoreRequest) (*engine.Job, error) {
	if e.fail() {
		return nil, fmt.Errorf("%w: store", errFlaky)
	}
	return e.Engine.Store(ctx, req)
}

func (e *flakyEngine) Load(ctx context.Context, req engine.LoadRequest) (*engine.Job, error) {
	if e.fail() {
		return nil, fmt.Errorf("%w: load", errFlaky)
	}
	return e.Engine.Load(ctx, req)
}

func (e *flakyEngine) Lookup(ctx context.Context, ns engine.NamespaceID, keys [][]byte) (int, error) {
	if e.fail() {
		return 0, fmt.Errorf("%w: lookup", errFlaky)
	}
	return e.Engine.Lookup(ctx, ns, keys)
}

func (e *flakyEngine) Pin(ctx context.Context, ns engine.NamespaceID, keys [][]byte, lease time.Duration) (engine.PinID, []bool, error) {
	if e.fail() {
		return 0, nil, fmt.Errorf("%w: pin", errFlaky)
	}
	return e.Engine.Pin(ctx, ns, keys, lease)
}

// hostileFixture is a daemon with hostileConfig whose engine fails a
// share of its calls and of its file reads and writes once armed.
func hostileFixture(t *testing.T) (*fixture, *flakyEngine) {
	flaky := &flakyEngine{rng: rand.New(rand.NewPCG(7, 7)), declared: map[engine.NamespaceID]bool{}}
	var armed atomic.Bool
	var fmu sync.Mutex
	frng := rand.New(rand.NewPCG(8, 8))
	inj := fsys.InjectorFunc(func(op fsys.Op, _ string) fsys.Fault {
		if !armed.Load() || (op != fsys.OpRead && op != fsys.OpWrite) {
			return fsys.Fault{}
		}
		fmu.Lock()
		defer fmu.Unlock()
		if frng.IntN(20) == 0 {
			return fsys.Fault{Err: syscall.EIO}
		}
		return fsys.Fault{}
	})
	f := newFixtureWith(t, hostileConfig(), func(c *engine.Config) {
		c.FS = &fsys.Faulty{FS: fsys.OS{}, Inj: inj}
		c.MaxNamespaces = 4
	}, func(e *engine.Engine) server.Engine {
		flaky.Engine = e
		return flaky
	})
	armed.Store(true)
	return f, flaky
}

// hostileConn is a connection of a hostile client: frames written by
// hand, with descriptors, and a reader that routes replies by id.
type hostileConn struct {
	tb   testing.TB
	c    *net.UnixConn
	mu   sync.Mutex
	next uint64
	wait map[uint64]chan protocol.Message
	dead chan struct{} // closed when the daemon closed the connection
	// What the connection holds, by the daemon's ids.
	regions []uint32
	ns      map[int]uint32 // by index in hostileGeos
	caches  []hostileCache
	pins    []uint64
}

// hostileCache is a cache a hostile connection registered.
type hostileCache struct {
	id  uint32
	bpk int
}

var errConnGone = errors.New("the daemon closed the connection")

func dialHostile(tb testing.TB, socket string) (*hostileConn, error) {
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: socket, Net: "unix"})
	if err != nil {
		return nil, err
	}
	h := &hostileConn{tb: tb, c: c, wait: map[uint64]chan protocol.Message{}, dead: make(chan struct{}), ns: map[int]uint32{}}
	go h.read()
	return h, nil
}

// read routes replies to their callers until the connection ends.
func (h *hostileConn) read() {
	defer close(h.dead)
	r := bufio.NewReaderSize(h.c, 64<<10)
	for {
		var hdr [protocol.HeaderSize]byte
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return
		}
		ph, err := protocol.ParseHeader(hdr[:], protocol.MaxFrame)
		if err != nil {
			h.tb.Errorf("the daemon sent a bad header: %v", err)
			return
		}
		body := make([]byte, ph.Len)
		if _, err := io.ReadFull(r, body); err != nil {
			return
		}
		m, err := protocol.Decode(ph.Type, body)
		if err != nil {
			h.tb.Errorf("the daemon sent a bad %s frame: %v", ph.Type, err)
			return
		}
		h.mu.Lock()
		ch := h.wait[ph.ID]
		delete(h.wait, ph.ID)
		h.mu.Unlock()
		if ch != nil && ph.ID != 0 {
			ch <- m
		}
	}
}

// write sends b with fds, failing only where the daemon closed the
// connection.
func (h *hostileConn) write(b []byte, fds ...int) error {
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	_, _, err := h.c.WriteMsgUnix(b, oob, nil)
	return err
}

// reserve returns a new request id and a channel that gets its reply.
func (h *hostileConn) reserve() (uint64, chan protocol.Message) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.next++
	ch := make(chan protocol.Message, 1)
	h.wait[h.next] = ch
	return h.next, ch
}

// frame returns the frame of m with a new request id, and a channel
// that gets its reply.
func (h *hostileConn) frame(m protocol.Message) ([]byte, chan protocol.Message) {
	id, ch := h.reserve()
	return protocol.AppendFrame(nil, id, m), ch
}

// call sends m with fds and returns the reply, or errConnGone.
func (h *hostileConn) call(m protocol.Message, fds ...int) (protocol.Message, error) {
	b, ch := h.frame(m)
	return h.await(ch, m.Type(), h.write(b, fds...))
}

// await returns the reply ch gets, or errConnGone where the write of its
// request failed (werr) or the daemon closed the connection.
func (h *hostileConn) await(ch chan protocol.Message, t protocol.Type, werr error) (protocol.Message, error) {
	if werr != nil {
		return nil, errConnGone
	}
	timer := time.NewTimer(hostileReplyWait)
	defer timer.Stop()
	select {
	case m := <-ch:
		return m, nil
	case <-h.dead:
		select {
		case m := <-ch: // the reply came before the close
			return m, nil
		default:
			return nil, errConnGone
		}
	case <-timer.C:
		h.tb.Errorf("no reply to %s in %v on a connection the daemon keeps open", t, hostileReplyWait)
		return nil, errConnGone
	}
}

// post sends m with fds and does not wait for its reply.
func (h *hostileConn) post(m protocol.Message, fds ...int) {
	b, _ := h.frame(m)
	h.write(b, fds...)
}

// gone waits until the daemon closes the connection.
func (h *hostileConn) gone(what string) {
	select {
	case <-h.dead:
	case <-time.After(hostileReplyWait):
		h.tb.Errorf("the daemon kept a connection open %v after %s", hostileReplyWait, what)
	}
}

// close closes the connection and waits for its reader to end.
func (h *hostileConn) close() {
	h.c.Close()
	<-h.dead
}

// hostileTally counts what the hostile clients got done, for the log.
type hostileTally struct {
	conns, welcomed, regions, caches, jobs, pins, limits, gone atomic.Int64
}

func (t *hostileTally) String() string {
	return fmt.Sprintf("%d connections, %d through hello, %d regions, %d caches, %d jobs accepted, %d pins held, %d refused by a limit, %d cut off by the daemon",
		t.conns.Load(), t.welcomed.Load(), t.regions.Load(), t.caches.Load(), t.jobs.Load(), t.pins.Load(), t.limits.Load(), t.gone.Load())
}

// hostileClient opens connections one after another and on each makes
// random requests, with its descriptors: a sealed memfd of hostileMemfd
// bytes, one not sealed, and a pipe.
type hostileClient struct {
	tb       testing.TB
	socket   string
	rng      *rand.Rand
	tally    *hostileTally
	memfd    *client.Memfd
	unsealed int
	pipe     [2]int
	// observe, if set, is called after each request.
	observe func()
}

func newHostileClient(tb testing.TB, socket string, seed uint64, tally *hostileTally) *hostileClient {
	tb.Helper()
	mem, err := client.NewMemfd("hostile", hostileMemfd)
	if err != nil {
		tb.Fatal(err)
	}
	unsealed, err := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC)
	if err != nil {
		tb.Fatal(err)
	}
	if err := unix.Ftruncate(unsealed, hostileMemfd); err != nil {
		tb.Fatal(err)
	}
	k := &hostileClient{tb: tb, socket: socket, rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)), tally: tally, memfd: mem, unsealed: unsealed}
	if err := unix.Pipe2(k.pipe[:], unix.O_CLOEXEC); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		mem.Close()
		unix.Close(unsealed)
		unix.Close(k.pipe[0])
		unix.Close(k.pipe[1])
	})
	return k
}

// run opens conns connections in turn and on each does up to ops random
// things, then ends it one of many ways.
func (k *hostileClient) run(conns, ops int) {
	for range conns {
		k.connection(ops)
	}
}

// connection runs one connection: its handshake, at times the setup of
// a client, up to ops requests and its end.
func (k *hostileClient) connection(ops int) {
	h, err := dialHostile(k.tb, k.socket)
	if err != nil {
		return // the daemon is shutting down
	}
	k.tally.conns.Add(1)
	defer h.close()
	if !k.handshake(h) {
		return
	}
	if k.rng.IntN(4) != 0 && !k.setup(h) {
		k.tally.gone.Add(1)
		return
	}
	for range k.rng.IntN(ops + 1) {
		err := k.request(h)
		if k.observe != nil {
			k.observe()
		}
		if err != nil {
			k.tally.gone.Add(1)
			return
		}
	}
	k.end(h)
}

// handshake says hello, or does one of the things a client may do
// instead; it reports whether the connection is through it.
func (k *hostileClient) handshake(h *hostileConn) bool {
	hello := &protocol.Hello{Version: protocol.Version, Client: "hostile"}
	switch k.rng.IntN(24) {
	case 0: // closed at once
		return false
	case 1: // a request first, with a descriptor
		h.post(&protocol.StatsRequest{}, k.memfd.Fd())
		h.gone("a request before hello")
		return false
	case 2: // another version
		h.post(&protocol.Hello{Version: protocol.Version + 1})
		h.gone("a hello of another version")
		return false
	case 3: // silent until the handshake's limit
		h.gone("a silent connection")
		return false
	case 4: // half a hello, with a descriptor
		b := protocol.AppendFrame(nil, 1, hello)
		h.write(b[:len(b)/2], k.memfd.Fd())
		return false
	case 5: // more connections at once than a process may hold
		for range 4 {
			if o, err := dialHostile(k.tb, k.socket); err == nil {
				m, _ := o.call(hello)
				k.note(m)
				defer o.close()
			}
		}
	}
	m, err := h.call(hello)
	if err != nil {
		return false
	}
	if _, ok := m.(*protocol.Welcome); !ok {
		k.note(m)
		return false
	}
	k.tally.welcomed.Add(1)
	return true
}

// setup registers the memfd, declares a geometry and registers a cache
// of it, as a client does first; it fails only where the daemon closed
// the connection.
func (k *hostileClient) setup(h *hostileConn) bool {
	m, err := h.call(&protocol.RegisterMemory{Kind: protocol.MemoryMemfd, Size: hostileMemfd}, k.memfd.Fd())
	r, ok := m.(*protocol.MemoryRegistered)
	if !ok {
		k.note(m)
		return err == nil
	}
	h.regions = append(h.regions, r.Region)
	k.tally.regions.Add(1)
	g := k.rng.IntN(3) // acct-a, acct-b or acct-wide
	if k.rng.IntN(4) == 0 {
		g = k.rng.IntN(len(hostileGeos))
	}
	m, err = h.call(&protocol.Declare{Geometry: hostileGeos[g]})
	d, ok := m.(*protocol.Declared)
	if !ok {
		k.note(m)
		return err == nil
	}
	h.ns[g] = d.NS
	return k.registerCache(h, g) == nil
}

// hostileGroups are the groups the hostile clients' caches join and their
// PinLoadables name ("": any connection's caches).
var hostileGroups = []string{"", "engine-a", "engine-b"}

// registerCache registers a cache of hostileGeos[g], which h declared,
// in h's regions.
func (k *hostileClient) registerCache(h *hostileConn, g int) error {
	geo := hostileGeos[g]
	const bb = 4 * 64 * 2 // a block of every geometry's
	layers := make([]protocol.Layer, geo.Layers)
	for i := range layers {
		layers[i] = protocol.Layer{Region: h.regions[k.rng.IntN(len(h.regions))], NumBlocks: hostileBlocks, BlockStride: bb, PlaneStride: hostileBlocks * bb}
	}
	if k.rng.IntN(8) == 0 {
		layers[k.rng.IntN(len(layers))].Region = k.pick(nil) // one the connection does not hold
	}
	m, err := h.call(&protocol.RegisterCache{NS: h.ns[g], Layers: layers})
	if r, ok := m.(*protocol.CacheRegistered); ok {
		h.caches = append(h.caches, hostileCache{id: r.Cache, bpk: geo.BlocksPerKey()})
		k.tally.caches.Add(1)
	}
	k.note(m)
	return err
}

// note counts a refusal by a limit.
func (k *hostileClient) note(m protocol.Message) {
	if e, ok := m.(*protocol.Error); ok && e.Code == protocol.CodeLimit {
		k.tally.limits.Add(1)
	}
}

// pick returns one of ids, or at times an id the connection does not
// hold.
func (k *hostileClient) pick(ids []uint32) uint32 {
	if len(ids) == 0 || k.rng.IntN(8) == 0 {
		return k.rng.Uint32N(1000) + 1 // one the connection does not hold
	}
	return ids[k.rng.IntN(len(ids))]
}

// keys returns n keys: small ones from a space of hostileKeySpace, so
// that loads and pins find some, or random ones.
func (k *hostileClient) keys(n int, small bool) [][]byte {
	keys := make([][]byte, n)
	for i := range keys {
		if small {
			keys[i] = fmt.Appendf(nil, "small-%010d", k.rng.IntN(hostileKeySpace))
		} else {
			keys[i] = fmt.Appendf(nil, "%016x", k.rng.Uint64())
		}
	}
	return keys
}

// transfer returns a store or load on c of n keys.
func (k *hostileClient) transfer(c hostileCache, n int, small bool) *protocol.Transfer {
	m := &protocol.Transfer{Kind: protocol.JobStore, Cache: c.id, Keys: k.keys(n, small), Blocks: make([][]uint32, n)}
	if k.rng.IntN(2) == 0 {
		m.Kind = protocol.JobLoad
	}
	for i := range m.Blocks {
		m.Blocks[i] = make([]uint32, c.bpk)
		for j := range m.Blocks[i] {
			m.Blocks[i][j] = k.rng.Uint32N(hostileBlocks)
		}
	}
	return m
}

// request does one random request on h; it fails only where the daemon
// closed the connection.
func (k *hostileClient) request(h *hostileConn) error {
	var m protocol.Message
	var err error
	switch k.rng.IntN(26) {
	case 0, 1: // register the memfd
		m, err = h.call(&protocol.RegisterMemory{Kind: protocol.MemoryMemfd, Size: hostileMemfd}, k.memfd.Fd())
		if r, ok := m.(*protocol.MemoryRegistered); ok {
			h.regions = append(h.regions, r.Region)
			k.tally.regions.Add(1)
		}
	case 2: // a registration that fails after its descriptor was taken
		reg := &protocol.RegisterMemory{Kind: protocol.MemoryMemfd, Size: hostileMemfd}
		var fds []int
		switch k.rng.IntN(7) {
		case 0:
			fds = []int{k.unsealed}
		case 1:
			reg.Size = 2 * hostileMemfd
			fds = []int{k.memfd.Fd()}
		case 2:
			fds = []int{k.pipe[0]}
		case 3: // none
		case 4:
			fds = []int{k.memfd.Fd(), k.pipe[1]}
		case 5:
			reg.Kind = protocol.MemoryShared
			fds = []int{k.memfd.Fd()}
		case 6:
			reg.Kind = protocol.MemoryCUDAIPC
			fds = []int{k.memfd.Fd()}
		}
		m, err = h.call(reg, fds...)
		if r, ok := m.(*protocol.MemoryRegistered); ok {
			h.regions = append(h.regions, r.Region)
		}
	case 3: // unregister memory
		id := k.pick(h.regions)
		m, err = h.call(&protocol.UnregisterMemory{Region: id})
		if _, ok := m.(*protocol.Empty); ok {
			h.regions = remove(h.regions, id)
		}
	case 4, 5: // declare
		g := k.rng.IntN(len(hostileGeos))
		m, err = h.call(&protocol.Declare{Geometry: hostileGeos[g]})
		if d, ok := m.(*protocol.Declared); ok {
			h.ns[g] = d.NS
		}
	case 6: // undeclare, at times twice
		g := k.rng.IntN(len(hostileGeos))
		id, ok := h.ns[g]
		if !ok {
			id = k.rng.Uint32N(1000) + 1
		}
		m, err = h.call(&protocol.Undeclare{NS: id})
		if _, done := m.(*protocol.Empty); done {
			delete(h.ns, g)
			if k.rng.IntN(2) == 0 {
				m, err = h.call(&protocol.Undeclare{NS: id})
			}
		}
	case 7, 8: // register a cache, at times joining a group first (refused once the connection has caches)
		g := k.rng.IntN(len(hostileGeos))
		if _, ok := h.ns[g]; !ok || len(h.regions) == 0 {
			break
		}
		if k.rng.IntN(3) == 0 {
			if m, err = h.call(&protocol.Group{Name: hostileGroups[1+k.rng.IntN(len(hostileGroups)-1)]}); err != nil {
				break
			}
		}
		err = k.registerCache(h, g)
	case 9: // unregister a cache
		if len(h.caches) == 0 {
			break
		}
		i := k.rng.IntN(len(h.caches))
		m, err = h.call(&protocol.UnregisterCache{Cache: h.caches[i].id})
		if _, ok := m.(*protocol.Empty); ok {
			h.caches = append(h.caches[:i], h.caches[i+1:]...)
		}
	case 10, 11, 12, 20, 21, 22, 23: // a store or load, small or of the most keys; at times cancelled
		if len(h.caches) == 0 {
			break
		}
		c := h.caches[k.rng.IntN(len(h.caches))]
		n := 1 + k.rng.IntN(8)
		if k.rng.IntN(4) == 0 {
			n = protocol.MaxKeysPerRequest
		}
		m, err = h.call(k.transfer(c, n, n < 16))
		if a, ok := m.(*protocol.JobAccepted); ok {
			k.tally.jobs.Add(1)
			if k.rng.IntN(3) == 0 {
				m, err = h.call(&protocol.Cancel{Job: a.Job})
			}
		}
	case 13: // lookup or delete
		g := k.rng.IntN(len(hostileGeos))
		id, ok := h.ns[g]
		if !ok {
			id = k.rng.Uint32N(1000) + 1
		}
		n := 1 + k.rng.IntN(16)
		if k.rng.IntN(4) == 0 {
			n = protocol.MaxKeysPerRequest
		}
		if k.rng.IntN(4) == 0 {
			m, err = h.call(&protocol.Delete{NS: id, Keys: k.keys(n, true)})
		} else {
			m, err = h.call(&protocol.Lookup{NS: id, Keys: k.keys(n, n < 16)})
		}
	case 14, 15, 24, 25: // pin, with or without a lease
		g := k.rng.IntN(len(hostileGeos))
		id, ok := h.ns[g]
		if !ok {
			break
		}
		n := 1 + k.rng.IntN(16)
		if k.rng.IntN(4) == 0 {
			n = protocol.MaxKeysPerRequest - k.rng.IntN(64)
		}
		leases := []uint32{0, 0, 1, 20, 3600_000}
		pin := &protocol.Pin{NS: id, LeaseMillis: leases[k.rng.IntN(len(leases))], Keys: k.keys(n, true)}
		if k.rng.IntN(3) == 0 { // only where a cache of a group is registered
			pin.Loadable, pin.Group = true, hostileGroups[k.rng.IntN(len(hostileGroups))]
		}
		m, err = h.call(pin)
		if p, ok := m.(*protocol.Pinned); ok && p.Pin != 0 {
			h.pins = append(h.pins, p.Pin)
			k.tally.pins.Add(1)
		}
	case 16: // unpin
		if len(h.pins) == 0 {
			break
		}
		i := k.rng.IntN(len(h.pins))
		m, err = h.call(&protocol.Unpin{Pin: h.pins[i]})
		h.pins = append(h.pins[:i], h.pins[i+1:]...)
	case 17: // stats, with descriptors that nothing claims
		m, err = h.call(&protocol.StatsRequest{}, k.memfd.Fd(), k.pipe[0])
	case 18: // a malformed body, small or of max_frame, at times with a descriptor
		n := k.rng.IntN(64)
		if k.rng.IntN(3) == 0 {
			n = server.UncountedBody + k.rng.IntN(hostileMaxFrame-protocol.HeaderSize-server.UncountedBody)
		}
		types := []protocol.Type{protocol.TypeRegisterMemory, protocol.TypeDeclare, protocol.TypeRegisterCache, protocol.TypeStore,
			protocol.TypeLoad, protocol.TypeLookup, protocol.TypePin, protocol.TypeUnpin, protocol.Type(0x7777), protocol.TypeHello}
		body := make([]byte, n)
		for i := range body {
			body[i] = byte(k.rng.Uint32())
		}
		id, ch := h.reserve()
		t := types[k.rng.IntN(len(types))]
		var fds []int
		if k.rng.IntN(2) == 0 {
			fds = []int{k.memfd.Fd()}
		}
		m, err = h.await(ch, t, h.write(rawFrame(id, t, body), fds...))
	case 19: // cancel a job of none
		m, err = h.call(&protocol.Cancel{Job: k.rng.Uint64()})
	}
	k.note(m)
	return err
}

// rawFrame returns a frame of type t, request id id and body.
func rawFrame(id uint64, t protocol.Type, body []byte) []byte {
	b := make([]byte, protocol.HeaderSize, protocol.HeaderSize+len(body))
	binary.LittleEndian.PutUint32(b[0:], uint32(len(body)))
	binary.LittleEndian.PutUint16(b[4:], uint16(t))
	binary.LittleEndian.PutUint64(b[8:], id)
	return append(b, body...)
}

func remove(ids []uint32, id uint32) []uint32 {
	for i, v := range ids {
		if v == id {
			return append(ids[:i], ids[i+1:]...)
		}
	}
	return ids
}

// end ends the connection one of many ways; the caller closes it.
func (k *hostileClient) end(h *hostileConn) {
	big := func() []byte {
		b, _ := h.frame(&protocol.Lookup{NS: 1, Keys: k.keys(protocol.MaxKeysPerRequest, false)})
		return b
	}
	switch k.rng.IntN(10) {
	case 0: // jobs and a registration in flight
		for _, c := range h.caches {
			h.post(k.transfer(c, 1+k.rng.IntN(protocol.MaxKeysPerRequest), false))
		}
		h.post(&protocol.RegisterMemory{Kind: protocol.MemoryMemfd, Size: hostileMemfd}, k.memfd.Fd())
	case 1: // in the middle of a header
		b, _ := h.frame(&protocol.StatsRequest{})
		h.write(b[:7])
	case 2: // in the middle of a counted body, with a descriptor
		b := big()
		h.write(b[:protocol.HeaderSize+1000], k.memfd.Fd())
	case 3: // stalled in the middle of a counted body until the daemon's limit
		b := big()
		if h.write(b[:protocol.HeaderSize+1000], k.memfd.Fd()) == nil {
			h.gone("a frame stalled in its middle")
		}
	case 4: // a header past max_frame
		var hdr [protocol.HeaderSize]byte
		binary.LittleEndian.PutUint32(hdr[0:], hostileMaxFrame)
		binary.LittleEndian.PutUint16(hdr[4:], uint16(protocol.TypeLookup))
		if h.write(hdr[:]) == nil {
			h.gone("a header past max_frame")
		}
	case 5: // more descriptors in one message than the daemon takes
		b, _ := h.frame(&protocol.StatsRequest{})
		fds := make([]int, 12)
		for i := range fds {
			fds[i] = k.memfd.Fd()
		}
		if h.write(b, fds...) == nil {
			h.gone("a message of 12 descriptors")
		}
	case 6: // half closed: the daemon answers what it read, then closes
		h.post(&protocol.StatsRequest{}, k.pipe[1])
		h.c.CloseWrite()
		h.gone("a half-closed connection")
	}
}

// hostileSocketEnv names the socket TestHelperHostileClients connects
// to; hostileSeedEnv seeds its clients.
const (
	hostileSocketEnv = "KVHOST_TEST_HOSTILE_SOCKET"
	hostileSeedEnv   = "KVHOST_TEST_HOSTILE_SEED"
	hostileReport    = "HOSTILE: "
)

// TestHelperHostileClients is not a test: run by
// TestHostileClientsLeaveNothingCounted in a process of its own, it runs
// hostile clients against the socket in $KVHOST_TEST_HOSTILE_SOCKET,
// saying on stdout after each request that it made one.
func TestHelperHostileClients(t *testing.T) {
	socket := os.Getenv(hostileSocketEnv)
	if socket == "" {
		t.Skip("run by TestHostileClientsLeaveNothingCounted")
	}
	seed, err := strconv.ParseUint(os.Getenv(hostileSeedEnv), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	var tally hostileTally
	var out sync.Mutex
	var wg sync.WaitGroup
	for w := range 4 {
		k := newHostileClient(t, socket, seed*100+uint64(w), &tally)
		k.observe = func() {
			out.Lock()
			fmt.Println(hostileReport + "request")
			out.Unlock()
		}
		wg.Go(func() { k.run(6, 60) })
	}
	wg.Wait()
	fmt.Println(hostileReport + "done: " + tally.String())
}

// hostileProcess runs TestHelperHostileClients against socket with seed;
// with kill, it kills the process (SIGKILL) once it has made kill
// requests.
type hostileProcess struct {
	cmd    *exec.Cmd
	report chan string // its last line
}

func startHostileProcess(t *testing.T, socket string, seed uint64, kill int) *hostileProcess {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperHostileClients$", "-test.count=1")
	cmd.Env = append(os.Environ(), hostileSocketEnv+"="+socket, hostileSeedEnv+"="+strconv.FormatUint(seed, 10))
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &hostileProcess{cmd: cmd, report: make(chan string, 1)}
	go func() {
		last, requests := "", 0
		for sc := bufio.NewScanner(stdout); sc.Scan(); {
			line, ok := strings.CutPrefix(sc.Text(), hostileReport)
			if !ok {
				continue
			}
			if kill > 0 && requests == kill {
				continue // killed
			}
			last = line
			if requests++; kill > 0 && requests == kill {
				cmd.Process.Kill()
				last = fmt.Sprintf("killed after %d requests", kill)
			}
		}
		p.report <- last
	}()
	return p
}

// wait waits for the process and returns its last report and its
// error, if it was not killed.
func (p *hostileProcess) wait() (string, error) {
	report := <-p.report
	err := p.cmd.Wait()
	if strings.HasPrefix(report, "killed") {
		err = nil
	}
	return report, err
}

// stallAndShutdown shuts the daemon down while a frame of this process
// waits for room behind two of max_frame stalled in the middle of their
// bodies (server.max_incoming_bytes_per_peer is two frames), each sent
// with a descriptor, and while the hostile clients run.
func stallAndShutdown(t *testing.T, f *fixture) {
	t.Helper()
	frame := rawFrame(2, protocol.TypeLookup, make([]byte, hostileMaxFrame-protocol.HeaderSize))
	deadline := time.Now().Add(hostileReplyWait)
	var stalled []*hostileConn
	for len(stalled) < 3 {
		h, err := dialHostile(t, f.socket)
		if err != nil {
			t.Fatal(err)
		}
		defer h.close()
		m, err := h.call(&protocol.Hello{Version: protocol.Version, Client: "stalled"})
		if err != nil && time.Now().After(deadline) {
			t.Fatalf("hello: %v", err)
		}
		if e, ok := m.(*protocol.Error); ok && time.Now().After(deadline) {
			t.Fatalf("hello: %v", e)
		}
		if _, ok := m.(*protocol.Welcome); !ok {
			continue // refused while the hostile clients hold the process's connections
		}
		if err := h.write(frame[:protocol.HeaderSize+1000], int(os.Stdin.Fd())); err != nil {
			t.Fatal(err)
		}
		stalled = append(stalled, h)
	}
	// Until a frame waits, or one stalled frame reached its limit (then
	// the one behind it no longer waits).
	cut := func() bool {
		for _, h := range stalled {
			select {
			case <-h.dead:
				return true
			default:
			}
		}
		return false
	}
	var waiting int64
	testwait.Until(t, "a frame waiting for room behind two stalled ones, or one of them cut off", time.Until(deadline), func() bool {
		waiting = f.srv.Stats().IncomingWaiting
		return waiting > 0 || cut()
	})
	f.srv.Shutdown()
	t.Logf("shut down with %d frames waiting for room", waiting)
}

// checkNothingHeld fails t for every charge srv still counts, in all and
// in each of records (peers gone included), and for every namespace the
// engine was not told to release.
func checkNothingHeld(t *testing.T, when string, f *fixture, flaky *flakyEngine, records map[server.PeerRecord]bool) {
	t.Helper()
	st := f.srv.Stats()
	for _, c := range []struct {
		what string
		n    int64
	}{
		{"clients", int64(st.Clients)}, {"handshakes", int64(st.Handshakes)}, {"jobs in flight", int64(st.InflightJobs)},
		{"bytes of jobs in flight", st.InflightBytes}, {"descriptors", st.Descriptors}, {"pinned keys", st.PinnedKeys},
		{"cache layers", st.CacheLayers}, {"bytes of frames read", st.IncomingBytes}, {"frames waiting for room", st.IncomingWaiting},
		{"regions", st.Regions}, {"registered bytes", st.RegisteredBytes},
	} {
		if c.n != 0 {
			t.Errorf("%s the daemon counts %d %s, want 0", when, c.n, c.what)
		}
	}
	if a := f.srv.Accounts(); a != (server.Accounts{}) {
		t.Errorf("%s the daemon holds %+v, want nothing", when, a)
	}
	for r := range records {
		if a := f.srv.PeerAccount(r); a != (server.PeerAccount{PID: a.PID}) {
			t.Errorf("%s the record of process %d counts %+v, want nothing", when, a.PID, a)
		}
	}
	if pins, keys := f.eng.PinStats(); pins != 0 || keys != 0 {
		t.Errorf("%s the engine holds %d pins of %d keys, want none", when, pins, keys)
	}
	if n := flaky.unreleased(); n != 0 {
		t.Errorf("%s %d namespaces were declared in the engine and never released", when, n)
	}
}

// TestHostileClientsLeaveNothingCounted: clients in this process and in
// three others (one killed in the middle) make every kind of request,
// with descriptors, malformed frames, frames of max_frame, cancels, pins
// with and without leases, against an engine that fails a share of its
// calls and of its file I/O, and end their connections in every way:
// closed at once, in the middle of a header or of a counted body (with a
// descriptor), stalled until the frame limit, with jobs and a
// registration in flight, with a header past max_frame, with too many
// descriptors. Every bound refuses some of them. Once every connection
// has ended, the daemon counts nothing held, in all and in every peer's
// record (those of gone processes included), its per-peer map is empty,
// and the engine holds no pin and was told to release every namespace.
// A second round is cut off by a shutdown with everything in flight, and
// leaves nothing counted either.
func TestHostileClientsLeaveNothingCounted(t *testing.T) {
	f, flaky := hostileFixture(t)
	records := map[server.PeerRecord]bool{}
	var rmu sync.Mutex
	observe := func() {
		rs := f.srv.PeerRecords()
		rmu.Lock()
		for _, r := range rs {
			records[r] = true
		}
		rmu.Unlock()
	}
	round := func(seed uint64, shutdown bool) *hostileTally {
		var tally hostileTally
		procs := []*hostileProcess{
			startHostileProcess(t, f.socket, seed+1, 0),
			startHostileProcess(t, f.socket, seed+2, 0),
			startHostileProcess(t, f.socket, seed+3, 40),
		}
		var wg sync.WaitGroup
		var requests atomic.Int64
		busy := make(chan struct{}) // closed once this process made 300 requests
		var once sync.Once
		for w := range 8 {
			k := newHostileClient(t, f.socket, seed*100+uint64(w), &tally)
			k.observe = func() {
				observe()
				if requests.Add(1) == 300 {
					once.Do(func() { close(busy) })
				}
			}
			wg.Go(func() { k.run(8, 80) })
		}
		workers := make(chan struct{})
		go func() {
			wg.Wait()
			close(workers)
		}()
		if shutdown {
			select {
			case <-busy:
			case <-workers:
			}
			stallAndShutdown(t, f)
		}
		<-workers
		for i, p := range procs {
			report, err := p.wait()
			if err != nil {
				t.Errorf("hostile process %d: %v (%s)", i, err, report)
			}
			t.Logf("hostile process %d: %s", i, report)
		}
		ctx, cancel := context.WithTimeout(context.Background(), hostileReplyWait)
		defer cancel()
		if err := f.srv.WaitSessions(ctx, 0); err != nil {
			t.Fatal(err)
		}
		return &tally
	}
	tally := round(1, false)
	st := f.srv.Stats()
	t.Logf("this process: %s; refused by %v; %d frames waited for room", tally, st.Refusals, st.IncomingWaits)
	checkNothingHeld(t, "once every connection ended,", f, flaky, records)
	if tally.jobs.Load() == 0 || tally.caches.Load() == 0 || tally.pins.Load() == 0 || tally.limits.Load() == 0 {
		t.Errorf("the hostile clients did too little to check anything: %s", tally)
	}

	tally = round(2, true)
	t.Logf("cut off by a shutdown: %s", tally)
	checkNothingHeld(t, "after a shutdown,", f, flaky, records)
}
