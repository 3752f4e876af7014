package policy

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/internal/recent"
)

// scratchSize is the scratch area the host asks every instance for: room for
// the largest batch of any hook, the eviction area and the configuration
// (abi.ScratchSize, which docs/abi.md gives as a number).
const scratchSize = abi.ScratchSize

// The scratch area holds every input the host writes.
const _ = uint(scratchSize - max(abi.MaxBatch*abi.NameRecordSize,
	abi.EvictHeaderSize+abi.MaxBatch*abi.VictimSize,
	abi.MaxBatch*abi.AccessRecordSize,
	abi.MaxBatch*abi.AdmitRecordSize,
	abi.MaxBatch*abi.RankRecordSize,
	abi.NamespaceRecordSize,
	abi.MaxConfigLen))

// backend creates the instances of one policy implementation: a wasm module
// or a native Go policy.
type backend interface {
	// kind is "wasm" or "native".
	kind() string
	features() abi.Feature
	// newInstance returns a fresh instance whose scratch area holds
	// scratchSize bytes. The host then initialises it and rebuilds its state.
	newInstance(ctx context.Context, shard int) (instance, error)
	close(ctx context.Context) error
}

// instance is one running copy of a policy, with its own state and scratch
// area. It is used by one goroutine at a time (under its shard's lock).
type instance interface {
	// scratch returns the scratch area. The slice is valid until the next
	// call: a call may grow (and move) the instance's memory.
	scratch() []byte
	// call runs hook h with argument arg (ignored by hooks without one)
	// and returns its i32 result. An error means the instance is unusable.
	call(ctx context.Context, h hook, arg int32) (int32, error)
	close(ctx context.Context)
	// lastMessage returns, and forgets, the last warning or error the
	// plugin logged: the reason it gives for a failure status.
	lastMessage() string
}

// Host runs a placement policy — a wasm plugin (Open) or a native Go policy
// (NewNative) — as a Policy: sharded over instances, every output validated,
// failed instances replaced and rebuilt from the Index, and, after repeated
// failures, a switch to the native fallback policy. A Host is safe for
// concurrent use.
type Host struct {
	name        string
	idx         Index
	cfg         Config
	log         *slog.Logger
	initCfg     [][]byte // kvhost_init configuration per shard
	fallbackCfg [][]byte // the fallback's (nil without one); written under h.mu
	interimCfg  [][]byte // Config.Interim's, while it serves (nil otherwise)
	canFallback bool
	// loaded is closed once the module of a Host that started on
	// Config.Interim has loaded, or failed to (loadErr, written before).
	loaded  chan struct{}
	loadErr error
	stats   counters
	ledgers []ledger // per shard id; outlive a switch to the fallback

	mu struct {
		sync.RWMutex
		backend  backend
		shards   []*shard
		fallback bool   // the backend is the native fallback
		loading  bool   // the backend is Config.Interim, the module loading
		reason   string // why the fallback was taken
		closed   bool
	}
	fail struct {
		sync.Mutex
		times []time.Time // recent failures, oldest first
	}
	// mounts is the last description UpdateMounts was given, replayed to
	// every rebuilt instance of a plugin with abi.FeatureMounts.
	mounts struct {
		sync.RWMutex
		recs []abi.MountRecord
	}
	// nss is every namespace declared through Namespace, by id, replayed
	// to every rebuilt instance after the Index's: the engine marks a
	// namespace declared in its Index only once Namespace has returned,
	// so an instance rebuilt in between would not know it. A declaration
	// counts from its start (the shards before a failing one have it) and
	// is forgotten when it fails, unless one of the same namespace
	// succeeded. The host has no call to undeclare a namespace: a plugin
	// keeps those the engine releases, as the instances not rebuilt do.
	nss struct {
		sync.Mutex
		m map[uint32]nsDecl
	}
}

// nsDecl is a namespace declared through Host.Namespace.
type nsDecl struct {
	rec      abi.NamespaceRecord
	inFlight int  // declarations under way
	ok       bool // a declaration succeeded
}

// ledger is what the host has told one shard's plugin: the pins it
// delivered (AccessPin minus AccessUnpin, dropped at AccessRemove) and the
// highest entry id. The engine updates its Index before it tells the policy,
// so the Index can be ahead of what the plugin knows; the ledger is the
// plugin's side. It is guarded by the lock of the shard that has its id.
type ledger struct {
	pins     map[uint64]uint32
	maxEntry uint64
	// removed holds the last removedWindow entries the plugin was sent a
	// REMOVE for (and no INSERT or RESTORE since): offering one of them is
	// a plugin failure.
	removed recent.IDs
}

// removedWindow is how many removed entries a ledger remembers per shard
// (16 bytes each in the ring and about 40 in the map): a plugin that
// ignores REMOVE records offers the entries it last had, the ones removed
// last, so a window catches it without a set that grows with every
// eviction of the process's life.
const removedWindow = 1 << 14

func newLedger() ledger {
	return ledger{pins: map[uint64]uint32{}, removed: recent.NewIDs(removedWindow)}
}

