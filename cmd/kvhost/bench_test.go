package main

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/cuda/cudatest"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/bench"
	"github.com/kvhost/kvhost/internal/daemon/daemontest"
)

// tinyBench is a small geometry: 4 layers of 8 KiB blocks (two heads of
// 128 two-byte elements, 16 tokens), keys of 64 tokens (256 KiB) and 16
// tokens (64 KiB).
//
// One ceiling pass per round: what the tests check of fractions are
// relations that hold under any load (the best ceiling is at least the
// run's own, a summed fraction lies between its rounds'), and each pass
// writes and reads every file again. TestBenchRunsEveryCeilingPassItIsAsked
// runs three.
var tinyBench = []string{"--layers", "4", "--kv-heads", "2", "--head-size", "128", "--tokens-per-key", "64,16", "--progress", "off", "--ceiling-passes", "1"}

// runBenchJSON runs kvhost bench with args, checks that it succeeded and
// left nothing behind (its --dir, which it made, included), and returns
// the parsed --json report and the SVG bytes.
func runBenchJSON(t *testing.T, args ...string) (*bench.Report, []byte) {
	t.Helper()
	dir := t.TempDir()
	svg := filepath.Join(dir, "out.svg")
	data := filepath.Join(dir, "data")
	rep, stdout := benchReport(t, data, append([]string{"--svg", svg}, args...)...)
	if !strings.Contains(stdout, "ceiling GB/s") {
		t.Errorf("no result table on standard output:\n%s", stdout)
	}
	if _, err := os.Lstat(data); !errors.Is(err, os.ErrNotExist) {
		left, _ := os.ReadDir(data)
		t.Errorf("the benchmark left its directory, which it made, with %d entries (%v): want it gone", len(left), err)
	}
	b, err := os.ReadFile(svg)
	if err != nil {
		t.Fatal(err)
	}
	return rep, b
}

// benchReport runs kvhost bench on dir with the tiny geometry and args,
// checks that it succeeded, and returns its parsed --json report and its
// standard output.
func benchReport(t *testing.T, dir string, args ...string) (*bench.Report, string) {
	t.Helper()
	out := filepath.Join(t.TempDir(), "out.json")
	all := append([]string{"bench", "--dir", dir, "--json", out}, tinyBench...)
	all = append(all, args...)
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), all, &stdout, &stderr); code != 0 {
		t.Fatalf("kvhost %s: exit %d\n%s%s", strings.Join(all, " "), code, stdout.String(), stderr.String())
	}
	return readReport(t, out), stdout.String()
}

// readReport reads the --json report kvhost bench wrote to path.
func readReport(t *testing.T, path string) *bench.Report {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatalf("no report: %v", err)
	}
	defer f.Close()
	rep, err := bench.ReadJSON(f)
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

// benchOnMemory runs kvhost bench with args on a fresh directory on the
// memory file system /dev/shm (spare files and registered files exist only
// there) and returns its report.
func benchOnMemory(t *testing.T, args ...string) *bench.Report {
	t.Helper()
	if st, err := os.Stat("/dev/shm"); err != nil || !st.IsDir() {
		t.Fatal("no /dev/shm: this test needs a memory file system")
	}
	shm, err := os.MkdirTemp("/dev/shm", "kvhost-bench-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(shm) })
	rep, _ := benchReport(t, shm, args...)
	return rep
}

// checkRuns checks what every run of a report must satisfy: each figure
// next to a ceiling of the same run, a fraction in (0, 2], every hit
// moved, and every key of a load checked byte for byte.
func checkRuns(t *testing.T, rep *bench.Report, want int, mover string) {
	t.Helper()
	if len(rep.Runs) != want {
		t.Fatalf("%d runs, want %d", len(rep.Runs), want)
	}
	for _, x := range rep.Runs {
		if x.Mover != mover {
			t.Errorf("run %+v: mover %q, want %q", x, x.Mover, mover)
		}
		if x.GBps <= 0 || x.Ceiling.GBps <= 0 || x.Ceiling.Name == "" || x.Ceiling.Threads != x.Jobs {
			t.Errorf("run %+v: want a throughput and a ceiling measured with as many threads as jobs", x)
		}
		// Both fractions are measured, so their values depend on the
		// machine's load (a ceiling caught by background work can put
		// either above 1; performance is judged by benchmarks, not
		// here). What holds on any machine: both are positive, and the
		// best ceiling over every thread count is at least the
		// same-threads one, so its fraction is at most the other.
		if x.Fraction <= 0 || x.FractionBest <= 0 || x.FractionBest > x.Fraction+1e-9 {
			t.Errorf("run %s %s %d jobs: fraction %.3f, of the best ceiling %.3f; want both positive and the latter at most the former", x.Path, x.Direction, x.Jobs, x.Fraction, x.FractionBest)
		}
		if x.CeilingBest.GBps < x.Ceiling.GBps || x.CeilingBest.Name != x.Ceiling.Name {
			t.Errorf("run %+v: best ceiling %+v below its own", x, x.CeilingBest)
		}
		if x.Bytes != int64(x.Hits)*x.KeyBytes {
			t.Errorf("run %+v: bytes %d, want hits × key bytes", x, x.Bytes)
		}
		if x.Direction == bench.Load && x.VerifiedBytes != int64(x.Keys)*x.KeyBytes {
			t.Errorf("load %+v: verified %d bytes, want every destination byte of every key (%d)", x, x.VerifiedBytes, int64(x.Keys)*x.KeyBytes)
		}
		if x.CPUMsPerGB <= 0 || x.Ceiling.CPUMsPerGB <= 0 {
			t.Errorf("run %s %s %d jobs: CPU %.1f ms/GB, ceiling's %.1f: want both measured", x.Path, x.Direction, x.Jobs, x.CPUMsPerGB, x.Ceiling.CPUMsPerGB)
		}
		if x.JobP99Ms < x.JobP50Ms || x.JobP50Ms <= 0 {
			t.Errorf("run %+v: job latency percentiles p50 %v p99 %v", x, x.JobP50Ms, x.JobP99Ms)
		}
		// A load is held to the second read of the ceiling's files too;
		// a store has no such ceiling.
		switch {
		case x.Direction == bench.Load && (x.CeilingReread.GBps <= 0 || x.CeilingReread.Threads != x.Jobs ||
			!strings.HasSuffix(x.CeilingReread.Name, "second read") ||
			math.Abs(x.FractionReread-x.GBps/x.CeilingReread.GBps) > 1e-9):
			t.Errorf("load %s %d jobs: reread ceiling %+v, fraction %v", x.Path, x.Jobs, x.CeilingReread, x.FractionReread)
		case x.Direction == bench.Store && (x.CeilingReread.GBps != 0 || x.FractionReread != 0):
			t.Errorf("store %s %d jobs: a reread ceiling %+v", x.Path, x.Jobs, x.CeilingReread)
		}
		// GPU memory is held to the same files moved plainly through
		// pinned buffers and the GPU, in the run's direction; host memory
		// has no such ceiling.
		want := map[string]string{bench.Load: "→ pinned → H2D", bench.Store: "D2H → pinned → pwrite"}[x.Direction]
		switch {
		case rep.Memory == "gpu" && (x.CeilingStaged.GBps <= 0 || x.CeilingStaged.Threads != x.Jobs ||
			!strings.Contains(x.CeilingStaged.Name, want) || x.CeilingStaged.CPUMsPerGB <= 0 ||
			math.Abs(x.FractionStaged-x.GBps/x.CeilingStaged.GBps) > 1e-9):
			t.Errorf("%s %s %d jobs on GPU memory: staged ceiling %+v, fraction %v; want one named %q", x.Direction, x.Path, x.Jobs, x.CeilingStaged, x.FractionStaged, want)
		case rep.Memory == "gpu" && strings.Contains(x.CeilingStaged.Name, "↔"):
			t.Errorf("%s %s %d jobs: staged ceiling %q names the plain ceiling's buffer", x.Direction, x.Path, x.Jobs, x.CeilingStaged.Name)
		case rep.Memory != "gpu" && (x.CeilingStaged != bench.Ceiling{} || x.FractionStaged != 0):
			t.Errorf("%s %s %d jobs on host memory: a staged ceiling %+v", x.Direction, x.Path, x.Jobs, x.CeilingStaged)
		}
	}
}

func TestBenchJSONOnHostMemoryIsVerifiedAndHeldToItsCeilings(t *testing.T) {
	rep, svg := runBenchJSON(t, "--memory", "host", "--jobs", "1,4", "--checksum", "on,off", "--path", "auto,posix", "--total", "8MiB")
	// 2 paths × 2 checksum settings × 2 key sizes × 2 job counts × store and load.
	checkRuns(t, rep, 32, "staging")
	if rep.Memory != "host" || rep.Device != "" || rep.Model.Layers != 4 || rep.Schema != bench.Schema {
		t.Errorf("report header %+v", rep)
	}
	ios := map[string]string{}
	for _, x := range rep.Runs {
		ios[x.Path] = x.IO
		if x.KeyBytes != int64(x.TokensPerKey/16)*4*2*8192 {
			t.Errorf("run %+v: key bytes %d do not match the geometry", x, x.KeyBytes)
		}
	}
	if ios["posix"] != "buffered" {
		t.Errorf("posix ran with io %q, want buffered", ios["posix"])
	}
	if err := xml.Unmarshal(svg, new(struct{})); err != nil {
		t.Errorf("the SVG is not well-formed XML: %v", err)
	}
}

// TestBenchRunsEveryCeilingPassItIsAsked: --ceiling-passes 3 runs the
// file ceilings three times a round (the bar counts them), says so in the
// report, and leaves none of their files. The other tests run one pass:
// each pass rewrites and rereads every file, the most of a small bench's
// time.
func TestBenchRunsEveryCeilingPassItIsAsked(t *testing.T) {
	dir := t.TempDir()
	data, out := filepath.Join(dir, "data"), filepath.Join(dir, "out.json")
	args := append([]string{"bench", "--dir", data, "--json", out, "--memory", "host", "--jobs", "2", "--total", "2MiB"}, tinyBench...)
	args = append(args, "--tokens-per-key", "16", "--ceiling-passes", "3", "--progress", "on")
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), args, &stdout, &stderr); code != 0 {
		t.Fatalf("kvhost %s: exit %d\n%s%s", strings.Join(args, " "), code, stdout.String(), stderr.String())
	}
	if !strings.Contains(stderr.String(), "3/3 ceilings, 2 threads") {
		t.Errorf("progress %q: want the ceilings' three passes counted done", stderr.String())
	}
	rep := readReport(t, out)
	if rep.CeilingPasses != 3 {
		t.Errorf("report says %d ceiling passes, want 3", rep.CeilingPasses)
	}
	checkRuns(t, rep, 2, "staging")
	if _, err := os.Lstat(data); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the benchmark left its directory (%v): want it gone with the ceilings' files", err)
	}
}

