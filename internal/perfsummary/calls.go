package main

import (
	"bufio"
	"fmt"
	"regexp"
	"strconv"
	"strings"
)

// A CallFile is one raw .txt file of one or more device calls. It comes in
// three formats, told apart by their section headers:
//
//   - a call file, the hand-written record of the earlier H100 calls (in
//     git's history): a prose header, then one section per call, each
//     opened by "== call N: kvhost at COMMIT";
//   - a sweep file, the raw output of scripts/peer-sweep.sh, which runs
//     llm-d's engine and kvhost in turn in one call
//     (docs/bench/h200-peer-da57e43.txt): sections "== kvhost-VARIANT
//     NAME: ARGS", "== llmd NAME: ARGS" and "== foreign VARIANT" (see
//     ParseSweepFile);
//   - a check file, the output of scripts/gpu-check.sh
//     (docs/bench/h200-lookups-8bc143f.txt), whose "== lookups-NAME.txt"
//     sections hold lookup latencies (see ParseCheckFile).
//
// A sweep or check file is one call, number 1.
type CallFile struct {
	Name  string // the file's name under docs/bench
	Date  string // the first YYYY-MM-DD of the header, "" if none
	Calls []Call
}

// A Call is one section of a CallFile: the figures of one device call.
type Call struct {
	N int // the call's number in its file
	// Commit is the kvhost commit it ran; "" where the file does not say
	// (a sweep file), and the manifest's row must.
	Commit  string
	Line    int // the line of its "== call" header (1-based)
	KV      []KVLine
	Peer    []PeerLine
	Figure  []FigureLine
	Lookups []LookupLine
}

// A KVLine is one phase of one `kvhost bench` report as a call's summary
// printed it: "  kv-shm32-1.json  load  49.94 GB/s  ceiling pread O_DIRECT
// ↔ pinned 29.1  of link 0.91  direct files 256/256 ...".
type KVLine struct {
	Line        int
	Report      string // the report's file name as the call wrote it
	Direction   string // "store" or "load"
	Sums        string // "on", "off", or "" where the line does not say
	GBps        float64
	CeilingName string // the file ceiling: "pread O_DIRECT ↔ pinned (cold)"
	CeilingGBps float64
	Link        float64 // the fraction of the pinned host–GPU link
	// Staged is the fraction of the staged ceiling (the same files moved
	// plainly through pinned buffers and the GPU); 0 where the line has
	// none.
	Staged float64
	NoGap  bool
	// Restart says a sweep table's load ran after a restart (its dir
	// column "load (restart)": kvhost bench --restart).
	Restart bool
	// Args are the `kvhost bench` arguments of a sweep file's section,
	// "" in a call file (whose reports carry a commit instead).
	Args string
}

// A PeerLine is one line of llm-d's figures: "llmd 32 MiB pair 2 store
// GB/s 23.71 23.68 24.52   load 23.18 23.46 23.52".
type PeerLine struct {
	Line   int
	Label  string // what ran, spaces collapsed: "32 MiB pair 2"
	Pair   int    // N of "pair N" in the label, 0 if none
	Phases []PeerPhase
}

// A PeerPhase is one phase's runs on a PeerLine.
type PeerPhase struct {
	Name string // "store", "store+sync", "load", "cold load"
	GBps []float64
	// Bad says why some of the runs are not figures (a run whose bytes
	// differed); "" where all are. A row that reads such a phase fails.
	Bad string
}

// A FigureLine is a labelled list of GB/s: "  registered (default, ...):
// 36.86 38.37 GB/s".
type FigureLine struct {
	Line  int
	Label string
	GBps  []float64
	// Bad says why the line is not a figure (keys missed or differed); ""
	// where it is. A row that reads such a line fails.
	Bad string
}

// A LookupLine holds the p50/p99 pairs, in µs, of lookups answered from
// the shared lookup table (by the client's C probe where it was built, and
// by its Python probe) and by the daemon, in one situation, and of the
// table probe's stand-in (fixed Python arithmetic as long as its lookups
// back to back, paced the same way).
type LookupLine struct {
	Line      int
	Situation string // "alone" or "beside" (beside host loads)
	// BackToBack is true where each lookup followed the last at once; false
	// where they were paced (one every 2 ms).
	BackToBack bool
	Table      []P50P99
	Python     []P50P99 // the table through the Python probe
	Daemon     []P50P99
	StandIn    []P50P99
}

// answer is the figures of one way of answering, by the name a summary
// row gives it ("table", "python", "stand-in" or "daemon"); nil for any
// other name.
func (l *LookupLine) answer(name string) *[]P50P99 {
	switch name {
	case "table":
		return &l.Table
	case "python":
		return &l.Python
	case "stand-in":
		return &l.StandIn
	case "daemon":
		return &l.Daemon
	}
	return nil
}

// P50P99 is one run's lookup latency percentiles in µs.
type P50P99 struct{ P50, P99 float64 }

