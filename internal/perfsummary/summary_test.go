package main

import (
	"encoding/json"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/kvhost/kvhost/internal/bench"
)

// TestDocsMatchRawFiles is the check that keeps the summary true: both
// documents, regenerated in memory from docs/bench, equal the files.
func TestDocsMatchRawFiles(t *testing.T) {
	docs, err := Generate("../..")
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range docs {
		if d.Old == d.New {
			continue
		}
		old, gen := strings.Split(d.Old, "\n"), strings.Split(d.New, "\n")
		i := 0
		for i < len(old) && i < len(gen) && old[i] == gen[i] {
			i++
		}
		var o, g string
		if i < len(old) {
			o = old[i]
		}
		if i < len(gen) {
			g = gen[i]
		}
		t.Errorf("%s differs from what docs/bench gives (run make perf-summary); first at line %d:\n file: %q\n  raw: %q", d.Path, i+1, o, g)
	}
}

const pairedCalls = `== call 1: kvhost at abcdef0
llmd 32 MiB pair 1 store GB/s 20.00 25.00   load 20.00 20.00
llmd 32 MiB pair 2 store GB/s 10.00 10.00   load 20.00 20.00
  kv-a-1.json  store  40.00 GB/s  ceiling w 30.0  of link 0.80  direct files 1/1  spares 1.0 GiB  no_gap False  verified 0 GiB
  kv-a-2.json  store  30.00 GB/s  ceiling w 30.0  of link 0.60  direct files 1/1  spares 1.0 GiB  no_gap False  verified 0 GiB
  kv-b.json    store  30.00 GB/s  ceiling w 30.0  of link 0.60  direct files 1/1  spares 1.0 GiB  no_gap False  verified 0 GiB
  kv-c-3.json  store  30.00 GB/s  ceiling w 30.0  of link 0.60  direct files 1/1  spares 1.0 GiB  no_gap False  verified 0 GiB
  restarted: 30.00 40.00 GB/s
`

