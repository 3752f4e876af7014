//go:build invariants

package engine

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/internal/clustercap"
	"github.com/kvhost/kvhost/internal/vllmfs"
)

// fsTier is our own reimplementation of vLLM's fs tier on disk, written
// from the layout described in docs/format.md ("The vllm-fs layout") and independent of
// the engine and of package vllmfs: it builds the JSON texts by hand for one
// shape of fields (one KV-cache group), names files, and writes and reads
// rows as the tier does (the row padded to 4 KiB, written to
// <path><vllmTmpSuffix> and renamed).
type fsTier struct {
	root     string
	model    string
	tp       int
	layers   []string
	rowBytes int
}

// vllmTmpSuffix ends the temporary name of a row vLLM's fs tier is
// writing: tiering/fs/io.py names it <path>_<a random int of its
// thread>.tmp and renames it to <path> once written.
const vllmTmpSuffix = "_6180339887498948482.tmp"

func (f fsTier) quoted(s []string) []string {
	out := make([]string, len(s))
	for i, x := range s {
		out[i] = strconv.Quote(x) // ASCII names: Python's quoting
	}
	return out
}

// compact is json.dumps(fields, sort_keys=True, separators=(",", ":")).
func (f fsTier) compact() string {
	return `{"blocks_per_file":1,"dcp_size":1,"dtype":"bfloat16","inference_engine":"vllm","kv_cache_groups":[{"layer_names":[` +
		strings.Join(f.quoted(f.layers), ",") + `],"tokens_per_block":16}],"model_name":` + strconv.Quote(f.model) +
		`,"parallel_agnostic":false,"pcp_size":1,"pp_size":1,"tokens_per_hash":16,"tp_size":` + strconv.Itoa(f.tp) + `}`
}

// configJSON is json.dump(fields, f, indent=2, sort_keys=True).
func (f fsTier) configJSON() string {
	names := f.quoted(f.layers)
	return "{\n  \"blocks_per_file\": 1,\n  \"dcp_size\": 1,\n  \"dtype\": \"bfloat16\",\n  \"inference_engine\": \"vllm\",\n" +
		"  \"kv_cache_groups\": [\n    {\n      \"layer_names\": [\n        " + strings.Join(names, ",\n        ") +
		"\n      ],\n      \"tokens_per_block\": 16\n    }\n  ],\n  \"model_name\": " + strconv.Quote(f.model) +
		",\n  \"parallel_agnostic\": false,\n  \"pcp_size\": 1,\n  \"pp_size\": 1,\n  \"tokens_per_hash\": 16,\n  \"tp_size\": " + strconv.Itoa(f.tp) + "\n}"
}

// fields are the same fields for the engine's configuration.
func (f fsTier) fields() *vllmfs.Fields {
	return &vllmfs.Fields{
		ModelName: f.model, TokensPerHash: 16, BlocksPerFile: 1, TPSize: f.tp, PPSize: 1, PCPSize: 1, DCPSize: 1,
		Dtype: "bfloat16", KVCacheGroups: []vllmfs.Group{{TokensPerBlock: 16, LayerNames: f.layers}}, NotParallelAgnostic: true,
	}
}

func (f fsTier) base() string {
	sum := sha256.Sum256([]byte(f.compact()))
	return filepath.Join(f.root, strings.ReplaceAll(f.model, "/", "_")+"_"+hex.EncodeToString(sum[:])[:12])
}

func (f fsTier) path(key []byte) string {
	h := hex.EncodeToString(key[:len(key)-4])
	g := binary.BigEndian.Uint32(key[len(key)-4:])
	return fmt.Sprintf("%s_r0/%s/%s_g%d/%s.bin", f.base(), h[:3], h[3:5], g, h)
}

func (f fsTier) fileLen() int { return (f.rowBytes + 4095) / 4096 * 4096 }

// init writes config.json as the tier does (only if absent).
func (f fsTier) init(t testing.TB) {
	t.Helper()
	if err := os.MkdirAll(f.base(), 0o755); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(f.base(), "config.json")
	if _, err := os.Stat(p); err == nil {
		return
	}
	if err := os.WriteFile(p, []byte(f.configJSON()), 0o644); err != nil {
		t.Fatal(err)
	}
}

// store writes row (rowBytes long) as key's file.
func (f fsTier) store(t testing.TB, key, row []byte) {
	t.Helper()
	p := f.path(key)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, f.fileLen())
	copy(buf, row)
	if err := os.WriteFile(p+vllmTmpSuffix, buf, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(p+vllmTmpSuffix, p); err != nil {
		t.Fatal(err)
	}
}

// tear leaves key's file n bytes long (0: empty), as a power loss can
// leave a row the tier renamed without fsync.
func (f fsTier) tear(t testing.TB, key []byte, n int) {
	t.Helper()
	p := f.path(key)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, make([]byte, n), 0o644); err != nil {
		t.Fatal(err)
	}
}

// load reads key's row as the tier does (rowBytes from offset 0), or nil.
func (f fsTier) load(t testing.TB, key []byte) []byte {
	t.Helper()
	b, err := os.ReadFile(f.path(key))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return b[:min(len(b), f.rowBytes)]
}

