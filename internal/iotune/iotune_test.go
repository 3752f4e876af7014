package iotune

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"testing"
	"time"
)

// disk is a model of a mount: its rate (bytes/s) at each reader count.
type disk func(readers int) float64

var (
	// virtio is the H200 machine's virtio disk as measured with plain
	// reads: one O_DIRECT reader fastest, many slower.
	virtio disk = func(n int) float64 { return 2.0e9 / (1 + 0.03*float64(n-1)) }
	// nvme wants many requests in flight.
	nvme disk = func(n int) float64 { return 6.5e9 * min(float64(n), 12) / 12 }
	// flat is the same at every count.
	flat disk = func(int) float64 { return 1e9 }
)

// drive runs windows of a saturated mount of rate d through the tuner,
// starting at t's max, and returns the counts it used, window by window.
func drive(t *tuner, d disk, start, windows int) []int {
	l, used := start, make([]int, 0, windows)
	for range windows {
		used = append(used, l)
		l = t.observe(l, d(l))
	}
	return used
}

func TestTunerSettlesOnTheFastestReaderCount(t *testing.T) {
	for _, tc := range []struct {
		name string
		d    disk
		max  int
		want int
	}{
		{"virtio prefers few readers", virtio, 16, 2}, // 1 is within the hysteresis of 2
		{"nvme prefers many", nvme, 16, 16},
		{"a flat disk stays at its start", flat, 16, 16},
		{"a max that is no power of two is reached", nvme, 24, 24},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tu := newTuner(tc.max, DefaultStale)
			used := drive(&tu, tc.d, tc.max, 64)
			// Settled: the most windows of the last 32 at the count wanted
			// (the rest re-measure its neighbours, each once in Stale).
			at := 0
			for _, l := range used[32:] {
				if l == tc.want {
					at++
				}
			}
			if at < 32-2*32/DefaultStale-2 {
				t.Fatalf("%d of the last 32 windows at %d readers; counts used: %v", at, tc.want, used)
			}
		})
	}
}

func TestTunerFindsItsWayBackWhenTheDiskChanges(t *testing.T) {
	tu := newTuner(16, DefaultStale)
	used := drive(&tu, virtio, 16, 48)
	if used[len(used)-1] > 2 {
		t.Fatalf("on the virtio disk it ended at %d readers: %v", used[len(used)-1], used)
	}
	// The same mount now behaves as an NVMe drive (another load, a
	// cleared host cache): the count must climb back to the most.
	used = drive(&tu, nvme, used[len(used)-1], 6*DefaultStale)
	if last := used[len(used)-1]; last != 16 {
		t.Fatalf("after the disk changed it stayed at %d readers: %v", last, used)
	}
}

func TestTunerIgnoresDifferencesWithinItsHysteresis(t *testing.T) {
	// 2% apart: noise, not a better count.
	near := func(n int) float64 { return 1e9 * (1 + 0.02*float64(n%2)) }
	tu := newTuner(16, DefaultStale)
	used := drive(&tu, near, 16, 40)
	for i, l := range used {
		if l != 16 && l != 8 {
			t.Fatalf("window %d at %d readers: it left 16 for a rate within 5%%: %v", i, l, used)
		}
	}
}

// clock is a settable clock.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

func TestGateNeverLetsMoreReadersInThanItsLimit(t *testing.T) {
	g := New(Config{Max: 3, Fixed: true})
	ctx := context.Background()
	var mu sync.Mutex
	in, most := 0, 0
	var wg sync.WaitGroup
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := g.Acquire(ctx); err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			in++
			most = max(most, in)
			mu.Unlock()
			mu.Lock()
			in--
			mu.Unlock()
			g.Release(1)
		}()
	}
	wg.Wait()
	if most > 3 {
		t.Fatalf("%d readers at once, limit 3", most)
	}
	if s := g.Stats(); s.Inflight != 0 || s.Limit != 3 {
		t.Fatalf("after every release: %+v", s)
	}
}

func TestGateAcquireEndsWithItsContextAndLosesNoReader(t *testing.T) {
	g := New(Config{Max: 1, Fixed: true})
	if err := g.Acquire(context.Background()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- g.Acquire(ctx) }()
	// Wait until it waits, then cancel it.
	for {
		g.mu.Lock()
		n := len(g.waiters)
		g.mu.Unlock()
		if n == 1 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Acquire after its context ended: %v", err)
	}
	g.Release(0)
	// The reader is free again: taken at once.
	ctx2, cancel2 := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel2()
	if err := g.Acquire(ctx2); err != nil {
		t.Fatalf("the reader given back was lost: %v", err)
	}
}

// TestGateTunesItsLimitFromTheRateOfSaturatedWindows drives a Gate with
// readers that each move a file at the virtio disk's rate for the count
// in flight, on a fake clock: it must come down from 16 readers.
func TestGateTunesItsLimitFromTheRateOfSaturatedWindows(t *testing.T) {
	clk := &clock{now: time.Unix(0, 0)}
	const file = 4 << 20
	g := New(Config{Max: 16, WindowBytes: 64 << 20, Now: clk.Now})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	// load starts one load: it takes a reader (the test releases it on
	// its behalf) or waits for one.
	load := func() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = g.Acquire(ctx)
		}()
	}
	waiting := func() int {
		g.mu.Lock()
		defer g.mu.Unlock()
		return len(g.waiters)
	}
	for files := 0; files < 4000; files++ {
		// Loads outnumber the readers: one always waits (the mount is
		// saturated, as when a prefix's files all wait for it).
		for waiting() == 0 {
			before := g.Stats().Inflight
			load()
			for deadline := time.Now().Add(10 * time.Second); waiting() == 0 && g.Stats().Inflight == before; {
				if time.Now().After(deadline) {
					t.Fatal("a load neither took a reader nor waited")
				}
				runtime.Gosched()
			}
		}
		// One reader ends its file: as long as one file takes at the
		// rate of the readers in force.
		clk.advance(time.Duration(float64(file) / virtio(g.Stats().Limit) * float64(time.Second)))
		g.Release(file)
	}
	s := g.Stats()
	if s.Limit > 4 || s.Changes == 0 {
		t.Fatalf("after 4000 files at the virtio disk's rates the limit is %d (%d changes); rates %v", s.Limit, s.Changes, s.Rates)
	}
}
