package gpu

import (
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/cuda/cudatest"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// TestSumsOnDeviceForRegisteredFiles: with checksums on the device, a
// registered file's direct store and load each launch the checksum kernel
// once (and no pinned buffer is taken), with the checksums the CPU would
// compute, for a file of one chunk and one of many.
func TestSumsOnDeviceForRegisteredFiles(t *testing.T) {
	for _, chunk := range []int{0, 3 * align} {
		e, m, kv, _, _, kf := registeredFile(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, Chunk: chunk, Copy: cuda.CopyBatch, RegisterFiles: 4, SumsOnDevice: true})
		// New bytes, so the direct jobs must move them.
		orig := kv.randomize(t, e.w, 2)
		host := hostCopies(kv, orig)
		launches := e.fake.Count(cudatest.OpLaunch)
		release := holdAllBuffers(m)
		roundTrip(t, e, m, kv, kf, host, orig)
		release()
		if st := m.FileStats(); st.Stores != 1 || st.Loads != 1 {
			t.Fatalf("chunk %d: %+v; want 1 direct store and 1 direct load", chunk, st)
		}
		if n := e.fake.Count(cudatest.OpLaunch) - launches; n != 2 {
			t.Fatalf("chunk %d: %d launches for a direct store and load, want one each", chunk, n)
		}
		// The first store (through the pinned buffers) and these two.
		if onCPU, onGPU := m.SumJobs(); onCPU != 0 || onGPU != 3 {
			t.Fatalf("chunk %d: jobs checksummed on the CPU %d, on the GPU %d; want 0 and 3", chunk, onCPU, onGPU)
		}
	}
}

// TestSumsOnDeviceSeeTheBytesThatArrived: a load checksums the bytes the
// copies delivered, so a file changed under the engine after its store
// loads with checksums that differ from the stored ones, through the
// pinned buffers and through a registered mapping alike.
func TestSumsOnDeviceSeeTheBytesThatArrived(t *testing.T) {
	for _, registered := range []bool{false, true} {
		_, m, _, _, host, kf := storedKeyFile(t, registered)
		_, want := expect(kf.p, host)
		// One byte of the first extent's data, changed in the file.
		f, err := os.OpenFile(kf.path, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		off := kf.p.Extents[0].FileOff + 5
		b := []byte{0}
		if _, err := f.ReadAt(b, off); err != nil {
			t.Fatal(err)
		}
		b[0] ^= 0xFF
		if _, err := f.WriteAt(b, off); err != nil {
			t.Fatal(err)
		}
		f.Close()
		rf, err := fsys.OS{}.OpenFile(kf.path, os.O_RDONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		sums := make([]uint32, kf.p.Sums)
		_, err = m.ReadFile(jobContext(t), rf, kf.p, sums)
		rf.Close()
		if err != nil {
			t.Fatal(err)
		}
		if x := kf.p.Extents[0].Sum; sums[x] == want[x] {
			t.Fatalf("registered %v: a changed byte left checksum %d at the stored %#x", registered, x, want[x])
		}
		if registered != (m.FileStats().Loads == 1) {
			t.Fatalf("registered %v: %+v", registered, m.FileStats())
		}
	}
}

// TestSumsOnDeviceLeaveUnalignedSpansToTheCPU: pages whose length is not a
// multiple of 16 bytes cannot be read by the kernel: the CPU checksums
// such a job, correctly, and no kernel is launched.
func TestSumsOnDeviceLeaveUnalignedSpansToTheCPU(t *testing.T) {
	e := newEnv(t)
	m := e.mover(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, Copy: cuda.CopyBatch, SumsOnDevice: true})
	g := geometry{layers: 2, numBlocks: 16, pageBytes: 4096 + 8, blocksPerKey: 4, headerBytes: 4096}
	kv := newCache(t, e.w, g)
	orig := kv.randomize(t, e.w, 3)
	host := hostCopies(kv, orig)
	p := kv.plan(keyBlocks(rand.New(rand.NewPCG(3, 4)), g.numBlocks, g.blocksPerKey), false)
	_, want := expect(p, host)
	f := createFile(t, "key")
	launches := e.fake.Count(cudatest.OpLaunch)
	sums := make([]uint32, p.Sums)
	if _, err := m.WriteFile(jobContext(t), f, p, sums); err != nil || !equal(sums, want) {
		t.Fatalf("WriteFile: %v, checksums %x, want %x", err, sums, want)
	}
	kv.poison(t, e.w)
	sums = make([]uint32, p.Sums)
	if _, err := m.ReadFile(jobContext(t), f, p, sums); err != nil || !equal(sums, want) {
		t.Fatalf("ReadFile: %v, checksums %x, want %x", err, sums, want)
	}
	if n := e.fake.Count(cudatest.OpLaunch) - launches; n != 0 {
		t.Fatalf("%d launches for spans the kernel cannot read", n)
	}
	if onCPU, onGPU := m.SumJobs(); onCPU != 2 || onGPU != 0 {
		t.Fatalf("jobs checksummed on the CPU %d, on the GPU %d; want 2 and 0", onCPU, onGPU)
	}
}

// TestSumsOnDeviceLaunchFailuresFailTheJob: a launch of the checksum
// kernel that fails fails its store or load with the driver's error, the
// lane is not reused, and the next jobs succeed.
func TestSumsOnDeviceLaunchFailuresFailTheJob(t *testing.T) {
	for _, registered := range []bool{false, true} {
		e, m, kv, orig, host, kf := storedKeyFile(t, registered)
		for _, write := range []bool{true, false} {
			e.fake.Fail(cudatest.OpLaunch, 1, 719)
			sums := make([]uint32, kf.p.Sums)
			var err error
			if write {
				_, err = m.WriteFile(context.Background(), kf.f, kf.p, sums)
			} else {
				rf, oerr := fsys.OS{}.OpenFile(kf.path, os.O_RDONLY, 0)
				if oerr != nil {
					t.Fatal(oerr)
				}
				_, err = m.ReadFile(context.Background(), rf, kf.p, sums)
				rf.Close()
			}
			e.fake.Fail(cudatest.OpLaunch, 0, 0)
			var de *cuda.DriverError
			if !errors.As(err, &de) || !strings.Contains(err.Error(), "cuLaunchKernel") {
				t.Fatalf("registered %v, write %v: %v, want the launch's DriverError", registered, write, err)
			}
			roundTrip(t, e, m, kv, kf, host, orig)
		}
	}
}

// storedKeyFile is filesSetup with checksums on the device and one key
// file, stored once and then, if registered, registered by the registrar
// (without, the mover keeps no registered files).
func storedKeyFile(t *testing.T, registered bool) (*env, *Mover, *cache, [][]byte, map[region.Region][]byte, *keyFile) {
	t.Helper()
	bound := 0
	if registered {
		bound = 4
	}
	e, m, kv, orig, host := filesSetup(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, Copy: cuda.CopyBatch, RegisterFiles: bound, SumsOnDevice: true})
	kf := newKeyFile(t, kv, t.TempDir(), "key", 1)
	store(t, e, m, kv, kf, host, orig)
	if registered {
		testwait.Until(t, "the file registered", testwait.Hang, func() bool { return m.FileStats().Files == 1 })
	}
	return e, m, kv, orig, host, kf
}

