package abi

// Sizes of the records, in bytes. Offsets are given in docs/abi.md and checked
// by abi_test.go.
const (
	NamespaceRecordSize = 256
	NameRecordSize      = 368
	AdmitRecordSize     = 40
	AccessRecordSize    = 48
	EvictHeaderSize     = 32
	VictimSize          = 16
	MountRecordSize     = 128
	VictimTargetSize    = 8
	TickHeaderSize      = 32
	MoveSize            = 16
	RankRecordSize      = 32
)

// NamespaceRecord describes one model namespace: a model, its KV-cache
// geometry and its tensor-parallel rank. The host writes it at scratch offset 0
// before calling kvhost_namespace; the guest fills KeysPerFile and Order.
type NamespaceRecord struct {
	NS             uint32 // host-assigned namespace id, small and dense
	Flags          uint32 // NamespaceMLA, ...
	Fingerprint    uint64 // stable hash of the whole geometry and model id
	Layers         uint32 // model layers
	KVHeads        uint32 // KV heads on this rank (1 for MLA's latent)
	HeadSize       uint32 // elements per head
	DtypeSize      uint32 // bytes per element
	TokensPerBlock uint32 // tokens in one GPU (paged) block
	TokensPerKey   uint32 // tokens covered by one key
	TPRank         uint32 // tensor-parallel rank, < TPSize
	TPSize         uint32 // tensor-parallel size
	MountCount     uint32 // number of mounts configured
	ModelLen       uint32 // bytes used in Model
	KeyBytes       uint64 // payload bytes of one key
	// Model is the model id, ModelLen bytes used.
	Model [MaxModelLen]byte

	// Output.
	KeysPerFile uint32 // 1..MaxKeysPerFile keys share one file
	Order       uint32 // OrderLayerMajor or OrderBlockMajor
	_           [56]byte
}

// ModelID returns the model id as a byte slice into the record.
func (r *NamespaceRecord) ModelID() []byte { return r.Model[:min(int(r.ModelLen), MaxModelLen)] }

// SetModelID copies id into the record, truncating it to MaxModelLen.
func (r *NamespaceRecord) SetModelID(id string) {
	r.ModelLen = uint32(copy(r.Model[:], id))
}

// NameRecord asks for the file name of one key. The host fills the input
// fields; the guest writes Mount, PathLen and Path.
type NameRecord struct {
	NS          uint32 // namespace id
	KeyLen      uint32 // bytes used in KeyBuf, 1..MaxKeyLen
	KeyHash     uint64 // KeyHash(Key())
	Fingerprint uint64 // NamespaceRecord.Fingerprint of NS
	TPRank      uint32 // NamespaceRecord.TPRank of NS
	MountCount  uint32 // number of mounts configured (>= 1)
	// KeyBuf holds the key, KeyLen bytes used.
	KeyBuf [MaxKeyLen]byte

	// Output.
	Mount   uint32 // index of the mount, < MountCount
	PathLen uint32 // bytes used in PathBuf, 1..MaxPathLen
	_       uint64
	PathBuf [MaxPathLen]byte // relative path under the mount's root
}

// Key returns the key as a byte slice into the record.
func (r *NameRecord) Key() []byte { return r.KeyBuf[:min(int(r.KeyLen), MaxKeyLen)] }

// Path returns the output path as a byte slice into the record.
func (r *NameRecord) Path() []byte { return r.PathBuf[:min(int(r.PathLen), MaxPathLen)] }

// SetKey copies key into the record and sets KeyLen and KeyHash.
func (r *NameRecord) SetKey(key []byte) {
	r.KeyLen = uint32(copy(r.KeyBuf[:], key))
	r.KeyHash = KeyHash(key)
}

// AdmitRecord asks whether one key should be stored. The guest writes Admit.
type AdmitRecord struct {
	KeyHash uint64 // KeyHash of the file's first key
	Size    uint64 // bytes the file will take
	Time    uint64 // Unix nanoseconds
	NS      uint32 // namespace id
	Mount   uint32 // the mount the name hook chose

	// Output.
	Admit uint32 // 1: store it; 0: skip it
	// Target is, with FeatureAdmitMount, the mount the file is written to:
	// the host writes Mount into it before the call and the guest may
	// change it (< the number of mounts). Without the feature the host
	// writes 0 and ignores it.
	Target uint32
}

// Access kinds (AccessRecord.Kind).
const (
	// AccessInsert: the entry was stored and published.
	AccessInsert uint32 = 1
	// AccessHit: the entry was found by a lookup or loaded.
	AccessHit uint32 = 2
	// AccessRemove: the entry is gone (evicted, deleted, or found missing or
	// corrupt); its handle will not be used again.
	AccessRemove uint32 = 3
	// AccessRestore: the entry already exists; sent when an instance is
	// (re)built from the host's index. Time is its last access, Hits its
	// access count.
	AccessRestore uint32 = 4
	// AccessPin: a load pinned the entry; it must not be a victim until a
	// matching AccessUnpin. Pins nest.
	AccessPin uint32 = 5
	// AccessUnpin releases one AccessPin.
	AccessUnpin uint32 = 6
)

// AccessRecord reports one event on one stored entry (a file). No output.
type AccessRecord struct {
	Entry   uint64 // host-assigned handle, unique for the life of the host
	Time    uint64 // Unix nanoseconds
	Size    uint64 // bytes on disk
	KeyHash uint64 // KeyHash of the entry's first key
	Kind    uint32 // Access*
	Mount   uint32 // index of the entry's mount
	NS      uint32 // namespace id; may be one kvhost_namespace was not called for
	Hits    uint32 // AccessRestore: accesses known to the host
}

