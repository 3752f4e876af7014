//go:build invariants

package engine

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/engine/removals"
	"github.com/kvhost/kvhost/internal/testwait"
)

// lateCalls counts what reaches a policy or a file system after Close
// returned: nothing should.
type lateCalls struct {
	closed atomic.Bool // Close returned
	policy atomic.Int64
	files  atomic.Int64
	mu     sync.Mutex
	what   []string
}

func (l *lateCalls) note(n *atomic.Int64, what string) {
	if !l.closed.Load() {
		return
	}
	n.Add(1)
	l.mu.Lock()
	l.what = append(l.what, what)
	l.mu.Unlock()
}

func (l *lateCalls) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.what, ", ")
}

// latePolicy is a testPolicy that notes every call made after Close
// returned.
type latePolicy struct {
	*testPolicy
	late *lateCalls
}

func (p latePolicy) Namespace(ctx context.Context, rec abi.NamespaceRecord) (abi.NamespaceRecord, error) {
	p.late.note(&p.late.policy, "policy namespace")
	return p.testPolicy.Namespace(ctx, rec)
}

func (p latePolicy) Name(ctx context.Context, recs []abi.NameRecord) error {
	p.late.note(&p.late.policy, "policy name")
	return p.testPolicy.Name(ctx, recs)
}

func (p latePolicy) Access(ctx context.Context, recs []abi.AccessRecord) error {
	p.late.note(&p.late.policy, "policy access")
	return p.testPolicy.Access(ctx, recs)
}

func (p latePolicy) Victims(ctx context.Context, req abi.EvictRequest, max int) ([]abi.Victim, error) {
	p.late.note(&p.late.policy, "policy victims")
	return p.testPolicy.Victims(ctx, req, max)
}

// heldStat holds the first stat of one path, once armed, until release
// says so; every operation after Close returned is noted.
type heldStat struct {
	late    *lateCalls
	path    atomic.Value // string: the path whose stat is held
	reached chan struct{}
	once    sync.Once
	release func() bool // polled while the stat is held
	t       testing.TB
}

func (h *heldStat) Inject(op fsys.Op, path string) fsys.Fault {
	h.late.note(&h.late.files, op.String()+" "+filepath.Base(path))
	if p, _ := h.path.Load().(string); op == fsys.OpStat && path == p {
		held := false
		h.once.Do(func() { held = true })
		if held {
			close(h.reached)
			testwait.Until(h.t, "the held stat's release", testwait.Hang, h.release)
		}
	}
	return fsys.Fault{}
}

// TestACallRacingCloseEndsBeforeCloseReturns: a Lookup that passed
// Close's check and is held in its file's stat (a slow file system) when
// Close begins is waited for: Close returns only after it, so the lookup
// never reaches the closed policy nor the mount once Close has returned
// (a new daemon may own the directory by then), and every call after
// Close fails with ErrClosed.
func TestACallRacingCloseEndsBeforeCloseReturns(t *testing.T) {
	dir := t.TempDir()
	ctx := context.Background()
	late := &lateCalls{}
	closeDone := make(chan struct{}) // closed when Close returned
	var e *Engine
	hold := &heldStat{late: late, reached: make(chan struct{}), t: t}
	hold.release = func() bool {
		select {
		case <-closeDone:
			return true // Close did not wait for the lookup
		default:
		}
		return closeWaitsForCalls(e)
	}
	e = openEngine(t, Config{
		Mounts:    []Mount{{Path: dir}},
		NewPolicy: func(policy.Index) (policy.Policy, error) { return latePolicy{newTestPolicy(1, 0), late}, nil },
		FS:        &fsys.Faulty{FS: fsys.OS{}, Inj: hold},
	})
	g := smallGeometry(true)
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	keys := testKeys("k", 2)
	if res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys[:1], Blocks: [][]int{{0, 1, 2, 3}}})); res.Err() != nil {
		t.Fatal(res.Err())
	}
	files := dataFiles(t, dir)
	if len(files) != 1 {
		t.Fatalf("files: %v", files)
	}
	hold.path.Store(files[0])

	type lookup struct {
		n   int
		err error
	}
	looked := make(chan lookup, 1)
	go func() {
		// The first key's stat is held; the second key, not indexed, is
		// looked for under its policy name.
		n, err := e.Lookup(ctx, ns, keys)
		looked <- lookup{n, err}
	}()
	<-hold.reached
	var closeErr error
	go func() {
		closeErr = e.Close(ctx)
		late.closed.Store(true)
		close(closeDone)
	}()
	<-closeDone
	if closeErr != nil {
		t.Fatalf("Close: %v", closeErr)
	}
	// The lookup's goroutine hands its result over after Lookup has
	// returned, so it may come a moment after Close: what tells a Close
	// that did not wait is the lookup's work after it (below): held
	// until Close returned, it would then call the policy and stat the
	// second key's name.
	l := <-looked
	if l.err != nil && !errors.Is(l.err, ErrClosed) {
		t.Errorf("the lookup racing Close: %d, %v; want a count or ErrClosed", l.n, l.err)
	}
	if n, f := late.policy.Load(), late.files.Load(); n+f > 0 {
		t.Errorf("after Close returned: %d policy calls and %d file operations: %s", n, f, late)
	}
	if _, err := e.Lookup(ctx, ns, keys); !errors.Is(err, ErrClosed) {
		t.Errorf("Lookup after Close: %v, want ErrClosed", err)
	}
}

