package policy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tetratelabs/wazero"
	"github.com/tetratelabs/wazero/api"
	"github.com/tetratelabs/wazero/imports/wasi_snapshot_preview1"
	"github.com/tetratelabs/wazero/sys"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy/internal/meter"
)

// Limits on what a plugin may log through kvhost.log.
const (
	maxLogMessage   = 1024 // bytes; longer messages are truncated
	maxLogPerSecond = 100  // messages; more are dropped and counted
)

// exportInitialize is the reactor initialisation function of WASI modules
// (Go's -buildmode=c-shared, C's -mexec-model=reactor); it runs before any
// hook when exported.
const exportInitialize = "_initialize"

// wasmBackend is one compiled plugin in its own wazero Runtime.
type wasmBackend struct {
	name       string
	cfg        *Config
	log        *slog.Logger
	r          wazero.Runtime
	cm         wazero.CompiledModule
	ownCache   wazero.CompilationCache // closed with the backend
	limitPages uint32
	feats      abi.Feature
	logs       logLimiter
	instances  sync.Map // api.Module → *wasmInstance, for hostLog
	// slow counts calls that finished within their fuel but after their
	// wall-clock deadline: the machine was slow (preemption, GC), not the
	// plugin, so they are not failures. It points into the Host's
	// counters once a Host runs the backend, so that the count outlives
	// the backend (a close at reload, a switch to the fallback).
	slow *atomic.Uint64

	mu     sync.Mutex
	spares []*wasmInstance // made ahead (the instance probed at load, prepare's), used by the next shards built
}

// newWasmBackend meters module (host/policy/internal/meter), compiles it,
// validates it against ABI v1 and creates a first instance to check its
// version, features and scratch area (probe).
func newWasmBackend(ctx context.Context, module []byte, name string, cfg *Config) (_ *wasmBackend, err error) {
	if name == "" {
		return nil, fmt.Errorf("%w: empty plugin name", ErrConfig)
	}
	// The metered module is a deterministic function of module, so the
	// compilation cache's key for it is as stable as for module itself.
	code, err := meter.Instrument(module)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrModule, name, err)
	}
	b := &wasmBackend{name: name, cfg: cfg, log: cfg.Logger.With("policy", name), limitPages: uint32(cfg.MemoryLimit / wasmPage), slow: new(atomic.Uint64)}
	cache := cfg.Cache
	if cache == nil && cfg.CacheDir != "" {
		if cache, err = wazero.NewCompilationCacheWithDir(cfg.CacheDir); err != nil {
			return nil, fmt.Errorf("%w: CacheDir %q: %v", ErrConfig, cfg.CacheDir, err)
		}
		b.ownCache = cache
	}
	b.r = b.newRuntime(ctx, cache)
	defer func() {
		if err != nil {
			_ = b.close(ctx)
		}
	}()
	if b.cm, err = b.r.CompileModule(ctx, code); err != nil && cache != nil && cacheFault(err) {
		// The cache failed, not the module (a file damaged on disk, a
		// directory that cannot be written).
		_ = b.r.Close(ctx)
		b.r = nil
		if b.ownCache != nil {
			rerr := b.repairCache(ctx, code)
			if rerr == nil {
				b.log.Warn("policy: the compilation cache failed; rewrote this module's entry", "cache_dir", cfg.CacheDir, "err", err)
				b.r = b.newRuntime(ctx, b.ownCache)
				if b.cm, err = b.r.CompileModule(ctx, code); err != nil && cacheFault(err) {
					_ = b.r.Close(ctx)
					b.r = nil
				}
			} else {
				err = errors.Join(err, rerr)
			}
		}
		if b.r == nil {
			// No repair, or the repaired cache failed again: compile
			// without it.
			b.log.Warn("policy: the compilation cache failed; compiling the module without it (remove the cache directory to rebuild it)",
				"cache_dir", cfg.CacheDir, "err", err)
			b.r = b.newRuntime(ctx, nil)
			b.cm, err = b.r.CompileModule(ctx, code)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrModule, name, err)
	}
	info := describe(b.cm, len(module))
	if len(info.Problems) > 0 {
		return nil, fmt.Errorf("%w: %s: %s", ErrModule, name, strings.Join(info.Problems, "; "))
	}
	if err := instantiateHostModules(ctx, b.r, b.hostLog); err != nil {
		return nil, err
	}
	probe, err := b.probe(ctx, &info)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrModule, name, err)
	}
	if len(info.Problems) > 0 {
		return nil, fmt.Errorf("%w: %s: %s", ErrModule, name, strings.Join(info.Problems, "; "))
	}
	b.feats, b.spares = info.Features, []*wasmInstance{probe}
	return b, nil
}

