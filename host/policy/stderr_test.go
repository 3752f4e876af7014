package policy

import (
	"bytes"
	"strings"
	"testing"
)

// TestStderrTailKeepsOnlyItsTail: what a plugin writes to stderr is kept
// only as far as its last tailSize bytes, whatever the size of its
// writes: a plugin's writes (up to its whole memory per iovec) must not
// make the host copy and keep as much memory, outside the memory limit,
// per instance.
func TestStderrTailKeepsOnlyItsTail(t *testing.T) {
	big := append(bytes.Repeat([]byte{'a'}, 1<<20), " the end"...)
	tests := []struct {
		name   string
		writes [][]byte
		want   string // the end of last()
	}{
		{"one write of 1 MiB", [][]byte{big}, "aaa the end"},
		{"a short write after 1 MiB", [][]byte{big, []byte("\nshort")}, "the end | short"},
		{"1 MiB after a short write", [][]byte{[]byte("short\n"), big}, "aaa the end"},
		{"many short writes", bytes.SplitAfter(bytes.Repeat([]byte("line\n"), 1000), []byte("\n")), "line | line"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := &tailWriter{}
			for _, p := range tt.writes {
				if n, err := w.Write(p); n != len(p) || err != nil {
					t.Fatalf("Write of %d bytes = %d, %v", len(p), n, err)
				}
				if c := cap(w.buf); c > 2*tailSize {
					t.Fatalf("after a write of %d bytes the tail holds %d bytes of memory, want at most %d", len(p), c, 2*tailSize)
				}
			}
			if got := w.last(); !strings.HasSuffix(got, tt.want) {
				t.Fatalf("last() = %q, want it to end in %q", got, tt.want)
			}
		})
	}
}
