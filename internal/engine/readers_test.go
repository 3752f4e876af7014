//go:build invariants

package engine

import (
	"context"
	"math/rand/v2"
	"os"
	"testing"
	"unsafe"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/iotune"
	"golang.org/x/sys/unix"
)

// TestLoadsFromADiskMountPassThroughItsReaders: a disk mount's loads
// take one of its readers each: with load_readers fixed the bound is
// that number, tuned (0) it starts at the I/O workers, a memory mount
// has none; and every key loads its bytes through them.
func TestLoadsFromADiskMountPassThroughItsReaders(t *testing.T) {
	for _, tc := range []struct {
		name    string
		readers int
		workers int
		want    int
	}{
		{"fixed at one", 1, 4, 1},
		{"fixed above the workers is the workers", 9, 4, 4},
		{"tuned starts at the workers", 0, 4, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pol := newTestPolicy(1, abi.OrderLayerMajor)
			e := openEngine(t, Config{IOWorkers: tc.workers, Mounts: []Mount{{Path: diskDir(t), LoadReaders: tc.readers}},
				NewPolicy: func(policy.Index) (policy.Policy, error) { return pol, nil }})
			storeAndLoadBack(t, e, 12)
			st := e.Stats()
			if got := st.Mounts[0].LoadReaders; got != tc.want {
				t.Fatalf("the mount's load readers: %d, want %d", got, tc.want)
			}
			if g := e.mounts[0].readers.Stats(); g.Inflight != 0 {
				t.Fatalf("%d readers still taken after the load", g.Inflight)
			}
		})
	}
	t.Run("buffered loads of a direct mount leave no pages cached", func(t *testing.T) {
		e, dir := bufferedDirectMount(t)
		const n = 4
		storeAndLoadBack(t, e, n)
		if !e.Stats().Mounts[0].LoadBuffered {
			t.Fatal("the mount's stats do not say its loads read buffered")
		}
		files := wantNoPagesCached(t, dir, n, "after a buffered load")
		// The probe sees cached pages where a read leaves them.
		if _, err := os.ReadFile(files[0]); err != nil {
			t.Fatal(err)
		}
		if residentPages(t, files[0]) == 0 {
			t.Fatal("a plain read left no page cached: the check above proves nothing here")
		}
	})
	t.Run("a direct mount's layer ranges read with O_DIRECT whatever the arm", func(t *testing.T) {
		e, dir := bufferedDirectMount(t)
		g := smallGeometry(true)
		ns, err := e.Declare(context.Background(), g)
		if err != nil {
			t.Fatal(err)
		}
		const n = 4
		c := newTestCache(t, e, ns, g, 2*n*g.BlocksPerKey(), layoutPlaneFirst)
		r := rand.New(rand.NewPCG(7, 2))
		keys := testKeys("l", n)
		from := blockLists(r, n, g.BlocksPerKey(), 0)
		for i := range keys {
			c.fill(r, from[i])
		}
		storeAndCheck(t, e, c, keys, from)
		if wantNoPagesCached(t, dir, n, "after the store (the check below proves nothing)"); t.Failed() {
			return
		}
		for first := range g.Layers {
			res := wait(t)(e.Load(context.Background(), LoadRequest{Cache: c.id, Keys: keys,
				Blocks: blockLists(r, n, g.BlocksPerKey(), n*g.BlocksPerKey()), Layers: LayerRange{First: first, Count: 1}}))
			wantOutcomes(t, "layer load", res, OutcomeLoaded)
		}
		wantNoPagesCached(t, dir, n, "after layer-range loads: they read through the page cache")
	})
	t.Run("a memory mount has none", func(t *testing.T) {
		pol := newTestPolicy(1, abi.OrderLayerMajor)
		e := openEngine(t, Config{Mounts: []Mount{{Path: shmDir(t)}}, NewPolicy: func(policy.Index) (policy.Policy, error) { return pol, nil }})
		if e.mounts[0].readers != nil || e.Stats().Mounts[0].LoadReaders != 0 {
			t.Fatal("a memory mount's loads are bounded by readers")
		}
	})
}

