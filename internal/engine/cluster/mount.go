package cluster

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/clustercap"
	"github.com/kvhost/kvhost/internal/engine/index"
	"github.com/kvhost/kvhost/internal/engine/space"
)

// Group is what a cluster mount works with of the engine's: its mount,
// this node, the index and the space, and the Host for the rest.
type Group struct {
	Idx   int    // the mount's number (index.Entry.Mount)
	Root  string // the mount's root
	Node  string // this node's id
	Log   *slog.Logger
	Host  Host
	Index *index.Index
	Space *space.Space
	Sp    *space.Mount // the mount's space
	// Policy names the placement policy in this node's summaries ("":
	// none said): a peer of another policy is named in a warning.
	Policy string
	// Clock times a store's wait for room and the ticks' holds of the
	// mount (nil: time.Now; a test's own moves them without sleeping).
	// Not Host.Now: an engine on a clock that stands still would wait
	// forever.
	Clock func() time.Time
}

// wall is the time by g.Clock.
func (g *Group) wall() time.Time {
	if g.Clock != nil {
		return g.Clock()
	}
	return time.Now()
}

// Host is what a cluster mount asks of the engine.
type Host interface {
	// Now is the engine's clock.
	Now() time.Time
	// Rank asks the policy for the ranks of recs; false, asking nothing,
	// where the policy cannot rank.
	Rank(ctx context.Context, recs []abi.RankRecord) (bool, error)
	// Access tells the policy of recs.
	Access(ctx context.Context, recs []abi.AccessRecord)
	// Evicted removes the files of claimed (their entries evicted from
	// the index, their paths held), counts the evictions of recs and
	// tells the policy of them.
	Evicted(ctx context.Context, claimed []*index.Entry, recs []abi.AccessRecord)
	// AdoptFiles indexes the files on the mount whose owner tag is in
	// tags, adding the temporary files of those nodes to temps with their
	// tag; it returns how many files it indexed, and the errors that left
	// the walk incomplete.
	AdoptFiles(ctx context.Context, tags map[uint32]bool, temps map[string]uint32) (int, error)
	// CleanTemp applies the leftover rule to a dead node's temporary file
	// at path and reports whether the file is gone.
	CleanTemp(path string) (gone bool, err error)
	// Purge drops ens, entries of purged namespaces, as a purge does.
	Purge(ctx context.Context, ens []*index.Entry)
	// Clustered reports whether mount (index.Entry.Mount) has a cluster
	// capacity.
	Clustered(mount int) bool
}

// NoSpaceError is Reserve's error where this node's files cannot be kept
// within its share of the cluster's capacity.
type NoSpaceError struct {
	Root                       string
	Own, Limit, Capacity, Size int64
	Why                        string // what keeps the node from more
}

func (e *NoSpaceError) Error() string {
	return fmt.Sprintf("mount %s: this node holds %d bytes and may hold %d of the cluster's %d, %d more needed, %s",
		e.Root, e.Own, e.Limit, e.Capacity, e.Size, e.Why)
}

// TagError is Open's error where a live node shares this node's owner tag.
type TagError struct {
	Node, Other string
	Tag         uint32
}

func (e *TagError) Error() string {
	return fmt.Sprintf("node ids %q and %q share the owner tag %#x: give this node another node_id", e.Node, e.Other, e.Tag)
}

// Open sets up the cluster state of a mount of g with a cluster capacity
// bound: its directory and lock, and checks that no live node shares this
// node's tag. The engine opens it before its rebuild: from the lock on,
// the others take this node for running (clustercap.Live), so that an
// adopter of its files lets go of them at its next read instead of
// evicting files the rebuild indexes. Its first summary waits for its
// first Tick. A Mount returned with an error is to be closed.
func Open(fs fsys.FS, g Group, bound clustercap.Bound, interval time.Duration) (*Mount, error) {
	dir, err := clustercap.OpenDir(fs, g.Root, g.Node)
	if err != nil {
		return nil, err
	}
	c := &Mount{Group: g, site: site{dir: dir, root: g.Root, node: g.Node, log: g.Log, tag: clustercap.Tag(g.Node), interval: interval},
		bound: bound, configured: bound, floor: map[uint64]uint64{}, ahead: map[uint64]int64{},
		run:             g.Host.Now().UnixNano(),
		clusterAgree:    clusterAgree{from: g.Node, capSaid: map[string]int64{}, untenable: map[string]uint64{}, policies: map[string]string{}, odd: map[string]bool{}, files: map[uint32]int64{}},
		clusterView:     clusterView{bad: map[string]bool{}, unknown: map[string]bool{}},
		clusterAdoption: clusterAdoption{walked: map[uint32]int64{}, temps: map[string]uint32{}},
		clusterFlocks:   clusterFlocks{shared: map[string]bool{}, probes: map[string]*lockProbe{}, unproven: map[string]bool{}}}
	c.dead.Store(&map[uint32]bool{})
	if c.interval == 0 {
		c.interval = DefaultInterval
	}
	peers, _, err := dir.ReadAll()
	if err != nil {
		return c, err
	}
	for _, p := range peers {
		if live, _ := clustercap.Live(p, g.Host.Now().UnixNano(), dir.LockFree); live && p.Tag == c.tag {
			return c, &TagError{Node: g.Node, Other: p.Node, Tag: c.tag}
		}
	}
	return c, nil
}

