package objstore

import (
	"container/heap"
	"iter"
	"maps"
)

// known is the objects a Store knows the bucket holds: each one's bytes
// and last use by name, and an order by last use (then name) for
// evictions, a min-heap whose root is the least recently used object.
// An eviction takes its victims from the root, a use moves its object,
// each in O(log n): no eviction sorts every object, and none holds the
// store's lock for longer than its victims take (BenchmarkEviction).
type known struct {
	byName map[string]*entry
	order  byUse
	used   int64 // the bytes of every object
}

// entry is one object of known, at index pos of its order.
type entry struct {
	name string
	object
	pos int
}

// newKnown returns the objects of objs, ordered in O(n).
func newKnown(objs map[string]object) *known {
	k := &known{byName: make(map[string]*entry, len(objs)), order: make(byUse, 0, len(objs))}
	for name, o := range objs {
		e := &entry{name: name, object: o, pos: len(k.order)}
		k.byName[name] = e
		k.order = append(k.order, e)
		k.used += o.size
	}
	heap.Init(&k.order)
	return k
}

// len returns the number of objects.
func (k *known) len() int { return len(k.byName) }

// get returns what is known of the object name.
func (k *known) get(name string) (object, bool) {
	e, ok := k.byName[name]
	if !ok {
		return object{}, false
	}
	return e.object, true
}

// set records the object name as o, in its place by o's last use.
func (k *known) set(name string, o object) {
	if e, ok := k.byName[name]; ok {
		k.used += o.size - e.size
		e.object = o
		heap.Fix(&k.order, e.pos)
		return
	}
	e := &entry{name: name, object: o}
	k.byName[name] = e
	k.used += o.size
	heap.Push(&k.order, e)
}

// remove forgets the object name, where known.
func (k *known) remove(name string) {
	e, ok := k.byName[name]
	if !ok {
		return
	}
	delete(k.byName, name)
	k.used -= e.size
	heap.Remove(&k.order, e.pos)
}

// oldest returns the least recently used object's name and what is
// known of it; false where there is none.
func (k *known) oldest() (string, object, bool) {
	if len(k.order) == 0 {
		return "", object{}, false
	}
	return k.order[0].name, k.order[0].object, true
}

// names returns the names of the objects, in no order.
func (k *known) names() iter.Seq[string] { return maps.Keys(k.byName) }

// byUse orders entries by last use, then name: container/heap's
// interface, each entry kept told of its index.
type byUse []*entry

func (h byUse) Len() int { return len(h) }

func (h byUse) Less(i, j int) bool {
	if h[i].at != h[j].at {
		return h[i].at < h[j].at
	}
	return h[i].name < h[j].name
}

func (h byUse) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].pos, h[j].pos = i, j
}

func (h *byUse) Push(x any) {
	e := x.(*entry)
	e.pos = len(*h)
	*h = append(*h, e)
}

func (h *byUse) Pop() any {
	old := *h
	e := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return e
}
