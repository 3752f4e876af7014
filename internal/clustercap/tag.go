package clustercap

import "hash/fnv"

// TagBits is the width of a node tag: the high bits of every file id a node
// writes. The low 64-TagBits bits are random.
const TagBits = 24

const randomMask = 1<<(64-TagBits) - 1

// Tag is the owner tag of the node named node: the low TagBits bits of the
// name's FNV-1a hash. Two node names may share a tag (about one pair in
// 16 million); a node finds such a pair among the running nodes'
// summaries (Summary.Tag), at its start and at every read.
func Tag(node string) uint32 {
	h := fnv.New64a()
	h.Write([]byte(node))
	return uint32(h.Sum64() & (1<<TagBits - 1))
}

// FileID returns a file id owned by tag, its low bits from random (never
// all zero, so that the id is never 0).
func FileID(tag uint32, random uint64) uint64 {
	low := random & randomMask
	if low == 0 {
		low = 1
	}
	return uint64(tag)<<(64-TagBits) | low
}

// Owner returns the tag in file id id, and false for id 0 (a file written
// before file ids existed, whose owner is unknown).
func Owner(id uint64) (uint32, bool) {
	if id == 0 {
		return 0, false
	}
	return uint32(id >> (64 - TagBits)), true
}
