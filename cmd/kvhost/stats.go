package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvhost/kvhost/protocol"
)

// statsReport is what `kvhost stats` shows, and its --json form.
type statsReport struct {
	Socket  string    `json:"socket"`
	Version string    `json:"version"`
	Started time.Time `json:"started,omitzero"`
	Uptime  string    `json:"uptime,omitempty"`
	Policy  struct {
		Name           string `json:"name"`
		Backend        string `json:"backend"`
		Fallback       bool   `json:"fallback"`
		FallbackReason string `json:"fallback_reason,omitempty"`
		FallbackPolicy string `json:"fallback_policy,omitempty"`
	} `json:"policy"`
	Reloads struct {
		OK     uint64 `json:"ok"`
		Failed uint64 `json:"failed"`
		Last   string `json:"last,omitempty"`
	} `json:"reloads"`
	Clients         uint64        `json:"clients"`
	InflightJobs    uint64        `json:"inflight_jobs"`
	Regions         uint64        `json:"regions"`
	RegisteredBytes uint64        `json:"registered_bytes"`
	Entries         uint64        `json:"entries"`
	Keys            uint64        `json:"keys"`
	Counters        statsCounters `json:"counters"`
	Tiering         statsTiering  `json:"tiering"`
	Mounts          []statsMount  `json:"mounts"`
	Devices         []statsDevice `json:"gpu_devices"`
	// Namespaces is what the index holds of each namespace, the most
	// bytes first (null from a daemon that predates the report);
	// NamespacesLeftOut counts the smallest, beyond the reply's bound.
	Namespaces        []statsNamespace `json:"namespaces"`
	NamespacesLeftOut uint64           `json:"namespaces_left_out,omitempty"`
	// Budgets is the use of each byte budget per namespace ([[budget]]),
	// in configuration order: empty without budgets, null from a daemon
	// that predates the report; BudgetsLeftOut counts those beyond the
	// reply's bound.
	Budgets        []statsBudget `json:"budgets"`
	BudgetsLeftOut uint64        `json:"budgets_left_out,omitempty"`
}

// statsBudget is one byte budget: the bytes of the namespaces it covers
// against its budget and floor, and what it did to evictions.
type statsBudget struct {
	Model  string `json:"model"`  // the pattern: a model id, or a prefix of ids ending in "*"
	Used   uint64 `json:"used"`   // the bytes of the indexed files of the namespaces it covers
	Budget uint64 `json:"budget"` // 0: none, only a floor
	Floor  uint64 `json:"floor"`  // 0: none
	// OverEvictions counts the files evictions took first because the
	// namespaces held more than the budget; FloorSkips, the eviction
	// victims skipped because taking them would cross the floor.
	OverEvictions uint64 `json:"over_evictions"`
	FloorSkips    uint64 `json:"floor_skips"`
}

// statsNamespace is one namespace: a model at one geometry (the vLLM
// tier's vllm:<model>:<digest>).
type statsNamespace struct {
	Fingerprint string `json:"fingerprint"` // 16 hex digits, as in the files' headers
	// Model is the id the namespace was declared with; empty for files
	// found on the mounts whose namespace no client declared since the
	// daemon started.
	Model    string `json:"model"`
	Declared bool   `json:"declared"`
	Files    uint64 `json:"files"`
	Keys     uint64 `json:"keys"`
	Bytes    uint64 `json:"bytes"`
	// Caches counts the caches registered in the namespace now, on all
	// connections: a vLLM engine's workers (0 from a daemon that predates
	// the count).
	Caches uint32 `json:"caches"`
}

type statsCounters struct {
	StoredKeys   uint64 `json:"stored_keys"`
	LoadedKeys   uint64 `json:"loaded_keys"`
	Hits         uint64 `json:"hits"`
	Misses       uint64 `json:"misses"`
	Evictions    uint64 `json:"evictions"`
	ReusedFiles  uint64 `json:"reused_files"`
	SparesMade   uint64 `json:"spare_files_made"`
	Failures     uint64 `json:"failures"`
	Corrupt      uint64 `json:"corrupt"`
	Vanished     uint64 `json:"vanished"`
	BytesWritten uint64 `json:"bytes_written"`
	BytesRead    uint64 `json:"bytes_read"`
}

