"""What KvhostConnector's halves share: its options, its identity and
the daemon geometry of its keys, what travels from the scheduler to the
workers (Transfer, ConnectorMetadata, WorkerMeta), and the daemon
connection both halves keep (_Half). connector.py has the connector
itself; _conn_scheduler.py and _conn_worker.py its two halves."""

import collections.abc
import logging
import dataclasses
import math
import os
import re
import time

from .. import protocol as p
from ..client import Geometry
from . import _conn_groups as groups_
from . import _namespace as ns_
from . import _pages as pages_
from ._common import DAEMON_WAIT_S, check_daemon_wait, check_request_timeout, check_seconds, merge_options
from ._connect import Reconnects
from ._removals import parse_media
from ._split import CostModel, layer_groups  # noqa: F401 (layer_groups: re-exported)

log = logging.getLogger("vllm.kvhost")

IDENTITY_FORMAT = "kvhost-vllm-connector-v1"

CONNECTOR_WINDOW = (
    "vLLM with KVConnectorBase_V1 (vllm.distributed.kv_transfer.kv_connector.v1.base: "
    "get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta, request_finished, "
    "start_load_kv, wait_for_layer_load, save_kv_layer, wait_for_save, get_finished, "
    "get_block_ids_with_load_errors) and build_offloading_config "
    "(kv_connector.v1.offloading.config); run against 017e9f44 and 2f41c894")

# The load rate the split starts from where load_gbps is not given: a
# disk's (DEFAULT_LOAD_GBPS), or, once the daemon says that every mount
# it has is memory (its Stats reply's device classes), a memory mount's
# (below the 26-53 GB/s the H200's pinned and registered paths move).
DEFAULT_LOAD_GBPS = 2.0
MEMORY_LOAD_GBPS = 20.0

# Tokens per key where neither block_size nor blocks_per_chunk is given:
# 128 keys for a 32K-token prompt keep the scheduler's lookup short.
DEFAULT_CHUNK_TOKENS = 256

OPTIONS = {
    "socket": None,             # the daemon's socket (default: $KVHOST_SOCKET, ...)
    "namespace": "",            # extra text in the namespace identity
    "client_name": "vllm-connector",
    "max_tracked_keys": 1 << 16,  # chunks announced stored whose removal is reported (docs/routers.md)
    "mount_media": None,        # {daemon mount index: medium name}: a move between media is reported
    "layers_per_load": 4,       # layers per load job (4: the fastest on the H200; 1: every layer waits only for its own)
    "layer_groups": "ramp",     # "ramp": the first and last load jobs one layer each, the rest layers_per_load; "even"
    "load_job_ms": 25.0,        # one layer per load job where a layer's load takes this long at the learned rate, else layers_per_load (0: always layers_per_load)
    "load_split": "auto",       # "auto": load or recompute; "all": claim every cached token; "off": load nothing
    "load_gbps": None,          # the load rate the split starts from (GB/s, per worker), then measured; None: by the daemon's mounts (MEMORY_LOAD_GBPS where all are memory, else DEFAULT_LOAD_GBPS)
    "load_latency_ms": 1.0,     # a load's fixed cost
    "prefill_us_per_token": 20.0,     # prefill model: linear term (microseconds per token)
    "prefill_ns_per_token2": 1.0,     # prefill model: attention term (ns per token x context token)
    "prefill_fixed_ms": 0.0,    # prefill model: fixed cost of a step
    "split_min_gain": 0.05,     # recompute a cached token only to save more than this fraction of TTFT
    "split_rate_margin": 0.15,  # the split prices a claim's loads at the learned rate less this fraction
    "load_rate_alpha": 0.2,     # EWMA weight of a measured load in the rate
    "load_rate_recover_s": 30.0,  # unmeasured, the learned rate moves half way back to the last good one per this (0: never)
    "tensor_layout": "blocks",  # "blocks": (num_blocks, ...) per layer; "planes": (2, num_blocks, ...)
    "page_layout": None,        # the workers' page byte order ("FLASH_ATTN/NHD"), where not the default's
    "page_bytes": None,         # bytes per layer and GPU block, where the config cannot say
    "pin_lease_s": 60.0,        # lease of the scheduler's pins of keys to load (a safety net)
    "load_timeout_s": 30.0,     # a layer's load not done after this is cancelled; its blocks recomputed
    "job_timeout_s": 120.0,     # a store not done after this is asked to cancel (and waited for)
    "reconnect_s": 1.0,         # after a lost daemon connection, how often to connect again (0: never)
    "request_timeout_s": 30.0,  # how long a request waits for the daemon's reply
    "daemon_wait_s": DAEMON_WAIT_S,  # the longest a vLLM call (start, a layer's load, shutdown) waits on the daemon
    "save": True,               # store newly computed prompt chunks
    "salt_namespaces": None,    # {cache_salt: name}: a request of that salt keeps its keys in namespace name's
}

