package server_test

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/protocol"
)

// hello completes the handshake of a raw connection.
func (r *rawConn) hello() {
	r.tb.Helper()
	r.send(1, &protocol.Hello{Version: protocol.Version})
	if _, m, err := r.recv(); err != nil || m.Type() != protocol.TypeHello|protocol.TypeReply {
		r.tb.Fatalf("welcome: %#v %v", m, err)
	}
}

// register registers fd's first size bytes and returns the reply: a
// region id, or the error code.
func (r *rawConn) register(fd int, size int64) (uint32, protocol.Code) {
	r.tb.Helper()
	r.send(2, &protocol.RegisterMemory{Kind: protocol.MemoryMemfd, Size: uint64(size)}, fd)
	_, m, err := r.recv()
	if err != nil {
		r.tb.Fatal(err)
	}
	switch m := m.(type) {
	case *protocol.MemoryRegistered:
		return m.Region, protocol.CodeOK
	case *protocol.Error:
		return 0, m.Code
	}
	r.tb.Fatalf("register: %#v", m)
	return 0, 0
}

// sparse returns a memfd of size bytes that uses no memory.
func sparse(tb testing.TB, size int64) int {
	tb.Helper()
	m, err := client.NewMemfd("sparse", size)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { m.Close() })
	return m.Fd()
}

func ram(tb testing.TB) int64 {
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil {
		tb.Fatal(err)
	}
	return int64(si.Totalram) * int64(si.Unit)
}

// TestSparseMemfdsDoNotExhaustRegisteredMemory reproduces issue 7 with the
// default limits: two clients that register sparse memfds the size of the
// machine's memory (which costs them nothing) used to leave no registered
// memory for anyone else. Now every client keeps its share.
func TestSparseMemfdsDoNotExhaustRegisteredMemory(t *testing.T) {
	f := newFixture(t, server.Config{})
	size := ram(t)
	fd := sparse(t, size)
	for i := 0; i < 3; i++ {
		r := f.raw(t)
		r.hello()
		if _, code := r.register(fd, size); code != protocol.CodeOK {
			t.Fatalf("client %d: registering %d sparse bytes (the machine's memory): %s", i, size, code)
		}
		if _, code := r.register(fd, 4096); code != protocol.CodeLimit {
			t.Fatalf("client %d: a second registration past its share: got %s, want %s", i, code, protocol.CodeLimit)
		}
	}
}

// TestRegisteredBytesShare: a connection may register at most the smaller
// of MaxRegisteredBytes and its share of MaxTotalRegisteredBytes; a client
// that takes all it can leaves every other client its share; bytes come
// back when a region is unregistered.
func TestRegisteredBytesShare(t *testing.T) {
	const gib = 1 << 30
	tests := []struct {
		name           string
		clients        int
		perConn, total int64
		wantShare      int64
	}{
		{"share below the per-connection limit", 4, 3 * gib, 8 * gib, 2 * gib},
		{"per-connection limit below the share", 2, 1 * gib, 8 * gib, 1 * gib},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, server.Config{MaxClients: tc.clients, MaxClientsPerPeer: tc.clients, MaxRegisteredBytes: tc.perConn, MaxTotalRegisteredBytes: tc.total})
			fd := sparse(t, tc.wantShare)
			conns := make([]*rawConn, tc.clients)
			var first uint32
			for i := range conns {
				r := f.raw(t)
				r.hello()
				conns[i] = r
				id, code := r.register(fd, tc.wantShare)
				if code != protocol.CodeOK {
					t.Fatalf("client %d: registering its share: %s", i, code)
				}
				if i == 0 {
					first = id
				}
				if _, code := r.register(fd, 4096); code != protocol.CodeLimit {
					t.Fatalf("client %d: one page past its share: got %s, want %s", i, code, protocol.CodeLimit)
				}
			}
			a := conns[0]
			a.send(3, &protocol.UnregisterMemory{Region: first})
			if _, m, err := a.recv(); err != nil || m.Type() != protocol.TypeUnregisterMemory|protocol.TypeReply {
				t.Fatalf("unregister: %#v %v", m, err)
			}
			if _, code := a.register(fd, tc.wantShare); code != protocol.CodeOK {
				t.Fatalf("registering again after unregistering: %s", code)
			}
		})
	}
}

