package engine

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/internal/engine/removals"
)

// The removal feed (docs/engine.md, "Removal"): the remover records each
// key that leaves the index, and each key a move takes to another mount,
// in its feed (removal.go: published, movedKeys); the daemon's removal
// streams read it (Engine.Removals). A key removed by another node on a
// shared mount leaves this engine's index only when this engine looks at
// its file: a lookup, a pin or a load that finds it gone. So while the
// feed has subscribers, a sweep lists, every interval, the directories
// of the files other nodes may remove (mount.othersRemove) and checks
// those whose names are gone (checker.verify), which drops them as
// vanished: another node's removal becomes a record here within an
// interval and a sweep's round (sweepPace stretches the interval where
// rounds are long).

// defaultSweepInterval is the sweep's interval where vanishSweep.every
// is zero: another node's removal is recorded here within about a
// second.
const defaultSweepInterval = time.Second

// vanishSweep is the sweep's state (the remover's).
type vanishSweep struct {
	once   sync.Once
	every  time.Duration // 0: defaultSweepInterval; set before Removals
	rounds atomic.Uint64 // rounds done (tests wait for them)
	found  atomic.Uint64 // files found gone by the sweep
}

// Removals returns the engine's removal feed: every key that leaves the
// index (evicted, deleted, purged, corrupt, vanished) and every key a
// move takes to another mount, from its first subscription on, and the
// mounts' device classes. The first call starts the sweep that finds the
// files other nodes removed on a shared mount; the feed is closed when
// the engine is.
func (e *Engine) Removals() *removals.Feed {
	e.rm.sweep.once.Do(func() {
		classes := make([]string, len(e.mounts))
		for i, m := range e.mounts {
			classes[i] = className(m.desc.class)
		}
		if e.objs.objs != nil {
			classes = append(classes, objectClass) // at objectTier.index
		}
		e.rm.feed.SetMounts(classes)
		go e.rm.sweep.run(&e.rm.feed, e.busy.down, &e.busy.calls, sweepOf(e))
	})
	if e.busy.calls.closing() {
		e.rm.feed.Close() // at once, not when the sweep's goroutine sees the engine closed
	}
	return &e.rm.feed
}

// sweeper is what a sweep reads of the engine: the indexed files other
// nodes may remove, their directories' listings, and the check that drops
// a file found gone as vanished (checker.verify: true while it is there).
type sweeper struct {
	files   func() []*entry
	readDir func(dir string) ([]fs.DirEntry, error)
	verify  func(ctx context.Context, en *entry) bool
}

// sweepOf is the engine's sweeper.
func sweepOf(e *Engine) sweeper {
	return sweeper{
		files: func() []*entry {
			return e.ix.Files().Matching(nil, func(en *entry) bool { return !en.Spare && e.mounts[en.Mount].othersRemove(en) })
		},
		readDir: e.fs.ReadDir,
		verify:  e.chk.verify,
	}
}

// run runs the sweep's rounds while feed has subscribers, every interval
// or sweepPace times the last round's duration, whichever is longer,
// until down is closed or calls closes, and then closes the feed.
func (s *vanishSweep) run(feed *removals.Feed, down <-chan struct{}, calls *callGate, sw sweeper) {
	defer feed.Close()
	every := s.every
	if every <= 0 {
		every = defaultSweepInterval
	}
	tm := time.NewTimer(every)
	defer tm.Stop()
	for {
		select {
		case <-down:
			return
		case <-tm.C:
		}
		if feed.Subscribers() == 0 {
			tm.Reset(every)
			continue
		}
		if calls.enter() != nil {
			return
		}
		start := time.Now()
		s.round(context.Background(), sw)
		calls.exit()
		tm.Reset(max(every, sweepPace*time.Since(start)))
	}
}

// sweepPace bounds the sweep's share of time: after a round that took d,
// the next starts no sooner than sweepPace × d later, so that the sweep
// of an index of many other nodes' files (a round costs some 1.2 µs a
// file on a local file system: 1.2 s for a million) takes at most a
// fifth of a core, its lag growing with the index instead.
const sweepPace = 4

// round lists the directory of every indexed file that another node
// may remove (mount.othersRemove) and checks those whose names are gone
// from it (checker.verify: a stat), which drops a file gone as vanished.
// A directory whose listing fails is skipped: its files are checked at
// the next round. A name still listed is not checked: a file another
// node replaced at the path holds the key still.
func (s *vanishSweep) round(ctx context.Context, sw sweeper) {
	byDir := map[string][]*entry{}
	for _, en := range sw.files() {
		dir := filepath.Dir(en.Path)
		byDir[dir] = append(byDir[dir], en)
	}
	for dir, list := range byDir {
		ents, err := sw.readDir(dir)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			continue
		}
		have := make(map[string]bool, len(ents))
		for _, d := range ents {
			have[d.Name()] = true
		}
		for _, en := range list {
			if !have[filepath.Base(en.Path)] && !sw.verify(ctx, en) {
				s.found.Add(1)
			}
		}
	}
	s.rounds.Add(1)
}
