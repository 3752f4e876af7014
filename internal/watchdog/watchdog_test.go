package watchdog

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/testwait"
)

// TestStallFindsJobsInFlightWithNothingMovedForAfter checks Stall.Check
// over a sequence of observations.
func TestStallFindsJobsInFlightWithNothingMovedForAfter(t *testing.T) {
	t0 := time.Date(2026, 11, 26, 0, 0, 0, 0, time.UTC)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	type obs struct {
		at      int // seconds after t0
		p       Progress
		stalled bool
	}
	for _, tc := range []struct {
		name  string
		after time.Duration
		seq   []obs
	}{
		{"no job: never stalled", 10 * time.Second, []obs{
			{0, Progress{Moved: 5}, false}, {30, Progress{Moved: 5}, false}, {300, Progress{Moved: 5}, false}}},
		{"jobs that keep moving", 10 * time.Second, []obs{
			{0, Progress{Jobs: 3, Oldest: at(0), Moved: 1}, false},
			{9, Progress{Jobs: 3, Oldest: at(0), Moved: 2}, false},
			{18, Progress{Jobs: 3, Oldest: at(0), Moved: 3}, false},
			{27, Progress{Jobs: 3, Oldest: at(0), Moved: 4}, false}}},
		{"a job with nothing moved for after", 10 * time.Second, []obs{
			{0, Progress{Jobs: 1, Oldest: at(0), Moved: 7}, false},
			{9, Progress{Jobs: 1, Oldest: at(0), Moved: 7}, false},
			{10, Progress{Jobs: 1, Oldest: at(0), Moved: 7}, true},
			{11, Progress{Jobs: 1, Oldest: at(0), Moved: 8}, false}}},
		{"a new job after an idle hour has its own time", 10 * time.Second, []obs{
			{0, Progress{Moved: 7}, false},
			{3600, Progress{Jobs: 1, Oldest: at(3599), Moved: 7}, false},
			{3608, Progress{Jobs: 1, Oldest: at(3599), Moved: 7}, false},
			{3609, Progress{Jobs: 1, Oldest: at(3599), Moved: 7}, true}}},
		{"the first observation is never a stall", time.Second, []obs{
			{100, Progress{Jobs: 1, Oldest: at(0), Moved: 1}, false},
			{101, Progress{Jobs: 1, Oldest: at(0), Moved: 1}, true}}},
		{"one I/O held for after while other jobs move", 10 * time.Second, []obs{
			{0, Progress{Jobs: 5, Oldest: at(0), OldestIO: at(0), Moved: 1}, false},
			{5, Progress{Jobs: 5, Oldest: at(0), OldestIO: at(0), Moved: 50}, false},
			{10, Progress{Jobs: 5, Oldest: at(0), OldestIO: at(0), Moved: 99}, true}}},
		{"I/Os that each return in time", 10 * time.Second, []obs{
			{0, Progress{Jobs: 5, Oldest: at(0), OldestIO: at(0), Moved: 1}, false},
			{9, Progress{Jobs: 5, Oldest: at(0), OldestIO: at(8), Moved: 2}, false},
			{18, Progress{Jobs: 5, Oldest: at(0), OldestIO: at(17), Moved: 3}, false}}},
		{"after 0 finds none", 0, []obs{
			{0, Progress{Jobs: 1, Oldest: at(0), OldestIO: at(0), Moved: 1}, false},
			{1000, Progress{Jobs: 1, Oldest: at(0), OldestIO: at(0), Moved: 1}, false}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := Stall{After: tc.after}
			for _, o := range tc.seq {
				why := s.Check(at(o.at), o.p)
				if (why != "") != o.stalled {
					t.Fatalf("at %ds, %+v: Check = %q, want stalled %v", o.at, o.p, why, o.stalled)
				}
				if why != "" && !strings.Contains(why, "in flight") {
					t.Errorf("at %ds: %q does not say what is stalled", o.at, why)
				}
			}
		})
	}
}

// notes records what the watchdog told its supervisor.
type notes struct {
	mu  sync.Mutex
	got []string
}

func (n *notes) notify(state string) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.got = append(n.got, state)
	return nil
}

func (n *notes) count() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return len(n.got)
}

