package policy_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/host/policy/policytest"
	"github.com/kvhost/kvhost/plugins"
)

// openBoth returns a wasm host of the well-behaved fixture and a native host
// of the lru policy, each with its own index.
func hosts(t *testing.T, shards int) map[string]struct {
	p   *policy.Host
	idx *policytest.Index
} {
	t.Helper()
	ctx := context.Background()
	out := map[string]struct {
		p   *policy.Host
		idx *policytest.Index
	}{}
	idx := policytest.NewIndex()
	w, err := policy.Open(ctx, fixture(t, "wellbehaved"), "wellbehaved", idx, policy.Config{Shards: shards, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close(ctx) })
	out["wasm"] = struct {
		p   *policy.Host
		idx *policytest.Index
	}{w, idx}
	idx = policytest.NewIndex()
	n, err := policy.NewNative(newLRU, idx, policy.Config{Shards: shards, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Close(ctx) })
	if _, err := n.Namespace(ctx, testNS); err != nil {
		t.Fatal(err)
	}
	idx.AddNamespace(testNS)
	out["native"] = struct {
		p   *policy.Host
		idx *policytest.Index
	}{n, idx}
	return out
}

// TestShardsAgree checks that naming does not depend on the number of shards,
// that batches larger than abi.MaxBatch are split, and that victims merge
// into one ascending order.
func TestShardsAgree(t *testing.T) {
	ctx := context.Background()
	one, four := hosts(t, 1), hosts(t, 4)
	for kind := range one {
		t.Run(kind, func(t *testing.T) {
			a, b := nameRecords(2*abi.MaxBatch+5, 3), nameRecords(2*abi.MaxBatch+5, 3)
			if err := one[kind].p.Name(ctx, a); err != nil {
				t.Fatal(err)
			}
			if err := four[kind].p.Name(ctx, b); err != nil {
				t.Fatal(err)
			}
			for i := range a {
				if a[i].Mount != b[i].Mount || string(a[i].Path()) != string(b[i].Path()) || a[i].PathLen == 0 {
					t.Fatalf("record %d: %d:%q with 1 shard, %d:%q with 4", i, a[i].Mount, a[i].Path(), b[i].Mount, b[i].Path())
				}
			}
			if calls := four[kind].p.Stats().Calls["kvhost_name"]; calls < 4 || calls > 4*3 {
				t.Errorf("%d kvhost_name calls for %d records over 4 shards", calls, len(b))
			}
			for _, h := range []struct {
				p   *policy.Host
				idx *policytest.Index
			}{one[kind], four[kind]} {
				insert(t, h.p, h.idx, 1, 3000, 10, 5, 6)
				v, err := h.p.Victims(ctx, abi.EvictRequest{Bytes: 1 << 40, Mount: abi.AnyMount}, abi.MaxBatch)
				if err != nil {
					t.Fatal(err)
				}
				if len(v) != abi.MaxBatch {
					t.Errorf("%d victims, want %d", len(v), abi.MaxBatch)
				}
				for i := 1; i < len(v); i++ {
					if v[i-1].Score > v[i].Score {
						t.Fatalf("victims not ascending at %d", i)
					}
				}
			}
		})
	}
}

// flaky is an lru policy whose Evict panics while *boom is set.
type flaky struct {
	guest.Policy
	boom *atomic.Int32
}

func (f flaky) Evict(req *abi.EvictRequest, out []abi.Victim) (int, error) {
	if f.boom.Load() > 0 {
		f.boom.Add(-1)
		panic("flaky: boom")
	}
	return f.Policy.Evict(req, out)
}

func (f flaky) Namespace(r *abi.NamespaceRecord) error {
	return f.Policy.(guest.Namespacer).Namespace(r)
}

