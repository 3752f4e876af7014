package s3local

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// The examples of AWS's SigV4 documentation
// (sig-v4-header-based-auth.html, sigv4-streaming.html): their keys, their
// time, and the signatures they give.
const (
	docAccess = "AKIAIOSFODNN7EXAMPLE"
	docSecret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
)

var docTime = time.Date(2013, 5, 24, 0, 0, 0, 0, time.UTC)

// wantCode fails the test where err is not an apiError of code, or
// code is "" and err is not nil.
func wantCode(t *testing.T, what string, err error, code string) {
	t.Helper()
	var ae *apiError
	switch {
	case code == "" && err != nil:
		t.Fatalf("%s: %v, want no error", what, err)
	case code != "" && (!errors.As(err, &ae) || ae.code != code):
		t.Fatalf("%s: %v, want %s", what, err, code)
	}
}

func docServer(t *testing.T) *Server {
	t.Helper()
	s, err := New(Config{Dir: t.TempDir(), AccessKey: docAccess, SecretKey: docSecret})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// docGet is the documentation's GET of /test.txt, its first 10 bytes.
func docGet() *http.Request {
	r := httptest.NewRequest(http.MethodGet, "/test.txt", nil)
	r.Host = "examplebucket.s3.amazonaws.com"
	r.Header.Set("Range", "bytes=0-9")
	r.Header.Set("x-amz-content-sha256", emptySHA256)
	r.Header.Set("x-amz-date", "20130524T000000Z")
	r.Header.Set("Authorization", "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41")
	return r
}

// TestAuthenticateChecksTheDocumentedSignature: the documentation's
// signed GET verifies; the same request changed in any signed part, at
// another time, or under other keys fails with S3's code for it.
func TestAuthenticateChecksTheDocumentedSignature(t *testing.T) {
	s := docServer(t)
	for _, tc := range []struct {
		name   string
		change func(r *http.Request)
		now    time.Time
		code   string // "" where it verifies
	}{
		{"as documented", func(*http.Request) {}, docTime, ""},
		{"an unsigned header added", func(r *http.Request) { r.Header.Set("User-Agent", "x") }, docTime, ""},
		{"another range", func(r *http.Request) { r.Header.Set("Range", "bytes=0-10") }, docTime, "SignatureDoesNotMatch"},
		{"another path", func(r *http.Request) { r.RequestURI = "/test.txu" }, docTime, "SignatureDoesNotMatch"},
		{"a query added", func(r *http.Request) { r.RequestURI += "?acl"; r.URL.RawQuery = "acl" }, docTime, "SignatureDoesNotMatch"},
		{"another host", func(r *http.Request) { r.Host = "evil.example" }, docTime, "SignatureDoesNotMatch"},
		{"another payload hash", func(r *http.Request) { r.Header.Set("x-amz-content-sha256", unsignedPayload) }, docTime, "SignatureDoesNotMatch"},
		{"20 minutes late", func(*http.Request) {}, docTime.Add(20 * time.Minute), "RequestTimeTooSkewed"},
		{"another access key", func(r *http.Request) {
			r.Header.Set("Authorization", strings.Replace(r.Header.Get("Authorization"), docAccess, "AKIANOTTHEKEY", 1))
		}, docTime, "InvalidAccessKeyId"},
		{"no signature", func(r *http.Request) { r.Header.Del("Authorization") }, docTime, "AccessDenied"},
		{"signature version 2", func(r *http.Request) { r.Header.Set("Authorization", "AWS "+docAccess+":c2lnbmF0dXJl") }, docTime, "InvalidArgument"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := docGet()
			tc.change(r)
			_, err := s.authenticate(r, tc.now)
			wantCode(t, "authenticate", err, tc.code)
		})
	}
	other, err := New(Config{Dir: t.TempDir(), AccessKey: docAccess, SecretKey: "another-secret"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := other.authenticate(docGet(), docTime); err == nil || !strings.Contains(err.Error(), "SignatureDoesNotMatch") {
		t.Fatalf("the documented request under another secret: %v, want SignatureDoesNotMatch", err)
	}
}

// docChunkedPut is the documentation's PUT of 66560 bytes of 'a' in two
// signed chunks (64 KiB, 1 KiB) and the last, empty one; chunk, where not
// nil, changes the body's bytes first.
func docChunkedPut(change func(body []byte) []byte) *http.Request {
	sigs := []string{
		"ad80c730a21e5b8d04586a2213dd63b9a0e99e0e2307b0ade35a65485a288648",
		"0055627c9e194cb4542bae2aa5492e3c1575bbb81b612b7d234b86a503ef5497",
		"b6c6ea8a5354eaf15b3cb7646744f4275b71ea724fed81ceb9323e279d449df9",
	}
	var body []byte
	for i, n := range []int{65536, 1024, 0} {
		body = fmt.Appendf(body, "%x;chunk-signature=%s\r\n", n, sigs[i])
		body = append(body, bytes.Repeat([]byte{'a'}, n)...)
		body = append(body, "\r\n"...)
	}
	if change != nil {
		body = change(body)
	}
	r := httptest.NewRequest(http.MethodPut, "/examplebucket/chunkObject.txt", bytes.NewReader(body))
	r.Host = "s3.amazonaws.com"
	r.Header.Set("x-amz-date", "20130524T000000Z")
	r.Header.Set("x-amz-storage-class", "REDUCED_REDUNDANCY")
	r.Header.Set("x-amz-content-sha256", streamingSigned)
	r.Header.Set("Content-Encoding", "aws-chunked")
	r.Header.Set("x-amz-decoded-content-length", "66560")
	r.Header.Set("Content-Length", "66824")
	r.Header.Set("Authorization", "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,SignedHeaders=content-encoding;content-length;host;x-amz-content-sha256;x-amz-date;x-amz-decoded-content-length;x-amz-storage-class,Signature=4f232c4386841ef735655705268965c44a0e4690baa4adea153f7db9fa80a0a9")
	return r
}

// TestChunkedBodyChecksTheDocumentedChunkSignatures: the documentation's
// aws-chunked PUT decodes to its 66560 bytes, every chunk's signature
// checked; a byte of data changed, a chunk's signature changed, or the
// body cut short fails with S3's code, before the end of the body.
func TestChunkedBodyChecksTheDocumentedChunkSignatures(t *testing.T) {
	s := docServer(t)
	for _, tc := range []struct {
		name   string
		change func([]byte) []byte
		code   string
	}{
		{"as documented", nil, ""},
		{"a byte of data changed", func(b []byte) []byte { b[1000] = 'b'; return b }, "SignatureDoesNotMatch"},
		{"the second chunk's signature changed", func(b []byte) []byte {
			i := bytes.Index(b, []byte("0055627c"))
			b[i] = '1'
			return b
		}, "SignatureDoesNotMatch"},
		{"cut short", func(b []byte) []byte { return b[:66000] }, "IncompleteBody"},
		{"not chunked", func(b []byte) []byte { return bytes.Repeat([]byte{'a'}, len(b)) }, "IncompleteBody"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := docChunkedPut(tc.change)
			sig, err := s.authenticate(r, docTime)
			if err != nil {
				t.Fatalf("the seed request: %v", err)
			}
			body, size, err := s.body(r, sig)
			if err != nil || size != 66560 {
				t.Fatalf("body: %d bytes, %v", size, err)
			}
			got, err := io.ReadAll(body)
			wantCode(t, "read", err, tc.code)
			if tc.code == "" && !bytes.Equal(got, bytes.Repeat([]byte{'a'}, 66560)) {
				t.Fatalf("read %d bytes, want 66560 of 'a'", len(got))
			}
		})
	}
}

// checksumOf returns the base64 of x-amz-checksum-ALG of b.
func checksumOf(alg string, b []byte) string {
	h := checksumAlgorithms[alg]()
	h.Write(b)
	return base64.StdEncoding.EncodeToString(h.Sum(nil))
}

// TestChecksumAlgorithmsGiveTheirCheckValues: each algorithm's digest of
// "123456789" is its catalogued check value.
func TestChecksumAlgorithmsGiveTheirCheckValues(t *testing.T) {
	for alg, want := range map[string]uint64{"crc32": 0xcbf43926, "crc32c": 0xe3069283, "crc64nvme": 0xae8b14860a799888} {
		h := checksumAlgorithms[alg]()
		h.Write([]byte("123456789"))
		sum := h.Sum(nil)
		var got uint64
		if len(sum) == 4 {
			got = uint64(binary.BigEndian.Uint32(sum))
		} else {
			got = binary.BigEndian.Uint64(sum)
		}
		if got != want {
			t.Errorf("%s of 123456789: %#x, want %#x", alg, got, want)
		}
	}
}

// TestUnsignedChunkedBodyChecksItsTrailer: a body as the SDK sends one
// over TLS (STREAMING-UNSIGNED-PAYLOAD-TRAILER, its checksum in the
// trailer) decodes whole where the trailer's checksum holds, and fails
// with BadDigest where it does not, or InvalidRequest where it is
// missing; a checksum header is checked as well.
func TestUnsignedChunkedBodyChecksItsTrailer(t *testing.T) {
	data := bytes.Repeat([]byte("kvhost"), 20000)
	chunked := func(trailer string) []byte {
		var b []byte
		for off := 0; off < len(data); off += 50000 {
			part := data[off:min(off+50000, len(data))]
			b = fmt.Appendf(b, "%x\r\n%s\r\n", len(part), part)
		}
		return fmt.Appendf(b, "0\r\n%s\r\n", trailer)
	}
	good := "x-amz-checksum-crc32c:" + checksumOf("crc32c", data) + "\r\n"
	for _, tc := range []struct {
		name    string
		body    []byte
		headers map[string]string
		code    string
	}{
		{"the right checksum", chunked(good), nil, ""},
		{"a wrong checksum", chunked("x-amz-checksum-crc32c:AAAAAA==\r\n"), nil, "BadDigest"},
		{"no trailer", chunked(""), nil, "InvalidRequest"},
		{"a right checksum header too", chunked(good), map[string]string{"x-amz-checksum-sha256": checksumOf("sha256", data)}, ""},
		{"a wrong checksum header", chunked(good), map[string]string{"x-amz-checksum-crc64nvme": checksumOf("crc64nvme", data[1:])}, "BadDigest"},
		{"a wrong Content-MD5", chunked(good), map[string]string{"Content-MD5": "1B2M2Y8AsgTpgAmY7PhCfg=="}, "BadDigest"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := &Server{}
			r := httptest.NewRequest(http.MethodPut, "/b/k", bytes.NewReader(tc.body))
			r.Header.Set("x-amz-content-sha256", streamingUnsigned)
			r.Header.Set("Content-Encoding", "aws-chunked")
			r.Header.Set("x-amz-decoded-content-length", fmt.Sprint(len(data)))
			r.Header.Set("x-amz-trailer", "x-amz-checksum-crc32c")
			for k, v := range tc.headers {
				r.Header.Set(k, v)
			}
			body, _, err := s.body(r, nil)
			if err != nil {
				t.Fatal(err)
			}
			got, err := io.ReadAll(body)
			wantCode(t, "read", err, tc.code)
			if tc.code == "" && !bytes.Equal(got, data) {
				t.Fatalf("read %d bytes, want the %d of the data", len(got), len(data))
			}
		})
	}
}

