package conformance

import (
	"fmt"
	"strings"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
)

// tieringFeatures are the feature bits the tiering checks exercise.
const tieringFeatures = abi.FeatureMounts | abi.FeatureAdmitMount | abi.FeatureDemote | abi.FeatureTick

// kvhostMounts is the number of kvhost mounts the suite describes (the
// mount count of its largest namespace); vllmfsMounts vllm-fs mounts
// follow them, and the object mount (MOUNT_OBJECT) comes last, as the
// engine lists them.
const (
	kvhostMounts = 4
	vllmfsMounts = 2
	objectMount  = kvhostMounts + vllmfsMounts
	allMounts    = objectMount + 1
)

// mountFixtures describes the mounts of the tiering checks, fastest
// first: a small NVMe, an SSD, a disk and a large shared file system
// (the kvhost mounts, 0 to 3), then two vllm-fs mounts (4 and 5) that
// take no names, admissions or moves: the one after the last kvhost
// mount is where a plugin that ignores MOUNT_VLLMFS sends files; and last
// the object mount (6), which takes admissions and demotions but no
// tick's move.
func mountFixtures(used uint64) []abi.MountRecord {
	classes := []uint32{abi.ClassNVMe, abi.ClassSSD, abi.ClassHDD, abi.ClassNetwork, abi.ClassNetwork, abi.ClassNetwork, abi.ClassNetwork}
	names := []string{"xfs", "ext4", "ext4", "nfs", "ceph", "ceph", "s3"}
	recs := make([]abi.MountRecord, allMounts)
	for i := range recs {
		c := uint64(1<<30) << (2 * min(i, kvhostMounts))
		r := &recs[i]
		r.Mount, r.Class, r.Capacity, r.Used = uint32(i), classes[i], c, min(used, c)
		r.Free, r.High, r.Low = c-r.Used, c/100*95, c/100*85
		copy(r.FSName[:], names[i])
		copy(r.Backend[:], "staging")
		switch {
		case i == objectMount:
			r.Flags |= abi.MountObject
		case i >= kvhostMounts:
			r.Flags |= abi.MountVLLMFS
		}
	}
	return recs
}

// isVLLMFS reports whether mount m of mountFixtures is a vllm-fs mount.
func isVLLMFS(m uint32) bool { return m >= kvhostMounts && m < objectMount }

// describe sends the mount fixtures to h (twice, usage changing).
func (s *suite) describe(h *policy.Host) error {
	for _, used := range []uint64{0, 1 << 29} {
		if err := s.timed(func() error { return h.UpdateMounts(s.ctx, mountFixtures(used)) }); err != nil {
			return fmt.Errorf("mount description: %w", err)
		}
	}
	return nil
}

func (s *suite) mountDescriptions() (string, error) {
	if !s.host.Features().Has(abi.FeatureMounts) {
		return "no FEATURE_MOUNTS declared: nothing to check", nil
	}
	if err := s.describe(s.host); err != nil {
		return "", err
	}
	return fmt.Sprintf("%d kvhost, %d vllm-fs and an object mount described, twice", kvhostMounts, vllmfsMounts), nil
}

// admitTargets names and admits 32 keys per namespace on h and returns
// the admission records.
func (s *suite) admitTargets(h *policy.Host) ([]abi.AdmitRecord, error) {
	var names []abi.NameRecord
	for _, ns := range s.ns {
		for _, k := range keys(32, 0x70+byte(ns.NS)) {
			names = append(names, nameRecord(ns, k))
		}
	}
	if err := s.name(h, names); err != nil {
		return nil, err
	}
	recs := make([]abi.AdmitRecord, len(names))
	for i, n := range names {
		s.now += 1000
		recs[i] = abi.AdmitRecord{KeyHash: n.KeyHash, Size: admitSizes[i%len(admitSizes)] << (i % 8), Time: s.now, NS: n.NS, Mount: n.Mount}
	}
	err := s.timed(func() error { return h.Admit(s.ctx, recs) })
	return recs, err
}

