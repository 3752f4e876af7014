//go:build invariants

package engine

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/plugins/tiered"
)

// TestReloadStormKeepsTiers is issue 37's reload storm on a small hot
// mount and an unbounded cold one under the tiered policy: 200 policy
// replacements while one client stores and another declares, uses and
// releases a namespace again and again (a reconnecting worker). No store
// and no lookup fails, every acknowledged key stays indexed (nothing is
// evicted from the last tier, which has room), the hot mount stays within
// its capacity and the demotions show in Stats.
func TestReloadStormKeepsTiers(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	g2 := g
	g2.Model = "storm/redeclared"
	fileLen := 4096 + g.KeyBytes()
	hot, cold := t.TempDir(), t.TempDir()
	newPolicy := func(idx policy.Index) (policy.Policy, error) {
		return policy.NewNative(func() guest.Policy { return tiered.New() }, idx, policy.Config{Shards: 2, Logger: testLogger(t)})
	}
	e := openEngine(t, Config{
		Mounts:    []Mount{{Path: hot, Capacity: 8 * fileLen, HighWatermark: 0.9, LowWatermark: 0.6}, {Path: cold}},
		NewPolicy: newPolicy, TickInterval: time.Millisecond, MountUpdateInterval: time.Millisecond,
	})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	const n, reloads = 48, 200
	c := newTestCache(t, e, ns, g, n*g.BlocksPerKey()+4, layoutPlaneFirst)
	r := rand.New(rand.NewPCG(37, 37))
	keys := testKeys("storm", n)
	blocks := blockLists(r, n, g.BlocksPerKey(), 0)
	c.fill(r, flat(blocks))

	var stored, redeclares, replaced atomic.Int64
	errs := make(chan error, 3)
	done := make(chan struct{}) // the stores are done
	var wg sync.WaitGroup
	wg.Add(3)
	go func() { // the client that stores
		defer wg.Done()
		defer close(done)
		for i := range keys {
			res, err := waitResult(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys[i : i+1], Blocks: blocks[i : i+1]}))
			if err == nil && res.Count(OutcomeStored) != 1 {
				err = fmt.Errorf("not stored: %+v", res)
			}
			if err != nil {
				errs <- fmt.Errorf("store of key %d: %w", i, err)
				return
			}
			stored.Add(1)
		}
	}()
	go func() { // the client that reconnects: declare, look up, release
		defer wg.Done()
		for {
			select {
			case <-done:
				if replaced.Load() >= reloads {
					return
				}
			default:
			}
			ns2, err := e.Declare(ctx, g2)
			if err == nil {
				_, err = e.Lookup(ctx, ns2, keys[:1]) // names the key through the policy
			}
			if err == nil {
				err = e.Release(ns2)
			}
			if err != nil {
				errs <- fmt.Errorf("re-declaration %d: %w", redeclares.Load(), err)
				return
			}
			redeclares.Add(1)
		}
	}()
	go func() { // the operator's reloads
		defer wg.Done()
		for i := 0; i < reloads || stored.Load() < n; i++ {
			if err := e.ReplacePolicy(ctx, newPolicy); err != nil {
				errs <- fmt.Errorf("reload %d: %w", i, err)
				return
			}
			replaced.Add(1)
		}
	}()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		return
	}
	st := e.Stats()
	t.Logf("%d reloads, %d re-declarations, %d keys stored; %d demotions, %d evictions; hot %d files, cold %d",
		replaced.Load(), redeclares.Load(), stored.Load(), st.Tiering.Demotions, st.Evictions, st.Mounts[0].Entries, st.Mounts[1].Entries)
	for i, k := range keys {
		if keyMount(e, ns, k) < 0 {
			t.Errorf("acknowledged key %d is gone", i)
		}
	}
	if st.Evictions != 0 || st.Tiering.Demotions == 0 || st.Mounts[0].Used > 8*fileLen {
		t.Errorf("stats: %d evictions, %d demotions, hot used %d of %d: want demotions only, within capacity",
			st.Evictions, st.Tiering.Demotions, st.Mounts[0].Used, 8*fileLen)
	}
}

// waitResult waits for a job that began without error.
func waitResult(j *Job, err error) (Result, error) {
	if err != nil {
		return Result{}, err
	}
	return j.Wait(context.Background())
}
