package main

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/kvhost/kvhost/internal/bench"
)

// A sweep file in the sweep driver's format: every kind of section, a
// table with both optional columns (a store row leaves of reread blank),
// one with neither note nor header but all ten figures, and loads after
// a restart and by a second engine ("load (restart)", "load (foreign)" in
// their dir column).
const sampleSweep = `# H100 machine, 2026-11-24, one call.
build done at 83 s
== llmd shm32: /dev/shm/sw/ll 8 16 2
llmd store GB/s 23.14 files 256 round 1 ok True
llmd load GB/s 21.40 files 256 round 1 ok True layers_differ 0
llmd store GB/s 22.87 files 256 round 2 ok True
llmd load GB/s 20.91 files 256 round 2 ok True layers_differ 0
== kvhost-final shm32: --dir /dev/shm/sw --tokens-per-key 256   --no-gap
  auto  gpu-staging  direct    on  32MiB    16  store  256/256  47.15         19.85      2.37     2.37                0.86    10.1    20.9        259        768         0  pwrite O_DIRECT ↔ pinned  1.86 2.37 2.88
  auto  gpu-staging  direct    on  32MiB    16   load  256/256  48.96         22.85      2.14     2.14       1.27     0.91     9.9    21.5        225        684      8GiB   pread O_DIRECT ↔ pinned  2.12 2.14 2.17
of reread: of the same files read plainly a second time (loads)
of link: of the pinned copy ceiling of the same direction
elapsed 237 s
== kvhost-after big: --total 16GiB
  auto  gpu-staging  direct   off  32MiB    16   load  512/512  29.98         24.39      1.23     1.23       0.81     0.55    16.4    37.0        351        637     16GiB   pread O_DIRECT ↔ pinned
== foreign final
store: 256 keys of 32 MiB in 16 jobs: 20.61 GB/s
load after restart: 256/256 keys of 32 MiB in 16 jobs: 27.61 GB/s; 0 keys differ
   kvhost_gpu_registered_files 261
load after restart: 256/256 keys of 32 MiB in 16 jobs: 44.95 GB/s; 0 keys differ
load after restart: 256/256 keys of 32 MiB in 16 jobs: 26.94 GB/s; 3 keys differ
load after restart: 256/256 keys of 32 MiB in 16 jobs: 47.76 GB/s; 0 keys differ
== kvhost-restart shm32: --restart
  auto  gpu-staging  direct    on  32MiB    16  load (restart)  256/256  47.48         28.63      1.66     1.66       1.24     0.88     9.9    23.1        226        539      8GiB   pread O_DIRECT ↔ pinned  1.49 1.67 1.85
== kvhost-foreign shm32: --foreign
  auto  gpu-staging  direct    on  32MiB    16  load (foreign)  256/256  30.12         28.63      1.05     1.05       0.74     0.55    17.2    33.0        390        539      8GiB   pread O_DIRECT ↔ pinned
`

