package main

import (
	"context"
	"fmt"
	"io"

	"github.com/kvhost/kvhost/config"
)

// runConfig implements `kvhost config check FILE...`: it reads each file
// as the daemon would (TOML syntax, unknown keys, types, sizes, durations,
// cross-field rules) and prints "FILE: ok" or the error with its line and
// key.
func runConfig(_ context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprintln(stderr, "usage: kvhost config check FILE...")
		return 2
	}
	switch args[0] {
	case "check":
		if len(args) < 2 {
			fmt.Fprintln(stderr, "usage: kvhost config check FILE...")
			return 2
		}
		code := 0
		for _, f := range args[1:] {
			if _, err := config.Load(f); err != nil {
				fmt.Fprintf(stderr, "%v\n", err)
				code = 1
				continue
			}
			fmt.Fprintf(stdout, "%s: ok\n", f)
		}
		return code
	}
	fmt.Fprintf(stderr, "kvhost config: unknown subcommand %q (want check)\n", args[0])
	return 2
}
