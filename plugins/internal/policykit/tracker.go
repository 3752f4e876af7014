package policykit

import (
	"math"
	"strconv"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
)

// MaxClasses bounds the number of lists a Tracker keeps (mounts, frequency
// levels), so that a bad record cannot make it allocate without limit.
const MaxClasses = 1024

// MaxMount is the highest mount a Tracker keeps in an Entry: an insert or
// restore of an entry on a higher mount is refused. A host describes at
// most abi.MaxMounts mounts.
const MaxMount = math.MaxUint16

// Entry.Class holds every class below MaxClasses.
const _ uint16 = MaxClasses - 1

// Tracker applies access records to a Pool of entries kept on recency lists,
// one list per class. A policy chooses the class of an entry (its mount, its
// frequency level) with the function given to NewTracker; within a list,
// entries are in ascending Time (last access), in the order they were last
// touched where times are equal, whatever order the records come in (see
// List).
//
// The rules every built-in policy shares live here:
//   - AccessInsert and AccessHit touch the entry (it moves behind the
//     entries of its list with a time not later than its own, Hits grows,
//     Time becomes the record's where that is later: times are not
//     monotonic, and a late hit must not lower a rank); an insert also sets
//     Size and Mount and Time. A hit on an unknown entry is
//     ignored: hosts deliver lookups' hits late, after the REMOVE of an
//     entry evicted, moved or deleted meanwhile, and learning it would
//     bring back a phantom entry offered as a victim.
//   - AccessRestore sets the entry's Time and Hits from the record.
//   - An AccessInsert or AccessRestore on a mount above MaxMount is refused
//     (abi.StatusInvalidInput) and changes nothing.
//   - AccessPin and AccessUnpin nest; an unpin without a pin, and a pin of
//     an unknown entry, are ignored (the host never offers a pinned entry's
//     removal, and a pinned entry is never a victim).
//   - AccessRemove forgets the entry; removing an unknown entry is a no-op.
type Tracker struct {
	Pool  Pool   // every entry tracked
	Lists []List // one list per class, indexed by Entry.Class

	classOf func(e *Entry) uint32
	byMount bool // classOf is the entry's mount, which a hit never changes
}

// NewTracker returns a Tracker with classes lists (more are added when
// classOf returns a higher class, up to MaxClasses). classOf may be nil, in
// which case every entry is on list 0.
func NewTracker(classes int, classOf func(e *Entry) uint32) *Tracker {
	// Room for every class up front (24 KiB): a list added later never
	// grows the slice, and an allocation in a hook of a Go guest can make
	// it assist the garbage collector through the whole heap (1,500 units
	// of fuel a record, amortized, in lfu's hits).
	t := &Tracker{classOf: classOf, Lists: make([]List, 0, MaxClasses)}
	t.ensure(uint32(max(classes, 1) - 1))
	return t
}

// NewTrackerByMount returns a Tracker whose class is the entry's mount,
// with classes lists to begin with: as NewTracker with that class
// function, and a hit, which keeps the mount, never calls it.
func NewTrackerByMount(classes int) *Tracker {
	t := NewTracker(classes, func(e *Entry) uint32 { return uint32(e.Mount) })
	t.byMount = true
	return t
}

// ApplyAll applies every record of a kvhost_access batch, in order.
func (t *Tracker) ApplyAll(recs []abi.AccessRecord) error {
	for i := range recs {
		r := &recs[i]
		if r.Kind == abi.AccessHit {
			// The commonest record, without Apply's call (nor Hit's,
			// where the hit cannot change the class).
			j, ok := t.Pool.index.Get(r.Entry)
			switch {
			case !ok:
			case t.classOf == nil || t.byMount:
				e := &t.Pool.entries[j]
				old := e.Time
				e.Time = max(old, r.Time)
				e.Hits += b2u(e.Hits != ^uint32(0))
				t.Lists[e.Class].TouchBack(&t.Pool, j, old)
			default:
				if err := t.Hit(j, r.Time); err != nil {
					return err
				}
			}
			continue
		}
		if err := t.Apply(r); err != nil {
			return err
		}
	}
	return nil
}

