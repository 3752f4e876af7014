package gpu

import (
	"fmt"
	"os"
	"testing"
)

// TestGPURegisteredLoadOrder compares the two orders a load of a
// registered file of one chunk can checksum in: after its copy is done
// (what the mover does beside other jobs; with one job the mover
// checksums beside the copy either way) and while it runs
// (Mover.sumsBesideLoad, what larger files do). Registered files on KVHOST_GPU_TMPFS, 2 MiB keys of
// the Llama-3.1-8B layout, 1, 8 and 16 jobs, the two orders alternated
// over three rounds (each round starting with the other), next to the
// host read ceiling of the same files timed in the same round; every
// loaded page is checked. KVHOST_GPU=1 runs it; KVHOST_GPU_OUT names a
// file for the report (suffix "-loadorder").
func TestGPURegisteredLoadOrder(t *testing.T) {
	needGPU(t)
	rep := newReport(t, "-loadorder")
	small := os.Getenv("KVHOST_GPU_SMALL") == "1"
	r, w := openGPU(t, envCUDA())
	g := llama8B()
	if small {
		g.numBlocks = 32
	}
	kv := newCache(t, w, g)
	orig := kv.randomize(t, w, 3)
	dir := benchDir(t, "loadorder")
	files := 1024
	if small {
		files = 8
	}
	gk := g
	gk.blocksPerKey = 1
	keyBytes := int64(gk.layers * gk.blocksPerKey * gk.pageBytes)
	plans, paths := keyFiles(kv, gk, dir, files, 11, false)
	for _, p := range plans {
		p.Memory = true
	}
	total := keyBytes * int64(files)
	label := fmt.Sprintf("%d MiB keys × %d", keyBytes>>20, files)
	if _, err := hostPass(r, paths, keyBytes, gk, 16, true, false); err != nil {
		t.Fatal(err)
	}
	m, err := New(Config{Runtime: r, Devices: []int{0}, MaxStaging: 16 * 2 * (8<<20 + 2*align), RegisterFiles: len(paths)})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	registerAll(t, m, paths, plans, 16, label)
	if _, err := moverPass(m, paths, plans, 16, true, false); err != nil {
		t.Fatalf("%s: store: %v", label, err)
	}
	for round := range 3 {
		for _, jobs := range []int{1, 8, 16} {
			cr, err := hostPass(r, paths, keyBytes, gk, jobs, false, false)
			if err != nil {
				t.Fatal(err)
			}
			for i := range 2 {
				beside := (i+round)%2 == 1
				m.sumsBesideLoad = beside
				kv.poison(t, w)
				before := m.FileStats().Loads
				ls, err := moverPass(m, paths, plans, jobs, false, false)
				if err != nil {
					t.Fatalf("%s: load: %v", label, err)
				}
				if n := m.FileStats().Loads - before; n != uint64(len(paths)) {
					t.Fatalf("%s: %d of %d loads moved registered files directly", label, n, len(paths))
				}
				order := "after the copy"
				if beside {
					order = "beside the copy"
				}
				checkLoaded(t, kv, w, plans, orig, label+", "+order)
				rep.printf("%s, round %d, %2d jobs, checksums %-15s: load %.2f GB/s (host read ceiling %.2f: %.2f); verified",
					label, round, jobs, order, gbps(total, ls), gbps(total, cr), gbps(total, ls)/gbps(total, cr))
			}
		}
	}
}
