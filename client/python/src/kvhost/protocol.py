"""The kvhost wire format (docs/protocol.md): frames and message bodies.

Every integer is little-endian. A frame is a 16-byte header
(u32 body length, u16 type, u16 flags = 0, u64 request id) and its body.
"""

import operator
import struct

# The newest protocol version this client speaks, and the oldest: a daemon
# that refuses VERSION (one older than version 2) is spoken to in
# MIN_VERSION, and announces no features then.
VERSION = 2
MIN_VERSION = 1
MAGIC = b"KVHOST\x00\x01"
HEADER = struct.Struct("<IHHQ")
HEADER_SIZE = HEADER.size

MAX_KEY_LEN = 64
MAX_MODEL_LEN = 128
MAX_KEYS_PER_REQUEST = 4096
MAX_BLOCKS_PER_KEY = 4096
# A Load's block id that leaves that block of the key out: the key's other
# blocks are loaded, and the daemon still reads and verifies the whole key.
# Refused in a Store, and for a key whose every block is NO_BLOCK.
NO_BLOCK = 0xFFFFFFFF
MAX_LAYERS = 4096
MIN_FRAME = 64 << 10
MAX_FRAME = 1 << 30

T_HELLO = 0x0001
T_REGISTER_MEMORY = 0x0002
T_UNREGISTER_MEMORY = 0x0003
T_DECLARE = 0x0004
T_REGISTER_CACHE = 0x0005
T_UNREGISTER_CACHE = 0x0006
T_LOOKUP = 0x0007
T_STORE = 0x0008
T_LOAD = 0x0009
T_CANCEL = 0x000A
T_DELETE = 0x000B
T_STATS = 0x000C
T_UNDECLARE = 0x000D
T_PIN = 0x000E
T_UNPIN = 0x000F
T_LOOKUP_TABLE = 0x0010
T_PURGE = 0x0011
T_PIN_LOADABLE = 0x0012
T_GROUP = 0x0013
T_LOAD_LAYERS = 0x0014  # a Load of a layer range of every key (version 2)
T_SUBSCRIBE_REMOVALS = 0x0015  # a removal stream (version 2, FEATURE_REMOVALS)
T_UNSUBSCRIBE_REMOVALS = 0x0016
T_REMOVALS = 0x4002  # a removal stream's event (request id 0)
T_REPLY = 0x8000
T_ERROR = 0xFFFF
T_COMPLETION = 0x4001

MAX_LEASE_MS = 24 * 60 * 60 * 1000
PIN_MISSING, PIN_HELD = 0, 1
PIN_NO_CACHE = 2  # PinLoadable: no cache of the namespace is registered
MAX_GROUP_LEN = 64

# Bits of a version-2 Welcome's features: what the daemon serves beyond
# version 1.
FEATURE_LAYER_LOADS = 1 << 0  # LoadLayers
FEATURE_REMOVALS = 1 << 1  # SubscribeRemovals, UnsubscribeRemovals, Removals events

# A removal's reasons (docs/protocol.md, "Removal streams"), by their
# protocol numbers.
REMOVAL_REASONS = {1: "evicted", 2: "cluster-evicted", 3: "deleted", 4: "purged", 5: "corrupt",
                   6: "vanished", 7: "moved"}
NO_REMOVAL_MOUNT = 0xFFFF  # a removal's "to" mount where it is not a move
MAX_REMOVAL_BATCH = 4096

MEMORY_MEMFD = 1
MEMORY_CUDA_IPC = 2
MEMORY_SHARED = 3

JOB_STORE = 1
JOB_LOAD = 2

OUTCOMES = ["pending", "stored", "present", "not admitted", "loaded", "missing", "failed", "cancelled"]
OUTCOME_STORED, OUTCOME_PRESENT, OUTCOME_NOT_ADMITTED = 1, 2, 3
OUTCOME_LOADED, OUTCOME_MISSING, OUTCOME_FAILED, OUTCOME_CANCELLED = 4, 5, 6, 7

