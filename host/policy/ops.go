package policy

import (
	"errors"
	"fmt"
	"slices"

	"github.com/kvhost/kvhost/abi"
)

// batchOp is the input and output handling of one hook call. The same ops
// serve wasm and native instances: both expose a scratch area laid out as
// ABI v1 says.
type batchOp interface {
	// write puts the call's input into scratch and returns the hook's
	// argument.
	write(s *shard, scratch []byte) int32
	// read validates the output in scratch after the hook returned status
	// st >= 0, and hands it to the caller. It must not keep scratch.
	read(h *Host, s *shard, scratch []byte, st int32) error
	// records is the number of records of the call, for Stats.
	records(s *shard) int
}

// initOp passes the configuration to kvhost_init.
type initOp struct{ config []byte }

func (o *initOp) write(_ *shard, scratch []byte) int32 {
	return int32(copy(scratch, o.config))
}
func (o *initOp) read(*Host, *shard, []byte, int32) error { return nil }
func (o *initOp) records(*shard) int                      { return 0 }

// namespaceOp declares one namespace and reads back its layout.
type namespaceOp struct{ in, out abi.NamespaceRecord }

func (o *namespaceOp) write(_ *shard, scratch []byte) int32 {
	r := &abi.View[abi.NamespaceRecord](scratch, 1)[0]
	*r = o.in
	// Outputs, prefilled with the default layout: a hook that writes
	// nothing chooses it (docs/abi.md, NamespaceRecord).
	r.KeysPerFile, r.Order = abi.DefaultKeysPerFile, abi.DefaultOrder
	return 0
}

func (o *namespaceOp) read(_ *Host, _ *shard, scratch []byte, _ int32) error {
	r := &abi.View[abi.NamespaceRecord](scratch, 1)[0]
	switch {
	case r.KeysPerFile < 1 || r.KeysPerFile > abi.MaxKeysPerFile:
		return fmt.Errorf("namespace %d: KeysPerFile %d is outside [1, %d]", o.in.NS, r.KeysPerFile, abi.MaxKeysPerFile)
	case r.Order != abi.OrderLayerMajor && r.Order != abi.OrderBlockMajor:
		return fmt.Errorf("namespace %d: Order %d is neither %d (layer-major) nor %d (block-major)",
			o.in.NS, r.Order, abi.OrderLayerMajor, abi.OrderBlockMajor)
	}
	o.out = o.in
	o.out.KeysPerFile, o.out.Order = r.KeysPerFile, r.Order
	return nil
}
func (o *namespaceOp) records(*shard) int { return 1 }

// nameOp names the records of recs at positions s.pos.
type nameOp struct{ recs []abi.NameRecord }

func (o *nameOp) write(s *shard, scratch []byte) int32 {
	v := abi.View[abi.NameRecord](scratch, len(s.pos))
	for j, p := range s.pos {
		v[j] = o.recs[p]
		v[j].Mount, v[j].PathLen = 0, 0 // outputs: a hook that writes nothing fails
	}
	return int32(len(s.pos))
}

func (o *nameOp) read(_ *Host, s *shard, scratch []byte, _ int32) error {
	v := abi.View[abi.NameRecord](scratch, len(s.pos))
	for j, p := range s.pos {
		in, out := &o.recs[p], &v[j]
		if out.PathLen > abi.MaxPathLen {
			return fmt.Errorf("record %d (key hash %#016x): PathLen %d > %d", p, in.KeyHash, out.PathLen, abi.MaxPathLen)
		}
		if err := abi.CheckPath(out.PathBuf[:out.PathLen]); err != nil {
			return fmt.Errorf("record %d (key hash %#016x): %w", p, in.KeyHash, err)
		}
		if out.Mount >= in.MountCount {
			return fmt.Errorf("record %d (key hash %#016x): mount %d, but only %d mounts exist", p, in.KeyHash, out.Mount, in.MountCount)
		}
	}
	for j, p := range s.pos {
		in, out := &o.recs[p], &v[j]
		in.Mount, in.PathLen = out.Mount, out.PathLen
		copy(in.PathBuf[:], out.PathBuf[:out.PathLen])
	}
	return nil
}
func (o *nameOp) records(s *shard) int { return len(s.pos) }

// unsetAdmit marks an Admit field the hook did not write.
const unsetAdmit = 0xFFFFFFFF