// TestReplacementRebuildsState makes a native instance fail and checks that
// the replacement, rebuilt from the index, knows every entry and pin.
func TestReplacementRebuildsState(t *testing.T) {
	ctx := context.Background()
	var boom atomic.Int32
	idx := policytest.NewIndex()
	idx.AddNamespace(testNS)
	h, err := policy.NewNative(func() guest.Policy { return flaky{newLRU(), &boom} }, idx, policy.Config{Shards: 1, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close(ctx)
	insert(t, h, idx, 1, 50, 100, 2, 4, 4, 8)
	boom.Store(1)
	v, err := h.Victims(ctx, abi.EvictRequest{Bytes: 1 << 40, Mount: abi.AnyMount}, 100)
	if err != nil {
		t.Fatalf("Victims after one panic: %v", err)
	}
	if len(v) != 47 {
		t.Fatalf("%d victims from the rebuilt instance, want the 47 unpinned entries", len(v))
	}
	s := h.Stats()
	if s.Failures != 1 || s.Replacements != 1 || s.Fallback {
		t.Fatalf("stats %+v; want 1 failure, 1 replacement", s)
	}
	// Two panics in a row: the retry fails too and the error names the panic.
	boom.Store(2)
	_, err = h.Victims(ctx, abi.EvictRequest{Bytes: 1, Mount: abi.AnyMount}, 1)
	if !errors.Is(err, policy.ErrPlugin) || !strings.Contains(err.Error(), "policy native: kvhost_evict (shard 0): panic: flaky: boom") {
		t.Fatalf("err = %v", err)
	}
	checkAnswers(t, h, idx)
}

// TestAnInstanceRebuiltBeforeTheEngineRecordsANamespaceKnowsIt: the
// engine marks a namespace declared in its Index only after Host.Namespace
// returns. An instance rebuilt in that window (another call failed on its
// shard) is declared the namespaces the host declared, not only the
// Index's, so the plugin names the namespace's keys: no failure but the
// one injected.
func TestAnInstanceRebuiltBeforeTheEngineRecordsANamespaceKnowsIt(t *testing.T) {
	ctx := context.Background()
	var boom atomic.Int32
	idx := policytest.NewIndex()
	h, err := policy.NewNative(func() guest.Policy { return flaky{newLRU(), &boom} }, idx, policy.Config{Shards: 1, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close(ctx)
	ns, err := h.Namespace(ctx, testNS) // declared to the plugin...
	if err != nil {
		t.Fatal(err)
	}
	// ...and, before the engine records it, a call fails on the shard.
	boom.Store(1)
	if _, err := h.Victims(ctx, abi.EvictRequest{Bytes: 1, Mount: abi.AnyMount}, 1); err != nil {
		t.Fatal(err)
	}
	idx.AddNamespace(ns) // the engine marks the namespace declared
	if err := h.Name(ctx, nameRecords(8, 1)); err != nil {
		t.Fatal(err)
	}
	if s := h.Stats(); s.Failures != 1 {
		t.Fatalf("%d failures, want the 1 injected: naming a declared namespace failed the plugin", s.Failures)
	}
}

// TestCallerCancel: a caller's context done before a call stops it, and
// that is no failure of the plugin (an instance whose call was not made is
// kept); one done while a call runs does not cut it short: the loop runs
// out its fuel, which is the plugin's failure (counted, not retried), and
// the caller gets its context's error. The context ends at points the
// test chooses, not at a time: before Name, after the first shard's call
// (OnCall), or when logloop logs in its call (its deadline passed, as when
// the plugin's call holds the processor and delays the context's timer).
func TestCallerCancel(t *testing.T) {
	tests := []struct {
		name     string
		fixture  string
		shards   int
		end      string // "before", "after a shard" or "in the call"
		deadline bool   // in the call: the deadline passes, ctx.Err stays nil
		want     error
		failures uint64
	}{
		{"cancelled before the call", "logloop", 1, "before", false, context.Canceled, 0},
		{"cancelled before the second shard's call", "wellbehaved", 2, "after a shard", false, context.Canceled, 0},
		{"cancelled during the call", "logloop", 1, "in the call", false, context.Canceled, 1},
		{"deadline passed during the call", "logloop", 1, "in the call", true, context.DeadlineExceeded, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			late := &lateDeadline{Context: ctx}
			end := context.CancelFunc(cancel)
			if tt.deadline {
				end = func() { late.passed.Store(true) }
			}
			var armed atomic.Bool
			logs := &cancelOnLog{msg: "logloop: looping"}
			if tt.end == "in the call" {
				logs.cancel.Store(&end)
			}
			onCall := func(hook string, _ int, _ time.Duration) {
				if tt.end == "after a shard" && armed.Load() && hook == "kvhost_name" {
					end()
				}
			}
			idx := policytest.NewIndex()
			h := declaredHost(t, fixture(t, tt.fixture), tt.fixture, idx, policy.Config{
				Shards: tt.shards, CallTimeout: 10 * time.Millisecond, Logger: slog.New(logs), OnCall: onCall})
			if tt.end == "before" {
				end()
			}
			armed.Store(true)
			recs := nameRecords(64, 0)
			if err := h.Name(late, recs); !errors.Is(err, tt.want) {
				t.Fatalf("Name: %v, want %v", err, tt.want)
			}
			armed.Store(false)
			s := h.Stats()
			if s.Failures != tt.failures || s.Calls["kvhost_name"] > uint64(tt.shards) {
				t.Fatalf("stats %+v: want %d failures and no retry", s, tt.failures)
			}
			// The host goes on: with the instance it kept, or a fresh one
			// for the one that failed.
			ins := []abi.AccessRecord{{Entry: 1, Size: 1, Kind: abi.AccessInsert}}
			idx.Apply(ins)
			if err := h.Access(context.Background(), ins); err != nil {
				t.Fatal(err)
			}
			if got := h.Stats().Replacements; got != tt.failures {
				t.Fatalf("%d replacements, want %d (one per failed instance)", got, tt.failures)
			}
		})
	}
}

// lateDeadline is a context whose deadline passes when passed is set,
// without its Err saying so yet.
type lateDeadline struct {
	context.Context
	passed atomic.Bool
}

func (c *lateDeadline) Deadline() (time.Time, bool) {
	if c.passed.Load() {
		return time.Unix(1, 0), true
	}
	return time.Now().Add(time.Hour), true
}

// TestAccessDeliversItsRecordsWhenItsCallerCancels checks that an Access
// whose caller's context ends, before the call or while its records go to
// the shards, still delivers every record, counts no failure and discards
// no instance: the plugins keep a state that agrees with the index.
func TestAccessDeliversItsRecordsWhenItsCallerCancels(t *testing.T) {
	for _, when := range []string{"before", "during"} {
		t.Run(when, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var armed atomic.Bool
			onCall := func(hook string, _ int, _ time.Duration) {
				if armed.Load() && hook == "kvhost_access" {
					cancel() // after the first shard's call
				}
			}
			idx := policytest.NewIndex()
			h, err := policy.Open(context.Background(), fixture(t, "wellbehaved"), "wellbehaved", idx,
				policy.Config{Shards: 4, Logger: quietLogger(), OnCall: onCall})
			if err != nil {
				t.Fatal(err)
			}
			defer h.Close(context.Background())
			insert(t, h, idx, 1, 64, 100, 3, 4)
			recs := []abi.AccessRecord{{Entry: 3, Time: 6000, Kind: abi.AccessUnpin}}
			for id := uint64(1); id <= 64; id++ {
				recs = append(recs, abi.AccessRecord{Entry: id, Time: 6000 + id, Kind: abi.AccessHit})
			}
			idx.Apply(recs)
			if when == "before" {
				cancel()
			}
			armed.Store(true)
			if err := h.Access(ctx, recs); err != nil {
				t.Fatalf("Access: %v", err)
			}
			armed.Store(false)
			checkAnswers(t, h, idx)
			if s := h.Stats(); s.Failures != 0 || s.Replacements != 0 || s.Fallback {
				t.Fatalf("stats %+v after a caller's cancel: want no failure, no replacement", s)
			}
		})
	}
}
func TestInputErrors(t *testing.T) {
	ctx := context.Background()
	h := hosts(t, 1)["wasm"].p
	bad := nameRecords(1, 0)
	bad[0].MountCount = 0
	if err := h.Name(ctx, bad); !errors.Is(err, policy.ErrInput) {
		t.Errorf("Name with MountCount 0: %v", err)
	}
	// Keys are 1..abi.MaxKeyLen bytes (docs/abi.md): an empty key is the
	// caller's error, never passed to the plugin.
	empty := nameRecords(1, 0)
	empty[0].SetKey(nil)
	if err := h.Name(ctx, empty); !errors.Is(err, policy.ErrInput) {
		t.Errorf("Name with an empty key: %v", err)
	}
	if err := h.Access(ctx, []abi.AccessRecord{{Entry: 1, Kind: 99}}); !errors.Is(err, policy.ErrInput) {
		t.Errorf("Access of kind 99: %v", err)
	}
	if _, err := h.Victims(ctx, abi.EvictRequest{}, -1); !errors.Is(err, policy.ErrInput) {
		t.Errorf("Victims(-1): %v", err)
	}
	if s := h.Stats(); s.Failures != 0 {
		t.Errorf("caller errors counted as %d plugin failures", s.Failures)
	}
	// Without the features, the host answers for the plugin.
	ns, err := h.Namespace(ctx, testNS)
	if err != nil || ns.KeysPerFile != abi.DefaultKeysPerFile || ns.Order != abi.DefaultOrder {
		t.Errorf("Namespace = %+v, %v; want the default layout", ns, err)
	}
	adm := []abi.AdmitRecord{{KeyHash: 1}, {KeyHash: 2}}
	if err := h.Admit(ctx, adm); err != nil || adm[0].Admit != 1 || adm[1].Admit != 1 {
		t.Errorf("Admit = %+v, %v; want every store admitted", adm, err)
	}
	h.Close(ctx)
	if err := h.Name(ctx, nameRecords(1, 0)); !errors.Is(err, policy.ErrClosed) {
		t.Errorf("Name after Close: %v", err)
	}
}

// TestNoAllocsPerRecord checks that the host allocates nothing per call or
// record, for a batch of one as for a batch of abi.MaxBatch.
func TestNoAllocsPerRecord(t *testing.T) {
	ctx := context.Background()
	for kind, h := range hosts(t, 1) {
		t.Run(kind, func(t *testing.T) {
			insert(t, h.p, h.idx, 1, 4*abi.MaxBatch, 10)
			for _, tc := range []struct {
				hook string
				run  func(n int) func()
			}{
				{"name", func(n int) func() {
					recs := nameRecords(n, 1)
					return func() { _ = h.p.Name(ctx, recs) }
				}},
				{"access", func(n int) func() {
					recs := make([]abi.AccessRecord, n)
					for i := range recs {
						recs[i] = abi.AccessRecord{Entry: uint64(1 + i), Kind: abi.AccessHit, Time: 5}
					}
					return func() { _ = h.p.Access(ctx, recs) }
				}},
			} {
				one := testing.AllocsPerRun(50, tc.run(1))
				many := testing.AllocsPerRun(50, tc.run(abi.MaxBatch))
				// A metered call allocates nothing: no deadline context, no
				// watcher goroutine.
				if many > one {
					t.Errorf("%s: %.1f allocations for a batch of %d, %.1f for one record", tc.hook, many, abi.MaxBatch, one)
				}
				if one > 0 {
					t.Errorf("%s: %.1f allocations per call", tc.hook, one)
				}
			}
		})
	}
}

// TestHammer runs concurrent callers on a sharded wasm host (go test -race).
func TestHammer(t *testing.T) {
	ctx := context.Background()
	h := hosts(t, 4)["wasm"]
	workers, loops := 8, 200
	if testing.Short() {
		loops = 20
	}
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range loops {
				base := uint64(w*1_000_000 + i*10 + 1)
				recs := make([]abi.AccessRecord, 10)
				for j := range recs {
					recs[j] = abi.AccessRecord{Entry: base + uint64(j), Size: 10, Kind: abi.AccessInsert, Time: base}
				}
				h.idx.Apply(recs)
				if err := h.p.Access(ctx, recs); err != nil {
					errs <- err
					return
				}
				if err := h.p.Name(ctx, nameRecords(16, byte(w))); err != nil {
					errs <- err
					return
				}
				if _, err := h.p.Victims(ctx, abi.EvictRequest{Bytes: 50, Mount: abi.AnyMount}, 8); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if s := h.p.Stats(); s.Failures != 0 {
		t.Fatalf("%d failures", s.Failures)
	}
}

// TestCompilationCache checks that a second start with the same CacheDir
// compiles nothing: the cache directory is not written again.
func TestCompilationCache(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	module := fixture(t, "wellbehaved")
	open := func() {
		h, err := policy.Open(ctx, module, "wellbehaved", policytest.NewIndex(), policy.Config{CacheDir: dir, Logger: quietLogger()})
		if err != nil {
			t.Fatal(err)
		}
		h.Close(ctx)
	}
	snapshot := func() map[string]time.Time {
		m := map[string]time.Time{}
		filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
			if err == nil && !fi.IsDir() {
				m[p] = fi.ModTime()
			}
			return nil
		})
		return m
	}
	open()
	first := snapshot()
	if len(first) == 0 {
		t.Fatal("the first start wrote nothing to the cache")
	}
	open()
	if second := snapshot(); fmt.Sprint(first) != fmt.Sprint(second) {
		t.Fatalf("the second start rewrote the cache:\n%v\n%v", first, second)
	}
}

// TestOpenCompilesAgainOverADamagedCacheFile: a compilation-cache file
// damaged on disk (a bit flipped, a file cut short by a crash) is the
// cache's failure, not the module's: Open warns, the plugin loads, and
// the module's entry is rewritten, so that the next start reads it with
// no warning and the cache holds the first start's bytes again.
func TestOpenCompilesAgainOverADamagedCacheFile(t *testing.T) {
	ctx := context.Background()
	module := fixture(t, "wellbehaved")
	tests := []struct {
		damage string
		apply  func(b []byte) []byte
	}{
		{"a bit flipped", func(b []byte) []byte { b[len(b)/2] ^= 0xff; return b }},
		{"cut short", func(b []byte) []byte { return b[:len(b)/2] }},
	}
	for _, tt := range tests {
		t.Run(tt.damage, func(t *testing.T) {
			dir := t.TempDir()
			var logs *captureHandler
			open := func() error {
				logs = &captureHandler{}
				h, err := policy.Open(ctx, module, "wellbehaved", policytest.NewIndex(), policy.Config{CacheDir: dir, Logger: slog.New(logs)})
				if err == nil {
					h.Close(ctx)
				}
				return err
			}
			warned := func() bool {
				logs.mu.Lock()
				defer logs.mu.Unlock()
				return slices.ContainsFunc(logs.recs, func(r slog.Record) bool {
					return r.Level == slog.LevelWarn && strings.Contains(r.Message, "compilation cache failed")
				})
			}
			if err := open(); err != nil {
				t.Fatal(err)
			}
			first := cacheFiles(t, dir)
			if len(first) == 0 {
				t.Fatal("the first start wrote nothing to the cache")
			}
			for f, b := range first {
				if err := os.WriteFile(f, tt.apply(slices.Clone(b)), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			if err := open(); err != nil {
				t.Fatalf("Open over a damaged cache file: %v", err)
			}
			if !warned() {
				t.Fatal("no warning of the damaged cache")
			}
			if got := cacheFiles(t, dir); !maps.EqualFunc(got, first, bytes.Equal) {
				t.Fatalf("the damaged entry was not rewritten: %d files, want the first start's %d", len(got), len(first))
			}
			if err := open(); err != nil {
				t.Fatal(err)
			}
			if warned() {
				t.Fatal("the start after the repair warned of the cache again")
			}
		})
	}
}

// TestInspectListsWhatStopsOpen: Inspect lists the problem that stops
// Open of each module TestOpenRejectsInvalidModules opens (the scratch
// area's too: they share the check), and none for the well-behaved
// fixture or a built-in plugin.
func TestInspectListsWhatStopsOpen(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		fixture string
		ok      bool
		version int32
		problem string
	}{
		{"wellbehaved", true, 1, ""},
		{"wrongabi", false, 2, "kvhost_abi_version returned 2"},
		{"noevict", false, 1, "missing export kvhost_evict"},
		{"badimport", false, 0, "imports env.abort"},
		{"scratchzero", false, 1, "returned 0: the plugin has no scratch area"},
	}
	for _, tt := range tests {
		t.Run(tt.fixture, func(t *testing.T) {
			info, err := policy.Inspect(ctx, fixture(t, tt.fixture))
			if err != nil {
				t.Fatal(err)
			}
			if info.OK() != tt.ok || info.ABIVersion != tt.version || !strings.Contains(strings.Join(info.Problems, "\n"), tt.problem) {
				t.Fatalf("Info = %+v", info)
			}
		})
	}
	info, err := policy.Inspect(ctx, fixture(t, "wellbehaved"))
	if err != nil || info.MemoryMin != 40 || info.MemoryMaxSet || len(info.Hooks) != 7 || len(info.Imports) != 0 {
		t.Fatalf("wellbehaved: %+v, %v", info, err)
	}
	for _, name := range plugins.Names() {
		mod, _ := plugins.Wasm(name)
		info, err := policy.Inspect(ctx, mod)
		if err != nil || !info.OK() || info.Size != len(mod) {
			t.Errorf("built-in %s: %+v, %v", name, info, err)
		}
	}
}

// captureHandler keeps every log record.
type captureHandler struct {
	mu   sync.Mutex
	recs []slog.Record
}

func (c *captureHandler) Enabled(context.Context, slog.Level) bool { return true }
func (c *captureHandler) Handle(_ context.Context, r slog.Record) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.recs = append(c.recs, r)
	return nil
}
func (c *captureHandler) WithAttrs([]slog.Attr) slog.Handler { return c }
func (c *captureHandler) WithGroup(string) slog.Handler      { return c }

// openChatty opens the chatty fixture, closed when t ends, with a
// logger that keeps every record.
func openChatty(t *testing.T) (*policy.Host, *captureHandler) {
	t.Helper()
	logs := &captureHandler{}
	h, err := policy.Open(context.Background(), fixture(t, "chatty"), "chatty", policytest.NewIndex(), policy.Config{Shards: 1, Logger: slog.New(logs)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close(context.Background()) })
	return h, logs
}

// TestPluginLogAndAdmit checks kvhost.log (levels, truncation, rate limit)
// and the admit hook.
func TestPluginLogAndAdmit(t *testing.T) {
	ctx := context.Background()
	h, logs := openChatty(t)
	if f := h.Features(); f != abi.FeatureAdmit {
		t.Fatalf("Features = %v", f)
	}
	adm := make([]abi.AdmitRecord, 4)
	if err := h.Admit(ctx, adm); err != nil {
		t.Fatal(err)
	}
	for i, r := range adm {
		if r.Admit != uint32(i&1) {
			t.Fatalf("Admit[%d] = %d", i, r.Admit)
		}
	}
	if _, err := h.Victims(ctx, abi.EvictRequest{Bytes: 1}, 1); err != nil {
		t.Fatal(err)
	}
	logs.mu.Lock()
	count := map[string]int{}
	for _, r := range logs.recs {
		switch {
		case r.Message == "chatty: init" && r.Level == slog.LevelInfo:
			count["init"]++
		case r.Message == "chatty: evicting" && r.Level == slog.LevelWarn:
			count["evicting"]++
		case len(r.Message) == 1024 && r.Level == slog.LevelError:
			count["long"]++
		default:
			count["other: "+r.Message]++
		}
	}
	logs.mu.Unlock()
	want := map[string]int{"init": 1, "long": 1, "evicting": 98}
	if fmt.Sprint(count) != fmt.Sprint(want) {
		t.Fatalf("log messages %v, want %v", count, want)
	}
	// kvhost_name returns "unsupported": a failure with the status named.
	err := h.Name(ctx, nameRecords(1, 0))
	if !errors.Is(err, policy.ErrPlugin) || !strings.Contains(err.Error(), "returned status -3 (unsupported)") {
		t.Fatalf("Name: %v", err)
	}
}

// TestFailureReasonIsFromTheFailedCall: the reason a failure status is
// given with, in the host's warning and in the error, is a warning the
// plugin logged in the call that failed, never one an earlier, successful
// call logged. chatty's kvhost_evict logs warnings and succeeds; its
// kvhost_name returns "unsupported" without a word (on the instance that
// evicted, then on its replacement).
func TestFailureReasonIsFromTheFailedCall(t *testing.T) {
	ctx := context.Background()
	h, logs := openChatty(t)
	if _, err := h.Victims(ctx, abi.EvictRequest{Bytes: 1}, 1); err != nil {
		t.Fatal(err)
	}
	err := h.Name(ctx, nameRecords(1, 0))
	if !errors.Is(err, policy.ErrPlugin) || !strings.HasSuffix(err.Error(), "returned status -3 (unsupported)") {
		t.Fatalf("Name: %v; want status -3 and no reason (the hook logged none)", err)
	}
	logs.mu.Lock()
	defer logs.mu.Unlock()
	var failures []string
	for _, r := range logs.recs {
		if r.Message != "policy plugin failed; replacing the instance" {
			continue
		}
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == "err" {
				failures = append(failures, a.Value.String())
			}
			return true
		})
	}
	want := []string{"returned status -3 (unsupported)", "returned status -3 (unsupported)"}
	if !slices.Equal(failures, want) {
		t.Fatalf("the host logged the failures %q, want %q", failures, want)
	}
}