CODES = ["ok", "malformed", "unsupported version", "unknown type", "handshake required",
         "limit exceeded", "unknown region", "unknown namespace", "unknown cache",
         "invalid argument", "unsupported", "descriptor missing", "bad descriptor", "in use",
         "no space", "not found", "corrupt", "policy failure", "shutting down", "cancelled",
         "internal error", "timed out", "bad IPC handle", "destination changed"]
CODE_VERSION, CODE_UNKNOWN_TYPE, CODE_LIMIT, CODE_UNSUPPORTED = 2, 3, 5, 10
# Per key of a load: the client's own destination blocks changed while the
# daemon wrote them; the file verifies and stays (docs/protocol.md, Errors).
CODE_DESTINATION_CHANGED = 23


def code_name(code):
    """The name of an error code; a code past the last this client knows
    (a newer daemon's) is named by its number, code(N): still an error."""
    return CODES[code] if 0 <= code < len(CODES) else f"code({code})"


STATS_FIELDS = ["entries", "keys", "stores", "loads", "hits", "misses", "evictions", "failures",
                "corrupt", "vanished", "bytes_written", "bytes_read", "clients", "regions",
                "caches", "inflight_jobs"]


class ProtocolError(Exception):
    """The daemon sent something this client cannot decode."""


NAMES = {T_HELLO: "Hello", T_REGISTER_MEMORY: "RegisterMemory", T_UNREGISTER_MEMORY: "UnregisterMemory",
         T_DECLARE: "Declare", T_REGISTER_CACHE: "RegisterCache", T_UNREGISTER_CACHE: "UnregisterCache",
         T_LOOKUP: "Lookup", T_STORE: "Store", T_LOAD: "Load", T_CANCEL: "Cancel", T_DELETE: "Delete",
         T_STATS: "Stats", T_UNDECLARE: "Undeclare", T_PIN: "Pin", T_UNPIN: "Unpin",
         T_LOOKUP_TABLE: "LookupTable", T_PURGE: "Purge", T_PIN_LOADABLE: "PinLoadable",
         T_GROUP: "Group", T_LOAD_LAYERS: "LoadLayers", T_SUBSCRIBE_REMOVALS: "SubscribeRemovals",
         T_UNSUBSCRIBE_REMOVALS: "UnsubscribeRemovals"}

# The fixed part of each reply's body (docs/protocol.md); a string after it
# (str8 or str16) or per-key bytes (Pinned) are checked by reply_problem.
_REPLY_SIZES = {T_HELLO: 33, T_REGISTER_MEMORY: 16, T_UNREGISTER_MEMORY: 0, T_DECLARE: 24,
                T_REGISTER_CACHE: 4, T_UNREGISTER_CACHE: 0, T_LOOKUP: 4, T_STORE: 8, T_LOAD: 8,
                T_CANCEL: 1, T_DELETE: 4, T_STATS: 132, T_UNDECLARE: 0, T_PIN: 12, T_UNPIN: 4,
                T_LOOKUP_TABLE: 2, T_PURGE: 40, T_PIN_LOADABLE: 12, T_GROUP: 0, T_LOAD_LAYERS: 8,
                T_SUBSCRIBE_REMOVALS: 22, T_UNSUBSCRIBE_REMOVALS: 0}


def reply_problem(asked, ftype, body):
    """What makes body, of a frame of type ftype answering a request of
    type asked, too short to decode; None where it is long enough (bytes
    after what this client reads are left to newer daemons)."""
    n = len(body)
    if ftype == T_ERROR:
        want = 4 + (struct.unpack_from("<H", body, 2)[0] if n >= 4 else 0)
    elif ftype == asked | T_REPLY and asked in _REPLY_SIZES:
        want = _REPLY_SIZES[asked]
        if n >= want:
            if asked == T_HELLO:
                want += body[32]
            elif asked in (T_PIN, T_PIN_LOADABLE):
                want += struct.unpack_from("<I", body, 8)[0]
            elif asked == T_LOOKUP_TABLE:
                want += struct.unpack_from("<H", body)[0]
    else:
        return None  # not this request's reply: the caller's error (_refusal)
    if n >= want:
        return None
    what = "Error" if ftype == T_ERROR else "reply"
    return f"{what} of {n} bytes to {NAMES.get(asked, hex(asked))}: want {want}"


