package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/gds"
	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/server/cudaipc"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/staging/gpu"
	"github.com/kvhost/kvhost/transfer"
)

// GPUOptions configure the daemon's GPU data paths ([gpu] in the TOML file).
type GPUOptions struct {
	// Mode is "auto" (use a GPU when the CUDA runtime loads), "off", or
	// "on" (fail start-up without one).
	Mode string
	// CUDALibrary, CUDADriver and CuFileLibrary override the library
	// search paths of libcudart, libcuda and libcufile.
	CUDALibrary, CUDADriver, CuFileLibrary []string
	// CuFile is "auto" (cuFile on mounts where it has a direct path),
	// "off", or "compat" (also where cuFile runs in compatibility mode).
	CuFile string
	// MaxStaging bounds the pinned host memory of the staging pipeline.
	MaxStaging int64
	// NoChecksum turns payload checksums off on the staging pipeline.
	NoChecksum bool
	// SumsOnDevice is gpu.checksum_on = "gpu": the staging pipeline's
	// checksums computed by the checksum kernel on the GPU.
	SumsOnDevice bool
	// Depth and Chunk tune the staging pipeline (0: its defaults).
	Depth int
	Chunk int
	// Copy is gpu.copy: auto, kernel, batch or segments.
	Copy string
	// Poll is gpu.poll: how long a job polls for its copies before it
	// sleeps on them; 0 sleeps at once (config.Default has the default).
	Poll time.Duration
	// RegisterFiles is gpu.register_files: the most memory-mount files
	// kept mapped and registered with CUDA.
	RegisterFiles int
	// RegisterBytes is gpu.register_bytes resolved: the most bytes of
	// those files (0 in the configuration: half of the machine's memory).
	RegisterBytes int64
	// IdleRegistrars is gpu.idle_registrars: threads that register those
	// files only while no staging job runs.
	IdleRegistrars int
	// YieldBytes is engine.yield_bytes: a staging job gives its CPU up
	// after every YieldBytes it copied or checksummed.
	YieldBytes int64
}

// GPUOptionsOf is the GPU options the configuration sets: the daemon's,
// and the benchmark's before it sets the mode, the cuFile setting and
// checksums of the path it measures.
func GPUOptionsOf(cfg config.Config) GPUOptions {
	c := cfg.GPU
	return GPUOptions{
		Mode:           c.Mode,
		CUDALibrary:    nonEmpty(c.CUDALibrary),
		CUDADriver:     nonEmpty(c.CUDADriverLibrary),
		CuFileLibrary:  nonEmpty(c.CuFileLibrary),
		CuFile:         c.CuFile,
		MaxStaging:     int64(c.StagingMemory),
		Depth:          c.Depth,
		Chunk:          int(c.Chunk),
		Copy:           c.Copy,
		SumsOnDevice:   c.ChecksumOn == "gpu",
		Poll:           time.Duration(c.Poll),
		RegisterFiles:  c.RegisterFiles,
		RegisterBytes:  registerBytes(int64(c.RegisterBytes)),
		IdleRegistrars: c.IdleRegistrars,
		YieldBytes:     int64(cfg.Engine.YieldBytes),
	}
}

// GPU is what the daemon opened for GPU memory: the CUDA runtime, the
// pinned staging pipeline, and cuFile where it loads.
type GPU struct {
	log     *slog.Logger
	rt      *cuda.Runtime
	devices int
	staging *gpu.Mover
	cufile  *gds.Driver // nil: cuFile unavailable or off
	cfMover *gds.Mover
	ipc     *cudaipc.Importer // imports clients' GPU memory (CUDA IPC)
	opts    GPUOptions
	// reprobe is how long, at least, a mount whose cuFile probe failed
	// for a passing reason waits before a job probes it again
	// (cufileReprobe); now is the clock it is measured on.
	reprobe time.Duration
	now     func() time.Time
}

// cufileReprobe is GPU.reprobe.
const cufileReprobe = time.Minute

