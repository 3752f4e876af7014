// Package conformance is the conformance suite of kvhost policy plugins: it
// loads a module in the policy host and drives it through the situations
// the storage engine creates — batch edge cases, varied keys, several
// namespaces and mounts, capacity pressure, pinned and removed entries — and
// checks every answer. A vendor runs it in CI with `kvhost policy test
// FILE.wasm`; kvhost's own tests run it on every built-in plugin.
//
// The host rejects any invalid output (a path escaping the cache root, an
// unknown or pinned victim, a failure status, a trap or an overrun); the
// suite counts a single rejection as a failure of the check during which
// it happened, with the host's message, so that every broken rule is
// named by its own check. RunPolicy runs the same suite on a native Go
// policy (guest.Policy), as the host's fallback runs one.
package conformance

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"runtime"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/tetratelabs/wazero"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/host/policy/policytest"
)

// Options tune a run. The zero value runs the full suite with the host's
// defaults.
type Options struct {
	// Name names the plugin in messages; default "plugin".
	Name string
	// Shards is the number of instances the host runs; default 2, so that
	// the host's fan-out and merge are exercised.
	Shards int
	// CallTimeout and MemoryLimit are the host's limits; zero means the
	// host's defaults.
	CallTimeout time.Duration
	MemoryLimit int64 // bytes of linear memory per instance
	// Params is the plugin configuration passed to kvhost_init.
	Params map[string]string
	// Entries is the number of entries of the capacity-pressure check;
	// default 4000.
	Entries int
	// Cache, if set, is the compilation cache of the hosts the suite opens.
	// By default the suite compiles the module once into an in-memory cache.
	Cache wazero.CompilationCache
	// Logger receives the host's and the plugin's logs; default: discarded.
	Logger *slog.Logger
}

// Check is the result of one named check.
type Check struct {
	Name string // the check's name, as the report lists it
	// Rule is the rule of docs/abi.md the check enforces.
	Rule     string
	OK       bool          // the check passed
	Message  string        // why it failed, or what it established
	Duration time.Duration // how long the check ran
}

// HookTiming is the time of the calls into the plugin of one hook, over the
// whole run, against the deadline of one call.
type HookTiming struct {
	Hook    string // export name, "kvhost_name", ...
	Calls   int    // calls into the plugin
	Records int    // records passed in those calls
	// P50, P99 and Max are the median, 99th percentile and slowest call.
	P50, P99, Max time.Duration
	// OverDeadline counts the calls that took longer than the deadline.
	OverDeadline int
}

// Report is the result of a run.
type Report struct {
	Plugin string // the plugin's name, Options.Name
	// Info describes the module (what `kvhost policy inspect` prints).
	Info   policy.Info
	Checks []Check // every check run, in order
	// Deadline is the deadline of one call the run used.
	Deadline time.Duration
	// Timing has one entry per hook the plugin was called with.
	Timing []HookTiming
	// Stats are the counters of the suite's main host at the end of the
	// run; valid when HasStats (the module loaded).
	Stats    policy.Stats
	HasStats bool // Stats is set: the module loaded
}

// OK reports whether every check passed.
func (r Report) OK() bool {
	if len(r.Checks) == 0 {
		return false
	}
	for _, c := range r.Checks {
		if !c.OK {
			return false
		}
	}
	return true
}

// Failed returns the checks that failed.
func (r Report) Failed() []Check {
	var out []Check
	for _, c := range r.Checks {
		if !c.OK {
			out = append(out, c)
		}
	}
	return out
}

// Check returns the check named name.
func (r Report) Check(name string) (Check, bool) {
	for _, c := range r.Checks {
		if c.Name == name {
			return c, true
		}
	}
	return Check{}, false
}

// WriteTo writes the report for humans: one line per check (with the rule
// under a failed one), the time of the calls per hook, the host's
// counters, then a summary.
func (r Report) WriteTo(w io.Writer) (int64, error) {
	var b strings.Builder
	passed := 0
	for _, c := range r.Checks {
		mark := "FAIL"
		if c.OK {
			mark, passed = "ok  ", passed+1
		}
		fmt.Fprintf(&b, "%s %-22s %8s  %s\n", mark, c.Name, c.Duration.Round(time.Millisecond), c.Message)
		if !c.OK && c.Rule != "" {
			fmt.Fprintf(&b, "     rule: %s\n", c.Rule)
		}
	}
	if len(r.Timing) > 0 {
		fmt.Fprintf(&b, "call times (deadline %v per call):\n", r.Deadline)
		for _, t := range r.Timing {
			fmt.Fprintf(&b, "  %-18s %6d calls %8d records  p50 %-9v p99 %-9v max %-9v (p99 %.2g%% of the deadline, %d over)\n",
				t.Hook, t.Calls, t.Records, round(t.P50), round(t.P99), round(t.Max),
				100*float64(t.P99)/float64(r.Deadline), t.OverDeadline)
		}
	}
	if r.HasStats {
		fmt.Fprintf(&b, "host stats: %s\n", StatsLine(r.Stats))
	}
	verdict := "PASS"
	if !r.OK() {
		verdict = "FAIL"
	}
	fmt.Fprintf(&b, "%s: %s: %d passed, %d failed\n", verdict, r.Plugin, passed, len(r.Checks)-passed)
	n, err := io.WriteString(w, b.String())
	return int64(n), err
}

// round rounds d to 3 significant digits for reading.
func round(d time.Duration) time.Duration {
	switch {
	case d >= 100*time.Millisecond:
		return d.Round(time.Millisecond)
	case d >= 100*time.Microsecond:
		return d.Round(time.Microsecond)
	case d >= 100*time.Nanosecond:
		return d.Round(100 * time.Nanosecond)
	}
	return d
}

// StatsLine formats a policy host's counters on one line: calls and records
// per hook, failures, rejected outputs, replacements, stale victims, slow
// calls and the backend answering calls.
func StatsLine(st policy.Stats) string {
	hooks := make([]string, 0, len(st.Calls))
	for h := range st.Calls {
		hooks = append(hooks, h)
	}
	sort.Strings(hooks)
	var parts []string
	for _, h := range hooks {
		if st.Calls[h] > 0 {
			parts = append(parts, fmt.Sprintf("%s %d/%d", strings.TrimPrefix(h, "kvhost_"), st.Calls[h], st.Records[h]))
		}
	}
	line := fmt.Sprintf("calls/records %s; failures %d (rejected outputs %d), replacements %d, stale victims %d, slow calls %d; backend %s",
		strings.Join(parts, ", "), st.Failures, st.Rejections, st.Replacements, st.StaleVictims, st.SlowCalls, st.Backend)
	if st.Fallback {
		line += fmt.Sprintf(" (fallback: %s)", st.FallbackReason)
	}
	return line
}

// Run runs the suite on module. It never panics on a hostile module: every
// problem is a failed check in the Report, naming the rule broken.
func Run(ctx context.Context, module []byte, opts Options) Report {
	return run(ctx, module, nil, opts)
}

// RunPolicy runs the suite on a native Go policy: newPolicy builds the
// policy of one shard, as policy.NewNative takes it. The checks are those
// of Run but for the sandbox's (memory, fuel), which do not apply to
// native code; a vendor checks a policy's logic with it before building
// the module, and kvhost's tests hold one-defect variants of the
// built-in policies to the rules with it.
func RunPolicy(ctx context.Context, newPolicy func() guest.Policy, opts Options) Report {
	if newPolicy == nil {
		return Report{Plugin: opts.Name, Checks: []Check{{Name: "load", Rule: ruleLoad, Message: "no policy: a nil constructor"}}}
	}
	return run(ctx, nil, newPolicy, opts)
}

