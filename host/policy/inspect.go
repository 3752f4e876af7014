package policy

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync/atomic"

	"github.com/tetratelabs/wazero"
	"github.com/tetratelabs/wazero/api"
	"github.com/tetratelabs/wazero/imports/wasi_snapshot_preview1"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy/internal/meter"
)

// Info describes a plugin module: what Inspect finds and what Open checks.
type Info struct {
	// Size is the module's size in bytes.
	Size int
	// ABIVersion is what kvhost_abi_version returned; valid when
	// VersionKnown.
	ABIVersion   int32
	VersionKnown bool // an instance was asked: ABIVersion and Features are set
	// Features is what kvhost_features returned.
	Features abi.Feature
	// Hooks lists the ABI exports present, in ABI order.
	Hooks []string
	// Exports lists every exported function with its signature, sorted.
	Exports []string
	// Imports lists every imported function as "module.name(params) results".
	Imports []string
	// MemoryMin and MemoryMax are the exported memory's limits in 64 KiB
	// pages; MemoryMax is valid when MemoryMaxSet.
	MemoryMin    uint32
	MemoryMax    uint32 // maximum in pages, when MemoryMaxSet
	MemoryMaxSet bool   // the memory declares a maximum
	// Problems lists every way the module falls short of ABI v1; empty
	// when Open would accept it.
	Problems []string
}

// OK reports whether the module implements ABI v1.
func (i *Info) OK() bool { return len(i.Problems) == 0 }

// abiExport is one export of ABI v1 and its signature.
type abiExport struct {
	name    string
	params  []api.ValueType
	results []api.ValueType
	feature abi.Feature // required only with this feature; 0: always
}

var (
	i32 = api.ValueTypeI32
	i64 = api.ValueTypeI64
)

// abiExports is every function export of ABI v1, in documentation order.
var abiExports = []abiExport{
	{abi.ExportABIVersion, nil, []api.ValueType{i32}, 0},
	{abi.ExportFeatures, nil, []api.ValueType{i64}, 0},
	{abi.ExportScratch, []api.ValueType{i32}, []api.ValueType{i32}, 0},
	{abi.ExportInit, []api.ValueType{i32}, []api.ValueType{i32}, 0},
	{abi.ExportNamespace, nil, []api.ValueType{i32}, abi.FeatureNamespace},
	{abi.ExportName, []api.ValueType{i32}, []api.ValueType{i32}, 0},
	{abi.ExportAdmit, []api.ValueType{i32}, []api.ValueType{i32}, abi.FeatureAdmit},
	{abi.ExportAccess, []api.ValueType{i32}, []api.ValueType{i32}, 0},
	{abi.ExportEvict, []api.ValueType{i32}, []api.ValueType{i32}, 0},
	{abi.ExportMounts, []api.ValueType{i32}, []api.ValueType{i32}, abi.FeatureMounts},
	{abi.ExportTick, []api.ValueType{i32}, []api.ValueType{i32}, abi.FeatureTick},
	{abi.ExportRank, []api.ValueType{i32}, []api.ValueType{i32}, abi.FeatureRank},
}

// describe lists a compiled module's exports, imports and memory, and
// every problem that needs no instance to find: missing or mistyped
// exports (those of optional features are checked by checkIdentity),
// imports the host does not provide, a missing memory.
func describe(cm wazero.CompiledModule, size int) Info {
	info := Info{Size: size}
	exports := cm.ExportedFunctions()
	for name, def := range exports {
		info.Exports = append(info.Exports, name+signature(def))
	}
	slices.Sort(info.Exports)
	for _, e := range abiExports {
		def, ok := exports[e.name]
		switch {
		case ok && !slices.Equal(def.ParamTypes(), e.params) || ok && !slices.Equal(def.ResultTypes(), e.results):
			info.Problems = append(info.Problems, fmt.Sprintf("export %s has signature %s, want %s",
				e.name, signature(def), sig(e.params, e.results)))
		case ok:
			info.Hooks = append(info.Hooks, e.name)
		case e.feature == 0:
			info.Problems = append(info.Problems, fmt.Sprintf("missing export %s%s", e.name, sig(e.params, e.results)))
		}
	}
	if def, ok := exports[exportInitialize]; ok && (len(def.ParamTypes()) > 0 || len(def.ResultTypes()) > 0) {
		info.Problems = append(info.Problems, fmt.Sprintf("export %s has signature %s, want ()", exportInitialize, signature(def)))
	}
	if mem, ok := cm.ExportedMemories()[abi.ExportMemory]; ok {
		info.MemoryMin = mem.Min()
		info.MemoryMax, info.MemoryMaxSet = mem.Max()
	} else {
		info.Problems = append(info.Problems, `missing export "memory" (the linear memory the scratch area lives in)`)
	}
	for _, def := range cm.ImportedFunctions() {
		mod, name, _ := def.Import()
		info.Imports = append(info.Imports, mod+"."+name+signature(def))
		switch {
		case mod == abi.ImportModule && name == abi.ImportLog:
			if !slices.Equal(def.ParamTypes(), []api.ValueType{i32, i32, i32}) || len(def.ResultTypes()) > 0 {
				info.Problems = append(info.Problems, fmt.Sprintf("import %s.%s has signature %s, want (i32, i32, i32)",
					mod, name, signature(def)))
			}
		case mod == wasi_snapshot_preview1.ModuleName:
		default:
			info.Problems = append(info.Problems, fmt.Sprintf("imports %s.%s, which the host does not provide (allowed: %s.%s and %s functions)",
				mod, name, abi.ImportModule, abi.ImportLog, wasi_snapshot_preview1.ModuleName))
		}
	}
	for _, def := range cm.ImportedMemories() {
		mod, name, _ := def.Import()
		info.Problems = append(info.Problems, fmt.Sprintf("imports memory %s.%s: a plugin must define and export its own memory", mod, name))
	}
	return info
}