// admitOp asks about the records of recs at positions s.pos. With choose
// (abi.FeatureAdmitMount) the plugin may change Target, which must stay
// below mounts when that is known (non-zero).
type admitOp struct {
	recs   []abi.AdmitRecord
	choose bool
	mounts int
}

func (o *admitOp) write(s *shard, scratch []byte) int32 {
	v := abi.View[abi.AdmitRecord](scratch, len(s.pos))
	for j, p := range s.pos {
		v[j] = o.recs[p]
		v[j].Admit = unsetAdmit // an output the hook must overwrite
		v[j].Target = 0         // reserved without the feature
		if o.choose {
			v[j].Target = v[j].Mount
		}
	}
	return int32(len(s.pos))
}

func (o *admitOp) read(_ *Host, s *shard, scratch []byte, _ int32) error {
	v := abi.View[abi.AdmitRecord](scratch, len(s.pos))
	for j, p := range s.pos {
		switch a := v[j].Admit; {
		case a == unsetAdmit:
			return fmt.Errorf("record %d (key hash %#016x): Admit was not written", p, o.recs[p].KeyHash)
		case a > 1:
			return fmt.Errorf("record %d (key hash %#016x): Admit %d is neither 0 nor 1", p, o.recs[p].KeyHash, a)
		case o.choose && o.mounts > 0 && int(v[j].Target) >= o.mounts:
			return fmt.Errorf("record %d (key hash %#016x): Target mount %d, but only %d mounts exist", p, o.recs[p].KeyHash, v[j].Target, o.mounts)
		}
	}
	for j, p := range s.pos {
		o.recs[p].Admit = v[j].Admit
		o.recs[p].Target = o.recs[p].Mount
		if o.choose {
			o.recs[p].Target = v[j].Target
		}
	}
	return nil
}
func (o *admitOp) records(s *shard) int { return len(s.pos) }

// accessOp reports the records of recs at positions s.pos, or all of recs.
type accessOp struct {
	recs []abi.AccessRecord
	all  bool
}

func (o *accessOp) write(s *shard, scratch []byte) int32 {
	if o.all {
		copy(abi.View[abi.AccessRecord](scratch, len(o.recs)), o.recs)
		for i := range o.recs {
			s.ledger.maxEntry = max(s.ledger.maxEntry, o.recs[i].Entry)
			s.ledger.removed.Delete(o.recs[i].Entry)
		}
		return int32(len(o.recs))
	}
	v := abi.View[abi.AccessRecord](scratch, len(s.pos))
	for j, p := range s.pos {
		v[j] = o.recs[p]
	}
	return int32(len(s.pos))
}

// record puts the records at s.pos in the shard's ledger, before they are
// sent (routedAfter), and drops from s.pos a HIT or PIN of an entry the
// plugin was sent a REMOVE for: a lookup's hit flushed after the entry's
// REMOVE, which a plugin that learns unknown entries (the ABI says to
// ignore them) would bring back as a phantom and offer.
func (o *accessOp) record(s *shard) {
	kept := s.pos[:0]
	for _, p := range s.pos {
		r := &o.recs[p]
		if k := r.Kind; k == abi.AccessHit || k == abi.AccessPin {
			if s.ledger.removed.Has(r.Entry) {
				continue
			}
		}
		s.ledger.apply(r)
		kept = append(kept, p)
	}
	s.pos = kept
}
func (o *accessOp) read(*Host, *shard, []byte, int32) error { return nil }
func (o *accessOp) records(s *shard) int {
	if o.all {
		return len(o.recs)
	}
	return len(s.pos)
}

// errUndescribed marks a demotion or move asked for before the host
// described the mounts (kvhost_mounts): the plugin can only be guessing
// the hierarchy.
var errUndescribed = errors.New("demote or move only once the host has described the mounts (kvhost_mounts)")

// evictOp asks one shard for up to max victims and appends the valid ones
// to *out, from position base (a retry starts over from there). With
// demote (abi.FeatureDemote, and a caller that wants targets) it reads
// each victim's target too, checked against the mounts described: none
// but NoMount before the first description.
type evictOp struct {
	req     abi.EvictRequest
	max     int32
	out     *[]Eviction
	base    int
	nshards int
	demote  bool
	mounts  int
}

