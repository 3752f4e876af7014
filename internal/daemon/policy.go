// Package daemon assembles the kvhost daemon. This file is its policy
// lifecycle, the one owner of loading a placement policy (a built-in
// name or a .wasm file: Module), building the host the engine runs with
// its native fallback (Build, at the start and at each reload), keeping
// the running one and the counters of those a reload replaced
// (PolicyState), and starting a policy as the daemon would for the
// checks (StartPolicy, PolicyFault).
package daemon

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/plugins"
	"github.com/kvhost/kvhost/plugins/lru"
	"github.com/kvhost/kvhost/plugins/tiered"
)

// IsPluginFile reports whether a policy name is a plugin file (it ends in
// .wasm or contains a '/') rather than a built-in policy's name.
func IsPluginFile(arg string) bool {
	return strings.HasSuffix(arg, ".wasm") || strings.Contains(arg, "/")
}

// Module resolves policy.name (--policy): a built-in name or a .wasm file. A
// bare file name (no path separator) that does not exist and names a
// built-in policy, such as lru.wasm, is that built-in (builtin true; the
// caller says so). A file that is not a WebAssembly module is refused
// here, naming its path. A built-in missing from the binary yields a nil
// module for lru, which then runs natively. A relative file that cannot
// be read is named with the working directory it was taken against,
// which is not the configuration file's.
func Module(nameOrFile string) (module []byte, name string, builtin bool, err error) {
	if IsPluginFile(nameOrFile) {
		b, err := os.ReadFile(nameOrFile)
		if errors.Is(err, os.ErrNotExist) && !strings.ContainsRune(nameOrFile, '/') && !strings.ContainsRune(nameOrFile, os.PathSeparator) {
			name := strings.TrimSuffix(nameOrFile, ".wasm")
			if b, berr := plugins.Wasm(name); berr == nil {
				return b, name, true, nil
			}
		}
		if err != nil {
			if wd, werr := os.Getwd(); werr == nil && !filepath.IsAbs(nameOrFile) {
				return nil, "", false, fmt.Errorf("policy: %w (a relative path is taken against the working directory, %s, not the configuration file's)", err, wd)
			}
			return nil, "", false, fmt.Errorf("policy: %w", err)
		}
		if !bytes.HasPrefix(b, []byte(wasmMagic)) {
			return nil, "", false, fmt.Errorf("policy %s: %w", nameOrFile, ErrNotWasm)
		}
		return b, strings.TrimSuffix(filepath.Base(nameOrFile), ".wasm"), false, nil
	}
	b, err := plugins.Wasm(nameOrFile)
	if err != nil {
		if nameOrFile == plugins.Default {
			return nil, nameOrFile, true, nil
		}
		return nil, "", false, err
	}
	return b, nameOrFile, true, nil
}

// wasmMagic begins every WebAssembly module.
const wasmMagic = "\x00asm"

// ErrNotWasm is Module's error for a policy file that is not a
// WebAssembly module.
var ErrNotWasm = errors.New("not a WebAssembly module (it does not begin with \\0asm)")

// Fallback is the native policy a failing plugin falls back to and the
// configuration it takes.
type Fallback struct {
	Name    string
	New     func() guest.Policy
	Params  map[string]string // the keys of [policy.params] it knows
	Ignored []string          // the others, sorted
}

// FallbackFor is the native policy a failing plugin falls back to: on a
// daemon with several kvhost mounts the mount-aware tiered policy (its
// defaults: mount 0 hot, mount 1 cold), since lru would put every new file
// on mount 0 and delete what it evicts there instead of demoting it; lru
// otherwise. Both name files alike (lru's scheme). It takes the keys of
// [policy.params] it knows, which mean for it what they mean for the
// built-in plugins; any other would fail its every start.
func FallbackFor(cfg config.Config) Fallback {
	fb := Fallback{Name: lru.Name, New: func() guest.Policy { return lru.New() }}
	known := lru.Keys()
	if kvhostMounts(cfg) > 1 {
		fb = Fallback{Name: tiered.Name, New: func() guest.Policy { return tiered.New() }}
		known = tiered.Keys()
	}
	fb.Params = cfg.Policy.PolicyParams()
	for k := range fb.Params {
		if !slices.Contains(known, k) {
			fb.Ignored = append(fb.Ignored, k)
			delete(fb.Params, k)
		}
	}
	slices.Sort(fb.Ignored)
	return fb
}

