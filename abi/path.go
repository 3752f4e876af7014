package abi

// PathError says why a path returned by a plugin is not acceptable.
type PathError struct {
	Path   string // the path as the plugin returned it
	Reason string // why it was refused, e.g. "absolute"
}

// Error quotes the path and says why it was refused.
func (e *PathError) Error() string {
	return "abi: invalid path " + quote(e.Path) + ": " + e.Reason
}

// CheckPath reports whether p is a path a plugin may return: relative, at most
// MaxPathLen bytes, '/'-separated components of [A-Za-z0-9._-], none empty, none
// starting with '.' (names starting with '.' are the host's: temporary files,
// metadata), so no component is "." or "..".
//
// It checks every name a plugin returns, so it takes one table lookup per
// byte, eight bytes a step, and no branch but the loop's: a path that
// fails any rule goes through checkPath, which says why.
func CheckPath(p []byte) error {
	// all: the bits every byte has; pairs: the bits of a byte's class
	// shifted up one, and those of the next byte: classStart there
	// is a '/' or '.' right after a '/'.
	all, pairs, prev := byte(classAllowed), byte(0), byte(classSlash) // as after a '/'
	q := p
	for len(q) >= 8 {
		k0, k1, k2, k3 := pathClass[q[0]], pathClass[q[1]], pathClass[q[2]], pathClass[q[3]]
		k4, k5, k6, k7 := pathClass[q[4]], pathClass[q[5]], pathClass[q[6]], pathClass[q[7]]
		all &= k0 & k1 & k2 & k3 & k4 & k5 & k6 & k7
		pairs |= prev<<1&k0 | k0<<1&k1 | k1<<1&k2 | k2<<1&k3 | k3<<1&k4 | k4<<1&k5 | k5<<1&k6 | k6<<1&k7
		prev = k7
		q = q[8:]
	}
	for _, c := range q {
		k := pathClass[c]
		all &= k
		pairs |= prev << 1 & k
		prev = k
	}
	if all&classAllowed == 0 || pairs&classStart != 0 || prev&classSlash != 0 || len(p) == 0 || len(p) > MaxPathLen {
		return checkPath(p) // a trailing '/' (prev) is an empty component
	}
	return nil
}

// The bits of pathClass: a byte of the set (classAllowed), '/'
// (classSlash), a byte that may not start a component (classStart: '/'
// and '.').
const (
	classAllowed = 1
	classSlash   = 2
	classStart   = 4
)

// pathClass holds the class bits of every byte (TestPathClass checks it
// against the rule).
const pathClass = "" +
	"\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00" +
	"\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01\x05\x07\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x00\x00\x00\x00\x00\x00" +
	"\x00\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x00\x00\x00\x00\x01" +
	"\x00\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x00\x00\x00\x00\x00" +
	"\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00" +
	"\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00" +
	"\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00" +
	"\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"

// checkPath is CheckPath one byte and one rule at a time: what says why a
// path fails.
func checkPath(p []byte) error {
	fail := func(reason string) error { return &PathError{Path: string(p), Reason: reason} }
	switch {
	case len(p) == 0:
		return fail("empty")
	case len(p) > MaxPathLen:
		return fail("longer than " + itoa(MaxPathLen) + " bytes")
	case p[0] == '/':
		return fail("absolute")
	}
	start := 0
	for i := 0; i <= len(p); i++ {
		if i < len(p) && p[i] != '/' {
			c := p[i]
			ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-'
			if !ok {
				return fail("byte 0x" + hex64(uint64(c)) + " at " + itoa(int64(i)) + " is not one of [A-Za-z0-9._-/]")
			}
			continue
		}
		switch {
		case i == start:
			return fail("empty component")
		case p[start] == '.':
			return fail("component " + quote(string(p[start:i])) + " starts with '.'")
		}
		start = i + 1
	}
	return nil
}

func quote(s string) string {
	const max = 80
	if len(s) > max {
		s = s[:max] + "..."
	}
	b := []byte{'"'}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c < 0x20 || c >= 0x7f:
			b = append(b, '\\', 'x', "0123456789abcdef"[c>>4], "0123456789abcdef"[c&15])
		default:
			b = append(b, c)
		}
	}
	return string(append(b, '"'))
}
