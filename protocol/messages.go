package protocol

import (
	"fmt"

	"github.com/kvhost/kvhost/outcome"
)

// Hello opens a connection: the client's magic, protocol version and name.
type Hello struct {
	Version uint16 // the protocol version the client speaks (Version)
	Client  string // free-form, at most MaxName bytes (logged)
}

// Type is TypeHello.
func (*Hello) Type() Type { return TypeHello }

// AppendBody encodes: magic [8] | u16 version | u16 0 | str8 client.
func (m *Hello) AppendBody(b []byte) []byte {
	b = append(b, Magic...)
	b = appendU16(b, m.Version)
	b = appendU16(b, 0)
	return appendStr8(b, m.Client, MaxName)
}

// DecodeBody decodes and checks the magic.
func (m *Hello) DecodeBody(b []byte) error {
	d := decoder{b: b}
	if magic := d.take(len(Magic), "magic"); d.err == nil && string(magic) != Magic {
		d.fail("bad magic %q", magic)
	}
	m.Version = d.u16("version")
	d.zero(2)
	m.Client = d.str8("client name", MaxName)
	return d.end()
}

// Welcome is the reply to Hello: the version spoken and the daemon's limits.
type Welcome struct {
	Version          uint16 // the protocol version the daemon speaks on the connection: the Hello's
	MaxFrame         uint32 // most bytes of one frame, header included
	MaxRegistrations uint32 // memory regions per connection
	MaxInflightJobs  uint32 // unfinished store and load jobs per connection
	MaxNamespaces    uint32 // declared namespaces per connection
	MaxCaches        uint32 // registered caches per connection
	MaxKeys          uint32 // keys per request
	MaxKeyLen        uint32 // longest key, in bytes (MaxKeyLen)
	Server           string // daemon name and version, at most MaxName bytes
	// Features (version 2 and later; 0 in version 1) are what the daemon
	// serves beyond version 1: FeatureLayerLoads and later bits.
	Features Feature
}

// Type is the reply to TypeHello.
func (*Welcome) Type() Type { return TypeHello | TypeReply }

// AppendBody encodes: u16 version | u16 0 | 7 × u32 limits | str8 server
// | from version 2: u64 features.
func (m *Welcome) AppendBody(b []byte) []byte {
	b = appendU16(b, m.Version)
	b = appendU16(b, 0)
	for _, v := range []uint32{m.MaxFrame, m.MaxRegistrations, m.MaxInflightJobs, m.MaxNamespaces, m.MaxCaches, m.MaxKeys, m.MaxKeyLen} {
		b = appendU32(b, v)
	}
	b = appendStr8(b, m.Server, MaxName)
	if m.Version >= 2 {
		b = appendU64(b, uint64(m.Features))
	}
	return b
}

// DecodeBody decodes a Welcome and checks MaxFrame against MinFrame and
// MaxFrame: a client sizes the frames it reads by it. A version-1 Welcome
// ends after the server name; from version 2 the features follow it, and
// bytes after them (a later daemon's fields) are ignored.
func (m *Welcome) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.Version = d.u16("version")
	d.zero(2)
	m.MaxFrame = d.u32("max frame")
	m.MaxRegistrations = d.u32("max registrations")
	m.MaxInflightJobs = d.u32("max inflight jobs")
	m.MaxNamespaces = d.u32("max namespaces")
	m.MaxCaches = d.u32("max caches")
	m.MaxKeys = d.u32("max keys")
	m.MaxKeyLen = d.u32("max key length")
	m.Server = d.str8("server name", MaxName)
	if d.err == nil && (m.MaxFrame < MinFrame || m.MaxFrame > MaxFrame) {
		d.fail("max frame %d: want %d..%d", m.MaxFrame, MinFrame, MaxFrame)
	}
	m.Features = 0
	if m.Version < 2 {
		return d.end()
	}
	m.Features = Feature(d.u64("features"))
	return d.err
}

// MemoryKind is the kind of a memory registration.
type MemoryKind uint8

// Memory kinds.
const (
	// MemoryMemfd is host memory: a memfd sent as SCM_RIGHTS ancillary data
	// with the frame, mapped by the daemon.
	MemoryMemfd MemoryKind = 1
	// MemoryCUDAIPC is GPU memory named by a cudaIpcMemHandle_t, the
	// device ordinal it lives on (as the daemon numbers its devices) and
	// an offset into the allocation the handle names. A daemon without
	// GPU support answers CodeUnsupported.
	MemoryCUDAIPC MemoryKind = 2
	// MemoryShared is host memory in a shared-memory file sent as
	// SCM_RIGHTS with the frame: a memfd or a regular file on a memory
	// file system (tmpfs such as /dev/shm, hugetlbfs), not necessarily
	// sealed. Its owner may truncate it; the daemon then fails the jobs
	// that touch the missing pages. A daemon that cannot guard its copies
	// answers CodeUnsupported.
	MemoryShared MemoryKind = 3
)

// String names the kind.
func (k MemoryKind) String() string {
	switch k {
	case MemoryMemfd:
		return "memfd"
	case MemoryCUDAIPC:
		return "cuda-ipc"
	case MemoryShared:
		return "shared-file"
	}
	return fmt.Sprintf("memory-kind(%d)", uint8(k))
}

// RegisterMemory registers a memory region.
type RegisterMemory struct {
	Kind   MemoryKind // memfd, CUDA IPC or shared file
	Device uint32     // CUDA device ordinal (MemoryCUDAIPC), else 0
	Size   uint64     // bytes of the region
	Offset uint64     // CUDA: offset into the IPC allocation; memfd: 0
	// Handle is the cudaIpcMemHandle_t (MemoryCUDAIPC), else all zero.
	Handle [CUDAIPCHandleLen]byte
}

// Type is TypeRegisterMemory.
func (*RegisterMemory) Type() Type { return TypeRegisterMemory }

// AppendBody encodes: u8 kind | 3 × 0 | u32 device | u64 size | u64 offset |
// [64] handle (all zero for memfd and shared files).
func (m *RegisterMemory) AppendBody(b []byte) []byte {
	b = append(b, uint8(m.Kind), 0, 0, 0)
	b = appendU32(b, m.Device)
	b = appendU64(b, m.Size)
	b = appendU64(b, m.Offset)
	return append(b, m.Handle[:]...)
}

// DecodeBody decodes and checks kind and size.
func (m *RegisterMemory) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.Kind = MemoryKind(d.u8("kind"))
	d.zero(3)
	m.Device = d.u32("device")
	m.Size = uint64(d.i64("size"))
	m.Offset = uint64(d.i64("offset"))
	copy(m.Handle[:], d.take(CUDAIPCHandleLen, "handle"))
	if d.err == nil {
		switch {
		case m.Kind != MemoryMemfd && m.Kind != MemoryCUDAIPC && m.Kind != MemoryShared:
			d.fail("memory kind %d", m.Kind)
		case m.Size == 0:
			d.fail("size 0")
		case m.Kind != MemoryCUDAIPC && (m.Offset != 0 || m.Device != 0 || m.Handle != [CUDAIPCHandleLen]byte{}):
			d.fail("%s registration with device, offset or handle set", m.Kind)
		}
	}
	return d.end()
}

