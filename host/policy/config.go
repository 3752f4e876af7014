package policy

import (
	"fmt"
	"log/slog"
	"runtime"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/tetratelabs/wazero"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
)

// Defaults of Config.
const (
	DefaultShards        = 4
	DefaultMemoryLimit   = 64 << 20
	DefaultCallTimeout   = 100 * time.Millisecond
	DefaultMaxFailures   = 3
	DefaultFailureWindow = time.Minute
)

// Host configuration keys passed to kvhost_init besides Config.Params.
const (
	// ParamShard is the index of the instance receiving the configuration.
	ParamShard = "kvhost.shard"
	// ParamShards is the number of instances of the plugin.
	ParamShards = "kvhost.shards"
)

// wasmPage is the size of a wasm memory page.
const wasmPage = 65536

// Config configures a policy Host. The zero value is usable: every zero field
// takes its default.
type Config struct {
	// Shards is the number of plugin instances the policy state is split
	// over; calls on different shards run in parallel. Zero means
	// DefaultShards capped at GOMAXPROCS.
	Shards int
	// MemoryLimit is the most linear memory, in bytes, one instance may
	// have; a multiple of 64 KiB. Zero means DefaultMemoryLimit.
	MemoryLimit int64
	// CallTimeout is the deadline of one hook call. A call gets fuel in
	// proportion to it (2 units, wasm instructions, per nanosecond), which
	// stops a call that runs on; a call that returns within its fuel but
	// after CallTimeout is counted in Stats.SlowCalls, not failed. Zero
	// means DefaultCallTimeout.
	CallTimeout time.Duration
	// CacheDir, if set, is a directory for wazero's on-disk compilation
	// cache: a second start with the same module compiles nothing. A cache
	// file damaged on disk is logged as a warning and the module's entry
	// rewritten; a directory that cannot be written is logged and the
	// module compiled without the cache.
	CacheDir string
	// Cache, if set, is used instead of CacheDir. It lets tests and tools
	// share an in-memory cache between hosts. The Host does not close it.
	Cache wazero.CompilationCache
	// Params is the plugin configuration, passed to kvhost_init as
	// "key=value" lines together with ParamShard and ParamShards. Keys
	// starting with "kvhost." are reserved for the host.
	Params map[string]string
	// MaxFailures failures of the plugin within FailureWindow switch the
	// Host to Fallback. Zero means DefaultMaxFailures.
	MaxFailures int
	// FailureWindow: see MaxFailures. Zero means DefaultFailureWindow.
	FailureWindow time.Duration
	// Fallback builds the native policy of one shard the Host switches to
	// when the plugin keeps failing. Nil means no fallback: the Host keeps
	// replacing failed instances and returns their errors.
	Fallback func() guest.Policy
	// FallbackParams is Fallback's configuration, passed to its
	// kvhost_init as Params is to the plugin's (Params, the plugin's own
	// keys, are not). If Fallback refuses them when the Host switches to
	// it, it runs without them: the fallback must serve whatever the
	// plugin's configuration.
	FallbackParams map[string]string
	// FallbackName names Fallback in logs and Stats.FallbackPolicy;
	// default "native".
	FallbackName string
	// Interim, if set, builds the native policy of one shard that a
	// Host serves while its module loads, so that a slow compilation (a
	// Go plugin of a few MB compiles in seconds without the compilation
	// cache) does not hold up the caller: Open waits at most LoadTimeout
	// for the module (compiled, validated, every instance made), then
	// returns a Host running Interim, configured with InterimParams, and
	// switches it to the plugin, rebuilt from the Index, once the module
	// has loaded (Host.WaitLoaded). A module that then fails to load
	// leaves the Host on Interim, as its fallback (Stats.Fallback, the
	// reason in Stats.FallbackReason). Nil: Open waits for the module.
	// NewNative ignores it.
	Interim func() guest.Policy
	// InterimParams is Interim's configuration, passed as Params is to
	// the plugin's kvhost_init; Interim must accept it (a refusal fails
	// Open).
	InterimParams map[string]string
	// InterimName names Interim in logs; default "native".
	InterimName string
	// LoadTimeout is how long Open waits for the module before it serves
	// Interim; zero serves Interim from the start. Without Interim it
	// does not apply.
	LoadTimeout time.Duration
	// Logger receives the host's and the plugin's log messages. Nil means
	// slog.Default().
	Logger *slog.Logger
	// OnCall, if set, is called after every call into a policy instance
	// with the hook's export name ("kvhost_name", ...), the number of
	// records passed and how long the instance ran (without the host's
	// validation). The conformance suite uses it to report call times per
	// hook. It runs on the caller's path: it must be fast and safe for
	// concurrent use.
	OnCall func(hook string, records int, took time.Duration)
}

