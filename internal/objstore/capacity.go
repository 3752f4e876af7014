package objstore

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"syscall"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"
)

// Capacity for the bucket (docs/object.md, "Capacity"): with a bound
// (Config.Capacity), an upload takes room for its object first; where the
// objects known under the prefix, every node's, and the uploads under way
// would pass the bound, it evicts the least recently used objects (by the
// uses this store saw: uploads and loads, else the listing's modification
// time) down to evictTo of the bound, in DeleteObjects requests of up to
// deleteBatch names, and tells the engine of each (OnGone). A store's
// quota that refuses an upload (QuotaExceeded) is a full bucket too: with
// a bound the upload evicts its size's worth more and tries once again.

// boundName is the name, after Prefix, of the object that holds the bound
// the nodes sharing the prefix agreed on (agreeBound): no key's object
// has it (ours).
const boundName = "kvhost-capacity"

// maxBound is the largest bound the bound's object may hold: 1 EiB.
const maxBound = 1 << 60

// agreeBound makes the bound one for every node of the prefix: the first
// node with Capacity writes it to the bound's object (a PUT if none is
// there), every later one reads it. A node without Capacity takes the
// agreed bound; one with another fails, naming both. An object that does
// not hold a bound (other bytes, a size out of range) fails Open, naming
// it: nothing stored is touched. A node without Capacity that cannot read
// the object (a store that refuses it) goes on without a bound, logged.
func (s *Store) agreeBound(ctx context.Context) error {
	name := s.cfg.Prefix + boundName
	agreed, found, err := s.readBound(ctx, name)
	if err != nil && s.cfg.Capacity == 0 && !errors.Is(err, ErrConfig) {
		s.cfg.Logger.Warn("objstore: the bound's object cannot be read; no bound", "object", name, "err", err)
		return nil
	}
	if err != nil {
		return err
	}
	if !found && s.cfg.Capacity > 0 {
		rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
		body := strconv.FormatInt(s.cfg.Capacity, 10) + "\n"
		_, err := s.client.PutObject(rctx, &s3.PutObjectInput{Bucket: &s.cfg.Bucket, Key: &name, Body: strings.NewReader(body), ContentLength: aws.Int64(int64(len(body))), IfNoneMatch: aws.String("*")})
		cancel()
		if err != nil && httpStatus(err) != 412 { // 412: another node wrote it first
			return fmt.Errorf("objstore: bucket %s: writing the bound's object %s: %w", s.cfg.Bucket, name, describe(err))
		}
		// Read back: where the store ignores If-None-Match, the last
		// writer's bound is the one.
		if agreed, found, err = s.readBound(ctx, name); err != nil {
			return err
		}
	}
	switch {
	case !found:
		return nil // no bound
	case s.cfg.Capacity == 0:
		s.cfg.Capacity = agreed
		s.cfg.Logger.Info("objstore: the bound the nodes agreed on", "object", name, "capacity", agreed)
	case s.cfg.Capacity != agreed:
		return fmt.Errorf("%w: capacity %d, but the nodes sharing bucket %s, prefix %q, agreed on %d (object %s): give every node the same, or remove the object to agree on another", ErrConfig, s.cfg.Capacity, s.cfg.Bucket, s.cfg.Prefix, agreed, name)
	}
	return nil
}

// readBound reads the bound's object name: the bound, and whether there
// is one.
func (s *Store) readBound(ctx context.Context, name string) (int64, bool, error) {
	rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	out, err := s.client.GetObject(rctx, &s3.GetObjectInput{Bucket: &s.cfg.Bucket, Key: &name})
	if err != nil {
		if isNotFound(err) {
			return 0, false, nil
		}
		return 0, false, fmt.Errorf("objstore: bucket %s: reading the bound's object %s: %w", s.cfg.Bucket, name, describe(err))
	}
	defer out.Body.Close()
	b, err := io.ReadAll(io.LimitReader(out.Body, 64))
	if err != nil {
		return 0, false, fmt.Errorf("objstore: bucket %s: reading the bound's object %s: %w", s.cfg.Bucket, name, err)
	}
	v, err := strconv.ParseInt(strings.TrimSuffix(string(b), "\n"), 10, 64)
	if err != nil || v < 1 || v > maxBound || aws.ToInt64(out.ContentLength) > 32 {
		return 0, false, fmt.Errorf("%w: the bound's object %s in bucket %s holds %q, not a size in bytes from 1 to 2^60 and a newline: remove it, or write the bound there", ErrConfig, name, s.cfg.Bucket, b)
	}
	return v, true, nil
}

