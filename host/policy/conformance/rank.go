package conformance

import (
	"fmt"
	"math"
	"math/bits"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/host/policy/policytest"
)

// rankEntries is how many entries the rank check tells two hosts of: more
// than one batch per shard.
const rankEntries = 1500

// rank tells two fresh hosts (the configured shards and 1) the same
// history under different handles and compares their ranks; then hits
// some entries and checks that their ranks did not drop.
func (s *suite) rank() (string, error) {
	if !s.host.Features().Has(abi.FeatureRank) {
		return "no FeatureRank declared: the host ranks entries by their last access; nothing to check", nil
	}
	type side struct {
		h    *policy.Host
		idx  *policytest.Index
		base uint64 // handle of entry i: base + step*i
		step uint64
	}
	sides := []*side{{base: 1, step: 1}, {base: 1_000_001, step: 3}}
	for i, sd := range sides {
		sd.idx = policytest.NewIndex()
		for _, ns := range s.ns {
			sd.idx.AddNamespace(ns)
		}
		shards := s.opts.Shards
		if i == 1 {
			shards = 1
		}
		h, err := s.open(sd.idx, shards)
		if err != nil {
			return "", fmt.Errorf("opening a host of %d shards: %w", shards, err)
		}
		defer h.Close(s.ctx)
		sd.h = h
	}
	base := s.now
	history := func(sd *side, i uint64, kind uint32, at uint64) abi.AccessRecord {
		ns := s.ns[i%uint64(len(s.ns))]
		return abi.AccessRecord{Entry: sd.base + sd.step*i, Time: at, Size: 4096 * (1 + i%5),
			KeyHash: abi.KeyHash(fmt.Appendf(nil, "ranked-%d", i)), Kind: kind, NS: ns.NS}
	}
	tell := func(sd *side, recs []abi.AccessRecord) error {
		sd.idx.Apply(recs)
		return s.timed(func() error { return sd.h.Access(s.ctx, recs) })
	}
	ranks := func(sd *side, now uint64, n uint64) ([]abi.RankRecord, error) {
		recs := make([]abi.RankRecord, n)
		for i := range recs {
			recs[i] = abi.RankRecord{Entry: sd.base + sd.step*uint64(i), Time: now}
		}
		err := s.timed(func() error { return sd.h.Rank(s.ctx, recs) })
		return recs, err
	}
	for _, sd := range sides {
		var recs []abi.AccessRecord
		for i := range uint64(rankEntries) {
			recs = append(recs, history(sd, i, abi.AccessInsert, base+i*1000))
		}
		for i := uint64(0); i < rankEntries; i += 3 {
			recs = append(recs, history(sd, i, abi.AccessHit, base+(rankEntries+i)*1000))
			if i%7 == 0 {
				recs = append(recs, history(sd, i, abi.AccessHit, base+(2*rankEntries+i)*1000))
			}
		}
		if err := tell(sd, recs); err != nil {
			return "", err
		}
	}
	now := base + 4*rankEntries*1000
	a, err := ranks(sides[0], now, rankEntries)
	if err != nil {
		return "", err
	}
	b, err := ranks(sides[1], now, rankEntries)
	if err != nil {
		return "", err
	}
	for i := range a {
		switch {
		case a[i].State != abi.RankKnown:
			return "", fmt.Errorf("entry %d, told to the plugin: state %d, want %d (known)", a[i].Entry, a[i].State, abi.RankKnown)
		case b[i].State != abi.RankKnown:
			return "", fmt.Errorf("entry %d, told to the plugin: state %d, want %d (known)", b[i].Entry, b[i].State, abi.RankKnown)
		case a[i].Rank != b[i].Rank:
			return "", fmt.Errorf("the same history ranks %d as entry %d (%d shards) and %d as entry %d (1 shard): a rank must depend only on the history and the time",
				a[i].Rank, a[i].Entry, s.opts.Shards, b[i].Rank, b[i].Entry)
		}
	}
	var hits []abi.AccessRecord
	for i := range uint64(100) {
		hits = append(hits, history(sides[0], i, abi.AccessHit, now+i))
	}
	if err := tell(sides[0], hits); err != nil {
		return "", err
	}
	after, err := ranks(sides[0], now+1000, 100)
	if err != nil {
		return "", err
	}
	for i := range after {
		if after[i].State != abi.RankKnown || after[i].Rank < a[i].Rank {
			return "", fmt.Errorf("entry %d ranks %d (state %d) after a hit, %d before: a hit must not lower a rank",
				after[i].Entry, after[i].Rank, after[i].State, a[i].Rank)
		}
	}
	s.now = now + 1000
	return fmt.Sprintf("%d entries rank alike under other handles in hosts of %d and 1 shards; 100 hits lowered no rank", rankEntries, s.opts.Shards), nil
}

