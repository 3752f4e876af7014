package format

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/internal/crc32c"
)

func sample(nkeys int, order uint32) *Header {
	h := &Header{
		Flags: FlagPayloadSums, Fingerprint: 0x1122334455667788, Order: order,
		Layers: 3, Planes: 2, BlocksPerKey: 4, BlockBytes: 512, Created: 1700000000,
		ID: 0x0123456789abcdef,
	}
	for i := range nkeys {
		h.Keys = append(h.Keys, Key{Key: fmt.Appendf(nil, "key-%03d", i), Sum: uint32(i * 7)})
	}
	return h
}

func TestRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		keys    int
		order   uint32
		hdrLen  int
		fileLen int64
	}{
		{1, OrderLayerMajor, 4096, 4096 + 12288},
		{3, OrderBlockMajor, 4096, 4096 + 36864},
		{56, OrderLayerMajor, 8192, 8192 + 56*12288},
		{MaxKeys, OrderBlockMajor, 20480, 20480 + MaxKeys*12288},
	} {
		t.Run(fmt.Sprintf("keys=%d/order=%d", tc.keys, tc.order), func(t *testing.T) {
			h := sample(tc.keys, tc.order)
			if h.Len() != tc.hdrLen || h.FileLen() != tc.fileLen {
				t.Fatalf("Len %d FileLen %d, want %d %d", h.Len(), h.FileLen(), tc.hdrLen, tc.fileLen)
			}
			b := make([]byte, h.Len())
			if err := h.Encode(b); err != nil {
				t.Fatal(err)
			}
			n, err := Peek(b)
			if err != nil || n != tc.hdrLen {
				t.Fatalf("Peek: %d %v", n, err)
			}
			got, err := Decode(b)
			if err != nil {
				t.Fatal(err)
			}
			if got.Fingerprint != h.Fingerprint || got.Order != h.Order || got.Flags != h.Flags ||
				got.Layers != h.Layers || got.Planes != h.Planes || got.BlocksPerKey != h.BlocksPerKey ||
				got.BlockBytes != h.BlockBytes || got.Created != h.Created || got.ID != h.ID || len(got.Keys) != len(h.Keys) {
				t.Fatalf("decoded %+v, want %+v", got, h)
			}
			for i := range h.Keys {
				if !bytes.Equal(got.Keys[i].Key, h.Keys[i].Key) || got.Keys[i].Sum != h.Keys[i].Sum {
					t.Fatalf("key %d: %v, want %v", i, got.Keys[i], h.Keys[i])
				}
			}
			last := h.Keys[len(h.Keys)-1].Key
			if i, err := got.Match(h.Fingerprint, last); err != nil || i != len(h.Keys)-1 {
				t.Fatalf("Match: %d %v", i, err)
			}
			if _, err := got.Match(h.Fingerprint+1, last); !errors.Is(err, ErrFingerprint) {
				t.Fatalf("Match other fingerprint: %v", err)
			}
			if _, err := got.Match(h.Fingerprint, []byte("nope")); !errors.Is(err, ErrKey) {
				t.Fatalf("Match other key: %v", err)
			}
			var tr *TruncatedError
			if _, err := Decode(b[:h.UsedLen()-1]); !errors.As(err, &tr) || tr.Need != h.UsedLen() {
				t.Fatalf("Decode short: %v", err)
			}
		})
	}
}

// TestWalk checks that Walk visits every block segment exactly once, in
// increasing, contiguous payload order, and that Offset agrees.
func TestWalk(t *testing.T) {
	for _, order := range []uint32{OrderLayerMajor, OrderBlockMajor} {
		h := sample(3, order)
		var next int64
		seen := map[int64]bool{}
		h.Walk(nil, func(k, b, l, p int, off int64) {
			if off != next || seen[off] || off != h.Offset(k, b, l, p) {
				t.Fatalf("order %d: (%d,%d,%d,%d) at %d, want %d", order, k, b, l, p, off, next)
			}
			seen[off] = true
			next += int64(h.BlockBytes)
		})
		if next != h.PayloadLen() {
			t.Fatalf("order %d: walked %d of %d bytes", order, next, h.PayloadLen())
		}
		n := 0
		h.Walk([]bool{false, true, false}, func(k, _, _, _ int, _ int64) {
			if k != 1 {
				t.Fatalf("walked key %d", k)
			}
			n++
		})
		if n != int(h.Layers*h.Planes*h.BlocksPerKey) {
			t.Fatalf("walked %d segments of key 1", n)
		}
	}
}

