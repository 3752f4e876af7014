//go:build invariants

package engine

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/region"
)

// trackedPolicy counts the calls a policy serves and fails the test's
// check if one begins or runs while (or after) it is closed.
type trackedPolicy struct {
	*testPolicy
	calls    atomic.Int64 // calls served
	inflight atomic.Int64
	closed   atomic.Bool
	misuse   atomic.Int64 // calls that began after Close, or Close during a call
}

func (p *trackedPolicy) enter() func() {
	p.calls.Add(1)
	p.inflight.Add(1)
	if p.closed.Load() {
		p.misuse.Add(1)
	}
	return func() { p.inflight.Add(-1) }
}

func (p *trackedPolicy) Name(ctx context.Context, recs []abi.NameRecord) error {
	defer p.enter()()
	return p.testPolicy.Name(ctx, recs)
}

func (p *trackedPolicy) Admit(ctx context.Context, recs []abi.AdmitRecord) error {
	defer p.enter()()
	return p.testPolicy.Admit(ctx, recs)
}

func (p *trackedPolicy) Access(ctx context.Context, recs []abi.AccessRecord) error {
	defer p.enter()()
	return p.testPolicy.Access(ctx, recs)
}

func (p *trackedPolicy) Close(context.Context) error {
	if p.inflight.Load() != 0 {
		p.misuse.Add(1)
	}
	p.closed.Store(true)
	return nil
}

// TestReplacePolicyUnderLoadLosesNothing swaps the policy repeatedly while
// stores and loads run: every key is stored and loads back, every replaced
// policy is closed only after its last call, and the last one serves.
func TestReplacePolicyUnderLoadLosesNothing(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	var mu sync.Mutex
	var policies []*trackedPolicy
	build := func(policy.Index) (policy.Policy, error) {
		p := &trackedPolicy{testPolicy: newTestPolicy(1, 0)}
		mu.Lock()
		policies = append(policies, p)
		mu.Unlock()
		return p, nil
	}
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, NewPolicy: build})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	const workers, rounds, perRound = 3, 8, 2
	c := newTestCache(t, e, ns, g, workers*rounds*perRound*g.BlocksPerKey()*2, layoutPlaneFirst)
	r := rand.New(rand.NewPCG(1, 2))
	stop := make(chan struct{})
	var replaced atomic.Int64
	swapped := make(chan error, 1)
	go func() {
		defer close(swapped)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if err := e.ReplacePolicy(ctx, build); err != nil {
				swapped <- err
				return
			}
			replaced.Add(1)
		}
	}()
	var wg sync.WaitGroup
	errs := make(chan error, workers*rounds)
	for w := range workers {
		keys := testKeys(fmt.Sprintf("w%d-", w), rounds*perRound)
		blocks := blockLists(r, len(keys), g.BlocksPerKey(), w*rounds*perRound*g.BlocksPerKey())
		c.fill(r, flat(blocks))
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < len(keys); i += perRound {
				k, b := keys[i:i+perRound], blocks[i:i+perRound]
				j, err := e.Store(ctx, StoreRequest{Cache: c.id, Keys: k, Blocks: b})
				if err == nil {
					var res Result
					if res, err = j.Wait(ctx); err == nil && res.Count(OutcomeStored) != len(k) {
						err = fmt.Errorf("stored %d of %d keys", res.Count(OutcomeStored), len(k))
					}
				}
				if err == nil {
					j, err = e.Load(ctx, LoadRequest{Cache: c.id, Keys: k, Blocks: b})
					if err == nil {
						var res Result
						if res, err = j.Wait(ctx); err == nil && res.Count(OutcomeLoaded) != len(k) {
							err = fmt.Errorf("loaded %d of %d keys", res.Count(OutcomeLoaded), len(k))
						}
					}
				}
				if err != nil {
					errs <- fmt.Errorf("worker %d round %d: %w", w, i/perRound, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(stop)
	if err := <-swapped; err != nil {
		t.Fatalf("ReplacePolicy: %v", err)
	}
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if replaced.Load() == 0 || len(policies) < 2 {
		t.Fatalf("the policy was never replaced (%d policies built)", len(policies))
	}
	for i, p := range policies {
		if p.misuse.Load() != 0 {
			t.Errorf("policy %d: %d calls overlapped its Close", i, p.misuse.Load())
		}
		if last := i == len(policies)-1; p.closed.Load() == last {
			t.Errorf("policy %d (of %d): closed = %v", i, len(policies), p.closed.Load())
		}
	}
	// The current policy answers: a new store goes through it.
	last := policies[len(policies)-1]
	before := last.calls.Load()
	k := testKeys("after-", 1)
	storeAndCheck(t, e, c, k, blockLists(r, 1, g.BlocksPerKey(), 0))
	if last.calls.Load() == before {
		t.Fatal("a store after the last replacement did not call the current policy")
	}
}

func flat(b [][]int) []int {
	var out []int
	for _, x := range b {
		out = append(out, x...)
	}
	return out
}

// TestReplacePolicyFailureKeepsTheOldOne: a build that fails leaves the
// engine on its policy, which keeps serving, and the error says why.
func TestReplacePolicyFailureKeepsTheOldOne(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	old := &trackedPolicy{testPolicy: newTestPolicy(1, 0)}
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, NewPolicy: func(policy.Index) (policy.Policy, error) { return old, nil }})
	errBuild := errors.New("module does not compile")
	err := e.ReplacePolicy(ctx, func(policy.Index) (policy.Policy, error) { return nil, errBuild })
	if !errors.Is(err, errBuild) || !errors.Is(err, ErrPolicy) {
		t.Fatalf("ReplacePolicy error %v, want one wrapping ErrPolicy and the build's error", err)
	}
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 4*g.BlocksPerKey(), layoutPlaneFirst)
	before := old.calls.Load()
	storeAndCheck(t, e, c, testKeys("k", 2), blockLists(rand.New(rand.NewPCG(3, 4)), 2, g.BlocksPerKey(), 0))
	if old.closed.Load() || old.calls.Load() == before {
		t.Fatalf("old policy closed %v, calls %d → %d: want it open and serving", old.closed.Load(), before, old.calls.Load())
	}
	e.Close(ctx)
	if err := e.ReplacePolicy(ctx, func(policy.Index) (policy.Policy, error) { return newTestPolicy(1, 0), nil }); !errors.Is(err, ErrClosed) {
		t.Fatalf("ReplacePolicy on a closed engine: %v, want ErrClosed", err)
	}
}