// bufferedDirectMount opens an engine of one disk mount that takes
// O_DIRECT, its readers' arm set as tuning may choose it: two, buffered.
func bufferedDirectMount(t *testing.T) (*Engine, string) {
	t.Helper()
	pol := newTestPolicy(1, abi.OrderLayerMajor)
	dir := diskDir(t)
	e := openEngine(t, Config{IOWorkers: 2, Mounts: []Mount{{Path: dir}}, NewPolicy: func(policy.Index) (policy.Policy, error) { return pol, nil }})
	if !e.mounts[0].direct {
		t.Fatalf("%s does not take O_DIRECT: nothing to compare", dir)
	}
	e.mounts[0].readers = iotune.New(iotune.Config{Max: 2, Fixed: true, Buffered: true})
	return e, dir
}

// TestADiskMountsTunedLoadsStartBuffered: a local disk that takes
// O_DIRECT by choice (io = "auto") starts its tuned loads through the
// page cache, with O_DIRECT for tuning to try; load_readers fixes io's
// mode, and io = "direct" or "buffered" is what its loads read with.
func TestADiskMountsTunedLoadsStartBuffered(t *testing.T) {
	for _, tc := range []struct {
		name         string
		io           string
		readers      int
		wantBuffered bool
	}{
		{"auto, tuned: buffered", IOAuto, 0, true},
		{"auto, fixed: O_DIRECT, io's", IOAuto, 2, false},
		{"direct, tuned: O_DIRECT", IODirect, 0, false},
		{"buffered, tuned: buffered", IOBuffered, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pol := newTestPolicy(1, abi.OrderLayerMajor)
			e := openEngine(t, Config{IOWorkers: 4, Mounts: []Mount{{Path: diskDir(t), IO: tc.io, LoadReaders: tc.readers}},
				NewPolicy: func(policy.Index) (policy.Policy, error) { return pol, nil }})
			if tc.io != IOBuffered && !e.mounts[0].direct {
				t.Fatalf("%s does not take O_DIRECT: nothing to compare", e.mounts[0].root)
			}
			if got := e.Stats().Mounts[0].LoadBuffered; got != tc.wantBuffered {
				t.Fatalf("the mount's loads read buffered: %v, want %v", got, tc.wantBuffered)
			}
			storeAndLoadBack(t, e, 4)
		})
	}
}

// storeAndLoadBack stores n keys of random bytes in a fresh namespace of
// the small geometry and loads them back into other blocks, requiring
// every byte back.
func storeAndLoadBack(t *testing.T, e *Engine, n int) {
	t.Helper()
	g := smallGeometry(true)
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 2*n*g.BlocksPerKey(), layoutPlaneFirst)
	r := rand.New(rand.NewPCG(uint64(n), 2))
	keys := testKeys("r", n)
	from := blockLists(r, n, g.BlocksPerKey(), 0)
	want := make([][]byte, n)
	for i := range keys {
		c.fill(r, from[i])
		want[i] = c.data(from[i])
	}
	storeAndCheck(t, e, c, keys, from)
	loadAndCompare(t, e, c, keys, blockLists(r, n, g.BlocksPerKey(), n*g.BlocksPerKey()), want)
}

// wantNoPagesCached requires n data files under dir and reports each
// with pages in the page cache (when says after what); it returns the
// files.
func wantNoPagesCached(t *testing.T, dir string, n int, when string) []string {
	t.Helper()
	files := dataFiles(t, dir)
	if len(files) != n {
		t.Fatalf("%d data files, want %d", len(files), n)
	}
	for _, f := range files {
		if got := residentPages(t, f); got != 0 {
			t.Errorf("%s: %d pages cached %s", f, got, when)
		}
	}
	return files
}

// residentPages returns how many of path's pages are in the page cache
// (mincore over a mapping of it).
func residentPages(t *testing.T, path string) int {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	if st.Size() == 0 {
		return 0
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	page := os.Getpagesize()
	vec := make([]byte, (len(mem)+page-1)/page)
	if _, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&mem[0])), uintptr(len(mem)), uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
		t.Fatal(errno)
	}
	n := 0
	for _, v := range vec {
		n += int(v & 1)
	}
	return n
}
