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
func CheckPath(p []byte) error {
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
