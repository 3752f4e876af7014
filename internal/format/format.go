// Package format encodes and decodes kvhost chunk files: a self-describing
// header (magic, version, geometry fingerprint, keys, chunk layout, lengths,
// checksums) followed by the payload at a 4 KiB-aligned offset.
// docs/format.md is the normative description; this package implements it.
package format

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/kvhost/kvhost/internal/crc32c"
)

// Errors of Decode and Match. Returned errors wrap them.
var (
	// ErrBadMagic: the file does not start with Magic.
	ErrBadMagic = errors.New("format: bad magic")
	// ErrVersion: the format version is not one this package reads.
	ErrVersion = errors.New("format: unsupported version")
	// ErrCorrupt: the header is inconsistent or fails its checksum, or the
	// payload fails its checksum.
	ErrCorrupt = errors.New("format: corrupt")
	// ErrRaw: a raw (headerless) file's Header cannot be encoded.
	ErrRaw = errors.New("format: a raw file has no header")
	// ErrTruncated: fewer bytes than the header needs were given; a
	// *TruncatedError says how many.
	ErrTruncated = errors.New("format: truncated header")
	// ErrFingerprint: the file belongs to another geometry.
	ErrFingerprint = errors.New("format: geometry fingerprint mismatch")
	// ErrKey: the file does not hold the key.
	ErrKey = errors.New("format: key not in file")
)

// Constants of format version 1.
const (
	// Magic starts every file.
	Magic = "KVHOSTF\n"
	// Version is the format version this package writes.
	Version = 1
	// Align is the alignment of the payload offset and of the file length:
	// what O_DIRECT and cuFile need on every file system kvhost supports.
	Align = 4096
	// FixedLen is the size of the fixed part of the header.
	FixedLen = 96
	// KeyEntryLen is the size of one key entry after the fixed part.
	KeyEntryLen = 72
	// MaxKeyLen is the longest key.
	MaxKeyLen = 64
	// MaxKeys is the most keys one file holds.
	MaxKeys = 256
	// MaxHeaderLen bounds the header area.
	MaxHeaderLen = 1 << 20
	// LayerSumsMagic starts the layer sums block, in the header area's
	// padding right after the used part.
	LayerSumsMagic = "KVLSUMS1"
	// LayerSumsFixedLen is the size of the layer sums block before its
	// entries: magic, entry count, table checksum, header checksum,
	// reserved.
	LayerSumsFixedLen = 24
)

// Orders of the payload (Header.Order), the same values as abi.Order*.
const (
	// OrderLayerMajor: for each layer, plane, key, block.
	OrderLayerMajor uint32 = 0
	// OrderBlockMajor: for each key, block, layer, plane.
	OrderBlockMajor uint32 = 1
)

// Flags of a header.
type Flags uint16

// Header flags.
const (
	// FlagPayloadSums: every key entry's Sum is the CRC-32C of that key's
	// payload bytes in file order. Without it the sums are zero and unchecked.
	FlagPayloadSums Flags = 1 << 0

	knownFlags = FlagPayloadSums
)

// Key is one key stored in a file and the checksum of its payload bytes.
type Key struct {
	Key []byte // the key, 1..MaxKeyLen bytes
	Sum uint32 // CRC-32C of the key's payload bytes with FlagPayloadSums, else 0
}

// Header describes one file.
type Header struct {
	Flags        Flags  // FlagPayloadSums or none
	Fingerprint  uint64 // geometry fingerprint of the namespace
	Order        uint32 // OrderLayerMajor or OrderBlockMajor
	Layers       uint32 // layers of the geometry
	Planes       uint32 // 2 (K, V) or 1 (MLA)
	BlocksPerKey uint32 // GPU blocks one key covers
	BlockBytes   uint64 // one plane of one layer of one block
	Created      int64  // Unix nanoseconds; informational
	// ID identifies the file: a random non-zero number the writer draws for
	// every file it publishes, so that a file is never taken for another
	// that reused its inode number. 0 in files written before it existed
	// (the field was reserved and zero); readers accept both.
	ID   uint64
	Keys []Key // 1..MaxKeys
	// LayerSums, when not nil, holds len(Keys)·Layers checksums: entry
	// k·Layers+l is the CRC-32C of key k's segments of layer l (both
	// planes, every block of the key) in increasing payload offset. They
	// live in the header area's padding (docs/format.md, "Layer sums"),
	// outside the used part and its checksum: Encode writes them only
	// where they fit (LayerSumsFit), Decode returns them where the file
	// has them. Only with FlagPayloadSums.
	LayerSums []uint32
	// Raw describes a file without a header: a row of vLLM's fs-tier
	// layout (package internal/vllmfs), whose payload starts at offset 0.
	// Its fields come from the reader's namespace and the file's name,
	// never from the file; Len is 0 and Encode refuses it.
	Raw bool
}

