//go:build invariants

package engine

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/region"
)

// Benchmarks of the engine against the storage's own ceiling, measured in
// the same run, on the directory named by KVHOST_BENCH_DIR (default
// os.TempDir(); use /dev/shm for tmpfs):
//
//	KVHOST_BENCH_DIR=/dev/shm go test -run '^$' -bench . -benchtime 10x ./host/engine
//
// The ceiling is a plain large sequential write (read) of the same bytes:
// one 32 MiB file per key from one contiguous memfd buffer in 8 MiB calls,
// by the same number of threads as the engine's I/O workers, with the same
// open flags (O_DIRECT where the engine uses it). The engine stores (loads)
// the same number of 32 MiB keys of Llama-3.1-8B bf16 (32 layers, 8 KV
// heads, head size 128, 16-token blocks, 256 tokens per key) from (into) a
// paged layout: one memfd-backed tensor per layer, blocks scattered. Each
// iteration times both; engine/ceiling is their throughput ratio. The
// timer (ns/op, MB/s) covers the engine alone: the ceilings run with it
// stopped.

func benchDir(b *testing.B) string {
	base := os.Getenv("KVHOST_BENCH_DIR")
	if base == "" {
		base = os.TempDir()
	}
	d, err := os.MkdirTemp(base, "kvhost-bench-")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { os.RemoveAll(d) })
	return d
}

func llama8B() Geometry {
	return Geometry{Model: "meta-llama/Llama-3.1-8B", Layers: 32, KVHeads: 8, HeadSize: 128, DtypeSize: 2, TokensPerBlock: 16, TokensPerKey: 256, TPSize: 1}
}

// benchKeys is the keys per iteration: 8 (256 MiB of KV cache), or
// KVHOST_BENCH_KEYS, so that a machine with many I/O workers can keep them
// all busy.
var benchKeys = func() int {
	if n, err := strconv.Atoi(os.Getenv("KVHOST_BENCH_KEYS")); err == nil && n > 0 {
		return n
	}
	return 8
}()

type benchEnv struct {
	e  *Engine
	ns NamespaceID
	c  *testCache
	ceilingEnv
}

// ceilingEnv is what the ceilings of an engine's benchmark need.
type ceilingEnv struct {
	dir     string
	direct  bool
	workers int
	keys    int // files per batch
	keyLen  int64
	bufs    []byte // the ceiling's contiguous memfd buffer, a slice per file
	same    []byte // the same size at the start of the cache's region
}

func newBenchEnv(b *testing.B, noDirect, noChecksum bool) *benchEnv {
	dir := benchDir(b)
	workers := max(2, runtime.GOMAXPROCS(0))
	pol := newTestPolicy(1, abi.OrderLayerMajor)
	e, err := testOpen(context.Background(), Config{
		Mounts: []Mount{{Path: filepath.Join(dir, "engine"), NoDirect: noDirect}}, Policy: pol,
		IOWorkers: workers, NoChecksum: noChecksum, Logger: testLogger(b),
	})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { e.Close(context.Background()) })
	g := llama8B()
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		b.Fatal(err)
	}
	// Twice the blocks a batch needs: stores read one half, loads write
	// the other.
	c := newTestCache(b, e, ns, g, 2*benchKeys*g.BlocksPerKey(), layoutPlaneFirst)
	all := make([]int, 2*benchKeys*g.BlocksPerKey())
	for i := range all {
		all[i] = i
	}
	c.fill(rand.New(rand.NewPCG(1, 1)), all)
	return &benchEnv{e: e, ns: ns, c: c, ceilingEnv: newCeilingEnv(b, dir, e, c, workers, benchKeys, g.KeyBytes())}
}