# A salt namespace's name: it goes into the namespace's model id
# ("vllm-conn@<name>:..."), which a [[budget]] table of the daemon names.
_SALT_NAME = re.compile(r"[A-Za-z0-9._-]{1,32}")

# Namespaces one connection may declare (docs/protocol.md, limits).
_MAX_NAMESPACES = 64

# kv_connector_extra_config keys read by vLLM's build_offloading_config
# (tokens per key), accepted.
VLLM_KEYS = frozenset({"block_size", "blocks_per_chunk", "canonical_layout"})

SPLITS = ("auto", "all", "off")
# Steps whose work the scheduler keeps for their forward passes' times (and
# passes a worker keeps until their events have run).
WORK_STEPS = 64
LAYER_GROUPS = ("ramp", "even")
TENSOR_LAYOUTS = ("blocks", "planes")


def options(extra):
    """The connector's options from kv_connector_extra_config, checked;
    unknown keys are refused by name."""
    if extra is None:
        extra = {}
    o = merge_options(extra, OPTIONS, VLLM_KEYS, "connector")
    if not o["socket"]:
        from .tier import default_socket
        o["socket"] = default_socket()
    check_seconds(o, ("pin_lease_s", "load_timeout_s", "job_timeout_s", "reconnect_s"))
    check_request_timeout(o)
    check_daemon_wait(o)
    for k in ("layers_per_load", "max_tracked_keys"):
        n = o[k]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"kvhost.vllm: {k}: want an integer >= 1, got {n!r}")
    parse_media(o["mount_media"])
    if o["layer_groups"] not in LAYER_GROUPS:
        raise ValueError(f"kvhost.vllm: layer_groups: want one of {', '.join(LAYER_GROUPS)}, got {o['layer_groups']!r}")
    if o["load_split"] not in SPLITS:
        raise ValueError(f"kvhost.vllm: load_split: want one of {', '.join(SPLITS)}, got {o['load_split']!r}")
    if o["tensor_layout"] not in TENSOR_LAYOUTS:
        raise ValueError(f"kvhost.vllm: tensor_layout: want one of {', '.join(TENSOR_LAYOUTS)}, "
                         f"got {o['tensor_layout']!r}")
    if not 1 <= o["pin_lease_s"] <= p.MAX_LEASE_MS / 1000:
        raise ValueError(f"kvhost.vllm: pin_lease_s: want 1..{p.MAX_LEASE_MS // 1000}, got {o['pin_lease_s']!r}")
    for k in ("save",):
        if not isinstance(o[k], bool):
            raise ValueError(f"kvhost.vllm: {k}: want true or false, got {o[k]!r}")
    if not isinstance(o["namespace"], str):
        raise ValueError(f"kvhost.vllm: namespace: want a string, got {o['namespace']!r}")
    salts = o["salt_namespaces"] or {}
    if not isinstance(salts, collections.abc.Mapping):
        raise ValueError(f"kvhost.vllm: salt_namespaces: want a mapping of cache_salt to a name, got {salts!r}")
    for salt, name in salts.items():
        if not isinstance(salt, str) or not salt:
            raise ValueError(f"kvhost.vllm: salt_namespaces: a salt must be a non-empty string, got {salt!r}")
        if not isinstance(name, str) or not _SALT_NAME.fullmatch(name):
            raise ValueError(f"kvhost.vllm: salt_namespaces: the name of a salt must be 1-32 of A-Z a-z 0-9 . _ -, "
                             f"got {name!r}")
    o["salt_namespaces"] = dict(salts)
    pb = o["page_bytes"]
    if pb is not None and (isinstance(pb, bool) or not isinstance(pb, int) or pb <= 0):
        raise ValueError(f"kvhost.vllm: page_bytes: want bytes per layer and GPU block (an integer > 0), got {pb!r}")
    for k in ("load_gbps", "load_latency_ms", "prefill_us_per_token", "prefill_ns_per_token2", "prefill_fixed_ms",
              "split_min_gain", "load_rate_alpha", "load_rate_recover_s", "load_job_ms"):
        v, least = o[k], 0 if k != "load_gbps" else math.ulp(0)
        if k == "load_gbps" and v is None:
            continue  # by the daemon's mounts (start_rate_from_mounts)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not least <= v < 1e12:
            raise ValueError(f"kvhost.vllm: {k}: want a number {'> 0' if least else '>= 0'} and < 1e12, got {v!r}")
    m = o["split_rate_margin"]
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m < 1:
        raise ValueError(f"kvhost.vllm: split_rate_margin: want 0 <= margin < 1, got {m!r}")
    if not 0 < o["load_rate_alpha"] <= 1:
        raise ValueError(f"kvhost.vllm: load_rate_alpha: want 0 < alpha <= 1, got {o['load_rate_alpha']!r}")
    return o


