// Package watchdog tells a supervisor — systemd's service watchdog, a
// liveness probe — whether the daemon still serves: the checks it is
// given (the daemon's locks, answered in time) pass, and its data path
// keeps ending work while jobs are in flight. A daemon that stops doing
// either holds its clients' jobs, and with them their memory, until it
// answers or exits; the watchdog makes it exit, through its supervisor.
package watchdog

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"
)

// Progress is what the data path has done so far.
type Progress struct {
	// Jobs is how many store and load jobs are in flight.
	Jobs int
	// Oldest is when the oldest of them began (zero with no job).
	Oldest time.Time
	// OldestIO is when the oldest file operation in flight (an open,
	// read, write, fsync, rename, close...) began (zero with none).
	OldestIO time.Time
	// Moved grows whenever the data path ends a piece of work (a file
	// stored or loaded, a job ended); its value means nothing else.
	Moved uint64
}

// Stall finds a data path that has stopped: one file operation (an
// open, a read or write of its bytes, an fsync, a rename...) in flight
// for After (a hung mount, a copy that never completes: found while
// other jobs go on), or jobs in flight and nothing moved for After,
// counted from the later of the last move seen and the oldest job's
// start (the engine stuck elsewhere: a lock, a policy call). The zero
// Stall with After set is ready; Check is called from one goroutine.
type Stall struct {
	// After is how long jobs may be in flight with nothing moved; 0
	// never finds a stall.
	After time.Duration

	moved uint64    // Progress.Moved at the last move seen
	since time.Time // when that move was seen (zero before the first Check)
}

// Check returns why the data path seen as p at now is stalled, or "".
func (s *Stall) Check(now time.Time, p Progress) string {
	if s.After > 0 && !p.OldestIO.IsZero() {
		if held := now.Sub(p.OldestIO); held >= s.After {
			return fmt.Sprintf("a file operation (open, read, write, fsync, rename...) has not returned for %s (%d jobs in flight)",
				readable(held), p.Jobs)
		}
	}
	if s.since.IsZero() || p.Moved != s.moved {
		s.moved, s.since = p.Moved, now
		return ""
	}
	if s.After <= 0 || p.Jobs == 0 {
		return ""
	}
	from := s.since
	if p.Oldest.After(from) {
		from = p.Oldest
	}
	if still := now.Sub(from); still >= s.After {
		return fmt.Sprintf("%d jobs in flight, the oldest for %s, and the data path has moved nothing for %s",
			p.Jobs, readable(now.Sub(p.Oldest)), readable(still))
	}
	return ""
}

// Config is what a Watchdog checks and whom it tells.
type Config struct {
	// Every is how often it checks (> 0).
	Every time.Duration
	// Progress reports the data path; nil checks no stall.
	Progress func() Progress
	// StallAfter is Stall.After.
	StallAfter time.Duration
	// Probe checks the daemon's other parts (its locks, its request
	// path); an error, or no answer within Every, makes it unhealthy.
	// nil probes nothing.
	Probe func(ctx context.Context) error
	// Notify is called with "WATCHDOG=1" after each check that passed
	// (systemd's sd_notify); nil notifies no one.
	Notify func(state string) error
	// Logger gets a line when the daemon turns unhealthy and when it
	// recovers; nil logs nothing.
	Logger *slog.Logger
}

// Watchdog checks the daemon every Config.Every while Run runs.
type Watchdog struct {
	cfg   Config
	stall Stall

	// The probe still out after its check gave up on it, and when it
	// began: the next checks wait for it rather than start another on
	// the same stuck lock (used by the checking goroutine only).
	out      chan error
	outSince time.Time

	mu      sync.Mutex
	why     string    // why the last check failed; "" if it passed
	last    time.Time // when the last check ended (zero before the first)
	stopped bool      // Run returned: no more checks, nothing to say
}

