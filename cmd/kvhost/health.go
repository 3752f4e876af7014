package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"
)

// runHealth implements `kvhost health [--socket S]`, for exec probes: it
// says hello to the daemon and asks for its Stats within --timeout. Exit
// status 0: the daemon answers, its policy has not fallen back (unless
// --allow-fallback), no GPU it serves has a broken context (a job
// failed there with a sticky CUDA error; unless --allow-device-faults)
// and no mount refuses stores (unless --allow-failing-mounts, the
// default: a warning line then names each, even with --quiet); 1:
// otherwise.
func runHealth(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("kvhost health", "usage: kvhost health [--socket PATH | --config FILE] [--timeout D]\n\nExit 0 if the daemon answers (Hello and Stats) and no GPU it serves is broken, else 1 (Kubernetes exec probes). A mount that refuses stores is a warning.", stderr)
	df := bindDaemonFlags(fs, 5*time.Second, "fail if the daemon has not answered by then")
	h := healthOptions{}
	fs.BoolVar(&h.allowFallback, "allow-fallback", true, "healthy even when the policy plugin fell back to its native fallback (tiered on several mounts, lru on one)")
	fs.BoolVar(&h.allowFaults, "allow-device-faults", false, "healthy even when a GPU's context is broken (a job failed there with a sticky CUDA error; every later job there fails until the daemon restarts)")
	fs.BoolVar(&h.allowFailingMounts, "allow-failing-mounts", true, "healthy, with a warning, even when a mount refuses stores (read-only, I/O errors, no room: a restart does not mend it)")
	quiet := fs.Bool("quiet", false, "print nothing when healthy and nothing to warn of")
	if code, ok := df.parse(fs, args, stdout, stderr); !ok {
		return code
	}
	r, err := df.stats(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "kvhost health: unhealthy: %s: %v\n", *df.socket, df.explain(err))
		return 1
	}
	if why := unhealthy(r, h); why != "" {
		fmt.Fprintf(stderr, "kvhost health: unhealthy: %s\n", why)
		return 1
	}
	warnings := healthWarnings(r)
	for _, w := range warnings {
		fmt.Fprintf(stderr, "kvhost health: warning: %s\n", w)
	}
	if !*quiet {
		state := "ok"
		if n := len(warnings); n > 0 {
			state = "ok, " + counted(n, "warning")
		}
		fmt.Fprintf(stdout, "kvhost health: %s (%s, %d clients, %d jobs in flight)\n", state, r.Version, r.Clients, r.InflightJobs)
	}
	return 0
}

// healthOptions are what `kvhost health` lets pass as healthy.
type healthOptions struct {
	allowFallback      bool // the policy fell back to its native fallback
	allowFaults        bool // a GPU's context is broken
	allowFailingMounts bool // a mount refuses stores
}

// unhealthy says why a daemon that answered with r is unhealthy, or ""
// where it is not: its policy fell back to its native fallback (unless
// allowFallback), a GPU it serves has a broken context (unless
// allowFaults), or a mount refuses stores (unless allowFailingMounts).
func unhealthy(r statsReport, h healthOptions) string {
	if r.Policy.Fallback && !h.allowFallback {
		return fmt.Sprintf("the policy %s fell back to its native fallback: %s", r.Policy.Name, r.Policy.FallbackReason)
	}
	if !h.allowFaults {
		for _, d := range r.Devices {
			if d.Faults > 0 {
				return d.faultText()
			}
		}
	}
	if !h.allowFailingMounts {
		if w := healthWarnings(r); len(w) > 0 {
			return strings.Join(w, "; ")
		}
	}
	return ""
}

// healthWarnings says what of a daemon that answered with r an operator
// should look at although it serves: each mount that refuses stores.
func healthWarnings(r statsReport) []string {
	var w []string
	for _, m := range r.Mounts {
		if f := m.StoresFailing; f != nil {
			w = append(w, f.text(m.Path))
		}
	}
	return w
}
