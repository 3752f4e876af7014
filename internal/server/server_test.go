package server_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/internal/daemon/hostpath"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/internal/testsock"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/internal/testwasm"
	"github.com/kvhost/kvhost/plugins"
	"github.com/kvhost/kvhost/plugins/lru"
	"github.com/kvhost/kvhost/protocol"
	"golang.org/x/sys/unix"
)

var geo = client.Geometry{Model: "m", Layers: 2, KVHeads: 1, HeadSize: 64, DtypeSize: 2, TokensPerBlock: 4, TokensPerKey: 8, TPSize: 1}

const numBlocks = 32

// fixture is an in-process daemon: a real engine on a temp dir and a
// server on a real socket.
type fixture struct {
	eng    *engine.Engine
	srv    *server.Server
	socket string
	dir    string
	cancel context.CancelFunc
	served chan error
}

// benchPolicyCache is the benchmarks' compilation cache of the wasm lru
// policy, in memory: a benchmark function runs several times (b.N
// growing), and compiles the policy only the first time in the process,
// leaving nothing on disk.
var benchPolicyCache = sync.OnceValue(testwasm.Cache)

// openEngineWith opens a real engine on dir, as the daemon configures it,
// with the configuration edited by edit (if not nil).
func openEngineWith(tb testing.TB, dir string, edit func(*engine.Config)) *engine.Engine {
	tb.Helper()
	cfg := engine.Config{
		Host:   hostpath.Staging,
		Mounts: []engine.Mount{{Path: dir, Capacity: 1 << 30}},
		NewPolicy: func(idx policy.Index) (policy.Policy, error) {
			if _, bench := tb.(*testing.B); bench {
				// Benchmarks run the policy as the daemon does: the
				// embedded wasm lru with the default shards.
				mod, err := plugins.Wasm("lru")
				if err != nil {
					return nil, err
				}
				d := config.Default().Policy
				return policy.Open(context.Background(), mod, "lru", idx, policy.Config{
					Shards: d.Shards, CallTimeout: time.Duration(d.CallTimeout), Cache: benchPolicyCache(), Logger: quiet()})
			}
			return policy.NewNative(func() guest.Policy { return lru.New() }, idx, policy.Config{Shards: 1, Logger: quiet()})
		},
		Logger: quiet(),
		// As the daemon runs it (config.Default).
		VerifyInterval: time.Duration(config.Default().Engine.VerifyInterval),
	}
	if edit != nil {
		edit(&cfg)
	}
	eng, err := engine.Open(context.Background(), cfg)
	if err != nil {
		tb.Fatal(err)
	}
	return eng
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func newFixture(tb testing.TB, cfg server.Config) *fixture {
	tb.Helper()
	return newFixtureWith(tb, cfg, nil, nil)
}

// newFixtureWith is newFixture with the engine's configuration edited by
// edit and the engine the server sees wrapped by wrap (each if not nil).
func newFixtureWith(tb testing.TB, cfg server.Config, edit func(*engine.Config), wrap func(*engine.Engine) server.Engine) *fixture {
	tb.Helper()
	base := testsock.Dir(tb)
	f := &fixture{dir: filepath.Join(base, "cache"), socket: filepath.Join(base, "s.sock"), served: make(chan error, 1)}
	f.eng = openEngineWith(tb, f.dir, edit)
	cfg.Logger = quiet()
	var eng server.Engine = f.eng
	if wrap != nil {
		eng = wrap(f.eng)
	}
	srv, err := server.New(eng, cfg)
	if err != nil {
		tb.Fatal(err)
	}
	f.srv = srv
	sock, err := server.Listen(f.socket, 0o600, "")
	if err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	f.cancel = cancel
	go func() { f.served <- srv.Serve(ctx, sock.UnixListener); sock.Close() }()
	tb.Cleanup(func() {
		f.stop(tb)
	})
	return f
}

func (f *fixture) stop(tb testing.TB) {
	if f.cancel == nil {
		return
	}
	f.cancel()
	f.cancel = nil
	if err := <-f.served; err != nil {
		tb.Error(err)
	}
	if err := f.eng.Close(context.Background()); err != nil {
		tb.Error(err)
	}
}

func (f *fixture) dial(tb testing.TB) *client.Client {
	tb.Helper()
	c, err := client.Dial(context.Background(), f.socket, tb.Name())
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { c.Close() })
	return c
}

