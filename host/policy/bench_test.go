package policy_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/host/policy/policytest"
	"github.com/kvhost/kvhost/plugins"
	"github.com/kvhost/kvhost/plugins/tiered"
)

// Ceilings of the policy boundary on the 2-core CI machine (issue 2).
const (
	ceilingNsPerKey = 300                    // per key at batch 256
	ceilingStart    = 100 * time.Millisecond // policy ready, compilation cache warm
)

// benchEntries is the number of entries the benchmark's index holds.
const benchEntries = 1 << 16

// benchHost opens a policy with one shard, so that a batch is one call,
// and fills it with benchEntries entries: "wat" the hand-written WAT
// fixture (the bare crossing: the host's work and a minimal guest), "c"
// the C SDK example (examples/c-policy/policy.wasm), "native" the lru
// policy run natively (plugins/lru), "wasm" the built-in lru module, and
// "wasm-NAME" the built-in module NAME.
func benchHost(b *testing.B, kind string) policy.Policy {
	b.Helper()
	ctx := context.Background()
	idx := policytest.NewIndex()
	cfg := policy.Config{Shards: 1, Logger: quietLogger()}
	var h *policy.Host
	var err error
	switch {
	case kind == "wat":
		h, err = policy.Open(ctx, fixture(b, "wellbehaved"), "wellbehaved", idx, cfg)
	case kind == "c":
		mod, rerr := os.ReadFile(filepath.Join("..", "..", "examples", "c-policy", "policy.wasm"))
		if rerr != nil {
			b.Fatalf("%v (build it with `make wasm`)", rerr)
		}
		h, err = policy.Open(ctx, mod, "c-policy", idx, cfg)
	case kind == "wasm" || strings.HasPrefix(kind, "wasm-"):
		name := strings.TrimPrefix(strings.TrimPrefix(kind, "wasm"), "-")
		if name == "" {
			name = "lru"
		}
		mod, werr := plugins.Wasm(name)
		if werr != nil {
			b.Fatalf("%v (build the plugins with `make wasm`)", werr)
		}
		cfg.Cache = builtinCache()
		h, err = policy.Open(ctx, mod, name, idx, cfg)
	default:
		h, err = policy.NewNative(newLRU, idx, cfg)
	}
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { h.Close(ctx) })
	ns, err := h.Namespace(ctx, testNS)
	if err != nil {
		b.Fatal(err)
	}
	idx.AddNamespace(ns)
	recs := make([]abi.AccessRecord, 0, abi.MaxBatch)
	for id := uint64(1); id <= benchEntries; id++ {
		recs = append(recs, abi.AccessRecord{Entry: id, Time: id, Size: 1 << 20, KeyHash: id * 0x9E3779B97F4A7C15, Kind: abi.AccessInsert})
		if len(recs) == cap(recs) || id == benchEntries {
			idx.Apply(recs)
			if err := h.Access(ctx, recs); err != nil {
				b.Fatal(err)
			}
			recs = recs[:0]
		}
	}
	return h
}

// benchHit returns the record of the hit that follows k hits on a host of
// benchHost: a hit on its least recently used entry, at a time later than
// any before, so that every hit moves an entry from the front of the
// policy's list to the back, in every repeat of a benchmark on one host.
func benchHit(k uint64) abi.AccessRecord {
	return abi.AccessRecord{Entry: k%benchEntries + 1, Time: benchEntries + 1 + k, Size: 1 << 20, Kind: abi.AccessHit}
}

