package vllmfs

import (
	"encoding/hex"
	"errors"
	"strings"
	"testing"
)

// llama are the fields of a Llama-3.1-8B fs tier at TP 1, not parallel
// agnostic. The expected bytes and hashes below were produced by CPython
// 3's json and hashlib modules (json.dumps(f, sort_keys=True,
// separators=(",", ":")) and json.dumps(f, indent=2, sort_keys=True)), the
// calls the tier makes: an implementation independent of this package.
var llama = Fields{
	ModelName: "meta-llama/Llama-3.1-8B-Instruct", TokensPerHash: 16, BlocksPerFile: 1,
	TPSize: 1, PPSize: 1, PCPSize: 1, DCPSize: 1, Dtype: "bfloat16",
	KVCacheGroups:       []Group{{TokensPerBlock: 16, LayerNames: []string{"model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"}}},
	NotParallelAgnostic: true,
}

const (
	llamaCompact = `{"blocks_per_file":1,"dcp_size":1,"dtype":"bfloat16","inference_engine":"vllm","kv_cache_groups":[{"layer_names":["model.layers.0.self_attn.attn","model.layers.1.self_attn.attn"],"tokens_per_block":16}],"model_name":"meta-llama/Llama-3.1-8B-Instruct","parallel_agnostic":false,"pcp_size":1,"pp_size":1,"tokens_per_hash":16,"tp_size":1}`
	llamaHash    = "cbcc909a29ac"
	llamaJSON    = "{\n  \"blocks_per_file\": 1,\n  \"dcp_size\": 1,\n  \"dtype\": \"bfloat16\",\n  \"inference_engine\": \"vllm\",\n  \"kv_cache_groups\": [\n    {\n      \"layer_names\": [\n        \"model.layers.0.self_attn.attn\",\n        \"model.layers.1.self_attn.attn\"\n      ],\n      \"tokens_per_block\": 16\n    }\n  ],\n  \"model_name\": \"meta-llama/Llama-3.1-8B-Instruct\",\n  \"parallel_agnostic\": false,\n  \"pcp_size\": 1,\n  \"pp_size\": 1,\n  \"tokens_per_hash\": 16,\n  \"tp_size\": 1\n}"
)

func TestFieldsMatchPython(t *testing.T) {
	c, err := FromFields(llama)
	if err != nil {
		t.Fatal(err)
	}
	if got := string(c.Compact()); got != llamaCompact {
		t.Errorf("compact JSON:\n got %s\nwant %s", got, llamaCompact)
	}
	if got := c.Hash(); got != llamaHash {
		t.Errorf("hash %s, want %s", got, llamaHash)
	}
	if got := c.Base(); got != "meta-llama_Llama-3.1-8B-Instruct_"+llamaHash {
		t.Errorf("base %s", got)
	}
	if got := string(c.JSON()); got != llamaJSON {
		t.Errorf("config.json:\n got %q\nwant %q", got, llamaJSON)
	}
	// Read back, the file gives the same hash and no difference.
	back, err := ParseConfig(c.JSON())
	if err != nil {
		t.Fatal(err)
	}
	if back.Hash() != llamaHash || len(back.Diff(c)) != 0 || string(back.JSON()) != llamaJSON {
		t.Errorf("parsed config: hash %s, diff %v", back.Hash(), back.Diff(c))
	}
}

func TestStringEscapesMatchPython(t *testing.T) {
	// Non-ASCII, a character above U+FFFF, HTML characters (which Go's
	// encoding/json would escape and Python does not), DEL (which Python
	// escapes), quote, backslash, newline; empty list and object.
	src := "{\"model_name\": \"a/b\\u00e9\\ud83d\\ude00<&>\\u007f\\\"\\\\\\n\", \"tokens_per_hash\": 16, \"x\": [], \"y\": {}}"
	c, err := ParseConfig([]byte(src))
	if err != nil {
		t.Fatal(err)
	}
	const wantCompact = `{"model_name":"a/b\u00e9\ud83d\ude00<&>\u007f\"\\\n","tokens_per_hash":16,"x":[],"y":{}}`
	const wantIndent = "{\n  \"model_name\": \"a/b\\u00e9\\ud83d\\ude00<&>\\u007f\\\"\\\\\\n\",\n  \"tokens_per_hash\": 16,\n  \"x\": [],\n  \"y\": {}\n}"
	if got := string(c.Compact()); got != wantCompact {
		t.Errorf("compact:\n got %s\nwant %s", got, wantCompact)
	}
	if got := c.Hash(); got != "1ef86987b491" {
		t.Errorf("hash %s, want 1ef86987b491", got)
	}
	if got := string(c.JSON()); got != wantIndent {
		t.Errorf("indent:\n got %q\nwant %q", got, wantIndent)
	}
}

