package main

import (
	"encoding/json"
	"fmt"
	"io/fs"
	"math"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/kvhost/kvhost/internal/bench"
)

// A Result is one row's figures, read from the raw files.
type Result struct {
	Row  *Row
	Runs []RunFigure
	// Peer is every llm-d figure the row's runs were compared with.
	Peer []float64
	// Calls are the calls the figures came from, in manifest order, with
	// their files' dates.
	Calls   []callRef
	Dates   []string
	Commits []string // distinct, in call order
}

// A RunFigure is one kvhost run of a row.
type RunFigure struct {
	Value float64 // GB/s, or a p99 in µs for lookups rows
	// Ceiling is the run's link fraction or file ceiling (report rows).
	Ceiling float64
	// Peer are the llm-d figures this run is compared with.
	Peer []float64
	Call callRef
}

var reRunNumber = regexp.MustCompile(`-(\d+)\.json$`)

// Compute reads every file the manifest names from dir (docs/bench) and
// returns the rows' figures. A call, line or report that is not there, or
// a report whose figures differ from its line in a call, is an error.
func Compute(m *Manifest, dir fs.FS) ([]Result, error) {
	files := map[string]*CallFile{}
	load := func(name string) (*CallFile, error) {
		if f, ok := files[name]; ok {
			return f, nil
		}
		b, err := fs.ReadFile(dir, name)
		if err != nil {
			return nil, err
		}
		f, err := ParseFile(name, string(b))
		if err != nil {
			return nil, err
		}
		files[name] = f
		return f, nil
	}
	out := make([]Result, 0, len(m.Rows))
	for i := range m.Rows {
		r := &m.Rows[i]
		res, err := computeRow(r, load, dir)
		if err != nil {
			return nil, fmt.Errorf("row %q: %w", r.Name, err)
		}
		out = append(out, res)
	}
	return out, nil
}

func computeRow(r *Row, load func(string) (*CallFile, error), dir fs.FS) (Result, error) {
	res := Result{Row: r}
	var calls []*Call
	for _, s := range r.Calls {
		ref, err := parseCallRef(s)
		if err != nil {
			return res, err
		}
		if ref.N == 0 {
			runs, commit, date, err := jsonRuns(r, dir, ref)
			if err != nil {
				return res, fmt.Errorf("%s: %w", ref, err)
			}
			res.Calls = append(res.Calls, ref)
			if !slices.Contains(res.Dates, date) {
				res.Dates = append(res.Dates, date)
			}
			if !slices.Contains(res.Commits, commit) {
				res.Commits = append(res.Commits, commit)
			}
			res.Runs = append(res.Runs, runs...)
			continue
		}
		f, err := load(ref.File)
		if err != nil {
			return res, err
		}
		c, err := f.Call(ref.N)
		if err != nil {
			return res, err
		}
		commit := c.Commit
		switch {
		case commit == "" && r.Commit == "":
			return res, fmt.Errorf("%s: the file names no commit (it may hold several builds): set the row's commit", ref)
		case commit == "":
			commit = r.Commit
		}
		calls = append(calls, c)
		res.Calls = append(res.Calls, ref)
		if !slices.Contains(res.Dates, f.Date) && f.Date != "" {
			res.Dates = append(res.Dates, f.Date)
		}
		if !slices.Contains(res.Commits, commit) {
			res.Commits = append(res.Commits, commit)
		}
		runs, err := rowRuns(r, c, ref)
		if err != nil {
			return res, fmt.Errorf("%s: %w", ref, err)
		}
		res.Runs = append(res.Runs, runs...)
	}
	for _, run := range res.Runs {
		res.Peer = append(res.Peer, run.Peer...)
	}
	slices.Sort(res.Peer)
	res.Peer = slices.Compact(res.Peer)
	var txtRefs []callRef
	for _, ref := range res.Calls {
		if ref.N != 0 {
			txtRefs = append(txtRefs, ref)
		}
	}
	for _, name := range r.Reports {
		if err := checkReport(r, name, dir, txtRefs, calls); err != nil {
			return res, err
		}
	}
	return res, nil
}

