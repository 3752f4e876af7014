package daemon

import (
	"context"
	"log/slog"
	"time"

	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/internal/watchdog"
)

// healthCheckEvery is how often the watchdog checks the daemon where
// systemd asks for nothing more often.
const healthCheckEvery = 5 * time.Second

// newWatchdog returns the daemon's watchdog: every healthCheckEvery (or
// half of systemd's watchdog timeout, if shorter) it takes the engine's
// and the server's stats (their locks answer) and looks for a file
// operation that has not returned for server.stall_timeout, or a data
// path that moves nothing for that long with jobs in flight; while
// both pass it tells systemd WATCHDOG=1 (where systemd keeps a watchdog
// on the daemon), and /healthz answers 200.
func newWatchdog(cfg config.Config, eng *engine.Engine, srv *server.Server, log *slog.Logger) (*watchdog.Watchdog, error) {
	every := healthCheckEvery
	var notify func(string) error
	half, err := systemdWatchdog()
	switch {
	case err != nil:
		log.Warn("systemd's watchdog settings ignored", "err", err)
	case half > 0:
		every, notify = min(every, half), sdNotify
	}
	wd, err := watchdog.New(watchdog.Config{
		Every: every,
		Progress: func() watchdog.Progress {
			a := eng.Activity()
			return watchdog.Progress{Jobs: a.Jobs, Oldest: a.Oldest, OldestIO: a.OldestIO, Moved: a.Moved}
		},
		StallAfter: time.Duration(cfg.Server.StallTimeout),
		Probe: func(context.Context) error {
			eng.Stats()
			srv.Stats()
			return nil
		},
		Notify: notify,
		Logger: log,
	})
	if err != nil {
		return nil, err
	}
	log.Info("watchdog", "every", every, "stall_timeout", time.Duration(cfg.Server.StallTimeout), "systemd", notify != nil)
	return wd, nil
}
