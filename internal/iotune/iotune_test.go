package iotune

import (
	"context"
	"errors"
	"math"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/testwait"
)

// disk is a model of a mount: its rate (bytes/s) at each arm.
type disk func(a Arm) float64

var (
	// virtio is one H200 machine's virtio disk as measured with plain
	// reads: one O_DIRECT reader fastest, many slower; buffered no
	// better.
	virtio disk = func(a Arm) float64 {
		r := 2.0e9 / (1 + 0.03*float64(a.Readers-1))
		if a.Buffered {
			r *= 0.8
		}
		return r
	}
	// readahead is another's: buffered readers (the kernel's read-ahead)
	// ahead of O_DIRECT ones, more of them better.
	readahead disk = func(a Arm) float64 {
		if a.Buffered {
			return 1.6e9 * min(float64(a.Readers), 8) / 8
		}
		return 1.0e9
	}
	// nvme wants many O_DIRECT requests in flight.
	nvme disk = func(a Arm) float64 {
		r := 6.5e9 * min(float64(a.Readers), 12) / 12
		if a.Buffered {
			r *= 0.7
		}
		return r
	}
	// flat is the same at every arm.
	flat disk = func(Arm) float64 { return 1e9 }
)

// drive runs windows of a saturated mount of rate d through the tuner,
// starting at start, and returns the arms it used, window by window.
func drive(t *tuner, d disk, start Arm, windows int) []Arm {
	a, used := start, make([]Arm, 0, windows)
	for range windows {
		used = append(used, a)
		a = t.observe(a, d(a))
	}
	return used
}

func TestTunerSettlesOnTheFastestArm(t *testing.T) {
	for _, tc := range []struct {
		name  string
		d     disk
		max   int
		modes bool
		want  Arm
	}{
		{"virtio prefers few direct readers", virtio, 16, true, Arm{2, false}},      // 1 is within the hysteresis of 2
		{"read-ahead prefers buffered readers", readahead, 16, true, Arm{16, true}}, // 8 and 16 move alike: it stays
		{"without modes it stays direct", readahead, 16, false, Arm{16, false}},
		{"nvme prefers many direct", nvme, 16, true, Arm{16, false}},
		{"a flat disk stays at its start", flat, 16, true, Arm{16, false}},
		{"a max that is no power of two is reached", nvme, 24, true, Arm{24, false}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tu := newTuner(tc.max, DefaultStale, tc.modes)
			used := drive(&tu, tc.d, Arm{tc.max, false}, 96)
			// Settled: the most windows of the last 48 at the arm wanted
			// (the rest re-measure its neighbours, each once in Stale).
			at := 0
			for _, a := range used[48:] {
				if a == tc.want {
					at++
				}
			}
			if at < 48-3*48/DefaultStale-3 {
				t.Fatalf("%d of the last 48 windows at %+v; arms used: %v", at, tc.want, used)
			}
		})
	}
}

func TestTunerFindsItsWayBackWhenTheDiskChanges(t *testing.T) {
	tu := newTuner(16, DefaultStale, true)
	used := drive(&tu, virtio, Arm{16, false}, 64)
	if last := used[len(used)-1]; last.Readers > 2 || last.Buffered {
		t.Fatalf("on the virtio disk it ended at %+v: %v", last, used)
	}
	// The same mount now behaves as an NVMe drive (another load, a
	// cleared host cache): the count must climb back to the most.
	used = drive(&tu, nvme, used[len(used)-1], 8*DefaultStale)
	if last := used[len(used)-1]; last != (Arm{16, false}) {
		t.Fatalf("after the disk changed it stayed at %+v: %v", last, used)
	}
}