// rowRuns picks a row's runs out of one call.
func rowRuns(r *Row, c *Call, ref callRef) ([]RunFigure, error) {
	var peers []PeerLine
	if r.Peer != "" {
		re := regexp.MustCompile("^(?:" + r.Peer + ")$")
		for _, p := range c.Peer {
			if re.MatchString(p.Label) && p.phase(r.PeerPhase) != nil {
				peers = append(peers, p)
			}
		}
		if len(peers) == 0 {
			return nil, fmt.Errorf("no llmd line labelled %q with a %q phase", r.Peer, r.PeerPhase)
		}
		for _, p := range peers {
			if bad := p.phase(r.PeerPhase).Bad; bad != "" {
				return nil, fmt.Errorf("llmd %s (line %d) %s is no figure: %s", p.Label, p.Line, r.PeerPhase, bad)
			}
		}
	}
	// peerFor is the llm-d figures a run is compared with: those of its
	// pair where the call ran pairs and the run names one, else the call's.
	peerFor := func(name string, byPair bool) ([]float64, error) {
		var paired bool
		for _, p := range peers {
			paired = paired || p.Pair != 0
		}
		paired = paired && byPair
		var out []float64
		if !paired {
			for _, p := range peers {
				out = append(out, p.phase(r.PeerPhase).GBps...)
			}
			return out, nil
		}
		m := reRunNumber.FindStringSubmatch(name)
		if m == nil {
			return nil, fmt.Errorf("the llmd lines are in pairs, and %q names no pair (-N.json)", name)
		}
		n, _ := strconv.Atoi(m[1])
		for _, p := range peers {
			if p.Pair == n {
				out = append(out, p.phase(r.PeerPhase).GBps...)
			}
		}
		if out == nil {
			return nil, fmt.Errorf("no llmd pair %d for %s", n, name)
		}
		return out, nil
	}
	var runs []RunFigure
	switch r.kind() {
	case "report":
		re := regexp.MustCompile("^(?:" + r.Report + ")$")
		for _, k := range c.KV {
			if !re.MatchString(k.Report) || k.Direction != r.Phase || !sumsMatch(r.Sums, k.Sums) {
				continue
			}
			run := RunFigure{Value: k.GBps, Ceiling: k.Link, Call: ref}
			switch r.Ceiling {
			case "file":
				run.Ceiling = k.CeilingGBps
			case "staged":
				run.Ceiling = k.Staged
			}
			if r.Peer != "" {
				p, err := peerFor(k.Report, !r.Unpaired)
				if err != nil {
					return nil, err
				}
				run.Peer = p
			}
			runs = append(runs, run)
		}
		if len(runs) == 0 {
			return nil, fmt.Errorf("no kvhost line of a report named %q with phase %s (sums %q)", r.Report, r.Phase, r.Sums)
		}
	case "figure":
		re := regexp.MustCompile(r.Figure)
		for _, f := range c.Figure {
			if !re.MatchString(f.Label) {
				continue
			}
			if f.Bad != "" {
				return nil, fmt.Errorf("%q (line %d) is no figure: %s", f.Label, f.Line, f.Bad)
			}
			var p []float64
			if r.Peer != "" {
				var err error
				if p, err = peerFor("", false); err != nil {
					return nil, err
				}
			}
			for _, v := range f.GBps {
				runs = append(runs, RunFigure{Value: v, Peer: p, Call: ref})
			}
		}
		if len(runs) == 0 {
			return nil, fmt.Errorf("no \"LABEL: X GB/s\" line whose label matches %q", r.Figure)
		}
	case "lookups":
		pace := "paced"
		if r.BackToBack {
			pace = "back-to-back"
		}
		var found bool
		for _, l := range c.Lookups {
			if l.Situation != r.Lookups || l.BackToBack != r.BackToBack {
				continue
			}
			found = true
			for _, p := range *l.answer(r.Answer) {
				runs = append(runs, RunFigure{Value: p.P99, Call: ref})
			}
		}
		if !found {
			return nil, fmt.Errorf("no %s %q lookups line", pace, r.Lookups)
		}
		if len(runs) == 0 {
			return nil, fmt.Errorf("the %s %q lookups lines have no %s figures", pace, r.Lookups, r.Answer)
		}
	}
	return runs, nil
}

func (p PeerLine) phase(name string) *PeerPhase {
	for i := range p.Phases {
		if p.Phases[i].Name == name {
			return &p.Phases[i]
		}
	}
	return nil
}

// sumsMatch: a line that does not say ran with kvhost's default, checksums on.
func sumsMatch(want, line string) bool {
	if line == "" {
		line = "on"
	}
	return want == "" || want == line
}

// readReport reads a `kvhost bench --json` report of this schema and the
// commit its version names.
func readReport(dir fs.FS, name string) (*bench.Report, string, error) {
	b, err := fs.ReadFile(dir, name)
	if err != nil {
		return nil, "", err
	}
	var rep bench.Report
	if err := json.Unmarshal(b, &rep); err != nil {
		return nil, "", fmt.Errorf("%s: %w", name, err)
	}
	if rep.Schema != bench.Schema {
		return nil, "", fmt.Errorf("%s: schema %q, want %q", name, rep.Schema, bench.Schema)
	}
	v := strings.Fields(rep.Version)
	if len(v) < 2 {
		return nil, "", fmt.Errorf("%s: version %q names no commit", name, rep.Version)
	}
	if v[1] == "devel" {
		return &rep, "", nil // built outside a checkout: no commit
	}
	return &rep, strings.TrimSuffix(v[1], "-dirty"), nil
}

// benchArgs are a report's `kvhost bench` arguments less --progress and
// --json, which do not change what ran, spaces collapsed.
func benchArgs(cmd []string) string {
	var out []string
	for i := 0; i < len(cmd); i++ {
		switch {
		case i < 2 && (cmd[i] == "kvhost" || cmd[i] == "bench" || strings.HasSuffix(cmd[i], "/kvhost")):
		case (cmd[i] == "--progress" || cmd[i] == "--json") && i+1 < len(cmd):
			i++
		default:
			out = append(out, cmd[i])
		}
	}
	return strings.Join(out, " ")
}

