package objstore_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/daemon/hostpath"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/objstore"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/plugins/lru"
	"github.com/kvhost/kvhost/region"
)

// The tests here run against a real S3 endpoint: scripts/rgw.sh run
// starts a one-host Ceph RGW and sets KVHOST_S3_ENDPOINT and the keys
// (make test-objects; make test runs them so). Without it they skip.

// rgwConfig returns a Config for a fresh bucket of the test's own on the
// endpoint the environment names, or skips.
func rgwConfig(t testing.TB) objstore.Config {
	t.Helper()
	ep := os.Getenv("KVHOST_S3_ENDPOINT")
	if ep == "" {
		t.Skip("KVHOST_S3_ENDPOINT is not set: these tests run under scripts/rgw.sh run (make test-objects)")
	}
	return objstore.Config{
		Endpoint:       ep,
		Bucket:         fmt.Sprintf("kvhost-test-%08x", rand.Uint32()),
		Prefix:         "kv/",
		AccessKey:      os.Getenv("KVHOST_S3_ACCESS_KEY"),
		SecretKey:      os.Getenv("KVHOST_S3_SECRET_KEY"),
		CreateBucket:   true,
		RequestTimeout: 5 * time.Second,
		PartSize:       5 << 20,
		RangeSize:      1 << 20,
		ListInterval:   100 * time.Millisecond,
		Logger:         quiet(),
	}
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// geometry: 8 MiB keys (8 layers, K and V, 16 blocks of 32 KiB), which
// upload in two parts of 5 MiB.
func geometry() engine.Geometry {
	return engine.Geometry{Model: "test/objects", Layers: 8, KVHeads: 8, HeadSize: 128, DtypeSize: 2, TokensPerBlock: 16, TokensPerKey: 256, TPSize: 1}
}

// node is an engine on a directory of its own with an object mount.
type node struct {
	dir   string
	store *objstore.Store
	eng   *engine.Engine
	ns    engine.NamespaceID
	cache engine.CacheID
	mem   []byte // the cache's memory: one tensor per layer, plane-first
	geo   engine.Geometry
	nb    int
}

const numBlocks = 256

func openNode(t testing.TB, dir string, cfg objstore.Config) *node {
	t.Helper()
	return openNodeWith(t, engine.Mount{Path: dir}, cfg, func() guest.Policy { return lru.New() })
}

// openNodeWith is openNode on mount with the policy newPolicy makes.
func openNodeWith(t testing.TB, mount engine.Mount, cfg objstore.Config, newPolicy func() guest.Policy) *node {
	t.Helper()
	return openNodeSlots(t, mount, cfg, newPolicy, 4)
}

// openNodeSlots is openNodeWith with workers I/O workers: the keys a
// load has in flight at once (engine.Config.IOWorkers).
func openNodeSlots(t testing.TB, mount engine.Mount, cfg objstore.Config, newPolicy func() guest.Policy, workers int) *node {
	t.Helper()
	dir := mount.Path
	ctx := context.Background()
	st, err := objstore.Open(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	eng, err := engine.Open(ctx, engine.Config{
		Host:   hostpath.Staging,
		Mounts: []engine.Mount{mount},
		NewPolicy: func(idx policy.Index) (policy.Policy, error) {
			return policy.NewNative(newPolicy, idx, policy.Config{Shards: 1})
		},
		Objects:   st,
		IOWorkers: workers,
		Logger:    quiet(),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close(ctx) })
	g := geometry()
	ns, err := eng.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	bb := g.BlockBytes()
	perLayer := 2 * numBlocks * bb
	reg, err := region.NewHost("kv", perLayer*int64(g.Layers))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { reg.Close() })
	var layers []engine.LayerTensor
	for l := range g.Layers {
		layers = append(layers, engine.LayerTensor{Region: reg, Offset: int64(l) * perLayer, NumBlocks: numBlocks, BlockStride: bb, PlaneStride: numBlocks * bb})
	}
	c, err := eng.RegisterCache(ns, layers)
	if err != nil {
		t.Fatal(err)
	}
	return &node{dir: dir, store: st, eng: eng, ns: ns, cache: c, mem: reg.Bytes(), geo: g, nb: numBlocks}
}

// blocks gives key i of n the blocks [first+i*bpk, first+(i+1)*bpk).
func (n *node) blocks(keys, first int) [][]int {
	bpk := n.geo.BlocksPerKey()
	out := make([][]int, keys)
	for i := range out {
		for b := range bpk {
			out[i] = append(out[i], first+i*bpk+b)
		}
	}
	return out
}

// block returns the bytes of block b of plane p of layer l.
func (n *node) block(l, p, b int) []byte {
	bb := n.geo.BlockBytes()
	off := (int64(l)*2*numBlocks + int64(p)*numBlocks + int64(b)) * bb
	return n.mem[off : off+bb]
}

// data returns the bytes of blocks, layer by layer and plane by plane.
func (n *node) data(blocks []int) []byte {
	var out []byte
	for l := range n.geo.Layers {
		for p := range 2 {
			for _, b := range blocks {
				out = append(out, n.block(l, p, b)...)
			}
		}
	}
	return out
}

func (n *node) put(t testing.TB, keys [][]byte, blocks [][]int) {
	t.Helper()
	res := wait(t)(n.eng.Store(context.Background(), engine.StoreRequest{Cache: n.cache, Keys: keys, Blocks: blocks}))
	for i, k := range res.Keys {
		if k.Outcome != engine.OutcomeStored {
			t.Fatalf("store of key %d: %v (%v)", i, k.Outcome, k.Err)
		}
	}
}

// clearBlocks zeroes the blocks.
func (n *node) clearBlocks(blocks [][]int) {
	for _, bl := range blocks {
		for l := range n.geo.Layers {
			for p := range 2 {
				for _, b := range bl {
					clear(n.block(l, p, b))
				}
			}
		}
	}
}

// load zeroes the blocks and loads keys into them.
func (n *node) load(t testing.TB, keys [][]byte, blocks [][]int) engine.Result {
	t.Helper()
	n.clearBlocks(blocks)
	return wait(t)(n.eng.Load(context.Background(), engine.LoadRequest{Cache: n.cache, Keys: keys, Blocks: blocks}))
}

// wait returns a function that waits for the job a Store or Load
// returned: wait(t)(e.Store(ctx, req)).
func wait(t testing.TB) func(*engine.Job, error) engine.Result {
	return func(j *engine.Job, err error) engine.Result {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		res, _ := j.Wait(ctx) // the outcomes are per key, in res
		if ctx.Err() != nil {
			t.Fatal("job did not finish within 2 minutes")
		}
		return res
	}
}

func newRand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, 7)) }