// TestWatchdogTellsTheSupervisorOnlyWhileTheDaemonServes: each passing
// check notifies WATCHDOG=1; a stall or a failed probe notifies nothing,
// is logged once, and is what Unhealthy says; recovery is logged too.
func TestWatchdogTellsTheSupervisorOnlyWhileTheDaemonServes(t *testing.T) {
	var mu sync.Mutex
	p := Progress{Jobs: 1, Oldest: time.Now(), Moved: 1}
	var probeErr error
	var logs bytes.Buffer
	n := &notes{}
	w, err := New(Config{
		Every: time.Second, StallAfter: 10 * time.Second,
		Progress: func() Progress { mu.Lock(); defer mu.Unlock(); return p },
		Probe:    func(context.Context) error { mu.Lock(); defer mu.Unlock(); return probeErr },
		Notify:   n.notify,
		Logger:   slog.New(slog.NewTextHandler(&logs, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	now := time.Now()
	check := func(s int) string {
		w.Check(ctx, now.Add(time.Duration(s)*time.Second))
		return w.Unhealthy(time.Now())
	}
	if why := check(0); why != "" || n.count() != 1 || n.got[0] != "WATCHDOG=1" {
		t.Fatalf("first check: %q, notes %q", why, n.got)
	}
	if why := check(5); why != "" || n.count() != 2 {
		t.Fatalf("5 s, nothing moved yet: %q, %d notes", why, n.count())
	}
	for _, s := range []int{11, 12} {
		if why := check(s); !strings.Contains(why, "moved nothing") || n.count() != 2 {
			t.Fatalf("%d s with nothing moved: %q, %d notes", s, why, n.count())
		}
	}
	mu.Lock()
	p.Moved = 2
	mu.Unlock()
	if why := check(13); why != "" || n.count() != 3 {
		t.Fatalf("moved again: %q, %d notes", why, n.count())
	}
	mu.Lock()
	probeErr = errors.New("engine stats: broken")
	mu.Unlock()
	if why := check(14); !strings.Contains(why, "broken") || n.count() != 3 {
		t.Fatalf("probe failing: %q, %d notes", why, n.count())
	}
	mu.Lock()
	probeErr = nil
	p.Moved = 3
	mu.Unlock()
	if why := check(15); why != "" || n.count() != 4 {
		t.Fatalf("probe passing again: %q, %d notes", why, n.count())
	}
	out := logs.String()
	if c := strings.Count(out, "not serving"); c != 2 {
		t.Errorf("%d lines saying the daemon is not serving, want 2 (one per episode):\n%s", c, out)
	}
	if c := strings.Count(out, "serves again"); c != 2 {
		t.Errorf("%d lines saying the daemon serves again, want 2:\n%s", c, out)
	}
}

// TestWatchdogWaitsForAStuckProbeInsteadOfStartingMore: a probe stuck on
// a lock makes the daemon unhealthy at the check that waited for it and
// at every later one, and no second probe starts while it is out; once
// it returns, the next check passes.
func TestWatchdogWaitsForAStuckProbeInsteadOfStartingMore(t *testing.T) {
	stuck := make(chan struct{})
	var mu sync.Mutex
	started := 0
	n := &notes{}
	w, err := New(Config{
		Every: 20 * time.Millisecond,
		Probe: func(context.Context) error {
			mu.Lock()
			started++
			mu.Unlock()
			<-stuck
			return nil
		},
		Notify: n.notify,
	})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		w.Check(context.Background(), time.Now())
		if why := w.Unhealthy(time.Now()); !strings.Contains(why, "no answer") {
			t.Fatalf("check %d with the probe stuck: Unhealthy = %q", i, why)
		}
	}
	mu.Lock()
	if started != 1 {
		t.Errorf("%d probes started while the first was stuck, want 1", started)
	}
	mu.Unlock()
	if n.count() != 0 {
		t.Errorf("the supervisor was told %q while the probe was stuck", n.got)
	}
	close(stuck)
	// The stuck probe's answer is taken by the next check; the one after
	// starts a new probe, which answers at once.
	w.Check(context.Background(), time.Now())
	if why := w.Unhealthy(time.Now()); why != "" || n.count() != 1 {
		t.Fatalf("after the probe returned: Unhealthy = %q, %d notes", why, n.count())
	}
}

// TestUnhealthyWhenNoCheckEndsForThreeIntervals: a check that never ends
// (the checking goroutine itself stuck) is seen by Unhealthy, which a
// liveness probe asks from another goroutine.
func TestUnhealthyWhenNoCheckEndsForThreeIntervals(t *testing.T) {
	w, err := New(Config{Every: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	if why := w.Unhealthy(now); why != "" {
		t.Fatalf("before the first check: %q", why)
	}
	w.Check(context.Background(), now)
	if why := w.Unhealthy(time.Now().Add(2 * time.Second)); why != "" {
		t.Fatalf("2 intervals after the last check: %q", why)
	}
	if why := w.Unhealthy(time.Now().Add(4 * time.Second)); !strings.Contains(why, "no check has ended") {
		t.Fatalf("4 intervals after the last check: %q", why)
	}
}

// TestNewRefusesBadIntervals names what was wrong.
func TestNewRefusesBadIntervals(t *testing.T) {
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{}, "check interval"},
		{Config{Every: -time.Second}, "check interval"},
		{Config{Every: time.Second, StallAfter: -1}, "stall timeout"},
	} {
		if _, err := New(tc.cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New(%+v) = %v, want an error about the %s", tc.cfg, err, tc.want)
		}
	}
}

// TestUnhealthyIsSilentOnceRunReturned: the daemon drains after its
// watchdog stops; a liveness probe then must not restart it.
func TestUnhealthyIsSilentOnceRunReturned(t *testing.T) {
	w, err := New(Config{Every: time.Millisecond, Probe: func(context.Context) error { return errors.New("broken") }})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { w.Run(ctx); close(done) }()
	testwait.Until(t, "a failed check", time.Minute, func() bool { return w.Unhealthy(time.Now()) != "" })
	cancel()
	<-done
	if why := w.Unhealthy(time.Now().Add(time.Hour)); why != "" {
		t.Errorf("after Run returned: %q", why)
	}
}
