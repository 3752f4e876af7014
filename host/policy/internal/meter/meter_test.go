package meter_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tetratelabs/wazero"
	"github.com/tetratelabs/wazero/api"

	"github.com/kvhost/kvhost/host/policy/internal/meter"
)

// root is the repository root, from this package's directory.
const root = "../../../.."

// fixtures returns every wasm module the repository builds (`make wasm`):
// the host's test fixtures, the built-in plugins and the examples. It fails
// the test if a group is missing.
func fixtures(t testing.TB) []string {
	t.Helper()
	var all []string
	for _, pattern := range []string{
		"testdata/*.wasm",
		root + "/host/policy/testdata/*.wasm",
		root + "/plugins/wasm/*.wasm",
		root + "/examples/*/*.wasm",
	} {
		files, err := filepath.Glob(pattern)
		if err != nil {
			t.Fatal(err)
		}
		if len(files) == 0 {
			t.Fatalf("no %s (build the modules with `make wasm`)", pattern)
		}
		all = append(all, files...)
	}
	return all
}

func read(t testing.TB, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (build the modules with `make wasm`)", err)
	}
	return b
}

// TestInstrumentFixtures instruments every module the repository builds and
// compiles the result in wazero. The Go modules (over 1 MiB) are compiled by
// wazero's interpreter, which decodes and validates them as the compiler
// does at a fraction of the time (half a minute each under -race); the
// host/policy tests run every built-in plugin through the compiler.
func TestInstrumentFixtures(t *testing.T) {
	ctx := context.Background()
	compiler := wazero.NewRuntime(ctx)
	defer compiler.Close(ctx)
	interpreter := wazero.NewRuntimeWithConfig(ctx, wazero.NewRuntimeConfigInterpreter())
	defer interpreter.Close(ctx)
	for _, path := range fixtures(t) {
		t.Run(filepath.Base(filepath.Dir(path))+"/"+filepath.Base(path), func(t *testing.T) {
			in := read(t, path)
			r := compiler
			if len(in) > 1<<20 {
				r = interpreter
			}
			out, err := meter.Instrument(in)
			if err != nil {
				t.Fatal(err)
			}
			again, err := meter.Instrument(in)
			if err != nil || !bytes.Equal(out, again) {
				t.Fatalf("second Instrument differs (err %v)", err)
			}
			cm, err := r.CompileModule(ctx, out)
			if err != nil {
				t.Fatalf("wazero refuses the instrumented module: %v", err)
			}
			defer cm.Close(ctx)
			orig, err := r.CompileModule(ctx, in)
			if err != nil {
				t.Fatal(err)
			}
			defer orig.Close(ctx)
			if got, want := len(cm.ExportedFunctions()), len(orig.ExportedFunctions()); got != want {
				t.Fatalf("%d exported functions, want %d", got, want)
			}
			if got, want := len(cm.CustomSections()), len(orig.CustomSections()); got != want {
				t.Fatalf("%d custom sections, want %d", got, want)
			}
			if len(out) > len(in)*2+1024 {
				t.Fatalf("instrumented %d bytes into %d", len(in), len(out))
			}
		})
	}
}

// instance instantiates the instrumented metered.wat fixture.
func instance(t *testing.T) (api.Module, api.MutableGlobal) {
	t.Helper()
	ctx := context.Background()
	out, err := meter.Instrument(read(t, "testdata/metered.wasm"))
	if err != nil {
		t.Fatal(err)
	}
	r := wazero.NewRuntime(ctx)
	t.Cleanup(func() { r.Close(ctx) })
	mod, err := r.Instantiate(ctx, out)
	if err != nil {
		t.Fatal(err)
	}
	g, ok := mod.ExportedGlobal(meter.ExportName).(api.MutableGlobal)
	if !ok {
		t.Fatalf("%s is not an exported mutable global", meter.ExportName)
	}
	if got := int64(g.Get()); got != meter.InitialFuel {
		t.Fatalf("initial fuel %d, want %d", got, meter.InitialFuel)
	}
	return mod, g
}

// TestFuelStops checks that code that would run forever (or for 2^40
// calls) traps once its fuel is spent, with the fuel negative.
func TestFuelStops(t *testing.T) {
	const budget = 1_000_000
	for _, tc := range []struct {
		fn   string
		args []uint64
	}{
		{"spin", nil},
		{"deep", []uint64{40}},
		{"fill", nil},
	} {
		t.Run(tc.fn, func(t *testing.T) {
			mod, fuel := instance(t)
			fuel.Set(budget)
			_, err := mod.ExportedFunction(tc.fn).Call(context.Background(), tc.args...)
			if err == nil || !strings.Contains(err.Error(), "unreachable") {
				t.Fatalf("err = %v, want the meter's unreachable trap", err)
			}
			if left := int64(fuel.Get()); left >= 0 || left < -(1<<16) {
				t.Fatalf("fuel left %d, want slightly below zero", left)
			}
		})
	}
}