func TestDecodeErrors(t *testing.T) {
	good := make([]byte, 4096)
	if err := sample(2, OrderLayerMajor).Encode(good); err != nil {
		t.Fatal(err)
	}
	mut := func(f func(b []byte)) []byte {
		b := bytes.Clone(good)
		f(b)
		return b
	}
	le := binary.LittleEndian
	for _, tc := range []struct {
		name string
		b    []byte
		want error
	}{
		{"magic", mut(func(b []byte) { b[0] = 'X' }), ErrBadMagic},
		{"version", mut(func(b []byte) { le.PutUint16(b[8:], 2) }), ErrVersion},
		{"header length", mut(func(b []byte) { le.PutUint32(b[12:], 100) }), ErrCorrupt},
		{"checksum", mut(func(b []byte) { b[24] ^= 1 }), ErrCorrupt},
		{"key byte", mut(func(b []byte) { b[FixedLen+8] ^= 1 }), ErrCorrupt},
		{"key count", mut(func(b []byte) { le.PutUint32(b[48:], 0) }), ErrCorrupt},
		{"short", good[:50], ErrTruncated},
		{"empty", nil, ErrTruncated},
	} {
		if _, err := Decode(tc.b); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
	// Bytes after the used part are not covered: changing the padding is
	// harmless, as docs/format.md says.
	if _, err := Decode(mut(func(b []byte) { b[4000] = 1 })); err != nil {
		t.Errorf("padding change: %v", err)
	}
}

func FuzzDecodeHeader(f *testing.F) {
	for _, n := range []int{1, 2, 7} {
		for _, order := range []uint32{OrderLayerMajor, OrderBlockMajor} {
			h := sample(n, order)
			b := make([]byte, h.Len())
			if err := h.Encode(b); err != nil {
				f.Fatal(err)
			}
			f.Add(b[:h.UsedLen()])
		}
	}
	h := withLayerSums(2, OrderLayerMajor)
	b := make([]byte, h.Len())
	if err := h.Encode(b); err != nil {
		f.Fatal(err)
	}
	f.Add(b[:h.UsedLen()+h.LayerSumsLen()])
	f.Add([]byte(Magic))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := Decode(b)
		if err != nil {
			if h != nil {
				t.Fatal("header with an error")
			}
			return
		}
		// Whatever decodes must re-encode and decode to the same header.
		checkReencodes(t, h)
	})
}

// checkReencodes fails t unless h encodes to bytes that decode to the
// same header.
func checkReencodes(t *testing.T, h *Header) {
	t.Helper()
	out := make([]byte, h.Len())
	if err := h.Encode(out); err != nil {
		t.Fatalf("re-encode: %v", err)
	}
	h2, err := Decode(out)
	if err != nil {
		t.Fatalf("decode re-encoded: %v", err)
	}
	if fmt.Sprint(*h2) != fmt.Sprint(*h) {
		t.Fatalf("re-encoded header differs:\n%v\n%v", *h2, *h)
	}
}