// statsTiering counts the files moved between mounts (zero from a daemon
// that predates the reply's tiering section).
type statsTiering struct {
	Demotions       uint64 `json:"demotions"`
	Promotions      uint64 `json:"promotions"`
	TickMoves       uint64 `json:"tick_moves"`
	MoveFailures    uint64 `json:"move_failures"`
	DemotionDeletes uint64 `json:"demotion_deletes"`
}

type statsMount struct {
	Path       string `json:"path"`
	Backend    string `json:"backend"`
	IO         string `json:"io"`
	Checksums  bool   `json:"checksums"`
	Capacity   uint64 `json:"capacity"`
	Configured uint64 `json:"configured"`
	Used       uint64 `json:"used"`
	Entries    uint64 `json:"entries"`
	SpareFiles uint64 `json:"spare_files"`
	SpareBytes uint64 `json:"spare_bytes"`
	MovedIn    uint64 `json:"moved_in_files"`
	MovedOut   uint64 `json:"moved_out_files"`
	// Class is the mount's device class, configured or detected
	// ("memory", "nvme", ...; empty from a daemon that predates it).
	Class string `json:"class"`
	// StoresFailing says that the mount refuses stores (null while its
	// stores succeed, and from a daemon that predates the report).
	StoresFailing *statsFailing `json:"stores_failing"`
}

// statsFailing is a mount's refusal of stores: its most recent stores
// failed for a reason of its own (read-only, I/O errors, no room) and
// none succeeded since.
type statsFailing struct {
	Since  time.Time `json:"since"`  // the first of those failures, or the start that found the mount refusing
	Last   time.Time `json:"last"`   // the latest
	Stores uint64    `json:"stores"` // files whose store failed so since the last that succeeded
	Err    string    `json:"error"`  // the latest failure
}

// text says what the refusal means to an operator.
func (f *statsFailing) text(path string) string {
	return fmt.Sprintf("mount %s refuses stores since %s (%d failed since the last that succeeded): %s",
		path, f.Since.Format(time.RFC3339), f.Stores, f.Err)
}

type statsDevice struct {
	Ordinal    uint32 `json:"ordinal"`
	Regions    uint64 `json:"regions"`
	Registered uint64 `json:"registered_bytes"`
	Limit      uint64 `json:"limit_bytes"`
	UUID       string `json:"uuid,omitempty"` // GPU-<uuid>, as nvidia-smi prints it; empty when unknown
	// Faults counts the jobs and registrations that failed with a sticky
	// CUDA error: the daemon's context on the device is broken until it
	// restarts.
	Faults uint64 `json:"faults"`
}