def frame(ftype, req_id, body):
    """Returns the bytes of one frame."""
    return HEADER.pack(len(body), ftype, 0, req_id) + body


# What each integer code of struct holds, for pack's messages.
_RANGES = {"B": (0, (1 << 8) - 1), "H": (0, (1 << 16) - 1), "I": (0, (1 << 32) - 1),
           "Q": (0, (1 << 64) - 1), "q": (-(1 << 63), (1 << 63) - 1)}


def pack(fmt, values, names):
    """struct.pack(fmt, *values), where a value that is not an int, or that
    its field cannot hold, raises TypeError or ValueError naming the field:
    names[i] (or names(i) where names is callable) is value i's. fmt is
    "<" and integer codes, each with an optional count, and pads (x)."""
    try:
        return struct.pack(fmt, *values)
    except struct.error:
        pass
    codes, count = [], ""
    for ch in fmt.lstrip("<"):
        if ch.isdigit():
            count += ch
            continue
        if ch != "x":
            codes += [ch] * int(count or 1)
        count = ""
    for i, (code, v) in enumerate(zip(codes, values)):
        name = names(i) if callable(names) else names[i]
        try:
            v = operator.index(v)
        except TypeError:
            raise TypeError(f"{name}: {type(v).__name__}, not an int") from None
        lo, hi = _RANGES[code]
        if not lo <= v <= hi:
            raise ValueError(f"{name} {v}: want {lo}..{hi}")
    return struct.pack(fmt, *values)  # what failed is not a field's: struct's own error


def _key_view(i, k):
    """Key i's bytes as a memoryview; TypeError for what is not bytes-like
    (bytes(5) would be five zero bytes: an int is no key)."""
    try:
        return memoryview(k)
    except TypeError:
        raise TypeError(f"key {i}: {type(k).__name__}, not bytes-like (bytes, bytearray, memoryview)") from None


def check_keys(keys):
    """Raises ValueError (TypeError for a key that is not bytes-like)
    where keys_body would, without encoding them: a key's length is its
    bytes' (an array of 8-byte items counts 8 per item)."""
    if not 1 <= len(keys) <= MAX_KEYS_PER_REQUEST:
        raise ValueError(f"{len(keys)} keys: want 1..{MAX_KEYS_PER_REQUEST}")
    for i, k in enumerate(keys):
        n = len(k) if type(k) is bytes else _key_view(i, k).nbytes
        if not 1 <= n <= MAX_KEY_LEN:
            raise ValueError(f"key of {n} bytes: want 1..{MAX_KEY_LEN}")


def keys_body(keys):
    if not 1 <= len(keys) <= MAX_KEYS_PER_REQUEST:
        raise ValueError(f"{len(keys)} keys: want 1..{MAX_KEYS_PER_REQUEST}")
    parts = [struct.pack("<I", len(keys))]
    for i, k in enumerate(keys):
        if type(k) is not bytes:
            k = _key_view(i, k).tobytes()
        if not 1 <= len(k) <= MAX_KEY_LEN:
            raise ValueError(f"key of {len(k)} bytes: want 1..{MAX_KEY_LEN}")
        parts.append(bytes([len(k)]))
        parts.append(k)
    return b"".join(parts)


def hello(name, version=VERSION):
    n = name.encode()[:64]
    return MAGIC + struct.pack("<HH", version, 0) + bytes([len(n)]) + n


def register_memory(kind, size, device=0, offset=0, handle=b""):
    handle = bytes(handle).ljust(64, b"\x00")
    if len(handle) != 64:
        raise ValueError("a CUDA IPC handle is 64 bytes")
    return pack("<B3xIQQ", (kind, device, size, offset), ("kind", "device", "size", "offset")) + handle


