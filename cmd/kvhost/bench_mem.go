package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"
	"unsafe"

	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/bench"
	"github.com/kvhost/kvhost/internal/config"
	kvdaemon "github.com/kvhost/kvhost/internal/daemon"
	"github.com/kvhost/kvhost/internal/fstype"
	"github.com/kvhost/kvhost/plugins/lru"
	"github.com/kvhost/kvhost/region"
)

// benchMemory is the paged cache's memory: GPU memory (cudaMalloc) or host
// memory (a memfd), as a client would register it.
type benchMemory interface {
	bench.Memory
	Region() region.Region
	// Base is the offset in Region of the benchmark's first byte.
	Base() int64
	Close() error
}

// hostMemory is a memfd region.
type hostMemory struct{ h *region.Host }

func newHostMemory(n int64) (*hostMemory, error) {
	h, err := region.NewHost("kvhost-bench", n)
	if err != nil {
		return nil, err
	}
	return &hostMemory{h}, nil
}

func (m *hostMemory) Region() region.Region { return m.h }
func (m *hostMemory) Base() int64           { return 0 }
func (m *hostMemory) Close() error          { return m.h.Close() }

func (m *hostMemory) WriteAt(p []byte, off int64) error {
	if off < 0 || off+int64(len(p)) > m.h.Len() {
		return region.ErrBounds
	}
	copy(m.h.Bytes()[off:], p)
	return nil
}

func (m *hostMemory) ReadAt(p []byte, off int64) error {
	if off < 0 || off+int64(len(p)) > m.h.Len() {
		return region.ErrBounds
	}
	copy(p, m.h.Bytes()[off:])
	return nil
}

// deviceMemory is cudaMalloc'd memory on device 0, filled and read back
// with synchronous copies on its own CUDA worker. Its first byte is 4 KiB
// aligned (CUDA aligns large allocations far more; a test's fake library
// does not), so that O_DIRECT file I/O may use it directly.
type deviceMemory struct {
	rt   *cuda.Runtime
	w    *cuda.Worker
	mem  *cuda.DeviceMemory
	base int64
	n    int64
}

func newDeviceMemory(gp *kvdaemon.GPU, n int64) (*deviceMemory, error) {
	w, err := gp.Runtime().NewWorker(0)
	if err != nil {
		return nil, err
	}
	m := &deviceMemory{rt: gp.Runtime(), w: w, n: n}
	err = w.Do(context.Background(), func(*cuda.Worker) error {
		m.mem, err = gp.Runtime().Malloc(0, n+bench.Align)
		if err == nil {
			m.base = int64(-m.mem.Ptr() & (bench.Align - 1))
		}
		return err
	})
	if err != nil {
		w.Close()
		return nil, err
	}
	return m, nil
}

func (m *deviceMemory) Region() region.Region { return m.mem }
func (m *deviceMemory) Base() int64           { return m.base }

func (m *deviceMemory) Close() error {
	err := m.w.Do(context.Background(), func(*cuda.Worker) error { return m.mem.Close() })
	return errors.Join(err, m.w.Close())
}

func (m *deviceMemory) copy(p []byte, off int64, toDevice bool) error {
	if off < 0 || off+int64(len(p)) > m.n {
		return region.ErrBounds
	}
	if len(p) == 0 {
		return nil
	}
	off += m.base
	return m.w.Do(context.Background(), func(*cuda.Worker) error {
		h := uintptr(unsafe.Pointer(&p[0]))
		if toDevice {
			return m.rt.CopySync(m.mem.Ptr()+uintptr(off), h, uintptr(len(p)))
		}
		return m.rt.CopySync(h, m.mem.Ptr()+uintptr(off), uintptr(len(p)))
	})
}

func (m *deviceMemory) WriteAt(p []byte, off int64) error { return m.copy(p, off, true) }
func (m *deviceMemory) ReadAt(p []byte, off int64) error  { return m.copy(p, off, false) }

// ceilingBuffers are one buffer per ceiling thread: pinned host memory
// when a GPU is used (the staging pipeline's kind of memory), else aligned
// anonymous memory.
type ceilingBuffers struct {
	bufs   [][]byte
	pinned []*cuda.Pinned
	rt     *cuda.Runtime // of pinned
	size   int64
}

func (b *ceilingBuffers) free() {
	if len(b.pinned) > 0 {
		// Freed as allocated: on a thread locked to device 0 (on this one
		// if device 0 cannot be made current, so that it is freed).
		unlock, err := b.rt.LockDevice(0)
		for _, p := range b.pinned {
			p.Free()
		}
		if err == nil {
			unlock()
		}
	}
	if b.pinned == nil {
		for _, x := range b.bufs {
			bench.FreeBuffer(x)
		}
	}
	b.bufs, b.pinned = nil, nil
}