// tierKeys returns n OffloadKeys: a 32-byte block hash and a big-endian
// group index (group i%3, so several group directories are used).
func tierKeys(seed uint64, n int) [][]byte {
	r := rand.New(rand.NewPCG(seed, 9))
	keys := make([][]byte, n)
	for i := range keys {
		k := make([]byte, 36)
		for j := 0; j < 32; j += 8 {
			binary.LittleEndian.PutUint64(k[j:], r.Uint64())
		}
		binary.BigEndian.PutUint32(k[32:], uint32(i%3))
		keys[i] = k
	}
	return keys
}

// rowGeometry is the vLLM tier's namespace of rows of n bytes (one layer,
// one plane, one block: the row; client/python kvhost.vllm declares it
// this way).
func rowGeometry(model string, n int) Geometry {
	head := 1
	for n%(head*2) == 0 && head*2 <= 4096 {
		head *= 2
	}
	return Geometry{Model: model, Layers: 1, KVHeads: n / head, HeadSize: head, DtypeSize: 1, MLA: true, TokensPerBlock: 1, TokensPerKey: 1, TPSize: 1}
}

func randomRow(r *rand.Rand, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

const tierModel = "vllm:meta-llama_Llama-3.1-8B:test"

func newFSTier(root string, rowBytes int) fsTier {
	return fsTier{root: root, model: "meta-llama/Llama-3.1-8B", tp: 1, rowBytes: rowBytes,
		layers: []string{"model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"}}
}

// TestVLLMFSAdoptsServesEvicts adopts a directory written by our fs-tier
// reimplementation (with configured fields, and by adoption of its
// config.json), serves its rows byte for byte, and evicts within capacity,
// the policy choosing the victims: the oldest rows go, from the disk.
func TestVLLMFSAdoptsServesEvicts(t *testing.T) {
	for _, tc := range []struct {
		name  string
		row   int
		adopt bool
	}{
		{"aligned rows, configured fields", 12288, false},
		{"unaligned rows, adopted config.json", 5000, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			root := t.TempDir()
			tier := newFSTier(root, tc.row)
			tier.init(t)
			r := rand.New(rand.NewPCG(1, 2))
			const n = 12
			old := tierKeys(1, n)
			rows := make([][]byte, n)
			for i, k := range old {
				rows[i] = randomRow(r, tc.row)
				tier.store(t, k, rows[i])
				// Distinct mtimes: the policy ranks restored rows by them.
				at := time.Now().Add(time.Duration(i-100) * time.Second)
				os.Chtimes(tier.path(k), at, at)
			}
			// A vLLM temporary file left by a crash: not a row, left alone.
			stray := tier.path(old[0]) + vllmTmpSuffix
			os.WriteFile(stray, []byte("torn"), 0o644)

			v := &VLLMFS{Namespace: tierModel}
			if !tc.adopt {
				v.Fields, v.RowBytes = tier.fields(), int64(tc.row)
			}
			capacity := int64(16 * tier.fileLen())
			pol := newTestPolicy(4, abi.OrderBlockMajor) // its layout is not used on the mount
			e := openEngine(t, Config{Mounts: []Mount{{Path: root, Capacity: capacity, HighWatermark: 1, LowWatermark: 0.75, VLLMFS: v}}, Policy: pol})
			st := e.Stats()
			if st.Entries != n || st.Mounts[0].Layout != LayoutVLLMFS || st.Mounts[0].Base != filepath.Base(tier.base()) || st.Mounts[0].Checksums {
				t.Fatalf("after open: %d entries, mount %+v", st.Entries, st.Mounts[0])
			}
			ns, err := e.Declare(ctx, rowGeometry(tierModel, tc.row))
			if err != nil {
				t.Fatal(err)
			}
			if got, err := e.Lookup(ctx, ns, old); err != nil || got != n {
				t.Fatalf("lookup: %d of %d, %v", got, n, err)
			}
			c := newTestCache(t, e, ns, rowGeometry(tierModel, tc.row), 32, layoutPlaneFirst)
			into := make([][]int, n)
			for i := range into {
				into[i] = []int{i}
			}
			loadAndCompare(t, e, c, old, into, rows)

			// 8 new rows: 20 do not fit in 16; the 4 oldest of the
			// adopted rows, which the policy ranks first, are evicted
			// down to the low watermark (12 files).
			fresh := tierKeys(2, 8)
			blocks := make([][]int, len(fresh))
			want := make([][]byte, len(fresh))
			for i := range fresh {
				blocks[i] = []int{16 + i}
				c.fill(r, blocks[i])
				want[i] = c.data(blocks[i])
			}
			storeAndCheck(t, e, c, fresh, blocks)
			st = e.Stats()
			if st.Evictions == 0 || st.Mounts[0].Used > capacity {
				t.Fatalf("no eviction within capacity: %+v", st.Mounts[0])
			}
			t.Logf("evictions %d, used %d of %d, entries %d", st.Evictions, st.Mounts[0].Used, capacity, st.Entries)
			if files := rowFiles(t, root); len(files) != st.Entries {
				t.Fatalf("%d row files on disk, %d indexed", len(files), st.Entries)
			}
			for i, k := range old {
				got := tier.load(t, k)
				switch {
				case i < int(st.Evictions) && got != nil:
					t.Errorf("old row %d (among the oldest) still on disk after %d evictions", i, st.Evictions)
				case i >= int(st.Evictions) && !bytes.Equal(got, rows[i]):
					t.Errorf("old row %d: changed or gone", i)
				}
			}
			// The fs tier reads what kvhost wrote, byte for byte.
			for i, k := range fresh {
				if got := tier.load(t, k); !bytes.Equal(got, want[i]) {
					t.Errorf("fresh row %d: the tier reads other bytes", i)
				}
			}
			if _, err := os.Stat(stray); err != nil {
				t.Errorf("vLLM's temporary file was touched: %v", err)
			}
		})
	}
}

