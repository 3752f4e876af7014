package main

import (
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"github.com/BurntSushi/toml"
)

// Manifest is one machine's docs/bench/summary-NAME.toml: the rows of its
// performance summary and where in the raw files each row's figures are.
// It names files and selects lines; it holds no figure.
type Manifest struct {
	// Setup is the paragraph above the table in docs/performance.md: the
	// machine, the peer and the workload every row shares.
	Setup string `toml:"setup"`
	// ReadmeRows is how many of the first rows the README's headline shows.
	ReadmeRows int `toml:"readme_rows"`
	// Machine names the machine in the headline's first column, and
	// Headline is its conditions there, shorter than Setup: both are
	// needed where ReadmeRows is not 0.
	Machine  string `toml:"machine"`
	Headline string `toml:"headline"`
	Rows     []Row  `toml:"row"`
}

// Row is one target of the summary.
type Row struct {
	Name string `toml:"name"` // the table's first cell, short
	// Calls are the calls whose figures the row reads, each "FILE#N": call
	// N of docs/bench/FILE. A report row without a peer may also name a
	// `kvhost bench --json` report, "FILE.json", and read its phases.
	Calls []string `toml:"calls"`

	// Exactly one of Report, Figure and Lookups says what the row reads.
	//
	// Report is a regular expression over the report names of a call's
	// `kvhost bench` lines ("kv-shm32-\d+\.json"), with Phase (store or
	// load) and Sums ("on", "off", or "" for either; a line that does not
	// say is "on", kvhost's default) picking the phase.
	Report string `toml:"report"`
	Phase  string `toml:"phase"`
	Sums   string `toml:"sums"`
	// KeyMiB picks the key size of a JSON report's phases (0: the report
	// must have one).
	KeyMiB int `toml:"key_mib"`
	// Figure is a regular expression over the labels of "LABEL: X Y GB/s"
	// lines.
	Figure string `toml:"figure"`
	// Lookups is "alone" or "beside": the lookup latency lines, p99 in µs,
	// of the answers from Answer ("table", "python": the table through the
	// client's Python probe, "stand-in": the table probe's stand-in, or
	// "daemon").
	Lookups string `toml:"lookups"`
	Answer  string `toml:"answer"`
	// BackToBack picks the lookups that followed one another at once
	// rather than the paced ones (one every 2 ms).
	BackToBack bool `toml:"back_to_back"`

	// Commit is the kvhost commit of the runs the row reads from calls
	// whose file names none (a sweep file, which can hold several builds).
	Commit string `toml:"commit"`

	// Peer is a regular expression over the labels of the call's llmd
	// lines, and PeerPhase the phase of them to compare with ("store",
	// "store+sync", "load", "cold load"). Where some of the matching
	// lines say "pair N", a report named "...-N.json" is compared with
	// pair N only (llm-d ran right before it).
	Peer      string `toml:"peer"`
	PeerPhase string `toml:"peer_phase"`
	// Unpaired compares every run with all the matching llmd lines of its
	// call, pairs or not: for runs that had no llm-d run of their own
	// (another variant of a workload llm-d ran in pairs).
	Unpaired bool `toml:"unpaired"`

	// Ceiling is what the ceiling column shows for report rows: "link"
	// (the fraction of the pinned host–GPU copy ceiling), "file" (the
	// plain file transfer of the same run, in GB/s) or "staged" (the
	// fraction of the same files moved plainly through pinned buffers
	// and the GPU).
	Ceiling string `toml:"ceiling"`
	Goal    Goal   `toml:"goal"`
	// Reports are `kvhost bench --json` reports of the row's runs, linked
	// from the table and checked against their lines in the calls.
	Reports []string `toml:"reports"`
	// Conditions is the row's footnote: what ran, beyond what the
	// summary's introduction says for every row.
	Conditions string `toml:"conditions"`
}

// Goal is a row's target; zero fields set none.
type Goal struct {
	Peer  float64 `toml:"peer"`   // at least this many times llm-d's GB/s
	Link  float64 `toml:"link"`   // at least this fraction of the link
	MaxUS float64 `toml:"max_us"` // a p99 below this many µs
}

var reCommit = regexp.MustCompile(`^[0-9a-f]{7,40}$`)

// A callRef is one parsed "FILE#N", or "FILE.json" (N 0).
type callRef struct {
	File string
	N    int
}

func (c callRef) String() string {
	if c.N == 0 {
		return c.File
	}
	return fmt.Sprintf("%s#%d", c.File, c.N)
}