// buffers returns n buffers of at least size bytes, reallocating when the
// ones held are too few or too small.
func (r *benchRun) buffers(n int, size int64) ([][]byte, error) {
	size = bench.RoundUp(size)
	if r.bufs != nil && len(r.bufs.bufs) >= n && r.bufs.size >= size {
		return r.bufs.bufs[:n], nil
	}
	if r.bufs != nil {
		r.bufs.free()
	}
	b := &ceilingBuffers{size: size}
	r.bufs = b
	if r.useGPU {
		// Pinned memory is allocated in the current device's context: on
		// a thread locked to the bench's device 0.
		b.rt = r.probe.Runtime()
		unlock, err := b.rt.LockDevice(0)
		if err != nil {
			return nil, fmt.Errorf("ceiling buffers: %w", err)
		}
		defer unlock()
	}
	for range n {
		if r.useGPU {
			p, err := b.rt.HostAlloc(int(size))
			if err != nil {
				return nil, fmt.Errorf("ceiling buffers: %w", err)
			}
			b.pinned = append(b.pinned, p)
			b.bufs = append(b.bufs, p.Bytes())
		} else {
			x, err := bench.AlignedBuffer(size)
			if err != nil {
				return nil, err
			}
			b.bufs = append(b.bufs, x)
		}
		// Touch every page: the ceiling should not pay for faulting the
		// buffer in, and the bytes written should not be the zero page.
		x := b.bufs[len(b.bufs)-1]
		for i := 0; i < len(x); i += 512 {
			x[i] = byte(i>>9) | 1
		}
	}
	return b.bufs, nil
}

// ceilingTotals sums a combination's ceiling passes over its rounds, as
// phaseTotals sums the engine's.
type ceilingTotals struct {
	name [2]string // write, read
	// Whether any round's write ceiling wrote into files that existed,
	// and into fresh ones: what name[0] says it timed.
	wroteExisting, wroteFresh bool
	wbytes, rbytes            int64
	wtime, rtime              time.Duration
	wcpu, rcpu                time.Duration // process CPU time
	// The second read of the same files, right after the first.
	r2bytes int64
	r2time  time.Duration
	r2cpu   time.Duration
	// Each round's passes (one measureCeilings call): write and read GB/s.
	wround, rround []float64
	// With a GPU, the staged passes (bench.StagedRead, bench.StagedWrite)
	// of the same files: each pass's bytes, time and CPU time, summed.
	// rereadName names the second read: never cold, since nothing is
	// dropped between the first read and it.
	rereadName       string
	stagedName       [2]string // write, read
	swbytes, srbytes int64
	swtime, srtime   time.Duration
	swcpu, srcpu     time.Duration
}

// pair is the ceilings: bytes over time of every pass.
func (t *ceilingTotals) pair(jobs int) ceilingPair {
	return ceilingPair{
		write: bench.Ceiling{Name: t.name[0], GBps: bench.GBps(t.wbytes, t.wtime), Threads: jobs, CPUMsPerGB: bench.CPUMsPerGB(t.wcpu, t.wbytes)},
		read:  bench.Ceiling{Name: t.name[1], GBps: bench.GBps(t.rbytes, t.rtime), Threads: jobs, CPUMsPerGB: bench.CPUMsPerGB(t.rcpu, t.rbytes)},
		reread: bench.Ceiling{Name: t.rereadName, GBps: bench.GBps(t.r2bytes, t.r2time), Threads: jobs,
			CPUMsPerGB: bench.CPUMsPerGB(t.r2cpu, t.r2bytes)},
		stagedWrite: bench.Ceiling{Name: t.stagedName[0], GBps: bench.GBps(t.swbytes, t.swtime), Threads: jobs, CPUMsPerGB: bench.CPUMsPerGB(t.swcpu, t.swbytes)},
		stagedRead:  bench.Ceiling{Name: t.stagedName[1], GBps: bench.GBps(t.srbytes, t.srtime), Threads: jobs, CPUMsPerGB: bench.CPUMsPerGB(t.srcpu, t.srbytes)},
	}
}

