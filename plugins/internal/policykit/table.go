package policykit

// Table maps entry ids to int32 slots: an open-addressing hash table with
// linear probing and backward-shift deletion (no tombstones), so lookups stay
// short under insert/remove churn. It is used instead of a Go map because it
// allocates only when it grows, keeps keys and values in two flat arrays, and
// is markedly faster than a map when compiled to wasm.
//
// The zero Table is empty and ready to use.
type Table struct {
	keys  []uint64
	vals  []int32 // slot+1; 0 marks an empty bucket
	n     int
	shift uint // 64 - log2(len(keys))
}

const minTableSize = 16

// Len returns the number of ids in the table.
func (t *Table) Len() int { return t.n }

// bucket returns the home bucket of id (Fibonacci hashing: entry ids are
// often sequential, and the multiply spreads them over the high bits).
func (t *Table) bucket(id uint64) int {
	return int((id * 0x9E3779B97F4A7C15) >> t.shift)
}

// Get returns the slot stored for id.
func (t *Table) Get(id uint64) (int32, bool) {
	i := t.find(id)
	return i, i >= 0
}

// find returns the slot stored for id, -1 if none. It is small enough to
// inline into its callers (Get, Pool.Lookup), as a call costs a Go guest
// tens of wasm instructions: the probe stops at id's bucket or an empty
// one, whose key is 0 and whose value, 0, says the id is absent (id 0
// included).
func (t *Table) find(id uint64) int32 {
	keys, vals := t.keys, t.vals
	if len(keys) == 0 {
		return -1
	}
	i := t.bucket(id)
	for keys[i] != id && vals[i] != 0 {
		i = (i + 1) & (len(keys) - 1)
	}
	return vals[i] - 1
}

// Put stores slot for id, replacing any previous slot. slot must be >= 0.
func (t *Table) Put(id uint64, slot int32) {
	if (t.n+1)*4 > len(t.keys)*3 {
		t.grow()
	}
	mask := len(t.keys) - 1
	for i := t.bucket(id); ; i = (i + 1) & mask {
		switch {
		case t.vals[i] == 0:
			t.keys[i], t.vals[i] = id, slot+1
			t.n++
			return
		case t.keys[i] == id:
			t.vals[i] = slot + 1
			return
		}
	}
}

// Delete removes id and reports whether it was present.
func (t *Table) Delete(id uint64) bool {
	if t.n == 0 {
		return false
	}
	mask := len(t.keys) - 1
	i := t.bucket(id)
	for ; ; i = (i + 1) & mask {
		if t.vals[i] == 0 {
			return false
		}
		if t.keys[i] == id {
			break
		}
	}
	// Backward-shift: move later members of the probe run into the hole when
	// their home bucket is not between the hole and their position.
	for j := (i + 1) & mask; t.vals[j] != 0; j = (j + 1) & mask {
		home := t.bucket(t.keys[j])
		if (j-home)&mask >= (j-i)&mask {
			t.keys[i], t.vals[i] = t.keys[j], t.vals[j]
			i = j
		}
	}
	t.keys[i], t.vals[i] = 0, 0
	t.n--
	return true
}

// Reset empties the table, keeping its storage.
func (t *Table) Reset() {
	clear(t.keys)
	clear(t.vals)
	t.n = 0
}

func (t *Table) grow() {
	size := max(minTableSize, len(t.keys)*2)
	keys, vals := t.keys, t.vals
	t.keys = make([]uint64, size)
	t.vals = make([]int32, size)
	t.shift = uint(64 - log2(size))
	t.n = 0
	for i, v := range vals {
		if v != 0 {
			t.Put(keys[i], v-1)
		}
	}
}

func log2(n int) int {
	k := 0
	for 1<<k < n {
		k++
	}
	return k
}
