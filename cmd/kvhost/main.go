// Command kvhost is the node-local KV-cache storage daemon and its tools.
//
//	kvhost [serve] [flags]          run the daemon (the default)
//	kvhost policy inspect NAME|FILE  describe a policy plugin
//	kvhost policy test NAME|FILE     run the plugin conformance suite
//	kvhost config check FILE...      check configuration files
//	kvhost version                   print the version (also --version)
//	kvhost stats [--json]            show a running daemon's state
//	kvhost health                    exit 0 if the daemon answers (probes)
//	kvhost reload                    reload the daemon's configuration
//	kvhost check [--dir DIR]         diagnose GPU, cuFile and mounts
//	kvhost bench --dir DIR           benchmark the engine against its ceilings
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"

	"github.com/kvhost/kvhost/internal/config"
)

// command is one subcommand: it gets its arguments (after its name) and
// returns the process exit code.
type command struct {
	summary string
	run     func(ctx context.Context, args []string, stdout, stderr io.Writer) int
}

func commands() map[string]command {
	return map[string]command{
		"serve":   {"run the daemon (the default)", runServe},
		"policy":  {"inspect or test a placement-policy plugin", runPolicy},
		"config":  {"check configuration files, show the effective one", runConfig},
		"check":   {"diagnose GPU, cuFile and mounts (like gdscheck)", runCheck},
		"bench":   {"benchmark the engine against ceilings measured in the same run", runBench},
		"version": {"print the version", runVersion},
		"stats":   {"show a running daemon's state", runStats},
		"health":  {"exit 0 if the daemon answers (for probes)", runHealth},
		"reload":  {"reload the daemon's configuration (SIGHUP) and report", runReload},
		"purge":   {"remove every file of a model's namespaces from a running daemon", runPurge},
	}
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cmds := commands()
	if len(args) > 0 {
		switch args[0] {
		case "help":
			// `kvhost help CMD` is `kvhost CMD --help`; `kvhost help
			// --help` is `kvhost help`.
			if len(args) == 2 && slices.Contains([]string{"-h", "-help", "--help", "help"}, args[1]) {
				usage(stdout, cmds)
				return 0
			}
			if len(args) == 2 {
				if c, ok := cmds[args[1]]; ok {
					return c.run(ctx, []string{"--help"}, stdout, stderr)
				}
				unknownCommand(stderr, "kvhost help", args[1], cmds)
				return 2
			}
			if len(args) > 2 {
				fmt.Fprintf(stderr, "kvhost help: want at most one command, got %q\n", args[1:])
				return 2
			}
			usage(stdout, cmds)
			return 0
		case "-h", "-help", "--help":
			usage(stdout, cmds)
			return 0
		case "-version", "--version":
			// `kvhost version`'s other spelling: what follows is
			// its arguments, refused as there.
			return runVersion(ctx, args[1:], stdout, stderr)
		}
		if c, ok := cmds[args[0]]; ok {
			return c.run(ctx, args[1:], stdout, stderr)
		}
		if !strings.HasPrefix(args[0], "-") {
			// serve, the default command, takes flags only: a first
			// word that is no command is a mistyped one.
			unknownCommand(stderr, "kvhost", args[0], cmds)
			return 2
		}
	}
	if c, ok := cmds["serve"]; ok {
		return c.run(ctx, args, stdout, stderr)
	}
	usage(stderr, cmds)
	return 2
}

// unknownCommand says that name is no command of cmds in a few lines,
// not the whole usage: the command likely meant (one that name begins
// or that begins name, or one edit or two away), the commands, and where
// the usage is.
func unknownCommand(w io.Writer, prefix, name string, cmds map[string]command) {
	names := make([]string, 0, len(cmds))
	for n := range cmds {
		names = append(names, n)
	}
	slices.Sort(names)
	fmt.Fprintf(w, "%s: unknown command %q", prefix, name)
	best, bestDist := "", 3
	for _, n := range names {
		d := editDistance(name, n)
		if strings.HasPrefix(n, name) || strings.HasPrefix(name, n) {
			d = min(d, 1)
		}
		if d < bestDist {
			best, bestDist = n, d
		}
	}
	if best != "" {
		fmt.Fprintf(w, " (did you mean %q?)", best)
	}
	fmt.Fprintf(w, "\ncommands: %s\nkvhost --help lists them with the daemon's flags; kvhost COMMAND --help describes one.\n",
		strings.Join(names, ", "))
}

// editDistance is the Levenshtein distance between a and b (bytes).
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

// usage prints the commands and the daemon's flags (serve is the default
// command, so its flags are kvhost's own).
func usage(w io.Writer, cmds map[string]command) {
	fmt.Fprintln(w, "usage: kvhost [command] [flags]")
	fmt.Fprintln(w, "\ncommands:")
	// The daemon and its operators' commands first, in this order; any
	// other command after them, by name, so that none goes unlisted.
	order := []string{"serve", "stats", "health", "reload", "purge", "check", "bench", "policy", "config", "version"}
	var rest []string
	for name := range cmds {
		if !slices.Contains(order, name) {
			rest = append(rest, name)
		}
	}
	slices.Sort(rest)
	for _, name := range append(order, rest...) {
		if c, ok := cmds[name]; ok {
			fmt.Fprintf(w, "  %-8s %s\n", name, c.summary)
		}
	}
	fmt.Fprintln(w, "\ndaemon flags (kvhost [serve] [flags]; they override the --config file):")
	fs := flag.NewFlagSet("kvhost serve", flag.ContinueOnError)
	config.BindFlags(fs)
	printFlags(fs, w)
	fmt.Fprintln(w, "\nkvhost COMMAND --help (or kvhost help COMMAND) describes a command's own flags.")
	fmt.Fprint(w, exitCodes)
}

// exitCodes is the rule every command's exit status follows
// (docs/serve.md, "Exit status").
const exitCodes = `
exit status:
  0  success
  1  runtime failure: the daemon stopped on an error after its configuration
     was accepted (a mount, the socket, the GPU), or a command's check failed
  2  usage or configuration error: a bad flag or value, a configuration file
     or key (named with its file and line, or its flag) that the daemon refuses
`
