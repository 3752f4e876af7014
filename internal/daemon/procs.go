package daemon

import (
	"log/slog"
	"os"
	"runtime"
	"strconv"

	"github.com/kvhost/kvhost/internal/engine"
)

// controlProcessors is how many Go processors (GOMAXPROCS) the daemon runs
// beyond its I/O workers. While the workers copy, each holds a processor;
// with none left over, a client's request waits for the runtime to notice
// its socket is readable (only the runtime's monitor polls the network
// then, every 10 ms) and then for a worker to be preempted (after 10 ms):
// lookups beside loads took 3–4 ms at the median and 28–33 ms at p99 on a
// 2-core machine. With one processor to spare, an idle thread waits in the
// network poller and runs the request at once. See RATIONALE.md, "Why does
// the daemon run one Go processor more than its I/O workers?".
const controlProcessors = 1

// daemonProcessors returns the Go processors the daemon runs with, given
// its I/O workers and the runtime's count: at least controlProcessors more
// than the workers, unless the GOMAXPROCS environment variable chose the
// count (fromEnv), which is kept.
func daemonProcessors(workers, procs int, fromEnv bool) int {
	if fromEnv {
		return procs
	}
	return max(procs, workers+controlProcessors)
}

// gomaxprocsFromEnv reports whether the GOMAXPROCS environment variable
// sets the runtime's count: the runtime honours a positive integer only.
func gomaxprocsFromEnv() bool {
	n, err := strconv.Atoi(os.Getenv("GOMAXPROCS"))
	return err == nil && n > 0
}

// reserveControlProcessors resolves the I/O workers of io_workers n (0:
// the engine's default, from the processors the runtime chose) and raises
// GOMAXPROCS so that controlProcessors are left for the control path. It
// returns the workers, for the engine to run exactly that many (the
// default would grow with the raised count), and a function that gives
// GOMAXPROCS back to the runtime's default.
func reserveControlProcessors(n int, log *slog.Logger) (workers int, restore func()) {
	workers = n
	if workers <= 0 {
		workers = engine.DefaultIOWorkers()
	}
	procs := runtime.GOMAXPROCS(0)
	fromEnv := gomaxprocsFromEnv()
	want := daemonProcessors(workers, procs, fromEnv)
	if want == procs {
		if fromEnv && procs < workers+controlProcessors {
			log.Warn("GOMAXPROCS leaves no Go processor beside the I/O workers: lookups wait for the transfers (set engine.io_workers below it)",
				"gomaxprocs", procs, "io_workers", workers)
		} else {
			log.Info("Go processors", "gomaxprocs", procs, "io_workers", workers)
		}
		return workers, func() {}
	}
	runtime.GOMAXPROCS(want)
	log.Info("Go processors: more than the I/O workers, for the control path", "gomaxprocs", want, "io_workers", workers, "was", procs)
	return workers, runtime.SetDefaultGOMAXPROCS
}

// Processors is the Go processors a daemon of workers I/O workers runs
// with where the runtime chose procs: daemonProcessors with the
// GOMAXPROCS environment variable of this process (`kvhost config show`
// reports it).
func Processors(workers, procs int) int {
	return daemonProcessors(workers, procs, gomaxprocsFromEnv())
}
