package cluster

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/clustercap"
	"github.com/kvhost/kvhost/internal/engine/index"
	"github.com/kvhost/kvhost/internal/engine/space"
)

// DefaultInterval is the interval of Open when it is zero.
const DefaultInterval = time.Second

// maxRewalkIntervals bounds how long, in cluster intervals, a failed walk
// of the mount for an adopted node's files puts off the next one.
const maxRewalkIntervals = 32

// Mount is the cluster state of one mount (Open).
type Mount struct {
	Group // what it works with of the engine's; immutable
	site  // what its parts work with; immutable
	// configured is the bound this node's configuration gives; bound
	// the one in force, agreed with the other nodes (clustercap.Agree:
	// the smallest configured among the running nodes), under mu.
	configured clustercap.Bound
	bound      clustercap.Bound
	run        int64 // when this run started (Summary.Run)

	mu  sync.Mutex // guards the rest; one claim or tick at a time
	own int64      // own bytes at the last count, plus reservations since
	// pending is the bytes reserve granted that the mount's space
	// has not reserved yet (ReserveGrant takes them there, GiveBack drops
	// them): a count adds them to the space's reservations.
	pending int64
	claim   int64
	// want is the claim this node asks, published beyond claim, while
	// waiters of its stores wait for room within its fair share
	// (Reserve): the others evict down to leave it. 0 without a waiter.
	want    int64
	waiters int
	// waitedOut is the live peers' summaries (peersSeen) when a wait for
	// room last ran out: no store waits again until one of them changes
	// (an idle peer above its share, of a long interval, would cost every
	// store the whole wait).
	waitedOut string
	// ticking is the time this node's ticks held mu, summed: a store
	// waiting for room does not count it against its wait.
	ticking time.Duration
	seq     uint64
	pub     *clustercap.Summary // the last summary published
	// The rest, in groups, all under mu but where a field says otherwise.
	clusterView
	clusterAdoption
	clusterFlocks
	clusterTwin
	clusterAgree
	census census // what the last census of the mount found (census.go)
	lost   bool   // the last read or write of the directory failed
	since  int64  // foreign uses after this time are reported (Unix ns)
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

// site is what the parts of a Mount (its groups of state: clusterView,
// clusterAgree, clusterAdoption, clusterFlocks, clusterTwin, census)
// work with beside their own fields, fixed at Open: the mount's cluster
// directory, root and log, this node's id and owner tag, and the
// interval. A part's methods take it as an argument and reach nothing
// else of the Mount.
type site struct {
	dir        *clustercap.Dir
	root, node string // Group.Root, Group.Node
	log        *slog.Logger
	tag        uint32
	interval   time.Duration
}

// clusterView is what the last read of a cluster mount's directory found
// of the other nodes (guarded by Mount.mu).
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
	// any is left this node's claim grows no further (Mount.Reserve,
	// FitsBound): a node that counted them as holding nothing could take
	// the room their files take.
	unknown map[string]bool
}

// MayEvict reports whether this node may remove en's file: on the
// mount, only its own files and those of the dead nodes it adopted, and
// none of its tag while another running node has that tag (twinned).
// It reads only en's immutable file id and the mount's atomics: callers
// may hold the engine's locks or none (a pin's check,
// othersRemove).
func (c *Mount) MayEvict(en *index.Entry) bool {
	o, ok := clustercap.Owner(en.FID)
	if !ok || (o == c.tag && c.twinned.Load()) {
		return false
	}
	return o == c.tag || (*c.dead.Load())[o]
}

// seenWindow is the least of how long ago another node's file this node
// indexes must have been checked on the mount (index.Entry.Verified) to
// count in its owner's bytes (count, clustercap.AtLeast) or as untagged:
// StaleIntervals of the mount's interval, and at least this.
const seenWindow = time.Second

// ranked is one of this node's entries with its eviction rank.
type ranked struct {
	en   *index.Entry
	rank uint64
}

// rank is en's eviction rank without the policy: its last access (Unix
// nanoseconds).
func rank(en *index.Entry) uint64 { return uint64(max(en.Last, 0)) }

