package conformance_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/policy/conformance"
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
	if len(r.Checks) < 10 {
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
		{"loop", "deadline", "ran out of fuel: exceeded the call deadline"},
		{"bomb", "names", "memory near its limit"},
		{"traversal", "names", `invalid path "../../etc/passwd"`},
		{"wrongabi", "load", "kvhost_abi_version returned 2, want 1"},
		{"noevict", "load", "missing export kvhost_evict"},
		{"badimport", "load", "imports env.abort"},
		{"pinned", "pinned entries", "is pinned"},
		{"pinned", "no host rejections", "invalid outputs"},
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
			for _, c := range r.Checks {
				if c.Name != tt.check {
					continue
				}
				if c.OK || !strings.Contains(c.Message, tt.message) {
					logReport(t, r)
					t.Fatalf("check %q: ok=%v %q; want a failure with %q", c.Name, c.OK, c.Message, tt.message)
				}
				return
			}
			logReport(t, r)
			t.Fatalf("no check %q in the report", tt.check)
		})
	}
}

// TestBuiltinsPass runs the suite on every built-in plugin; `make` builds
// them before the tests, so a missing module is a failure.
func TestBuiltinsPass(t *testing.T) {
	want := []string{"lru", "lfu", "ttl", "sharded"}
	for _, name := range want {
		t.Run(name, func(t *testing.T) {
			t.Parallel() // compiling a Go plugin takes seconds, more under -race
			mod, err := plugins.Wasm(name)
			if err != nil {
				t.Fatalf("%v (build the plugins with `make wasm`)", err)
			}
			r := conformance.Run(context.Background(), mod, conformance.Options{Name: name})
			if !r.OK() {
				logReport(t, r)
				t.Fatalf("built-in plugin %s fails the suite", name)
			}
		})
	}
}
