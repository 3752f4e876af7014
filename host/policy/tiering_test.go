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
)

// twoMounts describes two mounts.
var twoMounts = []abi.MountRecord{{Mount: 0, Capacity: 1 << 30}, {Mount: 1, Capacity: 1 << 40}}

// TestV1PluginWithoutTiering: a v1 plugin that declares no tiering feature
// (the WAT fixture, the native lru) keeps loading and working: mount
// descriptions and ticks never reach it, admission keeps the named mount,
// every victim is deleted.
func TestV1PluginWithoutTiering(t *testing.T) {
	ctx := context.Background()
	for name, open := range map[string]func(idx policy.Index) (*policy.Host, error){
		"wat": func(idx policy.Index) (*policy.Host, error) {
			return policy.Open(ctx, fixture(t, "wellbehaved"), "wellbehaved", idx, policy.Config{Logger: quietLogger()})
		},
		"native-lru": func(idx policy.Index) (*policy.Host, error) {
			return policy.NewNative(newLRU, idx, policy.Config{Logger: quietLogger()})
		},
	} {
		t.Run(name, func(t *testing.T) {
			idx := policytest.NewIndex()
			h, err := open(idx)
			if err != nil {
				t.Fatal(err)
			}
			defer h.Close(ctx)
			if f := h.Features(); f&(abi.FeatureMounts|abi.FeatureAdmitMount|abi.FeatureDemote|abi.FeatureTick) != 0 {
				t.Fatalf("features %s", f)
			}
			if err := h.UpdateMounts(ctx, twoMounts); err != nil {
				t.Fatal(err)
			}
			insert(t, h, idx, 1, 8, 100)
			moves, err := h.Tick(ctx, abi.TickRequest{Time: 1}, 16)
			if err != nil || len(moves) != 0 {
				t.Fatalf("Tick: %v, %v; want nothing", moves, err)
			}
			evs, err := h.Evictions(ctx, abi.EvictRequest{Bytes: 1 << 20, Mount: abi.AnyMount}, 16)
			if err != nil || len(evs) != 8 {
				t.Fatalf("Evictions: %d, %v", len(evs), err)
			}
			for _, ev := range evs {
				if ev.Target.Mount != abi.NoMount {
					t.Fatalf("victim %d has target %+v without FeatureDemote", ev.Entry, ev.Target)
				}
			}
			recs := []abi.AdmitRecord{{KeyHash: 1, Size: 10, Mount: 1}}
			if err := h.Admit(ctx, recs); err != nil || recs[0].Target != 1 {
				t.Fatalf("Admit: %+v, %v; want the named mount as target", recs[0], err)
			}
			st := h.Stats()
			if st.Calls["kvhost_mounts"] != 0 || st.Calls["kvhost_tick"] != 0 || st.Failures != 0 {
				t.Fatalf("calls %v, failures %d: the tiering hooks must not be called", st.Calls, st.Failures)
			}
		})
	}
}

// tierGuest is a native policy with every tiering feature, whose outputs
// the tests set: lru for the rest.
type tierGuest struct {
	guest.Policy
	mounts  *[]abi.MountRecord // received
	target  uint32             // admission target
	victimT abi.VictimTarget   // every victim's target
	moves   []abi.Move         // every tick's moves
}

func (g *tierGuest) Admit(recs []abi.AdmitRecord) error {
	for i := range recs {
		recs[i].Admit, recs[i].Target = 1, g.target
	}
	return nil
}
func (g *tierGuest) ExtraFeatures() abi.Feature { return abi.FeatureAdmitMount }
func (g *tierGuest) Mounts(recs []abi.MountRecord) error {
	*g.mounts = append((*g.mounts)[:0], recs...)
	return nil
}
func (g *tierGuest) EvictTo(req *abi.EvictRequest, out []abi.Victim, targets []abi.VictimTarget) (int, error) {
	n, err := g.Policy.Evict(req, out)
	for i := range n {
		targets[i] = g.victimT
	}
	return n, err
}
func (g *tierGuest) Tick(_ *abi.TickRequest, out []abi.Move) (int, error) {
	return copy(out, g.moves), nil
}

