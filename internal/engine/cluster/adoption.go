package cluster

import (
	"slices"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/internal/clustercap"
)

// clusterAdoption is the dead nodes this node adopted on a cluster mount
// and the walks of their files (guarded by Mount.mu but where a
// field says otherwise).
type clusterAdoption struct {
	// dead holds the tags of the dead nodes this node adopted (it holds
	// their adoption locks: their files are its to count and evict);
	// replaced whole under mu, read anywhere (MayEvict).
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

// releaseAll gives up the adoption of every dead node: their files are no
// longer this node's to count or evict (its next count leaves them out).
// Called with Mount.mu held.
func (d *clusterAdoption) releaseAll(at *site) {
	d.dead.Store(&map[uint32]bool{})
	clear(d.walked)
	for _, node := range at.dir.Adopted() {
		if err := at.dir.Release(node); err != nil {
			at.log.Warn("engine: cluster: adoption lock", "mount", at.root, "node", node, "err", err)
		}
	}
}

// cleanTemps applies the leftover rule (cleanTemp: flock free, older than
// temp_grace) to the adopted nodes' temporary files in d.temps, and
// forgets those gone and those of nodes no longer in dead (released).
// Called with Mount.mu held.
func (d *clusterAdoption) cleanTemps(at *site, host Host, dead map[uint32]bool) {
	for path, tag := range d.temps {
		if !dead[tag] {
			delete(d.temps, path)
			continue
		}
		gone, err := host.CleanTemp(path)
		if err != nil {
			at.log.Warn("engine: cluster: a dead node's temporary file", "path", path, "err", err)
		}
		if gone {
			delete(d.temps, path)
		}
	}
}

// adoptedNames names the dead nodes whose files Mount.own counts whole: this
// node holds their adoption and a walk of the mount for them completed
// (Summary.Adopted), and no other live summary (of peers) names them. Called with Mount.mu held.
func (d *clusterAdoption) adoptedNames(at *site, peers []*clustercap.Summary) []string {
	dead := *d.dead.Load()
	// A node another live summary names adopted is left out: that
	// summary is its last adopter's, which stopped (a SIGKILL leaves it
	// fresh for three intervals), and two summaries naming one dead node
	// would say it has two adopters. This node counts the dead node's
	// files meanwhile, and so does that summary: twice, on the side of
	// the bound.
	named := map[string]bool{}
	for _, p := range peers {
		for _, n := range p.Adopted {
			named[n] = true
		}
	}
	var out []string
	for _, node := range at.dir.Adopted() {
		tag := clustercap.Tag(node)
		if _, walked := d.walked[tag]; walked && dead[tag] && !named[node] {
			out = append(out, node)
		}
	}
	slices.Sort(out)
	return out
}
