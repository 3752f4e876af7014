package policykit

// Entry is what a policy remembers about one stored entry (a file).
type Entry struct {
	ID    uint64 // AccessRecord.Entry
	Time  uint64 // last access, Unix nanoseconds
	Size  uint64 // bytes on disk
	Mount uint16 // the mount the entry is on, at most MaxMount
	Class uint16 // the list the entry is on (a mount, a frequency level)
	Pins  uint32 // AccessPin minus AccessUnpin; pinned entries are never victims
	Hits  uint32 // accesses (policy-defined: LFU ages them)

	left, right, up int32 // links of the entry's List (a tree)
}

// none is the nil link; freed marks (in up) a slot on the free list, which
// is linked through right.
const (
	none  int32 = -1
	freed int32 = -2
)

// Pool stores entries in one flat slice, addressed by int32 slots, with a
// free list so that a removed entry's slot is reused by the next insert, and
// a Table from entry id to slot. Once it has grown to the working set it
// allocates nothing.
//
// The zero Pool is empty and ready to use.
type Pool struct {
	entries []Entry
	free    int32 // head of the free list, linked through right; none if empty
	live    int
	index   Table
}

// Len returns the number of live entries.
func (p *Pool) Len() int { return p.live }

// At returns the entry in slot i. The pointer is valid until the next Add.
func (p *Pool) At(i int32) *Entry { return &p.entries[i] }

// Lookup returns the slot of entry id.
func (p *Pool) Lookup(id uint64) (int32, bool) {
	i := p.index.find(id)
	return i, i >= 0
}

// Add returns the slot of entry id, creating a zeroed entry (with ID set) if
// it is not in the pool; created reports which.
func (p *Pool) Add(id uint64) (slot int32, created bool) {
	if i, ok := p.index.Get(id); ok {
		return i, false
	}
	if p.live == 0 && len(p.entries) == 0 {
		p.free = none
	}
	if p.free != none {
		slot = p.free
		p.free = p.entries[slot].right
	} else {
		slot = int32(len(p.entries))
		p.entries = append(p.entries, Entry{})
	}
	p.entries[slot] = Entry{ID: id, left: none, right: none, up: none}
	p.index.Put(id, slot)
	p.live++
	return slot, true
}

// Delete frees slot i. The entry must not be on a list.
func (p *Pool) Delete(i int32) {
	p.index.Delete(p.entries[i].ID)
	p.entries[i] = Entry{up: freed, right: p.free}
	p.free = i
	p.live--
}

// Range calls fn with the slot of every live entry, in slot order. fn must
// not add or delete entries.
func (p *Pool) Range(fn func(i int32)) {
	for i := range p.entries {
		if p.entries[i].up != freed {
			fn(int32(i))
		}
	}
}

// List is a list of pool entries in ascending Time, entries of equal Time
// in the order they were inserted: front = least recent. An entry is on at
// most one list at a time, and its Time must not change while it is on
// one (Remove it, change it, Insert it; or change it and Touch it at once).
// The zero List is not usable: create lists with NewList.
//
// The list is a treap in the entries' links, each slot's priority a fixed
// hash of the slot, so that the engine's records, whose times are not
// monotonic, are placed by time at O(log n) expected cost and the list
// never needs a sort. An Insert at the back (a time not before the
// back's, the common case) and a Remove take O(1) expected rotations.
type List struct {
	root, tail int32 // tail: the back, none if the list is empty
	n          int
}

// NewList returns an empty list.
func NewList() List { return List{root: none, tail: none} }

// Len returns the number of entries on the list.
func (l *List) Len() int { return l.n }

// Front returns the first slot, or -1 if the list is empty: O(log n)
// expected.
func (l *List) Front(p *Pool) int32 {
	i := l.root
	for i != none && p.entries[i].left != none {
		i = p.entries[i].left
	}
	return i
}

// Next returns the slot after i on its list, or -1 at the end of the list:
// O(1) amortized over a walk of the list, O(log n) expected at worst.
func (p *Pool) Next(i int32) int32 {
	e := p.entries
	if r := e[i].right; r != none {
		for i = r; e[i].left != none; i = e[i].left {
		}
		return i
	}
	for e[i].up != none && e[e[i].up].right == i {
		i = e[i].up
	}
	return e[i].up
}

// prev returns the slot before i on its list, or -1 at the front: O(1)
// expected for the back.
func (p *Pool) prev(i int32) int32 {
	e := p.entries
	if l := e[i].left; l != none {
		for i = l; e[i].right != none; i = e[i].right {
		}
		return i
	}
	for e[i].up != none && e[e[i].up].left == i {
		i = e[i].up
	}
	return e[i].up
}

// priority is slot i's treap priority: a bijective mix of the slot (the
// finalizer of MurmurHash3), so no two slots tie.
func priority(i int32) uint32 {
	h := uint32(i)
	h ^= h >> 16
	h *= 0x85ebca6b
	h ^= h >> 13
	h *= 0xc2b2ae35
	return h ^ h>>16
}

// Insert puts slot i, on no list, after every entry whose Time is not
// later than its own.
func (l *List) Insert(p *Pool, i int32) {
	e := p.entries
	t := e[i].Time
	e[i].left, e[i].right, e[i].up = none, none, none
	l.n++
	if l.root == none {
		l.root, l.tail = i, i
		return
	}
	at, right := l.tail, true // the back has no right child
	if e[at].Time > t {
		for at = l.root; ; {
			if right = e[at].Time <= t; right && e[at].right != none {
				at = e[at].right
			} else if !right && e[at].left != none {
				at = e[at].left
			} else {
				break
			}
		}
	}
	e[i].up = at
	if right {
		e[at].right = i
	} else {
		e[at].left = i
	}
	if t >= e[l.tail].Time {
		l.tail = i
	}
	for pi := priority(i); e[i].up != none && priority(e[i].up) < pi; {
		l.rotateUp(p, i)
	}
}

