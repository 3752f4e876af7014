package conformance_test

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/policy/conformance"
	"github.com/kvhost/kvhost/internal/testwasm"
	"github.com/kvhost/kvhost/plugins"
)

func fixture(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "testdata", name+".wasm"))
	if err != nil {
		t.Fatalf("%v (build the fixtures with `make wasm`)", err)
	}
	return b
}

func logReport(t *testing.T, r conformance.Report) {
	t.Helper()
	var b strings.Builder
	r.WriteTo(&b)
	t.Log("\n" + b.String())
}

func TestWellBehavedPasses(t *testing.T) {
	r := conformance.Run(context.Background(), fixture(t, "wellbehaved"), conformance.Options{Name: "wellbehaved"})
	if !r.OK() {
		logReport(t, r)
		t.Fatal("the well-behaved fixture fails the suite")
	}
	if len(r.Checks) < 13 {
		t.Errorf("%d checks ran, want every one", len(r.Checks))
	}
}

// TestHostileFixturesFail checks that the suite fails each broken plugin in
// the check that matters, with the host's message.
func TestHostileFixturesFail(t *testing.T) {
	// Only the endless loop waits for its deadline; the others get a
	// generous one, so that a slow machine (-race) does not turn their
	// failures into timeouts.
	timeout := map[string]time.Duration{"loop": 50 * time.Millisecond}
	tests := []struct {
		fixture string
		check   string
		message string
	}{
		{"loop", "names", "ran out of fuel: exceeded the call deadline of 50ms"},
		{"loop", "call timing", "ran out of fuel: exceeded the call deadline"},
		{"bomb", "names", "memory near its limit"},
		{"traversal", "names", `invalid path "../../etc/passwd"`},
		{"wrongabi", "load", "kvhost_abi_version returned 2, want 1"},
		{"noevict", "load", "missing export kvhost_evict"},
		{"badimport", "load", "imports env.abort"},
		{"pinned", "pinned entries", "is pinned"},
		{"pinned", "no host rejections", "invalid outputs"},
		// Issue 11: each defect fails its own check, naming the rule.
		{"layout300", "namespaces", "KeysPerFile 300 is outside [1, 256]"},
		{"layout300", "names", "not run: it needs the layouts of the 3 namespaces"},
		{"refuse", "admission", "every store refused"},
		{"rankhandle", "rank", "a rank must depend only on the history and the time"},
		{"admitbad", "admission", "Admit 2 is neither 0 nor 1"},
		{"shardname", "determinism", "names must not depend on the shard"},
		{"multikey", "names", "(4 keys per file) would be the first keys of two files"},
		// Tiering: each defect fails the tiering check with the host's message.
		{"badmove", "tick moves", "was never reported to this shard"},
		{"baddemote", "demotion targets", "target mount 77, but only 7 mounts exist"},
		// Issue 37: a plugin that ignores REMOVE records.
		{"noremove", "removed entries", "it ignores REMOVE records"},
		// Issue 37: the same path on two mounts, a tick that ignores its
		// max, a demotion before any mount description, a refused memory
		// grow ignored.
		{"mountpath", "names", "paths must be unique across mounts"},
		{"tickmax", "tick moves", "tick 0 (max 1): "},
		{"tickmax", "tick moves", "more than the 1 asked for"},
		{"earlydemote", "before mount descriptions", "eviction on mount 0 before any mount description: "},
		{"earlydemote", "before mount descriptions", "demote or move only once the host has described the mounts"},
		{"growignore", "names", "out of bounds memory access"},
	}
	reports := map[string]conformance.Report{}
	for _, tt := range tests {
		t.Run(tt.fixture+"/"+tt.check, func(t *testing.T) {
			r, ok := reports[tt.fixture]
			if !ok {
				d, ok := timeout[tt.fixture]
				if !ok {
					d = 5 * time.Second
				}
				r = conformance.Run(context.Background(), fixture(t, tt.fixture), conformance.Options{
					Name: tt.fixture, CallTimeout: d, MemoryLimit: 8 << 20})
				reports[tt.fixture] = r
			}
			if r.OK() {
				logReport(t, r)
				t.Fatal("the suite passes a hostile plugin")
			}
			c, ok := r.Check(tt.check)
			if !ok {
				logReport(t, r)
				t.Fatalf("no check %q in the report", tt.check)
			}
			if c.OK || !strings.Contains(c.Message, tt.message) {
				logReport(t, r)
				t.Fatalf("check %q: ok=%v %q; want a failure with %q", c.Name, c.OK, c.Message, tt.message)
			}
			if c.Rule == "" {
				t.Errorf("check %q failed without naming its rule", c.Name)
			}
		})
	}
}

