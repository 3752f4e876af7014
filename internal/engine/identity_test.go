//go:build invariants

package engine

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/format"
)

// writeHeaderFile writes a file holding h's header area at path and
// returns it open for reading.
func writeHeaderFile(t *testing.T, path string, h *format.Header) fsys.File {
	t.Helper()
	b := make([]byte, h.Len())
	if err := h.Encode(b); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := fsys.OS{}.OpenFile(path, os.O_RDONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

func headerOfKeys(prefix string, n int) *format.Header {
	h := &format.Header{Fingerprint: 7, Layers: 2, Planes: 2, BlocksPerKey: 1, BlockBytes: 4096, ID: uint64(n)}
	for i := range n {
		h.Keys = append(h.Keys, format.Key{Key: fmt.Appendf(nil, "%s-%03d", prefix, i)})
	}
	return h
}

// TestReadHeaderKeysOutliveItsReusedBuffer: readHeader reads into a buffer
// it reuses, so the keys of a header it returned must not be in that
// buffer: reading other files' headers afterwards leaves them as they were,
// whether the header fit the first read or needed a larger one.
func TestReadHeaderKeysOutliveItsReusedBuffer(t *testing.T) {
	dir := t.TempDir()
	var hr headerReader
	cases := []struct {
		name string
		keys int
	}{
		{"one key", 1},
		{"a first read's worth", 55},
		{"more than a first read holds", 120},
	}
	var got []*format.Header
	var want []*format.Header
	for _, c := range cases {
		for _, prefix := range []string{"a", "b"} { // two files a case, read one after the other
			h := headerOfKeys(prefix+c.name, c.keys)
			f := writeHeaderFile(t, filepath.Join(dir, fmt.Sprintf("%s-%d", prefix, c.keys)), h)
			r, err := hr.readHeader(f)
			if err != nil {
				t.Fatalf("%s: %v", c.name, err)
			}
			got = append(got, r)
			want = append(want, h)
		}
	}
	for i := range got {
		if len(got[i].Keys) != len(want[i].Keys) || got[i].ID != want[i].ID {
			t.Fatalf("header %d: %d keys, id %d: want %d, %d", i, len(got[i].Keys), got[i].ID, len(want[i].Keys), want[i].ID)
		}
		for k := range got[i].Keys {
			if !bytes.Equal(got[i].Keys[k].Key, want[i].Keys[k].Key) {
				t.Fatalf("header %d key %d: %q after later reads, want %q", i, k, got[i].Keys[k].Key, want[i].Keys[k].Key)
			}
		}
	}
}
