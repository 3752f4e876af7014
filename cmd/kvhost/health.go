package main

import (
	"context"
	"fmt"
	"io"
	"time"
)

// runHealth implements `kvhost health [--socket S]`, for exec probes: it
// says hello to the daemon and asks for its Stats within --timeout. Exit
// status 0: the daemon answers (and its policy has not fallen back, unless
// --allow-fallback); 1: it does not, or it fell back.
func runHealth(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("kvhost health", "usage: kvhost health [--socket PATH] [--timeout D]\n\nExit 0 if the daemon answers (Hello and Stats), else 1 (Kubernetes exec probes).", stderr)
	df := bindDaemonFlags(fs, 5*time.Second, "fail if the daemon has not answered by then")
	allowFallback := fs.Bool("allow-fallback", true, "healthy even when the policy plugin fell back to native lru")
	quiet := fs.Bool("quiet", false, "print nothing when healthy")
	if code, ok := parseFlags(fs, args); !ok {
		return code
	}
	r, err := df.stats(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "kvhost health: unhealthy: %s: %v\n", *df.socket, err)
		return 1
	}
	if r.Policy.Fallback && !*allowFallback {
		fmt.Fprintf(stderr, "kvhost health: unhealthy: the policy %s fell back to native lru: %s\n", r.Policy.Name, r.Policy.FallbackReason)
		return 1
	}
	if !*quiet {
		fmt.Fprintf(stdout, "kvhost health: ok (%s, %d clients, %d jobs in flight)\n", r.Version, r.Clients, r.InflightJobs)
	}
	return 0
}
