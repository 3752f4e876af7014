package format

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/kvhost/kvhost/internal/crc32c"
)

// withLayerSums returns sample(nkeys, order) with a layer sum for every
// key and layer.
func withLayerSums(nkeys int, order uint32) *Header {
	h := sample(nkeys, order)
	h.LayerSums = make([]uint32, nkeys*int(h.Layers))
	for i := range h.LayerSums {
		h.LayerSums[i] = 0x9e3779b9 * uint32(i+1)
	}
	return h
}

// TestLayerSumsRoundTrip: a header's layer sums decode as encoded where
// their block fits in the header area's padding, and are left out (the
// header otherwise the same, its length unchanged) where it does not; a
// header without them decodes without them.
func TestLayerSumsRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		name  string
		keys  int
		order uint32
		sums  bool
		fit   bool
	}{
		{"one key, layer-major", 1, OrderLayerMajor, true, true},
		{"three keys, block-major", 3, OrderBlockMajor, true, true},
		{"55 keys: no room in 4096 bytes", 55, OrderLayerMajor, true, false},
		{"56 keys: room in 8192 bytes", 56, OrderLayerMajor, true, true},
		{"256 keys: no room in 20480 bytes", MaxKeys, OrderLayerMajor, true, false},
		{"without layer sums", 2, OrderLayerMajor, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := sample(tc.keys, tc.order)
			if tc.sums {
				h = withLayerSums(tc.keys, tc.order)
			}
			if tc.sums && h.LayerSumsFit() != tc.fit {
				t.Fatalf("LayerSumsFit %v, want %v (used %d, block %d, area %d)", h.LayerSumsFit(), tc.fit, h.UsedLen(), h.LayerSumsLen(), h.Len())
			}
			b := make([]byte, h.Len())
			if err := h.Encode(b); err != nil {
				t.Fatal(err)
			}
			got, err := Decode(b)
			if err != nil {
				t.Fatal(err)
			}
			want := h.LayerSums
			if !tc.fit {
				want = nil
			}
			if !slices.Equal(got.LayerSums, want) || (got.LayerSums == nil) != (want == nil) {
				t.Fatalf("layer sums %v, want %v", got.LayerSums, want)
			}
			if tc.fit {
				if got.LayerSum(tc.keys-1, int(h.Layers)-1) != h.LayerSums[len(h.LayerSums)-1] {
					t.Fatalf("LayerSum of the last key's last layer: 0x%08x", got.LayerSum(tc.keys-1, int(h.Layers)-1))
				}
				checkReencodes(t, got)
			}
			// Every byte after the block (or the used part) is zero.
			end := h.UsedLen()
			if tc.fit {
				end += h.LayerSumsLen()
			}
			if i := slices.IndexFunc(b[end:], func(c byte) bool { return c != 0 }); i >= 0 {
				t.Fatalf("byte %d of the padding is 0x%02x, want 0", end+i, b[end+i])
			}
		})
	}
}

// TestLayerSumsInvisibleToOldReaders: the layer sums block changes no
// byte an older reader reads: the used part, used_len, header_len and
// the header checksum are those of the same header without layer sums,
// and the used part alone (all an older reader checks) decodes to the
// same fields.
func TestLayerSumsInvisibleToOldReaders(t *testing.T) {
	for _, keys := range []int{1, 7, 56} {
		t.Run(fmt.Sprintf("keys=%d", keys), func(t *testing.T) {
			with, without := withLayerSums(keys, OrderLayerMajor), sample(keys, OrderLayerMajor)
			bw, bo := make([]byte, with.Len()), make([]byte, without.Len())
			if err := with.Encode(bw); err != nil {
				t.Fatal(err)
			}
			if err := without.Encode(bo); err != nil {
				t.Fatal(err)
			}
			if len(bw) != len(bo) || !bytes.Equal(bw[:with.UsedLen()], bo[:without.UsedLen()]) {
				t.Fatalf("header areas %d and %d bytes, used parts equal %v", len(bw), len(bo), bytes.Equal(bw[:with.UsedLen()], bo[:without.UsedLen()]))
			}
			if bytes.Equal(bw, bo) {
				t.Fatal("the header areas are equal: no layer sums block written")
			}
			// The pre-change rules: header_len = roundup(used_len), the
			// checksum over [0, used_len).
			le := binary.LittleEndian
			used, n := int(le.Uint32(bw[16:])), int(le.Uint32(bw[12:]))
			if used != FixedLen+KeyEntryLen*keys || n != alignUp(used, Align) {
				t.Fatalf("used_len %d, header_len %d", used, n)
			}
			c := slices.Clone(bw[:used])
			le.PutUint32(c[20:], 0)
			if crc32c.Checksum(c) != le.Uint32(bw[20:]) {
				t.Fatal("header checksum does not cover [0, used_len) alone")
			}
			old, err := Decode(bw[:used])
			if err != nil {
				t.Fatal(err)
			}
			if old.LayerSums != nil {
				t.Fatalf("the used part alone has layer sums %v", old.LayerSums)
			}
			full, err := Decode(bw)
			if err != nil {
				t.Fatal(err)
			}
			full.LayerSums = nil
			if fmt.Sprint(*old) != fmt.Sprint(*full) {
				t.Fatalf("fields differ:\n%v\n%v", *old, *full)
			}
		})
	}
}

