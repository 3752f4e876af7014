package bench

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

// Schema is the value of Report.Schema; it changes only if a field changes
// meaning or goes away (new fields keep it). Version 2: file ceilings are
// timed in every round and summed (ceiling_passes per round), where
// version 1 took the best of ceiling_passes passes once per run.
const Schema = "kvhost-bench/2"

// SchemaV1 is the previous schema: its reports still read (and render),
// but a version 2 run is never appended to one.
const SchemaV1 = "kvhost-bench/1"

// Directions of a Run.
const (
	Store = "store"
	Load  = "load"
)

// Names of the pinned copy ceilings begin with these: one copy between
// pinned host memory and the GPU, host to device (the link loads cross)
// and device to host (the link stores cross).
const (
	CeilingH2D = "pinned H2D"
	CeilingD2H = "pinned D2H"
)

// Report is the whole result of one `kvhost bench` invocation, as written
// by --json (docs/bench.md documents every field).
type Report struct {
	Schema  string   `json:"schema"`  // Schema, or SchemaV1 in an older report
	Version string   `json:"version"` // kvhost's version
	Command []string `json:"command"` // the arguments it ran with
	// MoreCommands are the invocations whose runs were appended (--append).
	MoreCommands [][]string `json:"more_commands,omitempty"`
	Started      time.Time  `json:"started"`  // wall-clock start
	Host         string     `json:"host"`     // host name
	Dir          string     `json:"dir"`      // the benchmarked directory
	FSType       string     `json:"fs_type"`  // its file system ("ext4", "tmpfs")
	Memory       string     `json:"memory"`   // "gpu" or "host": where the paged cache lives
	Device       string     `json:"device"`   // the GPU (PCI id and name), "" for host memory
	Model        Geometry   `json:"geometry"` // the geometry, without TokensPerKey (per run)
	Fsync        bool       `json:"fsync"`    // stores were durable (engine fsync)
	Cold         bool       `json:"cold"`     // caches dropped before every read
	// CeilingPasses is how many times each file ceiling was measured per
	// round (between the round's store and its load); a run's ceiling is
	// the bytes over the time of every pass of its rounds.
	CeilingPasses int `json:"ceiling_passes"`
	// Ceilings that do not depend on the key size or thread count: the
	// pinned host ↔ GPU copies, when a GPU is present.
	Ceilings []Ceiling `json:"ceilings"`
	// Runs are the measured phases, in the order they ran.
	Runs []Run `json:"runs"`
	// Partial says the benchmark was interrupted: Runs holds the phases
	// that finished.
	Partial bool `json:"partial,omitempty"`
	// Seconds is the wall time of the whole benchmark.
	Seconds float64 `json:"seconds"`
}

// Geometry is the model shape of the benchmark's keys.
type Geometry struct {
	Layers         int `json:"layers"`           // model layers
	KVHeads        int `json:"kv_heads"`         // KV heads (the benchmark runs at TP size 1)
	HeadSize       int `json:"head_size"`        // elements per head
	DtypeSize      int `json:"dtype_size"`       // bytes per element
	TokensPerBlock int `json:"tokens_per_block"` // tokens in one GPU (paged) block
}

// Ceiling is a bound measured in the same run.
type Ceiling struct {
	// Name says what was measured ("pread O_DIRECT", "pinned H2D").
	Name string  `json:"name"`
	GBps float64 `json:"gbps"` // 1e9 bytes per second
	// Threads is the thread count it ran with (0 for a single copy).
	Threads int `json:"threads,omitempty"`
	// CPUMsPerGB is the CPU time it took, in milliseconds per GB (file
	// ceilings only).
	CPUMsPerGB float64 `json:"cpu_ms_per_gb,omitempty"`
}

