package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/gds"
	"github.com/kvhost/kvhost/internal/bench"
	kvdaemon "github.com/kvhost/kvhost/internal/daemon"
	"github.com/kvhost/kvhost/internal/daemon/hostpath"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/staging/gpu"
)

// benchRun is the state of one `kvhost bench` invocation.
type benchRun struct {
	o      benchOptions
	log    *slog.Logger
	prog   *bench.Progress
	rep    *bench.Report
	root   string // the working directory under --dir
	useGPU bool
	bufs   *ceilingBuffers
	staged []*gpuStager  // the staged ceilings' threads (with a GPU)
	warmed map[int]bool  // tokens per key warmed up
	seq    int           // engine directories made
	probe  *kvdaemon.GPU // open for the whole run when a GPU is used
	// ahead is the bytes of spares the last engine opened makes ahead of
	// stores (its mount's Preallocate, auto resolved; 0: none).
	ahead int64
}

// ceilingPair is a combination's file ceilings: the plain write, read
// and second read, and with a GPU the staged write and read.
type ceilingPair struct{ read, reread, write, stagedRead, stagedWrite bench.Ceiling }

// runBenchmark runs every combination the options ask for and returns the
// report.
func runBenchmark(ctx context.Context, o benchOptions, log *slog.Logger, stderr io.Writer) (*bench.Report, error) {
	start := time.Now()
	root, made, err := benchDirs(o.dir)
	if err != nil {
		return nil, err
	}
	if !o.keep {
		defer func() {
			os.RemoveAll(root)
			removeMade(made)
		}()
	}
	host, _ := os.Hostname()
	r := &benchRun{
		o: o, log: log, root: root,
		warmed: map[int]bool{},
		rep: &bench.Report{
			Schema: bench.Schema, Version: versionString(), Command: o.args, Started: start.UTC(),
			Host: host, Dir: absDir(o.dir), FSType: fsTypeOf(root), Model: o.geometry,
			Fsync: o.fsync, Cold: o.dropCaches, CeilingPasses: o.ceilingPasses, Ceilings: []bench.Ceiling{}, Runs: []bench.Run{},
		},
	}
	tty := false
	if f, ok := stderr.(*os.File); ok {
		tty = bench.IsTerminal(f)
	}
	r.prog = bench.NewProgress(stderr, o.progress == "on" || o.progress == "auto" && tty)
	defer r.prog.Clear()

	// Probe for a GPU once: it decides the memory and the ceilings.
	var probe *kvdaemon.GPU
	if o.memory != "host" {
		var err error
		if probe, err = r.openGPU("staging", true, o.memory == "gpu"); err != nil {
			return nil, fmt.Errorf("--memory %s: %w (kvhost check says more)", o.memory, err)
		}
	}
	r.useGPU = probe != nil
	r.probe = probe
	if r.useGPU {
		r.rep.Memory = "gpu"
		r.rep.Device = deviceName(probe)
		cs, err := pinnedCeilings(ctx, probe)
		if err != nil {
			probe.Close()
			return nil, err
		}
		r.rep.Ceilings = append(r.rep.Ceilings, cs...)
	} else {
		r.rep.Memory = "host"
	}
	if probe != nil {
		// Keep the runtime loaded for the whole run: each combination
		// opens its own GPU paths, and the library stays resident.
		defer probe.Close()
	}
	defer func() {
		if err := r.closeStagers(); err != nil {
			log.Warn("staged ceilings", "err", err)
		}
		if r.bufs != nil {
			r.bufs.free()
		}
	}()
	for _, path := range o.paths {
		if path == "cufile" && !r.useGPU {
			return nil, errors.New("--path cufile moves GPU memory: it needs a GPU (--memory gpu)")
		}
		for _, sums := range o.checksums {
			if err := r.combination(ctx, path, sums); err != nil {
				err = fmt.Errorf("path %s, checksums %v: %w", path, sums, err)
				if ctx.Err() != nil && len(r.rep.Runs) > 0 {
					// Interrupted (SIGTERM, SIGINT): the runs that
					// finished are still worth writing, marked partial.
					r.rep.Partial = true
					r.rep.Seconds = time.Since(start).Seconds()
					r.rep.Finish()
					return r.rep, err
				}
				return nil, err
			}
		}
	}
	r.rep.Seconds = time.Since(start).Seconds()
	r.rep.Finish()
	return r.rep, nil
}

// openGPU opens the daemon's GPU paths for a path: cuFile allowed for auto
// and cufile (in compatibility mode too with --allow-compat), off for
// staging and posix; the staging pipeline checksums when sums is set. With
// required it fails without a GPU, else it returns nil then.
func (r *benchRun) openGPU(path string, sums, required bool) (*kvdaemon.GPU, error) {
	c := r.o.cfg.GPU
	cufile := "off"
	if path == "auto" || path == "cufile" {
		cufile = c.CuFile
		if cufile == "off" && path == "cufile" {
			cufile = "auto"
		}
		if r.o.allowCompat {
			cufile = "compat"
		}
	}
	mode := c.Mode
	if required {
		mode = "on"
	}
	opts := kvdaemon.GPUOptionsOf(r.o.cfg) // as the daemon opens them, but for:
	opts.Mode, opts.CuFile, opts.NoChecksum = mode, cufile, !sums
	return kvdaemon.OpenGPU(opts, r.log)
}

