package engine

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/clustercap"
	"github.com/kvhost/kvhost/internal/engine/index"
	"github.com/kvhost/kvhost/internal/engine/space"
)

// Cluster-wide capacity (docs/cluster.md, "Cluster-wide capacity").
//
// A mount with Mount.ClusterCapacity is shared by several nodes whose
// files together stay within that bound. Each node publishes a summary of
// its own files (package clustercap) every ClusterInterval and whenever a
// store needs more than it claimed; a node that finds the cluster over the
// high watermark evicts its own files ranked below the cut-off that every
// node's summaries give, and the others follow the cut-off it publishes.
// A node removes only its own files (the owner tag in the file id) and
// those of nodes proven dead (summary stale, lock file free, flocks found
// shared with them: probeLocks).
//
// Ranks come from the policy (policy.Ranker, abi.FeatureRank): comparable
// across nodes, lower evicted first. An entry the policy does not rank (a
// plugin without the feature, an entry it was not told of yet, a failed
// call) is ranked by its last access time.

// DefaultClusterInterval is Mount.ClusterInterval when it is zero.
const DefaultClusterInterval = time.Second

// maxRewalkIntervals bounds how long, in cluster intervals, a failed walk
// of the mount for an adopted node's files puts off the next one.
const maxRewalkIntervals = 32

// clusterMount is the cluster state of one mount.
type clusterMount struct {
	dir      *clustercap.Dir
	bound    clustercap.Bound
	interval time.Duration
	tag      uint32

	mu  sync.Mutex // guards the rest; one claim or tick at a time
	own int64      // own bytes at the last count, plus reservations since
	// pending is the bytes reserve granted that the mount's space
	// has not reserved yet (reserveGrant takes them there, giveBack drops
	// them): a count adds them to the space's reservations.
	pending int64
	claim   int64
	seq     uint64
	pub     *clustercap.Summary // the last summary published
	// The rest, in groups, all under mu but where a field says otherwise.
	clusterView
	clusterAdoption
	clusterFlocks
	clusterTwin
	lost  bool  // the last read or write of the directory failed
	since int64 // foreign uses after this time are reported (Unix ns)
	// floor holds, per file id of this node's, the highest rank another
	// node reported for its use of the file (Touch.Rank): the file ranks
	// at least that high here. Entries of files gone are dropped by count.
	floor map[uint64]uint64
	// rankFailed: the policy's last rank call failed (logged once until
	// it succeeds again).
	rankFailed bool
	// ahead holds, by fingerprint, the purge record dated too far ahead
	// of this node's clock to apply (clustercap.PurgeAhead) that a tick
	// logged: each is logged once.
	ahead map[uint64]int64
}

// clusterView is what the last read of a cluster mount's directory found
// of the other nodes (guarded by clusterMount.mu).
type clusterView struct {
	peers []*clustercap.Summary // the live others, as last read
	// watch records, on this node's clock, when each read found a live
	// peer's summary changed: a peer's cut-off stays in force only while
	// the summary carrying it is recent as this node saw it (cutsOf).
	watch clustercap.Watch
	// unclaimed holds, as last read, the summaries of dead nodes whose
	// files no live node's summary counts yet, this node's included
	// (clustercap.Unclaimed): counted beside peers (others).
	unclaimed []*clustercap.Summary
	// fresh holds the running nodes whose summaries the last read found
	// fresh: a tick probes their locks (probeLocks), a claim raise's read
	// does not (no probe on a store's path).
	fresh []*clustercap.Summary
	// bad holds the nodes whose summary the last read could not use
	// (logged once, at the read that first found it so).
	bad map[string]bool
	// unknown holds the nodes of bad that may be running (their summary
	// file fresh, or their lock not found free) and of which no summary
	// was ever read to stand in: nothing says what they hold, so while
	// any is left this node's claim grows no further (clusterMount.reserve,
	// fitsBound): a node that counted them as holding nothing could take
	// the room their files take.
	unknown map[string]bool
}

// clusterAdoption is the dead nodes this node adopted on a cluster mount
// and the walks of their files (guarded by clusterMount.mu but where a
// field says otherwise).
type clusterAdoption struct {
	// dead holds the tags of the dead nodes this node adopted (it holds
	// their adoption locks: their files are its to count and evict);
	// replaced whole under mu, read anywhere (mayEvict holds e.mu).
	dead atomic.Pointer[map[uint32]bool]
	// walked holds the adopted tags whose files a walk of the mount has
	// indexed whole (adoptFiles without an error), each with the run of
	// the dead node it walked for (runOf its summary then): the others are
	// walked again, a tag newly adopted, or of a node found dead after a
	// run since the walk, at once, one adopted before at the first read
	// from rewalkAt (Unix ns), which each failed walk puts off by
	// rewalkWait, doubled from one interval up to maxRewalkIntervals: a
	// directory that stays unreadable must not cost a walk of the whole
	// mount, under mu, at every read.
	walked     map[uint32]int64
	rewalkAt   int64
	rewalkWait time.Duration
	// temps holds the temporary files of adopted nodes that a walk found
	// and that are not gone yet (younger than temp_grace, or their removal
	// failed), with their owner's tag: each read tries them again
	// (cleanTemp).
	temps map[string]uint32
}

// clusterFlocks is what this node found of flocks shared with the other
// nodes of a cluster mount (guarded by clusterMount.mu).
type clusterFlocks struct {
	// shared holds the nodes with which this node found flocks shared on
	// the mount (Summary.LockShared), while a summary of theirs is on the
	// mount (forgetGone): a probe of
	// the node's lock found it held while the node ran (its summary
	// fresh, or stale with its lock held), or its summary names this
	// node. A free lock proves a node dead only where flocks are so
	// shared (mayAdopt): on a mount whose flocks stay on each node every
	// probe finds another node's lock free.
	shared map[string]bool
	// probes holds, per running node not in shared, this node's probes of
	// its lock (probeLocks), while a summary of its is on the mount
	// (forgetGone).
	probes map[string]*lockProbe
	// unproven holds the dead nodes not adopted for want of shared
	// flocks, as the last read found them (logged once).
	unproven map[string]bool
	// shadowed holds the dead nodes not adopted because a running peer
	// carries their owner tag (read), as the last read found them
	// (logged once).
	shadowed map[string]bool
}

// clusterTwin is what this node found of nodes of its own owner tag: a
// twin of another node_id, or a second copy of itself (guarded by
// clusterMount.mu but where a field says otherwise).
type clusterTwin struct {
	// twin is a running node whose summary carries this node's owner tag,
	// as the last read found ("" if none): another node_id of the tag that
	// the start's check did not see (both started at once). Neither can
	// tell its files from the other's, so while twinned this node removes
	// none of the tag's (mayEvict: twinned is read anywhere).
	twin    string
	twinned atomic.Bool
	// copied: at the last tick another process held this node's lock file
	// (clustercap.Dir.Relock), a second copy of this node: set the twin.
	copied bool
}