func TestBenchRoundFractionsBracketTheSummedFraction(t *testing.T) {
	rep, _ := runBenchJSON(t, "--memory", "host", "--jobs", "2", "--rounds", "3", "--total", "8MiB", "--tokens-per-key", "16")
	checkRuns(t, rep, 2, "staging")
	for _, x := range rep.Runs {
		if len(x.RoundFractions) != 3 {
			t.Fatalf("run %+v: %d round fractions, want one per round (3)", x, len(x.RoundFractions))
		}
		lo, hi := slices.Min(x.RoundFractions), slices.Max(x.RoundFractions)
		// The summed fraction is a mediant of the rounds' (same bytes
		// each round), so it lies between them.
		if lo <= 0 || x.Fraction < lo*(1-1e-9) || x.Fraction > hi*(1+1e-9) {
			t.Errorf("%s: fraction %v outside its rounds' %v", x.Direction, x.Fraction, x.RoundFractions)
		}
		// So does the summed GB/s between the rounds' own.
		if len(x.RoundGBps) != 3 {
			t.Fatalf("%s: %d round GB/s, want one per round (3)", x.Direction, len(x.RoundGBps))
		}
		if lo, hi := slices.Min(x.RoundGBps), slices.Max(x.RoundGBps); lo <= 0 || x.GBps < lo*(1-1e-9) || x.GBps > hi*(1+1e-9) {
			t.Errorf("%s: %v GB/s outside its rounds' %v", x.Direction, x.GBps, x.RoundGBps)
		}
	}
	var table bytes.Buffer
	if err := rep.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(table.String(), "by round") || !strings.Contains(table.String(), "least, median and greatest") {
		t.Errorf("the table does not show the rounds' spread:\n%s", table.String())
	}
	// One round: nothing to spread, and no column for it.
	rep, _ = runBenchJSON(t, "--memory", "host", "--jobs", "2", "--total", "8MiB", "--tokens-per-key", "16")
	for _, x := range rep.Runs {
		if x.RoundFractions != nil || x.RoundGBps != nil {
			t.Errorf("one round: round fractions %v, round GB/s %v, want none", x.RoundFractions, x.RoundGBps)
		}
	}
	table.Reset()
	if err := rep.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(table.String(), "by round") {
		t.Errorf("a one-round table shows a by-round column:\n%s", table.String())
	}
}

func TestBenchReadFirstReportsAPlainReadBeforeEachLoad(t *testing.T) {
	for _, extra := range [][]string{nil, {"--foreign"}} {
		args := append([]string{"--memory", "host", "--jobs", "2", "--rounds", "2", "--total", "8MiB", "--tokens-per-key", "16", "--read-first"}, extra...)
		rep, stdout := benchReport(t, filepath.Join(t.TempDir(), "data"), args...)
		checkRuns(t, rep, 2, "staging")
		for _, x := range rep.Runs {
			rf := x.ReadFirst
			switch x.Direction {
			case bench.Load:
				if rf.GBps <= 0 || rf.Threads != x.Jobs || !strings.Contains(rf.Name, "of the load's own files") {
					t.Errorf("%v: load's read first %+v, want a plain read of its files with %d threads", extra, rf, x.Jobs)
				}
				// The read leaves the load's files as they were.
				if x.VerifiedBytes != int64(x.Keys)*x.KeyBytes || x.Hits != x.Keys {
					t.Errorf("%v: load after the read first: %d of %d keys hit, %d bytes verified", extra, x.Hits, x.Keys, x.VerifiedBytes)
				}
			default:
				if rf != (bench.Ceiling{}) {
					t.Errorf("%v: %s has a read first %+v, want none", extra, x.Direction, rf)
				}
			}
		}
		if !strings.Contains(stdout, "read first, before the load") {
			t.Errorf("%v: the table does not show the read first:\n%s", extra, stdout)
		}
	}
	// Without the flag, none.
	rep, _ := runBenchJSON(t, "--memory", "host", "--jobs", "2", "--total", "8MiB", "--tokens-per-key", "16")
	for _, x := range rep.Runs {
		if x.ReadFirst != (bench.Ceiling{}) {
			t.Errorf("no --read-first: %s has a read first %+v", x.Direction, x.ReadFirst)
		}
	}
}