// TestVLLMFSAdoptsModelOfRelativePath: vLLM names the base directory of a
// model given as a relative path with its '/' replaced, so it starts with
// '.' ("._models_llama_<hash>" for "./models/llama"). Such a directory is
// adopted and its rows indexed, and another geometry of the model beside
// it is refused, while the host's own dot names under the root (a
// temporary file, the cluster directory) are still not taken for base
// directories.
func TestVLLMFSAdoptsModelOfRelativePath(t *testing.T) {
	ctx := context.Background()
	for _, model := range []string{"./models/llama", "../llama"} {
		t.Run(model, func(t *testing.T) {
			root := t.TempDir()
			tier := newFSTier(root, 8192)
			tier.model = model
			if base := filepath.Base(tier.base()); !strings.HasPrefix(base, ".") {
				t.Fatalf("base directory %s does not start with '.'", base)
			}
			tier.init(t)
			keys := tierKeys(1, 3)
			for _, k := range keys {
				tier.store(t, k, make([]byte, 8192))
			}
			os.WriteFile(filepath.Join(root, tmpPrefix+"x"), nil, 0o644)
			os.Mkdir(filepath.Join(root, clustercap.DirName), 0o755)

			e := openEngine(t, Config{Mounts: []Mount{{Path: root, VLLMFS: &VLLMFS{Namespace: tierModel}}}, Policy: newTestPolicy(1, abi.OrderBlockMajor)})
			if st := e.Stats(); st.Entries != len(keys) || st.Mounts[0].Base != filepath.Base(tier.base()) {
				t.Fatalf("adopted: %d entries, mount %+v", st.Entries, st.Mounts[0])
			}
			g := rowGeometry(tierModel, 8192)
			ns, err := e.Declare(ctx, g)
			if err != nil {
				t.Fatal(err)
			}
			if got, err := e.Lookup(ctx, ns, keys); err != nil || got != len(keys) {
				t.Fatalf("lookup: %d of %d, %v", got, len(keys), err)
			}
			c := newTestCache(t, e, ns, g, 1, layoutPlaneFirst)
			c.fill(rand.New(rand.NewPCG(1, 2)), []int{0})
			fresh := tierKeys(2, 1)
			storeAndCheck(t, e, c, fresh, [][]int{{0}})
			if got := tier.load(t, fresh[0]); !bytes.Equal(got, c.data([]int{0})) {
				t.Fatal("the stored row is not in the tier's layout")
			}
			e.Close(ctx)

			other := tier
			other.tp = 2
			_, err = testOpen(ctx, Config{Mounts: []Mount{{Path: root, VLLMFS: &VLLMFS{Fields: other.fields()}}}, Policy: newTestPolicy(1, abi.OrderBlockMajor), Logger: testLogger(t)})
			if !errors.Is(err, vllmfs.ErrMismatch) || !strings.Contains(err.Error(), "tp_size: 1, not 2") {
				t.Fatalf("open with another geometry of the model: %v", err)
			}
		})
	}
}

// TestVLLMFSDefaultNamespaceOfLongModelName: vLLM names a model given by
// a long local path (a Hugging Face cache snapshot) by that path, so the
// base directory's name can be longer than a model id may be. The
// default namespace then keeps the directory's hash and the start of the
// model's name, cut on a character boundary to fit, and the rows vLLM
// wrote are served under it.
func TestVLLMFSDefaultNamespaceOfLongModelName(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name, model string
		adopt       bool // the directory vLLM wrote, or the fields configured
	}{
		{"snapshot path adopted", "/root/.cache/huggingface/hub/models--meta-llama--Llama-3.1-8B-Instruct/snapshots/0e9e39f249a16976918f6564b8830bc894c89659", true},
		// fsTier quotes ASCII only: the engine writes this one.
		{"cut inside a character", "/models/" + strings.Repeat("é", 60), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			tier := newFSTier(root, 8192)
			tier.model = tc.model
			keys := tierKeys(1, 3)
			v := &VLLMFS{Fields: tier.fields()}
			if tc.adopt {
				tier.init(t)
				for _, k := range keys {
					tier.store(t, k, make([]byte, 8192))
				}
				v = &VLLMFS{}
			}
			e := openEngine(t, Config{Mounts: []Mount{{Path: root, VLLMFS: v}}, Policy: newTestPolicy(1, abi.OrderBlockMajor)})
			base := e.Stats().Mounts[0].Base
			if len(ModelPrefix+base) <= abi.MaxModelLen {
				t.Fatalf("base directory %s is short enough for a model id: not the case tested", base)
			}
			ns := e.Stats().Mounts[0].Namespace
			if len(ns) > abi.MaxModelLen || !utf8.ValidString(ns) || !strings.HasPrefix(ns, ModelPrefix+base[:20]) || !strings.HasSuffix(ns, base[len(base)-1-vllmfs.HashLen:]) {
				t.Fatalf("default namespace %q (%d bytes) of base directory %s: want at most %d bytes of valid UTF-8, the model name's start and the hash", ns, len(ns), base, abi.MaxModelLen)
			}
			g := rowGeometry(ns, 8192)
			id, err := e.Declare(ctx, g)
			if err != nil {
				t.Fatal(err)
			}
			if !tc.adopt {
				c := newTestCache(t, e, id, g, 1, layoutPlaneFirst)
				c.fill(rand.New(rand.NewPCG(1, 2)), []int{0})
				storeAndCheck(t, e, c, keys, [][]int{{0}, {0}, {0}})
			}
			if got, err := e.Lookup(ctx, id, keys); err != nil || got != len(keys) {
				t.Fatalf("lookup: %d of %d, %v", got, len(keys), err)
			}
		})
	}
}