// rankSlack is how far from an entry's last access the rank scale lets a
// rank be: a day, in Unix nanoseconds. A rank in seconds, or 0, is
// decades away.
const rankSlack = uint64(24 * time.Hour)

// rankCeiling is the highest rank the rank scale allows an entry last
// used at last after hits hits: a day above it per doubling of its
// accesses (its INSERT and its hits), so a day for an entry never hit,
// three days after 3 hits. lfu's last access plus one half_life per
// frequency level (bits.Len of its accesses) stays below it for a
// half_life of at most a day. It saturates.
func rankCeiling(last uint64, hits uint32) uint64 {
	up := rankSlack * uint64(bits.Len64(1+uint64(hits)))
	if last > math.MaxUint64-up {
		return math.MaxUint64
	}
	return last + up
}

// ranked is a fresh host of the configured shards for the rank checks,
// with helpers that tell it histories and ask for ranks.
type ranked struct {
	s    *suite
	h    *policy.Host
	idx  *policytest.Index
	next uint64 // the next handle
}

func (s *suite) ranked() (*ranked, error) {
	h, idx, err := s.fresh(s.opts.Shards)
	if err != nil {
		return nil, err
	}
	return &ranked{s: s, h: h, idx: idx, next: 1}, nil
}

// withRanked runs a rank check on a fresh host of the configured shards;
// it passes, saying why, when the plugin does not declare FEATURE_RANK.
func (s *suite) withRanked(fn func(r *ranked) (string, error)) func() (string, error) {
	return func() (string, error) {
		if !s.host.Features().Has(abi.FeatureRank) {
			return "no FEATURE_RANK declared: the host ranks entries by their last access; nothing to check", nil
		}
		r, err := s.ranked()
		if err != nil {
			return "", err
		}
		defer r.h.Close(s.ctx)
		return fn(r)
	}
}

// insert tells the host of a new entry inserted at t and hit at each of
// hits, in order; it returns the handle.
func (r *ranked) insert(t uint64, hits ...uint64) (uint64, error) {
	id := r.next
	r.next++
	ns := r.s.ns[id%uint64(len(r.s.ns))]
	recs := []abi.AccessRecord{{Entry: id, Time: t, Size: 4096 * (1 + id%5), KeyHash: abi.KeyHash(fmt.Appendf(nil, "rank-%d", id)),
		Kind: abi.AccessInsert, NS: ns.NS}}
	for i, at := range hits {
		hit := recs[0]
		hit.Kind, hit.Time, hit.Hits = abi.AccessHit, at, uint32(i+1)
		recs = append(recs, hit)
	}
	return id, r.tell(recs)
}

func (r *ranked) tell(recs []abi.AccessRecord) error {
	r.idx.Apply(recs)
	return r.s.timed(func() error { return r.h.Access(r.s.ctx, recs) })
}

// ranks asks for the ranks of ids at now.
func (r *ranked) ranks(now uint64, ids []uint64) ([]abi.RankRecord, error) {
	recs := make([]abi.RankRecord, len(ids))
	for i, id := range ids {
		recs[i] = abi.RankRecord{Entry: id, Time: now}
	}
	err := r.s.timed(func() error { return r.h.Rank(r.s.ctx, recs) })
	return recs, err
}

// known asks for the ranks of ids, every one of which the plugin was
// told of, and fails on any RANK_UNKNOWN.
func (r *ranked) known(now uint64, ids []uint64) ([]uint64, error) {
	recs, err := r.ranks(now, ids)
	if err != nil {
		return nil, err
	}
	out := make([]uint64, len(recs))
	for i, rec := range recs {
		if rec.State != abi.RankKnown {
			return nil, fmt.Errorf("entry %d, told to the plugin: state %d, want %d (RANK_KNOWN)", rec.Entry, rec.State, abi.RankKnown)
		}
		out[i] = rec.Rank
	}
	return out, nil
}