// FuzzDecodeSealedHeader fuzzes the fields behind the header checksum:
// the fuzzer's bytes get the magic, the version and a header checksum
// recomputed over their used part (as far as they reach), so that Decode's
// field checks, not its checksum, judge them (FuzzDecodeHeader's inputs
// almost never pass the checksum). fix makes some fields agree as a
// writer would have written them, so that the checks after them are
// reached too: bit 0 sets used_len and header_len from the key count
// (zeros extend the bytes to the used length), bit 1 sets key_bytes and
// payload_len to the products of the geometry fields, wrapping as a
// writer's unchecked arithmetic would. A header that decodes must be one
// Validate accepts, whose lengths agree with the bytes, whose last
// segment ends at its payload's end, whose keys are found at their own
// index (no key repeats), and which re-encodes to the same header.
func FuzzDecodeSealedHeader(f *testing.F) {
	for _, n := range []int{1, 2, 7, 56} {
		for _, order := range []uint32{OrderLayerMajor, OrderBlockMajor} {
			h := sample(n, order)
			b := make([]byte, h.Len())
			if err := h.Encode(b); err != nil {
				f.Fatal(err)
			}
			f.Add(b[:h.UsedLen()], uint8(0))
			f.Add(b[:FixedLen], uint8(3))
		}
	}
	// Two keys, the second a copy of the first.
	h := sample(2, OrderLayerMajor)
	b := make([]byte, h.Len())
	if err := h.Encode(b); err != nil {
		f.Fatal(err)
	}
	copy(b[FixedLen+KeyEntryLen:], b[FixedLen:FixedLen+KeyEntryLen])
	f.Add(b[:h.UsedLen()], uint8(0))
	f.Add(make([]byte, FixedLen), uint8(0))
	f.Fuzz(func(t *testing.T, b []byte, fix uint8) {
		le := binary.LittleEndian
		if fix&1 != 0 && len(b) >= FixedLen {
			if n := int(le.Uint32(b[48:])); n >= 1 && n <= MaxKeys {
				used := FixedLen + KeyEntryLen*n
				le.PutUint32(b[16:], uint32(used))
				le.PutUint32(b[12:], uint32(alignUp(used, Align)))
				if len(b) < used {
					b = append(b, make([]byte, used-len(b))...)
				}
			}
		}
		if fix&2 != 0 && len(b) >= FixedLen {
			kb := uint64(le.Uint32(b[56:])) * uint64(le.Uint32(b[60:])) * uint64(le.Uint32(b[64:])) * le.Uint64(b[72:])
			le.PutUint64(b[40:], kb)
			le.PutUint64(b[32:], kb*uint64(le.Uint32(b[48:])))
		}
		if len(b) >= 24 {
			copy(b, Magic)
			le.PutUint16(b[8:], Version)
			seal(b)
		}
		h, err := Decode(b)
		if err != nil {
			if h != nil {
				t.Fatal("header with an error")
			}
			if !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrTruncated) {
				t.Fatalf("error %v: want ErrCorrupt or ErrTruncated", err)
			}
			return
		}
		if err := h.Validate(); err != nil {
			t.Fatalf("decoded a header Validate refuses: %v", err)
		}
		if h.Len() != int(le.Uint32(b[12:])) || h.UsedLen() != int(le.Uint32(b[16:])) || h.PayloadLen() != int64(le.Uint64(b[32:])) || h.KeyBytes() != int64(le.Uint64(b[40:])) {
			t.Fatalf("lengths %d, %d, %d, %d: the bytes say %d, %d, %d, %d", h.Len(), h.UsedLen(), h.PayloadLen(), h.KeyBytes(),
				le.Uint32(b[12:]), le.Uint32(b[16:]), le.Uint64(b[32:]), le.Uint64(b[40:]))
		}
		K, B, L, P := len(h.Keys), int(h.BlocksPerKey), int(h.Layers), int(h.Planes)
		if end := h.Offset(K-1, B-1, L-1, P-1) + int64(h.BlockBytes); end != h.PayloadLen() {
			t.Fatalf("order %d: the last segment ends at %d of a %d-byte payload", h.Order, end, h.PayloadLen())
		}
		if h.FileLen() < int64(h.Len())+h.PayloadLen() {
			t.Fatalf("file length %d: less than header %d plus payload %d", h.FileLen(), h.Len(), h.PayloadLen())
		}
		for i, k := range h.Keys {
			if j, err := h.Match(h.Fingerprint, k.Key); err != nil || j != i {
				t.Fatalf("key %d (%x) matches at %d, %v", i, k.Key, j, err)
			}
		}
		checkReencodes(t, h)
	})
}

// TestFileIDField: the file id lives in bytes [88, 96), which version-1
// files written before it existed kept zero: such a file decodes with ID 0,
// and a file with an id decodes the same for every other field (old readers
// ignore the bytes).
func TestFileIDField(t *testing.T) {
	h := sample(2, OrderLayerMajor)
	b := make([]byte, h.Len())
	if err := h.Encode(b); err != nil {
		t.Fatal(err)
	}
	if got := binary.LittleEndian.Uint64(b[88:]); got != h.ID {
		t.Fatalf("bytes [88, 96) = %#x, want the id %#x", got, h.ID)
	}
	old := *h
	old.ID = 0 // as the writer before the id wrote it
	ob := make([]byte, old.Len())
	if err := old.Encode(ob); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(ob[88:96], make([]byte, 8)) {
		t.Fatalf("an id-less header has %x at [88, 96), want zeros", ob[88:96])
	}
	got, err := Decode(ob)
	if err != nil {
		t.Fatalf("an old file does not decode: %v", err)
	}
	if got.ID != 0 || got.Fingerprint != h.Fingerprint || len(got.Keys) != 2 {
		t.Fatalf("old file decoded as %+v", got)
	}
	// Only the id and the header checksum differ between the two.
	for i := range b {
		if b[i] != ob[i] && (i < 88 || i >= 96) && (i < 20 || i >= 24) {
			t.Fatalf("byte %d differs between the headers with and without an id", i)
		}
	}
}

func TestRawHeaderHasNoHeaderArea(t *testing.T) {
	h := &Header{Raw: true, Fingerprint: 1, Layers: 1, Planes: 1, BlocksPerKey: 1, BlockBytes: 5000, Keys: []Key{{Key: []byte("k")}}}
	if h.Len() != 0 || h.FileLen() != 8192 || h.Offset(0, 0, 0, 0) != 0 {
		t.Fatalf("raw: Len %d, FileLen %d, payload at %d: want 0, 8192, 0", h.Len(), h.FileLen(), h.Offset(0, 0, 0, 0))
	}
	if err := h.Encode(make([]byte, 4096)); !errors.Is(err, ErrRaw) {
		t.Fatalf("Encode of a raw header: %v, want ErrRaw", err)
	}
}