def start_rate_from_mounts(cost, client, o):
    """Where load_gbps is not given (options o) and every mount of the
    daemon client is connected to is memory (its Stats reply's device
    classes), starts cost's rate at MEMORY_LOAD_GBPS: a disk's rate would
    size the first step's jobs one layer each and price a long prefix's
    load above recomputing it; any other mount, DEFAULT_LOAD_GBPS (each
    connection sets it: a daemon restarted on other mounts moves it). A
    daemon that predates the classes, or that does not answer, leaves the
    rate as it is."""
    if o["load_gbps"] is not None:
        return
    try:
        classes = [m.get("device_class") for m in client.stats()["mounts"]]
    except Exception as e:  # noqa: BLE001 - the rate stays; loads measure it
        log.debug("kvhost connector: the daemon's mounts not read (%s): the split starts from %g GB/s", e,
                  cost.load_gbps)
        return
    if not classes or None in classes:
        return  # a daemon that predates the classes
    memory = all(c == "memory" for c in classes)
    # Set at every connection: a daemon restarted on other mounts moves it.
    cost.start_from(MEMORY_LOAD_GBPS if memory else DEFAULT_LOAD_GBPS)
    if memory:
        log.info("kvhost connector: every mount of the daemon is memory: the split starts from %g GB/s "
                 "(load_gbps sets it)", MEMORY_LOAD_GBPS)


def cost_model(o, bytes_per_token, layers=1):
    """The split's CostModel of options o, for bytes_per_token of loads
    cut across layers (the load jobs' layer groups)."""
    gbps = DEFAULT_LOAD_GBPS if o["load_gbps"] is None else o["load_gbps"]
    return CostModel(bytes_per_token, gbps, o["load_latency_ms"] / 1e3, o["prefill_us_per_token"] / 1e6,
                     o["prefill_ns_per_token2"] / 1e9, o["prefill_fixed_ms"] / 1e3, o["split_min_gain"],
                     o["load_rate_alpha"], o["load_rate_recover_s"], layers=layers,
                     layers_per_load=o["layers_per_load"], shape=o["layer_groups"], job_s=o["load_job_ms"] / 1e3,
                     rate_margin=o["split_rate_margin"])


# -- identity ------------------------------------------------------------------


def default_page_layout(environ=None):
    """The page byte order of vLLM's default configuration for this
    connector (which requires no KV cache layout): DEFAULT_BACKEND with
    VLLM_KV_CACHE_LAYOUT, else NHD; never the cross-layer slab (the
    connector does not prefer cross-layer blocks)."""
    env = (os.environ if environ is None else environ).get(ns_.LAYOUT_ENV)
    if env is not None and env not in ns_.LAYOUTS:
        raise ValueError(f"kvhost.vllm: {ns_.LAYOUT_ENV}={env!r}: want NHD or HND (vLLM refuses it too)")
    return ns_.page_layout_text([[ns_.DEFAULT_BACKEND]], env or "NHD", False)


