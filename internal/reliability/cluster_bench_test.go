package reliability

// Throughput through a distributed file system's clients: kvhost daemons,
// one per client mount of KVHOST_CLUSTER_MOUNTS, store and load keys from
// CPU memory (memfd regions), next to plain writes and reads of files of
// the same sizes through the same mounts in the same run (the ceiling).
// docs/cluster.md has the figures and the command.

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/bench"
	"github.com/kvhost/kvhost/internal/testsock"
)

// Throughput settings: every node moves throughputBytes per phase with
// throughputJobs jobs (of one key each) in flight, and the ceiling writes
// and reads as many files of the key's size with as many threads.
const (
	throughputBytes = 256 << 20
	throughputJobs  = 4
)

// throughputGeometry is Llama-3.1-8B in bf16 on one rank (32 layers, 8 KV
// heads of 128 elements, 16 tokens per block): 16 tokens per key make
// 2 MiB keys, 256 make 32 MiB.
func throughputGeometry(tokensPerKey int) client.Geometry {
	return client.Geometry{
		Model: fmt.Sprintf("cluster-throughput-%d", tokensPerKey), Layers: 32, KVHeads: 8, HeadSize: 128, DtypeSize: 2,
		TokensPerBlock: 16, TokensPerKey: uint32(tokensPerKey), TPSize: 1,
	}
}

// payloadBytes is one key's KV bytes in geometry g.
func payloadBytes(g client.Geometry) int64 {
	return int64(g.Layers) * int64(g.Planes()) * int64(g.BlocksPerKey()) * g.BlockBytes()
}

// bulkCache is a paged cache in a memfd on one connection: 2·keys slots of
// one key each, the lower half stored from and the upper half loaded
// into. Slot s < keys holds the same bytes on every node (a ChaCha8 stream
// seeded with s), so a load of a key stored from slot s on any node is
// checked against slot s here.
type bulkCache struct {
	c         *client.Client
	mem       *client.Memfd
	ns        client.Namespace
	id        client.CacheID
	layers    int
	keys, bpk int
	bb        int64
}

