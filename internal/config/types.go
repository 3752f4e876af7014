package config

import (
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"
	"time"
)

// Size is a byte count written as an integer or a string with a unit:
// "64MiB", "100GiB", "4096", "1.5GB".
type Size int64

var sizeUnits = []struct {
	suffix string
	mult   float64
}{
	{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40},
	{"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12},
	{"K", 1 << 10}, {"M", 1 << 20}, {"G", 1 << 30}, {"T", 1 << 40},
	{"B", 1},
}

// ParseSize parses a size as Size documents it.
func ParseSize(s string) (Size, error) {
	s = strings.TrimSpace(s)
	mult := 1.0
	num := s
	for _, u := range sizeUnits {
		if rest, ok := strings.CutSuffix(s, u.suffix); ok {
			num, mult = strings.TrimSpace(rest), u.mult
			break
		}
	}
	v, err := strconv.ParseFloat(num, 64)
	// !(v >= 0) refuses NaN too, which every comparison passes and which
	// would convert to the most negative Size.
	if err != nil || !(v >= 0) || v*mult > 1<<62 {
		return 0, invalidf("size %q: want a number of bytes with an optional unit (KiB, MiB, GiB, TiB, KB, MB, GB, TB)", s)
	}
	// A fraction of a byte would be cut to a whole one: "0.5" to 0, the
	// setting's default, which is rarely what was meant.
	if (mult == 1 && v != math.Trunc(v)) || (v > 0 && v*mult < 1) {
		return 0, invalidf("size %q: want a whole number of bytes (a fraction needs a unit, e.g. \"0.5GiB\")", s)
	}
	return Size(v * mult), nil
}

// UnmarshalTOML accepts an integer or a string with a unit.
func (s *Size) UnmarshalTOML(v any) error {
	switch v := v.(type) {
	case int64:
		if v < 0 {
			return invalidf("size %d is negative", v)
		}
		*s = Size(v)
		return nil
	case string:
		n, err := ParseSize(v)
		*s = n
		return err
	}
	return invalidf("size: want an integer or a string such as \"64MiB\", got %T", v)
}

// Set implements flag.Value.
func (s *Size) Set(v string) error {
	n, err := ParseSize(v)
	if err == nil {
		*s = n
	}
	return err
}

// String formats the size with the largest exact binary unit.
func (s Size) String() string {
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}} {
		if s != 0 && int64(s)%u.mult == 0 {
			return strconv.FormatInt(int64(s)/u.mult, 10) + u.suffix
		}
	}
	return strconv.FormatInt(int64(s), 10)
}

// AutoSize is a Size that kvhost chooses unless it is given: its zero
// value and the string "auto" leave it to kvhost (Given false); any size,
// 0 included, is used as it is.
type AutoSize struct {
	Bytes Size // the size given (meaningful only where Given)
	Given bool // a size was given; false leaves it to kvhost
}

// Auto returns the AutoSize that leaves the size to kvhost (its zero
// value).
func Auto() AutoSize { return AutoSize{} }

// SizeOf is the AutoSize that gives n bytes.
func SizeOf(n Size) AutoSize { return AutoSize{Bytes: n, Given: true} }

// UnmarshalTOML accepts "auto", an integer or a string with a unit.
func (s *AutoSize) UnmarshalTOML(v any) error {
	if str, ok := v.(string); ok && isAuto(str) {
		*s = Auto()
		return nil
	}
	var n Size
	if err := n.UnmarshalTOML(v); err != nil {
		return fmt.Errorf("%w (or \"auto\")", err)
	}
	*s = SizeOf(n)
	return nil
}

// Set implements flag.Value: "auto" or a size.
func (s *AutoSize) Set(v string) error {
	if isAuto(v) {
		*s = Auto()
		return nil
	}
	n, err := ParseSize(v)
	if err != nil {
		return fmt.Errorf("%w (or \"auto\")", err)
	}
	*s = SizeOf(n)
	return nil
}

// String is "auto" or the size.
func (s AutoSize) String() string {
	if !s.Given {
		return "auto"
	}
	return s.Bytes.String()
}

func isAuto(s string) bool { return strings.EqualFold(strings.TrimSpace(s), "auto") }

// Duration is a time.Duration written as a string ("100ms", "1m").
type Duration time.Duration

// UnmarshalTOML accepts a Go duration string.
func (d *Duration) UnmarshalTOML(v any) error {
	s, ok := v.(string)
	if !ok {
		return invalidf("duration: want a string such as \"100ms\" or \"1m\", got %T", v)
	}
	return d.Set(s)
}

// Set implements flag.Value.
func (d *Duration) Set(s string) error {
	v, err := time.ParseDuration(s)
	if err != nil {
		return invalidf("duration %q: want a value such as \"100ms\" or \"1m\"", s)
	}
	*d = Duration(v)
	return nil
}

// String formats the duration as time.Duration does.
func (d Duration) String() string { return time.Duration(d).String() }

// FileMode is a permission written as an octal string ("0660").
type FileMode os.FileMode

// UnmarshalTOML accepts an octal string.
func (m *FileMode) UnmarshalTOML(v any) error {
	s, ok := v.(string)
	if !ok {
		return invalidf("file mode: want an octal string such as \"0660\", got %T", v)
	}
	return m.Set(s)
}

// Set implements flag.Value.
func (m *FileMode) Set(s string) error {
	v, err := strconv.ParseUint(s, 8, 32)
	if err != nil || v > 0o777 {
		return invalidf("file mode %q: want octal permissions such as \"0660\"", s)
	}
	*m = FileMode(v)
	return nil
}

// String formats the mode in octal.
func (m FileMode) String() string { return fmt.Sprintf("%04o", uint32(m)) }
