package s3local

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unicode/utf8"
)

// maxKeyLen is S3's longest key, in bytes.
const maxKeyLen = 1024

// maxObjectSize is the largest object one PUT may write, as S3's.
const maxObjectSize = 5 << 30

// checkKey fails where key is not an S3 key: 1 to 1024 bytes of UTF-8.
func checkKey(key string) error {
	if len(key) > maxKeyLen {
		return errorf(http.StatusBadRequest, "KeyTooLongError", "the key has %d bytes, more than %d", len(key), maxKeyLen)
	}
	if !utf8.ValidString(key) {
		return errorf(http.StatusBadRequest, "InvalidArgument", "the key %q is not UTF-8", key)
	}
	return nil
}

// safeByte reports whether c stays as it is in a path element.
func safeByte(c byte) bool {
	return c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || strings.IndexByte("-._~=+,:@", c) >= 0
}

// escapeSegment is the path element of seg, a segment of a key between
// slashes: seg where it is made of safe bytes, else with every other byte
// percent-encoded; "" is "%", "." and ".." are encoded whole. No element
// holds a '#', which marks temporary files.
func escapeSegment(seg string) string {
	switch seg {
	case "":
		return "%"
	case ".":
		return "%2E"
	case "..":
		return "%2E%2E"
	}
	const hexDigits = "0123456789ABCDEF"
	var b []byte
	for i := 0; i < len(seg); i++ {
		c := seg[i]
		if safeByte(c) {
			if b != nil {
				b = append(b, c)
			}
			continue
		}
		if b == nil {
			b = append(make([]byte, 0, len(seg)+8), seg[:i]...)
		}
		b = append(b, '%', hexDigits[c>>4], hexDigits[c&15])
	}
	if b == nil {
		return seg
	}
	return string(b)
}

// unescapeSegment is the key segment of a path element, and false where
// the element is no escapeSegment's (a temporary file, a stranger's).
func unescapeSegment(name string) (string, bool) {
	if name == "%" {
		return "", true
	}
	if strings.IndexByte(name, '%') < 0 {
		for i := 0; i < len(name); i++ {
			if !safeByte(name[i]) {
				return "", false
			}
		}
		return name, name != "." && name != ".."
	}
	var b []byte
	for i := 0; i < len(name); i++ {
		c := name[i]
		switch {
		case c == '%' && i+2 < len(name) && isHex(name[i+1]) && isHex(name[i+2]):
			b = append(b, unhex(name[i+1])<<4|unhex(name[i+2]))
			i += 2
		case safeByte(c):
			b = append(b, c)
		default:
			return "", false
		}
	}
	return string(b), true
}

func isHex(c byte) bool { return c >= '0' && c <= '9' || c >= 'A' && c <= 'F' }

func unhex(c byte) byte {
	if c <= '9' {
		return c - '0'
	}
	return c - 'A' + 10
}

// objectPath is the file of key in bucket's directory dir.
func objectPath(dir, key string) (string, error) {
	segs := strings.Split(key, "/")
	elems := make([]string, 0, len(segs)+1)
	elems = append(elems, dir)
	for _, seg := range segs {
		e := escapeSegment(seg)
		if len(e) > 255 {
			return "", errorf(http.StatusBadRequest, "KeyTooLongError", "a segment of the key between slashes is %d bytes as a file name, more than 255 (s3local stores keys as paths)", len(e))
		}
		elems = append(elems, e)
	}
	return filepath.Join(elems...), nil
}

// etag is the ETag of the object fi: not its MD5, which would cost a
// pass over every write, but its file's identity (modification time, size
// and inode), which every write changes.
func etag(fi fs.FileInfo) string {
	var ino uint64
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		ino = st.Ino
	}
	return fmt.Sprintf(`"%016x%08x%08x"`, fi.ModTime().UnixNano(), uint32(fi.Size()), uint32(ino))
}

// conflict is the error of a key that is both an object and the folder of
// others.
func conflict(key string) error {
	return errorf(http.StatusConflict, "KeyConflict", "the key %q is, or is under, both an object and a folder of others: s3local stores keys as paths and cannot hold \"a\" and \"a/b\" at once", key)
}

// tempIn creates a temporary file in the directory of path, making the
// directories on the way.
func tempIn(path, key string) (*os.File, error) {
	dir := filepath.Dir(path)
	for range 8 { // a removal of an emptied directory may race the creation
		f, err := os.CreateTemp(dir, "#tmp-*")
		if err == nil {
			return f, nil
		}
		if errors.Is(err, syscall.ENOTDIR) {
			return nil, conflict(key)
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return nil, err
		}
		if err := os.MkdirAll(dir, 0o755); errors.Is(err, syscall.ENOTDIR) || errors.Is(err, fs.ErrExist) {
			return nil, conflict(key)
		} else if err != nil {
			return nil, err
		}
	}
	return nil, fmt.Errorf("creating a file in %s: its directory keeps vanishing", dir)
}

