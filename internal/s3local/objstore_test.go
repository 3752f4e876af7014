package s3local_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"math/rand/v2"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/daemon/hostpath"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/objstore"
	"github.com/kvhost/kvhost/internal/s3local"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/plugins/lru"
	"github.com/kvhost/kvhost/region"
)

// These tests run internal/objstore's own client, through an engine as
// the daemon runs it, against an s3local endpoint on loopback.

const (
	testAccess = "s3local-test-access"
	testSecret = "s3local-test-secret-0123456789"
	testBucket = "kvhost-test"
)

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// endpoint is an s3local server on loopback over a directory of the
// test's own, with the test bucket made.
type endpoint struct {
	url string
	dir string
	srv *s3local.Server
}

func startEndpoint(t testing.TB, quota int64) *endpoint {
	t.Helper()
	return startServer(t, s3local.Config{AccessKey: testAccess, SecretKey: testSecret, Quota: quota})
}

// startServer is startEndpoint with cfg, on a directory of the test's.
func startServer(t testing.TB, cfg s3local.Config) *endpoint {
	t.Helper()
	dir := t.TempDir()
	cfg.Dir, cfg.Logger = dir, quiet()
	srv, err := s3local.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.CreateBucket(testBucket); err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv)
	t.Cleanup(ts.Close)
	return &endpoint{url: ts.URL, dir: dir, srv: srv}
}

// config is an objstore configuration on the endpoint: 5 MiB parts, so
// that a key of 8 MiB is a multipart upload, and 1 MiB ranges, so that
// its load is parallel ranged GETs.
func (ep *endpoint) config() objstore.Config {
	return objstore.Config{
		Endpoint:       ep.url,
		Bucket:         testBucket,
		Prefix:         "kv/",
		AccessKey:      testAccess,
		SecretKey:      testSecret,
		RequestTimeout: 10 * time.Second,
		PartSize:       5 << 20,
		RangeSize:      1 << 20,
		ListInterval:   -1,
		Logger:         quiet(),
	}
}

// objectFile is the file of the object name.
func (ep *endpoint) objectFile(name string) string {
	return filepath.Join(ep.dir, testBucket, filepath.FromSlash(name))
}

// geometry: keys of 8 MiB (8 layers, K and V, 16 blocks of 32 KiB).
func geometry() engine.Geometry {
	return engine.Geometry{Model: "test/s3local", Layers: 8, KVHeads: 8, HeadSize: 128, DtypeSize: 2, TokensPerBlock: 16, TokensPerKey: 256, TPSize: 1}
}

const numBlocks = 128

// node is an engine on a directory of its own whose object mount is on
// the endpoint.
type node struct {
	store *objstore.Store
	eng   *engine.Engine
	ns    engine.NamespaceID
	cache engine.CacheID
	mem   []byte
	geo   engine.Geometry
}