// cpuTime returns the CPU time the process has used so far (user and
// system, every thread: the guest runs on the caller's, the host's
// garbage collection on others).
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkBoundary measures the per-key cost of batched calls through the
// policy boundary, in wall time (ns/key) and in the process's CPU time
// (cpu-ns/key): the bare crossing first (the WAT fixture: the host's work,
// a minimal guest), then the C SDK example (an LRU list in C), the lru
// policy natively, and every built-in module (Go compiled to wasm,
// metered by fuel). At batch 256 each reports the crossing's CPU time per
// key for the same hook, measured in this run (crossing-cpu-ns/key; by
// crossingCPU where a filter left the WAT fixture's out), its own above
// it (over-crossing), and its CPU time against the ceiling of 300 ns per
// key (of-ceiling). Hits move the least recently used entry to the back;
// victims are asked for on any mount; names are of fresh keys.
func BenchmarkBoundary(b *testing.B) {
	crossing := map[string]float64{} // the WAT fixture's cpu-ns/key at batch 256, by hook
	kinds := []string{"wat", "c", "native"}
	for _, name := range plugins.Names() {
		kinds = append(kinds, "wasm-"+name)
	}
	for _, kind := range kinds {
		h := benchHost(b, kind)
		var hits uint64 // hits so far on h, over every batch size and repeat (-count)
		for _, hook := range []string{"access", "victims", "name"} {
			for _, n := range []int{1, 32, 256} {
				b.Run(fmt.Sprintf("%s/%s/batch=%d", kind, hook, n), func(b *testing.B) {
					run := boundaryCall(h, hook, n, &hits)
					cpu0 := cpuTime(b)
					for b.Loop() {
						if err := run(); err != nil {
							b.Fatal(err)
						}
					}
					keys := float64(b.N * n)
					cpu := float64((cpuTime(b) - cpu0).Nanoseconds()) / keys
					b.ReportMetric(float64(b.Elapsed().Nanoseconds())/keys, "ns/key")
					b.ReportMetric(cpu, "cpu-ns/key")
					if n != 256 {
						return
					}
					if kind == "wat" {
						crossing[hook] = cpu
					} else {
						c, ok := crossing[hook]
						if !ok {
							c = crossingCPU(b, hook)
							crossing[hook] = c
						}
						b.ReportMetric(c, "crossing-cpu-ns/key")
						b.ReportMetric(cpu-c, "over-crossing")
					}
					b.ReportMetric(cpu/ceilingNsPerKey, "of-ceiling")
				})
			}
		}
	}
}

// boundaryCall returns one call of BenchmarkBoundary's hook on h with n
// keys; hits counts the hits made on h.
func boundaryCall(h policy.Policy, hook string, n int, hits *uint64) func() error {
	ctx := context.Background()
	switch hook {
	case "access":
		recs := make([]abi.AccessRecord, n)
		return func() error {
			for j := range recs {
				recs[j] = benchHit(*hits)
				*hits++
			}
			return h.Access(ctx, recs)
		}
	case "victims":
		req := abi.EvictRequest{Bytes: uint64(n) << 20, Mount: abi.AnyMount}
		return func() error {
			v, err := h.Victims(ctx, req, n)
			if err == nil && len(v) != n {
				err = fmt.Errorf("%d victims, want %d", len(v), n)
			}
			return err
		}
	default:
		recs := nameRecords(n, 0)
		return func() error { return h.Name(ctx, recs) }
	}
}

// crossingCPU measures the WAT fixture's CPU time per key for hook at
// batch 256 over a fixed 1,000 calls: the crossing, for a run of
// BenchmarkBoundary whose filter left the fixture's own out.
func crossingCPU(b *testing.B, hook string) float64 {
	const calls, n = 1000, 256
	var hits uint64
	run := boundaryCall(benchHost(b, "wat"), hook, n, &hits)
	cpu0 := cpuTime(b)
	for range calls {
		if err := run(); err != nil {
			b.Fatal(err)
		}
	}
	return float64((cpuTime(b) - cpu0).Nanoseconds()) / (calls * n)
}

// BenchmarkStartWarmCache measures Open of the lru plugin with a warm
// on-disk compilation cache: from module bytes to a policy ready for calls.
func BenchmarkStartWarmCache(b *testing.B) {
	ctx := context.Background()
	mod, err := plugins.Wasm("lru")
	if err != nil {
		b.Fatalf("%v (build the plugins with `make wasm`)", err)
	}
	// 4 shards is the daemon's default (config.Default).
	for _, shards := range []int{1, 4} {
		b.Run(fmt.Sprintf("shards=%d", shards), func(b *testing.B) {
			cfg := policy.Config{Shards: shards, CacheDir: b.TempDir(), Logger: quietLogger()}
			warm, err := policy.Open(ctx, mod, "lru", policytest.NewIndex(), cfg)
			if err != nil {
				b.Fatal(err)
			}
			warm.Close(ctx)
			for b.Loop() {
				h, err := policy.Open(ctx, mod, "lru", policytest.NewIndex(), cfg)
				if err != nil {
					b.Fatal(err)
				}
				h.Close(ctx)
			}
			per := b.Elapsed() / time.Duration(b.N)
			b.ReportMetric(float64(per.Microseconds())/1000, "ms/start")
			b.ReportMetric(float64(per)/float64(ceilingStart), "of-ceiling")
		})
	}
}