// KeyBytes is the payload size of one key.
func (h *Header) KeyBytes() int64 {
	return int64(h.Layers) * int64(h.Planes) * int64(h.BlocksPerKey) * int64(h.BlockBytes)
}

// LayerBytes is the payload size of one layer of one key: both planes,
// every block.
func (h *Header) LayerBytes() int64 {
	return int64(h.Planes) * int64(h.BlocksPerKey) * int64(h.BlockBytes)
}

// LayerSumsLen is the size of the layer sums block of h's keys and layers.
func (h *Header) LayerSumsLen() int {
	return LayerSumsFixedLen + 4*len(h.Keys)*int(h.Layers)
}

// LayerSumsFit reports whether the layer sums block fits in the header
// area's padding: the header area is never enlarged for it.
func (h *Header) LayerSumsFit() bool {
	return !h.Raw && h.UsedLen()+h.LayerSumsLen() <= h.Len()
}

// LayerSum returns the checksum of layer l of key k (LayerSums).
func (h *Header) LayerSum(k, l int) uint32 { return h.LayerSums[k*int(h.Layers)+l] }

// PayloadLen is the payload size: every key.
func (h *Header) PayloadLen() int64 { return int64(len(h.Keys)) * h.KeyBytes() }

// UsedLen is the number of header bytes covered by the header checksum.
func (h *Header) UsedLen() int { return FixedLen + KeyEntryLen*len(h.Keys) }

// Len is the header area: UsedLen rounded up to Align (0 for a Raw file).
// The payload starts here.
func (h *Header) Len() int {
	if h.Raw {
		return 0
	}
	return alignUp(h.UsedLen(), Align)
}

// FileLen is the file's length: the header area plus the payload rounded up
// to Align.
func (h *Header) FileLen() int64 { return int64(h.Len()) + int64(alignUp64(h.PayloadLen(), Align)) }

// Validate checks the header's fields (not its checksums), the keys'
// lengths and that no key repeats.
func (h *Header) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrCorrupt}, args...)...)
	}
	switch {
	case h.Flags&^knownFlags != 0:
		return bad("unknown flags 0x%x", uint16(h.Flags&^knownFlags))
	case h.Order != OrderLayerMajor && h.Order != OrderBlockMajor:
		return bad("order %d", h.Order)
	case h.Planes != 1 && h.Planes != 2:
		return bad("planes %d", h.Planes)
	case h.Layers == 0 || h.BlocksPerKey == 0 || h.BlockBytes == 0:
		return bad("empty geometry: layers %d, blocks per key %d, block bytes %d", h.Layers, h.BlocksPerKey, h.BlockBytes)
	case h.Layers > 1<<16 || h.BlocksPerKey > 1<<16 || h.BlockBytes > 1<<40:
		return bad("geometry too large: layers %d, blocks per key %d, block bytes %d", h.Layers, h.BlocksPerKey, h.BlockBytes)
	case len(h.Keys) == 0 || len(h.Keys) > MaxKeys:
		return bad("%d keys: want 1..%d", len(h.Keys), MaxKeys)
	}
	// Segments per key are at most 2^33 (the bounds above); their product
	// with the block bytes is bounded by division, as it could pass 2^63
	// and wrap to a size in range.
	segs := int64(h.Layers) * int64(h.Planes) * int64(h.BlocksPerKey)
	if int64(h.BlockBytes) > (1<<40)/segs || int64(len(h.Keys))*h.KeyBytes() > 1<<48 {
		return bad("key bytes out of range: %d segments of %d bytes", segs, h.BlockBytes)
	}
	for i, k := range h.Keys {
		if len(k.Key) == 0 || len(k.Key) > MaxKeyLen {
			return bad("key %d: length %d: want 1..%d", i, len(k.Key), MaxKeyLen)
		}
	}
	if h.LayerSums != nil {
		if h.Flags&FlagPayloadSums == 0 {
			return bad("layer sums without payload sums")
		}
		if len(h.LayerSums) != len(h.Keys)*int(h.Layers) {
			return bad("%d layer sums for %d keys of %d layers", len(h.LayerSums), len(h.Keys), h.Layers)
		}
	}
	// The keys of one file are distinct: a repeated key would be indexed
	// twice and a load would find its first copy only.
	if len(h.Keys) > 1 {
		seen := make(map[string]int, len(h.Keys))
		for i, k := range h.Keys {
			if j, ok := seen[string(k.Key)]; ok {
				return bad("key %d repeats key %d (%x)", i, j, k.Key)
			}
			seen[string(k.Key)] = i
		}
	}
	return nil
}