// OpenGPU opens the GPU paths, or returns nil (and no error) when the mode
// is auto and no CUDA runtime or device is found: the daemon then serves
// host memory only and refuses GPU registrations.
func OpenGPU(opts GPUOptions, log *slog.Logger) (*GPU, error) {
	if opts.Mode == "off" {
		log.Info("GPU paths off by configuration")
		return nil, nil
	}
	required := opts.Mode == "on"
	rt, err := cuda.Open(cuda.Config{Runtime: opts.CUDALibrary, Driver: opts.CUDADriver})
	if err != nil {
		if required {
			return nil, fmt.Errorf("gpu: %w", err)
		}
		log.Info("no CUDA runtime: serving host memory only", "reason", err.Error())
		return nil, nil
	}
	n, err := rt.DeviceCount()
	if err == nil && n == 0 {
		err = errors.New("no CUDA device")
	}
	if err != nil {
		rt.Close()
		if required {
			return nil, fmt.Errorf("gpu: %w", err)
		}
		log.Info("no usable CUDA device: serving host memory only", "reason", err.Error())
		return nil, nil
	}
	p := &GPU{log: log, rt: rt, devices: n, opts: opts, reprobe: cufileReprobe, now: time.Now}
	if err := p.openMovers(); err != nil {
		rt.Close()
		return nil, err
	}
	if p.ipc, err = cudaipc.New(rt, n); err != nil {
		p.closeMovers()
		rt.Close()
		return nil, fmt.Errorf("gpu: %w", err)
	}
	log.Info("GPU paths ready", "devices", n, "cuda_runtime", rt.Path(), "cuda_version", rt.Version(),
		"copy", p.staging.CopyMode().String(), "checksum_on", p.staging.ChecksumOn(), "batched_copies", rt.HasBatch(), "pinned_staging_bytes", p.staging.PinnedBytes(),
		"poll", p.staging.PollTime(), "register_files", p.staging.FileStats().Limit, "register_bytes", p.staging.FileStats().LimitBytes)
	return p, nil
}

// openMovers opens the staging pipeline and, unless gpu.cufile is off,
// the cuFile mover where the library loads, on p's runtime.
func (p *GPU) openMovers() error {
	opts, log := p.opts, p.log
	mode, err := cuda.ParseCopyMode(opts.Copy)
	if err != nil {
		return fmt.Errorf("gpu: %w", err)
	}
	poll := opts.Poll
	if poll == 0 {
		poll = gpu.NoPoll // gpu.poll = "0s"; gpu.Config's zero is its default
	}
	p.staging, err = gpu.New(gpu.Config{Runtime: p.rt, MaxStaging: opts.MaxStaging, NoChecksums: opts.NoChecksum, SumsOnDevice: opts.SumsOnDevice, Depth: opts.Depth, Chunk: opts.Chunk, Copy: mode, Poll: poll,
		RegisterFiles: opts.RegisterFiles, RegisterBytes: opts.RegisterBytes, IdleRegistrars: opts.IdleRegistrars, Log: log, YieldBytes: opts.YieldBytes})
	if err != nil {
		return fmt.Errorf("gpu: staging pipeline: %w", err)
	}
	if opts.CuFile == "off" {
		return nil
	}
	d, err := gds.Open(gds.Config{LibraryPaths: opts.CuFileLibrary, Logger: log, BindDevice: p.rt.SetDevice})
	if err != nil {
		log.Info("cuFile unavailable: GPU memory moves through the staging pipeline", "reason", err.Error())
		return nil
	}
	mv, err := d.NewMover(gds.MoverConfig{AllowCompat: opts.CuFile == "compat"})
	if err != nil {
		d.Close()
		log.Warn("cuFile mover unavailable: GPU memory moves through the staging pipeline", "reason", err.Error())
		return nil
	}
	p.cufile, p.cfMover = d, mv
	pr := d.Properties()
	log.Info("cuFile loaded", "library", pr.Library, "version", pr.Version, "nvidia_fs", pr.NVFSLoaded, "compat_allowed", pr.CompatAllowed)
	return nil
}

// closeMovers closes what openMovers opened.
func (p *GPU) closeMovers() error {
	err := p.closeCuFile()
	if p.staging != nil {
		err = errors.Join(err, p.staging.Close())
		p.staging = nil
	}
	return err
}

// closeCuFile closes the cuFile mover and library, if open.
func (p *GPU) closeCuFile() error {
	var errs []error
	if p.cfMover != nil {
		errs = append(errs, p.cfMover.Close())
	}
	if p.cufile != nil {
		errs = append(errs, p.cufile.Close())
	}
	p.cfMover, p.cufile = nil, nil
	return errors.Join(errs...)
}