// cache registers a memfd cache on c.
type cache struct {
	c     *client.Client
	mem   interface{ Bytes() []byte }
	ns    client.Namespace
	id    client.CacheID
	bb    int64
	close func() error
}

func newCache(tb testing.TB, c *client.Client) *cache {
	tb.Helper()
	mem, rid := registerMemfd(tb, c, "t", int64(geo.Layers)*2*numBlocks*geo.BlockBytes())
	return newCacheIn(tb, c, mem, rid)
}

func newCacheOn(tb testing.TB, c *client.Client, mem *client.Memfd) *cache {
	tb.Helper()
	rid, err := c.RegisterMemfd(context.Background(), mem)
	if err != nil {
		tb.Fatal(err)
	}
	return newCacheIn(tb, c, mem, rid)
}

// newCacheIn registers a cache in region rid, which maps mem.
func newCacheIn(tb testing.TB, c *client.Client, mem interface {
	Bytes() []byte
	Close() error
}, rid client.RegionID) *cache {
	tb.Helper()
	bb := geo.BlockBytes()
	ns, id, err := registerCache(tb, c, geo, planesFirst(rid, numBlocks, bb))
	if err != nil {
		tb.Fatal(err)
	}
	return &cache{c: c, mem: mem, ns: ns, id: id, bb: bb, close: mem.Close}
}

// registerMemfd makes a memfd of size bytes, closed when tb ends, and
// registers it on c.
func registerMemfd(tb testing.TB, c *client.Client, name string, size int64) (*client.Memfd, client.RegionID) {
	tb.Helper()
	mem, err := client.NewMemfd(name, size)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { mem.Close() })
	rid, err := c.RegisterMemfd(context.Background(), mem)
	if err != nil {
		tb.Fatal(err)
	}
	return mem, rid
}

// planesFirst lays out layers of blocks blocks of bb bytes in region rid,
// one after another, each its K plane then its V plane: it returns layer
// l's place.
func planesFirst(rid client.RegionID, blocks uint32, bb int64) func(l int) client.Layer {
	return func(l int) client.Layer {
		return client.Layer{Region: uint32(rid), NumBlocks: blocks, Offset: int64(l) * 2 * int64(blocks) * bb, BlockStride: bb, PlaneStride: int64(blocks) * bb}
	}
}

// registerCache declares g on c and registers a cache of g whose layer l
// is at layer(l); it returns g's namespace and the cache's id, or the
// error RegisterCache returned.
func registerCache(tb testing.TB, c *client.Client, g client.Geometry, layer func(l int) client.Layer) (client.Namespace, client.CacheID, error) {
	tb.Helper()
	ctx := context.Background()
	ns, err := c.Declare(ctx, g)
	if err != nil {
		tb.Fatal(err)
	}
	layers := make([]client.Layer, g.Layers)
	for l := range layers {
		layers[l] = layer(l)
	}
	id, err := c.RegisterCache(ctx, ns.ID, layers)
	return ns, id, err
}

// blockBytes returns (and with fill, first randomizes) the bytes of blocks.
func (k *cache) bytesOf(blocks []uint32, rng *rand.Rand) []byte {
	mem := k.mem.Bytes()
	var out []byte
	for l := 0; l < int(geo.Layers); l++ {
		for p := 0; p < 2; p++ {
			for _, b := range blocks {
				off := int64(l)*2*numBlocks*k.bb + int64(p)*numBlocks*k.bb + int64(b)*k.bb
				s := mem[off : off+k.bb]
				if rng != nil {
					for i := range s {
						s[i] = byte(rng.Uint32())
					}
				}
				out = append(out, s...)
			}
		}
	}
	return out
}

