// Package sharded is a placement policy for large caches spread over several
// mounts (local NVMe drives, or several shared file systems): it spreads keys
// over the mounts by weight, fans files out over many directories so that no
// directory grows huge, and evicts least-recently-used entries per mount.
//
// It shows how a policy uses the mount fields of the ABI: NameRecord.Mount
// (where a new file goes), AccessRecord.Mount (where an entry lives) and
// EvictRequest.Mount (which mount is short of space).
//
// # Behaviour
//
//   - Mount: weighted rendezvous hashing of the key hash: each mount i gets
//     the score weight_i / -ln(u_i), u_i a hash of (key hash, i) in (0,1),
//     and the key goes to the highest score. It is stable (the same key
//     always lands on the same mount on every node), and adding a mount moves
//     only the keys that the new mount wins.
//   - Names: <model>_<fingerprint: 12 hex>_r<rank>/<hh>/<hh>/<key as hex>.kv,
//     with depth levels of fan-out directories, taken from the key hash's
//     most significant bytes (65,536 leaf directories at depth 2).
//   - Access: as package lru, with one LRU list per mount.
//   - Evict: from the LRU list of req.Mount; for abi.AnyMount, the lists are
//     merged by last access time. Score is the last access time.
//
// # Configuration
//
//	mounts        = 1,1,...  relative weight of each mount, one per mount
//	                         (default: equal weights for every mount)
//	depth         = 2        fan-out directory levels (0..4)
//	keys_per_file = 1        keys stored in one file (1..256)
//	order         = layer    layer | block: layout inside a file
package sharded

import (
	"math"
	"strconv"
	"strings"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/plugins/internal/policykit"
)

// Name is the policy's name, as kvhost's configuration spells it.
const Name = "sharded"

// DefaultDepth is the fan-out depth when none is configured.
const DefaultDepth = 2

// Policy is the sharded policy. The zero value is not usable; call New.
type Policy struct {
	weights []float64 // nil: equal weights for any mount count
	layout  policykit.Layout
	names   *policykit.Names
	track   *policykit.Tracker
	cursors []int32 // per-mount positions of an AnyMount eviction
}

// New returns a sharded policy with the default configuration.
func New() *Policy {
	names, _ := policykit.NewNames(DefaultDepth)
	return &Policy{
		layout: policykit.Layout{KeysPerFile: abi.DefaultKeysPerFile, Order: abi.DefaultOrder},
		names:  names,
		track:  policykit.NewTrackerByMount(1),
	}
}

// Init reads the configuration.
func (p *Policy) Init(cfg guest.Config) error {
	if err := cfg.CheckKeys(append(policykit.LayoutKeys(), "depth", "mounts")...); err != nil {
		return policykit.ConfigFailure(Name, err)
	}
	layout, err := policykit.ParseLayout(cfg)
	if err != nil {
		return policykit.ConfigFailure(Name, err)
	}
	depth, err := cfg.Int("depth", DefaultDepth)
	if err == nil && (depth < 0 || depth > policykit.MaxDepth) {
		err = &guest.ConfigError{Key: "depth", Value: cfg.String("depth", ""), Want: "an integer from 0 to " + strconv.Itoa(policykit.MaxDepth)}
	}
	if err != nil {
		return policykit.ConfigFailure(Name, err)
	}
	weights, err := parseWeights(cfg.String("mounts", ""))
	if err != nil {
		return policykit.ConfigFailure(Name, err)
	}
	names, err := policykit.NewNames(int(depth))
	if err != nil {
		return policykit.ConfigFailure(Name, err)
	}
	p.layout, p.names, p.weights = layout, names, weights
	return nil
}

// parseWeights reads "w0,w1,...": positive numbers, at most MaxClasses.
func parseWeights(s string) ([]float64, error) {
	if s == "" {
		return nil, nil
	}
	want := "comma-separated positive weights, one per mount, such as 1,1,2"
	fields := strings.Split(s, ",")
	if len(fields) > policykit.MaxClasses {
		return nil, &guest.ConfigError{Key: "mounts", Value: s, Want: "at most " + strconv.Itoa(policykit.MaxClasses) + " weights"}
	}
	w := make([]float64, len(fields))
	for i, f := range fields {
		v, err := strconv.ParseFloat(strings.TrimSpace(f), 64)
		if err != nil || !(v > 0) || math.IsInf(v, 0) {
			return nil, &guest.ConfigError{Key: "mounts", Value: s, Want: want}
		}
		w[i] = v
	}
	return w, nil
}