// queryStats connects to the daemon (Hello) and asks for its Stats.
func queryStats(ctx context.Context, socket string) (statsReport, error) {
	// The lists are empty, not null, in --json where there is nothing to
	// list (no GPU).
	r := statsReport{Mounts: []statsMount{}, Devices: []statsDevice{}}
	c, err := dialDaemon(ctx, socket, "kvhost stats")
	if err != nil {
		return r, err
	}
	defer c.Close()
	st, err := c.Stats(ctx)
	if err != nil {
		return r, err
	}
	r.Socket, r.Version = socket, c.Limits().Server
	r.Clients, r.Entries, r.Keys = st.Clients, st.Entries, st.Keys
	r.Counters = statsCounters{StoredKeys: st.Stores, LoadedKeys: st.Loads, Hits: st.Hits, Misses: st.Misses, Evictions: st.Evictions,
		Failures: st.Failures, Corrupt: st.Corrupt, Vanished: st.Vanished, BytesWritten: st.BytesWritten, BytesRead: st.BytesRead}
	for i, m := range st.Mounts {
		sm := statsMount{Capacity: m.Capacity, Used: m.Used, Entries: m.Entries, IO: "buffered"}
		if m.Direct {
			sm.IO = "direct"
		}
		if d := st.Daemon; d != nil && i < len(d.Mounts) {
			mi := d.Mounts[i]
			sm.Path, sm.Backend, sm.IO, sm.Checksums, sm.Configured = mi.Path, mi.Backend, mi.IO, mi.Checksums, mi.Configured
			sm.Class = mi.Class
		}
		if sp := st.Spares; sp != nil && i < len(sp.Mounts) {
			sm.SpareFiles, sm.SpareBytes = sp.Mounts[i].Files, sp.Mounts[i].Bytes
		}
		if ts := st.Tiering; ts != nil && i < len(ts.Mounts) {
			sm.MovedIn, sm.MovedOut = ts.Mounts[i].MovedIn, ts.Mounts[i].MovedOut
		}
		if i < len(st.StoresFailing) && st.StoresFailing[i].Since != 0 {
			f := st.StoresFailing[i]
			sm.StoresFailing = &statsFailing{Since: time.Unix(0, f.Since).UTC(), Last: time.Unix(0, f.Last).UTC(), Stores: f.Stores, Err: f.Err}
		}
		r.Mounts = append(r.Mounts, sm)
	}
	if st.Spares != nil {
		r.Counters.ReusedFiles, r.Counters.SparesMade = st.Spares.Reused, st.Spares.Made
	}
	if ts := st.Tiering; ts != nil {
		r.Tiering = statsTiering{Demotions: ts.Demotions, Promotions: ts.Promotions, TickMoves: ts.Moves,
			MoveFailures: ts.MoveFailures, DemotionDeletes: ts.DemotionDeletes}
		r.Policy.FallbackPolicy = ts.FallbackPolicy
	}
	if nl := st.Namespaces; nl != nil {
		r.Namespaces, r.NamespacesLeftOut = []statsNamespace{}, nl.LeftOut
		for _, ns := range nl.List {
			r.Namespaces = append(r.Namespaces, statsNamespace{Fingerprint: fmt.Sprintf("%016x", ns.Fingerprint), Model: ns.Model,
				Declared: ns.Declared, Files: ns.Files, Keys: ns.Keys, Bytes: ns.Bytes, Caches: ns.Caches})
		}
	}
	r.Budgets, r.BudgetsLeftOut = reportBudgets(st.Daemon)
	for _, d := range st.Devices {
		r.Devices = append(r.Devices, statsDevice{Ordinal: d.Ordinal, Regions: d.Regions, Registered: d.Registered, Limit: d.Limit, UUID: gpuUUID(d.UUID), Faults: d.Faults})
	}
	if d := st.Daemon; d != nil {
		r.Started = time.Unix(0, d.Started).UTC()
		r.Uptime = time.Since(r.Started).Round(time.Second).String()
		r.Policy.Name, r.Policy.Backend, r.Policy.Fallback, r.Policy.FallbackReason = d.Policy, d.PolicyBackend, d.Fallback, d.FallbackReason
		r.Reloads.OK, r.Reloads.Failed, r.Reloads.Last = d.Reloads, d.ReloadFailures, d.LastReload
		r.InflightJobs, r.Regions, r.RegisteredBytes = d.InflightJobs, d.Regions, d.RegisteredBytes
	} else {
		r.InflightJobs = st.InflightJobs
	}
	return r, nil
}

// reportBudgets is the budgets of the report from the daemon section d:
// nil where the daemon predates them (or the section), empty where it
// has none.
func reportBudgets(d *protocol.DaemonStats) ([]statsBudget, uint64) {
	if d == nil || d.Budgets == nil {
		return nil, 0
	}
	out := make([]statsBudget, 0, len(d.Budgets))
	for _, b := range d.Budgets {
		out = append(out, statsBudget{Model: b.Model, Used: b.Used, Budget: b.Budget, Floor: b.Floor, OverEvictions: b.Over, FloorSkips: b.Kept})
	}
	return out, d.BudgetsLeftOut
}

