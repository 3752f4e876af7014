package s3local

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"
)

// SigV4 (https://docs.aws.amazon.com/AmazonS3/latest/API/sig-v4-header-based-auth.html):
// the request's canonical form, hashed into a string to sign, signed by a
// key derived from the secret, the date, the region and the service.

const (
	sigAlgorithm = "AWS4-HMAC-SHA256"
	amzDateForm  = "20060102T150405Z"
	// maxSkew is how far a request's date may be from the server's
	// clock, as S3 allows.
	maxSkew = 15 * time.Minute
	// emptySHA256 is the SHA-256 of nothing, in hexadecimal.
	emptySHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
)

// signature is what a request's authentication leaves for the
// signatures of its body's chunks (aws-chunked): nil where the server
// checks none.
type signature struct {
	key     []byte // the signing key
	date    string // the request's x-amz-date
	scope   string // date/region/service/aws4_request
	seed    string // the request's signature
	payload string // its x-amz-content-sha256
}

// authHeader is a parsed Authorization header.
type authHeader struct {
	accessKey, date, region, service string
	signedHeaders                    []string
	signature                        string
}

// parseAuth parses an Authorization header of SigV4's form:
// "AWS4-HMAC-SHA256 Credential=AK/DATE/REGION/s3/aws4_request,
// SignedHeaders=a;b, Signature=HEX".
func parseAuth(h string) (authHeader, error) {
	var a authHeader
	alg, rest, _ := strings.Cut(h, " ")
	if alg != sigAlgorithm {
		return a, errorf(http.StatusBadRequest, "InvalidArgument", "authorization by %q: s3local takes %s (SigV4) only", alg, sigAlgorithm)
	}
	for _, f := range strings.Split(rest, ",") {
		k, v, _ := strings.Cut(strings.TrimSpace(f), "=")
		switch k {
		case "Credential":
			parts := strings.Split(v, "/")
			if len(parts) != 5 || parts[4] != "aws4_request" {
				return a, errorf(http.StatusBadRequest, "AuthorizationHeaderMalformed", "credential %q: want KEY/DATE/REGION/SERVICE/aws4_request", v)
			}
			a.accessKey, a.date, a.region, a.service = parts[0], parts[1], parts[2], parts[3]
		case "SignedHeaders":
			a.signedHeaders = strings.Split(v, ";")
		case "Signature":
			a.signature = v
		}
	}
	if a.accessKey == "" || len(a.signedHeaders) == 0 || a.signature == "" {
		return a, errorf(http.StatusBadRequest, "AuthorizationHeaderMalformed", "the authorization header lacks a credential, signed headers or a signature")
	}
	return a, nil
}

// authenticate checks r's SigV4 signature against the server's keys at
// time now. Without keys it accepts every request and returns nil.
func (s *Server) authenticate(r *http.Request, now time.Time) (*signature, error) {
	if s.cfg.AccessKey == "" {
		return nil, nil
	}
	h := r.Header.Get("Authorization")
	if h == "" {
		if r.URL.Query().Has("X-Amz-Signature") {
			return nil, errNotImplemented("presigned URLs")
		}
		return nil, errorf(http.StatusForbidden, "AccessDenied", "the request is not signed")
	}
	a, err := parseAuth(h)
	if err != nil {
		return nil, err
	}
	if a.accessKey != s.cfg.AccessKey {
		return nil, errorf(http.StatusForbidden, "InvalidAccessKeyId", "no access key %q here", a.accessKey)
	}
	date := r.Header.Get("x-amz-date")
	t, err := time.Parse(amzDateForm, date)
	if err != nil {
		return nil, errorf(http.StatusForbidden, "AccessDenied", "x-amz-date %q: want %s", date, amzDateForm)
	}
	if d := t.Sub(now); d > maxSkew || d < -maxSkew {
		return nil, errorf(http.StatusForbidden, "RequestTimeTooSkewed", "the request's time %s is %v from the server's", date, d.Round(time.Second))
	}
	if !strings.HasPrefix(date, a.date) {
		return nil, errorf(http.StatusForbidden, "SignatureDoesNotMatch", "the credential's date %s is not the request's %s", a.date, date)
	}
	payload := r.Header.Get("x-amz-content-sha256")
	if payload == "" {
		return nil, errorf(http.StatusBadRequest, "InvalidRequest", "missing x-amz-content-sha256")
	}
	key := signingKey(s.cfg.SecretKey, a.date, a.region, a.service)
	scope := a.date + "/" + a.region + "/" + a.service + "/aws4_request"
	canon := canonicalRequest(r, a.signedHeaders, payload)
	want := hmacHex(key, stringToSign(date, scope, canon))
	if !hmac.Equal([]byte(want), []byte(a.signature)) {
		return nil, errorf(http.StatusForbidden, "SignatureDoesNotMatch", "the request's signature does not match the one computed with the access key's secret")
	}
	return &signature{key: key, date: date, scope: scope, seed: a.signature, payload: payload}, nil
}

