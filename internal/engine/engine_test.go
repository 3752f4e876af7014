//go:build invariants

package engine

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/region"
)

func TestGeometry(t *testing.T) {
	g := Geometry{Model: "meta-llama/Llama-3.1-8B", Layers: 32, KVHeads: 8, HeadSize: 128, DtypeSize: 2, TokensPerBlock: 16, TokensPerKey: 256, TPSize: 1}
	if err := g.Validate(); err != nil {
		t.Fatal(err)
	}
	if g.KeyBytes() != 32<<20 || g.BlocksPerKey() != 16 || g.BlockBytes() != 32<<10 || g.Planes() != 2 {
		t.Fatalf("key bytes %d, blocks per key %d, block bytes %d", g.KeyBytes(), g.BlocksPerKey(), g.BlockBytes())
	}
	// The fingerprint is part of the file format: it must never change.
	if fp := g.Fingerprint(); fp != 0x4268b921884b09df {
		t.Fatalf("fingerprint 0x%016x changed", fp)
	}
	mla := g
	mla.MLA = true
	seen := map[uint64]string{g.Fingerprint(): "base", mla.Fingerprint(): "mla"}
	for name, mut := range map[string]func(*Geometry){
		"model": func(g *Geometry) { g.Model += "x" }, "layers": func(g *Geometry) { g.Layers++ },
		"heads": func(g *Geometry) { g.KVHeads = 4 }, "head": func(g *Geometry) { g.HeadSize = 64 },
		"dtype": func(g *Geometry) { g.DtypeSize = 1 }, "block": func(g *Geometry) { g.TokensPerBlock = 32 },
		"key": func(g *Geometry) { g.TokensPerKey = 512 }, "rank": func(g *Geometry) { g.TPSize, g.TPRank = 2, 1 },
		"size": func(g *Geometry) { g.TPSize = 2 },
	} {
		h := g
		mut(&h)
		if prev, dup := seen[h.Fingerprint()]; dup {
			t.Errorf("%s: fingerprint equals %s's", name, prev)
		}
		seen[h.Fingerprint()] = name
	}
	for _, tc := range []struct {
		field string
		mut   func(*Geometry)
	}{
		{"Model", func(g *Geometry) { g.Model = "" }},
		{"Model", func(g *Geometry) { g.Model = strings.Repeat("m", abi.MaxModelLen+1) }},
		{"Model", func(g *Geometry) { g.Model = "model-\xff" }},  // not UTF-8: it is a metric's label
		{"Model", func(g *Geometry) { g.Model = "red\x1b[31m" }}, // a control character: it is printed to terminals
		{"Model", func(g *Geometry) { g.Model = "two\nlines" }},
		{"Layers", func(g *Geometry) { g.Layers = 0 }},
		{"KVHeads", func(g *Geometry) { g.KVHeads = -1 }},
		{"HeadSize", func(g *Geometry) { g.HeadSize = 0 }},
		{"DtypeSize", func(g *Geometry) { g.DtypeSize = 3 }},
		{"TokensPerBlock", func(g *Geometry) { g.TokensPerBlock = 0 }},
		{"TokensPerKey", func(g *Geometry) { g.TokensPerKey = 100 }},
		{"TPSize", func(g *Geometry) { g.TPSize = 0 }},
		{"TPRank", func(g *Geometry) { g.TPRank = 1 }},
	} {
		h := g
		tc.mut(&h)
		err := h.Validate()
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), " "+tc.field+" ") {
			t.Errorf("%s: %v", tc.field, err)
		}
	}
}