func TestDiffNamesFields(t *testing.T) {
	a, _ := FromFields(llama)
	other := llama
	other.TPSize = 2
	other.NotParallelAgnostic = false
	b, _ := FromFields(other)
	d := a.Diff(b)
	want := []string{"parallel_agnostic: false, not (absent)", "tp_size: 1, not 2"}
	if strings.Join(d, "|") != strings.Join(want, "|") {
		t.Errorf("diff %q, want %q", d, want)
	}
	if a.Hash() == b.Hash() {
		t.Error("different fields, same hash")
	}
}

func TestPathAndKeyRoundTrip(t *testing.T) {
	c, _ := FromFields(llama)
	l, err := NewLayout(c, 0)
	if err != nil {
		t.Fatal(err)
	}
	hash, _ := hex.DecodeString("0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9")
	key := append(hash, 0, 0, 1, 2) // group 258
	p, err := l.Path(key)
	if err != nil {
		t.Fatal(err)
	}
	want := "meta-llama_Llama-3.1-8B-Instruct_" + llamaHash + "_r0/0a1/b2_g258/0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9.bin"
	if p != want {
		t.Errorf("path\n got %s\nwant %s", p, want)
	}
	k, err := l.Key(p)
	if err != nil || string(k) != string(key) {
		t.Errorf("key of %s: %x, %v", p, k, err)
	}
}

func TestKeyRefusesOtherNames(t *testing.T) {
	c, _ := FromFields(llama)
	l, _ := NewLayout(c, 0)
	d := l.DataDir()
	for _, tc := range []struct{ name, rel string }{
		{"config.json", l.Base() + "/config.json"},
		{"other rank", l.Base() + "_r1/0a1/b2_g0/0a1b2c.bin"},
		{"vLLM temporary file", d + "/0a1/b2_g0/0a1b2c.bin_6180339887498948482.tmp"},
		{"upper-case hex", d + "/0A1/B2_g0/0A1B2C.bin"},
		{"wrong first directory", d + "/0a2/b2_g0/0a1b2c.bin"},
		{"wrong second directory", d + "/0a1/b3_g0/0a1b2c.bin"},
		{"group with leading zero", d + "/0a1/b2_g01/0a1b2c.bin"},
		{"group above uint32", d + "/0a1/b2_g4294967296/0a1b2c.bin"},
		{"odd hex", d + "/0a1/b2_g0/0a1b2.bin"},
		{"too deep", d + "/0a1/b2_g0/x/0a1b2c.bin"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if k, err := l.Key(tc.rel); !errors.Is(err, ErrKey) {
				t.Errorf("Key(%s) = %x, %v: want ErrKey", tc.rel, k, err)
			}
		})
	}
	if _, err := l.Path([]byte{1, 2, 0, 0, 0, 0}); !errors.Is(err, ErrKey) {
		t.Errorf("Path of a 6-byte key: %v, want ErrKey", err)
	}
}

func TestValidateNamesField(t *testing.T) {
	for _, tc := range []struct {
		field string
		mod   func(*Fields)
	}{
		{"model_name", func(f *Fields) { f.ModelName = "" }},
		{"tokens_per_hash", func(f *Fields) { f.TokensPerHash = 0 }},
		{"blocks_per_file", func(f *Fields) { f.BlocksPerFile = 0 }},
		{"tp_size", func(f *Fields) { f.TPSize = 0 }},
		{"dtype", func(f *Fields) { f.Dtype = "" }},
		{"kv_cache_groups", func(f *Fields) { f.KVCacheGroups = nil }},
		{"kv_cache_groups[0].layer_names", func(f *Fields) { f.KVCacheGroups = []Group{{TokensPerBlock: 16}} }},
	} {
		f := llama
		tc.mod(&f)
		err := f.Validate()
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("%s: %v", tc.field, err)
		}
	}
}

func TestParseConfigRefusesBadFiles(t *testing.T) {
	for _, src := range []string{``, `[]`, `{"tp_size": 1}`, `{"model_name": ""}`, `{"model_name": "m"} {}`} {
		if _, err := ParseConfig([]byte(src)); !errors.Is(err, ErrConfig) {
			t.Errorf("ParseConfig(%q): %v, want ErrConfig", src, err)
		}
	}
}

func TestFileLenPadsTo4KiB(t *testing.T) {
	for _, tc := range []struct{ row, want int64 }{{1, 4096}, {4096, 4096}, {4097, 8192}, {64 << 10, 64 << 10}} {
		if got := FileLen(tc.row); got != tc.want {
			t.Errorf("FileLen(%d) = %d, want %d", tc.row, got, tc.want)
		}
	}
}