// TestFuelBounded checks that unbounded recursion still stops at wazero's
// stack limit, and that a call within its fuel returns its result.
func TestFuelBounded(t *testing.T) {
	mod, fuel := instance(t)
	ctx := context.Background()
	fuel.Set(1 << 40)
	if _, err := mod.ExportedFunction("forever").Call(ctx); err == nil || !strings.Contains(err.Error(), "stack overflow") {
		t.Fatalf("forever: err = %v, want a stack overflow", err)
	}
	fuel.Set(1 << 20)
	res, err := mod.ExportedFunction("deep").Call(ctx, 10)
	if err != nil || res[0] != 1024 {
		t.Fatalf("deep(10) = %v, %v, want 1024", res, err)
	}
}

// TestFuelDeterministic checks that the fuel a call spends depends on the
// work only, and grows with it: one unit per instruction that does work,
// charged per span.
func TestFuelDeterministic(t *testing.T) {
	mod, fuel := instance(t)
	ctx := context.Background()
	spent := func(n uint64) int64 {
		fuel.Set(1 << 40)
		res, err := mod.ExportedFunction("count").Call(ctx, n)
		if err != nil || res[0] != n {
			t.Fatalf("count(%d) = %v, %v", n, res, err)
		}
		return 1<<40 - int64(fuel.Get())
	}
	a, b, c := spent(1000), spent(1000), spent(2000)
	if a != b {
		t.Fatalf("count(1000) spent %d then %d", a, b)
	}
	// An iteration spends 5: i32.ge_u, br_if, i32.and, br_if (the span
	// from the loop header to the inner block's end), then i32.add (the
	// span after it); local.get/set, constants and br are free.
	if c-a != 5*1000 {
		t.Fatalf("count(2000) spent %d more than count(1000), want 5 per iteration", c-a)
	}
}

// TestInstrumentErrors checks that modules the meter cannot instrument are
// refused with the reason.
func TestInstrumentErrors(t *testing.T) {
	header := []byte{0, 'a', 's', 'm', 1, 0, 0, 0}
	// A module with type () -> (), one function whose body is code.
	withBody := func(code ...byte) []byte {
		b := append([]byte{}, header...)
		b = append(b, 1, 4, 1, 0x60, 0, 0) // type section
		b = append(b, 3, 2, 1, 0)          // function section
		body := append([]byte{0}, code...) // no locals
		b = append(b, 10, byte(len(body)+2), 1, byte(len(body)))
		return append(b, body...)
	}
	exportFuel := append(append([]byte{}, header...), 7, byte(len(meter.ExportName)+4), 1, byte(len(meter.ExportName)))
	exportFuel = append(append(exportFuel, meter.ExportName...), 0x03, 0)
	for _, tc := range []struct {
		name string
		in   []byte
		err  error
		msg  string
	}{
		{"empty", nil, meter.ErrMalformed, "magic"},
		{"version 2", []byte{0, 'a', 's', 'm', 2, 0, 0, 0}, meter.ErrUnsupported, "version"},
		{"reserved export", exportFuel, meter.ErrReserved, meter.ExportName},
		{"tail call", withBody(0x12, 0, 0x0b), meter.ErrUnsupported, "function 0: meter: unsupported feature: opcode 0x12 (tail call)"},
		{"try", withBody(0x06, 0x40, 0x0b, 0x0b), meter.ErrUnsupported, "opcode 0x6 (exception handling)"},
		{"atomics", withBody(0xfe, 0x03, 0x00, 0x0b), meter.ErrUnsupported, "threads/atomics"},
		{"relaxed simd", withBody(0xfd, 0x80, 0x02, 0x0b), meter.ErrUnsupported, "0xfd 0x100"},
		{"bad misc", withBody(0xfc, 18, 0x0b), meter.ErrUnsupported, "0xfc 18"},
		{"unterminated body", withBody(0x01), meter.ErrMalformed, "unexpected end"},
		{"stray else", withBody(0x05, 0x0b), meter.ErrMalformed, "else outside if"},
		{"trailing bytes", withBody(0x0b, 0x01), meter.ErrMalformed, "after the body"},
		// A module that sets the global the meter appends would refill its
		// own fuel: invalid as written, valid once metered.
		{"global.set of the fuel", withBody(0x42, 0x00, 0x24, 0x00, 0x0b), meter.ErrMalformed, "global.set of global 0; the module has 0"},
		{"global.get of the fuel", withBody(0x23, 0x00, 0x1a, 0x0b), meter.ErrMalformed, "global.get of global 0"},
		{"export of the fuel", append(append([]byte{}, header...), 7, 5, 1, 1, 'x', 0x03, 0), meter.ErrMalformed, `export "x" of global 0`},
		{"tables over the bound", withTable(header, meter.MaxTableElements+1), meter.ErrLimit, "tables of more than"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := meter.Instrument(tc.in)
			if !errors.Is(err, tc.err) || !strings.Contains(err.Error(), tc.msg) {
				t.Fatalf("err = %v, want %v containing %q", err, tc.err, tc.msg)
			}
		})
	}
	// The well-formed version of the same module instruments and compiles.
	out, err := meter.Instrument(withBody(0x0b))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	r := wazero.NewRuntime(ctx)
	defer r.Close(ctx)
	if _, err := r.CompileModule(ctx, out); err != nil {
		t.Fatal(err)
	}
}