// benchEngine is the engine a combination runs on, with its GPU paths
// and directory; with --restart both are replaced before each load.
type benchEngine struct {
	eng  *engine.Engine
	gp   *kvdaemon.GPU // nil: host memory
	dir  string
	path string
	sums bool
	// opened is the files the engine indexed at Open (--foreign's second
	// engine: those it did not find on its load).
	opened int
}

// engineFor opens an engine on a fresh directory for one path and checksum
// setting, wired as the daemon wires it.
func (r *benchRun) engineFor(ctx context.Context, path string, sums bool) (*benchEngine, error) {
	be := &benchEngine{path: path, sums: sums}
	if r.useGPU {
		var err error
		if be.gp, err = r.openGPU(path, sums, true); err != nil {
			return nil, err
		}
	}
	r.seq++
	be.dir = filepath.Join(r.root, fmt.Sprintf("engine-%d", r.seq))
	if path == "cufile" {
		if err := requireCuFile(be.gp, be.dir, r.o.allowCompat); err != nil {
			be.gp.Close()
			return nil, err
		}
	}
	eng, err := r.openEngine(ctx, be, "", r.o.preallocate)
	if err != nil {
		if be.gp != nil {
			be.gp.Close()
		}
		return nil, err
	}
	be.eng = eng
	r.ahead = eng.Stats().Mounts[0].Preallocate
	return be, nil
}

// openEngine opens an engine on be's directory with be's GPU paths'
// movers (as they are now), as the daemon opens one, as node nodeID (""
// the default: the host's name) making preallocate bytes of spares ahead.
func (r *benchRun) openEngine(ctx context.Context, be *benchEngine, nodeID string, preallocate int64) (*engine.Engine, error) {
	var movers map[region.Kind]engine.MoverFactory
	if be.gp != nil {
		movers = be.gp.Movers()
	}
	io := "auto"
	if be.path == "posix" {
		io = "buffered"
	}
	m := engine.Mount{Path: be.dir, IO: io, NoChecksum: !be.sums, HighWatermark: 0.95, LowWatermark: 0.85}
	if r.o.full {
		// One round of keys and their headers fills about 0.8 of it:
		// below the low watermark, so a round's loads find all its keys,
		// and the next round's stores evict the previous round's files.
		m.Capacity = r.o.total + r.o.total*3/10
	}
	if len(r.o.cfg.Mounts) > 0 {
		m.Reserve, m.LoadReaders = int64(r.o.cfg.Mounts[0].Reserve), r.o.cfg.Mounts[0].LoadReaders
		// The configuration's I/O mode, except for the posix path, which
		// is buffered by definition.
		if mio := r.o.cfg.Mounts[0].IO; mio != "" && be.path != "posix" {
			m.IO = mio
		}
	}
	m.Preallocate = preallocate
	cfg := r.o.cfg
	eng, err := engine.Open(ctx, engine.Config{
		Mounts: []engine.Mount{m}, NewPolicy: benchPolicy(ctx, cfg, r.log), NodeID: nodeID,
		Fsync: r.o.fsync, IOWorkers: cfg.Engine.IOWorkers, CPUs: cfg.Engine.CPUs, YieldBytes: int64(cfg.Engine.YieldBytes),
		StagingBytes: int64(cfg.Engine.StagingMemory), Logger: slog.New(withoutMessage{r.log.Handler(), engine.SharedDirectoryWarning}),
		Host: hostpath.Staging, Movers: movers, NoReuse: !cfg.Engine.Reuse(),
	})
	if err != nil {
		return nil, fmt.Errorf("open engine: %w", err)
	}
	return eng, nil
}

// restart does what a daemon's restart does to the files of c's round:
// it closes the engine and its GPU paths' movers, opens new ones on the
// same directory (the engine rebuilds its index from the files and offers
// those on a memory mount to the new registrar), and declares c's
// namespace and registers its memory again, as the client does on
// reconnecting. It returns the files the new engine indexed.
func (r *benchRun) restart(ctx context.Context, be *benchEngine, c *benchCache, tensors []engine.LayerTensor) (int, error) {
	err := closeEngine(be.eng)
	be.eng = nil
	if err != nil {
		return 0, fmt.Errorf("restart: close the engine: %w", err)
	}
	if be.gp != nil {
		if err := be.gp.RestartMovers(); err != nil {
			return 0, fmt.Errorf("restart: the GPU paths: %w", err)
		}
		if be.path == "cufile" {
			// The new cuFile mover must serve the mount as the first did,
			// or the loads would move through the staging pipeline under
			// --path cufile.
			if err := requireCuFile(be.gp, be.dir, r.o.allowCompat); err != nil {
				return 0, fmt.Errorf("restart: %w", err)
			}
		}
	}
	eng, err := r.openEngine(ctx, be, "", r.o.preallocate)
	if err != nil {
		return 0, fmt.Errorf("restart: %w", err)
	}
	r.ahead = eng.Stats().Mounts[0].Preallocate
	found := eng.Stats().Entries
	ns, cache, err := declareCache(ctx, eng, c, tensors)
	if err != nil {
		// No engine for keySize's and combination's clean-ups to
		// unregister from or close: this one closes here.
		return 0, errors.Join(fmt.Errorf("restart: %w", err), closeEngine(eng))
	}
	be.eng, c.ns, c.cache = eng, ns, cache
	return found, nil
}

