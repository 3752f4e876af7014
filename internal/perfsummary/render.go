package main

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// Render writes the summary table of results, with a footnote per row.
// link is the path from the document to docs/bench ("bench/" from
// docs/performance.md, "docs/bench/" from the README).
func Render(results []Result, link string) string {
	var b strings.Builder
	b.WriteString("| target | kvhost | its ceiling | llm-d, same call | × llm-d | goal | goal met? | commit | raw |\n")
	b.WriteString("| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
	for i, res := range results {
		r := res.Row
		cells := []string{
			fmt.Sprintf("%s <sup>%d</sup>", r.Name, i+1),
			valueRange(res),
			ceilingCell(res),
			peerCell(res),
			ratioCell(res),
			goalCell(r),
			status(res),
			strings.Join(res.Commits, ", "),
			rawCell(res, link),
		}
		b.WriteString("| " + strings.Join(cells, " | ") + " |\n")
	}
	b.WriteString("\n")
	for i, res := range results {
		b.WriteString(wrapText(fmt.Sprintf("<sup>%d</sup> %s %s", i+1, res.Row.Conditions, runsSentence(res))) + "\n")
		if i < len(results)-1 {
			b.WriteString("\n")
		}
	}
	return b.String()
}

func values(res Result) []float64 {
	v := make([]float64, len(res.Runs))
	for i, r := range res.Runs {
		v[i] = r.Value
	}
	return v
}

func valueRange(res Result) string {
	if res.Row.kind() == "lookups" {
		return span(values(res), 0) + " µs p99"
	}
	return gbps(values(res)) + " GB/s"
}

// gbps formats throughputs to one decimal, two below 10 GB/s.
func gbps(v []float64) string {
	if slices.Max(v) < 10 {
		return span(v, 2)
	}
	return span(v, 1)
}

// span is "lo–hi" of v, or one figure where both print alike.
func span(v []float64, prec int) string {
	lo := strconv.FormatFloat(slices.Min(v), 'f', prec, 64)
	hi := strconv.FormatFloat(slices.Max(v), 'f', prec, 64)
	if lo == hi {
		return lo
	}
	return lo + "–" + hi
}

func ceilingCell(res Result) string {
	c := make([]float64, len(res.Runs))
	for i, r := range res.Runs {
		c[i] = r.Ceiling
	}
	switch res.Row.Ceiling {
	case "link", "staged":
		return span(c, 2) + " of " + res.Row.Ceiling
	case "file":
		return gbps(c) + " GB/s file"
	}
	return "—"
}

func peerCell(res Result) string {
	if len(res.Peer) == 0 {
		return "—"
	}
	return gbps(res.Peer) + " GB/s"
}

// ratios are each run over the fastest and the slowest llm-d figure it is
// compared with: the least and the most it can be said to lead by.
func ratios(run RunFigure) (lo, hi float64) {
	return run.Value / slices.Max(run.Peer), run.Value / slices.Min(run.Peer)
}

func ratioCell(res Result) string {
	if len(res.Peer) == 0 {
		return "—"
	}
	var all []float64
	for _, r := range res.Runs {
		lo, hi := ratios(r)
		all = append(all, lo, hi)
	}
	return span(all, 2)
}

func goalCell(r *Row) string {
	var g []string
	if r.Goal.Peer != 0 {
		g = append(g, "≥ "+trim(r.Goal.Peer)+"×")
	}
	if r.Goal.Link != 0 {
		g = append(g, "≥ "+trim(r.Goal.Link)+" of link")
	}
	if r.Goal.MaxUS != 0 {
		g = append(g, "< "+trim(r.Goal.MaxUS)+" µs")
	}
	if len(g) == 0 {
		return "—"
	}
	return strings.Join(g, ", ")
}

func trim(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }

// status counts the runs that miss each goal; a run misses the peer goal
// where it falls short against the fastest llm-d figure of its call.
func status(res Result) string {
	r := res.Row
	if r.Goal == (Goal{}) {
		return "—"
	}
	n := len(res.Runs)
	var miss []string
	count := func(f func(RunFigure) bool) int {
		k := 0
		for _, run := range res.Runs {
			if f(run) {
				k++
			}
		}
		return k
	}
	if r.Goal.Peer != 0 {
		if k := count(func(run RunFigure) bool { lo, _ := ratios(run); return lo < r.Goal.Peer }); k > 0 {
			miss = append(miss, fmt.Sprintf("%d of %d below %s×", k, n, trim(r.Goal.Peer)))
		}
	}
	if r.Goal.Link != 0 {
		if k := count(func(run RunFigure) bool { return run.Ceiling < r.Goal.Link }); k > 0 {
			miss = append(miss, fmt.Sprintf("%d of %d below %s of link", k, n, trim(r.Goal.Link)))
		}
	}
	if r.Goal.MaxUS != 0 {
		if k := count(func(run RunFigure) bool { return run.Value >= r.Goal.MaxUS }); k > 0 {
			miss = append(miss, fmt.Sprintf("%d of %d at or above %s µs", k, n, trim(r.Goal.MaxUS)))
		}
	}
	if len(miss) == 0 {
		return fmt.Sprintf("met (%d of %d)", n, n)
	}
	return "missed: " + strings.Join(miss, "; ")
}

// rawCell links each call file once, with its call numbers, and the reports.
func rawCell(res Result, link string) string {
	var files []string
	nums := map[string][]string{}
	var reports []string
	for _, c := range res.Calls {
		if c.N == 0 {
			reports = append(reports, c.File)
			continue
		}
		if _, ok := nums[c.File]; !ok {
			files = append(files, c.File)
		}
		nums[c.File] = append(nums[c.File], strconv.Itoa(c.N))
	}
	var parts []string
	for _, f := range files {
		word := "call"
		if len(nums[f]) > 1 {
			word = "calls"
		}
		parts = append(parts, fmt.Sprintf("[%s %s](%s%s)", word, strings.Join(nums[f], ", "), link, f))
	}
	reports = append(reports, res.Row.Reports...)
	for i, rep := range reports {
		label := "report"
		if len(reports) > 1 {
			label = fmt.Sprintf("report %d", i+1)
		}
		parts = append(parts, fmt.Sprintf("[%s](%s%s)", label, link, rep))
	}
	return strings.Join(parts, ", ")
}

func runsSentence(res Result) string {
	word := "runs"
	if len(res.Runs) == 1 {
		word = "run"
	}
	s := fmt.Sprintf("%d %s", len(res.Runs), word)
	if len(res.Dates) > 0 {
		s += ", " + strings.Join(res.Dates, ", ")
	}
	return "(" + s + ".)"
}