// runStats implements `kvhost stats [--socket S] [--json]`.
func runStats(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("kvhost stats", "usage: kvhost stats [--socket PATH | --config FILE] [--json]\n\nShows a running daemon's state.", stderr)
	df := bindDaemonFlags(fs, 10*time.Second, "give up after this long")
	asJSON := fs.Bool("json", false, "print JSON")
	if code, ok := df.parse(fs, args, stdout, stderr); !ok {
		return code
	}
	r, err := df.stats(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "kvhost stats: %s: %v\n", *df.socket, df.explain(err))
		return 1
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(r); err != nil {
			fmt.Fprintf(stderr, "kvhost stats: %v\n", err)
			return 1
		}
		return 0
	}
	printStats(stdout, r)
	return 0
}

func printStats(w io.Writer, r statsReport) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "daemon\t%s\n", r.Version)
	fmt.Fprintf(tw, "socket\t%s\n", r.Socket)
	if r.Uptime != "" {
		fmt.Fprintf(tw, "uptime\t%s (since %s)\n", r.Uptime, r.Started.Format(time.RFC3339))
	}
	pol := r.Policy.Name + " (" + r.Policy.Backend + ")"
	if r.Policy.Fallback {
		pol += ", FELL BACK to its native fallback"
		if r.Policy.FallbackPolicy != "" {
			pol += " " + r.Policy.FallbackPolicy
		}
		pol += ": " + r.Policy.FallbackReason
	}
	fmt.Fprintf(tw, "policy\t%s\n", pol)
	rl := fmt.Sprintf("%d ok, %d failed", r.Reloads.OK, r.Reloads.Failed)
	if r.Reloads.Last != "" {
		rl += "; last: " + r.Reloads.Last
	}
	fmt.Fprintf(tw, "reloads\t%s\n", rl)
	fmt.Fprintf(tw, "clients\t%d (this command's connection included)\n", r.Clients)
	fmt.Fprintf(tw, "jobs in flight\t%d\n", r.InflightJobs)
	fmt.Fprintf(tw, "registered\t%d regions, %s\n", r.Regions, bytesString(r.RegisteredBytes))
	fmt.Fprintf(tw, "index\t%d files, %d keys\n", r.Entries, r.Keys)
	c := r.Counters
	fmt.Fprintf(tw, "keys\t%d stored, %d loaded, %d hits, %d misses, %d failed\n", c.StoredKeys, c.LoadedKeys, c.Hits, c.Misses, c.Failures)
	fmt.Fprintf(tw, "files\t%d evicted, %d reused, %d made ahead, %d corrupt, %d vanished\n", c.Evictions, c.ReusedFiles, c.SparesMade, c.Corrupt, c.Vanished)
	fmt.Fprintf(tw, "bytes\t%s written, %s read\n", bytesString(c.BytesWritten), bytesString(c.BytesRead))
	ti := r.Tiering
	fmt.Fprintf(tw, "tiers\t%d demoted, %d promoted, %d moved by ticks, %d moves failed, %d deleted (demotion target full)\n",
		ti.Demotions, ti.Promotions, ti.TickMoves, ti.MoveFailures, ti.DemotionDeletes)
	tw.Flush()
	fmt.Fprintln(w, "\nmounts:")
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	// capacity: the effective limit (the configured one, or less where
	// the free space minus the reserve, plus kvhost's own files, is
	// less), as kvhost check names it beside the configured one.
	fmt.Fprintln(tw, "  path\tbackend\tio\tchecksums\tused\tcapacity\tconfigured\tuse%\tfiles\tspares\tmoved in/out\tclass")
	for _, m := range r.Mounts {
		pct := 0.0
		if m.Capacity > 0 {
			pct = 100 * float64(m.Used) / float64(m.Capacity)
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%v\t%s\t%s\t%s\t%.1f%%\t%d\t%d (%s)\t%d/%d\t%s\n", m.Path, m.Backend, m.IO, m.Checksums, bytesString(m.Used), bytesString(m.Capacity), bytesString(m.Configured), pct, m.Entries, m.SpareFiles, bytesString(m.SpareBytes), m.MovedIn, m.MovedOut, m.Class)
	}
	tw.Flush()
	if slices.ContainsFunc(r.Mounts, func(m statsMount) bool { return m.Capacity < m.Configured }) {
		fmt.Fprintln(w, "  (capacity below configured: the free space minus the reserve, plus kvhost's own files, is less)")
	}
	for _, m := range r.Mounts {
		if f := m.StoresFailing; f != nil {
			fmt.Fprintf(w, "  STORES FAILING: %s\n", f.text(m.Path))
		}
	}
	if len(r.Namespaces) > 0 {
		fmt.Fprintln(w, "\nnamespaces:")
		tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		// The model id, free text whose display width tabwriter cannot
		// tell (it counts runes: a CJK id is two columns a rune), goes
		// last, where no column after it can be pushed off.
		fmt.Fprintln(tw, "  fingerprint\tkeys\tfiles\tbytes\tcaches\tmodel")
		for _, ns := range r.Namespaces {
			model := ns.Model
			switch {
			case model == "":
				model = "(found on the mounts; no client declared it since start)"
			case !ns.Declared:
				model += " (no client declares it now)"
			}
			fmt.Fprintf(tw, "  %s\t%d\t%d\t%s\t%d\t%s\n", ns.Fingerprint, ns.Keys, ns.Files, bytesString(ns.Bytes), ns.Caches, model)
		}
		tw.Flush()
		if r.NamespacesLeftOut > 0 {
			fmt.Fprintf(w, "  and %d more, each holding less\n", r.NamespacesLeftOut)
		}
	}
	printBudgets(w, r)
	if len(r.Devices) > 0 {
		fmt.Fprintln(w, "\nGPU registrations:")
		for _, d := range r.Devices {
			name := ""
			if d.UUID != "" {
				name = " (" + d.UUID + ")"
			}
			fmt.Fprintf(w, "  device %d%s: %d regions, %s of %s\n", d.Ordinal, name, d.Regions, bytesString(d.Registered), bytesString(d.Limit))
			if d.Faults > 0 {
				fmt.Fprintf(w, "    %s\n", d.faultText())
			}
		}
	}
}

