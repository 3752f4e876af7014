package objstore_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/objstore"
	"github.com/kvhost/kvhost/internal/objstore/objstoretest"
	"github.com/kvhost/kvhost/internal/testwait"
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
		Logger:         objstoretest.Quiet(),
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
	a := objstoretest.OpenNode(t, dirA, cfg)
	keys, want := a.StoreKeys(t, "prefix", 4)

	b := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "b"), cfg)
	if n, err := b.Eng.Lookup(context.Background(), b.NS, keys); err != nil || n != len(keys) {
		t.Fatalf("lookup on the other node: %d of %d hits (%v)", n, len(keys), err)
	}
	b.LoadAndCompare(t, keys, want)
	if st := b.Store.Stats(); st.Gets == 0 || st.GetBytes < uint64(len(keys))*uint64(b.Geo.KeyBytes()) {
		t.Fatalf("the other node's loads read %d bytes in %d GETs, want at least %d", st.GetBytes, st.Gets, len(keys)*int(b.Geo.KeyBytes()))
	}

	a.Eng.Close(context.Background())
	a.Store.Close()
	if err := os.RemoveAll(dirA); err != nil {
		t.Fatal(err)
	}
	a = objstoretest.OpenNode(t, dirA, cfg)
	if n, err := a.Eng.Lookup(context.Background(), a.NS, keys); err != nil || n != len(keys) {
		t.Fatalf("lookup after the wipe: %d of %d hits (%v)", n, len(keys), err)
	}
	a.LoadAndCompare(t, keys, want)
}

// TestObjectCorruptedInPlaceFailsItsLoadAndIsRemoved: an object whose
// payload changed in the bucket fails its load with engine.ErrCorrupt,
// and the store forgets and removes it.
func TestObjectCorruptedInPlaceFailsItsLoadAndIsRemoved(t *testing.T) {
	cfg := rgwConfig(t)
	a := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "a"), cfg)
	keys, _ := a.StoreKeys(t, "corrupt", 1)
	name := a.Store.Name(a.Geo.Fingerprint(), keys[0])
	raw := objstore.RawClient(a.Store)
	obj, err := raw.Get(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	obj[len(obj)-100] ^= 0x40
	if err := raw.Put(context.Background(), name, obj); err != nil {
		t.Fatal(err)
	}

	b := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "b"), cfg)
	into := b.Blocks(1, 0)
	res := b.Load(t, keys, into)
	if o, err := res.Keys[0].Outcome, res.Keys[0].Err; o != engine.OutcomeFailed || !errors.Is(err, engine.ErrCorrupt) {
		t.Fatalf("load of a corrupted object: %v (%v), want failed with engine.ErrCorrupt", o, err)
	}
	testwait.Until(t, "the bad object's removal", 30*time.Second, func() bool { return b.Store.Stats().Removed == 1 })
	if _, err := raw.Get(context.Background(), name); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the bad object after its removal: %v, want it gone", err)
	}
	if n, _ := b.Eng.Lookup(context.Background(), b.NS, keys); n != 0 {
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
	a := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "a"), cfg)
	keys, _ := a.StoreKeys(t, "deleted", 2)
	b := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "b"), cfg)
	if n, err := b.Eng.Delete(context.Background(), b.NS, keys[:1]); err != nil || n != 1 {
		t.Fatalf("delete of a key the bucket holds: %d, %v; want 1", n, err)
	}
	testwait.Until(t, "the object's removal", 30*time.Second, func() bool { return b.Store.Stats().Deleted == 1 })
	name := b.Store.Name(b.Geo.Fingerprint(), keys[0])
	if _, err := objstore.RawClient(b.Store).Get(context.Background(), name); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the deleted key's object: %v, want it gone", err)
	}
	c := objstoretest.OpenNode(t, filepath.Join(t.TempDir(), "c"), cfg)
	if n, _ := c.Eng.Lookup(context.Background(), c.NS, keys); n != 0 {
		t.Fatalf("a node opened after the delete finds %d leading keys, want 0", n)
	}
	if n, _ := c.Eng.Lookup(context.Background(), c.NS, keys[1:]); n != 1 {
		t.Fatal("the key not deleted is no hit")
	}
}