func TestTunerIgnoresDifferencesWithinItsHysteresis(t *testing.T) {
	// 2% apart: noise, not a better count.
	near := func(a Arm) float64 { return 1e9 * (1 + 0.02*float64(a.Readers%2)) }
	tu := newTuner(16, DefaultStale, false)
	used := drive(&tu, near, Arm{16, false}, 40)
	for i, a := range used {
		if a.Readers != 16 && a.Readers != 8 {
			t.Fatalf("window %d at %+v: it left 16 readers for a rate within 5%%: %v", i, a, used)
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
			r, err := g.Acquire(ctx)
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			in++
			most = max(most, in)
			mu.Unlock()
			runtime.Gosched() // others run while this one holds its reader
			mu.Lock()
			in--
			mu.Unlock()
			g.Release(r, 1)
		}()
	}
	wg.Wait()
	if most > 3 {
		t.Fatalf("%d readers at once, limit 3", most)
	}
	if s := g.Stats(); s.Inflight != 0 || s.Arm.Readers != 3 {
		t.Fatalf("after every release: %+v", s)
	}
}

func TestGateAcquireEndsWithItsContextAndLosesNoReader(t *testing.T) {
	g := New(Config{Max: 1, Fixed: true})
	r, err := g.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := g.Acquire(ctx)
		done <- err
	}()
	testwait.Until(t, "the Acquire to wait", 10*time.Second, func() bool { return waiting(g) == 1 })
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Acquire after its context ended: %v", err)
	}
	g.Release(r, 0)
	// The reader is free again: taken at once.
	ctx2, cancel2 := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel2()
	if _, err := g.Acquire(ctx2); err != nil {
		t.Fatalf("the reader given back was lost: %v", err)
	}
}

// TestGateTunesItsLimitFromTheRateOfSaturatedWindows drives a Gate with
// readers that each move a file at the virtio disk's rate for the count
// in flight, on a fake clock: it must come down from 16 readers.
func TestGateTunesItsLimitFromTheRateOfSaturatedWindows(t *testing.T) {
	clk := &clock{now: time.Unix(0, 0)}
	const file = 4 << 20
	g := New(Config{Max: 16, Modes: true, WindowBytes: 64 << 20, Now: clk.Now})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	// load starts one load: it takes a reader (held, which the test
	// releases on its behalf, oldest first) or waits for one.
	held := make(chan Reader, 64)
	load := func() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if r, err := g.Acquire(ctx); err == nil {
				held <- r
			}
		}()
	}
	for files := 0; files < 4000; files++ {
		// Loads outnumber the readers: one always waits (the mount is
		// saturated, as when a prefix's files all wait for it).
		for waiting(g) == 0 {
			before := len(held)
			load()
			testwait.Until(t, "a load to take a reader or wait", 10*time.Second, func() bool {
				return waiting(g) > 0 || len(held) != before
			})
		}
		// One reader ends its file: as long as one file takes at the
		// rate of the readers in force.
		clk.advance(time.Duration(float64(file) / virtio(g.Stats().Arm) * float64(time.Second)))
		g.Release(<-held, file)
	}
	// The arm it settled on (the arm in force may be a neighbour being
	// measured again).
	s := g.Stats()
	if home := s.Home; home.Readers > 4 || home.Buffered || s.Changes == 0 {
		t.Fatalf("after 4000 files at the virtio disk's rates it settled on %+v (in force %+v, %d changes); rates %v", home, s.Arm, s.Changes, s.Rates)
	}
	if _, ok := s.Rates[s.Home]; !ok {
		t.Fatalf("the home arm %+v has no rate in the stats: %v", s.Home, s.Rates)
	}
}

