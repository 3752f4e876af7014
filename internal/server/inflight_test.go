package server_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/protocol"
)

// wideGeo has 256 blocks per key: a job's block lists outweigh its keys,
// as they do for long keys of small blocks.
var wideGeo = client.Geometry{Model: "wide", Layers: 2, KVHeads: 1, HeadSize: 64, DtypeSize: 2, TokensPerBlock: 4, TokensPerKey: 4 * wideBPK, TPSize: 1}

const (
	wideBPK     = 256 // blocks per key of wideGeo
	wideKeys    = 16  // keys per job of a wideCache
	wideBlocks  = wideBPK
	wideKeySize = 16
)

// wideCache is a cache of wideGeo on a client.
type wideCache struct {
	c  *client.Client
	id client.CacheID
}

func newWideCache(tb testing.TB, c *client.Client) *wideCache {
	tb.Helper()
	bb := wideGeo.BlockBytes()
	_, rid := registerMemfd(tb, c, "wide", int64(wideGeo.Layers)*2*wideBlocks*bb)
	_, id, err := registerCache(tb, c, wideGeo, planesFirst(rid, wideBlocks, bb))
	if err != nil {
		tb.Fatal(err)
	}
	return &wideCache{c: c, id: id}
}

// store starts storing wideKeys keys named after name and i, and returns
// the bytes the daemon cannot keep in less while the job runs: the keys
// and, per block, the int the engine's copy of the block lists holds.
func (k *wideCache) store(ctx context.Context, name string, i int) (int64, error) {
	keys := make([][]byte, wideKeys)
	blocks := make([][]uint32, wideKeys)
	held := int64(0)
	for j := range keys {
		keys[j] = fmt.Appendf(nil, "%-*s", wideKeySize, fmt.Sprintf("%s-%d-%d", name, i, j))
		blocks[j] = make([]uint32, wideBPK)
		for b := range blocks[j] {
			blocks[j][b] = uint32(b)
		}
		held += int64(len(keys[j])) + 8*wideBPK
	}
	_, err := k.c.Store(ctx, k.id, keys, blocks)
	return held, err
}

// gate holds every open and write of the engine's data files while armed,
// until it is opened, and then fails them: the stores that reach them stay
// in flight, those behind them wait for the I/O workers, and once the gate
// opens they all end at once, writing nothing. The mounts' model books
// (.models-NODE, appended when a namespace is first declared) pass: a
// declaration is not a job in flight.
type gate struct {
	armed    atomic.Bool
	once     sync.Once
	released chan struct{}
}

func (g *gate) Inject(op fsys.Op, path string) fsys.Fault {
	if strings.Contains(filepath.Base(path), ".models-") {
		return fsys.Fault{}
	}
	if g.armed.Load() && (op == fsys.OpOpen || op == fsys.OpWrite) {
		<-g.released
		return fsys.Fault{Err: syscall.EIO}
	}
	return fsys.Fault{}
}

func (g *gate) open() { g.once.Do(func() { close(g.released) }) }

// gatedFixture is a fixture whose engine's file operations pass g. The
// gate opens before the fixture stops.
func gatedFixture(t *testing.T, cfg server.Config) (*fixture, *gate) {
	g := &gate{released: make(chan struct{})}
	f := newFixtureWith(t, cfg, func(c *engine.Config) { c.FS = &fsys.Faulty{FS: fsys.OS{}, Inj: g} }, nil)
	t.Cleanup(g.open) // runs before the fixture's stop
	return f, g
}

// fill starts stores on caches in turn, each waiting at g, until the
// daemon refuses one, and returns the refusal and the bytes the accepted
// jobs hold at least. It gives up after stores holding 4 × limit.
func fill(t *testing.T, caches []*wideCache, limit int64) (int64, error) {
	t.Helper()
	ctx := context.Background()
	var held int64
	for i := 0; held < 4*limit; i++ {
		n, err := caches[i%len(caches)].store(ctx, "fill", i)
		if err != nil {
			return held, err
		}
		held += n
	}
	return held, nil
}

// TestJobsInFlightOfAllConnectionsAreBounded: the jobs in flight of all
// connections together hold at most server.max_inflight_bytes; a job
// beyond it is refused with limit exceeded naming the key, and accepted
// again once the jobs in flight have ended.
func TestJobsInFlightOfAllConnectionsAreBounded(t *testing.T) {
	const limit = 4 << 20
	f, g := gatedFixture(t, server.Config{MaxInflightJobs: 1 << 16, MaxFrame: protocol.MinFrame, MaxInflightBytes: limit, MaxInflightBytesPerPeer: limit})
	caches := []*wideCache{newWideCache(t, f.dial(t)), newWideCache(t, f.dial(t))}
	g.armed.Store(true)
	held, err := fill(t, caches, limit)
	if held > limit {
		t.Errorf("the daemon accepted jobs holding at least %d bytes, more than server.max_inflight_bytes (%d)", held, limit)
	}
	var pe *protocol.Error
	if !errors.As(err, &pe) || pe.Code != protocol.CodeLimit || !strings.Contains(pe.Message, "server.max_inflight_bytes)") {
		t.Fatalf("a store beyond the jobs' bytes: %v, want limit exceeded naming server.max_inflight_bytes", err)
	}
	g.open()
	testwait.Until(t, "every job to end", time.Minute, func() bool { return f.srv.Stats().InflightJobs == 0 })
	if st := f.srv.Stats(); st.InflightBytes != 0 || st.InflightLimit != limit {
		t.Errorf("with no job in flight the jobs hold %d bytes of a limit of %d, want 0 of %d", st.InflightBytes, st.InflightLimit, limit)
	}
	if _, err := caches[1].store(context.Background(), "after", 0); err != nil {
		t.Fatalf("a store once every job ended: %v", err)
	}
}