func (k *cache) store(tb testing.TB, key string, blocks []uint32, rng *rand.Rand) []byte {
	tb.Helper()
	want := k.bytesOf(blocks, rng)
	job, err := k.c.Store(context.Background(), k.id, [][]byte{[]byte(key)}, [][]uint32{blocks})
	if err != nil {
		tb.Fatal(err)
	}
	res, err := job.Wait(context.Background())
	if err != nil || res.Keys[0].Outcome != client.OutcomeStored {
		tb.Fatalf("store %s: %v %v %s", key, err, res.Keys, res.Message)
	}
	return want
}

func (k *cache) load(tb testing.TB, key string, blocks []uint32) []byte {
	tb.Helper()
	for _, b := range k.bytesOfSegs(blocks) {
		clear(b)
	}
	job, err := k.c.Load(context.Background(), k.id, [][]byte{[]byte(key)}, [][]uint32{blocks})
	if err != nil {
		tb.Fatal(err)
	}
	res, err := job.Wait(context.Background())
	if err != nil {
		tb.Fatal(err)
	}
	if res.Keys[0].Outcome != client.OutcomeLoaded {
		return nil
	}
	return k.bytesOf(blocks, nil)
}

func (k *cache) bytesOfSegs(blocks []uint32) [][]byte {
	mem := k.mem.Bytes()
	var out [][]byte
	for l := 0; l < int(geo.Layers); l++ {
		for p := 0; p < 2; p++ {
			for _, b := range blocks {
				off := int64(l)*2*numBlocks*k.bb + int64(p)*numBlocks*k.bb + int64(b)*k.bb
				out = append(out, mem[off:off+k.bb])
			}
		}
	}
	return out
}

func TestStoreLoad(t *testing.T) {
	f := newFixture(t, server.Config{})
	c := f.dial(t)
	k := newCache(t, c)
	rng := rand.New(rand.NewPCG(1, 2))
	want := k.store(t, "key", []uint32{0, 1}, rng)
	if got := k.load(t, "key", []uint32{5, 9}); !bytes.Equal(got, want) {
		t.Fatal("loaded bytes differ")
	}
	if n, err := c.Lookup(context.Background(), k.ns.ID, [][]byte{[]byte("key"), []byte("other")}); err != nil || n != 1 {
		t.Fatalf("lookup %d %v", n, err)
	}
	st, err := c.Stats(context.Background())
	if err != nil || st.Regions != 1 || st.Caches != 1 || st.Clients != 1 || st.Keys != 1 {
		t.Fatalf("stats %+v %v", st, err)
	}
}

// rawConn is a connection that speaks frames by hand.
type rawConn struct {
	tb testing.TB
	c  *net.UnixConn
}

func (f *fixture) raw(tb testing.TB) *rawConn {
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: f.socket, Net: "unix"})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { c.Close() })
	return &rawConn{tb: tb, c: c}
}

func (r *rawConn) send(id uint64, m protocol.Message, fds ...int) {
	r.tb.Helper()
	b := protocol.AppendFrame(nil, id, m)
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	if _, _, err := r.c.WriteMsgUnix(b, oob, nil); err != nil {
		r.tb.Fatal(err)
	}
}

func (r *rawConn) recv() (protocol.Header, protocol.Message, error) {
	r.c.SetReadDeadline(time.Now().Add(10 * time.Second))
	var hdr [protocol.HeaderSize]byte
	if _, err := io.ReadFull(r.c, hdr[:]); err != nil {
		return protocol.Header{}, nil, err
	}
	h, err := protocol.ParseHeader(hdr[:], 1<<30)
	if err != nil {
		return h, nil, err
	}
	body := make([]byte, h.Len)
	if _, err := io.ReadFull(r.c, body); err != nil {
		return h, nil, err
	}
	m, err := protocol.Decode(h.Type, body)
	return h, m, err
}