func (s *suite) admissionTargets() (string, error) {
	h := s.host
	if !h.Features().Has(abi.FeatureAdmitMount) {
		return "no FEATURE_ADMIT_MOUNT declared: nothing to check", nil
	}
	if err := s.describe(h); err != nil {
		return "", err
	}
	recs, err := s.admitTargets(h)
	if err != nil {
		return "", err
	}
	moved := 0
	for i, r := range recs {
		switch {
		case r.Target >= allMounts:
			return "", fmt.Errorf("admission record %d: target mount %d of %d described", i, r.Target, allMounts)
		case isVLLMFS(r.Target):
			return "", fmt.Errorf("admission record %d: target mount %d is a vllm-fs mount (MOUNT_VLLMFS): it takes no admission", i, r.Target)
		case r.Target != r.Mount:
			moved++
		}
	}
	return fmt.Sprintf("%d files admitted, %d sent to another mount (the object mount among them), none to a vllm-fs mount", len(recs), moved), nil
}

// setUp prepares a tiering check of feature f on the suite's host: it
// describes the mounts, empties the cache and inserts n entries of 64 KiB
// on each of mounts. skip is set (and nothing done) when the plugin does
// not declare f.
func (s *suite) setUp(f abi.Feature, name string, n int, mounts ...uint32) (skip string, err error) {
	if !s.host.Features().Has(f) {
		return fmt.Sprintf("no %s declared: nothing to check", name), nil
	}
	if err := s.describe(s.host); err != nil {
		return "", err
	}
	if err := s.removeAll(); err != nil {
		return "", err
	}
	for _, m := range mounts {
		if err := s.access(s.host, s.inserts(n, m, 64<<10)); err != nil {
			return "", err
		}
	}
	return "", nil
}

// pinSome pins every seventh entry of the index and returns the unpin
// records that release them.
func (s *suite) pinSome(h *policy.Host) error {
	var pins []abi.AccessRecord
	s.idx.Range(func(e policy.Entry) bool {
		if e.ID%7 == 0 {
			pins = append(pins, s.event(e, abi.AccessPin))
		}
		return true
	})
	return s.access(h, pins)
}

// unpinAll releases every pin of the index and removes every entry.
func (s *suite) unpinAll(h *policy.Host) error {
	var unpins []abi.AccessRecord
	s.idx.Range(func(e policy.Entry) bool {
		for range e.Pins {
			unpins = append(unpins, s.event(e, abi.AccessUnpin))
		}
		return true
	})
	if err := s.access(h, unpins); err != nil {
		return err
	}
	return s.removeAll()
}

func (s *suite) demotionTargets() (string, error) {
	h := s.host
	if skip, err := s.setUp(abi.FeatureDemote, "FEATURE_DEMOTE", 300, 0, 1, kvhostMounts-1); skip != "" || err != nil {
		return skip, err
	}
	if err := s.pinSome(h); err != nil {
		return "", err
	}
	demoted, deleted := 0, 0
	for _, m := range []uint32{0, 1, kvhostMounts - 1, abi.AnyMount} {
		_, total := s.entries(m)
		req := abi.EvictRequest{Bytes: total / 4, Time: s.now, Mount: m}
		var evs []policy.Eviction
		if err := s.timed(func() (err error) { evs, err = h.Evictions(s.ctx, req, abi.MaxBatch); return err }); err != nil {
			return "", fmt.Errorf("eviction on mount %s: %w", mountName(m), err)
		}
		v := make([]abi.Victim, len(evs))
		for i, ev := range evs {
			v[i] = ev.Victim
			e, _ := s.idx.Lookup(ev.Entry)
			switch t := ev.Target; {
			case t.Mount == abi.NoMount:
				deleted++
			case t.Mount >= allMounts || t.Mount == e.Mount:
				return "", fmt.Errorf("eviction on mount %s, victim %d (entry %d on mount %d): target mount %d", mountName(m), i, ev.Entry, e.Mount, t.Mount)
			case isVLLMFS(t.Mount):
				return "", fmt.Errorf("eviction on mount %s, victim %d (entry %d on mount %d): target mount %d is a vllm-fs mount (MOUNT_VLLMFS): the engine moves no file there",
					mountName(m), i, ev.Entry, e.Mount, t.Mount)
			case t.Flags&^abi.MoveDeleteIfFull != 0:
				return "", fmt.Errorf("eviction on mount %s, victim %d: target flags %#x", mountName(m), i, t.Flags)
			default:
				demoted++
			}
		}
		if err := s.checkVictims(v, req, abi.MaxBatch); err != nil {
			return "", fmt.Errorf("eviction on mount %s: %w", mountName(m), err)
		}
	}
	if err := s.unpinAll(h); err != nil {
		return "", err
	}
	return fmt.Sprintf("evictions on mounts 0, 1, %d and any: %d victims demoted, %d deleted, none to a vllm-fs mount", kvhostMounts-1, demoted, deleted), nil
}