// newBulkCache dials socket and registers a cache of 2·keys slots of
// geometry g, the lower half filled.
func newBulkCache(ctx context.Context, socket, name string, g client.Geometry, keys int) (*bulkCache, error) {
	c, err := client.Dial(ctx, socket, name)
	if err != nil {
		return nil, err
	}
	k := &bulkCache{c: c, layers: int(g.Layers), keys: keys, bpk: g.BlocksPerKey(), bb: g.BlockBytes()}
	blocks := int64(2 * keys * k.bpk)
	if k.mem, err = client.NewMemfd("kvhost-cluster-bench", int64(g.Layers)*2*blocks*k.bb); err != nil {
		c.Close()
		return nil, err
	}
	fail := func(what string, err error) (*bulkCache, error) {
		c.Close()
		k.mem.Close()
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	rid, err := c.RegisterMemfd(ctx, k.mem)
	if err != nil {
		return fail("register memory", err)
	}
	if k.ns, err = c.Declare(ctx, g); err != nil {
		return fail("declare", err)
	}
	layers := make([]client.Layer, g.Layers)
	for l := range layers {
		layers[l] = client.Layer{Region: uint32(rid), NumBlocks: uint32(blocks), Offset: int64(l) * 2 * blocks * k.bb, BlockStride: k.bb, PlaneStride: blocks * k.bb}
	}
	if k.id, err = c.RegisterCache(ctx, k.ns.ID, layers); err != nil {
		return fail("register cache", err)
	}
	for s := range keys {
		var seed [32]byte
		binary.LittleEndian.PutUint64(seed[:], uint64(s))
		r := rand.NewChaCha8(seed)
		for _, seg := range k.segments(s) {
			r.Read(seg)
		}
	}
	return k, nil
}

// close closes the connection, then unmaps the memory.
func (k *bulkCache) close() {
	k.c.Close()
	k.mem.Close()
}

// blocks returns the block ids of slot s.
func (k *bulkCache) blocks(s int) []uint32 {
	b := make([]uint32, k.bpk)
	for j := range b {
		b[j] = uint32(s*k.bpk + j)
	}
	return b
}

// segments returns the bytes of every (layer, plane, block) of slot s.
func (k *bulkCache) segments(s int) [][]byte {
	mem := k.mem.Bytes()
	n := int64(2 * k.keys * k.bpk)
	var segs [][]byte
	for l := range int64(k.layers) {
		for p := range int64(2) {
			for _, b := range k.blocks(s) {
				off := l*2*n*k.bb + p*n*k.bb + int64(b)*k.bb
				segs = append(segs, mem[off:off+k.bb])
			}
		}
	}
	return segs
}

// loadedRight reports whether slot keys+s holds slot s's bytes.
func (k *bulkCache) loadedRight(s int) bool {
	want, got := k.segments(s), k.segments(k.keys+s)
	for i := range want {
		if !bytes.Equal(want[i], got[i]) {
			return false
		}
	}
	return true
}

// errThroughputOutcome: a store or load of the benchmark did not store or
// load its key.
var errThroughputOutcome = errors.New("unexpected outcome")

// run moves keys[s] for every slot s with throughputJobs jobs of one key in
// flight: stores from slot s, or loads into slot keys+s. It returns the
// time from the first job's start to the last one's end.
func (k *bulkCache) run(ctx context.Context, keys [][]byte, load bool) (time.Duration, error) {
	var next atomic.Int64
	errs := make(chan error, throughputJobs)
	start := time.Now()
	for range throughputJobs {
		go func() {
			for {
				s := int(next.Add(1) - 1)
				if s >= len(keys) {
					errs <- nil
					return
				}
				var job *client.Job
				var err error
				op, want := "store", client.OutcomeStored
				if load {
					op, want = "load", client.OutcomeLoaded
					job, err = k.c.Load(ctx, k.id, keys[s:s+1], [][]uint32{k.blocks(k.keys + s)})
				} else {
					job, err = k.c.Store(ctx, k.id, keys[s:s+1], [][]uint32{k.blocks(s)})
				}
				if err == nil {
					var res client.Result
					if res, err = job.Wait(ctx); err == nil && res.Keys[0].Outcome != want {
						err = fmt.Errorf("%w: %s of %s: %v (%s)", errThroughputOutcome, op, keys[s], res.Keys[0].Outcome, res.Message)
					}
				}
				if err != nil {
					next.Store(int64(len(keys)))
					errs <- err
					return
				}
			}
		}()
	}
	var first error
	for range throughputJobs {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	return time.Since(start), first
}

// phase is one timed phase on n nodes at once: each node's bytes and
// time, and the wall time from the first node's start to the last one's
// end.
type phase struct {
	bytes []int64
	took  []time.Duration
	wall  time.Duration
}

// runPhase runs fn(i) on every node i at once and times each and all.
func runPhase(n int, fn func(i int) (int64, time.Duration, error)) (phase, error) {
	p := phase{bytes: make([]int64, n), took: make([]time.Duration, n)}
	errs := make([]error, n)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.bytes[i], p.took[i], errs[i] = fn(i)
		}()
	}
	wg.Wait()
	p.wall = time.Since(start)
	return p, errors.Join(errs...)
}

// phaseTotals sums a phase's rounds.
type phaseTotals struct {
	bytes   int64
	wall    time.Duration
	perNode []float64 // each round's mean per-node MB/s
}

func (t *phaseTotals) add(p phase) {
	var sum float64
	for i, b := range p.bytes {
		t.bytes += b
		sum += mbps(b, p.took[i])
	}
	t.wall += p.wall
	t.perNode = append(t.perNode, sum/float64(len(p.bytes)))
}