// declareCache declares c's namespace on eng and registers c's memory
// there (tensors), as a client does on connecting.
func declareCache(ctx context.Context, eng *engine.Engine, c *benchCache, tensors []engine.LayerTensor) (engine.NamespaceID, engine.CacheID, error) {
	ns, err := eng.Declare(ctx, c.g)
	if err != nil {
		return ns, 0, err
	}
	cache, err := eng.RegisterCache(ns, tensors)
	return ns, cache, err
}

// closeEngine closes eng, giving it a minute whatever the benchmark's
// context (an interrupted run still closes its engines).
func closeEngine(eng *engine.Engine) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	return eng.Close(ctx)
}

// otherNode is the node id of --foreign's second engine.
const otherNode = "kvhost-bench-other"

// openOther opens --foreign's second engine on be's directory: GPU paths
// of its own (another registrar, other pinned buffers), another node's
// id, no spares made ahead (it only loads); and declares c's namespace and
// registers c's memory with it. It returns the engine and a copy of c
// that names them; close it with closeOther. It leaves the first
// engine's spare files, whose owner file that engine holds, as another
// daemon starting on the directory does: the round's stores write into
// them as without --foreign.
func (r *benchRun) openOther(ctx context.Context, be *benchEngine, c *benchCache, tensors []engine.LayerTensor) (*benchEngine, *benchCache, error) {
	o := &benchEngine{dir: be.dir, path: be.path, sums: be.sums}
	fail := func(err error) (*benchEngine, *benchCache, error) {
		return nil, nil, errors.Join(fmt.Errorf("--foreign: %w", err), r.closeOther(o))
	}
	var err error
	if be.gp != nil {
		if o.gp, err = r.openGPU(be.path, be.sums, true); err != nil {
			return fail(err)
		}
		if be.path == "cufile" {
			if err := requireCuFile(o.gp, o.dir, r.o.allowCompat); err != nil {
				return fail(err)
			}
		}
	}
	if o.eng, err = r.openEngine(ctx, o, otherNode, 0); err != nil {
		return fail(err)
	}
	o.opened = o.eng.Stats().Entries
	oc := *c
	if oc.ns, oc.cache, err = declareCache(ctx, o.eng, c, tensors); err != nil {
		return fail(err)
	}
	return o, &oc, nil
}

// closeOther closes what openOther opened.
func (r *benchRun) closeOther(o *benchEngine) error {
	var err error
	if o.eng != nil {
		err = closeEngine(o.eng)
	}
	if o.gp != nil {
		err = errors.Join(err, o.gp.Close())
	}
	return err
}

// awaitWarmed waits until a reopened engine has offered the files it
// found to the GPU path and the registrar has taken every offer: the idle
// moment a restarted daemon has before its first load.
func (r *benchRun) awaitWarmed(ctx context.Context, be *benchEngine) error {
	if err := be.eng.WaitWarmed(ctx); err != nil {
		return fmt.Errorf("wait for the files found at open to be offered: %w", err)
	}
	return awaitRegistrar(ctx, be.gp)
}

// requireCuFile fails unless cuFile loaded and can serve dir's mount.
func requireCuFile(gp *kvdaemon.GPU, dir string, allowCompat bool) error {
	if gp.CuFile() == nil {
		_, err := gds.Open(gds.Config{LibraryPaths: gp.Options().CuFileLibrary, Logger: slog.New(slog.DiscardHandler)})
		if err == nil {
			err = errors.New("the cuFile mover did not start (gpu.cufile = off?)")
		}
		return fmt.Errorf("--path cufile: cuFile unavailable: %w", err)
	}
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return err
	}
	c, err := gp.CuFile().ProbeDir(dir)
	if err != nil {
		return fmt.Errorf("--path cufile: %w", err)
	}
	switch {
	case c.Mode == gds.ModeDirect:
		return nil
	case c.Mode == gds.ModeCompat && allowCompat:
		return nil
	case c.Mode == gds.ModeCompat:
		return fmt.Errorf("--path cufile: %s: cuFile runs in compatibility mode there (a host bounce); pass --allow-compat to measure it", c)
	}
	return fmt.Errorf("--path cufile: cuFile cannot serve %s: %s", dir, c)
}