// probe creates an instance of b's module and checks what Open requires
// of it before any hook with records runs, adding what falls short to
// info.Problems: kvhost_abi_version and kvhost_features (info's version
// and features, checked by checkIdentity), then kvhost_scratch, asked for
// the scratch area when the module exports it and speaks ABI v1. Open and
// Inspect share it, so that Inspect lists every problem that stops Open.
// It returns the instance, its scratch area reserved, when info has no
// problems, and an error only when the module cannot be instantiated.
func (b *wasmBackend) probe(ctx context.Context, info *Info) (*wasmInstance, error) {
	in, err := b.instantiate(ctx)
	if err != nil {
		return nil, err
	}
	if version, feats, err := in.identify(ctx); err != nil {
		info.Problems = append(info.Problems, err.Error())
	} else {
		info.ABIVersion, info.VersionKnown, info.Features = version, true, feats
		info.checkIdentity()
		if version == abi.Version && slices.Contains(info.Hooks, abi.ExportScratch) {
			if err := in.reserve(ctx); err != nil {
				info.Problems = append(info.Problems, err.Error())
			}
		}
	}
	if len(info.Problems) > 0 {
		in.close(ctx)
		return nil, nil
	}
	return in, nil
}

// repairCache rewrites code's entry in the compilation cache of
// b.cfg.CacheDir, which failed to give it back: it compiles code into a
// new cache in a temporary directory inside CacheDir, whose files then
// replace theirs under CacheDir by rename (an entry's name depends on the
// module, the machine and wazero's version only, so the entry written is
// the damaged one's), and removes the temporary directory. It touches no
// other module's entry, and another daemon sharing the directory reads
// either the old file or the new one. b.ownCache is replaced by a new
// cache on the directory, the old one closed.
func (b *wasmBackend) repairCache(ctx context.Context, code []byte) error {
	dir := b.cfg.CacheDir
	tmp, err := os.MkdirTemp(dir, ".repair-")
	if err != nil {
		return fmt.Errorf("policy: repairing the compilation cache: %w", err)
	}
	defer os.RemoveAll(tmp)
	fresh, err := wazero.NewCompilationCacheWithDir(tmp)
	if err != nil {
		return fmt.Errorf("policy: repairing the compilation cache: %w", err)
	}
	r := b.newRuntime(ctx, fresh)
	_, err = r.CompileModule(ctx, code)
	err = errors.Join(err, r.Close(ctx), fresh.Close(ctx))
	if err != nil {
		return fmt.Errorf("policy: repairing the compilation cache: %w", err)
	}
	moved := 0
	err = filepath.WalkDir(tmp, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || strings.HasSuffix(p, ".tmp") {
			return err
		}
		rel, err := filepath.Rel(tmp, p)
		if err != nil {
			return err
		}
		to := filepath.Join(dir, rel)
		if err := os.MkdirAll(filepath.Dir(to), 0o750); err != nil {
			return err
		}
		moved++
		return os.Rename(p, to)
	})
	if err == nil && moved == 0 {
		err = errors.New("the new cache holds no entry")
	}
	if err != nil {
		return fmt.Errorf("policy: repairing the compilation cache: %w", err)
	}
	cache, err := wazero.NewCompilationCacheWithDir(dir)
	if err != nil {
		return fmt.Errorf("policy: repairing the compilation cache: %w", err)
	}
	_ = b.ownCache.Close(ctx)
	b.ownCache = cache
	return nil
}