func fill(r *rand.Rand, b []byte) {
	for i := range b {
		b[i] = byte(r.Uint32())
	}
}

// storeKeys fills the blocks of n keys on a with random bytes, stores
// them, waits for their uploads and returns the keys, the blocks and each
// key's bytes.
func storeKeys(t testing.TB, a *node, prefix string, n int) ([][]byte, [][]byte) {
	t.Helper()
	fill(newRand(uint64(n)), a.mem)
	keys := make([][]byte, n)
	for i := range keys {
		keys[i] = fmt.Appendf(nil, "%s-%03d", prefix, i)
	}
	src := a.blocks(n, 0)
	before := a.store.Stats().Uploaded + a.store.Stats().Skipped
	a.put(t, keys, src)
	want := make([][]byte, n)
	for i := range keys {
		want[i] = a.data(src[i])
	}
	testwait.Until(t, "the uploads", time.Minute, func() bool {
		return a.store.Stats().Uploaded+a.store.Stats().Skipped >= before+uint64(n) || a.store.Stats().Failed > 0
	})
	if st := a.store.Stats(); st.Failed > 0 {
		t.Fatalf("uploads failed: %+v", st)
	}
	return keys, want
}

func loadAndCompare(t testing.TB, n *node, keys, want [][]byte) {
	t.Helper()
	into := n.blocks(len(keys), n.geo.BlocksPerKey()*len(keys))
	res := n.load(t, keys, into)
	for i, k := range res.Keys {
		if k.Outcome != engine.OutcomeLoaded {
			t.Fatalf("load of key %s: %v (%v)", keys[i], k.Outcome, k.Err)
		}
		if !bytes.Equal(n.data(into[i]), want[i]) {
			t.Fatalf("key %s: the bytes loaded differ from those stored", keys[i])
		}
	}
}

