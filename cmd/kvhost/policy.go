package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/tetratelabs/wazero"

	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/host/policy/conformance"
	kvdaemon "github.com/kvhost/kvhost/internal/daemon"
	"github.com/kvhost/kvhost/plugins"
)

const policyUsage = `usage:
  kvhost policy inspect NAME|FILE.wasm         describe a plugin: ABI version, features, hooks, imports, size
  kvhost policy test [flags] NAME|FILE.wasm    run the conformance suite; exit status 1 if a check fails
                                               (--json: the report as JSON, for CI)

NAME is a built-in policy (%s); an argument ending in .wasm or
containing '/' is a file.
`

// runPolicy implements `kvhost policy`.
func runPolicy(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	var tf testFlags
	fs := tf.flagSet(stderr)
	usage := func(w io.Writer) {
		fmt.Fprintf(w, policyUsage, strings.Join(plugins.Names(), ", "))
		fmt.Fprintln(w, "\ntest flags:")
		printFlags(fs, w)
	}
	// parseFlags prints it: to stdout after --help (as `kvhost policy
	// --help` does), to stderr after a bad flag.
	fs.Usage = func() { usage(fs.Output()) }
	if len(args) == 0 {
		usage(stderr)
		return 2
	}
	switch args[0] {
	case "inspect":
		// inspect has no flags but --help: any other argument that
		// begins with '-' before NAME|FILE.wasm is a usage error, and
		// -- ends the flags (a file named -x.wasm: ./-x.wasm or after --).
		ifs := newFlagSet("kvhost policy inspect", "", stderr)
		ifs.Usage = func() { usage(ifs.Output()) }
		if code, ok := parseFlags(ifs, args[1:], stdout); !ok {
			return code
		}
		if ifs.NArg() > 1 {
			fmt.Fprintf(stderr, "kvhost policy inspect: unexpected argument %q after %s\n\n", ifs.Arg(1), ifs.Arg(0))
		}
		if ifs.NArg() != 1 {
			usage(stderr)
			return 2
		}
		return policyInspect(ctx, ifs.Arg(0), stdout, stderr)
	case "test":
		if code, ok := parseFlags(fs, args[1:], stdout); !ok {
			return code
		}
		if fs.NArg() > 1 {
			fmt.Fprintf(stderr, "kvhost policy test: unexpected argument %q after %s (flags go before NAME|FILE.wasm)\n\n", fs.Arg(1), fs.Arg(0))
		}
		if fs.NArg() != 1 {
			usage(stderr)
			return 2
		}
		opts := tf.options(stderr)
		if tf.cacheDir != "" {
			cache, err := compilationCache(tf.cacheDir)
			if err != nil {
				fmt.Fprintf(stderr, "kvhost policy test: -cache-dir %s: %v\n", tf.cacheDir, err)
				return 1
			}
			defer cache.Close(ctx)
			opts.Cache = cache
		}
		return policyTest(ctx, fs.Arg(0), opts, tf.json, stdout, stderr)
	case "help", "-h", "-help", "--help":
		usage(stdout)
		return 0
	}
	fmt.Fprintf(stderr, "kvhost policy: unknown command %q\n\n", args[0])
	usage(stderr)
	return 2
}

// testFlags are the flags of `kvhost policy test`.
type testFlags struct {
	shards    int
	timeout   time.Duration
	memoryMiB int64
	entries   int
	verbose   bool
	json      bool
	params    map[string]string
	cacheDir  string
}

