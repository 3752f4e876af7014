"""What the kvhost offloading spec needs of vLLM: feature detection,
fallback types, the spec's options and the namespaces of its keys.

Only vLLM's light ``vllm.v1.kv_offload`` modules are imported, and only when
``detect_spec`` is called. Without vLLM the spec runs with the plain types
below (tests, the GPU check); a vLLM that lacks the full-spec interface this
package was written for is refused with ``UnsupportedVLLM`` naming the
supported window.

The namespace of a key — one per (KV-cache group, worker shard) — is built
from what vLLM hands every offloading spec: its ``OffloadingConfig``
(``describe``), and the page layout its workers must have (the
``page_layout`` option, else the default configuration's, with
``VLLM_KV_CACHE_LAYOUT``), which every worker checks. A field that separates models and cannot be read refuses
the spec with ``IdentityUnknown`` naming it: vLLM's block hashes of one
prompt are equal across models, so a guessed identity would hand one
model's KV to another.
"""

import collections.abc
import dataclasses
import enum
import hashlib
import importlib
import importlib.util
import types
import typing

from .. import protocol as p
from ..client import Geometry
from . import _namespace as ns_
from ._common import (DAEMON_WAIT_S, OffloadingEvent, RequestOffloadingContext,  # noqa: F401 (re-exported)
                      UnsupportedVLLM, check_daemon_wait, check_request_timeout, check_seconds, daemon_key,
                      merge_options, missing_features, pick_medium, unsupported, vllm_installed, vllm_version)
from ._compat import stats_class
from ._pages import blocks_per_chunk, chunk_blocks, groups, page_bytes  # noqa: F401 (re-exported)
from ._namespace import IdentityUnknown  # noqa: F401 (re-exported)
from ._removals import parse_media

SPEC_WINDOW = (
    "vLLM with the full offloading-spec interface of v0.26.0 (2026-07-26; run against v0.26.0, "
    "a123159f, 017e9f44 and 2f41c894) and later releases keeping it: OffloadingSpec(config: OffloadingConfig) with "
    "get_manager() and get_worker(kv_caches: CanonicalKVCaches), a manager with lookup -> "
    "LookupResult (HIT, MISS, RETRY; HIT_PENDING optional), prepare_load/prepare_store -> "
    "PrepareStoreOutput, and a worker with submit_store/submit_load/get_finished -> "
    "TransferResult(job_id, success, transfer_size, transfer_time)/wait")

# Where vLLM keeps the classes the spec uses; the first module that has a
# name wins. Modules that do not exist in a vLLM version are skipped.
_MODULES = ("vllm.v1.kv_offload.base", "vllm.v1.kv_offload.abstract", "vllm.v1.kv_offload.spec",
            "vllm.v1.kv_offload.mediums", "vllm.v1.kv_offload.worker.worker",
            "vllm.v1.kv_offload.worker.base")
_NAMES = ("LookupResult", "PrepareStoreOutput", "TransferResult", "OffloadingEvent",
          "RequestOffloadingContext", "OffloadingSpec", "OffloadingManager", "LoadStoreSpec",
          "GPULoadStoreSpec", "Medium", "OffloadingWorker", "OffloadingCounterMetadata",
          "OffloadingGaugeMetadata")


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
    Medium=None, OffloadingWorker=None, OffloadingConnectorStats=None,
    OffloadingCounterMetadata=None, OffloadingGaugeMetadata=None)


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
    # The class get_stats must return (vLLM calls is_empty() and
    # aggregate() on it every scheduler step): None where this vLLM has none.
    api.OffloadingConnectorStats = stats_class()
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
    "namespace": "",            # extra text in the namespace identity (adds to it, never replaces it)
    "pin_lease_s": 600.0,       # lease of every daemon pin (a safety net)
    "hit_window_s": 30.0,       # a pinned key answers HIT this long without a load
    "lookup_wait_s": 0.0,       # how long lookup may block for the daemon's answer
    "stored_ttl_s": 30.0,       # prepare_store skips keys stored this recently
    "miss_ttl_s": 1.0,          # a MISS is answered this long before asking again
    "max_store_keys_inflight": 1 << 16,  # prepare_store answers None beyond
    "job_timeout_s": 120.0,     # worker: wait() asks to cancel a job not done after this (and waits on)
    "reconnect_s": 1.0,         # after a lost daemon connection, how often to connect again (0: never)
    "request_timeout_s": 30.0,  # how long a request waits for the daemon's reply, a send for its reading
    "daemon_wait_s": DAEMON_WAIT_S,  # the longest start and shutdown wait on the daemon
    "load_retry_s": 30.0,       # worker: a load lost with the connection is loaded again for this long
    "client_name": "vllm-spec",
    "max_events": 1 << 16,      # keys of stored events queued between two take_events calls
    "max_tracked_keys": 1 << 18,  # keys announced stored whose removal is reported (docs/routers.md)
    "mount_media": None,        # {daemon mount index: vLLM Medium name}: a move between media is reported
    "page_bytes": None,         # bytes per layer and GPU block, where the config cannot say
    "page_layout": None,        # the workers' page byte order ("FLASHINFER/HND"), where not the default's
    "metrics": True,            # the manager's counters reported through vLLM's metrics (get_stats)
}