// kvhostMounts counts the mounts of kvhost's own layout (not vllm-fs).
func kvhostMounts(cfg config.Config) int {
	n := 0
	for _, m := range cfg.Mounts {
		if m.Layout != config.LayoutVLLMFS {
			n++
		}
	}
	return n
}

// PolicyState is the policy the engine runs, for stats and metrics: the
// current host and the counters of the hosts reloads replaced (counters
// never go down).
type PolicyState struct {
	mu      sync.Mutex
	cur     *Policy
	retired policy.Stats
}

func (p *PolicyState) Swap(b *Policy) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cur != nil && p.cur.host != nil {
		addCounters(&p.retired, p.cur.host.Stats())
	}
	p.cur = b
}

// addCounters adds the counters of from to into (not the state fields:
// Fallback, FallbackReason, Backend).
func addCounters(into *policy.Stats, from policy.Stats) {
	if into.Calls == nil {
		into.Calls = map[string]uint64{}
	}
	if into.Records == nil {
		into.Records = map[string]uint64{}
	}
	for k, v := range from.Calls {
		into.Calls[k] += v
	}
	for k, v := range from.Records {
		into.Records[k] += v
	}
	into.Failures += from.Failures
	into.Rejections += from.Rejections
	into.Replacements += from.Replacements
	into.StaleVictims += from.StaleVictims
	into.SlowCalls += from.SlowCalls
}

func (p *PolicyState) Name() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cur == nil {
		return ""
	}
	return p.cur.Name
}

// Current is the policy running now.
func (p *PolicyState) Current() *Policy {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cur
}

// PolicyInfo is the running policy's name and its host's cumulative
// counters (PolicyState.State).
type PolicyInfo struct {
	Name  string       // the configured policy
	Stats policy.Stats // the host's counters, those a reload replaced added
}

// State is the policy's name and cumulative counters.
func (p *PolicyState) State() PolicyInfo {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cur == nil || p.cur.host == nil {
		return PolicyInfo{}
	}
	s := p.cur.host.Stats()
	addCounters(&s, p.retired)
	return PolicyInfo{Name: p.cur.Name, Stats: s}
}

// Policy is a policy configuration ready to build: fn builds the host
// (the engine calls it with its index) and records it in host.
type Policy struct {
	Name   string
	Sum    [32]byte // of the wasm module (zero: native)
	Config config.Policy
	// New builds the policy on the engine's index (engine.Config's
	// NewPolicy) and records the host it built.
	New  func(idx policy.Index) (policy.Policy, error)
	host *policy.Host
}

// Host is the policy host New built last, nil before (or for a build
// that failed).
func (b *Policy) Host() *policy.Host { return b.host }

// BuildOptions are what Build takes beyond the configuration.
type BuildOptions struct {
	// Log is the daemon's log (nil: none).
	Log *slog.Logger
	// OnCall, if set, observes every call into the policy (the
	// metrics' ObservePolicyCall).
	OnCall func(hook string, records int, took time.Duration)
	// Locate names where a key's value was given (config.Flags.Locate;
	// nil: the error as it is).
	Locate func(key string, err error) error
}

