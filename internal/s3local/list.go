package s3local

import (
	"encoding/base64"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// maxListKeys is the most keys of one listing's page, as S3's.
const maxListKeys = 1000

// listEntry is an object a listing found.
type listEntry struct {
	key string
	fi  fs.FileInfo
}

// walk appends to out, in key order, the objects under the directory dir,
// whose keys begin with keyPrefix, that begin with prefix and come after
// after, until out holds limit. A directory's entries are read whole and
// sorted by their keys ("/" after a folder's name), which makes a walk
// depth first give keys in order; a folder none of whose keys can qualify
// is not entered.
func walk(dir, keyPrefix, prefix, after string, limit int, out *[]listEntry) error {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, fs.ErrInvalid) {
		return nil // removed meanwhile, emptied
	}
	if err != nil {
		return err
	}
	type item struct {
		sortKey string // the key segment, a '/' after a folder's
		ent     fs.DirEntry
	}
	items := make([]item, 0, len(ents))
	for _, e := range ents {
		seg, ok := unescapeSegment(e.Name())
		if !ok {
			continue // a temporary file, or not s3local's
		}
		if e.IsDir() {
			seg += "/"
		} else if !e.Type().IsRegular() {
			continue
		}
		items = append(items, item{seg, e})
	}
	slices.SortFunc(items, func(a, b item) int { return strings.Compare(a.sortKey, b.sortKey) })
	for _, it := range items {
		if len(*out) >= limit {
			return nil
		}
		full := keyPrefix + it.sortKey
		if it.ent.IsDir() {
			if !strings.HasPrefix(full, prefix) && !strings.HasPrefix(prefix, full) {
				continue // no key under it begins with prefix
			}
			if after >= full && !strings.HasPrefix(after, full) {
				continue // every key under it comes before after
			}
			if err := walk(filepath.Join(dir, it.ent.Name()), full, prefix, after, limit, out); err != nil {
				return err
			}
			continue
		}
		if !strings.HasPrefix(full, prefix) || full <= after {
			continue
		}
		fi, err := it.ent.Info()
		if errors.Is(err, fs.ErrNotExist) {
			continue // removed meanwhile
		} else if err != nil {
			return err
		}
		*out = append(*out, listEntry{key: full, fi: fi})
	}
	return nil
}

// listResult is ListObjectsV2's answer.
type listResult struct {
	XMLName               xml.Name      `xml:"http://s3.amazonaws.com/doc/2006-03-01/ ListBucketResult"`
	Name                  string        `xml:"Name"`
	Prefix                string        `xml:"Prefix"`
	StartAfter            string        `xml:"StartAfter,omitempty"`
	ContinuationToken     string        `xml:"ContinuationToken,omitempty"`
	NextContinuationToken string        `xml:"NextContinuationToken,omitempty"`
	KeyCount              int           `xml:"KeyCount"`
	MaxKeys               int           `xml:"MaxKeys"`
	IsTruncated           bool          `xml:"IsTruncated"`
	Contents              []listContent `xml:"Contents"`
}

type listContent struct {
	Key          string `xml:"Key"`
	LastModified string `xml:"LastModified"`
	ETag         string `xml:"ETag"`
	Size         int64  `xml:"Size"`
	StorageClass string `xml:"StorageClass"`
}

