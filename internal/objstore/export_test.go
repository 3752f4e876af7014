package objstore

import (
	"bytes"
	"context"
	"fmt"
	"io"

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
