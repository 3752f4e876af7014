package policykit

// Entry is what a policy remembers about one stored entry (a file).
type Entry struct {
	ID    uint64 // AccessRecord.Entry
	Time  uint64 // last access, Unix nanoseconds
	Size  uint64 // bytes on disk
	Mount uint32 // the mount the entry is on
	Pins  uint32 // AccessPin minus AccessUnpin; pinned entries are never victims
	Hits  uint32 // accesses (policy-defined: LFU ages them)
	Class uint32 // the list the entry is on (a mount, a frequency level)

	prev, next int32
}

// none is the nil link; freed marks (in prev) a slot on the free list.
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
	free    int32 // head of the free list, linked through next; none if empty
	live    int
	index   Table
}

// Len returns the number of live entries.
func (p *Pool) Len() int { return p.live }

// At returns the entry in slot i. The pointer is valid until the next Add.
func (p *Pool) At(i int32) *Entry { return &p.entries[i] }

// Lookup returns the slot of entry id.
func (p *Pool) Lookup(id uint64) (int32, bool) { return p.index.Get(id) }

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
		p.free = p.entries[slot].next
	} else {
		slot = int32(len(p.entries))
		p.entries = append(p.entries, Entry{})
	}
	p.entries[slot] = Entry{ID: id, prev: none, next: none}
	p.index.Put(id, slot)
	p.live++
	return slot, true
}

// Delete frees slot i. The entry must not be on a list.
func (p *Pool) Delete(i int32) {
	p.index.Delete(p.entries[i].ID)
	p.entries[i] = Entry{prev: freed, next: p.free}
	p.free = i
	p.live--
}

// Range calls fn with the slot of every live entry, in slot order. fn must
// not add or delete entries.
func (p *Pool) Range(fn func(i int32)) {
	for i := range p.entries {
		if p.entries[i].prev != freed {
			fn(int32(i))
		}
	}
}

// List is a doubly linked list of pool entries, front = least recently
// touched. An entry is on at most one list at a time. The zero List is not
// usable: create lists with NewList.
type List struct {
	head, tail int32
	n          int
}

// NewList returns an empty list.
func NewList() List { return List{head: none, tail: none} }

// Len returns the number of entries on the list.
func (l *List) Len() int { return l.n }

// Front returns the first slot, or -1 if the list is empty.
func (l *List) Front() int32 { return l.head }

// Next returns the slot after i, or -1 at the end of the list.
func (p *Pool) Next(i int32) int32 { return p.entries[i].next }

// PushBack appends slot i.
func (l *List) PushBack(p *Pool, i int32) {
	e := &p.entries[i]
	e.prev, e.next = l.tail, none
	if l.tail != none {
		p.entries[l.tail].next = i
	} else {
		l.head = i
	}
	l.tail = i
	l.n++
}

// Remove unlinks slot i, which must be on l.
func (l *List) Remove(p *Pool, i int32) {
	e := &p.entries[i]
	if e.prev != none {
		p.entries[e.prev].next = e.next
	} else {
		l.head = e.next
	}
	if e.next != none {
		p.entries[e.next].prev = e.prev
	} else {
		l.tail = e.prev
	}
	e.prev, e.next = none, none
	l.n--
}

// MoveToBack moves slot i, which must be on l, to the back.
func (l *List) MoveToBack(p *Pool, i int32) {
	if l.tail == i {
		return
	}
	l.Remove(p, i)
	l.PushBack(p, i)
}

// SortByTime sorts the list by ascending Entry.Time, keeping the order of
// equal times (a stable bottom-up merge sort of the links: O(n log n), no
// allocation). Policies call it after AccessRestore records, which arrive in
// the host's index order rather than in time order.
func (l *List) SortByTime(p *Pool) {
	if l.n < 2 {
		return
	}
	e := p.entries
	head := l.head
	for width := 1; width < l.n; width *= 2 {
		var newHead, newTail int32 = none, none
		appendRun := func(i int32) {
			if newTail == none {
				newHead = i
			} else {
				e[newTail].next = i
			}
			newTail = i
		}
		a := head
		for a != none {
			// Split off run a (width entries) and run b (up to width entries).
			b := a
			for k := 0; k < width && b != none; k++ {
				b = e[b].next
			}
			rest := b
			for k := 0; k < width && rest != none; k++ {
				rest = e[rest].next
			}
			na, nb := width, width
			for (na > 0 && a != none) || (nb > 0 && b != none && b != rest) {
				takeA := nb == 0 || b == none || b == rest ||
					(na > 0 && a != none && e[a].Time <= e[b].Time)
				if takeA {
					next := e[a].next
					appendRun(a)
					a = next
					na--
				} else {
					next := e[b].next
					appendRun(b)
					b = next
					nb--
				}
			}
			a = rest
		}
		e[newTail].next = none
		head = newHead
	}
	// Rebuild the back links.
	prev := none
	for i := head; i != none; i = e[i].next {
		e[i].prev = prev
		prev = i
	}
	l.head, l.tail = head, prev
}