// count takes stock of m for c: this node's evictable entries by rank,
// its bytes (with stores in flight) and the other nodes' files it used
// since c.since. Called with c.mu held.
func (c *Mount) count(ctx context.Context) (own []ranked, bytes int64, touches []clustercap.Touch) {
	dead := *c.dead.Load()
	var foreign []ranked // used since c.since: touches
	var indexed int64
	files := make(map[uint32]int64, len(c.files))
	all := make(map[uint32]int64, len(c.all))
	paths := make(map[uint32]string, len(c.files))
	seen := c.Host.Now().Add(-max(clustercap.StaleIntervals*c.interval, seenWindow)).UnixNano()
	c.unowned, c.unownedPath = 0, ""
	c.Index.Files().Each(func(en *index.Entry) {
		if en.Mount != c.Idx {
			return
		}
		indexed += en.Size
		c.largest = max(c.largest, en.Size)
		o, ok := clustercap.Owner(en.FID)
		switch {
		case !ok:
			// Written by a kvhost before owner tags: no summary counts it
			// but as untagged bytes (others).
			c.unowned += en.Size
			if c.unownedPath == "" || en.Path < c.unownedPath {
				c.unownedPath = en.Path
			}
			return
		case o == c.tag || dead[o]:
			own = append(own, ranked{en, rank(en)})
			bytes += en.Size
			return
		}
		all[o] += en.Size
		if p, ok := paths[o]; !ok || en.Path < p {
			paths[o] = en.Path
		}
		if en.Verified.Load() >= seen {
			// Seen on the mount lately: its owner's summary counts it
			// (an entry of a file its owner removed since stays here
			// until a lookup finds it gone, and must not count for good).
			files[o] += en.Size
		}
		if en.Last > c.since && len(foreign) < clustercap.MaxTouches {
			foreign = append(foreign, ranked{en, rank(en)})
			touches = append(touches, clustercap.Touch{ID: en.FID, Time: en.Last})
		}
	})
	c.files, c.all, c.paths = files, all, paths
	used, _ := c.Space.Usage(c.Sp)
	// Reservations and files on their way out, and grants the space has
	// not reserved yet: a grant moves from pending to used in one hold of
	// c.mu (ReserveGrant), which this count holds, so it counts once.
	bytes += max(0, used-indexed) + c.pending

	c.policyRanks(ctx, own, foreign)
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
func (c *Mount) policyRanks(ctx context.Context, own, foreign []ranked) {
	n := len(own) + len(foreign)
	if n == 0 {
		return
	}
	now := uint64(c.Host.Now().UnixNano())
	recs := make([]abi.RankRecord, 0, n)
	for _, set := range [][]ranked{own, foreign} {
		for _, r := range set {
			recs = append(recs, abi.RankRecord{Entry: r.en.ID, Time: now})
		}
	}
	ok, err := c.Host.Rank(ctx, recs)
	switch {
	case err != nil:
		if !c.rankFailed {
			c.Log.Warn("engine: policy ranks unavailable; ranking this node's files by last access", "mount", c.Root, "err", err)
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
func (c *Mount) read(ctx context.Context) error {
	sums, bad, err := c.dir.ReadAll()
	if err != nil {
		c.clusterAdoption.releaseAll(&c.site)
		return err
	}
	now := c.Host.Now().UnixNano()
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
			before := c.bytesOf(again)
			n, err := c.Host.AdoptFiles(ctx, walk, c.temps)
			if err != nil {
				c.rewalkWait = min(max(2*c.rewalkWait, c.interval), maxRewalkIntervals*c.interval)
				c.rewalkAt = now + c.rewalkWait.Nanoseconds()
				if ctx.Err() == nil { // else the engine closes: the walk stopped
					c.Log.Warn("engine: cluster: indexing a dead node's files; walking the mount again later", "mount", c.Root, "in", c.rewalkWait, "err", err)
				}
			} else {
				c.rewalkWait = 0
				for tag := range walk {
					c.walked[tag] = runs[tag]
				}
			}
			c.Log.Info("engine: cluster: adopted the files of dead nodes", "mount", c.Root, "files", n)
			c.own += c.bytesOf(walk) - before
		}
		c.clusterAdoption.cleanTemps(&c.site, c.Host, dead)
		// The dead nodes this node's count covers whole: walked. Taken
		// before retire, which forgets those it retires (covered too).
		walked := map[string]bool{}
		for tag := range c.walked {
			if dead[tag] {
				walked[names[tag]] = true
			}
		}
		c.unclaimed = clustercap.Unclaimed(deadSums, c.peers, func(node string) bool { return walked[node] })
		c.retire(dead, names, stood)
	}()
	adopt := func(node string, tag uint32, run int64) {
		ok, err := c.dir.Adopt(node)
		if err != nil {
			c.Log.Warn("engine: cluster: adoption lock", "mount", c.Root, "node", node, "err", err)
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
		// A node whose lock file is not on the mount never ran there (or
		// its lock file went, and it did not lock it again for as long as
		// its summary went stale): whatever the flocks, nothing runs
		// under its name, and its summary goes once its files do,
		// whatever its date (a summary dated in the past, no node ever
		// paired with, stayed for good). So does one this node never saw
		// running (no probe of its while its summary was fresh) where
		// flocks reach between this node and others: a node seen running
		// with its lock free (flocks not shared with it) is never taken
		// so.
		if c.shared[node] || c.dir.LockMissing(node) || len(c.shared) > 0 && c.probes[node] == nil {
			proven = append(proven, deadNode{node, tag, run})
		} else {
			unproven[node] = true
		}
	}
	for _, s := range sums {
		read[s.Node] = true
		if slices.Contains(s.LockShared, c.Node) {
			c.shared[s.Node] = true // it found this node's lock held
		}
		stale := now-s.Time >= clustercap.StaleIntervals*s.Interval
		live, err := clustercap.Live(s, now, c.dir.LockFree)
		if err != nil {
			c.Log.Warn("engine: cluster lock probe", "mount", c.Root, "node", s.Node, "err", err)
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
			c.Log.Warn("engine: cluster: adoption lock", "mount", c.Root, "node", s.Node, "err", err)
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
	copied := twin == "" && c.copied
	if copied {
		twin = c.Node + " (another copy: it holds this node's lock file)"
	}
	c.watch.See(c.peers, now)
	c.clusterTwin.setTwin(&c.site, twin, copied)
	c.readBad(bad, read, now, adoptProven)
	deadSums = c.agree(now, deadSums)
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
				c.Log.Warn("engine: cluster: a dead node has the owner tag of a running node, whose files cannot be told from its own: not adopted; the running node counts and evicts the tag's files it indexed, and the dead node's last summary stays counted",
					"mount", c.Root, "node", dn.node, "running", live, "tag", fmt.Sprintf("%#x", dn.tag))
			}
			continue
		}
		adopt(dn.node, dn.tag, dn.run)
	}
	c.shadowed = shadowed
	c.forgetGone(read)
	c.fresh = fresh
	c.clusterFlocks.noteUnproven(&c.site, unproven)
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
	recs := c.Index.Pins().Touch(c.Idx, func(fid uint64) (int64, bool) {
		t, ok := touched[fid]
		if ok {
			c.floor[fid] = max(c.floor[fid], t.Rank)
		}
		return t.Time, ok
	})
	c.Host.Access(ctx, recs)
	return nil
}

// agree checks the summaries of the last read: the live peers' (c.peers)
// and the dead nodes' (dead, returned without those it ignores). A claim
// that cannot hold under the bound (clustercap.Untenable; a forged one
// of 2^62 bytes) is ignored, with one log line naming the summary file,
// unless its node's lock is held (a running node restarted with a bound
// above the agreed one: it evicts down at its next tick). The bound in
// force becomes the one agreed among this node and the live peers
// counted (clustercap.Agree), logged once per peer whose configured one
// differs from this node's. A peer's summary counts at least the files of
// its owner tag this node indexes (clustercap.AtLeast). A peer of another
// policy, or ranking on another scale (clustercap.OddRanks), is named in
// a warning, once. The untagged files counted are the most any running
// node reports (named in a warning while there are any). Called with c.mu
// held.
func (c *Mount) agree(now int64, dead []*clustercap.Summary) []*clustercap.Summary {
	c.refusing = map[string]bool{}
	c.clusterAgree.checkFields(&c.site, c.peers, c.configured.Capacity, now)
	first, _ := clustercap.Agree(c.configured.Capacity, c.Node, c.peers)
	untenable := map[string]uint64{}
	ignore := func(s *clustercap.Summary, why string) {
		_, was := c.untenable[s.Node]
		untenable[s.Node] = s.Seq
		if !was {
			c.Log.Warn("engine: cluster: a summary states a claim that cannot hold: ignored (a forged or corrupt summary, or a node configured far below the others); remove the file if no such node runs",
				"mount", c.Root, "summary", c.dir.SummaryPath(s.Node), "why", why)
		}
	}
	kept := c.peers[:0]
	for _, p := range c.peers {
		if why := clustercap.Untenable(p, first); why != "" {
			// Its lock probed once per summary: no probe per claim raise
			// on a store's path while a forged one stays.
			if seq, ok := c.untenable[p.Node]; ok && seq == p.Seq {
				ignore(p, why)
				continue
			}
			if free, err := c.dir.LockFree(p.Node); err != nil || free {
				ignore(p, why)
				continue
			}
		}
		kept = append(kept, p)
	}
	c.peers = kept
	c.clusterAgree.checkClaims(&c.site, c.peers)
	c.refused = c.refusing
	bound, from := clustercap.Agree(c.configured.Capacity, c.Node, c.peers)
	var counted []*clustercap.Summary
	for _, s := range dead {
		if why := clustercap.Untenable(s, bound); why != "" {
			ignore(s, why)
			continue
		}
		counted = append(counted, s)
	}
	c.untenable = untenable
	if bound != c.bound.Capacity || from != c.from {
		c.Log.Info("engine: cluster: the bound in force", "mount", c.Root, "bound", bound, "from", from, "configured", c.configured.Capacity)
	}
	c.bound, c.from = c.configured.WithCapacity(bound), from
	own := c.lastSketch()
	ownOdd := clustercap.OddRanks(own, now)
	capSaid, policies, odd := map[string]int64{}, map[string]string{}, map[string]bool{}
	c.untaggedAll, c.untaggedFrom = 0, ""
	for i, p := range c.peers {
		if p.Tag != c.tag {
			c.peers[i] = clustercap.AtLeast(p, c.files[p.Tag])
		}
		if p.Untagged > c.untaggedAll {
			c.untaggedAll, c.untaggedFrom = p.Untagged, p.Node
		}
		if p.Capacity > 0 && p.Capacity != c.configured.Capacity {
			capSaid[p.Node] = p.Capacity
			if c.capSaid[p.Node] != p.Capacity {
				c.Log.Warn("engine: cluster: another node configures another cluster_capacity for this mount; every node bounds the mount by the smallest a running node configures",
					"mount", c.Root, "node", p.Node, "its_capacity", p.Capacity, "this_capacity", c.configured.Capacity, "bound", bound, "bound_from", from)
			}
		}
		if p.Policy != "" && c.Policy != "" && p.Policy != c.Policy {
			policies[p.Node] = p.Policy
			if c.policies[p.Node] != p.Policy {
				c.Log.Warn("engine: cluster: another node runs another placement policy: the nodes' ranks do not compare, so the cluster's cut-off evicts one node's files before the other's whatever their use; run one policy on every node of a mount",
					"mount", c.Root, "node", p.Node, "its_policy", p.Policy, "this_policy", c.Policy)
			}
		}
		if len(own.Ranks) > 0 && len(p.Sketch.Ranks) > 0 && clustercap.OddRanks(p.Sketch, now) != ownOdd {
			odd[p.Node] = true
			if !c.odd[p.Node] {
				c.Log.Warn("engine: cluster: another node ranks its files on another scale than this node (not Unix nanoseconds of use on one of them: a policy's rank in seconds, or a constant?): the cluster's cut-off evicts one node's files before the other's whatever their use",
					"mount", c.Root, "node", p.Node, "its_top_rank", p.Sketch.Ranks[len(p.Sketch.Ranks)-1], "this_top_rank", own.Ranks[len(own.Ranks)-1])
			}
		}
	}
	c.capSaid, c.policies, c.odd = capSaid, policies, odd
	// Files of a tag no summary names (a kvhost without a cluster
	// capacity draws random tags) are as good as untagged: no node
	// counts them otherwise.
	c.untagged, c.untaggedPath = c.unowned, c.unownedPath
	named := map[uint32]bool{c.tag: true}
	for _, s := range slices.Concat(c.peers, dead) {
		named[s.Tag] = true
	}
	for node := range c.bad {
		named[clustercap.Tag(node)] = true
	}
	for tag := range *c.dead.Load() {
		named[tag] = true
	}
	for tag, n := range c.all {
		if named[tag] {
			continue
		}
		c.untagged += n
		if p := c.paths[tag]; c.untaggedPath == "" || p < c.untaggedPath {
			c.untaggedPath = p
		}
	}
	// The census finds the files of writers beside the cluster that no
	// lookup brought into the index, and names the writers it can.
	nodes := map[string]bool{c.Node: true}
	for _, s := range slices.Concat(c.peers, dead) {
		nodes[s.Node] = true
	}
	for node := range c.bad {
		nodes[node] = true
	}
	for _, node := range c.dir.Adopted() {
		nodes[node] = true
	}
	found, path, writers := c.census.untagged(named, nodes)
	if found > c.untagged {
		c.untagged, c.untaggedPath = found, path
	}
	if c.untagged > c.untaggedAll {
		c.untaggedAll, c.untaggedFrom = c.untagged, c.Node
	}
	note := writersNote(writers)
	switch {
	case c.untaggedAll == 0:
		c.untaggedSaid, c.writersSaid = 0, ""
	case c.untaggedSaid == 0 || c.untaggedAll >= 2*c.untaggedSaid || len(writers) > 0 && note != c.writersSaid:
		c.untaggedSaid, c.writersSaid = c.untaggedAll, note
		c.Log.Warn("engine: cluster: files without an owner tag (written by a kvhost before owner tags, or one without a cluster capacity, beside the cluster) are on the mount: they count against the bound, and no node evicts them; stop the daemon that writes them, and remove them or give it the cluster's settings",
			"mount", c.Root, "bytes", c.untaggedAll, "found_by", c.untaggedFrom, "bound", bound, "example", c.untaggedPath, "writers", note)
	}
	return counted
}

// forgetGone forgets the pairings and probes of the nodes that have no
// summary on the mount any more, readable (read) or not (c.bad): retired
// (by this node or another), or removed by hand. Nodes come and go under
// names of their own (a pod's host name), and the sets grew by one name
// per node ever seen; the pairings are published in every summary. A node
// of a forgotten name that runs again is probed again (its first probe
// pairs where flocks are shared), or pairs through its own summary.
// Called with c.mu held, after readBad.
func (c *Mount) forgetGone(read map[string]bool) {
	gone := func(node string) bool { return !read[node] && !c.bad[node] }
	maps.DeleteFunc(c.shared, func(node string, _ bool) bool { return gone(node) })
	maps.DeleteFunc(c.probes, func(node string, _ *lockProbe) bool { return gone(node) })
	maps.DeleteFunc(c.held, func(node string, _ heldProbe) bool { return gone(node) })
	maps.DeleteFunc(c.lockFiles, func(node string, _ lockFile) bool { return gone(node) })
}

// runOf identifies the run of a dead node by its last summary s: the
// time s was published. A node publishes no summary once dead, so a
// summary of another time, read while its adoption is held, means the
// node ran again since (and may have stored files meanwhile).
func runOf(s *clustercap.Summary) int64 { return s.Time }

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
func (c *Mount) retire(dead map[uint32]bool, names map[uint32]string, stood map[string]bool) {
	temps := map[uint32]bool{}
	for _, tag := range c.temps {
		temps[tag] = true
	}
	for tag := range dead {
		if _, ok := c.walked[tag]; !ok || temps[tag] || stood[names[tag]] || c.bytesOf(map[uint32]bool{tag: true}) > 0 || c.leftOf(tag) {
			continue
		}
		ok, err := c.dir.Retire(names[tag])
		if err != nil {
			c.Log.Warn("engine: cluster: retiring a dead node", "mount", c.Root, "node", names[tag], "err", err)
		}
		if ok {
			c.Log.Info("engine: cluster: retired a dead node, none of its files left", "mount", c.Root, "node", names[tag])
			delete(dead, tag)
			delete(c.walked, tag)
		}
	}
	for _, node := range c.dir.Adopted() {
		if tag := clustercap.Tag(node); dead[tag] && names[tag] == node {
			continue
		}
		if err := c.dir.Release(node); err != nil {
			c.Log.Warn("engine: cluster: adoption lock", "mount", c.Root, "node", node, "err", err)
		}
	}
}

// readBad handles the summaries of bad (ReadAll's *SummaryErrors) of
// nodes not in read (those have a last summary standing in). A node with
// no lock file on the mount is dead at once (a node locks its file before
// it first publishes: a stray or forged file). A node whose
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
func (c *Mount) readBad(bad []error, read map[string]bool, now int64, adopt func(node string, tag uint32, run int64)) {
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
			c.Log.Debug("engine: cluster summary skipped", "mount", c.Root, "err", err)
		} else {
			c.Log.Warn("engine: cluster summary skipped", "mount", c.Root, "err", err)
		}
		if read[se.Node] {
			continue
		}
		live := true // no modification time: no sign it stopped
		switch {
		case c.dir.LockMissing(se.Node):
			// No lock file: no node runs under the name (a node locks its
			// file before it first publishes, and again at each interval
			// where it went): a stray or forged file, dead at once.
			live = false
		case !se.ModTime.IsZero():
			var perr error
			if live, perr = clustercap.LiveAt(se.Node, se.ModTime.UnixNano(), int64(c.interval), now, c.dir.LockFree); perr != nil {
				c.Log.Warn("engine: cluster lock probe", "mount", c.Root, "node", se.Node, "err", perr)
			}
		}
		if live {
			c.unknown[se.Node] = true
			if !wasUnknown[se.Node] {
				c.Log.Warn("engine: cluster: a node that may be running has a summary this node cannot use, and none of it was read before: its files cannot be counted, so this node's claim grows no further until it can (or the node is found dead)",
					"mount", c.Root, "node", se.Node, "claim", c.claim)
			}
			continue
		}
		if errors.Is(err, clustercap.ErrSummary) {
			adopt(se.Node, clustercap.Tag(se.Node), se.ModTime.UnixNano())
		}
	}
}