// RestartMovers closes the movers and opens new ones on the same runtime,
// as a restarted daemon has them: no registered file, no cached cuFile
// handle, no pinned buffer of the old ones. The runtime, and the GPU
// memory allocated with it, stay (they are the client's, which outlives a
// daemon's restart). Engines must not move bytes meanwhile; an engine
// opened after it takes the new movers.
func (p *GPU) RestartMovers() error {
	if err := p.closeMovers(); err != nil {
		return err
	}
	return p.openMovers()
}

// Movers returns the engine's mover factory for device memory: per mount,
// cuFile first where the mount gives it a usable path, then the staging
// pipeline. The choice is made once per mount and logged with its reason.
func (p *GPU) Movers() map[region.Kind]engine.MoverFactory {
	return map[region.Kind]engine.MoverFactory{
		region.KindDevice: func(m engine.MountInfo) (transfer.Mover, error) {
			if p.cfMover == nil {
				return p.staging, nil
			}
			c, err := p.cufile.ProbeDir(m.Path)
			if err != nil {
				// A passing failure: ProbeDir cached nothing, and a
				// later job probes again (reprobing).
				p.log.Info("mount serves GPU memory through the staging pipeline until cuFile's probe of it works", "mount", m.Path,
					"cufile", err.Error(), "probe_again_after", p.reprobe.String())
				r := &reprobing{p: p, mount: m.Path, next: p.now().Add(p.reprobe), reason: err.Error(), probes: 1}
				return transfer.NewChain(m.Path, p.log, r, p.staging)
			}
			if !p.cufileServes(c) {
				p.log.Info("mount serves GPU memory through the staging pipeline", "mount", m.Path, "cufile", c.String())
				return p.staging, nil
			}
			p.log.Info("mount serves GPU memory with cuFile", "mount", m.Path, "cufile", c.String())
			return transfer.NewChain(m.Path, p.log, p.cfMover, p.staging)
		},
	}
}

// cufileServes says whether the cuFile mover serves a mount of
// capability c: direct, or compat where gpu.cufile = "compat".
func (p *GPU) cufileServes(c gds.Capability) bool {
	return c.Mode == gds.ModeDirect || c.Mode == gds.ModeCompat && p.opts.CuFile == "compat"
}

// reprobing is the cuFile step of the chain of a mount whose cuFile probe
// failed at start for a passing reason (gds.Driver.ProbeDir cached
// nothing: cuFile out of memory or descriptors, an internal error).
// Until a probe settles the mount it answers transfer.ErrUnsupported, so
// that the staging pipeline, next in the chain, moves the job and the
// chain counts the fallback; the first job at least GPU.reprobe
// after the last probe probes again, and the probes are counted (in the
// logs). Once a probe finds that cuFile serves the mount, every job goes
// to the cuFile mover; once one finds that it does not, every job is
// passed on with that reason and nothing is probed again. Its Name and
// Checksums are the cuFile mover's, so the chain is the one a mount
// whose first probe worked gets: files stored from GPU memory on it
// carry no payload checksums, even while the staging pipeline moves them.
type reprobing struct {
	p      *GPU
	mount  string
	serves atomic.Bool // a probe found that cuFile serves the mount: no more probes, no lock

	mu      sync.Mutex
	next    time.Time // when a job may probe again
	probing bool      // a job is probing now
	probes  int       // probes made, the first (at start) included
	settled bool      // a probe said what cuFile does on the mount
	reason  string    // why jobs are passed on: the last probe's error or capability
}

var _ transfer.Forgetter = (*reprobing)(nil)

// Name is the cuFile mover's.
func (r *reprobing) Name() string { return r.p.cfMover.Name() }

// Checksums is the cuFile mover's: false.
func (r *reprobing) Checksums() bool { return r.p.cfMover.Checksums() }

// Forget forwards to the cuFile mover, which may hold the file's handle.
func (r *reprobing) Forget(id fsys.FileID) { r.p.cfMover.Forget(id) }

// WriteFile writes through the cuFile mover once a probe found that it
// serves the mount.
func (r *reprobing) WriteFile(ctx context.Context, f fsys.File, p *transfer.Plan, sums []uint32) (int64, error) {
	if err := r.ready(); err != nil {
		return 0, err
	}
	return r.p.cfMover.WriteFile(ctx, f, p, sums)
}

