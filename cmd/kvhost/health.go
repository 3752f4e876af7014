package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/kvhost/kvhost/client"
)

// runHealth implements `kvhost health [--socket S]`, for exec probes: it
// says hello to the daemon and asks for its Stats within --timeout. Exit
// status 0: the daemon answers (and its policy has not fallen back, unless
// --allow-fallback); 1: it does not, or it fell back.
func runHealth(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("kvhost health", flag.ContinueOnError)
	fs.SetOutput(stderr)
	socket := fs.String("socket", client.DefaultSocket(), "the daemon's Unix socket `path`")
	timeout := fs.Duration("timeout", 5*time.Second, "fail if the daemon has not answered by then")
	allowFallback := fs.Bool("allow-fallback", true, "healthy even when the policy plugin fell back to native lru")
	quiet := fs.Bool("quiet", false, "print nothing when healthy")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: kvhost health [--socket PATH] [--timeout D]\n\nExit 0 if the daemon answers (Hello and Stats), else 1 (Kubernetes exec probes).\n\nflags:")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	r, err := queryStats(ctx, *socket)
	if err != nil {
		fmt.Fprintf(stderr, "kvhost health: unhealthy: %s: %v\n", *socket, err)
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