// newCeilingEnv makes the ceilings of keys files of keyLen bytes for the
// engine e with cache c, in dir/ceiling.
func newCeilingEnv(b *testing.B, dir string, e *Engine, c *testCache, workers, keys int, keyLen int64) ceilingEnv {
	env := ceilingEnv{dir: filepath.Join(dir, "ceiling"), direct: e.Stats().Mounts[0].Direct, workers: workers, keys: keys, keyLen: keyLen}
	os.MkdirAll(env.dir, 0o755)
	// The ceiling moves the same bytes as the engine between the files and
	// one contiguous buffer of benchKeys keys (each file its own slice, so
	// that neither side gains from a buffer that stays in the CPU cache),
	// in a fresh memfd, the kind of memory the engine's cache lives in.
	// The region ceiling does the same with the first bytes of the cache's
	// own memfd: with O_DIRECT the block layer builds requests from the
	// physical pages of the memory (max_segments), so two memfds of one
	// size can differ; this one has the engine's pages.
	reg, err := region.NewHost("ceiling", int64(keys)*keyLen)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { reg.Close() })
	env.bufs = reg.Bytes()
	for i := range env.bufs {
		env.bufs[i] = byte(i * 7)
	}
	env.same = c.reg.Bytes()[:int64(keys)*keyLen]
	return env
}

// batch returns benchKeys keys with scattered blocks from one half of the cache.
func (env *benchEnv) batch(r *rand.Rand, prefix string, half int) ([][]byte, [][]int) {
	bpk := env.c.geo.BlocksPerKey()
	perm := r.Perm(benchKeys * bpk)
	keys := testKeys(prefix, benchKeys)
	blocks := make([][]int, benchKeys)
	for i := range blocks {
		for j := range bpk {
			blocks[i] = append(blocks[i], half*benchKeys*bpk+perm[i*bpk+j])
		}
	}
	return keys, blocks
}

// ceiling writes (or reads) env.keys files of keyLen bytes with the
// workers' threads in system calls of up to 8 MiB, and returns the time it
// took.
func (env *ceilingEnv) ceiling(b *testing.B, write bool, iter int) time.Duration {
	return env.ceilingWith(b, write, iter, env.bufs)
}

func (env *ceilingEnv) ceilingWith(b *testing.B, write bool, iter int, mem []byte) time.Duration {
	const io = 8 << 20
	flag := os.O_RDONLY
	if write {
		flag = os.O_WRONLY | os.O_CREATE | os.O_TRUNC
	}
	if env.direct {
		flag |= unix.O_DIRECT
	}
	start := time.Now()
	var wg sync.WaitGroup
	next := make(chan int, env.keys)
	for i := range env.keys {
		next <- i
	}
	close(next)
	for range env.workers {
		wg.Go(func() {
			for i := range next {
				buf := mem[int64(i)*env.keyLen : int64(i+1)*env.keyLen]
				name := filepath.Join(env.dir, fmt.Sprintf("f-%d-%d", iter, i))
				f, err := fsys.OS{}.OpenFile(name, flag, 0o644)
				if err != nil {
					b.Error(err)
					return
				}
				for off := int64(0); off < env.keyLen; off += io {
					end := min(off+io, env.keyLen)
					var err error
					if write {
						_, err = f.WriteAt(buf[off:end], off)
					} else {
						_, err = f.ReadAt(buf[off:end], off)
					}
					if err != nil {
						b.Error(err)
					}
				}
				f.Close()
			}
		})
	}
	wg.Wait()
	return time.Since(start)
}

// removeFiles removes the files of the ceiling's iteration iter.
func (env *ceilingEnv) removeFiles(iter int) {
	for k := range env.keys {
		os.Remove(filepath.Join(env.dir, fmt.Sprintf("f-%d-%d", iter, k)))
	}
}

func (env *ceilingEnv) report(b *testing.B, engine, ceiling, same time.Duration) {
	moved := float64(b.N) * float64(env.keys) * float64(env.keyLen)
	eg, cg := moved/engine.Seconds()/1e9, moved/ceiling.Seconds()/1e9
	b.ReportMetric(eg, "engine-GB/s")
	b.ReportMetric(cg, "ceiling-GB/s")
	b.ReportMetric(moved/same.Seconds()/1e9, "region-ceiling-GB/s")
	b.ReportMetric(same.Seconds()/engine.Seconds(), "engine/region-ceiling")
	b.ReportMetric(eg/cg, "engine/ceiling")
	b.ReportMetric(0, "ns/op")
}

