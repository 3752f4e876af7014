// Command kvhost is the node-local KV-cache storage daemon and its tools.
//
//	kvhost [serve] [flags]          run the daemon (the default)
//	kvhost policy inspect NAME|FILE  describe a policy plugin
//	kvhost policy test NAME|FILE     run the plugin conformance suite
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

// command is one subcommand: it gets its arguments (after its name) and
// returns the process exit code.
type command struct {
	summary string
	run     func(ctx context.Context, args []string, stdout, stderr io.Writer) int
}

func commands() map[string]command {
	return map[string]command{
		"serve":  {"run the daemon (the default)", runServe},
		"policy": {"inspect or test a placement-policy plugin", runPolicy},
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
		case "help", "-h", "-help", "--help":
			usage(stdout, cmds)
			return 0
		}
		if c, ok := cmds[args[0]]; ok {
			return c.run(ctx, args[1:], stdout, stderr)
		}
	}
	if c, ok := cmds["serve"]; ok {
		return c.run(ctx, args, stdout, stderr)
	}
	usage(stderr, cmds)
	return 2
}

func usage(w io.Writer, cmds map[string]command) {
	fmt.Fprintln(w, "usage: kvhost [command] [flags]")
	fmt.Fprintln(w, "\ncommands:")
	for _, name := range []string{"serve", "policy"} {
		if c, ok := cmds[name]; ok {
			fmt.Fprintf(w, "  %-8s %s\n", name, c.summary)
		}
	}
}