// MemoryRegistered is the reply to RegisterMemory.
type MemoryRegistered struct {
	Region uint32 // the connection's id for the region
	Inode  uint64 // file inode as the daemon sees it (a cross-check); 0 for GPU memory
}

// Type is the reply to TypeRegisterMemory.
func (*MemoryRegistered) Type() Type { return TypeRegisterMemory | TypeReply }

// AppendBody encodes: u32 region | u32 0 | u64 inode.
func (m *MemoryRegistered) AppendBody(b []byte) []byte {
	return appendU64(appendU32(appendU32(b, m.Region), 0), m.Inode)
}

// DecodeBody decodes a MemoryRegistered.
func (m *MemoryRegistered) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.Region = d.u32("region")
	d.zero(4)
	m.Inode = d.u64("inode")
	return d.end()
}

// UnregisterMemory releases a region no cache uses any more.
type UnregisterMemory struct {
	Region uint32 // the region's id, from its MemoryRegistered
}

// Type is TypeUnregisterMemory.
func (*UnregisterMemory) Type() Type { return TypeUnregisterMemory }

// AppendBody encodes: u32 region.
func (m *UnregisterMemory) AppendBody(b []byte) []byte { return appendU32(b, m.Region) }

// DecodeBody decodes an UnregisterMemory.
func (m *UnregisterMemory) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.Region = d.u32("region")
	return d.end()
}

// Geometry is the KV-cache shape of one model at one tensor-parallel rank
// (host/engine.Geometry on the wire).
type Geometry struct {
	Model          string // model id, 1..MaxModelLen bytes
	Layers         uint32 // layers of the model
	KVHeads        uint32 // KV heads on this rank (1 for MLA's latent)
	HeadSize       uint32 // elements per head
	DtypeSize      uint32 // bytes per element
	MLA            bool   // one latent plane per layer instead of K and V
	TokensPerBlock uint32 // tokens in one GPU (paged) block
	TokensPerKey   uint32 // tokens one key covers; a multiple of TokensPerBlock
	TPRank         uint32 // this worker's tensor-parallel rank, below TPSize
	TPSize         uint32 // number of tensor-parallel ranks
}

// BlocksPerKey is TokensPerKey / TokensPerBlock (0 if TokensPerBlock is 0).
func (g Geometry) BlocksPerKey() int {
	if g.TokensPerBlock == 0 {
		return 0
	}
	return int(g.TokensPerKey / g.TokensPerBlock)
}

// BlockBytes is the size of one plane of one layer of one block.
func (g Geometry) BlockBytes() int64 {
	return int64(g.TokensPerBlock) * int64(g.KVHeads) * int64(g.HeadSize) * int64(g.DtypeSize)
}

// Planes is 2 (K and V) or 1 (MLA).
func (g Geometry) Planes() int {
	if g.MLA {
		return 1
	}
	return 2
}

// Declare declares a namespace: a geometry.
type Declare struct {
	Geometry Geometry // the namespace's geometry
}

// Type is TypeDeclare.
func (*Declare) Type() Type { return TypeDeclare }

// AppendBody encodes: str8 model | u32 layers, kv heads, head size, dtype
// size, mla (0/1), tokens per block, tokens per key, tp rank, tp size.
func (m *Declare) AppendBody(b []byte) []byte {
	g := m.Geometry
	b = appendStr8(b, g.Model, MaxModelLen)
	mla := uint32(0)
	if g.MLA {
		mla = 1
	}
	for _, v := range []uint32{g.Layers, g.KVHeads, g.HeadSize, g.DtypeSize, mla, g.TokensPerBlock, g.TokensPerKey, g.TPRank, g.TPSize} {
		b = appendU32(b, v)
	}
	return b
}

// DecodeBody decodes a Declare; the geometry's values are checked by the
// engine, only the encoding here.
func (m *Declare) DecodeBody(b []byte) error {
	d := decoder{b: b}
	g := &m.Geometry
	g.Model = d.str8("model", MaxModelLen)
	g.Layers = d.u32("layers")
	g.KVHeads = d.u32("kv heads")
	g.HeadSize = d.u32("head size")
	g.DtypeSize = d.u32("dtype size")
	mla := d.u32("mla")
	g.TokensPerBlock = d.u32("tokens per block")
	g.TokensPerKey = d.u32("tokens per key")
	g.TPRank = d.u32("tp rank")
	g.TPSize = d.u32("tp size")
	if d.err == nil && mla > 1 {
		d.fail("mla = %d: want 0 or 1", mla)
	}
	g.MLA = mla == 1
	return d.end()
}

// Declared is the reply to Declare.
type Declared struct {
	NS           uint32 // the connection's id for the namespace
	BlocksPerKey uint32 // GPU blocks one key covers (Geometry.BlocksPerKey)
	Fingerprint  uint64 // the geometry's fingerprint (docs/format.md)
	KeyBytes     uint64 // payload bytes of one key: every layer, plane and block
}

// Type is the reply to TypeDeclare.
func (*Declared) Type() Type { return TypeDeclare | TypeReply }

// AppendBody encodes: u32 ns | u32 blocks per key | u64 fingerprint | u64 key bytes.
func (m *Declared) AppendBody(b []byte) []byte {
	return appendU64(appendU64(appendU32(appendU32(b, m.NS), m.BlocksPerKey), m.Fingerprint), m.KeyBytes)
}

// DecodeBody decodes a Declared.
func (m *Declared) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.NS = d.u32("ns")
	m.BlocksPerKey = d.u32("blocks per key")
	m.Fingerprint = d.u64("fingerprint")
	m.KeyBytes = d.u64("key bytes")
	return d.end()
}

// Layer is the tensor of one layer of a paged cache in a registered region:
// block i of plane p is at Offset + p*PlaneStride + i*BlockStride.
type Layer struct {
	Region      uint32 // the registered region that holds the tensor
	NumBlocks   uint32 // blocks of the layer (at least 1); block ids are below it
	Offset      int64  // bytes from the region's start to block 0 of plane 0
	BlockStride int64  // bytes from one block to the next
	PlaneStride int64  // bytes from plane 0 (K) to plane 1 (V)
}

// layerSize is the encoded size of a Layer.
const layerSize = 32

// RegisterCache registers a paged KV cache of a declared namespace.
type RegisterCache struct {
	NS     uint32  // the namespace id, from Declared
	Layers []Layer // one per layer of the namespace's geometry
}

// Type is TypeRegisterCache.
func (*RegisterCache) Type() Type { return TypeRegisterCache }

// AppendBody encodes: u32 ns | u32 layer count | per layer: u32 region |
// u32 num blocks | i64 offset | i64 block stride | i64 plane stride.
func (m *RegisterCache) AppendBody(b []byte) []byte {
	b = appendU32(appendU32(b, m.NS), uint32(len(m.Layers)))
	for _, l := range m.Layers {
		b = appendU32(appendU32(b, l.Region), l.NumBlocks)
		b = appendU64(appendU64(appendU64(b, uint64(l.Offset)), uint64(l.BlockStride)), uint64(l.PlaneStride))
	}
	return b
}

