// Package s3local is a minimal S3 endpoint over a local directory, for
// tests and benchmarks where no object store can run (a GPU machine where
// nothing can be installed, a test machine without Ceph RGW); it is not
// for production. It serves what internal/objstore asks of a store
// through aws-sdk-go-v2, path-style only: buckets (HEAD, PUT, DELETE),
// PutObject (plain, Content-MD5, x-amz-checksum-* headers, and aws-chunked
// bodies, signed or not, with trailing checksums; If-None-Match: *),
// GetObject and HeadObject (one byte range, If-Match, If-None-Match),
// DeleteObject, DeleteObjects, ListObjectsV2 (prefix, start-after,
// continuation tokens; no delimiter), multipart uploads (create,
// upload a part, complete, abort) and the Deny statements of bucket
// policies (policy.go). Requests are checked against one key
// pair by their SigV4 signatures (docs/object.md, "Without an object
// store: s3local").
//
// Every object is a file under Config.Dir, at the bucket's directory
// followed by the object's key, each segment of the key between slashes
// a path element (bytes other than letters, digits and "-._~=+,:@"
// percent-encoded). A write goes to a temporary file in the object's
// directory, named with a '#', that is renamed over the object once
// whole and verified: a reader sees the old object or the new one, never
// half of one. Reads are served from the file (sendfile on Linux), never
// buffered whole. A key that is both an object and the folder of others
// ("a" and "a/b") cannot be stored: the second is refused (KeyConflict).
package s3local

