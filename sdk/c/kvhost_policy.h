/*
 * kvhost_policy.h - the kvhost policy plugin ABI, version 1, for C.
 *
 * A kvhost policy plugin is a WebAssembly module that names KV-cache files,
 * tracks the entries stored and picks eviction victims. docs/abi.md is the
 * normative contract; this header is the same contract as C declarations:
 * the records exchanged through the plugin's scratch area (with their
 * offsets checked at compile time), the status codes, the feature bits,
 * the access kinds, the limits, the one host import and the hooks a plugin
 * exports.
 *
 * It needs no libc and no WASI: build a plugin freestanding with clang,
 *
 *   clang --target=wasm32 -O2 -nostdlib -ffreestanding -mbulk-memory \
 *     -I sdk/c -Wl,--no-entry -o policy.wasm policy.c
 *
 * and define each hook with KVHOST_EXPORT, which exports it under its ABI
 * name. wasm-ld exports the linear memory as "memory", as the ABI requires.
 * examples/c-policy/policy.c is a complete plugin.
 *
 * All integers are little-endian (wasm is little-endian) and naturally
 * aligned; "out" fields are written by the plugin and zeroed (admit: set to
 * 0xFFFFFFFF) by the host before the call; "reserved" fields are zero and
 * must be ignored.
 */
#ifndef KVHOST_POLICY_H
#define KVHOST_POLICY_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ABI version: kvhost_abi_version must return it. */
#define KVHOST_ABI_VERSION 1

/* Limits of ABI v1. */
#define KVHOST_MAX_KEY_LEN 64           /* keys are 1..64 bytes, never empty */
#define KVHOST_MAX_PATH_LEN 256         /* a returned path is 1..256 bytes */
#define KVHOST_MAX_MODEL_LEN 128        /* model id bytes in a namespace */
#define KVHOST_MAX_BATCH 1024           /* records per call: n and max are 1..1024 */
#define KVHOST_MAX_CONFIG_LEN (64 << 10) /* bytes of configuration */
#define KVHOST_MAX_KEYS_PER_FILE 256
#define KVHOST_SCRATCH_ALIGN 8
/* The min_bytes the host passes to kvhost_scratch in v1 (1024 x 368). A
 * plugin honours its argument: a later host may ask for more. */
#define KVHOST_SCRATCH_SIZE 376832
/* EvictRequest.mount meaning "victims may be on any mount". */
#define KVHOST_ANY_MOUNT 0xFFFFFFFFu
/* Offset of the first Victim in the scratch area during kvhost_evict. */
#define KVHOST_VICTIMS_OFFSET 32
/* With KVHOST_FEATURE_DEMOTE: offset of the first kvhost_victim_target
 * during kvhost_evict (after room for KVHOST_MAX_BATCH victims). */
#define KVHOST_VICTIM_TARGETS_OFFSET (32 + 1024 * 16)
/* With KVHOST_FEATURE_TICK: offset of the first kvhost_move during
 * kvhost_tick, after the kvhost_tick_request at offset 0. */
#define KVHOST_MOVES_OFFSET 32
/* kvhost_victim_target.mount meaning "delete the victim" (the default). */
#define KVHOST_NO_MOUNT 0xFFFFFFFFu
/* The most mounts kvhost_mounts describes. */
#define KVHOST_MAX_MOUNTS 64

/* Feature bits returned by kvhost_features. Every other bit must be zero. */
#define KVHOST_FEATURE_NAMESPACE (UINT64_C(1) << 0) /* exports kvhost_namespace */
#define KVHOST_FEATURE_ADMIT (UINT64_C(1) << 1)     /* exports kvhost_admit */
/* Tiering (docs/abi.md, "Tiering"): */
#define KVHOST_FEATURE_MOUNTS (UINT64_C(1) << 2)      /* exports kvhost_mounts */
#define KVHOST_FEATURE_ADMIT_MOUNT (UINT64_C(1) << 3) /* kvhost_admit writes target (needs ADMIT) */
#define KVHOST_FEATURE_DEMOTE (UINT64_C(1) << 4)      /* kvhost_evict writes victim targets */
#define KVHOST_FEATURE_TICK (UINT64_C(1) << 5)        /* exports kvhost_tick */
/* Cluster-wide capacity (docs/abi.md, "RankRecord"): */
#define KVHOST_FEATURE_RANK (UINT64_C(1) << 6) /* exports kvhost_rank */

/* Status codes: every hook returns one; kvhost_evict returns a count >= 0
 * instead of KVHOST_STATUS_OK. A negative status is a failure of the
 * instance: log the reason with kvhost_log first. */
