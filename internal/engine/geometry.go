package engine

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/internal/format"
)

// Geometry is the KV-cache shape of one model at one tensor-parallel rank.
// One GPU block of one layer holds TokensPerBlock tokens of KVHeads heads of
// HeadSize elements of DtypeSize bytes, per plane: K and V, or one latent
// plane when MLA is set.
type Geometry struct {
	Model          string // model id: at most abi.MaxModelLen bytes of UTF-8, no control characters
	Layers         int    // layers, one LayerTensor each (1..4096)
	KVHeads        int    // KV heads on this rank (1 for MLA's latent)
	HeadSize       int    // elements per head (MLA: latent + rope dims)
	DtypeSize      int    // bytes per element
	MLA            bool   // one latent plane instead of K and V (multi-head latent attention)
	TokensPerBlock int    // tokens in one GPU (paged) block
	TokensPerKey   int    // tokens one key covers; a multiple of TokensPerBlock
	TPRank, TPSize int    // tensor-parallel rank and size (0 <= TPRank < TPSize)
}

// Validate reports the first field that is out of range.
func (g Geometry) Validate() error {
	bad := func(field string, v any, want string) error {
		return fmt.Errorf("%w: geometry %s = %v: want %s", ErrInvalid, field, v, want)
	}
	const maxDim = 1 << 20
	switch {
	case g.Model == "":
		return bad("Model", `""`, "a model id")
	case len(g.Model) > abi.MaxModelLen:
		return bad("Model", len(g.Model), fmt.Sprintf("at most %d bytes", abi.MaxModelLen))
	case !utf8.ValidString(g.Model) || strings.ContainsFunc(g.Model, unicode.IsControl):
		// It names the namespace to operators: logs, kvhost stats' table
		// and the metrics' labels, which must be UTF-8; a control
		// character would break the table or drive a terminal.
		return bad("Model", fmt.Sprintf("%q", g.Model), "valid UTF-8 without control characters")
	case g.Layers <= 0 || g.Layers > 4096:
		return bad("Layers", g.Layers, "1..4096")
	case g.KVHeads <= 0 || g.KVHeads > maxDim:
		return bad("KVHeads", g.KVHeads, "1..2^20")
	case g.HeadSize <= 0 || g.HeadSize > maxDim:
		return bad("HeadSize", g.HeadSize, "1..2^20")
	case g.DtypeSize != 1 && g.DtypeSize != 2 && g.DtypeSize != 4 && g.DtypeSize != 8:
		return bad("DtypeSize", g.DtypeSize, "1, 2, 4 or 8")
	case g.TokensPerBlock <= 0 || g.TokensPerBlock > maxDim:
		return bad("TokensPerBlock", g.TokensPerBlock, "1..2^20")
	case g.TokensPerKey <= 0 || g.TokensPerKey%g.TokensPerBlock != 0:
		return bad("TokensPerKey", g.TokensPerKey, fmt.Sprintf("a positive multiple of TokensPerBlock (%d)", g.TokensPerBlock))
	case g.TokensPerKey/g.TokensPerBlock > 4096:
		return bad("TokensPerKey", g.TokensPerKey, "at most 4096 blocks per key")
	case g.TPSize <= 0 || g.TPSize > 4096:
		return bad("TPSize", g.TPSize, "1..4096")
	case g.TPRank < 0 || g.TPRank >= g.TPSize:
		return bad("TPRank", g.TPRank, fmt.Sprintf("0..TPSize-1 (%d)", g.TPSize-1))
	}
	if bb := g.BlockBytes(); bb < MinBlockBytes {
		// Every block is one segment with its own metadata and iovec:
		// tiny blocks would make a small request cost far more memory
		// and system calls than the bytes it moves.
		return bad("BlockBytes (TokensPerBlock × KVHeads × HeadSize × DtypeSize)", bb, fmt.Sprintf("at least %d bytes: every block is one I/O segment with its own metadata", MinBlockBytes))
	}
	if s := g.SegmentsPerKey(); s > MaxSegmentsPerKey {
		return bad("SegmentsPerKey (Layers × planes × blocks per key)", s, fmt.Sprintf("at most %d segments per key (Layers %d, planes %d, blocks per key %d)", MaxSegmentsPerKey, g.Layers, g.Planes(), g.BlocksPerKey()))
	}
	if kb := g.KeyBytes(); kb <= 0 || kb > 1<<36 {
		return bad("KeyBytes", kb, "1..64 GiB per key")
	}
	return nil
}

// Limits on a geometry's segments: a store or load holds metadata for every
// segment (one plane of one layer of one GPU block) of the files it moves.
const (
	// MinBlockBytes is the smallest block (Geometry.BlockBytes) accepted.
	MinBlockBytes = 512
	// MaxSegmentsPerKey bounds Layers × planes × blocks per key; real
	// models are far below it (Llama-3.1-70B with 1024-token keys of
	// 16-token blocks: 80 × 2 × 64 = 10240).
	MaxSegmentsPerKey = 1 << 16
	// MaxSegmentsPerFile bounds keys per file × segments per key: the
	// layout a policy chooses for a namespace must stay within it.
	MaxSegmentsPerFile = 1 << 20
)

