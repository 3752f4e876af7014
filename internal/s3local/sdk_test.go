package s3local_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"
	"github.com/aws/smithy-go"

	"github.com/kvhost/kvhost/internal/objstore/objstoretest"
	"github.com/kvhost/kvhost/internal/s3local"
	"github.com/kvhost/kvhost/internal/testwait"
)

// These tests speak to s3local with aws-sdk-go-v2's S3 client directly,
// for what objstore's use does not reach or cannot show: the answers'
// codes and headers, listings of many pages, the checksums newer SDKs
// send.

// newClient is an S3 client of the endpoint at url with the keys, as
// objstore makes one (path-style); change adjusts its options.
func newClient(url, access, secret string, change func(*s3.Options)) *s3.Client {
	if change == nil {
		change = func(*s3.Options) {}
	}
	return s3.New(s3.Options{
		Region:                     "us-east-1",
		BaseEndpoint:               aws.String(url),
		UsePathStyle:               true,
		Credentials:                credentials.NewStaticCredentialsProvider(access, secret, ""),
		RequestChecksumCalculation: aws.RequestChecksumCalculationWhenRequired,
		ResponseChecksumValidation: aws.ResponseChecksumValidationWhenRequired,
	}, change)
}

func (ep *endpoint) client() *s3.Client { return newClient(ep.url, testAccess, testSecret, nil) }

// code is err's S3 error code and HTTP status.
func code(err error) (string, int) {
	var ae smithy.APIError
	var re *awshttp.ResponseError
	c, status := "", 0
	if errors.As(err, &ae) {
		c = ae.ErrorCode()
	}
	if errors.As(err, &re) {
		status = re.HTTPStatusCode()
	}
	return c, status
}

func put(t testing.TB, c *s3.Client, key string, b []byte) {
	t.Helper()
	if _, err := c.PutObject(context.Background(), &s3.PutObjectInput{Bucket: aws.String(testBucket), Key: aws.String(key), Body: bytes.NewReader(b)}); err != nil {
		t.Fatalf("put %s: %v", key, err)
	}
}

// TestSDKGetsRangesAndNamesMissingKeys: a ranged GET answers 206 with its
// Content-Range and exactly its bytes (a range, a suffix, one running
// past the end); one past the end is 416 InvalidRange; a missing key is
// NoSuchKey to a GET and 404 to a HEAD.
func TestSDKGetsRangesAndNamesMissingKeys(t *testing.T) {
	ep := startEndpoint(t, 0)
	c := ep.client()
	obj := make([]byte, 1<<20)
	for i := range obj {
		obj[i] = byte(i * 7)
	}
	put(t, c, "dir/obj", obj)
	ctx := context.Background()
	for _, tc := range []struct {
		rng, contentRange string
		start, n          int
	}{
		{"bytes=100-199", "bytes 100-199/1048576", 100, 100},
		{"bytes=-10", "bytes 1048566-1048575/1048576", 1<<20 - 10, 10},
		{"bytes=1048000-2000000", "bytes 1048000-1048575/1048576", 1048000, 576},
	} {
		out, err := c.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String(testBucket), Key: aws.String("dir/obj"), Range: aws.String(tc.rng)})
		if err != nil {
			t.Fatalf("%s: %v", tc.rng, err)
		}
		got, err := io.ReadAll(out.Body)
		out.Body.Close()
		if err != nil || aws.ToString(out.ContentRange) != tc.contentRange || !bytes.Equal(got, obj[tc.start:tc.start+tc.n]) {
			t.Fatalf("%s: Content-Range %q, %d bytes (%v); want %q and the object's %d bytes at %d", tc.rng, aws.ToString(out.ContentRange), len(got), err, tc.contentRange, tc.n, tc.start)
		}
	}
	_, err := c.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String(testBucket), Key: aws.String("dir/obj"), Range: aws.String("bytes=1048576-")})
	if cd, st := code(err); cd != "InvalidRange" || st != 416 {
		t.Fatalf("a range past the end: %v, want 416 InvalidRange", err)
	}
	_, err = c.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String(testBucket), Key: aws.String("dir/none")})
	var nsk *types.NoSuchKey
	if !errors.As(err, &nsk) {
		t.Fatalf("GET of a missing key: %v, want NoSuchKey", err)
	}
	_, err = c.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String(testBucket), Key: aws.String("dir")})
	if _, st := code(err); st != 404 {
		t.Fatalf("HEAD of a folder: %v, want 404", err)
	}
	h, err := c.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String(testBucket), Key: aws.String("dir/obj")})
	if err != nil || aws.ToInt64(h.ContentLength) != 1<<20 || aws.ToString(h.ETag) == "" {
		t.Fatalf("HEAD: %+v, %v", h, err)
	}
	_, err = c.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String(testBucket), Key: aws.String("dir/obj"), IfMatch: aws.String(`"not-its-etag"`)})
	if cd, st := code(err); cd != "PreconditionFailed" || st != 412 {
		t.Fatalf("GET If-Match another ETag: %v, want 412 PreconditionFailed", err)
	}
	_, err = c.HeadBucket(ctx, &s3.HeadBucketInput{Bucket: aws.String("no-such-bucket")})
	if _, st := code(err); st != 404 {
		t.Fatalf("HEAD of a missing bucket: %v, want 404", err)
	}
}

