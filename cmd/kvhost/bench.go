package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"runtime/trace"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/internal/bench"
	"github.com/kvhost/kvhost/internal/config"
	kvdaemon "github.com/kvhost/kvhost/internal/daemon"
	"github.com/kvhost/kvhost/internal/logging"
)

// benchOptions are `kvhost bench`'s settings (docs/bench.md).
type benchOptions struct {
	dir          string
	geometry     bench.Geometry
	tokensPerKey []int
	jobs         []int
	paths        []string // auto, cufile, staging, posix
	checksums    []bool
	store, load  bool // the mix: timed store and/or load phases
	hitRatio     float64
	keys         int // per phase; 0: total / key size
	total        int64
	keysPerJob   int
	memory       string // auto, gpu, host
	rounds       int
	// ceilingPasses is how many ceiling passes run per round, summed
	// over the rounds as the engine's phases are.
	ceilingPasses int
	duration      time.Duration
	dropCaches    bool
	verify        bool
	fsync         bool
	allowCompat   bool
	warmup        bool
	full          bool // a full cache: rounds evict the previous round's files
	noGap         bool // loads right after stores: no settle, ceilings after the load
	restart       bool // loads in a new engine and GPU paths opened after the store
	foreign       bool // loads by a second engine, another node's, opened before the store
	readFirst     bool // a plain read of the load's own files, timed before each load
	// preallocate is the mount's Preallocate (PreallocateAuto of
	// package engine for auto): spares made ahead of stores, which the benchmark waits
	// for before each timed phase.
	preallocate int64
	keep        bool
	jsonOut     string
	appendTo    string
	render      string
	svgOut      string
	cpuProfile  string
	mutexProf   string
	traceOut    string
	progress    string // auto, on, off
	cfg         config.Config
	args        []string
}