// TestCloseGivesUpOnAStoreHungInTheFileSystemButKeepsTheNodeLock: a store
// whose write never returns (a hung FUSE or NFS mount, which no
// cancellation reaches) does not hold Close past its context: Close
// cancels it, gives it a moment to unwind, and returns ctx's error. The
// node lock stays held until the store has returned, so that no new
// engine opens the directory while the old one still writes there; then
// the close completes, the cancelled store leaves no temporary file, and
// the directory opens again.
func TestCloseGivesUpOnAStoreHungInTheFileSystemButKeepsTheNodeLock(t *testing.T) {
	dir := t.TempDir()
	lockFile := filepath.Join(t.TempDir(), "kvhost.lock")
	g := smallGeometry(true)
	bfs := &blockingWrites{reached: make(chan struct{}), release: make(chan struct{})}
	var releaseOnce sync.Once
	release := func() { releaseOnce.Do(func() { close(bfs.release) }) }
	defer release() // a failed check must not leave the store held
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0), LockFile: lockFile,
		FS: &fsys.Faulty{FS: fsys.OS{}, Inj: bfs}})
	ctx := context.Background()
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	bfs.armed.Store(true)
	j, err := e.Store(ctx, StoreRequest{Cache: c.id, Keys: testKeys("h", 1), Blocks: [][]int{{0, 1, 2, 3}}})
	if err != nil {
		t.Fatal(err)
	}
	<-bfs.reached

	e.busy.unwind = 0 // the store cannot unwind: no need to wait for it
	cctx, cancel := context.WithCancel(ctx)
	cancel() // the shutdown's time is up
	closed := make(chan error, 1)
	go func() { closed <- e.Close(cctx) }()
	var closeErr error
	testwait.Until(t, "Close to give up on the hung store", testwait.Hang, func() bool {
		select {
		case closeErr = <-closed:
			return true
		default:
			return false
		}
	})
	if !errors.Is(closeErr, context.Canceled) || !errors.Is(closeErr, ErrInFlight) {
		t.Fatalf("Close: %v, want ErrInFlight and context.Canceled", closeErr)
	}
	if _, err := testOpen(ctx, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0), LockFile: lockFile, Logger: testLogger(t)}); !errors.Is(err, ErrLocked) {
		t.Fatalf("a second engine while the store still writes: %v, want ErrLocked", err)
	}

	release() // the file system answers again
	res := waitJob(t, j, nil)
	if k := res.Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, context.Canceled) {
		t.Fatalf("the hung store: %v %v, want cancelled", k.Outcome, k.Err)
	}
	// A later Close waits for the close to complete.
	if err := e.Close(ctx); err != nil {
		t.Fatalf("Close once the store returned: %v", err)
	}
	if l := leftovers(t, dir); len(l) != 0 {
		t.Fatalf("temporary files: %v", l)
	}
	e2, err := testOpen(ctx, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0), LockFile: lockFile, Logger: testLogger(t)})
	if err != nil {
		t.Fatalf("open after the close completed: %v", err)
	}
	if err := e2.Close(ctx); err != nil {
		t.Fatal(err)
	}
}

// closeWaitsForCalls reports whether Close has begun and waits for calls
// still in flight.
func closeWaitsForCalls(e *Engine) bool { return e.busy.calls.closing() && e.busy.calls.inFlight() > 0 }

// lateFiles notes every file operation made after Close returned.
type lateFiles struct{ late *lateCalls }

func (l lateFiles) Inject(op fsys.Op, path string) fsys.Fault {
	l.late.note(&l.late.files, op.String()+" "+filepath.Base(path))
	return fsys.Fault{}
}