// TestVLLMFSLayoutFingerprintIsPinned: a client checks the Declared
// fingerprint of its namespace against this one to tell which data
// directory serves it (kvhost.vllm refuses another model's): it must
// never change.
func TestVLLMFSLayoutFingerprintIsPinned(t *testing.T) {
	const dir, model = "meta-llama_Llama-3.1-8B_0123456789ab_r0", "vllm-fs:meta-llama_Llama-3.1-8B_0123456789ab"
	if fp := layoutFingerprint(dir, model); fp != 0xef4cd9c8a3d9e9e7 {
		t.Fatalf("layout fingerprint 0x%016x changed", fp)
	}
	if layoutFingerprint(dir, model+"x") == layoutFingerprint(dir, model) || layoutFingerprint(dir+"x", model) == layoutFingerprint(dir, model) {
		t.Fatal("the layout fingerprint ignores the model id or the data directory")
	}
}

// rowFiles lists the .bin files under root.
func rowFiles(t testing.TB, root string) []string {
	var out []string
	for _, p := range dataFiles(t, root) {
		if strings.HasSuffix(p, ".bin") {
			out = append(out, p)
		}
	}
	return out
}

// TestVLLMFSWritesTierLayout starts on an empty root: config.json is the
// tier's byte for byte, and every file kvhost stores has the tier's name
// and length (the row, zero-padded to 4 KiB), with no other file left.
func TestVLLMFSWritesTierLayout(t *testing.T) {
	for _, row := range []int{8192, 5000} {
		t.Run(strconv.Itoa(row), func(t *testing.T) {
			ctx := context.Background()
			root := t.TempDir()
			tier := newFSTier(root, row)
			e := openEngine(t, Config{Mounts: []Mount{{Path: root, VLLMFS: &VLLMFS{Fields: tier.fields(), Namespace: tierModel}}}, Policy: newTestPolicy(4, abi.OrderBlockMajor)})
			got, err := os.ReadFile(filepath.Join(tier.base(), "config.json"))
			if err != nil || string(got) != tier.configJSON() {
				t.Fatalf("config.json (%v):\n%s\nwant\n%s", err, got, tier.configJSON())
			}
			g := rowGeometry(tierModel, row)
			ns, err := e.Declare(ctx, g)
			if err != nil {
				t.Fatal(err)
			}
			c := newTestCache(t, e, ns, g, 8, layoutPlaneFirst)
			keys := tierKeys(3, 6)
			blocks := make([][]int, len(keys))
			r := rand.New(rand.NewPCG(5, 6))
			for i := range keys {
				blocks[i] = []int{i}
				c.fill(r, blocks[i])
			}
			storeAndCheck(t, e, c, keys, blocks)
			var want []string
			for i, k := range keys {
				want = append(want, tier.path(k))
				b, err := os.ReadFile(tier.path(k))
				if err != nil {
					t.Fatal(err)
				}
				if len(b) != tier.fileLen() {
					t.Errorf("key %d: %d bytes, want %d", i, len(b), tier.fileLen())
				}
				if !bytes.Equal(b[:row], c.data(blocks[i])) || bytes.Count(b[row:], []byte{0}) != len(b)-row {
					t.Errorf("key %d: the file is not the row followed by zeros", i)
				}
			}
			files := append(rowFiles(t, root), filepath.Join(tier.base(), "config.json"))
			if len(files) != len(keys)+1 || len(leftovers(t, root)) != 0 {
				t.Fatalf("files %v, leftovers %v", files, leftovers(t, root))
			}
			for _, p := range want {
				if _, err := os.Stat(p); err != nil {
					t.Errorf("%s: %v", p, err)
				}
			}
			// A restart indexes them again.
			e.Close(ctx)
			e2 := openEngine(t, Config{Mounts: []Mount{{Path: root, VLLMFS: &VLLMFS{Namespace: tierModel}}}, Policy: newTestPolicy(1, abi.OrderBlockMajor)})
			if st := e2.Stats(); st.Entries != len(keys) {
				t.Fatalf("after restart: %d entries", st.Entries)
			}
		})
	}
}

