package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"regexp"
	"strconv"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/fstype"
	"github.com/kvhost/kvhost/plugins/tiered"
)

// mountAware are the features by which a policy places files on a mount
// other than the first: admission to a chosen mount, demotion between
// mounts.
const mountAware = abi.FeatureAdmitMount | abi.FeatureDemote

// singleMountPolicy says why the policy name, declaring features f,
// leaves every kvhost mount but the first empty, or "" where it places
// files by mount or is given one kvhost mount (vllm-fs mounts serve their
// own namespace and do not count).
func singleMountPolicy(name string, f abi.Feature, mounts []config.Mount) string {
	var paths []string
	for _, m := range mounts {
		if m.Layout != config.LayoutVLLMFS {
			paths = append(paths, m.Path)
		}
	}
	if len(paths) < 2 || f&mountAware != 0 {
		return ""
	}
	return fmt.Sprintf("the policy %s places every file on the first mount (%s): the other %d mounts stay empty and the first evicts when it fills; use the built-in tiered policy (policy.name = \"tiered\", docs/config.md) or a plugin that places files by mount",
		filepath.Base(name), paths[0], len(paths)-1)
}

// singleMountMsg is the message of warnSingleMount's log line.
const singleMountMsg = "policy: several mounts, but the policy uses the first only"

// warnSingleMount logs singleMountPolicy's warning for the policy b now
// runs, if any.
func warnSingleMount(log *slog.Logger, b *builtPolicy, mounts []config.Mount) {
	var f abi.Feature
	if b.host != nil {
		f = b.host.Features()
	}
	if why := singleMountPolicy(b.name, f, mounts); why != "" {
		log.Warn(singleMountMsg, "policy", b.name, "why", why)
	}
}

// checkPolicyMounts is `kvhost check`'s finding on the configured policy
// and mounts: a failure where the policy does not start as the daemon's
// start builds it (startPolicy: its module, and its kvhost_init given
// [policy.params]), placed at its key in file, a warning where a policy
// that places files on the first mount only is given several, or where
// the tiered policy's tiers are reversed (memory(i): mounts[i] is on a
// memory file system).
func checkPolicyMounts(ctx context.Context, rep *checkReport, cfg config.Config, file string, mounts []config.Mount, memory func(i int) bool) {
	placed := cfg
	placed.Mounts = mounts
	b, features, err := startPolicy(ctx, placed)
	if err != nil {
		ke := policyStartError(file, cfg, err)
		fix := "fix the key in [policy.params] (docs/config.md lists the built-in policies' keys)"
		if ke.Key == "policy.name" {
			fix = "fix policy.name (a built-in name or a .wasm file; kvhost policy inspect says more)"
		}
		rep.add(levelFail, "policy", ke.Error(), fix)
		return
	}
	name := b.name
	if len(mounts) < 2 {
		if b.sum == ([32]byte{}) {
			rep.add(levelOK, "policy", fmt.Sprintf("policy %s, run natively (this binary embeds no module)", name), "")
			return
		}
		rep.add(levelOK, "policy", fmt.Sprintf("policy %s loads (features %s)", name, features), "")
		return
	}
	if why := singleMountPolicy(name, features, mounts); why != "" {
		rep.add(levelWarn, "policy", why, `policy.name = "tiered" (examples/tiered.toml)`)
		return
	}
	if why := reversedTiers(placed, memory); why != "" {
		rep.add(levelWarn, "policy", why, "put the memory [[mount]] first, or set [policy.params] hot and cold (docs/config.md, Two mounts)")
		return
	}
	rep.add(levelOK, "policy", fmt.Sprintf("policy %s places files across the %d mounts (features %s)", name, len(mounts), features), "")
}

// noEntries is the index startPolicy builds a policy on: the daemon's
// start gives the engine's, and no plugin's kvhost_init depends on it.
type noEntries struct{}

func (noEntries) Lookup(uint64) (policy.Entry, bool) { return policy.Entry{}, false }
func (noEntries) Range(func(policy.Entry) bool)      {}
func (noEntries) Namespaces() []abi.NamespaceRecord  { return nil }