// DecodeBody decodes a RegisterCache.
func (m *RegisterCache) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.NS = d.u32("ns")
	n := d.count("layer count", 1, MaxLayers, layerSize)
	if d.err == nil {
		m.Layers = make([]Layer, n)
		for i := range m.Layers {
			l := &m.Layers[i]
			l.Region = d.u32("region")
			l.NumBlocks = d.u32("num blocks")
			l.Offset = d.i64("offset")
			l.BlockStride = d.i64("block stride")
			l.PlaneStride = d.i64("plane stride")
		}
	}
	return d.end()
}

// CacheRegistered is the reply to RegisterCache.
type CacheRegistered struct {
	Cache uint32 // the connection's id for the cache
}

// Type is the reply to TypeRegisterCache.
func (*CacheRegistered) Type() Type { return TypeRegisterCache | TypeReply }

// AppendBody encodes: u32 cache.
func (m *CacheRegistered) AppendBody(b []byte) []byte { return appendU32(b, m.Cache) }

// DecodeBody decodes a CacheRegistered.
func (m *CacheRegistered) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.Cache = d.u32("cache")
	return d.end()
}

// UnregisterCache releases a cache with no job in flight.
type UnregisterCache struct {
	Cache uint32 // the cache's id, from its CacheRegistered
}

// Type is TypeUnregisterCache.
func (*UnregisterCache) Type() Type { return TypeUnregisterCache }

// AppendBody encodes: u32 cache.
func (m *UnregisterCache) AppendBody(b []byte) []byte { return appendU32(b, m.Cache) }

// DecodeBody decodes an UnregisterCache.
func (m *UnregisterCache) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.Cache = d.u32("cache")
	return d.end()
}

// Undeclare gives up a namespace that no registered cache of the
// connection uses and no held pin of the connection is in; the daemon
// forgets the geometry once no connection has it declared. Stored data is
// kept.
type Undeclare struct {
	NS uint32 // the namespace id, from Declared
}

// Type is TypeUndeclare.
func (*Undeclare) Type() Type { return TypeUndeclare }

// AppendBody encodes: u32 namespace.
func (m *Undeclare) AppendBody(b []byte) []byte { return appendU32(b, m.NS) }

// DecodeBody decodes an Undeclare.
func (m *Undeclare) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.NS = d.u32("namespace")
	return d.end()
}

// Lookup asks how many leading keys are stored in a namespace.
type Lookup struct {
	NS   uint32   // the namespace id, from Declared
	Keys [][]byte // the keys; the reply counts the leading ones stored
}

// Type is TypeLookup.
func (*Lookup) Type() Type { return TypeLookup }

// AppendBody encodes: u32 ns | keys (u32 count, then u8 length + bytes each).
func (m *Lookup) AppendBody(b []byte) []byte { return appendKeys(appendU32(b, m.NS), m.Keys) }

// DecodeBody decodes a Lookup.
func (m *Lookup) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.NS = d.u32("ns")
	m.Keys = d.keys()
	return d.end()
}

// Delete removes keys from a namespace.
type Delete struct {
	NS   uint32   // the namespace id, from Declared
	Keys [][]byte // the keys to remove
}

// Type is TypeDelete.
func (*Delete) Type() Type { return TypeDelete }

// AppendBody encodes as Lookup.
func (m *Delete) AppendBody(b []byte) []byte { return appendKeys(appendU32(b, m.NS), m.Keys) }

// DecodeBody decodes a Delete.
func (m *Delete) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.NS = d.u32("ns")
	m.Keys = d.keys()
	return d.end()
}

// Count is the reply to Lookup (leading keys stored) and Delete (keys
// removed).
type Count struct {
	T     Type   // TypeLookup|TypeReply or TypeDelete|TypeReply
	Count uint32 // leading keys stored (Lookup), keys removed (Delete) or keys the pin held (Unpin)
}

// Type is T.
func (m *Count) Type() Type { return m.T }

// AppendBody encodes: u32 count.
func (m *Count) AppendBody(b []byte) []byte { return appendU32(b, m.Count) }

// DecodeBody decodes a Count.
func (m *Count) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.Count = d.u32("count")
	return d.end()
}

// JobKind says whether a job stores or loads.
type JobKind uint8

// Job kinds.
const (
	JobStore JobKind = 1
	JobLoad  JobKind = 2
)

// String names the kind.
func (k JobKind) String() string {
	switch k {
	case JobStore:
		return "store"
	case JobLoad:
		return "load"
	}
	return fmt.Sprintf("job-kind(%d)", uint8(k))
}

// NoBlock, as a block id of a Load, says that block of the key is not
// loaded: the key's other blocks are, and the whole key is still read and
// its payload checksum verified, but the bytes of this block go nowhere.
// It serves a load that starts or ends inside a key (vLLM's chunks of
// several GPU blocks, whose first blocks the GPU prefix cache holds
// already). A Store may not carry it, nor may a Load leave out every block
// of a key (Transfer.CheckNoBlock).
const NoBlock uint32 = 0xFFFFFFFF

// Transfer is a Store or Load request: key i moves from or to the cache
// blocks Blocks[i] (BlocksPerKey of them).
type Transfer struct {
	Kind   JobKind    // JobStore or JobLoad: the frame type, not in the body
	Cache  uint32     // the cache id, from CacheRegistered
	Keys   [][]byte   // the keys to store or load
	Blocks [][]uint32 // per key, its block ids in the cache
	// Layers, set in a LoadLayers (Kind JobLoad) only, is the range of
	// layers of every key it loads; nil in a Store or Load.
	Layers *LayerRange
}

// Type is TypeStore, TypeLoad or, with Layers set, TypeLoadLayers.
func (m *Transfer) Type() Type {
	switch {
	case m.Layers != nil:
		return TypeLoadLayers
	case m.Kind == JobLoad:
		return TypeLoad
	}
	return TypeStore
}

// CheckNoBlock reports, as an error naming the key, a Store with a NoBlock
// block id and a Load of a key whose every block id is NoBlock; nil
// otherwise.
func (m *Transfer) CheckNoBlock() error {
	for i, blocks := range m.Blocks {
		skipped := 0
		for _, id := range blocks {
			if id == NoBlock {
				skipped++
			}
		}
		switch {
		case skipped == 0:
		case m.Kind != JobLoad:
			return fmt.Errorf("key %d: block id 0x%08x (NoBlock) in a store: only a load may leave blocks of a key out", i, NoBlock)
		case skipped == len(blocks):
			return fmt.Errorf("key %d: every block id is 0x%08x (NoBlock): a load must name at least one block of each key", i, NoBlock)
		}
	}
	return nil
}

// AppendBody encodes: u32 cache | u32 blocks per key | keys | key count ×
// blocks per key × u32 block ids | with Layers (LoadLayers): u32 first
// layer, u32 layer count. Every Blocks[i] must have the length of
// Blocks[0].
func (m *Transfer) AppendBody(b []byte) []byte {
	bpk := 0
	if len(m.Blocks) > 0 {
		bpk = len(m.Blocks[0])
	}
	b = appendU32(appendU32(b, m.Cache), uint32(bpk))
	b = appendKeys(b, m.Keys)
	for _, blocks := range m.Blocks {
		for _, id := range blocks {
			b = appendU32(b, id)
		}
	}
	if m.Layers != nil {
		b = appendLayerRange(b, *m.Layers)
	}
	return b
}