// BenchmarkRunaway measures how long an endless loop (the loop fixture)
// runs before its fuel stops it, as a multiple of the call deadline. Each
// Name call runs the loop twice (the call and its retry on a fresh
// instance). Ceiling: 3 deadlines per runaway call.
func BenchmarkRunaway(b *testing.B) {
	const timeout = 20 * time.Millisecond
	ctx := context.Background()
	h, err := policy.Open(ctx, fixture(b, "loop"), "loop", policytest.NewIndex(),
		policy.Config{Shards: 1, CallTimeout: timeout, MaxFailures: 1 << 30, Logger: quietLogger()})
	if err != nil {
		b.Fatal(err)
	}
	defer h.Close(ctx)
	recs := nameRecords(1, 0)
	for b.Loop() {
		if err := h.Name(ctx, recs); err == nil {
			b.Fatal("the endless loop returned")
		}
	}
	per := b.Elapsed() / time.Duration(2*b.N)
	b.ReportMetric(float64(per.Microseconds())/1000, "ms/runaway-call")
	b.ReportMetric(float64(per)/float64(timeout), "deadlines")
	b.ReportMetric(float64(per)/float64(3*timeout), "of-ceiling")
}

// BenchmarkHostCallRunaway measures how long a call that runs on in host
// functions (the hostcalls fixture, one kind of call per sub-benchmark)
// takes to run out of fuel, in deadlines of 10 ms: what the fuel each
// host call spends (hostParamFuel, hostCallFuel) amounts to in time. No
// ceiling.
func BenchmarkHostCallRunaway(b *testing.B) {
	const timeout = 10 * time.Millisecond
	ctx := context.Background()
	for _, which := range []string{"w", "e", "r", "p", "g", "o", "c", "l"} {
		b.Run(which, func(b *testing.B) {
			h, err := policy.Open(ctx, fixture(b, "hostcalls"), "hostcalls", policytest.NewIndex(), policy.Config{
				Shards: 1, CallTimeout: timeout, MaxFailures: 1 << 30,
				Params: map[string]string{"f": which}, Logger: quietLogger()})
			if err != nil {
				b.Fatal(err)
			}
			defer h.Close(ctx)
			recs := nameRecords(1, 0)
			for b.Loop() {
				if err := h.Name(ctx, recs); err == nil || !strings.Contains(err.Error(), "ran out of fuel") {
					b.Fatalf("Name: %v, want the call out of fuel", err)
				}
			}
			per := b.Elapsed() / time.Duration(2*b.N)
			b.ReportMetric(float64(per)/float64(timeout), "deadlines")
		})
	}
}

// BenchmarkFuelRate measures how fast plugin code spends fuel: units per
// nanosecond of call time, and units per key, for the built-in plugins,
// the WAT fixture and the C example, per hook at batch 256. It is what
// relates the fuel budget (2 units per nanosecond of the deadline) to
// time; no ceiling.
func BenchmarkFuelRate(b *testing.B) {
	ctx := context.Background()
	kinds := []string{"wat", "c"}
	for _, name := range plugins.Names() {
		kinds = append(kinds, "wasm-"+name)
	}
	for _, kind := range kinds {
		h := benchHost(b, kind).(*policy.Host)
		var hits uint64 // hits so far on h, over every repeat (-count)
		for _, hook := range []string{"access", "victims", "name"} {
			b.Run(kind+"/"+hook, func(b *testing.B) {
				const n = 256
				recs := make([]abi.AccessRecord, n)
				names := nameRecords(n, 0)
				read := policy.CountFuel(h)
				for b.Loop() {
					var err error
					switch hook {
					case "access":
						for j := range recs {
							recs[j] = benchHit(hits)
							hits++
						}
						err = h.Access(ctx, recs)
					case "victims":
						_, err = h.Victims(ctx, abi.EvictRequest{Bytes: n << 20, Mount: abi.AnyMount}, n)
					case "name":
						err = h.Name(ctx, names)
					}
					if err != nil {
						b.Fatal(err)
					}
				}
				fuel, ns := read()
				b.ReportMetric(float64(fuel)/float64(ns), "units/ns")
				b.ReportMetric(float64(fuel)/float64(b.N*n), "units/key")
			})
		}
	}
}