// Close releases the mount's cluster lock; the summaries stay (this
// node's files do).
func (c *Mount) Close() { c.dir.Close() }

// Interval is the mount's cluster interval: a Tick is due each.
func (c *Mount) Interval() time.Duration { return c.interval }

// Capacity is the cluster's capacity of the mount: the bound the nodes
// agreed on as last read (clustercap.Agree), at most this node's
// configured one.
func (c *Mount) Capacity() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.bound.Capacity
}

// FileID draws the id of a file about to be written, tagged with this
// node's owner tag.
func (c *Mount) FileID() uint64 { return clustercap.FileID(c.tag, rand.Uint64()) }

// TwinNote says why none of this node's files is evictable while a twin
// runs, naming it; "" without one.
func (c *Mount) TwinNote() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.clusterTwin.twinNote()
}

// Twinned reports whether a running node of this node's owner tag was
// found: none of the tag's files is evictable meanwhile.
func (c *Mount) Twinned() bool { return c.twinned.Load() }

// Covers reports whether the purge records of c's mount apply to en: a
// file on the mount, or on a mount without a cluster capacity (this
// node's hot tier, a file it moved off the mount), which the node would
// serve after the purge otherwise. Another cluster mount has its own
// records.
func (c *Mount) Covers(en *index.Entry) bool {
	return en.Mount == c.Idx || !c.Host.Clustered(en.Mount)
}

// WritePurge writes a purge record of namespace fp (clustercap.Dir.WritePurge).
func (c *Mount) WritePurge(fp uint64) error {
	_, err := c.dir.WritePurge(fp)
	return err
}

// Purged reports whether en, an entry of a file found on the disk, is
// one that a purge record of c's mount covers (Covers; a record of its
// namespace, the file last written at or before it) at now.
func (c *Mount) Purged(en *index.Entry, now time.Time) bool {
	if !c.Covers(en) {
		return false
	}
	t, ok := c.dir.PurgedAt(en.FP, PurgeLimit(now))
	return ok && en.Ident.Mtime <= t
}

// PurgeLimit is the latest purge record time that applies at now, this
// node's clock: now plus clustercap.PurgeAhead. A record further ahead (a
// garbage name, or a file system clock far off) would purge the
// namespace's files written until then, new ones too, at every tick.
func PurgeLimit(now time.Time) int64 {
	return now.Add(clustercap.PurgeAhead).UnixNano()
}

// Run is the loops of a node's cluster mounts: a Tick each interval.
type Run struct {
	// ctx is the loops' context (nil before start); cancel ends it
	// and with it the loops and a walk of the mount under way.
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// Start starts two loops per mount of ms: its ticks, and its census
// (census.go) every censusIntervals of its interval. They run under a
// context of their own, which Close ends: an adoption walk or census of
// the mount under way stops at its next file, Close does not wait for
// it.
func (r *Run) Start(ctx context.Context, ms []*Mount) {
	ctx, r.cancel = context.WithCancel(context.WithoutCancel(ctx))
	r.ctx = ctx
	for _, c := range ms {
		r.every(ctx, c.interval, func() { c.Tick(ctx) })
		r.every(ctx, censusIntervals*c.interval, func() {
			if err := c.runCensus(ctx); err != nil && ctx.Err() == nil {
				c.Log.Warn("engine: cluster: a census of the mount's files", "mount", c.Root, "err", err)
			}
		})
	}
}

// every runs fn every period (a run that takes longer skips the ticks it
// covers) until ctx ends.
func (r *Run) every(ctx context.Context, period time.Duration, fn func()) {
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		t := time.NewTicker(period)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				fn()
			}
		}
	}()
}

// Done is closed once Close ends the loops' context (nil before Start):
// a tick under way stops at its next file.
func (r *Run) Done() <-chan struct{} {
	if r.ctx == nil {
		return nil
	}
	return r.ctx.Done()
}

// Close stops the loops and closes every mount of ms.
func (r *Run) Close(ms []*Mount) {
	if r.ctx != nil {
		r.cancel()
		r.wg.Wait()
		r.ctx = nil
	}
	for _, c := range ms {
		c.Close()
	}
}