// TestPlainBodyChecksItsLengthAndHash: a body of Content-Length bytes
// with x-amz-content-sha256 reads whole where its hash holds; a wrong
// hash is XAmzContentSHA256Mismatch, a short body IncompleteBody, no
// length MissingContentLength.
func TestPlainBodyChecksItsLengthAndHash(t *testing.T) {
	data := []byte("an object's bytes")
	for _, tc := range []struct {
		name    string
		body    io.Reader
		hash    string
		length  int64
		code    string // of body(), or of the read
		atStart bool   // body() itself fails
	}{
		{"hashed", bytes.NewReader(data), sha256Hex(data), int64(len(data)), "", false},
		{"unsigned", bytes.NewReader(data), unsignedPayload, int64(len(data)), "", false},
		{"the wrong hash", bytes.NewReader(data), emptySHA256, int64(len(data)), "XAmzContentSHA256Mismatch", false},
		{"short", io.LimitReader(bytes.NewReader(data), 5), sha256Hex(data), int64(len(data)), "IncompleteBody", false},
		{"no length", bytes.NewReader(data), unsignedPayload, -1, "MissingContentLength", true},
		{"a payload kind not known", bytes.NewReader(data), "STREAMING-AWS4-ECDSA-P256-SHA256-PAYLOAD", int64(len(data)), "NotImplemented", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := httptest.NewRequest(http.MethodPut, "/b/k", tc.body)
			r.ContentLength = tc.length
			r.Header.Set("x-amz-content-sha256", tc.hash)
			body, _, err := (&Server{}).body(r, nil)
			if err == nil {
				var got []byte
				got, err = io.ReadAll(body)
				if err == nil && !bytes.Equal(got, data) {
					t.Fatalf("read %q, want %q", got, data)
				}
			}
			wantCode(t, "read", err, tc.code)
		})
	}
}