#define KVHOST_STATUS_OK 0
#define KVHOST_STATUS_INVALID_INPUT (-1)
#define KVHOST_STATUS_NO_MEMORY (-2)
#define KVHOST_STATUS_UNSUPPORTED (-3)
#define KVHOST_STATUS_INTERNAL (-4)

/* Access kinds (kvhost_access_record.kind). The host sends only these. */
#define KVHOST_ACCESS_INSERT 1  /* stored and visible */
#define KVHOST_ACCESS_HIT 2     /* found by a lookup or loaded */
#define KVHOST_ACCESS_REMOVE 3  /* gone; the handle is never used again */
#define KVHOST_ACCESS_RESTORE 4 /* exists; sent while an instance is built */
#define KVHOST_ACCESS_PIN 5     /* in use by a load: not a victim until UNPIN */
#define KVHOST_ACCESS_UNPIN 6   /* releases one PIN */

/* Namespace flags (kvhost_namespace_record.flags). */
#define KVHOST_NAMESPACE_MLA (1u << 0) /* one latent plane per layer */

/* Chunk layout orders (kvhost_namespace_record.order). */
#define KVHOST_ORDER_LAYER_MAJOR 0
#define KVHOST_ORDER_BLOCK_MAJOR 1

/* Device classes (kvhost_mount_record.device_class), fastest first. */
#define KVHOST_CLASS_UNKNOWN 0
#define KVHOST_CLASS_MEMORY 1
#define KVHOST_CLASS_NVME 2
#define KVHOST_CLASS_SSD 3
#define KVHOST_CLASS_HDD 4
#define KVHOST_CLASS_NETWORK 5

/* Mount flags (kvhost_mount_record.flags). */
#define KVHOST_MOUNT_DIRECT (1u << 0)    /* O_DIRECT */
#define KVHOST_MOUNT_CHECKSUMS (1u << 1) /* payload checksums */
#define KVHOST_MOUNT_VLLMFS (1u << 2)    /* a vllm-fs mount: never a target */
#define KVHOST_MOUNT_OBJECT (1u << 3)    /* the object mount: admission and demotion targets only */

/* kvhost_victim_target.flags */
#define KVHOST_MOVE_DELETE_IF_FULL (1u << 0) /* delete if the target has no room */

/* Log levels of kvhost_log (log/slog levels). */
#define KVHOST_LOG_DEBUG (-4)
#define KVHOST_LOG_INFO 0
#define KVHOST_LOG_WARN 4
#define KVHOST_LOG_ERROR 8

/* NamespaceRecord, 256 bytes: one at scratch offset 0 for kvhost_namespace. */
typedef struct kvhost_namespace_record {
	uint32_t ns;    /* namespace id: per process, not stable across restarts */
	uint32_t flags; /* KVHOST_NAMESPACE_MLA */
	uint64_t fingerprint; /* stable: model id, geometry, tp rank and size */
	uint32_t layers;
	uint32_t kv_heads;
	uint32_t head_size;
	uint32_t dtype_size;       /* bytes per element */
	uint32_t tokens_per_block; /* tokens in one GPU (paged) block */
	uint32_t tokens_per_key;   /* tokens covered by one key */
	uint32_t tp_rank;
	uint32_t tp_size;
	uint32_t mount_count; /* mounts configured */
	uint32_t model_len;   /* bytes used in model */
	uint64_t key_bytes;   /* payload bytes of one key */
	uint8_t model[KVHOST_MAX_MODEL_LEN];
	uint32_t keys_per_file; /* out: 1..256 (the host fills 1 before the call) */
	uint32_t order;         /* out: KVHOST_ORDER_* (the host fills 0) */
	uint8_t reserved[56];
} kvhost_namespace_record;

/* NameRecord, 368 bytes: n of them from scratch offset 0 for kvhost_name. */
typedef struct kvhost_name_record {
	uint32_t ns;
	uint32_t key_len;  /* 1..64 */
	uint64_t key_hash; /* FNV-1a 64 of the key bytes */
	uint64_t fingerprint;
	uint32_t tp_rank;
	uint32_t mount_count; /* >= 1 */
	uint8_t key[KVHOST_MAX_KEY_LEN];
	uint32_t mount;    /* out: < mount_count */
	uint32_t path_len; /* out: 1..256 */
	uint64_t reserved;
	uint8_t path[KVHOST_MAX_PATH_LEN]; /* out: [A-Za-z0-9._-/], relative, no
	                                      empty or '.'-led component */
} kvhost_name_record;

/* AdmitRecord, 40 bytes: n of them from offset 0 for kvhost_admit. One
 * record is one file: key_hash of its first key, size of the whole file. */