// newRuntime returns a runtime for b's module, compiling through cache
// unless it is nil. No WithCloseOnContextDone: a call is bounded by its
// fuel (see wasmInstance.callFn), not by interruption checks.
func (b *wasmBackend) newRuntime(ctx context.Context, cache wazero.CompilationCache) wazero.Runtime {
	rc := wazero.NewRuntimeConfig().WithMemoryLimitPages(b.limitPages)
	if cache != nil {
		rc = rc.WithCompilationCache(cache)
	}
	return wazero.NewRuntimeWithConfig(ctx, rc)
}

// cacheFault reports whether err, from compiling a module through a
// compilation cache, is the cache's failure rather than the module's:
// wazero returns a cache file it cannot read back (a flipped bit, a file
// cut short by a crash) as an error starting "compilationcache:", and one
// it cannot open or write (permissions, a full disk) as the file system's
// error. Decoding, validating and compiling a module touch no file.
func cacheFault(err error) bool {
	var pathErr *fs.PathError
	var linkErr *os.LinkError
	return strings.Contains(err.Error(), "compilationcache:") || errors.As(err, &pathErr) || errors.As(err, &linkErr)
}

// instantiateHostModules provides the imports a plugin may have: kvhost.log
// (registered without reflection) and WASI preview 1, which wazero gives no
// preopened directories, arguments, environment or real clocks unless asked.
// Every one of them spends the caller's fuel (metered).
func instantiateHostModules(ctx context.Context, r wazero.Runtime, logFn api.GoModuleFunc) error {
	i32 := api.ValueTypeI32
	params := []string{"level", "ptr", "len"}
	if _, err := r.NewHostModuleBuilder(abi.ImportModule).
		NewFunctionBuilder().
		WithGoModuleFunction(metered(abi.ImportModule+"."+abi.ImportLog, params, logFn), []api.ValueType{i32, i32, i32}, nil).
		WithParameterNames(params...).
		Export(abi.ImportLog).
		Instantiate(ctx); err != nil {
		return fmt.Errorf("policy: host module %s: %w", abi.ImportModule, err)
	}
	if err := instantiateWASI(ctx, r); err != nil {
		return fmt.Errorf("policy: host module %s: %w", wasi_snapshot_preview1.ModuleName, err)
	}
	return nil
}

func (b *wasmBackend) kind() string          { return "wasm" }
func (b *wasmBackend) features() abi.Feature { return b.feats }

func (b *wasmBackend) close(ctx context.Context) error {
	b.mu.Lock()
	for _, in := range b.spares {
		in.close(ctx)
	}
	b.spares = nil
	b.mu.Unlock()
	var err error
	if b.r != nil {
		err = b.r.Close(ctx)
	}
	if b.ownCache != nil {
		err = errors.Join(err, b.ownCache.Close(ctx))
	}
	return err
}