// combination runs every key size and job count for one path and checksum
// setting on its own engine.
func (r *benchRun) combination(ctx context.Context, path string, sums bool) (err error) {
	be, err := r.engineFor(ctx, path, sums)
	if err != nil {
		return err
	}
	defer func() {
		if be.eng != nil { // nil after a restart that failed to reopen it
			err = errors.Join(err, closeEngine(be.eng))
		}
		if be.gp != nil {
			err = errors.Join(err, be.gp.Close())
		}
		if !r.o.keep {
			os.RemoveAll(be.dir)
		}
	}()
	for _, tpk := range r.o.tokensPerKey {
		if err := r.keySize(ctx, be, tpk); err != nil {
			return err
		}
	}
	return nil
}

// benchCache is the paged cache of one key size: memory, layout, the
// sources as stored, and the engine's ids.
type benchCache struct {
	mem    benchMemory
	layout *bench.Layout
	src    [][]byte
	ns     engine.NamespaceID
	cache  engine.CacheID
	keys   [][]byte // stored names
	misses [][]byte // names never stored
	g      engine.Geometry
	gen    int // renames so far (--full)
}

// rename gives the cache's keys names never used before (--full): the
// next store writes new files, and the previous round's are evicted.
func (c *benchCache) rename() {
	c.gen++
	for i := range c.keys {
		c.keys[i] = fmt.Appendf(nil, "bench-%d-g%d-%08d", c.g.TokensPerKey, c.gen, i)
	}
}

// benchKeys is the keys of each phase for keys of keyBytes: --keys, or
// as many as --total holds. Every job count needs two keys per job
// (keys-per-job each), so a phase of fewer is an error naming what
// would do, rather than a silently larger run than --total.
func benchKeys(o benchOptions, keyBytes int64) (int, error) {
	keys, what := o.keys, fmt.Sprintf("--keys %d", o.keys)
	if keys == 0 {
		keys = int(max(1, o.total/keyBytes))
		what = fmt.Sprintf("--total %s holds %d keys of %s", sizeOf(o.total), keys, sizeOf(keyBytes))
	}
	need := 2 * slices.Max(o.jobs) * o.keysPerJob
	if keys < need {
		return 0, fmt.Errorf("%s, but --jobs %d needs at least %d keys (%s): raise --total or --keys, or lower --jobs, --keys-per-job or --tokens-per-key",
			what, slices.Max(o.jobs), need, sizeOf(int64(need)*keyBytes))
	}
	return keys, nil
}

