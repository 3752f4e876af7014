package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/cuda/cudatest"
	"github.com/kvhost/kvhost/protocol"
)

// TestServeReportsAGPUWhoseContextBroke runs the daemon in this process on
// the fake CUDA library (runtime and driver API, gpu.cuda_driver_library),
// registers device memory over CUDA IPC as a client process would, and
// fails one store's DMA copy with cudaErrorIllegalAddress, which on a real
// GPU breaks the daemon's context on the device. The store's key fails;
// kvhost stats reports the fault on device 0; kvhost health exits 1
// naming the device (0 with --allow-device-faults); /healthz/gpu answers
// 503 while /healthz stays 200; and the daemon keeps serving the client.
// A GPU that breaks while idle is found, and counted, by the next import.
func TestServeReportsAGPUWhoseContextBroke(t *testing.T) {
	lib := cudatest.Build(t)
	fake := cudatest.Open(t, lib)
	dir := t.TempDir()
	extra := fmt.Sprintf("[gpu]\nmode = \"on\"\ncuda_library = %q\ncuda_driver_library = %q\ncufile = \"off\"\nstaging_memory = \"16MiB\"\n", lib, lib)
	file, socket, _ := testConfig(t, dir, extra)
	ctx, cancel := context.WithTimeout(context.Background(), 2*hangBound) // the daemon's and the client's calls: a hang guard
	defer cancel()
	addr, _ := serveWithMetrics(t, ctx, file, socket)

	// The client process's side: device memory on GPU 0, exported.
	rt, err := cuda.Open(cuda.Config{Runtime: []string{lib}, Driver: []string{lib}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rt.Close() }) // after the allocations' cleanups
	size := opsCacheBytes()
	handle := exportDeviceMemory(t, rt, 0, size)

	c, err := client.Dial(ctx, socket, t.Name())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	rid, err := c.RegisterCUDAIPC(ctx, 0, handle, 0, size)
	if err != nil {
		t.Fatal(err)
	}
	_, cache := registerOpsCache(t, c, rid)
	store := func(key string) client.Result {
		t.Helper()
		job, err := c.Store(ctx, cache, [][]byte{[]byte(key)}, [][]uint32{{0, 1}})
		if err != nil {
			t.Fatal(err)
		}
		res, err := job.Wait(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	health := func(args ...string) (int, string) {
		var out, errb bytes.Buffer
		code := run(ctx, append([]string{"health", "--socket", socket}, args...), &out, &errb)
		return code, errb.String()
	}
	get := func(path string) (int, string) { return httpGet(t, addr, path) }

	if res := store("before"); res.Count(protocol.OutcomeStored) != 1 {
		t.Fatalf("store before the fault: %+v", res)
	}
	if code, msg := health(); code != 0 {
		t.Fatalf("kvhost health before the fault: exit %d: %s", code, msg)
	}
	if code, body := get("/healthz/gpu"); code != http.StatusOK {
		t.Fatalf("/healthz/gpu before the fault: %d %q", code, body)
	}

	const illegalAddress = 700
	fake.Fail(cudatest.OpCopy, 1, illegalAddress)
	res := store("faulted")
	fake.Fail(cudatest.OpCopy, 0, 0)
	if res.Count(protocol.OutcomeFailed) != 1 {
		t.Fatalf("store with an illegal address: %+v, want its key failed", res)
	}

	if st := statsJSON(t, ctx, socket); len(st.Devices) != 2 || st.Devices[0].Faults != 1 || st.Devices[1].Faults != 0 { // the fake has two GPUs
		t.Fatalf("kvhost stats devices %+v: want 1 fault on device 0, none on device 1", st.Devices)
	}
	if code, msg := health(); code != 1 || !strings.Contains(msg, "sticky CUDA error") || !strings.Contains(msg, "GPU 0") {
		t.Fatalf("kvhost health after the fault: exit %d, %q; want 1 naming GPU 0", code, msg)
	}
	if code, msg := health("--allow-device-faults"); code != 0 {
		t.Fatalf("kvhost health --allow-device-faults: exit %d: %s", code, msg)
	}
	if code, body := get("/healthz/gpu"); code != http.StatusServiceUnavailable || !strings.Contains(body, "GPU 0") {
		t.Fatalf("/healthz/gpu after the fault: %d %q; want 503 naming GPU 0", code, body)
	}
	if code, body := get("/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz after the fault: %d %q; want 200 (the process serves)", code, body)
	}
	// The fake's context is not broken: the daemon serves on.
	if res := store("after"); res.Count(protocol.OutcomeStored) != 1 {
		t.Fatalf("store after the fault: %+v", res)
	}

	// GPU 1 breaks while no job runs there: the next import finds it,
	// and it counts as that device's fault.
	handle1 := exportDeviceMemory(t, rt, 1, 1<<16)
	fake.BreakDevice(1, illegalAddress)
	defer fake.BreakDevice(1, 0) // before the allocation's cleanup frees it
	if _, err := c.RegisterCUDAIPC(ctx, 1, handle1, 0, 4096); !errors.Is(err, &protocol.Error{Code: protocol.CodeInternal}) {
		t.Fatalf("registration on the broken GPU 1: %v, want an internal error", err)
	}
	if st := statsJSON(t, ctx, socket); st.Devices[0].Faults != 1 || st.Devices[1].Faults != 1 {
		t.Fatalf("kvhost stats devices %+v: want 1 fault on each device", st.Devices)
	}
}

// exportDeviceMemory allocates n bytes on device d as a client process
// would (on a worker bound to d) and returns its IPC handle; the memory is
// freed, and the worker closed, when the test ends.
func exportDeviceMemory(t *testing.T, rt *cuda.Runtime, d int, n int64) [cuda.IPCHandleSize]byte {
	t.Helper()
	w, err := rt.NewWorker(d)
	if err != nil {
		t.Fatal(err)
	}
	var mem *cuda.DeviceMemory
	var h [cuda.IPCHandleSize]byte
	err = w.Do(context.Background(), func(*cuda.Worker) error {
		var err error
		if mem, err = rt.Malloc(d, n); err != nil {
			return err
		}
		h, err = mem.IPCHandle()
		return err
	})
	if err != nil {
		w.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		w.Do(context.Background(), func(*cuda.Worker) error { return mem.Close() })
		w.Close()
	})
	return h
}
