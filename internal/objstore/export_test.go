package objstore

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"sync"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
)

// Raw reads and writes a Store's objects behind its back, for tests.
type Raw struct{ s *Store }

// RawClient returns s's client as a Raw.
func RawClient(s *Store) Raw { return Raw{s} }

// Get returns the bytes of the object name; an error matching
// fs.ErrNotExist where it is gone.
func (r Raw) Get(ctx context.Context, name string) ([]byte, error) {
	out, err := r.s.client.GetObject(ctx, &s3.GetObjectInput{Bucket: &r.s.cfg.Bucket, Key: &name})
	if err != nil {
		return nil, fmt.Errorf("get %s: %w", name, describe(err))
	}
	defer out.Body.Close()
	return io.ReadAll(out.Body)
}

// Put writes b as the object name.
func (r Raw) Put(ctx context.Context, name string, b []byte) error {
	_, err := r.s.client.PutObject(ctx, &s3.PutObjectInput{Bucket: &r.s.cfg.Bucket, Key: &name, Body: bytes.NewReader(b), ContentLength: aws.Int64(int64(len(b)))})
	return err
}

// ParallelGet reads every object of names (each of size bytes) into buf
// (len(names)·size bytes) by ranged GETs of rangeSize, inflight at once,
// with the store's client: the ceiling its loads are measured against.
func (r Raw) ParallelGet(ctx context.Context, names []string, size, rangeSize int64, inflight int, buf []byte) error {
	sem := make(chan struct{}, inflight)
	errs := make(chan error, 1)
	var wg sync.WaitGroup
	for i, name := range names {
		for off := int64(0); off < size; {
			// As File.ReadvAt: a remainder shorter than a quarter of
			// rangeSize goes with the range before it.
			end := min(off+rangeSize, size)
			if size-end < rangeSize/4 {
				end = size
			}
			sem <- struct{}{}
			wg.Add(1)
			go func(off, end int64) {
				defer func() { <-sem; wg.Done() }()
				rng := fmt.Sprintf("bytes=%d-%d", off, end-1)
				out, err := r.s.client.GetObject(ctx, &s3.GetObjectInput{Bucket: &r.s.cfg.Bucket, Key: &name, Range: &rng})
				if err == nil {
					_, err = io.ReadFull(out.Body, buf[int64(i)*size+off:int64(i)*size+end])
					out.Body.Close()
				}
				if err != nil {
					select {
					case errs <- err:
					default:
					}
				}
			}(off, end)
			off = end
		}
	}
	wg.Wait()
	select {
	case err := <-errs:
		return err
	default:
		return nil
	}
}

// DenyGet sets a bucket policy that refuses every GET of the object name.
func (r Raw) DenyGet(ctx context.Context, name string) error {
	doc := fmt.Sprintf(`{"Version":"2012-10-17","Statement":[{"Effect":"Deny","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::%s/%s"}]}`, r.s.cfg.Bucket, name)
	_, err := r.s.client.PutBucketPolicy(ctx, &s3.PutBucketPolicyInput{Bucket: &r.s.cfg.Bucket, Policy: &doc})
	return err
}