// DecodeBody decodes a Transfer (Kind is kept, and whether Layers is set:
// the frame type says both).
func (m *Transfer) DecodeBody(b []byte) error {
	if m.Layers != nil {
		// The range is the body's last bytes: the block ids before it
		// are counted by the keys.
		if len(b) < layerRangeSize {
			return fmt.Errorf("%w: load-layers body of %d bytes: want a layer range at its end", ErrMalformed, len(b))
		}
		tail := decoder{b: b[len(b)-layerRangeSize:]}
		*m.Layers = decodeLayerRange(&tail)
		if tail.err != nil {
			return tail.err
		}
		b = b[:len(b)-layerRangeSize]
	}
	d := decoder{b: b}
	m.Cache = d.u32("cache")
	bpk := int(d.u32("blocks per key"))
	if d.err == nil && (bpk < 1 || bpk > MaxBlocksPerKey) {
		d.fail("blocks per key = %d: want 1..%d", bpk, MaxBlocksPerKey)
	}
	m.Keys = d.keys()
	if d.err == nil {
		if want := len(m.Keys) * bpk * 4; want != len(d.b) {
			d.fail("%d keys × %d blocks need %d bytes of block ids, body has %d", len(m.Keys), bpk, want, len(d.b))
		}
	}
	if d.err == nil {
		flat := make([]uint32, len(m.Keys)*bpk)
		for i := range flat {
			flat[i] = d.u32("block id")
		}
		m.Blocks = make([][]uint32, len(m.Keys))
		for i := range m.Blocks {
			m.Blocks[i] = flat[i*bpk : (i+1)*bpk : (i+1)*bpk]
		}
	}
	return d.end()
}

// JobAccepted is the reply to Store and Load: the job's id. Its Completion
// follows on the same connection.
type JobAccepted struct {
	T   Type   // TypeStore|TypeReply or TypeLoad|TypeReply
	Job uint64 // the daemon's id of the job, named by its Completion
}

// Type is T.
func (m *JobAccepted) Type() Type { return m.T }

// AppendBody encodes: u64 job.
func (m *JobAccepted) AppendBody(b []byte) []byte { return appendU64(b, m.Job) }

// DecodeBody decodes a JobAccepted.
func (m *JobAccepted) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.Job = d.u64("job")
	return d.end()
}

// Cancel asks to cancel a job of this connection.
type Cancel struct {
	Job uint64 // the job's id, from its JobAccepted
}

// Type is TypeCancel.
func (*Cancel) Type() Type { return TypeCancel }

// AppendBody encodes: u64 job.
func (m *Cancel) AppendBody(b []byte) []byte { return appendU64(b, m.Job) }

// DecodeBody decodes a Cancel.
func (m *Cancel) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.Job = d.u64("job")
	return d.end()
}

// Cancelled is the reply to Cancel. Its completion still follows when the
// job was in flight.
type Cancelled struct {
	// InFlight is true when the job was in flight and cancellation was
	// requested; false when it had already completed (or never existed).
	InFlight bool
}

// Type is the reply to TypeCancel.
func (*Cancelled) Type() Type { return TypeCancel | TypeReply }

// AppendBody encodes: u8 in flight (0/1).
func (m *Cancelled) AppendBody(b []byte) []byte {
	if m.InFlight {
		return append(b, 1)
	}
	return append(b, 0)
}

// DecodeBody decodes a Cancelled.
func (m *Cancelled) DecodeBody(b []byte) error {
	d := decoder{b: b}
	v := d.u8("in flight")
	if d.err == nil && v > 1 {
		d.fail("in flight = %d", v)
	}
	m.InFlight = v == 1
	return d.end()
}

// StatsRequest asks for the daemon's counters.
type StatsRequest struct{}

// Type is TypeStats.
func (*StatsRequest) Type() Type { return TypeStats }

// AppendBody encodes an empty body.
func (*StatsRequest) AppendBody(b []byte) []byte { return b }

// DecodeBody accepts only an empty body.
func (*StatsRequest) DecodeBody(b []byte) error { d := decoder{b: b}; return d.end() }

// Empty is the body-less reply of UnregisterMemory, UnregisterCache and
// Undeclare.
type Empty struct {
	T Type // the request's type with TypeReply set
}

// Type is T.
func (m *Empty) Type() Type { return m.T }

// AppendBody encodes an empty body.
func (*Empty) AppendBody(b []byte) []byte { return b }

// DecodeBody accepts only an empty body.
func (*Empty) DecodeBody(b []byte) error { d := decoder{b: b}; return d.end() }

// MountStats describes one mount (by index: the protocol carries no paths).
type MountStats struct {
	Capacity uint64 // effective capacity, in bytes
	Used     uint64 // bytes used on the mount
	Entries  uint64 // files indexed on the mount
	Direct   bool   // O_DIRECT is used on the mount
}

// maxMounts bounds the mounts of a Stats reply.
const maxMounts = 256

// DeviceStats is the GPU memory clients registered (CUDA IPC) on one
// device, over all connections, and the daemon's bound for it.
type DeviceStats struct {
	Ordinal    uint32 // the daemon's CUDA device ordinal
	Regions    uint64 // registered regions on the device
	Registered uint64 // their bytes
	Limit      uint64 // the most bytes clients may register on the device
	// UUID is the device's UUID (nvidia-smi's GPU-<uuid>), from the
	// device-identity section of the reply; zero where the daemon does not
	// know it or predates the section.
	UUID [16]byte
	// Faults counts the jobs and the CUDA IPC registrations on the device
	// that failed with a sticky CUDA error (an illegal address, a failed
	// launch, an ECC error): the daemon's context on the device is broken
	// and every later job there fails, until the daemon restarts. From the device-faults section of
	// the reply; 0 where the daemon predates it.
	Faults uint64
}

// MaxDevices bounds the devices of a Stats reply.
const MaxDevices = 1024

// Stats is the reply to StatsRequest: the engine's counters and this
// connection's usage.
type Stats struct {
	// Entries and Keys are the files and the keys in the daemon's index.
	Entries, Keys uint64
	// Stores and Loads count keys stored and loaded; Hits and Misses,
	// keys found and not found by lookups, loads and pins.
	Stores, Loads, Hits, Misses uint64
	// Evictions counts files deleted to make room, Failures keys that
	// ended OutcomeFailed, Corrupt files that failed verification.
	Evictions, Failures, Corrupt uint64
	// Vanished counts files found missing or replaced behind the
	// daemon's back; BytesWritten and BytesRead the payload bytes stored
	// and loaded.
	Vanished, BytesWritten, BytesRead uint64
	// Clients is the connections now past the handshake; Regions, Caches
	// and InflightJobs are this connection's.
	Clients, Regions, Caches, InflightJobs uint64
	Mounts                                 []MountStats  // one per mount, in configuration order
	Devices                                []DeviceStats // GPUs the daemon serves; none without GPU support
	// Daemon is the daemon-wide section, appended after Devices; nil in
	// the reply of a daemon that predates it.
	Daemon *DaemonStats
	// Spares is the spare-files section, appended after Daemon (sent only
	// with it); nil in the reply of a daemon that predates it.
	Spares *SpareStats
	// Tiering is the tiering section, after the device-faults section
	// (sent only with Spares); nil in the reply of a daemon that predates
	// it.
	Tiering *TierStats
	// StoresFailing is the mount-failures section, after the tiering
	// section (sent only with Tiering): one per Mounts, in order; nil in
	// the reply of a daemon that predates it.
	StoresFailing []MountFailure
	// Namespaces is the namespaces section, after the mount-failures
	// section (sent only with StoresFailing): what the daemon's index
	// holds of each namespace, the most bytes first, at most
	// MaxStatsNamespaces; nil in the reply of a daemon that predates it.
	Namespaces *NamespaceList
}