func TestParseSweepFileReadsEverySection(t *testing.T) {
	f, err := ParseFile("sweep.txt", sampleSweep)
	if err != nil {
		t.Fatal(err)
	}
	if f.Date != "2026-11-24" || len(f.Calls) != 1 || f.Calls[0].N != 1 || f.Calls[0].Commit != "" {
		t.Fatalf("date %q, calls %+v; want 2026-11-24 and one call 1 without a commit", f.Date, f.Calls)
	}
	c := f.Calls[0]
	wantPeer := []PeerLine{{Line: 3, Label: "shm32", Phases: []PeerPhase{
		{Name: "store", GBps: []float64{23.14, 22.87}}, {Name: "load", GBps: []float64{21.40, 20.91}}}}}
	if !reflect.DeepEqual(c.Peer, wantPeer) {
		t.Errorf("llmd: %+v, want %+v", c.Peer, wantPeer)
	}
	args := "--dir /dev/shm/sw --tokens-per-key 256 --no-gap"
	wantKV := []KVLine{
		{Line: 9, Report: "kv-final-shm32.json", Direction: "store", Sums: "on", GBps: 47.15, CeilingName: "pwrite O_DIRECT ↔ pinned", CeilingGBps: 19.85, Link: 0.86, NoGap: true, Args: args},
		{Line: 10, Report: "kv-final-shm32.json", Direction: "load", Sums: "on", GBps: 48.96, CeilingName: "pread O_DIRECT ↔ pinned", CeilingGBps: 22.85, Link: 0.91, NoGap: true, Args: args},
		{Line: 15, Report: "kv-after-big.json", Direction: "load", Sums: "off", GBps: 29.98, CeilingName: "pread O_DIRECT ↔ pinned", CeilingGBps: 24.39, Link: 0.55, Args: "--total 16GiB"},
		{Line: 24, Report: "kv-restart-shm32.json", Direction: "load", Sums: "on", GBps: 47.48, CeilingName: "pread O_DIRECT ↔ pinned", CeilingGBps: 28.63, Link: 0.88, Restart: true, Args: "--restart"},
		{Line: 26, Report: "kv-foreign-shm32.json", Direction: "load", Sums: "on", GBps: 30.12, CeilingName: "pread O_DIRECT ↔ pinned", CeilingGBps: 28.63, Link: 0.55, Args: "--foreign"},
	}
	if !reflect.DeepEqual(c.KV, wantKV) {
		t.Errorf("kvhost rows:\n %+v\nwant\n %+v", c.KV, wantKV)
	}
	wantFig := []FigureLine{
		{Line: 17, Label: "foreign final store", GBps: []float64{20.61}},
		{Line: 18, Label: "foreign final load right after lookup", GBps: []float64{27.61}},
		{Line: 20, Label: "foreign final load after registrar settled", GBps: []float64{44.95}},
		{Line: 21, Label: "foreign final load right after lookup", GBps: []float64{26.94}, Bad: "line 21 loaded 256 of 256 keys, 3 differing"},
		{Line: 22, Label: "foreign final load after registrar settled", GBps: []float64{47.76}},
	}
	if !reflect.DeepEqual(c.Figure, wantFig) {
		t.Errorf("foreign:\n %+v\nwant\n %+v", c.Figure, wantFig)
	}
}

// stagedSweep: tables with the staged ceiling's column, one with its
// header (a store leaves of reread blank), one with only its notes.
const stagedSweep = `# H100 machine, 2026-11-25, kvhost at commit 8ba5175.
== llmd shm32-1: /dev/shm/sw/ll 8 16 2
llmd store GB/s 22.71 files 256 round 1 ok True
llmd load GB/s 21.70 files 256 round 1 ok True layers_differ 0
== kvhost-pinned shm32-1: --dir /dev/shm/sw --no-gap
  path        mover      io  sums    key  jobs    dir     keys   GB/s  ceiling GB/s  fraction  of best  of reread  of staged  of link  p50 ms  p99 ms  CPU ms/GB  ceiling's  verified                ceiling is        by round
  auto  gpu-staging  direct    on  32MiB    16  store  256/256  23.07         27.76      0.83     0.83                  0.89     0.42    22.0    41.2        641        553         0  pwrite O_DIRECT ↔ pinned  0.79 0.83 0.87
  auto  gpu-staging  direct    on  32MiB    16   load  256/256  33.40         25.71      1.30     1.30       0.84       1.41     0.61    14.8    26.6        367        597      8GiB   pread O_DIRECT ↔ pinned  1.27 1.30 1.33
staged ceiling of 32MiB store, 16 jobs: D2H → pinned → pwrite O_DIRECT, 4 MiB chunks 25.97 GB/s, 601 CPU ms/GB
== kvhost-cur shm32-1: --dir /dev/shm/sw
  auto  gpu-staging  direct    on  32MiB    16   load  256/256  48.42         35.83      1.35     1.35       1.44       1.32     0.88     9.8    21.4        237        426      8GiB   pread O_DIRECT ↔ pinned
of reread: of the same files read plainly a second time (loads)
of staged: of the same files moved plainly through pinned buffers and the GPU
of link: of the pinned copy ceiling of the same direction
`

// TestParseSweepFileReadsTheStagedColumn: a table with "of staged" gives
// each row its staged fraction beside its link fraction, from its header
// or its notes, whether of reread is blank (stores) or not.
func TestParseSweepFileReadsTheStagedColumn(t *testing.T) {
	f, err := ParseSweepFile("s.txt", stagedSweep)
	if err != nil {
		t.Fatal(err)
	}
	type fig struct {
		report, dir            string
		gbps, link, staged, ce float64
	}
	var got []fig
	for _, k := range f.Calls[0].KV {
		got = append(got, fig{k.Report, k.Direction, k.GBps, k.Link, k.Staged, k.CeilingGBps})
	}
	want := []fig{
		{"kv-pinned-shm32-1.json", "store", 23.07, 0.42, 0.89, 27.76},
		{"kv-pinned-shm32-1.json", "load", 33.40, 0.61, 1.41, 25.71},
		{"kv-cur-shm32-1.json", "load", 48.42, 0.88, 1.32, 35.83},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("rows:\n %+v\nwant\n %+v", got, want)
	}
	if c := f.Calls[0].Commit; c != "8ba5175" {
		t.Errorf("commit %q, want 8ba5175", c)
	}
}

