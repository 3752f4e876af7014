package daemon

import (
	"slices"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/config"
)

// TestNeedsRestartNamesTheKeysAReloadDoesNotApply: changed keys are named
// as in the TOML file; the policy, log.level and engine.verify_interval
// (applied live) are not.
func TestNeedsRestartNamesTheKeysAReloadDoesNotApply(t *testing.T) {
	cases := []struct {
		name string
		edit func(*config.Config)
		want []string
	}{
		{"nothing", func(*config.Config) {}, nil},
		{"live settings only", func(c *config.Config) {
			c.Log.Level = "debug"
			c.Engine.VerifyInterval = config.Duration(time.Minute)
			c.Policy.Name, c.Policy.Shards = "lfu", 2
			c.Policy.Params = map[string]any{"x": int64(1)}
		}, nil},
		{"server and log format", func(c *config.Config) {
			c.Server.MaxClients = 7
			c.Server.Socket = "/elsewhere.sock"
			c.Log.Format = "text"
		}, []string{"server.socket", "server.max_clients", "log.format"}},
		{"mounts as one key", func(c *config.Config) {
			c.Mounts = append(c.Mounts, config.Mount{Path: "/b"})
		}, []string{"mount"}},
		{"metrics and gpu", func(c *config.Config) {
			c.Metrics.Listen = ":9400"
			c.GPU.CuFile = "off"
			c.Engine.Fsync = true
		}, []string{"engine.fsync", "gpu.cufile", "metrics.listen"}},
		{"budgets as one key", func(c *config.Config) {
			c.Budgets = []config.Budget{{Model: "m", Bytes: 1 << 30}}
		}, []string{"budget"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			a := config.Default()
			b := config.Default()
			c.edit(&b)
			got := needsRestart(a, b)
			if !slices.Equal(got, c.want) {
				t.Fatalf("needsRestart = %q, want %q", got, c.want)
			}
		})
	}
}