func run(ctx context.Context, module []byte, native func() guest.Policy, opts Options) Report {
	if opts.Name == "" {
		opts.Name = "plugin"
	}
	if opts.Shards == 0 {
		opts.Shards = 2
	}
	if opts.Entries <= 0 {
		opts.Entries = 4000
	}
	if opts.CallTimeout == 0 {
		opts.CallTimeout = policy.DefaultCallTimeout
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Cache == nil && native == nil {
		cache := wazero.NewCompilationCache()
		defer cache.Close(ctx)
		opts.Cache = cache
	}
	fails := &failureLog{}
	s := &suite{ctx: ctx, module: module, native: native, opts: opts, now: startTime,
		fails: fails, logger: slog.New(&failureHandler{next: opts.Logger.Handler(), log: fails}),
		report: Report{Plugin: opts.Name, Deadline: opts.CallTimeout},
		times:  map[string][]time.Duration{}, records: map[string]int{}}
	s.run()
	s.report.Timing = s.timing()
	return s.report
}

// startTime is the clock of the records at the start of a run (Unix
// nanoseconds, November 2023).
const startTime = 1_700_000_000_000_000_000

// suite is the state of one run.
type suite struct {
	ctx    context.Context
	module []byte              // the wasm module, or nil for native
	native func() guest.Policy // the native policy, or nil for module
	opts   Options
	report Report
	// fails holds the plugin failures every host of the run logged, and
	// logger (opts.Logger's handler behind it) is what fills it.
	fails  *failureLog
	logger *slog.Logger

	host *policy.Host
	idx  *policytest.Index
	ns   []abi.NamespaceRecord // declared, with their layouts
	next uint64                // next entry id
	now  uint64                // the clock of the records

	// deadlineErr is the first call that ran out of fuel.
	deadlineErr error

	// The time of every call into the plugin, by hook, from every host
	// the suite opens (policy.Config.OnCall).
	mu      sync.Mutex
	times   map[string][]time.Duration
	records map[string]int
}

func (s *suite) config(shards int) policy.Config {
	logger := s.logger
	if logger == nil {
		logger = s.opts.Logger
	}
	return policy.Config{Shards: shards, CallTimeout: s.opts.CallTimeout, MemoryLimit: s.opts.MemoryLimit,
		Params: s.opts.Params, Cache: s.opts.Cache, Logger: logger, OnCall: s.observe}
}

// open opens a host of the plugin (module or native policy) over idx.
func (s *suite) open(idx policy.Index, shards int) (*policy.Host, error) {
	return s.openConfig(idx, s.config(shards))
}

func (s *suite) openConfig(idx policy.Index, cfg policy.Config) (*policy.Host, error) {
	if s.native != nil {
		return policy.NewNative(s.native, idx, cfg)
	}
	return policy.Open(s.ctx, s.module, s.opts.Name, idx, cfg)
}

// fresh opens a host of shards instances over a new index, with the
// suite's namespaces declared. The caller closes the host.
func (s *suite) fresh(shards int) (*policy.Host, *policytest.Index, error) {
	idx := policytest.NewIndex()
	h, err := s.open(idx, shards)
	if err != nil {
		return nil, nil, fmt.Errorf("opening a host of %d shards: %w", shards, err)
	}
	for _, in := range namespaceFixtures() {
		out, err := h.Namespace(s.ctx, in)
		if err != nil {
			h.Close(s.ctx)
			return nil, nil, err
		}
		idx.AddNamespace(out)
	}
	return h, idx, nil
}

// observe records the time of one call into the plugin.
func (s *suite) observe(hook string, records int, took time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.times[hook] = append(s.times[hook], took)
	s.records[hook] += records
}

// timing summarises the calls observed, per hook in ABI order.
func (s *suite) timing() []HookTiming {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []HookTiming
	for _, hook := range []string{"kvhost_init", "kvhost_namespace", "kvhost_name", "kvhost_admit", "kvhost_access", "kvhost_evict", "kvhost_mounts", "kvhost_tick", "kvhost_rank"} {
		d := slices.Clone(s.times[hook])
		if len(d) == 0 {
			continue
		}
		slices.Sort(d)
		t := HookTiming{Hook: hook, Calls: len(d), Records: s.records[hook],
			P50: percentile(d, 50), P99: percentile(d, 99), Max: d[len(d)-1]}
		for _, x := range d {
			if x > s.opts.CallTimeout {
				t.OverDeadline++
			}
		}
		out = append(out, t)
	}
	return out
}

// percentile returns the nearest-rank p-th percentile of sorted d.
func percentile(d []time.Duration, p int) time.Duration {
	i := (len(d)*p + 99) / 100
	return d[max(i, 1)-1]
}

// Rules of docs/abi.md, one per check.
const (
	ruleLoad          = "the module implements ABI v1: required exports with their signatures, kvhost_abi_version 1, known feature bits, allowed imports, a valid scratch area; and kvhost_init accepts the configuration it is given (-param here, [policy.params] in the daemon) (docs/abi.md: Exports, Imports, The scratch area, Configuration)"
	ruleNamespaces    = "kvhost_namespace returns keys_per_file 1..256 and order 0 or 1, the same each time a namespace is declared (docs/abi.md: NamespaceRecord)"
	ruleBatches       = "hooks take 1..1024 records per call, kvhost_evict returns at most max victims, and a key gets the same name in any batch (docs/abi.md: n, max and batches)"
	ruleNames         = "every path is 1..256 bytes of [A-Za-z0-9._-/], relative, with no empty or dot-led component, on a mount < mount_count; distinct first keys of a namespace get distinct paths, for any keys per file and across mounts, keys that differ in one byte too (docs/abi.md: NameRecord, Rules the host enforces)"
	ruleDeterm        = "naming is a pure function of the name record and the configuration: the same on every shard, in every host, before and after any events; the same events give the same victims (docs/abi.md: Life cycle)"
	ruleAdmission     = "kvhost_admit writes 0 or 1 into every record, and does not refuse every store (docs/abi.md: AdmitRecord)"
	ruleCapacity      = "victims are known, unpinned, on the requested mount, listed once, and cover the bytes asked for when enough unpinned entries exist (docs/abi.md: Victim)"
	ruleRestore       = "an instance built from RESTORE records knows every entry, whatever its ns; a repeated INSERT or RESTORE updates an entry and keeps its pins, never duplicates it (docs/abi.md: Life cycle, AccessRecord)"
	ruleUnknown       = "HIT, PIN, UNPIN and REMOVE of unknown entries, and UNPIN without PIN, are accepted and ignored (docs/abi.md: AccessRecord)"
	ruleRemoved       = "a removed entry is never offered as a victim again (docs/abi.md: AccessRecord)"
	rulePinned        = "a pinned entry is never a victim until each of its pins is released (docs/abi.md: AccessRecord, Rules the host enforces)"
	ruleTiming        = "every call finishes within its fuel, the deterministic form of the deadline; how long calls took is reported, not judged (docs/abi.md: Sandbox)"
	ruleMounts        = "with FEATURE_MOUNTS, kvhost_mounts accepts every description: kvhost mounts first, vllm-fs mounts after them, sent again when usage changes (docs/abi.md: MountRecord, Tiering). A plugin without it passes"
	ruleAdmitTarget   = "with FEATURE_ADMIT_MOUNT, once the mounts are described, admission's target is a described mount that is not a vllm-fs mount (docs/abi.md: AdmitRecord, Rules the host enforces). A plugin without it passes"
	ruleDemote        = "with FEATURE_DEMOTE, a victim's target is NO_MOUNT or a described mount other than the victim's, never a vllm-fs mount, with no flag but MOVE_DELETE_IF_FULL; a request for any mount judges each victim's target against its own mount (docs/abi.md: VictimTarget, Rules the host enforces). A plugin without it passes"
	ruleTick          = "with FEATURE_TICK, a tick returns at most max moves (the suite asks for 1, 3 and 1024), each of a known entry not pinned, to a described mount other than its own that is not a vllm-fs mount, flags 0 (docs/abi.md: Move, Rules the host enforces). A plugin without it passes"
	ruleRepeat        = "with FEATURE_TICK, a plugin does not ask again to move an entry it asked to move while nothing new is known of it: no record of the entry (its REMOVE ends the move) and no later mount description (docs/abi.md: Tiering, What a tick sees). A plugin without it passes"
	ruleUndescribed   = "before the first mount description, admission keeps every file on its name's mount, no victim has a target and a tick moves nothing: a namespace's mount_count is no description (docs/abi.md: Tiering, Rules the host enforces). A plugin without the tiering features passes"
	ruleRank          = "with FEATURE_RANK, kvhost_rank writes a state into every record, ranks an entry by its access history and the time only (the same history under other handles, in a host of another shard count, ranks alike) and never lower after a hit (docs/abi.md: RankRecord, Ranks for a shared mount). A plugin without it passes"
	ruleRankScale     = "with FEATURE_RANK, a rank is on the scale of Unix nanoseconds: an entry never hit ranks within 24 hours of its last access, a hit entry at most 24 hours above it per doubling of its accesses (3 days after 3 hits), and no entry more than 24 hours below it, with the configuration it is given (docs/abi.md: Ranks for a shared mount). A plugin without it passes"
	ruleRankOrder     = "with FEATURE_RANK, ranks are monotone in recency and in hits: of two entries with the same hits, the one used later ranks no lower; of two last used at the same time, the one with more hits ranks no lower; a HIT, whatever its time (another node's use may be older than the last access), lowers no rank (docs/abi.md: Ranks for a shared mount). A plugin without it passes"
	ruleRankUnknown   = "with FEATURE_RANK, an entry the plugin was told of (and not sent a REMOVE for) is RANK_KNOWN, and any other handle is RANK_UNKNOWN (docs/abi.md: RankRecord). A plugin without it passes"
	ruleRestoreFields = "RESTORE's time is the file's last access and its hits the file's hit count: with FEATURE_RANK, a restored entry ranks by them as a live one with that last access and that many hits (within 24 hours of the time when never hit, at most 24 hours above it per doubling of the accesses; no lower for a later time or more hits; higher for more hits where the plugin's live ranks count hits) (docs/abi.md: AccessRecord). A plugin without FEATURE_RANK passes"
	ruleMemory        = "a memory.grow the host refuses (past the memory limit) returns -1: the plugin then fails the call (STATUS_NO_MEMORY) or carries on without the memory, never touching pages it did not get; the suite runs it under a limit of its initial memory plus 2 MiB (docs/abi.md: Rules the host enforces, Sandbox). A native policy passes"
	ruleRejections    = "the host rejects no output and replaces no instance during the run (docs/abi.md: Rules the host enforces)"
)

// check runs fn as the check name, which enforces rule. A panic in fn (a
// plugin answer that broke an assumption of the suite) is a failure of the
// check, never of the process.
func (s *suite) check(name, rule string, fn func() (string, error)) (ok bool) {
	start := time.Now()
	c := Check{Name: name, Rule: rule}
	defer func() {
		if r := recover(); r != nil {
			c.OK, c.Message = false, fmt.Sprintf("the check could not complete (internal error: %v, at %s): the plugin's answers so far break its rule", r, panicSite())
		}
		c.Duration = time.Since(start)
		s.report.Checks = append(s.report.Checks, c)
		ok = c.OK
	}()
	before := s.fails.len()
	msg, err := fn()
	if err == nil {
		err = s.caught(before)
	}
	c.OK, c.Message = err == nil, msg
	if err != nil {
		c.Message = err.Error()
	}
	return c.OK
}

// caught fails a check for the plugin failures the hosts caught since
// the first before: a rejected output or a trap the host recovered from
// (it rebuilt the instance and retried, so that the retried answer may
// look right) breaks the rule of the check that provoked it, which names
// the host's message, rather than only the catch-all "no host
// rejections". A check that provokes failures on purpose and judges them
// (memory limit) forgets them first (failureLog.truncate).
func (s *suite) caught(before int) error {
	f := s.fails.since(before)
	if len(f) == 0 {
		return nil
	}
	return fmt.Errorf("the host caught %d plugin failures during this check (and rebuilt the instance, so later answers came from a fresh one); the first: %s", len(f), f[0])
}

// panicSite is the function, file and line where the panic being
// recovered was raised (the first frame outside the runtime), so that a
// report of an internal error says where it happened.
func panicSite() string {
	pcs := make([]uintptr, 32)
	frames := runtime.CallersFrames(pcs[:runtime.Callers(3, pcs)])
	for {
		f, more := frames.Next()
		if !strings.HasPrefix(f.Function, "runtime.") {
			return fmt.Sprintf("%s %s:%d", f.Function, f.File, f.Line)
		}
		if !more {
			return "an unknown place"
		}
	}
}

func (s *suite) run() {
	if !s.check("load", ruleLoad, s.load) {
		return
	}
	defer func() {
		s.report.Stats, s.report.HasStats = s.host.Stats(), true
		s.host.Close(s.ctx)
	}()
	s.check("namespaces", ruleNamespaces, s.namespaces)
	s.check("batch sizes", ruleBatches, s.needNamespaces(s.batches))
	s.check("names", ruleNames, s.needNamespaces(s.names))
	s.check("determinism", ruleDeterm, s.needNamespaces(s.determinism))
	s.check("admission", ruleAdmission, s.needNamespaces(s.admission))
	s.check("capacity pressure", ruleCapacity, s.needNamespaces(s.capacity))
	s.check("restore", ruleRestore, s.needNamespaces(s.restore))
	s.check("unknown events", ruleUnknown, s.needNamespaces(s.unknownEvents))
	s.check("removed entries", ruleRemoved, s.needNamespaces(s.removed))
	s.check("pinned entries", rulePinned, s.needNamespaces(s.pinned))
	s.check("mount descriptions", ruleMounts, s.needNamespaces(s.mountDescriptions))
	s.check("admission targets", ruleAdmitTarget, s.needNamespaces(s.admissionTargets))
	s.check("demotion targets", ruleDemote, s.needNamespaces(s.demotionTargets))
	s.check("tick moves", ruleTick, s.needNamespaces(s.tickMoves))
	s.check("repeated moves", ruleRepeat, s.needNamespaces(s.repeatedMoves))
	s.check("before mount descriptions", ruleUndescribed, s.needNamespaces(s.beforeDescriptions))
	s.check("rank", ruleRank, s.needNamespaces(s.rank))
	s.check("rank scale", ruleRankScale, s.needNamespaces(s.withRanked(s.rankScale)))
	s.check("rank order", ruleRankOrder, s.needNamespaces(s.withRanked(s.rankOrder)))
	s.check("rank unknown", ruleRankUnknown, s.needNamespaces(s.withRanked(s.rankUnknown)))
	s.check("restore fields", ruleRestoreFields, s.needNamespaces(s.restoreFields))
	s.check("memory limit", ruleMemory, s.needNamespaces(s.memoryLimit))
	s.check("call timing", ruleTiming, s.callTiming)
	s.check("no host rejections", ruleRejections, s.rejections)
}

// needNamespaces wraps a check that uses the namespaces the namespaces
// check declared: without them it fails, saying why.
func (s *suite) needNamespaces(fn func() (string, error)) func() (string, error) {
	return func() (string, error) {
		if want := len(namespaceFixtures()); len(s.ns) != want {
			return "", fmt.Errorf("not run: it needs the layouts of the %d namespaces, and the namespaces check failed", want)
		}
		return fn()
	}
}

// timed runs one host call and remembers the first that ran out of fuel.
func (s *suite) timed(fn func() error) error {
	err := fn()
	if err != nil && strings.Contains(err.Error(), "exceeded the call deadline") && s.deadlineErr == nil {
		s.deadlineErr = err
	}
	return err
}

func (s *suite) load() (string, error) {
	if s.native != nil {
		s.idx = policytest.NewIndex()
		h, err := s.open(s.idx, s.opts.Shards)
		if err != nil {
			return "", err
		}
		s.host = h
		s.report.Info = policy.Info{ABIVersion: abi.Version, VersionKnown: true, Features: h.Features()}
		return fmt.Sprintf("native policy, features %s, %d shards", h.Features(), s.opts.Shards), nil
	}
	info, err := policy.Inspect(s.ctx, s.module)
	s.report.Info = info
	if err != nil {
		return "", err
	}
	if !info.OK() {
		return "", fmt.Errorf("not an ABI v%d plugin: %s", abi.Version, strings.Join(info.Problems, "; "))
	}
	s.idx = policytest.NewIndex()
	h, err := policy.Open(s.ctx, s.module, s.opts.Name, s.idx, s.config(s.opts.Shards))
	if err != nil {
		return "", err
	}
	s.host = h
	return fmt.Sprintf("ABI v%d, features %s, %d bytes, %d shards", info.ABIVersion, info.Features, info.Size, s.opts.Shards), nil
}

// namespaceFixtures are the namespaces the suite declares: different
// models, geometries, ranks, an MLA model and several mounts.
func namespaceFixtures() []abi.NamespaceRecord {
	mk := func(ns uint32, model string, fp uint64, layers, heads, rank, tp, mounts uint32, flags uint32) abi.NamespaceRecord {
		r := abi.NamespaceRecord{NS: ns, Flags: flags, Fingerprint: fp, Layers: layers, KVHeads: heads, HeadSize: 128,
			DtypeSize: 2, TokensPerBlock: 16, TokensPerKey: 256, TPRank: rank, TPSize: tp, MountCount: mounts}
		r.KeyBytes = uint64(layers) * 2 * uint64(heads) * 128 * 2 * 256
		r.SetModelID(model)
		return r
	}
	return []abi.NamespaceRecord{
		mk(0, "meta-llama/Llama-3.1-8B-Instruct", 0x0123456789abcdef, 32, 8, 0, 1, 1, 0),
		mk(1, "Qwen/Qwen2.5-72B", 0xfedcba9876543210, 80, 8, 3, 4, 2, 0),
		mk(2, "deepseek-ai/DeepSeek-V3", 0x5555aaaa5555aaaa, 61, 1, 0, 8, 4, abi.NamespaceMLA),
	}
}

func (s *suite) namespaces() (string, error) {
	var layouts []string
	for _, in := range namespaceFixtures() {
		var out abi.NamespaceRecord
		err := s.timed(func() (err error) { out, err = s.host.Namespace(s.ctx, in); return err })
		if err != nil {
			return "", err
		}
		again, err := s.host.Namespace(s.ctx, in)
		if err != nil {
			return "", err
		}
		if again.KeysPerFile != out.KeysPerFile || again.Order != out.Order {
			return "", fmt.Errorf("namespace %d: declared twice, got layouts (%d, %d) then (%d, %d)",
				in.NS, out.KeysPerFile, out.Order, again.KeysPerFile, again.Order)
		}
		s.idx.AddNamespace(out)
		s.ns = append(s.ns, out)
		layouts = append(layouts, fmt.Sprintf("ns %d: %d keys/file, order %d", out.NS, out.KeysPerFile, out.Order))
	}
	return strings.Join(layouts, "; "), nil
}

// nameRecord is a name request for key in namespace ns.
func nameRecord(ns abi.NamespaceRecord, key []byte) abi.NameRecord {
	r := abi.NameRecord{NS: ns.NS, Fingerprint: ns.Fingerprint, TPRank: ns.TPRank, MountCount: max(ns.MountCount, 1)}
	r.SetKey(key)
	return r
}

// keys returns n distinct keys of 16 bytes for namespace-independent use.
func keys(n int, salt byte) [][]byte {
	out := make([][]byte, n)
	for i := range out {
		k := make([]byte, 16)
		for j := range k {
			k[j] = byte(i>>(8*(j%4))) ^ salt ^ byte(j*31)
		}
		out[i] = k
	}
	return out
}

// specialKeys are keys that break naive naming: 1 byte, dots, slashes,
// every byte value, the longest key, spaces.
func specialKeys() [][]byte {
	long := make([]byte, abi.MaxKeyLen)
	for i := range long {
		long[i] = 0xff - byte(i)
	}
	binary := make([]byte, 32)
	for i := range binary {
		binary[i] = byte(i * 37) // includes 0x00, '/', '.', bytes >= 0x80
	}
	return [][]byte{{0}, {'.'}, []byte(".."), []byte("../../etc/passwd"), []byte("/abs"), binary, long, []byte("a key with spaces")}
}

func (s *suite) name(h *policy.Host, recs []abi.NameRecord) error {
	return s.timed(func() error { return h.Name(s.ctx, recs) })
}

func (s *suite) batches() (string, error) {
	ns := s.ns[0]
	for _, n := range []int{0, 1, 2, abi.MaxBatch, abi.MaxBatch + 1} {
		recs := make([]abi.NameRecord, n)
		for i, k := range keys(n, 7) {
			recs[i] = nameRecord(ns, k)
		}
		if err := s.name(s.host, recs); err != nil {
			return "", fmt.Errorf("name batch of %d: %w", n, err)
		}
		// The same keys one at a time get the same names.
		for _, i := range []int{0, n / 2, n - 1} {
			if i < 0 || i >= n {
				continue
			}
			one := []abi.NameRecord{nameRecord(ns, recs[i].Key())}
			if err := s.name(s.host, one); err != nil {
				return "", err
			}
			if one[0].Mount != recs[i].Mount || string(one[0].Path()) != string(recs[i].Path()) {
				return "", fmt.Errorf("batch of %d: key %d named %d:%q in the batch, %d:%q alone",
					n, i, recs[i].Mount, recs[i].Path(), one[0].Mount, one[0].Path())
			}
		}
	}
	for _, n := range []int{0, 1, abi.MaxBatch + 1} {
		recs := s.inserts(n, 0, 4096)
		if err := s.access(s.host, recs); err != nil {
			return "", fmt.Errorf("access batch of %d: %w", n, err)
		}
	}
	for _, max := range []int{0, 1, abi.MaxBatch} {
		v, err := s.victims(s.host, abi.EvictRequest{Bytes: 1 << 62, Mount: abi.AnyMount}, max)
		if err != nil {
			return "", fmt.Errorf("victims, at most %d: %w", max, err)
		}
		if len(v) > max {
			return "", fmt.Errorf("victims, at most %d: got %d", max, len(v))
		}
	}
	// Leave no entries behind for the later checks.
	if err := s.removeAll(); err != nil {
		return "", err
	}
	return fmt.Sprintf("name batches of 0, 1, 2, %d, %d (split by the host); access of 0, 1, %d; victims of 0, 1, %d",
		abi.MaxBatch, abi.MaxBatch+1, abi.MaxBatch+1, abi.MaxBatch), nil
}

// neighbourKeys are keys that differ from each other in one byte only,
// the first or the last (a block index in a chain of keys, say): a name
// must depend on every byte, and on bits a plugin also uses to pick the
// mount (its residue modulo the mount count, say), or two of them share a
// path, on one mount or across mounts.
func neighbourKeys(salt byte) [][]byte {
	var out [][]byte
	for _, at := range []int{0, 15} {
		for b := range 16 {
			k := []byte("neighbour-key-00")
			k[7] ^= salt
			k[at] = byte(b)
			out = append(out, k)
		}
	}
	return out
}

// nameSet returns the name records of the names check: the special keys,
// the neighbour keys and 200 keys per namespace.
func nameSet(nss []abi.NamespaceRecord) []abi.NameRecord {
	var recs []abi.NameRecord
	for _, ns := range nss {
		for _, k := range specialKeys() {
			recs = append(recs, nameRecord(ns, k))
		}
		for _, k := range neighbourKeys(byte(ns.NS)) {
			recs = append(recs, nameRecord(ns, k))
		}
		for _, k := range keys(200, byte(ns.NS)) {
			recs = append(recs, nameRecord(ns, k))
		}
	}
	return recs
}

func (s *suite) names() (string, error) {
	recs := nameSet(s.ns)
	if err := s.name(s.host, recs); err != nil {
		return "", err
	}
	// Distinct keys of a namespace are the first keys of distinct files,
	// whatever the layout: they need distinct files.
	// A file keeps its relative path when it moves between mounts, so
	// the path alone must be unique, whatever the mount.
	seen := map[string]int{}
	for i, r := range recs {
		f := fmt.Sprintf("%d:%s", r.Mount, r.Path())
		id := fmt.Sprintf("%d/%s", r.NS, r.Path())
		if j, dup := seen[id]; dup && string(recs[j].Key()) != string(r.Key()) {
			if recs[j].Mount != r.Mount {
				return "", fmt.Errorf("keys %x and %x of namespace %d are both named %s, on mounts %d and %d: paths must be unique across mounts (a file keeps its path when it moves)",
					recs[j].Key(), r.Key(), r.NS, r.Path(), recs[j].Mount, r.Mount)
			}
			return "", fmt.Errorf("keys %x and %x of namespace %d (%d keys per file) would be the first keys of two files, but both are named %s: a store of one replaces the other",
				recs[j].Key(), r.Key(), r.NS, s.layout(r.NS).KeysPerFile, f)
		}
		seen[id] = i
	}
	mounts := map[uint32]bool{}
	for _, r := range recs {
		mounts[r.Mount] = true
	}
	return fmt.Sprintf("%d keys in %d namespaces (1-byte, binary, %d-byte, dot, slash and neighbour keys): valid paths, distinct paths per namespace across %d mounts",
		len(recs), len(s.ns), abi.MaxKeyLen, len(mounts)), nil
}

func (s *suite) layout(ns uint32) abi.NamespaceRecord {
	for _, r := range s.ns {
		if r.NS == ns {
			return r
		}
	}
	return abi.NamespaceRecord{KeysPerFile: abi.DefaultKeysPerFile}
}

// inserts returns n insert records of new entries on mount, size bytes each
// (varied), over the declared namespaces.
func (s *suite) inserts(n int, mount uint32, size uint64) []abi.AccessRecord {
	recs := make([]abi.AccessRecord, n)
	for i := range recs {
		s.next++
		s.now += 1000
		ns := s.ns[i%len(s.ns)]
		recs[i] = abi.AccessRecord{Entry: s.next, Time: s.now, Size: size * uint64(1+i%7),
			KeyHash: abi.KeyHash(fmt.Appendf(nil, "entry-%d", s.next)), Kind: abi.AccessInsert,
			Mount: mount % max(ns.MountCount, 1), NS: ns.NS}
	}
	return recs
}

// event returns an access record of kind on the index entry e.
func (s *suite) event(e policy.Entry, kind uint32) abi.AccessRecord {
	s.now += 1000
	// hits is the host's count as of the record: a HIT counts itself.
	r := abi.AccessRecord{Entry: e.ID, Time: s.now, Size: e.Size, KeyHash: e.KeyHash, Kind: kind, Mount: e.Mount, NS: e.NS, Hits: e.Hits}
	switch kind {
	case abi.AccessRestore:
		r.Time = e.LastAccess
	case abi.AccessHit:
		r.Hits++
	}
	return r
}

// access applies recs to the index (as the engine does first) and reports
// them to the plugin.
func (s *suite) access(h *policy.Host, recs []abi.AccessRecord) error {
	s.idx.Apply(recs)
	return s.timed(func() error { return h.Access(s.ctx, recs) })
}

func (s *suite) victims(h *policy.Host, req abi.EvictRequest, max int) ([]abi.Victim, error) {
	var v []abi.Victim
	err := s.timed(func() (err error) { v, err = h.Victims(s.ctx, req, max); return err })
	return v, err
}

// removeAll removes every entry of the index.
func (s *suite) removeAll() error {
	var recs []abi.AccessRecord
	s.idx.Range(func(e policy.Entry) bool {
		recs = append(recs, s.event(e, abi.AccessRemove))
		return true
	})
	return s.access(s.host, recs)
}

// entries returns the number and bytes of the index's unpinned entries on
// mount.
func (s *suite) entries(mount uint32) (n int, bytes uint64) {
	s.idx.Range(func(e policy.Entry) bool {
		if e.Pins == 0 && (mount == abi.AnyMount || e.Mount == mount) {
			n++
			bytes += e.Size
		}
		return true
	})
	return n, bytes
}

// checkVictims checks victims against the index and that they cover
// req.Bytes when the eligible entries do.
func (s *suite) checkVictims(v []abi.Victim, req abi.EvictRequest, max int) error {
	_, eligible := s.entries(req.Mount)
	seen := map[uint64]bool{}
	var freed uint64
	for i, x := range v {
		e, ok := s.idx.Lookup(x.Entry)
		switch {
		case !ok:
			return fmt.Errorf("victim %d: entry %d is unknown", i, x.Entry)
		case seen[x.Entry]:
			return fmt.Errorf("victim %d: entry %d twice", i, x.Entry)
		case e.Pins > 0:
			return fmt.Errorf("victim %d: entry %d is pinned", i, x.Entry)
		case req.Mount != abi.AnyMount && e.Mount != req.Mount:
			return fmt.Errorf("victim %d: entry %d is on mount %d, not %d", i, x.Entry, e.Mount, req.Mount)
		}
		seen[x.Entry] = true
		freed += e.Size
	}
	if len(v) < max && freed < min(req.Bytes, eligible) {
		return fmt.Errorf("asked to free %d bytes (on mount %s) with %d eligible bytes: %d victims free only %d",
			req.Bytes, mountName(req.Mount), eligible, len(v), freed)
	}
	return nil
}

func mountName(m uint32) string {
	if m == abi.AnyMount {
		return "any"
	}
	return fmt.Sprint(m)
}

// determinism names the same keys in hosts of 1, the configured and 3
// shards, and in the suite's host after its events; and runs the same
// events through two fresh hosts, which must give the same victims.
func (s *suite) determinism() (string, error) {
	recs := nameSet(s.ns)
	// The suite's host, which has seen events, names first: the reference.
	ref := slices.Clone(recs)
	if err := s.name(s.host, ref); err != nil {
		return "", fmt.Errorf("the suite's host: %w", err)
	}
	type result struct {
		label   string
		names   []abi.NameRecord
		victims []abi.Victim
	}
	runOnce := func(label string, shards int) (res result, err error) {
		res.label = label
		idx := policytest.NewIndex()
		h, err := s.open(idx, shards)
		if err != nil {
			return res, err
		}
		defer h.Close(s.ctx)
		for _, in := range namespaceFixtures() {
			out, err := h.Namespace(s.ctx, in)
			if err != nil {
				return res, err
			}
			idx.AddNamespace(out)
		}
		res.names = slices.Clone(recs)
		if err := s.name(h, res.names); err != nil {
			return res, err
		}
		var acc []abi.AccessRecord
		for i := range uint64(2000) {
			ns := s.ns[i%uint64(len(s.ns))]
			acc = append(acc, abi.AccessRecord{Entry: i + 1, Time: startTime + i*7919%2000, Size: 4096 * (1 + i%5),
				KeyHash: abi.KeyHash([]byte{byte(i), byte(i >> 8)}), Kind: abi.AccessInsert,
				Mount: uint32(i) % ns.MountCount, NS: ns.NS})
		}
		for i := uint64(0); i < 2000; i += 3 {
			acc = append(acc, abi.AccessRecord{Entry: i + 1, Time: startTime + 1e9 + i, Kind: abi.AccessHit, Mount: acc[i].Mount, NS: acc[i].NS})
		}
		idx.Apply(acc)
		if err := s.timed(func() error { return h.Access(s.ctx, acc) }); err != nil {
			return res, err
		}
		res.victims, err = s.victims(h, abi.EvictRequest{Bytes: 2 << 20, Mount: abi.AnyMount, Time: startTime + 2e9}, abi.MaxBatch)
		if err != nil {
			return res, err
		}
		// Names do not depend on the events either.
		again := slices.Clone(recs)
		if err := s.name(h, again); err != nil {
			return res, err
		}
		if err := sameNames(res.names, again, "before events", "after 2000 inserts and hits"); err != nil {
			return res, fmt.Errorf("%s: %w", label, err)
		}
		if st := h.Stats(); st.Failures > 0 {
			return res, fmt.Errorf("%d plugin failures", st.Failures)
		}
		return res, nil
	}
	var runs []result
	for _, r := range []struct {
		label  string
		shards int
	}{
		{fmt.Sprintf("a fresh host of %d shards", s.opts.Shards), s.opts.Shards},
		{fmt.Sprintf("another fresh host of %d shards", s.opts.Shards), s.opts.Shards},
		{"a host of 1 shard", 1},
		{"a host of 3 shards", 3},
	} {
		res, err := runOnce(r.label, r.shards)
		if err != nil {
			return "", fmt.Errorf("%s: %w", r.label, err)
		}
		runs = append(runs, res)
	}
	for _, r := range runs {
		if err := sameNames(ref, r.names, fmt.Sprintf("the suite's host (%d shards)", s.opts.Shards), r.label); err != nil {
			return "", err
		}
	}
	a, b := runs[0], runs[1]
	if len(a.victims) != len(b.victims) {
		return "", fmt.Errorf("the same events: %d victims in %s, %d in %s", len(a.victims), a.label, len(b.victims), b.label)
	}
	for i := range a.victims {
		if a.victims[i] != b.victims[i] {
			return "", fmt.Errorf("the same events: victim %d is %+v in %s, %+v in %s", i, a.victims[i], a.label, b.victims[i], b.label)
		}
	}
	return fmt.Sprintf("%d names alike in hosts of 1, %d and 3 shards, before and after events; two fresh hosts: the same %d victims",
		len(recs), s.opts.Shards, len(a.victims)), nil
}

// sameNames compares the names of the same records from two sources.
func sameNames(a, b []abi.NameRecord, la, lb string) error {
	for i := range a {
		if a[i].Mount != b[i].Mount || string(a[i].Path()) != string(b[i].Path()) {
			return fmt.Errorf("key %x of namespace %d is named %d:%s by %s, %d:%s by %s: names must not depend on the shard, the host or its state",
				a[i].Key(), a[i].NS, a[i].Mount, a[i].Path(), la, b[i].Mount, b[i].Path(), lb)
		}
	}
	return nil
}

// Admission parameters: each of admitKeys keys per namespace is asked about
// admitRounds times, with files of these sizes, on an empty cache.
const (
	admitKeys   = 64
	admitRounds = 4
)

var admitSizes = []uint64{1 << 20, 16 << 20, 64 << 20}

func (s *suite) admission() (string, error) {
	if _, n := s.entries(abi.AnyMount); n != 0 {
		return "", fmt.Errorf("the cache is not empty before the check (%d bytes)", n)
	}
	var names []abi.NameRecord
	for _, ns := range s.ns {
		for _, k := range keys(admitKeys, 0x40+byte(ns.NS)) {
			names = append(names, nameRecord(ns, k))
		}
	}
	if err := s.name(s.host, names); err != nil {
		return "", err
	}
	admitted := map[uint32]int{}
	asked, yes := 0, 0
	for range admitRounds {
		recs := make([]abi.AdmitRecord, len(names))
		for i, n := range names {
			s.now += 1000
			recs[i] = abi.AdmitRecord{KeyHash: n.KeyHash, Size: admitSizes[i%len(admitSizes)], Time: s.now, NS: n.NS, Mount: n.Mount}
		}
		if err := s.timed(func() error { return s.host.Admit(s.ctx, recs) }); err != nil {
			return "", err
		}
		for i, r := range recs {
			if r.Admit > 1 { // the host validates; a second line of defence
				return "", fmt.Errorf("record %d: admit %d is neither 0 nor 1", i, r.Admit)
			}
			asked++
			if r.Admit == 1 {
				yes++
				admitted[r.NS]++
			}
		}
	}
	if !s.host.Features().Has(abi.FeatureAdmit) {
		if yes != asked {
			return "", fmt.Errorf("no kvhost_admit, yet %d of %d stores were refused", asked-yes, asked)
		}
		return fmt.Sprintf("no kvhost_admit: the host admitted all %d stores", asked), nil
	}
	for _, ns := range s.ns {
		if admitted[ns.NS] == 0 {
			return "", fmt.Errorf("namespace %d: every store refused (%d keys asked %d times each, files of 1 to 64 MiB, empty cache): a plugin must not refuse everything",
				ns.NS, admitKeys, admitRounds)
		}
	}
	return fmt.Sprintf("%d keys asked %d times each, files of 1 to 64 MiB: %d of %d stores admitted, %d refused", len(names), admitRounds, yes, asked, asked-yes), nil
}

func (s *suite) capacity() (string, error) {
	n := s.opts.Entries
	for start := 0; start < n; start += abi.MaxBatch {
		recs := s.inserts(min(abi.MaxBatch, n-start), uint32(start/abi.MaxBatch), 64<<10)
		if err := s.access(s.host, recs); err != nil {
			return "", err
		}
	}
	// Hits on every tenth entry.
	var hits []abi.AccessRecord
	s.idx.Range(func(e policy.Entry) bool {
		if e.ID%10 == 0 {
			hits = append(hits, s.event(e, abi.AccessHit))
		}
		return true
	})
	if err := s.access(s.host, hits); err != nil {
		return "", err
	}
	_, total := s.entries(abi.AnyMount)
	var asked []string
	for _, req := range []abi.EvictRequest{
		{Bytes: total / 20, Mount: abi.AnyMount},
		{Bytes: total / 50, Mount: 0},
		{Bytes: total / 50, Mount: 1},
		{Bytes: 1, Mount: abi.AnyMount},
	} {
		req.Time = s.now
		v, err := s.victims(s.host, req, abi.MaxBatch)
		if err != nil {
			return "", err
		}
		if err := s.checkVictims(v, req, abi.MaxBatch); err != nil {
			return "", err
		}
		asked = append(asked, fmt.Sprintf("%d B on mount %s: %d victims", req.Bytes, mountName(req.Mount), len(v)))
	}
	return fmt.Sprintf("%d entries, %d bytes; %s", s.idx.Len(), total, strings.Join(asked, ", ")), nil
}

// restoreEntries is the number of entries of the restore check.
const restoreEntries = 600

// restore opens a fresh host over an index that already holds entries (a
// restart: the instances are built from RESTORE records, some of a
// namespace never declared), checks the plugin knows all of them, then
// repeats RESTORE and INSERT of known, partly pinned entries.
func (s *suite) restore() (string, error) {
	idx := policytest.NewIndex()
	for _, ns := range s.ns {
		idx.AddNamespace(ns)
	}
	const undeclared = 7 // a namespace found on disk, not declared yet
	var recs []abi.AccessRecord
	for i := range uint64(restoreEntries) {
		ns := abi.NamespaceRecord{NS: undeclared, MountCount: 1}
		if i%5 != 4 {
			ns = s.ns[i%uint64(len(s.ns))]
		}
		recs = append(recs, abi.AccessRecord{Entry: 1 + i*3, Time: startTime - (i*7919)%restoreEntries*1e6,
			Size: 4096 * (1 + i%9), KeyHash: abi.KeyHash(fmt.Appendf(nil, "restored-%d", i)), Kind: abi.AccessRestore,
			Mount: uint32(i) % ns.MountCount, NS: ns.NS, Hits: uint32(i % 6)})
	}
	idx.Apply(recs)
	h, err := s.open(idx, s.opts.Shards)
	if err != nil {
		return "", fmt.Errorf("opening a host over %d stored entries: %w", restoreEntries, err)
	}
	defer h.Close(s.ctx)
	// The suite's helpers work on s.idx: point them at this index.
	saved := s.idx
	s.idx = idx
	defer func() { s.idx = saved }()

	all := abi.EvictRequest{Bytes: 1 << 62, Mount: abi.AnyMount, Time: startTime}
	expect := func(stage string, want int) error {
		for _, req := range []abi.EvictRequest{all, {Bytes: 1 << 62, Mount: 1, Time: startTime}} {
			v, err := s.victims(h, req, abi.MaxBatch)
			if err != nil {
				return fmt.Errorf("%s: %w", stage, err)
			}
			if err := s.checkVictims(v, req, abi.MaxBatch); err != nil {
				return fmt.Errorf("%s: %w", stage, err)
			}
			n, _ := s.entries(req.Mount)
			if req.Mount == abi.AnyMount {
				n = want
			}
			if len(v) != n {
				return fmt.Errorf("%s: asked to free every byte on mount %s, %d victims, want the %d unpinned entries there",
					stage, mountName(req.Mount), len(v), n)
			}
		}
		return nil
	}
	if err := expect(fmt.Sprintf("built from %d RESTORE records", restoreEntries), restoreEntries); err != nil {
		return "", err
	}
	// Pin 30 entries (15 of them twice), then send RESTORE again for every entry
	// with a new size, and INSERT again for every fourth.
	var ev []abi.AccessRecord
	pinned := map[uint64]bool{}
	idx.Range(func(e policy.Entry) bool {
		if e.ID%20 == 1 {
			ev = append(ev, s.event(e, abi.AccessPin))
			pinned[e.ID] = true
			if e.ID%40 == 1 {
				ev = append(ev, s.event(e, abi.AccessPin))
			}
		}
		return true
	})
	if err := s.access(h, ev); err != nil {
		return "", err
	}
	ev = ev[:0]
	idx.Range(func(e policy.Entry) bool {
		e.Size *= 2
		ev = append(ev, s.event(e, abi.AccessRestore))
		if e.ID%4 == 0 {
			ev = append(ev, s.event(e, abi.AccessInsert))
		}
		return true
	})
	if err := s.access(h, ev); err != nil {
		return "", err
	}
	if err := expect("after RESTORE and INSERT again of known entries, 30 of them pinned", restoreEntries-len(pinned)); err != nil {
		return "", err
	}
	// Half of the (new) bytes are covered by the new sizes.
	_, total := s.entries(abi.AnyMount)
	half := abi.EvictRequest{Bytes: total / 2, Mount: abi.AnyMount, Time: s.now}
	v, err := s.victims(h, half, abi.MaxBatch)
	if err != nil {
		return "", err
	}
	if err := s.checkVictims(v, half, abi.MaxBatch); err != nil {
		return "", fmt.Errorf("after sizes changed by RESTORE: %w", err)
	}
	if st := h.Stats(); st.Failures > 0 || st.StaleVictims > 0 {
		return "", fmt.Errorf("the restored host caught %d plugin failures and %d stale victims", st.Failures, st.StaleVictims)
	}
	return fmt.Sprintf("a host built over %d entries (some of an undeclared namespace) offers all of them; RESTORE and INSERT again update sizes, keep pins, never duplicate", restoreEntries), nil
}

// unknownEvents sends events on entries the plugin does not know, and an
// UNPIN without a PIN on one it knows.
func (s *suite) unknownEvents() (string, error) {
	// An empty cache, so that the one known entry must be a victim.
	if err := s.removeAll(); err != nil {
		return "", err
	}
	known := s.inserts(1, 0, 4096)
	if err := s.access(s.host, known); err != nil {
		return "", err
	}
	k := known[0]
	base := s.next + 1_000_000 // ids the suite never stores
	s.next = base + 10
	ghost := func(id uint64, kind uint32) abi.AccessRecord {
		s.now += 1000
		return abi.AccessRecord{Entry: id, Time: s.now, Size: 4096, KeyHash: id, Kind: kind, NS: s.ns[0].NS}
	}
	unpin := k
	unpin.Kind = abi.AccessUnpin
	recs := []abi.AccessRecord{
		ghost(base+1, abi.AccessUnpin), ghost(base+2, abi.AccessHit), ghost(base+3, abi.AccessPin),
		ghost(base+3, abi.AccessUnpin), ghost(base+3, abi.AccessUnpin), ghost(base+4, abi.AccessRemove),
		unpin, unpin,
	}
	if err := s.access(s.host, recs); err != nil {
		return "", fmt.Errorf("events on unknown entries: %w", err)
	}
	// The engine removes what it never had; the plugin forgets it.
	recs = []abi.AccessRecord{ghost(base+1, abi.AccessRemove), ghost(base+2, abi.AccessRemove), ghost(base+3, abi.AccessRemove)}
	if err := s.access(s.host, recs); err != nil {
		return "", err
	}
	req := abi.EvictRequest{Bytes: 1 << 62, Mount: abi.AnyMount, Time: s.now}
	v, err := s.victims(s.host, req, abi.MaxBatch)
	if err != nil {
		return "", err
	}
	if err := s.checkVictims(v, req, abi.MaxBatch); err != nil {
		return "", err
	}
	if !slices.ContainsFunc(v, func(x abi.Victim) bool { return x.Entry == k.Entry }) {
		return "", fmt.Errorf("entry %d, never pinned, got two UNPINs and is no longer offered as a victim: an UNPIN without PIN must be ignored", k.Entry)
	}
	return "HIT, PIN, UNPIN and REMOVE of unknown entries accepted; two UNPINs without PIN leave an entry unpinned", s.removeAll()
}

func (s *suite) removed() (string, error) {
	// The host rejects a victim the plugin was sent a REMOVE for and
	// answers from a rebuilt instance: count what it caught too.
	before := s.host.Stats().RemovedOffered
	if err := s.access(s.host, s.inserts(500, 0, 8192)); err != nil {
		return "", err
	}
	req := abi.EvictRequest{Bytes: 1 << 62, Mount: abi.AnyMount, Time: s.now}
	v, err := s.victims(s.host, req, 100)
	if err != nil {
		return "", err
	}
	gone := map[uint64]bool{}
	var recs []abi.AccessRecord
	for _, x := range v {
		e, ok := s.idx.Lookup(x.Entry)
		if !ok {
			return "", fmt.Errorf("victim %d is unknown", x.Entry)
		}
		recs = append(recs, s.event(e, abi.AccessRemove))
		gone[e.ID] = true
	}
	if err := s.access(s.host, recs); err != nil {
		return "", err
	}
	again, err := s.victims(s.host, req, abi.MaxBatch)
	if err != nil {
		return "", err
	}
	for _, x := range again {
		if gone[x.Entry] {
			return "", fmt.Errorf("entry %d was removed but is a victim again", x.Entry)
		}
	}
	if err := s.checkVictims(again, req, abi.MaxBatch); err != nil {
		return "", err
	}
	if err := s.removeAll(); err != nil {
		return "", err
	}
	v, err = s.victims(s.host, req, abi.MaxBatch)
	if err != nil {
		return "", err
	}
	if len(v) > 0 {
		return "", fmt.Errorf("every entry was removed, yet %d victims were offered", len(v))
	}
	if n := s.host.Stats().RemovedOffered - before; n > 0 {
		return "", fmt.Errorf("the plugin offered %d entries it had been sent a REMOVE for (the host rejected them and rebuilt the instance): it ignores REMOVE records", n)
	}
	return fmt.Sprintf("%d victims removed; none offered again; none once the cache is empty", len(recs)), nil
}

func (s *suite) pinned() (string, error) {
	recs := s.inserts(64, 0, 4096)
	if err := s.access(s.host, recs); err != nil {
		return "", err
	}
	// Pin 20 entries, 5 of them twice; unpin those 5 once: still pinned.
	var pins []abi.AccessRecord
	pin := func(r abi.AccessRecord, kind uint32) {
		s.now += 1000
		pins = append(pins, abi.AccessRecord{Entry: r.Entry, Time: s.now, Size: r.Size, KeyHash: r.KeyHash, Kind: kind, Mount: r.Mount, NS: r.NS})
	}
	for i := range 20 {
		pin(recs[i*3], abi.AccessPin)
	}
	for i := range 5 {
		pin(recs[i*3], abi.AccessPin)
		pin(recs[i*3], abi.AccessUnpin)
	}
	if err := s.access(s.host, pins); err != nil {
		return "", err
	}
	req := abi.EvictRequest{Bytes: 1 << 62, Mount: abi.AnyMount, Time: s.now}
	v, err := s.victims(s.host, req, abi.MaxBatch)
	if err != nil {
		return "", err
	}
	if err := s.checkVictims(v, req, abi.MaxBatch); err != nil {
		return "", err
	}
	if len(v) != 44 {
		return "", fmt.Errorf("asked for every byte with 44 unpinned entries: got %d victims", len(v))
	}
	// Unpin everything: all 64 become victims.
	pins = pins[:0]
	for i := range 20 {
		e, _ := s.idx.Lookup(recs[i*3].Entry)
		for range e.Pins {
			pin(recs[i*3], abi.AccessUnpin)
		}
	}
	if err := s.access(s.host, pins); err != nil {
		return "", err
	}
	v, err = s.victims(s.host, req, abi.MaxBatch)
	if err != nil {
		return "", err
	}
	if err := s.checkVictims(v, req, abi.MaxBatch); err != nil {
		return "", err
	}
	if len(v) != 64 {
		return "", fmt.Errorf("after unpinning every entry: %d victims, want all 64", len(v))
	}
	return "20 pinned entries (5 pinned twice, unpinned once) never offered; all 64 offered once unpinned", s.removeAll()
}

// callTiming fails the plugin if a call so far ran out of fuel, and
// reports the time of the calls against the deadline of one call.
func (s *suite) callTiming() (string, error) {
	if s.deadlineErr != nil {
		return "", s.deadlineErr
	}
	// A call that stays within its fuel but returns late was held up by
	// the machine (load, GC, -race): the host counts it as slow, not as a
	// failure, and so does the suite, so that a plugin passes or fails
	// alike on an idle machine and a loaded one.
	var parts []string
	over := 0
	for _, t := range s.timing() {
		over += t.OverDeadline
		parts = append(parts, fmt.Sprintf("%s p50 %v p99 %v max %v", strings.TrimPrefix(t.Hook, "kvhost_"), round(t.P50), round(t.P99), round(t.Max)))
	}
	msg := fmt.Sprintf("deadline %v per call: %s", s.opts.CallTimeout, strings.Join(parts, ", "))
	if over > 0 {
		msg += fmt.Sprintf("; %d calls returned after the deadline within their fuel (a loaded machine: counted as slow, not failed)", over)
	}
	return msg, nil
}

func (s *suite) rejections() (string, error) {
	st := s.host.Stats()
	var problems []string
	if st.Failures > 0 || st.Replacements > 0 {
		p := fmt.Sprintf("the host caught %d plugin failures (%d invalid outputs) and replaced %d instances", st.Failures, st.Rejections, st.Replacements)
		if f := s.fails.since(0); len(f) > 0 {
			p += fmt.Sprintf("; the first: %s (the check it happened in fails too)", f[0])
		}
		problems = append(problems, p)
	}
	if st.StaleVictims > 0 {
		problems = append(problems, fmt.Sprintf("the plugin offered %d victims that were pinned or removed in the index it had been told about (the suite reports every event before asking)", st.StaleVictims))
	}
	if len(problems) > 0 {
		return "", errors.New(strings.Join(problems, "; "))
	}
	var calls uint64
	for _, n := range st.Calls {
		calls += n
	}
	return fmt.Sprintf("%d plugin calls, no failure, no rejected output, no replacement", calls), nil
}
