package main

import (
	"log/slog"
	"os"
	"runtime"

	"github.com/kvhost/kvhost/host/engine"
)

// controlProcessors is how many Go processors (GOMAXPROCS) the daemon runs
// beyond its I/O workers. While the workers copy, each holds a processor;
// with none left over, a client's request waits up to 10 ms for the
// runtime to notice the socket is readable (sysmon's network poll) and up
// to 10 ms more for it to preempt a worker: lookups beside loads took
// 4 ms at the median and 20–30 ms at p99 on a 2-core machine. With one
// processor to spare, an idle thread sits in the network poller and runs
// the request at once. See RATIONALE.md, "Why does the daemon run one Go
// processor more than its I/O workers?".
const controlProcessors = 1

// daemonProcessors returns the Go processors the daemon runs with, given
// its I/O workers and the runtime's count: at least one more than the
// workers, unless the GOMAXPROCS environment variable chose the count
// (fromEnv), which is kept.
func daemonProcessors(workers, procs int, fromEnv bool) int {
	if fromEnv {
		return procs
	}
	return max(procs, workers+controlProcessors)
}

// spareProcessor resolves the I/O workers of io_workers n (0: the
// engine's default, from the processors the runtime chose) and raises
// GOMAXPROCS so that one processor is left for the control path. It
// returns the workers, for the engine to run exactly that many (the
// default would grow with the raised count), and a function restoring
// the former GOMAXPROCS.
func spareProcessor(n int, log *slog.Logger) (workers int, restore func()) {
	workers = n
	if workers <= 0 {
		workers = engine.DefaultIOWorkers()
	}
	procs := runtime.GOMAXPROCS(0)
	want := daemonProcessors(workers, procs, os.Getenv("GOMAXPROCS") != "")
	if want == procs {
		return workers, func() {}
	}
	runtime.GOMAXPROCS(want)
	log.Info("running one Go processor more than the I/O workers, for the control path", "gomaxprocs", want, "io_workers", workers, "was", procs)
	return workers, func() { runtime.GOMAXPROCS(procs) }
}
