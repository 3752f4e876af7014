// Package vllmfs is vLLM's file-system tier layout, as kvhost reads and
// writes it byte for byte: the base directory named after the model and a
// hash of the tier's fields, config.json holding those fields, and one file
// per offload key holding the raw CPU row (no header, no checksum).
//
// A base directory is
//
//	<root>/<model_name with '/' → '_'>_<first 12 hex of sha256(compact JSON of the fields)>
//
// where the JSON is the fields' object with keys sorted, separators "," and
// ":", non-ASCII escaped (Python's json.dumps(sort_keys=True,
// separators=(",", ":"))). config.json in the base directory holds the same
// object, indented by 2 with sorted keys and no final newline. The file of
// key k (block hash followed by the 4-byte big-endian KV-cache group index)
// is
//
//	<base>_r<rank>/<hex[0:3]>/<hex[3:5]>_g<group>/<hex>.bin
//
// with hex the lower-case hex of the block hash. docs/format.md ("vllm-fs
// layout") describes what kvhost does with it; the facts were read from
// vLLM's vllm/v1/kv_offload/file_mapper.py and tiering/fs/manager.py
// (commits 0078e9d2 and 0255eeaa) and written here anew.
package vllmfs

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"path"
	"slices"
	"strconv"
	"strings"
)

// Errors of the package. Returned errors wrap them; test with errors.Is.
var (
	// ErrConfig: the fields are invalid, or a config.json cannot be read.
	ErrConfig = errors.New("vllmfs: invalid configuration")
	// ErrMismatch: a directory's config.json records other fields than
	// the ones declared (the error names them).
	ErrMismatch = errors.New("vllmfs: config.json does not match")
	// ErrKey: a key cannot be named in the layout (too short), or a path
	// is not a row file of the layout.
	ErrKey = errors.New("vllmfs: not a key of the layout")
)

// Names of the layout.
const (
	// ConfigFile is the name of the fields' file in the base directory.
	ConfigFile = "config.json"
	// HashLen is the number of hex digits of the fields' sha256 in the
	// base directory's name.
	HashLen = 12
	// GroupLen is the bytes of the KV-cache group index at the end of a
	// key (big-endian).
	GroupLen = 4
	// MinKeyLen is the shortest key the layout names: a block hash of 3
	// bytes (5 hex digits for the two directory levels) and the group.
	MinKeyLen = 3 + GroupLen
	// Align is the row padding: a row file is its row rounded up to it.
	Align = 4096
)

// Group is one KV-cache group of the fields.
type Group struct {
	TokensPerBlock int      // "tokens_per_block"
	LayerNames     []string // "layer_names"
}

// Fields are the fs tier's fields (vLLM ≳ 0.26 names). The hash and
// config.json are computed from Map, which says which optional fields
// appear.
type Fields struct {
	ModelName     string  // "model_name"
	TokensPerHash int     // "tokens_per_hash"
	BlocksPerFile int     // "blocks_per_file"
	TPSize        int     // "tp_size"
	PPSize        int     // "pp_size"
	PCPSize       int     // "pcp_size"
	DCPSize       int     // "dcp_size"
	Dtype         string  // "dtype", the effective dtype, e.g. "bfloat16"
	KVCacheGroups []Group // "kv_cache_groups"
	// InferenceEngine is "inference_engine"; "" means "vllm".
	InferenceEngine string
	// NotParallelAgnostic writes "parallel_agnostic": false, as the tier
	// does for a layout that depends on the parallel sizes; the field is
	// absent otherwise.
	NotParallelAgnostic bool
	// ReplicatedLayout writes "replicated_layout": true; absent when false.
	ReplicatedLayout bool
	// CanonicalFormat ("canonical_format", e.g. "v1-hnd") and
	// StorageFormat ("storage_format") are written when not empty.
	CanonicalFormat string
	StorageFormat   string // written as "storage_format" when not empty
}

// FieldError is a field out of range; it wraps ErrConfig.
type FieldError struct {
	Field string // the JSON name, e.g. "tp_size" or "kv_cache_groups[0].layer_names"
	Got   any    // the value found
	Want  string // what was expected, e.g. "a positive size"
}

// Error names the field, its value and what was expected.
func (e *FieldError) Error() string {
	return fmt.Sprintf("%v: %s = %v: want %s", ErrConfig, e.Field, e.Got, e.Want)
}

// Unwrap returns ErrConfig.
func (e *FieldError) Unwrap() error { return ErrConfig }

