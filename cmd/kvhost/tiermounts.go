package main

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"

	"github.com/kvhost/kvhost/internal/config"
	kvdaemon "github.com/kvhost/kvhost/internal/daemon"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/fstype"
	"github.com/kvhost/kvhost/plugins/tiered"
)

// checkPolicyMounts is `kvhost check`'s finding on the configured policy
// and mounts: a failure where the policy does not start as the daemon's
// start builds it (kvdaemon.StartPolicy: its module, and its kvhost_init given
// [policy.params]), placed at its key in file, a warning where a policy
// that places files on the first mount only is given several, or where
// the tiered policy's tiers are reversed (memory(i): mounts[i] is on a
// memory file system).
func checkPolicyMounts(ctx context.Context, rep *checkReport, cfg config.Config, file string, mounts []config.Mount, memory func(i int) bool) {
	placed := cfg
	placed.Mounts = mounts
	b, features, err := kvdaemon.StartPolicy(ctx, placed)
	if err != nil {
		ke := kvdaemon.PolicyStartError(file, cfg, err)
		fix := "fix the key in [policy.params] (docs/config.md lists the built-in policies' keys)"
		if ke.Key == "policy.name" {
			fix = "fix policy.name (a built-in name or a .wasm file; kvhost policy inspect says more)"
		}
		rep.add(levelFail, "policy", ke.Error(), fix)
		return
	}
	name := b.Name
	if len(mounts) < 2 {
		if b.Sum == ([32]byte{}) {
			rep.add(levelOK, "policy", fmt.Sprintf("policy %s, run natively (this binary embeds no module)", name), "")
			return
		}
		rep.add(levelOK, "policy", fmt.Sprintf("policy %s loads (features %s)", name, features), "")
		return
	}
	if why := kvdaemon.SingleMountPolicy(name, features, mounts); why != "" {
		rep.add(levelWarn, "policy", why, `policy.name = "tiered" (examples/tiered.toml)`)
		return
	}
	if why := reversedTiers(placed, memory); why != "" {
		rep.add(levelWarn, "policy", why, "put the memory [[mount]] first, or set [policy.params] hot and cold (docs/config.md, Two mounts)")
		return
	}
	rep.add(levelOK, "policy", fmt.Sprintf("policy %s places files across the %d mounts (features %s)", name, len(mounts), features), "")
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