// SegmentsPerKey is the number of segments (blocks of one plane of one
// layer) one key covers: Layers × planes × blocks per key.
func (g Geometry) SegmentsPerKey() int {
	return g.Layers * g.Planes() * g.BlocksPerKey()
}

// Planes is 2 (K and V) or 1 (MLA).
func (g Geometry) Planes() int {
	if g.MLA {
		return 1
	}
	return 2
}

// BlocksPerKey is the number of GPU blocks one key covers.
func (g Geometry) BlocksPerKey() int {
	if g.TokensPerBlock <= 0 {
		return 0
	}
	return g.TokensPerKey / g.TokensPerBlock
}

// BlockBytes is the size of one plane of one layer of one GPU block: the
// unit segment of the paged layout.
func (g Geometry) BlockBytes() int64 {
	return int64(g.TokensPerBlock) * int64(g.KVHeads) * int64(g.HeadSize) * int64(g.DtypeSize)
}

// KeyBytes is the payload size of one key: every layer, plane and block.
func (g Geometry) KeyBytes() int64 {
	return int64(g.Layers) * int64(g.Planes()) * int64(g.BlocksPerKey()) * g.BlockBytes()
}

// fingerprintTag starts the fingerprint encoding; bump its version only if
// the encoding changes (which would orphan every stored file).
const fingerprintTag = "kvhost/geometry/v1\x00"

// Fingerprint is a stable 64-bit hash of the geometry: FNV-1a 64 of
// fingerprintTag, the model id's length (uint32 LE) and bytes, then Layers,
// KVHeads, HeadSize, DtypeSize, MLA (0/1), TokensPerBlock, TokensPerKey,
// TPRank, TPSize as uint32 LE, in that order. docs/format.md documents it; it
// never depends on the Go version, the process or the machine.
func (g Geometry) Fingerprint() uint64 {
	h := fnv.New64a()
	b := make([]byte, 0, len(fingerprintTag)+4+len(g.Model)+9*4)
	b = append(b, fingerprintTag...)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(g.Model)))
	b = append(b, g.Model...)
	mla := 0
	if g.MLA {
		mla = 1
	}
	for _, v := range []int{g.Layers, g.KVHeads, g.HeadSize, g.DtypeSize, mla, g.TokensPerBlock, g.TokensPerKey, g.TPRank, g.TPSize} {
		b = binary.LittleEndian.AppendUint32(b, uint32(v))
	}
	h.Write(b)
	return h.Sum64()
}

// record returns the NamespaceRecord the policy sees for g.
func (g Geometry) record(ns NamespaceID, mounts int) abi.NamespaceRecord {
	var r abi.NamespaceRecord
	r.NS = uint32(ns)
	if g.MLA {
		r.Flags |= abi.NamespaceMLA
	}
	r.Fingerprint = g.Fingerprint()
	r.Layers = uint32(g.Layers)
	r.KVHeads = uint32(g.KVHeads)
	r.HeadSize = uint32(g.HeadSize)
	r.DtypeSize = uint32(g.DtypeSize)
	r.TokensPerBlock = uint32(g.TokensPerBlock)
	r.TokensPerKey = uint32(g.TokensPerKey)
	r.TPRank = uint32(g.TPRank)
	r.TPSize = uint32(g.TPSize)
	r.MountCount = uint32(mounts)
	r.KeyBytes = uint64(g.KeyBytes())
	r.SetModelID(g.Model)
	return r
}

type namespace struct {
	id          NamespaceID
	fp          uint64
	declared    bool
	geo         Geometry
	rec         abi.NamespaceRecord
	keysPerFile int
	order       uint32
	// counted: created or claimed by Declare, so it counts against
	// Config.MaxNamespaces (namespaces of files found on disk do not).
	counted bool
	// adopting counts the files found on the mounts (namespaceOf) given
	// its id and not yet indexed (adoptDone): no id is given back while
	// any is, as an entry about to be indexed names it.
	adopting int
	// declaring counts the Declare calls under way (between their two
	// holds of the tables' lock): Release gives no id back while any is.
	declaring int
	// layout: the vllm-fs mount serving the namespace (nil: the policy
	// places and names its files on the kvhost mounts). Set by Declare.
	layout *mount
}

// header is the header of a file of ns's keys written at now (Unix
// nanoseconds), without its keys.
func (ns *namespace) header(now int64) *format.Header {
	return &format.Header{
		Fingerprint: ns.fp, Order: ns.order, Layers: uint32(ns.geo.Layers), Planes: uint32(ns.geo.Planes()),
		BlocksPerKey: uint32(ns.geo.BlocksPerKey()), BlockBytes: uint64(ns.geo.BlockBytes()), Created: now,
	}
}

// wholeFileLen is the length of a file that holds a whole group of ns's
// keys (KeysPerFile): key entries have a fixed length, so it depends on
// the geometry and the number of keys alone.
func (ns *namespace) wholeFileLen() int64 {
	h := ns.header(0)
	h.Keys = make([]format.Key, ns.keysPerFile)
	return h.FileLen()
}
