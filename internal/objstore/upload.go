package objstore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"syscall"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"

	"github.com/kvhost/kvhost/internal/crc32c"
	"github.com/kvhost/kvhost/internal/format"
)

// ErrChanged is wrapped by the error of an upload whose file did not
// verify (replaced or rewritten while it was read): nothing was published.
var ErrChanged = errors.New("objstore: the file changed while it was copied")

// Published queues the file at path, holding key of the namespace of
// fingerprint fp, for copying to the bucket (engine.Objects). It never
// blocks: with the queue full the file is not copied (Stats.Dropped).
func (s *Store) Published(fp uint64, key []byte, path string) {
	select {
	case s.queue <- upload{fp: fp, key: bytes.Clone(key), path: path}:
	default:
		s.dropped.Add(1)
	}
}

// uploader copies queued files until Close.
func (s *Store) uploader() {
	defer s.wg.Done()
	for {
		select {
		case <-s.ctx.Done():
			return
		case u := <-s.queue:
			if s.Has(u.fp, u.key) {
				s.skipped.Add(1)
				continue
			}
			if err := s.Upload(s.ctx, u.fp, u.key, u.path); err != nil {
				s.failed.Add(1)
				if s.ctx.Err() == nil {
					s.cfg.Logger.Warn("objstore: copy to the bucket failed", "path", u.path, "err", err)
				}
				continue
			}
			s.uploaded.Add(1)
		}
	}
}

// Upload copies the file at path, which must hold key alone, of the
// namespace of fingerprint fp, with payload checksums, to key's object:
// one PUT up to PartSize, else a multipart upload. The file's header and
// payload checksum are verified on the way; an object is published only
// whole and verified (S3 publishes a PUT, and a multipart upload at its
// completion, at once), else the multipart upload is aborted.
func (s *Store) Upload(ctx context.Context, fp uint64, key []byte, path string) error {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return fmt.Errorf("objstore: upload: %w", err)
	}
	defer f.Close()
	head := make([]byte, 4096)
	if _, err := io.ReadFull(f, head); err != nil {
		return fmt.Errorf("objstore: upload %s: reading the header: %w", path, err)
	}
	hl, err := format.Peek(head)
	if err == nil && hl > len(head) {
		head = make([]byte, hl)
		_, err = f.ReadAt(head, 0)
	}
	var h *format.Header
	if err == nil {
		h, err = format.Decode(head)
	}
	if err != nil {
		return fmt.Errorf("objstore: upload %s: %w: %w", path, ErrChanged, err)
	}
	if len(h.Keys) != 1 || h.Fingerprint != fp || !bytes.Equal(h.Keys[0].Key, key) || h.Flags&format.FlagPayloadSums == 0 {
		return fmt.Errorf("objstore: upload %s: %w: not a checked file of key %x alone", path, ErrChanged, key)
	}
	name := s.Name(fp, key)
	size := h.FileLen()
	release, err := s.takeRoom(ctx, size)
	if err != nil {
		s.full.Add(1)
		return fmt.Errorf("objstore: upload %s to %s: %w", path, name, err)
	}
	defer release()
	err = s.send(ctx, f, h, name, size)
	if errors.Is(err, ErrFull) && s.cfg.Capacity > 0 {
		// The store's quota is below the bound, or holds what this
		// store does not count (other prefixes, other nodes' uploads
		// since the last listing): room of the object's size more.
		if err = s.evict(ctx, size); err == nil {
			err = s.send(ctx, f, h, name, size)
		}
	}
	if err != nil {
		if errors.Is(err, ErrFull) {
			s.full.Add(1)
		}
		return fmt.Errorf("objstore: upload %s to %s: %w", path, name, err)
	}
	s.add(name, size)
	return nil
}

// send uploads the size bytes of f, whose header is h, as name: one PUT
// up to PartSize, else a multipart upload.
func (s *Store) send(ctx context.Context, f *os.File, h *format.Header, name string, size int64) error {
	if size <= s.cfg.PartSize {
		return s.put(ctx, f, h, name, size)
	}
	return s.multipart(ctx, f, h, name, size)
}

