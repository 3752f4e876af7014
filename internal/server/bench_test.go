package server_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/internal/testsock"
)

// lookupTarget is the target for a 32-key lookup round trip with
// one client, at the 99th percentile.
const lookupTarget = 100 * time.Microsecond

// benchLatency runs op b.N times on each of clients connections at once and
// reports the p50 and p99 of one round trip, and p99 as a fraction of
// target (≤ 1 meets it).
func benchLatency(b *testing.B, clients int, target time.Duration, setup func(b *testing.B, c *client.Client) func(i int) error) {
	f := newFixture(b, server.Config{})
	ops := make([]func(int) error, clients)
	for i := range ops {
		ops[i] = setup(b, f.dial(b))
	}
	measure(b, clients, target, func(ci, i int) error { return ops[ci](i) })
}

// measure runs op(client, i) for i < b.N on each client at once and
// reports the latency percentiles.
func measure(b *testing.B, clients int, target time.Duration, op func(ci, i int) error) {
	lat := make([][]time.Duration, clients)
	b.ResetTimer()
	var wg sync.WaitGroup
	for ci := 0; ci < clients; ci++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l := make([]time.Duration, 0, b.N)
			for i := 0; i < b.N; i++ {
				t0 := time.Now()
				if err := op(ci, i); err != nil {
					b.Error(err)
					return
				}
				l = append(l, time.Since(t0))
			}
			lat[ci] = l
		}()
	}
	wg.Wait()
	b.StopTimer()
	all := slices.Concat(lat...)
	if len(all) == 0 {
		return
	}
	slices.Sort(all)
	b.ReportMetric(micros(percentile(all, 0.50)), "p50-µs")
	b.ReportMetric(micros(percentile(all, 0.99)), "p99-µs")
	if target > 0 {
		b.ReportMetric(float64(percentile(all, 0.99))/float64(target), "p99/target")
	}
}

// percentile returns the q quantile of sorted latencies s.
func percentile(s []time.Duration, q float64) time.Duration {
	return s[min(len(s)-1, int(q*float64(len(s))))]
}

// heldAll says what is wrong with p, a pin of stored keys that a cache
// could load, unless it holds every key.
func heldAll(p client.Pin) error {
	if p.ID == 0 || p.NoCache || slices.Contains(p.Held, false) {
		return fmt.Errorf("pin = %+v; want every key held", p)
	}
	return nil
}

// micros is d in microseconds, for a benchmark's metric.
func micros(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }

// BenchmarkLookup32 is the round trip of a 32-key lookup whose keys are all
// stored. Target (one client): p99 < 100 µs.
func BenchmarkLookup32(b *testing.B) {
	for _, clients := range []int{1, 8} {
		b.Run(fmt.Sprintf("clients=%d", clients), func(b *testing.B) {
			target := time.Duration(0)
			if clients == 1 {
				target = lookupTarget
			}
			benchLatency(b, clients, target, func(b *testing.B, c *client.Client) func(int) error {
				k := newCache(b, c)
				keys := make([][]byte, 32)
				blocks := make([][]uint32, 32)
				for i := range keys {
					keys[i] = fmt.Appendf(nil, "lookup-key-%02d", i)
					blocks[i] = []uint32{0, 1}
				}
				job, err := c.Store(context.Background(), k.id, keys, blocks)
				if err != nil {
					b.Fatal(err)
				}
				if _, err := job.Wait(context.Background()); err != nil {
					b.Fatal(err)
				}
				ctx := context.Background()
				return func(int) error {
					n, err := c.Lookup(ctx, k.ns.ID, keys)
					if err == nil && n != len(keys) {
						err = fmt.Errorf("lookup found %d of %d keys", n, len(keys))
					}
					return err
				}
			})
		})
	}
}

// BenchmarkStoreJob is the round trip of a store job of one new 1 KiB key,
// from request to completion event.
func BenchmarkStoreJob(b *testing.B) {
	for _, clients := range []int{1, 8} {
		b.Run(fmt.Sprintf("clients=%d", clients), func(b *testing.B) {
			var next sync.Mutex
			id := 0
			benchLatency(b, clients, 0, func(b *testing.B, c *client.Client) func(int) error {
				k := newCache(b, c)
				k.bytesOf([]uint32{0, 1}, rand.New(rand.NewPCG(1, 1)))
				next.Lock()
				id++
				prefix := fmt.Sprintf("store-%d-%d", id, time.Now().UnixNano())
				next.Unlock()
				ctx := context.Background()
				return func(i int) error {
					job, err := c.Store(ctx, k.id, [][]byte{fmt.Appendf(nil, "%s-%d", prefix, i)}, [][]uint32{{0, 1}})
					if err != nil {
						return err
					}
					res, err := job.Wait(ctx)
					if err == nil && res.Keys[0].Outcome != client.OutcomeStored {
						err = fmt.Errorf("outcome %v: %s", res.Keys[0].Outcome, res.Message)
					}
					return err
				}
			})
		})
	}
}

// stubEngine answers lookups at once: it isolates the protocol path
// (client, socket, session, dispatch) from the engine's work.
type stubEngine struct{ server.Engine }

