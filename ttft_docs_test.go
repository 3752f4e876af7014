package kvhost_test

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// ttftRun is what one run of scripts/ttft-bench.py printed: the median
// of each mode by prefix size, and the ratio lines.
type ttftRun struct {
	median map[string]float64   // "P/mode" -> ms
	bound  map[string]string    // P -> "1.34 (1.16-1.47)"
	split  map[string][2]string // P -> split/recompute, modelled optimum/recompute
}

var (
	reTTFTLine  = regexp.MustCompile(`^ttft P (\d+) S \d+ mode (\w+) ms ([\d.]+) `)
	reBoundLine = regexp.MustCompile(`^bound P (\d+) S \d+ layerwise/bound ([\d.]+) \(reps ([\d.]+)-([\d.]+)\)`)
	reRatioLine = regexp.MustCompile(`^ratio P (\d+) S \d+ split/recompute ([\d.]+) split_tokens \d+ modelled_optimum/recompute ([\d.]+)`)
)

// ttftRuns reads a call's raw file (docs/bench/h200-ttft-COMMIT-*.txt):
// its runs by name ("== NAME" headers).
func ttftRuns(t *testing.T, commit string) map[string]*ttftRun {
	t.Helper()
	files, _ := filepath.Glob(filepath.Join("docs", "bench", "h200-ttft-"+commit+"-*.txt"))
	if len(files) == 0 {
		t.Fatalf("no docs/bench/h200-ttft-%s-*.txt for the call docs/vllm.md cites", commit)
	}
	runs := map[string]*ttftRun{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var cur *ttftRun
		for _, line := range strings.Split(string(b), "\n") {
			if name, ok := strings.CutPrefix(line, "== "); ok {
				name = strings.Fields(name)[0]
				cur = &ttftRun{median: map[string]float64{}, bound: map[string]string{}, split: map[string][2]string{}}
				runs[name] = cur
				continue
			}
			if cur == nil {
				continue
			}
			if m := reTTFTLine.FindStringSubmatch(line); m != nil {
				v, _ := strconv.ParseFloat(m[3], 64)
				cur.median[m[1]+"/"+m[2]] = v
			} else if m := reBoundLine.FindStringSubmatch(line); m != nil {
				cur.bound[m[1]] = fmt.Sprintf("%s (%s-%s)", m[2], m[3], m[4])
			} else if m := reRatioLine.FindStringSubmatch(line); m != nil {
				cur.split[m[1]] = [2]string{m[2], m[3]}
			}
		}
	}
	return runs
}

// ttftTable returns the rows of the markdown table that follows the line
// starting with lead in text, as cells.
func ttftTable(t *testing.T, text, lead string) [][]string {
	t.Helper()
	i := strings.Index(text, lead)
	if i < 0 {
		t.Fatalf("docs/vllm.md: no table after %q", lead)
	}
	var rows [][]string
	started := false
	for _, line := range strings.Split(text[i:], "\n")[1:] {
		if !strings.HasPrefix(line, "|") {
			if started {
				break
			}
			continue
		}
		started = true
		cells := strings.Split(strings.Trim(line, "|"), "|")
		for k := range cells {
			cells[k] = strings.TrimSpace(cells[k])
		}
		if strings.HasPrefix(cells[0], "---") || cells[0] == "call" {
			continue
		}
		rows = append(rows, cells)
	}
	return rows
}

var reLinkText = regexp.MustCompile(`^\[([^\]]+)\]\([^)]*\)$`)

// number parses a figure as the docs write it (1,314; 26.7).
func number(t *testing.T, s string) float64 {
	t.Helper()
	v, err := strconv.ParseFloat(strings.ReplaceAll(s, ",", ""), 64)
	if err != nil {
		t.Fatalf("docs/vllm.md: %q is no number", s)
	}
	return v
}

// sameFigure says whether doc, written with its own precision, is raw
// rounded to it.
func sameFigure(t *testing.T, doc string, raw float64) bool {
	v := number(t, doc)
	places := 0
	if i := strings.IndexByte(doc, '.'); i >= 0 {
		places = len(doc) - i - 1
	}
	return math.Abs(v-raw) <= 0.5*math.Pow(10, -float64(places))+1e-9
}

