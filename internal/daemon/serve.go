package daemon

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/internal/daemon/hostpath"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/logging"
	"github.com/kvhost/kvhost/internal/metrics"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/protocol"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// Options are what Run needs from the command line, and the seams tests
// replace (their zero values are the daemon's own).
type Options struct {
	// Flags are the parsed command-line flags: their Load is the
	// configuration, at the start and at each reload (SIGHUP).
	Flags *config.Flags
	// Name is the daemon's name and version in the handshake and the
	// metrics (kvhost's version string).
	Name string
	// Stdout gets the readiness line; Stderr the log and the stack dumps.
	Stdout, Stderr io.Writer
	// FS is the engine's file system (nil: the operating system's; tests
	// hold or fail operations in it).
	FS fsys.FS
	// Now is the clock the stop signals are timed by (nil: time.Now).
	Now func() time.Time
	// Term delivers the stop signals (nil: SIGTERM and SIGINT, which
	// Run subscribes to; tests send their own).
	Term <-chan os.Signal
}

// ErrForcedExit is Run's error where a second SIGTERM or SIGINT ended the
// daemon at once, whatever was still in flight (logged with
// MsgForcedExit); the process should exit with status 1 without more.
var ErrForcedExit = errors.New("kvhost exited at a second stop signal")

// ErrConfig marks Run's errors of a configuration refused before the
// daemon starts (a file that does not parse, a bad log.level or
// log.format): errors.Is(err, ErrConfig) says so, and err's text is the
// refusal, naming its file and line or its flag. Refusals found later
// are *config.KeyError.
var ErrConfig = errors.New("configuration error")

// configError is an error of the configuration that Run returns
// (ErrConfig).
type configError struct{ err error }

func (e configError) Error() string        { return e.err.Error() }
func (e configError) Unwrap() error        { return e.err }
func (e configError) Is(target error) bool { return target == ErrConfig }

// Run runs the daemon until ctx is done or a stop signal comes, then
// shuts it down gracefully: stop accepting, let jobs finish within
// server.shutdown_timeout, cancel the rest, close the engine, remove the
// socket. A second SIGTERM or SIGINT, repeatedStop or more after the
// first, returns ErrForcedExit at once, whatever is still in flight.
// SIGHUP reloads the configuration; SIGQUIT, from start-up to exit,
// writes every goroutine's stack to the log and goes on; SIGUSR1, SIGUSR2
// and SIGPIPE are ignored (docs/serve.md, "Signals"). A stop during
// start-up is a stop as asked for: nil.
func Run(ctx context.Context, o Options) error {
	term := o.Term
	if term == nil {
		// SIGTERM and SIGINT here as well as in the caller's context,
		// which ends at the first: the second ends the daemon at once.
		c := make(chan os.Signal, 2)
		signal.Notify(c, os.Interrupt, syscall.SIGTERM)
		defer signal.Stop(c)
		term = c
	}
	// Signals first: a SIGHUP during start-up (a long index rebuild) is a
	// reload once the daemon serves, not the end of the process.
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGHUP, syscall.SIGUSR1, syscall.SIGUSR2, syscall.SIGPIPE)
	defer signal.Stop(sigs)
	// SIGQUIT apart, served until the end: a start or a close that is
	// stuck is when a stack dump is wanted most.
	quit := make(chan os.Signal, 1)
	signal.Notify(quit, syscall.SIGQUIT)
	defer signal.Stop(quit)

	cfg, err := o.Flags.Load()
	if err != nil {
		return configError{err}
	}
	d := &daemon{flags: o.Flags, name: o.Name, stdout: o.Stdout, stderr: o.Stderr, sigs: sigs, started: time.Now(), fs: o.FS}
	lvl, err := logging.ParseLevel(cfg.Log.Level)
	if err != nil {
		return configError{err}
	}
	d.level.Set(lvl)
	if d.log, err = logging.NewLeveled(o.Stderr, &d.level, cfg.Log.Format); err != nil {
		return configError{err}
	}
	defer d.dumpStacks(quit)()
	// The daemon runs in a goroutine of its own so that a second SIGTERM
	// or SIGINT can end the process while its drain waits on work hung in
	// a mount (docs/serve.md, "Signals").
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	served := make(chan error, 1)
	go func() { served <- d.serve(sctx, cfg) }()
	err = nil
	now := o.Now
	if now == nil {
		now = time.Now
	}
	var stoppedAt time.Time
	for stopping := false; ; {
		var sig os.Signal
		select {
		case err = <-served:
		case sig = <-term:
		}
		if sig == nil {
			break
		}
		if !stopping {
			stopping, stoppedAt = true, now()
			d.log.Info(MsgStopping, "signal", sig.String())
			stop() // the caller's context ends at this signal too
			continue
		}
		if now().Sub(stoppedAt) < repeatedStop {
			d.log.Info(MsgRepeatedStop, "signal", sig.String(), "within", repeatedStop.String())
			continue
		}
		d.forcedExit(sig)
		return ErrForcedExit
	}
	if err != nil && sctx.Err() != nil && errors.Is(err, sctx.Err()) {
		// SIGTERM during start-up (an index rebuild, a policy's
		// compilation) is a stop as asked for, not a failure.
		d.log.Info("kvhost stopped during start-up", "reason", err)
		return nil
	}
	return err
}

