package space

// Counts is the space as the index tells it of its files (the index's
// Space interface): by the mount's position. The index calls it with its
// own lock held; nothing here calls back.
type Counts struct{ s *Space }

// Counts returns the space as the index tells it of its files.
func (s *Space) Counts() Counts { return Counts{s} }

// mount returns the mount at position i (the mounts are fixed once
// Open has added them).
func (c Counts) mount(i int) *Mount { return c.s.mounts[i] }

// Free uncounts size bytes of a file removed from mount (orphan: counted
// in orphaned too).
func (c Counts) Free(mount int, size int64, orphan bool) {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	ms := c.mount(mount)
	ms.used -= size
	if orphan {
		ms.orphaned -= size
	}
}

// Left counts size bytes of a spare or a file dropped from the index,
// whose removal failed, as used on mount.
func (c Counts) Left(mount int, size int64) { c.s.Left(c.mount(mount), size) }

// Unorphan uncounts size bytes of an orphan of mount from orphaned: its
// removal failed, and its bytes stay in used.
func (c Counts) Unorphan(mount int, size int64) {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	c.mount(mount).orphaned -= size
}

// Indexed counts a file of size bytes indexed on mount; reserved: its
// bytes are those of a reservation, already in used.
func (c Counts) Indexed(mount int, size int64, reserved bool) {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	ms := c.mount(mount)
	if !reserved {
		ms.used += size
	}
	ms.entries++
}

// Unindexed uncounts a file of size bytes dropped from mount's index.
// removing: its file is still there, on its way out, and counts as used
// until removed (Free); orphan: another job holds its path and removes
// it, so it also counts in orphaned.
func (c Counts) Unindexed(mount int, size int64, removing, orphan bool) {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	ms := c.mount(mount)
	ms.entries--
	if !removing {
		ms.used -= size
	}
	if orphan {
		ms.orphaned += size
	}
}

// Moved counts a file moved from mount from to mount to: its entry left
// from's index (its bytes count as used there until the source is
// removed: Free) and its copy, indexed on to, holds the reservation made
// there.
func (c Counts) Moved(from, to int) {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	src, dst := c.mount(from), c.mount(to)
	src.movedOut++
	src.entries--
	dst.movedIn++
}