var (
	reCall   = regexp.MustCompile(`^== call (\d+): kvhost at ([0-9a-f]{7,40})\b`)
	reDate   = regexp.MustCompile(`\b(\d{4}-\d{2}-\d{2})\b`)
	rePeer   = regexp.MustCompile(`^llmd\s+(.+?)\s+(store(?:\+sync)?)\s+GB/s\s+([0-9.]+(?:\s+[0-9.]+)*)\s+((?:cold )?load)\s+([0-9.]+(?:\s+[0-9.]+)*)\s*$`)
	rePair   = regexp.MustCompile(`\bpair (\d+)\b`)
	reKVHint = regexp.MustCompile(`^\s+kv-\S+\.json\s`)
	reKV     = regexp.MustCompile(`^\s+(kv-\S+\.json)\s+(store|load)\s+(?:sums=(on|off)\s+)?([0-9.]+) GB/s\s+ceiling (.+?) ([0-9.]+)\s+of link ([0-9.]+)\s+direct files \d+/\d+\s+spares [0-9.]+ GiB\s+no_gap (True|False)\s+verified \d+ GiB\s*$`)
	reFigure = regexp.MustCompile(`^\s+([^:]+?):\s+([0-9.]+(?:\s+[0-9.]+)*)\s+GB/s\s*$`)
	reAlone  = regexp.MustCompile(`^\s+alone\s+table\s+((?:\d+/\d+\s*)+?)\s+daemon\s+((?:\d+/\d+\s*)+)$`)
	reBeside = regexp.MustCompile(`^\s+beside\b.*:\s*$`)
	reTable  = regexp.MustCompile(`^\s+table\s+((?:\d+/\d+\s*)+?)\s+daemon\s+((?:\d+/\d+\s*)+)$`)
)

var (
	reCallHeader  = regexp.MustCompile(`(?m)^== call `)
	reSweepHeader = regexp.MustCompile(`(?m)^== (?:kvhost-\S+|llmd) \S+:`)
	reCheckHeader = regexp.MustCompile(`(?m)^== lookups-\S+\.txt\s*$`)
)

// ParseFile reads a raw .txt file of any of the three formats (see
// CallFile), choosing by its section headers.
func ParseFile(name, text string) (*CallFile, error) {
	switch {
	case reCallHeader.MatchString(text):
		return ParseCallFile(name, text)
	case reSweepHeader.MatchString(text):
		return ParseSweepFile(name, text)
	case reCheckHeader.MatchString(text):
		return ParseCheckFile(name, text)
	}
	return nil, fmt.Errorf("%s: no \"== call N: kvhost at COMMIT\", \"== kvhost-VARIANT NAME: ARGS\", \"== llmd NAME: ARGS\" or \"== lookups-NAME.txt\" section: not a format the summary reads", name)
}