// repeatedStop is how soon after the first stop signal another one is
// taken as the same request, not as the second that exits at once:
// `timeout`, and other wrappers that signal their child and then its
// process group, deliver SIGTERM twice within microseconds, and a
// person pressing Ctrl-C again does so later than this.
const repeatedStop = 250 * time.Millisecond

// forcedExit logs, at a second SIGTERM or SIGINT, that the daemon exits
// without waiting for what is still in flight, and what that is: its
// caller returns at once, and the process exits. That is safe where
// unmapping a client's memory under a copy still running is not: the
// process's end takes its mappings and its threads together, the node
// lock goes with it, and the next start replaces the socket and removes
// the temporary files of the stores cut short (no half-written file is
// ever visible under a key's name).
func (d *daemon) forcedExit(sig os.Signal) {
	attrs := []any{"signal", sig.String()}
	d.mu.Lock()
	eng := d.eng
	d.mu.Unlock()
	if eng != nil {
		now := time.Now()
		a := eng.Activity()
		attrs = append(attrs, "jobs_in_flight", a.Jobs)
		if !a.Oldest.IsZero() {
			attrs = append(attrs, "oldest_job_age", now.Sub(a.Oldest).Round(time.Millisecond).String())
		}
		if !a.OldestIO.IsZero() {
			attrs = append(attrs, "oldest_file_operation_age", now.Sub(a.OldestIO).Round(time.Millisecond).String())
		}
	}
	d.log.Error(MsgForcedExit, attrs...)
}

// The log lines of the stop signals (tests wait for them).
const (
	MsgStopping     = "stopping: draining; a second SIGTERM or SIGINT exits at once without waiting for the work in flight"
	MsgRepeatedStop = "stopping: a stop signal this soon after the first is the same request (a wrapper such as timeout signals twice); send another later to exit at once"
	MsgForcedExit   = "kvhost exits at a second signal without waiting for the work in flight (a file operation hung on a mount holds it); the next start removes the temporary files left"
)

// daemon is a running kvhost serve (Run).
type daemon struct {
	flags   *config.Flags
	name    string // Options.Name
	stdout  io.Writer
	stderr  io.Writer
	sigs    <-chan os.Signal
	started time.Time
	level   slog.LevelVar
	log     *slog.Logger
	metrics *metrics.Metrics // nil without [metrics] listen
	fs      fsys.FS          // the engine's file system; nil: the operating system's
	eng     *engine.Engine
	pol     PolicyState

	readyMu  sync.Mutex // held while readiness changes and systemd is told
	stopping bool       // set once the daemon stops: nothing makes it ready again

	mu             sync.Mutex
	running        config.Config // what runs: the start configuration with live changes applied
	chains         []mountChain  // GPU data paths built, for their fallback counts
	reloads        uint64
	reloadFailures uint64
	lastReload     string
}

// buildPolicy is Build for this daemon: its log, its metrics'
// policy calls, and errors placed at the key or flag that gave the value.
func (d *daemon) buildPolicy(ctx context.Context, cfg config.Config) (*Policy, error) {
	o := BuildOptions{Log: d.log, Locate: d.flags.Locate}
	if d.metrics != nil {
		o.OnCall = d.metrics.ObservePolicyCall
	}
	return Build(ctx, cfg, o)
}

