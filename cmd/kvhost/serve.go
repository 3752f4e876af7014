package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/kvhost/kvhost/internal/config"
	kvdaemon "github.com/kvhost/kvhost/internal/daemon"
	"github.com/kvhost/kvhost/protocol"
)

// runServe runs the daemon (kvdaemon.Run, which says what it does at
// each signal) with the flags of args, and returns its exit status: 0
// once it stopped as asked, 1 at a second stop signal or on an error
// after its configuration was accepted, 2 for a refused configuration
// (fatal).
func runServe(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runServeWith(ctx, kvdaemon.Options{}, args, stdout, stderr)
}

// runServeWith is runServe with the seams of o that tests set (FS, Now,
// Term); the rest of o is set here.
func runServeWith(ctx context.Context, o kvdaemon.Options, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("kvhost serve", "usage: kvhost [serve] [flags]\n\nRuns the kvhost daemon (docs/serve.md).", stderr)
	flags := config.BindFlags(fs)
	if code, ok := parseFlagsOnly(fs, args, stdout, stderr); !ok {
		return code
	}
	o.Flags, o.Name, o.Stdout, o.Stderr = flags, serverName(), stdout, stderr
	err := kvdaemon.Run(ctx, o)
	switch {
	case err == nil:
		return 0
	case errors.Is(err, kvdaemon.ErrForcedExit):
		return 1 // logged: the daemon exits at once
	case errors.Is(err, kvdaemon.ErrConfig):
		fmt.Fprintf(stderr, "kvhost: %v\n", err)
		return 2
	}
	return fatal(stderr, err)
}

// fatal writes err, the error the daemon stopped on, as one plain line
// on stderr, "kvhost: ERROR", whatever the log's format, and returns the
// exit status (main's usage, "exit status"): 2 for an error of the
// configuration (a key, named with its file and line or its flag), 1
// for any other.
func fatal(stderr io.Writer, err error) int {
	fmt.Fprintf(stderr, "kvhost: %s\n", strings.ReplaceAll(err.Error(), "\n", "; "))
	if ke := (*config.KeyError)(nil); errors.As(err, &ke) {
		return 2
	}
	return 1
}

// serverName is the daemon's name and version in the handshake.
func serverName() string {
	v := versionString()
	if i := strings.Index(v, " go1"); i > 0 {
		v = v[:i]
	}
	return v[:min(len(v), protocol.MaxName)]
}

// nonEmpty is []string{s}, or nil when s is empty (the default search
// paths).
func nonEmpty(s string) []string {
	if s == "" {
		return nil
	}
	return []string{s}
}