// printBudgets writes the budgets section of `kvhost stats`: nothing
// where the daemon has no byte budgets.
func printBudgets(w io.Writer, r statsReport) {
	if len(r.Budgets) == 0 {
		return
	}
	fmt.Fprintln(w, "\nbudgets:")
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	// The pattern, free text as the namespaces' model ids are, goes last.
	fmt.Fprintln(tw, "  used\tbudget\tuse%\tfloor\tevicted over budget\tkept by floor\tmodel")
	for _, b := range r.Budgets {
		budget, pct := "none", "-"
		if b.Budget > 0 {
			budget, pct = bytesString(b.Budget), fmt.Sprintf("%.1f%%", 100*float64(b.Used)/float64(b.Budget))
		}
		floor := "none"
		if b.Floor > 0 {
			floor = bytesString(b.Floor)
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%d\t%d\t%s\n", bytesString(b.Used), budget, pct, floor, b.OverEvictions, b.FloorSkips, b.Model)
	}
	tw.Flush()
	if r.BudgetsLeftOut > 0 {
		fmt.Fprintf(w, "  and %d more (kvhost_budget_* metrics list every one)\n", r.BudgetsLeftOut)
	}
}

// faultText says what the device's faults mean to an operator.
func (d statsDevice) faultText() string {
	return fmt.Sprintf("%d device faults on GPU %d (jobs or registrations that failed with a sticky CUDA error, or cuFile batches whose I/O did not come back): restart the daemon (or reset the GPU)", d.Faults, d.Ordinal)
}

// gpuUUID writes a GPU's UUID as nvidia-smi does (GPU-xxxxxxxx-xxxx-xxxx-
// xxxx-xxxxxxxxxxxx); "" for the zero UUID (unknown).
func gpuUUID(u [16]byte) string {
	if u == ([16]byte{}) {
		return ""
	}
	return fmt.Sprintf("GPU-%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}

// bytesString writes n in binary units ("1.5GiB").
func bytesString(n uint64) string {
	const units = "KMGTPE"
	if n < 1024 {
		return fmt.Sprintf("%dB", n)
	}
	v, i := float64(n)/1024, 0
	for v >= 1024 && i < len(units)-1 {
		v /= 1024
		i++
	}
	return strings.TrimSuffix(strings.TrimSuffix(fmt.Sprintf("%.1f", v), "0"), ".") + string(units[i]) + "iB"
}
