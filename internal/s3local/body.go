package s3local

import (
	"bufio"
	"crypto/md5"
	"crypto/sha1"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"hash"
	"hash/crc32"
	"hash/crc64"
	"io"
	"net/http"
	"strconv"
	"strings"
)

// A request's body is read through a verifier, which fails in place of
// io.EOF where the payload is not what the request said: its length, its
// SHA-256 (x-amz-content-sha256), its Content-MD5, an x-amz-checksum-*
// header or trailer, the signature of an aws-chunked chunk. A write that
// reads such an error publishes nothing.

// The payload hashes of x-amz-content-sha256 that are not a SHA-256.
const (
	unsignedPayload        = "UNSIGNED-PAYLOAD"
	streamingSigned        = "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"
	streamingSignedTrailer = "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER"
	streamingUnsigned      = "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
)

// crc64NVME is CRC-64/NVME's table (S3's CRC64NVME checksum): the
// reflected polynomial 0x9a6c9329ac4bc9b5.
var crc64NVME = crc64.MakeTable(0x9a6c9329ac4bc9b5)

// checksumAlgorithms are the algorithms of x-amz-checksum-NAME, by NAME.
var checksumAlgorithms = map[string]func() hash.Hash{
	"crc32":     func() hash.Hash { return crc32.NewIEEE() },
	"crc32c":    func() hash.Hash { return crc32.New(crc32.MakeTable(crc32.Castagnoli)) },
	"crc64nvme": func() hash.Hash { return crc64.New(crc64NVME) },
	"sha1":      sha1.New,
	"sha256":    sha256.New,
}

// check is one digest a payload must have.
type check struct {
	what string    // the header or trailer that gave it, for messages
	h    hash.Hash // computed over the payload
	hex  bool      // the digest is in hexadecimal, else base64
	want func() (string, bool)
	code string // the error code of a mismatch
}

// verifier reads a payload of size bytes and fails at its end where a
// check does not hold.
type verifier struct {
	r      io.Reader
	n      int64
	size   int64
	checks []check
}

func (v *verifier) Read(p []byte) (int, error) {
	n, err := v.r.Read(p)
	if n > 0 {
		v.n += int64(n)
		if v.n > v.size {
			return n, errorf(http.StatusBadRequest, "IncompleteBody", "the body has more than the %d bytes declared", v.size)
		}
		for _, c := range v.checks {
			c.h.Write(p[:n])
		}
	}
	if errors.Is(err, io.ErrUnexpectedEOF) || err == io.EOF && v.n < v.size {
		return n, errorf(http.StatusBadRequest, "IncompleteBody", "the body ended after %d of the %d bytes declared", v.n, v.size)
	}
	if err == io.EOF {
		for _, c := range v.checks {
			want, ok := c.want()
			if !ok {
				return n, errorf(http.StatusBadRequest, "InvalidRequest", "the body's trailer lacks %s", c.what)
			}
			sum := c.h.Sum(nil)
			got := base64.StdEncoding.EncodeToString(sum)
			if c.hex {
				got = hex.EncodeToString(sum)
			}
			if got != want {
				return n, errorf(http.StatusBadRequest, c.code, "%s says %s, the body's is %s", c.what, want, got)
			}
		}
	}
	return n, err
}