// MaxStatsNamespaces bounds the namespaces a Stats reply lists. A daemon
// lists fewer where the reply's other sections leave too little of its
// frame (a small max_frame, many mounts), counting the rest as left out.
const MaxStatsNamespaces = 128

// NamespaceList is the namespaces section of a Stats reply.
type NamespaceList struct {
	List []NamespaceStats // the most bytes first
	// LeftOut counts the namespaces beyond MaxStatsNamespaces, the
	// smallest, not listed.
	LeftOut uint64
}

// NamespaceStats is what the daemon's index holds of one namespace
// (host/engine.NamespaceStats).
type NamespaceStats struct {
	Fingerprint uint64 // the namespace's geometry fingerprint, as in its files' headers
	// Model is the model id the namespace was declared with (at most
	// MaxModelLen bytes), "" for files of a namespace no client declared
	// since the daemon started.
	Model    string
	Declared bool // declared by a client and not released
	Files    uint64
	Keys     uint64
	Bytes    uint64 // the files' bytes, headers included
	// Caches counts the caches registered in the namespace on all
	// connections (a vLLM engine's workers), from the caches section; 0
	// from a daemon that predates it.
	Caches uint32
}

// MountFailure is one mount's refusal of stores (host/engine.StoreFailure):
// the files stored there most recently failed for a reason of the mount's
// own (a read-only file system, an I/O error, no space left after
// eviction), and none succeeded since.
type MountFailure struct {
	// Since is when the first of those failures happened, or the daemon's
	// start found the mount refusing (Unix nanoseconds); 0 while the
	// mount's stores do not fail. Last is when the latest happened.
	Since, Last int64
	Stores      uint64 // files whose store failed so since the last that succeeded
	Err         string // the latest failure (at most 4096 bytes)
}

// TierStats is the tiering section of a Stats reply: the files moved
// between mounts (host/engine.TierStats) and the policy's fallback.
type TierStats struct {
	Demotions       uint64      // eviction victims moved to another mount
	Promotions      uint64      // moves to an earlier (faster) mount
	Moves           uint64      // moves the policy's tick asked for
	MoveFailures    uint64      // moves that failed; the file stays where it was
	DemotionDeletes uint64      // victims deleted because their target was full or held another file at their path
	Mounts          []TierMount // one per Stats.Mounts, in order
	// FallbackPolicy names the native policy the plugin fell back to
	// ("" while it has not).
	FallbackPolicy string
}

// TierMount is one mount's moves.
type TierMount struct {
	// MovedIn and MovedOut count the files moved to and from the mount.
	MovedIn, MovedOut uint64
}

// SpareStats is the spare-files section of a Stats reply: evicted files a
// daemon keeps on memory file systems for later stores to write into.
type SpareStats struct {
	Reused uint64       // stores that wrote into a spare instead of a fresh file
	Mounts []SpareMount // one per Stats.Mounts, in order
	// Made counts the spare files made ahead of stores (a mount's
	// preallocate), sent after the device-identity section; 0 from a
	// daemon that predates it.
	Made uint64
}

// SpareMount is one mount's spare files.
type SpareMount struct {
	// Files and Bytes are the spare files kept on the mount and their
	// bytes (not part of MountStats.Used).
	Files, Bytes uint64
}

// DaemonStats is the daemon-wide section of a Stats reply: what an operator
// asks of a running daemon (kvhost stats).
type DaemonStats struct {
	Started        int64  // Unix nanoseconds at start-up
	Policy         string // the configured policy's name
	PolicyBackend  string // what answers policy calls now: "wasm" or "native"
	Fallback       bool   // the policy fell back to its native build
	FallbackReason string // the failure that made the policy fall back ("" while it has not)
	// FallbackPolicy names that native policy; sent in the tiering
	// section of the reply (TierStats.FallbackPolicy), not in this one.
	FallbackPolicy string
	// Reloads and ReloadFailures count configuration reloads (SIGHUP);
	// LastReload says how the last one went ("" before any).
	Reloads, ReloadFailures uint64
	LastReload              string      // how the last reload went ("" before any)
	InflightJobs            uint64      // of all connections (Stats.InflightJobs is this connection's)
	Regions                 uint64      // host memory regions registered by all connections
	RegisteredBytes         uint64      // their bytes
	Mounts                  []MountInfo // one per Stats.Mounts, in order
	// Budgets is the use of each byte budget per namespace ([[budget]]),
	// in configuration order, at most MaxStatsBudgets: empty from a
	// daemon without budgets, nil from one that predates them. Sent in
	// the budgets section of the reply, after the caches section, not in
	// this one; BudgetsLeftOut counts those beyond MaxStatsBudgets.
	Budgets        []BudgetStats
	BudgetsLeftOut uint64
}

// MaxStatsBudgets bounds the budgets a Stats reply lists.
const MaxStatsBudgets = 128

// maxBudgetModel bounds a budget's pattern in a Stats reply (model ids
// are at most MaxModelLen bytes: a longer pattern matches none).
const maxBudgetModel = 255

// BudgetStats is the use of one byte budget (host/engine.BudgetStats).
type BudgetStats struct {
	// Model is the budget's pattern: a model id, or a prefix of model
	// ids ending in "*" (at most 255 bytes).
	Model  string
	Used   uint64 // the bytes of the indexed files of the namespaces it covers
	Budget uint64 // its bytes (0: none, only a floor)
	Floor  uint64 // what an eviction never takes them below (0: none)
	// Over counts the files evictions took first because the namespaces
	// were over the budget; Kept, the eviction victims skipped because
	// taking them would cross the floor.
	Over, Kept uint64
}

// MountInfo is what DaemonStats says about one mount.
type MountInfo struct {
	Path       string // the mount's root directory
	Backend    string // the data mover of host memory ("staging")
	IO         string // "direct" or "buffered"
	Checksums  bool   // payload checksums are written and verified
	Configured uint64 // configured capacity (0: the file system's size)
	Reserve    uint64 // bytes left free on the file system
	// Class is the mount's device class, configured or detected
	// ("memory", "nvme", "ssd", "hdd", "network", "unknown"), from the
	// classes section; "" from a daemon that predates it. A client takes
	// a name it does not know for "unknown".
	Class string
}

// maxClassName bounds a device class's name in the classes section.
const maxClassName = 16

// Bounds of DaemonStats strings.
const (
	maxDaemonText = 4096 // reasons and reload outcomes
	maxMountPath  = 4096
)