// apply records an access record delivered to the plugin.
func (l *ledger) apply(r *abi.AccessRecord) {
	l.maxEntry = max(l.maxEntry, r.Entry)
	switch r.Kind {
	case abi.AccessPin:
		l.pins[r.Entry]++
	case abi.AccessUnpin:
		if n := l.pins[r.Entry]; n > 1 {
			l.pins[r.Entry] = n - 1
		} else {
			delete(l.pins, r.Entry)
		}
	case abi.AccessRemove:
		delete(l.pins, r.Entry)
		l.removed.Add(r.Entry)
	case abi.AccessInsert, abi.AccessRestore:
		// Told again that it exists (a late RESTORE after a rebuild):
		// the plugin may offer it; the index says whether it is stale.
		l.removed.Delete(r.Entry)
		if r.Kind == abi.AccessInsert {
			// Pins delivered before the entry's INSERT (a load that
			// pinned a file the engine indexed, and its report was
			// overtaken) were of an entry the plugin did not know,
			// which the ABI has it ignore: the plugin may offer the
			// entry, and the index says whether it is pinned.
			delete(l.pins, r.Entry)
		}
	}
}

// shard is one instance and the reusable buffers of calls on it.
type shard struct {
	id     int
	ledger *ledger
	mu     sync.Mutex
	inst   instance // nil after a failed (re)build: rebuilt on next use
	pos    []int32  // positions of the caller's records in the current batch
	seen   []uint64 // victim or move entries, for the duplicate check

	// The ops of the caller's call, reused to keep calls allocation-free.
	nsOp     namespaceOp
	nameOp   nameOp
	admitOp  admitOp
	accessOp accessOp
	evictOp  evictOp
	mountsOp mountsOp
	tickOp   tickOp
	rankOp   rankOp
}

// locked runs fn with s locked.
func (s *shard) locked(fn func() error) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return fn()
}

func newShard(id int, l *ledger) *shard {
	return &shard{id: id, ledger: l, pos: make([]int32, 0, abi.MaxBatch), seen: make([]uint64, 0, abi.MaxBatch)}
}

// switchError asks the caller to switch the Host to its fallback and retry.
type switchError struct{ cause *Error }

func (e *switchError) Error() string { return e.cause.Error() }