// nodeLockFile is the engine's node lock (engine.Config.LockFile) of a
// daemon of cfg: beside its socket.
func nodeLockFile(cfg config.Config) string { return cfg.Server.Socket + ".lock" }

func (d *daemon) serve(ctx context.Context, cfg config.Config) error {
	d.running = cfg
	log := d.log
	// The socket's directories before any other: the engine's lock and
	// the lookup table go next to the socket, and the policy's
	// compilation cache and the mounts may lie beside it (the default
	// layout puts all under one directory); a directory made for one of
	// them would not be given to socket_group.
	// It also checks that the daemon's user may give files to
	// socket_group: the lookup table and the socket, given to it later,
	// come after the engine's start (an index rebuild, which may be long).
	if _, err := server.PrepareSocketDir(cfg.Server.Socket, cfg.Server.SocketGroup); err != nil {
		return d.groupFault(err)
	}
	if cfg.Metrics.Listen != "" {
		// A second daemon of this configuration would find the port
		// taken before the engine's lock: tell it why.
		if err := engine.ProbeNodeLock(nodeLockFile(cfg)); err != nil {
			return err
		}
		stop, err := d.serveMetrics(cfg.Metrics.Listen, cfg.Metrics.Profiling)
		if err != nil {
			return err
		}
		defer stop()
	}
	// SIGTERM, from start-up to the end: /readyz 503 and STOPPING=1. A
	// signal that ends the start-up can find the watcher not yet run when
	// serve returns, and its select then free to take either case: the
	// return says it once more after the watcher ended (setReady says it
	// once), so that systemd hears STOPPING=1 before the process exits.
	stopped, watched := make(chan struct{}), make(chan struct{})
	defer func() {
		close(stopped)
		<-watched
		if ctx.Err() != nil {
			d.setReady(ctx, false)
		}
	}()
	go func() {
		defer close(watched)
		select {
		case <-ctx.Done():
			d.setReady(ctx, false)
		case <-stopped:
		}
	}()
	build, err := d.buildPolicy(ctx, cfg)
	if err != nil {
		return err
	}
	// The Go processors after the policy: a policy refused at start is
	// then the one line the start prints, not the second.
	workers, restoreProcs := reserveControlProcessors(cfg.Engine.IOWorkers, log)
	defer restoreProcs()
	statfs := fsys.OS{}.Statfs
	if d.fs != nil {
		statfs = d.fs.Statfs // the engine's (tests hold it)
	}
	mounts, err := EngineMounts(ctx, cfg, statfs)
	if err != nil {
		return err
	}
	if cfg.GPU.Lanes != 0 {
		log.Warn("gpu.lanes is no longer used: each job of the staging pipeline drives its own CUDA stream; remove it (gpu.depth and gpu.chunk tune the pipeline)", "lanes", cfg.GPU.Lanes)
	}
	gp, err := OpenGPU(GPUOptionsOf(cfg), log)
	if err != nil {
		return err
	}
	closeGPU := func() error { return nil }
	var movers map[region.Kind]engine.MoverFactory
	if gp != nil {
		closeGPU = gp.Close
		movers = d.trackChains(gp.Movers())
	}
	objs, err := OpenObjects(ctx, cfg.Objects, log)
	if err != nil {
		return errors.Join(err, closeGPU())
	}
	if objs != nil {
		gpuClose := closeGPU
		closeGPU = func() error { return errors.Join(objs.Close(), gpuClose()) }
	}
	ecfg := engine.Config{
		Mounts:         mounts,
		NewPolicy:      build.New,
		Fsync:          cfg.Engine.Fsync,
		IOWorkers:      workers,
		YieldBytes:     int64(cfg.Engine.YieldBytes),
		CPUs:           cfg.Engine.CPUs,
		StagingBytes:   int64(cfg.Engine.StagingMemory),
		VerifyInterval: time.Duration(cfg.Engine.VerifyInterval),
		TempGrace:      time.Duration(cfg.Engine.TempGrace),
		RestartHold:    time.Duration(cfg.Engine.RestartHold),
		NodeID:         cfg.Engine.NodeID,
		// The plugin's file name, not its path: nodes may keep one
		// plugin under other directories.
		PolicyName:          filepath.Base(cfg.Policy.Name),
		TickInterval:        time.Duration(cfg.Engine.TickInterval),
		MountUpdateInterval: time.Duration(cfg.Engine.MountUpdateInterval),
		NoReuse:             !cfg.Engine.Reuse(),
		// Node-local state next to the socket: a second daemon started by
		// mistake stops here, before it touches a mount.
		LockFile: nodeLockFile(cfg),
		Logger:   log,
		Host:     hostpath.Staging,
		Movers:   movers,
		FS:       d.fs,
		Budgets:  EngineBudgets(cfg),
	}
	if objs != nil {
		ecfg.Objects = objs
	}
	if d.metrics != nil {
		ecfg.Observer = JobObserver(d.metrics)
	}
	eng, err := engine.Open(ctx, ecfg)
	if err != nil {
		if pe := (*policy.Error)(nil); errors.As(err, &pe) {
			// The policy does not start (a module that does not
			// compile, [policy.params] its init refuses): its key is
			// at fault, named once, without the engine's prefixes.
			err = d.flags.Locate(PolicyFault(cfg, err))
		} else {
			err = fmt.Errorf("open engine: %w", err)
		}
		return errors.Join(err, closeGPU())
	}
	d.mu.Lock()
	d.eng = eng // forcedExit reads it from another goroutine
	d.mu.Unlock()
	d.pol.Swap(build)
	WarnSingleMount(log, build, cfg.Mounts)
	warnReversedTiers(log, cfg, eng.Stats().Mounts)
	table, err := openLookupTable(cfg, eng, log)
	if err != nil {
		err = d.groupFault(err)
		cctx, cancel := context.WithTimeout(context.Background(), time.Duration(cfg.Server.ShutdownTimeout)+10*time.Second)
		defer cancel()
		cerr := eng.Close(cctx)
		if errors.Is(cerr, engine.ErrInFlight) {
			return errors.Join(err, cerr) // the GPU paths stay: see closeEngine
		}
		return errors.Join(err, cerr, closeGPU())
	}
	closeEngine := func() error {
		cctx, cancel := context.WithTimeout(context.Background(), time.Duration(cfg.Server.ShutdownTimeout)+10*time.Second)
		defer cancel()
		// The engine first: its jobs use the GPU paths until it is
		// closed; the table last, told of every key the engine drops.
		err := eng.Close(cctx)
		if errors.Is(err, engine.ErrInFlight) {
			// A job or a move hung on a mount still runs: it may use
			// the GPU paths and drop keys from the table. Both stay
			// open; the process exits next, which ends them all.
			return err
		}
		err = errors.Join(err, closeGPU())
		if table != nil {
			err = errors.Join(err, table.Close())
		}
		return err
	}
	sock, err := server.Listen(cfg.Server.Socket, os.FileMode(cfg.Server.SocketMode), cfg.Server.SocketGroup)
	if err != nil {
		return errors.Join(d.groupFault(err), closeEngine())
	}
	scfg := ServerLimits(cfg)
	scfg.Name = d.name
	scfg.Logger = log
	// The data paths guard their copies (region.Guard): a client
	// truncating its shared file fails its own job, nothing else.
	scfg.SharedFiles = true
	scfg.Daemon = d.daemonStats
	if table != nil {
		scfg.LookupTable = table.Path()
	}
	if d.metrics != nil {
		scfg.OnRequest = RequestObserver(d.metrics)
	}
	if gp != nil {
		scfg.OpenDevice, scfg.Devices = gp.ipc.Open, gp.ipc.Devices()
		scfg.DeviceUUIDs = gp.deviceUUIDs(scfg.Devices)
		scfg.DeviceFaults = gp.deviceFaults
	}
	if n := cfg.Engine.RemovalRing; n > 0 {
		if err := eng.Removals().SetSize(n); err != nil {
			sock.Close()
			return errors.Join(fmt.Errorf("engine.removal_ring: %w", err), closeEngine())
		}
	}
	srv, err := server.New(eng, scfg)
	if err != nil {
		sock.Close()
		return errors.Join(err, closeEngine())
	}
	wd, err := newWatchdog(cfg, eng, srv, log)
	if err != nil {
		sock.Close()
		return errors.Join(err, closeEngine())
	}
	if d.metrics != nil {
		src := metrics.Sources{
			Engine: EngineMetrics(eng.Stats), Server: ServerMetrics(srv.Stats), Policy: PolicyMetrics(d.pol.State),
			DataPaths: d.dataPaths, Staging: eng.StagingUsage, Statfs: StatfsMetrics(d.fs),
			Stalled: func() string { return wd.Unhealthy(time.Now()) },
			Removals: func() metrics.RemovalStats {
				st := eng.Removals().Stats()
				return metrics.RemovalStats{Published: st.Published, Resyncs: st.Resyncs, Subscribers: st.Subscribers}
			},
			Reloads: func() (uint64, uint64) {
				d.mu.Lock()
				defer d.mu.Unlock()
				return d.reloads, d.reloadFailures
			},
		}
		if objs != nil {
			src.Objects = ObjectMetrics(objs.Stats)
		}
		if gp != nil {
			src.GPUFiles, src.GPUStaging, src.GPUFaults = GPUFileMetrics(gp.Staging().FileStats), gp.Staging().PinnedUsage, gp.deviceFaults
			src.GPUChecksumJobs = gp.Staging().SumJobs
			if gp.CuFile() != nil {
				src.CuFile = CuFileMetrics(gp.CuFile().HandleStats)
			}
		}
		d.metrics.SetSources(src)
	}
	paths := make([]string, len(mounts))
	for i, m := range mounts {
		paths[i] = m.Path
	}

	// Signals while serving; reloads run here, one at a time, and end
	// before the engine closes.
	done := make(chan struct{})
	var sigWG sync.WaitGroup
	sigWG.Add(1)
	go func() {
		defer sigWG.Done()
		d.handleSignals(ctx, done)
	}()

	log.Info("kvhost listening", "socket", sock.Path(), "mode", cfg.Server.SocketMode.String(), "policy", d.pol.Name(), "mounts", strings.Join(paths, ","))
	// Ready first (/readyz, kvhost_ready, systemd), then the readiness
	// line on stdout (docs/serve.md), which scripts and tests wait for: a
	// scrape after the line must see the daemon ready. The socket already
	// accepts connections (the listener is open); Serve takes them. The
	// logs go to stderr in the configured format.
	d.setReady(ctx, true)
	wctx, stopWatchdog := context.WithCancel(ctx)
	var wdWG sync.WaitGroup
	wdWG.Add(1)
	go func() {
		defer wdWG.Done()
		wd.Run(wctx)
	}()
	fmt.Fprintf(d.stdout, "kvhost: listening on unix:%s\n", sock.Path())
	serveErr := srv.Serve(ctx, sock.UnixListener)
	stopWatchdog()
	wdWG.Wait()
	close(done)
	sigWG.Wait()
	log.Info("kvhost shutting down")
	err = errors.Join(serveErr, closeEngine())
	if cerr := sock.Close(); cerr != nil && !errors.Is(cerr, os.ErrClosed) && !strings.Contains(cerr.Error(), "use of closed") {
		err = errors.Join(err, cerr)
	}
	if err == nil {
		log.Info("kvhost stopped")
	}
	return err
}