// listObjects answers ListObjectsV2: the keys in order from prefix,
// after start-after or the continuation token (the last key of the page
// before), up to max-keys (at most 1000) a page.
func (s *Server) listObjects(w http.ResponseWriter, bucket string, q url.Values) error {
	dir, err := s.bucketDir(bucket)
	if err != nil {
		return err
	}
	for _, p := range []string{"delimiter", "encoding-type"} {
		if q.Get(p) != "" {
			return errNotImplemented("listings with " + p)
		}
	}
	prefix, startAfter, token := q.Get("prefix"), q.Get("start-after"), q.Get("continuation-token")
	maxKeys := maxListKeys
	if v := q.Get("max-keys"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return errorf(http.StatusBadRequest, "InvalidArgument", "max-keys %q: want a count", v)
		}
		maxKeys = min(n, maxListKeys)
	}
	after := startAfter
	if token != "" {
		last, err := base64.RawURLEncoding.DecodeString(token)
		if err != nil {
			return errorf(http.StatusBadRequest, "InvalidArgument", "the continuation token %q is not one of s3local's", token)
		}
		after = max(after, string(last))
	}
	// Walk from the deepest folder prefix names whole.
	start, keyPrefix := dir, ""
	if i := strings.LastIndexByte(prefix, '/'); i >= 0 {
		keyPrefix = prefix[:i+1]
		if start, err = objectPath(dir, prefix[:i]); err != nil {
			start = "" // no such folder can exist
		}
	}
	var found []listEntry
	if start != "" && maxKeys > 0 {
		if err := walk(start, keyPrefix, prefix, after, maxKeys+1, &found); err != nil {
			return fmt.Errorf("listing %s: %w", bucket, err)
		}
	}
	res := listResult{Name: bucket, Prefix: prefix, StartAfter: startAfter, ContinuationToken: token, MaxKeys: maxKeys}
	if len(found) > maxKeys {
		found = found[:maxKeys]
		res.IsTruncated = true
		res.NextContinuationToken = base64.RawURLEncoding.EncodeToString([]byte(found[len(found)-1].key))
	}
	res.KeyCount = len(found)
	for _, e := range found {
		res.Contents = append(res.Contents, listContent{Key: e.key, LastModified: lastModified(e.fi.ModTime()), ETag: etag(e.fi), Size: e.fi.Size(), StorageClass: "STANDARD"})
	}
	return writeXML(w, res)
}

// writeXML answers 200 with v as XML.
func writeXML(w http.ResponseWriter, v any) error {
	body, err := xml.Marshal(v)
	if err != nil {
		return err
	}
	w.Header().Set("Content-Type", "application/xml")
	w.Header().Set("Content-Length", strconv.Itoa(len(xml.Header)+len(body)))
	w.WriteHeader(http.StatusOK)
	io.WriteString(w, xml.Header)
	w.Write(body)
	return nil
}

// readXML decodes r's body, verified as body verifies it and of at most
// limit bytes, into v.
func (s *Server) readXML(r *http.Request, sig *signature, limit int64, v any) error {
	body, size, err := s.body(r, sig)
	if err != nil {
		return err
	}
	if size > limit {
		return errorf(http.StatusBadRequest, "MalformedXML", "the request's body has %d bytes, more than %d", size, limit)
	}
	b, err := io.ReadAll(body)
	if err != nil {
		return err
	}
	if err := xml.Unmarshal(b, v); err != nil {
		return errorf(http.StatusBadRequest, "MalformedXML", "the request's body: %v", err)
	}
	return nil
}

// deleteRequest is DeleteObjects' request.
type deleteRequest struct {
	Quiet   bool `xml:"Quiet"`
	Objects []struct {
		Key string `xml:"Key"`
	} `xml:"Object"`
}

// deleteResult is DeleteObjects' answer.
type deleteResult struct {
	XMLName xml.Name `xml:"http://s3.amazonaws.com/doc/2006-03-01/ DeleteResult"`
	Deleted []struct {
		Key string `xml:"Key"`
	} `xml:"Deleted"`
	Errors []deleteError `xml:"Error"`
}

type deleteError struct {
	Key     string `xml:"Key"`
	Code    string `xml:"Code"`
	Message string `xml:"Message"`
}

// deleteObjects answers DeleteObjects: up to 1000 keys, each removed or
// its error reported; with Quiet only the errors.
func (s *Server) deleteObjects(w http.ResponseWriter, r *http.Request, sig *signature, bucket string) error {
	dir, err := s.bucketDir(bucket)
	if err != nil {
		return err
	}
	var req deleteRequest
	if err := s.readXML(r, sig, 2<<20, &req); err != nil {
		return err
	}
	if len(req.Objects) > maxListKeys {
		return errorf(http.StatusBadRequest, "MalformedXML", "%d keys to delete, more than %d", len(req.Objects), maxListKeys)
	}
	var res deleteResult
	for _, o := range req.Objects {
		err := checkKey(o.Key)
		if err == nil {
			err = s.remove(dir, o.Key)
		}
		var ae *apiError
		switch {
		case errors.As(err, &ae):
			res.Errors = append(res.Errors, deleteError{Key: o.Key, Code: ae.code, Message: ae.msg})
		case err != nil:
			res.Errors = append(res.Errors, deleteError{Key: o.Key, Code: "InternalError", Message: err.Error()})
		case !req.Quiet:
			res.Deleted = append(res.Deleted, struct {
				Key string `xml:"Key"`
			}{o.Key})
		}
	}
	return writeXML(w, res)
}
