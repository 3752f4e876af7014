package protocol

import (
	"encoding/binary"
	"fmt"
)

// decoder reads a body; the first failure sticks and later reads return
// zero values, so a message decoder checks err once at the end.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: %s", ErrMalformed, fmt.Sprintf(format, args...))
	}
}

func (d *decoder) take(n int, what string) []byte {
	if d.err != nil {
		return nil
	}
	if n < 0 || n > len(d.b) {
		d.fail("%s: need %d bytes, %d left", what, n, len(d.b))
		return nil
	}
	v := d.b[:n:n]
	d.b = d.b[n:]
	return v
}

func (d *decoder) u8(what string) uint8 {
	if b := d.take(1, what); b != nil {
		return b[0]
	}
	return 0
}

func (d *decoder) u16(what string) uint16 {
	if b := d.take(2, what); b != nil {
		return binary.LittleEndian.Uint16(b)
	}
	return 0
}

func (d *decoder) u32(what string) uint32 {
	if b := d.take(4, what); b != nil {
		return binary.LittleEndian.Uint32(b)
	}
	return 0
}

func (d *decoder) u64(what string) uint64 {
	if b := d.take(8, what); b != nil {
		return binary.LittleEndian.Uint64(b)
	}
	return 0
}

// i64 reads a signed value that must not be negative.
func (d *decoder) i64(what string) int64 {
	v := d.u64(what)
	if v > 1<<62 {
		d.fail("%s = %d: out of range", what, v)
		return 0
	}
	return int64(v)
}

// count reads a u32 count that must be in [lo, hi] and fit in the rest of
// the body at minSize bytes per element.
func (d *decoder) count(what string, lo, hi, minSize int) int {
	v := d.u32(what)
	if d.err != nil {
		return 0
	}
	if int64(v) < int64(lo) || int64(v) > int64(hi) {
		d.fail("%s = %d: want %d..%d", what, v, lo, hi)
		return 0
	}
	if int64(v)*int64(minSize) > int64(len(d.b)) {
		d.fail("%s = %d: body has %d bytes left", what, v, len(d.b))
		return 0
	}
	return int(v)
}

// sectionCount reads the u32 count of a section that holds one entry per
// element of an earlier section (of, want of them): 0 and d failed where
// it is another count.
func (d *decoder) sectionCount(section, of string, want int) int {
	n := d.u32(section + " count")
	if d.err == nil && int64(n) != int64(want) {
		d.fail("%s section of %d %s after %d", section, n, of, want)
		return 0
	}
	return int(n)
}

// str8 reads a string with a u8 length of at most max bytes.
func (d *decoder) str8(what string, max int) string {
	n := int(d.u8(what + " length"))
	if n > max {
		d.fail("%s length %d: at most %d", what, n, max)
		return ""
	}
	return string(d.take(n, what))
}

// str16 reads a string with a u16 length of at most max bytes.
func (d *decoder) str16(what string, max int) string {
	n := int(d.u16(what + " length"))
	if n > max {
		d.fail("%s length %d: at most %d", what, n, max)
		return ""
	}
	return string(d.take(n, what))
}

// zero reads n reserved bytes that must be zero.
func (d *decoder) zero(n int) {
	for _, c := range d.take(n, "reserved") {
		if c != 0 {
			d.fail("reserved bytes are not zero")
			return
		}
	}
}

// keys reads a key count and the keys, each a u8 length then bytes.
func (d *decoder) keys() [][]byte {
	n := d.count("key count", 1, MaxKeysPerRequest, 2)
	if d.err != nil {
		return nil
	}
	keys := make([][]byte, n)
	for i := range keys {
		l := int(d.u8("key length"))
		if d.err == nil && (l == 0 || l > MaxKeyLen) {
			d.fail("key %d length %d: want 1..%d", i, l, MaxKeyLen)
		}
		keys[i] = d.take(l, "key")
		if d.err != nil {
			return nil
		}
	}
	return keys
}

// end fails if bytes are left.
func (d *decoder) end() error {
	if d.err == nil && len(d.b) != 0 {
		d.fail("%d trailing bytes", len(d.b))
	}
	return d.err
}

func appendU16(b []byte, v uint16) []byte { return binary.LittleEndian.AppendUint16(b, v) }
func appendU32(b []byte, v uint32) []byte { return binary.LittleEndian.AppendUint32(b, v) }
func appendU64(b []byte, v uint64) []byte { return binary.LittleEndian.AppendUint64(b, v) }

func appendStr8(b []byte, s string, max int) []byte {
	s = s[:min(len(s), max)]
	return append(append(b, uint8(len(s))), s...)
}

func appendStr16(b []byte, s string, max int) []byte {
	s = s[:min(len(s), max)]
	return append(appendU16(b, uint16(len(s))), s...)
}

func appendKeys(b []byte, keys [][]byte) []byte {
	b = appendU32(b, uint32(len(keys)))
	for _, k := range keys {
		b = append(append(b, uint8(len(k))), k...)
	}
	return b
}

// CheckKeys reports whether keys is a valid key list for a request: 1 to
// MaxKeysPerRequest keys of 1 to MaxKeyLen bytes. Encoders do not check;
// clients call it before sending.
func CheckKeys(keys [][]byte) error {
	if len(keys) == 0 || len(keys) > MaxKeysPerRequest {
		return fmt.Errorf("%w: %d keys: want 1..%d", ErrMalformed, len(keys), MaxKeysPerRequest)
	}
	for i, k := range keys {
		if len(k) == 0 || len(k) > MaxKeyLen {
			return fmt.Errorf("%w: key %d is %d bytes: want 1..%d", ErrMalformed, i, len(k), MaxKeyLen)
		}
	}
	return nil
}
