// Package abi is version 1 of the kvhost policy plugin ABI: the names of the
// functions a plugin exports and imports, the fixed-width little-endian records
// exchanged through the plugin's scratch area, the status codes and the feature
// bits.
//
// The package is shared by the host (host/policy) and the Go guest SDK
// (abi/guest). It has no dependencies and builds for GOOS=wasip1 GOARCH=wasm.
// docs/abi.md is the normative, language-neutral description of the same
// contract; the record structs here are laid out exactly as that document says
// (abi_test.go checks every offset).
//
// # Record layout
//
// Records are Go structs whose fields are naturally aligned, so that on a
// little-endian machine (wasm, amd64, arm64) a byte slice holding N records can
// be viewed as a []T without copying. The host never trusts a record it reads
// back: every output field is validated before it is used.
package abi

// Version is the ABI version this package describes. A plugin's
// kvhost_abi_version export must return it.
const Version = 1

// ImportModule is the wasm module name of the host functions a plugin may import.
const ImportModule = "kvhost"

// Names of the functions a plugin exports.
const (
	ExportMemory     = "memory"
	ExportABIVersion = "kvhost_abi_version" // () -> i32
	ExportFeatures   = "kvhost_features"    // () -> i64
	ExportScratch    = "kvhost_scratch"     // (min_bytes i32) -> i32 pointer
	ExportInit       = "kvhost_init"        // (config_len i32) -> i32 status
	ExportNamespace  = "kvhost_namespace"   // () -> i32 status, FeatureNamespace
	ExportName       = "kvhost_name"        // (n i32) -> i32 status
	ExportAdmit      = "kvhost_admit"       // (n i32) -> i32 status, FeatureAdmit
	ExportAccess     = "kvhost_access"      // (n i32) -> i32 status
	ExportEvict      = "kvhost_evict"       // (max i32) -> i32 count or status
	ExportMounts     = "kvhost_mounts"      // (n i32) -> i32 status, FeatureMounts
	ExportTick       = "kvhost_tick"        // (max i32) -> i32 count or status, FeatureTick
	ExportRank       = "kvhost_rank"        // (n i32) -> i32 status, FeatureRank
)

// Names of the host functions in ImportModule.
const (
	// ImportLog is log(level i32, ptr i32, len i32): a UTF-8 message at a
	// log/slog level (-4 debug, 0 info, 4 warn, 8 error). The host truncates
	// long messages and drops messages beyond a rate limit.
	ImportLog = "log"
)

// Feature is a bit set of optional hooks and behaviours a plugin declares
// through kvhost_features.
type Feature uint64

// Feature bits defined by ABI v1. Bits not named here must be zero.
const (
	// FeatureNamespace: the plugin exports kvhost_namespace and chooses the
	// chunk layout of each namespace. Without it the host uses DefaultLayout.
	FeatureNamespace Feature = 1 << 0
	// FeatureAdmit: the plugin exports kvhost_admit and may decline stores.
	// Without it every store is admitted.
	FeatureAdmit Feature = 1 << 1
	// FeatureMounts: the plugin exports kvhost_mounts and receives a
	// MountRecord per mount after kvhost_init and whenever a mount's
	// description changes (at most once per the host's update interval).
	FeatureMounts Feature = 1 << 2
	// FeatureAdmitMount: kvhost_admit may send a file to another mount than
	// the one kvhost_name chose, through AdmitRecord.Target. It requires
	// FeatureAdmit.
	FeatureAdmitMount Feature = 1 << 3
	// FeatureDemote: kvhost_evict may write a VictimTarget per victim, from
	// EvictTargetsOffset: the host then moves the victim's file to that
	// mount instead of deleting it.
	FeatureDemote Feature = 1 << 4
	// FeatureTick: the plugin exports kvhost_tick, which the host calls
	// periodically (at a rate it sets) with the time; the plugin may answer
	// with Moves of entries between mounts.
	FeatureTick Feature = 1 << 5
	// FeatureRank: the plugin exports kvhost_rank, which gives entries an
	// eviction rank comparable across nodes (RankRecord): the host uses it
	// to bound a mount that several nodes share. Without it the host ranks
	// an entry by its last access time.
	FeatureRank Feature = 1 << 6

	// KnownFeatures is every feature bit ABI v1 defines.
	KnownFeatures = FeatureNamespace | FeatureAdmit | FeatureMounts | FeatureAdmitMount | FeatureDemote | FeatureTick | FeatureRank
)

// Has reports whether every bit of g is set in f.
func (f Feature) Has(g Feature) bool { return f&g == g }