// groupFault is err, where it is a fault of server.socket_group (a
// *server.GroupError: a group this machine lacks, one the daemon's user
// may not give files to), as a *config.KeyError naming the key and where
// it was set; any other error as it is.
func (d *daemon) groupFault(err error) error {
	var ge *server.GroupError
	if errors.As(err, &ge) {
		return d.flags.Locate("server.socket_group", err)
	}
	return err
}

// setReady tells /readyz and systemd whether the daemon accepts clients.
// setReady(false) says that it stops (SIGTERM): from then on nothing makes
// it ready again, neither the end of its start-up nor that of a reload
// racing the signal; nor does setReady(true) once ctx, the daemon's, has
// ended (the signal came, and the goroutine that says so has not run
// yet). Readiness changes and systemd is told under one lock, so that
// systemd never hears READY=1 after STOPPING=1, nor once stopping.
func (d *daemon) setReady(ctx context.Context, ready bool) {
	d.readyMu.Lock()
	defer d.readyMu.Unlock()
	if d.stopping || ready && ctx.Err() != nil {
		return
	}
	d.stopping = !ready
	if d.metrics != nil {
		d.metrics.SetReady(ready)
	}
	state := "STOPPING=1"
	if ready {
		state = "READY=1\nSTATUS=serving"
	}
	d.notifyLocked(state)
}