// TestPrefixStoredByOneNodeLoadsOnAnotherAndAfterAWipe: keys one engine
// stored reach the bucket (multipart: 8 MiB keys, 5 MiB parts); an engine
// on another directory, sharing no file with the first, finds them by its
// listing, looks them up as hits and loads them byte for byte; and the
// first engine, its directory wiped and reopened, finds them again.
func TestPrefixStoredByOneNodeLoadsOnAnotherAndAfterAWipe(t *testing.T) {
	cfg := rgwConfig(t)
	dirA := filepath.Join(t.TempDir(), "a")
	a := openNode(t, dirA, cfg)
	keys, want := storeKeys(t, a, "prefix", 4)

	b := openNode(t, filepath.Join(t.TempDir(), "b"), cfg)
	if n, err := b.eng.Lookup(context.Background(), b.ns, keys); err != nil || n != len(keys) {
		t.Fatalf("lookup on the other node: %d of %d hits (%v)", n, len(keys), err)
	}
	loadAndCompare(t, b, keys, want)
	if st := b.store.Stats(); st.Gets == 0 || st.GetBytes < uint64(len(keys))*uint64(b.geo.KeyBytes()) {
		t.Fatalf("the other node's loads read %d bytes in %d GETs, want at least %d", st.GetBytes, st.Gets, len(keys)*int(b.geo.KeyBytes()))
	}

	a.eng.Close(context.Background())
	a.store.Close()
	if err := os.RemoveAll(dirA); err != nil {
		t.Fatal(err)
	}
	a = openNode(t, dirA, cfg)
	if n, err := a.eng.Lookup(context.Background(), a.ns, keys); err != nil || n != len(keys) {
		t.Fatalf("lookup after the wipe: %d of %d hits (%v)", n, len(keys), err)
	}
	loadAndCompare(t, a, keys, want)
}

// TestObjectCorruptedInPlaceFailsItsLoadAndIsRemoved: an object whose
// payload changed in the bucket fails its load with engine.ErrCorrupt,
// and the store forgets and removes it.
func TestObjectCorruptedInPlaceFailsItsLoadAndIsRemoved(t *testing.T) {
	cfg := rgwConfig(t)
	a := openNode(t, filepath.Join(t.TempDir(), "a"), cfg)
	keys, _ := storeKeys(t, a, "corrupt", 1)
	name := a.store.Name(a.geo.Fingerprint(), keys[0])
	raw := objstore.RawClient(a.store)
	obj, err := raw.Get(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	obj[len(obj)-100] ^= 0x40
	if err := raw.Put(context.Background(), name, obj); err != nil {
		t.Fatal(err)
	}

	b := openNode(t, filepath.Join(t.TempDir(), "b"), cfg)
	into := b.blocks(1, 0)
	res := b.load(t, keys, into)
	if o, err := res.Keys[0].Outcome, res.Keys[0].Err; o != engine.OutcomeFailed || !errors.Is(err, engine.ErrCorrupt) {
		t.Fatalf("load of a corrupted object: %v (%v), want failed with engine.ErrCorrupt", o, err)
	}
	testwait.Until(t, "the bad object's removal", 30*time.Second, func() bool { return b.store.Stats().Removed == 1 })
	if _, err := raw.Get(context.Background(), name); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the bad object after its removal: %v, want it gone", err)
	}
	if n, _ := b.eng.Lookup(context.Background(), b.ns, keys); n != 0 {
		t.Fatal("the removed object is still a hit")
	}
}

// TestWrongCredentialsFailOpenNamingThem: a store the endpoint refuses
// the keys of fails at Open with ErrCredentials (a refusal, not a
// request timeout).
func TestWrongCredentialsFailOpenNamingThem(t *testing.T) {
	cfg := rgwConfig(t)
	cfg.SecretKey = "not-the-secret-key-of-the-test-user-000000"
	_, err := objstore.Open(context.Background(), cfg)
	if !errors.Is(err, objstore.ErrCredentials) || errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("open with a wrong secret key: %v, want ErrCredentials", err)
	}
}

// TestDeletedKeyIsRemovedFromTheBucket: a key a client deletes on a node
// that holds it only in the bucket is removed from the bucket, and is a
// miss on a node that opens after.
func TestDeletedKeyIsRemovedFromTheBucket(t *testing.T) {
	cfg := rgwConfig(t)
	a := openNode(t, filepath.Join(t.TempDir(), "a"), cfg)
	keys, _ := storeKeys(t, a, "deleted", 2)
	b := openNode(t, filepath.Join(t.TempDir(), "b"), cfg)
	if n, err := b.eng.Delete(context.Background(), b.ns, keys[:1]); err != nil || n != 1 {
		t.Fatalf("delete of a key the bucket holds: %d, %v; want 1", n, err)
	}
	testwait.Until(t, "the object's removal", 30*time.Second, func() bool { return b.store.Stats().Deleted == 1 })
	name := b.store.Name(b.geo.Fingerprint(), keys[0])
	if _, err := objstore.RawClient(b.store).Get(context.Background(), name); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the deleted key's object: %v, want it gone", err)
	}
	c := openNode(t, filepath.Join(t.TempDir(), "c"), cfg)
	if n, _ := c.eng.Lookup(context.Background(), c.ns, keys); n != 0 {
		t.Fatalf("a node opened after the delete finds %d leading keys, want 0", n)
	}
	if n, _ := c.eng.Lookup(context.Background(), c.ns, keys[1:]); n != 1 {
		t.Fatal("the key not deleted is no hit")
	}
}