// TestTTFTFiguresMatchTheirRawFiles: every figure of docs/vllm.md's TTFT
// tables is the median its call's raw file printed (the bound's ratio and
// range, the split's ratios too), and README's TTFT sentence gives the
// range of the 32 K rows: a figure re-typed or kept from an older call
// fails here.
func TestTTFTFiguresMatchTheirRawFiles(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("docs", "vllm.md"))
	if err != nil {
		t.Fatal(err)
	}
	text := string(b)
	start := strings.Index(text, "\n### TTFT\n")
	if start < 0 {
		t.Fatal("docs/vllm.md has no TTFT section")
	}
	text = text[start:]
	// call returns a row's call: its commit and the suffix of its runs'
	// names ("3720e1fe b": the b call of that commit, runs "tmpfs-b"
	// and "cold-b"; "" for a commit's first call), and the run a third
	// word names ("103896e9 c43 graphs8-a": run "graphs8-a-c43"; ""
	// where none does).
	call := func(cell string) (commit, suffix, run string) {
		if m := reLinkText.FindStringSubmatch(cell); m != nil {
			cell = m[1]
		}
		f := strings.Fields(cell)
		commit = f[0]
		if len(f) > 1 {
			suffix = "-" + f[1]
		}
		if len(f) > 2 {
			run = f[2] + suffix
		}
		return commit, suffix, run
	}
	var layerwise, ratios, bounds, recomputes []float64
	for _, r := range ttftTable(t, text, "From tmpfs, files registered") {
		c, suffix, name := call(r[0])
		if name == "" {
			name = "tmpfs" + suffix
		}
		p := strings.ReplaceAll(r[1], ",", "")
		run := ttftRuns(t, c)[name]
		if run == nil {
			t.Errorf("%s: its raw file has no %s run", c, name)
			continue
		}
		for k, mode := range []string{"recompute", "bound", "whole", "layerwise"} {
			raw, ok := run.median[p+"/"+mode]
			if r[2+k] == "–" { // a mode the run did not time
				if ok {
					t.Errorf("docs/vllm.md: %s P %s %s: –, the raw file says %v", c, p, mode, raw)
				}
				continue
			}
			if !ok || !sameFigure(t, r[2+k], raw) {
				t.Errorf("docs/vllm.md: %s P %s %s: %s, the raw file says %v", c, p, mode, r[2+k], raw)
			}
		}
		if want := strings.ReplaceAll(r[6], "–", "-"); run.bound[p] != want {
			t.Errorf("docs/vllm.md: %s P %s layer-wise / bound %q, the raw file says %q", c, p, r[6], run.bound[p])
		}
		if p == "32256" {
			layerwise = append(layerwise, run.median[p+"/layerwise"])
			ratio, _ := strconv.ParseFloat(strings.Fields(run.bound[p])[0], 64)
			ratios = append(ratios, ratio)
			bounds = append(bounds, run.median[p+"/bound"])
			recomputes = append(recomputes, run.median[p+"/recompute"])
		}
	}
	for _, r := range ttftTable(t, text, "From the cold ext4 disk") {
		c, suffix, _ := call(r[0])
		p := strings.ReplaceAll(r[1], ",", "")
		run := ttftRuns(t, c)["cold"+suffix]
		if run == nil {
			t.Errorf("%s: its raw file has no cold%s run", c, suffix)
			continue
		}
		for k, mode := range []string{"recompute", "whole", "llmd"} {
			if raw, ok := run.median[p+"/"+mode]; !ok || !sameFigure(t, r[2+k], raw) {
				t.Errorf("docs/vllm.md: %s P %s %s: %s, the raw file says %v", c, p, mode, r[2+k], raw)
			}
		}
		if raw := run.median[p+"/split"]; !sameFigure(t, strings.Fields(r[5])[0], raw) {
			t.Errorf("docs/vllm.md: %s P %s split: %s, the raw file says %v", c, p, r[5], raw)
		}
		if got := run.split[p]; got != [2]string{r[6], r[7]} {
			t.Errorf("docs/vllm.md: %s P %s split and model ratios %s, %s; the raw file says %v", c, p, r[6], r[7], got)
		}
	}
	if len(layerwise) < 2 {
		t.Fatalf("docs/vllm.md: %d 32 K rows from tmpfs; want every call's", len(layerwise))
	}
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	span := func(xs []float64, format string) string {
		return fmt.Sprintf(format, slices.Min(xs)) + "–" + fmt.Sprintf(format, slices.Max(xs))
	}
	thousands := func(v float64) string {
		s := strconv.Itoa(int(math.Round(v)))
		if len(s) > 3 {
			s = s[:len(s)-3] + "," + s[len(s)-3:]
		}
		return s
	}
	want := fmt.Sprintf("first token after %s ms, %s × the\nhardware's bound of %s ms, against %s–%s ms recomputing",
		span(layerwise, "%.0f"), span(ratios, "%.2f"), span(bounds, "%.0f"),
		thousands(slices.Min(recomputes)), thousands(slices.Max(recomputes)))
	if !strings.Contains(string(readme), want) {
		t.Errorf("README.md's TTFT sentence does not give the docs' 32 K range; want %q", want)
	}
}