// layoutPolicy is the lru policy whose kvhost_namespace writes set into
// each record (nil: writes nothing).
type layoutPolicy struct {
	guest.Policy
	set func(r *abi.NamespaceRecord)
}

func (p *layoutPolicy) Namespace(r *abi.NamespaceRecord) error {
	if p.set != nil {
		p.set(r)
	}
	return nil
}

// TestNamespaceHookThatWritesNothingGetsTheDefault: the host fills the
// default layout (1 key per file, layer-major) into the NamespaceRecord
// before the call, as docs/abi.md and sdk/c promise, so a plugin that
// writes nothing gets it; what a plugin writes is still validated.
func TestNamespaceHookThatWritesNothingGetsTheDefault(t *testing.T) {
	tests := []struct {
		name      string
		set       func(r *abi.NamespaceRecord)
		keys, ord uint32
		err       string
	}{
		{"writes nothing", nil, abi.DefaultKeysPerFile, abi.DefaultOrder, ""},
		{"writes a layout", func(r *abi.NamespaceRecord) { r.KeysPerFile, r.Order = 4, abi.OrderBlockMajor }, 4, abi.OrderBlockMajor, ""},
		{"writes only the order", func(r *abi.NamespaceRecord) { r.Order = abi.OrderBlockMajor }, abi.DefaultKeysPerFile, abi.OrderBlockMajor, ""},
		{"writes 0 keys per file", func(r *abi.NamespaceRecord) { r.KeysPerFile = 0 }, 0, 0, "KeysPerFile 0 is outside [1, 256]"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			h, err := policy.NewNative(func() guest.Policy { return &layoutPolicy{Policy: newLRU(), set: tt.set} },
				policytest.NewIndex(), policy.Config{Shards: 2, Logger: quietLogger()})
			if err != nil {
				t.Fatal(err)
			}
			defer h.Close(ctx)
			ns, err := h.Namespace(ctx, testNS)
			if tt.err != "" {
				if !errors.Is(err, policy.ErrPlugin) || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("Namespace: %v; want %q", err, tt.err)
				}
				return
			}
			if err != nil || ns.KeysPerFile != tt.keys || ns.Order != tt.ord {
				t.Fatalf("Namespace = %d keys per file, order %d, %v; want %d, %d", ns.KeysPerFile, ns.Order, err, tt.keys, tt.ord)
			}
		})
	}
}