// TestSDKConditionalPutWritesOnce: of PUTs with If-None-Match: * of one
// new key, at once, exactly one writes; the others are 412
// PreconditionFailed and the object holds the winner's bytes.
func TestSDKConditionalPutWritesOnce(t *testing.T) {
	ep := startEndpoint(t, 0)
	c := ep.client()
	const n = 8
	var wins atomic.Int32
	var winner atomic.Int32
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := c.PutObject(context.Background(), &s3.PutObjectInput{Bucket: aws.String(testBucket), Key: aws.String("kv/kvhost-capacity"), Body: bytes.NewReader(fmt.Appendf(nil, "%d\n", i+1)), IfNoneMatch: aws.String("*")})
			if err == nil {
				wins.Add(1)
				winner.Store(int32(i + 1))
			} else if cd, st := code(err); cd != "PreconditionFailed" || st != 412 {
				errs[i] = err
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(ep.objectFile("kv/kvhost-capacity"))
	if wins.Load() != 1 || string(got) != fmt.Sprintf("%d\n", winner.Load()) {
		t.Fatalf("%d conditional PUTs wrote, the object holds %q; want 1, the winner's", wins.Load(), got)
	}
}

// TestSDKListsManyPagesInOrder: 2100 keys under a prefix list in order in
// pages of at most 1000 through continuation tokens; start-after and
// max-keys cut where asked; keys beside the prefix are not listed.
func TestSDKListsManyPagesInOrder(t *testing.T) {
	ep := startEndpoint(t, 0)
	c := ep.client()
	var want []string
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for i := range 2100 {
		k := fmt.Sprintf("p/%x/%04d", i%3, i)
		want = append(want, k)
		sem <- struct{}{}
		wg.Add(1)
		go func() { defer func() { <-sem; wg.Done() }(); put(t, c, k, []byte(k)) }()
	}
	put(t, c, "other", nil)
	put(t, c, "p0", nil)
	wg.Wait()
	slices.Sort(want)
	list := func(in *s3.ListObjectsV2Input) (keys []string, pages int) {
		p := s3.NewListObjectsV2Paginator(c, in)
		for p.HasMorePages() {
			page, err := p.NextPage(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			pages++
			for _, o := range page.Contents {
				if aws.ToInt64(o.Size) != int64(len(aws.ToString(o.Key))) || o.LastModified == nil {
					t.Fatalf("listed %s with size %d, modified %v", aws.ToString(o.Key), aws.ToInt64(o.Size), o.LastModified)
				}
				keys = append(keys, aws.ToString(o.Key))
			}
		}
		return keys, pages
	}
	got, pages := list(&s3.ListObjectsV2Input{Bucket: aws.String(testBucket), Prefix: aws.String("p/")})
	if !slices.Equal(got, want) || pages != 3 {
		t.Fatalf("listed %d keys in %d pages, want the %d in order in 3", len(got), pages, len(want))
	}
	got, _ = list(&s3.ListObjectsV2Input{Bucket: aws.String(testBucket), Prefix: aws.String("p/1"), StartAfter: aws.String("p/1/1000")})
	var wantAfter []string
	for _, k := range want {
		if k > "p/1/1000" && k < "p/2" {
			wantAfter = append(wantAfter, k)
		}
	}
	if !slices.Equal(got, wantAfter) {
		t.Fatalf("after p/1/1000 under p/1: %d keys, want %d", len(got), len(wantAfter))
	}
	got, pages = list(&s3.ListObjectsV2Input{Bucket: aws.String(testBucket), Prefix: aws.String("p/2/"), MaxKeys: aws.Int32(300)})
	if pages != 3 || len(got) != 700 {
		t.Fatalf("p/2/ in pages of 300: %d keys in %d pages, want 700 in 3", len(got), pages)
	}
}

// TestSDKMultipartChecksItsParts: a completion with a part under 5 MiB
// before the last is EntityTooSmall, one naming another ETag
// InvalidPart, parts out of order InvalidPartOrder, and each leaves the
// upload to complete; the completion that holds assembles the parts in
// order; an aborted upload takes no part more and leaves nothing.
func TestSDKMultipartChecksItsParts(t *testing.T) {
	ep := startEndpoint(t, 0)
	c := ep.client()
	ctx := context.Background()
	b, k := aws.String(testBucket), aws.String("big")
	up, err := c.CreateMultipartUpload(ctx, &s3.CreateMultipartUploadInput{Bucket: b, Key: k})
	if err != nil {
		t.Fatal(err)
	}
	sizes := []int{5 << 20, 1 << 20, 3}
	var parts []types.CompletedPart
	var whole []byte
	for i, n := range sizes {
		data := bytes.Repeat([]byte{byte('a' + i)}, n)
		whole = append(whole, data...)
		out, err := c.UploadPart(ctx, &s3.UploadPartInput{Bucket: b, Key: k, UploadId: up.UploadId, PartNumber: aws.Int32(int32(i + 1)), Body: bytes.NewReader(data)})
		if err != nil {
			t.Fatal(err)
		}
		parts = append(parts, types.CompletedPart{PartNumber: aws.Int32(int32(i + 1)), ETag: out.ETag})
	}
	wrongTag := slices.Clone(parts)
	wrongTag[0].ETag = aws.String(`"0000"`)
	for _, tc := range []struct {
		name  string
		parts []types.CompletedPart
		code  string
	}{
		{"a small part before the last", parts, "EntityTooSmall"},
		{"another ETag", wrongTag, "InvalidPart"},
		{"out of order", []types.CompletedPart{parts[1], parts[0]}, "InvalidPartOrder"},
	} {
		_, err := c.CompleteMultipartUpload(ctx, &s3.CompleteMultipartUploadInput{Bucket: b, Key: k, UploadId: up.UploadId, MultipartUpload: &types.CompletedMultipartUpload{Parts: tc.parts}})
		if cd, _ := code(err); cd != tc.code {
			t.Fatalf("%s: %v, want %s", tc.name, err, tc.code)
		}
	}
	_, err = c.CompleteMultipartUpload(ctx, &s3.CompleteMultipartUploadInput{Bucket: b, Key: k, UploadId: up.UploadId, MultipartUpload: &types.CompletedMultipartUpload{Parts: []types.CompletedPart{parts[0], parts[2]}}})
	if err != nil {
		t.Fatalf("completion of parts 1 and 3: %v", err)
	}
	got, err := os.ReadFile(ep.objectFile("big"))
	if want := append(whole[:5<<20:5<<20], whole[6<<20:]...); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("the object: %d bytes (%v), want parts 1 and 3, %d bytes", len(got), err, len(want))
	}

	up, err = c.CreateMultipartUpload(ctx, &s3.CreateMultipartUploadInput{Bucket: b, Key: aws.String("aborted")})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.AbortMultipartUpload(ctx, &s3.AbortMultipartUploadInput{Bucket: b, Key: aws.String("aborted"), UploadId: up.UploadId}); err != nil {
		t.Fatal(err)
	}
	_, err = c.UploadPart(ctx, &s3.UploadPartInput{Bucket: b, Key: aws.String("aborted"), UploadId: up.UploadId, PartNumber: aws.Int32(1), Body: bytes.NewReader([]byte("x"))})
	if cd, st := code(err); cd != "NoSuchUpload" || st != 404 {
		t.Fatalf("a part of an aborted upload: %v, want 404 NoSuchUpload", err)
	}
	if left, _ := os.ReadDir(filepath.Join(ep.dir, ".s3local-uploads")); len(left) != 0 {
		t.Fatalf("%d uploads left after a completion and an abort", len(left))
	}
}

// TestSDKChecksumsAreChecked: a client that sends checksums whenever it
// can sends a CRC32 header over plain HTTP and, over TLS with a body it
// cannot rewind, an aws-chunked body with the checksum in its trailer;
// both store the bytes. A PUT naming a wrong checksum is BadDigest and
// stores nothing.
func TestSDKChecksumsAreChecked(t *testing.T) {
	srv, err := s3local.New(s3local.Config{Dir: t.TempDir(), AccessKey: testAccess, SecretKey: testSecret, Logger: objstoretest.Quiet()})
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.CreateBucket(testBucket); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	payloads := map[string]bool{}
	record := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPut {
			mu.Lock()
			payloads[r.Header.Get("x-amz-content-sha256")] = true
			mu.Unlock()
		}
		srv.ServeHTTP(w, r)
	})
	plain := httptest.NewServer(record)
	defer plain.Close()
	tls := httptest.NewTLSServer(record)
	defer tls.Close()
	always := func(o *s3.Options) { o.RequestChecksumCalculation = aws.RequestChecksumCalculationWhenSupported }
	data := bytes.Repeat([]byte("checked "), 100000)
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		client *s3.Client
		body   io.Reader
	}{
		{"plain HTTP", newClient(plain.URL, testAccess, testSecret, always), bytes.NewReader(data)},
		{"TLS, a stream", newClient(tls.URL, testAccess, testSecret, func(o *s3.Options) {
			always(o)
			o.HTTPClient = tls.Client()
		}), struct{ io.Reader }{bytes.NewReader(data)}},
	} {
		_, err := tc.client.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String(testBucket), Key: aws.String(tc.name), Body: tc.body, ContentLength: aws.Int64(int64(len(data))), ChecksumAlgorithm: types.ChecksumAlgorithmCrc32})
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		out, err := tc.client.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String(testBucket), Key: aws.String(tc.name)})
		if err != nil {
			t.Fatal(err)
		}
		got, _ := io.ReadAll(out.Body)
		out.Body.Close()
		if !bytes.Equal(got, data) {
			t.Fatalf("%s: read back %d bytes, not the %d written", tc.name, len(got), len(data))
		}
	}
	if !payloads["STREAMING-UNSIGNED-PAYLOAD-TRAILER"] {
		t.Fatalf("the TLS client sent payloads %v, none with a trailer: the test did not reach what it checks", payloads)
	}
	c := newClient(plain.URL, testAccess, testSecret, nil)
	_, err = c.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String(testBucket), Key: aws.String("wrong"), Body: bytes.NewReader(data), ChecksumCRC32: aws.String("AAAAAA==")})
	if cd, st := code(err); cd != "BadDigest" || st != 400 {
		t.Fatalf("a wrong checksum: %v, want 400 BadDigest", err)
	}
	if _, err := c.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String(testBucket), Key: aws.String("wrong")}); err == nil {
		t.Fatal("the PUT with a wrong checksum stored its object")
	}
}

