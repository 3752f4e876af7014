package policy_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/host/policy/policytest"
	"github.com/kvhost/kvhost/plugins/lru"
)

// rankRecords asks for the ranks of ids at time now.
func rankRecords(now uint64, ids ...uint64) []abi.RankRecord {
	recs := make([]abi.RankRecord, len(ids))
	for i, id := range ids {
		recs[i] = abi.RankRecord{Entry: id, Time: now}
	}
	return recs
}

// TestRankRoutesToTheShardThatKnowsTheEntry: with 4 shards, every entry is
// ranked by the instance it was reported to (lru: its last access), an
// entry never reported is RankUnknown, and a plugin without FeatureRank
// (the WAT fixture) is never called: every record is RankUnknown.
func TestRankRoutesToTheShardThatKnowsTheEntry(t *testing.T) {
	ctx := context.Background()
	idx := policytest.NewIndex()
	h, err := policy.NewNative(newLRU, idx, policy.Config{Logger: quietLogger(), Shards: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close(ctx)
	if !h.Features().Has(abi.FeatureRank) {
		t.Fatalf("lru's features %s lack rank", h.Features())
	}
	insert(t, h, idx, 1, 40, 100)
	ids := make([]uint64, 0, 41)
	for id := uint64(1); id <= 40; id++ {
		ids = append(ids, id)
	}
	ids = append(ids, 999)
	recs := rankRecords(1<<40, ids...)
	if err := h.Rank(ctx, recs); err != nil {
		t.Fatal(err)
	}
	for _, r := range recs[:40] {
		if r.State != abi.RankKnown || r.Rank != 1000+r.Entry {
			t.Errorf("entry %d: rank %d state %d, want its last access %d, known", r.Entry, r.Rank, r.State, 1000+r.Entry)
		}
	}
	if r := recs[40]; r.State != abi.RankUnknown {
		t.Errorf("entry 999, never reported: state %d, want unknown", r.State)
	}

	w, err := policy.Open(ctx, fixture(t, "wellbehaved"), "wellbehaved", policytest.NewIndex(), policy.Config{Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close(ctx)
	recs = rankRecords(1, 1, 2)
	recs[0].Rank = 7
	if err := w.Rank(ctx, recs); err != nil {
		t.Fatal(err)
	}
	for _, r := range recs {
		if r.State != abi.RankUnknown || r.Rank != 0 {
			t.Errorf("entry %d from a plugin without rank: rank %d state %d, want 0, unknown", r.Entry, r.Rank, r.State)
		}
	}
	if n := w.Stats().Calls["kvhost_rank"]; n != 0 {
		t.Errorf("kvhost_rank called %d times on a plugin without FeatureRank", n)
	}
}

// badRanker is lru whose Rank breaks one rule.
type badRanker struct {
	*lru.Policy
	mode string
}

func (b *badRanker) Rank(recs []abi.RankRecord) error {
	if err := b.Policy.Rank(recs); err != nil {
		return err
	}
	switch b.mode {
	case "short":
		recs[len(recs)-1].State = abi.RankUnset // the last record left unwritten
	case "state":
		recs[0].State = 7
	case "entry":
		recs[0].Entry++
	case "status":
		return guest.InvalidInput("no ranks today")
	}
	return nil
}

// TestRankRejectsBadOutput: a record left unwritten, an undefined state,
// an overwritten input and a failure status each fail the call as a
// plugin failure of kvhost_rank, named in the error and counted.
func TestRankRejectsBadOutput(t *testing.T) {
	tests := []struct {
		mode, want string
		rejected   bool // an output the host refused (not a status)
	}{
		{"short", "State was not written", true},
		{"state", "State 7 is neither", true},
		{"entry", "it is an input", true},
		{"status", "no ranks today", false},
	}
	for _, tt := range tests {
		t.Run(tt.mode, func(t *testing.T) {
			ctx := context.Background()
			idx := policytest.NewIndex()
			h, err := policy.NewNative(func() guest.Policy { return &badRanker{Policy: lru.New(), mode: tt.mode} }, idx, policy.Config{Logger: quietLogger(), Shards: 1})
			if err != nil {
				t.Fatal(err)
			}
			defer h.Close(ctx)
			insert(t, h, idx, 1, 3, 100)
			err = h.Rank(ctx, rankRecords(5000, 1, 2, 3))
			var pe *policy.Error
			if !errors.As(err, &pe) || pe.Hook != "kvhost_rank" || !errors.Is(err, policy.ErrPlugin) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Rank: %v; want a plugin failure of kvhost_rank naming %q", err, tt.want)
			}
			st := h.Stats()
			if st.Failures != 2 { // the call and its retry on a rebuilt instance
				t.Errorf("failures %d, want 2", st.Failures)
			}
			if got := st.Rejections > 0; got != tt.rejected {
				t.Errorf("rejections %d: want some %v", st.Rejections, tt.rejected)
			}
		})
	}
}
