package main

import (
	"context"
	"fmt"

	"github.com/kvhost/kvhost/internal/config"
	kvdaemon "github.com/kvhost/kvhost/internal/daemon"
	"github.com/kvhost/kvhost/internal/fstype"
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
	if why := kvdaemon.SingleMountPolicy(name, cfg.Policy.Params, features, mounts); why != "" {
		rep.add(levelWarn, "policy", why, `policy.name = "tiered" (examples/tiered.toml)`)
		return
	}
	if why := kvdaemon.ReversedTiers(placed, memory); why != "" {
		rep.add(levelWarn, "policy", why, "put the memory [[mount]] first, or set [policy.params] hot and cold (docs/config.md, Two mounts)")
		return
	}
	rep.add(levelOK, "policy", fmt.Sprintf("policy %s places files across the %d mounts (features %s)", name, len(mounts), features), "")
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
