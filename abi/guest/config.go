package guest

import (
	"slices"
	"strconv"
	"strings"
	"time"
)

// Config is a plugin's configuration: the key = value pairs of the [policy]
// table of kvhost's TOML file (and host-provided keys starting with
// "kvhost."), passed to kvhost_init as UTF-8 lines "key=value".
type Config struct {
	kv map[string]string
}

// ConfigError names the key whose value could not be used.
type ConfigError struct {
	Key, Value, Want string // the key, the value that could not be used, and what was expected
}

// Error names the key, its value and what was expected.
func (e *ConfigError) Error() string {
	return "config " + e.Key + " = " + strconv.Quote(e.Value) + ": want " + e.Want
}

// ParseConfig parses "key=value" lines. Blank lines are ignored; a line
// without '=' is an error.
func ParseConfig(b []byte) (Config, error) {
	c := Config{kv: map[string]string{}}
	for line := range strings.SplitSeq(string(b), "\n") {
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			return c, InvalidInput("config line " + strconv.Quote(line) + " has no '='")
		}
		c.kv[strings.TrimSpace(k)] = strings.TrimSpace(v)
	}
	return c, nil
}

// Encode returns the lines ParseConfig reads back as c.
func (c Config) Encode() []byte {
	var b []byte
	for k, v := range c.kv {
		b = append(b, k...)
		b = append(b, '=')
		b = append(b, v...)
		b = append(b, '\n')
	}
	return b
}

// Set sets key to value, for tests and hosts.
func (c *Config) Set(key, value string) {
	if c.kv == nil {
		c.kv = map[string]string{}
	}
	c.kv[key] = value
}

// String returns the value of key, or def if it is not set.
func (c Config) String(key, def string) string {
	if v, ok := c.kv[key]; ok {
		return v
	}
	return def
}

// Int returns the integer value of key, or def if it is not set. The
// value is decimal, as the host writes a TOML integer: a string value
// with a leading zero is read in decimal ("010" is 10), and one with a
// base prefix or digit separators ("0x10", "1_000") is a ConfigError.
func (c Config) Int(key string, def int64) (int64, error) {
	v, ok := c.kv[key]
	if !ok {
		return def, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return def, &ConfigError{Key: key, Value: v, Want: "a decimal integer"}
	}
	return n, nil
}

// Duration returns the duration value of key ("90s", "2h"), or def.
func (c Config) Duration(key string, def time.Duration) (time.Duration, error) {
	v, ok := c.kv[key]
	if !ok {
		return def, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < 0 {
		return def, &ConfigError{Key: key, Value: v, Want: "a non-negative duration such as 90s or 2h"}
	}
	return d, nil
}

// HostKeyPrefix starts the keys the host adds to every configuration: in
// ABI v1 always "kvhost.shard" and "kvhost.shards", nothing else. A later
// host may add more; CheckKeys accepts every key with the prefix.
const HostKeyPrefix = "kvhost."

// CheckKeys returns a *ConfigError naming the first key that is neither in
// known nor a host key, so that a typo in an operator's configuration fails
// at start instead of being ignored.
func (c Config) CheckKeys(known ...string) error {
	var bad []string
	for k := range c.kv {
		if !strings.HasPrefix(k, HostKeyPrefix) && !slices.Contains(known, k) {
			bad = append(bad, k)
		}
	}
	if len(bad) == 0 {
		return nil
	}
	slices.Sort(bad)
	return &ConfigError{Key: bad[0], Value: c.kv[bad[0]], Want: "a known key: " + strings.Join(known, ", ")}
}

// Keys returns every key set, in no particular order.
func (c Config) Keys() []string {
	keys := make([]string, 0, len(c.kv))
	for k := range c.kv {
		keys = append(keys, k)
	}
	return keys
}
