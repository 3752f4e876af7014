// Package crc32c is kvhost's one CRC-32C (Castagnoli): the checksums of
// the file format's headers and payloads, of the movers' fused copy and of
// the engine's recheck all come from here.
//
// Where the CPU has AVX-512 carry-less multiplies (VPCLMULQDQ), long inputs
// are folded 256 bytes at a time, sixteen 16-byte lanes in four registers,
// down to 64 bytes whose CRC the standard library then computes: folding
// keeps the input's remainder modulo the polynomial, which is all a CRC
// depends on. Elsewhere, and for short inputs, it is hash/crc32 (its
// three-way CRC32-instruction loop; a 128-bit PCLMULQDQ fold measured
// 0.4-0.5x of it on AMD Zen 5, so there is none). The results are
// hash/crc32's, bit for bit (TestMatchesHashCRC32).
package crc32c

import "hash/crc32"

// clmulMin is the shortest input folded; shorter ones go to hash/crc32,
// whose per-call cost is lower.
const clmulMin = 1024

// polyCastagnoli is the CRC-32C polynomial, x^32 implied, normal bit order.
const polyCastagnoli = 0x1EDC6F41

// foldKeys are the folding constants: for a fold over d bits, the
// remainders of x^(d+32) and x^(d-32) modulo the polynomial, bit-reflected
// and shifted left by one (the product of two reflected operands of
// PCLMULQDQ lands one bit low). [0], [1]: d = 2048 (a lane onto the same
// lane 256 bytes on); [2], [3]: d = 512 (a register onto the next).
var foldKeys = [4]uint64{foldKey(2048 + 32), foldKey(2048 - 32), foldKey(512 + 32), foldKey(512 - 32)}

// foldKey is x^n mod P, bit-reflected in 32 bits, shifted left by one.
func foldKey(n int) uint64 {
	r := uint64(1)
	for range n {
		r <<= 1
		if r&(1<<32) != 0 {
			r ^= 1<<32 | polyCastagnoli
		}
	}
	var rev uint64
	for i := range 32 {
		if r&(1<<i) != 0 {
			rev |= 1 << (31 - i)
		}
	}
	return rev << 1
}

// table is hash/crc32's CRC-32C table (computed once by the standard
// library, shared with every other caller of MakeTable(Castagnoli)).
var table = crc32.MakeTable(crc32.Castagnoli)

// Checksum returns the CRC-32C of p.
func Checksum(p []byte) uint32 { return Update(0, p) }

// Update returns the CRC-32C of p appended to data whose CRC-32C is crc:
// what crc32.Update(crc, crc32.MakeTable(crc32.Castagnoli), p) returns,
// faster on CPUs with AVX-512 carry-less multiplies.
func Update(crc uint32, p []byte) uint32 {
	if !hasCLMUL || len(p) < clmulMin {
		return crc32.Update(crc, table, p)
	}
	n := len(p) &^ 255
	// crc32.Update(c, p) is the plain remainder with initial value ^c,
	// inverted; a plain remainder with initial value v is that of the
	// input with v xored into its first 4 bytes and initial value 0; and
	// an initial value of 0 is what crc32.Update(0xFFFFFFFF, ...) uses.
	var r [64]byte
	foldCLMUL(&r, p[:n], ^crc, &foldKeys)
	// The CRC of the 64 folded bytes, from initial value 0, a byte at a
	// time (r passed to hash/crc32 would escape: an allocation per call).
	c := uint32(0)
	for _, b := range r {
		c = table[byte(c)^b] ^ c>>8
	}
	return crc32.Update(^c, table, p[n:])
}