func (r *rawConn) expectCode(code protocol.Code) {
	r.tb.Helper()
	_, m, err := r.recv()
	if err != nil {
		r.tb.Fatal(err)
	}
	e, ok := m.(*protocol.Error)
	if !ok || e.Code != code {
		r.tb.Fatalf("got %#v, want error %s", m, code)
	}
}

func (r *rawConn) expectClosed() {
	r.tb.Helper()
	if _, _, err := r.recv(); !errors.Is(err, io.EOF) {
		r.tb.Fatalf("connection not closed: %v", err)
	}
}

func TestHandshake(t *testing.T) {
	f := newFixture(t, server.Config{})
	t.Run("request before hello", func(t *testing.T) {
		r := f.raw(t)
		r.send(1, &protocol.StatsRequest{})
		r.expectCode(protocol.CodeHandshake)
		r.expectClosed()
	})
	t.Run("version", func(t *testing.T) {
		r := f.raw(t)
		r.send(1, &protocol.Hello{Version: 99})
		r.expectCode(protocol.CodeVersion)
		r.expectClosed()
	})
	t.Run("oversized frame", func(t *testing.T) {
		r := f.raw(t)
		r.send(1, &protocol.Hello{Version: protocol.Version})
		if _, m, err := r.recv(); err != nil || m.Type() != protocol.TypeHello|protocol.TypeReply {
			t.Fatalf("welcome: %v %v", m, err)
		}
		hdr := make([]byte, protocol.HeaderSize)
		hdr[0], hdr[1], hdr[2], hdr[3] = 0xff, 0xff, 0xff, 0x7f
		hdr[4] = byte(protocol.TypeLookup)
		r.c.Write(hdr)
		r.expectCode(protocol.CodeMalformed)
		r.expectClosed()
	})
	t.Run("malformed body keeps the session", func(t *testing.T) {
		r := f.raw(t)
		r.send(1, &protocol.Hello{Version: protocol.Version})
		r.recv()
		r.send(2, &protocol.Lookup{NS: 1}) // no keys
		r.expectCode(protocol.CodeMalformed)
		r.send(3, &protocol.Count{T: protocol.TypeLookup | protocol.TypeReply})
		r.expectCode(protocol.CodeUnknownType)
		r.send(4, &protocol.StatsRequest{})
		if _, m, err := r.recv(); err != nil || m.Type() != protocol.TypeStats|protocol.TypeReply {
			t.Fatalf("stats after errors: %v %v", m, err)
		}
	})
}

func TestMemfdChecks(t *testing.T) {
	f := newFixture(t, server.Config{MaxRegistrations: 2})
	r := f.raw(t)
	r.send(1, &protocol.Hello{Version: protocol.Version})
	r.recv()
	reg := &protocol.RegisterMemory{Kind: protocol.MemoryMemfd, Size: 4096}
	r.send(2, reg)
	r.expectCode(protocol.CodeNoFd)

	unsealed, _ := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC)
	unix.Ftruncate(unsealed, 4096)
	defer unix.Close(unsealed)
	r.send(3, reg, unsealed)
	r.expectCode(protocol.CodeBadFd)

	small, err := client.NewMemfd("small", 1024)
	if err != nil {
		t.Fatal(err)
	}
	defer small.Close()
	r.send(4, reg, small.Fd())
	r.expectCode(protocol.CodeBadFd)

	pipe := make([]int, 2)
	unix.Pipe(pipe)
	defer unix.Close(pipe[0])
	defer unix.Close(pipe[1])
	r.send(5, reg, pipe[0])
	r.expectCode(protocol.CodeBadFd)

	good, err := client.NewMemfd("good", 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer good.Close()
	for i := 0; i < 2; i++ {
		r.send(uint64(6+i), reg, good.Fd())
		if _, m, err := r.recv(); err != nil || m.Type() != protocol.TypeRegisterMemory|protocol.TypeReply {
			t.Fatalf("register: %#v %v", m, err)
		}
	}
	r.send(9, reg, good.Fd())
	r.expectCode(protocol.CodeLimit)
}