// EvictRequest is the header of a kvhost_evict call, at scratch offset 0.
type EvictRequest struct {
	Bytes uint64 // bytes to free
	Time  uint64 // Unix nanoseconds
	Mount uint32 // victims must be on this mount, or AnyMount
	_     uint32
	_     uint64
}

// Victim is one eviction candidate the guest writes after the EvictRequest.
// The host removes victims in ascending Score order across all instances.
type Victim struct {
	Entry uint64 // handle of an entry to remove, as in AccessRecord
	Score uint64 // lower is evicted first
}

// Device classes of a mount (MountRecord.Class), fastest first.
const (
	ClassUnknown uint32 = 0
	ClassMemory  uint32 = 1 // tmpfs, ramfs
	ClassNVMe    uint32 = 2
	ClassSSD     uint32 = 3 // a non-rotational block device that is not NVMe
	ClassHDD     uint32 = 4 // a rotational block device
	ClassNetwork uint32 = 5 // NFS, Lustre, GPFS, CephFS, BeeGFS, SMB, FUSE
)

// Mount flags (MountRecord.Flags).
const (
	MountDirect    uint32 = 1 << 0 // files are written with O_DIRECT
	MountChecksums uint32 = 1 << 1 // payload checksums are written and checked
	MountVLLMFS    uint32 = 1 << 2 // a vllm-fs mount: not a target of kvhost_name, admission or moves
	// MountObject: the object mount (an S3 bucket), described last: a
	// target of admission and of demotion at eviction only, never of
	// kvhost_name or a tick's move (docs/abi.md, "Tiering").
	MountObject uint32 = 1 << 3
)

// MountRecord describes one mount (kvhost_mounts, FeatureMounts). Sizes are
// bytes; the host sends every mount in each call, in index order.
type MountRecord struct {
	Mount    uint32 // index, as in NameRecord.Mount
	Flags    uint32 // Mount*
	Capacity uint64 // the most bytes of files the host keeps on the mount
	Used     uint64 // bytes of files (and stores in flight) on it now
	Free     uint64 // Capacity - Used (0 when over)
	High     uint64 // usage that starts eviction
	Low      uint64 // usage eviction brings it down to
	Entries  uint64 // files on the mount
	Class    uint32 // Class*
	FSType   uint32 // statfs f_type magic (0xEF53 ext4, 0x58465342 xfs, 0x01021994 tmpfs, 0x6969 nfs, ...)
	// FSName is the file system's name (xfs, nfs, ...), NUL-padded; empty
	// when unknown.
	FSName [16]byte
	// Backend is the host's data mover (staging, gds, ...), NUL-padded.
	Backend [16]byte
	_       [32]byte
}

// FSNameString returns FSName up to its first NUL.
func (r *MountRecord) FSNameString() string { return cstr(r.FSName[:]) }

// BackendString returns Backend up to its first NUL.
func (r *MountRecord) BackendString() string { return cstr(r.Backend[:]) }

func cstr(b []byte) string {
	for i, c := range b {
		if c == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}

// Victim target flags (VictimTarget.Flags, Move.Flags).
const (
	// MoveDeleteIfFull: when the target mount has no room even after its own
	// eviction, delete the victim instead (VictimTarget only; without it
	// the victim stays where it is and frees nothing).
	MoveDeleteIfFull uint32 = 1 << 0
)

// VictimTarget says what to do with victim i of kvhost_evict
// (FeatureDemote): Mount NoMount (what the host writes before the call)
// deletes it, any other mount moves its file there.
type VictimTarget struct {
	Mount uint32 // NoMount deletes the victim; another mount moves its file there
	Flags uint32 // MoveDeleteIfFull or 0
}

// TickRequest is the header of a kvhost_tick call, at scratch offset 0
// (FeatureTick).
type TickRequest struct {
	Time uint64 // Unix nanoseconds
	// Interval is the host's tick period, in nanoseconds.
	Interval uint64
	_        uint64
	_        uint64
}

// Move asks the host to move an entry's file to another mount: kvhost_tick
// output, from offset TickHeaderSize.
type Move struct {
	Entry uint64 // handle of the entry to move, as in AccessRecord
	Mount uint32 // the target mount
	Flags uint32 // reserved: write 0
}

// States of a RankRecord (RankRecord.State).
const (
	// RankKnown: the plugin ranked the entry (RankRecord.Rank holds it).
	RankKnown uint32 = 0
	// RankUnknown: the plugin does not know the entry (it was not told of
	// it yet); the host ranks it by its own last access time.
	RankUnknown uint32 = 1
	// RankUnset is what the host writes into State before the call: a
	// hook that leaves it fails.
	RankUnset uint32 = 0xFFFFFFFF
)

// RankRecord asks for the eviction rank of one entry (kvhost_rank,
// FeatureRank). The host fills Entry and Time; the guest writes Rank and
// State. Ranks are compared across nodes that share a mount: a rank must
// depend only on the entry's access history and Time, never on this
// instance (handles, shard, position in a list, counts of entries); see
// docs/abi.md.
type RankRecord struct {
	Entry uint64 // handle of the entry, as in AccessRecord
	Time  uint64 // now, Unix nanoseconds; the same in every record of a call

	// Output.
	Rank  uint64 // lower is evicted first, on the scale of Unix nanoseconds
	State uint32 // RankKnown or RankUnknown; the host writes RankUnset
	_     uint32
}

// KeyHash is the 64-bit FNV-1a hash of key, the KeyHash field of records.
func KeyHash(key []byte) uint64 {
	const (
		offset = 14695981039346656037
		prime  = 1099511628211
	)
	h := uint64(offset)
	for _, c := range key {
		h ^= uint64(c)
		h *= prime
	}
	return h
}