// payloadSum folds the payload bytes of b, the file's bytes at off, into
// sum.
func payloadSum(sum uint32, h *format.Header, b []byte, off int64) uint32 {
	start, end := int64(h.Len()), int64(h.Len())+h.PayloadLen()
	lo, hi := max(off, start), min(off+int64(len(b)), end)
	if lo >= hi {
		return sum
	}
	return crc32c.Update(sum, b[lo-off:hi-off])
}

// put uploads the size bytes of f as name with one PUT, once they verify.
func (s *Store) put(ctx context.Context, f *os.File, h *format.Header, name string, size int64) error {
	buf := make([]byte, size)
	if _, err := f.ReadAt(buf, 0); err != nil {
		return fmt.Errorf("%w: %w", ErrChanged, err)
	}
	if got := payloadSum(0, h, buf, 0); got != h.Keys[0].Sum {
		return fmt.Errorf("%w: payload checksum 0x%08x, the header says 0x%08x", ErrChanged, got, h.Keys[0].Sum)
	}
	if err := s.acquire(ctx); err != nil {
		return err
	}
	defer s.release()
	rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	_, err := s.client.PutObject(rctx, &s3.PutObjectInput{Bucket: &s.cfg.Bucket, Key: &name, Body: bytes.NewReader(buf), ContentLength: aws.Int64(size)})
	if err != nil {
		return describe(err)
	}
	return nil
}

// multipart uploads the size bytes of f as name in parts of PartSize, at
// most Requests at once over the store, and completes the upload once the
// payload verified; it aborts it on any failure.
func (s *Store) multipart(ctx context.Context, f *os.File, h *format.Header, name string, size int64) (err error) {
	rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	out, err := s.client.CreateMultipartUpload(rctx, &s3.CreateMultipartUploadInput{Bucket: &s.cfg.Bucket, Key: &name})
	cancel()
	if err != nil {
		return describe(err)
	}
	id := out.UploadId
	defer func() {
		if err == nil {
			return
		}
		// Aborted even after ctx ended: the parts would hold the bucket's
		// room until the store's lifecycle rules, if any, removed them.
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.RequestTimeout)
		defer cancel()
		if _, aerr := s.client.AbortMultipartUpload(actx, &s3.AbortMultipartUploadInput{Bucket: &s.cfg.Bucket, Key: &name, UploadId: id}); aerr != nil {
			s.cfg.Logger.Warn("objstore: aborting a multipart upload", "object", name, "err", aerr)
		}
	}()
	nparts := int((size + s.cfg.PartSize - 1) / s.cfg.PartSize)
	parts := make([]types.CompletedPart, nparts)
	errs := make([]error, nparts)
	var sum uint32
	var wg sync.WaitGroup
	for i := range nparts {
		off := int64(i) * s.cfg.PartSize
		buf := make([]byte, min(s.cfg.PartSize, size-off))
		if _, err := f.ReadAt(buf, off); err != nil {
			wg.Wait()
			return fmt.Errorf("%w: %w", ErrChanged, err)
		}
		sum = payloadSum(sum, h, buf, off) // parts are read in order
		if err := s.acquire(ctx); err != nil {
			wg.Wait()
			return err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer s.release()
			pctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
			defer cancel()
			n := int32(i + 1)
			po, err := s.client.UploadPart(pctx, &s3.UploadPartInput{Bucket: &s.cfg.Bucket, Key: &name, UploadId: id, PartNumber: &n, Body: bytes.NewReader(buf), ContentLength: aws.Int64(int64(len(buf)))})
			if err != nil {
				errs[i] = describe(err)
				return
			}
			parts[i] = types.CompletedPart{ETag: po.ETag, PartNumber: &n}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if sum != h.Keys[0].Sum {
		return fmt.Errorf("%w: payload checksum 0x%08x, the header says 0x%08x", ErrChanged, sum, h.Keys[0].Sum)
	}
	rctx, cancel = context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	_, err = s.client.CompleteMultipartUpload(rctx, &s3.CompleteMultipartUploadInput{Bucket: &s.cfg.Bucket, Key: &name, UploadId: id, MultipartUpload: &types.CompletedMultipartUpload{Parts: parts}})
	if err != nil {
		return describe(err)
	}
	return nil
}
