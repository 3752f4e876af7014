package cluster

import (
	"errors"
	"fmt"
	"os"

	"github.com/kvhost/kvhost/internal/clustercap"
)

// clusterAgree is what this node checked of the others' summaries: the
// bound agreed, claims that cannot hold, other policies and rank scales,
// and the files the summaries must count (guarded by Mount.mu).
type clusterAgree struct {
	from    string           // the node whose configured capacity the bound is
	capSaid map[string]int64 // the peers whose other capacity was logged, with it
	// untenable holds the nodes whose summary's claim cannot hold, with
	// that summary's Seq: ignored, logged once while they stay so.
	untenable map[string]uint64
	policies  map[string]string // the peers of another policy logged, with it
	odd       map[string]bool   // the peers whose ranks were logged as of another scale
	// files holds, by owner tag, the bytes of the other nodes' files this
	// node indexes on the mount (count): a summary counts at least them.
	files map[uint32]int64
	// all is files with every entry of the tag, seen lately or not: those
	// of tags no summary names count as untagged (agree) while indexed.
	all   map[uint32]int64
	paths map[uint32]string // by owner tag: one of all's paths, for a warning
	// untagged is the bytes of files without an owner tag this node
	// indexes on the mount (count), one of them at untaggedPath;
	// untaggedAll the most any running node reports (read), counted
	// against the bound once (others); untaggedSaid the amount last
	// logged.
	untagged, untaggedAll, untaggedSaid int64
	untaggedPath, untaggedFrom          string
	writersSaid                         string // the writers the last warning of them named
	// unowned is the bytes of files with no file id (written before ids)
	// this node indexes on the mount (count), one of them at
	// unownedPath: agree adds those of tags no summary names to make
	// untagged.
	unowned     int64
	unownedPath string
	forgedSaid  bool // a summary under this node's name that it did not write was logged
	// held holds, per peer whose lock was probed for a field that counts
	// only from a running node (heldLocked), what the probe found.
	held map[string]heldProbe
	// refused holds the fields of peers' summaries refused (refuse), by
	// node and field: logged once while they stay so; refusing is the
	// current read's.
	refused, refusing map[string]bool
	// lockFiles holds, per peer whose lock file was looked for
	// (checkClaims), the summary's Seq then and whether the file was
	// missing.
	lockFiles map[string]lockFile
	// largest is the largest file this node counted or reserved on the
	// mount: the bound's floor is one such file per live node.
	largest int64
}

// lockFile is whether a peer's lock file was missing at its summary seq.
type lockFile struct {
	seq     uint64
	missing bool
}

// heldProbe is what a probe of a peer's lock found (heldLocked).
type heldProbe struct {
	run  int64  // the peer's run (Summary.Run) at the probe
	seq  uint64 // its summary's Seq at the probe
	at   int64  // when (Unix ns)
	held bool   // the lock was held
}

// boundFloorFraction: no bound below this fraction of this node's
// configured capacity is applied (checkFields).
const boundFloorFraction = 16

// checkFields checks the fields of the live peers' summaries (peers)
// that only a running node may state and that would stop every node's
// stores, or evict every node's files, if false: a capacity below this
// node's configured one (it lowers the bound), untagged bytes (they
// count against it) and a cut-off (every node evicts below it). Each
// counts only from a node whose lock is held (heldLocked: anyone may
// write a summary, but only a running node holds its lock), and a
// capacity only at or above the bound's floor: a sixteenth of this
// node's configured capacity, and one file (the largest this node saw)
// per live node. A field refused is left out of the peer's summary as
// this node counts it, with one warning naming the summary file while
// it stays so. Called with Mount.mu held.
func (a *clusterAgree) checkFields(at *site, peers []*clustercap.Summary, configured int64, now int64) {
	floor := max(configured/boundFloorFraction, int64(len(peers)+1)*a.largest)
	for i, p := range peers {
		lowers := p.Capacity > 0 && p.Capacity < configured
		if !lowers && p.Untagged == 0 && p.Cut == 0 {
			continue
		}
		g := *p
		held := a.heldLocked(at, p, now)
		switch {
		case lowers && !held:
			a.refuse(at, p, "capacity", p.Capacity, "its node holds no lock, so runs nowhere: a capacity from it never lowers the bound")
			g.Capacity = 0
		case lowers && p.Capacity < floor:
			a.refuse(at, p, "capacity", p.Capacity, fmt.Sprintf("below the floor of a bound, %d bytes: a sixteenth of this node's configured %d, and one file of %d bytes per live node", floor, configured, a.largest))
			g.Capacity = 0
		}
		if p.Untagged > 0 && !held {
			a.refuse(at, p, "untagged", p.Untagged, "its node holds no lock, so runs nowhere: untagged bytes count only as seen by this node or a running one")
			g.Untagged = 0
		}
		if p.Cut > 0 && !held {
			a.refuse(at, p, "cut", int64(min(p.Cut, uint64(clustercap.MaxBytes))), "its node holds no lock, so runs nowhere: its cut-off evicts nothing here")
			g.Cut, g.CutTime = 0, 0
		}
		peers[i] = &g
	}
}