// Open loads a wasm policy plugin and returns a Host running it. name names
// the plugin in errors, logs and metrics. The module is compiled once (from
// cfg.CacheDir when it is warm), validated against ABI v1, and cfg.Shards
// instances are created, initialised and filled from idx before Open returns.
func Open(ctx context.Context, module []byte, name string, idx Index, cfg Config) (*Host, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if idx == nil {
		return nil, fmt.Errorf("%w: nil Index", ErrConfig)
	}
	begin := time.Now()
	if cfg.Interim == nil {
		b, err := newWasmBackend(ctx, module, name, &cfg)
		if err != nil {
			return nil, err
		}
		return startWasm(ctx, name, idx, cfg, b)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	// The module loads on its own goroutine; the caller waits for it at
	// most LoadTimeout, and gets a Host serving Interim after that.
	loaded := make(chan loadResult, 1)
	go func() {
		lcfg := cfg
		b, err := newWasmBackend(ctx, module, name, &lcfg)
		if err == nil {
			if err = b.prepare(ctx, cfg.Shards); err != nil {
				_ = b.close(ctx)
				b, err = nil, fmt.Errorf("%w: %s: %v", ErrModule, name, err)
			}
		}
		loaded <- loadResult{b: b, err: err}
	}()
	// LoadTimeout 0 serves Interim at once: not a zero timer raced
	// against a module that fails (or loads) fast, which answered either
	// way.
	if cfg.LoadTimeout > 0 {
		timer := time.NewTimer(cfg.LoadTimeout)
		defer timer.Stop()
		select {
		case res := <-loaded:
			if res.err != nil {
				return nil, res.err
			}
			return startWasm(ctx, name, idx, cfg, res.b)
		case <-ctx.Done():
			go closeLoaded(ctx, loaded)
			return nil, ctx.Err()
		case <-timer.C:
		}
	}
	interim := cfg.InterimName
	if interim == "" {
		interim = "native"
	}
	h, err := newHost(name, idx, cfg, cfg.Fallback != nil)
	if err == nil {
		h.interimCfg, err = cfg.initConfigs("InterimParams", cfg.InterimParams)
	}
	if err == nil {
		err = h.serve(ctx, newNativeBackend(cfg.Interim, name+"/"+interim, h.log), h.interimCfg)
	}
	if err != nil {
		go closeLoaded(ctx, loaded)
		return nil, err
	}
	h.mu.loading, h.loaded = true, make(chan struct{})
	h.log.Info("policy: serving the interim policy while the module loads", "interim", interim, "waited", cfg.LoadTimeout.String())
	go h.upgrade(ctx, loaded, begin)
	return h, nil
}

// closeLoaded closes the module loaded for a Host that Open did not
// return, once it has loaded.
func closeLoaded(ctx context.Context, loaded <-chan loadResult) {
	if res := <-loaded; res.b != nil {
		_ = res.b.close(context.WithoutCancel(ctx))
	}
}

// loadResult is a module loaded for a Host, or why it did not load.
type loadResult struct {
	b   *wasmBackend
	err error
}

// startWasm starts a Host on the wasm backend b, closing b if it fails.
func startWasm(ctx context.Context, name string, idx Index, cfg Config, b *wasmBackend) (*Host, error) {
	h, err := start(ctx, name, idx, cfg, b, cfg.Fallback != nil)
	if err != nil {
		_ = b.close(ctx)
		return nil, err
	}
	return h, nil
}

// upgrade waits for the module of a Host serving Config.Interim and
// switches the Host to it, rebuilt from the Index and the ledgers under
// h.mu (its instances are made ahead, outside the lock); a module that
// did not load, or whose shards fail to build, leaves Interim serving as
// the fallback.
func (h *Host) upgrade(ctx context.Context, loaded <-chan loadResult, since time.Time) {
	defer close(h.loaded)
	res := <-loaded
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.mu.closed {
		if res.b != nil {
			_ = res.b.close(context.WithoutCancel(ctx))
		}
		h.loadErr = ErrClosed
		return
	}
	err := res.err
	if err == nil {
		res.b.slow = &h.stats.slowCalls
		var shards []*shard
		if shards, err = h.buildShards(ctx, res.b, h.initCfg); err == nil {
			for _, s := range h.mu.shards {
				if s.inst != nil {
					s.inst.close(ctx)
				}
			}
			_ = h.mu.backend.close(ctx)
			h.mu.backend, h.mu.shards, h.mu.loading, h.interimCfg = res.b, shards, false, nil
			h.log.Info("policy ready: the plugin replaces the interim policy", "shards", h.cfg.Shards,
				"took", time.Since(since).String())
			return
		}
		_ = res.b.close(ctx)
	}
	h.loadErr = err
	h.mu.loading, h.mu.fallback, h.mu.reason = false, true, fmt.Sprintf("the module did not load: %v", err)
	h.fallbackCfg, h.cfg.FallbackName = h.interimCfg, h.cfg.InterimName
	h.log.Error("policy plugin did not load; the interim policy goes on serving", "err", err)
}

// WaitLoaded waits until the Host's module has loaded, when it started
// on Config.Interim, and returns why it did not load (the Host then
// goes on serving Interim), or ctx's error. It returns nil at once for
// a Host that started on its module, or a native Host.
func (h *Host) WaitLoaded(ctx context.Context) error {
	if h.loaded == nil {
		return nil
	}
	select {
	case <-h.loaded:
		return h.loadErr
	case <-ctx.Done():
		return ctx.Err()
	}
}

// NewNative returns a Host running a native Go policy: newPolicy builds the
// policy of one shard. It shares the sharding, validation and rebuilding of a
// wasm Host; cfg.Fallback, CacheDir, Cache, MemoryLimit and CallTimeout do
// not apply to it.
func NewNative(newPolicy func() guest.Policy, idx Index, cfg Config) (*Host, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if newPolicy == nil {
		return nil, fmt.Errorf("%w: nil native policy constructor", ErrConfig)
	}
	if idx == nil {
		return nil, fmt.Errorf("%w: nil Index", ErrConfig)
	}
	b := newNativeBackend(newPolicy, "native", cfg.Logger)
	return start(context.Background(), "native", idx, cfg, b, false)
}

func start(ctx context.Context, name string, idx Index, cfg Config, b backend, canFallback bool) (*Host, error) {
	h, err := newHost(name, idx, cfg, canFallback)
	if err != nil {
		return nil, err
	}
	if wb, ok := b.(*wasmBackend); ok {
		wb.slow = &h.stats.slowCalls // kept when the backend is closed
	}
	if err := h.serve(ctx, b, h.initCfg); err != nil {
		return nil, err
	}
	return h, nil
}

// newHost returns a Host with its ledgers and configurations, no backend
// yet.
func newHost(name string, idx Index, cfg Config, canFallback bool) (*Host, error) {
	h := &Host{name: name, idx: idx, cfg: cfg, log: cfg.Logger.With("policy", name), canFallback: canFallback}
	h.ledgers = make([]ledger, cfg.Shards)
	for i := range h.ledgers {
		h.ledgers[i] = newLedger()
	}
	var err error
	if h.initCfg, err = cfg.initConfigs("Params", cfg.Params); err != nil {
		return nil, err
	}
	if canFallback {
		if h.fallbackCfg, err = cfg.initConfigs("FallbackParams", cfg.FallbackParams); err != nil {
			return nil, err
		}
	}
	return h, nil
}

// serve builds the shards of b, configured with configs, and makes them
// the Host's.
func (h *Host) serve(ctx context.Context, b backend, configs [][]byte) error {
	shards, err := h.buildShards(ctx, b, configs)
	if err != nil {
		return err
	}
	h.mu.backend, h.mu.shards = b, shards
	return nil
}

// buildShards creates every shard of b, initialised with configs (one per
// shard), failing fast.
func (h *Host) buildShards(ctx context.Context, b backend, configs [][]byte) ([]*shard, error) {
	// Instances are independent: build them in parallel, since each one
	// starts its guest's runtime (a Go guest's _initialize is most of a
	// warm start).
	shards := make([]*shard, h.cfg.Shards)
	errs := make([]error, len(shards))
	var wg sync.WaitGroup
	for i := range shards {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s := newShard(i, &h.ledgers[i])
			s.inst, errs[i] = h.build(ctx, b, s, configs[i])
			shards[i] = s
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		for _, s := range shards {
			if s.inst != nil {
				s.inst.close(ctx)
			}
		}
		for _, e := range errs {
			if e != nil {
				return nil, e // the first failure, as a sequential build reports it
			}
		}
	}
	return shards, nil
}

// build creates an instance for shard s, initialises it with config and
// replays the Index into it: every namespace, then for each entry routed to
// s an AccessRestore record and one AccessPin per pin the plugin had been
// told of (the shard's ledger: a pin the engine has made but not yet
// reported arrives afterwards, and is not counted twice).
func (h *Host) build(ctx context.Context, b backend, s *shard, config []byte) (instance, error) {
	inst, err := b.newInstance(ctx, s.id)
	if err != nil {
		return nil, h.pluginError(s, "instantiate", err)
	}
	ok := false
	defer func() {
		if !ok {
			inst.close(ctx)
		}
	}()
	// build runs in the middle of a caller's call on s (a replacement):
	// it uses ops of its own, not the shard's.
	if err := h.callOnce(ctx, s, inst, hookInit, &initOp{config: config}); err != nil {
		return nil, err
	}
	if b.features().Has(abi.FeatureNamespace) {
		for _, ns := range h.namespaces() {
			if err := h.callOnce(ctx, s, inst, hookNamespace, &namespaceOp{in: ns}); err != nil {
				return nil, err
			}
		}
	}
	if b.features().Has(abi.FeatureMounts) {
		if mounts := h.mountRecords(); len(mounts) > 0 {
			if err := h.callOnce(ctx, s, inst, hookMounts, &mountsOp{recs: mounts}); err != nil {
				return nil, err
			}
		}
	}
	var recs []abi.AccessRecord
	h.idx.Range(func(e Entry) bool {
		if route(e.ID, h.cfg.Shards) != s.id {
			return true
		}
		r := abi.AccessRecord{Entry: e.ID, Time: e.LastAccess, Size: e.Size, KeyHash: e.KeyHash,
			Kind: abi.AccessRestore, Mount: e.Mount, NS: e.NS, Hits: e.Hits}
		recs = append(recs, r)
		r.Kind, r.Hits = abi.AccessPin, 0
		for range s.ledger.pins[e.ID] {
			recs = append(recs, r)
		}
		return true
	})
	for len(recs) > 0 {
		k := min(len(recs), abi.MaxBatch)
		if err := h.callOnce(ctx, s, inst, hookAccess, &accessOp{recs: recs[:k], all: true}); err != nil {
			return nil, err
		}
		recs = recs[k:]
	}
	ok = true
	return inst, nil
}

// callOnce runs one hook call: op writes its input into the scratch area,
// the hook runs, and op validates and consumes the output.
func (h *Host) callOnce(ctx context.Context, s *shard, inst instance, hk hook, op batchOp) error {
	arg := op.write(s, inst.scratch())
	n := op.records(s)
	h.stats.calls[hk].Add(1)
	h.stats.records[hk].Add(uint64(n))
	var start time.Time
	if h.cfg.OnCall != nil {
		start = time.Now()
	}
	inst.lastMessage() // an earlier call's warning is no reason for this call's status
	st, err := inst.call(ctx, hk, arg)
	if h.cfg.OnCall != nil {
		h.cfg.OnCall(hk.String(), n, time.Since(start))
	}
	if err != nil {
		return h.pluginError(s, hk.String(), err)
	}
	if st < 0 {
		if msg := inst.lastMessage(); msg != "" {
			return h.pluginError(s, hk.String(), fmt.Errorf("returned status %d (%s): %s", st, abi.Status(st), msg))
		}
		return h.pluginError(s, hk.String(), fmt.Errorf("returned status %d (%s)", st, abi.Status(st)))
	}
	if err := op.read(h, s, inst.scratch(), st); err != nil {
		h.stats.rejections.Add(1)
		return h.pluginError(s, hk.String(), err)
	}
	return nil
}

func (h *Host) pluginError(s *shard, hook string, err error) *Error {
	return &Error{Plugin: h.name, Hook: hook, Shard: s.id, Err: err}
}

// invoke runs op on shard s (locked by the caller, as is h.mu for reading),
// replacing a failed instance and retrying the call once on the replacement.
// It returns a *switchError when the failure should switch the Host to its
// fallback.
func (h *Host) invoke(ctx context.Context, s *shard, hk hook, op batchOp) error {
	var last error
	for attempt := range 2 {
		built := false
		if s.inst == nil {
			h.stats.replacements.Add(1)
			built = true
			configs := h.initCfg
			switch {
			case h.mu.loading:
				configs = h.interimCfg
			case h.mu.fallback:
				configs = h.fallbackCfg
			}
			inst, err := h.build(ctx, h.mu.backend, s, configs[s.id])
			if err != nil {
				if cerr := callerDone(ctx); cerr != nil && notMade(err) {
					return cerr
				}
				if sw := h.failed(err.(*Error)); sw != nil {
					return sw
				}
				return err
			}
			s.inst = inst
		}
		if built && hk == hookAccess || attempt > 0 && hk == hookMounts {
			// The instance was built from the Index and the ledger, which
			// already hold these records (routed records a batch in the
			// ledger before invoke): sending them again would count their
			// pins twice. (Mount descriptions are replayed by build too.)
			return nil
		}
		err := h.callOnce(ctx, s, s.inst, hk, op)
		if err == nil {
			return nil
		}
		cerr := callerDone(ctx)
		if cerr != nil && notMade(err) {
			// The caller gave up before the call: the instance never ran
			// and is kept.
			return fmt.Errorf("policy %s: %s: %w", h.name, hk, cerr)
		}
		s.inst.close(ctx)
		s.inst = nil
		// The call ran and failed: the plugin's failure, whatever became
		// of the caller meanwhile, since nothing but its fuel ends a call.
		if sw := h.failed(err.(*Error)); sw != nil {
			return sw
		}
		if cerr != nil {
			// No retry for a caller that gave up; the instance is rebuilt
			// on next use.
			return fmt.Errorf("policy %s: %s: %w", h.name, hk, cerr)
		}
		last = err
	}
	return last
}

// notMade reports whether err is a call's refusal to start because its
// caller's context was done (wasmInstance.callFn checks it before each
// call): no fault of the plugin. A call that started is never cut short
// by its context, so any other error is the plugin's.
func notMade(err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}

// callerDone returns the caller's context error, or
// context.DeadlineExceeded once its deadline has passed: a plugin call holds
// its goroutine's processor until it returns, which can delay the timer
// that sets ctx.Err.
func callerDone(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if d, ok := ctx.Deadline(); ok && !time.Now().Before(d) {
		return context.DeadlineExceeded
	}
	return nil
}

// failed counts and logs a plugin failure and reports whether it should
// switch the Host to its fallback.
func (h *Host) failed(e *Error) *switchError {
	h.stats.failures.Add(1)
	h.log.Warn("policy plugin failed; replacing the instance", "hook", e.Hook, "shard", e.Shard, "err", e.Err)
	if !h.canFallback || h.mu.fallback || h.mu.loading {
		return nil
	}
	now := time.Now()
	h.fail.Lock()
	defer h.fail.Unlock()
	cut := 0
	for cut < len(h.fail.times) && now.Sub(h.fail.times[cut]) > h.cfg.FailureWindow {
		cut++
	}
	h.fail.times = append(h.fail.times[:0], h.fail.times[cut:]...)
	h.fail.times = append(h.fail.times, now)
	if len(h.fail.times) < h.cfg.MaxFailures {
		return nil
	}
	return &switchError{cause: e}
}

// switchToFallback replaces every wasm shard by a native shard of
// cfg.Fallback, rebuilt from the Index.
func (h *Host) switchToFallback(ctx context.Context, cause *Error) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.mu.closed {
		return ErrClosed
	}
	if h.mu.fallback {
		return nil
	}
	nb := newNativeBackend(h.cfg.Fallback, h.name+"/fallback", h.log)
	shards, err := h.buildShards(ctx, nb, h.fallbackCfg)
	if err != nil && len(h.cfg.FallbackParams) > 0 {
		// The plugin's values of keys the fallback shares with it may
		// not suit the fallback: its defaults do.
		h.log.Error("the fallback policy refuses its params; running it with its defaults", "fallback", h.fallbackName(), "err", err)
		bare, berr := h.cfg.initConfigs("FallbackParams", nil)
		if berr != nil {
			return berr
		}
		if shards, err = h.buildShards(ctx, nb, bare); err == nil {
			h.fallbackCfg = bare
		}
	}
	if err != nil {
		return fmt.Errorf("policy %s: switching to the fallback policy after %q: %w", h.name, cause, err)
	}
	for _, s := range h.mu.shards {
		if s.inst != nil {
			s.inst.close(ctx)
		}
	}
	_ = h.mu.backend.close(ctx)
	h.mu.backend, h.mu.shards, h.mu.fallback, h.mu.reason = nb, shards, true, cause.Error()
	h.log.Error("policy plugin disabled; using the native fallback policy", "fallback", h.fallbackName(),
		"failures", h.cfg.MaxFailures, "window", h.cfg.FailureWindow, "reason", cause.Error())
	return nil
}