// off describes how far rank is from t.
func off(rank, t uint64) string {
	if rank >= t {
		return fmt.Sprintf("%v after it", time.Duration(min(rank-t, 1<<63-1)))
	}
	return fmt.Sprintf("%v before it", time.Duration(min(t-rank, 1<<63-1)))
}

// rankScale checks that ranks are Unix nanoseconds of an access.
func (s *suite) rankScale(r *ranked) (string, error) {
	ms := uint64(time.Millisecond)
	base := s.now
	var cold, hot []uint64
	var coldAt, hotLast []uint64
	for i := range uint64(100) {
		t := base + i*ms
		id, err := r.insert(t)
		if err != nil {
			return "", err
		}
		cold, coldAt = append(cold, id), append(coldAt, t)
		id, err = r.insert(t, t+ms, t+2*ms, t+3*ms)
		if err != nil {
			return "", err
		}
		hot, hotLast = append(hot, id), append(hotLast, t+3*ms)
	}
	now := base + 200*ms
	a, err := r.known(now, cold)
	if err != nil {
		return "", err
	}
	for i, rank := range a {
		if t := coldAt[i]; rank+rankSlack < t || rank > t+rankSlack {
			return "", fmt.Errorf("entry %d, inserted at %d (Unix ns) and never hit, ranks %d, %s: a rank is on the scale of Unix nanoseconds of an access, within a day of the last access here",
				cold[i], t, rank, off(rank, t))
		}
	}
	b, err := r.known(now, hot)
	if err != nil {
		return "", err
	}
	for i, rank := range b {
		if t := hotLast[i]; rank+rankSlack < t {
			return "", fmt.Errorf("entry %d, last used at %d (Unix ns) after 3 hits, ranks %d, %s: a rank is never more than a day below the last access",
				hot[i], t, rank, off(rank, t))
		}
		if t := hotLast[i]; rank > rankCeiling(t, 3) {
			return "", fmt.Errorf("entry %d, last used at %d (Unix ns) after 3 hits, ranks %d, %s: a hit entry ranks at most a day above its last access per doubling of its accesses (3 days here)",
				hot[i], t, rank, off(rank, t))
		}
	}
	s.now = now
	return "200 entries, 100 of them hit 3 times: every rank within a day of the last access (Unix nanoseconds), 3 days above it after 3 hits", nil
}

// rankOrder checks that ranks are monotone in recency and hits, and that
// a HIT older than the last access lowers no rank.
func (s *suite) rankOrder(r *ranked) (string, error) {
	ms := uint64(time.Millisecond)
	base := s.now
	// Recency: entries inserted 1 ms apart, never hit or hit twice.
	for _, hits := range []int{0, 2} {
		var ids []uint64
		for i := range uint64(50) {
			t := base + i*ms
			var at []uint64
			for j := range uint64(hits) {
				at = append(at, t+(j+1)*ms/10)
			}
			id, err := r.insert(t, at...)
			if err != nil {
				return "", err
			}
			ids = append(ids, id)
		}
		ranks, err := r.known(base+100*ms, ids)
		if err != nil {
			return "", err
		}
		for i := 1; i < len(ranks); i++ {
			if ranks[i] < ranks[i-1] {
				return "", fmt.Errorf("entries %d and %d, each hit %d times, the second used 1 ms later: ranks %d and %d: an entry used later ranks no lower",
					ids[i-1], ids[i], hits, ranks[i-1], ranks[i])
			}
		}
	}
	// Hits: entries last used at the same time, after 0 to 32 hits.
	last := base + 200*ms
	var ids []uint64
	counts := []int{0, 1, 2, 3, 4, 8, 16, 32}
	for _, k := range counts {
		var at []uint64
		for j := range k {
			at = append(at, last-uint64(k-1-j)*ms/100)
		}
		id, err := r.insert(last-uint64(k)*ms/100-ms, at...)
		if err != nil {
			return "", err
		}
		ids = append(ids, id)
	}
	ranks, err := r.known(last+ms, ids)
	if err != nil {
		return "", err
	}
	for i := 1; i < len(ranks); i++ {
		if ranks[i] < ranks[i-1] {
			return "", fmt.Errorf("entries %d and %d, last used at the same time after %d and %d hits: ranks %d and %d: more hits rank no lower",
				ids[i-1], ids[i], counts[i-1], counts[i], ranks[i-1], ranks[i])
		}
	}
	// A HIT older than the last access (another node's use, a clock
	// step) lowers no rank.
	before, err := r.known(last+2*ms, ids)
	if err != nil {
		return "", err
	}
	var old []abi.AccessRecord
	for i, id := range ids {
		e, _ := r.idx.Lookup(id)
		old = append(old, abi.AccessRecord{Entry: id, Time: last - 10*uint64(time.Second), Size: e.Size, KeyHash: e.KeyHash,
			Kind: abi.AccessHit, NS: e.NS, Hits: uint32(counts[i] + 1)})
	}
	if err := r.s.timed(func() error { return r.h.Access(s.ctx, old) }); err != nil {
		return "", err
	}
	after, err := r.known(last+2*ms, ids)
	if err != nil {
		return "", err
	}
	for i := range after {
		if after[i] < before[i] {
			return "", fmt.Errorf("entry %d ranks %d after a HIT dated 10 s before its last access, %d before: a hit, whatever its time, lowers no rank (a use older than the last access leaves the last access as it is)",
				ids[i], after[i], before[i])
		}
	}
	s.now = last + 3*ms
	return "ranks rise with recency (never hit, hit twice) and with hits (0 to 32 at the same last access); a HIT 10 s older than the last access lowers none", nil
}