func TestRegisterCacheBounds(t *testing.T) {
	f := newFixture(t, server.Config{})
	c := f.dial(t)
	ctx := context.Background()
	half := 2 * 8 * geo.BlockBytes() // one layer of 8 blocks
	mem, err := client.NewMemfd("t", 2*half)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	rid, err := c.RegisterMemfd(ctx, mem)
	if err != nil {
		t.Fatal(err)
	}
	ns, err := c.Declare(ctx, geo)
	if err != nil {
		t.Fatal(err)
	}
	bb := geo.BlockBytes()
	r := uint32(rid)
	first := client.Layer{Region: r, NumBlocks: 8, BlockStride: bb, PlaneStride: 8 * bb} // bytes [0, half)
	cases := []struct {
		name string
		l    client.Layer
		code protocol.Code
	}{
		{"past the end", client.Layer{Region: r, NumBlocks: 9, Offset: half, BlockStride: bb, PlaneStride: 8 * bb}, protocol.CodeInvalid},
		{"huge stride", client.Layer{Region: r, NumBlocks: 3, Offset: half, BlockStride: 1 << 62, PlaneStride: bb}, protocol.CodeInvalid},
		{"huge plane stride", client.Layer{Region: r, NumBlocks: 1, Offset: half, BlockStride: bb, PlaneStride: 1 << 62}, protocol.CodeInvalid},
		{"offset", client.Layer{Region: r, NumBlocks: 1, Offset: 2*half - 96, BlockStride: bb, PlaneStride: bb}, protocol.CodeInvalid},
		{"zero blocks", client.Layer{Region: r, NumBlocks: 0, Offset: half, BlockStride: bb, PlaneStride: 8 * bb}, protocol.CodeInvalid},
		{"unknown region", client.Layer{Region: 77, NumBlocks: 1, BlockStride: bb, PlaneStride: bb}, protocol.CodeUnknownRegion},
		{"fits exactly", client.Layer{Region: r, NumBlocks: 8, Offset: half, BlockStride: bb, PlaneStride: 8 * bb}, protocol.CodeOK},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := c.RegisterCache(ctx, ns.ID, []client.Layer{first, tc.l})
			if tc.code == protocol.CodeOK {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if !errors.Is(err, &protocol.Error{Code: tc.code}) {
				t.Fatalf("got %v, want %s", err, tc.code)
			}
		})
	}
}

func TestInflightLimit(t *testing.T) {
	f := newFixture(t, server.Config{MaxInflightJobs: 1})
	c := f.dial(t)
	k := newCache(t, c)
	ctx := context.Background()
	var jobs []*client.Job
	limited := false
	for i := 0; i < 200 && !limited; i++ {
		j, err := c.Store(ctx, k.id, [][]byte{{byte(i), 1}}, [][]uint32{{0, 1}})
		switch {
		case errors.Is(err, &protocol.Error{Code: protocol.CodeLimit}):
			limited = true
		case err != nil:
			t.Fatal(err)
		default:
			jobs = append(jobs, j)
		}
	}
	for _, j := range jobs {
		if _, err := j.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if !limited {
		t.Log("every store completed before the next was sent: limit not reached")
	}
	// With every job complete, the cache can go.
	if err := c.UnregisterCache(ctx, k.id); err != nil {
		t.Fatal(err)
	}
}

// TestDisconnectMidJob closes clients while their jobs run, many times:
// jobs end before regions are unmapped (a fault would crash the test
// binary), and nothing half-written is visible.
func TestDisconnectMidJob(t *testing.T) {
	f := newFixture(t, server.Config{})
	rounds := 20
	if testing.Short() {
		rounds = 5
	}
	for i := 0; i < rounds; i++ {
		c, err := client.Dial(context.Background(), f.socket, "victim")
		if err != nil {
			t.Fatal(err)
		}
		k := newCache(t, c)
		var keys [][]byte
		var blocks [][]uint32
		for j := 0; j < 16; j++ {
			keys = append(keys, []byte{byte(i), byte(j)})
			blocks = append(blocks, []uint32{uint32(2 * j), uint32(2*j + 1)})
		}
		for n := 0; n < 4; n++ {
			if _, err := c.Store(context.Background(), k.id, keys, blocks); err != nil {
				t.Fatal(err)
			}
		}
		c.Close()
		k.close() // unmapped on the client side too: the daemon has its own mapping
	}
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Hang)
	defer cancel()
	if err := f.srv.WaitSessions(ctx, 0); err != nil {
		t.Fatalf("sessions of departed clients not released: %v", err)
	}
	// And the daemon still serves.
	if _, err := f.dial(t).Stats(ctx); err != nil {
		t.Fatal(err)
	}
}