// body returns r's payload, whose length is size, through a verifier; sig
// checks an aws-chunked body's chunks (nil: none checked).
func (s *Server) body(r *http.Request, sig *signature) (io.Reader, int64, error) {
	payload := r.Header.Get("x-amz-content-sha256")
	v := &verifier{r: r.Body}
	var chunks *chunkedReader
	switch payload {
	case streamingSigned, streamingSignedTrailer, streamingUnsigned:
		dl := r.Header.Get("x-amz-decoded-content-length")
		size, err := strconv.ParseInt(dl, 10, 64)
		if err != nil || size < 0 {
			return nil, 0, errorf(http.StatusLengthRequired, "MissingContentLength", "an aws-chunked body needs x-amz-decoded-content-length (got %q)", dl)
		}
		v.size = size
		chunks = &chunkedReader{br: bufio.NewReaderSize(r.Body, 64<<10), trailer: map[string]string{}}
		if payload != streamingUnsigned && sig != nil {
			chunks.sig, chunks.prev = sig, sig.seed
		}
		chunks.signedTrailer = payload == streamingSignedTrailer && sig != nil
		v.r = chunks
	default:
		if strings.HasPrefix(payload, "STREAMING-") {
			return nil, 0, errNotImplemented("bodies of " + payload)
		}
		if r.ContentLength < 0 {
			return nil, 0, errorf(http.StatusLengthRequired, "MissingContentLength", "the request has no Content-Length")
		}
		v.size = r.ContentLength
		if payload != "" && payload != unsignedPayload {
			if len(payload) != 64 {
				return nil, 0, errorf(http.StatusBadRequest, "InvalidArgument", "x-amz-content-sha256 %q is neither a SHA-256 nor a payload kind s3local knows", payload)
			}
			want := strings.ToLower(payload)
			v.checks = append(v.checks, check{what: "x-amz-content-sha256", h: sha256.New(), hex: true, want: func() (string, bool) { return want, true }, code: "XAmzContentSHA256Mismatch"})
		}
	}
	if md := r.Header.Get("Content-MD5"); md != "" {
		v.checks = append(v.checks, check{what: "Content-MD5", h: md5.New(), want: func() (string, bool) { return md, true }, code: "BadDigest"})
	}
	for name, vals := range r.Header {
		alg, ok := strings.CutPrefix(strings.ToLower(name), "x-amz-checksum-")
		if !ok || alg == "type" || alg == "algorithm" {
			continue
		}
		newHash, ok := checksumAlgorithms[alg]
		if !ok {
			return nil, 0, errorf(http.StatusBadRequest, "InvalidRequest", "checksum %s: s3local knows crc32, crc32c, crc64nvme, sha1 and sha256", name)
		}
		want := vals[0]
		v.checks = append(v.checks, check{what: strings.ToLower(name), h: newHash(), want: func() (string, bool) { return want, true }, code: "BadDigest"})
	}
	if t := r.Header.Get("x-amz-trailer"); t != "" {
		if chunks == nil {
			return nil, 0, errorf(http.StatusBadRequest, "InvalidRequest", "x-amz-trailer %q without an aws-chunked body", t)
		}
		for _, name := range strings.Split(t, ",") {
			name = strings.ToLower(strings.TrimSpace(name))
			alg, _ := strings.CutPrefix(name, "x-amz-checksum-")
			newHash, ok := checksumAlgorithms[alg]
			if !ok {
				return nil, 0, errorf(http.StatusBadRequest, "InvalidRequest", "trailer %s: s3local takes x-amz-checksum-ALG trailers of crc32, crc32c, crc64nvme, sha1 and sha256", name)
			}
			v.checks = append(v.checks, check{what: "the trailer " + name, h: newHash(), want: func() (string, bool) {
				val, ok := chunks.trailer[name]
				return val, ok
			}, code: "BadDigest"})
		}
	}
	return v, v.size, nil
}

// chunkedReader decodes an aws-chunked body
// (https://docs.aws.amazon.com/AmazonS3/latest/API/sigv4-streaming.html):
// chunks of "HEX-SIZE[;chunk-signature=SIG]\r\nDATA\r\n", the last of
// size 0, then trailer lines "name:value\r\n" and an empty line. With a
// signature it checks every chunk's, each chained to the one before, and
// the trailer's.
type chunkedReader struct {
	br            *bufio.Reader
	sig           *signature // nil: chunk signatures not checked
	signedTrailer bool       // the trailer must carry a signature (checked)
	prev          string     // the last signature of the chain
	left          int64      // bytes of the current chunk not yet read
	chunkSig      string     // the current chunk's signature
	h             hash.Hash  // the SHA-256 of the current chunk's data, with sig
	trailer       map[string]string
	err           error
}

func (c *chunkedReader) Read(p []byte) (int, error) {
	for c.err == nil && c.left == 0 {
		c.err = c.next()
	}
	if c.err != nil {
		return 0, c.err
	}
	n, err := c.br.Read(p[:min(int64(len(p)), c.left)])
	c.left -= int64(n)
	if c.h != nil {
		c.h.Write(p[:n])
	}
	if err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	if err == nil && c.left == 0 {
		err = c.endChunk()
	}
	if err != nil {
		c.err = err
	}
	return n, err
}