// TestAGeometryWhoseKeyBytesOverflowIsCorrupt: layers × planes × blocks
// per key × block bytes, each within its bound, can pass 2^63; a header
// whose product wrapped to a small number (and whose key_bytes and
// payload_len say that number, under a good checksum) describes a payload
// of another size than the one its lengths say, and is corrupt.
func TestAGeometryWhoseKeyBytesOverflowIsCorrupt(t *testing.T) {
	le := binary.LittleEndian
	for _, tc := range []struct {
		name                   string
		layers, planes, blocks uint32
		blockBytes             uint64
	}{
		{"wraps to 4 GiB", 1 << 16, 1, 1 << 16, 1<<32 + 1},
		{"wraps to 8 GiB", 1 << 16, 2, 1 << 16, 1<<31 + 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := sample(1, OrderLayerMajor)
			h.Layers, h.Planes, h.BlocksPerKey, h.BlockBytes = tc.layers, tc.planes, tc.blocks, tc.blockBytes
			if err := h.Validate(); !errors.Is(err, ErrCorrupt) {
				t.Errorf("Validate: %v (key bytes %d), want ErrCorrupt", err, h.KeyBytes())
			}
			// The same header as a writer with the product wrapped would
			// have encoded it.
			b := make([]byte, 4096)
			if err := sample(1, OrderLayerMajor).Encode(b); err != nil {
				t.Fatal(err)
			}
			le.PutUint32(b[56:], tc.layers)
			le.PutUint32(b[60:], tc.planes)
			le.PutUint32(b[64:], tc.blocks)
			le.PutUint64(b[72:], tc.blockBytes)
			le.PutUint64(b[32:], uint64(h.PayloadLen()))
			le.PutUint64(b[40:], uint64(h.KeyBytes()))
			le.PutUint32(b[20:], 0)
			le.PutUint32(b[20:], crc32c.Checksum(b[:h.UsedLen()]))
			if _, err := Decode(b); !errors.Is(err, ErrCorrupt) {
				t.Fatalf("Decode: %v (key bytes %d), want ErrCorrupt", err, h.KeyBytes())
			}
		})
	}
}

// seal sets the header checksum of the header in b over its used bytes
// (as read from b), as a writer would have.
func seal(b []byte) {
	le := binary.LittleEndian
	used := min(int(le.Uint32(b[16:])), len(b))
	le.PutUint32(b[20:], 0)
	le.PutUint32(b[20:], crc32c.Checksum(b[:used]))
}

// TestRepeatedKeysAreCorrupt: the keys of one file are distinct
// (docs/format.md). A header whose keys repeat, under a good checksum, is
// corrupt, and the error names the repeated key's index and the one it
// repeats; Encode refuses to write one.
func TestRepeatedKeysAreCorrupt(t *testing.T) {
	for _, tc := range []struct {
		name     string
		keys     int
		dup, of  int
		wantText string
	}{
		{"the second repeats the first", 2, 1, 0, "key 1 repeats key 0"},
		{"the last repeats one in the middle", 7, 6, 3, "key 6 repeats key 3"},
		{"of the most keys", MaxKeys, MaxKeys - 1, 0, fmt.Sprintf("key %d repeats key 0", MaxKeys-1)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := sample(tc.keys, OrderBlockMajor)
			b := make([]byte, h.Len())
			if err := h.Encode(b); err != nil {
				t.Fatal(err)
			}
			// The same header as a writer that repeated the key would
			// have encoded it.
			copy(b[FixedLen+tc.dup*KeyEntryLen:][:KeyEntryLen], b[FixedLen+tc.of*KeyEntryLen:][:KeyEntryLen])
			seal(b)
			if _, err := Decode(b); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), tc.wantText) {
				t.Errorf("Decode: %v, want ErrCorrupt saying %q", err, tc.wantText)
			}
			h.Keys[tc.dup] = h.Keys[tc.of]
			if err := h.Encode(make([]byte, h.Len())); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), tc.wantText) {
				t.Errorf("Encode: %v, want ErrCorrupt saying %q", err, tc.wantText)
			}
		})
	}
	// Keys that differ only by length (a trailing zero byte) are distinct.
	h := sample(2, OrderLayerMajor)
	h.Keys[0].Key, h.Keys[1].Key = []byte("k"), []byte("k\x00")
	b := make([]byte, h.Len())
	if err := h.Encode(b); err != nil {
		t.Fatalf("Encode of keys %q and %q: %v", h.Keys[0].Key, h.Keys[1].Key, err)
	}
	if _, err := Decode(b); err != nil {
		t.Fatalf("Decode of keys %q and %q: %v", h.Keys[0].Key, h.Keys[1].Key, err)
	}
}