def group_str8(group, empty_ok):
    """A group name (Group, PinLoadable) as a str8: str (UTF-8) or bytes,
    at most MAX_GROUP_LEN bytes (1.. unless empty_ok)."""
    b = group.encode() if isinstance(group, str) else bytes(group)
    if len(b) > MAX_GROUP_LEN or (not b and not empty_ok):
        raise ValueError(f"group of {len(b)} bytes: want {0 if empty_ok else 1}..{MAX_GROUP_LEN}")
    return bytes([len(b)]) + b


def model_str8(model):
    """A model id as a str8: its length, then its UTF-8 bytes (1..MAX_MODEL_LEN)."""
    m = model.encode()
    if not 1 <= len(m) <= MAX_MODEL_LEN:
        raise ValueError(f"model id of {len(m)} bytes: want 1..{MAX_MODEL_LEN}")
    return bytes([len(m)]) + m


def purge(model=None, fingerprint=None):
    """The body of a Purge of model's namespaces, or of one namespace's
    fingerprint: exactly one of them."""
    if (model is None) == (fingerprint is None):
        raise ValueError("purge: give exactly one of model and fingerprint")
    if model is None:
        return pack("<QB", (fingerprint, 0), ("fingerprint", "model length"))
    return pack("<Q", (0,), ("fingerprint",)) + model_str8(model)


def declare(g):
    return model_str8(g.model) + pack(
        "<9I", (g.layers, g.kv_heads, g.head_size, g.dtype_size, 1 if g.mla else 0,
                g.tokens_per_block, g.tokens_per_key, g.tp_rank, g.tp_size),
        ("layers", "kv_heads", "head_size", "dtype_size", "mla", "tokens_per_block", "tokens_per_key",
         "tp_rank", "tp_size"))


def register_cache(ns, layers):
    if not 1 <= len(layers) <= MAX_LAYERS:
        raise ValueError(f"{len(layers)} layers: want 1..{MAX_LAYERS}")
    parts = [pack("<II", (ns, len(layers)), ("namespace", "layers"))]
    for i, l in enumerate(layers):
        parts.append(pack("<IIqqq", (l.region, l.num_blocks, l.offset, l.block_stride, l.plane_stride),
                          lambda j: f"layer {i} {_LAYER_FIELDS[j]}"))
    return b"".join(parts)


_LAYER_FIELDS = ("region", "num_blocks", "offset", "block_stride", "plane_stride")


def transfer(cache, keys, blocks, load=False):
    if len(blocks) != len(keys) or not blocks:
        raise ValueError(f"{len(keys)} keys, {len(blocks)} block lists")
    bpk = len(blocks[0])
    if not 1 <= bpk <= MAX_BLOCKS_PER_KEY or any(len(b) != bpk for b in blocks):
        raise ValueError("every key needs the same number (1..4096) of blocks")
    for i, bl in enumerate(blocks):
        skipped = sum(1 for b in bl if b == NO_BLOCK)
        if skipped and not load:
            raise ValueError(f"key {i}: block id NO_BLOCK (0x{NO_BLOCK:08x}) in a store: only a load may leave "
                             "blocks of a key out")
        if skipped == bpk:
            raise ValueError(f"key {i}: every block id is NO_BLOCK (0x{NO_BLOCK:08x}): a load must name at "
                             "least one block of each key")
    flat = [b for bl in blocks for b in bl]
    return (pack("<II", (cache, bpk), ("cache", "blocks per key")) + keys_body(keys)
            + pack(f"<{len(flat)}I", flat, lambda i: f"key {i // bpk} block {i % bpk}"))


def layer_range(layers):
    """The tail of a LoadLayers body: layers (first, count), the layers
    [first, first+count) of every key; count 0 is every layer (first 0).
    ValueError for a range no namespace can have (the daemon checks it
    against the namespace's layers), TypeError for what is no pair of ints."""
    try:
        first, count = layers
    except (TypeError, ValueError):
        raise TypeError(f"layers {layers!r}: want (first, count)") from None
    body = pack("<II", (first, count), ("first layer", "layer count"))
    if count == 0 and first != 0:
        raise ValueError(f"layer range first {first} with count 0: count 0 means every layer, first must be 0 then")
    if first + count > MAX_LAYERS:
        raise ValueError(f"layer range first {first} count {count} ends past layer {MAX_LAYERS} "
                         f"(at most {MAX_LAYERS} layers)")
    return body