// setReloading tells systemd that a reload begins, unless the daemon
// stops.
func (d *daemon) setReloading() {
	d.readyMu.Lock()
	defer d.readyMu.Unlock()
	if !d.stopping {
		d.notifyLocked(fmt.Sprintf("RELOADING=1\nMONOTONIC_USEC=%d", monotonicUsec()))
	}
}

// notifyLocked sends state to systemd; d.readyMu is held.
func (d *daemon) notifyLocked(state string) {
	if err := sdNotify(state); err != nil {
		d.log.Warn("systemd notification failed", "err", err)
	}
}

// serveMetrics starts the metrics listener (with Go's profiles under
// /debug/pprof/ if profiling); stop shuts it down.
func (d *daemon) serveMetrics(addr string, profiling bool) (stop func(), err error) {
	d.metrics = metrics.New(d.name)
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics: %w", err)
	}
	hs := &http.Server{Handler: d.metrics.Handler(profiling), ReadHeaderTimeout: 10 * time.Second,
		ErrorLog: slog.NewLogLogger(d.log.Handler(), slog.LevelWarn)}
	go hs.Serve(ln)
	paths := "/metrics,/healthz,/healthz/gpu,/readyz"
	if profiling {
		paths += ",/debug/pprof/"
	}
	d.log.Info("metrics listening", "address", ln.Addr().String(), "paths", paths)
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		hs.Shutdown(ctx)
	}, nil
}