// TestSDKRefusalsNameTheirCode: a GET signed with a wrong secret is
// SignatureDoesNotMatch, one of an unknown key InvalidAccessKeyId (the
// codes objstore reports as ErrCredentials); a key that is both an
// object and a folder of others is KeyConflict, and the first stays.
func TestSDKRefusalsNameTheirCode(t *testing.T) {
	ep := startEndpoint(t, 0)
	ctx := context.Background()
	for _, tc := range []struct{ access, secret, code string }{
		{testAccess, "wrong", "SignatureDoesNotMatch"},
		{"nobody", testSecret, "InvalidAccessKeyId"},
	} {
		_, err := newClient(ep.url, tc.access, tc.secret, nil).GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String(testBucket), Key: aws.String("k")})
		if cd, st := code(err); cd != tc.code || st != 403 {
			t.Fatalf("keys %s/%s: %v, want 403 %s", tc.access, tc.secret, err, tc.code)
		}
	}
	c := ep.client()
	put(t, c, "a", []byte("a"))
	put(t, c, "c/d", []byte("c/d"))
	for _, k := range []string{"a/b", "c"} {
		_, err := c.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String(testBucket), Key: aws.String(k), Body: bytes.NewReader([]byte("x"))})
		if cd, st := code(err); cd != "KeyConflict" || st != 409 {
			t.Fatalf("put %s: %v, want 409 KeyConflict", k, err)
		}
	}
	if got, err := os.ReadFile(ep.objectFile("a")); err != nil || string(got) != "a" {
		t.Fatalf("the object a after the conflict: %q, %v", got, err)
	}
	out, err := c.DeleteObjects(ctx, &s3.DeleteObjectsInput{Bucket: aws.String(testBucket), Delete: &types.Delete{Objects: []types.ObjectIdentifier{{Key: aws.String("a")}, {Key: aws.String("c/d")}, {Key: aws.String("none")}}}})
	if err != nil || len(out.Deleted) != 3 || len(out.Errors) != 0 {
		t.Fatalf("DeleteObjects of two keys and a missing one: %+v, %v; want 3 deleted", out, err)
	}
	if ents, err := os.ReadDir(filepath.Join(ep.dir, testBucket)); err != nil || len(ents) != 0 {
		t.Fatalf("the bucket's directory after the deletes holds %d entries (%v), want none", len(ents), err)
	}
}

