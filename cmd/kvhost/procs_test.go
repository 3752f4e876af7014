package main

import (
	"fmt"
	"runtime"
	"testing"
)

func TestDaemonProcessorsLeaveOneForTheControlPath(t *testing.T) {
	cases := []struct {
		name           string
		workers, procs int
		fromEnv        bool
		want           int
	}{
		{"workers on every processor get one more", 2, 2, false, 3},
		{"sixteen workers on sixteen processors", 16, 16, false, 17},
		{"more workers than processors", 8, 2, false, 9},
		{"processors to spare already", 4, 64, false, 64},
		{"one spare already", 3, 4, false, 4},
		{"GOMAXPROCS set by the operator is kept", 2, 2, true, 2},
		{"GOMAXPROCS set by the operator, even below the workers", 8, 2, true, 2},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := daemonProcessors(c.workers, c.procs, c.fromEnv); got != c.want {
				t.Fatalf("daemonProcessors(%d, %d, %v) = %d, want %d", c.workers, c.procs, c.fromEnv, got, c.want)
			}
		})
	}
}

// TestDaemonRunsOneProcessorMoreThanItsIOWorkers starts daemons and reads
// the Go runtime's processor count from their metrics
// (go_sched_gomaxprocs_threads): io_workers plus one, unless GOMAXPROCS is
// set in the environment, which the daemon keeps.
func TestDaemonRunsOneProcessorMoreThanItsIOWorkers(t *testing.T) {
	workers := runtime.NumCPU() + 2 // more than the runtime's default count
	cases := []struct {
		name string
		env  string
		want int
	}{
		{"default", "GOMAXPROCS=", workers + 1}, // empty: unset for the runtime and for the daemon
		{"GOMAXPROCS kept", "GOMAXPROCS=1", 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			extra := fmt.Sprintf("[engine]\nio_workers = %d\n\n[metrics]\nlisten = \"127.0.0.1:0\"", workers)
			file, _, _ := testConfig(t, t.TempDir(), extra)
			p := startProc(t, []string{c.env}, "serve", "--config", file)
			addr, _ := p.stderr.logLine(t, "metrics listening")["address"].(string)
			if got := metricValue(scrapeMetrics(t, addr), "go_sched_gomaxprocs_threads"); got != float64(c.want) {
				t.Fatalf("go_sched_gomaxprocs_threads = %v with io_workers = %d and %s, want %d", got, workers, c.env, c.want)
			}
		})
	}
}