// fallbackName is Config.FallbackName with its default (InterimName once
// the interim policy serves as the fallback). Call it under h.mu.
func (h *Host) fallbackName() string {
	if h.cfg.FallbackName == "" {
		return "native"
	}
	return h.cfg.FallbackName
}

// withShards runs fn over the current shards, switching to the fallback and
// running fn again when fn asks for it.
func (h *Host) withShards(ctx context.Context, fn func(shards []*shard) error) error {
	return h.withShardsOnce(ctx, fn, true)
}

// withShardsOnce is withShards; with rerun false, fn is not run again after
// the switch (the fallback is built from the Index and the ledgers, which
// already hold what fn reported).
func (h *Host) withShardsOnce(ctx context.Context, fn func(shards []*shard) error, rerun bool) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	for {
		err := h.readLocked(fn)
		sw, ok := err.(*switchError)
		if !ok {
			return err
		}
		if err := h.switchToFallback(ctx, sw.cause); err != nil {
			return err
		}
		if !rerun {
			return nil
		}
	}
}

// readLocked runs fn over the shards under h.mu's read lock.
func (h *Host) readLocked(fn func(shards []*shard) error) error {
	h.mu.RLock()
	defer h.mu.RUnlock()
	if h.mu.closed {
		return ErrClosed
	}
	return fn(h.mu.shards)
}