// Validate reports the first field out of range, as a *FieldError.
func (f Fields) Validate() error {
	bad := func(field string, v any, want string) error {
		return &FieldError{Field: field, Got: v, Want: want}
	}
	switch {
	case f.ModelName == "":
		return bad("model_name", `""`, "the model's name")
	case f.TokensPerHash <= 0:
		return bad("tokens_per_hash", f.TokensPerHash, "a positive number of tokens")
	case f.BlocksPerFile <= 0:
		return bad("blocks_per_file", f.BlocksPerFile, "a positive number")
	case f.TPSize <= 0:
		return bad("tp_size", f.TPSize, "a positive size")
	case f.PPSize <= 0:
		return bad("pp_size", f.PPSize, "a positive size")
	case f.PCPSize <= 0:
		return bad("pcp_size", f.PCPSize, "a positive size")
	case f.DCPSize <= 0:
		return bad("dcp_size", f.DCPSize, "a positive size")
	case f.Dtype == "":
		return bad("dtype", `""`, `the effective dtype, e.g. "bfloat16"`)
	case len(f.KVCacheGroups) == 0:
		return bad("kv_cache_groups", "[]", "at least one group")
	}
	for i, g := range f.KVCacheGroups {
		if g.TokensPerBlock <= 0 {
			return bad(fmt.Sprintf("kv_cache_groups[%d].tokens_per_block", i), g.TokensPerBlock, "a positive number of tokens")
		}
		if len(g.LayerNames) == 0 {
			return bad(fmt.Sprintf("kv_cache_groups[%d].layer_names", i), "[]", "the group's layer names")
		}
	}
	return nil
}

// Map returns the fields as the tier's JSON object.
func (f Fields) Map() map[string]any {
	groups := make([]any, len(f.KVCacheGroups))
	for i, g := range f.KVCacheGroups {
		groups[i] = map[string]any{"tokens_per_block": g.TokensPerBlock, "layer_names": slices.Clone(g.LayerNames)}
	}
	engine := f.InferenceEngine
	if engine == "" {
		engine = "vllm"
	}
	m := map[string]any{
		"model_name": f.ModelName, "tokens_per_hash": f.TokensPerHash, "blocks_per_file": f.BlocksPerFile,
		"tp_size": f.TPSize, "pp_size": f.PPSize, "pcp_size": f.PCPSize, "dcp_size": f.DCPSize,
		"dtype": f.Dtype, "kv_cache_groups": groups, "inference_engine": engine,
	}
	if f.NotParallelAgnostic {
		m["parallel_agnostic"] = false
	}
	if f.ReplicatedLayout {
		m["replicated_layout"] = true
	}
	if f.CanonicalFormat != "" {
		m["canonical_format"] = f.CanonicalFormat
	}
	if f.StorageFormat != "" {
		m["storage_format"] = f.StorageFormat
	}
	return m
}

// Config is one base directory's fields as a JSON object: built from
// Fields, or read from a config.json (then it keeps every field the file
// has, known or not, so that its hash is the directory's).
type Config struct {
	m map[string]any
}

// FromFields returns the Config of f, which must be valid.
func FromFields(f Fields) (Config, error) {
	if err := f.Validate(); err != nil {
		return Config{}, err
	}
	return Config{m: f.Map()}, nil
}

// ParseConfig reads a config.json: a JSON object with a non-empty string
// model_name. Numbers keep their text.
func ParseConfig(data []byte) (Config, error) {
	d := json.NewDecoder(bytes.NewReader(data))
	d.UseNumber()
	var m map[string]any
	if err := d.Decode(&m); err != nil {
		return Config{}, fmt.Errorf("%w: config.json: %w", ErrConfig, err)
	}
	if d.More() {
		return Config{}, fmt.Errorf("%w: config.json: data after the object", ErrConfig)
	}
	if name, _ := m["model_name"].(string); name == "" {
		return Config{}, fmt.Errorf("%w: config.json: no model_name string", ErrConfig)
	}
	return Config{m: m}, nil
}

// ModelName is the model_name field.
func (c Config) ModelName() string { name, _ := c.m["model_name"].(string); return name }

// Int returns a whole-number field, and whether it is one.
func (c Config) Int(field string) (int64, bool) {
	switch v := c.m[field].(type) {
	case json.Number:
		n, err := v.Int64()
		return n, err == nil
	case int:
		return int64(v), true
	}
	return 0, false
}

// Compact is the fields' JSON as the tier hashes it.
func (c Config) Compact() []byte {
	b, err := encodeCompact(nil, c.m)
	if err != nil {
		panic(err) // only values of the types above are ever stored
	}
	return b
}