// others is the summaries this node's claims and cut-offs count beside
// its own: the live peers' and the unclaimed dead nodes'. Called with
// c.mu held.
func (c *Mount) others() []*clustercap.Summary {
	out := slices.Concat(c.peers, c.unclaimed)
	if c.untaggedAll > 0 {
		// Files without an owner tag: counted once, as the most any
		// running node found (agree); no node's to evict.
		out = append(out, &clustercap.Summary{Node: untaggedNode, Bytes: c.untaggedAll, Claim: c.untaggedAll})
	}
	return out
}

// untaggedNode names, in others, the files without an owner tag.
const untaggedNode = "(files without an owner tag)"

// cutsOf is others for Decide at now (Unix ns): the cut-offs of the
// summaries that may have stood, as this node saw them, longer than the
// window (two intervals) since their cut cleared (clustercap.Watch.Cuts),
// so that a peer whose publications stalled (its lock held, its last
// summary kept) does not keep an old cut in force. Called with c.mu held.
func (c *Mount) cutsOf(now int64) []*clustercap.Summary {
	return c.watch.Cuts(c.others(), now, 2*int64(c.interval))
}

// publish writes c's summary with bytes and c.claim; cut, if non-zero, is
// a cut-off this node computed now. Called with c.mu held.
func (c *Mount) publish(sketch clustercap.Sketch, touches []clustercap.Touch, cut uint64) error {
	c.seq++
	c.claim = max(c.claim, c.own)
	s := &clustercap.Summary{Version: clustercap.SummaryVersion, Node: c.Node, Tag: c.tag, Seq: c.seq, Time: c.Host.Now().UnixNano(),
		Interval: int64(c.interval), Bytes: c.own, Claim: max(c.claim, c.want), Sketch: sketch, Touches: touches, Adopted: c.clusterAdoption.adoptedNames(&c.site, c.peers), LockShared: c.clusterFlocks.lockShared(),
		Capacity: c.configured.Capacity, Bound: c.bound.Capacity, BoundFrom: c.from, Policy: c.Policy, Run: c.run, Untagged: c.untagged}
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

// Tick is the periodic work on a cluster mount: read the others, apply
// the purge records (applyPurges), count, evict below the cut-off,
// publish. It reads first: the count is then of
// the nodes adopted now, none that the read found running again. A failed
// read or write leaves the node on its last claim (reserve evicts its own
// files to stay within it).
func (c *Mount) Tick(ctx context.Context) {
	c.mu.Lock()
	defer c.mu.Unlock()
	held := c.wall()
	defer func() { c.ticking += c.wall().Sub(held) }()
	start := c.Host.Now().UnixNano()
	c.clusterTwin.relock(&c.site)
	err := c.read(ctx)
	if ctx.Err() != nil {
		return // the engine closes, or its start was cancelled: a walk stopped short
	}
	c.applyPurges(ctx) // before the count: the files it removes are not counted
	if err == nil {
		c.clusterFlocks.probeLocks(&c.site, c.fresh, start)
	}
	own, bytes, touches := c.count(ctx)
	c.own = bytes
	if err != nil {
		c.lose(err)
		return
	}
	items := make([]clustercap.Item, len(own))
	for i, r := range own {
		items[i] = clustercap.Item{Rank: r.rank, Bytes: r.en.Size}
	}
	sketch := clustercap.NewSketch(items, clustercap.SketchPoints)
	p := c.bound.Decide(start, sketch, c.own, c.cutsOf(start), 2*int64(c.interval))
	// Room for a node waiting below its fair share (its claim asks it):
	// a node above its own share evicts down to what the others' claims
	// leave, but not below its share.
	limit := c.bound.Capacity - clustercap.Claims(c.others())
	over := max(0, c.own-max(limit, c.shareLocked()))
	if p.Cut > 0 || over > 0 {
		if freed := c.evict(ctx, own, p.Cut, over); freed > 0 {
			own, c.own, _ = c.count(ctx)
			items = items[:0]
			for _, r := range own {
				items = append(items, clustercap.Item{Rank: r.rank, Bytes: r.en.Size})
			}
			sketch = clustercap.NewSketch(items, clustercap.SketchPoints)
		}
	}
	c.clusterAgree.checkOwn(&c.site, c.pub, c.own, c.claim)
	// A tick only lowers the claim: raising it is reserve's write-then-read.
	c.claim = min(c.claim, c.own+c.bound.Grant(len(c.peers)+1, 0), max(c.own, limit))
	cut := uint64(0)
	if p.Computed {
		cut = p.Cut
	}
	if err := c.publish(sketch, touches, cut); err != nil {
		c.lose(err)
		return
	}
	c.since = start
	if c.lost {
		c.lost = false
		c.Log.Info("engine: cluster summaries readable again", "mount", c.Root)
	}
}

// lose records a failed read or write of the cluster directory.
func (c *Mount) lose(err error) {
	if !c.lost {
		c.Log.Warn("engine: cluster summaries unavailable; evicting this node's files within its last claim", "mount", c.Root, "claim", c.claim, "err", err)
	}
	c.lost = true
}

// evict removes this node's entries of own (sorted by rank) ranked below
// cut, then more of the lowest until need bytes are freed. It returns the
// bytes freed. Pinned entries stay, and entries this node may no longer
// evict (mayEvict: their node runs again). Called with c.mu held.
func (c *Mount) evict(ctx context.Context, own []ranked, cut uint64, need int64) int64 {
	var freed int64
	var recs []abi.AccessRecord
	var claimed []*index.Entry
	now := c.Host.Now().UnixNano()
	for _, r := range own {
		if r.rank >= cut && freed >= need {
			break
		}
		en := r.en
		c, rec, ok := c.Index.Evict(en, func(en *index.Entry) bool { return en.Mount == c.Idx && c.MayEvict(en) }, now)
		if ok {
			if c {
				claimed = append(claimed, en)
			}
			recs = append(recs, rec)
			freed += en.Size
		}
	}
	c.Host.Evicted(ctx, claimed, recs)
	c.own -= freed
	return freed
}

// Reserve accounts size more bytes of this node's on a cluster
// mount before a store or move reserves them on the mount. Beyond its
// claim the node publishes a higher claim first and then reads the
// others' (two nodes raising theirs at once cannot both miss the other);
// if the claims do not fit the bound, it evicts its files below the
// cut-off, and then its lowest-ranked, until they do. A node below its
// fair share (shareLocked) beside a node above its own evicts none of its
// files beyond the cut-off: it asks the room (want, published) and waits
// for the others to evict down to their shares (at their next claim
// raise or tick), reading the directory every pollStarved, for
// starveWaitLocked and the time its own node's ticks held the mount
// meanwhile, longer while a peer above its share has not had its turns
// (peersHadTheirTurnsLocked); at the first read past maxStarveWait it
// ends. Without the directory (lost), or while a node that may run
// cannot be counted (c.unknown: its summary unusable, none read
// before), it stays within its last claim. A caller that gave up (ctx
// cancelled) before the eviction gets ctx's error instead, with no file
// deleted. A call that fails publishes its claim again, lowered back to
// what the node holds: a raised claim left published would count in the
// others' bound until the next tick.
func (c *Mount) Reserve(ctx context.Context, size int64) (err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	starved, err := c.reserveLocked(ctx, size)
	if !starved {
		return err
	}
	c.waiters++
	defer func() {
		if c.waiters--; c.waiters == 0 {
			c.want = 0
			if err != nil { // the room asked is not taken: published no more
				if perr := c.publish(c.lastSketch(), nil, 0); perr != nil {
					c.lose(perr)
				}
			}
		}
	}()
	begun, ticked := c.wall(), c.ticking
	wait := c.starveWaitLocked()
	var turns map[string]*peerTurns // from the first read after the request's publication
	for {
		c.mu.Unlock()
		t := time.NewTimer(pollStarved(c.interval))
		select {
		case <-ctx.Done():
		case <-t.C:
		}
		t.Stop()
		c.mu.Lock()
		if ctx.Err() != nil {
			return fmt.Errorf("engine: mount %s: waiting for room within this node's fair share: %w", c.Root, ctx.Err())
		}
		if rerr := c.read(ctx); rerr != nil {
			c.lose(rerr)
			return err
		}
		now := c.wall()
		turns = c.peerTurnsLocked(turns, now)
		// The time this node's ticks held the mount is no time the others
		// had to answer: the wait goes on as long.
		waited := now.Sub(begun)
		out := waited >= maxStarveWait || waited-(c.ticking-ticked) > wait && c.peersHadTheirTurnsLocked(turns, now)
		if c.own+size <= c.limitLocked(c.claim) || out {
			var again bool
			if again, err = c.reserveLocked(ctx, size); !again {
				return err
			}
			if out {
				c.waitedOut = c.peersSeen()
				var ns *NoSpaceError
				if errors.As(err, &ns) {
					ns.Why = fmt.Sprintf("waited %v for the other nodes to evict down to their fair shares (this node's: %d bytes; a node idle above its share evicts at its next tick)", waited.Round(time.Millisecond), c.shareLocked())
				}
				return err
			}
		}
	}
}

// peerTurns is what a store waiting for room saw of one live peer above
// its fair share: its sequence number at the wait's first read, and the
// last one with when it was first seen.
type peerTurns struct {
	first, last uint64
	changed     time.Time
}

// peerTurnsLocked records the live peers' sequence numbers as just read
// (at now) into turns: at the first read after a waiting store's request
// was published (turns nil), those of the peers above their fair share.
// Called with c.mu held.
func (c *Mount) peerTurnsLocked(turns map[string]*peerTurns, now time.Time) map[string]*peerTurns {
	if turns == nil {
		turns = make(map[string]*peerTurns)
		share := c.shareLocked()
		for _, p := range c.peers {
			if p.Claim > share {
				turns[p.Node] = &peerTurns{first: p.Seq, last: p.Seq, changed: now}
			}
		}
		return turns
	}
	for _, p := range c.peers {
		if t := turns[p.Node]; t != nil && p.Seq != t.last {
			t.last, t.changed = p.Seq, now
		}
	}
	return turns
}

// peersHadTheirTurnsLocked reports whether every live peer of turns that
// still claims more than its share has had its turns since the wait's
// first read: it published three times (the first may rest on a read
// from before the request, the second be a claim raise, which rests on
// none; the third rests on a read after the request), or it has
// published nothing for two of its intervals (a peer hung or stopped
// answers no request). A peer gone from the live ones, or down to its
// share, has had its turn. A wait ends at its length only then (or at
// maxStarveWait): on a loaded machine a peer's tick can run late, and a
// refusal then would blame a peer that never saw the request. Called
// with c.mu held.
func (c *Mount) peersHadTheirTurnsLocked(turns map[string]*peerTurns, now time.Time) bool {
	share := c.shareLocked()
	for _, p := range c.peers {
		t := turns[p.Node]
		if t == nil || p.Claim <= share || p.Seq-t.first >= 3 {
			continue
		}
		if silent := now.Sub(t.changed); silent < 2*min(max(time.Duration(p.Interval), 0), maxStarveWait) {
			return false
		}
	}
	return true
}

// pollStarved is how often a store waiting for room within its node's
// fair share reads the directory, on a mount of cluster interval i.
func pollStarved(i time.Duration) time.Duration {
	return min(max(i/32, time.Millisecond), 5*time.Millisecond)
}

// How long a store waits for room within its node's fair share, whatever
// the nodes' intervals: at least minStarveWait (a busy peer's next claim
// raise, through a file system that stalls a rename now and then), at
// most maxStarveWait, which is also how long a wait goes on while a peer
// above its share has not had its turns since it began.
const (
	minStarveWait = time.Second
	maxStarveWait = 5 * time.Second
)

// starveWaitLocked is how long a store waits for room within its node's
// fair share: StaleIntervals of the longest interval among this node and
// its live peers (a peer idle above its share evicts at its tick; a busy
// one at its next claim raise), within minStarveWait and maxStarveWait.
// Called with c.mu held.
func (c *Mount) starveWaitLocked() time.Duration {
	i := c.interval
	for _, p := range c.peers {
		i = max(i, time.Duration(p.Interval))
	}
	return min(max(clustercap.StaleIntervals*i, minStarveWait), maxStarveWait)
}

// shareLocked is this node's fair share of the bound as last read
// (Bound.Share): an equal part, among the live nodes, of what the
// unclaimed dead nodes and the untagged files leave of it. Called with
// c.mu held.
func (c *Mount) shareLocked() int64 {
	rest := clustercap.Claims(c.unclaimed)
	if c.untaggedAll > 0 {
		rest += c.untaggedAll
	}
	return c.bound.Share(len(c.peers)+1, rest)
}

// reserveLocked is Reserve without the wait: starved says the store did
// not fit, this node is below its fair share and the peers' evicting
// down to theirs would give the room (yieldLimitLocked), so that waiting
// for them may; the room is then asked (c.want, published) and err is
// the refusal should the wait end without it. Called with c.mu held.
func (c *Mount) reserveLocked(ctx context.Context, size int64) (starved bool, err error) {
	c.largest = max(c.largest, size)
	if c.own+size <= c.claim {
		c.own += size
		c.pending += size
		return false, nil
	}
	last := c.claim
	c.claim = c.own + size + c.bound.Grant(len(c.peers)+1, size)
	err = c.publish(c.lastSketch(), nil, 0)
	if err == nil {
		err = c.read(ctx)
	}
	var limit int64 // the most this node may hold
	if err != nil {
		c.lose(err)
		c.claim = last
		limit = last
	} else {
		limit = c.limitLocked(last)
	}
	if c.own+size > limit || (err == nil && !c.bound.Fits(c.claim, c.others())) {
		cut := uint64(0)
		computed := false
		if err == nil {
			now := c.Host.Now().UnixNano()
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
			if perr := c.publish(c.lastSketch(), nil, cut); perr != nil {
				c.lose(perr)
			}
		}
		own, bytes, _ := c.count(ctx)
		c.own = bytes
		if ctx.Err() != nil {
			// No file is deleted for a caller that gave up (evictRounds);
			// the files below the cut-off go at the next tick.
			c.claim = max(last, c.own)
			computed = false // its files below the cut-off are not gone yet
			settle()
			return false, fmt.Errorf("engine: mount %s: eviction stopped: %w", c.Root, ctx.Err())
		}
		// Below its fair share beside a node above its own, a node keeps
		// its files (but those below the cut-off) and asks the room.
		need := c.own + size - limit
		wait := err == nil && c.twin == "" && len(c.unknown) == 0 && c.own+size <= max(c.shareLocked(), size) && c.own+size <= c.yieldLimitLocked() &&
			c.peersSeen() != c.waitedOut
		if wait {
			need = 0
		}
		c.evict(ctx, own, cut, need)
		if c.own+size > limit {
			c.claim = max(last, c.own)
			if wait {
				c.want = max(c.want, c.own+size)
			}
			settle()
			why := "no evictable file of its own left"
			if twin := c.clusterTwin.twinNote(); twin != "" {
				why = twin
			} else if len(c.unknown) > 0 {
				why = fmt.Sprintf("its claim grows no further while the summary of node %q, which may be running, cannot be used", slices.Sorted(maps.Keys(c.unknown))[0])
			} else if c.untaggedAll > 0 {
				why = fmt.Sprintf("no evictable file of its own left, and %d bytes of files without an owner tag count against the bound", c.untaggedAll)
			}
			return wait, &NoSpaceError{Root: c.Root, Own: c.own, Limit: limit, Capacity: c.bound.Capacity, Size: size, Why: why}
		}
		c.claim = min(c.claim, limit)
		settle()
	}
	c.own += size
	c.pending += size
	return false, nil
}

// peersSeen identifies the live peers' summaries as last read: their
// nodes and sequence numbers. Called with c.mu held.
func (c *Mount) peersSeen() string {
	var b strings.Builder
	for _, p := range c.peers {
		fmt.Fprintf(&b, "%s@%d ", p.Node, p.Seq)
	}
	return b.String()
}

// yieldLimitLocked is the most this node may hold once every live peer
// above its fair share (shareLocked) evicted down to it: what the bound
// leaves beside the others as last read, each live peer's claim taken at
// most at its share. Called with c.mu held.
func (c *Mount) yieldLimitLocked() int64 {
	share := c.shareLocked()
	var peers int64
	for _, p := range c.peers {
		peers += min(p.Claim, share)
	}
	rest := c.bound.Capacity - clustercap.Claims(c.others()) + clustercap.Claims(c.peers)
	return rest - peers
}

// ReserveClaimed is Reserve within this node's claim only: it
// neither raises the claim nor evicts (a move within an eviction). It reports
// whether it granted size bytes, which the caller reserves on the space
// (ReserveGrant) or gives back.
func (c *Mount) ReserveClaimed(size int64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.own+size > c.claim {
		return false
	}
	c.own += size
	c.pending += size
	return true
}

// FitsBound reports whether size bytes more of this node's fit in the
// cluster's bound as last read: within its claim, or within what the
// others' claims leave of the cluster's capacity (reserve's limit;
// not while a node that may run cannot be counted: c.unknown), without
// reading the others again, evicting or reserving (reprobe).
func (c *Mount) FitsBound(size int64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.own+size <= max(c.claim, c.limitLocked(c.claim))
}

// limitLocked is the most this node may hold as last read: what the
// others' claims leave of the cluster's capacity, but no more than claim
// while a node that may run cannot be counted (c.unknown: it holds what
// no summary says; readBad). c.mu is held.
func (c *Mount) limitLocked(claim int64) int64 {
	limit := c.bound.Capacity - clustercap.Claims(c.others())
	if len(c.unknown) > 0 {
		limit = min(limit, claim)
	}
	return limit
}

// ReserveGrant reserves size bytes of a grant of Reserve (or
// ReserveClaimed) on the mount's space if its usage stays at or below limit
// (Space.ReserveBelow). The bytes leave pending as the space takes them,
// in one hold of c.mu: a count sees them once, never twice nor not at
// all. It reports whether the space took them; if not, the grant stays
// pending (the caller may evict and try again, or give it back).
func (c *Mount) ReserveGrant(size int64, limit space.Limit) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.Space.ReserveBelow(c.Sp, size, limit) {
		return false
	}
	c.pending -= size
	return true
}