// TestSumJobsCountOnlyJobsThatComputedChecksums: the checksum-jobs count
// (kvhost_gpu_checksum_jobs_total) takes a job once it succeeded, by
// where its checksums were computed: not a job whose launch failed, nor
// one none of whose extents feeds a checksum (nothing was computed).
func TestSumJobsCountOnlyJobsThatComputedChecksums(t *testing.T) {
	e, m, kv, orig, host, kf := storedKeyFile(t, false)
	onCPU, onGPU := m.SumJobs()
	unchanged := func(what string) {
		t.Helper()
		if c, g := m.SumJobs(); c != onCPU || g != onGPU {
			t.Fatalf("%s: jobs checksummed on the CPU %d → %d, on the GPU %d → %d; want no change", what, onCPU, c, onGPU, g)
		}
	}
	e.fake.Fail(cudatest.OpLaunch, 1, 719)
	_, err := m.WriteFile(context.Background(), kf.f, kf.p, make([]uint32, kf.p.Sums))
	e.fake.Fail(cudatest.OpLaunch, 0, 0)
	if err == nil {
		t.Fatal("a store whose launch failed succeeded")
	}
	unchanged("a store whose launch failed")

	p := *kf.p
	p.Extents = slices.Clone(p.Extents)
	for i := range p.Extents {
		p.Extents[i].Sum = -1
	}
	if _, err := m.WriteFile(context.Background(), kf.f, &p, make([]uint32, p.Sums)); err != nil {
		t.Fatal(err)
	}
	unchanged("a store with no extent feeding a checksum")

	roundTrip(t, e, m, kv, kf, host, orig)
	if c, g := m.SumJobs(); c != onCPU || g != onGPU+2 {
		t.Fatalf("after a store and a load: on the CPU %d, on the GPU %d; want %d and %d", c, g, onCPU, onGPU+2)
	}
}

// TestOnlyCPUChecksumsAreOfTheBytesWritten: the CPU sums the pinned
// buffer or the file's pages a store wrote; the checksum kernel sums the
// GPU memory the copies read again, so its sums vouch for no file.
func TestOnlyCPUChecksumsAreOfTheBytesWritten(t *testing.T) {
	e := newEnv(t)
	for _, tc := range []struct {
		name string
		cfg  Config
		want bool
	}{
		{"CPU checksums", Config{Devices: []int{0}, MaxStaging: 16 << 20, Copy: cuda.CopyBatch}, true},
		{"checksums on the device", Config{Devices: []int{0}, MaxStaging: 16 << 20, Copy: cuda.CopyBatch, SumsOnDevice: true}, false},
		{"no checksums", Config{Devices: []int{0}, MaxStaging: 16 << 20, Copy: cuda.CopyBatch, NoChecksums: true}, false},
	} {
		if got := transfer.SumsWritten(e.mover(t, tc.cfg)); got != tc.want {
			t.Errorf("%s: SumsWritten = %v, want %v", tc.name, got, tc.want)
		}
	}
}
