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
}

// NewTracker returns a Tracker with classes lists (more are added when
// classOf returns a higher class, up to MaxClasses). classOf may be nil, in
// which case every entry is on list 0.
func NewTracker(classes int, classOf func(e *Entry) uint32) *Tracker {
	t := &Tracker{classOf: classOf}
	t.ensure(uint32(max(classes, 1) - 1))
	return t
}

// ApplyAll applies every record of a kvhost_access batch, in order.
func (t *Tracker) ApplyAll(recs []abi.AccessRecord) error {
	for i := range recs {
		if err := t.Apply(&recs[i]); err != nil {
			return err
		}
	}
	return nil
}

// Apply applies one access record.
func (t *Tracker) Apply(r *abi.AccessRecord) error {
	switch r.Kind {
	case abi.AccessInsert, abi.AccessHit:
		var i int32
		created := false
		if r.Kind == abi.AccessHit {
			var ok bool
			if i, ok = t.Pool.Lookup(r.Entry); !ok {
				return nil
			}
		} else if err := checkMount(r); err != nil {
			return err
		} else {
			i, created = t.learn(r)
		}
		e := t.Pool.At(i)
		old := e.Time
		if r.Kind == abi.AccessInsert {
			// A hit keeps what the insert said: hosts need not repeat the
			// size and mount in hit records.
			e.Time, e.Size, e.Mount = r.Time, r.Size, uint16(r.Mount)
		} else {
			e.Time = max(e.Time, r.Time)
		}
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
	e := t.Pool.At(i)
	c := t.class(e)
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