// keySize measures one key size at every job count.
func (r *benchRun) keySize(ctx context.Context, be *benchEngine, tpk int) error {
	eng, gp, dir, path, sums := be.eng, be.gp, be.dir, be.path, be.sums
	g := engine.Geometry{
		Model: "kvhost-bench", Layers: r.o.geometry.Layers, KVHeads: r.o.geometry.KVHeads,
		HeadSize: r.o.geometry.HeadSize, DtypeSize: r.o.geometry.DtypeSize,
		TokensPerBlock: r.o.geometry.TokensPerBlock, TokensPerKey: tpk, TPSize: 1,
	}
	if err := g.Validate(); err != nil {
		return err
	}
	maxJobs := slices.Max(r.o.jobs)
	keys, err := benchKeys(r.o, g.KeyBytes())
	if err != nil {
		return err
	}
	ns, err := eng.Declare(ctx, g)
	if err != nil {
		return err
	}
	perFile, err := eng.KeysPerFile(ns)
	if err != nil {
		return err
	}
	perFile = min(perFile, r.o.keysPerJob) // a file holds one job's keys at most
	layout := bench.NewLayout(g.Layers, 2*g.BlockBytes(), g.BlocksPerKey(), keys, uint64(tpk))
	var mem benchMemory
	if r.useGPU {
		mem, err = newDeviceMemory(gp, layout.Bytes())
	} else {
		mem, err = newHostMemory(layout.Bytes())
	}
	if err != nil {
		return fmt.Errorf("cache of %d bytes: %w", layout.Bytes(), err)
	}
	defer mem.Close()
	c := &benchCache{mem: mem, layout: layout, ns: ns, g: g}
	if c.src, err = layout.Fill(mem, uint64(tpk)); err != nil {
		return err
	}
	tensors := make([]engine.LayerTensor, g.Layers)
	for l := range tensors {
		tensors[l] = engine.LayerTensor{
			Region: mem.Region(), Offset: mem.Base() + int64(l)*layout.LayerBytes(),
			BlockStride: layout.PageBytes, PlaneStride: g.BlockBytes(), NumBlocks: layout.NumBlocks,
		}
	}
	if c.cache, err = eng.RegisterCache(ns, tensors); err != nil {
		return err
	}
	// The key size's namespace is released when its runs are done, as a
	// client's is when it leaves: the engine splits spares made ahead
	// between the namespaces it knows, and the next key size's runs get
	// the whole budget, as a daemon serving one model gives it.
	defer func() {
		if be.eng == nil { // a restart failed to reopen it
			return
		}
		if err := be.eng.UnregisterCache(c.cache); err != nil {
			r.log.Warn("bench: unregister the cache", "err", err)
		} else if err := be.eng.Release(c.ns); err != nil {
			r.log.Warn("bench: release the namespace", "err", err)
		}
	}()
	for i := range keys {
		c.keys = append(c.keys, fmt.Appendf(nil, "bench-%d-%08d", tpk, i))
		c.misses = append(c.misses, fmt.Appendf(nil, "bench-miss-%d-%08d", tpk, i))
	}
	// Where the engine makes spares ahead, every key size is warmed up in
	// every engine (each path and checksum setting opens its own), so that the
	// engine makes spares of that size before the first measured round,
	// as a daemon serving one model has them: a size that follows
	// another in one engine would otherwise have its first round stored
	// before the engine knew it.
	if r.o.warmup && (!r.warmed[tpk] || r.ahead > 0) {
		r.warmed[tpk] = true
		r.prog.Start(fmt.Sprintf("warm-up %s %s keys", path, sizeOf(g.KeyBytes())), keys)
		if _, _, err := r.phase(ctx, eng, c, bench.Store, maxJobs); err != nil {
			return fmt.Errorf("warm-up: %w", err)
		}
		if err := r.deleteAll(ctx, eng, c); err != nil {
			return err
		}
	}
	stored := false
	var lastReused uint64 // files the last store phase wrote into spares
	// --foreign's second engine, open from a round's store to its load.
	var other *benchEngine
	var oc *benchCache
	defer func() {
		if other != nil {
			if err := r.closeOther(other); err != nil {
				r.log.Warn("bench: close the second engine", "err", err)
			}
		}
	}()
	for _, jobs := range r.o.jobs {
		var st, ld phaseTotals
		var ceil ceilingTotals
		deadline := time.Now().Add(r.o.duration)
		for round := 0; round < r.o.rounds || time.Now().Before(deadline); round++ {
			if stored && r.o.store {
				if r.o.full {
					c.rename() // new keys; the old ones are evicted
				} else if err := r.deleteAll(ctx, eng, c); err != nil {
					return err
				}
				stored = false
			}
			if !stored {
				if r.o.foreign {
					// Before the store: its files are then none of the
					// second engine's at open, and its load finds them.
					if other, oc, err = r.openOther(ctx, be, c, tensors); err != nil {
						return err
					}
				}
				if err := r.settle(ctx, eng, gp); err != nil {
					return err
				}
				if r.o.verify && r.o.noGap && r.o.load {
					// Before the store, so that nothing runs between it
					// and the load.
					if err := c.layout.Poison(c.mem); err != nil {
						return err
					}
				}
				r.prog.Start(fmt.Sprintf("store %s sums=%v %s keys, %d jobs", path, sums, sizeOf(g.KeyBytes()), jobs), keys)
				cpu := bench.CPUTime()
				reused, before := eng.Stats().Reused, fileStats(gp)
				d, lat, err := r.phase(ctx, eng, c, bench.Store, jobs)
				if err != nil {
					return err
				}
				stored, lastReused = true, eng.Stats().Reused-reused
				if r.o.store {
					st.add(d, lat, int64(keys)*g.KeyBytes(), keys, 0)
					st.cpu += bench.CPUTime() - cpu
					st.reused += eng.Stats().Reused - reused
					after := fileStats(gp)
					st.direct += after.Stores - before.Stores
					st.waits += after.Waits - before.Waits
				}
			}
			files, err := engineFiles(dir, g.KeyBytes())
			if err != nil {
				return err
			}
			spares := ceilingSpares(r.o.full, r.ahead, lastReused, len(files))
			// The ceiling is timed in every round, between the round's
			// store and its load (after the load with --no-gap), and
			// summed like the engine's phases: engine and ceiling see the
			// same machine at the same time.
			ceilings := func() error {
				if err := r.settle(ctx, eng, gp); err != nil {
					return err
				}
				ms := eng.Stats().Mounts[0]
				return r.measureCeilings(ctx, files, jobs, ms.Direct, int64(gpu.PieceBytes(ms.Direct, ms.Memory)), spares, &ceil)
			}
			if !r.o.noGap || !r.o.load {
				if err := ceilings(); err != nil {
					return err
				}
			}
			if !r.o.load {
				continue
			}
			if r.o.restart {
				found, err := r.restart(ctx, be, c, tensors)
				if err != nil {
					return err
				}
				eng = be.eng
				ld.found += found
				if !r.o.noGap {
					start := time.Now()
					if err := r.awaitWarmed(ctx, be); err != nil {
						return err
					}
					if gp != nil { // no registrar to wait for on host memory
						ld.warming += time.Since(start)
					}
				}
				// The new registrar's counts, from zero: the files it took
				// ahead of any job and has registered, when the load begins.
				st := fileStats(gp)
				ld.registered += min(st.Warmed, st.Registered)
			}
			if r.o.dropCaches {
				if _, err := bench.DropCaches(files); err != nil {
					return err
				}
			}
			if r.o.verify && !r.o.noGap {
				if err := c.layout.Poison(c.mem); err != nil {
					return err
				}
			}
			if !r.o.noGap {
				if err := r.settle(ctx, eng, gp); err != nil {
					return err
				}
			}
			r.prog.Start(fmt.Sprintf("load %s sums=%v %s keys, %d jobs", path, sums, sizeOf(g.KeyBytes()), jobs), keys)
			hits := 0
			for i := range keys {
				if bench.Hit(i, r.o.hitRatio) {
					hits++
				}
			}
			loadEng, loadC, loadGP := eng, c, gp
			if other != nil {
				loadEng, loadC, loadGP = other.eng, oc, other.gp
			}
			if r.o.readFirst {
				if err := r.readFirst(ctx, files, jobs, eng.Stats().Mounts[0].Direct, &ld); err != nil {
					return err
				}
				if r.o.dropCaches { // the load stays cold
					if _, err := bench.DropCaches(files); err != nil {
						return err
					}
				}
			}
			cpu, before := bench.CPUTime(), fileStats(loadGP)
			d, lat, err := r.phase(ctx, loadEng, loadC, bench.Load, jobs)
			if err != nil {
				return err
			}
			ld.cpu += bench.CPUTime() - cpu
			after := fileStats(loadGP)
			ld.direct += after.Loads - before.Loads
			ld.waits += after.Waits - before.Waits
			var verified int64
			if r.o.verify {
				idx := make([]int, keys)
				hit := make([]bool, keys)
				for i := range idx {
					idx[i], hit[i] = i, bench.Hit(i, r.o.hitRatio)
				}
				if verified, err = c.layout.Verify(c.mem, c.src, idx, hit); err != nil {
					return fmt.Errorf("load, %d jobs: %w", jobs, err)
				}
			}
			ld.add(d, lat, int64(hits)*g.KeyBytes(), hits, verified)
			if other != nil {
				// The files it holds beyond those it found at open (none:
				// it opened before the store) it found on the load.
				ld.found += other.eng.Stats().Entries - other.opened
				err := r.closeOther(other)
				other = nil
				if err != nil {
					return fmt.Errorf("--foreign: close the second engine: %w", err)
				}
			}
			if r.o.noGap {
				if err := ceilings(); err != nil {
					return err
				}
			}
		}
		mover := r.moverName(gp)
		io := eng.Stats().Mounts[0].IO
		// The engine writes payload checksums only where the mover
		// computes them: cuFile never lets the CPU see the bytes.
		summed := eng.Stats().Mounts[0].Checksums && mover != "cufile"
		sumsOn := ""
		if summed {
			sumsOn = "cpu"
			if mover == "gpu-staging" && gp != nil && gp.Staging() != nil {
				sumsOn = gp.Staging().ChecksumOn()
			}
		}
		cp := ceil.pair(jobs)
		base := bench.Run{
			Path: path, Mover: mover, IO: io, Checksums: sums, Checksummed: summed, ChecksumOn: sumsOn, Jobs: jobs, TokensPerKey: tpk,
			KeyBytes: g.KeyBytes(), KeysPerJob: r.o.keysPerJob, KeysPerFile: perFile, Keys: keys, Preallocate: eng.Stats().Mounts[0].Preallocate, NoGap: r.o.noGap && r.o.load,
		}
		if r.o.store {
			x := st.run(base, bench.Store, keys, cp.write, ceil.wround)
			x.CeilingStaged, x.FractionStaged = againstStaged(x.GBps, cp.stagedWrite)
			r.rep.Runs = append(r.rep.Runs, x)
		}
		if r.o.load {
			x := ld.run(base, bench.Load, keys, cp.read, ceil.rround)
			x.Misses = keys - ld.keys/max(1, ld.rounds)
			if cp.reread.GBps > 0 {
				x.CeilingReread = cp.reread
				x.FractionReread = x.GBps / cp.reread.GBps
			}
			x.CeilingStaged, x.FractionStaged = againstStaged(x.GBps, cp.stagedRead)
			if r.o.foreign {
				x.Foreign, x.FilesDiscovered = true, ld.found/max(1, ld.rounds)
			} else {
				ms := eng.Stats().Mounts[0]
				x.LoadReaders, x.LoadBuffered, x.LoadReadersChanged = ms.LoadReaders, ms.LoadBuffered, ms.LoadReadersChanged
			}
			if rf := ld.readFirst; rf.d > 0 {
				x.ReadFirst = bench.Ceiling{Name: plainReadName(eng.Stats().Mounts[0].Direct, r.useGPU, r.o.dropCaches) + " of the load's own files", GBps: bench.GBps(rf.bytes, rf.d), Threads: jobs, CPUMsPerGB: bench.CPUMsPerGB(rf.cpu, rf.bytes)}
			}
			if r.o.restart {
				x.Restart, x.FilesAtRestart = true, ld.found/max(1, ld.rounds)
				x.RegisteredAtRestart = int(ld.registered / uint64(max(1, ld.rounds)))
				x.RestartWarmMs = float64(ld.warming) / float64(time.Millisecond) / float64(max(1, ld.rounds))
			}
			r.rep.Runs = append(r.rep.Runs, x)
		}
	}
	return r.deleteAll(ctx, eng, c)
}