// withDefaults returns c with defaults applied, or an error naming the first
// invalid field.
func (c Config) withDefaults() (Config, error) {
	fail := func(format string, args ...any) (Config, error) {
		return c, fmt.Errorf("%w: %s", ErrConfig, fmt.Sprintf(format, args...))
	}
	switch {
	case c.Shards < 0:
		return fail("Shards = %d: want 0 (default) or more", c.Shards)
	case c.Shards > 1024:
		return fail("Shards = %d: want at most 1024", c.Shards)
	case c.Shards == 0:
		c.Shards = min(DefaultShards, runtime.GOMAXPROCS(0))
	}
	switch {
	case c.MemoryLimit == 0:
		c.MemoryLimit = DefaultMemoryLimit
	case c.MemoryLimit < wasmPage || c.MemoryLimit%wasmPage != 0:
		return fail("MemoryLimit = %d: want a positive multiple of 64 KiB", c.MemoryLimit)
	case c.MemoryLimit > 4<<30:
		return fail("MemoryLimit = %d: want at most 4 GiB (the wasm32 address space)", c.MemoryLimit)
	}
	switch {
	case c.CallTimeout == 0:
		c.CallTimeout = DefaultCallTimeout
	case c.CallTimeout < 0:
		return fail("CallTimeout = %v: want a positive duration", c.CallTimeout)
	}
	switch {
	case c.MaxFailures == 0:
		c.MaxFailures = DefaultMaxFailures
	case c.MaxFailures < 0:
		return fail("MaxFailures = %d: want a positive count", c.MaxFailures)
	}
	switch {
	case c.FailureWindow == 0:
		c.FailureWindow = DefaultFailureWindow
	case c.FailureWindow < 0:
		return fail("FailureWindow = %v: want a positive duration", c.FailureWindow)
	}
	for _, p := range []struct {
		field  string
		params map[string]string
	}{{"Params", c.Params}, {"FallbackParams", c.FallbackParams}, {"InterimParams", c.InterimParams}} {
		for k, v := range p.params {
			switch {
			case k == "" || strings.ContainsAny(k, "=\n") || strings.TrimSpace(k) != k:
				return fail("%s key %q: want a non-empty key without '=', newlines or surrounding spaces", p.field, k)
			case strings.HasPrefix(k, "kvhost."):
				return fail("%s key %q: keys starting with \"kvhost.\" are reserved for the host", p.field, k)
			case strings.Contains(v, "\n"):
				return fail("%s[%q]: value contains a newline", p.field, k)
			}
		}
	}
	if c.LoadTimeout < 0 {
		return fail("LoadTimeout = %v: want 0 (serve Interim at once) or more", c.LoadTimeout)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c, nil
}

// initConfigs returns the kvhost_init configuration of every shard: params
// (Params or FallbackParams, named field in errors) and the host's keys.
func (c *Config) initConfigs(field string, params map[string]string) ([][]byte, error) {
	keys := make([]string, 0, len(params))
	for k := range params {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var common []byte
	for _, k := range keys {
		common = fmt.Appendf(common, "%s=%s\n", k, params[k])
	}
	out := make([][]byte, c.Shards)
	for shard := range out {
		b := fmt.Appendf(slices.Clip(common), "%s=%d\n%s=%d\n", ParamShard, shard, ParamShards, c.Shards)
		if len(b) > abi.MaxConfigLen {
			return nil, fmt.Errorf("%w: %s encode to %d bytes, more than %d", ErrConfig, field, len(b), abi.MaxConfigLen)
		}
		out[shard] = b
	}
	return out, nil
}