// checkMoves checks a tick's moves against the index: known, unpinned,
// listed once, to another described kvhost mount.
func (s *suite) checkMoves(mv []abi.Move, what string) error {
	seen := map[uint64]bool{}
	for i, m := range mv {
		e, ok := s.idx.Lookup(m.Entry)
		switch {
		case !ok:
			return fmt.Errorf("%s, move %d: entry %d is unknown", what, i, m.Entry)
		case seen[m.Entry]:
			return fmt.Errorf("%s, move %d: entry %d listed twice", what, i, m.Entry)
		case e.Pins > 0:
			return fmt.Errorf("%s, move %d: entry %d is pinned", what, i, m.Entry)
		case m.Mount >= allMounts || m.Mount == e.Mount:
			return fmt.Errorf("%s, move %d: entry %d on mount %d to mount %d (%d described)", what, i, m.Entry, e.Mount, m.Mount, allMounts)
		case isVLLMFS(m.Mount):
			return fmt.Errorf("%s, move %d: entry %d to mount %d, a vllm-fs mount (MOUNT_VLLMFS): the engine moves no file there", what, i, m.Entry, m.Mount)
		case m.Mount == objectMount:
			return fmt.Errorf("%s, move %d: entry %d to mount %d, the object mount (MOUNT_OBJECT): it takes demotions at eviction, not a tick's moves", what, i, m.Entry, m.Mount)
		case m.Flags != 0:
			return fmt.Errorf("%s, move %d: flags %#x, want 0", what, i, m.Flags)
		}
		seen[m.Entry] = true
	}
	return nil
}

// hitMount sends n hits to each unpinned entry on mount whose id is
// round modulo mod.
func (s *suite) hitMount(h *policy.Host, mount uint32, round, mod uint64, n int) error {
	var hits []abi.AccessRecord
	s.idx.Range(func(e policy.Entry) bool {
		if e.Mount == mount && e.ID%mod == round {
			for range n {
				hits = append(hits, s.event(e, abi.AccessHit))
				e.Hits++
			}
		}
		return true
	})
	return s.access(h, hits)
}

func (s *suite) tick(h *policy.Host, max int) ([]abi.Move, error) {
	s.now += uint64(100 * time.Millisecond)
	var mv []abi.Move
	err := s.timed(func() (err error) {
		mv, err = h.Tick(s.ctx, abi.TickRequest{Time: s.now, Interval: uint64(100 * time.Millisecond)}, max)
		return err
	})
	return mv, err
}

// tickMoves runs three ticks (max 1, 3 and 1024) after hits on the
// entries of mount 1, some pinned, and applies the moves as the engine
// does (a REMOVE of the old handle, an INSERT of a new one on the
// target).
func (s *suite) tickMoves() (string, error) {
	h := s.host
	if skip, err := s.setUp(abi.FeatureTick, "FEATURE_TICK", 400, 0, 1); skip != "" || err != nil {
		return skip, err
	}
	if err := s.pinSome(h); err != nil {
		return "", err
	}
	moves := 0
	tickMax := [3]int{1, 3, abi.MaxBatch}
	for round := range 3 {
		if err := s.hitMount(h, 1, uint64(round), 3, 4); err != nil {
			return "", err
		}
		mv, err := s.tick(h, tickMax[round])
		what := fmt.Sprintf("tick %d (max %d)", round, tickMax[round])
		if err != nil {
			return "", fmt.Errorf("%s: %w", what, err)
		}
		// The host holds each shard to max and rejects more; the moves
		// of all shards together may be up to shards × max.
		if err := s.checkMoves(mv, what); err != nil {
			return "", err
		}
		var recs []abi.AccessRecord
		for _, m := range mv {
			e, _ := s.idx.Lookup(m.Entry)
			s.next++
			in := s.event(e, abi.AccessInsert)
			in.Entry, in.Mount, in.Time = s.next, m.Mount, e.LastAccess
			recs = append(recs, s.event(e, abi.AccessRemove), in)
		}
		if err := s.access(h, recs); err != nil {
			return "", err
		}
		moves += len(mv)
	}
	if err := s.unpinAll(h); err != nil {
		return "", err
	}
	return fmt.Sprintf("3 ticks (max 1, 3, 1024) after hits on mount 1, every seventh entry pinned: %d moves, applied as the engine does", moves), nil
}