// TestSDKBucketPolicyDeniesAnObject: a policy that denies GETs of one
// object makes them 403 AccessDenied, and the others' and the PUTs pass;
// once the policy is deleted the object reads again.
func TestSDKBucketPolicyDeniesAnObject(t *testing.T) {
	ep := startEndpoint(t, 0)
	c := ep.client()
	ctx := context.Background()
	put(t, c, "kv/denied", []byte("d"))
	put(t, c, "kv/open", []byte("o"))
	doc := `{"Version":"2012-10-17","Statement":[{"Effect":"Deny","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::` + testBucket + `/kv/denied"}]}`
	if _, err := c.PutBucketPolicy(ctx, &s3.PutBucketPolicyInput{Bucket: aws.String(testBucket), Policy: &doc}); err != nil {
		t.Fatal(err)
	}
	get := func(key string) error {
		out, err := c.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String(testBucket), Key: aws.String(key)})
		if err == nil {
			out.Body.Close()
		}
		return err
	}
	if cd, st := code(get("kv/denied")); cd != "AccessDenied" || st != 403 {
		t.Fatalf("GET of the denied object: %s %d, want 403 AccessDenied", cd, st)
	}
	if err := get("kv/open"); err != nil {
		t.Fatalf("GET of another object: %v", err)
	}
	put(t, c, "kv/denied", []byte("d2"))
	if _, err := c.DeleteBucketPolicy(ctx, &s3.DeleteBucketPolicyInput{Bucket: aws.String(testBucket)}); err != nil {
		t.Fatal(err)
	}
	if err := get("kv/denied"); err != nil {
		t.Fatalf("GET once the policy is deleted: %v", err)
	}
}

