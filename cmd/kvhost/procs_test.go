package main

import (
	"fmt"
	"runtime"
	"testing"
)

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
		{"GOMAXPROCS unset", "GOMAXPROCS=", workers + 1}, // empty: unset for the runtime and for the daemon
		{"GOMAXPROCS 0 is not a count", "GOMAXPROCS=0", workers + 1},
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

// TestReserveControlProcessorsSettlesTheDefaultWorkersFirst: with

// io_workers 0 the engine gets the workers of the runtime's count before

// the raise (not of the raised count, which would leave no processor

// spare), GOMAXPROCS is one more, and restore gives the count back.