// ErrFull is wrapped by the error of an upload refused for room: its
// object would not fit within Config.Capacity, even after evictions, or
// the store refused it (its quota: QuotaExceeded). Nothing stored is
// lost: the key's file stays on its mount, every other object stays. It
// matches syscall.ENOSPC, as engine.Objects asks.
var ErrFull error = errFull{}

// errFull is ErrFull's type.
type errFull struct{}

func (errFull) Error() string { return "objstore: the bucket is full" }

// Is makes ErrFull match syscall.ENOSPC.
func (errFull) Is(target error) bool { return target == syscall.ENOSPC }

// Usage returns the bytes and the number of the objects the store knows
// of under the prefix, and Config.Capacity (engine.Objects).
func (s *Store) Usage() (used, capacity int64, objects int) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.present.used, s.cfg.Capacity, s.present.len()
}

// evictTo is the share of Capacity an eviction leaves the objects
// and the uploads under way at, so that not every upload evicts.
const evictTo = 0.9

// deleteBatch is the most names of one DeleteObjects request (S3's most).
const deleteBatch = 1000

// OnGone sets fn to be told of every object that leaves the bucket other
// than by Delete, Bad or Purge: evicted by this store (evicted true), or
// found gone by a listing (another node evicted, deleted or purged it).
// fn must not call the store; it may be called from any goroutine.
func (s *Store) OnGone(fn func(fp uint64, key []byte, evicted bool)) {
	s.onGone.Store(&fn)
}

// tellGone tells OnGone's function of names, which left the bucket.
func (s *Store) tellGone(names []string, evicted bool) {
	fn := s.onGone.Load()
	if fn == nil {
		return
	}
	for _, name := range names {
		if fp, key, ok := s.parse(name); ok {
			(*fn)(fp, key, evicted)
		}
	}
}

// parse returns the fingerprint and key an object name of Name's form
// names.
func (s *Store) parse(name string) (fp uint64, key []byte, ok bool) {
	rest, ok := strings.CutPrefix(name, s.cfg.Prefix)
	if !ok || len(rest) < 18 || rest[16] != '/' {
		return 0, nil, false
	}
	fp, err := strconv.ParseUint(rest[:16], 16, 64)
	if err != nil {
		return 0, nil, false
	}
	key, err = hex.DecodeString(rest[17:])
	return fp, key, err == nil && len(key) > 0
}