// aggregate is the phases' MB/s over all nodes and rounds.
func (t *phaseTotals) aggregate() float64 { return mbps(t.bytes, t.wall) }

// node is the mean over rounds of the mean per-node MB/s.
func (t *phaseTotals) node() float64 {
	var s float64
	for _, v := range t.perNode {
		s += v
	}
	return s / float64(len(t.perNode))
}

// mbps is bytes over d in MB/s (10^6 bytes per second).
func mbps(bytes int64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(bytes) / d.Seconds() / 1e6
}

// alignedBuffer returns n bytes at an O_DIRECT-aligned address, filled
// with random bytes.
func alignedBuffer(n int64) []byte {
	b := make([]byte, n+bench.Align)
	off := int64(0)
	if r := int64(uintptr(unsafe.Pointer(unsafe.SliceData(b))) % bench.Align); r != 0 {
		off = bench.Align - r
	}
	b = b[off : off+n]
	rand.NewChaCha8([32]byte{1}).Read(b)
	return b
}

// BenchmarkClusterThroughput measures, for 1, 2 and 3 nodes (as many as
// KVHOST_CLUSTER_MOUNTS names) and 2 MiB and 32 MiB keys, kvhost's stores
// and loads through each node's client mount against plain writes and
// reads of files of the same sizes through the same mounts, each phase
// timed on its own: engine store, ceiling write, engine load, ceiling
// read. Every node stores 256 MiB of fresh keys with 4 jobs of one key in
// flight, and then loads the keys the next node stored (a cross-node hit;
// one node loads its own); the ceiling writes as many files with 4
// threads and reads the next node's, with O_DIRECT where the engine uses
// it. One iteration is one round; keys and files are deleted between
// rounds (untimed), and every loaded byte is checked (untimed). It
// reports aggregate and mean per-node MB/s and the fraction of the
// ceiling reached, and prints one line per round.
func BenchmarkClusterThroughput(b *testing.B) {
	mounts := clusterMounts(b)
	run := testsock.Dir(b)
	ds := make([]*daemon, len(mounts))
	for i, m := range mounts {
		ds[i] = startDaemon(b, clusterConfig(run, m, i))
	}
	direct, err := fsys.ProbeDirect(fsys.OS{}, mounts[0])
	if err != nil {
		b.Fatalf("O_DIRECT probe on %s: %v", mounts[0], err)
	}
	for n := 1; n <= min(3, len(mounts)); n++ {
		for _, tpk := range []int{16, 256} {
			g := throughputGeometry(tpk)
			size := payloadBytes(g)
			b.Run(fmt.Sprintf("nodes=%d/key=%dMiB", n, size>>20), func(b *testing.B) {
				benchThroughput(b, ds[:n], mounts[:n], g, direct)
			})
		}
	}
}

