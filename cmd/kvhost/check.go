package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/gds"
	"github.com/kvhost/kvhost/internal/bench"
	"github.com/kvhost/kvhost/internal/config"
	kvdaemon "github.com/kvhost/kvhost/internal/daemon"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/fstype"
	"github.com/kvhost/kvhost/internal/server"
)

// Levels of a check line.
const (
	levelOK   = "OK"
	levelInfo = "INFO"
	levelWarn = "WARN"
	levelFail = "FAIL"
)

// checkSchema is the JSON document's schema name.
const checkSchema = "kvhost-check/1"

// checkItem is one finding of `kvhost check`.
type checkItem struct {
	Level string `json:"level"` // OK, INFO, WARN or FAIL
	Area  string `json:"area"`  // gpu, cufile, or the mount's path
	What  string `json:"what"`  // the finding
	Fix   string `json:"fix,omitempty"`
}

// speedResult is one sequential transfer measured by --speed.
type speedResult struct {
	Mount string  `json:"mount"`
	Test  string  `json:"test"` // "write O_DIRECT + fsync", "read buffered (cold)", ...
	Bytes int64   `json:"bytes"`
	GBps  float64 `json:"gbps"`
}

// checkReport is the whole of `kvhost check --json`.
type checkReport struct {
	Schema  string        `json:"schema"`
	Version string        `json:"version"`
	Items   []checkItem   `json:"items"`
	Speed   []speedResult `json:"speed"`
	OK      int           `json:"ok"`
	Warn    int           `json:"warnings"`
	Fail    int           `json:"failures"`
}

func (r *checkReport) add(level, area, what, fix string) {
	r.Items = append(r.Items, checkItem{level, area, what, fix})
	switch level {
	case levelOK:
		r.OK++
	case levelWarn:
		r.Warn++
	case levelFail:
		r.Fail++
	}
}

// checkOptions are `kvhost check`'s settings.
type checkOptions struct {
	cfg       config.Config
	file      string // the file cfg was read from ("": none)
	dirs      []string
	speed     bool
	speedSize int64
	speedTime time.Duration
	// statfs is statfs(2) for the mounts' file systems; nil is
	// unix.Statfs (tests give another file system's answer).
	statfs func(path string, st *unix.Statfs_t) error
	// mountWait is how long a statfs of path (a mount's directory, or
	// the one above it) may go unanswered before the mount FAILs as hung;
	// nil, or 0 for path: cfg's server.statfs_timeout. A function of the
	// path, so that a test bounds the statfs it holds by a millisecond and
	// every other by a hang guard: a millisecond's bound on a statfs that
	// answers fails it wherever the machine is slow to run its goroutine.
	mountWait func(path string) time.Duration
	// access is access(2) for the mounts' directories; nil is
	// unix.Access (tests give a read-only file system's answer).
	access func(path string, mode uint32) error
}

// runCheck is `kvhost check`: diagnostics of the GPU, cuFile and every
// mount, printed as OK / INFO / WARN / FAIL lines with a fix for each
// problem. It exits 1 when something FAILs.
func runCheck(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("kvhost check", "usage: kvhost check [--config FILE] [--dir DIR]... [--speed] [--json]\n\nDiagnoses the GPU, cuFile and the mounts (docs/bench.md).", stderr)
	var (
		o                           checkOptions
		cfgPath, cudaLib, cufileLib string
		speedSize                   string
		asJSON                      bool
	)
	fs.StringVar(&cfgPath, "config", "", "kvhost configuration file (its mounts and [gpu] settings are checked)")
	fs.Func("dir", "a directory to check as a mount (repeatable; replaces the configuration's mounts)", func(s string) error {
		o.dirs = append(o.dirs, s)
		return nil
	})
	fs.BoolVar(&o.speed, "speed", false, "measure sequential write and read on every mount (O_DIRECT and buffered)")
	fs.StringVar(&speedSize, "speed-size", "256MiB", "bytes written and read by each --speed test")
	fs.DurationVar(&o.speedTime, "speed-time", 5*time.Second, "most time each --speed test takes")
	fs.BoolVar(&asJSON, "json", false, "print the findings as JSON")
	fs.StringVar(&cudaLib, "cuda-library", "", "path of libcudart (default: the configuration's, else the usual places)")
	fs.StringVar(&cufileLib, "cufile-library", "", "path of libcufile (default: the configuration's, else the usual places)")
	if code, ok := parseFlagsOnly(fs, args, stdout, stderr); !ok {
		return code
	}
	o.cfg = config.Default()
	if cfgPath != "" {
		c, err := config.Load(cfgPath)
		if err != nil {
			fmt.Fprintf(stderr, "kvhost check: %v\n", err)
			return 2
		}
		o.cfg, o.file = c, cfgPath
	}
	if cudaLib != "" {
		o.cfg.GPU.CUDALibrary = cudaLib
	}
	if cufileLib != "" {
		o.cfg.GPU.CuFileLibrary = cufileLib
	}
	sz, err := config.ParseSize(speedSize)
	if err != nil || sz < bench.Align {
		fmt.Fprintf(stderr, "kvhost check: --speed-size %q: want a size of at least 4KiB (\"256MiB\")\n", speedSize)
		return 2
	}
	o.speedSize = bench.RoundUp(int64(sz))
	rep := doCheck(ctx, o)
	if asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			fmt.Fprintf(stderr, "kvhost check: %v\n", err)
			return 1
		}
	} else {
		writeCheck(stdout, rep)
	}
	if rep.Fail > 0 {
		return 1
	}
	return 0
}

