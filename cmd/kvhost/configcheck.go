package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/kvhost/kvhost/internal/config"
	kvdaemon "github.com/kvhost/kvhost/internal/daemon"
	"github.com/kvhost/kvhost/internal/server"
)

// configUsage describes `kvhost config`.
const configUsage = `usage: kvhost config check FILE...
       kvhost config show [--config FILE] [daemon flags]

check: checks configuration files as the daemon reads them (TOML syntax,
unknown keys, types, sizes, durations, rules across fields, the name of a
built-in policy and the [policy.params] it refuses at start, mounts that
overlap, a plugin .wasm file as the daemon loads it, and refused where it
does not exist here) and prints "FILE: ok" or the
error with its line and key. Exit 0: every file is ok; 1: one is not;
2: usage. Apart from --help it has no flags: any other argument that
begins with '-' is a usage error, so a FILE named so is given as
./-x.toml, or after --.

show: prints the configuration the daemon would run with, as TOML, with
the defaults it computes resolved and commented (kvhost config show
--help says which). Exit 1 with the error on a bad file, or one the
daemon's start refuses.

docs/config.md describes every key.`

// checkAtStart refuses, with the error the daemon's start would stop
// on, what config check and config show find in cfg, loaded from file
// ("": flags only) beyond what Load checks: mounts of kvhost's layout
// that are one directory, or one inside the other (overlappingMounts),
// named at the later one's path, and a policy that does not start as the
// daemon's start builds it (kvdaemon.StartPolicy: a policy.name that is not built
// in, a plugin file that is not a WebAssembly module, a [policy.params]
// key its kvhost_init refuses). A plugin file that does not exist here is
// refused too, as the daemon's start refuses it, with a hint that the
// file may be meant for another node (check there).
func checkAtStart(ctx context.Context, file string, cfg config.Config) error {
	if o := overlappingMounts(cfg.Mounts); len(o) > 0 {
		return config.AtKey(file, "mount.path", o[0].second, o[0].err)
	}
	if kvdaemon.IsPluginFile(cfg.Policy.Name) {
		if _, _, _, err := kvdaemon.Module(cfg.Policy.Name); errors.Is(err, os.ErrNotExist) {
			return config.AtKey(file, "policy.name", 0, fmt.Errorf("plugin %s: no such file here: the daemon would not start with it "+
				"(if it exists only on the node that runs the daemon, check there): %w", cfg.Policy.Name, err))
		}
	}
	if _, _, err := kvdaemon.StartPolicy(ctx, cfg); err != nil {
		return kvdaemon.PolicyStartError(file, cfg, err)
	}
	return nil
}

// runConfig implements `kvhost config check FILE...`, which reads each
// file as the daemon would (TOML syntax, unknown keys, types, sizes,
// durations, cross-field rules) and prints "FILE: ok" or the error with
// its line and key, and `kvhost config show` (runConfigShow).
func runConfig(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprintln(stderr, configUsage)
		return 2
	}
	switch args[0] {
	case "help", "-h", "-help", "--help":
		fmt.Fprintln(stdout, configUsage)
		return 0
	case "show":
		return runConfigShow(ctx, args[1:], stdout, stderr)
	case "check":
		// --help, or a flag config check does not have, wherever it
		// stands, ends the command before any file is read.
		fs := newFlagSet("kvhost config check", configUsage, stderr)
		files, code, ok := parseFlagsAmongArgs(fs, args[1:], stdout)
		if !ok {
			return code
		}
		if len(files) == 0 {
			fmt.Fprintln(stderr, configUsage)
			return 2
		}
		for _, f := range files {
			c, err := config.Load(f)
			if err == nil {
				err = checkAtStart(ctx, f, c)
			}
			if err == nil && c.Server.SocketGroup != "" {
				if _, gerr := server.LookupGroup(c.Server.SocketGroup); gerr != nil {
					err = config.AtKey(f, "server.socket_group", 0, fmt.Errorf("%w: the daemon would not start", gerr))
				}
			}
			if err != nil {
				fmt.Fprintf(stderr, "%v\n", err)
				code = 1
				continue
			}
			fmt.Fprintf(stdout, "%s: ok\n", f)
		}
		return code
	}
	fmt.Fprintf(stderr, "kvhost config: unknown subcommand %q (want check or show)\n", args[0])
	return 2
}