// Build resolves cfg's policy (reading a .wasm file now, so that a
// missing file fails here) and returns its builder: the one place that
// loads a policy, at the start and at a reload, and gives it its native
// fallback.
func Build(ctx context.Context, cfg config.Config, o BuildOptions) (*Policy, error) {
	log := o.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	module, name, builtin, err := Module(cfg.Policy.Name)
	if err != nil {
		if o.Locate != nil {
			err = o.Locate("policy.name", err)
		}
		return nil, err
	}
	if builtin && IsPluginFile(cfg.Policy.Name) {
		log.Info("no such policy file: serving the built-in policy of that name", "file", cfg.Policy.Name, "policy", name)
	}
	b := &Policy{Name: name, Config: cfg.Policy}
	if module != nil {
		b.Sum = sha256.Sum256(module)
	}
	pcfg := policy.Config{
		Shards:        cfg.Policy.Shards,
		MemoryLimit:   int64(cfg.Policy.MemoryLimit),
		CallTimeout:   time.Duration(cfg.Policy.CallTimeout),
		CacheDir:      cfg.Policy.CacheDir,
		Params:        cfg.Policy.PolicyParams(),
		MaxFailures:   cfg.Policy.MaxFailures,
		FailureWindow: time.Duration(cfg.Policy.FailureWindow),
		Logger:        log,
	}
	fb := FallbackFor(cfg)
	pcfg.FallbackName, pcfg.Fallback, pcfg.FallbackParams = fb.Name, fb.New, fb.Params
	if module != nil && len(fb.Ignored) > 0 {
		log.Info("the native fallback policy ignores these [policy.params]", "policy", name,
			"fallback", fb.Name, "keys", strings.Join(fb.Ignored, ","))
	}
	pcfg.OnCall = o.OnCall
	// The module compiles in the background: a built-in policy serves
	// its native build (the same Go code) from the start, a plugin file
	// the native fallback once policy.load_timeout has passed; the
	// plugin replaces it when loaded (docs/policy-host.md, Loading).
	if native, ok := plugins.Native(name); ok && builtin {
		pcfg.Interim, pcfg.InterimName, pcfg.InterimParams = native, name+" (native)", pcfg.Params
	} else if !builtin {
		pcfg.Interim, pcfg.InterimName, pcfg.InterimParams = fb.New, fb.Name, fb.Params
		pcfg.LoadTimeout = time.Duration(cfg.Policy.LoadTimeout)
	}
	if pcfg.CacheDir == "" {
		pcfg.CacheDir = filepath.Join(config.DefaultRoot(), "wasm-cache")
	}
	if err := os.MkdirAll(pcfg.CacheDir, 0o750); err != nil {
		log.Warn("no compilation cache for the policy", "dir", pcfg.CacheDir, "err", err)
		pcfg.CacheDir = ""
	}
	b.New = func(idx policy.Index) (policy.Policy, error) {
		if module != nil {
			start := time.Now()
			h, err := policy.Open(ctx, module, name, idx, pcfg)
			if err == nil {
				if !h.Stats().Loading {
					log.Info("policy ready", "policy", name, "shards", h.Shards(), "took", time.Since(start).String())
				}
				b.host = h
				return h, nil
			}
			if ctx.Err() != nil {
				return nil, fmt.Errorf("policy %s: %w", name, ctx.Err())
			}
			// An init the plugin refused (its [policy.params]) would be
			// refused by the native build too: only a module that does
			// not load is worth the fallback.
			var pe *policy.Error
			isPolicyErr := errors.As(err, &pe)
			if !builtin || name != plugins.Default || (isPolicyErr && pe.Hook == "kvhost_init") {
				if isPolicyErr {
					return nil, err // it names the policy already
				}
				return nil, fmt.Errorf("policy %s: %w", name, err)
			}
			log.Warn("the built-in wasm policy does not load; running its native build", "policy", name, "err", err)
		}
		if module == nil {
			log.Warn("this binary embeds no wasm policy (plugins/wasm was empty when it was built); running the native lru policy", "policy", name)
		}
		h, err := policy.NewNative(func() guest.Policy { return lru.New() }, idx, pcfg)
		b.host = h
		return h, err
	}
	return b, nil
}

// noEntries is the index StartPolicy builds a policy on: the daemon's
// start gives the engine's, and no plugin's kvhost_init depends on it.
type noEntries struct{}

func (noEntries) Lookup(uint64) (policy.Entry, bool) { return policy.Entry{}, false }
func (noEntries) Range(func(policy.Entry) bool)      {}
func (noEntries) Namespaces() []abi.NamespaceRecord  { return nil }

// StartPolicy builds cfg's policy as the daemon's start builds it (its
// Build, then the constructor the engine calls: the module
// compiled, each shard's kvhost_init given [policy.params]), on an empty
// index, and closes it; it returns the policy built and its features,
// or the error the daemon's start would stop on. The module is compiled
// through a cache of the running user's own (config.DefaultRoot), kept
// from one check to the next, never the daemon's policy.cache_dir (one
// made by root would leave a daemon of another user without a cache);
// where it cannot be made, without one, as the daemon does.
func StartPolicy(ctx context.Context, cfg config.Config) (*Policy, abi.Feature, error) {
	cfg.Policy.CacheDir = filepath.Join(config.DefaultRoot(), "check-wasm-cache")
	b, err := Build(ctx, cfg, BuildOptions{})
	if err != nil {
		return nil, 0, err
	}
	p, err := b.New(noEntries{})
	if err != nil {
		return nil, 0, err
	}
	// The checks judge the module itself, not the policy serving while
	// it loads: wait for it, and fail as the module would.
	if b.host != nil {
		if err := b.host.WaitLoaded(ctx); err != nil {
			_ = p.Close(ctx)
			return nil, 0, fmt.Errorf("policy %s: %w", b.Name, err)
		}
	}
	features := p.Features()
	return b, features, p.Close(ctx)
}