// Apply applies one access record.
func (t *Tracker) Apply(r *abi.AccessRecord) error {
	switch r.Kind {
	case abi.AccessHit:
		if i, ok := t.Pool.index.Get(r.Entry); ok {
			return t.Hit(i, r.Time)
		}
		return nil
	case abi.AccessInsert:
		if err := checkMount(r); err != nil {
			return err
		}
		i, created := t.learn(r)
		e := t.Pool.At(i)
		old := e.Time
		e.Time, e.Size, e.Mount = r.Time, r.Size, uint16(r.Mount)
		if e.Hits != ^uint32(0) {
			e.Hits++
		}
		return t.place(i, !created, old)
	case abi.AccessRestore:
		if err := checkMount(r); err != nil {
			return err
		}
		i, created := t.learn(r)
		e := t.Pool.At(i)
		old := e.Time
		e.Time, e.Size, e.Mount, e.Hits = r.Time, r.Size, uint16(r.Mount), r.Hits
		return t.place(i, !created, old)
	case abi.AccessPin:
		if i, ok := t.Pool.Lookup(r.Entry); ok {
			if e := t.Pool.At(i); e.Pins != ^uint32(0) {
				e.Pins++
			}
		}
		return nil
	case abi.AccessUnpin:
		if i, ok := t.Pool.Lookup(r.Entry); ok {
			if e := t.Pool.At(i); e.Pins > 0 {
				e.Pins--
			}
		}
		return nil
	case abi.AccessRemove:
		if i, ok := t.Pool.Lookup(r.Entry); ok {
			t.Lists[t.Pool.At(i).Class].Remove(&t.Pool, i)
			t.Pool.Delete(i)
		}
		return nil
	}
	return guest.InvalidInput("access kind " + strconv.FormatUint(uint64(r.Kind), 10) + " is not defined by ABI v1")
}

// Hit applies a HIT at time now to the entry in slot i: Time becomes now
// where that is later (a hit keeps the size and mount the insert gave),
// Hits grows, and the entry moves on its list. It is Apply's path for
// the commonest record, kept to few calls: in a Go guest each costs tens
// of wasm instructions.
func (t *Tracker) Hit(i int32, now uint64) error {
	if t.classOf == nil || t.byMount {
		t.Touch(i, now)
		return nil
	}
	e := &t.Pool.entries[i]
	old := e.Time
	e.Time = max(old, now)
	if e.Hits != ^uint32(0) {
		e.Hits++
	}
	if c := t.classOf(e); c != uint32(e.Class) {
		return t.placeIn(i, c, true, old)
	}
	t.Lists[e.Class].Touch(&t.Pool, i, old)
	return nil
}

// Touch is Hit for a hit that leaves the entry in its class, which the
// caller knows (a Tracker without classes; lfu, for a count that stays
// on its level): no call of the class function, and the move to the back
// of the list, the commonest, without further calls.
func (t *Tracker) Touch(i int32, now uint64) {
	e := &t.Pool.entries[i]
	old := e.Time
	e.Time = max(old, now)
	e.Hits += b2u(e.Hits != ^uint32(0))
	t.Lists[e.Class].TouchBack(&t.Pool, i, old)
}

// Reclass is Hit for a policy that sets the entry's fields itself: the
// caller has set slot i's Time (from old) and Hits for a hit, and c is
// the class they give it. The entry moves as Hit moves it: within its
// list (Touch) if c is its class, else to c's list, its back the
// commonest place (List.MoveBack), in one call.
func (t *Tracker) Reclass(i int32, c uint32, old uint64) error {
	e := &t.Pool.entries[i]
	switch {
	case c == uint32(e.Class):
		t.Lists[c].Touch(&t.Pool, i, old)
		return nil
	case c < uint32(len(t.Lists)):
		from := e.Class
		e.Class = uint16(c)
		t.Lists[from].MoveBack(&t.Pool, i, &t.Lists[c])
		return nil
	}
	return t.placeIn(i, c, true, old)
}

