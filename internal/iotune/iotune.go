// Package iotune bounds how many files the engine reads at once from one
// mount, and tunes that bound by the throughput it measures.
//
// Disks differ in the queue depth they like: on a virtio disk one reader
// of 4 MiB O_DIRECT requests moved 2.0 GB/s where 16 to 64 moved 1.2 to
// 1.65, while an NVMe drive or a network file system wants many requests
// in flight. A Gate starts at its most readers and, while loads are
// waiting for a reader (the mount is the bottleneck), measures the bytes
// each reader count moves over windows of WindowBytes, moving one step
// (half or double) at a time toward the best count it has measured.
// Every measurement ages: a neighbour of the best count not measured for
// Stale windows is measured again, so a count learned under other
// conditions is never kept for good.
package iotune

import (
	"context"
	"sync"
	"time"
)

// Defaults of Config.
const (
	// DefaultWindowBytes is the bytes a measurement window moves: 16
	// files of 4 MiB, enough for one window to span several requests
	// per reader at 16 readers.
	DefaultWindowBytes = 64 << 20
	// DefaultStale is the windows after which a count's measurement is
	// taken again.
	DefaultStale = 16
	// hysteresis is how much better than the current count's rate
	// another count's must be to be moved to.
	hysteresis = 1.05
)

// Config configures a Gate.
type Config struct {
	// Max is the most readers (at least 1); a Gate starts there.
	Max int
	// Fixed, if set, keeps the bound at Max: no tuning.
	Fixed bool
	// WindowBytes is the bytes of one measurement window (0:
	// DefaultWindowBytes).
	WindowBytes int64
	// Stale is the windows after which a count is measured again (0:
	// DefaultStale).
	Stale int
	// Now is the clock (nil: time.Now).
	Now func() time.Time
}

// Gate bounds the readers of one mount. Its methods may be called from
// many goroutines at once.
type Gate struct {
	cfg      Config
	mu       sync.Mutex
	limit    int
	inflight int
	waiters  []chan struct{}
	win      window
	tune     tuner
	changes  uint64
}

// window is a measurement in progress: it runs while a reader is waited
// for, from start, and has moved bytes.
type window struct {
	active bool
	start  time.Time
	bytes  int64
}

// New returns a Gate of cfg.
func New(cfg Config) *Gate {
	cfg.Max = max(cfg.Max, 1)
	if cfg.WindowBytes <= 0 {
		cfg.WindowBytes = DefaultWindowBytes
	}
	if cfg.Stale <= 0 {
		cfg.Stale = DefaultStale
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Gate{cfg: cfg, limit: cfg.Max, tune: newTuner(cfg.Max, cfg.Stale)}
}

// Acquire takes a reader, waiting while the bound is reached, or fails
// with ctx's error.
func (g *Gate) Acquire(ctx context.Context) error {
	g.mu.Lock()
	if g.inflight < g.limit && len(g.waiters) == 0 {
		g.inflight++
		g.mu.Unlock()
		return nil
	}
	ch := make(chan struct{})
	g.waiters = append(g.waiters, ch)
	if !g.win.active {
		// Loads wait for this mount: what it moves from now on is its
		// rate at this count.
		g.win = window{active: true, start: g.cfg.Now()}
	}
	g.mu.Unlock()
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		g.mu.Lock()
		defer g.mu.Unlock()
		for i, w := range g.waiters {
			if w == ch {
				g.waiters = append(g.waiters[:i], g.waiters[i+1:]...)
				return ctx.Err()
			}
		}
		// Granted meanwhile: handed on.
		g.inflight--
		g.grantLocked()
		return ctx.Err()
	}
}

// Release gives a reader back, counting the bytes it read.
func (g *Gate) Release(bytes int64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.inflight--
	if g.win.active {
		g.win.bytes += max(bytes, 0)
		if g.win.bytes >= g.cfg.WindowBytes {
			if d := g.cfg.Now().Sub(g.win.start); d > 0 && !g.cfg.Fixed {
				next := g.tune.observe(g.limit, float64(g.win.bytes)/d.Seconds())
				if next != g.limit {
					g.limit = next
					g.changes++
				}
			}
			g.win = window{active: len(g.waiters) > 0, start: g.cfg.Now()}
		} else if len(g.waiters) == 0 && g.inflight < g.limit-1 {
			// Demand fell below the bound: the window measured the
			// loads, not the mount.
			g.win = window{}
		}
	}
	g.grantLocked()
}

// grantLocked wakes waiters while the bound allows.
func (g *Gate) grantLocked() {
	for len(g.waiters) > 0 && g.inflight < g.limit {
		ch := g.waiters[0]
		g.waiters = g.waiters[1:]
		g.inflight++
		close(ch)
	}
}

// Stats describes a Gate.
type Stats struct {
	Limit    int             // readers allowed now
	Max      int             // the most readers
	Inflight int             // readers now
	Changes  uint64          // times tuning moved the bound
	Rates    map[int]float64 // per reader count, its last measured rate (bytes/s)
	Ages     map[int]int     // per reader count, the windows since it was measured
}

// Stats returns the Gate's state.
func (g *Gate) Stats() Stats {
	g.mu.Lock()
	defer g.mu.Unlock()
	s := Stats{Limit: g.limit, Max: g.cfg.Max, Inflight: g.inflight, Changes: g.changes,
		Rates: make(map[int]float64, len(g.tune.rate)), Ages: make(map[int]int, len(g.tune.rate))}
	for l, r := range g.tune.rate {
		s.Rates[l], s.Ages[l] = r, g.tune.age[l]
	}
	return s
}

// tuner picks the reader count from measured rates: hill climbing over
// halvings and doublings of max with measurements that age.
type tuner struct {
	max   int
	stale int
	rate  map[int]float64 // count -> last rate
	age   map[int]int     // count -> windows since measured
	home  int             // the count settled on (0: none yet)
}

func newTuner(max, stale int) tuner {
	return tuner{max: max, stale: stale, rate: map[int]float64{}, age: map[int]int{}}
}

// neighbours returns the counts one step from l: half and double, within
// 1..max (max itself where doubling passes it).
func (t *tuner) neighbours(l int) []int {
	var out []int
	if l > 1 {
		out = append(out, l/2)
	}
	if l < t.max {
		out = append(out, min(2*l, t.max))
	}
	return out
}

// fresh reports whether count l has a measurement not yet stale.
func (t *tuner) fresh(l int) bool {
	_, ok := t.rate[l]
	return ok && t.age[l] <= t.stale
}

// observe records count l's rate over one window and returns the count
// to use next. The home count (the best so far) changes only to a
// count that beats it by the hysteresis; the next count is a neighbour
// of home that wants measuring (never measured, or stale), else home.
func (t *tuner) observe(l int, rate float64) int {
	for c := range t.age {
		t.age[c]++
	}
	if t.fresh(l) {
		rate = (t.rate[l] + rate) / 2 // a fresh count's rate is averaged, a stale one's replaced
	}
	t.rate[l], t.age[l] = rate, 0
	if t.home == 0 || !t.fresh(t.home) || rate > t.rate[t.home]*hysteresis {
		t.home = l
	}
	for _, n := range t.neighbours(t.home) {
		if !t.fresh(n) {
			return n
		}
	}
	return t.home
}
