"""What the kvhost offloading spec needs of vLLM: feature detection,
fallback types, the spec's options and the namespaces of its keys.

Only vLLM's light ``vllm.v1.kv_offload`` modules are imported, and only when
``detect_spec`` is called. Without vLLM the spec runs with the plain types
below (tests, the GPU check); a vLLM that lacks the full-spec interface this
package was written for is refused with ``UnsupportedVLLM`` naming the
supported window.
"""

import dataclasses
import enum
import hashlib
import importlib
import importlib.util
import json
import os
import types
import typing

from .. import protocol as p
from ..client import Geometry
from ._common import (OffloadingEvent, RequestOffloadingContext, UnsupportedVLLM,  # noqa: F401 (re-exported)
                      daemon_key, dtype_of, get, merge_options, missing_features, pick_medium,
                      scalar as _scalar, unsupported, vllm_installed, vllm_version)

SPEC_WINDOW = (
    "vLLM with the full offloading-spec interface of main 2026-08-17 (commit 017e9f44, between "
    "v0.27 and v0.28) and later releases keeping it: OffloadingSpec(config) with get_manager() "
    "and get_worker(kv_caches: CanonicalKVCaches), a manager with lookup -> LookupResult "
    "(HIT, MISS, RETRY; HIT_PENDING optional), prepare_load/prepare_store -> PrepareStoreOutput, "
    "and a worker with submit_store/submit_load/get_finished -> TransferResult(job_id, success, "
    "transfer_size, transfer_time)/wait")

# Where vLLM keeps the classes the spec uses; the first module that has a
# name wins. Modules that do not exist in a vLLM version are skipped.
_MODULES = ("vllm.v1.kv_offload.base", "vllm.v1.kv_offload.abstract", "vllm.v1.kv_offload.spec",
            "vllm.v1.kv_offload.mediums", "vllm.v1.kv_offload.worker.worker",
            "vllm.v1.kv_offload.worker.base")
_NAMES = ("LookupResult", "PrepareStoreOutput", "TransferResult", "OffloadingEvent",
          "RequestOffloadingContext", "OffloadingSpec", "OffloadingManager", "LoadStoreSpec",
          "GPULoadStoreSpec", "Medium", "OffloadingWorker")


class LookupResult(enum.Enum):
    """Fallback of vLLM's LookupResult (used only without vLLM)."""
    HIT = "hit"
    HIT_PENDING = "hit_pending"
    MISS = "miss"
    RETRY = "retry"


@dataclasses.dataclass
class PrepareStoreOutput:
    """Fallback of vLLM's PrepareStoreOutput."""
    keys_to_store: list
    store_spec: object
    evicted_keys: list


@dataclasses.dataclass
class TransferResult:
    """Fallback of vLLM's TransferResult."""
    job_id: int
    success: bool
    transfer_size: typing.Optional[int] = None
    transfer_time: typing.Optional[float] = None


SPEC_FALLBACK = types.SimpleNamespace(
    name="standalone (vLLM not installed)", LookupResult=LookupResult,
    PrepareStoreOutput=PrepareStoreOutput, TransferResult=TransferResult,
    OffloadingEvent=OffloadingEvent, RequestOffloadingContext=RequestOffloadingContext,
    OffloadingSpec=None, OffloadingManager=None, LoadStoreSpec=None, GPULoadStoreSpec=None,
    Medium=None, OffloadingWorker=None)


def check_spec_api(api):
    """Raises UnsupportedVLLM unless api has what the spec uses."""
    missing = missing_features(api, ("LookupResult", "PrepareStoreOutput", "TransferResult", "OffloadingEvent"),
                               members={"LookupResult": ("HIT", "MISS", "RETRY")},
                               fields={"TransferResult": ("transfer_size", "transfer_time")})
    if api is not SPEC_FALLBACK and getattr(api, "OffloadingSpec", None) is None:
        missing.append("OffloadingSpec")
    if missing:
        raise unsupported(api, missing, SPEC_WINDOW)


def detect_spec():
    """The vLLM classes the spec uses (a namespace); SPEC_FALLBACK without
    vLLM; UnsupportedVLLM for a vLLM outside the window."""
    if not vllm_installed():
        return SPEC_FALLBACK
    found = {}
    for mod in _MODULES:
        try:
            if importlib.util.find_spec(mod) is None:
                continue
            m = importlib.import_module(mod)
        except ImportError:
            continue
        for n in _NAMES:
            if n not in found and getattr(m, n, None) is not None:
                found[n] = getattr(m, n)
    api = types.SimpleNamespace(name=f"vllm {vllm_version()}", **{n: found.get(n) for n in _NAMES})
    check_spec_api(api)
    return api