// Run is one timed phase: the engine storing or loading Keys keys with
// Jobs concurrent jobs through one path.
type Run struct {
	Path      string `json:"path"`      // requested: auto, cufile, staging, posix
	Mover     string `json:"mover"`     // what moved the bytes: cufile, gpu-staging, staging
	IO        string `json:"io"`        // the mount's I/O mode: direct or buffered
	Checksums bool   `json:"checksums"` // payload checksums asked for (the mount's setting)
	// Checksummed says the files were written with payload checksums (and
	// loads verified them): false where the mover never lets the CPU see
	// the bytes (cuFile), whatever Checksums asked.
	Checksummed bool `json:"checksummed"`
	// ChecksumOn says where the checksums were computed: "cpu", or "gpu"
	// for the staging pipeline's checksum kernel (gpu.checksum_on);
	// empty where the files carry none.
	ChecksumOn string `json:"checksum_on,omitempty"`
	Direction  string `json:"direction"` // store or load
	Jobs       int    `json:"jobs"`      // concurrent jobs
	// TokensPerKey and KeyBytes size one key (one file unless KeysPerFile
	// packs several).
	TokensPerKey int   `json:"tokens_per_key"`
	KeyBytes     int64 `json:"key_bytes"`    // payload bytes of one key
	KeysPerJob   int   `json:"keys_per_job"` // keys each job stores or loads
	// KeysPerFile is how many keys of a job share one file: the policy's
	// keys_per_file, at most KeysPerJob (a file never holds two jobs'
	// keys); 0 in reports that predate it, which means 1.
	KeysPerFile int   `json:"keys_per_file,omitempty"`
	Keys        int   `json:"keys"`   // keys asked for
	Hits        int   `json:"hits"`   // keys stored or loaded
	Misses      int   `json:"misses"` // loads of keys never stored
	Bytes       int64 `json:"bytes"`  // payload bytes moved (hits × KeyBytes)
	// Seconds is the phase's wall time, first submission to last completion.
	Seconds float64 `json:"seconds"`
	GBps    float64 `json:"gbps"` // Bytes / Seconds / 1e9
	// Ceiling is the same operation done plainly on the same files with
	// the same number of threads; Fraction is GBps / Ceiling.GBps.
	Ceiling  Ceiling `json:"ceiling"`
	Fraction float64 `json:"fraction"` // GBps / Ceiling.GBps; 0 without a ceiling
	// RoundFractions is each round's GB/s over the same round's ceiling,
	// in round order, where there were two rounds or more: how much the
	// fraction moved from round to round. Fraction is over their sums, so
	// where every round moves the same bytes (not with --full, whose
	// ceiling writes more files as the cache fills) it lies between their
	// least and greatest.
	RoundFractions []float64 `json:"round_fractions,omitempty"`
	// RoundGBps is each round's GB/s, in round order, where there were two
	// rounds or more: GBps is over their summed bytes and time, so where
	// every round moves the same bytes it lies between their least and
	// greatest.
	RoundGBps []float64 `json:"round_gbps,omitempty"`
	// CeilingBest is the best ceiling of the same operation, key size and
	// I/O mode over every thread count of the report (issue 8's "best
	// thread count"), and FractionBest is GBps over it. The engine may
	// spread one job over several I/O threads, so Fraction can exceed 1
	// at low job counts; FractionBest says how close the engine came to
	// what the storage can do at all.
	CeilingBest  Ceiling `json:"ceiling_best"`
	FractionBest float64 `json:"fraction_best"` // GBps / CeilingBest.GBps
	// FractionLink is GBps over the pinned copy ceiling of the phase's
	// direction (CeilingH2D for loads, CeilingD2H for stores), for GPU
	// memory: the share of the host–GPU link the phase used. Every byte
	// crosses the link once, whatever the path, so no path passes it,
	// while a path that does not copy with the CPU may pass a file
	// ceiling (which the CPU copies). 0 without a GPU.
	FractionLink float64 `json:"fraction_link,omitempty"`
	// CeilingLink is that pinned copy ceiling, as measured by the run's
	// own invocation: a run appended from another invocation (--append)
	// keeps its own. Zero without a GPU.
	CeilingLink Ceiling `json:"ceiling_link,omitzero"`
	// CeilingReread is, for a load, the plain read of the ceiling's files
	// a second time, right after the first: on a memory file system the
	// first read of freshly written pages costs the kernel more than a
	// later one, and a path that does not read through the page cache
	// (registered files) pays neither, so the first read is no bound for
	// it. FractionReread is GBps over it. Zero for stores.
	CeilingReread  Ceiling `json:"ceiling_reread,omitzero"`
	FractionReread float64 `json:"fraction_reread,omitempty"` // GBps / CeilingReread.GBps; zero for stores
	// CeilingStaged is, for GPU memory, the same files moved plainly
	// through pinned buffers with as many threads as jobs (StagedRead for
	// a load, StagedWrite for a store): each thread reads a chunk (the
	// staging pipeline's chunk size, in its system calls) into a pinned
	// buffer and copies it to the GPU while it reads the next, or copies
	// from the GPU and writes. It is a path through pinned host memory
	// without the engine's work (no checksums, no scatter or gather, no
	// engine): the CPU's copy and the GPU's share the host's memory as on
	// the engine's pinned path, which the plain read and write ceilings
	// leave out. A path that copies straight between the GPU and
	// registered file pages moves each byte through host memory once and
	// may pass it. FractionStaged is GBps over it. Zero for host memory.
	CeilingStaged  Ceiling `json:"ceiling_staged,omitzero"`
	FractionStaged float64 `json:"fraction_staged,omitempty"` // GBps / CeilingStaged.GBps; zero for host memory
	// ReadFirst is, for a load with --read-first, a plain read of the
	// load's own files (pread, as many threads as jobs), timed right
	// before each round's load and summed over the rounds: what a read
	// with the CPU costs on those very pages in the state the store and
	// the scenario left them (another engine's spares, files found after
	// a restart), which the ceilings' files, written by the ceiling
	// itself, need not share. It is a diagnostic, not a ceiling held
	// against: the load that follows finds its pages read once, and the
	// GPU path had that much longer to register files. Zero without it.
	ReadFirst Ceiling `json:"read_first,omitzero"`
	// JobP50Ms and JobP99Ms are percentiles of the jobs' completion times.
	JobP50Ms float64 `json:"job_p50_ms"`
	JobP99Ms float64 `json:"job_p99_ms"` // 99th percentile, in milliseconds
	// VerifiedBytes is how many loaded bytes were compared with what was
	// stored (every byte of every hit when verification is on); a miss's
	// destination blocks are checked to be untouched too.
	VerifiedBytes int64 `json:"verified_bytes"`
	// ReusedFiles is how many files a store phase wrote into spare files
	// instead of fresh ones (evicted files in a full cache, and files made
	// ahead, on a memory file system), per round.
	ReusedFiles int `json:"reused_files,omitempty"`
	// Preallocate is the most bytes of spare files the engine made ahead
	// of stores when the phases ended (mount.preallocate, auto resolved and
	// grown after larger bursts, such as the warm-up's); with it the benchmark let the engine
	// make them, and the GPU path register them, before each timed phase
	// and ceiling.
	Preallocate int64 `json:"preallocate,omitempty"`
	// LoadReaders and LoadBuffered are the disk mount's load readers when
	// a load phase's last round ended (how many files its loads read at
	// once, and whether through the page cache: package iotune), and
	// LoadReadersChanged how many times tuning had moved them by then; 0
	// on a memory mount, and for a load by a second engine (--foreign).
	LoadReaders        int    `json:"load_readers,omitempty"`
	LoadBuffered       bool   `json:"load_buffered,omitempty"`
	LoadReadersChanged uint64 `json:"load_reader_changes,omitempty"`
	// NoGap says a load phase began right after its round's store, with
	// no idle moment for the GPU path to register the new files (the
	// round's ceilings were measured after the load).
	NoGap bool `json:"no_gap,omitempty"`
	// Restart says a load phase ran in a new engine, with new GPU paths,
	// opened on the directory after its round's store (--restart): it
	// found the files at open, as a restarted daemon does. With NoGap the
	// load began as soon as the engine was open; without, once the files
	// found had been offered to the GPU path and its registrar had taken
	// them.
	Restart bool `json:"restart,omitempty"`
	// Foreign says a load phase ran through a second engine, with GPU
	// paths of its own and another node's id, opened on the directory
	// before its round's store (--foreign): it found the files on the
	// load, as a daemon loads another process's or node's files right
	// after its lookup.
	Foreign bool `json:"foreign,omitempty"`
	// FilesDiscovered is how many files that second engine found on its
	// load, per round (Foreign).
	FilesDiscovered int `json:"files_discovered,omitempty"`
	// FilesAtRestart is how many files the reopened engine indexed at
	// open, per round (Restart).
	FilesAtRestart int `json:"files_at_restart,omitempty"`
	// RegisteredAtRestart is how many of those files the new GPU path's
	// registrar, offered them ahead of any job, had registered when the
	// load began, per round (with NoGap, those it registered in the
	// moment the engine took to open).
	RegisteredAtRestart int `json:"registered_at_restart,omitempty"`
	// RestartWarmMs is how long, per round, the reopened engine and its
	// registrar took, once open, to offer and register the files found
	// (Restart without NoGap): the idle moment a restarted daemon needs
	// before its loads copy straight out of the files' pages. The load's
	// time does not include it.
	RestartWarmMs float64 `json:"restart_warm_ms,omitempty"`
	// DirectFiles is how many of a phase's files, per round, moved
	// straight between GPU memory and the file's registered pages
	// (gpu.register_files) instead of through the pinned buffers.
	DirectFiles int `json:"direct_files,omitempty"`
	// RegistrationWaits is how many times per round the registrar of
	// registered files put a registration off during the phase, waiting
	// for stores into memory-mount files that moved through the pinned
	// buffers (kvhost_gpu_file_registration_waits_total).
	RegistrationWaits int `json:"registration_waits,omitempty"`
	// CPUMsPerGB is the process's CPU time (user and system, every
	// thread) during the phase, in milliseconds per GB moved: what the
	// data path costs the host, less noisy than throughput on a shared
	// machine. The ceiling's is in Ceiling.CPUMsPerGB.
	CPUMsPerGB float64 `json:"cpu_ms_per_gb,omitempty"`
}