// ceilingTieringShare is the most the tiering extras (mount updates and
// ticks) may add to the access path: 1% (issue 11).
const ceilingTieringShare = 0.01

// tieringHost opens the tiered policy (wasm or native) with one shard,
// describes two mounts and fills it with benchEntries entries, alternately
// on the hot and the cold mount.
func tieringHost(b *testing.B, kind string) *policy.Host {
	b.Helper()
	ctx := context.Background()
	idx := policytest.NewIndex()
	cfg := policy.Config{Shards: 1, Logger: quietLogger()}
	var h *policy.Host
	var err error
	if kind == "wasm" {
		mod, werr := plugins.Wasm(tiered.Name)
		if werr != nil {
			b.Fatalf("%v (build the plugins with `make wasm`)", werr)
		}
		h, err = policy.Open(ctx, mod, tiered.Name, idx, cfg)
	} else {
		h, err = policy.NewNative(func() guest.Policy { return tiered.New() }, idx, cfg)
	}
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { h.Close(ctx) })
	ns := testNS
	ns.MountCount = 2
	if ns, err = h.Namespace(ctx, ns); err != nil {
		b.Fatal(err)
	}
	idx.AddNamespace(ns)
	if err := h.UpdateMounts(ctx, benchMounts(0)); err != nil {
		b.Fatal(err)
	}
	recs := make([]abi.AccessRecord, 0, abi.MaxBatch)
	for id := uint64(1); id <= benchEntries; id++ {
		recs = append(recs, abi.AccessRecord{Entry: id, Time: id, Size: 1 << 20, KeyHash: id * 0x9E3779B97F4A7C15, Kind: abi.AccessInsert, Mount: uint32(id % 2)})
		if len(recs) == cap(recs) || id == benchEntries {
			idx.Apply(recs)
			if err := h.Access(ctx, recs); err != nil {
				b.Fatal(err)
			}
			recs = recs[:0]
		}
	}
	return h
}

// benchMounts describes a hot NVMe and a cold shared mount, with used
// bytes on the hot one.
func benchMounts(used uint64) []abi.MountRecord {
	const hot, cold = 1 << 40, 1 << 44
	return []abi.MountRecord{
		{Mount: 0, Capacity: hot, Used: used, Free: hot - used, High: hot / 100 * 95, Low: hot / 100 * 85, Class: abi.ClassNVMe},
		{Mount: 1, Capacity: cold, Free: cold, High: cold / 100 * 95, Low: cold / 100 * 85, Class: abi.ClassNetwork},
	}
}