// reserve takes room for size bytes more within the quota, and returns
// the function that gives it back.
func (s *Server) reserve(size int64) (func(), error) {
	if s.cfg.Quota == 0 {
		return func() {}, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.used+s.reserved+size > s.cfg.Quota {
		return nil, errorf(http.StatusForbidden, "QuotaExceeded", "%d bytes more would pass the quota of %d bytes (%d held, %d being written)", size, s.cfg.Quota, s.used, s.reserved)
	}
	s.reserved += size
	return func() {
		s.mu.Lock()
		s.reserved -= size
		s.mu.Unlock()
	}, nil
}

// commit makes the whole, verified temporary file tmp the object at path:
// a rename, or with ifNoneMatch a link that fails where the object
// exists (PreconditionFailed). It removes tmp in either case.
func (s *Server) commit(tmp, path, key string, ifNoneMatch bool) (fs.FileInfo, error) {
	defer os.Remove(tmp)
	if s.cfg.Quota > 0 {
		s.mu.Lock()
		defer s.mu.Unlock()
	}
	var old int64
	if fi, err := os.Lstat(path); err == nil {
		if fi.IsDir() {
			return nil, conflict(key)
		}
		old = fi.Size()
	}
	var err error
	if ifNoneMatch {
		err = os.Link(tmp, path)
		if errors.Is(err, fs.ErrExist) {
			return nil, errorf(http.StatusPreconditionFailed, "PreconditionFailed", "the key %q exists (If-None-Match: *)", key)
		}
		old = 0
	} else {
		err = os.Rename(tmp, path)
	}
	if errors.Is(err, syscall.EISDIR) || errors.Is(err, syscall.ENOTDIR) || errors.Is(err, syscall.ENOTEMPTY) {
		return nil, conflict(key)
	}
	if err != nil {
		return nil, err
	}
	fi, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	if s.cfg.Quota > 0 {
		s.used += fi.Size() - old
	}
	return fi, nil
}

// ifNoneMatchAll reports whether r asks to write only where the key has
// no object, and fails where it makes a condition s3local does not check.
func ifNoneMatchAll(r *http.Request) (bool, error) {
	if r.Header.Get("If-Match") != "" {
		return false, errNotImplemented("If-Match on writes")
	}
	switch v := r.Header.Get("If-None-Match"); v {
	case "":
		return false, nil
	case "*":
		return true, nil
	default:
		return false, errorf(http.StatusNotImplemented, "NotImplemented", "If-None-Match %q on a write: s3local takes \"*\" only", v)
	}
}

// copyInto copies src into f with one of the server's large buffers.
func (s *Server) copyInto(f *os.File, src io.Reader) (int64, error) {
	buf := s.bufs.Get().(*[]byte)
	defer s.bufs.Put(buf)
	// A struct that is only a Writer: os.File's ReadFrom would copy in
	// 32 KiB pieces.
	return io.CopyBuffer(struct{ io.Writer }{f}, src, *buf)
}

// locate returns the directory of bucket and the file of key's object in
// it, or NoSuchBucket.
func (s *Server) locate(bucket, key string) (dir, path string, err error) {
	if dir, err = s.bucketDir(bucket); err != nil {
		return "", "", err
	}
	path, err = objectPath(dir, key)
	return dir, path, err
}

// write makes what fill writes to a temporary file in path's directory
// the object at path (commit); it publishes nothing where fill fails.
func (s *Server) write(path, key string, ifNoneMatch bool, fill func(*os.File) error) (fs.FileInfo, error) {
	f, err := tempIn(path, key)
	if err != nil {
		return nil, err
	}
	tmp := f.Name()
	err = fill(f)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(tmp)
		return nil, err
	}
	return s.commit(tmp, path, key, ifNoneMatch)
}

func (s *Server) putObject(w http.ResponseWriter, r *http.Request, sig *signature, bucket, key string) error {
	_, path, err := s.locate(bucket, key)
	if err != nil {
		return err
	}
	ifNoneMatch, err := ifNoneMatchAll(r)
	if err != nil {
		return err
	}
	body, size, err := s.body(r, sig)
	if err != nil {
		return err
	}
	if size > maxObjectSize {
		return errorf(http.StatusBadRequest, "EntityTooLarge", "%d bytes in one PUT, more than 5 GiB: upload it in parts", size)
	}
	if ifNoneMatch {
		if _, err := os.Lstat(path); err == nil {
			return errorf(http.StatusPreconditionFailed, "PreconditionFailed", "the key %q exists (If-None-Match: *)", key)
		}
	}
	release, err := s.reserve(size)
	if err != nil {
		return err
	}
	defer release()
	fi, err := s.write(path, key, ifNoneMatch, func(f *os.File) error {
		_, err := s.copyInto(f, body)
		return err
	})
	if err != nil {
		return fmt.Errorf("writing %s/%s: %w", bucket, key, err)
	}
	w.Header().Set("ETag", etag(fi))
	w.WriteHeader(http.StatusOK)
	return nil
}