// Namespace gives the namespace the configured layout; it fails when the
// configured weights do not match the number of mounts.
func (p *Policy) Namespace(r *abi.NamespaceRecord) error {
	if err := p.checkMounts(r.MountCount); err != nil {
		return err
	}
	p.layout.Apply(r)
	return p.names.Declare(r)
}

func (p *Policy) checkMounts(n uint32) error {
	if p.weights != nil && uint32(len(p.weights)) != n {
		return guest.Unsupported("sharded: " + strconv.Itoa(len(p.weights)) + " mount weights are configured for " + strconv.FormatUint(uint64(n), 10) + " mounts")
	}
	return nil
}

// Name chooses the mount and the fan-out name of every key. The names
// come first, in one call for the batch (policykit.Names.PutEach), then
// the mounts: with nothing called per record, as each call costs a Go
// guest tens of wasm instructions. A record whose mount count the
// configured weights do not match fails after the records before it are
// named, as when each record was checked, named and placed in turn.
func (p *Policy) Name(recs []abi.NameRecord) error {
	if p.weights != nil {
		for i := range recs {
			if err := p.checkMounts(recs[i].MountCount); err != nil {
				if perr := p.names.PutEach(recs[:i]); perr != nil {
					return perr
				}
				return err
			}
		}
	}
	if err := p.names.PutEach(recs); err != nil {
		return err
	}
	for i := range recs {
		r := &recs[i]
		if p.weights != nil {
			r.Mount = p.weighted(r.KeyHash, r.MountCount)
			continue
		}
		// Equal weights: -1/ln(u) grows with u, so the largest hash wins
		// and no logarithm is needed.
		best, bestHash := uint32(0), uint64(0)
		for m := range r.MountCount {
			if h := mix(r.KeyHash ^ (uint64(m)+1)*0x9E3779B97F4A7C15); m == 0 || h > bestHash {
				best, bestHash = m, h
			}
		}
		r.Mount = best
	}
	return nil
}

// weighted picks one of mounts by weighted rendezvous hashing.
func (p *Policy) weighted(keyHash uint64, mounts uint32) uint32 {
	if mounts <= 1 {
		return 0
	}
	best, bestScore := uint32(0), math.Inf(-1)
	for m := range mounts {
		// u in (0, 1): 53 random bits of a mix of the key hash and the mount.
		u := (float64(mix(keyHash^(uint64(m)+1)*0x9E3779B97F4A7C15)>>11) + 0.5) / (1 << 53)
		if s := -p.weights[m] / math.Log(u); s > bestScore {
			best, bestScore = m, s
		}
	}
	return best
}

// mix is the SplitMix64 finalizer.
func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

// Access applies access records.
func (p *Policy) Access(recs []abi.AccessRecord) error {
	return p.track.ApplyAll(recs)
}

// Evict writes the least recently used unpinned entries of req.Mount (of all
// mounts, merged by time, for abi.AnyMount) until their sizes cover
// req.Bytes or out is full.
func (p *Policy) Evict(req *abi.EvictRequest, out []abi.Victim) (int, error) {
	t := p.track
	n, freed := 0, uint64(0)
	if req.Mount != abi.AnyMount {
		if req.Mount >= uint32(len(t.Lists)) {
			return 0, nil
		}
		for i := t.Lists[req.Mount].Front(&t.Pool); i >= 0 && n < len(out) && freed < req.Bytes; i = t.Pool.Next(i) {
			if e := t.Pool.At(i); e.Pins == 0 {
				out[n] = abi.Victim{Entry: e.ID, Score: e.Time}
				n++
				freed += e.Size
			}
		}
		return n, nil
	}
	// Merge the per-mount lists: repeatedly take the oldest head.
	if cap(p.cursors) < len(t.Lists) {
		p.cursors = make([]int32, len(t.Lists))
	}
	cur := p.cursors[:len(t.Lists)]
	for m := range t.Lists {
		cur[m] = t.Lists[m].Front(&t.Pool)
	}
	for n < len(out) && freed < req.Bytes {
		best := -1
		for m, i := range cur {
			for i >= 0 && t.Pool.At(i).Pins != 0 {
				i = t.Pool.Next(i)
			}
			cur[m] = i
			if i >= 0 && (best < 0 || t.Pool.At(i).Time < t.Pool.At(cur[best]).Time) {
				best = m
			}
		}
		if best < 0 {
			break
		}
		e := t.Pool.At(cur[best])
		out[n] = abi.Victim{Entry: e.ID, Score: e.Time}
		n++
		freed += e.Size
		cur[best] = t.Pool.Next(cur[best])
	}
	return n, nil
}