// ParseCallFile reads a call file. A line that starts like a figure line
// (llmd, a kv-*.json report, alone/beside lookups) but does not parse is an
// error naming the line, so that a figure is never silently skipped.
func ParseCallFile(name, text string) (*CallFile, error) {
	f := &CallFile{Name: name}
	var cur *Call
	var pendingBeside int // the line of a "beside ...:" awaiting its "table" line
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	n := 0
	for sc.Scan() {
		n++
		line := sc.Text()
		if cur == nil {
			f.noteDate(line)
		}
		if strings.HasPrefix(line, "== call") {
			m := reCall.FindStringSubmatch(line)
			if m == nil {
				return nil, fmt.Errorf("%s:%d: a call header must read \"== call N: kvhost at COMMIT\": %q", name, n, line)
			}
			num, _ := strconv.Atoi(m[1])
			for _, c := range f.Calls {
				if c.N == num {
					return nil, fmt.Errorf("%s:%d: call %d appears twice (first at line %d)", name, n, num, c.Line)
				}
			}
			f.Calls = append(f.Calls, Call{N: num, Commit: m[2], Line: n})
			cur = &f.Calls[len(f.Calls)-1]
			pendingBeside = 0
			continue
		}
		if cur == nil {
			continue // the header's prose
		}
		if pendingBeside != 0 {
			m := reTable.FindStringSubmatch(line)
			if m == nil {
				return nil, fmt.Errorf("%s:%d: the lookups \"beside\" line %d must be followed by a \"table P50/P99 ... daemon P50/P99 ...\" line: %q", name, n, pendingBeside, line)
			}
			l, err := lookupLine(pendingBeside, "beside", m[1], m[2])
			if err != nil {
				return nil, fmt.Errorf("%s:%d: %w", name, n, err)
			}
			cur.Lookups = append(cur.Lookups, l)
			pendingBeside = 0
			continue
		}
		switch {
		case strings.HasPrefix(line, "llmd"):
			m := rePeer.FindStringSubmatch(line)
			if m == nil {
				return nil, fmt.Errorf("%s:%d: an llmd line must read \"llmd LABEL store[+sync] GB/s X ... [cold ]load Y ...\": %q", name, n, line)
			}
			p := PeerLine{Line: n, Label: strings.Join(strings.Fields(m[1]), " ")}
			if pm := rePair.FindStringSubmatch(p.Label); pm != nil {
				p.Pair, _ = strconv.Atoi(pm[1])
			}
			for _, ph := range [][2]string{{m[2], m[3]}, {m[4], m[5]}} {
				v, err := floats(ph[1])
				if err != nil {
					return nil, fmt.Errorf("%s:%d: %w", name, n, err)
				}
				p.Phases = append(p.Phases, PeerPhase{Name: ph[0], GBps: v})
			}
			cur.Peer = append(cur.Peer, p)
		case reKVHint.MatchString(line):
			m := reKV.FindStringSubmatch(line)
			if m == nil {
				return nil, fmt.Errorf("%s:%d: a report line must read \"kv-NAME.json store|load [sums=on|off] X GB/s  ceiling NAME X  of link F  direct files A/B  spares X GiB  no_gap True|False  verified N GiB\": %q", name, n, line)
			}
			k := KVLine{Line: n, Report: m[1], Direction: m[2], Sums: m[3], CeilingName: m[5], NoGap: m[8] == "True"}
			var err error
			if k.GBps, err = strconv.ParseFloat(m[4], 64); err == nil {
				if k.CeilingGBps, err = strconv.ParseFloat(m[6], 64); err == nil {
					k.Link, err = strconv.ParseFloat(m[7], 64)
				}
			}
			if err != nil {
				return nil, fmt.Errorf("%s:%d: %w", name, n, err)
			}
			cur.KV = append(cur.KV, k)
		case strings.HasPrefix(strings.TrimSpace(line), "alone "):
			m := reAlone.FindStringSubmatch(line)
			if m == nil {
				return nil, fmt.Errorf("%s:%d: a lookups line must read \"alone table P50/P99 ... daemon P50/P99 ...\": %q", name, n, line)
			}
			l, err := lookupLine(n, "alone", m[1], m[2])
			if err != nil {
				return nil, fmt.Errorf("%s:%d: %w", name, n, err)
			}
			cur.Lookups = append(cur.Lookups, l)
		case reBeside.MatchString(line):
			pendingBeside = n
		default:
			if m := reFigure.FindStringSubmatch(line); m != nil {
				v, err := floats(m[2])
				if err != nil {
					return nil, fmt.Errorf("%s:%d: %w", name, n, err)
				}
				cur.Figure = append(cur.Figure, FigureLine{Line: n, Label: strings.TrimSpace(m[1]), GBps: v})
			}
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if pendingBeside != 0 {
		return nil, fmt.Errorf("%s:%d: the lookups \"beside\" line has no \"table ... daemon ...\" line after it", name, pendingBeside)
	}
	if len(f.Calls) == 0 {
		return nil, fmt.Errorf("%s: no \"== call N: kvhost at COMMIT\" section", name)
	}
	return f, nil
}

// Call returns call n of the file.
func (f *CallFile) Call(n int) (*Call, error) {
	for i := range f.Calls {
		if f.Calls[i].N == n {
			return &f.Calls[i], nil
		}
	}
	return nil, fmt.Errorf("%s has no call %d", f.Name, n)
}

func floats(s string) ([]float64, error) {
	var out []float64
	for _, w := range strings.Fields(s) {
		v, err := strconv.ParseFloat(w, 64)
		if err != nil {
			return nil, fmt.Errorf("figure %q: %w", w, err)
		}
		out = append(out, v)
	}
	return out, nil
}

func lookupLine(line int, situation, table, daemon string) (LookupLine, error) {
	l := LookupLine{Line: line, Situation: situation}
	for _, part := range []struct {
		s   string
		dst *[]P50P99
	}{{table, &l.Table}, {daemon, &l.Daemon}} {
		for _, w := range strings.Fields(part.s) {
			a, b, _ := strings.Cut(w, "/")
			p50, err := strconv.ParseFloat(a, 64)
			if err != nil {
				return l, fmt.Errorf("lookup figure %q: %w", w, err)
			}
			p99, err := strconv.ParseFloat(b, 64)
			if err != nil {
				return l, fmt.Errorf("lookup figure %q: %w", w, err)
			}
			*part.dst = append(*part.dst, P50P99{p50, p99})
		}
	}
	return l, nil
}

// noteDate takes the file's date from line, the first a line gives.
func (f *CallFile) noteDate(line string) {
	if f.Date == "" {
		if m := reDate.FindStringSubmatch(line); m != nil {
			f.Date = m[1]
		}
	}
}

// noteCommit takes the call's commit from a header line ("commit HEX"),
// the first a line gives.
func (c *Call) noteCommit(line string) {
	if c.Commit == "" {
		if m := reCheckCommit.FindStringSubmatch(line); m != nil {
			c.Commit = m[1]
		}
	}
}