// New returns a Watchdog for cfg.
func New(cfg Config) (*Watchdog, error) {
	if cfg.Every <= 0 {
		return nil, fmt.Errorf("watchdog: the check interval must be positive, got %s", cfg.Every)
	}
	if cfg.StallAfter < 0 {
		return nil, fmt.Errorf("watchdog: the stall timeout must not be negative, got %s", cfg.StallAfter)
	}
	return &Watchdog{cfg: cfg, stall: Stall{After: cfg.StallAfter}}, nil
}

// Run checks every Config.Every until ctx ends.
func (w *Watchdog) Run(ctx context.Context) {
	t := time.NewTicker(w.cfg.Every)
	defer t.Stop()
	defer func() {
		w.mu.Lock()
		w.stopped = true
		w.mu.Unlock()
	}()
	for {
		w.Check(ctx, time.Now())
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Check runs one check at now: the stall, then the probe. It notifies
// the supervisor if both passed, and records the outcome for Unhealthy.
// Checks run one at a time (Run's goroutine, or a test's).
func (w *Watchdog) Check(ctx context.Context, now time.Time) {
	why := ""
	if w.cfg.Progress != nil {
		why = w.stall.Check(now, w.cfg.Progress())
	}
	if p := w.probe(ctx); why == "" {
		why = p
	}
	w.mu.Lock()
	was := w.why
	w.why, w.last = why, time.Now()
	w.mu.Unlock()
	if why == "" && w.cfg.Notify != nil {
		if err := w.cfg.Notify("WATCHDOG=1"); err != nil && w.cfg.Logger != nil {
			w.cfg.Logger.Warn("watchdog: notifying the supervisor failed", "err", err)
		}
	}
	if w.cfg.Logger == nil || why == was {
		return
	}
	switch {
	case was == "":
		w.cfg.Logger.Error("watchdog: the daemon is not serving; its supervisor is no longer told it lives", "why", why)
	case why == "":
		w.cfg.Logger.Info("watchdog: the daemon serves again", "was", was)
	}
}

// probe runs Config.Probe, waiting Every for its answer: why it failed,
// or "". A probe that has not answered is not started again: the next
// checks wait for that one (a probe stuck on a lock stays stuck, and
// one goroutine per check would pile up behind it).
func (w *Watchdog) probe(ctx context.Context) string {
	if w.cfg.Probe == nil {
		return ""
	}
	if w.out == nil {
		w.out, w.outSince = make(chan error, 1), time.Now()
		pctx, cancel := context.WithTimeout(ctx, w.cfg.Every)
		go func(out chan<- error) {
			defer cancel()
			out <- w.cfg.Probe(pctx)
		}(w.out)
	}
	timer := time.NewTimer(w.cfg.Every)
	defer timer.Stop()
	select {
	case err := <-w.out:
		w.out = nil
		if err != nil {
			return fmt.Sprintf("probe: %v", err)
		}
		return ""
	case <-timer.C:
		return fmt.Sprintf("probe: no answer for %s", time.Since(w.outSince).Round(time.Millisecond))
	}
}

// Unhealthy says why the daemon is not serving at now, or "": the last
// check failed, or no check has ended for three intervals (one is stuck).
// Before the first check, and once Run has returned (the daemon drains),
// it is healthy.
func (w *Watchdog) Unhealthy(now time.Time) string {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.last.IsZero() || w.stopped {
		return ""
	}
	if late := now.Sub(w.last); late > 3*w.cfg.Every {
		return fmt.Sprintf("no check has ended for %s (the last: %s)", readable(late), w.whyOrOK())
	}
	return w.why
}

func (w *Watchdog) whyOrOK() string {
	if w.why == "" {
		return "ok"
	}
	return w.why
}

// readable rounds d for a message: to the second from 10s, to 100ms
// below (a stall timeout under a second reads "300ms", not "0s").
func readable(d time.Duration) time.Duration {
	if d >= 10*time.Second {
		return d.Round(time.Second)
	}
	return d.Round(100 * time.Millisecond)
}