type recordingObserver struct {
	mu     sync.Mutex
	events []JobEvent
}

func (o *recordingObserver) ObserveJob(ev JobEvent) {
	o.mu.Lock()
	o.events = append(o.events, ev)
	o.mu.Unlock()
}

// TestObserverSeesEveryFinishedJob: each store and load is observed once,
// before Wait returns, with its direction, path, bytes and outcomes.
func TestObserverSeesEveryFinishedJob(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	obs := &recordingObserver{}
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, 0), Observer: obs})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 4*g.BlocksPerKey(), layoutPlaneFirst)
	keys := testKeys("k", 2)
	blocks := blockLists(rand.New(rand.NewPCG(5, 6)), 3, g.BlocksPerKey(), 0)
	storeAndCheck(t, e, c, keys, blocks[:2])
	wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: append(keys, []byte("absent")), Blocks: blocks}))
	obs.mu.Lock()
	defer obs.mu.Unlock()
	if len(obs.events) != 2 {
		t.Fatalf("%d events, want 2: %+v", len(obs.events), obs.events)
	}
	st, ld := obs.events[0], obs.events[1]
	want := 2 * g.KeyBytes()
	switch {
	case st.Direction != "store" || st.Outcomes[OutcomeStored] != 2 || st.Bytes != want || st.Memory != region.KindHost || st.Path != "staging":
		t.Errorf("store event %+v, want 2 stored, %d bytes, host memory, path staging", st, want)
	case ld.Direction != "load" || ld.Outcomes[OutcomeLoaded] != 2 || ld.Outcomes[OutcomeMissing] != 1 || ld.Bytes != want || ld.Duration <= 0:
		t.Errorf("load event %+v, want 2 loaded, 1 missing, %d bytes", ld, want)
	}
}