// BenchmarkTieringOverhead measures what mount updates and ticks add to the
// access path of the tiered policy at batch 256, two ways:
//
//   - the cost of one kvhost_mounts call (2 mounts, changed usage) and one
//     kvhost_tick call (nothing to promote) through the host, from which
//     the share of time they take at the engine's default rates follows
//     (mount updates at most 1/s, the daemon's tick 10/s): extras-share,
//     against the ceiling of 1%. Calls into a shard exclude the access
//     calls for their duration, so this share is what they can add to the
//     access path.
//   - the access path itself (hits on hot entries, batch 256) with the
//     extras off, then with a driver calling them at the default rates
//     and at 100 times those rates: ns/key and its change against "off"
//     in the same run (vs-off; noisy on a shared machine).
func BenchmarkTieringOverhead(b *testing.B) {
	ctx := context.Background()
	const n = 256
	const mountsPerSec, ticksPerSec = 1, 10
	for _, kind := range []string{"wasm", "native"} {
		h := tieringHost(b, kind)
		var mountsCost, tickCost float64 // ns per call
		b.Run(kind+"/mounts", func(b *testing.B) {
			used := uint64(0)
			for b.Loop() {
				used += 1 << 20
				if err := h.UpdateMounts(ctx, benchMounts(used)); err != nil {
					b.Fatal(err)
				}
			}
			mountsCost = float64(b.Elapsed().Nanoseconds()) / float64(b.N)
			b.ReportMetric(mountsCost, "ns/call")
		})
		b.Run(kind+"/tick", func(b *testing.B) {
			for b.Loop() {
				if _, err := h.Tick(ctx, abi.TickRequest{Time: uint64(time.Now().UnixNano())}, 256); err != nil {
					b.Fatal(err)
				}
			}
			tickCost = float64(b.Elapsed().Nanoseconds()) / float64(b.N)
			share := (mountsPerSec*mountsCost + ticksPerSec*tickCost) / 1e9
			b.ReportMetric(tickCost, "ns/call")
			b.ReportMetric(share, "extras-share")
			b.ReportMetric(share/ceilingTieringShare, "of-ceiling")
		})
		off := 0.0
		for _, rate := range []struct {
			name          string
			mounts, ticks time.Duration // 0: off
		}{{"off", 0, 0}, {"default", time.Second / mountsPerSec, time.Second / ticksPerSec}, {"x100", time.Second / mountsPerSec / 100, time.Second / ticksPerSec / 100}} {
			b.Run(fmt.Sprintf("%s/access/batch=%d/extras=%s", kind, n, rate.name), func(b *testing.B) {
				recs := make([]abi.AccessRecord, n)
				stop, done := make(chan struct{}), make(chan struct{})
				go func() {
					defer close(done)
					if rate.mounts == 0 {
						return
					}
					mt, tt := time.NewTicker(rate.mounts), time.NewTicker(rate.ticks)
					defer mt.Stop()
					defer tt.Stop()
					used := uint64(0)
					for {
						select {
						case <-stop:
							return
						case <-mt.C:
							used += 1 << 20
							if err := h.UpdateMounts(ctx, benchMounts(used)); err != nil {
								b.Error(err)
								return
							}
						case <-tt.C:
							if _, err := h.Tick(ctx, abi.TickRequest{Time: uint64(time.Now().UnixNano())}, 256); err != nil {
								b.Error(err)
								return
							}
						}
					}
				}()
				for i := 0; b.Loop(); i++ {
					for j := range recs {
						id := 2 * (uint64((i*n+j)%(benchEntries/2)) + 1) // hot entries
						recs[j] = abi.AccessRecord{Entry: id, Time: uint64(benchEntries + i*n + j), Size: 1 << 20, Kind: abi.AccessHit}
					}
					if err := h.Access(ctx, recs); err != nil {
						b.Fatal(err)
					}
				}
				close(stop)
				<-done
				perKey := float64(b.Elapsed().Nanoseconds()) / float64(b.N*n)
				b.ReportMetric(perKey, "ns/key")
				if rate.mounts == 0 {
					off = perKey
				} else if off > 0 {
					b.ReportMetric((perKey-off)/off, "vs-off")
				}
			})
		}
	}
}

// BenchmarkVictimsAfterAnOldInsert measures the fuel of a Victims call of
// the lru plugin holding n entries, each call after the insert of an entry
// with a last access older than every other (a file found on disk or
// moved), which must come out first. A call has 200,000,000 units at the
// default deadline (docs/abi.md, "fuel"); the benchmark's deadline is long
// enough for any cost to show.
func BenchmarkVictimsAfterAnOldInsert(b *testing.B) {
	ctx := context.Background()
	mod, err := plugins.Wasm("lru")
	if err != nil {
		b.Fatalf("%v (build the plugins with `make wasm`)", err)
	}
	for _, n := range []int{1 << 16, 1 << 18, 1 << 20, 1 << 22} {
		b.Run(fmt.Sprint("entries=", n), func(b *testing.B) {
			idx := policytest.NewIndex()
			cfg := policy.Config{Shards: 1, CallTimeout: time.Minute, MemoryLimit: 2 << 30, Logger: quietLogger()}
			h := declaredHost(b, mod, "lru", idx, cfg)
			const recent = 1 << 40 // the entries' times; the old inserts' are lower
			access := func(recs []abi.AccessRecord) {
				idx.Apply(recs)
				if err := h.Access(ctx, recs); err != nil {
					b.Fatal(err)
				}
			}
			recs := make([]abi.AccessRecord, 0, abi.MaxBatch)
			for id := uint64(1); id <= uint64(n); id++ {
				recs = append(recs, abi.AccessRecord{Entry: id, Time: recent + id, Size: 1 << 20, KeyHash: id * 0x9E3779B97F4A7C15, Kind: abi.AccessInsert})
				if len(recs) == cap(recs) || id == uint64(n) {
					access(recs)
					recs = recs[:0]
				}
			}
			read := policy.CountFuel(h)
			var fuel int64
			for i := 0; b.Loop(); i++ {
				id := uint64(n + 1 + i)
				access([]abi.AccessRecord{{Entry: id, Time: uint64(i + 1), Size: 1 << 20, KeyHash: id * 0x9E3779B97F4A7C15, Kind: abi.AccessInsert}})
				before, _ := read()
				v, err := h.Victims(ctx, abi.EvictRequest{Bytes: 1, Mount: abi.AnyMount}, 1)
				after, _ := read()
				fuel += after - before
				if err != nil || len(v) != 1 || v[0].Entry != id {
					b.Fatalf("victims %v, %v; want the old entry %d", v, err, id)
				}
				access([]abi.AccessRecord{{Entry: id, Kind: abi.AccessRemove}})
			}
			b.ReportMetric(float64(fuel)/float64(b.N), "units/victims")
			b.ReportMetric(float64(fuel)/float64(b.N)/float64(2*policy.DefaultCallTimeout.Nanoseconds()), "of-fuel")
		})
	}
}