// TestVLLMFSRefusesMismatch: a root holding another geometry of the model
// (another tp_size), an edited config.json, a namespace of another row
// size or shape, and files of another length are refused, naming what
// differs, and nothing on disk changes.
func TestVLLMFSRefusesMismatch(t *testing.T) {
	ctx := context.Background()
	pol := func() *testPolicy { return newTestPolicy(1, abi.OrderBlockMajor) }
	t.Run("other tp_size at start", func(t *testing.T) {
		root := t.TempDir()
		other := newFSTier(root, 8192)
		other.tp = 2
		other.init(t)
		other.store(t, tierKeys(1, 1)[0], make([]byte, 8192))
		tier := newFSTier(root, 8192)
		_, err := testOpen(ctx, Config{Mounts: []Mount{{Path: root, VLLMFS: &VLLMFS{Fields: tier.fields()}}}, Policy: pol(), Logger: testLogger(t)})
		if !errors.Is(err, ErrInvalid) || !errors.Is(err, vllmfs.ErrMismatch) || !strings.Contains(err.Error(), "tp_size: 2, not 1") {
			t.Fatalf("open: %v", err)
		}
		if _, err := os.Stat(tier.base()); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("a refused start created %s", tier.base())
		}
	})
	t.Run("config.json edited", func(t *testing.T) {
		root := t.TempDir()
		tier := newFSTier(root, 8192)
		tier.init(t)
		p := filepath.Join(tier.base(), "config.json")
		os.WriteFile(p, []byte(strings.Replace(tier.configJSON(), `"tp_size": 1`, `"tp_size": 4`, 1)), 0o644)
		for _, v := range []*VLLMFS{{Fields: tier.fields()}, {}} {
			_, err := testOpen(ctx, Config{Mounts: []Mount{{Path: root, VLLMFS: v}}, Policy: pol(), Logger: testLogger(t)})
			// Readable but edited: the error says it hashes to another
			// name, never that it was unreadable.
			if !errors.Is(err, ErrInvalid) || !errors.Is(err, vllmfs.ErrMismatch) ||
				!strings.Contains(err.Error(), "not to the directory's name (edited") || strings.Contains(err.Error(), "unreadable") {
				t.Fatalf("open (fields %v): %v", v.Fields != nil, err)
			}
		}
	})
	t.Run("nothing to adopt", func(t *testing.T) {
		_, err := testOpen(ctx, Config{Mounts: []Mount{{Path: t.TempDir(), VLLMFS: &VLLMFS{}}}, Policy: pol(), Logger: testLogger(t)})
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "configure the fields") {
			t.Fatalf("open: %v", err)
		}
	})
	t.Run("nothing to adopt but a config.json cut", func(t *testing.T) {
		// Without fields nothing says what it held: the error names it.
		root := t.TempDir()
		tier := newFSTier(root, 8192)
		tier.init(t)
		p := filepath.Join(tier.base(), "config.json")
		os.WriteFile(p, nil, 0o644)
		_, err := testOpen(ctx, Config{Mounts: []Mount{{Path: root, VLLMFS: &VLLMFS{}}}, Policy: pol(), Logger: testLogger(t)})
		if !errors.Is(err, ErrInvalid) || !errors.Is(err, vllmfs.ErrConfig) || !strings.Contains(err.Error(), "configure the fields") || !strings.Contains(err.Error(), p) {
			t.Fatalf("open: %v", err)
		}
	})
	t.Run("namespace of another shape", func(t *testing.T) {
		root := t.TempDir()
		tier := newFSTier(root, 8192)
		e := openEngine(t, Config{Mounts: []Mount{{Path: root, VLLMFS: &VLLMFS{Fields: tier.fields(), Namespace: tierModel, RowBytes: 8192}}}, Policy: pol()})
		for _, tc := range []struct {
			g    Geometry
			want string
		}{
			{rowGeometry(tierModel, 4096), "key bytes 4096, but the mount's rows are 8192"},
			{Geometry{Model: tierModel, Layers: 1, KVHeads: 2, HeadSize: 1024, DtypeSize: 2, TokensPerBlock: 1, TokensPerKey: 1, TPSize: 1}, "K/V geometry"},
			{func() Geometry { g := rowGeometry(tierModel, 8192); g.TPSize, g.TPRank = 2, 1; return g }(), "TP rank 1"},
		} {
			if _, err := e.Declare(ctx, tc.g); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("declare %+v: %v, want %q", tc.g, err, tc.want)
			}
		}
		if _, err := e.Declare(ctx, rowGeometry(tierModel, 8192)); err != nil {
			t.Fatal(err)
		}
		if _, err := e.Declare(ctx, rowGeometry(tierModel, 16384)); !errors.Is(err, ErrInvalid) {
			t.Errorf("a second geometry on the served namespace: %v", err)
		}
	})
	t.Run("base name of other fields", func(t *testing.T) {
		root := t.TempDir()
		tier := newFSTier(root, 8192)
		e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}, {Path: root, VLLMFS: &VLLMFS{Fields: tier.fields()}}}, Policy: pol()})
		// The default namespace is the base directory's name: a client
		// computing the fields as the tier does gets the mount.
		g := rowGeometry(ModelPrefix+filepath.Base(tier.base()), 8192)
		ns, err := e.Declare(ctx, g)
		if err != nil {
			t.Fatal(err)
		}
		c := newTestCache(t, e, ns, g, 1, layoutPlaneFirst)
		key := tierKeys(4, 1)[0]
		storeAndCheck(t, e, c, [][]byte{key}, [][]int{{0}})
		if got := tier.load(t, key); !bytes.Equal(got, c.data([]int{0})) {
			t.Fatal("the default namespace's row is not in the tier's layout")
		}
		other := tier
		other.tp = 2
		_, err = e.Declare(ctx, rowGeometry(ModelPrefix+filepath.Base(other.base()), 8192))
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "no vllm-fs mount serves it") {
			t.Fatalf("declare of another base: %v", err)
		}
	})
	// Rows of another length are another geometry, not rows cut short
	// (TestVLLMFSDropsRowsCutShortByACrash): no crash lengthens a row,
	// and rows all shorter than the declared one are all another's.
	for _, tc := range []struct {
		name     string
		files    []int // lengths of the files in the directory
		declared int
	}{
		{"files of another row length", []int{8192}, 16384},
		{"files of another row length beside an empty one", []int{8192, 0}, 16384},
		{"a file longer than the row beside rows", []int{8192, 8192, 16384}, 8192},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			tier := newFSTier(root, 8192)
			tier.init(t)
			keys := tierKeys(1, len(tc.files))
			for i, k := range keys {
				tier.tear(t, k, tc.files[i])
			}
			e := openEngine(t, Config{Mounts: []Mount{{Path: root, VLLMFS: &VLLMFS{Namespace: tierModel}}}, Policy: pol()})
			_, err := e.Declare(ctx, rowGeometry(tierModel, tc.declared))
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), fmt.Sprintf("not rows of %d bytes", tc.declared)) {
				t.Fatalf("declare: %v", err)
			}
			for i, k := range keys {
				if fi, err := os.Stat(tier.path(k)); err != nil || fi.Size() != int64(tc.files[i]) {
					t.Errorf("file %d was touched: %v", i, err)
				}
			}
		})
	}
}