func (o *evictOp) write(_ *shard, scratch []byte) int32 {
	abi.View[abi.EvictRequest](scratch, 1)[0] = o.req
	if o.demote {
		t := abi.View[abi.VictimTarget](scratch[abi.EvictTargetsOffset:], int(o.max))
		for i := range t {
			t[i] = abi.VictimTarget{Mount: abi.NoMount}
		}
	}
	return o.max
}

func (o *evictOp) read(h *Host, s *shard, scratch []byte, st int32) error {
	*o.out = (*o.out)[:o.base]
	if st > o.max {
		return fmt.Errorf("returned %d victims, more than the %d asked for", st, o.max)
	}
	v := abi.View[abi.Victim](scratch[abi.EvictHeaderSize:], int(st))
	var targets []abi.VictimTarget
	if o.demote {
		targets = abi.View[abi.VictimTarget](scratch[abi.EvictTargetsOffset:], int(st))
		for i, t := range targets {
			switch {
			case t.Flags&^abi.MoveDeleteIfFull != 0:
				return fmt.Errorf("victim %d: target flags %#x: only %#x is defined", i, t.Flags, abi.MoveDeleteIfFull)
			case t.Mount != abi.NoMount && o.mounts == 0:
				return fmt.Errorf("victim %d: target mount %d before any mount description: %w", i, t.Mount, errUndescribed)
			case t.Mount != abi.NoMount && int(t.Mount) >= o.mounts:
				return fmt.Errorf("victim %d: target mount %d, but only %d mounts exist", i, t.Mount, o.mounts)
			}
		}
	}
	s.seen = s.seen[:0]
	for i := range v {
		if err := s.choosable(h, "victim", i, v[i].Entry, o.nshards); err != nil {
			return err
		}
	}
	if id, ok := s.repeated(); ok {
		return fmt.Errorf("entry %d is a victim more than once", id)
	}
	for i := range v {
		e, ok := h.idx.Lookup(v[i].Entry)
		switch {
		case ok && o.req.Mount != abi.AnyMount && e.Mount != o.req.Mount:
			return fmt.Errorf("victim %d: entry %d is on mount %d, not the requested mount %d", i, v[i].Entry, e.Mount, o.req.Mount)
		case !ok || e.Pins > 0:
			// Removed or pinned by the engine, which updates its index
			// before it tells the policy: the plugin cannot know yet. Not
			// the plugin's fault; the victim is skipped.
			h.stats.staleVictims.Add(1)
			continue
		}
		ev := Eviction{Victim: v[i], Target: abi.VictimTarget{Mount: abi.NoMount}}
		if targets != nil {
			if t := targets[i]; t.Mount == e.Mount {
				return fmt.Errorf("victim %d: entry %d is already on its target mount %d", i, v[i].Entry, t.Mount)
			}
			ev.Target = targets[i]
		}
		*o.out = append(*o.out, ev)
	}
	return nil
}
func (o *evictOp) records(*shard) int { return 1 }

// errRemovedOffered marks a victim or move of an entry the plugin was sent
// a REMOVE for.
var errRemovedOffered = errors.New("the plugin was sent its REMOVE: a plugin must forget a removed entry")

// choosable checks that the plugin may name entry id as its i-th what (a
// victim or a move): an entry reported to this shard, stored, not removed
// and not pinned as far as the plugin was told. It adds id to s.seen. An
// entry removed in the index but not yet reported is the caller's to skip.
func (s *shard) choosable(h *Host, what string, i int, id uint64, nshards int) error {
	removed := s.ledger.removed.Has(id)
	switch told := s.ledger.pins[id]; {
	case route(id, nshards) != s.id:
		return fmt.Errorf("%s %d: entry %d was never reported to this shard", what, i, id)
	case id > s.ledger.maxEntry:
		return fmt.Errorf("%s %d: entry %d was never reported to this shard (never stored)", what, i, id)
	case removed:
		h.stats.removed.Add(1)
		return fmt.Errorf("%s %d: entry %d was removed: %w", what, i, id, errRemovedOffered)
	case told > 0:
		return fmt.Errorf("%s %d: entry %d is pinned (the plugin was told of %d pins)", what, i, id, told)
	}
	s.seen = append(s.seen, id)
	return nil
}

// repeated sorts s.seen and returns an entry it holds more than once.
func (s *shard) repeated() (uint64, bool) {
	slices.Sort(s.seen)
	for i := 1; i < len(s.seen); i++ {
		if s.seen[i] == s.seen[i-1] {
			return s.seen[i], true
		}
	}
	return 0, false
}