// route maps a 64-bit id to one of n shards.
func route(x uint64, n int) int {
	if n <= 1 {
		return 0
	}
	// splitmix64 finaliser: KeyHash is FNV-1a, whose low bits mix poorly.
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return int(x % uint64(n))
}

// Features reports the optional hooks of the policy answering calls now.
func (h *Host) Features() abi.Feature {
	h.mu.RLock()
	defer h.mu.RUnlock()
	if h.mu.backend == nil {
		return 0
	}
	return h.mu.backend.features()
}

// Namespace implements Policy: the namespace is declared to every shard and
// every shard must choose the same layout.
func (h *Host) Namespace(ctx context.Context, rec abi.NamespaceRecord) (abi.NamespaceRecord, error) {
	if rec.ModelLen > abi.MaxModelLen {
		return rec, fmt.Errorf("%w: namespace %d: ModelLen %d > %d", ErrInput, rec.NS, rec.ModelLen, abi.MaxModelLen)
	}
	out := rec
	h.beginNamespace(rec) // from now on, a rebuilt instance is declared rec too
	err := h.withShards(ctx, func(shards []*shard) error {
		if !h.mu.backend.features().Has(abi.FeatureNamespace) {
			out.KeysPerFile, out.Order = abi.DefaultKeysPerFile, abi.DefaultOrder
			return nil
		}
		for i, s := range shards {
			var got abi.NamespaceRecord
			err := s.locked(func() error {
				s.nsOp = namespaceOp{in: rec}
				err := h.invoke(ctx, s, hookNamespace, &s.nsOp)
				got = s.nsOp.out
				return err
			})
			if err != nil {
				return err
			}
			if i == 0 {
				out.KeysPerFile, out.Order = got.KeysPerFile, got.Order
			} else if got.KeysPerFile != out.KeysPerFile || got.Order != out.Order {
				return &Error{Plugin: h.name, Hook: hookNamespace.String(), Shard: i, Err: fmt.Errorf(
					"namespace %d: layout (keys per file %d, order %d) differs from shard 0's (%d, %d): the hook must be deterministic",
					rec.NS, got.KeysPerFile, got.Order, out.KeysPerFile, out.Order)}
			}
		}
		return nil
	})
	h.endNamespace(rec, err == nil)
	return out, err
}

