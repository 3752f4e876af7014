package policy

import (
	"context"
	"fmt"
	"maps"
	"slices"

	"github.com/tetratelabs/wazero"
	"github.com/tetratelabs/wazero/api"
	"github.com/tetratelabs/wazero/imports/wasi_snapshot_preview1"

	"github.com/kvhost/kvhost/host/policy/internal/meter"
)

// hostCallFuel is the fuel every call of an imported function (kvhost.log
// and WASI) spends before it runs, besides the meter's charge for the call
// instruction: a loop of the cheapest calls (clock_time_get, a log
// message over the rate limit) takes 150–370 ns per call on the 2-core
// CI machine, where wasm code spends 1 to 4 units per nanosecond. A Go
// plugin's hooks make almost none (its runtime's calls are in
// _initialize).
const hostCallFuel = 512

// hostParamFuel is the fuel per unit of a host function's parameter named
// name (as wazero names WASI's parameters) that sizes the host's work: 0
// for the others. Measured on the 2-core CI machine: 27–36 ns per iovec
// written (stdout, the stderr tail), 4 per iovec read, 95 per poll
// subscription, 2.3 per random byte, up to 20 per path byte (copied,
// cleaned and checked before the descriptor is looked up).
func hostParamFuel(name string) uint64 {
	switch name {
	case "iovs_len", "ri_data_len", "si_data_len":
		return 64
	case "nsubscriptions":
		return 192
	case "path_len", "old_path_len", "new_path_len":
		return 40
	case "buf_len":
		return 5
	}
	return 0
}

// hostFuelError is the panic of a host call whose fuel does not cover its
// work: wazero turns it into the wasm call's error, and the fuel, left
// below zero, makes the call's failure read "ran out of fuel".
type hostFuelError struct{ fn string }

func (e *hostFuelError) Error() string { return "ran out of fuel in host function " + e.fn }

// metered returns fn, the host function name whose parameters are named
// params, spending from the calling module's fuel before each call:
// hostCallFuel and hostParamFuel per unit of each sizing parameter. A call
// whose fuel does not cover it fails before any of its work, so a plugin
// cannot run on in host functions (millions of iovecs or poll
// subscriptions in one call, megabytes of random bytes or of path, a loop
// of cheap calls) past the fuel of its call.
func metered(name string, params []string, fn api.GoModuleFunction) api.GoModuleFunction {
	type sizing struct {
		param int
		fuel  uint64
	}
	var sizes []sizing
	for i, p := range params {
		if f := hostParamFuel(p); f > 0 {
			sizes = append(sizes, sizing{i, f})
		}
	}
	return api.GoModuleFunc(func(ctx context.Context, mod api.Module, stack []uint64) {
		cost := uint64(hostCallFuel)
		for _, s := range sizes {
			cost += s.fuel * uint64(uint32(stack[s.param]))
		}
		spend(mod, name, cost)
		fn.Call(ctx, mod, stack)
	})
}

// spend takes cost units from mod's fuel (the meter's global), panicking
// with a *hostFuelError when they are not there.
func spend(mod api.Module, fn string, cost uint64) {
	g, ok := mod.ExportedGlobal(meter.ExportName).(api.MutableGlobal)
	if !ok {
		// Every module the host instantiates is metered.
		panic(fmt.Errorf("host function %s called by a module without the global %s", fn, meter.ExportName))
	}
	left := int64(g.Get()) - int64(cost)
	g.Set(uint64(left))
	if left < 0 {
		panic(&hostFuelError{fn: fn})
	}
}

// instantiateWASI instantiates WASI preview 1 in r with every function
// metered: wazero's own functions, compiled in a module that is never
// instantiated, exported again through metered.
func instantiateWASI(ctx context.Context, r wazero.Runtime) error {
	src := r.NewHostModuleBuilder(wasi_snapshot_preview1.ModuleName)
	wasi_snapshot_preview1.NewFunctionExporter().ExportFunctions(src)
	cm, err := src.Compile(ctx)
	if err != nil {
		return err
	}
	defer cm.Close(ctx)
	defs := cm.ExportedFunctions()
	b := r.NewHostModuleBuilder(wasi_snapshot_preview1.ModuleName)
	for _, name := range slices.Sorted(maps.Keys(defs)) {
		def := defs[name]
		fn, ok := def.GoFunction().(api.GoModuleFunction)
		if !ok {
			return fmt.Errorf("%s is not a Go function of the calling module", name)
		}
		b.NewFunctionBuilder().
			WithGoModuleFunction(metered(wasi_snapshot_preview1.ModuleName+"."+name, def.ParamNames(), fn), def.ParamTypes(), def.ResultTypes()).
			WithParameterNames(def.ParamNames()...).
			WithResultNames(def.ResultNames()...).
			Export(name)
	}
	_, err = b.Instantiate(ctx)
	return err
}