// benchThroughput runs b.N rounds of BenchmarkClusterThroughput on the
// daemons ds, daemon i on mounts[i].
func benchThroughput(b *testing.B, ds []*daemon, mounts []string, g client.Geometry, direct bool) {
	ctx := context.Background()
	n := len(ds)
	size := payloadBytes(g)
	keys := int(throughputBytes / size)
	caches := make([]*bulkCache, n)
	for i, d := range ds {
		k, err := newBulkCache(ctx, d.cfg.Socket, fmt.Sprintf("bench-%d", i), g, keys)
		if err != nil {
			b.Fatalf("node-%d: %v", i+1, err)
		}
		defer k.close()
		caches[i] = k
	}
	bufs := make([][][]byte, n)
	for i := range bufs {
		for range throughputJobs {
			bufs[i] = append(bufs[i], alignedBuffer(size))
		}
	}
	sizes := make([]int64, keys)
	for s := range sizes {
		sizes[s] = size
	}
	var store, write, load, read phaseTotals
	for r := range b.N {
		names := make([][][]byte, n)
		files := make([][]string, n)
		dir := make([]string, n)
		for i := range n {
			dir[i] = filepath.Join(mounts[i], fmt.Sprintf("ceiling-%d-%d", size, r))
			if i == 0 {
				if err := os.Mkdir(dir[i], 0o755); err != nil {
					b.Fatal(err)
				}
			}
			for s := range keys {
				names[i] = append(names[i], fmt.Appendf(nil, "tp-%d-r%d-n%d-%04d", size, r, i, s))
				files[i] = append(files[i], filepath.Join(dir[i], fmt.Sprintf("n%d-%04d", i, s)))
			}
		}
		// next is the node whose keys and files node i reads.
		next := func(i int) int { return (i + 1) % n }
		ps := make([]phase, 4)
		var err error
		ps[0], err = runPhase(n, func(i int) (int64, time.Duration, error) {
			d, err := caches[i].run(ctx, names[i], false)
			return int64(keys) * size, d, err
		})
		if err != nil {
			b.Fatalf("round %d: engine stores: %v", r, err)
		}
		ps[1], err = runPhase(n, func(i int) (int64, time.Duration, error) {
			return bench.WriteFiles(ctx, files[i], sizes, bufs[i], direct, false)
		})
		if err != nil {
			b.Fatalf("round %d: ceiling writes: %v", r, err)
		}
		ps[2], err = runPhase(n, func(i int) (int64, time.Duration, error) {
			d, err := caches[i].run(ctx, names[next(i)], true)
			return int64(keys) * size, d, err
		})
		if err != nil {
			b.Fatalf("round %d: engine loads: %v", r, err)
		}
		ps[3], err = runPhase(n, func(i int) (int64, time.Duration, error) {
			other := make([]string, keys)
			for s := range other {
				other[s] = filepath.Join(dir[i], filepath.Base(files[next(i)][s]))
			}
			return bench.ReadFiles(ctx, other, bufs[i], direct)
		})
		if err != nil {
			b.Fatalf("round %d: ceiling reads: %v", r, err)
		}
		for i, k := range caches {
			for s := range keys {
				if !k.loadedRight(s) {
					b.Fatalf("round %d: node-%d loaded %s with other bytes", r, i+1, names[next(i)][s])
				}
			}
			if _, err := k.c.Delete(ctx, k.ns.ID, names[i]); err != nil {
				b.Fatal(err)
			}
		}
		if err := os.RemoveAll(dir[0]); err != nil {
			b.Fatal(err)
		}
		for i, t := range []*phaseTotals{&store, &write, &load, &read} {
			t.add(ps[i])
		}
		line := fmt.Sprintf("cluster throughput: nodes=%d key=%dMiB round=%d direct=%v", n, size>>20, r, direct)
		for i, name := range []string{"store", "write_ceiling", "load", "read_ceiling"} {
			line += fmt.Sprintf(" %s=%.0fMB/s", name, mbps(sum(ps[i].bytes), ps[i].wall))
			for j := range n {
				line += fmt.Sprintf(" %s_n%d=%.0f", name, j+1, mbps(ps[i].bytes[j], ps[i].took[j]))
			}
		}
		fmt.Println(line)
	}
	b.ReportMetric(store.aggregate(), "store_MB/s")
	b.ReportMetric(store.node(), "store_MB/s/node")
	b.ReportMetric(write.aggregate(), "write_ceiling_MB/s")
	b.ReportMetric(store.aggregate()/write.aggregate(), "store/ceiling")
	b.ReportMetric(load.aggregate(), "load_MB/s")
	b.ReportMetric(load.node(), "load_MB/s/node")
	b.ReportMetric(read.aggregate(), "read_ceiling_MB/s")
	b.ReportMetric(load.aggregate()/read.aggregate(), "load/ceiling")
}

// sum adds up xs.
func sum(xs []int64) int64 {
	var s int64
	for _, x := range xs {
		s += x
	}
	return s
}

