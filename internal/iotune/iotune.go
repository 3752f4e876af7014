// Package iotune bounds how many files the engine reads at once from one
// mount, and how, and tunes both by the throughput it measures.
//
// Disks differ in the queue depth and the I/O mode they like: on one
// virtio disk one reader of 4 MiB O_DIRECT requests moved 2.0 GB/s where
// 16 to 64 moved 1.2 to 1.65; on another, 64 buffered readers (the
// kernel's read-ahead) moved 1.6 GB/s and 16 O_DIRECT ones 1.0; an NVMe
// drive wants many O_DIRECT requests in flight. A Gate starts at its most
// readers in the mount's mode (an Arm) and, while loads are waiting for
// a reader (the mount is the bottleneck), measures the bytes each arm
// moves over windows of WindowBytes, moving one step at a time (half or
// double the readers, or, where Config.Modes allows, the other mode)
// toward the best arm it has measured. A window's rate is its files'
// bytes over their readers' shares of the mount's time (each reader's
// time divided by the readers in flight with it), not over the window's
// length: a file ends at once with its bytes, so a window counted by
// length misses the bytes still in flight at its end, and more readers
// hold more of them (at 16 readers of 32 MiB files, twice a window).
// Every measurement ages: a neighbour of the best arm not measured for
// Stale windows is measured again, so an arm learned under other
// conditions is never kept for good; a measurement cut short (the loads
// ended, or a layer range's reads came between) puts the best arm back.
package iotune

import (
	"context"
	"maps"
	"sync"
	"time"
)

// Defaults of Config.
const (
	// DefaultWindowBytes is the bytes a measurement window moves: 8
	// files of 32 MiB, 64 of 4 MiB. On an H200's virtio disk 64 MiB
	// windows (35 ms) measured so unevenly that the arm flipped mode
	// every second window.
	DefaultWindowBytes = 256 << 20
	// DefaultStale is the windows after which an arm's measurement is
	// taken again: each neighbour of the best costs one window in that
	// many.
	DefaultStale = 32
	// hysteresis is how much better than the current count's rate
	// another count's must be to be moved to.
	hysteresis = 1.05
)

// Arm is how a mount's loads read: how many files at once, and whether
// through the page cache.
type Arm struct {
	Readers  int  // files read at once at most
	Buffered bool // read through the page cache, not O_DIRECT
}

// Config configures a Gate.
type Config struct {
	// Max is the most readers (at least 1); a Gate starts there.
	Max int
	// Buffered is the mode a Gate starts in: the mount's.
	Buffered bool
	// Modes lets tuning try the other mode too (a mount that reads with
	// O_DIRECT by default, on a local disk).
	Modes bool
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
	arm      Arm // the arm in force: its Readers bound inflight
	inflight int
	waiters  []*waiter
	win      window
	// share is the share clock: the seconds each reader in flight has
	// had of the mount, summed since the Gate began (the time divided by
	// the readers in flight, at each moment); a reader's share over its
	// read is the clock's advance from its grant to its release.
	share   float64
	shareAt time.Time // when share was last advanced
	tune    tuner
	changes uint64
}

// window is a measurement in progress: it runs while a reader is waited
// for, and counts the bytes of the files its arm's readers ended and
// their shares of the mount's time (seconds).
type window struct {
	active bool
	bytes  int64
	shares float64
}

// Reader is a reader a Gate granted, given back by Release or
// ReleaseUnmeasured.
type Reader struct {
	arm   Arm     // the arm in force at the grant
	share float64 // the Gate's share clock at the grant
}

// Buffered says whether the reader reads through the page cache, not
// with O_DIRECT (the arm in force when it was granted).
func (r Reader) Buffered() bool { return r.arm.Buffered }

// waiter is a load waiting for a reader: ch is closed once r is its.
type waiter struct {
	ch chan struct{}
	r  Reader
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
	return &Gate{cfg: cfg, arm: Arm{Readers: cfg.Max, Buffered: cfg.Buffered}, tune: newTuner(cfg.Max, cfg.Stale, cfg.Modes), shareAt: cfg.Now()}
}

// advanceLocked advances the share clock to now: called before every
// change of inflight.
func (g *Gate) advanceLocked() {
	now := g.cfg.Now()
	if g.inflight > 0 {
		g.share += now.Sub(g.shareAt).Seconds() / float64(g.inflight)
	}
	g.shareAt = now
}

// grantOneLocked takes a reader of the arm in force.
func (g *Gate) grantOneLocked() Reader {
	g.inflight++
	return Reader{arm: g.arm, share: g.share}
}

// Acquire takes a reader, waiting while the bound is reached, or fails
// with ctx's error. The Reader says whether it reads through the page
// cache (the arm in force when it was granted).
func (g *Gate) Acquire(ctx context.Context) (Reader, error) {
	g.mu.Lock()
	if g.inflight < g.arm.Readers && len(g.waiters) == 0 {
		g.advanceLocked()
		r := g.grantOneLocked()
		g.mu.Unlock()
		return r, nil
	}
	w := &waiter{ch: make(chan struct{})}
	g.waiters = append(g.waiters, w)
	// Loads wait for this mount: what it moves from now on is its rate
	// at this count.
	g.win.active = true
	g.mu.Unlock()
	select {
	case <-w.ch:
		return w.r, nil
	case <-ctx.Done():
		g.mu.Lock()
		defer g.mu.Unlock()
		for i, o := range g.waiters {
			if o == w {
				g.waiters = append(g.waiters[:i], g.waiters[i+1:]...)
				return Reader{}, ctx.Err()
			}
		}
		// Granted meanwhile: handed on.
		g.advanceLocked()
		g.inflight--
		g.grantLocked()
		return Reader{}, ctx.Err()
	}
}