// JSON is config.json's content, as the tier writes it (indent 2, sorted
// keys, no final newline).
func (c Config) JSON() []byte {
	b, err := encodeIndent(nil, c.m)
	if err != nil {
		panic(err)
	}
	return b
}

// Hash is the first HashLen hex digits of the sha256 of Compact.
func (c Config) Hash() string {
	sum := sha256.Sum256(c.Compact())
	return hex.EncodeToString(sum[:])[:HashLen]
}

// Base is the base directory's name: the model name with '/' replaced by
// '_', '_', and Hash.
func (c Config) Base() string {
	return strings.ReplaceAll(c.ModelName(), "/", "_") + "_" + c.Hash()
}

// Diff names the fields whose values differ between c and d (or that one
// of them lacks), sorted, each with both values: empty when they are the
// same fields.
func (c Config) Diff(d Config) []string {
	var out []string
	keys := map[string]bool{}
	for k := range c.m {
		keys[k] = true
	}
	for k := range d.m {
		keys[k] = true
	}
	show := func(m map[string]any, k string) string {
		v, ok := m[k]
		if !ok {
			return "(absent)"
		}
		b, err := encodeCompact(nil, v)
		if err != nil {
			return fmt.Sprintf("%v", v)
		}
		if len(b) > 120 {
			return string(b[:117]) + "..."
		}
		return string(b)
	}
	for k := range keys {
		a, b := show(c.m, k), show(d.m, k)
		if a != b {
			out = append(out, fmt.Sprintf("%s: %s, not %s", k, a, b))
		}
	}
	slices.Sort(out)
	return out
}

// Layout names the row files of one base directory at one rank.
type Layout struct {
	base string
	rank int
}

// NewLayout returns the layout of config c at rank (0 for the tier).
func NewLayout(c Config, rank int) (Layout, error) {
	if rank < 0 {
		return Layout{}, fmt.Errorf("%w: rank %d: want >= 0", ErrConfig, rank)
	}
	return Layout{base: c.Base(), rank: rank}, nil
}

// Base is the base directory's name (relative to the root).
func (l Layout) Base() string { return l.base }

// DataDir is the data directory's name (relative to the root):
// <base>_r<rank>.
func (l Layout) DataDir() string { return l.base + "_r" + strconv.Itoa(l.rank) }

// Path is the file of key, relative to the root (slash-separated).
func (l Layout) Path(key []byte) (string, error) {
	if len(key) < MinKeyLen {
		return "", fmt.Errorf("%w: key of %d bytes: want at least %d (a block hash and a 4-byte group)", ErrKey, len(key), MinKeyLen)
	}
	h := hex.EncodeToString(key[:len(key)-GroupLen])
	g := binary.BigEndian.Uint32(key[len(key)-GroupLen:])
	return l.DataDir() + "/" + h[:3] + "/" + h[3:5] + "_g" + strconv.FormatUint(uint64(g), 10) + "/" + h + ".bin", nil
}

// Key returns the key whose file is rel (relative to the root,
// slash-separated), or an error wrapping ErrKey if rel is not a row file of
// the layout (another directory, a temporary file, a name the layout would
// not write).
func (l Layout) Key(rel string) ([]byte, error) {
	no := func(why string) ([]byte, error) { return nil, fmt.Errorf("%w: %s: %s", ErrKey, rel, why) }
	parts := strings.Split(rel, "/")
	if len(parts) != 4 || parts[0] != l.DataDir() {
		return no("not <data dir>/<3 hex>/<2 hex>_g<group>/<hex>.bin")
	}
	h, ok := strings.CutSuffix(parts[3], ".bin")
	if !ok || len(h) < 2*(MinKeyLen-GroupLen) || len(h)%2 != 0 {
		return no("not <hex>.bin")
	}
	hash, err := hex.DecodeString(h)
	if err != nil || hex.EncodeToString(hash) != h { // lower case only
		return no("not lower-case hex")
	}
	sub, gs, ok := strings.Cut(parts[2], "_g")
	if !ok || parts[1] != h[:3] || sub != h[3:5] {
		return no("directories do not match the hash")
	}
	g, err := strconv.ParseUint(gs, 10, 32)
	if err != nil || strconv.FormatUint(g, 10) != gs {
		return no("group is not a decimal index")
	}
	key := binary.BigEndian.AppendUint32(hash, uint32(g))
	if want, _ := l.Path(key); want != path.Clean(rel) {
		return no("not the layout's name for its key")
	}
	return key, nil
}

// FileLen is the length of a row file holding a row of rowBytes: the row
// padded to Align.
func FileLen(rowBytes int64) int64 { return (rowBytes + Align - 1) / Align * Align }
