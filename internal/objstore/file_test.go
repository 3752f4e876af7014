package objstore_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/testwait"
)

// TestReadsReturnTheObjectsBytesInFewRequests: a File's reads, in the
// order a load makes them (the header at 0, then the rest, into several
// buffers), or others (a first read elsewhere, reads past the end),
// return the object's bytes and the counts preadv would, and a whole
// object costs one GET per RangeSize: the header's GET brings the first
// range, and a remainder shorter than a quarter of RangeSize goes with
// the last.
func TestReadsReturnTheObjectsBytesInFewRequests(t *testing.T) {
	const rs = 1 << 20
	ctx := context.Background()
	st := rangedStore(t, rs)
	type read struct{ off, n int64 } // n split into three buffers
	for _, tc := range []struct {
		name  string
		size  int64
		reads []read
		gets  uint64 // the GETs of the reads; 0: not checked
	}{
		{"header, then the rest", 2*rs + rs/2 + 100, []read{{0, 4096}, {4096, 2*rs + rs/2 + 100 - 4096}}, 3},
		{"header, then the whole object (a load into GPU memory)", 2*rs + rs/2 + 100, []read{{0, 4096}, {0, 2*rs + rs/2 + 100}}, 3},
		{"header, then the rest and a short remainder", 3*rs + 4096, []read{{0, 4096}, {4096, 3 * rs}}, 3},
		{"an object shorter than a range", 3000, []read{{0, 4096}, {4096, 100}, {10, 2000}}, 1},
		{"header, then past the end", rs + 10, []read{{0, 4096}, {rs - 5, 100}, {rs + 10, 10}, {rs + 20, 10}}, 4}, // past the head, each read asks
		{"first read elsewhere", 2*rs + 7, []read{{5, rs + 3}, {0, 2*rs + 7}, {2 * rs, 7}}, 0},
		{"a first read at 0 larger than a range", 2 * rs, []read{{0, 2 * rs}}, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key := []byte(tc.name)
			want := putRandom(t, st, key, tc.size)
			f, err := st.Open(ctx, 1, key)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			before := st.Stats().Gets
			for _, r := range tc.reads {
				a, b := r.n/3, r.n/2
				bufs := [][]byte{make([]byte, a), make([]byte, b-a), make([]byte, r.n-b)}
				n, err := f.ReadvAt(bufs, r.off)
				if err != nil {
					t.Fatalf("read of %d at %d: %v", r.n, r.off, err)
				}
				exp := want[min(r.off, tc.size):min(r.off+r.n, tc.size)]
				if got := bytes.Join(bufs, nil)[:n]; n != len(exp) || !bytes.Equal(got, exp) {
					t.Fatalf("read of %d at %d: %d bytes, want %d; equal: %v", r.n, r.off, n, len(exp), bytes.Equal(got, exp))
				}
			}
			if got := st.Stats().Gets - before; tc.gets > 0 && got != tc.gets {
				t.Fatalf("%d GETs, want %d", got, tc.gets)
			}
			if _, err := f.ReadAt(make([]byte, 1), tc.size); !errors.Is(err, io.EOF) {
				t.Fatalf("a read at the end: %v, want io.EOF", err)
			}
		})
	}
}

// TestALoadOfPartOfAnObjectHasTheNextReadItsHeaderAlone: after a load
// that read part of an object of several ranges (a layer range), the
// next load's header read is a GET of the header alone, not of a whole
// range, so that a key loaded layer by layer does not read a range per
// layer; after a load that read it whole, the header's GET reads a
// whole range again.
func TestALoadOfPartOfAnObjectHasTheNextReadItsHeaderAlone(t *testing.T) {
	const rs = 1 << 20
	ctx := context.Background()
	st := rangedStore(t, rs)
	key := []byte("layers")
	const size = 3 * rs
	want := putRandom(t, st, key, size)
	testwait.Until(t, "a listing finding the object", 30*time.Second, func() bool { return st.Has(1, key) })
	// load reads the header, then length bytes after it, and returns the
	// bytes the header's read cost.
	load := func(length int64) uint64 {
		t.Helper()
		f, err := st.Open(ctx, 1, key)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		before := st.Stats().GetBytes
		if _, err := f.ReadAt(make([]byte, 4096), 0); err != nil {
			t.Fatal(err)
		}
		cost := st.Stats().GetBytes - before
		got := make([]byte, length)
		if _, err := f.ReadAt(got, 4096); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want[4096:4096+length]) {
			t.Fatal("other bytes read")
		}
		return cost
	}
	for i, step := range []struct {
		length int64
		cost   uint64
	}{
		{rs / 2, rs},        // a head, the first load
		{rs / 2, 4096},      // after a partial load
		{size - 4096, 4096}, // still, and reads it whole
		{rs / 2, rs},        // a head again
	} {
		if cost := load(step.length); cost != step.cost {
			t.Fatalf("load %d: the header's read cost %d bytes, want %d", i, cost, step.cost)
		}
	}
}