// TestRoundTrip stores random blocks and loads them into other blocks,
// through every layout: file order, keys per file, cache layout, aligned
// and unaligned blocks, on disk (O_DIRECT where it works) and tmpfs.
func TestRoundTrip(t *testing.T) {
	dirs := map[string]string{"disk": ""}
	if d := shmDir(t); d != "" {
		dirs["tmpfs"] = d
	}
	for dname, base := range dirs {
		for _, order := range []uint32{abi.OrderLayerMajor, abi.OrderBlockMajor} {
			for _, kpf := range []uint32{1, 3} {
				for _, layout := range []int{layoutPlaneFirst, layoutBlockFirst} {
					for _, aligned := range []bool{true, false} {
						name := fmt.Sprintf("%s/order=%d/keysPerFile=%d/layout=%d/aligned=%v", dname, order, kpf, layout, aligned)
						t.Run(name, func(t *testing.T) {
							dir := t.TempDir()
							if base != "" {
								var err error
								if dir, err = os.MkdirTemp(base, "rt-"); err != nil {
									t.Fatal(err)
								}
							}
							roundTrip(t, dir, testPolicies(kpf, order), layout, aligned)
						})
					}
				}
			}
		}
	}
}

// testPolicies returns a constructor of test policies with a layout.
func testPolicies(kpf, order uint32) func(policy.Index) (policy.Policy, error) {
	return func(policy.Index) (policy.Policy, error) { return newTestPolicy(kpf, order), nil }
}

func roundTrip(t *testing.T, dir string, newPolicy func(policy.Index) (policy.Policy, error), layout int, aligned bool) {
	var pols []policy.Policy
	cfg := Config{Mounts: []Mount{{Path: dir}}, NewPolicy: func(idx policy.Index) (policy.Policy, error) {
		p, err := newPolicy(idx)
		pols = append(pols, p)
		return p, err
	}}
	e := openEngine(t, cfg)
	g := smallGeometry(aligned)
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	const n = 7 // with 3 keys per file: files of 3, 3 and 1 keys
	bpk := g.BlocksPerKey()
	c := newTestCache(t, e, ns, g, 4*n*bpk, layout)
	r := rand.New(rand.NewPCG(uint64(layout), uint64(n)))
	keys := testKeys("rt", n)
	src := blockLists(r, n, bpk, 0)
	want := make([][]byte, n)
	for i := range keys {
		c.fill(r, src[i])
		want[i] = c.data(src[i])
	}
	storeAndCheck(t, e, c, keys, src)
	kpf := int(e.tables.get(ns).keysPerFile)
	wantFiles := (n + kpf - 1) / kpf
	if files := dataFiles(t, dir); len(files) != wantFiles {
		t.Fatalf("%d files, want %d", len(files), wantFiles)
	}
	if got, err := e.Lookup(context.Background(), ns, keys); got != n || err != nil {
		t.Fatalf("Lookup: %d, %v", got, err)
	}
	// A prefix: the third key is unknown.
	probe := [][]byte{keys[0], keys[1], []byte("unknown"), keys[3]}
	if got, _ := e.Lookup(context.Background(), ns, probe); got != 2 {
		t.Fatalf("Lookup of a prefix: %d, want 2", got)
	}
	// Load into other blocks, in another order, including a subset of a
	// multi-key file.
	into := blockLists(r, n, bpk, 2*n*bpk)
	perm := r.Perm(n)
	pk, pi, pw := make([][]byte, n), make([][]int, n), make([][]byte, n)
	for i, j := range perm {
		pk[i], pi[i], pw[i] = keys[j], into[j], want[j]
	}
	loadAndCompare(t, e, c, pk, pi, pw)
	loadAndCompare(t, e, c, pk[:1], pi[:1], pw[:1])
	// Storing again: already present, nothing written.
	res := wait(t)(e.Store(context.Background(), StoreRequest{Cache: c.id, Keys: keys, Blocks: src}))
	wantOutcomes(t, "second store", res, OutcomePresent)

	// Restart: the index is rebuilt from the headers.
	if err := e.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	e2 := openEngine(t, cfg)
	ns2, err := e2.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	if st := e2.Stats(); st.Keys != n || st.Entries != wantFiles {
		t.Fatalf("after restart: %d keys, %d entries", st.Keys, st.Entries)
	}
	if tp, ok := pols[len(pols)-1].(*testPolicy); ok && tp.len() != wantFiles {
		t.Fatalf("after restart: the policy knows %d entries", tp.len())
	}
	c2 := newTestCache(t, e2, ns2, g, 4*n*bpk, layout)
	if got, _ := e2.Lookup(context.Background(), ns2, keys); got != n {
		t.Fatalf("Lookup after restart: %d", got)
	}
	loadAndCompare(t, e2, c2, keys, into, want)
	if l := leftovers(t, dir); len(l) != 0 {
		t.Fatalf("leftovers: %v", l)
	}
}