// String lists the named features, for humans.
func (f Feature) String() string {
	s := ""
	add := func(name string) {
		if s != "" {
			s += ","
		}
		s += name
	}
	if f.Has(FeatureNamespace) {
		add("namespace")
	}
	if f.Has(FeatureAdmit) {
		add("admit")
	}
	if f.Has(FeatureMounts) {
		add("mounts")
	}
	if f.Has(FeatureAdmitMount) {
		add("admit-mount")
	}
	if f.Has(FeatureDemote) {
		add("demote")
	}
	if f.Has(FeatureTick) {
		add("tick")
	}
	if f.Has(FeatureRank) {
		add("rank")
	}
	if rest := f &^ KnownFeatures; rest != 0 {
		add("unknown(0x" + hex64(uint64(rest)) + ")")
	}
	if s == "" {
		return "none"
	}
	return s
}

// Status is the i32 a hook returns. Zero and positive values mean success
// (kvhost_evict returns the number of victims it wrote); negative values are
// failures, and the host treats any failure as a failure of the instance.
type Status int32

// Status codes defined by ABI v1.
const (
	StatusOK           Status = 0
	StatusInvalidInput Status = -1 // the guest rejected a record the host sent
	StatusNoMemory     Status = -2 // the guest could not allocate
	StatusUnsupported  Status = -3 // hook or configuration not supported
	StatusInternal     Status = -4 // any other guest failure
)

// String names the status.
func (s Status) String() string {
	switch s {
	case StatusOK:
		return "ok"
	case StatusInvalidInput:
		return "invalid input"
	case StatusNoMemory:
		return "no memory"
	case StatusUnsupported:
		return "unsupported"
	case StatusInternal:
		return "internal error"
	}
	if s > 0 {
		return "ok(" + itoa(int64(s)) + ")"
	}
	return "status(" + itoa(int64(s)) + ")"
}

// Limits of ABI v1.
const (
	// MaxKeyLen is the longest key, in bytes.
	MaxKeyLen = 64
	// MaxPathLen is the longest relative path a plugin may return.
	MaxPathLen = 256
	// MaxModelLen is the longest model id passed in a NamespaceRecord.
	MaxModelLen = 128
	// MaxBatch is the most records the host passes in one call.
	MaxBatch = 1024
	// MaxConfigLen is the longest configuration passed to kvhost_init.
	MaxConfigLen = 64 << 10
	// ScratchAlign is the alignment the scratch pointer must have.
	ScratchAlign = 8
	// ScratchSize is the min_bytes the host passes to kvhost_scratch in v1:
	// room for the largest batch of any hook, MaxBatch NameRecords (376,832
	// bytes). Every other input fits in it: MaxBatch AccessRecords or
	// AdmitRecords, the EvictRequest with MaxBatch Victims, MaxConfigLen
	// bytes of configuration.
	ScratchSize = MaxBatch * NameRecordSize
	// AnyMount in EvictRequest.Mount means victims may come from any mount.
	AnyMount = 0xFFFFFFFF
	// NoMount in VictimTarget.Mount means "delete the victim" (the default
	// the host writes before kvhost_evict).
	NoMount = 0xFFFFFFFF
	// EvictTargetsOffset is where, with FeatureDemote, the VictimTarget of
	// victim i lies: EvictTargetsOffset + i*VictimTargetSize, after room for
	// MaxBatch victims.
	EvictTargetsOffset = EvictHeaderSize + MaxBatch*VictimSize
	// MaxMounts is the most mounts a host describes (kvhost_mounts' n).
	MaxMounts = 64
)

// Layout orders of a chunk file (NamespaceRecord.Order).
const (
	// OrderLayerMajor stores, for each layer, every block of every key in the
	// file: a loader can stream layer by layer.
	OrderLayerMajor uint32 = 0
	// OrderBlockMajor stores, for each GPU block, every layer: the layout of
	// vLLM's FS offload tier and llm-d's fs connector.
	OrderBlockMajor uint32 = 1
)

// Namespace flags (NamespaceRecord.Flags).
const (
	// NamespaceMLA: the model stores one latent plane per layer instead of K and V.
	NamespaceMLA uint32 = 1 << 0
)

// DefaultKeysPerFile and DefaultOrder are the layout used for a namespace when
// the plugin has no kvhost_namespace hook.
const (
	DefaultKeysPerFile = 1
	DefaultOrder       = OrderLayerMajor
	// MaxKeysPerFile bounds NamespaceRecord.KeysPerFile.
	MaxKeysPerFile = 256
)

func itoa(v int64) string {
	if v == 0 {
		return "0"
	}
	neg := v < 0
	if neg {
		v = -v
	}
	var b [20]byte
	i := len(b)
	for v > 0 {
		i--
		b[i] = byte('0' + v%10)
		v /= 10
	}
	if neg {
		i--
		b[i] = '-'
	}
	return string(b[i:])
}

func hex64(v uint64) string {
	const digits = "0123456789abcdef"
	if v == 0 {
		return "0"
	}
	var b [16]byte
	i := len(b)
	for v > 0 {
		i--
		b[i] = digits[v&15]
		v >>= 4
	}
	return string(b[i:])
}