def decode_error(body):
    code, _, n = struct.unpack_from("<BBH", body)
    return code, body[4:4 + n].decode(errors="replace")


def decode_welcome(body, version=VERSION):
    """The Welcome answering a Hello of version, as a dict. A Welcome of
    an older version this client speaks (MIN_VERSION up) is read as that
    version's; "features" (FEATURE_* bits) is 0 from a version-1 Welcome,
    and from one that ends before them."""
    f = struct.unpack_from("<HH7I", body)
    n = body[32]
    if not MIN_VERSION <= f[0] <= version:  # another version's frames are not this client's to read
        server = body[33:33 + n].decode(errors="replace")
        raise ProtocolError(f"the daemon {server!r} answered with a Welcome of protocol version {f[0]}; "
                            f"this client speaks version {version}")
    if not MIN_FRAME <= f[2] <= MAX_FRAME:  # the reader takes frames as long as this
        raise ProtocolError(f"max frame {f[2]}: want {MIN_FRAME}..{MAX_FRAME}")
    features = struct.unpack_from("<Q", body, 33 + n)[0] if f[0] >= 2 and len(body) >= 33 + n + 8 else 0
    return {"version": f[0], "max_frame": f[2], "max_registrations": f[3],
            "max_inflight_jobs": f[4], "max_namespaces": f[5], "max_caches": f[6],
            "max_keys": f[7], "max_key_len": f[8], "server": body[33:33 + n].decode(errors="replace"),
            "features": features}


def decode_completion(body):
    job, kind, n, nbytes, dur = struct.unpack_from("<QB3xIQQ", body)
    off = 32
    keys = [(body[off + 2 * i], body[off + 2 * i + 1]) for i in range(n)]
    for i, (outcome, code) in enumerate(keys):
        # Any code (a newer daemon's too), but a key never ends pending,
        # nor failed or cancelled without saying why.
        if not OUTCOME_STORED <= outcome <= OUTCOME_CANCELLED or outcome >= OUTCOME_FAILED and code == 0:
            raise ProtocolError(f"completion of job {job}: key {i}: outcome {outcome} code {code}")
    off += 2 * n
    (mlen,) = struct.unpack_from("<H", body, off)
    msg = body[off + 2:off + 2 + mlen].decode(errors="replace")
    return job, kind, keys, nbytes, dur, msg


def decode_stats(body):
    vals = struct.unpack_from("<16Q", body)
    out = dict(zip(STATS_FIELDS, vals))
    (n,) = struct.unpack_from("<I", body, 128)
    mounts = []
    off = 132
    for _ in range(n):
        cap, used, entries, direct = struct.unpack_from("<QQQB7x", body, off)
        # device_class: the classes section's ("memory", "nvme", ...);
        # None from a daemon that predates it.
        mounts.append({"capacity": cap, "used": used, "entries": entries, "direct": bool(direct),
                       "device_class": None})
        off += 32
    out["mounts"] = mounts
    devices = []
    if len(body) >= off + 4:
        (n,) = struct.unpack_from("<I", body, off)
        off += 4
        for _ in range(n):
            ordinal, regions, registered, limit = struct.unpack_from("<I4xQQQ", body, off)
            devices.append({"ordinal": ordinal, "regions": regions, "registered": registered, "limit": limit})
            off += 32
    out["devices"] = devices
    out["namespaces"] = None  # unknown: a daemon that predates the section
    for d in devices:
        d["uuid"] = None
        d["faults"] = 0
    try:
        off = _skip_daemon_and_spares(body, off)
    except struct.error:
        return out  # a daemon that predates those sections
    if off is not None and len(body) >= off + 4:
        (n,) = struct.unpack_from("<I", body, off)
        off += 4
        if n != len(devices) or len(body) < off + 16 * n:
            return out
        for d in devices:
            uuid = bytes(body[off:off + 16])
            d["uuid"] = uuid if any(uuid) else None
            off += 16
        off += 8  # spare files made ahead
        # The device-faults section: jobs that failed with a sticky CUDA
        # error, per device (the device is broken until the daemon restarts).
        if len(body) >= off + 4:
            (n,) = struct.unpack_from("<I", body, off)
            off += 4
            if n == len(devices) and len(body) >= off + 8 * n:
                for d in devices:
                    (d["faults"],) = struct.unpack_from("<Q", body, off)
                    off += 8
                try:
                    out["namespaces"], end = _decode_namespaces(body, off)
                    classes = _decode_classes(body, end, len(mounts)) if end is not None else None
                except struct.error:
                    classes = None  # cut short: not a reply this client can read
                for m, c in zip(mounts, classes or ()):
                    m["device_class"] = c if c in DEVICE_CLASSES else "unknown"
    return out