// runBench is `kvhost bench`.
func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("kvhost bench", "usage: kvhost bench --dir DIR [flags]\n\nMeasures the engine's stores and loads on DIR next to ceilings measured in the same run (docs/bench.md).", stderr)
	var o benchOptions
	var (
		cfgPath, tpk, jobs, paths, sums, mix, logLevel, cudaLib, cufileLib string
		fsync                                                              string
	)
	fs.StringVar(&o.dir, "dir", "", "directory to benchmark (required); the benchmark works in a fresh subdirectory and removes it, and DIR where it made it")
	fs.StringVar(&cfgPath, "config", "", "kvhost configuration file: its [engine], [gpu] and [policy] settings are used, and its first mount's io, load_readers, reserve and preallocate")
	fs.IntVar(&o.geometry.Layers, "layers", 32, "model layers")
	fs.IntVar(&o.geometry.KVHeads, "kv-heads", 8, "KV heads (on this rank)")
	fs.IntVar(&o.geometry.HeadSize, "head-size", 128, "elements per head")
	fs.IntVar(&o.geometry.DtypeSize, "dtype-size", 2, "bytes per element")
	fs.IntVar(&o.geometry.TokensPerBlock, "tokens-per-block", 16, "tokens per paged (GPU) block")
	fs.StringVar(&tpk, "tokens-per-key", "256", "tokens per key, a comma list (Llama-3.1-8B bf16: 256 → 32 MiB keys, 16 → 2 MiB)")
	fs.StringVar(&jobs, "jobs", "1,8,16", "concurrent jobs, a comma list")
	fs.StringVar(&paths, "path", "auto", "data paths, a comma list of auto, cufile, staging, posix")
	fs.StringVar(&sums, "checksum", "on", "payload checksums: on, off, or on,off")
	fs.StringVar(&mix, "mix", "write,read", "timed phases: write, read or write,read (a read-only mix stores its keys untimed first)")
	fs.Float64Var(&o.hitRatio, "hit-ratio", 1, "fraction of loaded keys that are stored (the rest are misses)")
	fs.IntVar(&o.keys, "keys", 0, "keys per phase (default: as many as --total holds; at least twice the largest job count times --keys-per-job, else an error)")
	totalStr := fs.String("total", "1GiB", "bytes of keys per phase when --keys is 0")
	preallocate := fs.String("preallocate", "", "bytes of spare files the engine makes ahead of stores on a memory file system, or auto (mount.preallocate; default: the configuration's first mount's, auto unless set: an eighth of the benchmark engine's capacity (what the file system can hold; 1.3 × --total with --full), at most the larger of 4GiB and a sixteenth of memory, growing after a larger burst as the daemon's does; 0: none); with spares the benchmark waits before each timed phase and ceiling until the engine has made them and the GPU path has registered them, as an idle moment would let it; the write ceiling then writes into as many existing files as the round's stores wrote into spares and into fresh files for the rest")
	fs.IntVar(&o.keysPerJob, "keys-per-job", 1, "keys per store or load job")
	keysPerFile := fs.Int("keys-per-file", 0, "keys of a job packed into one file: sets the policy's keys_per_file parameter (0: the configuration's, else the policy's default of 1)")
	fs.StringVar(&o.memory, "memory", "auto", "where the paged cache lives: gpu, host, or auto (gpu when one is found)")
	fs.IntVar(&o.rounds, "rounds", 1, "times each phase runs (figures are over all rounds)")
	fs.IntVar(&o.ceilingPasses, "ceiling-passes", 1, "ceiling passes per round, timed between the round's store and load and summed like the engine's rounds")
	fs.DurationVar(&o.duration, "duration", 0, "repeat each phase until this much time was spent on it (at least --rounds)")
	fs.BoolVar(&o.dropCaches, "drop-caches", false, "cold reads: drop the files' cached pages (and the page cache, as root) before every read")
	fs.BoolVar(&o.verify, "verify", true, "poison destinations before each load and check every loaded byte")
	fs.StringVar(&fsync, "fsync", "", "durable stores (true/false; default: the configuration's engine.fsync)")
	fs.BoolVar(&o.allowCompat, "allow-compat", false, "let cuFile serve mounts in compatibility mode (gpu.cufile = compat)")
	fs.BoolVar(&o.noGap, "no-gap", false, "load each round's keys right after storing them, as a request that follows its own prefill would: no idle moment for the GPU path to register the new files first (the round's ceilings are measured after its load instead of between store and load)")
	fs.BoolVar(&o.restart, "restart", false, "load each round's keys as a restarted daemon would: after the store, close the engine and its GPU movers (pinned buffers, registered files, cuFile handles; the CUDA runtime and the GPU memory stay) and open new ones on the same directory, which rebuild the index from the files and offer those on a memory file system to the new registrar; the load then starts once the registrar has taken them (with --no-gap: as soon as the engine is open)")
	fs.BoolVar(&o.foreign, "foreign", false, "load each round's keys through a second engine, with GPU movers of its own and another node's id, opened on the directory before the round's store: it finds the files on its load, as a daemon loads another process's or node's files right after its lookup (it leaves the first engine's spare files, whose owner runs, as another daemon does)")
	fs.BoolVar(&o.readFirst, "read-first", false, "before each round's load, time a plain read of the very files it loads (pread, --jobs threads, into the ceilings' buffers), in the state the store and the scenario left their pages: the bound a load that copies with the CPU has on them then, which the ceilings' own freshly written files may not share (a diagnostic: the load that follows finds its pages read once, and the GPU path had that much longer to register files)")
	fs.BoolVar(&o.full, "full", false, "a full cache: the mount holds one round of --total bytes, and each round stores new keys that evict the previous round's files instead of deleting them (on a memory file system stores then write into evicted files: engine.reuse_files); needs --rounds 2 or more to measure it")
	fs.BoolVar(&o.warmup, "warmup", true, "store and delete every key once, untimed, before the first measured phase of each key size (where the engine makes spare files ahead, of each key size in each path and checksum setting)")
	fs.BoolVar(&o.keep, "keep", false, "keep the benchmark's files")
	fs.StringVar(&o.jsonOut, "json", "", "write the report as JSON to this file (- for standard output, instead of the table)")
	fs.StringVar(&o.appendTo, "append", "", "add this run's results to the JSON report in this file (same --dir and memory); the table, --json and --svg then show both")
	fs.StringVar(&o.render, "report", "", "run nothing: read this JSON report and print its table (and --json, --svg); --dir is not needed")
	fs.StringVar(&o.svgOut, "svg", "", "write an SVG chart of throughput against concurrency to this file")
	fs.StringVar(&o.progress, "progress", "auto", "progress bar on standard error: auto (on a terminal), on, off")
	fs.StringVar(&logLevel, "log-level", "warn", "log level of the engine and GPU paths")
	fs.StringVar(&cudaLib, "cuda-library", "", "path of libcudart (default: the configuration's, else the usual places)")
	fs.StringVar(&cufileLib, "cufile-library", "", "path of libcufile (default: the configuration's, else the usual places)")
	fs.StringVar(&o.cpuProfile, "cpu-profile", "", "write a CPU profile of the whole run (engine, ceilings and checks; go tool pprof) to this file")
	fs.StringVar(&o.mutexProf, "mutex-profile", "", "write a profile of the time goroutines waited for locks during the whole run (go tool pprof) to this file")
	fs.StringVar(&o.traceOut, "trace", "", "write an execution trace of the whole run (where goroutines ran, waited and made system calls; go tool trace) to this file")
	if code, ok := parseFlagsOnly(fs, args, stdout, stderr); !ok {
		return code
	}
	bad := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "kvhost bench: "+format+"\n", a...)
		return 2
	}
	if o.render != "" {
		f, err := os.Open(o.render)
		if err != nil {
			return bad("--report: %v", err)
		}
		rep, err := bench.ReadJSON(f)
		f.Close()
		if err != nil {
			return bad("--report %s: %v", o.render, err)
		}
		rep.Finish()
		if err := writeBenchOutputs(rep, o, stdout); err != nil {
			fmt.Fprintf(stderr, "kvhost bench: %v\n", err)
			return 1
		}
		return 0
	}
	if o.dir == "" {
		return bad("--dir is required")
	}
	o.cfg = config.Default()
	if cfgPath != "" {
		c, err := config.Load(cfgPath)
		if err != nil {
			return bad("%v", err)
		}
		o.cfg = c
	}
	var err error
	if cudaLib != "" {
		o.cfg.GPU.CUDALibrary = cudaLib
	}
	if cufileLib != "" {
		o.cfg.GPU.CuFileLibrary = cufileLib
	}
	if o.tokensPerKey, err = intList("--tokens-per-key", tpk); err != nil {
		return bad("%v", err)
	}
	if o.jobs, err = intList("--jobs", jobs); err != nil {
		return bad("%v", err)
	}
	for _, p := range strings.Split(paths, ",") {
		switch p = strings.TrimSpace(p); p {
		case "auto", "cufile", "staging", "posix":
			o.paths = append(o.paths, p)
		default:
			return bad("--path %q: want auto, cufile, staging or posix", p)
		}
	}
	for _, s := range strings.Split(sums, ",") {
		switch strings.TrimSpace(s) {
		case "on":
			o.checksums = append(o.checksums, true)
		case "off":
			o.checksums = append(o.checksums, false)
		default:
			return bad("--checksum %q: want on, off or on,off", s)
		}
	}
	for _, m := range strings.Split(mix, ",") {
		switch strings.TrimSpace(m) {
		case "write":
			o.store = true
		case "read":
			o.load = true
		default:
			return bad("--mix %q: want write, read or write,read", m)
		}
	}
	switch {
	case o.hitRatio < 0 || o.hitRatio > 1:
		return bad("--hit-ratio %v: want 0..1", o.hitRatio)
	case o.full && o.keys != 0:
		return bad("--full sizes the cache from --total: leave --keys at 0")
	case o.full && !o.store:
		return bad("--full evicts by storing new keys every round: --mix must include write")
	case o.noGap && !(o.store && o.load):
		return bad("--no-gap loads each round's keys right after storing them: --mix must be write,read")
	case o.restart && !o.load:
		return bad("--restart reopens the engine before each round's load: --mix must include read")
	case o.foreign && !(o.store && o.load):
		return bad("--foreign opens its second engine before each round's store: --mix must be write,read")
	case o.readFirst && !o.load:
		return bad("--read-first reads the files of each round's load: --mix must include read")
	case o.foreign && (o.restart || o.full):
		return bad("--foreign cannot be combined with --restart or --full")
	case o.restart && o.full:
		return bad("--restart and --full cannot be combined: a full cache's rounds evict through one engine")
	case o.keys < 0:
		return bad("--keys %d: want 0 (automatic) or more", o.keys)
	case o.keysPerJob < 1:
		return bad("--keys-per-job %d: want at least 1", o.keysPerJob)
	case *keysPerFile < 0 || *keysPerFile > abi.MaxKeysPerFile:
		return bad("--keys-per-file %d: want 1 to %d (0: the configuration's)", *keysPerFile, abi.MaxKeysPerFile)
	case o.ceilingPasses < 1:
		return bad("--ceiling-passes %d: want at least 1", o.ceilingPasses)
	case o.rounds < 1:
		return bad("--rounds %d: want at least 1", o.rounds)
	case o.memory != "auto" && o.memory != "gpu" && o.memory != "host":
		return bad("--memory %q: want gpu, host or auto", o.memory)
	case o.progress != "auto" && o.progress != "on" && o.progress != "off":
		return bad("--progress %q: want auto, on or off", o.progress)
	}
	if *keysPerFile > 0 {
		params := maps.Clone(o.cfg.Policy.Params)
		if params == nil {
			params = map[string]any{}
		}
		params["keys_per_file"] = int64(*keysPerFile)
		o.cfg.Policy.Params = params
	}
	tot, err := config.ParseSize(*totalStr)
	if err != nil || tot <= 0 {
		return bad("--total %q: want a size such as 1GiB", *totalStr)
	}
	o.total = int64(tot)
	o.preallocate = kvdaemon.EnginePreallocate(config.Auto())
	if len(o.cfg.Mounts) > 0 {
		o.preallocate = kvdaemon.EnginePreallocate(o.cfg.Mounts[0].Preallocate)
	}
	if *preallocate != "" {
		var p config.AutoSize
		if err := p.Set(*preallocate); err != nil {
			return bad("--preallocate %q: want auto or a size such as 4GiB (0: none)", *preallocate)
		}
		o.preallocate = kvdaemon.EnginePreallocate(p)
	}
	o.fsync = o.cfg.Engine.Fsync
	if fsync != "" {
		if o.fsync, err = strconv.ParseBool(fsync); err != nil {
			return bad("--fsync %q: want true or false", fsync)
		}
	}
	log, err := logging.New(stderr, logLevel, "text")
	if err != nil {
		return bad("%v", err)
	}
	o.args = append([]string{"kvhost", "bench"}, args...)
	stopProfile, err := startCPUProfile(o.cpuProfile)
	if err != nil {
		return bad("--cpu-profile: %v", err)
	}
	stopMutex, err := startMutexProfile(o.mutexProf)
	if err != nil {
		stopProfile()
		return bad("--mutex-profile: %v", err)
	}
	stopTrace, err := startTrace(o.traceOut)
	if err != nil {
		stopMutex()
		stopProfile()
		return bad("--trace: %v", err)
	}
	rep, err := runBenchmark(ctx, o, log, stderr)
	if perr := stopTrace(); perr != nil {
		fmt.Fprintf(stderr, "kvhost bench: --trace: %v\n", perr)
	}
	if perr := stopMutex(); perr != nil {
		fmt.Fprintf(stderr, "kvhost bench: --mutex-profile: %v\n", perr)
	}
	if perr := stopProfile(); perr != nil {
		fmt.Fprintf(stderr, "kvhost bench: --cpu-profile: %v\n", perr)
	}
	if err != nil {
		fmt.Fprintf(stderr, "kvhost bench: %v\n", err)
		if rep == nil {
			return 1
		}
	}
	code := 0
	if err != nil {
		code = 1 // a partial report is written, and the exit says so
	}
	if o.appendTo != "" {
		if rep, err = appendReport(o.appendTo, rep); err != nil {
			fmt.Fprintf(stderr, "kvhost bench: --append: %v\n", err)
			return 1
		}
	}
	if err := writeBenchOutputs(rep, o, stdout); err != nil {
		fmt.Fprintf(stderr, "kvhost bench: %v\n", err)
		return 1
	}
	return code
}

