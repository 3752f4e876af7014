package main

import (
	"reflect"
	"strings"
	"testing"
	"testing/fstest"
)

// A check file as scripts/gpu-check.sh writes it: its parts' summary
// (prose here, the copies of lookup lines included), then the lookups
// parts' raw lines.
const sampleCheck = `# H100 machine, 2026-11-24, commit f9555a2 (+ a change)
== machine
16
== lookups-b2b-1
beside loads daemon p50 147 p99 2396 max 16582 n 18107 due - GB/s 20.7
== lookups-b2b-1.txt
alone table p50 28 p99 86 max 3287 n 155228 due -
alone daemon p50 92 p99 465 max 11515 n 43902 due -
beside loads table p50 28 p99 101 max 3638 n 156876 due -
beside loads daemon p50 147 p99 2396 max 16582 n 18107 due - GB/s 20.7
== lookups-spare-no-1.txt
alone table p50 61 p99 434 max 2582 n 2492 due 2500
alone stand-in p50 40 p99 300 max 900 n 2500 due 2500
alone table-python p50 70 p99 500 max 2600 n 2490 due 2500
alone daemon p50 260 p99 3370 max 7075 n 2430 due 2500
`

func TestParseCheckFileReadsTheLookupsParts(t *testing.T) {
	f, err := ParseFile("check.txt", sampleCheck)
	if err != nil {
		t.Fatal(err)
	}
	if f.Date != "2026-11-24" || len(f.Calls) != 1 || f.Calls[0].Commit != "f9555a2" {
		t.Fatalf("date %q, calls %+v; want 2026-11-24 and one call at f9555a2", f.Date, f.Calls)
	}
	want := []LookupLine{
		{Line: 7, Situation: "alone", BackToBack: true, Table: []P50P99{{28, 86}}, Daemon: []P50P99{{92, 465}}},
		{Line: 9, Situation: "beside", BackToBack: true, Table: []P50P99{{28, 101}}, Daemon: []P50P99{{147, 2396}}},
		{Line: 12, Situation: "alone", Table: []P50P99{{61, 434}}, Python: []P50P99{{70, 500}}, StandIn: []P50P99{{40, 300}}, Daemon: []P50P99{{260, 3370}}},
	}
	if !reflect.DeepEqual(f.Calls[0].Lookups, want) {
		t.Errorf("lookups:\n %+v\nwant\n %+v", f.Calls[0].Lookups, want)
	}
}

func TestParseCheckFileRefusesLinesItCannotRead(t *testing.T) {
	const part = "== lookups-a.txt\n"
	for _, tc := range []struct {
		name, text, want string
	}{
		{"line cut short", part + "alone table p50 28 p99 86\n", "c.txt:2: a line of lookups-a.txt must read"},
		{"paced and back to back", part + "alone table p50 1 p99 2 max 3 n 4 due -\nalone daemon p50 1 p99 2 max 3 n 4 due 2500\n", "c.txt:3: due 2500 in lookups-a.txt"},
		{"a figure twice", part + "alone table p50 1 p99 2 max 3 n 4 due -\nalone table p50 1 p99 2 max 3 n 4 due -\n", "c.txt:3: a second alone table line"},
		{"no lookups", "== lookups-a\nalone table p50 1 p99 2 max 3 n 4 due -\n", "no \"== lookups-NAME.txt\" section"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseCheckFile("c.txt", tc.text)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestParseFileRefusesAnUnknownFormat(t *testing.T) {
	_, err := ParseFile("x.txt", "== something\nprose\n")
	if err == nil || !strings.Contains(err.Error(), "x.txt: no \"== call N") {
		t.Fatalf("error %v, want one naming the file and the formats", err)
	}
}

func TestComputePicksPacedOrBackToBackLookups(t *testing.T) {
	dir := fstest.MapFS{"check.txt": {Data: []byte(sampleCheck)}}
	for _, tc := range []struct {
		backToBack bool
		answer     string
		want       float64
	}{{true, "table", 86}, {true, "daemon", 465}, {false, "table", 434}, {false, "python", 500}, {false, "stand-in", 300}, {false, "daemon", 3370}} {
		row := Row{Name: "row", Calls: []string{"check.txt#1"}, Lookups: "alone", Answer: tc.answer, BackToBack: tc.backToBack}
		res, err := Compute(&Manifest{Rows: []Row{row}}, dir)
		if err != nil {
			t.Fatal(err)
		}
		if r := res[0]; len(r.Runs) != 1 || r.Runs[0].Value != tc.want || !reflect.DeepEqual(r.Commits, []string{"f9555a2"}) {
			t.Errorf("back to back %v, %s: runs %+v, commits %v; want one p99 of %v at f9555a2", tc.backToBack, tc.answer, r.Runs, r.Commits, tc.want)
		}
	}
	row := Row{Name: "row", Calls: []string{"check.txt#1"}, Lookups: "beside", Answer: "table"}
	if _, err := Compute(&Manifest{Rows: []Row{row}}, dir); err == nil || !strings.Contains(err.Error(), "no paced \"beside\" lookups line") {
		t.Errorf("paced beside: error %v, want no paced \"beside\" lookups line", err)
	}
}