class KvhostLoadStoreSpec:
    """Where offloaded chunks live for kvhost: the daemon keys and their
    KV-cache groups, in the order vLLM gave them (ordered by group, as GPU
    blocks are). Picklable: it travels from the scheduler to the workers."""

    def __init__(self, keys, groups=None):
        self.keys = [bytes(k) for k in keys]
        self.groups = [int(g) for g in groups] if groups is not None else [0] * len(self.keys)
        if len(self.groups) != len(self.keys):
            raise ValueError(f"kvhost.vllm: {len(self.keys)} keys, {len(self.groups)} groups")

    @staticmethod
    def medium():
        return "KVHOST"

    def __repr__(self):
        return f"KvhostLoadStoreSpec({len(self.keys)} keys)"

    def __eq__(self, other):
        return isinstance(other, KvhostLoadStoreSpec) and (other.keys, other.groups) == (self.keys, self.groups)

    def __reduce__(self):
        return (KvhostLoadStoreSpec, (self.keys, self.groups))


# -- configuration ----------------------------------------------------------

OPTIONS = {
    "socket": None,             # the daemon's socket (default: $KVHOST_SOCKET, ...)
    "namespace": "",            # extra text in the namespace digest
    "pin_lease_s": 600.0,       # lease of every daemon pin (a safety net)
    "hit_window_s": 30.0,       # a pinned key answers HIT this long without a load
    "lookup_wait_s": 0.0,       # how long lookup may block for the daemon's answer
    "stored_ttl_s": 30.0,       # prepare_store skips keys stored this recently
    "miss_ttl_s": 1.0,          # a MISS is answered this long before asking again
    "max_store_keys_inflight": 1 << 16,  # prepare_store answers None beyond
    "job_timeout_s": 120.0,     # worker: wait() gives up on a job after this
    "client_name": "vllm-spec",
    "max_events": 1 << 16,
    "tp_rank": None,            # worker: this worker's TP rank when vLLM cannot say
    "page_bytes": None,         # per-layer page bytes, when the config cannot say
}
IGNORED = {"spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "cpu_bytes_to_use",
           "num_cpu_blocks"}


def vllm_config_of(config):
    """The VllmConfig behind an OffloadingConfig (or a VllmConfig itself)."""
    return get(config, "vllm_config") or config


def extra_config_of(config):
    for path in (("extra_config",), ("kv_connector_extra_config",),
                 ("vllm_config", "kv_transfer_config", "kv_connector_extra_config")):
        v = get(config, *path)
        if isinstance(v, dict):
            return v
    return {}


def options(config):
    extra = extra_config_of(config)
    o = merge_options(extra, OPTIONS, IGNORED, "spec")
    if not o["socket"]:
        from .tier import default_socket
        o["socket"] = default_socket()
    for k in ("pin_lease_s", "hit_window_s", "lookup_wait_s", "stored_ttl_s", "miss_ttl_s", "job_timeout_s"):
        if isinstance(o[k], bool) or not isinstance(o[k], (int, float)) or o[k] < 0:
            raise ValueError(f"kvhost.vllm: {k}: want seconds >= 0, got {o[k]!r}")
    if not 0 < o["hit_window_s"] <= o["pin_lease_s"] / 2:
        raise ValueError(f"kvhost.vllm: hit_window_s: want > 0 and at most half of pin_lease_s "
                         f"({o['pin_lease_s']}), got {o['hit_window_s']!r}")
    if o["miss_ttl_s"] <= 0:
        raise ValueError(f"kvhost.vllm: miss_ttl_s: want seconds > 0 (a MISS must be answered), got {o['miss_ttl_s']!r}")
    if not 1 <= o["pin_lease_s"] <= p.MAX_LEASE_MS / 1000:
        raise ValueError(f"kvhost.vllm: pin_lease_s: want 1..{p.MAX_LEASE_MS // 1000}, got {o['pin_lease_s']!r}")
    for k in ("max_store_keys_inflight", "max_events"):
        if isinstance(o[k], bool) or not isinstance(o[k], int) or o[k] < 1:
            raise ValueError(f"kvhost.vllm: {k}: want an integer >= 1, got {o[k]!r}")
    return o


def blocks_per_chunk(config):
    """GPU blocks per offloaded chunk (one key)."""
    extra = extra_config_of(config)
    gpu = get(vllm_config_of(config), "cache_config", "block_size")
    if isinstance(extra.get("blocks_per_chunk"), int):
        n = extra["blocks_per_chunk"]
    elif isinstance(extra.get("block_size"), int) and isinstance(gpu, int) and gpu > 0:
        if extra["block_size"] % gpu:
            raise ValueError(f"kvhost.vllm: block_size {extra['block_size']} is not a multiple of the "
                             f"GPU block size {gpu}")
        n = extra["block_size"] // gpu
    else:
        n = 1
    if not 1 <= n <= p.MAX_BLOCKS_PER_KEY:
        raise ValueError(f"kvhost.vllm: blocks_per_chunk {n}: want 1..{p.MAX_BLOCKS_PER_KEY}")
    return n