// lockProbe is this node's probing of a running node's lock (probeLocks).
type lockProbe struct {
	at   int64  // the last probe (Unix ns)
	seq  uint64 // the node's summary at the last probe that found the lock free
	free int    // probes that found it free, each with the node's summary grown since the last
	said bool   // logged that flocks are not shared with it
}

// Lock probes of running nodes (probeLocks).
const (
	// maxLockProbes bounds the probes of one read.
	maxLockProbes = 4
	// unsharedProbes is how many probes must find a running node's lock
	// free, its summary growing in between, before this node logs that
	// flocks are not shared with it.
	unsharedProbes = 3
)

// clusterRun is the engine's cluster loops.
type clusterRun struct {
	// ctx is the loops' context (nil before start); cancel ends it
	// and with it the loops and a walk of the mount under way.
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// fileID draws the id of a file about to be written: with a cluster
// mount among mounts, tagged with this node's owner tag.
func fileID(mounts []*mount) uint64 {
	for _, m := range mounts {
		if m.cluster != nil {
			return clustercap.FileID(m.cluster.tag, rand.Uint64())
		}
	}
	return newFileID()
}

// openCluster sets up the cluster state of every mount with a cluster
// capacity: its directory and lock, no spares made ahead there, and
// checks that no live node shares this node's tag. Open calls it before the rebuild: from the lock on,
// the others take this node for running (clustercap.Live), so that an
// adopter of its files lets go of them at its next read instead of
// evicting files the rebuild indexes. Its first summary waits for
// countCluster. On an error the caller closes the cluster (clusterRun.close).
func (e *Engine) openCluster() error {
	for i, cm := range e.cfg.Mounts {
		if cm.ClusterCapacity == 0 {
			continue
		}
		m := e.mounts[i]
		if cm.ClusterCapacity < 0 || cm.ClusterInterval < 0 || m.raw != nil {
			return fmt.Errorf("%w: mount %s: cluster capacity %d, interval %v: want >= 0, on a mount of kvhost's layout", ErrInvalid, m.root, cm.ClusterCapacity, cm.ClusterInterval)
		}
		hf, lf := m.sp.Watermarks()
		b, err := clustercap.NewBound(cm.ClusterCapacity, hf, lf)
		if err != nil {
			return fmt.Errorf("%w: mount %s: %w", ErrInvalid, m.root, err)
		}
		dir, err := clustercap.OpenDir(e.fs, m.root, e.node)
		if err != nil {
			return fmt.Errorf("engine: mount %s: %w", m.root, err)
		}
		c := &clusterMount{dir: dir, bound: b, interval: cm.ClusterInterval, tag: clustercap.Tag(e.node), floor: map[uint64]uint64{}, ahead: map[uint64]int64{},
			clusterView:     clusterView{bad: map[string]bool{}, unknown: map[string]bool{}},
			clusterAdoption: clusterAdoption{walked: map[uint32]int64{}, temps: map[string]uint32{}},
			clusterFlocks:   clusterFlocks{shared: map[string]bool{}, probes: map[string]*lockProbe{}, unproven: map[string]bool{}}}
		c.dead.Store(&map[uint32]bool{})
		if c.interval == 0 {
			c.interval = DefaultClusterInterval
		}
		m.cluster = c // it keeps no spares (spareCapable)
		peers, _, err := dir.ReadAll()
		if err != nil {
			return fmt.Errorf("engine: mount %s: %w", m.root, err)
		}
		for _, p := range peers {
			if live, _ := clustercap.Live(p, e.now().UnixNano(), dir.LockFree); live && p.Tag == c.tag {
				return fmt.Errorf("%w: mount %s: node ids %q and %q share the owner tag %#x: give this node another node_id", ErrInvalid, m.root, e.node, p.Node, c.tag)
			}
		}
	}
	return nil
}

// countCluster publishes the first summary of every cluster mount, after
// the rebuild (it counts the files already there).
func (e *Engine) countCluster(ctx context.Context) error {
	for _, m := range e.mounts {
		if m.cluster == nil {
			continue
		}
		m.cluster.tick(ctx, e, m)
		if err := ctx.Err(); err != nil { // the tick stopped short: no summary
			return fmt.Errorf("engine: mount %s: %w", m.root, err)
		}
	}
	return nil
}

// start starts one loop per cluster mount. Its ticks run under a
// context of their own, which close ends: an adoption walk of the
// mount under way stops at its next file, Close does not wait for it.
func (r *clusterRun) start(ctx context.Context, e *Engine) {
	ctx, r.cancel = context.WithCancel(context.WithoutCancel(ctx))
	r.ctx = ctx
	for _, m := range e.mounts {
		if m.cluster == nil {
			continue
		}
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			t := time.NewTicker(m.cluster.interval)
			defer t.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
					m.cluster.tick(ctx, e, m)
				}
			}
		}()
	}
}

// close stops the loops and releases the cluster lock of every mount of
// mounts; the summaries stay (this node's files do).
func (r *clusterRun) close(mounts []*mount) {
	if r.ctx != nil {
		r.cancel()
		r.wg.Wait()
		r.ctx = nil
	}
	for _, m := range mounts {
		if m.cluster != nil {
			m.cluster.dir.Close()
		}
	}
}

// mayEvict reports whether this node may remove en's file: on a cluster
// mount, only its own files and those of the dead nodes it adopted, and
// none of its tag while another running node has that tag (twinned).
// It reads only en's immutable file id and the mount's atomics: callers
// hold e.mu (eviction), index.mu (purges) or no lock (a pin's check,
// othersRemove).
func (m *mount) mayEvict(en *entry) bool {
	c := m.cluster
	if c == nil {
		return true
	}
	o, ok := clustercap.Owner(en.FID)
	if !ok || (o == c.tag && c.twinned.Load()) {
		return false
	}
	return o == c.tag || (*c.dead.Load())[o]
}

// ranked is one of this node's entries with its eviction rank.
type ranked struct {
	en   *entry
	rank uint64
}

// rank is en's eviction rank without the policy: its last access (Unix
// nanoseconds).
func rank(en *entry) uint64 { return uint64(max(en.Last, 0)) }

// count takes stock of m for c: this node's evictable entries by rank,
// its bytes (with stores in flight) and the other nodes' files it used
// since c.since. Called with c.mu held.
func (c *clusterMount) count(ctx context.Context, e *Engine, m *mount) (own []ranked, bytes int64, touches []clustercap.Touch) {
	dead := *c.dead.Load()
	var foreign []ranked // used since c.since: touches
	var indexed int64
	e.ix.Each(func(en *entry) {
		if en.Mount != m.idx {
			return
		}
		indexed += en.Size
		o, ok := clustercap.Owner(en.FID)
		switch {
		case ok && (o == c.tag || dead[o]):
			own = append(own, ranked{en, rank(en)})
			bytes += en.Size
		case ok && en.Last > c.since && len(foreign) < clustercap.MaxTouches:
			foreign = append(foreign, ranked{en, rank(en)})
			touches = append(touches, clustercap.Touch{ID: en.FID, Time: en.Last})
		}
	})
	used, _ := e.space.Usage(m.sp)
	// Reservations and files on their way out, and grants the space has
	// not reserved yet: a grant moves from pending to used in one hold of
	// c.mu (reserveGrant), which this count holds, so it counts once.
	bytes += max(0, used-indexed) + c.pending

	c.policyRanks(ctx, e, m, own, foreign)
	for i := range foreign {
		touches[i].Rank = foreign[i].rank
	}
	kept := make(map[uint64]uint64, len(c.floor))
	for i := range own {
		if f, ok := c.floor[own[i].en.FID]; ok {
			own[i].rank = max(own[i].rank, f)
			kept[own[i].en.FID] = f
		}
	}
	c.floor = kept
	slices.SortFunc(own, func(a, b ranked) int { return cmp.Compare(a.rank, b.rank) })
	return own, bytes, touches
}