// jsonRuns reads a report row's phases straight from a JSON report.
func jsonRuns(r *Row, dir fs.FS, ref callRef) (runs []RunFigure, commit, date string, err error) {
	rep, commit, err := readReport(dir, ref.File)
	if err != nil {
		return nil, "", "", err
	}
	if commit == "" {
		return nil, "", "", fmt.Errorf("version %q names no commit", rep.Version)
	}
	sizes := map[int64]bool{}
	for _, run := range rep.Runs {
		sums := "off"
		if run.Checksums {
			sums = "on"
		}
		if run.Direction != r.Phase || !sumsMatch(r.Sums, sums) || (r.KeyMiB != 0 && run.KeyBytes != int64(r.KeyMiB)<<20) {
			continue
		}
		sizes[run.KeyBytes] = true
		f := RunFigure{Value: run.GBps, Ceiling: run.FractionLink, Call: ref}
		switch r.Ceiling {
		case "file":
			f.Ceiling = run.Ceiling.GBps
		case "staged":
			f.Ceiling = run.FractionStaged
		}
		runs = append(runs, f)
	}
	if len(runs) == 0 {
		return nil, "", "", fmt.Errorf("no %s phase (sums %q, key_mib %d)", r.Phase, r.Sums, r.KeyMiB)
	}
	if len(sizes) > 1 {
		return nil, "", "", fmt.Errorf("%s phases of %d key sizes: set key_mib", r.Phase, len(sizes))
	}
	return runs, commit, rep.Started.Format("2006-01-02"), nil
}

// checkReport holds a `kvhost bench --json` report against the lines the
// call that ran it printed: the same report name (its --json file), a call
// of the same commit, every phase's GB/s, link fraction and staged
// fraction equal to the line's two decimals.
func checkReport(r *Row, name string, dir fs.FS, refs []callRef, calls []*Call) error {
	rep, commit, err := readReport(dir, name)
	if err != nil {
		return err
	}
	var written string
	for i, a := range rep.Command {
		if a == "--json" && i+1 < len(rep.Command) {
			written = path.Base(rep.Command[i+1])
		}
	}
	if written == "" {
		return fmt.Errorf("%s: its command has no --json FILE", name)
	}
	args := benchArgs(rep.Command)
	// A report kept as RAW-WRITTEN (its raw file's name, less .txt, then
	// the name it was written under: the rule for new ones) is held
	// against that file's calls only: two calls of one commit may both
	// have written a kv-NAME.json.
	order := make([]int, 0, len(calls))
	for i := range calls {
		if path.Base(name) == strings.TrimSuffix(refs[i].File, ".txt")+"-"+written {
			order = append(order, i)
		}
	}
	if len(order) == 0 {
		for i := range calls {
			order = append(order, i)
		}
	}
	for _, i := range order {
		c := calls[i]
		callCommit := c.Commit
		if callCommit == "" {
			callCommit = r.Commit
		}
		if commit != "" && !strings.HasPrefix(callCommit, commit) && !strings.HasPrefix(commit, callCommit) {
			continue
		}
		var lines []KVLine
		for _, k := range c.KV {
			if k.Report == written {
				lines = append(lines, k)
			}
		}
		if len(lines) == 0 {
			continue
		}
		// A report without a commit matches by its arguments, which only
		// a sweep file's sections record; the call's commit, where it
		// names one, is then the build's.
		if commit == "" && c.Commit != "" && lines[0].Args == "" {
			continue
		}
		if commit == "" && lines[0].Args != args {
			return fmt.Errorf("%s names no commit, and its arguments %q differ from those of %s in %s (line %d): %q", name, args, written, refs[i], lines[0].Line, lines[0].Args)
		}
		if len(lines) != len(rep.Runs) {
			return fmt.Errorf("%s: %d phases, but %s prints %d lines of %s", name, len(rep.Runs), refs[i], len(lines), written)
		}
		for _, run := range rep.Runs {
			sums := "off"
			if run.Checksums {
				sums = "on"
			}
			var found bool
			for _, k := range lines {
				if k.Direction != run.Direction || !sumsMatch(sums, k.Sums) {
					continue
				}
				found = true
				if round2(run.GBps) != k.GBps || round2(run.FractionLink) != k.Link || round2(run.FractionStaged) != k.Staged {
					return fmt.Errorf("%s: %s (sums %s) at %.2f GB/s, %.2f of link, %.2f of staged; %s line %d says %.2f, %.2f, %.2f",
						name, run.Direction, sums, run.GBps, run.FractionLink, run.FractionStaged, refs[i], k.Line, k.GBps, k.Link, k.Staged)
				}
			}
			if !found {
				return fmt.Errorf("%s: no line of %s in %s for its %s phase (sums %s)", name, written, refs[i], run.Direction, sums)
			}
		}
		return nil
	}
	if commit == "" {
		commit = "no commit"
	}
	return fmt.Errorf("%s (%s at %s) is in none of the row's calls", name, written, commit)
}

func round2(v float64) float64 { return math.Round(v*100) / 100 }
