package policykit

import (
	"encoding/binary"
	"strconv"
	"unsafe"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
)

// Names builds file names of the form
//
//	<model>_<fingerprint: 12 hex>_r<rank>/<hh>/.../<key as hex>.kv
//
// the layout of vLLM's FS offload tier and llm-d's fs connector, with depth
// fan-out directories <hh> taken from the key hash, most significant byte
// first. The namespace directory is computed once, when the host declares the
// namespace (kvhost_namespace); building a name then copies bytes into the
// record and allocates nothing.
//
// Every name passes abi.CheckPath for keys of up to abi.MaxKeyLen bytes and
// model ids of up to abi.MaxModelLen bytes: the model id is sanitized to
// [A-Za-z0-9._-] (other bytes become '-', a leading '.' becomes '-') and
// truncated so that the longest key still fits abi.MaxPathLen.
type Names struct {
	depth    int
	modelMax int
	dirs     []nsDir // indexed by namespace id
}

type nsDir struct {
	declared    bool
	fingerprint uint64
	rank        uint32
	dir         []byte
}

// MaxDepth is the most fan-out directory levels Names supports.
const MaxDepth = 4

// MaxNamespaces bounds the namespace ids Names accepts (ids are small and
// dense; the bound keeps a bad record from allocating without limit).
const MaxNamespaces = 1 << 16

// fixed parts of a name: "_" + 12 hex + "_r" + up to 10 digits in the
// namespace directory; "/" + "hh/" per level + key hex + ".kv" after it.
const (
	dirOverhead  = 1 + 12 + 2 + 10
	fileOverhead = 1 + 2*abi.MaxKeyLen + 3
)

// NewNames returns a Names with depth fan-out levels (0..MaxDepth).
func NewNames(depth int) (*Names, error) {
	if depth < 0 || depth > MaxDepth {
		return nil, guest.Unsupported("fan-out depth " + strconv.Itoa(depth) + " is outside 0.." + strconv.Itoa(MaxDepth))
	}
	return &Names{
		depth:    depth,
		modelMax: abi.MaxPathLen - fileOverhead - 3*depth - dirOverhead,
	}, nil
}

// Declare records the namespace directory of r.
func (n *Names) Declare(r *abi.NamespaceRecord) error {
	if r.NS >= MaxNamespaces {
		return guest.InvalidInput("namespace id " + strconv.FormatUint(uint64(r.NS), 10) + " is beyond " + strconv.Itoa(MaxNamespaces-1))
	}
	for uint32(len(n.dirs)) <= r.NS {
		n.dirs = append(n.dirs, nsDir{})
	}
	n.dirs[r.NS] = nsDir{
		declared:    true,
		fingerprint: r.Fingerprint,
		rank:        r.TPRank,
		dir:         NamespaceDir(r.ModelID(), r.Fingerprint, r.TPRank, n.modelMax),
	}
	return nil
}

// NamespaceDir returns "<model>_<fingerprint: 12 hex>_r<rank>" with the model
// id sanitized and cut to modelMax bytes.
func NamespaceDir(model []byte, fingerprint uint64, rank uint32, modelMax int) []byte {
	model = model[:min(len(model), modelMax)]
	if len(model) == 0 {
		model = []byte("model")
	}
	b := make([]byte, 0, len(model)+dirOverhead)
	for i, c := range model {
		if !pathByte(c) || (i == 0 && c == '.') {
			c = '-'
		}
		b = append(b, c)
	}
	b = append(b, '_')
	b = appendHex(b, fingerprint>>16, 12)
	b = append(b, "_r"...)
	return strconv.AppendUint(b, uint64(rank), 10)
}

// PutAll names every record of a kvhost_name batch on one mount, which must
// be below the records' mount count.
func (n *Names) PutAll(recs []abi.NameRecord, mount uint32) error {
	return n.put(recs, mount, true)
}

// PutEach names every record of a batch as Put does, leaving Mount to the
// caller; it stops at the first record that fails.
func (n *Names) PutEach(recs []abi.NameRecord) error {
	return n.put(recs, 0, false)
}