// rankUnknown checks the state of handles the plugin was told of, was
// told to remove, and never heard of.
func (s *suite) rankUnknown(r *ranked) (string, error) {
	var live, removed []uint64
	for i := range uint64(60) {
		id, err := r.insert(s.now + i*1000)
		if err != nil {
			return "", err
		}
		if i%4 == 3 {
			removed = append(removed, id)
			continue
		}
		live = append(live, id)
	}
	var rm []abi.AccessRecord
	for _, id := range removed {
		e, _ := r.idx.Lookup(id)
		rm = append(rm, abi.AccessRecord{Entry: id, Time: s.now + 100_000, Size: e.Size, KeyHash: e.KeyHash, Kind: abi.AccessRemove, NS: e.NS})
	}
	if err := r.tell(rm); err != nil {
		return "", err
	}
	var never []uint64
	for i := range uint64(60) {
		never = append(never, 1_000_000_007+i*7919)
	}
	now := s.now + 200_000
	if _, err := r.known(now, live); err != nil {
		return "", fmt.Errorf("%w: a plugin answers RANK_KNOWN for every entry it was told of", err)
	}
	for _, set := range []struct {
		ids  []uint64
		what string
	}{{removed, "was sent a REMOVE"}, {never, "was never reported to the plugin"}} {
		recs, err := r.ranks(now, set.ids)
		if err != nil {
			return "", err
		}
		for _, rec := range recs {
			if rec.State != abi.RankUnknown {
				return "", fmt.Errorf("entry %d %s, yet the plugin answered state %d (rank %d): an entry it does not know is RANK_UNKNOWN, so that the host ranks it by its own last access",
					rec.Entry, set.what, rec.State, rec.Rank)
			}
		}
	}
	s.now = now
	return fmt.Sprintf("%d live entries RANK_KNOWN; %d removed and %d never told RANK_UNKNOWN", len(live), len(removed), len(never)), nil
}