// mountsOp describes every mount to kvhost_mounts.
type mountsOp struct{ recs []abi.MountRecord }

func (o *mountsOp) write(_ *shard, scratch []byte) int32 {
	copy(abi.View[abi.MountRecord](scratch, len(o.recs)), o.recs)
	return int32(len(o.recs))
}
func (o *mountsOp) read(*Host, *shard, []byte, int32) error { return nil }
func (o *mountsOp) records(*shard) int                      { return len(o.recs) }

// tickOp calls kvhost_tick on one shard and appends the valid moves to
// *out from position base (a retry starts over from there).
type tickOp struct {
	req     abi.TickRequest
	max     int32
	out     *[]abi.Move
	base    int
	nshards int
	mounts  int
}

func (o *tickOp) write(_ *shard, scratch []byte) int32 {
	abi.View[abi.TickRequest](scratch, 1)[0] = o.req
	return o.max
}

func (o *tickOp) read(h *Host, s *shard, scratch []byte, st int32) error {
	*o.out = (*o.out)[:o.base]
	if st > o.max {
		return fmt.Errorf("returned %d moves, more than the %d asked for", st, o.max)
	}
	v := abi.View[abi.Move](scratch[abi.TickHeaderSize:], int(st))
	s.seen = s.seen[:0]
	for i := range v {
		m := v[i]
		if err := s.choosable(h, "move", i, m.Entry, o.nshards); err != nil {
			return err
		}
		switch {
		case m.Flags != 0:
			return fmt.Errorf("move %d: flags %#x: none is defined", i, m.Flags)
		case o.mounts == 0:
			return fmt.Errorf("move %d: to mount %d before any mount description: %w", i, m.Mount, errUndescribed)
		case m.Mount == abi.NoMount || int(m.Mount) >= o.mounts:
			return fmt.Errorf("move %d: target mount %d, but only %d mounts exist", i, m.Mount, o.mounts)
		}
	}
	if id, ok := s.repeated(); ok {
		return fmt.Errorf("entry %d is moved more than once", id)
	}
	for i := range v {
		e, ok := h.idx.Lookup(v[i].Entry)
		switch {
		case !ok || e.Pins > 0:
			h.stats.staleVictims.Add(1) // as for victims: the plugin cannot know yet
			continue
		case e.Mount == v[i].Mount:
			return fmt.Errorf("move %d: entry %d is already on mount %d", i, v[i].Entry, e.Mount)
		}
		*o.out = append(*o.out, v[i])
	}
	return nil
}
func (o *tickOp) records(*shard) int { return 1 }

// rankOp asks for the ranks of the records of recs at positions s.pos
// (kvhost_rank, abi.FeatureRank).
type rankOp struct{ recs []abi.RankRecord }

func (o *rankOp) write(s *shard, scratch []byte) int32 {
	v := abi.View[abi.RankRecord](scratch, len(s.pos))
	for j, p := range s.pos {
		v[j] = abi.RankRecord{Entry: o.recs[p].Entry, Time: o.recs[p].Time, State: abi.RankUnset}
	}
	return int32(len(s.pos))
}

func (o *rankOp) read(_ *Host, s *shard, scratch []byte, _ int32) error {
	v := abi.View[abi.RankRecord](scratch, len(s.pos))
	for j, p := range s.pos {
		switch st := v[j].State; {
		case st == abi.RankUnset:
			return fmt.Errorf("record %d (entry %d): State was not written", p, o.recs[p].Entry)
		case st != abi.RankKnown && st != abi.RankUnknown:
			return fmt.Errorf("record %d (entry %d): State %d is neither %d (known) nor %d (unknown)", p, o.recs[p].Entry, st, abi.RankKnown, abi.RankUnknown)
		case v[j].Entry != o.recs[p].Entry:
			return fmt.Errorf("record %d: Entry %d was overwritten with %d: it is an input", p, o.recs[p].Entry, v[j].Entry)
		}
	}
	for j, p := range s.pos {
		o.recs[p].Rank, o.recs[p].State = v[j].Rank, v[j].State
		if v[j].State == abi.RankUnknown {
			o.recs[p].Rank = 0
		}
	}
	return nil
}
func (o *rankOp) records(s *shard) int { return len(s.pos) }