// TestVLLMFSDropsRowsCutShortByACrash: rows shorter than the declared
// row (empty or cut, as a power loss leaves rows the tier renamed without
// fsync) do not stop the namespace's declaration: they are dropped from
// the index, counted corrupt and removed, as the tier removes a row it
// reads short, and a lookup or load of their keys is a miss, while the
// whole rows beside them are served. A short row found after the
// declaration is a miss too, never a failed load.
func TestVLLMFSDropsRowsCutShortByACrash(t *testing.T) {
	const row = 8192
	for _, tc := range []struct {
		name  string
		whole int
		torn  []int // the short rows' lengths
	}{
		{"beside whole rows", 3, []int{0, 4096}},
		{"only empty rows", 0, []int{0, 0}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			root := t.TempDir()
			tier := newFSTier(root, row)
			tier.init(t)
			keys := tierKeys(1, tc.whole+len(tc.torn)+1)
			whole, torn, later := keys[:tc.whole], keys[tc.whole:len(keys)-1], keys[len(keys)-1:]
			r := rand.New(rand.NewPCG(1, 2))
			rows := make([][]byte, len(whole))
			for i, k := range whole {
				rows[i] = randomRow(r, row)
				tier.store(t, k, rows[i])
			}
			for i, k := range torn {
				tier.tear(t, k, tc.torn[i])
			}
			e := openEngine(t, Config{Mounts: []Mount{{Path: root, VLLMFS: &VLLMFS{Namespace: tierModel}}}, Policy: newTestPolicy(1, abi.OrderBlockMajor)})
			g := rowGeometry(tierModel, row)
			ns, err := e.Declare(ctx, g)
			if err != nil {
				t.Fatal(err)
			}
			st := e.Stats()
			if st.Entries != len(whole) || st.Corrupt != uint64(len(torn)) || st.Mounts[0].Used != int64(len(whole)*tier.fileLen()) {
				t.Fatalf("after declare: %d entries, %d corrupt, %d bytes used: want %d, %d, %d", st.Entries, st.Corrupt, st.Mounts[0].Used, len(whole), len(torn), len(whole)*tier.fileLen())
			}
			for i, k := range torn {
				if _, err := os.Stat(tier.path(k)); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("short row %d (%d bytes) not removed: %v", i, tc.torn[i], err)
				}
			}
			if got, err := e.Lookup(ctx, ns, whole); err != nil || got != len(whole) {
				t.Fatalf("lookup of the whole rows: %d of %d, %v", got, len(whole), err)
			}
			c := newTestCache(t, e, ns, g, max(1, len(whole)), layoutPlaneFirst)
			into := make([][]int, len(whole))
			for i := range into {
				into[i] = []int{i}
			}
			loadAndCompare(t, e, c, whole, into, rows)
			// Cut short after the declaration: found by the lookup, not
			// indexed.
			tier.tear(t, later[0], 4096)
			for _, k := range append(torn, later...) {
				if got, err := e.Lookup(ctx, ns, [][]byte{k}); err != nil || got != 0 {
					t.Fatalf("lookup of a short row: %d, %v", got, err)
				}
				res := wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: [][]byte{k}, Blocks: [][]int{{0}}}))
				wantOutcomes(t, "load of a short row", res, OutcomeMissing)
			}
		})
	}
}