// againstStaged returns a run's staged ceiling and its fraction of it,
// or nothing where none was measured (host memory).
func againstStaged(gbps float64, c bench.Ceiling) (bench.Ceiling, float64) {
	if c.GBps <= 0 {
		return bench.Ceiling{}, 0
	}
	return c, gbps / c.GBps
}

// phaseTotals sums the rounds of one phase.
type phaseTotals struct {
	d          time.Duration
	lat        []time.Duration
	bytes      int64
	keys       int
	verified   int64
	rounds     int
	cpu        time.Duration // process CPU time over the phases
	reused     uint64        // stores into spare files over the phases
	direct     uint64        // jobs on registered files over the phases
	waits      uint64        // the registrar's waits for stores over the phases
	found      int           // files the engines reopened before loads found (--restart), or the second engines found on their loads (--foreign)
	registered uint64        // of those, registered by the new registrars before the loads
	warming    time.Duration // the waits, after the reopens, until the new registrars had taken the files found
	gbps       []float64     // each round's GB/s
	// readFirst sums the plain reads of the load's own files timed
	// before each round's load (--read-first).
	readFirst struct {
		bytes int64
		d     time.Duration
		cpu   time.Duration
	}
}

func (t *phaseTotals) add(d time.Duration, lat []time.Duration, bytes int64, keys int, verified int64) {
	t.d += d
	t.lat = append(t.lat, lat...)
	t.bytes += bytes
	t.keys += keys
	t.verified += verified
	t.rounds++
	t.gbps = append(t.gbps, bench.GBps(bytes, d))
}