// TestParseSweepFileNamesPairsAndColdPhases: an llmd section "NAME-N" is
// pair N (the kvhost runs "...-N" that follow it are compared with it
// alone), and the driver's --cold and --sync name its phases as the peer
// call files do ("cold load", "store+sync"), whether its lines say so
// (scripts/peer-llmd.py) or not (the earlier drivers).
func TestParseSweepFileNamesPairsAndColdPhases(t *testing.T) {
	cases := []struct {
		header string
		named  bool // the lines name the phases, as scripts/peer-llmd.py's do
		want   PeerLine
	}{
		{"== llmd disk-2: /var/tmp/sw/ll 2 16 1 --cold --sync", false, PeerLine{Line: 1, Label: "disk-2", Pair: 2,
			Phases: []PeerPhase{{Name: "store+sync", GBps: []float64{1.9}}, {Name: "cold load", GBps: []float64{1.57}}}}},
		{"== llmd disk-3: /var/tmp/sw/ll 2 16 1 --cold --sync", true, PeerLine{Line: 1, Label: "disk-3", Pair: 3,
			Phases: []PeerPhase{{Name: "store+sync", GBps: []float64{1.9}}, {Name: "cold load", GBps: []float64{1.57}}}}},
		{"== llmd shm32-1: /dev/shm/sw/ll 8 16 1", false, PeerLine{Line: 1, Label: "shm32-1", Pair: 1,
			Phases: []PeerPhase{{Name: "store", GBps: []float64{1.9}}, {Name: "load", GBps: []float64{1.57}}}}},
		{"== llmd shm32b: /dev/shm/sw/ll 8 16 1 --cold", false, PeerLine{Line: 1, Label: "shm32b",
			Phases: []PeerPhase{{Name: "store", GBps: []float64{1.9}}, {Name: "cold load", GBps: []float64{1.57}}}}},
	}
	for _, c := range cases {
		t.Run(c.want.Label, func(t *testing.T) {
			text := c.header + "\nllmd store GB/s 1.90 files 64 round 1 ok True\nllmd load GB/s 1.57 files 64 round 1 ok True layers_differ 0\n"
			if c.named {
				text = strings.NewReplacer("llmd store GB/s", "llmd store+sync GB/s", "llmd load GB/s", "llmd cold load GB/s").Replace(text)
			}
			f, err := ParseSweepFile("sweep.txt", text)
			if err != nil {
				t.Fatal(err)
			}
			if got := f.Calls[0].Peer; !reflect.DeepEqual(got, []PeerLine{c.want}) {
				t.Errorf("llmd: %+v, want %+v", got, c.want)
			}
		})
	}
}

// TestParseSweepFileTakesTheCommitItsHeaderNames: a sweep file of one
// build may say its commit in its "#" header; one that does not leaves
// the commit to the rows.
func TestParseSweepFileTakesTheCommitItsHeaderNames(t *testing.T) {
	body := "== llmd shm32-1: DIR 8 16 1\nllmd store GB/s 1.90 files 64 round 1 ok True\n"
	cases := []struct{ header, want string }{
		{"# H100 machine, 2026-11-24, kvhost at commit 23afb60.\n", "23afb60"},
		{"# H100 machine, 2026-11-24: 'old' is 91f4606 as committed, 'ra' an experiment.\n", ""},
		{"# first at commit abcdef0\n# then commit 1234567\n", "abcdef0"},
	}
	for _, c := range cases {
		f, err := ParseSweepFile("sweep.txt", c.header+body)
		if err != nil {
			t.Fatal(err)
		}
		if got := f.Calls[0].Commit; got != c.want {
			t.Errorf("header %q: commit %q, want %q", c.header, got, c.want)
		}
	}
}

