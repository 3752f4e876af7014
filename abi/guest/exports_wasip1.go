//go:build wasip1

package guest

import (
	"unsafe"

	"github.com/kvhost/kvhost/abi"
)

// plugin is the dispatcher the wasm exports drive. A wasm module has exactly
// one policy, so it lives in the package: this is the SDK's only package-level
// state, and it exists only in wasip1 builds.
var plugin *Dispatcher

// Register makes p the policy this wasm module exports. Call it from an init
// function of the plugin's main package.
func Register(p Policy) {
	plugin = NewDispatcher(p)
	plugin.Log = Log
}

// Log sends a message to the host's log at a log/slog level.
func Log(level int32, msg string) {
	if len(msg) == 0 {
		return
	}
	hostLog(level, uint32(uintptr(unsafe.Pointer(unsafe.StringData(msg)))), uint32(len(msg)))
}

//go:wasmimport kvhost log
func hostLog(level int32, ptr, n uint32)

//go:wasmexport kvhost_abi_version
func exportABIVersion() int32 { return abi.Version }

//go:wasmexport kvhost_features
func exportFeatures() int64 {
	if plugin == nil {
		return 0
	}
	return int64(plugin.Features())
}

//go:wasmexport kvhost_scratch
func exportScratch(n int32) int32 {
	if plugin == nil {
		return 0
	}
	b := plugin.Scratch(int(n))
	if len(b) == 0 {
		return 0
	}
	return int32(uintptr(unsafe.Pointer(unsafe.SliceData(b))))
}

//go:wasmexport kvhost_init
func exportInit(n int32) int32 {
	if plugin == nil {
		return int32(abi.StatusInternal)
	}
	return plugin.Init(n)
}

//go:wasmexport kvhost_namespace
func exportNamespace() int32 { return plugin.Namespace() }

//go:wasmexport kvhost_name
func exportName(n int32) int32 { return plugin.Name(n) }

//go:wasmexport kvhost_admit
func exportAdmit(n int32) int32 { return plugin.Admit(n) }

//go:wasmexport kvhost_access
func exportAccess(n int32) int32 { return plugin.Access(n) }

//go:wasmexport kvhost_evict
func exportEvict(max int32) int32 { return plugin.Evict(max) }

//go:wasmexport kvhost_mounts
func exportMounts(n int32) int32 { return plugin.Mounts(n) }

//go:wasmexport kvhost_tick
func exportTick(max int32) int32 { return plugin.Tick(max) }

//go:wasmexport kvhost_rank
func exportRank(n int32) int32 { return plugin.Rank(n) }