// GiveBack ends size bytes of a grant that the mount's space could not
// reserve (ErrNoSpace): no file of this node will hold them.
func (c *Mount) GiveBack(size int64) {
	c.mu.Lock()
	c.pending -= size
	c.own -= size
	c.mu.Unlock()
}

// Victims is policy.Evictions for a cluster mount's own eviction (its
// local capacity): this node's files, lowest rank first. The policy's
// victims could be other nodes' files it indexed, which it must not remove.
func (c *Mount) Victims(req abi.EvictRequest, batch int) []policy.Eviction {
	c.mu.Lock()
	// The caller's eviction has no context of its own to pass here; the
	// policy's calls are bounded by their own deadline.
	own, _, _ := c.count(context.Background())
	c.mu.Unlock()
	var out []policy.Eviction
	var sum uint64
	for _, r := range own {
		if sum >= req.Bytes || len(out) == batch {
			break
		}
		out = append(out, policy.Eviction{Victim: abi.Victim{Entry: r.en.ID, Score: r.rank}, Target: abi.VictimTarget{Mount: abi.NoMount}})
		sum += uint64(r.en.Size)
	}
	return out
}

// lastSketch is the sketch of c's last summary (none before the first).
// Called with c.mu held.
func (c *Mount) lastSketch() clustercap.Sketch {
	if c.pub == nil {
		return clustercap.Sketch{}
	}
	return c.pub.Sketch
}

