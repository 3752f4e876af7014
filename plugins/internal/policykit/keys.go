package policykit

import (
	"strconv"
	"time"

	"github.com/kvhost/kvhost/abi/guest"
)

// MountIndex reads configuration key as a mount index, 0 to MaxClasses-1
// (def where it is absent).
func MountIndex(cfg guest.Config, key string, def int64) (uint32, error) {
	m, err := cfg.Int(key, def)
	if err == nil && (m < 0 || m >= MaxClasses) {
		err = &guest.ConfigError{Key: key, Value: cfg.String(key, ""), Want: "a mount index from 0 to " + strconv.Itoa(MaxClasses-1)}
	}
	return uint32(m), err
}

// LayoutAndDuration reads the whole configuration of a policy whose keys
// are the layout keys (ParseLayout) and one duration above zero, key (def
// where it is absent; example, such as "90s or 2h", shows a good value in
// the error). Any other key, or a bad value, fails as ConfigFailure of
// policy.
func LayoutAndDuration(cfg guest.Config, policy, key string, def time.Duration, example string) (Layout, time.Duration, error) {
	if err := cfg.CheckKeys(append(LayoutKeys(), key)...); err != nil {
		return Layout{}, 0, ConfigFailure(policy, err)
	}
	d, err := positiveDuration(cfg, key, def, example)
	if err != nil {
		return Layout{}, 0, ConfigFailure(policy, err)
	}
	layout, err := ParseLayout(cfg)
	if err != nil {
		return Layout{}, 0, ConfigFailure(policy, err)
	}
	return layout, d, nil
}

// positiveDuration reads configuration key as a duration above zero (def
// where it is absent); example shows a good value in the error.
func positiveDuration(cfg guest.Config, key string, def time.Duration, example string) (time.Duration, error) {
	d, err := cfg.Duration(key, def)
	if err == nil && d == 0 {
		err = &guest.ConfigError{Key: key, Value: cfg.String(key, ""), Want: "a positive duration such as " + example}
	}
	return d, err
}