// policyRanks replaces the last-access ranks of own and foreign by the
// policy's where it gives one (policy.Ranker): in batches, in one call.
// A failed call leaves every rank as it was. Called with c.mu held.
func (c *clusterMount) policyRanks(ctx context.Context, e *Engine, m *mount, own, foreign []ranked) {
	n := len(own) + len(foreign)
	if n == 0 {
		return
	}
	now := uint64(e.now().UnixNano())
	recs := make([]abi.RankRecord, 0, n)
	for _, set := range [][]ranked{own, foreign} {
		for _, r := range set {
			recs = append(recs, abi.RankRecord{Entry: r.en.ID, Time: now})
		}
	}
	ok, err := e.policyRank(ctx, recs)
	switch {
	case err != nil:
		if !c.rankFailed {
			e.log.Warn("engine: policy ranks unavailable; ranking this node's files by last access", "mount", m.root, "err", err)
		}
		c.rankFailed = true
		return
	case !ok:
		return
	}
	c.rankFailed = false
	i := 0
	for _, set := range [][]ranked{own, foreign} {
		for j := range set {
			if recs[i].State == abi.RankKnown {
				set[j].rank = recs[i].Rank
			}
			i++
		}
	}
}

// policyRank asks the engine's policy for the ranks of recs. It reports
// false, asking nothing, when the policy cannot rank (no policy.Ranker, or
// no abi.FeatureRank).
func (e *Engine) policyRank(ctx context.Context, recs []abi.RankRecord) (bool, error) {
	p := e.pol
	if sp, ok := p.(*switchPolicy); ok {
		h := sp.acquire()
		defer h.calls.Done()
		p = h.p
	}
	r, ok := p.(policy.Ranker)
	if !ok || !p.Features().Has(abi.FeatureRank) {
		return false, nil
	}
	if err := r.Rank(ctx, recs); err != nil {
		return false, err
	}
	return true, nil
}

// read reads the other nodes' summaries: the live ones become c.peers;
// the dead ones whose files no live node counts yet (none names them
// adopted, nor has this node walked for them) become c.unclaimed; of the
// dead ones (summary stale, lock free; or a summary file that does
// not decode, stale, lock free: readBad), those whose adoption lock
// this node holds or takes become c.dead, and their files on the mount
// are indexed when newly adopted (they may have been written after this
// node's start) or found dead after another run (runOf), and again until
// a walk of the mount completes (after a failed walk, at the first read
// from c.rewalkAt); a node adopted before that runs again is released, and so
// is one no longer read at all; one whose files are all gone is retired
// (retire). Touches of this node's files raise their last access. A
// running node of this node's owner tag is recorded (setTwin). A read that fails
// releases every adopted node: this node cannot tell whether they run
// again. Called with c.mu held.
func (c *clusterMount) read(ctx context.Context, e *Engine, m *mount) error {
	sums, bad, err := c.dir.ReadAll()
	if err != nil {
		c.releaseAll(e, m)
		return err
	}
	now := e.now().UnixNano()
	c.peers = c.peers[:0]
	was := *c.dead.Load()
	dead := map[uint32]bool{}
	walk := map[uint32]bool{}    // adopted, their files not all indexed yet
	names := map[uint32]string{} // the nodes of dead
	runs := map[uint32]int64{}   // the runs of dead (runOf)
	// The nodes whose summary this read could not use, their last one read
	// standing in: a run since then is not seen (runOf), so none retires.
	stood := map[string]bool{}
	var deadSums []*clustercap.Summary // the dead nodes' summaries
	defer func() {
		// The adopted tags are published once their files are indexed:
		// a node counted as adopted is counted whole.
		defer c.dead.Store(&dead)
		for tag := range c.walked {
			if !dead[tag] {
				delete(c.walked, tag) // released: walked again if adopted again
			}
		}
		if len(walk) > 0 {
			// Their files are this node's bytes from now on, before its
			// next count: their owners' summaries no longer count them.
			// Those indexed of the tags adopted before are counted already.
			again := map[uint32]bool{}
			for tag := range walk {
				again[tag] = was[tag]
			}
			before := bytesOf(e.ix, m, again)
			n, err := e.adoptFiles(ctx, m, walk, c.temps)
			if err != nil {
				c.rewalkWait = min(max(2*c.rewalkWait, c.interval), maxRewalkIntervals*c.interval)
				c.rewalkAt = now + c.rewalkWait.Nanoseconds()
				if ctx.Err() == nil { // else the engine closes: the walk stopped
					e.log.Warn("engine: cluster: indexing a dead node's files; walking the mount again later", "mount", m.root, "in", c.rewalkWait, "err", err)
				}
			} else {
				c.rewalkWait = 0
				for tag := range walk {
					c.walked[tag] = runs[tag]
				}
			}
			e.log.Info("engine: cluster: adopted the files of dead nodes", "mount", m.root, "files", n)
			c.own += bytesOf(e.ix, m, walk) - before
		}
		c.cleanTemps(e, m, dead)
		// The dead nodes this node's count covers whole: walked. Taken
		// before retire, which forgets those it retires (covered too).
		walked := map[string]bool{}
		for tag := range c.walked {
			if dead[tag] {
				walked[names[tag]] = true
			}
		}
		c.unclaimed = clustercap.Unclaimed(deadSums, c.peers, func(node string) bool { return walked[node] })
		c.retire(e, m, dead, names, stood)
	}()
	adopt := func(node string, tag uint32, run int64) {
		ok, err := c.dir.Adopt(node)
		if err != nil {
			e.log.Warn("engine: cluster: adoption lock", "mount", m.root, "node", node, "err", err)
		}
		if ok {
			dead[tag] = true
			names[tag] = node
			runs[tag] = run
			// A node that ran again since the walk (its summary is not
			// the one walked for) may have stored files the walk never
			// saw: a new adoption, walked at once.
			w, walked := c.walked[tag]
			ranAgain := walked && w != run
			if ranAgain {
				delete(c.walked, tag)
			}
			if ranAgain || !walked && (!was[tag] || now >= c.rewalkAt) {
				walk[tag] = true
			}
		}
	}
	touched := map[uint64]clustercap.Touch{} // by file id: the latest use, the highest rank
	read := map[string]bool{}                // the nodes of sums
	twin := ""                               // a running node of this node's tag
	var fresh []*clustercap.Summary          // the nodes whose summary is fresh
	unproven := map[string]bool{}
	// proven holds the dead nodes found with flocks shared (their free
	// locks prove them dead), adopted once the read knows every running
	// node's tag (adoptProven).
	type deadNode struct {
		node string
		tag  uint32
		run  int64
	}
	var proven []deadNode
	// adoptProven notes a dead node for adoption where flocks are found
	// shared with it, else notes it unproven.
	adoptProven := func(node string, tag uint32, run int64) {
		if c.shared[node] {
			proven = append(proven, deadNode{node, tag, run})
		} else {
			unproven[node] = true
		}
	}
	for _, s := range sums {
		read[s.Node] = true
		if slices.Contains(s.LockShared, e.node) {
			c.shared[s.Node] = true // it found this node's lock held
		}
		stale := now-s.Time >= clustercap.StaleIntervals*s.Interval
		live, err := clustercap.Live(s, now, c.dir.LockFree)
		if err != nil {
			e.log.Warn("engine: cluster lock probe", "mount", m.root, "node", s.Node, "err", err)
		} else if live && stale {
			c.shared[s.Node] = true // its lock found held
		}
		if !live {
			deadSums = append(deadSums, s)
			adoptProven(s.Node, s.Tag, runOf(s))
			continue
		}
		if !stale {
			fresh = append(fresh, s)
		}
		if err := c.dir.Release(s.Node); err != nil { // it runs again: its files are its own
			e.log.Warn("engine: cluster: adoption lock", "mount", m.root, "node", s.Node, "err", err)
		}
		c.peers = append(c.peers, s)
		if s.Tag == c.tag {
			twin = s.Node
		}
		for _, t := range s.Touches {
			if o, ok := clustercap.Owner(t.ID); ok && o == c.tag {
				// A use is at most now: a time in this node's future (the
				// other node's clock ahead) would outrank every use here
				// until this node's clock caught up.
				u := touched[t.ID]
				touched[t.ID] = clustercap.Touch{ID: t.ID, Time: max(u.Time, min(t.Time, now)), Rank: max(u.Rank, t.Rank)}
			}
		}
	}
	if twin == "" && c.copied {
		twin = e.node + " (another copy: it holds this node's lock file)"
	}
	c.watch.See(c.peers, now)
	c.setTwin(e, m, twin)
	c.readBad(e, m, bad, read, now, adoptProven)
	// A dead node whose owner tag a running peer carries (another node_id
	// of the tag, started once the dead one's summary went stale) is not
	// adopted: its files cannot be told from the running node's, which a
	// walk for the tag would index as the dead node's and this node then
	// evict. The running node counts and evicts the tag's files it
	// indexed as its own; the dead node's last summary stays counted
	// (Unclaimed). This node's own tag is no peer's to guard: its files
	// are its own either way (and none is evicted while twinned).
	carried := map[uint32]string{}
	for _, p := range c.peers {
		if p.Tag != c.tag {
			carried[p.Tag] = p.Node
		}
	}
	shadowed := map[string]bool{}
	for _, dn := range proven {
		if live, ok := carried[dn.tag]; ok {
			shadowed[dn.node] = true
			if !c.shadowed[dn.node] {
				e.log.Warn("engine: cluster: a dead node has the owner tag of a running node, whose files cannot be told from its own: not adopted; the running node counts and evicts the tag's files it indexed, and the dead node's last summary stays counted",
					"mount", m.root, "node", dn.node, "running", live, "tag", fmt.Sprintf("%#x", dn.tag))
			}
			continue
		}
		adopt(dn.node, dn.tag, dn.run)
	}
	c.shadowed = shadowed
	c.forgetGone(read)
	c.fresh = fresh
	c.noteUnproven(e, m, unproven)
	for node := range c.bad {
		if read[node] {
			stood[node] = true
		}
	}
	if len(touched) == 0 {
		return nil
	}
	// The use is an access of the file: the policy hears of it as a hit
	// at its time, and the file ranks at least as the user ranks it.
	recs := e.ix.Touch(m.idx, func(fid uint64) (int64, bool) {
		t, ok := touched[fid]
		if ok {
			c.floor[fid] = max(c.floor[fid], t.Rank)
		}
		return t.Time, ok
	})
	e.access(ctx, recs)
	return nil
}