def groups_of(config, opts):
    """Per KV-cache group: (layer names, page bytes per layer per block)."""
    kc = get(config, "kv_cache_config") or get(vllm_config_of(config), "kv_cache_config")
    out = []
    for g in get(kc, "kv_cache_groups") or []:
        names = [str(n) for n in (get(g, "layer_names") or [])]
        page = opts.get("page_bytes") or get(g, "kv_cache_spec", "page_size_bytes")
        if not isinstance(page, int) or page <= 0:
            raise ValueError("kvhost.vllm: cannot tell the page size of KV-cache group "
                             f"{len(out)} (kv_cache_spec.page_size_bytes); set the spec option page_bytes")
        out.append((names, page))
    if not out:
        raise ValueError("kvhost.vllm: the offloading config names no KV-cache groups")
    return out


def parallel_of(config):
    par = get(vllm_config_of(config), "parallel_config")
    tp = get(par, "tensor_parallel_size") or 1
    pp = get(par, "pipeline_parallel_size") or 1
    if pp != 1:
        raise ValueError(f"kvhost.vllm: pipeline parallelism ({pp} stages) is not supported by the "
                         "kvhost offloading spec (a stage's layers are not known to the scheduler)")
    return int(tp)


def describe(config, opts, group, tp_rank):
    """What a key of one group at one TP rank means (JSON-safe)."""
    vc = vllm_config_of(config)
    names, page = groups_of(config, opts)[group]
    par = get(vc, "parallel_config")
    return {
        "format": "kvhost-vllm-spec-v1",
        "model": _scalar(get(vc, "model_config", "model")),
        "dtype": dtype_of(vc),
        "tp_size": parallel_of(config),
        "tp_rank": tp_rank,
        "pcp_size": _scalar(get(par, "prefill_context_parallel_size")),
        "dcp_size": _scalar(get(par, "decode_context_parallel_size")),
        "gpu_block_tokens": _scalar(get(vc, "cache_config", "block_size")),
        "blocks_per_chunk": blocks_per_chunk(config),
        "group": group,
        "layer_names": names,
        "page_bytes": page,
        "hash_algo": _scalar(get(vc, "cache_config", "prefix_caching_hash_algo")),
        "attention_backend": _scalar(get(vc, "attention_config", "backend")),
        "namespace": str(opts.get("namespace") or ""),
    }


def geometry(desc):
    """The daemon geometry of one group at one rank: one plane per layer
    whose block is exactly one page (kv_heads × head_size × 1 byte)."""
    page = desc["page_bytes"]
    if page < 512:
        raise ValueError(f"kvhost.vllm: a page of {page} bytes is below the daemon's 512-byte block minimum")
    head = 1
    while head < 4096 and page % (head * 2) == 0:
        head *= 2
    heads = page // head
    if heads > (1 << 20):
        raise ValueError(f"kvhost.vllm: a page of {page} bytes cannot be declared (want a multiple of "
                         f"{head * 2} bytes)")
    text = json.dumps(desc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    name = str(desc.get("model") or "unknown").encode("ascii", "replace").decode().replace("/", "_")[:64]
    return Geometry(model=f"vllm-spec:{name}:{digest}", layers=len(desc["layer_names"]) or 1,
                    kv_heads=heads, head_size=head, dtype_size=1, tokens_per_block=1,
                    tokens_per_key=desc["blocks_per_chunk"], mla=True,
                    tp_rank=desc["tp_rank"], tp_size=desc["tp_size"])


def key_group(key):
    """The KV-cache group of an OffloadKey: its last 4 bytes, big-endian."""
    return int.from_bytes(bytes(key)[-4:], "big") if len(key) >= 4 else 0


def worker_rank(config, opts):
    """This worker's TP rank: the option, vLLM's parallel state, the
    config's rank, or 0."""
    if isinstance(opts.get("tp_rank"), int):
        return opts["tp_rank"]
    try:
        if importlib.util.find_spec("vllm.distributed.parallel_state") is not None:
            ps = importlib.import_module("vllm.distributed.parallel_state")
            return int(ps.get_tensor_model_parallel_rank())
    except Exception:  # not initialized (tests) or another layout: fall through
        pass
    r = get(vllm_config_of(config), "parallel_config", "rank")
    if isinstance(r, int):
        return r % max(1, parallel_of(config))
    return int(os.environ.get("KVHOST_TP_RANK", "0"))