// writeCheck prints the findings, one line each, a fix under each problem.
func writeCheck(w io.Writer, rep *checkReport) {
	for _, it := range rep.Items {
		fmt.Fprintf(w, "%-4s  %-8s  %s\n", it.Level, it.Area, it.What)
		if it.Fix != "" {
			fmt.Fprintf(w, "      %-8s  fix: %s\n", "", it.Fix)
		}
	}
	for _, s := range rep.Speed {
		fmt.Fprintf(w, "%-4s  %-8s  speed: %s, %s: %.2f GB/s\n", levelInfo, s.Mount, s.Test, sizeOf(s.Bytes), s.GBps)
	}
	fmt.Fprintf(w, "kvhost check: %d ok, %s, %s\n", rep.OK, counted(rep.Warn, "warning"), counted(rep.Fail, "failure"))
}

// counted is n and what it counts, plural but for one: "1 warning",
// "0 failures".
func counted(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

// doCheck runs every check. CUDA's current device and cuFile's state are
// per OS thread: the checks run on a goroutine locked to a thread of its
// own, with device 0 current, which is never unlocked and so ends with the
// goroutine (cuda/worker.go's rule); the caller's thread is not
// touched.
func doCheck(ctx context.Context, o checkOptions) *checkReport {
	done := make(chan *checkReport, 1)
	go func() {
		runtime.LockOSThread()
		done <- checkOnThread(ctx, o)
	}()
	return <-done
}

// checkOnThread is doCheck on its locked thread.
func checkOnThread(ctx context.Context, o checkOptions) *checkReport {
	rep := &checkReport{Schema: checkSchema, Version: versionString(), Items: []checkItem{}, Speed: []speedResult{}}
	rt := checkGPU(rep, o.cfg.GPU)
	var drv *gds.Driver
	if rt != nil {
		defer rt.Close()
	}
	drv = checkCuFile(rep, o.cfg.GPU, rt)
	if drv != nil {
		defer drv.Close()
	}
	mounts := o.cfg.Mounts
	if len(o.dirs) > 0 {
		mounts = nil
		for _, d := range o.dirs {
			mounts = append(mounts, config.Mount{Path: d})
		}
	}
	hung := map[int]bool{} // by index in mounts: statfs did not answer
	var answering []config.Mount
	for i, m := range mounts {
		if !checkMount(ctx, rep, o, m, drv) {
			// Every later look at it (a listing, a stat, a statfs)
			// would hang too.
			hung[i] = true
			continue
		}
		checkVLLMAdoption(rep, m)
		answering = append(answering, m)
	}
	checkDisjointMounts(rep, answering)
	checkPolicyMounts(ctx, rep, o.cfg, o.file, mounts, func(i int) bool { return !hung[i] && o.onMemoryFS(ctx, mounts[i].Path) })
	checkObjects(ctx, rep, o.cfg.Objects)
	if g := o.cfg.Server.SocketGroup; g != "" {
		if _, err := server.LookupGroup(g); err != nil {
			rep.add(levelFail, "server", fmt.Sprintf("server.socket_group %q: no such group on this machine (%v): the daemon would not start", g, errors.Unwrap(err)),
				"create the group (groupadd), or set socket_group to a group this machine has, or to its numeric id")
		} else {
			rep.add(levelOK, "server", fmt.Sprintf("server.socket_group %q exists", g), "")
		}
	}
	return rep
}

// checkObjects opens the object mount as the daemon would (docs/object.md)
// and reports the bucket it reached, with the keys a listing found there,
// or why it could not: the daemon would not start.
func checkObjects(ctx context.Context, rep *checkReport, o config.Objects) {
	if o.Endpoint == "" {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Duration(o.RequestTimeout)+5*time.Second)
	defer cancel()
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	st, err := kvdaemon.OpenObjects(ctx, o, quiet)
	if err != nil {
		rep.add(levelFail, "objects", fmt.Sprintf("%v: the daemon would not start", err),
			"check objects.endpoint and objects.bucket, and the keys (objects.access_key or $KVHOST_S3_ACCESS_KEY, objects.secret_key_file or $KVHOST_S3_SECRET_KEY)")
		return
	}
	defer st.Close()
	rep.add(levelOK, "objects", fmt.Sprintf("bucket %s at %s: %d keys under prefix %q", o.Bucket, o.Endpoint, st.Stats().Objects, o.Prefix), "")
}

// checkGPU reports the CUDA runtime, the driver and the devices; it
// returns the runtime when one loaded with at least one device.
func checkGPU(rep *checkReport, g config.GPU) *cuda.Runtime {
	if g.Mode == "off" {
		rep.add(levelInfo, "gpu", "GPU paths off by configuration (gpu.mode = off): kvhost serves host memory only", "")
		return nil
	}
	if !gpuBuild {
		// Installing CUDA would change nothing: the binary cannot load it.
		level := levelWarn
		if g.Mode == "on" {
			level = levelFail
		}
		rep.add(level, "gpu", "this kvhost is "+cpuOnlyNote,
			"rebuild with cgo for GPU memory: a C compiler (Debian: apt install gcc) and CGO_ENABLED=1 make build")
		return nil
	}
	missing := levelWarn
	if g.Mode == "on" {
		missing = levelFail // the daemon would not start
	}
	rt, err := cuda.Open(cuda.Config{Runtime: nonEmpty(g.CUDALibrary), Driver: nonEmpty(g.CUDADriverLibrary)})
	if err != nil {
		rep.add(missing, "gpu", fmt.Sprintf("no CUDA runtime: %s; kvhost serves host memory only", loadError(err, nonEmpty(g.CUDALibrary), cuda.DefaultRuntimePaths())),
			"install the NVIDIA driver and the CUDA runtime (libcudart.so.12 or .13), or set gpu.cuda_library; gpu.mode = off silences this")
		return nil
	}
	v := rt.Version()
	rep.add(levelOK, "gpu", fmt.Sprintf("CUDA runtime %s, version %d.%d; batched copies %s, driver API %s",
		rt.Path(), v/1000, v%1000/10, yesNo(rt.HasBatch()), yesNo(rt.HasDriver())), "")
	if !rt.HasDriver() {
		rep.add(levelWarn, "gpu", "no CUDA driver API (libcuda.so.1): the daemon cannot check a CUDA IPC range against its allocation, so it refuses GPU memory registrations",
			"make the NVIDIA driver's libcuda.so.1 visible to the daemon (on the library path; in a container, as the NVIDIA container toolkit mounts it), or set gpu.cuda_driver_library")
	}
	if b, err := os.ReadFile("/proc/driver/nvidia/version"); err == nil {
		line, _, _ := strings.Cut(string(b), "\n")
		rep.add(levelInfo, "gpu", "driver: "+strings.Join(strings.Fields(line), " "), "")
	}
	n, err := rt.DeviceCount()
	if err == nil && n == 0 {
		err = errors.New("no CUDA device")
	}
	if err != nil {
		rep.add(missing, "gpu", fmt.Sprintf("no usable device: %v; kvhost serves host memory only", err),
			"check nvidia-smi, the container's device access (--gpus, CUDA_VISIBLE_DEVICES) and the driver version")
		rt.Close()
		return nil
	}
	for d := range n {
		bus, err := rt.PCIBusID(d)
		if err != nil {
			rep.add(levelWarn, "gpu", fmt.Sprintf("device %d: no PCI address: %v", d, err), "")
			continue
		}
		name := nvidiaModel(bus)
		if name == "" {
			name = "(model name not reported)"
		}
		rep.add(levelOK, "gpu", fmt.Sprintf("device %d: %s at %s", d, name, bus), "")
	}
	return rt
}

// checkCuFile reports libcufile, nvidia-fs and the mode cuFile runs in; it
// returns the driver when it opened.
func checkCuFile(rep *checkReport, g config.GPU, rt *cuda.Runtime) *gds.Driver {
	if g.CuFile == "off" {
		rep.add(levelInfo, "cufile", "cuFile off by configuration (gpu.cufile = off)", "")
		return nil
	}
	cfg := gds.Config{LibraryPaths: nonEmpty(g.CuFileLibrary), Logger: slog.New(slog.DiscardHandler)}
	if rt != nil {
		cfg.BindDevice = rt.SetDevice
		if err := rt.SetDevice(0); err != nil {
			rep.add(levelWarn, "cufile", fmt.Sprintf("cannot make device 0 current: %v", err), "")
		}
	}
	if !gpuBuild {
		rep.add(levelInfo, "cufile", "cuFile unused: this build cannot load CUDA (built without cgo)", "")
		return nil
	}
	d, err := gds.Open(cfg)
	if err != nil {
		level := levelWarn
		if rt == nil {
			level = levelInfo // no GPU: cuFile would not be used anyway
		}
		rep.add(level, "cufile", fmt.Sprintf("cuFile unavailable: %s; GPU memory moves through kvhost's staging pipeline", loadError(err, nonEmpty(g.CuFileLibrary), gds.DefaultLibraryPaths())),
			"for GPUDirect Storage install libcufile (the CUDA toolkit's GDS package) and nvidia-fs, or set gpu.cufile_library")
		return nil
	}
	p := d.Properties()
	v := fmt.Sprintf("%d.%d", p.Version/1000, p.Version%1000/10)
	if p.Version%10 != 0 {
		v += fmt.Sprintf(".%d", p.Version%10)
	}
	rep.add(levelOK, "cufile", fmt.Sprintf("cuFile %s, version %s, batch API %s", p.Library, v, yesNo(p.BatchAPI)), "")
	if p.NVFSLoaded {
		rep.add(levelOK, "cufile", "nvidia-fs loaded "+p.NVFSVersion+": GPUDirect transfers possible on supporting file systems", "")
	} else {
		rep.add(levelWarn, "cufile", "nvidia-fs not loaded: no GPUDirect; cuFile can only run in compatibility mode (a host bounce)",
			"load the nvidia-fs kernel module (modprobe nvidia-fs, from the GDS packages) for direct GPU ↔ storage DMA")
	}
	rep.add(levelInfo, "cufile", fmt.Sprintf("compatibility mode allowed: %s (from %s); mode: %s; kvhost setting gpu.cufile = %s",
		yesNo(p.CompatAllowed), p.CompatSource, p.Mode(), g.CuFile), "")
	if p.Mode() == gds.ModeCompat && g.CuFile != "compat" {
		rep.add(levelInfo, "cufile", "in compatibility mode kvhost moves GPU memory through its own staging pipeline (gpu.cufile = compat uses cuFile's)", "")
	}
	return d
}

// checkDisjointMounts FAILs each pair of mounts of kvhost's layout that
// are one directory or one inside the other, which the daemon refuses at
// start (overlappingMounts).
func checkDisjointMounts(rep *checkReport, mounts []config.Mount) {
	for _, o := range overlappingMounts(mounts) {
		rep.add(levelFail, mounts[o.second].Path, fmt.Sprintf("overlaps the mount %s (one directory, or one inside the other, through any name): the daemon refuses to start", mounts[o.first].Path),
			"give each [[mount]] a directory of its own, none inside another")
	}
}

// mountOverlap is two mounts, by their index in the configuration, that
// the daemon refuses at start as one directory or one inside the other.
type mountOverlap struct {
	first, second int
	err           error // the daemon's error, wrapping engine.ErrInvalid
}

// overlappingMounts returns the pairs of mounts of kvhost's layout that
// the daemon's start refuses as one directory, or one inside the other.
// Two existing directories are compared as the engine compares them
// (engine.MountsDisjoint: by device and inode, through any name). A mount
// that does not exist yet, which the daemon makes at start, is compared
// by its path: the real path of its nearest existing ancestor, symbolic
// links resolved, and the directories the daemon would make below it. A
// path that exists but is no directory is not compared (the daemon
// refuses it anyway).
func overlappingMounts(mounts []config.Mount) []mountOverlap {
	type root struct {
		i      int
		exists bool
		real   string
	}
	var roots []root
	var out []mountOverlap
	for i, m := range mounts {
		if m.Layout == config.LayoutVLLMFS {
			continue
		}
		fi, err := os.Stat(m.Path)
		if err == nil && !fi.IsDir() {
			continue
		}
		r := root{i: i, exists: err == nil, real: realPath(m.Path)}
		for _, q := range roots {
			a, b := mounts[q.i].Path, m.Path
			if r.exists && q.exists {
				if err := engine.MountsDisjoint(a, b); errors.Is(err, engine.ErrInvalid) {
					out = append(out, mountOverlap{q.i, i, err})
				}
				continue
			}
			if within(r.real, q.real) || within(q.real, r.real) {
				out = append(out, mountOverlap{q.i, i, fmt.Errorf("%w: mounts %s and %s overlap (one directory, or one inside the other, once the daemon makes them at start)", engine.ErrInvalid, a, b)})
			}
		}
		roots = append(roots, r)
	}
	return out
}

// realPath is path with the symbolic links of its nearest existing
// ancestor resolved, the rest as given: where the directory is, or where
// the daemon would make it.
func realPath(path string) string {
	path = filepath.Clean(path)
	parent := existingParent(path)
	real, err := filepath.EvalSymlinks(parent)
	if err != nil {
		return path
	}
	rest, err := filepath.Rel(parent, path)
	if err != nil {
		return path
	}
	return filepath.Join(real, rest)
}

// within reports whether the clean path p is dir or lies inside it.
func within(p, dir string) bool {
	return p == dir || strings.HasPrefix(p, strings.TrimSuffix(dir, "/")+"/")
}

// checkVLLMAdoption judges a vllm-fs mount configured without the fs
// tier's fields, which the daemon's start serves by adopting the one base
// directory under its root whose config.json hashes to the directory's
// name: it FAILs where the start finds none (vLLM has not written it yet,
// or the root does not exist), several, or only some it cannot use, and
// says which one it adopts otherwise.
func checkVLLMAdoption(rep *checkReport, m config.Mount) {
	if m.Layout != config.LayoutVLLMFS || m.VLLMFS != nil && m.VLLMFS.Fields() != nil {
		return
	}
	name, err := engine.AdoptedBase(m.Path)
	if err != nil {
		rep.add(levelFail, m.Path, fmt.Sprintf("vllm-fs: %v: the daemon refuses to start", err),
			"start vLLM's fs tier on this root first, so that it writes its directory, or configure the fields of the one to serve in [mount.vllm_fs] (docs/vllm.md)")
		return
	}
	rep.add(levelOK, m.Path, "vllm-fs: the daemon adopts the base directory "+name, "")
}

// checkMount reports one mount: file system, space, O_DIRECT, cuFile
// registration, and with --speed sequential throughput. Its statfs comes
// first, bounded (o.mountWait): a mount whose file system does not answer
// it FAILs as hung, the daemon's start refusing it too (daemon.EngineMounts),
// and checkMount returns false; nothing else is asked of it, since every
// call would hang the same way.
func checkMount(ctx context.Context, rep *checkReport, o checkOptions, m config.Mount, drv *gds.Driver) (answered bool) {
	area := m.Path
	access := o.access
	if access == nil {
		access = unix.Access
	}
	st, statErr := o.statfsWithin(ctx, m.Path)
	if errors.Is(statErr, kvdaemon.ErrNoAnswer) {
		rep.add(levelFail, area, fmt.Sprintf("statfs: %v: the mount is hung, and the daemon's start fails", statErr),
			"check the file system's server and its client (mount, dmesg); remount it, or remove this [[mount]] until it answers")
		return false
	}
	fi, err := os.Stat(m.Path)
	switch {
	case errors.Is(err, os.ErrNotExist):
		// The daemon makes it at start (os.MkdirAll), in the nearest
		// directory above it that exists: where that one refuses, so
		// does the start.
		parent := existingParent(m.Path)
		switch err := access(parent, unix.W_OK|unix.X_OK); {
		case errors.Is(err, unix.EROFS):
			rep.add(levelFail, area, fmt.Sprintf("does not exist, and cannot be made in %s, on a read-only file system: the daemon's start fails", parent),
				"remount it read-write (mount -o remount,rw), or name a directory on a writable file system")
		case err != nil:
			rep.add(levelFail, area, fmt.Sprintf("does not exist, and cannot be made in %s, not writable by this user (%v): the daemon's start fails", parent, err),
				"create it (mkdir -p) and give it to the daemon's user (chown), or name a directory that user may make")
		default:
			pst, err := o.statfsWithin(ctx, parent)
			if errors.Is(err, kvdaemon.ErrNoAnswer) {
				// Where the start would make it: its mkdir would hang.
				rep.add(levelFail, area, fmt.Sprintf("does not exist, and %s, where kvhost would make it, is on a hung mount: statfs: %v: the daemon's start fails", parent, err),
					"check the file system's server and its client (mount, dmesg); remount it, or remove this [[mount]] until it answers")
				return false
			}
			fst := "unknown"
			if err == nil {
				fst = fstype.Name(int64(pst.Type))
				if k, _ := fstype.Of(int64(pst.Type)); k.Kernel {
					rep.add(levelFail, area, fmt.Sprintf("does not exist, and cannot be made in %s, on %s, a kernel interface, not a file system that keeps files: the daemon's start fails", parent, fst),
						kernelFSFix)
					return true
				}
			}
			rep.add(levelWarn, area, fmt.Sprintf("does not exist; kvhost creates it at start (in %s, %s)", parent, fst),
				"create it (mkdir -p) to check it fully")
		}
		return true
	case err != nil:
		rep.add(levelFail, area, fmt.Sprintf("cannot stat: %v", err), "check the path and the daemon's permissions")
		return true
	case !fi.IsDir():
		rep.add(levelFail, area, "is not a directory", "name a directory in [[mount]] path")
		return true
	}
	switch err := access(m.Path, unix.W_OK|unix.X_OK); {
	case errors.Is(err, unix.EROFS):
		// No owner or mode makes it writable: the daemon starts on it,
		// and every store there fails.
		rep.add(levelFail, area, "on a read-only file system: every store there fails",
			"remount it read-write (mount -o remount,rw), or name a directory on a writable file system")
		return true
	case err != nil:
		rep.add(levelFail, area, "not writable by this user", "give the daemon's user write access (chown, or run as the owner)")
		return true
	}
	if statErr != nil {
		rep.add(levelFail, area, fmt.Sprintf("statfs: %v", statErr), "")
		return true
	}
	magic := int64(st.Type)
	fst := fstype.Name(magic)
	kind, _ := fstype.Of(magic)
	size, avail := int64(st.Blocks)*int64(st.Bsize), int64(st.Bavail)*int64(st.Bsize)
	if size == 0 {
		rep.add(levelOK, area, fmt.Sprintf("file system %s, no size reported (statfs: 0 blocks)", fst), "")
	} else {
		rep.add(levelOK, area, fmt.Sprintf("file system %s, %s of %s free", fst, sizeOf(avail), sizeOf(size)), "")
	}
	if level, what, fix := fileSystemFinding(fst, kind, size, int64(m.Capacity), int64(m.Reserve)); level != "" {
		rep.add(level, area, what, fix)
		if level == levelFail {
			return true // the engine refuses the mount: nothing else counts
		}
	}
	if kind.Network {
		grace := time.Duration(o.cfg.Engine.TempGrace)
		if grace == 0 {
			grace = engine.DefaultTempGrace
		}
		mnt, mntErr := fstype.MountOf(m.Path)
		for _, it := range sharedFindings(magic, mnt, mntErr, probeFlock(fsys.OS{}, m.Path), grace) {
			rep.add(it.Level, area, it.What, it.Fix)
		}
	}
	effective := min(configuredCapacity(size, int64(m.Capacity)), avail-int64(m.Reserve))
	if size == 0 {
		// What fileSystemFinding said: the capacity is the capacity
		// (statfs's 0 bytes free say nothing).
		effective, avail = int64(m.Capacity), int64(m.Capacity)
	} else {
		level, what, fix := spaceFinding(size, avail, int64(m.Capacity), int64(m.Reserve))
		rep.add(level, area, what, fix)
	}
	if magic == fstype.Tmpfs {
		if level, what, fix := hugePagesFinding(m.Path); level != "" {
			rep.add(level, area, what, fix)
		}
	}
	if level, what, fix := preallocateFinding(m.Preallocate, keepsSpares(magic, m, o.cfg.Engine.Reuse()), effective); level != "" {
		rep.add(level, area, what, fix)
	}

	direct, err := fsys.ProbeDirect(fsys.OS{}, m.Path)
	switch {
	case err != nil && errors.Is(err, unix.ENOSPC):
		rep.add(levelWarn, area, "O_DIRECT unknown: the probe could not write its one block (file system full); the engine then uses buffered I/O",
			"free space on the file system")
	case err != nil:
		rep.add(levelWarn, area, fmt.Sprintf("O_DIRECT probe failed: %v; the engine then uses buffered I/O", err), "")
	case direct:
		rep.add(levelOK, area, "O_DIRECT supported: files bypass the page cache (io = auto uses it)", "")
	case m.IO == "direct":
		rep.add(levelFail, area, "O_DIRECT refused by the file system, but io = direct", "set io = auto or buffered for this mount")
	default:
		rep.add(levelInfo, area, fmt.Sprintf("O_DIRECT refused by %s: buffered I/O through the page cache", fst), "")
	}
	if drv != nil {
		checkRegistration(rep, area, magic, m.Path, drv)
	}
	if o.speed {
		checkSpeed(ctx, rep, o, m, direct && err == nil, kind.Memory, avail)
	}
	return true
}

// statfsWithin is o's statfs of path, a mount's directory or the one above
// it where it does not exist yet, bounded by o.mountWait or else the
// configuration's server.statfs_timeout (kvdaemon.AnswerWithin):
// an error wrapping kvdaemon.ErrNoAnswer where its file system does not answer.
// Every statfs check makes of a mount goes through it.
func (o checkOptions) statfsWithin(ctx context.Context, path string) (unix.Statfs_t, error) {
	statfs := o.statfs
	if statfs == nil {
		statfs = unix.Statfs
	}
	wait := time.Duration(o.cfg.Server.StatfsTimeout)
	if o.mountWait != nil {
		if w := o.mountWait(path); w > 0 {
			wait = w
		}
	}
	return kvdaemon.AnswerWithin(ctx, wait, func() (unix.Statfs_t, error) {
		var st unix.Statfs_t
		err := statfs(path, &st)
		return st, err
	})
}

// kernelFSFix is the fix of a mount on a kernel interface (proc, sysfs).
const kernelFSFix = "name a directory on a disk or a tmpfs in [[mount]] path"

// fileSystemFinding says what the engine makes of a mount on file system
// name, of kind k, size bytes large by statfs, with the configured
// capacity and reserve: it refuses a kernel interface (proc, sysfs: kind
// Kernel), a file system whose files write(2)
// refuses (hugetlbfs: kind MapOnly), and one that reports no size (ramfs:
// statfs counts no blocks) without a capacity; with one, that capacity is
// the mount's capacity. It says nothing (level "") of any other.
func fileSystemFinding(name string, k fstype.Kind, size, capacity, reserve int64) (level, what, fix string) {
	switch {
	case k.Kernel:
		return levelFail, name + " is a kernel interface, not a file system that keeps files: the engine refuses this mount", kernelFSFix
	case k.MapOnly:
		return levelFail, name + ": its files cannot be written with write(2), only through mappings, and kvhost writes with pwrite: the engine refuses this mount",
			"for files in huge pages use a tmpfs mounted with huge=within_size (" + ownTmpfs + ")"
	case size != 0:
		return "", "", ""
	}
	memory := ""
	if k.Memory {
		memory = "; " + name + " has no limit of its own and its files stay in memory, so keep the capacity within what the node can spare"
	}
	if capacity == 0 {
		return levelFail, name + " reports no size (statfs: 0 blocks): the engine refuses the mount, which needs a configured capacity" + memory,
			"set capacity for this mount ([[mount]] capacity = \"16GiB\"), or use a tmpfs, which has a size (" + ownTmpfs + ")"
	}
	what = fmt.Sprintf("%s reports no size (statfs: 0 blocks): the configured capacity, %s, is the capacity", name, sizeOf(capacity))
	if reserve > 0 {
		what += fmt.Sprintf(" (the reserve, %s, has no effect: there is no free space to keep)", sizeOf(reserve))
	}
	return levelInfo, what + memory, ""
}

// configuredCapacity is a mount's capacity setting, or 90% of the file
// system's size where it is 0.
func configuredCapacity(size, capacity int64) int64 {
	if capacity == 0 {
		return size * 9 / 10
	}
	return capacity
}

// keepsSpares reports whether the engine keeps spare files on mount m of
// file system magic fsMagic, with engine.reuse_files reuse: the engine's
// own rule (a memory file system by its statfs magic, so that ramfs and
// hugetlbfs count as tmpfs does, in kvhost's layout, without a
// cluster_capacity, whose summaries would not count the spares).
func keepsSpares(fsMagic int64, m config.Mount, reuse bool) bool {
	kind, _ := fstype.Of(fsMagic)
	return kind.Memory && m.Layout != config.LayoutVLLMFS && m.ClusterCapacity == 0 && reuse
}

// preallocateFinding says what the mount's preallocate setting makes
// ahead of stores: spares keeps says the engine keeps spares there (a
// memory file system in kvhost's layout, engine.reuse_files on, no
// cluster_capacity), and effective is the capacity the engine will see
// (auto is an eighth of it, at most the larger of 4 GiB and a sixteenth
// of the machine's memory).
func preallocateFinding(p config.AutoSize, keeps bool, effective int64) (level, what, fix string) {
	switch {
	case !keeps && p.Given && p.Bytes > 0:
		return levelWarn, fmt.Sprintf("preallocate = %s has no effect here: spare files are kept only on memory file systems (tmpfs) in kvhost's layout, with engine.reuse_files on and no cluster_capacity", p),
			"remove preallocate from this mount"
	case !keeps:
		return "", "", ""
	case p.Given && p.Bytes == 0:
		return levelInfo, "no spare files made ahead of stores (preallocate = 0): stores into a cache with room write fresh files, through the GPU path's pinned buffers",
			`leave preallocate unset (or "auto") where the node can hold an eighth of the capacity (at most the larger of 4 GiB and a sixteenth of its memory) before the cache fills`
	case p.Given:
		return levelOK, fmt.Sprintf("spare files made ahead of stores in idle moments: up to %s, shared evenly by the models (namespaces) storing here", sizeOf(int64(p.Bytes))), ""
	}
	budget := engine.AutoPreallocate(effective, engine.MachineMemory())
	growth := ""
	if grown := engine.AutoPreallocateMax(effective, engine.MachineMemory()); grown > budget {
		growth = ", up to " + sizeOf(grown) + " after larger bursts of stores"
	}
	return levelOK, fmt.Sprintf("spare files made ahead of stores in idle moments: up to %s%s (preallocate auto: an eighth of the capacity, at most the larger of 4 GiB and a sixteenth of the machine's memory, growing to the largest recent burst within a quarter of the capacity and the larger of 4 GiB and an eighth of memory; %d files of a size), shared evenly by the models (namespaces) storing here",
		sizeOf(budget), growth, engine.MaxAutoSpareFiles), ""
}

// spaceFinding judges the free space against the configured capacity and
// reserve: the effective capacity is the smaller of the capacity (0: 90%
// of the file system) and the free space minus the reserve. It names the
// two figures as kvhost stats does: capacity (the effective one, which
// stats also counts kvhost's own files in) and configured.
func spaceFinding(size, avail, capacity, reserve int64) (level, what, fix string) {
	configured := configuredCapacity(size, capacity)
	effective := min(configured, avail-reserve)
	switch {
	case avail <= reserve:
		return levelWarn, fmt.Sprintf("full for kvhost: %s free, reserve %s: stores fail with no space until files are evicted",
			sizeOf(avail), sizeOf(reserve)), "free space on the file system or lower the mount's reserve"
	case capacity > size:
		return levelWarn, fmt.Sprintf("capacity %s exceeds the file system's size %s: the effective capacity is %s",
			sizeOf(capacity), sizeOf(size), sizeOf(effective)), "set capacity at most the file system's size"
	case effective < configured:
		return levelInfo, fmt.Sprintf("capacity %s now, configured %s, reserve %s: only %s can be stored now (the free space minus the reserve; kvhost stats adds kvhost's own files)",
			sizeOf(effective), sizeOf(configured), sizeOf(reserve), sizeOf(effective)), ""
	}
	return levelOK, fmt.Sprintf("capacity %s, configured %s, reserve %s: fits in the free space", sizeOf(configured), sizeOf(configured), sizeOf(reserve)), ""
}

// checkRegistration reports whether cuFile registers a file on the mount,
// of file system magic.
func checkRegistration(rep *checkReport, area string, magic int64, dir string, drv *gds.Driver) {
	c, err := drv.ProbeDir(dir)
	if err != nil {
		rep.add(levelWarn, area, fmt.Sprintf("cuFile probe failed: %v", err), "")
		return
	}
	switch c.Mode {
	case gds.ModeDirect:
		rep.add(levelOK, area, "cuFile registers files: direct (GPUDirect)", "")
	case gds.ModeCompat:
		rep.add(levelOK, area, "cuFile registers files: compatibility mode (a host bounce inside libcufile)", "")
	default:
		fix := ""
		switch {
		case magic == fstype.Tmpfs:
			fix = "none needed: cuFile does not serve tmpfs (it registers only block-device file systems); kvhost's staging pipeline does"
		case errors.Is(c.Err, gds.StatusHandleNotRegistered):
			var st unix.Stat_t
			dev := "bMAJOR:MINOR"
			if unix.Stat(dir, &st) == nil {
				dev = fmt.Sprintf("b%d:%d", unix.Major(st.Dev), unix.Minor(st.Dev))
			}
			fix = fmt.Sprintf("cuFile reads the udev database: where /run/udev is missing (containers, VMs) bind-mount the host's, or write /run/udev/data/%s with E:ID_FS_USAGE=filesystem and E:ID_FS_TYPE=%s", dev, fstype.Name(magic))
		}
		reason := "refused"
		if c.Err != nil {
			reason = c.Err.Error()
		}
		rep.add(levelWarn, area, fmt.Sprintf("cuFile cannot register files here: %s; GPU memory moves through the staging pipeline", reason), fix)
	}
}

// checkSpeed measures sequential writes and reads of one file, O_DIRECT
// (where supported) and buffered, each bounded by --speed-time. memory:
// the mount is a memory file system (its reads are never cold).
func checkSpeed(ctx context.Context, rep *checkReport, o checkOptions, m config.Mount, direct, memory bool, avail int64) {
	size := o.speedSize
	if avail-int64(m.Reserve) < size+(64<<20) {
		rep.add(levelWarn, m.Path, fmt.Sprintf("speed test skipped: %s free, it needs %s", sizeOf(avail), sizeOf(size)), "free space or pass a smaller --speed-size")
		return
	}
	buf, err := bench.AlignedBuffer(4 << 20)
	if err != nil {
		rep.add(levelWarn, m.Path, fmt.Sprintf("speed test skipped: %v", err), "")
		return
	}
	defer bench.FreeBuffer(buf)
	for i := range buf {
		buf[i] = byte(i*7 + 1)
	}
	modes := []bool{false}
	if direct {
		modes = []bool{true, false}
	}
	// A fresh name, made here (O_EXCL): the directory may be shared,
	// and a symbolic link planted at a name known ahead would have the
	// check write through it, where it points (speedPass).
	f, err := os.CreateTemp(m.Path, ".kvhost-check-speed-*")
	if err != nil {
		rep.add(levelWarn, m.Path, fmt.Sprintf("speed test skipped: %v", err), "")
		return
	}
	name := f.Name()
	f.Close()
	defer os.Remove(name)
	for _, d := range modes {
		mode := "buffered"
		if d {
			mode = "O_DIRECT"
		}
		n, el, err := speedPass(ctx, name, buf, size, o.speedTime, d, true)
		if err != nil {
			rep.add(levelWarn, m.Path, fmt.Sprintf("speed: write %s failed: %v", mode, err), "")
			return
		}
		rep.Speed = append(rep.Speed, speedResult{m.Path, "write " + mode + " + fsync", n, bench.GBps(n, el)})
		cold := ""
		if !d {
			_, err := bench.DropCaches([]string{name})
			if err == nil && !memory {
				cold = " (cold)"
			}
		}
		n, el, err = speedPass(ctx, name, buf, n, o.speedTime, d, false)
		if err != nil {
			rep.add(levelWarn, m.Path, fmt.Sprintf("speed: read %s failed: %v", mode, err), "")
			return
		}
		rep.Speed = append(rep.Speed, speedResult{m.Path, "read " + mode + cold, n, bench.GBps(n, el)})
	}
}

// speedPass writes (reads) up to size bytes sequentially in buf-sized
// calls, stopping after limit; writes end with fsync. It returns the bytes
// moved and the time taken. name is the file checkSpeed made; each pass
// opens it anew, O_NOFOLLOW: a symbolic link put in its place between
// passes (the directory may be shared) fails the pass with ELOOP, and
// nothing is written where it points.
func speedPass(ctx context.Context, name string, buf []byte, size int64, limit time.Duration, direct, write bool) (int64, time.Duration, error) {
	flags := os.O_RDONLY | unix.O_NOFOLLOW
	if write {
		flags = os.O_WRONLY | unix.O_NOFOLLOW
	}
	if direct {
		flags |= unix.O_DIRECT
	}
	f, err := os.OpenFile(name, flags, 0o600)
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	start := time.Now()
	var off int64
	for off < size && time.Since(start) < limit && ctx.Err() == nil {
		b := buf[:min(int64(len(buf)), size-off)]
		var k int
		if write {
			k, err = f.WriteAt(b, off)
		} else {
			k, err = f.ReadAt(b, off)
			if err == io.EOF && k > 0 {
				err = nil
			}
		}
		off += int64(k)
		if err != nil {
			return off, time.Since(start), err
		}
		if k == 0 {
			break
		}
	}
	if write {
		if err := f.Sync(); err != nil {
			return off, time.Since(start), err
		}
	}
	return off, time.Since(start), ctx.Err()
}

// loadError shortens a library-loading error where every candidate was
// simply absent ("not found; tried a, b, c"); any other failure (a missing
// dependency or symbol) is worth its full text.
func loadError(err error, paths, defaults []string) string {
	msg := err.Error()
	if len(paths) == 0 {
		paths = defaults
	}
	if strings.Count(msg, "No such file or directory") >= len(paths) {
		return "not found; tried " + strings.Join(paths, ", ")
	}
	return msg
}

// existingParent is the nearest existing ancestor of path.
func existingParent(path string) string {
	p := filepath.Clean(path)
	for {
		if _, err := os.Stat(p); err == nil || p == "/" || p == "." {
			return p
		}
		p = filepath.Dir(p)
	}
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}