// forgetGone forgets the pairings and probes of the nodes that have no
// summary on the mount any more, readable (read) or not (c.bad): retired
// (by this node or another), or removed by hand. Nodes come and go under
// names of their own (a pod's host name), and the sets grew by one name
// per node ever seen; the pairings are published in every summary. A node
// of a forgotten name that runs again is probed again (its first probe
// pairs where flocks are shared), or pairs through its own summary.
// Called with c.mu held, after readBad.
func (c *clusterMount) forgetGone(read map[string]bool) {
	gone := func(node string) bool { return !read[node] && !c.bad[node] }
	maps.DeleteFunc(c.shared, func(node string, _ bool) bool { return gone(node) })
	maps.DeleteFunc(c.probes, func(node string, _ *lockProbe) bool { return gone(node) })
}

// probeLocks probes, once a tick, the locks of running nodes (fresh:
// their summaries are fresh) with which flocks are not yet found shared
// (c.shared), at most maxLockProbes of them, those probed longest ago
// first: a lock found held proves flocks shared between the two nodes (a
// probe reaches the other's lock), so that its being free may later prove
// the other dead (read). A node whose lock is found free unsharedProbes
// times, its summary grown between each two, ran through the probes:
// flocks do not reach between the two nodes (an NFS mount with
// local_lock=flock, local_lock=all or nolock on either), and this node
// says so, once. Called with c.mu held.
func (c *clusterMount) probeLocks(e *Engine, m *mount, fresh []*clustercap.Summary, now int64) {
	var due []*clustercap.Summary
	for _, s := range fresh {
		if c.shared[s.Node] {
			delete(c.probes, s.Node)
			continue
		}
		if c.probes[s.Node] == nil {
			c.probes[s.Node] = &lockProbe{}
		}
		due = append(due, s)
	}
	slices.SortFunc(due, func(a, b *clustercap.Summary) int { return cmp.Compare(c.probes[a.Node].at, c.probes[b.Node].at) })
	for _, s := range due[:min(len(due), maxLockProbes)] {
		p := c.probes[s.Node]
		p.at = now
		free, err := c.dir.LockFree(s.Node)
		switch {
		case err != nil:
			e.log.Debug("engine: cluster lock probe of a running node", "mount", m.root, "node", s.Node, "err", err)
		case !free:
			c.shared[s.Node] = true
			delete(c.probes, s.Node)
			e.log.Debug("engine: cluster: flocks shared with another node", "mount", m.root, "node", s.Node)
		case p.free == 0 || s.Seq > p.seq:
			p.free++
			p.seq = s.Seq
			if p.free >= unsharedProbes && !p.said {
				p.said = true
				e.log.Error("engine: cluster: another node's lock file reads free while it runs: flocks do not reach between the two nodes (an NFS mount with local_lock=flock, local_lock=all or nolock?); neither will take the other for dead, and a dead node's files stay counted but not evicted until it runs again",
					"mount", m.root, "node", s.Node, "probes", p.free)
			}
		}
	}
}

