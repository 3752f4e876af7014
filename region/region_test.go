package region

import (
	"errors"
	"testing"

	"golang.org/x/sys/unix"
)

func TestHostShared(t *testing.T) {
	h, err := NewHost("test", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if h.Kind() != KindHost || h.Len() != 1<<20 || h.ID() == 0 {
		t.Fatalf("kind %v len %d id %d", h.Kind(), h.Len(), h.ID())
	}
	copy(h.Bytes()[4096:], "hello")
	// A second mapping of a dup of the fd sees the same pages, as a peer
	// process that received the fd over SCM_RIGHTS would.
	fd, err := unix.Dup(h.Fd())
	if err != nil {
		t.Fatal(err)
	}
	peer, err := OpenMemfd(fd, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	if peer.ID() != h.ID() {
		t.Fatalf("peer id %d, want %d", peer.ID(), h.ID())
	}
	if got := string(peer.Bytes()[4096:4101]); got != "hello" {
		t.Fatalf("peer sees %q", got)
	}
	peer.Bytes()[0] = 7
	if h.Bytes()[0] != 7 {
		t.Fatal("write through peer not visible")
	}
	if _, err := OpenMemfd(h.Fd(), 2<<20); !errors.Is(err, ErrBounds) {
		t.Fatalf("mapping beyond the memfd: %v", err)
	}
}

func TestSegment(t *testing.T) {
	h, err := NewHost("seg", 8192)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		off, n int64
		ok     bool
	}{
		{0, 8192, true}, {4096, 4096, true}, {8192, 0, true},
		{-1, 1, false}, {0, 8193, false}, {8000, 193, false}, {1, -1, false}, {1 << 62, 1 << 62, false},
	} {
		s := Segment{Region: h, Offset: tc.off, Length: tc.n}
		b, err := s.Bytes()
		if tc.ok != (err == nil) {
			t.Errorf("segment [%d,+%d): err %v", tc.off, tc.n, err)
			continue
		}
		if err == nil && int64(len(b)) != tc.n {
			t.Errorf("segment [%d,+%d): %d bytes", tc.off, tc.n, len(b))
		}
		if err != nil && !errors.Is(err, ErrBounds) {
			t.Errorf("segment [%d,+%d): %v, want ErrBounds", tc.off, tc.n, err)
		}
	}
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := (Segment{Region: h, Offset: 0, Length: 1}).Bytes(); !errors.Is(err, ErrClosed) {
		t.Fatalf("after close: %v", err)
	}
	if err := h.Close(); err != nil {
		t.Fatalf("second close: %v", err)
	}
}
