package main

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/plugins"
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
// and mounts: a failure where the policy does not load as the daemon's
// start loads it, a warning where a policy that places files on the
// first mount only is given several.
func checkPolicyMounts(ctx context.Context, rep *checkReport, cfg config.Config, mounts []config.Mount) {
	name, module, err := loadPlugin(cfg.Policy.Name)
	var info policy.Info
	switch {
	case err != nil && name == plugins.Default:
		// A binary without the wasm policies runs the native lru: one mount.
	case err != nil:
		rep.add(levelFail, "policy", fmt.Sprintf("policy %s: %v", name, err), "fix policy.name (a built-in name or a .wasm file)")
		return
	default:
		if info, err = policy.Inspect(ctx, module); err != nil {
			rep.add(levelFail, "policy", fmt.Sprintf("policy %s: %v", name, err), "kvhost policy inspect says more")
			return
		}
	}
	if len(mounts) < 2 {
		if module == nil {
			rep.add(levelOK, "policy", fmt.Sprintf("policy %s, run natively (this binary embeds no module)", name), "")
			return
		}
		rep.add(levelOK, "policy", fmt.Sprintf("policy %s loads (features %s)", name, info.Features), "")
		return
	}
	if why := singleMountPolicy(name, info.Features, mounts); why != "" {
		rep.add(levelWarn, "policy", why, `policy.name = "tiered" (examples/tiered.toml)`)
		return
	}
	rep.add(levelOK, "policy", fmt.Sprintf("policy %s places files across the %d mounts (features %s)", name, len(mounts), info.Features), "")
}