// trackChains wraps the GPU mover factories to remember the chains they
// build (their fallback counts are metrics).
func (d *daemon) trackChains(movers map[region.Kind]engine.MoverFactory) map[region.Kind]engine.MoverFactory {
	out := make(map[region.Kind]engine.MoverFactory, len(movers))
	for kind, build := range movers {
		out[kind] = func(m engine.MountInfo) (transfer.Mover, error) {
			mv, err := build(m)
			if c, ok := mv.(*transfer.Chain); ok && err == nil {
				d.mu.Lock()
				d.chains = append(d.chains, mountChain{m.Path, c})
				d.mu.Unlock()
			}
			return mv, err
		}
	}
	return out
}

// mountChain is a GPU data path the engine built for a mount.
type mountChain struct {
	mount string
	chain *transfer.Chain
}

func (d *daemon) dataPaths() []metrics.DataPath {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]metrics.DataPath, len(d.chains))
	for i, c := range d.chains {
		out[i] = metrics.DataPath{Mount: c.mount, Fallbacks: c.chain.Fallbacks()}
	}
	return out
}

// daemonStats is the daemon section of Stats replies.
func (d *daemon) daemonStats() protocol.DaemonStats {
	ps := d.pol.State()
	d.mu.Lock()
	defer d.mu.Unlock()
	return protocol.DaemonStats{
		Started: d.started.UnixNano(), Policy: ps.Name, PolicyBackend: ps.Stats.Backend,
		Fallback: ps.Stats.Fallback, FallbackReason: ps.Stats.FallbackReason, FallbackPolicy: ps.Stats.FallbackPolicy,
		Reloads: d.reloads, ReloadFailures: d.reloadFailures, LastReload: d.lastReload,
	}
}

// dumpStacks writes every goroutine's stack to stderr at each SIGQUIT on
// quit, from a goroutine of its own, until stop is called (stop waits for
// a dump under way): the daemon serves on.
func (d *daemon) dumpStacks(quit <-chan os.Signal) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-done:
				return
			case <-quit:
				d.log.Warn("SIGQUIT: writing every goroutine's stack to stderr; the daemon goes on")
				pprof.Lookup("goroutine").WriteTo(d.stderr, 2)
			}
		}
	}()
	return func() {
		close(done)
		wg.Wait()
	}
}

// handleSignals serves SIGHUP (reload) and the ignored signals until
// done.
func (d *daemon) handleSignals(ctx context.Context, done <-chan struct{}) {
	for {
		select {
		case <-done:
			return
		case sig := <-d.sigs:
			switch sig {
			case syscall.SIGHUP:
				if ctx.Err() == nil {
					d.reload(ctx)
				}
			case syscall.SIGPIPE:
				// A closed stdout or stderr: writes fail, the daemon serves on.
			default:
				d.log.Info("signal ignored", "signal", sig.String())
			}
		}
	}
}