func appendDaemon(b []byte, m *DaemonStats) []byte {
	b = appendU64(b, uint64(m.Started))
	b = appendStr8(appendStr8(b, m.Policy, MaxName), m.PolicyBackend, MaxName)
	b = append(b, boolByte(m.Fallback), 0, 0, 0, 0, 0, 0, 0)
	b = appendStr16(b, m.FallbackReason, maxDaemonText)
	b = appendU64(appendU64(b, m.Reloads), m.ReloadFailures)
	b = appendStr16(b, m.LastReload, maxDaemonText)
	b = appendU64(appendU64(appendU64(b, m.InflightJobs), m.Regions), m.RegisteredBytes)
	b = appendU32(b, uint32(len(m.Mounts)))
	for _, mt := range m.Mounts {
		b = appendStr16(b, mt.Path, maxMountPath)
		b = appendStr8(appendStr8(b, mt.Backend, MaxName), mt.IO, MaxName)
		b = append(b, boolByte(mt.Checksums), 0, 0, 0, 0, 0, 0, 0)
		b = appendU64(appendU64(b, mt.Configured), mt.Reserve)
	}
	return b
}

func boolByte(v bool) byte {
	if v {
		return 1
	}
	return 0
}

func (d *decoder) bool8(what string) bool {
	v := d.u8(what)
	if d.err == nil && v > 1 {
		d.fail("%s = %d", what, v)
	}
	d.zero(7)
	return v == 1
}

// decodeDaemon decodes the daemon section of a Stats reply with mounts
// mounts.
func decodeDaemon(d *decoder, mounts int) *DaemonStats {
	m := &DaemonStats{}
	m.Started = d.i64("start time")
	m.Policy = d.str8("policy", MaxName)
	m.PolicyBackend = d.str8("policy backend", MaxName)
	m.Fallback = d.bool8("fallback")
	m.FallbackReason = d.str16("fallback reason", maxDaemonText)
	m.Reloads = d.u64("reloads")
	m.ReloadFailures = d.u64("reload failures")
	m.LastReload = d.str16("last reload", maxDaemonText)
	m.InflightJobs = d.u64("daemon inflight jobs")
	m.Regions = d.u64("daemon regions")
	m.RegisteredBytes = d.u64("daemon registered bytes")
	n := d.count("mount info count", mounts, mounts, 2+1+1+8+8+8) // the smallest entry: empty strings
	if d.err == nil && n > 0 {
		m.Mounts = make([]MountInfo, n)
		for i := range m.Mounts {
			mt := &m.Mounts[i]
			mt.Path = d.str16("mount path", maxMountPath)
			mt.Backend = d.str8("mount backend", MaxName)
			mt.IO = d.str8("mount io", MaxName)
			mt.Checksums = d.bool8("mount checksums")
			mt.Configured = d.u64("mount configured capacity")
			mt.Reserve = d.u64("mount reserve")
		}
	}
	return m
}

// Type is the reply to TypeStats.
func (*Stats) Type() Type { return TypeStats | TypeReply }

func (m *Stats) fields() []*uint64 {
	return []*uint64{&m.Entries, &m.Keys, &m.Stores, &m.Loads, &m.Hits, &m.Misses, &m.Evictions,
		&m.Failures, &m.Corrupt, &m.Vanished, &m.BytesWritten, &m.BytesRead,
		&m.Clients, &m.Regions, &m.Caches, &m.InflightJobs}
}

// AppendBody encodes: 16 × u64 counters (in the field order) | u32 mount
// count | per mount: u64 capacity, u64 used, u64 entries, u8 direct, 7 × 0 |
// u32 device count | per device: u32 ordinal, u32 0, u64 regions,
// u64 registered, u64 limit | the daemon section if Daemon is set: i64
// start | str8 policy | str8 policy backend | u8 fallback, 7 × 0 | str16
// fallback reason | u64 reloads | u64 reload failures | str16 last reload
// | u64 inflight jobs | u64 regions | u64 registered bytes | u32 mount
// count (that of the mounts above, as in every later section) | per
// mount: str16 path, str8 backend, str8 io, u8 checksums, 7 × 0, u64
// configured, u64 reserve | the spares section if Spares is set (after
// the daemon section only): u64 reused | u32 mount count | per mount: u64
// files, u64 bytes | the device-identity section (after the
// spares section only): u32 device count (that of the devices above) | per
// device: 16 bytes UUID (zero: unknown) | the made-ahead section (after
// the device-identity section only): u64 spare files made ahead | the
// device-faults section (after the made-ahead section only): u32 device
// count (that of the devices above) | per device: u64 faults | the
// tiering section if Tiering is set (after the device-faults section
// only): u64 demotions, u64 promotions, u64 moves, u64 move failures, u64
// demotion deletes | u32 mount count | per mount: u64 moved in, u64 moved
// out | str8 fallback policy | the mount-failures section if StoresFailing
// is set (after the tiering section only): u32 mount count | per mount:
// i64 since, i64 last, u64 stores, str16 error | the namespaces section if
// Namespaces is set (after the mount-failures section only): u32 count (at
// most MaxStatsNamespaces) | u64 left out | per namespace: u64
// fingerprint, u64 files, u64 keys, u64 bytes, u8 declared, 7 × 0, str8
// model | the caches section (after the namespaces section only): u32
// count (that of the namespaces) | per namespace: u32 caches | the budgets
// section if Daemon.Budgets is set (after the caches section only; with
// Namespaces nil, an empty namespaces and caches section come first): u32
// count (at most MaxStatsBudgets) | u64 left out | per budget: u64 used,
// u64 budget, u64 floor, u64 over, u64 kept, str8 model.
func (m *Stats) AppendBody(b []byte) []byte {
	for _, p := range m.fields() {
		b = appendU64(b, *p)
	}
	b = appendU32(b, uint32(len(m.Mounts)))
	for _, mt := range m.Mounts {
		b = appendU64(appendU64(appendU64(b, mt.Capacity), mt.Used), mt.Entries)
		b = append(b, boolByte(mt.Direct), 0, 0, 0, 0, 0, 0, 0)
	}
	b = appendU32(b, uint32(len(m.Devices)))
	for _, dv := range m.Devices {
		b = appendU32(appendU32(b, dv.Ordinal), 0)
		b = appendU64(appendU64(appendU64(b, dv.Regions), dv.Registered), dv.Limit)
	}
	if m.Daemon != nil {
		b = appendDaemon(b, m.Daemon)
		if m.Spares != nil {
			b = appendU32(appendU64(b, m.Spares.Reused), uint32(len(m.Spares.Mounts)))
			for _, sm := range m.Spares.Mounts {
				b = appendU64(appendU64(b, sm.Files), sm.Bytes)
			}
			b = appendU32(b, uint32(len(m.Devices)))
			for _, dv := range m.Devices {
				b = append(b, dv.UUID[:]...)
			}
			b = appendU64(b, m.Spares.Made)
			b = appendU32(b, uint32(len(m.Devices)))
			for _, dv := range m.Devices {
				b = appendU64(b, dv.Faults)
			}
			if t := m.Tiering; t != nil {
				b = appendU64(appendU64(appendU64(appendU64(appendU64(b, t.Demotions), t.Promotions), t.Moves), t.MoveFailures), t.DemotionDeletes)
				b = appendU32(b, uint32(len(t.Mounts)))
				for _, tm := range t.Mounts {
					b = appendU64(appendU64(b, tm.MovedIn), tm.MovedOut)
				}
				b = appendStr8(b, t.FallbackPolicy, MaxName)
				if m.StoresFailing != nil {
					b = appendU32(b, uint32(len(m.StoresFailing)))
					for _, f := range m.StoresFailing {
						b = appendU64(appendU64(appendU64(b, uint64(f.Since)), uint64(f.Last)), f.Stores)
						b = appendStr16(b, f.Err, maxDaemonText)
					}
					nl := m.Namespaces
					if nl == nil && m.Daemon.Budgets != nil {
						nl = &NamespaceList{} // the budgets section comes after it
					}
					if nl != nil {
						b = appendNamespaces(b, nl)
					}
					if m.Daemon.Budgets != nil {
						b = appendBudgets(b, m.Daemon)
						if hasClasses(m.Daemon.Mounts) {
							b = appendClasses(b, m.Daemon.Mounts)
						}
					}
				}
			}
		}
	}
	return b
}