// repeatedMoves ticks twice with no record in between: a move asked for
// at the first tick is under way (or dropped) and the plugin knows
// nothing new of it, so the second must not ask for it again.
func (s *suite) repeatedMoves() (string, error) {
	h := s.host
	if skip, err := s.setUp(abi.FeatureTick, "FEATURE_TICK", 200, 0, 1); skip != "" || err != nil {
		return skip, err
	}
	if err := s.hitMount(h, 1, 0, 1, 4); err != nil {
		return "", err
	}
	first, err := s.tick(h, abi.MaxBatch)
	if err != nil {
		return "", fmt.Errorf("first tick: %w", err)
	}
	asked := map[uint64]bool{}
	for _, m := range first {
		asked[m.Entry] = true
	}
	total := len(first)
	for i := range 2 {
		mv, err := s.tick(h, abi.MaxBatch)
		if err != nil {
			return "", fmt.Errorf("tick %d: %w", i+2, err)
		}
		for _, m := range mv {
			if asked[m.Entry] {
				return "", fmt.Errorf("tick %d asks again to move entry %d, asked for at an earlier tick with no record of it and no mount description since: the move is under way (wait for its REMOVE) or was dropped (ask again once something new is known)",
					i+2, m.Entry)
			}
			asked[m.Entry] = true
		}
		total += len(mv)
	}
	if err := s.removeAll(); err != nil {
		return "", err
	}
	if total == 0 {
		return "3 ticks after hits on mount 1 asked for no move: nothing repeated", nil
	}
	return fmt.Sprintf("3 ticks with no record in between: %d moves asked, none twice", total), nil
}

// beforeDescriptions drives a fresh host, whose mounts were never
// described: the daemon describes the mounts before any store, eviction
// or tick, so admission to another mount, a demotion or a move before a
// description guesses the hierarchy.
func (s *suite) beforeDescriptions() (string, error) {
	f := s.host.Features() & tieringFeatures
	if f&(abi.FeatureAdmitMount|abi.FeatureDemote|abi.FeatureTick) == 0 {
		return "no tiering feature declared: nothing to check", nil
	}
	h, idx, err := s.fresh(s.opts.Shards)
	if err != nil {
		return "", err
	}
	defer h.Close(s.ctx)
	saved := s.idx
	s.idx = idx
	defer func() { s.idx = saved }()
	var what []string
	if f.Has(abi.FeatureAdmitMount) {
		recs, err := s.admitTargets(h)
		if err != nil {
			return "", fmt.Errorf("admission before any mount description: %w", err)
		}
		for i, r := range recs {
			if r.Admit == 1 && r.Target != r.Mount {
				return "", fmt.Errorf("admission record %d before any mount description: target mount %d, not the name's mount %d: admit to another mount only once the host has described the mounts",
					i, r.Target, r.Mount)
			}
		}
		what = append(what, "admission")
	}
	var total [2]uint64
	for m := range uint32(2) {
		recs := s.inserts(200, m, 64<<10)
		for _, r := range recs {
			total[r.Mount] += r.Size
		}
		if err := s.access(h, recs); err != nil {
			return "", err
		}
	}
	if f.Has(abi.FeatureDemote) {
		for m := range uint32(2) {
			req := abi.EvictRequest{Bytes: total[m], Time: s.now, Mount: m}
			var evs []policy.Eviction
			if err := s.timed(func() (err error) { evs, err = h.Evictions(s.ctx, req, abi.MaxBatch); return err }); err != nil {
				return "", fmt.Errorf("eviction on mount %d before any mount description: %w", m, err)
			}
			for i, ev := range evs {
				if ev.Target.Mount != abi.NoMount {
					return "", fmt.Errorf("eviction on mount %d before any mount description: victim %d has target mount %d", m, i, ev.Target.Mount)
				}
			}
		}
		what = append(what, "evictions on mounts 0 and 1")
	}
	if f.Has(abi.FeatureTick) {
		if err := s.hitMount(h, 1, 0, 1, 4); err != nil {
			return "", err
		}
		mv, err := s.tick(h, abi.MaxBatch)
		if err != nil {
			return "", fmt.Errorf("tick before any mount description: %w", err)
		}
		if len(mv) > 0 {
			return "", fmt.Errorf("tick before any mount description: %d moves (entry %d to mount %d)", len(mv), mv[0].Entry, mv[0].Mount)
		}
		what = append(what, "a tick")
	}
	return strings.Join(what, ", ") + " before any mount description: no other mount, no demotion, no move", nil
}
