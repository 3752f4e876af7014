package config

import (
	"bufio"
	"fmt"
	"io"
	"maps"
	"math"
	"reflect"
	"slices"
	"strconv"
	"strings"
)

// Notes are comments for WriteTOML, by key: "server.max_inflight_bytes",
// "mount.0.capacity" (the first [[mount]]), "policy.params.k".
type Notes map[string]string

// WriteTOML writes c as a TOML file that Parse reads back to c: every key
// of every table, in the order of the Config types, sizes with their
// largest exact binary unit, durations and file modes as strings. A key
// of notes gets its note as a comment at the end of its line. A pointer
// left nil (a setting that defaults by the mount or file system, such as
// mount.shared) and an empty list are written as a comment saying they are
// unset, with their note.
func (c Config) WriteTOML(w io.Writer, notes Notes) error {
	bw := bufio.NewWriter(w)
	tw := &tomlWriter{w: bw, notes: notes}
	v := reflect.ValueOf(c)
	for i := range v.NumField() {
		name := tomlName(v.Type().Field(i))
		tw.table(name, name, v.Field(i))
	}
	if tw.err != nil {
		return tw.err
	}
	return bw.Flush()
}

// tomlWriter writes tables and their keys; the first error sticks.
type tomlWriter struct {
	w       *bufio.Writer
	notes   Notes
	err     error
	started bool // a header is written: a blank line before the next
}

func (tw *tomlWriter) printf(format string, args ...any) {
	if tw.err == nil {
		_, tw.err = fmt.Fprintf(tw.w, format, args...)
	}
}

// header writes a table's header line, after a blank line.
func (tw *tomlWriter) header(h string) {
	if tw.started {
		tw.printf("\n")
	}
	tw.started = true
	tw.printf("%s\n", h)
}

// table writes f, a value isTable holds, as the table (or tables) name,
// its keys in notes under path: a map's keys sorted, a struct's keys
// then its own tables, each struct of a slice as one [[name]] table. An
// empty map and a nil pointer write nothing.
func (tw *tomlWriter) table(name, path string, f reflect.Value) {
	switch f.Kind() {
	case reflect.Map:
		if f.Len() == 0 {
			return
		}
		tw.header("[" + name + "]")
		m := f.Interface().(map[string]any)
		for _, k := range slices.Sorted(maps.Keys(m)) {
			val, err := tomlValue(reflect.ValueOf(m[k]))
			if err != nil {
				tw.err = fmt.Errorf("config: %s.%s: %w", path, k, err)
				return
			}
			tw.printf("%s = %s%s\n", tomlKey(k), val, suffix(tw.notes[path+"."+k], "  # "))
		}
	case reflect.Pointer:
		if !f.IsNil() {
			tw.table(name, path, f.Elem())
		}
	case reflect.Struct:
		tw.header("[" + name + "]")
		tw.fields(name, path, f)
	case reflect.Slice:
		for j := range f.Len() {
			tw.header("[[" + name + "]]")
			tw.fields(name, path+"."+strconv.Itoa(j), f.Index(j))
		}
	}
}

// fields writes struct v's keys, then its tables.
func (tw *tomlWriter) fields(name, path string, v reflect.Value) {
	t := v.Type()
	var later []int
	for i := range t.NumField() {
		key := tomlName(t.Field(i))
		f := v.Field(i)
		if isTable(f) {
			later = append(later, i)
			continue
		}
		note := tw.notes[path+"."+key]
		if f.Kind() == reflect.Pointer && f.IsNil() || f.Kind() == reflect.Slice && f.Len() == 0 {
			tw.printf("# %s: unset%s\n", key, suffix(note, ", "))
			continue
		}
		val, err := tomlValue(f)
		if err != nil {
			tw.err = fmt.Errorf("config: %s.%s: %w", path, key, err)
			return
		}
		tw.printf("%s = %s%s\n", key, val, suffix(note, "  # "))
	}
	for _, i := range later {
		key := tomlName(t.Field(i))
		tw.table(name+"."+key, path+"."+key, v.Field(i))
	}
}

// isTable reports whether f is written as a table of its own: a map, a
// struct behind a pointer, a slice of structs (a struct value, such as
// AutoSize, is a value).
func isTable(f reflect.Value) bool {
	switch f.Kind() {
	case reflect.Map:
		return true
	case reflect.Pointer, reflect.Slice:
		return f.Type().Elem().Kind() == reflect.Struct
	}
	return false
}

func suffix(note, sep string) string {
	if note == "" {
		return ""
	}
	return sep + note
}

// tomlName is a field's key: its toml tag.
func tomlName(sf reflect.StructField) string {
	name, _, _ := strings.Cut(sf.Tag.Get("toml"), ",")
	if name == "" {
		return sf.Name
	}
	return name
}

// tomlKey is k as a TOML key: bare where it may be, else quoted.
func tomlKey(k string) string {
	if k != "" && strings.Trim(k, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-") == "" {
		return k
	}
	return tomlString(k)
}

// tomlValue formats f as a TOML value: the types of this package as the
// strings they parse from.
func tomlValue(f reflect.Value) (string, error) {
	switch x := f.Interface().(type) {
	case Size, AutoSize, Duration, FileMode:
		return tomlString(x.(fmt.Stringer).String()), nil
	}
	switch f.Kind() {
	case reflect.Pointer, reflect.Interface:
		return tomlValue(f.Elem())
	case reflect.String:
		return tomlString(f.String()), nil
	case reflect.Bool:
		return strconv.FormatBool(f.Bool()), nil
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return strconv.FormatInt(f.Int(), 10), nil
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return strconv.FormatUint(f.Uint(), 10), nil
	case reflect.Float32, reflect.Float64:
		switch x := f.Float(); {
		case math.IsNaN(x): // TOML's spellings, not Go's NaN and +Inf
			return "nan", nil
		case math.IsInf(x, 1):
			return "inf", nil
		case math.IsInf(x, -1):
			return "-inf", nil
		}
		s := strconv.FormatFloat(f.Float(), 'g', -1, 64)
		if !strings.ContainsAny(s, ".eEnN") { // TOML: a float has a point or an exponent
			s += ".0"
		}
		return s, nil
	case reflect.Slice:
		parts := make([]string, f.Len())
		for i := range parts {
			p, err := tomlValue(f.Index(i))
			if err != nil {
				return "", err
			}
			parts[i] = p
		}
		return "[" + strings.Join(parts, ", ") + "]", nil
	}
	return "", fmt.Errorf("a value of type %s cannot be written", f.Type())
}

// tomlString quotes s as a TOML basic string.
func tomlString(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r < 0x20 || r == 0x7f:
			fmt.Fprintf(&b, "\\u%04X", r)
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte('"')
	return b.String()
}