// TestGeometriesNeverMix: a file of one geometry is a miss for another, even
// under the same name.
func TestGeometriesNeverMix(t *testing.T) {
	dir := t.TempDir()
	pol := newTestPolicy(1, abi.OrderLayerMajor)
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: pol})
	ctx := context.Background()
	g1 := smallGeometry(true)
	g2 := g1
	g2.TPSize, g2.TPRank = 2, 1
	ns1, _ := e.Declare(ctx, g1)
	ns2, err := e.Declare(ctx, g2)
	if err != nil || ns1 == ns2 {
		t.Fatalf("namespaces %d %d: %v", ns1, ns2, err)
	}
	if again, _ := e.Declare(ctx, g1); again != ns1 {
		t.Fatalf("redeclare: %d, want %d", again, ns1)
	}
	c1 := newTestCache(t, e, ns1, g1, 16, layoutPlaneFirst)
	c2 := newTestCache(t, e, ns2, g2, 16, layoutPlaneFirst)
	keys := testKeys("k", 2)
	r := rand.New(rand.NewPCG(1, 2))
	c1.fill(r, []int{0, 1, 2, 3, 4, 5, 6, 7})
	storeAndCheck(t, e, c1, keys, [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}})
	if n, _ := e.Lookup(ctx, ns2, keys); n != 0 {
		t.Fatalf("other geometry sees %d keys", n)
	}
	res := wait(t)(e.Load(ctx, LoadRequest{Cache: c2.id, Keys: keys[:1], Blocks: [][]int{{0, 1, 2, 3}}}))
	wantOutcomes(t, "load in other geometry", res, OutcomeMissing)
	// A file of geometry 1 renamed to the name geometry 2 would use is a
	// miss too, and is reported.
	_, paths, _, err := e.nm.names(ctx, e.tables.get(ns2), keys[1:])
	if err != nil {
		t.Fatal(err)
	}
	os.MkdirAll(paths[0][:strings.LastIndex(paths[0], "/")], 0o755)
	if err := os.Link(dataFiles(t, dir)[0], paths[0]); err != nil {
		t.Fatal(err)
	}
	if n, _ := e.Lookup(ctx, ns2, keys[1:]); n != 0 {
		t.Fatalf("foreign file under the key's name: %d hits", n)
	}
}

func TestRequestValidation(t *testing.T) {
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, 0)})
	ctx := context.Background()
	g := smallGeometry(true)
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 8, layoutPlaneFirst)
	for _, tc := range []struct {
		name   string
		req    StoreRequest
		target error
	}{
		{"cache", StoreRequest{Cache: 99}, ErrUnknownCache},
		{"lengths", StoreRequest{Cache: c.id, Keys: testKeys("a", 2), Blocks: [][]int{{0, 1, 2, 3}}}, ErrInvalid},
		{"blocks per key", StoreRequest{Cache: c.id, Keys: testKeys("a", 1), Blocks: [][]int{{0, 1, 2}}}, ErrInvalid},
		{"block id", StoreRequest{Cache: c.id, Keys: testKeys("a", 1), Blocks: [][]int{{0, 1, 2, 8}}}, ErrInvalid},
		{"negative block", StoreRequest{Cache: c.id, Keys: testKeys("a", 1), Blocks: [][]int{{0, -2, 2, 3}}}, ErrInvalid},
		{"empty key", StoreRequest{Cache: c.id, Keys: [][]byte{{}}, Blocks: [][]int{{0, 1, 2, 3}}}, ErrInvalid},
		{"long key", StoreRequest{Cache: c.id, Keys: [][]byte{make([]byte, 65)}, Blocks: [][]int{{0, 1, 2, 3}}}, ErrInvalid},
	} {
		if _, err := e.Store(ctx, tc.req); !errors.Is(err, tc.target) {
			t.Errorf("%s: store: %v, want %v", tc.name, err, tc.target)
		}
		if _, err := e.Load(ctx, LoadRequest{Cache: tc.req.Cache, Keys: tc.req.Keys, Blocks: tc.req.Blocks}); !errors.Is(err, tc.target) {
			t.Errorf("%s: load: %v, want %v", tc.name, err, tc.target)
		}
	}
	// Tensors that do not fit their region, or are not host memory.
	bad := func(mut func([]LayerTensor)) error {
		ls := append([]LayerTensor(nil), c.layers...)
		mut(ls)
		_, err := e.RegisterCache(ns, ls)
		return err
	}
	for name, mut := range map[string]func([]LayerTensor){
		"layers":       func(ls []LayerTensor) {},
		"past the end": func(ls []LayerTensor) { ls[3].NumBlocks = 9 },
		"stride":       func(ls []LayerTensor) { ls[0].BlockStride = 100 },
		"offset":       func(ls []LayerTensor) { ls[1].Offset = -1 },
		"nil region":   func(ls []LayerTensor) { ls[2].Region = nil },
		"device":       func(ls []LayerTensor) { ls[0].Region = deviceRegion{} },
	} {
		var err error
		if name == "layers" {
			_, err = e.RegisterCache(ns, c.layers[:3])
		} else {
			err = bad(mut)
		}
		if !errors.Is(err, ErrInvalid) {
			t.Errorf("RegisterCache %s: %v", name, err)
		}
	}
	if _, err := e.RegisterCache(77, c.layers); !errors.Is(err, ErrUnknownNamespace) {
		t.Errorf("RegisterCache unknown namespace: %v", err)
	}
	if _, err := e.Lookup(ctx, 77, nil); !errors.Is(err, ErrUnknownNamespace) {
		t.Errorf("Lookup unknown namespace: %v", err)
	}
}

