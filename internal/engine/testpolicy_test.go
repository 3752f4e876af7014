//go:build invariants

package engine

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
)

// testPolicy is a small LRU policy.Policy for the engine's tests: names are
// <hash[0:2]>/<hash>.kv on mount hash%mounts, the layout is configurable,
// and it can be told to decline keys or to offer pinned victims (which the
// engine must refuse).
type testPolicy struct {
	keysPerFile uint32
	order       uint32
	admit       func(abi.AdmitRecord) bool // nil: admit all
	hostile     bool                       // offer pinned entries as victims

	mu      sync.Mutex
	entries map[uint64]*abi.AccessRecord
	pins    map[uint64]int
	hits    int // AccessHit records seen
}

var _ policy.Policy = (*testPolicy)(nil)

func newTestPolicy(keysPerFile, order uint32) *testPolicy {
	return &testPolicy{keysPerFile: keysPerFile, order: order, entries: map[uint64]*abi.AccessRecord{}, pins: map[uint64]int{}}
}

func (p *testPolicy) Features() abi.Feature { return abi.FeatureNamespace | abi.FeatureAdmit }

func (p *testPolicy) Namespace(_ context.Context, rec abi.NamespaceRecord) (abi.NamespaceRecord, error) {
	rec.KeysPerFile, rec.Order = p.keysPerFile, p.order
	return rec, nil
}

func (p *testPolicy) Name(_ context.Context, recs []abi.NameRecord) error {
	for i := range recs {
		r := &recs[i]
		r.Mount = uint32(r.KeyHash % uint64(r.MountCount))
		r.PathLen = uint32(copy(r.PathBuf[:], fmt.Sprintf("%02x/%016x_%016x.kv", r.KeyHash>>56, r.Fingerprint, r.KeyHash)))
	}
	return nil
}

func (p *testPolicy) Admit(_ context.Context, recs []abi.AdmitRecord) error {
	for i := range recs {
		recs[i].Admit = 1
		if p.admit != nil && !p.admit(recs[i]) {
			recs[i].Admit = 0
		}
	}
	return nil
}

func (p *testPolicy) Access(_ context.Context, recs []abi.AccessRecord) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, r := range recs {
		switch r.Kind {
		case abi.AccessInsert, abi.AccessRestore:
			r := r
			p.entries[r.Entry] = &r
		case abi.AccessHit:
			p.hits++
			if e := p.entries[r.Entry]; e != nil {
				e.Time = r.Time
			}
		case abi.AccessRemove:
			delete(p.entries, r.Entry)
			delete(p.pins, r.Entry)
		case abi.AccessPin:
			p.pins[r.Entry]++
		case abi.AccessUnpin:
			p.pins[r.Entry]--
		}
	}
	return nil
}

func (p *testPolicy) Victims(_ context.Context, req abi.EvictRequest, max int) ([]abi.Victim, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var cands []*abi.AccessRecord
	for _, e := range p.entries {
		if (req.Mount == abi.AnyMount || e.Mount == req.Mount) && (p.hostile || p.pins[e.Entry] == 0) {
			cands = append(cands, e)
		}
	}
	slices.SortFunc(cands, func(a, b *abi.AccessRecord) int {
		if p.hostile && (p.pins[a.Entry] > 0) != (p.pins[b.Entry] > 0) {
			if p.pins[a.Entry] > 0 {
				return -1 // pinned first: the engine must skip them
			}
			return 1
		}
		return cmp.Or(cmp.Compare(a.Time, b.Time), cmp.Compare(a.Entry, b.Entry))
	})
	var out []abi.Victim
	for i, e := range cands {
		if i == max {
			break
		}
		out = append(out, abi.Victim{Entry: e.Entry, Score: uint64(i)})
	}
	return out, nil
}

func (p *testPolicy) Close(context.Context) error { return nil }

func (p *testPolicy) len() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.entries)
}
