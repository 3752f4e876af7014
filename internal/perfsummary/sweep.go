package main

import (
	"bufio"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

var (
	reSweepKV      = regexp.MustCompile(`^== kvhost-(\S+) (\S+):\s*(.*)$`)
	reSweepLLMD    = regexp.MustCompile(`^== llmd (\S+):\s*(.*)$`)
	reSweepForeign = regexp.MustCompile(`^== foreign (\S+)\s*$`)
	reSweepPairN   = regexp.MustCompile(`-(\d+)$`)
	reSweepPeer    = regexp.MustCompile(`^llmd (store(?:\+sync)?|(?:cold )?load) GB/s ([0-9.]+) files (\d+) round (\d+) ok (True|False)(?: layers_differ (\d+))?\s*$`)
	reSweepStore   = regexp.MustCompile(`^store: (\d+) keys of (\d+ [KMG]iB) in (\d+) jobs: ([0-9.]+) GB/s\s*$`)
	reSweepLoad    = regexp.MustCompile(`^load after restart: (\d+)/(\d+) keys of (\d+ [KMG]iB) in (\d+) jobs: ([0-9.]+) GB/s; (\d+) keys differ\s*$`)
	reSweepMetric  = regexp.MustCompile(`^\s+kvhost_\w+(\{.*\})? \S+$`)
	reNumber       = regexp.MustCompile(`^\d+(?:\.\d+)?$`)
	reSize         = regexp.MustCompile(`^(?:0|\d+(?:\.\d+)?(?:B|KiB|MiB|GiB|TiB))$`)
)

// The labels a sweep file's "== foreign VARIANT" lines get, after
// "foreign VARIANT ": the other daemon's stores, then each pair of loads.
const (
	foreignStore   = "store"
	foreignLookup  = "load right after lookup"
	foreignSettled = "load after registrar settled"
)

// ParseSweepFile reads the raw output of the sweep driver: one device call
// that ran llm-d's engine and one or more kvhost builds ("variants") in
// turn. Its sections:
//
//   - "== kvhost-VARIANT NAME: ARGS": `kvhost bench ARGS` of that build; its
//     table rows (indented, without their header) become KVLines named
//     "kv-VARIANT-NAME.json", the name the driver gives the --json report
//     of the run. The "of reread:", "of staged:" and "of link:" notes
//     after the rows (or the table's header, where kept) say which
//     optional columns the rows have.
//   - "== llmd NAME: ARGS": "llmd store|load GB/s X files N round R ok
//     True [layers_differ 0]" lines; one PeerLine labelled NAME, of pair
//     N where NAME ends in "-N"; with --cold in ARGS its loads are the
//     phase "cold load", with --sync its stores "store+sync".
//   - "== foreign VARIANT": scripts/gpu-check.sh FOREIGN: "store: ..."
//     lines (the other daemon's stores) and "load after restart: A/B keys
//     ... X GB/s; N keys differ" lines in pairs, the first right after the
//     lookup, the second after the registrar settled; FigureLines labelled
//     "foreign VARIANT store", "... load right after lookup" and "... load
//     after registrar settled".
//
// Other lines are prose. A line of one of these kinds that does not parse,
// or a table whose columns cannot be told, is an error naming the line.
// A file of one build may name its commit in a "#" header line ("commit
// HEX", the first one); a file that names none may hold several builds,
// and the rows that read it say which they ran.
func ParseSweepFile(name, text string) (*CallFile, error) {
	f := &CallFile{Name: name}
	c := Call{N: 1, Line: 1}
	var (
		sec      string // "kvhost", "llmd", "foreign" or "" before the first
		tab      sweepTable
		peer     *PeerLine
		peerArgs []string // the llmd section's driver arguments
		variant  string
		loads    int // "load after restart" lines in this foreign section
		lastSec  int // the line of the current section's header
	)
	endSection := func() error {
		switch sec {
		case "kvhost":
			kv, err := tab.lines(name)
			if err != nil {
				return err
			}
			c.KV = append(c.KV, kv...)
		case "llmd":
			if len(peer.Phases) == 0 {
				return fmt.Errorf("%s:%d: the llmd section has no \"llmd store|load GB/s ...\" line", name, lastSec)
			}
			// The driver's --cold drops the page cache before each load
			// and --sync counts a sync in each store: their phases are
			// named as the peer call files name them. The earlier
			// drivers' lines say "load" and "store" whatever the flags;
			// scripts/peer-llmd.py's name the phase, which must agree.
			for i := range peer.Phases {
				ph := &peer.Phases[i]
				for _, f := range []struct{ plain, named, flag string }{
					{"load", "cold load", "--cold"},
					{"store", "store+sync", "--sync"},
				} {
					flagged := slices.Contains(peerArgs, f.flag)
					if ph.Name == f.plain && flagged {
						ph.Name = f.named
					} else if ph.Name == f.named && !flagged {
						return fmt.Errorf("%s:%d: the llmd section's %q lines need %s among its arguments", name, lastSec, ph.Name, f.flag)
					}
				}
			}
			c.Peer = append(c.Peer, *peer)
		case "foreign":
			if loads%2 != 0 {
				return fmt.Errorf("%s:%d: the foreign section has %d \"load after restart\" lines; they come in pairs (right after lookup, after the registrar settled)", name, lastSec, loads)
			}
		}
		return nil
	}
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	n := 0
	for sc.Scan() {
		n++
		line := sc.Text()
		f.noteDate(line)
		if strings.HasPrefix(line, "#") {
			c.noteCommit(line)
		}
		if strings.HasPrefix(line, "== ") {
			if err := endSection(); err != nil {
				return nil, err
			}
			lastSec = n
			if m := reSweepKV.FindStringSubmatch(line); m != nil {
				sec, variant = "kvhost", m[1]
				args := strings.Join(strings.Fields(m[3]), " ")
				tab = sweepTable{report: "kv-" + m[1] + "-" + m[2] + ".json", args: args,
					noGap: slices.Contains(strings.Fields(args), "--no-gap")}
				for _, k := range c.KV {
					if k.Report == tab.report {
						return nil, fmt.Errorf("%s:%d: kvhost-%s %s appears twice (first at line %d)", name, n, m[1], m[2], k.Line)
					}
				}
				continue
			}
			if m := reSweepLLMD.FindStringSubmatch(line); m != nil {
				for _, p := range c.Peer {
					if p.Label == m[1] {
						return nil, fmt.Errorf("%s:%d: llmd %s appears twice (first at line %d)", name, n, m[1], p.Line)
					}
				}
				sec, peer, peerArgs = "llmd", &PeerLine{Line: n, Label: m[1]}, strings.Fields(m[2])
				// "NAME-N": llm-d's run of pair N, which the driver runs
				// right before kvhost's "NAME-N" runs.
				if pm := reSweepPairN.FindStringSubmatch(m[1]); pm != nil {
					peer.Pair, _ = strconv.Atoi(pm[1])
				}
				continue
			}
			if m := reSweepForeign.FindStringSubmatch(line); m != nil {
				sec, variant, loads = "foreign", m[1], 0
				continue
			}
			return nil, fmt.Errorf("%s:%d: a section header must read \"== kvhost-VARIANT NAME: ARGS\", \"== llmd NAME: ARGS\" or \"== foreign VARIANT\": %q", name, n, line)
		}
		switch sec {
		case "kvhost":
			if err := tab.add(n, line); err != nil {
				return nil, fmt.Errorf("%s:%d: %w", name, n, err)
			}
		case "llmd":
			if strings.HasPrefix(line, "llmd") {
				if err := addSweepPeer(peer, line); err != nil {
					return nil, fmt.Errorf("%s:%d: %w", name, n, err)
				}
			}
		case "foreign":
			label := "foreign " + variant + " "
			switch {
			case strings.HasPrefix(line, "store:"):
				m := reSweepStore.FindStringSubmatch(line)
				if m == nil {
					return nil, fmt.Errorf("%s:%d: a foreign store line must read \"store: N keys of S MiB in J jobs: X GB/s\": %q", name, n, line)
				}
				v, _ := strconv.ParseFloat(m[4], 64)
				c.Figure = append(c.Figure, FigureLine{Line: n, Label: label + foreignStore, GBps: []float64{v}})
			case strings.HasPrefix(line, "load after restart:"):
				m := reSweepLoad.FindStringSubmatch(line)
				if m == nil {
					return nil, fmt.Errorf("%s:%d: a foreign load line must read \"load after restart: A/B keys of S MiB in J jobs: X GB/s; N keys differ\": %q", name, n, line)
				}
				v, _ := strconv.ParseFloat(m[5], 64)
				fl := FigureLine{Line: n, Label: label + foreignLookup, GBps: []float64{v}}
				if loads%2 == 1 {
					fl.Label = label + foreignSettled
				}
				if m[1] != m[2] || m[6] != "0" {
					fl.Bad = fmt.Sprintf("line %d loaded %s of %s keys, %s differing", n, m[1], m[2], m[6])
				}
				c.Figure = append(c.Figure, fl)
				loads++
			case strings.HasPrefix(line, "llmd"):
				return nil, fmt.Errorf("%s:%d: an llmd line outside an \"== llmd NAME: ARGS\" section: %q", name, n, line)
			case strings.HasPrefix(line, " ") && !reSweepMetric.MatchString(line):
				return nil, fmt.Errorf("%s:%d: an indented line in a foreign section must be a kvhost_ metric: %q", name, n, line)
			}
		default:
			if strings.HasPrefix(line, "llmd") || strings.HasPrefix(line, "load after restart:") {
				return nil, fmt.Errorf("%s:%d: a figure line before any section: %q", name, n, line)
			}
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if err := endSection(); err != nil {
		return nil, err
	}
	if len(c.KV) == 0 && len(c.Peer) == 0 && len(c.Figure) == 0 {
		return nil, fmt.Errorf("%s: no figure in any section", name)
	}
	f.Calls = []Call{c}
	return f, nil
}

// addSweepPeer adds one "llmd store|load GB/s X files N round R ok B
// [layers_differ D]" line to its section's PeerLine.
func addSweepPeer(p *PeerLine, line string) error {
	m := reSweepPeer.FindStringSubmatch(line)
	if m == nil {
		return fmt.Errorf("an llmd line must read \"llmd store|store+sync|load|cold load GB/s X files N round R ok True|False [layers_differ D]\": %q", line)
	}
	v, err := strconv.ParseFloat(m[2], 64)
	if err != nil {
		return fmt.Errorf("figure %q: %w", m[2], err)
	}
	var ph *PeerPhase
	for i := range p.Phases {
		if p.Phases[i].Name == m[1] {
			ph = &p.Phases[i]
		}
	}
	if ph == nil {
		p.Phases = append(p.Phases, PeerPhase{Name: m[1]})
		ph = &p.Phases[len(p.Phases)-1]
	}
	round, _ := strconv.Atoi(m[4])
	if round != len(ph.GBps)+1 {
		return fmt.Errorf("llmd %s round %d follows %d rounds: want round %d", m[1], round, len(ph.GBps), len(ph.GBps)+1)
	}
	ph.GBps = append(ph.GBps, v)
	if m[5] != "True" || (m[6] != "" && m[6] != "0") {
		bad := fmt.Sprintf("round %d: ok %s", round, m[5])
		if m[6] != "" {
			bad += ", layers_differ " + m[6]
		}
		if ph.Bad != "" {
			bad = ph.Bad + "; " + bad
		}
		ph.Bad = bad
	}
	return nil
}

// A sweepTable gathers the `kvhost bench` table rows of one kvhost
// section until its notes say which optional columns they have.
type sweepTable struct {
	report, args string
	noGap        bool
	rows         []sweepRow
	// known is true once the header or a note named the optional
	// columns; reread, staged and link say which are there.
	known, reread, staged, link bool
}

type sweepRow struct {
	line int
	text string
}

// add takes one line of a kvhost section: a table row, the table's
// header, a column note, or prose.
func (t *sweepTable) add(n int, line string) error {
	switch {
	case strings.HasPrefix(line, "of reread:"):
		t.known, t.reread = true, true
	case strings.HasPrefix(line, "of staged:"):
		t.known, t.staged = true, true
	case strings.HasPrefix(line, "of link:"):
		t.known, t.link = true, true
	case strings.HasPrefix(line, "fraction:"), strings.HasPrefix(line, "CPU ms/GB:"):
		t.known = true // the notes that `kvhost bench` always prints
	case strings.HasPrefix(line, " ") || strings.HasPrefix(line, "\t"):
		if strings.TrimSpace(line) == "" {
			return nil
		}
		if f := strings.Fields(line); f[0] == "path" {
			t.known = true
			t.reread = strings.Contains(line, "of reread")
			t.staged = strings.Contains(line, "of staged")
			t.link = strings.Contains(line, "of link")
			return nil
		}
		t.rows = append(t.rows, sweepRow{n, line})
	}
	return nil
}

// lines reads the gathered rows. A row's columns: path mover io sums key
// jobs dir hits/keys GB/s ceiling fraction of-best [of-reread]
// [of-staged] [of-link] p50 p99 CPU ceiling's-CPU verified
// ceiling-name... [3 by-round figures]; of reread is blank on a store's
// row, of staged and of link never are where the table has them.
func (t *sweepTable) lines(file string) ([]KVLine, error) {
	var out []KVLine
	for _, r := range t.rows {
		k, err := t.parse(r.text)
		if err != nil {
			return nil, fmt.Errorf("%s:%d: %w: %q", file, r.line, err, r.text)
		}
		k.Line = r.line
		out = append(out, k)
	}
	return out, nil
}

func (t *sweepTable) parse(text string) (KVLine, error) {
	f := strings.Fields(text)
	// A load after a restart (kvhost bench --restart) or by a second
	// engine (--foreign) says so in its dir column: "load (restart)",
	// "load (foreign)", two words.
	restart := len(f) > 7 && f[6] == "load" && f[7] == "(restart)"
	if restart || len(f) > 7 && f[6] == "load" && f[7] == "(foreign)" {
		f = slices.Delete(f, 7, 8)
	}
	if len(f) < 9 {
		return KVLine{}, fmt.Errorf("a kvhost bench row has %d columns, want at least 9 (path mover io sums key jobs dir hits/keys GB/s ...)", len(f))
	}
	k := KVLine{Report: t.report, Direction: f[6], Args: t.args, NoGap: t.noGap, Restart: restart}
	if k.Direction != "store" && k.Direction != "load" {
		return k, fmt.Errorf("column dir is %q, want store or load", f[6])
	}
	switch f[3] {
	case "on", "off", "on*":
		k.Sums = f[3]
	default:
		return k, fmt.Errorf("column sums is %q, want on, off or on*", f[3])
	}
	if a, b, ok := strings.Cut(f[7], "/"); !ok || !reNumber.MatchString(a) || !reNumber.MatchString(b) {
		return k, fmt.Errorf("column keys is %q, want HITS/KEYS", f[7])
	}
	// The figures up to and with verified (a size), then the ceiling's name.
	i := 8
	for i < len(f) && (reNumber.MatchString(f[i]) || reSize.MatchString(f[i])) {
		i++
	}
	nums := f[8:i]
	if len(nums) == 0 || !reSize.MatchString(nums[len(nums)-1]) {
		return k, fmt.Errorf("no verified size before the ceiling's name")
	}
	figs := nums[:len(nums)-1]
	for _, s := range figs {
		if !reNumber.MatchString(s) {
			return k, fmt.Errorf("figure %q among the numeric columns", s)
		}
	}
	// Eight figures always: GB/s, ceiling, fraction, of best, p50, p99,
	// CPU and the ceiling's CPU; of reread, of staged and of link where
	// the table has them. Of link is the fifth figure from the end, of
	// staged the one before it.
	n := len(figs)
	reread, staged, link := t.reread, t.staged, t.link
	if !t.known {
		// Tables printed before the staged ceiling, their notes cut off:
		// 8 figures, or 10 with of reread and of link.
		switch n {
		case 8:
		case 10:
			reread, link = true, true
		default:
			return k, fmt.Errorf("%d figures, and no header or note says whether the table has the \"of reread\", \"of staged\" and \"of link\" columns", n)
		}
	}
	// Of reread is blank on a store's row.
	if want := 8 + btoi(reread && k.Direction == "load") + btoi(staged) + btoi(link); n != want {
		return k, fmt.Errorf("%d figures, want %d for a %s row of a table with of reread %v, of staged %v and of link %v", n, want, k.Direction, reread, staged, link)
	}
	var v [4]float64
	for j, s := range []string{figs[0], figs[1]} {
		v[j], _ = strconv.ParseFloat(s, 64)
	}
	if link {
		v[2], _ = strconv.ParseFloat(figs[n-5], 64)
	}
	if staged {
		v[3], _ = strconv.ParseFloat(figs[n-5-btoi(link)], 64)
	}
	k.GBps, k.CeilingGBps, k.Link, k.Staged = v[0], v[1], v[2], v[3]
	// The ceiling's name, then the by-round spread (three figures) if any.
	rest := f[i:]
	j := len(rest)
	for j > 0 && reNumber.MatchString(rest[j-1]) {
		j--
	}
	if by := len(rest) - j; by != 0 && by != 3 {
		return k, fmt.Errorf("%d figures after the ceiling's name, want 0 or 3 (least, median, greatest of the rounds)", by)
	}
	if j == 0 {
		return k, fmt.Errorf("no ceiling name")
	}
	k.CeilingName = strings.Join(rest[:j], " ")
	return k, nil
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}