// refusedParam finds the key a plugin's kvhost_init refuses in its
// message: the SDK's configuration errors (guest.ConfigError) read
// `config KEY = "VALUE": want ...`.
var refusedParam = regexp.MustCompile(`config (\S+) = "`)

// PolicyStartError places err, the daemon's start's error building the
// policy of cfg, at its key in file ("": none), as the checks report it
// (PolicyFault).
func PolicyStartError(file string, cfg config.Config, err error) *config.KeyError {
	key, err := PolicyFault(cfg, err)
	return config.AtKey(file, key, 0, fmt.Errorf("%w: the daemon would not start", err))
}

// PolicyFault returns the key of cfg that err, an error building its
// policy, is about: the [policy.params] key the plugin's kvhost_init
// names as refused (policy.params where it names none of them), else
// policy.name; and err with no prefix naming the policy a second time.
func PolicyFault(cfg config.Config, err error) (string, error) {
	key := "policy.name"
	var pe *policy.Error
	if errors.As(err, &pe) {
		err = pe // the engine's Open names the policy's construction in front
		if pe.Hook == "kvhost_init" {
			key = "policy.params"
			if m := refusedParam.FindStringSubmatch(pe.Err.Error()); m != nil {
				if _, ok := cfg.Policy.Params[m[1]]; ok {
					key += "." + m[1]
				}
			}
		}
	}
	return key, err
}

// mountAware are the features by which a policy places files on a mount
// other than the first: admission to a chosen mount, demotion between
// mounts.
const mountAware = abi.FeatureAdmitMount | abi.FeatureDemote

// SingleMountPolicy says why the policy name, declaring features f and
// given params ([policy.params]), leaves every kvhost mount but one
// empty, or "" where it places files by mount or is given one kvhost
// mount (vllm-fs mounts serve their own namespace and do not count). The
// mount it names is the one the policy places files on: its `mount`
// parameter (the built-in lru's, and any plugin built on its kit), which
// counts kvhost mounts from 0 in [[mount]] order, as the engine numbers
// them for the policy; the first mount where it is not given (or does
// not name one of them: the policy refuses it at start).
func SingleMountPolicy(name string, params map[string]any, f abi.Feature, mounts []config.Mount) string {
	var paths []string
	for _, m := range mounts {
		if m.Layout != config.LayoutVLLMFS {
			paths = append(paths, m.Path)
		}
	}
	if len(paths) < 2 || f&mountAware != 0 {
		return ""
	}
	at, which := 0, "the first mount"
	if v, given := params["mount"]; given {
		if i, err := strconv.Atoi(fmt.Sprint(v)); err == nil && i >= 0 && i < len(paths) {
			at = i
			which = fmt.Sprintf("mount %d (policy.params.mount = %d; mounts count from 0 in [[mount]] order)", i, i)
		}
	}
	others := "the other " + strconv.Itoa(len(paths)-1) + " mounts stay"
	if len(paths) == 2 {
		others = "the other mount stays"
	}
	return fmt.Sprintf("the policy %s places every file on %s, %s: %s empty and %s evicts when it fills; use the built-in tiered policy (policy.name = \"tiered\", docs/config.md) or a plugin that places files by mount",
		filepath.Base(name), which, paths[at], others, paths[at])
}

// SingleMountMsg is the message of WarnSingleMount's log line.
const SingleMountMsg = "policy: several mounts, but the policy uses one only"

// WarnSingleMount logs SingleMountPolicy's warning for the policy b now
// runs, if any.
func WarnSingleMount(log *slog.Logger, b *Policy, mounts []config.Mount) {
	var f abi.Feature
	if b.host != nil {
		f = b.host.Features()
	}
	if why := SingleMountPolicy(b.Name, b.Config.Params, f, mounts); why != "" {
		log.Warn(SingleMountMsg, "policy", b.Name, "why", why)
	}
}