func reportJSON(t *testing.T, name, version string, gbps, link float64) []byte {
	t.Helper()
	b, err := json.Marshal(bench.Report{
		Schema:  bench.Schema,
		Version: "kvhost " + version + " go1.26 linux/amd64",
		Command: []string{"kvhost", "bench", "--json", "/out/" + name},
		Runs:    []bench.Run{{Direction: "store", Checksums: true, GBps: gbps, FractionLink: link}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func testRow(mod func(*Row)) *Manifest {
	r := Row{Name: "row", Calls: []string{"c.txt#1"}, Report: `kv-a-\d+\.json`, Phase: "store",
		Peer: `32 MiB pair \d+`, PeerPhase: "store", Ceiling: "link", Goal: Goal{Peer: 1.5}}
	mod(&r)
	return &Manifest{Setup: "s", Rows: []Row{r}}
}

func TestComputeComparesEachRunWithItsPair(t *testing.T) {
	dir := fstest.MapFS{"c.txt": {Data: []byte(pairedCalls)}}
	res, err := Compute(testRow(func(*Row) {}), dir)
	if err != nil {
		t.Fatal(err)
	}
	r := res[0]
	// kv-a-1 (40) against pair 1's stores (20, 25): 1.6 to 2.0; kv-a-2
	// (30) against pair 2's (10, 10): 3.0. Pair 2's stores are not held
	// against kv-a-1.
	if got := ratioCell(r); got != "1.60–3.00" {
		t.Errorf("ratios %s, want 1.60–3.00", got)
	}
	if got := valueRange(r); got != "30.0–40.0 GB/s" {
		t.Errorf("kvhost %s, want 30.0–40.0 GB/s", got)
	}
	if got := ceilingCell(r); got != "0.60–0.80 of link" {
		t.Errorf("ceiling %s", got)
	}
	if got := status(r); got != "met (2 of 2)" {
		t.Errorf("status %q", got)
	}
}

// TestComputeComparesAnUnpairedRowWithTheWholeCall: with unpaired, a run
// that names no pair (kv-b) is compared with every matching llmd line of
// its call instead of being refused.
func TestComputeComparesAnUnpairedRowWithTheWholeCall(t *testing.T) {
	dir := fstest.MapFS{"c.txt": {Data: []byte(pairedCalls)}}
	res, err := Compute(testRow(func(r *Row) { r.Report, r.Unpaired = `kv-b\.json`, true }), dir)
	if err != nil {
		t.Fatal(err)
	}
	// kv-b (30) against all four stores (20, 25, 10, 10): 1.20 to 3.00.
	if got := ratioCell(res[0]); got != "1.20–3.00" {
		t.Errorf("ratios %s, want 1.20–3.00", got)
	}
}

func TestComputeStatusCountsTheRunsThatMiss(t *testing.T) {
	dir := fstest.MapFS{"c.txt": {Data: []byte(pairedCalls)}}
	res, err := Compute(testRow(func(r *Row) { r.Goal = Goal{Peer: 1.7, Link: 0.7} }), dir)
	if err != nil {
		t.Fatal(err)
	}
	// kv-a-1 is 1.6× pair 1's fastest store; kv-a-2 uses 0.60 of the link.
	if got, want := status(res[0]), "missed: 1 of 2 below 1.7×; 1 of 2 below 0.7 of link"; got != want {
		t.Errorf("status %q, want %q", got, want)
	}
}

func TestComputeReadsFigureLinesAgainstTheWholeCall(t *testing.T) {
	dir := fstest.MapFS{"c.txt": {Data: []byte(pairedCalls)}}
	m := testRow(func(r *Row) {
		r.Report, r.Phase, r.Ceiling, r.Figure = "", "", "", "^restarted$"
	})
	res, err := Compute(m, dir)
	if err != nil {
		t.Fatal(err)
	}
	// 30 and 40 against every pair's stores, 10 to 25.
	if got := ratioCell(res[0]); got != "1.20–4.00" {
		t.Errorf("ratios %s, want 1.20–4.00", got)
	}
}

func TestComputeChecksReportsAgainstTheirLines(t *testing.T) {
	for _, tc := range []struct {
		name    string
		report  []byte
		wantErr string
	}{
		{"same figures", reportJSON(t, "kv-a-1.json", "abcdef0", 40.004, 0.799), ""},
		{"other GB/s", reportJSON(t, "kv-a-1.json", "abcdef0", 41, 0.80), "says 40.00, 0.80"},
		{"other commit", reportJSON(t, "kv-a-1.json", "1234567", 40, 0.80), "in none of the row's calls"},
		{"name not printed", reportJSON(t, "kv-z-1.json", "abcdef0", 40, 0.80), "in none of the row's calls"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := fstest.MapFS{"c.txt": {Data: []byte(pairedCalls)}, "r.json": {Data: tc.report}}
			_, err := Compute(testRow(func(r *Row) { r.Reports = []string{"r.json"} }), dir)
			checkError(t, err, tc.wantErr)
		})
	}
}

// TestComputeHoldsAReportNamedAfterItsFileAgainstThatFile: two calls of
// one commit both wrote a kv-a-1.json; a report kept as RAW-kv-a-1.json is
// held against RAW.txt's line only, also where another raw file's name
// is a prefix of RAW (c.txt and c-b.txt).
func TestComputeHoldsAReportNamedAfterItsFileAgainstThatFile(t *testing.T) {
	other := strings.Replace(pairedCalls, "kv-a-1.json  store  40.00 GB/s", "kv-a-1.json  store  45.00 GB/s", 1)
	for _, tc := range []struct {
		name    string
		report  string
		gbps    float64
		wantErr string
	}{
		{"the second file's report, its figures", "c-b-kv-a-1.json", 45, ""},
		{"the second file's report, the first's figures", "c-b-kv-a-1.json", 40, "c-b.txt#1 line"},
		{"the first file's report, its figures", "c-kv-a-1.json", 40, ""},
		{"the first file's report, the second's figures", "c-kv-a-1.json", 45, "c.txt#1 line"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := fstest.MapFS{
				"c.txt":   {Data: []byte(pairedCalls)},
				"c-b.txt": {Data: []byte(other)},
				tc.report: {Data: reportJSON(t, "kv-a-1.json", "abcdef0", tc.gbps, 0.80)},
			}
			_, err := Compute(testRow(func(r *Row) {
				r.Calls = []string{"c.txt#1", "c-b.txt#1"}
				r.Reports = []string{tc.report}
			}), dir)
			checkError(t, err, tc.wantErr)
		})
	}
}

// checkError fails t unless err is nil where want is empty, or an error
// whose text contains want.
func checkError(t *testing.T, err error, want string) {
	t.Helper()
	if want == "" {
		if err != nil {
			t.Fatal(err)
		}
		return
	}
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("error %v, want one containing %q", err, want)
	}
}

func TestComputeFailsOnARowItCannotFind(t *testing.T) {
	for _, tc := range []struct {
		name    string
		mod     func(*Row)
		wantErr string
	}{
		{"no such call", func(r *Row) { r.Calls = []string{"c.txt#9"} }, "c.txt has no call 9"},
		{"no such file", func(r *Row) { r.Calls = []string{"gone.txt#1"} }, "gone.txt"},
		{"no report line", func(r *Row) { r.Report = `kv-x\.json` }, "no kvhost line of a report named"},
		{"no llmd line", func(r *Row) { r.Peer = "2 MiB" }, "no llmd line labelled \"2 MiB\""},
		{"paired peer, report without a number", func(r *Row) { r.Report = `kv-b\.json` }, "names no pair"},
		{"paired peer, no such pair", func(r *Row) { r.Report = `kv-c-3\.json` }, "no llmd pair 3"},
		{"no lookups", func(r *Row) {
			r.Report, r.Phase, r.Ceiling, r.Peer, r.PeerPhase, r.Goal = "", "", "", "", "", Goal{}
			r.Lookups, r.Answer = "alone", "table"
		}, "no paced \"alone\" lookups line"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := fstest.MapFS{"c.txt": {Data: []byte(pairedCalls)}}
			_, err := Compute(testRow(tc.mod), dir)
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
			}
		})
	}
}