// TestLayerSumsCorruptTable: a layer sums block whose checksum, entry
// count, header checksum copy or flags do not agree is ErrCorrupt, and
// the error says it is the layer sums'; a block cut short of the bytes
// given is a *TruncatedError needing its end.
func TestLayerSumsCorruptTable(t *testing.T) {
	h := withLayerSums(2, OrderLayerMajor)
	u := h.UsedLen()
	le := binary.LittleEndian
	for _, tc := range []struct {
		name string
		mut  func(b []byte)
	}{
		{"flipped entry", func(b []byte) { b[u+LayerSumsFixedLen+5] ^= 0x10 }},
		{"flipped table checksum", func(b []byte) { b[u+12] ^= 1 }},
		{"count of another geometry", func(b []byte) { le.PutUint32(b[u+8:], 5) }},
		{"huge count", func(b []byte) { le.PutUint32(b[u+8:], 1<<30) }},
		{"table of another header", func(b []byte) { le.PutUint32(b[u+16:], le.Uint32(b[u+16:])+1) }},
		{"table without payload sums", func(b []byte) {
			le.PutUint16(b[10:], 0)
			seal(b)
			// The table names the resealed header's checksum, and its
			// own checksum is right: only the flags are wrong.
			le.PutUint32(b[u+16:], le.Uint32(b[20:]))
			t := b[u : u+h.LayerSumsLen()]
			le.PutUint32(t[12:], 0)
			le.PutUint32(t[12:], crc32c.Checksum(t))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := make([]byte, h.Len())
			if err := h.Encode(b); err != nil {
				t.Fatal(err)
			}
			tc.mut(b)
			got, err := Decode(b)
			if !errors.Is(err, ErrCorrupt) || got != nil || !bytes.Contains([]byte(err.Error()), []byte("layer sums")) {
				t.Fatalf("Decode: %v, %v: want ErrCorrupt naming the layer sums", got, err)
			}
		})
	}
	b := make([]byte, h.Len())
	if err := h.Encode(b); err != nil {
		t.Fatal(err)
	}
	var tr *TruncatedError
	if _, err := Decode(b[:u+LayerSumsFixedLen+3]); !errors.As(err, &tr) || tr.Need != u+h.LayerSumsLen() {
		t.Fatalf("Decode of a cut table: %v, want a *TruncatedError needing %d", err, u+h.LayerSumsLen())
	}
}

// TestLayerSumsValidate: Encode refuses layer sums of the wrong length or
// without payload sums.
func TestLayerSumsValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		mut  func(h *Header)
	}{
		{"one short", func(h *Header) { h.LayerSums = h.LayerSums[1:] }},
		{"no payload sums", func(h *Header) { h.Flags = 0 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := withLayerSums(2, OrderLayerMajor)
			tc.mut(h)
			if err := h.Encode(make([]byte, h.Len())); !errors.Is(err, ErrCorrupt) {
				t.Fatalf("Encode: %v, want ErrCorrupt", err)
			}
		})
	}
}
