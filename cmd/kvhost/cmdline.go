package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/protocol"
)

// newFlagSet is the flag set of the subcommand name ("kvhost stats"):
// its output, where Parse names a bad flag, is stderr, and its Usage
// prints usage (the synopsis and a sentence or two, without a trailing
// newline) followed by the flags, where it has any, to that output.
// Parse it with parseFlags, which prints the usage where it belongs.
func newFlagSet(name, usage string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), usage)
		hasFlags := false
		fs.VisitAll(func(*flag.Flag) { hasFlags = true })
		if hasFlags {
			fmt.Fprintln(fs.Output(), "\nflags:")
			printFlags(fs, fs.Output())
		}
	}
	return fs
}

// printFlags is fs.PrintDefaults to w with each flag spelt --name, as the
// docs write it (the flag package takes -name and --name alike).
func printFlags(fs *flag.FlagSet, w io.Writer) {
	var b strings.Builder
	out := fs.Output()
	fs.SetOutput(&b)
	fs.PrintDefaults()
	fs.SetOutput(out)
	io.WriteString(w, flagLine.ReplaceAllString(b.String(), "$1--"))
}

// flagLine is the start of a flag's line in PrintDefaults's output.
var flagLine = regexp.MustCompile(`(?m)^(  )-`)

// flagErrorDash is where the flag package's errors name a flag -name.
var flagErrorDash = regexp.MustCompile(`(flag provided but not defined: |for flag |flag needs an argument: )-([^-])`)

// flagError is the flag package's error err, naming the flag --name.
func flagError(err error) string {
	return flagErrorDash.ReplaceAllString(err.Error(), "$1--$2")
}

// parseFlags parses args into fs, made by newFlagSet. When ok is false
// the command is over and exits with code: 0 after --help (or -h), whose
// usage goes to stdout, as asked for; 2 after a usage error (a bad flag
// or value), named in one line on fs's output, stderr, that ends "see
// NAME --help" (the usage is not repeated).
func parseFlags(fs *flag.FlagSet, args []string, stdout io.Writer) (code int, ok bool) {
	// Parse prints its error and the usage to fs's output: quiet, it
	// leaves them to be printed below, on the stream that the outcome
	// calls for.
	usage, stderr := fs.Usage, fs.Output()
	fs.Usage = func() {}
	fs.SetOutput(io.Discard)
	err := fs.Parse(args)
	fs.Usage = usage
	fs.SetOutput(stderr)
	switch {
	case errors.Is(err, flag.ErrHelp):
		fs.SetOutput(stdout)
		fs.Usage()
		fs.SetOutput(stderr)
		return 0, false
	case err != nil:
		fmt.Fprintf(stderr, "%s: %s (see %s --help)\n", fs.Name(), flagError(err), fs.Name())
		return 2, false
	}
	return 0, true
}

// parseFlagsOnly is parseFlags for a command that takes no positional
// arguments: the first one left after the flags is a usage error (exit 2),
// named on stderr.
func parseFlagsOnly(fs *flag.FlagSet, args []string, stdout, stderr io.Writer) (code int, ok bool) {
	if code, ok := parseFlags(fs, args, stdout); !ok {
		return code, false
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "%s: unexpected argument %q\n", fs.Name(), fs.Arg(0))
		return 2, false
	}
	return 0, true
}

// parseFlagsAmongArgs is parseFlags for a command whose positional
// arguments (its files) may come before, among and after its flags: an
// argument that begins with '-' is a flag wherever it stands, up to the
// first "--", after which every argument is positional (so a file named
// -x is given as ./-x or after --; no flag's value can be "--"). It
// returns the positional arguments in their order.
func parseFlagsAmongArgs(fs *flag.FlagSet, args []string, stdout io.Writer) (positional []string, code int, ok bool) {
	var after []string
	if i := slices.Index(args, "--"); i >= 0 {
		args, after = args[:i], args[i+1:]
	}
	for {
		if code, ok := parseFlags(fs, args, stdout); !ok {
			return nil, code, false
		}
		if fs.NArg() == 0 {
			return append(positional, after...), 0, true
		}
		positional = append(positional, fs.Arg(0))
		args = fs.Args()[1:]
	}
}

// daemonFlags are the flags of a command that talks to a running daemon:
// its socket (given, or read from the daemon's configuration file) and
// how long the whole command may take.
type daemonFlags struct {
	socket  *string
	config  *string
	timeout *time.Duration
}

// bindDaemonFlags defines --socket (default client.DefaultSocket()),
// --config and --timeout (default timeout, described by timeoutUsage) on
// fs.
func bindDaemonFlags(fs *flag.FlagSet, timeout time.Duration, timeoutUsage string) daemonFlags {
	return daemonFlags{
		socket:  fs.String("socket", client.DefaultSocket(), "the daemon's Unix socket `path`"),
		config:  fs.String("config", "", "the daemon's configuration `file`: its server.socket is the socket (--socket wins)"),
		timeout: fs.Duration("timeout", timeout, timeoutUsage),
	}
}