func TestParseManifestRefusesRowsThatReadNothingOrTooMuch(t *testing.T) {
	const head = "setup = \"s\"\n[[row]]\nname = \"r\"\ncalls = [\"c.txt#1\"]\n"
	for _, tc := range []struct {
		name, text, wantErr string
	}{
		{"unknown key", head + "report = 'a'\nphase = \"load\"\nceiling = \"link\"\ncolour = 1\n", "unknown keys row.colour"},
		{"two kinds", head + "report = 'a'\nfigure = 'b'\n", "exactly one of report, figure and lookups"},
		{"bad expression", head + "figure = '('\n", "regular expression"},
		{"bad phase", head + "report = 'a'\nphase = \"both\"\nceiling = \"link\"\n", "phase = \"both\""},
		{"bad ceiling", head + "report = 'a'\nphase = \"load\"\nceiling = \"reread\"\n", "want link, file or staged"},
		{"bad call", "setup = \"s\"\n[[row]]\nname = \"r\"\ncalls = [\"c.txt\"]\nfigure = 'a'\n", "want FILE#N"},
		{"peer goal without peer", head + "figure = 'a'\ngoal = { peer = 1.5 }\n", "goal.peer needs a peer"},
		{"lookups with a peer", head + "lookups = \"alone\"\nanswer = \"table\"\npeer = 'x'\npeer_phase = \"load\"\n", "no peer"},
		{"no setup", "[[row]]\nname = \"r\"\ncalls = [\"c.txt#1\"]\nfigure = 'a'\n", "no setup"},
		{"JSON report with a peer", "setup = \"s\"\n[[row]]\nname = \"r\"\ncalls = [\"r.json\"]\nreport = 'a'\nphase = \"load\"\nceiling = \"link\"\npeer = 'x'\npeer_phase = \"load\"\n", "only a report row without a peer"},
		{"back to back on a figure row", head + "figure = 'a'\nback_to_back = true\n", "back_to_back is for lookups rows"},
		{"bad commit", head + "figure = 'a'\ncommit = \"HEAD\"\n", "commit = \"HEAD\""},
		{"too many readme rows", "readme_rows = 2\n" + head + "figure = 'a'\n", "readme_rows = 2"},
		{"readme rows without machine", "readme_rows = 1\nheadline = \"h\"\n" + head + "figure = 'a'\n", "readme_rows needs machine and headline"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseManifest(tc.text)
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
			}
		})
	}
}