func TestBenchAppendMergesTwoInvocations(t *testing.T) {
	dir := t.TempDir()
	data := filepath.Join(dir, "data")
	first, merged := filepath.Join(dir, "first.json"), filepath.Join(dir, "merged.json")
	base := append([]string{"bench", "--dir", data, "--memory", "host", "--jobs", "2", "--keys", "4"}, tinyBench...)
	var out, errb bytes.Buffer
	if code := run(context.Background(), append(base, "--path", "staging", "--json", first), &out, &errb); code != 0 {
		t.Fatalf("first: exit %d: %s", code, errb.String())
	}
	if code := run(context.Background(), append(base, "--path", "posix", "--append", first, "--json", merged), &out, &errb); code != 0 {
		t.Fatalf("second: exit %d: %s", code, errb.String())
	}
	rep := readReport(t, merged)
	paths := map[string]int{}
	for _, x := range rep.Runs {
		paths[x.Path]++
	}
	if paths["staging"] != 4 || paths["posix"] != 4 || len(rep.MoreCommands) != 1 {
		t.Fatalf("merged runs by path %v, appended commands %d; want 4 and 4 (2 key sizes, store and load), 1", paths, len(rep.MoreCommands))
	}
}

func TestBenchReportRendersASavedReport(t *testing.T) {
	rep, _ := runBenchJSON(t, "--memory", "host", "--jobs", "2", "--keys", "4")
	dir := t.TempDir()
	saved := filepath.Join(dir, "saved.json")
	f, err := os.Create(saved)
	if err != nil {
		t.Fatal(err)
	}
	if err := rep.WriteJSON(f); err != nil {
		t.Fatal(err)
	}
	f.Close()
	var stdout, stderr bytes.Buffer
	svg := filepath.Join(dir, "again.svg")
	if code := run(context.Background(), []string{"bench", "--report", saved, "--svg", svg}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	if !strings.Contains(stdout.String(), "of best") || strings.Count(stdout.String(), "\n") < len(rep.Runs)+2 {
		t.Errorf("rendered table:\n%s", stdout.String())
	}
	if b, err := os.ReadFile(svg); err != nil || xml.Unmarshal(b, new(struct{})) != nil {
		t.Errorf("no well-formed SVG from a saved report: %v", err)
	}
}

func TestBenchLoadsWithMissesLeaveMissedBlocksUntouched(t *testing.T) {
	rep, _ := runBenchJSON(t, "--memory", "host", "--jobs", "2", "--mix", "read", "--hit-ratio", "0.5", "--total", "8MiB", "--keys-per-job", "2")
	checkRuns(t, rep, 2, "staging")
	for _, x := range rep.Runs {
		if x.Direction != bench.Load || x.Hits != x.Keys/2 || x.Misses != x.Keys/2 || x.KeysPerJob != 2 {
			t.Errorf("run %+v: want loads only, half of them hits and half misses, of 2-key jobs", x)
		}
	}
}

func TestBenchKeysPerFileSetsThePolicysPackingAndSaysSo(t *testing.T) {
	rep, _ := runBenchJSON(t, "--memory", "host", "--jobs", "2", "--keys-per-job", "4", "--keys-per-file", "4", "--total", "8MiB")
	checkRuns(t, rep, 4, "staging")
	for _, x := range rep.Runs {
		if x.KeysPerFile != 4 || x.KeysPerJob != 4 || x.Hits != x.Keys {
			t.Errorf("run %+v: want 4 keys per file (the namespace's layout), jobs of 4 keys, every key moved", x)
		}
	}
	var table bytes.Buffer
	if err := rep.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(table.String(), "; 4 keys per file") {
		t.Errorf("table does not say the keys per file:\n%s", table.String())
	}
	// More keys per file than per job: a file holds one job's keys.
	rep, _ = runBenchJSON(t, "--memory", "host", "--jobs", "2", "--keys-per-job", "2", "--keys-per-file", "8", "--total", "8MiB", "--tokens-per-key", "16")
	for _, x := range rep.Runs {
		if x.KeysPerFile != 2 {
			t.Errorf("run %+v: files of jobs of 2 keys reported as %d keys per file, want 2", x, x.KeysPerFile)
		}
	}
	// Without the flag the policy's default: a key per file, not mentioned.
	rep, _ = runBenchJSON(t, "--memory", "host", "--jobs", "2", "--keys-per-job", "4", "--total", "8MiB", "--tokens-per-key", "16")
	for _, x := range rep.Runs {
		if x.KeysPerFile != 1 {
			t.Errorf("run %+v: want 1 key per file by default", x)
		}
	}
	table.Reset()
	if err := rep.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(table.String(), "keys per file") {
		t.Errorf("table of unpacked runs speaks of keys per file:\n%s", table.String())
	}
}

// TestBenchGPUMemoryThroughTheDaemonsPathsOnFakeCUDA runs the benchmark
// with the paged cache in (fake) GPU memory: the daemon's GPU paths move
// it through the gpu-staging pipeline, ceilings use pinned buffers, and
// the pinned copy ceilings are measured.
func TestBenchGPUMemoryThroughTheDaemonsPathsOnFakeCUDA(t *testing.T) {
	lib := cudatest.Build(t)
	missing := filepath.Join(t.TempDir(), "libcufile.so.0")
	rep, _ := runBenchJSON(t, "--memory", "gpu", "--cuda-library", lib, "--cufile-library", missing,
		"--jobs", "1,3", "--path", "staging,auto", "--checksum", "on,off", "--total", "8MiB")
	checkRuns(t, rep, 32, "gpu-staging")
	if rep.Memory != "gpu" || !strings.Contains(rep.Device, "device 0 at") {
		t.Errorf("memory %q device %q: want gpu memory on device 0", rep.Memory, rep.Device)
	}
	names := ""
	for _, c := range rep.Ceilings {
		names += c.Name + ";"
		if c.GBps <= 0 {
			t.Errorf("ceiling %+v not measured", c)
		}
	}
	if !strings.Contains(names, "pinned H2D") || !strings.Contains(names, "pinned D2H") {
		t.Errorf("ceilings %q: want pinned H2D and D2H", names)
	}
	for _, x := range rep.Runs {
		if !strings.Contains(x.Ceiling.Name, "pinned") {
			t.Errorf("run %+v: with a GPU the file ceiling reads into pinned buffers", x)
		}
	}
}

// TestBenchStagedCeilingsNameDurableAndColdPasses: with durable stores
// and cold reads the staged ceilings say so, as the plain ones do, and
// name their own path.
func TestBenchStagedCeilingsNameDurableAndColdPasses(t *testing.T) {
	lib := cudatest.Build(t)
	missing := filepath.Join(t.TempDir(), "libcufile.so.0")
	rep, _ := runBenchJSON(t, "--memory", "gpu", "--cuda-library", lib, "--cufile-library", missing,
		"--jobs", "2", "--path", "staging", "--checksum", "on", "--total", "8MiB", "--fsync", "true", "--drop-caches")
	checkRuns(t, rep, 4, "gpu-staging")
	for _, x := range rep.Runs {
		want := map[string]string{bench.Store: " + fsync, ", bench.Load: " (cold) → pinned"}[x.Direction]
		if !strings.Contains(x.CeilingStaged.Name, want) {
			t.Errorf("%s: staged ceiling %q, want one naming %q", x.Direction, x.CeilingStaged.Name, want)
		}
	}
}

// With --drop-caches the first read of the ceiling's files is cold and
// named so; the second read follows it with nothing dropped between, so
// it is warm and not named cold.
func TestBenchSecondReadCeilingIsNotNamedColdWithDropCaches(t *testing.T) {
	rep, _ := runBenchJSON(t, "--memory", "host", "--jobs", "2", "--total", "2MiB", "--layers", "4", "--tokens-per-key", "16", "--drop-caches")
	loads := 0
	for _, x := range rep.Runs {
		if x.Direction != bench.Load {
			continue
		}
		loads++
		if !strings.Contains(x.Ceiling.Name, "(cold)") {
			t.Errorf("load ceiling %q: want the first read named cold", x.Ceiling.Name)
		}
		if strings.Contains(x.CeilingReread.Name, "cold") || !strings.Contains(x.CeilingReread.Name, "second read") {
			t.Errorf("load's second-read ceiling %q: it reads warm pages; want it named a second read, not cold", x.CeilingReread.Name)
		}
	}
	if loads == 0 {
		t.Fatal("no load run in the report")
	}
}

// TestBenchReportsWhereChecksumsRan: each run of the report says where its
// checksums were computed: on the CPU by default, by the checksum kernel
// with gpu.checksum_on = "gpu", and nowhere with checksums off.
func TestBenchReportsWhereChecksumsRan(t *testing.T) {
	lib := cudatest.Build(t)
	missing := filepath.Join(t.TempDir(), "libcufile.so.0")
	gpuSums := filepath.Join(t.TempDir(), "gpu-sums.toml")
	if err := os.WriteFile(gpuSums, []byte(fmt.Sprintf("[gpu]\nchecksum_on = \"gpu\"\ncuda_driver_library = %q\n", lib)), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		args []string
		want string // where runs with checksums on computed them
	}{
		{"defaults", nil, "cpu"},
		{"gpu.checksum_on = gpu", []string{"--config", gpuSums}, "gpu"},
	} {
		t.Run(c.name, func(t *testing.T) {
			args := append([]string{"--memory", "gpu", "--cuda-library", lib, "--cufile-library", missing,
				"--jobs", "1", "--path", "staging", "--checksum", "on,off", "--total", "8MiB"}, c.args...)
			rep, _ := runBenchJSON(t, args...)
			if len(rep.Runs) == 0 {
				t.Fatal("no runs")
			}
			for _, x := range rep.Runs {
				want := c.want
				if !x.Checksums {
					want = ""
				}
				if x.ChecksumOn != want {
					t.Errorf("%s run, checksums %v: checksum_on %q, want %q", x.Direction, x.Checksums, x.ChecksumOn, want)
				}
			}
		})
	}
}

// TestBenchMovesRegisteredFilesDirectlyAsTheDaemonDoes: on a memory file
// system the benchmark opens the GPU paths with the daemon's
// gpu.register_files, so that later jobs on a file move it straight
// between GPU memory and its registered pages (direct_files), and with
// register_files = 0 none does. Every loaded byte is verified either way.
func TestBenchMovesRegisteredFilesDirectlyAsTheDaemonDoes(t *testing.T) {
	lib := cudatest.Build(t)
	off := filepath.Join(t.TempDir(), "off.toml")
	if err := os.WriteFile(off, []byte("[gpu]\nregister_files = 0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		args   []string
		direct bool
	}{
		{"default", nil, true},
		{"register_files = 0", []string{"--config", off}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"--memory", "gpu", "--cuda-library", lib, "--path", "staging", "--full",
				"--rounds", "3", "--jobs", "2", "--tokens-per-key", "16", "--total", "4MiB"}, tc.args...)
			rep := benchOnMemory(t, args...)
			for _, x := range rep.Runs {
				if x.Direction == bench.Load && x.VerifiedBytes != int64(x.Keys)*x.KeyBytes {
					t.Errorf("load: %d of %d keys' bytes verified", x.VerifiedBytes/x.KeyBytes, x.Keys)
				}
				// Per round, at most every file; a store is direct only into
				// a reused spare (fresh files are registered after their
				// first job); under --full later rounds' stores reuse the
				// registered files of the round before.
				switch {
				case x.DirectFiles < 0 || x.DirectFiles > x.Keys:
					t.Errorf("%s %s: %d files direct per round of %d", sizeOf(x.KeyBytes), x.Direction, x.DirectFiles, x.Keys)
				case x.Direction == bench.Store && x.DirectFiles > x.ReusedFiles:
					t.Errorf("store %s: %d files direct per round but %d reused", sizeOf(x.KeyBytes), x.DirectFiles, x.ReusedFiles)
				case (x.DirectFiles > 0) != tc.direct:
					t.Errorf("%s %s: %d files direct per round, want direct %v", sizeOf(x.KeyBytes), x.Direction, x.DirectFiles, tc.direct)
				}
				// Each wait is for one offer, and a round offers each file
				// at most once per job; without registration, none.
				if x.RegistrationWaits < 0 || x.RegistrationWaits > 2*x.Keys || (!tc.direct && x.RegistrationWaits != 0) {
					t.Errorf("%s %s: %d registration waits per round of %d files (registration %v)", sizeOf(x.KeyBytes), x.Direction, x.RegistrationWaits, x.Keys, tc.direct)
				}
			}
		})
	}
}