# kv_connector_extra_config keys that are vLLM's own (its connector,
# scheduler, factory and other specs read them): accepted, never ours.
# Block size and blocks per chunk come resolved in config.cache;
# offload_prompt_only and self_describing_kv_events are the connector's;
# canonical_layout comes resolved in config.canonical_layout.
VLLM_KEYS = frozenset({
    "spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "canonical_layout",
    "offload_prompt_only", "self_describing_kv_events", "store_threshold", "max_tracker_size",
    "eviction_policy", "cache_policy_module_path", "cpu_bytes_to_use", "num_cpu_blocks",
    "kv_cache_layout", "max_recompute_pending_tokens", "secondary_tiers", "backpressure",
})

IDENTITY_FORMAT = "kvhost-vllm-spec-v3"


def extra_config_of(config):
    """The spec's options: config.extra_config (vLLM's
    kv_connector_extra_config), {} when it has none."""
    extra = getattr(config, "extra_config", None)
    if extra is None:
        return {}
    if not isinstance(extra, collections.abc.Mapping):
        raise ValueError(f"kvhost.vllm: the offloading config's extra_config is a {type(extra).__name__}, "
                         "not a mapping of options")
    return extra


def options(config):
    """The spec's options from config.extra_config, checked. Keys that are
    vLLM's own are accepted and left to vLLM; any other unknown key is
    refused by name."""
    extra = extra_config_of(config)
    o = merge_options(extra, OPTIONS, VLLM_KEYS, "spec")
    if not o["socket"]:
        from .tier import default_socket
        o["socket"] = default_socket()
    check_seconds(o, ("pin_lease_s", "hit_window_s", "lookup_wait_s", "stored_ttl_s", "miss_ttl_s", "job_timeout_s",
                      "reconnect_s", "load_retry_s"))
    check_request_timeout(o)
    check_daemon_wait(o)
    if not 0 < o["hit_window_s"] <= o["pin_lease_s"] / 2:
        raise ValueError(f"kvhost.vllm: hit_window_s: want > 0 and at most half of pin_lease_s "
                         f"({o['pin_lease_s']}), got {o['hit_window_s']!r}")
    if o["miss_ttl_s"] <= 0:
        raise ValueError(f"kvhost.vllm: miss_ttl_s: want seconds > 0 (a MISS must be answered), got {o['miss_ttl_s']!r}")
    if not 1 <= o["pin_lease_s"] <= p.MAX_LEASE_MS / 1000:
        raise ValueError(f"kvhost.vllm: pin_lease_s: want 1..{p.MAX_LEASE_MS // 1000}, got {o['pin_lease_s']!r}")
    for k in ("max_store_keys_inflight", "max_events", "max_tracked_keys"):
        if isinstance(o[k], bool) or not isinstance(o[k], int) or o[k] < 1:
            raise ValueError(f"kvhost.vllm: {k}: want an integer >= 1, got {o[k]!r}")
    pb = o["page_bytes"]
    if pb is not None and (isinstance(pb, bool) or not isinstance(pb, int) or pb <= 0):
        raise ValueError(f"kvhost.vllm: page_bytes: want bytes per layer and GPU block (an integer > 0), "
                         f"got {pb!r}")
    if not isinstance(o["metrics"], bool):
        raise ValueError(f"kvhost.vllm: metrics: want true or false, got {o['metrics']!r}")
    if not isinstance(o["namespace"], str):
        raise ValueError(f"kvhost.vllm: namespace: want a string, got {o['namespace']!r}")
    if o["page_layout"] is not None:
        ns_.page_layout(config, o["page_layout"])  # its form, checked
    parse_media(o["mount_media"])  # its form; the names are checked against vLLM's Medium at start
    return o