// TestVLLMFSStartsOverConfigCutByACrash: the tier writes config.json in
// place, without a temporary file, so a crash can leave it empty or cut.
// vLLM never reads it again, and kvhost starts too: the configured base
// directory's config.json is written anew as the tier writes it, and
// another base directory whose config.json does not parse is skipped
// with a warning naming the file (with fields configured, or beside the
// one adopted). Its rows are served either way.
func TestVLLMFSStartsOverConfigCutByACrash(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		config string // what a crash left of config.json
		other  bool   // in another base directory (else the configured one)
		adopt  bool   // no fields configured
	}{
		{"configured, empty", "", false, false},
		{"configured, cut", "{\n  \"blocks_per_file\": 1,\n  \"dcp", false, false},
		{"another beside the configured, empty", "", true, false},
		{"another beside the adopted, cut", "{\n", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			tier := newFSTier(root, 8192)
			tier.init(t)
			keys := tierKeys(1, 3)
			for _, k := range keys {
				tier.store(t, k, make([]byte, 8192))
			}
			cut := tier
			if tc.other {
				cut.tp = 2
				cut.init(t)
			}
			p := filepath.Join(cut.base(), "config.json")
			if err := os.WriteFile(p, []byte(tc.config), 0o644); err != nil {
				t.Fatal(err)
			}
			log, warned := countingLogger(t, "config.json")
			v := &VLLMFS{Namespace: tierModel}
			if !tc.adopt {
				v.Fields = tier.fields()
			}
			e, err := testOpen(ctx, Config{Mounts: []Mount{{Path: root, VLLMFS: v}}, Policy: newTestPolicy(1, abi.OrderBlockMajor), Logger: log})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close(ctx)
			got, err := os.ReadFile(filepath.Join(tier.base(), "config.json"))
			if err != nil || string(got) != tier.configJSON() {
				t.Errorf("the served base directory's config.json (%v):\n%s\nwant\n%s", err, got, tier.configJSON())
			}
			if tc.other {
				if got, _ := os.ReadFile(p); string(got) != tc.config || warned.Load() != 1 {
					t.Errorf("another base directory's config.json: now %q, %d warnings naming it", got, warned.Load())
				}
			}
			if l := leftovers(t, root); len(l) != 0 {
				t.Errorf("leftovers: %v", l)
			}
			ns, err := e.Declare(ctx, rowGeometry(tierModel, 8192))
			if err != nil {
				t.Fatal(err)
			}
			if got, err := e.Lookup(ctx, ns, keys); err != nil || got != len(keys) {
				t.Fatalf("lookup: %d of %d, %v", got, len(keys), err)
			}
		})
	}
}

// TestVLLMFSBesideKVHostMounts: other namespaces go to the kvhost mounts
// only (the policy sees only them), vllm-fs mounts must come last, and a
// policy naming a vllm-fs mount for another namespace is refused.
func TestVLLMFSBesideKVHostMounts(t *testing.T) {
	ctx := context.Background()
	kv, rootFS := t.TempDir(), t.TempDir()
	tier := newFSTier(rootFS, 8192)
	v := &VLLMFS{Fields: tier.fields(), Namespace: tierModel}
	if _, err := testOpen(ctx, Config{Mounts: []Mount{{Path: rootFS, VLLMFS: v}, {Path: kv}}, Policy: newTestPolicy(1, abi.OrderBlockMajor), Logger: testLogger(t)}); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "list vllm-fs mounts last") {
		t.Fatalf("vllm-fs mount first: %v", err)
	}
	e := openEngine(t, Config{Mounts: []Mount{{Path: kv}, {Path: rootFS, VLLMFS: v}}, Policy: newTestPolicy(1, abi.OrderBlockMajor)})
	g := smallGeometry(true)
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 64, layoutPlaneFirst)
	keys := testKeys("other", 8)
	blocks := blockLists(rand.New(rand.NewPCG(1, 1)), 8, g.BlocksPerKey(), 0)
	for _, b := range blocks {
		c.fill(rand.New(rand.NewPCG(2, 2)), b)
	}
	storeAndCheck(t, e, c, keys, blocks)
	if n := len(dataFiles(t, kv)); n != 8 {
		t.Fatalf("%d files on the kvhost mount, want 8", n)
	}
	if files := rowFiles(t, rootFS); len(files) != 0 {
		t.Fatalf("files of another namespace on the vllm-fs mount: %v", files)
	}
	rec := abi.NameRecord{Mount: 1}
	if _, _, err := e.nm.resolve(&rec); !errors.Is(err, ErrPolicy) {
		t.Fatalf("a policy naming the vllm-fs mount: %v", err)
	}
}

const vllmfsCrashEnv = "KVHOST_ENGINE_VLLMFS_CRASH_CHILD"

// vllmfsCrashRow is large, so that a kill often lands mid-file.
const vllmfsCrashRow = 2 << 20

// vllmfsCrashChild stores rows on a vllm-fs mount in a loop, each row's
// bytes derived from its key, printing each batch it saw stored, until it is
// killed.
func vllmfsCrashChild(root string) error {
	ctx := context.Background()
	tier := newFSTier(root, vllmfsCrashRow)
	e, err := testOpen(ctx, Config{Mounts: []Mount{{Path: root, VLLMFS: &VLLMFS{Fields: tier.fields(), Namespace: tierModel}}}, Policy: newTestPolicy(1, abi.OrderBlockMajor), IOWorkers: 2})
	if err != nil {
		return err
	}
	c, err := childCache(ctx, e, rowGeometry(tierModel, vllmfsCrashRow), 4)
	if err != nil {
		return err
	}
	for batch := 0; ; batch++ {
		keys := tierKeys(uint64(batch), 4)
		blocks := [][]int{{0}, {1}, {2}, {3}}
		for i, k := range keys {
			keyContent(c, k, blocks[i])
		}
		j, err := e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys, Blocks: blocks})
		if err != nil {
			return err
		}
		if res, err := j.Wait(ctx); err != nil || res.Err() != nil {
			return errors.Join(err, res.Err())
		}
		fmt.Printf("stored %d\n", batch)
	}
}