// restoreFields builds a host from RESTORE records (a restart) and checks
// that the ranks use their time as the last access and their hits as the
// hit count.
func (s *suite) restoreFields() (string, error) {
	if !s.host.Features().Has(abi.FeatureRank) {
		return "no FEATURE_RANK declared: nothing to rank a RESTORE by; nothing to check", nil
	}
	ms := uint64(time.Millisecond)
	last := s.now + 100*ms
	// The plugin's own live ranks say whether hits count for it.
	live, err := s.ranked()
	if err != nil {
		return "", err
	}
	defer live.h.Close(s.ctx)
	plain, err := live.insert(last)
	if err != nil {
		return "", err
	}
	var at []uint64
	for j := range uint64(16) {
		at = append(at, last-(15-j)*ms/100)
	}
	hit, err := live.insert(last-ms, at...)
	if err != nil {
		return "", err
	}
	lr, err := live.known(last+ms, []uint64{plain, hit})
	if err != nil {
		return "", err
	}
	hitsCount := lr[1] > lr[0]

	// Restored entries: for each of 8 times, hit counts 0, 1, 4 and 16.
	counts := []uint32{0, 1, 4, 16}
	idx := policytest.NewIndex()
	for _, ns := range s.ns {
		idx.AddNamespace(ns)
	}
	type restored struct {
		id   uint64
		t    uint64
		hits uint32
	}
	var rs []restored
	var recs []abi.AccessRecord
	for i := range uint64(8) {
		for j, k := range counts {
			id := 1 + i*uint64(len(counts)) + uint64(j)
			ns := s.ns[id%uint64(len(s.ns))]
			t := last - (7-i)*ms
			rs = append(rs, restored{id, t, k})
			recs = append(recs, abi.AccessRecord{Entry: id, Time: t, Size: 4096, KeyHash: abi.KeyHash(fmt.Appendf(nil, "restored-%d", id)),
				Kind: abi.AccessRestore, NS: ns.NS, Hits: k})
		}
	}
	idx.Apply(recs)
	h, err := s.open(idx, s.opts.Shards)
	if err != nil {
		return "", fmt.Errorf("opening a host over %d stored entries: %w", len(recs), err)
	}
	defer h.Close(s.ctx)
	r := &ranked{s: s, h: h, idx: idx}
	ids := make([]uint64, len(rs))
	for i, x := range rs {
		ids[i] = x.id
	}
	ranks, err := r.known(last+ms, ids)
	if err != nil {
		return "", fmt.Errorf("built from RESTORE records: %w", err)
	}
	rank := map[[2]uint64]uint64{}
	for i, x := range rs {
		rank[[2]uint64{x.t, uint64(x.hits)}] = ranks[i]
		if x.hits == 0 && (ranks[i]+rankSlack < x.t || ranks[i] > x.t+rankSlack) {
			return "", fmt.Errorf("entry %d, restored with time %d and 0 hits, ranks %d, %s: RESTORE's time is the file's last access, and a rank is within a day of it",
				x.id, x.t, ranks[i], off(ranks[i], x.t))
		}
		if ranks[i]+rankSlack < x.t {
			return "", fmt.Errorf("entry %d, restored with time %d and %d hits, ranks %d, %s: RESTORE's time is the file's last access, and no rank is a day below it",
				x.id, x.t, x.hits, ranks[i], off(ranks[i], x.t))
		}
		if ranks[i] > rankCeiling(x.t, x.hits) {
			return "", fmt.Errorf("entry %d, restored with time %d and %d hits, ranks %d, %s: RESTORE's time is the file's last access, and a rank is at most a day above it per doubling of the accesses",
				x.id, x.t, x.hits, ranks[i], off(ranks[i], x.t))
		}
	}
	for _, x := range rs {
		if x.t > last-7*ms {
			if prev := rank[[2]uint64{x.t - ms, uint64(x.hits)}]; rank[[2]uint64{x.t, uint64(x.hits)}] < prev {
				return "", fmt.Errorf("restored with %d hits, the entry last used at %d ranks %d, the one used 1 ms earlier %d: RESTORE's time is the last access, and a later one ranks no lower",
					x.hits, x.t, rank[[2]uint64{x.t, uint64(x.hits)}], prev)
			}
		}
	}
	for i := range uint64(8) {
		t := last - (7-i)*ms
		for j := 1; j < len(counts); j++ {
			lo, hi := rank[[2]uint64{t, uint64(counts[j-1])}], rank[[2]uint64{t, uint64(counts[j])}]
			if hi < lo {
				return "", fmt.Errorf("restored at the same time, the entry with %d hits ranks %d, the one with %d hits %d: RESTORE's hits are the file's hit count, and more hits rank no lower",
					counts[j], hi, counts[j-1], lo)
			}
		}
		if lo, hi := rank[[2]uint64{t, 0}], rank[[2]uint64{t, 16}]; hitsCount && hi <= lo {
			return "", fmt.Errorf("restored at the same time, the entry with 16 hits ranks %d, the one with none %d, while live, an entry hit 16 times ranks %d against %d for one never hit: RESTORE's hits are the file's hit count, to be counted as the live hits are",
				hi, lo, lr[1], lr[0])
		}
	}
	s.now = last + 2*ms
	how := "hits do not raise this plugin's live ranks"
	if hitsCount {
		how = "hits raise this plugin's live ranks, and RESTORE's hits raise the restored ones"
	}
	return fmt.Sprintf("%d entries restored with 8 times and 0 to 16 hits: ranked by RESTORE's time as the last access; %s", len(rs), how), nil
}
