package daemon

import (
	"fmt"
	"log/slog"
	"strconv"

	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/plugins/tiered"
)

// ReversedTiersMsg is the message of warnReversedTiers' log line (tests
// wait for it).
const ReversedTiersMsg = "policy: the tiered policy's cold mount is memory and its hot mount is not"

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

// ReversedTiers says why the tiered policy of cfg has its tiers the
// wrong way round — its cold mount holds memory and its hot mount does
// not, so that new and promoted files go to the slower one and demoted
// ones to the faster — or "". A mount holds memory where its
// device_class says "memory", or, with none set, where memory(i) says
// its file system is a memory one (tmpfs).
func ReversedTiers(cfg config.Config, memory func(i int) bool) string {
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

// warnReversedTiers logs ReversedTiers' warning for the mounts the
// engine serves, if any.
func warnReversedTiers(log *slog.Logger, cfg config.Config, mounts []engine.MountStats) {
	why := ReversedTiers(cfg, func(i int) bool { return i < len(mounts) && mounts[i].Memory })
	if why != "" {
		log.Warn(ReversedTiersMsg, "policy", cfg.Policy.Name, "why", why)
	}
}