def identity(config, o, kv_cache_config=None):
    """What every key of this engine's connector shares (JSON-safe): the
    tier's and spec's identity rule (model, dtype, tokens per hash and
    key, parallel sizes, KV-cache groups: _namespace.identity) with this
    connector's format, page layout, tensor layout and page size, the
    pipeline stage where there are several (_conn_stages), and, for a
    model of more than one KV-cache group or of one that is not plain
    full attention, each group's spec (kv_groups: kind, window, dtype,
    page size, replicated; _conn_groups). IdentityUnknown names a
    field vLLM did not give; ValueError a model the connector cannot
    serve."""
    layout = o["page_layout"] if o["page_layout"] is not None else default_page_layout()
    ident = ns_.identity(config, IDENTITY_FORMAT, o["namespace"] or "", collapse=False, layout=layout)
    pages_.blocks_per_chunk(config)
    ident["tensor_layout"] = o["tensor_layout"]
    kvg = groups_.from_vllm(kv_cache_config, config, o)
    if kvg is None or (len(kvg) == 1 and kvg[0].kind == groups_.FULL and not kvg[0].replicated):
        n = len(pages_.groups(ident))
        if n != 1:
            raise ValueError(f"kvhost.vllm: this model has {n} KV-cache groups: KvhostConnector needs vLLM's "
                             "KVCacheConfig (its third constructor argument) to tell them apart")
        ident["page_bytes"] = pages_.page_bytes(config, o)
        pages = [ident["page_bytes"]]
    else:
        ident["kv_groups"] = [{**dataclasses.asdict(g), "layer_names": list(g.layer_names)} for g in kvg]
        ident["page_bytes"] = kvg[0].page_bytes
        pages = [g.page_bytes for g in kvg if g.kind != groups_.STATE]
    if groups_.stages(config) > 1:
        # A pipeline stage's keys are its layers' (_conn_stages).
        ident["stage"] = groups_.place(config)[0]
    if o["tensor_layout"] == "planes":
        for pb in pages:
            if pb % 2:
                raise ValueError(f"kvhost.vllm: a page of {pb} bytes cannot be split into K and V planes")
    return ident