import (
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Config configures a Server.
type Config struct {
	// Dir holds the buckets, one directory each; it must exist. On a
	// machine without disks to spare it can be a tmpfs.
	Dir string
	// AccessKey and SecretKey are the one key pair requests must be
	// signed with (SigV4). Both empty: any request is served, signed or
	// not.
	AccessKey, SecretKey string
	// Quota bounds the bytes of every object under Dir (0: no bound). A
	// PUT or a multipart completion that would pass it is refused with
	// 403 QuotaExceeded, as Ceph RGW refuses one past a user's quota.
	// Objects written to Dir behind the server's back are counted only
	// at New.
	Quota int64
	// Logger receives the server's errors (default slog.Default()).
	Logger *slog.Logger
}

// uploadsDir is the directory under Config.Dir that holds the multipart
// uploads under way. No bucket name starts with a '.'.
const uploadsDir = ".s3local-uploads"

// copyBufSize is the buffer of a copy into a file: large enough that a
// write is not a syscall per 32 KiB.
const copyBufSize = 1 << 20

// Server is an S3 endpoint over a directory: an http.Handler. Its methods
// may be called from many goroutines at once.
type Server struct {
	cfg     Config
	dir     string // Config.Dir, absolute
	uploads string // dir/uploadsDir
	bufs    sync.Pool
	reqID   atomic.Uint64

	// mu serializes, with a Quota, the writes' and removals' accounting:
	// used is the bytes of the objects, reserved those of the writes
	// under way.
	mu             sync.Mutex
	used, reserved int64

	// policyMu guards the buckets' policies (policy.go): their denials
	// and their documents.
	policyMu   sync.RWMutex
	policies   map[string][]denial
	policyDocs map[string][]byte
}

// New returns a Server over cfg.Dir, which must be a directory. It
// counts the bytes of the objects already there, and removes what a
// server stopped mid-write left (recover).
func New(cfg Config) (*Server, error) {
	if cfg.Dir == "" {
		return nil, errors.New("s3local: no directory")
	}
	if (cfg.AccessKey == "") != (cfg.SecretKey == "") {
		return nil, errors.New("s3local: an access key needs a secret key, and a secret key an access key")
	}
	if cfg.Quota < 0 {
		return nil, fmt.Errorf("s3local: quota %d: want 0 (no bound) or a size in bytes", cfg.Quota)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	dir, err := filepath.Abs(cfg.Dir)
	if err != nil {
		return nil, fmt.Errorf("s3local: directory %s: %w", cfg.Dir, err)
	}
	if fi, err := os.Stat(dir); err != nil {
		return nil, fmt.Errorf("s3local: %w", err)
	} else if !fi.IsDir() {
		return nil, fmt.Errorf("s3local: %s is not a directory", dir)
	}
	s := &Server{cfg: cfg, dir: dir, uploads: filepath.Join(dir, uploadsDir), policies: map[string][]denial{}, policyDocs: map[string][]byte{}}
	s.bufs.New = func() any { b := make([]byte, copyBufSize); return &b }
	if err := os.MkdirAll(s.uploads, 0o755); err != nil {
		return nil, fmt.Errorf("s3local: %w", err)
	}
	if s.used, err = s.recover(); err != nil {
		return nil, err
	}
	warmXML()
	return s, nil
}

// warmXML has encoding/xml learn every type the server marshals or
// unmarshals before any request does: its type cache is a sync.Map
// filled on first use, and two handlers meeting one type for the first
// time at once were reported as a data race on the type's entry (Go
// 1.26: two concurrent CompleteMultipartUpload replies, then two
// requests' part lists), as concurrent first use of a sync.Map has
// misbehaved before (Go issue 81189). Every struct type reachable from
// the messages is taught, the element types of their slices too, which
// a message with empty slices never reaches.
func warmXML() {
	seen := map[reflect.Type]bool{}
	for _, v := range []any{listResult{}, deleteResult{}, initiateResult{}, completeResult{}, errorXML{},
		deleteRequest{}, completeRequest{}} {
		warmXMLType(reflect.TypeOf(v), seen)
	}
}

// warmXMLType teaches encoding/xml struct type t and the struct types
// its fields hold, each once (seen): decoding any element into a t makes
// it build t's type information first (the element's name may then be
// refused: the error is not what is wanted).
func warmXMLType(t reflect.Type, seen map[reflect.Type]bool) {
	switch t.Kind() {
	case reflect.Slice, reflect.Array, reflect.Pointer:
		warmXMLType(t.Elem(), seen)
	case reflect.Struct:
		if seen[t] {
			return // taught already, or a type that holds itself
		}
		seen[t] = true
		_ = xml.Unmarshal([]byte("<warm/>"), reflect.New(t).Interface())
		for i := range t.NumField() {
			warmXMLType(t.Field(i).Type, seen)
		}
	}
}

// recover finishes what a server stopped mid-write left under the
// directory: it removes the temporary files, and gives back to the
// multipart uploads whose completion it stopped their directories. It
// returns the bytes of the objects.
func (s *Server) recover() (int64, error) {
	var used int64
	err := filepath.WalkDir(s.dir, func(p string, d fs.DirEntry, err error) error {
		switch {
		case err != nil:
			return err
		case p == s.uploads:
			return filepath.SkipDir
		case d.Type().IsRegular() && strings.HasPrefix(d.Name(), "#tmp-"):
			return os.Remove(p)
		case d.Type().IsRegular():
			fi, err := d.Info()
			if err != nil {
				return err
			}
			used += fi.Size()
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("s3local: reading %s: %w", s.dir, err)
	}
	ups, err := os.ReadDir(s.uploads)
	if err != nil {
		return 0, fmt.Errorf("s3local: %w", err)
	}
	for _, u := range ups {
		if id, ok := strings.CutSuffix(u.Name(), "#done"); ok {
			if err := os.Rename(filepath.Join(s.uploads, u.Name()), filepath.Join(s.uploads, id)); err != nil {
				return 0, fmt.Errorf("s3local: %w", err)
			}
		}
	}
	return used, nil
}

// apiError is an S3 error answer: its HTTP status, code and message.
type apiError struct {
	status int
	code   string
	msg    string
}

func (e *apiError) Error() string { return e.code + ": " + e.msg }

// errorf returns an apiError.
func errorf(status int, code, format string, args ...any) *apiError {
	return &apiError{status: status, code: code, msg: fmt.Sprintf(format, args...)}
}

// Errors answered often.
func errNoSuchKey(key string) *apiError {
	return errorf(http.StatusNotFound, "NoSuchKey", "the key %q does not exist", key)
}

func errNoSuchBucket(bucket string) *apiError {
	return errorf(http.StatusNotFound, "NoSuchBucket", "the bucket %q does not exist", bucket)
}

func errNotImplemented(what string) *apiError {
	return errorf(http.StatusNotImplemented, "NotImplemented", "s3local does not implement %s", what)
}

// errorXML is the body of an error answer.
type errorXML struct {
	XMLName   xml.Name `xml:"Error"`
	Code      string   `xml:"Code"`
	Message   string   `xml:"Message"`
	Resource  string   `xml:"Resource,omitempty"`
	RequestID string   `xml:"RequestId"`
}

// ServeHTTP answers one S3 request.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	id := strconv.FormatUint(s.reqID.Add(1), 16)
	w.Header().Set("x-amz-request-id", id)
	w.Header().Set("Server", "s3local")
	err := s.serve(w, r)
	if err == nil {
		return
	}
	var ae *apiError
	if !errors.As(err, &ae) {
		ae = errorf(http.StatusInternalServerError, "InternalError", "%v", err)
	}
	if ae.status >= 500 {
		s.cfg.Logger.Error("s3local: request failed", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	if r.Method == http.MethodHead {
		w.WriteHeader(ae.status) // a HEAD's answer has no body
		return
	}
	body, _ := xml.Marshal(errorXML{Code: ae.code, Message: ae.msg, Resource: r.URL.Path, RequestID: id})
	w.Header().Set("Content-Type", "application/xml")
	w.Header().Set("Content-Length", strconv.Itoa(len(xml.Header)+len(body)))
	w.WriteHeader(ae.status)
	io.WriteString(w, xml.Header)
	w.Write(body)
}

// serve checks r's signature and routes it by method, bucket, key and
// subresource.
func (s *Server) serve(w http.ResponseWriter, r *http.Request) error {
	sig, err := s.authenticate(r, time.Now())
	if err != nil {
		return err
	}
	bucket, key, _ := strings.Cut(strings.TrimPrefix(r.URL.Path, "/"), "/")
	q := r.URL.Query()
	q.Del("x-id") // the SDK names the operation there
	if bucket == "" {
		return errNotImplemented("listing the buckets")
	}
	if err := checkBucketName(bucket); err != nil {
		return err
	}
	if key == "" {
		switch {
		case r.Method == http.MethodHead:
			return s.headBucket(bucket)
		case r.Method == http.MethodPut && len(q) == 0:
			return s.createBucket(w, r, bucket)
		case r.Method == http.MethodDelete && len(q) == 0:
			return s.deleteBucket(w, bucket)
		case r.Method == http.MethodGet && q.Get("list-type") == "2":
			return s.listObjects(w, bucket, q)
		case r.Method == http.MethodPost && q.Has("delete"):
			return s.deleteObjects(w, r, sig, bucket)
		case len(q) == 1 && q.Has("policy"):
			return s.bucketPolicy(w, r, sig, bucket)
		}
		return errNotImplemented(r.Method + " of a bucket with query " + strconv.Quote(r.URL.RawQuery))
	}
	if err := checkKey(key); err != nil {
		return err
	}
	if err := s.checkPolicy(r, bucket, key); err != nil {
		return err
	}
	switch {
	case (r.Method == http.MethodGet || r.Method == http.MethodHead) && len(q) == 0:
		return s.getObject(w, r, bucket, key)
	case r.Method == http.MethodPut && q.Has("uploadId") && q.Has("partNumber"):
		return s.uploadPart(w, r, sig, bucket, key, q.Get("uploadId"), q.Get("partNumber"))
	case r.Method == http.MethodPut && len(q) == 0:
		if r.Header.Get("x-amz-copy-source") != "" {
			return errNotImplemented("CopyObject")
		}
		return s.putObject(w, r, sig, bucket, key)
	case r.Method == http.MethodPost && q.Has("uploads"):
		return s.createUpload(w, bucket, key)
	case r.Method == http.MethodPost && q.Has("uploadId"):
		return s.completeUpload(w, r, sig, bucket, key, q.Get("uploadId"))
	case r.Method == http.MethodDelete && q.Has("uploadId"):
		return s.abortUpload(w, bucket, key, q.Get("uploadId"))
	case r.Method == http.MethodDelete && len(q) == 0:
		return s.deleteObject(w, bucket, key)
	}
	return errNotImplemented(r.Method + " of an object with query " + strconv.Quote(r.URL.RawQuery))
}

// checkBucketName fails where name is not an S3 bucket name: 3 to 63
// lower-case letters, digits, dots and hyphens, a letter or digit first
// and last.
func checkBucketName(name string) error {
	ok := len(name) >= 3 && len(name) <= 63
	for i := 0; ok && i < len(name); i++ {
		c := name[i]
		alnum := c >= 'a' && c <= 'z' || c >= '0' && c <= '9'
		ok = alnum || (c == '.' || c == '-') && i > 0 && i < len(name)-1
	}
	if !ok {
		return errorf(http.StatusBadRequest, "InvalidBucketName", "%q is not a bucket name: 3 to 63 lower-case letters, digits, dots and hyphens", name)
	}
	return nil
}

// bucketDir returns the directory of bucket, or NoSuchBucket.
func (s *Server) bucketDir(bucket string) (string, error) {
	dir := filepath.Join(s.dir, bucket)
	fi, err := os.Stat(dir)
	if err != nil || !fi.IsDir() {
		return "", errNoSuchBucket(bucket)
	}
	return dir, nil
}

func (s *Server) headBucket(bucket string) error {
	_, err := s.bucketDir(bucket)
	return err
}

func (s *Server) createBucket(w http.ResponseWriter, r *http.Request, bucket string) error {
	// The body, a CreateBucketConfiguration naming a region, says nothing
	// to a directory.
	if _, err := io.Copy(io.Discard, io.LimitReader(r.Body, 1<<20)); err != nil {
		return fmt.Errorf("reading the request: %w", err)
	}
	if err := os.Mkdir(filepath.Join(s.dir, bucket), 0o755); errors.Is(err, fs.ErrExist) {
		return errorf(http.StatusConflict, "BucketAlreadyOwnedByYou", "the bucket %q exists", bucket)
	} else if err != nil {
		return err
	}
	w.Header().Set("Location", "/"+bucket)
	w.WriteHeader(http.StatusOK)
	return nil
}

func (s *Server) deleteBucket(w http.ResponseWriter, bucket string) error {
	dir, err := s.bucketDir(bucket)
	if err != nil {
		return err
	}
	if err := os.Remove(dir); errors.Is(err, syscall.ENOTEMPTY) || errors.Is(err, fs.ErrExist) {
		return errorf(http.StatusConflict, "BucketNotEmpty", "the bucket %q holds objects", bucket)
	} else if err != nil {
		return err
	}
	s.policyMu.Lock()
	delete(s.policies, bucket)
	delete(s.policyDocs, bucket)
	s.policyMu.Unlock()
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// CreateBucket makes bucket where it is missing.
func (s *Server) CreateBucket(bucket string) error {
	if err := checkBucketName(bucket); err != nil {
		return fmt.Errorf("s3local: %w", err)
	}
	if err := os.Mkdir(filepath.Join(s.dir, bucket), 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("s3local: %w", err)
	}
	return nil
}
