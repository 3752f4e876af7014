package main

import (
	"context"
	"fmt"
	"io"
	"time"
)

// runHealth implements `kvhost health [--socket S]`, for exec probes: it
// says hello to the daemon and asks for its Stats within --timeout. Exit
// status 0: the daemon answers, its policy has not fallen back (unless
// --allow-fallback) and no GPU it serves has a broken context (a job
// failed there with a sticky CUDA error; unless --allow-device-faults);
// 1: otherwise.
func runHealth(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("kvhost health", "usage: kvhost health [--socket PATH | --config FILE] [--timeout D]\n\nExit 0 if the daemon answers (Hello and Stats) and no GPU it serves is broken, else 1 (Kubernetes exec probes).", stderr)
	df := bindDaemonFlags(fs, 5*time.Second, "fail if the daemon has not answered by then")
	allowFallback := fs.Bool("allow-fallback", true, "healthy even when the policy plugin fell back to its native fallback (tiered on several mounts, lru on one)")
	allowFaults := fs.Bool("allow-device-faults", false, "healthy even when a GPU's context is broken (a job failed there with a sticky CUDA error; every later job there fails until the daemon restarts)")
	quiet := fs.Bool("quiet", false, "print nothing when healthy")
	if code, ok := df.parse(fs, args, stderr); !ok {
		return code
	}
	r, err := df.stats(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "kvhost health: unhealthy: %s: %v\n", *df.socket, err)
		return 1
	}
	if why := unhealthy(r, *allowFallback, *allowFaults); why != "" {
		fmt.Fprintf(stderr, "kvhost health: unhealthy: %s\n", why)
		return 1
	}
	if !*quiet {
		fmt.Fprintf(stdout, "kvhost health: ok (%s, %d clients, %d jobs in flight)\n", r.Version, r.Clients, r.InflightJobs)
	}
	return 0
}

// unhealthy says why a daemon that answered with r is unhealthy, or ""
// where it is not: its policy fell back to its native fallback (unless
// allowFallback), or a GPU it serves has a broken context (unless
// allowFaults).
func unhealthy(r statsReport, allowFallback, allowFaults bool) string {
	if r.Policy.Fallback && !allowFallback {
		return fmt.Sprintf("the policy %s fell back to its native fallback: %s", r.Policy.Name, r.Policy.FallbackReason)
	}
	if !allowFaults {
		for _, d := range r.Devices {
			if d.Faults > 0 {
				return d.faultText()
			}
		}
	}
	return ""
}
