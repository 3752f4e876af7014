package s3local

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/xml"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// A multipart upload is a directory under Config.Dir's uploadsDir named
// by its ID, holding "target" (the bucket and the key, a line each) and
// one file per part ("part-00001"), each written as objects are: to a
// temporary file renamed once whole. A completion first renames the
// directory (ID + "#done"), so that a part still arriving fails rather
// than joining an object already assembled.

// Multipart limits, S3's.
const (
	maxParts    = 10000
	minPartSize = 5 << 20
	maxPartSize = 5 << 30
)

// uploadDir returns the directory of upload id of key in bucket, or
// NoSuchUpload.
func (s *Server) uploadDir(bucket, key, id string) (string, error) {
	noSuch := errorf(http.StatusNotFound, "NoSuchUpload", "no multipart upload %q of %s/%s", id, bucket, key)
	if len(id) != 32 || strings.Trim(id, "0123456789abcdef") != "" {
		return "", noSuch
	}
	dir := filepath.Join(s.uploads, id)
	target, err := os.ReadFile(filepath.Join(dir, "target"))
	if err != nil || string(target) != bucket+"\n"+key+"\n" {
		return "", noSuch
	}
	return dir, nil
}

type initiateResult struct {
	XMLName  xml.Name `xml:"http://s3.amazonaws.com/doc/2006-03-01/ InitiateMultipartUploadResult"`
	Bucket   string   `xml:"Bucket"`
	Key      string   `xml:"Key"`
	UploadID string   `xml:"UploadId"`
}

func (s *Server) createUpload(w http.ResponseWriter, bucket, key string) error {
	dir, err := s.bucketDir(bucket)
	if err != nil {
		return err
	}
	if _, err := objectPath(dir, key); err != nil {
		return err
	}
	var b [16]byte
	rand.Read(b[:])
	id := hex.EncodeToString(b[:])
	up := filepath.Join(s.uploads, id)
	if err := os.Mkdir(up, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(up, "target"), []byte(bucket+"\n"+key+"\n"), 0o644); err != nil {
		os.RemoveAll(up)
		return err
	}
	return writeXML(w, initiateResult{Bucket: bucket, Key: key, UploadID: id})
}

// partName is the file of part n.
func partName(n int) string { return fmt.Sprintf("part-%05d", n) }

func (s *Server) uploadPart(w http.ResponseWriter, r *http.Request, sig *signature, bucket, key, id, number string) error {
	up, err := s.uploadDir(bucket, key, id)
	if err != nil {
		return err
	}
	n, err := strconv.Atoi(number)
	if err != nil || n < 1 || n > maxParts {
		return errorf(http.StatusBadRequest, "InvalidArgument", "part number %q: want 1 to %d", number, maxParts)
	}
	body, size, err := s.body(r, sig)
	if err != nil {
		return err
	}
	if size > maxPartSize {
		return errorf(http.StatusBadRequest, "EntityTooLarge", "a part of %d bytes, more than 5 GiB", size)
	}
	f, err := os.CreateTemp(up, "#tmp-*")
	if errors.Is(err, fs.ErrNotExist) {
		return errorf(http.StatusNotFound, "NoSuchUpload", "the multipart upload %q ended", id)
	} else if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	_, err = s.copyInto(f, body)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("writing part %d of %s/%s: %w", n, bucket, key, err)
	}
	part := filepath.Join(up, partName(n))
	if err := os.Rename(tmp, part); errors.Is(err, fs.ErrNotExist) {
		return errorf(http.StatusNotFound, "NoSuchUpload", "the multipart upload %q ended", id)
	} else if err != nil {
		return err
	}
	fi, err := os.Stat(part)
	if err != nil {
		return errorf(http.StatusNotFound, "NoSuchUpload", "the multipart upload %q ended", id)
	}
	w.Header().Set("ETag", etag(fi))
	w.WriteHeader(http.StatusOK)
	return nil
}