// run is the phase's figures over its rounds, held to ceiling (summed
// over the same rounds); ceilingRounds is the ceiling's GB/s in each
// round, paired with the phase's own rounds for Run.RoundFractions.
func (t *phaseTotals) run(base bench.Run, dir string, keys int, ceiling bench.Ceiling, ceilingRounds []float64) bench.Run {
	x := base
	x.Direction = dir
	x.Hits = t.keys / max(1, t.rounds)
	x.Bytes = t.bytes / int64(max(1, t.rounds))
	x.Seconds = t.d.Seconds() / float64(max(1, t.rounds))
	x.GBps = bench.GBps(t.bytes, t.d)
	x.Ceiling = ceiling
	if ceiling.GBps > 0 {
		x.Fraction = x.GBps / ceiling.GBps
	}
	x.JobP50Ms = bench.Percentile(t.lat, 0.50)
	x.JobP99Ms = bench.Percentile(t.lat, 0.99)
	x.VerifiedBytes = t.verified / int64(max(1, t.rounds))
	x.ReusedFiles = int(t.reused / uint64(max(1, t.rounds)))
	x.DirectFiles = int(t.direct / uint64(max(1, t.rounds)))
	x.RegistrationWaits = int(t.waits / uint64(max(1, t.rounds)))
	x.CPUMsPerGB = bench.CPUMsPerGB(t.cpu, t.bytes)
	if len(t.gbps) > 1 {
		x.RoundGBps = slices.Clone(t.gbps)
	}
	if len(t.gbps) > 1 && len(t.gbps) == len(ceilingRounds) {
		for i, g := range t.gbps {
			f := 0.0 // a round whose ceiling moved no bytes has no fraction
			if ceilingRounds[i] > 0 {
				f = g / ceilingRounds[i]
			}
			x.RoundFractions = append(x.RoundFractions, f)
		}
	}
	return x
}

// settle waits, where the mount makes spares ahead of stores, until the
// engine has made them and the GPU path has registered every file offered
// to it: what an idle moment before a burst lets a daemon do. Nothing
// else runs meanwhile, so no timed phase or ceiling pays for that work.
// Without preallocation it returns at once: the registrar's work then
// overlaps the phases, as it does in a daemon under load.
func (r *benchRun) settle(ctx context.Context, eng *engine.Engine, gp *kvdaemon.GPU) error {
	if r.ahead <= 0 {
		return nil
	}
	if err := eng.WaitSpares(ctx); err != nil {
		return fmt.Errorf("wait for the spare files made ahead: %w", err)
	}
	return awaitRegistrar(ctx, gp)
}

// awaitRegistrar waits until the GPU path's registrar has taken every
// file offered to it (none queued); at once without one.
func awaitRegistrar(ctx context.Context, gp *kvdaemon.GPU) error {
	// The registrar has no completion signal to wait on: its queue is
	// read every millisecond, a negligible cost beside registrations of
	// milliseconds each.
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for fileStats(gp).Queued > 0 {
		select {
		case <-tick.C:
		case <-ctx.Done():
			return fmt.Errorf("wait for the GPU path's registrations: %w", ctx.Err())
		}
	}
	return nil
}

// fileStats is what the GPU staging mover's registered files have done
// so far (jobs moved directly, the registrar's waits); zero without one.
func fileStats(gp *kvdaemon.GPU) gpu.FileStats {
	if gp == nil || gp.Staging() == nil {
		return gpu.FileStats{}
	}
	return gp.Staging().FileStats()
}