// beginNamespace records a declaration of rec under way.
func (h *Host) beginNamespace(rec abi.NamespaceRecord) {
	h.nss.Lock()
	defer h.nss.Unlock()
	if h.nss.m == nil {
		h.nss.m = map[uint32]nsDecl{}
	}
	d := h.nss.m[rec.NS]
	d.rec, d.inFlight = rec, d.inFlight+1
	h.nss.m[rec.NS] = d
}

// endNamespace records the end of a declaration of rec begun with
// beginNamespace, and whether it succeeded.
func (h *Host) endNamespace(rec abi.NamespaceRecord, ok bool) {
	h.nss.Lock()
	defer h.nss.Unlock()
	d := h.nss.m[rec.NS]
	d.inFlight--
	if ok {
		d.rec, d.ok = rec, true
	}
	if d.inFlight == 0 && !d.ok {
		delete(h.nss.m, rec.NS)
		return
	}
	h.nss.m[rec.NS] = d
}

// namespaces returns the namespaces a new instance is declared: the
// Index's, then those declared through Namespace that the Index does not
// list yet, by id.
func (h *Host) namespaces() []abi.NamespaceRecord {
	out := h.idx.Namespaces()
	listed := make(map[uint32]bool, len(out))
	for _, r := range out {
		listed[r.NS] = true
	}
	h.nss.Lock()
	defer h.nss.Unlock()
	var more []abi.NamespaceRecord
	for id, d := range h.nss.m {
		if !listed[id] {
			more = append(more, d.rec)
		}
	}
	slices.SortFunc(more, func(a, b abi.NamespaceRecord) int { return cmp.Compare(a.NS, b.NS) })
	return append(out, more...)
}

// Name implements Policy. Records are routed to shards by KeyHash.
func (h *Host) Name(ctx context.Context, recs []abi.NameRecord) error {
	for i := range recs {
		r := &recs[i]
		switch {
		case r.KeyLen == 0 || r.KeyLen > abi.MaxKeyLen:
			return fmt.Errorf("%w: name record %d: KeyLen %d: want 1..%d", ErrInput, i, r.KeyLen, abi.MaxKeyLen)
		case r.MountCount == 0:
			return fmt.Errorf("%w: name record %d: MountCount is 0", ErrInput, i)
		}
	}
	if len(recs) == 0 {
		return nil
	}
	return h.withShards(ctx, func(shards []*shard) error {
		for _, s := range shards {
			err := s.locked(func() error {
				s.nameOp = nameOp{recs: recs}
				defer func() { s.nameOp = nameOp{} }() // drop the caller's records
				return h.routed(ctx, s, len(shards), hookName, len(recs), func(i int) uint64 { return recs[i].KeyHash }, &s.nameOp)
			})
			if err != nil {
				return err
			}
		}
		return nil
	})
}

// Admit implements Policy. Records are routed to shards by KeyHash.
func (h *Host) Admit(ctx context.Context, recs []abi.AdmitRecord) error {
	if len(recs) == 0 {
		return nil
	}
	return h.withShards(ctx, func(shards []*shard) error {
		feats := h.mu.backend.features()
		if !feats.Has(abi.FeatureAdmit) {
			for i := range recs {
				recs[i].Admit, recs[i].Target = 1, recs[i].Mount
			}
			return nil
		}
		mounts := h.mountCount()
		for _, s := range shards {
			err := s.locked(func() error {
				s.admitOp = admitOp{recs: recs, choose: feats.Has(abi.FeatureAdmitMount), mounts: mounts}
				defer func() { s.admitOp = admitOp{} }() // drop the caller's records
				return h.routed(ctx, s, len(shards), hookAdmit, len(recs), func(i int) uint64 { return recs[i].KeyHash }, &s.admitOp)
			})
			if err != nil {
				return err
			}
		}
		return nil
	})
}