func openNode(t testing.TB, cfg objstore.Config) *node {
	t.Helper()
	ctx := context.Background()
	st, err := objstore.Open(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	eng, err := engine.Open(ctx, engine.Config{
		Host:   hostpath.Staging,
		Mounts: []engine.Mount{{Path: t.TempDir()}},
		NewPolicy: func(idx policy.Index) (policy.Policy, error) {
			return policy.NewNative(func() guest.Policy { return lru.New() }, idx, policy.Config{Shards: 1})
		},
		Objects:   st,
		IOWorkers: 4,
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
	return &node{store: st, eng: eng, ns: ns, cache: c, mem: reg.Bytes(), geo: g}
}

// blocks gives key i of n the blocks from first+i*BlocksPerKey.
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

// data returns the bytes of blocks, layer by layer and plane by plane.
func (n *node) data(blocks []int) []byte {
	bb := n.geo.BlockBytes()
	var out []byte
	for l := range n.geo.Layers {
		for p := range 2 {
			for _, b := range blocks {
				off := (int64(l)*2*numBlocks + int64(p)*numBlocks + int64(b)) * bb
				out = append(out, n.mem[off:off+bb]...)
			}
		}
	}
	return out
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

// storeKeys fills n keys' blocks with random bytes, stores them and waits
// for their uploads (ok) or the failure of one (not ok); it returns the
// keys and each one's bytes.
func storeKeys(t testing.TB, a *node, prefix string, n int) (keys, want [][]byte, ok bool) {
	t.Helper()
	r := rand.New(rand.NewPCG(uint64(n), uint64(len(prefix))))
	for i := range a.mem {
		a.mem[i] = byte(r.Uint32())
	}
	keys = make([][]byte, n)
	for i := range keys {
		keys[i] = fmt.Appendf(nil, "%s-%03d", prefix, i)
	}
	src := a.blocks(n, 0)
	before := a.store.Stats()
	res := wait(t)(a.eng.Store(context.Background(), engine.StoreRequest{Cache: a.cache, Keys: keys, Blocks: src}))
	for i, k := range res.Keys {
		if k.Outcome != engine.OutcomeStored {
			t.Fatalf("store of key %d: %v (%v)", i, k.Outcome, k.Err)
		}
	}
	for i := range keys {
		want = append(want, a.data(src[i]))
	}
	testwait.Until(t, "the uploads", time.Minute, func() bool {
		st := a.store.Stats()
		return st.Uploaded+st.Skipped+st.Failed >= before.Uploaded+before.Skipped+before.Failed+uint64(n)
	})
	return keys, want, a.store.Stats().Failed == before.Failed
}

// TestObjstoreStoresListsAndLoadsThroughS3local: keys one engine stores
// are uploaded in parts and land as files of their exact size under the
// bucket's directory, with no multipart upload left behind; an engine on
// another directory finds them by its listing and loads them byte for
// byte by parallel ranged GETs.
func TestObjstoreStoresListsAndLoadsThroughS3local(t *testing.T) {
	ep := startEndpoint(t, 0)
	cfg := ep.config()
	a := openNode(t, cfg)
	keys, want, ok := storeKeys(t, a, "stored", 3)
	if !ok {
		t.Fatalf("uploads failed: %+v", a.store.Stats())
	}
	size := 4096 + a.geo.KeyBytes()
	for _, k := range keys {
		fi, err := os.Stat(ep.objectFile(a.store.Name(a.geo.Fingerprint(), k)))
		if err != nil || fi.Size() != size {
			t.Fatalf("key %s's object file: %v, want %d bytes", k, err, size)
		}
	}
	if left, _ := os.ReadDir(filepath.Join(ep.dir, ".s3local-uploads")); len(left) != 0 {
		t.Fatalf("%d multipart uploads left behind after the uploads", len(left))
	}

	b := openNode(t, cfg)
	if n, err := b.eng.Lookup(context.Background(), b.ns, keys); err != nil || n != len(keys) {
		t.Fatalf("lookup on the other node: %d of %d hits (%v)", n, len(keys), err)
	}
	into := b.blocks(len(keys), 0)
	res := wait(t)(b.eng.Load(context.Background(), engine.LoadRequest{Cache: b.cache, Keys: keys, Blocks: into}))
	for i, k := range res.Keys {
		if k.Outcome != engine.OutcomeLoaded {
			t.Fatalf("load of key %s: %v (%v)", keys[i], k.Outcome, k.Err)
		}
		if !bytes.Equal(b.data(into[i]), want[i]) {
			t.Fatalf("key %s: the bytes loaded differ from those stored", keys[i])
		}
	}
	// At least each key's 8 MiB, in ranges of at most 1 MiB.
	minGets := uint64(len(keys)) * uint64(b.geo.KeyBytes()/cfg.RangeSize)
	if st := b.store.Stats(); st.Gets < minGets || st.GetBytes < uint64(len(keys))*uint64(b.geo.KeyBytes()) || st.GetErrors != 0 {
		t.Fatalf("the loads read %d bytes in %d GETs (%d failed), want each key's %d bytes in at least %d ranged ones", st.GetBytes, st.Gets, st.GetErrors, b.geo.KeyBytes(), minGets)
	}
}

// TestObjstoreCorruptedObjectFailsItsLoadAndIsRemoved: a byte of an
// object's file flipped in place fails the key's load with
// engine.ErrCorrupt, and the store removes the object, file and all.
func TestObjstoreCorruptedObjectFailsItsLoadAndIsRemoved(t *testing.T) {
	ep := startEndpoint(t, 0)
	cfg := ep.config()
	a := openNode(t, cfg)
	keys, _, ok := storeKeys(t, a, "corrupt", 1)
	if !ok {
		t.Fatalf("upload failed: %+v", a.store.Stats())
	}
	file := ep.objectFile(a.store.Name(a.geo.Fingerprint(), keys[0]))
	f, err := os.OpenFile(file, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	var c [1]byte
	off := int64(4096 + 12345)
	if _, err := f.ReadAt(c[:], off); err != nil {
		t.Fatal(err)
	}
	c[0] ^= 0x40
	if _, err := f.WriteAt(c[:], off); err != nil {
		t.Fatal(err)
	}
	f.Close()

	b := openNode(t, cfg)
	res := wait(t)(b.eng.Load(context.Background(), engine.LoadRequest{Cache: b.cache, Keys: keys, Blocks: b.blocks(1, 0)}))
	if o, err := res.Keys[0].Outcome, res.Keys[0].Err; o != engine.OutcomeFailed || !errors.Is(err, engine.ErrCorrupt) {
		t.Fatalf("load of a corrupted object: %v (%v), want failed with engine.ErrCorrupt", o, err)
	}
	testwait.Until(t, "the bad object's removal", 30*time.Second, func() bool { return b.store.Stats().Removed == 1 })
	if _, err := os.Stat(file); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("the bad object's file after its removal: %v, want it gone", err)
	}
}

// TestObjstoreDeleteAndPurgeRemoveTheFiles: a key deleted on a node that
// holds it in the bucket only loses its object (DeleteObject); a purge of
// the namespace removes the rest (ListObjectsV2, DeleteObjects), and
// their folder with them.
func TestObjstoreDeleteAndPurgeRemoveTheFiles(t *testing.T) {
	ep := startEndpoint(t, 0)
	cfg := ep.config()
	a := openNode(t, cfg)
	keys, _, ok := storeKeys(t, a, "gone", 3)
	if !ok {
		t.Fatalf("uploads failed: %+v", a.store.Stats())
	}
	b := openNode(t, cfg)
	if n, err := b.eng.Delete(context.Background(), b.ns, keys[:1]); err != nil || n != 1 {
		t.Fatalf("delete of a key the bucket holds: %d, %v; want 1", n, err)
	}
	testwait.Until(t, "the object's removal", 30*time.Second, func() bool { return b.store.Stats().Deleted == 1 })
	fp := b.geo.Fingerprint()
	if _, err := os.Stat(ep.objectFile(b.store.Name(fp, keys[0]))); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("the deleted key's file: %v, want it gone", err)
	}
	if _, err := os.Stat(ep.objectFile(b.store.Name(fp, keys[1]))); err != nil {
		t.Fatalf("a key not deleted lost its file: %v", err)
	}
	r, err := b.eng.Purge(context.Background(), fp)
	if err != nil {
		t.Fatal(err)
	}
	if st := b.store.Stats(); st.Purged != 2 {
		t.Fatalf("the purge removed %d objects (%+v), want 2", st.Purged, r)
	}
	if _, err := os.Stat(filepath.Dir(ep.objectFile(b.store.Name(fp, keys[1])))); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("the namespace's folder after the purge: %v, want it gone", err)
	}
}

// TestObjstoreWrongCredentialsFailOpen: a wrong secret key and an unknown
// access key each fail Open with objstore.ErrCredentials, a 403 (Open's
// first request is a HEAD, whose answer has no body to name a code in).
func TestObjstoreWrongCredentialsFailOpen(t *testing.T) {
	ep := startEndpoint(t, 0)
	for _, tc := range []struct {
		name, access, secret string
	}{
		{"wrong secret", testAccess, "not-the-secret"},
		{"unknown access key", "nobody", testSecret},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := ep.config()
			cfg.AccessKey, cfg.SecretKey = tc.access, tc.secret
			_, err := objstore.Open(context.Background(), cfg)
			if !errors.Is(err, objstore.ErrCredentials) || !strings.Contains(err.Error(), "403") {
				t.Fatalf("open: %v, want ErrCredentials, a 403", err)
			}
		})
	}
}