// checkClaims checks the claims of the live peers' summaries (peers,
// after the claims that cannot hold were left out): a summary whose
// node has no lock file on the mount (a running node locks its file
// again at its next interval; a stray or forged summary has none)
// counts no bytes, claim or sketch of its own, only the files of its
// tag this node finds (clustercap.AtLeast), with one warning naming the
// file. The lock file is looked for once per summary Seq. Called with
// Mount.mu held.
func (a *clusterAgree) checkClaims(at *site, peers []*clustercap.Summary) {
	if a.lockFiles == nil {
		a.lockFiles = map[string]lockFile{}
	}
	for i, p := range peers {
		if p.Claim == 0 {
			continue
		}
		lf, ok := a.lockFiles[p.Node]
		if !ok || lf.seq != p.Seq {
			lf = lockFile{seq: p.Seq, missing: at.dir.LockMissing(p.Node)}
			a.lockFiles[p.Node] = lf
		}
		if !lf.missing {
			continue
		}
		a.refuse(at, p, "claim", p.Claim, "its node has no lock file on the mount, so runs nowhere: its claim and bytes count nothing but the files of its tag this node finds")
		g := *p
		g.Bytes, g.Claim, g.Sketch, g.Cut, g.CutTime, g.Touches = 0, 0, clustercap.Sketch{}, 0, 0, nil
		peers[i] = &g
	}
}

// refuse records field of p's summary, of value v, as refused for why
// (checkFields, checkClaims): logged, naming the summary file, once
// while it stays so. Called with Mount.mu held.
func (a *clusterAgree) refuse(at *site, p *clustercap.Summary, field string, v int64, why string) {
	key := p.Node + "\x00" + field
	a.refusing[key] = true
	if !a.refused[key] {
		at.log.Warn("engine: cluster: a summary states what this node cannot take as true: refused, the field not counted (a forged or corrupt summary, or a node configured far below the others); remove the file if no such node runs",
			"mount", at.root, "summary", at.dir.SummaryPath(p.Node), "field", field, "value", v, "why", why)
	}
}

// heldLocked reports whether p's node holds its lock: a probe found it
// held in p's run, or finds it so now. A probe that found it free is
// taken again at p's next summary, at most once an interval, so that
// neither a summary that stays (a forged one) nor a node whose flocks
// do not reach this one costs a probe on every store's claim raise.
// Called with Mount.mu held.
func (a *clusterAgree) heldLocked(at *site, p *clustercap.Summary, now int64) bool {
	if a.held == nil {
		a.held = map[string]heldProbe{}
	}
	h, ok := a.held[p.Node]
	switch {
	case ok && h.held && h.run == p.Run:
		return true
	case ok && !h.held && (h.seq == p.Seq || now-h.at < int64(at.interval)):
		return false
	}
	free, err := at.dir.LockFree(p.Node)
	h = heldProbe{run: p.Run, seq: p.Seq, at: now, held: err == nil && !free}
	a.held[p.Node] = h
	return h.held
}

// checkOwn checks that the summary under this node's name is the last
// one it published (pub; own and ownClaim are its bytes and claim now): one that is not (a summary forged under its name, say
// claiming nothing, which the others would count instead of its files)
// is logged, once while it recurs, and the publication that follows
// overwrites it. Called with Mount.mu held, before a tick's publication.
func (a *clusterAgree) checkOwn(at *site, pub *clustercap.Summary, own, ownClaim int64) {
	if pub == nil {
		return
	}
	s, err := at.dir.ReadSummary(at.node)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return // removed (retired, or by hand): published anew
	case err == nil && s.Seq == pub.Seq && s.Time == pub.Time && s.Bytes == pub.Bytes && s.Claim == pub.Claim && s.Run == pub.Run:
		a.forgedSaid = false
		return
	case err != nil && !errors.Is(err, clustercap.ErrSummary):
		return // unreadable: the publication tells
	}
	if !a.forgedSaid {
		var bytes, claim int64
		if s != nil {
			bytes, claim = s.Bytes, s.Claim
		}
		at.log.Warn("engine: cluster: the summary under this node's name is not the one it wrote (written by another process: a forged summary, or a second copy of this node); overwriting it",
			"mount", at.root, "summary", at.dir.SummaryPath(at.node), "its_bytes", bytes, "its_claim", claim, "bytes", own, "claim", ownClaim, "err", err)
	}
	a.forgedSaid = true
}