// checkIdentity adds the problems of the ABI version and features once
// they are known.
func (i *Info) checkIdentity() {
	if i.ABIVersion != abi.Version {
		i.Problems = append(i.Problems, fmt.Sprintf("%s returned %d, want %d (this host implements ABI v%d)",
			abi.ExportABIVersion, i.ABIVersion, abi.Version, abi.Version))
	}
	if rest := i.Features &^ abi.KnownFeatures; rest != 0 {
		i.Problems = append(i.Problems, fmt.Sprintf("%s returned unknown feature bits %#x (ABI v%d defines %#x)",
			abi.ExportFeatures, uint64(rest), abi.Version, uint64(abi.KnownFeatures)))
	}
	if i.Features.Has(abi.FeatureAdmitMount) && !i.Features.Has(abi.FeatureAdmit) {
		i.Problems = append(i.Problems, fmt.Sprintf("declares feature %s without %s: admission that chooses a mount needs %s",
			abi.FeatureAdmitMount, abi.FeatureAdmit, abi.ExportAdmit))
	}
	for _, e := range abiExports {
		if e.feature != 0 && i.Features.Has(e.feature) && !slices.Contains(i.Hooks, e.name) {
			i.Problems = append(i.Problems, fmt.Sprintf("declares feature %s but does not export %s%s",
				e.feature, e.name, sig(e.params, e.results)))
		}
	}
}

// Inspect describes a plugin module without running any hook beyond
// kvhost_abi_version, kvhost_features and kvhost_scratch (and the module's
// _initialize), the checks Open makes of its first instance (probe). It
// returns an error only when the module cannot be compiled or
// instantiated; every other shortcoming is listed in Info.Problems. It uses
// wazero's interpreter: the few calls it makes cost less than compiling a
// large module to machine code.
func Inspect(ctx context.Context, module []byte) (Info, error) {
	cfg, _ := Config{Logger: slog.New(slog.DiscardHandler)}.withDefaults()
	r := wazero.NewRuntimeWithConfig(ctx, wazero.NewRuntimeConfigInterpreter().
		WithMemoryLimitPages(uint32(cfg.MemoryLimit/wasmPage)))
	defer r.Close(ctx)
	// Inspect runs the module as Open does: metered. A module the meter
	// refuses is described, unrun, with the reason among its problems.
	code, merr := meter.Instrument(module)
	if merr != nil {
		code = module
	}
	cm, err := r.CompileModule(ctx, code)
	if err != nil {
		return Info{Size: len(module)}, fmt.Errorf("%w: %v", ErrModule, err)
	}
	info := describe(cm, len(module))
	if merr != nil {
		info.Problems = append(info.Problems, fmt.Sprintf("cannot be metered: %v", merr))
		return info, nil
	}
	for _, p := range info.Problems {
		if strings.HasPrefix(p, "imports ") || strings.HasPrefix(p, "missing export \"memory\"") ||
			strings.Contains(p, abi.ExportABIVersion) || strings.Contains(p, abi.ExportFeatures) {
			return info, nil // no instance to ask
		}
	}
	b := &wasmBackend{name: "inspect", cfg: &cfg, log: cfg.Logger, r: r, cm: cm, limitPages: uint32(cfg.MemoryLimit / wasmPage),
		slow: new(atomic.Uint64)} // a slow call (a loaded machine) is counted, not a crash
	if err := instantiateHostModules(ctx, r, b.hostLog); err != nil {
		return info, err
	}
	in, err := b.probe(ctx, &info)
	if err != nil {
		return info, fmt.Errorf("%w: %v", ErrModule, err)
	}
	if in != nil {
		in.close(ctx)
	}
	return info, nil
}

func signature(def api.FunctionDefinition) string { return sig(def.ParamTypes(), def.ResultTypes()) }

func sig(params, results []api.ValueType) string {
	name := func(ts []api.ValueType) string {
		s := make([]string, len(ts))
		for i, t := range ts {
			s[i] = api.ValueTypeName(t)
		}
		return strings.Join(s, ", ")
	}
	out := "(" + name(params) + ")"
	if len(results) > 0 {
		out += " -> " + name(results)
	}
	return out
}