// TestKeySegmentsEscapeToPathElementsAndBack: every segment becomes one
// path element that is neither "." nor "..", holds no '/' or '#', and
// reads back as the segment.
func TestKeySegmentsEscapeToPathElementsAndBack(t *testing.T) {
	for _, seg := range []string{"abc", "0123456789abcdef", "kvhost-capacity", "", ".", "..", "...", "a b", "ü", "%", "%41", "#tmp-1", "a+b=c,d:e@f~g", "\x00\xff", "CON"} {
		e := escapeSegment(seg)
		if e == "." || e == ".." || strings.ContainsAny(e, "/#") {
			t.Errorf("segment %q: path element %q", seg, e)
		}
		if back, ok := unescapeSegment(e); !ok || back != seg {
			t.Errorf("segment %q: element %q reads back as %q, %v", seg, e, back, ok)
		}
	}
	for _, name := range []string{"#tmp-123", ".", "..", "a b", "%4", "%zz"} {
		if seg, ok := unescapeSegment(name); ok {
			t.Errorf("element %q read as segment %q, want it passed over", name, seg)
		}
	}
}

// TestByteRangeFollowsS3 covers the forms of one range S3 honours, those
// it ignores (the whole object), and those past the object's end.
func TestByteRangeFollowsS3(t *testing.T) {
	for _, tc := range []struct {
		h            string
		size         int64
		start, n     int64
		ranged, fail bool
	}{
		{"", 100, 0, 0, false, false},
		{"bytes=0-9", 100, 0, 10, true, false},
		{"bytes=90-200", 100, 90, 10, true, false},
		{"bytes=50-", 100, 50, 50, true, false},
		{"bytes=-30", 100, 70, 30, true, false},
		{"bytes=-300", 100, 0, 100, true, false},
		{"bytes=99-99", 100, 99, 1, true, false},
		{"bytes=100-", 100, 0, 0, false, true},
		{"bytes=0-", 0, 0, 0, false, true},
		{"bytes=-0", 100, 0, 0, false, true},
		{"bytes=5-2", 100, 0, 0, false, false},
		{"bytes=0-1,5-6", 100, 0, 0, false, false},
		{"items=0-1", 100, 0, 0, false, false},
		{"bytes=a-b", 100, 0, 0, false, false},
	} {
		start, n, ranged, err := byteRange(tc.h, tc.size)
		if (err != nil) != tc.fail || ranged != tc.ranged || ranged && (start != tc.start || n != tc.n) {
			t.Errorf("Range %q of %d bytes: start %d, %d bytes, ranged %v, %v; want %d, %d, %v, failing %v", tc.h, tc.size, start, n, ranged, err, tc.start, tc.n, tc.ranged, tc.fail)
		}
	}
}