// takeRoom takes room for an object of size bytes within Capacity,
// evicting first where the objects and the uploads under way would pass
// it; release gives the room back once the upload ended (its object then
// counts as present, where it succeeded). It fails with ErrFull where the
// object is larger than Capacity, or evictions left too little room.
func (s *Store) takeRoom(ctx context.Context, size int64) (release func(), err error) {
	bound := s.cfg.Capacity
	if bound == 0 {
		return func() {}, nil
	}
	if size > bound {
		return nil, fmt.Errorf("%w: an object of %d bytes is larger than the bound of %d bytes on bucket %s (capacity)", ErrFull, size, bound, s.cfg.Bucket)
	}
	give := func() {
		s.mu.Lock()
		s.reserved -= size
		s.mu.Unlock()
	}
	s.mu.Lock()
	if s.present.used+s.reserved+size <= bound {
		s.reserved += size
		s.mu.Unlock()
		return give, nil
	}
	s.mu.Unlock()
	s.room.Lock() // one eviction at a time: each finds the room the last made
	defer s.room.Unlock()
	s.mu.Lock()
	over := s.present.used + s.reserved + size - int64(evictTo*float64(bound))
	s.mu.Unlock()
	if over > 0 {
		if err := s.evict(ctx, over); err != nil {
			return nil, err
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.present.used+s.reserved+size > bound {
		return nil, fmt.Errorf("%w: bucket %s: %d of the bound's %d bytes held and %d being uploaded, %d more needed, and nothing left to evict", ErrFull, s.cfg.Bucket, s.present.used, bound, s.reserved, size)
	}
	s.reserved += size
	return give, nil
}

// evict removes the least recently used objects of at least want bytes,
// or every object, and tells OnGone of those removed. It fails only where
// ctx ended; an object whose removal failed is forgotten until the next
// listing finds it again.
func (s *Store) evict(ctx context.Context, want int64) error {
	names := s.victims(want)
	gone, err := s.deleteNames(ctx, names)
	s.evicted.Add(uint64(len(gone)))
	s.tellGone(gone, true)
	return err
}

// victims forgets the least recently used objects of at least want bytes,
// or every object, marks them deleting and returns their names, least
// recently used first: O(log n) each, taken from the root of the order
// the store keeps (known).
func (s *Store) victims(want int64) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var names []string
	for want > 0 {
		name, o, ok := s.present.oldest()
		if !ok {
			break
		}
		names = append(names, name)
		want -= o.size
		s.forgetLocked(name)
		s.deleting[name] = struct{}{}
	}
	return names
}

// deleteNames removes the objects names, which the caller forgot and
// marked deleting, in DeleteObjects requests of up to deleteBatch, and
// returns the names removed. An object already gone counts as removed.
// It fails only where ctx ended; the failures of names are logged.
func (s *Store) deleteNames(ctx context.Context, names []string) (gone []string, err error) {
	defer func() {
		s.mu.Lock()
		for _, name := range names {
			delete(s.deleting, name)
			if s.gone != nil {
				s.gone[name] = struct{}{} // a listing under way may have found it
			}
		}
		s.mu.Unlock()
	}()
	for len(names) > 0 && ctx.Err() == nil {
		batch := names[:min(len(names), deleteBatch)]
		names = names[len(batch):]
		ids := make([]types.ObjectIdentifier, len(batch))
		for i := range batch {
			ids[i] = types.ObjectIdentifier{Key: &batch[i]}
		}
		rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
		out, err := s.client.DeleteObjects(rctx, &s3.DeleteObjectsInput{Bucket: &s.cfg.Bucket, Delete: &types.Delete{Objects: ids, Quiet: aws.Bool(true)}})
		cancel()
		if err != nil {
			s.cfg.Logger.Warn("objstore: removing objects", "objects", len(batch), "err", describe(err))
			continue
		}
		failed := map[string]bool{}
		for _, e := range out.Errors {
			if e.Key != nil {
				failed[*e.Key] = true
				s.cfg.Logger.Warn("objstore: removing an object", "object", *e.Key, "code", *e.Code)
			}
		}
		for _, name := range batch {
			if !failed[name] {
				gone = append(gone, name)
			}
		}
	}
	return gone, ctx.Err()
}

// Purge removes every object of the namespace of fingerprint fp under the
// prefix, as listed now, and returns the keys it removed (engine.Objects).
// An object uploaded while it runs may stay.
func (s *Store) Purge(ctx context.Context, fp uint64) ([][]byte, error) {
	dir := fmt.Sprintf("%s%016x/", s.cfg.Prefix, fp)
	var names []string
	p := s3.NewListObjectsV2Paginator(s.client, &s3.ListObjectsV2Input{Bucket: &s.cfg.Bucket, Prefix: &dir})
	for p.HasMorePages() {
		rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
		page, err := p.NextPage(rctx)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("objstore: purge of namespace %016x: listing bucket %s: %w", fp, s.cfg.Bucket, describe(err))
		}
		for _, o := range page.Contents {
			if o.Key != nil && s.ours(*o.Key) {
				names = append(names, *o.Key)
			}
		}
	}
	// What this store knows of besides (uploaded since the listing).
	s.mu.Lock()
	listed := make(map[string]bool, len(names))
	for _, name := range names {
		listed[name] = true
	}
	for name := range s.present.names() {
		if strings.HasPrefix(name, dir) && !listed[name] {
			names = append(names, name)
		}
	}
	for _, name := range names {
		s.forgetLocked(name)
		s.deleting[name] = struct{}{}
	}
	s.mu.Unlock()
	gone, err := s.deleteNames(ctx, names)
	s.purged.Add(uint64(len(gone)))
	keys := make([][]byte, 0, len(gone))
	for _, name := range gone {
		if _, key, ok := s.parse(name); ok {
			keys = append(keys, key)
		}
	}
	if err != nil {
		return keys, fmt.Errorf("objstore: purge of namespace %016x: %w", fp, err)
	}
	if len(gone) < len(names) {
		return keys, fmt.Errorf("objstore: purge of namespace %016x: %d of %d objects could not be removed (the log says why)", fp, len(names)-len(gone), len(names))
	}
	return keys, nil
}
