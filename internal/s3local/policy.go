package s3local

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
)

// Bucket policies, the least of them: the Deny statements of a policy,
// for every principal, of object actions (s3:GetObject, s3:PutObject,
// s3:DeleteObject, s3:*) on resources of the bucket ("*" matching any
// run of characters), which refuse those requests with 403 AccessDenied,
// as a store refuses an object to a node's keys. An Allow statement
// allows what the one key pair may do anyway. A policy is kept in memory,
// not across a restart. objstore's tests set one to make a store refuse
// an object.

// maxPolicySize is the largest policy document, as S3's.
const maxPolicySize = 20 << 10

// denial is a Deny statement: its actions and resource patterns.
type denial struct {
	actions   []string
	resources []string
}

// stringList is a JSON string or list of strings.
type stringList []string

func (l *stringList) UnmarshalJSON(b []byte) error {
	var one string
	if err := json.Unmarshal(b, &one); err == nil {
		*l = []string{one}
		return nil
	}
	return json.Unmarshal(b, (*[]string)(l))
}

// parsePolicy returns the denials of a policy document, or an error
// naming what s3local does not take.
func parsePolicy(bucket string, doc []byte) ([]denial, error) {
	var p struct {
		Statement []struct {
			Effect    string
			Principal json.RawMessage
			Action    stringList
			Resource  stringList
			Condition json.RawMessage
		}
	}
	if err := json.Unmarshal(doc, &p); err != nil {
		return nil, errorf(http.StatusBadRequest, "MalformedPolicy", "the policy: %v", err)
	}
	var out []denial
	for i, st := range p.Statement {
		switch {
		case st.Condition != nil:
			return nil, errNotImplemented("conditions in bucket policies")
		case st.Effect == "Allow":
			continue // the one key pair may do anything
		case st.Effect != "Deny":
			return nil, errorf(http.StatusBadRequest, "MalformedPolicy", "statement %d: effect %q", i, st.Effect)
		}
		if pr := strings.TrimSpace(string(st.Principal)); pr != `"*"` && pr != `{"AWS":"*"}` {
			return nil, errNotImplemented("bucket policy statements for principals other than \"*\"")
		}
		d := denial{actions: st.Action}
		for _, a := range st.Action {
			if a != "s3:GetObject" && a != "s3:PutObject" && a != "s3:DeleteObject" && a != "s3:*" {
				return nil, errNotImplemented("bucket policies on action " + a)
			}
		}
		for _, r := range st.Resource {
			pat, ok := strings.CutPrefix(r, "arn:aws:s3:::"+bucket+"/")
			if !ok {
				return nil, errorf(http.StatusBadRequest, "MalformedPolicy", "statement %d: resource %q is not an object of bucket %s", i, r, bucket)
			}
			d.resources = append(d.resources, pat)
		}
		out = append(out, d)
	}
	return out, nil
}

// denies reports whether the denials refuse action on key. A pattern's
// "*" matches any run of characters, '/' included.
func denies(ds []denial, action, key string) bool {
	for _, d := range ds {
		for _, a := range d.actions {
			if a != action && a != "s3:*" {
				continue
			}
			for _, pat := range d.resources {
				if wildcard(pat, key) {
					return true
				}
			}
		}
	}
	return false
}

// wildcard matches key against pat, whose '*' is any run of characters.
func wildcard(pat, key string) bool {
	// path.Match's '*' stops at '/', and its '?' and '[' are no S3
	// wildcards: match the pieces between '*'s by hand.
	pieces := strings.Split(pat, "*")
	if len(pieces) == 1 {
		return pat == key
	}
	if !strings.HasPrefix(key, pieces[0]) {
		return false
	}
	key = key[len(pieces[0]):]
	last := pieces[len(pieces)-1]
	for _, p := range pieces[1 : len(pieces)-1] {
		i := strings.Index(key, p)
		if i < 0 {
			return false
		}
		key = key[i+len(p):]
	}
	return len(key) >= len(last) && strings.HasSuffix(key, last)
}

// objectAction is the policy action of an object request's method.
func objectAction(method string) string {
	switch method {
	case http.MethodGet, http.MethodHead:
		return "s3:GetObject"
	case http.MethodDelete:
		return "s3:DeleteObject"
	}
	return "s3:PutObject"
}

// checkPolicy refuses an object request the bucket's policy denies.
func (s *Server) checkPolicy(r *http.Request, bucket, key string) error {
	s.policyMu.RLock()
	ds := s.policies[bucket]
	s.policyMu.RUnlock()
	if ds != nil && denies(ds, objectAction(r.Method), key) {
		return errorf(http.StatusForbidden, "AccessDenied", "the bucket's policy denies %s of %q", objectAction(r.Method), key)
	}
	return nil
}

// bucketPolicy answers PUT, GET and DELETE of a bucket's policy.
func (s *Server) bucketPolicy(w http.ResponseWriter, r *http.Request, sig *signature, bucket string) error {
	if _, err := s.bucketDir(bucket); err != nil {
		return err
	}
	s.policyMu.Lock()
	defer s.policyMu.Unlock()
	switch r.Method {
	case http.MethodPut:
		body, size, err := s.body(r, sig)
		if err != nil {
			return err
		}
		if size > maxPolicySize {
			return errorf(http.StatusBadRequest, "PolicyTooLarge", "a policy of %d bytes, more than %d", size, maxPolicySize)
		}
		doc, err := io.ReadAll(body)
		if err != nil {
			return err
		}
		ds, err := parsePolicy(bucket, doc)
		if err != nil {
			return err
		}
		s.policies[bucket], s.policyDocs[bucket] = ds, doc
		w.WriteHeader(http.StatusNoContent)
	case http.MethodGet:
		doc, ok := s.policyDocs[bucket]
		if !ok {
			return errorf(http.StatusNotFound, "NoSuchBucketPolicy", "the bucket %q has no policy", bucket)
		}
		w.Header().Set("Content-Type", "application/json")
		w.Write(doc)
	case http.MethodDelete:
		delete(s.policies, bucket)
		delete(s.policyDocs, bucket)
		w.WriteHeader(http.StatusNoContent)
	default:
		return errNotImplemented(r.Method + " of a bucket's policy")
	}
	return nil
}