// DecodeBody decodes a Stats.
func (m *Stats) DecodeBody(b []byte) error {
	d := decoder{b: b}
	for _, p := range m.fields() {
		*p = d.u64("counter")
	}
	n := d.count("mount count", 0, maxMounts, 32)
	m.Mounts = nil
	if d.err == nil && n > 0 {
		m.Mounts = make([]MountStats, n)
		for i := range m.Mounts {
			mt := &m.Mounts[i]
			mt.Capacity = d.u64("capacity")
			mt.Used = d.u64("used")
			mt.Entries = d.u64("entries")
			mt.Direct = d.bool8("direct")
		}
	}
	n = d.count("device count", 0, MaxDevices, 32)
	m.Devices = nil
	if d.err == nil && n > 0 {
		m.Devices = make([]DeviceStats, n)
		for i := range m.Devices {
			dv := &m.Devices[i]
			dv.Ordinal = d.u32("device ordinal")
			d.zero(4)
			dv.Regions = d.u64("device regions")
			dv.Registered = d.u64("device registered bytes")
			dv.Limit = d.u64("device limit")
		}
	}
	m.Daemon, m.Spares, m.Tiering, m.StoresFailing, m.Namespaces = nil, nil, nil, nil, nil
	if d.err == nil && len(d.b) > 0 {
		m.Daemon = decodeDaemon(&d, len(m.Mounts))
	}
	if d.err == nil && len(d.b) > 0 {
		sp := &SpareStats{Reused: d.u64("reused files")}
		n := d.count("spare mount count", len(m.Mounts), len(m.Mounts), 16)
		if d.err == nil && n > 0 {
			sp.Mounts = make([]SpareMount, n)
			for i := range sp.Mounts {
				sp.Mounts[i] = SpareMount{Files: d.u64("spare files"), Bytes: d.u64("spare bytes")}
			}
		}
		m.Spares = sp
	}
	if d.err == nil && len(d.b) > 0 {
		n := d.count("identified device count", len(m.Devices), len(m.Devices), 16)
		for i := 0; d.err == nil && i < n; i++ {
			copy(m.Devices[i].UUID[:], d.take(16, "device UUID"))
		}
	}
	if d.err == nil && len(d.b) > 0 && m.Spares != nil {
		m.Spares.Made = d.u64("spare files made ahead")
	}
	if d.err == nil && len(d.b) > 0 && m.Spares != nil {
		n := d.count("faulted device count", len(m.Devices), len(m.Devices), 8)
		for i := 0; d.err == nil && i < n; i++ {
			m.Devices[i].Faults = d.u64("device faults")
		}
	}
	if d.err == nil && len(d.b) > 0 && m.Spares != nil {
		m.Tiering = decodeTiering(&d, len(m.Mounts))
		if m.Daemon != nil {
			m.Daemon.FallbackPolicy = m.Tiering.FallbackPolicy
		}
	}
	if d.err == nil && len(d.b) > 0 && m.Tiering != nil {
		n := d.count("failing mount count", len(m.Mounts), len(m.Mounts), 8+8+8+2)
		if d.err == nil {
			m.StoresFailing = make([]MountFailure, n)
			for i := range m.StoresFailing {
				f := &m.StoresFailing[i]
				f.Since, f.Last = d.i64("failing since"), d.i64("last failure")
				f.Stores = d.u64("failed stores")
				f.Err = d.str16("failure", maxDaemonText)
			}
		}
	}
	if d.err == nil && len(d.b) > 0 && m.StoresFailing != nil {
		m.Namespaces = decodeNamespaces(&d)
		if d.err == nil && len(d.b) > 0 {
			decodeCaches(&d, m.Namespaces)
		}
		if d.err == nil && len(d.b) > 0 {
			decodeBudgets(&d, m.Daemon)
		}
		if d.err == nil && len(d.b) > 0 {
			decodeClasses(&d, m.Daemon)
		}
	}
	// Bytes after the classes section are sections of a later daemon,
	// which this client does not know: ignored, so that growing the reply
	// never breaks a client (the sections before it are strict).
	return d.err
}

// hasClasses reports whether any of mounts has its device class set:
// the classes section is sent then.
func hasClasses(mounts []MountInfo) bool {
	for _, mt := range mounts {
		if mt.Class != "" {
			return true
		}
	}
	return false
}

// appendClasses encodes the classes section: u32 count (the daemon
// section's mounts) | per mount: str8 device class.
func appendClasses(b []byte, mounts []MountInfo) []byte {
	b = appendU32(b, uint32(len(mounts)))
	for _, mt := range mounts {
		b = appendStr8(b, mt.Class, maxClassName)
	}
	return b
}

// decodeClasses decodes the classes section into m's mounts (a reply of
// a daemon that predates it ends before it).
func decodeClasses(d *decoder, m *DaemonStats) {
	n := d.sectionCount("classes", "mounts", len(m.Mounts))
	for i := 0; d.err == nil && i < n; i++ {
		m.Mounts[i].Class = d.str8("mount class", maxClassName)
	}
}

// EmptyNamespacesBytes is the encoded size of a namespaces section that
// lists none, with the caches section after it: their counts and the
// left-out count.
const EmptyNamespacesBytes = 4 + 8 + 4

// NamespaceBytes is the encoded size of one namespace in a Stats reply's
// namespaces section and caches section.
func NamespaceBytes(ns NamespaceStats) int { return 5*8 + 1 + min(len(ns.Model), MaxModelLen) + 4 }

// appendNamespaces encodes the namespaces section and, after it, the
// caches section: u32 count (that of the namespaces listed) | per
// namespace: u32 caches.
func appendNamespaces(b []byte, nl *NamespaceList) []byte {
	list := nl.List[:min(len(nl.List), MaxStatsNamespaces)]
	b = appendU64(appendU32(b, uint32(len(list))), nl.LeftOut+uint64(len(nl.List)-len(list)))
	for _, ns := range list {
		b = appendU64(appendU64(appendU64(appendU64(b, ns.Fingerprint), ns.Files), ns.Keys), ns.Bytes)
		b = append(b, boolByte(ns.Declared), 0, 0, 0, 0, 0, 0, 0)
		b = appendStr8(b, ns.Model, MaxModelLen)
	}
	b = appendU32(b, uint32(len(list)))
	for _, ns := range list {
		b = appendU32(b, ns.Caches)
	}
	return b
}

