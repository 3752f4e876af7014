// Package objstore is kvhost's object mount: one object per key in an S3
// bucket (Ceph RGW, MinIO, a cloud store), in the file format of
// docs/format.md, so that nodes that share no file system share a cache,
// and a node whose disks were wiped or replaced finds its keys again
// (docs/object.md).
//
// A Store implements engine.Objects. Loads read an object through a File
// whose reads are ranged GETs straight into the caller's buffers, a large
// read split into parallel ranges; the engine verifies the header and the
// CRC-32C of every load. Stores reach it as files the engine published:
// the Store copies each one in the background (a PUT, or a multipart
// upload for large ones), verifying its checksums on the way, so that
// what it publishes is a whole, checked object or nothing (S3 makes a PUT
// and a completed multipart upload visible at once). Which keys the
// bucket holds it keeps in memory, from what it uploaded and from
// listings paced by Config.ListInterval: a lookup costs no request.
package objstore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/aws/retry"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
)

// Defaults of Config's zero fields.
const (
	DefaultRegion         = "us-east-1"
	DefaultRequestTimeout = 30 * time.Second
	DefaultPartSize       = 16 << 20
	DefaultRangeSize      = 4 << 20
	DefaultRequests       = 32
	DefaultUploads        = 4
	DefaultQueue          = 1024
	DefaultListInterval   = 30 * time.Second
)

// ErrConfig is wrapped by Open's errors about the configuration.
var ErrConfig = errors.New("objstore: invalid configuration")

// Config configures a Store (docs/object.md; the [objects] section of
// kvhost's configuration).
type Config struct {
	// Endpoint is the S3 endpoint's URL, such as http://127.0.0.1:7480.
	Endpoint string
	// Bucket holds the objects; Open fails if it does not exist, unless
	// CreateBucket.
	Bucket string
	// Prefix is put before every object's name ("kvhost/"): several
	// caches may share a bucket under different prefixes.
	Prefix string
	// Region signs the requests (DefaultRegion; RGW ignores it).
	Region string
	// AccessKey and SecretKey sign the requests.
	AccessKey, SecretKey string
	// CreateBucket makes the bucket at Open where it is missing.
	CreateBucket bool
	// RequestTimeout bounds every request, its body included
	// (DefaultRequestTimeout): a store or endpoint that stops answering
	// fails the request, and the load or upload, past it.
	RequestTimeout time.Duration
	// PartSize is the part of a multipart upload, and the largest object
	// uploaded by one PUT (DefaultPartSize; at least 5 MiB, S3's least).
	PartSize int64
	// RangeSize is the bytes of one ranged GET of a load
	// (DefaultRangeSize): the header's GET reads as much, a larger read
	// is split into ranges in parallel, aligned to it, a remainder under
	// a quarter of it read with the last (File.ReadvAt).
	RangeSize int64
	// Requests bounds the GETs and part uploads in flight at once, over
	// every load and upload (DefaultRequests).
	Requests int
	// Uploads is the number of files copied to the bucket at once
	// (DefaultUploads); Queue, the files waiting (DefaultQueue): a file
	// published while the queue is full is not copied (Stats.Dropped).
	Uploads, Queue int
	// ListInterval is the period of the listings that learn what other
	// nodes stored (DefaultListInterval); negative lists only at Open.
	ListInterval time.Duration
	// Capacity bounds the bytes of the objects under Prefix, every
	// node's (0: no bound). An upload that would pass it first evicts the
	// least recently used objects, down to evictTo of it (capacity.go).
	// The first node with one writes it to the bucket; a node without one
	// takes it, a node with another fails Open (agreeBound).
	Capacity int64
	// Logger receives the store's logs (default slog.Default()).
	Logger *slog.Logger
}