// Finish fills every run's CeilingBest and FractionBest from the runs of
// the report: the best ceiling of the same direction, key size and ceiling
// kind, over every thread count measured.
func (r *Report) Finish() {
	type key struct {
		dir, name string
		keyBytes  int64
	}
	best := map[key]Ceiling{}
	for _, x := range r.Runs {
		k := key{x.Direction, x.Ceiling.Name, x.KeyBytes}
		if x.Ceiling.GBps > best[k].GBps {
			best[k] = x.Ceiling
		}
	}
	for i := range r.Runs {
		x := &r.Runs[i]
		x.CeilingBest = best[key{x.Direction, x.Ceiling.Name, x.KeyBytes}]
		x.FractionBest = 0
		if x.CeilingBest.GBps > 0 {
			x.FractionBest = x.GBps / x.CeilingBest.GBps
		}
		if x.CeilingLink.GBps <= 0 {
			x.CeilingLink = r.link(x.Direction)
		}
		x.FractionLink = 0
		if x.CeilingLink.GBps > 0 {
			x.FractionLink = x.GBps / x.CeilingLink.GBps
		}
	}
}

// link is the pinned copy ceiling that a phase of direction dir crosses
// (zero where the report has none: host memory).
func (r *Report) link(dir string) Ceiling {
	prefix := CeilingD2H
	if dir == Load {
		prefix = CeilingH2D
	}
	for _, c := range r.Ceilings {
		if strings.HasPrefix(c.Name, prefix) {
			return c
		}
	}
	return Ceiling{}
}