// cancelOnLog is a slog.Handler that calls cancel at each record whose
// message is msg: a way to end a caller's context while a plugin's call
// runs, at a point the plugin chooses (kvhost.log), not at a time.
type cancelOnLog struct {
	msg    string
	cancel atomic.Pointer[context.CancelFunc]
}

func (c *cancelOnLog) Enabled(context.Context, slog.Level) bool { return true }
func (c *cancelOnLog) Handle(_ context.Context, r slog.Record) error {
	if f := c.cancel.Load(); f != nil && r.Message == c.msg {
		(*f)()
	}
	return nil
}
func (c *cancelOnLog) WithAttrs([]slog.Attr) slog.Handler { return c }
func (c *cancelOnLog) WithGroup(string) slog.Handler      { return c }

// TestFailureWhileTheCallerGaveUpCounts: a call that has started is never
// cut short by its caller's context (fuel bounds it), so when it fails,
// the failure is the plugin's even if the caller gave up meanwhile: it is
// counted, and enough of them switch the Host to its fallback. A plugin
// that runs out of fuel in every call must not escape the fallback because
// its callers time out first. logloop warns, then loops until out of
// fuel; the warning cancels the caller's context.
func TestFailureWhileTheCallerGaveUpCounts(t *testing.T) {
	logs := &cancelOnLog{msg: "logloop: looping"}
	h := declaredHost(t, fixture(t, "logloop"), "logloop", policytest.NewIndex(), policy.Config{
		Shards: 1, CallTimeout: 10 * time.Millisecond, MaxFailures: 2, Fallback: newLRU, Logger: slog.New(logs)})
	for i := range 2 {
		ctx, cancel := context.WithCancel(context.Background())
		logs.cancel.Store(&cancel)
		err := h.Name(ctx, nameRecords(1, 0))
		cancel()
		if s := h.Stats(); s.Failures != uint64(i+1) {
			t.Fatalf("after call %d (err %v): %d failures, want %d", i+1, err, s.Failures, i+1)
		}
	}
	if s := h.Stats(); !s.Fallback || s.Backend != "native" || !strings.Contains(s.FallbackReason, "ran out of fuel") {
		t.Fatalf("stats %+v after 2 failures of MaxFailures 2: want the fallback, for running out of fuel", s)
	}
	if err := h.Name(context.Background(), nameRecords(4, 1)); err != nil {
		t.Fatalf("Name on the fallback: %v", err)
	}
}