// TestSDKKeysOfEveryKindRoundTrip: keys with spaces, non-ASCII letters,
// characters URLs and file names treat specially, empty segments and
// dots are signed, stored, listed and read back as themselves.
func TestSDKKeysOfEveryKindRoundTrip(t *testing.T) {
	ep := startEndpoint(t, 0)
	c := ep.client()
	ctx := context.Background()
	keys := []string{"a b/c d", "ü/ñ€", "q?x=1&y=2#frag", "p%41/+=,:@~", "dots/./../...", "slash//twice", "trailing/", "-/*(')!$;"}
	for _, k := range keys {
		put(t, c, k, []byte(k))
	}
	for _, k := range keys {
		out, err := c.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String(testBucket), Key: aws.String(k)})
		if err != nil {
			t.Fatalf("get %q: %v", k, err)
		}
		got, _ := io.ReadAll(out.Body)
		out.Body.Close()
		if string(got) != k {
			t.Fatalf("key %q read back %q", k, got)
		}
	}
	out, err := c.ListObjectsV2(ctx, &s3.ListObjectsV2Input{Bucket: aws.String(testBucket)})
	if err != nil {
		t.Fatal(err)
	}
	var listed []string
	for _, o := range out.Contents {
		listed = append(listed, aws.ToString(o.Key))
	}
	if want := slices.Sorted(slices.Values(keys)); !slices.Equal(listed, want) {
		t.Fatalf("listed %q, want %q", listed, want)
	}
}