// startPolicy builds cfg's policy as the daemon's start builds it (its
// policyBuilder, then the constructor the engine calls: the module
// compiled, each shard's kvhost_init given [policy.params]), on an empty
// index, and closes it; it returns the policy built and its features,
// or the error the daemon's start would stop on. The module is compiled
// through a cache of the running user's own (config.DefaultRoot), kept
// from one check to the next, never the daemon's policy.cache_dir (one
// made by root would leave a daemon of another user without a cache);
// where it cannot be made, without one, as the daemon does.
func startPolicy(ctx context.Context, cfg config.Config) (*builtPolicy, abi.Feature, error) {
	cfg.Policy.CacheDir = filepath.Join(config.DefaultRoot(), "check-wasm-cache")
	d := &daemon{log: slog.New(slog.DiscardHandler)}
	b, err := d.policyBuilder(ctx, cfg)
	if err != nil {
		return nil, 0, err
	}
	p, err := b.fn(noEntries{})
	if err != nil {
		return nil, 0, err
	}
	features := p.Features()
	return b, features, p.Close(ctx)
}

// refusedParam finds the key a plugin's kvhost_init refuses in its
// message: the SDK's configuration errors (guest.ConfigError) read
// `config KEY = "VALUE": want ...`.
var refusedParam = regexp.MustCompile(`config (\S+) = "`)

// policyStartError places err, the daemon's start's error building the
// policy of cfg, at its key in file ("": none), as the checks report it
// (policyFault).
func policyStartError(file string, cfg config.Config, err error) *config.KeyError {
	key, err := policyFault(cfg, err)
	return config.AtKey(file, key, 0, fmt.Errorf("%w: the daemon would not start", err))
}

// policyFault returns the key of cfg that err, an error building its
// policy, is about: the [policy.params] key the plugin's kvhost_init
// names as refused (policy.params where it names none of them), else
// policy.name; and err with no prefix naming the policy a second time.
func policyFault(cfg config.Config, err error) (string, error) {
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

// reversedTiersMsg is the message of warnReversedTiers' log line.
const reversedTiersMsg = "policy: the tiered policy's cold mount is memory and its hot mount is not"

// tieredHotCold returns the mounts the built-in tiered policy of cfg
// keeps hot and cold: its hot and cold parameters, else 0 and 1. ok is
// false for another policy, or where the two do not both name mounts of
// cfg (the configuration or the plugin refuses those).
func tieredHotCold(cfg config.Config) (hot, cold int, ok bool) {
	if cfg.Policy.Name != tiered.Name {
		return 0, 0, false
	}
	param := func(k string, def int) int {
		v, given := cfg.Policy.Params[k]
		if !given {
			return def
		}
		i, err := strconv.Atoi(fmt.Sprint(v))
		if err != nil {
			return -1
		}
		return i
	}
	hot, cold = param("hot", 0), param("cold", 1)
	n := len(cfg.Mounts)
	return hot, cold, hot >= 0 && cold >= 0 && hot < n && cold < n && hot != cold
}

// reversedTiers says why the tiered policy of cfg has its tiers the
// wrong way round — its cold mount holds memory and its hot mount does
// not, so that new and promoted files go to the slower one and demoted
// ones to the faster — or "". A mount holds memory where its
// device_class says "memory", or, with none set, where memory(i) says
// its file system is a memory one (tmpfs).
func reversedTiers(cfg config.Config, memory func(i int) bool) string {
	hot, cold, ok := tieredHotCold(cfg)
	if !ok {
		return ""
	}
	isMemory := func(i int) bool {
		if c := cfg.Mounts[i].DeviceClass; c != "" {
			return c == "memory"
		}
		return memory(i)
	}
	if !isMemory(cold) || isMemory(hot) {
		return ""
	}
	return fmt.Sprintf("the hot mount (%d: %s) is not memory and the cold mount (%d: %s) is: new and promoted files go to the slower mount and demoted ones to the faster; list the memory mount first (or set [policy.params] hot and cold)",
		hot, cfg.Mounts[hot].Path, cold, cfg.Mounts[cold].Path)
}

// warnReversedTiers logs reversedTiers' warning for the mounts the
// engine serves, if any.
func warnReversedTiers(log *slog.Logger, cfg config.Config, mounts []engine.MountStats) {
	why := reversedTiers(cfg, func(i int) bool { return i < len(mounts) && mounts[i].Memory })
	if why != "" {
		log.Warn(reversedTiersMsg, "policy", cfg.Policy.Name, "why", why)
	}
}

// onMemoryFS reports whether dir, or the directory that holds it where it
// does not exist yet, is on a memory file system (tmpfs). Its statfs is
// bounded (statfsWithin): a file system that does not answer is not
// taken for a memory one.
func (o checkOptions) onMemoryFS(ctx context.Context, dir string) bool {
	st, err := o.statfsWithin(ctx, existingParent(dir))
	if err != nil {
		return false
	}
	k, _ := fstype.Of(int64(st.Type))
	return k.Memory
}
