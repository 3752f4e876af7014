package policy_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/host/policy/policytest"
	"github.com/kvhost/kvhost/internal/testwasm"
	"github.com/kvhost/kvhost/plugins/lru"
)

// fixture reads testdata/NAME.wasm, built from NAME.wat by `make wasm`.
func fixture(t testing.TB, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name+".wasm"))
	if err != nil {
		t.Fatalf("%v (build the fixtures with `make wasm`)", err)
	}
	return b
}

// declaredHost opens the plugin mod as name over idx with cfg, closed when
// tb ends, and declares testNS in it and in idx.
func declaredHost(tb testing.TB, mod []byte, name string, idx *policytest.Index, cfg policy.Config) *policy.Host {
	tb.Helper()
	ctx := context.Background()
	h, err := policy.Open(ctx, mod, name, idx, cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { h.Close(ctx) })
	ns, err := h.Namespace(ctx, testNS)
	if err != nil {
		tb.Fatal(err)
	}
	idx.AddNamespace(ns)
	return h
}

func quietLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

// builtinCache is the compilation cache, in memory, of the tests that run
// the built-in lru policy (Go compiled to wasm: a compilation took 10 to
// 15 s under the race detector on 2 cores): the first of them compiles
// it, the others take its compiled code, as a daemon's restart takes it
// from policy.cache_dir. The tests that open a module without it check
// the compilation itself.
var builtinCache = sync.OnceValue(testwasm.Cache)

func newLRU() guest.Policy { return lru.New() }

// testNS is the namespace the tests declare.
var testNS = abi.NamespaceRecord{NS: 0, Fingerprint: 0xfeedface, Layers: 32, KVHeads: 8, HeadSize: 128,
	DtypeSize: 2, TokensPerBlock: 16, TokensPerKey: 256, TPSize: 1, MountCount: 2, KeyBytes: 1 << 20}

func nameRecords(n int, salt byte) []abi.NameRecord {
	recs := make([]abi.NameRecord, n)
	for i := range recs {
		recs[i].NS, recs[i].Fingerprint, recs[i].MountCount = testNS.NS, testNS.Fingerprint, testNS.MountCount
		recs[i].SetKey([]byte{salt, byte(i), byte(i >> 8), 'k'})
	}
	return recs
}

// insert stores n entries of size bytes from id first, pinning the ids in
// pinned, through idx and p as the engine would.
func insert(t *testing.T, p policy.Policy, idx *policytest.Index, first uint64, n int, size uint64, pinned ...uint64) {
	t.Helper()
	var recs []abi.AccessRecord
	for i := range uint64(n) {
		id := first + i
		recs = append(recs, abi.AccessRecord{Entry: id, Time: 1000 + id, Size: size, KeyHash: abi.KeyHash([]byte{byte(id), byte(id >> 8)}), Kind: abi.AccessInsert})
	}
	for _, id := range pinned {
		recs = append(recs, abi.AccessRecord{Entry: id, Time: 5000, Kind: abi.AccessPin})
	}
	idx.Apply(recs)
	if err := p.Access(context.Background(), recs); err != nil {
		t.Fatalf("Access: %v", err)
	}
}

// TestOpenRejectsInvalidModules: a module that does not implement ABI v1
// (a wrong version, a missing export, an import the host does not provide,
// a kvhost_scratch that gives no scratch area) fails Open with ErrModule,
// naming the plugin and the problem.
func TestOpenRejectsInvalidModules(t *testing.T) {
	tests := []struct {
		fixture string
		want    string
	}{
		{"wrongabi", "kvhost_abi_version returned 2, want 1"},
		{"noevict", "missing export kvhost_evict(i32) -> i32"},
		{"badimport", "imports env.abort, which the host does not provide"},
		{"scratchzero", "returned 0: the plugin has no scratch area"},
	}
	for _, tt := range tests {
		t.Run(tt.fixture, func(t *testing.T) {
			_, err := policy.Open(context.Background(), fixture(t, tt.fixture), tt.fixture, policytest.NewIndex(), policy.Config{Logger: quietLogger()})
			if !errors.Is(err, policy.ErrModule) || !strings.Contains(err.Error(), tt.want) || !strings.Contains(err.Error(), tt.fixture) {
				t.Fatalf("Open: %v; want ErrModule naming %q and %q", err, tt.fixture, tt.want)
			}
		})
	}
	t.Run("garbage", func(t *testing.T) {
		_, err := policy.Open(context.Background(), []byte("not wasm"), "garbage", policytest.NewIndex(), policy.Config{})
		if !errors.Is(err, policy.ErrModule) {
			t.Fatalf("Open: %v; want ErrModule", err)
		}
	})
}