// GBps is bytes per duration in 1e9 bytes per second.
func GBps(bytes int64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(bytes) / d.Seconds() / 1e9
}

// Append adds the runs and ceilings of a later invocation on the same
// directory and memory to r. Each run keeps the pinned copy ceilings of its
// own invocation (Run.CeilingLink); r.Ceilings lists the first of each
// name.
func (r *Report) Append(later *Report) error {
	if later.Schema != r.Schema {
		return fmt.Errorf("bench: append: a %s report onto a %s one (their ceilings were taken differently)", later.Schema, r.Schema)
	}
	if later.Dir != r.Dir || later.Memory != r.Memory {
		return fmt.Errorf("bench: append: report of %s (%s memory) onto one of %s (%s memory)", later.Dir, later.Memory, r.Dir, r.Memory)
	}
	later.Finish() // its runs take its own link before they join r's
	r.MoreCommands = append(r.MoreCommands, later.Command)
	r.Runs = append(r.Runs, later.Runs...)
	for _, c := range later.Ceilings {
		if !slices.ContainsFunc(r.Ceilings, func(x Ceiling) bool { return x.Name == c.Name }) {
			r.Ceilings = append(r.Ceilings, c)
		}
	}
	r.Seconds += later.Seconds
	r.Finish()
	return nil
}