def shards(config):
    """How many workers hold a different part of each block: tp × pcp
    (every rank stores its own shard; pipeline parallelism is refused)."""
    tp = ns_.count(config, "parallel.tp_size", "tp size")
    pp = ns_.count(config, "parallel.pp_size", "pp size")
    pcp = ns_.count(config, "parallel.pcp_size", "pcp size")
    ns_.count(config, "parallel.dcp_size", "dcp size")
    if pp != 1:
        raise ValueError(f"kvhost.vllm: pipeline parallelism ({pp} stages) is not supported by the "
                         "kvhost offloading spec (a stage's layers are not known to the scheduler)")
    return tp * pcp


def shard_of(config):
    """This worker's shard: config.parallel.rank within its engine's
    tp × pcp workers (0 on the scheduler)."""
    n = shards(config)
    rank = ns_.count(config, "parallel.rank", "worker rank", least=0)
    world = ns_.count(config, "parallel.world_size", "world size")
    if rank >= world:
        raise IdentityUnknown(f"kvhost.vllm: the offloading config's parallel.rank {rank} is not below its "
                              f"world_size {world}; refusing to share KV under a guessed identity")
    return rank % n


def identity(config, opts):
    """The fields every namespace of this engine shares (JSON-safe): the
    tier's identity rule (_namespace.identity) with the parallel sizes not
    collapsed (each shard stores its own bytes), the page layout the
    workers must have (the option page_layout, else the default
    configuration's: _namespace.page_layout) and the page size. The engine
    id is left out (engines of one model share)."""
    blocks_per_chunk(config)  # within the daemon's bound
    ident = ns_.identity(config, IDENTITY_FORMAT, opts.get("namespace") or "", collapse=False,
                         layout=opts.get("page_layout"))
    ident["page_bytes"] = page_bytes(config, opts)
    return ident


def engine_group(config):
    """The daemon group (Group, PinLoadable) of this engine's workers:
    vLLM's engine_id, the same in the scheduler and every worker of one
    engine and distinct per data-parallel rank; its SHA-256 in hex where
    it is longer than a group may be. "" (any engine's workers) for a
    vLLM whose OffloadingConfig has none."""
    eid = getattr(config, "engine_id", None)
    if not isinstance(eid, str) or not eid:
        return ""
    b = eid.encode()
    return eid if len(b) <= p.MAX_GROUP_LEN else hashlib.sha256(b).hexdigest()


def describe(ident, group, shard):
    """What a key of one group at one worker shard means (JSON-safe)."""
    return {**ident, "group": group, "shard": shard}


def geometry(desc):
    """The daemon geometry of one group at one shard: one plane per layer
    whose block is exactly one page (kv_heads × head_size × 1 byte); the
    model id carries a digest of the whole description."""
    heads, head = ns_.block_shape(desc["page_bytes"], "page")
    f = desc["fields"]
    return Geometry(model=ns_.model_id(desc, "vllm-spec"), layers=len(groups(desc)[desc["group"]]["layer_names"]),
                    kv_heads=heads, head_size=head, dtype_size=1, tokens_per_block=1,
                    tokens_per_key=chunk_blocks(desc), mla=True,
                    tp_rank=desc["shard"], tp_size=f["tp_size"] * f["pcp_size"])


def key_group(key):
    """The KV-cache group of an OffloadKey: its last 4 bytes, big-endian."""
    return int.from_bytes(bytes(key)[-4:], "big") if len(key) >= 4 else 0
