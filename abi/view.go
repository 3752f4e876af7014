package abi

import "unsafe"

// Record is the set of fixed-width record types of ABI v1.
type Record interface {
	NamespaceRecord | NameRecord | AdmitRecord | AccessRecord | EvictRequest | Victim |
		MountRecord | VictimTarget | TickRequest | Move | RankRecord
}

// View returns the first n records of b as a []T that aliases b. It panics if
// b is shorter than n records or not aligned to ScratchAlign. The byte order of
// the records is the machine's: View is for little-endian machines (wasm,
// amd64, arm64), which are the only ones kvhost supports.
func View[T Record](b []byte, n int) []T {
	var zero T
	size := int(unsafe.Sizeof(zero))
	if n < 0 || n*size > len(b) {
		panic("abi: View of " + itoa(int64(n)) + " records of " + itoa(int64(size)) + " bytes in " + itoa(int64(len(b))) + " bytes")
	}
	if n == 0 {
		return nil
	}
	p := unsafe.Pointer(unsafe.SliceData(b))
	if uintptr(p)%ScratchAlign != 0 {
		panic("abi: View of unaligned memory")
	}
	return unsafe.Slice((*T)(p), n)
}

// SizeOf returns the size in bytes of one record of type T.
func SizeOf[T Record]() int {
	var zero T
	return int(unsafe.Sizeof(zero))
}

// AlignedBuffer returns a zeroed byte slice of at least n bytes whose first
// byte is aligned to ScratchAlign, suitable as a scratch area.
func AlignedBuffer(n int) []byte {
	words := make([]uint64, (n+7)/8)
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(words))), len(words)*8)[: n : len(words)*8]
}
