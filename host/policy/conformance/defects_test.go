package conformance_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/host/policy/conformance"
	"github.com/kvhost/kvhost/plugins/lfu"
	"github.com/kvhost/kvhost/plugins/lru"
	"github.com/kvhost/kvhost/plugins/sharded"
	"github.com/kvhost/kvhost/plugins/tiered"
	"github.com/kvhost/kvhost/plugins/ttl"
)

// The one-defect variants of issue 85: each is a built-in policy, run
// natively, with one rule of docs/abi.md broken. lfu is the base of the
// rank defects (its ranks count hits), tiered of the tiering ones (it
// declares every tiering feature).

// rankSeconds ranks in Unix seconds instead of nanoseconds.
type rankSeconds struct{ *lfu.Policy }

func (p rankSeconds) Rank(recs []abi.RankRecord) error {
	err := p.Policy.Rank(recs)
	for i := range recs {
		recs[i].Rank /= uint64(time.Second)
	}
	return err
}

// rankZero ranks every entry 0.
type rankZero struct{ *lfu.Policy }

func (p rankZero) Rank(recs []abi.RankRecord) error {
	err := p.Policy.Rank(recs)
	for i := range recs {
		recs[i].Rank = 0
	}
	return err
}

// unknownKnown answers an unknown handle as known, ranked at the time.
type unknownKnown struct{ *lfu.Policy }

func (p unknownKnown) Rank(recs []abi.RankRecord) error {
	err := p.Policy.Rank(recs)
	for i := range recs {
		if recs[i].State == abi.RankUnknown {
			recs[i].State, recs[i].Rank = abi.RankKnown, recs[i].Time
		}
	}
	return err
}

// olderHit takes a HIT's time as the last access even when it is older:
// a use reported late lowers the rank.
type olderHit struct {
	*lfu.Policy
	last map[uint64]uint64
}

func (p olderHit) Access(recs []abi.AccessRecord) error {
	for i := range recs {
		r := &recs[i]
		switch r.Kind {
		case abi.AccessInsert, abi.AccessRestore:
			p.last[r.Entry] = r.Time
		case abi.AccessRemove:
			delete(p.last, r.Entry)
		case abi.AccessHit:
			if t, ok := p.last[r.Entry]; ok && r.Time < t {
				// The defect: the older time replaces the last access.
				re := *r
				re.Kind = abi.AccessRestore
				if err := p.Policy.Access([]abi.AccessRecord{re}); err != nil {
					return err
				}
				p.last[r.Entry] = r.Time
				continue
			}
			p.last[r.Entry] = r.Time
		}
		if err := p.Policy.Access(recs[i : i+1]); err != nil {
			return err
		}
	}
	return nil
}

// restoreHitsIgnored drops RESTORE's hit count.
type restoreHitsIgnored struct{ *lfu.Policy }

func (p restoreHitsIgnored) Access(recs []abi.AccessRecord) error {
	for i := range recs {
		if recs[i].Kind == abi.AccessRestore {
			recs[i].Hits = 0
		}
	}
	return p.Policy.Access(recs)
}

// mounts keeps the last mount description, for the tiered variants.
type mounts struct{ recs []abi.MountRecord }

func (m *mounts) keep(recs []abi.MountRecord) { m.recs = append(m.recs[:0], recs...) }

// demoteVLLMFS demotes to the last described vllm-fs mount.
type demoteVLLMFS struct {
	*tiered.Policy
	m *mounts
}

func (p demoteVLLMFS) Mounts(recs []abi.MountRecord) error {
	p.m.keep(recs)
	return p.Policy.Mounts(recs)
}

func (p demoteVLLMFS) EvictTo(req *abi.EvictRequest, out []abi.Victim, targets []abi.VictimTarget) (int, error) {
	n, err := p.Policy.EvictTo(req, out, targets)
	last := uint32(0)
	for _, r := range p.m.recs {
		if r.Flags&abi.MountVLLMFS != 0 {
			last = r.Mount
		}
	}
	for i := range n {
		if targets[i].Mount != abi.NoMount {
			targets[i].Mount = last
		}
	}
	return n, err
}

// repeatMove asks again, at every tick, for each move it asked for until
// the entry's REMOVE comes.
type repeatMove struct {
	*tiered.Policy
	asked map[uint64]abi.Move
}

