package objstore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"sync"
	"sync/atomic"

	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/smithy-go"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/region"
)

// ErrCredentials is wrapped by the errors of requests the store refused
// for their keys or signature.
var ErrCredentials = errors.New("objstore: the store refused the credentials")

// ErrReadOnly is returned by the writes of a File: objects are written
// whole, by uploads (Published), never in place.
var ErrReadOnly = errors.New("objstore: an object is read-only")

// errorCode is the S3 error code of err ("NoSuchKey"), or "".
func errorCode(err error) string {
	var ae smithy.APIError
	if errors.As(err, &ae) {
		return ae.ErrorCode()
	}
	return ""
}

// httpStatus is the HTTP status of err's response, or 0.
func httpStatus(err error) int {
	var re *awshttp.ResponseError
	if errors.As(err, &re) {
		return re.HTTPStatusCode()
	}
	return 0
}

// isNotFound reports whether err says the object or bucket does not exist.
func isNotFound(err error) bool {
	switch errorCode(err) {
	case "NoSuchKey", "NotFound", "NoSuchBucket":
		return true
	}
	return httpStatus(err) == http.StatusNotFound
}

// describe wraps err with ErrCredentials where the store refused the
// request's keys or signature, with fs.ErrNotExist where the object
// or bucket does not exist, and with ErrFull where its quota refused it.
func describe(err error) error {
	switch code := errorCode(err); {
	case code == "QuotaExceeded": // a 403, as refused keys are
		return fmt.Errorf("%w (the store's quota, %s): %w", ErrFull, code, err)
	case code == "InvalidAccessKeyId" || code == "SignatureDoesNotMatch" || code == "AccessDenied" || httpStatus(err) == http.StatusForbidden:
		return fmt.Errorf("%w (%s): %w", ErrCredentials, code, err)
	case isNotFound(err):
		return fmt.Errorf("%w: %w", fs.ErrNotExist, err)
	}
	return err
}

// Open opens key's object for reading (engine.Objects): no request until
// the first read. A first read at offset 0 of at most Config.RangeSize
// (the header) reads the object's first RangeSize bytes, which later
// reads take from memory, unless the last load of the object read part
// of it (File.small); every other read is ranged GETs straight into
// the caller's buffers, several in parallel for a read larger than
// RangeSize, each bounded by the request timeout and by ctx.
func (s *Store) Open(ctx context.Context, fp uint64, key []byte) (fsys.File, error) {
	name := s.Name(fp, key)
	o, _ := s.touch(name) // a use, which evictions rank by
	return &File{s: s, ctx: ctx, name: name, size: o.size, small: o.partial}, nil
}

// File is an object open for reading: an fsys.File whose reads are
// ranged GETs into the caller's buffers. Its writes fail (ErrReadOnly).
type File struct {
	s    *Store
	ctx  context.Context
	name string
	// size is the object's size as the store knows it (0: unknown);
	// small, that its last load read part of it (a layer range): then
	// the first read is not a head of RangeSize, lest a key loaded layer
	// by layer read a range per layer. read counts the bytes its reads
	// returned, which tell Close whether this load read it whole.
	size  int64
	small bool
	read  atomic.Int64

	// mu guards head: the object's first bytes, read by the first read
	// (at offset 0, of at most RangeSize) as one GET of RangeSize, so
	// that the header's request brings the payload's first range with
	// it (fewer requests per load, and none of a few KiB alone). It
	// holds the whole object where that is shorter than RangeSize
	// (whole); nil until read and after Close.
	mu    sync.RWMutex
	head  *[]byte
	whole bool
}

// ReadAt reads len(p) bytes at off, as io.ReaderAt: io.EOF where the
// object ends first; an error matching fs.ErrNotExist where it is gone.
func (f *File) ReadAt(p []byte, off int64) (int, error) {
	n, err := f.ReadvAt([][]byte{p}, off)
	if err == nil && n < len(p) {
		err = io.EOF
	}
	return n, err
}

// ReadvAt reads into bufs in order from off, as preadv: fewer bytes where
// the object ends first, 0 at its end. The bytes of the object's head
// (see File) come from memory; the rest is read by ranges of RangeSize,
// aligned to it, in parallel, the last one taking a remainder shorter
// than a quarter of RangeSize with it: every range ends in a buffer's
// bytes, never in the daemon's.
func (f *File) ReadvAt(bufs [][]byte, off int64) (int, error) {
	return f.readv(bufs, off, nil)
}