// badChunk is the error of a body that is not aws-chunked.
func badChunk(format string, args ...any) error {
	return errorf(http.StatusBadRequest, "IncompleteBody", "aws-chunked body: "+format, args...)
}

// readLine reads a line ending in CRLF, without it.
func (c *chunkedReader) readLine() (string, error) {
	line, err := c.br.ReadSlice('\n')
	if err == io.EOF || err == io.ErrUnexpectedEOF {
		return "", io.ErrUnexpectedEOF
	}
	if err != nil {
		return "", badChunk("a line: %v", err)
	}
	return strings.TrimSuffix(strings.TrimSuffix(string(line), "\n"), "\r"), nil
}

// next reads a chunk's header; at the last chunk it reads the trailer
// and returns io.EOF.
func (c *chunkedReader) next() error {
	line, err := c.readLine()
	if err != nil {
		return err
	}
	sizeHex, ext, _ := strings.Cut(line, ";")
	size, err := strconv.ParseInt(sizeHex, 16, 64)
	if err != nil || size < 0 {
		return badChunk("chunk header %q", line)
	}
	c.chunkSig, _ = strings.CutPrefix(ext, "chunk-signature=")
	if c.sig != nil && c.chunkSig == "" {
		return errorf(http.StatusForbidden, "SignatureDoesNotMatch", "aws-chunked body: chunk header %q has no signature", line)
	}
	if c.sig != nil {
		c.h = sha256.New()
	}
	c.left = size
	if size > 0 {
		return nil
	}
	if err := c.checkChunk(); err != nil {
		return err
	}
	return c.readTrailer()
}

// endChunk reads the CRLF after a chunk's data and checks its signature.
func (c *chunkedReader) endChunk() error {
	line, err := c.readLine()
	if err != nil {
		return err
	}
	if line != "" {
		return badChunk("a chunk's data runs past its size")
	}
	return c.checkChunk()
}

// checkChunk checks the current chunk's signature, with sig.
func (c *chunkedReader) checkChunk() error {
	if c.sig == nil {
		return nil
	}
	sts := "AWS4-HMAC-SHA256-PAYLOAD\n" + c.sig.date + "\n" + c.sig.scope + "\n" + c.prev + "\n" + emptySHA256 + "\n" + hex.EncodeToString(c.h.Sum(nil))
	if want := hmacHex(c.sig.key, sts); want != c.chunkSig {
		return errorf(http.StatusForbidden, "SignatureDoesNotMatch", "aws-chunked body: a chunk's signature does not match its data")
	}
	c.prev = c.chunkSig
	return nil
}

// readTrailer reads the trailer after the last chunk, checking its
// signature where it must have one, and returns io.EOF.
func (c *chunkedReader) readTrailer() error {
	var canon strings.Builder
	trailerSig := ""
	for {
		line, err := c.readLine()
		if err == io.ErrUnexpectedEOF && canon.Len() == 0 && trailerSig == "" {
			break // no trailer, and no empty line after the last chunk
		}
		if err != nil {
			return err
		}
		if line == "" {
			break
		}
		name, val, ok := strings.Cut(line, ":")
		if !ok {
			return badChunk("trailer line %q", line)
		}
		name, val = strings.ToLower(strings.TrimSpace(name)), strings.TrimSpace(val)
		if name == "x-amz-trailer-signature" {
			trailerSig = val
			continue
		}
		c.trailer[name] = val
		canon.WriteString(name + ":" + val + "\n")
	}
	if c.signedTrailer {
		sts := "AWS4-HMAC-SHA256-TRAILER\n" + c.sig.date + "\n" + c.sig.scope + "\n" + c.prev + "\n" + sha256Hex([]byte(canon.String()))
		if trailerSig == "" || hmacHex(c.sig.key, sts) != trailerSig {
			return errorf(http.StatusForbidden, "SignatureDoesNotMatch", "aws-chunked body: the trailer's signature is missing or does not match")
		}
	}
	return io.EOF
}