// completeRequest is CompleteMultipartUpload's request.
type completeRequest struct {
	Parts []struct {
		PartNumber int    `xml:"PartNumber"`
		ETag       string `xml:"ETag"`
	} `xml:"Part"`
}

type completeResult struct {
	XMLName  xml.Name `xml:"http://s3.amazonaws.com/doc/2006-03-01/ CompleteMultipartUploadResult"`
	Location string   `xml:"Location"`
	Bucket   string   `xml:"Bucket"`
	Key      string   `xml:"Key"`
	ETag     string   `xml:"ETag"`
}

// completeUpload assembles the parts the request names, in order, into
// the object: every part but the last at least 5 MiB, each named with
// the ETag its upload answered. The upload ends; a completion refused for
// its parts leaves it to be completed again or aborted.
func (s *Server) completeUpload(w http.ResponseWriter, r *http.Request, sig *signature, bucket, key, id string) error {
	_, path, err := s.locate(bucket, key)
	if err != nil {
		return err
	}
	ifNoneMatch, err := ifNoneMatchAll(r)
	if err != nil {
		return err
	}
	up, err := s.uploadDir(bucket, key, id)
	if err != nil {
		return err
	}
	var req completeRequest
	if err := s.readXML(r, sig, 4<<20, &req); err != nil {
		return err
	}
	if len(req.Parts) == 0 {
		return errorf(http.StatusBadRequest, "MalformedXML", "a completion that names no part")
	}
	done := up + "#done"
	if err := os.Rename(up, done); err != nil {
		return errorf(http.StatusNotFound, "NoSuchUpload", "the multipart upload %q ended", id)
	}
	complete := false
	defer func() {
		if complete {
			os.RemoveAll(done)
		} else {
			os.Rename(done, up) // to be completed again, or aborted
		}
	}()
	files := make([]string, len(req.Parts))
	var total int64
	for i, p := range req.Parts {
		if i > 0 && p.PartNumber <= req.Parts[i-1].PartNumber {
			return errorf(http.StatusBadRequest, "InvalidPartOrder", "part %d after part %d: parts go in ascending order", p.PartNumber, req.Parts[i-1].PartNumber)
		}
		if p.PartNumber < 1 || p.PartNumber > maxParts {
			return errorf(http.StatusBadRequest, "InvalidPart", "part number %d: want 1 to %d", p.PartNumber, maxParts)
		}
	}
	for i, p := range req.Parts {
		files[i] = filepath.Join(done, partName(p.PartNumber))
		fi, err := os.Stat(files[i])
		if err != nil || !etagMatches(p.ETag, etag(fi)) {
			return errorf(http.StatusBadRequest, "InvalidPart", "part %d with ETag %s was not uploaded", p.PartNumber, p.ETag)
		}
		if i < len(req.Parts)-1 && fi.Size() < minPartSize {
			return errorf(http.StatusBadRequest, "EntityTooSmall", "part %d has %d bytes; every part but the last needs 5 MiB", p.PartNumber, fi.Size())
		}
		total += fi.Size()
	}
	release, err := s.reserve(total)
	if err != nil {
		return err
	}
	defer release()
	fi, err := s.write(path, key, ifNoneMatch, func(f *os.File) error {
		for _, name := range files {
			pf, err := os.Open(name)
			if err != nil {
				return err
			}
			_, err = f.ReadFrom(pf) // copy_file_range where the file system can
			pf.Close()
			if err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("assembling %s/%s: %w", bucket, key, err)
	}
	complete = true
	return writeXML(w, completeResult{Location: "/" + bucket + "/" + key, Bucket: bucket, Key: key, ETag: etag(fi)})
}

func (s *Server) abortUpload(w http.ResponseWriter, bucket, key, id string) error {
	up, err := s.uploadDir(bucket, key, id)
	if err != nil {
		return err
	}
	if err := os.RemoveAll(up); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}