func (stubEngine) Declare(context.Context, engine.Geometry) (engine.NamespaceID, error) {
	return 1, nil
}

func (stubEngine) Release(engine.NamespaceID) error { return nil }

func (stubEngine) Fingerprint(engine.NamespaceID) (uint64, error) { return 0, nil }

func (stubEngine) Lookup(_ context.Context, _ engine.NamespaceID, keys [][]byte) (int, error) {
	return len(keys), nil
}

// BenchmarkLookup32Protocol is BenchmarkLookup32 against stubEngine: the
// cost of the protocol round trip alone.
func BenchmarkLookup32Protocol(b *testing.B) {
	for _, clients := range []int{1, 8} {
		b.Run(fmt.Sprintf("clients=%d", clients), func(b *testing.B) {
			base := testsock.Dir(b)
			srv, err := server.New(stubEngine{}, server.Config{Logger: quiet()})
			if err != nil {
				b.Fatal(err)
			}
			sock, err := server.Listen(filepath.Join(base, "s.sock"), 0o600, "")
			if err != nil {
				b.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { srv.Serve(ctx, sock.UnixListener); close(done) }()
			defer func() { cancel(); <-done; sock.Close() }()
			cs := make([]*client.Client, clients)
			for i := range cs {
				if cs[i], err = client.Dial(ctx, sock.Path(), "bench"); err != nil {
					b.Fatal(err)
				}
				defer cs[i].Close()
			}
			nss := make([]client.NamespaceID, clients)
			for i, c := range cs {
				ns, err := c.Declare(ctx, geo)
				if err != nil {
					b.Fatal(err)
				}
				nss[i] = ns.ID
			}
			keys := make([][]byte, 32)
			for i := range keys {
				keys[i] = fmt.Appendf(nil, "lookup-key-%02d", i)
			}
			target := time.Duration(0)
			if clients == 1 {
				target = lookupTarget
			}
			measure(b, clients, target, func(ci, _ int) error {
				_, err := cs[ci].Lookup(ctx, nss[ci], keys)
				return err
			})
		})
	}
}

// BenchmarkLookup16BesideLoads is the round trip of a 16-key lookup of
// stored keys, first alone and then while another client keeps four load
// jobs in flight, in the same run. It reports the p50 and p99 of each and,
// as the fraction, the p99 alone over the p99 beside loads: 1 means a
// lookup never waits behind the data path (the ceiling is the lookup
// alone).
func BenchmarkLookup16BesideLoads(b *testing.B) {
	benchBesideLoads(b, func(ctx context.Context, k *cache, keys [][]byte) (uint64, error) {
		n, err := k.c.Lookup(ctx, k.ns.ID, keys)
		if err == nil && n != len(keys) {
			err = fmt.Errorf("lookup: %d of %d", n, len(keys))
		}
		return 0, err
	})
}

// BenchmarkPinLoadable16BesideLoads is BenchmarkLookup16BesideLoads for
// the spec manager's pin, a PinLoadable of the 16 keys (released, untimed,
// after each), which stats every key's file where a lookup trusts a
// recent check.
func BenchmarkPinLoadable16BesideLoads(b *testing.B) {
	benchBesideLoads(b, func(ctx context.Context, k *cache, keys [][]byte) (uint64, error) {
		p, err := k.c.PinLoadable(ctx, k.ns.ID, keys, 0, "")
		if err == nil {
			err = heldAll(p)
		}
		return p.ID, err
	})
}

// benchBesideLoads times op, a round trip over 16 stored keys of its
// cache, b.N times alone and b.N times beside four load jobs kept in
// flight by another client, and reports the two latencies and their
// ratio (see BenchmarkLookup16BesideLoads). The pin op returns (0: none)
// is released after it, untimed.
func benchBesideLoads(b *testing.B, op func(ctx context.Context, k *cache, keys [][]byte) (pin uint64, err error)) {
	f := newFixture(b, server.Config{})
	ctx := context.Background()
	stored := func(k *cache, prefix string) [][]byte {
		keys := make([][]byte, 16)
		blocks := make([][]uint32, 16)
		for i := range keys {
			keys[i] = fmt.Appendf(nil, "%s-%02d", prefix, i)
			blocks[i] = []uint32{uint32(2 * i), uint32(2*i + 1)}
		}
		job, err := k.c.Store(ctx, k.id, keys, blocks)
		if err != nil {
			b.Fatal(err)
		}
		if res, err := job.Wait(ctx); err != nil || res.Keys[0].Outcome != client.OutcomeStored {
			b.Fatalf("store: %v %+v", err, res)
		}
		return keys
	}
	lk := newCache(b, f.dial(b))
	keys := stored(lk, "lookup")
	ld := newCache(b, f.dial(b))
	loadKeys := stored(ld, "load")
	loadBlocks := make([][]uint32, len(loadKeys))
	for i := range loadBlocks {
		loadBlocks[i] = []uint32{uint32(2 * i), uint32(2*i + 1)}
	}
	lookups := func() []time.Duration {
		l := make([]time.Duration, 0, b.N)
		for range b.N {
			t0 := time.Now()
			pin, err := op(ctx, lk, keys)
			if err != nil {
				b.Fatal(err)
			}
			l = append(l, time.Since(t0))
			if pin != 0 {
				if _, err := lk.c.Unpin(ctx, pin); err != nil {
					b.Fatal(err)
				}
			}
		}
		slices.Sort(l)
		return l
	}
	b.ResetTimer()
	alone := lookups()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var loads sync.Map
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n := 0
			for {
				select {
				case <-stop:
					loads.Store(w, n)
					return
				default:
				}
				job, err := ld.c.Load(ctx, ld.id, loadKeys, loadBlocks)
				if err == nil {
					_, err = job.Wait(ctx)
				}
				if err != nil {
					b.Error(err)
					loads.Store(w, n)
					return
				}
				n++
			}
		}()
	}
	beside := lookups()
	close(stop)
	wg.Wait()
	b.StopTimer()
	jobs := 0
	loads.Range(func(_, v any) bool { jobs += v.(int); return true })
	if jobs == 0 {
		b.Fatal("no load ran beside the lookups")
	}
	b.ReportMetric(micros(percentile(alone, 0.5)), "alone-p50-µs")
	b.ReportMetric(micros(percentile(alone, 0.99)), "alone-p99-µs")
	b.ReportMetric(micros(percentile(beside, 0.5)), "beside-p50-µs")
	b.ReportMetric(micros(percentile(beside, 0.99)), "beside-p99-µs")
	b.ReportMetric(float64(percentile(alone, 0.99))/float64(percentile(beside, 0.99)), "of-ceiling")
	b.ReportMetric(float64(jobs)/float64(b.N), "loads/lookup")
}