// startCPUProfile starts a CPU profile into path (none when path is
// empty); the function it returns stops it and closes the file.
func startCPUProfile(path string) (stop func() error, err error) {
	return startProfile(path, func(f *os.File) error { return pprof.StartCPUProfile(f) }, func(*os.File) error {
		pprof.StopCPUProfile()
		return nil
	})
}

// startMutexProfile has the runtime record every lock wait (none when path
// is empty); the function it returns writes the waits recorded since into
// path and restores the rate the process had.
func startMutexProfile(path string) (stop func() error, err error) {
	var was int
	return startProfile(path, func(*os.File) error {
		was = runtime.SetMutexProfileFraction(1)
		return nil
	}, func(f *os.File) error {
		defer runtime.SetMutexProfileFraction(was)
		return pprof.Lookup("mutex").WriteTo(f, 0)
	})
}

// startTrace starts an execution trace into path (none when path is
// empty); the function it returns stops it and closes the file.
func startTrace(path string) (stop func() error, err error) {
	return startProfile(path, func(f *os.File) error { return trace.Start(f) }, func(*os.File) error {
		trace.Stop()
		return nil
	})
}

// startProfile creates path (nothing when path is empty) and calls begin
// with it; the function it returns calls end with the file and closes it.
func startProfile(path string, begin, end func(*os.File) error) (stop func() error, err error) {
	if path == "" {
		return func() error { return nil }, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := begin(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() error { return errors.Join(end(f), f.Close()) }, nil
}

// writeBenchOutputs prints the table (unless the JSON goes to standard
// output) and writes the JSON and SVG files asked for.
func writeBenchOutputs(rep *bench.Report, o benchOptions, stdout io.Writer) error {
	if o.jsonOut != "-" {
		if err := rep.WriteTable(stdout); err != nil {
			return err
		}
	}
	write := func(name string, fn func(io.Writer) error) error {
		if name == "-" {
			return fn(stdout)
		}
		f, err := os.Create(name)
		if err != nil {
			return err
		}
		if err := fn(f); err != nil {
			f.Close()
			return fmt.Errorf("%s: %w", name, err)
		}
		return f.Close()
	}
	if o.jsonOut != "" {
		if err := write(o.jsonOut, rep.WriteJSON); err != nil {
			return err
		}
	}
	if o.svgOut != "" {
		if err := write(o.svgOut, rep.WriteSVG); err != nil {
			return err
		}
	}
	return nil
}

// appendReport reads the report in name and appends rep's runs to it.
func appendReport(name string, rep *bench.Report) (*bench.Report, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	earlier, err := bench.ReadJSON(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if err := earlier.Append(rep); err != nil {
		return nil, err
	}
	return earlier, nil
}

// intList parses a comma list of positive integers.
func intList(flagName, s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return nil, fmt.Errorf("%s %q: want positive integers separated by commas", flagName, s)
		}
		if !slices.Contains(out, n) {
			out = append(out, n)
		}
	}
	return out, nil
}

// benchDirs makes the benchmark's working directory, a fresh one under
// dir, and dir itself and the directories above it where missing. made
// is those it made, the deepest first: removeMade removes them again
// where they are left empty.
func benchDirs(dir string) (root string, made []string, err error) {
	if err := mkdirAllMade(dir, 0o750, &made); err != nil {
		removeMade(made)
		return "", nil, fmt.Errorf("--dir: %w", err)
	}
	root, err = os.MkdirTemp(dir, "kvhost-bench-")
	if err != nil {
		removeMade(made)
		return "", nil, fmt.Errorf("--dir: %w", err)
	}
	return root, made, nil
}

// mkdirAllMade is os.MkdirAll(path, perm), its directories walked as it
// walks them (path's parents by its text, ".." included, each made
// before the one below it), that prepends to made each directory its own
// mkdir made: never one that another process made first, nor one a
// cleaned path names in place of what the kernel resolved (a/b/../c,
// a/b missing, makes a/b and a/c, and names a/b).
func mkdirAllMade(path string, perm os.FileMode, made *[]string) error {
	if fi, err := os.Stat(path); err == nil {
		if fi.IsDir() {
			return nil
		}
		return &os.PathError{Op: "mkdir", Path: path, Err: syscall.ENOTDIR}
	}
	// The parent as os.MkdirAll takes it: path less its last component
	// and trailing separators, not cleaned.
	i := len(path)
	for i > 0 && os.IsPathSeparator(path[i-1]) {
		i--
	}
	j := i
	for j > 0 && !os.IsPathSeparator(path[j-1]) {
		j--
	}
	if j > 1 {
		if err := mkdirAllMade(path[:j-1], perm, made); err != nil {
			return err
		}
	}
	err := os.Mkdir(path, perm)
	if err == nil {
		*made = append([]string{path}, *made...)
		return nil
	}
	// Made meanwhile by another, or "..": a directory there will do.
	if fi, lerr := os.Lstat(path); lerr == nil && fi.IsDir() {
		return nil
	}
	return err
}

// removeMade removes the directories benchDirs made, the deepest first,
// each only if it is an empty directory (rmdir(2), which refuses one that
// is not, and any file or symbolic link, where os.Remove would unlink
// one put at the name since): a benchmark leaves behind no directory of
// its own but what --keep keeps, and removes nothing else.
func removeMade(made []string) {
	for _, d := range made {
		if syscall.Rmdir(d) != nil {
			return
		}
	}
}

// absDir is dir made absolute for the report.
func absDir(dir string) string {
	if a, err := filepath.Abs(dir); err == nil {
		return a
	}
	return dir
}
