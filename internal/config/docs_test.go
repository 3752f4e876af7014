package config

import (
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/BurntSushi/toml"
)

// TestEveryKeyIsInConfigMdAndEveryKeyThereExists: every key the file may
// hold (Config's toml tags) is named in the first column of a table under
// its table's heading in docs/config.md, which the unknown-key error
// points to, and every key those tables name is one the file may hold. A
// key that is itself a table ([policy.params]) has a heading of its own.
func TestEveryKeyIsInConfigMdAndEveryKeyThereExists(t *testing.T) {
	code := map[string][]string{} // table → its keys
	tableKeys(reflect.TypeFor[Config](), "", code)

	doc, err := os.ReadFile(filepath.Join("..", "..", "docs", "config.md"))
	if err != nil {
		t.Fatal(err)
	}
	heading := regexp.MustCompile("^#+ `\\[+([a-z_.]+)\\]+`")
	row := regexp.MustCompile("^\\| ((?:`[a-z_]+`(?:, )?)+) \\|")
	documented := map[string]map[string]bool{} // table → keys in its tables
	table := ""
	for _, line := range strings.Split(string(doc), "\n") {
		if strings.HasPrefix(line, "#") {
			table = ""
			if m := heading.FindStringSubmatch(line); m != nil {
				table = m[1]
				if documented[table] == nil {
					documented[table] = map[string]bool{}
				}
			}
			continue
		}
		if m := row.FindStringSubmatch(line); m != nil && table != "" {
			for _, k := range regexp.MustCompile("`([a-z_]+)`").FindAllStringSubmatch(m[1], -1) {
				documented[table][k[1]] = true
			}
		}
	}
	// [[mount.vllm_fs.kv_cache_groups]] is described in prose under
	// [mount.vllm_fs], which names its two keys.
	for _, k := range code["mount.vllm_fs.kv_cache_groups"] {
		if !strings.Contains(string(doc), "`"+k+"`") {
			t.Errorf("docs/config.md does not name mount.vllm_fs.kv_cache_groups.%s", k)
		}
	}
	delete(code, "mount.vllm_fs.kv_cache_groups")

	tables := make([]string, 0, len(code))
	for tb := range code {
		tables = append(tables, tb)
	}
	sort.Strings(tables)
	for _, tb := range tables {
		got, ok := documented[tb]
		if !ok {
			t.Errorf("docs/config.md has no heading for [%s]", tb)
			continue
		}
		known := map[string]bool{}
		for _, k := range code[tb] {
			known[k] = true
			if !got[k] && documented[tb+"."+k] == nil {
				t.Errorf("%s.%s is not in the tables under [%s] in docs/config.md", tb, k, tb)
			}
		}
		for k := range got {
			if !known[k] {
				t.Errorf("docs/config.md names %s.%s, which the configuration does not have", tb, k)
			}
		}
	}
}

// tableKeys adds to keys the keys of the TOML table that t decodes, under
// its dotted name prefix, and those of the tables inside it, each under
// its own name; a key that holds a map ([policy.params]) is a key of its
// table. The file's top level (prefix "") holds only tables.
func tableKeys(t reflect.Type, prefix string, keys map[string][]string) {
	unmarshaler := reflect.TypeFor[toml.Unmarshaler]()
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("toml"), ",")
		if name == "" || name == "-" {
			continue
		}
		ft := f.Type
		for ft.Kind() == reflect.Pointer || ft.Kind() == reflect.Slice {
			ft = ft.Elem()
		}
		full := name
		if prefix != "" {
			full = prefix + "." + name
		}
		if ft.Kind() == reflect.Struct && !reflect.PointerTo(ft).Implements(unmarshaler) {
			tableKeys(ft, full, keys) // a table: [server], [[mount]], [mount.vllm_fs]
			continue
		}
		keys[prefix] = append(keys[prefix], name)
	}
}
