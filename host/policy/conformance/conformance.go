// Package conformance is the conformance suite of kvhost policy plugins: it
// loads a module in the policy host and drives it through the situations
// the storage engine creates — batch edge cases, varied keys, several
// namespaces and mounts, capacity pressure, pinned and removed entries — and
// checks every answer. A vendor runs it in CI with `kvhost policy test
// FILE.wasm`; kvhost's own tests run it on every built-in plugin.
//
// The host rejects any invalid output (a path escaping the cache root, an
// unknown or pinned victim, a failure status, a trap or an overrun); the
// suite counts a single rejection as a failure and reports the host's
// message.
package conformance

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"

	"github.com/tetratelabs/wazero"

	"github.com/kvhost/kvhost/abi"
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
	MemoryLimit int64
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
	Name     string
	OK       bool
	Message  string // why it failed, or what it established
	Duration time.Duration
}

// Report is the result of a run.
type Report struct {
	Plugin string
	// Info describes the module (what `kvhost policy inspect` prints).
	Info   policy.Info
	Checks []Check
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

// WriteTo writes the report for humans: one line per check, then a summary.
func (r Report) WriteTo(w io.Writer) (int64, error) {
	var b strings.Builder
	passed := 0
	for _, c := range r.Checks {
		mark := "FAIL"
		if c.OK {
			mark, passed = "ok  ", passed+1
		}
		fmt.Fprintf(&b, "%s %-22s %8s  %s\n", mark, c.Name, c.Duration.Round(time.Millisecond), c.Message)
	}
	verdict := "PASS"
	if !r.OK() {
		verdict = "FAIL"
	}
	fmt.Fprintf(&b, "%s: %s: %d passed, %d failed\n", verdict, r.Plugin, passed, len(r.Checks)-passed)
	n, err := io.WriteString(w, b.String())
	return int64(n), err
}

// Run runs the suite on module. It never panics on a hostile module: every
// problem is a failed check in the Report.
func Run(ctx context.Context, module []byte, opts Options) Report {
	if opts.Name == "" {
		opts.Name = "plugin"
	}
	if opts.Shards == 0 {
		opts.Shards = 2
	}
	if opts.Entries <= 0 {
		opts.Entries = 4000
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Cache == nil {
		cache := wazero.NewCompilationCache()
		defer cache.Close(ctx)
		opts.Cache = cache
	}
	s := &suite{ctx: ctx, module: module, opts: opts, report: Report{Plugin: opts.Name}}
	s.run()
	return s.report
}

// suite is the state of one run.
type suite struct {
	ctx    context.Context
	module []byte
	opts   Options
	report Report

	host *policy.Host
	idx  *policytest.Index
	ns   []abi.NamespaceRecord // declared, with their layouts
	next uint64                // next entry id
	now  uint64                // the clock of the records
	// slowest is the slowest host call and its hook.
	slowest     time.Duration
	slowestHook string
	deadlineErr error
}

func (s *suite) config() policy.Config {
	return policy.Config{Shards: s.opts.Shards, CallTimeout: s.opts.CallTimeout, MemoryLimit: s.opts.MemoryLimit,
		Params: s.opts.Params, Cache: s.opts.Cache, Logger: s.opts.Logger}
}

func (s *suite) check(name string, fn func() (string, error)) bool {
	start := time.Now()
	msg, err := fn()
	c := Check{Name: name, OK: err == nil, Message: msg, Duration: time.Since(start)}
	if err != nil {
		c.Message = err.Error()
	}
	s.report.Checks = append(s.report.Checks, c)
	return c.OK
}

func (s *suite) run() {
	if !s.check("load", s.load) {
		return
	}
	defer s.host.Close(s.ctx)
	s.check("namespaces", s.namespaces)
	s.check("batch sizes", s.batches)
	s.check("names", s.names)
	s.check("determinism", s.determinism)
	s.check("capacity pressure", s.capacity)
	s.check("removed entries", s.removed)
	s.check("pinned entries", s.pinned)
	s.check("deadline", s.deadline)
	s.check("no host rejections", s.rejections)
}

// timed runs one host call and keeps the slowest.
func (s *suite) timed(hook string, fn func() error) error {
	start := time.Now()
	err := fn()
	if d := time.Since(start); d > s.slowest {
		s.slowest, s.slowestHook = d, hook
	}
	if err != nil && strings.Contains(err.Error(), "deadline") && s.deadlineErr == nil {
		s.deadlineErr = err
	}
	return err
}

func (s *suite) load() (string, error) {
	info, err := policy.Inspect(s.ctx, s.module)
	s.report.Info = info
	if err != nil {
		return "", err
	}
	if !info.OK() {
		return "", fmt.Errorf("not an ABI v%d plugin: %s", abi.Version, strings.Join(info.Problems, "; "))
	}
	s.idx = policytest.NewIndex()
	h, err := policy.Open(s.ctx, s.module, s.opts.Name, s.idx, s.config())
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
		err := s.timed("namespace", func() (err error) { out, err = s.host.Namespace(s.ctx, in); return err })
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

func (s *suite) name(recs []abi.NameRecord) error {
	return s.timed("name", func() error { return s.host.Name(s.ctx, recs) })
}

func (s *suite) batches() (string, error) {
	if len(s.ns) == 0 {
		return "", fmt.Errorf("no namespace declared")
	}
	ns := s.ns[0]
	for _, n := range []int{0, 1, 2, abi.MaxBatch, abi.MaxBatch + 1} {
		recs := make([]abi.NameRecord, n)
		for i, k := range keys(n, 7) {
			recs[i] = nameRecord(ns, k)
		}
		if err := s.name(recs); err != nil {
			return "", fmt.Errorf("name batch of %d: %w", n, err)
		}
		// The same keys one at a time get the same names.
		for _, i := range []int{0, n / 2, n - 1} {
			if i < 0 || i >= n {
				continue
			}
			one := []abi.NameRecord{nameRecord(ns, recs[i].Key())}
			if err := s.name(one); err != nil {
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
		if err := s.access(recs); err != nil {
			return "", fmt.Errorf("access batch of %d: %w", n, err)
		}
	}
	for _, max := range []int{0, 1, abi.MaxBatch} {
		v, err := s.victims(abi.EvictRequest{Bytes: 1 << 62, Mount: abi.AnyMount}, max)
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

func (s *suite) names() (string, error) {
	var recs []abi.NameRecord
	long := make([]byte, abi.MaxKeyLen)
	for i := range long {
		long[i] = 0xff - byte(i)
	}
	binary := make([]byte, 32)
	for i := range binary {
		binary[i] = byte(i * 37) // includes 0x00, '/', '.', bytes >= 0x80
	}
	special := [][]byte{{0}, {'.'}, []byte(".."), []byte("../../etc/passwd"), []byte("/abs"), binary, long, []byte("a key with spaces")}
	for _, ns := range s.ns {
		for _, k := range special {
			recs = append(recs, nameRecord(ns, k))
		}
		for _, k := range keys(200, byte(ns.NS)) {
			recs = append(recs, nameRecord(ns, k))
		}
	}
	if err := s.name(recs); err != nil {
		return "", err
	}
	// Distinct keys of a namespace with one key per file need distinct files.
	seen := map[string]int{}
	for i, r := range recs {
		if s.layout(r.NS).KeysPerFile != 1 {
			continue
		}
		f := fmt.Sprintf("%d:%s", r.Mount, r.Path())
		if j, dup := seen[f]; dup && string(recs[j].Key()) != string(r.Key()) {
			return "", fmt.Errorf("keys %x and %x of namespace %d (one key per file) share the file %s",
				recs[j].Key(), r.Key(), r.NS, f)
		}
		seen[f] = i
	}
	mounts := map[uint32]bool{}
	for _, r := range recs {
		mounts[r.Mount] = true
	}
	return fmt.Sprintf("%d keys in %d namespaces (1-byte, binary, %d-byte, dot and slash keys): valid, distinct paths on %d mounts",
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
// (varied), applied to the index.
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

// access applies recs to the index (as the engine does first) and reports
// them to the plugin.
func (s *suite) access(recs []abi.AccessRecord) error {
	s.idx.Apply(recs)
	return s.timed("access", func() error { return s.host.Access(s.ctx, recs) })
}

func (s *suite) victims(req abi.EvictRequest, max int) ([]abi.Victim, error) {
	var v []abi.Victim
	err := s.timed("victims", func() (err error) { v, err = s.host.Victims(s.ctx, req, max); return err })
	return v, err
}

// removeAll removes every entry of the index.
func (s *suite) removeAll() error {
	var recs []abi.AccessRecord
	s.idx.Range(func(e policy.Entry) bool {
		s.now += 1000
		recs = append(recs, abi.AccessRecord{Entry: e.ID, Time: s.now, Size: e.Size, KeyHash: e.KeyHash,
			Kind: abi.AccessRemove, Mount: e.Mount, NS: e.NS})
		return true
	})
	return s.access(recs)
}

// entries returns the index's entries that match mount.
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

// checkVictims checks victims against the index and that they cover want
// bytes when the eligible entries do.
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

func (s *suite) capacity() (string, error) {
	n := s.opts.Entries
	for start := 0; start < n; start += abi.MaxBatch {
		recs := s.inserts(min(abi.MaxBatch, n-start), uint32(start/abi.MaxBatch), 64<<10)
		if err := s.access(recs); err != nil {
			return "", err
		}
	}
	// Hits on every tenth entry.
	var hits []abi.AccessRecord
	s.idx.Range(func(e policy.Entry) bool {
		if e.ID%10 == 0 {
			s.now += 1000
			hits = append(hits, abi.AccessRecord{Entry: e.ID, Time: s.now, Size: e.Size, KeyHash: e.KeyHash,
				Kind: abi.AccessHit, Mount: e.Mount, NS: e.NS})
		}
		return true
	})
	if err := s.access(hits); err != nil {
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
		v, err := s.victims(req, abi.MaxBatch)
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

func (s *suite) removed() (string, error) {
	req := abi.EvictRequest{Bytes: 1 << 62, Mount: abi.AnyMount, Time: s.now}
	v, err := s.victims(req, abi.MaxBatch)
	if err != nil {
		return "", err
	}
	gone := map[uint64]bool{}
	var recs []abi.AccessRecord
	for _, x := range v {
		e, _ := s.idx.Lookup(x.Entry)
		s.now += 1000
		recs = append(recs, abi.AccessRecord{Entry: e.ID, Time: s.now, Size: e.Size, KeyHash: e.KeyHash,
			Kind: abi.AccessRemove, Mount: e.Mount, NS: e.NS})
		gone[e.ID] = true
	}
	if err := s.access(recs); err != nil {
		return "", err
	}
	again, err := s.victims(req, abi.MaxBatch)
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
	v, err = s.victims(req, abi.MaxBatch)
	if err != nil {
		return "", err
	}
	if len(v) > 0 {
		return "", fmt.Errorf("every entry was removed, yet %d victims were offered", len(v))
	}
	return fmt.Sprintf("%d victims removed; none offered again; none once the cache is empty", len(recs)), nil
}

func (s *suite) pinned() (string, error) {
	recs := s.inserts(64, 0, 4096)
	if err := s.access(recs); err != nil {
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
	if err := s.access(pins); err != nil {
		return "", err
	}
	req := abi.EvictRequest{Bytes: 1 << 62, Mount: abi.AnyMount, Time: s.now}
	v, err := s.victims(req, abi.MaxBatch)
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
	if err := s.access(pins); err != nil {
		return "", err
	}
	v, err = s.victims(req, abi.MaxBatch)
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

// determinism runs the same inputs through two fresh hosts.
func (s *suite) determinism() (string, error) {
	type result struct {
		names   []string
		victims []abi.Victim
	}
	runOnce := func() (result, error) {
		var res result
		idx := policytest.NewIndex()
		h, err := policy.Open(s.ctx, s.module, s.opts.Name, idx, s.config())
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
		var recs []abi.NameRecord
		for _, ns := range namespaceFixtures() {
			for _, k := range keys(300, 99) {
				recs = append(recs, nameRecord(ns, k))
			}
		}
		if err := h.Name(s.ctx, recs); err != nil {
			return res, err
		}
		for _, r := range recs {
			res.names = append(res.names, fmt.Sprintf("%d:%s", r.Mount, r.Path()))
		}
		var acc []abi.AccessRecord
		for i := range uint64(2000) {
			acc = append(acc, abi.AccessRecord{Entry: i + 1, Time: 1e9 + i*7919%2000, Size: 4096 * (1 + i%5),
				KeyHash: abi.KeyHash([]byte{byte(i), byte(i >> 8)}), Kind: abi.AccessInsert, Mount: uint32(i % 2)})
		}
		for i := uint64(0); i < 2000; i += 3 {
			acc = append(acc, abi.AccessRecord{Entry: i + 1, Time: 2e9 + i, Kind: abi.AccessHit, Mount: uint32(i % 2)})
		}
		idx.Apply(acc)
		if err := h.Access(s.ctx, acc); err != nil {
			return res, err
		}
		res.victims, err = h.Victims(s.ctx, abi.EvictRequest{Bytes: 2 << 20, Mount: abi.AnyMount, Time: 3e9}, abi.MaxBatch)
		if err != nil {
			return res, err
		}
		if st := h.Stats(); st.Failures > 0 {
			return res, fmt.Errorf("%d plugin failures in a fresh host", st.Failures)
		}
		return res, nil
	}
	a, err := runOnce()
	if err != nil {
		return "", fmt.Errorf("first host: %w", err)
	}
	b, err := runOnce()
	if err != nil {
		return "", fmt.Errorf("second host: %w", err)
	}
	for i := range a.names {
		if a.names[i] != b.names[i] {
			return "", fmt.Errorf("name %d: %s in one host, %s in another", i, a.names[i], b.names[i])
		}
	}
	if len(a.victims) != len(b.victims) {
		return "", fmt.Errorf("%d victims in one host, %d in another", len(a.victims), len(b.victims))
	}
	for i := range a.victims {
		if a.victims[i] != b.victims[i] {
			return "", fmt.Errorf("victim %d: %+v in one host, %+v in another", i, a.victims[i], b.victims[i])
		}
	}
	return fmt.Sprintf("two fresh hosts: same %d names, same %d victims", len(a.names), len(a.victims)), nil
}

func (s *suite) deadline() (string, error) {
	timeout := s.opts.CallTimeout
	if timeout == 0 {
		timeout = policy.DefaultCallTimeout
	}
	if s.deadlineErr != nil {
		return "", s.deadlineErr
	}
	return fmt.Sprintf("slowest host call: %s %v (deadline %v per plugin call)", s.slowestHook, s.slowest.Round(time.Microsecond), timeout), nil
}

func (s *suite) rejections() (string, error) {
	st := s.host.Stats()
	if st.StaleVictims > 0 {
		return "", fmt.Errorf("the plugin offered %d victims that were pinned or removed in the index it had been told about (the suite reports every event before asking)", st.StaleVictims)
	}
	if st.Failures > 0 || st.Replacements > 0 {
		return "", fmt.Errorf("the host caught %d plugin failures (%d invalid outputs) and replaced %d instances; see the failed checks above",
			st.Failures, st.Rejections, st.Replacements)
	}
	var calls uint64
	for _, n := range st.Calls {
		calls += n
	}
	return fmt.Sprintf("%d plugin calls, no failure, no rejected output, no replacement", calls), nil
}