// TestBenchNoGapLoadsRightAfterTheStoreAndSaysSo: with --no-gap every
// load phase is marked, its bytes verified and held to ceilings measured
// in the same rounds (after the loads); without, none is marked. (Which
// path the loads take depends on the registrar's pace: the GPU machine's
// figures say, not a unit test.)
func TestBenchNoGapLoadsRightAfterTheStoreAndSaysSo(t *testing.T) {
	lib := cudatest.Build(t)
	for _, tc := range []struct {
		name  string
		noGap bool
	}{{"no gap", true}, {"gap", false}} {
		t.Run(tc.name, func(t *testing.T) {
			args := []string{"--memory", "gpu", "--cuda-library", lib, "--path", "staging", "--preallocate", "0",
				"--rounds", "2", "--jobs", "2", "--tokens-per-key", "16", "--total", "4MiB"}
			if tc.noGap {
				args = append(args, "--no-gap")
			}
			rep := benchOnMemory(t, args...)
			loads := 0
			for _, x := range rep.Runs {
				if x.Direction != bench.Load {
					continue
				}
				loads++
				if x.NoGap != tc.noGap {
					t.Errorf("load marked no_gap %v, want %v", x.NoGap, tc.noGap)
				}
				if x.VerifiedBytes != int64(x.Keys)*x.KeyBytes || x.Ceiling.GBps <= 0 || x.Fraction <= 0 {
					t.Errorf("load: %d of %d bytes verified, ceiling %v GB/s, fraction %v", x.VerifiedBytes, int64(x.Keys)*x.KeyBytes, x.Ceiling.GBps, x.Fraction)
				}
			}
			if loads == 0 {
				t.Fatal("no load phase reported")
			}
		})
	}
}