func TestParseSweepFileRefusesLinesItCannotRead(t *testing.T) {
	const kv = "== kvhost-final a: --x\n"
	const row = "  auto  gpu  direct  on  32MiB  16  load  1/1  48.96  22.85  2.14  2.14  %s  9.9  21.5  225  684  8GiB  pread O_DIRECT ↔ pinned\n"
	for _, tc := range []struct {
		name, text, want string
	}{
		{"unknown section", "== kvhost-a b: x\n== something else\n", "s.txt:2: a section header must read"},
		{"llmd line cut short", "== llmd a: x\nllmd store GB/s 1.0 files 2\n", "s.txt:2: an llmd line must read"},
		{"cold load without --cold", "== llmd a: x --sync\nllmd cold load GB/s 1.0 files 2 round 1 ok True\n", "s.txt:1: the llmd section's \"cold load\" lines need --cold"},
		{"store+sync without --sync", "== llmd a: x\nllmd store+sync GB/s 1.0 files 2 round 1 ok True\n", "s.txt:1: the llmd section's \"store+sync\" lines need --sync"},
		{"llmd rounds out of order", "== llmd a: x\nllmd store GB/s 1.0 files 2 round 2 ok True\n", "s.txt:2: llmd store round 2 follows 0 rounds"},
		{"llmd section without figures", "== llmd a: x\nprose\n== kvhost-a b: x\n", "s.txt:1: the llmd section has no"},
		{"the same kvhost section twice", kv + strings.Replace(row, "%s", "1.27  0.91", 1) + kv, "s.txt:3: kvhost-final a appears twice"},
		{"nine figures, columns untold", kv + strings.Replace(row, "%s", "0.91", 1), "s.txt:2: 9 figures, and no header or note says"},
		{"too few figures for the notes", kv + strings.Replace(row, "%s", "", 1) + "of link: x\n", "s.txt:2: 8 figures, want 9"},
		{"no staged figure for the notes", kv + strings.Replace(row, "%s", "1.27  0.91", 1) + "of reread: x\nof staged: x\nof link: x\n", "s.txt:2: 10 figures, want 11"},
		{"bad dir column", kv + strings.Replace(strings.Replace(row, "load", "both", 1), "%s", "1.27  0.91", 1), "column dir is \"both\""},
		{"two figures after the ceiling", kv + strings.Replace(strings.Replace(row, "pinned", "pinned 1 2", 1), "%s", "1.27  0.91", 1), "2 figures after the ceiling's name"},
		{"foreign load cut short", "== foreign final\nload after restart: 256/256 keys of 32 MiB: 3 GB/s\n", "s.txt:2: a foreign load line must read"},
		{"foreign store cut short", "== foreign final\nstore: 256 keys 3 GB/s\n", "s.txt:2: a foreign store line must read"},
		{"foreign loads not in pairs", "== foreign final\nload after restart: 1/1 keys of 32 MiB in 1 jobs: 3 GB/s; 0 keys differ\n", "s.txt:1: the foreign section has 1 \"load after restart\" lines"},
		{"foreign indented prose", "== foreign final\n   something\n", "s.txt:2: an indented line in a foreign section"},
		{"llmd line before any section", "llmd store GB/s 1.0\n== kvhost-a b: x\n", "s.txt:1: a figure line before any section"},
		{"no figure", "== kvhost-a b: x\n", "no figure in any section"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseSweepFile("s.txt", tc.text)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestComputeReadsASweepFileWithTheRowsCommit(t *testing.T) {
	dir := fstest.MapFS{
		"s.txt":               {Data: []byte(sampleSweep)},
		"kv-final-shm32.json": {Data: sweepReport(t, "--progress", "off", "--dir", "/dev/shm/sw", "--tokens-per-key", "256", "--no-gap", "--json", "/out/kv-final-shm32.json")},
	}
	row := Row{Name: "row", Calls: []string{"s.txt#1"}, Report: `kv-final-shm32\.json`, Phase: "store",
		Peer: "shm32", PeerPhase: "store", Ceiling: "link", Commit: "b1233ba", Reports: []string{"kv-final-shm32.json"}}
	res, err := Compute(&Manifest{Rows: []Row{row}}, dir)
	if err != nil {
		t.Fatal(err)
	}
	r := res[0]
	if len(r.Runs) != 1 || r.Runs[0].Value != 47.15 || r.Runs[0].Ceiling != 0.86 || !reflect.DeepEqual(r.Peer, []float64{22.87, 23.14}) || !reflect.DeepEqual(r.Commits, []string{"b1233ba"}) {
		t.Errorf("runs %+v, peer %v, commits %v", r.Runs, r.Peer, r.Commits)
	}

	for _, tc := range []struct {
		name string
		edit func(*Row, fstest.MapFS)
		want string
	}{
		{"no commit", func(r *Row, _ fstest.MapFS) { r.Commit = "" }, "the file names no commit"},
		{"report of other arguments", func(_ *Row, d fstest.MapFS) {
			d["kv-final-shm32.json"] = &fstest.MapFile{Data: sweepReport(t, "--dir", "/x", "--json", "/out/kv-final-shm32.json")}
		}, "its arguments \"--dir /x\" differ"},
		{"a load whose keys differ", func(r *Row, _ fstest.MapFS) {
			*r = Row{Name: "row", Calls: []string{"s.txt#1"}, Figure: "^foreign final load right after lookup$", Commit: "b1233ba"}
		}, "is no figure: line 21 loaded 256 of 256 keys, 3 differing"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, d := row, fstest.MapFS{}
			for k, v := range dir {
				d[k] = v
			}
			tc.edit(&r, d)
			_, err := Compute(&Manifest{Rows: []Row{r}}, d)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// TestComputeMatchesAReportWithoutACommitToASweepFileThatNamesOne: a
// report built outside a checkout (version devel) is matched by its
// arguments in a sweep file whose header names the build's commit, and
// its runs are that commit's; other arguments are refused.
func TestComputeMatchesAReportWithoutACommitToASweepFileThatNamesOne(t *testing.T) {
	named := strings.Replace(sampleSweep, "one call.", "one call, kvhost at commit 0123abc.", 1)
	row := Row{Name: "row", Calls: []string{"s.txt#1"}, Report: `kv-final-shm32\.json`, Phase: "store",
		Peer: "shm32", PeerPhase: "store", Ceiling: "link", Commit: "b1233ba", Reports: []string{"s-kv-final-shm32.json"}}
	for _, tc := range []struct {
		name string
		args []string
		want string // an error, or "" for the run at 0123abc
	}{
		{"same arguments", []string{"--dir", "/dev/shm/sw", "--tokens-per-key", "256", "--no-gap", "--json", "/out/kv-final-shm32.json"}, ""},
		{"other arguments", []string{"--dir", "/x", "--json", "/out/kv-final-shm32.json"}, "its arguments \"--dir /x\" differ"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := fstest.MapFS{
				"s.txt":                 {Data: []byte(named)},
				"s-kv-final-shm32.json": {Data: sweepReport(t, tc.args...)},
			}
			res, err := Compute(&Manifest{Rows: []Row{row}}, dir)
			if tc.want != "" {
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("error %v, want one containing %q", err, tc.want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if r := res[0]; len(r.Runs) != 1 || r.Runs[0].Value != 47.15 || !reflect.DeepEqual(r.Commits, []string{"0123abc"}) {
				t.Errorf("runs %+v, commits %v; want 47.15 GB/s at 0123abc", r.Runs, r.Commits)
			}
		})
	}
}

// sweepReport is the report of sampleSweep's kvhost-final shm32, built
// outside a checkout (no commit), that ran `kvhost bench args...`.
func sweepReport(t *testing.T, args ...string) []byte {
	t.Helper()
	b, err := json.Marshal(bench.Report{
		Schema:  bench.Schema,
		Version: "kvhost devel go1.26 linux/amd64",
		Command: append([]string{"kvhost", "bench"}, args...),
		Runs: []bench.Run{
			{Direction: "store", Checksums: true, GBps: 47.149, FractionLink: 0.862},
			{Direction: "load", Checksums: true, GBps: 48.958, FractionLink: 0.908},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestComputeHoldsAStagedRowToItsStagedFractions: a row with ceiling =
// "staged" shows its runs' fractions of the staged ceiling.
func TestComputeHoldsAStagedRowToItsStagedFractions(t *testing.T) {
	dir := fstest.MapFS{"s.txt": {Data: []byte(stagedSweep)}}
	m := testRow(func(r *Row) {
		r.Calls, r.Report, r.Phase = []string{"s.txt#1"}, `kv-pinned-shm32-\d+\.json`, "load"
		r.Peer, r.PeerPhase, r.Ceiling = `shm32-\d+`, "load", "staged"
	})
	res, err := Compute(m, dir)
	if err != nil {
		t.Fatal(err)
	}
	if got := ceilingCell(res[0]); got != "1.41 of staged" {
		t.Errorf("ceiling %q, want 1.41 of staged", got)
	}
	if got := ratioCell(res[0]); got != "1.54" {
		t.Errorf("× llm-d %q, want 1.54 (33.40 over 21.70)", got)
	}
}