// Encode writes the header area (Len bytes: the header, then zeros) into b,
// which must be at least Len bytes long. With LayerSums, their block
// follows the used part where it fits (LayerSumsFit); where it does not,
// it is left out and the file is valid without it.
func (h *Header) Encode(b []byte) error {
	if h.Raw {
		return ErrRaw
	}
	if err := h.Validate(); err != nil {
		return err
	}
	n := h.Len()
	if len(b) < n {
		return fmt.Errorf("format: encode into %d bytes: need %d", len(b), n)
	}
	b = b[:n]
	clear(b)
	le := binary.LittleEndian
	copy(b[0:8], Magic)
	le.PutUint16(b[8:], Version)
	le.PutUint16(b[10:], uint16(h.Flags))
	le.PutUint32(b[12:], uint32(n))
	le.PutUint32(b[16:], uint32(h.UsedLen()))
	// b[20:24] header checksum, filled last
	le.PutUint64(b[24:], h.Fingerprint)
	le.PutUint64(b[32:], uint64(h.PayloadLen()))
	le.PutUint64(b[40:], uint64(h.KeyBytes()))
	le.PutUint32(b[48:], uint32(len(h.Keys)))
	le.PutUint32(b[52:], h.Order)
	le.PutUint32(b[56:], h.Layers)
	le.PutUint32(b[60:], h.Planes)
	le.PutUint32(b[64:], h.BlocksPerKey)
	// b[68:72] reserved
	le.PutUint64(b[72:], h.BlockBytes)
	le.PutUint64(b[80:], uint64(h.Created))
	le.PutUint64(b[88:], h.ID)
	for i, k := range h.Keys {
		e := b[FixedLen+i*KeyEntryLen:]
		le.PutUint32(e[0:], k.Sum)
		le.PutUint16(e[4:], uint16(len(k.Key)))
		// e[6:8] reserved
		copy(e[8:8+MaxKeyLen], k.Key)
	}
	headerCRC := crc32c.Checksum(b[:h.UsedLen()])
	le.PutUint32(b[20:], headerCRC)
	if h.LayerSums != nil && h.LayerSumsFit() {
		t := b[h.UsedLen() : h.UsedLen()+h.LayerSumsLen()]
		copy(t[0:8], LayerSumsMagic)
		le.PutUint32(t[8:], uint32(len(h.LayerSums)))
		// t[12:16] table checksum, filled last
		le.PutUint32(t[16:], headerCRC)
		// t[20:24] reserved
		for i, s := range h.LayerSums {
			le.PutUint32(t[LayerSumsFixedLen+4*i:], s)
		}
		le.PutUint32(t[12:], crc32c.Checksum(t))
	}
	return nil
}

// TruncatedError says that Decode needs Need bytes.
type TruncatedError struct {
	Have, Need int // bytes given, and bytes needed
}

// Error says how many bytes the header had and needed.
func (e *TruncatedError) Error() string {
	return fmt.Sprintf("format: truncated header: have %d bytes, need %d", e.Have, e.Need)
}

// Unwrap returns ErrTruncated.
func (e *TruncatedError) Unwrap() error { return ErrTruncated }