// TestStrayDescriptorIsNotTakenByTheNextRegistration: a descriptor sent
// with a frame that does not take it (one answered with an error before a
// registration could claim it, or one that takes none) belongs to that
// frame and is closed once the frame is answered. The next memfd
// registration maps its own descriptor, not the stray one, which used to
// wait in the queue for it; so when the client sends it at once, before
// the answer (pipelined).
func TestStrayDescriptorIsNotTakenByTheNextRegistration(t *testing.T) {
	const size = 4096
	tests := []struct {
		name  string
		frame protocol.Message // sent with the stray descriptor
		want  protocol.Code    // its answer
	}{
		{"hello", &protocol.Hello{Version: protocol.Version}, protocol.CodeOK},
		{"malformed", &protocol.Lookup{NS: 1}, protocol.CodeMalformed},
		{"malformed registration", &protocol.RegisterMemory{Kind: protocol.MemoryMemfd}, protocol.CodeMalformed},
		{"unknown type", &protocol.Count{T: protocol.TypeLookup | protocol.TypeReply}, protocol.CodeUnknownType},
		{"invalid geometry", &protocol.Declare{Geometry: protocol.Geometry{Model: "m"}}, protocol.CodeInvalid},
		{"GPU registration", &protocol.RegisterMemory{Kind: protocol.MemoryCUDAIPC, Size: size}, protocol.CodeUnsupported},
		{"request that takes none", &protocol.StatsRequest{}, protocol.CodeOK},
	}
	f := newFixture(t, server.Config{})
	for _, tc := range tests {
		for _, pipelined := range []bool{false, true} {
			name := tc.name
			if pipelined {
				name += ", pipelined"
			}
			t.Run(name, func(t *testing.T) {
				stray, err := client.NewMemfd("stray", size)
				if err != nil {
					t.Fatal(err)
				}
				var st unix.Stat_t
				if err := unix.Fstat(stray.Fd(), &st); err != nil {
					t.Fatal(err)
				}
				strayIno := st.Ino
				r := f.raw(t)
				if tc.frame.Type() != protocol.TypeHello {
					r.hello()
				}
				r.send(3, tc.frame, stray.Fd())
				stray.Close() // the daemon's copy is the only one left
				good := sparse(t, size)
				reg := &protocol.RegisterMemory{Kind: protocol.MemoryMemfd, Size: size}
				if pipelined {
					r.send(4, reg, good)
				}
				_, m, err := r.recv()
				if err != nil {
					t.Fatal(err)
				}
				if e, ok := m.(*protocol.Error); ok != (tc.want != protocol.CodeOK) || ok && e.Code != tc.want {
					t.Fatalf("%s with a descriptor answered %#v, want %s", tc.frame.Type(), m, tc.want)
				}
				if !pipelined {
					r.send(4, reg, good)
				}
				if err := unix.Fstat(good, &st); err != nil {
					t.Fatal(err)
				}
				_, m, err = r.recv()
				if err != nil {
					t.Fatal(err)
				}
				got, ok := m.(*protocol.MemoryRegistered)
				if !ok {
					t.Fatalf("registration after the stray descriptor: %#v", m)
				}
				if got.Inode != st.Ino {
					t.Fatalf("registration mapped inode %d (the stray descriptor's is %d), want its own %d", got.Inode, strayIno, st.Ino)
				}
				if fd := openMemfd(t, strayIno); fd >= 0 {
					t.Fatalf("the stray descriptor is still open (descriptor %d) after its frame was answered", fd)
				}
			})
		}
	}
}

// TestRegistrationPipelinedAfterAFrameWithoutDescriptorsGetsItsOwn: a
// descriptor that the daemon reads together with the frames before its
// own (a read that begins with them) is kept for its frame, not closed
// when those are answered.
func TestRegistrationPipelinedAfterAFrameWithoutDescriptorsGetsItsOwn(t *testing.T) {
	f := newFixture(t, server.Config{})
	r := f.raw(t)
	r.hello()
	for i := range 20 {
		good := sparse(t, 4096)
		r.send(2, &protocol.StatsRequest{})
		r.send(3, &protocol.RegisterMemory{Kind: protocol.MemoryMemfd, Size: 4096}, good)
		if _, m, err := r.recv(); err != nil || m.Type() != protocol.TypeStats|protocol.TypeReply {
			t.Fatalf("stats: %#v %v", m, err)
		}
		if _, m, err := r.recv(); err != nil || m.Type() != protocol.TypeRegisterMemory|protocol.TypeReply {
			t.Fatalf("registration %d after a stats request: %#v %v", i, m, err)
		}
	}
}

// openMemfd returns a descriptor of this process open on the memfd of
// inode ino, or -1.
func openMemfd(t *testing.T, ino uint64) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		path := "/proc/self/fd/" + e.Name()
		var st unix.Stat_t
		if link, err := os.Readlink(path); err != nil || !strings.HasPrefix(link, "/memfd:") || unix.Stat(path, &st) != nil || st.Ino != ino {
			continue // closed meanwhile, or another file
		}
		fd, _ := strconv.Atoi(e.Name())
		return fd
	}
	return -1
}