// TestBenchRestartAndForeignLoadsFindTheirFilesAsADaemonWould: with
// --restart each round's load runs in an engine opened after the store,
// which found the round's files on the directory (files_at_restart); with
// a gap its new GPU paths' registrar has registered every one before the
// load, so that all move straight from their pages. With --foreign the
// load runs through a second engine (another node's, with GPU paths of its
// own) opened before the store, which found every file on the load itself
// (files_discovered). Every loaded byte is verified, in host memory and in
// (fake) GPU memory.
func TestBenchRestartAndForeignLoadsFindTheirFilesAsADaemonWould(t *testing.T) {
	lib := cudatest.Build(t)
	gpuArgs := []string{"--memory", "gpu", "--cuda-library", lib, "--path", "staging"}
	restarted := func(direct, gap bool) func(x bench.Run) string {
		return func(x bench.Run) string {
			switch {
			case !x.Restart || x.Foreign || x.FilesAtRestart != x.Keys:
				return fmt.Sprintf("restart %v, foreign %v, %d files found at restart; want a restart that found every key's file", x.Restart, x.Foreign, x.FilesAtRestart)
			case direct && (x.RegisteredAtRestart != x.Keys || x.DirectFiles != x.Keys):
				return fmt.Sprintf("%d files registered at restart, %d direct per round; want all %d", x.RegisteredAtRestart, x.DirectFiles, x.Keys)
			case (direct && gap) != (x.RestartWarmMs > 0):
				return fmt.Sprintf("restart_warm_ms %v (GPU paths %v, a gap %v); want it timed exactly where the load waited for a registrar", x.RestartWarmMs, direct, gap)
			}
			return ""
		}
	}
	foreign := func(x bench.Run) string {
		if !x.Foreign || x.Restart || x.FilesDiscovered != x.Keys {
			return fmt.Sprintf("foreign %v, restart %v, %d files found on the load; want every key's file found by the second engine", x.Foreign, x.Restart, x.FilesDiscovered)
		}
		return ""
	}
	for _, tc := range []struct {
		name  string
		args  []string
		check func(bench.Run) string
	}{
		{"restart, host memory", []string{"--restart", "--memory", "host"}, restarted(false, true)},
		{"restart, gpu memory", append([]string{"--restart", "--preallocate", "0"}, gpuArgs...), restarted(true, true)},
		{"restart, gpu memory, no gap", append([]string{"--restart", "--preallocate", "0", "--no-gap"}, gpuArgs...), restarted(false, false)},
		{"foreign, host memory", []string{"--foreign", "--memory", "host"}, foreign},
		{"foreign, gpu memory", append([]string{"--foreign"}, gpuArgs...), foreign},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"--rounds", "2", "--jobs", "2", "--tokens-per-key", "16", "--total", "4MiB"}, tc.args...)
			rep := benchOnMemory(t, args...)
			loads := 0
			for _, x := range rep.Runs {
				if x.Direction != bench.Load {
					if x.Restart || x.Foreign {
						t.Errorf("store marked restart %v, foreign %v", x.Restart, x.Foreign)
					}
					if x.Preallocate > 0 && x.ReusedFiles != x.Keys {
						// The second engine (--foreign) leaves the first
						// engine's spares: their owner runs.
						t.Errorf("store: %d of %d files per round written into spares, want all", x.ReusedFiles, x.Keys)
					}
					continue
				}
				loads++
				if x.VerifiedBytes != int64(x.Keys)*x.KeyBytes {
					t.Errorf("load: %d of %d keys' bytes verified", x.VerifiedBytes/x.KeyBytes, x.Keys)
				}
				if why := tc.check(x); why != "" {
					t.Errorf("load: %s", why)
				}
			}
			if loads == 0 {
				t.Fatal("no load phase reported")
			}
		})
	}
}

// TestBenchStoresIntoSparesMadeAheadWithPreallocate: with --preallocate
// of a round's bytes, every store of a cache with room writes into a
// spare file the engine made ahead, and (on the fake CUDA library) every
// one of them moves straight into the file's registered pages.
func TestBenchStoresIntoSparesMadeAheadWithPreallocate(t *testing.T) {
	lib := cudatest.Build(t)
	// Two key sizes, two checksum settings: each setting opens its own
	// engine, in which the second size follows the first. A budget of
	// 5 MiB holds a round of either size (4 MiB of keys and their
	// headers), but not half of it: the first size's namespace is
	// released before the second's runs, which get the whole budget.
	rep := benchOnMemory(t, "--memory", "gpu", "--cuda-library", lib, "--path", "staging", "--preallocate", "5MiB",
		"--rounds", "2", "--jobs", "2", "--tokens-per-key", "16,32", "--checksum", "on,off", "--total", "4MiB")
	stores := 0
	for _, x := range rep.Runs {
		if x.Preallocate != 5<<20 {
			t.Errorf("%s %s: report says preallocate %d, want %d", sizeOf(x.KeyBytes), x.Direction, x.Preallocate, 5<<20)
		}
		switch x.Direction {
		case bench.Load:
			if x.VerifiedBytes != int64(x.Keys)*x.KeyBytes {
				t.Errorf("load: %d of %d keys' bytes verified", x.VerifiedBytes/x.KeyBytes, x.Keys)
			}
		case bench.Store:
			stores++
			if x.ReusedFiles != x.Keys || x.DirectFiles != x.Keys {
				t.Errorf("store %s, checksums %v: %d files reused and %d direct per round of %d; want every one", sizeOf(x.KeyBytes), x.Checksums, x.ReusedFiles, x.DirectFiles, x.Keys)
			}
			// Stores into files that exist are held to writes into
			// files that exist.
			if !strings.Contains(x.Ceiling.Name, "into existing files") || x.Ceiling.GBps <= 0 {
				t.Errorf("store ceiling %q at %.2f GB/s: want a measured overwrite of existing files", x.Ceiling.Name, x.Ceiling.GBps)
			}
		}
	}
	if stores != 4 {
		t.Fatalf("%d store runs in the report, want 4 (two sizes, checksums on and off)", stores)
	}
}

// On a memory file system the benchmark's engine makes spares ahead of
// stores as the daemon's does by default (preallocate auto: an eighth of
// the mount's capacity, at most 4 GiB), and --preallocate 0 turns that off.
func TestBenchMakesSparesAheadOnAMemoryMountByDefault(t *testing.T) {
	for _, tc := range []struct {
		name   string
		args   []string
		spares bool
	}{
		{"default", nil, true},
		{"--preallocate auto", []string{"--preallocate", "auto"}, true},
		{"--preallocate 0", []string{"--preallocate", "0"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Rounds of 2 MiB in keys of 256 KiB: the default budget, an
			// eighth of what /dev/shm holds, takes a whole round where
			// /dev/shm has 17 MiB free.
			args := append([]string{"--memory", "host", "--rounds", "2", "--jobs", "1", "--layers", "4", "--tokens-per-key", "16", "--total", "2MiB"}, tc.args...)
			rep := benchOnMemory(t, args...)
			stores := 0
			for _, x := range rep.Runs {
				if tc.spares != (x.Preallocate > 0) || x.Preallocate > 4<<30 {
					t.Errorf("%s: report says preallocate %d, want spares made ahead %v (at most 4 GiB)", x.Direction, x.Preallocate, tc.spares)
				}
				if x.Direction != bench.Store {
					continue
				}
				stores++
				if want := map[bool]int{true: x.Keys, false: 0}[tc.spares]; x.ReusedFiles != want {
					t.Errorf("store: %d files of %d a round written into spares, want %d", x.ReusedFiles, x.Keys, want)
				}
				if overwrite := strings.Contains(x.Ceiling.Name, "into existing files"); overwrite != tc.spares || x.Ceiling.GBps <= 0 {
					t.Errorf("store ceiling %q at %.2f GB/s: want a measured write of existing files %v", x.Ceiling.Name, x.Ceiling.GBps, tc.spares)
				}
			}
			if stores == 0 {
				t.Fatal("no store run in the report")
			}
		})
	}
}

// Stores that took no spare (a budget smaller than one file) are held to
// writes into fresh files, as without --preallocate.
func TestBenchStoresThatTookNoSpareAreHeldToFreshWrites(t *testing.T) {
	lib := cudatest.Build(t)
	rep := benchOnMemory(t, "--memory", "gpu", "--cuda-library", lib, "--path", "staging", "--preallocate", "32KiB",
		"--rounds", "2", "--jobs", "2", "--tokens-per-key", "16", "--total", "4MiB")
	stores := 0
	for _, x := range rep.Runs {
		if x.Direction != bench.Store {
			continue
		}
		stores++
		if x.ReusedFiles != 0 || strings.Contains(x.Ceiling.Name, "into existing files") || x.Ceiling.GBps <= 0 {
			t.Errorf("store %s: %d files reused a round, ceiling %q at %.2f GB/s; want none reused and a measured write of fresh files", sizeOf(x.KeyBytes), x.ReusedFiles, x.Ceiling.Name, x.Ceiling.GBps)
		}
	}
	if stores == 0 {
		t.Fatal("no store run in the report")
	}
}

