package example

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/policy/conformance"
	"github.com/tetratelabs/wazero"
)

// TestConformance runs kvhost's plugin conformance suite (what
// `kvhost policy test examples/wat-policy/policy.wasm` runs) on the module.
func TestConformance(t *testing.T) {
	wasm, err := os.ReadFile("policy.wasm")
	if err != nil {
		t.Fatalf("%v (build it with `make wasm`)", err)
	}
	// One compilation cache for the suite's hosts: the module compiles once.
	cache := wazero.NewCompilationCache()
	defer cache.Close(context.Background())
	// CI runs this beside the race suite on two cores (`make test`'s
	// test-norace), where a module's slowest call may near the 100 ms
	// production deadline; this test checks behaviour, so it allows more
	// time per call.
	r := conformance.Run(context.Background(), wasm, conformance.Options{Cache: cache, CallTimeout: time.Second, Name: "wat-policy"})
	if !r.OK() {
		var b strings.Builder
		r.WriteTo(&b)
		t.Fatalf("the WAT example fails the conformance suite:\n%s", b.String())
	}
}