// TestOneProcessCannotHoldEveryJobByte: one process's jobs in flight, on
// all its connections, hold at most server.max_inflight_bytes_per_peer
// (half of server.max_inflight_bytes by default); beyond it its jobs are
// refused with limit exceeded naming the key, while another process's job
// is still accepted.
func TestOneProcessCannotHoldEveryJobByte(t *testing.T) {
	const limit, perPeer = 8 << 20, 4 << 20
	f, g := gatedFixture(t, server.Config{MaxInflightJobs: 1 << 16, MaxFrame: protocol.MinFrame, MaxInflightBytes: limit})
	caches := []*wideCache{newWideCache(t, f.dial(t)), newWideCache(t, f.dial(t)), newWideCache(t, f.dial(t))}
	g.armed.Store(true)
	held, err := fill(t, caches, limit)
	if held > perPeer {
		t.Errorf("one process's jobs hold at least %d bytes, more than server.max_inflight_bytes_per_peer (%d)", held, perPeer)
	}
	var pe *protocol.Error
	if !errors.As(err, &pe) || pe.Code != protocol.CodeLimit || !strings.Contains(pe.Message, "server.max_inflight_bytes_per_peer") {
		t.Errorf("a store beyond the process's jobs' bytes: %v, want limit exceeded naming server.max_inflight_bytes_per_peer", err)
	}
	otherProcess(t, f, peerStoreEnv+"=1")
}

// TestInflightBytesLimits: the bounds on the jobs' bytes default to 1 GiB
// and half of it, grow with max_frame so that a process may hold two of
// the largest jobs, and refuse settings under which one such job could
// never run.
func TestInflightBytesLimits(t *testing.T) {
	eng := openEngineWith(t, t.TempDir(), nil)
	t.Cleanup(func() { eng.Close(context.Background()) })
	tests := []struct {
		name           string
		cfg            server.Config
		total, perPeer int64
		err            string // a substring of New's error; "" for none
	}{
		{"defaults", server.Config{}, 1 << 30, 1 << 29, ""},
		{"largest frame", server.Config{MaxFrame: protocol.MaxFrame}, 4 * server.MaxJobBytes(protocol.MaxFrame), 2 * server.MaxJobBytes(protocol.MaxFrame), ""},
		{"per peer given", server.Config{MaxInflightBytesPerPeer: 64 << 20}, 1 << 30, 64 << 20, ""},
		{"per peer above the total", server.Config{MaxInflightBytes: 64 << 20, MaxInflightBytesPerPeer: 128 << 20}, 0, 0, "want at most max_inflight_bytes"},
		{"per peer below one job", server.Config{MaxInflightBytes: 16 << 20}, 0, 0, "max_inflight_bytes_per_peer 8388608: want at least"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.Logger = quiet()
			srv, err := server.New(eng, tc.cfg)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("New: %v, want an error containing %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if st := srv.Stats(); st.InflightLimit != tc.total {
				t.Errorf("max_inflight_bytes %d, want %d", st.InflightLimit, tc.total)
			}
			if got := srv.InflightPerPeer(); got != tc.perPeer {
				t.Errorf("max_inflight_bytes_per_peer %d, want %d", got, tc.perPeer)
			}
		})
	}
}

// TestJobBytesOfTheLargestFrame: MaxJobBytes bounds what any Store or
// Load frame of max_frame bytes can carry, whether its keys or its block
// lists fill it.
func TestJobBytesOfTheLargestFrame(t *testing.T) {
	const maxFrame = protocol.MinFrame
	frame := func(n, keyLen, bpk int) ([][]byte, int) {
		m := &protocol.Transfer{Keys: make([][]byte, n), Blocks: make([][]uint32, n)}
		for i := range m.Keys {
			m.Keys[i], m.Blocks[i] = make([]byte, keyLen), make([]uint32, bpk)
		}
		return m.Keys, len(protocol.AppendFrame(nil, 1, m))
	}
	tests := []struct {
		name             string
		keyLen, bpk, max int // keys of keyLen bytes and bpk blocks, as many as fit (at most max)
	}{
		{"most keys, shortest", 1, 1, protocol.MaxKeysPerRequest},
		{"longest keys", protocol.MaxKeyLen, 1, protocol.MaxKeysPerRequest},
		{"one key, most blocks", 1, protocol.MaxBlocksPerKey, 1},
		{"block lists fill it", 8, 64, protocol.MaxKeysPerRequest},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, empty := frame(0, tc.keyLen, tc.bpk)
			n := min(tc.max, (maxFrame-empty)/(1+tc.keyLen+4*tc.bpk))
			keys, size := frame(n, tc.keyLen, tc.bpk)
			if _, more := frame(n+1, tc.keyLen, tc.bpk); size > maxFrame || (n < tc.max && more <= maxFrame) {
				t.Fatalf("%d keys make a frame of %d bytes, %d keys one of %d: want the most that fit %d", n, size, n+1, more, maxFrame)
			}
			if got, most := server.JobBytes(keys, tc.bpk), server.MaxJobBytes(maxFrame); got > most {
				t.Errorf("%d keys of %d bytes and %d blocks count %d bytes, more than MaxJobBytes(%d) = %d", n, tc.keyLen, tc.bpk, got, maxFrame, most)
			}
		})
	}
}