// TestVLLMFSCrashLeavesNoTornRow SIGKILLs a process storing rows on a
// vllm-fs mount: whatever the moment, no row file is torn (every .bin file
// is a whole row of the bytes its key was stored with), the temporary
// files are owned names the next Open removes, and every batch the child
// saw stored is served.
func TestVLLMFSCrashLeavesNoTornRow(t *testing.T) {
	root := t.TempDir()
	tier := newFSTier(root, vllmfsCrashRow)
	stored, midStore := -1, 0
	for round := 0; round < 10 && (round < 3 || midStore == 0); round++ {
		cmd, sc, stderr := startChild(t, vllmfsCrashEnv+"="+root)
		if scanStored(sc, &stored, 1) == 0 {
			cmd.Wait()
			t.Fatalf("child stored nothing: %s", stderr.String())
		}
		// Kill as soon as a store is writing a temporary file.
		awaitLeftover(t, root, 10*time.Second)
		cmd.Process.Signal(syscall.SIGKILL)
		scanStored(sc, &stored, -1)
		cmd.Wait()
		if len(leftovers(t, root)) > 0 {
			midStore++
		}
	}
	if midStore == 0 {
		t.Fatal("no kill landed mid-store")
	}
	for _, l := range leftovers(t, root) {
		if !strings.HasPrefix(filepath.Base(l), tmpPrefix) {
			t.Fatalf("a temporary file without kvhost's owned name: %s", l)
		}
	}
	// Every visible row is whole, with its key's bytes, as the tier
	// would read it.
	ctx := context.Background()
	e := openEngine(t, Config{Mounts: []Mount{{Path: root, VLLMFS: &VLLMFS{Fields: tier.fields(), Namespace: tierModel}}}, Policy: newTestPolicy(1, abi.OrderBlockMajor)})
	if l := leftovers(t, root); len(l) != 0 {
		t.Fatalf("leftovers after Open: %v", l)
	}
	g := rowGeometry(tierModel, vllmfsCrashRow)
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	want := newTestCache(t, e, ns, g, 1, layoutPlaneFirst)
	files := rowFiles(t, root)
	if st := e.Stats(); st.Entries != len(files) {
		t.Fatalf("%d row files, %d indexed", len(files), st.Entries)
	}
	seen := 0
	for batch := 0; ; batch++ {
		keys := tierKeys(uint64(batch), 4)
		found := 0
		for _, k := range keys {
			got := tier.load(t, k)
			if got == nil {
				continue
			}
			found++
			keyContent(want, k, []int{0})
			if !bytes.Equal(got, want.data([]int{0})) {
				t.Fatalf("batch %d: a visible row holds other bytes (torn)", batch)
			}
		}
		if batch <= stored && found != 4 {
			t.Fatalf("batch %d, reported stored, has %d rows", batch, found)
		}
		seen += found
		if found == 0 && batch > stored {
			break
		}
	}
	if seen != len(files) {
		t.Fatalf("%d rows found by key, %d on disk", seen, len(files))
	}
}

// TestVLLMFSMLAGeometryIsTensorMajorRow: an MLA geometry (one plane) on a
// vllm-fs mount writes each key's row tensor-major (every block of layer
// 0, then of layer 1, ...), the order of vLLM's row at TP 1, and loads it
// back.
func TestVLLMFSMLAGeometryIsTensorMajorRow(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	g := Geometry{Model: "mla-model", Layers: 3, KVHeads: 1, HeadSize: 576, DtypeSize: 2, MLA: true, TokensPerBlock: 16, TokensPerKey: 32, TPSize: 1}
	tier := newFSTier(root, int(g.KeyBytes()))
	e := openEngine(t, Config{Mounts: []Mount{{Path: root, VLLMFS: &VLLMFS{Fields: tier.fields(), Namespace: g.Model}}}, Policy: newTestPolicy(4, abi.OrderBlockMajor)})
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 8, layoutPlaneFirst)
	keys := tierKeys(7, 2)
	blocks := [][]int{{5, 1}, {2, 6}}
	r := rand.New(rand.NewPCG(3, 4))
	for _, b := range blocks {
		c.fill(r, b)
	}
	storeAndCheck(t, e, c, keys, blocks)
	for i, k := range keys {
		var row []byte
		for l := range g.Layers {
			for _, b := range blocks[i] {
				row = append(row, c.block(l, 0, b)...)
			}
		}
		if got := tier.load(t, k); !bytes.Equal(got, row) {
			t.Fatalf("key %d: the file is not the tensor-major row", i)
		}
	}
	loadAndCompare(t, e, c, keys, [][]int{{0, 3}, {4, 7}}, [][]byte{c.data(blocks[0]), c.data(blocks[1])})
}
