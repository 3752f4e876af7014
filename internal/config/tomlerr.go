package config

import (
	"bufio"
	"bytes"
	"fmt"
	"regexp"
)

// The TOML decoder's messages about a value of the wrong type name Go
// types: "incompatible types: TOML value has type map[string]any;
// destination has type slice", "type mismatch for config.Server:
// expected table but found []map[string]any".
var (
	incompatibleType = regexp.MustCompile(`^incompatible types: TOML value has type (.+); destination has type (.+)$`)
	notATable        = regexp.MustCompile(`^type mismatch for .+: expected table but found (.+)$`)
)

// plainTypeError rewrites msg, the TOML decoder's message about the
// value of key having the wrong type, in the file's own terms: "want an
// integer, got a string". A table written with one pair of brackets
// where the key takes an array of them ([mount] for [[mount]]), or the
// other way round, says which to write. A message it does not know is
// returned as it is.
func plainTypeError(key, msg string) string {
	var got, want string
	if m := incompatibleType.FindStringSubmatch(msg); m != nil {
		got, want = tomlValueKind(m[1]), destinationKind(m[2])
	} else if m := notATable.FindStringSubmatch(msg); m != nil {
		got, want = tomlValueKind(m[1]), "a table"
	}
	switch {
	case got == "" || want == "":
		return msg
	case got == "a table" && want == "an array":
		return fmt.Sprintf("want an array of tables, one [[%s]] (two brackets) before the keys of each, got a table: write [[%[1]s]], not [%[1]s]", key)
	case got == "an array of tables" && want == "a table":
		return fmt.Sprintf("want a table, got an array of tables: write [%s], not [[%[1]s]]", key)
	}
	return fmt.Sprintf("want %s, got %s", want, got)
}

// tomlValueKind names a TOML value by the Go type the decoder gives it
// ("" for one it does not know).
func tomlValueKind(goType string) string {
	switch goType {
	case "string":
		return "a string"
	case "int64":
		return "an integer"
	case "float64":
		return "a number with a fraction"
	case "bool":
		return "a boolean"
	case "[]any":
		return "an array"
	case "[]map[string]any":
		return "an array of tables"
	case "map[string]any":
		return "a table"
	case "time.Time", "toml.LocalDate", "toml.LocalDatetime", "toml.LocalTime":
		return "a date or time"
	}
	return ""
}

// destinationKind names what a key takes by the decoder's name of its
// Go type ("" for one it does not know).
func destinationKind(dst string) string {
	switch dst {
	case "integer":
		return "an integer"
	case "float":
		return "a number"
	case "boolean":
		return "true or false"
	case "string", "primitive (string-like)":
		return "a string (in quotes)"
	case "slice":
		return "an array"
	case "map":
		return "a table"
	}
	return ""
}

// unquotedUnit matches a line that gives a key a number followed by a
// unit without quotes (capacity = 4GiB, shutdown_timeout = 10s), which
// TOML reads as a number followed by stray text.
var unquotedUnit = regexp.MustCompile(`^\s*([A-Za-z0-9_-]+)\s*=\s*([+-]?[0-9][0-9_.]*\s*[A-Za-z]+)\s*(#.*)?$`)

// unquotedUnitHint says, where line n of src gives a key a size or
// duration with its unit unquoted, the key (its table's name, table,
// in front) and how to write it; "" otherwise.
func unquotedUnitHint(src []byte, n int, table string) string {
	sc := bufio.NewScanner(bytes.NewReader(src))
	for i := 1; sc.Scan(); i++ {
		if i < n {
			continue
		}
		m := unquotedUnit.FindStringSubmatch(sc.Text())
		if m == nil {
			return ""
		}
		key := m[1]
		if table != "" {
			key = table + "." + key
		}
		return fmt.Sprintf("%s: a size or duration with a unit is a string: write %s = %q", key, m[1], m[2])
	}
	return ""
}