// Access implements Policy. Records are routed to shards by Entry. They are
// delivered whatever becomes of ctx: the index already holds them, and a
// shard that missed them would have to be rebuilt from it.
func (h *Host) Access(ctx context.Context, recs []abi.AccessRecord) error {
	for i := range recs {
		if k := recs[i].Kind; k < abi.AccessInsert || k > abi.AccessUnpin {
			return fmt.Errorf("%w: access record %d: unknown kind %d", ErrInput, i, k)
		}
	}
	if len(recs) == 0 {
		return nil
	}
	// A caller's cancel would leave the records in the ledgers but not in
	// the plugins, whose instances would then be rebuilt, or, before the
	// first shard, out of both: an unpin lost pins an entry for good. (A
	// context that cannot end is kept: wrapping it would allocate.)
	if ctx.Done() != nil {
		ctx = context.WithoutCancel(ctx)
	}
	return h.withShardsOnce(ctx, func(shards []*shard) error {
		// Every shard's ledger gets its records, whatever fails: a
		// shard that fails is rebuilt from its ledger on next use, and a
		// switch to the fallback builds every shard from the ledgers, so
		// a record left out of one would be lost (an unpin lost pins an
		// entry in the policy for good). After a switch the shards left
		// are only recorded: their plugin is being replaced.
		var sw *switchError
		var errs []error
		for _, s := range shards {
			err := s.locked(func() error {
				s.accessOp = accessOp{recs: recs}
				defer func() { s.accessOp = accessOp{} }() // drop the caller's records
				var skip error
				if sw != nil {
					skip = sw
				}
				return h.routedAfter(ctx, s, len(shards), hookAccess, len(recs), func(i int) uint64 { return recs[i].Entry }, &s.accessOp, skip)
			})
			if e, ok := err.(*switchError); ok {
				if sw == nil {
					sw = e
				}
				continue
			}
			if err != nil {
				errs = append(errs, err)
			}
		}
		if sw != nil {
			return sw
		}
		return errors.Join(errs...)
	}, false)
}

// routed calls hook hk on shard s (locked) with the records among n whose
// routing key, key(i), maps to s, in batches of at most abi.MaxBatch whose
// positions op finds in s.pos.
func (h *Host) routed(ctx context.Context, s *shard, nshards int, hk hook, n int, key func(int) uint64, op batchOp) error {
	return h.routedAfter(ctx, s, nshards, hk, n, key, op, nil)
}

// ledgered is a batchOp whose records the shard's ledger holds (accessOp):
// record puts the batch at s.pos in it, before the batch is sent or
// instead of it.
type ledgered interface {
	record(s *shard)
}

// routedAfter is routed after a failure, skip, where it is not nil: then,
// and from a batch that fails on, the batches of an op that is ledgered
// are only recorded in the ledger (the instance that failed is rebuilt
// from it), and other ops stop at once. It returns skip or the first
// failure.
func (h *Host) routedAfter(ctx context.Context, s *shard, nshards int, hk hook, n int, key func(int) uint64, op batchOp, skip error) error {
	l, isLedgered := op.(ledgered)
	err := skip
	flush := func() {
		if isLedgered {
			l.record(s)
		}
		if err == nil && len(s.pos) > 0 {
			err = h.invoke(ctx, s, hk, op)
		}
		s.pos = s.pos[:0]
	}
	s.pos = s.pos[:0]
	for i := range n {
		if route(key(i), nshards) != s.id {
			continue
		}
		s.pos = append(s.pos, int32(i))
		if len(s.pos) == abi.MaxBatch {
			flush()
			if err != nil && !isLedgered {
				return err
			}
		}
	}
	if len(s.pos) > 0 {
		flush()
	}
	return err
}

// Victims implements Policy: every shard proposes up to max victims, the
// host validates them and returns the lowest scores of all, ties broken by
// entry.
//
// It reads no targets, even from a plugin with abi.FeatureDemote: its
// caller deletes the victims, so the targets the plugin wrote are neither
// used nor checked (Evictions checks them).
func (h *Host) Victims(ctx context.Context, req abi.EvictRequest, max int) ([]abi.Victim, error) {
	evs, err := h.evictions(ctx, req, max, false)
	if err != nil || len(evs) == 0 {
		return nil, err
	}
	out := make([]abi.Victim, len(evs))
	for i := range evs {
		out[i] = evs[i].Victim
	}
	return out, nil
}

// Evictions implements Tiering: Victims with each victim's target. A
// target other than NoMount before the first UpdateMounts is a failure of
// the plugin (it demotes before knowing the mounts).
func (h *Host) Evictions(ctx context.Context, req abi.EvictRequest, max int) ([]Eviction, error) {
	return h.evictions(ctx, req, max, true)
}