// parse parses args into fs (parseFlagsOnly: these commands take no
// positional argument, so a socket path without --socket, or the "false"
// of "--allow-fallback false", is a usage error, not ignored) and then,
// where --config was given and --socket was not, takes the socket from
// the configuration file as the daemon would (its default where the file
// names none). Only server.socket is read (config.Socket): errors in the
// rest of the file are a warning on stderr, since the command needs none
// of it; a file whose socket cannot be read ends the command with exit
// code 2.
func (f daemonFlags) parse(fs *flag.FlagSet, args []string, stdout, stderr io.Writer) (code int, ok bool) {
	if code, ok := parseFlagsOnly(fs, args, stdout, stderr); !ok {
		return code, false
	}
	if *f.config == "" {
		return 0, true
	}
	given := false
	fs.Visit(func(fl *flag.Flag) { given = given || fl.Name == "socket" })
	if given {
		return 0, true
	}
	socket, rest, err := config.Socket(*f.config)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", fs.Name(), err)
		return 2, false
	}
	if rest != nil {
		fmt.Fprintf(stderr, "%s: warning: the daemon would refuse this configuration (%v); only its socket is needed here: %s\n", fs.Name(), rest, socket)
	}
	*f.socket = socket
	return 0, true
}

// explain words err, a command's failure to get what it asked of the
// daemon behind --socket: where --timeout passed, it says so, with the
// timeout, rather than only Go's "context deadline exceeded".
func (f daemonFlags) explain(err error) error {
	if errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("no answer within --timeout %v: %w", *f.timeout, err)
	}
	return err
}

// withTimeout is ctx limited by --timeout.
func (f daemonFlags) withTimeout(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, *f.timeout)
}

// stats asks the daemon behind --socket for its Stats (queryStats) within
// --timeout.
func (f daemonFlags) stats(ctx context.Context) (statsReport, error) {
	ctx, cancel := f.withTimeout(ctx)
	defer cancel()
	return queryStats(ctx, *f.socket)
}

// dialDaemon is client.Dial for the commands that talk to a daemon (stats,
// health, purge, reload): where the listener on socket answers the Hello
// with what is no kvhost frame (another program's socket), the error says
// so rather than only how the bytes failed to decode; where connecting
// fails, it is a *dialError, which says what to do. The commands print
// the socket before the error, which therefore does not name it. A path
// longer than a Unix socket's address holds (connect's EINVAL) says so,
// and how to reach such a socket.
func dialDaemon(ctx context.Context, socket, name string) (*client.Client, error) {
	if len(socket) > config.MaxSocketPath {
		return nil, fmt.Errorf("a Unix socket's path holds at most %d bytes, and this one has %d: give it relative to a directory nearer the socket (cd there first)", config.MaxSocketPath, len(socket))
	}
	c, err := client.Dial(ctx, socket, name)
	if errors.Is(err, protocol.ErrTooLarge) || errors.Is(err, protocol.ErrMalformed) || errors.Is(err, protocol.ErrUnknownType) {
		return nil, fmt.Errorf("not a kvhost daemon's socket (its answer to the handshake is no kvhost frame): %w", err)
	}
	if err != nil {
		return nil, explainDial(err)
	}
	return c, nil
}

// The hints of a failed connection to the daemon's socket, one wording
// for every command that dials it.
const (
	// hintNoDaemon: nothing listens on the socket (ENOENT, ECONNREFUSED).
	hintNoDaemon = "is the daemon running? (give its --socket, or --config to read the socket from its config)"
	// hintNoAccess: the socket, or a directory above it, refuses this
	// user (EACCES, EPERM).
	hintNoAccess = "permission denied: run as a member of the daemon's server.socket_group (or root)"
)

// dialError is a failed connection to the daemon's socket: the system
// call's error and what to do about it. It unwraps to client.Dial's
// error, so errors.Is(err, syscall.ENOENT) holds.
type dialError struct {
	err  error // client.Dial's
	msg  string
	hint string
}

// Error is the system call's error and the hint, without the socket's
// path (the commands print it once, before the error).
func (e *dialError) Error() string { return e.msg + ": " + e.hint }

// Unwrap returns client.Dial's error.
func (e *dialError) Unwrap() error { return e.err }

// explainDial turns client.Dial's err into a *dialError where connecting
// failed for a reason with a known fix; any other error is returned as
// it is.
func explainDial(err error) error {
	var se *os.SyscallError
	if !errors.As(err, &se) {
		return err
	}
	switch {
	case errors.Is(se.Err, syscall.ENOENT), errors.Is(se.Err, syscall.ECONNREFUSED):
		return &dialError{err: err, msg: se.Error(), hint: hintNoDaemon}
	case errors.Is(se.Err, syscall.EACCES), errors.Is(se.Err, syscall.EPERM):
		// The hint names the errno itself.
		return &dialError{err: err, msg: se.Syscall, hint: hintNoAccess}
	}
	return err
}