// noteUnproven logs, once per node while it stays so, each dead node
// (unproven) that this node does not adopt for want of shared flocks
// (c.shared): its lock's being free proves nothing. Called with c.mu
// held.
func (c *clusterMount) noteUnproven(e *Engine, m *mount, unproven map[string]bool) {
	for node := range unproven {
		if !c.unproven[node] {
			e.log.Warn("engine: cluster: a node looks dead (summary stale, lock free), but this node never found flocks shared with it, so a free lock proves nothing: not adopted; its files stay, evicted by no node, until it runs again",
				"mount", m.root, "node", node)
		}
	}
	c.unproven = unproven
}

// lockShared names the nodes with which this node found flocks shared
// (Summary.LockShared), at most clustercap.MaxAdopted of them. Called
// with c.mu held.
func (c *clusterMount) lockShared() []string {
	out := slices.Sorted(maps.Keys(c.shared))
	return out[:min(len(out), clustercap.MaxAdopted)]
}

// runOf identifies the run of a dead node by its last summary s: the
// time s was published. A node publishes no summary once dead, so a
// summary of another time, read while its adoption is held, means the
// node ran again since (and may have stored files meanwhile).
func runOf(s *clustercap.Summary) int64 { return s.Time }

// twinNote says why none of this node's files is evictable while a twin
// runs (setTwin), naming it; "" without one. Called with c.mu held.
func (c *clusterMount) twinNote() string {
	if c.twin == "" {
		return ""
	}
	return fmt.Sprintf("none of its files evictable while node %q runs with its owner tag", c.twin)
}

// setTwin records twin, a running node of this node's owner tag that a
// read found ("" if none), logging when one is found and when none is
// left. Called with c.mu held.
func (c *clusterMount) setTwin(e *Engine, m *mount, twin string) {
	switch {
	case twin == c.twin:
	case twin != "":
		e.log.Error("engine: cluster: another running node has this node's owner tag; removing none of the tag's files, which cannot be told apart, until one of them runs with another node_id",
			"mount", m.root, "node", e.node, "other", twin, "tag", fmt.Sprintf("%#x", c.tag))
	default:
		e.log.Info("engine: cluster: no other running node has this node's owner tag any more", "mount", m.root, "other", c.twin)
	}
	c.twin = twin
	c.twinned.Store(twin != "")
}

// retire retires the dead nodes of dead (names: their names) whose
// files are all gone: a walk of the mount completed (c.walked), no entry
// of theirs is left on m, nor a file of theirs whose removal failed or
// is under way (leftOf), no temporary file of theirs either (c.temps);
// but not one in stood, whose summary the read could not use (the last
// one read stood in for it): it may have run, and stored files, since
// the walk (runOf could not tell).
// Dir.Retire removes their summaries, locks and adoption files; a node
// retired leaves dead (and c.walked). Then it lets go of every adoption
// this node holds of a node not in dead: one retired by another node
// meanwhile (in neither of ReadAll's lists), or one whose summary could
// not be read (unknown). Called with c.mu held.
func (c *clusterMount) retire(e *Engine, m *mount, dead map[uint32]bool, names map[uint32]string, stood map[string]bool) {
	temps := map[uint32]bool{}
	for _, tag := range c.temps {
		temps[tag] = true
	}
	for tag := range dead {
		if _, ok := c.walked[tag]; !ok || temps[tag] || stood[names[tag]] || bytesOf(e.ix, m, map[uint32]bool{tag: true}) > 0 || leftOf(e.ix, m, tag) {
			continue
		}
		ok, err := c.dir.Retire(names[tag])
		if err != nil {
			e.log.Warn("engine: cluster: retiring a dead node", "mount", m.root, "node", names[tag], "err", err)
		}
		if ok {
			e.log.Info("engine: cluster: retired a dead node, none of its files left", "mount", m.root, "node", names[tag])
			delete(dead, tag)
			delete(c.walked, tag)
		}
	}
	for _, node := range c.dir.Adopted() {
		if tag := clustercap.Tag(node); dead[tag] && names[tag] == node {
			continue
		}
		if err := c.dir.Release(node); err != nil {
			e.log.Warn("engine: cluster: adoption lock", "mount", m.root, "node", node, "err", err)
		}
	}
}

// readBad handles the summaries of bad (ReadAll's *SummaryErrors) of
// nodes not in read (those have a last summary standing in). A node whose
// summary does not decode is dead once the file is as stale as Live asks
// of a summary (StaleIntervals of this mount's interval, by the file's
// modification time; an unknown time is not stale) and its lock is free:
// a running node holds its lock, and a stopped one of this version left
// its summary whole (a crash while publishing, a version whose summary
// this one cannot read). adopt adopts it, its run identified by the
// file's modification time (as runOf). A node whose summary cannot be
// read (the file system's error) is never adopted. Either kind, unless
// its file is so stale and its lock free, may be running: it goes into
// c.unknown, and this node's claim grows no further while any is there.
// Each node is logged once while its summary stays bad. Called with c.mu
// held.
func (c *clusterMount) readBad(e *Engine, m *mount, bad []error, read map[string]bool, now int64, adopt func(node string, tag uint32, run int64)) {
	was, wasUnknown := c.bad, c.unknown
	c.bad = make(map[string]bool, len(bad))
	c.unknown = map[string]bool{}
	for _, err := range bad {
		var se *clustercap.SummaryError
		if !errors.As(err, &se) {
			continue
		}
		c.bad[se.Node] = true
		if was[se.Node] {
			e.log.Debug("engine: cluster summary skipped", "mount", m.root, "err", err)
		} else {
			e.log.Warn("engine: cluster summary skipped", "mount", m.root, "err", err)
		}
		if read[se.Node] {
			continue
		}
		live := true // no modification time: no sign it stopped
		if !se.ModTime.IsZero() {
			var perr error
			if live, perr = clustercap.LiveAt(se.Node, se.ModTime.UnixNano(), int64(c.interval), now, c.dir.LockFree); perr != nil {
				e.log.Warn("engine: cluster lock probe", "mount", m.root, "node", se.Node, "err", perr)
			}
		}
		if live {
			c.unknown[se.Node] = true
			if !wasUnknown[se.Node] {
				e.log.Warn("engine: cluster: a node that may be running has a summary this node cannot use, and none of it was read before: its files cannot be counted, so this node's claim grows no further until it can (or the node is found dead)",
					"mount", m.root, "node", se.Node, "claim", c.claim)
			}
			continue
		}
		if errors.Is(err, clustercap.ErrSummary) {
			adopt(se.Node, clustercap.Tag(se.Node), se.ModTime.UnixNano())
		}
	}
}