// signingKey derives SigV4's signing key.
func signingKey(secret, date, region, service string) []byte {
	k := hmacSum([]byte("AWS4"+secret), date)
	k = hmacSum(k, region)
	k = hmacSum(k, service)
	return hmacSum(k, "aws4_request")
}

func hmacSum(key []byte, data string) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(data))
	return m.Sum(nil)
}

func hmacHex(key []byte, data string) string { return hex.EncodeToString(hmacSum(key, data)) }

func sha256Hex(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// stringToSign is SigV4's string to sign of a canonical request.
func stringToSign(date, scope, canon string) string {
	return sigAlgorithm + "\n" + date + "\n" + scope + "\n" + sha256Hex([]byte(canon))
}

// canonicalRequest is SigV4's canonical form of r: its method, its path
// as sent (S3 signs it without escaping it again), its query sorted and
// escaped, the signed headers and the payload's hash.
func canonicalRequest(r *http.Request, signed []string, payload string) string {
	path := r.RequestURI
	if i := strings.IndexByte(path, '?'); i >= 0 {
		path = path[:i]
	}
	if u, err := url.Parse(path); err == nil && u.IsAbs() {
		path = u.EscapedPath()
	}
	if path == "" {
		path = "/"
	}
	var b strings.Builder
	b.WriteString(r.Method)
	b.WriteByte('\n')
	b.WriteString(path)
	b.WriteByte('\n')
	b.WriteString(canonicalQuery(r.URL.Query()))
	b.WriteByte('\n')
	for _, name := range signed {
		b.WriteString(name)
		b.WriteByte(':')
		b.WriteString(headerValue(r, name))
		b.WriteByte('\n')
	}
	b.WriteByte('\n')
	b.WriteString(strings.Join(signed, ";"))
	b.WriteByte('\n')
	b.WriteString(payload)
	return b.String()
}

// canonicalQuery is q's parameters escaped as SigV4 does, sorted by name,
// then value.
func canonicalQuery(q url.Values) string {
	var pairs []string
	for k, vs := range q {
		for _, v := range vs {
			pairs = append(pairs, awsEscape(k)+"="+awsEscape(v))
		}
	}
	sort.Strings(pairs)
	return strings.Join(pairs, "&")
}

// awsEscape percent-encodes every byte of s but RFC 3986's unreserved
// characters, in upper-case hexadecimal.
func awsEscape(s string) string {
	const hexDigits = "0123456789ABCDEF"
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.' || c == '~' {
			b.WriteByte(c)
			continue
		}
		b.WriteByte('%')
		b.WriteByte(hexDigits[c>>4])
		b.WriteByte(hexDigits[c&15])
	}
	return b.String()
}

// headerValue is the canonical value of r's header name (lower case):
// its values trimmed, inner runs of spaces made one, joined by commas.
// Go's server keeps Host and Content-Length out of r.Header.
func headerValue(r *http.Request, name string) string {
	var vals []string
	switch name {
	case "host":
		vals = []string{r.Host}
	case "content-length":
		vals = r.Header.Values("Content-Length")
		if len(vals) == 0 && r.ContentLength >= 0 {
			vals = []string{strconv.FormatInt(r.ContentLength, 10)}
		}
	case "transfer-encoding":
		vals = r.TransferEncoding
	default:
		vals = r.Header.Values(name)
	}
	out := make([]string, len(vals)) // vals may be r.Header's own
	for i, v := range vals {
		out[i] = strings.Join(strings.Fields(v), " ")
	}
	return strings.Join(out, ",")
}
