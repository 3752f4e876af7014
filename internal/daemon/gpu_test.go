package daemon

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/cuda/cudatest"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/internal/daemon/daemontest"
	"github.com/kvhost/kvhost/internal/daemon/hostpath"
	"github.com/kvhost/kvhost/internal/dl"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/plugins/lru"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/staging/gpu"
	"github.com/kvhost/kvhost/transfer"
)

func TestOpenGPUModes(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "libcudart.so.13")
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	cases := []struct {
		name    string
		opts    GPUOptions
		wantNil bool
		wantErr bool
		wantLog string
	}{
		{"off", GPUOptions{Mode: "off"}, true, false, "GPU paths off"},
		{"auto without a runtime serves host memory", GPUOptions{Mode: "auto", CUDALibrary: []string{missing}}, true, false, "no CUDA runtime"},
		{"on without a runtime fails", GPUOptions{Mode: "on", CUDALibrary: []string{missing}}, true, true, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			logs.Reset()
			gp, err := OpenGPU(c.opts, log)
			if (err != nil) != c.wantErr || (gp == nil) != c.wantNil {
				t.Fatalf("OpenGPU = %v, %v", gp, err)
			}
			if !strings.Contains(logs.String(), c.wantLog) {
				t.Errorf("log %q does not contain %q", logs.String(), c.wantLog)
			}
		})
	}
}

// TestGPUMemoryRoundTripsThroughTheEngine wires the daemon's GPU paths to an
// engine as serve does, with the fake CUDA library (device memory is host
// memory there), and moves a paged cache in device memory to files and back
// into poisoned blocks, with the checksums computed on the CPU and on the
// GPU (gpu.checksum_on). Then a byte of one key's payload is changed in
// its file: that key's load fails its checksum and the other still loads.
func TestGPUMemoryRoundTripsThroughTheEngine(t *testing.T) {
	for _, on := range []string{"cpu", "gpu"} {
		t.Run("checksum_on="+on, func(t *testing.T) { gpuRoundTripThroughTheEngine(t, on) })
	}
}