// TestSingleDefectFailsOnlyItsCheck checks that the suite pinpoints a
// defect: the fixtures of issue 11 differ from the well-behaved plugin in
// one respect, and fail exactly the checks that respect breaks.
func TestSingleDefectFailsOnlyItsCheck(t *testing.T) {
	tests := []struct {
		fixture string
		failed  []string
	}{
		{"refuse", []string{"admission"}},
		{"admitbad", []string{"admission", "no host rejections"}},
		{"shardname", []string{"determinism"}},
		{"multikey", []string{"names"}},
		// A move of an entry never reported fails every check that ticks.
		{"badmove", []string{"tick moves", "repeated moves", "before mount descriptions", "no host rejections"}},
		{"baddemote", []string{"demotion targets", "before mount descriptions", "no host rejections"}},
		// Every check that evicts after a REMOVE sees the host catch
		// an offered removed entry (issue 94: a failure the host
		// recovered from fails the check it happened in).
		{"noremove", []string{"capacity pressure", "unknown events", "removed entries", "no host rejections"}},
		{"mountpath", []string{"names"}},
		// tickmax also asks again for moves under way, and moves before
		// any description.
		{"tickmax", []string{"tick moves", "repeated moves", "before mount descriptions", "no host rejections"}},
		// Before any description: the check's fresh host, not the
		// suite's, refuses the demotion.
		{"earlydemote", []string{"before mount descriptions"}},
		// A rank from the handle is also off the Unix-nanosecond scale and
		// answers RANK_KNOWN for a removed entry.
		{"rankhandle", []string{"rank", "rank scale", "rank unknown", "restore fields"}},
		// Issue 94: a hit ranks 231 days above its last access, and so
		// does an entry restored with hits.
		{"rankboost", []string{"rank scale", "restore fields"}},
	}
	for _, tt := range tests {
		t.Run(tt.fixture, func(t *testing.T) {
			r := conformance.Run(context.Background(), fixture(t, tt.fixture), conformance.Options{Name: tt.fixture, CallTimeout: 5 * time.Second})
			var failed []string
			for _, c := range r.Failed() {
				failed = append(failed, c.Name)
			}
			if !slices.Equal(failed, tt.failed) {
				logReport(t, r)
				t.Fatalf("failed checks %q, want %q", failed, tt.failed)
			}
		})
	}
}

// TestTrapOnNthCallFailsTheCheckItHappenedIn checks that a trap the host
// recovers from (the trapnth fixture traps on the 40th hook call of each
// instance; the host rebuilds it and retries, and the retry answers right)
// fails the check during which it happened, naming the trap, and that the
// catch-all names it too rather than pointing at checks that passed.
func TestTrapOnNthCallFailsTheCheckItHappenedIn(t *testing.T) {
	r := conformance.Run(context.Background(), fixture(t, "trapnth"), conformance.Options{Name: "trapnth", CallTimeout: 5 * time.Second})
	failed := r.Failed()
	if len(failed) < 2 {
		logReport(t, r)
		t.Fatalf("%d checks failed, want the check the trap happened in and the catch-all", len(failed))
	}
	first := failed[0]
	if first.Name == "no host rejections" || first.Rule == "" ||
		!strings.Contains(first.Message, "the host caught") || !strings.Contains(first.Message, "unreachable") {
		logReport(t, r)
		t.Fatalf("first failed check %q: %q (rule %q); want a check before the catch-all naming the trap the host caught", first.Name, first.Message, first.Rule)
	}
	last := failed[len(failed)-1]
	if last.Name != "no host rejections" || !strings.Contains(last.Message, "unreachable") {
		logReport(t, r)
		t.Fatalf("last failed check %q: %q; want the catch-all naming the first trap", last.Name, last.Message)
	}
	var b strings.Builder
	r.WriteTo(&b)
	if want := "FAIL " + first.Name; !strings.Contains(b.String(), want) || !strings.Contains(b.String(), "rule: "+first.Rule) {
		t.Errorf("the text report lacks %q with its rule:\n%s", want, b.String())
	}
}

// TestRankScaleHoldsWithTheParameters checks that the rank scale is
// judged with the configuration the plugin is given: the built-in lfu
// ranks an entry one half_life per frequency level above its last
// access, inside the scale with a half_life of a day and far outside it
// with 77 days (231 days after 3 hits). The rankboost fixture's test
// (TestSingleDefectFailsOnlyItsCheck) holds the ceiling of hit entries.
func TestRankScaleHoldsWithTheParameters(t *testing.T) {
	mod, err := plugins.Wasm("lfu")
	if err != nil {
		t.Fatalf("%v (build the plugins with `make wasm`)", err)
	}
	for _, tt := range []struct {
		halfLife string
		ok       bool
	}{{"24h", true}, {"1848h", false}} {
		t.Run("half_life="+tt.halfLife, func(t *testing.T) {
			r := conformance.Run(context.Background(), mod, conformance.Options{Name: "lfu", Cache: builtinCache(),
				Params: map[string]string{"half_life": tt.halfLife}})
			c, ok := r.Check("rank scale")
			if !ok {
				logReport(t, r)
				t.Fatal("no rank scale check in the report")
			}
			if c.OK != tt.ok {
				logReport(t, r)
				t.Fatalf("rank scale: ok=%v %q; want ok=%v", c.OK, c.Message, tt.ok)
			}
		})
	}
}

