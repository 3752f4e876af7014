package meter_test

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/tetratelabs/wazero"

	"github.com/kvhost/kvhost/host/policy/internal/meter"
)

// FuzzInstrument checks that Instrument never panics on arbitrary bytes and
// that whenever wazero accepts a module Instrument succeeds on, wazero
// accepts the instrumented module too. (It compiles only what Instrument
// accepts: wazero spends seconds and gigabytes on a function declaring 2^28
// locals, which the meter refuses.)
func FuzzInstrument(f *testing.F) {
	for _, pattern := range []string{"testdata/*.wasm", root + "/host/policy/testdata/*.wasm", root + "/examples/wat-policy/*.wasm"} {
		files, err := filepath.Glob(pattern)
		if err != nil || len(files) == 0 {
			f.Fatalf("no %s (build the modules with `make wasm`)", pattern)
		}
		for _, file := range files {
			f.Add(read(f, file))
		}
	}
	ctx := context.Background()
	r := wazero.NewRuntime(ctx)
	defer r.Close(ctx)
	f.Fuzz(func(t *testing.T, in []byte) {
		out, err := meter.Instrument(in)
		if err != nil {
			return
		}
		cm, err := r.CompileModule(ctx, in)
		if err != nil {
			return // wazero refuses the input: nothing to compare
		}
		_ = cm.Close(ctx)
		cm, err = r.CompileModule(ctx, out)
		if err != nil {
			t.Fatalf("wazero accepts the module but not its instrumented version: %v", err)
		}
		_ = cm.Close(ctx)
	})
}