// instantiate creates an instance and runs its _initialize.
func (b *wasmBackend) instantiate(ctx context.Context) (*wasmInstance, error) {
	in := &wasmInstance{b: b, stderr: &tailWriter{}}
	mc := wazero.NewModuleConfig().
		WithName(""). // anonymous: any number of instances
		WithStartFunctions().
		WithStdout(io.Discard).
		WithStderr(in.stderr)
	mod, err := b.r.InstantiateModule(ctx, b.cm, mc)
	if err != nil {
		return nil, fmt.Errorf("instantiate: %w", err)
	}
	in.mod, in.mem = mod, mod.Memory()
	b.instances.Store(mod, in)
	fuel, ok := mod.ExportedGlobal(meter.ExportName).(api.MutableGlobal)
	if !ok {
		_ = mod.Close(ctx)
		return nil, fmt.Errorf("no mutable global %s: the module was not metered", meter.ExportName)
	}
	in.fuel = fuel
	for h := range numHooks {
		in.fns[h] = mod.ExportedFunction(h.String())
	}
	if f := mod.ExportedFunction(exportInitialize); f != nil {
		if _, err := in.callFn(ctx, f, 0, max(b.cfg.CallTimeout, time.Second)); err != nil {
			in.close(ctx)
			return nil, fmt.Errorf("%s: %w", exportInitialize, err)
		}
	}
	return in, nil
}

func (b *wasmBackend) newInstance(ctx context.Context, shard int) (instance, error) {
	b.mu.Lock()
	var in *wasmInstance
	if n := len(b.spares); n > 0 {
		in, b.spares = b.spares[n-1], b.spares[:n-1]
	}
	b.mu.Unlock()
	if in != nil {
		return in, nil
	}
	return b.checked(ctx)
}

// checked makes an instance and checks it as the probe was: the same
// version and features, a valid scratch area.
func (b *wasmBackend) checked(ctx context.Context) (*wasmInstance, error) {
	in, err := b.instantiate(ctx)
	if err != nil {
		return nil, err
	}
	version, feats, err := in.identify(ctx)
	if err == nil && (version != abi.Version || feats != b.feats) {
		err = fmt.Errorf("ABI version %d and features %s differ from the first instance's (%d, %s)", version, feats, abi.Version, b.feats)
	}
	if err == nil {
		err = in.reserve(ctx)
	}
	if err != nil {
		in.close(ctx)
		return nil, err
	}
	return in, nil
}

// prepare makes spare instances, in parallel, until n are ready for the
// shards built next: a Host that switches to b builds its shards under
// its lock, where a Go guest's _initialize would hold every call up.
func (b *wasmBackend) prepare(ctx context.Context, n int) error {
	b.mu.Lock()
	missing := n - len(b.spares)
	b.mu.Unlock()
	made := make([]*wasmInstance, max(missing, 0))
	errs := make([]error, len(made))
	var wg sync.WaitGroup
	for i := range made {
		wg.Go(func() { made[i], errs[i] = b.checked(ctx) })
	}
	wg.Wait()
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, in := range made {
		if in != nil {
			b.spares = append(b.spares, in)
		}
	}
	return errors.Join(errs...)
}

// hostLog implements kvhost.log(level, ptr, len).
func (b *wasmBackend) hostLog(ctx context.Context, mod api.Module, stack []uint64) {
	level := slog.Level(api.DecodeI32(stack[0]))
	ptr, n := api.DecodeU32(stack[1]), api.DecodeU32(stack[2])
	if !b.logs.allow(b.log) {
		return
	}
	msg, ok := mod.Memory().Read(ptr, min(n, maxLogMessage))
	if !ok {
		b.log.Warn("plugin log message outside its memory", "ptr", ptr, "len", n)
		return
	}
	b.log.Log(ctx, level, string(msg), "source", "plugin")
	if level >= slog.LevelWarn {
		if in, ok := b.instances.Load(mod); ok {
			in.(*wasmInstance).last.Store(string(msg))
		}
	}
}

// logLimiter drops plugin log messages beyond maxLogPerSecond.
type logLimiter struct {
	mu      sync.Mutex
	start   time.Time
	n       int
	dropped int
}

func (l *logLimiter) allow(log *slog.Logger) bool {
	now := time.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	if now.Sub(l.start) >= time.Second {
		if l.dropped > 0 {
			log.Warn("plugin log messages dropped", "dropped", l.dropped, "limit_per_second", maxLogPerSecond)
		}
		l.start, l.n, l.dropped = now, 0, 0
	}
	l.n++
	if l.n > maxLogPerSecond {
		l.dropped++
		return false
	}
	return true
}