// Put writes the name of r's key into r.PathBuf and sets r.PathLen. It fails
// for an undeclared namespace, a fingerprint or rank that differs from the
// declaration, or a key longer than abi.MaxKeyLen.
func (n *Names) Put(r *abi.NameRecord) error {
	return n.put(unsafe.Slice(r, 1), 0, false)
}

// put is Put of every record of recs in order, and with setMount the
// check of mount against each record's mount count and its Mount set to
// mount. It names a whole batch in one call, with nothing called per
// record: compiled to wasm, each call costs tens of instructions, as much
// as a short name's bytes (issue 94).
func (n *Names) put(recs []abi.NameRecord, mount uint32, setMount bool) error {
	dirs, depth := n.dirs, n.depth
	for i := range recs {
		r := &recs[i]
		if setMount && mount >= max(r.MountCount, 1) {
			return guest.InvalidInput("configured mount " + strconv.FormatUint(uint64(mount), 10) +
				" is not below the record's mount count " + strconv.FormatUint(uint64(r.MountCount), 10))
		}
		if r.NS >= uint32(len(dirs)) || !dirs[r.NS].declared {
			return guest.InvalidInput("namespace " + strconv.FormatUint(uint64(r.NS), 10) + " was not declared with kvhost_namespace")
		}
		d := &dirs[r.NS]
		if d.fingerprint != r.Fingerprint || d.rank != r.TPRank {
			return guest.InvalidInput("name record for namespace " + strconv.FormatUint(uint64(r.NS), 10) + " has a fingerprint or rank other than its declaration")
		}
		if r.KeyLen > abi.MaxKeyLen {
			return guest.InvalidInput("key of " + strconv.FormatUint(uint64(r.KeyLen), 10) + " bytes is longer than " + strconv.Itoa(abi.MaxKeyLen))
		}
		p := r.PathBuf[:]
		o := copy(p, d.dir)
		for k := range depth {
			c := byte(r.KeyHash >> (56 - 8*k))
			p[o], p[o+1], p[o+2] = '/', hexDigits[c>>4], hexDigits[c&15]
			o += 3
		}
		p[o] = '/'
		o++
		key := r.KeyBuf[:r.KeyLen]
		if len(key) == 0 {
			p[o] = '_' // an empty key: a name that does not start with '.'
			o++
		}
		// The key in hex, four bytes a step with 64-bit arithmetic (SWAR)
		// rather than a table lookup per nibble: compiled to wasm, where
		// every slice access is bounds-checked, that is twice as fast.
		w := len(key) &^ 3
		for k := 0; k < w; k += 4 {
			binary.LittleEndian.PutUint64(p[o+2*k:], hex4(binary.LittleEndian.Uint32(key[k:])))
		}
		for k := w; k < len(key); k++ {
			c := key[k]
			p[o+2*k], p[o+2*k+1] = hexDigits[c>>4], hexDigits[c&15]
		}
		o += 2 * len(key)
		p[o], p[o+1], p[o+2] = '.', 'k', 'v'
		r.PathLen = uint32(o + 3)
		if setMount {
			r.Mount = mount
		}
	}
	return nil
}

const hexDigits = "0123456789abcdef"

// hex4 returns the 8 ASCII hex digits of the 4 bytes of x (byte 0 in the low
// bits), in memory order when the result is stored little-endian.
func hex4(x uint32) uint64 {
	v := uint64(x)
	// Spread the bytes into 16-bit lanes, byte k in lane k's low byte.
	v = (v | v<<16) & 0x0000FFFF0000FFFF
	v = (v | v<<8) & 0x00FF00FF00FF00FF
	// In each lane: high nibble in the low byte (it is written first), low
	// nibble in the high byte.
	v = (v>>4)&0x000F000F000F000F | (v&0x000F000F000F000F)<<8
	// '0' + n for n < 10, 'a' + n - 10 = '0' + n + 39 otherwise: n + 6
	// carries into bit 4 exactly when n >= 10.
	letters := ((v + 0x0606060606060606) >> 4) & 0x0101010101010101
	return v + 0x3030303030303030 + letters*39
}

// appendHex appends the low digits hex digits of v.
func appendHex(b []byte, v uint64, digits int) []byte {
	for k := digits - 1; k >= 0; k-- {
		b = append(b, hexDigits[(v>>(4*k))&15])
	}
	return b
}

func pathByte(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-'
}