func countFds(t *testing.T) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// TestNoLeaks connects, registers, runs jobs and disconnects many clients,
// and checks that the daemon's goroutines and descriptors come back to
// where they were.
func TestNoLeaks(t *testing.T) {
	f := newFixture(t, server.Config{})
	cycle := func() {
		c, err := client.Dial(context.Background(), f.socket, "leak")
		if err != nil {
			t.Fatal(err)
		}
		mem, err := client.NewMemfd("leak", int64(geo.Layers)*2*numBlocks*geo.BlockBytes())
		if err != nil {
			t.Fatal(err)
		}
		k := newCacheOn(t, c, mem)
		// A second mapping of the memfd and a job in flight ride along.
		r := mem.Fd()
		c.RegisterFd(context.Background(), r, 4096)
		c.Store(context.Background(), k.id, [][]byte{[]byte("leak")}, [][]uint32{{0, 1}})
		c.Close()
		mem.Close()
	}
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Hang)
	defer cancel()
	// settle waits until every session is released and returns the
	// goroutines and descriptors then.
	settle := func() (int, int) {
		if err := f.srv.WaitSessions(ctx, 0); err != nil {
			t.Fatal(err)
		}
		runtime.GC()
		return runtime.NumGoroutine(), countFds(t)
	}
	cycle()
	g0, fd0 := settle()
	for i := 0; i < 20; i++ {
		cycle()
	}
	// Goroutines that finished their work may still be returning: poll
	// the counts (there is nothing to wait on) until they come back.
	var g, fds int
	for ctx.Err() == nil {
		if g, fds = settle(); g <= g0 && fds <= fd0 {
			return
		}
		runtime.Gosched()
		time.Sleep(time.Millisecond)
	}
	t.Fatalf("goroutines %d → %d, descriptors %d → %d", g0, g, fd0, fds)
}

// TestShutdownWithStuckClient: a client that sends requests but never reads
// replies cannot hold the daemon's shutdown beyond the grace period. The
// write timeout is an hour, so the grace period is the only thing that can
// end the stuck session: the wait for the shutdown is a hang guard, not a
// measurement.
func TestShutdownWithStuckClient(t *testing.T) {
	f := newFixture(t, server.Config{ShutdownTimeout: 100 * time.Millisecond, WriteTimeout: time.Hour})
	r := f.raw(t)
	r.send(1, &protocol.Hello{Version: protocol.Version})
	frame := protocol.AppendFrame(nil, 2, &protocol.StatsRequest{})
	var burst []byte
	for i := 0; i < 4096; i++ {
		burst = append(burst, frame...)
	}
	// Write until the socket buffers are full in both directions.
	r.c.SetWriteDeadline(time.Now().Add(500 * time.Millisecond))
	for {
		if _, err := r.c.Write(burst); err != nil {
			break
		}
	}
	done := make(chan struct{})
	go func() { f.stop(t); close(done) }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("shutdown blocked by a client that does not read")
	}
}