// ParseManifest decodes and checks a manifest; an unknown key, a bad
// regular expression or a row that reads nothing is an error naming the row.
func ParseManifest(text string) (*Manifest, error) {
	var m Manifest
	md, err := toml.Decode(text, &m)
	if err != nil {
		return nil, fmt.Errorf("summary manifest: %w", err)
	}
	if u := md.Undecoded(); len(u) > 0 {
		keys := make([]string, len(u))
		for i, k := range u {
			keys[i] = k.String()
		}
		return nil, fmt.Errorf("summary manifest: unknown keys %s", strings.Join(keys, ", "))
	}
	if strings.TrimSpace(m.Setup) == "" {
		return nil, errors.New("summary manifest: no setup paragraph")
	}
	if len(m.Rows) == 0 {
		return nil, errors.New("summary manifest: no [[row]]")
	}
	if m.ReadmeRows < 0 || m.ReadmeRows > len(m.Rows) {
		return nil, fmt.Errorf("summary manifest: readme_rows = %d, want 0 to %d", m.ReadmeRows, len(m.Rows))
	}
	if m.ReadmeRows > 0 && (m.Machine == "" || strings.TrimSpace(m.Headline) == "") {
		return nil, errors.New("summary manifest: readme_rows needs machine and headline")
	}
	seen := map[string]bool{}
	for i := range m.Rows {
		r := &m.Rows[i]
		if err := r.check(); err != nil {
			return nil, fmt.Errorf("summary manifest: row %d (%q): %w", i+1, r.Name, err)
		}
		if seen[r.Name] {
			return nil, fmt.Errorf("summary manifest: row %d: name %q used twice", i+1, r.Name)
		}
		seen[r.Name] = true
	}
	return &m, nil
}

func (r *Row) kind() string {
	switch {
	case r.Report != "":
		return "report"
	case r.Figure != "":
		return "figure"
	default:
		return "lookups"
	}
}

func (r *Row) check() error {
	if r.Name == "" {
		return errors.New("no name")
	}
	n := 0
	for _, s := range []string{r.Report, r.Figure, r.Lookups} {
		if s != "" {
			n++
		}
	}
	if n != 1 {
		return errors.New("set exactly one of report, figure and lookups")
	}
	if len(r.Calls) == 0 {
		return errors.New("no calls")
	}
	for _, c := range r.Calls {
		ref, err := parseCallRef(c)
		if err != nil {
			return err
		}
		if ref.N == 0 && (r.kind() != "report" || r.Peer != "") {
			return fmt.Errorf("%s: a JSON report has no llm-d figures and no other lines; only a report row without a peer reads one", c)
		}
	}
	if r.KeyMiB < 0 {
		return fmt.Errorf("key_mib = %d", r.KeyMiB)
	}
	for _, re := range []string{r.Report, r.Figure, r.Peer} {
		if _, err := regexp.Compile(re); err != nil {
			return fmt.Errorf("regular expression %q: %w", re, err)
		}
	}
	switch r.kind() {
	case "report":
		if r.Phase != "store" && r.Phase != "load" {
			return fmt.Errorf("phase = %q, want store or load", r.Phase)
		}
		if r.Sums != "" && r.Sums != "on" && r.Sums != "off" {
			return fmt.Errorf("sums = %q, want on, off or nothing", r.Sums)
		}
		if r.Ceiling != "link" && r.Ceiling != "file" && r.Ceiling != "staged" {
			return fmt.Errorf("ceiling = %q, want link, file or staged", r.Ceiling)
		}
	case "lookups":
		if r.Lookups != "alone" && r.Lookups != "beside" {
			return fmt.Errorf("lookups = %q, want alone or beside", r.Lookups)
		}
		if (&LookupLine{}).answer(r.Answer) == nil {
			return fmt.Errorf("answer = %q, want table, python, stand-in or daemon", r.Answer)
		}
		if r.Peer != "" || r.Goal.Peer != 0 || r.Goal.Link != 0 {
			return errors.New("a lookups row has no peer and no link goal")
		}
	}
	if r.kind() != "report" && (r.Phase != "" || r.Sums != "" || r.KeyMiB != 0 || r.Ceiling != "" || len(r.Reports) > 0) {
		return errors.New("phase, sums, key_mib, ceiling and reports are for report rows")
	}
	if r.kind() != "lookups" && r.BackToBack {
		return errors.New("back_to_back is for lookups rows")
	}
	if r.Commit != "" && !reCommit.MatchString(r.Commit) {
		return fmt.Errorf("commit = %q, want 7 to 40 hexadecimal digits", r.Commit)
	}
	if r.kind() != "lookups" && r.Goal.MaxUS != 0 {
		return errors.New("goal.max_us is for lookups rows")
	}
	if (r.Peer == "") != (r.PeerPhase == "") {
		return errors.New("set peer and peer_phase together")
	}
	if r.Goal.Peer != 0 && r.Peer == "" {
		return errors.New("goal.peer needs a peer")
	}
	if r.Goal.Link != 0 && r.Ceiling != "link" {
		return errors.New("goal.link needs ceiling = \"link\"")
	}
	return nil
}

func parseCallRef(s string) (callRef, error) {
	if strings.HasSuffix(s, ".json") && !strings.ContainsAny(s, `#/\`) {
		return callRef{s, 0}, nil
	}
	file, num, ok := strings.Cut(s, "#")
	n, err := strconv.Atoi(num)
	if !ok || file == "" || err != nil || n < 1 || strings.ContainsAny(file, `/\`) {
		return callRef{}, fmt.Errorf("call %q: want FILE#N (a file in docs/bench and a call number) or FILE.json", s)
	}
	return callRef{file, n}, nil
}