// readv is ReadvAt that tells landed, where not nil, of every part of
// the object that reached bufs, [at, at+n), once it did, from the
// goroutine that read it (in a region.Guard): the mover checksums
// each extent there while other ranges are still on the way.
func (f *File) readv(bufs [][]byte, off int64, landed func(at, n int64)) (got int, err error) {
	defer func() { f.read.Add(int64(got)) }() // what Close judges the load by
	total := length(bufs)
	if total == 0 {
		return 0, nil
	}
	rs := f.s.cfg.RangeSize
	f.mu.Lock()
	if f.head == nil && off == 0 && total <= rs && !f.small {
		if err := f.readHead(); err != nil {
			f.mu.Unlock()
			return 0, err
		}
	}
	f.mu.Unlock()
	f.mu.RLock()
	defer f.mu.RUnlock()
	var n int64 // bytes read into bufs, from off
	if f.head != nil && off < int64(len(*f.head)) {
		head := (*f.head)[off:]
		for _, b := range bufs {
			c := copy(b, head)
			head, n = head[c:], n+int64(c)
			if c < len(b) {
				break
			}
		}
		if landed != nil && n > 0 {
			landed(off, n)
		}
		if n == total || f.whole {
			return int(n), nil
		}
	} else if f.head != nil && f.whole {
		return 0, nil // past the object's end
	}
	// Ranges that end at multiples of RangeSize, each its own sub-slices
	// of bufs, the last one taking a short remainder with it.
	type rng struct {
		bufs [][]byte
		off  int64
		want int64
		n    int
		err  error
	}
	var ranges []*rng
	for at := n; at < total; {
		end := min(total, (off+at)/rs*rs+rs-off)
		if total-end < rs/4 {
			end = total
		}
		ranges = append(ranges, &rng{bufs: within(bufs, at, end), off: off + at, want: end - at})
		at = end
	}
	// read reads r, and tells landed of it.
	read := func(r *rng) {
		r.n, r.err = f.get(r.bufs, r.off)
		if r.err == nil && r.n > 0 && landed != nil {
			landed(r.off, int64(r.n))
		}
	}
	if len(ranges) == 1 {
		read(ranges[0])
		return int(n) + ranges[0].n, ranges[0].err
	}
	var wg sync.WaitGroup
	for _, r := range ranges {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// A client that truncates the memory behind its region
			// fails this read, not the daemon.
			if err := region.Guard(func() error { read(r); return nil }); err != nil {
				r.err = err
			}
		}()
	}
	wg.Wait()
	// The bytes read up to the first range that fell short or failed.
	for _, r := range ranges {
		n += int64(r.n)
		if r.err != nil {
			return int(n), r.err
		}
		if int64(r.n) < r.want {
			return int(n), nil
		}
	}
	return int(n), nil
}

// readHead reads the object's first RangeSize bytes into head, f.mu held.
func (f *File) readHead() error {
	p := f.s.heads.Get().(*[]byte)
	n, err := f.get([][]byte{*p}, 0)
	if err != nil {
		f.s.heads.Put(p)
		return err
	}
	h := (*p)[:n]
	f.head, f.whole = &h, int64(n) < f.s.cfg.RangeSize
	return nil
}

// length is the bytes of bufs.
func length(bufs [][]byte) int64 {
	var n int64
	for _, b := range bufs {
		n += int64(len(b))
	}
	return n
}

// within returns the sub-slices of bufs that hold their bytes from
// from to to, counted over bufs in order.
func within(bufs [][]byte, from, to int64) [][]byte {
	var out [][]byte
	var at int64
	for _, b := range bufs {
		l := int64(len(b))
		if at+l > from && at < to {
			out = append(out, b[max(from-at, 0):min(to-at, l)])
		}
		at += l
		if at >= to {
			break
		}
	}
	return out
}

// get reads one range into bufs with one GET: fewer bytes where the
// object ends first.
func (f *File) get(bufs [][]byte, off int64) (int, error) {
	s := f.s
	want := length(bufs)
	if err := s.acquire(f.ctx); err != nil {
		return 0, err
	}
	defer s.release()
	ctx, cancel := context.WithTimeout(f.ctx, s.cfg.RequestTimeout)
	defer cancel()
	s.gets.Add(1)
	rng := fmt.Sprintf("bytes=%d-%d", off, off+want-1)
	out, err := s.client.GetObject(ctx, &s3.GetObjectInput{Bucket: &s.cfg.Bucket, Key: &f.name, Range: &rng})
	if err != nil {
		if errorCode(err) == "InvalidRange" || httpStatus(err) == http.StatusRequestedRangeNotSatisfiable {
			return 0, nil // at or past the object's end
		}
		s.getErrors.Add(1)
		if isNotFound(err) {
			s.forget(f.name)
		}
		return 0, fmt.Errorf("objstore: get %s %s: %w", f.name, rng, describe(err))
	}
	defer out.Body.Close()
	// The range served: want bytes, or fewer where the object ends. A
	// body that ends before it is a broken transfer, not the object's end.
	served := aws.ToInt64(out.ContentLength)
	if served < 0 || served > want {
		s.getErrors.Add(1)
		return 0, fmt.Errorf("objstore: get %s %s: the answer has %d bytes", f.name, rng, served)
	}
	var n int
	for _, b := range bufs {
		if int64(n) == served {
			break
		}
		b = b[:min(int64(len(b)), served-int64(n))]
		got, err := io.ReadFull(out.Body, b)
		n += got
		if err != nil {
			s.getErrors.Add(1)
			return n, fmt.Errorf("objstore: get %s %s: %d of %d bytes: %w", f.name, rng, n, served, err)
		}
	}
	s.getBytes.Add(uint64(n))
	return n, nil
}

// WriteAt fails: objects are read-only.
func (f *File) WriteAt([]byte, int64) (int, error) { return 0, ErrReadOnly }

// WritevAt fails: objects are read-only.
func (f *File) WritevAt([][]byte, int64) (int, error) { return 0, ErrReadOnly }

// Allocate fails: objects are read-only.
func (f *File) Allocate(int64) error { return ErrReadOnly }

// Sync does nothing: there is nothing written to flush.
func (f *File) Sync() error { return nil }

// Close gives back the memory of the object's head and records whether
// the load read the object whole (File.small); a File holds no
// connection between reads. Reads after Close read the object again.
func (f *File) Close() error {
	// An object of more than one range read in part (a layer range):
	// the next load reads its header alone. One read whole: a head again.
	if n := f.read.Load(); n > 0 && f.size > f.s.cfg.RangeSize {
		f.s.loaded(f.name, n < f.size)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.head != nil {
		h := (*f.head)[:cap(*f.head)]
		f.s.heads.Put(&h)
		f.head, f.whole = nil, false
	}
	return nil
}

// Fd returns ^uintptr(0): an object has no descriptor, and a mover that
// needs one (cuFile) must not be given a File.
func (f *File) Fd() uintptr { return ^uintptr(0) }