type deviceRegion struct{}

func (deviceRegion) ID() uint64        { return 1 }
func (deviceRegion) Len() int64        { return 1 << 30 }
func (deviceRegion) Kind() region.Kind { return region.KindDevice }

// TestOpenRefusesMountsThatOverlap: the rebuild indexes every file under a
// kvhost mount's root, so two mounts on one directory (one path twice, or
// two names of one directory) or one inside the other would index the
// files of the inner one twice, and the rebuild would remove one of the two
// "copies" (dedupe): the file itself. Open refuses them, and the files
// stored there stay.
func TestOpenRefusesMountsThatOverlap(t *testing.T) {
	ctx := context.Background()
	g := smallGeometry(true)
	for _, tc := range []struct {
		name   string
		stored string   // the mount a file is stored on first, under the test's directory
		mounts []string // then opened together
	}{
		{"one path twice", ".", []string{".", "./"}},
		{"two names of one directory", ".", []string{".", "alias"}},
		{"the second inside the first", "cold", []string{".", "cold"}},
		{"the first inside the second", "hot", []string{"hot", "."}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			if err := os.Symlink(dir, filepath.Join(dir, "alias")); err != nil {
				t.Fatal(err)
			}
			e := openEngine(t, Config{Mounts: []Mount{{Path: filepath.Join(dir, tc.stored)}}, Policy: newTestPolicy(1, abi.OrderLayerMajor)})
			ns, _ := e.Declare(ctx, g)
			c := newTestCache(t, e, ns, g, 8, layoutPlaneFirst)
			c.fill(rand.New(rand.NewPCG(1, 1)), []int{0, 1, 2, 3})
			keys := testKeys("overlap", 1)
			storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}})
			_, paths, _, _ := e.nm.names(ctx, e.tables.get(ns), keys)
			e.Close(ctx)
			var mounts []Mount
			for _, m := range tc.mounts {
				mounts = append(mounts, Mount{Path: dir + "/" + m})
			}
			e, err := testOpen(ctx, Config{Mounts: mounts, Policy: newTestPolicy(1, abi.OrderLayerMajor), Logger: testLogger(t)})
			if err == nil {
				e.Close(ctx)
			}
			if _, serr := os.Stat(paths[0]); serr != nil {
				t.Fatalf("open: %v; the stored file: %v", err, serr)
			}
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "overlap") {
				t.Fatalf("open: %v, want ErrInvalid: the mounts overlap", err)
			}
		})
	}
}
