package daemon

import (
	"context"
	"reflect"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/internal/logging"
)

// liveKey reports whether a reload applies the setting key to the running
// daemon: the whole [policy] table, log.level and engine.verify_interval;
// every other changed key is reported as needing a restart.
func liveKey(k string) bool {
	switch k {
	case "policy", "log.level", "engine.verify_interval":
		return true
	}
	return strings.HasPrefix(k, "policy.")
}

// reload re-reads the configuration (the --config file with the
// command-line flags over it, as at start) and applies what can change
// live: the policy (compiled, warmed from the index, swapped in, the old
// one closed once its calls drain), log.level and engine.verify_interval.
// On any failure nothing changes and the reason is logged and kept for
// `kvhost reload` and `kvhost stats`.
func (d *daemon) reload(ctx context.Context) {
	start := time.Now()
	d.setReloading()
	d.log.Info("reload: re-reading the configuration", "config", d.flags.ConfigPath())
	msg, err := d.applyReload(ctx)
	d.mu.Lock()
	if err != nil {
		d.reloadFailures++
		d.lastReload = "failed: " + err.Error() + "; the running configuration is unchanged"
	} else {
		d.reloads++
		d.lastReload = msg
	}
	d.mu.Unlock()
	if err != nil {
		d.log.Error("reload failed; the running configuration is unchanged", "err", err, "took", time.Since(start).String())
	} else {
		d.log.Info("reload done", "result", msg, "took", time.Since(start).String())
	}
	d.setReady(ctx, true) // not while draining: setReady sees to that
}

// applyReload does the work of reload and describes what changed.
func (d *daemon) applyReload(ctx context.Context) (string, error) {
	next, err := d.flags.Load()
	if err != nil {
		return "", err
	}
	d.mu.Lock()
	cur := d.running
	d.mu.Unlock()
	level, err := logging.ParseLevel(next.Log.Level)
	if err != nil {
		return "", err
	}
	// What runs once the reload applies: the live settings from next, the
	// rest (the mounts above all, which the policy's fallback follows) as
	// it runs until a restart.
	running := cur
	running.Policy, running.Log.Level, running.Engine.VerifyInterval = next.Policy, next.Log.Level, next.Engine.VerifyInterval
	var changed []string
	build, err := d.buildPolicy(ctx, running)
	if err != nil {
		return "", err
	}
	old := d.pol.Current()
	switch {
	case old == nil || !reflect.DeepEqual(old.Config, next.Policy):
		changed = append(changed, "policy")
	case old.Sum != build.Sum:
		changed = append(changed, "policy (module changed)")
	case old.Host() != nil && old.Host().Stats().Fallback:
		changed = append(changed, "policy (retried after its fallback)")
	}
	if len(changed) > 0 {
		if err := d.eng.ReplacePolicy(ctx, build.New); err != nil {
			return "", err
		}
		d.pol.Swap(build)
		WarnSingleMount(d.log, build, cur.Mounts)
		// The new policy's parameters over the mounts that run.
		running := cur
		running.Policy = next.Policy
		warnReversedTiers(d.log, running, d.eng.Stats().Mounts)
	}
	if next.Log.Level != cur.Log.Level {
		d.level.Set(level)
		changed = append(changed, "log.level")
	}
	if next.Engine.VerifyInterval != cur.Engine.VerifyInterval {
		d.eng.SetVerifyInterval(time.Duration(next.Engine.VerifyInterval))
		changed = append(changed, "engine.verify_interval")
	}
	restart := needsRestart(cur, next)
	d.mu.Lock()
	d.running = running
	d.mu.Unlock()
	msg := "ok; nothing changed"
	if len(changed) > 0 {
		msg = "ok; changed: " + strings.Join(changed, ", ")
	}
	if len(restart) > 0 {
		msg += "; needs restart: " + strings.Join(restart, ", ")
		d.log.Warn("reload: these settings changed but apply only at the next start", "keys", strings.Join(restart, ","))
	}
	return msg, nil
}

// needsRestart lists the keys (as in the TOML file) whose values differ
// between a and b and that a reload does not apply.
func needsRestart(a, b config.Config) []string {
	var keys []string
	diffKeys("", reflect.ValueOf(a), reflect.ValueOf(b), &keys)
	return slices.DeleteFunc(keys, func(k string) bool {
		return liveKey(k)
	})
}

// diffKeys appends the dotted TOML keys under prefix whose values differ.
// Tables of arrays ([[mount]]) count as one key.
func diffKeys(prefix string, a, b reflect.Value, out *[]string) {
	if a.Kind() == reflect.Struct {
		for i := range a.NumField() {
			name, _, _ := strings.Cut(a.Type().Field(i).Tag.Get("toml"), ",")
			if name == "" || name == "-" {
				continue
			}
			key := name
			if prefix != "" {
				key = prefix + "." + name
			}
			diffKeys(key, a.Field(i), b.Field(i), out)
		}
		return
	}
	if !reflect.DeepEqual(a.Interface(), b.Interface()) {
		*out = append(*out, prefix)
	}
}

// monotonicUsec is CLOCK_MONOTONIC in microseconds (systemd's
// MONOTONIC_USEC of a reload).
func monotonicUsec() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return 0
	}
	return ts.Nano() / 1000
}
