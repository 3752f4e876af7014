package crc32c

// Linear pieces of the CRC, for checksums computed elsewhere in parts (the
// GPU's checksum kernel) and joined here. Bits are in the CRC's reflected
// order: x^0 is the top bit (1<<31), x^31 the bottom one.

// reflectedPoly is the CRC-32C polynomial, x^32 implied, bit-reflected.
const reflectedPoly = 0x82F63B78

// x2n[k] is x^(2^k) modulo the polynomial: Shift multiplies by x2n[k]
// for each set bit k of 8n (k < 64: shifts past up to 2^61 bytes). It is
// computed once and never written.
var x2n = func() (t [64]uint32) {
	p := uint32(1 << 30) // x^1
	for k := range t {
		t[k] = p
		p = mulMod(p, p)
	}
	return t
}()

// mulMod returns a·b modulo the polynomial.
func mulMod(a, b uint32) uint32 {
	var p uint32
	for m := uint32(1 << 31); m != 0; m >>= 1 {
		if a&m != 0 {
			p ^= b
		}
		if b&1 != 0 {
			b = b>>1 ^ reflectedPoly
		} else {
			b >>= 1
		}
	}
	return p
}

// Shift returns the CRC register after n zero bytes from state r (no
// inversions: the register itself): r·x^(8n) modulo the polynomial.
// A register is shifted past the bytes that follow its own.
func Shift(r uint32, n int64) uint32 {
	for k := 3; n > 0; k, n = k+1, n>>1 {
		if n&1 != 0 {
			r = mulMod(r, x2n[k])
		}
	}
	return r
}

// Register returns the CRC register after p from state 0, with no
// inversions: Update's linear part. The register of a concatenation is
// the first part's register shifted past the second (Shift) xored with
// the second's.
func Register(p []byte) uint32 { return ^Update(0xFFFFFFFF, p) }

// Extend returns what Update(crc, p) returns, given only the register of
// p (Register) and its length n: the checksums of data whose bytes were
// read elsewhere, joined in order.
func Extend(crc, register uint32, n int64) uint32 {
	return ^(Shift(^crc, n) ^ register)
}

// An Extender is Extend for parts of one length: it computes x^(8n) once,
// where Extend computes it for every part (up to one multiplication per
// bit of n), so joining many parts of a length costs one multiplication
// each. The zero Extender is for length 0.
type Extender struct {
	n int64
	k uint32 // x^(8n) modulo the polynomial
}

// NewExtender returns the Extender of parts of n bytes.
func NewExtender(n int64) Extender { return Extender{n: n, k: Shift(1<<31, n)} }

// Len is the length of the parts e joins.
func (e Extender) Len() int64 { return e.n }

// Extend returns what Extend(crc, register, e.Len()) returns.
func (e Extender) Extend(crc, register uint32) uint32 {
	if e.k == 0 { // the zero Extender: no bytes, nothing moves
		return ^(^crc ^ register)
	}
	return ^(mulMod(^crc, e.k) ^ register)
}