func benchModes(b *testing.B, fn func(b *testing.B, noDirect, noChecksum bool)) {
	for _, m := range []struct {
		name               string
		noDirect, noChksum bool
	}{{"io=auto/crc=on", false, false}, {"io=auto/crc=off", false, true}, {"io=buffered/crc=on", true, false}} {
		b.Run(m.name, func(b *testing.B) { fn(b, m.noDirect, m.noChksum) })
	}
}

// Full-cache benchmarks: the engine on a mount whose capacity holds
// fullBatches batches, filled before the timer starts, so that every store
// evicts (a batch's worth of files, kept as spares on tmpfs) and every load
// finds its files among a full index. A batch is the bytes of benchKeys
// keys of 32 MiB, in keys of 2 MiB (Llama-3.1-8B bf16, 16 tokens per key)
// or 32 MiB (256 tokens per key). The ceilings are their siblings', in
// files of the key size: they pay no eviction, which is what the fraction
// shows.
const fullBatches = 4

// fullSizes are the key sizes of the full-cache benchmarks: their names
// and tokens per key of llama8B.
var fullSizes = []struct {
	name   string
	tokens int
}{{"2MiB-full", 16}, {"32MiB-full", 256}}

// fullEnv is an engine whose mount is full of keys of one size.
type fullEnv struct {
	e     *Engine
	ns    NamespaceID
	c     *testCache
	keys  int // keys per batch
	bpk   int // blocks per key
	batch int64
	n     int // batches stored so far
	ceilingEnv
}

func newFullEnv(b *testing.B, tokens int) *fullEnv {
	base := benchDir(b)
	dir := filepath.Join(base, "engine")
	g := llama8B()
	g.TokensPerKey = tokens
	keys := benchKeys * 256 / tokens
	// The capacity in files: a key's file is its payload and a header
	// page or two.
	fileLen := g.KeyBytes() + 8<<10
	ctx := context.Background()
	workers := max(2, runtime.GOMAXPROCS(0))
	e, err := testOpen(ctx, Config{
		Mounts:    []Mount{{Path: dir, Capacity: fullBatches * int64(keys) * fileLen}},
		Policy:    newTestPolicy(1, abi.OrderLayerMajor),
		IOWorkers: workers, Logger: testLogger(b),
	})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { e.Close(context.Background()) })
	ns, err := e.Declare(ctx, g)
	if err != nil {
		b.Fatal(err)
	}
	bpk := g.BlocksPerKey()
	c := newTestCache(b, e, ns, g, 2*keys*bpk, layoutPlaneFirst)
	all := make([]int, 2*keys*bpk)
	for i := range all {
		all[i] = i
	}
	c.fill(rand.New(rand.NewPCG(1, 1)), all)
	env := &fullEnv{e: e, ns: ns, c: c, keys: keys, bpk: bpk, batch: int64(keys) * g.KeyBytes(), ceilingEnv: newCeilingEnv(b, base, e, c, workers, keys, g.KeyBytes())}
	for range fullBatches + 1 {
		env.store(b)
	}
	if st := e.Stats(); st.Evictions == 0 {
		b.Fatalf("the cache is not full: %+v", st.Mounts[0])
	}
	return env
}

// blocks returns the blocks of a batch in one half of the cache.
func (env *fullEnv) blocks(half int) [][]int {
	blocks := make([][]int, env.keys)
	for i := range blocks {
		for j := range env.bpk {
			blocks[i] = append(blocks[i], (half*env.keys+i)*env.bpk+j)
		}
	}
	return blocks
}

// store stores the next batch of new keys from the first half of the
// cache and returns its keys.
func (env *fullEnv) store(b *testing.B) [][]byte {
	keys := testKeys(fmt.Sprintf("full%d-", env.n), env.keys)
	env.n++
	res := wait(b)(env.e.Store(context.Background(), StoreRequest{Cache: env.c.id, Keys: keys, Blocks: env.blocks(0)}))
	if res.Count(OutcomeStored) != env.keys {
		b.Fatalf("store: %v", res.Err())
	}
	return keys
}