// decodeCaches decodes the caches section into nl's namespaces (a reply
// of a daemon that predates it ends before it).
func decodeCaches(d *decoder, nl *NamespaceList) {
	n := d.sectionCount("caches", "namespaces", len(nl.List))
	for i := 0; d.err == nil && i < n; i++ {
		nl.List[i].Caches = d.u32("namespace caches")
	}
}

// appendBudgets encodes the budgets section of m.
func appendBudgets(b []byte, m *DaemonStats) []byte {
	list := m.Budgets[:min(len(m.Budgets), MaxStatsBudgets)]
	b = appendU64(appendU32(b, uint32(len(list))), m.BudgetsLeftOut+uint64(len(m.Budgets)-len(list)))
	for _, bs := range list {
		b = appendU64(appendU64(appendU64(appendU64(appendU64(b, bs.Used), bs.Budget), bs.Floor), bs.Over), bs.Kept)
		b = appendStr8(b, bs.Model, maxBudgetModel)
	}
	return b
}

// decodeBudgets decodes the budgets section into m (a reply of a daemon
// that predates it ends before it).
func decodeBudgets(d *decoder, m *DaemonStats) {
	n := d.count("budget count", 0, MaxStatsBudgets, 5*8+1)
	left := d.u64("budgets left out")
	if d.err != nil {
		return
	}
	list := make([]BudgetStats, n)
	for i := range list {
		bs := &list[i]
		bs.Used, bs.Budget, bs.Floor = d.u64("budget used"), d.u64("budget bytes"), d.u64("budget floor")
		bs.Over, bs.Kept = d.u64("budget over evictions"), d.u64("budget floor skips")
		bs.Model = d.str8("budget model", maxBudgetModel)
	}
	if d.err == nil {
		m.Budgets, m.BudgetsLeftOut = list, left
	}
}

func decodeNamespaces(d *decoder) *NamespaceList {
	n := d.count("namespace count", 0, MaxStatsNamespaces, 5*8+1)
	nl := &NamespaceList{LeftOut: d.u64("namespaces left out")}
	for i := 0; d.err == nil && i < n; i++ {
		ns := NamespaceStats{Fingerprint: d.u64("namespace fingerprint"), Files: d.u64("namespace files"),
			Keys: d.u64("namespace keys"), Bytes: d.u64("namespace bytes")}
		ns.Declared = d.bool8("namespace declared")
		ns.Model = d.str8("namespace model", MaxModelLen)
		nl.List = append(nl.List, ns)
	}
	return nl
}

// Outcome is what happened to one key of a job, sent to the client in a
// Completion: the vocabulary's (outcome.Outcome), which the engine
// speaks too. The values are on the wire.
type Outcome = outcome.Outcome

// Outcomes of a key in a job (outcome.Pending, ...: documented there).
const (
	OutcomePending     = outcome.Pending     // not finished; never in a Completion
	OutcomeStored      = outcome.Stored      // written and published
	OutcomePresent     = outcome.Present     // already stored; nothing written
	OutcomeNotAdmitted = outcome.NotAdmitted // the policy declined the key
	OutcomeLoaded      = outcome.Loaded      // read into its blocks and verified
	OutcomeMissing     = outcome.Missing     // not stored; its blocks not written
	OutcomeFailed      = outcome.Failed      // failed (the Completion's Code says why)
	OutcomeCancelled   = outcome.Cancelled   // the job was cancelled before the key was done
)

// KeyOutcome is the outcome of one key and, when it failed, an error code.
type KeyOutcome struct {
	Outcome Outcome // what happened to the key
	Code    Code    // CodeOK unless Outcome is OutcomeFailed or OutcomeCancelled, never CodeOK then
}

// Completion ends a job: one outcome per request key, in request order.
type Completion struct {
	Job      uint64       // the job's id, from its JobAccepted
	Kind     JobKind      // JobStore or JobLoad
	Bytes    uint64       // payload bytes moved
	Duration uint64       // nanoseconds from submission to completion
	Keys     []KeyOutcome // one per request key, in request order
	Message  string       // the first failure's text, at most MaxMessage bytes
}

// Type is TypeCompletion.
func (*Completion) Type() Type { return TypeCompletion }

// AppendBody encodes: u64 job | u8 kind | 3 × 0 | u32 key count | u64 bytes
// | u64 duration ns | per key: u8 outcome, u8 code | str16 message.
func (m *Completion) AppendBody(b []byte) []byte {
	b = appendU64(b, m.Job)
	b = append(b, uint8(m.Kind), 0, 0, 0)
	b = appendU32(b, uint32(len(m.Keys)))
	b = appendU64(appendU64(b, m.Bytes), m.Duration)
	for _, k := range m.Keys {
		b = append(b, uint8(k.Outcome), uint8(k.Code))
	}
	return appendStr16(b, m.Message, MaxMessage)
}

// DecodeBody decodes a Completion.
func (m *Completion) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.Job = d.u64("job")
	m.Kind = JobKind(d.u8("kind"))
	d.zero(3)
	n := int(d.u32("key count"))
	m.Bytes = d.u64("bytes")
	m.Duration = d.u64("duration")
	if d.err == nil {
		switch {
		case m.Kind != JobStore && m.Kind != JobLoad:
			d.fail("job kind %d", m.Kind)
		case n < 1 || n > MaxKeysPerRequest || 2*n > len(d.b):
			d.fail("key count %d", n)
		}
	}
	if d.err == nil {
		m.Keys = make([]KeyOutcome, n)
		for i := range m.Keys {
			m.Keys[i].Outcome = Outcome(d.u8("outcome"))
			m.Keys[i].Code = Code(d.u8("code"))
			o, code := m.Keys[i].Outcome, m.Keys[i].Code
			// Any code (a newer daemon's too), but one: a key never ends
			// pending, nor failed or cancelled without saying why.
			if d.err == nil && (o == OutcomePending || o > OutcomeCancelled || o >= OutcomeFailed && code == CodeOK) {
				d.fail("key %d: outcome %d code %d", i, o, code)
			}
		}
	}
	m.Message = d.str16("message", MaxMessage)
	return d.end()
}

// decodeTiering decodes the tiering section of a Stats reply with mounts
// mounts.
func decodeTiering(d *decoder, mounts int) *TierStats {
	t := &TierStats{Demotions: d.u64("demotions"), Promotions: d.u64("promotions"), Moves: d.u64("moves"),
		MoveFailures: d.u64("move failures"), DemotionDeletes: d.u64("demotion deletes")}
	n := d.count("tier mount count", mounts, mounts, 16)
	if d.err == nil && n > 0 {
		t.Mounts = make([]TierMount, n)
		for i := range t.Mounts {
			t.Mounts[i] = TierMount{MovedIn: d.u64("moved in"), MovedOut: d.u64("moved out")}
		}
	}
	t.FallbackPolicy = d.str8("fallback policy", MaxName)
	return t
}