// measureCeilings times plain writes of files of the same sizes as the
// engine's (into a sibling directory) and plain reads of those files right
// after, --ceiling-passes times, with jobs threads, O_DIRECT where the
// engine uses it, fsync when stores are durable, the page cache dropped
// before the read when reads are cold; the files are then removed. It adds
// the passes to t. The read ceiling reads files just written, as the
// engine's loads do, and never the engine's own files: on tmpfs the first
// read of a written page costs more than later ones (the kernel activates
// the page), so reading the engine's files here would speed up the load
// that follows. Spares of the files are written into files that exist
// (created untimed, spread evenly over the files), as a full cache's
// stores and stores into spares made ahead do, and the others into fresh
// files, in the same pass. With a GPU each pass then moves the same files
// through pinned buffers and the GPU plainly (the staged ceilings): a
// staged write, into as many existing files and fresh ones, then a
// staged read of them.
// The staged read cuts a chunk into system calls of piece bytes, as the
// staging pipeline does on the mount (gpu.PieceBytes; 0: one per chunk).
func (r *benchRun) measureCeilings(ctx context.Context, files []string, jobs int, direct bool, piece int64, spares int, t *ceilingTotals) error {
	sizes, largest, err := fileSizes(files)
	if err != nil {
		return err
	}
	var stagers []bench.Stager
	chunk := r.stagedChunk()
	if r.useGPU {
		// The staged passes use two chunks of the same buffers.
		largest = max(largest, 2*chunk)
		var err error
		if stagers, err = r.stagers(ctx, jobs, chunk); err != nil {
			return err
		}
	}
	bufs, err := r.buffers(jobs, largest)
	if err != nil {
		return err
	}
	cdir, err := os.MkdirTemp(r.root, "ceiling-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(cdir)
	cpaths := make([]string, len(files))
	for i := range cpaths {
		cpaths[i] = filepath.Join(cdir, fmt.Sprintf("c%06d", i))
	}
	r.prog.Start(fmt.Sprintf("ceilings, %d threads", jobs), r.o.ceilingPasses)
	mem := ""
	if r.useGPU {
		mem = " ↔ pinned"
	}
	mode := "buffered"
	if direct {
		mode = "O_DIRECT"
	}
	pwrite, sync, cold := "pwrite "+mode, "", ""
	write := bench.WriteFiles
	// A full cache's stores write into evicted files (spare files), and
	// with preallocation into spares made ahead: the ceiling writes into
	// as many files that exist, created untimed, and the rest fresh.
	exist := spreadSpares(len(cpaths), spares)
	var existing, fresh []string
	var existingSizes []int64
	for i, p := range cpaths {
		if exist[i] {
			existing, existingSizes = append(existing, p), append(existingSizes, sizes[i])
		} else {
			fresh = append(fresh, p)
		}
	}
	switch {
	case len(existing) == len(cpaths):
		write = bench.OverwriteFiles
	case len(existing) > 0:
		write = bench.WriteIntoFiles
	}
	// The name is the totals', summed over rounds that may each write
	// another mix: it says every kind of file any of them wrote into.
	t.wroteExisting = t.wroteExisting || len(existing) > 0
	t.wroteFresh = t.wroteFresh || len(fresh) > 0
	switch {
	case t.wroteExisting && t.wroteFresh:
		pwrite = "pwrite into existing and new files " + mode
	case t.wroteExisting:
		pwrite = "pwrite into existing files " + mode
	}
	if _, _, err := bench.WriteFiles(ctx, existing, existingSizes, bufs, direct, false); err != nil {
		return err
	}
	if r.o.fsync {
		sync = " + fsync"
	}
	if r.o.dropCaches {
		cold = " (cold)"
	}
	t.name[0] = pwrite + mem + sync
	t.name[1] = plainReadName(direct, r.useGPU, r.o.dropCaches)
	t.rereadName = plainReadName(direct, r.useGPU, false) + ", second read"
	pieces := ""
	if piece > 0 {
		pieces = fmt.Sprintf(" in %s pieces", sizeOf(piece))
	}
	t.stagedName[0] = fmt.Sprintf("D2H → pinned → %s%s, %s chunks", pwrite, sync, sizeOf(chunk))
	t.stagedName[1] = fmt.Sprintf("pread %s%s%s → pinned → H2D, %s chunks", mode, pieces, cold, sizeOf(chunk))
	var wb0, wt0, rb0, rt0 = t.wbytes, t.wtime, t.rbytes, t.rtime
	defer func() {
		t.wround = append(t.wround, bench.GBps(t.wbytes-wb0, t.wtime-wt0))
		t.rround = append(t.rround, bench.GBps(t.rbytes-rb0, t.rtime-rt0))
	}()
	for range r.o.ceilingPasses {
		cpu := bench.CPUTime()
		wb, wd, err := write(ctx, cpaths, sizes, bufs, direct, r.o.fsync)
		if err != nil {
			return err
		}
		t.wbytes, t.wtime, t.wcpu = t.wbytes+wb, t.wtime+wd, t.wcpu+bench.CPUTime()-cpu
		if r.o.dropCaches {
			if _, err := bench.DropCaches(cpaths); err != nil {
				return err
			}
		}
		cpu = bench.CPUTime()
		rb, rd, err := bench.ReadFiles(ctx, cpaths, bufs, direct)
		rcpu := bench.CPUTime() - cpu
		if err == nil {
			// The same files again: what a read costs once the kernel has
			// activated their pages (see bench.Run.CeilingReread).
			cpu = bench.CPUTime()
			var r2b int64
			var r2d time.Duration
			r2b, r2d, err = bench.ReadFiles(ctx, cpaths, bufs, direct)
			t.r2bytes, t.r2time, t.r2cpu = t.r2bytes+r2b, t.r2time+r2d, t.r2cpu+bench.CPUTime()-cpu
		}
		if err == nil && stagers != nil {
			err = r.stagedPasses(ctx, cpaths, sizes, bufs, stagers, chunk, piece, direct, fresh, len(existing) > 0, t)
		}
		for _, p := range fresh { // the next pass writes them fresh again
			os.Remove(p)
		}
		if err != nil {
			return err
		}
		t.rbytes, t.rtime, t.rcpu = t.rbytes+rb, t.rtime+rd, t.rcpu+rcpu
		r.prog.Step(1)
	}
	return nil
}

// readFirst times a plain read of files, the round's load's own, with
// jobs threads (O_DIRECT where the engine uses it) into the ceilings'
// buffers, and adds it to ld (--read-first).
func (r *benchRun) readFirst(ctx context.Context, files []string, jobs int, direct bool, ld *phaseTotals) error {
	_, largest, err := fileSizes(files)
	if err != nil {
		return fmt.Errorf("--read-first: %w", err)
	}
	bufs, err := r.buffers(jobs, largest)
	if err != nil {
		return err
	}
	cpu := bench.CPUTime()
	n, d, err := bench.ReadFiles(ctx, files, bufs, direct)
	if err != nil {
		return fmt.Errorf("--read-first: %w", err)
	}
	ld.readFirst.bytes += n
	ld.readFirst.d += d
	ld.readFirst.cpu += bench.CPUTime() - cpu
	return nil
}

// ceilingSpares is how many of a round's files the write ceiling writes
// into files that exist: every one in a full cache (its stores write into
// evicted files), as many as the round's stores wrote into spares where
// the engine makes them ahead (ahead > 0), and none otherwise. The others
// it writes fresh, so that a round whose stores took spares for some files
// and fresh files for the rest is held to the same mix.
func ceilingSpares(full bool, ahead int64, reused uint64, files int) int {
	switch {
	case full:
		return files
	case ahead > 0:
		return int(min(reused, uint64(files)))
	}
	return 0
}

// spreadSpares says which of n ceiling files exist before the write when
// spares of them do: spread evenly, so that the threads meet them in the
// same proportion throughout the pass.
func spreadSpares(n, spares int) []bool {
	exist := make([]bool, n)
	for i := range exist {
		exist[i] = (i+1)*spares/n > i*spares/n
	}
	return exist
}

// fileSizes returns each file's size and the largest.
func fileSizes(files []string) (sizes []int64, largest int64, err error) {
	sizes = make([]int64, len(files))
	for i, f := range files {
		fi, err := os.Stat(f)
		if err != nil {
			return nil, 0, err
		}
		sizes[i] = fi.Size()
		largest = max(largest, fi.Size())
	}
	return sizes, largest, nil
}

// plainReadName names a plain read of files with jobs threads, as the
// read ceiling and --read-first time it: "pread O_DIRECT ↔ pinned (cold)".
func plainReadName(direct, gpu, cold bool) string {
	name := "pread buffered"
	if direct {
		name = "pread O_DIRECT"
	}
	if gpu {
		name += " ↔ pinned"
	}
	if cold {
		name += " (cold)"
	}
	return name
}

// stagedPasses times a staged write, into fresh files where the paths are
// in fresh (they are removed first) and into the files that exist for the
// others (with overwrite: else every path is in fresh), then
// a staged read of what it wrote (cold when reads are). Into fresh files
// the read finds its pages as the plain first read and the engine's loads
// do, written and not yet read; into existing files the plain passes have
// read those files just before.
func (r *benchRun) stagedPasses(ctx context.Context, cpaths []string, sizes []int64, bufs [][]byte, stagers []bench.Stager, chunk, piece int64, direct bool, fresh []string, overwrite bool, t *ceilingTotals) error {
	for _, p := range fresh {
		if err := os.Remove(p); err != nil {
			return err
		}
	}
	cpu := bench.CPUTime()
	wb, wd, err := bench.StagedWrite(ctx, cpaths, sizes, bufs, chunk, stagers, direct, r.o.fsync, overwrite)
	if err != nil {
		return err
	}
	t.swbytes, t.swtime, t.swcpu = t.swbytes+wb, t.swtime+wd, t.swcpu+bench.CPUTime()-cpu
	if r.o.dropCaches {
		if _, err := bench.DropCaches(cpaths); err != nil {
			return err
		}
	}
	cpu = bench.CPUTime()
	rb, rd, err := bench.StagedRead(ctx, cpaths, bufs, chunk, piece, stagers, direct)
	if err != nil {
		return err
	}
	t.srbytes, t.srtime, t.srcpu = t.srbytes+rb, t.srtime+rd, t.srcpu+bench.CPUTime()-cpu
	return nil
}

// stagedChunk is the staged ceilings' chunk: the staging pipeline's.
func (r *benchRun) stagedChunk() int64 {
	if r.probe != nil && r.probe.Staging() != nil {
		return int64(r.probe.Staging().ChunkBytes())
	}
	return 4 << 20
}

// pinnedCeilings times pinned host ↔ GPU copies of 256 MiB, best of 5.
func pinnedCeilings(ctx context.Context, gp *kvdaemon.GPU) ([]bench.Ceiling, error) {
	const n = 256 << 20
	w, err := gp.Runtime().NewWorker(0)
	if err != nil {
		return nil, err
	}
	defer w.Close()
	var h2d, d2h time.Duration
	err = w.Do(ctx, func(w *cuda.Worker) (err error) {
		h2d, d2h, err = w.PinnedCopyTimes(n, 5)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("pinned copy ceilings: %w", err)
	}
	return []bench.Ceiling{
		{Name: bench.CeilingH2D + " (256 MiB copy)", GBps: bench.GBps(n, h2d)},
		{Name: bench.CeilingD2H + " (256 MiB copy)", GBps: bench.GBps(n, d2h)},
	}, nil
}

// deviceName is device 0's PCI id and, where the NVIDIA driver tells it,
// its model name.
func deviceName(gp *kvdaemon.GPU) string {
	bus, err := gp.Runtime().PCIBusID(0)
	if err != nil {
		return "device 0"
	}
	if name := nvidiaModel(bus); name != "" {
		return name + " at " + bus
	}
	return "device 0 at " + bus
}

// nvidiaModel reads the model name of the GPU at a PCI address from the
// NVIDIA driver's /proc files ("" when absent).
func nvidiaModel(bus string) string {
	b, err := os.ReadFile(filepath.Join("/proc/driver/nvidia/gpus", strings.ToLower(bus), "information"))
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Model:"); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// fsTypeOf names the file system holding path ("unknown" where statfs
// fails).
func fsTypeOf(path string) string {
	_, name, err := fstype.OfPath(path)
	if err != nil {
		return "unknown"
	}
	return name
}

// benchPolicy builds the engine's policy as the daemon does: the configured
// wasm policy, or the native lru policy when this binary embeds none.
func benchPolicy(ctx context.Context, cfg config.Config, log *slog.Logger) func(policy.Index) (policy.Policy, error) {
	pc := cfg.Policy
	fb := kvdaemon.FallbackFor(cfg)
	pcfg := policy.Config{
		Shards: pc.Shards, MemoryLimit: int64(pc.MemoryLimit), CallTimeout: time.Duration(pc.CallTimeout),
		CacheDir: pc.CacheDir, Params: pc.PolicyParams(), MaxFailures: pc.MaxFailures,
		FailureWindow: time.Duration(pc.FailureWindow), Fallback: fb.New, FallbackName: fb.Name, FallbackParams: fb.Params, Logger: log,
	}
	if pcfg.CacheDir == "" {
		pcfg.CacheDir = filepath.Join(config.DefaultRoot(), "wasm-cache")
	}
	if err := os.MkdirAll(pcfg.CacheDir, 0o750); err != nil {
		pcfg.CacheDir = ""
	}
	return func(idx policy.Index) (policy.Policy, error) {
		module, name, _, err := kvdaemon.Module(pc.Name)
		if err != nil {
			return nil, err
		}
		if module != nil {
			return policy.Open(ctx, module, name, idx, pcfg)
		}
		log.Warn("this binary embeds no wasm policy (plugins/wasm was empty when it was built); running the native lru policy", "policy", name)
		return policy.NewNative(func() guest.Policy { return lru.New() }, idx, pcfg)
	}
}