// TestGateLearnsNothingFromUnmeasuredReads: reads of parts of files (a
// layer range's) drop the window they fall in, so that no rate mixes
// them with whole files': two halves of a window with unmeasured reads
// between them measure nothing, two halves together measure.
func TestGateLearnsNothingFromUnmeasuredReads(t *testing.T) {
	clk := &clock{now: time.Unix(0, 0)}
	const window = 1 << 20
	g := New(Config{Max: 2, Modes: true, WindowBytes: window, Now: clk.Now})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	held := make(chan Reader, 4) // the readers out, oldest first
	for range 2 {
		r, err := g.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		held <- r
	}
	// step has a load wait for a reader (the mount saturated), then a
	// reader end, measured with bytes or not, and the load take it
	// (granted is closed then; a measurement may lower the bound).
	step := func(measured bool, bytes int64) (granted chan struct{}) {
		granted = make(chan struct{})
		go func() {
			if r, err := g.Acquire(ctx); err == nil {
				held <- r
				close(granted)
			}
		}()
		testwait.Until(t, "the load to wait", 10*time.Second, func() bool { return waiting(g) == 1 })
		clk.advance(time.Millisecond)
		if measured {
			g.Release(<-held, bytes)
		} else {
			g.ReleaseUnmeasured(<-held)
		}
		return granted
	}
	<-step(true, window/2)
	for range 100 {
		<-step(false, 0)
	}
	last := step(true, window/2)
	if s := g.Stats(); len(s.Rates) != 0 {
		t.Fatalf("a window with unmeasured reads inside was measured: %+v", s)
	}
	<-last
	step(true, window/2) // not waited for: the measurement may lower the bound below the readers held
	if s := g.Stats(); len(s.Rates) != 1 {
		t.Fatalf("two measured halves of a window measured nothing: %+v", s)
	}
}