typedef struct kvhost_admit_record {
	uint64_t key_hash;
	uint64_t size; /* bytes the file will take */
	uint64_t time; /* now, Unix nanoseconds */
	uint32_t ns;
	uint32_t mount; /* the mount kvhost_name chose */
	uint32_t admit; /* out: 1 store, 0 skip; anything else fails */
	uint32_t target; /* with KVHOST_FEATURE_ADMIT_MOUNT: in/out, the mount the
	                    file goes to (the host writes mount); else reserved, 0 */
} kvhost_admit_record;

/* AccessRecord, 48 bytes: n of them from offset 0 for kvhost_access. */
typedef struct kvhost_access_record {
	uint64_t entry;    /* handle, unique for the life of the host process */
	uint64_t time;     /* Unix nanoseconds (RESTORE: the last access) */
	uint64_t size;     /* bytes on disk */
	uint64_t key_hash; /* of the entry's first key */
	uint32_t kind;     /* KVHOST_ACCESS_* */
	uint32_t mount;
	uint32_t ns; /* may be a namespace never declared (files found at start) */
	uint32_t hits; /* RESTORE: accesses the host knows of */
} kvhost_access_record;

/* EvictRequest, 32 bytes at offset 0 for kvhost_evict. */
typedef struct kvhost_evict_request {
	uint64_t bytes; /* bytes the host wants to free */
	uint64_t time;  /* now */
	uint32_t mount; /* victims must be on it, or KVHOST_ANY_MOUNT */
	uint32_t reserved0;
	uint64_t reserved1;
} kvhost_evict_request;

/* Victim, 16 bytes each from offset 32: the output of kvhost_evict. */
typedef struct kvhost_victim {
	uint64_t entry; /* known, unpinned, on the mount, listed once */
	uint64_t score; /* lower is removed first; comparable across shards */
} kvhost_victim;

/* MountRecord, 128 bytes: n of them (every mount, in index order) from
 * offset 0 for kvhost_mounts. Sizes are bytes. */
typedef struct kvhost_mount_record {
	uint32_t mount; /* index */
	uint32_t flags; /* KVHOST_MOUNT_* */
	uint64_t capacity;
	uint64_t used;
	uint64_t free; /* capacity - used, 0 when over */
	uint64_t high; /* usage that starts eviction */
	uint64_t low;  /* usage eviction brings it down to */
	uint64_t entries;
	uint32_t device_class; /* KVHOST_CLASS_* (not "class": C++) */
	uint32_t fs_type; /* statfs f_type */
	uint8_t fs_name[16]; /* "xfs", "nfs"...: NUL-padded */
	uint8_t backend[16]; /* the host's data mover: NUL-padded */
	uint8_t reserved[32];
} kvhost_mount_record;

/* VictimTarget, 8 bytes each from KVHOST_VICTIM_TARGETS_OFFSET, with
 * KVHOST_FEATURE_DEMOTE: what to do with victim i. */
typedef struct kvhost_victim_target {
	uint32_t mount; /* KVHOST_NO_MOUNT (written by the host): delete; else move there */
	uint32_t flags; /* KVHOST_MOVE_DELETE_IF_FULL */
} kvhost_victim_target;

/* TickRequest, 32 bytes at offset 0 for kvhost_tick. */
typedef struct kvhost_tick_request {
	uint64_t time;     /* now, Unix nanoseconds */
	uint64_t interval; /* the host's tick period, nanoseconds */
	uint64_t reserved0;
	uint64_t reserved1;
} kvhost_tick_request;

/* Move, 16 bytes each from KVHOST_MOVES_OFFSET: the output of kvhost_tick. */
typedef struct kvhost_move {
	uint64_t entry; /* known, unpinned */
	uint32_t mount; /* the target: another mount */
	uint32_t flags; /* 0 */
} kvhost_move;

/* kvhost_rank_record.state values. The host writes KVHOST_RANK_UNSET
 * before the call; a hook that leaves it fails. */
#define KVHOST_RANK_KNOWN 0u
#define KVHOST_RANK_UNKNOWN 1u /* not told of the entry yet: the host ranks it */
#define KVHOST_RANK_UNSET 0xFFFFFFFFu

/* RankRecord, 32 bytes each from offset 0 for kvhost_rank
 * (KVHOST_FEATURE_RANK). rank must depend only on the entry's access
 * history and time (never on the handle, shard or instance), so that every
 * node running the same policy ranks alike: for LRU, the last access time. */
