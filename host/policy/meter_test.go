package policy_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/host/policy/policytest"
	"github.com/kvhost/kvhost/plugins"
)

// TestMeteredLRUMatchesNative runs one workload through the built-in lru
// plugin as wasm (metered) and through the same Go policy natively, and
// checks that both give the same names and the same victims: metering
// changes no behaviour.
func TestMeteredLRUMatchesNative(t *testing.T) {
	ctx := context.Background()
	mod, err := plugins.Wasm("lru")
	if err != nil {
		t.Fatalf("%v (build the plugins with `make wasm`)", err)
	}
	type run struct {
		names   [][]byte
		victims []abi.Victim
	}
	workload := func(h *policy.Host, idx *policytest.Index) run {
		t.Helper()
		var out run
		ns, err := h.Namespace(ctx, testNS)
		if err != nil {
			t.Fatal(err)
		}
		idx.AddNamespace(ns)
		const n = 3000
		var recs []abi.AccessRecord
		for id := uint64(1); id <= n; id++ {
			recs = append(recs, abi.AccessRecord{Entry: id, Time: id, Size: 1 << 20, KeyHash: id * 0x9E3779B97F4A7C15, Kind: abi.AccessInsert, Mount: uint32(id % 2)})
		}
		// Hits on every third entry, pins on every seventh, in time order.
		for id := uint64(3); id <= n; id += 3 {
			recs = append(recs, abi.AccessRecord{Entry: id, Time: n + id, Kind: abi.AccessHit})
		}
		for id := uint64(7); id <= n; id += 7 {
			recs = append(recs, abi.AccessRecord{Entry: id, Time: 2*n + id, Kind: abi.AccessPin})
		}
		idx.Apply(recs)
		if err := h.Access(ctx, recs); err != nil {
			t.Fatal(err)
		}
		names := nameRecords(500, 9)
		if err := h.Name(ctx, names); err != nil {
			t.Fatal(err)
		}
		for _, r := range names {
			out.names = append(out.names, append([]byte{byte(r.Mount)}, r.PathBuf[:r.PathLen]...))
		}
		for _, req := range []abi.EvictRequest{
			{Bytes: 100 << 20, Mount: abi.AnyMount},
			{Bytes: 50 << 20, Mount: 1},
			{Bytes: 1, Mount: 0},
		} {
			v, err := h.Victims(ctx, req, 200)
			if err != nil {
				t.Fatal(err)
			}
			out.victims = append(out.victims, v...)
			// Remove them, as the engine would, and go on.
			rm := make([]abi.AccessRecord, len(v))
			for i, x := range v {
				rm[i] = abi.AccessRecord{Entry: x.Entry, Time: 3 * n, Kind: abi.AccessRemove}
			}
			idx.Apply(rm)
			if err := h.Access(ctx, rm); err != nil {
				t.Fatal(err)
			}
		}
		return out
	}
	cfg := policy.Config{Shards: 2, Cache: builtinCache(), Logger: quietLogger()}
	widx := policytest.NewIndex()
	w, err := policy.Open(ctx, mod, "lru", widx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close(ctx)
	nidx := policytest.NewIndex()
	n, err := policy.NewNative(newLRU, nidx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close(ctx)
	got, want := workload(w, widx), workload(n, nidx)
	if len(got.victims) == 0 || len(got.names) != 500 {
		t.Fatalf("workload gave %d victims and %d names", len(got.victims), len(got.names))
	}
	if !slices.EqualFunc(got.names, want.names, func(a, b []byte) bool { return string(a) == string(b) }) {
		t.Fatalf("metered wasm names differ from native")
	}
	if !slices.Equal(got.victims, want.victims) {
		t.Fatalf("metered wasm victims differ from native:\n%v\n%v", got.victims, want.victims)
	}
	if s := w.Stats(); s.Failures != 0 || s.Backend != "wasm" {
		t.Fatalf("stats %+v", s)
	}
}

// TestRunawayStopsByFuel checks that an endless loop is stopped by its fuel
// (an instruction count, not the clock), with a message that says so, and
// that the host retries it once on a fresh instance. How long a runaway
// takes in wall time is a performance figure: BenchmarkRunaway measures it.
func TestRunawayStopsByFuel(t *testing.T) {
	const timeout = 50 * time.Millisecond
	h, err := policy.Open(context.Background(), fixture(t, "loop"), "loop", policytest.NewIndex(),
		policy.Config{Shards: 1, CallTimeout: timeout, MaxFailures: 100, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close(context.Background())
	err = h.Name(context.Background(), nameRecords(1, 0))
	if !errors.Is(err, policy.ErrPlugin) || !strings.Contains(err.Error(), "kvhost_name (shard 0): ran out of fuel: exceeded the call deadline of 50ms") {
		t.Fatalf("err = %v, want the plugin out of fuel", err)
	}
	// The call and its retry on a fresh instance (one replacement) both ran
	// out of fuel. None of this depends on the machine's load.
	s := h.Stats()
	if s.Failures != 2 || s.Replacements != 1 || s.Fallback {
		t.Fatalf("stats after a runaway: %d failures, %d replacements, fallback %v; want 2, 1, false", s.Failures, s.Replacements, s.Fallback)
	}
}

// TestHostCallsSpendFuel: the work a plugin makes the host do in its
// imported functions (WASI and kvhost.log) costs fuel, by the call and
// by its size: iovecs, poll subscriptions, random bytes, path bytes. The
// hostcalls fixture makes 8 rounds of such calls, each cheap in wasm
// instructions (the whole call under a tenth of its fuel) but millions of
// items or bytes for the host, then fails; it must run out of fuel
// instead of returning its status (which it did, after about 10 ms per
// round for the host, whatever its deadline).
func TestHostCallsSpendFuel(t *testing.T) {
	tests := []struct{ name, which string }{
		{"fd_write to stdout", "w"},
		{"fd_write to stderr", "e"},
		{"fd_read from stdin", "r"},
		{"poll_oneoff", "p"},
		{"random_get", "g"},
		{"path_open", "o"},
		{"clock_time_get", "c"},
		{"kvhost.log", "l"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			h, err := policy.Open(ctx, fixture(t, "hostcalls"), "hostcalls", policytest.NewIndex(), policy.Config{
				Shards: 1, CallTimeout: 10 * time.Millisecond, MaxFailures: 100,
				Params: map[string]string{"f": tt.which}, Logger: quietLogger()})
			if err != nil {
				t.Fatal(err)
			}
			defer h.Close(ctx)
			err = h.Name(ctx, nameRecords(1, 0))
			if !errors.Is(err, policy.ErrPlugin) || !strings.Contains(err.Error(), "kvhost_name (shard 0): ran out of fuel") {
				t.Fatalf("err = %v, want the plugin out of fuel", err)
			}
		})
	}
}

// TestStartFunctionHostCallsSpendFuel: a start function's host calls
// spend the meter's initial fuel (the host sets no call's fuel before the
// module is instantiated): the hoststart fixture's 40 large fd_write calls
// cost more than it, and the module is refused, the host function named.
func TestStartFunctionHostCallsSpendFuel(t *testing.T) {
	_, err := policy.Open(context.Background(), fixture(t, "hoststart"), "hoststart", policytest.NewIndex(),
		policy.Config{Shards: 1, Logger: quietLogger()})
	if !errors.Is(err, policy.ErrModule) || !strings.Contains(err.Error(), "ran out of fuel in host function wasi_snapshot_preview1.fd_write") {
		t.Fatalf("Open: %v; want the module refused, its start function out of fuel in fd_write", err)
	}
}

// TestInitializeGetsASecondsFuel: a module's _initialize (a Go or C
// reactor's runtime start) gets at least a second's worth of fuel whatever
// the call deadline; kvhost_init, like every hook, gets its deadline's.
// slowinit spends about 75 million units in _initialize, and as much in
// kvhost_init with slow=y, against the 20 million of a 10 ms deadline.
func TestInitializeGetsASecondsFuel(t *testing.T) {
	tests := []struct {
		slow string
		want string // in Open's error; "" for none
	}{
		{"n", ""},
		{"y", "kvhost_init (shard 0): ran out of fuel: exceeded the call deadline of 10ms"},
	}
	for _, tt := range tests {
		t.Run("slow="+tt.slow, func(t *testing.T) {
			ctx := context.Background()
			h, err := policy.Open(ctx, fixture(t, "slowinit"), "slowinit", policytest.NewIndex(), policy.Config{
				Shards: 1, CallTimeout: 10 * time.Millisecond, Params: map[string]string{"slow": tt.slow}, Logger: quietLogger()})
			if err == nil {
				h.Close(ctx)
			}
			switch {
			case tt.want == "" && err != nil:
				t.Fatalf("Open: %v; want _initialize within its second's fuel", err)
			case tt.want != "" && (!errors.Is(err, policy.ErrPlugin) || !strings.Contains(err.Error(), tt.want)):
				t.Fatalf("Open: %v; want %q", err, tt.want)
			}
		})
	}
}

// TestEvictionsOverManyEntriesStayWithinTheirFuel: an eviction of the
// built-in lru plugin holding 2^18 entries (more memory than the default
// gives room for them), after they were restored (in
// the index's order, not by time) and after an insert older than all of
// them (a file found on disk or moved), stays within the fuel of the
// default deadline: the plugin keeps its list in time order record by
// record, where a sort of every entry before the eviction took about
// twice that fuel and failed the call.
func TestEvictionsOverManyEntriesStayWithinTheirFuel(t *testing.T) {
	const n = 1 << 18
	ctx := context.Background()
	mod, err := plugins.Wasm("lru")
	if err != nil {
		t.Fatalf("%v (build the plugins with `make wasm`)", err)
	}
	idx := policytest.NewIndex()
	idx.AddNamespace(testNS)
	recs := make([]abi.AccessRecord, n)
	for k := range recs {
		id := uint64(k + 1)
		// An odd multiple modulo n is a permutation: times in no id order,
		// the oldest (1<<40) that of entry n.
		recs[k] = abi.AccessRecord{Entry: id, Time: 1<<40 + id*0x9E3779B97F4A7C15%n, Size: 1, KeyHash: id, Kind: abi.AccessInsert}
	}
	idx.Apply(recs)
	h, err := policy.Open(ctx, mod, "lru", idx, policy.Config{Shards: 1, MemoryLimit: 128 << 20, Cache: builtinCache(), Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close(ctx)
	evict := func(want uint64) {
		t.Helper()
		vs, err := h.Victims(ctx, abi.EvictRequest{Bytes: 1, Mount: abi.AnyMount}, 1)
		if err != nil || len(vs) != 1 || vs[0].Entry != want || h.Stats().Failures != 0 {
			t.Fatalf("Victims = %v, %v, %d failures; want entry %d and no failure", vs, err, h.Stats().Failures, want)
		}
	}
	evict(n)
	old := []abi.AccessRecord{{Entry: n + 1, Time: 1, Size: 1, KeyHash: n + 1, Kind: abi.AccessInsert}}
	idx.Apply(old)
	if err := h.Access(ctx, old); err != nil {
		t.Fatal(err)
	}
	evict(n + 1)
}

// TestLFUAgingOverManyEntriesStaysWithinItsFuel: the Access call of the
// built-in lfu plugin holding 2^18 entries, restored over every frequency
// level, whose record crosses a half-life (so that every count halves)
// stays within the fuel of the default deadline, as does the eviction
// after it, which puts the entries of a count halved to zero first, least
// recent first. Halving every count and putting every entry back on its
// level in that one call took about 1.3 times its fuel and failed it.
func TestLFUAgingOverManyEntriesStaysWithinItsFuel(t *testing.T) {
	const n = 1 << 18
	ctx := context.Background()
	mod, err := plugins.Wasm("lfu")
	if err != nil {
		t.Fatalf("%v (build the plugins with `make wasm`)", err)
	}
	h, err := policy.Open(ctx, mod, "lfu", lfuIndex(n), policy.Config{Shards: 1, MemoryLimit: 128 << 20, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close(ctx)
	if err := h.Access(ctx, []abi.AccessRecord{lfuCrossing(1)}); err != nil || h.Stats().Failures != 0 {
		t.Fatalf("Access across a half-life: %v, %d failures; want no failure", err, h.Stats().Failures)
	}
	// Entries with one access (id%16 == 0) are down to none; the least
	// recent of them (time lfuEpoch+0, that of entry n) goes first.
	vs, err := h.Victims(ctx, abi.EvictRequest{Bytes: 1, Mount: abi.AnyMount}, 1)
	if err != nil || len(vs) != 1 || vs[0].Entry != n || h.Stats().Failures != 0 {
		t.Fatalf("Victims = %v, %v, %d failures; want entry %d and no failure", vs, err, h.Stats().Failures, n)
	}
}

// TestReservedFuelExport checks that a module exporting the meter's reserved
// name is refused by Open and reported by Inspect.
func TestReservedFuelExport(t *testing.T) {
	const name = "kvhost_fuel"
	mod := []byte{0, 'a', 's', 'm', 1, 0, 0, 0,
		6, 6, 1, 0x7e, 0x01, 0x42, 0x00, 0x0b, // global section: (mut i64) = 0
		7, byte(4 + len(name)), 1, byte(len(name))} // export section: the global as name
	mod = append(append(mod, name...), 0x03, 0x00)
	ctx := context.Background()
	_, err := policy.Open(ctx, mod, "reserved", policytest.NewIndex(), policy.Config{Logger: quietLogger()})
	if !errors.Is(err, policy.ErrModule) || !strings.Contains(err.Error(), "reserved: export section: meter: reserved export name kvhost_fuel") {
		t.Fatalf("Open: %v; want ErrModule for the reserved export", err)
	}
	info, err := policy.Inspect(ctx, mod)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(info.Problems, func(p string) bool { return strings.Contains(p, "reserved export name kvhost_fuel") }) {
		t.Fatalf("Inspect problems %q do not name the reserved export", info.Problems)
	}
}