// wasmInstance is one instance of a plugin module.
type wasmInstance struct {
	b      *wasmBackend
	mod    api.Module
	mem    api.Memory
	fns    [numHooks]api.Function
	fuel   api.MutableGlobal // the meter's fuel (host/policy/internal/meter)
	stack  [1]uint64         // parameters and results of every hook: at most one each
	ptr    uint32            // the scratch area
	stderr *tailWriter
	last   atomic.Value // string: the last warning or error the plugin logged
}

func (in *wasmInstance) lastMessage() string {
	m, _ := in.last.Swap("").(string)
	return m
}

// identify calls kvhost_abi_version and kvhost_features.
func (in *wasmInstance) identify(ctx context.Context) (version int32, feats abi.Feature, err error) {
	f := in.mod.ExportedFunction(abi.ExportABIVersion)
	if _, err = in.callFn(ctx, f, 0, in.b.cfg.CallTimeout); err != nil {
		return 0, 0, fmt.Errorf("%s: %w", abi.ExportABIVersion, err)
	}
	version = api.DecodeI32(in.stack[0])
	f = in.mod.ExportedFunction(abi.ExportFeatures)
	if _, err = in.callFn(ctx, f, 0, in.b.cfg.CallTimeout); err != nil {
		return 0, 0, fmt.Errorf("%s: %w", abi.ExportFeatures, err)
	}
	return version, abi.Feature(in.stack[0]), nil
}

// reserve asks the plugin for its scratch area and checks it.
func (in *wasmInstance) reserve(ctx context.Context) error {
	f := in.mod.ExportedFunction(abi.ExportScratch)
	ptr, err := in.callFn(ctx, f, scratchSize, in.b.cfg.CallTimeout)
	if err != nil {
		return fmt.Errorf("%s(%d): %w", abi.ExportScratch, scratchSize, err)
	}
	p := uint32(ptr)
	size := in.mem.Size()
	switch {
	case p == 0:
		return fmt.Errorf("%s(%d) returned 0: the plugin has no scratch area", abi.ExportScratch, scratchSize)
	case p%abi.ScratchAlign != 0:
		return fmt.Errorf("%s(%d) returned %#x, not aligned to %d bytes", abi.ExportScratch, scratchSize, p, abi.ScratchAlign)
	case uint64(p)+scratchSize > uint64(size):
		return fmt.Errorf("%s(%d) returned %#x: the area ends past the memory's %d bytes", abi.ExportScratch, scratchSize, p, size)
	}
	in.ptr = p
	return nil
}

func (in *wasmInstance) scratch() []byte {
	b, _ := in.mem.Read(in.ptr, scratchSize) // memory never shrinks: reserve checked the bounds
	return b
}

func (in *wasmInstance) call(ctx context.Context, h hook, arg int32) (int32, error) {
	f := in.fns[h]
	if f == nil {
		return 0, fmt.Errorf("%s is not exported", h)
	}
	return in.callFn(ctx, f, arg, in.b.cfg.CallTimeout)
}

// fuelPerNanosecond is the fuel a call gets per nanosecond of its deadline.
// One unit of fuel is one wasm instruction that does work (moves between
// locals and constants are free; host/policy/internal/meter). On the 2-core
// CI machine the built-in lru plugin spends 2.7 to 3.8 units per nanosecond
// (BenchmarkFuelRate) and an endless `loop br 0 end` about 1
// (BenchmarkRunaway): a runaway loop stops after about twice its deadline,
// and code that would finish within its deadline is not stopped before
// about 0.45 of it (docs/policy-host.md).
const fuelPerNanosecond = 2

// fuelFor returns the fuel of a call with deadline timeout.
func fuelFor(timeout time.Duration) int64 {
	return min(timeout.Nanoseconds(), math.MaxInt64/fuelPerNanosecond) * fuelPerNanosecond
}