# The device classes a daemon names its mounts by (the Stats reply's
# classes section); another name is taken for "unknown".
DEVICE_CLASSES = frozenset({"memory", "nvme", "ssd", "hdd", "network", "unknown"})


def _decode_classes(body, off, mounts):
    """The device class of each of mounts mounts, from a Stats reply whose
    budgets section starts at off (after the caches section), or None
    where the reply ends before the classes section (an older daemon)."""
    if len(body) < off + 12:
        return None  # before the budgets section
    count, _ = struct.unpack_from("<IQ", body, off)
    off += 12
    for _ in range(count):
        off += 5 * 8  # used, budget, floor, over, kept
        (n,) = struct.unpack_from("<B", body, off)  # pattern (str8)
        off += 1 + n
    if len(body) < off + 4:
        return None
    (n,) = struct.unpack_from("<I", body, off)
    off += 4
    if n != mounts:
        return None
    classes = []
    for _ in range(n):
        (k,) = struct.unpack_from("<B", body, off)
        if len(body) < off + 1 + k:
            raise struct.error("mount class cut short")
        classes.append(bytes(body[off + 1:off + 1 + k]).decode("utf-8", "replace"))
        off += 1 + k
    return classes


def _decode_namespaces(body, off):
    """The namespaces section of a Stats reply whose tiering section
    starts at off (after the device faults): ({"list": one dict per
    namespace, the most bytes first, "left_out": how many the daemon did
    not list}, or None where the reply ends before it (an older daemon);
    the offset after the caches section, None where it is absent)."""
    if len(body) <= off:
        return None, None
    off += 5 * 8  # demotions, promotions, moves, move failures, demotion deletes
    (mounts,) = struct.unpack_from("<I", body, off)
    off += 4 + 16 * mounts
    (n,) = struct.unpack_from("<B", body, off)  # fallback policy (str8)
    off += 1 + n
    if len(body) <= off:
        return None, None  # before the mount-failures section
    (mounts,) = struct.unpack_from("<I", body, off)
    off += 4
    for _ in range(mounts):
        off += 24  # since, last, stores
        (n,) = struct.unpack_from("<H", body, off)  # error (str16)
        off += 2 + n
    if len(body) <= off:
        return None, None  # before the namespaces section
    count, left_out = struct.unpack_from("<IQ", body, off)
    off += 12
    listed = []
    for _ in range(count):
        fp, files, keys, size, declared = struct.unpack_from("<QQQQB7x", body, off)
        off += 40
        (n,) = struct.unpack_from("<B", body, off)
        if len(body) < off + 1 + n:
            raise struct.error("namespace model cut short")
        model = bytes(body[off + 1:off + 1 + n]).decode("utf-8", "replace")
        off += 1 + n
        listed.append({"fingerprint": fp, "model": model, "declared": bool(declared),
                       "files": files, "keys": keys, "bytes": size, "caches": 0})
    # The caches section (a daemon that predates it ends before it): the
    # caches registered in each namespace, on all connections.
    end = None
    if len(body) >= off + 4 + 4 * count and struct.unpack_from("<I", body, off)[0] == count:
        for i, ns in enumerate(listed):
            (ns["caches"],) = struct.unpack_from("<I", body, off + 4 + 4 * i)
        end = off + 4 + 4 * count
    return {"list": listed, "left_out": left_out}, end