func TestReplaceRewritesOnlyBetweenTheMarkers(t *testing.T) {
	mk := summaryMarkers(summaries()[0])
	perfBegin, perfEnd := mk.begin, mk.end
	doc := "before\n" + perfBegin + "\nold\ntable\n" + perfEnd + "\nafter\n"
	got, err := Replace(doc, perfBegin, perfEnd, "new\n")
	if err != nil {
		t.Fatal(err)
	}
	if want := "before\n" + perfBegin + "\nnew\n" + perfEnd + "\nafter\n"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
	for _, bad := range []string{"no markers\n", perfEnd + "\n" + perfBegin + "\n", doc + doc} {
		if _, err := Replace(bad, perfBegin, perfEnd, "x\n"); err == nil {
			t.Errorf("Replace(%q) took it", bad)
		}
	}
}

func TestComputeReadsAJSONReportsPhases(t *testing.T) {
	rep := bench.Report{
		Schema:  bench.Schema,
		Version: "kvhost abcdef0-dirty go1.26 linux/amd64",
		Runs: []bench.Run{
			{Direction: "store", Checksums: true, KeyBytes: 32 << 20, GBps: 40, FractionLink: 0.7},
			{Direction: "load", Checksums: true, KeyBytes: 32 << 20, GBps: 45, FractionLink: 0.8},
			{Direction: "load", Checksums: false, KeyBytes: 32 << 20, GBps: 50, FractionLink: 0.9},
			{Direction: "load", Checksums: true, KeyBytes: 2 << 20, GBps: 30, FractionLink: 0.5},
		},
	}
	b, err := json.Marshal(rep)
	if err != nil {
		t.Fatal(err)
	}
	dir := fstest.MapFS{"r.json": {Data: b}}
	row := func(mod func(*Row)) *Manifest {
		return testRow(func(r *Row) {
			r.Calls, r.Phase, r.Peer, r.PeerPhase, r.Goal = []string{"r.json"}, "load", "", "", Goal{Link: 0.85}
			mod(r)
		})
	}
	res, err := Compute(row(func(r *Row) { r.KeyMiB, r.Sums = 32, "on" }), dir)
	if err != nil {
		t.Fatal(err)
	}
	if got := valueRange(res[0]) + " " + ceilingCell(res[0]) + " " + strings.Join(res[0].Commits, ","); got != "45.0 GB/s 0.80 of link abcdef0" {
		t.Errorf("got %q", got)
	}
	if got := rawCell(res[0], "bench/"); got != "[report](bench/r.json)" {
		t.Errorf("raw %q", got)
	}
	if _, err := Compute(row(func(r *Row) { r.Sums = "on" }), dir); err == nil || !strings.Contains(err.Error(), "set key_mib") {
		t.Errorf("two key sizes: error %v, want one asking for key_mib", err)
	}
	if _, err := Compute(row(func(r *Row) { r.KeyMiB = 8 }), dir); err == nil || !strings.Contains(err.Error(), "no load phase") {
		t.Errorf("no such key size: error %v", err)
	}
}

// TestHeadlineBlockIsOneTableOfEveryMachinesFirstRows: the README's
// headline has a row per machine's shown result, named by its machine,
// no raw file, and each machine's conditions with the dates of its runs.
func TestHeadlineBlockIsOneTableOfEveryMachinesFirstRows(t *testing.T) {
	dir := fstest.MapFS{"c.txt": {Data: []byte(pairedCalls)}}
	var parts []headline
	for _, machine := range []string{"A100", "B200"} {
		m := testRow(func(*Row) {})
		m.Machine, m.Headline, m.ReadmeRows = machine, "conditions of "+machine, 1
		res, err := Compute(m, dir)
		if err != nil {
			t.Fatal(err)
		}
		res[0].Dates = []string{"2026-11-28"}
		parts = append(parts, headline{m, res})
	}
	got := HeadlineBlock(parts)
	for _, want := range []string{
		"| A100 | row | 30.0–40.0 GB/s | 0.60–0.80 of link | 10.0–25.0 GB/s | 1.60–3.00 | ≥ 1.5× | met (2 of 2) |\n",
		"| B200 | row |",
		"\nA100, 2026-11-28: conditions of A100\n",
		"\nB200, 2026-11-28: conditions of B200\n",
		"(docs/performance.md)",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("headline lacks %q:\n%s", want, got)
		}
	}
	if strings.Contains(got, "bench/") {
		t.Errorf("headline links a raw file:\n%s", got)
	}
}