// TestTieringValidation: the host passes valid tiering outputs through and
// fails the instance, naming the rule, for each invalid one; before any
// mount description (undescribed) a demotion or a move is invalid, and
// Victims, which reads no targets, is not.
func TestTieringValidation(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name        string
		g           tierGuest
		call        string // "admit", "evict", "victims", "tick"
		wantErr     string // "" for success
		undescribed bool   // no UpdateMounts
	}{
		{"admission to mount 1", tierGuest{target: 1}, "admit", "", false},
		{"admission to mount 2 of 2", tierGuest{target: 2}, "admit", "Target mount 2, but only 2 mounts exist", false},
		{"demotion to mount 1", tierGuest{victimT: abi.VictimTarget{Mount: 1, Flags: abi.MoveDeleteIfFull}}, "evict", "", false},
		{"deletion", tierGuest{victimT: abi.VictimTarget{Mount: abi.NoMount}}, "evict", "", false},
		{"demotion to its own mount", tierGuest{victimT: abi.VictimTarget{Mount: 0}}, "evict", "already on its target mount 0", false},
		{"demotion to mount 5", tierGuest{victimT: abi.VictimTarget{Mount: 5}}, "evict", "target mount 5, but only 2 mounts exist", false},
		{"unknown flag", tierGuest{victimT: abi.VictimTarget{Mount: 1, Flags: 2}}, "evict", "target flags 0x2", false},
		{"promotion", tierGuest{moves: []abi.Move{{Entry: 3, Mount: 1}}}, "tick", "", false},
		{"move of a pinned entry", tierGuest{moves: []abi.Move{{Entry: 2, Mount: 1}}}, "tick", "entry 2 is pinned", false},
		{"move never stored", tierGuest{moves: []abi.Move{{Entry: 99, Mount: 1}}}, "tick", "never stored", false},
		{"move to its own mount", tierGuest{moves: []abi.Move{{Entry: 3, Mount: 0}}}, "tick", "already on mount 0", false},
		{"move twice", tierGuest{moves: []abi.Move{{Entry: 3, Mount: 1}, {Entry: 3, Mount: 1}}}, "tick", "moved more than once", false},
		{"move with flags", tierGuest{moves: []abi.Move{{Entry: 3, Mount: 1, Flags: 1}}}, "tick", "flags 0x1", false},
		{"demotion before any description", tierGuest{victimT: abi.VictimTarget{Mount: 1}}, "evict", "target mount 1 before any mount description", true},
		{"deletion before any description", tierGuest{victimT: abi.VictimTarget{Mount: abi.NoMount}}, "evict", "", true},
		{"victims, targets unread, before any description", tierGuest{victimT: abi.VictimTarget{Mount: 1}}, "victims", "", true},
		{"move before any description", tierGuest{moves: []abi.Move{{Entry: 3, Mount: 1}}}, "tick", "to mount 1 before any mount description", true},
		{"no move before any description", tierGuest{}, "tick", "", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got []abi.MountRecord
			idx := policytest.NewIndex()
			h, err := policy.NewNative(func() guest.Policy {
				g := tt.g
				g.Policy, g.mounts = newLRU(), &got
				return &g
			}, idx, policy.Config{Shards: 1, Logger: quietLogger()})
			if err != nil {
				t.Fatal(err)
			}
			defer h.Close(ctx)
			want := abi.FeatureAdmit | abi.FeatureAdmitMount | abi.FeatureMounts | abi.FeatureDemote | abi.FeatureTick
			if f := h.Features(); f != want {
				t.Fatalf("features %s, want %s", f, want)
			}
			if !tt.undescribed {
				if err := h.UpdateMounts(ctx, twoMounts); err != nil {
					t.Fatal(err)
				}
				if len(got) != 2 || got[1].Capacity != 1<<40 {
					t.Fatalf("the plugin got mounts %+v", got)
				}
			}
			insert(t, h, idx, 1, 4, 100, 2)
			switch tt.call {
			case "admit":
				recs := []abi.AdmitRecord{{KeyHash: 7, Size: 10, Mount: 0}}
				err = h.Admit(ctx, recs)
				if err == nil && recs[0].Target != tt.g.target {
					t.Fatalf("target %d, want %d", recs[0].Target, tt.g.target)
				}
			case "evict":
				var evs []policy.Eviction
				evs, err = h.Evictions(ctx, abi.EvictRequest{Bytes: 1 << 20, Mount: 0}, 16)
				if err == nil && (len(evs) != 3 || evs[0].Target != tt.g.victimT) {
					t.Fatalf("evictions %+v: want 3 (one is pinned) with target %+v", evs, tt.g.victimT)
				}
			case "victims":
				var v []abi.Victim
				v, err = h.Victims(ctx, abi.EvictRequest{Bytes: 1 << 20, Mount: 0}, 16)
				if err == nil && len(v) != 3 {
					t.Fatalf("victims %+v: want 3 (one is pinned)", v)
				}
			case "tick":
				var mv []abi.Move
				mv, err = h.Tick(ctx, abi.TickRequest{Time: 1}, 16)
				if err == nil && len(mv) != len(tt.g.moves) {
					t.Fatalf("moves %+v, want %+v", mv, tt.g.moves)
				}
			}
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("%v", err)
			case tt.wantErr != "" && (!errors.Is(err, policy.ErrPlugin) || !strings.Contains(err.Error(), tt.wantErr)):
				t.Fatalf("err %v, want a plugin error with %q", err, tt.wantErr)
			}
		})
	}
}

// TestMountsReplayedToRebuiltInstance: an instance rebuilt after a failure
// gets the last mount description before any other event.
func TestMountsReplayedToRebuiltInstance(t *testing.T) {
	ctx := context.Background()
	var got []abi.MountRecord
	fail := true
	idx := policytest.NewIndex()
	h, err := policy.NewNative(func() guest.Policy {
		return &failingTick{tierGuest: tierGuest{Policy: newLRU(), mounts: &got}, fail: &fail}
	}, idx, policy.Config{Shards: 1, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close(ctx)
	if err := h.UpdateMounts(ctx, twoMounts); err != nil {
		t.Fatal(err)
	}
	got = nil
	if _, err := h.Tick(ctx, abi.TickRequest{Time: 1}, 4); err != nil {
		t.Fatalf("Tick (fails once, then succeeds on the rebuilt instance): %v", err)
	}
	if st := h.Stats(); st.Replacements != 1 || len(got) != 2 {
		t.Fatalf("%d replacements, the rebuilt instance got %d mount records; want 1 and 2", st.Replacements, len(got))
	}
}

// failingTick is a tierGuest whose first tick fails.
type failingTick struct {
	tierGuest
	fail *bool
}

func (g *failingTick) Tick(req *abi.TickRequest, out []abi.Move) (int, error) {
	if *g.fail {
		*g.fail = false
		return 0, errors.New("first tick fails")
	}
	return g.tierGuest.Tick(req, out)
}