// TestBucketNamesFollowS3 accepts S3's bucket names only.
func TestBucketNamesFollowS3(t *testing.T) {
	for name, ok := range map[string]bool{"kvcache": true, "kv-cache.0": true, "abc": true, "ab": false, "Kvcache": false, "-kv": false, "kv-": false, ".s3local-uploads": false, "kv_cache": false, strings.Repeat("a", 64): false} {
		if err := checkBucketName(name); (err == nil) != ok {
			t.Errorf("bucket name %q: %v, want accepted %v", name, err, ok)
		}
	}
}

// TestWalkListsKeysInOrderAcrossFolders: keys stored as paths list in S3's
// order (bytewise), which is not a folder-first walk's ('-' < '/' < '0'),
// from any key on, under any prefix, temporary files passed over.
func TestWalkListsKeysInOrderAcrossFolders(t *testing.T) {
	dir := t.TempDir()
	keys := []string{"a-c", "a/b", "a/b-", "a0", "b/c/d", "b/c/e", "b/c!/x", "b c", "dir/", "dir/x", "z.", "ü"}
	for _, k := range keys {
		p, err := objectPath(dir, k)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(k), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "b", "#tmp-1"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	sorted := slices.Sorted(slices.Values(keys))
	for _, tc := range []struct{ prefix, after string }{{"", ""}, {"", "a/b"}, {"", "a/"}, {"", "b/c/d"}, {"b/", ""}, {"b/c", ""}, {"dir/", ""}, {"a", "a/b-"}, {"nothing", ""}} {
		var want []string
		for _, k := range sorted {
			if strings.HasPrefix(k, tc.prefix) && k > tc.after {
				want = append(want, k)
			}
		}
		for _, limit := range []int{1, 3, 100} {
			var out []listEntry
			if err := walk(dir, "", tc.prefix, tc.after, limit, &out); err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, e := range out {
				got = append(got, e.key)
			}
			if w := want[:min(limit, len(want))]; !slices.Equal(got, w) {
				t.Errorf("prefix %q after %q, %d at most: %q, want %q", tc.prefix, tc.after, limit, got, w)
			}
		}
	}
}

// TestNewRefusesWhatItCannotServe: no directory, a file for one, one key
// of the pair alone, a negative quota.
func TestNewRefusesWhatItCannotServe(t *testing.T) {
	file := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for name, cfg := range map[string]Config{
		"no directory":     {},
		"a missing one":    {Dir: filepath.Join(t.TempDir(), "missing")},
		"a file":           {Dir: file},
		"an access key":    {Dir: t.TempDir(), AccessKey: "a"},
		"a negative quota": {Dir: t.TempDir(), Quota: -1},
	} {
		if _, err := New(cfg); err == nil {
			t.Errorf("%s: New succeeded", name)
		}
	}
	if _, err := New(Config{Dir: filepath.Join(t.TempDir(), "missing")}); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a missing directory: %v, want fs.ErrNotExist", err)
	}
}