// Stores of which some took a spare and the rest wrote fresh files (a
// budget of spares smaller than a round) are held to a write of as many
// existing files and as many new ones, not to the fresh writes alone.
func TestBenchStoresThatTookSomeSparesAreHeldToTheSameMix(t *testing.T) {
	rep := benchOnMemory(t, "--memory", "host", "--preallocate", "1MiB",
		"--rounds", "2", "--jobs", "2", "--layers", "4", "--tokens-per-key", "16", "--total", "2MiB")
	stores := 0
	for _, x := range rep.Runs {
		if x.Direction != bench.Store {
			continue
		}
		stores++
		if x.ReusedFiles == 0 || x.ReusedFiles >= x.Keys {
			t.Fatalf("store: %d of %d files a round written into spares; the test needs some and not all", x.ReusedFiles, x.Keys)
		}
		if !strings.Contains(x.Ceiling.Name, "into existing and new files") || x.Ceiling.GBps <= 0 {
			t.Errorf("store with %d of %d files into spares: ceiling %q at %.2f GB/s; want a measured write into existing and new files", x.ReusedFiles, x.Keys, x.Ceiling.Name, x.Ceiling.GBps)
		}
	}
	if stores == 0 {
		t.Fatal("no store run in the report")
	}
}

// A write ceiling summed over rounds of different mixes (one round's
// files all into spares, the next's all fresh) is named for what it
// timed, a write into existing and new files, not for the last round's.
func TestBenchWriteCeilingOverRoundsOfDifferentMixesIsNamedForTheMix(t *testing.T) {
	ctx := context.Background()
	r := &benchRun{o: benchOptions{ceilingPasses: 1}, root: t.TempDir()}
	defer func() {
		if r.bufs != nil {
			r.bufs.free()
		}
	}()
	dir := t.TempDir()
	files := make([]string, 4)
	for i := range files {
		files[i] = filepath.Join(dir, fmt.Sprintf("f%d", i))
		if err := os.WriteFile(files[i], make([]byte, 64<<10), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	var ceil ceilingTotals
	for round, spares := range []int{len(files), 0} {
		if err := r.measureCeilings(ctx, files, 2, false, 0, spares, &ceil); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
	}
	if w := ceil.pair(2).write; !strings.Contains(w.Name, "into existing and new files") || len(ceil.wround) != 2 {
		t.Errorf("write ceiling of a round into existing files and a round into new ones: %q over %d rounds; want a write into existing and new files over 2", w.Name, len(ceil.wround))
	}
}

// TestBenchCuFilePathMovesGPUMemoryWithCuFile forces the cufile path with
// the fake libcudart and libcufile (compatibility mode, allowed): cuFile
// registers the files and moves the bytes, and every loaded byte checks.
func TestBenchCuFilePathMovesGPUMemoryWithCuFile(t *testing.T) {
	cudaLib, cufileLib := cudatest.Build(t), daemontest.BuildFakeCuFile(t)
	rep, _ := runBenchJSON(t, "--memory", "gpu", "--cuda-library", cudaLib, "--cufile-library", cufileLib,
		"--path", "cufile", "--allow-compat", "--jobs", "2", "--checksum", "on,off", "--total", "4MiB")
	checkRuns(t, rep, 8, "cufile")
}

func TestBenchCuFilePathWithoutCompatSaysHowToAllowIt(t *testing.T) {
	cudaLib, cufileLib := cudatest.Build(t), daemontest.BuildFakeCuFile(t)
	dir := t.TempDir()
	var stdout, stderr bytes.Buffer
	args := append([]string{"bench", "--dir", dir, "--memory", "gpu", "--cuda-library", cudaLib, "--cufile-library", cufileLib, "--path", "cufile", "--jobs", "1", "--keys", "2"}, tinyBench...)
	if code := run(context.Background(), args, &stdout, &stderr); code != 1 || !strings.Contains(stderr.String(), "--allow-compat") {
		t.Fatalf("exit %d, stderr %q; want 1 and a hint to pass --allow-compat", code, stderr.String())
	}
}

func TestBenchRejectsBadFlagsNamingThem(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "libcudart.so.13")
	cases := []struct {
		args []string
		code int
		want string
	}{
		{[]string{}, 2, "--dir is required"},
		{[]string{"--dir", dir, "--path", "nvme"}, 2, `--path "nvme"`},
		{[]string{"--dir", dir, "--jobs", "1,0"}, 2, "--jobs"},
		{[]string{"--dir", dir, "--checksum", "maybe"}, 2, "--checksum"},
		{[]string{"--dir", dir, "--mix", "append"}, 2, "--mix"},
		{[]string{"--dir", dir, "--hit-ratio", "1.5"}, 2, "--hit-ratio"},
		{[]string{"--dir", dir, "--memory", "tpu"}, 2, "--memory"},
		{[]string{"--dir", dir, "--fsync", "sometimes"}, 2, "--fsync"},
		{[]string{"--dir", dir, "--total", "lots"}, 2, "--total"},
		{[]string{"--dir", dir, "--preallocate", "-1GiB"}, 2, "--preallocate"},
		{[]string{"--dir", dir, "--full", "--keys", "8"}, 2, "--full"},
		{[]string{"--dir", dir, "--full", "--mix", "read"}, 2, "--full"},
		{[]string{"--dir", dir, "--no-gap", "--mix", "read"}, 2, "--no-gap"},
		{[]string{"--dir", dir, "--restart", "--mix", "write"}, 2, "--restart"},
		{[]string{"--dir", dir, "--restart", "--full"}, 2, "--restart and --full"},
		{[]string{"--dir", dir, "--foreign", "--mix", "read"}, 2, "--foreign"},
		{[]string{"--dir", dir, "--foreign", "--restart"}, 2, "--foreign cannot be combined"},
		{[]string{"--dir", dir, "--read-first", "--mix", "write"}, 2, "--read-first"},
		{[]string{"--dir", dir, "--keys-per-file", "257"}, 2, "--keys-per-file 257"},
		{[]string{"--dir", dir, "--keys-per-file", "-1"}, 2, "--keys-per-file -1"},
		{[]string{"--dir", dir, "--memory", "gpu", "--cuda-library", missing}, 1, "--memory gpu"},
		{[]string{"--dir", dir, "--memory", "host", "--path", "cufile"}, 1, "needs a GPU"},
		{[]string{"--dir", dir, "--memory", "host", "--layers", "0"}, 1, "Layers"},
	}
	for _, c := range cases {
		var stdout, stderr bytes.Buffer
		code := run(context.Background(), append([]string{"bench", "--progress", "off"}, c.args...), &stdout, &stderr)
		if code != c.code || !strings.Contains(stderr.String(), c.want) {
			t.Errorf("kvhost bench %s: exit %d, stderr %q; want exit %d naming %q", strings.Join(c.args, " "), code, stderr.String(), c.code, c.want)
		}
	}
}

func TestBenchInterruptedWritesThePhasesThatFinishedMarkedPartial(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "out.json")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// Cancel once the second job count starts (the first one's runs are
	// in the report); the JSON file appears
	// only at the end, so watch the progress output instead.
	pr, pw := io.Pipe()
	go func() {
		b := make([]byte, 4096)
		seen := ""
		for {
			n, err := pr.Read(b)
			seen += string(b[:n])
			if strings.Contains(seen, "keys, 2 jobs") {
				cancel()
			}
			if err != nil {
				return
			}
		}
	}()
	args := append([]string{"bench", "--dir", filepath.Join(dir, "data"), "--memory", "host", "--json", out, "--jobs", "1,2,3,4", "--keys", "8"}, tinyBench...)
	args = append(args, "--progress", "on")
	code := run(ctx, args, io.Discard, pw)
	pw.Close()
	if code != 1 {
		t.Fatalf("interrupted bench: exit %d, want 1", code)
	}
	rep := readReport(t, out)
	if !rep.Partial || len(rep.Runs) == 0 || len(rep.Runs) >= 16 {
		t.Fatalf("partial %v with %d runs; want a partial report of the runs before the interruption", rep.Partial, len(rep.Runs))
	}
}