// TestReportTimesEachCall checks that the report gives the time of single
// calls per hook, not totals: every hook the suite drives has calls, and
// its percentiles are ordered and no larger than the longest call.
func TestReportTimesEachCall(t *testing.T) {
	r := conformance.Run(context.Background(), fixture(t, "wellbehaved"), conformance.Options{Name: "wellbehaved"})
	if !r.OK() {
		logReport(t, r)
		t.Fatal("the well-behaved fixture fails the suite")
	}
	hooks := map[string]conformance.HookTiming{}
	for _, h := range r.Timing {
		hooks[h.Hook] = h
		if h.Calls == 0 || h.P50 > h.P99 || h.P99 > h.Max || h.Max <= 0 {
			t.Errorf("%s: %+v: want calls > 0 and 0 < p50 <= p99 <= max", h.Hook, h)
		}
	}
	for _, hook := range []string{"kvhost_init", "kvhost_name", "kvhost_access", "kvhost_evict"} {
		if _, ok := hooks[hook]; !ok {
			t.Errorf("no timing for %s in %+v", hook, r.Timing)
		}
	}
	if !r.HasStats || r.Stats.Calls["kvhost_name"] == 0 {
		t.Errorf("the report has no host counters: %+v", r.Stats)
	}
	var b strings.Builder
	r.WriteTo(&b)
	for _, want := range []string{"call times (deadline 100ms per call):", "kvhost_access", "p99", "host stats: calls/records"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("the text report lacks %q:\n%s", want, b.String())
		}
	}
}

// TestReportJSON checks the JSON report a vendor's CI reads: the verdict,
// each check with its rule, and the call times.
func TestReportJSON(t *testing.T) {
	r := conformance.Run(context.Background(), fixture(t, "refuse"), conformance.Options{Name: "refuse", CallTimeout: 5 * time.Second})
	var b bytes.Buffer
	if err := r.WriteJSON(&b); err != nil {
		t.Fatal(err)
	}
	var got struct {
		OK     bool `json:"ok"`
		Failed int  `json:"failed"`
		Checks []struct {
			Name, Rule, Message string
			OK                  bool
		} `json:"checks"`
		Timing []struct {
			Hook  string  `json:"hook"`
			Calls int     `json:"calls"`
			P99   float64 `json:"p99_us"`
		} `json:"timing"`
		Module struct {
			FeatureNames string `json:"feature_names"`
		} `json:"module"`
	}
	if err := json.Unmarshal(b.Bytes(), &got); err != nil {
		t.Fatalf("%v:\n%s", err, b.String())
	}
	if got.OK || got.Failed != 1 || len(got.Checks) != len(r.Checks) || got.Module.FeatureNames != "admit" {
		t.Fatalf("ok %v, failed %d, %d checks, features %q; want a failure of 1 check of %d, features admit",
			got.OK, got.Failed, len(got.Checks), got.Module.FeatureNames, len(r.Checks))
	}
	for _, c := range got.Checks {
		if c.Name == "admission" && (c.OK || c.Rule == "" || !strings.Contains(c.Message, "every store refused")) {
			t.Errorf("admission check in JSON: %+v", c)
		}
	}
	if len(got.Timing) == 0 || got.Timing[0].Calls == 0 {
		t.Errorf("no call times in JSON: %+v", got.Timing)
	}
}

// builtinCache is the compilation cache of the built-in plugins: the
// run's shared one where `make test` names it (testwasm), else one in
// memory.
var builtinCache = sync.OnceValue(testwasm.Cache)

// TestBuiltinsPass runs the suite on every built-in plugin; `make` builds
// them before the tests, so a missing module is a failure.
func TestBuiltinsPass(t *testing.T) {
	want := []string{"lru", "lfu", "ttl", "sharded", "tiered"}
	for _, name := range want {
		t.Run(name, func(t *testing.T) {
			t.Parallel() // compiling a Go plugin takes seconds, more under -race
			mod, err := plugins.Wasm(name)
			if err != nil {
				t.Fatalf("%v (build the plugins with `make wasm`)", err)
			}
			r := conformance.Run(context.Background(), mod, conformance.Options{Name: name, Cache: builtinCache()})
			if !r.OK() {
				logReport(t, r)
				t.Fatalf("built-in plugin %s fails the suite", name)
			}
		})
	}
}