// TestObjstoreAgreesOnTheBoundThroughItsObject: the first node with a
// capacity writes it to <prefix>kvhost-capacity (a conditional PUT); a
// node without one takes it; one with another fails Open.
func TestObjstoreAgreesOnTheBoundThroughItsObject(t *testing.T) {
	ep := startEndpoint(t, 0)
	cfg := ep.config()
	cfg.Capacity = 1 << 30
	openNode(t, cfg)
	got, err := os.ReadFile(ep.objectFile("kv/kvhost-capacity"))
	if err != nil || string(got) != "1073741824\n" {
		t.Fatalf("the bound's object: %q, %v", got, err)
	}
	cfg.Capacity = 0
	if _, capacity, _ := openNode(t, cfg).store.Usage(); capacity != 1<<30 {
		t.Fatalf("a node without a capacity took %d, want the agreed %d", capacity, 1<<30)
	}
	cfg.Capacity = 2 << 30
	if _, err := objstore.Open(context.Background(), cfg); !errors.Is(err, objstore.ErrConfig) {
		t.Fatalf("open with another capacity: %v, want ErrConfig", err)
	}
}

// TestObjstoreQuotaExceededIsAFullBucket: an endpoint whose quota holds
// one object refuses the second's upload with QuotaExceeded, which the
// store reports as a full bucket; the first object stays whole.
func TestObjstoreQuotaExceededIsAFullBucket(t *testing.T) {
	ep := startEndpoint(t, 12<<20) // one key of 8 MiB and its header
	cfg := ep.config()
	a := openNode(t, cfg)
	keys, _, ok := storeKeys(t, a, "quota", 2)
	if ok {
		t.Fatal("both uploads succeeded past the quota")
	}
	if st := a.store.Stats(); st.Uploaded != 1 || st.Full != 1 {
		t.Fatalf("uploads: %+v, want 1 uploaded and 1 refused as full", st)
	}
	var held int
	for _, k := range keys {
		if fi, err := os.Stat(ep.objectFile(a.store.Name(a.geo.Fingerprint(), k))); err == nil && fi.Size() == 4096+a.geo.KeyBytes() {
			held++
		}
	}
	if held != 1 {
		t.Fatalf("%d whole objects in the bucket, want 1", held)
	}
}