// withTable returns header followed by a table section of one funcref
// table of at least lo elements and no maximum.
func withTable(header []byte, lo uint32) []byte {
	limits := []byte{0x70, 0x00}
	for ; lo >= 0x80; lo >>= 7 {
		limits = append(limits, byte(lo)|0x80)
	}
	limits = append(limits, byte(lo))
	b := append(append([]byte{}, header...), 4, byte(len(limits)+1), 1)
	return append(b, limits...)
}

// TestInstrumentBoundsTables: a table declared without a maximum grows
// within MaxTableElements and no further, once metered; the runtime keeps
// tables in the host's memory, which the memory limit does not bound.
func TestInstrumentBoundsTables(t *testing.T) {
	header := []byte{0, 'a', 's', 'm', 1, 0, 0, 0}
	// (func (export "grow") (param i32) (result i32)
	//   (table.grow (ref.null func) (local.get 0)))
	typ := []byte{1, 0x60, 1, 0x7f, 1, 0x7f}
	b := append(append(append([]byte{}, header...), 1, byte(len(typ))), typ...)
	b = append(b, 3, 2, 1, 0)            // function section
	b = append(b, withTable(nil, 16)...) // table section
	b = append(b, 7, 8, 1, 4, 'g', 'r', 'o', 'w', 0x00, 0)
	body := []byte{0, 0xd0, 0x70, 0x20, 0x00, 0xfc, 15, 0x00, 0x0b}
	b = append(b, 10, byte(len(body)+2), 1, byte(len(body)))
	b = append(b, body...)
	out, err := meter.Instrument(b)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	r := wazero.NewRuntimeWithConfig(ctx, wazero.NewRuntimeConfigInterpreter())
	defer r.Close(ctx)
	mod, err := r.Instantiate(ctx, out)
	if err != nil {
		t.Fatal(err)
	}
	fuel, ok := mod.ExportedGlobal(meter.ExportName).(api.MutableGlobal)
	if !ok {
		t.Fatalf("%s is not an exported mutable global", meter.ExportName)
	}
	fuel.Set(1 << 40)
	grow := mod.ExportedFunction("grow")
	for _, tc := range []struct {
		by   uint32
		want int32 // the size before, or -1 where the grow fails
	}{
		{meter.MaxTableElements, -1}, // 16 + 2^20 > the bound
		{meter.MaxTableElements - 16, 16},
		{1, -1},
	} {
		res, err := grow.Call(ctx, uint64(tc.by))
		if err != nil {
			t.Fatal(err)
		}
		if got := int32(res[0]); got != tc.want {
			t.Fatalf("table.grow by %d = %d, want %d", tc.by, got, tc.want)
		}
	}
}

// BenchmarkInstrument measures Instrument of the 2.3 MB Go lru plugin, which
// every start pays before the compilation cache is consulted. Ceiling: 20 ms,
// a fifth of the 100 ms warm-start budget.
func BenchmarkInstrument(b *testing.B) {
	in := read(b, root+"/plugins/wasm/lru.wasm")
	b.SetBytes(int64(len(in)))
	for b.Loop() {
		if _, err := meter.Instrument(in); err != nil {
			b.Fatal(err)
		}
	}
	per := b.Elapsed().Seconds() / float64(b.N)
	b.ReportMetric(per*1000, "ms/op")
	b.ReportMetric(per/0.020, "of-ceiling")
}