// WriteJSON writes r as indented JSON.
func (r *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// ReadJSON decodes a report written by WriteJSON and checks its schema.
func ReadJSON(rd io.Reader) (*Report, error) {
	var r Report
	if err := json.NewDecoder(rd).Decode(&r); err != nil {
		return nil, fmt.Errorf("bench: report: %w", err)
	}
	if r.Schema != Schema && r.Schema != SchemaV1 {
		return nil, fmt.Errorf("bench: report schema %q, want %q", r.Schema, Schema)
	}
	return &r, nil
}

// roundSpread writes the least, median and greatest of fs as "0.82 0.88
// 0.94\t", the table's last column; "" where the table has no such column
// (column false), "\t" for fewer than two rounds.
func roundSpread(fs []float64, column bool) string {
	if !column {
		return ""
	}
	if len(fs) < 2 {
		return "\t"
	}
	s := slices.Clone(fs)
	slices.Sort(s)
	med := s[len(s)/2]
	if len(s)%2 == 0 {
		med = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return fmt.Sprintf("%.2f %.2f %.2f\t", s[0], med, s[len(s)-1])
}

// keysPerFile is the runs' keys per file where they all share one (0
// where they differ or there are none).
func (r *Report) keysPerFile() int {
	k := 0
	for i, x := range r.Runs {
		if i > 0 && max(x.KeysPerFile, 1) != k {
			return 0
		}
		k = max(x.KeysPerFile, 1)
	}
	return k
}

// WriteTable writes the runs as an aligned text table, each figure next to
// its ceiling and the fraction reached, then the global ceilings.
func (r *Report) WriteTable(w io.Writer) error {
	fmt.Fprintf(w, "kvhost bench: %s (%s), %s memory", r.Dir, r.FSType, r.Memory)
	if r.Device != "" {
		fmt.Fprintf(w, " on %s", r.Device)
	}
	g := r.Model
	fmt.Fprintf(w, "; %d layers, %d KV heads, head %d, %d-byte elements, %d-token blocks", g.Layers, g.KVHeads, g.HeadSize, g.DtypeSize, g.TokensPerBlock)
	if k := r.keysPerFile(); k > 1 {
		fmt.Fprintf(w, "; %d keys per file", k)
	}
	if r.Fsync {
		fmt.Fprint(w, "; durable stores (fsync)")
	}
	if r.Cold {
		fmt.Fprint(w, "; caches dropped before reads")
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	footnote, spread, link, reread, staged := false, false, false, false, false
	for _, x := range r.Runs {
		spread = spread || len(x.RoundFractions) > 1
		link = link || x.FractionLink > 0
		reread = reread || x.CeilingReread.GBps > 0
		staged = staged || x.CeilingStaged.GBps > 0
	}
	header := "path\tmover\tio\tsums\tkey\tjobs\tdir\tkeys\tGB/s\tceiling GB/s\tfraction\tof best\t"
	if reread {
		header += "of reread\t"
	}
	if staged {
		header += "of staged\t"
	}
	if link {
		header += "of link\t"
	}
	header += "p50 ms\tp99 ms\tCPU ms/GB\tceiling's\tverified\tceiling is\t"
	if spread {
		header += "by round\t"
	}
	fmt.Fprintln(tw, header)
	for _, x := range r.Runs {
		sums := "off"
		switch {
		case x.Checksums && x.Checksummed:
			sums = "on"
		case x.Checksums:
			sums = "on*"
			footnote = true
		}
		ofLink := column(reread, x.CeilingReread, x.FractionReread) + column(staged, x.CeilingStaged, x.FractionStaged)
		if link {
			ofLink += fmt.Sprintf("%.2f\t", x.FractionLink)
		}
		dir := x.Direction
		switch {
		case x.Restart:
			dir += " (restart)"
		case x.Foreign:
			dir += " (foreign)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%s\t%d/%d\t%.2f\t%.2f\t%.2f\t%.2f\t%s%.1f\t%.1f\t%.0f\t%.0f\t%s\t%s\t%s\n",
			x.Path, x.Mover, x.IO, sums, sizeString(x.KeyBytes), x.Jobs, dir, x.Hits, x.Keys,
			x.GBps, x.Ceiling.GBps, x.Fraction, x.FractionBest, ofLink, x.JobP50Ms, x.JobP99Ms, x.CPUMsPerGB, x.Ceiling.CPUMsPerGB,
			sizeString(x.VerifiedBytes), x.Ceiling.Name, roundSpread(x.RoundFractions, spread))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w, "fraction: of the ceiling with as many threads as jobs; of best: of the best ceiling over every thread count")
	if reread {
		fmt.Fprintln(w, "of reread: of the same files read plainly a second time (loads): a first read of fresh pages on a memory file system costs more than later ones")
	}
	if staged {
		fmt.Fprintln(w, "of staged: of the same files moved plainly through pinned buffers and the GPU, a chunk at a time, double-buffered (a path through pinned host memory without checksums or scatter)")
	}
	if link {
		fmt.Fprintln(w, "of link: of the pinned copy ceiling of the same direction (H2D for loads, D2H for stores), which every byte crosses")
	}
	fmt.Fprintln(w, "CPU ms/GB: the process's CPU time per GB moved, the engine's and the ceiling's")
	restart, foreign := false, false
	for _, x := range r.Runs {
		restart, foreign = restart || x.Restart, foreign || x.Foreign
	}
	if restart {
		fmt.Fprintln(w, "load (restart): in a new engine and GPU movers opened on the directory after the store, as after a daemon restart")
		for _, x := range r.Runs {
			if x.Restart && x.RestartWarmMs > 0 {
				fmt.Fprintf(w, "load (restart), %s keys, %d jobs: %d files found at open, %d registered when the load began, %.0f ms a round to register them (not in the load's time)\n",
					sizeString(x.KeyBytes), x.Jobs, x.FilesAtRestart, x.RegisteredAtRestart, x.RestartWarmMs)
			}
		}
	}
	if foreign {
		fmt.Fprintln(w, "load (foreign): by a second engine, another node's with GPU movers of its own, opened before the store: it found the files on the load")
	}
	if spread {
		fmt.Fprintln(w, "by round: the least, median and greatest of the rounds' fractions, each of a round's GB/s over its own ceiling")
	}
	for _, x := range r.Runs {
		if x.LoadReaders > 0 {
			mode := "O_DIRECT"
			if x.LoadBuffered {
				mode = "buffered"
			}
			fmt.Fprintf(w, "load readers after %s %s sums=%v, %d jobs: %d %s (%d changes by tuning)\n",
				x.Path, sizeString(x.KeyBytes), x.Checksums, x.Jobs, x.LoadReaders, mode, x.LoadReadersChanged)
		}
	}
	if footnote {
		fmt.Fprintln(w, "on*: checksums asked for, but the mover computes none (the CPU never sees the bytes)")
	}
	for _, c := range r.Ceilings {
		fmt.Fprintf(w, "ceiling: %s %.2f GB/s\n", c.Name, c.GBps)
	}
	for _, x := range r.Runs {
		if c := x.CeilingStaged; c.GBps > 0 {
			sums := "off"
			if x.Checksums {
				sums = "on"
			}
			fmt.Fprintf(w, "staged ceiling of %s sums=%s %s %s, %d jobs: %s %.2f GB/s, %.0f CPU ms/GB\n", x.Path, sums, sizeString(x.KeyBytes), x.Direction, x.Jobs, c.Name, c.GBps, c.CPUMsPerGB)
		}
	}
	for _, x := range r.Runs {
		if c := x.ReadFirst; c.GBps > 0 {
			fmt.Fprintf(w, "read first, before the %s of %s keys, %d jobs: %s %.2f GB/s, %.0f CPU ms/GB\n", x.Direction, sizeString(x.KeyBytes), x.Jobs, c.Name, c.GBps, c.CPUMsPerGB)
		}
	}
	if r.Partial {
		fmt.Fprintln(w, "PARTIAL: the benchmark was interrupted; these are the phases that finished")
	}
	_, err := fmt.Fprintf(w, "took %.1f s\n", r.Seconds)
	return err
}

// column is a fraction's cell in the table where the column is shown:
// the fraction where the run has the ceiling (0.00 for a run that moved
// nothing), empty where it has none; nothing where the column is not
// shown.
func column(shown bool, c Ceiling, f float64) string {
	switch {
	case !shown:
		return ""
	case c.GBps > 0:
		return fmt.Sprintf("%.2f\t", f)
	}
	return "\t"
}

// sizeString prints a byte count in binary units ("32MiB").
func sizeString(n int64) string {
	switch {
	case n == 0:
		return "0"
	case n%(1<<30) == 0:
		return fmt.Sprintf("%dGiB", n>>30)
	case n >= 1<<30:
		return fmt.Sprintf("%.1fGiB", float64(n)/(1<<30))
	case n%(1<<20) == 0:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<20:
		return fmt.Sprintf("%.1fMiB", float64(n)/(1<<20))
	case n%(1<<10) == 0:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}

// Percentile is the p-th percentile (0..1) of ds, by nearest rank, in
// milliseconds; 0 for no samples. ds is sorted in place.
func Percentile(ds []time.Duration, p float64) float64 {
	if len(ds) == 0 {
		return 0
	}
	slices.Sort(ds)
	i := int(p*float64(len(ds))+0.5) - 1
	i = max(0, min(i, len(ds)-1))
	return float64(ds[i]) / float64(time.Millisecond)
}

// seriesKey names a run's series in the chart and groups runs.
func (x Run) seriesKey() string {
	return x.Path + " " + x.Direction
}

// panelKey names the chart panel a run belongs to.
func (x Run) panelKey() string {
	sums := "checksums off"
	if x.Checksums {
		sums = "checksums on"
	}
	return sizeString(x.KeyBytes) + " keys, " + sums
}

// title is a short description used in the SVG.
func (r *Report) title() string {
	var b strings.Builder
	fmt.Fprintf(&b, "kvhost bench — %s (%s), %s memory", r.Dir, r.FSType, r.Memory)
	if r.Device != "" {
		fmt.Fprintf(&b, ", %s", r.Device)
	}
	return b.String()
}