// TestWASIClocksAreFakeAndDeterministic: a plugin's WASI clocks are
// wazero's fakes, as docs/abi.md says: in every instance the wall clock
// starts at 2022-01-01 UTC and each reading is 1 ms after the one before,
// whatever the time is. The clock fixture reports its readings through
// its statuses.
func TestWASIClocksAreFakeAndDeterministic(t *testing.T) {
	ctx := context.Background()
	h, err := policy.Open(ctx, fixture(t, "clock"), "clock", policytest.NewIndex(), policy.Config{Shards: 1, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close(ctx)
	// -(s + 1), s the seconds since 2022-01-01 of the first reading.
	if err := h.Name(ctx, nameRecords(1, 0)); err == nil || !strings.HasSuffix(err.Error(), "returned status -1 (invalid input)") {
		t.Fatalf("Name: %v; want status -1: the first reading at 2022-01-01T00:00:00Z", err)
	}
	// The microseconds between two readings in a row.
	if _, err := h.Victims(ctx, abi.EvictRequest{Bytes: 1, Mount: abi.AnyMount}, 1); err == nil || !strings.HasSuffix(err.Error(), "returned 1000 victims, more than the 1 asked for") {
		t.Fatalf("Victims: %v; want 1000: readings 1 ms apart", err)
	}
}

// cacheFiles returns the files under a compilation cache's directory
// (path → bytes).
func cacheFiles(t *testing.T, dir string) map[string][]byte {
	t.Helper()
	files := map[string][]byte{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(p)
		files[p] = b
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}