func (p repeatMove) Access(recs []abi.AccessRecord) error {
	for _, r := range recs {
		if r.Kind == abi.AccessRemove {
			delete(p.asked, r.Entry)
		}
	}
	return p.Policy.Access(recs)
}

func (p repeatMove) Tick(req *abi.TickRequest, out []abi.Move) (int, error) {
	n, err := p.Policy.Tick(req, out)
	for _, m := range p.asked {
		if n == len(out) {
			break
		}
		if !containsEntry(out[:n], m.Entry) {
			out[n] = m
			n++
		}
	}
	for _, m := range out[:n] {
		p.asked[m.Entry] = m
	}
	return n, err
}

func containsEntry(mv []abi.Move, e uint64) bool {
	for _, m := range mv {
		if m.Entry == e {
			return true
		}
	}
	return false
}

// admitEarly sends files to another mount before the mounts are
// described.
type admitEarly struct {
	*tiered.Policy
	m *mounts
}

func (p admitEarly) Mounts(recs []abi.MountRecord) error {
	p.m.keep(recs)
	return p.Policy.Mounts(recs)
}

func (p admitEarly) Admit(recs []abi.AdmitRecord) error {
	err := p.Policy.Admit(recs)
	if len(p.m.recs) == 0 {
		for i := range recs {
			recs[i].Target = recs[i].Mount ^ 1
		}
	}
	return err
}

// tickTo moves every entry its tick moves to the mount to picks from the
// last description instead.
type tickTo struct {
	*tiered.Policy
	m  *mounts
	to func(recs []abi.MountRecord) uint32
}

func (p tickTo) Mounts(recs []abi.MountRecord) error {
	p.m.keep(recs)
	return p.Policy.Mounts(recs)
}

func (p tickTo) Tick(req *abi.TickRequest, out []abi.Move) (int, error) {
	n, err := p.Policy.Tick(req, out)
	for i := range n {
		out[i].Mount = p.to(p.m.recs)
	}
	return n, err
}

// pastLast is the mount past the last described.
func pastLast(recs []abi.MountRecord) uint32 { return uint32(len(recs)) }

// objectMount is the object mount (MOUNT_OBJECT), which takes no tick's
// move.
func objectMount(recs []abi.MountRecord) uint32 {
	for _, r := range recs {
		if r.Flags&abi.MountObject != 0 {
			return r.Mount
		}
	}
	return 0
}

// tickPins promotes hit entries whether pinned or not.
type tickPins struct {
	*tiered.Policy
	pins map[uint64]int    // pins by entry
	cold map[uint64]uint32 // hits of entries on mount 1
}

func (p tickPins) Access(recs []abi.AccessRecord) error {
	for _, r := range recs {
		switch r.Kind {
		case abi.AccessPin:
			p.pins[r.Entry]++
		case abi.AccessUnpin:
			p.pins[r.Entry] = max(p.pins[r.Entry]-1, 0)
		case abi.AccessHit:
			if r.Mount == 1 {
				p.cold[r.Entry]++
			}
		case abi.AccessRemove:
			delete(p.pins, r.Entry)
			delete(p.cold, r.Entry)
		}
	}
	return p.Policy.Access(recs)
}

func (p tickPins) Tick(req *abi.TickRequest, out []abi.Move) (int, error) {
	n, err := p.Policy.Tick(req, out)
	for e, hits := range p.cold {
		if n < len(out) && hits >= 3 && p.pins[e] > 0 && !containsEntry(out[:n], e) {
			out[n] = abi.Move{Entry: e, Mount: 0}
			n++
			delete(p.cold, e)
		}
	}
	return n, err
}

