package engine

import (
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync/atomic"

	"github.com/kvhost/kvhost/internal/engine/index"
	"github.com/kvhost/kvhost/internal/engine/space"
)

// budgetSet is Config.Budgets, checked, and what evictions counted of
// each (BudgetStats.Over, Kept). It belongs to the tables (namespaces.go),
// which know each namespace's model id; nil where there are none.
type budgetSet struct {
	list []Budget
	over []atomic.Int64
	kept []atomic.Int64
}

// newBudgetSet checks bs (Config.Budgets) and returns them as a set: nil
// for none. It fails with ErrInvalid naming the budget at fault.
func newBudgetSet(bs []Budget) (*budgetSet, error) {
	if len(bs) == 0 {
		return nil, nil
	}
	seen := map[string]bool{}
	for i, b := range bs {
		switch {
		case b.Model == "" || b.Model == "*":
			return nil, fmt.Errorf("%w: budget %d: no model id (a budget names the model id it covers, or a prefix of it ending in \"*\")", ErrInvalid, i)
		case seen[b.Model]:
			return nil, fmt.Errorf("%w: budget %q: given twice", ErrInvalid, b.Model)
		case b.Bytes < 0 || b.Floor < 0:
			return nil, fmt.Errorf("%w: budget %q: bytes %d, floor %d: want 0 or more", ErrInvalid, b.Model, b.Bytes, b.Floor)
		case b.Bytes > 0 && b.Floor > b.Bytes:
			return nil, fmt.Errorf("%w: budget %q: its floor of %d bytes exceeds its budget of %d", ErrInvalid, b.Model, b.Floor, b.Bytes)
		}
		seen[b.Model] = true
	}
	return &budgetSet{list: bs, over: make([]atomic.Int64, len(bs)), kept: make([]atomic.Int64, len(bs))}, nil
}

// checkFloors fails with ErrInvalid where the budgets' floors together
// exceed capacity, the bytes of the mounts' capacity: an eviction could
// then never make room without crossing one.
func (s *budgetSet) checkFloors(capacity int64) error {
	if s == nil {
		return nil
	}
	var sum int64
	largest := -1
	for i, b := range s.list {
		sum += b.Floor
		if largest < 0 || b.Floor > s.list[largest].Floor {
			largest = i
		}
	}
	if sum <= capacity {
		return nil
	}
	b := s.list[largest]
	if b.Floor > capacity {
		return fmt.Errorf("%w: budget %q: its floor of %d bytes exceeds the mounts' capacity of %d", ErrInvalid, b.Model, b.Floor, capacity)
	}
	return fmt.Errorf("%w: budgets: their floors sum to %d bytes, more than the mounts' capacity of %d (the largest: %q, %d)", ErrInvalid, sum, capacity, b.Model, b.Floor)
}

// Matches reports whether the budget covers namespaces of model id
// model: exactly, or as a prefix where b.Model ends with "*".
func (b Budget) Matches(model string) bool {
	if p, ok := strings.CutSuffix(b.Model, "*"); ok {
		return model != "" && strings.HasPrefix(model, p)
	}
	return model == b.Model
}

// match returns the index of the budget covering model id model, the
// longest matching pattern, or -1.
func (s *budgetSet) match(model string) int {
	best := -1
	for i, b := range s.list {
		if b.Matches(model) && (best < 0 || len(b.Model) > len(s.list[best].Model)) {
			best = i
		}
	}
	return best
}

// budgetRound is what one round of an eviction (evictRounds) knows of
// the budgets: the budget of each fingerprint indexed, and each budget's
// bytes above its budget and above its floor, less what the round took.
// Only the evicting goroutine uses it (under the index's lock, within
// Index.EvictID's callback).
type budgetRound struct {
	set   *budgetSet
	of    map[uint64]int // fingerprint → budget
	used  []int64        // bytes indexed, per budget
	over  []int64        // bytes above the budget (Bytes > 0), per budget
	above []int64        // bytes above the floor, per budget
	// took and kept count the files taken over budget and skipped for
	// the floor, per budget.
	took, kept []int64
}

// budgetRound returns the budgets' state for an eviction round, from
// counts (index.Counts.ByFingerprint), or nil where there are no
// budgets. It takes t.mu, shared.
func (t *tables) budgetRound(counts func() map[uint64]index.FPCount) *budgetRound {
	s := t.budgets
	if s == nil {
		return nil
	}
	c := counts()
	n := len(s.list)
	r := &budgetRound{set: s, of: map[uint64]int{}, used: make([]int64, n), over: make([]int64, n), above: make([]int64, n), took: make([]int64, n), kept: make([]int64, n)}
	t.mu.RLock()
	for _, ns := range t.nss {
		model := t.modelOfLocked(ns)
		if model == "" {
			continue
		}
		if i := s.match(model); i >= 0 {
			r.of[ns.fp] = i
			r.used[i] += c[ns.fp].Bytes
		}
	}
	t.mu.RUnlock()
	for i, b := range s.list {
		if b.Bytes > 0 {
			r.over[i] = r.used[i] - b.Bytes
		}
		r.above[i] = r.used[i] - b.Floor
	}
	return r
}