// Release gives r back, counting the bytes it read.
func (g *Gate) Release(r Reader, bytes int64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.advanceLocked()
	g.inflight--
	g.measureLocked(r, bytes)
	g.grantLocked()
}

// ReleaseUnmeasured gives back r, whose read says nothing of the mount's
// rate (a few layers of a key, whose read-ahead and request sizes are
// not a whole file's): the window it was part of is dropped.
func (g *Gate) ReleaseUnmeasured(r Reader) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.advanceLocked()
	g.inflight--
	if g.win.active {
		g.win = window{active: len(g.waiters) > 0}
	}
	g.homeLocked()
	g.grantLocked()
}

// measureLocked counts r's bytes and share into the window where r was
// granted under the arm in force (a reader of an arm left behind
// measured that arm), and ends the window once it holds WindowBytes:
// the tuner learns its rate and may change the arm.
func (g *Gate) measureLocked(r Reader, bytes int64) {
	if !g.win.active {
		return
	}
	if r.arm == g.arm {
		g.win.bytes += max(bytes, 0)
		g.win.shares += g.share - r.share
	}
	switch {
	case g.win.bytes >= g.cfg.WindowBytes:
		if g.win.shares > 0 && !g.cfg.Fixed {
			next := g.tune.observe(g.arm, float64(g.win.bytes)/g.win.shares)
			if next != g.arm {
				g.arm = next
				g.changes++
			}
		}
		g.win = window{active: len(g.waiters) > 0}
	case len(g.waiters) == 0 && g.inflight < g.arm.Readers-1:
		// Demand fell below the bound: the window measured the loads,
		// not the mount.
		g.win = window{}
		g.homeLocked()
	}
}

// homeLocked puts the tuner's home arm back in force where a measurement
// of another arm (a neighbour of home, measured again) was cut short:
// the loads after it would otherwise read at an arm kept only to be
// measured, and a layer range's reads, which never measure, would keep
// it for good (on an H200 the layer-wise loads after a run of whole
// loads that left 2 readers in force took 3.1 s, at 16 readers 2.0).
func (g *Gate) homeLocked() {
	if h := g.tune.home; h.Readers > 0 && h != g.arm && !g.cfg.Fixed {
		g.arm = h
		g.changes++
	}
}

// grantLocked wakes waiters while the bound allows.
func (g *Gate) grantLocked() {
	for len(g.waiters) > 0 && g.inflight < g.arm.Readers {
		w := g.waiters[0]
		g.waiters = g.waiters[1:]
		w.r = g.grantOneLocked()
		close(w.ch)
	}
}

// Stats describes a Gate.
type Stats struct {
	Arm      Arm             // the arm in force
	Max      int             // the most readers
	Inflight int             // readers now
	Changes  uint64          // times tuning moved the arm
	Rates    map[Arm]float64 // per arm, its last measured rate (bytes/s)
	Home     Arm             // the arm tuning settled on (zero: none measured)
}

// Stats returns the Gate's state.
func (g *Gate) Stats() Stats {
	g.mu.Lock()
	defer g.mu.Unlock()
	s := Stats{Arm: g.arm, Max: g.cfg.Max, Inflight: g.inflight, Changes: g.changes,
		Rates: maps.Clone(g.tune.rate), Home: g.tune.home}
	return s
}

// tuner picks the arm from measured rates: hill climbing over halvings
// and doublings of the readers (and the other mode, with modes) with
// measurements that age.
type tuner struct {
	max   int
	stale int
	modes bool
	rate  map[Arm]float64 // arm -> last rate
	age   map[Arm]int     // arm -> windows since measured
	home  Arm             // the arm settled on (zero: none yet)
}

func newTuner(max, stale int, modes bool) tuner {
	return tuner{max: max, stale: stale, modes: modes, rate: map[Arm]float64{}, age: map[Arm]int{}}
}

// neighbours returns the arms one step from a: half and double the
// readers within 1..max (max itself where doubling passes it), and with
// modes the other mode.
func (t *tuner) neighbours(a Arm) []Arm {
	var out []Arm
	if a.Readers > 1 {
		out = append(out, Arm{a.Readers / 2, a.Buffered})
	}
	if a.Readers < t.max {
		out = append(out, Arm{min(2*a.Readers, t.max), a.Buffered})
	}
	if t.modes {
		out = append(out, Arm{a.Readers, !a.Buffered})
	}
	return out
}

// fresh reports whether arm a has a measurement not yet stale.
func (t *tuner) fresh(a Arm) bool {
	_, ok := t.rate[a]
	return ok && t.age[a] <= t.stale
}

// observe records arm a's rate over one window and returns the arm to
// use next. The home arm (the best so far) changes only to an arm that
// beats it by the hysteresis; the next arm is a neighbour of home that
// wants measuring (never measured, or stale), else home.
func (t *tuner) observe(a Arm, rate float64) Arm {
	for c := range t.age {
		t.age[c]++
	}
	if t.fresh(a) {
		rate = (t.rate[a] + rate) / 2 // a fresh arm's rate is averaged, a stale one's replaced
	}
	t.rate[a], t.age[a] = rate, 0
	if t.home.Readers == 0 || !t.fresh(t.home) || rate > t.rate[t.home]*hysteresis {
		t.home = a
	}
	for _, n := range t.neighbours(t.home) {
		if !t.fresh(n) {
			return n
		}
	}
	return t.home
}