// b2u is 1 for true, 0 for false: a hit count that saturates without a
// branch (Go's wasm code takes a jump through its function's dispatch
// for each).
func b2u(b bool) uint32 {
	var u uint32
	if b {
		u = 1
	}
	return u
}

// checkMount refuses an insert or restore on a mount an Entry cannot hold.
func checkMount(r *abi.AccessRecord) error {
	if r.Mount > MaxMount {
		return guest.InvalidInput("access record of entry " + strconv.FormatUint(r.Entry, 10) + ": mount " + strconv.FormatUint(uint64(r.Mount), 10) + " is beyond the limit of " + strconv.Itoa(MaxMount))
	}
	return nil
}

// learn returns the slot of the record's entry, adding it with the
// record's fields, on no list, if it is new (created).
func (t *Tracker) learn(r *abi.AccessRecord) (i int32, created bool) {
	i, created = t.Pool.Add(r.Entry)
	if created {
		e := t.Pool.At(i)
		e.Time, e.Size, e.Mount = r.Time, r.Size, uint16(r.Mount)
	}
	return i, created
}

// place puts slot i, whose fields have just changed, on the list of its
// (possibly new) class, in time order: off its list first if listed (with
// the Time old). A new entry of a class beyond MaxClasses is forgotten; a
// known one stays in its class.
func (t *Tracker) place(i int32, listed bool, old uint64) error {
	return t.placeIn(i, t.class(t.Pool.At(i)), listed, old)
}

// placeIn is place with the entry's class c already asked.
func (t *Tracker) placeIn(i int32, c uint32, listed bool, old uint64) error {
	e := t.Pool.At(i)
	if listed && c == uint32(e.Class) {
		t.Lists[c].Touch(&t.Pool, i, old)
		return nil
	}
	err := t.ensure(c)
	if err != nil && !listed {
		t.Pool.Delete(i)
		return err
	}
	if listed {
		t.Lists[e.Class].Remove(&t.Pool, i)
	}
	if err == nil {
		e.Class = uint16(c)
	}
	t.Lists[e.Class].Insert(&t.Pool, i)
	return err
}

func (t *Tracker) class(e *Entry) uint32 {
	if t.classOf == nil {
		return 0
	}
	return t.classOf(e)
}

func (t *Tracker) ensure(c uint32) error {
	if c >= MaxClasses {
		return guest.InvalidInput("class " + strconv.FormatUint(uint64(c), 10) + " (mount or level) is beyond the limit of " + strconv.Itoa(MaxClasses))
	}
	for uint32(len(t.Lists)) <= c {
		t.Lists = append(t.Lists, NewList())
	}
	return nil
}

// Eligible reports whether e may be a victim of req: unpinned, and on the
// requested mount unless req.Mount is abi.AnyMount.
func Eligible(e *Entry, req *abi.EvictRequest) bool {
	return e.Pins == 0 && (req.Mount == abi.AnyMount || req.Mount == uint32(e.Mount))
}

// Rank answers a kvhost_rank batch (abi.FeatureRank): each known entry
// gets score(e, r.Time) and abi.RankKnown, each entry the tracker does not
// know abi.RankUnknown (the host then ranks it by its own last access).
// score must depend only on the entry's access history and the time, so
// that ranks are comparable across nodes (docs/abi.md, "RankRecord").
func (t *Tracker) Rank(recs []abi.RankRecord, score func(e *Entry, now uint64) uint64) {
	for i := range recs {
		r := &recs[i]
		j, ok := t.Pool.Lookup(r.Entry)
		if !ok {
			r.Rank, r.State = 0, abi.RankUnknown
			continue
		}
		r.Rank, r.State = score(t.Pool.At(j), r.Time), abi.RankKnown
	}
}

// LastAccess is the rank of an LRU policy: the entry's last access time.
func LastAccess(e *Entry, _ uint64) uint64 { return e.Time }