// evictions asks every shard for victims, and for their targets when
// targets is set and the plugin has abi.FeatureDemote.
func (h *Host) evictions(ctx context.Context, req abi.EvictRequest, max int, targets bool) ([]Eviction, error) {
	if max < 0 {
		return nil, fmt.Errorf("%w: victims: max %d < 0", ErrInput, max)
	}
	if max == 0 {
		return nil, ctx.Err()
	}
	per := min(max, abi.MaxBatch)
	mounts := h.mountCount()
	var out []Eviction
	err := h.withShards(ctx, func(shards []*shard) error {
		out = make([]Eviction, 0, per*len(shards))
		demote := targets && h.mu.backend.features().Has(abi.FeatureDemote)
		for _, s := range shards {
			err := s.locked(func() error {
				s.evictOp = evictOp{req: req, max: int32(per), out: &out, base: len(out), nshards: len(shards), demote: demote, mounts: mounts}
				defer func() { s.evictOp = evictOp{} }()
				return h.invoke(ctx, s, hookEvict, &s.evictOp)
			})
			if err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	slices.SortFunc(out, func(a, b Eviction) int {
		switch {
		case a.Score != b.Score:
			return cmpU64(a.Score, b.Score)
		default:
			return cmpU64(a.Entry, b.Entry)
		}
	})
	if len(out) > max {
		out = out[:max]
	}
	return out, nil
}

func cmpU64(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// UpdateMounts implements Tiering: it keeps recs (every mount, in index
// order) and sends them to every shard of a plugin with abi.FeatureMounts.
func (h *Host) UpdateMounts(ctx context.Context, recs []abi.MountRecord) error {
	if len(recs) == 0 || len(recs) > abi.MaxMounts {
		return fmt.Errorf("%w: mounts: %d records: want 1..%d", ErrInput, len(recs), abi.MaxMounts)
	}
	for i := range recs {
		if recs[i].Mount != uint32(i) {
			return fmt.Errorf("%w: mount record %d has Mount %d: records go in index order", ErrInput, i, recs[i].Mount)
		}
	}
	h.mounts.Lock()
	h.mounts.recs = slices.Clone(recs)
	h.mounts.Unlock()
	return h.withShardsOnce(ctx, func(shards []*shard) error {
		if !h.mu.backend.features().Has(abi.FeatureMounts) {
			return nil
		}
		for _, s := range shards {
			err := s.locked(func() error {
				s.mountsOp = mountsOp{recs: recs}
				defer func() { s.mountsOp = mountsOp{} }()
				return h.invoke(ctx, s, hookMounts, &s.mountsOp)
			})
			if err != nil {
				return err
			}
		}
		return nil
	}, false)
}

// mountRecords returns the last mount description (nil before the first).
func (h *Host) mountRecords() []abi.MountRecord {
	h.mounts.RLock()
	defer h.mounts.RUnlock()
	return h.mounts.recs
}

// mountCount is the number of mounts described, 0 before UpdateMounts.
func (h *Host) mountCount() int {
	h.mounts.RLock()
	defer h.mounts.RUnlock()
	return len(h.mounts.recs)
}

// Tick implements Tiering: kvhost_tick on every shard of a plugin with
// abi.FeatureTick; the validated moves of all shards, in shard order.
func (h *Host) Tick(ctx context.Context, req abi.TickRequest, max int) ([]abi.Move, error) {
	if max < 0 {
		return nil, fmt.Errorf("%w: tick: max %d < 0", ErrInput, max)
	}
	if max == 0 {
		return nil, ctx.Err()
	}
	per := min(max, abi.MaxBatch)
	mounts := h.mountCount()
	var out []abi.Move
	err := h.withShards(ctx, func(shards []*shard) error {
		out = out[:0]
		if !h.mu.backend.features().Has(abi.FeatureTick) {
			return nil
		}
		for _, s := range shards {
			err := s.locked(func() error {
				s.tickOp = tickOp{req: req, max: int32(per), out: &out, base: len(out), nshards: len(shards), mounts: mounts}
				defer func() { s.tickOp = tickOp{} }()
				return h.invoke(ctx, s, hookTick, &s.tickOp)
			})
			if err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// Rank implements Ranker: records are routed to shards by Entry, the
// shard that was told of the entry. Without abi.FeatureRank every record
// is abi.RankUnknown.
func (h *Host) Rank(ctx context.Context, recs []abi.RankRecord) error {
	if len(recs) == 0 {
		return nil
	}
	return h.withShards(ctx, func(shards []*shard) error {
		if !h.mu.backend.features().Has(abi.FeatureRank) {
			for i := range recs {
				recs[i].Rank, recs[i].State = 0, abi.RankUnknown
			}
			return nil
		}
		for _, s := range shards {
			err := s.locked(func() error {
				s.rankOp = rankOp{recs: recs}
				defer func() { s.rankOp = rankOp{} }() // drop the caller's records
				return h.routed(ctx, s, len(shards), hookRank, len(recs), func(i int) uint64 { return recs[i].Entry }, &s.rankOp)
			})
			if err != nil {
				return err
			}
		}
		return nil
	})
}

// Shards returns the number of instances the policy state is spread over.
func (h *Host) Shards() int { return h.cfg.Shards }

// Stats returns the Host's counters.
func (h *Host) Stats() Stats {
	s := h.stats.snapshot()
	h.mu.RLock()
	defer h.mu.RUnlock()
	s.Fallback, s.FallbackReason, s.Loading = h.mu.fallback, h.mu.reason, h.mu.loading
	if s.Fallback {
		s.FallbackPolicy = h.fallbackName()
	}
	if h.mu.backend != nil {
		s.Backend = h.mu.backend.kind()
	}
	return s
}

// Close implements Policy: it closes every instance and the runtime.
// A Host still loading its module (Config.Interim) waits for the load to
// end, which cannot be cut short, and closes the module too, so that
// nothing of the Host runs on, or writes to the compilation cache, after
// Close.
func (h *Host) Close(ctx context.Context) error {
	err := h.close(ctx)
	if h.loaded != nil {
		<-h.loaded
	}
	return err
}

func (h *Host) close(ctx context.Context) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.mu.closed {
		return nil
	}
	h.mu.closed = true
	for _, s := range h.mu.shards {
		s.mu.Lock()
		if s.inst != nil {
			s.inst.close(ctx)
			s.inst = nil
		}
		s.mu.Unlock()
	}
	err := h.mu.backend.close(ctx)
	h.mu.backend, h.mu.shards = nil, nil
	return err
}

var (
	_ Policy  = (*Host)(nil)
	_ Tiering = (*Host)(nil)
	_ Ranker  = (*Host)(nil)
)