func benchStoreFull(b *testing.B, tokens int) {
	env := newFullEnv(b, tokens)
	b.SetBytes(env.batch)
	evicted := env.e.Stats().Evictions
	var eng, ceil, same time.Duration
	for i := 0; b.Loop(); i++ {
		b.StopTimer()
		e, c, sm := env.timedStore(b, i, func() { env.store(b) })
		eng, ceil, same = eng+e, ceil+c, same+sm
		env.removeFiles(i)
		b.StartTimer()
	}
	b.ReportMetric(float64(env.e.Stats().Evictions-evicted)/float64(b.N), "evictions/op")
	env.report(b, eng, ceil, same)
}

func benchLoadFull(b *testing.B, tokens int) {
	env := newFullEnv(b, tokens)
	b.SetBytes(env.batch)
	keys := env.store(b) // the newest: never evicted
	from, into := env.blocks(0), env.blocks(1)
	env.ceiling(b, true, 0)
	var eng, ceil, same time.Duration
	for i := 0; b.Loop(); i++ {
		b.StopTimer()
		le, lc, ls := env.timedLoad(b, i, env.e, env.c, keys, from, into)
		eng, ceil, same = eng+le, ceil+lc, same+ls
		b.StartTimer()
	}
	env.report(b, eng, ceil, same)
}

// timedLoad is iteration i of a load benchmark, called with b's timer
// stopped and returning with it stopped: the file ceiling (before the
// load or after it, alternately) and the region ceiling untimed, and the
// load of keys from e into c's blocks into timed. Every key must load, and
// on iteration 0 (before the region ceiling overwrites the cache) hold
// the bytes of the blocks from. It returns the load's time and the
// ceilings'.
// timedStore times store, the engine's store of round i, and the write
// ceiling right before or right after it (alternating by round, as
// timedLoad does), then the write ceiling from the engine's own kind of
// memory (same), removing the ceiling's files between the two. The caller
// has stopped b's timer, and it is stopped on return.
func (env *ceilingEnv) timedStore(b *testing.B, i int, store func()) (eng, ceil, same time.Duration) {
	if i%2 == 0 { // alternate who goes first
		ceil += env.ceiling(b, true, i)
	}
	b.StartTimer()
	start := time.Now()
	store()
	eng = time.Since(start)
	b.StopTimer()
	if i%2 == 1 {
		ceil += env.ceiling(b, true, i)
	}
	env.removeFiles(i)
	same = env.ceilingWith(b, true, i, env.same)
	return eng, ceil, same
}

func (env *ceilingEnv) timedLoad(b *testing.B, i int, e *Engine, c *testCache, keys [][]byte, from, into [][]int) (eng, ceil, same time.Duration) {
	if i%2 == 0 { // alternate who goes first
		ceil += env.ceiling(b, false, 0)
	}
	b.StartTimer()
	start := time.Now()
	res := wait(b)(e.Load(context.Background(), LoadRequest{Cache: c.id, Keys: keys, Blocks: into}))
	eng = time.Since(start)
	b.StopTimer()
	if n := res.Count(OutcomeLoaded); n != len(keys) {
		b.Fatalf("load: %d of %d keys loaded: %v", n, len(keys), res.Err())
	}
	if i == 0 {
		verifyLoad(b, c, from, into)
	}
	if i%2 == 1 {
		ceil += env.ceiling(b, false, 0)
	}
	same = env.ceilingWith(b, false, 0, env.same)
	return eng, ceil, same
}

// verifyLoad fails b unless the blocks of each key in into hold the bytes
// of its blocks in from, which it was stored from.
func verifyLoad(b *testing.B, c *testCache, from, into [][]int) {
	b.Helper()
	for k := range into {
		if !bytes.Equal(c.data(into[k]), c.data(from[k])) {
			b.Fatalf("key %d: loaded bytes differ", k)
		}
	}
}