// BenchmarkLFUAgingOverManyEntries measures the fuel of the Access call of
// the lfu plugin holding n entries, restored over every frequency level,
// whose record's time crosses a half-life, so that the counts age. A call
// has 200,000,000 units at the default deadline (docs/abi.md, "fuel"); the
// benchmark's deadline is long enough for any cost to show.
func BenchmarkLFUAgingOverManyEntries(b *testing.B) {
	ctx := context.Background()
	mod, err := plugins.Wasm("lfu")
	if err != nil {
		b.Fatalf("%v (build the plugins with `make wasm`)", err)
	}
	for _, n := range []int{1 << 16, 1 << 18, 1 << 20} {
		b.Run(fmt.Sprint("entries=", n), func(b *testing.B) {
			idx := lfuIndex(n)
			start := time.Now()
			h, err := policy.Open(ctx, mod, "lfu", idx, policy.Config{Shards: 1, CallTimeout: time.Minute, MemoryLimit: 2 << 30, Logger: quietLogger()})
			if err != nil {
				b.Fatal(err)
			}
			defer h.Close(ctx)
			b.Logf("%d entries restored in %v", n, time.Since(start))
			read := policy.CountFuel(h)
			var fuel int64
			for i := 0; b.Loop(); i++ {
				before, _ := read()
				if err := h.Access(ctx, []abi.AccessRecord{lfuCrossing(uint64(i + 1))}); err != nil {
					b.Fatal(err)
				}
				after, _ := read()
				fuel += after - before
			}
			b.ReportMetric(float64(fuel)/float64(b.N), "units/aging")
			b.ReportMetric(float64(fuel)/float64(b.N)/float64(2*policy.DefaultCallTimeout.Nanoseconds()), "of-fuel")
		})
	}
}

// lfuEpoch is the start of a half-life (the default hour) at which the
// entries of lfuIndex were last accessed.
const lfuEpoch = 1 << 40 / uint64(time.Hour) * uint64(time.Hour)

// lfuIndex returns an index of n entries of testNS, last accessed within
// the half-life from lfuEpoch in no id order, with counts over every
// frequency level of the lfu plugin.
func lfuIndex(n int) *policytest.Index {
	idx := policytest.NewIndex()
	idx.AddNamespace(testNS)
	recs := make([]abi.AccessRecord, n)
	for k := range recs {
		id := uint64(k + 1)
		// An odd multiple modulo n is a permutation: times in no id order.
		recs[k] = abi.AccessRecord{Entry: id, Time: lfuEpoch + id*0x9E3779B97F4A7C15%uint64(n), Size: 1, KeyHash: id,
			Hits: 1 << (id % 16), Kind: abi.AccessRestore}
	}
	idx.Apply(recs)
	return idx
}

// lfuCrossing is a hit of entry 1 in the k-th half-life after lfuEpoch, the
// first record of that half-life.
func lfuCrossing(k uint64) abi.AccessRecord {
	return abi.AccessRecord{Entry: 1, Time: lfuEpoch + k*uint64(time.Hour), Kind: abi.AccessHit}
}