func TestProgressBarDrawsOnlyWhenAsked(t *testing.T) {
	var b bytes.Buffer
	p := bench.NewProgress(&b, true)
	p.Start("store", 4)
	p.Step(4)
	p.Clear()
	if !strings.Contains(b.String(), "[##############################] 4/4 store") {
		t.Fatalf("bar output %q", b.String())
	}
	var none *bench.Progress = bench.NewProgress(io.Discard, false)
	none.Start("x", 1) // a nil bar draws nothing and does not panic
	none.Step(1)
}

func TestBenchProfilesAreGzippedProfilesOfTheRun(t *testing.T) {
	for _, tc := range []struct {
		flag string
		want []string // the profile's sample and period types
	}{
		{"--cpu-profile", []string{"samples", "cpu", "nanoseconds"}},
		{"--mutex-profile", []string{"contentions", "delay", "nanoseconds"}},
	} {
		t.Run(tc.flag, func(t *testing.T) {
			prof := filepath.Join(t.TempDir(), "prof.pprof")
			runBenchJSON(t, "--memory", "host", "--jobs", "2", "--total", "4MiB", tc.flag, prof)
			f, err := os.Open(prof)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			z, err := gzip.NewReader(f) // pprof's format: a gzipped protocol buffer
			if err != nil {
				t.Fatalf("the profile is not gzipped: %v", err)
			}
			b, err := io.ReadAll(z)
			if err != nil || len(b) == 0 {
				t.Fatalf("the profile holds %d bytes (%v)", len(b), err)
			}
			for _, want := range tc.want {
				if !bytes.Contains(b, []byte(want)) {
					t.Errorf("the profile's string table lacks %q: not a %s profile", want, tc.flag)
				}
			}
		})
	}
}

func TestBenchTraceIsAnExecutionTraceOfTheRun(t *testing.T) {
	out := filepath.Join(t.TempDir(), "run.trace")
	runBenchJSON(t, "--memory", "host", "--jobs", "2", "--total", "4MiB", "--trace", out)
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	// An execution trace starts with its format's header, "go 1.NN trace".
	if !bytes.HasPrefix(b, []byte("go 1.")) || !bytes.Contains(b[:min(len(b), 16)], []byte(" trace")) {
		t.Fatalf("%s starts %q: not an execution trace", out, b[:min(len(b), 16)])
	}
	// The run's jobs ran on goroutines the trace must name by function.
	if !bytes.Contains(b, []byte("runBenchmark")) {
		t.Errorf("%s (%d bytes) names no runBenchmark frame: not a trace of the run", out, len(b))
	}
}

func TestBenchProfileInAMissingDirectoryIsRefused(t *testing.T) {
	for _, flag := range []string{"--cpu-profile", "--mutex-profile", "--trace"} {
		var stdout, stderr bytes.Buffer
		args := append([]string{"bench", "--dir", t.TempDir(), flag, filepath.Join(t.TempDir(), "no", "prof.pprof")}, tinyBench...)
		if code := run(context.Background(), args, &stdout, &stderr); code != 2 || !strings.Contains(stderr.String(), flag) {
			t.Errorf("%s: exit %d, stderr %q: want 2 and a message naming %s", flag, code, stderr.String(), flag)
		}
	}
}

func TestBenchFullCacheStoresIntoEvictedFilesOnTmpfsUnlessTurnedOff(t *testing.T) {
	noReuse := filepath.Join(t.TempDir(), "noreuse.toml")
	if err := os.WriteFile(noReuse, []byte("[engine]\nreuse_files = false\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		args   []string
		reused bool
	}{
		{"default", nil, true},
		{"reuse_files = false", []string{"--config", noReuse}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"--memory", "host", "--full", "--rounds", "3", "--jobs", "2", "--tokens-per-key", "16", "--total", "4MiB"}, tc.args...)
			rep := benchOnMemory(t, args...)
			for _, x := range rep.Runs {
				switch x.Direction {
				case bench.Store:
					if (x.ReusedFiles > 0) != tc.reused {
						t.Errorf("store: %d files reused per round, want reuse %v", x.ReusedFiles, tc.reused)
					}
					if !strings.Contains(x.Ceiling.Name, "into existing files") || x.Ceiling.GBps <= 0 {
						t.Errorf("store ceiling %q at %.2f GB/s: want a measured overwrite of existing files", x.Ceiling.Name, x.Ceiling.GBps)
					}
				case bench.Load:
					// Each round's keys survive the eviction its stores cause.
					if x.Hits != x.Keys || x.VerifiedBytes != int64(x.Keys)*x.KeyBytes {
						t.Errorf("load: %d of %d keys, %d bytes verified: a full cache lost the round's own keys", x.Hits, x.Keys, x.VerifiedBytes)
					}
				}
			}
		})
	}
}

// TestBenchKeysHonoursTotal: --total sets the keys of a phase; a total
// too small for the largest job count is an error naming the sizes, never
// a silently larger run (--total 256MiB of 32 MiB keys with --jobs 16
// used to run 1 GiB).
func TestBenchKeysHonoursTotal(t *testing.T) {
	const key = 32 << 20
	for _, tc := range []struct {
		name         string
		total        int64
		keys         int
		jobs         []int
		want         int
		errSubstring string
	}{
		{"256MiB at 4 jobs", 256 << 20, 0, []int{1, 4}, 8, ""},
		{"1GiB at 16 jobs", 1 << 30, 0, []int{1, 8, 16}, 32, ""},
		{"256MiB at 16 jobs", 256 << 20, 0, []int{1, 8, 16}, 0, "--total 256 MiB holds 8 keys of 32 MiB, but --jobs 16 needs at least 32 keys (1 GiB)"},
		{"--keys too few", 1 << 30, 4, []int{16}, 0, "--keys 4, but --jobs 16 needs at least 32 keys"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := benchOptions{total: tc.total, keys: tc.keys, jobs: tc.jobs, keysPerJob: 1}
			got, err := benchKeys(o, key)
			if tc.errSubstring != "" {
				if err == nil || !strings.Contains(err.Error(), tc.errSubstring) {
					t.Fatalf("benchKeys = %d, %v; want an error containing %q", got, err, tc.errSubstring)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("benchKeys = %d, %v; want %d keys", got, err, tc.want)
			}
		})
	}
}

func TestBenchTakesTheConfiguredMountsIOMode(t *testing.T) {
	for _, mode := range []string{"buffered", "direct"} {
		t.Run(mode, func(t *testing.T) {
			dir := t.TempDir()
			if mode == "direct" {
				if ok, err := fsys.ProbeDirect(fsys.OS{}, dir); err != nil || !ok {
					t.Skipf("%s refuses O_DIRECT (%v): nothing to force", dir, err)
				}
			}
			cfg := filepath.Join(dir, "kvhost.toml")
			body := fmt.Sprintf("[[mount]]\npath = %q\nio = %q\n", filepath.Join(dir, "data"), mode)
			if err := os.WriteFile(cfg, []byte(body), 0o600); err != nil {
				t.Fatal(err)
			}
			rep, _ := benchReport(t, filepath.Join(dir, "data"), "--memory", "host", "--config", cfg, "--path", "auto,posix", "--jobs", "1", "--total", "4MiB")
			ios := map[string]string{}
			for _, x := range rep.Runs {
				ios[x.Path] = x.IO
			}
			if ios["auto"] != mode || ios["posix"] != "buffered" {
				t.Errorf("paths ran with io %v, want auto %s and posix buffered", ios, mode)
			}
		})
	}
}