def geometry(ident, shard, salt_ns=None, group=0):
    """The daemon geometry of the connector's keys of one KV-cache group
    at one worker shard: one layer per layer of the group, one plane per
    layer ("blocks" tensors, and state groups: a block's page is one
    extent) or two ("planes": K and V apart), each block a page's share
    in bytes, blocks_per_chunk blocks per key (one for a state group).
    A replicated group has one namespace (shard 0's) for every rank.
    With salt_ns (a salt_namespaces name) the namespace of that name's
    requests: model id "vllm-conn@<salt_ns>:...", which a budget of the
    daemon can name apart."""
    g = groups_.groups(ident)[group]
    planes = 2 if ident["tensor_layout"] == "planes" and g.kind != groups_.STATE else 1
    heads, head = ns_.block_shape(g.page_bytes // planes, "page")
    f = ident["fields"]
    shard, tp = (0, 1) if g.replicated else (shard, f["tp_size"] * f["pcp_size"])
    desc = {**ident, "group": group, "shard": shard}
    prefix = "vllm-conn"
    if salt_ns is not None:
        desc["salt_namespace"] = salt_ns
        prefix = f"vllm-conn@{salt_ns}"
    return Geometry(model=ns_.model_id(desc, prefix), layers=len(g.layer_names),
                    kv_heads=heads, head_size=head, dtype_size=1, tokens_per_block=1,
                    tokens_per_key=g.blocks_per_key(pages_.chunk_blocks(ident)), mla=planes == 1, tp_rank=shard,
                    tp_size=tp)


def offloading_config(vllm_config, kv_cache_config, extra):
    """vLLM's OffloadingConfig of the engine (what the spec and the tier
    name their identity from), built by vLLM's own build_offloading_config,
    with DEFAULT_CHUNK_TOKENS tokens per key where the options name none."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
    config = build_offloading_config(vllm_config, kv_cache_config)
    if "block_size" not in extra and "blocks_per_chunk" not in extra:
        tpb = {g.tokens_per_block for g in config.groups}
        if len(tpb) == 1 and DEFAULT_CHUNK_TOKENS % next(iter(tpb)) == 0:
            cache = dataclasses.replace(config.cache, blocks_per_chunk=DEFAULT_CHUNK_TOKENS // next(iter(tpb)))
            config = dataclasses.replace(config, cache=cache)
    return config


# -- what travels from the scheduler to the workers ------------------------------


class Transfer:
    """One request's keys of one KV-cache group to load or to save this
    step, and per key the GPU block ids (NO_BLOCK for a block the load
    leaves out: already on the GPU, or outside a sliding window). ns: the
    salt_namespaces name whose namespace holds the keys (None: the
    engine's own); group: the KV-cache group's index. Picklable."""
    __slots__ = ("req_id", "keys", "blocks", "ns", "group")

    def __init__(self, req_id, keys, blocks, ns=None, group=0):
        self.req_id, self.keys, self.blocks = req_id, list(keys), [list(b) for b in blocks]
        self.ns, self.group = ns, int(group)

    def __reduce__(self):
        return (Transfer, (self.req_id, self.keys, self.blocks, self.ns, self.group))

    def __repr__(self):
        return f"Transfer({self.req_id!r}, {len(self.keys)} keys, group {self.group})"


class ConnectorMetadata:
    """The scheduler's word to the workers for one step (what
    build_connector_meta returns and bind_connector_metadata takes): loads
    and saves (lists of Transfer), the ids of requests preempted this step,
    the step's number (its loads' end is reported back with it; 0 for
    metadata built by hand), and errors: GPU block ids the workers report
    as load errors at once (a claim one of whose groups could not be
    loaded: vLLM recomputes from there); layers_per_load: the layers in
    each of the step's load jobs, sized by the scheduler's cost model to
    the load's bytes and the learned rate (0: the workers' option).
    Picklable."""

    def __init__(self, loads=(), saves=(), preempted=(), step=0, errors=(), layers_per_load=0):
        self.loads, self.saves, self.preempted = list(loads), list(saves), set(preempted)
        self.step = int(step)
        self.errors = list(errors)
        self.layers_per_load = int(layers_per_load)  # of the step's load jobs (0: the workers' option)

    def __reduce__(self):
        return (ConnectorMetadata, (self.loads, self.saves, self.preempted, self.step, self.errors,
                                    self.layers_per_load))


class WorkerMeta:
    """What a worker tells the scheduler after a step
    (build_connector_worker_meta): the steps whose loads ended (their pins
    can go), the bytes the loads moved and the seconds they took, for the
    split's load rate, and computes, (step, seconds) of forward passes
    without loads the worker timed, for its prefill model, and latencies,
    (step, seconds) of the loads' fixed costs (each step's first layer
    group's time beyond its bytes at the rate of the rest), for the
    split's load latency; loaders,
    the workers whose bytes nbytes sums (1 for one that loaded). vLLM
    joins the workers' (aggregate)."""

    def __init__(self, nbytes=0, seconds=0.0, steps=(), computes=(), latencies=(), loaders=None):
        self.nbytes, self.seconds, self.steps = int(nbytes), float(seconds), tuple(steps)
        self.computes = tuple((int(s), float(t)) for s, t in computes)
        self.latencies = tuple((int(s), float(t)) for s, t in latencies)
        self.loaders = int(loaders) if loaders is not None else int(self.nbytes > 0)

    def aggregate(self, other):
        """Both workers' bytes and loaders, the slower one's time, either's
        steps, and per step the slower worker's forward pass and load
        latency (ranks run in step: one measurement per step)."""
        def slower(a, b):
            per = dict(a)
            for s, t in b:
                per[s] = max(t, per.get(s, 0.0))
            return sorted(per.items())
        return WorkerMeta(self.nbytes + other.nbytes, max(self.seconds, other.seconds),
                          sorted(set(self.steps) | set(other.steps)), slower(self.computes, other.computes),
                          slower(self.latencies, other.latencies), self.loaders + other.loaders)

    def __reduce__(self):
        return (WorkerMeta, (self.nbytes, self.seconds, self.steps, self.computes, self.latencies, self.loaders))



class _Half(Reconnects):
    """What the scheduler and worker halves share: one daemon connection
    (_client), connected again after a loss (Reconnects), and its close."""

    _client = None

    def _current(self):
        return self._client

    def _usable(self):
        """The connection in use, None where there is none: never
        connected, lost (a thread connects again), or found closed by the
        daemon now (then marked lost, which starts that thread)."""
        client = self._client
        if client is None or self._broken is not None:
            return None
        if not client.connected():
            with self._cv:
                self._lost_locked(client, "the daemon closed the connection")
            return None
        return client

    def _close(self, until=None):
        """Stops connecting again and closes the connection; a connection
        try under way is waited for until until (monotonic; None: now
        plus daemon_wait_s). Idempotent."""
        with self._cv:
            if self._closing:
                return
            self._closing = True
            self._cv.notify_all()
        self._join_reconnectors(until if until is not None else time.monotonic() + self._opts["daemon_wait_s"])
        with self._lock:
            client = self._client
        if client is not None:
            client.close()




# The worker counters vLLM's KV-transfer stats carry (get_kv_connector_stats).
STAT_KEYS = ("load_jobs", "load_keys", "load_failed_keys", "bytes_loaded", "load_seconds", "store_jobs", "store_keys",
             "stored_keys", "present_keys", "store_failed_jobs", "bytes_stored")