// TestPolicyDenialsMatchTheirActionsAndResources: a Deny statement
// refuses its actions on the keys its resources match ("*" any run, '/'
// included), nothing else; what s3local cannot honour is refused when the
// policy is set.
func TestPolicyDenialsMatchTheirActionsAndResources(t *testing.T) {
	doc := `{"Version":"2012-10-17","Statement":[
		{"Effect":"Allow","Principal":"*","Action":"s3:*","Resource":"arn:aws:s3:::b/*"},
		{"Effect":"Deny","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::b/kv/kvhost-capacity"},
		{"Effect":"Deny","Principal":{"AWS":"*"},"Action":["s3:PutObject","s3:DeleteObject"],"Resource":["arn:aws:s3:::b/ro/*/x*y"]}]}`
	ds, err := parsePolicy("b", []byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		action, key string
		denied      bool
	}{
		{"s3:GetObject", "kv/kvhost-capacity", true},
		{"s3:GetObject", "kv/kvhost-capacity2", false},
		{"s3:PutObject", "kv/kvhost-capacity", false},
		{"s3:PutObject", "ro/a/b/xzy", true},
		{"s3:DeleteObject", "ro/a/xy", true},
		{"s3:PutObject", "ro/a/xz", false},
		{"s3:GetObject", "ro/a/xy", false},
	} {
		if got := denies(ds, tc.action, tc.key); got != tc.denied {
			t.Errorf("%s of %s: denied %v, want %v", tc.action, tc.key, got, tc.denied)
		}
	}
	for name, doc := range map[string]string{
		"a condition":         `{"Statement":[{"Effect":"Deny","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::b/*","Condition":{}}]}`,
		"a principal":         `{"Statement":[{"Effect":"Deny","Principal":{"AWS":"arn:aws:iam::1:user/x"},"Action":"s3:GetObject","Resource":"arn:aws:s3:::b/*"}]}`,
		"a bucket action":     `{"Statement":[{"Effect":"Deny","Principal":"*","Action":"s3:ListBucket","Resource":"arn:aws:s3:::b/*"}]}`,
		"another bucket":      `{"Statement":[{"Effect":"Deny","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::c/*"}]}`,
		"not JSON":            `Statement`,
		"an effect not known": `{"Statement":[{"Effect":"Maybe","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::b/*"}]}`,
	} {
		if _, err := parsePolicy("b", []byte(doc)); err == nil {
			t.Errorf("%s: the policy was taken", name)
		}
	}
}

// TestNewRecoversWhatAStoppedServerLeft: the temporary files of writes a
// server stopped in are removed, a completion it stopped in gives its
// upload back, and the objects are counted against the quota.
func TestNewRecoversWhatAStoppedServerLeft(t *testing.T) {
	dir := t.TempDir()
	for path, body := range map[string]string{
		"bkt/kv/obj":                        "12345",
		"bkt/kv/#tmp-123":                   "half an object",
		"bkt/#tmp-9":                        "",
		".s3local-uploads/0123#done/target": "bkt\nkey\n",
	} {
		p := filepath.Join(dir, filepath.FromSlash(path))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	s, err := New(Config{Dir: dir, Quota: 100})
	if err != nil {
		t.Fatal(err)
	}
	if s.used != 5 {
		t.Errorf("counted %d bytes of objects, want 5", s.used)
	}
	for _, gone := range []string{"bkt/kv/#tmp-123", "bkt/#tmp-9", ".s3local-uploads/0123#done"} {
		if _, err := os.Stat(filepath.Join(dir, gone)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s after New: %v, want it gone", gone, err)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, ".s3local-uploads/0123/target")); err != nil {
		t.Errorf("the upload whose completion stopped: %v", err)
	}
}