// ReadFile reads through the cuFile mover once a probe found that it
// serves the mount.
func (r *reprobing) ReadFile(ctx context.Context, f fsys.File, p *transfer.Plan, sums []uint32) (int64, error) {
	if err := r.ready(); err != nil {
		return 0, err
	}
	return r.p.cfMover.ReadFile(ctx, f, p, sums)
}

// ready answers nil if the cuFile mover serves the mount, probing it if
// a probe is due and none runs, and transfer.ErrUnsupported with the
// reason otherwise.
func (r *reprobing) ready() error {
	if r.serves.Load() {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.serves.Load() {
		return nil
	}
	if r.settled || r.probing || r.p.now().Before(r.next) {
		return fmt.Errorf("%w: cufile: mount %s: %s", transfer.ErrUnsupported, r.mount, r.reason)
	}
	r.probing = true
	r.probes++
	r.mu.Unlock()
	c, err := r.p.cufile.ProbeDir(r.mount)
	r.mu.Lock()
	r.probing = false
	r.next = r.p.now().Add(r.p.reprobe)
	if err != nil {
		r.reason = err.Error()
		r.p.log.Info("cuFile's probe of the mount failed again: GPU memory moves through the staging pipeline", "mount", r.mount,
			"cufile", r.reason, "probes", r.probes, "probe_again_after", r.p.reprobe.String())
		return fmt.Errorf("%w: cufile: mount %s: %w", transfer.ErrUnsupported, r.mount, err)
	}
	serves := r.p.cufileServes(c)
	r.settled, r.reason = true, c.String()
	if !serves {
		r.p.log.Info("mount serves GPU memory through the staging pipeline", "mount", r.mount, "cufile", r.reason, "probes", r.probes)
		return fmt.Errorf("%w: cufile: mount %s: %s", transfer.ErrUnsupported, r.mount, r.reason)
	}
	r.serves.Store(true)
	r.p.log.Info("mount serves GPU memory with cuFile", "mount", r.mount, "cufile", r.reason, "probes", r.probes)
	return nil
}

// Runtime is the CUDA runtime the paths run on (the benchmark allocates
// device memory and pinned buffers with it).
func (p *GPU) Runtime() *cuda.Runtime { return p.rt }

// Staging is the pinned staging pipeline, the mover of every mount where
// cuFile serves none.
func (p *GPU) Staging() *gpu.Mover { return p.staging }

// CuFile is the cuFile library, nil where it did not load or gpu.cufile
// is off.
func (p *GPU) CuFile() *gds.Driver { return p.cufile }

// Options are the options p was opened with.
func (p *GPU) Options() GPUOptions { return p.opts }

// Close releases the GPU paths.
func (p *GPU) Close() error {
	// cuFile's buffer registrations go before the imports of the memory
	// they name; the staging pipeline after them, as before.
	cf := p.closeCuFile()
	ipc := p.ipc.Close()
	return errors.Join(cf, ipc, p.closeMovers(), p.rt.Close())
}

// deviceFaults reports, per device ordinal, what failed there with a
// sticky CUDA error: the staging pipeline's jobs, the cuFile mover's
// where it runs, and the CUDA IPC registrations (a device that broke
// while idle is found by the next registration).
func (p *GPU) deviceFaults() map[int]uint64 {
	out := p.staging.DeviceFaults()
	add := func(counts map[int]uint64) {
		for d, n := range counts {
			out[d] += n
		}
	}
	add(p.ipc.Faults())
	if p.cfMover != nil {
		add(p.cfMover.DeviceFaults())
	}
	return out
}

// deviceUUIDs are the UUIDs of devices 0..n-1 (server.Config.DeviceUUIDs),
// zero where the driver cannot say; that is logged once.
func (p *GPU) deviceUUIDs(n int) [][16]byte {
	out := make([][16]byte, n)
	for d := range out {
		u, err := p.rt.DeviceUUID(d)
		if err != nil {
			p.log.Info("GPU UUIDs unknown: clients find their device by index", "reason", err.Error())
			return nil
		}
		out[d] = u
	}
	return out
}

// registerBytes is gpu.register_bytes, or half of the machine's memory
// where it is 0 (and no bound where the kernel does not say).
func registerBytes(configured int64) int64 {
	if configured > 0 {
		return configured
	}
	return engine.MachineMemory() / 2
}

// nonEmpty is []string{s}, or nil when s is empty (the default search
// paths).
func nonEmpty(s string) []string {
	if s == "" {
		return nil
	}
	return []string{s}
}