// phase stores (loads) every key with jobs concurrent jobs of keysPerJob
// keys and checks every key's outcome: stored (present after a warm-up
// is refused), loaded for hits, missing for misses. It returns the wall
// time and each job's completion time.
func (r *benchRun) phase(ctx context.Context, eng *engine.Engine, c *benchCache, dir string, jobs int) (time.Duration, []time.Duration, error) {
	n := len(c.keys)
	per := r.o.keysPerJob
	batches := (n + per - 1) / per
	lat := make([]time.Duration, batches)
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, jobs)
	start := time.Now()
	for j := range jobs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				b := int(next.Add(1) - 1)
				if b >= batches {
					return
				}
				lo, hi := b*per, min(n, (b+1)*per)
				var keys [][]byte
				var blocks [][]int
				for i := lo; i < hi; i++ {
					if dir == bench.Store {
						keys, blocks = append(keys, c.keys[i]), append(blocks, c.layout.Src[i])
					} else {
						k := c.keys[i]
						if !bench.Hit(i, r.o.hitRatio) {
							k = c.misses[i]
						}
						keys, blocks = append(keys, k), append(blocks, c.layout.Dst[i])
					}
				}
				var job *engine.Job
				var err error
				if dir == bench.Store {
					job, err = eng.Store(ctx, engine.StoreRequest{Cache: c.cache, Keys: keys, Blocks: blocks})
				} else {
					job, err = eng.Load(ctx, engine.LoadRequest{Cache: c.cache, Keys: keys, Blocks: blocks})
				}
				var res engine.Result
				if err == nil {
					res, err = job.Wait(ctx)
				}
				if err == nil {
					err = checkOutcomes(res, dir, lo, r.o.hitRatio)
				}
				if err != nil {
					errs[j] = fmt.Errorf("%s of keys %d..%d: %w", dir, lo, hi-1, err)
					next.Store(int64(batches)) // stop the others
					return
				}
				lat[b] = res.Duration
				r.prog.Step(hi - lo)
			}
		}()
	}
	wg.Wait()
	d := time.Since(start)
	return d, lat, errors.Join(errs...)
}

// checkOutcomes fails a job whose keys did not end as the benchmark
// expects: a benchmark never reports a run that lost or refused keys.
func checkOutcomes(res engine.Result, dir string, first int, hitRatio float64) error {
	for i, k := range res.Keys {
		want := engine.OutcomeStored
		if dir == bench.Load {
			want = engine.OutcomeLoaded
			if !bench.Hit(first+i, hitRatio) {
				want = engine.OutcomeMissing
			}
		}
		if k.Outcome != want {
			return fmt.Errorf("key %d: %s, want %s: %w", first+i, k.Outcome, want, errors.Join(k.Err, res.Err()))
		}
	}
	return nil
}

// deleteAll removes every stored key of the cache's namespace.
func (r *benchRun) deleteAll(ctx context.Context, eng *engine.Engine, c *benchCache) error {
	if _, err := eng.Delete(ctx, c.ns, c.keys); err != nil {
		return fmt.Errorf("delete: %w", err)
	}
	return nil
}

// moverName says what moved GPU bytes: cuFile when it registered files
// during the run, else the staging pipeline; host memory moves through the
// CPU staging pipeline.
func (r *benchRun) moverName(gp *kvdaemon.GPU) string {
	if gp == nil {
		return "staging"
	}
	if gp.CuFile() != nil && gp.CuFile().HandleStats().Registrations > 0 {
		return "cufile"
	}
	return "gpu-staging"
}

// engineFiles lists the payload files under dir: regular files at least a
// key long.
func engineFiles(dir string, keyBytes int64) ([]string, error) {
	var out []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() || strings.HasPrefix(d.Name(), ".") {
			return err // temporary and spare files are no key's
		}
		if fi, err := d.Info(); err == nil && fi.Size() >= keyBytes {
			out = append(out, p)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list files: %w", err)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("list files: no payload file under %s", dir)
	}
	return out, nil
}

// sizeOf prints a size in binary units with up to three significant
// digits ("32 MiB", "1.5 GiB", "0 B").
func sizeOf(n int64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB", "PiB"}
	v, u := float64(n), 0
	for v >= 1024 && u < len(units)-1 {
		v /= 1024
		u++
	}
	return strconv.FormatFloat(v, 'g', 3, 64) + " " + units[u]
}

// withoutMessage is a log handler that drops the records of one message:
// the engines of --foreign share the directory by design, and the
// warning Open logs for engines that share one (engine.SharedDirectoryWarning)
// would only be noise in a benchmark's output.
type withoutMessage struct {
	slog.Handler
	msg string
}

// Handle passes on every record but those of h.msg.
func (h withoutMessage) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == h.msg {
		return nil
	}
	return h.Handler.Handle(ctx, r)
}

// WithAttrs keeps dropping h.msg.
func (h withoutMessage) WithAttrs(as []slog.Attr) slog.Handler {
	return withoutMessage{h.Handler.WithAttrs(as), h.msg}
}

// WithGroup keeps dropping h.msg.
func (h withoutMessage) WithGroup(name string) slog.Handler {
	return withoutMessage{h.Handler.WithGroup(name), h.msg}
}