// Passes of a round with budgets: files of namespaces over their budget
// first, then any file that leaves every floor kept.
const (
	passOver = iota
	passAny
)

// pick reports whether a round's pass takes a file of fingerprint fp
// and size bytes, and counts it where it does. A nil round takes every
// file in passAny, none in passOver.
func (r *budgetRound) pick(pass int, fp uint64, size int64) bool {
	if r == nil {
		return pass == passAny
	}
	i, ok := r.of[fp]
	if !ok {
		return pass == passAny
	}
	b := r.set.list[i]
	if b.Floor > 0 && r.above[i]-size < 0 {
		r.kept[i]++
		return false
	}
	if pass == passOver {
		if r.over[i] <= 0 {
			return false
		}
		r.took[i]++
	}
	r.over[i] -= size
	r.above[i] -= size
	return true
}

// done adds the round's counts to the set's.
func (r *budgetRound) done() {
	if r == nil {
		return
	}
	for i := range r.took {
		r.set.over[i].Add(r.took[i])
		r.set.kept[i].Add(r.kept[i])
	}
}

// floorNote is why a round left files it could have taken: the budgets
// whose floors kept them, for ErrNoSpace; "" where none did.
func (r *budgetRound) floorNote() string {
	if r == nil {
		return ""
	}
	var parts []string
	for i, b := range r.set.list {
		if r.kept[i] > 0 {
			parts = append(parts, fmt.Sprintf("namespace %q holds %d bytes, its floor is %d", b.Model, r.used[i], b.Floor))
		}
	}
	return strings.Join(parts, "; ")
}

// budgetStats returns the use of each budget (Stats.Budgets) from counts
// (index.Counts.ByFingerprint), and sets the Budget of each of nss
// (Stats.Namespaces), of a namespace no client declared since the start
// by the model id the model books name. It takes t.mu, shared.
func (t *tables) budgetStats(counts map[uint64]index.FPCount, nss []NamespaceStats) []BudgetStats {
	s := t.budgets
	if s == nil {
		return nil
	}
	out := make([]BudgetStats, len(s.list))
	for i, b := range s.list {
		out[i] = BudgetStats{Model: b.Model, Budget: b.Bytes, Floor: b.Floor, Over: s.over[i].Load(), Kept: s.kept[i].Load()}
	}
	t.mu.RLock()
	for _, ns := range t.nss {
		model := t.modelOfLocked(ns)
		if model == "" {
			continue
		}
		if i := s.match(model); i >= 0 {
			out[i].Bytes += counts[ns.fp].Bytes
		}
	}
	books := t.books
	t.mu.RUnlock()
	for j := range nss {
		model := nss[j].Model
		if model == "" {
			model = books.model(nss[j].Fingerprint) // found at start: the books'
		}
		if i := s.match(model); model != "" && i >= 0 {
			nss[j].Budget = s.list[i].Model
		}
	}
	return out
}

// ownCapacity is the bytes of the capacity of the mounts of kvhost's own
// layout (a vllm-fs mount serves one namespace of its own): what the
// budgets' floors must fit in.
func ownCapacity(mounts []*mount, sp *space.Space) int64 {
	var sum int64
	for _, m := range mounts {
		if m.raw != nil {
			continue
		}
		_, c := sp.Usage(m.sp)
		sum += c
	}
	return sum
}

// modelOfLocked is the model id of ns: its client's (Declare), or, for
// the files found at Open of a namespace no client declared since, the
// one the model books named (modelbook.go). t.mu is held.
func (t *tables) modelOfLocked(ns *namespace) string {
	if ns.geo.Model != "" {
		return ns.geo.Model
	}
	return t.books.model(ns.fp)
}

// budgetsFound logs, once Open has indexed the files found and read the
// model books, what the budgets count of them before any client
// declares its namespace: the namespaces a book named, and, where a
// budget has a floor, those no book names (files stored before the
// books, or a book lost), which no floor protects until their clients
// declare them.
func (t *tables) budgetsFound(log *slog.Logger, counts map[uint64]index.FPCount) {
	s := t.budgets
	if s == nil {
		return
	}
	floors := slices.ContainsFunc(s.list, func(b Budget) bool { return b.Floor > 0 })
	var named, unknown int
	var namedBytes, unknownBytes int64
	t.mu.RLock()
	for fp, c := range counts {
		id, ok := t.byFP[fp]
		if !ok || t.nss[id].layout != nil {
			continue
		}
		if model := t.modelOfLocked(t.nss[id]); model != "" {
			if s.match(model) >= 0 {
				named++
				namedBytes += c.Bytes
			}
			continue
		}
		unknown++
		unknownBytes += c.Bytes
	}
	t.mu.RUnlock()
	log.Info("engine: budgets count the files found from the start: their namespaces' model ids read from the model books", "namespaces", named, "bytes", namedBytes)
	if unknown > 0 && floors {
		log.Warn("engine: budget floors: files found of namespaces no model book names count toward no budget until their clients declare them; a floor does not protect them meanwhile",
			"namespaces", unknown, "bytes", unknownBytes)
	}
}