// withDefaults returns c with its zero fields set, or an error naming
// what is wrong.
func (c Config) withDefaults() (Config, error) {
	if c.Endpoint == "" || !(strings.HasPrefix(c.Endpoint, "http://") || strings.HasPrefix(c.Endpoint, "https://")) {
		return c, fmt.Errorf("%w: endpoint %q: want an http:// or https:// URL", ErrConfig, c.Endpoint)
	}
	if c.Bucket == "" {
		return c, fmt.Errorf("%w: no bucket", ErrConfig)
	}
	if c.AccessKey == "" || c.SecretKey == "" {
		return c, fmt.Errorf("%w: no access key or secret key", ErrConfig)
	}
	if c.Region == "" {
		c.Region = DefaultRegion
	}
	if c.RequestTimeout == 0 {
		c.RequestTimeout = DefaultRequestTimeout
	}
	if c.PartSize == 0 {
		c.PartSize = DefaultPartSize
	}
	if c.PartSize < 5<<20 {
		return c, fmt.Errorf("%w: part size %d: S3's least is 5 MiB", ErrConfig, c.PartSize)
	}
	if c.RangeSize <= 0 {
		c.RangeSize = DefaultRangeSize
	}
	if c.Requests <= 0 {
		c.Requests = DefaultRequests
	}
	if c.Uploads <= 0 {
		c.Uploads = DefaultUploads
	}
	if c.Queue <= 0 {
		c.Queue = DefaultQueue
	}
	if c.ListInterval == 0 {
		c.ListInterval = DefaultListInterval
	}
	if c.Capacity < 0 {
		return c, fmt.Errorf("%w: capacity %d: want 0 (no bound) or a size in bytes", ErrConfig, c.Capacity)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c, nil
}

// Stats counts what a Store did since Open.
type Stats struct {
	Objects   int    // keys known to be in the bucket
	Uploaded  uint64 // files copied to the bucket
	Skipped   uint64 // files not copied: the bucket had the key
	Failed    uint64 // copies that failed (an error, a file that changed or vanished)
	Dropped   uint64 // files not copied: the queue was full
	Gets      uint64 // GET requests of loads
	GetBytes  uint64 // bytes those read
	GetErrors uint64 // GETs that failed
	Removed   uint64 // objects removed as bad
	Deleted   uint64 // objects removed as their keys were deleted
	Evicted   uint64 // objects removed to keep the prefix within Capacity
	Purged    uint64 // objects removed by purges of their namespaces
	Full      uint64 // uploads refused for room: Capacity, or the store's quota
	Vanished  uint64 // objects a listing found gone (another node removed them)
	Listings  uint64 // listings of the bucket
	Used      int64  // bytes of the objects known to be in the bucket
}

// Store is an object mount on one bucket. Its methods may be called from
// many goroutines at once.
type Store struct {
	cfg    Config
	client *s3.Client
	// reqs bounds the requests in flight (Config.Requests).
	reqs chan struct{}

	mu sync.RWMutex
	// present is the objects the bucket holds, as known, in the order
	// evictions take them.
	present *known
	// reserved is the bytes of the uploads under way that took room
	// within Capacity (capacity.go).
	reserved int64
	// since is what uploads added while a listing ran, gone what was
	// found missing or bad meanwhile: the listing's end keeps both.
	since map[string]object
	gone  map[string]struct{}
	// deleting are the bad objects whose removal is under way: no
	// listing finds them.
	deleting map[string]struct{}

	// heads is the memory of the Files' heads (File.head): slices of
	// RangeSize bytes.
	heads sync.Pool

	// room serializes the evictions that make room within Capacity.
	room sync.Mutex
	// onGone, where set (OnGone), is told of every object that left the
	// bucket other than by Delete, Bad or Purge: evicted, or found gone.
	onGone atomic.Pointer[func(fp uint64, key []byte, evicted bool)]

	queue  chan upload
	ctx    context.Context // ended by Close
	cancel context.CancelFunc
	wg     sync.WaitGroup

	uploaded, skipped, failed, dropped atomic.Uint64
	gets, getBytes, getErrors          atomic.Uint64
	removed, deleted, listings         atomic.Uint64
	evicted, purged, full, vanished    atomic.Uint64
}

// object is what a Store knows of an object in the bucket.
type object struct {
	size int64 // its bytes
	at   int64 // its last use known here: its upload, a load, or its listing's modification time (Unix ns)
	// partial: its last load here read part of it (a layer range), so
	// the next one reads the header alone (File.small).
	partial bool
}

// upload is a published file to copy.
type upload struct {
	fp   uint64
	key  []byte
	path string
}

// Open connects to the bucket, lists what it holds under the prefix and
// starts the uploads and the paced listings. ctx bounds the first
// listing.
func Open(ctx context.Context, cfg Config) (*Store, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	hc := awshttp.NewBuildableClient().WithTransportOptions(func(t *http.Transport) {
		t.MaxIdleConns = 2 * cfg.Requests
		t.MaxIdleConnsPerHost = 2 * cfg.Requests
		t.ResponseHeaderTimeout = cfg.RequestTimeout
	})
	client := s3.New(s3.Options{
		Region:       cfg.Region,
		BaseEndpoint: aws.String(cfg.Endpoint),
		UsePathStyle: true,
		Credentials:  credentials.NewStaticCredentialsProvider(cfg.AccessKey, cfg.SecretKey, ""),
		HTTPClient:   hc,
		Retryer: retry.NewStandard(func(o *retry.StandardOptions) {
			o.MaxAttempts = 3
			o.MaxBackoff = 500 * time.Millisecond
		}),
		// kvhost checks its own CRC-32C over the payload; RGW takes no
		// trailing checksums of the newer SDKs.
		RequestChecksumCalculation: aws.RequestChecksumCalculationWhenRequired,
		ResponseChecksumValidation: aws.ResponseChecksumValidationWhenRequired,
	})
	s := newStore(cfg, client)
	if err := s.checkBucket(ctx); err != nil {
		return nil, err
	}
	if err := s.agreeBound(ctx); err != nil {
		return nil, err
	}
	if err := s.list(ctx); err != nil {
		return nil, err
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	for range cfg.Uploads {
		s.wg.Add(1)
		go s.uploader()
	}
	if cfg.ListInterval > 0 {
		s.wg.Add(1)
		go s.lister()
	}
	return s, nil
}

// newStore returns a Store on client, knowing of no object yet, with
// nothing started.
func newStore(cfg Config, client *s3.Client) *Store {
	s := &Store{cfg: cfg, client: client, reqs: make(chan struct{}, cfg.Requests), present: newKnown(nil), deleting: map[string]struct{}{}, queue: make(chan upload, cfg.Queue)}
	s.heads.New = func() any { b := make([]byte, cfg.RangeSize); return &b }
	return s
}

// Close stops the uploads and listings. Uploads under way are abandoned
// (a multipart one aborted, bounded by the request timeout): the files
// are the engine's, and a later store of their keys copies them again.
func (s *Store) Close() error {
	s.cancel()
	s.wg.Wait()
	return nil
}

// Stats returns the store's counts.
func (s *Store) Stats() Stats {
	s.mu.RLock()
	n, used := s.present.len(), s.present.used
	s.mu.RUnlock()
	return Stats{
		Objects: n, Uploaded: s.uploaded.Load(), Skipped: s.skipped.Load(), Failed: s.failed.Load(), Dropped: s.dropped.Load(),
		Gets: s.gets.Load(), GetBytes: s.getBytes.Load(), GetErrors: s.getErrors.Load(), Removed: s.removed.Load(), Deleted: s.deleted.Load(),
		Evicted: s.evicted.Load(), Purged: s.purged.Load(), Full: s.full.Load(), Vanished: s.vanished.Load(), Listings: s.listings.Load(), Used: used,
	}
}

// Name is the object name of key in the namespace of fingerprint fp:
// Prefix, the fingerprint in 16 hexadecimal digits, a slash, the key in
// hexadecimal.
func (s *Store) Name(fp uint64, key []byte) string {
	return fmt.Sprintf("%s%016x/%x", s.cfg.Prefix, fp, key)
}

// Has reports whether the bucket is known to hold key of the namespace of
// fingerprint fp: uploaded by this store, or found by a listing, and not
// found missing or bad since. It sends no request.
func (s *Store) Has(fp uint64, key []byte) bool {
	name := s.Name(fp, key)
	s.mu.RLock()
	_, ok := s.present.get(name)
	s.mu.RUnlock()
	return ok
}

// add records name, of size bytes, as in the bucket, used now.
func (s *Store) add(name string, size int64) {
	s.mu.Lock()
	o := object{size: size, at: time.Now().UnixNano()}
	s.present.set(name, o)
	if s.since != nil {
		s.since[name] = o
		delete(s.gone, name)
	}
	s.mu.Unlock()
}

// forget records name as not in the bucket.
func (s *Store) forget(name string) {
	s.mu.Lock()
	s.forgetLocked(name)
	s.mu.Unlock()
}

// forgetLocked is forget with s.mu held.
func (s *Store) forgetLocked(name string) {
	s.present.remove(name)
	if s.since != nil {
		delete(s.since, name)
		s.gone[name] = struct{}{}
	}
}

// touch records a use of name now (a load), which an eviction ranks by,
// and returns what is known of it.
func (s *Store) touch(name string) (object, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	o, ok := s.present.get(name)
	if ok {
		o.at = time.Now().UnixNano()
		s.present.set(name, o)
	}
	return o, ok
}

// loaded records whether the last load of name read part of it.
func (s *Store) loaded(name string, partial bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if o, ok := s.present.get(name); ok && o.partial != partial {
		o.partial = partial
		s.present.set(name, o)
	}
}

// Bad forgets key's object, which failed a load's checks, and removes it
// from the bucket in the background, so that a later store of the key
// copies a good one.
func (s *Store) Bad(fp uint64, key []byte, err error) {
	name := s.Name(fp, key)
	s.cfg.Logger.Warn("objstore: bad object removed", "object", name, "err", err)
	s.remove(name, &s.removed)
}

// Delete forgets key's object, which a client deleted, and removes it
// from the bucket in the background.
func (s *Store) Delete(fp uint64, key []byte) { s.remove(s.Name(fp, key), &s.deleted) }

// remove forgets name at once and removes its object in the background,
// counting the removal in done. The name stays out of the presence set
// while the removal runs and through the listing under way then.
func (s *Store) remove(name string, done *atomic.Uint64) {
	s.forget(name)
	s.mu.Lock()
	s.deleting[name] = struct{}{}
	s.mu.Unlock()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer func() {
			s.mu.Lock()
			delete(s.deleting, name)
			if s.gone != nil {
				s.gone[name] = struct{}{} // a listing under way may have found it
			}
			s.mu.Unlock()
		}()
		ctx, cancel := context.WithTimeout(s.ctx, s.cfg.RequestTimeout)
		defer cancel()
		if _, err := s.client.DeleteObject(ctx, &s3.DeleteObjectInput{Bucket: &s.cfg.Bucket, Key: &name}); err != nil {
			s.cfg.Logger.Warn("objstore: removing an object", "object", name, "err", err)
			return
		}
		done.Add(1)
	}()
}

// checkBucket fails naming the bucket and the endpoint's answer where the
// bucket cannot be reached (wrong credentials, no such bucket), making it
// with CreateBucket.
func (s *Store) checkBucket(ctx context.Context) error {
	rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	_, err := s.client.HeadBucket(rctx, &s3.HeadBucketInput{Bucket: &s.cfg.Bucket})
	if err == nil {
		return nil
	}
	if s.cfg.CreateBucket && isNotFound(err) {
		if _, cerr := s.client.CreateBucket(rctx, &s3.CreateBucketInput{Bucket: &s.cfg.Bucket}); cerr == nil {
			return nil
		} else {
			err = cerr
		}
	}
	return fmt.Errorf("objstore: bucket %s at %s: %w", s.cfg.Bucket, s.cfg.Endpoint, describe(err))
}

// list replaces the presence set by a listing of the prefix, keeping
// what uploads added while it ran.
func (s *Store) list(ctx context.Context) error {
	s.mu.Lock()
	s.since, s.gone = map[string]object{}, map[string]struct{}{}
	s.mu.Unlock()
	found := map[string]object{}
	p := s3.NewListObjectsV2Paginator(s.client, &s3.ListObjectsV2Input{Bucket: &s.cfg.Bucket, Prefix: &s.cfg.Prefix})
	var err error
	for p.HasMorePages() {
		rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
		var page *s3.ListObjectsV2Output
		page, err = p.NextPage(rctx)
		cancel()
		if err != nil {
			break
		}
		for _, o := range page.Contents {
			if o.Key != nil && s.ours(*o.Key) {
				found[*o.Key] = object{size: aws.ToInt64(o.Size), at: aws.ToTime(o.LastModified).UnixNano()}
			}
		}
	}
	s.mu.Lock()
	since, gone := s.since, s.gone
	s.since, s.gone = nil, nil
	if err != nil {
		s.mu.Unlock()
		return fmt.Errorf("objstore: listing bucket %s at %s: %w", s.cfg.Bucket, s.cfg.Endpoint, describe(err))
	}
	for name, o := range since {
		found[name] = o
	}
	for name := range gone {
		delete(found, name)
	}
	for name := range s.deleting {
		delete(found, name)
	}
	for name, o := range found {
		if old, ok := s.present.get(name); ok {
			o.at = max(o.at, old.at) // a use here since its upload
			o.partial = old.partial
			found[name] = o
		}
	}
	// What the last listing or an upload knew and this one did not find
	// left behind this store's back: another node evicted, deleted or
	// purged it.
	var vanished []string
	for name := range s.present.names() {
		if _, ok := found[name]; !ok {
			vanished = append(vanished, name)
		}
	}
	s.present = newKnown(found)
	s.mu.Unlock()
	s.listings.Add(1)
	s.vanished.Add(uint64(len(vanished)))
	s.tellGone(vanished, false)
	return nil
}

// ours reports whether name is an object name of Name's form.
func (s *Store) ours(name string) bool {
	rest, ok := strings.CutPrefix(name, s.cfg.Prefix)
	if !ok || len(rest) < 18 || rest[16] != '/' {
		return false
	}
	_, err := strconv.ParseUint(rest[:16], 16, 64)
	return err == nil
}

// lister lists the bucket every ListInterval until Close.
func (s *Store) lister() {
	defer s.wg.Done()
	t := time.NewTicker(s.cfg.ListInterval)
	defer t.Stop()
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-t.C:
		}
		if err := s.list(s.ctx); err != nil && s.ctx.Err() == nil {
			s.cfg.Logger.Warn("objstore: listing failed; keeping the last one", "err", err)
		}
	}
}

// acquire takes a request slot, or fails with ctx's error.
func (s *Store) acquire(ctx context.Context) error {
	select {
	case s.reqs <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (s *Store) release() { <-s.reqs }