// TestOneDefectPoliciesFailTheirRule: each one-defect variant of a
// built-in policy of issue 85 fails the check named for the rule it
// breaks, without -v, with a message saying what was wrong.
func TestOneDefectPoliciesFailTheirRule(t *testing.T) {
	tests := []struct {
		name    string
		policy  func() guest.Policy
		fixture string // a wasm fixture instead of policy
		check   string
		message string
	}{
		{name: "rank in seconds", policy: func() guest.Policy { return rankSeconds{lfu.New()} },
			check: "rank scale", message: "on the scale of Unix nanoseconds"},
		{name: "rank always 0", policy: func() guest.Policy { return rankZero{lfu.New()} },
			check: "rank scale", message: "ranks 0,"},
		{name: "unknown handle answered as known", policy: func() guest.Policy { return unknownKnown{lfu.New()} },
			check: "rank unknown", message: "an entry it does not know is RANK_UNKNOWN"},
		{name: "an older hit lowers the rank", policy: func() guest.Policy { return olderHit{lfu.New(), map[uint64]uint64{}} },
			check: "rank order", message: "a hit, whatever its time, lowers no rank"},
		{name: "RESTORE's hit count ignored", policy: func() guest.Policy { return restoreHitsIgnored{lfu.New()} },
			check: "restore fields", message: "RESTORE's hits are the file's hit count"},
		{name: "demotion to a vllm-fs mount", policy: func() guest.Policy { return demoteVLLMFS{tiered.New(), &mounts{}} },
			check: "demotion targets", message: "is a vllm-fs mount"},
		{name: "a move asked for again", policy: func() guest.Policy { return repeatMove{tiered.New(), map[uint64]abi.Move{}} },
			check: "repeated moves", message: "asks again to move entry"},
		{name: "an admission target before the mounts are described", policy: func() guest.Policy { return admitEarly{tiered.New(), &mounts{}} },
			check: "before mount descriptions", message: "admit to another mount only once the host has described the mounts"},
		{name: "a tick to a missing mount", policy: func() guest.Policy { return tickTo{tiered.New(), &mounts{}, pastLast} },
			check: "tick moves", message: "target mount 7, but only 7 mounts exist"},
		{name: "a tick to the object mount", policy: func() guest.Policy { return tickTo{tiered.New(), &mounts{}, objectMount} },
			check: "tick moves", message: "the object mount (MOUNT_OBJECT)"},
		{name: "a tick ignoring pins", policy: func() guest.Policy {
			return tickPins{tiered.New(), map[uint64]int{}, map[uint64]uint32{}}
		}, check: "tick moves", message: "is pinned"},
		{name: "a tick ignoring max", fixture: "tickmax", check: "tick moves", message: "more than the 1 asked for"},
		{name: "a refused memory.grow ignored", fixture: "growignore", check: "memory limit", message: "out of bounds memory access"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			opts := conformance.Options{Name: tt.name, CallTimeout: 5 * time.Second}
			var r conformance.Report
			if tt.fixture != "" {
				r = conformance.Run(context.Background(), fixture(t, tt.fixture), opts)
			} else {
				r = conformance.RunPolicy(context.Background(), tt.policy, opts)
			}
			for _, f := range r.Failed() {
				t.Logf("failed: %s: %s", f.Name, f.Message)
			}
			c, ok := r.Check(tt.check)
			if !ok {
				logReport(t, r)
				t.Fatalf("no check %q in the report", tt.check)
			}
			if c.OK || !strings.Contains(c.Message, tt.message) || c.Rule == "" {
				logReport(t, r)
				t.Fatalf("check %q: ok=%v %q; want a failure naming its rule, with %q", c.Name, c.OK, c.Message, tt.message)
			}
			var b strings.Builder
			r.WriteTo(&b)
			if !strings.Contains(b.String(), "FAIL "+tt.check) {
				t.Errorf("the text report does not name the failed check %q:\n%s", tt.check, b.String())
			}
		})
	}
}

// TestBuiltinPoliciesPassNatively: the bases of the one-defect variants,
// and every other built-in policy, pass every check run natively.
func TestBuiltinPoliciesPassNatively(t *testing.T) {
	tests := []struct {
		name   string
		policy func() guest.Policy
	}{
		{"lru", func() guest.Policy { return lru.New() }},
		{"lfu", func() guest.Policy { return lfu.New() }},
		{"ttl", func() guest.Policy { return ttl.New() }},
		{"sharded", func() guest.Policy { return sharded.New() }},
		{"tiered", func() guest.Policy { return tiered.New() }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			r := conformance.RunPolicy(context.Background(), tt.policy, conformance.Options{Name: tt.name})
			if !r.OK() {
				logReport(t, r)
				t.Fatalf("built-in policy %s fails the suite natively", tt.name)
			}
			if len(r.Checks) < 25 {
				t.Errorf("%d checks ran, want every one", len(r.Checks))
			}
		})
	}
}