// callFn calls f with at most one i32 argument under a deadline: the call
// gets the fuel of timeout, which stops it if it runs on; a call that
// returns within its fuel but after timeout is counted as slow. A caller's context cancelled before the
// call stops it; one cancelled during the call does not cut it short.
func (in *wasmInstance) callFn(ctx context.Context, f api.Function, arg int32, timeout time.Duration) (int32, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	in.stack[0] = api.EncodeI32(arg)
	in.fuel.Set(uint64(fuelFor(timeout)))
	start := time.Now()
	err := f.CallWithStack(ctx, in.stack[:])
	took := time.Since(start)
	if err != nil {
		return 0, in.diagnose(err, timeout)
	}
	if took > timeout {
		// The fuel bounds what the plugin can do deterministically; a call
		// that stayed within it but returned late was held up by the
		// machine. Count it, don't fail the plugin for it.
		if in.b.slow.Add(1) == 1 || took > 10*timeout {
			in.b.log.Warn("policy call finished within its fuel but after its deadline (the machine is slow or overloaded)",
				"took", took.Round(time.Microsecond).String(), "deadline", timeout.String())
		}
	}
	return api.DecodeI32(in.stack[0]), nil
}

// diagnose turns the error of a call into the reason the instance failed.
func (in *wasmInstance) diagnose(err error, timeout time.Duration) error {
	var reason error
	var exit *sys.ExitError
	switch {
	case int64(in.fuel.Get()) < 0:
		reason = fmt.Errorf("ran out of fuel: exceeded the call deadline of %v, counted in instructions (%d units of fuel)", timeout, fuelFor(timeout))
	case errors.As(err, &exit):
		reason = fmt.Errorf("exited with code %d", exit.ExitCode())
	default:
		msg, _, _ := strings.Cut(err.Error(), "\n") // drop wazero's stack trace
		reason = errors.New(msg)
	}
	// A grow past the limit fails without a trace; a failure with memory
	// within one eighth of the limit is most likely its consequence.
	if size := uint64(in.mem.Size()); size*8 >= uint64(in.b.cfg.MemoryLimit)*7 {
		reason = fmt.Errorf("memory near its limit (%s of %s in use): %w",
			mib(size), mib(uint64(in.b.cfg.MemoryLimit)), reason)
	}
	if tail := in.stderr.last(); tail != "" {
		reason = fmt.Errorf("%w (stderr: %s)", reason, tail)
	}
	return reason
}

func (in *wasmInstance) close(ctx context.Context) {
	in.b.instances.Delete(in.mod)
	_ = in.mod.Close(ctx)
}

// tailWriter keeps the end of what a plugin writes to stderr, to explain
// its failures.
type tailWriter struct {
	mu  sync.Mutex
	buf []byte // at most tailSize bytes
}

const tailSize = 512

// Write keeps the last tailSize bytes of what was written. It copies no
// more than that of p: a plugin may write its whole memory, once per
// iovec, and the host must neither copy nor keep as much.
func (w *tailWriter) Write(p []byte) (int, error) {
	n := len(p)
	if n > tailSize {
		p = p[n-tailSize:]
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if keep := tailSize - len(p); len(w.buf) > keep {
		w.buf = append(w.buf[:0], w.buf[len(w.buf)-keep:]...)
	}
	w.buf = append(w.buf, p...)
	return n, nil
}

// last returns the last non-empty lines written, joined, at most 200 bytes.
func (w *tailWriter) last() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	s := strings.TrimSpace(string(w.buf))
	if len(s) > 200 {
		s = "..." + s[len(s)-200:]
	}
	return strings.ReplaceAll(s, "\n", " | ")
}

// mib formats a byte count in MiB.
func mib(n uint64) string { return strconv.FormatFloat(float64(n)/(1<<20), 'f', -1, 64) + " MiB" }