// TestGateGoesBackHomeWhenAMeasurementIsCutShort: while tuning measures
// a neighbour of its home arm again, a window cut short (a layer range's
// read, or the loads ending) puts home back in force, so that the loads
// after it do not read at an arm kept only to be measured.
func TestGateGoesBackHomeWhenAMeasurementIsCutShort(t *testing.T) {
	home, neighbour := Arm{Readers: 4, Buffered: true}, Arm{Readers: 2, Buffered: true}
	for _, tc := range []struct {
		name string
		end  func(g *Gate, held chan Reader)
	}{
		{"by a layer range's read", func(g *Gate, held chan Reader) { g.ReleaseUnmeasured(<-held) }},
		{"by the loads ending", func(g *Gate, held chan Reader) {
			for range 3 {
				g.Release(<-held, 1)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := New(Config{Max: 4, Buffered: true, Modes: true, WindowBytes: 1 << 30})
			g.mu.Lock()
			g.tune.home, g.tune.rate[home], g.arm = home, 2e9, neighbour
			g.mu.Unlock()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			held := make(chan Reader, 3)
			for range 2 {
				r, err := g.Acquire(ctx)
				if err != nil {
					t.Fatal(err)
				}
				held <- r
			}
			// A third load waits: the mount is saturated at the
			// neighbour's two readers, and its window runs.
			go func() {
				if r, err := g.Acquire(ctx); err == nil {
					held <- r
				}
			}()
			testwait.Until(t, "the third load to wait", 10*time.Second, func() bool { return waiting(g) == 1 })
			tc.end(g, held)
			s := g.Stats()
			if s.Arm != home || s.Changes != 1 {
				t.Fatalf("after the measurement of %+v was cut short: %+v in force, %d changes; want home %+v, 1 change", neighbour, s.Arm, s.Changes, home)
			}
		})
	}
	t.Run("a fixed gate keeps its arm", func(t *testing.T) {
		g := New(Config{Max: 2, Fixed: true})
		r, err := g.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		g.ReleaseUnmeasured(r)
		if s := g.Stats(); s.Arm != (Arm{Readers: 2}) || s.Changes != 0 {
			t.Fatalf("a fixed gate moved: %+v", s)
		}
	})
}

// TestGateMeasuresTheRateOfReadersThatShareTheDisk: loads of 126 files
// of 32 MiB, each load on an idle mount, on disks whose rate the readers
// in flight share evenly. The files a load starts at once end together,
// so a window timed by its length would end with 16 readers' bytes
// uncounted: 16 readers measured half a flat disk's rate, and tuning left
// them for 8. Every arm the Gate measures must measure its disk's rate.
func TestGateMeasuresTheRateOfReadersThatShareTheDisk(t *testing.T) {
	for _, tc := range []struct {
		name string
		d    disk
	}{{"flat", flat}, {"readahead", readahead}} {
		t.Run(tc.name, func(t *testing.T) {
			const file, files, loads = 32 << 20, 126, 6
			clk := &clock{now: time.Unix(0, 0)}
			g := New(Config{Max: 16, Buffered: true, Modes: true, Now: clk.Now})
			ctx, cancel := context.WithCancel(context.Background())
			var wg sync.WaitGroup
			defer wg.Wait()
			defer cancel()
			held := make(chan Reader, files)
			type reading struct {
				r    Reader
				left float64 // bytes
			}
			var active []*reading
			for range loads {
				for range files {
					wg.Add(1)
					go func() {
						defer wg.Done()
						if r, err := g.Acquire(ctx); err == nil {
							held <- r
						}
					}()
				}
				for out := files; out > 0; out-- {
					testwait.Until(t, "every file to take a reader or wait", 10*time.Second, func() bool {
						for {
							select {
							case r := <-held:
								active = append(active, &reading{r: r, left: file})
							default:
								return len(active)+waiting(g) == out
							}
						}
					})
					// The readers share the disk's rate at their count
					// and mode: the file nearest its end ends.
					each := tc.d(Arm{len(active), g.Stats().Arm.Buffered}) / float64(len(active))
					next := slices.IndexFunc(active, func(a *reading) bool {
						return !slices.ContainsFunc(active, func(b *reading) bool { return b.left < a.left })
					})
					dt := time.Duration(math.Ceil(active[next].left / each * 1e9))
					clk.advance(dt)
					for _, a := range active {
						a.left -= each * dt.Seconds()
					}
					r := active[next].r
					active = slices.Delete(active, next, next+1)
					g.Release(r, file)
				}
				clk.advance(time.Second) // idle until the next load
			}
			s := g.Stats()
			if len(s.Rates) == 0 {
				t.Fatalf("%d loads measured nothing: %+v", loads, s)
			}
			for a, got := range s.Rates {
				if want := tc.d(a); math.Abs(got/want-1) > 0.03 {
					t.Errorf("%+v measured %.3g bytes/s, the disk moves %.3g at it", a, got, want)
				}
			}
		})
	}
}

// TestGateCountsOnlyTheReadersOfTheArmInForce: a reader granted under
// an arm tuning has left measured that arm, not the one in force, so its
// bytes stay out of the window; the arm in force is measured by its own
// readers, each over its share of the time (here 4 s beside one other
// reader: a share of 2 s).
func TestGateCountsOnlyTheReadersOfTheArmInForce(t *testing.T) {
	clk := &clock{now: time.Unix(0, 0)}
	g := New(Config{Max: 4, WindowBytes: 7, Now: clk.Now})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	old, err := g.Acquire(ctx) // under 4 readers
	if err != nil {
		t.Fatal(err)
	}
	g.mu.Lock()
	g.arm = Arm{Readers: 2} // tuning moved on
	g.mu.Unlock()
	clk.advance(time.Second)
	cur, err := g.Acquire(ctx) // under 2: the bound is reached
	if err != nil {
		t.Fatal(err)
	}
	waiter := make(chan Reader, 1)
	go func() {
		if r, err := g.Acquire(ctx); err == nil {
			waiter <- r
		}
	}()
	testwait.Until(t, "a load to wait (the mount saturated)", 10*time.Second, func() bool { return waiting(g) == 1 })
	clk.advance(time.Second)
	g.Release(old, 1000) // 2 s, but of the arm left behind: not counted
	next := <-waiter
	clk.advance(3 * time.Second)
	g.Release(cur, 7) // its share: 1 s beside old, 3 s beside next: 0.5 + 1.5
	s := g.Stats()
	if len(s.Rates) != 1 || s.Rates[Arm{Readers: 2}] != 7/2.0 {
		t.Fatalf("rates %v; want only 2 readers', 7 bytes over a share of 2 s", s.Rates)
	}
	g.Release(next, 0)
}

// waiting returns how many Acquires g has waiting.
func waiting(g *Gate) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.waiters)
}