// BenchmarkStore: the engine's store of 32 MiB keys against a plain write,
// and stores into a full cache (2MiB-full, 32MiB-full).
func BenchmarkStore(b *testing.B) {
	for _, sz := range fullSizes {
		b.Run(sz.name, func(b *testing.B) { benchStoreFull(b, sz.tokens) })
	}
	benchModes(b, func(b *testing.B, noDirect, noChecksum bool) {
		env := newBenchEnv(b, noDirect, noChecksum)
		b.SetBytes(int64(benchKeys) * env.keyLen)
		ctx := context.Background()
		r := rand.New(rand.NewPCG(2, 2))
		var eng, ceil, same time.Duration
		for i := 0; b.Loop(); i++ {
			keys, blocks := env.batch(r, fmt.Sprintf("s%d", i), 0)
			b.StopTimer()
			var res Result
			e, c, sm := env.timedStore(b, i, func() {
				res = wait(b)(env.e.Store(ctx, StoreRequest{Cache: env.c.id, Keys: keys, Blocks: blocks}))
			})
			eng, ceil, same = eng+e, ceil+c, same+sm
			if res.Count(OutcomeStored) != benchKeys {
				b.Fatalf("store: %+v", res)
			}
			env.e.Delete(ctx, env.ns, keys)
			env.removeFiles(i)
			b.StartTimer()
		}
		b.Logf("O_DIRECT %v, %d workers", env.direct, env.workers)
		env.report(b, eng, ceil, same)
	})
}

// BenchmarkLoad: the engine's load of 32 MiB keys against a plain read,
// and loads from a full cache (2MiB-full, 32MiB-full).
func BenchmarkLoad(b *testing.B) {
	for _, sz := range fullSizes {
		b.Run(sz.name, func(b *testing.B) { benchLoadFull(b, sz.tokens) })
	}
	benchModes(b, func(b *testing.B, noDirect, noChecksum bool) {
		env := newBenchEnv(b, noDirect, noChecksum)
		b.SetBytes(int64(benchKeys) * env.keyLen)
		ctx := context.Background()
		r := rand.New(rand.NewPCG(3, 3))
		keys, blocks := env.batch(r, "l", 0)
		res := wait(b)(env.e.Store(ctx, StoreRequest{Cache: env.c.id, Keys: keys, Blocks: blocks}))
		if res.Count(OutcomeStored) != benchKeys {
			b.Fatalf("store: %+v", res)
		}
		env.ceiling(b, true, 0)
		var eng, ceil, same time.Duration
		for i := 0; b.Loop(); i++ {
			_, into := env.batch(r, "l", 1)
			b.StopTimer()
			le, lc, ls := env.timedLoad(b, i, env.e, env.c, keys, blocks, into)
			eng, ceil, same = eng+le, ceil+lc, same+ls
			b.StartTimer()
		}
		b.Logf("O_DIRECT %v, %d workers", env.direct, env.workers)
		env.report(b, eng, ceil, same)
	})
}

// BenchmarkRebuild measures Open's index rebuild over 100,000 small files
// (created once per run, by the engine, outside the timer).
func BenchmarkRebuild(b *testing.B) {
	const files = 100_000
	dir := benchDir(b)
	g := Geometry{Model: "tiny", Layers: 1, KVHeads: 1, HeadSize: 16, DtypeSize: 2, TokensPerBlock: 16, TokensPerKey: 16, TPSize: 1}
	ctx := context.Background()
	cfg := Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, abi.OrderLayerMajor), Logger: testLogger(b)}
	e, err := testOpen(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	ns, _ := e.Declare(ctx, g)
	c := newTestCache(b, e, ns, g, 1024, layoutPlaneFirst)
	created := time.Now()
	var jobs []*Job
	for start := 0; start < files; start += 1024 {
		n := min(1024, files-start)
		keys := testKeys(fmt.Sprintf("r%d", start), n)
		blocks := make([][]int, n)
		for i := range blocks {
			blocks[i] = []int{i}
		}
		j, err := e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys, Blocks: blocks})
		if err != nil {
			b.Fatal(err)
		}
		jobs = append(jobs, j)
		if len(jobs) == 4 {
			waitJob(b, jobs[0], nil)
			jobs = jobs[1:]
		}
	}
	for _, j := range jobs {
		waitJob(b, j, nil)
	}
	e.Close(ctx)
	b.Logf("created %d files in %v", files, time.Since(created))
	for b.Loop() {
		cfg.Policy = newTestPolicy(1, abi.OrderLayerMajor)
		e, err := testOpen(ctx, cfg)
		if err != nil {
			b.Fatal(err)
		}
		if st := e.Stats(); st.Entries != files {
			b.Fatalf("rebuilt %d entries, want %d", st.Entries, files)
		}
		e.Close(ctx)
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/files, "ns/file")
}
