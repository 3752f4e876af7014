package meter

import "fmt"

var errEOF = fmt.Errorf("%w: unexpected end", ErrMalformed)

// reader decodes the primitive encodings of the wasm binary format.
type reader struct {
	b   []byte
	pos int
}

func (r *reader) byte() (byte, error) {
	if r.pos >= len(r.b) {
		return 0, errEOF
	}
	c := r.b[r.pos]
	r.pos++
	return c, nil
}

func (r *reader) bytes(n int) ([]byte, error) {
	if n < 0 || n > len(r.b)-r.pos {
		return nil, errEOF
	}
	b := r.b[r.pos : r.pos+n]
	r.pos += n
	return b, nil
}

var errLEB = fmt.Errorf("%w: integer too long", ErrMalformed)

// u32 reads an unsigned LEB128 of at most 32 bits.
func (r *reader) u32() (uint32, error) {
	var v uint32
	for shift := uint(0); ; shift += 7 {
		c, err := r.byte()
		if err != nil {
			return 0, err
		}
		if shift == 28 && c&0x70 != 0 {
			return 0, errLEB
		}
		v |= uint32(c&0x7f) << shift
		if c&0x80 == 0 {
			return v, nil
		}
		if shift == 28 {
			return 0, errLEB
		}
	}
}

// signed reads a signed LEB128 of at most bits bits. The unused bits of
// its last byte are not checked: wazero checks them when it compiles the
// output, which copies the bytes unchanged.
func (r *reader) signed(bits uint) (int64, error) {
	var v int64
	var shift uint
	for {
		c, err := r.byte()
		if err != nil {
			return 0, err
		}
		if shift < 64 {
			v |= int64(c&0x7f) << shift
		}
		shift += 7
		if c&0x80 == 0 {
			if shift < 64 && c&0x40 != 0 {
				v |= -1 << shift
			}
			return v, nil
		}
		if shift >= bits {
			return 0, errLEB
		}
	}
}

// name reads a length-prefixed byte string.
func (r *reader) name() ([]byte, error) {
	n, err := r.u32()
	if err != nil {
		return nil, err
	}
	return r.bytes(int(n))
}

func (r *reader) valType() (byte, error) {
	c, err := r.byte()
	if err != nil {
		return 0, err
	}
	if !isValType(c) {
		return 0, fmt.Errorf("%w: value type %#x", ErrUnsupported, c)
	}
	return c, nil
}

// valTypes reads a vector of value types and returns its length.
func (r *reader) valTypes() (int, error) {
	n, err := r.u32()
	if err != nil {
		return 0, err
	}
	for range n {
		if _, err := r.valType(); err != nil {
			return 0, err
		}
	}
	return int(n), nil
}

// limits reads the limits of a table or memory: the minimum, and the
// maximum where hasMax.
func (r *reader) limits() (lo, hi uint32, hasMax bool, err error) {
	flag, err := r.byte()
	if err != nil {
		return 0, 0, false, err
	}
	if flag > 1 {
		return 0, 0, false, fmt.Errorf("%w: limits flag %#x (shared memory or memory64)", ErrUnsupported, flag)
	}
	if lo, err = r.u32(); err != nil {
		return 0, 0, false, err
	}
	if flag == 1 {
		hi, err = r.u32()
		hasMax = true
	}
	return lo, hi, hasMax, err
}

func appendU32(b []byte, v uint32) []byte {
	for v >= 0x80 {
		b = append(b, byte(v)|0x80)
		v >>= 7
	}
	return append(b, byte(v))
}

func appendS64(b []byte, v int64) []byte {
	for {
		c := byte(v & 0x7f)
		v >>= 7
		if (v == 0 && c&0x40 == 0) || (v == -1 && c&0x40 != 0) {
			return append(b, c)
		}
		b = append(b, c|0x80)
	}
}