func gpuRoundTripThroughTheEngine(t *testing.T, checksumOn string) {
	lib := cudatest.Build(t)
	fake := cudatest.Open(t, lib)
	ctx := context.Background()
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	gp, err := OpenGPU(GPUOptions{Mode: "on", CUDALibrary: []string{lib}, CUDADriver: []string{lib}, CuFile: "off", MaxStaging: 16 << 20,
		Poll: time.Duration(config.Default().GPU.Poll), SumsOnDevice: checksumOn == "gpu"}, log)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	eng, err := engine.Open(ctx, engine.Config{
		Host:   hostpath.Staging,
		Mounts: []engine.Mount{{Path: dir}},
		NewPolicy: func(idx policy.Index) (policy.Policy, error) {
			return policy.NewNative(func() guest.Policy { return lru.New() }, idx, policy.Config{Shards: 1})
		},
		Movers: gp.Movers(),
		Logger: log,
	})
	if err != nil {
		gp.Close()
		t.Fatal(err)
	}
	defer func() {
		if err := eng.Close(ctx); err != nil {
			t.Error(err)
		}
		if err := gp.Close(); err != nil {
			t.Error(err)
		}
	}()
	g := engine.Geometry{Model: "test/gpu", Layers: 4, KVHeads: 2, HeadSize: 128, DtypeSize: 2, TokensPerBlock: 16, TokensPerKey: 64, TPSize: 1}
	ns, err := eng.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	const blocks = 16
	bb := g.BlockBytes()
	layerBytes := 2 * blocks * bb
	mem, err := gp.rt.Malloc(0, int64(g.Layers)*layerBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	var layers []engine.LayerTensor
	for l := range g.Layers {
		layers = append(layers, engine.LayerTensor{Region: mem, Offset: int64(l) * layerBytes, BlockStride: bb, PlaneStride: blocks * bb, NumBlocks: blocks})
	}
	cid, err := eng.RegisterCache(ns, layers)
	if err != nil {
		t.Fatal(err)
	}
	host := make([]byte, mem.Len())
	r := rand.New(rand.NewPCG(1, 2))
	for i := range host {
		host[i] = byte(r.Uint32())
	}
	copyDevice(t, gp.rt, mem.Ptr(), host, true)
	keys := [][]byte{[]byte("key-a"), []byte("key-b")}
	job, err := eng.Store(ctx, engine.StoreRequest{Cache: cid, Keys: keys, Blocks: [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}}})
	if err != nil {
		t.Fatal(err)
	}
	res, err := job.Wait(ctx)
	if err != nil || res.Count(engine.OutcomeStored) != 2 {
		t.Fatalf("store: %+v %v", res, err)
	}
	if b := eng.Stats().Mounts[0]; !b.Checksums {
		t.Errorf("mount %+v: the staging pipeline checksums, the mount should say so", b)
	}
	poison := bytes.Repeat([]byte{0xA5}, len(host))
	copyDevice(t, gp.rt, mem.Ptr(), poison, true)
	job, err = eng.Load(ctx, engine.LoadRequest{Cache: cid, Keys: keys, Blocks: [][]int{{8, 9, 10, 11}, {12, 13, 14, 15}}})
	if err != nil {
		t.Fatal(err)
	}
	res, err = job.Wait(ctx)
	if err != nil || res.Count(engine.OutcomeLoaded) != 2 {
		t.Fatalf("load: %+v %v", res, err)
	}
	got := make([]byte, len(host))
	copyDevice(t, gp.rt, mem.Ptr(), got, false)
	for l := range g.Layers {
		for p := range 2 {
			for i := range 8 {
				src := int64(l)*layerBytes + int64(p)*blocks*bb + int64(i)*bb
				dst := src + 8*bb
				if !bytes.Equal(host[src:src+bb], got[dst:dst+bb]) {
					t.Fatalf("layer %d plane %d block %d: loaded bytes differ", l, p, i)
				}
			}
		}
	}
	// Two keys stored and loaded: one launch of the checksum kernel per
	// file and job on the GPU, none on the CPU.
	if n, want := fake.Count(cudatest.OpLaunch), map[string]int{"cpu": 0, "gpu": 4}[checksumOn]; n != want {
		t.Errorf("checksums on the %s: %d kernel launches, want %d", checksumOn, n, want)
	}
	if want := "checksum_on=" + checksumOn; !strings.Contains(logs.String(), "GPU paths ready") || !strings.Contains(logs.String(), want) {
		t.Errorf("no start-up line for the GPU paths naming %s:\n%s", want, logs.String())
	}

	// One payload byte changed in one key's file (the payload starts at
	// 4096, after the header area of a one-key file).
	var keyFiles []string
	filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if info, ierr := d.Info(); err == nil && ierr == nil && info.Mode().IsRegular() && info.Size() > 4096 {
			keyFiles = append(keyFiles, path)
		}
		return nil
	})
	if len(keyFiles) != 2 {
		t.Fatalf("key files %q, want 2", keyFiles)
	}
	f, err := os.OpenFile(keyFiles[0], os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	b := []byte{0}
	if _, err := f.ReadAt(b, 4096+100); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0x5A
	if _, err := f.WriteAt(b, 4096+100); err != nil {
		t.Fatal(err)
	}
	f.Close()
	job, err = eng.Load(ctx, engine.LoadRequest{Cache: cid, Keys: keys, Blocks: [][]int{{8, 9, 10, 11}, {12, 13, 14, 15}}})
	if err != nil {
		t.Fatal(err)
	}
	res, _ = job.Wait(ctx)
	if res.Count(engine.OutcomeLoaded) != 1 || res.Count(engine.OutcomeFailed) != 1 {
		t.Fatalf("load after a payload byte changed in one file: %+v; want one key loaded, one failed", res)
	}
	for _, k := range res.Keys {
		if k.Outcome == engine.OutcomeFailed && (k.Err == nil || !strings.Contains(k.Err.Error(), "payload checksum")) {
			t.Fatalf("the changed key failed with %v, want a payload checksum mismatch", k.Err)
		}
	}
}

// TestGPUPollReachesTheStagingPipeline: gpu.poll's duration is how long the
// pipeline's jobs poll, and its 0 means they never poll (where the
// pipeline's own zero means its default).
func TestGPUPollReachesTheStagingPipeline(t *testing.T) {
	lib := cudatest.Build(t)
	for _, c := range []struct{ poll, want time.Duration }{
		{time.Duration(config.Default().GPU.Poll), gpu.DefaultPoll},
		{time.Millisecond, time.Millisecond},
		{250 * time.Microsecond, 250 * time.Microsecond},
		{0, 0},
	} {
		var logs bytes.Buffer
		gp, err := OpenGPU(GPUOptions{Mode: "on", CUDALibrary: []string{lib}, CuFile: "off", MaxStaging: 16 << 20, Poll: c.poll},
			slog.New(slog.NewTextHandler(&logs, nil)))
		if err != nil {
			t.Fatal(err)
		}
		got := gp.staging.PollTime()
		gp.Close()
		if got != c.want {
			t.Errorf("gpu.poll %v: the pipeline polls %v, want %v", c.poll, got, c.want)
		}
		if want := "poll=" + c.want.String(); !strings.Contains(logs.String(), want) {
			t.Errorf("gpu.poll %v: the start-up line lacks %q:\n%s", c.poll, want, logs.String())
		}
	}
}