// Peek reads the header area length from the first FixedLen bytes of a file,
// checking the magic and version, so a reader knows how much to read.
func Peek(b []byte) (int, error) {
	if len(b) < FixedLen {
		return 0, &TruncatedError{Have: len(b), Need: FixedLen}
	}
	if string(b[:8]) != Magic {
		return 0, fmt.Errorf("%w: %q", ErrBadMagic, b[:8])
	}
	if v := binary.LittleEndian.Uint16(b[8:]); v != Version {
		return 0, fmt.Errorf("%w: %d (this build reads %d)", ErrVersion, v, Version)
	}
	n := int(binary.LittleEndian.Uint32(b[12:]))
	if n < Align || n > MaxHeaderLen || n%Align != 0 {
		return 0, fmt.Errorf("%w: header length %d", ErrCorrupt, n)
	}
	return n, nil
}

// Decode parses and verifies the header at the start of b. b must hold at
// least the used part of the header; a shorter b yields a *TruncatedError.
// The returned keys alias b. The layer sums block, in the padding after
// the used part, is read where b holds its start (its magic): give Decode
// the whole header area (Len bytes) to have them; a b that holds the
// magic and not the whole block yields a *TruncatedError. A block that
// fails its checks is ErrCorrupt; no magic there means no layer sums.
func Decode(b []byte) (*Header, error) {
	n, err := Peek(b)
	if err != nil {
		return nil, err
	}
	le := binary.LittleEndian
	used := int(le.Uint32(b[16:]))
	nkeys := int(le.Uint32(b[48:]))
	if nkeys < 1 || nkeys > MaxKeys || used != FixedLen+KeyEntryLen*nkeys || used > n {
		return nil, fmt.Errorf("%w: %d keys in %d header bytes of %d", ErrCorrupt, nkeys, used, n)
	}
	if len(b) < used {
		return nil, &TruncatedError{Have: len(b), Need: used}
	}
	want := le.Uint32(b[20:])
	crc := crc32c.Update(0, b[:20])
	crc = crc32c.Update(crc, []byte{0, 0, 0, 0})
	crc = crc32c.Update(crc, b[24:used])
	if crc != want {
		return nil, fmt.Errorf("%w: header checksum 0x%08x, want 0x%08x", ErrCorrupt, crc, want)
	}
	h := &Header{
		Flags:        Flags(le.Uint16(b[10:])),
		Fingerprint:  le.Uint64(b[24:]),
		Order:        le.Uint32(b[52:]),
		Layers:       le.Uint32(b[56:]),
		Planes:       le.Uint32(b[60:]),
		BlocksPerKey: le.Uint32(b[64:]),
		BlockBytes:   le.Uint64(b[72:]),
		Created:      int64(le.Uint64(b[80:])),
		ID:           le.Uint64(b[88:]),
		Keys:         make([]Key, nkeys),
	}
	for i := range h.Keys {
		e := b[FixedLen+i*KeyEntryLen:]
		kl := int(le.Uint16(e[4:]))
		if kl == 0 || kl > MaxKeyLen {
			return nil, fmt.Errorf("%w: key %d: length %d", ErrCorrupt, i, kl)
		}
		h.Keys[i] = Key{Key: e[8 : 8+kl : 8+kl], Sum: le.Uint32(e[0:])}
	}
	if err := h.Validate(); err != nil {
		return nil, err
	}
	if pl := int64(le.Uint64(b[32:])); pl != h.PayloadLen() {
		return nil, fmt.Errorf("%w: payload length %d, geometry says %d", ErrCorrupt, pl, h.PayloadLen())
	}
	if kb := int64(le.Uint64(b[40:])); kb != h.KeyBytes() {
		return nil, fmt.Errorf("%w: key bytes %d, geometry says %d", ErrCorrupt, kb, h.KeyBytes())
	}
	if h.Len() != n {
		return nil, fmt.Errorf("%w: header length %d, keys need %d", ErrCorrupt, n, h.Len())
	}
	if err := h.decodeLayerSums(b, want); err != nil {
		return nil, err
	}
	return h, nil
}