def _skip_daemon_and_spares(body, off):
    """The offset after the daemon and spares sections of a Stats reply
    that starts them at off, or None where the reply ends before the
    spares section (an older daemon)."""
    if len(body) <= off:
        return None
    off += 8  # start time
    for _ in range(2):  # policy, policy backend (str8)
        (n,) = struct.unpack_from("<B", body, off)
        off += 1 + n
    off += 8  # fallback flag and padding
    (n,) = struct.unpack_from("<H", body, off)  # fallback reason (str16)
    off += 2 + n + 16  # and reloads, reload failures
    (n,) = struct.unpack_from("<H", body, off)  # last reload (str16)
    off += 2 + n + 24  # and in-flight jobs, regions, registered bytes
    (mounts,) = struct.unpack_from("<I", body, off)
    off += 4
    for _ in range(mounts):
        (n,) = struct.unpack_from("<H", body, off)
        off += 2 + n
        for _ in range(2):  # backend, io (str8)
            (n,) = struct.unpack_from("<B", body, off)
            off += 1 + n
        off += 8 + 16  # checksums and padding, configured, reserve
    if len(body) <= off:
        return None
    off += 8  # reused
    (mounts,) = struct.unpack_from("<I", body, off)
    off += 4 + 16 * mounts
    if len(body) < off:
        raise struct.error("spares section cut short")
    return off


def subscribe_removals(epoch, since, namespaces):
    """A SubscribeRemovals body: u64 epoch | u64 since | u32 count | count
    x u32 namespace id (none: every namespace)."""
    namespaces = list(namespaces)
    if len(namespaces) > MAX_KEYS_PER_REQUEST:
        raise ValueError(f"{len(namespaces)} namespaces: at most {MAX_KEYS_PER_REQUEST}")
    return (pack("<QQI", (epoch, since, len(namespaces)), ("epoch", "since", "namespace count"))
            + b"".join(pack("<I", (ns,), ("namespace",)) for ns in namespaces))


def decode_subscribed(body):
    """A RemovalsSubscribed reply: (subscription, epoch, last, [the
    device class of each mount, by the index removals name])."""
    sub, epoch, last, n = struct.unpack_from("<IQQH", body)
    off, mounts = 22, []
    for _ in range(n):
        k = body[off]
        mounts.append(bytes(body[off + 1:off + 1 + k]).decode("utf-8", "replace"))
        off += 1 + k
    if off > len(body):
        raise ProtocolError(f"RemovalsSubscribed of {len(body)} bytes: its {n} mount classes run past it")
    return sub, epoch, last, mounts


_REMOVAL = struct.Struct("<QQBBHHQB")  # seq, fingerprint, reason, pad, mount, to, time, key length


def decode_removals(body):
    """A Removals event: (subscription, resync, last, [(seq, fingerprint,
    reason number, mount, to, time ns, key)]). Bytes after the records
    are refused (the event's length bounds them)."""
    sub, flags, last, n = struct.unpack_from("<IB3xQI", body)
    if flags & ~1 or n > MAX_REMOVAL_BATCH or (flags & 1 and n):
        raise ProtocolError(f"Removals event: flags {flags:#x}, {n} records")
    off, records = 20, []
    for _ in range(n):
        seq, fp, reason, _pad, mount, to, t, klen = _REMOVAL.unpack_from(body, off)
        off += _REMOVAL.size
        if not 1 <= klen <= MAX_KEY_LEN or off + klen > len(body):
            raise ProtocolError(f"Removals event: a key of {klen} bytes at offset {off} of {len(body)}")
        records.append((seq, fp, reason, mount, to, t, bytes(body[off:off + klen])))
        off += klen
    if off != len(body):
        raise ProtocolError(f"Removals event: {len(body) - off} bytes after its {n} records")
    return sub, bool(flags & 1), last, records