// TestBenchReportsTheLoadReadersItsLoadsEndedWith: a disk mount's load
// readers when the loads ended (here fixed by the configuration: 1,
// buffered, never moved) are in the report and below the table, so that
// a run shows what tuning settled on.
func TestBenchReportsTheLoadReadersItsLoadsEndedWith(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "kvhost.toml")
	body := fmt.Sprintf("[[mount]]\npath = %q\nio = \"buffered\"\nload_readers = 1\n", filepath.Join(dir, "data"))
	if err := os.WriteFile(cfg, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	rep, stdout := benchReport(t, filepath.Join(dir, "data"), "--memory", "host", "--config", cfg, "--jobs", "2", "--total", "4MiB")
	if rep.FSType == "tmpfs" {
		t.Skipf("%s is a memory file system, whose loads take no readers; the test needs a disk", dir)
	}
	loads := 0
	for _, x := range rep.Runs {
		if x.Direction != bench.Load {
			continue
		}
		loads++
		if x.LoadReaders != 1 || !x.LoadBuffered || x.LoadReadersChanged != 0 {
			t.Errorf("load of %d jobs: readers %d buffered %v changes %d; want the configured 1, buffered, unchanged", x.Jobs, x.LoadReaders, x.LoadBuffered, x.LoadReadersChanged)
		}
	}
	if want := "load readers after auto 256KiB sums=true, 2 jobs: 1 buffered (0 changes by tuning)"; loads == 0 || !strings.Contains(stdout, want) {
		t.Errorf("%d loads; want the line %q below the table:\n%s", loads, want, stdout)
	}
}

// The write ceiling writes into as many existing files as the round's
// stores wrote into spares, spread evenly, and fresh files for the rest.
func TestCeilingSparesFollowTheRoundsMix(t *testing.T) {
	for _, tc := range []struct {
		name   string
		full   bool
		ahead  int64
		reused uint64
		files  int
		want   int
	}{
		{"no spares made ahead", false, 0, 5, 8, 0},
		{"spares made ahead, none taken", false, 1 << 20, 0, 8, 0},
		{"some took spares", false, 1 << 20, 127, 128, 127},
		{"every one took a spare", false, 1 << 20, 128, 128, 128},
		{"more spares than files", false, 1 << 20, 200, 128, 128},
		{"full cache", true, 0, 0, 128, 128},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := ceilingSpares(tc.full, tc.ahead, tc.reused, tc.files)
			if got != tc.want {
				t.Fatalf("ceilingSpares = %d, want %d", got, tc.want)
			}
			exist := spreadSpares(tc.files, got)
			n, firstHalf := 0, 0
			for i, e := range exist {
				if e {
					n++
					if i < tc.files/2 {
						firstHalf++
					}
				}
			}
			if n != got || firstHalf < got/2-1 || firstHalf > got/2+1 {
				t.Fatalf("spreadSpares(%d, %d): %d existing, %d in the first half; want %d spread evenly", tc.files, got, n, firstHalf, got)
			}
		})
	}
}

// TestBenchRemovesTheDirectoriesItMadeAndKeepsThoseItFound: --dir naming
// a directory that does not exist yet, two levels deep, is made for the
// run and gone after it; a --dir that existed stays, empty.
func TestBenchRemovesTheDirectoriesItMadeAndKeepsThoseItFound(t *testing.T) {
	base := t.TempDir()
	made := filepath.Join(base, "made", "deeper")
	benchReport(t, made, "--keys", "2", "--jobs", "1")
	if _, err := os.Lstat(filepath.Join(base, "made")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the directory the benchmark made is left: %v", err)
	}
	found := filepath.Join(base, "found")
	if err := os.Mkdir(found, 0o755); err != nil {
		t.Fatal(err)
	}
	benchReport(t, found, "--keys", "2", "--jobs", "1")
	if ents, err := os.ReadDir(found); err != nil || len(ents) != 0 {
		t.Errorf("the directory that was there: %d entries, %v; want it kept, empty", len(ents), err)
	}
}

// TestBenchRemovesEveryDirectoryItMadeOnAPathWithDotDot: the directories
// a run made are those its mkdir calls made, not those missing from the
// path --dir names once cleaned: --dir base/made/../other, base/made
// missing, makes base/made on the way (the kernel resolves ".." after
// it) and base/other. Both are gone after the run; base/made was left
// behind, the cleaned path (base/other) not naming it.
func TestBenchRemovesEveryDirectoryItMadeOnAPathWithDotDot(t *testing.T) {
	base := t.TempDir()
	benchReport(t, filepath.Join(base, "made")+"/../other", "--keys", "2", "--jobs", "1")
	if ents, err := os.ReadDir(base); err != nil || len(ents) != 0 {
		t.Errorf("%s holds %v after the run (%v): want what the run made gone", base, ents, err)
	}
}

// TestBenchRemovesNoFileWhereADirectoryItMadeWas: the run removes the
// directories it made, each where it is left empty, with rmdir. It
// removed them with os.Remove, which unlinks first: a file or a symbolic
// link the user put in place of such a directory during the run (the
// directory removed, a file written at its name) was removed with it.
// Here the directory the run made is replaced by a file and by a link
// before the removal, which leaves both.
func TestBenchRemovesNoFileWhereADirectoryItMadeWas(t *testing.T) {
	for _, c := range []struct {
		name  string
		plant func(path string) error
	}{
		{"a file", func(path string) error { return os.WriteFile(path, []byte("the user's"), 0o644) }},
		{"a symbolic link", func(path string) error { return os.Symlink(t.TempDir(), path) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "made")
			root, made, err := benchDirs(dir)
			if err != nil {
				t.Fatal(err)
			}
			if len(made) != 1 || made[0] != dir {
				t.Fatalf("benchDirs made %v, want [%s]", made, dir)
			}
			if err := os.Remove(root); err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(dir); err != nil {
				t.Fatal(err)
			}
			if err := c.plant(dir); err != nil {
				t.Fatal(err)
			}
			removeMade(made)
			if _, err := os.Lstat(dir); err != nil {
				t.Errorf("%s put where the run's directory was is gone after it: %v", c.name, err)
			}
		})
	}
}

// TestBenchForeignSaysNothingOfItsTwoEnginesSharingTheDirectory: the two
// engines of --foreign share a memory directory by design, and the
// warning an engine's Open logs where others run on its directory
// (engine.SharedDirectoryWarning) stays out of the benchmark's output.
func TestBenchForeignSaysNothingOfItsTwoEnginesSharingTheDirectory(t *testing.T) {
	shm, err := os.MkdirTemp("/dev/shm", "kvhost-bench-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(shm) })
	all := append([]string{"bench", "--dir", shm}, tinyBench...)
	all = append(all, "--foreign", "--memory", "host", "--rounds", "2", "--jobs", "2", "--tokens-per-key", "16", "--total", "4MiB")
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), all, &stdout, &stderr); code != 0 {
		t.Fatalf("kvhost %s: exit %d\n%s%s", strings.Join(all, " "), code, stdout.String(), stderr.String())
	}
	if out := stdout.String() + stderr.String(); strings.Contains(out, "other kvhost engines run") {
		t.Fatalf("the benchmark's output warns of its own engines:\n%s", out)
	}
}
