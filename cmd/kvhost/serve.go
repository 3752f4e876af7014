package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/config"
	"github.com/kvhost/kvhost/host/engine"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/logging"
	"github.com/kvhost/kvhost/plugins"
	"github.com/kvhost/kvhost/plugins/lru"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/server"
)

// runServe runs the daemon until ctx is done (SIGTERM, SIGINT), then shuts
// it down gracefully: stop accepting, let jobs finish within
// server.shutdown_timeout, cancel the rest, close the engine, remove the
// socket.
func runServe(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("kvhost serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	flags := config.BindFlags(fs)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: kvhost [serve] [flags]\n\nRuns the kvhost daemon (docs/serve.md).\n\nflags:")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kvhost serve: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	cfg, err := flags.Load()
	if err != nil {
		fmt.Fprintf(stderr, "kvhost: %v\n", err)
		return 2
	}
	log, err := logging.New(stderr, cfg.Log.Level, cfg.Log.Format)
	if err != nil {
		fmt.Fprintf(stderr, "kvhost: %v\n", err)
		return 2
	}
	if err := serve(ctx, cfg, log, stdout); err != nil {
		log.Error("kvhost stopped", "err", err)
		return 1
	}
	return 0
}

func serve(ctx context.Context, cfg config.Config, log *slog.Logger, stdout io.Writer) error {
	module, name, builtin, err := policyModule(cfg.Policy.Name)
	if err != nil {
		return err
	}
	pcfg := policy.Config{
		Shards:        cfg.Policy.Shards,
		MemoryLimit:   int64(cfg.Policy.MemoryLimit),
		CallTimeout:   time.Duration(cfg.Policy.CallTimeout),
		CacheDir:      cfg.Policy.CacheDir,
		Params:        cfg.Policy.PolicyParams(),
		MaxFailures:   cfg.Policy.MaxFailures,
		FailureWindow: time.Duration(cfg.Policy.FailureWindow),
		Fallback:      func() guest.Policy { return lru.New() },
		Logger:        log,
	}
	if pcfg.CacheDir == "" {
		pcfg.CacheDir = filepath.Join(config.DefaultRoot(), "wasm-cache")
	}
	if err := os.MkdirAll(pcfg.CacheDir, 0o750); err != nil {
		log.Warn("no compilation cache for the policy", "dir", pcfg.CacheDir, "err", err)
		pcfg.CacheDir = ""
	}
	newPolicy := func(idx policy.Index) (policy.Policy, error) {
		if module != nil {
			start := time.Now()
			h, err := policy.Open(ctx, module, name, idx, pcfg)
			if err == nil {
				log.Info("policy ready", "policy", name, "shards", h.Shards(), "took", time.Since(start).String())
				return h, nil
			}
			if ctx.Err() != nil {
				return nil, fmt.Errorf("policy %s: %w", name, ctx.Err())
			}
			if !builtin || name != plugins.Default {
				return nil, fmt.Errorf("policy %s: %w", name, err)
			}
			log.Warn("the built-in wasm policy does not load; running its native build", "policy", name, "err", err)
		}
		if module == nil {
			log.Warn("this binary embeds no wasm policy (built without make); running the native lru policy", "policy", name)
		}
		return policy.NewNative(func() guest.Policy { return lru.New() }, idx, pcfg)
	}
	mounts := make([]engine.Mount, len(cfg.Mounts))
	for i, m := range cfg.Mounts {
		capacity, err := mountCapacity(m)
		if err != nil {
			return err
		}
		mounts[i] = engine.Mount{
			Path: m.Path, Capacity: capacity, HighWatermark: m.HighWatermark, LowWatermark: m.LowWatermark,
			Reserve: int64(m.Reserve), IO: m.IO, NoChecksum: !m.Checksums(),
		}
		if m.Layout == config.LayoutVLLMFS {
			v := m.VLLMFS
			if v == nil {
				v = &config.VLLMFS{}
			}
			mounts[i].VLLMFS = &engine.VLLMFS{Fields: v.Fields(), Rank: v.Rank, Namespace: v.Namespace, RowBytes: int64(v.RowBytes)}
		}
	}
	gp, err := openGPU(gpuOptions{
		Mode:          cfg.GPU.Mode,
		CUDALibrary:   nonEmpty(cfg.GPU.CUDALibrary),
		CuFileLibrary: nonEmpty(cfg.GPU.CuFileLibrary),
		CuFile:        cfg.GPU.CuFile,
		MaxStaging:    int64(cfg.GPU.StagingMemory),
	}, log)
	if err != nil {
		return err
	}
	closeGPU := func() error { return nil }
	var movers map[region.Kind]engine.MoverFactory
	if gp != nil {
		closeGPU = gp.Close
		movers = gp.movers()
	}
	eng, err := engine.Open(ctx, engine.Config{
		Mounts:         mounts,
		NewPolicy:      newPolicy,
		Fsync:          cfg.Engine.Fsync,
		IOWorkers:      cfg.Engine.IOWorkers,
		CPUs:           cfg.Engine.CPUs,
		StagingBytes:   int64(cfg.Engine.StagingMemory),
		VerifyInterval: time.Duration(cfg.Engine.VerifyInterval),
		TempGrace:      time.Duration(cfg.Engine.TempGrace),
		NodeID:         cfg.Engine.NodeID,
		// Node-local state next to the socket: a second daemon started by
		// mistake stops here, before it touches a mount.
		LockFile: cfg.Server.Socket + ".lock",
		Logger:   log,
		Movers:   movers,
	})
	if err != nil {
		return errors.Join(fmt.Errorf("open engine: %w", err), closeGPU())
	}
	closeEngine := func() error {
		cctx, cancel := context.WithTimeout(context.Background(), time.Duration(cfg.Server.ShutdownTimeout)+10*time.Second)
		defer cancel()
		// The engine first: its jobs use the GPU paths until it is closed.
		return errors.Join(eng.Close(cctx), closeGPU())
	}
	sock, err := server.Listen(cfg.Server.Socket, os.FileMode(cfg.Server.SocketMode), cfg.Server.SocketGroup)
	if err != nil {
		return errors.Join(err, closeEngine())
	}
	scfg := server.Config{
		MaxClients:              cfg.Server.MaxClients,
		MaxFrame:                int(cfg.Server.MaxFrame),
		MaxRegistrations:        cfg.Server.MaxRegistrations,
		MaxInflightJobs:         cfg.Server.MaxInflightJobs,
		ShutdownTimeout:         time.Duration(cfg.Server.ShutdownTimeout),
		MaxHandshakes:           cfg.Server.MaxHandshakes,
		HandshakeTimeout:        time.Duration(cfg.Server.HandshakeTimeout),
		FrameTimeout:            time.Duration(cfg.Server.FrameTimeout),
		IdleTimeout:             time.Duration(cfg.Server.IdleTimeout),
		WriteTimeout:            time.Duration(cfg.Server.WriteTimeout),
		MaxRegisteredBytes:      int64(cfg.Server.MaxRegisteredBytes),
		MaxTotalRegisteredBytes: int64(cfg.Server.MaxTotalRegisteredBytes),
		Name:                    "kvhost",
		Logger:                  log,
		// The data paths guard their copies (region.Guard): a client
		// truncating its shared file fails its own job, nothing else.
		SharedFiles:    true,
		MaxDeviceBytes: int64(cfg.Server.MaxDeviceRegisteredBytes),
	}
	if gp != nil {
		scfg.OpenDevice, scfg.Devices = gp.ipc.Open, gp.ipc.Devices()
	}
	srv, err := server.New(eng, scfg)
	if err != nil {
		sock.Close()
		return errors.Join(err, closeEngine())
	}
	paths := make([]string, len(mounts))
	for i, m := range mounts {
		paths[i] = m.Path
	}
	log.Info("kvhost listening", "socket", sock.Path(), "mode", cfg.Server.SocketMode.String(), "policy", name, "mounts", strings.Join(paths, ","))
	fmt.Fprintf(stdout, "kvhost: listening on unix:%s\n", sock.Path())
	serveErr := srv.Serve(ctx, sock.UnixListener)
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

// nonEmpty is []string{s}, or nil when s is empty (the default search
// paths).
func nonEmpty(s string) []string {
	if s == "" {
		return nil
	}
	return []string{s}
}

// policyModule resolves --policy: a built-in name or a .wasm file. A
// built-in missing from the binary (built without make) yields a nil module
// for lru, which then runs natively.
func policyModule(nameOrFile string) (module []byte, name string, builtin bool, err error) {
	if strings.HasSuffix(nameOrFile, ".wasm") || strings.ContainsRune(nameOrFile, os.PathSeparator) {
		b, err := os.ReadFile(nameOrFile)
		if err != nil {
			return nil, "", false, fmt.Errorf("policy: %w", err)
		}
		return b, strings.TrimSuffix(filepath.Base(nameOrFile), ".wasm"), false, nil
	}
	b, err := plugins.Wasm(nameOrFile)
	if err != nil {
		if nameOrFile == plugins.Default {
			return nil, nameOrFile, true, nil
		}
		return nil, "", false, err
	}
	return b, nameOrFile, true, nil
}

// mountCapacity is the configured capacity, or 90% of the file system's
// size when it is 0 (docs/config.md).
func mountCapacity(m config.Mount) (int64, error) {
	if m.Capacity > 0 {
		return int64(m.Capacity), nil
	}
	if err := os.MkdirAll(m.Path, 0o750); err != nil {
		return 0, fmt.Errorf("mount %s: %w", m.Path, err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(m.Path, &st); err != nil {
		return 0, fmt.Errorf("mount %s: statfs: %w", m.Path, err)
	}
	return int64(float64(st.Blocks) * float64(st.Bsize) * 0.9), nil
}