func (t *testFlags) flagSet(out io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("kvhost policy test", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.IntVar(&t.shards, "shards", 2, "plugin instances the host runs")
	fs.DurationVar(&t.timeout, "timeout", policy.DefaultCallTimeout, "deadline of one plugin call")
	fs.Int64Var(&t.memoryMiB, "memory-mib", policy.DefaultMemoryLimit>>20, "memory limit of one instance, in MiB")
	fs.IntVar(&t.entries, "entries", 4000, "entries of the capacity-pressure check")
	fs.BoolVar(&t.verbose, "v", false, "print the host's and the plugin's log (to stderr)")
	fs.BoolVar(&t.json, "json", false, "print the report as JSON: checks with their rules, call times per hook, the host's counters")
	fs.StringVar(&t.cacheDir, "cache-dir", "", "keep the compiled plugin in this `directory` for the next run, as the daemon's policy.cache_dir (default: compile in memory, keep nothing)")
	fs.Func("param", "plugin configuration `key=value` passed to kvhost_init (repeatable)", func(s string) error {
		k, v, ok := strings.Cut(s, "=")
		if !ok || k == "" {
			return errors.New("want key=value")
		}
		if t.params == nil {
			t.params = map[string]string{}
		}
		t.params[k] = v
		return nil
	})
	return fs
}

func (t *testFlags) options(logTo io.Writer) conformance.Options {
	opts := conformance.Options{Shards: t.shards, CallTimeout: t.timeout, MemoryLimit: t.memoryMiB << 20,
		Entries: t.entries, Params: t.params}
	if t.verbose {
		opts.Logger = slog.New(slog.NewTextHandler(logTo, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return opts
}

// compilationCache opens dir, made if missing, as an on-disk compilation
// cache, as the daemon opens policy.cache_dir.
func compilationCache(dir string) (wazero.CompilationCache, error) {
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, err
	}
	return wazero.NewCompilationCacheWithDir(dir)
}

// loadPlugin reads a plugin module: a file when arg ends in .wasm or
// contains '/' (a bare NAME.wasm that does not exist is the built-in
// NAME, as for the daemon: kvdaemon.Module), a built-in policy otherwise.
func loadPlugin(arg string) (name string, module []byte, err error) {
	if kvdaemon.IsPluginFile(arg) {
		b, _, _, err := kvdaemon.Module(arg)
		return arg, b, err
	}
	b, err := plugins.Wasm(arg)
	return arg, b, err
}

func policyInspect(ctx context.Context, arg string, stdout, stderr io.Writer) int {
	name, module, err := loadPlugin(arg)
	if err != nil {
		fmt.Fprintf(stderr, "kvhost policy inspect: %v\n", err)
		return 1
	}
	info, err := policy.Inspect(ctx, module)
	if err != nil {
		fmt.Fprintf(stderr, "kvhost policy inspect: %s: %v\n", name, err)
		return 1
	}
	writeInfo(stdout, name, info)
	if !info.OK() {
		return 1
	}
	return 0
}

// writeInfo prints what Inspect found, for a vendor.
func writeInfo(w io.Writer, name string, info policy.Info) {
	version := "unknown"
	if info.VersionKnown {
		version = fmt.Sprint(info.ABIVersion)
	}
	memory := fmt.Sprintf("min %d pages (%s)", info.MemoryMin, mib(uint64(info.MemoryMin)<<16))
	if info.MemoryMaxSet {
		memory += fmt.Sprintf(", max %d pages (%s)", info.MemoryMax, mib(uint64(info.MemoryMax)<<16))
	} else {
		memory += ", no max (the host's limit applies)"
	}
	fmt.Fprintf(w, "plugin:      %s\n", name)
	fmt.Fprintf(w, "size:        %d bytes\n", info.Size)
	fmt.Fprintf(w, "abi version: %s\n", version)
	fmt.Fprintf(w, "features:    %s\n", info.Features)
	fmt.Fprintf(w, "hooks:       %s\n", strings.Join(info.Hooks, ", "))
	fmt.Fprintf(w, "memory:      %s\n", memory)
	list := func(title string, items []string) {
		fmt.Fprintf(w, "%s:\n", title)
		if len(items) == 0 {
			fmt.Fprintln(w, "  (none)")
		}
		for _, it := range items {
			fmt.Fprintf(w, "  %s\n", it)
		}
	}
	list("imports", info.Imports)
	list("exports", info.Exports)
	if info.OK() {
		fmt.Fprintf(w, "OK: %s implements ABI v%d\n", name, info.ABIVersion)
		return
	}
	list("problems", info.Problems)
	fmt.Fprintf(w, "FAIL: %s does not implement this host's ABI\n", name)
}

func mib(n uint64) string { return fmt.Sprintf("%.4g MiB", float64(n)/(1<<20)) }

func policyTest(ctx context.Context, arg string, opts conformance.Options, asJSON bool, stdout, stderr io.Writer) int {
	name, module, err := loadPlugin(arg)
	if err != nil {
		fmt.Fprintf(stderr, "kvhost policy test: %v\n", err)
		return 1
	}
	opts.Name = name
	report := conformance.Run(ctx, module, opts)
	if asJSON {
		err = report.WriteJSON(stdout)
	} else {
		_, err = report.WriteTo(stdout)
	}
	if err != nil {
		fmt.Fprintf(stderr, "kvhost policy test: %v\n", err)
		return 1
	}
	if !report.OK() {
		return 1
	}
	return 0
}