// TestSDKReadersNeverSeeHalfAnObject: while writers replace one key over
// and over with objects of one repeated byte each, of two sizes, by PUTs
// and multipart uploads, every GET and ranged GET of many readers at once
// reads one whole object: one byte throughout, its size's length.
func TestSDKReadersNeverSeeHalfAnObject(t *testing.T) {
	ep := startEndpoint(t, 0)
	c := ep.client()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b, k := aws.String(testBucket), aws.String("hot")
	sizes := map[byte]int{'a': 1 << 20, 'b': 6<<20 + 5, 'c': 3}
	put(t, c, "hot", bytes.Repeat([]byte{'c'}, 3))
	var writes atomic.Int64
	var wg sync.WaitGroup
	for w := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ctx.Err() == nil; i++ {
				v := byte('a' + (i+w)%3)
				data := bytes.Repeat([]byte{v}, sizes[v])
				var err error
				if v == 'b' { // in two parts
					var up *s3.CreateMultipartUploadOutput
					if up, err = c.CreateMultipartUpload(ctx, &s3.CreateMultipartUploadInput{Bucket: b, Key: k}); err == nil {
						var parts []types.CompletedPart
						for n, p := range [][]byte{data[:5<<20], data[5<<20:]} {
							out, perr := c.UploadPart(ctx, &s3.UploadPartInput{Bucket: b, Key: k, UploadId: up.UploadId, PartNumber: aws.Int32(int32(n + 1)), Body: bytes.NewReader(p)})
							if perr != nil {
								err = perr
								break
							}
							parts = append(parts, types.CompletedPart{PartNumber: aws.Int32(int32(n + 1)), ETag: out.ETag})
						}
						if err == nil {
							_, err = c.CompleteMultipartUpload(ctx, &s3.CompleteMultipartUploadInput{Bucket: b, Key: k, UploadId: up.UploadId, MultipartUpload: &types.CompletedMultipartUpload{Parts: parts}})
						}
					}
				} else {
					_, err = c.PutObject(ctx, &s3.PutObjectInput{Bucket: b, Key: k, Body: bytes.NewReader(data)})
				}
				if err != nil && ctx.Err() == nil {
					t.Errorf("write of %c: %v", v, err)
					return
				}
				writes.Add(1)
			}
		}()
	}
	var reads atomic.Int64
	for r := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				in := &s3.GetObjectInput{Bucket: b, Key: k}
				if r%2 == 1 {
					in.Range = aws.String("bytes=1-")
				}
				out, err := c.GetObject(ctx, in)
				if err != nil {
					if ctx.Err() == nil {
						t.Errorf("get: %v", err)
					}
					return
				}
				got, err := io.ReadAll(out.Body)
				out.Body.Close()
				if err != nil {
					if ctx.Err() == nil {
						t.Errorf("reading a body: %v", err)
					}
					return
				}
				v := got[0]
				want := sizes[v] - r%2
				if len(got) != want || bytes.Count(got, []byte{v}) != want {
					t.Errorf("a GET read %d bytes starting %q, not one whole object (%d of one byte)", len(got), got[:1], want)
					return
				}
				reads.Add(1)
			}
		}()
	}
	testwait.Until(t, "24 writes", time.Minute, func() bool { return writes.Load() >= 24 || t.Failed() })
	cancel()
	wg.Wait()
	t.Logf("%d writes, %d reads", writes.Load(), reads.Load())
	if reads.Load() == 0 {
		t.Fatal("no read completed: the test checked nothing")
	}
}