// copyDevice copies between host bytes and device memory on a thread with
// device 0 current.
func copyDevice(t *testing.T, rt *cuda.Runtime, dev uintptr, host []byte, toDevice bool) {
	t.Helper()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := rt.SetDevice(0); err != nil {
		t.Fatal(err)
	}
	h := uintptr(unsafe.Pointer(&host[0]))
	var err error
	if toDevice {
		err = rt.CopySync(dev, h, uintptr(len(host)))
	} else {
		err = rt.CopySync(h, dev, uintptr(len(host)))
	}
	if err != nil {
		t.Fatal(err)
	}
}

// TestCuFileJobsFailingWithAStickyErrorAreDeviceFaults: where the cuFile
// mover serves GPU memory (the fake libcufile, compatibility mode
// allowed), a job whose piece on device 1 fails with a sticky CUDA error
// (its worker cannot make the broken device current) counts as a fault
// of device 1 in what the daemon reports, beside the staging pipeline's
// and the CUDA IPC importer's faults.
func TestCuFileJobsFailingWithAStickyErrorAreDeviceFaults(t *testing.T) {
	gp, lib, _ := openFakeCuFileGPU(t)
	fake := cudatest.Open(t, lib)
	// A plan over both devices: the file's registration runs bound to
	// device 0, the piece on device 1 on a worker that binds to it.
	p := &transfer.Plan{}
	for d := range 2 {
		mem, err := gp.rt.Malloc(d, 4096)
		if err != nil {
			t.Fatal(err)
		}
		defer mem.Close()
		p.Extents = append(p.Extents, transfer.Extent{FileOff: int64(d) * 4096, Region: mem, Len: 4096, Sum: -1})
	}
	f, err := fsys.OS{}.OpenFile(filepath.Join(t.TempDir(), "key"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	const illegalAddress = 700
	fake.BreakDevice(1, illegalAddress)
	defer fake.BreakDevice(1, 0) // before the memory is freed
	if _, err := gp.cfMover.WriteFile(context.Background(), f, p, nil); !errors.Is(err, cuda.ErrSticky) || errors.Is(err, transfer.ErrUnsupported) {
		t.Fatalf("cuFile job on the broken device: %v; want it failed with the sticky error", err)
	}
	if faults := gp.deviceFaults(); faults[0] != 0 || faults[1] != 1 {
		t.Fatalf("device faults %v; want the cuFile job's on device 1 only", faults)
	}
}

// TestDefaultConfigurationSetsTheMoversDefaultIdleRegistrars: the
// configuration's default gpu.idle_registrars, which reaches the mover
// through GPUOptionsOf, is the mover's documented default.
func TestDefaultConfigurationSetsTheMoversDefaultIdleRegistrars(t *testing.T) {
	if got := GPUOptionsOf(config.Default()).IdleRegistrars; got != gpu.DefaultIdleRegistrars {
		t.Fatalf("default gpu.idle_registrars reaches the mover as %d, want gpu.DefaultIdleRegistrars (%d)", got, gpu.DefaultIdleRegistrars)
	}
}

// fakeCuFileCtl is the head of struct fake_ctl in gds/testdata/fakecufile.c
// (gds's tests mirror all of it), in the C struct's order: its int64
// fields are read and written atomically on both sides.
type fakeCuFileCtl struct {
	DriverOpenError, RegisterError, RegisterFailDev                         int64
	ReadFailAfter, ReadFailCode, ReadTruncateAt, WriteFailAfter, WriteShort int64
	NoCompat, DriverOpens, DriverCloses                                     int64
	HandlesRegistered, HandlesDeregistered, HandlesLive, BadHandleUses      int64
	BytesRead, BytesWritten, Reads, Writes, RegisterCalls                   int64
}

// openFakeCuFileGPU opens the daemon's GPU paths on the fake CUDA
// library and the fake libcufile, compatibility mode allowed, closed when
// t ends, and returns them with the two libraries' paths.
func openFakeCuFileGPU(t *testing.T) (gp *GPU, lib, cufileLib string) {
	t.Helper()
	lib, cufileLib = cudatest.Build(t), daemontest.BuildFakeCuFile(t)
	gp, err := OpenGPU(GPUOptions{Mode: "on", CUDALibrary: []string{lib}, CuFileLibrary: []string{cufileLib}, CuFile: "compat",
		MaxStaging: 16 << 20}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { gp.Close() })
	if gp.cfMover == nil {
		t.Fatal("the cuFile mover did not start on the fake libcufile")
	}
	return gp, lib, cufileLib
}

// fakeCuFileControl opens the fake libcufile at lib (the instance the
// daemon loads) and returns its control block.
func fakeCuFileControl(t *testing.T, lib string) *fakeCuFileCtl {
	t.Helper()
	l, err := dl.Open(lib)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	p, err := l.Sym("fake_ctl")
	if err != nil {
		t.Fatal(err)
	}
	return (*fakeCuFileCtl)(p)
}

// TestCuFileProbeFailingAtStartIsRetriedByALaterJob: a mount whose cuFile
// probe fails for a passing reason (cuFile out of memory) when the engine
// builds its movers is not left on the staging pipeline for the daemon's
// life. Its jobs move through the staging pipeline, each counted as a
// cuFile fallback, and a job the re-probe interval after the last probe
// probes again, no earlier; once a probe works, cuFile moves the jobs.
func TestCuFileProbeFailingAtStartIsRetriedByALaterJob(t *testing.T) {
	gp, _, cufileLib := openFakeCuFileGPU(t)
	now := time.Unix(1_000_000, 0)
	gp.now = func() time.Time { return now }
	ctl := fakeCuFileControl(t, cufileLib)
	const nomem = 5043 // CU_FILE_NOMEM_ERROR: says nothing of the mount
	atomic.StoreInt64(&ctl.RegisterError, nomem)

	dir := t.TempDir()
	mv, err := gp.Movers()[region.KindDevice](engine.MountInfo{Path: dir})
	if err != nil {
		t.Fatal(err)
	}
	mem, err := gp.rt.Malloc(0, 64<<10)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	p := &transfer.Plan{Extents: []transfer.Extent{{Region: mem, Len: 64 << 10, Sum: -1}}}
	f, err := fsys.OS{}.OpenFile(filepath.Join(dir, "key"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	// store moves one job and reports the probes made so far (each is a
	// registration; so is a cuFile job's first on the file) and the
	// files cuFile registered for jobs.
	store := func(step string) (probes int64, cufileJobs uint64) {
		t.Helper()
		if n, err := mv.WriteFile(context.Background(), f, p, nil); err != nil || n != p.Bytes() {
			t.Fatalf("%s: WriteFile = %d, %v; want %d", step, n, err, p.Bytes())
		}
		return atomic.LoadInt64(&ctl.RegisterCalls), gp.cufile.HandleStats().Registrations
	}
	if probes, jobs := store("while the failure lasts"); probes != 1 || jobs != 0 {
		t.Errorf("a job right after the failed probe: %d probes, %d cuFile jobs; want 1, 0", probes, jobs)
	}
	now = now.Add(gp.reprobe)
	if probes, jobs := store("the interval later, failing again"); probes != 2 || jobs != 0 {
		t.Errorf("a job the interval after the failed probe: %d probes, %d cuFile jobs; want 2 (it probes again), 0", probes, jobs)
	}
	atomic.StoreInt64(&ctl.RegisterError, 0)
	now = now.Add(gp.reprobe - time.Second)
	if probes, jobs := store("before the next interval"); probes != 2 || jobs != 0 {
		t.Errorf("a job before the interval ended: %d probes, %d cuFile jobs; want 2 (no probe), 0", probes, jobs)
	}
	now = now.Add(time.Second)
	if _, jobs := store("the interval later, working"); jobs != 1 {
		t.Errorf("a job the interval after the last probe, once probes work: %d cuFile jobs; want 1", jobs)
	}
	if probes, jobs := store("settled"); probes != 4 || jobs != 1 {
		t.Errorf("a job after the probe worked: %d registrations, %d cuFile jobs; want 4 (3 probes, the file's), 1", probes, jobs)
	}
	if c, ok := mv.(*transfer.Chain); !ok || c.Fallbacks()["cufile"] != 3 {
		t.Errorf("the mount's mover %s: want a chain that counted the 3 jobs passed on to the staging pipeline as cufile fallbacks", mv.Name())
	}
}