// TestAConnectedClientIsToldTheDaemonIsShuttingDown: a client connected
// when the daemon stops gets an Error of code ShuttingDown (request id 0)
// before its connection closes, as a new connection does then, so that
// what its requests fail with says why.
func TestAConnectedClientIsToldTheDaemonIsShuttingDown(t *testing.T) {
	f := newFixture(t, server.Config{ShutdownTimeout: time.Second})
	r := f.raw(t)
	r.hello()
	f.stop(t)
	h, m, err := r.recv()
	if e, ok := m.(*protocol.Error); err != nil || !ok || e.Code != protocol.CodeShuttingDown || h.ID != 0 {
		t.Fatalf("after the shutdown: %+v %#v %v, want an Error of code ShuttingDown, request 0", h, m, err)
	}
	r.expectClosed()
}

// slowPurges is an engine whose purges go on until their context ends,
// as a purge of a namespace of many files on a slow mount does (the
// engine's stops between files once its context ends), saying on
// entered that one has begun; a purge also ends once end is closed (a
// failed test must not leave one holding the fixture's stop).
type slowPurges struct {
	*engine.Engine
	entered chan struct{}
	end     chan struct{}
}

func (e *slowPurges) Purge(ctx context.Context, fp uint64) (engine.PurgeResult, error) {
	e.entered <- struct{}{}
	select {
	case <-ctx.Done():
		return engine.PurgeResult{}, ctx.Err()
	case <-e.end:
		return engine.PurgeResult{}, nil
	}
}

// TestShutdownCancelsARequestUnderWay: a request the daemon is answering
// when it stops (here a purge, which goes on until its context ends) is
// cancelled, as jobs past the grace period are: it does not hold the
// shutdown for as long as it would run. The wait for the shutdown is a
// hang guard, not a measurement.
func TestShutdownCancelsARequestUnderWay(t *testing.T) {
	eng := &slowPurges{entered: make(chan struct{}, 1), end: make(chan struct{})}
	f := newFixtureWith(t, server.Config{}, nil, func(e *engine.Engine) server.Engine {
		eng.Engine = e
		return eng
	})
	t.Cleanup(func() { close(eng.end) }) // before the fixture's stop
	r := f.raw(t)
	r.hello()
	r.send(2, &protocol.Purge{Fingerprint: 1})
	<-eng.entered
	done := make(chan struct{})
	go func() { f.srv.Shutdown(); close(done) }()
	select {
	case <-done:
	case <-time.After(testwait.Hang):
		t.Fatal("the shutdown waits for a purge under way to end on its own")
	}
	h, m, err := r.recv()
	if e, ok := m.(*protocol.Error); err != nil || !ok || e.Code != protocol.CodeCancelled || h.ID != 2 {
		t.Fatalf("the purge's reply: %+v %#v %v, want an Error of code Cancelled, request 2", h, m, err)
	}
}

func TestRetryableAccept(t *testing.T) {
	tests := []struct {
		err  error
		want bool
	}{
		{&net.OpError{Op: "accept", Err: os.NewSyscallError("accept4", unix.EMFILE)}, true},
		{&net.OpError{Op: "accept", Err: os.NewSyscallError("accept4", unix.ENFILE)}, true},
		{&net.OpError{Op: "accept", Err: os.NewSyscallError("accept4", unix.ECONNABORTED)}, true},
		{net.ErrClosed, false},
		{&net.OpError{Op: "accept", Err: os.NewSyscallError("accept4", unix.EINVAL)}, false},
	}
	for _, tt := range tests {
		if got := server.RetryableAccept(tt.err); got != tt.want {
			t.Errorf("RetryableAccept(%v) = %v, want %v", tt.err, got, tt.want)
		}
	}
}
