package s3local_test

import (
	"context"
	"errors"
	"io/fs"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/objstore"
	"github.com/kvhost/kvhost/internal/objstore/objstoretest"
	"github.com/kvhost/kvhost/internal/s3local"
	"github.com/kvhost/kvhost/internal/testwait"
)

// These tests run internal/objstore's own client, through an engine as
// the daemon runs it, against an s3local endpoint on loopback.

const (
	testAccess = "s3local-test-access"
	testSecret = "s3local-test-secret-0123456789"
	testBucket = "kvhost-test"
)

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
	cfg.Dir, cfg.Logger = dir, objstoretest.Quiet()
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
		Logger:         objstoretest.Quiet(),
	}
}

// objectFile is the file of the object name.
func (ep *endpoint) objectFile(name string) string {
	return filepath.Join(ep.dir, testBucket, filepath.FromSlash(name))
}

// TestObjstoreStoresListsAndLoadsThroughS3local: keys one engine stores
// are uploaded in parts and land as files of their exact size under the
// bucket's directory, with no multipart upload left behind; an engine on
// another directory finds them by its listing and loads them byte for
// byte by parallel ranged GETs.
func TestObjstoreStoresListsAndLoadsThroughS3local(t *testing.T) {
	ep := startEndpoint(t, 0)
	cfg := ep.config()
	a := objstoretest.OpenNode(t, t.TempDir(), cfg)
	keys, want := a.StoreKeys(t, "stored", 3)
	size := 4096 + a.Geo.KeyBytes()
	for _, k := range keys {
		fi, err := os.Stat(ep.objectFile(a.Store.Name(a.Geo.Fingerprint(), k)))
		if err != nil || fi.Size() != size {
			t.Fatalf("key %s's object file: %v, want %d bytes", k, err, size)
		}
	}
	if left, _ := os.ReadDir(filepath.Join(ep.dir, ".s3local-uploads")); len(left) != 0 {
		t.Fatalf("%d multipart uploads left behind after the uploads", len(left))
	}

	b := objstoretest.OpenNode(t, t.TempDir(), cfg)
	if n, err := b.Eng.Lookup(context.Background(), b.NS, keys); err != nil || n != len(keys) {
		t.Fatalf("lookup on the other node: %d of %d hits (%v)", n, len(keys), err)
	}
	b.LoadAndCompare(t, keys, want)
	// At least each key's 8 MiB, in ranges of at most 1 MiB.
	minGets := uint64(len(keys)) * uint64(b.Geo.KeyBytes()/cfg.RangeSize)
	if st := b.Store.Stats(); st.Gets < minGets || st.GetBytes < uint64(len(keys))*uint64(b.Geo.KeyBytes()) || st.GetErrors != 0 {
		t.Fatalf("the loads read %d bytes in %d GETs (%d failed), want each key's %d bytes in at least %d ranged ones", st.GetBytes, st.Gets, st.GetErrors, b.Geo.KeyBytes(), minGets)
	}
}

// TestObjstoreCorruptedObjectFailsItsLoadAndIsRemoved: a byte of an
// object's file flipped in place fails the key's load with
// engine.ErrCorrupt, and the store removes the object, file and all.
func TestObjstoreCorruptedObjectFailsItsLoadAndIsRemoved(t *testing.T) {
	ep := startEndpoint(t, 0)
	cfg := ep.config()
	a := objstoretest.OpenNode(t, t.TempDir(), cfg)
	keys, _ := a.StoreKeys(t, "corrupt", 1)
	file := ep.objectFile(a.Store.Name(a.Geo.Fingerprint(), keys[0]))
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

	b := objstoretest.OpenNode(t, t.TempDir(), cfg)
	res := b.Load(t, keys, b.Blocks(1, 0))
	if o, err := res.Keys[0].Outcome, res.Keys[0].Err; o != engine.OutcomeFailed || !errors.Is(err, engine.ErrCorrupt) {
		t.Fatalf("load of a corrupted object: %v (%v), want failed with engine.ErrCorrupt", o, err)
	}
	testwait.Until(t, "the bad object's removal", 30*time.Second, func() bool { return b.Store.Stats().Removed == 1 })
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
	a := objstoretest.OpenNode(t, t.TempDir(), cfg)
	keys, _ := a.StoreKeys(t, "gone", 3)
	b := objstoretest.OpenNode(t, t.TempDir(), cfg)
	if n, err := b.Eng.Delete(context.Background(), b.NS, keys[:1]); err != nil || n != 1 {
		t.Fatalf("delete of a key the bucket holds: %d, %v; want 1", n, err)
	}
	testwait.Until(t, "the object's removal", 30*time.Second, func() bool { return b.Store.Stats().Deleted == 1 })
	fp := b.Geo.Fingerprint()
	if _, err := os.Stat(ep.objectFile(b.Store.Name(fp, keys[0]))); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("the deleted key's file: %v, want it gone", err)
	}
	if _, err := os.Stat(ep.objectFile(b.Store.Name(fp, keys[1]))); err != nil {
		t.Fatalf("a key not deleted lost its file: %v", err)
	}
	r, err := b.Eng.Purge(context.Background(), fp)
	if err != nil {
		t.Fatal(err)
	}
	if st := b.Store.Stats(); st.Purged != 2 {
		t.Fatalf("the purge removed %d objects (%+v), want 2", st.Purged, r)
	}
	if _, err := os.Stat(filepath.Dir(ep.objectFile(b.Store.Name(fp, keys[1])))); !errors.Is(err, fs.ErrNotExist) {
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
	objstoretest.OpenNode(t, t.TempDir(), cfg)
	got, err := os.ReadFile(ep.objectFile("kv/kvhost-capacity"))
	if err != nil || string(got) != "1073741824\n" {
		t.Fatalf("the bound's object: %q, %v", got, err)
	}
	cfg.Capacity = 0
	if _, capacity, _ := objstoretest.OpenNode(t, t.TempDir(), cfg).Store.Usage(); capacity != 1<<30 {
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
	a := objstoretest.OpenNode(t, t.TempDir(), cfg)
	keys, _, ok := a.TryStoreKeys(t, "quota", 2)
	if ok {
		t.Fatal("both uploads succeeded past the quota")
	}
	if st := a.Store.Stats(); st.Uploaded != 1 || st.Full != 1 {
		t.Fatalf("uploads: %+v, want 1 uploaded and 1 refused as full", st)
	}
	var held int
	for _, k := range keys {
		if fi, err := os.Stat(ep.objectFile(a.Store.Name(a.Geo.Fingerprint(), k))); err == nil && fi.Size() == 4096+a.Geo.KeyBytes() {
			held++
		}
	}
	if held != 1 {
		t.Fatalf("%d whole objects in the bucket, want 1", held)
	}
}