// bytesOf is the bytes of the entries on c's mount whose owner tag is in tags.
func (c *Mount) bytesOf(tags map[uint32]bool) int64 {
	var n int64
	c.Index.Files().Each(func(en *index.Entry) {
		if o, ok := clustercap.Owner(en.FID); ok && tags[o] && en.Mount == c.Idx {
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
func (c *Mount) leftOf(tag uint32) bool {
	of := func(en *index.Entry) bool {
		o, ok := clustercap.Owner(en.FID)
		return ok && o == tag && en.Mount == c.Idx
	}
	return c.Index.Leaving().AnyOut(of)
}

// applyPurges drops the entries that a purge record of c's mount covers (the
// records the last read listed, and those this node wrote; the mount's entries,
// and those of this node's mounts without a cluster capacity: Covers),
// as Purge does: a file
// this node may remove is removed (MayEvict), another node's only leaves
// the index, and a file a client pin holds stays, to go at the first tick
// after its pin ends. Called with c.mu held (Tick).
func (c *Mount) applyPurges(ctx context.Context) {
	purges, ahead := c.dir.Purges(PurgeLimit(c.Host.Now()))
	for fp, t := range ahead {
		if c.ahead[fp] != t {
			c.Log.Warn("engine: cluster: a purge record is dated too far ahead of this node's clock to apply (a clock far off, or a file that is no record); it applies once this node's clock is within the bound, and the next purge of the namespace removes it",
				"mount", c.Root, "fingerprint", fmt.Sprintf("%016x", fp), "record_time", time.Unix(0, t).UTC(), "bound", clustercap.PurgeAhead)
		}
	}
	c.ahead = ahead
	if len(purges) == 0 {
		return
	}
	// The records stay after their namespace's files went: one of a
	// namespace with no file indexed costs no scan of the index.
	ens := c.Index.Files().Matching(purges, func(en *index.Entry) bool {
		t, ok := purges[en.FP]
		return ok && c.Covers(en) && !en.Spare && en.Ident.Mtime <= t
	})
	c.Host.Purge(ctx, ens)
}