// Touch puts slot i, on l, in its place after its Time changed from old
// (as Remove, then Insert): where it is still after every entry whose Time
// is not later than its own and before the others, it stays. An entry at
// the back touched at a time not before its own costs O(1).
func (l *List) Touch(p *Pool, i int32, old uint64) {
	e := p.entries
	if t := e[i].Time; t >= old {
		if i == l.tail {
			return
		}
		// Entries up to i are not later than old, hence t; the back is
		// after i, so where it is not later than t, i moves.
		if e[l.tail].Time > t {
			if n := p.Next(i); e[n].Time > t {
				return
			}
		} else {
			l.TouchBack(p, i, old)
			return
		}
	}
	l.Remove(p, i)
	l.Insert(p, i)
}

// TouchBack is Touch for an entry whose Time did not go down from old (a
// hit, the commonest record): one that is now not before the back's
// moves to the back in this function (Remove then Insert, with
// rotateUp's work inline where it rotates up), since in a Go guest each
// call costs tens of wasm instructions; another goes through Touch.
func (l *List) TouchBack(p *Pool, i int32, old uint64) {
	e := p.entries
	x := &e[i]
	if i == l.tail {
		return
	}
	if e[l.tail].Time > x.Time {
		l.Touch(p, i, old)
		return
	}
	// Unlink i: rotate it down below the child of higher priority until
	// it has at most one child, then put that child in its place.
	for x.left != none && x.right != none {
		c := x.left
		if priority(x.right) > priority(c) {
			c = x.right
		}
		l.rotateUp(p, c)
	}
	c := x.left
	if c == none {
		c = x.right
	}
	l.replace(p, i, c)
	// Hang it below the back, the rightmost slot, as its right child,
	// and rotate it up while its priority is higher than its parent's
	// (rotateUp's work for a right child, inline).
	at := l.tail
	x.left, x.right, x.up = none, none, at
	e[at].right = i
	l.tail = i
	pi := priority(i)
	for y := at; y != none && priority(y) < pi; y = x.up {
		// Rotate i above y. y is an ancestor of the back, so the right
		// child of its parent g (or the root), where i goes.
		b := x.left
		if e[y].right = b; b != none {
			e[b].up = y
		}
		g := e[y].up
		x.left, x.up = y, g
		e[y].up = i
		if g == none {
			l.root = i
		} else {
			e[g].right = i
		}
	}
}

// MoveBack moves slot i from l to dst, another list, after every entry of
// dst whose Time is not later than its own, as Remove then dst.Insert
// do: where that is dst's back, the commonest (a hit that moves an entry
// to another class), it unlinks i and rotates it up in this function, as
// TouchBack does. (One function for both, with dst an argument, cost
// every hit of lru 3% more fuel.)
func (l *List) MoveBack(p *Pool, i int32, dst *List) {
	e := p.entries
	x := &e[i]
	if at := dst.tail; at == none || e[at].Time > x.Time {
		l.Remove(p, i)
		dst.Insert(p, i)
		return
	}
	// Remove's work, inline: i goes to dst's back as in TouchBack.
	if i == l.tail {
		l.tail = p.prev(i)
	}
	for x.left != none && x.right != none {
		c := x.left
		if priority(x.right) > priority(c) {
			c = x.right
		}
		l.rotateUp(p, c)
	}
	c := x.left
	if c == none {
		c = x.right
	}
	l.replace(p, i, c)
	l.n--
	dst.n++
	at := dst.tail
	x.left, x.right, x.up = none, none, at
	e[at].right = i
	dst.tail = i
	for pi, y := priority(i), at; y != none && priority(y) < pi; y = x.up {
		// Rotate i above y. y is an ancestor of the back, so the right
		// child of its parent g (or the root), where i goes.
		b := x.left
		if e[y].right = b; b != none {
			e[b].up = y
		}
		g := e[y].up
		x.left, x.up = y, g
		e[y].up = i
		if g == none {
			dst.root = i
		} else {
			e[g].right = i
		}
	}
}

// Remove unlinks slot i, which must be on l.
func (l *List) Remove(p *Pool, i int32) {
	e := p.entries
	if l.tail == i {
		l.tail = p.prev(i)
	}
	for e[i].left != none && e[i].right != none {
		c := e[i].left
		if priority(e[i].right) > priority(c) {
			c = e[i].right
		}
		l.rotateUp(p, c)
	}
	c := e[i].left
	if c == none {
		c = e[i].right
	}
	l.replace(p, i, c)
	e[i].left, e[i].right, e[i].up = none, none, none
	l.n--
}

// rotateUp rotates slot x above its parent, keeping the order.
func (l *List) rotateUp(p *Pool, x int32) {
	e := p.entries
	y := e[x].up
	if e[y].left == x {
		b := e[x].right
		if e[y].left = b; b != none {
			e[b].up = y
		}
		e[x].right = y
	} else {
		b := e[x].left
		if e[y].right = b; b != none {
			e[b].up = y
		}
		e[x].left = y
	}
	l.replace(p, y, x)
	e[y].up = x
}

// replace puts slot c (or none) where slot i hangs from i's parent.
func (l *List) replace(p *Pool, i, c int32) {
	e := p.entries
	g := e[i].up
	if c != none {
		e[c].up = g
	}
	switch {
	case g == none:
		l.root = c
	case e[g].left == i:
		e[g].left = c
	default:
		e[g].right = c
	}
}