// TestEveryCallAfterCloseIsRefused: once Close has returned, every
// exported Engine method that acts (neither a job's submission nor an
// observer of counters) fails with ErrClosed, reaches neither the policy
// nor a mount, and changes nothing: UnregisterCache used to forget the
// cache of a closed engine and succeed. The methods are listed by
// reflection, so that one added later is either in the table or named
// among those that answer after Close, with the reason.
func TestEveryCallAfterCloseIsRefused(t *testing.T) {
	dir := t.TempDir()
	ctx := context.Background()
	late := &lateCalls{}
	e := openEngine(t, Config{
		Mounts:    []Mount{{Path: dir}},
		NewPolicy: func(policy.Index) (policy.Policy, error) { return latePolicy{newTestPolicy(1, 0), late}, nil },
		FS:        &fsys.Faulty{FS: fsys.OS{}, Inj: lateFiles{late}},
	})
	g := smallGeometry(true)
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	keys := testKeys("k", 1)
	blocks := [][]int{{0, 1, 2, 3}}
	storeAndCheck(t, e, c, keys, blocks)
	pin, _, err := e.Pin(ctx, ns, keys, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	late.closed.Store(true)
	caches := e.tables.cacheCount()

	refused := []struct {
		method string
		call   func() error
	}{
		{"Declare", func() error { _, err := e.Declare(ctx, g); return err }},
		{"Release", func() error { return e.Release(ns) }},
		{"RegisterCache", func() error { _, err := e.RegisterCache(ns, c.layers); return err }},
		{"UnregisterCache", func() error { return e.UnregisterCache(c.id) }},
		{"KeysPerFile", func() error { _, err := e.KeysPerFile(ns); return err }},
		{"Fingerprint", func() error { _, err := e.Fingerprint(ns); return err }},
		{"Store", func() error {
			_, err := e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys, Blocks: blocks})
			return err
		}},
		{"Load", func() error { _, err := e.Load(ctx, LoadRequest{Cache: c.id, Keys: keys, Blocks: blocks}); return err }},
		{"Lookup", func() error { _, err := e.Lookup(ctx, ns, keys); return err }},
		{"Pin", func() error { _, _, err := e.Pin(ctx, ns, keys, time.Hour); return err }},
		{"Unpin", func() error {
			if n := e.Unpin(ctx, pin); n != 0 {
				return fmt.Errorf("released %d keys", n)
			}
			return ErrClosed // no error to return: Close released every pin
		}},
		{"Delete", func() error { _, err := e.Delete(ctx, ns, keys); return err }},
		{"Purge", func() error { _, err := e.Purge(ctx, g.Fingerprint()); return err }},
		{"PurgeModel", func() error { _, err := e.PurgeModel(ctx, g.Model); return err }},
		{"ReplacePolicy", func() error {
			return e.ReplacePolicy(ctx, func(policy.Index) (policy.Policy, error) { return newTestPolicy(1, 0), nil })
		}},
	}
	// answers are the methods that still answer after Close, and why.
	answers := map[string]string{
		"Close":             "waits for the close, as it did",
		"Stats":             "an observer: counters, no mount",
		"TierStats":         "an observer",
		"HeldFound":         "an observer",
		"Activity":          "an observer (the watchdog's)",
		"StagingUsage":      "an observer",
		"PinStats":          "an observer",
		"PinnedFilesOpen":   "an observer",
		"PinHeld":           "an observer",
		"Index":             "the policy's view of the index, read only",
		"WaitSpares":        "returns once the spare maker stopped, which Close did",
		"WaitWarmed":        "returns once the warmer started, or at once",
		"MirrorKeys":        "tells the caller's key set of the index's keys: no mount, no policy",
		"SetVerifyInterval": "stores a number the closed engine no longer reads",
		"Removals":          "returns the removal feed, closed with the engine (checked below)",
	}
	listed := map[string]bool{}
	for _, r := range refused {
		listed[r.method] = true
		if err := r.call(); !errors.Is(err, ErrClosed) {
			t.Errorf("%s after Close: %v, want ErrClosed", r.method, err)
		}
	}
	et := reflect.TypeFor[*Engine]()
	for i := range et.NumMethod() {
		name := et.Method(i).Name
		if _, ok := answers[name]; !ok && !listed[name] {
			t.Errorf("Engine.%s: neither checked to be refused after Close nor listed among the methods that answer", name)
		}
	}
	if _, _, _, err := e.Removals().Subscribe(nil, 0, 0); !errors.Is(err, removals.ErrClosed) {
		t.Errorf("a removal subscription after Close: %v, want removals.ErrClosed", err)
	}
	if n := e.tables.cacheCount(); n != caches {
		t.Errorf("caches after the calls: %d, want %d", n, caches)
	}
	if n, f := late.policy.Load(), late.files.Load(); n+f > 0 {
		t.Errorf("after Close returned: %d policy calls and %d file operations: %s", n, f, late)
	}
}