// BenchmarkClusterPinOfAnotherNodesFiles times what a client pin costs
// on a shared file system, where the daemon holds open each file another
// node may remove (docs/engine.md, "Pins and other nodes"): node 1 stores
// 64 keys of one file each; node 2, having found them (an untimed pin
// first), pins all 64 and unpins them, each iteration (pin+unpin, one
// daemon round trip each), or pins them, loads them (every byte checked,
// in the time) and unpins them (pin+load+unpin: the load reads through
// the files the pin holds open, with no open of its own). Beside it, in the same run, the ceilings of
// what a pin does per file through node 2's mount: a stat (what a pin
// did before), and an open, fstat and close (what it does now). Each
// reports µs per file.
func BenchmarkClusterPinOfAnotherNodesFiles(b *testing.B) {
	mounts := clusterMounts(b)
	run := testsock.Dir(b)
	ds := []*daemon{startDaemon(b, clusterConfig(run, mounts[0], 0)), startDaemon(b, clusterConfig(run, mounts[1], 1))}
	ctx := context.Background()
	const files = 64
	var keys [][]byte
	for i := range files {
		keys = append(keys, fmt.Appendf(nil, "pin-bench-%02d", i))
	}
	var nodes [2]*kvCache
	for i, d := range ds {
		c, k, err := dialCache(ctx, d.cfg.Socket, fmt.Sprintf("pin-bench-%d", i), 2*files)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { c.Close(); k.close() })
		nodes[i] = k
	}
	res, err := nodes[0].store(ctx, keys)
	if err != nil {
		b.Fatal(err)
	}
	for i, k := range res.Keys {
		if k.Outcome != client.OutcomeStored {
			b.Fatalf("node-1: store of %s: %v (%s)", keys[i], k.Outcome, res.Message)
		}
	}
	pinAll := func(load bool) {
		p, err := nodes[1].c.Pin(ctx, nodes[1].ns.ID, keys, 0)
		if err != nil {
			b.Fatal(err)
		}
		for i, h := range p.Held {
			if !h {
				b.Fatalf("node-2: %s, stored on node-1, not pinned", keys[i])
			}
		}
		if load {
			r, err := nodes[1].load(ctx, keys)
			if err != nil {
				b.Fatal(err)
			}
			for i, ok := range r.match {
				if !ok {
					b.Fatalf("node-2: load of %s: %v (%s)", keys[i], r.outcomes[i], r.message)
				}
			}
		}
		if _, err := nodes[1].c.Unpin(ctx, p.ID); err != nil {
			b.Fatal(err)
		}
	}
	pinAll(false) // node 2 finds the files
	var paths []string
	for _, fs := range scanFiles(mounts[1]) {
		paths = append(paths, fs[0].path)
	}
	if len(paths) != files {
		b.Fatalf("%d files through node 2's mount, want %d", len(paths), files)
	}
	perFile := func(b *testing.B) {
		b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N*files), "µs/file")
	}
	b.Run("pin+unpin", func(b *testing.B) {
		for b.Loop() {
			pinAll(false)
		}
		perFile(b)
	})
	b.Run("pin+load+unpin", func(b *testing.B) {
		for b.Loop() {
			pinAll(true)
		}
		perFile(b)
	})
	b.Run("stat", func(b *testing.B) {
		for b.Loop() {
			for _, p := range paths {
				if _, err := os.Stat(p); err != nil {
					b.Fatal(err)
				}
			}
		}
		perFile(b)
	})
	b.Run("open+fstat+close", func(b *testing.B) {
		for b.Loop() {
			for _, p := range paths {
				f, err := os.Open(p)
				if err != nil {
					b.Fatal(err)
				}
				if _, err := f.Stat(); err != nil {
					b.Fatal(err)
				}
				f.Close()
			}
		}
		perFile(b)
	})
}