typedef struct kvhost_rank_record {
	uint64_t entry; /* the entry's handle */
	uint64_t time;  /* now, Unix nanoseconds */
	uint64_t rank;  /* out: lower is evicted first, on the scale of Unix ns */
	uint32_t state; /* out: KVHOST_RANK_KNOWN or KVHOST_RANK_UNKNOWN */
	uint32_t reserved;
} kvhost_rank_record;

/* The offsets of docs/abi.md, checked at compile time. */
#define KVHOST_CHECK(type, field, off) \
	_Static_assert(offsetof(type, field) == (off), #type "." #field " is not at offset " #off)
_Static_assert(sizeof(kvhost_namespace_record) == 256, "NamespaceRecord is 256 bytes");
KVHOST_CHECK(kvhost_namespace_record, fingerprint, 8);
KVHOST_CHECK(kvhost_namespace_record, tp_rank, 40);
KVHOST_CHECK(kvhost_namespace_record, mount_count, 48);
KVHOST_CHECK(kvhost_namespace_record, key_bytes, 56);
KVHOST_CHECK(kvhost_namespace_record, model, 64);
KVHOST_CHECK(kvhost_namespace_record, keys_per_file, 192);
KVHOST_CHECK(kvhost_namespace_record, order, 196);
_Static_assert(sizeof(kvhost_name_record) == 368, "NameRecord is 368 bytes");
KVHOST_CHECK(kvhost_name_record, key_hash, 8);
KVHOST_CHECK(kvhost_name_record, fingerprint, 16);
KVHOST_CHECK(kvhost_name_record, tp_rank, 24);
KVHOST_CHECK(kvhost_name_record, mount_count, 28);
KVHOST_CHECK(kvhost_name_record, key, 32);
KVHOST_CHECK(kvhost_name_record, mount, 96);
KVHOST_CHECK(kvhost_name_record, path_len, 100);
KVHOST_CHECK(kvhost_name_record, path, 112);
_Static_assert(sizeof(kvhost_admit_record) == 40, "AdmitRecord is 40 bytes");
KVHOST_CHECK(kvhost_admit_record, ns, 24);
KVHOST_CHECK(kvhost_admit_record, mount, 28);
KVHOST_CHECK(kvhost_admit_record, admit, 32);
_Static_assert(sizeof(kvhost_access_record) == 48, "AccessRecord is 48 bytes");
KVHOST_CHECK(kvhost_access_record, key_hash, 24);
KVHOST_CHECK(kvhost_access_record, kind, 32);
KVHOST_CHECK(kvhost_access_record, mount, 36);
KVHOST_CHECK(kvhost_access_record, ns, 40);
KVHOST_CHECK(kvhost_access_record, hits, 44);
_Static_assert(sizeof(kvhost_evict_request) == KVHOST_VICTIMS_OFFSET, "EvictRequest is 32 bytes");
KVHOST_CHECK(kvhost_evict_request, mount, 16);
_Static_assert(sizeof(kvhost_victim) == 16, "Victim is 16 bytes");
KVHOST_CHECK(kvhost_admit_record, target, 36);
_Static_assert(sizeof(kvhost_mount_record) == 128, "MountRecord is 128 bytes");
KVHOST_CHECK(kvhost_mount_record, capacity, 8);
KVHOST_CHECK(kvhost_mount_record, used, 16);
KVHOST_CHECK(kvhost_mount_record, free, 24);
KVHOST_CHECK(kvhost_mount_record, high, 32);
KVHOST_CHECK(kvhost_mount_record, low, 40);
KVHOST_CHECK(kvhost_mount_record, entries, 48);
KVHOST_CHECK(kvhost_mount_record, device_class, 56);
KVHOST_CHECK(kvhost_mount_record, fs_type, 60);
KVHOST_CHECK(kvhost_mount_record, fs_name, 64);
KVHOST_CHECK(kvhost_mount_record, backend, 80);
_Static_assert(sizeof(kvhost_victim_target) == 8, "VictimTarget is 8 bytes");
_Static_assert(sizeof(kvhost_tick_request) == 32, "TickRequest is 32 bytes");
_Static_assert(sizeof(kvhost_move) == 16, "Move is 16 bytes");
KVHOST_CHECK(kvhost_move, mount, 8);
_Static_assert(sizeof(kvhost_rank_record) == 32, "RankRecord is 32 bytes");
KVHOST_CHECK(kvhost_rank_record, rank, 16);
KVHOST_CHECK(kvhost_rank_record, state, 24);
_Static_assert(KVHOST_SCRATCH_SIZE == KVHOST_MAX_BATCH * sizeof(kvhost_name_record), "scratch holds a full batch of name records");
#undef KVHOST_CHECK

/* Exports a function under the ABI name of a hook. */
#define KVHOST_EXPORT(name) __attribute__((export_name(name), visibility("default")))

/* The one host function: log len UTF-8 bytes at msg at a KVHOST_LOG_*
 * level. The host truncates a message to 1 KiB and rate-limits them. */
__attribute__((import_module("kvhost"), import_name("log"))) void kvhost_log(int32_t level, const char *msg, int32_t len);

/*
 * The hooks. Define each required one with KVHOST_EXPORT and exactly this
 * signature (a wrong signature is refused at load, naming the export):
 *
 *   required:
 *     KVHOST_EXPORT("kvhost_abi_version") int32_t kvhost_abi_version(void);
 *         return KVHOST_ABI_VERSION.
 *     KVHOST_EXPORT("kvhost_features") int64_t kvhost_features(void);
 *         return the KVHOST_FEATURE_* bits of the optional hooks defined.
 *     KVHOST_EXPORT("kvhost_scratch") int32_t kvhost_scratch(int32_t min_bytes);
 *         return the address of an 8-aligned area of at least min_bytes that
 *         stays put for the life of the instance, or 0.
 *     KVHOST_EXPORT("kvhost_init") int32_t kvhost_init(int32_t config_len);
 *         "key=value\n" lines in scratch [0, config_len); kvhost.shard and
 *         kvhost.shards are always present. Return a status.
 *     KVHOST_EXPORT("kvhost_name") int32_t kvhost_name(int32_t n);
 *         fill mount, path_len and path of n kvhost_name_records: a pure
 *         function of the record and the configuration.
 *     KVHOST_EXPORT("kvhost_access") int32_t kvhost_access(int32_t n);
 *         apply n kvhost_access_records in order.
 *     KVHOST_EXPORT("kvhost_evict") int32_t kvhost_evict(int32_t max);
 *         write up to max kvhost_victims from KVHOST_VICTIMS_OFFSET for the
 *         kvhost_evict_request at offset 0; return how many.
 *   with KVHOST_FEATURE_NAMESPACE:
 *     KVHOST_EXPORT("kvhost_namespace") int32_t kvhost_namespace(void);
 *         set keys_per_file and order of the kvhost_namespace_record at 0.
 *   with KVHOST_FEATURE_ADMIT:
 *     KVHOST_EXPORT("kvhost_admit") int32_t kvhost_admit(int32_t n);
 *         set admit (0 or 1) in each of n kvhost_admit_records (and, with
 *         KVHOST_FEATURE_ADMIT_MOUNT, target).
 *   with KVHOST_FEATURE_MOUNTS:
 *     KVHOST_EXPORT("kvhost_mounts") int32_t kvhost_mounts(int32_t n);
 *         n kvhost_mount_records from offset 0: after kvhost_init and the
 *         namespaces, and whenever a mount's description changes.
 *   with KVHOST_FEATURE_TICK:
 *     KVHOST_EXPORT("kvhost_tick") int32_t kvhost_tick(int32_t max);
 *         the kvhost_tick_request at offset 0; write up to max kvhost_moves
 *         from KVHOST_MOVES_OFFSET; return how many.
 *   with KVHOST_FEATURE_RANK:
 *     KVHOST_EXPORT("kvhost_rank") int32_t kvhost_rank(int32_t n);
 *         set rank and state of each of n kvhost_rank_records from offset 0.
 *   with KVHOST_FEATURE_DEMOTE, kvhost_evict also writes, for victim i, the
 *   kvhost_victim_target at KVHOST_VICTIM_TARGETS_OFFSET + 8 * i.
 */
int32_t kvhost_abi_version(void);
int64_t kvhost_features(void);
int32_t kvhost_scratch(int32_t min_bytes);
int32_t kvhost_init(int32_t config_len);
int32_t kvhost_namespace(void);
int32_t kvhost_name(int32_t n);
int32_t kvhost_admit(int32_t n);
int32_t kvhost_access(int32_t n);
int32_t kvhost_evict(int32_t max);
int32_t kvhost_mounts(int32_t n);
int32_t kvhost_tick(int32_t max);
int32_t kvhost_rank(int32_t n);

/* kvhost_key_hash is FNV-1a 64 of len bytes, the key_hash of the records. */
static inline uint64_t kvhost_key_hash(const uint8_t *key, uint32_t len) {
	uint64_t h = UINT64_C(0xcbf29ce484222325);
	for (uint32_t i = 0; i < len; i++) {
		h ^= key[i];
		h *= UINT64_C(0x100000001b3);
	}
	return h;
}

#ifdef __cplusplus
}
#endif

#endif /* KVHOST_POLICY_H */