// releaseAll gives up the adoption of every dead node: their files are no
// longer this node's to count or evict (its next count leaves them out).
// Called with c.mu held.
func (c *clusterMount) releaseAll(e *Engine, m *mount) {
	c.dead.Store(&map[uint32]bool{})
	clear(c.walked)
	for _, node := range c.dir.Adopted() {
		if err := c.dir.Release(node); err != nil {
			e.log.Warn("engine: cluster: adoption lock", "mount", m.root, "node", node, "err", err)
		}
	}
}

// others is the summaries this node's claims and cut-offs count beside
// its own: the live peers' and the unclaimed dead nodes'. Called with
// c.mu held.
func (c *clusterMount) others() []*clustercap.Summary {
	return slices.Concat(c.peers, c.unclaimed)
}

// cutsOf is others for Decide at now (Unix ns): the cut-offs of the
// summaries that may have stood, as this node saw them, longer than the
// window (two intervals) since their cut cleared (clustercap.Watch.Cuts),
// so that a peer whose publications stalled (its lock held, its last
// summary kept) does not keep an old cut in force. Called with c.mu held.
func (c *clusterMount) cutsOf(now int64) []*clustercap.Summary {
	return c.watch.Cuts(c.others(), now, 2*int64(c.interval))
}

// adoptedNames names the dead nodes whose files c.own counts whole: this
// node holds their adoption and a walk of the mount for them completed
// (Summary.Adopted). Called with c.mu held.
func (c *clusterMount) adoptedNames() []string {
	dead := *c.dead.Load()
	var out []string
	for _, node := range c.dir.Adopted() {
		tag := clustercap.Tag(node)
		if _, walked := c.walked[tag]; walked && dead[tag] {
			out = append(out, node)
		}
	}
	slices.Sort(out)
	return out
}

// publish writes c's summary with bytes and c.claim; cut, if non-zero, is
// a cut-off this node computed now. Called with c.mu held.
func (c *clusterMount) publish(e *Engine, sketch clustercap.Sketch, touches []clustercap.Touch, cut uint64) error {
	c.seq++
	c.claim = max(c.claim, c.own)
	s := &clustercap.Summary{Version: clustercap.SummaryVersion, Node: e.node, Tag: c.tag, Seq: c.seq, Time: e.now().UnixNano(),
		Interval: int64(c.interval), Bytes: c.own, Claim: c.claim, Sketch: sketch, Touches: touches, Adopted: c.adoptedNames(), LockShared: c.lockShared()}
	switch {
	case cut > 0:
		s.Cut, s.CutTime = cut, s.Time
	case c.pub != nil:
		s.Cut, s.CutTime = c.pub.Cut, c.pub.CutTime
	}
	if err := c.dir.Publish(s); err != nil {
		return err
	}
	c.pub = s
	return nil
}

// tick is the periodic work on a cluster mount: read the others, apply
// the purge records (applyPurges), count, evict below the cut-off,
// publish. It reads first: the count is then of
// the nodes adopted now, none that the read found running again. A failed
// read or write leaves the node on its last claim (reserve evicts its own
// files to stay within it).
func (c *clusterMount) tick(ctx context.Context, e *Engine, m *mount) {
	c.mu.Lock()
	defer c.mu.Unlock()
	start := e.now().UnixNano()
	c.relock(e, m)
	err := c.read(ctx, e, m)
	if ctx.Err() != nil {
		return // the engine closes, or its start was cancelled: a walk stopped short
	}
	c.applyPurges(ctx, e, m) // before the count: the files it removes are not counted
	if err == nil {
		c.probeLocks(e, m, c.fresh, start)
	}
	own, bytes, touches := c.count(ctx, e, m)
	c.own = bytes
	if err != nil {
		c.lose(e, m, err)
		return
	}
	items := make([]clustercap.Item, len(own))
	for i, r := range own {
		items[i] = clustercap.Item{Rank: r.rank, Bytes: r.en.Size}
	}
	sketch := clustercap.NewSketch(items, clustercap.SketchPoints)
	p := c.bound.Decide(start, sketch, c.own, c.cutsOf(start), 2*int64(c.interval))
	if p.Cut > 0 {
		if freed := c.evict(ctx, e, m, own, p.Cut, 0); freed > 0 {
			own, c.own, _ = c.count(ctx, e, m)
			items = items[:0]
			for _, r := range own {
				items = append(items, clustercap.Item{Rank: r.rank, Bytes: r.en.Size})
			}
			sketch = clustercap.NewSketch(items, clustercap.SketchPoints)
		}
	}
	// A tick only lowers the claim: raising it is reserve's write-then-read.
	c.claim = min(c.claim, c.own+c.bound.Grant(len(c.peers)+1, 0))
	cut := uint64(0)
	if p.Computed {
		cut = p.Cut
	}
	if err := c.publish(e, sketch, touches, cut); err != nil {
		c.lose(e, m, err)
		return
	}
	c.since = start
	if c.lost {
		c.lost = false
		e.log.Info("engine: cluster summaries readable again", "mount", m.root)
	}
}

// relock checks that this node's lock is still on the file at its lock
// path, and locks the file there anew where it is not (Dir.Relock): a
// node that took this one for dead may have retired it, removing its lock
// file, while it ran. Where another process holds the file there, a
// second copy of this node runs: c.copied makes it this node's twin at
// the next read (setTwin), so that it removes none of their files, which
// it cannot tell apart. Called with c.mu held.
func (c *clusterMount) relock(e *Engine, m *mount) {
	renewed, err := c.dir.Relock()
	switch {
	case errors.Is(err, clustercap.ErrNodeLocked):
		if !c.copied {
			e.log.Error("engine: cluster: another process holds this node's lock file, which this node no longer held: a second copy of this node runs on the mount (or another node probes it a moment); removing none of this node's files until it can lock it again",
				"mount", m.root, "node", e.node, "err", err)
		}
		c.copied = true
		return
	case err != nil:
		e.log.Warn("engine: cluster: checking this node's lock", "mount", m.root, "err", err)
	case renewed:
		e.log.Warn("engine: cluster: this node's lock file was removed while it ran (another node took it for dead and retired it?); locked anew", "mount", m.root, "node", e.node)
	}
	if c.copied && err == nil {
		e.log.Info("engine: cluster: this node holds its lock file again", "mount", m.root, "node", e.node)
		c.copied = false
	}
}

// lose records a failed read or write of the cluster directory.
func (c *clusterMount) lose(e *Engine, m *mount, err error) {
	if !c.lost {
		e.log.Warn("engine: cluster summaries unavailable; evicting this node's files within its last claim", "mount", m.root, "claim", c.claim, "err", err)
	}
	c.lost = true
}

// evict removes this node's entries of own (sorted by rank) ranked below
// cut, then more of the lowest until need bytes are freed. It returns the
// bytes freed. Pinned entries stay, and entries this node may no longer
// evict (mayEvict: their node runs again). Called with c.mu held.
func (c *clusterMount) evict(ctx context.Context, e *Engine, m *mount, own []ranked, cut uint64, need int64) int64 {
	var freed int64
	var recs []abi.AccessRecord
	var claimed []*entry
	now := e.now().UnixNano()
	for _, r := range own {
		if r.rank >= cut && freed >= need {
			break
		}
		en := r.en
		c, rec, ok := e.ix.Evict(en, func(en *entry) bool { return en.Mount == m.idx && m.mayEvict(en) }, now)
		if ok {
			if c {
				claimed = append(claimed, en)
			}
			recs = append(recs, rec)
			freed += en.Size
			e.st.evictions.Add(1)
		}
	}
	e.evictAll(claimed)
	e.access(ctx, recs)
	c.own -= freed
	return freed
}