// decodeLayerSums sets h.LayerSums from the block after the used part of
// the header area b (whose header checksum is headerCRC), if b holds one.
func (h *Header) decodeLayerSums(b []byte, headerCRC uint32) error {
	used, n := h.UsedLen(), h.Len()
	if n-used < len(LayerSumsMagic) || len(b) < used+len(LayerSumsMagic) || string(b[used:used+len(LayerSumsMagic)]) != LayerSumsMagic {
		return nil // no layer sums
	}
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: layer sums: "+format, append([]any{ErrCorrupt}, args...)...)
	}
	if n-used < LayerSumsFixedLen {
		return bad("%d bytes of padding hold no table", n-used)
	}
	if len(b) < used+LayerSumsFixedLen {
		return &TruncatedError{Have: len(b), Need: used + LayerSumsFixedLen}
	}
	le := binary.LittleEndian
	t := b[used:]
	count := int(le.Uint32(t[8:]))
	if want := len(h.Keys) * int(h.Layers); count != want {
		return bad("%d entries, want %d (%d keys of %d layers)", count, want, len(h.Keys), h.Layers)
	}
	end := used + h.LayerSumsLen()
	if end > n {
		return bad("table of %d bytes past the header area (%d bytes)", h.LayerSumsLen(), n)
	}
	if len(b) < end {
		return &TruncatedError{Have: len(b), Need: end}
	}
	t = t[:h.LayerSumsLen()]
	if hc := le.Uint32(t[16:]); hc != headerCRC {
		return bad("header checksum 0x%08x, the header's is 0x%08x (a table of another header)", hc, headerCRC)
	}
	crc := crc32c.Update(0, t[:12])
	crc = crc32c.Update(crc, []byte{0, 0, 0, 0})
	crc = crc32c.Update(crc, t[16:])
	if wantCRC := le.Uint32(t[12:]); crc != wantCRC {
		return bad("table checksum 0x%08x, want 0x%08x", crc, wantCRC)
	}
	if h.Flags&FlagPayloadSums == 0 {
		return bad("a table in a file without payload sums")
	}
	h.LayerSums = make([]uint32, count)
	for i := range h.LayerSums {
		h.LayerSums[i] = le.Uint32(t[LayerSumsFixedLen+4*i:])
	}
	return nil
}

// Match returns the index of key in the file, or an error wrapping
// ErrFingerprint or ErrKey.
func (h *Header) Match(fingerprint uint64, key []byte) (int, error) {
	if h.Fingerprint != fingerprint {
		return -1, fmt.Errorf("%w: file 0x%016x, want 0x%016x", ErrFingerprint, h.Fingerprint, fingerprint)
	}
	for i, k := range h.Keys {
		if string(k.Key) == string(key) {
			return i, nil
		}
	}
	return -1, fmt.Errorf("%w: %x", ErrKey, key)
}

// Offset returns the payload offset (relative to the payload start) of block
// b of plane p of layer l of key k.
func (h *Header) Offset(k, b, l, p int) int64 {
	K, B, L, P := int64(len(h.Keys)), int64(h.BlocksPerKey), int64(h.Layers), int64(h.Planes)
	var i int64
	if h.Order == OrderBlockMajor {
		i = ((int64(k)*B+int64(b))*L+int64(l))*P + int64(p)
	} else {
		i = ((int64(l)*P+int64(p))*K+int64(k))*B + int64(b)
	}
	return i * int64(h.BlockBytes)
}

// Walk calls fn for every block segment of the keys in want (nil: every key),
// in payload order: key index, block, layer, plane and payload offset.
// Consecutive calls with contiguous offsets are contiguous in the file.
func (h *Header) Walk(want []bool, fn func(k, b, l, p int, off int64)) {
	K, B, L, P := len(h.Keys), int(h.BlocksPerKey), int(h.Layers), int(h.Planes)
	ok := func(k int) bool { return want == nil || want[k] }
	if h.Order == OrderBlockMajor {
		for k := range K {
			if !ok(k) {
				continue
			}
			for b := range B {
				for l := range L {
					for p := range P {
						fn(k, b, l, p, h.Offset(k, b, l, p))
					}
				}
			}
		}
		return
	}
	for l := range L {
		for p := range P {
			for k := range K {
				if !ok(k) {
					continue
				}
				for b := range B {
					fn(k, b, l, p, h.Offset(k, b, l, p))
				}
			}
		}
	}
}

func alignUp(n, a int) int           { return (n + a - 1) / a * a }
func alignUp64(n int64, a int) int64 { return (n + int64(a) - 1) / int64(a) * int64(a) }