func TestConfigErrors(t *testing.T) {
	tests := []struct {
		name string
		cfg  policy.Config
		want string
	}{
		{"shards", policy.Config{Shards: -1}, "Shards = -1"},
		{"memory", policy.Config{MemoryLimit: 1000}, "MemoryLimit = 1000"},
		{"timeout", policy.Config{CallTimeout: -time.Second}, "CallTimeout"},
		{"failures", policy.Config{MaxFailures: -2}, "MaxFailures"},
		{"reserved", policy.Config{Params: map[string]string{"kvhost.shard": "1"}}, "reserved"},
		{"newline", policy.Config{Params: map[string]string{"a": "b\nc"}}, "newline"},
		{"fallback reserved", policy.Config{Fallback: newLRU, FallbackParams: map[string]string{"kvhost.shards": "1"}}, "FallbackParams key"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := policy.Open(context.Background(), fixture(t, "wellbehaved"), "wb", policytest.NewIndex(), tt.cfg)
			if !errors.Is(err, policy.ErrConfig) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Open: %v; want ErrConfig mentioning %q", err, tt.want)
			}
		})
	}
}

// TestHostileFallback drives each hostile fixture into its failure: the
// failing call is retried on a replacement, the third failure switches the
// Host to the native fallback, and the Host keeps answering correctly.
func TestHostileFallback(t *testing.T) {
	tests := []struct {
		fixture string
		hook    string // the failing hook
		timeout time.Duration
		reason  string
	}{
		{"loop", "kvhost_name", 20 * time.Millisecond, "ran out of fuel: exceeded the call deadline of 20ms"},
		{"bomb", "kvhost_name", time.Second, "memory near its limit (7.5 MiB of 8 MiB in use): wasm error: unreachable"},
		{"traversal", "kvhost_name", time.Second, `invalid path "../../etc/passwd": component ".." starts with '.'`},
		{"pinned", "kvhost_evict", time.Second, "is pinned (the plugin was told of 1 pins)"},
	}
	for _, tt := range tests {
		t.Run(tt.fixture, func(t *testing.T) {
			ctx := context.Background()
			idx := policytest.NewIndex()
			var logs bytes.Buffer
			var logMu sync.Mutex
			logger := slog.New(slog.NewTextHandler(syncWriter{&logs, &logMu}, nil))
			h := declaredHost(t, fixture(t, tt.fixture), tt.fixture, idx, policy.Config{
				Shards: 2, MemoryLimit: 8 << 20, CallTimeout: tt.timeout,
				Fallback: newLRU, Logger: logger,
			})
			insert(t, h, idx, 1, 40, 100, 3, 7, 11, 20, 33)

			trigger := func() error {
				if tt.hook == "kvhost_name" {
					return h.Name(ctx, nameRecords(8, 1))
				}
				_, err := h.Victims(ctx, abi.EvictRequest{Bytes: 1 << 20, Mount: abi.AnyMount}, 64)
				return err
			}
			// First call: a failure, a replacement, a failed retry.
			err := trigger()
			var perr *policy.Error
			if !errors.As(err, &perr) || !errors.Is(err, policy.ErrPlugin) || perr.Hook != tt.hook || !strings.Contains(err.Error(), tt.reason) {
				t.Fatalf("first call: %v; want a *policy.Error of %s: %s", err, tt.hook, tt.reason)
			}
			if !strings.HasPrefix(err.Error(), "policy "+tt.fixture+": "+tt.hook) {
				t.Errorf("error %q does not start with the plugin and hook", err)
			}
			if s := h.Stats(); s.Failures != 2 || s.Fallback {
				t.Fatalf("after one call: %+v; want 2 failures, no fallback", s)
			}
			// Second call: the third failure switches to the fallback, which answers.
			if err := trigger(); err != nil {
				t.Fatalf("second call (on the fallback): %v", err)
			}
			s := h.Stats()
			if !s.Fallback || s.Backend != "native" || s.Failures != 3 || !strings.Contains(s.FallbackReason, tt.reason) {
				t.Fatalf("after the switch: %+v", s)
			}
			if s.Replacements < 1 {
				t.Errorf("Replacements = %d, want >= 1", s.Replacements)
			}
			logMu.Lock()
			if n := strings.Count(logs.String(), "using the native fallback policy"); n != 1 {
				t.Errorf("fallback logged %d times, want once:\n%s", n, logs.String())
			}
			logMu.Unlock()
			checkAnswers(t, h, idx)
		})
	}
}