// heldStats is an engine whose first Stats call closes entered and waits
// until release is closed: the session stops reading while the test
// queues frames behind the Stats request.
type heldStats struct {
	*engine.Engine
	once    sync.Once
	entered chan struct{}
	release chan struct{}
}

func (h *heldStats) Stats() engine.Stats {
	h.once.Do(func() {
		close(h.entered)
		<-h.release
	})
	return h.Engine.Stats()
}

// TestRegistrationWithoutDescriptorDoesNotTakeTheNextOnes: a memfd
// registration sent without its descriptor is answered "descriptor
// missing", even when the daemon reads it together with the next
// registration, sent with its own descriptor in a sendmsg of its own:
// that descriptor is the next registration's, which maps it.
func TestRegistrationWithoutDescriptorDoesNotTakeTheNextOnes(t *testing.T) {
	held := &heldStats{entered: make(chan struct{}), release: make(chan struct{})}
	f := newFixtureWith(t, server.Config{}, nil, func(e *engine.Engine) server.Engine {
		held.Engine = e
		return held
	})
	r := f.raw(t)
	r.hello()
	r.send(2, &protocol.StatsRequest{})
	<-held.entered // the session reads nothing until release
	good := sparse(t, 4096)
	var st unix.Stat_t
	if err := unix.Fstat(good, &st); err != nil {
		t.Fatal(err)
	}
	reg := &protocol.RegisterMemory{Kind: protocol.MemoryMemfd, Size: 4096}
	r.send(3, reg)       // no descriptor
	r.send(4, reg, good) // its own, in a sendmsg of its own
	close(held.release)
	if _, m, err := r.recv(); err != nil || m.Type() != protocol.TypeStats|protocol.TypeReply {
		t.Fatalf("stats: %#v %v", m, err)
	}
	r.expectCode(protocol.CodeNoFd)
	_, m, err := r.recv()
	if err != nil {
		t.Fatal(err)
	}
	if got, ok := m.(*protocol.MemoryRegistered); !ok || got.Inode != st.Ino {
		t.Fatalf("registration sent with its descriptor (inode %d): %#v", st.Ino, m)
	}
}

// TestRefusedTransferAllocatesByTheFrameNotTheNamespace: a Store whose
// keys carry 1 block each, in a namespace of 4096 blocks per key, is
// refused (invalid argument) before the daemon sizes anything by the
// namespace's count: refusing a frame of some 35 KiB (below what
// max_incoming_bytes counts) cost 128 MiB before.
func TestRefusedTransferAllocatesByTheFrameNotTheNamespace(t *testing.T) {
	f := newFixture(t, server.Config{})
	r := f.raw(t)
	r.hello()
	rid, code := r.register(sparse(t, 4096), 4096)
	if code != protocol.CodeOK {
		t.Fatalf("register: %s", code)
	}
	// 4096 blocks of 1 token per key: one latent plane of one layer.
	r.send(3, &protocol.Declare{Geometry: protocol.Geometry{Model: "wide", Layers: 1, KVHeads: 1, HeadSize: 256, DtypeSize: 2,
		MLA: true, TokensPerBlock: 1, TokensPerKey: 4096, TPSize: 1}})
	_, m, err := r.recv()
	if err != nil {
		t.Fatal(err)
	}
	d, ok := m.(*protocol.Declared)
	if !ok || d.BlocksPerKey != 4096 {
		t.Fatalf("declare: %#v, want 4096 blocks per key", m)
	}
	r.send(4, &protocol.RegisterCache{NS: d.NS, Layers: []protocol.Layer{{Region: rid, NumBlocks: 1, BlockStride: 512}}})
	if _, m, err = r.recv(); err != nil {
		t.Fatal(err)
	}
	cr, ok := m.(*protocol.CacheRegistered)
	if !ok {
		t.Fatalf("register cache: %#v", m)
	}
	tr := &protocol.Transfer{Kind: protocol.JobStore, Cache: cr.Cache}
	for i := range protocol.MaxKeysPerRequest {
		tr.Keys = append(tr.Keys, []byte(fmt.Sprint(i)))
		tr.Blocks = append(tr.Blocks, []uint32{0})
	}
	frame := len(protocol.AppendFrame(nil, 5, tr))
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	r.send(5, tr)
	r.expectCode(protocol.CodeInvalid)
	runtime.ReadMemStats(&after)
	if got := after.TotalAlloc - before.TotalAlloc; got > 16<<20 {
		t.Fatalf("refusing a %d-byte Store frame allocated %d MiB in the daemon", frame, got>>20)
	}
}