// reserve accounts size more bytes of this node's on a cluster
// mount before a store or move reserves them on the mount. Beyond its
// claim the node publishes a higher claim first and then reads the
// others' (two nodes raising theirs at once cannot both miss the other);
// if the claims do not fit the bound, it evicts its files below the
// cut-off, and then its lowest-ranked, until they do. Without the
// directory (lost), or while a node that may run cannot be counted
// (c.unknown: its summary unusable, none read before), it stays within its
// last claim. A caller that gave up
// (ctx cancelled) before the eviction gets ctx's error instead, with no
// file deleted. A call that fails publishes its claim again, lowered back
// to what the node holds: a raised claim left published would count in
// the others' bound until the next tick.
func (c *clusterMount) reserve(ctx context.Context, e *Engine, m *mount, size int64) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.own+size <= c.claim {
		c.own += size
		c.pending += size
		return nil
	}
	last := c.claim
	c.claim = c.own + size + c.bound.Grant(len(c.peers)+1, size)
	err := c.publish(e, c.lastSketch(), nil, 0)
	if err == nil {
		err = c.read(ctx, e, m)
	}
	var limit int64 // the most this node may hold
	if err != nil {
		c.lose(e, m, err)
		c.claim = last
		limit = last
	} else {
		limit = c.limitLocked(last)
	}
	if c.own+size > limit || (err == nil && !c.bound.Fits(c.claim, c.others())) {
		cut := uint64(0)
		computed := false
		if err == nil {
			now := e.now().UnixNano()
			p := c.bound.Decide(now, c.lastSketch(), c.own, c.cutsOf(now), 2*int64(c.interval))
			cut, computed = p.Cut, p.Computed
		}
		// settle publishes the claim this call ends with, where the raise
		// above was published: the others count a published claim in the
		// bound until this node's next tick.
		settle := func() {
			if err != nil {
				return
			}
			if !computed {
				cut = 0
			}
			if perr := c.publish(e, c.lastSketch(), nil, cut); perr != nil {
				c.lose(e, m, perr)
			}
		}
		own, bytes, _ := c.count(ctx, e, m)
		c.own = bytes
		if ctx.Err() != nil {
			// No file is deleted for a caller that gave up (evictRounds);
			// the files below the cut-off go at the next tick.
			c.claim = max(last, c.own)
			computed = false // its files below the cut-off are not gone yet
			settle()
			return fmt.Errorf("engine: mount %s: eviction stopped: %w", m.root, ctx.Err())
		}
		c.evict(ctx, e, m, own, cut, c.own+size-limit)
		if c.own+size > limit {
			c.claim = max(last, c.own)
			settle()
			why := "no evictable file of its own left"
			if twin := c.twinNote(); twin != "" {
				why = twin
			} else if len(c.unknown) > 0 {
				why = fmt.Sprintf("its claim grows no further while the summary of node %q, which may be running, cannot be used", slices.Sorted(maps.Keys(c.unknown))[0])
			}
			return fmt.Errorf("%w: mount %s: this node holds %d bytes and may hold %d of the cluster's %d, %d more needed, %s",
				ErrNoSpace, m.root, c.own, limit, c.bound.Capacity, size, why)
		}
		c.claim = min(c.claim, limit)
		settle()
	}
	c.own += size
	c.pending += size
	return nil
}

// reserveClaimed is reserve within this node's claim only: it
// neither raises the claim nor evicts (Engine.reserveFree). It reports
// whether it granted size bytes, which the caller reserves on the space
// (reserveGrant) or gives back.
func (c *clusterMount) reserveClaimed(size int64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.own+size > c.claim {
		return false
	}
	c.own += size
	c.pending += size
	return true
}

// fitsBound reports whether size bytes more of this node's fit in the
// cluster's bound as last read: within its claim, or within what the
// others' claims leave of the cluster's capacity (reserve's limit;
// not while a node that may run cannot be counted: c.unknown), without
// reading the others again, evicting or reserving (reprobe).
func (c *clusterMount) fitsBound(size int64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.own+size <= max(c.claim, c.limitLocked(c.claim))
}

// limitLocked is the most this node may hold as last read: what the
// others' claims leave of the cluster's capacity, but no more than claim
// while a node that may run cannot be counted (c.unknown: it holds what
// no summary says; readBad). c.mu is held.
func (c *clusterMount) limitLocked(claim int64) int64 {
	limit := c.bound.Capacity - clustercap.Claims(c.others())
	if len(c.unknown) > 0 {
		limit = min(limit, claim)
	}
	return limit
}

// reserveGrant reserves size bytes of a grant of reserve (or
// reserveClaimed) on m's space if its usage stays at or below limit
// (Space.ReserveBelow). The bytes leave pending as the space takes them,
// in one hold of c.mu: a count sees them once, never twice nor not at
// all. It reports whether the space took them; if not, the grant stays
// pending (the caller may evict and try again, or give it back).
func (c *clusterMount) reserveGrant(e *Engine, m *mount, size int64, limit space.Limit) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !e.space.ReserveBelow(m.sp, size, limit) {
		return false
	}
	c.pending -= size
	return true
}

// giveBack ends size bytes of a grant that the mount's space could not
// reserve (ErrNoSpace): no file of this node will hold them.
func (c *clusterMount) giveBack(size int64) {
	c.mu.Lock()
	c.pending -= size
	c.own -= size
	c.mu.Unlock()
}

// victims is policy.Evictions for a cluster mount's own eviction (its
// local capacity): this node's files, lowest rank first. The policy's
// victims could be other nodes' files it indexed, which it must not remove.
func (c *clusterMount) victims(e *Engine, m *mount, req abi.EvictRequest) []policy.Eviction {
	c.mu.Lock()
	// The caller's eviction has no context of its own to pass here; the
	// policy's calls are bounded by their own deadline.
	own, _, _ := c.count(context.Background(), e, m)
	c.mu.Unlock()
	var out []policy.Eviction
	var sum uint64
	for _, r := range own {
		if sum >= req.Bytes || len(out) == victimBatch {
			break
		}
		out = append(out, policy.Eviction{Victim: abi.Victim{Entry: r.en.ID, Score: r.rank}, Target: abi.VictimTarget{Mount: abi.NoMount}})
		sum += uint64(r.en.Size)
	}
	return out
}

// lastSketch is the sketch of c's last summary (none before the first).
// Called with c.mu held.
func (c *clusterMount) lastSketch() clustercap.Sketch {
	if c.pub == nil {
		return clustercap.Sketch{}
	}
	return c.pub.Sketch
}