// TestTheFallbackRunsWhateverThePluginsParams: the fallback is configured
// by FallbackParams, never by the plugin's Params (a key it does not know
// would fail its every start), and runs with its defaults where it refuses
// FallbackParams (a plugin's value of a key they share), at init or when a
// namespace is replayed.
func TestTheFallbackRunsWhateverThePluginsParams(t *testing.T) {
	tests := []struct {
		name           string
		params         map[string]string
		fallbackParams map[string]string
		keysPerFile    uint32 // the fallback's layout of a new namespace
	}{
		{"a key of the plugin's own", map[string]string{"x": "2"}, nil, 1},
		{"a key the fallback knows", map[string]string{"x": "2", "keys_per_file": "2"}, map[string]string{"keys_per_file": "2"}, 2},
		{"a value the fallback refuses at init", map[string]string{"order": "diagonal"}, map[string]string{"order": "diagonal", "keys_per_file": "2"}, 1},
		{"a value the fallback refuses for a namespace", map[string]string{"mount": "7"}, map[string]string{"mount": "7"}, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			idx := policytest.NewIndex()
			h := declaredHost(t, fixture(t, "traversal"), "traversal", idx, policy.Config{
				Shards: 2, MaxFailures: 1, Params: tt.params,
				Fallback: newLRU, FallbackParams: tt.fallbackParams, Logger: quietLogger(),
			})
			if err := h.Name(ctx, nameRecords(8, 1)); err != nil { // the plugin fails, the fallback answers
				t.Fatalf("Name: %v; want the fallback's answer", err)
			}
			if s := h.Stats(); !s.Fallback {
				t.Fatalf("no fallback after a failure with MaxFailures 1: %+v", s)
			}
			next := testNS
			next.NS, next.Fingerprint = 1, testNS.Fingerprint+1
			got, err := h.Namespace(ctx, next)
			if err != nil {
				t.Fatal(err)
			}
			if got.KeysPerFile != tt.keysPerFile {
				t.Errorf("the fallback gives a new namespace %d keys per file, want %d", got.KeysPerFile, tt.keysPerFile)
			}
		})
	}
}

// checkAnswers checks that p names keys validly and picks only valid victims
// for the entries of idx.
func checkAnswers(t *testing.T, p policy.Policy, idx *policytest.Index) {
	t.Helper()
	ctx := context.Background()
	recs := nameRecords(100, 9)
	if err := p.Name(ctx, recs); err != nil {
		t.Fatalf("Name: %v", err)
	}
	for _, r := range recs {
		if err := abi.CheckPath(r.Path()); err != nil || r.Mount >= r.MountCount {
			t.Fatalf("Name gave mount %d path %q: %v", r.Mount, r.Path(), err)
		}
	}
	victims, err := p.Victims(ctx, abi.EvictRequest{Bytes: 1 << 30, Mount: abi.AnyMount}, 1000)
	if err != nil {
		t.Fatalf("Victims: %v", err)
	}
	unpinned := 0
	idx.Range(func(e policy.Entry) bool {
		if e.Pins == 0 {
			unpinned++
		}
		return true
	})
	if len(victims) != unpinned {
		t.Errorf("%d victims, want every one of the %d unpinned entries", len(victims), unpinned)
	}
	for i, v := range victims {
		e, ok := idx.Lookup(v.Entry)
		if !ok || e.Pins > 0 {
			t.Fatalf("victim %d: entry %d: in index %v, %d pins", i, v.Entry, ok, e.Pins)
		}
		if i > 0 && victims[i-1].Score > v.Score {
			t.Fatalf("victims not in ascending score order: %v", victims)
		}
	}
}

type syncWriter struct {
	b  *bytes.Buffer
	mu *sync.Mutex
}

func (w syncWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}
