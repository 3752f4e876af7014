package vllmfs

import (
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strconv"
)

// The fs tier hashes and writes its fields with Python's json module
// (sort_keys, ensure_ascii): Go's encoding/json escapes differently (<, >,
// & and U+2028 as \u escapes, no escape for DEL), so the bytes are produced
// here, by rules written from the json module's documented behaviour.

// encodeCompact appends v as json.dumps(v, sort_keys=True,
// separators=(",", ":")) would write it.
func encodeCompact(b []byte, v any) ([]byte, error) {
	return encode(b, v, -1, 0)
}

// encodeIndent appends v as json.dump(v, indent=2, sort_keys=True) would
// write it (item separator ",", key separator ": ", no final newline).
func encodeIndent(b []byte, v any) ([]byte, error) {
	return encode(b, v, 2, 0)
}

func encode(b []byte, v any, indent, depth int) ([]byte, error) {
	newline := func(b []byte, d int) []byte {
		if indent < 0 {
			return b
		}
		b = append(b, '\n')
		for range d * indent {
			b = append(b, ' ')
		}
		return b
	}
	keySep := ":"
	if indent >= 0 {
		keySep = ": "
	}
	var err error
	switch v := v.(type) {
	case nil:
		return append(b, "null"...), nil
	case bool:
		return strconv.AppendBool(b, v), nil
	case int:
		return strconv.AppendInt(b, int64(v), 10), nil
	case int64:
		return strconv.AppendInt(b, v, 10), nil
	case json.Number:
		// Numbers read from a config.json keep their text: Python wrote it.
		return append(b, v...), nil
	case string:
		return appendString(b, v), nil
	case []string:
		a := make([]any, len(v))
		for i, s := range v {
			a[i] = s
		}
		return encode(b, a, indent, depth)
	case []any:
		if len(v) == 0 {
			return append(b, "[]"...), nil
		}
		b = append(b, '[')
		for i, x := range v {
			if i > 0 {
				b = append(b, ',')
			}
			b = newline(b, depth+1)
			if b, err = encode(b, x, indent, depth+1); err != nil {
				return nil, err
			}
		}
		b = newline(b, depth)
		return append(b, ']'), nil
	case map[string]any:
		if len(v) == 0 {
			return append(b, "{}"...), nil
		}
		// Python sorts str by code point; Go orders strings by byte,
		// which for valid UTF-8 is the same order.
		keys := slices.Sorted(maps.Keys(v))
		b = append(b, '{')
		for i, k := range keys {
			if i > 0 {
				b = append(b, ',')
			}
			b = newline(b, depth+1)
			b = appendString(b, k)
			b = append(b, keySep...)
			if b, err = encode(b, v[k], indent, depth+1); err != nil {
				return nil, err
			}
		}
		b = newline(b, depth)
		return append(b, '}'), nil
	}
	return nil, fmt.Errorf("%w: a value of type %T has no JSON form here", ErrConfig, v)
}

// appendString appends s quoted as Python's json module does with
// ensure_ascii: `"` and `\` escaped, \b \f \n \r \t short forms, every
// other character outside printable ASCII (0x20..0x7e) as \uXXXX in lower-case
// hex, characters above U+FFFF as a surrogate pair. Invalid UTF-8 is
// U+FFFD (a Python str cannot hold it).
func appendString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	u := func(b []byte, r rune) []byte {
		return append(b, '\\', 'u', hex[r>>12&15], hex[r>>8&15], hex[r>>4&15], hex[r&15])
	}
	b = append(b, '"')
	for _, r := range s { // invalid bytes come out as utf8.RuneError
		switch {
		case r == '"':
			b = append(b, '\\', '"')
		case r == '\\':
			b = append(b, '\\', '\\')
		case r == '\b':
			b = append(b, '\\', 'b')
		case r == '\f':
			b = append(b, '\\', 'f')
		case r == '\n':
			b = append(b, '\\', 'n')
		case r == '\r':
			b = append(b, '\\', 'r')
		case r == '\t':
			b = append(b, '\\', 't')
		case r >= 0x20 && r <= 0x7e:
			b = append(b, byte(r))
		case r > 0xffff:
			r -= 0x10000
			b = u(b, 0xd800|(r>>10)&0x3ff)
			b = u(b, 0xdc00|r&0x3ff)
		default:
			b = u(b, r)
		}
	}
	return append(b, '"')
}