// BenchmarkPinLoadable16 is the round trip of the manager's lookup pin: a
// PinLoadable of 16 stored keys, whose answer asks the server's namespace
// lock whether a worker of the group has a cache registered. Its ceiling,
// in the same run, is a plain Pin of the same keys: each client alternates
// the two (every pin released, untimed, before the next), so both see the
// same contention. It reports the p50 and p99 of each and, as the
// fraction, the Pin's p99 over the PinLoadable's (1: the lock costs
// nothing a client can see).
func BenchmarkPinLoadable16(b *testing.B) {
	for _, clients := range []int{1, 16} {
		b.Run(fmt.Sprintf("clients=%d", clients), func(b *testing.B) {
			f := newFixture(b, server.Config{})
			ctx := context.Background()
			worker := f.dial(b)
			if err := worker.JoinGroup(ctx, "engine"); err != nil {
				b.Fatal(err)
			}
			k := newCache(b, worker)
			keys := make([][]byte, 16)
			for i := range keys {
				keys[i] = fmt.Appendf(nil, "pin-%02d", i)
				k.store(b, string(keys[i]), []uint32{uint32(2 * i), uint32(2*i + 1)}, nil)
			}
			scheds := make([]*client.Client, clients)
			nss := make([]client.NamespaceID, clients)
			for i := range scheds {
				scheds[i] = f.dial(b)
				ns, err := scheds[i].Declare(ctx, geo)
				if err != nil {
					b.Fatal(err)
				}
				nss[i] = ns.ID
			}
			pin := func(ci int, loadable bool) (time.Duration, error) {
				c := scheds[ci]
				t0 := time.Now()
				var p client.Pin
				var err error
				if loadable {
					p, err = c.PinLoadable(ctx, nss[ci], keys, 0, "engine")
				} else {
					p, err = c.Pin(ctx, nss[ci], keys, 0)
				}
				d := time.Since(t0)
				if err == nil {
					err = heldAll(p)
				}
				if err == nil {
					_, err = c.Unpin(ctx, p.ID)
				}
				return d, err
			}
			plain := make([][]time.Duration, clients)
			loadable := make([][]time.Duration, clients)
			b.ResetTimer()
			var wg sync.WaitGroup
			for ci := range scheds {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for range b.N {
						for _, l := range []bool{false, true} {
							d, err := pin(ci, l)
							if err != nil {
								b.Error(err)
								return
							}
							if l {
								loadable[ci] = append(loadable[ci], d)
							} else {
								plain[ci] = append(plain[ci], d)
							}
						}
					}
				}()
			}
			wg.Wait()
			b.StopTimer()
			p, l := slices.Concat(plain...), slices.Concat(loadable...)
			if len(p) == 0 || len(l) == 0 {
				return
			}
			slices.Sort(p)
			slices.Sort(l)
			b.ReportMetric(micros(percentile(p, 0.5)), "pin-p50-µs")
			b.ReportMetric(micros(percentile(p, 0.99)), "pin-p99-µs")
			b.ReportMetric(micros(percentile(l, 0.5)), "loadable-p50-µs")
			b.ReportMetric(micros(percentile(l, 0.99)), "loadable-p99-µs")
			b.ReportMetric(float64(percentile(p, 0.99))/float64(percentile(l, 0.99)), "of-ceiling")
		})
	}
}