// byteRange parses a Range header of one range of bytes ("bytes=A-B",
// "bytes=A-", "bytes=-N") on an object of size bytes: the first byte and
// the count. ok is false where there is no range to honour (none, or one
// S3 ignores); a range past the object's end is InvalidRange.
func byteRange(h string, size int64) (start, n int64, ok bool, err error) {
	spec, found := strings.CutPrefix(h, "bytes=")
	if !found || strings.Contains(spec, ",") {
		return 0, 0, false, nil
	}
	a, b, found := strings.Cut(strings.TrimSpace(spec), "-")
	if !found {
		return 0, 0, false, nil
	}
	invalid := errorf(http.StatusRequestedRangeNotSatisfiable, "InvalidRange", "the range %q is not within the object's %d bytes", h, size)
	if a == "" { // the last N bytes
		last, perr := strconv.ParseInt(b, 10, 64)
		if perr != nil || last < 0 {
			return 0, 0, false, nil
		}
		if last == 0 || size == 0 {
			return 0, 0, false, invalid
		}
		last = min(last, size)
		return size - last, last, true, nil
	}
	first, perr := strconv.ParseInt(a, 10, 64)
	if perr != nil || first < 0 {
		return 0, 0, false, nil
	}
	end := size - 1
	if b != "" {
		e, perr := strconv.ParseInt(b, 10, 64)
		if perr != nil || e < first {
			return 0, 0, false, nil
		}
		end = min(e, size-1)
	}
	if first >= size {
		return 0, 0, false, invalid
	}
	return first, end - first + 1, true, nil
}

// etagMatches reports whether the If-Match or If-None-Match value list
// names tag ("*" names any).
func etagMatches(list, tag string) bool {
	for _, t := range strings.Split(list, ",") {
		t = strings.TrimSpace(t)
		if t == "*" || strings.Trim(t, `"`) == strings.Trim(tag, `"`) {
			return true
		}
	}
	return false
}

// getObject answers a GET or HEAD of an object: one range at most, from
// the file (sendfile where the connection is TCP).
func (s *Server) getObject(w http.ResponseWriter, r *http.Request, bucket, key string) error {
	_, path, err := s.locate(bucket, key)
	if err != nil {
		return err
	}
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
		return errNoSuchKey(key)
	} else if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return errNoSuchKey(key)
	}
	tag := etag(fi)
	h := w.Header()
	h.Set("ETag", tag)
	h.Set("Last-Modified", fi.ModTime().UTC().Format(http.TimeFormat))
	if im := r.Header.Get("If-Match"); im != "" && !etagMatches(im, tag) {
		return errorf(http.StatusPreconditionFailed, "PreconditionFailed", "the object's ETag is %s, not %s (If-Match)", tag, im)
	}
	if inm := r.Header.Get("If-None-Match"); inm != "" && etagMatches(inm, tag) {
		w.WriteHeader(http.StatusNotModified)
		return nil
	}
	size := fi.Size()
	start, n, ranged, err := byteRange(r.Header.Get("Range"), size)
	if err != nil {
		return err
	}
	status := http.StatusOK
	if ranged {
		status = http.StatusPartialContent
		h.Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", start, start+n-1, size))
	} else {
		n = size
	}
	h.Set("Accept-Ranges", "bytes")
	h.Set("Content-Type", "application/octet-stream")
	h.Set("Content-Length", strconv.FormatInt(n, 10))
	w.WriteHeader(status)
	if r.Method == http.MethodHead || n == 0 {
		return nil
	}
	if _, err := f.Seek(start, io.SeekStart); err != nil {
		return nil // the header is sent: nothing to answer with
	}
	// http's response writer hands an io.LimitedReader of an *os.File to
	// the connection, which sends it with sendfile.
	if _, err := io.CopyN(w, f, n); err != nil && r.Context().Err() == nil {
		s.cfg.Logger.Debug("s3local: sending an object", "bucket", bucket, "key", key, "err", err)
	}
	return nil
}

// remove removes key's object in bucket's directory dir, and the
// directories it leaves empty; a missing object is no error.
func (s *Server) remove(dir, key string) error {
	path, err := objectPath(dir, key)
	if err != nil {
		return err
	}
	if s.cfg.Quota > 0 {
		s.mu.Lock()
		defer s.mu.Unlock()
	}
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) || err == nil && fi.IsDir() {
		return nil // no such object: S3 answers the same
	} else if err != nil {
		return err
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if s.cfg.Quota > 0 {
		s.used -= fi.Size()
	}
	for d := filepath.Dir(path); d != dir && strings.HasPrefix(d, dir); d = filepath.Dir(d) {
		if os.Remove(d) != nil {
			break // not empty, or made again meanwhile
		}
	}
	return nil
}

func (s *Server) deleteObject(w http.ResponseWriter, bucket, key string) error {
	dir, err := s.bucketDir(bucket)
	if err != nil {
		return err
	}
	if err := s.remove(dir, key); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// lastModified is the form of a time in S3's XML.
func lastModified(t time.Time) string { return t.UTC().Format("2006-01-02T15:04:05.000Z") }