// cleanTemps applies the leftover rule (cleanTemp: flock free, older than
// temp_grace) to the adopted nodes' temporary files in c.temps, and
// forgets those gone and those of nodes no longer in dead (released).
// Called with c.mu held.
func (c *clusterMount) cleanTemps(e *Engine, m *mount, dead map[uint32]bool) {
	for path, tag := range c.temps {
		if !dead[tag] {
			delete(c.temps, path)
			continue
		}
		rest, _ := tempRest(filepath.Base(path))
		removed, err := e.cleanTemp(m, path, rest)
		if err != nil {
			e.log.Warn("engine: cluster: a dead node's temporary file", "path", path, "err", err)
		}
		if _, serr := e.fs.Stat(path); removed || errors.Is(serr, os.ErrNotExist) {
			delete(c.temps, path)
		}
	}
}

// bytesOf is the bytes of the entries on m whose owner tag is in tags.
func bytesOf(ix *index.Index, m *mount, tags map[uint32]bool) int64 {
	var n int64
	ix.Each(func(en *entry) {
		if o, ok := clustercap.Owner(en.FID); ok && tags[o] && en.Mount == m.idx {
			n += en.Size
		}
	})
	return n
}

// leftOf reports whether a file of owner tag tag on m is still on disk
// though its entry was dropped: its removal failed (index.left), and an
// eviction tries it again (retryLeft), or it is under way (index.removing:
// an eviction, a delete, a retry or a move of the file that dropped the
// entry and has yet to unlink the file, which may fail and leave it). Its mount counts it as
// used while this engine runs, but only its owner's summary (or its
// adopter's walk) counts it after a restart: a dead node is not retired
// while one is left.
func leftOf(ix *index.Index, m *mount, tag uint32) bool {
	of := func(en *entry) bool {
		o, ok := clustercap.Owner(en.FID)
		return ok && o == tag && en.Mount == m.idx
	}
	return ix.AnyOut(of)
}

// adoptFiles indexes the files on m whose owner tag is in tags (dead
// nodes this node has just adopted): a dead node's files written after
// this node's start are not in its index. It lists each directory afresh
// (touchDir): a listing the file system client answered from its cache
// could miss the dead node's newest files, and a node whose walk found
// none of its files left is retired, its files then counted and removed
// by no node. A file gone meanwhile, or not a kvhost file (the rebuild's
// business), is skipped; one of those nodes' files that is shorter than
// its header says (shortFileError) is removed, as a load removes a
// corrupt file: its owner is dead, and no node would count or remove it. So is a file whose read fails (readFailed: it
// may be the dead node's); a dead node's file whose path a job of this
// engine holds (errPathHeld: a store that fails leaves it there), or
// whose stat fails; and a directory that cannot be read or not be listed
// afresh. It returns their errors once the walk is done (the caller walks
// again). The temporary
// files of those nodes it adds to temps, with their owner's tag
// (clusterMount.cleanTemps). It returns how many files it indexed.
func (e *Engine) adoptFiles(ctx context.Context, m *mount, tags map[uint32]bool, temps map[string]uint32) (int, error) {
	n := 0
	var errs []error
	var walk func(dir string) error
	walk = func(dir string) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := e.touchDir(m, dir); err != nil {
			// The listing may be as old as the client's cache of it: the
			// walk is not complete (the caller walks again).
			errs = append(errs, fmt.Errorf("engine: listing %s afresh: %w", dir, err))
		}
		ents, err := e.fs.ReadDir(dir)
		if err != nil {
			errs = append(errs, err)
			return nil
		}
		for _, d := range ents {
			name := d.Name()
			path := filepath.Join(dir, name)
			if strings.HasPrefix(name, ".") { // metadata, temporaries, spares
				if rest, ok := tempRest(name); ok && d.Type().IsRegular() {
					if node, _, owned := tempOwner(rest); owned && tags[clustercap.Tag(node)] {
						temps[path] = clustercap.Tag(node)
					}
				}
				continue
			}
			if d.IsDir() {
				if err := walk(path); err != nil {
					return err
				}
				continue
			}
			if !d.Type().IsRegular() {
				continue
			}
			if err := ctx.Err(); err != nil {
				return err
			}
			en, err := e.readEntry(m.idx, path)
			e.st.scanned.Add(1) // progress for Activity: the walk may take minutes, stores waiting on it
			var short *shortFileError
			if errors.As(err, &short) {
				en, err = short.en, nil // a dead node's is indexed, then dropped below
			}
			if err != nil {
				if readFailed(err) {
					// Whose file it is cannot be told: the walk is not
					// complete (the caller walks again).
					errs = append(errs, fmt.Errorf("engine: reading %s: %w", path, err))
				}
				continue
			}
			if o, ok := clustercap.Owner(en.FID); !ok || !tags[o] {
				continue
			}
			got, err := e.adoptFound(ctx, en)
			switch {
			case got != nil && short != nil:
				// Cut short, and its owner dead: no node will finish or
				// load it. Dropped as a load drops a corrupt file, through
				// the index (the path held, the file removed only if it is
				// still this one); a removal that fails leaves it counted
				// on this node's mount (index.left) and tried again.
				e.st.corrupt.Add(1)
				e.log.Warn("engine: cluster: a dead node's corrupt file removed", "mount", m.root, "err", short)
				e.rm.drop(ctx, got, true, "corrupt")
			case got != nil:
				n++
			case errors.Is(err, errPathHeld) || readFailed(err):
				// A job of this engine holds the path (a store that may
				// fail and leave the file), or its stat failed: the walk
				// is not complete (the caller walks again).
				errs = append(errs, fmt.Errorf("engine: indexing %s: %w", path, err))
			}
		}
		return nil
	}
	err := walk(m.root)
	return n, errors.Join(append(errs, err)...)
}

// readFailed reports whether err, readEntry's, is the file system's
// failure (an I/O error, a stale handle, a refused open) rather than the
// file's being gone or not a kvhost file: the file may be anyone's.
func readFailed(err error) bool {
	var errno syscall.Errno
	return errors.As(err, &errno) && !errors.Is(err, os.ErrNotExist)
}

// touchDir creates a temporary file in dir and removes it, so that the
// next listing of dir is as dir is now: an NFS client may answer a
// listing from its cache of the directory for up to acdirmax (mounted
// nocto, or where the server's directory mtime is too coarse to show a
// change), missing files created since through other clients, and a
// change through the client itself invalidates that cache whatever the
// mount options (clustercap lists its directory so too). A crash in
// between leaves a temporary file of this node, which the leftover rule
// removes. dir is a directory of m, found by a walk: one replaced by a
// symbolic link since gets no file through it (openNoLinks), and the
// file is removed as a store's temporary is (removeFile, relative to its
// directory opened without links).
func (e *Engine) touchDir(m *mount, dir string) error {
	tmp := e.tempName(dir, tmpPrefix)
	f, err := e.openNoLinks(m, tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return err
	}
	id, _ := fileIdentity(f)
	err = f.Close()
	if rerr := e.rm.removeFile(m, tmp, id); rerr != nil {
		err = errors.Join(err, rerr)
	}
	return err
}
